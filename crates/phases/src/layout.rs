//! Where a trace's iterations and annotated regions are.
//!
//! # Annotations on the trace
//!
//! An annotation (`external_annotations`, torch ≥ 2.5) carries a time on the same clock as the
//! trace entries' `time_us`, not a position in the trace. It is placed among the entries of its
//! device by time: a `START` before every entry of the same microsecond or later, an `END` after
//! every entry of the same microsecond or earlier, so entries that share a microsecond with a
//! boundary count as inside the scope. (torch records both from the same clock; ties are rare.)
//!
//! # Iterations
//!
//! * By the optimizer (the default): an iteration ends at the `END` of each `Optimizer.step#…`
//!   annotation (torch's optimizers wrap `step()` in `record_function("Optimizer.step#AdamW.step")`
//!   and friends). The first iteration starts at the trace's first entry, so setup work (model
//!   creation) counts in it; the requests after the last `END`, if any, form a final partial
//!   iteration (`complete: false`).
//! * `--by NAME`: the same with the annotations named `NAME`, or `NAME#…` (so `Optimizer.step`
//!   matches every optimizer's step).
//! * Without annotations (or when none is an optimizer step): the repeating request pattern.
//!   Each request gets a signature (its stack when the trace recorded stacks, else its size); a
//!   signature is a candidate when it occurs at least three times (five for sizes), from its first to its last
//!   occurrence over at least half the requests, at regular distances: their median at least 2,
//!   none after the first over 1.5× the median, the first not over 3× (the first step also makes
//!   the optimizer's state) nor under the median / 1.5, and at most one in ten of the others (at
//!   least one) under the median / 1.5 (an iteration cut short by an OOM it caught). A number
//!   of repeats is tried when at least two candidates share it (a lone signature repeating at
//!   regular distances happens by chance in long random traces), the fewest first (the coarsest
//!   repetition: a training step before the layers repeated inside it); of the candidates with
//!   that count the one that comes earliest in each repetition marks where an iteration starts
//!   (the first iteration takes in what comes before its first occurrence). The repeats are
//!   iterations only when they are alike (at least half the requests after the first repeat have
//!   a signature found in at least half of the repeats) and return to the same live memory (the
//!   bytes held at the starts of the repeats after the first differ by at most a quarter of how
//!   far a repeat rises above its start: a job's steps free what they make, but the layers of one
//!   forward pass keep their activations). No such repeats: one iteration, the whole trace, and
//!   only the annotated regions.
//!
//! # Regions
//!
//! Every `START`/`END` pair of one name (nested same-name scopes pair innermost first) is a region,
//! in the iteration where it starts. A `START` without its `END` (the snapshot was taken inside
//! the scope) runs to the trace's end (`open_end`); an `END` without its `START` (the annotations'
//! ring buffer dropped it) starts at the trace's start (`open_start`). `depth` counts the regions
//! that enclose it.

use std::collections::HashMap;

use allocsim_replay::{Prepared, Request};
use allocsim_trace::{Annotation, TraceEntry};

/// The optimizer's step scope, as torch names it (`Optimizer.step#AdamW.step`).
pub const OPTIMIZER_STEP: &str = "Optimizer.step";

/// How the iterations were found.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Source {
    /// Each iteration ends at the `END` of one of these annotations.
    Annotation { names: Vec<String> },
    /// A request that comes once per iteration marks where each starts (see the module
    /// documentation): its call site and size, its first occurrence, and how many times it came;
    /// between repeats the live memory returns to the same level: `live_spread`, the most the
    /// live bytes at the starts of the repeats after the first differ, against `median_rise`, the
    /// median of how far each repeat rises above its start.
    Pattern { marker: String, marker_request: u32, repeats: usize, live_spread: u64, median_rise: u64 },
    /// No iterations found: one, the whole trace.
    Whole { reason: String },
}

/// A stretch of one device's trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Span {
    /// Trace entries `start_entry..end_entry`.
    pub start_entry: u32,
    pub end_entry: u32,
    /// Requests (ordinals of `alloc`/`oom` entries) `request_start..request_end`.
    pub request_start: u32,
    pub request_end: u32,
    pub start_us: i64,
    pub end_us: i64,
}

impl Span {
    pub fn requests(&self) -> u32 {
        self.request_end - self.request_start
    }

    /// The first and last request, `None` when it holds none.
    pub fn request_range(&self) -> Option<(u32, u32)> {
        (self.request_end > self.request_start).then(|| (self.request_start, self.request_end - 1))
    }

    pub fn contains_entry(&self, entry: u32) -> bool {
        self.start_entry <= entry && entry < self.end_entry
    }
}

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct IterationSpan {
    pub index: usize,
    #[serde(flatten)]
    pub span: Span,
    /// Ends with its iteration's boundary (the annotation's `END`, or the next repetition); false
    /// for the requests after the last one.
    pub complete: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct RegionSpan {
    pub name: String,
    /// The iteration it starts in.
    pub iteration: Option<usize>,
    /// How many regions enclose it.
    pub depth: u32,
    #[serde(flatten)]
    pub span: Span,
    /// Its `START` is not in the snapshot: it starts at the trace's start.
    pub open_start: bool,
    /// Its `END` is not in the snapshot: it runs to the trace's end.
    pub open_end: bool,
}

/// The iterations and regions of one device's trace.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Layout {
    pub source: Source,
    pub iterations: Vec<IterationSpan>,
    pub regions: Vec<RegionSpan>,
}

/// Where one request falls.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct PhaseAt {
    pub iteration: Option<usize>,
    pub iterations: usize,
    /// That iteration ends with its boundary (false: the requests after the last one).
    pub complete: bool,
    /// The regions holding it, outermost first.
    pub regions: Vec<String>,
    pub source: Source,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    #[error("--by {name:?}: no annotation of that name on this device (it has {})", if .names.is_empty() { "no annotations".to_string() } else { .names.join(", ") })]
    NoSuchAnnotation { name: String, names: Vec<String> },
}

/// Whether annotation `name` is `by`, or `by#…`.
fn matches(name: &str, by: &str) -> bool {
    name == by || name.strip_prefix(by).is_some_and(|rest| rest.starts_with('#'))
}

/// One annotation placed on the trace.
#[derive(Clone, Copy, Debug)]
struct Placed<'a> {
    name: &'a str,
    start: bool,
    /// Trace position: the entries before it.
    pos: u32,
    time_us: i64,
}

/// Places `annotations` (with a `name` and a `stage` of `START`/`END`; others are skipped) among
/// `trace`'s entries by time (see the module documentation), oldest first.
fn place<'a>(trace: &[TraceEntry], annotations: &'a [Annotation]) -> Vec<Placed<'a>> {
    let mut v: Vec<(&'a Annotation, &'a str, bool)> = annotations.iter().filter_map(|a| Some((a, a.name()?, a.is_start()?))).collect();
    v.sort_by_key(|(a, _, _)| a.time_us);
    let mut j = 0usize;
    v.into_iter()
        .map(|(a, name, start)| {
            let t = a.time_us;
            while j < trace.len() && (trace[j].time_us < t || (!start && trace[j].time_us == t)) {
                j += 1;
            }
            Placed { name, start, pos: j as u32, time_us: t }
        })
        .collect()
}

struct Builder<'a> {
    trace: &'a [TraceEntry],
    requests: &'a [Request],
}

impl Builder<'_> {
    /// The requests before trace position `pos`.
    fn requests_before(&self, pos: u32) -> u32 {
        self.requests.partition_point(|r| r.trace_index < pos) as u32
    }

    fn time_at(&self, pos: u32, end: bool) -> i64 {
        let i = if end { pos.saturating_sub(1) } else { pos } as usize;
        self.trace.get(i.min(self.trace.len().saturating_sub(1))).map_or(0, |e| e.time_us)
    }

    fn span(&self, start: u32, end: u32, start_us: i64, end_us: i64) -> Span {
        Span { start_entry: start, end_entry: end, request_start: self.requests_before(start), request_end: self.requests_before(end), start_us, end_us }
    }

    /// Iterations from boundary positions (each the end of an iteration), with their times.
    fn iterations(&self, bounds: &[(u32, i64)]) -> Vec<IterationSpan> {
        let n = self.trace.len() as u32;
        let mut out = Vec::with_capacity(bounds.len() + 1);
        let (mut start, mut start_us) = (0u32, self.time_at(0, false));
        for &(pos, t) in bounds {
            out.push(IterationSpan { index: out.len(), span: self.span(start, pos, start_us, t), complete: true });
            (start, start_us) = (pos, t);
        }
        let tail = self.span(start, n, start_us, self.time_at(n, true));
        if tail.requests() > 0 || out.is_empty() {
            // Without boundaries the one iteration is the whole trace.
            out.push(IterationSpan { index: out.len(), span: tail, complete: bounds.is_empty() });
        }
        out
    }
}

impl Layout {
    /// The layout of `prepared`'s device: iterations by the annotations named `by` (default: the
    /// optimizer's step, else the request pattern).
    pub fn of(prepared: &Prepared, by: Option<&str>) -> Result<Layout, LayoutError> {
        Layout::from_parts(&prepared.trace, &prepared.program.requests, &prepared.annotations, by, &|q| prepared.call_site(q))
    }

    /// [`Layout::of`] from one device's trace, its requests (in trace order), its annotations, and
    /// the call site of a request (to name a pattern's marker).
    pub fn from_parts(
        trace: &[TraceEntry],
        requests: &[Request],
        annotations: &[Annotation],
        by: Option<&str>,
        call_site: &dyn Fn(u32) -> Option<String>,
    ) -> Result<Layout, LayoutError> {
        let b = Builder { trace, requests };
        let placed = place(trace, annotations);
        let key = by.unwrap_or(OPTIMIZER_STEP);
        let ends: Vec<&Placed<'_>> = placed.iter().filter(|p| !p.start && matches(p.name, key)).collect();
        let (source, iterations) = if !ends.is_empty() {
            let mut names: Vec<String> = Vec::new();
            for p in &ends {
                if !names.iter().any(|n| n == p.name) {
                    names.push(p.name.to_string());
                }
            }
            let bounds: Vec<(u32, i64)> = ends.iter().map(|p| (p.pos, p.time_us)).collect();
            (Source::Annotation { names }, b.iterations(&bounds))
        } else if let Some(name) = by {
            let mut names: Vec<String> = Vec::new();
            for p in &placed {
                if !names.iter().any(|n| n == p.name) {
                    names.push(p.name.to_string());
                }
            }
            return Err(LayoutError::NoSuchAnnotation { name: name.to_string(), names });
        } else {
            match pattern(requests, &live_before(trace, requests)) {
                Some((starts, live_spread, median_rise)) => {
                    let bounds: Vec<(u32, i64)> = starts[1..]
                        .iter()
                        .map(|&q| {
                            let pos = requests[q as usize].trace_index;
                            (pos, trace.get(pos as usize).map_or(0, |e| e.time_us))
                        })
                        .collect();
                    let mut its = b.iterations(&bounds);
                    // The last repetition is an iteration like the others, as far as can be told.
                    if let Some(last) = its.last_mut() {
                        last.complete = true;
                    }
                    let first = starts[0];
                    let size = requests[first as usize].size;
                    let marker = match call_site(first) {
                        Some(site) => format!("{site} ({size} bytes)"),
                        None => format!("a request of {size} bytes"),
                    };
                    (Source::Pattern { marker, marker_request: first, repeats: starts.len(), live_spread, median_rise }, its)
                }
                None => {
                    let reason = if requests.is_empty() {
                        "the trace holds no requests".to_string()
                    } else if annotations.is_empty() {
                        "no optimizer-step annotations, and no request pattern that repeats and returns to the same live memory between repeats".to_string()
                    } else {
                        "no optimizer-step annotations (--by NAME takes another), and no request pattern that repeats and returns to the same live memory between repeats".to_string()
                    };
                    (Source::Whole { reason }, b.iterations(&[]))
                }
            }
        };
        let regions = regions(&b, &placed, &iterations);
        Ok(Layout { source, iterations, regions })
    }

    /// The iteration holding request `req`.
    pub fn iteration_of_request(&self, req: u32) -> Option<usize> {
        let i = self.iterations.partition_point(|it| it.span.request_end <= req);
        self.iterations.get(i).filter(|it| it.span.request_start <= req).map(|it| it.index)
    }

    /// The iteration holding trace entry `entry`.
    pub fn iteration_at_entry(&self, entry: u32) -> Option<usize> {
        let i = self.iterations.partition_point(|it| it.span.end_entry <= entry);
        self.iterations.get(i).filter(|it| it.span.start_entry <= entry).map(|it| it.index)
    }

    /// Where request `req` (trace entry `entry`) falls.
    pub fn phase_at(&self, req: u32, entry: u32) -> PhaseAt {
        let iteration = self.iteration_of_request(req);
        PhaseAt {
            iteration,
            iterations: self.iterations.len(),
            complete: iteration.is_some_and(|i| self.iterations[i].complete),
            regions: self.regions_at_entry(entry).into_iter().map(|r| r.name.clone()).collect(),
            source: self.source.clone(),
        }
    }

    /// The regions holding trace entry `entry`, outermost first.
    pub fn regions_at_entry(&self, entry: u32) -> Vec<&RegionSpan> {
        let mut v: Vec<&RegionSpan> = self.regions.iter().filter(|r| r.span.contains_entry(entry)).collect();
        v.sort_by_key(|r| (r.depth, r.span.start_entry));
        v
    }
}

/// Regions from the placed annotations (see the module documentation), ordered by start.
fn regions(b: &Builder<'_>, placed: &[Placed<'_>], iterations: &[IterationSpan]) -> Vec<RegionSpan> {
    let n = b.trace.len() as u32;
    let mut open: HashMap<&str, Vec<&Placed<'_>>> = HashMap::new();
    let mut out: Vec<RegionSpan> = Vec::new();
    let mut push = |name: &str, start: Option<&Placed<'_>>, end: Option<&Placed<'_>>| {
        let (s, s_us) = start.map_or((0, b.time_at(0, false)), |p| (p.pos, p.time_us));
        let (e, e_us) = end.map_or((n, b.time_at(n, true)), |p| (p.pos, p.time_us));
        out.push(RegionSpan {
            name: name.to_string(),
            iteration: None,
            depth: 0,
            span: b.span(s, e.max(s), s_us, e_us),
            open_start: start.is_none(),
            open_end: end.is_none(),
        });
    };
    for p in placed {
        if p.start {
            open.entry(p.name).or_default().push(p);
        } else {
            let start = open.get_mut(p.name).and_then(|v| v.pop());
            push(p.name, start, Some(p));
        }
    }
    let mut rest: Vec<&Placed<'_>> = open.into_values().flatten().collect();
    rest.sort_by_key(|p| (p.pos, p.time_us));
    for p in rest {
        push(p.name, Some(p), None);
    }
    // By start (then the longer first, so an enclosing region comes before what it holds).
    out.sort_by_key(|r| (r.span.start_entry, std::cmp::Reverse(r.span.end_entry), r.span.start_us));
    // The ends of the regions that enclose the current start.
    let mut ends: Vec<u32> = Vec::new();
    for r in &mut out {
        while ends.last().is_some_and(|&e| e <= r.span.start_entry) {
            ends.pop();
        }
        r.depth = ends.len() as u32;
        ends.push(r.span.end_entry);
        let i = iterations.partition_point(|it| it.span.end_entry <= r.span.start_entry);
        r.iteration = iterations.get(i).filter(|it| it.span.start_entry <= r.span.start_entry).map(|it| it.index).or(iterations.last().map(|it| it.index));
    }
    out
}

/// The bytes the program holds (allocated and not yet freed) just before each request, counted
/// from the trace's first entry (a trace that starts mid-history counts from its own start: only
/// differences between these are meaningful). A block is freed at its `free_requested` (or, in a
/// trace that records none, its `free_completed`).
fn live_before(trace: &[TraceEntry], requests: &[Request]) -> Vec<i64> {
    use allocsim_trace::Action;
    let requested = trace.iter().any(|e| e.action == Action::FreeRequested);
    let mut out = Vec::with_capacity(requests.len());
    let (mut live, mut q) = (0i64, 0usize);
    for (i, e) in trace.iter().enumerate() {
        while q < requests.len() && requests[q].trace_index as usize == i {
            out.push(live);
            q += 1;
        }
        match e.action {
            Action::Alloc => live += e.size as i64,
            Action::FreeRequested if requested => live -= e.size as i64,
            Action::FreeCompleted if !requested => live -= e.size as i64,
            _ => {}
        }
    }
    out.resize(requests.len(), live);
    out
}

/// Whether repeats starting at `starts` return to the same live memory, as iterations of a job
/// do (each frees what it made, but for what it keeps for the next: parameters, gradients, the
/// optimizer's state); the repeated layers of one forward pass do not (each keeps its
/// activations for the backward pass, so the live bytes at their starts climb). After the
/// first repeat (which may create the optimizer's state), the live bytes at the repeats' starts
/// may differ by at most a quarter of the median of how far a repeat rises above its start.
/// Returns that spread and median when they do.
fn returns_to_the_same_live_set(requests: &[Request], live: &[i64], starts: &[u32]) -> Option<(u64, u64)> {
    if starts.len() < 3 {
        return None;
    }
    let at: Vec<i64> = starts[1..].iter().map(|&q| live[q as usize]).collect();
    let spread = (at.iter().max()? - at.iter().min()?) as u64;
    let mut rises: Vec<u64> = starts
        .windows(2)
        .skip(1)
        .map(|w| {
            let base = live[w[0] as usize];
            let top = (w[0]..w[1]).map(|q| live[q as usize] + requests[q as usize].size as i64).max().unwrap_or(base);
            (top - base).max(0) as u64
        })
        .collect();
    if rises.is_empty() {
        return None;
    }
    rises.sort_unstable();
    let median = rises[rises.len() / 2];
    (median > 0 && spread.saturating_mul(4) <= median).then_some((spread, median))
}

/// The request pattern's iteration starts (request ordinals; see the module documentation), with
/// the live-memory evidence of [`returns_to_the_same_live_set`].
fn pattern(requests: &[Request], live: &[i64]) -> Option<(Vec<u32>, u64, u64)> {
    let stacks = requests.iter().any(|r| r.stack != 0);
    let sig = |r: &Request| if stacks { r.stack as u64 } else { r.size };
    let mut at: HashMap<u64, Vec<u32>> = HashMap::new();
    for (i, r) in requests.iter().enumerate() {
        at.entry(sig(r)).or_default().push(i as u32);
    }
    let n = requests.len() as u32;
    // Sizes are weaker evidence than stacks: equal sizes come by chance more often.
    let fewest = if stacks { 3 } else { 5 };
    let regular = |p: &[u32]| -> bool {
        if p.len() < fewest || p[p.len() - 1] - p[0] < n / 2 {
            return false;
        }
        let mut gaps: Vec<u32> = p.windows(2).map(|w| w[1] - w[0]).collect();
        let first = gaps[0];
        let mut rest = gaps.split_off(1);
        rest.sort_unstable();
        let median = rest[rest.len() / 2] as f64;
        if median < 2.0 {
            return false;
        }
        let long = |g: u32, f: f64| g as f64 > median * f;
        let short = |g: u32| (g as f64) * 1.5 < median;
        // An iteration cut short (by an OOM it caught) makes a short distance; allow a few.
        let shorts = rest.iter().filter(|&&g| short(g)).count();
        !rest.iter().any(|&g| long(g, 1.5)) && !long(first, 3.0) && !short(first) && shorts <= (rest.len() / 10).max(1)
    };
    let candidates: Vec<(u64, &Vec<u32>)> = at.iter().filter(|(_, p)| regular(p)).map(|(&s, p)| (s, p)).collect();
    let mut counts: HashMap<usize, usize> = HashMap::new();
    for (_, p) in &candidates {
        *counts.entry(p.len()).or_default() += 1;
    }
    // A count of repeats at least two candidates share, the fewest repeats first (the coarsest
    // repetition: steps before the layers repeated inside each), of those whose repeats are
    // alike and return to the same live memory.
    let mut ks: Vec<usize> = counts.iter().filter(|&(_, &c)| c >= 2).map(|(&k, _)| k).collect();
    ks.sort_unstable();
    ks.into_iter().find_map(|k| {
        // Of those that come k times, the earliest in each repetition.
        let (_, p) = candidates.iter().filter(|(_, p)| p.len() == k).min_by_key(|(s, p)| (p.iter().map(|&x| x as u64).sum::<u64>(), *s))?;
        // The iterations must be alike: most of their requests (after the first iteration) have
        // a signature that comes in at least half of them.
        let iteration_of = |q: u32| p.partition_point(|&s| s <= q);
        let mut seen: HashMap<u64, (usize, usize)> = HashMap::new();
        for (q, r) in requests.iter().enumerate().skip(p[1] as usize) {
            let (last, count) = seen.entry(sig(r)).or_insert((usize::MAX, 0));
            let it = iteration_of(q as u32);
            if *last != it {
                *last = it;
                *count += 1;
            }
        }
        let tail = &requests[p[1] as usize..];
        let common = tail.iter().filter(|r| 2 * seen[&sig(r)].1 >= k - 1).count();
        if 2 * common < tail.len() {
            return None;
        }
        let (spread, rise) = returns_to_the_same_live_set(requests, live, p)?;
        Some(((*p).clone(), spread, rise))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use allocsim_model::allocator::Route;
    use allocsim_trace::Action;
    use std::sync::Arc;

    fn entry(action: Action, time_us: i64, stack: u32, size: u64) -> TraceEntry {
        TraceEntry { action, addr: 0, size, stream: 0, time_us, stack, meta: 0 }
    }

    fn requests_of(trace: &[TraceEntry]) -> Vec<Request> {
        trace
            .iter()
            .enumerate()
            .filter(|(_, e)| matches!(e.action, Action::Alloc | Action::Oom))
            .map(|(i, e)| Request {
                size: e.size,
                stream: 0,
                route: Route::Default,
                recorded_oom: e.action == Action::Oom,
                recorded_addr: 0,
                trace_index: i as u32,
                stack: e.stack,
                checkpoint: false,
            })
            .collect()
    }

    fn ann(stage: &str, name: &str, t: i64) -> Annotation {
        let s = |x: &str| -> Arc<str> { x.into() };
        Annotation { device: 0, time_us: t, fields: vec![(s("stage"), s(stage)), (s("name"), s(name))] }
    }

    /// Two steps of forward (2 allocs), backward (1 alloc), optimizer step (1 alloc), then one
    /// alloc after the last step: 2 complete iterations and a partial one.
    #[test]
    fn optimizer_steps_and_regions() {
        let t: Vec<TraceEntry> = (0..11).map(|i| entry(if i % 5 == 4 { Action::FreeRequested } else { Action::Alloc }, 10 * i, 0, 1)).collect();
        // entries at t=0,10,20,30 alloc; 40 free; 50..80 alloc; 90 free; 100 alloc
        let anns = vec![
            ann("START", "forward", 0),
            ann("END", "forward", 10),
            ann("START", "backward", 15),
            ann("END", "backward", 20),
            ann("START", "Optimizer.step#AdamW.step", 25),
            ann("END", "Optimizer.step#AdamW.step", 40),
            ann("START", "forward", 45),
            ann("END", "forward", 60),
            ann("START", "Optimizer.step#AdamW.step", 65),
            ann("END", "Optimizer.step#AdamW.step", 90),
        ];
        let reqs = requests_of(&t);
        let l = Layout::from_parts(&t, &reqs, &anns, None, &|_| None).unwrap();
        assert_eq!(l.source, Source::Annotation { names: vec!["Optimizer.step#AdamW.step".into()] });
        let it: Vec<(u32, u32, u32, u32, bool)> =
            l.iterations.iter().map(|i| (i.span.start_entry, i.span.end_entry, i.span.request_start, i.span.request_end, i.complete)).collect();
        // END at 40 is placed after the entry at 40 (ties count inside); END at 90 after 90.
        assert_eq!(it, [(0, 5, 0, 4, true), (5, 10, 4, 8, true), (10, 11, 8, 9, false)]);
        assert_eq!(l.iterations[1].span.start_us, 40);
        assert_eq!(l.iterations[2].span.end_us, 100);
        // forward [0,10] holds the entries at 0 and 10; backward [15,20] the one at 20.
        let f0 = &l.regions[0];
        assert_eq!((f0.name.as_str(), f0.span.start_entry, f0.span.end_entry, f0.iteration), ("forward", 0, 2, Some(0)));
        let names: Vec<(&str, u32, Option<usize>)> = l.regions.iter().map(|r| (r.name.as_str(), r.span.start_entry, r.iteration)).collect();
        assert_eq!(
            names,
            [
                ("forward", 0, Some(0)),
                ("backward", 2, Some(0)),
                ("Optimizer.step#AdamW.step", 3, Some(0)),
                ("forward", 5, Some(1)),
                ("Optimizer.step#AdamW.step", 7, Some(1))
            ]
        );
        assert_eq!(l.iteration_of_request(3), Some(0));
        assert_eq!(l.iteration_of_request(4), Some(1));
        assert_eq!(l.iteration_of_request(8), Some(2));
        assert_eq!(l.iteration_of_request(9), None);
        assert_eq!(l.regions_at_entry(6).iter().map(|r| r.name.as_str()).collect::<Vec<_>>(), ["forward"]);
        // --by forward: iterations end at each forward's END.
        let l = Layout::from_parts(&t, &reqs, &anns, Some("forward"), &|_| None).unwrap();
        assert_eq!(l.iterations.iter().map(|i| i.span.end_entry).collect::<Vec<_>>(), [2, 7, 11]);
        // --by a name that is not there
        let e = Layout::from_parts(&t, &reqs, &anns, Some("train_step"), &|_| None).unwrap_err();
        assert!(e.to_string().contains("forward, backward, Optimizer.step#AdamW.step"), "{e}");
    }

    #[test]
    fn nesting_and_open_regions() {
        let t: Vec<TraceEntry> = (0..6).map(|i| entry(Action::Alloc, 10 * i, 0, 1)).collect();
        let anns = vec![
            ann("END", "lost", 5),
            ann("START", "outer", 10),
            ann("START", "inner", 20),
            ann("START", "inner", 25),
            ann("END", "inner", 30),
            ann("END", "inner", 35),
            ann("END", "outer", 40),
            ann("START", "tail", 45),
        ];
        let l = Layout::from_parts(&t, &requests_of(&t), &anns, None, &|_| None).unwrap();
        let v: Vec<(&str, u32, u32, u32, bool, bool)> =
            l.regions.iter().map(|r| (r.name.as_str(), r.span.start_entry, r.span.end_entry, r.depth, r.open_start, r.open_end)).collect();
        assert_eq!(
            v,
            [
                ("lost", 0, 1, 0, true, false),
                ("outer", 1, 5, 0, false, false),
                ("inner", 2, 4, 1, false, false),
                ("inner", 3, 4, 2, false, false),
                ("tail", 5, 6, 0, false, true),
            ]
        );
    }

    /// Without annotations: 5 repetitions of (a, b, b, c) with stacks 1, 2, 2, 3 after a setup
    /// request (stack 9), the first repetition one request longer (stack 4, optimizer state).
    #[test]
    fn repeating_pattern() {
        let mut t = vec![entry(Action::Alloc, 0, 9, 8)];
        for k in 0..5 {
            for &s in &[1u32, 2, 2, 3] {
                t.push(entry(Action::Alloc, t.len() as i64, s, 8));
            }
            if k == 0 {
                t.push(entry(Action::Alloc, t.len() as i64, 4, 8));
            }
            // Each repetition frees what it made (the first keeps its 8 bytes of state).
            for _ in 0..4 {
                t.push(entry(Action::FreeRequested, t.len() as i64, 0, 8));
            }
        }
        let reqs = requests_of(&t);
        let l = Layout::from_parts(&t, &reqs, &[], None, &|_| None).unwrap();
        assert!(matches!(l.source, Source::Pattern { repeats: 5, .. }), "{:?}", l.source);
        // stack 1 marks the starts: requests 1, 6, 10, 14, 18; the first iteration takes the setup.
        let starts: Vec<u32> = l.iterations.iter().map(|i| i.span.request_start).collect();
        assert_eq!(starts, [0, 6, 10, 14, 18]);
        assert!(l.iterations.iter().all(|i| i.complete));
        // no pattern: one iteration
        let flat: Vec<TraceEntry> = (0..5).map(|i| entry(Action::Alloc, i, 0, 100 + i as u64)).collect();
        let l = Layout::from_parts(&flat, &requests_of(&flat), &[], None, &|_| None).unwrap();
        assert!(matches!(l.source, Source::Whole { .. }));
        assert_eq!(l.iterations.len(), 1);
        assert_eq!(l.iterations[0].span.requests(), 5);
        // The same repetitions keeping what they make (as the layers of one forward pass keep
        // their activations): no iterations.
        let kept: Vec<TraceEntry> = t.iter().filter(|e| e.action != Action::FreeRequested).cloned().collect();
        let l = Layout::from_parts(&kept, &requests_of(&kept), &[], None, &|_| None).unwrap();
        assert!(matches!(l.source, Source::Whole { .. }), "{:?}", l.source);
    }
}
