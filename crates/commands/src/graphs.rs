//! `graphs`: what capturing CUDA graphs for other batch sizes into one shared pool would
//! reserve, learnt from a trace that captured a few (logic: `allocsim_graphs`).

use std::io::{self, Write};

use allocsim_graphs::{GraphsAnswer as Found, Question, Reading};
use allocsim_model::format::format_size as fs;
use comfy_table::{Table, presets};
use serde_json::Value;

use crate::{Answer, Error, Trace, TraceOptions};

/// `graphs`' question.
#[derive(Clone, Debug)]
pub struct GraphsOptions {
    pub trace: TraceOptions,
    /// The batch size of each capture in the trace, in order (a trace does not record them).
    pub captured: Vec<u64>,
    /// The batch sizes to predict, in capture order (default: the recorded ones).
    pub batches: Vec<u64>,
    /// Settings to replay under (default: the trace's own).
    pub config: Option<String>,
    /// The allowed maximum (default: the trace's own budget).
    pub capacity: Option<u64>,
    /// Segment placements to replay under (the trace's own addresses first).
    pub placements: usize,
}

impl Default for GraphsOptions {
    fn default() -> Self {
        GraphsOptions { trace: TraceOptions::default(), captured: Vec::new(), batches: Vec::new(), config: None, capacity: None, placements: 4 }
    }
}

/// `graphs`.
pub fn graphs(t: Trace<'_>, a: &GraphsOptions) -> Result<GraphsAnswer, Error> {
    if a.captured.is_empty() {
        return Err(Error::Usage(
            "the batch size of each capture in the trace is needed (--captured 256,128,…, in capture order): a trace does not record it".into(),
        ));
    }
    let (p, config) = a.trace.prepare_for(t.snapshot, a.config.as_deref(), a.capacity)?;
    crate::input::no_requests(t, &p, "learn captures from")?;
    let batches = if a.batches.is_empty() { a.captured.clone() } else { a.batches.clone() };
    let limits = p.limits(a.capacity);
    let q = Question { captured: &a.captured, batches: &batches, config: &config, limits: &limits, placements: a.placements };
    let found = allocsim_graphs::predict(&p, &q).map_err(|e| Error::Usage(format!("{}: {e}", t.name)))?;
    let conf = if config.source.is_empty() { "the defaults".to_string() } else { config.source.clone() };
    Ok(GraphsAnswer { name: t.name.to_owned(), conf, own_settings: p.is_own(&config, a.capacity), found, not_reproduced: p.not_reproduced() })
}

/// What `graphs` found.
pub struct GraphsAnswer {
    pub name: String,
    /// The replayed settings in words.
    pub conf: String,
    /// Replayed under the trace's own settings and budget.
    pub own_settings: bool,
    pub found: Found,
    /// The trace's own replay is not the recording.
    pub not_reproduced: Option<allocsim_replay::settings_change::NotReproduced>,
}

fn list(v: &[u64]) -> String {
    v.iter().map(|b| b.to_string()).collect::<Vec<_>>().join(", ")
}

fn delta(now: u64, before: u64) -> String {
    match now.cmp(&before) {
        std::cmp::Ordering::Equal => "0".into(),
        std::cmp::Ordering::Greater => format!("+{}", fs(now - before)),
        std::cmp::Ordering::Less => format!("−{}", fs(before - now)),
    }
}

fn range(lo: u64, hi: u64) -> String {
    if lo == hi { fs(lo) } else { format!("{}–{}", fs(lo), fs(hi)) }
}

impl Answer for GraphsAnswer {
    fn write_text(&self, out: &mut dyn Write) -> io::Result<()> {
        let f = &self.found;
        let pat = &f.pattern;
        let recorded: Vec<u64> = f.recorded.iter().map(|r| r.batch).collect();
        writeln!(out, "{}: {} captures into graph pool ({}, {}) at batch sizes {}", self.name, f.recorded.len(), f.pool.0, f.pool.1, list(&recorded))?;
        crate::input::write_not_reproduced(out, self.not_reproduced.as_ref(), false)?;
        writeln!(
            out,
            "  each round (as the one at batch size {} makes it): {} requests, {} of them in the graph pool, {} empty_cache() call{}",
            pat.from_batch,
            pat.requests,
            pat.pool_requests,
            pat.empty_cache_calls,
            if pat.empty_cache_calls == 1 { "" } else { "s" }
        )?;
        if !pat.first_only.is_empty() {
            writeln!(
                out,
                "  the first round makes {} more ({} at batch size {}; kept at that size for any batch size)",
                pat.first_only.len(),
                fs(pat.first_only_bytes),
                recorded[0]
            )?;
        }
        let n = pat.requests;
        let quadratic = if pat.quadratic > 0 { format!(", {} grow quadratically", pat.quadratic) } else { String::new() };
        if pat.piecewise.is_empty() {
            writeln!(
                out,
                "  sizes: {} of {n} requests grow linearly with the batch size{quadratic}, {} do not change; every recorded size lies on its {}",
                pat.affine,
                pat.constant,
                if pat.quadratic > 0 { "curve" } else { "line" }
            )?;
        } else {
            let worst = pat.piecewise.iter().map(|x| x.1).max().unwrap_or(0);
            writeln!(
                out,
                "  sizes: {} of {n} requests grow linearly with the batch size{quadratic}, {} do not change, {} follow no line (interpolated between the recorded batch sizes; up to {} off the line through the outermost two)",
                pat.affine,
                pat.constant,
                pat.piecewise.len(),
                fs(worst)
            )?;
        }
        let sc = &f.self_check;
        match &sc.first_difference {
            None => writeln!(
                out,
                "  self-check: predicting the recorded batch sizes gives the trace's own replay back after every capture ({}/{})",
                sc.agree, sc.rounds
            )?,
            Some((b, mine, own)) => writeln!(
                out,
                "  self-check: predicting the recorded batch sizes gives the trace's own replay back after {}/{} captures; first difference at batch size {b}: reserved {} predicted, {} replayed",
                sc.agree,
                sc.rounds,
                fs(mine.reserved),
                fs(own.reserved)
            )?,
        }
        let pr = &f.prediction;
        writeln!(
            out,
            "predicted under {}{}: {} captures (before the first: reserved {}, allocated {})",
            self.conf,
            if self.own_settings { " (the trace's own)" } else { "" },
            pr.captures.len(),
            fs(pr.before.reserved),
            fs(pr.before.allocated)
        )?;
        let mut table = Table::new();
        table.load_style(presets::UTF8_FULL_CONDENSED);
        table.set_header(vec!["batch", "reserved", "change", "graph pool", "allocated", "round's peak", ""]);
        let mut prev: Reading = pr.before;
        for (k, c) in pr.captures.iter().enumerate() {
            let (lo, hi) = f.reserved_ranges[k];
            let mut notes = Vec::new();
            if c.extrapolated {
                notes.push("extrapolated".to_string());
            }
            if lo != hi {
                notes.push(format!("{} across placements", range(lo, hi)));
            }
            if c.ooms > 0 {
                notes.push(format!("{} OOM{}", c.ooms, if c.ooms == 1 { "" } else { "s" }));
            }
            table.add_row(vec![
                c.batch.to_string(),
                fs(c.after.reserved),
                delta(c.after.reserved, prev.reserved),
                fs(c.after.pool_reserved),
                fs(c.after.allocated),
                fs(c.round_peak_reserved),
                notes.join("; "),
            ]);
            prev = c.after;
        }
        for line in table.to_string().lines() {
            writeln!(out, "  {}", line.trim_end())?;
        }
        let at = match pr.peak_round {
            Some(k) => format!("in the round of batch size {} (warm-up or capture)", pr.captures[k].batch),
            None => "before the first round".to_string(),
        };
        let spread = if f.placement_independent {
            " (expandable segments: placement does not matter)".to_string()
        } else if f.peak_range.0 != f.peak_range.1 {
            format!(" ({} depending on where the driver places segments, {} placements)", range(f.peak_range.0, f.peak_range.1), f.placements.len() + 1)
        } else {
            format!(" (the same under {} placements)", f.placements.len() + 1)
        };
        writeln!(out, "  peak reserved {} {at}{spread}", fs(pr.peak_reserved))?;
        if let Some(last) = pr.captures.last() {
            writeln!(out, "  the graph pool holds {} in {} segments after the last capture", fs(last.after.pool_reserved), last.after.pool_segments)?;
        }
        if pr.ooms > 0 {
            writeln!(out, "  {} requests ran out of memory", pr.ooms)?;
        }
        if !f.extrapolated.is_empty() {
            writeln!(
                out,
                "  note: {} {} outside the recorded batch sizes ({}–{}): their sizes come from the fitted lines, which the recording cannot confirm there",
                list(&f.extrapolated),
                if f.extrapolated.len() == 1 { "lies" } else { "lie" },
                f.recorded_range.0,
                f.recorded_range.1
            )?;
        }
        Ok(())
    }
    fn to_json(&self) -> Value {
        let mut v = serde_json::to_value(&self.found).expect("JSON");
        v["config"] = Value::String(self.conf.clone());
        v["own_settings"] = Value::Bool(self.own_settings);
        crate::input::add_not_reproduced_json(&mut v, self.not_reproduced.as_ref());
        v
    }
}
