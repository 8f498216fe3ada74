//! `allocsim sweep` and `fit` (the answers: `allocsim_commands::{sweep, fit}`).

use allocsim_commands::Trace;
use allocsim_commands::fit::FitOptions;
use allocsim_commands::sweep::SweepOptions;

use crate::common::{TraceArgs, UserError, write_answer};
use crate::output::Io;
use crate::size::parse_size;

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
    crate::common::say_device(io, &snap, a.trace.recorded.device, a.json || a.csv)?;
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
    crate::common::say_device(io, &snap, a.trace.recorded.device, a.json)?;
    write_answer(&answer, a.json, io)
}
