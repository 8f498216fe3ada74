//! The `allocsim` command line as a library: every command writes its answer to any
//! [`std::io::Write`] (see [`cli::run`]), so a caller (a Python binding, a test) can run the same
//! command code and capture its text; the binary (`src/main.rs`) writes to stdout and stderr
//! through [`output::PipeWriter`], so a reader that closes the pipe early ends the command quietly.

pub mod cli;
pub mod common;
pub mod compare_cmd;
pub mod explain_cmd;
pub mod graphs_cmd;
pub mod output;
pub mod phases_cmd;
pub mod report_cmd;
pub mod scale_cmd;
pub use allocsim_commands::size;
pub mod sweep_cmd;
pub mod synth_cmd;
