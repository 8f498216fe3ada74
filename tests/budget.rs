//! The memory budget inferred from a trace (`allocsim_replay::budget`), as a user meets it: the
//! commands run with no `--capacity` and no `--device-memory`.
//!
//! * Fraction-capped real runs (`traces/frag__*__2048M`, recorded under a 2 GiB cap): the inferred
//!   interval holds the real cap (`int(fraction × total)` from the run's .json), and `validate`
//!   is exact without `--capacity`.
//! * A device that was full: the real frag run under a 2 GiB cap made the same decisions a run
//!   with 2 GiB available on a full device makes (`cudaMalloc` of S fails exactly when reserved +
//!   S > 2 GiB, the cap's own test), so with each OOM entry's `device_free` set to what such a
//!   device reports (2 GiB − reserved) it is a device-full recording. `validate` must be exact
//!   and `explain` must print PyTorch's numbers from the run's .json, with "of which X is free"
//!   from the device.
//! * A neighbour whose usage changes between two OOMs, written out by hand below with the
//!   allocator's decisions reasoned step by step.

mod common;

use allocsim_model::format::format_size;
use allocsim_trace::{Action, read_trace, write_trace};
use common::{TempFile, json, root, run, show, success};

/// A run's .json (`name` relative to `traces/`).
fn meta(name: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(root(&format!("traces/{name}.json"))).unwrap()).unwrap()
}

/// The allowed maximum a run was recorded under: `(size_t)(fraction * total)`.
fn real_cap(m: &serde_json::Value) -> u64 {
    (m["fraction"].as_f64().unwrap() * m["device_total_memory"].as_f64().unwrap()) as u64
}

#[test]
fn capped_runs_validate_without_capacity_and_the_interval_holds_the_cap() {
    let mut checked = 0;
    for name in ["frag__default__2048M", "frag__expandable__2048M"] {
        let path = root(&format!("traces/{name}.pickle.gz"));
        let path = path.to_str().unwrap();
        let cap = real_cap(&meta(name));
        let v = json(&["validate", path, "--json"]);
        assert_eq!(v["exact"], true, "{name}: {v}");
        let b = &v["budget"];
        assert_eq!(b["kind"], "allowed_maximum", "{name}: {b}");
        let (lo, hi) = (b["low"].as_u64().unwrap(), b["high"].as_u64().unwrap());
        assert!(lo <= cap && cap <= hi, "{name}: the real cap {cap} is outside [{lo}, {hi}]");
        // The OOMs are the evidence: all three recorded requests.
        assert_eq!(b["from"], serde_json::json!([300, 301, 302]), "{name}");
        checked += 1;
    }
    assert_eq!(checked, 2);
}

/// PyTorch's message of the frag run's OOM `i` (0, 1, 2), as recorded.
fn recorded_message(i: usize) -> String {
    meta("frag__default__2048M")["log"][i]["exception"].as_str().unwrap().to_string()
}

/// The text between `before` and `after` in `s`.
fn between<'a>(s: &'a str, before: &str, after: &str) -> &'a str {
    let i = s.find(before).unwrap_or_else(|| panic!("{before:?} not in {s}")) + before.len();
    let j = s[i..].find(after).unwrap_or_else(|| panic!("{after:?} not after {before:?} in {s}")) + i;
    &s[i..j]
}

#[test]
fn device_full_run_validates_and_explains_with_pytorchs_numbers() {
    const AVAILABLE: u64 = 2 << 30;
    let mut snap = read_trace(&root("traces/frag__default__2048M.pickle.gz")).unwrap();
    // device_free as a full device with 2 GiB for this process reports it: 2 GiB − reserved.
    let mut reserved = 0u64;
    let mut frees = Vec::new();
    for e in snap.device_traces[0].iter_mut() {
        match e.action {
            Action::SegmentAlloc | Action::SegmentMap => reserved += e.size,
            Action::SegmentFree | Action::SegmentUnmap => reserved -= e.size,
            Action::Oom => {
                e.addr = AVAILABLE - reserved;
                frees.push(e.addr);
            }
            _ => {}
        }
    }
    assert_eq!(frees.len(), 3);
    // Smaller than each request: the device itself is out of memory.
    assert!(frees.iter().all(|&f| f < 256 << 20), "{frees:?}");
    let file = TempFile::new("devfull-frag.pickle.gz");
    write_trace(&snap, &file.0).unwrap();

    let v = success(&["validate", file.arg()]);
    assert!(v.trim_end().ends_with("exact") && !v.contains("NOT exact"), "{v}");
    let r = json(&["replay", file.arg(), "--json"]);
    let b = &r["budget"];
    assert_eq!(b["kind"], "device_full", "{b}");
    assert_eq!(b["device_full"][0]["device_free"].as_u64(), Some(frees[0]));
    assert_eq!(b["device_full"][0]["available"].as_u64(), Some(AVAILABLE));
    assert_eq!(r["ooms"].as_array().unwrap().len(), 3);
    assert_eq!(r["capacity"], serde_json::Value::Null, "a full device is not an allowed maximum");

    // explain with no flags: the last recorded OOM (the one that ended the run), its verdict
    // first, with PyTorch's numbers.
    let out = success(&["explain", file.arg()]);
    let real = recorded_message(2);
    let tried = between(&real, "Tried to allocate ", ".");
    let allocated = between(&real, "Of the allocated memory ", " is allocated by PyTorch");
    let unallocated = between(&real, "is allocated by PyTorch, and ", " is reserved by PyTorch but unallocated");
    let verdict: Vec<&str> = out.lines().take(6).collect();
    let msg = verdict.iter().find_map(|l| l.strip_prefix("PyTorch's message: ")).unwrap_or_else(|| panic!("no message in the first six lines:\n{out}"));
    assert!(msg.contains(&format!("Tried to allocate {tried}.")), "{msg}");
    assert!(msg.contains(&format!("Of the allocated memory {allocated} is allocated by PyTorch")), "{msg}");
    assert!(msg.contains(&format!("and {unallocated} is reserved by PyTorch but unallocated")), "{msg}");
    assert!(msg.contains(&format!("of which {} is free.", format_size(frees[2]))), "{msg}");
    assert!(!msg.contains("allowed;"), "no allowed maximum on a full device: {msg}");
    assert!(out.starts_with("Out of memory at request 302: 1024.00 MiB"), "{out}");
    assert!(verdict[1].starts_with("The last of 3 OOMs the trace recorded, the one that ended the run"), "{out}");
    // 606 MiB of 6 MiB tensors and the 1 GiB request fit in the 2 GiB the job had: the 1.36 GiB
    // reserved but unallocated lies in 14 MiB pieces.
    assert!(verdict[2].starts_with("Cause: fragmentation. 1.36 GiB was reserved but unallocated"), "{out}");
    for (r, size) in [(300, "256.00 MiB"), (301, "512.00 MiB")] {
        assert!(
            out.lines().any(|l| l.starts_with(&format!("  request {r} ")) && l.contains(size) && l.contains("survived")),
            "the OOMs before it, survived: {out}"
        );
    }
}

/// One event line of a JSON Lines trace.
fn ev(action: &str, addr: u64, size: u64) -> String {
    let key = if action == "oom" { "device_free" } else { "addr" };
    format!("{{\"action\":\"{action}\",\"{key}\":{addr},\"size\":{size}}}")
}

const MIB: u64 = 1 << 20;
const BASE: u64 = 0x7f00_0000_0000;

fn seg_line(addr: u64, size: u64, blocks: &[(u64, u64, &str)]) -> String {
    let b: Vec<String> = blocks.iter().map(|&(a, s, st)| format!("{{\"address\":{a},\"size\":{s},\"requested_size\":{s},\"state\":\"{st}\"}}")).collect();
    format!("{{\"segment\":{{\"address\":{addr},\"total_size\":{size},\"blocks\":[{}]}}}}", b.join(","))
}

/// A job beside a neighbour that holds all but 350 MiB for it, then all but 700 MiB. All sizes
/// are whole MiB above 10 MiB, so each segment is exactly its request (`get_allocation_size`).
///
/// * r0, r1, r2: 100 MiB each, a new segment each (300 MiB reserved). r2 is freed: its segment
///   is cached.
/// * r3: 200 MiB. No cached block fits; `cudaMalloc(200)` needs 500 > 350 and fails;
///   `release_cached_blocks` frees r2's segment (200 reserved); the retry needs 400 > 350: out of
///   memory with 350 − 200 = 150 MiB free.
/// * The neighbour shrinks: 700 MiB for the job. r4: 100 MiB, a new segment (300). r5: 300 MiB, a
///   new segment (600).
/// * r6: 200 MiB. Needs 800 > 700; nothing cached to release: out of memory with 100 MiB free.
/// * r5 is freed; r7 (150 MiB) splits its cached 300 MiB segment.
fn neighbour_trace() -> String {
    let a = |k: u64| BASE + k * 0x1000_0000;
    let mut l = vec![r#"{"format":"allocsim-trace","version":1,"devices":1,"allocator_settings":{"PYTORCH_CUDA_ALLOC_CONF":""}}"#.to_string()];
    for k in 0..3 {
        l.push(ev("segment_alloc", a(k), 100 * MIB));
        l.push(ev("alloc", a(k), 100 * MIB));
    }
    l.push(ev("free_requested", a(2), 100 * MIB));
    l.push(ev("free_completed", a(2), 100 * MIB));
    l.push(ev("segment_free", a(2), 100 * MIB));
    l.push(ev("oom", 150 * MIB, 200 * MIB));
    l.push(ev("segment_alloc", a(3), 100 * MIB));
    l.push(ev("alloc", a(3), 100 * MIB));
    l.push(ev("segment_alloc", a(4), 300 * MIB));
    l.push(ev("alloc", a(4), 300 * MIB));
    l.push(ev("oom", 100 * MIB, 200 * MIB));
    l.push(ev("free_requested", a(4), 300 * MIB));
    l.push(ev("free_completed", a(4), 300 * MIB));
    l.push(ev("alloc", a(4), 150 * MIB));
    for k in [0, 1, 3] {
        l.push(seg_line(a(k), 100 * MIB, &[(a(k), 100 * MIB, "active_allocated")]));
    }
    l.push(seg_line(a(4), 300 * MIB, &[(a(4), 150 * MIB, "active_allocated"), (a(4) + 150 * MIB, 150 * MIB, "inactive")]));
    l.join("\n") + "\n"
}

#[test]
fn a_neighbour_that_changes_its_usage_is_followed_over_time() {
    let file = TempFile::new("neighbour.jsonl");
    std::fs::write(&file.0, neighbour_trace()).unwrap();
    let h200 = 150_109_880_320u64;

    let v = success(&["validate", file.arg()]);
    assert!(v.trim_end().ends_with("exact") && !v.contains("NOT exact"), "{v}");
    let r = json(&["replay", file.arg(), "--json"]);
    let b = &r["budget"];
    assert_eq!(b["kind"], "device_full", "{b}");
    assert_eq!(b["device_memory_source"], "default", "{b}");
    // 350 MiB available up to r3, 700 MiB from r4 on; the rest of the (assumed) H200 is outside.
    assert_eq!(b["outside"], serde_json::json!([{"from_request": 0, "bytes": h200 - 350 * MIB}, {"from_request": 4, "bytes": h200 - 700 * MIB}]), "{b}");
    let ooms = r["ooms"].as_array().unwrap();
    assert_eq!(ooms.iter().map(|o| o["request"].as_u64().unwrap()).collect::<Vec<_>>(), [3, 6]);
    // r3's retry released r2's cached segment first: the real failure path.
    assert!(r["segment_events"].as_array().unwrap().iter().any(|e| e["action"] == "segment_free" && e["request"] == 3), "{}", r["segment_events"]);
    let m3 = ooms[0]["message"].as_str().unwrap();
    assert!(m3.contains("Tried to allocate 200.00 MiB. GPU 0 has a total capacity of 139.80 GiB of which 150.00 MiB is free."), "{m3}");
    assert!(m3.contains("Of the allocated memory 200.00 MiB is allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated."), "{m3}");
    let m6 = ooms[1]["message"].as_str().unwrap();
    assert!(m6.contains("of which 100.00 MiB is free."), "{m6}");
    assert!(m6.contains("Of the allocated memory 600.00 MiB is allocated by PyTorch, and 0 bytes is reserved"), "{m6}");

    // explain with no flags: the last OOM, r6. 600 MiB live and 200 MiB asked for are more than the
    // 700 MiB the job could have.
    let out = success(&["explain", file.arg()]);
    assert!(out.starts_with("Out of memory at request 6: 200.00 MiB"), "{out}");
    assert!(out.contains("\nThe last of 2 OOMs the trace recorded; requests follow each of them"), "{out}");
    assert!(out.contains("\nCause: the device was full. It had 100.00 MiB free"), "{out}");
    assert!(out.contains("the allocator could hold 700.00 MiB (600.00 MiB reserved + 100.00 MiB free)"), "{out}");
    // No setting helps (nothing is cached to release or reuse). With more memory r3, the OOM the
    // job caught, is served too and stays allocated (the trace never frees it): r0, r1, r3, r4 and
    // r5 hold 800 MiB when r6 asks for 200 MiB, so the allocator needs 1000 MiB, 300 MiB more than
    // the 700 MiB it could hold.
    assert!(
        out.contains(
            "\nFix (checked by replaying the same requests): no setting tried helps; 1000.00 MiB for the allocator (300.00 MiB more than it could hold"
        ),
        "{out}"
    );

    // A what-if under the job's own budget: expandable segments map only what they need, and
    // still run out at r3 (200 + 200 > 350).
    let w = json(&["replay", file.arg(), "--json", "--config", "expandable_segments:True"]);
    assert_eq!(w["first_oom"], 3, "{w}");
    // --capacity replaces the inferred budget: 1 GiB allowed and nothing outside, no OOM.
    let c = json(&["replay", file.arg(), "--json", "--capacity", "1GiB"]);
    assert_eq!(c["ooms"].as_array().unwrap().len(), 0, "{c}");
}

#[test]
fn device_memory_given_is_used() {
    let file = TempFile::new("neighbour-dm.jsonl");
    std::fs::write(&file.0, neighbour_trace()).unwrap();
    let args = ["replay", file.arg(), "--json", "--device-memory", "80GiB"];
    let o = run(&args);
    assert_eq!(o.status.code(), Some(0), "{}", show(&args, &o));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["budget"]["device_memory"].as_u64(), Some(80 << 30));
    assert!(r["ooms"][0]["message"].as_str().unwrap().contains("total capacity of 80.00 GiB of which 150.00 MiB is free"));
}

/// PyTorch's message without NVML's per-process sentences ("Process N has X memory in use. ",
/// "Including non-PyTorch memory, this process has X memory in use. "), which a trace cannot show.
fn without_nvml(msg: &str) -> String {
    let mut out = String::new();
    for sentence in msg.split_inclusive(". ") {
        let nvml = (sentence.starts_with("Process ") || sentence.starts_with("Including non-PyTorch memory, this process has "))
            && sentence.ends_with(" memory in use. ");
        if !nvml {
            out.push_str(sentence);
        }
    }
    out
}

/// Real H200 recordings kept in `traces/field` (torch 2.11, `tools/record_field.py`): a second process
/// holding all but a few GiB of the GPU (`devfull_*`), and `set_per_process_memory_fraction` caps
/// (`fraccap_*`). With no flags, `validate` is exact, the budget is of the right kind (holding the
/// real cap), and every OOM message is PyTorch's own, as the run's .json recorded it.
#[test]
fn recorded_full_devices_and_caps_need_no_flags() {
    let mut runs: Vec<String> = std::fs::read_dir(root("traces/field"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| (n.starts_with("devfull_") || n.starts_with("fraccap_")) && n.ends_with(".pickle.gz"))
        .map(|n| format!("field/{}", n.trim_end_matches(".pickle.gz")))
        .collect();
    runs.sort();
    assert_eq!(runs.len(), 6, "{runs:?}");
    let mut messages = 0;
    for name in &runs {
        let path = root(&format!("traces/{name}.pickle.gz"));
        let path = path.to_str().unwrap();
        let m = meta(name);
        let v = json(&["validate", path, "--json"]);
        assert_eq!(v["exact"], true, "{name}: {v}");
        let b = &v["budget"];
        match m["cap_bytes"].as_u64() {
            Some(cap) => {
                assert_eq!(b["kind"], "allowed_maximum", "{name}: {b}");
                let (lo, hi) = (b["low"].as_u64().unwrap(), b["high"].as_u64().unwrap());
                assert!(lo <= cap && cap <= hi, "{name}: the real cap {cap} is outside [{lo}, {hi}]");
            }
            None => assert_eq!(b["kind"], "device_full", "{name}: {b}"),
        }
        let r = json(&["replay", path, "--json"]);
        // History began after the process's first CUDA allocation, so the counters count one
        // allocation more than the trace shows; what is held at the end and the OOMs are knowable.
        for k in ["num_ooms", "reserved_bytes.all.current", "allocated_bytes.all.current", "active_bytes.all.current", "segment.all.current"] {
            assert_eq!(r["stats"][k], m["memory_stats"][k], "{name}: {k}");
        }
        let real: Vec<String> = m["log"].as_array().unwrap().iter().map(|l| without_nvml(l["oom"].as_str().unwrap())).collect();
        let sim: Vec<&str> = r["ooms"].as_array().unwrap().iter().map(|o| o["message"].as_str().unwrap()).collect();
        assert_eq!(real.len(), sim.len(), "{name}: OOMs");
        for (a, b) in real.iter().zip(&sim) {
            assert_eq!(a, b, "{name}");
            messages += 1;
        }
        // explain with no flags: the last recorded OOM, PyTorch's message in its first six lines.
        let out = success(&["explain", path]);
        let last = real.last().unwrap();
        // (Under an allowed maximum inferred as an interval the line says so, before the message.)
        let shown = out
            .lines()
            .take(6)
            .find_map(|l| l.strip_prefix("PyTorch's message").map(|m| m.strip_prefix(": ").or_else(|| m.split_once("): ").map(|(_, m)| m)).unwrap_or("")));
        assert_eq!(shown, Some(last.as_str()), "{name}: explain does not lead with PyTorch's message:\n{out}");
    }
    assert!(messages >= 20, "{messages} messages compared");
}

#[path = "support/reference.rs"]
mod reference;

/// Missing reference data is a note, or a failure when required (`ALLOCSIM_REQUIRE_SHARED=1`, as
/// `.ci/run` sets it); fewer items than expected always fail.
#[test]
fn missing_reference_data_fails_when_required() {
    let nowhere = std::path::Path::new("/nonexistent/allocsim");
    let r = std::panic::catch_unwind(|| reference::shared(nowhere, "traces"));
    if reference::required() {
        assert!(r.is_err(), "required but missing data did not fail");
    } else {
        assert_eq!(r.ok(), Some(None));
    }
    assert!(std::panic::catch_unwind(|| reference::expect_count("runs", 31, reference::SHARED_TRACE_RUNS)).is_err());
    reference::expect_count("runs", reference::SHARED_TRACE_RUNS, reference::SHARED_TRACE_RUNS);
}
