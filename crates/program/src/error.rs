//! Why a replay could not run: the settings, the device asked for, or a trace that contradicts
//! itself (`crate::check`).

use crate::version::TorchVersion;

/// The most placements a replay runs under (`ReplaySpec::placements`, `--placements`).
pub const MAX_PLACEMENTS: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("--placements {0}: out of range (1 to {MAX_PLACEMENTS})")]
    Placements(usize),
    #[error("the snapshot has no device {0} ({1} device traces)")]
    NoDevice(usize, usize),
    #[error("the snapshot's recorded PYTORCH_CUDA_ALLOC_CONF {conf:?} is not valid for PyTorch 2.11: {err}")]
    RecordedConfig { conf: String, err: allocsim_model::ConfigError },
    #[error("--config {conf:?}: {err}")]
    Config { conf: String, err: allocsim_model::ConfigError },
    #[error("the snapshot's recorded PYTORCH_CUDA_ALLOC_CONF {conf:?} is not valid for PyTorch {version}: {err}")]
    RecordedConfigFor { conf: String, err: allocsim_model::ConfigError, version: TorchVersion },
    #[error("--config {conf:?} (PyTorch {version}): {err}")]
    ConfigFor { conf: String, err: allocsim_model::ConfigError, version: TorchVersion },
    #[error("{0}")]
    Trace(#[from] crate::check::TraceCheckError),
}
