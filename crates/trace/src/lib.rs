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
//! * [`pickle_stream`]: snapshot pickles read as a stream of events (and a first pass for the
//!   segments and settings), in memory bounded by what the pickle's memo can still refer to.
//! * [`jsonl_stream`]: JSON Lines read as a stream of events (and a cheap first pass for the
//!   final segments), for replays in bounded memory.
//! * [`read_trace`] / [`write_trace`]: files in any of these formats (gzip'd or not).
//! * [`hash`]: a fast hasher for integer keys.
//! * [`frames`]: which frame of a recorded stack is the user's call site.

pub mod frames;
pub mod gzip_tail;
pub mod hash;
pub mod input;
pub mod jsonl;
pub mod jsonl_stream;
pub mod mem;
pub mod pickle;
pub mod pickle_stream;
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
    /// A segment event: `segment_alloc`, `segment_free`, `segment_map` or `segment_unmap`.
    pub fn is_segment_event(self) -> bool {
        matches!(self, Action::SegmentAlloc | Action::SegmentFree | Action::SegmentMap | Action::SegmentUnmap)
    }

    /// A segment event that adds reserved memory: `segment_alloc` (a cudaMalloc) or
    /// `segment_map` (pages mapped into an expandable segment).
    pub fn reserves(self) -> bool {
        matches!(self, Action::SegmentAlloc | Action::SegmentMap)
    }

    /// A segment event that gives reserved memory back: `segment_free` or `segment_unmap`.
    pub fn releases(self) -> bool {
        matches!(self, Action::SegmentFree | Action::SegmentUnmap)
    }

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

impl std::fmt::Display for Action {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// As the trace names it (`"segment_alloc"`, …).
impl serde::Serialize for Action {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
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

/// A trace entry's `compile_context` and `user_metadata`: 0 is torch's defaults (`'N/A'` and
/// `''`, also what a snapshot from before torch 2.8 / 2.10 without these keys means); `k > 0` is
/// [`Snapshot::entry_metas`]`[k - 1]`. Interned by content, so an entry pays 4 bytes for them.
pub type MetaId = u32;

/// The per-entry strings of torch ≥ 2.8 that are not torch's defaults (see [`MetaId`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct EntryMeta {
    /// `compile_context` (2.8+, with `_record_memory_history(compile_context=True)`): the top of
    /// the thread's stack of `Torch-Compiled Region…` record_function names, `'N/A'` when empty.
    pub compile_context: String,
    /// `user_metadata` (2.10+): the thread-local string `torch.cuda.memory._set_memory_metadata`
    /// set, `''` when none.
    pub user_metadata: String,
}

/// The `compile_context` torch records when no compiled region is active.
pub const NO_COMPILE_CONTEXT: &str = "N/A";

impl Default for EntryMeta {
    fn default() -> Self {
        EntryMeta { compile_context: NO_COMPILE_CONTEXT.to_owned(), user_metadata: String::new() }
    }
}

/// Interns [`EntryMeta`] values as [`MetaId`]s (what the readers use to fill
/// [`Snapshot::entry_metas`]).
#[derive(Clone, Debug, Default)]
pub struct MetaInterner {
    ids: std::collections::HashMap<EntryMeta, MetaId>,
    metas: Vec<EntryMeta>,
}

impl MetaInterner {
    /// The id of `(compile_context, user_metadata)`: 0 for torch's defaults.
    pub fn intern(&mut self, compile_context: &str, user_metadata: &str) -> MetaId {
        if compile_context == NO_COMPILE_CONTEXT && user_metadata.is_empty() {
            return 0;
        }
        let m = EntryMeta { compile_context: compile_context.to_owned(), user_metadata: user_metadata.to_owned() };
        if let Some(&id) = self.ids.get(&m) {
            return id;
        }
        self.metas.push(m.clone());
        let id = self.metas.len() as MetaId;
        self.ids.insert(m, id);
        id
    }

    /// The interned values, for [`Snapshot::entry_metas`].
    pub fn into_metas(self) -> Vec<EntryMeta> {
        self.metas
    }
}

/// One entry of the snapshot's top-level `external_annotations` (torch ≥ 2.5): what a
/// `record_function` callback recorded while memory history was on. torch 2.11 records the
/// start and the end of every `RecordScope::USER_SCOPE` function (Python's `record_function`,
/// and the optimizer's own `Optimizer.step#AdamW.step`, `Optimizer.zero_grad#…`) on the thread
/// that turned history on, or on every thread with `global_record_annotations=True`: a dict of
/// `stage` (`'START'`/`'END'`) and `name`, then `device` (the current device) and `time_us` (the
/// same clock as the trace entries' `time_us`). Kept in the recorded order (oldest first).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Annotation {
    pub device: i64,
    pub time_us: i64,
    /// The string pairs of the entry in the recorded order (every key but `device` and
    /// `time_us`). Repeated strings share one allocation.
    pub fields: Vec<(std::sync::Arc<str>, std::sync::Arc<str>)>,
}

impl Annotation {
    /// The value of string field `key`.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.fields.iter().find(|(k, _)| &**k == key).map(|(_, v)| &**v)
    }

    /// The `record_function` name.
    pub fn name(&self) -> Option<&str> {
        self.get("name")
    }

    /// `Some(true)` for `stage: 'START'`, `Some(false)` for `'END'`, else `None`.
    pub fn is_start(&self) -> Option<bool> {
        match self.get("stage")? {
            "START" => Some(true),
            "END" => Some(false),
            _ => None,
        }
    }
}

/// Interns the strings of [`Annotation`]s by content.
#[derive(Clone, Debug, Default)]
pub struct StrInterner {
    strs: std::collections::HashSet<std::sync::Arc<str>>,
}

impl StrInterner {
    pub fn intern(&mut self, s: &str) -> std::sync::Arc<str> {
        if let Some(a) = self.strs.get(s) {
            return a.clone();
        }
        let a: std::sync::Arc<str> = s.into();
        self.strs.insert(a.clone());
        a
    }
}

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
    /// `compile_context` and `user_metadata` (0: torch's defaults).
    pub meta: MetaId,
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
/// Two are equal when their settings are: [`RecordedSettings::keys`] says which release wrote
/// them, not what they are, and is compared apart where it matters.
#[derive(Clone, Debug, Default)]
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
    /// The dict's keys as recorded, in order (at most [`RecordedSettings::MAX_KEYS`]), where
    /// they are not torch 2.11's ([`RecordedSettings::TORCH_2_11_KEYS`], of which the first four
    /// may be absent, as allocsim's own pickles write them); `None` for those, or where no dict
    /// was read. Which keys a release writes tells releases apart (2.13 added
    /// `max_round_threshold`, 2.9 `graph_capture_record_stream_reuse`).
    pub keys: Option<Vec<String>>,
}

impl PartialEq for RecordedSettings {
    fn eq(&self, other: &Self) -> bool {
        // (Every field but `keys`, named so that a field added is decided here too.)
        let RecordedSettings { alloc_conf, max_split_size, garbage_collection_threshold, expandable_segments, roundup_power2_divisions, present, keys: _ } =
            self;
        *alloc_conf == other.alloc_conf
            && *max_split_size == other.max_split_size
            && *garbage_collection_threshold == other.garbage_collection_threshold
            && *expandable_segments == other.expandable_segments
            && *roundup_power2_divisions == other.roundup_power2_divisions
            && *present == other.present
    }
}

impl RecordedSettings {
    /// What torch 2.11 records when `PYTORCH_CUDA_ALLOC_CONF` is unset (its `allocator_settings`
    /// dict as read): the settings most snapshots have.
    pub fn torch_default() -> RecordedSettings {
        RecordedSettings {
            alloc_conf: Some(String::new()),
            max_split_size: Some(-1),
            garbage_collection_threshold: Some(0.0),
            expandable_segments: Some(false),
            roundup_power2_divisions: (0..16).map(|k| (1u64 << k, 0)).collect(),
            present: true,
            keys: None,
        }
    }

    /// `keys` as [`RecordedSettings::keys`] keeps them: `None` for torch 2.11's.
    pub fn keys_unless_2_11(keys: Vec<String>) -> Option<Vec<String>> {
        let k: Vec<&str> = keys.iter().map(String::as_str).collect();
        let tail = &Self::TORCH_2_11_KEYS[4..];
        let is_2_11 = k.len() >= tail.len() && k[k.len() - tail.len()..] == *tail && {
            // The first four, each present or absent, in their order.
            let mut head = Self::TORCH_2_11_KEYS[..4].iter();
            k[..k.len() - tail.len()].iter().all(|h| head.any(|x| x == h))
        };
        (!is_2_11).then_some(keys)
    }

    /// The keys of torch 2.11's `allocator_settings` (`torch/csrc/cuda/Module.cpp`), in its order.
    pub const TORCH_2_11_KEYS: [&'static str; 9] = [
        "PYTORCH_CUDA_ALLOC_CONF",
        "max_split_size",
        "garbage_collection_threshold",
        "expandable_segments",
        "pinned_num_register_threads",
        "release_lock_on_cudamalloc",
        "pinned_use_cuda_host_register",
        "graph_capture_record_stream_reuse",
        "roundup_power2_divisions",
    ];

    /// At most this many keys are kept (a release writes about ten).
    pub const MAX_KEYS: usize = 64;

    /// What torch 2.11 records with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`.
    pub fn torch_expandable() -> RecordedSettings {
        RecordedSettings { alloc_conf: Some("expandable_segments:True".into()), expandable_segments: Some(true), ..RecordedSettings::torch_default() }
    }
}

/// A stream of `(device, entry)` that can give back what it has yielded so far, for a replay
/// that starts again from the first entry ([`pickle_stream::TeeEvents`] keeps the batches it has
/// read; [`Keeping`] copies what another iterator yields).
pub trait Rewind {
    /// The entries yielded so far, in order; `None` where they were not all kept.
    fn read_so_far(&self) -> Option<impl Iterator<Item = (usize, TraceEntry)> + '_>;
    /// Keep every entry from now on (where only some are kept by default).
    fn keep_all(&mut self) {}
    /// The settings the file holds after its entries (a snapshot pickle's `allocator_settings`),
    /// once the stream has yielded every entry; `None` before, or where the stream does not say.
    fn settings_at_end(&self) -> Option<&RecordedSettings> {
        None
    }
}

/// An iterator of `(device, entry)` that keeps a copy of what it yields ([`Rewind`]).
pub struct Keeping<I> {
    inner: I,
    read: Vec<(usize, TraceEntry)>,
    /// [`Rewind::settings_at_end`] once `inner` has ended.
    at_end: Option<RecordedSettings>,
    ended: bool,
}

impl<I> Keeping<I> {
    pub fn new(inner: I) -> Keeping<I> {
        Keeping { inner, read: Vec::new(), at_end: None, ended: false }
    }

    /// [`Keeping::new`], saying `settings` once `inner` has ended (as a pickle's first pass
    /// does, [`pickle_stream::TeeEvents`]).
    pub fn with_settings_at_end(inner: I, settings: RecordedSettings) -> Keeping<I> {
        Keeping { at_end: Some(settings), ..Keeping::new(inner) }
    }
}

impl<I: Iterator<Item = Result<(usize, TraceEntry), E>>, E> Iterator for Keeping<I> {
    type Item = Result<(usize, TraceEntry), E>;
    fn next(&mut self) -> Option<Self::Item> {
        let Some(item) = self.inner.next() else {
            self.ended = true;
            return None;
        };
        if let Ok(x) = &item {
            self.read.push(*x);
        }
        Some(item)
    }
}

impl<I> Rewind for Keeping<I> {
    fn read_so_far(&self) -> Option<impl Iterator<Item = (usize, TraceEntry)> + '_> {
        Some(self.read.iter().copied())
    }
    fn settings_at_end(&self) -> Option<&RecordedSettings> {
        self.at_end.as_ref().filter(|_| self.ended)
    }
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
    /// `external_annotations`, every device's, in the recorded order.
    pub annotations: Vec<Annotation>,
    /// The distinct non-default per-entry metadata (see [`MetaId`]).
    pub entry_metas: Vec<EntryMeta>,
    /// Read from a list of segments (`torch.cuda.memory_snapshot()`): the final state only, no
    /// trace and no settings.
    pub segments_only: bool,
}

impl Snapshot {
    pub fn stack(&self, id: StackId) -> &[Frame] {
        self.stacks.get(id as usize).map(|v| v.as_slice()).unwrap_or(&[])
    }

    /// An entry's `compile_context` (`'N/A'` for [`MetaId`] 0 or an id out of range).
    pub fn compile_context(&self, id: MetaId) -> &str {
        self.meta(id).map_or(NO_COMPILE_CONTEXT, |m| &m.compile_context)
    }

    /// An entry's `user_metadata` (`''` for [`MetaId`] 0 or an id out of range).
    pub fn user_metadata(&self, id: MetaId) -> &str {
        self.meta(id).map_or("", |m| &m.user_metadata)
    }

    fn meta(&self, id: MetaId) -> Option<&EntryMeta> {
        self.entry_metas.get((id as usize).checked_sub(1)?)
    }

    /// Whether no device recorded a trace entry.
    pub fn has_no_history(&self) -> bool {
        self.device_traces.iter().all(|t| t.is_empty())
    }

    /// What a snapshot without any trace entry can and cannot tell, and how to record one that
    /// has them; `None` when some device has entries.
    pub fn no_history_note(&self) -> Option<String> {
        if !self.has_no_history() {
            return None;
        }
        let what = if self.segments_only {
            "a list of segments (torch.cuda.memory_snapshot()): the final state only, no history of allocations"
        } else {
            "a snapshot with no trace entries: memory history was not being recorded when it was taken"
        };
        Some(format!(
            "{what}; only the final state is analysed (its segments, fragmentation and the blocks pinning free memory). \
             To record the history: torch.cuda.memory._record_memory_history(max_entries=100000) before the code to \
             analyse, then torch.cuda.memory._dump_snapshot(\"snapshot.pickle\")"
        ))
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
    /// [`pickle_stream`] cannot read this file as a stream (a shape it does not know, or invalid
    /// input): read it whole, which gives the answer or the error.
    #[error("not read as a stream: {0}")]
    Unstreamable(String),
}

/// Reads a trace file: a snapshot pickle (plain or gzip'd, detected by magic bytes) or a JSON Lines
/// trace (detected by a leading `{`). A gzip'd file is decompressed as it is read. A pickle of the
/// shape torch writes is read in one pass by [`pickle_stream::PickleFile::compact`] (a fraction of
/// the time and memory of building every value of the pickle); anything else, and any file it
/// does not read, by [`read_trace_whole`], whose answer is the same.
pub fn read_trace(path: &Path) -> Result<Snapshot, TraceError> {
    if let Ok(Some(file)) = pickle_stream::PickleFile::open(path)
        && let Ok(snap) = file.compact()
    {
        return Ok(snap);
    }
    read_trace_whole(path)
}

/// [`read_trace`] by the general decoders alone: the file read into memory, a pickle decoded
/// into all its values ([`pickle`]) and then converted ([`snapshot`]). The reference the faster
/// path is tested against, and what names the problem in a file that path does not read.
///
/// The file is read as [`input::read_bounded`] reads it: in chunks, up to where the decoders
/// stop (a pickle's `STOP`, an opcode refused, a declared length over
/// [`input::MAX_VALUE_BYTES`], a byte no JSON holds), so a file of zeros is refused after its
/// first 64 KiB, plain or gzip'd.
pub fn read_trace_whole(path: &Path) -> Result<Snapshot, TraceError> {
    use std::io::Read;
    let io = |e| TraceError::Io { path: path.display().to_string(), source: e };
    let mut f = std::fs::File::open(path).map_err(io)?;
    let mut head = Vec::with_capacity(2);
    (&mut f).take(2).read_to_end(&mut head).map_err(io)?;
    let r = std::io::Read::chain(&head[..], f);
    let bytes = if input::is_gzip(&head) { gunzip_from(std::io::BufReader::with_capacity(1 << 18, r))? } else { input::read_bounded(r, false).map_err(io)?.0 };
    read_trace_bytes_whole(&bytes)
}

/// Like [`read_trace`], from bytes.
pub fn read_trace_bytes(bytes: &[u8]) -> Result<Snapshot, TraceError> {
    let raw;
    let bytes = if input::is_gzip(bytes) {
        raw = gunzip_from(bytes)?;
        &raw[..]
    } else {
        bytes
    };
    if bytes.first() == Some(&0x80)
        && let Ok(snap) = pickle_stream::PickleFile::from_bytes(bytes).compact()
    {
        return Ok(snap);
    }
    read_trace_bytes_whole(bytes)
}

/// Like [`read_trace_whole`], from bytes.
pub fn read_trace_bytes_whole(bytes: &[u8]) -> Result<Snapshot, TraceError> {
    let raw;
    let bytes = if input::is_gzip(bytes) {
        raw = gunzip_from(bytes)?;
        &raw[..]
    } else {
        bytes
    };
    let start = bytes.iter().position(|b| !b.is_ascii_whitespace()).unwrap_or(bytes.len());
    match bytes.get(start) {
        Some(b'{') if is_json_snapshot(&bytes[start..]) => snapshot::from_json(bytes),
        Some(b'{') => jsonl::read(bytes),
        Some(b'[') => snapshot::from_json(bytes),
        None if bytes.is_empty() => Err(TraceError::NotSnapshot(format!("the file is empty{}", WHAT_A_SNAPSHOT_IS))),
        None => Err(TraceError::NotSnapshot(format!("the file holds only white space{}", WHAT_A_SNAPSHOT_IS))),
        _ => snapshot::from_pickle(bytes).map_err(|e| not_a_pickle(bytes).unwrap_or(e)),
    }
}

/// What a trace file is, for the errors of a file that is none.
const WHAT_A_SNAPSHOT_IS: &str = " (a trace is what torch.cuda.memory._dump_snapshot writes, plain or gzip'd, the snapshot as JSON, or allocsim's JSON Lines)";

/// The error for bytes the pickle decoder refused that are text, not a pickle: a pickle of
/// protocol 2 or later (what `pickle.dump` writes by default, so `_dump_snapshot`) starts with
/// the `PROTO` byte 0x80, and text that is neither JSON nor JSON Lines is some other file, whatever
/// opcode its first letter happens to be ("h" is `BINGET`). `None` for anything else: the
/// decoder's own error names the byte.
fn not_a_pickle(bytes: &[u8]) -> Option<TraceError> {
    let head = &bytes[..bytes.len().min(64)];
    let text = match std::str::from_utf8(head) {
        Ok(t) => t,
        // A character cut by the 64-byte window: the text before it.
        Err(e) if e.error_len().is_none() => std::str::from_utf8(&head[..e.valid_up_to()]).ok()?,
        Err(_) => return None,
    };
    let printable = |c: char| !c.is_control() || c.is_ascii_whitespace();
    if bytes[0] == 0x80 || text.is_empty() || !text.chars().all(printable) {
        return None;
    }
    let shown: String = text.chars().take(40).map(|c| if c.is_ascii_whitespace() { ' ' } else { c }).collect();
    Some(TraceError::NotSnapshot(format!(
        "the file is text ({:?}), neither a snapshot pickle (one starts with byte 0x80) nor JSON{}",
        shown.trim_end(),
        WHAT_A_SNAPSHOT_IS
    )))
}

/// The keys of the dict `torch.cuda.memory._snapshot()` returns.
pub(crate) const SNAPSHOT_KEYS: &[&str] = &["segments", "device_traces", "allocator_settings", "external_annotations"];

/// Whether text that starts with `{` (after white space) is a snapshot saved as JSON
/// (`json.dump(torch.cuda.memory._snapshot(), f)`, what Mosaic reads) rather than allocsim's JSON
/// Lines: its first key is one of the snapshot's (a JSON Lines file starts with its header,
/// `{"format":…`, or an event), and its first line is not a JSON Lines header with its keys in
/// another order (`"format": "allocsim-trace"` within the first 4 KiB of that line, as a header
/// written by another tool may have it after `allocator_settings`). Decided from a prefix of the
/// file.
pub fn is_json_snapshot(text: &[u8]) -> bool {
    first_key_is_a_snapshots(text) && !starts_with_jsonl_header(text)
}

/// Whether the first line of `text` (its first 4 KiB) names allocsim's JSON Lines format.
fn starts_with_jsonl_header(text: &[u8]) -> bool {
    let head = &text[..text.len().min(4096)];
    let line = head.split(|&b| b == b'\n').next().unwrap_or(head);
    let key = b"\"format\"";
    let mut from = 0;
    while let Some(at) = memchr::memmem::find(&line[from..], key) {
        let rest = &line[from + at + key.len()..];
        let rest = rest.trim_ascii_start();
        if let Some(rest) = rest.strip_prefix(b":") {
            let value = rest.trim_ascii_start();
            if value.starts_with(format!("\"{}\"", jsonl::FORMAT).as_bytes()) {
                return true;
            }
        }
        from += at + key.len();
    }
    false
}

fn first_key_is_a_snapshots(text: &[u8]) -> bool {
    let mut i = 0;
    let skip = |i: &mut usize| {
        while text.get(*i).is_some_and(|b| b.is_ascii_whitespace()) {
            *i += 1;
        }
    };
    skip(&mut i);
    if text.get(i) != Some(&b'{') {
        return false;
    }
    i += 1;
    skip(&mut i);
    if text.get(i) != Some(&b'"') {
        return false;
    }
    let rest = &text[i + 1..];
    let Some(end) = rest.iter().position(|&b| b == b'"' || b == b'\\') else { return false };
    SNAPSHOT_KEYS.iter().any(|k| k.as_bytes() == &rest[..end])
}

/// The decompressed bytes of a gzip'd stream (members, zero padding: [`input::GzReader`]), read
/// as far as the decoders need them ([`input::read_bounded`]).
fn gunzip_from(r: impl std::io::BufRead) -> Result<Vec<u8>, TraceError> {
    let mut z = input::GzReader::new(r);
    let mut out_len = 0u64;
    let counted = std::io::Read::by_ref(&mut z);
    let r = CountRead { inner: counted, n: &mut out_len };
    input::read_bounded(r, true).map(|(b, _)| b).map_err(|e| TraceError::Gzip(format!("{e} (after {out_len} decompressed bytes)")))
}

/// A reader that counts what it gives.
struct CountRead<'a, R> {
    inner: R,
    n: &'a mut u64,
}

impl<R: std::io::Read> std::io::Read for CountRead<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let k = self.inner.read(buf)?;
        *self.n += k as u64;
        Ok(k)
    }
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
pub fn write_trace_to(snap: &Snapshot, format: OutputFormat, gzip: bool, out: &mut impl std::io::Write) -> std::io::Result<()> {
    fn plain(snap: &Snapshot, format: OutputFormat, out: &mut impl std::io::Write) -> std::io::Result<()> {
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
