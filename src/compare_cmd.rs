//! `allocsim compare`: two runs of the same requests side by side (`allocsim_whatif::compare`),
//! or many files as the ranks of one job (`allocsim_phases::ranks`).

use std::io::{self, Write};
use std::path::{Path, PathBuf};

use allocsim_model::AllocatorConfig;
use allocsim_model::format::format_size;
use allocsim_model::format::format_size as fs;
use allocsim_phases::ranks::{RankSpec, Ranks, compare_runs, expand_paths};
use allocsim_replay::{Prepared, ReplayOutcome, TorchVersion};
use allocsim_trace::{Action, Snapshot};
use allocsim_whatif::compare::{Side, compare};
use comfy_table::{Table, presets};

use crate::common::{UserError, load, say_device, write_json};
use crate::output::Io;
use crate::size::parse_size;

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
    /// median of that iteration (above 0, at most 1000).
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
    /// How many call sites of new segments to list (two runs), or rows (ranks).
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    /// Print one JSON object instead of the text.
    #[arg(long)]
    pub json: bool,
}

/// A recorded run as one side: its own segment events (a self replay reproduces them exactly).
fn recorded_side(path: &Path, snap: &Snapshot, device: Option<usize>, io: &mut Io<'_>, machine: bool) -> Result<Side, UserError> {
    let p = Prepared::new_for(snap, device, None, None, TorchVersion::DEFAULT).map_err(allocsim_commands::Error::from)?;
    if let Some(text) = p.choice.describe() {
        let line = format!("{}: answering for {text}", path.display());
        if machine {
            writeln!(io.err, "allocsim: note: {line}")?;
        } else {
            writeln!(io.out, "{line}")?;
        }
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
        label: path.display().to_string(),
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

pub fn cmd_compare(a: &CompareArgs, io: &mut Io<'_>) -> Result<i32, UserError> {
    if let Some(files) = as_ranks(a)? {
        return cmd_ranks(a, &files, io);
    }
    let path_a = &a.files[0];
    let snap_a = load(path_a)?;
    let (sa, sb) = match a.files.get(1) {
        Some(b) => {
            let snap_b = load(b)?;
            (recorded_side(path_a, &snap_a, a.device, io, a.json)?, recorded_side(b, &snap_b, a.device, io, a.json)?)
        }
        None => {
            let p = Prepared::new_for(&snap_a, a.device, a.device_memory, None, TorchVersion::DEFAULT).map_err(allocsim_commands::Error::from)?;
            say_device(io, &snap_a, a.device, a.json)?;
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

/// The files to compare as ranks, when the arguments ask for that (a directory, a glob, three or
/// more files, or `--ranks`); `None` for the two-run comparison.
pub fn as_ranks(a: &CompareArgs) -> Result<Option<Vec<PathBuf>>, UserError> {
    let many = a.ranks || a.files.len() > 2 || a.files.iter().any(|f| f.is_dir() || f.file_name().is_some_and(|n| n.to_string_lossy().contains(['*', '?'])));
    if !many {
        return Ok(None);
    }
    Ok(Some(expand_paths(&a.files).map_err(UserError)?))
}

/// The ranks question, its settings and spike ratio checked before any file is read (what
/// `compare` over ranks and the Python package's `allocsim.fleet` both ask).
pub fn rank_spec(
    config: Option<String>,
    capacity: Option<u64>,
    device_memory: Option<u64>,
    device: Option<usize>,
    by: Option<String>,
    spike: f64,
) -> Result<RankSpec, allocsim_commands::Error> {
    if let Some(c) = &config {
        AllocatorConfig::parse(c).map_err(|e| allocsim_commands::Error::Config { message: format!("--config {c:?}: {e}"), pytorch: e.to_string() })?;
    }
    if spike.partial_cmp(&1.0) != Some(std::cmp::Ordering::Greater) {
        return Err(allocsim_commands::Error::Usage(format!("--spike {spike}: expected a ratio above 1 (e.g. 1.1)")));
    }
    Ok(RankSpec { config, capacity, device_memory, device, by, spike_ratio: spike })
}

pub fn cmd_ranks(a: &CompareArgs, files: &[PathBuf], io: &mut Io<'_>) -> Result<i32, UserError> {
    let spec = rank_spec(a.config.clone(), a.capacity, a.device_memory, a.device, a.by.clone(), a.spike)?;
    let k = compare_runs(files, &spec);
    if a.json {
        write_json(io.out, &k)?;
    } else {
        write_ranks(io.out, &k)?;
    }
    match ranks_failure(&k) {
        None => Ok(0),
        Some(e) => Err(UserError(e)),
    }
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
