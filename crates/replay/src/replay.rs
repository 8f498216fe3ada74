//! Replays a [`Program`] through the allocator model and collects what happened.

use allocsim_model::allocator::{BlockId, CachingAllocator, EventKind, OutOfMemory, RestoredBlockSpec, RestoredHandle, RestoredState, Route};
use allocsim_model::{AllocatorConfig, Device, DeviceStats, Placement, SimDevice};
use allocsim_trace::{Action, TraceEntry};

use crate::program::{Op, Program};
use crate::restore::InitialState;

/// How to replay: the allocator settings, the allowed maximum, the device and its placement.
#[derive(Clone, Debug)]
pub struct ReplayOptions {
    pub config: AllocatorConfig,
    /// The allowed maximum (`set_per_process_memory_fraction`), in bytes.
    pub capacity: Option<u64>,
    /// The device's total memory (`totalGlobalMem`).
    pub device_memory: u64,
    pub placement: Placement,
}

/// Where the `empty_cache()` calls are (the trace does not record them), and which cross-stream
/// completions a malloc's own synchronize made (the trace shows them like any other).
#[derive(Clone, Copy, Debug)]
pub enum EmptyCacheCalls<'a> {
    /// Decide while replaying under the trace's own settings: a release run that the model's next
    /// `malloc` does not produce itself was an `empty_cache()`.
    Infer(&'a [TraceEntry]),
    /// Apply `empty_cache()` at the ops flagged (one flag per op).
    Given(&'a [bool]),
}

/// A segment event the model produced.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct SegmentEvent {
    pub action: &'static str,
    pub addr: u64,
    pub size: u64,
    pub stream: u64,
    /// The ordinal of the request during (or before) which it happened.
    pub request: u32,
    /// In a small pool (2 MiB segments and pages).
    pub small: bool,
}

/// A request the model could not serve.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Oom {
    pub request: u32,
    pub info: OutOfMemory,
}

/// What a replay did.
#[derive(Clone, Debug)]
pub struct ReplayOutcome<D: Device = SimDevice> {
    pub stats: DeviceStats,
    pub segment_events: Vec<SegmentEvent>,
    pub ooms: Vec<Oom>,
    /// One flag per op: at a release run, an `empty_cache()` was applied there; at a completion,
    /// it was held for the next malloc's synchronize.
    pub empty_cache: Vec<bool>,
    /// The address each request got (`None`: it ran out of memory).
    pub addresses: Vec<Option<u64>>,
    /// Peak `reserved_bytes.all`, same as `stats`, kept for convenience.
    pub peak_reserved: u64,
    /// The allocator at the end of the trace.
    pub allocator: CachingAllocator<D>,
    /// Segments of the reconstructed initial state that could not be restored (the device had no
    /// room, or the state was inconsistent), with why. Their blocks' frees are ignored.
    pub restore_failures: Vec<String>,
}

impl<D: Device> ReplayOutcome<D> {
    pub fn first_oom(&self) -> Option<u32> {
        self.ooms.first().map(|o| o.request)
    }
}

fn action_name(k: EventKind) -> &'static str {
    match k {
        EventKind::SegmentAlloc => "segment_alloc",
        EventKind::SegmentFree => "segment_free",
        EventKind::SegmentMap => "segment_map",
        EventKind::SegmentUnmap => "segment_unmap",
        EventKind::Oom => "oom",
    }
}

/// Replays `program` under `opts` on a simulated device.
pub fn replay(program: &Program, opts: &ReplayOptions, empty_cache: EmptyCacheCalls<'_>) -> ReplayOutcome {
    let device = SimDevice::new(opts.device_memory, opts.placement.clone());
    // The next malloc (op index) whose own release chain the ops before it belong to.
    let mut inside_malloc: Option<usize> = None;
    replay_on(program, opts, device, |alloc, oi| match empty_cache {
        EmptyCacheCalls::Given(f) => f.get(oi).copied().unwrap_or(false),
        EmptyCacheCalls::Infer(trace) => {
            let Some(m) = next_malloc(program, oi) else {
                // No malloc follows: a release run is an empty_cache(); a completion is just that.
                return matches!(program.ops[oi], Op::ReleaseRun { .. });
            };
            if inside_malloc == Some(m) {
                // An earlier release run or completion before this malloc was its own: so is this.
                return !matches!(program.ops[oi], Op::ReleaseRun { .. });
            }
            match program.ops[oi] {
                Op::ReleaseRun { .. } => {
                    let recorded: Vec<&TraceEntry> = program.ops[oi..m]
                        .iter()
                        .filter_map(|op| match *op {
                            Op::ReleaseRun { start, end } => Some(&trace[start as usize..end as usize]),
                            _ => None,
                        })
                        .flatten()
                        .collect();
                    let produced = next_malloc_makes(alloc, program, m, &recorded);
                    if produced {
                        inside_malloc = Some(m);
                    }
                    !produced
                }
                Op::Complete(_) | Op::CompletePre(_) => {
                    let inside = completed_by_next_malloc(alloc, program, m, trace);
                    if inside {
                        inside_malloc = Some(m);
                    }
                    inside
                }
                _ => false,
            }
        }
    })
}

/// The op index of the next malloc after `oi`, if only completions and release runs come between
/// (the entries a malloc's retry chain can emit before its own `alloc`).
fn next_malloc(program: &Program, oi: usize) -> Option<usize> {
    for (i, op) in program.ops.iter().enumerate().skip(oi + 1) {
        match op {
            Op::Malloc(_) => return Some(i),
            Op::Complete(_) | Op::CompletePre(_) | Op::ReleaseRun { .. } => {}
            _ => return None,
        }
    }
    None
}

/// Were these cross-stream completions made by the next malloc's own `synchronize_and_free_events`
/// (its OOM retry), rather than by `process_events` before it? The trace shows both the same way:
/// `free_completed` entries before the request's `alloc`. Only with an allowed maximum can the
/// first `alloc_block` fail; then the malloc is tried with the blocks still pending, and if it
/// synchronizes and reproduces the recorded segment events and address, the completions were its own.
fn completed_by_next_malloc(alloc: &CachingAllocator<SimDevice>, program: &Program, m: usize, trace: &[TraceEntry]) -> bool {
    if alloc.allowed_memory_maximum.is_none() {
        return false;
    }
    let Op::Malloc(req) = program.ops[m] else { return false };
    let r = &program.requests[req as usize];
    let mut trial = alloc.clone();
    trial.events.clear();
    let syncs = trial.stats.num_sync_all_streams;
    let result = trial.malloc(r.size, r.stream, r.route);
    if trial.stats.num_sync_all_streams == syncs {
        return false;
    }
    let served_as_recorded = match result {
        Ok(b) => !r.recorded_oom && trial.block(b).ptr == r.recorded_addr,
        Err(_) => r.recorded_oom,
    };
    // The recorded segment entries of this malloc: those right before its alloc/oom entry.
    let mut recorded: Vec<(EventKind, u64, u64)> = Vec::new();
    let mut i = r.trace_index as usize;
    while i > 0 {
        i -= 1;
        let e = &trace[i];
        let kind = match e.action {
            Action::SegmentAlloc => EventKind::SegmentAlloc,
            Action::SegmentFree => EventKind::SegmentFree,
            Action::SegmentMap => EventKind::SegmentMap,
            Action::SegmentUnmap => EventKind::SegmentUnmap,
            Action::FreeCompleted => continue,
            _ => break,
        };
        recorded.push((kind, e.addr, e.size));
    }
    recorded.reverse();
    let made: Vec<(EventKind, u64, u64)> =
        trial.events.iter().filter(|e| e.kind != EventKind::Oom).map(|e| (e.kind, e.addr, e.size)).collect();
    served_as_recorded && made == recorded
}

/// Replays `program` under `opts` on `device` (a simulated or a real one). At each release run,
/// `is_empty_cache(allocator, op index)` says whether it was an `empty_cache()` call; at each
/// cross-stream completion, whether the next malloc's own synchronize made it (the completion is
/// then held until that malloc). (Inferring
/// that tries the next malloc on a clone of the allocator, which only a simulated device allows;
/// a real device replays the calls a simulated replay inferred.)
pub fn replay_on<D: Device>(
    program: &Program,
    opts: &ReplayOptions,
    device: D,
    is_empty_cache: impl FnMut(&CachingAllocator<D>, usize) -> bool,
) -> ReplayOutcome<D> {
    replay_observed(program, opts, device, is_empty_cache, |_, _| {})
}

/// [`replay_on`], calling `observe(allocator, op index)` after every op (for time series).
pub fn replay_observed<D: Device>(
    program: &Program,
    opts: &ReplayOptions,
    device: D,
    mut is_empty_cache: impl FnMut(&CachingAllocator<D>, usize) -> bool,
    mut observe: impl FnMut(&CachingAllocator<D>, usize),
) -> ReplayOutcome<D> {
    let mut alloc = CachingAllocator::new(opts.config.clone(), device);
    if opts.capacity.is_some() {
        alloc.set_allowed_memory_maximum(opts.capacity);
    }
    for &id in &program.private_pools {
        alloc.private_pool(id);
    }
    let n = program.requests.len();
    let mut blocks: Vec<Option<BlockId>> = vec![None; n];
    let mut tokens: Vec<Option<u64>> = vec![None; n];
    let mut addresses: Vec<Option<u64>> = vec![None; n];
    let mut segment_events = Vec::new();
    let mut ooms = Vec::new();
    let mut flags = vec![false; program.ops.len()];
    let mut next_request = 0u32;
    let npre = program.initial.as_ref().map_or(0, |s| s.blocks.len());
    let mut pre_blocks: Vec<Option<BlockId>> = vec![None; npre];
    let mut pre_tokens: Vec<Option<u64>> = vec![None; npre];
    let mut restore_failures = Vec::new();
    // Cross-stream completions that the next malloc's synchronize made.
    let mut held: Vec<u64> = Vec::new();
    if let Some(init) = &program.initial {
        restore_failures = restore(&mut alloc, init, &mut pre_blocks, &mut pre_tokens);
        // Counters count from the trace's start; peaks are the window's (see `crate::restore`).
        alloc.events.clear();
        alloc.reset_accumulated_stats();
        alloc.stats.reset_peak();
    }

    fn drain<D: Device>(alloc: &mut CachingAllocator<D>, out: &mut Vec<SegmentEvent>, request: u32) {
        for e in alloc.events.drain(..) {
            if e.kind != EventKind::Oom {
                let small = alloc.pools[e.pool as usize].is_small;
                out.push(SegmentEvent { action: action_name(e.kind), addr: e.addr, size: e.size, stream: e.stream, request, small });
            }
        }
    }

    for (oi, op) in program.ops.iter().enumerate() {
        if oi > 0 {
            observe(&alloc, oi - 1);
        }
        match *op {
            Op::Malloc(req) => {
                let r = &program.requests[req as usize];
                match alloc.malloc(r.size, r.stream, r.route) {
                    Ok(b) => {
                        blocks[req as usize] = Some(b);
                        addresses[req as usize] = Some(alloc.block(b).ptr);
                    }
                    Err(info) => ooms.push(Oom { request: req, info }),
                }
                drain(&mut alloc, &mut segment_events, req);
                next_request = req + 1;
                // Completions held for this malloc's synchronize happened by its end at the latest.
                for t in held.drain(..) {
                    alloc.complete_free(t);
                }
            }
            Op::Free { req, deferred } => {
                if let Some(b) = blocks[req as usize].take() {
                    tokens[req as usize] = alloc.free(b, deferred);
                }
            }
            Op::Complete(req) => {
                if let Some(t) = tokens[req as usize].take() {
                    if is_empty_cache(&alloc, oi) {
                        // Completed by the next malloc's own synchronize (see `replay`).
                        flags[oi] = true;
                        held.push(t);
                    } else {
                        alloc.complete_free(t);
                    }
                }
            }
            Op::ReleaseRun { .. } => {
                if is_empty_cache(&alloc, oi) {
                    flags[oi] = true;
                    alloc.empty_cache();
                    drain(&mut alloc, &mut segment_events, next_request);
                }
            }
            Op::FreePre { pre, deferred } => {
                if let Some(b) = pre_blocks[pre as usize].take() {
                    pre_tokens[pre as usize] = alloc.free(b, deferred);
                }
            }
            Op::CompletePre(pre) => {
                if let Some(t) = pre_tokens[pre as usize].take() {
                    if is_empty_cache(&alloc, oi) {
                        flags[oi] = true;
                        held.push(t);
                    } else {
                        alloc.complete_free(t);
                    }
                }
            }
            Op::ForcedRelease { addr, unmap } => {
                if unmap {
                    alloc.unmap_free_block_at(addr);
                } else {
                    alloc.release_segment_at(addr);
                }
                drain(&mut alloc, &mut segment_events, next_request);
            }
        }
    }
    for t in held.drain(..) {
        alloc.complete_free(t);
    }
    if !program.ops.is_empty() {
        observe(&alloc, program.ops.len() - 1);
    }
    let stats = alloc.stats.clone();
    ReplayOutcome {
        peak_reserved: stats.reserved_bytes.all().peak as u64,
        stats,
        segment_events,
        ooms,
        empty_cache: flags,
        addresses,
        allocator: alloc,
        restore_failures,
    }
}

/// Restores `init` into a fresh allocator, segment by segment in address order (the order
/// [`recorded_placement_from`] lists them in), recording each pre-existing block's handle.
fn restore<D: Device>(
    alloc: &mut CachingAllocator<D>,
    init: &InitialState,
    pre_blocks: &mut [Option<BlockId>],
    pre_tokens: &mut [Option<u64>],
) -> Vec<String> {
    let mut failures = Vec::new();
    for s in &init.segments {
        let route = if s.pool_id == (0, 0) { Route::Default } else { Route::Private(s.pool_id) };
        let specs: Vec<RestoredBlockSpec> = s
            .blocks
            .iter()
            .map(|&k| {
                let b = &init.blocks[k as usize];
                let state = if b.pending {
                    RestoredState::PendingFree { requested_size: b.requested_size }
                } else {
                    RestoredState::Allocated { requested_size: b.requested_size }
                };
                RestoredBlockSpec { offset: b.addr - s.addr, size: b.size, state }
            })
            .collect();
        let r = if s.expandable {
            let mapped: Vec<(u64, u64)> = s.mapped.iter().map(|&(a, l)| (a - s.addr, l)).collect();
            alloc.restore_expandable_segment(s.stream, route, s.small, &mapped, &specs)
        } else {
            alloc.restore_segment(s.size, s.stream, route, s.small, &specs)
        };
        match r {
            Ok(r) => {
                for (&k, h) in s.blocks.iter().zip(r.handles) {
                    match h {
                        RestoredHandle::Allocated(b) => pre_blocks[k as usize] = Some(b),
                        RestoredHandle::PendingFree(t) => pre_tokens[k as usize] = Some(t),
                    }
                }
            }
            Err(e) => failures.push(format!("segment at {:#x}: {e}", s.addr)),
        }
    }
    failures
}

/// Would the next op, a `malloc`, release exactly the recorded segments itself?
/// Would malloc `m` release exactly the recorded segments itself (in its retry chain)?
fn next_malloc_makes(alloc: &CachingAllocator<SimDevice>, program: &Program, m: usize, recorded: &[&TraceEntry]) -> bool {
    let Op::Malloc(req) = program.ops[m] else { return false };
    let r = &program.requests[req as usize];
    let mut trial = alloc.clone();
    let _ = trial.malloc(r.size, r.stream, r.route);
    let released = trial.events.iter().filter(|e| matches!(e.kind, EventKind::SegmentFree | EventKind::SegmentUnmap));
    let mut n = 0;
    for (e, rec) in released.zip(recorded) {
        let kind = if rec.action == Action::SegmentFree { EventKind::SegmentFree } else { EventKind::SegmentUnmap };
        if e.kind != kind || e.size != rec.size || e.addr != rec.addr {
            return false;
        }
        n += 1;
    }
    n == recorded.len()
}

/// The addresses a recorded run gave its segments: every `segment_alloc` (address, size) in order,
/// and the base of every expandable-segment reservation. A reservation spans 1.125 × `device_memory`
/// and starts at its first `segment_map`; it is released when an unmap leaves nothing of it mapped
/// (`release_expandable_segment`), after which a later map in its range starts a new one.
pub fn recorded_placement(trace: &[TraceEntry], device_memory: u64) -> Placement {
    recorded_placement_from(trace, device_memory, None)
}

/// [`recorded_placement`] of a trace that starts from `initial`: its segments and reservations
/// come first (in the order the replay restores them), and its reservations are live from the start.
pub fn recorded_placement_from(trace: &[TraceEntry], device_memory: u64, initial: Option<&InitialState>) -> Placement {
    let reservation = (device_memory + device_memory / 8).div_ceil(2 << 20) * (2 << 20);
    let mut segments = Vec::new();
    let mut reservations: Vec<u64> = Vec::new();
    // Live reservations: (base, mapped bytes).
    let mut live: Vec<(u64, u64)> = Vec::new();
    if let Some(init) = initial {
        let (segs, res) = init.placement_lists();
        segments.extend(segs);
        reservations.extend(&res);
        for s in init.segments.iter().filter(|s| s.expandable) {
            live.push((s.addr, s.size));
        }
    }
    for e in trace {
        match e.action {
            Action::SegmentAlloc => segments.push((e.addr, e.size)),
            Action::SegmentMap => match live.iter_mut().find(|(b, _)| e.addr >= *b && e.addr < *b + reservation) {
                Some(r) => r.1 += e.size,
                None => {
                    reservations.push(e.addr);
                    live.push((e.addr, e.size));
                }
            },
            Action::SegmentUnmap => {
                if let Some(i) = live.iter().position(|(b, _)| e.addr >= *b && e.addr < *b + reservation) {
                    live[i].1 = live[i].1.saturating_sub(e.size);
                    if live[i].1 == 0 {
                        live.remove(i);
                    }
                }
            }
            _ => {}
        }
    }
    Placement::Recorded { segments, reservations }
}

/// The placements `--placements N` tries, in order: the recorded run's addresses, ascending,
/// descending, lowest fit, then seeded random ones.
pub fn plausible_placements(trace: &[TraceEntry], device_memory: u64, n: usize) -> Vec<(String, Placement)> {
    plausible_placements_from(trace, device_memory, n, None)
}

/// [`plausible_placements`] of a trace that starts from `initial`.
pub fn plausible_placements_from(trace: &[TraceEntry], device_memory: u64, n: usize, initial: Option<&InitialState>) -> Vec<(String, Placement)> {
    let mut v = vec![
        ("recorded".to_string(), recorded_placement_from(trace, device_memory, initial)),
        ("ascending".to_string(), Placement::Ascending),
        ("descending".to_string(), Placement::Descending),
        ("lowest-fit".to_string(), Placement::LowestFit),
    ];
    let mut seed = 1;
    while v.len() < n {
        v.push((format!("random-{seed}"), Placement::Random(seed)));
        seed += 1;
    }
    v.truncate(n);
    v
}
