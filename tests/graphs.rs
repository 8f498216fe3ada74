//! `allocsim graphs` against real H200 recordings (torch 2.11, `traces/field/capture_*`,
//! `tools/record_field.py` workload `graph_capture`): a 4-layer transformer encoder whose graphs
//! are captured per batch size, largest first, into one `graph_pool_handle()` pool after an eager
//! warm-up on a side stream. Each run's `.json` holds `memory_reserved()` and
//! `memory_allocated()` as the job read them after the weights and after every capture, and
//! `max_memory_reserved()` at the end. Run A (batch sizes 256…1) is what the predictions are
//! learnt from; runs B (512…1, 15 captures) and C (64…8) are what they are checked against.

mod common;

use allocsim_trace::Action;
use common::{json, root, user_error};
use serde_json::Value;

fn meta(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(root(&format!("traces/field/{name}.json"))).expect("the run's .json")).unwrap()
}

fn batches(m: &Value) -> String {
    m["extra"]["batches"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap().to_string()).collect::<Vec<_>>().join(",")
}

fn trace(name: &str) -> String {
    let path = format!("traces/field/{name}.pickle.gz");
    assert!(root(&path).exists(), "{path} is required");
    path
}

/// Predicts run `target`'s batch sizes from run `from` (under `config`, if given) and checks every
/// reading the job took: after the weights, after each capture (reserved and allocated), and the
/// run's `max_memory_reserved()` (under the trace's own addresses; within the placements' range).
fn check(from: &str, target: &str, config: Option<&str>) {
    let (a, t) = (meta(from), meta(target));
    let path = trace(from);
    let (captured, asked) = (batches(&a), batches(&t));
    let mut args = vec!["graphs", path.as_str(), "--captured", captured.as_str(), "--batches", asked.as_str(), "--json"];
    if let Some(c) = config {
        args.extend(["--config", c]);
    }
    let v = json(&args);
    let p = &v["prediction"];
    let want = t["extra"]["captures"].as_array().unwrap();
    let got = p["captures"].as_array().unwrap();
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(want) {
        assert_eq!(g["batch"], w["batch"]);
        assert_eq!(
            (g["reserved"].as_u64(), g["allocated"].as_u64()),
            (w["reserved"].as_u64(), w["allocated"].as_u64()),
            "{from} → {target}: after the capture at batch size {}",
            w["batch"]
        );
        // The graph pool's bytes are part of what is reserved.
        assert!(g["pool_reserved"].as_u64().unwrap() <= g["reserved"].as_u64().unwrap());
    }
    let peak = t["max_memory_reserved"].as_u64().unwrap();
    assert_eq!(p["peak_reserved"].as_u64(), Some(peak), "{from} → {target}: max_memory_reserved()");
    let range = (v["peak_range"][0].as_u64().unwrap(), v["peak_range"][1].as_u64().unwrap());
    assert!(range.0 <= peak && peak <= range.1);
    // Learnt from the same model, so the weights are the same: the reading before the first warm-up.
    if config.is_none() {
        assert_eq!(p["before"]["reserved"], t["extra"]["after_weights"]["reserved"]);
        assert_eq!(p["before"]["allocated"], t["extra"]["after_weights"]["allocated"]);
    }
    // The learnt pattern gives the recording it was learnt from back.
    assert_eq!(v["self_check"]["agree"], v["self_check"]["rounds"]);
    assert!(v["self_check"]["first_difference"].is_null());
}

#[test]
fn default_settings_predict_b_and_c_from_a() {
    check("capture_a__default", "capture_b__default", None);
    check("capture_a__default", "capture_c__default", None);
}

#[test]
fn expandable_segments_predict_b_from_a() {
    check("capture_a__expandable", "capture_b__expandable", None);
}

/// The recorded batch sizes themselves: every reading of the run learnt from.
#[test]
fn the_recorded_batch_sizes_give_the_recording_back() {
    check("capture_a__default", "capture_a__default", None);
    check("capture_a__expandable", "capture_a__expandable", None);
}

/// Another config than the trace's: the default-settings capture predicts the expandable runs'
/// readings after every capture, and the reverse.
#[test]
fn another_config_predicts_the_runs_recorded_under_it() {
    check("capture_a__default", "capture_b__expandable", Some("expandable_segments:True"));
    check("capture_a__default", "capture_a__expandable", Some("expandable_segments:True"));
    check("capture_a__expandable", "capture_b__default", Some(""));
    check("capture_a__expandable", "capture_c__default", Some(""));
}

/// Batch sizes beyond the recorded ones are said to be extrapolated.
#[test]
fn extrapolation_is_said() {
    let a = meta("capture_a__default");
    let path = trace("capture_a__default");
    let captured = batches(&a);
    let v = json(&["graphs", &path, "--captured", &captured, "--batches", "512,3", "--json"]);
    assert_eq!(v["extrapolated"], serde_json::json!([512]));
    assert_eq!(v["prediction"]["captures"][0]["extrapolated"], true);
    assert_eq!(v["prediction"]["captures"][1]["extrapolated"], false);
    let text = common::success(&["graphs", &path, "--captured", &captured, "--batches", "512,3"]);
    assert!(text.contains("512 lies outside the recorded batch sizes (1–256)"), "{text}");
}

#[test]
fn questions_the_trace_cannot_answer() {
    let path = trace("capture_a__default");
    user_error(&["graphs", &path, "--captured", "256,128"], &["holds 9 captures into graph pool (0, 1)", "2 recorded batch sizes were given"]);
    user_error(&["graphs", &path, "--captured", "256,128,64,32,16,8,4,2,1", "--batches", "64,0"], &["batch size 0"]);
    user_error(&["graphs", &path, "--captured", "256,128,64,32,16,8,4,2,1", "--config", "foo:1"], &["Unrecognized key 'foo'"]);
    user_error(&["graphs", "traces/frag__default__2048M.pickle.gz", "--captured", "1,2"], &["no request of this trace went to a private pool"]);
    // Two graphs of different models in one pool, one right after the other: not captures of one
    // model at several batch sizes (refused, whichever way the pools are read).
    user_error(&["graphs", &trace("graphs__default"), "--captured", "1,2"], &[]);
    // torch.compile's CUDA-graph trees restore their pool to checkpoints between recordings.
    user_error(&["graphs", &trace("compile_infer__default"), "--captured", "1,2,3,4,5,6,7,8"], &["checkpoint"]);
}

/// A capture whose requests differ from the others' (one request fewer at batch size 16) is
/// named, not guessed at.
#[test]
fn a_capture_that_does_not_repeat_the_others_is_named() {
    let path = trace("capture_a__default");
    let snap = allocsim_trace::read_trace(&root(&path)).unwrap();
    let p = allocsim_replay::Prepared::new_for(&snap, None, None, None, allocsim_replay::TorchVersion::DEFAULT).unwrap();
    let rec = allocsim_graphs::learn(&p, &[256, 128, 64, 32, 16, 8, 4, 2, 1]).unwrap();
    let round = &rec.rounds[4];
    assert_eq!(round.batch, 16);
    // An 8-byte request of its capture, with its free.
    let q = (round.capture_requests.0..=round.capture_requests.1).find(|&q| p.program.requests[q as usize].size == 8).expect("an 8-byte request");
    let at = p.program.requests[q as usize].trace_index as usize;
    let mut t = snap.device_traces[0].clone();
    let addr = t[at].addr;
    let freed = (at + 1..t.len()).find(|&i| t[i].action == Action::FreeRequested && t[i].addr == addr).unwrap();
    let done = (freed + 1..t.len()).find(|&i| t[i].action == Action::FreeCompleted && t[i].addr == addr).unwrap();
    for i in [done, freed, at] {
        t.remove(i);
    }
    let mut edited = snap.clone();
    edited.device_traces[0] = t;
    let out = common::TempFile::new("graphs-differs.jsonl");
    allocsim_trace::write_trace(&edited, &out.0).unwrap();
    user_error(
        &["graphs", out.arg(), "--captured", "256,128,64,32,16,8,4,2,1"],
        &["the capture at batch size 16 does not repeat the one at batch size 128", "143 requests in its round against 144"],
    );
}

/// A trace recorded without stacks (`_record_memory_history(stacks=None)`… or stripped): the
/// requests are told apart by stream, pool and by the size the later captures give, and the
/// prediction is the same.
#[test]
fn without_stacks_the_prediction_is_the_same() {
    let (a, c) = (meta("capture_a__default"), meta("capture_c__default"));
    let mut snap = allocsim_trace::read_trace(&root(&trace("capture_a__default"))).unwrap();
    let empty = snap.stacks.iter().position(|s| s.is_empty()).unwrap_or_else(|| {
        snap.stacks.push(Vec::new());
        snap.stacks.len() - 1
    }) as u32;
    for e in snap.device_traces[0].iter_mut() {
        e.stack = empty;
    }
    let out = common::TempFile::new("graphs-nostacks.jsonl");
    allocsim_trace::write_trace(&snap, &out.0).unwrap();
    let v = json(&["graphs", out.arg(), "--captured", &batches(&a), "--batches", &batches(&c), "--json"]);
    let got: Vec<(u64, u64)> =
        v["prediction"]["captures"].as_array().unwrap().iter().map(|g| (g["reserved"].as_u64().unwrap(), g["allocated"].as_u64().unwrap())).collect();
    let want: Vec<(u64, u64)> =
        c["extra"]["captures"].as_array().unwrap().iter().map(|w| (w["reserved"].as_u64().unwrap(), w["allocated"].as_u64().unwrap())).collect();
    assert_eq!(got, want);
}
