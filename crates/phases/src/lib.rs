//! Phases of a training run: its iterations and the regions annotated inside them, each with its
//! peaks under the config being replayed — the step whose peak hides under the run's global maximum.
//!
//! * [`layout`]: where the iterations and regions are (trace positions and request ranges), from
//!   the snapshot's `external_annotations` (the optimizer's `Optimizer.step#…` scopes, or any
//!   named `record_function` scope), else from the repeating request pattern. Independent of the
//!   allocator settings.
//! * [`measure`]: one replay (under any config, capacity and placement) measured per iteration and
//!   region: peak allocated and reserved and where they were reached, the live blocks by call site
//!   at each iteration's peak, new segments, OOMs.
//! * [`ranks`]: many snapshots (the ranks of a distributed job, or runs to compare) replayed in
//!   parallel, one row each, their iteration peaks against the median, who ran out or spiked first.

pub mod layout;
pub mod measure;
pub mod ranks;

pub use layout::{IterationSpan, Layout, LayoutError, PhaseAt, RegionSpan, Source, Span};
pub use measure::{Iteration, Phases, Region, SiteBytes, measure};
