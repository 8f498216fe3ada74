//! Which requests went to which private pool (CUDA graphs, `torch.cuda.MemPool`), and what
//! happened to the pools' users, from what a 2.11 snapshot records. The trace does not name a
//! request's pool, nor record `beginAllocateToPool`, `releasePool` or a MemPool's destructor; it
//! does record where every block and segment was, on which stream, and in which order segments
//! were released. The final segments name the pool of the segments still alive.
//!
//! * **Segment instances.** Every block lies in a segment: a `segment_alloc` … `segment_free`
//!   range, or an expandable segment's reservation (one per stream, pool and size class, from its
//!   first `segment_map` until nothing of it is mapped). All blocks of a segment belong to its
//!   pool, so a request is routed to the pool of the segment its recorded address lies in, and
//!   the question is each segment's pool.
//! * **Labels.** A segment alive at the end has its final `segment_pool_id`. Every other one
//!   starts in the default pools; a replay under the trace's own settings then shows where that
//!   reading fails (the first request placed elsewhere than recorded, or the first segment event
//!   that differs), and the segments involved there (the one the request was recorded in, the one
//!   the model put it in, those of the differing events, the latest ones made before) are tried
//!   in another pool: a new one, one of the latest private pools, or the default pools. The
//!   reading that reproduces the trace furthest is kept, and the search goes on from its first
//!   divergence. Where two readings fit equally far, the one that changes less is kept.
//! * **Release order.** A second search starts from the reading the release runs' order suggests
//!   (`seed_from_releases`): `release_blocks` frees a pool's segments sorted by (stream, size,
//!   address), a MemPool destructor's `emptyCache(id)` small before large, `empty_cache()` the
//!   default pools large before small; so each run splits into ascending pieces, read as pools
//!   and a default head or tail, run by run, repeated until no run changes (a pool released only at the
//!   end decides requests made long before). Of the two searches, the one that reproduces the
//!   trace further is kept; where both reproduce it as far, the one with fewer private pools.
//! * **Ids.** A pool with a segment alive at the end has that id; the others get MemPool ids
//!   `(0, n)` in the order of their first segment, counting on from the known ones (MemPools are
//!   numbered as they are made, from 1), which decides the order in which `release_cached_blocks`
//!   visits them (`graph_pools_freeable`).
//! * **Users.** A run of segment releases that starts with a private pool's segments is read as
//!   that MemPool's destructor (`releasePool`, then `emptyCache(id)`: its small pool, then its
//!   large), pool by pool, followed by whatever the rest of the run is (an `empty_cache()` or a
//!   malloc's own releases). A private pool whose segments appear later in a run became freeable
//!   just before it (`releasePool` to 0). A pool that is never seen released keeps its users.
//! * **`use_on_oom`.** A request recorded in a private pool's cached block while the default
//!   pools could not serve it under the allowed maximum is read as `try_mempool_fallback`: the
//!   request stays in the default route and the pool is marked `use_on_oom`.
//! * **Kinds.** A pool made with `no_split=True` or with its own allocator shows it in what it
//!   left: an allocated block `should_split` would have cut (final segments), a cudaMalloc'd
//!   segment under expandable segments (final segments, or a segment instance the reading puts in
//!   the pool): `allocsim_program::program::pool_kinds`, and [`Plan::apply`] for the instances.
//! * **Checkpoints.** CUDA-graph trees restore their pool to a checkpoint before recording a new
//!   graph (`_cuda_setCheckpointPoolState`, from `apply_checkpoint_execution_state_in_allocator`):
//!   the allocations it makes are the checkpoint's blocks, taken in place, not mallocs. They are
//!   recognised by that frame in their recorded stack.

use allocsim_model::AllocatorConfig;
use allocsim_model::allocator::{MempoolId, Route, splits_block};
use allocsim_model::constants::K_SMALL_SIZE;
use allocsim_trace::hash::IntMap;
use allocsim_trace::{Action, Frame, SnapshotSegment, TraceEntry};

use crate::budget::RecordedEvent;
use allocsim_program::program::{Op, PoolAction, Program};
use allocsim_program::replay::{EmptyCacheCalls, ReplayOptions, ReplayOutcome, replay};

/// Frames that mark an allocation made by `_cuda_setCheckpointPoolState`.
const CHECKPOINT_FRAMES: &[&str] = &["apply_checkpoint_execution_state_in_allocator", "setCheckpointPoolState", "_set_checkpoint_pool_state"];

/// Whether a recorded stack is that of a checkpoint restoration.
pub fn is_checkpoint_stack(frames: &[Frame]) -> bool {
    frames.iter().any(|f| CHECKPOINT_FRAMES.iter().any(|n| f.name.contains(n)))
}

/// Marks the requests `_cuda_setCheckpointPoolState` made (see the module documentation).
pub fn mark_checkpoint_allocations(program: &mut Program, stacks: &[Vec<Frame>]) {
    let marked: Vec<bool> = stacks.iter().map(|s| is_checkpoint_stack(s)).collect();
    for r in &mut program.requests {
        r.checkpoint = !r.recorded_oom && marked.get(r.stack as usize).copied().unwrap_or(false);
    }
}

/// One segment's life: a cudaMalloc'd range, or an expandable segment's reservation.
#[derive(Clone, Debug)]
struct Instance {
    /// The request during (or before) which it was made.
    created: u32,
    /// The request before which it was released (`u32::MAX`: alive at the end).
    released: u32,
    lo: u64,
    hi: u64,
    /// Its final `segment_pool_id`, when alive at the end.
    final_pool: Option<MempoolId>,
    /// `cudaMalloc`'d (`segment_alloc`), not mapped: in a private pool under expandable
    /// segments, the pool has its own allocator.
    malloced: bool,
}

/// The instances of a trace, the instance each request lies in, and the instance each release
/// entry (by trace index) releases.
struct Instances {
    all: Vec<Instance>,
    of_request: Vec<Option<u32>>,
    of_release: IntMap<u32, u32>,
    /// The recorded stack of each release entry (by trace index; 0: none recorded).
    release_stacks: IntMap<u32, allocsim_trace::StackId>,
    /// The settings the trace ran under (rounding and split rules).
    config: AllocatorConfig,
}

/// Where in the release entries `start..end` (trace indices) another call's releases begin:
/// the first entry recorded with another stack than the first (each call records its own
/// context: an `empty_cache()` its frames, a MemPool destructor the frames that dropped the
/// pool, a malloc the request's). `None` where they all have one, or stacks were not recorded.
fn call_boundary(inst: &Instances, start: u32, end: u32) -> Option<u32> {
    let stack = |ti: u32| inst.release_stacks.get(&ti).copied().unwrap_or(0);
    let first = stack(start.min(end.saturating_sub(1)));
    (start..end).find(|&ti| first != 0 && stack(ti) != 0 && stack(ti) != first)
}

fn instances(trace: &[TraceEntry], segments: &[SnapshotSegment], device_memory: u64, config: &AllocatorConfig) -> Instances {
    let reservation = (device_memory + device_memory / 8).div_ceil(2 << 20) * (2 << 20);
    let mut all: Vec<Instance> = Vec::new();
    let mut live: Vec<u32> = Vec::new();
    // Mapped bytes per live expandable instance.
    let mut mapped: IntMap<u32, u64> = IntMap::default();
    let mut of_request = Vec::new();
    let mut of_release = IntMap::default();
    let mut req = 0u32;
    let find = |all: &[Instance], live: &[u32], addr: u64| live.iter().copied().find(|&i| addr >= all[i as usize].lo && addr < all[i as usize].hi);
    let mut release_stacks = IntMap::default();
    for (ti, e) in trace.iter().enumerate() {
        if matches!(e.action, Action::SegmentFree | Action::SegmentUnmap) {
            release_stacks.insert(ti as u32, e.stack);
        }
        match e.action {
            Action::SegmentAlloc => {
                live.push(all.len() as u32);
                all.push(Instance { created: req, released: u32::MAX, lo: e.addr, hi: e.addr.saturating_add(e.size), final_pool: None, malloced: true });
            }
            Action::SegmentMap => match find(&all, &live, e.addr) {
                Some(i) => *mapped.entry(i).or_default() += e.size,
                None => {
                    let i = all.len() as u32;
                    live.push(i);
                    mapped.insert(i, e.size);
                    all.push(Instance {
                        created: req,
                        released: u32::MAX,
                        lo: e.addr,
                        hi: e.addr.saturating_add(reservation),
                        final_pool: None,
                        malloced: false,
                    });
                }
            },
            Action::SegmentFree => {
                if let Some(i) = find(&all, &live, e.addr) {
                    of_release.insert(ti as u32, i);
                    all[i as usize].released = req;
                    live.retain(|&x| x != i);
                }
            }
            Action::SegmentUnmap => {
                if let Some(i) = find(&all, &live, e.addr) {
                    of_release.insert(ti as u32, i);
                    let m = mapped.entry(i).or_default();
                    *m = m.saturating_sub(e.size);
                    if *m == 0 {
                        all[i as usize].released = req;
                        live.retain(|&x| x != i);
                    }
                }
            }
            Action::Alloc => {
                of_request.push(find(&all, &live, e.addr));
                req += 1;
            }
            Action::Oom => {
                of_request.push(None);
                req += 1;
            }
            _ => {}
        }
    }
    for s in segments.iter().filter(|s| s.pool_id != (0, 0)) {
        if let Some(i) = find(&all, &live, s.address) {
            all[i as usize].final_pool = Some(s.pool_id);
        }
    }
    Instances { all, of_request, of_release, release_stacks, config: config.clone() }
}

/// A segment's pool: the default pools, or private pool group `.0`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Label {
    Default,
    Pool(u32),
}

/// What the inference concluded, for the report.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolInference {
    /// Private pools found (id, whether the id was recorded in the final segments).
    pub pools: Vec<(MempoolId, bool)>,
    /// Replays tried.
    pub trials: usize,
    /// Whether the final reading reproduces the trace (segment events and addresses).
    pub exact: bool,
}

#[derive(Clone)]
struct Plan {
    labels: Vec<Label>,
    /// Per group: the known id, if any.
    groups: Vec<Option<MempoolId>>,
    /// Release runs (by op index) whose trailing private segments are read as MemPool
    /// destructors after the run, pool by pool in the recorded order, rather than as pools made
    /// freeable before it and released by it in `graph_pools_freeable` order.
    tail_drops: Vec<usize>,
}

/// See [`score`].
type Score = (u32, usize, usize, usize, i64);

impl Plan {
    /// The groups some segment uses, in the order of their first segment.
    fn group_order(&self, inst: &Instances) -> Vec<u32> {
        let mut order: Vec<u32> = Vec::new();
        let mut by_creation: Vec<usize> = (0..self.labels.len()).collect();
        by_creation.sort_by_key(|&i| (inst.all[i].created, i));
        for i in by_creation {
            if let Label::Pool(g) = self.labels[i]
                && !order.contains(&g)
            {
                order.push(g);
            }
        }
        order
    }

    /// Group ids: known ones, else `(0, n)` counting on in order of first segment.
    fn ids(&self, inst: &Instances) -> Vec<MempoolId> {
        let mut first: Vec<Option<u32>> = vec![None; self.groups.len()];
        for (i, l) in self.labels.iter().enumerate() {
            if let Label::Pool(g) = *l
                && first[g as usize].is_none_or(|c| inst.all[i].created < c)
            {
                first[g as usize] = Some(inst.all[i].created);
            }
        }
        let mut order: Vec<usize> = (0..self.groups.len()).collect();
        order.sort_by_key(|&g| first[g].unwrap_or(u32::MAX));
        let taken: Vec<MempoolId> = self.groups.iter().flatten().copied().collect();
        let mut ids = vec![(0, 0); self.groups.len()];
        let mut n = 1i64;
        for g in order {
            match self.groups[g] {
                Some(id) => {
                    ids[g] = id;
                    if id.0 == 0 {
                        n = n.max(id.1 + 1);
                    }
                }
                None => {
                    while taken.contains(&(0, n)) {
                        n += 1;
                    }
                    ids[g] = (0, n);
                    n += 1;
                }
            }
        }
        ids
    }

    /// The program with this reading's routes and pool actions.
    fn apply(&self, base: &Program, inst: &Instances) -> Program {
        let ids = self.ids(inst);
        let mut p = base.clone();
        p.private_pools.clear();
        // What the final segments show of pools' kinds stays (`allocsim_program::program::pool_kinds`).
        p.pool_actions.retain(|a| matches!(a.1, PoolAction::NoSplit(_) | PoolAction::CustomAllocator(_)));
        for (q, r) in p.requests.iter_mut().enumerate() {
            r.route = match inst.of_request.get(q).copied().flatten().map(|i| self.labels[i as usize]) {
                Some(Label::Pool(g)) => Route::Private(ids[g as usize]),
                _ => Route::Default,
            };
            if let Route::Private(id) = r.route
                && !p.private_pools.contains(&id)
            {
                p.private_pools.push(id);
            }
        }
        let mut freeable: Vec<MempoolId> = Vec::new();
        for (oi, op) in p.ops.iter_mut().enumerate() {
            let Op::ReleaseRun { start, end } = *op else { continue };
            let pool_of = |ti: u32| match inst.of_release.get(&ti).map(|&i| self.labels[i as usize]) {
                Some(Label::Pool(g)) => Some(ids[g as usize]),
                _ => None,
            };
            // Leading private segments: MemPool destructors, pool by pool.
            let mut k = start;
            while k < end {
                let Some(id) = pool_of(k) else { break };
                p.pool_actions.push((oi as u32, PoolAction::DropMemPool(id)));
                freeable.push(id);
                while k < end && pool_of(k) == Some(id) {
                    k += 1;
                }
            }
            // Trailing private segments read as destructors after the run: those recorded with
            // another stack than the run's first release (one call, one context: an
            // `empty_cache()` records its own, a MemPool destructor the frames that dropped the
            // pool), else all of them where that fits better.
            let mut tail = end;
            let other_call = call_boundary(inst, k, end).filter(|&b| (b..end).all(|ti| pool_of(ti).is_some()));
            if let Some(b) = other_call {
                tail = b;
            } else if self.tail_drops.contains(&oi) {
                while tail > k && pool_of(tail - 1).is_some() {
                    tail -= 1;
                }
            }
            let mut t = tail;
            while t < end {
                let id = pool_of(t).expect("private");
                p.pool_actions.push((oi as u32 + 1, PoolAction::DropMemPool(id)));
                freeable.push(id);
                while t < end && pool_of(t) == Some(id) {
                    t += 1;
                }
            }
            for ti in k..tail {
                if let Some(id) = pool_of(ti)
                    && !freeable.contains(&id)
                {
                    p.pool_actions.push((oi as u32, PoolAction::ReleasePool(id)));
                    freeable.push(id);
                }
            }
            *op = Op::ReleaseRun { start: k, end: tail };
        }
        // A cudaMalloc'd segment in a private pool: the pool's own allocator where expandable
        // segments are on (`allocsim_program::program::pool_kinds`); nothing changes where they are off.
        for (i, inst) in inst.all.iter().enumerate() {
            if let Label::Pool(g) = self.labels[i]
                && inst.malloced
            {
                let a = PoolAction::CustomAllocator(ids[g as usize]);
                if !p.pool_actions.iter().any(|x| x.1 == a) {
                    p.pool_actions.push((0, a));
                }
            }
        }
        for id in no_split_shown(&p, inst) {
            let a = PoolAction::NoSplit(id);
            if !p.pool_actions.iter().any(|x| x.1 == a) {
                p.pool_actions.push((0, a));
            }
        }
        p.pool_actions.sort_by_key(|a| a.0);
        p
    }
}

/// The private pools the trace shows made with `MemPool(no_split=True)`: a request of a pool
/// that got a new cudaMalloc'd segment while another segment of that pool, on its stream and of
/// its size class, held a single live block at its base whose remainder `should_split` would
/// have cut off and freed (`splits_block`), large enough for the request. A pool that splits
/// would have served the request from that remainder (`get_free_block` looks in the pool before
/// `alloc_block` calls cudaMalloc); a `no_split` pool gives the whole segment to its one block.
/// (`test_mempool_no_split` in PyTorch's test_cuda.py, whose blocks are freed before the
/// snapshot, so the final segments show nothing: `allocsim_program::program::pool_kinds`.)
fn no_split_shown(p: &Program, inst: &Instances) -> Vec<MempoolId> {
    let cfg = &inst.config;
    let mut out: Vec<MempoolId> = Vec::new();
    // Live requests per instance.
    let mut live: IntMap<u32, Vec<u32>> = IntMap::default();
    let instance_of = |q: u32| inst.of_request.get(q as usize).copied().flatten();
    for op in &p.ops {
        match *op {
            Op::Malloc(q) => {
                let r = &p.requests[q as usize];
                let Some(i) = instance_of(q) else { continue };
                let seg = &inst.all[i as usize];
                if let Route::Private(id) = r.route
                    && !out.contains(&id)
                    && !r.recorded_oom
                    && seg.malloced
                    && seg.created == q
                    && r.recorded_addr == seg.lo
                {
                    let size = cfg.round_size(r.size);
                    let small = r.size <= K_SMALL_SIZE;
                    let shown = live.iter().any(|(&j, reqs)| {
                        let other = &inst.all[j as usize];
                        let [b] = reqs.as_slice() else { return false };
                        let held = &p.requests[*b as usize];
                        let held_size = cfg.round_size(held.size);
                        let remainder = other.hi - other.lo - held_size.min(other.hi - other.lo);
                        j != i
                            && other.malloced
                            && held.route == r.route
                            && held.stream == r.stream
                            && held.recorded_addr == other.lo
                            && (held.size <= K_SMALL_SIZE) == small
                            && splits_block(cfg, other.hi - other.lo, held_size, small, false)
                            && remainder >= size
                            && (size >= cfg.max_split_size || remainder < cfg.max_split_size)
                    });
                    if shown {
                        out.push(id);
                    }
                }
                live.entry(i).or_default().push(q);
            }
            Op::Free { req, deferred: false } | Op::Complete(req) => {
                if let Some(i) = instance_of(req)
                    && let Some(v) = live.get_mut(&i)
                {
                    v.retain(|&x| x != req);
                }
            }
            _ => {}
        }
    }
    out
}

/// How far a replay reproduces the trace: the first request at which it differs (in an address
/// or a segment event), then how many segment events it reproduces before differing, then how
/// many of that request's segment events it makes in the recorded order (the longest common
/// subsequence: a release run partly in order), then how many addresses it reproduces.
fn score(o: &ReplayOutcome, p: &Program, recorded: &[RecordedEvent]) -> Score {
    let mut first = u32::MAX;
    let mut prefix = recorded.len();
    for (k, r) in recorded.iter().enumerate() {
        match o.segment_events.get(k) {
            Some(e) if (e.request, e.action, e.addr, e.size) == *r => {}
            Some(e) => {
                first = r.0.min(e.request);
                prefix = k;
                break;
            }
            None => {
                first = r.0;
                prefix = k;
                break;
            }
        }
    }
    if first == u32::MAX && o.segment_events.len() > recorded.len() {
        first = o.segment_events[recorded.len()].request;
    }
    let mut matched = 0;
    for (q, r) in p.requests.iter().enumerate() {
        if r.recorded_oom {
            continue;
        }
        if o.addresses[q] == Some(r.recorded_addr) {
            matched += 1;
        } else {
            first = first.min(q as u32);
        }
    }
    let at = |v: Vec<RecordedEvent>| v;
    let rec = at(recorded.iter().filter(|e| e.0 == first).copied().collect());
    let sim = at(o.segment_events.iter().filter(|e| e.request == first).map(|e| (e.request, e.action, e.addr, e.size)).collect());
    // Fewer changes of pool from one request to the next: `use_mem_pool` and captures route
    // runs of requests.
    let switches = p.requests.windows(2).filter(|w| w[0].route != w[1].route).count() as i64;
    (first, prefix, lcs(&rec, &sim), matched, -switches)
}

/// The length of the longest common subsequence (for short runs of events).
fn lcs<T: PartialEq>(a: &[T], b: &[T]) -> usize {
    if a.len() * b.len() > 1 << 20 {
        return a.iter().zip(b).take_while(|(x, y)| x == y).count();
    }
    let mut row = vec![0usize; b.len() + 1];
    for x in a {
        let mut diag = 0;
        for (j, y) in b.iter().enumerate() {
            let up = row[j + 1];
            row[j + 1] = if x == y { diag + 1 } else { up.max(row[j]) };
            diag = up;
        }
    }
    row[b.len()]
}

/// At most this many replays per trace, and at most this many ops replayed in all.
const MAX_TRIALS: usize = 3000;
const MAX_OPS_REPLAYED: usize = 200_000_000;

/// Infers the private pools of `program` (built from `trace` and `segments`) by replaying under
/// `opts` (the trace's own settings, addresses and budget), and rewrites its routes and pool
/// actions. Leaves the program as it was when nothing better is found.
pub fn infer(program: &mut Program, trace: &[TraceEntry], segments: &[SnapshotSegment], opts: &ReplayOptions) -> PoolInference {
    let inst = instances(trace, segments, opts.device_memory, &opts.config);
    let (recorded, _) = crate::budget::recorded_events(trace);
    let mut groups: Vec<Option<MempoolId>> = Vec::new();
    let mut labels = Vec::with_capacity(inst.all.len());
    for s in &inst.all {
        labels.push(match s.final_pool {
            Some(id) => {
                let g = groups.iter().position(|&x| x == Some(id)).unwrap_or_else(|| {
                    groups.push(Some(id));
                    groups.len() - 1
                });
                Label::Pool(g as u32)
            }
            None => Label::Default,
        });
    }
    let start = Plan { labels, groups, tail_drops: Vec::new() };
    let run = |plan: &Plan| {
        let p = plan.apply(program, &inst);
        let o = replay(&p, opts, EmptyCacheCalls::Infer(trace));
        let s = score(&o, &p, &recorded);
        (p, o, s)
    };
    let max_trials = MAX_TRIALS.min(MAX_OPS_REPLAYED / (program.ops.len() + 1)).max(1);
    let search = |lookahead: bool, start: &Plan, seed_trials: usize| {
        let mut plan = start.clone();
        let (mut best_p, mut best_o, mut best) = run(&plan);
        let mut trials = 1 + seed_trials;
        loop {
            let before = (best, plan.labels.clone(), plan.tail_drops.clone());
            // Relabel segments where the reading first fails. Where several relabellings reproduce
            // the trace equally far, each is followed a few steps further and the one that gets
            // furthest is kept (the first tried among equals).
            while best.0 != u32::MAX && trials < max_trials {
                let tied = step(&plan, &best_p, &best_o, best, &inst, &recorded, &run, &mut trials, max_trials);
                debug(|| format!("pools: score {best:?}, {} equal readings", tied.len()));
                let mut chosen: Option<(usize, Score)> = None;
                if lookahead && tied.len() > 1 {
                    for (k, t) in tied.iter().enumerate().take(LOOKAHEAD_BRANCHES) {
                        let (mut lp, mut lpp, mut lo, mut ls) = (t.0.clone(), t.1.clone(), t.2.clone(), t.3);
                        for _ in 0..LOOKAHEAD_STEPS {
                            if ls.0 == u32::MAX || trials >= max_trials {
                                break;
                            }
                            let next = step(&lp, &lpp, &lo, ls, &inst, &recorded, &run, &mut trials, max_trials);
                            match next.into_iter().next() {
                                Some(n) => {
                                    (lp, lpp, lo, ls) = n;
                                }
                                None => break,
                            }
                        }
                        let key = (ls.0, ls.1, ls.2);
                        if chosen.is_none_or(|(_, c)| key > (c.0, c.1, c.2)) {
                            chosen = Some((k, ls));
                        }
                    }
                }
                let pick = chosen.map_or(0, |c| c.0);
                match tied.into_iter().nth(pick) {
                    Some((t, p, o, s)) => {
                        plan = t;
                        best_p = p;
                        best_o = o;
                        best = s;
                    }
                    None => break,
                }
            }
            // A segment made between two segments of one pool (in the order segments were made)
            // is tried in that pool: `use_mem_pool` routes every request of its window.
            let mut by_creation: Vec<usize> = (0..plan.labels.len()).collect();
            by_creation.sort_by_key(|&i| (inst.all[i].created, i));
            for k in 1..by_creation.len().saturating_sub(1) {
                let (a, c, b) = (by_creation[k - 1], by_creation[k], by_creation[k + 1]);
                if trials >= max_trials || inst.all[c].final_pool.is_some() {
                    continue;
                }
                let (la, lb) = (plan.labels[a], plan.labels[b]);
                if la != lb || la == Label::Default || plan.labels[c] == la {
                    continue;
                }
                let mut t = plan.clone();
                t.labels[c] = la;
                let (p, o, s) = run(&t);
                trials += 1;
                if s >= best {
                    plan = t;
                    best_p = p;
                    best_o = o;
                    best = s;
                }
            }
            // A pool released on both sides of a run's call boundary (`call_boundary`) was made
            // freeable by the first call, which released all of it: the second call's segments
            // are another pool's.
            for op in program.ops.iter() {
                let Op::ReleaseRun { start, end } = *op else { continue };
                let Some(b) = call_boundary(&inst, start, end) else { continue };
                let label = |ti: u32| inst.of_release.get(&ti).map(|&i| plan.labels[i as usize]);
                let before: Vec<Label> = (start..b).filter_map(label).filter(|l| matches!(l, Label::Pool(_))).collect();
                let mut split: Vec<Label> = (b..end).filter_map(label).filter(|l| before.contains(l)).collect();
                split.dedup();
                for g in split {
                    if trials >= max_trials {
                        break;
                    }
                    let mut t = plan.clone();
                    let fresh = Label::Pool(t.groups.len() as u32);
                    t.groups.push(None);
                    for ti in b..end {
                        if let Some(&i) = inst.of_release.get(&ti)
                            && t.labels[i as usize] == g
                            && inst.all[i as usize].final_pool.is_none()
                        {
                            t.labels[i as usize] = fresh;
                        }
                    }
                    let (p, o, s) = run(&t);
                    trials += 1;
                    if s >= best {
                        plan = t;
                        best_p = p;
                        best_o = o;
                        best = s;
                    }
                }
            }
            // Trailing private segments of a release run: destructors after it, where that fits better.
            for (oi, op) in program.ops.iter().enumerate() {
                let Op::ReleaseRun { start, end } = *op else { continue };
                let last_private =
                    (start..end).next_back().and_then(|ti| inst.of_release.get(&ti)).is_some_and(|&i| matches!(plan.labels[i as usize], Label::Pool(_)));
                if !last_private || trials >= max_trials {
                    continue;
                }
                let mut t = plan.clone();
                match t.tail_drops.iter().position(|&x| x == oi) {
                    Some(k) => {
                        t.tail_drops.remove(k);
                    }
                    None => t.tail_drops.push(oi),
                }
                let (p, o, s) = run(&t);
                trials += 1;
                if s > best {
                    plan = t;
                    best_p = p;
                    best_o = o;
                    best = s;
                }
            }
            // Fewer pools where they fit as well: merge pools made one after the other.
            let mut merged = true;
            while merged && trials < max_trials {
                merged = false;
                let order = plan.group_order(&inst);
                for w in order.windows(2) {
                    let (a, b) = (w[0], w[1]);
                    if plan.groups[a as usize].is_some() && plan.groups[b as usize].is_some() {
                        continue;
                    }
                    let mut t = plan.clone();
                    let (keep, gone) = if t.groups[b as usize].is_some() { (b, a) } else { (a, b) };
                    for l in t.labels.iter_mut() {
                        if *l == Label::Pool(gone) {
                            *l = Label::Pool(keep);
                        }
                    }
                    let (p, o, s) = run(&t);
                    trials += 1;
                    if s >= best {
                        plan = t;
                        best_p = p;
                        best_o = o;
                        best = s;
                        merged = true;
                        break;
                    }
                }
            }
            if best.0 == u32::MAX || trials >= max_trials || (best, plan.labels.clone(), plan.tail_drops.clone()) == before {
                break;
            }
        }
        // Among the readings that reproduce the trace as far, the one whose requests change pool
        // least often: `use_mem_pool` and captures route runs of consecutive requests.
        let mut changed = true;
        while changed && trials < max_trials {
            changed = false;
            for c in 0..inst.all.len() {
                if inst.all[c].final_pool.is_some() || trials >= max_trials {
                    continue;
                }
                let mut labels = options(&plan, &inst, c as u32);
                labels.retain(|l| !matches!(l, Label::Pool(g) if *g as usize == plan.groups.len()));
                for label in labels {
                    if label == plan.labels[c] {
                        continue;
                    }
                    let mut t = plan.clone();
                    t.labels[c] = label;
                    let (p, o, s) = run(&t);
                    trials += 1;
                    if (s.0, s.1, s.2, s.3) >= (best.0, best.1, best.2, best.3) && s > best {
                        plan = t;
                        best_p = p;
                        drop(o);
                        best = s;
                        changed = true;
                        break;
                    }
                }
            }
        }
        (plan, best_p, best, trials)
    };
    // With and without following equal readings further: the one that reproduces the trace
    // further, else the one found by looking ahead (its pools are the more plausible).
    let (plan_a, p_a, s_a, t_a) = search(true, &start, 0);
    let (plan, best_p, best, trials) = if s_a.0 == u32::MAX {
        (plan_a, p_a, s_a, t_a)
    } else {
        let (plan_b, p_b, s_b, t_b) = search(false, &start, 0);
        if (s_b.0, s_b.1, s_b.2) > (s_a.0, s_a.1, s_a.2) { (plan_b, p_b, s_b, t_a + t_b) } else { (plan_a, p_a, s_a, t_a + t_b) }
    };
    // Not reproduced: search again from the reading the release runs' order suggests, kept if
    // it reproduces the trace further (a pool released only late in the trace decides requests
    // made long before, beyond the reach of the search's steps).
    // Among readings that reproduce the trace as far, the one with fewer private pools.
    let pools_used = |p: &Plan| (0..p.groups.len() as u32).filter(|&g| p.labels.contains(&Label::Pool(g))).count();
    let (plan, best_p, best, trials) = if !worth_seeding(program) {
        (plan, best_p, best, trials)
    } else {
        let (seeded, seed_trials) = seed_from_releases(start.clone(), program, trace, &inst, &run, max_trials);
        let (plan_c, p_c, s_c, t_c) = search(true, &seeded, seed_trials);
        let better =
            (s_c.0, s_c.1, s_c.2) > (best.0, best.1, best.2) || ((s_c.0, s_c.1, s_c.2) == (best.0, best.1, best.2) && pools_used(&plan_c) < pools_used(&plan));
        debug(|| format!("seeded search: {s_c:?} with {} pools; unseeded {best:?} with {}", pools_used(&plan_c), pools_used(&plan)));
        if better { (plan_c, p_c, s_c, trials + t_c) } else { (plan, best_p, best, trials + t_c) }
    };
    debug(|| {
        let ids = plan.ids(&inst);
        let mut out = String::new();
        for (i, s) in inst.all.iter().enumerate() {
            let l = match plan.labels[i] {
                Label::Pool(g) => format!("{:?}", ids[g as usize]),
                Label::Default => "default".into(),
            };
            out += &format!("pools: segment {:#x}+{} requests {}..{}: {l}\n", s.lo, s.hi - s.lo, s.created, s.released);
        }
        out + &format!("pools: actions {:?}", best_p.pool_actions)
    });
    // Drop groups no label uses (a search step may leave one behind).
    let ids = plan.ids(&inst);
    let used: Vec<u32> = plan.labels.iter().filter_map(|l| if let Label::Pool(g) = *l { Some(g) } else { None }).collect();
    let mut pools: Vec<(MempoolId, bool)> = Vec::new();
    for g in 0..plan.groups.len() as u32 {
        if used.contains(&g) && !pools.iter().any(|x| x.0 == ids[g as usize]) {
            pools.push((ids[g as usize], plan.groups[g as usize].is_some()));
        }
    }
    // A reading that reproduces the trace less far than the final segments alone is not kept.
    let first_p = start.apply(program, &inst);
    let initial = score(&replay(&first_p, opts, EmptyCacheCalls::Infer(trace)), &first_p, &recorded);
    if (best.0, best.1, best.2) >= (initial.0, initial.1, initial.2) {
        *program = best_p;
    }
    PoolInference { pools, trials, exact: best.0 == u32::MAX }
}

/// A first reading from the order of each release run (see the module documentation): PyTorch
/// releases a pool's cached segments in `release_blocks` order, sorted by (stream, size,
/// address), a private pool's small segments before its large ones (`emptyCache(id)` from a
/// MemPool's destructor) and the default pools' large before small (`empty_cache()`), so a run
/// splits into ascending pieces, and the pieces into pools. Each run is tried, in trace order, as
/// all default, with its trailing pieces default (large then small) and the others private, and
/// with every piece private (a private pool's small piece joined to the large piece after it); the
/// reading that reproduces the trace furthest is kept for that run before the next one is tried.
fn seed_from_releases(
    mut plan: Plan,
    program: &Program,
    trace: &[TraceEntry],
    inst: &Instances,
    run: &impl Fn(&Plan) -> (Program, ReplayOutcome, Score),
    max_trials: usize,
) -> (Plan, usize) {
    let mut trials = 0;
    let mut best: Option<Score> = None;
    // Runs later in the trace can decide segments made before an earlier run's divergence (a pool
    // released only at the end), so the runs are tried again until no run changes.
    for _pass in 0..3 {
        let before = plan.labels.clone();
        let mut done: Vec<bool> = vec![false; inst.all.len()];
        for op in &program.ops {
            let Op::ReleaseRun { start, end } = *op else { continue };
            // The run's segments in release order, with their keys.
            let mut seq: Vec<(u32, (bool, u64, u64, u64))> = Vec::new();
            for ti in start..end {
                let Some(&i) = inst.of_release.get(&ti) else { continue };
                if done[i as usize] || inst.all[i as usize].final_pool.is_some() || seq.iter().any(|x| x.0 == i) {
                    continue;
                }
                let e = &trace[ti as usize];
                seq.push((i, (e.size == allocsim_model::constants::K_SMALL_BUFFER, e.stream, e.size, e.addr)));
            }
            if seq.is_empty() {
                continue;
            }
            // Ascending pieces of one size class.
            let mut pieces: Vec<(bool, Vec<u32>)> = Vec::new();
            let mut last: Option<(bool, u64, u64, u64)> = None;
            for &(i, k) in &seq {
                match (pieces.last_mut(), last) {
                    (Some(p), Some(l)) if l.0 == k.0 && (l.1, l.2, l.3) < (k.1, k.2, k.3) => p.1.push(i),
                    _ => pieces.push((k.0, vec![i])),
                }
                last = Some(k);
            }
            // How many trailing pieces fit `empty_cache()`'s order: large, then small.
            let n = pieces.len();
            let mut tails = vec![0];
            if pieces[n - 1].0 {
                tails.push(1);
                if n >= 2 && !pieces[n - 2].0 {
                    tails.push(2);
                }
            } else {
                tails.push(1);
            }
            // How many leading pieces fit `empty_cache()` before the freeable pools and destructors
            // after it: the default pools' large, then small.
            let mut heads = Vec::new();
            if n >= 2 && !pieces[0].0 && pieces[1].0 {
                heads.push(2);
            }
            if n >= 2 {
                heads.push(1);
            }
            let mut options: Vec<Vec<Label>> = vec![vec![Label::Default; n]];
            let splits = tails.iter().map(|&t| (0, t)).chain(heads.iter().map(|&h| (h, 0)));
            for (h, t) in splits {
                let mut labels = vec![Label::Default; n];
                let mut g = plan.groups.len() as u32;
                let mut k = h;
                while k < n - t {
                    labels[k] = Label::Pool(g);
                    if pieces[k].0 && k + 1 < n - t && !pieces[k + 1].0 {
                        labels[k + 1] = Label::Pool(g);
                        k += 1;
                    }
                    g += 1;
                    k += 1;
                }
                if !options.contains(&labels) {
                    options.push(labels);
                }
            }
            let current: Vec<Label> = pieces.iter().map(|p| plan.labels[p.1[0] as usize]).collect();
            let mut chosen: Option<(Plan, Score)> = None;
            for labels in options {
                if trials >= max_trials {
                    break;
                }
                let mut t = plan.clone();
                for (p, &l) in pieces.iter().zip(&labels) {
                    if let Label::Pool(g) = l {
                        while t.groups.len() <= g as usize {
                            t.groups.push(None);
                        }
                    }
                    for &i in &p.1 {
                        t.labels[i as usize] = l;
                    }
                }
                if same_reading(&labels, &current)
                    && let Some(b) = best
                {
                    chosen = chosen.or(Some((t, b)));
                    continue;
                }
                let (_, _, sc) = run(&t);
                trials += 1;
                debug(|| format!("seed: run {start}..{end}: {labels:?} scores {sc:?}"));
                if chosen.as_ref().is_none_or(|c| sc > c.1) {
                    chosen = Some((t, sc));
                }
            }
            if let Some((t, sc)) = chosen {
                plan = t;
                best = Some(sc);
            }
            for p in &pieces {
                for &i in &p.1 {
                    done[i as usize] = true;
                }
            }
        }
        if same_reading(&before, &plan.labels) || trials >= max_trials {
            break;
        }
    }
    // Drop groups no segment uses.
    let used: Vec<bool> = (0..plan.groups.len() as u32).map(|g| plan.labels.contains(&Label::Pool(g))).collect();
    let mut remap = vec![0u32; plan.groups.len()];
    let mut groups = Vec::new();
    for (g, &u) in used.iter().enumerate() {
        if u {
            remap[g] = groups.len() as u32;
            groups.push(plan.groups[g]);
        }
    }
    for l in plan.labels.iter_mut() {
        if let Label::Pool(g) = *l {
            *l = Label::Pool(remap[g as usize]);
        }
    }
    plan.groups = groups;
    (plan, trials)
}

/// Whether the reading from the release runs' order is worth a search of its own: the trace
/// releases segments (else there is nothing to read it from).
fn worth_seeding(program: &Program) -> bool {
    program.ops.iter().any(|o| matches!(o, Op::ReleaseRun { start, end } if end > start))
}

/// Whether two labellings are the same reading, group numbers aside: the same segments in the
/// default pools, and the others grouped alike.
fn same_reading(a: &[Label], b: &[Label]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| (*x == Label::Default) == (*y == Label::Default))
        && (0..a.len()).all(|i| (0..a.len()).all(|j| (a[i] == a[j]) == (b[i] == b[j])))
}

/// Appends a line to the file `ALLOCSIM_DEBUG_POOLS` names, if set: the search's steps, for
/// working on the inference. (Not stderr: the CLI holds its lock while a command runs.)
fn debug(line: impl FnOnce() -> String) {
    if let Some(path) = std::env::var_os("ALLOCSIM_DEBUG_POOLS") {
        use std::io::Write;
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
            let _ = writeln!(f, "{}", line());
        }
    }
}

/// Tied readings followed further, and how far.
const LOOKAHEAD_BRANCHES: usize = 4;
const LOOKAHEAD_STEPS: usize = 4;

type Reading = (Plan, Program, ReplayOutcome, Score);

/// One search step from `plan` (whose replay is `o`, scored `best`): every single relabelling of
/// a segment involved in the first divergence that reproduces the trace further, the best ones
/// (equal in how far) in the order tried.
#[allow(clippy::too_many_arguments)]
fn step(
    plan: &Plan,
    p: &Program,
    o: &ReplayOutcome,
    best: Score,
    inst: &Instances,
    recorded: &[RecordedEvent],
    run: &impl Fn(&Plan) -> (Program, ReplayOutcome, Score),
    trials: &mut usize,
    max_trials: usize,
) -> Vec<Reading> {
    let key = |x: &Score| (x.0, x.1, x.2);
    let mut out: Vec<Reading> = Vec::new();
    for c in candidates(inst, o, p, recorded, best.0) {
        if inst.all[c as usize].final_pool.is_some() {
            continue;
        }
        for label in options(plan, inst, c) {
            if label == plan.labels[c as usize] || *trials >= max_trials {
                continue;
            }
            let mut t = plan.clone();
            if let Label::Pool(g) = label
                && g as usize == t.groups.len()
            {
                t.groups.push(None);
            }
            t.labels[c as usize] = label;
            let (tp, to, ts) = run(&t);
            *trials += 1;
            if key(&ts) < key(&best) || (key(&ts) == key(&best) && ts <= best) {
                continue;
            }
            match out.first() {
                Some(f) if key(&ts) < key(&f.3) => {}
                Some(f) if key(&ts) == key(&f.3) => out.push((t, tp, to, ts)),
                _ => out = vec![(t, tp, to, ts)],
            }
        }
    }
    out
}

/// The segments worth relabelling at a divergence at request `d`.
fn candidates(inst: &Instances, o: &ReplayOutcome, p: &Program, recorded: &[RecordedEvent], d: u32) -> Vec<u32> {
    let mut c: Vec<u32> = Vec::new();
    let mut add = |i: Option<u32>| {
        if let Some(i) = i
            && !c.contains(&i)
        {
            c.push(i);
        }
    };
    // The segment holding `addr` while request `q` ran; for a segment event, the one it made
    // (`created == q`) or released (`released == q`).
    let holding =
        |addr: u64, q: u32| inst.all.iter().enumerate().find(|(_, s)| s.created <= q && s.released > q && addr >= s.lo && addr < s.hi).map(|(i, _)| i as u32);
    let event_of = |action: Action, addr: u64, q: u32| {
        let made = action.reserves();
        inst.all
            .iter()
            .enumerate()
            .find(|(_, s)| addr >= s.lo && addr < s.hi && if made { s.created == q } else { s.released == q })
            .map(|(i, _)| i as u32)
            .or_else(|| holding(addr, q))
    };
    if let Some(r) = p.requests.get(d as usize) {
        add(inst.of_request.get(d as usize).copied().flatten());
        if let Some(Some(a)) = o.addresses.get(d as usize)
            && Some(*a) != Some(r.recorded_addr)
        {
            add(holding(*a, d));
        }
    }
    for e in recorded.iter().filter(|e| e.0 == d) {
        add(event_of(e.1, e.2, d));
    }
    for e in o.segment_events.iter().filter(|e| e.request == d) {
        add(event_of(e.action, e.addr, d));
    }
    // The latest segments made up to here.
    let mut recent: Vec<u32> = (0..inst.all.len() as u32).filter(|&i| inst.all[i as usize].created <= d).collect();
    recent.sort_by_key(|&i| std::cmp::Reverse(inst.all[i as usize].created));
    for i in recent.into_iter().take(4) {
        add(Some(i));
    }
    c
}

/// The pools a segment may be tried in: the private pools of the segments made just before or
/// after it, a new private pool, the default pools.
fn options(plan: &Plan, inst: &Instances, c: u32) -> Vec<Label> {
    let mut v = Vec::new();
    let mut by_creation: Vec<usize> = (0..inst.all.len()).collect();
    by_creation.sort_by_key(|&i| (inst.all[i].created, i));
    let at = by_creation.iter().position(|&i| i == c as usize).unwrap_or(0);
    let mut near: Vec<usize> = (at.saturating_sub(3)..(at + 4).min(by_creation.len())).filter(|&k| k != at).collect();
    near.sort_by_key(|&k| (k as i64 - at as i64).unsigned_abs());
    for k in near {
        if let Label::Pool(g) = plan.labels[by_creation[k]]
            && !v.contains(&Label::Pool(g))
        {
            v.push(Label::Pool(g));
        }
    }
    v.push(Label::Pool(plan.groups.len() as u32));
    v.push(Label::Default);
    v
}

/// Whether a replay reproduces every recorded segment event and address.
pub fn self_replay_exact(o: &ReplayOutcome, p: &Program, trace: &[TraceEntry]) -> bool {
    let (recorded, _) = crate::budget::recorded_events(trace);
    score(o, p, &recorded).0 == u32::MAX
}

/// Whether to look for private pools behind a trace's divergence: it made segments (a pool
/// that made none changed nothing).
pub fn worth_inferring(trace: &[TraceEntry], _program: &Program) -> bool {
    trace.iter().any(|e| matches!(e.action, Action::SegmentAlloc | Action::SegmentMap))
}
