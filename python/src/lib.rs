//! `allocsim._allocsim`: the native half of the `allocsim` Python package (the Python half,
//! `allocsim/`, wraps it). Snapshots are decoded and every command runs with the GIL released,
//! through the same `allocsim_commands` functions the command line calls, so each answer's text
//! and JSON are the command line's.

use std::path::PathBuf;
use std::sync::Arc;

use allocsim_commands::explain::ExplainOptions;
use allocsim_commands::fit::FitOptions;
use allocsim_commands::graphs::GraphsOptions;
use allocsim_commands::phases::PhasesOptions;
use allocsim_commands::replay::ReplayOptions;
use allocsim_commands::report::ReportOptions;
use allocsim_commands::scale::{LargestUnder, ScaleOptions};
use allocsim_commands::sweep::SweepOptions;
use allocsim_commands::{Answer, Error as CommandError, Trace, TraceOptions};
use allocsim_replay::TorchVersion;
use allocsim_trace::Action;
use pyo3::exceptions::{PyException, PyOSError, PyValueError};
use pyo3::prelude::*;

pyo3::create_exception!(allocsim, Error, PyException, "Base class of allocsim's errors.");
pyo3::create_exception!(allocsim, TraceError, Error, "A trace that cannot be read: not a snapshot, corrupt or truncated, or holding impossible values.");
pyo3::create_exception!(allocsim, ConfigError, Error, "Settings PyTorch rejects; the message is PyTorch's own.");

/// A command's error as a Python exception.
fn py_err(e: CommandError) -> PyErr {
    match e {
        CommandError::Trace(m) => TraceError::new_err(m),
        CommandError::Config { pytorch, .. } => ConfigError::new_err(pytorch),
        CommandError::Usage(m) => PyValueError::new_err(m),
        CommandError::Io(m) => PyOSError::new_err(m),
    }
}

/// An answer as `(text, json, exit status)`.
type Rendered = (String, String, i32);

fn render(a: &dyn Answer) -> Rendered {
    (a.text(), a.json(), a.exit_code())
}

/// A decoded snapshot (immutable; shared by every command run on it).
#[pyclass(frozen, module = "allocsim._allocsim")]
struct Snapshot {
    snap: Arc<allocsim_trace::Snapshot>,
    name: String,
}

impl Snapshot {
    fn trace(&self) -> Trace<'_> {
        Trace { name: &self.name, snapshot: &self.snap }
    }
    /// The snapshot and its name, shared (for a command that takes two snapshots).
    fn trace_owned(&self) -> (Arc<allocsim_trace::Snapshot>, String) {
        (self.snap.clone(), self.name.clone())
    }
}

fn trace_options(device: Option<usize>, device_memory: Option<u64>, trace_capacity: Option<u64>) -> TraceOptions {
    TraceOptions { device_memory, trace_capacity, device }
}

#[pymethods]
impl Snapshot {
    /// Reads a snapshot pickle (`.pickle`, `.pickle.gz`; one of the shape torch writes in one pass,
    /// without building its values) or an allocsim JSON Lines trace.
    #[staticmethod]
    #[pyo3(signature = (path, name = None))]
    fn from_path(py: Python<'_>, path: PathBuf, name: Option<String>) -> PyResult<Snapshot> {
        let name = name.unwrap_or_else(|| path.display().to_string());
        let snap = py.detach(|| allocsim_trace::read_trace(&path)).map_err(|e| py_err(allocsim_commands::error::trace_error(&name, e)))?;
        Ok(Snapshot { snap: Arc::new(snap), name })
    }

    /// Decodes a snapshot from bytes (a pickle, gzip'd or not, or JSON Lines).
    #[staticmethod]
    fn from_bytes(py: Python<'_>, data: &[u8], name: String) -> PyResult<Snapshot> {
        let snap = py.detach(|| allocsim_trace::read_trace_bytes(data)).map_err(|e| py_err(allocsim_commands::error::trace_error(&name, e)))?;
        Ok(Snapshot { snap: Arc::new(snap), name })
    }

    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// Trace entries per device.
    #[getter]
    fn entries(&self) -> Vec<usize> {
        self.snap.device_traces.iter().map(|t| t.len()).collect()
    }

    /// The number of final segments (every device's).
    #[getter]
    fn segments(&self) -> usize {
        self.snap.segments.len()
    }

    /// The `PYTORCH_CUDA_ALLOC_CONF` string recorded in the snapshot (None when absent).
    #[getter]
    fn alloc_conf(&self) -> Option<String> {
        self.snap.settings.alloc_conf.clone()
    }

    /// The request numbers (0-based ordinals of the device's `alloc` and `oom` entries) of the
    /// OOMs the trace recorded on `device`.
    fn recorded_ooms(&self, device: usize) -> Vec<u32> {
        let mut out = Vec::new();
        let mut req = 0u32;
        for e in self.snap.device_traces.get(device).map_or(&[][..], |v| v.as_slice()) {
            match e.action {
                Action::Alloc => req += 1,
                Action::Oom => {
                    out.push(req);
                    req += 1;
                }
                _ => {}
            }
        }
        out
    }

    /// How many requests (`alloc` and `oom` entries) the trace holds on `device`.
    fn requests(&self, device: usize) -> usize {
        self.snap.device_traces.get(device).map_or(0, |t| t.iter().filter(|e| matches!(e.action, Action::Alloc | Action::Oom)).count())
    }

    /// Whether two snapshots hold the same entries, segments, settings, stacks and annotations.
    fn same_as(&self, other: &Snapshot) -> bool {
        self.snap == other.snap
    }

    /// The snapshot as torch 2.11's snapshot pickle (protocol 4).
    fn to_pickle<'py>(&self, py: Python<'py>) -> Bound<'py, pyo3::types::PyBytes> {
        let bytes = py.detach(|| allocsim_trace::snapshot::to_pickle(&self.snap));
        pyo3::types::PyBytes::new(py, &bytes)
    }

    #[pyo3(signature = (config = None, capacity = None, device_memory = None, trace_capacity = None, placements = None, device = None, torch_version = None, addresses_from = None))]
    #[allow(clippy::too_many_arguments)]
    fn replay(
        &self,
        py: Python<'_>,
        config: Option<String>,
        capacity: Option<u64>,
        device_memory: Option<u64>,
        trace_capacity: Option<u64>,
        placements: Option<usize>,
        device: Option<usize>,
        torch_version: Option<String>,
        addresses_from: Option<PyRef<'_, Snapshot>>,
    ) -> PyResult<Rendered> {
        let torch_version = torch_version.map(|v| TorchVersion::parse(&v).map_err(PyValueError::new_err)).transpose()?;
        let o = ReplayOptions { config, capacity, device_memory, trace_capacity, placements, device, torch_version };
        let other = addresses_from.map(|s| s.snap.clone());
        py.detach(|| allocsim_commands::replay::replay(self.trace(), other.as_deref(), &o).map(|a| render(&a))).map_err(py_err)
    }

    #[pyo3(signature = (capacity = None, device_memory = None, device = None))]
    fn validate(&self, py: Python<'_>, capacity: Option<u64>, device_memory: Option<u64>, device: Option<usize>) -> PyResult<Rendered> {
        let o = allocsim_commands::replay::ValidateOptions { capacity, device_memory, device, ..Default::default() };
        py.detach(|| allocsim_commands::replay::validate(self.trace(), &o).map(|a| render(&a))).map_err(py_err)
    }

    #[pyo3(signature = (at = None, config = None, capacity = None, top = 5, device = None, device_memory = None, trace_capacity = None, addresses_from = None))]
    #[allow(clippy::too_many_arguments)]
    fn explain(
        &self,
        py: Python<'_>,
        at: Option<String>,
        config: Option<String>,
        capacity: Option<u64>,
        top: usize,
        device: Option<usize>,
        device_memory: Option<u64>,
        trace_capacity: Option<u64>,
        addresses_from: Option<PyRef<'_, Snapshot>>,
    ) -> PyResult<Rendered> {
        let o = ExplainOptions { trace: trace_options(device, device_memory, trace_capacity), at, config, capacity, top };
        let other = addresses_from.map(|s| s.snap.clone());
        py.detach(|| allocsim_commands::explain::explain(self.trace(), other.as_deref(), &o).map(|a| render(&a))).map_err(py_err)
    }

    #[pyo3(signature = (grid = None, capacity = None, base = String::new(), placements = 4, top = 15, device = None, device_memory = None, trace_capacity = None))]
    #[allow(clippy::too_many_arguments)]
    fn sweep(
        &self,
        py: Python<'_>,
        grid: Option<String>,
        capacity: Option<u64>,
        base: String,
        placements: usize,
        top: usize,
        device: Option<usize>,
        device_memory: Option<u64>,
        trace_capacity: Option<u64>,
    ) -> PyResult<(String, String, String)> {
        let o = SweepOptions {
            trace: trace_options(device, device_memory, trace_capacity),
            capacity,
            grid,
            base,
            placements,
            top,
            width: Some(allocsim_commands::sweep::DEFAULT_WIDTH),
        };
        py.detach(|| {
            let a = allocsim_commands::sweep::sweep(self.trace(), &o, &|| {})?;
            let mut csv = Vec::new();
            a.write_csv(&mut csv)?;
            Ok((a.text(), a.json(), String::from_utf8(csv).expect("UTF-8")))
        })
        .map_err(py_err)
    }

    #[pyo3(signature = (cards = Vec::new(), config = None, grid = None, reserve = None, placements = 1, device = None, device_memory = None, trace_capacity = None))]
    #[allow(clippy::too_many_arguments)]
    fn fit(
        &self,
        py: Python<'_>,
        cards: Vec<u64>,
        config: Option<String>,
        grid: Option<String>,
        reserve: Option<u64>,
        placements: usize,
        device: Option<usize>,
        device_memory: Option<u64>,
        trace_capacity: Option<u64>,
    ) -> PyResult<Rendered> {
        let o = FitOptions { trace: trace_options(device, device_memory, trace_capacity), config, grid, cards, reserve, placements };
        py.detach(|| allocsim_commands::fit::fit(self.trace(), &o).map(|a| render(&a))).map_err(py_err)
    }

    #[pyo3(signature = (captured, batches = Vec::new(), config = None, capacity = None, placements = 4, device = None, device_memory = None, trace_capacity = None))]
    #[allow(clippy::too_many_arguments)]
    fn graphs(
        &self,
        py: Python<'_>,
        captured: Vec<u64>,
        batches: Vec<u64>,
        config: Option<String>,
        capacity: Option<u64>,
        placements: usize,
        device: Option<usize>,
        device_memory: Option<u64>,
        trace_capacity: Option<u64>,
    ) -> PyResult<Rendered> {
        let o = GraphsOptions { trace: trace_options(device, device_memory, trace_capacity), captured, batches, config, capacity, placements };
        py.detach(|| allocsim_commands::graphs::graphs(self.trace(), &o).map(|a| render(&a))).map_err(py_err)
    }

    #[pyo3(signature = (config = None, capacity = None, by = None, top = 3, device = None, device_memory = None, trace_capacity = None))]
    #[allow(clippy::too_many_arguments)]
    fn phases(
        &self,
        py: Python<'_>,
        config: Option<String>,
        capacity: Option<u64>,
        by: Option<String>,
        top: usize,
        device: Option<usize>,
        device_memory: Option<u64>,
        trace_capacity: Option<u64>,
    ) -> PyResult<Rendered> {
        let o = PhasesOptions { trace: trace_options(device, device_memory, trace_capacity), config, capacity, by, top };
        py.detach(|| allocsim_commands::phases::phases(self.trace(), &o).map(|a| render(&a))).map_err(py_err)
    }

    /// `allocsim compare`: with `other`, this recorded run against another of the same requests,
    /// each as recorded; without, this trace's requests replayed under `config` (side A) and
    /// `config_b` (side B), each the trace's own settings where not given.
    #[pyo3(signature = (other = None, config = None, config_b = None, capacity = None, top = 10, device = None, device_memory = None, trace_capacity = None))]
    #[allow(clippy::too_many_arguments)]
    fn compare(
        &self,
        py: Python<'_>,
        other: Option<Py<Snapshot>>,
        config: Option<String>,
        config_b: Option<String>,
        capacity: Option<u64>,
        top: usize,
        device: Option<usize>,
        device_memory: Option<u64>,
        trace_capacity: Option<u64>,
    ) -> PyResult<Rendered> {
        use allocsim_commands::compare::{CompareOptions, compare_configs, compare_recorded};
        let other = other.map(|o| o.get().trace_owned());
        let o = CompareOptions { trace: trace_options(device, device_memory, trace_capacity), config, config_b, capacity, top };
        py.detach(|| match &other {
            Some((snap, name)) => compare_recorded(self.trace(), Trace { name, snapshot: snap }, &o).map(|a| render(&a)),
            None => compare_configs(self.trace(), &o).map(|a| render(&a)),
        })
        .map_err(py_err)
    }

    /// Writes the HTML report to `path` (and the plots into `svg_dir`); returns the page's size.
    #[pyo3(signature = (path, configs = Vec::new(), capacity = None, svg_dir = None, device = None, device_memory = None, trace_capacity = None))]
    #[allow(clippy::too_many_arguments)]
    fn report(
        &self,
        py: Python<'_>,
        path: PathBuf,
        configs: Vec<String>,
        capacity: Option<u64>,
        svg_dir: Option<PathBuf>,
        device: Option<usize>,
        device_memory: Option<u64>,
        trace_capacity: Option<u64>,
    ) -> PyResult<usize> {
        let o = ReportOptions { trace: trace_options(device, device_memory, trace_capacity), configs, capacity };
        py.detach(|| {
            let r = allocsim_commands::report::report(self.trace(), &o)?;
            r.write_page(&path)?;
            if let Some(dir) = &svg_dir {
                r.write_svgs(dir)?;
            }
            Ok(r.page.len())
        })
        .map_err(py_err)
    }
}

/// `allocsim replay PATH`: a snapshot file replayed without keeping it, as the command line does
/// (streamed in memory bounded by the live set where one pass answers, else read compactly and
/// replayed in memory; `allocsim_commands::file`).
#[pyfunction]
#[pyo3(signature = (path, config = None, capacity = None, device_memory = None, trace_capacity = None, placements = None, device = None, torch_version = None, addresses_from = None))]
#[allow(clippy::too_many_arguments)]
fn replay_file(
    py: Python<'_>,
    path: PathBuf,
    config: Option<String>,
    capacity: Option<u64>,
    device_memory: Option<u64>,
    trace_capacity: Option<u64>,
    placements: Option<usize>,
    device: Option<usize>,
    torch_version: Option<String>,
    addresses_from: Option<PathBuf>,
) -> PyResult<Rendered> {
    let torch_version = torch_version.map(|v| TorchVersion::parse(&v).map_err(PyValueError::new_err)).transpose()?;
    let o = ReplayOptions { config, capacity, device_memory, trace_capacity, placements, device, torch_version };
    py.detach(|| {
        let f = allocsim_commands::file::ReplayFile { addresses_from: addresses_from.as_deref(), ..allocsim_commands::file::ReplayFile::new(&path) };
        allocsim_commands::file::replay_file(f, &o, &mut |_| {}).map(|a| render(&a))
    })
    .map_err(py_err)
}

/// `allocsim scale` on one or more snapshots of the same job (the first gives the state the asked
/// steps follow): `values` one list per snapshot (or none: the `PARAM=VALUE` annotations);
/// `largest_under` an allowed maximum, or `largest_under_budget` the first trace's own budget.
#[pyfunction]
#[pyo3(signature = (snapshots, param, values = Vec::new(), predict = Vec::new(), hold_out = Vec::new(), after = None, largest_under = None, largest_under_budget = false, cards = Vec::new(), reserve = None, step = None, config = None, capacity = None, by = None, device = None, device_memory = None, trace_capacity = None))]
#[allow(clippy::too_many_arguments)]
fn scale(
    py: Python<'_>,
    snapshots: Vec<Py<Snapshot>>,
    param: String,
    values: Vec<Vec<Option<u64>>>,
    predict: Vec<u64>,
    hold_out: Vec<u64>,
    after: Option<usize>,
    largest_under: Option<u64>,
    largest_under_budget: bool,
    cards: Vec<u64>,
    reserve: Option<u64>,
    step: Option<u64>,
    config: Option<String>,
    capacity: Option<u64>,
    by: Option<String>,
    device: Option<usize>,
    device_memory: Option<u64>,
    trace_capacity: Option<u64>,
) -> PyResult<Rendered> {
    let snaps: Vec<(Arc<allocsim_trace::Snapshot>, String)> = snapshots.iter().map(|s| (s.get().snap.clone(), s.get().name.clone())).collect();
    let largest_under = match (largest_under, largest_under_budget) {
        (Some(b), _) => Some(LargestUnder::Bytes(b)),
        (None, true) => Some(LargestUnder::Budget),
        (None, false) => None,
    };
    let o = ScaleOptions {
        trace: trace_options(device, device_memory, trace_capacity),
        param,
        values,
        by,
        after,
        predict,
        hold_out,
        largest_under,
        cards,
        reserve,
        step,
        config,
        capacity,
    };
    py.detach(|| {
        let traces: Vec<Trace<'_>> = snaps.iter().map(|(s, n)| Trace { name: n, snapshot: s }).collect();
        allocsim_commands::scale::scale(&traces, &o).map(|a| render(&a))
    })
    .map_err(py_err)
}

/// The files `allocsim compare` takes as ranks for these arguments (directories and globs
/// expanded, each list sorted), named as the command line names them.
#[pyfunction]
fn rank_paths(args: Vec<PathBuf>) -> PyResult<Vec<String>> {
    let paths = allocsim_phases::ranks::expand_paths(&args).map_err(PyValueError::new_err)?;
    Ok(paths.iter().map(|p| p.display().to_string()).collect())
}

/// Checks a ranks question's settings and spike ratio as `allocsim compare` does before reading
/// any file (`ConfigError`, `ValueError`).
#[pyfunction]
#[pyo3(signature = (config = None, spike = 1.1))]
fn rank_check(config: Option<String>, spike: f64) -> PyResult<()> {
    allocsim_commands::compare::rank_spec(config, None, TraceOptions::default(), None, spike).map(|_| ()).map_err(py_err)
}

/// One file of a ranks comparison, read and replayed (`allocsim_phases::ranks::summarize_rank`):
/// `source` is its path (str) or its bytes, `name` what its row calls it. Returns the summary as
/// one line of JSON; a file that cannot be read or replayed gives a summary holding the error.
#[pyfunction]
#[pyo3(signature = (source, name, config = None, capacity = None, device_memory = None, device = None, by = None, trace_capacity = None))]
#[allow(clippy::too_many_arguments)]
fn rank_summary(
    py: Python<'_>,
    source: &Bound<'_, PyAny>,
    name: String,
    config: Option<String>,
    capacity: Option<u64>,
    device_memory: Option<u64>,
    device: Option<usize>,
    by: Option<String>,
    trace_capacity: Option<u64>,
) -> PyResult<String> {
    use allocsim_phases::ranks::{RankSource, RankSpec, summarize_rank};
    let spec = RankSpec { config, capacity, trace: trace_options(device, device_memory, trace_capacity), by, spike_ratio: 1.1 };
    if let Ok(b) = source.cast::<pyo3::types::PyBytes>() {
        let data = b.as_bytes();
        return Ok(py.detach(|| summarize_rank(RankSource::Bytes(data), &name, &spec).to_json()));
    }
    let path: PathBuf = source.extract().map_err(|_| pyo3::exceptions::PyTypeError::new_err("rank_summary: expected a path (str) or bytes"))?;
    Ok(py.detach(|| summarize_rank(RankSource::Path(&path), &name, &spec).to_json()))
}

/// The ranks compared from their summaries (`allocsim_phases::ranks::reduce_ranks`), in the
/// order given: each item a summary `rank_summary` returned, or `(name, error)` for a file whose
/// summary could not be made. Returns `(text, json, exit status, error line)` as
/// `allocsim compare` prints them (the JSON without its newline) (the error line, when some files failed, without the
/// `allocsim: error: ` before it).
#[pyfunction]
#[pyo3(signature = (summaries, spike = 1.1))]
fn rank_reduce(py: Python<'_>, summaries: Vec<Bound<'_, PyAny>>, spike: f64) -> PyResult<(String, String, i32, Option<String>)> {
    use allocsim_phases::ranks::{RankSummary, reduce_ranks};
    let spec = allocsim_commands::compare::rank_spec(None, None, TraceOptions::default(), None, spike).map_err(py_err)?;
    enum Item {
        Json(String),
        Failed(String, String),
    }
    let mut items = Vec::with_capacity(summaries.len());
    for (i, s) in summaries.iter().enumerate() {
        if let Ok(j) = s.extract::<String>() {
            items.push(Item::Json(j));
        } else if let Ok((f, e)) = s.extract::<(String, String)>() {
            items.push(Item::Failed(f, e));
        } else {
            return Err(pyo3::exceptions::PyTypeError::new_err(format!("rank_reduce: item {i}: expected a summary (str) or (name, error)")));
        }
    }
    py.detach(|| {
        let mut parsed = Vec::with_capacity(items.len());
        for (i, it) in items.into_iter().enumerate() {
            parsed.push(match it {
                Item::Json(j) => RankSummary::from_json(&j).map_err(|e| PyValueError::new_err(format!("rank_reduce: item {i}: {e}")))?,
                Item::Failed(f, e) => RankSummary::failed(f, e),
            });
        }
        let k = reduce_ranks(parsed, &spec);
        let (mut text, mut json) = (Vec::new(), Vec::new());
        allocsim_commands::compare::write_ranks(&mut text, &k).map_err(|e| PyOSError::new_err(e.to_string()))?;
        allocsim_commands::write_json(&mut json, &k).map_err(|e| PyOSError::new_err(e.to_string()))?;
        json.pop(); // the newline, as every answer's JSON is kept
        let failure = allocsim_commands::compare::ranks_failure(&k);
        let code = if failure.is_some() { 2 } else { 0 };
        Ok((String::from_utf8(text).expect("UTF-8"), String::from_utf8(json).expect("UTF-8"), code, failure))
    })
}

/// Bytes from `1073741824`, `24GiB`, `1.5 GiB`, `80GB` (what the command line accepts).
#[pyfunction]
fn parse_size(s: &str) -> PyResult<u64> {
    allocsim_commands::parse_size(s).map_err(PyValueError::new_err)
}

/// Runs the command line (`argv[0]` is the program name) on this process's stdout and stderr;
/// returns its exit status.
#[pyfunction]
fn cli(py: Python<'_>, argv: Vec<String>) -> i32 {
    py.detach(|| allocsim::cli::main_from(argv))
}

#[pymodule]
fn _allocsim(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Snapshot>()?;
    m.add_function(wrap_pyfunction!(parse_size, m)?)?;
    m.add_function(wrap_pyfunction!(replay_file, m)?)?;
    m.add_function(wrap_pyfunction!(scale, m)?)?;
    m.add_function(wrap_pyfunction!(cli, m)?)?;
    m.add_function(wrap_pyfunction!(rank_paths, m)?)?;
    m.add_function(wrap_pyfunction!(rank_check, m)?)?;
    m.add_function(wrap_pyfunction!(rank_summary, m)?)?;
    m.add_function(wrap_pyfunction!(rank_reduce, m)?)?;
    m.add("Error", m.py().get_type::<Error>())?;
    m.add("TraceError", m.py().get_type::<TraceError>())?;
    m.add("ConfigError", m.py().get_type::<ConfigError>())?;
    m.add("VERSION", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
