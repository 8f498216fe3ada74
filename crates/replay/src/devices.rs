//! Snapshots of several GPUs: each device's trace is replayed on its own model (allocators are per
//! device in PyTorch; nothing is shared), and the devices are ranked worst first.

use allocsim_trace::Snapshot;

use crate::run::{ReplaySpec, ReplaySummary, Replayed, RunError, run};

/// The devices whose trace has entries, in device order.
pub fn devices_with_entries(snap: &Snapshot) -> Vec<usize> {
    (0..snap.device_traces.len()).filter(|&d| !snap.device_traces[d].is_empty()).collect()
}

/// Replays every device with entries (`spec.device` is ignored), in parallel; results in device
/// order. A snapshot without entries replays device 0 (nothing happens), as [`run`] does.
pub fn run_devices(snap: &Snapshot, spec: &ReplaySpec<'_>) -> Result<Vec<Replayed>, RunError> {
    let mut devices = devices_with_entries(snap);
    if devices.is_empty() {
        devices.push(0);
    }
    let results: Vec<Result<Replayed, RunError>> = std::thread::scope(|s| {
        let handles: Vec<_> = devices
            .iter()
            .map(|&d| {
                let spec = ReplaySpec { device: Some(d), ..spec.clone() };
                s.spawn(move || run(snap, &spec))
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("device replay panicked")).collect()
    });
    results.into_iter().collect()
}

/// Indices into `replays`, worst first: most OOMs, then highest peak reserved, then device order.
pub fn worst_first(replays: &[ReplaySummary]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..replays.len()).collect();
    order.sort_by_key(|&i| {
        let o = &replays[i].outcome;
        (std::cmp::Reverse(o.ooms.len()), std::cmp::Reverse(o.peak_reserved), replays[i].device)
    });
    order
}
