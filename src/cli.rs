//! Command-line interface: argument parsing, dispatch, and the `replay`, `validate` and
//! `convert` commands. The answers themselves (text and JSON), and how `replay` reads a file
//! (streamed or in memory), come from `allocsim_commands`.

use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};

use allocsim_commands::Trace;
use allocsim_commands::file::ReplayFile;
use allocsim_commands::replay::ReplayOptions;
use clap::{Parser, Subcommand};

pub use crate::common::UserError;
use crate::common::{load, write_answer};
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
    /// The allowed maximum, as `set_per_process_memory_fraction` gives it: bytes or e.g. `24GiB`
    /// (every size option: at most 2^60 bytes).
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
    /// Also replay under N plausible segment placements (1 to 64) and report each outcome.
    #[arg(long)]
    placements: Option<usize>,
    /// Which device's trace to replay, 0 to 65535 (default: every device with entries, each on its own
    /// allocator; `--json` puts the worst, most OOMs then the highest peak reserved, at the top
    /// level and lists all in `devices`).
    #[arg(long)]
    device: Option<usize>,
    /// The PyTorch release whose allocator rules apply, 2.1 to 2.15 (default: 2.11, measured,
    /// unless the snapshot's `allocator_settings` shows another release; 2.12–2.15 and 2.1–2.10
    /// are read from their wheels and sources, not measured). See docs/versions.md.
    #[arg(long, value_parser = allocsim_replay::TorchVersion::parse)]
    torch_version: Option<allocsim_replay::TorchVersion>,
    /// Read the whole trace with the general decoders (every value of a pickle built) before
    /// replaying it: the reference the default paths are tested against, slower and larger. By
    /// default a JSON Lines trace (.jsonl, .jsonl.gz) or a snapshot pickle (.pickle, .pickle.gz)
    /// is replayed as a stream in memory bounded by the live set, with the same result; one that
    /// starts mid-history, or with `--placements`/`--addresses-from`, is read into memory
    /// compactly (a pickle of torch's shape in one pass, without building its values) and
    /// replayed there.
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
    /// allocation address and the final segments. Exit status 0 if exact, 1 if anything differs
    /// or the trace contradicts itself (a free of a block it never allocated), 3 if there is
    /// nothing to validate (no trace entries: no history was recorded), 2 on an error.
    Validate {
        /// A snapshot (.pickle, .pickle.gz, a snapshot saved as JSON) or an allocsim .jsonl trace.
        trace: PathBuf,
        /// The allowed maximum the trace was recorded under (default: inferred from the trace; at
        /// most 2^60 bytes).
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
        #[arg(long, value_parser = allocsim_replay::TorchVersion::parse)]
        torch_version: Option<allocsim_replay::TorchVersion>,
        /// Print one JSON object (each check's counts, the first difference, the budget) instead
        /// of the text.
        #[arg(long)]
        json: bool,
    },
    /// Why did the job run out of memory? The OOM that ended the run (or `--at`): a verdict (the
    /// request, the cause, a fix checked by replaying), then every OOM, the allocator's steps,
    /// where the free memory is and the blocks pinning it.
    Explain(crate::explain_cmd::ExplainArgs),
    /// A self-contained HTML report: timeline, OOM markers, fragmentation, segment maps.
    Report(crate::report_cmd::ReportArgs),
    /// Write a simulated run (under any config) as a snapshot for memory_viz / torch.cuda._memory_viz.
    Export(crate::report_cmd::ExportArgs),
    /// Replay under every config of a grid and rank them: which setting saves this job?
    Sweep(crate::sweep_cmd::SweepArgs),
    /// The smallest allowed maximum (to the 2 MiB) at which the trace runs without OOM.
    Fit(crate::sweep_cmd::FitArgs),
    /// The trace cut into iterations (the optimizer's steps, or `--by NAME`) and annotated
    /// regions, each with its peaks under the replayed config: which step peaks, and where.
    Phases(crate::phases_cmd::PhasesArgs),
    /// What capturing CUDA graphs for other batch sizes into one shared pool would reserve,
    /// learnt from a trace that captured a few (`--captured`) and replayed (`--batches`).
    Graphs(crate::graphs_cmd::GraphsArgs),
    /// Will it fit? A training or inference step at a shape never run (`--predict`), learnt from
    /// recorded steps at other shapes (`record_function("NAME=VALUE")` regions, or `--values`),
    /// and the largest shape a budget holds (`--largest-under`, `--cards`), by replay.
    Scale(crate::scale_cmd::ScaleArgs),
    /// Runs side by side: two runs of the same requests (where reserved memory diverges, and
    /// why), or the ranks of one job (a directory, a glob or several files: which rank spiked or
    /// ran out of memory first, in which iteration).
    Compare(crate::compare_cmd::CompareArgs),
    /// Generate a seeded synthetic snapshot (training steps, variable-length batches, KV-cache
    /// growth, random) of any length, for scale tests; `-o trace.jsonl` streams in constant memory.
    Synth(crate::synth_cmd::SynthArgs),
    /// Convert a trace between formats: `-o trace.jsonl` (allocsim's JSON Lines) or
    /// `-o snapshot.pickle` / `.pickle.gz` (a torch 2.11 snapshot pickle); `.gz` gzips.
    Convert {
        /// The trace to read: a snapshot (.pickle, .pickle.gz, or saved as JSON) or an allocsim
        /// .jsonl trace.
        input: PathBuf,
        /// The file to write; its name picks the format: `.jsonl`, `.pickle` (add `.gz` to gzip).
        #[arg(short, long)]
        output: PathBuf,
    },
}

/// The binary: parses the process's arguments (clap prints help and argument errors itself) and
/// runs the command on stdout and stderr. A reader that closes either early ends the command
/// quietly (see [`crate::output`]).
pub fn main() -> i32 {
    main_from(std::env::args_os())
}

/// [`main`] with the given command line (`argv[0]` is the program name): what the Python
/// package's `allocsim` command and `python -m allocsim` run.
pub fn main_from<I, T>(argv: I) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(argv) {
        Ok(cli) => cli,
        Err(e) => {
            // As `Cli::parse` does, without exiting: help and version on stdout (status 0),
            // argument errors on stderr (status 2).
            let _ = e.print();
            return e.exit_code();
        }
    };
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

/// The most placements a command replays under (`--placements`).
pub const MAX_PLACEMENTS: usize = allocsim_replay::run::MAX_PLACEMENTS;
/// The largest size a memory option takes (`--capacity`, `--device-memory`, `--cards`, …): 2^60
/// bytes (1 EiB), the bound on what a trace may record (`allocsim_replay::check`).
pub const MAX_MEMORY: u64 = allocsim_replay::check::MAX_ADDRESS;

/// Options out of any sensible range, refused before anything is read: one `allocsim: error:`
/// line naming the option (exit status 2).
fn check_bounds(command: &Command) -> Result<(), UserError> {
    fn memory(name: &str, v: Option<u64>) -> Result<(), UserError> {
        match v {
            Some(b) if b > MAX_MEMORY => Err(UserError(format!("--{name} {b}: beyond any device (at most 2^60 bytes, 1 EiB)"))),
            _ => Ok(()),
        }
    }
    fn placements(v: Option<usize>) -> Result<(), UserError> {
        match v {
            Some(n) if n == 0 || n > MAX_PLACEMENTS => Err(UserError(format!("--placements {n}: out of range (1 to {MAX_PLACEMENTS})"))),
            _ => Ok(()),
        }
    }
    fn device(v: Option<usize>) -> Result<(), UserError> {
        match v {
            Some(d) if d as i64 >= allocsim_replay::check::MAX_DEVICE => {
                Err(UserError(format!("--device {d}: not a device index (0 to {})", allocsim_replay::check::MAX_DEVICE - 1)))
            }
            _ => Ok(()),
        }
    }
    fn recorded(t: &crate::common::RecordedArgs) -> Result<(), UserError> {
        memory("device-memory", t.device_memory)?;
        memory("trace-capacity", t.trace_capacity)?;
        device(t.device)
    }
    let traced = |t: &crate::common::TraceArgs| recorded(&t.recorded);
    match command {
        Command::Replay { args, .. } => {
            memory("capacity", args.capacity)?;
            memory("device-memory", args.device_memory)?;
            memory("trace-capacity", args.trace_capacity)?;
            placements(args.placements)?;
            device(args.device)
        }
        Command::Validate { capacity, device_memory, device: d, .. } => {
            memory("capacity", *capacity)?;
            memory("device-memory", *device_memory)?;
            device(*d)
        }
        Command::Explain(a) => traced(&a.trace).and(memory("capacity", a.capacity)),
        Command::Report(a) => traced(&a.trace).and(memory("capacity", a.capacity)),
        Command::Export(a) => traced(&a.trace).and(memory("capacity", a.capacity)),
        Command::Phases(a) => traced(&a.trace).and(memory("capacity", a.capacity)),
        Command::Sweep(a) => traced(&a.trace).and(memory("capacity", a.capacity)).and(placements(Some(a.placements))),
        Command::Graphs(a) => traced(&a.trace).and(memory("capacity", a.capacity)).and(placements(Some(a.placements))),
        Command::Fit(a) => {
            traced(&a.trace)?;
            memory("reserve", a.reserve)?;
            a.cards.iter().try_for_each(|&c| memory("cards", Some(c)))?;
            placements(Some(a.placements))
        }
        Command::Scale(a) => {
            memory("capacity", a.capacity)?;
            memory("reserve", a.reserve)?;
            memory("largest-under", a.largest_under.flatten())?;
            a.cards.iter().try_for_each(|&c| memory("cards", Some(c)))?;
            recorded(&a.recorded)
        }
        Command::Compare(a) => {
            memory("capacity", a.capacity)?;
            recorded(&a.recorded)?;
            if !(a.spike.is_finite() && a.spike > 0.0 && a.spike <= 1000.0) {
                return Err(UserError(format!("--spike {}: out of range (a factor above 0, at most 1000)", a.spike)));
            }
            Ok(())
        }
        Command::Synth(_) | Command::Convert { .. } => Ok(()),
    }
}

/// Runs a parsed command: its exit status, or 2 after one `allocsim: error:` line.
fn execute(command: Command, io: &mut Io<'_>) -> i32 {
    if let Err(e) = check_bounds(&command) {
        return report(io.err, &e);
    }
    let r = match command {
        Command::Replay { args, json, backend: Backend::Sim } => cmd_replay(&args, json, io),
        Command::Replay { args, json, backend: Backend::Cuda } => cmd_replay_cuda(&args, json, io),
        Command::Validate { trace, capacity, device_memory, device, torch_version, json } => {
            cmd_validate(&trace, &allocsim_commands::replay::ValidateOptions { capacity, device_memory, device, torch_version }, json, io)
        }
        Command::Convert { input, output } => cmd_convert(&input, &output, io),
        Command::Explain(a) => crate::explain_cmd::cmd_explain(&a, io),
        Command::Report(a) => crate::report_cmd::cmd_report(&a, io),
        Command::Export(a) => crate::report_cmd::cmd_export(&a, io),
        Command::Sweep(a) => crate::sweep_cmd::cmd_sweep(&a, io),
        Command::Fit(a) => crate::sweep_cmd::cmd_fit(&a, io),
        Command::Phases(a) => crate::phases_cmd::cmd_phases(&a, io),
        Command::Graphs(a) => crate::graphs_cmd::cmd_graphs(&a, io),
        Command::Scale(a) => crate::scale_cmd::cmd_scale(&a, io),
        Command::Compare(a) => crate::compare_cmd::cmd_compare(&a, io),
        Command::Synth(a) => crate::synth_cmd::cmd_synth(&a, io),
    };
    match r {
        Ok(code) => code,
        Err(e) => report(io.err, &e),
    }
}

/// Writes the error line; exit status 2.
fn report(err: &mut dyn Write, e: &UserError) -> i32 {
    // One line whatever the message quotes (a snapshot's dict keys are the file's own strings).
    let line: String = e.0.chars().flat_map(|c| if c.is_control() { c.escape_default().collect::<Vec<_>>() } else { vec![c] }).collect();
    let _ = writeln!(err, "allocsim: error: {line}");
    let _ = err.flush();
    2
}

impl ReplayArgs {
    /// The replay question these arguments ask.
    fn options(&self) -> ReplayOptions {
        ReplayOptions {
            config: self.config.clone(),
            capacity: self.capacity,
            device_memory: self.device_memory,
            trace_capacity: self.trace_capacity,
            placements: self.placements,
            device: self.device,
            torch_version: self.torch_version,
        }
    }
}

/// `--device N`: that device; else every device with entries (in device order), streamed where
/// one pass gives the answer (see `allocsim_commands::file`).
fn cmd_replay(args: &ReplayArgs, as_json: bool, io: &mut Io<'_>) -> Result<i32, UserError> {
    let f = ReplayFile { addresses_from: args.addresses_from.as_deref(), in_memory: args.in_memory, ..ReplayFile::new(&args.trace) };
    let err = &mut *io.err;
    let mut note = |n: &str| {
        let _ = writeln!(err, "allocsim: note: {n}");
    };
    let answer = allocsim_commands::file::replay_file(f, &args.options(), &mut note)?;
    write_answer(&answer, as_json, io)
}

fn cmd_validate(path: &Path, o: &allocsim_commands::replay::ValidateOptions, as_json: bool, io: &mut Io<'_>) -> Result<i32, UserError> {
    let snap = load(path)?;
    let name = path.display().to_string();
    let answer = allocsim_commands::replay::validate(Trace { name: &name, snapshot: &snap }, o)?;
    write_answer(&answer, as_json, io)
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
    use allocsim_model::format::format_size;
    use serde_json::json;
    let snap = load(&args.trace)?;
    let other = args.addresses_from.as_deref().map(load).transpose()?;
    let r = allocsim_replay::run(&snap, &args.options().spec(other.as_ref()))?;
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
