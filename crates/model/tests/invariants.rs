//! Property tests of the allocator model: random sequences of `malloc` / `free` (immediate or with
//! outstanding cross-stream events) / event completion / `synchronize` / `empty_cache`, under a
//! fixed list of `PYTORCH_CUDA_ALLOC_CONF` settings, with and without a memory limit, under every
//! simulated segment placement. After every op the structural invariants hold
//! (`check_invariants()`), plus the accounting and safety properties checked in [`Sim::check`].
//!
//! What "capacity" means here: either the allowed maximum (`set_per_process_memory_fraction`) on a
//! device with the H200's memory, or the simulated device's own total memory (cudaMalloc itself
//! fails). With expandable segments the allowed-maximum check uses the request's `alloc_size`
//! while `map_block` maps whole pages (PyTorch 2.11 does the same, spec §5.1), so there the bound
//! is `capacity + page size` rather than `capacity`.
//!
//! Private pools (`Route::Private((1, 0))`) are never made freeable here, so their segments are
//! never released: the end-of-run "everything released" assertions only apply to the default
//! pools (they check that whatever remains belongs to the private pool).
//!
//! Run: `cargo test -p allocsim-model --test invariants`. `PROPTEST_CASES=N` overrides the number
//! of cases.

use std::collections::VecDeque;

use allocsim_model::allocator::Block;
use allocsim_model::constants::{H200_TOTAL_MEMORY, K_SMALL_BUFFER, K_SMALL_SIZE, MIB};
use allocsim_model::stats::{DeviceStats, Stat, StatArray};
use allocsim_model::{AllocatorConfig, BlockId, CachingAllocator, EventKind, Placement, Route, SimDevice};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

type Alloc = CachingAllocator<SimDevice>;

const CONFIGS: &[&str] = &[
    "",
    "expandable_segments:True",
    "max_split_size_mb:40",
    "max_split_size_mb:64,max_non_split_rounding_mb:30",
    "roundup_power2_divisions:4",
    "roundup_power2_divisions:[2:8,256:4,>:2]",
    "garbage_collection_threshold:0.6",
    "large_segment_size_mb:64",
    "expandable_segments:True,large_segment_size_mb:64",
];

const STREAMS: &[u64] = &[0, 7, 0x3000_0000];
const PRIVATE: Route = Route::Private((1, 0));

// ---------------------------------------------------------------------------------------------
// Ops and setups
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Op {
    Malloc {
        size: u64,
        stream: u64,
        private: bool,
    },
    /// Frees the live allocation at `idx` (modulo the number of live allocations); `pending`: a
    /// cross-stream free whose events are outstanding.
    Free {
        idx: usize,
        pending: bool,
    },
    /// The oldest outstanding cross-stream free completes.
    CompleteOne,
    Sync,
    EmptyCache,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Limit {
    /// `set_allowed_memory_maximum(Some(capacity))` on a device of H200 size.
    AllowedMaximum,
    /// A device of `capacity` bytes, no allowed maximum.
    DeviceTotal,
}

#[derive(Clone, Debug)]
struct Setup {
    conf: &'static str,
    capacity: Option<u64>,
    limit: Limit,
    placement: Placement,
}

fn size_strategy() -> impl Strategy<Value = u64> {
    prop_oneof![
        3 => 1u64..4096,
        3 => 4096u64..MIB,
        3 => MIB..12 * MIB,
        1 => 12 * MIB..300 * MIB,
    ]
}

fn op_strategy(allow_private: bool) -> impl Strategy<Value = Op> {
    let private_weight = if allow_private { 1u32 } else { 0 };
    let malloc = (size_strategy(), prop::sample::select(STREAMS), prop::bool::weighted(0.1 * private_weight as f64))
        .prop_map(|(size, stream, private)| Op::Malloc { size, stream, private });
    prop_oneof![
        10 => malloc,
        8 => (any::<usize>(), prop::bool::weighted(0.25)).prop_map(|(idx, pending)| Op::Free { idx, pending }),
        2 => Just(Op::CompleteOne),
        1 => Just(Op::Sync),
        1 => Just(Op::EmptyCache),
    ]
}

fn placement_strategy() -> impl Strategy<Value = Placement> {
    prop_oneof![Just(Placement::Ascending), Just(Placement::Descending), Just(Placement::LowestFit), any::<u64>().prop_map(Placement::Random),]
}

fn setup_strategy() -> impl Strategy<Value = Setup> {
    (
        prop::sample::select(CONFIGS),
        prop_oneof![1 => Just(None), 3 => (64 * MIB..=2048 * MIB).prop_map(Some)],
        prop_oneof![3 => Just(Limit::AllowedMaximum), 1 => Just(Limit::DeviceTotal)],
        placement_strategy(),
    )
        .prop_map(|(conf, mut capacity, mut limit, placement)| {
            if conf.starts_with("garbage_collection_threshold") {
                // Garbage collection runs only under an allowed maximum.
                capacity = capacity.or(Some(1024 * MIB));
                limit = Limit::AllowedMaximum;
            }
            Setup { conf, capacity, limit, placement }
        })
}

// ---------------------------------------------------------------------------------------------
// The simulation and its checks
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
struct Live {
    id: BlockId,
    ptr: u64,
    size: u64,
}

struct Sim {
    a: Alloc,
    setup: Setup,
    live: Vec<Live>,
    pending: VecDeque<u64>,
    used_private: bool,
    /// Check "a free merges its free neighbours" explicitly after every free.
    check_merge: bool,
}

fn stat_arrays(s: &DeviceStats) -> [(&'static str, &StatArray); 9] {
    [
        ("allocation", &s.allocation),
        ("segment", &s.segment),
        ("active", &s.active),
        ("inactive_split", &s.inactive_split),
        ("allocated_bytes", &s.allocated_bytes),
        ("reserved_bytes", &s.reserved_bytes),
        ("active_bytes", &s.active_bytes),
        ("inactive_split_bytes", &s.inactive_split_bytes),
        ("requested_bytes", &s.requested_bytes),
    ]
}

fn is_free(b: &Block) -> bool {
    !b.allocated && b.event_count == 0
}

macro_rules! ensure {
    ($cond:expr, $($arg:tt)+) => {
        if !$cond {
            return Err(format!($($arg)+));
        }
    };
}

impl Sim {
    fn new(setup: &Setup) -> Sim {
        let config = AllocatorConfig::parse(setup.conf).unwrap_or_else(|e| panic!("{:?}: {e}", setup.conf));
        let total = match (setup.limit, setup.capacity) {
            (Limit::DeviceTotal, Some(c)) => c,
            _ => H200_TOTAL_MEMORY,
        };
        let mut a = CachingAllocator::new(config, SimDevice::new(total, setup.placement.clone()));
        if setup.limit == Limit::AllowedMaximum {
            a.set_allowed_memory_maximum(setup.capacity);
        }
        Sim { a, setup: setup.clone(), live: Vec::new(), pending: VecDeque::new(), used_private: false, check_merge: false }
    }

    /// The largest `page` by which mapping whole pages may overshoot the allowed maximum.
    fn overshoot(&self) -> u64 {
        if self.a.config.expandable_segments && self.setup.limit == Limit::AllowedMaximum { self.a.config.large_segment_size.max(K_SMALL_BUFFER) } else { 0 }
    }

    fn apply(&mut self, op: &Op) -> Result<(), String> {
        match *op {
            Op::Malloc { size, stream, private } => self.malloc(size, stream, private)?,
            Op::Free { idx, pending } => {
                if !self.live.is_empty() {
                    let l = self.live.swap_remove(idx % self.live.len());
                    self.free(l, pending)?;
                }
            }
            Op::CompleteOne => {
                if let Some(t) = self.pending.pop_front() {
                    // Returns false when a synchronize inside a malloc (release_cached_blocks)
                    // already completed it.
                    self.a.complete_free(t);
                }
            }
            Op::Sync => {
                self.a.synchronize_and_free_events();
                self.pending.clear();
                ensure!(self.a.pending_free_count() == 0, "pending frees remain after synchronize");
            }
            Op::EmptyCache => {
                self.a.empty_cache();
                self.pending.clear();
                ensure!(self.a.pending_free_count() == 0, "pending frees remain after empty_cache");
                self.check_default_pools_released("empty_cache")?;
            }
        }
        self.a.events.clear();
        self.check()
    }

    fn malloc(&mut self, size: u64, stream: u64, private: bool) -> Result<(), String> {
        let route = if private { PRIVATE } else { Route::Default };
        let rounded = self.a.config.round_size(size);
        self.a.events.clear();
        match self.a.malloc(size, stream, route) {
            Ok(id) => {
                self.used_private |= private;
                let b = self.a.block(id).clone();
                ensure!(b.allocated, "malloc({size}) returned block {id}, which is not allocated");
                ensure!(b.event_count == 0, "malloc({size}) returned block {id} with outstanding events");
                ensure!(b.size >= rounded, "malloc({size}): block of {} bytes < rounded request {rounded}", b.size);
                ensure!(b.requested_size == size, "malloc({size}): requested_size {}", b.requested_size);
                ensure!(b.stream == stream, "malloc(stream {stream}) got a block of stream {}", b.stream);
                ensure!(b.mapped, "malloc({size}) returned an unmapped block");
                ensure!(!self.live.iter().any(|l| l.id == id), "malloc returned live block id {id} again");
                let segs = self.a.segments();
                let Some(seg) = segs.iter().find(|s| s.blocks.contains(&id)) else {
                    return Err(format!("malloc({size}): block {id} is in no segment"));
                };
                ensure!(
                    seg.address <= b.ptr && b.ptr + b.size <= seg.address + seg.total_size,
                    "malloc({size}): block [{:#x}, +{}) outside its segment [{:#x}, +{})",
                    b.ptr,
                    b.size,
                    seg.address,
                    seg.total_size
                );
                ensure!(seg.is_small == (rounded <= K_SMALL_SIZE), "malloc({size}): rounded {rounded} served from is_small={}", seg.is_small);
                let want_pool = if private { (1, 0) } else { (0, 0) };
                ensure!(seg.pool_id == want_pool, "malloc({size}, {route:?}) served from pool {:?}", seg.pool_id);
                ensure!(seg.stream == stream, "malloc(stream {stream}) served from a segment of stream {}", seg.stream);
                self.live.push(Live { id, ptr: b.ptr, size: b.size });
            }
            Err(oom) => {
                ensure!(oom.rounded_size == rounded, "OOM rounded_size {} != round_size({size}) = {rounded}", oom.rounded_size);
                ensure!(self.a.events.last().map(|e| e.kind) == Some(EventKind::Oom), "OOM without a trailing Oom event: {:?}", self.a.events.last());
                let cap = match self.setup.capacity {
                    Some(c) => c,
                    None => return Err(format!("malloc({size}) ran out of memory with no capacity set: {oom:?}")),
                };
                // The last attempt of a malloc outside a capture is alloc_block after
                // release_cached_blocks, so the OOM is justified by the final state. A private-pool
                // malloc (a capture) stops after release_available_cached_blocks, which may have
                // released cached oversize segments (and returned false) without a retry: PyTorch
                // does the same (spec §5.3: "Blocks released before returning false stay released").
                let released = self.a.events.iter().any(|e| e.kind == EventKind::SegmentFree);
                match self.setup.limit {
                    Limit::AllowedMaximum => ensure!(
                        self.a.total_allocated_memory + oom.alloc_size > cap || (private && released),
                        "OOM although total_allocated_memory {} + alloc_size {} <= allowed {cap}",
                        self.a.total_allocated_memory,
                        oom.alloc_size
                    ),
                    Limit::DeviceTotal => {
                        if !(self.a.config.expandable_segments || private && released) {
                            ensure!(
                                self.a.device.used() + oom.alloc_size > cap,
                                "OOM although the device has {} used + alloc_size {} <= total {cap}",
                                self.a.device.used(),
                                oom.alloc_size
                            );
                        }
                    }
                }
                if !private {
                    // Outside a capture an OOM comes only after release_cached_blocks.
                    ensure!(self.a.pending_free_count() == 0, "OOM with pending frees (no synchronize happened)");
                    self.pending.clear();
                    self.check_default_pools_released("OOM")?;
                }
            }
        }
        Ok(())
    }

    fn free(&mut self, l: Live, pending: bool) -> Result<(), String> {
        let token = self.a.free(l.id, pending);
        ensure!(token.is_some() == pending, "free(pending={pending}) returned {token:?}");
        if let Some(t) = token {
            self.pending.push_back(t);
            let b = self.a.block(l.id);
            ensure!(!b.allocated && b.event_count > 0, "pending-freed block {} is not active-with-events", l.id);
            return Ok(());
        }
        if self.check_merge {
            let b = self.a.block(l.id);
            ensure!(is_free(b) && b.mapped, "freed block {} is not free: {b:?}", l.id);
            ensure!(b.size >= l.size, "freed block {} shrank: {} < {}", l.id, b.size, l.size);
            ensure!(b.ptr <= l.ptr && l.ptr + l.size <= b.ptr + b.size, "freed block {} no longer covers its range", l.id);
            for n in [b.prev(), b.next()].into_iter().flatten() {
                let nb = self.a.block(n);
                ensure!(!(is_free(nb) && nb.mapped), "free of block {} left free neighbour {n} unmerged: {nb:?}", l.id);
            }
            // And the merged block is in exactly one segment.
            let n_seg = self.a.segments().iter().filter(|s| s.blocks.contains(&l.id)).count();
            ensure!(n_seg == 1, "freed block {} lies in {n_seg} segments", l.id);
        }
        Ok(())
    }

    /// After a synchronize + release (empty_cache, or an OOM outside a capture): no default-pool
    /// segment is completely free, and no free default-pool expandable block holds a whole page.
    fn check_default_pools_released(&self, when: &str) -> Result<(), String> {
        for s in self.a.segments() {
            if s.pool_id != (0, 0) {
                continue;
            }
            if s.is_expandable {
                for &id in &s.blocks {
                    let b = self.a.block(id);
                    if !is_free(b) {
                        continue;
                    }
                    let es = self.a.expandable_segments[b.expandable_segment.unwrap() as usize].as_ref().unwrap();
                    let (base, page) = (es.ptr, es.segment_size);
                    let begin = (b.ptr - base).div_ceil(page);
                    let end = (b.ptr + b.size - base) / page;
                    ensure!(begin >= end, "after {when}: free expandable block {id} ({:#x}, {}) still maps whole pages", b.ptr, b.size);
                }
            } else {
                ensure!(
                    s.blocks.iter().any(|&id| !is_free(self.a.block(id))),
                    "after {when}: completely free default-pool segment at {:#x} ({} bytes) was not released",
                    s.address,
                    s.total_size
                );
            }
        }
        Ok(())
    }

    fn check(&self) -> Result<(), String> {
        let a = &self.a;
        a.check_invariants()?;
        let s = &a.stats;
        if let Some(cap) = self.setup.capacity {
            let bound = cap + self.overshoot();
            ensure!(
                a.total_allocated_memory <= bound,
                "total_allocated_memory {} > capacity {cap} (+ overshoot {})",
                a.total_allocated_memory,
                self.overshoot()
            );
            ensure!(s.reserved_bytes.all().current as u64 <= bound, "reserved {} > capacity {cap}", s.reserved_bytes.all().current);
        }
        ensure!(a.device.used() == a.total_allocated_memory, "device.used() {} != total_allocated_memory {}", a.device.used(), a.total_allocated_memory);
        let stat_ok = |name: &str, pool: usize, st: &Stat| -> Result<(), String> {
            ensure!(st.current >= 0, "{name}[{pool}].current = {} < 0", st.current);
            ensure!(st.peak >= st.current, "{name}[{pool}]: peak {} < current {}", st.peak, st.current);
            ensure!(st.allocated - st.freed == st.current, "{name}[{pool}]: allocated - freed != current: {st:?}");
            Ok(())
        };
        for (name, arr) in stat_arrays(s) {
            for (i, st) in arr.0.iter().enumerate() {
                stat_ok(name, i, st)?;
            }
            ensure!(arr.0[0].peak <= arr.0[1].peak + arr.0[2].peak, "{name}: aggregate peak > sum of pool peaks");
        }
        stat_ok("oversize_allocations", 0, &s.oversize_allocations)?;
        stat_ok("oversize_segments", 0, &s.oversize_segments)?;
        let (alloc, active, res, req) =
            (s.allocated_bytes.all().current, s.active_bytes.all().current, s.reserved_bytes.all().current, s.requested_bytes.all().current);
        ensure!(alloc <= active && active <= res, "allocated {alloc} <= active {active} <= reserved {res} fails");
        ensure!(req <= active, "requested {req} > active {active}");
        ensure!(s.allocation.all().current as usize == self.live.len(), "allocation.current {} != {} live", s.allocation.all().current, self.live.len());
        // Live allocations keep their block and address, and never overlap.
        let mut ranges = Vec::with_capacity(self.live.len());
        for l in &self.live {
            let b = a.block(l.id);
            ensure!(b.allocated && b.ptr == l.ptr && b.size == l.size, "live block {} changed: {b:?} (was {l:?})", l.id);
            ranges.push((l.ptr, l.ptr + l.size));
        }
        ranges.sort_unstable();
        for w in ranges.windows(2) {
            ensure!(w[0].1 <= w[1].0, "live allocations overlap: {:#x?} and {:#x?}", w[0], w[1]);
        }
        Ok(())
    }

    /// Frees everything, completes every pending free, empties the cache; checks that only
    /// private-pool memory remains.
    fn finish(&mut self) -> Result<(), String> {
        while let Some(l) = self.live.pop() {
            self.free(l, false)?;
            self.check()?;
        }
        while let Some(t) = self.pending.pop_front() {
            self.a.complete_free(t);
            self.check()?;
        }
        ensure!(self.a.pending_free_count() == 0, "{} pending frees left", self.a.pending_free_count());
        self.a.empty_cache();
        self.check()?;
        let a = &self.a;
        let s = &a.stats;
        for (name, arr) in [
            ("allocated_bytes", &s.allocated_bytes),
            ("active_bytes", &s.active_bytes),
            ("allocation", &s.allocation),
            ("active", &s.active),
            ("requested_bytes", &s.requested_bytes),
        ] {
            ensure!(arr.all().current == 0, "{name}.all.current = {} after freeing everything", arr.all().current);
        }
        let segs = a.segments();
        ensure!(segs.iter().all(|x| x.pool_id == (1, 0)), "default-pool segments remain after empty_cache: {segs:?}");
        let private_bytes: u64 = segs.iter().map(|x| x.total_size).sum();
        ensure!(s.reserved_bytes.all().current as u64 == private_bytes, "reserved {} != private segments {private_bytes}", s.reserved_bytes.all().current);
        if !self.used_private {
            ensure!(s.reserved_bytes.all().current == 0, "reserved_bytes.all.current = {}", s.reserved_bytes.all().current);
            ensure!(s.segment.all().current == 0, "segment.all.current = {}", s.segment.all().current);
            ensure!(s.inactive_split.all().current == 0, "inactive_split.all.current = {}", s.inactive_split.all().current);
            ensure!(a.device.used() == 0, "device.used() = {}", a.device.used());
            ensure!(a.total_allocated_memory == 0, "total_allocated_memory = {}", a.total_allocated_memory);
            // An expandable segment whose first map failed (device full) is never mapped, so
            // release_blocks (which walks only the free *mapped* blocks) never releases its address
            // reservation: PyTorch 2.11 does the same. Such a segment holds no memory.
            ensure!(a.expandable_segments.iter().flatten().all(|e| e.mapped_size == 0), "expandable segments still mapped: {:?}", a.expandable_segments);
            ensure!(
                a.live_blocks().all(|(_, b)| !b.mapped && b.expandable_segment.is_some()),
                "blocks remain: {:?}",
                a.live_blocks().filter(|(_, b)| b.mapped || b.expandable_segment.is_none()).collect::<Vec<_>>()
            );
        }
        // empty_cache is idempotent (apart from counting one more synchronize).
        let before = self.a.stats.clone();
        self.a.empty_cache();
        let mut after = self.a.stats.clone();
        after.num_sync_all_streams -= 1;
        ensure!(before == after, "a second empty_cache changed the stats: {before:?} -> {after:?}");
        Ok(())
    }
}

fn run(setup: &Setup, ops: &[Op], check_merge: bool) -> Result<(), TestCaseError> {
    let mut sim = Sim::new(setup);
    sim.check_merge = check_merge;
    for (i, op) in ops.iter().enumerate() {
        sim.apply(op).map_err(|e| TestCaseError::fail(format!("after op {i} {op:?}: {e}")))?;
    }
    sim.finish().map_err(|e| TestCaseError::fail(format!("at the end: {e}")))?;
    Ok(())
}

proptest! {
    // No failure persistence: integration tests have no lib.rs for proptest's regression files, and
    // this file must not write into the source tree.
    #![proptest_config(ProptestConfig { cases: 128, max_shrink_iters: 4096, failure_persistence: None, ..ProptestConfig::default() })]

    /// Every invariant after every op, with private pools in the mix.
    #[test]
    fn invariants_hold_after_every_op(setup in setup_strategy(), ops in prop::collection::vec(op_strategy(true), 1..300)) {
        run(&setup, &ops, false)?;
    }

    /// Default pools only: at the end everything is released (reserved == 0, no segments, the
    /// device is empty), and every free merges its free neighbours.
    #[test]
    fn free_merges_free_neighbours_and_all_is_released(setup in setup_strategy(), ops in prop::collection::vec(op_strategy(false), 1..300)) {
        run(&setup, &ops, true)?;
    }
}

// ---------------------------------------------------------------------------------------------
// Expandable segments: decisions do not depend on where segments are placed
// ---------------------------------------------------------------------------------------------

/// A small deterministic generator (splitmix64) for fixed op sequences.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn fixed_ops(seed: u64, n: usize, streams: &[u64]) -> Vec<Op> {
    let mut r = Rng(seed);
    (0..n)
        .map(|_| match r.below(22) {
            0..=9 => {
                let size = match r.below(10) {
                    0..=2 => 1 + r.below(4095),
                    3..=5 => 4096 + r.below(MIB - 4096),
                    6..=8 => MIB + r.below(11 * MIB),
                    _ => 12 * MIB + r.below(288 * MIB),
                };
                Op::Malloc { size, stream: streams[r.below(streams.len() as u64) as usize], private: false }
            }
            10..=17 => Op::Free { idx: r.next() as usize, pending: streams.len() > 1 && r.below(4) == 0 },
            18 | 19 => Op::CompleteOne,
            20 => Op::Sync,
            _ => Op::EmptyCache,
        })
        .collect()
}

/// What one run looks like independently of addresses: per op, the stats and the malloc outcome
/// (block size and offset in its expandable segment, or OOM).
/// Per op: the stats after it, and for a malloc `Ok((block size, offset in its segment))` or
/// `Err(rounded size)` (an OOM).
type PlacementFreeTrace = Vec<(DeviceStats, Option<Result<(u64, u64), u64>>)>;

fn placement_free_trace(conf: &str, capacity: Option<u64>, placement: Placement, ops: &[Op]) -> PlacementFreeTrace {
    let setup = Setup { conf: leak(conf), capacity, limit: Limit::AllowedMaximum, placement };
    let mut sim = Sim::new(&setup);
    let mut out = Vec::with_capacity(ops.len());
    for (i, op) in ops.iter().enumerate() {
        let outcome = if let Op::Malloc { size, .. } = *op {
            let before = sim.live.len();
            sim.apply(op).unwrap_or_else(|e| panic!("{conf} op {i}: {e}"));
            Some(if sim.live.len() > before {
                let l = *sim.live.last().unwrap();
                let b = sim.a.block(l.id);
                let es = sim.a.expandable_segments[b.expandable_segment.unwrap() as usize].as_ref().unwrap();
                Ok((l.size, l.ptr - es.ptr))
            } else {
                Err(sim.a.config.round_size(size))
            })
        } else {
            sim.apply(op).unwrap_or_else(|e| panic!("{conf} op {i}: {e}"));
            None
        };
        out.push((sim.a.stats.clone(), outcome));
    }
    sim.finish().unwrap_or_else(|e| panic!("{conf} at the end: {e}"));
    out.push((sim.a.stats.clone(), None));
    out
}

fn leak(s: &str) -> &'static str {
    Box::leak(s.to_string().into_boxed_str())
}

fn placements() -> Vec<Placement> {
    vec![Placement::Ascending, Placement::Descending, Placement::LowestFit, Placement::Random(1), Placement::Random(0xdead_beef)]
}

/// Compares runs of the same ops under every placement; returns the first difference.
fn compare_placements(conf: &str, capacity: Option<u64>, ops: &[Op]) -> Result<(), String> {
    let ps = placements();
    let reference = placement_free_trace(conf, capacity, ps[0].clone(), ops);
    for p in &ps[1..] {
        let other = placement_free_trace(conf, capacity, p.clone(), ops);
        for (i, (x, y)) in reference.iter().zip(&other).enumerate() {
            if x != y {
                return Err(format!("{conf:?} capacity {capacity:?}: {:?} and {p:?} differ after op {i} ({:?}):\n  {:?}\n  {:?}", ps[0], ops.get(i), x, y));
            }
        }
    }
    Ok(())
}

const ES_CONFIGS: &[&str] = &[
    "expandable_segments:True",
    "expandable_segments:True,large_segment_size_mb:64",
    "expandable_segments:True,max_split_size_mb:40",
    "expandable_segments:True,roundup_power2_divisions:4",
];
const ES_CAPACITIES: &[Option<u64>] = &[None, Some(256 * MIB), Some(1024 * MIB), Some(3000 * MIB + 12345)];

/// With expandable segments and a single stream, every decision (and so every stat, every block
/// size and every offset inside the segment) is the same whatever addresses the device gives.
#[test]
fn expandable_single_stream_is_placement_independent() {
    for seed in 0..6u64 {
        let ops = fixed_ops(seed, 400, &[0]);
        for conf in ES_CONFIGS {
            for &cap in ES_CAPACITIES {
                compare_placements(conf, cap, &ops).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
            }
        }
    }
}

/// The same with several streams (each stream has its own expandable segment; blocks are ordered
/// by stream first, so the relative placement of the segments should not matter either).
#[test]
fn expandable_multi_stream_is_placement_independent() {
    for seed in 100..104u64 {
        let ops = fixed_ops(seed, 400, STREAMS);
        for conf in ES_CONFIGS {
            for &cap in ES_CAPACITIES {
                compare_placements(conf, cap, &ops).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
            }
        }
    }
}

/// With expandable segments the allowed-maximum check uses `alloc_size` (the cudaMalloc size) but
/// `map_block` maps whole pages, so the mapped total can pass the allowed maximum by less than one
/// page. PyTorch 2.11 does the same (spec §5.1: "it uses `alloc_size` even on the expandable
/// path"); the property tests allow for it.
#[test]
fn expandable_mapping_may_pass_the_allowed_maximum_by_less_than_a_page() {
    let mut a = CachingAllocator::new(AllocatorConfig::parse("expandable_segments:True").unwrap(), SimDevice::new(H200_TOTAL_MEMORY, Placement::Ascending));
    a.set_allowed_memory_maximum(Some(34 * MIB));
    // 12 MiB + 512: alloc_size 14 MiB; maps one 20 MiB page.
    a.malloc(12 * MIB + 1, 0, Route::Default).unwrap();
    assert_eq!(a.total_allocated_memory, 20 * MIB);
    // 20 MiB + 14 MiB <= 34 MiB passes the check; the ~8 MiB free tail of the first page is not
    // enough, so a second 20 MiB page is mapped: 40 MiB > 34 MiB.
    a.malloc(12 * MIB + 1, 0, Route::Default).unwrap();
    assert_eq!(a.total_allocated_memory, 40 * MIB);
    assert_eq!(a.stats.reserved_bytes.all().current as u64, 40 * MIB);
    a.check_invariants().unwrap();
    // 17 MiB does not fit the ~16 MiB free tail; 40 + 18 > 34 fails the check, and releasing the
    // cache unmaps nothing (no whole free page): OOM.
    let oom = a.malloc(17 * MIB, 0, Route::Default).unwrap_err();
    assert_eq!(oom.alloc_size, 18 * MIB);
    assert_eq!(a.total_allocated_memory, 40 * MIB);
    a.check_invariants().unwrap();
}
