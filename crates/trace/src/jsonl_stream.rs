//! JSON Lines traces read as a stream, for replays whose memory does not grow with the trace.
//!
//! * [`Events`]: an iterator over the events of any [`BufRead`] (plain or gunzipped), one line at
//!   a time, parsed by the same [`LineParser`] as [`crate::jsonl::read`] (same errors, same line
//!   numbers). Header, annotation and segment lines are parsed (and checked) and skipped.
//! * [`scan`]: a cheap first pass for what a replay must know before the events: the header, the
//!   final segments (which come after the events) and every device's segment events (the recorded
//!   run's addresses). Only lines that can hold those are parsed: a line is parsed when it contains
//!   `segment` (every segment line and every `segment_*` event does, and so may a frame) or a `\u`
//!   escape (a key spelled with escapes); the others are skipped at memory speed.
//! * [`JsonlFile`]: a file (plain or `.gz`, detected by content) read both ways, as often as needed.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use crate::jsonl::{Header, LineParser, Parsed};
use crate::{SnapshotSegment, TraceEntry, TraceError};

/// Where a stream's bytes come from, for its I/O errors.
#[derive(Clone, Debug)]
pub struct Source {
    /// The file, for messages.
    pub path: String,
    /// Gunzipped as it is read (errors are gzip errors).
    pub gzip: bool,
}

impl Source {
    fn error(&self, e: std::io::Error, after: u64) -> TraceError {
        if self.gzip { TraceError::Gzip(format!("{e} (after {after} decompressed bytes)")) } else { TraceError::Io { path: self.path.clone(), source: e } }
    }
}

/// The events of a JSON Lines trace, in file order, as `(device, entry)`. Stacks are not kept (every
/// `stack` is 0; frames are checked). After the first error the iterator ends.
pub struct Events<R: BufRead> {
    r: R,
    source: Source,
    line: Vec<u8>,
    lineno: usize,
    read: u64,
    parser: Option<LineParser>,
    header: Option<Header>,
    max_device: Option<usize>,
}

impl<R: BufRead> Events<R> {
    pub fn new(r: R, source: Source) -> Events<R> {
        Events { r, source, line: Vec::new(), lineno: 0, read: 0, parser: Some(LineParser::new(false)), header: None, max_device: None }
    }

    /// The header, once read.
    pub fn header(&self) -> Option<&Header> {
        self.header.as_ref()
    }

    /// The number of devices: as the header declares, else one more than the highest device seen.
    pub fn devices(&self) -> usize {
        self.header.as_ref().and_then(|h| h.devices).unwrap_or_else(|| self.max_device.map_or(0, |d| d + 1))
    }

    /// The number of lines read so far.
    pub fn lines(&self) -> usize {
        self.lineno
    }
}

impl<R: BufRead> Events<R> {
    /// Parses one complete line (without its `\n`); `Some` for an event or an error.
    fn line(parser: &mut LineParser, raw: &[u8], lineno: usize, header: &mut Option<Header>) -> Option<Result<(usize, TraceEntry), TraceError>> {
        match parser.parse(raw, lineno) {
            Ok(Parsed::Event { device, entry }) => Some(Ok((device, entry))),
            Ok(Parsed::Header(h)) => {
                *header = Some(h);
                None
            }
            Ok(Parsed::Blank | Parsed::Segment(_) | Parsed::Annotation(_)) => None,
            Err(e) => Some(Err(e)),
        }
    }
}

impl<R: BufRead> Iterator for Events<R> {
    type Item = Result<(usize, TraceEntry), TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let parser = self.parser.as_mut()?;
            let buf = match self.r.fill_buf() {
                Ok(b) => b,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    self.parser = None;
                    return Some(Err(self.source.error(e, self.read)));
                }
            };
            let found = if buf.is_empty() {
                // The end: a last line without its newline, then the end of the input.
                if self.line.is_empty() {
                    let p = self.parser.take()?;
                    return p.finish().err().map(Err);
                }
                self.lineno += 1;
                let r = Self::line(parser, &self.line, self.lineno, &mut self.header);
                self.line.clear();
                r
            } else if let Some(p) = memchr::memchr(b'\n', buf) {
                // A whole line: parsed where it lies in the reader's buffer when it all is there.
                self.lineno += 1;
                let r = if self.line.is_empty() {
                    Self::line(parser, &buf[..p], self.lineno, &mut self.header)
                } else {
                    self.line.extend_from_slice(&buf[..p]);
                    let r = Self::line(parser, &self.line, self.lineno, &mut self.header);
                    self.line.clear();
                    r
                };
                self.read += p as u64 + 1;
                self.r.consume(p + 1);
                r
            } else {
                let n = buf.len();
                let bad = buf.iter().any(|&c| crate::input::never_in_json(c));
                self.line.extend_from_slice(buf);
                self.read += n as u64;
                self.r.consume(n);
                if bad || self.line.len() as u64 > crate::input::MAX_VALUE_BYTES {
                    // A line that cannot parse, or is too long to: refused now, not at its end.
                    self.lineno += 1;
                    let lineno = self.lineno;
                    let r = if bad {
                        Self::line(parser, &self.line, lineno, &mut self.header)
                            .or_else(|| Some(Err(TraceError::Jsonl { line: lineno, msg: "a byte JSON never holds".into() })))
                    } else {
                        Some(Err(TraceError::Jsonl {
                            line: lineno,
                            msg: format!(
                                "longer than the {} MiB a line may hold (allocsim_trace::input::MAX_VALUE_BYTES)",
                                crate::input::MAX_VALUE_BYTES >> 20
                            ),
                        }))
                    };
                    self.line.clear();
                    r
                } else {
                    None
                }
            };
            match found {
                Some(Ok((device, entry))) => {
                    self.max_device = Some(self.max_device.map_or(device, |d| d.max(device)));
                    return Some(Ok((device, entry)));
                }
                Some(Err(e)) => {
                    self.parser = None;
                    return Some(Err(e));
                }
                None => {}
            }
        }
    }
}

/// What a replay needs before the events: see [`scan`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Scan {
    pub header: Header,
    /// The final segments, every device's, in file order.
    pub segments: Vec<SnapshotSegment>,
    /// By device: its `segment_alloc`, `segment_free`, `segment_map` and `segment_unmap` entries in
    /// order (stacks not kept).
    pub segment_entries: Vec<Vec<TraceEntry>>,
}

/// The outcome of [`scan`] when the input is readable.
#[derive(Debug)]
pub enum Scanned {
    Done(Scan),
    /// A line could not be parsed: the input is not a valid trace. Which error comes first in line
    /// order (what [`crate::jsonl::read`] reports) takes a pass with [`Events`] to tell.
    Invalid,
}

/// The first pass over a JSON Lines trace: the header, the final segments and the segment events,
/// parsing only the lines that can hold them (see the module documentation). I/O errors are
/// returned at once; a line that does not parse makes it [`Scanned::Invalid`].
pub fn scan(mut r: impl Read, source: &Source) -> Result<Scanned, TraceError> {
    const CHUNK: usize = 1 << 22;
    let segment = memchr::memmem::Finder::new(b"segment");
    let escape = memchr::memmem::Finder::new(b"\\u");
    let mut out = Scan::default();
    let mut parser = LineParser::new(false);
    let mut saw_header = false;
    let mut buf: Vec<u8> = Vec::with_capacity(2 * CHUNK);
    let mut read = 0u64;
    let mut candidates: Vec<usize> = Vec::new();
    // Parses one line; false when it does not parse.
    let take = |line: &[u8], parser: &mut LineParser, out: &mut Scan, saw_header: &mut bool| -> bool {
        match parser.parse(line, 0) {
            Ok(Parsed::Header(h)) => {
                out.header = h;
                *saw_header = true;
            }
            Ok(Parsed::Segment(s)) => out.segments.push(s),
            Ok(Parsed::Event { device, entry }) => {
                if entry.action.is_segment_event() {
                    if out.segment_entries.len() <= device {
                        out.segment_entries.resize_with(device + 1, Vec::new);
                    }
                    out.segment_entries[device].push(entry);
                }
            }
            Ok(Parsed::Blank | Parsed::Annotation(_)) => {}
            Err(_) => return false,
        }
        true
    };
    loop {
        let old = buf.len();
        buf.resize(old + CHUNK, 0);
        let mut filled = old;
        while filled < buf.len() {
            match r.read(&mut buf[filled..]) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(source.error(e, read + (filled - old) as u64)),
            }
        }
        read += (filled - old) as u64;
        buf.truncate(filled);
        let eof = filled == old;
        // Complete lines only (at the end of the input, the last line too).
        let end = if eof {
            buf.len()
        } else {
            match memchr::memrchr(b'\n', &buf) {
                Some(p) => p + 1,
                // A line too long, or one that cannot parse: what does not parse is named by
                // the events' pass.
                None if buf.len() as u64 > crate::input::MAX_VALUE_BYTES || buf[old..].iter().any(|&c| crate::input::never_in_json(c)) => {
                    return Ok(Scanned::Invalid);
                }
                None => continue,
            }
        };
        let region = &buf[..end];
        let mut pos = 0;
        // Up to the header, every line (blank lines, then the header).
        while !saw_header && pos < region.len() {
            let stop = memchr::memchr(b'\n', &region[pos..]).map_or(region.len(), |p| pos + p);
            if !take(&region[pos..stop], &mut parser, &mut out, &mut saw_header) {
                return Ok(Scanned::Invalid);
            }
            pos = stop + 1;
        }
        if pos < region.len() {
            let rest = &region[pos..];
            candidates.clear();
            candidates.extend(segment.find_iter(rest).map(|p| pos + p));
            candidates.extend(escape.find_iter(rest).map(|p| pos + p));
            candidates.sort_unstable();
            let mut next = pos;
            for &c in &candidates {
                if c < next {
                    continue;
                }
                let start = memchr::memrchr(b'\n', &region[..c]).map_or(0, |p| p + 1).max(pos);
                let stop = memchr::memchr(b'\n', &region[c..]).map_or(region.len(), |p| c + p);
                if !take(&region[start..stop], &mut parser, &mut out, &mut saw_header) {
                    return Ok(Scanned::Invalid);
                }
                next = stop + 1;
            }
        }
        if eof {
            break;
        }
        buf.drain(..end);
    }
    if !saw_header {
        return Ok(Scanned::Invalid);
    }
    Ok(Scanned::Done(out))
}

/// A JSON Lines trace file, plain or gzip'd, read by [`JsonlFile::scan`] and
/// [`JsonlFile::events`] as many times as needed.
#[derive(Clone, Debug)]
pub struct JsonlFile {
    path: PathBuf,
    gzip: bool,
}

/// A reader of a (possibly gunzipped) trace file.
pub type TraceReader = Box<dyn BufRead + Send>;

impl JsonlFile {
    /// `Some` when `path` holds a JSON Lines trace (its first non-blank byte, after gunzipping, is
    /// `{`: what [`crate::read_trace`] takes as JSON Lines); `None` for anything else, and for a
    /// file whose first bytes cannot be read (then [`crate::read_trace`] says why).
    pub fn open(path: &Path) -> Result<Option<JsonlFile>, TraceError> {
        let io = |e| TraceError::Io { path: path.display().to_string(), source: e };
        let mut f = std::fs::File::open(path).map_err(io)?;
        let mut head = [0u8; 2];
        let gzip = match f.read_exact(&mut head) {
            Ok(()) => head == [0x1f, 0x8b],
            Err(_) => return Ok(None),
        };
        let file = JsonlFile { path: path.to_path_buf(), gzip };
        let Ok(mut r) = file.reader() else { return Ok(None) };
        // The first non-whitespace byte, within the first MiB.
        let mut seen = 0usize;
        loop {
            let Ok(b) = r.fill_buf() else { return Ok(None) };
            if b.is_empty() || seen > 1 << 20 {
                return Ok(None);
            }
            if let Some(at) = b.iter().position(|c| !c.is_ascii_whitespace()) {
                if b[at] != b'{' {
                    return Ok(None);
                }
                // A snapshot saved as JSON is read whole, as a pickle is.
                let head = &b[at..b.len().min(at + 4096)];
                return Ok((!crate::is_json_snapshot(head)).then_some(file));
            }
            let n = b.len();
            seen += n;
            r.consume(n);
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file's size on disk (compressed, for a gzip'd one).
    pub fn len(&self) -> u64 {
        std::fs::metadata(&self.path).map_or(0, |m| m.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn source(&self) -> Source {
        Source { path: self.path.display().to_string(), gzip: self.gzip }
    }

    /// The file's bytes (gunzipped), buffered.
    pub fn reader(&self) -> Result<TraceReader, TraceError> {
        let f = std::fs::File::open(&self.path).map_err(|e| TraceError::Io { path: self.path.display().to_string(), source: e })?;
        Ok(if self.gzip {
            Box::new(BufReader::with_capacity(1 << 20, crate::input::GzReader::new(BufReader::with_capacity(1 << 20, f))))
        } else {
            Box::new(BufReader::with_capacity(1 << 20, f))
        })
    }

    /// The first pass ([`scan`]). When a line does not parse, the error [`crate::jsonl::read`]
    /// would give (the first in line order), found by a pass with [`Events`].
    pub fn scan(&self) -> Result<Scan, TraceError> {
        match scan(self.reader()?, &self.source())? {
            Scanned::Done(s) => Ok(s),
            Scanned::Invalid => {
                let mut events = self.events()?;
                for e in &mut events {
                    e?;
                }
                Err(TraceError::Jsonl { line: events.lines(), msg: "a line that does not parse".into() })
            }
        }
    }

    /// The events ([`Events`]).
    pub fn events(&self) -> Result<Events<TraceReader>, TraceError> {
        Ok(Events::new(self.reader()?, self.source()))
    }
}
