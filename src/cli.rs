//! Command-line interface: argument parsing, dispatch, and the `replay`, `validate` and
//! `convert` commands.

use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};

use allocsim_model::format::{format_size, oom_message};
use allocsim_replay::program::Request;
use allocsim_replay::replay::Oom;
use allocsim_replay::stream::{StreamError, StreamInput, Streamed, replay_stream};
use allocsim_replay::{ReplaySpec, ReplaySummary};
use allocsim_trace::Snapshot;
use allocsim_trace::jsonl_stream::JsonlFile;
use clap::{Parser, Subcommand};
use serde_json::{Value, json};

use crate::output::{Io, PipeWriter};
use crate::size::parse_size;

#[derive(Parser)]
#[command(name = "allocsim", version, about = "Replays PyTorch CUDA caching-allocator snapshots through an exact model of the allocator (PyTorch 2.11 rules)")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args, Clone)]
struct ReplayArgs {
    /// A snapshot from `torch.cuda.memory._dump_snapshot()` (.pickle, .pickle.gz) or an allocsim .jsonl trace.
    trace: PathBuf,
    /// A `PYTORCH_CUDA_ALLOC_CONF` string (default: the settings recorded in the snapshot).
    #[arg(long)]
    config: Option<String>,
    /// The allowed maximum, as `set_per_process_memory_fraction` gives it: bytes or e.g. `24GiB`.
    /// Default: the budget the trace was recorded under, inferred from its OOM entries and segment
    /// events (an allowed maximum, or a device full with memory held outside the allocator).
    #[arg(long, value_parser = parse_size)]
    capacity: Option<u64>,
    /// The device's total memory (for `per_process_memory_fraction`, expandable reservations and
    /// the OOM message). Default: as the trace shows it, else an H200's.
    #[arg(long, value_parser = parse_size)]
    device_memory: Option<u64>,
    /// The allowed maximum the trace itself was recorded under (tells its `empty_cache()` calls
    /// from the releases of its own OOM retries). Default: `--capacity` when replaying under the
    /// trace's own settings, else none.
    #[arg(long, value_parser = parse_size)]
    trace_capacity: Option<u64>,
    /// Give new segments the addresses another recorded run of the same requests gave them.
    #[arg(long)]
    addresses_from: Option<PathBuf>,
    /// Also replay under N plausible segment placements and report each outcome.
    #[arg(long)]
    placements: Option<usize>,
    /// Which device's trace to replay (default: every device with entries, each on its own
    /// allocator; `--json` keeps the first one's at the top level and lists all in `devices`).
    #[arg(long)]
    device: Option<usize>,
    /// The PyTorch release whose allocator rules apply, 2.1 to 2.15 (a snapshot does not record
    /// its version; default 2.11; 2.1–2.4 were not measured: 2.5's rules). See
    /// `allocsim_replay::version` for what changes.
    #[arg(long, value_parser = allocsim_replay::TorchVersion::parse, default_value = "2.11")]
    torch_version: allocsim_replay::TorchVersion,
    /// Read the whole trace before replaying it, as for a pickle. By default a JSON Lines trace
    /// (.jsonl, .jsonl.gz) is replayed as a stream in memory bounded by the live set, with the
    /// same result, unless it starts mid-history or `--placements`/`--addresses-from` is given.
    #[arg(long)]
    in_memory: bool,
}

#[derive(Subcommand)]
enum Command {
    /// Replay a snapshot's requests and report what the allocator does.
    Replay {
        #[command(flatten)]
        args: ReplayArgs,
        /// Print one JSON object (stats, segment events, OOMs, placements).
        #[arg(long)]
        json: bool,
        /// `cuda`: also drive a real GPU with the model's decisions and check every segment event
        /// against the device's used memory (needs a build with `--features cuda`).
        #[arg(long, value_enum, default_value_t = Backend::Sim)]
        backend: Backend,
    },
    /// Replay a snapshot under its own settings and check every recorded segment event, OOM,
    /// allocation address and the final segments. Exit status 1 if anything differs.
    Validate {
        trace: PathBuf,
        /// The allowed maximum the trace was recorded under (default: inferred from the trace).
        #[arg(long, value_parser = parse_size)]
        capacity: Option<u64>,
        /// The device's total memory (default: as the trace shows it, else an H200's).
        #[arg(long, value_parser = parse_size)]
        device_memory: Option<u64>,
        /// Which device's trace (default: every device with entries; `--json` puts the one that
        /// matters, as `replay` ranks them, at the top level and all of them in `devices`).
        #[arg(long)]
        device: Option<usize>,
        /// The PyTorch release whose allocator rules apply (see `replay --torch-version`).
        #[arg(long, value_parser = allocsim_replay::TorchVersion::parse, default_value = "2.11")]
        torch_version: allocsim_replay::TorchVersion,
        #[arg(long)]
        json: bool,
    },
    /// Why did this request run out of memory? The request, the allocator's steps, where the free
    /// memory is, the blocks pinning it, and what would have worked.
    Explain(crate::explain_cmd::ExplainArgs),
    /// A self-contained HTML report: timeline, OOM markers, fragmentation, segment maps.
    Report(crate::report_cmd::ReportArgs),
    /// Write a simulated run (under any config) as a snapshot for memory_viz / torch.cuda._memory_viz.
    Export(crate::report_cmd::ExportArgs),
    /// Replay under every config of a grid and rank them: which setting saves this job?
    Sweep(crate::whatif_cmds::SweepArgs),
    /// The smallest allowed maximum (to the 2 MiB) at which the trace runs without OOM.
    Fit(crate::whatif_cmds::FitArgs),
    /// The trace cut into iterations (the optimizer's steps, or `--by NAME`) and annotated
    /// regions, each with its peaks under the replayed config: which step peaks, and where.
    Phases(crate::phases_cmd::PhasesArgs),
    /// Two runs of the same requests side by side: where reserved memory diverges, and why.
    Compare(crate::whatif_cmds::CompareArgs),
    /// Generate a seeded synthetic snapshot (training steps, variable-length batches, KV-cache
    /// growth, random) of any length, for scale tests; `-o trace.jsonl` streams in constant memory.
    Synth(crate::synth_cmd::SynthArgs),
    /// Convert a trace between formats: `-o trace.jsonl` (allocsim's JSON Lines) or
    /// `-o snapshot.pickle` / `.pickle.gz` (a torch 2.11 snapshot pickle); `.gz` gzips.
    Convert {
        input: PathBuf,
        #[arg(short, long)]
        output: PathBuf,
    },
}

/// An error for the user: one line, exit status 2.
#[derive(Debug)]
pub struct UserError(pub String);

impl<E: std::fmt::Display> From<E> for UserError {
    fn from(e: E) -> Self {
        UserError(e.to_string())
    }
}

/// The binary: parses the process's arguments (clap prints help and argument errors itself) and
/// runs the command on stdout and stderr. A reader that closes either early ends the command
/// quietly (see [`crate::output`]).
pub fn main() -> i32 {
    let cli = Cli::parse();
    let stdout = std::io::stdout();
    let stderr = std::io::stderr();
    let mut out = PipeWriter::new(std::io::BufWriter::with_capacity(1 << 16, stdout.lock()));
    let mut err = PipeWriter::new(stderr.lock());
    let code = execute(cli.command, &mut Io { out: &mut out, err: &mut err });
    match out.flush() {
        Ok(()) => code,
        Err(e) => report(&mut err, &UserError(format!("writing the output: {e}"))),
    }
}

/// Runs one command line (`argv[0]` is the program name) with its answer written to `out` and
/// its notes to `err`; returns the exit status the binary would have. Argument errors and
/// `--help` are written as clap renders them (without colour).
pub fn run<I, T>(argv: I, out: &mut dyn Write, err: &mut dyn Write) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    match Cli::try_parse_from(argv) {
        Ok(cli) => execute(cli.command, &mut Io { out, err }),
        Err(e) => {
            let text = e.render().to_string();
            let w: &mut dyn Write = if e.use_stderr() { err } else { out };
            let _ = w.write_all(text.as_bytes());
            e.exit_code()
        }
    }
}

/// Runs a parsed command: its exit status, or 2 after one `allocsim: error:` line.
fn execute(command: Command, io: &mut Io<'_>) -> i32 {
    let r = match command {
        Command::Replay { args, json, backend: Backend::Sim } => cmd_replay(&args, json, io),
        Command::Replay { args, json, backend: Backend::Cuda } => cmd_replay_cuda(&args, json, io),
        Command::Validate { trace, capacity, device_memory, device, torch_version, json } => {
            cmd_validate(&trace, &ValidateArgs { capacity, device_memory, device, torch_version }, json, io)
        }
        Command::Convert { input, output } => cmd_convert(&input, &output, io),
        Command::Explain(a) => crate::explain_cmd::cmd_explain(&a, io),
        Command::Report(a) => crate::report_cmd::cmd_report(&a, io),
        Command::Export(a) => crate::report_cmd::cmd_export(&a, io),
        Command::Sweep(a) => crate::whatif_cmds::cmd_sweep(&a, io),
        Command::Fit(a) => crate::whatif_cmds::cmd_fit(&a, io),
        Command::Phases(a) => crate::phases_cmd::cmd_phases(&a, io),
        Command::Compare(a) => crate::whatif_cmds::cmd_compare(&a, io),
        Command::Synth(a) => crate::synth_cmd::cmd_synth(&a, io),
    };
    match r {
        Ok(code) => code,
        Err(e) => report(io.err, &e),
    }
}

/// Writes the error line; exit status 2.
fn report(err: &mut dyn Write, e: &UserError) -> i32 {
    let _ = writeln!(err, "allocsim: error: {}", e.0);
    let _ = err.flush();
    2
}

/// Says which device a command answers for when it chose one (several devices, no `--device`):
/// a first line of the text output, or a note on stderr beside machine-readable output.
pub(crate) fn say_device(io: &mut Io<'_>, choice: &allocsim_replay::devices::DeviceChoice, machine: bool) -> std::io::Result<()> {
    let Some(text) = choice.describe() else { return Ok(()) };
    if machine {
        writeln!(io.err, "allocsim: note: answering for {text}")
    } else {
        writeln!(io.out, "answering for {text}")
    }
}

/// Says what a snapshot without any trace entry can tell (and how to record history): a line of
/// the text output, or a note on stderr beside machine-readable output. Returns whether it did.
pub(crate) fn say_no_history(io: &mut Io<'_>, snap: &Snapshot, machine: bool) -> std::io::Result<bool> {
    let Some(text) = snap.no_history_note() else { return Ok(false) };
    if machine {
        writeln!(io.err, "allocsim: note: {text}")?;
    } else {
        writeln!(io.out, "note: {text}")?;
    }
    Ok(true)
}

pub(crate) fn load(path: &Path) -> Result<Snapshot, UserError> {
    allocsim_trace::read_trace(path).map_err(|e| trace_error(path, e))
}

/// A trace that cannot be read, as the user sees it.
fn trace_error(path: &Path, e: allocsim_trace::TraceError) -> UserError {
    match e {
        // Already names the path.
        allocsim_trace::TraceError::Io { .. } => UserError(e.to_string()),
        _ => UserError(format!("{}: {e}", path.display())),
    }
}

impl ReplayArgs {
    /// The replay question these arguments ask (`other`: the loaded `--addresses-from` run).
    fn spec<'a>(&self, other: Option<&'a Snapshot>) -> ReplaySpec<'a> {
        ReplaySpec {
            config: self.config.clone(),
            capacity: self.capacity,
            device_memory: self.device_memory,
            trace_capacity: self.trace_capacity,
            addresses_from: other,
            placements: self.placements,
            device: self.device,
            torch_version: self.torch_version,
        }
    }
}

/// `--device N`: that device; else every device with entries (in device order). A JSON Lines
/// trace is replayed as a stream, in memory bounded by the live set, where that gives the same
/// answer (see `allocsim_replay::stream`); else (and for pickles) the trace is read whole.
/// Also returns what to say about a snapshot without any trace entry.
fn run_replays(args: &ReplayArgs, err: &mut dyn Write) -> Result<(Vec<ReplaySummary>, Option<String>), UserError> {
    if !args.in_memory
        && args.addresses_from.is_none()
        && args.placements.is_none()
        && let Some(file) = JsonlFile::open(&args.trace).map_err(|e| trace_error(&args.trace, e))?
        && let Some(v) = run_streamed(&file, args, err)?
    {
        let note = v.iter().all(|r| r.entries == 0).then(|| Snapshot::default().no_history_note()).flatten();
        return Ok((v, note));
    }
    let snap = load(&args.trace)?;
    let other = args.addresses_from.as_deref().map(load).transpose()?;
    let spec = args.spec(other.as_ref());
    let note = snap.no_history_note();
    if args.device.is_some() {
        return Ok((vec![allocsim_replay::run(&snap, &spec)?.into_summary()], note));
    }
    Ok((allocsim_replay::devices::run_devices(&snap, &spec)?.into_iter().map(|r| r.into_summary()).collect(), note))
}

/// Above this size a JSON Lines trace replayed in memory after all takes GiBs: say so.
const NOTE_FALLBACK_ABOVE: u64 = 1 << 30;

/// Replays a JSON Lines trace in one pass over its events (after a first pass for its final
/// segments); `None` when only the in-memory replay gives the answer.
fn run_streamed(file: &JsonlFile, args: &ReplayArgs, err: &mut dyn Write) -> Result<Option<Vec<ReplaySummary>>, UserError> {
    let path = file.path();
    let scan = file.scan().map_err(|e| trace_error(path, e))?;
    let input = StreamInput {
        settings: &scan.header.settings,
        devices: scan.header.devices,
        segments: &scan.segments,
        segment_entries: &scan.segment_entries,
    };
    match replay_stream(&input, &args.spec(None), || file.events()) {
        Ok(Streamed::Done(v)) => Ok(Some(v)),
        Ok(Streamed::Fallback(why)) => {
            if file.len() > NOTE_FALLBACK_ABOVE {
                writeln!(err, "allocsim: note: {}: replaying in memory ({why})", path.display())?;
            }
            Ok(None)
        }
        Err(StreamError::Read(e)) => Err(trace_error(path, e)),
        Err(StreamError::Run(e)) => Err(e.into()),
    }
}

/// The budget in words, for text output (nothing when there is nothing to say).
pub(crate) fn budget_lines(b: &allocsim_replay::Budget) -> Vec<String> {
    if b.kind.is_none() && b.device_memory.source != allocsim_replay::budget::DeviceMemorySource::Inferred {
        return Vec::new();
    }
    b.describe()
}

/// The state a truncated trace starts from (`null`: an empty allocator).
fn initial_state_json(r: &ReplaySummary) -> Value {
    match &r.initial {
        None => Value::Null,
        Some(s) => json!({
            "segments": s.segments.len(),
            "reserved_bytes": s.reserved_bytes(),
            "blocks": s.blocks.len(),
            "allocated_blocks": s.allocated_blocks(),
            "allocated_bytes": s.allocated_bytes(),
            "pending_free_blocks": s.pending_blocks(),
            "inferred_block_sizes": s.inferred_sizes,
            "restore_failures": r.outcome.restore_failures,
        }),
    }
}

/// One summary per device, in device order.
fn devices_json(all: &[ReplaySummary]) -> Value {
    let rank = allocsim_replay::devices::worst_first(all);
    Value::from(
        all.iter()
            .enumerate()
            .map(|(i, r)| {
                let s = &r.outcome.stats;
                json!({
                    "device": r.device,
                    "rank": rank.iter().position(|&k| k == i),
                    "requests": r.requests,
                    "ooms": r.outcome.ooms.len(),
                    "first_oom": r.outcome.first_oom(),
                    "peak_reserved": r.outcome.peak_reserved,
                    "peak_allocated": s.allocated_bytes.all().peak,
                    "reserved_at_end": s.reserved_bytes.all().current,
                    "num_device_alloc": s.num_device_alloc,
                    "num_device_free": s.num_device_free,
                    "initial_state": initial_state_json(r),
                })
            })
            .collect::<Vec<_>>(),
    )
}

/// The OOM message as PyTorch would print it, with `device_free` from the trace where it recorded
/// one (see `allocsim_replay::oom`); NVML's per-process sentence cannot be known and is left out.
fn message(r: &ReplaySummary, o: &Oom, device_free: u64) -> String {
    let mut info = o.info.clone();
    info.device_free = device_free;
    oom_message(&info, r.device as i32, "")
}

fn oom_json(r: &ReplaySummary, o: &Oom, &(ref req, device_free): &(Request, u64)) -> Value {
    json!({
        "request": o.request,
        "size": o.info.rounded_size,
        "orig_size": o.info.orig_size,
        "alloc_size": o.info.alloc_size,
        "stream": o.info.stream,
        "pool": if o.info.is_small { "small" } else { "large" },
        "recorded_oom": req.recorded_oom,
        "trace_index": req.trace_index,
        "allocated_bytes": o.info.allocated_bytes,
        "reserved_bytes": o.info.reserved_bytes,
        "message": message(r, o, device_free),
    })
}

/// Fragmentation figures of a replay (definitions in `allocsim_report::frag`).
fn fragmentation_json(o: &allocsim_replay::ReplayOutcome) -> Value {
    let s = &o.stats;
    let end = allocsim_report::frag::breakdown(&o.allocator);
    json!({
        "utilization": s.active_bytes.all().peak as f64 / (s.reserved_bytes.all().peak.max(1) as f64),
        "peak_reserved_minus_peak_allocated": s.reserved_bytes.all().peak - s.allocated_bytes.all().peak,
        "at_end": end,
    })
}

fn cmd_replay(args: &ReplayArgs, as_json: bool, io: &mut Io<'_>) -> Result<i32, UserError> {
    let (all, no_history) = run_replays(args, io.err)?;
    let choice = allocsim_replay::devices::choice_of_replays(&all).expect("at least one device is replayed");
    let top = all.iter().position(|r| r.device == choice.device).unwrap_or(0);
    if as_json {
        let mut v = replay_json(args, &all[top], &all);
        v["device_choice"] = serde_json::to_value(&choice).expect("JSON");
        v["no_history"] = json!(no_history);
        v["torch_version_note"] = json!(args.torch_version.note());
        write_json(io.out, &v)?;
        return Ok(0);
    }
    write_replay_text(io.out, args, &all, no_history.as_deref())?;
    Ok(0)
}

/// Writes one JSON value and a newline.
pub fn write_json<T: serde::Serialize + ?Sized>(out: &mut dyn Write, v: &T) -> std::io::Result<()> {
    serde_json::to_writer(&mut *out, v)?;
    writeln!(out)
}

/// `replay --json`: the device `r` at the top level, every device in `devices`.
fn replay_json(args: &ReplayArgs, r: &ReplaySummary, all: &[ReplaySummary]) -> Value {
    let o = &r.outcome;
    let placements: Vec<Value> = r
        .placements
        .iter()
        .map(|(name, p)| json!({"name": name, "first_oom": p.first_oom(), "peak_reserved": p.peak_reserved, "ooms": p.ooms.len()}))
        .collect();
    json!({
        "trace": args.trace.display().to_string(),
        "device": r.device,
        "config": r.options.config.source,
        "capacity": r.options.capacity,
        "requests": r.requests,
        "stats": o.stats.to_memory_stats(),
        "segment_events": o.segment_events,
        "ooms": o.ooms.iter().zip(&r.oom_requests).map(|(x, q)| oom_json(r, x, q)).collect::<Vec<_>>(),
        "first_oom": o.first_oom(),
        "empty_cache_calls": o.empty_cache_requests,
        "unknown_frees": r.unknown_frees,
        "initial_state": initial_state_json(r),
        "reconstruct_error": r.reconstruct_error,
        "torch_version": args.torch_version.to_string(),
        "devices": devices_json(all),
        "placements": if args.placements.is_some() { Value::from(placements) } else { Value::Null },
        "placement_independent": r.options.config.expandable_segments,
        "fragmentation": fragmentation_json(o),
        "budget": r.budget.as_ref().map(|b| b.to_json()),
        "budget_ends": r.budget_ends,
    })
}

/// `replay` as text: every device, worst first.
fn write_replay_text(out: &mut dyn Write, args: &ReplayArgs, all: &[ReplaySummary], no_history: Option<&str>) -> std::io::Result<()> {
    if all.len() > 1 {
        writeln!(out, "{}: {} devices, each replayed on its own allocator; worst first (most OOMs, then highest peak reserved)", args.trace.display(), all.len())?;
    }
    if let Some(note) = args.torch_version.note() {
        writeln!(out, "note: {note}")?;
    }
    if let Some(note) = no_history {
        writeln!(out, "note: {note}")?;
    }
    for &i in &allocsim_replay::devices::worst_first(all) {
        write_device_text(out, args, &all[i])?;
    }
    Ok(())
}

fn write_device_text(out: &mut dyn Write, args: &ReplayArgs, r: &ReplaySummary) -> std::io::Result<()> {
    let o = &r.outcome;
    let placement_independent = r.options.config.expandable_segments;
    let s = &o.stats;
    let conf = if r.options.config.source.is_empty() { "defaults".to_string() } else { r.options.config.source.clone() };
    writeln!(out, "{} (device {}): {} requests replayed under {conf}", args.trace.display(), r.device, r.requests)?;
    match &r.budget {
        Some(b) if args.capacity.is_none() && (b.kind.is_some() || b.device_memory.source == allocsim_replay::budget::DeviceMemorySource::Inferred) => {
            for line in budget_lines(b) {
                writeln!(out, "  budget            {line}")?;
            }
        }
        _ => {
            if let Some(c) = r.options.capacity {
                writeln!(out, "  allowed maximum   {} ({c} bytes)", format_size(c))?;
            }
        }
    }
    if let [lo, hi] = r.budget_ends.as_slice() {
        let at = |e: &allocsim_replay::run::BudgetEnd| match e.first_oom {
            Some(q) => format!("{} OOMs from request {q}", e.ooms),
            None => format!("no OOM, peak reserved {}", format_size(e.peak_reserved)),
        };
        let same = (lo.first_oom, lo.ooms) == (hi.first_oom, hi.ooms) && (lo.first_oom, lo.ooms) == (o.first_oom(), o.ooms.len());
        writeln!(
            out,
            "  uncertainty       at the ends of the inferred allowed maximum: {} allowed → {}; {} allowed → {}{}",
            format_size(lo.capacity),
            at(lo),
            format_size(hi.capacity),
            at(hi),
            if same { " (the same OOMs as replayed)" } else { ": the answer depends on where in that interval the real maximum lies" }
        )?;
    }
    let peak_res = s.reserved_bytes.all().peak as u64;
    let peak_alloc = s.allocated_bytes.all().peak as u64;
    writeln!(
        out,
        "  peak reserved     {}   (peak allocated {}; {} reserved beyond it)",
        format_size(peak_res),
        format_size(peak_alloc),
        format_size(peak_res.saturating_sub(peak_alloc))
    )?;
    let expandable = o.allocator.segments().iter().filter(|g| g.is_expandable).count();
    if expandable > 0 {
        writeln!(
            out,
            "  at the end        {} reserved ({} mapped range{} of expandable segments{}), {} allocated",
            format_size(s.reserved_bytes.all().current as u64),
            expandable,
            if expandable == 1 { "" } else { "s" },
            match s.segment.all().current {
                0 => "; memory_stats()' `segment` counter counts cudaMalloc'd segments only and says 0".to_string(),
                n => format!(", and {n} cudaMalloc'd segments"),
            },
            format_size(s.allocated_bytes.all().current as u64)
        )?;
    } else {
        writeln!(
            out,
            "  at the end        {} reserved in {} segments, {} allocated",
            format_size(s.reserved_bytes.all().current as u64),
            s.segment.all().current,
            format_size(s.allocated_bytes.all().current as u64)
        )?;
    }
    writeln!(
        out,
        "  device calls      {} cudaMalloc/map, {} cudaFree/unmap; {} alloc retries, {} full synchronizations",
        s.num_device_alloc, s.num_device_free, s.num_alloc_retries, s.num_sync_all_streams
    )?;
    let end = allocsim_report::frag::breakdown(&o.allocator);
    writeln!(
        out,
        "  fragmentation     utilization {:.1}% (peak active ÷ peak reserved); at the end {} free, largest block {} ({:.0}% of the free), {} rounding inside live blocks",
        100.0 * s.active_bytes.all().peak as f64 / (peak_res.max(1) as f64),
        format_size(end.free),
        format_size(end.largest_free_block),
        if end.free > 0 { 100.0 * end.largest_free_block as f64 / end.free as f64 } else { 100.0 },
        format_size(end.rounding_waste)
    )?;
    let ec = &o.empty_cache_requests;
    if !ec.is_empty() {
        writeln!(out, "  empty_cache()     {} calls, inferred from the trace's releases", ec.len())?;
    }
    if let Some(init) = &r.initial
        && r.entries == 0
    {
        writeln!(
            out,
            "  final state       {} segments ({} reserved) holding {} live blocks ({} allocated, {} pending free); no trace to replay",
            init.segments.len(),
            format_size(init.reserved_bytes()),
            init.blocks.len(),
            format_size(init.allocated_bytes()),
            init.pending_blocks()
        )?;
    } else if let Some(init) = &r.initial {
        writeln!(
            out,
            "  mid-history       {}: the replay starts from the state reconstructed from the final segments, {} pre-existing blocks ({} allocated in {} blocks, {} pending free) in {} segments ({} reserved); counters count from the trace's start, peaks are the trace's",
            allocsim_replay::restore::InitialState::why(r.entries),
            init.blocks.len(),
            format_size(init.allocated_bytes()),
            init.allocated_blocks(),
            init.pending_blocks(),
            init.segments.len(),
            format_size(init.reserved_bytes())
        )?;
    }
    if let Some(e) = &r.reconstruct_error {
        writeln!(out, "  note              the state at the trace's start could not be reconstructed ({e}); the replay starts from an empty allocator")?;
    }
    if r.unknown_frees > 0 {
        writeln!(
            out,
            "  note              {} frees of blocks allocated before the trace began were ignored",
            r.unknown_frees
        )?;
    }
    match o.ooms.first().zip(r.oom_requests.first()) {
        None => writeln!(out, "  OOMs              none")?,
        Some((first, &(ref req, device_free))) => {
            writeln!(
                out,
                "  OOMs              {}; the first at request {} ({} on stream {}{}):",
                o.ooms.len(),
                first.request,
                format_size(req.size),
                req.stream,
                if req.recorded_oom { ", an OOM in the trace too" } else { "" }
            )?;
            writeln!(out, "    {}", message(r, first, device_free))?;
            let rest: Vec<String> = o.ooms.iter().skip(1).take(8).map(|x| x.request.to_string()).collect();
            if !rest.is_empty() {
                writeln!(out, "    later OOMs at requests {}{}", rest.join(", "), if o.ooms.len() > 9 { ", ..." } else { "" })?;
            }
        }
    }
    if !r.placements.is_empty() {
        let n = r.placements.len();
        let fits: Vec<u64> = r.placements.iter().filter(|(_, p)| p.first_oom().is_none()).map(|(_, p)| p.peak_reserved).collect();
        let n_oom = n - fits.len();
        let mut line = match (fits.iter().min(), fits.iter().max()) {
            (Some(lo), Some(hi)) if lo == hi => format!("peak reserved {} in every placement without OOM", format_size(*lo)),
            (Some(lo), Some(hi)) => format!("peak reserved {}–{} depending on where the driver places segments ({} sampled placements; a sample, not a bound)", format_size(*lo), format_size(*hi), n),
            _ => String::new(),
        };
        if n_oom > 0 {
            if !line.is_empty() {
                line.push_str("; ");
            }
            line.push_str(&format!("OOM in {n_oom} of {n} placements"));
        }
        writeln!(out, "  placements        {line}")?;
        if placement_independent {
            writeln!(out, "                    (expandable segments: the decisions do not depend on where segments are placed)")?;
        }
        for (name, p) in &r.placements {
            writeln!(
                out,
                "    {name:<11} peak reserved {:>11}   first OOM {}",
                format_size(p.peak_reserved),
                p.first_oom().map_or("none".to_string(), |x| format!("at request {x}"))
            )?;
        }
    }
    Ok(())
}

/// `validate`'s settings.
struct ValidateArgs {
    capacity: Option<u64>,
    device_memory: Option<u64>,
    device: Option<usize>,
    torch_version: allocsim_replay::TorchVersion,
}

fn cmd_validate(path: &Path, a: &ValidateArgs, as_json: bool, io: &mut Io<'_>) -> Result<i32, UserError> {
    let snap = load(path)?;
    let spec = ReplaySpec { capacity: a.capacity, device_memory: a.device_memory, device: a.device, torch_version: a.torch_version, ..ReplaySpec::default() };
    let runs = match a.device {
        Some(_) => vec![allocsim_replay::run(&snap, &spec)?],
        None => allocsim_replay::devices::run_devices(&snap, &spec)?,
    };
    let checks: Vec<allocsim_replay::Validation> = runs.iter().map(allocsim_replay::validate).collect();
    let exact = checks.iter().all(|v| v.exact);
    // The device that matters first (most OOMs, then highest peak reserved), as `replay` lists them.
    let order: Vec<usize> = {
        let mut o: Vec<usize> = (0..runs.len()).collect();
        o.sort_by_key(|&i| (std::cmp::Reverse(runs[i].outcome.ooms.len()), std::cmp::Reverse(runs[i].outcome.peak_reserved), runs[i].device));
        o
    };
    if as_json {
        let one = |r: &allocsim_replay::Replayed, v: &allocsim_replay::Validation| {
            let mut json = serde_json::to_value(v).expect("JSON");
            json["device"] = json!(r.device);
            json["budget"] = r.budget.to_json();
            json
        };
        let top = order[0];
        let mut json = one(&runs[top], &checks[top]);
        json["exact"] = json!(exact);
        json["exact_device"] = json!(checks[top].exact);
        json["torch_version"] = json!(a.torch_version.to_string());
        json["devices"] = Value::from(runs.iter().zip(&checks).map(|(r, v)| one(r, v)).collect::<Vec<_>>());
        write_json(io.out, &json)?;
        return Ok(if exact { 0 } else { 1 });
    }
    let out = &mut *io.out;
    if runs.len() > 1 {
        writeln!(out, "{}: {} devices with entries, each validated on its own allocator", path.display(), runs.len())?;
    }
    if let Some(note) = a.torch_version.note() {
        writeln!(out, "note: {note}")?;
    }
    if let Some(note) = snap.no_history_note() {
        writeln!(out, "note: {note}")?;
    }
    for &i in &order {
        let (r, v) = (&runs[i], &checks[i]);
        writeln!(out, "{} (device {}): replay under its own settings against the recording", path.display(), r.device)?;
        for line in budget_lines(&r.budget) {
            writeln!(out, "  budget           {line}")?;
        }
        for (name, a) in [
            ("segment events", &v.segment_events),
            ("OOMs", &v.ooms),
            ("alloc addresses", &v.alloc_addresses),
            ("final segments", &v.final_segments),
        ] {
            writeln!(
                out,
                "  {name:<16} {}/{} reproduced{}",
                a.matched,
                a.recorded,
                a.first_divergence.as_ref().map(|d| format!("; first divergence: {d}")).unwrap_or_default()
            )?;
        }
        writeln!(out, "  {}", if v.exact { "exact" } else { "NOT exact" })?;
    }
    Ok(if exact { 0 } else { 1 })
}

fn cmd_convert(input: &Path, output: &Path, io: &mut Io<'_>) -> Result<i32, UserError> {
    let snap = load(input)?;
    allocsim_trace::write_trace(&snap, output)?;
    let n: usize = snap.device_traces.iter().map(|t| t.len()).sum();
    writeln!(io.err, "wrote {} ({} trace entries, {} segments)", output.display(), n, snap.segments.len())?;
    Ok(0)
}

// ----- `replay --backend cuda` (the GPU part lives in crates/cuda, behind the `cuda` feature) -----

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Backend {
    /// The simulated device only.
    Sim,
    /// The simulated replay, then the same requests on GPU 0 (cudarc), every segment event checked.
    Cuda,
}

#[cfg(not(feature = "cuda"))]
fn cmd_replay_cuda(_: &ReplayArgs, _: bool, _: &mut Io<'_>) -> Result<i32, UserError> {
    Err(UserError("allocsim was built without the `cuda` feature; rebuild with --features cuda".into()))
}

/// Replays on the simulated device (which infers the `empty_cache()` calls), then on GPU 0 with the
/// same calls. Exit status 1 if any segment event's measured memory differs from the model's.
#[cfg(feature = "cuda")]
fn cmd_replay_cuda(args: &ReplayArgs, as_json: bool, io: &mut Io<'_>) -> Result<i32, UserError> {
    let snap = load(&args.trace)?;
    let other = args.addresses_from.as_deref().map(load).transpose()?;
    let r = allocsim_replay::run(&snap, &args.spec(other.as_ref()))?;
    let gpu = allocsim_cuda::replay_on_gpu(&r.program, &r.options, &r.outcome.empty_cache, 0)?;
    // Real addresses differ from the simulated ones; without expandable segments best fit breaks
    // ties by address, so the GPU replay's decisions can differ from the simulated replay's.
    let key = |e: &allocsim_replay::replay::SegmentEvent| (e.action, e.size, e.request);
    let sim: Vec<_> = r.outcome.segment_events.iter().map(key).collect();
    let real: Vec<_> = gpu.model_events.iter().map(key).collect();
    let first_difference = (sim != real).then(|| sim.iter().zip(&real).position(|(a, b)| a != b).unwrap_or(sim.len().min(real.len())));
    if as_json {
        let v = json!({
            "trace": args.trace.display().to_string(),
            "device": r.device,
            "config": r.options.config.source,
            "capacity": r.options.capacity,
            "simulated": {"segment_events": sim.len(), "peak_reserved": r.outcome.peak_reserved, "first_oom": r.outcome.first_oom()},
            "gpu": gpu,
            "same_events_as_simulated": first_difference.is_none(),
            "first_difference": first_difference,
            "exact": gpu.exact(),
        });
        write_json(io.out, &v)?;
    } else {
        let out = &mut *io.out;
        writeln!(
            out,
            "{} (device {}): {} requests, simulated ({} segment events, peak reserved {}), then replayed on the GPU",
            args.trace.display(),
            r.device,
            r.program.requests.len(),
            sim.len(),
            format_size(r.outcome.peak_reserved)
        )?;
        writeln!(out, "{gpu}")?;
        match first_difference {
            None => writeln!(out, "  the GPU replay made the same segment events (action, size, request) as the simulated one")?,
            Some(i) => writeln!(
                out,
                "  the GPU replay's segment events differ from the simulated ones from event {i} on (the driver placed segments elsewhere; best fit breaks ties by address)"
            )?,
        }
    }
    Ok(if gpu.exact() { 0 } else { 1 })
}
