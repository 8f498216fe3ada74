//! From trace entries to allocator requests: the "program" a trace describes.
//!
//! A request is each `alloc` or `oom` entry, on its stream, numbered in trace order (the request
//! ordinal). A free names its request, not its address, so the program can be replayed under any
//! config, where addresses differ. A block returns to its pool at its `free_completed`: a
//! `free_completed` right after its `free_requested` is an ordinary free; a later one is a
//! cross-stream free (`record_stream`) that completes where the trace shows it.
//! Runs of `segment_free`/`segment_unmap` are kept as [`Op::ReleaseRun`] markers: replaying under
//! the trace's own settings decides whether the model's own `malloc` made them or whether they
//! were an `empty_cache()` call (which the trace does not record), see `crate::replay`.
//!
//! # A trace that starts mid-history
//!
//! When the trace begins in the middle of a run (the ring buffer of `max_entries`), the state at
//! its first entry is reconstructed from the final segments ([`crate::restore`]) and kept in
//! [`Program::initial`]; the replay starts from it. The blocks that were already active are
//! numbered apart from the requests, in address order ("pre-existing block" `k` =
//! `initial.blocks[k]`), and freed by [`Op::FreePre`] / [`Op::CompletePre`]: request ordinals stay
//! the ordinals of the trace's `alloc`/`oom` entries. A run of releases at the very start (the tail
//! of an `empty_cache()` or of a `malloc`'s releases whose beginning was cut off) is replayed as
//! exactly those releases ([`Op::ForcedRelease`]).

use std::collections::HashMap;

use allocsim_model::AllocatorConfig;
use allocsim_model::allocator::{MempoolId, Route};
use allocsim_model::constants::H200_TOTAL_MEMORY;
use allocsim_trace::{Action, SnapshotSegment, StackId, TraceEntry};

use crate::restore::{InitialState, reconstruct};

/// One allocation request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Request {
    /// Requested bytes (for an `oom` entry: the rounded size the trace recorded).
    pub size: u64,
    pub stream: u64,
    pub route: Route,
    /// The trace recorded an `oom` for this request.
    pub recorded_oom: bool,
    /// The address the trace recorded (`alloc`), or `device_free` (`oom`).
    pub recorded_addr: u64,
    /// Index of the entry in the device trace.
    pub trace_index: u32,
    pub stack: StackId,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// `malloc` of request `.0`.
    Malloc(u32),
    /// `free` of request `req`; `deferred`: its events complete later (at a `Complete`).
    Free { req: u32, deferred: bool },
    /// The cross-stream events of request `.0`'s freed block completed.
    Complete(u32),
    /// A run of `segment_free`/`segment_unmap` entries (trace indices `start..end`).
    ReleaseRun { start: u32, end: u32 },
    /// `free` of pre-existing block `pre` (`Program::initial.blocks[pre]`).
    FreePre { pre: u32, deferred: bool },
    /// The cross-stream events of pre-existing block `.0`'s free completed.
    CompletePre(u32),
    /// A release at the very start of a truncated trace, replayed as recorded: the free segment
    /// at `addr` (`segment_free`), or the free expandable block at `addr` unmapped (`segment_unmap`).
    ForcedRelease { addr: u64, unmap: bool },
}

#[derive(Clone, Copy)]
enum Live {
    Req(u32),
    Pre(u32),
}

/// What the trace asks of the allocator, device by device.
#[derive(Clone, Debug, Default)]
pub struct Program {
    pub requests: Vec<Request>,
    pub ops: Vec<Op>,
    /// Frees (or completions) of addresses neither the trace nor the reconstructed initial state
    /// allocated (ignored).
    pub unknown_frees: u32,
    /// Private-pool ids the requests are routed to.
    pub private_pools: Vec<MempoolId>,
    /// The state at the trace's start when it starts mid-history (`None`: an empty allocator).
    pub initial: Option<InitialState>,
    /// Why the initial state could not be reconstructed (then the replay starts empty and frees of
    /// unknown blocks are ignored).
    pub reconstruct_error: Option<String>,
}

impl Program {
    /// Builds the program of one device's trace. `segments` (the snapshot's final segments of this
    /// device) tell which requests went to private pools (CUDA graphs, MemPools): a request whose
    /// block lies in a final private-pool segment on the same stream, allocated after that segment
    /// was. Private segments freed before the snapshot cannot be recognised; their requests are
    /// replayed in the default pools.
    pub fn build(trace: &[TraceEntry], segments: &[SnapshotSegment]) -> Program {
        Program::build_with(trace, segments, &AllocatorConfig::default(), H200_TOTAL_MEMORY)
    }

    /// [`Program::build`], reconstructing a truncated trace's initial state under the settings the
    /// trace was recorded under (`config`: its rounding and split rules) on a device of
    /// `device_memory` bytes (the expandable segments' reservation size).
    pub fn build_with(trace: &[TraceEntry], segments: &[SnapshotSegment], config: &AllocatorConfig, device_memory: u64) -> Program {
        let private = PrivateRanges::new(trace, segments);
        let mut p = Program::default();
        let mut live: HashMap<u64, Live> = HashMap::new();
        let mut pending: HashMap<u64, Live> = HashMap::new();
        match reconstruct(trace, segments, config, device_memory) {
            Ok(s) if s.is_empty() => {}
            Ok(s) => {
                for (k, b) in s.blocks.iter().enumerate() {
                    if b.pending {
                        pending.insert(b.addr, Live::Pre(k as u32));
                    } else {
                        live.insert(b.addr, Live::Pre(k as u32));
                    }
                }
                p.initial = Some(s);
            }
            // Without a sign of truncation, an inconsistency lies in the final segments (absent,
            // or from another moment), not in the trace: replay from empty without a note.
            Err(e) => p.reconstruct_error = starts_mid_history(trace).then_some(e),
        }
        // Does the trace have cross-stream frees (a completion not right after its request)?
        let cross_stream = has_cross_stream_frees(trace);
        let mut i = 0usize;
        while i < trace.len() {
            let e = &trace[i];
            match e.action {
                Action::Alloc | Action::Oom => {
                    let req = p.requests.len() as u32;
                    let route = if e.action == Action::Alloc { private.route(e.addr, e.stream, i) } else { Route::Default };
                    if let Route::Private(id) = route
                        && !p.private_pools.contains(&id) {
                            p.private_pools.push(id);
                        }
                    p.requests.push(Request {
                        size: e.size,
                        stream: e.stream,
                        route,
                        recorded_oom: e.action == Action::Oom,
                        recorded_addr: e.addr,
                        trace_index: i as u32,
                        stack: e.stack,
                    });
                    p.ops.push(Op::Malloc(req));
                    if e.action == Action::Alloc {
                        live.insert(e.addr, Live::Req(req));
                    }
                }
                Action::FreeRequested => match live.remove(&e.addr) {
                    Some(req) => {
                        let completed_next = trace
                            .get(i + 1)
                            .is_some_and(|n| n.action == Action::FreeCompleted && n.addr == e.addr);
                        // A completion right after the request is an ordinary free, unless the trace
                        // has cross-stream frees, the completion came measurably later (inside a
                        // later call: an ordinary free records both entries in the same call, 0–2 µs
                        // apart) and a malloc's device calls follow: then it may be the next
                        // malloc's OOM-retry synchronize completing a pending block, which the
                        // replay decides (see `crate::replay::replay`).
                        let later = completed_next && trace[i + 1].time_us - e.time_us >= SYNC_COMPLETION_MIN_US;
                        let immediate = completed_next && !(cross_stream && later && malloc_device_calls_follow(trace, i + 2));
                        p.ops.push(match req {
                            Live::Req(req) => Op::Free { req, deferred: !immediate },
                            Live::Pre(pre) => Op::FreePre { pre, deferred: !immediate },
                        });
                        if immediate {
                            i += 1;
                        } else {
                            pending.insert(e.addr, req);
                        }
                    }
                    None => p.unknown_frees += 1,
                },
                Action::FreeCompleted => match pending.remove(&e.addr) {
                    Some(Live::Req(req)) => p.ops.push(Op::Complete(req)),
                    Some(Live::Pre(pre)) => p.ops.push(Op::CompletePre(pre)),
                    None => p.unknown_frees += 1,
                },
                Action::SegmentFree | Action::SegmentUnmap if p.initial.is_some() && p.ops.is_empty() => {
                    // The tail of a release whose cause was cut off: replayed as recorded.
                    while i < trace.len() && matches!(trace[i].action, Action::SegmentFree | Action::SegmentUnmap) {
                        p.ops.push(Op::ForcedRelease { addr: trace[i].addr, unmap: trace[i].action == Action::SegmentUnmap });
                        i += 1;
                    }
                    continue;
                }
                Action::SegmentFree | Action::SegmentUnmap => {
                    let start = i;
                    while i + 1 < trace.len() && matches!(trace[i + 1].action, Action::SegmentFree | Action::SegmentUnmap) {
                        i += 1;
                    }
                    p.ops.push(Op::ReleaseRun { start: start as u32, end: i as u32 + 1 });
                }
                Action::SegmentAlloc | Action::SegmentMap | Action::Snapshot | Action::Annotate => {}
            }
            i += 1;
        }
        p
    }
}

/// Whether the trace refers to blocks or segments it did not allocate (frees, completions,
/// releases, unmaps of unknown addresses): it starts mid-history.
pub fn starts_mid_history(trace: &[TraceEntry]) -> bool {
    use std::collections::{BTreeMap, HashSet};
    let mut blocks: HashSet<u64> = HashSet::new();
    let mut segments: HashSet<u64> = HashSet::new();
    let mut mapped: BTreeMap<u64, u64> = BTreeMap::new();
    for e in trace {
        match e.action {
            Action::Alloc => {
                blocks.insert(e.addr);
            }
            Action::FreeRequested | Action::FreeCompleted if !blocks.contains(&e.addr) => return true,
            Action::FreeCompleted => {
                blocks.remove(&e.addr);
            }
            Action::SegmentAlloc => {
                segments.insert(e.addr);
            }
            Action::SegmentFree if !segments.remove(&e.addr) => return true,
            Action::SegmentMap => {
                mapped.insert(e.addr, e.addr.saturating_add(e.size));
            }
            Action::SegmentUnmap => {
                let inside = mapped.range(..=e.addr).next_back().is_some_and(|(_, &end)| end > e.addr);
                let first = mapped.range(..e.addr.saturating_add(e.size)).next_back().is_some_and(|(&s, _)| s >= e.addr);
                if !inside && !first {
                    return true;
                }
            }
            _ => {}
        }
    }
    false
}

/// Final private-pool segments, with the trace index from which each one held its range.
struct PrivateRanges {
    ranges: Vec<(u64, u64, u64, MempoolId, usize)>,
}

impl PrivateRanges {
    fn new(trace: &[TraceEntry], segments: &[SnapshotSegment]) -> PrivateRanges {
        let mut ranges = Vec::new();
        for s in segments.iter().filter(|s| s.pool_id != (0, 0)) {
            let (lo, hi) = (s.address, s.address + s.total_size);
            // A cudaMalloc'd segment holds its range from its last segment_alloc on; an expandable
            // segment's range is its own reservation (per stream and pool), so it holds it throughout.
            let since = if s.is_expandable {
                0
            } else {
                trace.iter().rposition(|e| e.action == Action::SegmentAlloc && e.addr == s.address).unwrap_or(0)
            };
            ranges.push((lo, hi, s.stream, s.pool_id, since));
        }
        PrivateRanges { ranges }
    }

    fn route(&self, addr: u64, stream: u64, index: usize) -> Route {
        for &(lo, hi, s, id, since) in &self.ranges {
            if addr >= lo && addr < hi && s == stream && index >= since {
                return Route::Private(id);
            }
        }
        Route::Default
    }
}

/// A completion this much later than its request (µs) may have been made by a later call.
pub const SYNC_COMPLETION_MIN_US: i64 = 20;

/// Whether any free in the trace completed later than it was requested (`record_stream`).
fn has_cross_stream_frees(trace: &[TraceEntry]) -> bool {
    trace.iter().enumerate().any(|(i, e)| {
        e.action == Action::FreeRequested && trace.get(i + 1).is_none_or(|n| n.action != Action::FreeCompleted || n.addr != e.addr)
    })
}

/// Whether entries from `i` on, past any further completions, are a malloc's device calls
/// (segment frees, unmaps, allocations, maps) or an OOM: the entries a retry chain makes.
fn malloc_device_calls_follow(trace: &[TraceEntry], i: usize) -> bool {
    for e in &trace[i.min(trace.len())..] {
        match e.action {
            Action::FreeCompleted => continue,
            Action::SegmentFree | Action::SegmentUnmap | Action::SegmentAlloc | Action::SegmentMap | Action::Oom => return true,
            _ => return false,
        }
    }
    false
}
