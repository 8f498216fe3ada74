//! One replay question, end to end: a snapshot and a spec in, a [`Replayed`] out.
//!
//! This is where the replay semantics that need more than one pass live: the `empty_cache()`
//! calls are inferred by replaying under the trace's own settings, then applied under the
//! requested config; `--addresses-from` and `--placements` choose the device's addresses.

use allocsim_model::AllocatorConfig;
use allocsim_model::Placement;
use allocsim_model::constants::ROUNDUP_INTERVALS;
use allocsim_trace::{Annotation, EntryMeta, Frame, RecordedSettings, Snapshot, SnapshotSegment, TraceEntry};

use crate::budget::{Budget, DeviceMemory};
use crate::devices::{DeviceChoice, DeviceFacts, DeviceReason};
use crate::program::{Program, Request};
use crate::replay::{EmptyCacheCalls, OutsideMemory, ReplayOptions, ReplayOutcome, plausible_placements_from, recorded_placement_from, replay};
use crate::restore::InitialState;
use crate::version::TorchVersion;
use rayon::prelude::*;

/// What to replay, and how.
#[derive(Clone, Debug, Default)]
pub struct ReplaySpec<'a> {
    /// A `PYTORCH_CUDA_ALLOC_CONF` string; `None`: the settings recorded in the snapshot.
    pub config: Option<String>,
    /// The allowed maximum in bytes (`set_per_process_memory_fraction`); `None`: the trace's own
    /// budget, inferred from it (`crate::budget`).
    pub capacity: Option<u64>,
    /// The device's total memory; `None`: as the trace shows it, else an H200's.
    pub device_memory: Option<u64>,
    /// The allowed maximum the trace was recorded under; default: `capacity` when replaying under
    /// the trace's own settings.
    pub trace_capacity: Option<u64>,
    /// Take new segments' addresses from this recorded run of the same requests.
    pub addresses_from: Option<&'a Snapshot>,
    /// Also replay under this many plausible placements.
    pub placements: Option<usize>,
    /// Which device's trace; default: the one that matters ([`crate::devices::choose_device`]).
    pub device: Option<usize>,
    /// The PyTorch release whose allocator rules apply; `None`: chosen from what the snapshot
    /// shows ([`crate::version::Rules::choose`]).
    pub torch_version: Option<TorchVersion>,
}

impl ReplaySpec<'_> {
    /// The trace's own settings (`recorded`) and the config to replay under (`config`, else the
    /// own), as PyTorch `torch_version` parses them.
    pub fn configs(&self, recorded: &RecordedSettings) -> Result<(AllocatorConfig, AllocatorConfig), RunError> {
        self.configs_under(recorded, self.rules(recorded).version)
    }

    /// [`ReplaySpec::configs`] under the release `version` already chosen.
    fn configs_under(&self, recorded: &RecordedSettings, version: TorchVersion) -> Result<(AllocatorConfig, AllocatorConfig), RunError> {
        let own = settings_config(recorded, version)?;
        let config = match &self.config {
            Some(c) => parse_config_for(c, version)?,
            None => own.clone(),
        };
        Ok((own, config))
    }

    /// The trace made ready for this replay (the device chosen, or `given` with its trace), the
    /// trace's own settings and the config to replay under: the one place where a question's
    /// options decide the rules, the settings and the allowed maximum the trace was recorded
    /// under ([`ReplaySpec::trace_capacity_for`]).
    fn prepare(&self, snap: &Snapshot, given: Option<(crate::devices::DeviceChoice, Vec<TraceEntry>)>) -> Result<(Prepared, AllocatorConfig), RunError> {
        let rules = self.rules(&snap.settings);
        let (own, config) = self.configs_under(&snap.settings, rules.version)?;
        // Where were the empty_cache() calls? Decided under the trace's own settings and addresses.
        let trace_capacity = self.trace_capacity_for(&own, &config);
        let (choice, trace) = match given {
            Some(given) => given,
            None => chosen_trace(snap, self.device)?,
        };
        let prepared = Prepared::new_with(snap, choice, trace, self.device_memory, trace_capacity, rules)?;
        Ok((prepared, config))
    }

    /// Which release's rules apply to a trace recorded with `recorded`, and why.
    pub fn rules(&self, recorded: &RecordedSettings) -> crate::version::Rules {
        rules_for(self.torch_version, recorded)
    }

    /// The allowed maximum the trace was recorded under: `trace_capacity`, else `capacity` when
    /// replaying under the trace's own settings.
    pub fn trace_capacity_for(&self, own: &AllocatorConfig, config: &AllocatorConfig) -> Option<u64> {
        self.trace_capacity.or(if same_settings(config, own) { self.capacity } else { None })
    }
}

pub use crate::error::{MAX_PLACEMENTS, RunError};

/// The device to answer for ([`crate::devices::device_for`]: `device`, else the one that
/// matters) and a copy of its trace.
fn chosen_trace(snap: &Snapshot, device: Option<usize>) -> Result<(crate::devices::DeviceChoice, Vec<TraceEntry>), RunError> {
    let choice = crate::devices::device_for(snap, device)?;
    let trace = snap.device_traces.get(choice.device).cloned().unwrap_or_default();
    Ok((choice, trace))
}

/// Which release's rules apply to a trace recorded with `recorded` (`asked`: `--torch-version`),
/// and how its settings string was read ([`settings_in_force`]).
pub fn rules_for(asked: Option<TorchVersion>, recorded: &RecordedSettings) -> crate::version::Rules {
    let mut r = crate::version::Rules::choose(asked, recorded);
    r.settings_note = settings_in_force(recorded, r.version).ok().and_then(|(_, note)| note);
    r
}

/// A settings string (`--config`) as PyTorch `version` parses it: the one place a user's
/// `PYTORCH_CUDA_ALLOC_CONF` is read for a replay.
pub fn parse_config_for(conf: &str, version: TorchVersion) -> Result<AllocatorConfig, RunError> {
    if version == TorchVersion::DEFAULT {
        AllocatorConfig::parse(conf).map_err(|err| RunError::Config { conf: conf.to_string(), err })
    } else {
        version.parse_config(conf).map_err(|err| RunError::ConfigFor { conf: conf.to_string(), err, version })
    }
}

/// What a trace does not say about how it was recorded (every field `None`: inferred), as every
/// command but `replay` takes it: one device, the rules the snapshot shows.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TraceOptions {
    /// The device's total memory (default: as the trace shows it, else an H200's).
    pub device_memory: Option<u64>,
    /// The allowed maximum the trace was recorded under (tells its `empty_cache()` calls from the
    /// releases its own OOM retries made). Default: inferred from the trace's OOM entries and
    /// segment events, with the memory held outside the allocator; replaying under the trace's
    /// own settings with a capacity given, that capacity.
    pub trace_capacity: Option<u64>,
    /// Which device's trace (default: the one that ran out of memory, else the one with the
    /// highest peak reserved; with no trace entries, the one holding the segments; see
    /// [`crate::devices::choose_device`]).
    pub device: Option<usize>,
}

impl TraceOptions {
    /// The trace made ready for replays under any settings.
    pub fn prepare(&self, snap: &Snapshot) -> Result<Prepared, RunError> {
        self.prepare_for(snap, None, None).map(|(p, _)| p)
    }

    /// The trace made ready for a replay under `config` (default: the trace's own settings) and
    /// `capacity`, and that config, as [`run`] prepares it ([`ReplaySpec`]'s rules: the release the
    /// snapshot shows, the config parsed as it parses it, `capacity` taken as the cap the trace
    /// was recorded under when replaying under its own settings unless `trace_capacity` says
    /// otherwise).
    pub fn prepare_for(&self, snap: &Snapshot, config: Option<&str>, capacity: Option<u64>) -> Result<(Prepared, AllocatorConfig), RunError> {
        let spec = ReplaySpec {
            config: config.map(str::to_string),
            capacity,
            device_memory: self.device_memory,
            trace_capacity: self.trace_capacity,
            device: self.device,
            ..ReplaySpec::default()
        };
        spec.prepare(snap, None)
    }
}

/// Everything one replay computes.
#[derive(Clone, Debug)]
pub struct Replayed {
    pub device: usize,
    /// Which device, and why.
    pub choice: crate::devices::DeviceChoice,
    pub program: Program,
    pub options: ReplayOptions,
    pub outcome: ReplayOutcome,
    /// (placement name, outcome) for `placements`.
    pub placements: Vec<(String, ReplayOutcome)>,
    pub trace: Vec<TraceEntry>,
    /// The snapshot's final segments of this device.
    pub segments: Vec<SnapshotSegment>,
    /// Whether the replay ran under the trace's own settings and allowed maximum.
    pub own_settings: bool,
    /// The memory budget the trace was recorded under (inferred, or as given).
    pub budget: Budget,
    /// A replay under other settings with the allowed maximum an inferred interval: the outcome
    /// at each end of it, to tell whether the answer depends on where in it the real one lies.
    pub budget_ends: Vec<BudgetEnd>,
    /// Which release's rules the replay used, and why.
    pub rules: crate::version::Rules,
    /// The settings the trace was recorded under (those of `options` for a replay of its own).
    pub own: AllocatorConfig,
}

/// The outcome of a replay at one end of an inferred allowed maximum.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct BudgetEnd {
    pub capacity: u64,
    pub first_oom: Option<u32>,
    pub ooms: usize,
    pub peak_reserved: u64,
}

impl Replayed {
    /// The request ordinals before which an `empty_cache()` call was applied.
    pub fn empty_cache_requests(&self) -> Vec<u32> {
        self.outcome.empty_cache_requests.clone()
    }

    /// What the trace shows of settings other than the recorded ones having been in force for
    /// part of the run ([`crate::settings_change::evidence`]; empty: nothing shows it).
    pub fn settings_change_evidence(&self) -> Vec<String> {
        crate::settings_change::evidence(&self.trace, &self.program, &self.own, &self.budget, self.rules.settings_note.as_deref())
    }

    /// Whether the trace's own replay is not the recording ([`crate::settings_change::not_reproduced`]).
    pub fn not_reproduced(&self) -> Option<crate::settings_change::NotReproduced> {
        crate::settings_change::not_reproduced(&self.trace, &self.program, &self.own, &self.budget, &self.rules)
    }

    /// What `allocsim replay` reports of it.
    pub fn into_summary(self) -> ReplaySummary {
        let not_reproduced = self.not_reproduced();
        let device_memory = self.options.device_memory;
        // One walk over the trace for all OOMs (they come in trace order), and the memory outside
        // the allocator computed once: each by itself is a pass over the trace.
        let mut walked = crate::oom::RecordedMemory::default();
        let mut at = 0usize;
        let mut outside: Option<Option<u64>> = None;
        let mut oom_requests = Vec::with_capacity(self.outcome.ooms.len());
        let simulated_outside = !self.options.outside.is_empty();
        for o in &self.outcome.ooms {
            let req = self.program.requests[o.request as usize];
            let free = crate::oom::device_free_with(
                &req,
                &o.info,
                self.own_settings,
                device_memory,
                simulated_outside,
                || {
                    let to = (req.trace_index as usize).min(self.trace.len());
                    for e in &self.trace[at.min(to)..to] {
                        walked.push(e, device_memory);
                    }
                    at = at.max(to);
                    walked.reserved()
                },
                || *outside.get_or_insert_with(|| crate::oom::outside_memory_from_ooms(&self.trace, device_memory)),
            );
            oom_requests.push((req, free));
        }
        ReplaySummary {
            device: self.device,
            options: self.options,
            own_settings: self.own_settings,
            requests: self.program.requests.len(),
            entries: self.trace.len(),
            outcome: self.outcome,
            oom_requests,
            unknown_frees: self.program.unknown_frees,
            initial: self.program.initial,
            reconstruct_error: self.program.reconstruct_error,
            placements: self.placements,
            streamed: false,
            budget: Some(self.budget),
            budget_ends: self.budget_ends,
            rules: Some(self.rules),
            not_reproduced,
        }
    }
}

/// What `allocsim replay` reports of one device's replay, from either path: a [`Replayed`]
/// ([`Replayed::into_summary`]) or a replay of a stream (`crate::stream`).
#[derive(Clone, Debug)]
pub struct ReplaySummary {
    pub device: usize,
    pub options: ReplayOptions,
    /// Replayed under the trace's own settings and allowed maximum.
    pub own_settings: bool,
    /// The requests in the trace (its `alloc` and `oom` entries).
    pub requests: usize,
    /// The trace's entries.
    pub entries: usize,
    /// The replay. Streamed: without `addresses` and `empty_cache` flags (not kept).
    pub outcome: ReplayOutcome,
    /// For each of `outcome.ooms`: its request, and `device_free` for PyTorch's message (see
    /// [`crate::oom::device_free_estimate`]).
    pub oom_requests: Vec<(Request, u64)>,
    /// See [`Program::unknown_frees`].
    pub unknown_frees: u32,
    /// See [`Program::initial`].
    pub initial: Option<InitialState>,
    /// See [`Program::reconstruct_error`].
    pub reconstruct_error: Option<String>,
    /// (placement name, outcome) for `placements`.
    pub placements: Vec<(String, ReplayOutcome)>,
    /// Replayed in one pass over a stream of entries.
    pub streamed: bool,
    /// The trace's memory budget (not inferred when streamed: a stream that needs one is
    /// replayed in memory).
    pub budget: Option<Budget>,
    /// See [`Replayed::budget_ends`].
    pub budget_ends: Vec<BudgetEnd>,
    /// Which release's rules the replay used, and why (`None`: not said by the path that made
    /// the summary).
    pub rules: Option<crate::version::Rules>,
    /// The replay under the trace's own settings and the budget inferred from it does not make
    /// the trace's recorded segment events and OOMs, and what the trace shows of why
    /// ([`crate::settings_change::not_reproduced`]). A stream never answers such a trace: it
    /// falls back to the in-memory replay.
    pub not_reproduced: Option<crate::settings_change::NotReproduced>,
}

/// The settings the snapshot was recorded under.
pub fn recorded_config(snap: &Snapshot) -> Result<AllocatorConfig, RunError> {
    recorded_config_for(snap, TorchVersion::DEFAULT)
}

/// The settings the snapshot was recorded under, parsed as PyTorch `version` parses them.
pub fn recorded_config_for(snap: &Snapshot, version: TorchVersion) -> Result<AllocatorConfig, RunError> {
    settings_config(&snap.settings, version)
}

/// The settings a trace recorded (`allocator_settings`), as in force when the snapshot was
/// taken ([`settings_in_force`]).
pub fn settings_config(s: &RecordedSettings, version: TorchVersion) -> Result<AllocatorConfig, RunError> {
    settings_in_force(s, version).map(|(c, _)| c)
}

/// The settings in force when the snapshot was taken, and what a user should know of how they
/// were read. `allocator_settings` holds the last settings string parsed
/// (`PYTORCH_CUDA_ALLOC_CONF`, recorded before it is parsed, so also one PyTorch refused) and
/// the values the allocator held (`max_split_size`, `garbage_collection_threshold`,
/// `expandable_segments`, `roundup_power2_divisions`). The string is parsed as PyTorch `version`
/// parses it and the recorded values take precedence where they differ: a string set at run
/// time (`_set_allocator_settings`) resets some keys and leaves others (`expandable_segments`)
/// as they were, and a refused one leaves in force what was parsed before the failing key. The
/// settings not recorded (`max_non_split_rounding_mb`, `large_segment_size_mb`, the pinned and
/// lock keys) are the string's, or the defaults where the string was refused.
pub fn settings_in_force(s: &RecordedSettings, version: TorchVersion) -> Result<(AllocatorConfig, Option<String>), RunError> {
    let Some(conf) = &s.alloc_conf else {
        // No settings string recorded: rebuild what matters from the recorded values.
        let mut c = AllocatorConfig::default();
        recorded_values(s, &mut c);
        return Ok((c, None));
    };
    let parsed = if version == TorchVersion::DEFAULT { AllocatorConfig::parse(conf) } else { version.parse_config(conf) };
    match parsed {
        Ok(mut c) => {
            let changed = recorded_values(s, &mut c);
            let note = (!changed.is_empty()).then(|| {
                format!(
                    "allocator_settings records {} in force where its settings string {conf:?} gives other values: the settings were changed at run time (a snapshot keeps only the last string); replayed under the recorded values",
                    changed.join(", ")
                )
            });
            Ok((c, note))
        }
        Err(err) => {
            let mut c = AllocatorConfig { source: conf.clone(), ..AllocatorConfig::default() };
            recorded_values(s, &mut c);
            let note = format!(
                "the recorded settings string {conf:?} was refused by PyTorch {version} ({err}): a refused string leaves the settings before it in force, so the replay uses the values allocator_settings records as in force (max_split_size, garbage_collection_threshold, expandable_segments, roundup_power2_divisions) and the defaults for the rest"
            );
            Ok((c, Some(note)))
        }
    }
}

/// Puts the values `allocator_settings` records into `c`; returns the names of those that
/// differed.
fn recorded_values(s: &RecordedSettings, c: &mut AllocatorConfig) -> Vec<&'static str> {
    let mut changed = Vec::new();
    if let Some(m) = s.max_split_size {
        // −1 (and any value that is not a size) is unlimited.
        let m = if m > 0 { m as u64 } else { u64::MAX };
        if c.max_split_size != m {
            c.max_split_size = m;
            changed.push("max_split_size");
        }
    }
    if let Some(g) = s.garbage_collection_threshold
        && c.garbage_collection_threshold != g
        && (0.0..1.0).contains(&g)
    {
        c.garbage_collection_threshold = g;
        changed.push("garbage_collection_threshold");
    }
    if let Some(e) = s.expandable_segments
        && c.expandable_segments != e
    {
        c.expandable_segments = e;
        changed.push("expandable_segments");
    }
    // One entry per interval of 1, 2, 4, … MB (what 2.3+ records), each a power of two or 0.
    let rpd = &s.roundup_power2_divisions;
    if rpd.len() == ROUNDUP_INTERVALS && rpd.iter().enumerate().all(|(i, &(mb, d))| mb == 1 << i && (d == 0 || d.is_power_of_two())) {
        let divs: Vec<u64> = rpd.iter().map(|&(_, d)| d).collect();
        if c.roundup_power2_divisions[..] != divs[..] {
            c.roundup_power2_divisions.copy_from_slice(&divs);
            changed.push("roundup_power2_divisions");
        }
    }
    changed
}

/// Whether two configs are the same settings (whatever strings they were parsed from).
pub fn same_settings(a: &AllocatorConfig, b: &AllocatorConfig) -> bool {
    let (mut a, mut b) = (a.clone(), b.clone());
    a.source.clear();
    b.source.clear();
    a == b
}

/// A trace made ready for any number of replays: its program, its own settings, and the
/// `empty_cache()` calls inferred by replaying it under them.
#[derive(Clone, Debug)]
pub struct Prepared {
    pub device: usize,
    /// Which device, and why (see [`crate::devices::choose_device`]).
    pub choice: crate::devices::DeviceChoice,
    pub trace: Vec<TraceEntry>,
    /// The snapshot's final segments of this device.
    pub segments: Vec<SnapshotSegment>,
    pub program: Program,
    /// The settings the trace was recorded under.
    pub own: AllocatorConfig,
    /// The PyTorch release whose rules its replays follow, and why.
    pub rules: crate::version::Rules,
    /// The allowed maximum the trace was recorded under (given, or the one inferred).
    pub trace_capacity: Option<u64>,
    pub device_memory: u64,
    /// The memory budget the trace was recorded under: given (`trace_capacity`), or inferred from
    /// its OOM entries and segment events (`crate::budget`).
    pub budget: Budget,
    /// One flag per op: an `empty_cache()` call.
    pub empty_cache: Vec<bool>,
    /// The replay under the trace's own settings, addresses and allowed maximum.
    pub own_outcome: ReplayOutcome,
    /// The snapshot's interned stacks (for call sites).
    pub stacks: Vec<Vec<Frame>>,
    /// The private pools inferred from the trace, when its final segments did not suffice
    /// (`crate::pools`).
    pub pools: Option<crate::pools::PoolInference>,
    /// The snapshot's per-entry metadata (`TraceEntry::meta` indexes it; see
    /// [`allocsim_trace::MetaId`]).
    pub entry_metas: Vec<EntryMeta>,
    /// The snapshot's `external_annotations` recorded on this device, in order; when none was,
    /// all of them (a `record_function` scope is the host's: its `device` is only the device
    /// current at the time, so a process driving several devices records its scopes on one).
    pub annotations: Vec<Annotation>,
}

/// The allowed maximum and the memory held outside the allocator, for one replay.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    pub capacity: Option<u64>,
    pub outside: OutsideMemory,
}

impl Limits {
    /// This allowed maximum (or none) and nothing outside the allocator.
    pub fn capacity(capacity: Option<u64>) -> Limits {
        Limits { capacity, outside: OutsideMemory::default() }
    }
}

impl Prepared {
    /// Prepares device `device` (default: the one that matters, [`crate::devices::choose_device`]) of `snap` on a device of
    /// `device_memory` bytes. `trace_capacity`: the allowed maximum the trace was recorded under;
    /// `None`: inferred from the trace with the memory outside the allocator (`crate::budget`).
    pub fn new(snap: &Snapshot, device: Option<usize>, device_memory: u64, trace_capacity: Option<u64>) -> Result<Prepared, RunError> {
        Prepared::new_for(snap, device, Some(device_memory), trace_capacity, TorchVersion::DEFAULT)
    }

    /// [`Prepared::new`] under the rules of PyTorch `version`; `device_memory` `None`: as the
    /// trace shows it, else an H200's.
    pub fn new_for(
        snap: &Snapshot,
        device: Option<usize>,
        device_memory: Option<u64>,
        trace_capacity: Option<u64>,
        version: TorchVersion,
    ) -> Result<Prepared, RunError> {
        let (choice, trace) = chosen_trace(snap, device)?;
        Prepared::new_with(snap, choice, trace, device_memory, trace_capacity, rules_for(Some(version), &snap.settings))
    }

    /// [`Prepared::new_for`] with the device chosen and its trace given (moved, not copied: `snap`
    /// need not hold it any more, see [`run_given`]).
    pub fn new_with(
        snap: &Snapshot,
        choice: crate::devices::DeviceChoice,
        trace: Vec<TraceEntry>,
        device_memory: Option<u64>,
        trace_capacity: Option<u64>,
        rules: crate::version::Rules,
    ) -> Result<Prepared, RunError> {
        let version = rules.version;
        let device = choice.device;
        let segments: Vec<_> = snap.segments.iter().filter(|s| s.device == device as i64).cloned().collect();
        crate::check::check_trace(device, &trace, &segments)?;
        let own = recorded_config_for(snap, version)?;
        let memory = match device_memory {
            Some(d) => DeviceMemory::given(d),
            None => crate::budget::infer_device_memory(&trace, &segments, own.large_segment_size),
        };
        let device_memory = memory.bytes;
        let mut program = crate::restore::build_program(&trace, &segments, &own, device_memory);
        let placement = recorded_placement_from(&trace, device_memory, program.initial.as_ref());
        let opts =
            ReplayOptions { config: own.clone(), capacity: trace_capacity, device_memory, placement: placement.clone(), outside: OutsideMemory::default() };
        crate::settle::settle_block_sizes(&mut program, &trace, &opts, 32);
        crate::pools::mark_checkpoint_allocations(&mut program, &snap.stacks);
        let infer_budget = |program: &Program| match trace_capacity {
            Some(c) => (Budget::given(c, memory.clone()), None),
            None => crate::budget::infer(&trace, program, &own, memory.clone(), &placement),
        };
        let own_replay = |program: &Program, budget: &Budget, outcome: Option<ReplayOutcome>| match outcome {
            Some(o) => o,
            None => {
                let opts = ReplayOptions { capacity: budget.capacity(), outside: budget.outside.clone(), ..opts.clone() };
                replay(program, &opts, EmptyCacheCalls::Infer(&trace))
            }
        };
        let (mut budget, outcome) = infer_budget(&program);
        let mut own_outcome = own_replay(&program, &budget, outcome);
        let mut pools = None;
        if !crate::pools::self_replay_exact(&own_outcome, &program, &trace) && crate::pools::worth_inferring(&trace, &program) {
            // Judged under the budget the trace itself shows, not a capacity given for it (a
            // what-if under another cap diverges for that reason alone).
            let inferred = match trace_capacity {
                Some(_) => {
                    let (b, o) = crate::budget::infer(&trace, &program, &own, memory.clone(), &placement);
                    let o = own_replay(&program, &b, o);
                    (!crate::pools::self_replay_exact(&o, &program, &trace)).then_some(b)
                }
                None => Some(budget.clone()),
            };
            if let Some(b) = inferred {
                // Private pools the final segments do not show: infer them (see `crate::pools`).
                let o = ReplayOptions { capacity: b.capacity(), outside: b.outside.clone(), ..opts.clone() };
                let mut candidate = program.clone();
                let inferred = crate::pools::infer(&mut candidate, &trace, &segments, &o);
                if candidate.requests != program.requests || candidate.pool_actions != program.pool_actions || candidate.ops != program.ops {
                    let (b, outcome) = infer_budget(&candidate);
                    let out = own_replay(&candidate, &b, outcome);
                    program = candidate;
                    budget = b;
                    own_outcome = out;
                }
                pools = Some(inferred);
            }
        }
        if budget.kind == Some(crate::budget::BudgetKind::Given) {
            // A budget given is not inferred, so nothing above checked it: whether the replay
            // under it makes the recorded segment events and OOMs (as the stream checks it).
            budget.reproduces = crate::budget::reproduces(&own_outcome, &trace);
        }
        Ok(Prepared {
            pools,
            device,
            choice,
            empty_cache: own_outcome.empty_cache.clone(),
            trace,
            segments,
            program,
            own,
            rules,
            trace_capacity: budget.capacity(),
            device_memory,
            budget,
            own_outcome,
            stacks: snap.stacks.clone(),
            entry_metas: snap.entry_metas.clone(),
            annotations: {
                let own: Vec<Annotation> = snap.annotations.iter().filter(|a| a.device == device as i64).cloned().collect();
                if own.is_empty() { snap.annotations.clone() } else { own }
            },
        })
    }

    /// A settings string as this trace's release parses it ([`parse_config_for`]).
    pub fn parse_config(&self, conf: &str) -> Result<AllocatorConfig, RunError> {
        parse_config_for(conf, self.rules.version)
    }

    /// Whether the trace's own replay is not the recording ([`crate::settings_change::not_reproduced`]).
    pub fn not_reproduced(&self) -> Option<crate::settings_change::NotReproduced> {
        crate::settings_change::not_reproduced(&self.trace, &self.program, &self.own, &self.budget, &self.rules)
    }

    /// The limits a replay runs under: `capacity` when given (and nothing held outside the
    /// allocator), else the trace's own budget.
    pub fn limits(&self, capacity: Option<u64>) -> Limits {
        match capacity {
            Some(_) => Limits::capacity(capacity),
            None => Limits { capacity: self.budget.capacity(), outside: self.budget.outside.clone() },
        }
    }

    /// The trace's own budget with the allowed maximum at `capacity` (an end of an inferred
    /// interval).
    pub fn limits_at(&self, capacity: u64) -> Limits {
        Limits { capacity: Some(capacity), outside: self.budget.outside.clone() }
    }

    /// The options of a replay under `config` and `limits` with `placement`.
    pub fn options(&self, config: &AllocatorConfig, limits: &Limits, placement: Placement) -> ReplayOptions {
        ReplayOptions { config: config.clone(), capacity: limits.capacity, device_memory: self.device_memory, placement, outside: limits.outside.clone() }
    }

    /// The trace's own segment addresses.
    pub fn recorded_placement(&self) -> Placement {
        recorded_placement_from(&self.trace, self.device_memory, self.program.initial.as_ref())
    }

    /// Replays under `config` and exactly `capacity` (nothing held outside the allocator) on a
    /// simulated device with `placement`.
    pub fn replay(&self, config: &AllocatorConfig, capacity: Option<u64>, placement: Placement) -> ReplayOutcome {
        self.replay_under(config, &Limits::capacity(capacity), placement)
    }

    /// Replays under `config` and `limits` on a simulated device with `placement`.
    pub fn replay_under(&self, config: &AllocatorConfig, limits: &Limits, placement: Placement) -> ReplayOutcome {
        replay(&self.program, &self.options(config, limits, placement), EmptyCacheCalls::Given(&self.empty_cache))
    }

    /// The `n` plausible placements `--placements n` replays under.
    pub fn placements(&self, n: usize) -> Vec<(String, Placement)> {
        plausible_placements_from(&self.trace, self.device_memory, n, self.program.initial.as_ref())
    }

    /// Whether `config` and `capacity` (as [`Prepared::limits`] takes it) are the trace's own.
    pub fn is_own(&self, config: &AllocatorConfig, capacity: Option<u64>) -> bool {
        self.is_own_under(config, &self.limits(capacity))
    }

    /// Whether `config` and `limits` are the trace's own.
    pub fn is_own_under(&self, config: &AllocatorConfig, limits: &Limits) -> bool {
        same_settings(config, &self.own) && limits.capacity == self.trace_capacity && limits.outside == self.budget.outside
    }

    /// The request at the peak of `outcome` (a replay of this trace under `config`, `limits` and
    /// `placement`): where reserved memory first reached its peak, from the segment events; when
    /// reserved memory never rose above where the trace started (no segment was made or mapped,
    /// e.g. history turned on after warm-up), where allocated memory first reached its peak,
    /// counting the blocks already live at the trace's start. `None` without requests.
    pub fn peak_request(&self, outcome: &ReplayOutcome, config: &AllocatorConfig, limits: &Limits, placement: Placement) -> Option<u32> {
        outcome.peak_reserved_request().or_else(|| self.peak_allocated_request(config, limits, placement))
    }

    /// The request whose malloc first brought allocated memory (with the blocks live at the
    /// trace's start) to its peak, replaying under `config`, `limits` and `placement`.
    pub fn peak_allocated_request(&self, config: &AllocatorConfig, limits: &Limits, placement: Placement) -> Option<u32> {
        let opts = self.options(config, limits, placement);
        let device = allocsim_model::SimDevice::new(opts.device_memory, opts.placement.clone());
        let (mut best, mut at) = (-1i64, None);
        let ops = &self.program.ops;
        crate::replay::replay_observed(
            &self.program,
            &opts,
            device,
            |_, oi| self.empty_cache.get(oi).copied().unwrap_or(false),
            |alloc, oi| {
                let cur = alloc.stats.allocated_bytes.all().current;
                if cur > best {
                    best = cur;
                    if let Some(crate::program::Op::Malloc(q)) = ops.get(oi) {
                        at = Some(*q);
                    }
                }
            },
        );
        at.or_else(|| (!self.program.requests.is_empty()).then_some(0))
    }

    /// The stack recorded for request `req` (innermost first; empty when none was recorded).
    pub fn frames(&self, req: u32) -> &[Frame] {
        let stack = self.program.requests.get(req as usize).map_or(0, |r| r.stack as usize);
        self.stacks.get(stack).map_or(&[], |v| v.as_slice())
    }

    /// Where request `req` was made: the first frame in the user's code, skipping C++ frames and
    /// PyTorch's own Python files (see [`allocsim_trace::frames`]); `None` when the trace recorded
    /// no stack for it.
    pub fn call_site(&self, req: u32) -> Option<String> {
        allocsim_trace::frames::call_site(self.frames(req))
    }
}

/// Replays one device of `snap` as `spec` asks.
pub fn run(snap: &Snapshot, spec: &ReplaySpec<'_>) -> Result<Replayed, RunError> {
    run_with(snap, spec, None)
}

/// [`run`] with the device chosen (as [`crate::devices::device_for`] chose it on the snapshot
/// whole) and its trace given, moved out of the snapshot rather than copied
/// ([`run_devices_owned`]).
pub fn run_given(snap: &Snapshot, spec: &ReplaySpec<'_>, choice: crate::devices::DeviceChoice, trace: Vec<TraceEntry>) -> Result<Replayed, RunError> {
    run_with(snap, spec, Some((choice, trace)))
}

fn run_with(snap: &Snapshot, spec: &ReplaySpec<'_>, given: Option<(crate::devices::DeviceChoice, Vec<TraceEntry>)>) -> Result<Replayed, RunError> {
    if let Some(n) = spec.placements
        && !(1..=MAX_PLACEMENTS).contains(&n)
    {
        return Err(RunError::Placements(n));
    }
    let (prepared, config) = spec.prepare(snap, given)?;
    let placement = match spec.addresses_from {
        Some(other) => recorded_placement_from(
            other.device_traces.get(prepared.device).map_or(&[], |v| v.as_slice()),
            prepared.device_memory,
            prepared.program.initial.as_ref(),
        ),
        None => prepared.recorded_placement(),
    };
    let limits = prepared.limits(spec.capacity);
    let own_settings = prepared.is_own_under(&config, &limits);
    // (The own replay's outcome is moved out of `prepared` at the end, not copied.)
    let outcome = (!own_settings || spec.addresses_from.is_some()).then(|| prepared.replay_under(&config, &limits, placement.clone()));
    let options = prepared.options(&config, &limits, placement);
    let mut placements = Vec::new();
    if let Some(n) = spec.placements {
        let list = prepared.placements(n);
        // On rayon's pool (one thread a core), however many placements are asked for.
        use rayon::prelude::*;
        let limits = Limits { capacity: options.capacity, outside: options.outside.clone() };
        placements = list.into_par_iter().map(|(name, pl)| (name, prepared.replay_under(&options.config, &limits, pl))).collect();
    }
    let mut budget_ends = Vec::new();
    if !own_settings
        && spec.capacity.is_none()
        && prepared.budget.allowed_is_interval()
        && let (Some(lo), Some(hi)) = (prepared.budget.allowed_low, prepared.budget.allowed_high)
    {
        for capacity in [lo, hi] {
            let o = prepared.replay_under(&options.config, &prepared.limits_at(capacity), options.placement.clone());
            budget_ends.push(BudgetEnd { capacity, first_oom: o.first_oom(), ooms: o.ooms.len(), peak_reserved: o.peak_reserved });
        }
    }
    let Prepared { device, choice, program, trace, segments, budget, own_outcome, own, rules, .. } = prepared;
    let outcome = outcome.unwrap_or(own_outcome);
    Ok(Replayed { device, choice, program, options, outcome, placements, trace, segments, own_settings, budget, budget_ends, rules, own })
}

/// Replays every device with entries (`spec.device` is ignored), in parallel; results in device
/// order. A snapshot without entries replays the device with its segments ([`crate::devices::choose_device`]), as
/// [`run`] does.
pub fn run_devices(snap: &Snapshot, spec: &ReplaySpec<'_>) -> Result<Vec<Replayed>, RunError> {
    let mut devices = crate::devices::devices_with_entries(snap);
    if devices.is_empty() {
        devices.push(crate::devices::choose_device(snap)?.device);
    }
    // On rayon's pool (one thread a core), however many devices the snapshot has.
    let results: Vec<Result<Replayed, RunError>> = devices
        .par_iter()
        .map(|&d| {
            let spec = ReplaySpec { device: Some(d), ..spec.clone() };
            run(snap, &spec)
        })
        .collect();
    results.into_iter().collect()
}

/// [`run_devices`] of a snapshot the caller owns and no longer needs whole: each replayed
/// device's trace is moved out of `snap` (left empty there) rather than copied
/// ([`run_owned`]). The same answers.
pub fn run_devices_owned(snap: &mut Snapshot, spec: &ReplaySpec<'_>) -> Result<Vec<Replayed>, RunError> {
    let mut devices = crate::devices::devices_with_entries(snap);
    if devices.is_empty() {
        devices.push(crate::devices::choose_device(snap)?.device);
    }
    // Chosen (each as `run` would: given) on the snapshot whole, then the traces taken out.
    let mut given = Vec::with_capacity(devices.len());
    for &d in &devices {
        let choice = crate::devices::device_for(snap, Some(d))?;
        let trace = snap.device_traces.get_mut(d).map(std::mem::take).unwrap_or_default();
        given.push((choice, trace));
    }
    let snap: &Snapshot = snap;
    let results: Vec<Result<Replayed, RunError>> = given
        .into_par_iter()
        .map(|(choice, trace)| {
            let spec = ReplaySpec { device: Some(choice.device), ..spec.clone() };
            run_given(snap, &spec, choice, trace)
        })
        .collect();
    results.into_iter().collect()
}

/// Indices into `replays`, worst first: most OOMs, then highest peak reserved, then device order.
pub fn worst_first(replays: &[ReplaySummary]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..replays.len()).collect();
    order.sort_by_key(|&i| {
        let o = &replays[i].outcome;
        (std::cmp::Reverse(o.ooms.len()), std::cmp::Reverse(o.peak_reserved), replays[i].device)
    });
    order
}

/// The device that matters among replays of several devices (see [`worst_first`]): the same rule
/// as [`crate::devices::choose_device`], on what the replays did.
pub fn choice_of_replays(replays: &[ReplaySummary]) -> Option<DeviceChoice> {
    let order = worst_first(replays);
    let best = &replays[*order.first()?];
    let candidates: Vec<DeviceFacts> = replays
        .iter()
        .map(|r| DeviceFacts {
            device: r.device,
            entries: r.requests,
            ooms: r.outcome.ooms.len(),
            peak_reserved: r.outcome.peak_reserved,
            reserved_at_end: r.outcome.stats.reserved_bytes.all().current as u64,
        })
        .collect();
    let reason = if replays.len() == 1 {
        DeviceReason::Only
    } else if best.outcome.ooms.is_empty() {
        DeviceReason::HighestPeak
    } else {
        DeviceReason::RanOutOfMemory
    };
    Some(DeviceChoice { device: best.device, reason, candidates })
}
