//! `allocsim scale` against real H200 recordings (torch 2.11, `traces/field/`, `tools/record_field.py`
//! and `tools/record_ranks.py`): HF Llama training steps at several sequence lengths. Each run's
//! `.json` holds the job's `max_memory_allocated()` after every step with the peaks reset at its
//! start (`extra.step_peaks`), the sequence length of each step (`extra.seq_lens`) and every OOM
//! message as PyTorch printed it. Peak reserved per step is not in the `.json`; it is read from the
//! trace's own segment entries (what the allocator asked the driver for, as recorded: the final
//! segments less what the trace reserved, then each `segment_alloc`/`segment_free`), never from a
//! replay. Steps are predicted after the step before them, learnt only from steps at other values.

mod common;

use allocsim_trace::{Action, Annotation, Snapshot};
use common::{json, root, user_error};
use serde_json::Value;

fn meta(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(root(&format!("traces/field/{name}.json"))).expect("the run's .json")).unwrap()
}

fn trace(name: &str) -> String {
    let path = format!("traces/field/{name}.pickle.gz");
    assert!(root(&path).exists(), "{path} is required");
    path
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array().expect("an array").iter().map(|x| x.as_u64().expect("a number")).collect()
}

/// The trace's entry ranges `[start, end)` of the optimizer's steps: an `Optimizer.step#…` END
/// annotation placed after every entry of its microsecond or earlier.
fn iterations(snap: &Snapshot) -> Vec<(usize, usize)> {
    let t = &snap.device_traces[0];
    let mut ends: Vec<i64> = snap
        .annotations
        .iter()
        .filter(|a| a.get("stage") == Some("END") && a.get("name").is_some_and(|n| n.starts_with("Optimizer.step")))
        .map(|a| a.time_us)
        .collect();
    ends.sort_unstable();
    let (mut out, mut start, mut j) = (Vec::new(), 0usize, 0usize);
    for e in ends {
        while j < t.len() && t[j].time_us <= e {
            j += 1;
        }
        out.push((start, j));
        start = j;
    }
    if t[start..].iter().any(|e| matches!(e.action, Action::Alloc | Action::Oom)) {
        out.push((start, t.len()));
    }
    out
}

/// Each iteration's peak reserved as the recorded segment entries give it.
fn recorded_reserved_peaks(snap: &Snapshot, its: &[(usize, usize)]) -> Vec<u64> {
    let t = &snap.device_traces[0];
    let sign = |a: Action| match a {
        Action::SegmentAlloc | Action::SegmentMap => 1i64,
        Action::SegmentFree | Action::SegmentUnmap => -1,
        _ => 0,
    };
    let total: i64 = t.iter().map(|e| sign(e.action) * e.size as i64).sum();
    let mut cur = snap.segments.iter().filter(|s| s.device == 0).map(|s| s.total_size as i64).sum::<i64>() - total;
    its.iter()
        .map(|&(a, b)| {
            let mut peak = cur;
            for e in &t[a..b] {
                cur += sign(e.action) * e.size as i64;
                peak = peak.max(cur);
            }
            peak as u64
        })
        .collect()
}

/// Requests (alloc and oom entries) per iteration, as recorded.
fn recorded_requests(snap: &Snapshot, its: &[(usize, usize)]) -> Vec<usize> {
    its.iter().map(|&(a, b)| snap.device_traces[0][a..b].iter().filter(|e| matches!(e.action, Action::Alloc | Action::Oom)).count()).collect()
}

fn values_arg(v: &[Option<u64>]) -> String {
    v.iter().map(|x| x.map_or("-".to_string(), |x| x.to_string())).collect::<Vec<_>>().join(",")
}

/// `scale --json` on `name` learning from `values`, predicting `predict` after step `after`.
fn scale(name: &str, values: &[Option<u64>], predict: u64, after: usize, more: &[&str]) -> Value {
    let path = trace(name);
    let vals = values_arg(values);
    let (p, a) = (predict.to_string(), after.to_string());
    let mut args = vec!["scale", path.as_str(), "--param", "seq", "--values", vals.as_str(), "--predict", p.as_str(), "--after", a.as_str(), "--json"];
    args.extend_from_slice(more);
    json(&args)
}

fn pair(v: &Value) -> (u64, u64) {
    (v[0].as_u64().unwrap(), v[1].as_u64().unwrap())
}

/// The sequence length of each iteration of `name` (the optimizer's steps), from the `.json`.
fn iteration_values(m: &Value) -> Vec<Option<u64>> {
    u64s(&m["extra"]["seq_lens"]).into_iter().map(Some).collect()
}

/// Learnt from seq 128–384 only (every 512 and 768 step left out), the first step at 768, after
/// the step before it: its `max_memory_allocated()` and its peak reserved, to the byte (2× the
/// largest value learnt from; the 14 requests embedding backward makes past 3,072 indices are
/// not in what was learnt, and do not reach the peak).
#[test]
fn llama_step_at_twice_the_largest_learnt_length() {
    let m = meta("llama_train__default");
    let snap = allocsim_trace::read_trace(&root(&trace("llama_train__default"))).unwrap();
    let its = iterations(&snap);
    let reserved = recorded_reserved_peaks(&snap, &its);
    let peaks = u64s(&m["extra"]["step_peaks"]);
    let values: Vec<Option<u64>> = iteration_values(&m).into_iter().map(|v| v.filter(|&x| x <= 384)).collect();
    let i = u64s(&m["extra"]["seq_lens"]).iter().position(|&v| v == 768).unwrap();
    let v = scale("llama_train__default", &values, 768, i - 1, &[]);
    let p = &v["predictions"][0];
    assert_eq!(pair(&p["peak_allocated"]), (peaks[i], peaks[i]));
    assert_eq!(pair(&p["peak_reserved"]), (reserved[i], reserved[i]));
    assert_eq!(p["extrapolated"], true);
    assert!(p["runs"][0]["oom"].is_null());
    // What was learnt: the steps at 128, 256 and 384 of one structure.
    assert_eq!(v["recorded_range"], serde_json::json!([128, 384]));
}

/// Every step of the two Llama runs, learnt from the steps at every other value and predicted
/// after the step before it: `max_memory_allocated()` and the peak reserved to the byte.
#[test]
fn every_llama_step_from_the_steps_at_other_lengths() {
    let mut checked = 0;
    for name in ["llama_train__default", "llama_oom__default"] {
        let m = meta(name);
        let snap = allocsim_trace::read_trace(&root(&trace(name))).unwrap();
        let its = iterations(&snap);
        let reserved = recorded_reserved_peaks(&snap, &its);
        let peaks = u64s(&m["extra"]["step_peaks"]);
        let seq = u64s(&m["extra"]["seq_lens"]);
        // The step of each iteration: llama_oom's OOM step never reached its optimizer step, so
        // it and the next are one iteration (left out).
        let oom_step = m["log"].as_array().unwrap().iter().find_map(|x| x["step"].as_u64()).map(|s| s as usize);
        let step_of: Vec<Option<usize>> = (0..its.len())
            .map(|i| match oom_step {
                Some(s) if i == s => None,
                Some(s) if i > s => Some(i + 1),
                _ => Some(i),
            })
            .collect();
        let values: Vec<Option<u64>> = step_of.iter().map(|s| s.map(|s| seq[s])).collect();
        for i in 2..its.len() {
            let (Some(s), Some(_)) = (step_of[i], step_of[i - 1]) else { continue };
            let learn: Vec<Option<u64>> = values.iter().map(|x| x.filter(|&x| x != seq[s])).collect();
            let v = scale(name, &learn, seq[s], i - 1, &[]);
            let p = &v["predictions"][0];
            assert_eq!(pair(&p["peak_allocated"]), (peaks[s], peaks[s]), "{name} step {s} (seq {})", seq[s]);
            assert_eq!(pair(&p["peak_reserved"]), (reserved[i], reserved[i]), "{name} step {s} (seq {})", seq[s]);
            checked += 1;
        }
    }
    assert_eq!(checked, 14 + 11);
}

/// The OOM step of `llama_oom` (seq 4096 under a 6 GiB cap, 8× the largest length learnt from):
/// the step runs out of memory at the request PyTorch's message names, with its allocated and
/// reserved-but-unallocated figures, and the peak the job read after catching it.
#[test]
fn llama_oom_step_predicted_from_lengths_up_to_an_eighth() {
    let m = meta("llama_oom__default");
    let seq = u64s(&m["extra"]["seq_lens"]);
    let peaks = u64s(&m["extra"]["step_peaks"]);
    let log = &m["log"][0];
    let s = log["step"].as_u64().unwrap() as usize;
    assert_eq!(seq[s], 4096);
    let values: Vec<Option<u64>> = seq[..s].iter().map(|&v| Some(v)).collect();
    let v = scale("llama_oom__default", &values, 4096, s - 1, &[]);
    let p = &v["predictions"][0];
    assert_eq!(p["extrapolated"], true);
    assert_eq!(pair(&p["peak_allocated"]), (peaks[s], peaks[s]));
    let recorded = log["oom"].as_str().unwrap();
    let figures = |msg: &str| -> (String, String, String) {
        let cut = |a: &str, b: &str| msg[msg.find(a).unwrap()..].split(b).next().unwrap().to_string();
        (cut("Tried to allocate", "."), cut("GiB allowed", ";"), cut("Of the allocated memory", " If reserved"))
    };
    let runs = p["runs"].as_array().unwrap();
    assert!(!runs.is_empty());
    for r in runs {
        let msg = r["oom"]["message"].as_str().expect("the step runs out of memory");
        assert_eq!(figures(msg), figures(recorded), "{msg}");
    }
    // The requests embedding backward makes past 3,072 indices were seen at 512 only.
    assert!(p["caveats"].as_array().unwrap().iter().any(|c| c.as_str().unwrap().contains("seen at one value only")));
}

/// The largest length under the job's own cap (6 GiB, inferred from the trace), by replaying:
/// the job ran 512 under it and ran out of memory at 4096.
#[test]
fn the_largest_length_under_the_cap_lies_between_what_ran_and_what_did_not() {
    let m = meta("llama_oom__default");
    let cap = m["cap_bytes"].as_u64().unwrap();
    let seq = u64s(&m["extra"]["seq_lens"]);
    let s = m["log"][0]["step"].as_u64().unwrap() as usize;
    let values: Vec<Option<u64>> = seq[..s].iter().map(|&v| Some(v)).collect();
    let v = scale("llama_oom__default", &values, 512, s - 1, &["--largest-under"]);
    let l = &v["largest"][0];
    assert_eq!(l["capacity"].as_u64(), Some(cap));
    let best = l["value"].as_u64().expect("a length fits");
    assert!((512..4096).contains(&best), "{l}");
    assert_eq!(best % 128, 0);
    // Above the answer, the first value tried runs out of memory; the answer's peak is under the cap.
    assert!(l["first_oom_above"].as_u64().unwrap() > best);
    assert!(l["peak_reserved"].as_u64().unwrap() <= cap);
    // The same cap given in bytes, and a card.
    let c = cap.to_string();
    let w = scale("llama_oom__default", &values, 512, s - 1, &["--largest-under", &c, "--step", "64"]);
    let b64 = w["largest"][0]["value"].as_u64().unwrap();
    assert!((best..best + 128).contains(&b64), "{} vs {best}", w["largest"][0]);
}

/// A single short recording at one length (rank 1's first six steps, all at 512): the step at
/// 2048 that the job then took is given as a range, which holds the job's reading; with rank 0's
/// run beside it (the same job, 512 throughout), rank 1's step at 2048 learnt from the step
/// itself and predicted after rank 0's sixth step gives rank 1's reading to the byte.
#[test]
fn one_recorded_length_gives_a_range_and_two_traces_learn_together() {
    let r1: Value = serde_json::from_str(&std::fs::read_to_string(root("traces/field/ranks/rank1.json")).unwrap()).unwrap();
    let seq = u64s(&r1["seq_lens"]);
    let peaks = u64s(&r1["step_peaks"]);
    let i = seq.iter().position(|&v| v == 2048).unwrap();
    let values: Vec<Option<u64>> = seq[..i].iter().map(|&v| Some(v)).collect();
    let v = json(&["scale", "traces/field/ranks/rank1.pickle.gz", "--param", "seq", "--values", &values_arg(&values), "--predict", "2048", "--json"]);
    let p = &v["predictions"][0];
    let (lo, hi) = pair(&p["peak_allocated"]);
    assert!(lo < hi && lo <= peaks[i] && peaks[i] <= hi, "{lo}–{hi} vs {}", peaks[i]);
    assert_eq!(p["exact"], false);
    let all0 = values_arg(&[Some(512); 12]);
    let all1 = values_arg(&seq.iter().map(|&v| Some(v)).collect::<Vec<_>>());
    let after = (i - 1).to_string();
    let v = json(&[
        "scale",
        "traces/field/ranks/rank0.pickle.gz",
        "traces/field/ranks/rank1.pickle.gz",
        "--param",
        "seq",
        "--values",
        &all0,
        "--values",
        &all1,
        "--predict",
        "2048",
        "--after",
        &after,
        "--json",
    ]);
    let p = &v["predictions"][0];
    assert_eq!(pair(&p["peak_allocated"]), (peaks[i], peaks[i]));
    assert_eq!(p["exact"], true);
    // Rank 1 never freed a segment: its peak reserved is what it held at the end.
    assert_eq!(r1["memory_stats"]["reserved_bytes.all.freed"].as_u64(), Some(0));
    assert_eq!(p["peak_reserved"][0], r1["memory_stats"]["reserved_bytes.all.current"]);
    // The first step (it makes the optimizer's state) is recognised in both traces.
    for t in v["traces"].as_array().unwrap() {
        assert_eq!(t["steps"][0]["role"]["kind"], "first");
    }
}

/// The requests that change where the structure does (embedding backward's sort-based path past
/// 3,072 indices: batch 8 × 384 = 3,072) are named between the lengths that bracket the switch,
/// as many as the recorded steps' request counts differ by.
#[test]
fn requests_that_appear_past_a_length_are_named() {
    for name in ["llama_train__default", "llama_oom__default"] {
        let m = meta(name);
        let snap = allocsim_trace::read_trace(&root(&trace(name))).unwrap();
        let its = iterations(&snap);
        let counts = recorded_requests(&snap, &its);
        let seq = u64s(&m["extra"]["seq_lens"]);
        // Iterations 1..=8 are steps 1..=8 in both runs.
        let at = |v: u64| (1..=8).find(|&i| seq[i] == v).map(|i| counts[i]).unwrap();
        let values: Vec<Option<u64>> = (0..its.len()).map(|i| (i <= 8).then(|| seq[i])).collect();
        let v = scale(name, &values, 512, 8, &[]);
        let sw = v["switches"].as_array().unwrap();
        assert_eq!(sw.len(), 1, "{name}: {sw:?}");
        assert_eq!((sw[0]["below"].as_u64(), sw[0]["above"].as_u64()), (Some(384), Some(512)));
        let net = sw[0]["appear"]["requests"].as_i64().unwrap() - sw[0]["disappear"]["requests"].as_i64().unwrap();
        assert_eq!(net, at(512) as i64 - at(384) as i64, "{name}");
        let mut above: Vec<u64> = values[1..=8].iter().flatten().copied().filter(|&x| x > 384).collect();
        above.sort_unstable();
        above.dedup();
        assert_eq!(u64s(&sw[0]["appear"]["seen_at"]), above, "{name}");
    }
}

/// A copy of `llama_train` with each step annotated `record_function("seq=N")` (the region from
/// the end of one optimizer step to the end of the next): the annotated steps give what
/// `--values` gives.
#[test]
fn annotated_steps_give_what_values_give() {
    let m = meta("llama_train__default");
    let mut snap = allocsim_trace::read_trace(&root(&trace("llama_train__default"))).unwrap();
    let seq = u64s(&m["extra"]["seq_lens"]);
    let t = &snap.device_traces[0];
    let mut ends: Vec<i64> = snap
        .annotations
        .iter()
        .filter(|a| a.get("stage") == Some("END") && a.get("name").is_some_and(|n| n.starts_with("Optimizer.step")))
        .map(|a| a.time_us)
        .collect();
    ends.sort_unstable();
    let s = |x: &str| -> std::sync::Arc<str> { x.into() };
    let mut start = t[0].time_us;
    for (k, &end) in ends.iter().enumerate() {
        let name = format!("seq={}", seq[k]);
        for (stage, time_us) in [("START", start), ("END", end)] {
            snap.annotations.push(Annotation { device: 0, time_us, fields: vec![(s("stage"), s(stage)), (s("name"), s(&name))] });
        }
        start = end + 1;
    }
    let out = common::TempFile::new("scale-annotated.pickle.gz");
    allocsim_trace::write_trace(&snap, &out.0).unwrap();
    let a = json(&["scale", out.arg(), "--param", "seq", "--predict", "768,1024", "--after", "3", "--json"]);
    let all = values_arg(&seq.iter().map(|&v| Some(v)).collect::<Vec<_>>());
    let b = json(&["scale", &trace("llama_train__default"), "--param", "seq", "--values", &all, "--predict", "768,1024", "--after", "3", "--json"]);
    assert_eq!(a["predictions"], b["predictions"]);
    assert_eq!(a["structures"], b["structures"]);
    assert_eq!(a["traces"][0]["from"]["kind"], "annotations");
    let peaks = u64s(&m["extra"]["step_peaks"]);
    assert_eq!(pair(&a["predictions"][0]["peak_allocated"]), (peaks[4], peaks[4]));
    // The 512 and 768 steps held out: seq 768 at 2× the largest learnt from, as --values with them
    // left out gives it, and the job's reading.
    let h = json(&["scale", out.arg(), "--param", "seq", "--hold-out", "512,768", "--predict", "768", "--after", "3", "--json"]);
    let masked = values_arg(&seq.iter().map(|&v| (v <= 384).then_some(v)).collect::<Vec<_>>());
    let c = json(&["scale", &trace("llama_train__default"), "--param", "seq", "--values", &masked, "--predict", "768", "--after", "3", "--json"]);
    assert_eq!(h["predictions"], c["predictions"]);
    assert_eq!(pair(&h["predictions"][0]["peak_allocated"]), (peaks[4], peaks[4]));
    assert!(h["traces"][0]["steps"].as_array().unwrap().iter().any(|s| s["role"]["kind"] == "held_out"));
    // Without the annotations and without --values: said, with what the trace has.
    user_error(
        &["scale", &trace("llama_train__default"), "--param", "seq", "--predict", "768"],
        &["no record_function regions named seq=VALUE", "forward", "--values"],
    );
}

#[test]
fn questions_the_traces_cannot_answer() {
    let path = trace("llama_train__default");
    // A list that does not parse is refused by the argument parser (exit status 2, its usage).
    let o = common::run(&["scale", &path, "--param", "seq", "--values", "512,x", "--predict", "768"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2));
    assert!(err.contains("\"x\" is not a whole number") && !err.contains("panicked"), "{err}");
    let many = vec!["512"; 17].join(",");
    user_error(&["scale", &path, "--param", "seq", "--values", &many, "--predict", "768"], &["17 values given but the trace has 16 iterations"]);
    user_error(&["scale", &path, "--param", "seq", "--values", "512,512,128", "--predict", "0"], &["values are at least 1"]);
    user_error(&["scale", &path, "--param", "seq", "--values", "512,512,128,384", "--predict", "768", "--after", "40"], &["--after 40", "has steps 0–15"]);
    // Only the first step has a value: nothing to learn from.
    user_error(&["scale", &path, "--param", "seq", "--values", "512", "--predict", "768"], &["no step to learn from", "the first step"]);
    // One --values list for two traces.
    user_error(&["scale", &path, &path, "--param", "seq", "--values", "512,512", "--predict", "768"], &["1 --values list for 2 traces"]);
    // No budget to search under.
    user_error(&["scale", &path, "--param", "seq", "--values", "512,512,128,384", "--largest-under"], &["no budget to search under"]);
    user_error(&["scale", &path, "--param", "seq", "--values", "512,512,128,384", "--config", "foo:1", "--predict", "768"], &["Unrecognized key 'foo'"]);
    user_error(&["scale", &path, "--param", "seq", "--values", "512,512,128,384", "--predict", "768", "--step", "0"], &["--step 0"]);
    // Absurd values: refused, not overflowed.
    user_error(&["scale", &path, "--param", "seq", "--values", "512,512,128,384", "--predict", "18446744073709551615"], &["at most 2^40"]);
    user_error(&["scale", &path, "--param", "seq", "--values", "512,18446744073709551615,128", "--predict", "768"], &["1 to 2^40"]);
    user_error(
        &["scale", &path, "--param", "seq", "--values", "512,512,128,384", "--largest-under", "64GiB", "--step", "1"],
        &["--step 1", "give a larger --step"],
    );
    // The largest value taken: its step cannot fit on the device (every run runs out of memory),
    // and the other asked value is answered beside it.
    let v = json(&["scale", &path, "--param", "seq", "--values", "512,512,128,384", "--predict", "768,1099511627776", "--json"]);
    let far = &v["predictions"][1];
    assert_eq!(far["ooms"].as_u64().unwrap() as usize, far["runs"].as_array().unwrap().len(), "{far}");
    assert_eq!(v["predictions"][0]["ooms"], 0);
}
