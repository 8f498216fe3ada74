//! How a trace was recorded, and making it ready for replays.

use allocsim_model::AllocatorConfig;
use allocsim_replay::{Prepared, TorchVersion};
use allocsim_trace::Snapshot;

use crate::Error;

/// What the trace does not say about how it was recorded (every field: default inferred).
#[derive(Clone, Debug, Default)]
pub struct TraceOptions {
    /// The device's total memory (default: as the trace shows it, else an H200's).
    pub device_memory: Option<u64>,
    /// The allowed maximum the trace was recorded under (tells its `empty_cache()` calls from the
    /// releases its own OOM retries made). Default: inferred from the trace's OOM entries and
    /// segment events, with the memory held outside the allocator.
    pub trace_capacity: Option<u64>,
    /// Which device's trace (default: the one that ran out of memory, else the one with the
    /// highest peak reserved; with no trace entries, the one holding the segments; see
    /// `allocsim_replay::devices::choose_device`).
    pub device: Option<usize>,
}

impl TraceOptions {
    /// The trace made ready for replays under any settings.
    pub fn prepare(&self, snap: &Snapshot) -> Result<Prepared, Error> {
        Ok(Prepared::new_for(snap, self.device, self.device_memory, self.trace_capacity, rules_version(snap))?)
    }

    /// The trace made ready for a replay under `config` (default: the trace's own settings) and
    /// `capacity`, and that config. Replaying under the trace's own settings, `capacity` is also
    /// taken as the cap it was recorded under unless `trace_capacity` says otherwise.
    pub fn prepare_for(&self, snap: &Snapshot, config: Option<&str>, capacity: Option<u64>) -> Result<(Prepared, AllocatorConfig), Error> {
        let version = rules_version(snap);
        let own = allocsim_replay::run::recorded_config_for(snap, version)?;
        let config = match config {
            Some(c) => version.parse_config(c).map_err(|e| Error::Config { message: format!("--config {c:?}: {e}"), pytorch: e.to_string() })?,
            None => own.clone(),
        };
        let own_settings = {
            let (mut x, mut y) = (config.clone(), own);
            x.source.clear();
            y.source.clear();
            x == y
        };
        let trace_capacity = self.trace_capacity.or(if own_settings { capacity } else { None });
        let p = Prepared::new_for(snap, self.device, self.device_memory, trace_capacity, version)?;
        Ok((p, config))
    }
}

/// The release whose rules a command uses on `snap` without `--torch-version`: 2.11, unless the
/// snapshot shows another release (`allocsim_replay::version::Rules`).
pub fn rules_version(snap: &Snapshot) -> TorchVersion {
    allocsim_replay::version::Rules::choose(None, &snap.settings).version
}

/// A `PYTORCH_CUDA_ALLOC_CONF` string, with PyTorch's error text.
pub fn parse_config(c: &str) -> Result<AllocatorConfig, Error> {
    AllocatorConfig::parse(c).map_err(|e| Error::Config { message: format!("--config {c:?}: {e}"), pytorch: e.to_string() })
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
