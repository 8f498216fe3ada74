//! The `allocsim replay` command on real-world snapshots: traces that start mid-history,
//! several devices, other PyTorch versions, and hostile input (absurd sizes, addresses out of any
//! range, unknown actions, pre-2.1 snapshots): each bad input ends with exit status 2 and one
//! `allocsim: error: ...` line naming the entry, never a panic.

mod common;
use common::*;

/// `traces/frag__default__2048M` in JSON Lines with the first half of its events cut off, as the
/// ring buffer would.
fn frag_cut() -> TempFile {
    let full = TempFile::new("frag.jsonl");
    success(&["convert", "traces/frag__default__2048M.pickle.gz", "-o", full.arg()]);
    let text = std::fs::read_to_string(&full.0).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let events: Vec<&str> = lines[1..].iter().copied().filter(|l| l.contains("\"action\"")).collect();
    let segments: Vec<&str> = lines[1..].iter().copied().filter(|l| l.contains("\"segment\"")).collect();
    let mut out = vec![lines[0]];
    out.extend(&events[events.len() / 2..]);
    out.extend(segments);
    let cut = TempFile::new("frag_cut.jsonl");
    std::fs::write(&cut.0, out.join("\n") + "\n").unwrap();
    cut
}

#[test]
fn a_truncated_trace_says_what_pre_existed() {
    let cut = frag_cut();
    let text = success(&["replay", cut.arg(), "--capacity", "2GiB"]);
    assert!(text.contains("mid-history") && text.contains("pre-existing blocks"), "{text}");
    let j = json(&["replay", cut.arg(), "--capacity", "2GiB", "--json"]);
    let init = &j["initial_state"];
    assert!(init["blocks"].as_u64().unwrap() > 0, "{init}");
    assert!(init["allocated_bytes"].as_u64().unwrap() > 0, "{init}");
    assert_eq!(init["reserved_bytes"].as_u64(), Some((100 * 20) << 20), "{init}");
    assert_eq!(j["unknown_frees"].as_u64(), Some(0));
    // fidelity.py's contract: stats, segment_events, ooms at the top level.
    assert!(j["stats"]["reserved_bytes.all.current"].is_i64() && j["segment_events"].is_array() && j["ooms"].is_array());
    // A complete trace starts from an empty allocator.
    let full = json(&["replay", "traces/frag__default__2048M.pickle.gz", "--capacity", "2GiB", "--json"]);
    assert!(full["initial_state"].is_null());
}

#[test]
fn many_devices_each_on_its_own_allocator_worst_first() {
    let f = "tests/fixtures/robust/two_devices.pickle";
    let text = success(&["replay", f, "--capacity", "64MiB"]);
    let d1 = text.find("(device 1)").expect("device 1 reported");
    let d0 = text.find("(device 0)").expect("device 0 reported");
    assert!(d1 < d0, "the device with an OOM comes first:\n{text}");
    assert!(text.contains("2 devices"), "{text}");
    let all = json(&["replay", f, "--capacity", "64MiB", "--json"]);
    let devices = all["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 2);
    assert_eq!((devices[0]["device"].as_u64(), devices[0]["rank"].as_u64(), devices[0]["ooms"].as_u64()), (Some(0), Some(1), Some(0)));
    assert_eq!((devices[1]["device"].as_u64(), devices[1]["rank"].as_u64(), devices[1]["ooms"].as_u64()), (Some(1), Some(0), Some(1)));
    // The top level is the device that matters (the one that ran out of memory), exactly as
    // `--device 1` gives it, and the JSON says why.
    let d1 = json(&["replay", f, "--capacity", "64MiB", "--json", "--device", "1"]);
    for k in ["device", "requests", "stats", "segment_events", "ooms"] {
        assert_eq!(all[k], d1[k], "{k}");
    }
    assert_eq!(all["device_choice"]["reason"], "ran_out_of_memory");
    assert_eq!(d1["ooms"][0]["request"].as_u64(), Some(1));
    assert_eq!(d1["devices"].as_array().unwrap().len(), 1);
}

#[test]
fn torch_versions_select_their_rules() {
    let t = "traces/frag__default__2048M.pickle.gz";
    user_error(
        &["replay", t, "--torch-version", "2.5", "--config", "max_non_split_rounding_mb:64"],
        &["RuntimeError: Unrecognized CachingAllocator option: max_non_split_rounding_mb"],
    );
    user_error(&["replay", t, "--torch-version", "2.5", "--config", "foo:1"], &["RuntimeError: Unrecognized CachingAllocator option: foo"]);
    user_error(&["replay", t, "--torch-version", "2.9", "--config", "max_split_size_mb:20"], &["must be > 20", "PyTorch 2.9"]);
    user_error(&["replay", t, "--config", "foo:1"], &["Unrecognized key 'foo' in CUDA allocator config."]);
    let ok = json(&["replay", t, "--torch-version", "2.10", "--config", "max_split_size_mb:20", "--json"]);
    assert_eq!(ok["torch_version"], "2.10");
    // Same numbers for the oversize tolerance in every version: the recorded run replays the same.
    let a = json(&["replay", t, "--capacity", "2GiB", "--json"]);
    let b = json(&["replay", t, "--capacity", "2GiB", "--json", "--torch-version", "2.5"]);
    assert_eq!(a["segment_events"], b["segment_events"]);
    // Not a version allocsim models: clap's error, exit status 2.
    let o = run(&["replay", t, "--torch-version", "1.13"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("2.1 to 2.15"));
}

#[test]
fn pre_2_1_snapshots_are_refused_clearly() {
    user_error(&["replay", "crates/trace/tests/fixtures/snap/pre21.pickle"], &["PyTorch < 2.1", "history"]);
}

#[test]
fn absurd_values_name_the_entry() {
    let d = "tests/fixtures/robust";
    user_error(&["replay", &format!("{d}/huge_size.pickle")], &["trace entry 2 (alloc)", "9223372036854775808"]);
    user_error(&["replay", &format!("{d}/far_addr.pickle")], &["trace entry 2 (segment_alloc)", "address space"]);
    user_error(&["replay", &format!("{d}/negative_addr.pickle")], &["device_traces[0][2]['addr']", "-4096"]);
    user_error(&["replay", &format!("{d}/bigint_addr.pickle")], &["device_traces[0][2]['addr']", "1180591620717411303424"]);
    user_error(&["replay", &format!("{d}/unknown_action.pickle")], &["device_traces[0][2]", "unknown action \"explode\""]);
    // The same in JSON Lines.
    let f = TempFile::new("huge.jsonl");
    std::fs::write(
        &f.0,
        "{\"format\":\"allocsim-trace\",\"version\":1}\n\
         {\"action\":\"segment_alloc\",\"addr\":139637976727552,\"size\":2097152}\n\
         {\"action\":\"oom\",\"device_free\":0,\"size\":18446744073709551615}\n",
    )
    .unwrap();
    user_error(&["replay", f.arg()], &["trace entry 1 (oom)", "18446744073709551615"]);
    let g = TempFile::new("action.jsonl");
    std::fs::write(&g.0, "{\"format\":\"allocsim-trace\",\"version\":1}\n{\"action\":\"teleport\",\"addr\":0,\"size\":1}\n").unwrap();
    user_error(&["replay", g.arg()], &["line 2", "teleport"]);
}

#[test]
fn a_trace_that_frees_an_address_never_allocated_replays_and_says_so() {
    // A free of an address that neither the trace nor the final segments know: the state cannot
    // be reconstructed from them, so the replay starts empty and counts the free as unknown.
    let f = TempFile::new("stray.jsonl");
    std::fs::write(
        &f.0,
        "{\"format\":\"allocsim-trace\",\"version\":1}\n\
         {\"action\":\"free_requested\",\"addr\":4096,\"size\":512}\n\
         {\"action\":\"free_completed\",\"addr\":4096,\"size\":512}\n\
         {\"action\":\"segment_alloc\",\"addr\":139637976727552,\"size\":2097152}\n\
         {\"action\":\"alloc\",\"addr\":139637976727552,\"size\":512}\n",
    )
    .unwrap();
    let text = success(&["replay", f.arg()]);
    assert!(text.contains("could not be reconstructed") && text.contains("frees of blocks allocated before the trace began were ignored"), "{text}");
    let j = json(&["replay", f.arg(), "--json"]);
    assert_eq!(j["unknown_frees"].as_u64(), Some(2));
    assert!(j["reconstruct_error"].as_str().unwrap().contains("entry"), "{j}");
}
