//! `allocsim sweep`: one trace, every config of a grid, every placement; outcomes ranked.

use allocsim_model::AllocatorConfig;
use allocsim_model::constants::ROUNDUP_INTERVALS;
use allocsim_model::{Device, Placement, SimDevice};
use allocsim_replay::run::Limits;
use allocsim_replay::{Prepared, ReplayOutcome};
use rayon::prelude::*;
use std::collections::HashMap;
use std::sync::Arc;

use crate::cost::device_call_us;
use crate::grid::GridPoint;

/// What one replay came to.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Outcome {
    pub placement: String,
    /// The first request that ran out of memory.
    pub first_oom: Option<u32>,
    pub ooms: usize,
    pub peak_reserved: u64,
    /// The request during which reserved memory first reached `peak_reserved`.
    pub peak_reserved_request: Option<u32>,
    pub peak_allocated: u64,
    pub num_alloc_retries: i64,
    pub num_sync_all_streams: i64,
    pub num_device_alloc: i64,
    pub num_device_free: i64,
    /// Estimated time in cudaMalloc/cudaFree/map/unmap calls (see `cost`).
    pub device_call_us: f64,
    /// At the first OOM, how many bytes more the allocator needed: the segment it asked for less
    /// what the allowed maximum (or the device) still had room for.
    pub first_oom_shortfall: Option<u64>,
    /// Not replayed separately: this config cannot behave differently from the named one on this
    /// trace (see [`sweep_with`]), so this is that config's outcome.
    pub same_as: Option<String>,
}

impl Outcome {
    pub fn of(placement: &str, o: &ReplayOutcome, large_page: u64) -> Outcome {
        let s = &o.stats;
        Outcome {
            placement: placement.to_string(),
            first_oom: o.first_oom(),
            ooms: o.ooms.len(),
            peak_reserved: s.reserved_bytes.all().peak as u64,
            peak_reserved_request: o.peak_reserved_request(),
            peak_allocated: s.allocated_bytes.all().peak as u64,
            num_alloc_retries: s.num_alloc_retries,
            num_sync_all_streams: s.num_sync_all_streams,
            num_device_alloc: s.num_device_alloc,
            num_device_free: s.num_device_free,
            device_call_us: device_call_us(&o.segment_events, large_page),
            first_oom_shortfall: o.ooms.first().map(|x| {
                let i = &x.info;
                let room = match i.allowed_memory_maximum {
                    Some(a) => a.saturating_sub(i.reserved_bytes).min(i.device_free),
                    None => i.device_free,
                };
                i.alloc_size.saturating_sub(room)
            }),
            same_as: None,
        }
    }
}

/// One config of the grid and its outcomes across placements.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Row {
    pub conf: String,
    /// PyTorch would refuse this config (its message).
    pub rejected: Option<String>,
    /// Expandable segments: the outcome does not depend on placement (replayed once).
    pub placement_independent: bool,
    pub outcomes: Vec<Outcome>,
}

impl Row {
    pub fn placements_with_oom(&self) -> usize {
        self.outcomes.iter().filter(|o| o.first_oom.is_some()).count()
    }
    /// (min, max) of peak reserved across placements.
    pub fn peak_reserved_range(&self) -> Option<(u64, u64)> {
        let v = self.outcomes.iter().map(|o| o.peak_reserved);
        Some((v.clone().min()?, v.max()?))
    }
    /// (earliest, latest) first OOM across placements; `None` inside = no OOM there.
    pub fn first_oom_range(&self) -> (Option<u32>, Option<u32>) {
        let key = |o: &&Outcome| o.first_oom.map_or(u64::MAX, |x| x as u64);
        let lo = self.outcomes.iter().min_by_key(key).and_then(|o| o.first_oom);
        let hi = self.outcomes.iter().max_by_key(key).and_then(|o| o.first_oom);
        (lo, hi)
    }
    pub fn worst(&self) -> Option<&Outcome> {
        self.outcomes.iter().max_by_key(|o| (o.first_oom.is_some(), u64::MAX - o.first_oom.unwrap_or(0) as u64, o.peak_reserved))
    }
    /// Sort key: fewer placements with OOM, then later first OOM, then lower worst peak reserved,
    /// then fewer device calls.
    fn rank_key(&self) -> (bool, usize, u64, u64, u64) {
        let worst_first_oom = self.outcomes.iter().map(|o| o.first_oom.map_or(u32::MAX, |x| x)).min().unwrap_or(u32::MAX);
        let peak = self.peak_reserved_range().map_or(u64::MAX, |r| r.1);
        let calls = self.outcomes.iter().map(|o| o.device_call_us as u64).max().unwrap_or(0);
        (self.rejected.is_some(), self.placements_with_oom(), u64::MAX - worst_first_oom as u64, peak, calls)
    }
}

/// Replays `prepared` under every valid point of the grid and every placement, in parallel, under
/// `limits` ([`Prepared::limits`]), and returns the rows ranked best first (rejected configs last). `progress` is called once per
/// finished (or shared, see [`sweep_with`]) replay.
pub fn sweep(prepared: &Prepared, points: &[GridPoint], limits: &Limits, placements: usize, progress: &(dyn Fn() + Sync)) -> Vec<Row> {
    sweep_with(prepared, points, limits, placements, true, progress)
}

/// What a base replay tells about settings it did not have (see [`inert`]).
#[derive(Clone, Debug)]
struct Replay {
    outcome: Outcome,
    largest_size_seen: u64,
    peak_total_at_cache_miss: u64,
    allowed: Option<u64>,
    /// The device calls it made, in order: (cudaMalloc or cudaFree, address, size); `None` if it
    /// mapped or unmapped pages (expandable segments).
    calls: Option<Arc<Vec<(bool, u64, u64)>>>,
}

/// Whether a replay whose device calls were `calls` would make exactly the same decisions on a
/// device with `placement`. The allocator looks at addresses only to order free blocks of equal
/// size, and blocks of different segments order as their segments do; so if the other device,
/// given the same cudaMalloc/cudaFree calls, puts every new segment at the same rank among the
/// live segments (and never fails), every decision, and so the outcome, is the same. Checked by
/// feeding the calls to a simulated device of that placement: cheap, one step per segment.
fn same_order(calls: &[(bool, u64, u64)], device_memory: u64, placement: &Placement) -> bool {
    let mut dev = SimDevice::new(device_memory, placement.clone());
    let (mut a_live, mut b_live): (Vec<u64>, Vec<u64>) = (Vec::new(), Vec::new());
    let mut to_b: HashMap<u64, u64> = HashMap::new();
    for &(malloc, addr, size) in calls {
        if malloc {
            let Some(b) = dev.malloc(size) else { return false };
            let (ra, rb) = (a_live.partition_point(|&x| x < addr), b_live.partition_point(|&x| x < b));
            if ra != rb {
                return false;
            }
            a_live.insert(ra, addr);
            b_live.insert(rb, b);
            to_b.insert(addr, b);
        } else {
            let Some(b) = to_b.remove(&addr) else { return false };
            dev.free(b, size);
            a_live.retain(|&x| x != addr);
            b_live.retain(|&x| x != b);
        }
    }
    true
}

/// Whether `config`'s `max_split_size` would have changed nothing in `base`, a replay under the
/// same settings without it: no rounded request, block or segment reached it, so no rule that
/// compares a size with it could fire. Then replaying `config` gives `base`'s outcome exactly.
fn split_inert(config: &AllocatorConfig, base: &Replay) -> bool {
    base.largest_size_seen < config.max_split_size
}

/// Whether `config`'s `garbage_collection_threshold` would have changed nothing in `base`, a
/// replay under the same settings without it: `total_allocated_memory` never exceeded the
/// threshold at a cache miss, so `garbage_collect_cached_blocks` would have returned at once
/// every time (or there is no allowed maximum, and GC never runs).
fn gc_inert(config: &AllocatorConfig, base: &Replay) -> bool {
    match base.allowed {
        Some(allowed) => base.peak_total_at_cache_miss <= (config.garbage_collection_threshold * allowed as f64) as u64,
        None => true,
    }
}

/// `roundup_power2_divisions` only changes `round_size`: settings that round every request of the
/// trace alike are one setting here. Maps each setting to the first one (in `all`'s order) that
/// rounds `sizes` as it does.
fn rounding_classes(all: &[[u64; ROUNDUP_INTERVALS]], sizes: &[u64]) -> Vec<[u64; ROUNDUP_INTERVALS]> {
    let mut reps: Vec<([u64; ROUNDUP_INTERVALS], Vec<u64>)> = Vec::new();
    all.iter()
        .map(|divs| {
            let c = AllocatorConfig { roundup_power2_divisions: *divs, ..AllocatorConfig::default() };
            let rounded: Vec<u64> = sizes.iter().map(|&s| c.round_size(s)).collect();
            match reps.iter().find(|(_, r)| *r == rounded) {
                Some((d, _)) => *d,
                None => {
                    reps.push((*divs, rounded));
                    *divs
                }
            }
        })
        .collect()
}

/// [`sweep`]; with `share`, a config that cannot behave differently from another on this trace
/// is not replayed again: configs that differ only in `roundup_power2_divisions` values that
/// round every request of the trace alike, and configs whose `max_split_size_mb` or
/// `garbage_collection_threshold` is never reached in the replay without them ([`inert`]). Their
/// outcomes name the config whose replay they share (`same_as`). Without `share` every
/// (config, placement) is replayed (the tests check that both agree).
pub fn sweep_with(prepared: &Prepared, points: &[GridPoint], limits: &Limits, placements: usize, share: bool, progress: &(dyn Fn() + Sync)) -> Vec<Row> {
    let list = prepared.placements(placements.max(1));
    let valid: Vec<(usize, &AllocatorConfig)> = points.iter().enumerate().filter_map(|(i, p)| p.config.as_ref().ok().map(|c| (i, c))).collect();
    // The settings each point is replayed under: itself, or (sharing) its canonical form.
    let canonical: Vec<AllocatorConfig> = if share {
        let mut sizes: Vec<u64> = prepared.program.requests.iter().map(|r| r.size).collect();
        sizes.sort_unstable();
        sizes.dedup();
        let divs: Vec<_> = valid.iter().map(|(_, c)| c.roundup_power2_divisions).collect();
        rounding_classes(&divs, &sizes)
            .into_iter()
            .zip(&valid)
            .map(|(d, (_, c))| AllocatorConfig { roundup_power2_divisions: d, source: String::new(), ..(*c).clone() })
            .collect()
    } else {
        valid.iter().map(|(_, c)| (*c).clone()).collect()
    };
    // Distinct runs; `run_of[k]` for valid point k. A run's base: the same settings without
    // max_split_size and GC, when that is a run of its own.
    let mut runs: Vec<AllocatorConfig> = Vec::new();
    let mut first_point: Vec<usize> = Vec::new();
    let run_of: Vec<usize> = canonical
        .iter()
        .enumerate()
        .map(|(k, c)| match runs.iter().position(|r| r == c) {
            Some(r) if share => r,
            _ => {
                runs.push(c.clone());
                first_point.push(valid[k].0);
                runs.len() - 1
            }
        })
        .collect();
    // A run's bases: the same settings without GC, and without max_split_size, where those are
    // runs too. Runs are replayed by levels (how many of the two they set), so bases come first.
    let without_gc = |c: &AllocatorConfig| AllocatorConfig { garbage_collection_threshold: 0.0, ..c.clone() };
    let without_split = |c: &AllocatorConfig| AllocatorConfig {
        max_split_size: u64::MAX,
        max_non_split_rounding_size: AllocatorConfig::default().max_non_split_rounding_size,
        ..c.clone()
    };
    let gc_base: Vec<Option<usize>> =
        runs.iter().map(|c| if share && c.garbage_collection_threshold > 0.0 { runs.iter().position(|r| *r == without_gc(c)) } else { None }).collect();
    let split_base: Vec<Option<usize>> =
        runs.iter().map(|c| if share && c.max_split_size != u64::MAX { runs.iter().position(|r| *r == without_split(c)) } else { None }).collect();
    let level = |r: usize| usize::from(runs[r].garbage_collection_threshold > 0.0) + usize::from(runs[r].max_split_size != u64::MAX);
    let n_placements = |c: &AllocatorConfig| if c.expandable_segments { 1 } else { list.len() };
    let users = |r: usize| run_of.iter().filter(|&&x| x == r).count();
    // done[r][j]: run r's replay (or the replay it shares) under placement j.
    let mut done: Vec<Vec<Option<Replay>>> = runs.iter().map(|c| vec![None; n_placements(c)]).collect();
    // Placement sharing needs the segment calls of the first placement's replay, and a replay that
    // starts from a restored state also made device calls before its events.
    let placements_shareable = share && prepared.program.initial.is_none();
    for (lv, first) in (0..=2).flat_map(|lv| [(lv, true), (lv, false)]) {
        let jobs: Vec<(usize, usize)> =
            (0..runs.len()).filter(|&r| level(r) == lv).flat_map(|r| (0..done[r].len()).map(move |j| (r, j))).filter(|&(_, j)| (j == 0) == first).collect();
        let results: Vec<(usize, usize, Replay)> = jobs
            .par_iter()
            .map(|&(r, j)| {
                let from = |base: Option<usize>, inert: fn(&AllocatorConfig, &Replay) -> bool| {
                    let b = base?;
                    let x = done[b][j].as_ref()?;
                    inert(&runs[r], x).then(|| {
                        let mut x = x.clone();
                        x.outcome.same_as.get_or_insert_with(|| points[first_point[b]].conf.clone());
                        x
                    })
                };
                let (name, placement) = &list[j];
                let same_placement = || {
                    let x = done[r][0].as_ref().filter(|_| j > 0 && placements_shareable)?;
                    same_order(x.calls.as_deref()?, prepared.device_memory, placement).then(|| {
                        let mut x = x.clone();
                        x.outcome.placement = name.clone();
                        x.outcome.same_as.get_or_insert_with(|| format!("{} (placement {})", points[first_point[r]].conf, list[0].0));
                        x
                    })
                };
                let x = from(gc_base[r], gc_inert).or_else(|| from(split_base[r], split_inert)).or_else(same_placement).unwrap_or_else(|| {
                    let config = &runs[r];
                    let o = prepared.replay_under(config, limits, placement.clone());
                    let calls = o
                        .segment_events
                        .iter()
                        .map(|e| match e.action {
                            allocsim_trace::Action::SegmentAlloc => Some((true, e.addr, e.size)),
                            allocsim_trace::Action::SegmentFree => Some((false, e.addr, e.size)),
                            _ => None,
                        })
                        .collect::<Option<Vec<_>>>()
                        .map(Arc::new);
                    Replay {
                        outcome: Outcome::of(name, &o, config.large_segment_size),
                        largest_size_seen: o.allocator.largest_size_seen,
                        peak_total_at_cache_miss: o.allocator.peak_total_at_cache_miss,
                        allowed: o.allocator.allowed_memory_maximum,
                        calls,
                    }
                });
                (0..users(r)).for_each(|_| progress());
                (r, j, x)
            })
            .collect();
        for (r, j, x) in results {
            done[r][j] = Some(x);
        }
    }
    let mut rows: Vec<Row> = points
        .iter()
        .map(|p| Row {
            conf: p.conf.clone(),
            rejected: p.config.as_ref().err().cloned(),
            placement_independent: p.config.as_ref().is_ok_and(|c| c.expandable_segments),
            outcomes: Vec::new(),
        })
        .collect();
    for (k, &(i, _)) in valid.iter().enumerate() {
        let r = run_of[k];
        for x in &done[r] {
            let mut o = x.clone().expect("every run was replayed").outcome;
            if first_point[r] != i && o.same_as.is_none() {
                o.same_as = Some(points[first_point[r]].conf.clone());
            }
            rows[i].outcomes.push(o);
        }
    }
    rows.sort_by_key(|r| r.rank_key());
    rows
}

/// Adjacent ranked rows whose order could flip with segment placement: the same number of
/// placements with OOM and overlapping peak-reserved ranges (or overlapping first-OOM ranges).
/// Returns the indices `i` (into `rows`) such that rows `i` and `i + 1` could swap.
pub fn placement_sensitive_pairs(rows: &[Row]) -> Vec<usize> {
    let valid: Vec<usize> = (0..rows.len()).filter(|&i| rows[i].rejected.is_none()).collect();
    let mut out = Vec::new();
    for w in valid.windows(2) {
        let (a, b) = (&rows[w[0]], &rows[w[1]]);
        if a.outcomes.len() + b.outcomes.len() <= 2 {
            continue; // one placement each: nothing to compare across placements
        }
        let overlap = |x: (u64, u64), y: (u64, u64)| x.0 <= y.1 && y.0 <= x.1;
        let peaks = matches!((a.peak_reserved_range(), b.peak_reserved_range()), (Some(x), Some(y)) if overlap(x, y));
        let key = |o: Option<u32>| o.map_or(u64::MAX, |v| v as u64);
        let (fa, fb) = (a.first_oom_range(), b.first_oom_range());
        let ooms = a.placements_with_oom() > 0 && b.placements_with_oom() > 0 && overlap((key(fa.0), key(fa.1)), (key(fb.0), key(fb.1)));
        if (a.placements_with_oom() == b.placements_with_oom() && peaks) || ooms {
            out.push(w[0]);
        }
    }
    out
}

/// The configs whose outcome (which placements run out of memory, and where first) differs
/// between sweeps of the same grid under different limits (the ends of an inferred allowed
/// maximum): their answer depends on where in it the real maximum lies.
pub fn depends_on_limits(sweeps: &[&[Row]]) -> Vec<String> {
    let Some(first) = sweeps.first() else { return Vec::new() };
    let key = |r: &Row| (r.placements_with_oom(), r.first_oom_range());
    first
        .iter()
        .filter(|r| r.rejected.is_none())
        .filter(|r| sweeps[1..].iter().any(|s| s.iter().find(|x| x.conf == r.conf).is_none_or(|x| key(x) != key(r))))
        .map(|r| r.conf.clone())
        .collect()
}

/// How many replays `sweep` will run (for a progress bar).
pub fn replay_count(points: &[GridPoint], placements: usize) -> usize {
    points.iter().filter_map(|p| p.config.as_ref().ok()).map(|c| if c.expandable_segments { 1 } else { placements.max(1) }).sum()
}

/// What `sweep` recommends, from its ranked rows (`own`: the index of the trace's own settings
/// among them, when the grid holds them).
#[derive(Clone, Debug, PartialEq)]
pub enum Recommendation {
    /// The trace's own settings rank first.
    KeepOwn { own: usize },
    /// `best` helps over the trace's own settings: fewer placements run out of memory, the first
    /// OOM comes later, or the worst peak reserved is at least [`MIN_GAIN`] lower.
    Better { best: usize, own: usize },
    /// No setting helps over the trace's own settings (ties on OOMs, and peak reserved within
    /// [`MIN_GAIN`]): nothing to change.
    OwnAsGood { own: usize, best: usize },
    /// The grid does not hold the trace's own settings: the best of it.
    Best { best: usize },
    /// Every setting runs out of memory in every placement; `smallest` has the smallest shortfall
    /// at its first OOM (bytes).
    AllOom { smallest: usize, shortfall: u64, request: u32 },
}

/// A peak reserved lower by less than this fraction is no gain worth a change of settings.
pub const MIN_GAIN: f64 = 0.01;

/// The recommendation for `rows` (ranked best first, as [`sweep`] returns them).
pub fn recommend(rows: &[Row], own: Option<usize>) -> Option<Recommendation> {
    let valid: Vec<usize> = (0..rows.len()).filter(|&i| rows[i].rejected.is_none() && !rows[i].outcomes.is_empty()).collect();
    let &best = valid.first()?;
    if valid.iter().all(|&i| rows[i].placements_with_oom() == rows[i].outcomes.len()) {
        let (smallest, shortfall, request) = valid
            .iter()
            .flat_map(|&i| rows[i].outcomes.iter().map(move |o| (i, o)))
            .filter_map(|(i, o)| Some((i, o.first_oom_shortfall?, o.first_oom?)))
            .min_by_key(|&(i, s, q)| (s, std::cmp::Reverse(q), i))?;
        return Some(Recommendation::AllOom { smallest, shortfall, request });
    }
    let Some(own) = own else { return Some(Recommendation::Best { best }) };
    if own == best {
        return Some(Recommendation::KeepOwn { own });
    }
    let (b, o) = (&rows[best], &rows[own]);
    let earliest = |r: &Row| r.outcomes.iter().map(|x| x.first_oom.map_or(u32::MAX, |q| q)).min().unwrap_or(u32::MAX);
    let worst_peak = |r: &Row| r.peak_reserved_range().map_or(u64::MAX, |x| x.1);
    let helps = b.placements_with_oom() < o.placements_with_oom()
        || (b.placements_with_oom() == o.placements_with_oom() && earliest(b) > earliest(o))
        || (worst_peak(b) as f64) < worst_peak(o) as f64 * (1.0 - MIN_GAIN);
    Some(if helps { Recommendation::Better { best, own } } else { Recommendation::OwnAsGood { own, best } })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(conf: &str, peaks: &[u64], ooms: &[Option<u32>]) -> Row {
        Row {
            conf: conf.into(),
            rejected: None,
            placement_independent: false,
            outcomes: peaks
                .iter()
                .zip(ooms)
                .map(|(&p, &o)| Outcome {
                    placement: String::new(),
                    first_oom: o,
                    ooms: o.is_some() as usize,
                    peak_reserved: p,
                    peak_reserved_request: None,
                    peak_allocated: 0,
                    num_alloc_retries: 0,
                    num_sync_all_streams: 0,
                    num_device_alloc: 0,
                    num_device_free: 0,
                    device_call_us: 0.0,
                    first_oom_shortfall: o.map(|_| 1 << 20),
                    same_as: None,
                })
                .collect(),
        }
    }

    #[test]
    fn recommends_only_what_helps() {
        // Equal peaks (within 1%) and no OOM: the own settings are as good.
        let rows = vec![row("x", &[1000, 1000], &[None, None]), row("", &[1005, 1005], &[None, None])];
        assert_eq!(recommend(&rows, Some(1)), Some(Recommendation::OwnAsGood { own: 1, best: 0 }));
        // 10% lower: better.
        let rows = vec![row("x", &[900, 900], &[None, None]), row("", &[1000, 1000], &[None, None])];
        assert_eq!(recommend(&rows, Some(1)), Some(Recommendation::Better { best: 0, own: 1 }));
        // Avoiding an OOM is better whatever the peak.
        let rows = vec![row("x", &[1000], &[None]), row("", &[990], &[Some(3)])];
        assert_eq!(recommend(&rows, Some(1)), Some(Recommendation::Better { best: 0, own: 1 }));
        // Every config runs out of memory: no recommendation of a setting.
        let rows = vec![row("x", &[1000], &[Some(9)]), row("", &[990], &[Some(3)])];
        assert!(matches!(recommend(&rows, Some(1)), Some(Recommendation::AllOom { .. })));
    }

    #[test]
    fn overlapping_neighbours_could_swap() {
        let rows = vec![
            row("a", &[10, 14], &[None, None]),
            row("b", &[12, 13], &[None, None]),
            row("c", &[20, 21], &[None, None]),
            row("d", &[30, 30], &[Some(5), Some(9)]),
            row("e", &[30, 30], &[Some(7), Some(8)]),
        ];
        // a/b overlap in peak; b/c do not; c/d differ in OOMs; d/e overlap in first OOM.
        assert_eq!(placement_sensitive_pairs(&rows), vec![0, 3]);
    }
}
