//! Bounds on what a trace may say, checked before anything is replayed, so that a corrupt or
//! hostile snapshot gets a one-line error naming the entry instead of an overflow deep inside the
//! model: request sizes below 2^63 (a tensor's byte size is an `int64`), segment sizes and every
//! address (plus its size) of a trace entry within 2^60 (GPU virtual address spaces are 49 to 57
//! bits), final segments of at most 2^60 bytes that end below 2^64 − 2^48 and overlap neither
//! each other nor (their blocks) one another, allocations that do not overlap a block the trace
//! allocated and has not freed, and device indices below 2^16 (PyTorch's are small ints).

use std::collections::BTreeMap;

use allocsim_trace::{Action, Snapshot, SnapshotSegment, TraceEntry};

/// Largest request size a trace may record (exclusive).
pub const MAX_REQUEST: u64 = 1 << 63;
/// Largest address plus size a trace entry may record (inclusive).
pub const MAX_ADDRESS: u64 = 1 << 60;
/// Largest end of a final segment (inclusive): room above it for the simulated device's own
/// addresses.
pub const MAX_SEGMENT_END: u64 = u64::MAX - (1 << 48);
/// Largest device index a snapshot may name (exclusive): PyTorch's device indices are small
/// non-negative ints (the JSON Lines reader has the same bound).
pub const MAX_DEVICE: i64 = 1 << 16;

/// What is wrong with a trace entry or a final segment.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TraceCheckError {
    #[error("device {device}, trace entry {index} ({action}): {msg}")]
    Entry { device: usize, index: usize, action: &'static str, msg: String },
    #[error("device {device}, final segment at {address:#x}: {msg}")]
    Segment { device: usize, address: u64, msg: String },
    /// A final segment (`index` in the snapshot's `segments`) on a device no machine has.
    #[error("final segment {index} (at {address:#x}): device {device} is not a device index (PyTorch's are 0 to {})", MAX_DEVICE - 1)]
    Device { index: usize, address: u64, device: i64 },
    /// More per-device traces than any machine has devices.
    #[error("{0} device traces: more devices than any machine has (at most {MAX_DEVICE})")]
    DeviceTraces(usize),
}

/// Checks the device indices a snapshot names: every final segment's, and the number of device
/// traces. Before anything is indexed by device.
pub fn check_devices(snap: &Snapshot) -> Result<(), TraceCheckError> {
    check_segment_devices(&snap.segments)?;
    if snap.device_traces.len() > MAX_DEVICE as usize {
        return Err(TraceCheckError::DeviceTraces(snap.device_traces.len()));
    }
    Ok(())
}

/// Checks every final segment's device index (every device's segments).
pub fn check_segment_devices(segments: &[SnapshotSegment]) -> Result<(), TraceCheckError> {
    match segments.iter().enumerate().find(|(_, s)| !(0..MAX_DEVICE).contains(&s.device)) {
        Some((index, s)) => Err(TraceCheckError::Device { index, address: s.address, device: s.device }),
        None => Ok(()),
    }
}

/// Checks one device's trace and final segments against the bounds above.
pub fn check_trace(device: usize, trace: &[TraceEntry], segments: &[SnapshotSegment]) -> Result<(), TraceCheckError> {
    let mut live = LiveBlocks::default();
    for (index, e) in trace.iter().enumerate() {
        check_entry(device, index, e)?;
        live.push(device, index, e)?;
    }
    check_segments(device, segments)
}

/// The blocks a trace allocated and has not yet freed (`free_completed`), entry by entry: an
/// allocation that overlaps one of them is impossible (the allocator hands out a range once).
/// Blocks that pre-existed a trace that starts mid-history are not known and not checked.
#[derive(Clone, Debug, Default)]
pub struct LiveBlocks {
    /// Start → end.
    live: BTreeMap<u64, u64>,
}

impl LiveBlocks {
    /// Entry `index` of device `device`'s trace (already [`check_entry`]'d).
    pub fn push(&mut self, device: usize, index: usize, e: &TraceEntry) -> Result<(), TraceCheckError> {
        match e.action {
            // (A block of no bytes occupies nothing.)
            Action::Alloc if e.size > 0 => {
                let end = e.addr + e.size;
                let before = self.live.range(..end).next_back().filter(|&(_, &b_end)| b_end > e.addr);
                if let Some((&b, &b_end)) = before {
                    return Err(TraceCheckError::Entry {
                        device,
                        index,
                        action: e.action.as_str(),
                        msg: format!("{} bytes at {:#x} overlap a block the trace allocated and has not freed ({} bytes at {b:#x})", e.size, e.addr, b_end - b),
                    });
                }
                self.live.insert(e.addr, end);
            }
            Action::FreeCompleted => {
                self.live.remove(&e.addr);
            }
            _ => {}
        }
        Ok(())
    }
}

/// Checks entry `index` of a device's trace.
pub fn check_entry(device: usize, index: usize, e: &TraceEntry) -> Result<(), TraceCheckError> {
    let err = |msg: String| TraceCheckError::Entry { device, index, action: e.action.as_str(), msg };
    if index >= u32::MAX as usize {
        return Err(err("a device trace of more than 2^32 entries is beyond what allocsim replays".into()));
    }
    match e.action {
        Action::Alloc | Action::Oom | Action::FreeRequested | Action::FreeCompleted => {
            if e.size >= MAX_REQUEST {
                return Err(err(format!("size {} bytes is not a possible request (at least 2^63)", e.size)));
            }
        }
        Action::SegmentAlloc | Action::SegmentFree | Action::SegmentMap | Action::SegmentUnmap => {
            if e.size > MAX_ADDRESS {
                return Err(err(format!("segment size {} bytes is beyond any device (more than 2^60)", e.size)));
            }
        }
        Action::Snapshot | Action::Annotate => {}
    }
    let sized = matches!(e.action, Action::Alloc | Action::SegmentAlloc | Action::SegmentFree | Action::SegmentMap | Action::SegmentUnmap);
    if sized && e.addr.checked_add(e.size).is_none_or(|end| end > MAX_ADDRESS) {
        return Err(err(format!("address {:#x} with size {} lies beyond any GPU address space (2^60)", e.addr, e.size)));
    }
    if matches!(e.action, Action::FreeRequested | Action::FreeCompleted) && e.addr > MAX_ADDRESS {
        return Err(err(format!("address {:#x} lies beyond any GPU address space (2^60)", e.addr)));
    }
    Ok(())
}

/// Checks a device's final segments.
pub fn check_segments(device: usize, segments: &[SnapshotSegment]) -> Result<(), TraceCheckError> {
    check_segment_devices(segments)?;
    for s in segments {
        let err = |msg: String| TraceCheckError::Segment { device, address: s.address, msg };
        if s.total_size > MAX_ADDRESS {
            return Err(err(format!("segment size {} bytes is beyond any device (more than 2^60)", s.total_size)));
        }
        if s.address.checked_add(s.total_size).is_none_or(|end| end > MAX_SEGMENT_END) {
            return Err(err(format!("{} bytes at this address end beyond the 64-bit address space", s.total_size)));
        }
        let mut end_of_previous: Option<(u64, u64)> = None;
        let mut blocks: Vec<(u64, u64)> = s.blocks.iter().map(|b| (b.address, b.size)).collect();
        blocks.sort_unstable();
        for (address, size) in blocks {
            if address < s.address || address.checked_add(size).is_none_or(|end| end > s.address + s.total_size) {
                return Err(err(format!("block at {address:#x} of {size} bytes lies outside the segment")));
            }
            if let Some((p, p_end)) = end_of_previous
                && p_end > address
            {
                return Err(err(format!("block at {address:#x} of {size} bytes overlaps the block at {p:#x} of {} bytes", p_end - p)));
            }
            end_of_previous = Some((address, address + size));
        }
    }
    // In address order, each segment must end before the next begins.
    let mut order: Vec<&SnapshotSegment> = segments.iter().collect();
    order.sort_by_key(|s| (s.address, s.total_size));
    for w in order.windows(2) {
        let (a, b) = (w[0], w[1]);
        if a.address + a.total_size > b.address {
            let what = if (a.address, a.total_size) == (b.address, b.total_size) {
                format!("listed twice ({} bytes)", b.total_size)
            } else {
                format!("{} bytes overlapping the final segment at {:#x} ({} bytes)", b.total_size, a.address, a.total_size)
            };
            return Err(TraceCheckError::Segment { device, address: b.address, msg: what });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alloc(addr: u64, size: u64) -> TraceEntry {
        TraceEntry { action: Action::Alloc, addr, size, stream: 0, time_us: 0, stack: 0, meta: 0 }
    }

    #[test]
    fn an_allocation_over_a_live_block_names_both() {
        let mut live = LiveBlocks::default();
        live.push(0, 0, &alloc(0x1000, 0x1000)).unwrap();
        live.push(0, 1, &alloc(0x2000, 0x1000)).unwrap();
        let e = live.push(0, 2, &alloc(0x2800, 0x100)).unwrap_err().to_string();
        assert_eq!(e, "device 0, trace entry 2 (alloc): 256 bytes at 0x2800 overlap a block the trace allocated and has not freed (4096 bytes at 0x2000)");
        // Freed, the range can be handed out again.
        live.push(0, 3, &TraceEntry { action: Action::FreeCompleted, addr: 0x2000, size: 0x1000, stream: 0, time_us: 0, stack: 0, meta: 0 }).unwrap();
        live.push(0, 4, &alloc(0x2800, 0x100)).unwrap();
    }
}
