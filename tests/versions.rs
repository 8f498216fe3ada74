//! Which release's rules a replay uses, and why (docs/versions.md). The snapshots here are
//! constructed (a JSON snapshot, the shape `json.dump(torch.cuda.memory._snapshot())` writes)
//! around what each release records in `allocator_settings`, as read in its wheel; the real
//! 2.11 recordings come from `traces/`.

mod common;
use common::*;

/// The keys `allocator_settings` has in 2.11 (`torch/csrc/cuda/Module.cpp` in the 2.11.0 wheel's
/// `libtorch_python.so`), with values for the default settings.
const SETTINGS_2_11: &str = r#""max_split_size": -1, "garbage_collection_threshold": 0.0, "expandable_segments": false, "pinned_num_register_threads": 1, "release_lock_on_cudamalloc": false, "pinned_use_cuda_host_register": false, "graph_capture_record_stream_reuse": false, "roundup_power2_divisions": {"1": 0, "2": 0, "4": 0, "8": 0, "16": 0, "32": 0, "64": 0, "128": 0, "256": 0, "512": 0, "1024": 0, "2048": 0, "4096": 0, "8192": 0, "16384": 0, "32768": 0}"#;

/// A snapshot of one 20 MiB segment with one 4 MiB block, its trace, and `settings` (the
/// `allocator_settings` dict's text, without braces).
fn snapshot(settings: &str) -> String {
    let seg = 20 << 20;
    let blk = 4 << 20;
    format!(
        r#"{{"segments": [{{"device": 0, "address": 1073741824, "total_size": {seg}, "allocated_size": {blk}, "active_size": {blk}, "requested_size": {blk}, "stream": 0, "segment_type": "large", "segment_pool_id": [0, 0], "is_expandable": false, "frames": [], "blocks": [{{"address": 1073741824, "size": {blk}, "requested_size": {blk}, "state": "active_allocated", "frames": []}}, {{"address": 1077936128, "size": 16777216, "requested_size": 0, "state": "inactive", "frames": []}}]}}],
 "device_traces": [[{{"action": "segment_alloc", "addr": 1073741824, "size": {seg}, "stream": 0, "time_us": 1}}, {{"action": "alloc", "addr": 1073741824, "size": {blk}, "stream": 0, "time_us": 2}}]],
 "allocator_settings": {{{settings}}}}}"#
    )
}

#[test]
fn a_2_11_recording_gets_2_11_rules_measured() {
    let j = json(&["replay", "traces/frag__default__2048M.pickle.gz", "--json"]);
    assert_eq!(j["rules"]["torch_version"], "2.11");
    assert_eq!(j["rules"]["measured"], true);
    assert_eq!(j["rules"]["evidence"].as_array().map(Vec::len), Some(0));
    let text = success(&["validate", "traces/frag__default__2048M.pickle.gz"]);
    assert!(text.starts_with("rules: PyTorch 2.11 (the default; the snapshot does not show its release); measured on torch 2.11.0"), "{text}");
}

#[test]
fn a_2_13_snapshot_gets_2_13_rules_read_not_measured() {
    let f = TempFile::new("v213.json");
    let settings =
        format!(r#""PYTORCH_CUDA_ALLOC_CONF": "", {SETTINGS_2_11}, "max_round_threshold": 18446744073709551615, "max_cached_size": 18446744073709551615"#);
    std::fs::write(&f.0, snapshot(&settings)).unwrap();
    let j = json(&["replay", f.arg(), "--json"]);
    assert_eq!(j["rules"]["torch_version"], "2.13");
    assert_eq!(j["rules"]["measured"], false);
    assert_eq!(j["rules"]["allowed"], serde_json::json!(["2.13", "2.15"]));
    let note = j["rules"]["note"].as_str().unwrap();
    assert!(note.contains("max_round_threshold") && note.contains("not measured"), "{note}");
    // Asked for 2.11: 2.11's rules, and the contradiction said.
    let text = success(&["validate", f.arg(), "--torch-version", "2.11"]);
    assert!(text.starts_with("rules: PyTorch 2.11 (asked with --torch-version, although the snapshot shows PyTorch 2.13 or later"), "{text}");
    assert!(text.contains("\n  exact\n"), "{text}");
}

#[test]
fn a_settings_key_of_a_later_release_picks_it() {
    let f = TempFile::new("v215.json");
    let settings = format!(r#""PYTORCH_CUDA_ALLOC_CONF": "expandable_segments_reserve:0.5", {SETTINGS_2_11}"#);
    std::fs::write(&f.0, snapshot(&settings)).unwrap();
    let j = json(&["replay", f.arg(), "--json"]);
    assert_eq!(j["rules"]["torch_version"], "2.15");
    // Refused by 2.11's parser: replayed under the values recorded in force, and said.
    let j = json(&["replay", f.arg(), "--json", "--torch-version", "2.11"]);
    assert_eq!(j["rules"]["torch_version"], "2.11");
    let note = j["rules"]["settings_note"].as_str().unwrap();
    assert!(note.contains("refused by PyTorch 2.11") && note.contains("Unrecognized key 'expandable_segments_reserve'"), "{note}");
}

/// One `segment_alloc` of `seg` bytes and an `alloc` of `size` at its start, and the final
/// segment with that block; `settings` as in [`snapshot`].
fn one_block(settings: &str, seg: u64, size: u64, expandable: bool) -> String {
    let (action, kind) = if expandable { ("segment_map", "true") } else { ("segment_alloc", "false") };
    // Expandable segments split off any remainder of at least 512 bytes; a 20 MiB segment cut for
    // 17 MiB under roundup_power2_divisions:4 is the whole block.
    let (block, rest) = if expandable { (size, seg - size) } else { (seg, 0) };
    let blocks = if rest > 0 {
        format!(
            r#"{{"address": 1073741824, "size": {block}, "requested_size": {size}, "state": "active_allocated", "frames": []}}, {{"address": {}, "size": {rest}, "requested_size": 0, "state": "inactive", "frames": []}}"#,
            1073741824 + block
        )
    } else {
        format!(r#"{{"address": 1073741824, "size": {block}, "requested_size": {size}, "state": "active_allocated", "frames": []}}"#)
    };
    format!(
        r#"{{"segments": [{{"device": 0, "address": 1073741824, "total_size": {seg}, "allocated_size": {block}, "active_size": {block}, "requested_size": {size}, "stream": 0, "segment_type": "large", "segment_pool_id": [0, 0], "is_expandable": {kind}, "frames": [], "blocks": [{blocks}]}}],
 "device_traces": [[{{"action": "{action}", "addr": 1073741824, "size": {seg}, "stream": 0, "time_us": 1}}, {{"action": "alloc", "addr": 1073741824, "size": {size}, "stream": 0, "time_us": 2}}]],
 "allocator_settings": {{{settings}}}}}"#
    )
}

/// Constructed from the rules: a 17 MiB request in a 20 MiB segment, which
/// `roundup_power2_divisions:4` makes (17 MiB rounds to 20 MiB) and the recorded settings (none:
/// an 18 MiB segment) do not. `validate` says the settings likely changed, not a bare "NOT exact".
#[test]
fn settings_changed_mid_run_are_named() {
    let f = TempFile::new("midrun.json");
    let settings = format!(r#""PYTORCH_CUDA_ALLOC_CONF": "", {SETTINGS_2_11}"#);
    std::fs::write(&f.0, one_block(&settings, 20 << 20, 17 << 20, false)).unwrap();
    let o = run(&["validate", f.arg()]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(1), "{text}");
    assert!(text.contains("NOT exact: the settings likely changed during the run"), "{text}");
    assert!(text.contains("request 0 (17825792 bytes) got a new segment of 20971520 bytes; the recorded settings make 18874368"), "{text}");
    let o = run(&["validate", f.arg(), "--json"]);
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(j["settings_changed"].as_array().map(Vec::len), Some(1), "{j}");
}

/// `test_allocator_settings` ends with `_set_allocator_settings("pinned_num_register_threads:1024")`,
/// which PyTorch refuses ("should be less than or equal to 128") after recording the string
/// (`last_allocator_settings_` is set before parsing). Constructed: that string recorded with
/// expandable segments in force (as set before it) and a trace that mapped pages. The trace
/// replays under the recorded values, exactly, and says so.
#[test]
fn a_refused_settings_string_replays_under_the_recorded_values() {
    let f = TempFile::new("refused.json");
    let settings = r#""PYTORCH_CUDA_ALLOC_CONF": "pinned_num_register_threads:1024", "max_split_size": -1, "garbage_collection_threshold": 0.0, "expandable_segments": true, "pinned_num_register_threads": 1, "release_lock_on_cudamalloc": false, "pinned_use_cuda_host_register": false, "graph_capture_record_stream_reuse": false, "roundup_power2_divisions": {"1": 0, "2": 0, "4": 0, "8": 0, "16": 0, "32": 0, "64": 0, "128": 0, "256": 0, "512": 0, "1024": 0, "2048": 0, "4096": 0, "8192": 0, "16384": 0, "32768": 0}"#;
    std::fs::write(&f.0, one_block(settings, 20 << 20, 17 << 20, true)).unwrap();
    let text = success(&["validate", f.arg()]);
    assert!(text.contains("\n  exact\n"), "{text}");
    assert!(
        text.contains("note: the recorded settings string \"pinned_num_register_threads:1024\" was refused by PyTorch 2.11 (Number of register threads should be less than or equal to 128, got 1024)"),
        "{text}"
    );
    let j = json(&["replay", f.arg(), "--json"]);
    assert_eq!(j["segment_events"][0]["action"], "segment_map");
}

/// Every settings string a command replays under is parsed as the trace's release parses it: a
/// grid point or `fit --config` with a key only later releases accept is a row of a 2.15
/// snapshot, not a refusal (as `--config` is: `Prepared::parse_config`).
#[test]
fn grids_are_parsed_as_the_traces_release_parses_them() {
    let f = TempFile::new("v215_grid.json");
    let settings = format!(r#""PYTORCH_CUDA_ALLOC_CONF": "expandable_segments_reserve:0.5", {SETTINGS_2_11}"#);
    std::fs::write(&f.0, snapshot(&settings)).unwrap();
    let later = "expandable_segments:True,expandable_segments_reserve:0.5";
    let j = json(&["sweep", f.arg(), "--grid", "expandable_segments=True; expandable_segments_reserve=0.5", "--placements", "1", "--json"]);
    let rows = j["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 1, "{j}");
    assert_eq!((rows[0]["conf"].as_str(), &rows[0]["rejected"]), (Some(later), &serde_json::Value::Null), "{j}");
    let j = json(&["fit", f.arg(), "--config", later, "--json"]);
    assert!(j.get("rejected").is_none() && j["capacity"].is_u64(), "{j}");
    // A 2.11 recording refuses the key, as PyTorch 2.11 does.
    let j = json(&["sweep", "traces/frag__default__2048M.pickle.gz", "--grid", "expandable_segments_reserve=0.5", "--placements", "1", "--json"]);
    assert!(j["rows"][0]["rejected"].as_str().is_some_and(|e| e.contains("Unrecognized key")), "{j}");
}
