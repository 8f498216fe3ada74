//! allocsim-shape: requests as functions of a shape value (a batch size, a sequence length, an
//! image side). The model both `allocsim graphs` and `allocsim scale` use:
//!
//! * [`fit`]: each request's size from the sizes it had at the recorded values — constant,
//!   exactly affine, exactly quadratic, else piecewise linear with its error stated — and whether
//!   a point it was not made from checked it.
//! * [`pattern`]: what identifies a request whatever its size (stream, pool, call stack), a
//!   stretch of ops as a pattern of such requests, and matching one pattern's requests to
//!   another's (found in order inside a longer stretch, or aligned where either makes requests
//!   the other does not).

pub mod fit;
pub mod pattern;
pub mod predict;
pub mod scale;
pub mod steps;

pub use scale::{Budget, Question, ScaleAnswer, scale};

/// Why the traces cannot answer the question.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ScaleError {
    /// A question that cannot be asked of these traces (the line says why).
    Usage(String),
}

impl std::fmt::Display for ScaleError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ScaleError::Usage(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for ScaleError {}
