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
//! its first entry is reconstructed from the final segments (`allocsim_infer::restore`) and kept in
//! [`Program::initial`]; the replay starts from it. The blocks that were already active are
//! numbered apart from the requests, in address order ("pre-existing block" `k` =
//! `initial.blocks[k]`), and freed by [`Op::FreePre`] / [`Op::CompletePre`]: request ordinals stay
//! the ordinals of the trace's `alloc`/`oom` entries. A run of releases at the very start (the tail
//! of an `empty_cache()` or of a `malloc`'s releases whose beginning was cut off) is replayed as
//! exactly those releases ([`Op::ForcedRelease`]).

use allocsim_model::AllocatorConfig;
use allocsim_model::allocator::{MempoolId, Route, splits_block};
use allocsim_trace::hash::{IntMap, IntSet};
use allocsim_trace::{Action, SnapshotSegment, StackId, TraceEntry};

use crate::initial::InitialState;

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
    /// An allocation `_cuda_setCheckpointPoolState` made (CUDA-graph trees restoring a pool to a
    /// checkpoint, see `allocsim_infer::pools`): the free block at `recorded_addr` taken whole or split,
    /// not a `malloc`.
    pub checkpoint: bool,
}

/// What happened to a private pool's users between ops, as `allocsim_infer::pools` infers it (the trace
/// does not record it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolAction {
    /// The pool's last user went (`releasePool` down to `use_count` 0): it is freeable.
    ReleasePool(MempoolId),
    /// `MemPool::~MemPool`: `releasePool`, then `emptyCache(id)` (that pool's free segments).
    DropMemPool(MempoolId),
    /// The pool serves requests the default pools cannot (`MemPool(use_on_oom=True)`).
    UseOnOom(MempoolId),
    /// The pool never splits a block (`MemPool(no_split=True)`).
    NoSplit(MempoolId),
    /// The pool has its own allocator (`MemPool(allocator)`): no expandable segments in it.
    CustomAllocator(MempoolId),
}

/// What the final segments show of private pools' kinds, as actions before the first op:
///
/// * **`no_split`.** An allocated block that `should_split` would have split: larger than its
///   rounded request by more than 1 MiB (`kSmallSize`) in a large pool of cudaMalloc'd
///   segments, or by 512 bytes or more in a small pool or an expandable segment, with the request
///   below `max_split_size` (an oversize block is never split, and may be reused within
///   `max_non_split_rounding_mb`). Only a pool made with `no_split=True` returns such a block.
///   Where the final segments show none (the blocks were freed), `allocsim_infer::pools` reads the trace
///   (`no_split_shown`).
/// * **A custom allocator.** A cudaMalloc'd segment in a private pool while expandable segments
///   are on: `is_expandable_segments_active` is false only for a pool with its own allocator.
pub fn pool_kinds(segments: &[SnapshotSegment], config: &AllocatorConfig) -> Vec<(u32, PoolAction)> {
    let mut out: Vec<(u32, PoolAction)> = Vec::new();
    let mut push = |a: PoolAction| {
        if !out.iter().any(|x| x.1 == a) {
            out.push((0, a));
        }
    };
    for s in segments.iter().filter(|s| s.pool_id != (0, 0)) {
        let id = s.pool_id;
        if config.expandable_segments && !s.is_expandable {
            push(PoolAction::CustomAllocator(id));
        }
        let unsplit = s.blocks.iter().any(|b| {
            let rounded = config.round_size(b.requested_size);
            b.state == allocsim_trace::BlockState::ActiveAllocated
                && b.requested_size > 0
                && rounded < config.max_split_size
                && splits_block(config, b.size, rounded, s.is_small, s.is_expandable)
        });
        if unsplit {
            push(PoolAction::NoSplit(id));
        }
    }
    out
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
    /// Private-pool lifecycle, by op index: each applies before that op (see `allocsim_infer::pools`).
    pub pool_actions: Vec<(u32, PoolAction)>,
    /// The state at the trace's start when it starts mid-history (`None`: an empty allocator).
    pub initial: Option<InitialState>,
    /// Why the initial state could not be reconstructed (then the replay starts empty and frees of
    /// unknown blocks are ignored).
    pub reconstruct_error: Option<String>,
}

impl Program {
    /// The request a malloc op serves (`None` for any other op).
    pub fn request_of(&self, op: Op) -> Option<&Request> {
        match op {
            Op::Malloc(q) => self.requests.get(q as usize),
            _ => None,
        }
    }

    /// Builds the program of one device's trace, starting from `initial` (the state at the first
    /// entry of a trace that starts mid-history, as `allocsim_infer::restore::build_program`
    /// infers it; `None` from empty) with `reconstruct_error` (why it could not be inferred, if
    /// the trace shows it should have been). `segments` (the snapshot's final segments of this
    /// device) tell which requests went to private pools (CUDA graphs, MemPools): a request whose
    /// block lies in a final private-pool segment on the same stream, allocated after that segment
    /// was. Private segments freed before the snapshot cannot be recognised; their requests are
    /// replayed in the default pools. `config` is the recorded settings (the pools' kinds).
    pub fn build_from(
        trace: &[TraceEntry],
        segments: &[SnapshotSegment],
        config: &AllocatorConfig,
        initial: Option<InitialState>,
        reconstruct_error: Option<String>,
    ) -> Program {
        let mut p = Program { initial, reconstruct_error, ..Program::default() };
        let mut b = Program::builder(trace, segments, p.initial.as_ref());
        // At most a request an entry and an op or two an entry: reserved once, backed as written.
        p.requests = allocsim_trace::mem::huge_vec(trace.len());
        p.ops = allocsim_trace::mem::huge_vec(trace.len() + trace.len() / 2);
        let (requests, ops) = (&mut p.requests, &mut p.ops);
        let mut add = |x: Built<'_>| {
            requests.extend(x.request);
            ops.push(x.op);
        };
        for e in trace {
            b.push(*e, &mut add);
        }
        b.finish(&mut add);
        p.unknown_frees = b.unknown_frees;
        p.private_pools = b.private_pools;
        p.pool_actions = pool_kinds(segments, config);
        p
    }

    fn builder(trace: &[TraceEntry], segments: &[SnapshotSegment], initial: Option<&InitialState>) -> ProgramBuilder {
        let segment_allocs = trace.iter().filter(|e| e.action == Action::SegmentAlloc).map(|e| e.addr);
        ProgramBuilder::new(segments, segment_allocs, initial, Some(has_cross_stream_frees(trace)))
    }

    /// For each op of this program (built from `trace` and `segments` by [`Program::build_from`]),
    /// the trace index of the entry it stands for (see [`Built::index`]): nondecreasing, so the
    /// ops before trace position `k` are those whose index is below `k`.
    pub fn op_trace_indices(&self, trace: &[TraceEntry], segments: &[SnapshotSegment]) -> Vec<u32> {
        let mut b = Program::builder(trace, segments, self.initial.as_ref());
        let mut out = Vec::with_capacity(self.ops.len());
        let mut add = |x: Built<'_>| out.push(x.index);
        for e in trace {
            b.push(*e, &mut add);
        }
        b.finish(&mut add);
        debug_assert_eq!(out.len(), self.ops.len());
        out
    }
}

/// An op as [`ProgramBuilder`] makes it, with what the replay's `empty_cache()` inference needs
/// to see of the entries behind it.
#[derive(Clone, Copy, Debug)]
pub struct Built<'a> {
    pub op: Op,
    /// The request of a [`Op::Malloc`].
    pub request: Option<Request>,
    /// [`Op::ReleaseRun`]: its entries. [`Op::Malloc`]: the entries right before its own that
    /// [`before_malloc`] accepts (the device calls a retry chain may have made; see
    /// `crate::replay::recorded_device_calls`). Otherwise empty.
    pub entries: &'a [TraceEntry],
    /// The trace index of the entry the op stands for: a malloc's `alloc`/`oom`, a free's
    /// `free_requested`, a completion's `free_completed`, a release run's first entry.
    pub index: u32,
}

/// Whether an entry can be part of a malloc's own device calls, right before its `alloc` (or
/// `oom`) entry: segment events, and completions of cross-stream frees that its synchronize made.
pub fn before_malloc(a: Action) -> bool {
    matches!(a, Action::FreeCompleted | Action::SegmentAlloc | Action::SegmentFree | Action::SegmentMap | Action::SegmentUnmap)
}

fn is_release(a: Action) -> bool {
    matches!(a, Action::SegmentFree | Action::SegmentUnmap)
}

/// Turns trace entries into ops as they come (the rules in the module documentation), looking
/// ahead only as far as a rule needs: the entry after a `free_requested` (and, when the trace may
/// have cross-stream frees, past the completions after it), the end of a run of releases. Its
/// memory is the live and pending blocks plus that lookahead, whatever the trace's length.
///
/// Whether the trace has cross-stream frees at all decides whether a completion right after its
/// request may still be a later call's (see [`Program::build_from`]). When that is not known in
/// advance (a stream), the builder assumes none until it sees one, and [`ProgramBuilder::speculated`]
/// says whether that assumption decided a free before one was seen (then the ops differ from
/// [`Program::build_from`]'s if the trace turns out to have one: build again, telling it).
pub struct ProgramBuilder {
    private: PrivateRanges,
    live: IntMap<u64, Live>,
    pending: IntMap<u64, Live>,
    cross_stream: Option<bool>,
    seen_cross_stream: bool,
    speculated: bool,
    restored: bool,
    /// Entries not yet turned into ops: `buf[head..]`, the first at trace index `index`.
    buf: Vec<TraceEntry>,
    head: usize,
    index: usize,
    /// The entries [`before_malloc`] accepts right before `buf[head]`.
    recent: Vec<TraceEntry>,
    /// `segment_alloc` entries before `buf[head]`.
    segment_allocs: usize,
    next_request: u32,
    ops: usize,
    /// See [`Program::unknown_frees`].
    pub unknown_frees: u32,
    /// See [`Program::private_pools`].
    pub private_pools: Vec<MempoolId>,
}

impl ProgramBuilder {
    /// `segments`: the device's final segments; `segment_allocs`: the addresses of its trace's
    /// `segment_alloc` entries in order; `initial`: the state the trace starts from; `cross_stream`:
    /// whether the trace has cross-stream frees (`None`: not known, see above).
    pub fn new(
        segments: &[SnapshotSegment],
        segment_allocs: impl IntoIterator<Item = u64>,
        initial: Option<&InitialState>,
        cross_stream: Option<bool>,
    ) -> ProgramBuilder {
        let mut b = ProgramBuilder {
            private: PrivateRanges::new(segments, segment_allocs),
            live: IntMap::default(),
            pending: IntMap::default(),
            cross_stream,
            seen_cross_stream: false,
            speculated: false,
            restored: initial.is_some(),
            buf: Vec::new(),
            head: 0,
            index: 0,
            recent: Vec::new(),
            segment_allocs: 0,
            next_request: 0,
            ops: 0,
            unknown_frees: 0,
            private_pools: Vec::new(),
        };
        if let Some(s) = initial {
            for (k, blk) in s.blocks.iter().enumerate() {
                if blk.pending {
                    b.pending.insert(blk.addr, Live::Pre(k as u32));
                } else {
                    b.live.insert(blk.addr, Live::Pre(k as u32));
                }
            }
        }
        b
    }

    /// The next entry; `out` gets the ops it completes.
    pub fn push(&mut self, e: TraceEntry, out: &mut impl FnMut(Built<'_>)) {
        self.buf.push(e);
        self.drain(false, out);
    }

    /// The end of the trace: the remaining ops.
    pub fn finish(&mut self, out: &mut impl FnMut(Built<'_>)) {
        self.drain(true, out);
    }

    /// Requests made so far.
    pub fn requests(&self) -> u32 {
        self.next_request
    }

    /// Whether a free was decided by assuming the trace has no cross-stream frees (only when
    /// that was not known) while it might yet have one.
    pub fn speculated(&self) -> bool {
        self.speculated
    }

    /// Whether the entries so far have a cross-stream free (a `free_requested` not followed by its
    /// `free_completed`).
    pub fn seen_cross_stream(&self) -> bool {
        self.seen_cross_stream
    }

    fn consume(&mut self, n: usize) {
        for e in &self.buf[self.head..self.head + n] {
            if before_malloc(e.action) {
                self.recent.push(*e);
            } else {
                self.recent.clear();
            }
            self.segment_allocs += (e.action == Action::SegmentAlloc) as usize;
        }
        self.head += n;
        self.index += n;
        if self.head == self.buf.len() {
            self.buf.clear();
            self.head = 0;
        } else if self.head >= 1024 && 2 * self.head >= self.buf.len() {
            self.buf.drain(..self.head);
            self.head = 0;
        }
    }

    fn drain(&mut self, done: bool, out: &mut impl FnMut(Built<'_>)) {
        while self.head < self.buf.len() {
            let e = self.buf[self.head];
            let i = self.index;
            let n = match e.action {
                Action::Alloc | Action::Oom => {
                    let req = self.next_request;
                    self.next_request += 1;
                    let route = if e.action == Action::Alloc { self.private.route(e.addr, e.stream, self.segment_allocs) } else { Route::Default };
                    if let Route::Private(id) = route
                        && !self.private_pools.contains(&id)
                    {
                        self.private_pools.push(id);
                    }
                    let request = Request {
                        size: e.size,
                        stream: e.stream,
                        route,
                        recorded_oom: e.action == Action::Oom,
                        recorded_addr: e.addr,
                        trace_index: i as u32,
                        stack: e.stack,
                        checkpoint: false,
                    };
                    out(Built { op: Op::Malloc(req), request: Some(request), entries: &self.recent, index: i as u32 });
                    self.ops += 1;
                    if e.action == Action::Alloc {
                        self.live.insert(e.addr, Live::Req(req));
                    }
                    1
                }
                Action::FreeRequested => {
                    let next = self.buf.get(self.head + 1).copied();
                    if next.is_none() && !done {
                        break;
                    }
                    let completed_next = next.is_some_and(|n| n.action == Action::FreeCompleted && n.addr == e.addr);
                    if !completed_next {
                        self.seen_cross_stream = true;
                    }
                    // A completion right after the request is an ordinary free, unless the trace
                    // has cross-stream frees, the completion came measurably later (inside a later
                    // call: an ordinary free records both entries in the same call, 0–2 µs apart)
                    // and a malloc's device calls follow: then it may be the next malloc's
                    // OOM-retry synchronize completing a pending block, which the replay decides
                    // (see `crate::replay::replay`).
                    let later = next.is_some_and(|n| completed_next && n.time_us.saturating_sub(e.time_us) >= SYNC_COMPLETION_MIN_US);
                    let cross = self.cross_stream.unwrap_or(self.seen_cross_stream);
                    let mut follows = false;
                    if later && self.cross_stream != Some(false) {
                        follows = match malloc_device_calls_follow(&self.buf[self.head + 2..]) {
                            Some(f) => f,
                            None if done => false,
                            None => break,
                        };
                        self.speculated |= follows && !cross;
                    }
                    let immediate = completed_next && !(cross && later && follows);
                    match self.live.remove(&e.addr) {
                        Some(l) => {
                            let op = match l {
                                Live::Req(req) => Op::Free { req, deferred: !immediate },
                                Live::Pre(pre) => Op::FreePre { pre, deferred: !immediate },
                            };
                            out(Built { op, request: None, entries: &[], index: i as u32 });
                            self.ops += 1;
                            if immediate {
                                2
                            } else {
                                self.pending.insert(e.addr, l);
                                1
                            }
                        }
                        None => {
                            self.unknown_frees += 1;
                            1
                        }
                    }
                }
                Action::FreeCompleted => {
                    let op = match self.pending.remove(&e.addr) {
                        Some(Live::Req(req)) => Some(Op::Complete(req)),
                        Some(Live::Pre(pre)) => Some(Op::CompletePre(pre)),
                        None => None,
                    };
                    match op {
                        Some(op) => {
                            out(Built { op, request: None, entries: &[], index: i as u32 });
                            self.ops += 1;
                        }
                        None => self.unknown_frees += 1,
                    }
                    1
                }
                Action::SegmentFree | Action::SegmentUnmap => {
                    let run = self.buf[self.head..].iter().take_while(|x| is_release(x.action)).count();
                    if self.head + run == self.buf.len() && !done {
                        break;
                    }
                    let entries = &self.buf[self.head..self.head + run];
                    if self.restored && self.ops == 0 {
                        // The tail of a release whose cause was cut off: replayed as recorded.
                        for (k, x) in entries.iter().enumerate() {
                            let op = Op::ForcedRelease { addr: x.addr, unmap: x.action == Action::SegmentUnmap };
                            out(Built { op, request: None, entries: &[], index: (i + k) as u32 });
                        }
                        self.ops += run;
                    } else {
                        out(Built { op: Op::ReleaseRun { start: i as u32, end: (i + run) as u32 }, request: None, entries, index: i as u32 });
                        self.ops += 1;
                    }
                    run
                }
                Action::SegmentAlloc | Action::SegmentMap | Action::Snapshot | Action::Annotate => 1,
            };
            self.consume(n);
        }
    }
}

/// Final private-pool segments, with the ordinal of the `segment_alloc` from which each one held
/// its range.
struct PrivateRanges {
    /// (start, end, stream, pool, the ordinal among the trace's `segment_alloc` entries of the last
    /// one at its address; `None`: held throughout).
    ranges: Vec<(u64, u64, u64, MempoolId, Option<usize>)>,
}

impl PrivateRanges {
    fn new(segments: &[SnapshotSegment], segment_allocs: impl IntoIterator<Item = u64>) -> PrivateRanges {
        let private: Vec<&SnapshotSegment> = segments.iter().filter(|s| s.pool_id != (0, 0)).collect();
        let mut last: IntMap<u64, usize> = IntMap::default();
        if !private.is_empty() {
            let wanted: IntSet<u64> = private.iter().filter(|s| !s.is_expandable).map(|s| s.address).collect();
            for (k, a) in segment_allocs.into_iter().enumerate() {
                if wanted.contains(&a) {
                    last.insert(a, k);
                }
            }
        }
        let mut ranges = Vec::new();
        for s in private {
            let (lo, hi) = (s.address, s.address.saturating_add(s.total_size));
            // A cudaMalloc'd segment holds its range from its last segment_alloc on; an expandable
            // segment's range is its own reservation (per stream and pool), so it holds it throughout.
            let since = if s.is_expandable { None } else { last.get(&s.address).copied() };
            ranges.push((lo, hi, s.stream, s.pool_id, since));
        }
        PrivateRanges { ranges }
    }

    /// The pool of a request at `addr` on `stream`, after `segment_allocs` `segment_alloc` entries.
    fn route(&self, addr: u64, stream: u64, segment_allocs: usize) -> Route {
        for &(lo, hi, s, id, since) in &self.ranges {
            if addr >= lo && addr < hi && s == stream && since.is_none_or(|k| segment_allocs > k) {
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
    trace
        .iter()
        .enumerate()
        .any(|(i, e)| e.action == Action::FreeRequested && trace.get(i + 1).is_none_or(|n| n.action != Action::FreeCompleted || n.addr != e.addr))
}

/// Whether the entries `after` (those after a free and its completion), past any further
/// completions, are a malloc's device calls (segment frees, unmaps, allocations, maps) or an OOM:
/// the entries a retry chain makes. `None` when `after` ends before that is known.
fn malloc_device_calls_follow(after: &[TraceEntry]) -> Option<bool> {
    for e in after {
        match e.action {
            Action::FreeCompleted => continue,
            Action::SegmentFree | Action::SegmentUnmap | Action::SegmentAlloc | Action::SegmentMap | Action::Oom => return Some(true),
            _ => return Some(false),
        }
    }
    None
}
