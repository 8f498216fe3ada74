//! `scale`: what was learnt, in numbers; the asked steps predicted; the largest value a budget
//! holds, found by replaying.

use rayon::prelude::*;
use serde::Serialize;

use crate::ScaleError;
use crate::fit::SizeFit;
use crate::predict::{After, Bound, Runner, Setting, StepReading, SynthError, after, replay_step, replay_step_on, synthesize};
use crate::steps::{Input, Learnt, Role, StepsFrom, find_steps, learn};

/// What to answer.
#[derive(Clone, Debug)]
pub struct Question<'a> {
    /// The annotation's name (`record_function("PARAM=VALUE")`), or what `--values` are.
    pub param: &'a str,
    /// `--values` mode: iterations end at each annotation of this name (default: the optimizer's
    /// steps, else the repeating request pattern).
    pub by: Option<&'a str>,
    /// The step of the first trace whose end state the asked steps follow (default: its last
    /// complete one).
    pub after: Option<usize>,
    pub predict: &'a [u64],
    /// Values whose steps are not learnt from (to check a prediction against them).
    pub hold_out: &'a [u64],
    /// How the asked steps are replayed.
    pub setting: Setting,
    /// Budgets to find the largest value under.
    pub largest: Vec<Budget>,
    /// The largest value is a multiple of this (default: the recorded values' greatest common
    /// divisor).
    pub step: Option<u64>,
}

/// A budget to find the largest value under.
#[derive(Clone, Debug)]
pub struct Budget {
    /// How it was given (`--largest-under`, the trace's budget, a card).
    pub label: String,
    pub capacity: u64,
    pub setting: Setting,
}

/// Candidates [`largest`] replays at most (past that, a larger step is needed).
pub const MAX_CANDIDATES: u64 = 4096;

/// The largest shape value taken ([`crate::steps::MAX_VALUE`]): also the limit of [`largest`]'s
/// doubling, so that no arithmetic on values overflows.
pub use crate::steps::MAX_VALUE;

/// The steps of one trace, as used.
#[derive(Clone, Debug, Serialize)]
pub struct TraceSteps {
    pub name: String,
    pub from: StepsFrom,
    pub steps: Vec<StepRow>,
}

#[derive(Clone, Debug, Serialize)]
pub struct StepRow {
    pub index: usize,
    pub value: Option<u64>,
    pub requests: u32,
    pub role: Role,
}

/// How a structure's requests follow the value.
#[derive(Clone, Debug, Default, Serialize)]
pub struct FitCounts {
    pub constant: u32,
    pub affine: u32,
    pub quadratic: u32,
    /// Requests no line or parabola gives through every point, and the largest distance of a
    /// point from the line through the outermost two.
    pub piecewise: u32,
    pub worst_deviation: u64,
    /// Exact fits checked on a value they were not made from, and those that had none.
    pub checked: u32,
    pub unchecked: u32,
    /// Requests seen at one value only (their dependence on the value unknown).
    pub single_valued: u32,
}

#[derive(Clone, Debug, Serialize)]
pub struct StructureRow {
    pub id: usize,
    pub requests: usize,
    pub values: Vec<u64>,
    /// (trace, step index) of the steps learnt from.
    pub steps: Vec<(usize, usize)>,
    pub fits: FitCounts,
    /// Requests whose size differed between steps at one value (the larger kept).
    pub conflicts: u32,
}

/// Requests one structure makes and the other does not.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RequestGroup {
    pub requests: u32,
    /// Their bytes at the value named with the group.
    pub bytes: u64,
    pub seen_at: Vec<u64>,
    /// Where they were made (distinct call sites; "(no stack)" for requests without one).
    pub call_sites: Vec<String>,
}

/// Where the structure changes between two recorded values.
#[derive(Clone, Debug, Serialize)]
pub struct Switch {
    pub below: u64,
    pub above: u64,
    pub from_structure: usize,
    pub to_structure: usize,
    /// Requests made only past the switch (bytes at `above`), and only before it (at `below`).
    pub appear: RequestGroup,
    pub disappear: RequestGroup,
}

/// The learnt steps replayed in place of the recorded ones (first trace, each after the one
/// before it, under the trace's own settings and budget).
#[derive(Clone, Debug, Default, Serialize)]
pub struct SelfCheck {
    pub steps: usize,
    pub agree: usize,
    /// The first that does not.
    pub first_difference: Option<Difference>,
}

/// A recorded step whose learnt replacement peaks otherwise.
#[derive(Clone, Debug, Serialize)]
pub struct Difference {
    pub step: usize,
    pub value: u64,
    /// Peak allocated and reserved: predicted (none: it could not be synthesized), and as the
    /// trace's own replay gives them.
    pub predicted: Option<(u64, u64)>,
    pub replayed: (u64, u64),
}

/// One replay of an asked step.
#[derive(Clone, Debug, Serialize)]
pub struct Run {
    pub structure: usize,
    pub bound: Bound,
    #[serde(flatten)]
    pub reading: StepReading,
    pub unmatched_frees: u32,
}

/// An asked step.
#[derive(Clone, Debug, Serialize)]
pub struct Prediction {
    pub value: u64,
    /// Outside the recorded values' range.
    pub extrapolated: bool,
    /// Between two recorded values of different structures: the switch lies between them.
    pub switch_between: Option<(u64, u64)>,
    pub runs: Vec<Run>,
    /// Lowest and highest over the runs.
    pub peak_allocated: (u64, u64),
    pub peak_reserved: (u64, u64),
    /// Runs that ran out of memory.
    pub ooms: usize,
    /// Every request's size from an exact fit through values on both sides of it (or at it),
    /// one structure: as exact as the model.
    pub exact: bool,
    /// Why not exact, in words.
    pub caveats: Vec<String>,
    /// Why it could not be predicted.
    pub error: Option<String>,
}

/// The largest value under one budget.
#[derive(Clone, Debug, Serialize)]
pub struct Largest {
    pub label: String,
    pub capacity: u64,
    pub step: u64,
    /// The largest multiple of `step` whose step replays without OOM (every run: both ends of
    /// requests seen at one value, both structures at a switch).
    pub value: Option<u64>,
    pub peak_allocated: Option<u64>,
    pub peak_reserved: Option<u64>,
    /// The same with requests seen at one value at the smaller end of their range, where it
    /// differs.
    pub optimistic: Option<u64>,
    /// The smallest value found to OOM above `value`.
    pub first_oom_above: Option<u64>,
    /// No OOM found doubling from the largest recorded value up to this one (the search's limit
    /// 2^40, or the last value a fit gives sizes at: see `unpredictable`): `value` is a lower
    /// bound.
    pub no_oom_up_to: Option<u64>,
    /// Ranges of values below `value` that OOM (fragmentation: the answer is not monotone).
    pub non_monotone: Vec<(u64, u64)>,
    /// Values every multiple of `step` from `searched.0` to `searched.1` was replayed at.
    pub searched: (u64, u64),
    pub replays: usize,
    /// Values that could not be synthesized (a fit gives no positive size there).
    pub unpredictable: Vec<u64>,
}

/// The state the asked steps follow.
#[derive(Clone, Debug, Serialize)]
pub struct AfterStep {
    pub index: usize,
    pub value: Option<u64>,
    pub allocated: u64,
    pub reserved: u64,
}

/// `scale`'s answer.
#[derive(Clone, Debug, Serialize)]
pub struct ScaleAnswer {
    pub param: String,
    pub traces: Vec<TraceSteps>,
    pub structures: Vec<StructureRow>,
    pub switches: Vec<Switch>,
    /// Values at which two traces' steps differ (the first trace's learnt).
    pub ambiguous_values: Vec<u64>,
    pub recorded_range: (u64, u64),
    pub self_check: SelfCheck,
    pub after: AfterStep,
    pub predictions: Vec<Prediction>,
    pub largest: Vec<Largest>,
}

/// Learns from `inputs` and answers `q`.
pub fn scale(inputs: &[Input<'_>], q: &Question<'_>) -> Result<ScaleAnswer, ScaleError> {
    if inputs.is_empty() {
        return Err(ScaleError::Usage("no trace to learn from".into()));
    }
    if q.predict.contains(&0) {
        return Err(ScaleError::Usage(format!("--predict: {} 0: values are at least 1", q.param)));
    }
    if q.step == Some(0) {
        return Err(ScaleError::Usage("--step 0: the step is at least 1".into()));
    }
    for (what, v) in q.predict.iter().map(|&v| ("--predict", v)).chain(q.step.map(|s| ("--step", s))) {
        if v > MAX_VALUE {
            return Err(ScaleError::Usage(format!("{what} {v}: shape values are at most 2^40 ({MAX_VALUE})")));
        }
    }
    let mut per_trace = Vec::with_capacity(inputs.len());
    for (t, inp) in inputs.iter().enumerate() {
        per_trace.push(find_steps(inp, t, q.param, q.by)?);
    }
    let l = learn(q.param, inputs, per_trace, q.hold_out)?;
    // The step the asked ones follow.
    let first: Vec<usize> = (0..l.steps.len()).filter(|&i| l.steps[i].trace == 0).collect();
    let k = match q.after {
        Some(a) => *first.iter().find(|&&i| l.steps[i].index == a).ok_or_else(|| {
            ScaleError::Usage(format!(
                "--after {a}: {} has steps {}",
                inputs[0].name,
                match (first.first(), first.last()) {
                    (Some(&x), Some(&y)) => format!("{}–{}", l.steps[x].index, l.steps[y].index),
                    _ => "none".into(),
                }
            ))
        })?,
        None => {
            *first.iter().rev().find(|&&i| l.steps[i].complete).or(first.last()).ok_or_else(|| ScaleError::Usage(format!("{}: no steps", inputs[0].name)))?
        }
    };
    let room = l.structures.iter().map(|s| s.keys.len()).max().unwrap_or(0);
    let call_site = |s: usize| {
        let l = &l;
        move |k: u32| {
            let (t, r) = l.structures[s].recorded[k as usize];
            inputs[t].prepared.call_site(r)
        }
    };
    let a = after(&l, &inputs[0], &l.steps[k], &q.setting, room);
    let after_step = AfterStep {
        index: l.steps[k].index,
        value: l.steps[k].value,
        allocated: a.stepper.alloc.stats.allocated_bytes.all().current as u64,
        reserved: a.stepper.alloc.stats.reserved_bytes.all().current as u64,
    };
    let values: Vec<u64> = l.by_value.keys().copied().collect();
    let recorded_range = (values[0], values[values.len() - 1]);
    let predictions: Vec<Prediction> = q.predict.iter().map(|&v| predict_one(&l, inputs, &a, v, &call_site)).collect();
    let step = q.step.unwrap_or_else(|| values.iter().fold(0, |g, &v| gcd(g, v)).max(1));
    let largest = q
        .largest
        .iter()
        .map(|b| {
            let a = after(&l, &inputs[0], &l.steps[k], &b.setting, room);
            largest(&l, inputs, &a, b, step, q.step.is_some())
        })
        .collect::<Result<Vec<_>, _>>()?;
    let self_check = self_check(&l, inputs, room);
    Ok(ScaleAnswer {
        param: l.param.clone(),
        traces: traces(&l, inputs),
        structures: structures(&l),
        switches: switches(&l, inputs),
        ambiguous_values: l.ambiguous_values.clone(),
        recorded_range,
        self_check,
        after: after_step,
        predictions,
        largest,
    })
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// The structures an asked value takes: the structure of the recorded values either side (both
/// where they differ), and whether it is outside the recorded range.
pub fn structures_for(l: &Learnt, v: u64) -> (Vec<usize>, bool, Option<(u64, u64)>) {
    if let Some(&s) = l.by_value.get(&v) {
        return (vec![s], false, None);
    }
    let below = l.by_value.range(..v).next_back();
    let above = l.by_value.range(v..).next();
    match (below, above) {
        (Some((&a, &sa)), Some((&b, &sb))) if sa != sb => (vec![sa, sb], false, Some((a, b))),
        (Some((_, &s)), Some(_)) => (vec![s], false, None),
        (Some((_, &s)), None) | (None, Some((_, &s))) => (vec![s], true, None),
        (None, None) => (Vec::new(), true, None),
    }
}

/// The bounds a structure's step at `v` is replayed at.
fn bounds(l: &Learnt, s: usize, v: u64) -> Vec<Bound> {
    let f = l.fitted[s].as_ref().expect("learnt");
    if (0..f.fits.len()).any(|k| f.single_valued(k) && f.seen[k][0] != v) { vec![Bound::Low, Bound::High] } else { vec![Bound::Fitted] }
}

fn predict_one<F: Fn(u32) -> Option<String>>(l: &Learnt, inputs: &[Input<'_>], a: &After, v: u64, call_site: &dyn Fn(usize) -> F) -> Prediction {
    let (structs, extrapolated, switch_between) = structures_for(l, v);
    let mut runs = Vec::new();
    let mut error = None;
    for &s in &structs {
        for b in bounds(l, s, v) {
            match synthesize(l, inputs, s, v, b, a) {
                Ok(syn) => {
                    let reading = replay_step(a, &syn, call_site(s));
                    runs.push(Run { structure: s, bound: b, reading, unmatched_frees: syn.unmatched_frees });
                }
                Err(e) => error = Some(synth_error(l, inputs, v, &e)),
            }
        }
    }
    let range = |f: &dyn Fn(&Run) -> u64| (runs.iter().map(f).min().unwrap_or(0), runs.iter().map(f).max().unwrap_or(0));
    let peak_allocated = range(&|r| r.reading.peak_allocated);
    let peak_reserved = range(&|r| r.reading.peak_reserved);
    let ooms = runs.iter().filter(|r| r.reading.oom.is_some()).count();
    let mut caveats = Vec::new();
    if extrapolated {
        let (lo, hi) = (l.by_value.keys().next().copied().unwrap_or(0), l.by_value.keys().next_back().copied().unwrap_or(0));
        caveats.push(format!(
            "outside the recorded values ({lo}–{hi}): the fits are extended, and a library that switches algorithms past the recorded values (buffers of its own, another workspace) cannot be seen"
        ));
    }
    if let Some((x, y)) = switch_between {
        caveats.push(format!("the requests change between the recorded values {x} and {y}; where between is not known: both are replayed"));
    }
    for &s in &structs {
        let f = l.fitted[s].as_ref().expect("learnt");
        let single = (0..f.fits.len()).filter(|&k| f.single_valued(k) && f.seen[k][0] != v).count();
        if single > 0 {
            caveats.push(format!(
                "{single} request{} seen at one value only: replayed at {} (their size there) and scaled to {v}",
                if single == 1 { "" } else { "s" },
                join(&f.seen.iter().filter(|x| x.len() == 1).map(|x| x[0]).collect::<Vec<_>>())
            ));
        }
        let piecewise: Vec<u64> = f.fits.iter().filter_map(|x| if let SizeFit::Piecewise { deviation, .. } = x { Some(*deviation) } else { None }).collect();
        if !piecewise.is_empty() {
            caveats.push(format!(
                "{} request{} follow no line or parabola (piecewise; up to {} off the line through the outermost values)",
                piecewise.len(),
                if piecewise.len() == 1 { "" } else { "s" },
                allocsim_model::format::format_size(*piecewise.iter().max().unwrap_or(&0))
            ));
        }
        let unchecked = (0..f.fits.len()).filter(|&k| f.seen[k].len() > 1 && f.fits[k].is_exact() && !f.fits[k].checked_by(f.seen[k].len())).count();
        if unchecked > 0 {
            caveats.push(format!(
                "{unchecked} request{} fitted through every recorded value with no value left to check the fit on",
                if unchecked == 1 { "" } else { "s" }
            ));
        }
    }
    let unmatched: u32 = runs.iter().map(|r| r.unmatched_frees).max().unwrap_or(0);
    if unmatched > 0 {
        caveats.push(format!("{unmatched} free{} of requests the step it follows did not leave alive were left out", if unmatched == 1 { "" } else { "s" }));
    }
    let exact = error.is_none()
        && runs.len() == 1
        && runs[0].bound == Bound::Fitted
        && !extrapolated
        && unmatched == 0
        && structs.iter().all(|&s| l.fitted[s].as_ref().is_some_and(|f| f.fits.iter().all(SizeFit::is_exact)));
    Prediction { value: v, extrapolated, switch_between, runs, peak_allocated, peak_reserved, ooms, exact, caveats, error }
}

fn join(v: &[u64]) -> String {
    let mut v = v.to_vec();
    v.sort_unstable();
    v.dedup();
    v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", ")
}

fn synth_error(l: &Learnt, inputs: &[Input<'_>], v: u64, e: &SynthError) -> String {
    match e {
        SynthError::NotPositive { recorded: (t, q), value } => {
            let site = inputs[*t].prepared.call_site(*q).map(|c| format!(" ({c})")).unwrap_or_default();
            let (lo, hi) = (l.by_value.keys().next().copied().unwrap_or(0), l.by_value.keys().next_back().copied().unwrap_or(0));
            format!(
                "{}={v}: request {q}{site} would be {value} by the fit through its recorded sizes; predicting that far from the recorded values ({lo}–{hi}) is not possible",
                l.param
            )
        }
    }
}

/// One value tried by [`largest`].
#[derive(Clone, Copy, Debug)]
struct Tried {
    /// Every run replayed without OOM.
    fits: bool,
    peak_allocated: u64,
    peak_reserved: u64,
}

/// Whether the step at `v` replays without OOM in every run, and the largest peaks; `None` when
/// it cannot be synthesized. `optimistic`: with the requests seen at one value at their smaller
/// end only.
fn try_value(l: &Learnt, inputs: &[Input<'_>], a: &After, v: u64, optimistic: bool) -> Option<Tried> {
    let (structs, _, _) = structures_for(l, v);
    let (mut ok, mut pa, mut pr) = (true, 0, 0);
    for &s in &structs {
        for b in bounds(l, s, v) {
            if optimistic && b == Bound::High {
                continue;
            }
            let syn = synthesize(l, inputs, s, v, b, a).ok()?;
            let mut st = a.stepper.clone();
            let r = replay_step_on(&mut st, a.base, a.device, &syn, |_| None);
            ok &= r.oom.is_none();
            pa = pa.max(r.peak_allocated);
            pr = pr.max(r.peak_reserved);
        }
    }
    Some(Tried { fits: ok, peak_allocated: pa, peak_reserved: pr })
}

/// The largest multiple of `step` whose step replays without OOM under `b`: doubling from the
/// largest recorded value to the first OOM, then every multiple below it replayed (not
/// interpolated: fragmentation makes the answer non-monotone, and the ranges that OOM below the
/// answer are said).
fn largest(l: &Learnt, inputs: &[Input<'_>], a: &After, b: &Budget, step: u64, step_given: bool) -> Result<Largest, ScaleError> {
    let hi_rec = l.by_value.keys().next_back().copied().unwrap_or(step);
    let mut replays = 0usize;
    let mut unpredictable = Vec::new();
    let mut try_v = |v: u64| {
        replays += 1;
        try_value(l, inputs, a, v, false)
    };
    // Doubling to the first OOM.
    let limit = MAX_VALUE;
    let mut v = hi_rec.div_ceil(step) * step;
    let mut last_ok = None;
    let mut upper = None;
    while v <= limit {
        match try_v(v) {
            Some(t) if t.fits => last_ok = Some(v),
            Some(_) => {
                upper = Some(v);
                break;
            }
            None => {
                // Past here a fit gives no size: nothing further can be replayed.
                unpredictable.push(v);
                break;
            }
        }
        v = (v * 2).div_ceil(step) * step;
    }
    let Some(upper) = upper else {
        return Ok(Largest {
            label: b.label.clone(),
            capacity: b.capacity,
            step,
            value: last_ok,
            peak_allocated: None,
            peak_reserved: None,
            optimistic: None,
            first_oom_above: None,
            no_oom_up_to: Some(last_ok.unwrap_or(0)),
            non_monotone: Vec::new(),
            searched: (hi_rec.div_ceil(step) * step, last_ok.unwrap_or(0)),
            replays,
            unpredictable,
        });
    };
    // Every multiple of the step below the first OOM.
    let mut step = step;
    while upper / step > MAX_CANDIDATES {
        if step_given {
            return Err(ScaleError::Usage(format!(
                "--step {step}: the first OOM under {} is at {}={upper}, so {} steps would be replayed below it; at most {MAX_CANDIDATES}: give a larger --step",
                b.label,
                l.param,
                upper / step
            )));
        }
        step *= 2;
    }
    let candidates: Vec<u64> = (1..=upper / step).map(|k| k * step).filter(|&x| x < upper).collect();
    let results: Vec<(u64, Option<Tried>)> = candidates.par_iter().map(|&x| (x, try_value(l, inputs, a, x, false))).collect();
    replays += results.len();
    for (x, r) in &results {
        if r.is_none() {
            unpredictable.push(*x);
        }
    }
    let oom = |r: &Option<Tried>| r.is_some_and(|t| !t.fits);
    let best = results.iter().rev().find(|(_, r)| r.is_some_and(|t| t.fits));
    let value = best.map(|b| b.0);
    let (peak_allocated, peak_reserved) = best.and_then(|b| b.1).map_or((None, None), |t| (Some(t.peak_allocated), Some(t.peak_reserved)));
    let first_oom_above = match value {
        Some(v) => results.iter().find(|(x, r)| *x > v && oom(r)).map(|r| r.0).or(Some(upper)),
        None => Some(upper),
    };
    // Below the answer, the values that OOM, as ranges of consecutive multiples.
    let mut non_monotone: Vec<(u64, u64)> = Vec::new();
    if let Some(v) = value {
        for (x, r) in &results {
            if *x < v && oom(r) {
                match non_monotone.last_mut() {
                    Some(last) if last.1 + step == *x => last.1 = *x,
                    _ => non_monotone.push((*x, *x)),
                }
            }
        }
    }
    // With the requests seen at one value at their smaller end.
    let optimistic = if candidates.iter().any(|&x| bounds_any(l, x)) {
        let opt: Vec<(u64, bool)> = candidates.par_iter().filter_map(|&x| try_value(l, inputs, a, x, true).map(|r| (x, r.fits))).collect();
        replays += opt.len();
        opt.iter().rev().find(|r| r.1).map(|r| r.0).filter(|&o| Some(o) != value)
    } else {
        None
    };
    unpredictable.sort_unstable();
    unpredictable.dedup();
    Ok(Largest {
        label: b.label.clone(),
        capacity: b.capacity,
        step,
        value,
        peak_allocated,
        peak_reserved,
        optimistic,
        first_oom_above,
        no_oom_up_to: None,
        non_monotone,
        searched: (step, upper),
        replays,
        unpredictable,
    })
}

/// Whether a step at `v` has runs at two bounds.
fn bounds_any(l: &Learnt, v: u64) -> bool {
    structures_for(l, v).0.iter().any(|&s| bounds(l, s, v).len() > 1)
}

fn traces(l: &Learnt, inputs: &[Input<'_>]) -> Vec<TraceSteps> {
    inputs
        .iter()
        .enumerate()
        .map(|(t, inp)| TraceSteps {
            name: inp.name.to_string(),
            from: l.from[t].clone(),
            steps: l
                .steps
                .iter()
                .zip(&l.roles)
                .filter(|(s, _)| s.trace == t)
                .map(|(s, r)| StepRow { index: s.index, value: s.value, requests: s.requests.1 - s.requests.0, role: *r })
                .collect(),
        })
        .collect()
}

fn structures(l: &Learnt) -> Vec<StructureRow> {
    l.structures
        .iter()
        .enumerate()
        .filter(|(s, _)| l.fitted[*s].is_some())
        .map(|(s, st)| {
            let f = l.fitted[s].as_ref().expect("learnt");
            let mut c = FitCounts::default();
            for (k, fit) in f.fits.iter().enumerate() {
                match fit {
                    SizeFit::Constant { .. } => c.constant += 1,
                    SizeFit::Affine { .. } => c.affine += 1,
                    SizeFit::Quadratic { .. } => c.quadratic += 1,
                    SizeFit::Piecewise { deviation, .. } => {
                        c.piecewise += 1;
                        c.worst_deviation = c.worst_deviation.max(*deviation);
                    }
                }
                let n = f.seen[k].len();
                if n == 1 {
                    c.single_valued += 1;
                } else if fit.checked_by(n) {
                    c.checked += 1;
                } else if fit.is_exact() {
                    c.unchecked += 1;
                }
            }
            StructureRow {
                id: s,
                requests: st.keys.len(),
                values: st.values(&l.steps),
                steps: st.steps.iter().map(|&i| (l.steps[i].trace, l.steps[i].index)).collect(),
                fits: c,
                conflicts: st.conflicts,
            }
        })
        .collect()
}

fn switches(l: &Learnt, inputs: &[Input<'_>]) -> Vec<Switch> {
    let mut out = Vec::new();
    let v: Vec<(u64, usize)> = l.by_value.iter().map(|(&a, &b)| (a, b)).collect();
    for w in v.windows(2) {
        let ((below, sa), (above, sb)) = (w[0], w[1]);
        if sa == sb {
            continue;
        }
        let group = |me: usize, other: usize, at: u64| -> RequestGroup {
            let f = l.fitted[me].as_ref().expect("learnt");
            let mut g = RequestGroup::default();
            for k in 0..f.fits.len() {
                if f.aligned[other].get(k).copied().flatten().is_some() {
                    continue;
                }
                g.requests += 1;
                g.bytes += crate::predict::size_at(l, me, k, at, Bound::Fitted).unwrap_or(0);
                for &x in &f.seen[k] {
                    if !g.seen_at.contains(&x) {
                        g.seen_at.push(x);
                    }
                }
                let (t, q) = l.structures[me].recorded[k];
                let site = inputs[t].prepared.call_site(q).unwrap_or_else(|| "(no stack)".into());
                if !g.call_sites.contains(&site) {
                    g.call_sites.push(site);
                }
            }
            g.seen_at.sort_unstable();
            g
        };
        out.push(Switch { below, above, from_structure: sa, to_structure: sb, appear: group(sb, sa, above), disappear: group(sa, sb, below) });
    }
    out
}

/// Each learnt step of the first trace that follows another step of it, predicted after that
/// one and compared with the trace's own replay of it.
fn self_check(l: &Learnt, inputs: &[Input<'_>], room: usize) -> SelfCheck {
    let p = inputs[0].prepared;
    let setting = Setting { config: p.own.clone(), limits: p.limits(None), placement: p.recorded_placement(), device_memory: None };
    let mut r = Runner::new(p, &setting, p.program.requests.len() as u32, room, p.program.ops.len());
    let mut out = SelfCheck::default();
    let idx: Vec<usize> = (0..l.steps.len()).filter(|&i| l.steps[i].trace == 0).collect();
    for w in idx.windows(2) {
        let (pi, i) = (w[0], w[1]);
        let (prev, st) = (&l.steps[pi], &l.steps[i]);
        let Role::Learnt { .. } = l.roles[i] else { continue };
        let Some(v) = st.value else { continue };
        let Some(&s) = l.by_value.get(&v) else { continue };
        if !prev.complete || prev.ops.1 > st.ops.0 || prev.ops.1 < r.next {
            continue;
        }
        r.advance_to(prev.ops.1);
        let a = After { stepper: r.stepper.clone(), base: prev.requests.1, crossing: crate::predict::crossing(l, p, prev), device: p.device };
        let predicted = match synthesize(l, inputs, s, v, Bound::Fitted, &a) {
            Ok(syn) => {
                // The synthesized requests are numbered from the previous step's end, as the
                // recorded ones are.
                let mut st2 = a.stepper.clone();
                let rd = replay_step_on(&mut st2, a.base, a.device, &syn, |_| None);
                Some((rd.peak_allocated, rd.peak_reserved))
            }
            Err(_) => None,
        };
        r.advance_to(st.ops.0);
        r.stepper.alloc.stats.reset_peak();
        r.advance_to(st.ops.1);
        let replayed = (r.stepper.alloc.stats.allocated_bytes.all().peak as u64, r.stepper.alloc.stats.reserved_bytes.all().peak as u64);
        out.steps += 1;
        if predicted == Some(replayed) {
            out.agree += 1;
        } else if out.first_difference.is_none() {
            out.first_difference = Some(Difference { step: st.index, value: v, predicted, replayed });
        }
    }
    out
}
