//! Reading a trace file's bytes in bounded memory: gzip as Python reads it, the limits on what a
//! snapshot may hold, and a first look at the bytes as they arrive that stops reading where the
//! decoders will stop anyway.
//!
//! * [`GzReader`]: gzip members one after another, with zero bytes between and after them
//!   skipped, as CPython's `gzip` module reads a file (`_GzipReader._read_eof`: "Gzip files can
//!   be padded with zeroes and still have archives"); anything else after a member is refused,
//!   as Python refuses it (`BadGzipFile`).
//! * [`MAX_VALUE_BYTES`]: the longest string, bytes, integer, text-opcode line or `FRAME` a
//!   pickle may declare, and the longest line of a JSON Lines trace. Checked against the declared
//!   length before anything is read or kept for it.
//! * [`read_bounded`]: reads a file (or a gunzipped one) into memory in chunks, looking at each
//!   chunk as it arrives ([`Look`]): a pickle is followed opcode by opcode (without building
//!   anything), and reading stops at its `STOP`, at an opcode no decoder here takes, or at a
//!   length over the limit; text stops at a control byte JSON never holds. A file of zeros is
//!   so refused after its first chunk, not after reading all of it. What was read is then given
//!   to the decoders, which end there (with their answer or their error) at the latest.

use std::io::{BufRead, Read};

/// The most bytes any single value a snapshot holds may declare (a `str`, `bytes`, an integer of
/// `LONG1`/`LONG4`, a text opcode's line, a protocol-4 `FRAME`), and the longest line of a JSON
/// Lines trace: 256 MiB. Torch's snapshots hold strings of a few hundred bytes (frame names and
/// file names, settings) and frames of 64 KiB; a length over this is refused where it is
/// declared, naming its byte offset, before anything is allocated for it.
pub const MAX_VALUE_BYTES: u64 = 256 << 20;

/// After a pickle's `STOP`, at most this many more bytes of a gzip'd file are inflated (and
/// dropped) to check the gzip stream's end (its CRC and length); more are ignored, as
/// `pickle.loads` ignores what follows `STOP`.
pub const MAX_TRAILING_CHECKED: u64 = 64 << 20;

/// A gzip'd stream's members, decompressed one after another, as CPython's `gzip` module reads
/// them: zero bytes after a member are skipped (padding), the input may end there, and anything
/// else must be another member. Errors name the compressed byte where the reader was.
pub struct GzReader<R: BufRead> {
    state: GzState<R>,
    /// Compressed bytes consumed before the current member.
    before: u64,
    /// Members started.
    members: u64,
}

// The decoder's state is large beside the other variants', and there is one `GzState` per file
// read: boxing it would buy nothing.
#[allow(clippy::large_enum_variant)]
enum GzState<R: BufRead> {
    Member(flate2::bufread::GzDecoder<Counting<R>>),
    Between(Counting<R>),
    Done,
}

/// A `BufRead` that counts the bytes consumed from it.
struct Counting<R> {
    inner: R,
    consumed: u64,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.consumed += n as u64;
        Ok(n)
    }
}

impl<R: BufRead> BufRead for Counting<R> {
    fn fill_buf(&mut self) -> std::io::Result<&[u8]> {
        self.inner.fill_buf()
    }
    fn consume(&mut self, n: usize) {
        self.consumed += n as u64;
        self.inner.consume(n);
    }
}

impl<R: BufRead> GzReader<R> {
    /// Reads the gzip'd stream `r` (which should start with a gzip member).
    pub fn new(r: R) -> GzReader<R> {
        GzReader { state: GzState::Member(flate2::bufread::GzDecoder::new(Counting { inner: r, consumed: 0 })), before: 0, members: 1 }
    }

    fn error(&self, e: std::io::Error, at: u64) -> std::io::Error {
        std::io::Error::new(e.kind(), format!("{e} (gzip member {}, near compressed byte {at})", self.members))
    }
}

impl<R: BufRead> Read for GzReader<R> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        loop {
            match &mut self.state {
                GzState::Done => return Ok(0),
                GzState::Member(z) => match z.read(out) {
                    Ok(0) => {
                        let GzState::Member(z) = std::mem::replace(&mut self.state, GzState::Done) else { unreachable!() };
                        self.state = GzState::Between(z.into_inner());
                    }
                    Ok(n) => return Ok(n),
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        let at = z.get_ref().consumed;
                        let e = self.error(e, at);
                        self.state = GzState::Done;
                        return Err(e);
                    }
                },
                GzState::Between(r) => {
                    // Padding: zero bytes, skipped.
                    let buf = match r.fill_buf() {
                        Ok(b) => b,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                        Err(e) => return Err(e),
                    };
                    if buf.is_empty() {
                        self.state = GzState::Done;
                        return Ok(0);
                    }
                    let zeros = buf.iter().position(|&b| b != 0).unwrap_or(buf.len());
                    let not_gzip = buf.len() >= 2 && buf[..2] != [0x1f, 0x8b] || buf[0] != 0x1f;
                    if zeros > 0 {
                        r.consume(zeros);
                        continue;
                    }
                    let at = r.consumed;
                    if not_gzip {
                        self.state = GzState::Done;
                        return Err(std::io::Error::new(
                            std::io::ErrorKind::InvalidData,
                            format!("bytes after gzip member {} at compressed byte {at} are neither zero padding nor another gzip member", self.members),
                        ));
                    }
                    let GzState::Between(r) = std::mem::replace(&mut self.state, GzState::Done) else { unreachable!() };
                    self.before = at;
                    self.members += 1;
                    self.state = GzState::Member(flate2::bufread::GzDecoder::new(r));
                }
            }
        }
    }
}

/// Whether `b` starts as a gzip'd file does.
pub fn is_gzip(b: &[u8]) -> bool {
    b.starts_with(&[0x1f, 0x8b])
}

/// Where the look at a file's bytes stands ([`Look::feed`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Seen {
    /// Read on.
    More,
    /// The decoders end at or before this byte offset (a pickle's `STOP`, an opcode they refuse,
    /// a declared length over [`MAX_VALUE_BYTES`], a byte JSON never holds): what follows need
    /// not be read.
    EndsBy(u64),
}

/// A first look at a trace file's bytes as they arrive, deciding nothing but where reading may
/// stop: see the module documentation. It agrees with the decoders on how long each pickle
/// opcode is, so it finds the `STOP` they find.
#[derive(Clone, Debug, Default)]
pub struct Look {
    /// Bytes seen so far.
    at: u64,
    state: LookState,
    /// The bytes of an opcode (and its fixed-size argument) split across chunks.
    partial: Vec<u8>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum LookState {
    /// Nothing seen yet.
    #[default]
    Start,
    /// Leading white space of a text file.
    Blank,
    /// JSON text.
    Text,
    /// At a pickle opcode.
    Opcode,
    /// Skipping `n` bytes of an argument.
    Skip(u64),
    /// Inside `lines` newline-terminated arguments, the current one `len` bytes long so far.
    Line { lines: u8, len: u64, op_at: u64 },
    /// Decided ([`Seen::EndsBy`]).
    Ended(u64),
}

/// How a pickle opcode's argument is laid out, for [`Look`].
enum Arg {
    Fixed(usize),
    /// A little-endian length of this many bytes, then that many bytes (`signed`: an `i32`).
    Counted {
        width: usize,
        signed: bool,
        skip_body: bool,
    },
    Lines(u8),
    /// An opcode the decoders end at (STOP, or one they refuse, or not an opcode).
    End,
}

fn arg_of(op: u8) -> Arg {
    use Arg::*;
    match op {
        b'(' | b'0' | b'1' | b'2' | b'N' | b'a' | b'd' | b'}' | b'e' | b'l' | b']' | b's' | b't' | b')' | b'u' | 0x85..=0x89 | 0x8f | 0x90 | 0x91 | 0x94 => {
            Fixed(0)
        }
        b'K' | b'h' | b'q' | 0x80 => Fixed(1),
        b'M' => Fixed(2),
        b'J' | b'j' | b'r' => Fixed(4),
        b'G' => Fixed(8),
        b'U' | b'C' | 0x8c | 0x8a => Counted { width: 1, signed: false, skip_body: true },
        b'X' | b'B' => Counted { width: 4, signed: false, skip_body: true },
        b'T' | 0x8b => Counted { width: 4, signed: true, skip_body: true },
        0x8d | 0x8e | 0x96 => Counted { width: 8, signed: false, skip_body: true },
        // A frame's body is opcodes: only its length is checked.
        0x95 => Counted { width: 8, signed: false, skip_body: false },
        b'I' | b'L' | b'F' | b'S' | b'V' | b'g' | b'p' => Lines(1),
        // STOP; GLOBAL, INST, REDUCE, BUILD, OBJ, NEWOBJ(_EX), PERSID, BINPERSID, EXT1/2/4,
        // STACK_GLOBAL, NEXT_BUFFER, READONLY_BUFFER (refused); and bytes that are no opcode.
        _ => End,
    }
}

/// A byte that JSON text never holds raw (a control character other than white space; `\x0b`
/// and `\x0c` are left to the parser, which names them).
pub fn never_in_json(b: u8) -> bool {
    b < 0x20 && !matches!(b, b'\t' | b'\n' | b'\r' | 0x0b | 0x0c)
}

impl Look {
    pub fn new() -> Look {
        Look::default()
    }

    /// Looks at the next bytes of the file.
    pub fn feed(&mut self, mut b: &[u8]) -> Seen {
        while !b.is_empty() {
            match self.state {
                LookState::Ended(at) => return Seen::EndsBy(at),
                LookState::Start => {
                    self.state = match b[0] {
                        c if c.is_ascii_whitespace() => LookState::Blank,
                        b'{' | b'[' => LookState::Text,
                        _ => LookState::Opcode,
                    };
                }
                LookState::Blank => {
                    let n = b.iter().position(|c| !c.is_ascii_whitespace()).unwrap_or(b.len());
                    self.advance(&mut b, n);
                    if let Some(&c) = b.first() {
                        // (Only `{` or `[` is read as text; a pickle may not start with blanks.)
                        self.state = if c == b'{' || c == b'[' { LookState::Text } else { LookState::Ended(self.at) };
                    }
                }
                LookState::Text => match b.iter().position(|&c| never_in_json(c)) {
                    Some(i) => {
                        self.state = LookState::Ended(self.at + i as u64);
                    }
                    None => {
                        let n = b.len();
                        self.advance(&mut b, n);
                    }
                },
                LookState::Skip(n) => {
                    let k = n.min(b.len() as u64);
                    self.advance(&mut b, k as usize);
                    self.state = if k == n { LookState::Opcode } else { LookState::Skip(n - k) };
                }
                LookState::Line { lines, len, op_at } => match memchr::memchr(b'\n', b) {
                    Some(i) if len + i as u64 <= MAX_VALUE_BYTES => {
                        self.advance(&mut b, i + 1);
                        self.state = if lines > 1 { LookState::Line { lines: lines - 1, len: 0, op_at } } else { LookState::Opcode };
                    }
                    _ if len + b.len() as u64 > MAX_VALUE_BYTES => {
                        // The decoders refuse the line once they have seen this much of it.
                        let rest = MAX_VALUE_BYTES + 1 - len;
                        self.advance(&mut b, rest as usize);
                        self.state = LookState::Ended(op_at.max(self.at));
                    }
                    _ => {
                        let n = b.len();
                        self.advance(&mut b, n);
                        self.state = LookState::Line { lines, len: len + n as u64, op_at };
                    }
                },
                LookState::Opcode if self.partial.is_empty() => {
                    // Whole opcodes within this chunk, in a tight loop.
                    let mut i = 0;
                    let mut ended = None;
                    while i < b.len() {
                        let op = b[i];
                        let (head, counted) = match arg_of(op) {
                            Arg::Fixed(n) => (1 + n, None),
                            Arg::Counted { width, signed, skip_body } => (1 + width, Some((signed, skip_body))),
                            _ => break,
                        };
                        if b.len() - i < head {
                            break;
                        }
                        let mut h = [0u8; 9];
                        h[..head].copy_from_slice(&b[i..i + head]);
                        let op_at = self.at + i as u64;
                        i += head;
                        if counted.is_some() {
                            self.after_head(&h[..head], counted, op_at);
                            match self.state {
                                LookState::Opcode => {}
                                LookState::Skip(n) if n <= (b.len() - i) as u64 => {
                                    i += n as usize;
                                    self.state = LookState::Opcode;
                                }
                                LookState::Ended(at) => {
                                    ended = Some(at);
                                    break;
                                }
                                _ => break,
                            }
                        }
                    }
                    self.advance(&mut b, i);
                    if let Some(at) = ended {
                        self.state = LookState::Ended(at);
                        continue;
                    }
                    if self.state != LookState::Opcode || b.is_empty() {
                        continue;
                    }
                    // The opcode at `b[0]`: one that ends, one of lines, or one split across chunks.
                    let op_at = self.at;
                    match arg_of(b[0]) {
                        Arg::End => self.state = LookState::Ended(op_at),
                        Arg::Lines(k) => {
                            self.advance(&mut b, 1);
                            self.state = LookState::Line { lines: k, len: 0, op_at };
                        }
                        _ => {
                            let n = b.len();
                            self.partial.extend_from_slice(b);
                            self.advance(&mut b, n);
                        }
                    }
                }
                LookState::Opcode => {
                    // Continuing an opcode's fixed part split across chunks.
                    let op_at = self.at - self.partial.len() as u64;
                    let (head, counted) = match arg_of(self.partial[0]) {
                        Arg::Fixed(n) => (1 + n, None),
                        Arg::Counted { width, signed, skip_body } => (1 + width, Some((signed, skip_body))),
                        _ => unreachable!("only fixed parts are split"),
                    };
                    let k = (head - self.partial.len()).min(b.len());
                    self.partial.extend_from_slice(&b[..k]);
                    self.advance(&mut b, k);
                    if self.partial.len() == head {
                        let h = std::mem::take(&mut self.partial);
                        self.after_head(&h, counted, op_at);
                    }
                }
            }
        }
        match self.state {
            LookState::Ended(at) => Seen::EndsBy(at),
            _ => Seen::More,
        }
    }

    fn advance(&mut self, b: &mut &[u8], n: usize) {
        *b = &b[n..];
        self.at += n as u64;
    }

    /// After an opcode's fixed part `h` (the opcode byte first).
    fn after_head(&mut self, h: &[u8], counted: Option<(bool, bool)>, op_at: u64) {
        let Some((signed, skip_body)) = counted else {
            self.state = LookState::Opcode;
            return;
        };
        let mut a = [0u8; 8];
        a[..h.len() - 1].copy_from_slice(&h[1..]);
        let n = u64::from_le_bytes(a);
        let negative = signed && (n as u32) & 0x8000_0000 != 0;
        self.state = if negative || n > MAX_VALUE_BYTES {
            LookState::Ended(op_at)
        } else if skip_body && n > 0 {
            LookState::Skip(n)
        } else {
            LookState::Opcode
        };
    }
}

/// Reads `r` to its end into memory, or to where [`Look`] says the decoders end (then, for a
/// gzip'd stream after a pickle's `STOP`, up to [`MAX_TRAILING_CHECKED`] more bytes are inflated
/// and dropped, so that a damaged end of the gzip stream is still found). Memory: the bytes kept
/// (in a vector that doubles as they arrive, never grown by a length the file declares or by the
/// file's size: a file that turns out not to be a trace costs what was read of it).
pub fn read_bounded(mut r: impl Read, gzip: bool) -> std::io::Result<(Vec<u8>, Option<u64>)> {
    // A small first chunk, so that a file that is not a trace is refused at once.
    let mut chunk = 64 << 10;
    let mut out: Vec<u8> = Vec::with_capacity(chunk);
    let mut look = Look::new();
    loop {
        let old = out.len();
        if out.capacity() - old < chunk {
            out.reserve(chunk);
        }
        out.resize(old + chunk, 0);
        // The whole chunk (or what is left), so that the look sees it all at once.
        let mut n = 0;
        while old + n < out.len() {
            match r.read(&mut out[old + n..]) {
                Ok(0) => break,
                Ok(k) => n += k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    out.truncate(old + n);
                    return Err(e);
                }
            }
        }
        out.truncate(old + n);
        if n == 0 {
            return Ok((out, None));
        }
        if let Seen::EndsBy(at) = look.feed(&out[old..]) {
            if gzip {
                // The end of the gzip stream, checked where it is near.
                let mut sink = vec![0u8; 64 << 10];
                let mut left = MAX_TRAILING_CHECKED;
                while left > 0 {
                    match r.read(&mut sink) {
                        Ok(0) => break,
                        Ok(k) => left = left.saturating_sub(k as u64),
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(e),
                    }
                }
            }
            return Ok((out, Some(at)));
        }
        chunk = (chunk * 2).min(8 << 20);
    }
}
