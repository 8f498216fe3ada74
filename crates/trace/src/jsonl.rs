//! Placeholder: being written.
use crate::{Snapshot, TraceError};
pub fn read(_bytes: &[u8]) -> Result<Snapshot, TraceError> { Err(TraceError::NotSnapshot("unimplemented".into())) }
