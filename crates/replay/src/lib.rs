//! allocsim-replay: answers one replay question end to end ([`run`]: the trace prepared once, with
//! what `allocsim-infer` infers of it, then replayed; in one pass over a stream of entries, in
//! memory bounded by the live set: [`stream`]), checks a replay against its recording
//! ([`validate`]) and tells when the recording changed its settings at run time
//! ([`settings_change`]).
//!
//! The layers below are re-exported under their module names, so that one path reaches each:
//! `allocsim-program`'s ([`program`], [`replay`], [`check`], [`oom`], [`live`], [`version`],
//! [`error`]: the trace as requests and their replay through the model) and `allocsim-infer`'s
//! ([`budget`], [`devices`], [`pools`], [`mid_history`], [`restore`], [`settle`]: what a trace
//! cannot record).
pub mod run;
pub mod settings_change;
pub mod stream;
pub mod validate;

pub use allocsim_infer::{budget, devices, mid_history, pools, restore, settle};
pub use allocsim_program::{check, error, initial, live, oom, program, replay, version};

pub use budget::{Budget, BudgetKind};
pub use program::{Op, PoolAction, Program, Request};
pub use replay::{EmptyCacheCalls, OutsideMemory, ReplayOptions, ReplayOutcome, plausible_placements, recorded_placement, replay, replay_observed, replay_on};
pub use run::{Prepared, ReplaySpec, ReplaySummary, Replayed, RunError, TraceOptions, recorded_config, run};
pub use validate::{Validation, validate};
pub use version::TorchVersion;
