//! allocsim-replay: turns trace events into allocator requests ([`program`]), replays them through
//! the model ([`replay`]), and checks a replay against its recording ([`validate`]).
pub mod program;
pub mod replay;

pub use program::{Op, Program, Request};
pub use replay::{EmptyCacheCalls, ReplayOptions, ReplayOutcome, plausible_placements, recorded_placement, replay};
