//! Why a command could not answer, in one line.

use allocsim_replay::run::RunError;

/// Why a command could not answer. `Display` is the line the command line prints after
/// `allocsim: error:`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Error {
    /// A trace that cannot be read, or whose entries are impossible (the line names the file, the
    /// byte offset or the entry).
    Trace(String),
    /// Settings PyTorch rejects: `message` as the command line prints it (naming the option),
    /// `pytorch` the text PyTorch's own parser gives.
    Config { message: String, pytorch: String },
    /// A question that cannot be asked of this trace (a request number beyond its end, a device it
    /// does not have, a grid that does not parse).
    Usage(String),
    /// Reading or writing a file other than the trace.
    Io(String),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Trace(m) | Error::Usage(m) | Error::Io(m) => f.write_str(m),
            Error::Config { message, .. } => f.write_str(message),
        }
    }
}

impl std::error::Error for Error {}

impl From<RunError> for Error {
    fn from(e: RunError) -> Self {
        let message = e.to_string();
        match e {
            RunError::Config { err, .. } | RunError::ConfigFor { err, .. } | RunError::RecordedConfig { err, .. } | RunError::RecordedConfigFor { err, .. } => {
                Error::Config { message, pytorch: err.to_string() }
            }
            RunError::Trace(_) => Error::Trace(message),
            RunError::NoDevice(..) | RunError::Placements(_) => Error::Usage(message),
        }
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::Io(e.to_string())
    }
}

/// A trace that cannot be read, as the user sees it (`name`: its path).
pub fn trace_error(name: &str, e: allocsim_trace::TraceError) -> Error {
    match e {
        // Already names the path.
        allocsim_trace::TraceError::Io { .. } => Error::Trace(e.to_string()),
        _ => Error::Trace(format!("{name}: {e}")),
    }
}
