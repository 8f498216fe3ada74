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
        fr("at::native::empty_cuda(c10::ArrayRef<long>, std::optional<c10::ScalarType>, std::optional<c10::Layout>, std::optional<c10::Device>, std::optional<bool>, std::optional<c10::MemoryFormat>)", "??"),
        fr("at::_ops::empty_memory_format::call(c10::ArrayRef<c10::SymInt>, std::optional<c10::ScalarType>, std::optional<c10::Layout>, std::optional<c10::Device>, std::optional<bool>, std::optional<c10::MemoryFormat>)", "??"),
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
