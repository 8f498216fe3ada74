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

use std::collections::HashMap;

use allocsim_model::allocator::{MempoolId, Route};
use allocsim_trace::{Action, SnapshotSegment, StackId, TraceEntry};

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
}

/// What the trace asks of the allocator, device by device.
#[derive(Clone, Debug, Default)]
pub struct Program {
    pub requests: Vec<Request>,
    pub ops: Vec<Op>,
    /// Frees (or completions) of addresses the trace never allocated: the trace starts mid-history.
    pub unknown_frees: u32,
    /// Private-pool ids the requests are routed to.
    pub private_pools: Vec<MempoolId>,
}

impl Program {
    /// Builds the program of one device's trace. `segments` (the snapshot's final segments of this
    /// device) tell which requests went to private pools (CUDA graphs, MemPools): a request whose
    /// block lies in a final private-pool segment on the same stream, allocated after that segment
    /// was. Private segments freed before the snapshot cannot be recognised; their requests are
    /// replayed in the default pools.
    pub fn build(trace: &[TraceEntry], segments: &[SnapshotSegment]) -> Program {
        let private = PrivateRanges::new(trace, segments);
        let mut p = Program::default();
        let mut live: HashMap<u64, u32> = HashMap::new();
        let mut pending: HashMap<u64, u32> = HashMap::new();
        let mut i = 0usize;
        while i < trace.len() {
            let e = &trace[i];
            match e.action {
                Action::Alloc | Action::Oom => {
                    let req = p.requests.len() as u32;
                    let route = if e.action == Action::Alloc { private.route(e.addr, e.stream, i) } else { Route::Default };
                    if let Route::Private(id) = route {
                        if !p.private_pools.contains(&id) {
                            p.private_pools.push(id);
                        }
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
                        live.insert(e.addr, req);
                    }
                }
                Action::FreeRequested => match live.remove(&e.addr) {
                    Some(req) => {
                        let immediate = trace
                            .get(i + 1)
                            .is_some_and(|n| n.action == Action::FreeCompleted && n.addr == e.addr);
                        p.ops.push(Op::Free { req, deferred: !immediate });
                        if immediate {
                            i += 1;
                        } else {
                            pending.insert(e.addr, req);
                        }
                    }
                    None => p.unknown_frees += 1,
                },
                Action::FreeCompleted => match pending.remove(&e.addr) {
                    Some(req) => p.ops.push(Op::Complete(req)),
                    None => p.unknown_frees += 1,
                },
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
