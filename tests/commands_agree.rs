//! Commands agree on one file: `replay`, `compare` (of a recording with itself: its recorded
//! segment events from the reconstructed start state, not a replay), `compare --ranks` and
//! `explain --at peak` give the same peak reserved, and the last two the same reserved-but-
//! unallocated figure at that peak, on every recording in traces/ and traces/field. The device's
//! total memory (given, inferred or assumed: one inference, `budget::infer_device_memory`) is the
//! same in `replay`, `validate` and `explain` too. Most of the field recordings start mid-history
//! (a 2 MiB segment reserved before recording began), where the two-file `compare` once counted
//! from zero. The recordings whose settings changed during the run (which `validate` does not
//! reproduce) are checked apart: the replays agree with each other and say that they are not the
//! recording, and `compare A A` gives the recorded peak.

mod common;

use std::path::PathBuf;

use common::{json, root};
use serde_json::Value;

fn recordings() -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut dirs = vec![root("traces")];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.to_string_lossy().ends_with(".pickle.gz") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

fn u(v: &Value, what: &str) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("{what}: not a number: {v}"))
}

/// Recordings checked as not reproduced because their settings changed during the run.
static SETTINGS_CHANGED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// ([replay, compare, ranks, explain] peak reserved, [ranks, explain] unallocated at it,
/// [replay, validate, explain] device memory), each command run once.
fn figures(f: &str) -> Option<([u64; 4], [u64; 2], [u64; 3])> {
    let replay = json(&["replay", "--json", f]);
    if replay["requests"] == 0 {
        return None; // a snapshot without trace entries: explain answers for its final state only
    }
    let compare = json(&["compare", "--json", f, f]);
    let ranks = json(&["compare", "--ranks", "--json", f]);
    let explain = json(&["explain", "--at", "peak", "--json", f]);
    let row = &ranks["rows"][0];
    // validate exits 1 on a recording it does not reproduce (test_cuda's run-time settings changes): still an answer
    let v = common::run(&["validate", "--json", f]);
    assert!(matches!(v.status.code(), Some(0 | 1)), "{f}: validate exited {:?}", v.status.code());
    let validate: Value = serde_json::from_slice(&v.stdout).unwrap_or_else(|e| panic!("{f}: validate printed no JSON: {e}"));
    if v.status.code() == Some(1) {
        // Not reproduced (settings changed at run time): `replay`, `explain` and the rank answer
        // for a replay under the last settings, and `replay` says that it is not the recording and
        // what the trace shows of other settings; `compare A A` compares the two runs as recorded:
        // PyTorch's own peak, which the recording's metadata holds.
        assert_eq!(replay["budget"]["reproduces"], false, "{f}: validate says NOT exact");
        assert_eq!(replay["settings_changed"], validate["settings_changed"], "{f}: replay and validate name the settings changes alike");
        assert!(replay["settings_changed"].as_array().is_some_and(|a| !a.is_empty()), "{f}: replay says nothing of the settings change");
        let text = common::success(&["replay", f]);
        assert!(text.contains("settings changed  likely during the run"), "{f}: {text}");
        // Every other answer about the trace says it too, with the same facts.
        let others = [
            ("explain --at peak", explain.clone()),
            ("explain", json(&["explain", "--json", f])),
            ("phases", json(&["phases", "--json", f])),
            ("fit", json(&["fit", "--json", f])),
            ("sweep", json(&["sweep", "--grid", "expandable_segments=True", "--json", f])),
        ];
        for (what, j) in &others {
            assert_eq!(j["not_reproduced"], true, "{f}: {what} does not say that the replay is not the recording");
            assert_eq!(j["settings_changed"], validate["settings_changed"], "{f}: {what} and validate name the settings changes alike");
        }
        for what in [&["explain", f][..], &["phases", f], &["fit", f]] {
            let text = common::success(what);
            assert!(text.contains("not reproduced    the replay under the trace's own settings"), "{f}: {what:?} says nothing:\n{text}");
        }
        let meta: Value = serde_json::from_str(&std::fs::read_to_string(f.replace(".pickle.gz", ".json")).unwrap()).unwrap();
        let recorded = u(&meta["memory_stats"]["reserved_bytes.all.peak"], "PyTorch's memory_stats()");
        assert_eq!(u(&compare["peak_reserved"][0], "compare"), recorded, "{f}: compare A A is the recorded run");
        let simulated = u(&replay["stats"]["reserved_bytes.all.peak"], "replay");
        let others = [u(&row["peak_reserved"], "compare --ranks"), u(&explain["free"]["reserved"], "explain --at peak")];
        assert_eq!(others, [simulated; 2], "{f}: peak reserved of (compare --ranks, explain --at peak) against replay's");
        SETTINGS_CHANGED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        return None;
    }
    assert_eq!((&replay["not_reproduced"], &explain["not_reproduced"]), (&Value::Bool(false), &Value::Bool(false)), "{f}: validate says exact");
    let dm = [
        u(&replay["budget"]["device_memory"], "replay"),
        u(&validate["budget"]["device_memory"], "validate"),
        u(&explain["budget"]["device_memory"], "explain"),
    ];
    assert!(dm.iter().all(|&d| d == dm[0]), "{f}: device memory (replay, validate, explain) {dm:?}");
    let free = &explain["free"];
    let peaks = [
        u(&replay["stats"]["reserved_bytes.all.peak"], "replay"),
        u(&compare["peak_reserved"][0], "compare"),
        u(&row["peak_reserved"], "compare --ranks"),
        u(&free["reserved"], "explain --at peak"),
    ];
    let unallocated = [u(&row["unallocated_at_peak"], "compare --ranks"), u(&free["reserved"], "explain").saturating_sub(u(&free["allocated"], "explain"))];
    Some((peaks, unallocated, dm))
}

#[test]
fn replay_compare_and_explain_give_one_peak() {
    let files = recordings();
    // 16 in traces/, 37 in traces/field and its two ranks (the directory as it is committed).
    assert!(files.len() >= 55, "only {} recordings under traces/", files.len());
    let names: Vec<String> = files.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    let results: Vec<(String, [u64; 4], [u64; 2])> = std::thread::scope(|s| {
        let chunks: Vec<_> = names.chunks(names.len().div_ceil(4)).collect();
        let handles: Vec<_> = chunks
            .into_iter()
            .map(|c| {
                s.spawn(move || {
                    c.iter()
                        .filter_map(|f| {
                            let (p, u, _) = figures(f)?;
                            Some((f.clone(), p, u))
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    let mut bad = Vec::new();
    let mut mid_history_peaks = 0;
    for (f, peaks, unallocated) in &results {
        if peaks.iter().any(|&p| p != peaks[0]) || unallocated[0] != unallocated[1] {
            bad.push(format!("{f}: peak reserved (replay, compare, ranks, explain) {peaks:?}, unallocated at it (ranks, explain) {unallocated:?}"));
        }
        if f.contains("field") {
            mid_history_peaks += 1;
        }
        assert!(peaks[0] > 0, "{f}: no peak reserved");
    }
    assert!(bad.is_empty(), "{} of {} recordings disagree:\n{}", bad.len(), results.len(), bad.join("\n"));
    assert!(mid_history_peaks >= 37, "{mid_history_peaks} field recordings checked");
    // settings_midrun, test_allocator_settings, test_max_split_expandable and
    // test_mempool_expandable in traces/field/test_cuda, each under two settings.
    let changed = SETTINGS_CHANGED.load(std::sync::atomic::Ordering::Relaxed);
    assert!(changed >= 8, "{changed} recordings whose settings changed during the run checked");
}

/// A job on a card larger than an H200: the same recording with 160 GiB more free at each OOM, so
/// that reserved + free there exceeds an H200's memory. Every command answers for the card the OOM
/// entries show, none for an assumed H200.
#[test]
fn every_command_answers_for_the_card_the_ooms_show() {
    let dir = std::env::temp_dir().join(format!("allocsim-agree-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let plain = dir.join("devfull.jsonl");
    let big = dir.join("bigger_card.jsonl");
    let src = root("traces/field/devfull_frag__default.pickle.gz");
    common::success(&["convert", src.to_str().unwrap(), "-o", plain.to_str().unwrap()]);
    let mut out = String::new();
    let mut ooms = 0;
    for line in std::fs::read_to_string(&plain).unwrap().lines() {
        let v: Value = serde_json::from_str(line).unwrap();
        // Edited as text: the header line must stay first in its own key order.
        let mut line = line.to_string();
        if v["action"] == "oom" {
            let free = u(&v["device_free"], "device_free");
            line = line.replace(&format!("\"device_free\":{free}"), &format!("\"device_free\":{}", free + (160 << 30)));
            ooms += 1;
        }
        out.push_str(&line);
        out.push('\n');
    }
    assert_eq!(ooms, 9, "devfull_frag__default records 9 OOMs");
    std::fs::write(&big, out).unwrap();
    let f = big.to_str().unwrap();
    let (peaks, unallocated, dm) = figures(f).expect("the edited recording has trace entries");
    std::fs::remove_dir_all(&dir).ok();
    // An H200 has 150109880320 bytes; reserved + free at the OOMs is 162.15 GiB.
    assert_eq!(dm, [174107197440; 3], "device memory (replay, validate, explain)");
    assert!(peaks.iter().all(|&p| p == peaks[0]) && unallocated[0] == unallocated[1], "{peaks:?} {unallocated:?}");
}

/// `compare --ranks` prepares each file as every command prepares one (one function:
/// `TraceOptions::prepare_for`): under a capacity asked for, the trace's own settings or others,
/// its row has the peak reserved and the OOMs of `replay` under the same options. (Before, a
/// rank took the capacity only for its replay and inferred the cap the trace was recorded under,
/// where `replay` takes the capacity asked for as that cap under the trace's own settings, and it
/// used 2.11's rules whatever release the snapshot showed.)
#[test]
fn ranks_replay_each_file_as_replay_does() {
    let files: Vec<PathBuf> = recordings().into_iter().filter(|p| p.parent() == Some(root("traces").as_path())).collect();
    assert!(files.len() >= 16, "only {} recordings in traces/", files.len());
    let mut checked = 0;
    for p in &files {
        let f = p.to_str().unwrap();
        let own = json(&["replay", "--json", f]);
        let peak = u(&own["stats"]["reserved_bytes.all.peak"], "replay");
        // Under 90 % and 70 % of its own peak reserved (crossstream__msplit64 at 70 %: `replay`
        // 194 MiB with 12 OOMs, the rank 210 MiB before).
        for (pct, extra) in [(9, vec![]), (7, vec![]), (9, vec!["--config", "expandable_segments:True"]), (7, vec!["--config", "expandable_segments:True"])] {
            let cap = format!("{}", (peak / 10 * pct) >> 20 << 20);
            let mut replay_args = vec!["replay", "--json", "--capacity", &cap, f];
            replay_args.extend(&extra);
            let mut ranks_args = vec!["compare", "--ranks", "--json", "--capacity", &cap, f];
            ranks_args.extend(&extra);
            let (replay, ranks) = (json(&replay_args), json(&ranks_args));
            let row = &ranks["rows"][0];
            assert!(row["error"].is_null(), "{f}: {}", row["error"]);
            let r = (u(&replay["stats"]["reserved_bytes.all.peak"], "replay"), u(&replay["stats"]["num_ooms"], "replay"));
            let k = (u(&row["peak_reserved"], "ranks"), u(&row["ooms"], "ranks"));
            assert_eq!(r, k, "{f} {extra:?} under {cap} bytes: (peak reserved, OOMs) of replay and of compare --ranks");
            checked += 1;
        }
    }
    assert!(checked >= 64);
}
