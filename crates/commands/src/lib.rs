//! allocsim's commands on a snapshot already in memory: `replay`, `validate`, `explain`,
//! `sweep`, `fit`, `phases`, `graphs`, `scale`, `report` and `compare`. Each takes a [`Trace`] (a decoded snapshot and the name
//! its text calls it by) and plain options, and returns an answer that renders as the text the
//! command line prints ([`Answer::write_text`]) and as the object its `--json` prints
//! ([`Answer::to_json`]). The command line (`src/`) parses arguments and reads files into these;
//! the Python package (`python/`) calls the same functions, so both print the same answers.
//! [`file`] reads trace files and decides how `replay` reads one (streamed, or in memory).

use std::io::{self, Write};

use allocsim_trace::Snapshot;
use serde_json::Value;

pub mod compare;
pub mod error;
pub mod explain;
pub mod file;
pub mod fit;
pub mod graphs;
pub mod input;
pub mod phases;
pub mod replay;
pub mod report;
pub mod scale;
pub mod size;
pub mod sweep;

pub use error::Error;
pub use input::{TraceOptions, parse_config};
pub use size::{parse_size, parse_sizes};

/// A decoded snapshot and the name the answers call it by (the path given on the command line).
#[derive(Clone, Copy)]
pub struct Trace<'a> {
    pub name: &'a str,
    pub snapshot: &'a Snapshot,
}

/// A command's answer.
pub trait Answer {
    /// The text the command line prints.
    fn write_text(&self, out: &mut dyn Write) -> io::Result<()>;
    /// The object `--json` prints.
    fn to_json(&self) -> Value;
    /// `--json`'s line: [`Answer::to_json`] and a newline (an answer that serializes a struct
    /// writes it directly, keeping its fields' order).
    fn write_json(&self, out: &mut dyn Write) -> io::Result<()> {
        write_json(out, &self.to_json())
    }
    /// The command line's exit status for this answer (`validate`: 1 when not exact).
    fn exit_code(&self) -> i32 {
        0
    }
    /// `--json`'s line as a string (without the newline).
    fn json(&self) -> String {
        let mut v = Vec::new();
        self.write_json(&mut v).expect("writing to memory");
        v.pop();
        String::from_utf8(v).expect("UTF-8 JSON")
    }
    /// The text as a string.
    fn text(&self) -> String {
        let mut v = Vec::new();
        self.write_text(&mut v).expect("writing to memory");
        String::from_utf8(v).expect("UTF-8 text")
    }
}

/// Writes one JSON value and a newline.
pub fn write_json<T: serde::Serialize + ?Sized>(out: &mut dyn Write, v: &T) -> io::Result<()> {
    serde_json::to_writer(&mut *out, v)?;
    writeln!(out)
}

/// The budget in words, for text output (nothing when there is nothing to say).
pub fn budget_lines(b: &allocsim_replay::Budget) -> Vec<String> {
    if b.kind.is_none() && b.device_memory.source != allocsim_replay::budget::DeviceMemorySource::Inferred {
        return Vec::new();
    }
    b.describe()
}

/// Writes `text` in lines of at most `width` columns (where `Some`), broken at spaces, the lines
/// after the first indented by `indent` spaces; a word longer than a line stays whole.
pub fn write_wrapped(out: &mut dyn Write, text: &str, width: Option<u16>, indent: usize) -> io::Result<()> {
    let Some(width) = width.map(usize::from) else { return writeln!(out, "{text}") };
    let (mut line, mut cols, mut empty) = (String::new(), 0usize, true);
    for word in text.split(' ').filter(|w| !w.is_empty()) {
        let w = word.chars().count();
        if !empty && cols + 1 + w > width {
            writeln!(out, "{line}")?;
            line = " ".repeat(indent);
            cols = indent;
            empty = true;
        }
        if !empty {
            line.push(' ');
            cols += 1;
        }
        line.push_str(word);
        cols += w;
        empty = false;
    }
    writeln!(out, "{line}")
}
