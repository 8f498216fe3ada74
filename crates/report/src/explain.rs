//! `allocsim explain`: why a request ran out of memory (or what the allocator did for any request,
//! or at the peak), with exact numbers, and which settings would have avoided it.

use std::collections::HashMap;

use allocsim_model::allocator::CachingAllocator;
use allocsim_model::allocator::{AllocFailure, MallocStep, OutOfMemory};
use allocsim_model::format::oom_message;
use allocsim_model::{AllocatorConfig, Device, Placement, SimDevice};
use allocsim_phases::{Layout, PhaseAt};
use allocsim_replay::{EmptyCacheCalls, Op, Prepared, Program, replay};
use allocsim_trace::Frame;
use allocsim_whatif::fit::fit_where;
use rayon::prelude::*;

use crate::frag::{FreeBreakdown, breakdown};

/// Which moment to explain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum At {
    /// The first request that runs out of memory.
    FirstOom,
    /// The OOM that ended the run ([`ending_oom`]).
    EndingOom,
    /// Request N (0-based, as in `replay --json`), explained as the allocator served it.
    Request(u32),
    /// Just after the request at which reserved memory peaked.
    Peak,
}

/// A live block and where it came from.
#[derive(Clone, Debug, serde::Serialize)]
pub struct LiveBlock {
    pub request: u32,
    pub size: u64,
    pub requested: u64,
    pub call_site: Option<String>,
}

/// A segment whose free memory is held by live blocks.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PinnedSegment {
    pub address: u64,
    pub size: u64,
    pub free: u64,
    pub largest_free_block: u64,
    pub stream: u64,
    pub small: bool,
    pub expandable: bool,
    /// The private pool the segment belongs to ((0, 0): the default pools).
    pub pool_id: (i64, i64),
    pub live: Vec<LiveBlock>,
}

/// The live blocks of `pinned` grouped by call site (`name`), each site charged an equal share of
/// its segments' free memory per block, with the whole stack (`frames`) of its first block; most
/// pinned free memory first.
fn pinning_sites(
    pinned: &[PinnedSegment],
    name: impl Fn(&LiveBlock) -> String,
    frames: impl Fn(&PinnedSegment, usize, &LiveBlock) -> Vec<Frame>,
) -> Vec<PinningSite> {
    let mut sites: HashMap<String, PinningSite> = HashMap::new();
    for seg in pinned {
        let share = seg.free / seg.live.len() as u64;
        for (i, b) in seg.live.iter().enumerate() {
            let call_site = name(b);
            let e = sites.entry(call_site.clone()).or_insert_with(|| PinningSite {
                call_site,
                frames: frames(seg, i, b),
                blocks: 0,
                live_bytes: 0,
                pinned_free: 0,
            });
            e.blocks += 1;
            e.live_bytes += b.size;
            e.pinned_free += share;
        }
    }
    let mut sites: Vec<PinningSite> = sites.into_values().collect();
    sites.sort_by(|a, b| b.pinned_free.cmp(&a.pinned_free).then(a.call_site.cmp(&b.call_site)));
    sites
}

/// Live blocks from one call site and the free memory they pin.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PinningSite {
    pub call_site: String,
    /// The whole stack of the first of these blocks (C++ frames included, innermost first).
    pub frames: Vec<Frame>,
    pub blocks: u32,
    pub live_bytes: u64,
    pub pinned_free: u64,
}

/// Another setting tried on the same requests.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Alternative {
    pub conf: String,
    pub capacity: Option<u64>,
    pub first_oom: Option<u32>,
    pub peak_reserved: u64,
    /// The explained request does not run out of memory.
    pub avoids: bool,
    /// The first request that runs out of memory although the recorded run served it (the job
    /// never saw an OOM there, so it would have ended there).
    pub new_oom: Option<u32>,
    /// A fix: the explained request and every request the recorded run served are served.
    pub fixes: bool,
    pub rejected: Option<String>,
    /// The allowed maximum is an inferred interval and this outcome (first OOM) differs between
    /// its ends: the answer depends on where in it the real maximum lies.
    pub depends_on_allowed_maximum: bool,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct Explanation {
    pub request: u32,
    pub orig_size: u64,
    pub rounded_size: u64,
    /// The segment size a new segment for this request would have (`get_allocation_size`).
    pub alloc_size: u64,
    pub small: bool,
    pub stream: u64,
    /// The whole recorded stack, innermost first (C++ frames included when the trace has them).
    pub frames: Vec<Frame>,
    /// The first frame in the user's code (see `allocsim_trace::frames`).
    pub call_site: Option<String>,
    /// The request was recorded as an OOM in the trace.
    pub recorded_oom: bool,
    /// The iteration and annotated regions it falls in (see `allocsim_phases::layout`).
    pub phase: Option<PhaseAt>,
    /// `--at peak` on a trace whose peak reserved is the state it started from (segments reserved
    /// before the history began, never exceeded): that state is explained, before the first op;
    /// `request`'s malloc is not run (no steps, no OOM).
    pub at_start: bool,
    /// Asked for as `--at peak`: the request is the one whose new segment reached the peak reserved.
    pub at_peak: bool,
    #[serde(skip)]
    pub oom: Option<OutOfMemory>,
    /// PyTorch's OOM message, without NVML's per-process sentence (which a trace cannot know).
    pub message: Option<String>,
    #[serde(skip)]
    pub steps: Vec<MallocStep>,
    /// The steps in words.
    pub step_lines: Vec<String>,
    pub free: FreeBreakdown,
    /// Free memory on this request's stream and pool kind (the only memory it could use), and the
    /// largest block there.
    pub usable_free: u64,
    pub usable_largest_block: u64,
    pub pinned: Vec<PinnedSegment>,
    /// The pinning summed by the call site of the live blocks: free memory each site's blocks keep
    /// from being released (a segment's free bytes shared evenly among its live blocks).
    pub pinning_sites: Vec<PinningSite>,
    pub alternatives: Vec<Alternative>,
    /// The smallest allowed maximum (2 MiB steps) under which, with the explained settings, the
    /// explained request and every request the recorded run served are served (OOMs the job
    /// caught and went on after may stay OOMs): what the allocator needed.
    pub smallest_capacity: Option<u64>,
    /// Why it ran out of memory (`None` when it did not).
    pub cause: Option<OomCause>,
    /// The change that avoids it, checked by replaying (`None` when it did not run out of memory).
    pub fix: Option<Fix>,
    /// Candidate settings not tried, and why (the explained settings already have them, or they
    /// provably change nothing here).
    pub not_tried: Vec<String>,
}

/// The one change that avoids an OOM, checked by replaying the same requests.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Fix {
    /// A setting under which the request and every request before it that the recorded run
    /// served are served (the one with the lowest peak reserved of those tried); `conf` is the
    /// whole `PYTORCH_CUDA_ALLOC_CONF`, the explained settings with the change.
    Setting { conf: String, peak_reserved: u64, depends_on_allowed_maximum: bool },
    /// More memory: the smallest allowed maximum (to 2 MiB) under which the request and every
    /// request before it that the recorded run served are served, against what the allocator could hold at the
    /// OOM (`had`: the allowed maximum, or its reserved bytes plus the device's free ones).
    Memory { needed: u64, had: u64 },
    /// No setting tried helps, and no allowed maximum up to the device's memory does.
    Nothing,
}

/// The OOM that ended the run, of the OOMs of `outcome` (a replay of `prepared`). A job cannot
/// have survived an OOM at a request its recorded run served (it never handled one there), so
/// that is the first OOM at such a request; else the last OOM. Under the trace's own settings and
/// budget that is the last OOM the trace recorded: those before it were caught and the job went
/// on (cuDNN retrying with a smaller workspace, a loop that catches the OOM and retries smaller).
pub fn ending_oom(prepared: &Prepared, outcome: &allocsim_replay::ReplayOutcome) -> Option<u32> {
    let recorded = |r: u32| prepared.program.requests.get(r as usize).is_some_and(|q| q.recorded_oom);
    outcome.ooms.iter().map(|o| o.request).find(|&r| !recorded(r)).or_else(|| outcome.ooms.last().map(|o| o.request))
}

/// Whether a replay serves request `req` and every request before it that the recorded run of
/// `prepared` served: up to `req`, its OOMs are all at requests the trace recorded as OOMs (the job
/// caught those and went on). What follows `req` is not asked: after the OOM that ended it, the
/// run under another setting would have gone on its own way. (A request the trace recorded as an
/// OOM that a replay serves stays allocated, since the trace does not say when the job would have
/// freed it: the answer errs on the side of needing more.)
pub fn serves_the_run(prepared: &Prepared, req: u32, outcome: &allocsim_replay::ReplayOutcome) -> bool {
    outcome
        .ooms
        .iter()
        .take_while(|o| o.request <= req)
        .all(|o| o.request != req && prepared.program.requests.get(o.request as usize).is_some_and(|q| q.recorded_oom))
}

/// The settings tried by default as alternatives (on top of the explained settings).
pub const CANDIDATES: &[&str] = &[
    "expandable_segments:True",
    "max_split_size_mb:64",
    "max_split_size_mb:128",
    "max_split_size_mb:256",
    "max_split_size_mb:512",
    "roundup_power2_divisions:4",
    "garbage_collection_threshold:0.6",
    "garbage_collection_threshold:0.8",
    "expandable_segments:True,max_split_size_mb:128",
];

/// The final state of a snapshot as it recorded it, for a snapshot without history (a segments
/// list, or recording off): what is reserved, allocated and free, and the live blocks that keep
/// free memory from being released, by segment and by call site (from the blocks' own stacks).
#[derive(Clone, Debug, serde::Serialize)]
pub struct FinalState {
    pub segments: usize,
    pub reserved: u64,
    pub allocated: u64,
    pub free: u64,
    pub largest_free_block: u64,
    /// Free bytes in segments that live blocks keep from being released.
    pub pinned_free: u64,
    pub pinned: Vec<PinnedSegment>,
    pub pinning_sites: Vec<PinningSite>,
}

/// [`FinalState`] of `prepared`'s device, from the snapshot's final segments.
pub fn final_state(prepared: &Prepared) -> FinalState {
    use allocsim_trace::BlockState;
    let stack = |id: u32| prepared.stacks.get(id as usize).map_or(&[][..], |v| v.as_slice());
    let (mut reserved, mut allocated, mut free, mut largest) = (0, 0, 0, 0);
    let mut pinned = Vec::new();
    for seg in &prepared.segments {
        reserved += seg.total_size;
        let f: u64 = seg.blocks.iter().filter(|b| b.state == BlockState::Inactive).map(|b| b.size).sum();
        let l = seg.blocks.iter().filter(|b| b.state == BlockState::Inactive).map(|b| b.size).max().unwrap_or(0);
        allocated += seg.blocks.iter().filter(|b| b.state == BlockState::ActiveAllocated).map(|b| b.size).sum::<u64>();
        free += f;
        largest = largest.max(l);
        let live: Vec<LiveBlock> = seg
            .blocks
            .iter()
            .filter(|b| b.state != BlockState::Inactive)
            .map(|b| LiveBlock { request: u32::MAX, size: b.size, requested: b.requested_size, call_site: allocsim_trace::frames::call_site(stack(b.stack)) })
            .collect();
        if f > 0 && !live.is_empty() {
            pinned.push(PinnedSegment {
                address: seg.address,
                size: seg.total_size,
                free: f,
                largest_free_block: l,
                stream: seg.stream,
                small: seg.is_small,
                expandable: seg.is_expandable,
                pool_id: seg.pool_id,
                live,
            });
        }
    }
    pinned.sort_by(|a, b| b.free.cmp(&a.free).then(a.address.cmp(&b.address)));
    // The stack of the first live block of each call site, by address.
    let stacks_by_addr: HashMap<u64, u32> =
        prepared.segments.iter().flat_map(|s| s.blocks.iter().filter(|b| b.state != BlockState::Inactive).map(|b| (b.address, b.stack))).collect();
    let addr_of = |seg: &PinnedSegment, i: usize| -> u64 {
        let ps = prepared.segments.iter().find(|s| s.address == seg.address);
        ps.and_then(|s| s.blocks.iter().filter(|b| b.state != BlockState::Inactive).nth(i)).map_or(0, |b| b.address)
    };
    let pinning_sites = pinning_sites(
        &pinned,
        |b| b.call_site.clone().unwrap_or_else(|| "(no stack recorded)".to_string()),
        |seg, i, _| stacks_by_addr.get(&addr_of(seg, i)).map_or(Vec::new(), |&id| stack(id).to_vec()),
    );
    let pinned_free = pinned.iter().map(|s| s.free).sum();
    FinalState { segments: prepared.segments.len(), reserved, allocated, free, largest_free_block: largest, pinned_free, pinned, pinning_sites }
}

fn truncated(p: &Program, ops: usize) -> Program {
    Program { ops: p.ops[..ops].to_vec(), ..p.clone() }
}

/// The allocator just before op `k`, and the live requests with their blocks' addresses.
pub struct State {
    pub allocator: CachingAllocator<SimDevice>,
    /// request → address of its (allocated) block.
    pub live: HashMap<u32, u64>,
}

/// Replays the first `k` ops of `prepared` under `config` and returns the allocator there.
pub fn state_before(prepared: &Prepared, config: &AllocatorConfig, capacity: Option<u64>, placement: &Placement, k: usize) -> State {
    let before = truncated(&prepared.program, k);
    let opts = prepared.options(config, &prepared.limits(capacity), placement.clone());
    let state = replay(&before, &opts, EmptyCacheCalls::Given(&prepared.empty_cache[..k]));
    let live = allocsim_replay::live::live_requests(&before.ops, &state.addresses);
    State { allocator: state.allocator, live }
}

/// The op index of request `req`'s malloc.
pub fn op_index_of_malloc(p: &Program, req: u32) -> Option<usize> {
    p.ops.iter().position(|op| *op == Op::Malloc(req))
}

/// Explains request `at` of `prepared` replayed under `config` and `capacity` with `placement`.
/// Returns `None` when there is nothing to explain (no OOM, or no such request).
pub fn explain(
    prepared: &Prepared,
    config: &AllocatorConfig,
    capacity: Option<u64>,
    placement: &Placement,
    at: At,
    candidates: &[&str],
) -> Option<Explanation> {
    let limits = prepared.limits(capacity);
    let full = prepared.replay_under(config, &limits, placement.clone());
    let (req, include) = match at {
        At::FirstOom => (full.first_oom()?, false),
        At::EndingOom => (ending_oom(prepared, &full)?, false),
        At::Request(n) => (n, false),
        // The request whose events reached the peak.
        At::Peak => (prepared.peak_request(&full, config, &limits, placement.clone()).unwrap_or(0), true),
    };
    // A peak no request raised: the state the trace started from (a mid-history start whose
    // segments no later request grew past) is the peak, shown as it was before the first op.
    let at_start = matches!(at, At::Peak) && full.peak_reserved_request().is_none() && prepared.program.initial.as_ref().is_some_and(|s| !s.is_empty());
    let r = *prepared.program.requests.get(req as usize)?;
    let k = if at_start { 0 } else { op_index_of_malloc(&prepared.program, req)? };
    let State { allocator: mut alloc, mut live } = state_before(prepared, config, capacity, placement, k);
    alloc.events.clear();
    if !limits.outside.is_empty() {
        alloc.device.set_outside_memory(limits.outside.at(req));
    }
    let (steps, oom) = if at_start {
        (Vec::new(), None)
    } else {
        alloc.record_steps = true;
        let result = alloc.malloc(r.size, r.stream, r.route);
        let steps = std::mem::take(&mut alloc.steps);
        alloc.record_steps = false;
        let oom = result.as_ref().err().cloned();
        if let Ok(b) = result
            && include
        {
            live.insert(req, alloc.block(b).ptr);
        }
        (steps, oom)
    };
    let by_ptr: HashMap<u64, u32> = live.iter().map(|(&q, &a)| (a, q)).collect();
    let free = breakdown(&alloc);
    let rounded = config.round_size(r.size);
    let small = rounded <= allocsim_model::constants::K_SMALL_SIZE;
    let (usable_free, usable_largest_block) = free
        .per_pool
        .iter()
        .filter(|p| p.small == small && p.stream == r.stream && (p.pool_id == (0, 0)) == matches!(r.route, allocsim_model::Route::Default))
        .fold((0, 0), |(t, l), p| (t + p.free, l.max(p.largest_free_block)));
    // Segments whose free memory live blocks hold, most free first.
    let mut pinned: Vec<PinnedSegment> = alloc
        .segments()
        .into_iter()
        .filter_map(|seg| {
            let blocks: Vec<_> = seg.blocks.iter().map(|&b| alloc.block(b)).collect();
            let free: u64 = blocks.iter().filter(|b| !b.allocated && b.event_count == 0).map(|b| b.size).sum();
            let largest = blocks.iter().filter(|b| !b.allocated && b.event_count == 0).map(|b| b.size).max().unwrap_or(0);
            let live: Vec<LiveBlock> = blocks
                .iter()
                .filter(|b| b.allocated)
                .map(|b| {
                    let q = by_ptr.get(&b.ptr).copied();
                    LiveBlock { request: q.unwrap_or(u32::MAX), size: b.size, requested: b.requested_size, call_site: q.and_then(|q| prepared.call_site(q)) }
                })
                .collect();
            (free > 0 && !live.is_empty()).then_some(PinnedSegment {
                address: seg.address,
                size: seg.total_size,
                free,
                largest_free_block: largest,
                stream: seg.stream,
                small: seg.is_small,
                expandable: seg.is_expandable,
                pool_id: seg.pool_id,
                live,
            })
        })
        .collect();
    pinned.sort_by(|a, b| b.free.cmp(&a.free).then(a.address.cmp(&b.address)));
    let pinning_sites = pinning_sites(
        &pinned,
        |b| match (&b.call_site, b.request) {
            (Some(c), _) => c.clone(),
            (None, u32::MAX) => "(blocks from before the trace)".to_string(),
            (None, _) => "(no stack recorded)".to_string(),
        },
        |_, _, b| if b.request == u32::MAX { Vec::new() } else { prepared.frames(b.request).to_vec() },
    );
    let own = prepared.is_own(config, capacity);
    let message = oom.as_ref().map(|o| {
        let mut m = o.clone();
        m.device_free = allocsim_replay::oom::device_free_estimate(&prepared.trace, &r, o, own, prepared.device_memory, !limits.outside.is_empty());
        oom_message(&m, prepared.device as i32, "")
    });
    let step_lines = describe_steps(&steps, usable_largest_block);
    // What would have worked: the same requests under other settings (and, where the allowed
    // maximum is an inferred interval, at its two ends too).
    let ends = match (capacity, prepared.budget.allowed_low, prepared.budget.allowed_high) {
        (None, Some(lo), Some(hi)) if prepared.budget.allowed_is_interval() => Some((lo, hi)),
        _ => None,
    };
    let (tried, not_tried) = candidates_to_try(config, candidates, limits.capacity.is_some(), prepared.rules.version);
    let recorded = |r: u32| prepared.program.requests.get(r as usize).is_some_and(|q| q.recorded_oom);
    let mut alternatives: Vec<Alternative> = tried
        .par_iter()
        .map(|(c, parsed)| match parsed {
            Err(e) => Alternative {
                conf: c.to_string(),
                capacity: limits.capacity,
                first_oom: None,
                peak_reserved: 0,
                avoids: false,
                new_oom: None,
                fixes: false,
                rejected: Some(e.to_string()),
                depends_on_allowed_maximum: false,
            },
            Ok(cfg) => {
                let o = prepared.replay_under(cfg, &limits, placement.clone());
                let fixes = serves_the_run(prepared, req, &o);
                let depends = ends.is_some_and(|(lo, hi)| {
                    [lo, hi].iter().any(|&c| {
                        let at = prepared.replay_under(cfg, &prepared.limits_at(c), placement.clone());
                        at.first_oom() != o.first_oom() || serves_the_run(prepared, req, &at) != fixes
                    })
                });
                Alternative {
                    conf: c.to_string(),
                    capacity: limits.capacity,
                    first_oom: o.first_oom(),
                    peak_reserved: o.peak_reserved,
                    avoids: !o.ooms.iter().any(|x| x.request == req),
                    new_oom: o.ooms.iter().map(|x| x.request).find(|&r| !recorded(r)),
                    fixes,
                    rejected: None,
                    depends_on_allowed_maximum: depends,
                }
            }
        })
        .collect();
    // Best first: accepted, a fix, gets past this request, runs longest without OOM, lowest peak.
    alternatives.sort_by_key(|a| (a.rejected.is_some(), !a.fixes, !a.avoids, std::cmp::Reverse(a.first_oom.unwrap_or(u32::MAX)), a.peak_reserved));
    let smallest_capacity = if oom.is_some() { fit_where(prepared, config, placement, |o| serves_the_run(prepared, req, o)).capacity } else { None };
    let cause = oom.as_ref().map(|o| OomCause::of(prepared, req, o));
    let fix = cause.as_ref().map(|c| {
        let best = alternatives.iter().filter(|a| a.fixes).min_by_key(|a| (a.depends_on_allowed_maximum, a.peak_reserved));
        match (best, smallest_capacity) {
            (Some(a), _) => Fix::Setting {
                conf: if config.source.is_empty() { a.conf.clone() } else { format!("{},{}", config.source, a.conf) },
                peak_reserved: a.peak_reserved,
                depends_on_allowed_maximum: a.depends_on_allowed_maximum,
            },
            (None, Some(needed)) => Fix::Memory { needed, had: c.room },
            (None, None) => Fix::Nothing,
        }
    });
    Some(Explanation {
        request: req,
        orig_size: r.size,
        rounded_size: rounded,
        alloc_size: config.get_allocation_size(rounded),
        small,
        stream: r.stream,
        frames: prepared.frames(req).to_vec(),
        call_site: prepared.call_site(req),
        recorded_oom: r.recorded_oom,
        phase: Layout::of(prepared, None).ok().map(|l| l.phase_at(req, r.trace_index)),
        at_start,
        at_peak: matches!(at, At::Peak),
        oom,
        message,
        steps,
        step_lines,
        free,
        usable_free,
        usable_largest_block,
        pinned,
        pinning_sites,
        alternatives,
        smallest_capacity,
        cause,
        fix,
        not_tried,
    })
}

/// A setting to try: its `PYTORCH_CUDA_ALLOC_CONF` text and the parsed settings (or why they do
/// not parse).
pub type Candidate = (String, Result<AllocatorConfig, String>);

/// The candidate settings worth replaying on top of `config`, parsed, and those left out with the
/// reason: one whose settings `config` already has (`expandable_segments:True` on a job that
/// used it), one that parses to settings already listed, and `garbage_collection_threshold`
/// without an allowed maximum (PyTorch runs `garbage_collect_cached_blocks` only when
/// `set_per_process_memory_fraction` was called: it cannot change anything then). Each is parsed
/// as PyTorch `version` parses it (the trace's release).
pub fn candidates_to_try(
    config: &AllocatorConfig,
    candidates: &[&str],
    has_fraction: bool,
    version: allocsim_replay::TorchVersion,
) -> (Vec<Candidate>, Vec<String>) {
    let base = config.source.clone();
    let (mut tried, mut not_tried): (Vec<Candidate>, Vec<String>) = (Vec::new(), Vec::new());
    for c in candidates {
        let conf = if base.is_empty() { c.to_string() } else { format!("{base},{c}") };
        let parsed = version.parse_config(&conf).map_err(|e| e.to_string());
        if let Ok(cfg) = &parsed {
            if allocsim_replay::run::same_settings(cfg, config) {
                not_tried.push(format!("{c}: already in effect"));
                continue;
            }
            if !has_fraction && cfg.garbage_collection_threshold > 0.0 && cfg.garbage_collection_threshold != config.garbage_collection_threshold {
                not_tried.push(format!("{c}: acts only under a memory fraction (set_per_process_memory_fraction), which this run did not have"));
                continue;
            }
            if let Some((same, _)) = tried.iter().find(|(_, t)| t.as_ref().is_ok_and(|t| allocsim_replay::run::same_settings(t, cfg))) {
                not_tried.push(format!("{c}: the same settings as {same} here"));
                continue;
            }
        }
        tried.push((c.to_string(), parsed));
    }
    (tried, not_tried)
}

use allocsim_model::format::format_size as fs;

/// Why one OOM happened, in the terms that tell OOMs apart.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct OomCause {
    pub request: u32,
    /// The request was recorded as an OOM in the trace.
    pub recorded_oom: bool,
    /// The job went on after it: it is an OOM the trace recorded and later requests follow it.
    pub survived: bool,
    /// `"allowed_maximum"` (the fraction check refused) or `"device_full"` (the device had no room).
    pub limit: &'static str,
    /// The live tensors and the request fit in what the allocator could hold (the allowed
    /// maximum, or its reserved bytes plus the device's free ones), only the free memory was not
    /// in one block it could use: fragmentation (else the live tensors themselves left too
    /// little room).
    pub fragmentation: bool,
    pub size: u64,
    pub call_site: Option<String>,
    /// Bytes of live tensors (allocated, in the default and private pools) at the OOM.
    pub live: u64,
    /// Reserved and allocated bytes at the OOM.
    pub reserved: u64,
    pub allocated: u64,
    /// What the device had free at the OOM.
    pub device_free: u64,
    /// The allowed maximum (`set_per_process_memory_fraction`), if any.
    pub allowed: Option<u64>,
    /// What the allocator could have held: the allowed maximum, or its reserved bytes plus what
    /// the device still had free, whichever is less.
    pub room: u64,
}

impl OomCause {
    /// The cause of the OOM of request `request` (with its out-of-memory information `i`).
    pub fn of(prepared: &Prepared, request: u32, i: &OutOfMemory) -> OomCause {
        let over_allowed = i.allowed_memory_maximum.is_some_and(|a| i.reserved_bytes + i.alloc_size > a);
        // Fragmentation: the live tensors and this request fit in what the allocator could
        // hold, only the free memory was not in a block it could use.
        let room = (i.reserved_bytes + i.device_free).min(i.allowed_memory_maximum.unwrap_or(u64::MAX));
        let live = i.allocated_bytes + i.allocated_in_private_pools;
        let recorded_oom = prepared.program.requests.get(request as usize).is_some_and(|r| r.recorded_oom);
        OomCause {
            request,
            recorded_oom,
            survived: recorded_oom && (request as usize) + 1 < prepared.program.requests.len(),
            limit: if over_allowed || i.device_free >= i.alloc_size { "allowed_maximum" } else { "device_full" },
            fragmentation: live + i.rounded_size <= room,
            size: i.rounded_size,
            call_site: prepared.call_site(request),
            live,
            reserved: i.reserved_bytes,
            allocated: i.allocated_bytes,
            device_free: i.device_free,
            allowed: i.allowed_memory_maximum,
            room,
        }
    }

    /// The cause in words (without the request).
    pub fn describe(&self) -> String {
        let limit = if self.limit == "device_full" { "the device was full" } else { "over the allowed maximum" };
        if self.fragmentation {
            format!(
                "{limit}, though the live tensors and this request fit in what the allocator could hold: its free memory was not in one block it could use (fragmentation)"
            )
        } else {
            format!("{limit}: the live tensors and this request need more than the allocator could hold, however its free memory lay")
        }
    }
    /// Whether two OOMs have the same cause (limit and fragmentation).
    pub fn same_cause(&self, other: &OomCause) -> bool {
        self.limit == other.limit && self.fragmentation == other.fragmentation
    }
}

/// The cause of every OOM of `outcome`, a replay of `prepared`.
pub fn oom_causes(prepared: &Prepared, outcome: &allocsim_replay::ReplayOutcome) -> Vec<OomCause> {
    outcome.ooms.iter().map(|o| OomCause::of(prepared, o.request, &o.info)).collect()
}

/// The allocator's steps in words.
pub fn describe_steps(steps: &[MallocStep], usable_largest: u64) -> Vec<String> {
    let mut out = Vec::new();
    for s in steps {
        out.push(match s {
            MallocStep::CacheLookup { found: Some(b), rounded, .. } => {
                format!("found a cached free block of {} for the {} request", fs(*b), fs(*rounded))
            }
            MallocStep::CacheLookup { found: None, rounded, stream, .. } => {
                format!("no cached free block of ≥ {} on stream {stream} in this pool (the largest there is {})", fs(*rounded), fs(usable_largest))
            }
            MallocStep::GarbageCollection { segments, bytes } => {
                format!("garbage collection released {segments} old cached segments ({})", fs(*bytes))
            }
            MallocStep::AllocBlock { is_retry, result } => {
                let what = if *is_retry { "retried a new segment" } else { "asked for a new segment" };
                match result {
                    Ok(n) => format!("{what} of {}: got it", fs(*n)),
                    Err(AllocFailure::OverLimit { total_allocated, alloc_size, allowed }) => format!(
                        "{what} of {}: {} reserved + {} is over the {} allowed by {}",
                        fs(*alloc_size),
                        fs(*total_allocated),
                        fs(*alloc_size),
                        fs(*allowed),
                        fs(total_allocated + alloc_size - allowed)
                    ),
                    Err(AllocFailure::DeviceOutOfMemory { alloc_size, device_free }) => {
                        format!("{what} of {}: the device had only {} free", fs(*alloc_size), fs(*device_free))
                    }
                }
            }
            MallocStep::ReleaseAvailable { segments, bytes, enough } => {
                format!("released {segments} cached oversize segments ({}){}", fs(*bytes), if *enough { "" } else { ": not enough" })
            }
            MallocStep::ReleaseCached { segments, bytes, completed_frees } => format!(
                "synchronized{} and released {segments} completely free cached segments ({})",
                if *completed_frees > 0 { format!(" (completing {completed_frees} pending cross-stream frees)") } else { String::new() },
                fs(*bytes)
            ),
        });
    }
    out
}

/// The explained OOM in at most six lines: which request failed (size, call site, where in the
/// run), which OOM of the trace it is, why in one sentence, the one change that avoids it (checked
/// by replaying), and PyTorch's message.
pub fn verdict_lines(
    x: &Explanation,
    causes: &[OomCause],
    own: bool,
    asked: bool,
    config: &AllocatorConfig,
    capacity: Option<u64>,
    p: &Prepared,
) -> Vec<String> {
    let mut lines = Vec::new();
    let site = x.call_site.as_deref().map_or_else(|| "(no stack recorded)".to_string(), |s| format!("from {s}"));
    let whereabouts = x.phase.as_ref().map(phase_words).unwrap_or_default();
    if x.at_start {
        lines.push(format!(
            "Peak reserved at the start: {} reserved before memory history was turned on, which no request grew past ({} allocated then).",
            fs(x.free.reserved),
            fs(x.free.allocated)
        ));
        return lines;
    }
    if x.message.is_none() && x.at_peak {
        lines.push(format!(
            "Peak reserved: {}, reached by request {}: {} {site}{whereabouts}, served ({} allocated after it).",
            fs(x.free.reserved),
            x.request,
            fs(x.orig_size),
            fs(x.free.allocated)
        ));
        return lines;
    }
    if x.message.is_none() {
        lines.push(format!(
            "Request {}: {} {site}{whereabouts}, served ({} reserved, {} allocated after it).",
            x.request,
            fs(x.orig_size),
            fs(x.free.reserved),
            fs(x.free.allocated)
        ));
        return lines;
    }
    lines.push(format!("Out of memory at request {}: {} {site}{whereabouts}.", x.request, fs(x.orig_size)));
    let recorded: Vec<&OomCause> = causes.iter().filter(|c| c.recorded_oom).collect();
    let this = causes.iter().find(|c| c.request == x.request);
    let survived = recorded.iter().filter(|c| c.survived && c.request != x.request).count();
    let went_on = this.is_some_and(|c| c.survived);
    let which = if asked {
        format!("Request {} as asked{}.", x.request, if x.recorded_oom { "; the trace recorded it as an OOM" } else { "" })
    } else if own && x.recorded_oom {
        let n = recorded.len();
        match (n, went_on) {
            (1, false) => "The only OOM the trace recorded; the run ended there.".to_string(),
            (1, true) => "The only OOM the trace recorded; requests follow it: the job went on after it.".to_string(),
            (_, false) => format!(
                "The last of {n} OOMs the trace recorded, the one that ended the run; the job went on after {} before it (as code that catches an OOM and retries smaller, or cuDNN trying a smaller workspace, does).",
                if survived == n - 1 { "every one".to_string() } else { format!("{survived}") }
            ),
            (_, true) => format!("The last of {n} OOMs the trace recorded; requests follow each of them: the job went on after every one."),
        }
    } else if x.recorded_oom {
        format!(
            "The trace recorded this request as an OOM too; {} replay runs out of memory {} time{}.",
            replay_words(config, capacity),
            causes.len(),
            plural(causes.len())
        )
    } else {
        format!("The recorded run served this request: under {} the job would have ended here.", replay_words(config, capacity))
    };
    lines.push(which);
    if let Some(c) = &x.cause {
        lines.push(format!("Cause: {}", cause_sentence(c, x, p)));
    }
    if let Some(f) = &x.fix {
        lines.push(fix_sentence(f, x, capacity));
    }
    if let Some(m) = &x.message {
        // A message under an allowed maximum inferred as an interval shows the value replayed,
        // which the real message may not have had.
        match (capacity, p.budget.allowed_low, p.budget.allowed_high) {
            (None, Some(lo), Some(hi)) if p.budget.allowed_is_interval() && m.contains(" allowed; ") => {
                lines.push(format!("PyTorch's message (its allowed maximum is inferred, between {} and {}: the value replayed is shown): {m}", fs(lo), fs(hi)))
            }
            _ => lines.push(format!("PyTorch's message: {m}")),
        }
    }
    lines
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

/// "the replay under X" for the settings and budget explained.
fn replay_words(config: &AllocatorConfig, capacity: Option<u64>) -> String {
    let conf = if config.source.is_empty() { "the default settings".to_string() } else { config.source.clone() };
    match capacity {
        Some(c) => format!("the replay under {conf} with {} allowed,", fs(c)),
        None => format!("the replay under {conf}"),
    }
}

/// ", in iteration i of n (how known), inside a › b" where the trace shows them.
fn phase_words(ph: &PhaseAt) -> String {
    use allocsim_phases::Source;
    let regions = if ph.regions.is_empty() { String::new() } else { format!(", inside {}", ph.regions.join(" › ")) };
    let iteration = match (&ph.source, ph.iteration) {
        (Source::Annotation { .. } | Source::Pattern { .. }, Some(i)) if ph.complete => format!(", in iteration {i} of {}", ph.iterations),
        (Source::Annotation { .. } | Source::Pattern { .. }, Some(_)) => format!(", after the last of {} iterations", ph.iterations),
        _ => String::new(),
    };
    format!("{iteration}{regions}")
}

/// Why the OOM happened, in one sentence: fragmentation, a larger need than the allowed maximum,
/// or memory held outside the allocator.
fn cause_sentence(c: &OomCause, x: &Explanation, p: &Prepared) -> String {
    let pool = if x.small { "small" } else { "large" };
    if c.fragmentation {
        return format!(
            "fragmentation. {} was reserved but unallocated, yet no free block of {} fit on stream {} in the {pool} pool (the largest there was {}), and the free memory could not be released: live blocks pin it. The live tensors ({}) and this request fit in the {} the allocator could hold.",
            fs(c.reserved.saturating_sub(c.allocated)),
            fs(x.rounded_size),
            x.stream,
            fs(x.usable_largest_block),
            fs(c.live),
            fs(c.room)
        );
    }
    if c.limit == "device_full" {
        let total_known = p.budget.device_memory.source != allocsim_replay::budget::DeviceMemorySource::Default;
        let outside = if total_known {
            format!(
                " and {} of the device's {} was in use outside PyTorch's allocator (other processes, the CUDA context, libraries)",
                fs(p.device_memory.saturating_sub(c.room)),
                fs(p.device_memory)
            )
        } else {
            " and the rest was in use outside PyTorch's allocator (other processes, the CUDA context, libraries)".to_string()
        };
        return format!(
            "the device was full. It had {} free{outside}; the allocator could hold {} ({} reserved + {} free), less than the live tensors ({}) and this request ({}) need.",
            fs(c.device_free),
            fs(c.room),
            fs(c.reserved),
            fs(c.device_free),
            fs(c.live),
            fs(x.alloc_size)
        );
    }
    format!(
        "the job needs more than its allowed maximum. The live tensors ({}) and this request ({}) come to more than the {} allowed (set_per_process_memory_fraction), however the free memory lay.",
        fs(c.live),
        fs(x.rounded_size),
        fs(c.allowed.unwrap_or(c.room))
    )
}

/// The one change that avoids the OOM, checked by replaying.
fn fix_sentence(f: &Fix, x: &Explanation, capacity: Option<u64>) -> String {
    let served = "this request and every one before it that the recorded run served are served";
    match f {
        Fix::Setting { conf, peak_reserved, depends_on_allowed_maximum } => {
            format!(
                "Fix (checked by replaying the same requests): PYTORCH_CUDA_ALLOC_CONF={conf} — {served}; peak reserved {}{}.",
                fs(*peak_reserved),
                if *depends_on_allowed_maximum { " (for part of the inferred interval of the allowed maximum only)" } else { "" }
            )
        }
        Fix::Memory { needed, had } => {
            let more = fs(needed.saturating_sub(*had));
            let device_full = x.cause.as_ref().is_some_and(|c| c.limit == "device_full") && capacity.is_none();
            let how = if device_full {
                format!(
                    "{} for the allocator ({more} more than it could hold: free that much on the device, or run on a larger one — `allocsim fit --cards`)",
                    fs(*needed)
                )
            } else {
                format!("an allowed maximum of {} ({more} more than {})", fs(*needed), fs(*had))
            };
            format!("Fix (checked by replaying the same requests): no setting tried helps; {how} — {served}.")
        }
        Fix::Nothing => "Fix: none found. No setting tried helps, and no allowed maximum up to the device's memory serves the run.".to_string(),
    }
}
