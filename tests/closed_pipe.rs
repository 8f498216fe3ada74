//! A reader that closes the pipe early (`allocsim replay X --json | head`) ends the command
//! quietly: no panic, no error line, and the exit status the command would have had. And the
//! command code run in-process ([`allocsim::cli::run`]) writes exactly what the binary prints.

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};

mod common;
use common::*;

const FRAG: &str = "traces/frag__default__2048M.pickle.gz";

/// Runs allocsim with stdout into a pipe whose reader reads `lines` lines (0: none) and then
/// closes it; returns the exit status, stderr, and what was read.
fn run_closing_after(args: &[&str], lines: usize) -> (Option<i32>, String, String) {
    let mut child = Command::new(BIN).args(args).current_dir(ROOT).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn allocsim");
    let mut read = String::new();
    {
        let mut out = BufReader::new(child.stdout.take().unwrap());
        for _ in 0..lines {
            let mut l = String::new();
            out.read_line(&mut l).unwrap();
            read.push_str(&l);
        }
        // Dropped here: the pipe's only reader is gone before the command has written the rest.
    }
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    let status = child.wait().unwrap();
    (status.code(), err, read)
}

fn check_quiet(args: &[&str], lines: usize, expected_status: i32) -> String {
    let (code, err, read) = run_closing_after(args, lines);
    let ctx = format!("allocsim {}: status {code:?}, stderr {err:?}", args.join(" "));
    assert!(!err.contains("panicked"), "panic: {ctx}");
    assert!(!err.contains("error"), "error line: {ctx}");
    assert!(err.is_empty(), "something on stderr: {ctx}");
    assert_eq!(code, Some(expected_status), "{ctx}");
    read
}

#[test]
fn replay_json_into_a_closed_pipe() {
    check_quiet(&["replay", FRAG, "--json"], 0, 0);
}

#[test]
fn explain_into_a_closed_pipe() {
    check_quiet(&["explain", FRAG, "--capacity", "2GiB"], 0, 0);
    // The first line was read (the OOM that ended the run: request 302, the 1 GiB request after
    // the 256 and 512 MiB ones the job survived), then the reader left.
    let first = check_quiet(&["explain", FRAG, "--capacity", "2GiB"], 1, 0);
    assert!(first.starts_with("Out of memory at request 302: 1024.00 MiB"), "{first}");
}

#[test]
fn sweep_csv_into_a_closed_pipe() {
    check_quiet(&["sweep", FRAG, "--capacity", "2GiB", "--csv"], 0, 0);
    let header = check_quiet(&["sweep", FRAG, "--capacity", "2GiB", "--csv"], 1, 0);
    assert!(header.starts_with("rank,config,"), "{header}");
}

/// `validate` keeps its exit status (0: exact) when the reader leaves early.
#[test]
fn validate_into_a_closed_pipe_keeps_its_status() {
    check_quiet(&["validate", FRAG, "--capacity", "2GiB"], 0, 0);
}

/// An output far larger than a pipe's buffer (64 KiB on Linux; here thousands of OOMs under a
/// 1 GiB cap), abandoned after one line or none.
#[test]
fn long_output_abandoned() {
    let t = TempFile::new("closed-pipe-synth.jsonl");
    success(&["synth", "--workload", "random", "--requests", "20k", "--seed", "3", "--live-bytes", "4GiB", "-o", t.arg()]);
    let args = ["replay", t.arg(), "--json", "--capacity", "1GiB"];
    let full = success(&args);
    assert!(full.len() > 1 << 20, "the test needs more output than a pipe holds: {} bytes", full.len());
    let first = check_quiet(&args, 1, 0);
    assert_eq!(first, full, "one line: the whole JSON object");
    check_quiet(&args, 0, 0);
    check_quiet(&["replay", t.arg(), "--capacity", "1GiB"], 1, 0);
}

/// The in-process entry point writes the same bytes the binary prints, into any buffer.
#[test]
fn in_process_run_writes_what_the_binary_prints() {
    for args in [vec!["replay", FRAG, "--json"], vec!["explain", FRAG, "--capacity", "2GiB"], vec!["replay", FRAG]] {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let argv: Vec<&str> = std::iter::once("allocsim").chain(args.iter().copied()).collect();
        let code = allocsim::cli::run(argv, &mut out, &mut err);
        assert_eq!(code, 0, "{args:?}: {}", String::from_utf8_lossy(&err));
        assert_eq!(String::from_utf8(out).unwrap(), success(&args), "{args:?}");
    }
    // Errors: the one line, status 2, as the binary.
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let code = allocsim::cli::run(["allocsim", "replay", "no/such/file.pickle"], &mut out, &mut err);
    assert_eq!(code, 2);
    assert!(out.is_empty());
    let err = String::from_utf8(err).unwrap();
    assert!(err.starts_with("allocsim: error: ") && err.ends_with('\n') && err.lines().count() == 1, "{err}");
    // Argument errors as clap renders them, status 2.
    let (mut out, mut err) = (Vec::new(), Vec::new());
    assert_eq!(allocsim::cli::run(["allocsim", "replay"], &mut out, &mut err), 2);
    assert!(String::from_utf8(err).unwrap().contains("required"));
}

#[test]
fn phases_fit_compare_graphs_and_scale_into_a_closed_pipe() {
    let llama = "traces/field/llama_train__default.pickle.gz";
    check_quiet(&["phases", llama], 0, 0);
    check_quiet(&["phases", llama, "--json"], 0, 0);
    check_quiet(&["fit", FRAG, "--cards", "1GiB,2GiB", "--json"], 0, 0);
    check_quiet(&["compare", FRAG, "traces/frag__expandable__2048M.pickle.gz"], 0, 0);
    check_quiet(&["compare", FRAG, "--config", "expandable_segments:True", "--json"], 0, 0);
    // Many files compared as ranks.
    check_quiet(&["compare", "--ranks", FRAG, "traces/frag__expandable__2048M.pickle.gz"], 0, 0);
    let capture = "traces/field/capture_a__default.pickle.gz";
    check_quiet(&["graphs", capture, "--captured", "256,128,64,32,16,8,4,2,1"], 0, 0);
    check_quiet(&["graphs", capture, "--captured", "256,128,64,32,16,8,4,2,1", "--batches", "512,8", "--json"], 0, 0);
    let values = "512,512,128,384,768,512,512,384,512,384,768,256,768,256,384,256";
    check_quiet(&["scale", llama, "--param", "seq", "--values", values, "--predict", "1024,2048", "--largest-under", "16GiB"], 0, 0);
    check_quiet(&["scale", llama, "--param", "seq", "--values", values, "--predict", "1024", "--json"], 0, 0);
}

/// `report` and `export` write their file and say so on stderr: a closed stderr ends them
/// quietly with the file written.
#[test]
fn report_and_export_with_a_closed_stderr() {
    for (cmd, name) in [("report", "closed-stderr.html"), ("export", "closed-stderr.pickle.gz")] {
        let out = TempFile::new(name);
        let mut child = Command::new(BIN)
            .args([cmd, FRAG, "-o", out.arg()])
            .current_dir(ROOT)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn allocsim");
        drop(child.stderr.take());
        let mut stdout = String::new();
        child.stdout.take().unwrap().read_to_string(&mut stdout).unwrap();
        let status = child.wait().unwrap();
        assert_eq!(status.code(), Some(0), "{cmd}: {stdout}");
        assert!(std::fs::metadata(&out.0).is_ok_and(|m| m.len() > 0), "{cmd} wrote its file");
    }
}
