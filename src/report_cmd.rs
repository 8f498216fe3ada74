//! `allocsim report` (the page: `allocsim_commands::report`) and `allocsim export`.

use std::path::PathBuf;

use allocsim_commands::Trace;
use allocsim_commands::report::ReportOptions;

use crate::common::TraceArgs;
use crate::common::UserError;
use crate::output::Io;
use crate::size::parse_size;

#[derive(clap::Args)]
pub struct ReportArgs {
    #[command(flatten)]
    pub trace: TraceArgs,
    /// Settings to replay under; repeat to overlay several (default: the trace's own).
    #[arg(long)]
    pub config: Vec<String>,
    /// The allowed maximum (e.g. `24GiB`).
    #[arg(long, value_parser = parse_size)]
    pub capacity: Option<u64>,
    /// The HTML file to write.
    #[arg(short, long, default_value = "report.html")]
    pub output: PathBuf,
    /// Also write the plots alone as SVG files into this directory.
    #[arg(long)]
    pub svg: Option<PathBuf>,
}

pub fn cmd_report(a: &ReportArgs, io: &mut Io<'_>) -> Result<i32, UserError> {
    let (snap, name) = a.trace.load()?;
    let options = ReportOptions { trace: a.trace.options(), configs: a.config.clone(), capacity: a.capacity };
    let report = allocsim_commands::report::report(Trace { name: &name, snapshot: &snap }, &options)?;
    crate::common::say_device(io, &snap, a.trace.recorded.device, true)?;
    report.write_page(&a.output)?;
    writeln!(io.err, "wrote {} ({} KiB)", a.output.display(), report.page.len() / 1024)?;
    if let Some(dir) = &a.svg {
        report.write_svgs(dir)?;
        writeln!(io.err, "wrote the plots to {}", dir.display())?;
    }
    Ok(0)
}

#[derive(clap::Args)]
pub struct ExportArgs {
    #[command(flatten)]
    pub trace: TraceArgs,
    /// Settings to replay under (default: the trace's own).
    #[arg(long)]
    pub config: Option<String>,
    /// The allowed maximum (e.g. `24GiB`).
    #[arg(long, value_parser = parse_size)]
    pub capacity: Option<u64>,
    /// Where to write the simulated snapshot: `.pickle`, `.pickle.gz` (for memory_viz and
    /// `torch.cuda._memory_viz`) or `.jsonl`.
    #[arg(short, long)]
    pub output: PathBuf,
}

pub fn cmd_export(a: &ExportArgs, io: &mut Io<'_>) -> Result<i32, UserError> {
    let (snap, _) = a.trace.load()?;
    let (p, config) = a.trace.options().prepare_for(&snap, a.config.as_deref(), a.capacity)?;
    crate::common::say_device(io, &snap, a.trace.recorded.device, true)?;
    let sim = allocsim_report::export::simulated_snapshot(&p, &config, a.capacity, &p.recorded_placement());
    allocsim_trace::write_trace(&sim, &a.output).map_err(|e| UserError(format!("{}: {e}", a.output.display())))?;
    let n: usize = sim.device_traces.iter().map(|t| t.len()).sum();
    writeln!(io.err, "wrote {} ({n} trace entries, {} segments) — open it in https://pytorch.org/memory_viz", a.output.display(), sim.segments.len())?;
    Ok(0)
}
