//! A pickle **writer** for builtin Python values, protocol 4, byte-compatible with CPython's C
//! pickler (`pickle.dumps(obj, protocol=4)`).
//!
//! What it writes, opcode by opcode, is what CPython 3.8+ writes for the same value:
//!
//! * `None` → NONE; `bool` → NEWTRUE/NEWFALSE.
//! * `int` → BININT1 (0..=0xff), BININT2 (0..=0xffff), BININT (the `i32` range), otherwise LONG1
//!   (LONG4 beyond 255 bytes) with the minimal little-endian two's-complement bytes.
//! * `float` → BINFLOAT (big-endian IEEE 754 double).
//! * `str` → SHORT_BINUNICODE (< 256 UTF-8 bytes), BINUNICODE, BINUNICODE8 (> 4 GiB);
//!   `bytes` → SHORT_BINBYTES, BINBYTES, BINBYTES8. Both are MEMOIZEd.
//! * `list` → EMPTY_LIST, MEMOIZE, then the items: one item with APPEND, more in batches of 1000
//!   between MARK and APPENDS.
//! * `dict` → EMPTY_DICT, MEMOIZE, then the pairs: one pair with SETITEM, more in batches of 1000
//!   between MARK and SETITEMS (like CPython, a dict of exactly k·1000 pairs ends with an empty
//!   `MARK SETITEMS` batch).
//! * `tuple` → EMPTY_TUPLE (not memoized); 1–3 items then TUPLE1/2/3; more between MARK and TUPLE;
//!   then MEMOIZE. `set` → EMPTY_SET, MEMOIZE, ADDITEMS batches; `frozenset` → MARK items FROZENSET
//!   MEMOIZE.
//! * A memoized object written again → BINGET (memo index < 256) or LONG_BINGET.
//! * Framing: PROTO 4 is followed by FRAME opcodes; a frame is closed at the first value boundary
//!   at which it holds at least 64 KiB, frames under 4 bytes get no header, and a `str`/`bytes`
//!   payload of 64 KiB or more is written outside any frame. STOP ends the last frame.
//!
//! CPython memoizes by object identity; this writer memoizes `str` and `bytes` **by content**
//! (one object per distinct string, which is what interning gives Python anyway) and containers
//! as they are written: the [`MemoId`] a container method returns lets the caller refer to the
//! same object again with [`Pickler::get`], so shared substructure (the frame lists of a memory
//! snapshot) stays shared after unpickling. Consequently, for a value that `pickle.loads` made
//! from this writer's output, `pickle.dumps(value, protocol=4)` gives back the same bytes (sets
//! aside: Python iterates them in hash order). [`Pickler::str_new_object`] writes a string that is
//! deliberately not shared, for output that must match a pickle of distinct equal strings.
//!
//! Nothing written here needs anything but builtin types to load: no GLOBAL, REDUCE or BUILD.

use std::collections::HashMap;

/// Index of a memoized object (the argument of BINGET / LONG_BINGET).
pub type MemoId = u32;

/// CPython's `_FRAME_SIZE_TARGET`.
pub const FRAME_SIZE_TARGET: usize = 64 * 1024;
/// CPython's `_FRAME_SIZE_MIN`: smaller frames are written without a FRAME header.
pub const FRAME_SIZE_MIN: usize = 4;
/// CPython's `_BATCHSIZE` for APPENDS / SETITEMS / ADDITEMS.
pub const BATCHSIZE: usize = 1000;

const FRAME_HEADER: usize = 9;

mod op {
    pub const MARK: u8 = b'(';
    pub const STOP: u8 = b'.';
    pub const BININT: u8 = b'J';
    pub const BININT1: u8 = b'K';
    pub const BININT2: u8 = b'M';
    pub const NONE: u8 = b'N';
    pub const BINUNICODE: u8 = b'X';
    pub const APPEND: u8 = b'a';
    pub const EMPTY_DICT: u8 = b'}';
    pub const APPENDS: u8 = b'e';
    pub const BINGET: u8 = b'h';
    pub const LONG_BINGET: u8 = b'j';
    pub const EMPTY_LIST: u8 = b']';
    pub const SETITEM: u8 = b's';
    pub const TUPLE: u8 = b't';
    pub const EMPTY_TUPLE: u8 = b')';
    pub const SETITEMS: u8 = b'u';
    pub const BINFLOAT: u8 = b'G';
    pub const BINBYTES: u8 = b'B';
    pub const SHORT_BINBYTES: u8 = b'C';
    pub const PROTO: u8 = 0x80;
    pub const TUPLE1: u8 = 0x85;
    pub const NEWTRUE: u8 = 0x88;
    pub const NEWFALSE: u8 = 0x89;
    pub const LONG1: u8 = 0x8a;
    pub const LONG4: u8 = 0x8b;
    pub const SHORT_BINUNICODE: u8 = 0x8c;
    pub const BINUNICODE8: u8 = 0x8d;
    pub const BINBYTES8: u8 = 0x8e;
    pub const EMPTY_SET: u8 = 0x8f;
    pub const ADDITEMS: u8 = 0x90;
    pub const FROZENSET: u8 = 0x91;
    pub const MEMOIZE: u8 = 0x94;
    pub const FRAME: u8 = 0x95;
}

/// An owned Python value for [`dumps`] (the builtin types this writer supports).
#[derive(Clone, Debug, PartialEq)]
pub enum PyValue {
    None,
    Bool(bool),
    Int(i128),
    /// An int of any size: little-endian two's-complement bytes (empty = 0).
    BigInt(Vec<u8>),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    List(Vec<PyValue>),
    Tuple(Vec<PyValue>),
    /// Pairs in insertion order (duplicate keys are written as given).
    Dict(Vec<(PyValue, PyValue)>),
    Set(Vec<PyValue>),
    FrozenSet(Vec<PyValue>),
}

/// Pickles `v` (protocol 4, framed), as `pickle.dumps(v, protocol=4)` would.
pub fn dumps(v: &PyValue) -> Vec<u8> {
    let mut p = Pickler::new();
    p.value(v);
    p.finish()
}

/// A protocol-4 pickle being written. Each method writes one value (one `save()` in CPython's
/// terms); container methods take the items and a closure that writes each of them.
/// [`Pickler::finish`] appends STOP and returns the bytes.
#[derive(Debug)]
pub struct Pickler {
    out: Vec<u8>,
    /// Offset of the open frame's header placeholder.
    frame: Option<usize>,
    memo_len: u32,
    strs: HashMap<Box<str>, MemoId>,
    bytes: HashMap<Box<[u8]>, MemoId>,
}

impl Default for Pickler {
    fn default() -> Self {
        Self::new()
    }
}

impl Pickler {
    /// Starts a pickle: PROTO 4, then framing.
    pub fn new() -> Self {
        Self::with_capacity(0)
    }

    /// Like [`Pickler::new`] with room for `n` bytes of output.
    pub fn with_capacity(n: usize) -> Self {
        let mut out = Vec::with_capacity(n.max(16));
        out.extend_from_slice(&[op::PROTO, 4]);
        Pickler { out, frame: None, memo_len: 0, strs: HashMap::new(), bytes: HashMap::new() }
    }

    /// Bytes written so far (including frame headers).
    pub fn bytes_written(&self) -> usize {
        self.out.len()
    }

    /// Number of objects memoized so far. A list, dict or set gets `memo_len()` as its id when it
    /// is started (before its items), so a recursive structure can refer to itself with
    /// [`Pickler::get`] from inside the item closure.
    pub fn memo_len(&self) -> u32 {
        self.memo_len
    }

    /// Writes STOP, closes the last frame and returns the pickle.
    pub fn finish(mut self) -> Vec<u8> {
        self.write(&[op::STOP]);
        self.commit_frame();
        self.out
    }

    // ---- framing

    #[inline]
    fn write(&mut self, b: &[u8]) {
        if self.frame.is_none() {
            self.frame = Some(self.out.len());
            self.out.extend_from_slice(&[0; FRAME_HEADER]);
        }
        self.out.extend_from_slice(b);
    }

    #[inline]
    fn write1(&mut self, b: u8) {
        self.write(&[b]);
    }

    fn commit_frame(&mut self) {
        let Some(start) = self.frame.take() else {
            return;
        };
        let len = self.out.len() - start - FRAME_HEADER;
        if len >= FRAME_SIZE_MIN {
            self.out[start] = op::FRAME;
            self.out[start + 1..start + FRAME_HEADER].copy_from_slice(&(len as u64).to_le_bytes());
        } else {
            self.out.drain(start..start + FRAME_HEADER);
        }
    }

    /// The start of a value (CPython commits a full frame at the start of each `save()`).
    #[inline]
    fn boundary(&mut self) {
        if let Some(start) = self.frame
            && self.out.len() - start - FRAME_HEADER >= FRAME_SIZE_TARGET
        {
            self.commit_frame();
        }
    }

    /// Opcode + length header + payload; payloads of 64 KiB or more go outside any frame.
    fn write_payload(&mut self, header: &[u8], data: &[u8]) {
        if data.len() >= FRAME_SIZE_TARGET {
            self.commit_frame();
            self.out.extend_from_slice(header);
            self.out.extend_from_slice(data);
        } else {
            self.write(header);
            self.write(data);
        }
    }

    // ---- memo

    /// MEMOIZE the object on top of the stack; `None` once the memo is full (2^32 − 1 objects).
    fn memoize(&mut self) -> Option<MemoId> {
        if self.memo_len == u32::MAX {
            return None;
        }
        self.write1(op::MEMOIZE);
        let id = self.memo_len;
        self.memo_len += 1;
        Some(id)
    }

    fn write_get(&mut self, id: MemoId) {
        if id < 256 {
            self.write(&[op::BINGET, id as u8]);
        } else {
            let b = id.to_le_bytes();
            self.write(&[op::LONG_BINGET, b[0], b[1], b[2], b[3]]);
        }
    }

    /// Writes a reference to an object memoized earlier (the same Python object again).
    pub fn get(&mut self, id: MemoId) {
        debug_assert!(id < self.memo_len, "memo id {id} not written yet");
        self.boundary();
        self.write_get(id);
    }

    // ---- atoms

    pub fn none(&mut self) {
        self.boundary();
        self.write1(op::NONE);
    }

    pub fn bool(&mut self, b: bool) {
        self.boundary();
        self.write1(if b { op::NEWTRUE } else { op::NEWFALSE });
    }

    pub fn int(&mut self, v: i64) {
        self.int128(v as i128);
    }

    pub fn uint(&mut self, v: u64) {
        self.int128(v as i128);
    }

    pub fn int128(&mut self, v: i128) {
        self.boundary();
        if (0..=0xff).contains(&v) {
            self.write(&[op::BININT1, v as u8]);
        } else if (0..=0xffff).contains(&v) {
            let b = (v as u16).to_le_bytes();
            self.write(&[op::BININT2, b[0], b[1]]);
        } else if (i32::MIN as i128..=i32::MAX as i128).contains(&v) {
            let b = (v as i32).to_le_bytes();
            self.write(&[op::BININT, b[0], b[1], b[2], b[3]]);
        } else {
            let mut b = v.to_le_bytes().to_vec();
            trim_twos(&mut b);
            self.long(&b);
        }
    }

    /// An int of any size, given as little-endian two's-complement bytes (empty = 0).
    pub fn bigint_le(&mut self, le: &[u8]) {
        let mut b = le.to_vec();
        if b.is_empty() {
            b.push(0);
        }
        trim_twos(&mut b);
        if b.len() <= 16 {
            let ext = if b[b.len() - 1] & 0x80 != 0 { 0xff } else { 0 };
            let mut buf = [ext; 16];
            buf[..b.len()].copy_from_slice(&b);
            self.int128(i128::from_le_bytes(buf));
        } else {
            self.boundary();
            self.long(&b);
        }
    }

    /// LONG1 / LONG4 with already minimal bytes.
    fn long(&mut self, b: &[u8]) {
        if b.len() < 256 {
            self.write(&[op::LONG1, b.len() as u8]);
        } else {
            let n = (b.len() as u32).to_le_bytes();
            self.write(&[op::LONG4, n[0], n[1], n[2], n[3]]);
        }
        self.write(b);
    }

    pub fn float(&mut self, f: f64) {
        self.boundary();
        let b = f.to_bits().to_be_bytes();
        self.write(&[op::BINFLOAT]);
        self.write(&b);
    }

    /// A `str`, memoized by content: the second time the same text is written it is a BINGET.
    pub fn str(&mut self, s: &str) {
        self.boundary();
        if let Some(&id) = self.strs.get(s) {
            self.write_get(id);
            return;
        }
        if let Some(id) = self.str_object(s) {
            self.strs.insert(s.into(), id);
        }
    }

    /// A new `str` object even if the same text was written before (what CPython writes for
    /// equal but distinct string objects); it is memoized, but not found by later [`Pickler::str`]
    /// calls. Returns its memo id.
    pub fn str_new_object(&mut self, s: &str) -> Option<MemoId> {
        self.boundary();
        self.str_object(s)
    }

    fn str_object(&mut self, s: &str) -> Option<MemoId> {
        let n = s.len();
        if n < 256 {
            self.write_payload(&[op::SHORT_BINUNICODE, n as u8], s.as_bytes());
        } else if n as u64 <= u32::MAX as u64 {
            let l = (n as u32).to_le_bytes();
            self.write_payload(&[op::BINUNICODE, l[0], l[1], l[2], l[3]], s.as_bytes());
        } else {
            let l = (n as u64).to_le_bytes();
            let mut h = [0u8; 9];
            h[0] = op::BINUNICODE8;
            h[1..].copy_from_slice(&l);
            self.write_payload(&h, s.as_bytes());
        }
        self.memoize()
    }

    /// A `bytes` object, memoized by content.
    pub fn bytes(&mut self, b: &[u8]) {
        self.boundary();
        if let Some(&id) = self.bytes.get(b) {
            self.write_get(id);
            return;
        }
        let n = b.len();
        if n < 256 {
            self.write_payload(&[op::SHORT_BINBYTES, n as u8], b);
        } else if n as u64 <= u32::MAX as u64 {
            let l = (n as u32).to_le_bytes();
            self.write_payload(&[op::BINBYTES, l[0], l[1], l[2], l[3]], b);
        } else {
            let l = (n as u64).to_le_bytes();
            let mut h = [0u8; 9];
            h[0] = op::BINBYTES8;
            h[1..].copy_from_slice(&l);
            self.write_payload(&h, b);
        }
        if let Some(id) = self.memoize() {
            self.bytes.insert(b.into(), id);
        }
    }

    // ---- containers

    /// Items in batches: `one` after a single item (when `single` allows it), otherwise batches
    /// of up to [`BATCHSIZE`] between MARK and `many`. `empty_tail`: CPython's dict/set loop,
    /// which writes one more (empty) batch after a full last batch.
    fn batches<I: Iterator>(&mut self, items: I, single: Option<u8>, many: u8, empty_tail: bool, each: &mut impl FnMut(&mut Self, I::Item)) {
        let mut it = items.peekable();
        let Some(first) = it.next() else {
            return;
        };
        if let Some(one) = single
            && it.peek().is_none()
        {
            each(self, first);
            self.write1(one);
            return;
        }
        let mut pending = Some(first);
        loop {
            self.write1(op::MARK);
            let mut n = 0;
            while n < BATCHSIZE {
                let Some(x) = pending.take().or_else(|| it.next()) else {
                    break;
                };
                each(self, x);
                n += 1;
            }
            self.write1(many);
            let more = it.peek().is_some();
            if !(more || (empty_tail && n == BATCHSIZE)) {
                break;
            }
        }
    }

    /// A `list`: EMPTY_LIST, MEMOIZE, then `each(self, item)` for every item (which must write
    /// exactly one value). Returns the list's memo id (`None` only when the memo is full).
    pub fn list<I: IntoIterator>(&mut self, items: I, mut each: impl FnMut(&mut Self, I::Item)) -> Option<MemoId> {
        self.boundary();
        self.write1(op::EMPTY_LIST);
        let id = self.memoize();
        self.batches(items.into_iter(), Some(op::APPEND), op::APPENDS, false, &mut each);
        id
    }

    /// A `dict`: EMPTY_DICT, MEMOIZE, then `each(self, item)` for every item (which must write
    /// exactly two values: the key, then the value). Returns the dict's memo id.
    pub fn dict<I: IntoIterator>(&mut self, items: I, mut each: impl FnMut(&mut Self, I::Item)) -> Option<MemoId> {
        self.boundary();
        self.write1(op::EMPTY_DICT);
        let id = self.memoize();
        self.batches(items.into_iter(), Some(op::SETITEM), op::SETITEMS, true, &mut each);
        id
    }

    /// A `tuple` (each item writes one value). The empty tuple is not memoized (`None`).
    pub fn tuple<I>(&mut self, items: I, mut each: impl FnMut(&mut Self, I::Item)) -> Option<MemoId>
    where
        I: IntoIterator,
        I::IntoIter: ExactSizeIterator,
    {
        self.boundary();
        let it = items.into_iter();
        let n = it.len();
        if n == 0 {
            self.write1(op::EMPTY_TUPLE);
            return None;
        }
        if n > 3 {
            self.write1(op::MARK);
        }
        let mut written = 0;
        for x in it {
            each(self, x);
            written += 1;
        }
        debug_assert_eq!(written, n, "ExactSizeIterator lied");
        self.write1(match n {
            1..=3 => op::TUPLE1 + (n as u8 - 1),
            _ => op::TUPLE,
        });
        self.memoize()
    }

    /// A `set`: EMPTY_SET, MEMOIZE, ADDITEMS batches.
    pub fn set<I: IntoIterator>(&mut self, items: I, mut each: impl FnMut(&mut Self, I::Item)) -> Option<MemoId> {
        self.boundary();
        self.write1(op::EMPTY_SET);
        let id = self.memoize();
        self.batches(items.into_iter(), None, op::ADDITEMS, true, &mut each);
        id
    }

    /// A `frozenset`: MARK, items, FROZENSET, MEMOIZE.
    pub fn frozenset<I: IntoIterator>(&mut self, items: I, mut each: impl FnMut(&mut Self, I::Item)) -> Option<MemoId> {
        self.boundary();
        self.write1(op::MARK);
        for x in items {
            each(self, x);
        }
        self.write1(op::FROZENSET);
        self.memoize()
    }

    /// Writes an owned value tree (containers are not shared; strings are, by content).
    pub fn value(&mut self, v: &PyValue) {
        match v {
            PyValue::None => self.none(),
            PyValue::Bool(b) => self.bool(*b),
            PyValue::Int(i) => self.int128(*i),
            PyValue::BigInt(b) => self.bigint_le(b),
            PyValue::Float(f) => self.float(*f),
            PyValue::Str(s) => self.str(s),
            PyValue::Bytes(b) => self.bytes(b),
            PyValue::List(items) => {
                self.list(items, |p, x| p.value(x));
            }
            PyValue::Tuple(items) => {
                self.tuple(items, |p, x| p.value(x));
            }
            PyValue::Dict(pairs) => {
                self.dict(pairs, |p, (k, x)| {
                    p.value(k);
                    p.value(x);
                });
            }
            PyValue::Set(items) => {
                self.set(items, |p, x| p.value(x));
            }
            PyValue::FrozenSet(items) => {
                self.frozenset(items, |p, x| p.value(x));
            }
        }
    }
}

/// Drops redundant sign-extension bytes of a little-endian two's-complement integer.
fn trim_twos(b: &mut Vec<u8>) {
    while b.len() > 1 {
        let top = b[b.len() - 1];
        let next = b[b.len() - 2];
        if (top == 0 && next & 0x80 == 0) || (top == 0xff && next & 0x80 != 0) {
            b.pop();
        } else {
            break;
        }
    }
}
