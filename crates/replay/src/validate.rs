//! Checks a replay under the trace's own settings against what the trace recorded: every segment
//! event (in order, with its request), every OOM, every allocation's address, and the final
//! segments with their blocks.

use allocsim_trace::BlockState;

use crate::budget::RecordedEvent;
use crate::run::Replayed;

/// How much of one kind of recorded fact the replay reproduced.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Agreement {
    pub recorded: usize,
    pub simulated: usize,
    pub matched: usize,
    pub first_divergence: Option<String>,
}

impl Agreement {
    pub fn exact(&self) -> bool {
        self.first_divergence.is_none()
    }
}

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Validation {
    pub exact: bool,
    pub segment_events: Agreement,
    pub ooms: Agreement,
    pub alloc_addresses: Agreement,
    pub final_segments: Agreement,
    /// Where the replay is not exact: what the trace shows of settings other than the recorded
    /// ones in force for part of the run (`crate::settings_change`; a snapshot keeps only the
    /// last settings).
    pub settings_changed: Vec<String>,
    /// What the trace itself contradicts (a free of an address it never allocated, a block freed
    /// twice, a start that cannot be reconstructed): a replay of an inconsistent trace is never
    /// exact, whatever its counts.
    pub findings: Vec<String>,
}

pub fn validate(r: &Replayed) -> Validation {
    let o = &r.outcome;
    let (recorded, recorded_ooms) = crate::budget::recorded_events(&r.trace);
    let sim: Vec<_> = o.segment_events.iter().map(|e| (e.request, e.action, e.addr, e.size)).collect();
    let show = |x: Option<&RecordedEvent>| x.map_or("nothing".to_string(), |x| format!("{} of {} bytes at {:#x} (request {})", x.1, x.3, x.2, x.0));
    let matched = recorded.iter().zip(&sim).take_while(|(a, b)| a == b).count();
    let segment_events = Agreement {
        recorded: recorded.len(),
        simulated: sim.len(),
        matched,
        first_divergence: (recorded != sim).then(|| {
            let (a, b) = (recorded.get(matched), sim.get(matched));
            let which = match (a, b) {
                (Some(a), Some(b)) => {
                    let mut f = Vec::new();
                    if a.1 != b.1 {
                        f.push("action");
                    }
                    if a.3 != b.3 {
                        f.push("size");
                    }
                    if a.2 != b.2 {
                        f.push("address");
                    }
                    if a.0 != b.0 {
                        f.push("request");
                    }
                    let last = f.pop().unwrap_or("fields");
                    if f.is_empty() { format!("differs in its {last}: ") } else { format!("differs in its {} and {last}: ", f.join(", ")) }
                }
                (Some(_), None) => "was not made by the replay: ".to_string(),
                _ => "was made by the replay only: ".to_string(),
            };
            format!("event {matched} {which}recorded {}, simulated {}", show(a), show(b))
        }),
    };
    let sim_ooms: Vec<u32> = o.ooms.iter().map(|x| x.request).collect();
    let ooms = Agreement {
        recorded: recorded_ooms.len(),
        simulated: sim_ooms.len(),
        matched: recorded_ooms.iter().filter(|x| sim_ooms.contains(x)).count(),
        first_divergence: (recorded_ooms != sim_ooms).then(|| format!("recorded OOMs at requests {recorded_ooms:?}, simulated at {sim_ooms:?}")),
    };
    let mut alloc_addresses = Agreement::default();
    for (i, q) in r.program.requests.iter().enumerate().filter(|(_, q)| !q.recorded_oom) {
        alloc_addresses.recorded += 1;
        if o.addresses[i].is_some() {
            alloc_addresses.simulated += 1;
        }
        if o.addresses[i] == Some(q.recorded_addr) {
            alloc_addresses.matched += 1;
        } else if alloc_addresses.first_divergence.is_none() {
            alloc_addresses.first_divergence =
                Some(format!("request {i}: recorded {:#x}, simulated {}", q.recorded_addr, o.addresses[i].map_or("OOM".into(), |a| format!("{a:#x}"))));
        }
    }
    let final_segments = compare_final_segments(r);
    let findings = findings(r);
    let exact = segment_events.exact() && ooms.exact() && alloc_addresses.exact() && final_segments.exact() && findings.is_empty();
    let settings_changed = if exact { Vec::new() } else { r.settings_change_evidence() };
    Validation { exact, settings_changed, findings, segment_events, ooms, alloc_addresses, final_segments }
}

/// What the trace contradicts, as the replay's program found it: its start could not be
/// reconstructed from the final segments, or it frees blocks that neither it nor the final
/// segments allocated (ignored by the replay, so the counts alone would not show them).
fn findings(r: &Replayed) -> Vec<String> {
    let mut v = Vec::new();
    if let Some(e) = &r.program.reconstruct_error {
        v.push(format!("the state at the trace's start cannot be reconstructed from its final segments ({e})"));
    }
    let n = r.program.unknown_frees;
    if n > 0 {
        v.push(format!(
            "{n} free{} of blocks that neither the trace nor its final segments allocated (freed twice, or never allocated) {} ignored",
            if n == 1 { "" } else { "s" },
            if n == 1 { "was" } else { "were" }
        ));
    }
    v
}

type SegmentShape = (u64, u64, Vec<(u64, BlockState)>);

/// The snapshot's final segments (address, size, each block's size and state) against the model's.
fn compare_final_segments(r: &Replayed) -> Agreement {
    let a = &r.outcome.allocator;
    let sim: Vec<SegmentShape> = a
        .segments()
        .into_iter()
        .map(|s| {
            let blocks = s
                .blocks
                .iter()
                .map(|&id| {
                    let b = a.block(id);
                    (b.size, crate::live::block_state(b))
                })
                .collect();
            (s.address, s.total_size, blocks)
        })
        .collect();
    let rec: Vec<SegmentShape> = r.segments.iter().map(|s| (s.address, s.total_size, s.blocks.iter().map(|b| (b.size, b.state)).collect())).collect();
    let show = |s: Option<&SegmentShape>| s.map_or("none".to_string(), |s| format!("{:#x} ({} bytes, {} blocks)", s.0, s.1, s.2.len()));
    // Each simulated segment matches one recorded segment at most, so that `matched` counts what
    // was reproduced and is below `recorded` (or `simulated`) whenever they differ.
    let mut used = vec![false; sim.len()];
    let mut matched = 0;
    for x in &rec {
        if let Some(k) = (0..sim.len()).find(|&k| !used[k] && sim[k] == *x) {
            used[k] = true;
            matched += 1;
        }
    }
    let i = rec.iter().zip(&sim).take_while(|(x, y)| x == y).count();
    let reproduced = matched == rec.len() && matched == sim.len();
    Agreement {
        recorded: rec.len(),
        simulated: sim.len(),
        matched,
        first_divergence: (rec != sim).then(|| match (rec.get(i), sim.get(i)) {
            // The same segments in another order (the snapshot lists them as PyTorch iterates).
            _ if reproduced => format!("segment {i}: the same segments, in another order: recorded {}, simulated {}", show(rec.get(i)), show(sim.get(i))),
            (Some(x), Some(y)) => format!("segment {i}: {}", segment_difference(x, y)),
            (x, y) => format!("segment {i}: recorded {}, simulated {}", show(x), show(y)),
        }),
    }
}

fn state_name(s: BlockState) -> &'static str {
    match s {
        BlockState::ActiveAllocated => "active_allocated",
        BlockState::ActivePendingFree => "active_pending_free",
        BlockState::Inactive => "inactive",
    }
}

/// Which field of a final segment differs between the recording (`x`) and the replay (`y`).
fn segment_difference(x: &SegmentShape, y: &SegmentShape) -> String {
    if x.0 != y.0 {
        return format!("the address differs: recorded {:#x} ({} bytes), simulated {:#x} ({} bytes)", x.0, x.1, y.0, y.1);
    }
    if x.1 != y.1 {
        return format!("at {:#x} the size differs: recorded {} bytes, simulated {} bytes", x.0, x.1, y.1);
    }
    let k = x.2.iter().zip(&y.2).take_while(|(a, b)| a == b).count();
    match (x.2.get(k), y.2.get(k)) {
        (Some(a), Some(b)) if a.0 != b.0 => format!(
            "at {:#x} ({} bytes) block {k}'s size differs: recorded {} bytes ({}), simulated {} bytes ({})",
            x.0,
            x.1,
            a.0,
            state_name(a.1),
            b.0,
            state_name(b.1)
        ),
        (Some(a), Some(b)) => {
            format!("at {:#x} ({} bytes) block {k} ({} bytes)'s state differs: recorded {}, simulated {}", x.0, x.1, a.0, state_name(a.1), state_name(b.1))
        }
        _ => format!("at {:#x} ({} bytes) the number of blocks differs: recorded {}, simulated {}", x.0, x.1, x.2.len(), y.2.len()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_segment_difference_names_the_field() {
        use BlockState::*;
        let rec: SegmentShape = (0x1000, 4 << 20, vec![(1 << 20, ActiveAllocated), (3 << 20, Inactive)]);
        let state = (0x1000, 4 << 20, vec![(1 << 20, Inactive), (3 << 20, Inactive)]);
        assert_eq!(
            segment_difference(&rec, &state),
            "at 0x1000 (4194304 bytes) block 0 (1048576 bytes)'s state differs: recorded active_allocated, simulated inactive"
        );
        let size = (0x1000, 4 << 20, vec![(2 << 20, ActiveAllocated), (2 << 20, Inactive)]);
        assert!(segment_difference(&rec, &size).contains("block 0's size differs: recorded 1048576 bytes (active_allocated), simulated 2097152 bytes"));
        let count = (0x1000, 4 << 20, vec![(1 << 20, ActiveAllocated), (3 << 20, Inactive), (0, Inactive)]);
        assert!(segment_difference(&rec, &count).contains("the number of blocks differs: recorded 2, simulated 3"));
        assert!(segment_difference(&rec, &(0x2000, 4 << 20, vec![])).starts_with("the address differs"));
        assert!(segment_difference(&rec, &(0x1000, 2 << 20, vec![])).contains("the size differs"));
    }
}
