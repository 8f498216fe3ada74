//! allocsim-infer: what a trace cannot record and allocsim infers, each under a name that says
//! why and a doc comment that names the allocator rule it rests on:
//!
//! * [`budget`]: the memory the job could reserve (a cap set by
//!   `set_per_process_memory_fraction`, or the device's free memory when another process held
//!   some), from the recorded OOMs and segment events;
//! * [`devices`]: the device to answer for;
//! * [`pools`]: the private pools (CUDA graphs, MemPools) a trace's requests went to where the
//!   final segments do not show them;
//! * [`mid_history`]: whether a trace starts mid-history, and [`restore`]: the allocator's state
//!   at its first entry then; [`settle`]: the sizes of the blocks it frees but allocated before it.
pub mod budget;
pub mod devices;
pub mod mid_history;
pub mod pools;
pub mod restore;
pub mod settle;
