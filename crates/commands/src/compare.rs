//! `compare`: two runs of the same requests side by side (`allocsim_whatif::compare`): two
//! recorded runs as they were recorded, or one trace replayed under two settings; or many files as
//! the ranks of one job (`allocsim_phases::ranks`).

use std::io::{self, Write};
use std::path::PathBuf;

use allocsim_model::AllocatorConfig;
use allocsim_model::format::format_size;
use allocsim_model::format::format_size as fs;
use allocsim_phases::ranks::{RankSpec, Ranks, compare_runs};
use allocsim_replay::{Prepared, ReplayOutcome};
use allocsim_trace::Action;
use allocsim_whatif::compare::{Comparison, Side, compare};
use comfy_table::{Table, presets};
use serde_json::Value;

use crate::{Answer, Error, Trace, TraceOptions};

/// `compare`'s question on one trace: its requests replayed under two settings.
#[derive(Clone, Debug)]
pub struct CompareOptions {
    pub trace: TraceOptions,
    /// Settings for side A (default: the trace's own).
    pub config: Option<String>,
    /// Settings for side B (default: the trace's own).
    pub config_b: Option<String>,
    /// The allowed maximum (default: the trace's own budget, inferred from it).
    pub capacity: Option<u64>,
    /// How many call sites of new segments to list.
    pub top: usize,
}

impl Default for CompareOptions {
    fn default() -> Self {
        CompareOptions { trace: TraceOptions::default(), config: None, config_b: None, capacity: None, top: 10 }
    }
}

/// What `compare` of two runs found.
pub struct CompareAnswer {
    pub comparison: Comparison,
    /// How many call sites the text lists.
    pub top: usize,
    /// Which device each recorded run is answered for, where a file has several (the command
    /// line prints these before the answer, or on stderr with `--json`).
    pub notes: Vec<String>,
}

impl Answer for CompareAnswer {
    fn write_text(&self, out: &mut dyn Write) -> io::Result<()> {
        write_comparison(out, &self.comparison, self.top)
    }
    fn to_json(&self) -> Value {
        serde_json::to_value(&self.comparison).expect("JSON")
    }
    fn write_json(&self, out: &mut dyn Write) -> io::Result<()> {
        crate::write_json(out, &self.comparison)
    }
}

/// Two recorded runs of the same requests (the same job under other settings, another card),
/// each as it was recorded: its own segment events, which a self replay reproduces exactly. Of
/// `o`, only the device and `top` apply; the options of a replay are refused, not ignored.
pub fn compare_recorded(a: Trace<'_>, b: Trace<'_>, o: &CompareOptions) -> Result<CompareAnswer, Error> {
    let given: Vec<&str> = [
        ("--config", o.config.is_some()),
        ("--config-b", o.config_b.is_some()),
        ("--capacity", o.capacity.is_some()),
        ("--device-memory", o.trace.device_memory.is_some()),
        ("--trace-capacity", o.trace.trace_capacity.is_some()),
    ]
    .into_iter()
    .filter_map(|(name, set)| set.then_some(name))
    .collect();
    if !given.is_empty() {
        return Err(Error::Usage(format!(
            "{} {} to one trace replayed under two settings (`compare FILE --config A --config-b B`), not to two recorded runs, which are compared as recorded",
            given.join(", "),
            if given.len() == 1 { "applies" } else { "apply" }
        )));
    }
    let mut notes = Vec::new();
    let sa = recorded_side(a, o.trace.device, &mut notes)?;
    let sb = recorded_side(b, o.trace.device, &mut notes)?;
    Ok(CompareAnswer { comparison: compare(&sa, &sb), top: o.top, notes })
}

/// One trace's requests replayed under `o.config` (side A) and `o.config_b` (side B), each the
/// trace's own settings where not given, under the same allowed maximum and placement.
pub fn compare_configs(t: Trace<'_>, o: &CompareOptions) -> Result<CompareAnswer, Error> {
    let p = o.trace.prepare(t.snapshot)?;
    let cfg = |c: &Option<String>| -> Result<(String, AllocatorConfig), Error> {
        match c {
            Some(s) => Ok((s.clone(), p.parse_config(s)?)),
            None => Ok(("its own settings".into(), p.own.clone())),
        }
    };
    let ((la, ca), (lb, cb)) = (cfg(&o.config)?, cfg(&o.config_b)?);
    let limits = p.limits(o.capacity);
    let oa = p.replay_under(&ca, &limits, p.recorded_placement());
    let ob = p.replay_under(&cb, &limits, p.recorded_placement());
    let (sa, sb) = (replayed_side(la, &p, &oa), replayed_side(lb, &p, &ob));
    Ok(CompareAnswer { comparison: compare(&sa, &sb), top: o.top, notes: Vec::new() })
}

/// A recorded run as one side: its own segment events (a self replay reproduces them exactly).
fn recorded_side(t: Trace<'_>, device: Option<usize>, notes: &mut Vec<String>) -> Result<Side, Error> {
    let p = TraceOptions { device, ..TraceOptions::default() }.prepare(t.snapshot)?;
    if let Some(text) = p.choice.describe() {
        notes.push(format!("{}: answering for {text}", t.name));
    }
    let mut deltas = Vec::new();
    let mut sites = Vec::new();
    let mut req = 0u32;
    let mut first_oom = None;
    let start = reserved_at_start(&p);
    let start_i = i64::try_from(start).unwrap_or(i64::MAX);
    let (mut cur, mut peak) = (start_i, start_i);
    for e in &p.trace {
        match e.action {
            Action::SegmentAlloc | Action::SegmentMap => {
                deltas.push((req, e.size as i64));
                cur = cur.saturating_add(e.size as i64);
                peak = peak.max(cur);
                sites.push((p.call_site(req).unwrap_or_else(|| "(no stack recorded for these requests)".into()), e.size));
            }
            Action::SegmentFree | Action::SegmentUnmap => {
                deltas.push((req, -(e.size as i64)));
                cur = cur.saturating_sub(e.size as i64);
            }
            Action::Alloc => req += 1,
            Action::Oom => {
                first_oom.get_or_insert(req);
                req += 1;
            }
            _ => {}
        }
    }
    Ok(Side {
        label: t.name.to_string(),
        reserved_at_start: start,
        reserved_deltas: deltas,
        peak_reserved: peak as u64,
        peak_allocated: p.own_outcome.stats.allocated_bytes.all().peak as u64,
        first_oom,
        requests: req,
        new_segment_sites: sites,
    })
}

/// What a trace that starts mid-history had reserved before its first entry: the state the
/// replay restores (`Program::initial`), so that a recorded side's peak is the replay's.
fn reserved_at_start(p: &Prepared) -> u64 {
    p.program.initial.as_ref().map_or(0, |s| s.reserved_bytes())
}

fn replayed_side(label: String, p: &Prepared, o: &ReplayOutcome) -> Side {
    let mut deltas = Vec::new();
    let mut sites = Vec::new();
    for e in &o.segment_events {
        let grow = e.action.reserves();
        deltas.push((e.request, if grow { e.size as i64 } else { -(e.size as i64) }));
        if grow {
            sites.push((p.call_site(e.request).unwrap_or_else(|| "(no stack recorded for these requests)".into()), e.size));
        }
    }
    Side {
        label,
        reserved_at_start: reserved_at_start(p),
        reserved_deltas: deltas,
        peak_reserved: o.peak_reserved,
        peak_allocated: o.stats.allocated_bytes.all().peak as u64,
        first_oom: o.first_oom(),
        requests: p.program.requests.len() as u32,
        new_segment_sites: sites,
    }
}

/// `compare` as text: peaks, first OOMs, where reserved memory diverges, the call sites that made
/// new segments on either side (`top` of them).
pub fn write_comparison(out: &mut dyn Write, c: &allocsim_whatif::compare::Comparison, top: usize) -> io::Result<()> {
    writeln!(out, "A: {}\nB: {}", c.a, c.b)?;
    if c.requests.0 != c.requests.1 {
        writeln!(out, "note: A has {} requests and B {}; compared over the first {}", c.requests.0, c.requests.1, c.requests.0.min(c.requests.1))?;
    }
    let oom = |x: Option<u32>| x.map_or("none".to_string(), |r| format!("at request {r}"));
    writeln!(out, "  peak reserved   A {:>12}   B {:>12}", format_size(c.peak_reserved.0), format_size(c.peak_reserved.1))?;
    writeln!(out, "  peak allocated  A {:>12}   B {:>12}", format_size(c.peak_allocated.0), format_size(c.peak_allocated.1))?;
    writeln!(out, "  first OOM       A {:>12}   B {:>12}", oom(c.first_oom.0), oom(c.first_oom.1))?;
    match c.first_divergence {
        None => writeln!(out, "  reserved memory is the same after every request")?,
        Some((r, x, y)) => {
            writeln!(out, "  reserved memory first differs after request {r}: A {} vs B {}", format_size(x), format_size(y))?;
            if let Some((r, x, y)) = c.largest_gap {
                writeln!(out, "  largest difference after request {r}: A {} vs B {}", format_size(x), format_size(y))?;
            }
        }
    }
    let diffs: Vec<_> = c.sites.iter().filter(|s| s.a_bytes != s.b_bytes).take(top).collect();
    if !diffs.is_empty() {
        let mut t = Table::new();
        t.load_style(presets::UTF8_FULL_CONDENSED);
        t.set_header(["call site of requests that made new segments", "A", "B", "B − A"]);
        for s in diffs {
            t.add_row([
                s.site.clone(),
                format_size(s.a_bytes),
                format_size(s.b_bytes),
                format!("{}{}", if s.b_bytes >= s.a_bytes { "+" } else { "−" }, format_size(s.b_bytes.abs_diff(s.a_bytes))),
            ]);
        }
        writeln!(out, "{t}")?;
    }
    Ok(())
}

/// The ranks question, its settings and spike ratio checked before any file is read (what
/// `compare` over ranks and the Python package's `allocsim.fleet` both ask).
pub fn rank_spec(config: Option<String>, capacity: Option<u64>, trace: TraceOptions, by: Option<String>, spike: f64) -> Result<RankSpec, Error> {
    if let Some(c) = &config {
        crate::parse_config(c)?;
    }
    if spike.partial_cmp(&1.0) != Some(std::cmp::Ordering::Greater) {
        return Err(Error::Usage(format!("--spike {spike}: expected a ratio above 1 (e.g. 1.1)")));
    }
    Ok(RankSpec { config, capacity, trace, by, spike_ratio: spike })
}

/// What `compare` over ranks found.
pub struct RanksAnswer {
    pub ranks: Ranks,
}

impl Answer for RanksAnswer {
    fn write_text(&self, out: &mut dyn Write) -> io::Result<()> {
        write_ranks(out, &self.ranks)
    }
    fn to_json(&self) -> Value {
        serde_json::to_value(&self.ranks).expect("JSON")
    }
    fn write_json(&self, out: &mut dyn Write) -> io::Result<()> {
        crate::write_json(out, &self.ranks)
    }
}

/// Every file replayed (in parallel) and compared as the ranks of one job.
pub fn ranks(files: &[PathBuf], spec: &RankSpec) -> RanksAnswer {
    RanksAnswer { ranks: compare_runs(files, spec) }
}

/// The error a ranks comparison ends with when some files could not be compared (their rows hold
/// why; the command prints the answer, then this line, and exits with status 2).
pub fn ranks_failure(k: &Ranks) -> Option<String> {
    let failed: Vec<_> = k.rows.iter().filter(|r| r.error.is_some()).collect();
    failed
        .first()
        .map(|r| format!("{} of {} files could not be compared; the first, {}: {}", failed.len(), k.rows.len(), r.file, r.error.as_deref().unwrap_or("")))
}

fn short(file: &str) -> &str {
    std::path::Path::new(file).file_name().and_then(|n| n.to_str()).unwrap_or(file)
}

/// The ranks as text: one row per file, the first OOM and the first spike, and (for up to 40
/// iterations) each file's iteration peaks over the median.
pub fn write_ranks(out: &mut dyn Write, k: &Ranks) -> io::Result<()> {
    let t0 = k.rows.iter().filter_map(|r| r.start_us).min();
    let at = |t: Option<i64>| match (t, t0) {
        (Some(t), Some(t0)) => format!("+{:.3} s", (t - t0) as f64 / 1e6),
        _ => String::new(),
    };
    let mut t = Table::new();
    t.load_style(presets::UTF8_FULL_CONDENSED);
    t.set_header([
        "file",
        "requests",
        "peak allocated",
        "peak reserved",
        "OOMs (recorded)",
        "first OOM",
        "unallocated at peak reserved",
        "iterations",
        "peak in",
        "max ÷ median",
    ]);
    for r in &k.rows {
        if let Some(e) = &r.error {
            t.add_row([short(&r.file).to_string(), format!("error: {e}")]);
            continue;
        }
        let worst = r.vs_median.iter().enumerate().max_by(|x, y| x.1.total_cmp(y.1));
        t.add_row([
            short(&r.file).to_string(),
            r.requests.to_string(),
            fs(r.peak_allocated),
            fs(r.peak_reserved),
            format!("{} ({})", r.ooms, r.recorded_ooms),
            r.first_oom.map_or(String::new(), |q| format!("request {q} {}", at(r.first_oom_us))),
            format!("{} ({:.1}%)", fs(r.unallocated_at_peak), 100.0 * r.fragmentation_at_peak),
            r.iteration_peaks.len().to_string(),
            r.peak_iteration.map_or(String::new(), |i| i.to_string()),
            worst.map_or(String::new(), |(i, v)| format!("{v:.2} (iteration {i})")),
        ]);
    }
    writeln!(out, "{t}")?;
    if let Some(o) = &k.first_oom {
        let what = if o.recorded { "recorded running out of memory first (no replay does)" } else { "runs out of memory first" };
        writeln!(
            out,
            "{} {what}{}{}",
            short(&o.file),
            o.request.map_or(String::new(), |q| format!(", at request {q}")),
            match at(o.time_us) {
                s if s.is_empty() => String::new(),
                s => format!(", {s} after the earliest trace starts"),
            }
        )?;
    }
    match &k.first_spike {
        Some(s) => writeln!(
            out,
            "{} spikes first: iteration {} peaks at {}, {:.2}× the median {} of that iteration",
            short(&s.file),
            s.iteration,
            fs(s.peak_allocated),
            s.ratio,
            fs(s.median)
        )?,
        None => writeln!(out, "no file's iteration peak reaches {:.2}× the median of its iteration", k.spike_ratio)?,
    }
    let ok: Vec<_> = k.rows.iter().filter(|r| r.error.is_none()).collect();
    let n = k.median_iteration_peaks.len();
    if n > 1 && n <= 40 && !ok.is_empty() {
        writeln!(out, "Iteration peaks ÷ the median of the files (* at or above {:.2}):", k.spike_ratio)?;
        let mut t = Table::new();
        t.load_style(presets::UTF8_FULL_CONDENSED);
        let mut header = vec!["file".to_string()];
        header.extend((0..n).map(|i| i.to_string()));
        t.set_header(header);
        let mut med = vec!["median".to_string()];
        med.extend(k.median_iteration_peaks.iter().map(|&m| fs(m)));
        t.add_row(med);
        for r in ok {
            let mut row = vec![short(&r.file).to_string()];
            row.extend(r.vs_median.iter().map(|v| format!("{v:.2}{}", if *v >= k.spike_ratio { "*" } else { "" })));
            t.add_row(row);
        }
        writeln!(out, "{t}")?;
    }
    Ok(())
}
