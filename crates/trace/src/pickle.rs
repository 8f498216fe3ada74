//! Placeholder: being written.
#[derive(Debug, thiserror::Error)]
#[error("pickle error at byte {offset}: {msg}")]
pub struct PickleError { pub offset: usize, pub msg: String }
