//! Whether a trace ran under settings other than those its snapshot records. A snapshot keeps
//! only the last settings: `allocator_settings` is read when it is taken, so a job that called
//! `torch.cuda.memory._set_allocator_settings` or `set_per_process_memory_fraction` during the
//! recording is replayed under the last ones throughout, and a replay that is not exact may owe
//! that to the change alone. What the trace itself shows of other settings (each a rule of the
//! allocator that the recorded settings cannot have made):
//!
//! * **Expandable segments.** Pages mapped (`segment_map`) under settings without expandable
//!   segments; or `cudaMalloc`'d segments (`segment_alloc`) under settings with them, which only a
//!   MemPool with its own allocator also makes (`is_expandable_segments_active` is false there).
//! * **Segment sizes.** A request's new segment (the `segment_alloc` right before its `alloc`, at
//!   its address) is `get_allocation_size(round_size(size))`: 2 MiB, `large_segment_size_mb`, or
//!   the rounded size in 2 MiB steps. Another size means other rounding or another
//!   `large_segment_size_mb`.
//! * **Rounding.** A live block takes at least `round_size` of its request: a later block that
//!   starts inside that span means the earlier one was rounded less (another
//!   `roundup_power2_divisions`).
//! * **Expandable growth.** A request that maps pages at the top of an expandable segment
//!   (`segment_map`s right before its `alloc`, where the mapped range ends) takes the free block
//!   at the segment's top with them: it starts where the highest live block below ends. A request
//!   that starts well above that end means the block below took more than `round_size` of its
//!   request: it was rounded more (another `roundup_power2_divisions`).
//! * **The allowed maximum.** Its OOMs allow less than the segments the trace got need
//!   ([`crate::budget::Budget::bounds_contradict`]).
//! * **Recorded values** that differ from what the last settings string gives
//!   ([`crate::run::settings_in_force`]'s note): a string set at run time.

use std::collections::BTreeMap;

use allocsim_model::AllocatorConfig;
use allocsim_model::constants::K_MIN_BLOCK_SIZE;
use allocsim_model::format::format_size;
use allocsim_trace::{Action, TraceEntry};

use allocsim_model::allocator::Route;

use crate::budget::Budget;
use crate::program::Program;

/// At most this many facts of each kind are reported.
const MAX_PER_KIND: usize = 1;

/// A trace whose own replay, under its recorded settings and the budget inferred from it, does not
/// make its recorded segment events and OOMs ([`Budget::recording_not_reproduced`]): every answer
/// about it rests on a replay that is not the recording, and says so.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct NotReproduced {
    /// What the trace shows of other settings in force for part of the run ([`evidence`]; empty:
    /// nothing shows it, and the model may miss a rule).
    pub settings_changed: Vec<String>,
}

impl NotReproduced {
    /// The fact in words, as every command prints it.
    pub const SUMMARY: &'static str =
        "the replay under the trace's own settings does not make every recorded segment event and OOM (`allocsim validate` says where)";
    /// The heading of [`NotReproduced::settings_changed`].
    pub const SETTINGS_CHANGED: &'static str = "likely during the run (a snapshot records only the last ones, and the replay runs under those throughout)";
}

/// Whether the trace's own replay is not the recording ([`Budget::recording_not_reproduced`]:
/// the trace records a segment event or an OOM, and the budget was not given), with what it
/// shows of why; `rules`: the release its replays follow, and how its settings were read.
pub fn not_reproduced(trace: &[TraceEntry], program: &Program, own: &AllocatorConfig, budget: &Budget, rules: &crate::version::Rules) -> Option<NotReproduced> {
    let records_any = || trace.iter().any(|e| e.action.is_segment_event() || e.action == Action::Oom);
    budget
        .recording_not_reproduced(records_any)
        .then(|| NotReproduced { settings_changed: evidence(trace, program, own, budget, rules.settings_note.as_deref()) })
}

/// What the trace shows of settings other than `own` (the recorded ones) having been in force
/// for part of the run, with the budget the replay inferred; `settings_note`: how the recorded
/// settings were read (a string changed at run time). Empty: nothing shows it.
pub fn evidence(trace: &[TraceEntry], program: &Program, own: &AllocatorConfig, budget: &Budget, settings_note: Option<&str>) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(note) = settings_note.filter(|n| n.contains("changed at run time")) {
        out.push(note.to_string());
    }
    let maps = trace.iter().filter(|e| e.action == Action::SegmentMap).count();
    let mallocs = trace.iter().filter(|e| e.action == Action::SegmentAlloc).count();
    if !own.expandable_segments && maps > 0 {
        out.push(format!("the trace maps {maps} expandable-segment pages, but the recorded settings have expandable_segments:False"));
    }
    if own.expandable_segments && mallocs > 0 {
        out.push(format!(
            "the trace cudaMallocs {mallocs} segments, but the recorded settings have expandable_segments:True (only a MemPool with its own allocator does that)"
        ));
    }
    out.extend(segment_sizes(trace, own).into_iter().take(MAX_PER_KIND));
    out.extend(rounding(trace, own).into_iter().take(MAX_PER_KIND));
    out.extend(expandable_growth(trace, program, own).into_iter().take(MAX_PER_KIND));
    if let Some((need, allowed)) = budget.bounds_contradict {
        out.push(format!(
            "the segments the trace got need at least {} allowed, more than its OOMs allow ({}): the allowed maximum (set_per_process_memory_fraction) changed during the run",
            format_size(need),
            format_size(allowed)
        ));
    }
    out
}

/// Requests whose new `cudaMalloc`'d segment has another size than the recorded settings make.
fn segment_sizes(trace: &[TraceEntry], own: &AllocatorConfig) -> Vec<String> {
    let mut out = Vec::new();
    let mut req = 0u32;
    let mut last_segment: Option<(u64, u64)> = None;
    for e in trace {
        match e.action {
            Action::SegmentAlloc => last_segment = Some((e.addr, e.size)),
            Action::FreeCompleted => {}
            Action::Alloc => {
                if let Some((addr, seg)) = last_segment.take()
                    && addr == e.addr
                {
                    let want = own.get_allocation_size(own.round_size(e.size));
                    if seg != want {
                        out.push(format!("request {req} ({} bytes) got a new segment of {seg} bytes; the recorded settings make {want}", e.size));
                    }
                }
                req += 1;
            }
            Action::Oom => {
                last_segment = None;
                req += 1;
            }
            _ => last_segment = None,
        }
    }
    out
}

/// Blocks placed inside the span the recorded settings round a live block to.
fn rounding(trace: &[TraceEntry], own: &AllocatorConfig) -> Vec<String> {
    let mut out = Vec::new();
    // Live blocks: address → (request, requested size).
    let mut live: BTreeMap<u64, (u32, u64)> = BTreeMap::new();
    let mut req = 0u32;
    for e in trace {
        match e.action {
            Action::Alloc => {
                if let Some((&a, &(q, size))) = live.range(..e.addr).next_back() {
                    let rounded = own.round_size(size);
                    if e.addr < a.saturating_add(rounded) {
                        out.push(format!(
                            "request {req} starts {} bytes into request {q}'s block ({size} bytes), which the recorded settings round to {rounded}",
                            e.addr - a
                        ));
                    }
                }
                live.insert(e.addr, (req, e.size));
                req += 1;
            }
            Action::Oom => req += 1,
            Action::FreeCompleted => {
                live.remove(&e.addr);
            }
            _ => {}
        }
    }
    out
}

/// Requests that grew an expandable segment but start above the end of the highest live block
/// below them, as the recorded settings round it (see the module documentation). Blocks of
/// private pools are left out: a `MemPool(no_split=True)` block takes its whole mapping.
fn expandable_growth(trace: &[TraceEntry], program: &Program, own: &AllocatorConfig) -> Vec<String> {
    let mut out = Vec::new();
    // Mapped ranges: start → end, contiguous ranges merged.
    let mut mapped: BTreeMap<u64, u64> = BTreeMap::new();
    // Live blocks: address → (request, requested size).
    let mut live: BTreeMap<u64, (u32, u64)> = BTreeMap::new();
    let mut req = 0u32;
    // The segment's mapped start and the grown range's start, for the maps before an alloc.
    let mut grown: Option<(u64, u64)> = None;
    for e in trace {
        match e.action {
            Action::SegmentMap => {
                let end = e.addr.saturating_add(e.size);
                let below = mapped.range(..=e.addr).next_back().map(|(&lo, &hi)| (lo, hi)).filter(|&(_, hi)| hi == e.addr);
                let lo = match below {
                    Some((lo, _)) => lo,
                    None => e.addr,
                };
                let hi = match mapped.remove(&end) {
                    Some(hi) => hi,
                    None => end,
                };
                mapped.insert(lo, hi);
                if grown.is_none() {
                    grown = Some((lo, e.addr));
                }
            }
            Action::SegmentUnmap => {
                let end = e.addr.saturating_add(e.size);
                if let Some((&lo, &hi)) = mapped.range(..=e.addr).next_back()
                    && hi >= end
                {
                    mapped.remove(&lo);
                    if lo < e.addr {
                        mapped.insert(lo, e.addr);
                    }
                    if end < hi {
                        mapped.insert(end, hi);
                    }
                }
                grown = None;
            }
            Action::Alloc => {
                if let Some((lo, top)) = grown.take()
                    && lo < top
                    && e.addr <= top
                    && let Some((&a, &(q, size))) = live.range(lo..top).next_back()
                    && program.requests.get(q as usize).is_some_and(|r| r.route == Route::Default)
                {
                    let rounded = own.round_size(size);
                    let end = a.saturating_add(rounded);
                    if e.addr >= end.saturating_add(K_MIN_BLOCK_SIZE) {
                        out.push(format!(
                            "request {req} grew an expandable segment from {} bytes above the end of request {q}'s block ({size} bytes, which the recorded settings round to {rounded}): that block took {} bytes, rounded more than the recorded settings round",
                            e.addr - end,
                            e.addr - a
                        ));
                    }
                }
                grown = None;
                live.insert(e.addr, (req, e.size));
                req += 1;
            }
            Action::Oom => {
                grown = None;
                req += 1;
            }
            Action::FreeCompleted => {
                live.remove(&e.addr);
            }
            Action::FreeRequested => {}
            _ => grown = None,
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use allocsim_model::constants::MIB;

    fn e(action: Action, addr: u64, size: u64) -> TraceEntry {
        TraceEntry { action, addr, size, stream: 0, time_us: 0, stack: 0, meta: 0 }
    }

    /// Constructed from the rules: a job that ran with `roundup_power2_divisions:4` at first (a
    /// 17 MiB request rounded to 20 MiB, its segment 20 MiB) and later without: under the
    /// recorded settings (none) that segment would be 18 MiB. And a block that starts 1 MiB into
    /// a live 1.5 MiB one, which no rounding of the recorded settings allows.
    #[test]
    fn rounding_and_segment_sizes_other_settings_make() {
        let own = AllocatorConfig::default();
        let base = 1 << 32;
        // A 17 MiB request gets an 18 MiB segment (2 MiB steps); under
        // roundup_power2_divisions:4 it is rounded to 20 MiB first.
        let trace = [
            e(Action::SegmentAlloc, base, 20 * MIB),
            e(Action::Alloc, base, 17 * MIB),
            e(Action::SegmentAlloc, base + (64 << 20), 20 * MIB),
            e(Action::Alloc, base + (64 << 20), 3 * MIB / 2),
            e(Action::Alloc, base + (64 << 20) + MIB, MIB + 1),
        ];
        let ev = evidence(&trace, &Program::default(), &own, &Budget::none(crate::budget::DeviceMemory::given(1 << 40)), None);
        assert_eq!(ev.len(), 2, "{ev:?}");
        assert!(ev[0].contains("request 0 (17825792 bytes) got a new segment of 20971520 bytes; the recorded settings make 18874368"), "{ev:?}");
        assert!(ev[1].contains("request 2 starts 1048576 bytes into request 1's block"), "{ev:?}");
        // Under the settings that made it, nothing shows.
        let rpd = AllocatorConfig::parse("roundup_power2_divisions:4").unwrap();
        let trace = &trace[..2];
        assert!(evidence(trace, &Program::default(), &rpd, &Budget::none(crate::budget::DeviceMemory::given(1 << 40)), None).is_empty());
    }

    /// Constructed from the rules of expandable segments (large pages of 20 MiB): a request that
    /// maps pages takes the free block at the segment's top, which starts where the highest live
    /// block ends. Request 1's 84 MiB block took 96 MiB (`roundup_power2_divisions:4`), so request
    /// 2 starts 12 MiB above where the recorded settings (none) end it. A private pool's block is
    /// not read (a `no_split` pool's takes its whole mapping).
    #[test]
    fn expandable_growth_above_the_rounded_end() {
        let own = AllocatorConfig { expandable_segments: true, ..AllocatorConfig::default() };
        let b = 1u64 << 36;
        let trace = [
            e(Action::SegmentMap, b, 100 * MIB),
            e(Action::Alloc, b, 84 * MIB),
            e(Action::SegmentMap, b + 100 * MIB, 80 * MIB),
            e(Action::Alloc, b + 84 * MIB, 84 * MIB),
            e(Action::SegmentMap, b + 180 * MIB, 100 * MIB),
            e(Action::Alloc, b + 180 * MIB, 84 * MIB),
        ];
        let budget = Budget::none(crate::budget::DeviceMemory::given(1 << 40));
        let mut program = crate::restore::build_program_default(&trace, &[]);
        let ev = evidence(&trace, &program, &own, &budget, None);
        assert_eq!(ev.len(), 1, "{ev:?}");
        assert!(ev[0].starts_with("request 2 grew an expandable segment from 12582912 bytes above the end of request 1's block (88080384 bytes"), "{ev:?}");
        // Under the settings that made it (every block rounded to 96 MiB), nothing shows.
        let rpd = AllocatorConfig { expandable_segments: true, ..AllocatorConfig::parse("roundup_power2_divisions:4").unwrap() };
        let made = [
            e(Action::SegmentMap, b, 100 * MIB),
            e(Action::Alloc, b, 84 * MIB),
            e(Action::SegmentMap, b + 100 * MIB, 100 * MIB),
            e(Action::Alloc, b + 96 * MIB, 84 * MIB),
            e(Action::SegmentMap, b + 200 * MIB, 80 * MIB),
            e(Action::Alloc, b + 192 * MIB, 84 * MIB),
        ];
        assert!(evidence(&made, &crate::restore::build_program_default(&made, &[]), &rpd, &budget, None).is_empty());
        // The same blocks under no rounding: request 1 starts 12 MiB above request 0's end.
        let ev = evidence(&made, &crate::restore::build_program_default(&made, &[]), &own, &budget, None);
        assert!(ev.iter().any(|x| x.starts_with("request 1 grew an expandable segment from 12582912 bytes above")), "{ev:?}");
        // A private pool's block is left out.
        program.requests[1].route = allocsim_model::allocator::Route::Private((0, 1));
        assert!(evidence(&trace, &program, &own, &budget, None).is_empty());
    }
}
