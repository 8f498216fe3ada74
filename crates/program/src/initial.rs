//! The allocator's state at the first entry of a trace that starts mid-history: the segments,
//! the expandable segments' mapped pages and the active blocks a replay starts from
//! (`CachingAllocator::restore_segment`). How it is inferred from the final segments is
//! `allocsim_infer::restore`'s.

use allocsim_model::allocator::MempoolId;

/// An active block at the trace's start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreBlock {
    pub addr: u64,
    pub size: u64,
    pub requested_size: u64,
    /// Freed, with cross-stream events outstanding (`active_pending_free`).
    pub pending: bool,
    /// The size was inferred (the block was freed in the trace), see the module documentation.
    pub size_inferred: bool,
    /// The index of the entry that returned it to its pool (`free_completed`), if in the trace.
    pub freed_at: Option<u32>,
    /// The bytes it may take: up to the next active block or its segment's end.
    pub room: u64,
    /// The most it could have been larger than its rounded request and still not have been split
    /// (when its size is inferred): 1 MiB, or `max_non_split_rounding` for an oversize block;
    /// 0 where blocks are always split (small pool, expandable segments).
    pub slack: u64,
}

/// A segment at the trace's start: a cudaMalloc'd segment, or an expandable segment's
/// reservation with its mapped ranges.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreSegment {
    /// The segment's address; for an expandable segment the reservation's base.
    pub addr: u64,
    /// The segment's size; for an expandable segment the mapped bytes.
    pub size: u64,
    pub stream: u64,
    pub small: bool,
    pub pool_id: MempoolId,
    pub expandable: bool,
    /// Expandable: the mapped ranges (address, bytes), sorted.
    pub mapped: Vec<(u64, u64)>,
    /// Indices into [`InitialState::blocks`] of the active blocks inside it, by address.
    pub blocks: Vec<u32>,
}

/// The allocator's state at the trace's first entry.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InitialState {
    /// In address order.
    pub segments: Vec<PreSegment>,
    /// Active blocks, in address order.
    pub blocks: Vec<PreBlock>,
    /// Blocks whose size was inferred (freed in the trace, allocated before it).
    pub inferred_sizes: u32,
}

impl InitialState {
    pub fn is_empty(&self) -> bool {
        self.segments.is_empty()
    }
    /// Reserved bytes (segments plus mapped pages).
    pub fn reserved_bytes(&self) -> u64 {
        self.segments.iter().map(|s| s.size).sum()
    }
    pub fn allocated_blocks(&self) -> usize {
        self.blocks.iter().filter(|b| !b.pending).count()
    }
    pub fn allocated_bytes(&self) -> u64 {
        self.blocks.iter().filter(|b| !b.pending).map(|b| b.size).sum()
    }
    pub fn pending_blocks(&self) -> usize {
        self.blocks.iter().filter(|b| b.pending).count()
    }
    /// Segment addresses (non-expandable) and reservation bases (expandable), in restore order,
    /// for a recorded placement.
    pub fn placement_lists(&self) -> (Vec<(u64, u64)>, Vec<u64>) {
        let segs = self.segments.iter().filter(|s| !s.expandable).map(|s| (s.addr, s.size)).collect();
        let res = self.segments.iter().filter(|s| s.expandable).map(|s| s.addr).collect();
        (segs, res)
    }
}
