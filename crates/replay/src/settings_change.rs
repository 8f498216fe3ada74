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
//! * **The allowed maximum.** Its OOMs allow less than the segments the trace got need
//!   ([`crate::budget::Budget::bounds_contradict`]).
//! * **Recorded values** that differ from what the last settings string gives
//!   ([`crate::run::settings_in_force`]'s note): a string set at run time.

use std::collections::BTreeMap;

use allocsim_model::AllocatorConfig;
use allocsim_model::format::format_size;
use allocsim_trace::{Action, TraceEntry};

use crate::budget::Budget;

/// At most this many facts of each kind are reported.
const MAX_PER_KIND: usize = 1;

/// What the trace shows of settings other than `own` (the recorded ones) having been in force
/// for part of the run, with the budget the replay inferred; `settings_note`: how the recorded
/// settings were read (a string changed at run time). Empty: nothing shows it.
pub fn evidence(trace: &[TraceEntry], own: &AllocatorConfig, budget: &Budget, settings_note: Option<&str>) -> Vec<String> {
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
        let ev = evidence(&trace, &own, &Budget::none(crate::budget::DeviceMemory::given(1 << 40)), None);
        assert_eq!(ev.len(), 2, "{ev:?}");
        assert!(ev[0].contains("request 0 (17825792 bytes) got a new segment of 20971520 bytes; the recorded settings make 18874368"), "{ev:?}");
        assert!(ev[1].contains("request 2 starts 1048576 bytes into request 1's block"), "{ev:?}");
        // Under the settings that made it, nothing shows.
        let rpd = AllocatorConfig::parse("roundup_power2_divisions:4").unwrap();
        let trace = &trace[..2];
        assert!(evidence(trace, &rpd, &Budget::none(crate::budget::DeviceMemory::given(1 << 40)), None).is_empty());
    }
}
