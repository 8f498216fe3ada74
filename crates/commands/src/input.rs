//! How a trace was recorded, and making it ready for replays.

use allocsim_model::AllocatorConfig;
use allocsim_replay::Prepared;
use allocsim_replay::settings_change::NotReproduced;

use crate::Error;

pub use allocsim_replay::TraceOptions;

/// A `PYTORCH_CUDA_ALLOC_CONF` string as PyTorch 2.11 parses it, with PyTorch's error text: the
/// check of an option before any trace is read (a trace's replays parse it as the trace's
/// release does, `Prepared::parse_config`).
pub fn parse_config(c: &str) -> Result<AllocatorConfig, Error> {
    Ok(allocsim_replay::run::parse_config_for(c, allocsim_replay::TorchVersion::DEFAULT)?)
}

/// A snapshot without history has no requests to `what`: the error, with how to record them.
pub fn no_requests(t: crate::Trace<'_>, p: &Prepared, what: &str) -> Result<(), Error> {
    if !p.program.requests.is_empty() || !t.snapshot.has_no_history() {
        return Ok(());
    }
    Err(Error::Usage(format!(
        "{}: no trace entries (memory history was not recorded), so no requests to {what}; record them with torch.cuda.memory._record_memory_history(max_entries=100000) before the code to analyse, then torch.cuda.memory._dump_snapshot(\"snapshot.pickle\")",
        t.name
    )))
}

/// Where the trace's own replay is not the recording
/// ([`allocsim_replay::settings_change::not_reproduced`]): the line saying so (unless the budget's
/// lines said it, `said`), and what the trace shows of other settings in force for part of the
/// run: every command's text says it, so that no answer rests silently on a replay that differs
/// from the recording.
pub fn write_not_reproduced(out: &mut dyn std::io::Write, n: Option<&NotReproduced>, said: bool) -> std::io::Result<()> {
    let Some(n) = n else { return Ok(()) };
    if !said {
        writeln!(out, "  not reproduced    {}", NotReproduced::SUMMARY)?;
    }
    if !n.settings_changed.is_empty() {
        writeln!(out, "  settings changed  {}:", NotReproduced::SETTINGS_CHANGED)?;
        for why in &n.settings_changed {
            writeln!(out, "    - {why}")?;
        }
    }
    Ok(())
}

/// The JSON keys every answer about a trace carries for [`write_not_reproduced`]'s fact, as
/// `replay --json` has them (flattened into an answer serialized as a struct).
#[derive(serde::Serialize)]
pub struct NotReproducedKeys<'a> {
    not_reproduced: bool,
    settings_changed: &'a [String],
}

impl<'a> NotReproducedKeys<'a> {
    pub fn of(n: Option<&'a NotReproduced>) -> Self {
        NotReproducedKeys { not_reproduced: n.is_some(), settings_changed: n.map_or(&[][..], |n| n.settings_changed.as_slice()) }
    }
}

/// [`NotReproducedKeys`] added to an answer's JSON object.
pub fn add_not_reproduced_json(v: &mut serde_json::Value, n: Option<&NotReproduced>) {
    if let (Some(o), Ok(serde_json::Value::Object(keys))) = (v.as_object_mut(), serde_json::to_value(NotReproducedKeys::of(n))) {
        o.extend(keys);
    }
}
