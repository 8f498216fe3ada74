//! `allocsim export`: a simulated run written back as a memory snapshot, so a what-if state opens in
//! the tools people already use (`torch.cuda._memory_viz`, memory_viz). The trace holds the
//! simulated `alloc`/`free_requested`/`free_completed`/`segment_*`/`oom` entries in the order the
//! model made them, with the model's addresses and the original stacks and times; `segments` holds
//! the model's final segments and blocks. An `alloc`/`oom` entry keeps its recorded
//! `compile_context` and `user_metadata`; the other entries take the time and metadata of the
//! latest request (the trace does not tie a free to its own entry). The `external_annotations`
//! the replay kept (`Prepared::annotations`: the device's) are kept as recorded (their times are
//! the original run's, which the entries keep too).

use std::collections::HashMap;

use allocsim_model::allocator::MempoolId;
use allocsim_model::{AllocatorConfig, Placement, SimDevice};
use allocsim_replay::live::{block_state, live_requests};
use allocsim_replay::oom::device_free_estimate;
use allocsim_replay::{Op, Prepared, replay_observed};
use allocsim_trace::{Action, BlockState, RecordedSettings, Snapshot, SnapshotBlock, SnapshotSegment, TraceEntry};

/// `allocator_settings` as torch 2.11 records `config` (what a run under it would write).
pub fn recorded_settings(config: &AllocatorConfig) -> RecordedSettings {
    let mut rpd = Vec::new();
    for (i, &d) in config.roundup_power2_divisions.iter().enumerate() {
        rpd.push((1u64 << i, d));
    }
    RecordedSettings {
        alloc_conf: Some(config.source.clone()),
        max_split_size: Some(if config.max_split_size == u64::MAX { -1 } else { config.max_split_size as i64 }),
        garbage_collection_threshold: Some(config.garbage_collection_threshold),
        expandable_segments: Some(config.expandable_segments),
        roundup_power2_divisions: rpd,
        present: true,
        keys: None,
    }
}

/// Replays `prepared` under `config` and writes the run as a snapshot of device `prepared.device`.
pub fn simulated_snapshot(prepared: &Prepared, config: &AllocatorConfig, capacity: Option<u64>, placement: &Placement) -> Snapshot {
    let opts = prepared.options(config, &prepared.limits(capacity), placement.clone());
    let device = SimDevice::new(prepared.device_memory, placement.clone());
    let flags = &prepared.empty_cache;
    // Segment events made by each op: every event bumps num_device_alloc or num_device_free.
    let mut events_after: Vec<usize> = Vec::with_capacity(prepared.program.ops.len());
    let outcome = replay_observed(
        &prepared.program,
        &opts,
        device,
        |_, oi| flags.get(oi).copied().unwrap_or(false),
        |a, _| events_after.push((a.stats.num_device_alloc + a.stats.num_device_free) as usize),
    );
    let own = prepared.is_own(config, capacity);
    let reqs = &prepared.program.requests;
    let oom_at: HashMap<u32, &allocsim_replay::replay::Oom> = outcome.ooms.iter().map(|o| (o.request, o)).collect();
    let mut trace = Vec::new();
    let mut time = prepared.trace.first().map_or(0, |e| e.time_us);
    let mut deferred: HashMap<u32, bool> = HashMap::new();
    let mut ev = 0usize;
    let mut meta = 0;
    let entry = |action, addr, size, stream, time_us, stack, meta| TraceEntry { action, addr, size, stream, time_us, stack, meta };
    for (oi, op) in prepared.program.ops.iter().enumerate() {
        let stream_of = |r: u32| reqs[r as usize].stream;
        if let Op::Malloc(r) = *op
            && let Some(e) = prepared.trace.get(reqs[r as usize].trace_index as usize)
        {
            time = time.max(e.time_us);
            meta = e.meta;
        }
        let end = events_after.get(oi).copied().unwrap_or(ev);
        for e in &outcome.segment_events[ev..end] {
            let action = e.action;
            trace.push(entry(action, e.addr, e.size, e.stream, time, 0, meta));
        }
        ev = end;
        match *op {
            Op::Malloc(r) => {
                let q = &reqs[r as usize];
                match (outcome.addresses[r as usize], oom_at.get(&r)) {
                    (Some(a), _) => trace.push(entry(Action::Alloc, a, q.size, q.stream, time, q.stack, meta)),
                    (None, Some(o)) => {
                        let free = device_free_estimate(&prepared.trace, q, &o.info, own, prepared.device_memory, !opts.outside.is_empty());
                        trace.push(entry(Action::Oom, free, o.info.rounded_size, q.stream, time, q.stack, meta));
                    }
                    (None, None) => {}
                }
            }
            Op::Free { req, deferred: d } => {
                if let Some(a) = outcome.addresses[req as usize] {
                    let q = &reqs[req as usize];
                    trace.push(entry(Action::FreeRequested, a, q.size, stream_of(req), time, q.stack, meta));
                    if d {
                        deferred.insert(req, true);
                    } else {
                        trace.push(entry(Action::FreeCompleted, a, q.size, stream_of(req), time, q.stack, meta));
                    }
                }
            }
            Op::Complete(req) if deferred.remove(&req).is_some() => {
                let q = &reqs[req as usize];
                trace.push(entry(Action::FreeCompleted, outcome.addresses[req as usize].unwrap(), q.size, q.stream, time, q.stack, meta));
            }
            // Release runs made only the segment events written above; frees of blocks from before
            // a truncated trace are not written (their allocation is not in the trace either).
            _ => {}
        }
    }
    // Final segments with the model's blocks; live blocks keep their request's stack.
    let a = &outcome.allocator;
    let live_stack: HashMap<u64, u32> =
        live_requests(&prepared.program.ops, &outcome.addresses).into_iter().map(|(q, addr)| (addr, reqs[q as usize].stack)).collect();
    let device = prepared.device as i64;
    let segments = a
        .segments()
        .into_iter()
        .map(|s| {
            let mut blocks = Vec::new();
            let (mut allocated, mut active, mut requested) = (0, 0, 0);
            for &id in &s.blocks {
                let b = a.block(id);
                let state = block_state(b);
                if b.allocated {
                    allocated += b.size;
                }
                if state != BlockState::Inactive {
                    active += b.size;
                    requested += b.requested_size;
                }
                let stack = if b.allocated { live_stack.get(&b.ptr).copied().unwrap_or(0) } else { 0 };
                blocks.push(SnapshotBlock { address: b.ptr, size: b.size, requested_size: b.requested_size, state, stack });
            }
            let pool_id: MempoolId = s.pool_id;
            SnapshotSegment {
                device,
                address: s.address,
                total_size: s.total_size,
                allocated_size: allocated,
                active_size: active,
                requested_size: requested,
                stream: s.stream,
                is_small: s.is_small,
                pool_id,
                is_expandable: s.is_expandable,
                blocks,
            }
        })
        .collect();
    let mut device_traces = vec![Vec::new(); prepared.device + 1];
    device_traces[prepared.device] = trace;
    Snapshot {
        segments,
        device_traces,
        settings: recorded_settings(config),
        stacks: prepared.stacks.clone(),
        annotations: prepared.annotations.clone(),
        entry_metas: prepared.entry_metas.clone(),
        segments_only: false,
    }
}
