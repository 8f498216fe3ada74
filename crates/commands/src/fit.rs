//! `fit`: the smallest allowed maximum without OOM, and which cards suffice (logic:
//! `allocsim_whatif::fit`).

use std::io::{self, Write};

use allocsim_model::format::format_size;
use allocsim_whatif::fit::{DEFAULT_OUTSIDE_MEMORY, fit as fit_one, outside_memory_from_ooms};
use allocsim_whatif::grid::GridPoint;
use serde_json::{Value, json};

use crate::{Answer, Error, Trace, TraceOptions};

/// `fit`'s question.
#[derive(Clone, Debug)]
pub struct FitOptions {
    pub trace: TraceOptions,
    /// The settings to fit under (default: the trace's own).
    pub config: Option<String>,
    /// Fit every config of a grid instead (see `sweep`).
    pub grid: Option<String>,
    /// Cards to check (bytes).
    pub cards: Vec<u64>,
    /// Memory outside the allocator (default: what the trace's OOM entries show, else 518 MiB).
    pub reserve: Option<u64>,
    /// Also fit under this many plausible placements and report the range.
    pub placements: usize,
}

impl Default for FitOptions {
    fn default() -> Self {
        FitOptions { trace: TraceOptions::default(), config: None, grid: None, cards: Vec::new(), reserve: None, placements: 1 }
    }
}

/// `fit`.
pub fn fit(t: Trace<'_>, a: &FitOptions) -> Result<FitAnswer, Error> {
    let p = a.trace.prepare(t.snapshot)?;
    crate::input::no_requests(t, &p, "fit")?;
    let points: Vec<GridPoint> = match (&a.grid, &a.config) {
        (Some(g), _) => crate::sweep::grid_points_for(g, "", &p)?,
        (None, Some(c)) => vec![GridPoint { conf: c.clone(), config: p.rules.version.parse_config(c).map_err(|e| e.to_string()) }],
        (None, None) => vec![GridPoint { conf: p.own.source.clone(), config: Ok(p.own.clone()) }],
    };
    let (outside, outside_source): (u64, String) = match (a.reserve, outside_memory_from_ooms(&p)) {
        (Some(r), _) => (r, "given with --reserve".into()),
        // What a full device held outside the allocator includes other processes' memory, which
        // would not follow the job to another card.
        (None, Some(r)) if !p.budget.device_full.is_empty() => (
            DEFAULT_OUTSIDE_MEMORY,
            format!(
                "the CUDA context measured on an H200 with torch 2.11; the trace's OOM entries show {} outside the allocator on a full device, which includes what other processes held (--reserve {r} counts it all)",
                format_size(r)
            ),
        ),
        (None, Some(r)) => (r, "from the trace's OOM entries (device_free)".into()),
        (None, None) => (DEFAULT_OUTSIDE_MEMORY, "default: CUDA context measured on an H200 with torch 2.11".into()),
    };
    let placements = p.placements(a.placements.max(1));
    let mut results = Vec::new();
    for pt in &points {
        let config = match &pt.config {
            Ok(c) => c,
            Err(e) => {
                results.push(json!({"config": pt.conf, "rejected": e}));
                continue;
            }
        };
        let n = if config.expandable_segments { 1 } else { placements.len() };
        let fits: Vec<_> = placements[..n].iter().map(|(name, pl)| (name.clone(), fit_one(&p, config, pl))).collect();
        let caps: Vec<u64> = fits.iter().filter_map(|(_, f)| f.capacity).collect();
        let capacity = fits[0].1.capacity;
        let own_budget = match (caps.iter().min(), caps.iter().max()) {
            (Some(&lo), Some(&hi)) if caps.len() == fits.len() => allocsim_whatif::fit::against_budget(lo, hi, &p.budget),
            _ => None,
        };
        // Each card is replayed (every placement), not compared with the fitted capacity.
        let cards: Vec<_> = a
            .cards
            .iter()
            .map(|&card| {
                let usable = card.saturating_sub(outside);
                let runs: Vec<_> = placements[..n].iter().map(|(_, pl)| allocsim_whatif::fit::on_card(&p, config, pl, card, outside)).collect();
                let ok = runs.iter().filter(|o| o.first_oom().is_none()).count();
                let first_oom = runs.iter().filter_map(|o| o.first_oom()).min();
                let peak_reserved = runs.iter().map(|o| o.peak_reserved).max().unwrap_or(0);
                json!({
                    "card": card,
                    "usable": usable,
                    "fits": ok == runs.len(),
                    "fits_in_some_placements": ok > 0 && ok < runs.len(),
                    "first_oom": first_oom,
                    "peak_reserved": peak_reserved,
                })
            })
            .collect();
        results.push(json!({
            "config": pt.conf,
            "capacity": capacity,
            "capacity_range": if caps.is_empty() { json!(null) } else { json!([caps.iter().min(), caps.iter().max()]) },
            "uncapped_peak_reserved": fits[0].1.uncapped_peak_reserved,
            "peak_allocated": fits[0].1.peak_allocated,
            "checked_below": fits[0].1.checked_below,
            "non_monotone": fits.iter().any(|(_, f)| f.non_monotone),
            "placement_independent": config.expandable_segments,
            "placements": fits.iter().map(|(name, f)| json!({"name": name, "capacity": f.capacity, "replays": f.replays})).collect::<Vec<_>>(),
            "cards": cards,
            "own_budget": own_budget.map(|(v, lo, hi)| json!({"verdict": v, "low": lo, "high": hi})),
        }));
    }
    Ok(FitAnswer {
        name: t.name.to_owned(),
        options: a.clone(),
        requests: p.program.requests.len(),
        device_memory: p.device_memory,
        results,
        outside,
        outside_source,
        not_reproduced: p.not_reproduced(),
    })
}

/// What `fit` found: per config (JSON objects, as `--json` prints them).
pub struct FitAnswer {
    pub name: String,
    pub options: FitOptions,
    pub requests: usize,
    pub device_memory: u64,
    pub results: Vec<Value>,
    /// The memory outside the allocator the cards are judged with, and where it came from.
    pub outside: u64,
    pub outside_source: String,
    /// The trace's own replay is not the recording.
    pub not_reproduced: Option<allocsim_replay::settings_change::NotReproduced>,
}

impl Answer for FitAnswer {
    fn write_text(&self, out: &mut dyn Write) -> io::Result<()> {
        write_fit_text(out, self, self.requests, self.device_memory, &self.results, self.outside, &self.outside_source)
    }
    fn to_json(&self) -> Value {
        let mut out = if self.results.len() == 1 && self.options.grid.is_none() {
            let mut r = self.results[0].clone();
            r["outside_memory"] = json!(self.outside);
            r
        } else {
            json!({"outside_memory": self.outside, "configs": self.results})
        };
        crate::input::add_not_reproduced_json(&mut out, self.not_reproduced.as_ref());
        out
    }
}

/// `fit` as text: per config the fitting capacity, how it was checked, and the cards.
fn write_fit_text(
    out: &mut dyn Write,
    s: &FitAnswer,
    requests: usize,
    device_memory: u64,
    results: &[serde_json::Value],
    outside: u64,
    outside_source: &str,
) -> io::Result<()> {
    writeln!(out, "{}: {} requests", s.name, requests)?;
    crate::input::write_not_reproduced(out, s.not_reproduced.as_ref(), false)?;
    for r in results {
        let conf = r["config"].as_str().unwrap_or("");
        let conf = if conf.is_empty() { "defaults" } else { conf };
        if let Some(e) = r["rejected"].as_str() {
            writeln!(out, "  {conf}: rejected by PyTorch: {e}")?;
            continue;
        }
        match r["capacity"].as_u64() {
            None => writeln!(out, "  {conf}: does not fit even in the whole device ({})", format_size(device_memory))?,
            Some(c) => {
                let rng = &r["capacity_range"];
                let spread = match (rng[0].as_u64(), rng[1].as_u64()) {
                    (Some(lo), Some(hi)) if lo != hi => format!(" ({}–{} across placements)", format_size(lo), format_size(hi)),
                    _ => String::new(),
                };
                writeln!(
                    out,
                    "  {conf}: fits in an allowed maximum of {} ({c} bytes){spread}; peak allocated {}, uncapped peak reserved {}",
                    format_size(c),
                    format_size(r["peak_allocated"].as_u64().unwrap()),
                    format_size(r["uncapped_peak_reserved"].as_u64().unwrap())
                )?;
                writeln!(
                    out,
                    "    checked: {} − 2 MiB runs out of memory, and so does every capacity down to {} ({}{})",
                    format_size(c),
                    format_size(c.saturating_sub(r["checked_below"].as_u64().unwrap() * (2 << 20))),
                    if r["non_monotone"].as_bool() == Some(true) {
                        "fitting is NOT monotone here: a smaller capacity fits below a larger one that does not"
                    } else {
                        "monotone near the edge"
                    },
                    if r["placement_independent"].as_bool() == Some(true) { "; expandable segments: placement does not matter" } else { "" }
                )?;
                if let Some(b) = r["own_budget"].as_object() {
                    let (lo, hi) = (b["low"].as_u64().unwrap_or(0), b["high"].as_u64().unwrap_or(0));
                    let had = if lo == hi { format_size(lo) } else { format!("between {} and {} (inferred)", format_size(lo), format_size(hi)) };
                    let verdict = match b["verdict"].as_str() {
                        Some("fits") => "enough",
                        Some("does_not_fit") => "not enough",
                        _ => "enough or not depending on where in that range the real value lies",
                    };
                    writeln!(out, "    the trace itself had {had}: {verdict}")?;
                }
            }
        }
        for c in r["cards"].as_array().map_or(&[][..], |v| v.as_slice()) {
            writeln!(
                out,
                "    {} card: {} usable after {} outside the allocator → {}",
                format_size(c["card"].as_u64().unwrap_or(0)),
                format_size(c["usable"].as_u64().unwrap_or(0)),
                format_size(outside),
                if c["fits"].as_bool() == Some(true) {
                    format!("fits (replayed: peak reserved {})", format_size(c["peak_reserved"].as_u64().unwrap_or(0)))
                } else if c["fits_in_some_placements"].as_bool() == Some(true) {
                    "fits in some placements only".to_string()
                } else {
                    format!("does not fit (replayed: out of memory at request {})", c["first_oom"].as_u64().map_or("?".to_string(), |q| q.to_string()))
                }
            )?;
        }
    }
    if !s.options.cards.is_empty() {
        writeln!(out, "  memory outside the allocator: {} ({outside_source})", format_size(outside))?;
    }
    Ok(())
}
