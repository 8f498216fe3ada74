//! Where the free memory is, and how fragmented it is, in one allocator state.
//!
//! Definitions (each metric's source):
//! * `reserved − allocated`: what PyTorch's OOM message calls "reserved by PyTorch but unallocated"
//!   (plus blocks whose cross-stream frees are pending).
//! * utilization = peak active / peak reserved (GMLake, ASPLOS'24; STAlloc); fragmentation = 1 − utilization.
//! * internal free = allocated − requested (rounding waste inside live blocks; `_memory_viz.py segsum`
//!   calls it "internal"); external free = free blocks between and after live blocks ("external").
//! * largest free block / total free, per pool and stream: 1.0 when all free memory is one block.
//! * gap concentration = Σ gap² / (Σ gap)² over free blocks (the Σ(free gap²)/total² helper that
//!   MemoryViz.js prints to the browser console); 1.0 = one gap, → 0 = many small gaps.

use std::collections::BTreeMap;

use allocsim_model::Device;
use allocsim_model::allocator::CachingAllocator;

/// Free memory of one (pool kind, stream) pair.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct PoolFree {
    pub small: bool,
    pub stream: u64,
    /// Private pool id, (0, 0) for the default pools.
    pub pool_id: (i64, i64),
    pub free: u64,
    pub largest_free_block: u64,
    pub free_blocks: u32,
}

#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct FreeBreakdown {
    pub reserved: u64,
    pub allocated: u64,
    pub active: u64,
    pub requested: u64,
    /// Free (inactive) mapped bytes.
    pub free: u64,
    /// Blocks freed whose cross-stream events have not completed (active but not allocated).
    pub pending_frees: u64,
    /// Free bytes in segments that also hold live (allocated or pending) blocks: they cannot be
    /// returned to the device until those blocks go.
    pub pinned_by_live_blocks: u64,
    /// Free bytes in completely free cudaMalloc'd segments (released by empty_cache or an OOM retry).
    pub in_free_segments: u64,
    pub free_small_pool: u64,
    pub free_large_pool: u64,
    pub free_private_pools: u64,
    /// allocated − requested.
    pub rounding_waste: u64,
    pub largest_free_block: u64,
    pub gap_concentration: f64,
    pub per_pool: Vec<PoolFree>,
    /// Each private pool's memory (CUDA graphs, MemPools), largest first.
    pub private_pools: Vec<PrivatePoolShare>,
}

/// What one private pool holds.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct PrivatePoolShare {
    pub pool_id: (i64, i64),
    pub reserved: u64,
    pub allocated: u64,
    pub free: u64,
    pub segments: u32,
    /// Of all reserved memory.
    pub share_of_reserved: f64,
    /// No user is left (`use_count` 0): the pool serves no more requests, and its free segments
    /// go at the next `empty_cache()` or OOM retry; what stays is held by its live blocks.
    pub freeable: bool,
}

impl FreeBreakdown {
    /// reserved − allocated: "reserved by PyTorch but unallocated".
    pub fn unallocated(&self) -> u64 {
        self.reserved.saturating_sub(self.allocated)
    }
}

pub fn breakdown<D: Device>(a: &CachingAllocator<D>) -> FreeBreakdown {
    let s = &a.stats;
    let mut f = FreeBreakdown {
        reserved: s.reserved_bytes.all().current as u64,
        allocated: s.allocated_bytes.all().current as u64,
        active: s.active_bytes.all().current as u64,
        requested: s.requested_bytes.all().current as u64,
        ..Default::default()
    };
    f.pending_frees = f.active.saturating_sub(f.allocated);
    f.rounding_waste = f.allocated.saturating_sub(f.requested);
    let mut per: BTreeMap<(bool, u64, (i64, i64)), PoolFree> = BTreeMap::new();
    let (mut sum, mut sum_sq) = (0f64, 0f64);
    for seg in a.segments() {
        let live = seg.blocks.iter().any(|&b| {
            let b = a.block(b);
            b.allocated || b.event_count > 0
        });
        for &id in &seg.blocks {
            let b = a.block(id);
            if b.allocated || b.event_count > 0 {
                continue;
            }
            f.free += b.size;
            if live || seg.is_expandable {
                f.pinned_by_live_blocks += b.size;
            } else {
                f.in_free_segments += b.size;
            }
            if seg.pool_id != (0, 0) {
                f.free_private_pools += b.size;
            } else if seg.is_small {
                f.free_small_pool += b.size;
            } else {
                f.free_large_pool += b.size;
            }
            f.largest_free_block = f.largest_free_block.max(b.size);
            sum += b.size as f64;
            sum_sq += (b.size as f64) * (b.size as f64);
            let e = per.entry((seg.is_small, seg.stream, seg.pool_id)).or_insert_with(|| PoolFree {
                small: seg.is_small,
                stream: seg.stream,
                pool_id: seg.pool_id,
                ..Default::default()
            });
            e.free += b.size;
            e.largest_free_block = e.largest_free_block.max(b.size);
            e.free_blocks += 1;
        }
    }
    let mut pools: BTreeMap<(i64, i64), PrivatePoolShare> = BTreeMap::new();
    for seg in a.segments().iter().filter(|s| s.pool_id != (0, 0)) {
        let e = pools.entry(seg.pool_id).or_insert_with(|| PrivatePoolShare { pool_id: seg.pool_id, ..Default::default() });
        e.reserved += seg.total_size;
        e.segments += 1;
        for &id in &seg.blocks {
            let b = a.block(id);
            if b.allocated {
                e.allocated += b.size;
            } else if b.event_count == 0 {
                e.free += b.size;
            }
        }
    }
    let mut shares: Vec<PrivatePoolShare> = pools.into_values().collect();
    for p in &mut shares {
        p.share_of_reserved = if f.reserved > 0 { p.reserved as f64 / f.reserved as f64 } else { 0.0 };
        p.freeable = a.graph_pools_freeable.contains(p.pool_id);
    }
    shares.sort_by(|x, y| y.reserved.cmp(&x.reserved).then(x.pool_id.cmp(&y.pool_id)));
    f.private_pools = shares;
    f.gap_concentration = if sum > 0.0 { sum_sq / (sum * sum) } else { 1.0 };
    f.per_pool = per.into_values().collect();
    f
}
