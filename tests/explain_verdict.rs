//! `explain` with no flags on every recording that ran out of memory: its first six lines name
//! the request that ended the run (the last OOM the trace recorded, found here from the trace's
//! own entries), its cause and a fix, and carry PyTorch's message for that OOM as the run's .json
//! recorded it (without NVML's per-process sentences, which a trace cannot show). The fix is then
//! checked with `replay`: under it, that request and every request before it that the recorded
//! run served are served; a memory fix is the smallest such allowed maximum to the 2 MiB.

mod common;

use std::path::{Path, PathBuf};

use allocsim_trace::{Action, read_trace};
use common::{json, root, success};
use serde_json::Value;

#[path = "support/reference.rs"]
mod reference;

/// PyTorch's message without NVML's per-process sentences ("Process N has X memory in use. " and
/// "Including non-PyTorch memory, this process has X memory in use. ").
fn without_nvml(msg: &str) -> String {
    let start = msg.find(" is free. ").unwrap() + " is free. ".len();
    let rest = &msg[start..];
    let keep_from =
        rest.find(" allowed; ").map(|i| rest[..i].rfind(". ").map_or(0, |j| j + 2)).unwrap_or_else(|| rest.find("Of the allocated memory").unwrap());
    format!("{}{}", &msg[..start], &rest[keep_from..])
}

/// The OOM messages a run's .json recorded, in order (`log` entries' `oom` or `exception`).
fn recorded_messages(path: &Path) -> Vec<String> {
    let meta = PathBuf::from(path.to_str().unwrap().trim_end_matches(".pickle.gz").to_string() + ".json");
    let Ok(text) = std::fs::read_to_string(&meta) else { return Vec::new() };
    let m: Value = serde_json::from_str(&text).unwrap();
    m["log"]
        .as_array()
        .map(|log| {
            log.iter()
                .filter_map(|l| ["oom", "exception"].iter().find_map(|k| l[*k].as_str().filter(|s| s.starts_with("CUDA out of memory.")).map(str::to_string)))
                .collect()
        })
        .unwrap_or_default()
}

/// The allowed maximum a run was recorded under, from its .json: `cap_bytes`, else
/// `(size_t)(fraction × total)`.
fn real_cap(path: &Path) -> u64 {
    let meta = PathBuf::from(path.to_str().unwrap().trim_end_matches(".pickle.gz").to_string() + ".json");
    let m: Value = serde_json::from_str(&std::fs::read_to_string(meta).unwrap()).unwrap();
    match m["cap_bytes"].as_u64().filter(|&c| c > 0) {
        Some(c) => c,
        None => (m["fraction"].as_f64().unwrap() * m["device_total_memory"].as_f64().unwrap()) as u64,
    }
}

/// Every recording with OOMs under `dir`.
fn oom_recordings(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir).unwrap().filter_map(|e| e.ok().map(|e| e.path())).collect();
    v.sort();
    for p in v {
        if p.to_str().unwrap().ends_with(".pickle.gz") && !recorded_messages(&p).is_empty() {
            out.push(p);
        }
    }
}

/// The request number (the ordinal of the trace's `alloc`/`oom` entries) of the last OOM entry,
/// and the numbers of all of them.
fn recorded_ooms(path: &Path) -> Vec<u64> {
    let snap = read_trace(path).unwrap();
    assert_eq!(snap.device_traces.iter().filter(|t| !t.is_empty()).count(), 1, "{}: one device", path.display());
    let trace = snap.device_traces.iter().find(|t| !t.is_empty()).unwrap();
    trace
        .iter()
        .filter(|e| matches!(e.action, Action::Alloc | Action::Oom))
        .enumerate()
        .filter(|(_, e)| e.action == Action::Oom)
        .map(|(i, _)| i as u64)
        .collect()
}

/// Whether a `replay --json` answer serves request `req` and every request before it except those
/// the trace recorded as OOMs.
fn serves(replay: &Value, req: u64, recorded: &[u64]) -> bool {
    replay["ooms"].as_array().unwrap().iter().map(|o| o["request"].as_u64().unwrap()).filter(|&r| r <= req).all(|r| r != req && recorded.contains(&r))
}

#[test]
fn every_oom_recording_leads_with_its_verdict() {
    let mut files = Vec::new();
    oom_recordings(&root("traces"), &mut files);
    oom_recordings(&root("traces/field"), &mut files);
    let local = files.len();
    let shared = reference::shared(&root(""), "traces");
    if let Some(dir) = &shared {
        oom_recordings(dir, &mut files);
    }
    // 18 in the repository (frag, crossstream, kvcache under caps, the field recordings of full
    // devices and memory fractions); 8 more in ../shared/traces (frag and synthetic under caps).
    assert_eq!(local, 18, "OOM recordings in traces/ and traces/field");
    reference::expect_count("OOM recordings in ../shared/traces", files.len() - local, if shared.is_some() { 8 } else { 0 });
    let (mut settings, mut memory, mut intervals, mut known_misses) = (0, 0, 0, 0);
    for path in &files {
        let name = path.file_name().unwrap().to_str().unwrap();
        let p = path.to_str().unwrap();
        let messages = recorded_messages(path);
        let ooms = recorded_ooms(path);
        assert_eq!(ooms.len(), messages.len(), "{name}: OOM entries against the messages its run printed");
        let last = *ooms.last().unwrap();
        let out = success(&["explain", p]);
        let head: Vec<&str> = out.lines().take(6).collect();
        assert!(head[0].starts_with(&format!("Out of memory at request {last}: ")), "{name}: not the last OOM first:\n{out}");
        assert!(head.iter().any(|l| l.starts_with("Cause: ")), "{name}: no cause in the first six lines:\n{out}");
        assert!(head.iter().any(|l| l.starts_with("Fix")), "{name}: no fix in the first six lines:\n{out}");
        let x = json(&["explain", p, "--json"]);
        let mut real = without_nvml(messages.last().unwrap());
        if name == "mempool_oom__default.pickle.gz" && !out.contains("with 20.00 MiB allocated in private pools") {
            // A limit of what a trace records (every OOM of this recording, in `replay` too): the
            // job's `MemPool(no_split=True)` served one request in each of its two segments
            // (1 MiB + 1 in 20 MiB, 1000 bytes in 2 MiB), which took the whole blocks; the trace's
            // entries record requested sizes only, and nothing else was allocated there, so the
            // pool's `no_split` leaves no trace. The replay splits those blocks: PyTorch's free
            // memory in private pools is 20 MiB (the `use_on_oom` pool's), the replay's 41 MiB
            // (the sum with the allocated bytes, the message's first figure, is the same).
            real = real.replacen("with 20.00 MiB allocated in private pools", "with 41.00 MiB allocated in private pools", 1);
            known_misses += 1;
        }
        let shown = head.iter().find(|l| l.starts_with("PyTorch's message")).unwrap_or_else(|| panic!("{name}: no message in the first six lines:\n{out}"));
        if let Some(m) = shown.strip_prefix("PyTorch's message: ") {
            assert_eq!(m, real, "{name}: the message is not PyTorch's");
        } else {
            // An allowed maximum inferred as an interval: the real one lies in it, and the rest of
            // the message is PyTorch's.
            let m = shown.split_once("): ").unwrap().1;
            let b = &x["budget"];
            let (lo, hi) = (b["low"].as_u64().unwrap(), b["high"].as_u64().unwrap());
            let cap = real_cap(path);
            assert!(lo <= cap && cap <= hi, "{name}: the real allowed maximum {cap} is not in [{lo}, {hi}]");
            let unallowed = |s: &str| {
                let (a, rest) = s.split_once(" allowed; ").unwrap();
                format!("{}? allowed; {rest}", &a[..a.rfind(". ").unwrap() + 2])
            };
            assert_eq!(unallowed(m), unallowed(&real), "{name}: the message is not PyTorch's");
            intervals += 1;
        }
        // The fix, checked by another command.
        assert_eq!(x["request"].as_u64(), Some(last), "{name}");
        let fix = &x["fix"];
        match fix["kind"].as_str().unwrap() {
            "setting" => {
                let conf = fix["conf"].as_str().unwrap();
                let r = json(&["replay", p, "--config", conf, "--json"]);
                assert!(serves(&r, last, &ooms), "{name}: {conf} does not serve request {last}: {}", r["ooms"]);
                settings += 1;
            }
            "memory" => {
                // The same question asked of the library: the trace prepared as every command
                // prepares it (its own budget inferred), replayed under the allowed maximum given.
                // (`replay --capacity` under the trace's own settings takes the capacity for the
                // one the trace was recorded under, and infers the trace's `empty_cache()` calls
                // under it: another question.)
                let needed = fix["needed"].as_u64().unwrap();
                let snap = read_trace(path).unwrap();
                let prepared = allocsim_commands::TraceOptions::default().prepare(&snap).unwrap();
                let replay = |cap: u64| {
                    let o = prepared.replay(&prepared.own, Some(cap), prepared.recorded_placement());
                    serde_json::json!({"ooms": o.ooms.iter().map(|o| serde_json::json!({"request": o.request})).collect::<Vec<_>>()})
                };
                let at = replay(needed);
                assert!(serves(&at, last, &ooms), "{name}: {needed} bytes do not serve request {last}: {}", at["ooms"]);
                let below = replay(needed - (2 << 20));
                assert!(!serves(&below, last, &ooms), "{name}: {needed} bytes are not the smallest");
                memory += 1;
            }
            other => panic!("{name}: no fix found ({other}):\n{out}"),
        }
    }
    eprintln!(
        "{} OOM recordings: {settings} fixed by a setting, {memory} by memory; {intervals} with an allowed maximum known as an interval; {known_misses} known miss",
        files.len()
    );
}
