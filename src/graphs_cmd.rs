//! `allocsim graphs` (the answer: `allocsim_commands::graphs`).

use allocsim_commands::graphs::GraphsOptions;

use crate::common::TraceArgs;
use crate::common::{UserError, write_answer};
use crate::output::Io;
use crate::size::parse_size;

#[derive(clap::Args)]
pub struct GraphsArgs {
    #[command(flatten)]
    pub trace: TraceArgs,
    /// The batch size of each CUDA-graph capture in the trace, in capture order (a trace does not
    /// record them), e.g. `256,128,64,32,16,8,4,2,1`.
    #[arg(long, value_delimiter = ',', required = true)]
    pub captured: Vec<u64>,
    /// The batch sizes to predict, in the order the job captures them (default: the recorded ones).
    #[arg(long, value_delimiter = ',')]
    pub batches: Vec<u64>,
    /// Settings to replay under (default: the trace's own).
    #[arg(long)]
    pub config: Option<String>,
    /// The allowed maximum (e.g. `24GiB`), as `set_per_process_memory_fraction` gives it.
    #[arg(long, value_parser = parse_size)]
    pub capacity: Option<u64>,
    /// Segment placements to replay under, 1 to 64 (the trace's own addresses first); expandable
    /// segments need one.
    #[arg(long, default_value_t = 4)]
    pub placements: usize,
    /// Print one JSON object instead of the text.
    #[arg(long)]
    pub json: bool,
}

pub fn cmd_graphs(a: &GraphsArgs, io: &mut Io<'_>) -> Result<i32, UserError> {
    let (snap, name) = a.trace.load()?;
    let options = GraphsOptions {
        trace: a.trace.options(),
        captured: a.captured.clone(),
        batches: a.batches.clone(),
        config: a.config.clone(),
        capacity: a.capacity,
        placements: a.placements,
    };
    let answer = allocsim_commands::graphs::graphs(allocsim_commands::Trace { name: &name, snapshot: &snap }, &options)?;
    crate::common::say_device(io, &snap, a.trace.recorded.device, a.json)?;
    write_answer(&answer, a.json, io)
}
