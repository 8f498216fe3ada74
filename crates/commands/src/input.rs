//! How a trace was recorded, and making it ready for replays.

use allocsim_model::AllocatorConfig;
use allocsim_replay::Prepared;

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
