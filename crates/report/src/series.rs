//! Time series of one replay on the request axis: allocated, active, reserved, and fragmentation
//! samples, downsampled for plotting (each point keeps the maximum of its bucket, so peaks stay).

use allocsim_model::{AllocatorConfig, Placement, SimDevice};
use allocsim_replay::{Op, Prepared, ReplayOutcome, replay_observed};

use crate::frag::breakdown;

#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Series {
    /// Request ordinal of each point.
    pub request: Vec<u32>,
    pub allocated: Vec<u64>,
    pub active: Vec<u64>,
    pub reserved: Vec<u64>,
}

/// Fragmentation sampled at evenly spaced requests.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct FragSeries {
    pub request: Vec<u32>,
    /// reserved − allocated.
    pub unallocated: Vec<u64>,
    /// largest free block / total free (1 when there is no free memory).
    pub largest_free_ratio: Vec<f64>,
    pub gap_concentration: Vec<f64>,
}

/// Replays and records the series; `points` bounds the number of points kept (≥ 2).
pub fn record(
    prepared: &Prepared,
    config: &AllocatorConfig,
    capacity: Option<u64>,
    placement: &Placement,
    points: usize,
) -> (ReplayOutcome, Series, FragSeries) {
    let n = prepared.program.requests.len().max(1);
    let bucket = n.div_ceil(points.max(2)).max(1);
    let frag_every = n.div_ceil(200).max(1);
    let mut s = Series::default();
    let mut f = FragSeries::default();
    let opts = prepared.options(config, &prepared.limits(capacity), placement.clone());
    let device = SimDevice::new(prepared.device_memory, placement.clone());
    let flags = &prepared.empty_cache;
    let mut last_bucket = usize::MAX;
    let outcome = replay_observed(
        &prepared.program,
        &opts,
        device,
        |_, oi| flags.get(oi).copied().unwrap_or(false),
        |a, oi| {
            let Op::Malloc(r) = prepared.program.ops[oi] else { return };
            let st = &a.stats;
            let (al, ac, re) = (st.allocated_bytes.all().current as u64, st.active_bytes.all().current as u64, st.reserved_bytes.all().current as u64);
            let b = r as usize / bucket;
            if b != last_bucket {
                last_bucket = b;
                s.request.push(r);
                s.allocated.push(al);
                s.active.push(ac);
                s.reserved.push(re);
            } else {
                let i = s.request.len() - 1;
                s.allocated[i] = s.allocated[i].max(al);
                s.active[i] = s.active[i].max(ac);
                s.reserved[i] = s.reserved[i].max(re);
            }
            if (r as usize).is_multiple_of(frag_every) {
                let fb = breakdown(a);
                f.request.push(r);
                f.unallocated.push(fb.unallocated());
                f.largest_free_ratio.push(if fb.free > 0 { fb.largest_free_block as f64 / fb.free as f64 } else { 1.0 });
                f.gap_concentration.push(fb.gap_concentration);
            }
        },
    );
    (outcome, s, f)
}
