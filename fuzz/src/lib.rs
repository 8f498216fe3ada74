//! The fuzz targets' bodies, shared by the libFuzzer targets (`fuzz_targets/`, `cargo fuzz run`)
//! and the stable-Rust harness (`src/bin/stable_fuzz.rs`), and replayed over the kept crashers by
//! the workspace's regression tests.
//!
//! Both targets must never panic, and must stay within bounded memory and time: every input either
//! decodes or gives an error, and a decoded trace replays (with at most [`MAX_ENTRIES`] entries per
//! device, so one input cannot take minutes).

/// Entries per device that `decode_replay` replays (the rest is cut off).
pub const MAX_ENTRIES: usize = 4096;

/// `decode`: bytes → snapshot (gzip, pickle VM, snapshot conversion, JSON Lines), then the
/// conversion back to the JSON Lines and pickle formats must not panic either.
pub fn decode(data: &[u8]) {
    if let Ok(snap) = allocsim_trace::read_trace_bytes(data) {
        let mut out = Vec::new();
        let _ = allocsim_trace::jsonl::write(&snap, &mut out);
    }
}

/// `decode_replay`: decode, keep the first [`MAX_ENTRIES`] entries of each device, then replay
/// every device under the snapshot's own settings (errors are fine, panics are not).
pub fn decode_replay(data: &[u8]) {
    let Ok(mut snap) = allocsim_trace::read_trace_bytes(data) else { return };
    for t in &mut snap.device_traces {
        t.truncate(MAX_ENTRIES);
    }
    for device in 0..snap.device_traces.len().min(4) {
        let spec = allocsim_replay::ReplaySpec { device: Some(device), ..Default::default() };
        if let Ok(r) = allocsim_replay::run(&snap, &spec) {
            let _ = allocsim_replay::validate(&r);
        }
    }
}
