//! `DeviceCachingAllocator`: the per-device caching allocator, rule for rule as in PyTorch 2.11's
//! `c10/cuda/CUDACachingAllocator.cpp`. Function names follow PyTorch's so each rule can be found
//! in both: `malloc`, `get_free_block`, `alloc_block`, `should_split`, `alloc_found_block`, `free`,
//! `free_block`, `try_merge_blocks`, `release_available_cached_blocks`, `release_cached_blocks`,
//! `release_blocks`, `release_block`, `garbage_collect_cached_blocks`, `find_expandable_block`,
//! `map_block`, `unmap_block`, `try_allocate_expandable_block`, `synchronize_and_free_events`.

use std::collections::BTreeMap;

use crate::config::AllocatorConfig;
use crate::constants::*;
use crate::device::Device;
use crate::flat_hash_map::MempoolIdSet;
use crate::free_set::FreeSet;
use crate::stats::DeviceStats;

/// Index of a block in the allocator's arena. Stable while the block lives.
pub type BlockId = u32;
const NIL: BlockId = u32::MAX;

/// Index into the allocator's block pools (`BlockPool`).
pub type PoolIdx = u32;
/// The default large pool (`large_blocks`).
pub const LARGE_POOL: PoolIdx = 0;
/// The default small pool (`small_blocks`).
pub const SMALL_POOL: PoolIdx = 1;

/// A private pool id (`MempoolId_t`): graph pools `(n, 0)`, user MemPools `(0, n)`.
pub type MempoolId = (i64, i64);

/// A `Block`: one address range of a segment; blocks of a segment form an address-ordered list.
#[derive(Clone, Debug)]
pub struct Block {
    pub stream: u64,
    pub size: u64,
    /// The original (unrounded) request last served by this Block object (stale when inactive).
    pub requested_size: u64,
    pub pool: PoolIdx,
    pub ptr: u64,
    pub allocated: bool,
    /// Backed by physical memory (always true outside expandable segments).
    pub mapped: bool,
    pub prev: BlockId,
    pub next: BlockId,
    /// Outstanding cross-stream events (a freed block stays active until they complete).
    pub event_count: u32,
    pub gc_count_base: i64,
    /// Index of the expandable segment this block belongs to.
    pub expandable_segment: Option<u32>,
}

impl Block {
    pub fn is_split(&self) -> bool {
        self.prev != NIL || self.next != NIL
    }
    pub fn prev(&self) -> Option<BlockId> {
        (self.prev != NIL).then_some(self.prev)
    }
    pub fn next(&self) -> Option<BlockId> {
        (self.next != NIL).then_some(self.next)
    }
}

/// A `BlockPool`: the free, mapped blocks ordered by `BlockComparatorSize` (stream, size, ptr) and
/// the unmapped expandable blocks ordered by `BlockComparatorAddress` (stream, ptr).
#[derive(Clone, Debug)]
pub struct BlockPool {
    pub blocks: FreeSet,
    pub unmapped: BTreeMap<(u64, u64), BlockId>,
    pub is_small: bool,
    /// Index into `private_pools`, for a private pool's BlockPool.
    pub owner_private_pool: Option<u32>,
    /// The garbage-collection clock (`get_free_blocks_call_count`).
    pub get_free_blocks_call_count: i64,
}

impl BlockPool {
    fn new(is_small: bool, owner: Option<u32>) -> BlockPool {
        BlockPool { blocks: FreeSet::new(), unmapped: BTreeMap::new(), is_small, owner_private_pool: owner, get_free_blocks_call_count: 0 }
    }
}

/// A CUDA-graph or MemPool private pool (`PrivatePool`).
#[derive(Clone, Debug)]
pub struct PrivatePool {
    pub id: MempoolId,
    pub large: PoolIdx,
    pub small: PoolIdx,
    /// Live users (`use_count`): a MemPool object, each `beginAllocateToPool` not yet released,
    /// each CUDA graph captured into it. At 0 the pool is freeable (`graph_pools_freeable`).
    pub use_count: i64,
    /// Segments not yet freed (`cudaMalloc_count`).
    pub cuda_malloc_count: i64,
    /// Still in `graph_pools` (erased by `release_cached_blocks` once freeable with no segments).
    pub alive: bool,
}

/// Which streams a `captures_underway` entry routes to its pool (the `filter` of
/// `beginAllocateToPool`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolFilter {
    /// `use_mem_pool` / `_cuda_beginAllocateCurrentThreadToPool`: the calling thread, whatever the
    /// stream. The model has one thread.
    CurrentThread,
    /// A CUDA graph capture (or `_cuda_beginAllocateCurrentStreamToPool`): this stream only.
    Stream(u64),
}

/// One `ExpandableSegment`: a reservation of virtual addresses mapped page by page.
#[derive(Clone, Debug)]
pub struct ExpandableSegment {
    pub ptr: u64,
    pub segment_size: u64,
    pub max_handles: u64,
    pub stream: u64,
    pub mapped_size: u64,
}

impl ExpandableSegment {
    pub fn size(&self) -> u64 {
        self.max_handles * self.segment_size
    }
}

/// What the allocator did to device memory, in order (the segment entries of the trace), plus OOMs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    SegmentAlloc,
    SegmentFree,
    SegmentMap,
    SegmentUnmap,
    /// `addr` is `device_free`, `size` the rounded request.
    Oom,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    pub kind: EventKind,
    pub addr: u64,
    pub size: u64,
    pub stream: u64,
    pub pool: PoolIdx,
}

/// Everything PyTorch's OOM message reports, taken when the OOM is raised.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutOfMemory {
    pub orig_size: u64,
    pub rounded_size: u64,
    /// "Tried to allocate": the segment size the request needed.
    pub alloc_size: u64,
    pub stream: u64,
    pub is_small: bool,
    pub device_free: u64,
    pub device_total: u64,
    pub allowed_memory_maximum: Option<u64>,
    pub allocated_bytes: u64,
    pub reserved_bytes: u64,
    /// Free cached bytes in private pools.
    pub allocated_in_private_pools: u64,
    /// Refused before the driver was called (`throw_on_cudamalloc_oom`, 2.12+): no retry chain,
    /// counted in `num_oom_rejections`, not in `num_ooms`.
    pub preemptive: bool,
}

/// Why `alloc_block` could not get a new segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllocFailure {
    /// `total_allocated_memory + alloc_size > allowed_memory_maximum` (checked before any CUDA call).
    OverLimit { total_allocated: u64, alloc_size: u64, allowed: u64 },
    /// The device itself had no room (cudaMalloc or cuMemCreate out of memory).
    DeviceOutOfMemory { alloc_size: u64, device_free: u64 },
}

/// One step of `malloc`'s search, recorded when [`CachingAllocator::record_steps`] is on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MallocStep {
    /// `get_free_block` found no block (`found` = None) or the block it hands out.
    CacheLookup { found: Option<u64>, rounded: u64, stream: u64, pool: PoolIdx },
    /// `garbage_collect_cached_blocks` released these segments.
    GarbageCollection { segments: u32, bytes: u64 },
    /// `alloc_block`: a new segment (or pages) of this many bytes, or why not.
    AllocBlock { is_retry: bool, result: Result<u64, AllocFailure> },
    /// `release_available_cached_blocks` released these oversize segments; `enough` is its result.
    ReleaseAvailable { segments: u32, bytes: u64, enough: bool },
    /// `release_cached_blocks`: synchronize, then release every free segment (and free pages).
    ReleaseCached { segments: u32, bytes: u64, completed_frees: u32 },
}

/// Which pool a request is routed to (`get_pool`): the default pools or a private pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Route {
    #[default]
    Default,
    Private(MempoolId),
}

/// `AllocParams`.
struct AllocParams {
    size: u64,
    stream: u64,
    pool: PoolIdx,
    alloc_size: u64,
    is_expandable_segments_active: bool,
    block: BlockId,
}

/// The caching allocator of one device.
#[derive(Clone, Debug)]
pub struct CachingAllocator<D: Device> {
    pub config: AllocatorConfig,
    pub device: D,
    blocks: Vec<Block>,
    free_slots: Vec<BlockId>,
    pub pools: Vec<BlockPool>,
    pub private_pools: Vec<PrivatePool>,
    pub expandable_segments: Vec<Option<ExpandableSegment>>,
    /// Set by `set_per_process_memory_fraction` (the allowed maximum).
    pub allowed_memory_maximum: Option<u64>,
    /// Bytes from cudaMalloc plus bytes mapped in expandable segments.
    pub total_allocated_memory: u64,
    pub stats: DeviceStats,
    /// Blocks freed with outstanding events (with a token naming that free), in the order their
    /// events were recorded.
    pending_frees: Vec<(BlockId, u64)>,
    next_free_token: u64,
    /// Segment events and OOMs, in order; the caller drains it.
    pub events: Vec<Event>,
    /// `captures_underway`: (pool, filter) pairs from `beginAllocateToPool`, searched LIFO by
    /// `get_pool`.
    pub captures_underway: Vec<(MempoolId, PoolFilter)>,
    /// Mallocs in progress with an explicit [`Route::Private`] (a replay's inferred routing): they
    /// count as a capture underway, as the `beginAllocateToPool` that routed them would.
    routed_private: u32,
    /// The current malloc's `alloc_block` was refused by `throw_on_cudamalloc_oom` (2.12+).
    preemptively_rejected: bool,
    /// `graph_pools_freeable`, in `ska::flat_hash_map` order.
    pub graph_pools_freeable: MempoolIdSet,
    /// `use_on_oom_pools`.
    pub use_on_oom_pools: MempoolIdSet,
    /// `no_split_pools`.
    pub no_split_pools: MempoolIdSet,
    /// MemPools made with their own allocator (`MemPool(allocator)`): `raw_alloc`/`raw_delete`
    /// instead of cudaMalloc/cudaFree, and never expandable segments (`active_user_pool`).
    pub custom_allocator_pools: MempoolIdSet,
    /// Record each malloc's steps into `steps` (for explanations; off by default).
    pub record_steps: bool,
    pub steps: Vec<MallocStep>,
    /// The largest rounded request, block or segment size so far. While it stays below
    /// `max_split_size`, that setting changes nothing (no rule compares a size with it and
    /// finds it reached), so a replay under the same settings without it is identical.
    pub largest_size_seen: u64,
    /// The largest `total_allocated_memory` at a cache miss (where `garbage_collect_cached_blocks`
    /// would run). While it stays at or below a GC threshold's bytes, garbage collection with that
    /// threshold would return at once, so a replay without it is identical.
    pub peak_total_at_cache_miss: u64,
    /// When set, every comparison with the allowed maximum (in `alloc_block` and
    /// `garbage_collect_cached_blocks`) adds the value `v` at which its outcome flips: it goes the
    /// way a smaller maximum makes it go exactly when `allowed_memory_maximum < v`. A clone shares
    /// the list, so the trial mallocs a caller makes on clones are included. For inferring an
    /// unknown maximum from a trace: between two such values, every maximum decides alike.
    pub limit_probe: Option<LimitProbe>,
}

/// See [`CachingAllocator::limit_probe`].
pub type LimitProbe = std::sync::Arc<std::sync::Mutex<Vec<u64>>>;

/// The smallest allowed maximum `a` whose garbage-collection threshold
/// (`(size_t)(fraction * a)`) is at least `x`.
fn gc_flip(fraction: f64, x: u64) -> u64 {
    let thr = |a: u64| (fraction * a as f64) as u64;
    let mut a = (x as f64 / fraction) as u64;
    while a > 0 && thr(a - 1) >= x {
        a -= 1;
    }
    while thr(a) < x {
        a += 1;
    }
    a
}

impl<D: Device> CachingAllocator<D> {
    pub fn new(config: AllocatorConfig, device: D) -> Self {
        let stats = DeviceStats { max_split_size: if config.max_split_size == u64::MAX { -1 } else { config.max_split_size as i64 }, ..DeviceStats::default() };
        let mut a = CachingAllocator {
            config,
            device,
            blocks: Vec::new(),
            free_slots: Vec::new(),
            pools: vec![BlockPool::new(false, None), BlockPool::new(true, None)],
            private_pools: Vec::new(),
            expandable_segments: Vec::new(),
            allowed_memory_maximum: None,
            total_allocated_memory: 0,
            stats,
            pending_frees: Vec::new(),
            next_free_token: 0,
            events: Vec::new(),
            captures_underway: Vec::new(),
            routed_private: 0,
            preemptively_rejected: false,
            graph_pools_freeable: MempoolIdSet::default(),
            use_on_oom_pools: MempoolIdSet::default(),
            no_split_pools: MempoolIdSet::default(),
            custom_allocator_pools: MempoolIdSet::default(),
            record_steps: false,
            steps: Vec::new(),
            largest_size_seen: 0,
            peak_total_at_cache_miss: 0,
            limit_probe: None,
        };
        if let Some(f) = a.config.per_process_memory_fraction {
            a.set_memory_fraction(f);
        }
        a
    }

    /// `setMemoryFraction`: `allowed = (size_t)(fraction * totalGlobalMem)` when fraction < 1.
    pub fn set_memory_fraction(&mut self, fraction: f64) {
        self.allowed_memory_maximum = None;
        if fraction < 1.0 {
            let total = self.device.mem_get_info().1;
            self.allowed_memory_maximum = Some((fraction * total as f64) as u64);
        }
    }

    /// Sets the allowed maximum directly, in bytes.
    pub fn set_allowed_memory_maximum(&mut self, allowed: Option<u64>) {
        self.allowed_memory_maximum = allowed;
    }

    pub fn block(&self, id: BlockId) -> &Block {
        &self.blocks[id as usize]
    }

    /// All live blocks (arena slots in use).
    pub fn live_blocks(&self) -> impl Iterator<Item = (BlockId, &Block)> {
        let free: std::collections::HashSet<BlockId> = self.free_slots.iter().copied().collect();
        self.blocks.iter().enumerate().filter(move |(i, _)| !free.contains(&(*i as u32))).map(|(i, b)| (i as u32, b))
    }

    /// Keeps `largest_size_seen`. Every block is made by `new_block` (a merge never grows one past
    /// its segment, which was noted when made); `malloc` notes the rounded request.
    #[inline]
    fn note_size(&mut self, size: u64) {
        self.largest_size_seen = self.largest_size_seen.max(size);
    }

    fn new_block(&mut self, b: Block) -> BlockId {
        self.note_size(b.size);
        if let Some(id) = self.free_slots.pop() {
            self.blocks[id as usize] = b;
            id
        } else {
            self.blocks.push(b);
            (self.blocks.len() - 1) as BlockId
        }
    }

    fn delete_block(&mut self, id: BlockId) {
        self.blocks[id as usize].size = 0;
        self.free_slots.push(id);
    }

    /// A new free block of `size` bytes at `ptr` in `like`'s segment (same stream, pool and
    /// expandable segment), linked between `before` and `after`: PyTorch's `new Block(...)` followed
    /// by `Block::splice(before, after)`.
    fn new_block_between(&mut self, like: &Block, ptr: u64, size: u64, mapped: bool, before: BlockId, after: BlockId) -> BlockId {
        let id = self.new_block(Block {
            stream: like.stream,
            size,
            requested_size: 0,
            pool: like.pool,
            ptr,
            allocated: false,
            mapped,
            prev: before,
            next: after,
            event_count: 0,
            gc_count_base: 0,
            expandable_segment: like.expandable_segment,
        });
        if before != NIL {
            self.bm(before).next = id;
        }
        if after != NIL {
            self.bm(after).prev = id;
        }
        id
    }

    #[inline]
    fn b(&self, id: BlockId) -> &Block {
        &self.blocks[id as usize]
    }
    #[inline]
    fn bm(&mut self, id: BlockId) -> &mut Block {
        &mut self.blocks[id as usize]
    }

    fn size_key(&self, id: BlockId) -> (u64, u64, u64) {
        let b = self.b(id);
        (b.stream, b.size, b.ptr)
    }

    /// `BlockPool::insert_into_blocks`: resets the block's GC age.
    fn insert_into_blocks(&mut self, id: BlockId) {
        let key = self.size_key(id);
        let pool = self.b(id).pool;
        let clock = self.pools[pool as usize].get_free_blocks_call_count;
        self.bm(id).gc_count_base = clock;
        let added = self.pools[pool as usize].blocks.insert(key, id);
        debug_assert!(added);
    }

    fn erase_from_blocks(&mut self, id: BlockId) -> bool {
        let key = self.size_key(id);
        let pool = self.b(id).pool;
        self.pools[pool as usize].blocks.remove(key).is_some()
    }

    fn unmapped_insert(&mut self, id: BlockId) {
        let b = self.b(id);
        let (key, pool) = ((b.stream, b.ptr), b.pool);
        self.pools[pool as usize].unmapped.insert(key, id);
    }

    fn unmapped_erase(&mut self, id: BlockId) -> bool {
        let b = self.b(id);
        let (key, pool) = ((b.stream, b.ptr), b.pool);
        self.pools[pool as usize].unmapped.remove(&key).is_some()
    }

    fn is_small(&self, pool: PoolIdx) -> bool {
        self.pools[pool as usize].is_small
    }

    /// The live private pool `id` (index into `private_pools`), if `graph_pools` has it.
    pub fn find_private_pool(&self, id: MempoolId) -> Option<u32> {
        self.private_pools.iter().rposition(|p| p.alive && p.id == id).map(|i| i as u32)
    }

    /// Finds or creates the private pool `id` (a new one with `use_count` 1, as
    /// `create_or_incref_pool` makes it), without changing the use count of an existing one.
    pub fn private_pool(&mut self, id: MempoolId) -> u32 {
        if let Some(i) = self.find_private_pool(id) {
            return i;
        }
        let idx = self.private_pools.len() as u32;
        let large = self.pools.len() as PoolIdx;
        self.pools.push(BlockPool::new(false, Some(idx)));
        self.pools.push(BlockPool::new(true, Some(idx)));
        self.private_pools.push(PrivatePool { id, large, small: large + 1, use_count: 1, cuda_malloc_count: 0, alive: true });
        idx
    }

    /// `create_or_incref_pool`: a new pool with `use_count` 1, or one more user of a live one.
    pub fn create_or_incref_pool(&mut self, id: MempoolId) {
        match self.find_private_pool(id) {
            Some(i) => self.private_pools[i as usize].use_count += 1,
            None => {
                self.private_pool(id);
            }
        }
    }

    /// `releasePool`: one user fewer; at 0 the pool enters `graph_pools_freeable`, and the next
    /// `release_cached_blocks` frees its free segments (and erases it once it has none).
    pub fn release_pool(&mut self, id: MempoolId) {
        let i = self.private_pool(id) as usize;
        let pp = &mut self.private_pools[i];
        pp.use_count -= 1;
        if pp.use_count <= 0 {
            pp.use_count = 0;
            self.graph_pools_freeable.insert(id);
        }
    }

    /// Drops every user of pool `id` at once (`releasePool` until `use_count` is 0): for a replay
    /// that sees a pool's segments released without seeing its users go.
    pub fn release_pool_fully(&mut self, id: MempoolId) {
        let i = self.private_pool(id) as usize;
        self.private_pools[i].use_count = 1;
        self.release_pool(id);
    }

    /// `beginAllocateToPool(id, filter)`: creates or increfs the pool and routes the matching
    /// streams' allocations to it until `endAllocateToPool`.
    pub fn begin_allocate_to_pool(&mut self, id: MempoolId, filter: PoolFilter) {
        self.create_or_incref_pool(id);
        self.captures_underway.push((id, filter));
    }

    /// `endAllocateToPool(id)`: stops routing to the pool (its use count is left to `releasePool`).
    pub fn end_allocate_to_pool(&mut self, id: MempoolId) {
        if let Some(k) = self.captures_underway.iter().position(|c| c.0 == id) {
            self.captures_underway.remove(k);
        }
    }

    /// `setUseOnOOM(id, use_on_oom)`.
    pub fn set_use_on_oom(&mut self, id: MempoolId, use_on_oom: bool) {
        if use_on_oom {
            self.use_on_oom_pools.insert(id);
        } else {
            self.use_on_oom_pools.remove(id);
        }
    }

    /// `setNoSplit(id)`.
    pub fn set_no_split(&mut self, id: MempoolId) {
        self.no_split_pools.insert(id);
    }

    /// The MemPool `id` has its own allocator (`MemPool(allocator)`; the model calls the device
    /// as that allocator's `raw_alloc` would call cudaMalloc): its requests never use expandable
    /// segments.
    pub fn set_custom_allocator(&mut self, id: MempoolId) {
        self.custom_allocator_pools.insert(id);
    }

    /// `is_expandable_segments_active` for requests to `pool`: expandable segments are on and the
    /// pool has no allocator of its own (`active_user_pool`).
    fn expandable_segments_active(&self, pool: PoolIdx) -> bool {
        self.config.expandable_segments
            && (self.custom_allocator_pools.is_empty()
                || !self.pools[pool as usize].owner_private_pool.is_some_and(|pp| self.custom_allocator_pools.contains(self.private_pools[pp as usize].id)))
    }

    /// `torch.cuda.MemPool(use_on_oom, no_split)`: the constructor's `createOrIncrefPool`,
    /// `setUseOnOOM`, `setNoSplit`.
    pub fn mem_pool_new(&mut self, id: MempoolId, use_on_oom: bool, no_split: bool) {
        self.create_or_incref_pool(id);
        if use_on_oom {
            self.set_use_on_oom(id, true);
        }
        if no_split {
            self.set_no_split(id);
        }
    }

    /// `MemPool::~MemPool`: `setUseOnOOM(id, false)`, `releasePool(id)`, `emptyCache(id)`.
    pub fn mem_pool_drop(&mut self, id: MempoolId) {
        self.set_use_on_oom(id, false);
        self.release_pool(id);
        self.release_cached_blocks_of(Some(id));
    }

    /// Whether any allocation routing is active (`!captures_underway.empty()`).
    fn capture_underway(&self) -> bool {
        !self.captures_underway.is_empty() || self.routed_private > 0
    }

    /// `get_pool(size, stream)`: an explicit route, else the last `captures_underway` entry whose
    /// filter takes `stream`, else the default pools.
    fn get_pool(&mut self, size: u64, stream: u64, route: Route) -> PoolIdx {
        if let Route::Private(id) = route {
            self.private_pool(id);
        }
        self.pool_of(size, stream, route).expect("the private pool exists")
    }

    /// The pool `get_pool` picks, without making a private pool that does not exist yet (`None`).
    fn pool_of(&self, size: u64, stream: u64, route: Route) -> Option<PoolIdx> {
        let id = match route {
            Route::Private(id) => Some(id),
            Route::Default => self
                .captures_underway
                .iter()
                .rev()
                .find(|(_, f)| match f {
                    PoolFilter::CurrentThread => true,
                    PoolFilter::Stream(s) => *s == stream,
                })
                .map(|c| c.0),
        };
        match id {
            None => Some(if size <= K_SMALL_SIZE { SMALL_POOL } else { LARGE_POOL }),
            Some(id) => {
                let pp = &self.private_pools[self.find_private_pool(id)? as usize];
                Some(if size <= K_SMALL_SIZE { pp.small } else { pp.large })
            }
        }
    }

    /// The value at which `alloc_block`'s fraction check for `malloc(orig_size)` would flip were
    /// it made now ([`Self::limit_probe`]): the malloc's first comparison with the allowed maximum
    /// when it misses the cache ([`Self::finds_cached_block`]) and no garbage collection (whose
    /// comparisons come first) runs. Changes nothing.
    pub fn fraction_check_flip(&self, orig_size: u64) -> u64 {
        self.limit_flip(self.config.get_allocation_size(self.config.round_size(orig_size)))
    }

    /// `alloc_block`'s fraction check, `total_allocated_memory + alloc_size > allowed`, fails
    /// exactly when the allowed maximum is below this.
    fn limit_flip(&self, alloc_size: u64) -> u64 {
        self.total_allocated_memory + alloc_size
    }

    /// Whether `malloc(orig_size, stream)` would be served from the cache (`get_free_block` finds
    /// a block), so that it makes no device call and no comparison with the allowed maximum.
    /// Changes nothing.
    pub fn finds_cached_block(&self, orig_size: u64, stream: u64, route: Route) -> bool {
        let size = self.config.round_size(orig_size);
        let Some(pool) = self.pool_of(size, stream, route) else { return false };
        let p = AllocParams {
            size,
            stream,
            pool,
            alloc_size: self.config.get_allocation_size(size),
            is_expandable_segments_active: self.expandable_segments_active(pool),
            block: NIL,
        };
        self.find_free_block(&p).is_some()
    }

    /// Notes a comparison with the allowed maximum for [`Self::limit_probe`].
    fn note_limit(&self, flips_below: u64) {
        if let Some(probe) = &self.limit_probe {
            probe.lock().expect("limit probe").push(flips_below);
        }
    }

    /// `malloc(orig_size, stream)`: returns the allocated block, or the OOM PyTorch would raise.
    /// Cross-stream frees must have been completed by the caller (`process_events`).
    pub fn malloc(&mut self, orig_size: u64, stream: u64, route: Route) -> Result<BlockId, OutOfMemory> {
        let size = self.config.round_size(orig_size);
        self.note_size(size);
        let pool = self.get_pool(size, stream, route);
        let alloc_size = self.config.get_allocation_size(size);
        let mut p = AllocParams { size, stream, pool, alloc_size, is_expandable_segments_active: self.expandable_segments_active(pool), block: NIL };
        let routed = matches!(route, Route::Private(_));
        if routed {
            self.routed_private += 1;
        }
        // trigger_free_memory_callbacks() frees nothing in a model, so the second lookup never runs.
        let mut found = self.get_free_block(&mut p);
        if self.record_steps {
            let found_size = found.then(|| self.b(p.block).size);
            self.steps.push(MallocStep::CacheLookup { found: found_size, rounded: size, stream, pool });
        }
        if !found {
            self.peak_total_at_cache_miss = self.peak_total_at_cache_miss.max(self.total_allocated_memory);
            if self.allowed_memory_maximum.is_some() && self.config.garbage_collection_threshold > 0.0 {
                let e0 = self.events.len();
                self.garbage_collect_cached_blocks();
                if self.record_steps {
                    let (segments, bytes) = self.released_since(e0);
                    self.steps.push(MallocStep::GarbageCollection { segments, bytes });
                }
            }
            // alloc_block || try_mempool_fallback
            //   || (release_available_cached_blocks && alloc_block)
            //   || (no capture underway && release_cached_blocks && alloc_block(isRetry))
            found = self.alloc_block(&mut p, false);
            if !found && self.preemptively_rejected {
                self.preemptively_rejected = false;
                if routed {
                    self.routed_private -= 1;
                }
                return Err(self.preemptive_rejection(orig_size, size, alloc_size, stream, pool));
            }
            if !found {
                found = self.try_mempool_fallback(&mut p);
            }
            if !found {
                let e0 = self.events.len();
                let enough = self.release_available_cached_blocks(&p);
                if self.record_steps && self.config.max_split_size != u64::MAX {
                    let (segments, bytes) = self.released_since(e0);
                    self.steps.push(MallocStep::ReleaseAvailable { segments, bytes, enough });
                }
                found = enough && self.alloc_block(&mut p, false);
            }
            if !found && !self.capture_underway() {
                let e0 = self.events.len();
                let pending = self.pending_frees.len() as u32;
                self.release_cached_blocks();
                if self.record_steps {
                    let (segments, bytes) = self.released_since(e0);
                    self.steps.push(MallocStep::ReleaseCached { segments, bytes, completed_frees: pending });
                }
                found = self.alloc_block(&mut p, true);
            }
        }
        if routed {
            self.routed_private -= 1;
        }
        if !found {
            let (device_free, device_total) = self.device.mem_get_info();
            self.events.push(Event { kind: EventKind::Oom, addr: device_free, size, stream, pool });
            self.stats.num_ooms += 1;
            let allocated_in_private_pools = self
                .private_pools
                .iter()
                .filter(|pp| pp.alive)
                .flat_map(|pp| [pp.large, pp.small])
                .map(|pi| self.pools[pi as usize].blocks.values().map(|id| self.b(id).size).sum::<u64>())
                .sum();
            return Err(OutOfMemory {
                orig_size,
                rounded_size: size,
                alloc_size,
                stream,
                is_small: self.is_small(pool),
                device_free,
                device_total,
                allowed_memory_maximum: self.allowed_memory_maximum,
                allocated_bytes: self.stats.allocated_bytes.all().current as u64,
                reserved_bytes: self.stats.reserved_bytes.all().current as u64,
                allocated_in_private_pools,
                preemptive: false,
            });
        }
        let split_remainder = self.should_split(p.block, p.size, p.is_expandable_segments_active);
        Ok(self.alloc_found_block(&p, orig_size, split_remainder))
    }

    /// `throw_on_cudamalloc_oom`'s refusal (2.12+): `num_oom_rejections` counts it; no `oom`
    /// trace entry, no `num_ooms` (the OOM-rejection observers are told instead). What the 2.12
    /// wheel shows of it: the texts "Preemptively rejecting allocation: requested …" and "CUDA out
    /// of memory. Allocation was preemptively rejected because it would exceed
    /// per_process_memory_fraction limit. Requested size: …", the `num_oom_rejections` stat and
    /// `OomRejectionObserver`; its code was not read.
    fn preemptive_rejection(&mut self, orig_size: u64, size: u64, alloc_size: u64, stream: u64, pool: PoolIdx) -> OutOfMemory {
        self.stats.num_oom_rejections += 1;
        let (device_free, device_total) = self.device.mem_get_info();
        OutOfMemory {
            orig_size,
            rounded_size: size,
            alloc_size,
            stream,
            is_small: self.is_small(pool),
            device_free,
            device_total,
            allowed_memory_maximum: self.allowed_memory_maximum,
            allocated_bytes: self.stats.allocated_bytes.all().current as u64,
            reserved_bytes: self.stats.reserved_bytes.all().current as u64,
            allocated_in_private_pools: 0,
            preemptive: true,
        }
    }

    /// `try_mempool_fallback` (2.11: right after the first `alloc_block` fails): unless the request
    /// already goes to a private pool, look for a cached block in each `use_on_oom` pool (in
    /// `use_on_oom_pools` order) as if routed there (`beginAllocateToPool` … `releasePool`), with
    /// expandable segments inactive; the first hit serves the request from that pool.
    fn try_mempool_fallback(&mut self, p: &mut AllocParams) -> bool {
        if self.pools[p.pool as usize].owner_private_pool.is_some() {
            return false;
        }
        for id in self.use_on_oom_pools.keys() {
            let Some(i) = self.find_private_pool(id) else { continue };
            let pp = &self.private_pools[i as usize];
            let pool = if p.size <= K_SMALL_SIZE { pp.small } else { pp.large };
            let mut mp = AllocParams { size: p.size, stream: p.stream, pool, alloc_size: p.alloc_size, is_expandable_segments_active: false, block: NIL };
            if self.get_free_block(&mut mp) {
                *p = mp;
                return true;
            }
        }
        false
    }

    /// One step of `setSegmentStateToCheckpoint` (`_cuda_setCheckpointPoolState`, which
    /// CUDA-graph trees call before recording from a checkpoint): the free block that starts at
    /// `ptr` is taken out of its pool and allocated with `size` bytes, split if it is larger
    /// (`alloc_found_block(params, size, ctx, curr_block->size > size)`). The trace records it as
    /// an `alloc` of `size` at `ptr`. `None` if no free block starts there or it is too small.
    pub fn alloc_checkpointed_block(&mut self, ptr: u64, size: u64) -> Option<BlockId> {
        let id = self.pools.iter().find_map(|pool| pool.blocks.values().find(|&b| self.b(b).ptr == ptr))?;
        let b = self.b(id);
        if b.size < size {
            return None;
        }
        let p =
            AllocParams { size, stream: b.stream, pool: b.pool, alloc_size: size, is_expandable_segments_active: b.expandable_segment.is_some(), block: id };
        let split = b.size > size;
        self.erase_from_blocks(id);
        Some(self.alloc_found_block(&p, size, split))
    }

    /// `get_free_block`: best fit on (stream, size, address), looking at the first candidate only.
    fn get_free_block(&mut self, p: &mut AllocParams) -> bool {
        let gc_clock = self.allowed_memory_maximum.is_some() && self.config.garbage_collection_threshold > 0.0;
        if gc_clock {
            self.pools[p.pool as usize].get_free_blocks_call_count += 1;
        }
        match self.find_free_block(p) {
            Some(it) => {
                p.block = it;
                self.erase_from_blocks(it);
                true
            }
            None => false,
        }
    }

    /// The block `get_free_block` hands out, if any (the search alone, changing nothing).
    fn find_free_block(&self, p: &AllocParams) -> Option<BlockId> {
        let pool = &self.pools[p.pool as usize];
        let mut range = pool.blocks.range_from(p.stream, p.size, 0);
        let (_, _, first) = range.next()?;
        let mut it = first;
        if self.b(it).expandable_segment.is_some() {
            if p.is_expandable_segments_active {
                let expandable_size = |id: BlockId| {
                    let b = self.b(id);
                    b.size + b.next().filter(|&n| !self.b(n).mapped).map_or(0, |n| self.b(n).size)
                };
                for (_, _, next) in range {
                    if self.b(it).expandable_segment.is_some() && expandable_size(next) < expandable_size(it) {
                        it = next;
                    } else {
                        break;
                    }
                }
            } else {
                let mut found = None;
                for (_, _, next) in range {
                    if self.b(next).expandable_segment.is_none() {
                        found = Some(next);
                        break;
                    }
                }
                it = found?;
            }
        }
        let max_split = self.config.max_split_size;
        let bsize = self.b(it).size;
        // Do not return an oversized block for a large request
        if p.size < max_split && bsize >= max_split {
            return None;
        }
        // Allow oversized block size to be rounded up but within a limit
        if p.size >= max_split && bsize >= p.size.saturating_add(self.config.max_non_split_rounding_size) {
            return None;
        }
        Some(it)
    }

    /// `should_split`.
    fn should_split(&self, block: BlockId, size: u64, is_expandable_segments_active: bool) -> bool {
        let b = self.b(block);
        // A pool made with no_split never splits a segment.
        if !self.no_split_pools.is_empty()
            && let Some(pp) = self.pools[b.pool as usize].owner_private_pool
            && self.no_split_pools.contains(self.private_pools[pp as usize].id)
        {
            return false;
        }
        splits_block(&self.config, b.size, size, self.is_small(b.pool), is_expandable_segments_active)
    }

    /// `alloc_found_block`: the allocated part takes the low address; the old Block object keeps the
    /// remainder and goes back to the pool.
    fn alloc_found_block(&mut self, p: &AllocParams, orig_size: u64, split_remainder: bool) -> BlockId {
        let size = p.size;
        let mut block = p.block;
        let small = self.is_small(p.pool);
        let already_split = self.b(block).is_split();
        if split_remainder {
            let remaining = block;
            let r = self.b(remaining).clone();
            block = self.new_block_between(&r, r.ptr, size, true, r.prev, remaining);
            {
                let rm = self.bm(remaining);
                rm.ptr += size;
                rm.size -= size;
            }
            self.insert_into_blocks(remaining);
            if r.expandable_segment.is_none() {
                if already_split {
                    // An already-split inactive block is being shrunk by size bytes.
                    self.stats.inactive_split_bytes.decrease(small, size);
                } else {
                    // A new split inactive block is being created from a previously unsplit block.
                    let rs = self.b(remaining).size;
                    self.stats.inactive_split_bytes.increase(small, rs);
                    self.stats.inactive_split.increase(small, 1);
                }
            }
        } else if already_split && self.b(block).expandable_segment.is_none() {
            // An already-split block is becoming active
            let bs = self.b(block).size;
            self.stats.inactive_split_bytes.decrease(small, bs);
            self.stats.inactive_split.decrease(small, 1);
        }
        let bs = {
            let b = self.bm(block);
            b.allocated = true;
            b.requested_size = orig_size;
            b.size
        };
        let st = &mut self.stats;
        st.allocation.increase(small, 1);
        st.allocated_bytes.increase(small, bs);
        st.active.increase(small, 1);
        st.active_bytes.increase(small, bs);
        st.requested_bytes.increase(small, orig_size);
        if bs >= self.config.max_split_size {
            st.oversize_allocations.increase(1);
        }
        block
    }

    /// `free(block)`: the request side of a free. With `pending_events` the block was used on other
    /// streams (`record_stream`): it stays active until [`Self::complete_free`] with the returned
    /// token, or a synchronize.
    pub fn free(&mut self, block: BlockId, pending_events: bool) -> Option<u64> {
        let small = self.is_small(self.b(block).pool);
        let size = self.b(block).size;
        self.bm(block).allocated = false;
        self.stats.allocation.decrease(small, 1);
        self.stats.allocated_bytes.decrease(small, size);
        if size >= self.config.max_split_size {
            self.stats.oversize_allocations.decrease(1);
        }
        if pending_events {
            self.bm(block).event_count = 1;
            self.next_free_token += 1;
            self.pending_frees.push((block, self.next_free_token));
            Some(self.next_free_token)
        } else {
            self.free_block(block);
            None
        }
    }

    /// The cross-stream events of the free named by `token` completed (`process_events`): the block
    /// returns to its pool. Returns false if a synchronize had already completed it.
    pub fn complete_free(&mut self, token: u64) -> bool {
        let Some(i) = self.pending_frees.iter().position(|&(_, t)| t == token) else { return false };
        let (block, _) = self.pending_frees.remove(i);
        self.bm(block).event_count = 0;
        self.free_block(block);
        true
    }

    /// Frees whose cross-stream events are outstanding.
    pub fn pending_free_count(&self) -> usize {
        self.pending_frees.len()
    }

    /// `free_block`: merge with free neighbours and return to the pool.
    fn free_block(&mut self, block: BlockId) {
        let original_block_size = self.b(block).size;
        let requested_size = self.b(block).requested_size;
        let pool = self.b(block).pool;
        let small = self.is_small(pool);
        let mut net_blocks: i64 = 0;
        let mut net_size: i64 = 0;
        let candidates = [self.b(block).prev, self.b(block).next];
        for c in candidates {
            let subsumed = self.try_merge_blocks(block, c);
            if subsumed > 0 {
                net_blocks -= 1;
                net_size -= subsumed as i64;
            }
        }
        self.insert_into_blocks(block);
        if self.b(block).is_split() {
            net_blocks += 1;
            net_size += self.b(block).size as i64;
        }
        let st = &mut self.stats;
        if self.blocks[block as usize].expandable_segment.is_none() {
            if net_blocks > 0 {
                st.inactive_split.increase(small, net_blocks as u64);
            } else if net_blocks < 0 {
                st.inactive_split.decrease(small, (-net_blocks) as u64);
            }
            if net_size > 0 {
                st.inactive_split_bytes.increase(small, net_size as u64);
            } else if net_size < 0 {
                st.inactive_split_bytes.decrease(small, (-net_size) as u64);
            }
        }
        st.active.decrease(small, 1);
        st.active_bytes.decrease(small, original_block_size);
        st.requested_bytes.decrease(small, requested_size);
    }

    /// `try_merge_blocks(dst, src)`: returns the size of the subsumed block, or 0.
    fn try_merge_blocks(&mut self, dst: BlockId, src: BlockId) -> u64 {
        if src == NIL {
            return 0;
        }
        let s = self.b(src);
        if s.allocated || s.event_count > 0 || self.b(dst).mapped != s.mapped {
            return 0;
        }
        let s = s.clone();
        if self.b(dst).prev == src {
            // [src dst]
            let d = self.bm(dst);
            d.ptr = s.ptr;
            d.prev = s.prev;
            if s.prev != NIL {
                self.bm(s.prev).next = dst;
            }
        } else {
            // [dst src]
            self.bm(dst).next = s.next;
            if s.next != NIL {
                self.bm(s.next).prev = dst;
            }
        }
        // Erase src from its set before dst's size changes (keys use the old values).
        if s.mapped {
            let removed = self.pools[s.pool as usize].blocks.remove((s.stream, s.size, s.ptr));
            debug_assert!(removed.is_some());
        } else {
            self.pools[s.pool as usize].unmapped.remove(&(s.stream, s.ptr));
        }
        self.bm(dst).size += s.size;
        self.delete_block(src);
        s.size
    }

    /// `alloc_block`: a new segment from the device (or new pages of an expandable segment).
    fn alloc_block(&mut self, p: &mut AllocParams, is_retry: bool) -> bool {
        let size = p.alloc_size;
        if is_retry {
            self.stats.num_alloc_retries += 1;
        }
        if self.allowed_memory_maximum.is_some() {
            self.note_limit(self.limit_flip(size));
        }
        if let Some(allowed) = self.allowed_memory_maximum
            && allowed < self.limit_flip(size)
        {
            // 2.12+ `throw_on_cudamalloc_oom`: the request is refused here, before the
            // driver, and malloc's retry chain does not run (PR #179473's description and
            // the 2.12 wheel's strings; not measured).
            if self.config.throw_on_cudamalloc_oom {
                self.preemptively_rejected = true;
            }
            if self.record_steps {
                let result = Err(AllocFailure::OverLimit { total_allocated: self.total_allocated_memory, alloc_size: size, allowed });
                self.steps.push(MallocStep::AllocBlock { is_retry, result });
            }
            return false;
        }
        let ok = self.alloc_block_inner(p);
        if self.record_steps {
            let result = if ok { Ok(size) } else { Err(AllocFailure::DeviceOutOfMemory { alloc_size: size, device_free: self.device.mem_get_info().0 }) };
            self.steps.push(MallocStep::AllocBlock { is_retry, result });
        }
        ok
    }

    /// Segments and bytes released (cudaFree'd or unmapped) since event index `e0`.
    fn released_since(&self, e0: usize) -> (u32, u64) {
        self.events[e0..].iter().filter(|e| matches!(e.kind, EventKind::SegmentFree | EventKind::SegmentUnmap)).fold((0, 0), |(n, b), e| (n + 1, b + e.size))
    }

    /// `alloc_block` past the fraction check: the expandable path or cudaMalloc.
    fn alloc_block_inner(&mut self, p: &mut AllocParams) -> bool {
        let size = p.alloc_size;
        if p.is_expandable_segments_active {
            match self.try_allocate_expandable_block(p.stream, p.pool, p.size) {
                Some(b) => {
                    p.block = b;
                    if let Some(pp) = self.pools[p.pool as usize].owner_private_pool {
                        self.private_pools[pp as usize].cuda_malloc_count += 1;
                    }
                    true
                }
                None => false,
            }
        } else {
            let Some(ptr) = self.device.malloc(size) else { return false };
            if let Some(pp) = self.pools[p.pool as usize].owner_private_pool {
                self.private_pools[pp as usize].cuda_malloc_count += 1;
            }
            self.total_allocated_memory += size;
            p.block = self.new_block(Block {
                stream: p.stream,
                size,
                requested_size: 0,
                pool: p.pool,
                ptr,
                allocated: false,
                mapped: true,
                prev: NIL,
                next: NIL,
                event_count: 0,
                gc_count_base: 0,
                expandable_segment: None,
            });
            let small = self.is_small(p.pool);
            self.stats.segment.increase(small, 1);
            self.stats.reserved_bytes.increase(small, size);
            if size >= self.config.max_split_size {
                self.stats.oversize_segments.increase(1);
            }
            self.stats.num_device_alloc += 1;
            self.events.push(Event { kind: EventKind::SegmentAlloc, addr: ptr, size, stream: p.stream, pool: p.pool });
            true
        }
    }

    /// `release_available_cached_blocks`: free oversize cached blocks (only with `max_split_size`).
    fn release_available_cached_blocks(&mut self, p: &AllocParams) -> bool {
        let max_split = self.config.max_split_size;
        if max_split == u64::MAX {
            return false;
        }
        let key_size = p.size.max(max_split);
        let pool = &self.pools[p.pool as usize];
        let hit = pool.blocks.range_from(p.stream, key_size, 0).next();
        // An oversize free block is a whole segment in any state PyTorch reaches under these
        // settings (requests below `max_split_size` never take one, and oversize blocks are never
        // split). A state restored from a trace recorded under other settings can hold a split
        // segment with an oversize free piece: it cannot be cudaFree'd alone, so it is passed
        // over like an expandable block (`release_block` would cut it out of its segment).
        let releasable = |s: &Self, id: BlockId| s.b(id).expandable_segment.is_none() && !s.b(id).is_split();
        match hit {
            Some((_, _, id)) if releasable(self, id) => {
                self.release_block(id);
                true
            }
            _ => {
                // No single block is large enough; free multiple oversize blocks, largest first.
                // (PyTorch returns false at once when no block precedes the key in the whole
                // pool; the walk below stops at the stream's first block, so looking only at
                // this stream's blocks gives the same answer.)
                let candidates: Vec<(u64, BlockId)> = pool.blocks.range_below(p.stream, key_size, 0).map(|(size, _, id)| (size, id)).collect();
                if candidates.is_empty() {
                    return false;
                }
                let mut total_released = 0u64;
                for (size, id) in candidates {
                    if !(total_released < key_size && size >= max_split) {
                        break;
                    }
                    if releasable(self, id) {
                        total_released += size;
                        self.release_block(id);
                    }
                }
                total_released >= key_size
            }
        }
    }

    /// `release_cached_blocks(mempool_id = {0,0})` (also `empty_cache()`): with no capture
    /// underway, synchronize, then free every completely free segment (and unmap free expandable
    /// pages) of the default pools, large first; then those of every freeable private pool.
    pub fn release_cached_blocks(&mut self) -> bool {
        self.release_cached_blocks_of(None)
    }

    /// `release_cached_blocks(context, mempool_id)`. `None` is the default id `{0,0}`. With a
    /// private pool's id (the MemPool destructor's `emptyCache(id)`), only that pool, if freeable:
    /// its own events synchronized, its segments freed. The freeable pools are visited in
    /// `graph_pools_freeable` order, small pool before large; a pool left with no segments is
    /// erased from `graph_pools`.
    pub fn release_cached_blocks_of(&mut self, mempool_id: Option<MempoolId>) -> bool {
        if mempool_id.is_none() && !self.capture_underway() {
            self.synchronize_and_free_events();
            self.release_blocks(LARGE_POOL);
            self.release_blocks(SMALL_POOL);
        }
        let mut freeable = std::mem::take(&mut self.graph_pools_freeable);
        freeable.visit_erasing(|id| {
            if let Some(only) = mempool_id {
                if id != only {
                    return false;
                }
                self.synchronize_and_free_events_of(Some(id));
            }
            let Some(i) = self.find_private_pool(id) else { return true };
            let (small, large) = (self.private_pools[i as usize].small, self.private_pools[i as usize].large);
            self.release_blocks(small);
            self.release_blocks(large);
            if self.private_pools[i as usize].cuda_malloc_count == 0 {
                self.private_pools[i as usize].alive = false;
                return true;
            }
            false
        });
        self.graph_pools_freeable = freeable;
        true
    }

    /// `empty_cache()` (`emptyCache({0,0})`).
    pub fn empty_cache(&mut self) {
        self.release_cached_blocks();
    }

    /// `synchronize_and_free_events`: every outstanding cross-stream free completes.
    pub fn synchronize_and_free_events(&mut self) {
        self.synchronize_and_free_events_of(None);
    }

    /// `synchronize_and_free_events(context, pool)`: with a pool, only the events of that private
    /// pool's blocks.
    fn synchronize_and_free_events_of(&mut self, pool: Option<MempoolId>) {
        self.stats.num_sync_all_streams += 1;
        let owner = pool.and_then(|id| self.find_private_pool(id));
        let pending = std::mem::take(&mut self.pending_frees);
        for (b, t) in pending {
            if pool.is_some() && (owner.is_none() || self.pools[self.b(b).pool as usize].owner_private_pool != owner) {
                self.pending_frees.push((b, t));
                continue;
            }
            self.bm(b).event_count = 0;
            self.free_block(b);
        }
    }

    /// `release_blocks(pool)`.
    fn release_blocks(&mut self, pool: PoolIdx) {
        let all: Vec<BlockId> = self.pools[pool as usize].blocks.values().collect();
        let mut to_unmap = Vec::new();
        for id in all {
            let b = self.b(id);
            if b.expandable_segment.is_some() {
                to_unmap.push(id);
            } else if b.prev == NIL && b.next == NIL {
                self.release_block(id);
            }
        }
        for id in to_unmap {
            self.unmap_block(id);
            let b = self.b(id);
            if b.prev == NIL && b.next == NIL {
                self.release_expandable_segment(id);
            }
        }
    }

    /// `release_block`: cudaFree a whole free segment.
    fn release_block(&mut self, id: BlockId) {
        debug_assert!(!self.b(id).is_split(), "release_block of a piece of a segment");
        let b = self.b(id).clone();
        self.stats.num_device_free += 1;
        self.events.push(Event { kind: EventKind::SegmentFree, addr: b.ptr, size: b.size, stream: b.stream, pool: b.pool });
        self.device.free(b.ptr, b.size);
        self.total_allocated_memory -= b.size;
        if let Some(pp) = self.pools[b.pool as usize].owner_private_pool {
            self.private_pools[pp as usize].cuda_malloc_count -= 1;
        }
        let small = self.is_small(b.pool);
        self.stats.segment.decrease(small, 1);
        self.stats.reserved_bytes.decrease(small, b.size);
        if b.size >= self.config.max_split_size {
            self.stats.oversize_segments.decrease(1);
        }
        self.erase_from_blocks(id);
        self.delete_block(id);
    }

    /// `garbage_collect_cached_blocks`: free old unsplit large blocks until below the threshold.
    fn garbage_collect_cached_blocks(&mut self) {
        let allowed = self.allowed_memory_maximum.expect("GC runs only with a memory fraction");
        let fraction = self.config.garbage_collection_threshold;
        let gc_threshold = (fraction * allowed as f64) as u64;
        if self.limit_probe.is_some() {
            self.note_limit(gc_flip(fraction, self.total_allocated_memory));
        }
        if self.total_allocated_memory <= gc_threshold {
            return;
        }
        let target_size = self.total_allocated_memory - gc_threshold;
        let mut gc_reclaimed = 0u64;
        let clock = self.pools[LARGE_POOL as usize].get_free_blocks_call_count;
        let gc_count = |b: &Block| (clock - b.gc_count_base) as i32 as i64 as u64;
        let mut total_age: u64 = 0;
        let mut freeable_block_count: i64 = 0;
        for id in self.pools[LARGE_POOL as usize].blocks.values() {
            let b = self.b(id);
            if !b.is_split() {
                total_age = total_age.wrapping_add(gc_count(b));
                freeable_block_count += 1;
            }
        }
        if freeable_block_count == 0 {
            return;
        }
        let total_at_start = self.total_allocated_memory;
        let mut block_freed = true;
        loop {
            if self.limit_probe.is_some() {
                // gc_reclaimed < target_size, that is: threshold < total at start − gc_reclaimed
                self.note_limit(gc_flip(fraction, total_at_start - gc_reclaimed));
            }
            if !(gc_reclaimed < target_size && block_freed && freeable_block_count > 0) {
                break;
            }
            let age_threshold = total_age as f64 / freeable_block_count as f64;
            block_freed = false;
            let all: Vec<BlockId> = self.pools[LARGE_POOL as usize].blocks.values().collect();
            for id in all {
                let b = self.b(id);
                if !b.is_split() && b.expandable_segment.is_none() && gc_count(b) as f64 >= age_threshold {
                    block_freed = true;
                    gc_reclaimed += b.size;
                    total_age = total_age.wrapping_sub(gc_count(b));
                    freeable_block_count -= 1;
                    self.release_block(id);
                }
            }
        }
    }

    // ----- expandable segments -----

    /// `find_expandable_block`: the lowest address (of this stream's segments) where free and
    /// unmapped blocks together cover `size`; else a new expandable segment.
    fn find_expandable_block(&mut self, stream: u64, pool: PoolIdx, size: u64) -> BlockId {
        let allocatable = |s: &Self, id: BlockId| id != NIL && !s.b(id).allocated && s.b(id).event_count == 0;
        let candidates: Vec<BlockId> = self.pools[pool as usize].unmapped.range((stream, 0)..).take_while(|(k, _)| k.0 == stream).map(|(_, &id)| id).collect();
        for mut c in candidates {
            let prev = self.b(c).prev;
            if allocatable(self, prev) {
                c = prev;
            }
            let mut bytes = 0u64;
            let mut b = c;
            while bytes < size && allocatable(self, b) {
                bytes += self.b(b).size;
                b = self.b(b).next;
            }
            if bytes >= size {
                return c;
            }
        }
        let segment_size = if self.is_small(pool) { K_SMALL_BUFFER } else { self.config.large_segment_size };
        let total = self.device.mem_get_info().1;
        let max_handles = self.config.expandable_reservation_pages(total, segment_size);
        let ptr = self.device.reserve(max_handles * segment_size);
        let es = self.expandable_segments.len() as u32;
        self.expandable_segments.push(Some(ExpandableSegment { ptr, segment_size, max_handles, stream, mapped_size: 0 }));
        let id = self.new_block(Block {
            stream,
            size: max_handles * segment_size,
            requested_size: 0,
            pool,
            ptr,
            allocated: false,
            mapped: false,
            prev: NIL,
            next: NIL,
            event_count: 0,
            gc_count_base: 0,
            expandable_segment: Some(es),
        });
        self.unmapped_insert(id);
        id
    }

    /// `map_block`: map whole pages covering `[ptr, ptr + size)` of an unmapped block.
    fn map_block(&mut self, to_map: BlockId, size: u64) -> bool {
        let b = self.b(to_map).clone();
        let es_idx = b.expandable_segment.expect("map_block on an expandable block") as usize;
        let (base, seg) = {
            let es = self.expandable_segments[es_idx].as_ref().unwrap();
            (es.ptr, es.segment_size)
        };
        let begin = (b.ptr - base) / seg;
        let end = (b.ptr + size - base).div_ceil(seg);
        if begin == end {
            return false;
        }
        let mapped_ptr = base + begin * seg;
        let mapped_size = (end - begin) * seg;
        if !self.device.map(mapped_ptr, mapped_size) {
            return false;
        }
        self.expandable_segments[es_idx].as_mut().unwrap().mapped_size += mapped_size;
        self.unmapped_erase(to_map);
        self.bm(to_map).mapped = true;
        if mapped_size < b.size {
            let remaining = self.new_block_between(&b, b.ptr + mapped_size, b.size - mapped_size, false, to_map, b.next);
            self.unmapped_insert(remaining);
            self.bm(to_map).size = mapped_size;
        }
        let (prev, next) = (self.b(to_map).prev, self.b(to_map).next);
        self.try_merge_blocks(to_map, prev);
        self.try_merge_blocks(to_map, next);
        self.insert_into_blocks(to_map);
        self.total_allocated_memory += mapped_size;
        let small = self.is_small(b.pool);
        self.stats.reserved_bytes.increase(small, mapped_size);
        self.stats.num_device_alloc += 1;
        self.events.push(Event { kind: EventKind::SegmentMap, addr: mapped_ptr, size: mapped_size, stream: b.stream, pool: b.pool });
        true
    }

    /// `try_allocate_expandable_block`.
    fn try_allocate_expandable_block(&mut self, stream: u64, pool: PoolIdx, size: u64) -> Option<BlockId> {
        let mut candidate = self.find_expandable_block(stream, pool, size);
        if !self.b(candidate).mapped {
            let n = self.b(candidate).size.min(size);
            if !self.map_block(candidate, n) {
                return None;
            }
        }
        while self.b(candidate).size < size {
            let remaining = size - self.b(candidate).size;
            let new_candidate = self.b(candidate).next;
            let n = remaining.min(self.b(new_candidate).size);
            if !self.map_block(new_candidate, n) {
                return None;
            }
            candidate = new_candidate;
        }
        self.erase_from_blocks(candidate);
        Some(candidate)
    }

    /// `unmap_block`: unmap the whole pages strictly inside a free expandable block.
    fn unmap_block(&mut self, id: BlockId) {
        let b = self.b(id).clone();
        let es_idx = b.expandable_segment.unwrap() as usize;
        let (base, seg) = {
            let es = self.expandable_segments[es_idx].as_ref().unwrap();
            (es.ptr, es.segment_size)
        };
        let begin = (b.ptr - base).div_ceil(seg);
        let end = (b.ptr + b.size - base) / seg;
        if begin >= end {
            return;
        }
        let unmapped_ptr = base + begin * seg;
        let unmapped_size = (end - begin) * seg;
        self.device.unmap(unmapped_ptr, unmapped_size);
        self.expandable_segments[es_idx].as_mut().unwrap().mapped_size -= unmapped_size;
        self.erase_from_blocks(id);
        let before_size = unmapped_ptr - b.ptr;
        if before_size > 0 {
            let before = self.new_block_between(&b, b.ptr, before_size, true, b.prev, id);
            self.insert_into_blocks(before);
        }
        let after_size = b.size - (before_size + unmapped_size);
        if after_size > 0 {
            let next = self.b(id).next;
            let after = self.new_block_between(&b, unmapped_ptr + unmapped_size, after_size, true, id, next);
            self.insert_into_blocks(after);
        }
        {
            let bm = self.bm(id);
            bm.ptr = unmapped_ptr;
            bm.size = unmapped_size;
            bm.mapped = false;
        }
        let (prev, next) = (self.b(id).prev, self.b(id).next);
        self.try_merge_blocks(id, prev);
        self.try_merge_blocks(id, next);
        self.unmapped_insert(id);
        self.total_allocated_memory -= unmapped_size;
        let small = self.is_small(b.pool);
        self.stats.reserved_bytes.decrease(small, unmapped_size);
        if let Some(pp) = self.pools[b.pool as usize].owner_private_pool {
            self.private_pools[pp as usize].cuda_malloc_count -= 1;
        }
        self.stats.num_device_free += 1;
        self.events.push(Event { kind: EventKind::SegmentUnmap, addr: unmapped_ptr, size: unmapped_size, stream: b.stream, pool: b.pool });
    }

    /// `release_expandable_segment`: the whole segment is unmapped; free its address range.
    fn release_expandable_segment(&mut self, id: BlockId) {
        let es_idx = self.b(id).expandable_segment.unwrap() as usize;
        let es = self.expandable_segments[es_idx].take().unwrap();
        self.device.release_reservation(es.ptr, es.size());
        self.unmapped_erase(id);
        self.delete_block(id);
    }

    // ----- inspection -----

    /// The segments as `torch.cuda.memory._snapshot()` lists them: one per cudaMalloc'd segment, one
    /// per contiguous mapped range of an expandable segment; sorted by address.
    pub fn segments(&self) -> Vec<SegmentView> {
        let mut out = Vec::new();
        for (id, b) in self.live_blocks() {
            // A segment head: no prev, or (expandable) prev unmapped; and mapped.
            if !b.mapped {
                continue;
            }
            let head = b.prev == NIL || !self.b(b.prev).mapped;
            if !head {
                continue;
            }
            let mut blocks = Vec::new();
            let mut cur = id;
            while cur != NIL && self.b(cur).mapped {
                blocks.push(cur);
                cur = self.b(cur).next;
            }
            let total_size = blocks.iter().map(|&x| self.b(x).size).sum();
            let pool = &self.pools[b.pool as usize];
            out.push(SegmentView {
                address: b.ptr,
                total_size,
                stream: b.stream,
                is_small: pool.is_small,
                pool_id: pool.owner_private_pool.map_or((0, 0), |i| self.private_pools[i as usize].id),
                is_expandable: b.expandable_segment.is_some(),
                blocks,
            });
        }
        out.sort_by_key(|s| s.address);
        out
    }

    /// Checks the structural invariants (blocks tile each segment, free sets agree with blocks, stats
    /// agree with blocks). Returns a description of the first violation.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut allocated = [0i64; 3];
        let mut active = [0i64; 3];
        let mut n_alloc = [0i64; 3];
        let mut reserved = [0i64; 3];
        let mut segments = [0i64; 3];
        let mut inactive_split = [0i64; 3];
        let mut inactive_split_bytes = [0i64; 3];
        let mut in_sets = 0usize;
        for (id, b) in self.live_blocks() {
            let p = if self.pools[b.pool as usize].is_small { 1 } else { 2 };
            if b.next != NIL {
                let n = self.b(b.next);
                if n.prev != id {
                    return Err(format!("block {id}: next.prev mismatch"));
                }
                if b.ptr + b.size != n.ptr {
                    return Err(format!("block {id} at {:#x}+{} does not touch its next at {:#x}", b.ptr, b.size, n.ptr));
                }
            }
            if b.prev != NIL && self.b(b.prev).next != id {
                return Err(format!("block {id}: prev.next mismatch"));
            }
            if b.mapped {
                reserved[p] += b.size as i64;
                if b.expandable_segment.is_none() && b.prev == NIL {
                    segments[p] += 1;
                }
            }
            if b.allocated {
                allocated[p] += b.size as i64;
                n_alloc[p] += 1;
            }
            if b.allocated || b.event_count > 0 {
                active[p] += b.size as i64;
            }
            let free = !b.allocated && b.event_count == 0;
            if free && b.mapped {
                let pool = &self.pools[b.pool as usize];
                if pool.blocks.get((b.stream, b.size, b.ptr)) != Some(id) {
                    return Err(format!("free block {id} ({:#x}, {}) missing from its pool's set", b.ptr, b.size));
                }
                in_sets += 1;
                if b.is_split() && b.expandable_segment.is_none() {
                    inactive_split[p] += 1;
                    inactive_split_bytes[p] += b.size as i64;
                }
                for nb in [b.prev, b.next] {
                    if nb != NIL {
                        let o = self.b(nb);
                        if !o.allocated && o.event_count == 0 && o.mapped {
                            return Err(format!("free block {id} has an unmerged free neighbour {nb}"));
                        }
                    }
                }
            }
        }
        let set_total: usize = self.pools.iter().map(|p| p.blocks.count()).sum();
        if set_total != in_sets {
            return Err(format!("pool sets hold {set_total} blocks, {in_sets} free mapped blocks exist"));
        }
        let s = &self.stats;
        for (name, arr, want) in [
            ("allocated_bytes", &s.allocated_bytes, allocated),
            ("active_bytes", &s.active_bytes, active),
            ("allocation", &s.allocation, n_alloc),
            ("reserved_bytes", &s.reserved_bytes, reserved),
            ("segment", &s.segment, segments),
            ("inactive_split", &s.inactive_split, inactive_split),
            ("inactive_split_bytes", &s.inactive_split_bytes, inactive_split_bytes),
        ] {
            for (p, (got, &want)) in arr.0.iter().zip(want.iter()).enumerate().skip(1) {
                if got.current != want {
                    return Err(format!("{name}[{p}].current = {} but blocks say {want}", got.current));
                }
            }
            if arr.0[0].current != want[1] + want[2] {
                return Err(format!("{name}.all.current = {} but blocks say {}", arr.0[0].current, want[1] + want[2]));
            }
        }
        if self.total_allocated_memory as i64 != reserved[1] + reserved[2] {
            return Err(format!("total_allocated_memory {} != mapped bytes {}", self.total_allocated_memory, reserved[1] + reserved[2]));
        }
        Ok(())
    }
}

/// A segment as a snapshot shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentView {
    pub address: u64,
    pub total_size: u64,
    pub stream: u64,
    pub is_small: bool,
    pub pool_id: MempoolId,
    pub is_expandable: bool,
    pub blocks: Vec<BlockId>,
}

// ---------------------------------------------------------------------------------------------
// Restoring a state (a trace that starts mid-history)

/// The state of one block of a segment being restored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RestoredState {
    /// Allocated (`active_allocated`), serving a request of `requested_size` bytes.
    Allocated { requested_size: u64 },
    /// Freed with outstanding cross-stream events (`active_pending_free`).
    PendingFree { requested_size: u64 },
}

/// An active block of a segment being restored, at `offset` bytes from the segment's start (for an
/// expandable segment: from the reservation's base). Free blocks are the gaps between active
/// blocks (free neighbours always merge, so the gaps are exactly the free blocks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RestoredBlockSpec {
    pub offset: u64,
    pub size: u64,
    pub state: RestoredState,
}

/// A handle on a restored active block: the block (allocated) or the token of its pending free.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RestoredHandle {
    Allocated(BlockId),
    PendingFree(u64),
}

/// What a restore made: the segment's (or reservation's) address as the device chose it, and one
/// handle per active block, in the order given.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Restored {
    pub address: u64,
    pub handles: Vec<RestoredHandle>,
}

impl<D: Device> CachingAllocator<D> {
    /// Restores a cudaMalloc'd segment of `size` bytes with the given active blocks (sorted by
    /// offset, non-overlapping, inside the segment), as if it had been allocated and its blocks
    /// split, allocated and freed: the device is asked for the segment (`Device::malloc`; a
    /// simulated device with [`crate::Placement::Recorded`] gives the recorded address when the
    /// segment is listed first), and every statistic moves exactly as the allocation would have
    /// moved it (`segment`, `reserved_bytes`, `oversize_segments`, `num_device_alloc`, and per block
    /// `allocation`, `allocated_bytes`, `active`, `active_bytes`, `requested_bytes`,
    /// `oversize_allocations`, and for the free blocks of a split segment `inactive_split` and
    /// `inactive_split_bytes`). The allowed maximum is not checked: the state existed.
    pub fn restore_segment(&mut self, size: u64, stream: u64, route: Route, small: bool, blocks: &[RestoredBlockSpec]) -> Result<Restored, String> {
        check_specs(blocks, size)?;
        let pool = self.restore_pool(small, route);
        let ptr = self.device.malloc(size).ok_or_else(|| format!("the device has no room for a restored segment of {size} bytes"))?;
        self.note_size(size);
        if let Some(pp) = self.pools[pool as usize].owner_private_pool {
            self.private_pools[pp as usize].cuda_malloc_count += 1;
        }
        self.total_allocated_memory += size;
        self.stats.segment.increase(small, 1);
        self.stats.reserved_bytes.increase(small, size);
        if size >= self.config.max_split_size {
            self.stats.oversize_segments.increase(1);
        }
        self.stats.num_device_alloc += 1;
        // Tile the segment: active blocks and the free gaps between them.
        let mut pieces: Vec<(u64, u64, Option<RestoredState>)> = Vec::new();
        let mut at = 0;
        for b in blocks {
            if b.offset > at {
                pieces.push((at, b.offset - at, None));
            }
            pieces.push((b.offset, b.size, Some(b.state)));
            at = b.offset + b.size;
        }
        if at < size {
            pieces.push((at, size - at, None));
        }
        let split = pieces.len() > 1;
        let ids = self.link_pieces(&pieces, ptr, stream, pool, true, None);
        let mut handles = Vec::new();
        for (&id, &(_, bsize, st)) in ids.iter().zip(&pieces) {
            match st {
                None => {
                    self.insert_into_blocks(id);
                    if split {
                        self.stats.inactive_split.increase(small, 1);
                        self.stats.inactive_split_bytes.increase(small, bsize);
                    }
                }
                Some(st) => handles.push(self.restore_active(id, st)),
            }
        }
        Ok(Restored { address: ptr, handles })
    }

    /// Restores an expandable segment: a reservation (`Device::reserve`, of the size
    /// `find_expandable_block` would reserve for this pool) with the page-aligned `mapped` ranges
    /// (offsets from its base, sorted, disjoint) mapped (`Device::map`, one call and one
    /// `num_device_alloc` per range) and the given active blocks inside them. Returns the base the
    /// device chose.
    pub fn restore_expandable_segment(
        &mut self,
        stream: u64,
        route: Route,
        small: bool,
        mapped: &[(u64, u64)],
        blocks: &[RestoredBlockSpec],
    ) -> Result<Restored, String> {
        let pool = self.restore_pool(small, route);
        let segment_size = if small { K_SMALL_BUFFER } else { self.config.large_segment_size };
        let total = self.device.mem_get_info().1;
        let max_handles = self.config.expandable_reservation_pages(total, segment_size);
        let res_size = max_handles * segment_size;
        let mut at = 0;
        for &(off, len) in mapped {
            if off < at || len == 0 || off % segment_size != 0 || len % segment_size != 0 || off.saturating_add(len) > res_size {
                return Err(format!("mapped range at offset {off} of {len} bytes is not page-aligned, ordered and inside the reservation"));
            }
            at = off + len;
        }
        check_specs(blocks, res_size)?;
        for b in blocks {
            if !mapped.iter().any(|&(o, l)| b.offset >= o && b.offset + b.size <= o + l) {
                return Err(format!("block at offset {} of {} bytes is not inside one mapped range", b.offset, b.size));
            }
        }
        let base = self.device.reserve(res_size);
        let mut mapped_total = 0;
        for &(off, len) in mapped {
            if !self.device.map(base + off, len) {
                return Err(format!("the device has no room to map {len} bytes of a restored expandable segment"));
            }
            mapped_total += len;
            self.total_allocated_memory += len;
            self.stats.reserved_bytes.increase(small, len);
            self.stats.num_device_alloc += 1;
            if let Some(pp) = self.pools[pool as usize].owner_private_pool {
                self.private_pools[pp as usize].cuda_malloc_count += 1;
            }
        }
        let es = self.expandable_segments.len() as u32;
        self.expandable_segments.push(Some(ExpandableSegment { ptr: base, segment_size, max_handles, stream, mapped_size: mapped_total }));
        // Tile the reservation: unmapped ranges, and inside mapped ranges active blocks and free gaps.
        let mut pieces: Vec<(u64, u64, Option<RestoredState>, bool)> = Vec::new();
        let mut at = 0;
        let mut bi = 0;
        for &(off, len) in mapped {
            if off > at {
                pieces.push((at, off - at, None, false));
            }
            let mut p = off;
            while bi < blocks.len() && blocks[bi].offset < off + len {
                let b = blocks[bi];
                if b.offset > p {
                    pieces.push((p, b.offset - p, None, true));
                }
                pieces.push((b.offset, b.size, Some(b.state), true));
                p = b.offset + b.size;
                bi += 1;
            }
            if p < off + len {
                pieces.push((p, off + len - p, None, true));
            }
            at = off + len;
        }
        if at < res_size {
            pieces.push((at, res_size - at, None, false));
        }
        let plain: Vec<(u64, u64, Option<RestoredState>)> = pieces.iter().map(|&(o, s, st, _)| (o, s, st)).collect();
        let ids = self.link_pieces(&plain, base, stream, pool, true, Some(es));
        let mut handles = Vec::new();
        for (&id, &(_, _, st, is_mapped)) in ids.iter().zip(&pieces) {
            self.bm(id).mapped = is_mapped;
            match (st, is_mapped) {
                (None, false) => self.unmapped_insert(id),
                (None, true) => self.insert_into_blocks(id),
                (Some(st), _) => handles.push(self.restore_active(id, st)),
            }
        }
        Ok(Restored { address: base, handles })
    }

    /// Releases the whole free cudaMalloc'd segment at `ptr` (`release_block`), as a release the
    /// trace shows but whose cause lies before its start. False if there is no such segment.
    pub fn release_segment_at(&mut self, ptr: u64) -> bool {
        let hit = self.live_blocks().find(|(_, b)| b.ptr == ptr && b.mapped && b.expandable_segment.is_none() && !b.is_split()).map(|(id, _)| id);
        match hit {
            Some(id) if !self.b(id).allocated && self.b(id).event_count == 0 => {
                self.release_block(id);
                true
            }
            _ => false,
        }
    }

    /// Unmaps the free pages of the free expandable block containing `ptr` (`unmap_block`, then
    /// `release_expandable_segment` if nothing of it stays mapped), as `release_blocks` does.
    /// False if `ptr` is not in a free mapped expandable block.
    pub fn unmap_free_block_at(&mut self, ptr: u64) -> bool {
        let hit = self.live_blocks().find(|(_, b)| b.mapped && b.expandable_segment.is_some() && ptr >= b.ptr && ptr < b.ptr + b.size).map(|(id, _)| id);
        let Some(id) = hit else { return false };
        if self.b(id).allocated || self.b(id).event_count > 0 {
            return false;
        }
        self.unmap_block(id);
        let b = self.b(id);
        if !b.mapped && b.prev == NIL && b.next == NIL {
            self.release_expandable_segment(id);
        }
        true
    }

    /// `resetAccumulatedStats`: the `allocated`/`freed` counters of every statistic and
    /// `num_alloc_retries`, `num_ooms`, `num_sync_all_streams`, `num_device_alloc`,
    /// `num_device_free` back to zero.
    pub fn reset_accumulated_stats(&mut self) {
        let s = &mut self.stats;
        for a in [
            &mut s.allocation,
            &mut s.segment,
            &mut s.active,
            &mut s.inactive_split,
            &mut s.allocated_bytes,
            &mut s.reserved_bytes,
            &mut s.active_bytes,
            &mut s.inactive_split_bytes,
            &mut s.requested_bytes,
        ] {
            for st in a.0.iter_mut() {
                st.allocated = 0;
                st.freed = 0;
            }
        }
        for st in [&mut s.oversize_allocations, &mut s.oversize_segments] {
            st.allocated = 0;
            st.freed = 0;
        }
        s.num_alloc_retries = 0;
        s.num_ooms = 0;
        s.num_oom_rejections = 0;
        s.num_sync_all_streams = 0;
        s.num_device_alloc = 0;
        s.num_device_free = 0;
    }

    fn restore_pool(&mut self, small: bool, route: Route) -> PoolIdx {
        match route {
            Route::Default => {
                if small {
                    SMALL_POOL
                } else {
                    LARGE_POOL
                }
            }
            Route::Private(id) => {
                let i = self.private_pool(id) as usize;
                if small { self.private_pools[i].small } else { self.private_pools[i].large }
            }
        }
    }

    /// New blocks for `pieces` (offset, size) at `base`, linked in order.
    fn link_pieces(
        &mut self,
        pieces: &[(u64, u64, Option<RestoredState>)],
        base: u64,
        stream: u64,
        pool: PoolIdx,
        mapped: bool,
        es: Option<u32>,
    ) -> Vec<BlockId> {
        let mut ids: Vec<BlockId> = Vec::with_capacity(pieces.len());
        for &(off, size, _) in pieces {
            let prev = ids.last().copied().unwrap_or(NIL);
            let id = self.new_block(Block {
                stream,
                size,
                requested_size: 0,
                pool,
                ptr: base + off,
                allocated: false,
                mapped,
                prev,
                next: NIL,
                event_count: 0,
                gc_count_base: 0,
                expandable_segment: es,
            });
            if prev != NIL {
                self.bm(prev).next = id;
            }
            ids.push(id);
        }
        ids
    }

    /// Makes restored block `id` active, with the statistics of its allocation (and of its free).
    fn restore_active(&mut self, id: BlockId, st: RestoredState) -> RestoredHandle {
        let small = self.is_small(self.b(id).pool);
        let size = self.b(id).size;
        let requested = match st {
            RestoredState::Allocated { requested_size } | RestoredState::PendingFree { requested_size } => requested_size,
        };
        self.bm(id).requested_size = requested;
        let s = &mut self.stats;
        s.active.increase(small, 1);
        s.active_bytes.increase(small, size);
        s.requested_bytes.increase(small, requested);
        match st {
            RestoredState::Allocated { .. } => {
                self.bm(id).allocated = true;
                let s = &mut self.stats;
                s.allocation.increase(small, 1);
                s.allocated_bytes.increase(small, size);
                if size >= self.config.max_split_size {
                    s.oversize_allocations.increase(1);
                }
                RestoredHandle::Allocated(id)
            }
            RestoredState::PendingFree { .. } => {
                self.bm(id).event_count = 1;
                self.next_free_token += 1;
                self.pending_frees.push((id, self.next_free_token));
                RestoredHandle::PendingFree(self.next_free_token)
            }
        }
    }
}

fn check_specs(blocks: &[RestoredBlockSpec], size: u64) -> Result<(), String> {
    let mut at = 0;
    for b in blocks {
        if b.offset < at || b.size == 0 || b.offset.checked_add(b.size).is_none_or(|e| e > size) {
            return Err(format!("restored block at offset {} of {} bytes overlaps another or leaves its segment", b.offset, b.size));
        }
        at = b.offset + b.size;
    }
    Ok(())
}

/// `should_split` in a pool that splits (every pool but a `MemPool(no_split=True)`): whether a
/// free block of `block_size` bytes serving a request rounded to `size` bytes is cut, leaving the
/// remainder free. In a small pool or an expandable segment any remainder of `kMinBlockSize`
/// (512) bytes or more is; in a large pool of cudaMalloc'd segments, a remainder above
/// `kSmallSize` (1 MiB), and only for a request below `max_split_size`.
pub fn splits_block(config: &AllocatorConfig, block_size: u64, size: u64, small: bool, expandable: bool) -> bool {
    let remaining = block_size.saturating_sub(size);
    if small || expandable { remaining >= K_MIN_BLOCK_SIZE } else { size < config.max_split_size && remaining > K_SMALL_SIZE }
}
