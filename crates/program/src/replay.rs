//! Replays a [`Program`] through the allocator model and collects what happened.

use allocsim_model::allocator::{BlockId, CachingAllocator, EventKind, MempoolId, OutOfMemory, RestoredBlockSpec, RestoredHandle, RestoredState, Route};
use allocsim_model::{AllocatorConfig, Device, DeviceStats, Placement, SimDevice};
use allocsim_trace::hash::IntMap;
use allocsim_trace::{Action, TraceEntry};

use crate::initial::InitialState;
use crate::program::{Op, PoolAction, Program, Request};

/// How to replay: the allocator settings, the allowed maximum, the device and its placement.
#[derive(Clone, Debug)]
pub struct ReplayOptions {
    pub config: AllocatorConfig,
    /// The allowed maximum (`set_per_process_memory_fraction`), in bytes.
    pub capacity: Option<u64>,
    /// The device's total memory (`totalGlobalMem`).
    pub device_memory: u64,
    pub placement: Placement,
    /// Device memory held outside the allocator over the replay (empty: none).
    pub outside: OutsideMemory,
}

/// Device memory held outside the allocator (CUDA context, other processes, library workspaces),
/// as a step function of the request ordinal: from each step's request on, its bytes, until the
/// next step. Before the first step: the first step's bytes. Empty: none at all.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct OutsideMemory {
    /// (first request, bytes), in increasing request order.
    pub steps: Vec<(u32, u64)>,
}

impl OutsideMemory {
    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }
    /// Bytes held outside the allocator at request `req`.
    pub fn at(&self, req: u32) -> u64 {
        let i = self.steps.partition_point(|&(r, _)| r <= req);
        self.steps[i.saturating_sub(1)].1
    }
    /// The most held at any time (0 if none).
    pub fn max(&self) -> u64 {
        self.steps.iter().map(|s| s.1).max().unwrap_or(0)
    }
}

/// Where the `empty_cache()` calls are (the trace does not record them), and which cross-stream
/// completions a malloc's own synchronize made (the trace shows them like any other).
#[derive(Clone, Copy, Debug)]
pub enum EmptyCacheCalls<'a> {
    /// Decide while replaying under the trace's own settings: a release run that the model's next
    /// `malloc` does not produce itself was an `empty_cache()`.
    Infer(&'a [TraceEntry]),
    /// Apply `empty_cache()` at the ops flagged (one flag per op).
    Given(&'a [bool]),
}

/// A segment event the model produced.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct SegmentEvent {
    /// `SegmentAlloc`, `SegmentFree`, `SegmentMap` or `SegmentUnmap`.
    pub action: Action,
    pub addr: u64,
    pub size: u64,
    pub stream: u64,
    /// The ordinal of the request during (or before) which it happened.
    pub request: u32,
    /// In a small pool (2 MiB segments and pages).
    pub small: bool,
}

/// A request the model could not serve.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Oom {
    pub request: u32,
    pub info: OutOfMemory,
}

/// What a replay did.
#[derive(Clone, Debug)]
pub struct ReplayOutcome<D: Device = SimDevice> {
    pub stats: DeviceStats,
    pub segment_events: Vec<SegmentEvent>,
    pub ooms: Vec<Oom>,
    /// One flag per op: at a release run, an `empty_cache()` was applied there; at a completion,
    /// it was held for the next malloc's synchronize. (Empty when streamed: not kept.)
    pub empty_cache: Vec<bool>,
    /// The request ordinals before which an `empty_cache()` call was applied.
    pub empty_cache_requests: Vec<u32>,
    /// The address each request got (`None`: it ran out of memory). (Empty when streamed: not
    /// kept.)
    pub addresses: Vec<Option<u64>>,
    /// Peak `reserved_bytes.all`, same as `stats`, kept for convenience.
    pub peak_reserved: u64,
    /// The allocator at the end of the trace.
    pub allocator: CachingAllocator<D>,
    /// Segments of the reconstructed initial state that could not be restored (the device had no
    /// room, or the state was inconsistent), with why. Their blocks' frees are ignored.
    pub restore_failures: Vec<String>,
}

impl<D: Device> ReplayOutcome<D> {
    pub fn first_oom(&self) -> Option<u32> {
        self.ooms.first().map(|o| o.request)
    }

    /// The request during which reserved memory first reached its peak (from the segment events;
    /// `None` when no segment was made or mapped).
    pub fn peak_reserved_request(&self) -> Option<u32> {
        let (mut cur, mut best, mut at) = (0i64, 0i64, None);
        for e in &self.segment_events {
            cur += if e.action.reserves() { e.size as i64 } else { -(e.size as i64) };
            if cur > best {
                best = cur;
                at = Some(e.request);
            }
        }
        at
    }
}

fn action_of(k: EventKind) -> Action {
    match k {
        EventKind::SegmentAlloc => Action::SegmentAlloc,
        EventKind::SegmentFree => Action::SegmentFree,
        EventKind::SegmentMap => Action::SegmentMap,
        EventKind::SegmentUnmap => Action::SegmentUnmap,
        EventKind::Oom => Action::Oom,
    }
}

/// Replays `program` under `opts` on a simulated device.
pub fn replay(program: &Program, opts: &ReplayOptions, empty_cache: EmptyCacheCalls<'_>) -> ReplayOutcome {
    let device = SimDevice::new(opts.device_memory, opts.placement.clone());
    ProgramReplay::new(program, opts, device, empty_cache_calls(program, empty_cache)).finish(|_, _| {})
}

/// `replay`'s `is_empty_cache`: the calls given, or inferred op by op ([`Inference`]).
pub fn empty_cache_calls<'a>(program: &'a Program, empty_cache: EmptyCacheCalls<'a>) -> impl FnMut(&CachingAllocator<SimDevice>, usize) -> bool + 'a {
    let mut inference = Inference::default();
    move |alloc, oi| match empty_cache {
        EmptyCacheCalls::Given(f) => f.get(oi).copied().unwrap_or(false),
        EmptyCacheCalls::Infer(trace) => inference.decide(alloc, oi, &ProgramAhead { program, trace, oi }),
    }
}

/// The ops from the current one on, as the `empty_cache()` inference ([`Inference`]) sees them.
pub trait Ahead {
    /// The op `k` places after the current one (0: the current one); `None` past the last.
    fn op(&self, k: usize) -> Option<Op>;
    /// The request of the malloc `k` places ahead.
    fn request(&self, k: usize) -> Request;
    /// The entries of the release run `k` places ahead.
    fn release_entries(&self, k: usize) -> &[TraceEntry];
    /// The recorded segment events right before the entry of the malloc `k` places ahead
    /// ([`recorded_device_calls`]).
    fn device_calls_before(&self, k: usize) -> Vec<(EventKind, u64, u64)>;
}

/// A whole [`Program`] and its trace, at op `oi`.
pub struct ProgramAhead<'a> {
    pub program: &'a Program,
    pub trace: &'a [TraceEntry],
    pub oi: usize,
}

impl Ahead for ProgramAhead<'_> {
    fn op(&self, k: usize) -> Option<Op> {
        self.program.ops.get(self.oi + k).copied()
    }
    fn request(&self, k: usize) -> Request {
        match self.program.ops[self.oi + k] {
            Op::Malloc(q) => self.program.requests[q as usize],
            op => unreachable!("{op:?} is not a malloc"),
        }
    }
    fn release_entries(&self, k: usize) -> &[TraceEntry] {
        match self.program.ops[self.oi + k] {
            Op::ReleaseRun { start, end } => &self.trace[start as usize..end as usize],
            _ => &[],
        }
    }
    fn device_calls_before(&self, k: usize) -> Vec<(EventKind, u64, u64)> {
        let r = self.request(k);
        recorded_device_calls(&self.trace[..r.trace_index as usize])
    }
}

/// `EmptyCacheCalls::Infer`: decides, op by op, whether a release run was an `empty_cache()` call
/// (the model's next `malloc` does not make exactly those releases itself) and whether a
/// cross-stream completion was made by the next malloc's own synchronize. Needs the ops up to the
/// next malloc ([`Ahead`]).
#[derive(Clone, Debug, Default)]
pub struct Inference {
    /// The next malloc (op index) whose own release chain the ops before it belong to.
    inside_malloc: Option<usize>,
}

impl Inference {
    /// At op `oi` (a release run or a completion), on the allocator before it.
    pub fn decide(&mut self, alloc: &CachingAllocator<SimDevice>, oi: usize, ahead: &impl Ahead) -> bool {
        let release = matches!(ahead.op(0), Some(Op::ReleaseRun { .. }));
        if release && ahead.release_entries(0).is_empty() {
            // Its entries were a MemPool destructor's (a pool action): nothing is left to do.
            return false;
        }
        let Some(mk) = next_malloc(ahead) else {
            // No malloc follows: a release run is an empty_cache(); a completion is just that.
            return release;
        };
        if self.inside_malloc == Some(oi + mk) {
            // An earlier release run or completion before this malloc was its own: so is this.
            return !release;
        }
        match ahead.op(0) {
            Some(Op::ReleaseRun { .. }) => {
                let recorded: Vec<&TraceEntry> =
                    (0..mk).filter(|&k| matches!(ahead.op(k), Some(Op::ReleaseRun { .. }))).flat_map(|k| ahead.release_entries(k)).collect();
                let produced = next_malloc_makes(alloc, &ahead.request(mk), &recorded);
                if produced {
                    self.inside_malloc = Some(oi + mk);
                }
                !produced
            }
            Some(Op::Complete(_) | Op::CompletePre(_)) => {
                let inside = completed_by_next_malloc(alloc, &ahead.request(mk), || ahead.device_calls_before(mk));
                if inside {
                    self.inside_malloc = Some(oi + mk);
                }
                inside
            }
            _ => false,
        }
    }
}

/// How many ops ahead the next malloc is, if only completions and release runs come between
/// (the entries a malloc's retry chain can emit before its own `alloc`).
fn next_malloc(ahead: &impl Ahead) -> Option<usize> {
    let mut k = 1;
    loop {
        match ahead.op(k)? {
            Op::Malloc(_) => return Some(k),
            Op::Complete(_) | Op::CompletePre(_) | Op::ReleaseRun { .. } => k += 1,
            _ => return None,
        }
    }
}

/// The segment events a malloc's entry is recorded right after (the trailing ones of `before`,
/// past completions), oldest first.
pub fn recorded_device_calls(before: &[TraceEntry]) -> Vec<(EventKind, u64, u64)> {
    let mut recorded = Vec::new();
    for e in before.iter().rev() {
        let kind = match e.action {
            Action::SegmentAlloc => EventKind::SegmentAlloc,
            Action::SegmentFree => EventKind::SegmentFree,
            Action::SegmentMap => EventKind::SegmentMap,
            Action::SegmentUnmap => EventKind::SegmentUnmap,
            Action::FreeCompleted => continue,
            _ => break,
        };
        recorded.push((kind, e.addr, e.size));
    }
    recorded.reverse();
    recorded
}

/// Were these cross-stream completions made by the next malloc's own `synchronize_and_free_events`
/// (its OOM retry), rather than by `process_events` before it? The trace shows both the same way:
/// `free_completed` entries before the request's `alloc`. Only with an allowed maximum can the
/// first `alloc_block` fail; then the malloc is tried with the blocks still pending, and if it
/// synchronizes and reproduces the recorded segment events (`recorded`) and address, the
/// completions were its own.
fn completed_by_next_malloc(alloc: &CachingAllocator<SimDevice>, r: &Request, recorded: impl FnOnce() -> Vec<(EventKind, u64, u64)>) -> bool {
    if alloc.allowed_memory_maximum.is_none() {
        return false;
    }
    let mut trial = alloc.clone();
    trial.events.clear();
    let syncs = trial.stats.num_sync_all_streams;
    let result = trial.malloc(r.size, r.stream, r.route);
    if trial.stats.num_sync_all_streams == syncs {
        return false;
    }
    let served_as_recorded = match result {
        Ok(b) => !r.recorded_oom && trial.block(b).ptr == r.recorded_addr,
        Err(_) => r.recorded_oom,
    };
    let made: Vec<(EventKind, u64, u64)> = trial.events.iter().filter(|e| e.kind != EventKind::Oom).map(|e| (e.kind, e.addr, e.size)).collect();
    served_as_recorded && made == recorded()
}

/// Replays `program` under `opts` on `device` (a simulated or a real one). At each release run,
/// `is_empty_cache(allocator, op index)` says whether it was an `empty_cache()` call; at each
/// cross-stream completion, whether the next malloc's own synchronize made it (the completion is
/// then held until that malloc). (Inferring
/// that tries the next malloc on a clone of the allocator, which only a simulated device allows;
/// a real device replays the calls a simulated replay inferred.)
pub fn replay_on<D: Device>(
    program: &Program,
    opts: &ReplayOptions,
    device: D,
    is_empty_cache: impl FnMut(&CachingAllocator<D>, usize) -> bool,
) -> ReplayOutcome<D> {
    replay_observed(program, opts, device, is_empty_cache, |_, _| {})
}

/// [`replay_on`], calling `observe(allocator, op index)` after every op (for time series).
pub fn replay_observed<D: Device>(
    program: &Program,
    opts: &ReplayOptions,
    device: D,
    is_empty_cache: impl FnMut(&CachingAllocator<D>, usize) -> bool,
    mut observe: impl FnMut(&CachingAllocator<D>, usize),
) -> ReplayOutcome<D> {
    let mut r = ProgramReplay::new(program, opts, device, is_empty_cache);
    while r.next < program.ops.len() {
        if r.next > 0 {
            observe(&r.stepper.alloc, r.next - 1);
        }
        r.step();
    }
    r.finish(observe)
}

/// A replay of a whole [`Program`], op by op: it can stop and go on (`allocsim_infer::budget` needs its
/// replay without an allowed maximum only up to its first difference from the recording, most
/// of the time). `is_empty_cache` as in [`replay_on`].
pub struct ProgramReplay<'p, D: Device, F> {
    program: &'p Program,
    stepper: Stepper<D, VecSlots>,
    is_empty_cache: F,
    flags: Vec<bool>,
    addresses: Vec<Option<u64>>,
    /// The next op's index.
    next: usize,
}

impl<'p, D: Device, F: FnMut(&CachingAllocator<D>, usize) -> bool> ProgramReplay<'p, D, F> {
    pub fn new(program: &'p Program, opts: &ReplayOptions, device: D, is_empty_cache: F) -> Self {
        let n = program.requests.len();
        let mut stepper = Stepper::new(opts, device, VecSlots::new(n), &program.private_pools, program.initial.as_ref());
        stepper.set_pool_actions(&program.pool_actions);
        ProgramReplay { program, stepper, is_empty_cache, flags: vec![false; program.ops.len()], addresses: vec![None; n], next: 0 }
    }

    /// Applies the next op; `false` past the last.
    pub fn step(&mut self) -> bool {
        let oi = self.next;
        let Some(&op) = self.program.ops.get(oi) else { return false };
        let request = self.program.request_of(op);
        let is_empty_cache = &mut self.is_empty_cache;
        let step = self.stepper.step(op, request, |alloc| is_empty_cache(alloc, oi));
        self.flags[oi] = step.flag;
        if let Op::Malloc(q) = op {
            self.addresses[q as usize] = step.address;
        }
        self.next += 1;
        true
    }

    /// The segment events so far.
    pub fn segment_events(&self) -> &[SegmentEvent] {
        self.stepper.segment_events()
    }

    /// The rest of the ops, then the outcome (`observe` sees the allocator after the last op).
    pub fn finish(mut self, mut observe: impl FnMut(&CachingAllocator<D>, usize)) -> ReplayOutcome<D> {
        while self.step() {}
        let ops = self.program.ops.len();
        self.stepper.complete_held();
        self.stepper.finish_pool_actions(ops);
        if ops > 0 {
            observe(&self.stepper.alloc, ops - 1);
        }
        self.stepper.finish(self.flags, self.addresses)
    }
}

/// Where a [`Stepper`] keeps each request's block while it is allocated, and the token of its
/// free while its cross-stream events are outstanding.
pub trait Slots {
    fn put_block(&mut self, req: u32, b: BlockId);
    fn take_block(&mut self, req: u32) -> Option<BlockId>;
    fn put_token(&mut self, req: u32, token: u64);
    fn take_token(&mut self, req: u32) -> Option<u64>;
}

/// [`Slots`] indexed by request ordinal: for a whole [`Program`] (fast, one 4-byte slot per
/// request; the tokens of cross-stream frees, which are few, in a map).
#[derive(Clone, Debug, Default)]
pub struct VecSlots {
    /// The block of each request while it is allocated; `NO_BLOCK` otherwise.
    blocks: Vec<BlockId>,
    tokens: IntMap<u32, u64>,
}

const NO_BLOCK: BlockId = BlockId::MAX;

impl VecSlots {
    pub fn new(requests: usize) -> VecSlots {
        VecSlots { blocks: vec![NO_BLOCK; requests], tokens: IntMap::default() }
    }
}

impl Slots for VecSlots {
    fn put_block(&mut self, req: u32, b: BlockId) {
        self.blocks[req as usize] = b;
    }
    fn take_block(&mut self, req: u32) -> Option<BlockId> {
        let slot = self.blocks.get_mut(req as usize)?;
        let b = std::mem::replace(slot, NO_BLOCK);
        (b != NO_BLOCK).then_some(b)
    }
    fn put_token(&mut self, req: u32, token: u64) {
        self.tokens.insert(req, token);
    }
    fn take_token(&mut self, req: u32) -> Option<u64> {
        self.tokens.remove(&req)
    }
}

/// [`Slots`] of the live requests only: for a stream, where memory follows the live set.
#[derive(Clone, Debug, Default)]
pub struct MapSlots {
    blocks: IntMap<u32, BlockId>,
    tokens: IntMap<u32, u64>,
}

impl MapSlots {
    /// Requests holding a block or a pending free.
    pub fn len(&self) -> usize {
        self.blocks.len() + self.tokens.len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Slots for MapSlots {
    fn put_block(&mut self, req: u32, b: BlockId) {
        self.blocks.insert(req, b);
    }
    fn take_block(&mut self, req: u32) -> Option<BlockId> {
        self.blocks.remove(&req)
    }
    fn put_token(&mut self, req: u32, token: u64) {
        self.tokens.insert(req, token);
    }
    fn take_token(&mut self, req: u32) -> Option<u64> {
        self.tokens.remove(&req)
    }
}

/// What one op did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Step {
    /// `is_empty_cache` was asked and said yes (an `empty_cache()` applied, or a completion held).
    pub flag: bool,
    /// A malloc's address.
    pub address: Option<u64>,
    /// A malloc ran out of memory.
    pub oom: bool,
}

/// The allocator driven op by op: the one implementation of each op, for a whole [`Program`]
/// ([`replay_observed`]) and for a stream (`allocsim_replay::stream`).
#[derive(Clone)]
pub struct Stepper<D: Device, S: Slots> {
    pub alloc: CachingAllocator<D>,
    outside: OutsideMemory,
    slots: S,
    pre_blocks: Vec<Option<BlockId>>,
    pre_tokens: Vec<Option<u64>>,
    segment_events: Vec<SegmentEvent>,
    ooms: Vec<Oom>,
    empty_cache_requests: Vec<u32>,
    next_request: u32,
    /// Cross-stream completions that the next malloc's synchronize made.
    held: Vec<u64>,
    restore_failures: Vec<String>,
    /// Private-pool lifecycle by op index ([`Program::pool_actions`]), and the next op's index.
    pool_actions: Vec<(u32, PoolAction)>,
    op_index: u32,
}

fn drain<D: Device>(alloc: &mut CachingAllocator<D>, out: &mut Vec<SegmentEvent>, request: u32) {
    for e in alloc.events.drain(..) {
        if e.kind != EventKind::Oom {
            let small = alloc.pools[e.pool as usize].is_small;
            out.push(SegmentEvent { action: action_of(e.kind), addr: e.addr, size: e.size, stream: e.stream, request, small });
        }
    }
}

impl<D: Device, S: Slots> Stepper<D, S> {
    /// A fresh allocator under `opts` on `device`, with `private_pools` made (in that order) and
    /// `initial` restored.
    pub fn new(opts: &ReplayOptions, device: D, slots: S, private_pools: &[MempoolId], initial: Option<&InitialState>) -> Self {
        let mut alloc = CachingAllocator::new(opts.config.clone(), device);
        if opts.capacity.is_some() {
            alloc.set_allowed_memory_maximum(opts.capacity);
        }
        for &id in private_pools {
            alloc.private_pool(id);
        }
        let npre = initial.map_or(0, |s| s.blocks.len());
        let mut st = Stepper {
            alloc,
            outside: opts.outside.clone(),
            slots,
            pre_blocks: vec![None; npre],
            pre_tokens: vec![None; npre],
            segment_events: Vec::new(),
            ooms: Vec::new(),
            empty_cache_requests: Vec::new(),
            next_request: 0,
            held: Vec::new(),
            restore_failures: Vec::new(),
            pool_actions: Vec::new(),
            op_index: 0,
        };
        if let Some(init) = initial {
            st.restore_failures = restore(&mut st.alloc, init, &mut st.pre_blocks, &mut st.pre_tokens);
            // Counters count from the trace's start; peaks are the window's (see `allocsim_infer::restore`).
            st.alloc.events.clear();
            st.alloc.reset_accumulated_stats();
            st.alloc.stats.reset_peak();
        }
        st
    }

    /// Applies `op` (`request`: a malloc's). At a release run, and at a completion of a pending
    /// free, `is_empty_cache(allocator)` says whether it was an `empty_cache()` call, or a
    /// completion the next malloc's synchronize made.
    /// The cross-stream events of the free `t` completed: now (`process_events`), or, when
    /// `is_empty_cache` says the next malloc's own synchronize made it (see `replay`), held until
    /// that malloc. Returns whether it was held.
    fn complete_or_hold(&mut self, t: u64, is_empty_cache: impl FnOnce(&CachingAllocator<D>) -> bool) -> bool {
        let held = is_empty_cache(&self.alloc);
        if held {
            self.held.push(t);
        } else {
            self.alloc.complete_free(t);
        }
        held
    }

    /// Applies `actions` (a program's [`Program::pool_actions`]) before the ops they name; ops are
    /// counted from this stepper's first.
    pub fn set_pool_actions(&mut self, actions: &[(u32, PoolAction)]) {
        self.pool_actions = actions.iter().rev().copied().collect();
    }

    fn apply_pool_actions(&mut self) {
        while let Some(&(at, action)) = self.pool_actions.last() {
            if at > self.op_index {
                break;
            }
            self.pool_actions.pop();
            match action {
                PoolAction::ReleasePool(id) => {
                    if self.alloc.find_private_pool(id).is_some() && !self.alloc.graph_pools_freeable.contains(id) {
                        self.alloc.release_pool_fully(id);
                    }
                }
                PoolAction::DropMemPool(id) => {
                    if self.alloc.find_private_pool(id).is_some() {
                        if !self.alloc.graph_pools_freeable.contains(id) {
                            self.alloc.release_pool_fully(id);
                        }
                        self.alloc.release_cached_blocks_of(Some(id));
                        drain(&mut self.alloc, &mut self.segment_events, self.next_request);
                    }
                }
                PoolAction::UseOnOom(id) => {
                    self.alloc.private_pool(id);
                    self.alloc.set_use_on_oom(id, true);
                }
                PoolAction::NoSplit(id) => self.alloc.set_no_split(id),
                PoolAction::CustomAllocator(id) => self.alloc.set_custom_allocator(id),
            }
        }
    }

    pub fn step(&mut self, op: Op, request: Option<&Request>, is_empty_cache: impl FnOnce(&CachingAllocator<D>) -> bool) -> Step {
        if !self.pool_actions.is_empty() {
            self.apply_pool_actions();
        }
        self.op_index += 1;
        let mut step = Step::default();
        if !self.outside.is_empty() {
            // What others hold when the next malloc (this one, or the one these ops precede) runs.
            let req = if let Op::Malloc(q) = op { q } else { self.next_request };
            self.alloc.device.set_outside_memory(self.outside.at(req));
        }
        let alloc = &mut self.alloc;
        match op {
            Op::Malloc(req) => {
                let Some(r) = request else {
                    debug_assert!(false, "a malloc without its request");
                    return step;
                };
                let checkpointed = if r.checkpoint { alloc.alloc_checkpointed_block(r.recorded_addr, r.size) } else { None };
                let result = match checkpointed {
                    Some(b) => Ok(b),
                    None => alloc.malloc(r.size, r.stream, r.route),
                };
                match result {
                    Ok(b) => {
                        self.slots.put_block(req, b);
                        step.address = Some(alloc.block(b).ptr);
                    }
                    Err(info) => {
                        self.ooms.push(Oom { request: req, info });
                        step.oom = true;
                    }
                }
                drain(alloc, &mut self.segment_events, req);
                self.next_request = req + 1;
                // Completions held for this malloc's synchronize happened by its end at the latest.
                for t in self.held.drain(..) {
                    alloc.complete_free(t);
                }
            }
            Op::Free { req, deferred } => {
                if let Some(b) = self.slots.take_block(req)
                    && let Some(t) = alloc.free(b, deferred)
                {
                    self.slots.put_token(req, t);
                }
            }
            Op::Complete(req) => {
                if let Some(t) = self.slots.take_token(req) {
                    step.flag = self.complete_or_hold(t, is_empty_cache);
                }
            }
            Op::ReleaseRun { .. } => {
                if is_empty_cache(alloc) {
                    step.flag = true;
                    alloc.empty_cache();
                    drain(alloc, &mut self.segment_events, self.next_request);
                    self.empty_cache_requests.push(self.next_request);
                }
            }
            Op::FreePre { pre, deferred } => {
                if let Some(b) = self.pre_blocks.get_mut(pre as usize).and_then(Option::take) {
                    self.pre_tokens[pre as usize] = alloc.free(b, deferred);
                }
            }
            Op::CompletePre(pre) => {
                if let Some(t) = self.pre_tokens.get_mut(pre as usize).and_then(Option::take) {
                    step.flag = self.complete_or_hold(t, is_empty_cache);
                }
            }
            Op::ForcedRelease { addr, unmap } => {
                if unmap {
                    alloc.unmap_free_block_at(addr);
                } else {
                    alloc.release_segment_at(addr);
                }
                drain(alloc, &mut self.segment_events, self.next_request);
            }
        }
        step
    }

    /// Completions still held complete (at the end of the trace, or of a partial replay).
    pub fn complete_held(&mut self) {
        for t in self.held.drain(..) {
            self.alloc.complete_free(t);
        }
    }

    /// After the last of `ops` ops: the pool actions placed after it apply (not those of ops a
    /// shortened program left out).
    pub fn finish_pool_actions(&mut self, ops: usize) {
        if !self.pool_actions.is_empty() {
            self.op_index = ops as u32;
            self.apply_pool_actions();
        }
    }

    /// OOMs so far.
    pub fn ooms(&self) -> &[Oom] {
        &self.ooms
    }

    /// Segment events so far.
    pub fn segment_events(&self) -> &[SegmentEvent] {
        &self.segment_events
    }

    /// The outcome (`flags` and `addresses` as the caller kept them, or empty).
    pub fn finish(self, flags: Vec<bool>, addresses: Vec<Option<u64>>) -> ReplayOutcome<D> {
        let stats = self.alloc.stats.clone();
        ReplayOutcome {
            peak_reserved: stats.reserved_bytes.all().peak as u64,
            stats,
            segment_events: self.segment_events,
            ooms: self.ooms,
            empty_cache: flags,
            empty_cache_requests: self.empty_cache_requests,
            addresses,
            allocator: self.alloc,
            restore_failures: self.restore_failures,
        }
    }
}

impl<D: Device + Clone, S: Slots + Clone> Stepper<D, S> {
    /// A copy of this replay as it would be under the allowed maximum `allowed`, for a caller
    /// that knows every decision so far to be the same under both (no comparison with the
    /// maximum flipped between them): only what reports the maximum (the OOMs') differs.
    pub fn under_maximum(&self, allowed: u64) -> Stepper<D, S> {
        let mut s = self.clone();
        s.alloc.set_allowed_memory_maximum(Some(allowed));
        for o in &mut s.ooms {
            o.info.allowed_memory_maximum = Some(allowed);
        }
        s
    }
}

impl<D: Device + Clone> Stepper<D, VecSlots> {
    /// A copy to try ops on that allocate and complete frees but free nothing (`allocsim_infer::budget`'s
    /// groups: completions and release runs, then a malloc): all of it but the blocks of the
    /// requests alive, which such ops do not read (a copy of those would cost a slot per request
    /// of the whole program).
    pub fn fork(&self) -> Stepper<D, MapSlots> {
        // (Every field named: one added to `Stepper` must be decided here too.)
        let Stepper {
            alloc,
            outside,
            slots,
            pre_blocks,
            pre_tokens,
            segment_events,
            ooms,
            empty_cache_requests,
            next_request,
            held,
            restore_failures,
            pool_actions,
            op_index,
        } = self;
        Stepper {
            alloc: alloc.clone(),
            outside: outside.clone(),
            slots: MapSlots { blocks: IntMap::default(), tokens: slots.tokens.clone() },
            pre_blocks: pre_blocks.clone(),
            pre_tokens: pre_tokens.clone(),
            segment_events: segment_events.clone(),
            ooms: ooms.clone(),
            empty_cache_requests: empty_cache_requests.clone(),
            next_request: *next_request,
            held: held.clone(),
            restore_failures: restore_failures.clone(),
            pool_actions: pool_actions.clone(),
            op_index: *op_index,
        }
    }
}

/// Restores `init` into a fresh allocator, segment by segment in address order (the order
/// [`recorded_placement_from`] lists them in), recording each pre-existing block's handle.
fn restore<D: Device>(alloc: &mut CachingAllocator<D>, init: &InitialState, pre_blocks: &mut [Option<BlockId>], pre_tokens: &mut [Option<u64>]) -> Vec<String> {
    let mut failures = Vec::new();
    for s in &init.segments {
        let route = if s.pool_id == (0, 0) { Route::Default } else { Route::Private(s.pool_id) };
        let specs: Vec<RestoredBlockSpec> = s
            .blocks
            .iter()
            .map(|&k| {
                let b = &init.blocks[k as usize];
                let state = if b.pending {
                    RestoredState::PendingFree { requested_size: b.requested_size }
                } else {
                    RestoredState::Allocated { requested_size: b.requested_size }
                };
                RestoredBlockSpec { offset: b.addr - s.addr, size: b.size, state }
            })
            .collect();
        let r = if s.expandable {
            let mapped: Vec<(u64, u64)> = s.mapped.iter().map(|&(a, l)| (a - s.addr, l)).collect();
            alloc.restore_expandable_segment(s.stream, route, s.small, &mapped, &specs)
        } else {
            alloc.restore_segment(s.size, s.stream, route, s.small, &specs)
        };
        match r {
            Ok(r) => {
                for (&k, h) in s.blocks.iter().zip(r.handles) {
                    match h {
                        RestoredHandle::Allocated(b) => pre_blocks[k as usize] = Some(b),
                        RestoredHandle::PendingFree(t) => pre_tokens[k as usize] = Some(t),
                    }
                }
            }
            Err(e) => failures.push(format!("segment at {:#x}: {e}", s.addr)),
        }
    }
    failures
}

/// Would the malloc of `r` release exactly the recorded segments itself (in its retry chain)?
fn next_malloc_makes(alloc: &CachingAllocator<SimDevice>, r: &Request, recorded: &[&TraceEntry]) -> bool {
    let mut trial = alloc.clone();
    let _ = trial.malloc(r.size, r.stream, r.route);
    let released = trial.events.iter().filter(|e| matches!(e.kind, EventKind::SegmentFree | EventKind::SegmentUnmap));
    let mut n = 0;
    for (e, rec) in released.zip(recorded) {
        let kind = if rec.action == Action::SegmentFree { EventKind::SegmentFree } else { EventKind::SegmentUnmap };
        if e.kind != kind || e.size != rec.size || e.addr != rec.addr {
            return false;
        }
        n += 1;
    }
    n == recorded.len()
}

/// The addresses a recorded run gave its segments: every `segment_alloc` (address, size) in order,
/// and the base of every expandable-segment reservation. A reservation spans 1.125 × `device_memory`
/// and starts at its first `segment_map`; it is released when an unmap leaves nothing of it mapped
/// (`release_expandable_segment`), after which a later map in its range starts a new one.
pub fn recorded_placement(trace: &[TraceEntry], device_memory: u64) -> Placement {
    recorded_placement_from(trace, device_memory, None)
}

/// [`recorded_placement`] of a trace that starts from `initial`: its segments and reservations
/// come first (in the order the replay restores them), and its reservations are live from the start.
pub fn recorded_placement_from(trace: &[TraceEntry], device_memory: u64, initial: Option<&InitialState>) -> Placement {
    let mut segments = Vec::new();
    let mut reservations: Vec<u64> = Vec::new();
    let mut addresses = RecordedAddresses::new(device_memory);
    if let Some(init) = initial {
        let (segs, res) = init.placement_lists();
        segments.extend(segs);
        reservations.extend(&res);
        for s in init.segments.iter().filter(|s| s.expandable) {
            addresses.live.push((s.addr, s.size));
        }
    }
    for e in trace {
        match addresses.push(e) {
            Recorded::Segment(a, size) => segments.push((a, size)),
            Recorded::Reservation(b) => reservations.push(b),
            Recorded::Nothing => {}
        }
    }
    Placement::Recorded { segments, reservations }
}

/// What one entry adds to the recorded run's addresses ([`RecordedAddresses::push`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recorded {
    /// A `cudaMalloc`'d segment: its address and size.
    Segment(u64, u64),
    /// An expandable segment's reservation: its base.
    Reservation(u64),
    Nothing,
}

/// The recorded run's addresses, entry by entry, in trace order: the segments `cudaMalloc`
/// returned and the bases of the reservations expandable segments mapped into (a map outside
/// every live reservation starts one). What [`recorded_placement_from`] lists, for a replay
/// that learns them as it goes.
#[derive(Clone, Debug)]
pub struct RecordedAddresses {
    /// A reservation's span: the device's memory and an eighth, in 2 MiB pages.
    reservation: u64,
    /// Live reservations: (base, mapped bytes).
    live: Vec<(u64, u64)>,
}

impl RecordedAddresses {
    pub fn new(device_memory: u64) -> RecordedAddresses {
        RecordedAddresses { reservation: (device_memory + device_memory / 8).div_ceil(2 << 20) * (2 << 20), live: Vec::new() }
    }

    #[inline]
    pub fn push(&mut self, e: &TraceEntry) -> Recorded {
        let reservation = self.reservation;
        match e.action {
            Action::SegmentAlloc => Recorded::Segment(e.addr, e.size),
            Action::SegmentMap => match self.live.iter_mut().find(|(b, _)| e.addr >= *b && e.addr < *b + reservation) {
                Some(r) => {
                    r.1 += e.size;
                    Recorded::Nothing
                }
                None => {
                    self.live.push((e.addr, e.size));
                    Recorded::Reservation(e.addr)
                }
            },
            Action::SegmentUnmap => {
                if let Some(i) = self.live.iter().position(|(b, _)| e.addr >= *b && e.addr < *b + reservation) {
                    self.live[i].1 = self.live[i].1.saturating_sub(e.size);
                    if self.live[i].1 == 0 {
                        self.live.remove(i);
                    }
                }
                Recorded::Nothing
            }
            _ => Recorded::Nothing,
        }
    }
}

/// The placements `--placements N` tries, in order: the recorded run's addresses, ascending,
/// descending, lowest fit, then seeded random ones.
pub fn plausible_placements(trace: &[TraceEntry], device_memory: u64, n: usize) -> Vec<(String, Placement)> {
    plausible_placements_from(trace, device_memory, n, None)
}

/// [`plausible_placements`] of a trace that starts from `initial`.
pub fn plausible_placements_from(trace: &[TraceEntry], device_memory: u64, n: usize, initial: Option<&InitialState>) -> Vec<(String, Placement)> {
    let mut v = vec![
        ("recorded".to_string(), recorded_placement_from(trace, device_memory, initial)),
        ("ascending".to_string(), Placement::Ascending),
        ("descending".to_string(), Placement::Descending),
        ("lowest-fit".to_string(), Placement::LowestFit),
    ];
    let mut seed = 1;
    while v.len() < n {
        v.push((format!("random-{seed}"), Placement::Random(seed)));
        seed += 1;
    }
    v.truncate(n);
    v
}
