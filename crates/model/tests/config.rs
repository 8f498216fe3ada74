//! `PYTORCH_CUDA_ALLOC_CONF` parsing and the size rules (`round_size`, `get_allocation_size`),
//! checked against measurements on the real allocator (torch 2.11.0+cu130, one H200):
//!
//! * the cases of `shared/reference/probe-cases` (oracle error texts, spec §1.1/§1.2 rounding,
//!   `probe1_2.11.json`);
//! * `RUNTIME_CASES` below: each row is one fresh process that called
//!   `torch.cuda.memory._set_allocator_settings(s)` for every `s` of `seq` (no environment
//!   variable), then read `torch.cuda.memory._snapshot()["allocator_settings"]`, and the segment
//!   size of a 2 MiB request (= `large_segment_size`). Texts are `str(exception)` prefixed with the
//!   Python type; `ConfigError` holds the text without the type.

use allocsim_model::config::{AllocatorConfig, roundup_power2_next_division};
use allocsim_model::constants::*;

fn parse_err(conf: &str) -> String {
    match AllocatorConfig::parse(conf) {
        Ok(c) => panic!("{conf:?} was accepted: {c:?}"),
        Err(e) => e.0,
    }
}

fn parse_ok(conf: &str) -> AllocatorConfig {
    AllocatorConfig::parse(conf).unwrap_or_else(|e| panic!("{conf:?} was rejected: {e}"))
}

/// A configuration that has already been through one runtime settings call, so later calls get
/// the runtime rules (generic parser first, `... in Accelerator allocator config.`).
fn runtime_cfg() -> AllocatorConfig {
    let mut c = parse_ok("");
    c.apply("expandable_segments:False").unwrap();
    c
}

/// Strips the Python exception type: `ValueError: msg` → `msg`.
fn strip_type(text: &str) -> &str {
    for ty in ["ValueError: ", "RuntimeError: ", "IndexError: "] {
        if let Some(rest) = text.strip_prefix(ty) {
            return rest;
        }
    }
    panic!("no exception type in {text:?}")
}

// --------------------------------------------------------------------------------------------
// Error texts measured with the environment variable (oracle_cases_2.11.json)

#[test]
fn env_error_texts_measured() {
    // ConfigError carries the C++ message; Python shows these as "ValueError: <message>".
    assert_eq!(parse_err("foo_bar:1"), "Unrecognized key 'foo_bar' in CUDA allocator config.");
    assert_eq!(parse_err("max_split_size_mb:19"), "CachingAllocator option max_split_size_mb too small, must be >= 20");
    assert_eq!(parse_err("large_segment_size_mb:10"), "CachingAllocator option large_segment_size_mb must be > 10 MB");
    assert_eq!(parse_err("large_segment_size_mb:40,max_split_size_mb:30"), "CachingAllocator option max_split_size_mb too small, must be >= 40");
    assert_eq!(parse_err("expandable_segments:true"), "Expected 'True' or 'False' at index 2 in ConfigTokenizer but got 'true'");
}

#[test]
fn env_structural_errors_abort_at_load_time() {
    // Measured: with the variable set before `import torch`, these abort the process at library
    // load ("terminate called after throwing an instance of 'c10::Error'") with these texts.
    let idx = "i < config_.size() INTERNAL ASSERT FAILED at \"/pytorch/c10/core/AllocatorConfig.h\":124, please report a bug to PyTorch. Index out of bounds in ConfigTokenizer";
    assert_eq!(parse_err("max_split_size_mb"), idx);
    assert_eq!(parse_err(","), idx);
    assert_eq!(
        parse_err("roundup_power2_divisions:[256:4"),
        "i < config_.size() INTERNAL ASSERT FAILED at \"/pytorch/c10/core/AllocatorConfig.h\":115, please report a bug to PyTorch. Expected closing bracket ']' in ConfigTokenizer but reached end of config"
    );
    // A key known to neither parser is reported by the CUDA parser at process start even when a
    // generic value error comes first in the string (inferred order, see config_parse.rs).
    assert_eq!(parse_err("max_split_size_mb:19,foo_bar:1"), "Unrecognized key 'foo_bar' in CUDA allocator config.");
}

#[test]
fn whitespace_is_dropped() {
    let c = parse_ok(" max_split_size_mb : 100 ,\texpandable_segments:False");
    assert_eq!(c.max_split_size, 100 * MIB);
    assert!(!c.expandable_segments);
    assert_eq!(c.source, " max_split_size_mb : 100 ,\texpandable_segments:False");
}

#[test]
fn empty_string_gives_defaults() {
    let c = parse_ok("");
    assert_eq!(c, AllocatorConfig::default());
    assert_eq!(c.max_split_size, u64::MAX);
    assert_eq!(c.max_non_split_rounding_size, 20 * MIB);
    assert_eq!(c.large_segment_size, 20 * MIB);
    assert_eq!(c.roundup_power2_divisions, [0; 16]);
    assert_eq!(c.pinned_num_register_threads, 1);
    assert!(c.backend_native);
}

#[test]
fn all_keys_parse() {
    let c = parse_ok(
        "backend:native,max_split_size_mb:100,max_non_split_rounding_mb:50,large_segment_size_mb:32,\
         garbage_collection_threshold:0.6,roundup_power2_divisions:4,expandable_segments:True,\
         pinned_use_background_threads:True,release_lock_on_cudamalloc:True,pinned_use_cuda_host_register:True,\
         pinned_num_register_threads:8,pinned_reserve_segment_size_mb:64,graph_capture_record_stream_reuse:True,\
         per_process_memory_fraction:0.9",
    );
    assert_eq!(c.max_split_size, 100 * MIB);
    assert_eq!(c.max_non_split_rounding_size, 50 * MIB);
    assert_eq!(c.large_segment_size, 32 * MIB);
    assert_eq!(c.garbage_collection_threshold, 0.6);
    assert_eq!(c.roundup_power2_divisions, [4; 16]);
    assert!(c.expandable_segments && c.pinned_use_background_threads && c.release_lock_on_cudamalloc);
    assert!(c.pinned_use_cuda_host_register && c.graph_capture_record_stream_reuse && c.backend_native);
    assert_eq!(c.pinned_num_register_threads, 8);
    assert_eq!(c.pinned_reserve_segment_size_mb, 64);
    assert_eq!(c.per_process_memory_fraction, Some(0.9));
    assert!(c.gc_enabled());
}

#[test]
fn backend_at_start_and_at_runtime() {
    let c = parse_ok("backend:cudaMallocAsync");
    assert!(!c.backend_native);
    assert_eq!(parse_err("backend:foo"), "Unknown allocator backend, options are native and cudaMallocAsync");
    let mut r = runtime_cfg();
    assert_eq!(
        r.apply("backend:cudaMallocAsync").unwrap_err().0,
        "tokenizer[i] == get()->name() INTERNAL ASSERT FAILED at \"/pytorch/c10/cuda/CUDAAllocatorConfig.cpp\":44, please report a bug to PyTorch. Allocator backend parsed at runtime != allocator backend parsed at load time, cudaMallocAsync != native"
    );
    r.apply("backend:native").unwrap();
}

// --------------------------------------------------------------------------------------------
// Reset semantics

#[test]
fn every_parse_resets_split_roundup_gc_and_non_split() {
    let mut c = parse_ok("max_split_size_mb:100,roundup_power2_divisions:4,garbage_collection_threshold:0.5,max_non_split_rounding_mb:50");
    assert_eq!(c.max_split_size, 100 * MIB);
    assert_eq!(c.max_non_split_rounding_size, 50 * MIB);
    c.apply("expandable_segments:True").unwrap();
    assert_eq!(c.max_split_size, u64::MAX);
    assert_eq!(c.roundup_power2_divisions, [0; 16]);
    assert_eq!(c.garbage_collection_threshold, 0.0);
    assert_eq!(c.max_non_split_rounding_size, c.large_segment_size);
    assert!(c.expandable_segments);
    assert_eq!(c.source, "expandable_segments:True");

    // Measured case settings_runtime_reset.
    let mut c = parse_ok("max_split_size_mb:100");
    c.apply("expandable_segments:False").unwrap();
    assert_eq!(c.max_split_size, u64::MAX);

    // Other keys keep their value when absent, large_segment_size_mb included.
    let mut c = parse_ok("large_segment_size_mb:64,release_lock_on_cudamalloc:True,per_process_memory_fraction:0.5");
    c.apply("max_split_size_mb:100").unwrap();
    assert_eq!(c.large_segment_size, 64 * MIB);
    assert_eq!(c.max_non_split_rounding_size, 64 * MIB);
    assert!(c.release_lock_on_cudamalloc);
    assert_eq!(c.per_process_memory_fraction, Some(0.5));
    assert_eq!(c.apply("max_split_size_mb:30").unwrap_err().0, "CachingAllocator option max_split_size_mb too small, must be >= 64");
}

#[test]
fn large_segment_size_mb() {
    let c = parse_ok("large_segment_size_mb:64");
    assert_eq!(c.large_segment_size, 64 * MIB);
    assert_eq!(c.max_non_split_rounding_size, 64 * MIB);
    assert_eq!(c.get_allocation_size(c.round_size(2 * MIB)), 64 * MIB);
    // Read before the other keys, wherever it is in the string.
    assert_eq!(parse_err("max_split_size_mb:30,large_segment_size_mb:40"), "CachingAllocator option max_split_size_mb too small, must be >= 40");
    assert_eq!(
        parse_err("large_segment_size_mb:40,max_non_split_rounding_mb:30"),
        "CachingAllocator option max_non_split_rounding_mb too small, must be >= 40"
    );
    assert_eq!(parse_ok("large_segment_size_mb:40,max_split_size_mb:40").max_split_size, 40 * MIB);
}

#[test]
fn numbers_parse_like_stoull_and_stod() {
    // Longest valid prefix, sign accepted, base 10 (all measured at runtime, see RUNTIME_CASES).
    assert_eq!(parse_ok("max_split_size_mb:100abc").max_split_size, 100 * MIB);
    assert_eq!(parse_ok("max_split_size_mb:+100").max_split_size, 100 * MIB);
    assert_eq!(parse_ok("max_split_size_mb:-1").max_split_size, (u64::MAX / MIB) * MIB);
    assert_eq!(parse_ok("max_split_size_mb:18446744073709551615").max_split_size, (u64::MAX / MIB) * MIB);
    assert_eq!(parse_err("max_split_size_mb:1e3"), "CachingAllocator option max_split_size_mb too small, must be >= 20");
    assert_eq!(parse_err("max_split_size_mb:0x40"), "CachingAllocator option max_split_size_mb too small, must be >= 20");
    assert_eq!(parse_err("max_split_size_mb:abc"), "stoull"); // ValueError (std::invalid_argument)
    assert_eq!(parse_err("max_split_size_mb:99999999999999999999"), "stoull"); // IndexError (std::out_of_range)
    assert_eq!(parse_ok("garbage_collection_threshold:.5").garbage_collection_threshold, 0.5);
    assert_eq!(parse_ok("garbage_collection_threshold:0.5x").garbage_collection_threshold, 0.5);
    assert_eq!(parse_ok("garbage_collection_threshold:0x0.8p0").garbage_collection_threshold, 0.5);
    assert_eq!(parse_ok("garbage_collection_threshold:5e-1").garbage_collection_threshold, 0.5);
    assert_eq!(parse_ok("garbage_collection_threshold:0X.4P1").garbage_collection_threshold, 0.5);
    assert_eq!(parse_err("garbage_collection_threshold:abc"), "stod");
    assert_eq!(parse_err("garbage_collection_threshold:1e-400"), "stod");
    assert_eq!(parse_err("garbage_collection_threshold:1e400"), "stod");
    let bad_gc = "garbage_collect_threshold is invalid, set it in (0.0, 1.0)";
    for v in ["0", "1", "nan", "inf", "-0.5", "NaN", "-inf"] {
        assert_eq!(parse_err(&format!("garbage_collection_threshold:{v}")), bad_gc, "{v}");
    }
    assert_eq!(parse_ok("per_process_memory_fraction:0").per_process_memory_fraction, Some(0.0));
    assert_eq!(parse_ok("per_process_memory_fraction:1").per_process_memory_fraction, Some(1.0));
    assert_eq!(parse_err("per_process_memory_fraction:nan"), "per_process_memory_fraction is invalid, set it in [0.0, 1.0]");
}

// --------------------------------------------------------------------------------------------
// Rounding and pool choice (spec §1.1–§1.3, measured)

#[test]
fn roundup_scalar_4() {
    let c = parse_ok("roundup_power2_divisions:4");
    assert_eq!(c.roundup_power2_divisions, [4; 16]);
    for (n, want) in [(1200, 1536), (3000, 3072), (2049, 2560), (4096, 4096), (MIB + 1, MIB + MIB / 4), (5 * MIB + 1, 6 * MIB), (100 * MIB + 1, 112 * MIB)] {
        assert_eq!(c.round_size(n), want, "round_size({n})");
    }
    assert_eq!(parse_err("roundup_power2_divisions:0"), "For roundups, the divisions has to be power of 2 ");
    assert_eq!(parse_err("roundup_power2_divisions:3"), "For roundups, the divisions has to be power of 2 ");
}

#[test]
fn roundup_lists() {
    let c = parse_ok("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]");
    assert_eq!(c.roundup_power2_divisions, [1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 4, 8, 8, 8, 8, 8]);
    for (n, want) in
        [(3 * MIB + 1, 3 * MIB + 512), (300 * MIB + 1, 300 * MIB + 512), (600 * MIB + 1, 768 * MIB), (1200 * MIB + 1, 1280 * MIB), (2500 * MIB + 1, 2560 * MIB)]
    {
        assert_eq!(c.round_size(n), want, "round_size({n})");
    }
    let c = parse_ok("roundup_power2_divisions:[2:8,256:4,>:2]");
    assert_eq!(c.roundup_power2_divisions, [8, 8, 0, 0, 0, 0, 0, 0, 4, 2, 2, 2, 2, 2, 2, 2]);
    for (n, want) in [(3 * MIB + 1, 3 * MIB + MIB / 4), (300 * MIB + 1, 320 * MIB), (600 * MIB + 1, 768 * MIB)] {
        assert_eq!(c.round_size(n), want, "round_size({n})");
    }
}

#[test]
fn roundup_list_edges() {
    // `>` first: fills from entry 1 (last_index starts at 0); entry 0 stays 0 (measured).
    assert_eq!(parse_ok("roundup_power2_divisions:[>:4]").roundup_power2_divisions, [0, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4]);
    // Keys above 32 GiB clamp to the last entry; the first key fills everything below it.
    assert_eq!(parse_ok("roundup_power2_divisions:[1048576:4]").roundup_power2_divisions, [4; 16]);
    // 2.10+: `>` no longer overwrites the last explicit entry; a later key still applies.
    assert_eq!(parse_ok("roundup_power2_divisions:[256:4,>:2,512:8]").roundup_power2_divisions, [4, 4, 4, 4, 4, 4, 4, 4, 4, 8, 2, 2, 2, 2, 2, 2]);
    assert_eq!(parse_ok("roundup_power2_divisions:[]").roundup_power2_divisions, [0; 16]);
    assert_eq!(parse_err("roundup_power2_divisions:[3:4]"), "For roundups, the intervals have to be power of 2 ");
    assert_eq!(parse_err("roundup_power2_divisions:[0:4]"), "For roundups, the intervals have to be power of 2 ");
    assert_eq!(parse_err("roundup_power2_divisions:[256:3]"), "For roundups, the divisions has to be power of 2 or 0 to disable roundup ");
    // 0 is allowed in the list form and disables rounding for that interval.
    let c = parse_ok("roundup_power2_divisions:[256:0,>:4]");
    assert_eq!(c.round_size(300 * MIB + 1), 300 * MIB + 512);
    assert_eq!(c.round_size(600 * MIB + 1), 640 * MIB);
}

#[test]
fn pool_choice_and_segment_size() {
    let c = parse_ok("");
    // Request 10 MiB - 1 rounds to exactly 10 MiB → a 10 MiB segment (measured).
    assert_eq!(c.round_size(10 * MIB - 1), 10 * MIB);
    assert_eq!(c.get_allocation_size(c.round_size(10 * MIB - 1)), 10 * MIB);
    // 1 MiB + 1 → 1049088 → large pool → 20 MiB segment.
    assert_eq!(c.round_size(MIB + 1), 1_049_088);
    assert!(c.round_size(MIB + 1) > K_SMALL_SIZE);
    assert_eq!(c.get_allocation_size(c.round_size(MIB + 1)), 20 * MIB);
    // 1 MiB and 1 MiB - 1 stay in the small pool.
    assert!(c.round_size(MIB) <= K_SMALL_SIZE && c.round_size(MIB - 1) <= K_SMALL_SIZE);
    assert_eq!(c.get_allocation_size(c.round_size(MIB)), 2 * MIB);
    assert_eq!(c.round_size(1), 512);
    assert_eq!(c.round_size(0), 512);
    assert_eq!(roundup_power2_next_division(MIB + 1, 4), MIB + MIB / 4);
}

// --------------------------------------------------------------------------------------------
// probe1_2.11.json: rounding and pool choice on the default settings

#[test]
fn probe1_rounding_and_pools() {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let Some(path) = reference::shared(&repo, "reference/probe-cases/probe1_2.11.json") else { return };
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let probe: serde_json::Value = serde_json::from_str(&text).expect("probe1 JSON");
    let c = parse_ok("");
    let u = |v: &serde_json::Value| v.as_u64().unwrap_or_else(|| panic!("not an integer: {v}"));

    // The settings the probe ran under are the defaults.
    let s = &probe["allocator_settings"];
    assert_eq!(s["PYTORCH_CUDA_ALLOC_CONF"], "");
    assert_eq!(s["max_split_size"].as_i64(), Some(-1));
    assert_eq!(c.max_split_size, u64::MAX);
    assert_eq!(s["garbage_collection_threshold"].as_f64(), Some(c.garbage_collection_threshold));
    assert_eq!(s["expandable_segments"].as_bool(), Some(c.expandable_segments));
    assert_eq!(u(&s["pinned_num_register_threads"]), c.pinned_num_register_threads);
    assert_eq!(s["release_lock_on_cudamalloc"].as_bool(), Some(c.release_lock_on_cudamalloc));
    assert_eq!(s["pinned_use_cuda_host_register"].as_bool(), Some(c.pinned_use_cuda_host_register));
    assert_eq!(s["graph_capture_record_stream_reuse"].as_bool(), Some(c.graph_capture_record_stream_reuse));
    let rp = s["roundup_power2_divisions"].as_object().unwrap();
    assert_eq!(rp.len(), 16);
    for (i, d) in c.roundup_power2_divisions.iter().enumerate() {
        assert_eq!(u(&rp[&(1u64 << i).to_string()]), *d);
    }

    // Each logged request: allocated bytes grow by round_size(n); reserved bytes grow by
    // get_allocation_size(round_size(n)) when a segment was added, else not at all.
    let (mut allocated, mut reserved, mut segments) = (0, 0, 0);
    let log = probe["rounding"]["log"].as_array().unwrap();
    assert!(!log.is_empty());
    for e in log {
        let n = u(&e["n"]);
        let st = &e["stats"];
        let (a, r, sg) = (u(&st["allocated_bytes.all.current"]), u(&st["reserved_bytes.all.current"]), u(&st["segment.all.current"]));
        let rounded = c.round_size(n);
        assert_eq!(a - allocated, rounded, "allocated delta for request {n}");
        if sg > segments {
            assert_eq!(sg, segments + 1);
            assert_eq!(r - reserved, c.get_allocation_size(rounded), "segment size for request {n}");
        } else {
            assert_eq!(r, reserved, "request {n} reused a segment");
        }
        assert_eq!(u(&st["requested_bytes.all.current"]) - log_requested_before(log, n), n);
        (allocated, reserved, segments) = (a, r, sg);
    }

    // Final layout: every allocated block is round_size(requested) in the pool that size selects;
    // each segment is the allocation size of the request that created it (its first block).
    let segs = probe["rounding"]["segs"].as_array().unwrap();
    let mut checked = 0;
    for seg in segs {
        let blocks = seg["blocks"].as_array().unwrap();
        let total = u(&seg["total"]);
        let first = &blocks[0];
        assert_eq!(first[2], "active_allocated");
        assert_eq!(total, c.get_allocation_size(c.round_size(u(&first[1]))), "segment {seg}");
        assert_eq!(blocks.iter().map(|b| u(&b[0])).sum::<u64>(), total);
        for b in blocks.iter().filter(|b| b[2] == "active_allocated") {
            let (size, requested) = (u(&b[0]), u(&b[1]));
            assert_eq!(size, c.round_size(requested), "block {b}");
            let pool = if size <= K_SMALL_SIZE { "small" } else { "large" };
            assert_eq!(seg["pool"], pool, "pool of block {b}");
            checked += 1;
        }
    }
    assert_eq!(checked, log.len());
}

/// requested_bytes before the request `n` in the probe's log.
fn log_requested_before(log: &[serde_json::Value], n: u64) -> u64 {
    let mut prev = 0;
    for e in log {
        if e["n"].as_u64() == Some(n) {
            return prev;
        }
        prev = e["stats"]["requested_bytes.all.current"].as_u64().unwrap();
    }
    unreachable!()
}

// --------------------------------------------------------------------------------------------
// Runtime settings calls measured on torch 2.11.0+cu130

/// The settings read back after the calls (`allocator_settings` of the snapshot, plus the segment
/// size of a 2 MiB request, which is `large_segment_size`).
struct S {
    source: &'static str,
    max_split: u64,
    gc: f64,
    es: bool,
    threads: u64,
    release_lock: bool,
    host_register: bool,
    record_stream_reuse: bool,
    roundup: [u64; 16],
    large_segment: u64,
}

/// One fresh process: `_set_allocator_settings(s)` for each `s` of `seq`; `results[i]` is `None`
/// when call `i` returned, else the exception as Python printed it; `state` afterwards (`None`
/// where it could not be read).
struct R {
    seq: &'static [&'static str],
    results: &'static [Option<&'static str>],
    state: Option<S>,
}

#[test]
fn runtime_settings_calls_measured() {
    let mut failures = Vec::new();
    for case in RUNTIME_CASES {
        let mut c = runtime_cfg();
        for (s, want) in case.seq.iter().zip(case.results) {
            let got = c.apply(s);
            match (want, &got) {
                (None, Ok(())) => {}
                (Some(w), Err(e)) if strip_type(w) == e.0 => {}
                _ => failures.push(format!("apply({s:?}): want {want:?}, got {got:?}")),
            }
        }
        let Some(st) = &case.state else { continue };
        let got = (
            c.source.as_str(),
            c.max_split_size,
            c.garbage_collection_threshold,
            c.expandable_segments,
            c.pinned_num_register_threads,
            c.release_lock_on_cudamalloc,
            c.pinned_use_cuda_host_register,
            c.graph_capture_record_stream_reuse,
            c.roundup_power2_divisions,
            c.large_segment_size,
        );
        let want = (st.source, st.max_split, st.gc, st.es, st.threads, st.release_lock, st.host_register, st.record_stream_reuse, st.roundup, st.large_segment);
        if got != want {
            failures.push(format!("{:?}: state\n  want {want:?}\n  got  {got:?}", case.seq));
        }
        if !c.expandable_segments && c.get_allocation_size(c.round_size(2 * MIB)) != st.large_segment {
            failures.push(format!("{:?}: 2 MiB segment size", case.seq));
        }
    }
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
}

#[rustfmt::skip]
const RUNTIME_CASES: &[R] = &[
    R { seq: &[""], results: &[None], state: Some(S { source: "", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &[","], results: &[Some("ValueError: Unrecognized key ',' in Accelerator allocator config.")], state: Some(S { source: ",", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &[":"], results: &[Some("ValueError: Unrecognized key ':' in Accelerator allocator config.")], state: Some(S { source: ":", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["max_split_size_mb:100,"], results: &[None], state: Some(S { source: "max_split_size_mb:100,", max_split: 104857600, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["max_split_size_mb,100"], results: &[None], state: Some(S { source: "max_split_size_mb,100", max_split: 104857600, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["max_split_size_mb:100:expandable_segments:True"], results: &[None], state: Some(S { source: "max_split_size_mb:100:expandable_segments:True", max_split: 104857600, gc: 0.0, es: true, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["max_split_size_mb:100,,expandable_segments:True"], results: &[Some("ValueError: Unrecognized key ',' in Accelerator allocator config.")], state: Some(S { source: "max_split_size_mb:100,,expandable_segments:True", max_split: 104857600, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["max_split_size_mb"], results: &[Some("RuntimeError: i < config_.size() INTERNAL ASSERT FAILED at \"/pytorch/c10/core/AllocatorConfig.h\":124, please report a bug to PyTorch. Index out of bounds in ConfigTokenizer")], state: Some(S { source: "max_split_size_mb", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["max_split_size_mb:"], results: &[Some("RuntimeError: i < config_.size() INTERNAL ASSERT FAILED at \"/pytorch/c10/core/AllocatorConfig.h\":124, please report a bug to PyTorch. Index out of bounds in ConfigTokenizer")], state: Some(S { source: "max_split_size_mb:", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["max_split_size_mb:abc"], results: &[Some("ValueError: stoull")], state: Some(S { source: "max_split_size_mb:abc", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["max_split_size_mb:100abc"], results: &[None], state: Some(S { source: "max_split_size_mb:100abc", max_split: 104857600, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["max_split_size_mb:+100"], results: &[None], state: Some(S { source: "max_split_size_mb:+100", max_split: 104857600, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["max_split_size_mb:-1"], results: &[None], state: Some(S { source: "max_split_size_mb:-1", max_split: 18446744073708503040, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["max_split_size_mb:1e3"], results: &[Some("ValueError: CachingAllocator option max_split_size_mb too small, must be >= 20")], state: Some(S { source: "max_split_size_mb:1e3", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["max_split_size_mb:0x40"], results: &[Some("ValueError: CachingAllocator option max_split_size_mb too small, must be >= 20")], state: Some(S { source: "max_split_size_mb:0x40", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["max_split_size_mb:99999999999999999999"], results: &[Some("IndexError: stoull")], state: Some(S { source: "max_split_size_mb:99999999999999999999", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["max_split_size_mb:18446744073709551615"], results: &[None], state: Some(S { source: "max_split_size_mb:18446744073709551615", max_split: 18446744073708503040, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["max_split_size_mb:17592186044415"], results: &[None], state: Some(S { source: "max_split_size_mb:17592186044415", max_split: 18446744073708503040, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["max_split_size_mb:17592186044416"], results: &[None], state: Some(S { source: "max_split_size_mb:17592186044416", max_split: 18446744073708503040, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["max_split_size_mb:[1,2]"], results: &[Some("ValueError: stoull")], state: Some(S { source: "max_split_size_mb:[1,2]", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["max_non_split_rounding_mb:19"], results: &[Some("ValueError: CachingAllocator option max_non_split_rounding_mb too small, must be >= 20")], state: Some(S { source: "max_non_split_rounding_mb:19", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["max_non_split_rounding_mb:abc"], results: &[Some("ValueError: stoull")], state: Some(S { source: "max_non_split_rounding_mb:abc", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["garbage_collection_threshold:abc"], results: &[Some("ValueError: stod")], state: Some(S { source: "garbage_collection_threshold:abc", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["garbage_collection_threshold:1"], results: &[Some("ValueError: garbage_collect_threshold is invalid, set it in (0.0, 1.0)")], state: Some(S { source: "garbage_collection_threshold:1", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["garbage_collection_threshold:0"], results: &[Some("ValueError: garbage_collect_threshold is invalid, set it in (0.0, 1.0)")], state: Some(S { source: "garbage_collection_threshold:0", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["garbage_collection_threshold:0.5x"], results: &[None], state: Some(S { source: "garbage_collection_threshold:0.5x", max_split: 18446744073709551615, gc: 0.5, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["garbage_collection_threshold:nan"], results: &[Some("ValueError: garbage_collect_threshold is invalid, set it in (0.0, 1.0)")], state: Some(S { source: "garbage_collection_threshold:nan", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["garbage_collection_threshold:1e-400"], results: &[Some("IndexError: stod")], state: Some(S { source: "garbage_collection_threshold:1e-400", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["garbage_collection_threshold:.5"], results: &[None], state: Some(S { source: "garbage_collection_threshold:.5", max_split: 18446744073709551615, gc: 0.5, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["garbage_collection_threshold:inf"], results: &[Some("ValueError: garbage_collect_threshold is invalid, set it in (0.0, 1.0)")], state: Some(S { source: "garbage_collection_threshold:inf", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["garbage_collection_threshold:0x0.8p0"], results: &[None], state: Some(S { source: "garbage_collection_threshold:0x0.8p0", max_split: 18446744073709551615, gc: 0.5, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["garbage_collection_threshold:1e400"], results: &[Some("IndexError: stod")], state: Some(S { source: "garbage_collection_threshold:1e400", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["garbage_collection_threshold:"], results: &[Some("RuntimeError: i < config_.size() INTERNAL ASSERT FAILED at \"/pytorch/c10/core/AllocatorConfig.h\":124, please report a bug to PyTorch. Index out of bounds in ConfigTokenizer")], state: Some(S { source: "garbage_collection_threshold:", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["roundup_power2_divisions:0"], results: &[Some("ValueError: For roundups, the divisions has to be power of 2 ")], state: Some(S { source: "roundup_power2_divisions:0", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["roundup_power2_divisions:3"], results: &[Some("ValueError: For roundups, the divisions has to be power of 2 ")], state: Some(S { source: "roundup_power2_divisions:3", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["roundup_power2_divisions:8"], results: &[None], state: Some(S { source: "roundup_power2_divisions:8", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8], large_segment: 20971520 }) },
    R { seq: &["roundup_power2_divisions:[]"], results: &[None], state: Some(S { source: "roundup_power2_divisions:[]", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["roundup_power2_divisions:[3:4]"], results: &[Some("ValueError: For roundups, the intervals have to be power of 2 ")], state: Some(S { source: "roundup_power2_divisions:[3:4]", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["roundup_power2_divisions:[256:3]"], results: &[Some("ValueError: For roundups, the divisions has to be power of 2 or 0 to disable roundup ")], state: Some(S { source: "roundup_power2_divisions:[256:3]", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["roundup_power2_divisions:[>:4]"], results: &[None], state: Some(S { source: "roundup_power2_divisions:[>:4]", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4], large_segment: 20971520 }) },
    R { seq: &["roundup_power2_divisions:[256:4"], results: &[Some("RuntimeError: i < config_.size() INTERNAL ASSERT FAILED at \"/pytorch/c10/core/AllocatorConfig.h\":55, please report a bug to PyTorch. Index out of bounds in ConfigTokenizer")], state: Some(S { source: "roundup_power2_divisions:[256:4", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [4, 4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["roundup_power2_divisions:[abc:4]"], results: &[Some("ValueError: stoull")], state: Some(S { source: "roundup_power2_divisions:[abc:4]", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["roundup_power2_divisions:[256:abc]"], results: &[Some("ValueError: stoull")], state: Some(S { source: "roundup_power2_divisions:[256:abc]", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["roundup_power2_divisions:[0:4]"], results: &[Some("ValueError: For roundups, the intervals have to be power of 2 ")], state: Some(S { source: "roundup_power2_divisions:[0:4]", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["roundup_power2_divisions:[1:2,2:4]"], results: &[None], state: Some(S { source: "roundup_power2_divisions:[1:2,2:4]", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [2, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["roundup_power2_divisions:[1048576:4]"], results: &[None], state: Some(S { source: "roundup_power2_divisions:[1048576:4]", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4], large_segment: 20971520 }) },
    R { seq: &["roundup_power2_divisions:[256:4,>:2,512:8]"], results: &[None], state: Some(S { source: "roundup_power2_divisions:[256:4,>:2,512:8]", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [4, 4, 4, 4, 4, 4, 4, 4, 4, 8, 2, 2, 2, 2, 2, 2], large_segment: 20971520 }) },
    R { seq: &["roundup_power2_divisions:[64:8,256:4,1024:4,>:1]"], results: &[None], state: Some(S { source: "roundup_power2_divisions:[64:8,256:4,1024:4,>:1]", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [8, 8, 8, 8, 8, 8, 8, 0, 4, 0, 4, 1, 1, 1, 1, 1], large_segment: 20971520 }) },
    R { seq: &["roundup_power2_divisions:[256:4,512:8"], results: &[Some("RuntimeError: i < config_.size() INTERNAL ASSERT FAILED at \"/pytorch/c10/core/AllocatorConfig.h\":55, please report a bug to PyTorch. Index out of bounds in ConfigTokenizer")], state: Some(S { source: "roundup_power2_divisions:[256:4,512:8", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [4, 4, 4, 4, 4, 4, 4, 4, 4, 8, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["roundup_power2_divisions:[256:4 512:8]"], results: &[Some("ValueError: For roundups, the divisions has to be power of 2 or 0 to disable roundup ")], state: Some(S { source: "roundup_power2_divisions:[256:4 512:8]", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["roundup_power2_divisions:[256,4]"], results: &[None], state: Some(S { source: "roundup_power2_divisions:[256,4]", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [4, 4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["roundup_power2_divisions"], results: &[Some("RuntimeError: i < config_.size() INTERNAL ASSERT FAILED at \"/pytorch/c10/core/AllocatorConfig.h\":124, please report a bug to PyTorch. Index out of bounds in ConfigTokenizer")], state: Some(S { source: "roundup_power2_divisions", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["roundup_power2_divisions:"], results: &[Some("RuntimeError: i < config_.size() INTERNAL ASSERT FAILED at \"/pytorch/c10/core/AllocatorConfig.h\":55, please report a bug to PyTorch. Index out of bounds in ConfigTokenizer")], state: Some(S { source: "roundup_power2_divisions:", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["expandable_segments:true"], results: &[Some("ValueError: Expected 'True' or 'False' at index 2 in ConfigTokenizer but got 'true'")], state: Some(S { source: "expandable_segments:true", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["expandable_segments:"], results: &[Some("RuntimeError: i < config_.size() INTERNAL ASSERT FAILED at \"/pytorch/c10/core/AllocatorConfig.h\":124, please report a bug to PyTorch. Index out of bounds in ConfigTokenizer")], state: Some(S { source: "expandable_segments:", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["expandable_segments"], results: &[Some("RuntimeError: i < config_.size() INTERNAL ASSERT FAILED at \"/pytorch/c10/core/AllocatorConfig.h\":124, please report a bug to PyTorch. Index out of bounds in ConfigTokenizer")], state: Some(S { source: "expandable_segments", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["release_lock_on_cudamalloc:yes"], results: &[Some("ValueError: Expected 'True' or 'False' at index 2 in ConfigTokenizer but got 'yes'")], state: Some(S { source: "release_lock_on_cudamalloc:yes", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["pinned_use_background_threads:1"], results: &[Some("ValueError: Expected 'True' or 'False' at index 2 in ConfigTokenizer but got '1'")], state: Some(S { source: "pinned_use_background_threads:1", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["graph_capture_record_stream_reuse:TRUE"], results: &[Some("ValueError: Expected 'True' or 'False' at index 2 in ConfigTokenizer but got 'TRUE'")], state: Some(S { source: "graph_capture_record_stream_reuse:TRUE", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["pinned_use_cuda_host_register:x"], results: &[Some("ValueError: Expected 'True' or 'False' at index 2 in ConfigTokenizer but got 'x'")], state: Some(S { source: "pinned_use_cuda_host_register:x", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["pinned_num_register_threads:3"], results: &[Some("ValueError: Number of register threads has to be power of 2, got 3")], state: Some(S { source: "pinned_num_register_threads:3", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["pinned_num_register_threads:256"], results: &[Some("ValueError: Number of register threads should be less than or equal to 128, got 256")], state: Some(S { source: "pinned_num_register_threads:256", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["pinned_num_register_threads:0"], results: &[Some("ValueError: Number of register threads has to be power of 2, got 0")], state: Some(S { source: "pinned_num_register_threads:0", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["pinned_num_register_threads:128,release_lock_on_cudamalloc:True,pinned_use_cuda_host_register:True,graph_capture_record_stream_reuse:True"], results: &[None], state: Some(S { source: "pinned_num_register_threads:128,release_lock_on_cudamalloc:True,pinned_use_cuda_host_register:True,graph_capture_record_stream_reuse:True", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 128, release_lock: true, host_register: true, record_stream_reuse: true, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["pinned_reserve_segment_size_mb:0"], results: &[Some("ValueError: Pinned reserve segment size has to be greater than 0")], state: Some(S { source: "pinned_reserve_segment_size_mb:0", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["pinned_reserve_segment_size_mb:abc"], results: &[Some("ValueError: stoull")], state: Some(S { source: "pinned_reserve_segment_size_mb:abc", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["per_process_memory_fraction:1.5"], results: &[Some("ValueError: per_process_memory_fraction is invalid, set it in [0.0, 1.0]")], state: Some(S { source: "per_process_memory_fraction:1.5", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["per_process_memory_fraction:-0.1"], results: &[Some("ValueError: per_process_memory_fraction is invalid, set it in [0.0, 1.0]")], state: Some(S { source: "per_process_memory_fraction:-0.1", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["per_process_memory_fraction:abc"], results: &[Some("ValueError: stod")], state: Some(S { source: "per_process_memory_fraction:abc", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["per_process_memory_fraction:0"], results: &[None], state: None },
    R { seq: &["backend:foo"], results: &[Some("ValueError: Unknown allocator backend, options are native and cudaMallocAsync")], state: Some(S { source: "backend:foo", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["backend:native"], results: &[None], state: Some(S { source: "backend:native", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["backend:cudaMallocAsync"], results: &[Some("RuntimeError: tokenizer[i] == get()->name() INTERNAL ASSERT FAILED at \"/pytorch/c10/cuda/CUDAAllocatorConfig.cpp\":44, please report a bug to PyTorch. Allocator backend parsed at runtime != allocator backend parsed at load time, cudaMallocAsync != native")], state: Some(S { source: "backend:cudaMallocAsync", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["backend:"], results: &[Some("RuntimeError: i < config_.size() INTERNAL ASSERT FAILED at \"/pytorch/c10/core/AllocatorConfig.h\":124, please report a bug to PyTorch. Index out of bounds in ConfigTokenizer")], state: Some(S { source: "backend:", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["foo_bar"], results: &[Some("ValueError: Unrecognized key 'foo_bar' in Accelerator allocator config.")], state: Some(S { source: "foo_bar", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["foo_bar:[1,2"], results: &[Some("ValueError: Unrecognized key 'foo_bar' in Accelerator allocator config.")], state: Some(S { source: "foo_bar:[1,2", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["foo_bar:[1,2]"], results: &[Some("ValueError: Unrecognized key 'foo_bar' in Accelerator allocator config.")], state: Some(S { source: "foo_bar:[1,2]", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["foo_bar:1,max_split_size_mb:19"], results: &[Some("ValueError: Unrecognized key 'foo_bar' in Accelerator allocator config.")], state: Some(S { source: "foo_bar:1,max_split_size_mb:19", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["max_split_size_mb:19,foo_bar:1"], results: &[Some("ValueError: CachingAllocator option max_split_size_mb too small, must be >= 20")], state: Some(S { source: "max_split_size_mb:19,foo_bar:1", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["pinned_num_register_threads:3,max_split_size_mb:19"], results: &[Some("ValueError: CachingAllocator option max_split_size_mb too small, must be >= 20")], state: Some(S { source: "pinned_num_register_threads:3,max_split_size_mb:19", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["expandable_segments:true,pinned_num_register_threads:3"], results: &[Some("ValueError: Expected 'True' or 'False' at index 2 in ConfigTokenizer but got 'true'")], state: Some(S { source: "expandable_segments:true,pinned_num_register_threads:3", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["max_split_size_mb:19,large_segment_size_mb:10"], results: &[Some("ValueError: CachingAllocator option large_segment_size_mb must be > 10 MB")], state: Some(S { source: "max_split_size_mb:19,large_segment_size_mb:10", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["large_segment_size_mb:abc"], results: &[Some("ValueError: stoull")], state: Some(S { source: "large_segment_size_mb:abc", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["large_segment_size_mb:11"], results: &[None], state: Some(S { source: "large_segment_size_mb:11", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 11534336 }) },
    R { seq: &["max_split_size_mb:30,large_segment_size_mb:40"], results: &[Some("ValueError: CachingAllocator option max_split_size_mb too small, must be >= 40")], state: Some(S { source: "max_split_size_mb:30,large_segment_size_mb:40", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 41943040 }) },
    R { seq: &["large_segment_size_mb:40,max_non_split_rounding_mb:30"], results: &[Some("ValueError: CachingAllocator option max_non_split_rounding_mb too small, must be >= 40")], state: Some(S { source: "large_segment_size_mb:40,max_non_split_rounding_mb:30", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 41943040 }) },
    R { seq: &["large_segment_size_mb"], results: &[Some("RuntimeError: i < config_.size() INTERNAL ASSERT FAILED at \"/pytorch/c10/core/AllocatorConfig.h\":124, please report a bug to PyTorch. Index out of bounds in ConfigTokenizer")], state: Some(S { source: "large_segment_size_mb", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["foo:large_segment_size_mb"], results: &[Some("RuntimeError: i < config_.size() INTERNAL ASSERT FAILED at \"/pytorch/c10/core/AllocatorConfig.h\":124, please report a bug to PyTorch. Index out of bounds in ConfigTokenizer")], state: Some(S { source: "foo:large_segment_size_mb", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["max_split_size_mb:100,expandable_segments:true"], results: &[Some("ValueError: Expected 'True' or 'False' at index 6 in ConfigTokenizer but got 'true'")], state: Some(S { source: "max_split_size_mb:100,expandable_segments:true", max_split: 104857600, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["expandable_segments:True", "max_split_size_mb:19"], results: &[None, Some("ValueError: CachingAllocator option max_split_size_mb too small, must be >= 20")], state: Some(S { source: "max_split_size_mb:19", max_split: 18446744073709551615, gc: 0.0, es: true, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["max_split_size_mb:100,roundup_power2_divisions:4,garbage_collection_threshold:0.5", "release_lock_on_cudamalloc:True"], results: &[None, None], state: Some(S { source: "release_lock_on_cudamalloc:True", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: true, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["large_segment_size_mb:64", "expandable_segments:False"], results: &[None, None], state: Some(S { source: "expandable_segments:False", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 67108864 }) },
    R { seq: &["expandable_segments:True", "garbage_collection_threshold:0.5,pinned_num_register_threads:3"], results: &[None, Some("ValueError: Number of register threads has to be power of 2, got 3")], state: Some(S { source: "garbage_collection_threshold:0.5,pinned_num_register_threads:3", max_split: 18446744073709551615, gc: 0.5, es: true, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["Max_split_size_mb:100"], results: &[Some("ValueError: Unrecognized key 'Max_split_size_mb' in Accelerator allocator config.")], state: Some(S { source: "Max_split_size_mb:100", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["max_split_size_mb:\u{a0}100"], results: &[Some("ValueError: stoull")], state: Some(S { source: "max_split_size_mb:\u{a0}100", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["release_lock_on_hipmalloc:True"], results: &[None], state: Some(S { source: "release_lock_on_hipmalloc:True", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: true, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["pinned_use_hip_host_register:True"], results: &[None], state: Some(S { source: "pinned_use_hip_host_register:True", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: true, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["roundup_power2_divisions:[256:4,"], results: &[Some("RuntimeError: i < tokenizer.size() INTERNAL ASSERT FAILED at \"/pytorch/c10/core/AllocatorConfig.cpp\":185, please report a bug to PyTorch. Expected closing bracket ']' in ConfigTokenizer but reached end of config")], state: Some(S { source: "roundup_power2_divisions:[256:4,", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [4, 4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["roundup_power2_divisions:["], results: &[Some("RuntimeError: i < tokenizer.size() INTERNAL ASSERT FAILED at \"/pytorch/c10/core/AllocatorConfig.cpp\":185, please report a bug to PyTorch. Expected closing bracket ']' in ConfigTokenizer but reached end of config")], state: Some(S { source: "roundup_power2_divisions:[", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["backend:[native"], results: &[Some("RuntimeError: i < config_.size() INTERNAL ASSERT FAILED at \"/pytorch/c10/core/AllocatorConfig.h\":115, please report a bug to PyTorch. Expected closing bracket ']' in ConfigTokenizer but reached end of config")], state: Some(S { source: "backend:[native", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["release_lock_on_cudamalloc:[True"], results: &[Some("RuntimeError: i < config_.size() INTERNAL ASSERT FAILED at \"/pytorch/c10/core/AllocatorConfig.h\":115, please report a bug to PyTorch. Expected closing bracket ']' in ConfigTokenizer but reached end of config")], state: Some(S { source: "release_lock_on_cudamalloc:[True", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["foo:[a,b],max_split_size_mb:100"], results: &[Some("ValueError: Unrecognized key 'foo' in Accelerator allocator config.")], state: Some(S { source: "foo:[a,b],max_split_size_mb:100", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["large_segment_size_mb:[1]"], results: &[Some("ValueError: stoull")], state: Some(S { source: "large_segment_size_mb:[1]", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["expandable_segments:[True]"], results: &[Some("ValueError: Expected 'True' or 'False' at index 2 in ConfigTokenizer but got '['")], state: Some(S { source: "expandable_segments:[True]", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["max_split_size_mb:100,"], results: &[None], state: Some(S { source: "max_split_size_mb:100,", max_split: 104857600, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
    R { seq: &["large_segment_size_mb:64,max_split_size_mb:100", "max_split_size_mb:30"], results: &[None, Some("ValueError: CachingAllocator option max_split_size_mb too small, must be >= 64")], state: Some(S { source: "max_split_size_mb:30", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 67108864 }) },
    R { seq: &["max_non_split_rounding_mb:[1]"], results: &[Some("ValueError: stoull")], state: Some(S { source: "max_non_split_rounding_mb:[1]", max_split: 18446744073709551615, gc: 0.0, es: false, threads: 1, release_lock: false, host_register: false, record_stream_reuse: false, roundup: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], large_segment: 20971520 }) },
];

#[path = "../../../tests/support/reference.rs"]
mod reference;
