//! What the command modules share: the user's error, reading a trace, writing an answer, the
//! device line, and the arguments that say how a trace was recorded. The command modules
//! (`*_cmd.rs`) use this module and `output`; `cli` uses them: no module imports one that imports
//! it.

use std::path::{Path, PathBuf};

use allocsim_commands::{Answer, TraceOptions};
use allocsim_trace::Snapshot;

pub use allocsim_commands::write_json;

use crate::output::Io;
use crate::size::parse_size;

/// An error for the user: one line, exit status 2.
#[derive(Debug)]
pub struct UserError(pub String);

impl<E: std::fmt::Display> From<E> for UserError {
    fn from(e: E) -> Self {
        UserError(e.to_string())
    }
}

/// Says which device a command answers for when it chose one (several devices, no `--device`),
/// and what a snapshot without any trace entry can tell: lines before the text output, or notes on
/// stderr beside machine-readable output (the choice: `allocsim_replay::devices`).
pub fn say_device(io: &mut Io<'_>, snap: &Snapshot, device: Option<usize>, machine: bool) -> Result<(), UserError> {
    let choice = allocsim_replay::devices::device_for(snap, device).map_err(allocsim_commands::Error::from)?;
    let mut lines = Vec::new();
    if let Some(text) = choice.describe() {
        lines.push(format!("answering for {text}"));
    }
    if let Some(text) = snap.no_history_note() {
        lines.push(format!("note: {text}"));
    }
    for l in lines {
        if machine {
            writeln!(io.err, "allocsim: note: {}", l.strip_prefix("note: ").unwrap_or(&l))?;
        } else {
            writeln!(io.out, "{l}")?;
        }
    }
    Ok(())
}

pub fn load(path: &Path) -> Result<Snapshot, UserError> {
    Ok(allocsim_commands::file::read_trace(path, false)?)
}

/// Writes an answer as text or JSON; its exit status.
pub fn write_answer(answer: &dyn Answer, as_json: bool, io: &mut Io<'_>) -> Result<i32, UserError> {
    if as_json {
        answer.write_json(io.out)?;
    } else {
        answer.write_text(io.out)?;
    }
    Ok(answer.exit_code())
}

/// Where the trace came from and how it was recorded.
#[derive(clap::Args, Clone)]
pub struct TraceArgs {
    /// A snapshot (.pickle, .pickle.gz) or an allocsim .jsonl trace.
    pub trace: PathBuf,
    #[command(flatten)]
    pub recorded: RecordedArgs,
}

/// How a trace was recorded where it does not say: the options of every command that answers
/// for one device of each trace (`allocsim_replay::TraceOptions`).
#[derive(clap::Args, Clone, Default)]
pub struct RecordedArgs {
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

impl RecordedArgs {
    /// The options as every command's crate takes them.
    pub fn options(&self) -> TraceOptions {
        TraceOptions { device_memory: self.device_memory, trace_capacity: self.trace_capacity, device: self.device }
    }
}

impl TraceArgs {
    /// The trace, read, and the name its answers call it by.
    pub fn load(&self) -> Result<(Snapshot, String), UserError> {
        Ok((load(&self.trace)?, self.trace.display().to_string()))
    }

    /// The options that say how it was recorded.
    pub fn options(&self) -> TraceOptions {
        self.recorded.options()
    }
}
