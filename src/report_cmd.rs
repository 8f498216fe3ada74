//! `allocsim report`.

use std::path::PathBuf;

use allocsim_model::AllocatorConfig;
use allocsim_model::constants::H200_TOTAL_MEMORY;
use allocsim_replay::Prepared;
use allocsim_report::html;

use crate::cli::{UserError, load};
use crate::size::parse_size;

#[derive(clap::Args)]
pub struct ReportArgs {
    /// A snapshot (.pickle, .pickle.gz) or an allocsim .jsonl trace.
    pub trace: PathBuf,
    /// Settings to replay under; repeat to overlay several (default: the trace's own).
    #[arg(long)]
    pub config: Vec<String>,
    /// The allowed maximum (e.g. `24GiB`).
    #[arg(long, value_parser = parse_size)]
    pub capacity: Option<u64>,
    /// The allowed maximum the trace was recorded under.
    #[arg(long, value_parser = parse_size)]
    pub trace_capacity: Option<u64>,
    #[arg(long, value_parser = parse_size, default_value_t = H200_TOTAL_MEMORY)]
    pub device_memory: u64,
    /// The HTML file to write.
    #[arg(short, long, default_value = "report.html")]
    pub output: PathBuf,
    /// Also write the plots alone as SVG files into this directory.
    #[arg(long)]
    pub svg: Option<PathBuf>,
}

pub fn cmd_report(a: &ReportArgs) -> Result<i32, UserError> {
    let snap = load(&a.trace)?;
    let own = allocsim_replay::recorded_config(&snap)?;
    let mut configs = Vec::new();
    for c in &a.config {
        let label = if c.trim().is_empty() { "defaults".to_string() } else { c.clone() };
        configs.push((label, AllocatorConfig::parse(c).map_err(|e| UserError(format!("--config {c:?}: {e}")))?));
    }
    if configs.is_empty() {
        let label = if own.source.is_empty() { "defaults (the trace's own)".to_string() } else { format!("{} (the trace's own)", own.source) };
        configs.push((label, own.clone()));
    }
    let trace_capacity = a.trace_capacity.or(if a.config.is_empty() { a.capacity } else { None });
    let p = Prepared::new(&snap, None, a.device_memory, trace_capacity)?;
    let title = a.trace.file_name().map_or("trace".to_string(), |f| f.to_string_lossy().to_string());
    let report = html::build(&p, &title, &configs, a.capacity, &p.recorded_placement());
    let page = html::render(&report);
    std::fs::write(&a.output, &page).map_err(|e| UserError(format!("{}: {e}", a.output.display())))?;
    eprintln!("wrote {} ({} KiB)", a.output.display(), page.len() / 1024);
    if let Some(dir) = &a.svg {
        std::fs::create_dir_all(dir).map_err(|e| UserError(format!("{}: {e}", dir.display())))?;
        let mut files = vec![("timeline.svg".to_string(), html::timeline_svg(&report)), ("fragmentation.svg".to_string(), html::frag_svg(&report))];
        for (i, (_, svg)) in report.maps.iter().enumerate() {
            files.push((format!("segments-{}.svg", if i == 0 { "peak" } else { "oom" }), svg.clone()));
        }
        for (name, svg) in files {
            let path = dir.join(&name);
            std::fs::write(&path, svg).map_err(|e| UserError(format!("{}: {e}", path.display())))?;
        }
        eprintln!("wrote the plots to {}", dir.display());
    }
    Ok(0)
}

#[derive(clap::Args)]
pub struct ExportArgs {
    /// A snapshot (.pickle, .pickle.gz) or an allocsim .jsonl trace.
    pub trace: PathBuf,
    /// Settings to replay under (default: the trace's own).
    #[arg(long)]
    pub config: Option<String>,
    /// The allowed maximum (e.g. `24GiB`).
    #[arg(long, value_parser = parse_size)]
    pub capacity: Option<u64>,
    /// The allowed maximum the trace was recorded under.
    #[arg(long, value_parser = parse_size)]
    pub trace_capacity: Option<u64>,
    #[arg(long, value_parser = parse_size, default_value_t = H200_TOTAL_MEMORY)]
    pub device_memory: u64,
    /// Where to write the simulated snapshot: `.pickle`, `.pickle.gz` (for memory_viz and
    /// `torch.cuda._memory_viz`) or `.jsonl`.
    #[arg(short, long)]
    pub output: PathBuf,
}

pub fn cmd_export(a: &ExportArgs) -> Result<i32, UserError> {
    let snap = load(&a.trace)?;
    let own = allocsim_replay::recorded_config(&snap)?;
    let config = match &a.config {
        Some(c) => AllocatorConfig::parse(c).map_err(|e| UserError(format!("--config {c:?}: {e}")))?,
        None => own,
    };
    let trace_capacity = a.trace_capacity.or(if a.config.is_none() { a.capacity } else { None });
    let p = Prepared::new(&snap, None, a.device_memory, trace_capacity)?;
    let sim = allocsim_report::export::simulated_snapshot(&p, &config, a.capacity, &p.recorded_placement());
    allocsim_trace::write_trace(&sim, &a.output).map_err(|e| UserError(format!("{}: {e}", a.output.display())))?;
    let n: usize = sim.device_traces.iter().map(|t| t.len()).sum();
    eprintln!("wrote {} ({n} trace entries, {} segments) — open it in https://pytorch.org/memory_viz", a.output.display(), sim.segments.len());
    Ok(0)
}
