//! `allocsim phases` (the answer: `allocsim_commands::phases`).

use allocsim_commands::phases::PhasesOptions;

use crate::common::TraceArgs;
use crate::common::{UserError, write_answer};
use crate::output::Io;
use crate::size::parse_size;

#[derive(clap::Args)]
pub struct PhasesArgs {
    #[command(flatten)]
    pub trace: TraceArgs,
    /// Settings to replay under (default: the trace's own).
    #[arg(long)]
    pub config: Option<String>,
    /// The allowed maximum (e.g. `24GiB`), as `set_per_process_memory_fraction` gives it.
    #[arg(long, value_parser = parse_size)]
    pub capacity: Option<u64>,
    /// Iterations end at the end of each annotation of this name (or `NAME#…`); default: the
    /// optimizer's step (`Optimizer.step#…`), else the repeating request pattern.
    #[arg(long)]
    pub by: Option<String>,
    /// How many call sites of live blocks to list at each iteration's peak.
    #[arg(long, default_value_t = 3)]
    pub top: usize,
    /// Print one JSON object (every iteration and region) instead of the text.
    #[arg(long)]
    pub json: bool,
}

pub fn cmd_phases(a: &PhasesArgs, io: &mut Io<'_>) -> Result<i32, UserError> {
    let (snap, name) = a.trace.load()?;
    let options = PhasesOptions { trace: a.trace.options(), config: a.config.clone(), capacity: a.capacity, by: a.by.clone(), top: a.top };
    let answer = allocsim_commands::phases::phases(allocsim_commands::Trace { name: &name, snapshot: &snap }, &options)?;
    crate::common::say_device(io, &snap, a.trace.recorded.device, a.json)?;
    write_answer(&answer, a.json, io)
}
