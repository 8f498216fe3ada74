//! Whether a trace starts mid-history: the sign that the allocator held memory before its first
//! entry (`_record_memory_history(max_entries=N)` keeps only the last N entries, or history was
//! turned on late), so that its state there must be inferred ([`crate::restore`]).
//!
//! The allocator rule it rests on: every block a trace frees was allocated by an `alloc` entry
//! (`DeviceCachingAllocator::malloc` records one before it returns), every segment it releases or
//! unmaps by a `segment_alloc` or `segment_map` (`alloc_block`, `map_block`). A trace that frees,
//! completes, releases or unmaps what it never allocated started after that allocation.

use std::collections::BTreeMap;

use allocsim_trace::hash::IntSet;
use allocsim_trace::{Action, TraceEntry};

/// Whether the trace refers to blocks or segments it did not allocate (frees, completions,
/// releases, unmaps of unknown addresses): it starts mid-history.
pub fn starts_mid_history(trace: &[TraceEntry]) -> bool {
    let mut m = MidHistory::default();
    trace.iter().any(|e| m.push(e))
}

/// [`starts_mid_history`] entry by entry: its memory is the live blocks and segments (and every
/// address ever mapped).
#[derive(Clone, Debug, Default)]
pub struct MidHistory {
    blocks: IntSet<u64>,
    segments: IntSet<u64>,
    mapped: BTreeMap<u64, u64>,
}

impl MidHistory {
    /// True when this entry shows that the trace starts mid-history.
    pub fn push(&mut self, e: &TraceEntry) -> bool {
        match e.action {
            Action::Alloc => {
                self.blocks.insert(e.addr);
            }
            Action::FreeRequested | Action::FreeCompleted if !self.blocks.contains(&e.addr) => return true,
            Action::FreeCompleted => {
                self.blocks.remove(&e.addr);
            }
            Action::SegmentAlloc => {
                self.segments.insert(e.addr);
            }
            Action::SegmentFree if !self.segments.remove(&e.addr) => return true,
            Action::SegmentMap => {
                self.mapped.insert(e.addr, e.addr.saturating_add(e.size));
            }
            Action::SegmentUnmap => {
                let inside = self.mapped.range(..=e.addr).next_back().is_some_and(|(_, &end)| end > e.addr);
                let first = self.mapped.range(..e.addr.saturating_add(e.size)).next_back().is_some_and(|(&s, _)| s >= e.addr);
                if !inside && !first {
                    return true;
                }
            }
            _ => {}
        }
        false
    }
}

/// [`MidHistory`], and also an allocation at an address no segment the trace allocated (or
/// mapped) holds: a segment that existed before the trace's first entry, which a trace that
/// starts mid-history often shows long before it frees anything it did not allocate (the
/// segment of the allocation that was made before the history was turned on). Only once the
/// trace has shown a segment event (a trace recorded without them, or generated, shows none).
#[derive(Clone, Debug, Default)]
pub struct PreExisting {
    mid: MidHistory,
    /// Live segments and every mapped range: start → end.
    ranges: BTreeMap<u64, u64>,
    segment_events: bool,
}

impl PreExisting {
    /// True when this entry shows that the trace starts mid-history.
    pub fn push(&mut self, e: &TraceEntry) -> bool {
        if self.mid.push(e) {
            return true;
        }
        match e.action {
            Action::SegmentAlloc | Action::SegmentMap => {
                self.segment_events = true;
                let end = e.addr.saturating_add(e.size);
                let r = self.ranges.entry(e.addr).or_insert(end);
                *r = (*r).max(end);
            }
            Action::SegmentFree => {
                self.segment_events = true;
                self.ranges.remove(&e.addr);
            }
            Action::SegmentUnmap => self.segment_events = true,
            Action::Alloc if self.segment_events => {
                return self.ranges.range(..=e.addr).next_back().is_none_or(|(_, &end)| end <= e.addr);
            }
            _ => {}
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(action: Action, addr: u64, size: u64) -> TraceEntry {
        TraceEntry { action, addr, size, stream: 0, time_us: 0, stack: 0, meta: 0 }
    }

    #[test]
    fn an_allocation_outside_every_segment_the_trace_allocated_shows_a_trace_that_starts_mid_history() {
        const MIB: u64 = 1 << 20;
        let mut p = PreExisting::default();
        // Before any segment event nothing can be told (a trace recorded without them).
        assert!(!p.push(&entry(Action::Alloc, 0x9000_0000, 512)));
        assert!(!p.push(&entry(Action::SegmentAlloc, 0x1000_0000, 2 * MIB)));
        assert!(!p.push(&entry(Action::Alloc, 0x1000_0000, 512)));
        assert!(!p.push(&entry(Action::Alloc, 0x1000_0000 + 2 * MIB - 512, 512)));
        // Past the segment's end, and in a segment released since: not the trace's.
        assert!(p.clone().push(&entry(Action::Alloc, 0x1000_0000 + 2 * MIB, 512)));
        let mut released = p.clone();
        assert!(!released.push(&entry(Action::SegmentFree, 0x1000_0000, 2 * MIB)));
        assert!(released.push(&entry(Action::Alloc, 0x1000_0000, 512)));
        // Mapped pages hold allocations; a free of a block never allocated is MidHistory's sign.
        assert!(!p.push(&entry(Action::SegmentMap, 0x2000_0000, 20 * MIB)));
        assert!(!p.push(&entry(Action::Alloc, 0x2000_0000 + 19 * MIB, 4096)));
        assert!(p.push(&entry(Action::FreeRequested, 0x3000_0000, 512)));
    }
}
