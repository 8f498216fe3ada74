//! Retries on a full device without an OOM (`allocsim_replay::budget::MallocRetries`): a malloc
//! whose first cudaMalloc or map the device refuses releases the cached blocks and retries; with
//! no OOM entry in the trace, the releases' stack (the malloc's own) is what tells them from an
//! `empty_cache()` call.
//!
//! Built from a real recording: `traces/field/devfull_findbatch__expandable` (H200, torch 2.11,
//! a second process leaving 5 GiB; the job caught 4 OOMs; PyTorch counted 6 retries) with its 4
//! `oom` entries taken out, as a job that caught none would record it. Its two retries that
//! succeeded stay as PyTorch recorded them; the releases before the 4 OOMs become releases no
//! malloc follows, as an `empty_cache()`'s. What PyTorch counted for this run: 6 retries, 4 of
//! them the OOMs' (each OOM counts its retry), so 2 for the trace without them.

mod common;

use allocsim_trace::{Action, read_trace, snapshot};
use common::{TempFile, json, root, success};

#[test]
fn retries_without_an_oom_on_a_full_device_replay() {
    let name = "devfull_findbatch__expandable";
    let meta: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(root(&format!("traces/field/{name}.json"))).unwrap()).unwrap();
    let stats = &meta["memory_stats"];
    let (retries, ooms) = (stats["num_alloc_retries"].as_i64().unwrap(), stats["num_ooms"].as_i64().unwrap());
    assert_eq!((retries, ooms), (6, 4), "the recording");
    let mut snap = read_trace(&root(&format!("traces/field/{name}.pickle.gz"))).unwrap();
    snap.device_traces[0].retain(|e| e.action != Action::Oom);
    let f = TempFile::new("devfull_no_oom.pickle");
    std::fs::write(&f.0, snapshot::to_pickle(&snap)).unwrap();
    for extra in [&[][..], &["--in-memory"][..]] {
        let mut args = vec!["replay", f.arg(), "--json"];
        args.extend_from_slice(extra);
        let r = json(&args);
        assert_eq!(r["stats"]["num_alloc_retries"].as_i64(), Some(retries - ooms), "{extra:?}");
        assert_eq!(r["stats"]["num_ooms"].as_i64(), Some(0), "{extra:?}");
        let b = &r["budget"];
        assert_eq!(b["kind"], "device_full", "{b}");
        assert_eq!(b["retries"].as_array().map(Vec::len), Some(2), "{b}");
    }
    let v = success(&["validate", f.arg()]);
    assert!(v.contains("\n  exact\n") && v.contains("the device refused the first cudaMalloc/map of 2 requests"), "{v}");
    // The recording itself (with its OOMs) still counts all 6.
    let r = json(&["replay", &root(&format!("traces/field/{name}.pickle.gz")).to_string_lossy(), "--json"]);
    assert_eq!((r["stats"]["num_alloc_retries"].as_i64(), r["stats"]["num_ooms"].as_i64()), (Some(retries), Some(ooms)));
}

/// An `empty_cache()` right before a malloc that needs a new segment has the same shape, but its
/// releases carry `empty_cache`'s stack: no retry (`traces/emptycache__default__0M`, recorded
/// with 0 retries, does this five times).
#[test]
fn empty_cache_before_a_new_segment_is_no_retry() {
    let m: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(root("traces/emptycache__default__0M.json")).unwrap()).unwrap();
    let r = json(&["replay", &root("traces/emptycache__default__0M.pickle.gz").to_string_lossy(), "--json"]);
    assert_eq!(r["stats"]["num_alloc_retries"].as_i64(), m["memory_stats"]["num_alloc_retries"].as_i64());
    assert_eq!(r["stats"]["num_alloc_retries"].as_i64(), Some(0));
    assert_eq!(r["budget"]["retries"].as_array().map(Vec::len), Some(0), "{}", r["budget"]);
}
