//! What a user hits the first time they run allocsim on a snapshot from their own job: call sites
//! in C++-heavy stacks, several devices, JSON-saved snapshots, older and partial files, wording.
//! Each test builds its input from a real recording (`traces/`, `tests/fixtures/field/`: torch
//! 2.11 on an H200) the way a user's file differs from it.

use std::path::PathBuf;

use allocsim_trace::{Frame, Snapshot, read_trace, write_trace};
use serde_json::Value;

mod common;
use common::*;

const FRAG: &str = "traces/frag__default__2048M.pickle.gz";
/// Recorded with `_record_memory_history()` defaults: C++ frames in every stack.
const TINY_STACKS_ALL: &str = "tests/fixtures/field/tiny_stacks_all__default.pickle.gz";

fn fr(name: &str, filename: &str) -> Frame {
    Frame { name: name.into(), filename: filename.into(), line: 0 }
}

/// `snap` as `_record_memory_history(stacks="all")` would have recorded it: every stack starts
/// with the unwinder, the allocator, ATen's dispatch and CPython's C frames (file `??` or a
/// basename, line 0, as torch 2.11 writes them), then a frame of PyTorch's own Python, then the
/// recorded Python frames.
fn with_cpp_frames(snap: &Snapshot) -> Snapshot {
    let site_packages = "/opt/venv/lib/python3.12/site-packages/torch";
    let prefix = vec![
        fr("torch::unwind::unwind()", "??"),
        fr("torch::CapturedTraceback::gather(bool, bool, bool)", "??"),
        fr("torch::cuda::(anonymous namespace)::gather_with_cpp()", "memory_snapshot.cpp"),
        fr("c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(unsigned long, CUstream_st*)", "CUDACachingAllocator.cpp"),
        fr("c10::cuda::CUDACachingAllocator::Native::NativeCachingAllocator::allocate(unsigned long)", ""),
        fr("at::detail::empty_generic(c10::ArrayRef<long>, c10::Allocator*, c10::DispatchKeySet, c10::ScalarType, std::optional<c10::MemoryFormat>)", "??"),
        fr(
            "at::native::empty_cuda(c10::ArrayRef<long>, std::optional<c10::ScalarType>, std::optional<c10::Layout>, std::optional<c10::Device>, std::optional<bool>, std::optional<c10::MemoryFormat>)",
            "??",
        ),
        fr(
            "at::_ops::empty_memory_format::call(c10::ArrayRef<c10::SymInt>, std::optional<c10::ScalarType>, std::optional<c10::Layout>, std::optional<c10::Device>, std::optional<bool>, std::optional<c10::MemoryFormat>)",
            "??",
        ),
        fr("torch::autograd::THPVariable_empty(_object*, _object*, _object*)", "python_torch_functions_0.cpp"),
        fr("_PyEval_EvalFrameDefault", "??"),
        fr("PyEval_EvalCode", "??"),
        fr("Py_RunMain", "??"),
        fr("__libc_start_main", "??"),
        fr("_start", "??"),
        Frame { name: "_call_impl".into(), filename: format!("{site_packages}/nn/modules/module.py"), line: 1784 },
    ];
    let mut s = snap.clone();
    for stack in s.stacks.iter_mut().filter(|st| !st.is_empty()) {
        let python = std::mem::take(stack);
        *stack = prefix.iter().cloned().chain(python).collect();
    }
    s
}

fn write(snap: &Snapshot, name: &str) -> TempFile {
    let t = TempFile::new(name);
    write_trace(snap, &t.0).unwrap_or_else(|e| panic!("{}: {e}", t.0.display()));
    t
}

fn load(rel: &str) -> Snapshot {
    let p: PathBuf = root(rel);
    read_trace(&p).unwrap_or_else(|e| panic!("{}: {e} (required test data)", p.display()))
}

// ----- call sites -----

/// The call sites `explain` prints: after `from ` (the request, the pinning sites) and `) at `
/// (the blocks of pinned segments).
fn call_sites(explain: &str) -> Vec<&str> {
    explain
        .lines()
        .filter_map(|l| {
            l.trim_start()
                .strip_prefix("from ")
                .or_else(|| l.contains(" pinned by ").then(|| l.split_once(") from ").map(|(_, s)| s)).flatten())
                .or_else(|| l.split_once(") at ").map(|(_, s)| s))
        })
        .collect()
}

/// The frag recording's requests come from `gpu/record.py` (its Python stacks say so); with C++
/// frames in front of them, every call site must still be that file, never the unwinder.
#[test]
fn call_sites_skip_cpp_frames_and_torch_files() {
    let orig = load(FRAG);
    let site = "gpu/record.py:61 in w_frag"; // the 256 MiB requests that run out of memory
    let t = write(&with_cpp_frames(&orig), "cpp-frames.pickle.gz");
    let explain = success(&["explain", t.arg(), "--capacity", "2GiB"]);
    assert!(explain.contains(&format!("  from {site}\n")), "{explain}");
    for site in call_sites(&explain) {
        assert!(site.starts_with("gpu/record.py:"), "not the user's code as a call site: {site}\n{explain}");
    }
    // Pinning blocks: the 6 MiB tensors kept, allocated in gpu/record.py too.
    let pinning = explain.split("by where they were allocated:").nth(1).expect("pinning sites");
    assert!(pinning.lines().nth(1).unwrap().contains("from gpu/record.py:"), "{explain}");
    let sweep = success(&["sweep", t.arg(), "--capacity", "2GiB", "--grid", "max_split_size_mb=none,128"]);
    assert!(sweep.contains(&format!("at {site}")), "{sweep}");
    assert!(!sweep.contains("unwind"), "{sweep}");
    // The whole stack stays available: `--json` has every frame, C++ ones included.
    let j = json(&["explain", t.arg(), "--capacity", "2GiB", "--json"]);
    let frames = j["frames"].as_array().unwrap();
    assert_eq!(frames[0]["name"], "torch::unwind::unwind()");
    assert_eq!(frames.len(), 15 + 1 + frames.iter().skip(16).count(), "the C++ prefix, PyTorch's frame, the recorded frames");
    assert!(frames[15..].iter().any(|f| f["filename"] == "gpu/record.py"), "{frames:?}");
    assert_eq!(j["call_site"], site);
    let sites = j["pinning_sites"].as_array().unwrap();
    assert!(sites.iter().all(|s| s["frames"].as_array().is_some_and(|f| f[0]["name"] == "torch::unwind::unwind()")), "{sites:?}");
}

/// A real `_record_memory_history()` recording (C++ frames in every stack, Python frames after
/// the C library's): no call site is a C++ unwinder or allocator frame.
#[test]
fn call_sites_of_a_real_stacks_all_recording() {
    let snap = load(TINY_STACKS_ALL);
    assert!(snap.stacks.iter().filter(|s| !s.is_empty()).all(|s| s[0].name == "torch::unwind::unwind()"), "the recording has C++ frames first");
    let out = success(&["explain", TINY_STACKS_ALL, "--at", "peak"]);
    let sites = call_sites(&out);
    assert!(sites.len() > 5, "{out}");
    for site in sites {
        assert!(!["torch::", "c10::", "??", "at::detail::", "at::native::empty", "_Py"].iter().any(|p| site.starts_with(p)), "{site}\n{out}");
        assert!(!site.contains("site-packages/torch/") && !site.starts_with("torch/"), "PyTorch's own file: {site}\n{out}");
    }
    // The recording script's own file (its Python frames name it) is where the tensors come from.
    assert!(out.contains("record_field.py:"), "{out}");
    let page = TempFile::new("stacks-all.html");
    success(&["report", TINY_STACKS_ALL, "-o", page.arg()]);
    let html = std::fs::read_to_string(&page.0).unwrap();
    assert!(html.contains("record_field.py:"), "the report's tooltips name the user's file");
    assert!(!html.contains(" at torch::unwind::unwind()"), "a C++ unwinder frame as a call site in the report");
}

// ----- several devices -----

/// `a`'s device 0 and `b`'s device 0 as devices 0 and 1 of one snapshot (stacks renumbered,
/// `b`'s segments moved to device 1): a two-GPU job's snapshot.
fn two_devices(a: &Snapshot, b: &Snapshot) -> Snapshot {
    assert!(a.entry_metas.is_empty() && b.entry_metas.is_empty(), "inputs without per-entry metadata");
    let mut s = a.clone();
    let off = s.stacks.len() as u32 - 1;
    let re = |id: u32| if id == 0 { 0 } else { id + off };
    s.stacks.extend(b.stacks.iter().skip(1).cloned());
    let mut t = b.device_traces[0].clone();
    for e in &mut t {
        e.stack = re(e.stack);
    }
    s.device_traces = vec![a.device_traces[0].clone(), t];
    for seg in &b.segments {
        let mut seg = seg.clone();
        seg.device = 1;
        for blk in &mut seg.blocks {
            blk.stack = re(blk.stack);
        }
        s.segments.push(seg);
    }
    s
}

/// A recorded `memory_stats()` value of a trace's metadata (`<trace>.json` beside it).
fn recorded_stat(trace: &str, key: &str) -> u64 {
    let meta = root(&trace.replace(".pickle.gz", ".json"));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&meta).unwrap_or_else(|e| panic!("{}: {e} (required test data)", meta.display()))).unwrap();
    v["memory_stats"][key].as_u64().unwrap_or_else(|| panic!("{}: no memory_stats[{key}]", meta.display()))
}

const EMPTYCACHE: &str = "traces/emptycache__default__0M.pickle.gz";
const UNET: &str = "traces/unet512__default__0M.pickle.gz";

/// Device 1 ran out of memory (the frag recording under its 2 GiB cap), device 0 did not: every
/// command answers for device 1 without `--device`, says so and why, and answers as `--device 1`.
#[test]
fn several_devices_answer_for_the_one_that_ran_out_of_memory() {
    let t = write(&two_devices(&load(EMPTYCACHE), &load(FRAG)), "two-gpus.pickle.gz");
    let f = t.arg();
    let said = |text: &str| text.contains("answering for device 1 of 2 with entries: it ran out of memory");
    // replay: the device with the OOM first; --json puts it at the top and says why.
    let text = success(&["replay", f]);
    assert!(text.find("(device 1)").unwrap() < text.find("(device 0)").unwrap(), "{text}");
    let j = json(&["replay", f, "--json"]);
    assert_eq!((j["device"].as_u64(), j["device_choice"]["device"].as_u64()), (Some(1), Some(1)), "{}", j["device_choice"]);
    assert_eq!(j["device_choice"]["reason"], "ran_out_of_memory");
    // validate: every device, each exact (both recordings replay exactly on their own).
    let v = success(&["validate", f]);
    assert_eq!(v.matches("\n  exact\n").count(), 2, "{v}");
    let vj = json(&["validate", f, "--json"]);
    assert_eq!((vj["device"].as_u64(), vj["exact"].as_bool(), vj["devices"].as_array().map(Vec::len)), (Some(1), Some(true), Some(2)));
    let v0 = json(&["validate", f, "--json", "--device", "0"]);
    assert_eq!(v0["device"].as_u64(), Some(0));
    // explain: the frag recording's last OOM, the one that ended the run, is request 302, a
    // 1 GiB tensor.
    let x = success(&["explain", f]);
    assert!(said(&x), "{x}");
    assert!(x.contains("\nOut of memory at request 302: 1024.00 MiB"), "{x}");
    let x0 = success(&["explain", f, "--device", "0"]);
    assert!(!x0.contains("answering for") && x0.contains("no request runs out of memory"), "{x0}");
    // sweep, fit, phases: text says which device; JSON equals --device 1's.
    let grid = "max_split_size_mb=none,128";
    let s = success(&["sweep", f, "--grid", grid]);
    assert!(said(s.lines().next().unwrap()), "{s}");
    let strip = |mut v: Value| {
        v["seconds"] = Value::Null;
        v
    };
    assert_eq!(strip(json(&["sweep", f, "--grid", grid, "--json"])), strip(json(&["sweep", f, "--grid", grid, "--json", "--device", "1"])));
    assert_eq!(json(&["fit", f, "--json"]), json(&["fit", f, "--json", "--device", "1"]));
    let ph = success(&["phases", f]);
    assert!(said(&ph) && ph.contains("Device 1:"), "{ph}");
    // compare: each file's device 1.
    let c = success(&["compare", f, f]);
    assert_eq!(c.matches("answering for device 1").count(), 2, "{c}");
    // report and export: a note on stderr; export writes device 1's run.
    let page = TempFile::new("two-gpus.html");
    let o = run(&["report", f, "-o", page.arg()]);
    assert!(o.status.success() && said(&String::from_utf8_lossy(&o.stderr)), "{}", show(&["report"], &o));
    let out = TempFile::new("two-gpus-sim.pickle.gz");
    let o = run(&["export", f, "-o", out.arg()]);
    assert!(o.status.success() && said(&String::from_utf8_lossy(&o.stderr)), "{}", show(&["export"], &o));
    let sim = read_trace(&out.0).unwrap();
    assert!(sim.device_traces.len() == 2 && sim.device_traces[0].is_empty() && !sim.device_traces[1].is_empty());
    // A device the snapshot does not have: one error line.
    user_error(&["explain", f, "--device", "2"], &["no device 2"]);
    user_error(&["validate", f, "--device", "5"], &["no device 5"]);
}

/// No device ran out of memory: the one with the highest peak reserved (the UNet recording's
/// 15.32 GiB against 512 MiB, as each run's `memory_stats()` recorded them).
#[test]
fn several_devices_without_oom_answer_for_the_highest_peak() {
    let t = write(&two_devices(&load(EMPTYCACHE), &load(UNET)), "two-gpus-peak.pickle.gz");
    let j = json(&["replay", t.arg(), "--json"]);
    let c = &j["device_choice"];
    assert_eq!((c["device"].as_u64(), c["reason"].as_str()), (Some(1), Some("highest_peak")), "{c}");
    let peak = |d: u64| c["candidates"].as_array().unwrap().iter().find(|x| x["device"] == d).unwrap()["peak_reserved"].as_u64();
    assert_eq!(peak(1), Some(recorded_stat(UNET, "reserved_bytes.all.peak")));
    assert_eq!(peak(0), Some(recorded_stat(EMPTYCACHE, "reserved_bytes.all.peak")));
    assert_eq!(j["stats"]["reserved_bytes.all.peak"].as_u64(), peak(1));
    let x = success(&["explain", t.arg(), "--at", "peak"]);
    assert!(
        x.starts_with(
            "answering for device 1 of 2 with entries: none ran out of memory and it has the highest peak reserved (15.32 GiB; device 0: 512.00 MiB)"
        ),
        "{x}"
    );
}

/// Every trace empty (recording off) and the segments on device 1: device 1 is analysed, with
/// a note that there is no history and how to record it.
#[test]
fn empty_traces_answer_for_the_device_with_segments() {
    let tiny = load(TINY_STACKS_ALL);
    let mut s = tiny.clone();
    s.device_traces = vec![Vec::new(), Vec::new()];
    for seg in &mut s.segments {
        seg.device = 1;
    }
    let t = write(&s, "recording-off.pickle.gz");
    let x = success(&["explain", t.arg()]);
    assert!(x.starts_with("answering for device 1: no device recorded any trace entry"), "{x}");
    assert!(x.contains("memory history was not being recorded") && x.contains("torch.cuda.memory._record_memory_history("), "{x}");
    // The final state is the recording's: reserved and allocated as memory_stats() read them at the end.
    let j = json(&["explain", t.arg(), "--json"]);
    assert_eq!(j["final_state"]["reserved"].as_u64(), Some(recorded_stat(TINY_STACKS_ALL, "reserved_bytes.all.current")));
    assert_eq!(j["final_state"]["allocated"].as_u64(), Some(recorded_stat(TINY_STACKS_ALL, "allocated_bytes.all.current")));
    let r = success(&["replay", t.arg()]);
    assert!(r.contains("(device 1)") && r.contains("final state") && !r.contains("mid-history"), "{r}");
    // Nothing was recorded to check a replay against: not "exact", exit status 3.
    let o = run(&["validate", t.arg()]);
    let v = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(3), "{v}");
    assert!(v.contains("nothing to validate: the snapshot has no trace entries") && !v.contains("  exact"), "{v}");
    user_error(&["sweep", t.arg()], &["no trace entries", "_record_memory_history("]);
    user_error(&["fit", t.arg()], &["no trace entries"]);
}

// ----- snapshots saved as JSON, segments-only lists, older files -----

const JSON_SNAPSHOT: &str = "tests/fixtures/json/tiny_stacks_all.snapshot.json.gz";
const JSON_SEGMENTS: &str = "tests/fixtures/json/tiny_stacks_all.segments.json";

/// `json.dump(torch.cuda.memory._snapshot())` (made by Python's json module from the real
/// recording, `tools/json_fixtures.py`) reads as the pickle does; a pickle named `.json` too.
#[test]
fn json_saved_snapshots_are_read() {
    assert_eq!(load(JSON_SNAPSHOT), load(TINY_STACKS_ALL), "the JSON holds the pickle's values");
    assert!(success(&["validate", JSON_SNAPSHOT]).contains("\n  exact\n"));
    let plain = TempFile::new("snapshot.json");
    let mut text = String::new();
    std::io::Read::read_to_string(&mut flate2::read::GzDecoder::new(std::fs::File::open(root(JSON_SNAPSHOT)).unwrap()), &mut text).unwrap();
    std::fs::write(&plain.0, &text).unwrap();
    assert_eq!(json(&["replay", plain.arg(), "--json"])["stats"], json(&["replay", TINY_STACKS_ALL, "--json"])["stats"]);
    let misnamed = TempFile::new("pickle-named.json");
    std::fs::copy(root(TINY_STACKS_ALL), &misnamed.0).unwrap();
    assert!(success(&["validate", misnamed.arg()]).contains("\n  exact\n"));
    // allocsim's own JSON Lines still reads as such.
    let jl = TempFile::new("tiny.jsonl");
    success(&["convert", TINY_STACKS_ALL, "-o", jl.arg()]);
    assert_eq!(load(jl.arg()).device_traces, load(TINY_STACKS_ALL).device_traces);
}

/// `json.dump(torch.cuda.memory_snapshot())`: segments only. The final state is analysed (the
/// recording's reserved and allocated bytes at the end), with a note that there is no history.
#[test]
fn a_segments_only_list_is_analysed_as_a_final_state() {
    let r = success(&["replay", JSON_SEGMENTS]);
    assert!(r.contains("a list of segments (torch.cuda.memory_snapshot())") && r.contains("_record_memory_history("), "{r}");
    let j = json(&["explain", JSON_SEGMENTS, "--json"]);
    let f = &j["final_state"];
    assert_eq!(f["reserved"].as_u64(), Some(recorded_stat(TINY_STACKS_ALL, "reserved_bytes.all.current")));
    assert_eq!(f["allocated"].as_u64(), Some(recorded_stat(TINY_STACKS_ALL, "allocated_bytes.all.current")));
    assert_eq!(f["segments"].as_u64(), Some(load(TINY_STACKS_ALL).segments.len() as u64));
    // The pinning blocks are named by their own stacks: the user's file, not the unwinder.
    let x = success(&["explain", JSON_SEGMENTS]);
    assert!(x.contains("from ") && x.contains("record_field.py:") && !x.contains("unwind"), "{x}");
    // A list of segments holds no history: nothing to validate (exit status 3), not "exact".
    let o = run(&["validate", JSON_SEGMENTS]);
    let v = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(3), "{v}");
    assert!(v.contains("nothing to validate: the snapshot has no trace entries") && !v.contains("  exact"), "{v}");
    let j: serde_json::Value = serde_json::from_slice(&run(&["validate", JSON_SEGMENTS, "--json"]).stdout).unwrap();
    assert_eq!((j["exact"].as_bool(), j["nothing_to_validate"].as_bool()), (Some(false), Some(true)), "{j}");
}

/// torch 2.1–2.4: accepted (2.5's rules), and the output says they were not measured.
#[test]
fn older_torch_versions_are_accepted_and_said_unmeasured() {
    let r = success(&["replay", FRAG, "--torch-version", "2.3"]);
    assert!(r.starts_with("rules: PyTorch 2.3 (asked with --torch-version"), "{r}");
    assert!(r.contains("\nnote: PyTorch 2.3's allocator was not measured"), "{r}");
    let v = success(&["validate", FRAG, "--torch-version", "2.1"]);
    assert!(v.contains("not measured") && v.contains("\n  exact\n"), "{v}");
    // The legacy parser's rule (`max_split_size_mb` must be > 20) applies.
    user_error(&["replay", FRAG, "--torch-version", "2.2", "--config", "max_split_size_mb:20"], &["must be > 20"]);
    let o = run(&["replay", FRAG, "--torch-version", "2.0"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("2.1 to 2.15"));
}

// ----- the peak without segment events -----

/// History turned on after warm-up: the trace has no segment event (every segment existed
/// before it) and starts where the job held the least between steps. `explain --at peak` lands
/// where allocated memory, counting the blocks live at the trace's start, first peaks: the entry
/// of the recorded trace after which the live bytes (allocs minus completed frees since the job
/// began) are highest, not request 0.
#[test]
fn explain_at_peak_without_segment_events() {
    let full = load("traces/field/llama_train__default.pickle.gz");
    let t = &full.device_traces[0];
    use allocsim_trace::Action as A;
    let after_segments = t.iter().rposition(|e| matches!(e.action, A::SegmentAlloc | A::SegmentFree | A::SegmentMap | A::SegmentUnmap)).unwrap() + 1;
    // The live bytes after each entry of the whole recording.
    let live: Vec<i64> = t
        .iter()
        .scan(0i64, |live, e| {
            match e.action {
                A::Alloc => *live += e.size as i64,
                A::FreeCompleted => *live -= e.size as i64,
                _ => {}
            }
            Some(*live)
        })
        .collect();
    // Start the trace just after the least live bytes in the first half of what follows.
    let half = after_segments + (t.len() - after_segments) / 2;
    let cut = (after_segments..half).min_by_key(|&i| (live[i], i)).unwrap() + 1;
    let (mut best, mut best_req, mut req) = (i64::MIN, None, 0u32);
    for i in cut..t.len() {
        if t[i].action == A::Alloc && live[i] > best {
            best = live[i];
            best_req = Some(req);
        }
        if matches!(t[i].action, A::Alloc | A::Oom) {
            req += 1;
        }
    }
    assert!(best_req.is_some_and(|q| q > 0), "the peak is not the trace's first request");
    let mut s = full.clone();
    s.device_traces[0] = t[cut..].to_vec();
    let late = write(&s, "history-after-warmup.pickle.gz");
    let r = success(&["replay", late.arg()]);
    assert!(r.contains("memory history was turned on after the job had allocated memory") && !r.contains("ring buffer"), "{r}");
    let j = json(&["explain", late.arg(), "--at", "peak", "--json"]);
    assert_eq!(j["request"].as_u64(), best_req.map(u64::from), "the peak of live bytes is at request {best_req:?} ({best} bytes)");
}

// ----- sweep and fit -----

/// sweep recommends only a setting that helps. The compiled training run's peak reserved is the
/// same under every setting (within 1%): keep the own settings, no "X (peak reserved 292 MiB vs
/// 292 MiB)". The frag recording under its 2 GiB cap (inferred between 1.95 and 2.20 GiB) holds
/// 606 MiB and then asks for 256, 512 and 1024 MiB, which stay allocated once served: 2398 MiB,
/// more than any allowed maximum it could have had, so every setting runs out of memory.
#[test]
fn sweep_recommends_only_what_helps() {
    let t = "traces/field/compile_train__default.pickle.gz";
    let out = success(&["sweep", t, "--placements", "1"]);
    let line = out.lines().find(|l| l.starts_with("recommendation:")).unwrap();
    assert!(line.starts_with("recommendation: keep the defaults (the trace's own settings) — they are as good as any setting tried"), "{out}");
    let j = json(&["sweep", t, "--placements", "1", "--json"]);
    // The best-ranked setting and the defaults: no OOM in either, peaks within 1%.
    let rows = j["rows"].as_array().unwrap();
    let own = rows.iter().find(|r| r["conf"] == "").unwrap();
    let peak = |r: &Value| r["outcomes"][0]["peak_reserved"].as_u64().unwrap();
    assert!(rows[0]["outcomes"][0]["first_oom"].is_null() && own["outcomes"][0]["first_oom"].is_null());
    assert!(peak(&rows[0]) as f64 >= 0.99 * peak(own) as f64, "{} vs {}", peak(&rows[0]), peak(own));
    let out = success(&["sweep", FRAG, "--placements", "1"]);
    let line = out.lines().find(|l| l.starts_with("recommendation:")).unwrap();
    assert!(line.starts_with("recommendation: none — every setting runs out of memory; the smallest shortfall is "), "{out}");
}

/// fit --cards replays each card. The training job that ran out of memory because another
/// process held the GPU (peak allocated 3.63 GiB) fits a 24 GiB and a 40 GiB card: the other
/// process's memory does not follow it to another card. A 1 GiB card cannot hold its 3.63 GiB.
#[test]
fn fit_cards_replays_each_card() {
    let t = "traces/field/devfull_train__default.pickle.gz";
    let out = success(&["fit", t, "--cards", "24GiB,40GiB,1GiB"]);
    let cards: Vec<&str> = out.lines().filter(|l| l.contains(" card: ")).collect();
    assert_eq!(cards.len(), 3, "one line per card:\n{out}");
    assert!(cards[0].starts_with("    24.00 GiB card:") && cards[0].contains("→ fits"), "{out}");
    assert!(cards[1].starts_with("    40.00 GiB card:") && cards[1].contains("→ fits"), "{out}");
    assert!(cards[2].contains("→ does not fit"), "{out}");
    let j = json(&["fit", t, "--cards", "24GiB,40GiB,1GiB", "--json"]);
    let verdicts: Vec<bool> = j["cards"].as_array().unwrap().iter().map(|c| c["fits"].as_bool().unwrap()).collect();
    assert_eq!(verdicts, [true, true, false]);
    // Consistent with the peaks: a card that fits has room for the peak allocated.
    for c in j["cards"].as_array().unwrap() {
        if c["fits"] == true {
            assert!(c["usable"].as_u64() >= j["peak_allocated"].as_u64(), "{c}");
        }
    }
}

// ----- wording -----

/// A divergence names the field that differs, so its two sides never read the same.
#[test]
fn divergences_say_which_field_differs() {
    let orig = load(TINY_STACKS_ALL);
    // A segment event's size changed: the size is named.
    let mut s = orig.clone();
    let e = s.device_traces[0].iter_mut().find(|e| e.action == allocsim_trace::Action::SegmentAlloc).unwrap();
    e.size += 2 << 20;
    let t = write(&s, "size-differs.pickle.gz");
    let o = run(&["validate", t.arg()]);
    assert_eq!(o.status.code(), Some(1));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let line = out.lines().find(|l| l.contains("segment events")).unwrap();
    assert!(line.contains("event 0 differs in its size"), "{line}");
}

/// Expandable segments: PyTorch's `segment` counter counts cudaMalloc'd segments only, so the
/// replay says what the reserved memory is in instead of "reserved in 0 segments".
#[test]
fn expandable_segments_are_not_reported_as_zero_segments() {
    let out = success(&["replay", "traces/frag__expandable__2048M.pickle.gz"]);
    let line = out.lines().find(|l| l.contains("at the end")).unwrap();
    assert!(!line.contains("in 0 segments") && line.contains("1 mapped range of expandable segments") && line.contains("cudaMalloc'd segments only"), "{line}");
}
