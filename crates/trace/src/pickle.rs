//! A small, **non-executing** pickle decoder for builtin Python types.
//!
//! It reads protocols 2–5 (what `pickle.dump` and torch's C++ pickler write) and the text opcodes
//! of protocols 0/1. Only values made of `None`, `bool`, `int`, `float`, `str`, `bytes`,
//! `bytearray`, `list`, `tuple`, `set`, `frozenset` and `dict` can be decoded. Every opcode that
//! would look up a global, call it or build an object (GLOBAL, STACK_GLOBAL, REDUCE, BUILD, INST,
//! OBJ, NEWOBJ, NEWOBJ_EX, PERSID, BINPERSID, EXT1/2/4, NEXT_BUFFER, READONLY_BUFFER) is refused
//! with a [`PickleError`] naming the opcode and its byte offset. Nothing is ever executed.
//!
//! # Representation
//!
//! A decoded value is a 16-byte `Copy` handle ([`Value`]). Strings, bytes and big integers are
//! spans of the input (zero-copy; text-protocol strings that needed unescaping live in a side
//! buffer of the [`Decoded`]). Containers are indices into arenas owned by the [`Decoded`]. The
//! memo holds handles, so a memo reference (`BINGET`) shares the container exactly like Python
//! does: real memory snapshots are DAGs (one frame dict is referenced from thousands of stacks) and
//! decoding them costs nothing extra. Cycles (`l = []; l.append(l)`) decode fine too; walkers of
//! the result must bound their recursion (see [`Decoded::depth_limited_repr`]).
//!
//! Differences from CPython's `pickle.loads` (none occur in memory snapshots):
//! * `bytearray` decodes as [`Value::Bytes`].
//! * dicts and sets keep the items as pickled, without merging duplicate keys/items;
//!   [`Decoded::dict_get`] returns the last matching pair, as Python's dict would hold.
//! * Protocol-0/1 8-bit strings (`STRING`, `BINSTRING`, `SHORT_BINSTRING`) decode as `str` when
//!   they are valid UTF-8 and as `bytes` otherwise (CPython's default would be strict ASCII).
//! * Strings with lone surrogates (which CPython accepts with `surrogatepass`) are an error.
//!
//! # Robustness
//!
//! Malformed input (truncated data, stack underflow, missing MARK, bad memo index, unknown opcode,
//! length fields larger than the remaining input or than [`MAX_VALUE_BYTES`], marks nested deeper
//! than [`MAX_MARK_DEPTH`], memo indices no pickler writes: [`MEMO_INDEX_SLACK`]) gives a
//! [`PickleError`] with the byte offset of the offending opcode; it never panics. Every length
//! field is checked against the limit and the remaining input before anything is allocated, and
//! each opcode adds O(1) handles (or moves existing ones), so memory is linear in the input size.

use std::collections::HashMap;

/// A decoding failure at byte `offset` of the input (the offset of the offending opcode).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("pickle error at byte {offset}: {msg}")]
pub struct PickleError {
    pub offset: usize,
    pub msg: String,
}

/// Index of a list, tuple, set or frozenset in [`Decoded`]'s sequence arena.
pub type SeqId = u32;
/// Index of a dict in [`Decoded`]'s dict arena.
pub type DictId = u32;

/// Most MARKs that may be open at once (deeper nesting is refused as malformed).
pub const MAX_MARK_DEPTH: usize = 100_000;
/// The most bytes one value may declare ([`crate::input::MAX_VALUE_BYTES`]).
pub use crate::input::MAX_VALUE_BYTES;

/// Memo indices up to this are taken wherever they come (CPython's C unpickler grows its memo
/// array to twice the index a put names, so these cost it at most 32 MiB); a larger one only at
/// or below the byte offset of its opcode. A pickler numbers its memo from 0, one index per
/// value memoized, each value at least one byte before its put, so no pickler writes a larger
/// index; CPython would need 16 bytes per unit of the index (an index of 2^31 − 1: 32 GiB), a
/// `MemoryError` in any ordinary process. Refused, naming the offset.
pub const MEMO_INDEX_SLACK: u64 = 1 << 20;

fn too_long(op: u8, n: u64) -> String {
    format!("{} declares {n} bytes, more than the {} MiB a snapshot value may hold (allocsim_trace::input::MAX_VALUE_BYTES)", name(op), MAX_VALUE_BYTES >> 20)
}

/// Python's default limit on the digits of a decimal integer (`sys.get_int_max_str_digits()`),
/// applied to the text opcodes INT and LONG.
pub const MAX_INT_DIGITS: usize = 4300;

/// A decoded Python value: a cheap `Copy` handle. Use [`Decoded`]'s accessors to look inside.
///
/// `start`/`len` spans address the input; a `start` at or beyond the input length addresses the
/// decoder's side buffer (unescaped text-protocol strings, text big ints).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Value {
    None,
    Bool(bool),
    Int(i64),
    /// An int outside `i64`: little-endian two's-complement bytes, as `LONG1`/`LONG4` store them.
    BigInt {
        start: u64,
        len: u32,
    },
    Float(f64),
    /// UTF-8 checked.
    Str {
        start: u64,
        len: u32,
    },
    /// `bytes` or `bytearray`.
    Bytes {
        start: u64,
        len: u32,
    },
    List(SeqId),
    Tuple(SeqId),
    Set(SeqId),
    FrozenSet(SeqId),
    Dict(DictId),
}

impl Value {
    /// The Python type name, for messages.
    pub fn type_name(self) -> &'static str {
        match self {
            Value::None => "None",
            Value::Bool(_) => "bool",
            Value::Int(_) | Value::BigInt { .. } => "int",
            Value::Float(_) => "float",
            Value::Str { .. } => "str",
            Value::Bytes { .. } => "bytes",
            Value::List(_) => "list",
            Value::Tuple(_) => "tuple",
            Value::Set(_) => "set",
            Value::FrozenSet(_) => "frozenset",
            Value::Dict(_) => "dict",
        }
    }
}

/// The result of [`decode`]: the root value and the arenas its handles point into.
#[derive(Debug)]
pub struct Decoded<'a> {
    input: &'a [u8],
    extra: Vec<u8>,
    seqs: Vec<Vec<Value>>,
    dicts: Vec<Vec<(Value, Value)>>,
    root: Value,
}

impl<'a> Decoded<'a> {
    /// Values built elsewhere (by [`crate::pickle_stream`]): spans address `input`.
    pub(crate) fn from_parts(input: &'a [u8], seqs: Vec<Vec<Value>>, dicts: Vec<Vec<(Value, Value)>>, root: Value) -> Decoded<'a> {
        Decoded { input, extra: Vec::new(), seqs, dicts, root }
    }

    /// The value the pickle's STOP returned.
    pub fn root(&self) -> Value {
        self.root
    }

    /// Number of lists/tuples/sets and of dicts decoded.
    pub fn arena_sizes(&self) -> (usize, usize) {
        (self.seqs.len(), self.dicts.len())
    }

    fn span(&self, start: u64, len: u32) -> &[u8] {
        let n = self.input.len() as u64;
        let (buf, s) = if start < n { (self.input, start) } else { (&self.extra[..], start - n) };
        // Spans are created by the decoder and always in bounds; stay panic-free regardless.
        let s = s as usize;
        buf.get(s..s.saturating_add(len as usize)).unwrap_or(&[])
    }

    /// The UTF-8 bytes of a `str`, without re-validating.
    pub fn str_bytes(&self, v: Value) -> Option<&[u8]> {
        match v {
            Value::Str { start, len } => Some(self.span(start, len)),
            _ => None,
        }
    }

    /// A `str` value.
    pub fn str(&self, v: Value) -> Option<&str> {
        self.str_bytes(v).and_then(|b| std::str::from_utf8(b).ok())
    }

    /// A `bytes`/`bytearray` value.
    pub fn bytes(&self, v: Value) -> Option<&[u8]> {
        match v {
            Value::Bytes { start, len } => Some(self.span(start, len)),
            _ => None,
        }
    }

    /// The little-endian two's-complement bytes of a [`Value::BigInt`].
    pub fn bigint_bytes(&self, v: Value) -> Option<&[u8]> {
        match v {
            Value::BigInt { start, len } => Some(self.span(start, len)),
            _ => None,
        }
    }

    /// An int as `i128` (`None` for non-ints and for ints outside `i128`). `bool` is not an int here.
    pub fn int_i128(&self, v: Value) -> Option<i128> {
        match v {
            Value::Int(i) => Some(i as i128),
            Value::BigInt { .. } => {
                let b = self.bigint_bytes(v)?;
                let neg = b.last().is_some_and(|&x| x & 0x80 != 0);
                let ext = if neg { 0xff } else { 0 };
                if b.len() > 16 && b[16..].iter().any(|&x| x != ext) {
                    return None;
                }
                let mut buf = [ext; 16];
                let n = b.len().min(16);
                buf[..n].copy_from_slice(&b[..n]);
                let r = i128::from_le_bytes(buf);
                // The sign bit of the 16-byte value must agree with the original sign.
                if (r < 0) != neg { None } else { Some(r) }
            }
            _ => None,
        }
    }

    /// An int that fits `i64`.
    pub fn int_i64(&self, v: Value) -> Option<i64> {
        match v {
            Value::Int(i) => Some(i),
            _ => None, // BigInt never fits i64 (the decoder narrows whenever it does)
        }
    }

    /// An int in `0..2^64`.
    pub fn int_u64(&self, v: Value) -> Option<u64> {
        match v {
            Value::Int(i) => u64::try_from(i).ok(),
            Value::BigInt { .. } => self.int_i128(v).and_then(|i| u64::try_from(i).ok()),
            _ => None,
        }
    }

    /// The items of a list, tuple, set or frozenset.
    pub fn items(&self, v: Value) -> Option<&[Value]> {
        match v {
            Value::List(id) | Value::Tuple(id) | Value::Set(id) | Value::FrozenSet(id) => self.seqs.get(id as usize).map(|x| x.as_slice()),
            _ => None,
        }
    }

    /// The (key, value) pairs of a dict, in insertion order.
    pub fn dict(&self, v: Value) -> Option<&[(Value, Value)]> {
        match v {
            Value::Dict(id) => self.dicts.get(id as usize).map(|x| x.as_slice()),
            _ => None,
        }
    }

    /// `d[key]` for a `str` key (the last matching pair, as a Python dict would keep).
    pub fn dict_get(&self, d: Value, key: &str) -> Option<Value> {
        self.dict(d)?.iter().rev().find(|(k, _)| self.str_bytes(*k) == Some(key.as_bytes())).map(|&(_, v)| v)
    }

    /// A short Python-like rendering for messages and debugging; recursion is cut at `max_depth`
    /// (so shared and cyclic structures are safe) and output at about `max_len` characters.
    pub fn depth_limited_repr(&self, v: Value, max_depth: usize, max_len: usize) -> String {
        let mut s = String::new();
        self.repr_into(v, max_depth, max_len, &mut s);
        if s.len() > max_len {
            let mut cut = max_len;
            while !s.is_char_boundary(cut) {
                cut -= 1;
            }
            s.truncate(cut);
            s.push('…');
        }
        s
    }

    fn repr_into(&self, v: Value, depth: usize, max_len: usize, s: &mut String) {
        use std::fmt::Write;
        if s.len() > max_len {
            return;
        }
        match v {
            Value::None => s.push_str("None"),
            Value::Bool(b) => s.push_str(if b { "True" } else { "False" }),
            Value::Int(i) => {
                let _ = write!(s, "{i}");
            }
            Value::BigInt { .. } => match self.int_i128(v) {
                Some(i) => {
                    let _ = write!(s, "{i}");
                }
                None => {
                    let n = self.bigint_bytes(v).map_or(0, |b| b.len());
                    let _ = write!(s, "<int of {n} bytes>");
                }
            },
            Value::Float(f) => {
                let _ = write!(s, "{f:?}");
            }
            Value::Str { .. } => {
                let _ = write!(s, "{:?}", self.str(v).unwrap_or(""));
            }
            Value::Bytes { .. } => {
                let _ = write!(s, "b{:?}", String::from_utf8_lossy(self.bytes(v).unwrap_or(&[])));
            }
            Value::List(_) | Value::Tuple(_) | Value::Set(_) | Value::FrozenSet(_) => {
                let (open, close) = match v {
                    Value::List(_) => ("[", "]"),
                    Value::Tuple(_) => ("(", ")"),
                    Value::Set(_) => ("{", "}"),
                    _ => ("frozenset({", "})"),
                };
                let items = self.items(v).unwrap_or(&[]);
                if depth == 0 {
                    let _ = write!(s, "{open}…{} items{close}", items.len());
                    return;
                }
                s.push_str(open);
                for (i, &x) in items.iter().enumerate() {
                    if i > 0 {
                        s.push_str(", ");
                    }
                    if s.len() > max_len {
                        break;
                    }
                    self.repr_into(x, depth - 1, max_len, s);
                }
                if matches!(v, Value::Tuple(_)) && items.len() == 1 {
                    s.push(',');
                }
                s.push_str(close);
            }
            Value::Dict(_) => {
                let pairs = self.dict(v).unwrap_or(&[]);
                if depth == 0 {
                    let _ = write!(s, "{{…{} items}}", pairs.len());
                    return;
                }
                s.push('{');
                for (i, &(k, x)) in pairs.iter().enumerate() {
                    if i > 0 {
                        s.push_str(", ");
                    }
                    if s.len() > max_len {
                        break;
                    }
                    self.repr_into(k, depth - 1, max_len, s);
                    s.push_str(": ");
                    self.repr_into(x, depth - 1, max_len, s);
                }
                s.push('}');
            }
        }
    }
}

/// Decodes one pickle (up to its STOP opcode; trailing bytes are ignored, as `pickle.loads` does).
pub fn decode(input: &[u8]) -> Result<Decoded<'_>, PickleError> {
    let mut d = Decoder {
        input,
        pos: 0,
        stack: Vec::with_capacity(64),
        marks: Vec::with_capacity(16),
        memo: Vec::new(),
        sparse_memo: HashMap::new(),
        extra: Vec::new(),
        seqs: Vec::new(),
        dicts: Vec::new(),
    };
    let root = d.run()?;
    Ok(Decoded { input, extra: d.extra, seqs: d.seqs, dicts: d.dicts, root })
}

/// The name of a pickle opcode byte, if it is one.
pub fn opcode_name(op: u8) -> Option<&'static str> {
    Some(match op {
        b'(' => "MARK",
        b'.' => "STOP",
        b'0' => "POP",
        b'1' => "POP_MARK",
        b'2' => "DUP",
        b'F' => "FLOAT",
        b'I' => "INT",
        b'J' => "BININT",
        b'K' => "BININT1",
        b'L' => "LONG",
        b'M' => "BININT2",
        b'N' => "NONE",
        b'P' => "PERSID",
        b'Q' => "BINPERSID",
        b'R' => "REDUCE",
        b'S' => "STRING",
        b'T' => "BINSTRING",
        b'U' => "SHORT_BINSTRING",
        b'V' => "UNICODE",
        b'X' => "BINUNICODE",
        b'a' => "APPEND",
        b'b' => "BUILD",
        b'c' => "GLOBAL",
        b'd' => "DICT",
        b'}' => "EMPTY_DICT",
        b'e' => "APPENDS",
        b'g' => "GET",
        b'h' => "BINGET",
        b'i' => "INST",
        b'j' => "LONG_BINGET",
        b'l' => "LIST",
        b']' => "EMPTY_LIST",
        b'o' => "OBJ",
        b'p' => "PUT",
        b'q' => "BINPUT",
        b'r' => "LONG_BINPUT",
        b's' => "SETITEM",
        b't' => "TUPLE",
        b')' => "EMPTY_TUPLE",
        b'u' => "SETITEMS",
        b'G' => "BINFLOAT",
        0x80 => "PROTO",
        0x81 => "NEWOBJ",
        0x82 => "EXT1",
        0x83 => "EXT2",
        0x84 => "EXT4",
        0x85 => "TUPLE1",
        0x86 => "TUPLE2",
        0x87 => "TUPLE3",
        0x88 => "NEWTRUE",
        0x89 => "NEWFALSE",
        0x8a => "LONG1",
        0x8b => "LONG4",
        b'B' => "BINBYTES",
        b'C' => "SHORT_BINBYTES",
        0x8c => "SHORT_BINUNICODE",
        0x8d => "BINUNICODE8",
        0x8e => "BINBYTES8",
        0x8f => "EMPTY_SET",
        0x90 => "ADDITEMS",
        0x91 => "FROZENSET",
        0x92 => "NEWOBJ_EX",
        0x93 => "STACK_GLOBAL",
        0x94 => "MEMOIZE",
        0x95 => "FRAME",
        0x96 => "BYTEARRAY8",
        0x97 => "NEXT_BUFFER",
        0x98 => "READONLY_BUFFER",
        _ => return None,
    })
}

struct Decoder<'a> {
    input: &'a [u8],
    pos: usize,
    stack: Vec<Value>,
    /// Stack lengths at each open MARK (CPython's metastack).
    marks: Vec<usize>,
    /// Dense memo: indices `0..memo.len()`; other indices go to `sparse_memo`.
    memo: Vec<Value>,
    sparse_memo: HashMap<u64, Value>,
    extra: Vec<u8>,
    seqs: Vec<Vec<Value>>,
    dicts: Vec<Vec<(Value, Value)>>,
}

fn err<T>(offset: usize, msg: impl Into<String>) -> Result<T, PickleError> {
    Err(PickleError { offset, msg: msg.into() })
}

fn name(op: u8) -> &'static str {
    opcode_name(op).unwrap_or("?")
}

impl<'a> Decoder<'a> {
    #[inline]
    fn take(&mut self, n: usize, at: usize, op: u8) -> Result<&'a [u8], PickleError> {
        let rem = self.input.len() - self.pos;
        if n > rem {
            return err(at, format!("{} needs {n} bytes of argument but only {rem} remain (truncated input?)", name(op)));
        }
        let s = &self.input[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    #[inline]
    fn arg<const N: usize>(&mut self, at: usize, op: u8) -> Result<[u8; N], PickleError> {
        let s = self.take(N, at, op)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    /// Converts a length read from the input to usize, checking it against the remaining input.
    fn len_arg(&self, n: u64, at: usize, op: u8) -> Result<usize, PickleError> {
        if n > MAX_VALUE_BYTES {
            return err(at, too_long(op, n));
        }
        let rem = (self.input.len() - self.pos) as u64;
        if n > rem {
            return err(at, format!("{} declares {n} bytes but only {rem} remain (truncated or corrupt input)", name(op)));
        }
        Ok(n as usize)
    }

    /// The span of `n` bytes at the current position (already length-checked) as `start`.
    fn span_here(&mut self, n: usize, at: usize, op: u8) -> Result<(u64, u32), PickleError> {
        if n > u32::MAX as usize {
            return err(at, format!("{} of {n} bytes is larger than the supported 4 GiB", name(op)));
        }
        let start = self.pos as u64;
        self.take(n, at, op)?;
        Ok((start, n as u32))
    }

    fn str_value(&mut self, n: usize, at: usize, op: u8) -> Result<Value, PickleError> {
        let (start, len) = self.span_here(n, at, op)?;
        let b = &self.input[start as usize..start as usize + len as usize];
        if let Err(e) = std::str::from_utf8(b) {
            return err(at, format!("{} string is not valid UTF-8 ({e})", name(op)));
        }
        Ok(Value::Str { start, len })
    }

    /// Puts owned bytes into the side buffer and returns their span start.
    fn push_extra(&mut self, b: &[u8], at: usize) -> Result<(u64, u32), PickleError> {
        if b.len() > u32::MAX as usize {
            return err(at, "value larger than 4 GiB");
        }
        let start = self.input.len() as u64 + self.extra.len() as u64;
        self.extra.extend_from_slice(b);
        Ok((start, b.len() as u32))
    }

    #[inline]
    fn base(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    #[inline]
    fn pop(&mut self, at: usize, op: u8) -> Result<Value, PickleError> {
        if self.stack.len() <= self.base() {
            return err(at, format!("{}: stack underflow", name(op)));
        }
        Ok(self.stack.pop().unwrap_or(Value::None))
    }

    #[inline]
    fn top(&self, at: usize, op: u8) -> Result<Value, PickleError> {
        if self.stack.len() <= self.base() {
            return err(at, format!("{}: stack underflow (empty stack)", name(op)));
        }
        Ok(self.stack[self.stack.len() - 1])
    }

    /// Pops the innermost MARK; returns the stack index where its items start.
    #[inline]
    fn pop_mark(&mut self, at: usize, op: u8) -> Result<usize, PickleError> {
        match self.marks.pop() {
            Some(m) => Ok(m),
            None => err(at, format!("{}: no MARK on the stack", name(op))),
        }
    }

    /// The container just below a popped mark (`stack[start-1]`), which must be above the new base.
    fn below_mark(&self, start: usize, at: usize, op: u8) -> Result<Value, PickleError> {
        if start == 0 || start - 1 < self.base() {
            return err(at, format!("{}: stack underflow (no container below the MARK)", name(op)));
        }
        Ok(self.stack[start - 1])
    }

    fn new_seq(&mut self, items: Vec<Value>, at: usize) -> Result<SeqId, PickleError> {
        let id = self.seqs.len();
        if id >= u32::MAX as usize {
            return err(at, "more than 2^32 containers");
        }
        self.seqs.push(items);
        Ok(id as SeqId)
    }

    fn new_dict(&mut self, pairs: Vec<(Value, Value)>, at: usize) -> Result<DictId, PickleError> {
        let id = self.dicts.len();
        if id >= u32::MAX as usize {
            return err(at, "more than 2^32 dicts");
        }
        self.dicts.push(pairs);
        Ok(id as DictId)
    }

    fn pairs_from(&mut self, start: usize, at: usize, op: u8) -> Result<Vec<(Value, Value)>, PickleError> {
        let n = self.stack.len() - start;
        if !n.is_multiple_of(2) {
            return err(at, format!("{}: odd number of items ({n}) after MARK", name(op)));
        }
        let pairs = self.stack[start..].chunks_exact(2).map(|c| (c[0], c[1])).collect();
        self.stack.truncate(start);
        Ok(pairs)
    }

    fn memo_put(&mut self, idx: u64, v: Value) {
        let n = self.memo.len() as u64;
        if idx < n {
            self.memo[idx as usize] = v;
        } else if idx == n {
            self.memo.push(v);
            if !self.sparse_memo.is_empty() {
                while let Some(v) = self.sparse_memo.remove(&(self.memo.len() as u64)) {
                    self.memo.push(v);
                }
            }
        } else {
            self.sparse_memo.insert(idx, v);
        }
    }

    /// Refuses a memo index no pickler writes ([`MEMO_INDEX_SLACK`]).
    fn check_memo_index(&self, idx: u64, at: usize, op: u8) -> Result<(), PickleError> {
        if idx > MEMO_INDEX_SLACK.max(at as u64) {
            return err(
                at,
                format!(
                    "{}: memo index {idx}, beyond the byte offset: no pickler writes it (CPython's unpickler would grow its memo to {} GiB for it)",
                    name(op),
                    idx.saturating_mul(16).div_ceil(1 << 30)
                ),
            );
        }
        Ok(())
    }

    fn memo_get(&self, idx: u64, at: usize, op: u8) -> Result<Value, PickleError> {
        if let Some(&v) = self.memo.get(idx as usize).filter(|_| idx < self.memo.len() as u64) {
            return Ok(v);
        }
        match self.sparse_memo.get(&idx) {
            Some(&v) => Ok(v),
            None => err(at, format!("{}: memo key {idx} not found (corrupt pickle)", name(op))),
        }
    }

    fn long_value(&mut self, n: usize, at: usize, op: u8) -> Result<Value, PickleError> {
        let (start, len) = self.span_here(n, at, op)?;
        let b = &self.input[start as usize..start as usize + n];
        Ok(match narrow_long(b) {
            Some(i) => Value::Int(i),
            None => Value::BigInt { start, len },
        })
    }

    /// A `\n`-terminated line (without the newline), for the text opcodes.
    fn line(&mut self, at: usize, op: u8) -> Result<&'a [u8], PickleError> {
        let rest = &self.input[self.pos..];
        let within = &rest[..rest.len().min(MAX_VALUE_BYTES as usize + 1)];
        match memchr::memchr(b'\n', within) {
            None if rest.len() > MAX_VALUE_BYTES as usize => err(
                at,
                format!(
                    "{}: argument line longer than the {} MiB a snapshot value may hold (allocsim_trace::input::MAX_VALUE_BYTES)",
                    name(op),
                    MAX_VALUE_BYTES >> 20
                ),
            ),
            Some(i) => {
                self.pos += i + 1;
                Ok(&rest[..i])
            }
            None => err(at, format!("{}: argument line has no terminating newline (truncated input?)", name(op))),
        }
    }

    fn text_int(&mut self, line: &[u8], at: usize, op: u8) -> Result<Value, PickleError> {
        let s = std::str::from_utf8(line).map(str::trim).unwrap_or("");
        let (neg, digits) = match s.as_bytes() {
            [b'-', rest @ ..] => (true, rest),
            [b'+', rest @ ..] => (false, rest),
            d => (false, d),
        };
        let digits: Vec<u8> = digits.iter().copied().filter(|&c| c != b'_').collect();
        if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
            return err(at, format!("{}: invalid integer literal {:?}", name(op), String::from_utf8_lossy(line)));
        }
        if digits.len() > MAX_INT_DIGITS {
            return err(at, format!("{}: integer literal has more than {MAX_INT_DIGITS} digits", name(op)));
        }
        // Magnitude as little-endian base-2^32 limbs.
        let mut limbs: Vec<u32> = vec![0];
        for &c in &digits {
            let mut carry = (c - b'0') as u64;
            for l in limbs.iter_mut() {
                let x = *l as u64 * 10 + carry;
                *l = x as u32;
                carry = x >> 32;
            }
            if carry != 0 {
                limbs.push(carry as u32);
            }
        }
        let mut mag: Vec<u8> = limbs.iter().flat_map(|l| l.to_le_bytes()).collect();
        mag.push(0); // room for the sign bit
        if neg {
            // two's complement: invert and add one
            let mut carry = 1u16;
            for b in mag.iter_mut() {
                let x = (!*b) as u16 + carry;
                *b = x as u8;
                carry = x >> 8;
            }
        }
        // Minimal length: drop redundant sign-extension bytes.
        while mag.len() > 1 {
            let top = mag[mag.len() - 1];
            let next = mag[mag.len() - 2];
            if (top == 0 && next & 0x80 == 0) || (top == 0xff && next & 0x80 != 0) {
                mag.pop();
            } else {
                break;
            }
        }
        Ok(match narrow_long(&mag) {
            Some(i) => Value::Int(i),
            None => {
                let (start, len) = self.push_extra(&mag, at)?;
                Value::BigInt { start, len }
            }
        })
    }

    fn text_index(&mut self, at: usize, op: u8) -> Result<u64, PickleError> {
        let line = self.line(at, op)?;
        std::str::from_utf8(line)
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .map_or_else(|| err(at, format!("{}: invalid memo index {:?}", name(op), String::from_utf8_lossy(line))), Ok)
    }

    /// An 8-bit string of the text protocols: `str` if valid UTF-8, else `bytes`.
    fn eight_bit_string(&mut self, b: &[u8], owned: bool, start: u64, at: usize) -> Result<Value, PickleError> {
        let (start, len) = if owned { self.push_extra(b, at)? } else { (start, b.len() as u32) };
        Ok(if std::str::from_utf8(b).is_ok() { Value::Str { start, len } } else { Value::Bytes { start, len } })
    }

    fn run(&mut self) -> Result<Value, PickleError> {
        loop {
            let at = self.pos;
            let Some(&op) = self.input.get(at) else {
                return err(at, "input ended before the STOP opcode (truncated pickle)");
            };
            self.pos += 1;
            match op {
                // ---- framing / protocol
                0x80 => {
                    let [v] = self.arg::<1>(at, op)?;
                    if v > 5 {
                        return err(at, format!("unsupported pickle protocol {v}"));
                    }
                }
                0x95 => {
                    let n = u64::from_le_bytes(self.arg::<8>(at, op)?);
                    self.len_arg(n, at, op)?;
                }
                b'.' => return self.pop(at, op),
                // ---- stack manipulation
                b'(' => {
                    if self.marks.len() >= MAX_MARK_DEPTH {
                        return err(at, format!("MARK: nesting deeper than {MAX_MARK_DEPTH}"));
                    }
                    self.marks.push(self.stack.len());
                }
                b'0' => {
                    if self.stack.len() > self.base() {
                        self.stack.pop();
                    } else {
                        let m = self.pop_mark(at, op)?;
                        self.stack.truncate(m);
                    }
                }
                b'1' => {
                    let m = self.pop_mark(at, op)?;
                    self.stack.truncate(m);
                }
                b'2' => {
                    let v = self.top(at, op)?;
                    self.stack.push(v);
                }
                // ---- constants
                b'N' => self.stack.push(Value::None),
                0x88 => self.stack.push(Value::Bool(true)),
                0x89 => self.stack.push(Value::Bool(false)),
                b'J' => {
                    let v = i32::from_le_bytes(self.arg::<4>(at, op)?);
                    self.stack.push(Value::Int(v as i64));
                }
                b'K' => {
                    let [v] = self.arg::<1>(at, op)?;
                    self.stack.push(Value::Int(v as i64));
                }
                b'M' => {
                    let v = u16::from_le_bytes(self.arg::<2>(at, op)?);
                    self.stack.push(Value::Int(v as i64));
                }
                0x8a => {
                    let [n] = self.arg::<1>(at, op)?;
                    let v = self.long_value(n as usize, at, op)?;
                    self.stack.push(v);
                }
                0x8b => {
                    let n = i32::from_le_bytes(self.arg::<4>(at, op)?);
                    if n < 0 {
                        return err(at, format!("LONG4: negative byte count {n}"));
                    }
                    let n = self.len_arg(n as u64, at, op)?;
                    let v = self.long_value(n, at, op)?;
                    self.stack.push(v);
                }
                b'G' => {
                    let v = f64::from_be_bytes(self.arg::<8>(at, op)?);
                    self.stack.push(Value::Float(v));
                }
                // ---- strings and bytes
                0x8c => {
                    let [n] = self.arg::<1>(at, op)?;
                    let v = self.str_value(n as usize, at, op)?;
                    self.stack.push(v);
                }
                b'X' => {
                    let n = u32::from_le_bytes(self.arg::<4>(at, op)?);
                    let n = self.len_arg(n as u64, at, op)?;
                    let v = self.str_value(n, at, op)?;
                    self.stack.push(v);
                }
                0x8d => {
                    let n = u64::from_le_bytes(self.arg::<8>(at, op)?);
                    let n = self.len_arg(n, at, op)?;
                    let v = self.str_value(n, at, op)?;
                    self.stack.push(v);
                }
                b'C' | b'B' | 0x8e | 0x96 => {
                    let n = match op {
                        b'C' => self.arg::<1>(at, op)?[0] as u64,
                        b'B' => u32::from_le_bytes(self.arg::<4>(at, op)?) as u64,
                        _ => u64::from_le_bytes(self.arg::<8>(at, op)?),
                    };
                    let n = self.len_arg(n, at, op)?;
                    let (start, len) = self.span_here(n, at, op)?;
                    self.stack.push(Value::Bytes { start, len });
                }
                // ---- containers
                b'}' => {
                    let id = self.new_dict(Vec::new(), at)?;
                    self.stack.push(Value::Dict(id));
                }
                b']' => {
                    let id = self.new_seq(Vec::new(), at)?;
                    self.stack.push(Value::List(id));
                }
                b')' => {
                    let id = self.new_seq(Vec::new(), at)?;
                    self.stack.push(Value::Tuple(id));
                }
                0x8f => {
                    let id = self.new_seq(Vec::new(), at)?;
                    self.stack.push(Value::Set(id));
                }
                0x85..=0x87 => {
                    let n = (op - 0x84) as usize;
                    if self.stack.len() < self.base() + n {
                        return err(at, format!("{}: stack underflow", name(op)));
                    }
                    let items = self.stack.split_off(self.stack.len() - n);
                    let id = self.new_seq(items, at)?;
                    self.stack.push(Value::Tuple(id));
                }
                b't' | b'l' | 0x91 => {
                    let start = self.pop_mark(at, op)?;
                    let items = self.stack.split_off(start);
                    let id = self.new_seq(items, at)?;
                    self.stack.push(match op {
                        b't' => Value::Tuple(id),
                        b'l' => Value::List(id),
                        _ => Value::FrozenSet(id),
                    });
                }
                b'd' => {
                    let start = self.pop_mark(at, op)?;
                    let pairs = self.pairs_from(start, at, op)?;
                    let id = self.new_dict(pairs, at)?;
                    self.stack.push(Value::Dict(id));
                }
                b'a' => {
                    let v = self.pop(at, op)?;
                    match self.top(at, op)? {
                        Value::List(id) => self.seqs[id as usize].push(v),
                        t => return err(at, format!("APPEND to a {}, not a list", t.type_name())),
                    }
                }
                b'e' => {
                    let start = self.pop_mark(at, op)?;
                    match self.below_mark(start, at, op)? {
                        Value::List(id) => {
                            let seq = &mut self.seqs[id as usize];
                            seq.extend(self.stack.drain(start..));
                        }
                        t => return err(at, format!("APPENDS to a {}, not a list", t.type_name())),
                    }
                }
                b's' => {
                    let v = self.pop(at, op)?;
                    let k = self.pop(at, op)?;
                    match self.top(at, op)? {
                        Value::Dict(id) => self.dicts[id as usize].push((k, v)),
                        t => return err(at, format!("SETITEM on a {}, not a dict", t.type_name())),
                    }
                }
                b'u' => {
                    let start = self.pop_mark(at, op)?;
                    match self.below_mark(start, at, op)? {
                        Value::Dict(id) => {
                            let pairs = self.pairs_from(start, at, op)?;
                            let d = &mut self.dicts[id as usize];
                            if d.is_empty() {
                                *d = pairs;
                            } else {
                                d.extend(pairs);
                            }
                        }
                        t => {
                            return err(at, format!("SETITEMS on a {}, not a dict", t.type_name()));
                        }
                    }
                }
                0x90 => {
                    let start = self.pop_mark(at, op)?;
                    match self.below_mark(start, at, op)? {
                        Value::Set(id) => {
                            let seq = &mut self.seqs[id as usize];
                            seq.extend(self.stack.drain(start..));
                        }
                        t => return err(at, format!("ADDITEMS to a {}, not a set", t.type_name())),
                    }
                }
                // ---- memo
                0x94 => {
                    let v = self.top(at, op)?;
                    let idx = self.memo.len() as u64 + self.sparse_memo.len() as u64;
                    self.memo_put(idx, v);
                }
                b'q' => {
                    let [i] = self.arg::<1>(at, op)?;
                    let v = self.top(at, op)?;
                    self.check_memo_index(i as u64, at, op)?;
                    self.memo_put(i as u64, v);
                }
                b'r' => {
                    let i = u32::from_le_bytes(self.arg::<4>(at, op)?);
                    let v = self.top(at, op)?;
                    self.check_memo_index(i as u64, at, op)?;
                    self.memo_put(i as u64, v);
                }
                b'h' => {
                    let [i] = self.arg::<1>(at, op)?;
                    let v = self.memo_get(i as u64, at, op)?;
                    self.stack.push(v);
                }
                b'j' => {
                    let i = u32::from_le_bytes(self.arg::<4>(at, op)?);
                    let v = self.memo_get(i as u64, at, op)?;
                    self.stack.push(v);
                }
                // ---- protocol 0/1 text opcodes
                b'p' => {
                    let i = self.text_index(at, op)?;
                    let v = self.top(at, op)?;
                    self.check_memo_index(i, at, op)?;
                    self.memo_put(i, v);
                }
                b'g' => {
                    let i = self.text_index(at, op)?;
                    let v = self.memo_get(i, at, op)?;
                    self.stack.push(v);
                }
                b'I' => {
                    let line = self.line(at, op)?;
                    let v = match line {
                        b"00" => Value::Bool(false),
                        b"01" => Value::Bool(true),
                        _ => self.text_int(line, at, op)?,
                    };
                    self.stack.push(v);
                }
                b'L' => {
                    let mut line = self.line(at, op)?;
                    if let [rest @ .., b'L'] = line {
                        line = rest;
                    }
                    let v = self.text_int(line, at, op)?;
                    self.stack.push(v);
                }
                b'F' => {
                    let line = self.line(at, op)?;
                    let v = std::str::from_utf8(line).ok().and_then(|s| s.trim().parse::<f64>().ok());
                    match v {
                        Some(f) => self.stack.push(Value::Float(f)),
                        None => {
                            return err(at, format!("FLOAT: invalid literal {:?}", String::from_utf8_lossy(line)));
                        }
                    }
                }
                b'S' => {
                    let line = self.line(at, op)?;
                    let inner = match line {
                        [q, inner @ .., q2] if q == q2 && (*q == b'\'' || *q == b'"') => inner,
                        _ => return err(at, "STRING: argument must be quoted"),
                    };
                    let b = escape_decode(inner).map_err(|m| PickleError { offset: at, msg: format!("STRING: {m}") })?;
                    let v = self.eight_bit_string(&b, true, 0, at)?;
                    self.stack.push(v);
                }
                b'T' | b'U' => {
                    let n = if op == b'T' {
                        let n = i32::from_le_bytes(self.arg::<4>(at, op)?);
                        if n < 0 {
                            return err(at, format!("BINSTRING: negative length {n}"));
                        }
                        n as u64
                    } else {
                        self.arg::<1>(at, op)?[0] as u64
                    };
                    let n = self.len_arg(n, at, op)?;
                    let (start, _) = self.span_here(n, at, op)?;
                    let input = self.input;
                    let b = &input[start as usize..start as usize + n];
                    let v = self.eight_bit_string(b, false, start, at)?;
                    self.stack.push(v);
                }
                b'V' => {
                    let line = self.line(at, op)?;
                    let s = raw_unicode_escape_decode(line).map_err(|m| PickleError { offset: at, msg: format!("UNICODE: {m}") })?;
                    let (start, len) = self.push_extra(s.as_bytes(), at)?;
                    self.stack.push(Value::Str { start, len });
                }
                // ---- refused: these would import, call or construct Python objects
                b'c' | 0x93 | b'R' | b'b' | b'i' | b'o' | 0x81 | 0x92 | b'P' | b'Q' | 0x82 | 0x83 | 0x84 | 0x97 | 0x98 => {
                    return err(
                        at,
                        format!(
                            "pickle opcode {} (0x{op:02x}) at byte {at} would construct a Python object; \
                             allocsim never executes pickles (only builtin types can be read)",
                            name(op)
                        ),
                    );
                }
                _ => {
                    return err(at, format!("unknown pickle opcode 0x{op:02x} (not a pickle, or corrupt)"));
                }
            }
        }
    }
}

/// Little-endian two's complement → i64 if it fits (also the stream's, `pickle_stream.rs`).
#[inline]
pub(crate) fn narrow_long(b: &[u8]) -> Option<i64> {
    if b.is_empty() {
        return Some(0);
    }
    let neg = b[b.len() - 1] & 0x80 != 0;
    let ext = if neg { 0xff } else { 0 };
    if b.len() > 8 && (b[8..].iter().any(|&x| x != ext) || ((b[7] & 0x80 != 0) != neg)) {
        return None;
    }
    let mut buf = [ext; 8];
    let n = b.len().min(8);
    buf[..n].copy_from_slice(&b[..n]);
    Some(i64::from_le_bytes(buf))
}

/// Python's `codecs.escape_decode` (the `STRING` opcode's argument).
fn escape_decode(s: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        let c = s[i];
        i += 1;
        if c != b'\\' {
            out.push(c);
            continue;
        }
        let Some(&e) = s.get(i) else {
            return Err("trailing backslash".into());
        };
        i += 1;
        match e {
            b'\n' => {}
            b'\\' | b'\'' | b'"' => out.push(e),
            b'a' => out.push(7),
            b'b' => out.push(8),
            b'f' => out.push(12),
            b'n' => out.push(b'\n'),
            b'r' => out.push(b'\r'),
            b't' => out.push(b'\t'),
            b'v' => out.push(11),
            b'0'..=b'7' => {
                let mut v = (e - b'0') as u32;
                for _ in 0..2 {
                    match s.get(i) {
                        Some(&d @ b'0'..=b'7') => {
                            v = v * 8 + (d - b'0') as u32;
                            i += 1;
                        }
                        _ => break,
                    }
                }
                out.push(v as u8);
            }
            b'x' => {
                let h = s.get(i..i + 2).and_then(|h| std::str::from_utf8(h).ok()).and_then(|h| u8::from_str_radix(h, 16).ok());
                match h {
                    Some(v) => {
                        out.push(v);
                        i += 2;
                    }
                    None => return Err("invalid \\x escape".into()),
                }
            }
            _ => {
                out.push(b'\\');
                out.push(e);
            }
        }
    }
    Ok(out)
}

/// Python's `raw-unicode-escape` decoding (the `UNICODE` opcode's argument).
fn raw_unicode_escape_decode(s: &[u8]) -> Result<String, String> {
    let mut out = String::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        let c = s[i];
        if c != b'\\' {
            out.push(c as char); // latin-1
            i += 1;
            continue;
        }
        let bs = i;
        while i < s.len() && s[i] == b'\\' {
            out.push('\\');
            i += 1;
        }
        if (i - bs) % 2 == 0 || i >= s.len() || (s[i] != b'u' && s[i] != b'U') {
            continue;
        }
        out.pop();
        let count = if s[i] == b'u' { 4 } else { 8 };
        i += 1;
        let code = s
            .get(i..i + count)
            .and_then(|h| std::str::from_utf8(h).ok())
            .filter(|h| h.bytes().all(|b| b.is_ascii_hexdigit()))
            .and_then(|h| u32::from_str_radix(h, 16).ok())
            .ok_or_else(|| format!("truncated \\{}XXXX escape", if count == 4 { 'u' } else { 'U' }))?;
        let ch = char::from_u32(code).ok_or_else(|| format!("\\u escape {code:#x} is not a Unicode scalar value"))?;
        out.push(ch);
        i += count;
    }
    Ok(out)
}
