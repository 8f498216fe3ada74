//! What device calls cost, for a time estimate of a replay's cudaMalloc/cudaFree/map/unmap calls.
//!
//! Figures measured on an H200 (driver 580.159.04, CUDA 13.0) with cudarc 0.19, recorded in
//! `../shared/reference/ecosystem.md` §3: `cuMemAlloc`/`cuMemFree` ≈ 46–56 µs per call (32 MiB),
//! `cuMemCreate`+`cuMemMap`+`cuMemSetAccess` ≈ 40 µs per 20 MiB page, `cuMemUnmap`+`cuMemRelease`
//! ≈ 34 µs per page. A full-device synchronize costs whatever work is queued; it is counted, not
//! priced.

use allocsim_replay::replay::SegmentEvent;

pub const CUDA_MALLOC_US: f64 = 51.0;
pub const CUDA_FREE_US: f64 = 51.0;
pub const MAP_PER_PAGE_US: f64 = 40.0;
pub const UNMAP_PER_PAGE_US: f64 = 34.0;

/// Estimated microseconds spent in device calls for these segment events. `large_page` is the
/// large pool's expandable page (`large_segment_size`).
pub fn device_call_us(events: &[SegmentEvent], large_page: u64) -> f64 {
    events
        .iter()
        .map(|e| {
            let page = if e.small { 2 << 20 } else { large_page };
            let pages = e.size.div_ceil(page) as f64;
            match e.action {
                allocsim_trace::Action::SegmentAlloc => CUDA_MALLOC_US,
                allocsim_trace::Action::SegmentFree => CUDA_FREE_US,
                allocsim_trace::Action::SegmentMap => MAP_PER_PAGE_US * pages,
                allocsim_trace::Action::SegmentUnmap => UNMAP_PER_PAGE_US * pages,
                _ => 0.0,
            }
        })
        .sum()
}
