//! PyTorch's own allocator tests (`test/test_cuda.py`) and four scenarios, recorded on an H100 with
//! torch 2.11 (`traces/field/test_cuda/`, `tools/record_test_cuda_all.sh`), validated against
//! what the real allocator recorded; and the checkpointing what-if pair in `traces/field/whatif/`.

mod common;

use common::{json, root, run};

fn validate(name: &str) -> String {
    let path = format!("traces/field/test_cuda/{name}.pickle.gz");
    assert!(root(&path).exists(), "{path} is required");
    let o = run(&["validate", &path]);
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn exact(text: &str) -> bool {
    text.lines().any(|l| l.trim() == "exact")
}

/// Every recording that keeps one settings string and one fraction for the whole run (and the
/// scenarios whose changes the snapshot shows in full) replays exactly: segment events, OOMs,
/// addresses and final segments. Not listed: `test_mempool_multithread` and
/// `test_mempool_with_allocator`, whose snapshots hold no trace entries (nothing to replay).
#[test]
fn allocator_tests_replay_exactly() {
    let names = [
        "fraction_midrun__default",
        "fraction_midrun__expandable",
        "refused_settings__default",
        "refused_settings__expandable",
        "retries_devfull__default",
        "retries_devfull__expandable",
        "test_caching_allocator_record_stream_oom__default",
        "test_caching_allocator_record_stream_oom__expandable",
        "test_deleted_mempool_not_used_on_oom__default",
        "test_garbage_collect_expandable__default",
        "test_garbage_collect_expandable__expandable",
        "test_mempool_empty_cache__default",
        "test_mempool_empty_cache__expandable",
        "test_mempool_empty_cache_inactive__default",
        "test_mempool_empty_cache_inactive__expandable",
        "test_mempool_no_split__default",
        "test_mempool_no_split__expandable",
        "test_notifies_oom__default",
        "test_notifies_oom__expandable",
        "test_out_of_memory_retry__default",
        "test_out_of_memory_retry__expandable",
        "test_record_stream__default",
        "test_record_stream__expandable",
        "test_set_per_process_memory_fraction__default",
        "test_set_per_process_memory_fraction__expandable",
        "test_tensor_delete_after_allocator_delete__default",
        "test_tensor_delete_after_allocator_delete__expandable",
    ];
    assert_eq!(names.len(), 27);
    let not: Vec<_> = names.iter().filter(|n| !exact(&validate(n))).collect();
    assert!(not.is_empty(), "not exact: {not:?}");
}

/// `test_mempool_multithread` and `test_mempool_with_allocator` were recorded with trace entries
/// off for their threads or allocator: their snapshots hold final segments and no history, so
/// validate has nothing to check and says so (exit status 3), not "exact".
#[test]
fn snapshots_without_history_have_nothing_to_validate() {
    for name in [
        "test_mempool_multithread__default",
        "test_mempool_multithread__expandable",
        "test_mempool_with_allocator__default",
        "test_mempool_with_allocator__expandable",
    ] {
        let path = format!("traces/field/test_cuda/{name}.pickle.gz");
        let o = run(&["validate", &path]);
        let text = String::from_utf8_lossy(&o.stdout);
        assert_eq!(o.status.code(), Some(3), "{name}:\n{text}");
        assert!(text.contains("nothing to validate: the snapshot has no trace entries") && !exact(&text), "{name}:\n{text}");
    }
}

/// The first reservation of these processes predates the history; the spacing to the next, recorded
/// one tells the card's memory: an H100's, not the H200 assumed otherwise.
#[test]
fn a_reservation_made_before_the_history_tells_the_device() {
    let v = json(&["replay", "traces/field/test_cuda/retries_devfull__expandable.pickle.gz", "--json"]);
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root("traces/field/test_cuda/retries_devfull__expandable.json")).unwrap()).unwrap();
    let real = m["device_total_memory"].as_u64().unwrap();
    let b = &v["budget"];
    let got = b["device_memory"].as_u64().unwrap_or_else(|| panic!("no device memory in {b}"));
    let range = (b["device_memory_range"][0].as_u64().unwrap(), b["device_memory_range"][1].as_u64().unwrap());
    assert!(range.0 <= real && real <= range.1, "the card's {real} bytes outside the inferred range {range:?}");
    assert!(got.abs_diff(real) < 64 << 20, "inferred {got}, the card has {real}");
}

/// Tests that change the settings at run time (`_set_allocator_settings`, recorded in each `.json`'s
/// `settings_calls`): a snapshot keeps only the last settings, so validate says the settings changed
/// rather than a bare "NOT exact".
#[test]
fn settings_changed_at_run_time_are_named() {
    for name in [
        "settings_midrun__default",
        "settings_midrun__expandable",
        "test_allocator_settings__default",
        "test_allocator_settings__expandable",
        "test_max_split_expandable__default",
        "test_max_split_expandable__expandable",
        "test_mempool_expandable__default",
        "test_mempool_expandable__expandable",
    ] {
        let text = validate(name);
        assert!(exact(&text) || text.contains("the settings likely changed during the run"), "{name}:\n{text}");
    }
}

/// Activation checkpointing with fused AdamW, uncapped (the input) and under a 45111 MiB cap: both
/// replay exactly; the input replayed under the capped run's cap and addresses makes every segment
/// event the capped run recorded — and yet the two real processes freed the same allocations in
/// another order, which is why `inactive_split.all.peak` of that what-if is not the capped run's.
#[test]
fn checkpointing_what_if_frees_in_another_order() {
    let input = "traces/field/whatif/ckpt__default__0M.pickle.gz";
    let capped = "traces/field/whatif/ckpt__default__45111M.pickle.gz";
    for f in [input, capped] {
        let o = run(&["validate", f]);
        assert!(exact(&String::from_utf8_lossy(&o.stdout)), "{f} is not exact");
    }
    let m: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(root("traces/field/whatif/ckpt__default__45111M.json")).unwrap()).unwrap();
    let cap = m["cap_bytes"].as_u64().unwrap().to_string();
    let what_if = json(&["replay", input, "--capacity", &cap, "--addresses-from", capped, "--json"]);
    let own = json(&["replay", capped, "--json"]);
    let events = |v: &serde_json::Value| {
        v["segment_events"].as_array().unwrap().iter().map(|e| (e["action"].clone(), e["size"].clone(), e["addr"].clone())).collect::<Vec<_>>()
    };
    assert_eq!(events(&what_if), events(&own), "the what-if's segment events");
    // The frees, as the index of the allocation each frees, in trace order: not the same sequence.
    let frees = |path: &str| {
        let snap = allocsim_trace::read_trace_whole(&root(path)).unwrap();
        let (mut live, mut n, mut out) = (std::collections::HashMap::new(), 0usize, Vec::new());
        for e in &snap.device_traces[0] {
            match e.action {
                allocsim_trace::Action::Alloc => {
                    live.insert(e.addr, n);
                    n += 1;
                }
                allocsim_trace::Action::FreeRequested => out.push(live.get(&e.addr).copied()),
                _ => {}
            }
        }
        out
    };
    let (a, b) = (frees(input), frees(capped));
    assert_eq!(a.len(), b.len());
    assert_ne!(a, b, "the two processes freed in the same order");
}
