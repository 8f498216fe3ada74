//! Every real trace replayed against its recording.
//!
//! * `traces/` (in the repository): each run replayed under its own settings and allowed maximum
//!   must reproduce every recorded segment event, OOM, allocation address and final segment, and
//!   every `torch.cuda.memory_stats()` value the run's `.json` recorded.
//! * `../shared/traces` (beside the checkout, when present): the same for every run, plus the
//!   what-if question: the workload's uncapped default run replayed under another run's config and
//!   allowed maximum, with that run's segment addresses, must reproduce that run up to the first OOM.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use allocsim_replay::{ReplaySpec, run, validate};
use allocsim_trace::{Action, Snapshot, read_trace};

struct Recorded {
    name: String,
    snap: Snapshot,
    meta: serde_json::Value,
}

impl Recorded {
    fn load(path: &Path) -> Recorded {
        let name = path.file_name().unwrap().to_str().unwrap().trim_end_matches(".gz").trim_end_matches(".pickle").to_string();
        let meta_path = path.with_file_name(format!("{name}.json"));
        let meta = serde_json::from_str(&std::fs::read_to_string(&meta_path).expect("the run's .json")).unwrap();
        Recorded { name, snap: read_trace(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())), meta }
    }
    /// `int(fraction * device_total_memory)`: what set_per_process_memory_fraction allowed.
    fn capacity(&self) -> Option<u64> {
        let f = self.meta["fraction"].as_f64()?;
        Some((f * self.meta["device_total_memory"].as_f64().unwrap()) as u64)
    }
    fn conf(&self) -> String {
        self.meta["PYTORCH_CUDA_ALLOC_CONF"].as_str().unwrap_or("").to_string()
    }
    fn stats(&self) -> BTreeMap<String, i64> {
        self.meta["memory_stats"].as_object().unwrap().iter().map(|(k, v)| (k.clone(), v.as_i64().unwrap())).collect()
    }
    /// Peaks count from the last reset_peak_memory_stats(), which the trace does not show.
    fn peaks_reset(&self) -> bool {
        self.name.starts_with("emptycache__") || self.meta.get("peak_resets").is_some_and(|v| v.as_i64().unwrap_or(0) > 0)
    }
    fn has_deferred_frees(&self) -> bool {
        let t = &self.snap.device_traces[0];
        t.iter().enumerate().any(|(i, e)| e.action == Action::FreeRequested && t.get(i + 1).is_none_or(|n| n.action != Action::FreeCompleted))
    }
}

fn runs_in(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.to_str().unwrap().ends_with(".pickle.gz")).collect())
        .unwrap_or_default();
    v.sort();
    v
}

/// Self replay: exact on every recorded fact and every memory_stats() key.
fn check_self(r: &Recorded) -> Vec<String> {
    let spec = ReplaySpec { capacity: r.capacity(), ..ReplaySpec::default() };
    let replayed = run(&r.snap, &spec).unwrap();
    let v = validate(&replayed);
    let mut errors = Vec::new();
    if !v.exact {
        errors.push(format!("{}: self replay not exact: {v:?}", r.name));
    }
    let sim = replayed.outcome.stats.to_memory_stats();
    for (k, want) in r.stats() {
        if r.peaks_reset() && k.ends_with(".peak") {
            continue;
        }
        if sim.get(&k) != Some(&want) {
            errors.push(format!("{}: memory_stats[{k}] recorded {want}, simulated {:?}", r.name, sim.get(&k)));
        }
    }
    errors
}

#[test]
fn repository_traces_replay_exactly() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("traces");
    let runs = runs_in(&dir);
    assert!(runs.len() >= 5, "traces/ should hold the sample traces");
    let errors: Vec<String> = runs.iter().flat_map(|p| check_self(&Recorded::load(p))).collect();
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

#[test]
fn what_if_from_the_default_run_reproduces_expandable_emptycache() {
    // emptycache__default__0M replayed under expandable_segments:True, with the addresses of the
    // real expandable run, must make that run's maps and unmaps: the empty_cache() calls it
    // inferred from the default run's segment frees are applied under the other config.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("traces");
    let base = Recorded::load(&dir.join("emptycache__default__0M.pickle.gz"));
    let real = Recorded::load(&dir.join("emptycache__expandable__0M.pickle.gz"));
    let errors = check_what_if(&base, &real);
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

fn check_what_if(base: &Recorded, real: &Recorded) -> Vec<String> {
    let spec = ReplaySpec { config: Some(real.conf()), capacity: real.capacity(), addresses_from: Some(&real.snap), ..ReplaySpec::default() };
    let replayed = run(&base.snap, &spec).unwrap();
    let mut recorded = Vec::new();
    let mut req = 0u32;
    let mut real_oom = None;
    for e in &real.snap.device_traces[0] {
        match e.action {
            Action::SegmentAlloc | Action::SegmentFree | Action::SegmentMap | Action::SegmentUnmap => recorded.push((req, e.action, e.size)),
            Action::Alloc => req += 1,
            Action::Oom => {
                real_oom.get_or_insert(req);
                req += 1;
            }
            _ => {}
        }
    }
    let sim_oom = replayed.outcome.first_oom();
    let cut = [real_oom, sim_oom].into_iter().flatten().min();
    let keep = |v: Vec<(u32, Action, u64)>| -> Vec<(Action, u64)> { v.into_iter().filter(|e| cut.is_none_or(|c| e.0 < c)).map(|e| (e.1, e.2)).collect() };
    let sim: Vec<(u32, Action, u64)> = replayed.outcome.segment_events.iter().map(|e| (e.request, e.action, e.size)).collect();
    let mut errors = Vec::new();
    let (a, b) = (keep(recorded), keep(sim));
    if a != b {
        let i = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
        errors.push(format!("{} from {}: segment events differ at {i}: {:?} vs {:?}", real.name, base.name, a.get(i), b.get(i)));
    }
    if real_oom != sim_oom {
        errors.push(format!("{} from {}: first OOM recorded {real_oom:?}, simulated {sim_oom:?}", real.name, base.name));
    }
    if real_oom.is_none() && sim_oom.is_none() {
        let sim = replayed.outcome.stats.to_memory_stats();
        for k in ["num_device_alloc", "num_device_free", "reserved_bytes.all.current", "segment.all.current", "num_alloc_retries"] {
            let want = real.stats()[k];
            if sim.get(k) != Some(&want) {
                errors.push(format!("{} from {}: {k} recorded {want}, simulated {:?}", real.name, base.name, sim.get(k)));
            }
        }
        if !real.peaks_reset() && replayed.outcome.peak_reserved as i64 != real.stats()["reserved_bytes.all.peak"] {
            errors.push(format!("{} from {}: peak reserved differs", real.name, base.name));
        }
    }
    errors
}

#[path = "support/reference.rs"]
mod reference;

/// The reference traces beside the checkout (`../shared/traces`); skipped with a note where
/// absent, unless required (`ALLOCSIM_REQUIRE_SHARED=1`).
fn shared_traces() -> Option<PathBuf> {
    reference::shared(Path::new(env!("CARGO_MANIFEST_DIR")), "traces")
}

#[test]
fn shared_traces_self_replays_are_exact() {
    let Some(dir) = shared_traces() else { return };
    let runs = runs_in(&dir);
    reference::expect_count("shared runs", runs.len(), reference::SHARED_TRACE_RUNS);
    let errors: Vec<String> = runs.iter().flat_map(|p| check_self(&Recorded::load(p))).collect();
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

#[test]
fn shared_traces_what_if_replays_are_exact() {
    let Some(dir) = shared_traces() else { return };
    let mut errors = Vec::new();
    let mut asked = 0;
    for p in runs_in(&dir) {
        let real = Recorded::load(&p);
        let workload = real.name.split("__").next().unwrap().to_string();
        let base_path = dir.join(format!("{workload}__default__0M.pickle.gz"));
        if !base_path.exists() || base_path == p || real.has_deferred_frees() {
            continue;
        }
        asked += 1;
        errors.extend(check_what_if(&Recorded::load(&base_path), &real));
    }
    assert!(asked >= 10, "expected what-if questions, asked {asked}");
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}
