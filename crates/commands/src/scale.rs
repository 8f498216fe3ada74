//! `scale`: a training or inference step at a shape never run, predicted from recorded steps at
//! other shapes, and the largest shape a budget holds (logic: `allocsim_shape::scale`).

use std::io::{self, Write};

use allocsim_model::format::format_size as fs;
use allocsim_replay::Prepared;
use allocsim_replay::run::Limits;
use allocsim_replay::settings_change::NotReproduced;
use allocsim_shape::predict::{Bound, Setting};
use allocsim_shape::scale::{Largest, Prediction, ScaleAnswer as Found};
use allocsim_shape::steps::{Input, Role, StepsFrom};
use allocsim_shape::{Budget, Question};
use allocsim_whatif::fit::{DEFAULT_OUTSIDE_MEMORY, outside_memory_from_ooms};
use comfy_table::{Table, presets};
use serde_json::Value;

use crate::{Answer, Error, Trace, TraceOptions};

/// Which budget `--largest-under` searches under.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LargestUnder {
    /// The allowed maximum given (`--largest-under BYTES`).
    Bytes(u64),
    /// The trace's own budget (or `--capacity`).
    Budget,
}

/// `scale`'s question.
#[derive(Clone, Debug, Default)]
pub struct ScaleOptions {
    pub trace: TraceOptions,
    /// The shape parameter: the annotation `record_function("PARAM=VALUE")` around each step.
    pub param: String,
    /// `--values`, one list per trace (in order): the value of each iteration of the `phases`
    /// layout (`None`: not told). Empty: the values are the annotations.
    pub values: Vec<Vec<Option<u64>>>,
    /// `--values` mode: iterations end at each annotation of this name.
    pub by: Option<String>,
    /// The step of the first trace whose end state the asked steps follow (default: its last).
    pub after: Option<usize>,
    pub predict: Vec<u64>,
    /// Values whose steps are not learnt from (to check a prediction against them).
    pub hold_out: Vec<u64>,
    pub largest_under: Option<LargestUnder>,
    /// Cards to find the largest value on (bytes each).
    pub cards: Vec<u64>,
    /// Memory outside the allocator on a card (default: what the trace's OOM entries show, else
    /// the CUDA context measured on an H200).
    pub reserve: Option<u64>,
    /// The largest value's multiple (default: the recorded values' greatest common divisor).
    pub step: Option<u64>,
    /// Settings to replay under (default: the first trace's own).
    pub config: Option<String>,
    /// The allowed maximum (default: the first trace's own budget).
    pub capacity: Option<u64>,
}

/// `--values`' list: numbers, with `-` (or `_`, `?`) for an iteration whose value is not told.
pub fn parse_values(s: &str) -> Result<Vec<Option<u64>>, String> {
    s.split(',')
        .map(|x| {
            let x = x.trim();
            match x {
                "-" | "_" | "?" => Ok(None),
                _ => match x.parse::<u64>() {
                    Ok(0) => Err("--values: 0 is not a shape value (values are at least 1; `-` marks an iteration not told)".to_string()),
                    Ok(v) => Ok(Some(v)),
                    Err(_) => Err(format!("--values: {x:?} is not a whole number (use `-` for an iteration whose value is not told)")),
                },
            }
        })
        .collect()
}

/// `scale` on one or more traces of the same job (the first gives the state the asked steps
/// follow, its settings and budget).
pub fn scale(traces: &[Trace<'_>], a: &ScaleOptions) -> Result<ScaleAnswer, Error> {
    if traces.is_empty() {
        return Err(Error::Usage("no trace given".into()));
    }
    if a.param.is_empty() || a.param.contains('=') {
        return Err(Error::Usage(format!("--param {:?}: the shape parameter's name (annotated as NAME=VALUE)", a.param)));
    }
    if !a.values.is_empty() && a.values.len() != traces.len() {
        return Err(Error::Usage(format!(
            "{} --values list{} for {} traces: give one per trace, in order (or none: the traces' {}=VALUE annotations)",
            a.values.len(),
            if a.values.len() == 1 { "" } else { "s" },
            traces.len(),
            a.param
        )));
    }
    let mut prepared = Vec::with_capacity(traces.len());
    let mut config = None;
    for (i, t) in traces.iter().enumerate() {
        let (p, c) = a.trace.prepare_for(t.snapshot, a.config.as_deref(), if i == 0 { a.capacity } else { None })?;
        crate::input::no_requests(*t, &p, "learn steps from")?;
        if i == 0 {
            config = Some(c);
        }
        prepared.push(p);
    }
    let config = config.expect("a first trace");
    let p0 = &prepared[0];
    let inputs: Vec<Input<'_>> = traces
        .iter()
        .zip(&prepared)
        .enumerate()
        .map(|(i, (t, p))| Input { name: t.name, prepared: p, values: a.values.get(i).map(|v| v.as_slice()) })
        .collect();
    let limits = p0.limits(a.capacity);
    let setting = Setting { config: config.clone(), limits: limits.clone(), placement: p0.recorded_placement(), device_memory: None };
    let mut largest = Vec::new();
    match &a.largest_under {
        Some(LargestUnder::Bytes(b)) => largest.push(Budget {
            label: format!("an allowed maximum of {}", fs(*b)),
            capacity: *b,
            setting: Setting { limits: Limits { capacity: Some(*b), outside: limits.outside.clone() }, ..setting.clone() },
        }),
        Some(LargestUnder::Budget) => {
            let (cap, label) = match (limits.capacity, limits.outside.is_empty()) {
                (Some(c), _) if a.capacity.is_some() => (c, format!("--capacity {}", fs(c))),
                (Some(c), _) => (c, format!("the trace's allowed maximum ({})", fs(c))),
                (None, false) => (
                    p0.device_memory,
                    format!("the trace's full device ({} with {} held outside the allocator)", fs(p0.device_memory), fs(limits.outside.max())),
                ),
                (None, true) => {
                    return Err(Error::Usage(format!(
                        "{}: the trace ran under no allowed maximum and never filled its device, so it has no budget to search under: give --largest-under BYTES, --capacity or --cards",
                        traces[0].name
                    )));
                }
            };
            largest.push(Budget { label, capacity: cap, setting: setting.clone() });
        }
        None => {}
    }
    if !a.cards.is_empty() {
        let outside = match (a.reserve, outside_memory_from_ooms(p0)) {
            (Some(r), _) => r,
            (None, Some(r)) if p0.budget.device_full.is_empty() => r,
            _ => DEFAULT_OUTSIDE_MEMORY,
        };
        for &card in &a.cards {
            let usable = card.saturating_sub(outside);
            largest.push(Budget {
                label: format!("a {} card ({} usable, {} outside the allocator)", fs(card), fs(usable), fs(outside)),
                capacity: usable,
                setting: Setting { limits: Limits::capacity(Some(usable)), device_memory: Some(card), ..setting.clone() },
            });
        }
    }
    let q = Question { param: &a.param, by: a.by.as_deref(), after: a.after, predict: &a.predict, hold_out: &a.hold_out, setting, largest, step: a.step };
    let found = allocsim_shape::scale(&inputs, &q).map_err(|e| Error::Usage(e.to_string()))?;
    let conf = if config.source.is_empty() { "the defaults".to_string() } else { config.source.clone() };
    let budget = match limits.capacity {
        Some(c) => format!("an allowed maximum of {}", fs(c)),
        None if !limits.outside.is_empty() => format!("the trace's full device ({} held outside the allocator at most)", fs(limits.outside.max())),
        None => "no allowed maximum".to_string(),
    };
    let not_reproduced = prepared.iter().map(Prepared::not_reproduced).collect();
    Ok(ScaleAnswer { conf, own_settings: p0.is_own(&config, a.capacity), budget, capacity: limits.capacity, found, not_reproduced })
}

/// What `scale` found.
pub struct ScaleAnswer {
    /// The replayed settings in words.
    pub conf: String,
    pub own_settings: bool,
    /// The asked steps' budget in words, and its allowed maximum.
    pub budget: String,
    pub capacity: Option<u64>,
    pub found: Found,
    /// Per trace (in `found.traces`' order): its own replay is not the recording.
    pub not_reproduced: Vec<Option<NotReproduced>>,
}

fn list(v: &[u64]) -> String {
    v.iter().map(|b| b.to_string()).collect::<Vec<_>>().join(", ")
}

/// A list shortened to its first `n` items and a count.
fn short(v: &[String], n: usize) -> String {
    if v.len() <= n { v.join(", ") } else { format!("{}, … ({} in all)", v[..n].join(", "), v.len()) }
}

fn range(lo: u64, hi: u64) -> String {
    if lo == hi { fs(lo) } else { format!("{}–{}", fs(lo), fs(hi)) }
}

fn plural(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

impl ScaleAnswer {
    fn write_learnt(&self, out: &mut dyn Write) -> io::Result<()> {
        let f = &self.found;
        let param = &f.param;
        for (i, t) in f.traces.iter().enumerate() {
            let how = match &t.from {
                StepsFrom::Annotations { name } => format!("record_function regions {name}=VALUE"),
                StepsFrom::Values { iterations, given, iterations_found } => {
                    let rest = if given < iterations_found { format!("; {} without a value", iterations_found - given) } else { String::new() };
                    format!("{iterations}; {param} given with --values{rest}")
                }
            };
            writeln!(out, "{}: {} ({how})", t.name, plural(t.steps.len(), "step", "steps"))?;
            crate::input::write_not_reproduced(out, self.not_reproduced.get(i).and_then(Option::as_ref), false)?;
            let learnt: Vec<String> = t.steps.iter().filter(|s| matches!(s.role, Role::Learnt { .. })).map(|s| s.index.to_string()).collect();
            if !learnt.is_empty() {
                writeln!(out, "  learnt from steps {}", short(&learnt, 16))?;
            }
            for s in &t.steps {
                let v = s.value.map_or("no value".to_string(), |v| format!("{param}={v}"));
                let why = match s.role {
                    Role::Learnt { .. } | Role::NoValue => continue,
                    Role::HeldOut => "held out; not learnt from".to_string(),
                    Role::First { more_requests } => format!(
                        "the first step ({} requests, {} more than the later steps make: setup, the optimizer's state); not learnt from",
                        s.requests, more_requests
                    ),
                    Role::Superseded { by } => format!(
                        "differs from the later steps at its value in its requests or frees (a warm-up step; structure {by} is learnt); not learnt from"
                    ),
                    Role::Incomplete => "cut off by the trace's start or end; not learnt from".to_string(),
                    Role::RecordedOom => "cut short by a recorded OOM; not learnt from".to_string(),
                    Role::Unusable => "restores a CUDA-graph pool to a checkpoint, or releases from before the trace; not learnt from".to_string(),
                };
                writeln!(out, "  step {} ({v}): {why}", s.index)?;
            }
        }
        writeln!(
            out,
            "  {} of requests{}:",
            plural(f.structures.len(), "structure", "structures"),
            if f.structures.len() > 1 { " (steps that make the same requests, by stream, pool and stack, in the same order)" } else { "" }
        )?;
        for s in &f.structures {
            let c = &s.fits;
            let mut kinds = Vec::new();
            for (n, what) in [(c.affine, "affine"), (c.quadratic, "quadratic"), (c.constant, "constant"), (c.piecewise, "piecewise")] {
                if n > 0 {
                    kinds.push(format!("{n} {what}"));
                }
            }
            let steps: Vec<String> = s.steps.iter().map(|&(t, i)| if f.traces.len() > 1 { format!("{t}:{i}") } else { i.to_string() }).collect();
            writeln!(
                out,
                "    {}: {} requests per step at {param} = {} (steps {}): {}",
                s.id,
                s.requests,
                short(&s.values.iter().map(|v| v.to_string()).collect::<Vec<_>>(), 12),
                short(&steps, 8),
                kinds.join(", ")
            )?;
            let mut notes = Vec::new();
            if c.checked > 0 {
                notes.push(format!("{} checked on a value not used for the fit", c.checked));
            }
            if c.unchecked > 0 {
                notes.push(format!("{} through every recorded value with none left to check on", c.unchecked));
            }
            if c.single_valued > 0 {
                notes.push(format!("{} seen at one value only", c.single_valued));
            }
            if c.piecewise > 0 {
                notes.push(format!("the piecewise ones up to {} off a line", fs(c.worst_deviation)));
            }
            if s.conflicts > 0 {
                notes.push(format!("{} differ between steps at one value (the larger kept)", s.conflicts));
            }
            if !notes.is_empty() {
                writeln!(out, "       {}", notes.join("; "))?;
            }
        }
        for w in &f.switches {
            writeln!(out, "  between {param}={} and {param}={} the requests change (structure {} → {}):", w.below, w.above, w.from_structure, w.to_structure)?;
            if w.appear.requests > 0 {
                writeln!(
                    out,
                    "    {} appear ({} at {}; seen at {}; made at {})",
                    plural(w.appear.requests as usize, "request", "requests"),
                    fs(w.appear.bytes),
                    w.above,
                    list(&w.appear.seen_at),
                    short(&w.appear.call_sites, 3)
                )?;
            }
            if w.disappear.requests > 0 {
                writeln!(
                    out,
                    "    {} no longer made ({} at {}; made at {})",
                    plural(w.disappear.requests as usize, "request is", "requests are"),
                    fs(w.disappear.bytes),
                    w.below,
                    short(&w.disappear.call_sites, 3)
                )?;
            }
        }
        if !f.ambiguous_values.is_empty() {
            writeln!(out, "  note: at {param} = {} the traces' steps make different requests; the first trace's are learnt", list(&f.ambiguous_values))?;
        }
        let sc = &f.self_check;
        match &sc.first_difference {
            None if sc.steps > 0 => writeln!(
                out,
                "  self-check: each learnt step replayed in place of the recorded one gives the trace's own peaks back ({}/{})",
                sc.agree, sc.steps
            )?,
            None => {}
            Some(d) => writeln!(
                out,
                "  self-check: the learnt steps give the trace's own peaks back for {}/{}; first difference at step {} ({param}={}): {}, {} and {} replayed",
                sc.agree,
                sc.steps,
                d.step,
                d.value,
                match d.predicted {
                    Some(p) => format!("allocated {} and reserved {} predicted", fs(p.0), fs(p.1)),
                    None => "it could not be synthesized".to_string(),
                },
                fs(d.replayed.0),
                fs(d.replayed.1)
            )?,
        }
        Ok(())
    }

    fn write_predictions(&self, out: &mut dyn Write) -> io::Result<()> {
        let f = &self.found;
        let param = &f.param;
        if f.predictions.is_empty() {
            return Ok(());
        }
        let a = &f.after;
        writeln!(
            out,
            "predicted after step {}{} (allocated {}, reserved {}) under {}{}, {}:",
            a.index,
            a.value.map(|v| format!(" ({param}={v})")).unwrap_or_default(),
            fs(a.allocated),
            fs(a.reserved),
            self.conf,
            if self.own_settings { " (the trace's own)" } else { "" },
            self.budget
        )?;
        let mut table = Table::new();
        table.load_style(presets::UTF8_FULL_CONDENSED);
        table.set_header(vec![param.as_str(), "peak allocated", "peak reserved", "new segments", "OOM", ""]);
        for p in &f.predictions {
            table.add_row(prediction_row(p));
        }
        for line in table.to_string().lines() {
            writeln!(out, "  {}", line.trim_end())?;
        }
        for p in &f.predictions {
            if let Some(e) = &p.error {
                writeln!(out, "  {param}={}: {e}", p.value)?;
            }
            for r in &p.runs {
                if let Some(o) = &r.reading.oom {
                    let at = o.call_site.as_ref().map(|c| format!(" at {c}")).unwrap_or_default();
                    writeln!(
                        out,
                        "  {param}={}{}: request {} of the step ({}){at} runs out of memory: {}",
                        p.value,
                        run_label(p, r),
                        o.request,
                        fs(o.size),
                        o.message
                    )?;
                    break;
                }
            }
            if !p.caveats.is_empty() {
                writeln!(out, "  {param}={}: {}", p.value, p.caveats.join("; "))?;
            }
        }
        Ok(())
    }

    fn write_largest(&self, out: &mut dyn Write) -> io::Result<()> {
        let f = &self.found;
        let param = &f.param;
        for l in &f.largest {
            writeln!(out, "{}", largest_line(param, l))?;
        }
        Ok(())
    }
}

fn run_label(p: &Prediction, r: &allocsim_shape::scale::Run) -> String {
    let mut parts = Vec::new();
    if p.switch_between.is_some() {
        parts.push(format!("as structure {}", r.structure));
    }
    match r.bound {
        Bound::Fitted => {}
        Bound::Low => parts.push("with the requests seen at one value at the smaller end".into()),
        Bound::High => parts.push("with the requests seen at one value at the larger end".into()),
    }
    if parts.is_empty() { String::new() } else { format!(" ({})", parts.join(", ")) }
}

fn prediction_row(p: &Prediction) -> Vec<String> {
    if p.runs.is_empty() {
        return vec![p.value.to_string(), "—".into(), "—".into(), "—".into(), "".into(), "cannot be predicted".into()];
    }
    let segs: Vec<u32> = p.runs.iter().map(|r| r.reading.new_segments).collect();
    let bytes: Vec<u64> = p.runs.iter().map(|r| r.reading.new_segment_bytes).collect();
    let (slo, shi) = (*segs.iter().min().unwrap_or(&0), *segs.iter().max().unwrap_or(&0));
    let (blo, bhi) = (*bytes.iter().min().unwrap_or(&0), *bytes.iter().max().unwrap_or(&0));
    let new = if shi == 0 {
        "0".to_string()
    } else if slo == shi {
        format!("{slo} ({})", range(blo, bhi))
    } else {
        format!("{slo}–{shi} ({})", range(blo, bhi))
    };
    let oom = match (p.ooms, p.runs.len()) {
        (0, _) => String::new(),
        (n, m) if n == m => "OOM".into(),
        (n, m) => format!("OOM in {n} of {m}"),
    };
    let mut notes = Vec::new();
    if p.exact {
        notes.push("exact".to_string());
    }
    if p.extrapolated {
        notes.push("extrapolated".into());
    }
    if let Some((a, b)) = p.switch_between {
        notes.push(format!("switch between {a} and {b}"));
    }
    if p.runs.iter().any(|r| r.bound != Bound::Fitted) {
        let same = p.peak_allocated.0 == p.peak_allocated.1 && p.peak_reserved.0 == p.peak_reserved.1;
        notes.push(if same { "requests seen at one value: the same at both ends" } else { "range: requests seen at one value" }.into());
    }
    vec![p.value.to_string(), range(p.peak_allocated.0, p.peak_allocated.1), range(p.peak_reserved.0, p.peak_reserved.1), new, oom, notes.join("; ")]
}

/// The largest value under one budget, in words.
pub fn largest_line(param: &str, l: &Largest) -> String {
    let mut s = format!("largest {param} under {}: ", l.label);
    match (l.value, l.no_oom_up_to) {
        (_, Some(v)) => {
            s += &format!("no OOM found: {param}={v} and every value doubling up to it from the largest recorded one ran ({} replays)", l.replays);
            if let Some(u) = l.unpredictable.first() {
                s += &format!("; at {u} a fit gives no positive size, so larger values cannot be synthesized");
            }
            return s;
        }
        (Some(v), None) => {
            s += &format!("{v} (a multiple of {})", l.step);
            if let (Some(pa), Some(pr)) = (l.peak_allocated, l.peak_reserved) {
                s += &format!(", peak allocated {} and reserved {} there", fs(pa), fs(pr));
            }
            if let Some(o) = l.first_oom_above {
                s += &format!("; {o} runs out of memory");
            }
        }
        (None, _) => {
            s += &format!("none: every multiple of {} up to {} runs out of memory", l.step, l.first_oom_above.unwrap_or(l.searched.1));
        }
    }
    s += &format!("; every multiple of {} from {} to {} replayed ({} replays)", l.step, l.searched.0, l.searched.1, l.replays);
    if !l.non_monotone.is_empty() {
        let r: Vec<String> = l.non_monotone.iter().map(|&(a, b)| if a == b { a.to_string() } else { format!("{a}–{b}") }).collect();
        s += &format!(
            "; not monotone: {} below it run{} out of memory",
            short(&r, 6),
            if l.non_monotone.len() == 1 && l.non_monotone[0].0 == l.non_monotone[0].1 { "s" } else { "" }
        );
    }
    if let Some(o) = l.optimistic {
        s += &format!("; {o} with the requests seen at one value at the smaller end of their range");
    }
    if !l.unpredictable.is_empty() {
        s += &format!(
            "; {} value{} could not be synthesized (a fit gives no positive size)",
            l.unpredictable.len(),
            if l.unpredictable.len() == 1 { "" } else { "s" }
        );
    }
    s
}

impl Answer for ScaleAnswer {
    fn write_text(&self, out: &mut dyn Write) -> io::Result<()> {
        self.write_learnt(out)?;
        self.write_predictions(out)?;
        self.write_largest(out)
    }
    fn to_json(&self) -> Value {
        let mut v = serde_json::to_value(&self.found).expect("JSON");
        v["config"] = Value::String(self.conf.clone());
        v["own_settings"] = Value::Bool(self.own_settings);
        v["capacity"] = serde_json::json!(self.capacity);
        if let Some(traces) = v["traces"].as_array_mut() {
            for (t, n) in traces.iter_mut().zip(&self.not_reproduced) {
                crate::input::add_not_reproduced_json(t, n.as_ref());
            }
        }
        v
    }
}
