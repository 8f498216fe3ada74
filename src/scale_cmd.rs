//! `allocsim scale` (the answer: `allocsim_commands::scale`).

use std::path::PathBuf;

use allocsim_commands::scale::{LargestUnder, ScaleOptions, parse_values};

use crate::common::{RecordedArgs, UserError, load, write_answer};
use crate::output::Io;
use crate::size::parse_size;

#[derive(clap::Args)]
pub struct ScaleArgs {
    /// Snapshots of the same job (runs that share their first steps, then take steps at other
    /// shapes); the first gives the state the asked steps follow, its settings and budget.
    #[arg(required = true, num_args = 1..)]
    pub traces: Vec<PathBuf>,
    /// The shape parameter: each step is a `record_function("NAME=VALUE")` region (e.g.
    /// `allocsim.torch.step(seq=L)`), unless `--values` gives the values.
    #[arg(long)]
    pub param: String,
    /// The value of each iteration of the `phases` layout, one list per trace (repeat the flag),
    /// e.g. `512,512,128,384`; `-` for an iteration whose value is not told (not learnt from).
    #[arg(long, value_parser = parse_values, allow_hyphen_values = true)]
    pub values: Vec<Vec<Option<u64>>>,
    /// With `--values`: iterations end at each annotation of this name (default: the optimizer's
    /// steps, else the repeating request pattern).
    #[arg(long)]
    pub by: Option<String>,
    /// The step of the first trace whose end state the asked steps follow (default: its last).
    #[arg(long)]
    pub after: Option<usize>,
    /// The values to predict a step at, e.g. `1024,2048,4096`.
    #[arg(long, value_delimiter = ',')]
    pub predict: Vec<u64>,
    /// Values whose steps are not learnt from, e.g. to predict a recorded step from the others.
    #[arg(long, value_delimiter = ',')]
    pub hold_out: Vec<u64>,
    /// The largest value (a multiple of `--step`) whose step replays without OOM under this
    /// allowed maximum (e.g. `24GiB`); without a size, under the trace's own budget.
    #[arg(long, num_args = 0..=1, value_parser = parse_size)]
    pub largest_under: Option<Option<u64>>,
    /// Cards to find the largest value on, e.g. `24GiB,80GiB`.
    #[arg(long, value_delimiter = ',', value_parser = parse_size)]
    pub cards: Vec<u64>,
    /// Memory outside the allocator on a card (default: what the trace's OOM entries show, else
    /// 518 MiB, measured on an H200 with torch 2.11).
    #[arg(long, value_parser = parse_size)]
    pub reserve: Option<u64>,
    /// The largest value is a multiple of this (default: the recorded values' greatest common
    /// divisor).
    #[arg(long)]
    pub step: Option<u64>,
    /// Settings to replay under (default: the first trace's own).
    #[arg(long)]
    pub config: Option<String>,
    /// The allowed maximum the asked steps run under (e.g. `24GiB`); default: the first trace's
    /// own budget.
    #[arg(long, value_parser = parse_size, conflicts_with = "cards")]
    pub capacity: Option<u64>,
    #[command(flatten)]
    pub recorded: RecordedArgs,
    /// Print one JSON object (the steps learnt, every prediction, the largest values) instead of
    /// the text.
    #[arg(long)]
    pub json: bool,
}

pub fn cmd_scale(a: &ScaleArgs, io: &mut Io<'_>) -> Result<i32, UserError> {
    let snaps = a.traces.iter().map(|p| load(p)).collect::<Result<Vec<_>, _>>()?;
    let names: Vec<String> = a.traces.iter().map(|p| p.display().to_string()).collect();
    let options = ScaleOptions {
        trace: a.recorded.options(),
        param: a.param.clone(),
        values: a.values.clone(),
        by: a.by.clone(),
        after: a.after,
        predict: a.predict.clone(),
        hold_out: a.hold_out.clone(),
        largest_under: a.largest_under.map(|b| b.map_or(LargestUnder::Budget, LargestUnder::Bytes)),
        cards: a.cards.clone(),
        reserve: a.reserve,
        step: a.step,
        config: a.config.clone(),
        capacity: a.capacity,
    };
    let traces: Vec<allocsim_commands::Trace<'_>> = snaps.iter().zip(&names).map(|(s, n)| allocsim_commands::Trace { name: n, snapshot: s }).collect();
    let answer = allocsim_commands::scale::scale(&traces, &options)?;
    crate::common::say_device(io, &snaps[0], a.recorded.device, a.json)?;
    write_answer(&answer, a.json, io)
}
