//! `allocsim report`.

use std::path::PathBuf;

use allocsim_report::html;

use crate::cli::UserError;
use crate::output::Io;
use crate::size::parse_size;
use crate::whatif_cmds::{TraceArgs, parse_config};

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
    // When the first config is the trace's own, --capacity is taken as the cap it was recorded under.
    let (_, p, first) = a.trace.prepare_for(a.config.first().map(String::as_str), a.capacity)?;
    crate::cli::say_device(io, &p.choice, true)?;
    let mut configs = Vec::new();
    for c in &a.config {
        let label = if c.trim().is_empty() { "defaults".to_string() } else { c.clone() };
        configs.push((label, parse_config(c)?));
    }
    if configs.is_empty() {
        let label = if first.source.is_empty() { "defaults (the trace's own)".to_string() } else { format!("{} (the trace's own)", first.source) };
        configs.push((label, first));
    }
    let title = a.trace.trace.file_name().map_or("trace".to_string(), |f| f.to_string_lossy().to_string());
    let report = html::build(&p, &title, &configs, a.capacity, &p.recorded_placement());
    let page = html::render(&report);
    std::fs::write(&a.output, &page).map_err(|e| UserError(format!("{}: {e}", a.output.display())))?;
    writeln!(io.err, "wrote {} ({} KiB)", a.output.display(), page.len() / 1024)?;
    if let Some(dir) = &a.svg {
        std::fs::create_dir_all(dir).map_err(|e| UserError(format!("{}: {e}", dir.display())))?;
        let mut files = vec![("timeline.svg".to_string(), html::timeline_svg(&report)), ("fragmentation.svg".to_string(), html::frag_svg(&report))];
        if let Some(ph) = &report.phases {
            files.push(("iterations.svg".to_string(), html::iterations_svg(ph)));
        }
        for (i, (_, svg)) in report.maps.iter().enumerate() {
            files.push((format!("segments-{}.svg", if i == 0 { "peak" } else { "oom" }), svg.clone()));
        }
        for (name, svg) in files {
            let path = dir.join(&name);
            std::fs::write(&path, svg).map_err(|e| UserError(format!("{}: {e}", path.display())))?;
        }
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
    let (_, p, config) = a.trace.prepare_for(a.config.as_deref(), a.capacity)?;
    crate::cli::say_device(io, &p.choice, true)?;
    let sim = allocsim_report::export::simulated_snapshot(&p, &config, a.capacity, &p.recorded_placement());
    allocsim_trace::write_trace(&sim, &a.output).map_err(|e| UserError(format!("{}: {e}", a.output.display())))?;
    let n: usize = sim.device_traces.iter().map(|t| t.len()).sum();
    writeln!(io.err, "wrote {} ({n} trace entries, {} segments) — open it in https://pytorch.org/memory_viz", a.output.display(), sim.segments.len())?;
    Ok(0)
}
