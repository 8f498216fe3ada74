//! Snapshots of several GPUs: the devices a snapshot names and the one a command answers for
//! (each device's trace is replayed on its own model, as allocators are per device in PyTorch:
//! `allocsim_replay::run::run_devices`).

use std::collections::BTreeSet;

use allocsim_model::format::format_size;
use allocsim_program::error::RunError;
use allocsim_trace::{Action, Snapshot, SnapshotSegment};

/// The devices a snapshot names, in order: every index of `device_traces` and every final
/// segment's device. A set of the indices seen, never anything indexed by device: a device index
/// no machine has (negative, or 2^16 and beyond) is an error naming the segment
/// ([`allocsim_program::check::check_devices`]).
pub fn devices_named(snap: &Snapshot) -> Result<BTreeSet<usize>, RunError> {
    allocsim_program::check::check_devices(snap)?;
    let mut set: BTreeSet<usize> = (0..snap.device_traces.len()).collect();
    set.extend(snap.segments.iter().map(|s| s.device as usize));
    Ok(set)
}

/// One more than the highest device a snapshot names (0 for none): `--device N` must be below it.
fn device_count(named: &BTreeSet<usize>) -> usize {
    named.last().map_or(0, |d| d + 1)
}

/// The devices whose trace has entries, in device order.
pub fn devices_with_entries(snap: &Snapshot) -> Vec<usize> {
    (0..snap.device_traces.len()).filter(|&d| !snap.device_traces[d].is_empty()).collect()
}

/// What one device's trace shows, for choosing the device that matters.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct DeviceFacts {
    pub device: usize,
    /// Trace entries recorded for it.
    pub entries: usize,
    /// `oom` entries recorded.
    pub ooms: usize,
    /// Peak reserved bytes as the trace shows it: the final segments' total, walked back through
    /// the segment events (what MemoryViz draws).
    pub peak_reserved: u64,
    /// Bytes in its final segments.
    pub reserved_at_end: u64,
}

/// Why a device was chosen when none was given.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceReason {
    /// `--device N`.
    Given,
    /// The only device with trace entries (or, with none, the only one with segments, or none).
    Only,
    /// It ran out of memory (the most `oom` entries among the devices).
    RanOutOfMemory,
    /// No device ran out of memory; it has the highest peak reserved.
    HighestPeak,
    /// No device recorded any trace entry; it holds the most of the snapshot's segments.
    HasSegments,
}

/// The device a command answers for, and why.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct DeviceChoice {
    pub device: usize,
    pub reason: DeviceReason,
    /// Every device with trace entries (or, with none, with segments), with what its trace shows.
    pub candidates: Vec<DeviceFacts>,
}

/// What device `d`'s trace and final segments show.
pub fn device_facts(snap: &Snapshot, d: usize) -> DeviceFacts {
    let trace = snap.device_traces.get(d).map_or(&[][..], |t| t.as_slice());
    // Saturating: sizes out of bounds are refused later, naming the segment (allocsim_program::check),
    // and must not overflow here first.
    let end: u64 = snap.segments.iter().filter(|s| s.device == d as i64).fold(0u64, |a, s| a.saturating_add(s.total_size));
    // Backwards from the final segments: before a segment_alloc/map there was less reserved,
    // before a segment_free/unmap more.
    let (mut cur, mut peak) = (end as i128, end as i128);
    let mut ooms = 0;
    for e in trace.iter().rev() {
        match e.action {
            Action::SegmentAlloc | Action::SegmentMap => cur -= e.size as i128,
            Action::SegmentFree | Action::SegmentUnmap => cur += e.size as i128,
            Action::Oom => ooms += 1,
            _ => {}
        }
        peak = peak.max(cur);
    }
    DeviceFacts { device: d, entries: trace.len(), ooms, peak_reserved: peak.clamp(0, u64::MAX as i128) as u64, reserved_at_end: end }
}

/// The device that matters when none is given: among the devices with trace entries, the one
/// that ran out of memory (the most `oom` entries), else the one with the highest peak reserved
/// (lowest device number on ties); with no entries anywhere, the device holding the most of the
/// final segments; with nothing at all, device 0. Only the devices the snapshot names are looked
/// at ([`devices_named`]; an absurd device index is an error).
pub fn choose_device(snap: &Snapshot) -> Result<DeviceChoice, RunError> {
    let all: Vec<DeviceFacts> = devices_named(snap)?.into_iter().map(|d| device_facts(snap, d)).collect();
    let with_entries: Vec<DeviceFacts> = all.iter().filter(|f| f.entries > 0).cloned().collect();
    if !with_entries.is_empty() {
        let best = with_entries.iter().min_by_key(|f| (std::cmp::Reverse(f.ooms), std::cmp::Reverse(f.peak_reserved), f.device)).expect("non-empty");
        let reason = if with_entries.len() == 1 {
            DeviceReason::Only
        } else if best.ooms > 0 {
            DeviceReason::RanOutOfMemory
        } else {
            DeviceReason::HighestPeak
        };
        return Ok(DeviceChoice { device: best.device, reason, candidates: with_entries });
    }
    let with_segments: Vec<DeviceFacts> = all.into_iter().filter(|f| f.reserved_at_end > 0).collect();
    Ok(match with_segments.iter().min_by_key(|f| (std::cmp::Reverse(f.reserved_at_end), f.device)) {
        // One device, device 0: nothing was chosen.
        Some(best) if with_segments.len() == 1 && best.device == 0 => DeviceChoice { device: 0, reason: DeviceReason::Only, candidates: with_segments },
        Some(best) => DeviceChoice { device: best.device, reason: DeviceReason::HasSegments, candidates: with_segments },
        None => DeviceChoice { device: 0, reason: DeviceReason::Only, candidates: Vec::new() },
    })
}

/// [`choose_device`], or `given` (checked against the snapshot's devices).
pub fn device_for(snap: &Snapshot, given: Option<usize>) -> Result<DeviceChoice, RunError> {
    match given {
        None => choose_device(snap),
        Some(d) => {
            let n = device_count(&devices_named(snap)?);
            if d >= n {
                return Err(RunError::NoDevice(d, n));
            }
            Ok(DeviceChoice { device: d, reason: DeviceReason::Given, candidates: vec![device_facts(snap, d)] })
        }
    }
}

impl DeviceChoice {
    /// The choice in words, for a first line of output: `None` when there was no choice to make
    /// (one device, or `--device` given).
    pub fn describe(&self) -> Option<String> {
        let others = |f: &dyn Fn(&DeviceFacts) -> String| self.candidates.iter().filter(|c| c.device != self.device).map(f).collect::<Vec<_>>().join(", ");
        let me = self.candidates.iter().find(|c| c.device == self.device)?;
        let gib = |b: u64| format_size(b);
        let text = match self.reason {
            DeviceReason::Given | DeviceReason::Only => return None,
            DeviceReason::RanOutOfMemory => format!(
                "device {} of {} with entries: it ran out of memory ({} OOM{}; {})",
                self.device,
                self.candidates.len(),
                me.ooms,
                if me.ooms == 1 { "" } else { "s" },
                others(&|c| format!("device {}: {}", c.device, if c.ooms == 0 { "none".to_string() } else { c.ooms.to_string() }))
            ),
            DeviceReason::HighestPeak => format!(
                "device {} of {} with entries: none ran out of memory and it has the highest peak reserved ({}; {})",
                self.device,
                self.candidates.len(),
                gib(me.peak_reserved),
                others(&|c| format!("device {}: {}", c.device, gib(c.peak_reserved)))
            ),
            DeviceReason::HasSegments => format!(
                "device {}: no device recorded any trace entry, and it holds the snapshot's segments ({} reserved{})",
                self.device,
                gib(me.reserved_at_end),
                if self.candidates.len() > 1 {
                    format!("; {}", others(&|c| format!("device {}: {}", c.device, gib(c.reserved_at_end))))
                } else {
                    String::new()
                }
            ),
        };
        Some(format!("{text}; --device N answers for another"))
    }
}

/// The device holding the most of `segments` (reserved bytes), if any.
pub fn device_with_most_segments(segments: &[SnapshotSegment]) -> Option<usize> {
    let mut by: std::collections::BTreeMap<usize, u64> = std::collections::BTreeMap::new();
    for s in segments {
        *by.entry(s.device.max(0) as usize).or_default() += s.total_size;
    }
    by.into_iter().max_by_key(|&(d, b)| (b, std::cmp::Reverse(d))).map(|(d, _)| d)
}
