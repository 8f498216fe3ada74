//! Trace formats: PyTorch memory-snapshot pickles and allocsim's own JSON Lines format.
//!
//! Data flows one way: bytes → [`Snapshot`] (typed, compact events) → the replay crate.
//! Nothing here knows about the allocator model.
//!
//! * [`pickle`]: a small, non-executing pickle decoder for builtin types (protocols 2–5). It refuses
//!   GLOBAL, REDUCE, BUILD and every other opcode that would construct or call an object.
//! * [`snapshot`]: turns the decoded value of `torch.cuda.memory._snapshot()` into a [`Snapshot`].
//! * [`pickle_write`]: a protocol-4 pickle writer for builtin types (what CPython's pickler writes).
//! * [`snapshot`]: also [`snapshot::to_pickle`], a [`Snapshot`] back in torch 2.11's snapshot shape.
//! * [`jsonl`]: allocsim's documented JSON Lines trace format, and conversion both ways.
//! * [`jsonl_stream`]: JSON Lines read as a stream of events (and a cheap first pass for the
//!   final segments), for replays in bounded memory.
//! * [`read_trace`] / [`write_trace`]: files in any of these formats (gzip'd or not).
//! * [`hash`]: a fast hasher for integer keys.
//! * [`frames`]: which frame of a recorded stack is the user's call site.

pub mod frames;
pub mod hash;
pub mod jsonl;
pub mod jsonl_stream;
pub mod pickle;
pub mod pickle_write;
pub mod snapshot;

use std::path::Path;

/// What happened in one trace entry (`device_traces[d][i]["action"]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    Alloc,
    FreeRequested,
    FreeCompleted,
    SegmentAlloc,
    SegmentFree,
    SegmentMap,
    SegmentUnmap,
    /// `addr` holds `device_free` (bytes free on the device per cudaMemGetInfo); `size` is the rounded request.
    Oom,
    Snapshot,
    /// 2.15+: `_annotate_memory`. Carries no allocator decision.
    Annotate,
}

impl Action {
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Alloc => "alloc",
            Action::FreeRequested => "free_requested",
            Action::FreeCompleted => "free_completed",
            Action::SegmentAlloc => "segment_alloc",
            Action::SegmentFree => "segment_free",
            Action::SegmentMap => "segment_map",
            Action::SegmentUnmap => "segment_unmap",
            Action::Oom => "oom",
            Action::Snapshot => "snapshot",
            Action::Annotate => "annotate",
        }
    }
    pub fn parse(s: &str) -> Option<Action> {
        Some(match s {
            "alloc" => Action::Alloc,
            "free_requested" => Action::FreeRequested,
            "free_completed" => Action::FreeCompleted,
            "segment_alloc" => Action::SegmentAlloc,
            "segment_free" => Action::SegmentFree,
            "segment_map" => Action::SegmentMap,
            "segment_unmap" => Action::SegmentUnmap,
            "oom" => Action::Oom,
            "snapshot" => Action::Snapshot,
            "annotate" => Action::Annotate,
            _ => return None,
        })
    }
}

/// One frame of a Python (or C++) stack.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Frame {
    pub name: String,
    pub filename: String,
    pub line: i64,
}

/// Index into [`Snapshot::stacks`]; 0 is the empty stack (no frames recorded).
pub type StackId = u32;

/// One entry of `device_traces[d]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceEntry {
    pub action: Action,
    /// Block or segment address; for [`Action::Oom`] the `device_free` value.
    pub addr: u64,
    pub size: u64,
    /// Raw `cudaStream_t` value (0 = legacy default stream).
    pub stream: u64,
    pub time_us: i64,
    pub stack: StackId,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockState {
    ActiveAllocated,
    ActivePendingFree,
    Inactive,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotBlock {
    pub address: u64,
    pub size: u64,
    pub requested_size: u64,
    pub state: BlockState,
    pub stack: StackId,
}

/// One entry of `segments` (one cudaMalloc'd segment, or one contiguous mapped range of an
/// expandable segment).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotSegment {
    pub device: i64,
    pub address: u64,
    pub total_size: u64,
    pub allocated_size: u64,
    pub active_size: u64,
    pub requested_size: u64,
    pub stream: u64,
    /// `segment_type == "small"`.
    pub is_small: bool,
    pub pool_id: (i64, i64),
    pub is_expandable: bool,
    pub blocks: Vec<SnapshotBlock>,
}

/// `allocator_settings` as the snapshot recorded them (2.11 keys; absent keys keep defaults).
#[derive(Clone, Debug, PartialEq, Default)]
pub struct RecordedSettings {
    /// The last parsed settings string (`PYTORCH_CUDA_ALLOC_CONF`); `None` if the key was absent.
    pub alloc_conf: Option<String>,
    /// −1 = unlimited.
    pub max_split_size: Option<i64>,
    pub garbage_collection_threshold: Option<f64>,
    pub expandable_segments: Option<bool>,
    /// `roundup_power2_divisions` as (interval start in MB, divisions), in the recorded order.
    pub roundup_power2_divisions: Vec<(u64, u64)>,
    /// Whether the snapshot had an `allocator_settings` dict at all (pre-2.1 snapshots do not).
    pub present: bool,
}

/// A decoded memory snapshot: what `torch.cuda.memory._snapshot()` returned.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Snapshot {
    pub segments: Vec<SnapshotSegment>,
    /// Indexed by device.
    pub device_traces: Vec<Vec<TraceEntry>>,
    pub settings: RecordedSettings,
    /// Interned stacks; `stacks[0]` is the empty stack.
    pub stacks: Vec<Vec<Frame>>,
}

impl Snapshot {
    pub fn stack(&self, id: StackId) -> &[Frame] {
        self.stacks.get(id as usize).map(|v| v.as_slice()).unwrap_or(&[])
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("pickle: {0}")]
    Pickle(#[from] pickle::PickleError),
    #[error("not a memory snapshot: {0}")]
    NotSnapshot(String),
    #[error("JSON Lines trace, line {line}: {msg}")]
    Jsonl { line: usize, msg: String },
    #[error("gzip: {0}")]
    Gzip(String),
}

/// Reads a trace file: a snapshot pickle (plain or gzip'd, detected by magic bytes) or a JSON Lines
/// trace (detected by a leading `{`). A gzip'd file is decompressed as it is read.
pub fn read_trace(path: &Path) -> Result<Snapshot, TraceError> {
    use std::io::Read;
    let io = |e| TraceError::Io { path: path.display().to_string(), source: e };
    let mut f = std::fs::File::open(path).map_err(io)?;
    let len = f.metadata().map(|m| m.len()).unwrap_or(0) as usize;
    let mut head = Vec::with_capacity(2);
    (&mut f).take(2).read_to_end(&mut head).map_err(io)?;
    if head == [0x1f, 0x8b] {
        let r = std::io::Read::chain(&head[..], std::io::BufReader::new(f));
        let out = gunzip_from(r, len)?;
        return read_trace_bytes(&out);
    }
    let mut bytes = Vec::with_capacity(len);
    bytes.extend_from_slice(&head);
    f.read_to_end(&mut bytes).map_err(io)?;
    read_trace_bytes(&bytes)
}

/// Like [`read_trace`], from bytes.
pub fn read_trace_bytes(bytes: &[u8]) -> Result<Snapshot, TraceError> {
    let raw;
    let bytes = if bytes.starts_with(&[0x1f, 0x8b]) {
        raw = gunzip_from(bytes, bytes.len())?;
        &raw[..]
    } else {
        bytes
    };
    let first = bytes.iter().copied().find(|b| !b.is_ascii_whitespace());
    if first == Some(b'{') {
        jsonl::read(bytes)
    } else {
        snapshot::from_pickle(bytes)
    }
}

fn gunzip_from(r: impl std::io::Read, compressed_len: usize) -> Result<Vec<u8>, TraceError> {
    use std::io::Read;
    let mut out = Vec::with_capacity(compressed_len.saturating_mul(8).min(1 << 30));
    flate2::read::MultiGzDecoder::new(r)
        .read_to_end(&mut out)
        .map_err(|e| TraceError::Gzip(format!("{e} (after {} decompressed bytes)", out.len())))?;
    Ok(out)
}

/// A format [`write_trace`] writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputFormat {
    /// allocsim's JSON Lines ([`jsonl::write`]).
    Jsonl,
    /// A torch 2.11 snapshot pickle ([`snapshot::to_pickle`]).
    Pickle,
}

impl OutputFormat {
    /// The format and whether to gzip it, from a file name: `*.jsonl`, `*.pickle` / `*.pkl`, each
    /// optionally followed by `.gz`. `None` for anything else.
    pub fn from_path(path: &Path) -> Option<(OutputFormat, bool)> {
        let name = path.file_name()?.to_str()?.to_ascii_lowercase();
        let (stem, gz) = match name.strip_suffix(".gz") {
            Some(s) => (s.to_owned(), true),
            None => (name, false),
        };
        let format = if stem.ends_with(".jsonl") {
            OutputFormat::Jsonl
        } else if stem.ends_with(".pickle") || stem.ends_with(".pkl") {
            OutputFormat::Pickle
        } else {
            return None;
        };
        Some((format, gz))
    }
}

/// Writes `snap` to `out` in `format`, gzip'd when `gzip` (`out` should be buffered).
pub fn write_trace_to(
    snap: &Snapshot,
    format: OutputFormat,
    gzip: bool,
    out: &mut impl std::io::Write,
) -> std::io::Result<()> {
    fn plain(
        snap: &Snapshot,
        format: OutputFormat,
        out: &mut impl std::io::Write,
    ) -> std::io::Result<()> {
        match format {
            OutputFormat::Jsonl => jsonl::write(snap, out),
            OutputFormat::Pickle => out.write_all(&snapshot::to_pickle(snap)),
        }
    }
    if gzip {
        let mut gz = flate2::write::GzEncoder::new(out, flate2::Compression::default());
        plain(snap, format, &mut gz)?;
        gz.finish()?;
        Ok(())
    } else {
        plain(snap, format, out)
    }
}

/// Writes `snap` to the file `path` in the format its name asks for (see
/// [`OutputFormat::from_path`]); returns that format and whether it was gzip'd.
pub fn write_trace(snap: &Snapshot, path: &Path) -> Result<(OutputFormat, bool), TraceError> {
    use std::io::Write;
    let (format, gzip) = OutputFormat::from_path(path).ok_or_else(|| TraceError::Io {
        path: path.display().to_string(),
        source: std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "unknown output format: name the file *.jsonl, *.pickle or *.pickle.gz \
             (also *.jsonl.gz, *.pkl, *.pkl.gz)",
        ),
    })?;
    let io = |e| TraceError::Io { path: path.display().to_string(), source: e };
    let f = std::fs::File::create(path).map_err(io)?;
    let mut w = std::io::BufWriter::new(f);
    write_trace_to(snap, format, gzip, &mut w).map_err(io)?;
    w.flush().map_err(io)?;
    Ok((format, gzip))
}
