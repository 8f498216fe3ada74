//! Bounds on what a trace may say, checked before anything is replayed, so that a corrupt or
//! hostile snapshot gets a one-line error naming the entry instead of an overflow deep inside the
//! model: request sizes below 2^63 (a tensor's byte size is an `int64`), segment sizes and every
//! address (plus its size) of a trace entry within 2^60 (GPU virtual address spaces are 49 to 57
//! bits), and final segments that end below 2^64 − 2^48.

use allocsim_trace::{Action, SnapshotSegment, TraceEntry};

/// Largest request size a trace may record (exclusive).
pub const MAX_REQUEST: u64 = 1 << 63;
/// Largest address plus size a trace entry may record (inclusive).
pub const MAX_ADDRESS: u64 = 1 << 60;
/// Largest end of a final segment (inclusive): room above it for the simulated device's own
/// addresses.
pub const MAX_SEGMENT_END: u64 = u64::MAX - (1 << 48);

/// What is wrong with a trace entry or a final segment.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TraceCheckError {
    #[error("device {device}, trace entry {index} ({action}): {msg}")]
    Entry { device: usize, index: usize, action: &'static str, msg: String },
    #[error("device {device}, final segment at {address:#x}: {msg}")]
    Segment { device: usize, address: u64, msg: String },
}

/// Checks one device's trace and final segments against the bounds above.
pub fn check_trace(device: usize, trace: &[TraceEntry], segments: &[SnapshotSegment]) -> Result<(), TraceCheckError> {
    for (index, e) in trace.iter().enumerate() {
        check_entry(device, index, e)?;
    }
    check_segments(device, segments)
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
    for s in segments {
        let err = |msg: String| TraceCheckError::Segment { device, address: s.address, msg };
        if s.address.checked_add(s.total_size).is_none_or(|end| end > MAX_SEGMENT_END) {
            return Err(err(format!("{} bytes at this address end beyond the 64-bit address space", s.total_size)));
        }
        for b in &s.blocks {
            if b.address < s.address || b.address.checked_add(b.size).is_none_or(|end| end > s.address + s.total_size) {
                return Err(err(format!("block at {:#x} of {} bytes lies outside the segment", b.address, b.size)));
            }
        }
    }
    Ok(())
}
