//! allocsim-report: what a replay means for the user.
//!
//! * [`frag`]: where reserved-but-unallocated memory is, and fragmentation metrics, for one
//!   allocator state.
//! * [`explain`]: an OOM (or any request, or the peak) explained: the request, the allocator's
//!   steps, the free memory that could not serve it, the blocks pinning it, what would have worked.
//! * [`series`], [`html`]: time series of a replay and the self-contained HTML report.
//! * [`export`]: a simulated run written back as a memory snapshot.
pub mod explain;
pub mod export;
pub mod frag;
pub mod html;
pub mod series;
