//! `allocsim sweep` and `fit` (the answers: `allocsim_commands::{sweep, fit}`) and `compare`.

use std::io::{self, Write};
use std::path::{Path, PathBuf};

use allocsim_commands::fit::FitOptions;
use allocsim_commands::sweep::SweepOptions;
use allocsim_commands::{Trace, TraceOptions};
use allocsim_model::AllocatorConfig;
use allocsim_model::format::format_size;
use allocsim_replay::{Prepared, ReplayOutcome, TorchVersion};
use allocsim_trace::{Action, Snapshot};
use allocsim_whatif::compare::{Side, compare};
use comfy_table::{Table, presets};

use crate::cli::{UserError, load, write_answer, write_json};
use crate::output::Io;
use crate::size::parse_size;

/// Where the trace came from and how it was recorded.
#[derive(clap::Args, Clone)]
pub struct TraceArgs {
    /// A snapshot (.pickle, .pickle.gz) or an allocsim .jsonl trace.
    pub trace: PathBuf,
    /// The device's total memory (default: as the trace shows it, else an H200's). Every size
    /// option takes at most 2^60 bytes.
    #[arg(long, value_parser = parse_size)]
    pub device_memory: Option<u64>,
    /// The allowed maximum the trace was recorded under (tells its `empty_cache()` calls from the
    /// releases its own OOM retries made). Default: inferred from the trace's OOM entries and
    /// segment events, with the memory held outside the allocator.
    #[arg(long, value_parser = parse_size)]
    pub trace_capacity: Option<u64>,
    /// Which device's trace, 0 to 65535 (default: the one that ran out of memory, else the one
    /// with the highest peak reserved; the answer's first line says which and why).
    #[arg(long)]
    pub device: Option<usize>,
}

impl TraceArgs {
    /// The trace, read, and the name its answers call it by.
    pub fn load(&self) -> Result<(Snapshot, String), UserError> {
        Ok((load(&self.trace)?, self.trace.display().to_string()))
    }

    /// The options that say how it was recorded.
    pub fn options(&self) -> TraceOptions {
        TraceOptions { device_memory: self.device_memory, trace_capacity: self.trace_capacity, device: self.device }
    }
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
    /// Segment placements per config, 1 to 64 (expandable-segment configs need one).
    #[arg(long, default_value_t = 4)]
    pub placements: usize,
    /// Print one JSON object (every config, every placement) instead of the table.
    #[arg(long, conflicts_with = "csv")]
    pub json: bool,
    /// Print one CSV row per config instead of the table.
    #[arg(long)]
    pub csv: bool,
    /// How many rows to print (text output; configs with the same outcome share a row).
    #[arg(long, default_value_t = 15)]
    pub top: usize,
    /// Let the table be as wide as its contents (default: the terminal's width from `COLUMNS`,
    /// else 100 columns).
    #[arg(long)]
    pub wide: bool,
}

/// The widest a table may be: none with `--wide`, else `COLUMNS` (a terminal's width, at least
/// 60), else `allocsim_commands::sweep::DEFAULT_WIDTH`.
pub fn table_width(wide: bool) -> Option<u16> {
    if wide {
        return None;
    }
    let columns = std::env::var("COLUMNS").ok().and_then(|c| c.trim().parse::<u16>().ok()).map(|c| c.max(60));
    Some(columns.unwrap_or(allocsim_commands::sweep::DEFAULT_WIDTH))
}

fn progress_bar(n: usize, quiet: bool) -> indicatif::ProgressBar {
    if quiet {
        return indicatif::ProgressBar::hidden();
    }
    let pb = indicatif::ProgressBar::new(n as u64);
    pb.set_style(indicatif::ProgressStyle::with_template("{spinner} replaying {pos}/{len} [{bar:30}] {elapsed}").unwrap().progress_chars("=> "));
    pb
}

pub fn cmd_sweep(a: &SweepArgs, io: &mut Io<'_>) -> Result<i32, UserError> {
    let (snap, name) = a.trace.load()?;
    let options = SweepOptions {
        trace: a.trace.options(),
        capacity: a.capacity,
        grid: a.grid.clone(),
        base: a.base.clone(),
        placements: a.placements,
        top: a.top,
        width: table_width(a.wide),
    };
    let points = allocsim_commands::sweep::grid_points(&options)?;
    let pb = progress_bar(allocsim_commands::sweep::replays(&options, &points), a.json || a.csv);
    let answer = allocsim_commands::sweep::sweep(Trace { name: &name, snapshot: &snap }, &options, &|| pb.inc(1));
    pb.finish_and_clear();
    let answer = answer?;
    crate::cli::say_device(io, &snap, a.trace.device, a.json || a.csv)?;
    if a.csv {
        answer.write_csv(io.out)?;
        return Ok(0);
    }
    write_answer(&answer, a.json, io)
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
    /// Also fit under N plausible placements (1 to 64) and report the range.
    #[arg(long, default_value_t = 1)]
    pub placements: usize,
    /// Print one JSON object instead of the text.
    #[arg(long)]
    pub json: bool,
}

pub fn cmd_fit(a: &FitArgs, io: &mut Io<'_>) -> Result<i32, UserError> {
    let (snap, name) = a.trace.load()?;
    let options = FitOptions {
        trace: a.trace.options(),
        config: a.config.clone(),
        grid: a.grid.clone(),
        cards: a.cards.clone(),
        reserve: a.reserve,
        placements: a.placements,
    };
    let answer = allocsim_commands::fit::fit(Trace { name: &name, snapshot: &snap }, &options)?;
    crate::cli::say_device(io, &snap, a.trace.device, a.json)?;
    write_answer(&answer, a.json, io)
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
        let grow = matches!(e.action, "segment_alloc" | "segment_map");
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
            let p = Prepared::new_for(&snap_a, a.device, a.device_memory, None, TorchVersion::DEFAULT).map_err(allocsim_commands::Error::from)?;
            crate::cli::say_device(io, &snap_a, a.device, a.json)?;
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
