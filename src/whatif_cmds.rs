//! `allocsim sweep`, `fit` and `compare`.

use std::io::{self, Write};
use std::path::{Path, PathBuf};

use allocsim_model::AllocatorConfig;
use allocsim_model::format::format_size;
use allocsim_replay::{Prepared, ReplayOutcome, TorchVersion};
use allocsim_trace::{Action, Snapshot};
use allocsim_whatif::compare::{Side, compare};
use allocsim_whatif::fit::{DEFAULT_OUTSIDE_MEMORY, fit, outside_memory_from_ooms};
use allocsim_whatif::grid::{DEFAULT_GRID, GridPoint, parse_grid};
use allocsim_whatif::sweep::{Row, replay_count, sweep};
use comfy_table::{Table, presets};
use serde_json::json;

use crate::cli::{UserError, load, write_json};
use crate::output::Io;
use crate::size::parse_size;

/// Where the trace came from and how it was recorded.
#[derive(clap::Args, Clone)]
pub struct TraceArgs {
    /// A snapshot (.pickle, .pickle.gz) or an allocsim .jsonl trace.
    pub trace: PathBuf,
    /// The device's total memory (default: as the trace shows it, else an H200's).
    #[arg(long, value_parser = parse_size)]
    pub device_memory: Option<u64>,
    /// The allowed maximum the trace was recorded under (tells its `empty_cache()` calls from the
    /// releases its own OOM retries made). Default: inferred from the trace's OOM entries and
    /// segment events, with the memory held outside the allocator.
    #[arg(long, value_parser = parse_size)]
    pub trace_capacity: Option<u64>,
    /// Which device's trace (default: the one that ran out of memory, else the one with the
    /// highest peak reserved; with no trace entries, the one holding the segments).
    #[arg(long)]
    pub device: Option<usize>,
}

impl TraceArgs {
    fn prepare(&self) -> Result<(Snapshot, Prepared), UserError> {
        let snap = load(&self.trace)?;
        let p = Prepared::new_for(&snap, self.device, self.device_memory, self.trace_capacity, TorchVersion::DEFAULT)?;
        Ok((snap, p))
    }

    /// Loads and prepares the trace for a replay under `config` (default: the trace's own
    /// settings) and `capacity`. Replaying under the trace's own settings, `--capacity` is also
    /// taken as the cap it was recorded under unless `--trace-capacity` says otherwise.
    pub fn prepare_for(&self, config: Option<&str>, capacity: Option<u64>) -> Result<(Snapshot, Prepared, AllocatorConfig), UserError> {
        let snap = load(&self.trace)?;
        let own = allocsim_replay::recorded_config(&snap)?;
        let config = match config {
            Some(c) => parse_config(c)?,
            None => own.clone(),
        };
        let own_settings = {
            let (mut x, mut y) = (config.clone(), own);
            x.source.clear();
            y.source.clear();
            x == y
        };
        let trace_capacity = self.trace_capacity.or(if own_settings { capacity } else { None });
        let p = Prepared::new_for(&snap, self.device, self.device_memory, trace_capacity, TorchVersion::DEFAULT)?;
        Ok((snap, p, config))
    }
}

/// A snapshot without history has no requests to `what`: the error, with how to record them.
fn no_requests(snap: &Snapshot, p: &Prepared, path: &Path, what: &str) -> Result<(), UserError> {
    if !p.program.requests.is_empty() || !snap.has_no_history() {
        return Ok(());
    }
    Err(UserError(format!(
        "{}: no trace entries (memory history was not recorded), so no requests to {what}; record them with torch.cuda.memory._record_memory_history(max_entries=100000) before the code to analyse, then torch.cuda.memory._dump_snapshot(\"snapshot.pickle\")",
        path.display()
    )))
}

/// `--config STR`, with PyTorch's error text.
pub fn parse_config(c: &str) -> Result<AllocatorConfig, UserError> {
    AllocatorConfig::parse(c).map_err(|e| UserError(format!("--config {c:?}: {e}")))
}

#[derive(clap::Args)]
pub struct SweepArgs {
    #[command(flatten)]
    pub trace: TraceArgs,
    /// The allowed maximum to sweep under (e.g. `24GiB`); default: the trace's own budget
    /// (inferred from it), else the whole device.
    #[arg(long, value_parser = parse_size)]
    pub capacity: Option<u64>,
    /// `key=v1,v2; key2=...` (`none` leaves a key out). Default: a grid over expandable_segments,
    /// max_split_size_mb, roundup_power2_divisions and garbage_collection_threshold.
    #[arg(long)]
    pub grid: Option<String>,
    /// Settings put before every grid point (e.g. `large_segment_size_mb:64`).
    #[arg(long, default_value = "")]
    pub base: String,
    /// Segment placements per config (expandable-segment configs need one).
    #[arg(long, default_value_t = 4)]
    pub placements: usize,
    #[arg(long, conflicts_with = "csv")]
    pub json: bool,
    #[arg(long)]
    pub csv: bool,
    /// How many rows to print (text output).
    #[arg(long, default_value_t = 15)]
    pub top: usize,
}

fn progress_bar(n: usize, quiet: bool) -> indicatif::ProgressBar {
    if quiet {
        return indicatif::ProgressBar::hidden();
    }
    let pb = indicatif::ProgressBar::new(n as u64);
    pb.set_style(
        indicatif::ProgressStyle::with_template("{spinner} replaying {pos}/{len} [{bar:30}] {elapsed}").unwrap().progress_chars("=> "),
    );
    pb
}

fn oom_cell(p: &Prepared, row: &Row) -> String {
    let n = row.outcomes.len();
    let k = row.placements_with_oom();
    if k == 0 {
        return "no".into();
    }
    let (lo, _) = row.first_oom_range();
    let lo = lo.unwrap_or(0);
    let req = &p.program.requests[lo as usize];
    let mut s = format!("request {lo} ({})", format_size(req.size));
    if let Some(site) = p.call_site(lo) {
        s.push_str(&format!("\n  at {site}"));
    }
    if n > 1 {
        s = format!("{k}/{n} placements; first at {s}");
    }
    s
}

fn range(r: Option<(u64, u64)>) -> String {
    match r {
        Some((lo, hi)) if format_size(lo) == format_size(hi) => format_size(lo),
        Some((lo, hi)) => format!("{}–{}", format_size(lo), format_size(hi)),
        None => "-".into(),
    }
}

pub fn cmd_sweep(a: &SweepArgs, io: &mut Io<'_>) -> Result<i32, UserError> {
    let (snap, p) = a.trace.prepare()?;
    no_requests(&snap, &p, &a.trace.trace, "replay under other settings")?;
    crate::cli::say_device(io, &p.choice, a.json || a.csv)?;
    let grid = a.grid.as_deref().unwrap_or(DEFAULT_GRID);
    let points: Vec<GridPoint> = parse_grid(grid, &a.base).map_err(UserError)?;
    let pb = progress_bar(replay_count(&points, a.placements), a.json || a.csv);
    let t0 = std::time::Instant::now();
    let limits = p.limits(a.capacity);
    let rows = sweep(&p, &points, &limits, a.placements, &|| pb.inc(1));
    pb.finish_and_clear();
    // An allowed maximum known as an interval: the outcomes at its two ends say which answers
    // depend on where in it the real one lies.
    let ends = match (a.capacity, p.budget.allowed_low, p.budget.allowed_high) {
        (None, Some(lo), Some(hi)) if p.budget.allowed_is_interval() => Some((lo, hi)),
        _ => None,
    };
    let depends: Vec<String> = match ends {
        Some((lo, hi)) => {
            let at = |c: u64| sweep(&p, &points, &p.limits_at(c), a.placements, &|| {});
            allocsim_whatif::sweep::depends_on_limits(&[&rows, &at(lo), &at(hi)])
        }
        None => Vec::new(),
    };
    let secs = t0.elapsed().as_secs_f64();
    // Which iteration each outcome's reserved memory peaks in (when the trace has iterations).
    let layout = allocsim_phases::Layout::of(&p, None).ok().filter(|l| l.iterations.len() > 1);
    let iteration_of = |q: Option<u32>| layout.as_ref().and_then(|l| l.iteration_of_request(q?));
    if a.json {
        let mut rows_json = serde_json::to_value(&rows).expect("JSON");
        for (r, row) in rows.iter().zip(rows_json.as_array_mut().expect("rows")) {
            for (o, out) in r.outcomes.iter().zip(row["outcomes"].as_array_mut().expect("outcomes")) {
                out["peak_reserved_iteration"] = json!(iteration_of(o.peak_reserved_request));
            }
        }
        let out = json!({
            "trace": a.trace.trace.display().to_string(),
            "capacity": a.capacity,
            "grid": grid,
            "placements": a.placements,
            "seconds": secs,
            "iterations": layout.as_ref().map(|l| l.iterations.len()),
            "rows": rows_json,
            "could_swap_with_next": allocsim_whatif::sweep::placement_sensitive_pairs(&rows),
            "allowed_maximum_used": limits.capacity,
            "budget": p.budget.to_json(),
            "depends_on_allowed_maximum": depends,
        });
        write_json(io.out, &out)?;
        return Ok(0);
    }
    if a.csv {
        write_sweep_csv(io.out, &rows)?;
        return Ok(0);
    }
    write_sweep_text(io.out, a, &p, &points, &rows, secs, ends.map(|e| (e, depends.as_slice())), &iteration_of)?;
    Ok(0)
}

/// `sweep --csv`: one row per config, best first.
pub fn write_sweep_csv(out: &mut dyn Write, rows: &[Row]) -> io::Result<()> {
    writeln!(out, "rank,config,rejected,placements,placements_with_oom,first_oom_min,first_oom_max,peak_reserved_min,peak_reserved_max,peak_allocated,retries,syncs,device_alloc,device_free,device_call_ms")?;
    for (i, r) in rows.iter().enumerate() {
        let w = r.worst();
        let (lo, hi) = r.first_oom_range();
        let (pl, ph) = r.peak_reserved_range().unwrap_or((0, 0));
        writeln!(
            out,
            "{},\"{}\",\"{}\",{},{},{},{},{},{},{},{},{},{},{},{:.3}",
            i + 1,
            r.conf,
            r.rejected.clone().unwrap_or_default().replace('"', "'"),
            r.outcomes.len(),
            r.placements_with_oom(),
            lo.map_or(String::new(), |x| x.to_string()),
            hi.map_or(String::new(), |x| x.to_string()),
            pl,
            ph,
            w.map_or(0, |w| w.peak_allocated),
            w.map_or(0, |w| w.num_alloc_retries),
            w.map_or(0, |w| w.num_sync_all_streams),
            w.map_or(0, |w| w.num_device_alloc),
            w.map_or(0, |w| w.num_device_free),
            w.map_or(0.0, |w| w.device_call_us / 1000.0)
        )?;
    }
    Ok(())
}

/// `sweep` as text: the table of the `a.top` best configs, the rejected ones, the recommendation.
/// `interval`: the ends of an inferred allowed maximum and the configs whose outcome differs
/// between them; `iteration_of`: the iteration holding a request (when the trace has iterations).
fn write_sweep_text(
    out: &mut dyn Write,
    a: &SweepArgs,
    p: &Prepared,
    points: &[GridPoint],
    rows: &[Row],
    secs: f64,
    interval: Option<((u64, u64), &[String])>,
    iteration_of: &dyn Fn(Option<u32>) -> Option<usize>,
) -> io::Result<()> {
    let limits = p.limits(a.capacity);
    let valid = rows.iter().filter(|r| r.rejected.is_none()).count();
    let shared = rows.iter().flat_map(|r| &r.outcomes).filter(|o| o.same_as.is_some()).count();
    writeln!(
        out,
        "{}: {} requests, {} configs ({} placements each, expandable segments once), {} outcomes under {} ({} replayed; {} shared with a config that cannot behave differently on this trace); {:.1} s",
        a.trace.trace.display(),
        p.program.requests.len(),
        valid,
        a.placements,
        replay_count(points, a.placements),
        match (a.capacity, limits.capacity, limits.outside.is_empty()) {
            (Some(c), _, _) => format!("a {} cap", format_size(c)),
            (None, Some(c), _) => format!("the trace's own allowed maximum, {} (inferred)", format_size(c)),
            (None, None, false) => "the trace's own budget (a full device, inferred)".to_string(),
            (None, None, true) => "no cap".to_string(),
        },
        replay_count(points, a.placements) - shared,
        shared,
        secs
    )?;
    let mut t = Table::new();
    t.load_style(presets::UTF8_FULL_CONDENSED);
    let with_iterations = rows.iter().flat_map(|r| &r.outcomes).any(|o| iteration_of(o.peak_reserved_request).is_some());
    let mut header = vec!["#", "config", "OOM", "peak reserved"];
    if with_iterations {
        header.push("in iteration");
    }
    header.extend(["reserved − allocated", "retries", "syncs", "cudaMalloc/free (map/unmap)", "device time"]);
    t.set_header(header);
    for (i, r) in rows.iter().filter(|r| r.rejected.is_none()).take(a.top).enumerate() {
        let w = r.worst().unwrap();
        // The iterations where the placements' peaks fall (one, usually).
        let mut its: Vec<usize> = r.outcomes.iter().filter_map(|o| iteration_of(o.peak_reserved_request)).collect();
        its.sort_unstable();
        its.dedup();
        let mut cells = vec![
            (i + 1).to_string(),
            if r.conf.is_empty() { "(defaults)".into() } else { r.conf.replace(',', ", ") },
            oom_cell(p, r),
            range(r.peak_reserved_range()),
        ];
        if with_iterations {
            cells.push(its.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(", "));
        }
        cells.extend([
            format_size(w.peak_reserved.saturating_sub(w.peak_allocated)),
            w.num_alloc_retries.to_string(),
            w.num_sync_all_streams.to_string(),
            format!("{} / {}", w.num_device_alloc, w.num_device_free),
            format!("{:.1} ms", (w.device_call_us / 1000.0).max(0.0)),
        ]);
        t.add_row(cells);
    }
    writeln!(out, "{t}")?;
    if a.capacity.is_none() {
        for line in crate::cli::budget_lines(&p.budget) {
            writeln!(out, "budget: {line}")?;
        }
    }
    match interval {
        Some(((lo, hi), depends)) if depends.is_empty() => writeln!(
            out,
            "every outcome above is the same at both ends of the inferred allowed maximum ({}–{})",
            format_size(lo),
            format_size(hi)
        )?,
        Some(((lo, hi), depends)) => writeln!(
            out,
            "depends on where in {}–{} the real allowed maximum lies (the outcome differs between its ends): {}",
            format_size(lo),
            format_size(hi),
            depends.iter().map(|c| if c.is_empty() { "(defaults)" } else { c.as_str() }).collect::<Vec<_>>().join("; ")
        )?,
        None => {}
    }
    for r in rows.iter().filter(|r| r.rejected.is_some()) {
        writeln!(out, "rejected by PyTorch: {} — {}", r.conf, r.rejected.as_ref().unwrap())?;
    }
    if limits.capacity.is_none() && points.iter().any(|p| p.config.as_ref().is_ok_and(|c| c.gc_enabled())) {
        writeln!(out, "note: garbage_collection_threshold has no effect without a memory fraction (give --capacity)")?;
    }
    // Rankings that placement can flip: adjacent configs whose outcome ranges overlap.
    let shown: Vec<&Row> = rows.iter().filter(|r| r.rejected.is_none()).take(a.top).collect();
    let flips = allocsim_whatif::sweep::placement_sensitive_pairs(rows);
    let flips: Vec<String> = flips.iter().filter(|&&i| i + 1 < a.top).map(|i| format!("#{} and #{}", i + 1, i + 2)).collect();
    if !flips.is_empty() {
        writeln!(out, "placement: these neighbours could swap places depending on where the driver puts segments (their ranges overlap): {}", flips.join(", "))?;
    }
    let _ = shown;
    let own = rows.iter().position(|r| r.rejected.is_none() && AllocatorConfig::parse(&r.conf).is_ok_and(|c| p.is_own_under(&c, &limits)));
    let name = |r: &Row| if r.conf.is_empty() { "the defaults".to_string() } else { r.conf.clone() };
    let own_name = |r: &Row| format!("{} (the trace's own settings)", name(r));
    use allocsim_whatif::sweep::Recommendation as R;
    let line = match allocsim_whatif::sweep::recommend(rows, own) {
        None => return Ok(()),
        Some(R::KeepOwn { own }) => format!("recommendation: keep {} — they rank first", own_name(&rows[own])),
        Some(R::OwnAsGood { own, best }) => format!(
            "recommendation: keep {} — they are as good as any setting tried (no OOM avoided or postponed, and peak reserved {} against {} at best, {}: less than {:.0}% apart)",
            own_name(&rows[own]),
            range(rows[own].peak_reserved_range()),
            range(rows[best].peak_reserved_range()),
            name(&rows[best]),
            100.0 * allocsim_whatif::sweep::MIN_GAIN
        ),
        Some(R::Better { best, own }) if rows[own].placements_with_oom() > 0 && rows[best].placements_with_oom() == 0 => format!(
            "recommendation: {} avoids the OOM at request {} under {} (peak reserved {})",
            name(&rows[best]),
            rows[own].first_oom_range().0.unwrap_or(0),
            own_name(&rows[own]),
            range(rows[best].peak_reserved_range())
        ),
        Some(R::Better { best, own }) => format!(
            "recommendation: {} (peak reserved {} vs {} under {}{})",
            name(&rows[best]),
            range(rows[best].peak_reserved_range()),
            range(rows[own].peak_reserved_range()),
            own_name(&rows[own]),
            match (rows[best].first_oom_range().0, rows[own].first_oom_range().0) {
                (Some(b), Some(o)) if b > o => format!("; its first OOM comes at request {b} instead of {o}"),
                _ => String::new(),
            }
        ),
        Some(R::Best { best }) => format!("recommendation: {} (peak reserved {})", name(&rows[best]), range(rows[best].peak_reserved_range())),
        Some(R::AllOom { smallest, shortfall, request }) => format!(
            "recommendation: none — every setting runs out of memory; the smallest shortfall is {} ({}, at request {request}); `allocsim fit` finds the allowed maximum each setting needs",
            format_size(shortfall),
            name(&rows[smallest])
        ),
    };
    writeln!(out, "{line}")?;
    Ok(())
}

#[derive(clap::Args)]
pub struct FitArgs {
    #[command(flatten)]
    pub trace: TraceArgs,
    /// The settings to fit under (default: the trace's own).
    #[arg(long)]
    pub config: Option<String>,
    /// Fit every config of a grid instead (see `sweep --grid`).
    #[arg(long, conflicts_with = "config")]
    pub grid: Option<String>,
    /// Cards to check, e.g. `24GiB,40GiB,80GiB`.
    #[arg(long, value_delimiter = ',', value_parser = parse_size)]
    pub cards: Vec<u64>,
    /// Memory outside the allocator (CUDA context, library workspaces). Default: what the trace's
    /// OOM entries show (`device_free`), else 518 MiB (measured on an H200 with torch 2.11).
    #[arg(long, value_parser = parse_size)]
    pub reserve: Option<u64>,
    /// Also fit under N plausible placements and report the range.
    #[arg(long, default_value_t = 1)]
    pub placements: usize,
    #[arg(long)]
    pub json: bool,
}

pub fn cmd_fit(a: &FitArgs, io: &mut Io<'_>) -> Result<i32, UserError> {
    let (snap, p) = a.trace.prepare()?;
    no_requests(&snap, &p, &a.trace.trace, "fit")?;
    crate::cli::say_device(io, &p.choice, a.json)?;
    let points: Vec<GridPoint> = match (&a.grid, &a.config) {
        (Some(g), _) => parse_grid(g, "").map_err(UserError)?,
        (None, Some(c)) => vec![GridPoint { conf: c.clone(), config: AllocatorConfig::parse(c).map_err(|e| e.to_string()) }],
        (None, None) => vec![GridPoint { conf: p.own.source.clone(), config: Ok(p.own.clone()) }],
    };
    let full_device_note;
    let (outside, outside_source) = match (a.reserve, outside_memory_from_ooms(&p)) {
        (Some(r), _) => (r, "given with --reserve"),
        (None, Some(r)) if !p.budget.device_full.is_empty() => {
            // What a full device held outside the allocator includes other processes' memory,
            // which would not follow the job to another card.
            full_device_note = format!(
                "the CUDA context measured on an H200 with torch 2.11; the trace's OOM entries show {} outside the allocator on a full device, which includes what other processes held (--reserve {} counts it all)",
                format_size(r),
                r
            );
            (DEFAULT_OUTSIDE_MEMORY, full_device_note.as_str())
        }
        (None, Some(r)) => (r, "from the trace's OOM entries (device_free)"),
        (None, None) => (DEFAULT_OUTSIDE_MEMORY, "default: CUDA context measured on an H200 with torch 2.11"),
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
        let fits: Vec<_> = placements[..n].iter().map(|(name, pl)| (name.clone(), fit(&p, config, pl))).collect();
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
    if a.json {
        let body = if results.len() == 1 && a.grid.is_none() {
            let mut r = results.pop().unwrap();
            r["outside_memory"] = json!(outside);
            r
        } else {
            json!({"outside_memory": outside, "configs": results})
        };
        write_json(io.out, &body)?;
        return Ok(0);
    }
    write_fit_text(io.out, a, p.program.requests.len(), p.device_memory, &results, outside, outside_source)?;
    Ok(0)
}

/// `fit` as text: per config the fitting capacity, how it was checked, and the cards.
fn write_fit_text(
    out: &mut dyn Write,
    a: &FitArgs,
    requests: usize,
    device_memory: u64,
    results: &[serde_json::Value],
    outside: u64,
    outside_source: &str,
) -> io::Result<()> {
    writeln!(out, "{}: {} requests", a.trace.trace.display(), requests)?;
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
                    if r["non_monotone"].as_bool() == Some(true) { "fitting is NOT monotone here: a smaller capacity fits below a larger one that does not" } else { "monotone near the edge" },
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
    if !a.cards.is_empty() {
        writeln!(out, "  memory outside the allocator: {} ({outside_source})", format_size(outside))?;
    }
    Ok(())
}

#[derive(clap::Args)]
pub struct CompareArgs {
    /// A snapshot, and a second one of the same requests (e.g. the same job under another
    /// config); with one, it is replayed under `--config` and `--config-b` (default: its own
    /// settings). A directory, a glob (`'rank*.pickle.gz'`), three or more files, or `--ranks`:
    /// every file replayed (in parallel) and compared as the ranks of one job.
    #[arg(required = true, num_args = 1..)]
    pub files: Vec<PathBuf>,
    /// Compare the files as ranks (one row each, iteration peaks against the median) even when
    /// there are only two.
    #[arg(long)]
    pub ranks: bool,
    /// Ranks: iterations by this annotation (default: the optimizer's step; see `phases --by`).
    #[arg(long)]
    pub by: Option<String>,
    /// Ranks: a file spikes in an iteration when its peak allocated is at least this times the
    /// median of that iteration.
    #[arg(long, default_value_t = 1.1)]
    pub spike: f64,
    /// Settings for side A when comparing one trace under two configs.
    #[arg(long)]
    pub config: Option<String>,
    /// Settings for side B (default: the trace's own).
    #[arg(long)]
    pub config_b: Option<String>,
    /// The allowed maximum (default: the trace's own budget, inferred from it).
    #[arg(long, value_parser = parse_size)]
    pub capacity: Option<u64>,
    /// The device's total memory (default: as the trace shows it, else an H200's).
    #[arg(long, value_parser = parse_size)]
    pub device_memory: Option<u64>,
    /// Which device's trace, in every file (default: in each file, the one that ran out of
    /// memory, else the one with the highest peak reserved).
    #[arg(long)]
    pub device: Option<usize>,
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    #[arg(long)]
    pub json: bool,
}

/// A recorded run as one side: its own segment events (a self replay reproduces them exactly).
fn recorded_side(path: &Path, snap: &Snapshot, device: Option<usize>, io: &mut Io<'_>, machine: bool) -> Result<Side, UserError> {
    let p = Prepared::new_for(snap, device, None, None, TorchVersion::DEFAULT)?;
    if let Some(text) = p.choice.describe() {
        let line = format!("{}: answering for {text}", path.display());
        if machine { writeln!(io.err, "allocsim: note: {line}")? } else { writeln!(io.out, "{line}")? }
    }
    let mut deltas = Vec::new();
    let mut sites = Vec::new();
    let mut req = 0u32;
    let mut first_oom = None;
    let (mut cur, mut peak) = (0i64, 0i64);
    for e in &p.trace {
        match e.action {
            Action::SegmentAlloc | Action::SegmentMap => {
                deltas.push((req, e.size as i64));
                cur += e.size as i64;
                peak = peak.max(cur);
                sites.push((p.call_site(req).unwrap_or_else(|| "(no stack recorded for these requests)".into()), e.size));
            }
            Action::SegmentFree | Action::SegmentUnmap => {
                deltas.push((req, -(e.size as i64)));
                cur -= e.size as i64;
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
        label: path.display().to_string(),
        reserved_deltas: deltas,
        peak_reserved: peak as u64,
        peak_allocated: p.own_outcome.stats.allocated_bytes.all().peak as u64,
        first_oom,
        requests: req,
        new_segment_sites: sites,
    })
}

fn replayed_side(label: String, p: &Prepared, o: &ReplayOutcome) -> Side {
    let mut deltas = Vec::new();
    let mut sites = Vec::new();
    for e in &o.segment_events {
        let grow = matches!(e.action, "segment_alloc" | "segment_map");
        deltas.push((e.request, if grow { e.size as i64 } else { -(e.size as i64) }));
        if grow {
            sites.push((p.call_site(e.request).unwrap_or_else(|| "(no stack recorded for these requests)".into()), e.size));
        }
    }
    Side {
        label,
        reserved_deltas: deltas,
        peak_reserved: o.peak_reserved,
        peak_allocated: o.stats.allocated_bytes.all().peak as u64,
        first_oom: o.first_oom(),
        requests: p.program.requests.len() as u32,
        new_segment_sites: sites,
    }
}

pub fn cmd_compare(a: &CompareArgs, io: &mut Io<'_>) -> Result<i32, UserError> {
    if let Some(files) = crate::ranks_cmd::as_ranks(a)? {
        return crate::ranks_cmd::cmd_ranks(a, &files, io);
    }
    let path_a = &a.files[0];
    let snap_a = load(path_a)?;
    let (sa, sb) = match a.files.get(1) {
        Some(b) => {
            let snap_b = load(b)?;
            (recorded_side(path_a, &snap_a, a.device, io, a.json)?, recorded_side(b, &snap_b, a.device, io, a.json)?)
        }
        None => {
            let p = Prepared::new_for(&snap_a, a.device, a.device_memory, None, TorchVersion::DEFAULT)?;
            crate::cli::say_device(io, &p.choice, a.json)?;
            let cfg = |c: &Option<String>| -> Result<(String, AllocatorConfig), UserError> {
                match c {
                    Some(s) => Ok((s.clone(), AllocatorConfig::parse(s).map_err(|e| UserError(format!("--config {s:?}: {e}")))?)),
                    None => Ok(("its own settings".into(), p.own.clone())),
                }
            };
            let ((la, ca), (lb, cb)) = (cfg(&a.config)?, cfg(&a.config_b)?);
            let limits = p.limits(a.capacity);
            let oa = p.replay_under(&ca, &limits, p.recorded_placement());
            let ob = p.replay_under(&cb, &limits, p.recorded_placement());
            (replayed_side(la, &p, &oa), replayed_side(lb, &p, &ob))
        }
    };
    let c = compare(&sa, &sb);
    if a.json {
        write_json(io.out, &c)?;
    } else {
        write_comparison(io.out, &c, a.top)?;
    }
    Ok(0)
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
