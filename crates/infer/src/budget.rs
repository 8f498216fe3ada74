//! The memory the allocator had, as the trace shows it.
//!
//! A snapshot records neither the allowed maximum (`set_per_process_memory_fraction`) nor the
//! memory held outside the allocator (the CUDA context, other processes, NCCL and cuBLAS
//! workspaces), nor the device's total memory. Its OOM entries and segment events bound them:
//!
//! * **Device full.** An `oom` entry records `device_free` (`cudaMemGetInfo` after the retry's
//!   releases). When that is smaller than the segment the allocator asked for (`alloc_size`), the
//!   device itself was out of memory, and what the allocator could have had at that moment is
//!   exactly the bytes it had reserved (the trace's segment events up to the entry) plus
//!   `device_free`. Between OOMs the trace shows only lower bounds: every segment it got needed
//!   its reserved bytes after the `cudaMalloc` (or map) to fit. The rule: up to each device-full
//!   OOM (from the one before), the allocator had what that OOM shows, raised where a later
//!   success before it needed more; after the last one, what the last showed, raised from each
//!   success on that needed more. That is the least memory consistent with every entry, and it
//!   changes over time as a neighbour's usage does. The device's total less this is the memory
//!   outside the allocator ([`OutsideMemory`]), which the simulated device holds back, so the
//!   real failure path runs: `cudaMalloc` fails, cached blocks are released, the retry fails, and
//!   the message's "of which X is free" is the recorded figure.
//! * **A retry on a full device.** A malloc whose first `alloc_block` fails (the device refuses
//!   the `cudaMalloc` or the pages) releases the cached blocks (`release_cached_blocks`) and
//!   tries again (`num_alloc_retries`); only if that fails too is there an OOM entry. The trace
//!   shows the releases right before the malloc's own new segment or pages and its `alloc`, and
//!   the releases carry the malloc's stack (the context `malloc` gathered), where an
//!   `empty_cache()` call's carry that call's ([`MallocRetries`]). A trace without OOM entries
//!   that shows such retries had a full device there: the allocator could have at least what it
//!   reserved after the retry's new memory, and less than it held before the releases plus what
//!   the first attempt asked for. The least such memory is taken at each retry, raised where a
//!   later success needed more, as for device-full OOMs; the reading is kept where the replay
//!   under it reproduces the recorded segment events and makes every retry.
//! * **Allowed maximum.** `device_free` at or above `alloc_size` says the device had room: the
//!   fraction check refused (`total_allocated_memory + alloc_size > allowed`, with `alloc_size`
//!   on the expandable path too). Every new segment says `allowed ≥ reserved + alloc_size` at its
//!   check, every such OOM says `allowed < reserved + alloc_size` after the releases. Where the
//!   trace needs a maximum that these bounds leave open (releases of `max_split_size` or garbage
//!   collection, retries that succeed), the trace is replayed under its own settings with the
//!   maximum known only to lie in an interval: each malloc whose decisions differ within it is
//!   tried on each side of every comparison it makes with the maximum
//!   ([`CachingAllocator::limit_probe`]), and the interval keeps the parts that reproduce the
//!   recorded segment events, address or OOM. Every maximum in the final interval replays the
//!   trace the same way; a what-if answer under another config can still depend on where in it
//!   the real one lies, and the commands say so.
//! * **Device total.** Expandable segments reserve `1.125 × total` of address space each, and
//!   the driver places consecutive reservations next to one another (32 MiB-aligned on an H200
//!   with CUDA 13): the spacing of the reservations' bases bounds the total. OOM entries bound it
//!   from below (reserved + free). Otherwise an H200 (150109880320 bytes) is assumed, and said.
//!
//! A trace that replays exactly without any of this (no OOM, or OOMs the model reproduces
//! unaided) gets no budget: nothing is inferred where nothing is needed.
//!
//! [`CachingAllocator::limit_probe`]: allocsim_model::CachingAllocator::limit_probe

use std::sync::{Arc, Mutex};

use allocsim_model::allocator::{CachingAllocator, LimitProbe};
use allocsim_model::constants::{H200_TOTAL_MEMORY, K_LARGE_BUFFER, K_SMALL_BUFFER};
use allocsim_model::format::format_size;
use allocsim_model::{AllocatorConfig, Placement, SimDevice};
use allocsim_trace::{Action, SnapshotSegment, StackId, TraceEntry};

use allocsim_program::program::{Op, Program};
use allocsim_program::replay::{
    EmptyCacheCalls, Inference, OutsideMemory, ProgramAhead, ProgramReplay, ReplayOptions, ReplayOutcome, SegmentEvent, Slots, Stepper, VecSlots,
    empty_cache_calls, replay,
};

/// What kind of limit the trace shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BudgetKind {
    /// The device itself was out of memory: others held the rest.
    DeviceFull,
    /// `set_per_process_memory_fraction`'s allowed maximum.
    AllowedMaximum,
    /// Given by the caller (`--capacity`, `--trace-capacity`).
    Given,
}

/// Where the device's total memory came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceMemorySource {
    Given,
    /// Not shown by the trace: an H200 assumed.
    Default,
    /// From the trace ([`DeviceMemory::note`] says how).
    Inferred,
}

/// The device's total memory and how it is known.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct DeviceMemory {
    pub bytes: u64,
    pub source: DeviceMemorySource,
    /// The range the trace allows, where it shows one.
    pub range: Option<(u64, u64)>,
    pub note: String,
}

impl DeviceMemory {
    pub fn given(bytes: u64) -> DeviceMemory {
        DeviceMemory { bytes, source: DeviceMemorySource::Given, range: None, note: "given".into() }
    }

    /// Nothing in the trace says: an H200's (the card allocsim's recordings come from).
    pub fn h200_assumed() -> DeviceMemory {
        DeviceMemory { bytes: H200_TOTAL_MEMORY, source: DeviceMemorySource::Default, range: None, note: "an H200 assumed".into() }
    }
}

/// One OOM of the device-full kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct DeviceFullOom {
    pub request: u32,
    /// `device_free` as recorded.
    pub device_free: u64,
    /// Bytes the allocator had reserved (after the retry's releases).
    pub reserved: u64,
    /// reserved + device_free: what the allocator could have had.
    pub available: u64,
    /// The device's total less `available`.
    pub outside: u64,
}

/// A malloc that retried after the device refused its first attempt (see [`MallocRetries`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct DeviceFullRetry {
    pub request: u32,
    /// Bytes reserved before the malloc's releases.
    pub reserved_before: u64,
    /// Bytes reserved after its releases, before its new memory.
    pub reserved_released: u64,
    /// Bytes reserved after the retry's new memory: the least the allocator could have.
    pub available: u64,
}

/// The rule that tells a malloc's own retry from an `empty_cache()` call: a run of segment
/// releases (`segment_free`/`segment_unmap`, with `free_completed` from the synchronization
/// before them) right before a malloc's new segment or pages and its `alloc` entry, every release
/// carrying the `alloc`'s stack. `malloc` gathers its context once and hands it to
/// `release_cached_blocks`, so its releases record the malloc's stack; `empty_cache()` records
/// its own (the `empty_cache` frame). A trace recorded without stacks shows neither: the rule
/// then finds nothing. The same shape comes from `garbage_collect_cached_blocks` and
/// `release_available_cached_blocks` inside a malloc; the budget keeps a retry reading only where
/// the replay under it reproduces the trace.
#[derive(Clone, Debug, Default)]
pub struct MallocRetries {
    reserved: i64,
    req: u32,
    state: RetryState,
    pub found: Vec<DeviceFullRetry>,
}

#[derive(Clone, Copy, Debug, Default)]
enum RetryState {
    #[default]
    Idle,
    /// Releases seen: (reserved before them, their stack, all of them with it).
    Releasing(u64, StackId, bool),
    /// New memory after them: (reserved before the releases, after them, stack, same).
    Growing(u64, u64, StackId, bool),
}

impl MallocRetries {
    /// From a trace whose allocator held `initial_reserved` bytes before its first entry.
    pub fn with_initial(initial_reserved: u64) -> MallocRetries {
        MallocRetries { reserved: initial_reserved as i64, ..MallocRetries::default() }
    }

    /// The next entry.
    pub fn push(&mut self, e: &TraceEntry) {
        let r = self.reserved.max(0) as u64;
        self.state = match (e.action, self.state) {
            (Action::SegmentFree | Action::SegmentUnmap, RetryState::Releasing(before, stack, same)) => {
                RetryState::Releasing(before, stack, same && e.stack == stack)
            }
            (Action::SegmentFree | Action::SegmentUnmap, _) => RetryState::Releasing(r, e.stack, true),
            (Action::FreeCompleted, st) => st,
            (Action::SegmentAlloc | Action::SegmentMap, RetryState::Releasing(before, stack, same)) => RetryState::Growing(before, r, stack, same),
            (Action::SegmentAlloc | Action::SegmentMap, st @ RetryState::Growing(..)) => st,
            (Action::Alloc, RetryState::Growing(before, released, stack, same)) => {
                if same && stack != 0 && e.stack == stack && released < before {
                    self.found.push(DeviceFullRetry { request: self.req, reserved_before: before, reserved_released: released, available: r });
                }
                RetryState::Idle
            }
            _ => RetryState::Idle,
        };
        match e.action {
            Action::SegmentAlloc | Action::SegmentMap => self.reserved += e.size as i64,
            Action::SegmentFree | Action::SegmentUnmap => self.reserved -= e.size as i64,
            Action::Alloc | Action::Oom => self.req += 1,
            _ => {}
        }
    }
}

/// Whether any device of `snap` shows a malloc's retry ([`MallocRetries`]) and no OOM entry: a
/// budget the in-memory replay infers from stacks, which a stream of entries without stacks
/// cannot (`allocsim_commands::file` replays such a snapshot in memory).
pub fn shows_malloc_retries(snap: &allocsim_trace::Snapshot) -> bool {
    snap.device_traces.iter().any(|t| {
        if t.iter().any(|e| e.action == Action::Oom) {
            return false;
        }
        let mut m = MallocRetries::default();
        t.iter().for_each(|e| m.push(e));
        !m.found.is_empty()
    })
}

/// Whether segment events alone (per device, as a file's first pass reads them) leave room for a
/// malloc's retry ([`MallocRetries`]): a release right before a new segment or pages. Where they
/// do, only the entries' stacks tell, and a stream of entries does not keep them.
pub fn segment_events_allow_retries(segment_entries: &[Vec<TraceEntry>]) -> bool {
    segment_entries.iter().any(|t| {
        t.windows(2)
            .any(|w| matches!(w[0].action, Action::SegmentFree | Action::SegmentUnmap) && matches!(w[1].action, Action::SegmentAlloc | Action::SegmentMap))
    })
}

/// The memory budget a trace was recorded under.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Budget {
    /// `None`: nothing needed inferring (the trace replays exactly without a limit).
    pub kind: Option<BudgetKind>,
    /// The allowed maximum lies in `low..=high`; replays use `used`.
    pub allowed_low: Option<u64>,
    pub allowed_high: Option<u64>,
    pub allowed_used: Option<u64>,
    /// The OOMs that show a full device, in order.
    pub device_full: Vec<DeviceFullOom>,
    /// The mallocs that retried on a full device without an OOM ([`MallocRetries`]), in order.
    pub retries: Vec<DeviceFullRetry>,
    /// Memory outside the allocator over time (device full).
    pub outside: OutsideMemory,
    pub device_memory: DeviceMemory,
    /// The requests whose entries the inference rests on.
    pub from: Vec<u32>,
    /// OOM entries in the trace, and how many of them showed each kind.
    pub recorded_ooms: usize,
    pub allowed_ooms: usize,
    /// The replay under this budget reproduces every recorded segment event and OOM.
    pub reproduces: bool,
    /// Requests whose recorded outcome no maximum in the interval reproduces.
    pub unexplained: Vec<u32>,
    /// The segments the trace got need more allowed than its OOMs allow (`(need, allowed)`):
    /// no one maximum held over the whole run.
    pub bounds_contradict: Option<(u64, u64)>,
    pub notes: Vec<String>,
}

impl Budget {
    /// No limit known or needed.
    pub fn none(device_memory: DeviceMemory) -> Budget {
        Budget {
            kind: None,
            allowed_low: None,
            allowed_high: None,
            allowed_used: None,
            device_full: Vec::new(),
            retries: Vec::new(),
            outside: OutsideMemory::default(),
            device_memory,
            from: Vec::new(),
            recorded_ooms: 0,
            allowed_ooms: 0,
            reproduces: true,
            unexplained: Vec::new(),
            bounds_contradict: None,
            notes: Vec::new(),
        }
    }

    /// An allowed maximum the caller gave.
    pub fn given(capacity: u64, device_memory: DeviceMemory) -> Budget {
        Budget {
            kind: Some(BudgetKind::Given),
            allowed_low: Some(capacity),
            allowed_high: Some(capacity),
            allowed_used: Some(capacity),
            ..Budget::none(device_memory)
        }
    }

    /// The allowed maximum replays use (`None`: no fraction set).
    pub fn capacity(&self) -> Option<u64> {
        self.allowed_used
    }

    /// Whether the trace's own replay, under its recorded settings and the budget inferred from
    /// it, does not make its recorded segment events and OOMs (`records_any`: whether it has one, asked only when the replay differs): the
    /// recording is not reproduced (its settings changed during the run, or the model misses a
    /// rule). A budget given (`--capacity` under the own settings, `--trace-capacity`) asks a
    /// question instead, whose replay need not be the recording; a trace that records neither
    /// (`allocsim synth`'s) has nothing to reproduce.
    pub fn recording_not_reproduced(&self, records_any: impl FnOnce() -> bool) -> bool {
        !self.reproduces && self.kind != Some(BudgetKind::Given) && records_any()
    }

    /// Whether the allowed maximum is known only as an interval wider than one value.
    pub fn allowed_is_interval(&self) -> bool {
        matches!((self.allowed_low, self.allowed_high), (Some(l), Some(h)) if l < h) && self.kind != Some(BudgetKind::Given)
    }

    /// The budget in words: what was inferred and from what.
    pub fn describe(&self) -> Vec<String> {
        let mut out = Vec::new();
        let reqs = |v: &[u32]| {
            let shown: Vec<String> = v.iter().take(6).map(|r| r.to_string()).collect();
            format!("{}{}", shown.join(", "), if v.len() > 6 { format!(" and {} more", v.len() - 6) } else { String::new() })
        };
        if let Some(first) = self.device_full.first() {
            out.push(format!(
                "the GPU had {} free at request {}: the allocator could have {} ({} reserved + {} free); {} was in use outside PyTorch's allocator on a {} device",
                format_size(first.device_free),
                first.request,
                format_size(first.available),
                format_size(first.reserved),
                format_size(first.device_free),
                format_size(first.outside),
                format_size(self.device_memory.bytes),
            ));
            if self.device_full.len() > 1 {
                let lo = self.device_full.iter().map(|d| d.outside).min().unwrap_or(0);
                let hi = self.device_full.iter().map(|d| d.outside).max().unwrap_or(0);
                if format_size(lo) == format_size(hi) {
                    out.push(format!("{} device-full OOMs, each with {} outside the allocator", self.device_full.len(), format_size(lo)));
                } else {
                    out.push(format!(
                        "{} device-full OOMs with {}–{} outside the allocator: replayed with what each OOM shows from the one before it on (the least the trace allows between them)",
                        self.device_full.len(),
                        format_size(lo),
                        format_size(hi)
                    ));
                }
            }
        }
        if let Some(first) = self.retries.first() {
            let n = self.retries.len();
            out.push(format!(
                "the device refused the first cudaMalloc/map of {n} request{} ({}), which released the cached blocks and retried (num_alloc_retries): a full device, another process holding the rest; at request {} the allocator could have {} ({} reserved before the releases); replayed with {} outside the allocator there, the least the trace allows (an allowed maximum would read the same, but the trace has no OOM to tell)",
                if n == 1 { "" } else { "s" },
                reqs(&self.retries.iter().map(|r| r.request).collect::<Vec<_>>()),
                first.request,
                format_size(first.available),
                format_size(first.reserved_before),
                format_size(self.device_memory.bytes.saturating_sub(first.available)),
            ));
        }
        match (self.kind, self.allowed_low, self.allowed_high, self.allowed_used) {
            (Some(BudgetKind::Given), _, _, Some(c)) => out.push(format!("allowed maximum {} (given)", format_size(c))),
            (_, Some(lo), Some(hi), Some(used)) => {
                let n = self.allowed_ooms;
                let from = if n > 0 {
                    format!("inferred from {n} OOM{} and the segments the trace got", if n == 1 { "" } else { "s" })
                } else {
                    "inferred from the releases and segments the trace shows".to_string()
                };
                if lo == hi {
                    out.push(format!("allowed maximum {} (set_per_process_memory_fraction), {from}", format_size(lo)));
                } else {
                    out.push(format!(
                        "allowed maximum between {} and {} (set_per_process_memory_fraction), {from}; replayed under {} ({used} bytes): every value in the interval replays the trace alike",
                        format_size(lo),
                        format_size(hi),
                        format_size(used)
                    ));
                }
            }
            _ => {}
        }
        if self.kind.is_some() && !self.from.is_empty() && self.kind != Some(BudgetKind::Given) {
            out.push(format!("evidence: requests {}", reqs(&self.from)));
        }
        if self.kind.is_some() || self.device_memory.source != DeviceMemorySource::Given {
            match self.device_memory.source {
                DeviceMemorySource::Default => out.push(format!(
                    "the device's total memory is not in the trace: an H200 ({} bytes) assumed (--device-memory sets it)",
                    self.device_memory.bytes
                )),
                DeviceMemorySource::Inferred => out.push(format!("device memory {}: {}", format_size(self.device_memory.bytes), self.device_memory.note)),
                DeviceMemorySource::Given => {}
            }
        }
        if !self.unexplained.is_empty() {
            out.push(format!("no allowed maximum reproduces what the trace recorded at requests {}", reqs(&self.unexplained)));
        }
        if self.kind.is_some() && !self.reproduces {
            out.push("the replay under this budget does not reproduce every recorded segment event and OOM (see `allocsim validate`)".into());
        }
        out.extend(self.notes.iter().cloned());
        out
    }

    /// The `budget` object of `--json` output.
    pub fn to_json(&self) -> serde_json::Value {
        let kind = self.kind.map(|k| match k {
            BudgetKind::DeviceFull if self.allowed_used.is_some() => "allowed_maximum",
            BudgetKind::DeviceFull => "device_full",
            BudgetKind::AllowedMaximum => "allowed_maximum",
            BudgetKind::Given => "given",
        });
        let (low, high, used) = match (self.allowed_low, self.allowed_high, self.allowed_used) {
            (Some(l), Some(h), Some(u)) => (Some(l), Some(h), Some(u)),
            _ => {
                let avail: Vec<u64> = self.device_full.iter().map(|d| d.available).collect();
                (avail.iter().min().copied(), avail.iter().max().copied(), avail.first().copied())
            }
        };
        serde_json::json!({
            "kind": kind,
            "low": low,
            "high": high,
            "used": used,
            "allowed_maximum": self.allowed_used.map(|u| serde_json::json!({"low": self.allowed_low, "high": self.allowed_high, "used": u})),
            "device_full": self.device_full,
            "retries": self.retries,
            "outside": self.outside.steps.iter().map(|&(r, b)| serde_json::json!({"from_request": r, "bytes": b})).collect::<Vec<_>>(),
            "device_memory": self.device_memory.bytes,
            "device_memory_source": self.device_memory.source,
            "device_memory_range": self.device_memory.range,
            "device_memory_note": self.device_memory.note,
            "from": self.from,
            "recorded_ooms": self.recorded_ooms,
            "reproduces": self.reproduces,
            "unexplained": self.unexplained,
            "description": self.describe(),
        })
    }
}

/// `cuMemAddressReserve`'s size for a new expandable segment on a device of `total` bytes.
fn reservation_size(total: u64, segment_size: u64) -> u64 {
    (total + total / 8).div_ceil(segment_size) * segment_size
}

/// The first `t` in `lo..=hi` where `pred` turns false (`pred` true then false), or `hi + 1`.
fn partition(mut lo: u64, mut hi: u64, pred: impl Fn(u64) -> bool) -> u64 {
    hi += 1;
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if pred(mid) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

/// How far apart the driver placed consecutive reservations beyond their size: their bases are
/// aligned to this (measured on an H200 with CUDA 13).
const RESERVATION_ALIGN: u64 = 32 << 20;

/// Whether a cluster of expandable-segment addresses starts at its reservation's base although the
/// trace did not show that reservation being made (it was made before the history began): its
/// lowest address, a final segment's or a page the trace unmaps but never maps, is aligned as the driver aligns
/// reservation bases ([`RESERVATION_ALIGN`]). The allocator maps an expandable segment's pages from
/// the reservation's start upwards (`ExpandableSegment::map`), and the snapshot starts a segment at
/// each head block, so the lowest page a cluster shows is most often the base; a lower page unmapped
/// earlier would make the spacing, and so the inferred total, too small by a multiple of the page,
/// which the pairs' bounds then usually refuse (`lo > hi`: the H200 default). Motivated by PyTorch's
/// own tests recorded on an H100 (`traces/field/test_cuda/`: `refused_settings__expandable`,
/// `fraction_midrun__expandable`, `retries_devfull__expandable`): the test process's first
/// reservation predates the history, the next one is recorded, and only their spacing tells the
/// card's memory (85017493504 bytes, not an H200's).
fn reservation_base_before_history(cluster: &[(u64, u64, Option<usize>, bool)]) -> bool {
    // A lowest page the trace itself maps is left to the rule above (its first event there).
    cluster.first().is_some_and(|&(base, ..)| base % RESERVATION_ALIGN == 0 && !cluster.iter().any(|t| t.0 == base && t.3))
}

/// The device's total memory as far as the trace shows it. `segments`: the snapshot's final
/// segments of this device; `large_segment_size`: the large pool's expandable page size
/// (`large_segment_size_mb`).
///
/// Two readings, in this order: the segment events and final segments (what the allocator
/// reserved, and the spacing of expandable segments' reservations: [`memory_from_segments`]),
/// then the OOM entries, which can only raise it: an OOM records what the device had free
/// (`device_free`, from `cudaMemGetInfo`), and the device holds at least that plus what the
/// allocator had reserved then (`allocsim_program::oom::RecordedMemory::least_device_memory`). A stream that reads the segment events first
/// makes the first reading before the replay and checks each OOM entry against it as it comes
/// (`allocsim_replay::stream`), so every road gives this answer.
pub fn infer_device_memory(trace: &[TraceEntry], segments: &[SnapshotSegment], large_segment_size: u64) -> DeviceMemory {
    let mut recorded = allocsim_program::oom::RecordedMemory::default();
    trace.iter().for_each(|e| recorded.push(e, 0));
    raised_by_ooms(memory_from_segments(trace, segments, large_segment_size), recorded.least_device_memory())
}

/// `memory` as the segment events show it, with what an OOM entry shows (`oom_lower`: free +
/// reserved at it). Within the range the reservations' spacing gives, the OOM raises its lower
/// end ([`within_spacing`]: an H200's bytes where they still fit, else the middle); above that
/// range it contradicts the spacing, which is then set aside; with no range, it raises the
/// H200 assumed. (Where it changes nothing, `memory` comes back as it is.)
pub fn raised_by_ooms(memory: DeviceMemory, oom_lower: u64) -> DeviceMemory {
    let spacing = memory.range.filter(|&(_, hi)| memory.source == DeviceMemorySource::Inferred && hi != u64::MAX);
    match spacing {
        Some((lo, hi)) if oom_lower > lo && oom_lower <= hi => {
            within_spacing(oom_lower, hi, "an OOM entry (reserved + free) and the spacing of the expandable segments' address reservations show")
        }
        Some((_, hi)) if oom_lower > hi => raised_by_ooms(DeviceMemory::h200_assumed(), oom_lower),
        _ if oom_lower <= memory.bytes => memory,
        _ => DeviceMemory {
            bytes: oom_lower,
            source: DeviceMemorySource::Inferred,
            range: Some((oom_lower, u64::MAX)),
            note: if oom_lower > H200_TOTAL_MEMORY {
                "at least what an OOM entry shows (reserved + free); more than an H200 has".to_string()
            } else {
                "at least what an OOM entry shows (reserved + free)".to_string()
            },
        },
    }
}

/// The device's memory between `lo` and `hi` (`shows`: what bounds it, in words): an H200's
/// bytes where they lie in the range (the card the recordings come from), else the range's
/// middle to the MiB.
fn within_spacing(lo: u64, hi: u64, shows: &str) -> DeviceMemory {
    if (lo..=hi).contains(&H200_TOTAL_MEMORY) {
        return DeviceMemory {
            bytes: H200_TOTAL_MEMORY,
            source: DeviceMemorySource::Inferred,
            range: Some((lo, hi)),
            note: format!("an H200's {H200_TOTAL_MEMORY} bytes, within {}–{} as {shows}", format_size(lo), format_size(hi)),
        };
    }
    let mid = (lo / 2 + hi / 2) >> 20 << 20;
    DeviceMemory {
        bytes: mid.clamp(lo, hi),
        source: DeviceMemorySource::Inferred,
        range: Some((lo, hi)),
        note: format!("between {} and {} as {shows} (--device-memory sets it exactly)", format_size(lo), format_size(hi)),
    }
}

/// The device's total memory as the segment events and final segments show it (the OOM entries
/// aside: [`infer_device_memory`]).
fn memory_from_segments(trace: &[TraceEntry], segments: &[SnapshotSegment], large_segment_size: u64) -> DeviceMemory {
    // A lower bound: the most the allocator reserved.
    let mut reserved = 0i64;
    let mut lower = 0u64;
    // Addresses the expandable segments touched: (address, size, trace order or None for a final
    // segment, a map).
    let mut touched: Vec<(u64, u64, Option<usize>, bool)> = Vec::new();
    for (i, e) in trace.iter().enumerate() {
        match e.action {
            Action::SegmentAlloc | Action::SegmentMap => {
                reserved += e.size as i64;
                if e.action == Action::SegmentMap {
                    touched.push((e.addr, e.size, Some(i), true));
                }
            }
            Action::SegmentFree | Action::SegmentUnmap => {
                reserved -= e.size as i64;
                if e.action == Action::SegmentUnmap {
                    touched.push((e.addr, e.size, Some(i), false));
                }
            }
            _ => {}
        }
        lower = lower.max(reserved.max(0) as u64);
    }
    touched.extend(segments.iter().filter(|s| s.is_expandable).map(|s| (s.address, if s.is_small { K_SMALL_BUFFER } else { large_segment_size }, None, false)));
    let default = || {
        if lower > H200_TOTAL_MEMORY {
            DeviceMemory {
                bytes: lower,
                source: DeviceMemorySource::Inferred,
                range: Some((lower, u64::MAX)),
                note: "at least what the allocator reserved; more than an H200 has".into(),
            }
        } else {
            DeviceMemory::h200_assumed()
        }
    };
    if touched.is_empty() {
        return default();
    }
    // Reservations: the touched addresses in clusters. Within one, addresses lie less than the
    // device's memory apart; reservations lie at least 1.125 times that apart. A cluster's
    // lowest address is its reservation's base when the trace made the reservation: its first
    // event there is a map at that address (a trace that starts mid-history may not show it).
    touched.sort_unstable_by_key(|t| t.0);
    let gap = lower.max(1 << 30);
    // (base, small pool, base known)
    let mut bases: Vec<(u64, bool, bool)> = Vec::new();
    let mut cluster: Vec<(u64, u64, Option<usize>, bool)> = Vec::new();
    let close = |cluster: &mut Vec<(u64, u64, Option<usize>, bool)>, bases: &mut Vec<(u64, bool, bool)>| {
        let Some(&(base, ..)) = cluster.first() else { return };
        let small = cluster.iter().all(|t| t.1 < large_segment_size.min(K_LARGE_BUFFER) || t.1 % large_segment_size != 0);
        let first = cluster.iter().filter(|t| t.2.is_some()).min_by_key(|t| t.2);
        let known = first.is_some_and(|f| f.3 && f.0 == base) || reservation_base_before_history(cluster);
        bases.push((base, small, known));
        cluster.clear();
    };
    let mut last = 0u64;
    for &t in &touched {
        if !cluster.is_empty() && t.0 - last > gap {
            close(&mut cluster, &mut bases);
        }
        cluster.push(t);
        last = t.0;
    }
    close(&mut cluster, &mut bases);
    let pairs: Vec<(u64, bool)> = bases.windows(2).filter(|w| w[0].2 && w[1].2).map(|w| (w[1].0 - w[0].0, w[0].1)).collect();
    if pairs.is_empty() {
        return default();
    }
    // Each pair of neighbouring bases: reservation ≤ spacing (hard), and, the driver packing
    // reservations, reservation > spacing − alignment − one page.
    let (mut lo, mut hi) = (lower, u64::MAX);
    for &(spacing, small) in &pairs {
        let seg = if small { K_SMALL_BUFFER } else { large_segment_size };
        let floor = spacing.saturating_sub(RESERVATION_ALIGN);
        // Largest total whose reservation fits the spacing; smallest whose exceeds spacing − align.
        let largest = partition(0, spacing, |t| reservation_size(t, seg) <= spacing).saturating_sub(1);
        let smallest = partition(0, spacing, |t| reservation_size(t, seg) <= floor);
        hi = hi.min(largest);
        lo = lo.max(smallest);
    }
    if lo > hi {
        return default();
    }
    within_spacing(lo, hi, "the spacing of the expandable segments' address reservations shows")
}

/// A recorded segment event: (request, action, address, size).
pub type RecordedEvent = (u32, Action, u64, u64);

/// The recorded segment events and the requests recorded as OOMs, in order.
pub fn recorded_events(trace: &[TraceEntry]) -> (Vec<RecordedEvent>, Vec<u32>) {
    let mut events = Vec::new();
    let mut ooms = Vec::new();
    let mut req = 0u32;
    for e in trace {
        match e.action {
            Action::SegmentAlloc | Action::SegmentFree | Action::SegmentMap | Action::SegmentUnmap => events.push((req, e.action, e.addr, e.size)),
            Action::Alloc => req += 1,
            Action::Oom => {
                ooms.push(req);
                req += 1
            }
            _ => {}
        }
    }
    (events, ooms)
}

/// Whether a replay made exactly the recorded segment events and OOMs.
pub fn reproduces(o: &ReplayOutcome, trace: &[TraceEntry]) -> bool {
    let (events, ooms) = recorded_events(trace);
    made_recorded(&events, &ooms, &o.segment_events, &o.ooms)
}

/// Whether a replay's segment events and OOMs (`simulated`, `simulated_ooms`) are exactly the
/// recorded ones (`events`, `ooms`: as [`recorded_events`] gives them), each at its request. The
/// one comparison behind `Budget::reproduces`, in memory ([`reproduces`]) and streamed.
pub fn made_recorded(
    events: &[RecordedEvent],
    ooms: &[u32],
    simulated: &[allocsim_program::replay::SegmentEvent],
    simulated_ooms: &[allocsim_program::replay::Oom],
) -> bool {
    events.len() == simulated.len()
        && events.iter().zip(simulated).all(|(a, b)| *a == (b.request, b.action, b.addr, b.size))
        && ooms.len() == simulated_ooms.len()
        && ooms.iter().zip(simulated_ooms).all(|(a, b)| *a == b.request)
}

/// Whether a budget could explain why a replay without one (`simulated`, its segment events)
/// differs from the recording (`recorded`, the trace's segment entries): the trace has OOM
/// entries (`recorded_ooms`), or the replay releases where the recording does something else
/// (the allocator's own releases under an allowed maximum, `max_split_size`'s and garbage
/// collection's, release less than the `empty_cache()` the replay takes them for). A trace that
/// replays exactly, or differs otherwise, gets no budget.
pub fn budget_may_explain(recorded: &[TraceEntry], simulated: &[allocsim_program::replay::SegmentEvent], recorded_ooms: bool) -> bool {
    let Some(i) = first_difference(recorded, simulated) else {
        return false;
    };
    budget_may_explain_at(simulated.get(i), recorded_ooms)
}

/// [`budget_may_explain`] at the first difference, where the replay made `simulated` (`None`:
/// no more events than the recording's).
pub fn budget_may_explain_at(simulated: Option<&allocsim_program::replay::SegmentEvent>, recorded_ooms: bool) -> bool {
    // Without a maximum the model takes a release run it does not make itself for an
    // `empty_cache()`, which releases every free segment: a maximum changes a release there. A
    // release the replay cannot make at all (the segment is not free in it) is no budget's doing.
    recorded_ooms || simulated.is_some_and(|b| b.action.releases())
}

/// Whether a replay's segment event is the recorded one (action, address, size).
pub fn same_segment_event(recorded: &TraceEntry, simulated: &allocsim_program::replay::SegmentEvent) -> bool {
    (recorded.action, recorded.addr, recorded.size) == (simulated.action, simulated.addr, simulated.size)
}

/// The first recorded segment event (action, address, size) a replay's differs from, if any.
pub fn first_difference(recorded: &[TraceEntry], simulated: &[allocsim_program::replay::SegmentEvent]) -> Option<usize> {
    (0..recorded.len().max(simulated.len())).find(|&i| match (recorded.get(i), simulated.get(i)) {
        (Some(a), Some(b)) => !same_segment_event(a, b),
        _ => true,
    })
}

/// What the trace shows at each request: the reserved bytes before its entry, and (for a
/// success that got new memory) the reserved bytes after its last new segment or pages.
struct Walk {
    /// Device-full OOMs.
    full: Vec<DeviceFullOom>,
    /// (request, rounded size, reserved at the entry) of OOMs whose device had room.
    allowed_ooms: Vec<(u32, u64, u64)>,
    /// (request, reserved after its new memory, reserved before its first new segment, bytes of
    /// its first new segment or `None` for pages) of each request that got new memory.
    grew: Vec<(u32, u64, u64, Option<u64>)>,
    ooms: usize,
    /// Mallocs that retried on a full device ([`MallocRetries`]).
    retries: MallocRetries,
}

/// `initial_reserved`: the bytes reserved before the trace's first entry (a trace that starts
/// mid-history).
fn walk(trace: &[TraceEntry], initial_reserved: u64, own: &AllocatorConfig, device_memory: u64) -> Walk {
    let mut w = Walker::with_initial(own, device_memory, initial_reserved);
    trace.iter().for_each(|e| w.push(e));
    w.w
}

/// [`walk`] entry by entry, for a trace read as it comes (`allocsim_replay::stream::replay_speculating`):
/// the maximum the entries so far point to.
pub struct Walker {
    w: Walk,
    own: AllocatorConfig,
    device_memory: u64,
    reserved: i64,
    /// The new memory since the last request entry: (reserved before the first, its size or None).
    pending: Option<(u64, Option<u64>)>,
    req: u32,
    /// Each request's size, by ordinal.
    sizes: Vec<u64>,
}

impl Walker {
    /// For a trace that starts from an empty allocator.
    pub fn new(own: &AllocatorConfig, device_memory: u64) -> Walker {
        Walker::with_initial(own, device_memory, 0)
    }

    fn with_initial(own: &AllocatorConfig, device_memory: u64, initial_reserved: u64) -> Walker {
        Walker {
            w: Walk { full: Vec::new(), allowed_ooms: Vec::new(), grew: Vec::new(), ooms: 0, retries: MallocRetries::with_initial(initial_reserved) },
            own: own.clone(),
            device_memory,
            reserved: initial_reserved as i64,
            pending: None,
            req: 0,
            sizes: Vec::new(),
        }
    }

    pub fn push(&mut self, e: &TraceEntry) {
        self.w.retries.push(e);
        let (w, own, req) = (&mut self.w, &self.own, &mut self.req);
        let r = self.reserved.max(0) as u64;
        match e.action {
            Action::SegmentAlloc | Action::SegmentMap => {
                self.pending.get_or_insert((r, (e.action == Action::SegmentAlloc).then_some(e.size)));
                self.reserved += e.size as i64;
            }
            Action::SegmentFree | Action::SegmentUnmap => {
                self.reserved -= e.size as i64;
                self.pending = None;
            }
            Action::Alloc => {
                if let Some((before, first)) = self.pending.take() {
                    w.grew.push((*req, r, before, first));
                }
                self.sizes.push(e.size);
                *req += 1;
            }
            Action::Oom => {
                self.pending = None;
                w.ooms += 1;
                let alloc_size = own.get_allocation_size(e.size);
                if e.addr < alloc_size {
                    let available = r.saturating_add(e.addr);
                    w.full.push(DeviceFullOom {
                        request: *req,
                        device_free: e.addr,
                        reserved: r,
                        available,
                        outside: self.device_memory.saturating_sub(available),
                    });
                } else {
                    w.allowed_ooms.push((*req, e.size, r));
                }
                self.sizes.push(e.size);
                *req += 1;
            }
            _ => {}
        }
    }

    /// The allowed maximum [`infer`] would pick from the bounds the entries so far give, when
    /// they show an OOM of the allowed maximum and no device-full one.
    pub fn capacity_to_try(&self) -> Option<u64> {
        self.allowed_bounds().map(|b| pick_used(b.lo, b.hi))
    }

    /// The bounds [`Walker::capacity_to_try`] picks from, as `(lo, hi)`: the allowed maximum lies
    /// in `lo..=hi`.
    pub fn bounds(&self) -> Option<(u64, u64)> {
        self.allowed_bounds().map(|b| (b.lo, b.hi))
    }

    /// The bounds the entries so far give an allowed maximum, when they show an OOM of it, no
    /// device-full one, and bounds that do not contradict one another.
    fn allowed_bounds(&self) -> Option<Bounds> {
        if !self.w.full.is_empty() || self.w.allowed_ooms.is_empty() {
            return None;
        }
        let bounds = Bounds::of(&self.w, &self.own, self.device_memory, true, |req| self.sizes.get(req as usize).copied().unwrap_or(0));
        bounds.note.is_none().then_some(bounds)
    }
}

/// The device-full rule (see the module documentation) as memory outside the allocator over
/// time. `grew`: (request, reserved after its new memory).
fn outside_schedule(full: &[DeviceFullOom], grew: &[(u32, u64)], device_memory: u64) -> OutsideMemory {
    let mut avail: Vec<(u32, u64)> = Vec::new(); // (from request, bytes available)
    let push = |v: &mut Vec<(u32, u64)>, r: u32, b: u64| match v.last_mut() {
        Some(l) if l.1 == b => {}
        Some(l) if l.0 == r => l.1 = b,
        _ => v.push((r, b)),
    };
    let mut from = 0u32;
    for oom in full {
        // Successes before this OOM (from the previous one on): suffix maxima.
        let seg: Vec<(u32, u64)> = grew.iter().copied().filter(|&(r, _)| r >= from && r < oom.request).collect();
        let mut suffix = vec![oom.available; seg.len() + 1];
        for i in (0..seg.len()).rev() {
            suffix[i] = suffix[i + 1].max(seg[i].1);
        }
        push(&mut avail, from, suffix[0]);
        for (i, &(r, _)) in seg.iter().enumerate() {
            push(&mut avail, r + 1, suffix[i + 1]);
        }
        from = oom.request + 1;
    }
    if let Some(last) = full.last() {
        let mut cur = last.available;
        push(&mut avail, from, cur);
        for &(r, need) in grew.iter().filter(|&&(r, _)| r >= from) {
            if need > cur {
                cur = need;
                push(&mut avail, r, cur);
            }
        }
    }
    OutsideMemory { steps: avail.into_iter().map(|(r, b)| (r, device_memory.saturating_sub(b))).collect() }
}

/// Infers the budget of `program` (one device's `trace`, recorded under `own`) on a device of
/// `device_memory` bytes whose segments go where `placement` says. Returns the budget and, when
/// it computed it, the replay under it with the `empty_cache()` calls inferred.
pub fn infer(
    trace: &[TraceEntry],
    program: &Program,
    own: &AllocatorConfig,
    device_memory: DeviceMemory,
    placement: &Placement,
) -> (Budget, Option<ReplayOutcome>) {
    let d = device_memory.bytes;
    let w = walk(trace, program.initial.as_ref().map_or(0, |s| s.reserved_bytes()), own, d);
    // Retries on a full device (no OOM entry): kept where the replay under them reproduces the
    // trace and makes every retry; else the trace is read without them.
    let retried = walked_with(&w, device_memory.clone(), true);
    if !retried.retries.is_empty() {
        let o = ReplayOptions { config: own.clone(), capacity: None, device_memory: d, placement: placement.clone(), outside: retried.outside.clone() };
        let outcome = replay(program, &o, EmptyCacheCalls::Infer(trace));
        if reproduces(&outcome, trace) && outcome.stats.num_alloc_retries as usize >= retried.retries.len() {
            let mut budget = retried;
            budget.kind = Some(BudgetKind::DeviceFull);
            budget.reproduces = true;
            return (budget, Some(outcome));
        }
    }
    let mut budget = walked(&w, device_memory);
    let opts = |capacity: Option<u64>| ReplayOptions {
        config: own.clone(),
        capacity,
        device_memory: d,
        placement: placement.clone(),
        outside: budget.outside.clone(),
    };
    // Without an allowed maximum: up to its first difference from the recorded segment events,
    // which is all the decisions below need of it unless it is the answer.
    let segment_entries: Vec<TraceEntry> = trace.iter().filter(|e| e.action.is_segment_event()).copied().collect();
    let plain = Plain::up_to_difference(program, &opts(None), trace, &segment_entries);
    if segment_entries.is_empty() || !budget_may_explain(&segment_entries, plain.segment_events(), w.ooms > 0) {
        // Nothing to infer from (no segment events: a trace recorded without them, or generated),
        // or the replay is exact, or it differs where no budget could make it agree.
        let plain = plain.whole();
        budget.reproduces = reproduces(&plain, trace);
        if !w.full.is_empty() {
            budget.kind = Some(BudgetKind::DeviceFull);
        }
        return (budget, Some(plain));
    }
    if plain.reproduces(trace) {
        if !w.full.is_empty() {
            budget.kind = Some(BudgetKind::DeviceFull);
        }
        return (budget, Some(plain.whole()));
    }
    if w.full.is_empty() && w.allowed_ooms.is_empty() && w.grew.is_empty() {
        budget.reproduces = false;
        return (budget, Some(plain.whole()));
    }
    // An allowed maximum: the bounds the segments and OOMs give, then the replay narrows them.
    let request_size = |req: u32| program.requests.get(req as usize).map_or(0, |r| r.size);
    let bounds = Bounds::of(&w, own, d, program.reconstruct_error.is_none(), request_size);
    let (lo, hi) = (bounds.lo, bounds.hi);
    let mut from = budget.from.clone();
    from.extend(&bounds.from);
    budget.notes.extend(bounds.note);
    budget.bounds_contradict = bounds.contradiction;
    let refined = refine(trace, program, &opts(Some(hi)), lo, hi);
    let used = pick_used(refined.lo, refined.hi);
    let outcome = replay(program, &opts(Some(used)), EmptyCacheCalls::Infer(trace));
    let reproduced = reproduces(&outcome, trace);
    if !reproduced && w.allowed_ooms.is_empty() && matching_prefix(plain.segment_events(), trace) >= matching_prefix(&outcome.segment_events, trace) {
        // No OOM asks for a maximum, and one explains no more of the trace than none: none.
        budget.reproduces = false;
        if !w.full.is_empty() {
            budget.kind = Some(BudgetKind::DeviceFull);
        }
        return (budget, Some(plain.whole()));
    }
    allowed_maximum(&mut budget, refined, from, reproduced);
    (budget, Some(outcome))
}

/// The budget of a trace that starts from an empty allocator and records OOMs of the allowed
/// maximum, where a replay under `tried` made `outcome` with no comparison with the maximum
/// flipping between the bounds the trace gives (`checks`: the flips of every comparison it
/// made, [`CachingAllocator::limit_probe`]), and the replay without a maximum differs from the
/// recording: what [`infer`] infers for the same trace when `tried` is the value it picks, for
/// then its refinement narrows nothing and its replay under that value is `outcome`. `None`
/// otherwise (device-full OOMs, bounds that contradict one another, a comparison that flips
/// within them, another value picked): only [`infer`] answers.
pub fn speculated(
    trace: &[TraceEntry],
    own: &AllocatorConfig,
    device_memory: DeviceMemory,
    tried: u64,
    checks: &[u64],
    outcome: &ReplayOutcome,
) -> Option<Budget> {
    let d = device_memory.bytes;
    let mut walker = Walker::new(own, d);
    trace.iter().for_each(|e| walker.push(e));
    let bounds = walker.allowed_bounds()?;
    if checks.iter().any(|&v| bounds.lo < v && v <= bounds.hi) || pick_used(bounds.lo, bounds.hi) != tried {
        return None;
    }
    let mut budget = walked(&walker.w, device_memory);
    let mut from = budget.from.clone();
    from.extend(&bounds.from);
    let refined = Refined { lo: bounds.lo, hi: bounds.hi, from: Vec::new(), unexplained: Vec::new(), gaps: false };
    allowed_maximum(&mut budget, refined, from, reproduces(outcome, trace));
    Some(budget)
}

/// The budget as the walk alone shows it: the OOMs, the device-full ones, the memory outside
/// the allocator over time.
fn walked(w: &Walk, device_memory: DeviceMemory) -> Budget {
    walked_with(w, device_memory, false)
}

/// [`walked`], with the mallocs' retries on a full device read as such (`retries`) where the
/// trace has no OOM entry: each retry is a point where the allocator had exactly what it
/// reserved after the retry's new memory, as a device-full OOM's `available`.
fn walked_with(w: &Walk, device_memory: DeviceMemory, retries: bool) -> Budget {
    let d = device_memory.bytes;
    let mut budget = Budget::none(device_memory);
    budget.recorded_ooms = w.ooms;
    budget.allowed_ooms = w.allowed_ooms.len();
    let grew: Vec<(u32, u64)> = w.grew.iter().map(|g| (g.0, g.1)).collect();
    if retries && w.ooms == 0 && !w.retries.found.is_empty() {
        let points: Vec<DeviceFullOom> = w
            .retries
            .found
            .iter()
            .map(|r| DeviceFullOom {
                request: r.request,
                device_free: 0,
                reserved: r.available,
                available: r.available,
                outside: d.saturating_sub(r.available),
            })
            .collect();
        budget.outside = outside_schedule(&points, &grew, d);
        budget.retries = w.retries.found.clone();
        budget.from = budget.retries.iter().map(|r| r.request).collect();
        return budget;
    }
    budget.outside = outside_schedule(&w.full, &grew, d);
    if let Some(max) = w.full.iter().map(|f| f.available).max()
        && max > d
    {
        budget.notes.push(format!(
            "an OOM entry shows {} available to the allocator, more than the device's {}: pass --device-memory",
            format_size(max),
            format_size(d)
        ));
    }
    budget.device_full = w.full.clone();
    budget.from = w.full.iter().map(|f| f.request).collect();
    budget
}

/// The bounds the segments and OOMs give the allowed maximum, before a replay narrows them.
struct Bounds {
    lo: u64,
    hi: u64,
    /// The requests of the OOMs that bound it from above.
    from: Vec<u32>,
    /// Where the bounds contradict one another (then `lo..=hi` is the whole device).
    note: Option<String>,
    /// The contradicting bounds: (least the segments need, most the OOMs allow).
    contradiction: Option<(u64, u64)>,
}

impl Bounds {
    /// `sizes_known`: the requests' sizes are those of the trace (`request_size` by ordinal);
    /// else only new segments, not pages, bound it from below.
    fn of(w: &Walk, own: &AllocatorConfig, d: u64, sizes_known: bool, request_size: impl Fn(u32) -> u64) -> Bounds {
        let mut lo = 0u64;
        if sizes_known {
            for &(req, _, before, first) in &w.grew {
                let need = match first {
                    Some(size) => before + size,
                    None => before + own.get_allocation_size(own.round_size(request_size(req))),
                };
                lo = lo.max(need);
            }
        }
        let mut hi = d.saturating_sub(1);
        let mut from = Vec::new();
        for &(req, size, reserved) in &w.allowed_ooms {
            let bound = reserved + own.get_allocation_size(size);
            if bound.saturating_sub(1) < hi {
                hi = bound.saturating_sub(1);
            }
            from.push(req);
        }
        let mut note = None;
        let mut contradiction = None;
        if lo > hi {
            contradiction = Some((lo, hi + 1));
            note = Some(format!(
                "the segments the trace got need at least {} allowed, more than its OOMs allow ({}): the maximum was searched over the whole device",
                format_size(lo),
                format_size(hi + 1)
            ));
            lo = 0;
            hi = d.saturating_sub(1);
        }
        Bounds { lo, hi, from, note, contradiction }
    }
}

/// Sets an allowed maximum refined as `refined`, inferred from the requests `from` (besides the
/// refinement's), whose replay `reproduced` the recording or not.
fn allowed_maximum(budget: &mut Budget, refined: Refined, mut from: Vec<u32>, reproduced: bool) {
    from.extend(&refined.from);
    from.sort_unstable();
    from.dedup();
    budget.reproduces = reproduced;
    budget.kind = Some(BudgetKind::AllowedMaximum);
    budget.allowed_low = Some(refined.lo);
    budget.allowed_high = Some(refined.hi);
    budget.allowed_used = Some(pick_used(refined.lo, refined.hi));
    budget.unexplained = refined.unexplained;
    if refined.gaps {
        budget.notes.push("the values of the allowed maximum that reproduce the trace do not form one interval; the interval given spans them".into());
    }
    budget.from = from;
}

/// How many recorded segment events a replay's (`simulated`) reproduce before the first
/// difference.
fn matching_prefix(simulated: &[SegmentEvent], trace: &[TraceEntry]) -> usize {
    let (events, _) = recorded_events(trace);
    events.iter().zip(simulated).take_while(|(a, b)| **a == (b.request, b.action, b.addr, b.size)).count()
}

/// The replay of a program without an allowed maximum, run up to the first segment event that
/// differs from the recorded ones (`Partial`), or to its end when none does (`Whole`). What
/// [`infer`] asks of it before it is the answer ([`budget_may_explain`], [`reproduces`],
/// [`matching_prefix`]) depends only on the events up to that difference; `whole` runs the rest.
enum Plain<'a> {
    Whole(Box<ReplayOutcome>),
    Partial(Box<ProgramReplay<'a, SimDevice, InferredCalls<'a>>>),
}

/// `empty_cache_calls(…, EmptyCacheCalls::Infer(…))`, boxed.
type InferredCalls<'a> = Box<dyn FnMut(&CachingAllocator<SimDevice>, usize) -> bool + 'a>;

impl<'a> Plain<'a> {
    fn up_to_difference(program: &'a Program, opts: &ReplayOptions, trace: &'a [TraceEntry], recorded: &[TraceEntry]) -> Plain<'a> {
        let device = SimDevice::new(opts.device_memory, opts.placement.clone());
        let calls: InferredCalls<'a> = Box::new(empty_cache_calls(program, EmptyCacheCalls::Infer(trace)));
        let mut r = ProgramReplay::new(program, opts, device, calls);
        let mut compared = 0;
        while r.step() {
            let simulated = r.segment_events();
            while compared < simulated.len() {
                if !recorded.get(compared).is_some_and(|e| same_segment_event(e, &simulated[compared])) {
                    return Plain::Partial(Box::new(r));
                }
                compared += 1;
            }
        }
        Plain::Whole(Box::new(r.finish(|_, _| {})))
    }

    fn segment_events(&self) -> &[SegmentEvent] {
        match self {
            Plain::Whole(o) => &o.segment_events,
            Plain::Partial(r) => r.segment_events(),
        }
    }

    /// Whether it made exactly the recorded segment events and OOMs (never, when it stopped at
    /// a difference).
    fn reproduces(&self, trace: &[TraceEntry]) -> bool {
        match self {
            Plain::Whole(o) => reproduces(o, trace),
            Plain::Partial(_) => false,
        }
    }

    fn whole(self) -> ReplayOutcome {
        match self {
            Plain::Whole(o) => *o,
            Plain::Partial(r) => r.finish(|_, _| {}),
        }
    }
}

/// The value replays use from the interval: the one with the most trailing zero bits (a round
/// number, as caps given in bytes usually are).
pub fn pick_used(lo: u64, hi: u64) -> u64 {
    for k in (0..63).rev() {
        let step = 1u64 << k;
        let m = lo.div_ceil(step).saturating_mul(step);
        if m <= hi {
            return m;
        }
    }
    lo
}

struct Refined {
    lo: u64,
    hi: u64,
    from: Vec<u32>,
    unexplained: Vec<u32>,
    gaps: bool,
}

/// What a group of ops (completions and release runs, then a malloc) did, as (action, address,
/// size) of its segment events and the malloc's address (`None`: out of memory).
type GroupOutcome = (Vec<(Action, u64, u64)>, Option<u64>);

/// One trial of a group at one maximum: what it did, and the values at which its comparisons
/// with the maximum flip.
struct Trial {
    /// The maximum it was tried at.
    at: u64,
    outcome: GroupOutcome,
    checks: Vec<u64>,
}

/// At most this many trials per group (a guard; real groups need a handful).
const MAX_TRIALS_PER_GROUP: usize = 64;

/// Replays `program` under `opts` (whose capacity is a point of `lo..=hi`) and narrows the
/// interval where a malloc's decisions depend on the maximum (see the module documentation).
fn refine(trace: &[TraceEntry], program: &Program, opts: &ReplayOptions, mut lo: u64, mut hi: u64) -> Refined {
    let mut out = Refined { lo, hi, from: Vec::new(), unexplained: Vec::new(), gaps: false };
    let device = SimDevice::new(opts.device_memory, opts.placement.clone());
    let mut st = Stepper::new(opts, device, VecSlots::new(program.requests.len()), &program.private_pools, program.initial.as_ref());
    st.set_pool_actions(&program.pool_actions);
    let mut inference = Inference::default();
    let mut a = hi;
    st.alloc.allowed_memory_maximum = Some(a);
    let ops = &program.ops;
    let mut i = 0usize;
    while i < ops.len() {
        // A group: completions and release runs right before a malloc, and the malloc.
        let mut m = i;
        while m < ops.len() && matches!(ops[m], Op::Complete(_) | Op::CompletePre(_) | Op::ReleaseRun { .. }) {
            m += 1;
        }
        let Some(Op::Malloc(q)) = ops.get(m).copied() else {
            // Not before a malloc: nothing here compares with the maximum.
            let end = m.min(ops.len() - 1).max(i);
            for j in i..=end {
                step_op(&mut st, &mut inference, program, trace, j);
            }
            i = end + 1;
            continue;
        };
        let r = program.requests[q as usize];
        if m == i && st.alloc.finds_cached_block(r.size, r.stream, r.route) {
            step_op(&mut st, &mut inference, program, trace, i);
            i += 1;
            continue;
        }
        let recorded = recorded_group(trace, program, i, m);
        let first = trial(&st, &inference, program, trace, i, m, a);
        let (rl, rh) = region(&first.checks, a, lo, hi);
        if rl == lo && rh == hi {
            run_group(&mut st, &mut inference, program, trace, i, m, a);
            i = m + 1;
            continue;
        }
        // The maximum matters here: try every region of the interval.
        let mut matching: Vec<(u64, u64)> = Vec::new();
        let mut chosen: Option<u64> = None;
        let mut x = lo;
        let mut trials = 0;
        loop {
            let t = if x == a { None } else { Some(trial(&st, &inference, program, trace, i, m, x)) };
            let t = t.as_ref().unwrap_or(&first);
            let (xl, xh) = region(&t.checks, x, lo, hi);
            if t.outcome == recorded {
                matching.push((xl, xh));
                if chosen.is_none() || (xl..=xh).contains(&a) {
                    chosen = Some(t.at);
                }
            }
            trials += 1;
            if xh >= hi || trials >= MAX_TRIALS_PER_GROUP {
                break;
            }
            x = xh + 1;
        }
        match chosen {
            None => {
                out.unexplained.push(q);
                run_group(&mut st, &mut inference, program, trace, i, m, a);
            }
            Some(x) => {
                let new_lo = matching.iter().map(|m| m.0).min().unwrap_or(lo);
                let new_hi = matching.iter().map(|m| m.1).max().unwrap_or(hi);
                out.gaps |= matching.windows(2).any(|w| w[1].0 > w[0].1 + 1);
                if (new_lo, new_hi) != (lo, hi) {
                    out.from.push(q);
                }
                (lo, hi) = (new_lo, new_hi);
                a = x;
                // What the trial at `x` did (the same ops on the same state: the same result).
                run_group(&mut st, &mut inference, program, trace, i, m, a);
            }
        }
        i = m + 1;
    }
    out.lo = lo;
    out.hi = hi;
    out
}

/// The interval around `x` within `lo..=hi` where every comparison in `checks` goes as at `x`.
fn region(checks: &[u64], x: u64, lo: u64, hi: u64) -> (u64, u64) {
    let mut l = lo;
    let mut h = hi;
    for &v in checks {
        if v <= x {
            l = l.max(v);
        } else {
            h = h.min(v - 1);
        }
    }
    (l, h)
}

/// One op of the plain inference replay.
fn step_op<S: Slots>(
    st: &mut Stepper<SimDevice, S>,
    inference: &mut Inference,
    program: &Program,
    trace: &[TraceEntry],
    j: usize,
) -> allocsim_program::replay::Step {
    let op = program.ops[j];
    st.step(op, program.request_of(op), |alloc| inference.decide(alloc, j, &ProgramAhead { program, trace, oi: j }))
}

/// Ops `i..=m` (ending in a malloc) on a copy of `st` under maximum `x`.
fn trial(st: &Stepper<SimDevice, VecSlots>, inference: &Inference, program: &Program, trace: &[TraceEntry], i: usize, m: usize, x: u64) -> Trial {
    let mut t = st.fork();
    let mut inf = inference.clone();
    let probe: LimitProbe = Arc::new(Mutex::new(Vec::new()));
    t.alloc.limit_probe = Some(probe.clone());
    let before = t.segment_events().len();
    let address = run_group(&mut t, &mut inf, program, trace, i, m, x);
    let events = t.segment_events()[before..].iter().map(|e| (e.action, e.addr, e.size)).collect();
    let checks = std::mem::take(&mut *probe.lock().expect("limit probe"));
    Trial { at: x, outcome: (events, address), checks }
}

/// Ops `i..=m` (a group, ending in a malloc) on `st` under maximum `x`: the malloc's address.
fn run_group<S: Slots>(
    st: &mut Stepper<SimDevice, S>,
    inference: &mut Inference,
    program: &Program,
    trace: &[TraceEntry],
    i: usize,
    m: usize,
    x: u64,
) -> Option<u64> {
    st.alloc.allowed_memory_maximum = Some(x);
    (i..=m).map(|j| step_op(st, inference, program, trace, j)).last().and_then(|s| s.address)
}

/// What the trace recorded for ops `i..=m`: the releases of its release runs, the new segments
/// or pages right before the malloc's entry, and the malloc's address (`None`: an OOM).
fn recorded_group(trace: &[TraceEntry], program: &Program, i: usize, m: usize) -> GroupOutcome {
    let mut events = Vec::new();
    for op in &program.ops[i..m] {
        if let Op::ReleaseRun { start, end } = *op {
            events.extend(trace[start as usize..end as usize].iter().map(|e| (e.action, e.addr, e.size)));
        }
    }
    let Op::Malloc(q) = program.ops[m] else { unreachable!("a group ends in a malloc") };
    let r = program.requests[q as usize];
    let mut new = Vec::new();
    for e in trace[..r.trace_index as usize].iter().rev() {
        match e.action {
            Action::SegmentAlloc | Action::SegmentMap => new.push((e.action, e.addr, e.size)),
            Action::FreeCompleted => {}
            _ => break,
        }
    }
    new.reverse();
    events.extend(new);
    (events, (!r.recorded_oom).then_some(r.recorded_addr))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outside_memory_steps() {
        let o = OutsideMemory { steps: vec![(0, 10), (5, 20), (9, 5)] };
        assert_eq!([o.at(0), o.at(4), o.at(5), o.at(8), o.at(9), o.at(100)], [10, 10, 20, 20, 5, 5]);
    }

    #[test]
    fn used_value_is_round() {
        assert_eq!(pick_used(2_100_000_000, 2_200_000_000), 2 << 30);
        assert_eq!(pick_used(5, 5), 5);
        assert_eq!(pick_used(5, 7), 6);
    }

    #[test]
    fn region_between_flips() {
        assert_eq!(region(&[10, 20, 30], 25, 0, 100), (20, 29));
        assert_eq!(region(&[10, 20, 30], 5, 0, 100), (0, 9));
        assert_eq!(region(&[], 5, 3, 9), (3, 9));
    }

    #[test]
    fn reservation_spacing_bounds_the_device() {
        // Two reservations 32 MiB-aligned apart on an H200: large first, then small.
        let d = H200_TOTAL_MEMORY;
        let r = reservation_size(d, K_LARGE_BUFFER);
        let base = 0x3_0200_0000u64;
        let next = (base + r).div_ceil(RESERVATION_ALIGN) * RESERVATION_ALIGN;
        let e = |action, addr, size| TraceEntry { action, addr, size, stream: 0, time_us: 0, stack: 0, meta: 0 };
        let trace = vec![e(Action::SegmentMap, base, 20 << 20), e(Action::SegmentMap, next, 2 << 20)];
        let m = infer_device_memory(&trace, &[], K_LARGE_BUFFER);
        assert_eq!(m.bytes, d);
        assert_eq!(m.source, DeviceMemorySource::Inferred);
        // An 80 GiB card.
        let d80 = 85_899_345_920u64;
        let r80 = reservation_size(d80, K_LARGE_BUFFER);
        let next80 = (base + r80).div_ceil(RESERVATION_ALIGN) * RESERVATION_ALIGN;
        let trace = vec![e(Action::SegmentMap, base, 20 << 20), e(Action::SegmentMap, next80, 2 << 20)];
        let m = infer_device_memory(&trace, &[], K_LARGE_BUFFER);
        let (lo, hi) = m.range.unwrap();
        assert!(lo <= d80 && d80 <= hi, "{lo} {hi}");
        assert!(hi - lo < 64 << 20, "{lo} {hi}");
        // No expandable segments: the default.
        assert_eq!(infer_device_memory(&[], &[], K_LARGE_BUFFER).source, DeviceMemorySource::Default);
        // A trace that starts mid-history: its first event in the second reservation is a map
        // above the base, so the spacing tells nothing.
        let trace = vec![e(Action::SegmentMap, base, 20 << 20), e(Action::SegmentMap, next80 + (40 << 20), 2 << 20), e(Action::SegmentMap, next80, 2 << 20)];
        assert_eq!(infer_device_memory(&trace, &[], K_LARGE_BUFFER).source, DeviceMemorySource::Default);
    }

    /// An OOM entry (free + reserved) raises the device memory the segment events show, never
    /// lowers it, and reservations' spacing still bounds it from above; the clustering of the
    /// reservations does not depend on it (both pools' reservations stay two, though the OOM's
    /// bound is more than the gap from the large pool's last page to the small pool's base).
    #[test]
    fn ooms_raise_the_device_memory_and_do_not_change_the_reservations() {
        let d = H200_TOTAL_MEMORY;
        let e = |action, addr, size| TraceEntry { action, addr, size, stream: 0, time_us: 0, stack: 0, meta: 0 };
        let base = 0x3_0200_0000u64;
        let next = (base + reservation_size(d, K_LARGE_BUFFER)).div_ceil(RESERVATION_ALIGN) * RESERVATION_ALIGN;
        // 21.5 GiB mapped in the large pool's reservation (11 maps of 100 pages of 20 MiB), 2 MiB
        // in the small one's, then an OOM with what is left of the card free: the bound is the
        // H200's memory less 1 GiB, more than the 137.8 GiB from the last map to the small base.
        let map = 100 * K_LARGE_BUFFER;
        let mut trace: Vec<TraceEntry> = (0..11).map(|k| e(Action::SegmentMap, base + k * map, map)).collect();
        trace.push(e(Action::SegmentMap, next, 2 << 20));
        let reserved = 11 * map + (2 << 20);
        assert!(next - (base + 10 * map) < d - (1 << 30));
        trace.push(e(Action::Oom, d - (1 << 30) - reserved, 64 << 20));
        let m = infer_device_memory(&trace, &[], K_LARGE_BUFFER);
        assert_eq!((m.bytes, m.source), (d, DeviceMemorySource::Inferred), "{}", m.note);
        assert!(m.note.contains("spacing of the expandable segments"), "{}", m.note);
        assert_eq!(m, memory_from_segments(&trace, &[], K_LARGE_BUFFER), "an OOM below what the spacing shows changes nothing");
        // An OOM that shows more than the spacing's lower end: the range starts there, and the
        // H200's bytes, still in it, stay.
        let (lo, hi) = m.range.unwrap();
        assert!(lo < d && d < hi);
        let raised = raised_by_ooms(m.clone(), lo + 1);
        assert_eq!((raised.bytes, raised.range), (d, Some((lo + 1, hi))), "{}", raised.note);
        assert!(raised.note.contains("an OOM entry (reserved + free) and the spacing"), "{}", raised.note);
        // Above the H200's bytes: the middle of what is left.
        let raised = raised_by_ooms(m.clone(), d + 1);
        assert_eq!(raised.range, Some((d + 1, hi)));
        assert!(raised.bytes > d && raised.bytes <= hi, "{}", raised.bytes);
        // Beyond what the spacing allows: the spacing is set aside, and the OOM raises the H200
        // assumed, to at least what it shows.
        let raised = raised_by_ooms(m.clone(), hi + (1 << 30));
        assert_eq!((raised.bytes, raised.range), (hi + (1 << 30), Some((hi + (1 << 30), u64::MAX))));
        assert!(raised.note.starts_with("at least what an OOM entry shows"), "{}", raised.note);
        // No expandable segments: an H200 assumed, unless an OOM shows more.
        let trace = vec![e(Action::SegmentAlloc, base, 2 << 30), e(Action::Oom, 180 << 30, 2 << 30)];
        let m = infer_device_memory(&trace, &[], K_LARGE_BUFFER);
        assert_eq!((m.bytes, m.range), (182 << 30, Some((182 << 30, u64::MAX))));
        assert!(m.note.contains("more than an H200 has"), "{}", m.note);
    }
}
