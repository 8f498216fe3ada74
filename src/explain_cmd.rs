//! `allocsim explain` (the answer: `allocsim_commands::explain`).

use std::path::PathBuf;

use allocsim_commands::Trace;
use allocsim_commands::explain::ExplainOptions;

use crate::common::TraceArgs;
use crate::common::{UserError, load, write_answer};
use crate::output::Io;
use crate::size::parse_size;

#[derive(clap::Args)]
pub struct ExplainArgs {
    #[command(flatten)]
    pub trace: TraceArgs,
    /// `oom` (the default): the OOM that ended the run (the last the trace recorded; under other
    /// settings, the first at a request the recorded run served); `first`: the replay's first
    /// OOM; a request number N (0-based, as in `replay --json`); or `peak`.
    #[arg(long)]
    pub at: Option<String>,
    /// Settings to replay under (default: the trace's own).
    #[arg(long)]
    pub config: Option<String>,
    /// The allowed maximum (e.g. `2GiB`), as `set_per_process_memory_fraction` gives it.
    /// Default: the trace's own budget, inferred from it.
    #[arg(long, value_parser = parse_size)]
    pub capacity: Option<u64>,
    /// Take new segments' addresses from this recorded run.
    #[arg(long)]
    pub addresses_from: Option<PathBuf>,
    /// How many pinned segments to list.
    #[arg(long, default_value_t = 5)]
    pub top: usize,
    /// Print one JSON object (the explanation, its verdict, the budget, every OOM) instead of the text.
    #[arg(long)]
    pub json: bool,
}

pub fn cmd_explain(a: &ExplainArgs, io: &mut Io<'_>) -> Result<i32, UserError> {
    let snap = load(&a.trace.trace)?;
    let other = a.addresses_from.as_deref().map(load).transpose()?;
    let name = a.trace.trace.display().to_string();
    let options = ExplainOptions { trace: a.trace.options(), at: a.at.clone(), config: a.config.clone(), capacity: a.capacity, top: a.top };
    let answer = allocsim_commands::explain::explain(Trace { name: &name, snapshot: &snap }, other.as_ref(), &options)?;
    crate::common::say_device(io, &snap, a.trace.recorded.device, a.json)?;
    write_answer(&answer, a.json, io)
}
