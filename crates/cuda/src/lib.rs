//! allocsim-cuda: the allocator model driving a real GPU.
//!
//! * [`driver`]: a small safe layer of our own over cudarc's driver API (context, `cuMemAlloc`'d
//!   memory, reservation, physical handle, mapping); all `unsafe` of the crate is there.
//! * [`CudaDevice`]: the model's `Device` on a GPU, each call timed, with an optional byte cap.
//! * [`Measured`] and [`check`]: used memory (`cuMemGetInfo`: total − free) read around every call
//!   and held against the model's segment events.
//! * [`replay_on_gpu`]: a program replayed on GPU `ordinal` with the `empty_cache()` calls of a
//!   simulated replay; every segment event checked.
//!
//! Without `libcuda.so` everything returns [`CudaError::NoDriver`] ("no CUDA driver found"), never
//! a panic. Nothing from CUDA is needed to build.

pub mod device;
pub mod driver;
pub mod measured;

use std::collections::BTreeMap;
use std::time::Instant;

use allocsim_model::Device;
use allocsim_model::format::format_size;
use allocsim_replay::replay::SegmentEvent;
use allocsim_replay::{Program, ReplayOptions, ReplayOutcome, replay_on};

pub use device::{CALL_KINDS, CudaDevice, Timing};
pub use driver::{CudaError, driver_present};
pub use measured::{Call, Check, Measured, Measurement, Mismatch, check};

/// Replays `program` on `device` with every call measured, applying `empty_cache()` where
/// `empty_cache_flags` (one per op, from a simulated replay) says, and checks every segment event.
pub fn replay_checked<D: Device>(program: &Program, opts: &ReplayOptions, device: D, empty_cache_flags: &[bool]) -> (ReplayOutcome<Measured<D>>, Check) {
    let outcome = replay_on(program, opts, Measured::new(device), |_, oi| empty_cache_flags.get(oi).copied().unwrap_or(false));
    let c = check(&outcome.segment_events, &outcome.allocator.device.log);
    (outcome, c)
}

/// Mean time of one kind of call.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct CallTiming {
    pub kind: &'static str,
    pub count: u64,
    pub total_ns: u64,
    pub mean_us: f64,
}

/// What a replay on a GPU found.
#[derive(Clone, Debug, serde::Serialize)]
pub struct GpuReport {
    pub device_name: String,
    pub ordinal: usize,
    /// `cuDriverGetVersion` (e.g. 13000 for CUDA 13.0).
    pub driver_version: i32,
    pub total_memory: u64,
    /// `cuMemGetInfo`'s free bytes before the replay.
    pub free_at_start: u64,
    pub config: String,
    pub capacity: Option<u64>,
    /// The byte cap the device itself enforced ([`device_cap`]).
    pub device_cap: Option<u64>,
    /// Calls the device refused because of that cap (0 unless the model overshoots it).
    pub cap_refusals: u64,
    pub requests: usize,
    /// Segment events the model produced (all of them are checked).
    pub segment_events: usize,
    pub events_checked: usize,
    pub refused_calls: usize,
    pub reservation_calls: usize,
    pub mismatches: Vec<Mismatch>,
    pub ooms: usize,
    pub first_oom: Option<u32>,
    pub peak_reserved: u64,
    /// Per call kind (see [`CALL_KINDS`]), in that order; kinds never called are left out.
    pub timings: Vec<CallTiming>,
    /// Wall time of the replay, measurement included.
    pub wall_s: f64,
    /// Used memory after everything was given back, minus used memory at the start.
    pub leaked_bytes: i64,
    /// Driver errors other than out-of-memory.
    pub driver_errors: Vec<String>,
    /// The model's segment events in this replay (addresses are the GPU's).
    #[serde(skip)]
    pub model_events: Vec<SegmentEvent>,
}

impl GpuReport {
    /// Every segment event matched and nothing went wrong.
    pub fn exact(&self) -> bool {
        self.mismatches.is_empty()
            && self.driver_errors.is_empty()
            && self.leaked_bytes == 0
            && self.events_checked == self.segment_events
            && self.cap_refusals == 0
    }

    pub fn timing(&self, kind: &str) -> Option<&CallTiming> {
        self.timings.iter().find(|t| t.kind == kind)
    }
}

/// The byte cap a device should enforce for a replay under `opts` on a device of `total` bytes: the
/// allowed maximum (`opts.capacity`, else `per_process_memory_fraction` × total), plus one page of the
/// largest expandable-segment page when expandable segments are on. PyTorch checks
/// `total_allocated_memory + size` against the maximum for the rounded request, then maps whole
/// pages, so its reserved memory can exceed the maximum by less than a page (seen on an H200:
/// `synthetic__default__8810M` under `expandable_segments:True` peaks 16 MiB above its maximum).
/// `None`: no maximum.
pub fn device_cap(opts: &ReplayOptions, total: u64) -> Option<u64> {
    let fraction_cap = opts.config.per_process_memory_fraction.filter(|&f| f < 1.0).map(|f| (f * total as f64) as u64);
    let allowed = match (opts.capacity, fraction_cap) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }?;
    let slack = if opts.config.expandable_segments { opts.config.large_segment_size.max(allocsim_model::constants::K_SMALL_BUFFER) } else { 0 };
    Some(allowed.saturating_add(slack))
}

/// Replays `program` under `opts` on GPU `ordinal`: real `cuMemAlloc`/`cuMemFree` and VMM calls for
/// the model's decisions, `empty_cache()` where `empty_cache_flags` says (those of a simulated replay,
/// `Replayed.outcome.empty_cache`), and at every segment event a check that the device's used memory
/// moved by exactly the model's reserved delta. Everything is given back at the end.
///
/// The device refuses allocations beyond [`device_cap`] as an extra safety; the model enforces the
/// allowed maximum itself. A refusal by that cap means the model asked for more than PyTorch could
/// have taken: it is counted in [`GpuReport::cap_refusals`] and makes the report not exact.
pub fn replay_on_gpu(program: &Program, opts: &ReplayOptions, empty_cache_flags: &[bool], ordinal: usize) -> Result<GpuReport, CudaError> {
    let dev = CudaDevice::new(ordinal)?;
    let total = dev.total();
    let device_cap = device_cap(opts, total);
    let dev = dev.with_cap(device_cap).with_large_segment_size(opts.config.large_segment_size);
    let device_name = dev.context().name()?;
    let driver_version = dev.context().driver_version()?;
    let (free_at_start, _) = dev.context().mem_get_info()?;

    let t = Instant::now();
    let (outcome, c) = replay_checked(program, opts, dev, empty_cache_flags);
    let wall_s = t.elapsed().as_secs_f64();

    let ReplayOutcome { segment_events, ooms, peak_reserved, allocator, .. } = outcome;
    let mut dev = allocator.device.inner;
    let cap_refusals = dev.cap_refusals();
    let mut driver_errors = dev.errors();
    driver_errors.extend(dev.release_all().into_iter().map(|e| e.to_string()));
    let (free_at_end, _) = dev.context().mem_get_info()?;

    let tm: BTreeMap<&'static str, Timing> = dev.timings();
    let timings =
        CALL_KINDS.iter().filter_map(|&k| tm.get(k).map(|t| CallTiming { kind: k, count: t.count, total_ns: t.total_ns, mean_us: t.mean_us() })).collect();
    Ok(GpuReport {
        device_name,
        ordinal,
        driver_version,
        total_memory: total,
        free_at_start,
        config: opts.config.source.clone(),
        capacity: opts.capacity,
        device_cap,
        cap_refusals,
        requests: program.requests.len(),
        segment_events: segment_events.len(),
        events_checked: c.events_checked,
        refused_calls: c.refused_calls,
        reservation_calls: c.reservation_calls,
        mismatches: c.mismatches,
        ooms: ooms.len(),
        first_oom: ooms.first().map(|o| o.request),
        peak_reserved,
        timings,
        wall_s,
        leaked_bytes: free_at_start as i64 - free_at_end as i64,
        driver_errors,
        model_events: segment_events,
    })
}

impl std::fmt::Display for GpuReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let v = self.driver_version;
        writeln!(
            f,
            "GPU replay on {} (device {}, driver API {}.{}, {} total, {} free at start) under {}",
            self.device_name,
            self.ordinal,
            v / 1000,
            (v % 1000) / 10,
            format_size(self.total_memory),
            format_size(self.free_at_start),
            if self.config.is_empty() { "defaults" } else { &self.config }
        )?;
        if let Some(c) = self.device_cap {
            writeln!(f, "  device cap        {} ({c} bytes); {} calls refused by it", format_size(c), self.cap_refusals)?;
        }
        let verdict = if self.mismatches.is_empty() { "every reserved delta matched".to_string() } else { format!("{} MISMATCHES", self.mismatches.len()) };
        writeln!(f, "  segment events    {}/{} checked against cuMemGetInfo (total − free): {verdict}", self.events_checked, self.segment_events)?;
        for m in self.mismatches.iter().take(20) {
            writeln!(f, "    {m}")?;
        }
        if self.mismatches.len() > 20 {
            writeln!(f, "    ... {} more", self.mismatches.len() - 20)?;
        }
        writeln!(
            f,
            "  refused calls     {} (out of memory or beyond the cap); {} reservation calls moved no memory{}",
            self.refused_calls,
            self.reservation_calls,
            if self.mismatches.iter().any(|m| m.event.is_none()) { " (except those listed)" } else { "" }
        )?;
        writeln!(
            f,
            "  outcome           peak reserved {}; {} OOMs{}",
            format_size(self.peak_reserved),
            self.ooms,
            self.first_oom.map(|r| format!(", the first at request {r}")).unwrap_or_default()
        )?;
        let line = |kinds: &[&str]| -> String {
            kinds.iter().filter_map(|k| self.timing(k)).map(|t| format!("{} {} × {:.1} µs", t.kind, t.count, t.mean_us)).collect::<Vec<_>>().join(", ")
        };
        writeln!(f, "  device calls      {}", line(&["cudaMalloc", "cudaFree", "map", "unmap", "reserve", "release_reservation"]))?;
        writeln!(f, "  driver calls      {}", line(&["cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemRelease", "cuMemGetInfo"]))?;
        writeln!(f, "  wall              {:.3} s for {} requests", self.wall_s, self.requests)?;
        if self.leaked_bytes == 0 {
            writeln!(f, "  given back        all (used memory back to where it started)")?;
        } else {
            writeln!(f, "  given back        used memory differs from the start by {} bytes", self.leaked_bytes)?;
        }
        for e in &self.driver_errors {
            writeln!(f, "  driver error      {e}")?;
        }
        write!(f, "  {}", if self.exact() { "exact" } else { "NOT exact" })
    }
}
