//! Many runs side by side: the snapshots of a distributed job's ranks (one per process), or any
//! runs to compare. Each file is read and replayed on its own thread (rayon), then:
//!
//! * one row per file: peak allocated and reserved, OOMs and the time of the first, what the
//!   allocator held unallocated when reserved memory peaked, the iterations and their peaks;
//! * per iteration, the median of the files' peaks, and each file's peak against it;
//! * the file that ran out of memory first (the earliest recorded time of a first OOM in the
//!   replays; when no replay runs out of memory, of the OOMs the traces recorded), and the
//!   one that spiked first: the earliest iteration in which a file's peak allocated exceeds the
//!   median of that iteration by the spike ratio (default 1.1), ties to the earlier peak time.
//!
//! Times are the trace's `time_us` (microseconds since the epoch on each host's clock), so "first"
//! across hosts is as good as their clocks agree.
//!
//! The work is a map and a reduce: [`summarize_rank`] reads and replays one file (a path or its
//! bytes) into a [`RankSummary`], small and serialisable ([`RankSummary::to_json`]: its row and
//! each iteration's peak and the time of that peak), and [`reduce_ranks`] compares summaries.
//! [`compare_runs`] is the two over local files on rayon's threads; the Python package's
//! `allocsim.fleet` runs the map as processes or Ray tasks and the reduce here.

use std::path::{Path, PathBuf};

use allocsim_replay::TraceOptions;
use rayon::prelude::*;

use crate::layout::Layout;
use crate::measure::measure;

/// How to replay each file.
#[derive(Clone, Debug)]
pub struct RankSpec {
    /// A `PYTORCH_CUDA_ALLOC_CONF` string for every file (default: each file's own settings).
    pub config: Option<String>,
    /// The allowed maximum for every file (`None`: each file's own budget, inferred from its trace).
    pub capacity: Option<u64>,
    /// How every file was recorded where it does not say (the device's memory, the allowed
    /// maximum, which device): each file is prepared as every command prepares one
    /// ([`TraceOptions::prepare_for`]).
    pub trace: TraceOptions,
    /// Iterations by this annotation (see [`Layout::of`]).
    pub by: Option<String>,
    /// A file spikes in an iteration when its peak allocated is at least this times the median.
    pub spike_ratio: f64,
}

/// One file.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct RunRow {
    pub file: String,
    pub device: Option<usize>,
    pub requests: usize,
    pub peak_allocated: u64,
    pub peak_reserved: u64,
    pub ooms: usize,
    pub first_oom: Option<u32>,
    /// The recorded time of the first OOM's request.
    pub first_oom_us: Option<i64>,
    /// The requests the trace recorded as OOMs (whether or not the replay runs out there), and
    /// the recorded time of the first.
    pub recorded_ooms: usize,
    pub first_recorded_oom_us: Option<i64>,
    /// The time of the trace's first entry.
    pub start_us: Option<i64>,
    /// Reserved − allocated when reserved memory peaked, and that as a share of the peak.
    pub unallocated_at_peak: u64,
    pub fragmentation_at_peak: f64,
    pub peak_iteration: Option<usize>,
    /// Peak allocated of each iteration.
    pub iteration_peaks: Vec<u64>,
    /// The recorded time of each iteration's peak request.
    #[serde(skip)]
    pub iteration_peak_us: Vec<Option<i64>>,
    /// Each iteration's peak over the median of the files that have that iteration.
    pub vs_median: Vec<f64>,
    /// Why this file could not be compared (then the other fields are empty).
    pub error: Option<String>,
}

/// A file and a moment.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct FirstOom {
    pub file: String,
    /// The replay's first OOM (`None` for a recorded one).
    pub request: Option<u32>,
    pub time_us: Option<i64>,
    /// No file runs out of memory in the replay: this is the earliest OOM the traces recorded.
    pub recorded: bool,
}

#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Spike {
    pub file: String,
    pub iteration: usize,
    pub peak_allocated: u64,
    pub median: u64,
    pub ratio: f64,
    pub time_us: Option<i64>,
}

#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Ranks {
    pub rows: Vec<RunRow>,
    /// Per iteration, the median of the files' peak allocated.
    pub median_iteration_peaks: Vec<u64>,
    pub first_oom: Option<FirstOom>,
    pub first_spike: Option<Spike>,
    /// The file with the highest peak allocated.
    pub largest_peak: Option<String>,
    pub spike_ratio: f64,
}

/// Where one file's snapshot comes from.
#[derive(Clone, Copy, Debug)]
pub enum RankSource<'a> {
    /// A file, read as every command reads one (`allocsim_trace::read_trace`).
    Path(&'a Path),
    /// A file's bytes (read from wherever it lies), decoded by `allocsim_trace::read_trace_bytes`.
    Bytes(&'a [u8]),
}

/// One file's part of a comparison: its row (without `vs_median`, which needs the other files)
/// and the recorded time of each iteration's peak, which the first spike is decided by. What
/// crosses a process boundary in a distributed comparison, as [`RankSummary::to_json`].
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RankSummary {
    pub row: RunRow,
    /// The recorded time of each iteration's peak request (`RunRow::iteration_peak_us`, which the
    /// row's own JSON leaves out).
    pub iteration_peak_us: Vec<Option<i64>>,
}

impl RankSummary {
    /// A file that could not be compared: its row holds only its name and why.
    pub fn failed(file: impl Into<String>, error: impl Into<String>) -> RankSummary {
        RankSummary { row: RunRow { file: file.into(), error: Some(error.into()), ..RunRow::default() }, iteration_peak_us: Vec::new() }
    }

    /// The summary as one line of JSON (a few hundred bytes, and about 30 more per iteration).
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a summary serialises")
    }

    /// A summary [`to_json`](Self::to_json) wrote.
    pub fn from_json(s: &str) -> Result<RankSummary, String> {
        serde_json::from_str(s).map_err(|e| format!("not a rank summary: {e}"))
    }
}

/// Reads and replays one file under `spec`: its summary, named `file` (the name its row, the
/// text and the JSON call it by). A file that cannot be read or replayed gives a summary whose
/// row holds the error; this never fails otherwise.
pub fn summarize_rank(source: RankSource<'_>, file: &str, spec: &RankSpec) -> RankSummary {
    let mut r = RunRow { file: file.to_string(), ..RunRow::default() };
    if let Err(e) = measure_file(source, spec, &mut r) {
        r.error = Some(e);
        r.iteration_peak_us.clear();
    }
    let iteration_peak_us = std::mem::take(&mut r.iteration_peak_us);
    RankSummary { row: r, iteration_peak_us }
}

fn measure_file(source: RankSource<'_>, spec: &RankSpec, r: &mut RunRow) -> Result<(), String> {
    let snap = match source {
        RankSource::Path(path) => allocsim_trace::read_trace(path),
        RankSource::Bytes(bytes) => allocsim_trace::read_trace_bytes(bytes),
    }
    .map_err(|e| e.to_string())?;
    let (p, config) = spec.trace.prepare_for(&snap, spec.config.as_deref(), spec.capacity).map_err(|e| e.to_string())?;
    let layout = Layout::of(&p, spec.by.as_deref()).map_err(|e| e.to_string())?;
    let ph = measure(&p, &layout, &config, spec.capacity, &p.recorded_placement(), 0);
    r.device = Some(ph.device);
    r.requests = ph.requests;
    r.peak_allocated = ph.peak_allocated;
    r.peak_reserved = ph.peak_reserved;
    r.ooms = ph.ooms;
    r.first_oom = ph.first_oom;
    r.first_oom_us = ph.first_oom.and_then(|q| p.program.requests.get(q as usize)).and_then(|q| p.trace.get(q.trace_index as usize)).map(|e| e.time_us);
    r.recorded_ooms = p.program.requests.iter().filter(|q| q.recorded_oom).count();
    r.first_recorded_oom_us = p.program.requests.iter().find(|q| q.recorded_oom).and_then(|q| p.trace.get(q.trace_index as usize)).map(|e| e.time_us);
    r.start_us = p.trace.first().map(|e| e.time_us);
    if let Some(i) = ph.peak_reserved_iteration {
        let pk = &ph.iterations[i].peaks;
        r.unallocated_at_peak = pk.peak_reserved - pk.allocated_at_peak_reserved.min(pk.peak_reserved);
        r.fragmentation_at_peak = if pk.peak_reserved > 0 { r.unallocated_at_peak as f64 / pk.peak_reserved as f64 } else { 0.0 };
    }
    r.peak_iteration = ph.peak_iteration;
    r.iteration_peaks = ph.iterations.iter().map(|i| i.peaks.peak_allocated).collect();
    r.iteration_peak_us = ph.iterations.iter().map(|i| i.peaks.peak_us).collect();
    Ok(())
}

/// The median of `v` (the mean of the two middle values for an even count); `None` when empty.
fn median(mut v: Vec<u64>) -> Option<u64> {
    if v.is_empty() {
        return None;
    }
    v.sort_unstable();
    let n = v.len();
    Some(if n % 2 == 1 { v[n / 2] } else { ((v[n / 2 - 1] as u128 + v[n / 2] as u128) / 2) as u64 })
}

/// The files `args` name: a directory stands for the snapshots in it (`*.pickle`, `*.pkl`,
/// `*.jsonl`, each optionally `.gz`), a name with `*` or `?` in its last component for the files
/// it matches (`?` one character, `*` any run), anything else for itself; each list sorted by name.
pub fn expand_paths(args: &[PathBuf]) -> Result<Vec<PathBuf>, String> {
    let mut out = Vec::new();
    for a in args {
        let name = a.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let glob = name.contains(['*', '?']);
        let (dir, pattern): (PathBuf, Option<String>) = if a.is_dir() {
            (a.clone(), None)
        } else if glob {
            let parent = a.parent().filter(|p| !p.as_os_str().is_empty()).map_or_else(|| PathBuf::from("."), Path::to_path_buf);
            (parent, Some(name.clone()))
        } else {
            out.push(a.clone());
            continue;
        };
        let entries = std::fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let mut found: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file())
            .filter(|p| {
                let n = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                match &pattern {
                    Some(g) => glob_match(g.as_bytes(), n.as_bytes()),
                    None => is_snapshot_name(&n),
                }
            })
            .collect();
        if found.is_empty() {
            return Err(match pattern {
                Some(_) => format!("{}: no file matches", a.display()),
                None => format!("{}: no snapshots (*.pickle, *.pkl, *.jsonl, optionally .gz) in this directory", a.display()),
            });
        }
        found.sort();
        out.extend(found);
    }
    Ok(out)
}

fn is_snapshot_name(n: &str) -> bool {
    let n = n.strip_suffix(".gz").unwrap_or(n);
    n.ends_with(".pickle") || n.ends_with(".pkl") || n.ends_with(".jsonl")
}

/// `*` any run of bytes, `?` one byte, everything else itself.
fn glob_match(p: &[u8], s: &[u8]) -> bool {
    let (mut pi, mut si) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while si < s.len() {
        match p.get(pi) {
            Some(b'*') => {
                star = Some((pi, si));
                pi += 1;
            }
            Some(&c) if c == b'?' || c == s[si] => {
                pi += 1;
                si += 1;
            }
            _ => match star {
                Some((sp, ss)) => {
                    pi = sp + 1;
                    si = ss + 1;
                    star = Some((sp, ss + 1));
                }
                None => return false,
            },
        }
    }
    p[pi..].iter().all(|&c| c == b'*')
}

/// Replays every file of `paths` (in parallel) and compares them: [`summarize_rank`] on each,
/// then [`reduce_ranks`]. Each row is named by the path as given (`Path::display`).
pub fn compare_runs(paths: &[PathBuf], spec: &RankSpec) -> Ranks {
    let summaries: Vec<RankSummary> = paths.par_iter().map(|p| summarize_rank(RankSource::Path(p), &p.display().to_string(), spec)).collect();
    reduce_ranks(summaries, spec)
}

/// Compares the files' summaries, in the order given (see the module documentation).
pub fn reduce_ranks(summaries: Vec<RankSummary>, spec: &RankSpec) -> Ranks {
    let rows = summaries
        .into_iter()
        .map(|s| {
            let mut row = s.row;
            row.iteration_peak_us = s.iteration_peak_us;
            row.vs_median.clear();
            row
        })
        .collect();
    rank(rows, spec.spike_ratio)
}

/// Compares measured rows (see the module documentation).
pub fn rank(mut rows: Vec<RunRow>, spike_ratio: f64) -> Ranks {
    let ok = |r: &&RunRow| r.error.is_none();
    let n_it = rows.iter().filter(ok).map(|r| r.iteration_peaks.len()).max().unwrap_or(0);
    let medians: Vec<u64> =
        (0..n_it).map(|i| median(rows.iter().filter(ok).filter_map(|r| r.iteration_peaks.get(i).copied()).collect()).unwrap_or(0)).collect();
    for r in rows.iter_mut().filter(|r| r.error.is_none()) {
        r.vs_median = r.iteration_peaks.iter().zip(&medians).map(|(&p, &m)| if m > 0 { p as f64 / m as f64 } else { 1.0 }).collect();
    }
    let first_oom = rows
        .iter()
        .filter(ok)
        .filter_map(|r| Some((r, r.first_oom?)))
        .min_by_key(|(r, _)| r.first_oom_us.unwrap_or(i64::MAX))
        .map(|(r, q)| FirstOom { file: r.file.clone(), request: Some(q), time_us: r.first_oom_us, recorded: false })
        .or_else(|| {
            rows.iter().filter(ok).filter(|r| r.recorded_ooms > 0).min_by_key(|r| r.first_recorded_oom_us.unwrap_or(i64::MAX)).map(|r| FirstOom {
                file: r.file.clone(),
                request: None,
                time_us: r.first_recorded_oom_us,
                recorded: true,
            })
        });
    let mut first_spike: Option<Spike> = None;
    'its: for (i, &m) in medians.iter().enumerate() {
        let mut best: Option<Spike> = None;
        for r in rows.iter().filter(ok) {
            let Some(&p) = r.iteration_peaks.get(i) else { continue };
            let ratio = if m > 0 { p as f64 / m as f64 } else { 1.0 };
            if m == 0 || ratio < spike_ratio {
                continue;
            }
            let t = r.iteration_peak_us.get(i).copied().flatten();
            let s = Spike { file: r.file.clone(), iteration: i, peak_allocated: p, median: m, ratio, time_us: t };
            if best.as_ref().is_none_or(|b| t.unwrap_or(i64::MAX) < b.time_us.unwrap_or(i64::MAX)) {
                best = Some(s);
            }
        }
        if best.is_some() {
            first_spike = best;
            break 'its;
        }
    }
    let largest_peak = rows.iter().filter(ok).max_by_key(|r| r.peak_allocated).map(|r| r.file.clone());
    Ranks { rows, median_iteration_peaks: medians, first_oom, first_spike, largest_peak, spike_ratio }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(file: &str, peaks: &[u64], oom: Option<(u32, i64)>) -> RunRow {
        RunRow {
            file: file.into(),
            device: Some(0),
            requests: 10,
            peak_allocated: peaks.iter().copied().max().unwrap_or(0),
            peak_reserved: 0,
            ooms: oom.is_some() as usize,
            first_oom: oom.map(|o| o.0),
            first_oom_us: oom.map(|o| o.1),
            recorded_ooms: 0,
            first_recorded_oom_us: None,
            start_us: Some(0),
            unallocated_at_peak: 0,
            fragmentation_at_peak: 0.0,
            peak_iteration: None,
            iteration_peaks: peaks.to_vec(),
            iteration_peak_us: (0..peaks.len()).map(|i| Some(100 * i as i64 + file.len() as i64)).collect(),
            vs_median: Vec::new(),
            error: None,
        }
    }

    #[test]
    fn medians_spikes_and_first_oom() {
        let rows = vec![
            r("a", &[100, 100, 100], None),
            r("bb", &[100, 120, 200], Some((7, 50))),
            r("ccc", &[100, 100, 100], Some((3, 40))),
            r("dddd", &[100, 100], None),
        ];
        let k = rank(rows, 1.1);
        // iteration 1: 100, 120, 100, 100 → median 100; iteration 2: 100, 200, 100 → 100
        assert_eq!(k.median_iteration_peaks, [100, 100, 100]);
        let s = k.first_spike.unwrap();
        assert_eq!((s.file.as_str(), s.iteration, s.peak_allocated, s.median), ("bb", 1, 120, 100));
        assert_eq!(k.first_oom.unwrap(), FirstOom { file: "ccc".into(), request: Some(3), time_us: Some(40), recorded: false });
        assert_eq!(k.largest_peak.as_deref(), Some("bb"));
        assert_eq!(k.rows[1].vs_median, [1.0, 1.2, 2.0]);
        assert_eq!(median(vec![1, 4, 2, 3]), Some(2));
        assert_eq!(median(vec![]), None);
    }

    #[test]
    fn summaries_cross_as_json_and_reduce_as_rows_rank() {
        let rows = vec![r("a", &[100, 100], None), r("bb", &[100, 150], Some((2, 30)))];
        let spec = RankSpec { config: None, capacity: None, trace: TraceOptions::default(), by: None, spike_ratio: 1.1 };
        let summaries: Vec<RankSummary> = rows
            .iter()
            .map(|row| {
                let mut row = row.clone();
                let iteration_peak_us = std::mem::take(&mut row.iteration_peak_us);
                let s = RankSummary { row, iteration_peak_us };
                let back = RankSummary::from_json(&s.to_json()).unwrap();
                assert_eq!(back, s);
                back
            })
            .chain([RankSummary::failed("c", "c: not a snapshot")])
            .collect();
        let mut want_rows = rows.clone();
        want_rows.push(RunRow { file: "c".into(), error: Some("c: not a snapshot".into()), ..RunRow::default() });
        assert_eq!(reduce_ranks(summaries, &spec), rank(want_rows, 1.1));
        assert!(RankSummary::from_json("{").unwrap_err().starts_with("not a rank summary"));
        // Floats come back bit for bit (a value serde_json's default parser reads 1 ulp off).
        let s = RankSummary { row: RunRow { fragmentation_at_peak: 0.45494132427203565, ..RunRow::default() }, iteration_peak_us: vec![None, Some(-1)] };
        assert_eq!(RankSummary::from_json(&s.to_json()).unwrap(), s);
    }

    #[test]
    fn a_file_and_its_bytes_summarize_alike() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../traces/field/ranks");
        let spec = RankSpec { config: None, capacity: None, trace: TraceOptions::default(), by: None, spike_ratio: 1.1 };
        let path = dir.join("rank1.pickle.gz");
        let a = summarize_rank(RankSource::Path(&path), "rank1", &spec);
        let bytes = std::fs::read(&path).unwrap();
        let b = summarize_rank(RankSource::Bytes(&bytes), "rank1", &spec);
        assert_eq!(a, b);
        assert_eq!(a.row.error, None);
        assert_eq!(a.iteration_peak_us.len(), a.row.iteration_peaks.len());
        assert!(a.row.iteration_peaks.len() >= 12, "{:?}", a.row.iteration_peaks);
        // A damaged file is a row with its error, not a failure.
        let cut = summarize_rank(RankSource::Bytes(&bytes[..bytes.len() / 2]), "cut", &spec);
        assert!(cut.row.error.is_some() && cut.row.iteration_peaks.is_empty(), "{cut:?}");
        let missing = summarize_rank(RankSource::Path(&dir.join("absent.pickle.gz")), "absent", &spec);
        assert!(missing.row.error.is_some());
    }

    #[test]
    fn globs() {
        for (p, s, want) in [
            ("rank*.pickle.gz", "rank0.pickle.gz", true),
            ("rank*.pickle.gz", "rank12.pickle.gz", true),
            ("rank*.pickle.gz", "rank0.pickle", false),
            ("rank?.pkl", "rank3.pkl", true),
            ("rank?.pkl", "rank33.pkl", false),
            ("*", "", true),
            ("a*b*c", "axxbyyc", true),
            ("a*b*c", "axxbyy", false),
        ] {
            assert_eq!(glob_match(p.as_bytes(), s.as_bytes()), want, "{p} {s}");
        }
    }
}
