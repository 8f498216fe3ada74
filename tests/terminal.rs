//! What a user sees in a terminal: tables that fit it, and settings with one outcome in one row.

mod common;

use std::process::Command;

use common::{BIN, ROOT};

/// `allocsim ARGS` with `COLUMNS` set (or removed); stdout.
fn run_with_columns(args: &[&str], columns: Option<&str>) -> String {
    let mut c = Command::new(BIN);
    c.args(args).current_dir(ROOT);
    match columns {
        Some(v) => c.env("COLUMNS", v),
        None => c.env_remove("COLUMNS"),
    };
    let o = c.output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap()
}

fn widest(text: &str) -> usize {
    text.lines().map(|l| l.chars().count()).max().unwrap_or(0)
}

const TRACES: [&str; 3] =
    ["traces/frag__default__2048M.pickle.gz", "traces/field/llama_oom__default.pickle.gz", "traces/field/devfull_frag__default.pickle.gz"];

#[test]
fn sweep_fits_the_terminal() {
    for t in TRACES {
        let plain = run_with_columns(&["sweep", t], None);
        assert!(widest(&plain) <= 100, "{t}: {} columns without COLUMNS:\n{plain}", widest(&plain));
        let wide = run_with_columns(&["sweep", t], Some("140"));
        assert!(widest(&wide) <= 140, "{t}: {} columns with COLUMNS=140", widest(&wide));
        // --wide: as wide as the contents (the summary line is one line then).
        let unbounded = run_with_columns(&["sweep", t, "--wide"], None);
        assert!(widest(&unbounded) > 100, "{t}: --wide");
        // (Up to the time it took, which differs from run to run.)
        let untimed = |s: &str| s[..s.rfind(';').unwrap()].to_string();
        let summary = plain.lines().take_while(|l| !l.starts_with('┌')).map(str::trim_start).collect::<Vec<_>>().join(" ");
        assert_eq!(untimed(unbounded.lines().next().unwrap()), untimed(&summary), "{t}: the summary wrapped, not cut");
    }
}

/// Every row of `sweep`'s table is another outcome: configs whose outcomes are the same share a
/// row (the trace's 120 configs in the frag recording under its 2 GiB cap come to 2 outcomes: the
/// expandable segments' and the rest's).
#[test]
fn sweep_shows_each_outcome_once() {
    let json: serde_json::Value = serde_json::from_str(&run_with_columns(&["sweep", TRACES[0], "--json"], None)).unwrap();
    let rows = json["rows"].as_array().unwrap();
    let outcome = |r: &serde_json::Value| {
        r["outcomes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|o| (o["first_oom"].clone(), o["peak_reserved"].clone(), o["num_device_alloc"].clone()))
            .collect::<Vec<_>>()
    };
    let mut distinct: Vec<_> = rows.iter().filter(|r| r["rejected"].is_null()).map(outcome).collect();
    distinct.sort_by_key(|v| format!("{v:?}"));
    distinct.dedup();
    let text = run_with_columns(&["sweep", TRACES[0]], None);
    let shown = text.lines().filter(|l| l.starts_with("│ ") && l.chars().nth(2).is_some_and(|c| c.is_ascii_digit())).count();
    assert_eq!(shown, distinct.len(), "one row per distinct outcome:\n{text}");
    assert!(text.contains("+59 alike"), "{text}");
}

/// Every argument and option of every command says what it is (`--help`).
#[test]
fn every_option_is_described() {
    let top = common::success(&["--help"]);
    let commands: Vec<String> = top
        .split("Commands:")
        .nth(1)
        .unwrap()
        .split("Options:")
        .next()
        .unwrap()
        .lines()
        .filter_map(|l| l.strip_prefix("  ").and_then(|l| l.split_whitespace().next()).map(str::to_string))
        .filter(|c| c != "help")
        .collect();
    assert!(commands.len() >= 12, "{top}");
    let mut undescribed = Vec::new();
    for c in &commands {
        let help = common::success(&[c.as_str(), "--help"]);
        let body: Vec<&str> = help.lines().skip_while(|l| !(l.starts_with("Arguments:") || l.starts_with("Options:"))).collect();
        let is_start = |l: &str| {
            let t = l.trim_start();
            (2..=6).contains(&(l.len() - t.len())) && (t.starts_with('-') || t.starts_with('<') || t.starts_with('['))
        };
        let starts: Vec<usize> = body.iter().enumerate().filter(|(_, l)| is_start(l)).map(|(i, _)| i).collect();
        for (k, &i) in starts.iter().enumerate() {
            let line = body[i].trim();
            let same_line = line.split_once("  ").is_some_and(|(_, d)| !d.trim().is_empty() && !d.trim().starts_with('['));
            let end = starts.get(k + 1).copied().unwrap_or(body.len());
            let next_lines = body[i + 1..end].iter().any(|l| l.starts_with("        ") && !l.trim().is_empty() && !l.trim().starts_with('['));
            if !(same_line || next_lines) {
                undescribed.push(format!("{c}: {line}"));
            }
        }
    }
    assert!(undescribed.is_empty(), "without a description:\n{}", undescribed.join("\n"));
}
