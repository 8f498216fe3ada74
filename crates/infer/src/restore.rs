//! Ring-buffer truncation: the allocator's state at the start of a trace that begins mid-history.
//!
//! `_record_memory_history(max_entries=N)` keeps the last N entries, so a trace may start in the
//! middle of a run: it frees blocks whose `alloc` was overwritten, releases segments whose
//! `segment_alloc` was overwritten, and the snapshot's final `segments` hold blocks that no `alloc`
//! of the trace made. [`reconstruct`] undoes the trace backwards from the final segments (what
//! PyTorch's MemoryViz does) and returns the state at the trace's first entry: the segments, the
//! expandable segments' mapped pages, and the active blocks. The replay then starts from that state
//! (`CachingAllocator::restore_segment`), with the recorded addresses, pools, streams and
//! expandable flags.
//!
//! Undoing, newest entry first: `alloc` makes its block free again; `free_requested` makes a
//! pending block allocated; `free_completed` makes the freed range an (active, pending) block
//! again; `segment_alloc` removes its segment, `segment_free` adds it back (free); `segment_map`
//! unmaps its pages, `segment_unmap` maps them back. Free blocks need no tracking: free neighbours
//! always merge, so the free blocks of a segment are exactly the gaps between its active blocks.
//!
//! # What the trace does not say, and the choices made
//!
//! * The size of a block freed in the trace but allocated before it: `free_requested` and
//!   `free_completed` record the request's size, not the block's. The block got
//!   `round_size(request)` bytes when the block it was cut from was split, else the whole block.
//!   Small-pool and expandable blocks are always split unless under 512 bytes would remain, so
//!   they have the rounded size. A large-pool block of a cudaMalloc'd segment takes the gap up to
//!   the next active block (or the segment's end) when less than 1 MiB would remain after the
//!   rounded size (every large-pool block is larger than 1 MiB, so that remainder cannot be a free
//!   block), or when it is oversize (≥ `max_split_size`, never split) and the gap is within
//!   `max_non_split_rounding`; otherwise the rounded size. [`InitialState::inferred_sizes`]
//!   counts these blocks.
//! * A segment released in the trace but allocated before it is in the default pools (private
//!   pools are never released in the replay either); small if it is 2 MiB (`kSmallBuffer`).
//! * An expandable segment's reservation base: the lowest address the trace or the final segments
//!   show for it (a map below it would have shown up), page-aligned relative to the true base.
//! * A `free_completed` at the very start without its `free_requested` is a block freed with
//!   pending cross-stream events (`active_pending_free` at the start).
//! * A run of `segment_free`/`segment_unmap` at the very start (the tail of an `empty_cache()` or of
//!   a `malloc`'s releases whose beginning was cut off) is replayed as exactly those releases.
//! * `memory_stats()`: the restored state moves every statistic as its allocation would have,
//!   then the accumulated counters are reset and the peaks set to the current values, as if
//!   `torch.cuda.reset_accumulated_memory_stats()` and `reset_peak_memory_stats()` had been called
//!   at the trace's first entry. So `*.current` values are exact, the `allocated`/`freed` counters
//!   and `num_*` count from the trace's start, and peaks are the trace's own (the job's may have
//!   been higher before it).
//! * Garbage collection ages: a block free at the start is taken as freed at the start.

use std::collections::BTreeMap;

use allocsim_model::AllocatorConfig;
use allocsim_model::allocator::MempoolId;
use allocsim_model::constants::{H200_TOTAL_MEMORY, K_MIN_BLOCK_SIZE, K_SMALL_BUFFER, K_SMALL_SIZE};
use allocsim_trace::hash::{IntMap, IntSet};
use allocsim_trace::{Action, BlockState, SnapshotSegment, TraceEntry};

pub use allocsim_program::initial::{InitialState, PreBlock, PreSegment};
use allocsim_program::program::Program;

use crate::mid_history::starts_mid_history;

/// Why a trace of `entries` entries starts mid-history (from an [`InitialState`]), in words: with
/// no entries, there is no history at all; with a round number of them (a multiple of 1000), the
/// ring buffer of `_record_memory_history(max_entries=…)` was most likely full and dropped older
/// entries; else history was turned on after the job had allocated memory (a snapshot does not
/// say which, so the ring buffer is named only where the count suggests it).
pub fn why_mid_history(entries: usize) -> String {
    if entries == 0 {
        "no trace entries: only the final state is known".to_string()
    } else if entries >= 1000 && entries.is_multiple_of(1000) {
        format!("the trace holds exactly {entries} entries, as a full ring buffer of max_entries does: older entries were dropped")
    } else {
        "memory history was turned on after the job had allocated memory".to_string()
    }
}

#[derive(Clone, Copy, Debug)]
struct Seg {
    size: u64,
    stream: u64,
    small: bool,
    pool_id: MempoolId,
}

#[derive(Clone, Copy, Debug)]
struct Act {
    size: Option<u64>,
    requested: u64,
    pending: bool,
    /// The index of the entry that freed it (`free_completed`), for a block freed in the trace.
    freed_at: usize,
}

/// The blocks live at a point of [`reconstruct`]'s backward walk, by address: a hash map (an
/// insertion and a removal per entry) with a count of blocks per 2 MiB granule of address, for
/// the question a segment event asks of them (is any block inside this range?), which for ranges
/// of whole granules (every segment and mapped range torch makes) is a look at the counts.
#[derive(Default)]
struct LiveBlocks {
    blocks: IntMap<u64, Act>,
    granules: IntMap<u64, u32>,
}

const GRANULE_BITS: u32 = 21;

impl LiveBlocks {
    fn insert(&mut self, addr: u64, a: Act) {
        if self.blocks.insert(addr, a).is_none() {
            *self.granules.entry(addr >> GRANULE_BITS).or_default() += 1;
        }
    }

    fn remove(&mut self, addr: u64) -> Option<Act> {
        let a = self.blocks.remove(&addr)?;
        let g = addr >> GRANULE_BITS;
        match self.granules.get_mut(&g) {
            Some(n) if *n > 1 => *n -= 1,
            _ => {
                self.granules.remove(&g);
            }
        }
        Some(a)
    }

    /// Whether a block starts in `start..end`.
    fn any_in(&self, start: u64, end: u64) -> bool {
        let whole = |a: u64| a.trailing_zeros() >= GRANULE_BITS;
        if !(whole(start) && whole(end)) {
            return self.blocks.keys().any(|&a| a >= start && a < end);
        }
        let (g0, g1) = (start >> GRANULE_BITS, end >> GRANULE_BITS);
        if g1.saturating_sub(g0) <= self.granules.len() as u64 {
            (g0..g1).any(|g| self.granules.contains_key(&g))
        } else {
            self.granules.keys().any(|&g| g >= g0 && g < g1)
        }
    }

    /// The blocks by address.
    fn into_sorted(self) -> Vec<(u64, Act)> {
        let mut v: Vec<(u64, Act)> = self.blocks.into_iter().collect();
        v.sort_unstable_by_key(|&(a, _)| a);
        v
    }
}

/// Mapped pages of expandable segments: start → (end, stream).
type Mapped = BTreeMap<u64, (u64, u64)>;

fn unmap_range(m: &mut Mapped, a: u64, len: u64) -> bool {
    let end = a.saturating_add(len);
    let Some((&s, &(e, stream))) = m.range(..=a).next_back() else { return false };
    if e < end {
        return false;
    }
    m.remove(&s);
    if s < a {
        m.insert(s, (a, stream));
    }
    if end < e {
        m.insert(end, (e, stream));
    }
    true
}

fn map_range(m: &mut Mapped, a: u64, len: u64, stream: u64) -> bool {
    let mut start = a;
    let mut end = a.saturating_add(len);
    if let Some((_, &(e, _))) = m.range(..end).next_back()
        && e > a
    {
        return false; // overlaps a mapped range
    }
    if let Some((&s, &(e, st))) = m.range(..=a).next_back()
        && e == a
        && st == stream
    {
        m.remove(&s);
        start = s;
    }
    if let Some(&(e, st)) = m.get(&end)
        && st == stream
    {
        m.remove(&end);
        end = e;
    }
    m.insert(start, (end, stream));
    true
}

/// The program of one device's trace (`allocsim_program::Program::build_from`), starting from
/// the state at its first entry where it starts mid-history: [`reconstruct`]ed under the settings
/// the trace was recorded under (`config`: its rounding and split rules) on a device of
/// `device_memory` bytes (the expandable segments' reservation size). Where reconstruction fails
/// without a sign of truncation ([`starts_mid_history`]), the inconsistency lies in the final
/// segments (absent, or from another moment), not in the trace: the replay starts from empty
/// without a note.
pub fn build_program(trace: &[TraceEntry], segments: &[SnapshotSegment], config: &AllocatorConfig, device_memory: u64) -> Program {
    let (initial, error) = match reconstruct(trace, segments, config, device_memory) {
        Ok(s) if s.is_empty() => (None, None),
        Ok(s) => (Some(s), None),
        Err(e) => (None, starts_mid_history(trace).then_some(e)),
    };
    Program::build_from(trace, segments, config, initial, error)
}

/// [`build_program`] under torch's default settings on an H200 (for traces recorded so).
pub fn build_program_default(trace: &[TraceEntry], segments: &[SnapshotSegment]) -> Program {
    build_program(trace, segments, &AllocatorConfig::default(), H200_TOTAL_MEMORY)
}

/// The state at the trace's first entry, from the final `segments` of this device undone
/// backwards. Empty for a trace that starts with an empty allocator. An error names the first
/// entry that contradicts the final segments (then the trace and the segments do not belong
/// together, or entries are missing, e.g. recorded with `skip_actions`).
pub fn reconstruct(trace: &[TraceEntry], segments: &[SnapshotSegment], config: &AllocatorConfig, device_memory: u64) -> Result<InitialState, String> {
    let mut segs: BTreeMap<u64, Seg> = BTreeMap::new();
    let mut mapped: Mapped = BTreeMap::new();
    let mut active = LiveBlocks::default();
    // Expandable ranges of the final snapshot: (address, stream, small, pool id), as hints.
    let mut es_hints: Vec<(u64, u64, bool, MempoolId)> = Vec::new();
    for s in segments {
        let end = s.address.checked_add(s.total_size).ok_or("a final segment ends beyond 2^64")?;
        if s.total_size == 0 {
            return Err(format!("final segment at {:#x} has no bytes", s.address));
        }
        if s.is_expandable {
            if !map_range(&mut mapped, s.address, s.total_size, s.stream) {
                return Err(format!("final expandable segment at {:#x} overlaps another", s.address));
            }
            es_hints.push((s.address, s.stream, s.is_small, s.pool_id));
        } else {
            if segs.range(..end).next_back().is_some_and(|(&a, g)| a + g.size > s.address) {
                return Err(format!("final segment at {:#x} overlaps another", s.address));
            }
            segs.insert(s.address, Seg { size: s.total_size, stream: s.stream, small: s.is_small, pool_id: s.pool_id });
        }
        for b in &s.blocks {
            if b.state != BlockState::Inactive {
                let pending = b.state == BlockState::ActivePendingFree;
                active.insert(b.address, Act { size: Some(b.size), requested: b.requested_size, pending, freed_at: usize::MAX });
            }
        }
    }
    for (i, e) in trace.iter().enumerate().rev() {
        let at = || format!("entry {i} ({} at {:#x})", e.action.as_str(), e.addr);
        match e.action {
            Action::Alloc => match active.remove(e.addr) {
                Some(a) if !a.pending => {}
                Some(_) => return Err(format!("{}: the block is freed later without a free_requested", at())),
                None => return Err(format!("{}: no such block is live after it", at())),
            },
            Action::FreeRequested => match active.blocks.get_mut(&e.addr) {
                Some(a) if a.pending => a.pending = false,
                _ => return Err(format!("{}: the block is not pending after it", at())),
            },
            Action::FreeCompleted => {
                if active.blocks.contains_key(&e.addr) {
                    return Err(format!("{}: the address is in use after it", at()));
                }
                active.insert(e.addr, Act { size: None, requested: e.size, pending: true, freed_at: i });
            }
            Action::SegmentAlloc => match segs.get(&e.addr) {
                Some(s) if s.size == e.size => {
                    if active.any_in(e.addr, e.addr.saturating_add(e.size)) {
                        return Err(format!("{}: blocks of the segment are live before it", at()));
                    }
                    segs.remove(&e.addr);
                }
                _ => return Err(format!("{}: no such segment after it", at())),
            },
            Action::SegmentFree | Action::SegmentUnmap if e.size == 0 => return Err(format!("{}: a release of 0 bytes", at())),
            Action::SegmentFree => {
                let end = e.addr.checked_add(e.size).ok_or_else(|| format!("{}: segment ends beyond 2^64", at()))?;
                if segs.range(..end).next_back().is_some_and(|(&a, g)| a + g.size > e.addr) {
                    return Err(format!("{}: the range is in use after it", at()));
                }
                let small = e.size == K_SMALL_BUFFER;
                segs.insert(e.addr, Seg { size: e.size, stream: e.stream, small, pool_id: (0, 0) });
            }
            Action::SegmentMap => {
                if !unmap_range(&mut mapped, e.addr, e.size) {
                    return Err(format!("{}: those pages are not mapped after it", at()));
                }
                if active.any_in(e.addr, e.addr.saturating_add(e.size)) {
                    return Err(format!("{}: blocks in those pages are live before it", at()));
                }
            }
            Action::SegmentUnmap => {
                if !map_range(&mut mapped, e.addr, e.size, e.stream) {
                    return Err(format!("{}: those pages are mapped after it", at()));
                }
            }
            Action::Oom | Action::Snapshot | Action::Annotate => {}
        }
    }
    let mut out = InitialState::default();
    if segs.is_empty() && mapped.is_empty() {
        if let Some(a) = active.blocks.keys().min() {
            return Err(format!("a block at {a:#x} is live at the start outside every segment"));
        }
        return Ok(out);
    }

    // Expandable segments: group mapped ranges into reservations (per stream, within one
    // reservation's span of each other), then find each one's pool and base.
    let span = device_memory.min(1 << 60).saturating_add(device_memory.min(1 << 60) / 8).max(K_SMALL_BUFFER).div_ceil(K_SMALL_BUFFER) * K_SMALL_BUFFER;
    let mut groups: Vec<(u64, Vec<(u64, u64)>)> = Vec::new(); // (stream, ranges)
    for (&s, &(e, stream)) in &mapped {
        match groups.iter_mut().rev().find(|(st, r)| *st == stream && s < r[0].0.saturating_add(span)) {
            Some((_, r)) => r.push((s, e - s)),
            None => groups.push((stream, vec![(s, e - s)])),
        }
    }
    // Each group's extent (lowest, highest address), grown by the trace's maps and unmaps in
    // time order: an event goes to the group whose extent holds it, else to the nearest group of
    // its stream that one reservation could span.
    let mut extent: Vec<(u64, u64)> = groups.iter().map(|(_, r)| (r[0].0, r.last().map_or(r[0].0, |&(s, l)| s + l))).collect();
    let mut lowered: Vec<u64> = extent.iter().map(|e| e.0).collect();
    for e in trace.iter().filter(|e| matches!(e.action, Action::SegmentMap | Action::SegmentUnmap)) {
        let end = e.addr.saturating_add(e.size);
        let inside = (0..groups.len()).find(|&g| groups[g].0 == e.stream && e.addr >= extent[g].0 && e.addr <= extent[g].1);
        let g = inside.or_else(|| {
            (0..groups.len())
                .filter(|&g| groups[g].0 == e.stream && end.saturating_add(span) > extent[g].1 && e.addr < extent[g].0.saturating_add(span))
                .min_by_key(|&g| if e.addr < extent[g].0 { extent[g].0 - e.addr } else { e.addr - extent[g].1 })
        });
        if let Some(g) = g {
            extent[g].0 = extent[g].0.min(e.addr);
            extent[g].1 = extent[g].1.max(end);
            if e.addr < lowered[g] {
                lowered[g] = e.addr;
            }
        }
    }
    let mut pre: Vec<PreSegment> = Vec::new();
    for (gi, (stream, ranges)) in groups.into_iter().enumerate() {
        let lo = ranges[0].0;
        let hi = ranges.last().map(|&(s, l)| s + l).unwrap_or(lo);
        let near = |a: u64| a.saturating_add(span) > hi && a < lo.saturating_add(span);
        let dist = |a: u64| if a < lo { lo - a } else { a.saturating_sub(hi) };
        // Small or large pages: ranges that are not whole large pages are small pages; else the
        // first request served inside; else the nearest final segment of the stream.
        let large_page = config.large_segment_size;
        let odd = ranges.iter().any(|&(s, l)| (s - lo) % large_page != 0 || l % large_page != 0);
        let served = trace
            .iter()
            .find(|e| e.action == Action::Alloc && e.stream == stream && e.addr >= lo && e.addr < hi)
            .map(|e| config.round_size(e.size) <= K_SMALL_SIZE);
        let hint = es_hints.iter().filter(|h| h.1 == stream && near(h.0)).min_by_key(|h| dist(h.0));
        let small = odd || served.or(hint.map(|h| h.2)).unwrap_or(false);
        let pool_id = es_hints.iter().filter(|h| h.1 == stream && h.2 == small && near(h.0)).min_by_key(|h| dist(h.0)).map_or((0, 0), |h| h.3);
        let page = if small { K_SMALL_BUFFER } else { config.large_segment_size };
        let base = if (lo - lowered[gi]).is_multiple_of(page) { lowered[gi] } else { lo };
        let size = ranges.iter().map(|r| r.1).sum();
        pre.push(PreSegment { addr: base, size, stream, small, pool_id, expandable: true, mapped: ranges, blocks: Vec::new() });
    }
    for (&addr, s) in &segs {
        pre.push(PreSegment {
            addr,
            size: s.size,
            stream: s.stream,
            small: s.small,
            pool_id: s.pool_id,
            expandable: false,
            mapped: Vec::new(),
            blocks: Vec::new(),
        });
    }
    pre.sort_by_key(|s| s.addr);

    // Place every active block in its segment (or mapped range) and settle unknown sizes.
    let container = |a: u64| -> Option<(usize, u64)> {
        pre.iter().enumerate().find_map(|(i, s)| {
            if s.expandable {
                s.mapped.iter().find(|&&(m, l)| a >= m && a < m + l).map(|&(m, l)| (i, m + l))
            } else {
                (a >= s.addr && a < s.addr + s.size).then_some((i, s.addr + s.size))
            }
        })
    };
    let list: Vec<(u64, Act)> = active.into_sorted();
    // The first `alloc` at each address: the first allocation in the free block after a block
    // of unknown size starts where that block ends.
    let mut first_alloc: BTreeMap<u64, usize> = BTreeMap::new();
    if list.iter().any(|(_, a)| a.size.is_none()) {
        for (i, e) in trace.iter().enumerate() {
            if e.action == Action::Alloc {
                first_alloc.entry(e.addr).or_insert(i);
            }
        }
    }
    let mut blocks = Vec::with_capacity(list.len());
    let mut owner = Vec::with_capacity(list.len());
    for (k, &(addr, a)) in list.iter().enumerate() {
        let (si, end) = container(addr).ok_or_else(|| format!("a block at {addr:#x} is live at the start outside every segment"))?;
        let next = list.get(k + 1).map(|x| x.0).filter(|&n| n < end).unwrap_or(end);
        let room = next - addr;
        let seg = &pre[si];
        let (size, inferred) = match a.size {
            Some(s) if s <= room => (s, false),
            Some(s) => return Err(format!("the block at {addr:#x} ({s} bytes) overlaps the next one at the start")),
            None => {
                let r = config.round_size(a.requested);
                // Not split when allocated: up to 1 MiB more, or (oversize) up to the rounding limit.
                let slack = if r >= config.max_split_size { config.max_non_split_rounding_size } else { K_SMALL_SIZE };
                let lo = addr.saturating_add(r);
                let hi = addr.saturating_add(r).saturating_add(slack).min(next.saturating_sub(1));
                let seen = if lo <= hi { first_alloc.range(lo..=hi).min_by_key(|x| *x.1).filter(|x| *x.1 < a.freed_at) } else { None };
                let s = if seg.small || seg.expandable {
                    r
                } else if let Some((&g, _)) = seen {
                    g - addr
                } else if room <= r.saturating_add(K_SMALL_SIZE) || (r >= config.max_split_size && room < r.saturating_add(config.max_non_split_rounding_size))
                {
                    room
                } else {
                    r
                };
                (s.min(room).max(K_MIN_BLOCK_SIZE.min(room)), true)
            }
        };
        if size == 0 {
            return Err(format!("the block at {addr:#x} has no room at the start"));
        }
        out.inferred_sizes += inferred as u32;
        owner.push(si);
        let r = config.round_size(a.requested);
        let slack = if seg.small || seg.expandable {
            0
        } else if r >= config.max_split_size {
            config.max_non_split_rounding_size
        } else {
            K_SMALL_SIZE
        };
        blocks.push(PreBlock {
            addr,
            size,
            requested_size: a.requested,
            pending: a.pending,
            size_inferred: inferred,
            freed_at: (a.freed_at != usize::MAX).then_some(a.freed_at as u32),
            room,
            slack,
        });
    }
    for (k, &si) in owner.iter().enumerate() {
        pre[si].blocks.push(k as u32);
    }
    out.segments = pre;
    out.blocks = blocks;
    Ok(out)
}

/// Whether a trace that [`starts_mid_history`] does not flag starts from an empty
/// allocator as far as [`reconstruct`] is concerned, decided entry by entry (for a stream, which
/// cannot be undone backwards): [`EmptyStart::finish`] is true when `reconstruct` can only find an
/// empty state or fail, both of which replay from an empty allocator without a note.
///
/// Undoing the trace leaves a final segment in the initial state only when the trace never
/// `segment_alloc`'d its address (a `segment_free` before any `segment_alloc` of an address is
/// flagged by `starts_mid_history`), and leaves a final mapped page only when the trace never
/// mapped it or unmapped it before mapping it. So it is enough that every final segment's address
/// had a `segment_alloc`, that every final expandable range is mapped at the end by the trace's own
/// maps, and that every unmap unmaps pages the trace had mapped. Otherwise (false) the answer is
/// not known without undoing the trace.
#[derive(Clone, Debug, Default)]
pub struct EmptyStart {
    /// Final (not expandable) segments whose address no `segment_alloc` had yet.
    unseen: IntSet<u64>,
    /// Final expandable ranges: (address, end).
    final_mapped: Vec<(u64, u64)>,
    /// Pages the trace mapped and has not unmapped: start → end (adjacent ranges merged).
    mapped: BTreeMap<u64, u64>,
    /// An unmap of pages the trace had not mapped.
    stray_unmap: bool,
}

impl EmptyStart {
    /// `segments`: the device's final segments.
    pub fn new(segments: &[SnapshotSegment]) -> EmptyStart {
        EmptyStart {
            unseen: segments.iter().filter(|s| !s.is_expandable).map(|s| s.address).collect(),
            final_mapped: segments.iter().filter(|s| s.is_expandable).map(|s| (s.address, s.address.saturating_add(s.total_size))).collect(),
            ..Default::default()
        }
    }

    pub fn push(&mut self, e: &TraceEntry) {
        let end = e.addr.saturating_add(e.size);
        match e.action {
            Action::SegmentAlloc => {
                self.unseen.remove(&e.addr);
            }
            Action::SegmentMap => {
                let (mut start, mut stop) = (e.addr, end);
                if let Some((&s, &t)) = self.mapped.range(..=start).next_back()
                    && t >= start
                {
                    self.mapped.remove(&s);
                    start = s;
                    stop = stop.max(t);
                }
                while let Some((&s, &t)) = self.mapped.range(start..=stop).next() {
                    self.mapped.remove(&s);
                    stop = stop.max(t);
                }
                self.mapped.insert(start, stop);
            }
            Action::SegmentUnmap => match self.mapped.range(..=e.addr).next_back().map(|(&s, &t)| (s, t)) {
                Some((s, t)) if t >= end => {
                    self.mapped.remove(&s);
                    if s < e.addr {
                        self.mapped.insert(s, e.addr);
                    }
                    if end < t {
                        self.mapped.insert(end, t);
                    }
                }
                _ => self.stray_unmap = true,
            },
            _ => {}
        }
    }

    /// After the last entry: true when `reconstruct` would find an empty state or fail.
    pub fn finish(&self) -> bool {
        let covered = |&(a, b): &(u64, u64)| self.mapped.range(..=a).next_back().is_some_and(|(_, &t)| t >= b);
        self.unseen.is_empty() && !self.stray_unmap && self.final_mapped.iter().all(covered)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `LiveBlocks` answers as an ordered map of the same blocks would, over insertions and
    /// removals at addresses that share granules, and ranges whole, partial and wide.
    #[test]
    fn live_blocks_find_a_block_in_a_range_as_an_ordered_map_does() {
        const MIB: u64 = 1 << 20;
        let act = Act { size: None, requested: 512, pending: false, freed_at: 0 };
        let (mut live, mut reference) = (LiveBlocks::default(), BTreeMap::new());
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..20_000 {
            let addr = (1 << 40) + (next() % 64) * MIB + (next() % 4) * 512;
            if next() % 2 == 0 {
                live.insert(addr, act);
                reference.insert(addr, act);
            } else {
                assert_eq!(live.remove(addr).is_some(), reference.remove(&addr).is_some());
            }
            let start = (1 << 40) + (next() % 70) * MIB - if next() % 3 == 0 { 512 } else { 0 };
            let len = [2 * MIB, 20 * MIB, 64 * MIB, 3 * MIB / 2][(next() % 4) as usize];
            assert_eq!(live.any_in(start, start + len), reference.range(start..start + len).next().is_some(), "{start:#x}+{len:#x}");
        }
        assert_eq!(live.into_sorted().iter().map(|p| p.0).collect::<Vec<_>>(), reference.keys().copied().collect::<Vec<_>>());
    }
}
