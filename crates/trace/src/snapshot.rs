//! Converts the decoded value of `torch.cuda.memory._snapshot()` (as pickled by `_dump_snapshot`)
//! into a [`Snapshot`].
//!
//! * `device_traces[d][i]` → [`TraceEntry`] (for `oom` the address field holds `device_free`).
//!   Required keys: `action`, `addr` (`device_free` for `oom`), `size` (both default to 0 for
//!   `annotate`); `stream` and `time_us` default to 0 when absent. Unknown actions are an error
//!   naming the action and the entry.
//! * `segments` → [`SnapshotSegment`] with its `blocks` (a block without `address` gets the
//!   running sum from the segment address, like `_memory_viz.py`).
//! * `allocator_settings` → [`RecordedSettings`].
//! * a list at the top (`torch.cuda.memory_snapshot()`: segments only) → a [`Snapshot`] with
//!   those segments, every device's trace empty and [`Snapshot::segments_only`] set.
//! * [`from_json`]: the same values saved as JSON (`json.dump`).
//! * per entry, `compile_context` and `user_metadata` (torch 2.8+ / 2.10+; both `str`) →
//!   [`TraceEntry::meta`], interned; absent keys mean torch's defaults (`'N/A'`, `''`).
//! * `external_annotations` (torch 2.5+) → [`Snapshot::annotations`]: each a dict with `device`
//!   and `time_us` (ints; 0 when absent) and string pairs (`stage`, `name`), kept in order; a
//!   pair whose key or value is not a `str` is an error naming the annotation.
//! * `frames` lists are interned into [`Snapshot::stacks`]: first by the identity of the pickled
//!   list (memo sharing), then by content. Stacks are numbered in first-use order: trace entries
//!   (device by device, oldest first), then segment blocks. Segment-level `frames` are not kept.
//!
//! Streams are stored as `u64`; a negative stream (an `int64`-typed pickler) wraps.

use std::collections::HashMap;

use crate::pickle_write::PyValue;
use std::hash::{BuildHasherDefault, Hasher};

use crate::pickle::{self, Decoded, Value};
use crate::{
    Action, Annotation, BlockState, Frame, MetaId, MetaInterner, NO_COMPILE_CONTEXT, RecordedSettings, Snapshot, SnapshotBlock, SnapshotSegment, StackId,
    StrInterner, TraceEntry, TraceError,
};

/// Decodes a snapshot pickle (not gzip'd; see [`crate::read_trace_bytes`] for that).
pub fn from_pickle(bytes: &[u8]) -> Result<Snapshot, TraceError> {
    let d = pickle::decode(bytes)?;
    from_decoded(&d)
}

/// Decodes a snapshot saved as JSON (`json.dump(torch.cuda.memory._snapshot(), f)`, the form
/// Mosaic reads; or the list `torch.cuda.memory_snapshot()` returns): the same values, with
/// tuples as lists and dict keys as strings. The JSON is turned into the pickle of the same
/// Python value and decoded as one, so both forms follow one set of rules.
pub fn from_json(bytes: &[u8]) -> Result<Snapshot, TraceError> {
    use serde::de::DeserializeSeed;
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = JsonValue
        .deserialize(&mut de)
        .and_then(|v| de.end().map(|()| v))
        .map_err(|e| ns(format!("JSON: {e} (a snapshot saved with json.dump, or allocsim's JSON Lines, was expected)")))?;
    from_pickle(&crate::pickle_write::dumps(&value))
}

/// Deserializes any JSON value as the Python value `json.load` gives (keeping the order of keys).
struct JsonValue;

impl<'de> serde::de::DeserializeSeed<'de> for JsonValue {
    type Value = PyValue;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<PyValue, D::Error> {
        d.deserialize_any(JsonVisitor)
    }
}

struct JsonVisitor;

impl<'de> serde::de::Visitor<'de> for JsonVisitor {
    type Value = PyValue;
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<PyValue, E> {
        Ok(PyValue::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<PyValue, E> {
        Ok(PyValue::Int(v as i128))
    }
    fn visit_u64<E>(self, v: u64) -> Result<PyValue, E> {
        Ok(PyValue::Int(v as i128))
    }
    fn visit_f64<E>(self, v: f64) -> Result<PyValue, E> {
        Ok(PyValue::Float(v))
    }
    fn visit_str<E>(self, v: &str) -> Result<PyValue, E> {
        Ok(PyValue::Str(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<PyValue, E> {
        Ok(PyValue::Str(v))
    }
    fn visit_unit<E>(self) -> Result<PyValue, E> {
        Ok(PyValue::None)
    }
    fn visit_none<E>(self) -> Result<PyValue, E> {
        Ok(PyValue::None)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<PyValue, A::Error> {
        let mut out = Vec::new();
        while let Some(v) = seq.next_element_seed(JsonValue)? {
            out.push(v);
        }
        Ok(PyValue::List(out))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<PyValue, A::Error> {
        let mut out = Vec::new();
        while let Some(k) = map.next_key::<String>()? {
            let v = map.next_value_seed(JsonValue)?;
            out.push((PyValue::Str(k), v));
        }
        Ok(PyValue::Dict(out))
    }
}

/// Converts an already decoded pickle.
pub fn from_decoded(d: &Decoded<'_>) -> Result<Snapshot, TraceError> {
    let root = d.root();
    if let Some(items) = d.items(root).filter(|_| matches!(root, Value::List(_))) {
        return segments_only(d, items);
    }
    let Some(top) = d.dict(root) else {
        return Err(ns(format!("top-level is a {}, expected the dict returned by torch.cuda.memory._snapshot()", root.type_name())));
    };
    let (mut segments, mut traces, mut settings, mut annotations) = (None, None, None, None);
    for &(k, v) in top {
        match d.str_bytes(k) {
            Some(b"segments") => segments = Some(v),
            Some(b"device_traces") => traces = Some(v),
            Some(b"allocator_settings") => settings = Some(v),
            Some(b"external_annotations") => annotations = Some(v),
            _ => {}
        }
    }
    let Some(traces) = traces else {
        if segments.is_some_and(|s| has_history(d, s)) {
            return Err(ns("snapshot from PyTorch < 2.1 (blocks carry 'history', no 'device_traces'), which has no \
                 trace of allocations to replay; re-record with torch >= 2.1: \
                 torch.cuda.memory._record_memory_history(max_entries=100000) before the code to \
                 analyse, then torch.cuda.memory._dump_snapshot('snapshot.pickle')"));
        }
        let keys: Vec<String> = top.iter().take(12).map(|&(k, _)| d.str(k).map_or_else(|| d.depth_limited_repr(k, 1, 40), |s| format!("'{s}'"))).collect();
        return Err(ns(format!(
            "top-level dict has no 'device_traces' key (keys: [{}]); expected the dict returned by \
             torch.cuda.memory._snapshot() with memory history recorded",
            keys.join(", ")
        )));
    };

    let mut c = Conv::new(d);
    let mut snap = Snapshot { stacks: vec![Vec::new()], ..Default::default() };

    let devs = d.items(traces).ok_or_else(|| ns(format!("'device_traces' is a {}, expected a list", traces.type_name())))?;
    for (dev, &t) in devs.iter().enumerate() {
        let entries = d.items(t).ok_or_else(|| ns(format!("device_traces[{dev}] is a {}, expected a list", t.type_name())))?;
        let mut out = Vec::with_capacity(entries.len());
        for (i, &e) in entries.iter().enumerate() {
            out.push(c.entry(e, dev, i)?);
        }
        snap.device_traces.push(out);
    }

    if let Some(s) = segments {
        let segs = d.items(s).ok_or_else(|| ns(format!("'segments' is a {}, expected a list", s.type_name())))?;
        snap.segments.reserve(segs.len());
        for (i, &sv) in segs.iter().enumerate() {
            snap.segments.push(c.segment(sv, i)?);
        }
    }

    if let Some(s) = settings {
        snap.settings = c.settings(s)?;
    }
    if let Some(a) = annotations {
        snap.annotations = annotations_of(d, a)?;
    }
    snap.stacks = c.stacks;
    snap.entry_metas = c.metas.into_metas();
    Ok(snap)
}

/// A list of segments, what `torch.cuda.memory_snapshot()` returns: the final state only, no
/// trace (every device's trace empty; [`Snapshot::segments_only`]).
fn segments_only(d: &Decoded<'_>, items: &[Value]) -> Result<Snapshot, TraceError> {
    let mut c = Conv::new(d);
    let mut snap = Snapshot { stacks: vec![Vec::new()], segments_only: true, ..Default::default() };
    for (i, &sv) in items.iter().enumerate() {
        if d.dict(sv).is_none() {
            return Err(ns(format!(
                "top-level is a list whose item {i} is a {}, expected the segments torch.cuda.memory_snapshot() returns or the dict of torch.cuda.memory._snapshot()",
                sv.type_name()
            )));
        }
        snap.segments.push(c.segment(sv, i)?);
    }
    let devices = snap.segments.iter().map(|s| s.device.max(0) as usize + 1).max().unwrap_or(1);
    snap.device_traces = vec![Vec::new(); devices];
    snap.stacks = c.stacks;
    snap.entry_metas = c.metas.into_metas();
    Ok(snap)
}

/// The segments (block stacks not kept) and settings of a snapshot whose top-level values are
/// given, checked as [`from_decoded`] checks them (the annotations too), for
/// [`crate::pickle_stream`].
pub(crate) fn header_from_decoded(
    d: &Decoded<'_>,
    segments: Option<Value>,
    settings: Option<Value>,
    annotations: Option<Value>,
) -> Result<(Vec<SnapshotSegment>, RecordedSettings), TraceError> {
    let mut c = Conv::new(d);
    let mut segs_out = Vec::new();
    if let Some(s) = segments {
        let segs = d.items(s).ok_or_else(|| ns(format!("'segments' is a {}, expected a list", s.type_name())))?;
        for (i, &sv) in segs.iter().enumerate() {
            let mut seg = c.segment(sv, i)?;
            for b in &mut seg.blocks {
                b.stack = 0;
            }
            segs_out.push(seg);
        }
    }
    let settings = match settings {
        Some(s) => c.settings(s)?,
        None => RecordedSettings::default(),
    };
    if let Some(a) = annotations {
        annotations_of(d, a)?;
    }
    Ok((segs_out, settings))
}

/// What [`crate::pickle_stream::PickleFile::compact`] converts once the entries are read.
pub(crate) struct CompactHeader {
    /// For each stack the stream interned (lists of frame dicts, in order of first use): its
    /// [`StackId`].
    pub stack_ids: Vec<StackId>,
    pub stacks: Vec<Vec<Frame>>,
    pub segments: Vec<SnapshotSegment>,
    pub settings: RecordedSettings,
    pub annotations: Vec<Annotation>,
}

/// The stacks a stream interned from the entries (`stacks`: frames lists, in order of first use)
/// and the snapshot's segments, settings and annotations, converted as [`from_decoded`] converts
/// them: stacks interned in the same order (the traces' first, then the segments' blocks'), so
/// the ids are the ones [`from_decoded`] gives.
pub(crate) fn compact_header_from_decoded(
    d: &Decoded<'_>,
    stacks: &[Value],
    segments: Option<Value>,
    settings: Option<Value>,
    annotations: Option<Value>,
) -> Result<CompactHeader, TraceError> {
    let mut c = Conv::new(d);
    let mut stack_ids = Vec::with_capacity(stacks.len());
    for (i, &f) in stacks.iter().enumerate() {
        stack_ids.push(c.stack(f, &|| format!("stack {i}"))?);
    }
    let mut segs_out = Vec::new();
    if let Some(s) = segments {
        let segs = d.items(s).ok_or_else(|| ns(format!("'segments' is a {}, expected a list", s.type_name())))?;
        for (i, &sv) in segs.iter().enumerate() {
            segs_out.push(c.segment(sv, i)?);
        }
    }
    let settings = match settings {
        Some(s) => c.settings(s)?,
        None => RecordedSettings::default(),
    };
    let annotations = match annotations {
        Some(a) => annotations_of(d, a)?,
        None => Vec::new(),
    };
    Ok(CompactHeader { stack_ids, stacks: c.stacks, segments: segs_out, settings, annotations })
}

/// `external_annotations` → [`Annotation`]s (`None` is taken as an empty list).
fn annotations_of(d: &Decoded<'_>, a: Value) -> Result<Vec<Annotation>, TraceError> {
    if a == Value::None {
        return Ok(Vec::new());
    }
    let items = d.items(a).ok_or_else(|| ns(format!("'external_annotations' is a {}, expected a list", a.type_name())))?;
    let mut strs = StrInterner::default();
    let mut out = Vec::with_capacity(items.len());
    for (i, &e) in items.iter().enumerate() {
        let at = || format!("external_annotations[{i}]");
        let pairs = d.dict(e).ok_or_else(|| ns(format!("{}: a {}, expected a dict", at(), e.type_name())))?;
        let mut ann = Annotation { device: 0, time_us: 0, fields: Vec::with_capacity(pairs.len()) };
        for &(k, v) in pairs {
            let key = d.str(k).ok_or_else(|| ns(format!("{}: a key that is a {}, expected a str", at(), k.type_name())))?;
            let int = |v| i64_of(d, v).map_err(|m| ns(format!("{}['{key}']: {m}", at())));
            match key {
                "device" => ann.device = int(v)?,
                "time_us" => ann.time_us = int(v)?,
                _ => {
                    let val = d.str(v).ok_or_else(|| ns(format!("{}['{key}']: expected a str, got {}", at(), describe(d, v))))?;
                    ann.fields.push((strs.intern(key), strs.intern(val)));
                }
            }
        }
        out.push(ann);
    }
    Ok(out)
}

fn ns(msg: impl Into<String>) -> TraceError {
    TraceError::NotSnapshot(msg.into())
}

fn has_history(d: &Decoded<'_>, segments: Value) -> bool {
    d.items(segments)
        .unwrap_or(&[])
        .iter()
        .any(|&s| d.dict_get(s, "blocks").and_then(|b| d.items(b)).unwrap_or(&[]).iter().any(|&b| d.dict_get(b, "history").is_some()))
}

fn describe(d: &Decoded<'_>, v: Value) -> String {
    format!("{} {}", v.type_name(), d.depth_limited_repr(v, 2, 80))
}

fn u64_of(d: &Decoded<'_>, v: Value) -> Result<u64, String> {
    d.int_u64(v).ok_or_else(|| format!("expected an int in 0..2^64, got {}", describe(d, v)))
}

fn i64_of(d: &Decoded<'_>, v: Value) -> Result<i64, String> {
    d.int_i64(v).ok_or_else(|| format!("expected an int in the i64 range, got {}", describe(d, v)))
}

/// A stream: `u64`, negative values wrap (two's complement).
fn stream_of(d: &Decoded<'_>, v: Value) -> Result<u64, String> {
    d.int_u64(v).or_else(|| d.int_i64(v).map(|i| i as u64)).ok_or_else(|| format!("expected an int stream handle, got {}", describe(d, v)))
}

fn bool_of(d: &Decoded<'_>, v: Value) -> Result<bool, String> {
    match v {
        Value::Bool(b) => Ok(b),
        Value::Int(0) => Ok(false),
        Value::Int(1) => Ok(true),
        _ => Err(format!("expected a bool, got {}", describe(d, v))),
    }
}

// ---------------------------------------------------------------------------------------------
// Small fast hashing and a span-identity cache.

#[derive(Default, Clone, Copy)]
struct Fx(u64);

impl Fx {
    #[inline]
    fn add(&mut self, w: u64) {
        self.0 = (self.0.rotate_left(5) ^ w).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

impl Hasher for Fx {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            self.add(u64::from_le_bytes(c.try_into().unwrap_or([0; 8])));
        }
        for &b in chunks.remainder() {
            self.add(b as u64);
        }
    }
    fn write_u8(&mut self, i: u8) {
        self.add(i as u64)
    }
    fn write_u32(&mut self, i: u32) {
        self.add(i as u64)
    }
    fn write_u64(&mut self, i: u64) {
        self.add(i)
    }
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64)
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

type FxMap<K, V> = HashMap<K, V, BuildHasherDefault<Fx>>;

/// Direct-mapped cache from a string's span (its identity in the pickle: shared strings are memo
/// references to one span) to what it was classified as.
struct SpanCache<T: Copy> {
    slots: Vec<(u64, u32, T)>,
}

impl<T: Copy> SpanCache<T> {
    const N: usize = 256;
    fn new(fill: T) -> Self {
        SpanCache { slots: vec![(u64::MAX, 0, fill); Self::N] }
    }
    /// `None` when `v` is not a `str`.
    #[inline]
    fn get(&mut self, d: &Decoded<'_>, v: Value, classify: impl FnOnce(&[u8]) -> T) -> Option<T> {
        let Value::Str { start, len } = v else {
            return None;
        };
        let slot = (start.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56) as usize % Self::N;
        let (s, l, t) = self.slots[slot];
        if s == start && l == len {
            return Some(t);
        }
        let t = classify(d.str_bytes(v)?);
        self.slots[slot] = (start, len, t);
        Some(t)
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum K {
    Action,
    Addr,
    DeviceFree,
    Size,
    Stream,
    TimeUs,
    CompileContext,
    UserMetadata,
    Frames,
    Device,
    Address,
    TotalSize,
    AllocatedSize,
    ActiveSize,
    RequestedSize,
    SegmentType,
    SegmentPoolId,
    IsExpandable,
    Blocks,
    State,
    History,
    Other,
}

fn classify_key(b: &[u8]) -> K {
    match b {
        b"action" => K::Action,
        b"addr" => K::Addr,
        b"device_free" => K::DeviceFree,
        b"size" => K::Size,
        b"stream" => K::Stream,
        b"time_us" => K::TimeUs,
        b"compile_context" => K::CompileContext,
        b"user_metadata" => K::UserMetadata,
        b"frames" => K::Frames,
        b"device" => K::Device,
        b"address" => K::Address,
        b"total_size" => K::TotalSize,
        b"allocated_size" => K::AllocatedSize,
        b"active_size" => K::ActiveSize,
        b"requested_size" => K::RequestedSize,
        b"segment_type" => K::SegmentType,
        b"segment_pool_id" => K::SegmentPoolId,
        b"is_expandable" => K::IsExpandable,
        b"blocks" => K::Blocks,
        b"state" => K::State,
        b"history" => K::History,
        _ => K::Other,
    }
}

/// Action string → action; `Err(())` for an unknown string.
type ActionClass = Result<Action, ()>;

struct Conv<'d, 'a> {
    d: &'d Decoded<'a>,
    keys: SpanCache<K>,
    actions: SpanCache<ActionClass>,
    /// pickled frames list (seq id) → stack
    by_list: FxMap<u32, StackId>,
    /// pickled frame dict (dict id) → index into `frames`
    by_frame_dict: FxMap<u32, u32>,
    frames: Vec<Frame>,
    frame_index: HashMap<Frame, u32>,
    by_content: FxMap<Vec<u32>, StackId>,
    buf: Vec<u32>,
    stacks: Vec<Vec<Frame>>,
    metas: MetaInterner,
    /// (compile_context, user_metadata) bytes → id, so a repeated pair allocates nothing.
    meta_ids: FxMap<(&'d [u8], &'d [u8]), MetaId>,
}

impl<'d, 'a> Conv<'d, 'a> {
    fn new(d: &'d Decoded<'a>) -> Self {
        Conv {
            d,
            keys: SpanCache::new(K::Other),
            actions: SpanCache::new(Err(())),
            by_list: FxMap::default(),
            by_frame_dict: FxMap::default(),
            frames: Vec::new(),
            frame_index: HashMap::new(),
            by_content: FxMap::default(),
            buf: Vec::new(),
            stacks: vec![Vec::new()],
            metas: MetaInterner::default(),
            meta_ids: FxMap::default(),
        }
    }

    /// The [`MetaId`] of an entry's `compile_context` and `user_metadata` values (absent: the
    /// defaults).
    fn meta(&mut self, cc: Option<Value>, um: Option<Value>, at: &dyn Fn() -> String) -> Result<MetaId, TraceError> {
        let d = self.d;
        let text = |v: Option<Value>, name: &str, default: &'static [u8]| match v {
            None => Ok(default),
            Some(v) => d.str_bytes(v).ok_or_else(|| ns(format!("{}['{name}']: expected a str, got {}", at(), describe(d, v)))),
        };
        let cc = text(cc, "compile_context", NO_COMPILE_CONTEXT.as_bytes())?;
        let um = text(um, "user_metadata", b"")?;
        if cc == NO_COMPILE_CONTEXT.as_bytes() && um.is_empty() {
            return Ok(0);
        }
        if let Some(&id) = self.meta_ids.get(&(cc, um)) {
            return Ok(id);
        }
        fn utf8<'b>(b: &'b [u8], name: &str, at: &dyn Fn() -> String) -> Result<&'b str, TraceError> {
            std::str::from_utf8(b).map_err(|_| ns(format!("{}['{name}']: not UTF-8", at())))
        }
        let id = self.metas.intern(utf8(cc, "compile_context", at)?, utf8(um, "user_metadata", at)?);
        self.meta_ids.insert((cc, um), id);
        Ok(id)
    }

    #[inline]
    fn key(&mut self, k: Value) -> K {
        self.keys.get(self.d, k, classify_key).unwrap_or(K::Other)
    }

    fn entry(&mut self, e: Value, dev: usize, i: usize) -> Result<TraceEntry, TraceError> {
        let d = self.d;
        let at = || format!("device_traces[{dev}][{i}]");
        let pairs = d.dict(e).ok_or_else(|| ns(format!("{}: a {}, expected a dict", at(), e.type_name())))?;
        let (mut action, mut addr, mut free, mut size, mut stream, mut time, mut frames) = (None, None, None, None, None, None, None);
        let (mut cc, mut um) = (None, None);
        for &(k, v) in pairs {
            match self.key(k) {
                K::CompileContext => cc = Some(v),
                K::UserMetadata => um = Some(v),
                K::Action => action = Some(v),
                K::Addr => addr = Some(v),
                K::DeviceFree => free = Some(v),
                K::Size => size = Some(v),
                K::Stream => stream = Some(v),
                K::TimeUs => time = Some(v),
                K::Frames => frames = Some(v),
                _ => {}
            }
        }
        let av = action.ok_or_else(|| ns(format!("{}: no 'action' key", at())))?;
        let action = match self.actions.get(d, av, |b| std::str::from_utf8(b).ok().and_then(Action::parse).ok_or(())) {
            Some(Ok(a)) => a,
            Some(Err(())) => {
                return Err(ns(format!("{}: unknown action {}", at(), d.depth_limited_repr(av, 1, 80))));
            }
            None => {
                return Err(ns(format!("{}: 'action' is a {}, expected a str", at(), av.type_name())));
            }
        };
        let field = |name: &str, r: Result<u64, String>| r.map_err(|m| ns(format!("{}['{name}']: {m}", at())));
        let (aname, addr) = if action == Action::Oom { ("device_free", free.or(addr)) } else { ("addr", addr) };
        // `annotate` entries carry no allocator decision; tolerate them without addr/size.
        let lenient = action == Action::Annotate;
        let addr = match addr {
            Some(a) => field(aname, u64_of(d, a))?,
            None if lenient => 0,
            None => {
                return Err(ns(format!("{}: action '{}' without '{aname}'", at(), action.as_str())));
            }
        };
        let size = match size {
            Some(s) => field("size", u64_of(d, s))?,
            None if lenient => 0,
            None => return Err(ns(format!("{}: no 'size' key", at()))),
        };
        let stream = match stream {
            Some(s) => field("stream", stream_of(d, s))?,
            None => 0,
        };
        let time_us = match time {
            Some(t) => i64_of(d, t).map_err(|m| ns(format!("{}['time_us']: {m}", at())))?,
            None => 0,
        };
        let stack = match frames {
            Some(f) => self.stack(f, &at)?,
            None => 0,
        };
        let meta = self.meta(cc, um, &at)?;
        Ok(TraceEntry { action, addr, size, stream, time_us, stack, meta })
    }

    fn stack(&mut self, f: Value, at: &dyn Fn() -> String) -> Result<StackId, TraceError> {
        let id = match f {
            Value::List(id) | Value::Tuple(id) => id,
            Value::None => return Ok(0),
            _ => {
                return Err(ns(format!("{}['frames']: a {}, expected a list", at(), f.type_name())));
            }
        };
        if let Some(&s) = self.by_list.get(&id) {
            return Ok(s);
        }
        let d = self.d;
        let items = d.items(f).unwrap_or(&[]);
        let mut buf = std::mem::take(&mut self.buf);
        buf.clear();
        for (j, &fr) in items.iter().enumerate() {
            buf.push(self.frame(fr, &|| format!("{}['frames'][{j}]", at()))?);
        }
        let sid = if buf.is_empty() {
            0
        } else if let Some(&s) = self.by_content.get(&buf[..]) {
            s
        } else {
            let s = self.stacks.len() as StackId;
            self.stacks.push(buf.iter().map(|&i| self.frames[i as usize].clone()).collect());
            self.by_content.insert(buf.clone(), s);
            s
        };
        self.buf = buf;
        self.by_list.insert(id, sid);
        Ok(sid)
    }

    fn frame(&mut self, f: Value, at: &dyn Fn() -> String) -> Result<u32, TraceError> {
        let Value::Dict(did) = f else {
            return Err(ns(format!("{}: a {}, expected a frame dict", at(), f.type_name())));
        };
        if let Some(&i) = self.by_frame_dict.get(&did) {
            return Ok(i);
        }
        let d = self.d;
        let (mut name, mut filename, mut line) = ("", "", 0i64);
        for &(k, v) in d.dict(f).unwrap_or(&[]) {
            match d.str_bytes(k) {
                Some(b"name") => name = d.str(v).unwrap_or(""),
                Some(b"filename") => filename = d.str(v).unwrap_or(""),
                Some(b"line") => line = d.int_i64(v).unwrap_or(0),
                _ => {}
            }
        }
        let frame = Frame { name: name.to_owned(), filename: filename.to_owned(), line };
        let idx = match self.frame_index.get(&frame) {
            Some(&i) => i,
            None => {
                let i = self.frames.len() as u32;
                self.frames.push(frame.clone());
                self.frame_index.insert(frame, i);
                i
            }
        };
        self.by_frame_dict.insert(did, idx);
        Ok(idx)
    }

    fn segment(&mut self, s: Value, i: usize) -> Result<SnapshotSegment, TraceError> {
        let d = self.d;
        let at = || format!("segments[{i}]");
        let pairs = d.dict(s).ok_or_else(|| ns(format!("{}: a {}, expected a dict", at(), s.type_name())))?;
        let mut seg = SnapshotSegment {
            device: 0,
            address: 0,
            total_size: 0,
            allocated_size: 0,
            active_size: 0,
            requested_size: 0,
            stream: 0,
            is_small: false,
            pool_id: (0, 0),
            is_expandable: false,
            blocks: Vec::new(),
        };
        let mut blocks = None;
        let (mut have_addr, mut have_total) = (false, false);
        for &(k, v) in pairs {
            let key = self.key(k);
            let wrap = |name: &str, m: String| ns(format!("{}['{name}']: {m}", at()));
            match key {
                K::Device => seg.device = i64_of(d, v).map_err(|m| wrap("device", m))?,
                K::Address => {
                    seg.address = u64_of(d, v).map_err(|m| wrap("address", m))?;
                    have_addr = true;
                }
                K::TotalSize => {
                    seg.total_size = u64_of(d, v).map_err(|m| wrap("total_size", m))?;
                    have_total = true;
                }
                K::AllocatedSize => seg.allocated_size = u64_of(d, v).map_err(|m| wrap("allocated_size", m))?,
                K::ActiveSize => seg.active_size = u64_of(d, v).map_err(|m| wrap("active_size", m))?,
                K::RequestedSize => seg.requested_size = u64_of(d, v).map_err(|m| wrap("requested_size", m))?,
                K::Stream => seg.stream = stream_of(d, v).map_err(|m| wrap("stream", m))?,
                K::SegmentType => {
                    seg.is_small = match d.str(v) {
                        Some("small") => true,
                        Some("large") => false,
                        _ => {
                            return Err(wrap("segment_type", format!("expected 'small' or 'large', got {}", describe(d, v))));
                        }
                    }
                }
                K::SegmentPoolId => {
                    let p = d.items(v).filter(|p| p.len() == 2);
                    let pid = |x: Value| d.int_i64(x).or_else(|| d.int_u64(x).map(|u| u as i64));
                    match p.and_then(|p| Some((pid(p[0])?, pid(p[1])?))) {
                        Some(p) => seg.pool_id = p,
                        None => {
                            return Err(wrap("segment_pool_id", format!("expected a pair of ints, got {}", describe(d, v))));
                        }
                    }
                }
                K::IsExpandable => seg.is_expandable = bool_of(d, v).map_err(|m| wrap("is_expandable", m))?,
                K::Blocks => blocks = Some(v),
                _ => {}
            }
        }
        if !have_addr || !have_total {
            return Err(ns(format!("{}: missing 'address' or 'total_size'", at())));
        }
        if let Some(b) = blocks {
            let items = d.items(b).ok_or_else(|| ns(format!("{}['blocks']: a {}, expected a list", at(), b.type_name())))?;
            seg.blocks.reserve(items.len());
            let mut next = seg.address;
            for (j, &bv) in items.iter().enumerate() {
                let blk = self.block(bv, &|| format!("segments[{i}]['blocks'][{j}]"), next)?;
                next = blk.address.wrapping_add(blk.size);
                seg.blocks.push(blk);
            }
        }
        Ok(seg)
    }

    fn block(&mut self, b: Value, at: &dyn Fn() -> String, default_addr: u64) -> Result<SnapshotBlock, TraceError> {
        let d = self.d;
        let pairs = d.dict(b).ok_or_else(|| ns(format!("{}: a {}, expected a dict", at(), b.type_name())))?;
        let (mut address, mut size, mut requested, mut state, mut frames) = (None, None, 0, None, None);
        for &(k, v) in pairs {
            let wrap = |name: &str, m: String| ns(format!("{}['{name}']: {m}", at()));
            match self.key(k) {
                K::Address => address = Some(u64_of(d, v).map_err(|m| wrap("address", m))?),
                K::Size => size = Some(u64_of(d, v).map_err(|m| wrap("size", m))?),
                K::RequestedSize => requested = u64_of(d, v).map_err(|m| wrap("requested_size", m))?,
                K::State => {
                    state = Some(match d.str(v) {
                        Some("active_allocated") => BlockState::ActiveAllocated,
                        Some("active_pending_free") => BlockState::ActivePendingFree,
                        Some("inactive") => BlockState::Inactive,
                        _ => {
                            return Err(wrap("state", format!("unknown block state {}", describe(d, v))));
                        }
                    })
                }
                K::Frames => frames = Some(v),
                K::History => {
                    return Err(ns(format!("{}: snapshot from PyTorch < 2.1 (blocks carry 'history'); re-record with torch>=2.1", at())));
                }
                _ => {}
            }
        }
        let size = size.ok_or_else(|| ns(format!("{}: no 'size' key", at())))?;
        let state = state.ok_or_else(|| ns(format!("{}: no 'state' key", at())))?;
        let stack = match frames {
            Some(f) => self.stack(f, at)?,
            None => 0,
        };
        Ok(SnapshotBlock { address: address.unwrap_or(default_addr), size, requested_size: requested, state, stack })
    }

    fn settings(&mut self, s: Value) -> Result<RecordedSettings, TraceError> {
        let d = self.d;
        let pairs = d.dict(s).ok_or_else(|| ns(format!("'allocator_settings' is a {}, expected a dict", s.type_name())))?;
        let mut r = RecordedSettings { present: true, ..Default::default() };
        let wrap = |name: &str, m: String| ns(format!("allocator_settings['{name}']: {m}"));
        let mut keys: Vec<String> = Vec::new();
        for &(k, v) in pairs {
            if keys.len() < RecordedSettings::MAX_KEYS
                && let Some(b) = d.str_bytes(k)
            {
                keys.push(String::from_utf8_lossy(b).into_owned());
            }
            match d.str_bytes(k) {
                Some(b"PYTORCH_CUDA_ALLOC_CONF") => match v {
                    Value::None => r.alloc_conf = None,
                    _ => {
                        let s = d.str(v).ok_or_else(|| wrap("PYTORCH_CUDA_ALLOC_CONF", format!("expected a str, got {}", describe(d, v))))?;
                        r.alloc_conf = Some(s.to_owned());
                    }
                },
                Some(b"max_split_size") => r.max_split_size = Some(i64_of(d, v).map_err(|m| wrap("max_split_size", m))?),
                Some(b"garbage_collection_threshold") => {
                    r.garbage_collection_threshold = Some(match v {
                        Value::Float(f) => f,
                        Value::Int(i) => i as f64,
                        _ => {
                            return Err(wrap("garbage_collection_threshold", format!("expected a float, got {}", describe(d, v))));
                        }
                    })
                }
                Some(b"expandable_segments") => r.expandable_segments = Some(bool_of(d, v).map_err(|m| wrap("expandable_segments", m))?),
                Some(b"roundup_power2_divisions") => {
                    r.roundup_power2_divisions = match v {
                        Value::Dict(_) => {
                            let mut out = Vec::new();
                            for &(k, x) in d.dict(v).unwrap_or(&[]) {
                                let start = d
                                    .str(k)
                                    .and_then(|s| s.parse::<u64>().ok())
                                    .or_else(|| d.int_u64(k))
                                    .ok_or_else(|| wrap("roundup_power2_divisions", format!("bad key {}", describe(d, k))))?;
                                out.push((start, u64_of(d, x).map_err(|m| wrap("roundup_power2_divisions", m))?));
                            }
                            out
                        }
                        // A list indexed by log2(interval start in MB), the C++ vector's layout.
                        Value::List(_) | Value::Tuple(_) => {
                            let mut out = Vec::new();
                            for (j, &x) in d.items(v).unwrap_or(&[]).iter().enumerate().take(64) {
                                out.push((1u64 << j, u64_of(d, x).map_err(|m| wrap("roundup_power2_divisions", m))?));
                            }
                            out
                        }
                        _ => {
                            return Err(wrap("roundup_power2_divisions", format!("expected a dict, got {}", describe(d, v))));
                        }
                    }
                }
                _ => {}
            }
        }
        r.keys = RecordedSettings::keys_unless_2_11(keys);
        Ok(r)
    }
}

// ---------------------------------------------------------------------------------------------
// Writing

/// Pickles `snap` in the shape `torch.cuda.memory._snapshot()` of torch 2.11 returns and
/// `torch.cuda.memory._dump_snapshot` writes (protocol 4, framed, builtin types only); see
/// `allocator-spec.md` §10 for the layout. Keys and their order:
///
/// * top level: `segments`, `device_traces`, `allocator_settings` (omitted when
///   [`RecordedSettings::present`] is false), `external_annotations` ([`Snapshot::annotations`]:
///   each a dict of its string pairs in order, then `device` and `time_us`, as torch writes it).
/// * segment: `device`, `address`, `total_size`, `allocated_size`, `active_size`,
///   `requested_size`, `stream`, `segment_type` (`'large'`/`'small'`), `segment_pool_id` (a
///   tuple), `is_expandable`, `frames` (`[]`), `blocks`.
/// * block: `address`, `size`, `requested_size`, `state`, `frames` (`[]` when no stack).
/// * trace entry: `action`, `addr` (`device_free` for `oom`), `size`, `stream`, `time_us`,
///   `compile_context` (`'N/A'` unless [`TraceEntry::meta`] says otherwise), `user_metadata`
///   (`''` unless…), and `frames` only when the entry has a stack.
/// * `allocator_settings`: `PYTORCH_CUDA_ALLOC_CONF`, `max_split_size`,
///   `garbage_collection_threshold`, `expandable_segments` (each only when recorded), then the
///   2.11 keys a [`Snapshot`] does not keep, with torch's defaults: `pinned_num_register_threads`
///   (1), `release_lock_on_cudamalloc`, `pinned_use_cuda_host_register`,
///   `graph_capture_record_stream_reuse` (False), and last `roundup_power2_divisions` (a dict of
///   decimal-string keys, in the recorded order).
///
/// Streams are written as signed 64-bit ints (torch's `int64_t(stream)`), addresses and sizes as
/// unsigned. As in torch's own snapshots, each stack is one list object shared by every entry and
/// block that uses it, equal frames are one dict object, all empty `frames` are one list, keys
/// and other repeated strings are memoized, while each frame dict has its own name and filename
/// strings, each entry its own `compile_context` and non-empty `user_metadata`, and each
/// annotation its own keys and values, except where CPython shares one object for equal strings
/// (the empty string and one-character Latin-1 strings) — so a snapshot without stacks is written
/// back byte for byte. The opcodes used are all among those MemoryViz.js's unpickler reads.
/// Segment-level stacks are not kept in a [`Snapshot`], so segment `frames` are always `[]`.
///
/// `from_pickle(&to_pickle(s)) == s` for every `s` that [`from_pickle`] or
/// [`crate::jsonl::read`] returned.
pub fn to_pickle(snap: &Snapshot) -> Vec<u8> {
    use crate::pickle_write::Pickler;

    let entries: usize = snap.device_traces.iter().map(Vec::len).sum();
    let blocks: usize = snap.segments.iter().map(|s| s.blocks.len()).sum();
    let mut p = Pickler::with_capacity(40 * entries + 60 * blocks + 4096);
    let mut w = Writer { snap, stacks: vec![None; snap.stacks.len()], frames: HashMap::new(), empty_frames: None };
    let keys: &[u8] = if snap.settings.present { &[0, 1, 2, 3] } else { &[0, 1, 3] };
    p.dict(keys, |p, &k| match k {
        0 => {
            p.str("segments");
            p.list(&snap.segments, |p, s| w.segment(p, s));
        }
        1 => {
            p.str("device_traces");
            p.list(&snap.device_traces, |p, t| {
                p.list(t, |p, e| w.entry(p, e));
            });
        }
        2 => {
            p.str("allocator_settings");
            settings(p, &snap.settings);
        }
        _ => {
            p.str("external_annotations");
            p.list(&snap.annotations, annotation);
        }
    });
    p.finish()
}

/// A string torch makes a new Python object for each time (a `py::str` from a `std::string`):
/// CPython still returns its shared object for the empty string and one-character Latin-1
/// strings, which the pickler then memoizes.
fn fresh_str(p: &mut crate::pickle_write::Pickler, s: &str) {
    let mut chars = s.chars();
    let shared = match (chars.next(), chars.next()) {
        (None, _) => true,
        (Some(c), None) => (c as u32) < 256,
        _ => false,
    };
    if shared {
        p.str(s);
    } else {
        p.str_new_object(s);
    }
}

fn annotation(p: &mut crate::pickle_write::Pickler, a: &Annotation) {
    let n = a.fields.len();
    p.dict(0..n + 2, |p, i| {
        if let Some((k, v)) = a.fields.get(i) {
            fresh_str(p, k);
            fresh_str(p, v);
        } else if i == n {
            p.str("device");
            p.int(a.device);
        } else {
            p.str("time_us");
            p.int(a.time_us);
        }
    });
}

struct Writer<'s> {
    snap: &'s Snapshot,
    /// Memo id of each stack's list, once written.
    stacks: Vec<Option<crate::pickle_write::MemoId>>,
    frames: HashMap<&'s Frame, crate::pickle_write::MemoId>,
    /// The one empty list every frame-less segment and block shares (as in torch's snapshots).
    empty_frames: Option<crate::pickle_write::MemoId>,
}

fn state_str(s: BlockState) -> &'static str {
    match s {
        BlockState::ActiveAllocated => "active_allocated",
        BlockState::ActivePendingFree => "active_pending_free",
        BlockState::Inactive => "inactive",
    }
}

impl<'s> Writer<'s> {
    fn segment(&mut self, p: &mut crate::pickle_write::Pickler, s: &SnapshotSegment) {
        p.dict(0..12u8, |p, i| match i {
            0 => {
                p.str("device");
                p.int(s.device);
            }
            1 => {
                p.str("address");
                p.uint(s.address);
            }
            2 => {
                p.str("total_size");
                p.uint(s.total_size);
            }
            3 => {
                p.str("allocated_size");
                p.uint(s.allocated_size);
            }
            4 => {
                p.str("active_size");
                p.uint(s.active_size);
            }
            5 => {
                p.str("requested_size");
                p.uint(s.requested_size);
            }
            6 => {
                p.str("stream");
                p.int(s.stream as i64);
            }
            7 => {
                p.str("segment_type");
                p.str(if s.is_small { "small" } else { "large" });
            }
            8 => {
                p.str("segment_pool_id");
                p.tuple([s.pool_id.0, s.pool_id.1], |p, x| p.int(x));
            }
            9 => {
                p.str("is_expandable");
                p.bool(s.is_expandable);
            }
            10 => {
                p.str("frames");
                self.stack(p, 0);
            }
            _ => {
                p.str("blocks");
                p.list(&s.blocks, |p, b| self.block(p, b));
            }
        });
    }

    fn block(&mut self, p: &mut crate::pickle_write::Pickler, b: &SnapshotBlock) {
        p.dict(0..5u8, |p, i| match i {
            0 => {
                p.str("address");
                p.uint(b.address);
            }
            1 => {
                p.str("size");
                p.uint(b.size);
            }
            2 => {
                p.str("requested_size");
                p.uint(b.requested_size);
            }
            3 => {
                p.str("state");
                p.str(state_str(b.state));
            }
            _ => {
                p.str("frames");
                self.stack(p, b.stack);
            }
        });
    }

    fn entry(&mut self, p: &mut crate::pickle_write::Pickler, e: &TraceEntry) {
        let has_stack = !self.snap.stack(e.stack).is_empty();
        let n = 7 + has_stack as u8;
        p.dict(0..n, |p, i| match i {
            0 => {
                p.str("action");
                p.str(e.action.as_str());
            }
            1 => {
                let key = if e.action == Action::Oom { "device_free" } else { "addr" };
                p.str(key);
                p.uint(e.addr);
            }
            2 => {
                p.str("size");
                p.uint(e.size);
            }
            3 => {
                p.str("stream");
                p.int(e.stream as i64);
            }
            4 => {
                p.str("time_us");
                p.int(e.time_us);
            }
            5 => {
                p.str("compile_context");
                // torch makes a new string for every entry
                fresh_str(p, self.snap.compile_context(e.meta));
            }
            6 => {
                p.str("user_metadata");
                fresh_str(p, self.snap.user_metadata(e.meta));
            }
            _ => {
                p.str("frames");
                self.stack(p, e.stack);
            }
        });
    }

    /// A stack's frames list: written once, referenced (BINGET) afterwards.
    fn stack(&mut self, p: &mut crate::pickle_write::Pickler, id: StackId) {
        let frames = self.snap.stack(id);
        if frames.is_empty() {
            match self.empty_frames {
                Some(m) => p.get(m),
                None => self.empty_frames = p.list(std::iter::empty::<()>(), |_, _| {}),
            }
            return;
        }
        if let Some(m) = self.stacks[id as usize] {
            p.get(m);
            return;
        }
        let memo = &mut self.frames;
        let m = p.list(frames, |p, f| {
            if let Some(&m) = memo.get(f) {
                p.get(m);
                return;
            }
            let m = p.dict(0..3u8, |p, i| match i {
                0 => {
                    p.str("name");
                    p.str_new_object(&f.name);
                }
                1 => {
                    p.str("filename");
                    p.str_new_object(&f.filename);
                }
                _ => {
                    p.str("line");
                    p.int(f.line);
                }
            });
            if let Some(m) = m {
                memo.insert(f, m);
            }
        });
        self.stacks[id as usize] = m;
    }
}

fn settings(p: &mut crate::pickle_write::Pickler, s: &RecordedSettings) {
    let mut keys: Vec<u8> = Vec::with_capacity(9);
    if s.alloc_conf.is_some() {
        keys.push(0);
    }
    if s.max_split_size.is_some() {
        keys.push(1);
    }
    if s.garbage_collection_threshold.is_some() {
        keys.push(2);
    }
    if s.expandable_segments.is_some() {
        keys.push(3);
    }
    keys.extend_from_slice(&[4, 5, 6, 7, 8]);
    p.dict(keys, |p, k| match k {
        0 => {
            p.str("PYTORCH_CUDA_ALLOC_CONF");
            p.str(s.alloc_conf.as_deref().unwrap_or(""));
        }
        1 => {
            p.str("max_split_size");
            p.int(s.max_split_size.unwrap_or(-1));
        }
        2 => {
            p.str("garbage_collection_threshold");
            p.float(s.garbage_collection_threshold.unwrap_or(0.0));
        }
        3 => {
            p.str("expandable_segments");
            p.bool(s.expandable_segments.unwrap_or(false));
        }
        4 => {
            p.str("pinned_num_register_threads");
            p.int(1);
        }
        5 => {
            p.str("release_lock_on_cudamalloc");
            p.bool(false);
        }
        6 => {
            p.str("pinned_use_cuda_host_register");
            p.bool(false);
        }
        7 => {
            p.str("graph_capture_record_stream_reuse");
            p.bool(false);
        }
        _ => {
            p.str("roundup_power2_divisions");
            p.dict(&s.roundup_power2_divisions, |p, &(start, div)| {
                p.str(&start.to_string());
                p.uint(div);
            });
        }
    });
}
