//! Trace formats: PyTorch memory-snapshot pickles and allocsim's own JSON Lines format.
//!
//! Data flows one way: bytes → [`Snapshot`] (typed, compact events) → the replay crate.
//! Nothing here knows about the allocator model.
//!
//! * [`pickle`]: a small, non-executing pickle decoder for builtin types (protocols 2–5). It refuses
//!   GLOBAL, REDUCE, BUILD and every other opcode that would construct or call an object.
//! * [`snapshot`]: turns the decoded value of `torch.cuda.memory._snapshot()` into a [`Snapshot`].
//! * [`jsonl`]: allocsim's documented JSON Lines trace format, and conversion both ways.

pub mod jsonl;
pub mod pickle;
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
/// trace (detected by a leading `{`).
pub fn read_trace(path: &Path) -> Result<Snapshot, TraceError> {
    let bytes = std::fs::read(path).map_err(|e| TraceError::Io { path: path.display().to_string(), source: e })?;
    read_trace_bytes(&bytes)
}

/// Like [`read_trace`], from bytes.
pub fn read_trace_bytes(bytes: &[u8]) -> Result<Snapshot, TraceError> {
    let raw;
    let bytes = if bytes.starts_with(&[0x1f, 0x8b]) {
        raw = gunzip(bytes)?;
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

fn gunzip(bytes: &[u8]) -> Result<Vec<u8>, TraceError> {
    use std::io::Read;
    let mut out = Vec::with_capacity(bytes.len() * 8);
    flate2::read::MultiGzDecoder::new(bytes)
        .read_to_end(&mut out)
        .map_err(|e| TraceError::Gzip(format!("{e} (after {} decompressed bytes)", out.len())))?;
    Ok(out)
}
