//! Snapshot pickles read as a stream, for replays whose memory does not grow with the trace.
//!
//! [`crate::pickle`] decodes a whole pickle into arenas and [`crate::snapshot`] then builds the
//! [`crate::Snapshot`]: memory proportional to the file (≈ 400 bytes a trace entry). This module
//! runs the same (non-executing) pickle machine over the bytes as they are read, and recognises
//! the shape `torch.cuda.memory._dump_snapshot` writes: a top-level dict whose `device_traces`
//! value is a list of per-device lists of entry dicts. An entry dict is decoded into a
//! [`TraceEntry`] as soon as it is appended to its device's list and then forgotten; everything
//! else (the segments, the settings, the annotations, the frame dicts and the strings the memo
//! shares) is kept as the pickle builds it. What stays is what later opcodes can still refer to:
//!
//! * the memo, in pages of 1024 slots allocated only when a slot holds something kept. Entry
//!   dicts and the `'N/A'` strings torch writes fresh for every entry's `compile_context` are
//!   not kept, so a memo reference to one makes the stream give up (no writer does that);
//! * a `frames` list made inside an entry is interned by its frame dicts and its memo slot
//!   rewritten to the interned stack, so a snapshot whose every entry has its own list (as torch
//!   writes them for distinct tracebacks) costs one memo slot an entry, not a list;
//! * strings: the keys and actions of entries are recognised by their bytes when first read
//!   (later uses are memo references, resolved by index: no hashing per entry); other strings
//!   live in one arena.
//!
//! Anything outside that shape, and any malformed input, stops the stream with
//! [`TraceError::Unstreamable`]: the caller then reads the file whole with [`crate::read_trace`],
//! which gives the answer (or the error message) the whole-file decoder gives. So the stream never
//! decides what a file means; it only agrees with the whole-file decoder or steps aside.
//!
//! Entry dicts of the form torch writes (protocol ≥ 2: `EMPTY_DICT`, a memo put, `MARK`, key and
//! value opcodes, `SETITEMS`) are read by a byte-level fast path ([`Vm::fast_entry`]) that handles
//! `BINGET`/`LONG_BINGET` keys and values, the integer opcodes, `SHORT_BINUNICODE` strings and
//! memo puts directly; an entry it does not recognise is read again by the general machine.
//! A gzip'd file is decompressed in a second thread ([`PickleFile`]).
//!
//! [`PickleFile::scan`] is the first pass a replay needs (the final segments, which come before
//! the traces; the settings, which come after; every device's segment events), and
//! [`PickleFile::events`] the stream of `(device, entry)` (stacks and metadata not kept: every
//! `stack` and `meta` is 0, as in [`crate::jsonl_stream::Events`]).

use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::mpsc;

use crate::hash::IntHasher;
use crate::pickle::{self, Value};
use crate::{Action, RecordedSettings, SnapshotSegment, TraceEntry, TraceError};

fn unstreamable<T>(msg: impl Into<String>) -> Result<T, TraceError> {
    Err(TraceError::Unstreamable(msg.into()))
}

/// Refuses a declared length over [`crate::input::MAX_VALUE_BYTES`] before anything is read for
/// it (the whole-file decoder then names the offset).
#[inline]
fn over_limit(n: u64) -> Result<(), TraceError> {
    if n > crate::input::MAX_VALUE_BYTES {
        return unstreamable(format!("a declared length of {n} bytes, over the limit"));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Values

/// A value on the machine's stack or in its memo: 16 bytes, `Copy`.
#[derive(Clone, Copy, Debug, PartialEq)]
enum V {
    /// Not a value: an empty memo slot, a field an entry does not have.
    Absent,
    None,
    Bool(bool),
    Int(i64),
    /// Little-endian two's complement bytes in the string arena.
    Big {
        start: u32,
        len: u32,
    },
    Float(f64),
    /// UTF-8 in the string arena.
    Str {
        start: u32,
        len: u32,
    },
    /// One of [`WORDS`].
    Word(u8),
    Bytes {
        start: u32,
        len: u32,
    },
    List(u32),
    Tuple(u32),
    Set(u32),
    FrozenSet(u32),
    Dict(u32),
    /// The top-level dict.
    Top,
    /// Its `device_traces` list.
    DeviceTraces,
    /// `device_traces[d]`.
    DeviceList(u32),
    /// An entry dict being built (a slot of [`Vm::entries`]).
    Entry(u32),
    /// A `frames` list made inside an entry, interned.
    Stack(u32),
}

impl V {
    /// A value the general containers may hold.
    #[inline]
    fn is_role(self) -> bool {
        matches!(self, V::Top | V::DeviceTraces | V::DeviceList(_) | V::Entry(_) | V::Absent)
    }
}

/// Strings recognised when read. The first [`FIELDS`] are the entry keys, in field order.
const WORDS: [&[u8]; 25] = [
    b"action",
    b"addr",
    b"device_free",
    b"size",
    b"stream",
    b"time_us",
    b"compile_context",
    b"user_metadata",
    b"frames",
    b"segments",
    b"device_traces",
    b"allocator_settings",
    b"external_annotations",
    b"alloc",
    b"free_requested",
    b"free_completed",
    b"segment_alloc",
    b"segment_free",
    b"segment_map",
    b"segment_unmap",
    b"oom",
    b"snapshot",
    b"annotate",
    b"N/A",
    b"",
];
const FIELDS: usize = 9;
const F_ACTION: usize = 0;
const F_ADDR: usize = 1;
const F_DEVICE_FREE: usize = 2;
const F_SIZE: usize = 3;
const F_STREAM: usize = 4;
const F_TIME: usize = 5;
const F_CC: usize = 6;
const F_UM: usize = 7;
const F_FRAMES: usize = 8;
const W_SEGMENTS: u8 = 9;
const W_DEVICE_TRACES: u8 = 10;
const W_SETTINGS: u8 = 11;
const W_ANNOTATIONS: u8 = 12;
const W_FIRST_ACTION: u8 = 13;
const W_NA: u8 = 23;
const ACTIONS: [Action; 10] = [
    Action::Alloc,
    Action::FreeRequested,
    Action::FreeCompleted,
    Action::SegmentAlloc,
    Action::SegmentFree,
    Action::SegmentMap,
    Action::SegmentUnmap,
    Action::Oom,
    Action::Snapshot,
    Action::Annotate,
];

#[inline]
fn word(b: &[u8]) -> Option<u8> {
    Some(match b {
        b"action" => 0,
        b"addr" => 1,
        b"device_free" => 2,
        b"size" => 3,
        b"stream" => 4,
        b"time_us" => 5,
        b"compile_context" => 6,
        b"user_metadata" => 7,
        b"frames" => 8,
        b"segments" => 9,
        b"device_traces" => 10,
        b"allocator_settings" => 11,
        b"external_annotations" => 12,
        b"alloc" => 13,
        b"free_requested" => 14,
        b"free_completed" => 15,
        b"segment_alloc" => 16,
        b"segment_free" => 17,
        b"segment_map" => 18,
        b"segment_unmap" => 19,
        b"oom" => 20,
        b"snapshot" => 21,
        b"annotate" => 22,
        b"N/A" => 23,
        b"" => 24,
        _ => return None,
    })
}

// ---------------------------------------------------------------------------------------------
// The memo

const PAGE_BITS: u32 = 10;
const PAGE: usize = 1 << PAGE_BITS;

/// One page of the memo: a bitmap of `'N/A'` strings (torch writes a fresh one for every
/// entry's `compile_context`, so most pages hold nothing else), or 4-byte slots.
enum Page {
    Na(Box<[u64; PAGE / 64]>),
    Full(Box<[u32; PAGE]>),
}

/// The pickle memo: dense indices (what every pickler writes), in pages allocated on demand.
/// A slot is 4 bytes: 0 (empty), a word, an interned stack, or an index into `kept`.
struct Memo {
    /// The first [`LOW`] slots, flat (the keys and actions torch's first entries define).
    low: Box<[u32]>,
    pages: Vec<Option<Page>>,
    /// The number of indices put so far (the next `MEMOIZE` index).
    count: u64,
    kept: Vec<V>,
}

const LOW: usize = 1 << 16;
const TAG_SHIFT: u32 = 29;
const TAG_STACK: u32 = 1 << TAG_SHIFT;
const TAG_KEPT: u32 = 2 << TAG_SHIFT;
const PAYLOAD: u32 = TAG_STACK - 1;
const NA_CODE: u32 = W_NA as u32 + 1;

impl Default for Memo {
    fn default() -> Memo {
        Memo { low: vec![0; LOW].into_boxed_slice(), pages: Vec::new(), count: 0, kept: Vec::new() }
    }
}

impl Memo {
    /// The slot's code (see [`Memo`]).
    #[inline]
    fn code(&self, idx: u64) -> u32 {
        if (idx as usize) < LOW {
            return self.low[idx as usize];
        }
        let i = idx as usize & (PAGE - 1);
        match self.pages.get((idx >> PAGE_BITS) as usize) {
            Some(Some(Page::Full(p))) => p[i],
            Some(Some(Page::Na(bits))) if bits[i / 64] >> (i % 64) & 1 != 0 => NA_CODE,
            _ => 0,
        }
    }

    #[inline]
    fn decode(&self, x: u32) -> V {
        if x == 0 {
            V::Absent
        } else if x < TAG_STACK {
            V::Word((x - 1) as u8)
        } else if x < TAG_KEPT {
            V::Stack(x & PAYLOAD)
        } else {
            self.kept[(x & PAYLOAD) as usize]
        }
    }

    #[inline]
    fn get(&self, idx: u64) -> V {
        if (idx as usize) < LOW {
            return self.decode(self.low[idx as usize]);
        }
        let i = idx as usize & (PAGE - 1);
        match self.pages.get((idx >> PAGE_BITS) as usize) {
            Some(Some(Page::Full(p))) => self.decode(p[i]),
            Some(Some(Page::Na(bits))) => {
                if bits[i / 64] >> (i % 64) & 1 != 0 {
                    V::Word(W_NA)
                } else {
                    V::Absent
                }
            }
            _ => V::Absent,
        }
    }

    /// Puts `v` at `idx` (which must be an index already put or the next one). Entry dicts are
    /// not kept: their slot stays empty.
    #[inline]
    fn put(&mut self, idx: u64, v: V) -> Result<(), TraceError> {
        // The common case: torch's fresh 'N/A' at the next index of an 'N/A' page.
        if v == V::Word(W_NA)
            && idx == self.count
            && let Some(Some(Page::Na(bits))) = self.pages.get_mut((idx >> PAGE_BITS) as usize)
        {
            let i = idx as usize & (PAGE - 1);
            bits[i / 64] |= 1 << (i % 64);
            self.count += 1;
            return Ok(());
        }
        if idx > self.count {
            return unstreamable("a memo index out of sequence");
        }
        if idx == self.count {
            self.count += 1;
        }
        let code = match v {
            V::Entry(_) | V::Absent => 0,
            V::Word(w) => w as u32 + 1,
            V::Stack(s) if s < PAYLOAD => TAG_STACK | s,
            _ => {
                if self.kept.len() >= PAYLOAD as usize {
                    return unstreamable("more than 2^29 values in the memo");
                }
                self.kept.push(v);
                TAG_KEPT | (self.kept.len() - 1) as u32
            }
        };
        if (idx as usize) < LOW {
            self.low[idx as usize] = code;
            return Ok(());
        }
        let page = (idx >> PAGE_BITS) as usize;
        let i = idx as usize & (PAGE - 1);
        if self.pages.len() <= page {
            if code == 0 {
                return Ok(());
            }
            self.pages.resize_with(page + 1, || None);
        }
        let slot = &mut self.pages[page];
        match slot {
            None if code == 0 => {}
            None if code == NA_CODE => {
                let mut bits = Box::new([0u64; PAGE / 64]);
                bits[i / 64] |= 1 << (i % 64);
                *slot = Some(Page::Na(bits));
            }
            None => {
                let mut p = Box::new([0u32; PAGE]);
                p[i] = code;
                *slot = Some(Page::Full(p));
            }
            Some(Page::Na(bits)) if code == 0 => bits[i / 64] &= !(1 << (i % 64)),
            Some(Page::Na(bits)) if code == NA_CODE => bits[i / 64] |= 1 << (i % 64),
            Some(Page::Na(bits)) => {
                let mut p = Box::new([0u32; PAGE]);
                for (j, x) in p.iter_mut().enumerate() {
                    if bits[j / 64] >> (j % 64) & 1 != 0 {
                        *x = NA_CODE;
                    }
                }
                p[i] = code;
                *slot = Some(Page::Full(p));
            }
            Some(Page::Full(p)) => p[i] = code,
        }
        Ok(())
    }
}

/// The `compile_context` torch writes when none is active.
const NO_CC: &[u8] = crate::NO_COMPILE_CONTEXT.as_bytes();

/// The bytes of a string value (`default` when absent).
#[inline]
fn str_of<'a>(strs: &'a [u8], v: V, default: &'static [u8]) -> &'a [u8] {
    match v {
        V::Word(w) => WORDS[w as usize],
        V::Str { start, len } => &strs[start as usize..(start + len) as usize],
        _ => default,
    }
}

/// The [`crate::MetaId`] of an entry's `compile_context` and `user_metadata` (as
/// [`crate::snapshot`] interns them: 0 for torch's defaults, else in order of first use).
#[inline]
fn intern_meta(
    ids: &mut HashMap<Box<[u8]>, crate::MetaId>,
    metas: &mut crate::MetaInterner,
    key: &mut Vec<u8>,
    cc: &[u8],
    um: &[u8],
) -> Result<crate::MetaId, TraceError> {
    if cc == NO_CC && um.is_empty() {
        return Ok(0);
    }
    key.clear();
    key.extend_from_slice(cc);
    key.push(0xff); // never in UTF-8
    key.extend_from_slice(um);
    if let Some(&id) = ids.get(&key[..]) {
        return Ok(id);
    }
    let (Ok(c), Ok(u)) = (std::str::from_utf8(cc), std::str::from_utf8(um)) else {
        return unstreamable("an entry's compile_context or user_metadata is not UTF-8");
    };
    let id = metas.intern(c, u);
    ids.insert(key.as_slice().into(), id);
    Ok(id)
}

/// A `frames` list written inside an entry, at `b[i]` (its `EMPTY_LIST`), as torch writes the
/// list of each new traceback: its memo put (index `memo_next`), then memo references (to frame
/// dicts) in `MARK … APPENDS` batches or by one `APPEND`. The range of those items' bytes, which
/// ends where the list does; `None` when the bytes are not of that form (the general machine
/// reads them). Only the opcodes are read: [`frame_dicts`] resolves the references.
#[inline]
fn frames_extent(b: &[u8], mut i: usize, memo_next: u64) -> Option<(usize, usize)> {
    let u32_at = |i: usize| -> Option<u64> { Some(u32::from_le_bytes(b.get(i..i + 4)?.try_into().ok()?) as u64) };
    i += 1;
    match *b.get(i)? {
        0x94 => i += 1,
        b'q' if *b.get(i + 1)? as u64 == memo_next => i += 2,
        b'r' if u32_at(i + 1)? == memo_next => i += 5,
        _ => return None,
    }
    let start = i;
    loop {
        match *b.get(i)? {
            b'(' => {
                i += 1;
                loop {
                    match *b.get(i)? {
                        b'h' => i += 2,
                        b'j' => i += 5,
                        b'e' => break,
                        _ => return None,
                    }
                }
                i += 1;
            }
            // One APPEND, or the entry's next key after the list.
            op @ (b'h' | b'j') => {
                let n = if op == b'h' { 2 } else { 5 };
                if b.get(i + n) != Some(&b'a') {
                    return Some((start, i));
                }
                i += n + 1;
            }
            _ => return Some((start, i)),
        }
    }
}

/// The frame dicts the items of a frames list refer to ([`frames_extent`]'s bytes), pushed to
/// `key`; `None` when one is not a memo reference to a dict.
#[inline]
fn frame_dicts(items: &[u8], memo: &Memo, key: &mut Vec<u32>) -> Option<()> {
    let mut i = 0;
    while i < items.len() {
        let (idx, n) = match items[i] {
            b'(' | b'e' | b'a' => {
                i += 1;
                continue;
            }
            b'h' => (*items.get(i + 1)? as u64, 2),
            _ => (u32::from_le_bytes(items.get(i + 1..i + 5)?.try_into().ok()?) as u64, 5),
        };
        let code = memo.code(idx);
        if code < TAG_KEPT {
            return None;
        }
        let V::Dict(d) = memo.kept[(code & PAYLOAD) as usize] else { return None };
        key.push(d);
        i += n;
    }
    Some(())
}

/// A hasher for byte strings (the frames lists [`Vm::frames_seen`] keeps): Fletcher's two running
/// sums over 8-byte words (position-sensitive, one add each), folded by a 128-bit multiply. Not
/// DoS-resistant, like [`crate::hash::IntHasher`]; equal hashes are told apart by comparing bytes.
#[derive(Default, Clone, Copy)]
struct BytesHasher(u64);

impl std::hash::Hasher for BytesHasher {
    #[inline]
    fn write(&mut self, b: &[u8]) {
        let (mut s1, mut s2) = (self.0 ^ b.len() as u64, 0u64);
        let mut chunks = b.chunks_exact(8);
        for c in &mut chunks {
            s1 = s1.wrapping_add(u64::from_le_bytes(c.try_into().unwrap_or_default()));
            s2 = s2.wrapping_add(s1);
        }
        let mut w = [0u8; 8];
        w[..chunks.remainder().len()].copy_from_slice(chunks.remainder());
        s1 = s1.wrapping_add(u64::from_le_bytes(w));
        s2 = s2.wrapping_add(s1);
        let p = (s1 as u128).wrapping_mul((s2 ^ 0x9e37_79b9_7f4a_7c15) as u128 | 1);
        self.0 = (p as u64) ^ ((p >> 64) as u64);
    }
    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.0 ^= i as u64;
    }
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

/// At most this many bytes of frames lists in [`Vm::frames_seen`] (a snapshot whose every
/// entry has a stack of its own must not keep them all).
const FRAMES_SEEN_BYTES: usize = 16 << 20;

// ---------------------------------------------------------------------------------------------
// Input

/// Where the machine's bytes come from.
enum Input {
    /// Chunks from the thread that reads (and gunzips) the file; used chunks go back to it.
    Gzip {
        rx: mpsc::Receiver<std::io::Result<Vec<u8>>>,
        back: mpsc::Sender<Vec<u8>>,
        chunk: Vec<u8>,
        at: usize,
    },
    Bytes {
        bytes: std::sync::Arc<[u8]>,
        at: usize,
    },
}

const CHUNK: usize = 1 << 20;

impl Input {
    /// Reads into `out`; 0 at the end.
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Input::Gzip { rx, back, chunk, at } => {
                while *at >= chunk.len() {
                    match rx.recv() {
                        Ok(Ok(c)) => {
                            let old = std::mem::replace(chunk, c);
                            let _ = back.send(old);
                            *at = 0;
                            if chunk.is_empty() {
                                return Ok(0);
                            }
                        }
                        Ok(Err(e)) => return Err(e),
                        Err(_) => return Ok(0),
                    }
                }
                let n = (chunk.len() - *at).min(out.len());
                out[..n].copy_from_slice(&chunk[*at..*at + n]);
                *at += n;
                Ok(n)
            }
            Input::Bytes { bytes, at } => {
                let n = (bytes.len() - *at).min(out.len());
                out[..n].copy_from_slice(&bytes[*at..*at + n]);
                *at += n;
                Ok(n)
            }
        }
    }
}

/// Starts a thread that gunzips `f` into chunks.
fn gunzip_thread(f: std::fs::File) -> Input {
    reader_thread(crate::input::GzReader::new(std::io::BufReader::with_capacity(1 << 18, f)))
}

/// Starts a thread that reads `z` into chunks (a plain file too: its reads then overlap the
/// decoding).
fn reader_thread(mut z: impl Read + Send + 'static) -> Input {
    let (tx, rx) = mpsc::sync_channel::<std::io::Result<Vec<u8>>>(4);
    let (back, recycled) = mpsc::channel::<Vec<u8>>();
    std::thread::spawn(move || {
        loop {
            // A chunk that comes back full is overwritten as it is (not zeroed again).
            let mut c = recycled.try_recv().unwrap_or_default();
            c.resize(CHUNK, 0);
            let mut n = 0;
            while n < CHUNK {
                match z.read(&mut c[n..]) {
                    Ok(0) => break,
                    Ok(k) => n += k,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        let _ = tx.send(Err(e));
                        return;
                    }
                }
            }
            c.truncate(n);
            let end = n == 0;
            if tx.send(Ok(c)).is_err() || end {
                return;
            }
        }
    });
    Input::Gzip { rx, back, chunk: Vec::new(), at: 0 }
}

// ---------------------------------------------------------------------------------------------
// The machine

/// An entry dict's fields as read (by [`FIELDS`] index).
#[derive(Clone, Copy)]
struct Partial {
    f: [V; FIELDS],
}

const EMPTY_PARTIAL: Partial = Partial { f: [V::Absent; FIELDS] };

/// What [`Vm`] keeps of the entries.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Every entry, for [`Events`].
    Events,
    /// The segment entries, the segments and the settings, for [`PickleFile::scan`].
    Scan,
    /// Every entry with its stack and metadata, for [`PickleFile::compact`].
    Collect,
}

/// What the first pass found: see [`PickleFile::scan`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PickleScan {
    pub settings: RecordedSettings,
    /// `len(device_traces)`.
    pub devices: usize,
    /// The final segments (block stacks not kept).
    pub segments: Vec<SnapshotSegment>,
    /// By device: its segment entries in order (stacks not kept).
    pub segment_entries: Vec<Vec<TraceEntry>>,
    /// Trace entries, every device's.
    pub entries: u64,
}

type StackMap = HashMap<Vec<u32>, u32, BuildHasherDefault<IntHasher>>;

struct Vm {
    input: Input,
    eof: bool,
    /// Bytes `pos..end` of `buf` are read and not yet decoded.
    buf: Vec<u8>,
    pos: usize,
    end: usize,
    stack: Vec<V>,
    marks: Vec<usize>,
    memo: Memo,
    strs: Vec<u8>,
    word_spans: [(u32, u32); WORDS.len()],
    seqs: Vec<Vec<V>>,
    /// Per seq: the memo index of a `frames` list made inside an entry (`u64::MAX`: none yet;
    /// `u64::MAX - 1`: a generic seq).
    seq_memo: Vec<u64>,
    seq_free: Vec<u32>,
    /// Per seq: its items were checked to be frame dicts.
    seq_checked: Vec<bool>,
    dicts: Vec<Vec<(V, V)>>,
    entries: Vec<Partial>,
    entry_free: Vec<u32>,
    /// Entries the fast path read whole, waiting for their `APPENDS` (`V::Entry(id | READY)`).
    ready: Vec<TraceEntry>,
    ready_free: Vec<u32>,
    stacks: StackMap,
    devices: u32,
    top_made: bool,
    traces_made: bool,
    top: [V; 4],
    mode: Mode,
    out: Vec<(usize, TraceEntry)>,
    segment_entries: Vec<Vec<TraceEntry>>,
    entry_count: u64,
    done: bool,
    /// [`Mode::Collect`]: the entries by device, their `stack` one more than a key of `stacks`
    /// (0: no frames) until [`PickleFile::compact`] renumbers them.
    traces: Vec<Vec<TraceEntry>>,
    /// [`Mode::Collect`]: the entries' metadata, interned (see [`Vm::meta_of`]).
    metas: crate::MetaInterner,
    meta_ids: HashMap<Box<[u8]>, crate::MetaId>,
    /// Scratch: the frame dicts of a `frames` list the fast path read; a metadata key.
    frame_key: Vec<u32>,
    meta_key: Vec<u8>,
    /// The frames lists the fast path read inside entries, by their items' bytes: the stack
    /// (0 outside [`Mode::Collect`]), so a list seen before is neither resolved nor hashed by
    /// its frames again. Emptied when a memo index is bound again (the same bytes could then
    /// mean other frames); at most [`FRAMES_SEEN_BYTES`].
    frames_seen: HashMap<Box<[u8]>, u32, BuildHasherDefault<BytesHasher>>,
    frames_seen_bytes: usize,
    /// [`Mode::Collect`]: past this many entries, a scan ([`PickleFile::first_pass`]).
    max_entries: u64,
    /// [`PickleFile::first_pass_teed`]: where the final segments and the entries also go as
    /// they are read.
    tee: Option<Tee>,
}

/// Entries handed to a [`TeeEvents`] at a time.
const TEE_BATCH: usize = 4096;

/// What a [`Tee`] sends.
enum TeeMsg {
    /// The final segments, read before the traces.
    Segments(Vec<SnapshotSegment>),
    Entries(Vec<(usize, TraceEntry)>),
    /// The whole snapshot was read: the entries are all sent, and these are its settings.
    End(RecordedSettings),
}

/// The sending side of [`PickleFile::first_pass_teed`] (see [`tee`]).
pub struct Tee {
    tx: mpsc::Sender<TeeMsg>,
    batch: Vec<(usize, TraceEntry)>,
    /// The final segments were sent (or could not be).
    segments_sent: bool,
    /// The receiver is gone.
    gone: bool,
}

impl Tee {
    fn send(&mut self, m: TeeMsg) {
        if !self.gone {
            self.gone = self.tx.send(m).is_err();
        }
    }
}

/// A pair: the [`Tee`] that [`PickleFile::first_pass_teed`] sends to, and the [`TeeEvents`]
/// that receives (on another thread).
pub fn tee() -> (Tee, TeeEvents) {
    let (tx, rx) = mpsc::channel();
    let tee = Tee { tx, batch: Vec::with_capacity(TEE_BATCH), segments_sent: false, gone: false };
    (tee, TeeEvents { rx, batch: Vec::new(), at: 0, ended: false, pending: None, read: Some(Vec::new()), held: 0, keep: TEE_KEEP, settings: None })
}

/// What a [`PickleFile::first_pass_teed`] reads, as it reads it: first the final segments
/// ([`TeeEvents::segments`]), then the entries as `(device, entry)` (every `stack` and `meta` 0),
/// in file order: what [`PickleFile::events`] yields for the same file. When the read fails or
/// stops keeping entries (more than it keeps), the entries end with one
/// [`TraceError::Unstreamable`]; they end without one only when the snapshot was read whole.
pub struct TeeEvents {
    rx: mpsc::Receiver<TeeMsg>,
    batch: Vec<(usize, TraceEntry)>,
    at: usize,
    ended: bool,
    /// A message [`TeeEvents::segments`] received that was not the segments.
    pending: Option<TeeMsg>,
    /// The batches read to the end, kept for [`crate::Rewind::read_so_far`] (moved, not
    /// copied), while they hold at most `keep` entries (then dropped, and `None` kept).
    read: Option<Vec<Vec<(usize, TraceEntry)>>>,
    /// The entries in `read`.
    held: usize,
    keep: usize,
    /// The snapshot's settings, once its entries have all been yielded.
    settings: Option<RecordedSettings>,
}

/// How many entries a [`TeeEvents`] keeps for [`crate::Rewind::read_so_far`] unless told to keep
/// them all: what they cost is the memory the first pass then allocates afresh for its batches.
pub const TEE_KEEP: usize = 1 << 16;

impl TeeEvents {
    fn done_with(&mut self, batch: Vec<(usize, TraceEntry)>) {
        if let Some(read) = &mut self.read {
            if self.held + batch.len() <= self.keep {
                self.held += batch.len();
                read.push(batch);
            } else {
                self.read = None;
            }
        }
    }
}

impl crate::Rewind for TeeEvents {
    fn read_so_far(&self) -> Option<impl Iterator<Item = (usize, TraceEntry)> + '_> {
        Some(self.read.as_ref()?.iter().flatten().chain(&self.batch[..self.at]).copied())
    }
    fn keep_all(&mut self) {
        self.keep = usize::MAX;
    }
    fn settings_at_end(&self) -> Option<&RecordedSettings> {
        self.settings.as_ref()
    }
}

impl TeeEvents {
    /// The final segments, when the file holds them before the traces (waits for them); `None`
    /// otherwise (the entries can still be read).
    pub fn segments(&mut self) -> Option<Vec<SnapshotSegment>> {
        match self.rx.recv() {
            Ok(TeeMsg::Segments(s)) => Some(s),
            Ok(m) => {
                self.pending = Some(m);
                None
            }
            Err(_) => None,
        }
    }
}

impl Iterator for TeeEvents {
    type Item = Result<(usize, TraceEntry), TraceError>;

    #[inline]
    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if self.at < self.batch.len() {
                self.at += 1;
                return Some(Ok(self.batch[self.at - 1]));
            }
            if self.ended {
                return None;
            }
            self.at = 0;
            let m = match self.pending.take() {
                Some(m) => Ok(m),
                None => self.rx.recv(),
            };
            match m {
                Ok(TeeMsg::Entries(b)) => {
                    let done = std::mem::replace(&mut self.batch, b);
                    self.done_with(done);
                }
                Ok(TeeMsg::Segments(_)) => {}
                Ok(TeeMsg::End(settings)) => {
                    let done = std::mem::take(&mut self.batch);
                    self.done_with(done);
                    self.ended = true;
                    self.settings = Some(settings);
                    return None;
                }
                Err(_) => {
                    let done = std::mem::take(&mut self.batch);
                    self.done_with(done);
                    self.ended = true;
                    return Some(Err(TraceError::Unstreamable("the first pass stopped keeping entries".into())));
                }
            }
        }
    }
}

const GENERIC_SEQ: u64 = u64::MAX - 1;
/// [`Vm::fast_entry`]: a fresh memo put of the `frames` list it read, and that list as the
/// entry's `frames` until it is interned.
const FRESH_STACK: u32 = u32::MAX;
const FRESH_FRAMES: V = V::Stack(u32::MAX);
/// Marks an entry slot of [`Vm::ready`].
const READY: u32 = 1 << 31;
/// An entry the first pass does not keep.
const SKIPPED: u32 = u32::MAX;
const FRAMES_SEQ: u64 = u64::MAX;

impl Vm {
    fn new(input: Input, mode: Mode) -> Vm {
        let mut strs = Vec::with_capacity(1 << 16);
        let mut word_spans = [(0u32, 0u32); WORDS.len()];
        for (i, w) in WORDS.iter().enumerate() {
            word_spans[i] = (strs.len() as u32, w.len() as u32);
            strs.extend_from_slice(w);
        }
        Vm {
            input,
            eof: false,
            buf: Vec::new(),
            pos: 0,
            end: 0,
            stack: Vec::with_capacity(4096),
            marks: Vec::with_capacity(64),
            memo: Memo::default(),
            strs,
            word_spans,
            seqs: Vec::new(),
            seq_memo: Vec::new(),
            seq_free: Vec::new(),
            seq_checked: Vec::new(),
            dicts: Vec::new(),
            entries: Vec::new(),
            entry_free: Vec::new(),
            ready: Vec::new(),
            ready_free: Vec::new(),
            stacks: StackMap::default(),
            devices: 0,
            top_made: false,
            traces_made: false,
            top: [V::Absent; 4],
            mode,
            out: Vec::with_capacity(1024),
            segment_entries: Vec::new(),
            entry_count: 0,
            done: false,
            traces: Vec::new(),
            metas: crate::MetaInterner::default(),
            meta_ids: HashMap::new(),
            frame_key: Vec::new(),
            meta_key: Vec::new(),
            frames_seen: HashMap::default(),
            frames_seen_bytes: 0,
            max_entries: u64::MAX,
            tee: None,
        }
    }

    /// Makes at least `n` bytes available at `pos` (fewer only at the end of the input): moves
    /// what is left to the front of the buffer and reads until it is full. The buffer grows with
    /// the bytes that arrive, not with `n`: a length an invalid file declares costs no more
    /// memory than the file holds.
    #[cold]
    fn refill(&mut self, n: usize) -> Result<(), TraceError> {
        self.buf.copy_within(self.pos..self.end, 0);
        self.end -= self.pos;
        self.pos = 0;
        if self.buf.len() < 2 * CHUNK {
            self.buf.resize(2 * CHUNK, 0);
        }
        while self.end < n.max(CHUNK) && !self.eof {
            if self.end == self.buf.len() {
                let more = (n - self.end).min(self.buf.len());
                self.buf.resize(self.buf.len() + more, 0);
            }
            match self.input.read(&mut self.buf[self.end..]) {
                Ok(0) => self.eof = true,
                Ok(k) => self.end += k,
                Err(e) => return unstreamable(format!("reading: {e}")),
            }
        }
        Ok(())
    }

    #[inline]
    fn need(&mut self, n: usize) -> Result<(), TraceError> {
        if self.end - self.pos < n {
            self.refill(n)?;
            if self.end - self.pos < n {
                return unstreamable("the input ends inside an opcode (truncated pickle)");
            }
        }
        Ok(())
    }

    #[inline]
    fn bytes<const N: usize>(&mut self) -> Result<[u8; N], TraceError> {
        self.need(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(&self.buf[self.pos..self.pos + N]);
        self.pos += N;
        Ok(a)
    }

    #[inline]
    fn base(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    #[inline]
    fn pop(&mut self) -> Result<V, TraceError> {
        if self.stack.len() <= self.base() {
            return unstreamable("stack underflow");
        }
        Ok(self.stack.pop().unwrap_or(V::Absent))
    }

    #[inline]
    fn top_value(&self) -> V {
        if self.stack.len() > self.base() { self.stack[self.stack.len() - 1] } else { V::Absent }
    }

    #[inline]
    fn below_mark(&self) -> V {
        match self.marks.last() {
            Some(&m) if m > 0 => self.stack[m - 1],
            _ => V::Absent,
        }
    }

    /// The value two below the top (above the base), for the `SETITEM` pattern.
    #[inline]
    fn second(&self) -> V {
        let n = self.stack.len();
        if n >= self.base() + 2 { self.stack[n - 2] } else { V::Absent }
    }

    fn new_seq(&mut self, items: Vec<V>, frames: bool) -> u32 {
        let tag = if frames { FRAMES_SEQ } else { GENERIC_SEQ };
        if let Some(id) = self.seq_free.pop() {
            self.seqs[id as usize] = items;
            self.seq_memo[id as usize] = tag;
            self.seq_checked[id as usize] = false;
            return id;
        }
        self.seqs.push(items);
        self.seq_memo.push(tag);
        self.seq_checked.push(false);
        (self.seqs.len() - 1) as u32
    }

    fn new_dict(&mut self, pairs: Vec<(V, V)>) -> u32 {
        self.dicts.push(pairs);
        (self.dicts.len() - 1) as u32
    }

    fn new_entry(&mut self) -> u32 {
        if let Some(id) = self.entry_free.pop() {
            self.entries[id as usize] = EMPTY_PARTIAL;
            return id;
        }
        self.entries.push(EMPTY_PARTIAL);
        (self.entries.len() - 1) as u32
    }

    /// A string read from the input (`n` bytes at `pos`, available).
    #[inline]
    fn string(&mut self, n: usize) -> Result<V, TraceError> {
        let b = &self.buf[self.pos..self.pos + n];
        let w = word(b);
        let ok = w.is_some() || std::str::from_utf8(b).is_ok();
        self.pos += n;
        if let Some(w) = w {
            return Ok(V::Word(w));
        }
        if !ok {
            return unstreamable("a string that is not UTF-8");
        }
        self.arena(n).map(|(start, len)| V::Str { start, len })
    }

    /// Copies the `n` bytes before `pos` into the string arena.
    fn arena(&mut self, n: usize) -> Result<(u32, u32), TraceError> {
        let start = self.strs.len();
        if start + n > u32::MAX as usize {
            return unstreamable("more than 4 GiB of strings");
        }
        self.strs.extend_from_slice(&self.buf[self.pos - n..self.pos]);
        Ok((start as u32, n as u32))
    }

    fn memo_put(&mut self, idx: u64, v: V) -> Result<(), TraceError> {
        if idx < self.memo.count && !self.frames_seen.is_empty() {
            self.frames_seen.clear();
            self.frames_seen_bytes = 0;
        }
        if let V::List(id) = v
            && self.seq_memo[id as usize] == FRAMES_SEQ
        {
            self.seq_memo[id as usize] = idx;
        }
        self.memo.put(idx, v)
    }

    #[inline]
    fn memo_get(&self, idx: u64) -> Result<V, TraceError> {
        match self.memo.get(idx) {
            V::Absent => unstreamable("a memo reference to a value the stream does not keep"),
            V::Top | V::DeviceTraces | V::DeviceList(_) => unstreamable("a memo reference to the snapshot's structure"),
            v => Ok(v),
        }
    }

    /// The role of a list made now: a device's trace (appended to `device_traces` by `APPEND`,
    /// or inside the `MARK` of its `APPENDS`), or `device_traces` itself (the value after that key
    /// in the top-level dict).
    #[inline]
    fn list_role(&self) -> Option<V> {
        let (top, below) = (self.top_value(), self.below_mark());
        if top == V::DeviceTraces || below == V::DeviceTraces {
            return Some(V::DeviceList(self.devices));
        }
        if top == V::Word(W_DEVICE_TRACES) && (below == V::Top || self.second() == V::Top) {
            return Some(V::DeviceTraces);
        }
        None
    }

    fn push_list(&mut self) -> Result<(), TraceError> {
        match self.list_role() {
            Some(V::DeviceList(d)) => {
                self.devices += 1;
                self.stack.push(V::DeviceList(d));
            }
            Some(V::DeviceTraces) => {
                if self.traces_made {
                    return unstreamable("two device_traces lists");
                }
                self.traces_made = true;
                if let Some(t) = &mut self.tee
                    && !t.segments_sent
                {
                    t.segments_sent = true;
                    if let Some(segments) = self.early_segments()
                        && let Some(t) = &mut self.tee
                    {
                        t.send(TeeMsg::Segments(segments));
                    }
                }
                self.stack.push(V::DeviceTraces);
            }
            _ => {
                let top = self.top_value();
                let frames = top == V::Word(F_FRAMES as u8) && (matches!(self.below_mark(), V::Entry(_)) || matches!(self.second(), V::Entry(_)));
                let id = self.new_seq(Vec::new(), frames);
                self.stack.push(V::List(id));
            }
        }
        Ok(())
    }

    /// Whether a dict made now is an entry.
    #[inline]
    fn dict_is_entry(&self) -> bool {
        matches!(self.top_value(), V::DeviceList(_)) || matches!(self.below_mark(), V::DeviceList(_))
    }

    fn push_dict(&mut self) -> Result<(), TraceError> {
        if !self.top_made && self.stack.is_empty() && self.marks.is_empty() {
            self.top_made = true;
            self.stack.push(V::Top);
        } else if self.dict_is_entry() {
            let id = self.new_entry();
            self.stack.push(V::Entry(id));
        } else {
            let id = self.new_dict(Vec::new());
            self.stack.push(V::Dict(id));
        }
        Ok(())
    }

    /// Appends `items` to `target`.
    fn append(&mut self, target: V, start: usize) -> Result<(), TraceError> {
        match target {
            V::List(id) => {
                if self.seq_checked[id as usize] {
                    // The whole-file decoder would see the list as it ends up.
                    return unstreamable("a frames list changed after an entry used it");
                }
                for i in start..self.stack.len() {
                    let v = self.stack[i];
                    if v.is_role() {
                        return unstreamable("the snapshot's structure inside another value");
                    }
                    self.seqs[id as usize].push(v);
                }
            }
            V::DeviceTraces => {
                for i in start..self.stack.len() {
                    if !matches!(self.stack[i], V::DeviceList(_)) {
                        return unstreamable("device_traces holds something other than a list");
                    }
                }
            }
            V::DeviceList(d) => {
                for i in start..self.stack.len() {
                    let V::Entry(slot) = self.stack[i] else {
                        return unstreamable("a device trace holds something other than a dict");
                    };
                    self.finish_entry(slot, d)?;
                }
            }
            _ => return unstreamable("APPEND to something other than a list"),
        }
        self.stack.truncate(start);
        Ok(())
    }

    /// Sets the pairs `stack[start..]` in `target`.
    fn set_items(&mut self, target: V, start: usize) -> Result<(), TraceError> {
        if !(self.stack.len() - start).is_multiple_of(2) {
            return unstreamable("an odd number of items for a dict");
        }
        match target {
            V::Dict(id) => {
                for i in (start..self.stack.len()).step_by(2) {
                    let (k, v) = (self.stack[i], self.stack[i + 1]);
                    if k.is_role() || v.is_role() {
                        return unstreamable("the snapshot's structure inside another value");
                    }
                    self.dicts[id as usize].push((k, v));
                }
            }
            V::Entry(slot) => {
                if slot & READY != 0 {
                    return unstreamable("an entry dict set twice");
                }
                for i in (start..self.stack.len()).step_by(2) {
                    let (k, v) = (self.stack[i], self.stack[i + 1]);
                    if v.is_role() {
                        return unstreamable("the snapshot's structure inside an entry");
                    }
                    if let V::Word(w) = k
                        && (w as usize) < FIELDS
                    {
                        let v = if w as usize == F_FRAMES { self.intern_frames(v)? } else { v };
                        self.entries[slot as usize].f[w as usize] = v;
                    }
                }
            }
            V::Top => {
                for i in (start..self.stack.len()).step_by(2) {
                    let (k, v) = (self.stack[i], self.stack[i + 1]);
                    match k {
                        V::Word(W_SEGMENTS) => self.top[0] = v,
                        V::Word(W_DEVICE_TRACES) => {
                            if v != V::DeviceTraces {
                                return unstreamable("device_traces is not the list the stream read");
                            }
                            self.top[1] = v;
                        }
                        V::Word(W_SETTINGS) => self.top[2] = v,
                        V::Word(W_ANNOTATIONS) => self.top[3] = v,
                        _ if v.is_role() || k.is_role() => {
                            return unstreamable("the snapshot's structure under another key");
                        }
                        _ => {}
                    }
                }
            }
            _ => return unstreamable("SETITEMS on something other than a dict"),
        }
        self.stack.truncate(start);
        Ok(())
    }

    /// An entry's `frames` value: a list made inside an entry is interned (its memo slot then
    /// holds the interned stack) and its storage reused.
    fn intern_frames(&mut self, v: V) -> Result<V, TraceError> {
        let V::List(id) = v else { return Ok(v) };
        let memo = self.seq_memo[id as usize];
        if memo == GENERIC_SEQ {
            return Ok(v);
        }
        let items = std::mem::take(&mut self.seqs[id as usize]);
        let mut key = Vec::with_capacity(items.len());
        for it in &items {
            match *it {
                V::Dict(d) => key.push(d),
                _ => return unstreamable("a frame that is not a dict"),
            }
        }
        let n = self.stacks.len() as u32;
        let sid = *self.stacks.entry(key).or_insert(n);
        let s = V::Stack(sid);
        if memo != FRAMES_SEQ {
            self.memo.put(memo, s)?;
        }
        let mut items = items;
        items.clear();
        self.seqs[id as usize] = items;
        self.seq_free.push(id);
        Ok(s)
    }

    /// Converts a complete entry dict (as [`crate::snapshot`] does) and hands it on.
    fn finish_entry(&mut self, slot: u32, dev: u32) -> Result<(), TraceError> {
        if slot == SKIPPED {
            self.entry_count += 1;
            return Ok(());
        }
        let e = if slot & READY != 0 {
            let id = slot & !READY;
            self.ready_free.push(id);
            self.ready[id as usize]
        } else {
            let p = self.entries[slot as usize];
            self.entry_free.push(slot);
            self.convert(&p)?
        };
        self.emit(e, dev);
        Ok(())
    }

    /// An entry dict's fields as [`TraceEntry`] (as [`crate::snapshot`] reads them).
    #[inline]
    fn convert(&mut self, p: &Partial) -> Result<TraceEntry, TraceError> {
        let action = match p.f[F_ACTION] {
            V::Word(w) if (W_FIRST_ACTION..W_FIRST_ACTION + 10).contains(&w) => ACTIONS[(w - W_FIRST_ACTION) as usize],
            _ => return unstreamable("an entry without a known action"),
        };
        let lenient = action == Action::Annotate;
        let addr = if action == Action::Oom { if p.f[F_DEVICE_FREE] != V::Absent { p.f[F_DEVICE_FREE] } else { p.f[F_ADDR] } } else { p.f[F_ADDR] };
        let addr = self.u64_field(addr, lenient)?;
        let size = self.u64_field(p.f[F_SIZE], lenient)?;
        let stream = match p.f[F_STREAM] {
            V::Absent => 0,
            V::Int(i) => i as u64,
            v @ V::Big { .. } => self.big_u64(v)?,
            _ => return unstreamable("an entry's stream is not an int"),
        };
        let time_us = match p.f[F_TIME] {
            V::Absent => 0,
            V::Int(i) => i,
            _ => return unstreamable("an entry's time_us is not an i64"),
        };
        match p.f[F_FRAMES] {
            V::Absent | V::None | V::Stack(_) => {}
            V::List(id) | V::Tuple(id) => {
                if !self.seq_checked[id as usize] {
                    if !self.seqs[id as usize].iter().all(|v| matches!(v, V::Dict(_))) {
                        return unstreamable("a frame that is not a dict");
                    }
                    self.seq_checked[id as usize] = true;
                }
            }
            _ => return unstreamable("an entry's frames are not a list"),
        }
        for f in [F_CC, F_UM] {
            if !matches!(p.f[f], V::Absent | V::Str { .. } | V::Word(_)) {
                return unstreamable("an entry's compile_context or user_metadata is not a str");
            }
        }
        let (stack, meta) = if self.mode == Mode::Collect {
            let stack = self.stack_of(p.f[F_FRAMES])?;
            let cc = str_of(&self.strs, p.f[F_CC], NO_CC);
            let um = str_of(&self.strs, p.f[F_UM], b"");
            (stack, intern_meta(&mut self.meta_ids, &mut self.metas, &mut self.meta_key, cc, um)?)
        } else {
            (0, 0)
        };
        Ok(TraceEntry { action, addr, size, stream, time_us, stack, meta })
    }

    /// [`Mode::Collect`]: an entry's stack (one more than its key in `stacks`; 0: no frames)
    /// from its `frames` value (interned already, or a list made outside the entry).
    fn stack_of(&mut self, v: V) -> Result<u32, TraceError> {
        match v {
            V::Stack(s) => Ok(s + 1),
            V::List(id) | V::Tuple(id) => {
                let mut key = std::mem::take(&mut self.frame_key);
                key.clear();
                for it in &self.seqs[id as usize] {
                    let V::Dict(d) = *it else { return unstreamable("a frame that is not a dict") };
                    key.push(d);
                }
                let sid = self.intern_stack(&key);
                self.frame_key = key;
                Ok(sid + 1)
            }
            _ => Ok(0),
        }
    }

    /// The id of the stack of these frame dicts.
    fn intern_stack(&mut self, key: &[u32]) -> u32 {
        if let Some(&s) = self.stacks.get(key) {
            return s;
        }
        let n = self.stacks.len() as u32;
        self.stacks.insert(key.to_vec(), n);
        n
    }

    #[inline]
    fn emit(&mut self, e: TraceEntry, dev: u32) {
        let action = e.action;
        self.entry_count += 1;
        match self.mode {
            Mode::Events => self.out.push((dev as usize, e)),
            Mode::Collect if self.entry_count <= self.max_entries => {
                let d = dev as usize;
                if self.traces.len() <= d {
                    self.traces.resize_with(d + 1, Vec::new);
                }
                if self.traces[d].capacity() == 0 {
                    // Room for every entry the first pass keeps, backed as it is written.
                    self.traces[d] = crate::mem::huge_vec(self.max_entries.min(1 << 20) as usize);
                }
                self.traces[d].push(e);
                if let Some(t) = &mut self.tee
                    && !t.gone
                {
                    t.batch.push((d, TraceEntry { stack: 0, meta: 0, ..e }));
                    if t.batch.len() == TEE_BATCH {
                        let full = std::mem::replace(&mut t.batch, Vec::with_capacity(TEE_BATCH));
                        t.send(TeeMsg::Entries(full));
                    }
                }
            }
            Mode::Collect => {
                // Dropping the tee ends its entries with an error.
                self.tee = None;
                // More entries than [`PickleFile::first_pass`] keeps: a scan from here on.
                self.mode = Mode::Scan;
                for (d, t) in std::mem::take(&mut self.traces).into_iter().enumerate() {
                    let segment = |e: &TraceEntry| e.action.is_segment_event();
                    let kept: Vec<TraceEntry> = t.iter().filter(|e| segment(e)).map(|e| TraceEntry { stack: 0, meta: 0, ..*e }).collect();
                    if self.segment_entries.len() <= d {
                        self.segment_entries.resize_with(d + 1, Vec::new);
                    }
                    self.segment_entries[d] = kept;
                }
                self.entry_count -= 1;
                self.emit(e, dev);
            }
            Mode::Scan => {
                if action.is_segment_event() {
                    let d = dev as usize;
                    if self.segment_entries.len() <= d {
                        self.segment_entries.resize_with(d + 1, Vec::new);
                    }
                    // (Entries read before a first pass became a scan carry their stacks.)
                    self.segment_entries[d].push(TraceEntry { stack: 0, meta: 0, ..e });
                }
            }
        }
    }

    #[inline]
    fn u64_field(&self, v: V, lenient: bool) -> Result<u64, TraceError> {
        match v {
            V::Int(i) if i >= 0 => Ok(i as u64),
            V::Big { .. } => self.big_u64(v),
            V::Absent if lenient => Ok(0),
            _ => unstreamable("an entry's address or size is not an int in 0..2^64"),
        }
    }

    fn big_u64(&self, v: V) -> Result<u64, TraceError> {
        let V::Big { start, len } = v else { return unstreamable("not an int") };
        let b = &self.strs[start as usize..(start + len) as usize];
        let neg = b.last().is_some_and(|&x| x & 0x80 != 0);
        if neg || b.len() > 9 || (b.len() == 9 && b[8] != 0) {
            return unstreamable("an int outside 0..2^64");
        }
        let mut a = [0u8; 8];
        let n = b.len().min(8);
        a[..n].copy_from_slice(&b[..n]);
        Ok(u64::from_le_bytes(a))
    }

    #[inline]
    fn long(&mut self, n: usize) -> Result<V, TraceError> {
        over_limit(n as u64)?;
        self.need(n)?;
        let b = &self.buf[self.pos..self.pos + n];
        if let Some(i) = pickle::narrow_long(b) {
            self.pos += n;
            return Ok(V::Int(i));
        }
        self.pos += n;
        let (start, len) = self.arena(n)?;
        Ok(V::Big { start, len })
    }

    /// Runs until entries were handed on (events), or to the end.
    fn run(&mut self) -> Result<(), TraceError> {
        while !self.done {
            if self.end - self.pos < 16 {
                self.refill(16)?;
                if self.pos >= self.end {
                    return unstreamable("the input ended before the STOP opcode (truncated pickle)");
                }
            }
            let op = self.buf[self.pos];
            if op == b'}' && self.dict_is_entry() && self.fast_entry()? {
                continue;
            }
            self.pos += 1;
            match op {
                0x80 => {
                    let [v] = self.bytes::<1>()?;
                    if v > 5 {
                        return unstreamable("pickle protocol above 5");
                    }
                }
                0x95 => {
                    // A frame must fit in what is left, as the whole-file decoder checks.
                    let n = u64::from_le_bytes(self.bytes::<8>()?);
                    over_limit(n)?;
                    if n > 0 {
                        self.need(usize::try_from(n).unwrap_or(usize::MAX))?;
                    }
                }
                b'.' => {
                    let v = self.pop()?;
                    if v != V::Top || !self.stack.is_empty() || !self.marks.is_empty() {
                        return unstreamable("the pickle is not one top-level dict");
                    }
                    if self.top[1] != V::DeviceTraces {
                        return unstreamable("no device_traces");
                    }
                    self.done = true;
                }
                b'(' => {
                    if self.marks.len() >= pickle::MAX_MARK_DEPTH {
                        return unstreamable("marks nested too deep");
                    }
                    self.marks.push(self.stack.len());
                }
                b'N' => self.stack.push(V::None),
                0x88 => self.stack.push(V::Bool(true)),
                0x89 => self.stack.push(V::Bool(false)),
                b'J' => {
                    let v = i32::from_le_bytes(self.bytes::<4>()?);
                    self.stack.push(V::Int(v as i64));
                }
                b'K' => {
                    let [v] = self.bytes::<1>()?;
                    self.stack.push(V::Int(v as i64));
                }
                b'M' => {
                    let v = u16::from_le_bytes(self.bytes::<2>()?);
                    self.stack.push(V::Int(v as i64));
                }
                0x8a => {
                    let [n] = self.bytes::<1>()?;
                    let v = self.long(n as usize)?;
                    self.stack.push(v);
                }
                0x8b => {
                    let n = i32::from_le_bytes(self.bytes::<4>()?);
                    if n < 0 {
                        return unstreamable("LONG4 with a negative length");
                    }
                    let v = self.long(n as usize)?;
                    self.stack.push(v);
                }
                b'G' => {
                    let v = f64::from_be_bytes(self.bytes::<8>()?);
                    self.stack.push(V::Float(v));
                }
                0x8c | b'X' | 0x8d => {
                    let n = match op {
                        0x8c => self.bytes::<1>()?[0] as u64,
                        b'X' => u32::from_le_bytes(self.bytes::<4>()?) as u64,
                        _ => u64::from_le_bytes(self.bytes::<8>()?),
                    };
                    over_limit(n)?;
                    self.need(n as usize)?;
                    let v = self.string(n as usize)?;
                    self.stack.push(v);
                }
                b'C' | b'B' | 0x8e | 0x96 => {
                    let n = match op {
                        b'C' => self.bytes::<1>()?[0] as u64,
                        b'B' => u32::from_le_bytes(self.bytes::<4>()?) as u64,
                        _ => u64::from_le_bytes(self.bytes::<8>()?),
                    };
                    over_limit(n)?;
                    self.need(n as usize)?;
                    self.pos += n as usize;
                    let (start, len) = self.arena(n as usize)?;
                    self.stack.push(V::Bytes { start, len });
                }
                b'}' => self.push_dict()?,
                b']' => self.push_list()?,
                b')' => {
                    let id = self.new_seq(Vec::new(), false);
                    self.stack.push(V::Tuple(id));
                }
                0x8f => {
                    let id = self.new_seq(Vec::new(), false);
                    self.stack.push(V::Set(id));
                }
                0x85..=0x87 => {
                    let n = (op - 0x84) as usize;
                    if self.stack.len() < self.base() + n {
                        return unstreamable("stack underflow");
                    }
                    let items = self.stack.split_off(self.stack.len() - n);
                    if items.iter().any(|v| v.is_role()) {
                        return unstreamable("the snapshot's structure in a tuple");
                    }
                    let id = self.new_seq(items, false);
                    self.stack.push(V::Tuple(id));
                }
                b't' | b'l' | 0x91 => {
                    let Some(start) = self.marks.pop() else { return unstreamable("no MARK") };
                    let items = self.stack.split_off(start);
                    if items.iter().any(|v| v.is_role()) {
                        return unstreamable("the snapshot's structure in a tuple");
                    }
                    let id = self.new_seq(items, false);
                    self.stack.push(match op {
                        b't' => V::Tuple(id),
                        b'l' => V::List(id),
                        _ => V::FrozenSet(id),
                    });
                }
                b'd' => {
                    let Some(start) = self.marks.pop() else { return unstreamable("no MARK") };
                    let id = self.new_dict(Vec::new());
                    self.set_items(V::Dict(id), start)?;
                    self.stack.push(V::Dict(id));
                }
                b'a' => {
                    let n = self.stack.len();
                    if n < self.base() + 2 {
                        return unstreamable("stack underflow");
                    }
                    let target = self.stack[n - 2];
                    self.append(target, n - 1)?;
                }
                b'e' => {
                    let Some(start) = self.marks.pop() else { return unstreamable("no MARK") };
                    if start == 0 || start - 1 < self.base() {
                        return unstreamable("stack underflow");
                    }
                    let target = self.stack[start - 1];
                    self.append(target, start)?;
                }
                b's' => {
                    let n = self.stack.len();
                    if n < self.base() + 3 {
                        return unstreamable("stack underflow");
                    }
                    let target = self.stack[n - 3];
                    self.set_items(target, n - 2)?;
                }
                b'u' => {
                    let Some(start) = self.marks.pop() else { return unstreamable("no MARK") };
                    if start == 0 || start - 1 < self.base() {
                        return unstreamable("stack underflow");
                    }
                    let target = self.stack[start - 1];
                    self.set_items(target, start)?;
                }
                0x90 => {
                    let Some(start) = self.marks.pop() else { return unstreamable("no MARK") };
                    if start == 0 || start - 1 < self.base() {
                        return unstreamable("stack underflow");
                    }
                    let V::Set(id) = self.stack[start - 1] else { return unstreamable("ADDITEMS to a non-set") };
                    for i in start..self.stack.len() {
                        let v = self.stack[i];
                        if v.is_role() {
                            return unstreamable("the snapshot's structure in a set");
                        }
                        self.seqs[id as usize].push(v);
                    }
                    self.stack.truncate(start);
                }
                0x94 => {
                    let v = self.top_value();
                    if v == V::Absent {
                        return unstreamable("MEMOIZE on an empty stack");
                    }
                    self.memo_put(self.memo.count, v)?;
                }
                b'q' | b'r' => {
                    let i = if op == b'q' { self.bytes::<1>()?[0] as u64 } else { u32::from_le_bytes(self.bytes::<4>()?) as u64 };
                    let v = self.top_value();
                    if v == V::Absent {
                        return unstreamable("a memo put on an empty stack");
                    }
                    self.memo_put(i, v)?;
                }
                b'h' => {
                    let [i] = self.bytes::<1>()?;
                    let v = self.memo_get(i as u64)?;
                    self.stack.push(v);
                }
                b'j' => {
                    let i = u32::from_le_bytes(self.bytes::<4>()?);
                    let v = self.memo_get(i as u64)?;
                    self.stack.push(v);
                }
                _ => {
                    return unstreamable(format!("pickle opcode {} is not read by the stream", pickle::opcode_name(op).unwrap_or("(unknown)")));
                }
            }
            if !self.out.is_empty() {
                return Ok(());
            }
        }
        Ok(())
    }

    /// The byte-level fast path for one entry dict at `pos` (an `EMPTY_DICT` where an entry
    /// begins): `EMPTY_DICT`, a memo put, `MARK`, then key/value pairs whose keys are memo
    /// references to entry keys, and whose values are ints (`BININT*`, `LONG1`), memo references
    /// or short strings (with their memo puts), then `SETITEMS`. Converts the entry as
    /// [`Vm::convert`] would, pushes it and returns `true`; returns `false` without changing
    /// anything when the bytes are not of that form or the entry is not valid (the general
    /// machine then reads them and decides).
    #[inline]
    fn fast_entry(&mut self) -> Result<bool, TraceError> {
        const WINDOW: usize = 1024;
        const INT_FIELD: [bool; FIELDS] = [false, true, true, true, true, true, false, false, false];
        if self.end - self.pos < WINDOW {
            self.refill(WINDOW)?;
        }
        let b = &self.buf[self.pos..self.end];
        let b = &b[..b.len().min(WINDOW)];
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]) as u64;
        let mut i = 1;
        let mut memo_next = self.memo.count;
        // The entry dict's own memo put.
        match b.get(i) {
            Some(0x94) => i += 1,
            Some(b'q') if b.get(i + 1).map(|&x| x as u64) == Some(memo_next) => i += 2,
            Some(b'r') if b.len() > i + 4 && u32_at(i + 1) == memo_next => i += 5,
            _ => return Ok(false),
        }
        memo_next += 1;
        if b.get(i) != Some(&b'(') {
            return Ok(false);
        }
        i += 1;
        let mut ints = [0i64; FIELDS];
        let mut have = 0u32;
        let mut action = 0u32;
        let mut frames = V::Absent;
        // Strings this entry made: (memo index or u64::MAX, start in `b`, length, word code;
        // `FRESH_STACK`: the frames list read by `inline_frames`, its frames in `frame_key`).
        let mut fresh = [(0u64, 0usize, 0usize, 0u32); 4];
        let mut nfresh = 0usize;
        // compile_context and user_metadata: a value, or `V::Entry(k)` for `fresh[k]`.
        let mut meta = [V::Absent; 2];
        let mut inline = false;
        // The inline frames list's stack, when `frames_seen` knew its bytes.
        let mut known = None;
        let memo = &self.memo;
        loop {
            if i + 12 > b.len() {
                return Ok(false);
            }
            let kw: &[u8; 12] = b[i..i + 12].try_into().map_err(|_| TraceError::Unstreamable("window".into()))?;
            let code = match kw[0] {
                b'h' => {
                    i += 2;
                    memo.code(kw[1] as u64)
                }
                b'j' => {
                    i += 5;
                    memo.code(u32::from_le_bytes([kw[1], kw[2], kw[3], kw[4]]) as u64)
                }
                b'u' => {
                    i += 1;
                    break;
                }
                _ => return Ok(false),
            };
            let k = code.wrapping_sub(1) as usize;
            if k >= FIELDS || i + 12 > b.len() {
                return Ok(false);
            }
            // The value's opcode and up to 11 argument bytes (one bounds check).
            let w: &[u8; 12] = b[i..i + 12].try_into().map_err(|_| TraceError::Unstreamable("window".into()))?;
            match w[0] {
                op @ (b'K' | b'M' | b'J' | 0x8a) => {
                    let x = match op {
                        b'K' => {
                            i += 2;
                            w[1] as i64
                        }
                        b'M' => {
                            i += 3;
                            u16::from_le_bytes([w[1], w[2]]) as i64
                        }
                        b'J' => {
                            i += 5;
                            i32::from_le_bytes([w[1], w[2], w[3], w[4]]) as i64
                        }
                        _ => {
                            let n = w[1] as usize;
                            if n > 8 {
                                return Ok(false);
                            }
                            // The n bytes, sign-extended (8 bytes are in the window).
                            let raw = u64::from_le_bytes([w[2], w[3], w[4], w[5], w[6], w[7], w[8], w[9]]);
                            i += 2 + n;
                            if n == 0 {
                                0
                            } else {
                                let sh = 64 - 8 * n as u32;
                                ((raw << sh) as i64) >> sh
                            }
                        }
                    };
                    if !INT_FIELD[k] {
                        return Ok(false);
                    }
                    ints[k] = x;
                }
                op @ (b'h' | b'j') => {
                    let c = if op == b'h' {
                        i += 2;
                        memo.code(w[1] as u64)
                    } else {
                        i += 5;
                        memo.code(u32::from_le_bytes([w[1], w[2], w[3], w[4]]) as u64)
                    };
                    let w = c.wrapping_sub(1);
                    match k {
                        F_ACTION if (W_FIRST_ACTION as u32..W_FIRST_ACTION as u32 + 10).contains(&w) => action = w,
                        F_CC | F_UM if c != 0 && c < TAG_STACK => meta[k - F_CC] = V::Word(w as u8),
                        F_CC | F_UM if c >= TAG_KEPT && matches!(memo.decode(c), V::Str { .. }) => meta[k - F_CC] = memo.decode(c),
                        F_FRAMES if c >= TAG_STACK => {
                            frames = memo.decode(c);
                            if !matches!(frames, V::Stack(_) | V::List(_) | V::Tuple(_)) {
                                return Ok(false);
                            }
                        }
                        _ if INT_FIELD[k] && c >= TAG_KEPT => match memo.decode(c) {
                            V::Int(x) => ints[k] = x,
                            _ => return Ok(false),
                        },
                        _ => return Ok(false),
                    }
                }
                0x8c => {
                    let n = b[i + 1] as usize;
                    if i + 2 + n + 6 > b.len() || nfresh == fresh.len() {
                        return Ok(false);
                    }
                    let start = i + 2;
                    let s = &b[start..start + n];
                    i += 2 + n;
                    let w = word(s);
                    match (k, w) {
                        (F_ACTION, Some(w)) if (W_FIRST_ACTION..W_FIRST_ACTION + 10).contains(&w) => action = w as u32,
                        (F_CC | F_UM, Some(_)) => {}
                        (F_CC | F_UM, None) if std::str::from_utf8(s).is_ok() => {}
                        _ => return Ok(false),
                    }
                    let idx = match b[i] {
                        0x94 => {
                            i += 1;
                            memo_next += 1;
                            memo_next - 1
                        }
                        b'q' if b[i + 1] as u64 == memo_next => {
                            i += 2;
                            memo_next += 1;
                            memo_next - 1
                        }
                        b'r' if u32_at(i + 1) == memo_next => {
                            i += 5;
                            memo_next += 1;
                            memo_next - 1
                        }
                        _ => u64::MAX,
                    };
                    if k != F_ACTION {
                        meta[k - F_CC] = V::Entry(nfresh as u32);
                    }
                    fresh[nfresh] = (idx, start, n, w.map_or(0, |w| w as u32 + 1));
                    nfresh += 1;
                }
                b']' if k == F_FRAMES && nfresh < fresh.len() && !inline => {
                    inline = true;
                    let Some((start, next)) = frames_extent(b, i, memo_next) else { return Ok(false) };
                    known = self.frames_seen.get(&b[start..next]).copied();
                    if known.is_none() {
                        self.frame_key.clear();
                        if frame_dicts(&b[start..next], memo, &mut self.frame_key).is_none() {
                            return Ok(false);
                        }
                    }
                    i = next;
                    fresh[nfresh] = (memo_next, start, next - start, FRESH_STACK);
                    nfresh += 1;
                    memo_next += 1;
                    frames = FRESH_FRAMES;
                }
                _ => return Ok(false),
            }
            have |= 1 << k;
        }
        // The entry, as `convert` makes it.
        if have & 1 << F_ACTION == 0 {
            return Ok(false);
        }
        let act = ACTIONS[(action - W_FIRST_ACTION as u32) as usize];
        let lenient = act == Action::Annotate;
        let af = if act == Action::Oom && have & 1 << F_DEVICE_FREE != 0 { F_DEVICE_FREE } else { F_ADDR };
        let field = |f: usize| -> Option<u64> {
            if have & 1 << f != 0 {
                u64::try_from(ints[f]).ok()
            } else if lenient {
                Some(0)
            } else {
                None
            }
        };
        let (Some(addr), Some(size)) = (field(af), field(F_SIZE)) else { return Ok(false) };
        let stream = ints[F_STREAM] as u64;
        let time_us = ints[F_TIME];
        if let V::List(id) | V::Tuple(id) = frames
            && (self.seq_memo[id as usize] != GENERIC_SEQ || !self.seq_checked[id as usize] && !self.seqs[id as usize].iter().all(|v| matches!(v, V::Dict(_))))
        {
            return Ok(false);
        }
        // Success: the memo puts, in order.
        let base = self.pos;
        self.pos += i;
        self.memo.count += 1; // the entry dict (not kept; a fresh index is empty)
        for &(idx, start, n, w) in &fresh[..nfresh] {
            if idx == u64::MAX {
                continue;
            }
            if w == FRESH_STACK {
                let sid = match known {
                    Some(sid) => sid,
                    None => {
                        // Interned only where the stacks are kept.
                        let sid = if self.mode == Mode::Collect {
                            let key = std::mem::take(&mut self.frame_key);
                            let sid = self.intern_stack(&key);
                            self.frame_key = key;
                            sid
                        } else {
                            0
                        };
                        if self.frames_seen_bytes + n <= FRAMES_SEEN_BYTES {
                            self.frames_seen_bytes += n;
                            self.frames_seen.insert(self.buf[base + start..base + start + n].into(), sid);
                        }
                        sid
                    }
                };
                if frames == FRESH_FRAMES {
                    frames = V::Stack(sid);
                }
                self.memo.put(idx, V::Stack(sid))?;
                continue;
            }
            let v = if w != 0 {
                V::Word((w - 1) as u8)
            } else {
                let at = self.strs.len();
                if at + n > u32::MAX as usize {
                    return unstreamable("more than 4 GiB of strings");
                }
                self.strs.extend_from_slice(&self.buf[base + start..base + start + n]);
                V::Str { start: at as u32, len: n as u32 }
            };
            self.memo.put(idx, v)?;
        }
        if let V::List(id) | V::Tuple(id) = frames {
            self.seq_checked[id as usize] = true;
        }
        if self.mode == Mode::Scan && !act.is_segment_event() {
            // The first pass keeps only segment entries: counted when appended.
            self.stack.push(V::Entry(SKIPPED));
            return Ok(true);
        }
        let (stack, meta) = if self.mode == Mode::Collect { self.fast_stack_meta(frames, meta, &fresh, base)? } else { (0, 0) };
        let e = TraceEntry { action: act, addr, size, stream, time_us, stack, meta };
        let id = match self.ready_free.pop() {
            Some(id) => {
                self.ready[id as usize] = e;
                id
            }
            None => {
                self.ready.push(e);
                (self.ready.len() - 1) as u32
            }
        };
        self.stack.push(V::Entry(id | READY));
        Ok(true)
    }

    /// [`Mode::Collect`]: the stack and metadata of an entry the fast path read (`meta`'s
    /// `V::Entry(k)`: the string of `fresh[k]`, at `base` in the buffer).
    fn fast_stack_meta(&mut self, frames: V, meta: [V; 2], fresh: &[(u64, usize, usize, u32)], base: usize) -> Result<(u32, u32), TraceError> {
        let stack = self.stack_of(frames)?;
        let text = |v: V, default: &'static [u8]| -> &[u8] {
            match v {
                V::Entry(k) => {
                    let (_, start, n, _) = fresh[k as usize];
                    &self.buf[base + start..base + start + n]
                }
                v => str_of(&self.strs, v, default),
            }
        };
        let (cc, um) = (text(meta[0], NO_CC), text(meta[1], b""));
        let meta = intern_meta(&mut self.meta_ids, &mut self.metas, &mut self.meta_key, cc, um)?;
        Ok((stack, meta))
    }

    /// The segments, settings and annotations as [`crate::snapshot`] reads them.
    /// The final segments, read before `device_traces` (the value under `segments` among the
    /// top-level dict's items on the stack): what [`Vm::header`] gives at the end, unless the
    /// file changes them later (the caller checks).
    fn early_segments(&self) -> Option<Vec<SnapshotSegment>> {
        // Set already (one `SETITEM` a key), or among the items of the top-level `SETITEMS`.
        let v = if self.top[0] != V::Absent {
            self.top[0]
        } else {
            let items = self.stack.get(*self.marks.last()?..)?;
            items.chunks_exact(2).find(|p| p[0] == V::Word(W_SEGMENTS))?[1]
        };
        let mut t = Translate { vm: self, seqs: Vec::new(), dicts: Vec::new(), seq_ids: HashMap::new(), dict_ids: HashMap::new() };
        let value = t.value(v, 0).ok()?;
        let Translate { seqs, dicts, .. } = t;
        let d = pickle::Decoded::from_parts(&self.strs, seqs, dicts, Value::None);
        crate::snapshot::header_from_decoded(&d, Some(value), None, None).ok().map(|(segments, _)| segments)
    }

    fn header(&self) -> Result<(Vec<SnapshotSegment>, RecordedSettings), TraceError> {
        let mut t = Translate { vm: self, seqs: Vec::new(), dicts: Vec::new(), seq_ids: HashMap::new(), dict_ids: HashMap::new() };
        let mut vals = [None; 4];
        for (k, v) in self.top.iter().enumerate() {
            if k != 1 && *v != V::Absent {
                vals[k] = Some(t.value(*v, 0)?);
            }
        }
        let Translate { seqs, dicts, .. } = t;
        let d = pickle::Decoded::from_parts(&self.strs, seqs, dicts, Value::None);
        crate::snapshot::header_from_decoded(&d, vals[0], vals[2], vals[3]).map_err(|e| TraceError::Unstreamable(e.to_string()))
    }
}

impl Vm {
    /// [`Mode::Scan`], at the end: what [`PickleFile::scan`] returns.
    fn into_scan(mut self) -> Result<PickleScan, TraceError> {
        let (segments, settings) = self.header()?;
        let devices = self.devices as usize;
        let mut segment_entries = std::mem::take(&mut self.segment_entries);
        segment_entries.resize_with(devices.max(segment_entries.len()), Vec::new);
        Ok(PickleScan { settings, devices, segments, segment_entries, entries: self.entry_count })
    }

    /// [`Mode::Collect`], at the end: the snapshot, its stacks converted and numbered as
    /// [`crate::snapshot`] numbers them (by first use: the entries', then the blocks').
    fn into_snapshot(mut self) -> Result<crate::Snapshot, TraceError> {
        let mut traces = std::mem::take(&mut self.traces);
        traces.resize_with(traces.len().max(self.devices as usize), Vec::new);
        let mut keys: Vec<&[u32]> = vec![&[]; self.stacks.len()];
        for (k, &sid) in &self.stacks {
            keys[sid as usize] = k;
        }
        // The stacks the entries use, in order of first use (an entry's `stack`: one more than
        // its key's id).
        let mut first_use = vec![u32::MAX; keys.len() + 1];
        let mut used: Vec<u32> = Vec::new();
        for e in traces.iter().flatten() {
            let s = e.stack as usize;
            if s != 0 && first_use[s] == u32::MAX {
                first_use[s] = used.len() as u32;
                used.push(e.stack - 1);
            }
        }
        let mut t = Translate { vm: &self, seqs: Vec::new(), dicts: Vec::new(), seq_ids: HashMap::new(), dict_ids: HashMap::new() };
        let mut lists = Vec::with_capacity(used.len());
        for &sid in &used {
            let mut items = Vec::with_capacity(keys[sid as usize].len());
            for &d in keys[sid as usize] {
                items.push(t.value(V::Dict(d), 0)?);
            }
            lists.push(Value::List(t.seqs.len() as u32));
            t.seqs.push(items);
        }
        let mut vals = [None; 4];
        for (k, v) in self.top.iter().enumerate() {
            if k != 1 && *v != V::Absent {
                vals[k] = Some(t.value(*v, 0)?);
            }
        }
        let Translate { seqs, dicts, .. } = t;
        let d = pickle::Decoded::from_parts(&self.strs, seqs, dicts, Value::None);
        let h = crate::snapshot::compact_header_from_decoded(&d, &lists, vals[0], vals[2], vals[3]).map_err(|e| TraceError::Unstreamable(e.to_string()))?;
        // Metadata too is numbered by first use (the fast path interns it when it reads an
        // entry, the general machine when the entry is appended).
        let metas = std::mem::take(&mut self.metas).into_metas();
        let mut meta_ids = vec![0u32; metas.len() + 1];
        let mut entry_metas = Vec::with_capacity(metas.len());
        for e in traces.iter_mut().flatten() {
            if e.stack != 0 {
                e.stack = h.stack_ids[first_use[e.stack as usize] as usize];
            }
            if e.meta != 0 {
                let m = &mut meta_ids[e.meta as usize];
                if *m == 0 {
                    entry_metas.push(metas[e.meta as usize - 1].clone());
                    *m = entry_metas.len() as u32;
                }
                e.meta = *m;
            }
        }
        Ok(crate::Snapshot {
            segments: h.segments,
            device_traces: traces,
            settings: h.settings,
            stacks: h.stacks,
            annotations: h.annotations,
            entry_metas,
            segments_only: false,
        })
    }
}

/// The stream's values as [`pickle::Value`]s (for the segments, settings and annotations).
struct Translate<'v> {
    vm: &'v Vm,
    seqs: Vec<Vec<Value>>,
    dicts: Vec<Vec<(Value, Value)>>,
    seq_ids: HashMap<u32, u32>,
    dict_ids: HashMap<u32, u32>,
}

impl Translate<'_> {
    fn value(&mut self, v: V, depth: usize) -> Result<Value, TraceError> {
        if depth > 1000 {
            return unstreamable("values nested too deep");
        }
        Ok(match v {
            V::None => Value::None,
            V::Bool(b) => Value::Bool(b),
            V::Int(i) => Value::Int(i),
            V::Big { start, len } => Value::BigInt { start: start as u64, len },
            V::Float(f) => Value::Float(f),
            V::Str { start, len } => Value::Str { start: start as u64, len },
            V::Word(w) => {
                let (start, len) = self.vm.word_spans[w as usize];
                Value::Str { start: start as u64, len }
            }
            V::Bytes { start, len } => Value::Bytes { start: start as u64, len },
            V::List(id) | V::Tuple(id) | V::Set(id) | V::FrozenSet(id) => {
                let new = match self.seq_ids.get(&id) {
                    Some(&n) => n,
                    None => {
                        let n = self.seqs.len() as u32;
                        self.seqs.push(Vec::new());
                        self.seq_ids.insert(id, n);
                        let mut items = Vec::with_capacity(self.vm.seqs[id as usize].len());
                        for &x in &self.vm.seqs[id as usize] {
                            items.push(self.value(x, depth + 1)?);
                        }
                        self.seqs[n as usize] = items;
                        n
                    }
                };
                match v {
                    V::List(_) => Value::List(new),
                    V::Tuple(_) => Value::Tuple(new),
                    V::Set(_) => Value::Set(new),
                    _ => Value::FrozenSet(new),
                }
            }
            V::Dict(id) => {
                let new = match self.dict_ids.get(&id) {
                    Some(&n) => n,
                    None => {
                        let n = self.dicts.len() as u32;
                        self.dicts.push(Vec::new());
                        self.dict_ids.insert(id, n);
                        let mut pairs = Vec::with_capacity(self.vm.dicts[id as usize].len());
                        for &(k, x) in &self.vm.dicts[id as usize] {
                            pairs.push((self.value(k, depth + 1)?, self.value(x, depth + 1)?));
                        }
                        self.dicts[n as usize] = pairs;
                        n
                    }
                };
                Value::Dict(new)
            }
            V::Absent | V::Top | V::DeviceTraces | V::DeviceList(_) | V::Entry(_) | V::Stack(_) => {
                return unstreamable("the snapshot's structure inside its segments, settings or annotations");
            }
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Files

/// What [`PickleFile::first_pass`] read.
#[derive(Clone, Debug, PartialEq)]
pub enum FirstPass {
    /// The whole snapshot (at most the number of entries asked for).
    Whole(crate::Snapshot),
    /// What [`PickleFile::scan`] reads (more entries than that).
    Scan(PickleScan),
}

/// A snapshot pickle file, plain or gzip'd, read by [`PickleFile::scan`] and
/// [`PickleFile::events`] as often as needed.
#[derive(Clone, Debug)]
pub struct PickleFile {
    path: PathBuf,
    gzip: bool,
    /// Bytes instead of a file (tests, benches).
    bytes: Option<std::sync::Arc<[u8]>>,
}

impl PickleFile {
    /// `Some` when `path` holds a pickle (after gunzipping, its first byte is the `PROTO`
    /// opcode, which every pickle of protocol ≥ 2 starts with); `None` for anything else, and for
    /// a file whose first bytes cannot be read (then [`crate::read_trace`] says why).
    pub fn open(path: &Path) -> Result<Option<PickleFile>, TraceError> {
        let io = |e| TraceError::Io { path: path.display().to_string(), source: e };
        let mut f = std::fs::File::open(path).map_err(io)?;
        let mut head = [0u8; 2];
        let gzip = match f.read_exact(&mut head) {
            Ok(()) => head == [0x1f, 0x8b],
            Err(_) => return Ok(None),
        };
        let file = PickleFile { path: path.to_path_buf(), gzip, bytes: None };
        let first = if gzip {
            let mut z = crate::input::GzReader::new(std::io::BufReader::new(std::fs::File::open(path).map_err(io)?));
            let mut b = [0u8; 1];
            match z.read_exact(&mut b) {
                Ok(()) => b[0],
                Err(_) => return Ok(None),
            }
        } else {
            head[0]
        };
        Ok((first == 0x80).then_some(file))
    }

    /// A pickle held in memory (not gzip'd; a `Vec<u8>`, or a slice, which is copied).
    pub fn from_bytes(bytes: impl Into<std::sync::Arc<[u8]>>) -> PickleFile {
        PickleFile { path: PathBuf::from("(memory)"), gzip: false, bytes: Some(bytes.into()) }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file's size on disk (compressed, for a gzip'd one).
    pub fn len(&self) -> u64 {
        match &self.bytes {
            Some(b) => b.len() as u64,
            None => std::fs::metadata(&self.path).map_or(0, |m| m.len()),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn input(&self) -> Result<Input, TraceError> {
        if let Some(b) = &self.bytes {
            return Ok(Input::Bytes { bytes: b.clone(), at: 0 });
        }
        let f = std::fs::File::open(&self.path).map_err(|e| TraceError::Io { path: self.path.display().to_string(), source: e })?;
        Ok(if self.gzip { gunzip_thread(f) } else { reader_thread(f) })
    }

    /// The first pass: the settings, the number of devices, the final segments and every
    /// device's segment events. [`TraceError::Unstreamable`] when the file is not of the shape
    /// the stream reads (or not valid): read it whole instead.
    pub fn scan(&self) -> Result<PickleScan, TraceError> {
        let mut vm = Vm::new(self.input()?, Mode::Scan);
        vm.run()?;
        vm.into_scan()
    }

    /// A first pass that reads the whole snapshot, as [`PickleFile::compact`], when it holds at
    /// most `max_entries` trace entries, and is [`PickleFile::scan`] otherwise (the entries read
    /// until there were more are then dropped): a replay then needs no second pass over a small
    /// file, and memory stays bounded (by `max_entries` entries of 48 bytes) for a large one.
    pub fn first_pass(&self, max_entries: u64) -> Result<FirstPass, TraceError> {
        self.first_pass_with(max_entries, None)
    }

    /// [`PickleFile::first_pass`], also sending to `tee` what it reads as it reads it: the final
    /// segments when they come before the traces, then the entries ([`TeeEvents`]), for a replay
    /// on another thread that starts before the first pass ends. The entries end without an
    /// error only when the snapshot was read whole ([`FirstPass::Whole`]).
    pub fn first_pass_teed(&self, max_entries: u64, tee: Tee) -> Result<FirstPass, TraceError> {
        self.first_pass_with(max_entries, Some(tee))
    }

    fn first_pass_with(&self, max_entries: u64, tee: Option<Tee>) -> Result<FirstPass, TraceError> {
        let mut vm = Vm::new(self.input()?, Mode::Collect);
        vm.max_entries = max_entries;
        vm.tee = tee;
        vm.run()?;
        if vm.mode == Mode::Collect {
            let tee = vm.tee.take();
            let snap = vm.into_snapshot()?;
            if let Some(mut t) = tee {
                if !t.batch.is_empty() {
                    let rest = std::mem::take(&mut t.batch);
                    t.send(TeeMsg::Entries(rest));
                }
                t.send(TeeMsg::End(snap.settings.clone()));
            }
            return Ok(FirstPass::Whole(snap));
        }
        vm.into_scan().map(FirstPass::Scan)
    }

    /// The whole snapshot, read in one pass by the stream's machine: what
    /// [`crate::snapshot::from_pickle`] gives for the same bytes, in a fraction of its time and
    /// memory (each entry is converted when it is appended, frames lists are interned as they
    /// are read, and nothing of the pickle is kept but the memo's frame dicts and strings).
    /// [`TraceError::Unstreamable`] when the file is not of the shape the stream reads (or not
    /// valid): read it with [`crate::read_trace_whole`] instead, which also names what is wrong
    /// ([`crate::read_trace`] does both).
    pub fn compact(&self) -> Result<crate::Snapshot, TraceError> {
        let mut vm = Vm::new(self.input()?, Mode::Collect);
        vm.run()?;
        vm.into_snapshot()
    }

    /// The settings torch wrote near the end of the file, read from its last [`TAIL_SETTINGS`]
    /// bytes alone: torch writes `allocator_settings` after the traces, with only
    /// `external_annotations` after it. A gzip'd file's last bytes are inflated from its last
    /// deflate blocks without the rest ([`gzip_tail_settings`]). What a replay that starts before
    /// the first pass has read the file may assume (the first pass then checks it). `None` where
    /// those bytes do not hold the key and a value the general decoder reads on its own (one
    /// that refers to an earlier memo entry, say), or a gzip'd file's last blocks do not give
    /// them. `max_split_size_of` is the allocator's reading of a settings string (see
    /// [`gzip_tail_settings`]).
    pub fn tail_settings(&self, max_split_size_of: impl Fn(&str) -> Option<i64>) -> Option<RecordedSettings> {
        let tail = match &self.bytes {
            Some(b) => return settings_in_tail(&b[b.len().saturating_sub(TAIL_SETTINGS as usize)..]),
            None if !self.gzip => {
                use std::io::{Seek, SeekFrom};
                let mut f = std::fs::File::open(&self.path).ok()?;
                let len = f.metadata().ok()?.len();
                f.seek(SeekFrom::Start(len.saturating_sub(TAIL_SETTINGS))).ok()?;
                let mut v = Vec::new();
                f.read_to_end(&mut v).ok()?;
                v
            }
            None => return gzip_tail_settings(&self.path, max_split_size_of),
        };
        settings_in_tail(&tail)
    }

    /// The events, in file order, as `(device, entry)` (every `stack` and `meta` 0). After the
    /// first error the iterator ends; [`TraceError::Unstreamable`] means: read the file whole.
    pub fn events(&self) -> Result<Events, TraceError> {
        Ok(Events { vm: Some(Vm::new(self.input()?, Mode::Events)), at: 0 })
    }
}

/// The settings a gzip'd snapshot pickle holds, read from its last blocks without inflating the
/// rest ([`crate::gzip_tail`]; [`settings_in_known_tail`]); `None` where they cannot be read so.
/// `max_split_size_of` gives the `max_split_size` the allocator records for a
/// `PYTORCH_CUDA_ALLOC_CONF` string (`allocsim_model::AllocatorConfig::recorded_max_split_size`;
/// this crate knows formats, not how the allocator parses its settings).
pub fn gzip_tail_settings(path: &Path, max_split_size_of: impl Fn(&str) -> Option<i64>) -> Option<RecordedSettings> {
    crate::gzip_tail::known_tail(path, TAIL_SETTINGS as usize, |bytes, known| settings_in_known_tail(bytes, known, &max_split_size_of))
}

/// How much of a plain file's end [`PickleFile::tail_settings`] reads.
pub const TAIL_SETTINGS: u64 = 1 << 20;

/// The `allocator_settings` value in the last bytes of a snapshot pickle (see
/// [`PickleFile::tail_settings`]): the bytes after the key, up to the next key torch writes
/// (`external_annotations`) or the top-level dict's `SETITEMS` and `STOP`, decoded as a pickle
/// of their own (a reference to an earlier memo entry fails it, but for the one an unset
/// `PYTORCH_CUDA_ALLOC_CONF` makes) and converted as the whole-file decoders convert them.
fn settings_in_tail(tail: &[u8]) -> Option<RecordedSettings> {
    let (_, start, end) = settings_value_in(tail)?;
    settings_of_value(tail[start..end].to_vec())
}

/// [`settings_in_tail`] of the end of a gzip'd file read without the bytes before it
/// ([`crate::gzip_tail`]), where `known[i]` says whether `tail[i]` is the file's byte. Every byte
/// of the value must be known but for what deflate copied from before the bytes read, in two
/// places where only one thing can stand:
/// - three bytes after a key's memo put and before a string: the opening of a dict of several
///   items, `EMPTY_DICT`, `MEMOIZE`, `MARK` (CPython writes it before every such dict);
/// - two or five bytes after the `PYTORCH_CUDA_ALLOC_CONF` key and before a string: a reference
///   to an earlier memo entry (`BINGET`, `LONG_BINGET`), which [`settings_in_tail`] takes for
///   the empty string;
/// - bytes of `max_split_size`'s `BININT` (its low bytes are a multiple of 1 MiB's, which
///   deflate copies from sizes before): the value `max_split_size_of` gives for the conf string,
///   read in full ([`max_split_size_binint`]), where the bytes that are known agree with it.
///
/// What this reads is checked like every assumption of the replay that starts before the first
/// pass ends.
fn settings_in_known_tail(tail: &[u8], known: &[bool], max_split_size_of: &dyn Fn(&str) -> Option<i64>) -> Option<RecordedSettings> {
    let (key, start, end) = settings_value_in(tail)?;
    // The key and the next one (or the two closing bytes) must be read, not guessed.
    if !known[key..start].iter().all(|&k| k) || !known[end..(end + 2).min(tail.len())].iter().all(|&k| k) {
        return None;
    }
    let mut value = tail[start..end].to_vec();
    let known = &known[start..end];
    let mut i = 0;
    while i < value.len() {
        if known[i] {
            i += 1;
            continue;
        }
        let run = known[i..].iter().take_while(|&&k| !k).count();
        let before_string = value.get(i + run) == Some(&0x8c);
        // (At 0: after the `allocator_settings` key.)
        let after_key = i == 0 || value[i - 1] == 0x94;
        let after_conf = i >= CONF_KEY_PUT.len() && value[i - CONF_KEY_PUT.len()..i] == *CONF_KEY_PUT && known[i - CONF_KEY_PUT.len()..i].iter().all(|&k| k);
        let stands: &[u8] = match run {
            2 if after_conf => b"h\x00",
            5 if after_conf => b"j\x00\x00\x00\x00",
            3 if after_key => b"}\x94(",
            _ => {
                // Within `max_split_size`'s `BININT`: the value the conf gives, where the bytes
                // read agree with it.
                let at = memchr::memmem::find(&value, MAX_SPLIT)? + MAX_SPLIT.len();
                let int = max_split_size_binint(&value, max_split_size_of)?;
                if !known[at - MAX_SPLIT.len()..at].iter().all(|&k| k) || !(at..at + 5).contains(&i) || i + run > at + 5 {
                    return None;
                }
                if (at..at + 5).any(|j| known[j] && value[j] != int[j - at]) {
                    return None;
                }
                value[at..at + 5].copy_from_slice(&int);
                i = at + 5;
                continue;
            }
        };
        if !before_string {
            return None;
        }
        value[i..i + run].copy_from_slice(stands);
        i += run;
    }
    settings_of_value(value)
}

/// The `max_split_size` key and its memo put.
const MAX_SPLIT: &[u8] = b"\x8c\x0emax_split_size\x94";
/// The `PYTORCH_CUDA_ALLOC_CONF` key, and with its memo put.
const CONF_KEY: &[u8] = b"\x8c\x17PYTORCH_CUDA_ALLOC_CONF";
const CONF_KEY_PUT: &[u8] = b"\x8c\x17PYTORCH_CUDA_ALLOC_CONF\x94";

/// The `BININT` torch's snapshot holds for `max_split_size`: what `max_split_size_of` makes of
/// the `PYTORCH_CUDA_ALLOC_CONF` string in the settings pickle `value` (which must be read
/// whole). `None` where the conf cannot be read or is refused, or the value does not fit a
/// `BININT`.
fn max_split_size_binint(value: &[u8], max_split_size_of: &dyn Fn(&str) -> Option<i64>) -> Option<[u8; 5]> {
    let at = memchr::memmem::find(value, CONF_KEY_PUT)? + CONF_KEY_PUT.len();
    let conf = match value.get(at..)? {
        [0x8c, n, rest @ ..] => std::str::from_utf8(rest.get(..*n as usize)?).ok()?,
        // (The empty string, referred to.)
        [b'h', ..] | [b'j', ..] => "",
        _ => return None,
    };
    let v = i32::try_from(max_split_size_of(conf)?).ok()?;
    let mut int = [b'J', 0, 0, 0, 0];
    int[1..].copy_from_slice(&v.to_le_bytes());
    Some(int)
}

/// Where the `allocator_settings` key and its value lie in `tail` (see [`settings_in_tail`]):
/// the key's first byte, the value's first, the byte after it.
fn settings_value_in(tail: &[u8]) -> Option<(usize, usize, usize)> {
    const KEY: &[u8] = b"\x8c\x12allocator_settings";
    const NEXT: &[u8] = b"\x8c\x14external_annotations";
    let key = memchr::memmem::rfind(tail, KEY)?;
    let mut start = key + KEY.len();
    // The key's memo put, if any.
    start += match tail.get(start)? {
        0x94 => 1,
        b'q' => 2,
        b'r' => 5,
        _ => 0,
    };
    let rest = tail.get(start..)?;
    let end = memchr::memmem::find(rest, NEXT).unwrap_or(rest.len().checked_sub(2)?);
    Some((key, start, start + end))
}

/// The settings of an `allocator_settings` value's pickle bytes (see [`settings_in_tail`]).
fn settings_of_value(mut value: Vec<u8>) -> Option<RecordedSettings> {
    // `PYTORCH_CUDA_ALLOC_CONF` unset is the empty string, which CPython interns: the pickle
    // refers to where it first wrote it, before the tail. Taken for the empty string (what else
    // the reference could be is a string written earlier, which a setting's is not).
    if let Some(k) = memchr::memmem::find(&value, CONF_KEY) {
        let mut v = k + CONF_KEY.len();
        if value.get(v) == Some(&0x94) {
            v += 1;
        }
        let get = match value.get(v) {
            Some(b'h') => 2,
            Some(b'j') => 5,
            _ => 0,
        };
        if get > 0 && v + get <= value.len() {
            value.splice(v..v + get, [0x8c, 0]);
        }
    }
    let mut p = Vec::with_capacity(value.len() + 3);
    p.extend_from_slice(&[0x80, 4]);
    p.extend_from_slice(&value);
    p.push(b'.');
    let d = pickle::decode(&p).ok()?;
    let root = d.root();
    matches!(root, Value::Dict(_)).then_some(())?;
    crate::snapshot::header_from_decoded(&d, None, Some(root), None).ok().map(|(_, s)| s)
}

/// The entries of a snapshot pickle as a stream: see [`PickleFile::events`].
pub struct Events {
    vm: Option<Vm>,
    at: usize,
}

impl Events {
    /// The number of device lists read so far (all of them, at the end).
    pub fn devices(&self) -> usize {
        self.vm.as_ref().map_or(0, |v| v.devices as usize)
    }
}

impl Iterator for Events {
    type Item = Result<(usize, TraceEntry), TraceError>;

    #[inline]
    fn next(&mut self) -> Option<Self::Item> {
        let vm = self.vm.as_mut()?;
        if self.at < vm.out.len() {
            self.at += 1;
            return Some(Ok(vm.out[self.at - 1]));
        }
        vm.out.clear();
        self.at = 0;
        if vm.done {
            return None;
        }
        match vm.run() {
            Ok(()) => {
                if vm.out.is_empty() {
                    return None;
                }
                self.at = 1;
                Some(Ok(vm.out[0]))
            }
            Err(e) => {
                self.vm = None;
                Some(Err(e))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The last MiB of a recording in `traces/`, decompressed, and the settings it holds.
    fn recorded_tail(name: &str) -> (Vec<u8>, RecordedSettings) {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../traces").join(name);
        let mut raw = Vec::new();
        flate2::read::GzDecoder::new(std::fs::File::open(&path).unwrap()).read_to_end(&mut raw).unwrap();
        let settings = crate::snapshot::from_pickle(&raw).unwrap().settings;
        let tail = raw[raw.len().saturating_sub(TAIL_SETTINGS as usize)..].to_vec();
        (tail, settings)
    }

    /// `tail` with the bytes of `pattern`'s last occurrence from `from` to `to` unknown (their
    /// values garbled, as a fill would leave them).
    fn unknown(tail: &[u8], pattern: &[u8], from: usize, to: usize) -> (Vec<u8>, Vec<bool>) {
        let at = memchr::memmem::rfind(tail, pattern).unwrap();
        let (mut bytes, mut known) = (tail.to_vec(), vec![true; tail.len()]);
        for i in at + from..at + to {
            bytes[i] = 0x90;
            known[i] = false;
        }
        (bytes, known)
    }

    #[test]
    fn settings_are_read_from_bytes_some_of_which_are_unknown() {
        let (tail, settings) = recorded_tail("crossstream__msplit64__320M.pickle.gz");
        assert_eq!(settings.max_split_size, Some(64 << 20), "the recording this is for");
        let all = vec![true; tail.len()];
        let read = |b: &[u8], k: &[bool]| settings_in_known_tail(b, k, &allocsim_model::AllocatorConfig::recorded_max_split_size);
        assert_eq!(read(&tail, &all), Some(settings.clone()));
        // The dict's opening after the key, copied from before.
        let (b, k) = unknown(&tail, b"allocator_settings\x94}\x94(", 19, 22);
        assert_eq!(read(&b, &k), Some(settings.clone()), "the dict's opening");
        let (b, k) = unknown(&tail, b"roundup_power2_divisions\x94}\x94(", 25, 28);
        assert_eq!(read(&b, &k), Some(settings.clone()), "the inner dict's opening");
        // max_split_size's BININT: from the conf string, where the known bytes agree.
        for (from, to) in [(0, 2), (1, 4), (0, 5)] {
            let (b, k) = unknown(&tail, b"max_split_size\x94J\x00\x00\x00\x04", 15 + from, 15 + to);
            assert_eq!(read(&b, &k), Some(settings.clone()), "max_split_size's bytes {from}..{to}");
        }
        let (mut b, k) = unknown(&tail, b"max_split_size\x94J\x00\x00\x00\x04", 15, 17);
        let at = memchr::memmem::rfind(&b, b"\x00\x00\x04\x8c\x1cgarbage").unwrap();
        b[at + 2] = 0x05;
        assert_eq!(read(&b, &k), None, "known bytes that disagree with the conf");
        // What cannot be inferred: the conf string itself, another value, the key.
        for (pattern, from, to) in [
            (&b"max_split_size_mb:64"[..], 3, 6),
            (b"expandable_segments\x94\x89", 20, 21),
            (b"allocator_settings", 2, 5),
            (b"threads\x94K\x01", 8, 10),
            (b"max_split_size\x94J\x00\x00\x00\x04", 4, 17),
        ] {
            let (b, k) = unknown(&tail, pattern, from, to);
            assert_eq!(read(&b, &k), None, "{}", String::from_utf8_lossy(pattern));
        }
    }

    #[test]
    fn max_split_size_is_what_torch_makes_of_the_conf() {
        let value = |conf: &str| {
            let mut v = b"\x8c\x17PYTORCH_CUDA_ALLOC_CONF\x94".to_vec();
            v.push(0x8c);
            v.push(conf.len() as u8);
            v.extend_from_slice(conf.as_bytes());
            max_split_size_binint(&v, &allocsim_model::AllocatorConfig::recorded_max_split_size)
        };
        assert_eq!(value("max_split_size_mb:128"), Some(*b"J\x00\x00\x00\x08"));
        assert_eq!(value("expandable_segments:True, max_split_size_mb: 64"), Some(*b"J\x00\x00\x00\x04"));
        assert_eq!(value("max_split_size_mb:64,max_split_size_mb:512"), Some(*b"J\x00\x00\x00\x20"));
        assert_eq!(value("garbage_collection_threshold:0.6"), Some(*b"J\xff\xff\xff\xff"));
        assert_eq!(value(""), Some(*b"J\xff\xff\xff\xff"));
        // 2.11 takes 20 (at least `large_segment_size_mb`); below it is refused.
        assert_eq!(value("max_split_size_mb:20"), Some(*b"J\x00\x00\x40\x01"));
        // Refused by torch, or beyond a BININT: not inferred.
        assert_eq!(value("max_split_size_mb:19"), None);
        assert_eq!(value("max_split_size_mb:4096"), None);
        assert_eq!(value("max_split_size_mb:x"), None);
    }
}
