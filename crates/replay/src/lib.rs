//! allocsim-replay: turns trace events into allocator requests ([`program`]), replays them through
//! the model ([`replay`]), answers one replay question end to end ([`run`]; in one pass over a
//! stream of entries, in memory bounded by the live set: [`stream`]), and checks a replay against
//! its recording ([`validate`]).
pub mod budget;
pub mod check;
pub mod devices;
pub mod error;
pub mod live;
pub mod oom;
pub mod pools;
pub mod program;
pub mod replay;
pub mod restore;
pub mod run;
pub mod settings_change;
pub mod settle;
pub mod stream;
pub mod validate;
pub mod version;

pub use budget::{Budget, BudgetKind};
pub use program::{Op, PoolAction, Program, Request};
pub use replay::{EmptyCacheCalls, OutsideMemory, ReplayOptions, ReplayOutcome, plausible_placements, recorded_placement, replay, replay_observed, replay_on};
pub use run::{Prepared, ReplaySpec, ReplaySummary, Replayed, RunError, TraceOptions, recorded_config, run};
pub use validate::{Validation, validate};
pub use version::TorchVersion;
