//! `allocsim compare` (the answers: `allocsim_commands::compare`): two runs of the same requests
//! side by side, or many files as the ranks of one job.

use std::path::PathBuf;

use allocsim_commands::compare::{CompareOptions, compare_configs, compare_recorded, rank_spec, ranks, ranks_failure};
use allocsim_commands::{Answer, Trace};
use allocsim_phases::ranks::expand_paths;

use crate::common::{RecordedArgs, UserError, load, say_device, write_answer};
use crate::output::Io;
use crate::size::parse_size;

#[derive(clap::Args)]
pub struct CompareArgs {
    /// A snapshot, and a second one of the same requests (e.g. the same job under another
    /// config); with one, it is replayed under `--config` and `--config-b` (default: its own
    /// settings). A directory, a glob (`'rank*.pickle.gz'`), three or more files, or `--ranks`:
    /// every file replayed (in parallel) and compared as the ranks of one job.
    #[arg(required = true, num_args = 1..)]
    pub files: Vec<PathBuf>,
    /// Compare the files as ranks (one row each, iteration peaks against the median) even when
    /// there are only two.
    #[arg(long)]
    pub ranks: bool,
    /// Ranks: iterations by this annotation (default: the optimizer's step; see `phases --by`).
    #[arg(long)]
    pub by: Option<String>,
    /// Ranks: a file spikes in an iteration when its peak allocated is at least this times the
    /// median of that iteration (above 0, at most 1000).
    #[arg(long, default_value_t = 1.1)]
    pub spike: f64,
    /// Settings for side A when comparing one trace under two configs.
    #[arg(long)]
    pub config: Option<String>,
    /// Settings for side B (default: the trace's own).
    #[arg(long)]
    pub config_b: Option<String>,
    /// The allowed maximum (default: the trace's own budget, inferred from it).
    #[arg(long, value_parser = parse_size)]
    pub capacity: Option<u64>,
    /// How the traces were recorded (the same for every file; with two recorded runs, only
    /// `--device` applies).
    #[command(flatten)]
    pub recorded: RecordedArgs,
    /// How many call sites of new segments to list (two runs), or rows (ranks).
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    /// Print one JSON object instead of the text.
    #[arg(long)]
    pub json: bool,
}

pub fn cmd_compare(a: &CompareArgs, io: &mut Io<'_>) -> Result<i32, UserError> {
    if let Some(files) = as_ranks(a)? {
        return cmd_ranks(a, &files, io);
    }
    let path_a = &a.files[0];
    let (name_a, snap_a) = (path_a.display().to_string(), load(path_a)?);
    let ta = Trace { name: &name_a, snapshot: &snap_a };
    let o = CompareOptions { trace: a.recorded.options(), config: a.config.clone(), config_b: a.config_b.clone(), capacity: a.capacity, top: a.top };
    let answer = match a.files.get(1) {
        Some(b) => {
            let (name_b, snap_b) = (b.display().to_string(), load(b)?);
            compare_recorded(ta, Trace { name: &name_b, snapshot: &snap_b }, &o)?
        }
        None => {
            let answer = compare_configs(ta, &o)?;
            say_device(io, &snap_a, a.recorded.device, a.json)?;
            answer
        }
    };
    for line in &answer.notes {
        if a.json {
            writeln!(io.err, "allocsim: note: {line}")?;
        } else {
            writeln!(io.out, "{line}")?;
        }
    }
    write_answer(&answer, a.json, io)
}

/// The files to compare as ranks, when the arguments ask for that (a directory, a glob, three or
/// more files, or `--ranks`); `None` for the two-run comparison.
pub fn as_ranks(a: &CompareArgs) -> Result<Option<Vec<PathBuf>>, UserError> {
    let many = a.ranks || a.files.len() > 2 || a.files.iter().any(|f| f.is_dir() || f.file_name().is_some_and(|n| n.to_string_lossy().contains(['*', '?'])));
    if !many {
        return Ok(None);
    }
    Ok(Some(expand_paths(&a.files).map_err(UserError)?))
}

pub fn cmd_ranks(a: &CompareArgs, files: &[PathBuf], io: &mut Io<'_>) -> Result<i32, UserError> {
    let spec = rank_spec(a.config.clone(), a.capacity, a.recorded.options(), a.by.clone(), a.spike)?;
    let answer = ranks(files, &spec);
    if a.json {
        answer.write_json(io.out)?;
    } else {
        answer.write_text(io.out)?;
    }
    match ranks_failure(&answer.ranks) {
        None => Ok(0),
        Some(e) => Err(UserError(e)),
    }
}
