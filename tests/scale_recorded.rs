//! `allocsim scale` against the ground truth `tools/record_scale.py` recorded on an H100 (80 GB,
//! torch 2.11.0+cu130, `tools/record_scale_all.sh`), kept in `traces/field/scale/`. Each run is a
//! fresh process: a prefix of steps at small shapes, then one step at a larger shape, with
//! `reset_peak_memory_stats()` at the start of every step and `max_memory_allocated()` /
//! `max_memory_reserved()` read after it (`extra.step_peaks`, `extra.step_peaks_reserved`: what the
//! job read, not a replay). The larger step is held out and predicted after the step before it,
//! learnt from the prefix alone. The search ran every multiple of 128 from 768 in its own process
//! under a 12 GiB `set_per_process_memory_fraction` cap; allocsim finds its answer from the prefix
//! recorded under the same cap.

mod common;

use common::{json, root};
use serde_json::Value;

fn meta(name: &str) -> Value {
    let path = root(&format!("traces/field/scale/{name}.json"));
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).unwrap()
}

fn trace(name: &str) -> String {
    let path = format!("traces/field/scale/{name}.pickle.gz");
    assert!(root(&path).exists(), "{path} is required");
    path
}

/// The held-out larger step of a run: (predicted peak allocated, predicted peak reserved, the job's
/// readings of both), each prediction a `[low, high]` range.
fn predict_big(name: &str) -> ([u64; 2], [u64; 2], u64, u64) {
    let m = meta(name);
    let x = &m["extra"];
    let k = x["big_index"].as_u64().unwrap() as usize;
    let v = x["values"][k].as_u64().unwrap().to_string();
    let after = (k - 1).to_string();
    let param = x["param"].as_str().unwrap();
    let p = json(&["scale", &trace(name), "--param", param, "--hold-out", &v, "--predict", &v, "--after", &after, "--json"]);
    let p = &p["predictions"][0];
    let pair = |v: &Value| [v[0].as_u64().unwrap(), v[1].as_u64().unwrap()];
    (pair(&p["peak_allocated"]), pair(&p["peak_reserved"]), x["step_peaks"][k].as_u64().unwrap(), x["step_peaks_reserved"][k].as_u64().unwrap())
}

/// Steps at 2× to 8× the largest value learnt from, each request's size recorded at two values or
/// more: one figure each, the job's own to the byte.
#[test]
fn larger_steps_are_predicted_to_the_byte() {
    for (name, factor) in [
        ("lm_seq__default__big1280", "seq 1280, 2x the largest of 128-640"),
        ("lm_seq__default__big2560", "seq 2560, 4x the largest of 128-640"),
        ("lm_batch__expandable__big64", "batch 64, 4x the largest of 2-16, expandable segments"),
        ("infer__default__big32", "inference batch 32, 4x the largest of 1-8"),
    ] {
        let (alloc, reserved, ra, rr) = predict_big(name);
        assert_eq!(alloc, [ra, ra], "{name} ({factor}): peak allocated");
        assert_eq!(reserved, [rr, rr], "{name} ({factor}): peak reserved");
    }
}

/// Learnt from steps at one value only (512), a step at 2048 is a range, and it holds the job's
/// readings; its width is the dependence one value cannot show.
#[test]
fn from_one_value_the_range_holds_the_reading() {
    let (alloc, reserved, ra, rr) = predict_big("lm_seq__default__big2048__one");
    assert!(alloc[0] < alloc[1] && alloc[0] <= ra && ra <= alloc[1], "peak allocated {alloc:?} vs the reading {ra}");
    assert!(reserved[0] < reserved[1] && reserved[0] <= rr && rr <= reserved[1], "peak reserved {reserved:?} vs the reading {rr}");
}

/// The largest sequence length under the cap, found by replaying, equals the one found by running
/// every value on the GPU (1536: 1664 and the four values after it ran out of memory).
#[test]
fn largest_under_the_cap_equals_the_real_search() {
    let search = meta("search__lm_seq__default__cap12288");
    let real = search["largest"].as_u64().expect("the search found a largest value");
    assert!(
        search["tried"].as_array().unwrap().iter().any(|t| t["value"].as_u64() == Some(real + 128) && t["oom"] == true),
        "the search saw the next value fail"
    );
    let cap = meta("search__lm_seq__default__cap12288__prefix")["cap_bytes"].as_u64().unwrap().to_string();
    let got = json(&["scale", &trace("search__lm_seq__default__cap12288__prefix"), "--param", "seq", "--largest-under", &cap, "--step", "128", "--json"]);
    assert_eq!(got["largest"][0]["value"].as_u64(), Some(real), "{}", got["largest"]);
}
