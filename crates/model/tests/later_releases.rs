//! Rules of releases after 2.11 that the model follows behind their settings keys, on cases
//! constructed by hand from the rules (they were read in the 2.12 and 2.15 wheels and pull
//! requests, not measured: see docs/versions.md). Each case's expected values are worked from
//! the rule, and the same case without the key gives 2.11's measured behaviour.

use allocsim_model::constants::MIB;
use allocsim_model::{AllocatorConfig, CachingAllocator, EventKind, LaterKeys, Placement, Route, SimDevice};

const GIB: u64 = 1 << 30;
const ALL_LATER: LaterKeys = LaterKeys { v2_12: true, v2_13: true, v2_15: true };

fn allocator(conf: &str, total: u64) -> CachingAllocator<SimDevice> {
    let config = AllocatorConfig::parse_with(conf, ALL_LATER).expect("valid settings");
    CachingAllocator::new(config, SimDevice::new(total, Placement::Ascending))
}

/// A 60 MiB segment cached, then a 70 MiB request under a 100 MiB maximum: 2.11 releases the
/// cached segment and retries; with `throw_on_cudamalloc_oom` (2.12) the request is refused at
/// the first `alloc_block`, the cached segment stays, and no retry is counted.
#[test]
fn throw_on_cudamalloc_oom_refuses_before_the_retry_chain() {
    for (conf, refused) in [("", false), ("throw_on_cudamalloc_oom:True", true)] {
        let mut a = allocator(conf, 80 * GIB);
        a.set_allowed_memory_maximum(Some(100 * MIB));
        let b = a.malloc(60 * MIB, 0, Route::Default).unwrap();
        assert!(a.free(b, false).is_none());
        a.events.clear();
        let r = a.malloc(70 * MIB, 0, Route::Default);
        let kinds: Vec<EventKind> = a.events.iter().map(|e| e.kind).collect();
        if refused {
            let oom = r.expect_err("refused");
            assert!(oom.preemptive);
            assert_eq!(oom.alloc_size, 70 * MIB);
            assert!(kinds.is_empty(), "{kinds:?}");
            assert_eq!((a.stats.num_oom_rejections, a.stats.num_ooms, a.stats.num_alloc_retries), (1, 0, 0));
            assert_eq!(a.stats.reserved_bytes.all().current, 60 * MIB as i64);
            let text = allocsim_model::format::oom_message(&oom, 0, "");
            assert!(text.starts_with("CUDA out of memory. Allocation was preemptively rejected"), "{text}");
            assert_eq!(a.stats.to_memory_stats()["num_oom_rejections"], 1);
        } else {
            assert!(r.is_ok());
            assert_eq!(kinds, [EventKind::SegmentFree, EventKind::SegmentAlloc]);
            assert_eq!((a.stats.num_oom_rejections, a.stats.num_ooms, a.stats.num_alloc_retries), (0, 0, 1));
            assert!(!a.stats.to_memory_stats().contains_key("num_oom_rejections"));
        }
    }
}

/// Without an allowed maximum `throw_on_cudamalloc_oom` changes nothing (its check compares with
/// the maximum).
#[test]
fn throw_on_cudamalloc_oom_needs_a_maximum() {
    let mut a = allocator("throw_on_cudamalloc_oom:True", 80 * GIB);
    assert!(a.malloc(70 * MIB, 0, Route::Default).is_ok());
    assert_eq!(a.stats.num_oom_rejections, 0);
}

/// `expandable_segments_reserve:0.25` on a 1 GiB device: each segment reserves 256 MiB of
/// addresses, 13 pages of 20 MiB (`numSegments` rounds up), instead of 1.125 GiB. After 200 MiB
/// (10 pages) the first segment has 3 pages left, so a 100 MiB request opens a second segment;
/// under the default reserve it grows the first.
#[test]
fn expandable_segments_reserve_bounds_each_segment() {
    let total = GIB;
    for (conf, second_segment) in [("expandable_segments:True", false), ("expandable_segments:True,expandable_segments_reserve:0.25", true)] {
        let mut a = allocator(conf, total);
        assert_eq!(a.config.expandable_reservation_pages(total, 20 * MIB), if second_segment { 13 } else { 58 });
        let x = a.malloc(200 * MIB, 0, Route::Default).unwrap();
        let y = a.malloc(100 * MIB, 0, Route::Default).unwrap();
        let (px, py) = (a.block(x).ptr, a.block(y).ptr);
        if second_segment {
            assert_eq!(py, px + 13 * 20 * MIB, "the next reservation, right after the first");
        } else {
            assert_eq!(py, px + 200 * MIB, "the first segment grown");
        }
    }
}

/// `expandable_segments_reserve` values: a fraction, or GiB with `G`; a malformed or non-positive
/// one is ignored (the default kept), as `parseReserveSpec` does. The 2.11 parser refuses the key.
#[test]
fn reserve_values() {
    let r = |conf: &str| AllocatorConfig::parse_with(conf, ALL_LATER).unwrap().expandable_segments_reserve;
    assert_eq!(r("expandable_segments_reserve:0.5").map(|s| s.resolve_bytes(GIB)), Some(GIB / 2));
    assert_eq!(r("expandable_segments_reserve:40G").map(|s| s.resolve_bytes(GIB)), Some(40 * GIB));
    assert_eq!(r("expandable_segments_reserve:-1"), None);
    assert_eq!(r("expandable_segments_reserve:abc"), None);
    assert_eq!(r("expandable_segments_reserve:0"), None);
    let by_class = AllocatorConfig::parse_with("expandable_segments_reserve_by_class:[nccl:0.1,comm:2G]", ALL_LATER).unwrap();
    assert_eq!(by_class.expandable_segments_reserve_by_class.len(), 2);
    assert_eq!(
        AllocatorConfig::parse("expandable_segments_reserve:0.5").unwrap_err().0,
        "Unrecognized key 'expandable_segments_reserve' in CUDA allocator config."
    );
    assert!(AllocatorConfig::parse_with("throw_on_cudamalloc_oom:true", ALL_LATER).unwrap_err().0.contains("Expected 'True' or 'False'"));
    let c = AllocatorConfig::parse_with("pinned_max_round_threshold_mb:64,pinned_free_catch_all:True", ALL_LATER).unwrap();
    assert_eq!((c.pinned_max_round_threshold_mb, c.pinned_free_catch_all), (Some(64), true));
}
