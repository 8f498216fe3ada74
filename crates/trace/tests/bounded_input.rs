//! Hostile and unusual inputs (issue 29): each ends in the answer of the plain file or in an
//! error naming a byte offset, and the decoding's peak heap is bounded: measured by a counting
//! global allocator (this test binary's own), with the tests run one at a time.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::{Read, Write};
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use allocsim_trace::input::{GzReader, Look, MAX_VALUE_BYTES, Seen};
use allocsim_trace::pickle_stream::PickleFile;
use allocsim_trace::{Snapshot, TraceError, read_trace, read_trace_bytes, read_trace_whole};

struct Counting;

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(n: usize) {
    let now = CURRENT.fetch_add(n, Ordering::Relaxed) + n;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call goes to `System` as it is; only the sizes are counted.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            grew(l.size());
        }
        p
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(l) };
        if !p.is_null() {
            grew(l.size());
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) };
        CURRENT.fetch_sub(l.size(), Ordering::Relaxed);
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let q = unsafe { System.realloc(p, l, new) };
        if !q.is_null() {
            // (Counted as the new block beside the old, as a moving realloc needs for a moment.)
            grew(new);
            CURRENT.fetch_sub(l.size(), Ordering::Relaxed);
        }
        q
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// One test at a time, so that the peak is the measured code's.
static ONE: Mutex<()> = Mutex::new(());

/// `f`'s result and the most heap it held at once beyond what was held before it.
fn peak_of<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let before = CURRENT.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let t = f();
    (t, PEAK.load(Ordering::Relaxed).saturating_sub(before))
}

const MIB: usize = 1 << 20;

/// A file in the temporary directory, removed when dropped.
struct Temp(PathBuf);

impl Temp {
    fn new(name: &str, bytes: &[u8]) -> Temp {
        let p = std::env::temp_dir().join(format!("allocsim-bounded-{}-{name}", std::process::id()));
        std::fs::write(&p, bytes).unwrap();
        Temp(p)
    }
}

impl Drop for Temp {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

/// A gzip'd file of `prefix` and then `mib` MiB of `fill` bytes, made without compressing them
/// all: the deflate data of one MiB of `fill` after a sync flush (which refers only to the
/// `fill` bytes before it) is repeated. Its trailer is not the contents' (no reader here gets
/// that far).
fn bomb(prefix: &[u8], fill: u8, mib: usize) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::new(6));
    e.write_all(prefix).unwrap();
    e.write_all(&vec![fill; MIB]).unwrap();
    e.flush().unwrap();
    let l1 = e.get_ref().len();
    e.write_all(&vec![fill; MIB]).unwrap();
    e.flush().unwrap();
    let mut out = e.get_ref().clone();
    let seg = out[l1..].to_vec();
    for _ in 2..mib {
        out.extend_from_slice(&seg);
    }
    out.extend_from_slice(&[0x03, 0x00]); // a last, empty block of the fixed code
    out.extend_from_slice(&[0; 8]);
    // What it holds, checked on its first MiBs.
    let mut head = vec![0u8; prefix.len() + 3 * MIB];
    flate2::read::GzDecoder::new(&out[..]).read_exact(&mut head).unwrap();
    assert!(head.starts_with(prefix) && head[prefix.len()..].iter().all(|&b| b == fill));
    out
}

fn message(r: Result<Snapshot, TraceError>) -> String {
    match r {
        Ok(_) => panic!("an answer where an error was expected"),
        Err(e) => e.to_string(),
    }
}

/// The offset an error message names ("... at byte N ...").
fn byte_named(msg: &str) -> u64 {
    let at = msg.find("at byte ").unwrap_or_else(|| panic!("no byte offset in {msg:?}")) + 8;
    msg[at..].split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
}

fn real(name: &str) -> Vec<u8> {
    std::fs::read(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../traces").join(name)).unwrap()
}

fn gunzip(gz: &[u8]) -> Vec<u8> {
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(gz).read_to_end(&mut raw).unwrap();
    raw
}

#[test]
fn a_huge_string_declared_in_a_small_gzip_is_refused_at_its_header() {
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    // BINUNICODE of 4 GiB − 1 bytes, which follow: 4 GiB of 'a' in about 4 MB.
    let gz = bomb(b"\x80\x04X\xff\xff\xff\xff", b'a', 4096);
    assert!(gz.len() < 8 * MIB, "{} bytes", gz.len());
    let f = Temp::new("huge-string.pickle.gz", &gz);
    for (how, read) in [("read_trace", read_trace as fn(&std::path::Path) -> _), ("read_trace_whole", read_trace_whole)] {
        let (r, peak) = peak_of(|| read(&f.0));
        let msg = message(r);
        assert_eq!(byte_named(&msg), 2, "{how}: {msg}");
        assert!(msg.contains("BINUNICODE declares 4294967295 bytes, more than the 256 MiB"), "{how}: {msg}");
        assert!(peak < 16 * MIB, "{how}: peak heap {peak} bytes");
    }
    let (r, peak) = peak_of(|| read_trace_bytes(&gz));
    assert_eq!(byte_named(&message(r)), 2);
    assert!(peak < 16 * MIB, "read_trace_bytes: peak heap {peak} bytes");
    // The stream's machine steps aside at once.
    let (r, peak) = peak_of(|| PickleFile::open(&f.0).unwrap().unwrap().compact());
    assert!(matches!(r, Err(TraceError::Unstreamable(_))));
    assert!(peak < 16 * MIB, "compact: peak heap {peak} bytes");
}

#[test]
fn a_gzip_of_zeros_is_refused_at_byte_0() {
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let gz = bomb(b"", 0, 4096);
    let f = Temp::new("zeros.gz", &gz);
    let (r, peak) = peak_of(|| read_trace(&f.0));
    let msg = message(r);
    assert_eq!(byte_named(&msg), 0, "{msg}");
    assert!(msg.contains("unknown opcode") || msg.contains("0x00"), "{msg}");
    assert!(peak < 16 * MIB, "peak heap {peak} bytes");
    assert!(PickleFile::open(&f.0).unwrap().is_none());
    assert!(allocsim_trace::jsonl_stream::JsonlFile::open(&f.0).unwrap().is_none());
    // A pickle's start, then zeros: refused where the zeros start.
    let gz = bomb(b"\x80\x04}", 0, 4096);
    let f = Temp::new("dict-zeros.gz", &gz);
    let (r, peak) = peak_of(|| read_trace(&f.0));
    assert_eq!(byte_named(&message(r)), 3);
    assert!(peak < 16 * MIB, "peak heap {peak} bytes");
}

#[test]
fn a_sparse_file_is_refused_without_reading_it() {
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let f = Temp::new("sparse", b"");
    std::fs::OpenOptions::new().write(true).open(&f.0).unwrap().set_len(1 << 30).unwrap();
    let (r, peak) = peak_of(|| read_trace(&f.0));
    assert_eq!(byte_named(&message(r)), 0);
    assert!(peak < 4 * MIB, "peak heap {peak} bytes");
    // A pickle's start, then zeros.
    let f = Temp::new("sparse-pickle", b"\x80\x04}");
    std::fs::OpenOptions::new().write(true).open(&f.0).unwrap().set_len(1 << 30).unwrap();
    let (r, peak) = peak_of(|| read_trace_whole(&f.0));
    assert_eq!(byte_named(&message(r)), 3);
    assert!(peak < 4 * MIB, "peak heap {peak} bytes");
    // JSON Lines, then zeros: refused at the line of zeros, by the whole read and the stream.
    let snap = read_trace(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../traces/emptycache__default__0M.pickle.gz")).unwrap();
    let mut jsonl = Vec::new();
    allocsim_trace::write_trace_to(&snap, allocsim_trace::OutputFormat::Jsonl, false, &mut jsonl).unwrap();
    let lines = jsonl.iter().filter(|&&b| b == b'\n').count();
    let f = Temp::new("sparse.jsonl", &jsonl);
    std::fs::OpenOptions::new().write(true).open(&f.0).unwrap().set_len(1 << 30).unwrap();
    let (r, peak) = peak_of(|| read_trace(&f.0));
    match r {
        Err(TraceError::Jsonl { line, .. }) => assert_eq!(line, lines + 1),
        other => panic!("{other:?}"),
    }
    assert!(peak < 8 * MIB, "peak heap {peak} bytes");
    let file = allocsim_trace::jsonl_stream::JsonlFile::open(&f.0).unwrap().expect("JSON Lines");
    let (last, peak) = peak_of(|| file.events().unwrap().find_map(Result::err));
    match last {
        Some(TraceError::Jsonl { line, .. }) => assert_eq!(line, lines + 1),
        other => panic!("{other:?}"),
    }
    assert!(peak < 8 * MIB, "events: peak heap {peak} bytes");
}

#[test]
fn a_padded_gzip_reads_as_the_file_unpadded() {
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    for name in ["emptycache__default__0M.pickle.gz", "cudagraph__default__0M.pickle.gz"] {
        let gz = real(name);
        let expected = read_trace_bytes(&gz).unwrap();
        for pad in [1, 7, 1000, 100_000] {
            let mut padded = gz.clone();
            padded.extend(std::iter::repeat_n(0u8, pad));
            let f = Temp::new(&format!("padded-{pad}-{name}"), &padded);
            assert_eq!(read_trace(&f.0).unwrap(), expected, "{name} + {pad} zeros");
            assert_eq!(read_trace_whole(&f.0).unwrap(), expected, "{name} + {pad} zeros, whole");
            assert_eq!(PickleFile::open(&f.0).unwrap().expect("a pickle").compact().unwrap(), expected, "{name} + {pad}, compact");
            assert_eq!(read_trace_bytes(&padded).unwrap(), expected);
            let mut raw = Vec::new();
            GzReader::new(&padded[..]).read_to_end(&mut raw).unwrap();
            assert_eq!(raw, gunzip(&gz));
        }
        // Not zeros after the member: refused, naming where.
        let mut bad = gz.clone();
        bad.extend_from_slice(b"\0\0garbage");
        let msg = message(read_trace_bytes(&bad));
        assert!(msg.contains(&format!("at compressed byte {}", gz.len() + 2)), "{msg}");
    }
}

#[test]
fn concatenated_gzip_members_read_as_one_stream() {
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let gz = real("cudagraph__default__0M.pickle.gz");
    let raw = gunzip(&gz);
    let expected = read_trace_bytes(&gz).unwrap();
    for parts in [2, 3, 17] {
        let mut cat = Vec::new();
        for (i, piece) in raw.chunks(raw.len().div_ceil(parts)).enumerate() {
            cat.extend(gzip(piece));
            // Zeros between members too, which Python's gzip skips.
            cat.extend(std::iter::repeat_n(0u8, i % 3));
        }
        let f = Temp::new(&format!("members-{parts}.pickle.gz"), &cat);
        assert_eq!(read_trace(&f.0).unwrap(), expected, "{parts} members");
        assert_eq!(read_trace_whole(&f.0).unwrap(), expected, "{parts} members, whole");
        assert_eq!(read_trace_bytes(&cat).unwrap(), expected);
    }
}

#[test]
fn memo_indices_no_pickler_writes_are_refused() {
    use allocsim_trace::pickle::decode;
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    // LONG_BINPUT 2^31 − 1 (CPython: a MemoryError, growing its memo to 32 GiB).
    let e = decode(b"\x80\x04}r\xff\xff\xff\x7f.").unwrap_err();
    assert_eq!(e.offset, 3, "{e}");
    assert!(e.msg.contains("memo index 2147483647"), "{e}");
    // Then LONG_BINGET of it, as the audit's file had.
    let e = decode(b"\x80\x04}r\xff\xff\xff\x7fj\xff\xff\xff\x7f.").unwrap_err();
    assert_eq!(e.offset, 3, "{e}");
    // The text opcode PUT.
    let e = decode(b"(dp2147483647\n.").unwrap_err();
    assert_eq!(e.offset, 2, "{e}");
    // As a file: the error line names it.
    let msg = message(read_trace_bytes(b"\x80\x04}r\xff\xff\xff\x7f."));
    assert_eq!(byte_named(&msg), 3, "{msg}");
    // What CPython takes: small indices anywhere, and any index at or below its offset.
    assert!(decode(b"\x80\x04]q\xff.").is_ok());
    assert!(decode(b"\x80\x04]r\x00\x00\x10\x00h\x00.").is_err(), "index 2^20 put, 0 not");
    assert!(decode(b"\x80\x04]r\x00\x00\x10\x00j\x00\x00\x10\x00.").is_ok());
}

#[test]
fn declared_lengths_over_the_limit_name_their_offset() {
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let limit = MAX_VALUE_BYTES + 1;
    let le8 = limit.to_le_bytes();
    let le4 = (limit as u32).to_le_bytes();
    let cases: Vec<(Vec<u8>, &str)> = vec![
        ([&b"\x80\x04\x8e"[..], &le8, b"xx."].concat(), "BINBYTES8"),
        ([&b"\x80\x04\x8d"[..], &le8, b"xx."].concat(), "BINUNICODE8"),
        ([&b"\x80\x04\x95"[..], &le8, b"N."].concat(), "FRAME"),
        ([&b"\x80\x04B"[..], &le4, b"xx."].concat(), "BINBYTES"),
        ([&b"\x80\x02\x8b"[..], &le4, b"xx."].concat(), "LONG4"),
        ([&b"\x80\x02T"[..], &le4, b"xx."].concat(), "BINSTRING"),
    ];
    for (bytes, op) in cases {
        for gz in [false, true] {
            let input = if gz { gzip(&bytes) } else { bytes.clone() };
            let f = Temp::new(&format!("{op}-{gz}"), &input);
            let (r, peak) = peak_of(|| read_trace(&f.0));
            let msg = message(r);
            assert_eq!(byte_named(&msg), 2, "{op}: {msg}");
            assert!(msg.contains(&format!("{op} declares {limit} bytes")), "{op}: {msg}");
            assert!(peak < 16 * MIB, "{op}: peak heap {peak} bytes");
        }
    }
    // At the limit, a length is only checked against what remains.
    let le4 = (MAX_VALUE_BYTES as u32).to_le_bytes();
    let msg = message(read_trace_bytes(&[&b"\x80\x04X"[..], &le4, b"xx."].concat()));
    assert!(msg.contains("only 3 remain"), "{msg}");
}

#[test]
fn the_look_stops_at_the_stop_whatever_the_chunks() {
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let mut pickles: Vec<Vec<u8>> =
        ["snap/small_p2.pickle", "snap/small_p4.pickle", "snap/small_p5.pickle", "snap/torch_frames_p2.pickle", "snap/pre21.pickle"]
            .iter()
            .map(|p| common::fixture(p))
            .collect();
    pickles.push(gunzip(&real("cudagraph__default__0M.pickle.gz")));
    for p in &pickles {
        let stop = p.len() as u64 - 1;
        assert_eq!(p[stop as usize], b'.');
        for chunk in [1, 2, 3, 5, 8, 13, 4096, p.len()] {
            let mut look = Look::new();
            let mut seen = Seen::More;
            for c in p.chunks(chunk) {
                seen = look.feed(c);
                if seen != Seen::More {
                    break;
                }
            }
            assert_eq!(seen, Seen::EndsBy(stop), "chunks of {chunk}");
        }
        // Bytes after the STOP are not read for it.
        let mut padded = p.clone();
        padded.extend_from_slice(&[0u8; 100]);
        assert_eq!(Look::new().feed(&padded), Seen::EndsBy(stop));
    }
}
