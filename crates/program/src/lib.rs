//! allocsim-program: a trace as the program of allocator requests it makes ([`program`]: allocs,
//! frees by request ordinal, deferred frees, release runs; [`initial`]: the state a trace that
//! starts mid-history starts from), its replay through the model ([`replay`]), the trace's own
//! consistency ([`check`]), its OOM entries matched to requests ([`oom`]), blocks live at a point
//! ([`live`]) and the rules of each PyTorch release ([`version`]). What allocsim infers about a
//! trace (budget, pools, the mid-history state, the device) is `allocsim-infer`'s; answering a
//! question end to end is `allocsim-replay`'s.
pub mod check;
pub mod error;
pub mod initial;
pub mod live;
pub mod oom;
pub mod program;
pub mod replay;
pub mod version;
