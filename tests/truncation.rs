//! Ring-buffer truncation: every real trace, cut as `_record_memory_history(max_entries=N)` cuts it
//! (only the last N entries are kept, the final segments are the same), must replay from the
//! reconstructed initial state and reproduce what the recording shows after the cut: every segment
//! event (with its request), every OOM, every allocation's address, the final segments, and every
//! `memory_stats()` value that the cut leaves knowable (the `*.current` values; the counters count
//! from the cut, so `num_device_alloc`/`num_device_free` must equal the segment events after it).
//!
//! One thing the cut makes unknowable: how long the blocks that are free at the cut had been
//! free, which `garbage_collection_threshold` uses to choose what to release (they are taken as
//! freed at the cut). For runs with garbage collection, a cut whose replay differs only from a
//! garbage-collection release on is counted, not failed, and at least 80% of their cuts must be
//! exact.
//!
//! Cut points: fixed fractions of the trace, plus the awkward places: right after a
//! `free_requested` whose `free_completed` comes later (or right after, within the same free),
//! and inside a run of releases (a `malloc`'s or an `empty_cache()`'s).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use allocsim_replay::{ReplaySpec, run, validate};
use allocsim_trace::{Action, Snapshot, read_trace};

fn runs_in(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.to_str().unwrap().ends_with(".pickle.gz")).collect())
        .unwrap_or_default();
    v.sort();
    v
}

fn meta(path: &Path) -> serde_json::Value {
    let name = path.file_name().unwrap().to_str().unwrap().trim_end_matches(".gz").trim_end_matches(".pickle");
    serde_json::from_str(&std::fs::read_to_string(path.with_file_name(format!("{name}.json"))).unwrap()).unwrap()
}

fn capacity(meta: &serde_json::Value) -> Option<u64> {
    let f = meta["fraction"].as_f64()?;
    Some((f * meta["device_total_memory"].as_f64().unwrap()) as u64)
}

/// The cut points of a trace of `t` entries.
fn cut_points(t: &[allocsim_trace::TraceEntry]) -> Vec<usize> {
    let n = t.len();
    let mut cuts: Vec<usize> = [1, 5, 10, 20, 25, 33, 50, 60, 66, 75, 90, 95, 99].iter().map(|p| n * p / 100).collect();
    // Between a free_requested and its free_completed (deferred, then immediate).
    let deferred = (0..n).find(|&i| t[i].action == Action::FreeRequested && t.get(i + 1).is_some_and(|x| x.action != Action::FreeCompleted));
    let immediate = (n / 3..n).find(|&i| t[i].action == Action::FreeRequested && t.get(i + 1).is_some_and(|x| x.action == Action::FreeCompleted));
    // Inside a release run, and right at its start.
    let release = (n / 4..n).find(|&i| matches!(t[i].action, Action::SegmentFree | Action::SegmentUnmap) && i + 1 < n && t[i + 1].action == t[i].action);
    let release2 =
        (1..n).rev().find(|&i| matches!(t[i].action, Action::SegmentFree | Action::SegmentUnmap) && t[i + 1..].iter().any(|e| e.action == Action::Alloc));
    cuts.extend(deferred.map(|i| i + 1));
    cuts.extend(immediate.map(|i| i + 1));
    cuts.extend(release.map(|i| i + 1));
    cuts.extend(release2);
    cuts.retain(|&c| c > 0 && c < n);
    cuts.sort();
    cuts.dedup();
    cuts
}

fn truncated(snap: &Snapshot, cut: usize) -> Snapshot {
    let mut s = snap.clone();
    s.device_traces[0] = s.device_traces[0][cut..].to_vec();
    s
}

/// (cuts, errors, cuts of a garbage-collecting run, those of them that differ from a GC release on).
fn check_run(path: &Path) -> (usize, Vec<String>, usize, usize) {
    let snap = read_trace(path).unwrap();
    let meta = meta(path);
    let cap = capacity(&meta);
    let name = path.file_name().unwrap().to_str().unwrap().to_string();
    let recorded: BTreeMap<String, i64> = meta["memory_stats"].as_object().unwrap().iter().map(|(k, v)| (k.clone(), v.as_i64().unwrap())).collect();
    let mut errors = Vec::new();
    let mut gc_misses = 0;
    let gc = cap.is_some() && meta["PYTORCH_CUDA_ALLOC_CONF"].as_str().unwrap_or("").contains("garbage_collection_threshold");
    let cuts = cut_points(&snap.device_traces[0]);
    for &cut in &cuts {
        let t = truncated(&snap, cut);
        let spec = ReplaySpec { capacity: cap, ..ReplaySpec::default() };
        let r = run(&t, &spec).unwrap();
        let ctx = format!("{name} cut at {cut}/{}", snap.device_traces[0].len());
        if let Some(e) = &r.program.reconstruct_error {
            errors.push(format!("{ctx}: reconstruction failed: {e}"));
            continue;
        }
        if !r.outcome.restore_failures.is_empty() {
            errors.push(format!("{ctx}: restore failed: {:?}", r.outcome.restore_failures));
        }
        if r.program.unknown_frees > 0 {
            errors.push(format!("{ctx}: {} unknown frees", r.program.unknown_frees));
        }
        let v = validate(&r);
        if !v.exact && gc {
            eprintln!("note: {ctx} (garbage collection: ages at the cut unknown): {:?}", v.segment_events.first_divergence);
            gc_misses += 1;
            continue;
        }
        if !v.exact {
            errors.push(format!(
                "{ctx}: not exact: events {:?}; ooms {:?}; addresses {:?}; final segments {:?}",
                v.segment_events.first_divergence, v.ooms.first_divergence, v.alloc_addresses.first_divergence, v.final_segments.first_divergence
            ));
            continue;
        }
        let sim = r.outcome.stats.to_memory_stats();
        for (k, want) in &recorded {
            if k.ends_with(".current") && sim.get(k) != Some(want) {
                errors.push(format!("{ctx}: {k} recorded {want}, simulated {:?}", sim.get(k)));
            }
        }
        let after = &t.device_traces[0];
        let count = |a: &[Action]| after.iter().filter(|e| a.contains(&e.action)).count() as i64;
        for (k, n) in [
            ("num_device_alloc", count(&[Action::SegmentAlloc, Action::SegmentMap])),
            ("num_device_free", count(&[Action::SegmentFree, Action::SegmentUnmap])),
            ("num_ooms", count(&[Action::Oom])),
        ] {
            if sim[k] != n {
                errors.push(format!("{ctx}: {k} counts from the cut: {n} events, simulated {}", sim[k]));
            }
        }
    }
    (cuts.len(), errors, if gc { cuts.len() } else { 0 }, gc_misses)
}

fn check_dir(dir: &Path) {
    let runs = runs_in(dir);
    let mut errors = Vec::new();
    let mut n = 0;
    let (mut gc_cuts, mut gc_misses) = (0, 0);
    for p in &runs {
        let (k, e, gk, g) = check_run(p);
        n += k;
        gc_cuts += gk;
        gc_misses += g;
        errors.extend(e);
    }
    eprintln!("{}: {} runs, {n} cuts; of {gc_cuts} cuts of garbage-collecting runs {gc_misses} differ from a GC release on", dir.display(), runs.len());
    assert!(gc_misses * 5 <= gc_cuts, "{gc_misses} of {gc_cuts} cuts of garbage-collecting runs differ");
    assert!(errors.is_empty(), "{} of {n} cuts failed:\n{}", errors.len(), errors.join("\n"));
}

#[test]
fn repository_traces_cut_anywhere_replay_exactly() {
    check_dir(&Path::new(env!("CARGO_MANIFEST_DIR")).join("traces"));
}

#[test]
fn shared_traces_cut_anywhere_replay_exactly() {
    let Some(dir) = reference::shared(Path::new(env!("CARGO_MANIFEST_DIR")), "traces") else { return };
    reference::expect_count("shared runs", runs_in(&dir).len(), reference::SHARED_TRACE_RUNS);
    check_dir(&dir);
}

#[path = "support/reference.rs"]
mod reference;

#[test]
fn the_reconstructed_state_is_reported() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("traces/frag__default__2048M.pickle.gz");
    let snap = read_trace(&path).unwrap();
    let n = snap.device_traces[0].len();
    let r = run(&truncated(&snap, n / 2), &ReplaySpec { capacity: capacity(&meta(&path)), ..ReplaySpec::default() }).unwrap();
    let init = r.program.initial.as_ref().expect("a trace cut in the middle starts from a reconstructed state");
    assert!(!init.segments.is_empty() && !init.blocks.is_empty());
    assert_eq!(init.allocated_bytes() + init.blocks.iter().filter(|b| b.pending).map(|b| b.size).sum::<u64>(), init.blocks.iter().map(|b| b.size).sum::<u64>());
    // A complete trace starts from an empty allocator.
    let full = run(&snap, &ReplaySpec { capacity: capacity(&meta(&path)), ..ReplaySpec::default() }).unwrap();
    assert!(full.program.initial.is_none() && full.program.reconstruct_error.is_none());
}

/// A cut trace replayed under settings other than its own: the restored state was reached under
/// the recorded settings and may be one these settings never reach (a split segment with a free
/// piece of at least `max_split_size`). Whatever the settings, capacity and placement, the
/// allocator must stay consistent (blocks tile their segments, the free sets hold exactly the free
/// blocks, the statistics agree): `release_available_cached_blocks` once cut such a piece out of
/// its segment.
#[test]
fn cut_traces_stay_consistent_under_other_settings() {
    use allocsim_model::AllocatorConfig;
    use allocsim_replay::Prepared;
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("traces");
    let mut checked = 0;
    for path in runs_in(&dir) {
        let snap = read_trace(&path).unwrap();
        let n = snap.device_traces[0].len();
        for cut in [n / 3, n / 2] {
            let p = Prepared::new(&truncated(&snap, cut), None, 150_109_880_320, None).unwrap();
            if p.program.initial.is_none() {
                continue;
            }
            let peak = p.own_outcome.peak_reserved;
            for conf in
                ["max_split_size_mb:64", "max_split_size_mb:128", "garbage_collection_threshold:0.6", "roundup_power2_divisions:2", "expandable_segments:True"]
            {
                let config = AllocatorConfig::parse(conf).unwrap();
                for cap in [None, Some(peak + peak / 20), Some(peak - peak / 10)] {
                    for (name, placement) in p.placements(4) {
                        let o = p.replay(&config, cap, placement);
                        if let Err(e) = o.allocator.check_invariants() {
                            panic!("{} cut at {cut} under {conf}, cap {cap:?}, placement {name}: {e}", path.display());
                        }
                        checked += 1;
                    }
                }
            }
        }
    }
    assert!(checked > 100, "only {checked} replays checked");
}
