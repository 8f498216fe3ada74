//! What a trace tells about device memory outside the allocator, for the `device_free` figure of
//! PyTorch's OOM message (`cudaMemGetInfo`, which the model cannot know by itself).

use allocsim_model::allocator::OutOfMemory;
use allocsim_trace::{Action, TraceEntry};

use crate::program::Request;

/// CUDA context and default workspaces of a process that has run one kernel, measured on an H200
/// with torch 2.11: 538 MiB in use with 20 MiB reserved by the allocator (probe case `oom_real`).
pub const DEFAULT_OUTSIDE_MEMORY: u64 = 518 << 20;

/// The trace's own account of reserved memory, entry by entry: its segment events, and the
/// memory outside the allocator its OOM entries show.
#[derive(Clone, Copy, Debug, Default)]
pub struct RecordedMemory {
    reserved: i64,
    outside: Option<u64>,
    /// The least device memory the OOM entries so far show: reserved + `device_free` at each.
    least_device_memory: u64,
}

impl RecordedMemory {
    pub fn push(&mut self, e: &TraceEntry, device_memory: u64) {
        match e.action {
            Action::SegmentAlloc | Action::SegmentMap => self.reserved = self.reserved.saturating_add(e.size as i64),
            Action::SegmentFree | Action::SegmentUnmap => self.reserved = self.reserved.saturating_sub(e.size as i64),
            Action::Oom => {
                let outside = device_memory.saturating_sub(e.addr).saturating_sub(self.reserved());
                self.outside = Some(self.outside.map_or(outside, |w| w.max(outside)));
                self.least_device_memory = self.least_device_memory.max(self.reserved().saturating_add(e.addr));
            }
            _ => {}
        }
    }

    /// Bytes reserved after the entries so far.
    pub fn reserved(&self) -> u64 {
        self.reserved.max(0) as u64
    }

    /// The least device memory any OOM entry so far showed: what the allocator had reserved plus
    /// what the device had free (`device_free`, from `cudaMemGetInfo`); 0 before any.
    pub fn least_device_memory(&self) -> u64 {
        self.least_device_memory
    }

    /// The most memory outside the allocator any OOM entry so far showed
    /// ([`outside_memory_from_ooms`]).
    pub fn outside(&self) -> Option<u64> {
        self.outside
    }
}

/// Bytes reserved according to the trace's own segment events just before entry `index`.
pub fn recorded_reserved_before(trace: &[TraceEntry], index: usize) -> u64 {
    let mut m = RecordedMemory::default();
    for e in &trace[..index.min(trace.len())] {
        m.push(e, 0);
    }
    m.reserved()
}

/// Memory outside the allocator (CUDA context, library workspaces), as the trace shows it: at each
/// recorded OOM, `device_total − device_free − reserved`. `None` when the trace has no OOM.
pub fn outside_memory_from_ooms(trace: &[TraceEntry], device_memory: u64) -> Option<u64> {
    let mut m = RecordedMemory::default();
    for e in trace {
        m.push(e, device_memory);
    }
    m.outside()
}

/// `device_free` for the OOM message of a replayed OOM. Under the trace's own settings, at a
/// request the trace recorded as an OOM, it is the recorded value. Where the simulated device held
/// the memory outside the allocator (`simulated_outside`: a device-full budget), its own figure.
/// At a recorded OOM under other settings, the recorded value corrected by the difference in
/// reserved memory. Elsewhere, the device minus the memory outside the allocator (from the trace's
/// OOMs, else a measured default) minus what the model reserved.
pub fn device_free_estimate(trace: &[TraceEntry], req: &Request, oom: &OutOfMemory, own_settings: bool, device_memory: u64, simulated_outside: bool) -> u64 {
    device_free_with(
        req,
        oom,
        own_settings,
        device_memory,
        simulated_outside,
        || recorded_reserved_before(trace, req.trace_index as usize),
        || outside_memory_from_ooms(trace, device_memory),
    )
}

/// [`device_free_estimate`] given the bytes the trace had reserved before the request's entry
/// ([`recorded_reserved_before`]) and the memory outside the allocator
/// ([`outside_memory_from_ooms`]), each asked for only when needed.
#[allow(clippy::too_many_arguments)]
pub fn device_free_with(
    req: &Request,
    oom: &OutOfMemory,
    own_settings: bool,
    device_memory: u64,
    simulated_outside: bool,
    recorded_reserved: impl FnOnce() -> u64,
    outside: impl FnOnce() -> Option<u64>,
) -> u64 {
    if req.recorded_oom && own_settings {
        return req.recorded_addr;
    }
    if simulated_outside {
        return oom.device_free;
    }
    if req.recorded_oom {
        return req.recorded_addr.saturating_add(recorded_reserved()).saturating_sub(oom.reserved_bytes);
    }
    let outside = outside().unwrap_or(DEFAULT_OUTSIDE_MEMORY);
    device_memory.saturating_sub(outside).saturating_sub(oom.reserved_bytes)
}
