//! The what-if answers against the real runs in `../shared/traces` (skipped where absent):
//! a sweep over a workload's default run must contain each recorded config's real outcome within
//! the range it states across placements, and `fit` must give a capacity C at which the replay
//! runs without OOM while C − 2 MiB runs out of memory.

use std::path::{Path, PathBuf};

use allocsim_model::AllocatorConfig;
use allocsim_replay::Prepared;
use allocsim_replay::run::Limits;
use allocsim_trace::{Action, Snapshot, read_trace};
use allocsim_whatif::fit::{STEP, fit};
use allocsim_whatif::grid::parse_grid;
use allocsim_whatif::sweep::sweep;

const H200: u64 = 150_109_880_320;

#[path = "support/reference.rs"]
mod reference;

fn shared() -> Option<PathBuf> {
    reference::shared(Path::new(env!("CARGO_MANIFEST_DIR")), "traces")
}

fn meta(path: &Path) -> serde_json::Value {
    let s = path.to_str().unwrap().trim_end_matches(".pickle.gz").to_string() + ".json";
    serde_json::from_str(&std::fs::read_to_string(s).unwrap()).unwrap()
}

fn cap(m: &serde_json::Value) -> Option<u64> {
    Some((m["fraction"].as_f64()? * m["device_total_memory"].as_f64().unwrap()) as u64)
}

fn first_oom(snap: &Snapshot) -> Option<u32> {
    let mut req = 0;
    for e in &snap.device_traces[0] {
        match e.action {
            Action::Alloc => req += 1,
            Action::Oom => return Some(req),
            _ => {}
        }
    }
    None
}

fn deferred(snap: &Snapshot) -> bool {
    let t = &snap.device_traces[0];
    t.iter().enumerate().any(|(i, e)| e.action == Action::FreeRequested && t.get(i + 1).is_none_or(|n| n.action != Action::FreeCompleted))
}

#[test]
fn sweeps_over_the_default_run_contain_every_recorded_outcome() {
    let Some(dir) = shared() else { return };
    let mut runs: Vec<PathBuf> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).filter(|p| p.to_str().unwrap().ends_with(".pickle.gz")).collect();
    runs.sort();
    reference::expect_count("shared runs", runs.len(), reference::SHARED_TRACE_RUNS);
    let mut failures = Vec::new();
    let mut asked = 0;
    for path in &runs {
        let name = path.file_name().unwrap().to_str().unwrap().trim_end_matches(".pickle.gz").to_string();
        let workload = name.split("__").next().unwrap();
        let base = dir.join(format!("{workload}__default__0M.pickle.gz"));
        if !base.exists() || &base == path {
            continue;
        }
        let real = read_trace(path).unwrap();
        if deferred(&real) {
            continue;
        }
        let m = meta(path);
        let conf = m["PYTORCH_CUDA_ALLOC_CONF"].as_str().unwrap_or("");
        let prepared = Prepared::new(&read_trace(&base).unwrap(), None, H200, None).unwrap();
        // One grid axis holding exactly the recorded config.
        let points = parse_grid("", conf).unwrap();
        let rows = sweep(&prepared, &points, &Limits::capacity(cap(&m)), 8, &|| {});
        let row = &rows[0];
        asked += 1;
        let inf = u64::MAX;
        let firsts: Vec<u64> = row.outcomes.iter().map(|o| o.first_oom.map_or(inf, |x| x as u64)).collect();
        let real_oom = first_oom(&real).map_or(inf, |x| x as u64);
        let (lo, hi) = (*firsts.iter().min().unwrap(), *firsts.iter().max().unwrap());
        if !(lo <= real_oom && real_oom <= hi) {
            failures.push(format!("{name}: real first OOM {real_oom} outside [{lo}, {hi}]"));
            continue;
        }
        if real_oom == inf {
            let peaks: Vec<u64> = row.outcomes.iter().filter(|o| o.first_oom.is_none()).map(|o| o.peak_reserved).collect();
            let want = m["memory_stats"]["reserved_bytes.all.peak"].as_u64().unwrap();
            let (plo, phi) = (*peaks.iter().min().unwrap(), *peaks.iter().max().unwrap());
            if !(plo <= want && want <= phi) {
                failures.push(format!("{name}: real peak reserved {want} outside [{plo}, {phi}]"));
            }
        }
    }
    assert!(asked >= 15, "asked {asked}");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn fit_finds_the_edge_for_every_workload() {
    let Some(dir) = shared() else { return };
    let mut bases: Vec<(PathBuf, Option<u64>)> = Vec::new();
    for w in ["cudagraph", "emptycache", "multistream", "synthetic", "transformer", "unet512", "unet"] {
        bases.push((dir.join(format!("{w}__default__0M.pickle.gz")), None));
    }
    // frag has only its capped run; its releases are judged under the cap it was recorded with.
    let frag = dir.join("frag__default__2048M.pickle.gz");
    bases.push((frag.clone(), cap(&meta(&frag))));
    let mut failures = Vec::new();
    for (path, trace_cap) in bases {
        let prepared = Prepared::new(&read_trace(&path).unwrap(), None, H200, trace_cap).unwrap();
        for conf in ["", "expandable_segments:True"] {
            let config = AllocatorConfig::parse(conf).unwrap();
            let placement = prepared.recorded_placement();
            let f = fit(&prepared, &config, &placement);
            let c = f.capacity.expect("every workload fits on an H200");
            let at = prepared.replay(&config, Some(c), placement.clone());
            let below = prepared.replay(&config, Some(c - STEP), placement.clone());
            if at.first_oom().is_some() || below.first_oom().is_none() {
                failures.push(format!("{} under {conf:?}: C = {c}: OOM at C: {:?}, at C − 2 MiB: {:?}", path.display(), at.first_oom(), below.first_oom()));
            }
            assert!(c >= f.peak_allocated, "a capacity below peak allocated cannot fit");
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Sharing replays between configs that cannot differ on a trace (`sweep_with(.., share)`) must
/// give every config exactly the outcomes it gets when replayed on its own: checked on the
/// repository's traces (whole, and cut to start mid-history) over the default grid, uncapped and
/// under caps that make GC and `max_split_size` fire for some configs and not others.
#[test]
fn shared_sweep_replays_equal_separate_ones() {
    use allocsim_whatif::grid::DEFAULT_GRID;
    use allocsim_whatif::sweep::sweep_with;
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("traces");
    let points = parse_grid(DEFAULT_GRID, "").unwrap();
    let (mut shared_outcomes, mut total, mut mid_history) = (0, 0, 0);
    for name in [
        "frag__default__2048M",
        "unet512__default__0M",
        "multistream__default__0M",
        "emptycache__default__0M",
        "crossstream__default__320M",
        "cudagraph__default__0M",
    ] {
        let path = dir.join(format!("{name}.pickle.gz"));
        let Ok(whole) = read_trace(&path) else { continue };
        // The whole trace, and the trace cut at a third (it then starts mid-history, from a
        // restored state; placements are not shared there).
        let mut cut = whole.clone();
        let n = cut.device_traces[0].len();
        cut.device_traces[0] = cut.device_traces[0][n / 3..].to_vec();
        for snap in [whole, cut] {
            let prepared = Prepared::new(&snap, None, H200, None).unwrap();
            mid_history += usize::from(prepared.program.initial.is_some());
            let peak = prepared.own_outcome.peak_reserved;
            for capacity in [None, Some(peak + peak / 20), Some(peak - peak / 10)] {
                let strip = |rows: Vec<allocsim_whatif::sweep::Row>| -> Vec<(String, Vec<allocsim_whatif::sweep::Outcome>)> {
                    let mut v: Vec<_> = rows
                        .into_iter()
                        .map(|r| (r.conf, r.outcomes.into_iter().map(|o| allocsim_whatif::sweep::Outcome { same_as: None, ..o }).collect()))
                        .collect();
                    v.sort_by(|a: &(String, _), b| a.0.cmp(&b.0));
                    v
                };
                let shared = sweep_with(&prepared, &points, &Limits::capacity(capacity), 4, true, &|| {});
                shared_outcomes += shared.iter().flat_map(|r| &r.outcomes).filter(|o| o.same_as.is_some()).count();
                total += shared.iter().map(|r| r.outcomes.len()).sum::<usize>();
                let separate = sweep_with(&prepared, &points, &Limits::capacity(capacity), 4, false, &|| {});
                assert_eq!(strip(shared), strip(separate), "{name} under {capacity:?}");
            }
        }
    }
    // The check means something only if some replays were shared and others were not.
    eprintln!("{shared_outcomes} of {total} outcomes shared");
    assert!(shared_outcomes > 0 && shared_outcomes < total, "{shared_outcomes} of {total} outcomes shared");
    assert!(mid_history >= 3, "only {mid_history} cut traces start mid-history");
}
