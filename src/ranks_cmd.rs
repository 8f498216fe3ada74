//! `allocsim compare` over many files: the ranks of a job (or any runs) side by side (logic:
//! `allocsim_phases::ranks`).

use std::io::{self, Write};
use std::path::PathBuf;

use allocsim_model::format::format_size as fs;
use allocsim_phases::ranks::{RankSpec, Ranks, compare_runs, expand_paths};
use comfy_table::{Table, presets};

use crate::cli::{UserError, write_json};
use crate::output::Io;
use crate::whatif_cmds::CompareArgs;

/// The files to compare as ranks, when the arguments ask for that (a directory, a glob, three or
/// more files, or `--ranks`); `None` for the two-run comparison.
pub fn as_ranks(a: &CompareArgs) -> Result<Option<Vec<PathBuf>>, UserError> {
    let many = a.ranks || a.files.len() > 2 || a.files.iter().any(|f| f.is_dir() || f.file_name().is_some_and(|n| n.to_string_lossy().contains(['*', '?'])));
    if !many {
        return Ok(None);
    }
    Ok(Some(expand_paths(&a.files).map_err(UserError)?))
}

pub fn cmd_ranks(a: &CompareArgs, files: &[PathBuf], io: &mut Io<'_>) -> Result<i32, UserError> {
    if let Some(c) = &a.config {
        allocsim_model::AllocatorConfig::parse(c).map_err(|e| UserError(format!("--config {c:?}: {e}")))?;
    }
    if a.spike.partial_cmp(&1.0) != Some(std::cmp::Ordering::Greater) {
        return Err(UserError(format!("--spike {}: expected a ratio above 1 (e.g. 1.1)", a.spike)));
    }
    let spec =
        RankSpec { config: a.config.clone(), capacity: a.capacity, device_memory: a.device_memory, device: a.device, by: a.by.clone(), spike_ratio: a.spike };
    let k = compare_runs(files, &spec);
    if a.json {
        write_json(io.out, &k)?;
    } else {
        write_ranks(io.out, &k)?;
    }
    let failed: Vec<_> = k.rows.iter().filter(|r| r.error.is_some()).collect();
    match failed.first() {
        None => Ok(0),
        Some(r) => Err(UserError(format!(
            "{} of {} files could not be compared; the first, {}: {}",
            failed.len(),
            k.rows.len(),
            r.file,
            r.error.as_deref().unwrap_or("")
        ))),
    }
}

fn short(file: &str) -> &str {
    std::path::Path::new(file).file_name().and_then(|n| n.to_str()).unwrap_or(file)
}

/// The ranks as text: one row per file, the first OOM and the first spike, and (for up to 40
/// iterations) each file's iteration peaks over the median.
pub fn write_ranks(out: &mut dyn Write, k: &Ranks) -> io::Result<()> {
    let t0 = k.rows.iter().filter_map(|r| r.start_us).min();
    let at = |t: Option<i64>| match (t, t0) {
        (Some(t), Some(t0)) => format!("+{:.3} s", (t - t0) as f64 / 1e6),
        _ => String::new(),
    };
    let mut t = Table::new();
    t.load_style(presets::UTF8_FULL_CONDENSED);
    t.set_header([
        "file",
        "requests",
        "peak allocated",
        "peak reserved",
        "OOMs (recorded)",
        "first OOM",
        "unallocated at peak reserved",
        "iterations",
        "peak in",
        "max ÷ median",
    ]);
    for r in &k.rows {
        if let Some(e) = &r.error {
            t.add_row([short(&r.file).to_string(), format!("error: {e}")]);
            continue;
        }
        let worst = r.vs_median.iter().enumerate().max_by(|x, y| x.1.total_cmp(y.1));
        t.add_row([
            short(&r.file).to_string(),
            r.requests.to_string(),
            fs(r.peak_allocated),
            fs(r.peak_reserved),
            format!("{} ({})", r.ooms, r.recorded_ooms),
            r.first_oom.map_or(String::new(), |q| format!("request {q} {}", at(r.first_oom_us))),
            format!("{} ({:.1}%)", fs(r.unallocated_at_peak), 100.0 * r.fragmentation_at_peak),
            r.iteration_peaks.len().to_string(),
            r.peak_iteration.map_or(String::new(), |i| i.to_string()),
            worst.map_or(String::new(), |(i, v)| format!("{v:.2} (iteration {i})")),
        ]);
    }
    writeln!(out, "{t}")?;
    if let Some(o) = &k.first_oom {
        let what = if o.recorded { "recorded running out of memory first (no replay does)" } else { "runs out of memory first" };
        writeln!(
            out,
            "{} {what}{}{}",
            short(&o.file),
            o.request.map_or(String::new(), |q| format!(", at request {q}")),
            match at(o.time_us) {
                s if s.is_empty() => String::new(),
                s => format!(", {s} after the earliest trace starts"),
            }
        )?;
    }
    match &k.first_spike {
        Some(s) => writeln!(
            out,
            "{} spikes first: iteration {} peaks at {}, {:.2}× the median {} of that iteration",
            short(&s.file),
            s.iteration,
            fs(s.peak_allocated),
            s.ratio,
            fs(s.median)
        )?,
        None => writeln!(out, "no file's iteration peak reaches {:.2}× the median of its iteration", k.spike_ratio)?,
    }
    let ok: Vec<_> = k.rows.iter().filter(|r| r.error.is_none()).collect();
    let n = k.median_iteration_peaks.len();
    if n > 1 && n <= 40 && !ok.is_empty() {
        writeln!(out, "Iteration peaks ÷ the median of the files (* at or above {:.2}):", k.spike_ratio)?;
        let mut t = Table::new();
        t.load_style(presets::UTF8_FULL_CONDENSED);
        let mut header = vec!["file".to_string()];
        header.extend((0..n).map(|i| i.to_string()));
        t.set_header(header);
        let mut med = vec!["median".to_string()];
        med.extend(k.median_iteration_peaks.iter().map(|&m| fs(m)));
        t.add_row(med);
        for r in ok {
            let mut row = vec![short(&r.file).to_string()];
            row.extend(r.vs_median.iter().map(|v| format!("{v:.2}{}", if *v >= k.spike_ratio { "*" } else { "" })));
            t.add_row(row);
        }
        writeln!(out, "{t}")?;
    }
    Ok(())
}
