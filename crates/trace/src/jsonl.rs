//! allocsim's own trace format: JSON Lines. This comment is the specification.
//!
//! A file is UTF-8 text, one JSON object per line (`\n` or `\r\n` line ends; blank lines are
//! ignored). Readers ignore keys they do not know, so later versions may add keys.
//!
//! # Line 1: the header
//!
//! ```json
//! {"format":"allocsim-trace","version":1,"devices":1,
//!  "allocator_settings":{"PYTORCH_CUDA_ALLOC_CONF":"","max_split_size":-1,
//!                        "garbage_collection_threshold":0.0,"expandable_segments":false,
//!                        "roundup_power2_divisions":{"1":0,"2":0,"4":0}}}
//! ```
//!
//! * `format` must be `"allocsim-trace"` and `version` must be `1`.
//! * `devices` (optional): the number of devices, i.e. of per-device traces. Events must name a
//!   device below it. When absent, the number is one more than the highest device seen.
//! * `allocator_settings` (optional; absent = the trace recorded no settings): the keys of a torch
//!   snapshot's `allocator_settings`, each optional: `PYTORCH_CUDA_ALLOC_CONF` (string),
//!   `max_split_size` (integer bytes, −1 = unlimited), `garbage_collection_threshold` (number),
//!   `expandable_segments` (bool), `roundup_power2_divisions` (object: interval start in MB as a
//!   decimal string → divisions; the order of the keys is kept).
//!
//! # Event lines
//!
//! One per trace entry, oldest first within a device (lines of different devices may interleave):
//!
//! ```json
//! {"device":0,"action":"alloc","addr":139919842344960,"size":6291456,"stream":0,"time_us":1796208315567807,
//!  "frames":[{"name":"w_frag","filename":"gpu/record.py","line":56}]}
//! ```
//!
//! * `action`: one of PyTorch's trace actions: `alloc`, `free_requested`, `free_completed`,
//!   `segment_alloc`, `segment_free`, `segment_map`, `segment_unmap`, `oom`, `snapshot`, `annotate`.
//! * `addr`: block or segment address (unsigned 64-bit). For `oom` the line carries
//!   `device_free` (bytes free on the device) instead, as PyTorch does.
//! * `size` (required): bytes, as in the PyTorch trace entry.
//! * `device` (default 0), `stream` (raw `cudaStream_t` as unsigned 64-bit, default 0),
//!   `time_us` (signed 64-bit, default 0).
//! * `frames` (optional, absent = no stack): the stack, innermost frame first, each
//!   `{"name","filename","line"}` (all three required).
//! * `compile_context` (string, default `"N/A"`) and `user_metadata` (string, default `""`):
//!   torch's per-entry strings (2.8+ / 2.10+); written only when not the default.
//!
//! # Annotation lines (optional)
//!
//! A snapshot's `external_annotations` (torch 2.5+: the start and end of `record_function`
//! scopes, such as the optimizer's `Optimizer.step#AdamW.step`), one line each, in the recorded
//! order:
//!
//! ```json
//! {"annotation":{"stage":"START","name":"Optimizer.step#AdamW.step","device":0,"time_us":1796208798586821}}
//! ```
//!
//! * `device` and `time_us` (integers, default 0); every other key is a string field, kept in the
//!   order written (torch records `stage`, `"START"` or `"END"`, and `name`).
//! * [`write()`] puts them after the events and before the segments; a reader takes them
//!   anywhere after the header.
//!
//! # Segment lines (optional)
//!
//! After the events, the allocator's final state, one line per segment, in the order of a torch
//! snapshot's `segments`:
//!
//! ```json
//! {"segment":{"device":0,"address":139916008751104,"total_size":20971520,"allocated_size":0,
//!   "active_size":0,"requested_size":0,"stream":0,"segment_type":"large","segment_pool_id":[0,0],
//!   "is_expandable":false,"blocks":[{"address":139916008751104,"size":20971520,
//!   "requested_size":6291456,"state":"inactive"}]}}
//! ```
//!
//! * `address` and `total_size` are required; `device`, `allocated_size`, `active_size`,
//!   `requested_size`, `stream` default to 0, `segment_type` (`"large"`/`"small"`) to `"large"`,
//!   `segment_pool_id` to `[0,0]`, `is_expandable` to false, `blocks` to `[]`.
//! * A block needs `address`, `size` and `state` (`"active_allocated"`, `"active_pending_free"`,
//!   `"inactive"`); `requested_size` defaults to 0; `frames` as for events.
//!
//! # Stacks
//!
//! Stacks are written inline. A reader interns them by content in first-use order (events in file
//! order, then segment blocks), and likewise the events' `compile_context`/`user_metadata` pairs;
//! [`write()`] emits device 0's events first, then device 1's, …, so reading what [`write()`]
//! wrote gives back an equal [`Snapshot`] whenever its stacks and metadata are numbered that way
//! (as [`crate::snapshot::from_pickle`] and [`read()`] number them).

use std::borrow::Cow;
use std::collections::HashMap;
use std::io::Write;

use serde::de::{MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::{
    Action, Annotation, BlockState, EntryMeta, Frame, MetaInterner, NO_COMPILE_CONTEXT, RecordedSettings, Snapshot, SnapshotBlock, SnapshotSegment, StackId,
    StrInterner, TraceEntry, TraceError,
};

pub const FORMAT: &str = "allocsim-trace";
pub const VERSION: u64 = 1;

// ---------------------------------------------------------------------------------------------
// Reading

#[derive(Deserialize)]
struct Line<'a> {
    #[serde(borrow, default)]
    format: Option<Cow<'a, str>>,
    #[serde(default)]
    version: Option<u64>,
    #[serde(default)]
    devices: Option<usize>,
    // Boxed (like `segment`): rare, and large enough that moving the parsed line would cost.
    #[serde(default)]
    allocator_settings: Option<Box<SettingsIn>>,
    #[serde(default)]
    device: Option<usize>,
    #[serde(borrow, default)]
    action: Option<Cow<'a, str>>,
    #[serde(default)]
    addr: Option<u64>,
    #[serde(default)]
    device_free: Option<u64>,
    #[serde(default)]
    size: Option<u64>,
    #[serde(default)]
    stream: Option<u64>,
    #[serde(default)]
    time_us: Option<i64>,
    #[serde(default)]
    frames: Option<Vec<Frame>>,
    #[serde(borrow, default)]
    compile_context: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    user_metadata: Option<Cow<'a, str>>,
    #[serde(default)]
    segment: Option<Box<SegmentIn>>,
    #[serde(default)]
    annotation: Option<Box<AnnotationIn>>,
}

/// An annotation object read in key order: `device`, `time_us` and the string fields.
struct AnnotationIn {
    device: i64,
    time_us: i64,
    fields: Vec<(String, String)>,
}

impl<'de> Deserialize<'de> for AnnotationIn {
    fn deserialize<D: Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = AnnotationIn;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object of string fields with integer \"device\" and \"time_us\"")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Self::Value, A::Error> {
                let mut out = AnnotationIn { device: 0, time_us: 0, fields: Vec::new() };
                while let Some(k) = m.next_key::<Cow<'de, str>>()? {
                    match &*k {
                        "device" => out.device = m.next_value()?,
                        "time_us" => out.time_us = m.next_value()?,
                        _ => {
                            let v = m.next_value::<Cow<'de, str>>().map_err(|e| serde::de::Error::custom(format!("annotation field {k:?}: {e}")))?;
                            out.fields.push((k.into_owned(), v.into_owned()));
                        }
                    }
                }
                Ok(out)
            }
        }
        de.deserialize_map(V)
    }
}

#[derive(Deserialize)]
struct SettingsIn {
    #[serde(rename = "PYTORCH_CUDA_ALLOC_CONF", default)]
    alloc_conf: Option<String>,
    #[serde(default)]
    max_split_size: Option<i64>,
    #[serde(default)]
    garbage_collection_threshold: Option<f64>,
    #[serde(default)]
    expandable_segments: Option<bool>,
    #[serde(default)]
    roundup_power2_divisions: Option<OrderedDivisions>,
}

/// `{"1":0,"2":4,…}` read in file order.
struct OrderedDivisions(Vec<(u64, u64)>);

impl<'de> Deserialize<'de> for OrderedDivisions {
    fn deserialize<D: Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = OrderedDivisions;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object mapping interval start in MB (decimal string) to divisions")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Self::Value, A::Error> {
                let mut out = Vec::new();
                while let Some((k, v)) = m.next_entry::<Cow<'de, str>, u64>()? {
                    let k = k.parse::<u64>().map_err(|_| serde::de::Error::custom(format!("roundup_power2_divisions key {k:?} is not an integer")))?;
                    out.push((k, v));
                }
                Ok(OrderedDivisions(out))
            }
        }
        de.deserialize_map(V)
    }
}

fn default_large() -> String {
    "large".to_owned()
}

#[derive(Deserialize)]
struct SegmentIn {
    #[serde(default)]
    device: i64,
    address: u64,
    total_size: u64,
    #[serde(default)]
    allocated_size: u64,
    #[serde(default)]
    active_size: u64,
    #[serde(default)]
    requested_size: u64,
    #[serde(default)]
    stream: u64,
    #[serde(default = "default_large")]
    segment_type: String,
    #[serde(default)]
    segment_pool_id: (i64, i64),
    #[serde(default)]
    is_expandable: bool,
    #[serde(default)]
    blocks: Vec<BlockIn>,
}

#[derive(Deserialize)]
struct BlockIn {
    address: u64,
    size: u64,
    #[serde(default)]
    requested_size: u64,
    state: String,
    #[serde(default)]
    frames: Option<Vec<Frame>>,
}

fn parse_state(s: &str) -> Option<BlockState> {
    Some(match s {
        "active_allocated" => BlockState::ActiveAllocated,
        "active_pending_free" => BlockState::ActivePendingFree,
        "inactive" => BlockState::Inactive,
        _ => return None,
    })
}

fn state_str(s: BlockState) -> &'static str {
    match s {
        BlockState::ActiveAllocated => "active_allocated",
        BlockState::ActivePendingFree => "active_pending_free",
        BlockState::Inactive => "inactive",
    }
}

#[derive(Default)]
struct Interner {
    map: HashMap<Vec<Frame>, StackId>,
    stacks: Vec<Vec<Frame>>,
}

impl Interner {
    fn intern(&mut self, frames: Option<Vec<Frame>>) -> StackId {
        let Some(f) = frames.filter(|f| !f.is_empty()) else {
            return 0;
        };
        if let Some(&s) = self.map.get(&f) {
            return s;
        }
        let s = self.stacks.len() as StackId;
        self.stacks.push(f.clone());
        self.map.insert(f, s);
        s
    }
}

/// The header line: the number of devices it declares and the recorded settings.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Header {
    pub devices: Option<usize>,
    pub settings: RecordedSettings,
}

/// One line of a JSON Lines trace.
#[derive(Clone, Debug, PartialEq)]
pub enum Parsed {
    /// An empty or whitespace-only line.
    Blank,
    Header(Header),
    Event {
        device: usize,
        entry: TraceEntry,
    },
    Segment(SnapshotSegment),
    Annotation(Annotation),
}

/// What a [`LineParser`] interned over a whole file.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Tables {
    /// `stacks[0]` is the empty stack (just that one when stacks are not kept).
    pub stacks: Vec<Vec<Frame>>,
    /// See [`Snapshot::entry_metas`] (empty when not kept).
    pub entry_metas: Vec<EntryMeta>,
}

/// Parses a JSON Lines trace line by line (the one parser behind [`read`],
/// [`crate::jsonl_stream::Events`] and [`crate::jsonl_stream::scan`]): it checks the header comes
/// first, that events name a declared device, and interns stacks and per-entry metadata when
/// asked to (else every `stack` and `meta` is 0, and frames are only checked).
pub struct LineParser {
    saw_header: bool,
    devices: Option<usize>,
    stacks: Option<Interner>,
    metas: Option<MetaInterner>,
    strs: StrInterner,
}

impl LineParser {
    /// `keep_stacks`: intern the frames of events and blocks and the events' `compile_context` and
    /// `user_metadata` (else frames are checked and dropped, and metadata dropped).
    pub fn new(keep_stacks: bool) -> LineParser {
        let stacks = keep_stacks.then(|| Interner { stacks: vec![Vec::new()], ..Default::default() });
        LineParser { saw_header: false, devices: None, stacks, metas: keep_stacks.then(MetaInterner::default), strs: StrInterner::default() }
    }

    fn intern(&mut self, frames: Option<Vec<Frame>>) -> StackId {
        match &mut self.stacks {
            Some(i) => i.intern(frames),
            None => 0,
        }
    }

    /// Parses line `lineno` (1-based; for errors), without its `\n` (a trailing `\r` is allowed).
    pub fn parse(&mut self, raw: &[u8], lineno: usize) -> Result<Parsed, TraceError> {
        let err = |msg: String| TraceError::Jsonl { line: lineno, msg };
        let line = raw.strip_suffix(b"\r").unwrap_or(raw);
        if line.iter().all(u8::is_ascii_whitespace) {
            return Ok(Parsed::Blank);
        }
        let l: Line<'_> = serde_json::from_slice(line).map_err(|e| {
            if !self.saw_header && e.classify() == serde_json::error::Category::Eof && memchr::memmem::find(line, b"\"format\"").is_none() {
                err(format!("an unfinished JSON object ({e}): a JSON Lines trace holds one whole object per line, its header first; a JSON document spread over lines is read only as a snapshot, whose first key is one of {}, and this one's is not (the .json written beside a recording is its metadata, not a trace)", crate::SNAPSHOT_KEYS.join(", ")))
            } else {
                err(e.to_string())
            }
        })?;
        if !self.saw_header {
            match l.format.as_deref() {
                Some(FORMAT) => {}
                Some(f) => return Err(err(format!("format is {f:?}, expected {FORMAT:?}"))),
                None => {
                    return Err(err(format!("the first line must be the header {{\"format\":\"{FORMAT}\",\"version\":{VERSION},…}}")));
                }
            }
            match l.version {
                Some(VERSION) => {}
                v => {
                    return Err(err(format!("unsupported version {v:?}; this reader reads version {VERSION}")));
                }
            }
            if let Some(n) = l.devices
                && n > 1 << 16
            {
                return Err(err(format!("implausible number of devices {n}")));
            }
            self.devices = l.devices;
            let mut h = Header { devices: l.devices, ..Default::default() };
            if let Some(s) = l.allocator_settings {
                h.settings = RecordedSettings {
                    alloc_conf: s.alloc_conf,
                    max_split_size: s.max_split_size,
                    garbage_collection_threshold: s.garbage_collection_threshold,
                    expandable_segments: s.expandable_segments,
                    roundup_power2_divisions: s.roundup_power2_divisions.map(|d| d.0).unwrap_or_default(),
                    present: true,
                    keys: None,
                };
            }
            self.saw_header = true;
            return Ok(Parsed::Header(h));
        }
        if l.format.is_some() {
            return Err(err("a second header line".into()));
        }
        if let Some(a) = l.annotation {
            let fields = a.fields.iter().map(|(k, v)| (self.strs.intern(k), self.strs.intern(v))).collect();
            return Ok(Parsed::Annotation(Annotation { device: a.device, time_us: a.time_us, fields }));
        }
        if let Some(s) = l.segment {
            let s = *s;
            let is_small = match s.segment_type.as_str() {
                "small" => true,
                "large" => false,
                t => {
                    return Err(err(format!("segment_type {t:?}, expected \"small\" or \"large\"")));
                }
            };
            let mut blocks = Vec::with_capacity(s.blocks.len());
            for (j, b) in s.blocks.into_iter().enumerate() {
                let state = parse_state(&b.state).ok_or_else(|| err(format!("blocks[{j}]: unknown state {:?}", b.state)))?;
                blocks.push(SnapshotBlock { address: b.address, size: b.size, requested_size: b.requested_size, state, stack: self.intern(b.frames) });
            }
            return Ok(Parsed::Segment(SnapshotSegment {
                device: s.device,
                address: s.address,
                total_size: s.total_size,
                allocated_size: s.allocated_size,
                active_size: s.active_size,
                requested_size: s.requested_size,
                stream: s.stream,
                is_small,
                pool_id: s.segment_pool_id,
                is_expandable: s.is_expandable,
                blocks,
            }));
        }
        let Some(a) = l.action else {
            return Err(err("neither an event (no \"action\") nor a segment line (no \"segment\")".into()));
        };
        let action = Action::parse(&a).ok_or_else(|| err(format!("unknown action {a:?}")))?;
        let dev = l.device.unwrap_or(0);
        let addr = if action == Action::Oom {
            l.device_free.or(l.addr).ok_or_else(|| err("an oom event needs \"device_free\"".into()))?
        } else {
            l.addr.ok_or_else(|| err(format!("a {} event needs \"addr\"", action.as_str())))?
        };
        let size = l.size.ok_or_else(|| err("an event needs \"size\"".into()))?;
        match self.devices {
            Some(n) if dev >= n => {
                return Err(err(format!("device {dev}, but the header declares {n} device(s)")));
            }
            None if dev >= 1 << 16 => return Err(err(format!("implausible device {dev}"))),
            _ => {}
        }
        let meta = match &mut self.metas {
            Some(m) => m.intern(l.compile_context.as_deref().unwrap_or(NO_COMPILE_CONTEXT), l.user_metadata.as_deref().unwrap_or("")),
            None => 0,
        };
        Ok(Parsed::Event {
            device: dev,
            entry: TraceEntry { action, addr, size, stream: l.stream.unwrap_or(0), time_us: l.time_us.unwrap_or(0), stack: self.intern(l.frames), meta },
        })
    }

    /// The end of the input: an error if there was no header; else what was interned.
    pub fn finish(self) -> Result<Tables, TraceError> {
        if !self.saw_header {
            return Err(TraceError::Jsonl { line: 1, msg: "empty file (no header line)".into() });
        }
        Ok(Tables {
            stacks: self.stacks.map_or_else(|| vec![Vec::new()], |i| i.stacks),
            entry_metas: self.metas.map(MetaInterner::into_metas).unwrap_or_default(),
        })
    }
}

/// Reads a JSON Lines trace. Errors carry the 1-based line number.
pub fn read(bytes: &[u8]) -> Result<Snapshot, TraceError> {
    let mut snap = Snapshot::default();
    let mut parser = LineParser::new(true);
    for (i, raw) in bytes.split(|&b| b == b'\n').enumerate() {
        match parser.parse(raw, i + 1)? {
            Parsed::Blank => {}
            Parsed::Header(h) => {
                if let Some(n) = h.devices {
                    snap.device_traces = vec![Vec::new(); n];
                }
                snap.settings = h.settings;
            }
            Parsed::Segment(s) => snap.segments.push(s),
            Parsed::Annotation(a) => snap.annotations.push(a),
            Parsed::Event { device, entry } => {
                if snap.device_traces.len() <= device {
                    snap.device_traces.resize_with(device + 1, Vec::new);
                }
                snap.device_traces[device].push(entry);
            }
        }
    }
    let t = parser.finish()?;
    snap.stacks = t.stacks;
    snap.entry_metas = t.entry_metas;
    Ok(snap)
}

// ---------------------------------------------------------------------------------------------
// Writing

struct DivisionsOut<'a>(&'a [(u64, u64)]);

impl Serialize for DivisionsOut<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.0.iter().map(|(k, v)| (k.to_string(), v)))
    }
}

#[derive(Serialize)]
struct SettingsOut<'a> {
    #[serde(rename = "PYTORCH_CUDA_ALLOC_CONF", skip_serializing_if = "Option::is_none")]
    alloc_conf: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_split_size: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    garbage_collection_threshold: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    expandable_segments: Option<bool>,
    roundup_power2_divisions: DivisionsOut<'a>,
}

#[derive(Serialize)]
struct HeaderOut<'a> {
    format: &'static str,
    version: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    allocator_settings: Option<SettingsOut<'a>>,
    devices: usize,
}

#[derive(Serialize)]
struct EventOut<'a> {
    device: usize,
    action: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    addr: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    device_free: Option<u64>,
    size: u64,
    stream: u64,
    time_us: i64,
    #[serde(skip_serializing_if = "<[Frame]>::is_empty")]
    frames: &'a [Frame],
    #[serde(skip_serializing_if = "Option::is_none")]
    compile_context: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    user_metadata: Option<&'a str>,
}

/// An annotation's string fields in order, then `device` and `time_us`.
struct AnnotationOut<'a>(&'a Annotation);

impl Serialize for AnnotationOut<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let a = self.0;
        let mut m = s.serialize_map(Some(a.fields.len() + 2))?;
        for (k, v) in &a.fields {
            m.serialize_entry(&**k, &**v)?;
        }
        m.serialize_entry("device", &a.device)?;
        m.serialize_entry("time_us", &a.time_us)?;
        m.end()
    }
}

#[derive(Serialize)]
struct AnnotationLine<'a> {
    annotation: AnnotationOut<'a>,
}

#[derive(Serialize)]
struct BlockOut<'a> {
    address: u64,
    size: u64,
    requested_size: u64,
    state: &'static str,
    #[serde(skip_serializing_if = "<[Frame]>::is_empty")]
    frames: &'a [Frame],
}

#[derive(Serialize)]
struct SegmentOut<'a> {
    device: i64,
    address: u64,
    total_size: u64,
    allocated_size: u64,
    active_size: u64,
    requested_size: u64,
    stream: u64,
    segment_type: &'static str,
    segment_pool_id: (i64, i64),
    is_expandable: bool,
    blocks: Vec<BlockOut<'a>>,
}

#[derive(Serialize)]
struct SegmentLine<'a> {
    segment: SegmentOut<'a>,
}

fn line<T: Serialize>(out: &mut impl Write, v: &T) -> std::io::Result<()> {
    serde_json::to_writer(&mut *out, v).map_err(std::io::Error::other)?;
    out.write_all(b"\n")
}

/// Writes `snap` as a JSON Lines trace (header, events device by device, annotations, then
/// segments).
/// `out` should be buffered.
pub fn write(snap: &Snapshot, out: &mut impl Write) -> std::io::Result<()> {
    let s = &snap.settings;
    let settings = s.present.then(|| SettingsOut {
        alloc_conf: s.alloc_conf.as_deref(),
        max_split_size: s.max_split_size,
        garbage_collection_threshold: s.garbage_collection_threshold,
        expandable_segments: s.expandable_segments,
        roundup_power2_divisions: DivisionsOut(&s.roundup_power2_divisions),
    });
    line(out, &HeaderOut { format: FORMAT, version: VERSION, allocator_settings: settings, devices: snap.device_traces.len() })?;
    for (device, entries) in snap.device_traces.iter().enumerate() {
        for e in entries {
            let oom = e.action == Action::Oom;
            line(
                out,
                &EventOut {
                    device,
                    action: e.action.as_str(),
                    addr: (!oom).then_some(e.addr),
                    device_free: oom.then_some(e.addr),
                    size: e.size,
                    stream: e.stream,
                    time_us: e.time_us,
                    frames: snap.stack(e.stack),
                    compile_context: Some(snap.compile_context(e.meta)).filter(|&c| c != NO_COMPILE_CONTEXT),
                    user_metadata: Some(snap.user_metadata(e.meta)).filter(|u| !u.is_empty()),
                },
            )?;
        }
    }
    for a in &snap.annotations {
        line(out, &AnnotationLine { annotation: AnnotationOut(a) })?;
    }
    for seg in &snap.segments {
        let blocks = seg
            .blocks
            .iter()
            .map(|b| BlockOut { address: b.address, size: b.size, requested_size: b.requested_size, state: state_str(b.state), frames: snap.stack(b.stack) })
            .collect();
        line(
            out,
            &SegmentLine {
                segment: SegmentOut {
                    device: seg.device,
                    address: seg.address,
                    total_size: seg.total_size,
                    allocated_size: seg.allocated_size,
                    active_size: seg.active_size,
                    requested_size: seg.requested_size,
                    stream: seg.stream,
                    segment_type: if seg.is_small { "small" } else { "large" },
                    segment_pool_id: seg.pool_id,
                    is_expandable: seg.is_expandable,
                    blocks,
                },
            },
        )?;
    }
    Ok(())
}
