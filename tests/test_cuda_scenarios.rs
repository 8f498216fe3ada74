//! Scenarios of PyTorch's own allocator tests (`test/test_cuda.py`, `TestMemPool`) as the 2.11
//! allocator records them, **constructed** here from its rules (no GPU recording of them is in
//! this repository; `tools/record_test_cuda.py` records the real ones): each snapshot is what
//! `_dump_snapshot` writes after the test's steps, worked out by hand from `malloc`,
//! `should_split`, the expandable-segment rules and the MemPool destructor (see each test), on an
//! H200 (reservations of 1.125 × 150109880320 bytes, 32 MiB-aligned, one after the other).
//! `validate` must reproduce each one exactly.

mod common;
use common::*;

const MIB: u64 = 1 << 20;
const H200: u64 = 150_109_880_320;

/// The base of the reservation after one at `base` (large pool, 20 MiB pages), as the driver
/// places them on an H200 (`crate::budget`'s `RESERVATION_ALIGN`).
fn next_reservation(base: u64) -> u64 {
    let r = (H200 + H200 / 8).div_ceil(20 * MIB) * 20 * MIB;
    (base + r).div_ceil(32 * MIB) * 32 * MIB
}

fn settings(expandable: bool) -> String {
    let conf = if expandable { "expandable_segments:True" } else { "" };
    format!(
        r#""PYTORCH_CUDA_ALLOC_CONF": "{conf}", "max_split_size": -1, "garbage_collection_threshold": 0.0, "expandable_segments": {expandable}, "pinned_num_register_threads": 1, "release_lock_on_cudamalloc": false, "pinned_use_cuda_host_register": false, "graph_capture_record_stream_reuse": false, "roundup_power2_divisions": {{"1": 0, "2": 0, "4": 0, "8": 0, "16": 0, "32": 0, "64": 0, "128": 0, "256": 0, "512": 0, "1024": 0, "2048": 0, "4096": 0, "8192": 0, "16384": 0, "32768": 0}}"#
    )
}

fn entry(action: &str, addr: u64, size: u64) -> String {
    format!(r#"{{"action": "{action}", "addr": {addr}, "size": {size}, "stream": 0, "time_us": 0}}"#)
}

/// A final segment: `(address, pool, expandable, small, blocks as (size, requested, allocated))`.
fn segment(addr: u64, pool: (u64, u64), expandable: bool, small: bool, blocks: &[(u64, u64, bool)]) -> String {
    let total: u64 = blocks.iter().map(|b| b.0).sum();
    let allocated: u64 = blocks.iter().filter(|b| b.2).map(|b| b.0).sum();
    let mut at = addr;
    let bl: Vec<String> = blocks
        .iter()
        .map(|&(size, req, alloc)| {
            let s = format!(
                r#"{{"address": {at}, "size": {size}, "requested_size": {req}, "state": "{}", "frames": []}}"#,
                if alloc { "active_allocated" } else { "inactive" }
            );
            at += size;
            s
        })
        .collect();
    format!(
        r#"{{"device": 0, "address": {addr}, "total_size": {total}, "allocated_size": {allocated}, "active_size": {allocated}, "requested_size": 0, "stream": 0, "segment_type": "{}", "segment_pool_id": [{}, {}], "is_expandable": {expandable}, "frames": [], "blocks": [{}]}}"#,
        if small { "small" } else { "large" },
        pool.0,
        pool.1,
        bl.join(", ")
    )
}

fn snapshot(segments: &[String], trace: &[String], expandable: bool) -> String {
    format!(r#"{{"segments": [{}], "device_traces": [[{}]], "allocator_settings": {{{}}}}}"#, segments.join(", "), trace.join(", "), settings(expandable))
}

fn assert_exact(name: &str, text: String) {
    let f = TempFile::new(name);
    std::fs::write(&f.0, text).unwrap();
    let out = success(&["validate", f.arg()]);
    assert!(out.contains("\n  exact\n"), "{name}:\n{out}");
}

/// `test_mempool_no_split`: 4 MiB in a MemPool, 4 MiB in a `MemPool(no_split=True)`, and again.
/// Default settings: each first request gets a 20 MiB segment (`kLargeBuffer` for 1–10 MiB); the
/// split pool cuts 4 MiB off and serves the second request from the rest; the no_split pool
/// keeps the whole 20 MiB block for its request (`should_split` is false) and needs a second
/// segment. The pools are alive when the snapshot is taken, so the final segments name them.
#[test]
fn mempool_no_split_default() {
    let (a, b, c) = (0x7f00_0000_0000u64, 0x7f00_0200_0000u64, 0x7f00_0400_0000u64);
    let trace = [
        entry("segment_alloc", a, 20 * MIB),
        entry("alloc", a, 4 * MIB),
        entry("segment_alloc", b, 20 * MIB),
        entry("alloc", b, 4 * MIB),
        entry("alloc", a + 4 * MIB, 4 * MIB),
        entry("segment_alloc", c, 20 * MIB),
        entry("alloc", c, 4 * MIB),
    ];
    let segments = [
        segment(a, (0, 1), false, false, &[(4 * MIB, 4 * MIB, true), (4 * MIB, 4 * MIB, true), (12 * MIB, 0, false)]),
        segment(b, (0, 2), false, false, &[(20 * MIB, 4 * MIB, true)]),
        segment(c, (0, 2), false, false, &[(20 * MIB, 4 * MIB, true)]),
    ];
    assert_exact("no_split_default.json", snapshot(&segments, &trace, false));
}

/// `test_mempool_no_split` under expandable segments: each pool maps 20 MiB pages in its own
/// reservation; the no_split pool gives its first request the whole mapped page and maps the
/// next page for the second (one expandable segment of two 20 MiB blocks at the end).
#[test]
fn mempool_no_split_expandable() {
    let r1 = 0x7f00_0000_0000u64;
    let r2 = next_reservation(r1);
    let trace = [
        entry("segment_map", r1, 20 * MIB),
        entry("alloc", r1, 4 * MIB),
        entry("segment_map", r2, 20 * MIB),
        entry("alloc", r2, 4 * MIB),
        entry("alloc", r1 + 4 * MIB, 4 * MIB),
        entry("segment_map", r2 + 20 * MIB, 20 * MIB),
        entry("alloc", r2 + 20 * MIB, 4 * MIB),
    ];
    let segments = [
        segment(r1, (0, 1), true, false, &[(4 * MIB, 4 * MIB, true), (4 * MIB, 4 * MIB, true), (12 * MIB, 0, false)]),
        segment(r2, (0, 2), true, false, &[(20 * MIB, 4 * MIB, true), (20 * MIB, 4 * MIB, true)]),
    ];
    assert_exact("no_split_expandable.json", snapshot(&segments, &trace, true));
}

/// `test_tensor_delete_after_allocator_delete` under expandable segments: a 16-byte tensor in a
/// `MemPool(allocator)` (a pluggable allocator calling cudaMalloc) gets a 2 MiB small segment
/// from that allocator, not an expandable one (`is_expandable_segments_active` is false for a
/// pool with its own allocator); the pool and the allocator are dropped while the tensor lives,
/// then the tensor, then `empty_cache()` frees the segment of the freeable pool. Nothing of the
/// pool is left at the end: its kind shows only in the trace (a `segment_alloc` under expandable
/// segments).
#[test]
fn tensor_delete_after_allocator_delete_expandable() {
    let x = 0x7f10_0000_0000u64;
    let trace = [
        entry("segment_alloc", x, 2 * MIB),
        entry("alloc", x, 16),
        entry("free_requested", x, 16),
        entry("free_completed", x, 16),
        entry("segment_free", x, 2 * MIB),
    ];
    assert_exact("allocator_delete_expandable.json", snapshot(&[], &trace, true));
}
