//! A replay measured per iteration and region.
//!
//! Peaks are PyTorch's: `allocated_bytes.all` and `reserved_bytes.all` after every op of the
//! replay, the maximum over a stretch of the trace including the level it starts at — what
//! `torch.cuda.reset_peak_memory_stats()` at the stretch's start and `max_memory_allocated()` /
//! `max_memory_reserved()` at its end would read. Where the peak was first reached is the request
//! then being served (`None` when the stretch never rose above its starting level).
//!
//! The live blocks at an iteration's peak are summed by the call site of the request that
//! allocated them (blocks from before a truncated trace count apart); they take a second replay.

use std::collections::HashMap;

use allocsim_model::{AllocatorConfig, Placement, SimDevice};
use allocsim_replay::{Op, Prepared, ReplayOptions, ReplayOutcome, replay_observed};
use allocsim_trace::StackId;

use crate::layout::{Layout, Source, Span};

/// Live blocks of one call site.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct SiteBytes {
    pub call_site: String,
    pub blocks: u32,
    pub bytes: u64,
}

/// What one stretch of the trace (an iteration, a region) holds and came to under the replayed
/// config.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Peaks {
    pub first_request: Option<u32>,
    pub last_request: Option<u32>,
    pub requests: u32,
    pub start_us: i64,
    pub end_us: i64,
    pub peak_allocated: u64,
    pub peak_reserved: u64,
    /// The request at which `peak_allocated` was first reached.
    pub peak_request: Option<u32>,
    /// The time the trace recorded for that request.
    pub peak_us: Option<i64>,
    pub peak_reserved_request: Option<u32>,
    /// Allocated bytes when `peak_reserved` was reached (reserved − this is what the allocator held
    /// unallocated at its largest).
    pub allocated_at_peak_reserved: u64,
    /// `segment_alloc`/`segment_map` events and their bytes.
    pub new_segments: u32,
    pub new_segment_bytes: u64,
    pub ooms: u32,
    pub first_oom: Option<u32>,
}

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Iteration {
    pub index: usize,
    pub complete: bool,
    #[serde(flatten)]
    pub peaks: Peaks,
    /// Change of `peak_allocated` / `peak_reserved` from the previous iteration.
    pub delta_peak_allocated: Option<i64>,
    pub delta_peak_reserved: Option<i64>,
    /// Live blocks at the peak by call site, most bytes first (the first `top_sites`).
    pub live_at_peak: Vec<SiteBytes>,
    /// This iteration holds the run's peak allocated (the first one to reach it).
    pub global_peak: bool,
    /// This iteration holds the run's peak reserved (the first one to reach it).
    pub global_peak_reserved: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Region {
    pub name: String,
    pub iteration: Option<usize>,
    pub depth: u32,
    #[serde(flatten)]
    pub peaks: Peaks,
    pub open_start: bool,
    pub open_end: bool,
}

/// One replay measured by phase.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Phases {
    pub device: usize,
    pub source: Source,
    /// The replay's peaks (`memory_stats()`'s `.peak` values).
    pub peak_allocated: u64,
    pub peak_reserved: u64,
    /// The iteration holding the run's peak allocated / reserved.
    pub peak_iteration: Option<usize>,
    pub peak_reserved_iteration: Option<usize>,
    pub ooms: usize,
    pub first_oom: Option<u32>,
    pub requests: usize,
    pub iterations: Vec<Iteration>,
    pub regions: Vec<Region>,
}

impl Phases {
    /// The iteration holding request `req`.
    pub fn iteration_of_request(&self, req: u32) -> Option<usize> {
        self.iterations.iter().find(|it| it.peaks.first_request.is_some_and(|f| f <= req) && it.peaks.last_request.is_some_and(|l| req <= l)).map(|it| it.index)
    }
}

/// Running maxima of one stretch of ops.
#[derive(Clone, Copy, Debug, Default)]
struct Window {
    start_op: usize,
    end_op: usize,
    allocated: u64,
    reserved: u64,
    allocated_op: Option<usize>,
    reserved_op: Option<usize>,
    allocated_at_reserved: u64,
}

impl Window {
    fn open(&mut self, level: (u64, u64)) {
        self.allocated = level.0;
        self.reserved = level.1;
        self.allocated_at_reserved = level.0;
    }
    fn see(&mut self, oi: usize, level: (u64, u64)) {
        if level.0 > self.allocated {
            self.allocated = level.0;
            self.allocated_op = Some(oi);
        }
        if level.1 > self.reserved {
            self.reserved = level.1;
            self.reserved_op = Some(oi);
            self.allocated_at_reserved = level.0;
        }
    }
}

/// Every window's maxima over one replay: `windows` by start op, `level` the levels after each op.
struct Sweep {
    windows: Vec<Window>,
    /// Window ids by start op.
    order: Vec<usize>,
    next: usize,
    active: Vec<usize>,
    prev: (u64, u64),
}

impl Sweep {
    fn new(windows: Vec<Window>, initial: (u64, u64)) -> Sweep {
        let mut order: Vec<usize> = (0..windows.len()).collect();
        order.sort_by_key(|&w| windows[w].start_op);
        Sweep { windows, order, next: 0, active: Vec::new(), prev: initial }
    }

    /// Opens the windows that start at op `oi` (at the level before it).
    fn open_until(&mut self, oi: usize) {
        while let Some(&w) = self.order.get(self.next) {
            if self.windows[w].start_op > oi {
                break;
            }
            self.windows[w].open(self.prev);
            if self.windows[w].end_op > self.windows[w].start_op {
                self.active.push(w);
            }
            self.next += 1;
        }
    }

    /// Op `oi` left the allocator at `level`.
    fn step(&mut self, oi: usize, level: (u64, u64)) {
        self.open_until(oi);
        let windows = &mut self.windows;
        self.active.retain(|&w| {
            windows[w].see(oi, level);
            windows[w].end_op > oi + 1
        });
        self.prev = level;
    }

    fn finish(mut self) -> Vec<Window> {
        self.open_until(usize::MAX);
        self.windows
    }
}

/// Replays `prepared` under `config`, `capacity` (`None`: the trace's own budget, see
/// `Prepared::limits`) and `placement` and measures every iteration and region of `layout`;
/// `top_sites`: how many call sites to list at each iteration's peak (0: none, and no second
/// replay).
pub fn measure(prepared: &Prepared, layout: &Layout, config: &AllocatorConfig, capacity: Option<u64>, placement: &Placement, top_sites: usize) -> Phases {
    let program = &prepared.program;
    let op_index = program.op_trace_indices(&prepared.trace, &prepared.segments);
    let op_at = |entry: u32| op_index.partition_point(|&i| i < entry);
    let window = |s: &Span| Window { start_op: op_at(s.start_entry), end_op: op_at(s.end_entry), ..Window::default() };
    let spans: Vec<&Span> = layout.iterations.iter().map(|i| &i.span).chain(layout.regions.iter().map(|r| &r.span)).collect();
    let initial = program.initial.as_ref().map_or((0, 0), |s| (s.allocated_bytes(), s.reserved_bytes()));
    let mut sweep = Sweep::new(spans.iter().map(|s| window(s)).collect(), initial);
    // The limits every command replays under: `capacity` when given, else the trace's own budget.
    let opts = prepared.options(config, &prepared.limits(capacity), placement.clone());
    let flags = &prepared.empty_cache;
    let outcome = replay_observed(
        program,
        &opts,
        SimDevice::new(prepared.device_memory, placement.clone()),
        |_, oi| flags.get(oi).copied().unwrap_or(false),
        |a, oi| {
            let s = &a.stats;
            sweep.step(oi, (s.allocated_bytes.all().current as u64, s.reserved_bytes.all().current as u64));
        },
    );
    let windows = sweep.finish();
    let request_of = |op: Option<usize>| match op.map(|o| program.ops[o]) {
        Some(Op::Malloc(q)) => Some(q),
        _ => None,
    };
    let time_of = |q: u32| prepared.trace.get(program.requests[q as usize].trace_index as usize).map(|e| e.time_us);
    // Segment growth and OOMs by request, for counting per request range.
    let grow: Vec<(u32, u64)> = outcome.segment_events.iter().filter(|e| e.action.reserves()).map(|e| (e.request, e.size)).collect();
    let ooms: Vec<u32> = outcome.ooms.iter().map(|o| o.request).collect();
    let peaks = |w: &Window, s: &Span| -> Peaks {
        let g = &grow[grow.partition_point(|g| g.0 < s.request_start)..grow.partition_point(|g| g.0 < s.request_end)];
        let o = &ooms[ooms.partition_point(|&q| q < s.request_start)..ooms.partition_point(|&q| q < s.request_end)];
        let peak_request = request_of(w.allocated_op);
        let range = s.request_range();
        Peaks {
            first_request: range.map(|r| r.0),
            last_request: range.map(|r| r.1),
            requests: s.requests(),
            start_us: s.start_us,
            end_us: s.end_us,
            peak_allocated: w.allocated,
            peak_reserved: w.reserved,
            peak_request,
            peak_us: peak_request.and_then(time_of),
            peak_reserved_request: request_of(w.reserved_op),
            allocated_at_peak_reserved: w.allocated_at_reserved,
            new_segments: g.len() as u32,
            new_segment_bytes: g.iter().map(|g| g.1).sum(),
            ooms: o.len() as u32,
            first_oom: o.first().copied(),
        }
    };
    let n_it = layout.iterations.len();
    let mut iterations: Vec<Iteration> = layout
        .iterations
        .iter()
        .zip(&windows[..n_it])
        .map(|(it, w)| Iteration {
            index: it.index,
            complete: it.complete,
            peaks: peaks(w, &it.span),
            delta_peak_allocated: None,
            delta_peak_reserved: None,
            live_at_peak: Vec::new(),
            global_peak: false,
            global_peak_reserved: false,
        })
        .collect();
    for i in 1..iterations.len() {
        let (a, b) = (&iterations[i - 1].peaks, &iterations[i].peaks);
        let d = (b.peak_allocated as i64 - a.peak_allocated as i64, b.peak_reserved as i64 - a.peak_reserved as i64);
        iterations[i].delta_peak_allocated = Some(d.0);
        iterations[i].delta_peak_reserved = Some(d.1);
    }
    let max_a = iterations.iter().map(|i| i.peaks.peak_allocated).max();
    let max_r = iterations.iter().map(|i| i.peaks.peak_reserved).max();
    let peak_iteration = iterations.iter().position(|i| Some(i.peaks.peak_allocated) == max_a);
    let peak_reserved_iteration = iterations.iter().position(|i| Some(i.peaks.peak_reserved) == max_r);
    if let Some(i) = peak_iteration {
        iterations[i].global_peak = true;
    }
    if let Some(i) = peak_reserved_iteration {
        iterations[i].global_peak_reserved = true;
    }
    if top_sites > 0 {
        let at: Vec<Option<usize>> = windows[..n_it].iter().map(|w| w.allocated_op).collect();
        let sites = live_sites_at(prepared, &opts, &outcome, &at, top_sites);
        for (it, s) in iterations.iter_mut().zip(sites) {
            it.live_at_peak = s;
        }
    }
    let regions = layout
        .regions
        .iter()
        .zip(&windows[n_it..])
        .map(|(r, w)| Region {
            name: r.name.clone(),
            iteration: r.iteration,
            depth: r.depth,
            peaks: peaks(w, &r.span),
            open_start: r.open_start,
            open_end: r.open_end,
        })
        .collect();
    let s = &outcome.stats;
    Phases {
        device: prepared.device,
        source: layout.source.clone(),
        peak_allocated: s.allocated_bytes.all().peak as u64,
        peak_reserved: s.reserved_bytes.all().peak as u64,
        peak_iteration,
        peak_reserved_iteration,
        ooms: outcome.ooms.len(),
        first_oom: outcome.first_oom(),
        requests: program.requests.len(),
        iterations,
        regions,
    }
}

/// The live blocks by call site just after each op of `at` (`None`: nothing), replaying again;
/// `first`'s addresses tell whose each block is.
fn live_sites_at(prepared: &Prepared, opts: &ReplayOptions, first: &ReplayOutcome, at: &[Option<usize>], top: usize) -> Vec<Vec<SiteBytes>> {
    let program = &prepared.program;
    let mut wanted: HashMap<usize, Vec<usize>> = HashMap::new();
    for (i, op) in at.iter().enumerate() {
        if let Some(op) = op {
            wanted.entry(*op).or_default().push(i);
        }
    }
    let mut out: Vec<Vec<SiteBytes>> = vec![Vec::new(); at.len()];
    if wanted.is_empty() {
        return out;
    }
    let mut owner: HashMap<u64, u32> = HashMap::new();
    let mut site_of: HashMap<StackId, String> = HashMap::new();
    let flags = &prepared.empty_cache;
    replay_observed(
        program,
        opts,
        SimDevice::new(prepared.device_memory, opts.placement.clone()),
        |_, oi| flags.get(oi).copied().unwrap_or(false),
        |a, oi| {
            match program.ops[oi] {
                Op::Malloc(q) => {
                    if let Some(addr) = first.addresses.get(q as usize).copied().flatten() {
                        owner.insert(addr, q);
                    }
                }
                Op::Free { req, .. } => {
                    if let Some(addr) = first.addresses.get(req as usize).copied().flatten() {
                        owner.remove(&addr);
                    }
                }
                _ => {}
            }
            let Some(its) = wanted.get(&oi) else { return };
            let mut by: HashMap<String, (u32, u64)> = HashMap::new();
            for (_, b) in a.live_blocks().filter(|(_, b)| b.allocated) {
                let site = match owner.get(&b.ptr) {
                    Some(&q) => {
                        let stack = program.requests[q as usize].stack;
                        site_of.entry(stack).or_insert_with(|| prepared.call_site(q).unwrap_or_else(|| "(no stack recorded)".to_string())).clone()
                    }
                    None => "(allocated before the trace)".to_string(),
                };
                let e = by.entry(site).or_default();
                e.0 += 1;
                e.1 += b.size;
            }
            let mut v: Vec<SiteBytes> = by.into_iter().map(|(call_site, (blocks, bytes))| SiteBytes { call_site, blocks, bytes }).collect();
            v.sort_by(|x, y| y.bytes.cmp(&x.bytes).then_with(|| x.call_site.cmp(&y.call_site)));
            v.truncate(top);
            for &i in its {
                out[i] = v.clone();
            }
        },
    );
    out
}
