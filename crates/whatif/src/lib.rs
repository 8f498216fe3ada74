//! allocsim-whatif: the questions users bring, answered by replays.
//!
//! * [`grid`]: a grid of settings (`key=v1,v2; key2=...`) → the configs it spans, each checked
//!   with PyTorch's own parser.
//! * [`sweep`]: replay a trace under every config of a grid (in parallel) across placements, and
//!   rank the outcomes.
//! * [`fit`]: the smallest allowed maximum (to the 2 MiB) at which a trace runs without OOM.
//! * [`compare`]: two replays side by side on the same request axis.
//! * [`cost`]: the measured cost of device calls, for a time estimate.
pub mod compare;
pub mod cost;
pub mod fit;
pub mod grid;
pub mod sweep;
