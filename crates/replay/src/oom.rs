//! What a trace tells about device memory outside the allocator, for the `device_free` figure of
//! PyTorch's OOM message (`cudaMemGetInfo`, which the model cannot know by itself).

use allocsim_model::allocator::OutOfMemory;
use allocsim_trace::{Action, TraceEntry};

use crate::program::Request;

/// CUDA context and default workspaces of a process that has run one kernel, measured on an H200
/// with torch 2.11: 538 MiB in use with 20 MiB reserved by the allocator (probe case `oom_real`).
pub const DEFAULT_OUTSIDE_MEMORY: u64 = 518 << 20;

/// Bytes reserved according to the trace's own segment events just before entry `index`.
pub fn recorded_reserved_before(trace: &[TraceEntry], index: usize) -> u64 {
    let mut reserved: i64 = 0;
    for e in &trace[..index.min(trace.len())] {
        match e.action {
            Action::SegmentAlloc | Action::SegmentMap => reserved += e.size as i64,
            Action::SegmentFree | Action::SegmentUnmap => reserved -= e.size as i64,
            _ => {}
        }
    }
    reserved.max(0) as u64
}

/// Memory outside the allocator (CUDA context, library workspaces), as the trace shows it: at each
/// recorded OOM, `device_total − device_free − reserved`. `None` when the trace has no OOM.
pub fn outside_memory_from_ooms(trace: &[TraceEntry], device_memory: u64) -> Option<u64> {
    let mut reserved: i64 = 0;
    let mut worst: Option<u64> = None;
    for e in trace {
        match e.action {
            Action::SegmentAlloc | Action::SegmentMap => reserved += e.size as i64,
            Action::SegmentFree | Action::SegmentUnmap => reserved -= e.size as i64,
            Action::Oom => {
                let outside = device_memory.saturating_sub(e.addr).saturating_sub(reserved.max(0) as u64);
                worst = Some(worst.map_or(outside, |w| w.max(outside)));
            }
            _ => {}
        }
    }
    worst
}

/// `device_free` for the OOM message of a replayed OOM. Under the trace's own settings, at a
/// request the trace recorded as an OOM, it is the recorded value. At a recorded OOM under other
/// settings, the recorded value corrected by the difference in reserved memory. Elsewhere, the
/// device minus the memory outside the allocator (from the trace's OOMs, else a measured default)
/// minus what the model reserved.
pub fn device_free_estimate(trace: &[TraceEntry], req: &Request, oom: &OutOfMemory, own_settings: bool, device_memory: u64) -> u64 {
    if req.recorded_oom {
        if own_settings {
            return req.recorded_addr;
        }
        let recorded_reserved = recorded_reserved_before(trace, req.trace_index as usize);
        return (req.recorded_addr + recorded_reserved).saturating_sub(oom.reserved_bytes);
    }
    let outside = outside_memory_from_ooms(trace, device_memory).unwrap_or(DEFAULT_OUTSIDE_MEMORY);
    device_memory.saturating_sub(outside).saturating_sub(oom.reserved_bytes)
}
