//! The `PYTORCH_CUDA_ALLOC_CONF` tokenizer and parser (2.11 rules and error texts).

use crate::config::{AllocatorConfig, ConfigError};

pub(crate) fn apply(cfg: &mut AllocatorConfig, conf: &str) -> Result<(), ConfigError> {
    // Placeholder: being written (accepts only the empty string for now).
    let _ = cfg;
    if conf.trim().is_empty() { Ok(()) } else { Err(ConfigError(format!("unsupported: {conf}"))) }
}
