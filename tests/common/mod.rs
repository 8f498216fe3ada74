//! Helpers shared by the tests that run the `allocsim` binary.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

pub const BIN: &str = env!("CARGO_BIN_EXE_allocsim");
pub const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// A path relative to the repository root.
pub fn root(rel: &str) -> PathBuf {
    Path::new(ROOT).join(rel)
}

pub fn run<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Output {
    Command::new(BIN).args(args).current_dir(ROOT).output().expect("run allocsim")
}

pub fn show(args: &[&str], o: &Output) -> String {
    format!(
        "allocsim {}\n  status: {:?}\n  stdout: {}\n  stderr: {}",
        args.join(" "),
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Runs allocsim and checks it failed the way a user error should: exit status 2, no panic, and
/// exactly one stderr line `allocsim: error: ...` containing every `needle`. Returns that line.
pub fn user_error(args: &[&str], needles: &[&str]) -> String {
    let o = run(args);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    let ctx = show(args, &o);
    assert!(!err.contains("panicked"), "panic:\n{ctx}");
    assert_eq!(o.status.code(), Some(2), "exit status:\n{ctx}");
    let line = err.strip_suffix('\n').unwrap_or_else(|| panic!("stderr does not end with a newline:\n{ctx}"));
    assert!(!line.contains('\n'), "more than one stderr line:\n{ctx}");
    assert!(line.starts_with("allocsim: error: "), "not an `allocsim: error:` line:\n{ctx}");
    for n in needles {
        assert!(line.contains(n), "message does not contain {n:?}:\n{ctx}");
    }
    assert!(o.stdout.is_empty(), "output on stdout despite the error:\n{ctx}");
    line.to_string()
}

/// Runs allocsim and expects success; returns stdout.
pub fn success(args: &[&str]) -> String {
    let o = run(args);
    let ctx = show(args, &o);
    assert!(!String::from_utf8_lossy(&o.stderr).contains("panicked"), "panic:\n{ctx}");
    assert_eq!(o.status.code(), Some(0), "exit status:\n{ctx}");
    String::from_utf8(o.stdout).expect("UTF-8 stdout")
}

/// Runs allocsim and parses the one JSON object it prints.
pub fn json(args: &[&str]) -> Value {
    let out = success(args);
    serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("`allocsim {}` printed no JSON object: {e}\n{out}", args.join(" ")))
}

/// A file under the temp dir (named by the test process and `name`), removed when dropped.
pub struct TempFile(pub PathBuf);

impl TempFile {
    pub fn new(name: &str) -> TempFile {
        TempFile(std::env::temp_dir().join(format!("allocsim-test-{}-{name}", std::process::id())))
    }
    pub fn arg(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
