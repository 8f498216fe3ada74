//! `phases`: the trace cut into iterations and annotated regions, each with its peaks under the
//! replayed config (logic: `allocsim_phases`).

use std::io::{self, Write};

use allocsim_model::format::format_size as fs;
use allocsim_phases::{Layout, Phases, Source, measure};
use allocsim_replay::settings_change::NotReproduced;
use comfy_table::{Table, presets};
use serde_json::Value;

use crate::{Answer, Error, Trace, TraceOptions};

/// `phases`' question.
#[derive(Clone, Debug)]
pub struct PhasesOptions {
    pub trace: TraceOptions,
    /// Settings to replay under (default: the trace's own).
    pub config: Option<String>,
    /// The allowed maximum, as `set_per_process_memory_fraction` gives it.
    pub capacity: Option<u64>,
    /// Iterations end at the end of each annotation of this name (or `NAME#…`); default: the
    /// optimizer's step (`Optimizer.step#…`), else the repeating request pattern.
    pub by: Option<String>,
    /// How many call sites of live blocks to list at each iteration's peak.
    pub top: usize,
}

impl Default for PhasesOptions {
    fn default() -> Self {
        PhasesOptions { trace: TraceOptions::default(), config: None, capacity: None, by: None, top: 3 }
    }
}

/// `phases`.
pub fn phases(t: Trace<'_>, a: &PhasesOptions) -> Result<PhasesAnswer, Error> {
    let (p, config) = a.trace.prepare_for(t.snapshot, a.config.as_deref(), a.capacity)?;
    let layout = Layout::of(&p, a.by.as_deref()).map_err(|e| Error::Usage(e.to_string()))?;
    let phases = measure(&p, &layout, &config, a.capacity, &p.recorded_placement(), a.top);
    let conf = if config.source.is_empty() { "the defaults".to_string() } else { config.source.clone() };
    Ok(PhasesAnswer { phases, conf, capacity: a.capacity, not_reproduced: p.not_reproduced() })
}

/// What `phases` found.
pub struct PhasesAnswer {
    pub phases: Phases,
    /// The replayed settings in words.
    pub conf: String,
    pub capacity: Option<u64>,
    /// The trace's own replay is not the recording.
    pub not_reproduced: Option<NotReproduced>,
}

/// `phases --json`: the phases' fields, then [`crate::input::NotReproducedKeys`].
#[derive(serde::Serialize)]
struct PhasesJson<'a> {
    #[serde(flatten)]
    phases: &'a Phases,
    #[serde(flatten)]
    reproduced: crate::input::NotReproducedKeys<'a>,
}

impl PhasesAnswer {
    fn json_view(&self) -> PhasesJson<'_> {
        PhasesJson { phases: &self.phases, reproduced: crate::input::NotReproducedKeys::of(self.not_reproduced.as_ref()) }
    }
}

impl Answer for PhasesAnswer {
    fn write_text(&self, out: &mut dyn Write) -> io::Result<()> {
        write_phases(out, &self.phases, &self.conf, self.capacity, self.not_reproduced.as_ref())
    }
    fn to_json(&self) -> Value {
        serde_json::to_value(self.json_view()).expect("JSON")
    }
    fn write_json(&self, out: &mut dyn Write) -> io::Result<()> {
        crate::write_json(out, &self.json_view())
    }
}

/// How the iterations were found, in words.
pub fn source_text(s: &Source) -> String {
    match s {
        Source::Annotation { names } => format!("iterations end at each `{}` annotation", names.join("`/`")),
        Source::Pattern { marker, repeats, live_spread, median_rise, .. } => format!(
            "no optimizer annotations; iterations from a request that repeats {repeats} times ({marker}), the live memory at each repeat's start within {} of the others while a repeat rises {} above it",
            fs(*live_spread),
            fs(*median_rise)
        ),
        Source::Whole { reason } => format!("one iteration, the whole trace ({reason})"),
    }
}

fn signed(d: Option<i64>) -> String {
    match d {
        None => String::new(),
        Some(0) => "0".into(),
        Some(d) => format!("{}{}", if d > 0 { "+" } else { "−" }, fs(d.unsigned_abs())),
    }
}

/// `phases` as text: the iterations table (the peak one marked), then per region name its largest
/// peak and where.
pub fn write_phases(out: &mut dyn Write, ph: &Phases, conf: &str, capacity: Option<u64>, not_reproduced: Option<&NotReproduced>) -> io::Result<()> {
    writeln!(
        out,
        "Device {}: {} requests replayed under {conf}{}; {}.",
        ph.device,
        ph.requests,
        capacity.map_or(String::new(), |c| format!(", {} allowed", fs(c))),
        source_text(&ph.source)
    )?;
    crate::input::write_not_reproduced(out, not_reproduced, false)?;
    writeln!(
        out,
        "Peak allocated {}, peak reserved {}{}.",
        fs(ph.peak_allocated),
        fs(ph.peak_reserved),
        match ph.first_oom {
            Some(q) => format!("; {} OOM{} from request {q}", ph.ooms, if ph.ooms == 1 { "" } else { "s" }),
            None => String::new(),
        }
    )?;
    let mut t = Table::new();
    t.load_style(presets::UTF8_FULL_CONDENSED);
    t.set_header(["iter", "requests", "peak allocated", "Δ", "peak reserved", "Δ", "new segments", "OOMs", "largest at the peak"]);
    for it in &ph.iterations {
        let mark = match (it.global_peak, it.global_peak_reserved) {
            (true, true) => " ◆",
            (true, false) => " ◆a",
            (false, true) => " ◆r",
            _ => "",
        };
        let site = it
            .live_at_peak
            .first()
            .map_or(String::new(), |s| format!("{} in {} block{} at {}", fs(s.bytes), s.blocks, if s.blocks == 1 { "" } else { "s" }, s.call_site));
        t.add_row([
            format!("{}{}{mark}", it.index, if it.complete { "" } else { " (partial)" }),
            it.peaks.requests.to_string(),
            fs(it.peaks.peak_allocated),
            signed(it.delta_peak_allocated),
            fs(it.peaks.peak_reserved),
            signed(it.delta_peak_reserved),
            if it.peaks.new_segments > 0 { format!("{} ({})", it.peaks.new_segments, fs(it.peaks.new_segment_bytes)) } else { String::new() },
            if it.peaks.ooms > 0 { it.peaks.ooms.to_string() } else { String::new() },
            site,
        ]);
    }
    writeln!(out, "{t}")?;
    writeln!(out, "◆ marks the iteration that first reached the run's peak (a: allocated, r: reserved).")?;
    if let Some(i) = ph.peak_iteration {
        let it = &ph.iterations[i];
        writeln!(
            out,
            "The peak allocated ({}) is reached in iteration {i}{}{}.",
            fs(it.peaks.peak_allocated),
            it.peaks.peak_request.map_or(String::new(), |q| format!(" at request {q}")),
            region_of(ph, it.peaks.peak_request).map_or(String::new(), |r| format!(", in {r}"))
        )?;
        if it.live_at_peak.len() > 1 {
            writeln!(out, "  Live then, by call site:")?;
            for s in &it.live_at_peak {
                writeln!(out, "  {:>12} in {} block{} from {}", fs(s.bytes), s.blocks, if s.blocks == 1 { "" } else { "s" }, s.call_site)?;
            }
        }
        let inside: Vec<_> = ph.regions.iter().filter(|r| r.iteration == Some(i)).collect();
        if !inside.is_empty() {
            writeln!(out, "  Its regions:")?;
            for r in inside {
                writeln!(
                    out,
                    "  {:indent$}{:<w$} peak allocated {:>12}, reserved {:>12}, {} requests{}",
                    "",
                    r.name,
                    fs(r.peaks.peak_allocated),
                    fs(r.peaks.peak_reserved),
                    r.peaks.requests,
                    if r.peaks.new_segments > 0 { format!(", {} new segments", r.peaks.new_segments) } else { String::new() },
                    indent = 2 * r.depth as usize,
                    w = 40usize.saturating_sub(2 * r.depth as usize)
                )?;
            }
        }
    }
    // Regions: per name, how many, and the largest peak.
    let mut names: Vec<&str> = Vec::new();
    for r in &ph.regions {
        if !names.contains(&r.name.as_str()) {
            names.push(&r.name);
        }
    }
    if !names.is_empty() {
        let mut t = Table::new();
        t.load_style(presets::UTF8_FULL_CONDENSED);
        t.set_header(["region", "times", "largest peak allocated", "in iteration", "largest peak reserved", "new segments"]);
        for n in names {
            let rs: Vec<_> = ph.regions.iter().filter(|r| r.name == n).collect();
            let top = rs.iter().max_by_key(|r| (r.peaks.peak_allocated, std::cmp::Reverse(r.peaks.start_us))).expect("a region");
            let segs: u32 = rs.iter().map(|r| r.peaks.new_segments).sum();
            t.add_row([
                n.to_string(),
                rs.len().to_string(),
                fs(top.peaks.peak_allocated),
                top.iteration.map_or(String::new(), |i| i.to_string()),
                fs(rs.iter().map(|r| r.peaks.peak_reserved).max().unwrap_or(0)),
                segs.to_string(),
            ]);
        }
        writeln!(out, "{t}")?;
    }
    Ok(())
}

/// The innermost region holding request `req`'s peak, by name (`None` without regions).
fn region_of(ph: &Phases, req: Option<u32>) -> Option<String> {
    let q = req?;
    let holds = |r: &&allocsim_phases::Region| r.peaks.first_request.is_some_and(|f| f <= q) && r.peaks.last_request.is_some_and(|l| q <= l);
    let mut v: Vec<_> = ph.regions.iter().filter(holds).collect();
    v.sort_by_key(|r| r.depth);
    (!v.is_empty()).then(|| v.iter().map(|r| r.name.as_str()).collect::<Vec<_>>().join(" › "))
}
