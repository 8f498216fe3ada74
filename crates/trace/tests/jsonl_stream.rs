//! JSON Lines read as a stream (`jsonl_stream`): the same entries, segments and errors as reading
//! the whole file with `jsonl::read`.

mod common;

use std::io::Write;

use allocsim_trace::jsonl_stream::{Events, JsonlFile, Scan, Scanned, Source, scan};
use allocsim_trace::{Action, Snapshot, TraceEntry, TraceError, jsonl};
use common::{fixture, real_trace};

fn src() -> Source {
    Source { path: "test".into(), gzip: false }
}

fn to_jsonl(s: &Snapshot) -> Vec<u8> {
    let mut out = Vec::new();
    jsonl::write(s, &mut out).unwrap();
    out
}

/// Entries without their stacks (a stream does not keep them).
fn bare(s: &Snapshot) -> Vec<Vec<TraceEntry>> {
    s.device_traces.iter().map(|t| t.iter().map(|e| TraceEntry { stack: 0, ..*e }).collect()).collect()
}

/// What `jsonl::read` gives, as `Events` and `scan` should give it.
fn check_stream(text: &[u8]) {
    let whole = jsonl::read(text).unwrap_or_else(|e| panic!("{e}"));
    // Events: every entry, in order, by device.
    let mut events = Events::new(text, src());
    let mut traces: Vec<Vec<TraceEntry>> = vec![Vec::new(); whole.device_traces.len()];
    for item in &mut events {
        let (d, e) = item.unwrap_or_else(|e| panic!("{e}"));
        traces[d].push(e);
    }
    assert_eq!(traces, bare(&whole));
    assert_eq!(events.devices(), whole.device_traces.len());
    assert_eq!(events.header().map(|h| &h.settings), Some(&whole.settings));
    // scan: the header, the segments (without stacks) and the segment entries.
    let Scanned::Done(Scan { header, segments, segment_entries }) = scan(text, &src()).unwrap() else { panic!("scan refused a valid trace") };
    assert_eq!(header.settings, whole.settings);
    let mut want_segments = whole.segments.clone();
    for b in want_segments.iter_mut().flat_map(|s| s.blocks.iter_mut()) {
        b.stack = 0;
    }
    assert_eq!(segments, want_segments);
    for (d, t) in bare(&whole).iter().enumerate() {
        let want: Vec<TraceEntry> =
            t.iter().filter(|e| matches!(e.action, Action::SegmentAlloc | Action::SegmentFree | Action::SegmentMap | Action::SegmentUnmap)).copied().collect();
        assert_eq!(segment_entries.get(d).cloned().unwrap_or_default(), want, "device {d}");
    }
}

#[test]
fn streams_the_fixtures() {
    for f in ["snap/small_p2.pickle", "snap/small_p4.pickle", "snap/small_p5.pickle"] {
        let s = allocsim_trace::snapshot::from_pickle(&fixture(f)).unwrap();
        check_stream(&to_jsonl(&s));
    }
}

#[test]
fn streams_real_traces() {
    for name in ["frag__default__2048M.pickle.gz", "multistream__expandable__0M.pickle.gz", "cudagraph__default__0M.pickle.gz"] {
        let Some(p) = real_trace(name) else { continue };
        let s = allocsim_trace::read_trace(&p).unwrap();
        let text = to_jsonl(&s);
        check_stream(&text);
        // Whatever the chunking of the reader.
        let r = std::io::BufReader::with_capacity(7, &text[..]);
        let n = Events::new(r, src()).count();
        assert_eq!(n, s.device_traces.iter().map(Vec::len).sum::<usize>());
    }
}

#[test]
fn scan_finds_lines_with_escaped_keys_and_blank_lines() {
    // A segment line whose key is spelled with escapes, CRLF line ends, blank lines, no final newline.
    let text = concat!(
        "\n  \r\n",
        r#"{"format":"allocsim-trace","version":1}"#,
        "\r\n",
        r#"{"action":"alloc","addr":1024,"size":512,"frames":[{"name":"segment","filename":"x.py","line":1}]}"#,
        "\n",
        r#"{"action":"segment_\u0061lloc","addr":0,"size":2097152}"#,
        "\n",
        r#"{"\u0073egment":{"address":0,"total_size":2097152}}"#,
    );
    check_stream(text.as_bytes());
    let Scanned::Done(s) = scan(text.as_bytes(), &src()).unwrap() else { panic!() };
    assert_eq!(s.segments.len(), 1);
    assert_eq!(s.segment_entries[0].len(), 1);
}

#[test]
fn errors_are_those_of_a_whole_read() {
    let h = r#"{"format":"allocsim-trace","version":1,"devices":1}"#;
    let ev = r#"{"action":"alloc","addr":1,"size":2}"#;
    let seg = r#"{"segment":{"address":1,"total_size":2}}"#;
    let cases = [
        String::new(),
        "\n\n".to_string(),
        ev.to_string(),
        format!("{h}\n{ev}\n{{oops\n{seg}"),
        format!("{h}\n{ev}\n{seg}\n{{\"segment\":{{\"address\":1}}}}"),
        // A bad event line before a bad segment line: the event's error, as in line order.
        format!("{h}\n{{\"action\":\"frob\",\"addr\":1,\"size\":2}}\n{{\"segment\":{{\"address\":1}}}}"),
        format!("{h}\n{{\"device\":3,\"action\":\"segment_alloc\",\"addr\":1,\"size\":2}}"),
        format!("{h}\n{h}"),
        format!("{h}\n{ev}\n\u{0}garbage"),
    ];
    for text in cases {
        let Err(TraceError::Jsonl { line, msg }) = jsonl::read(text.as_bytes()) else { panic!("{text:?} should not read") };
        let mut events = Events::new(text.as_bytes(), src());
        let e = events.find_map(Result::err).unwrap_or_else(|| panic!("{text:?}: the stream found no error"));
        let TraceError::Jsonl { line: l2, msg: m2 } = e else { panic!("{e}") };
        assert_eq!((l2, &m2), (line, &msg), "{text:?}");
        assert!(events.next().is_none(), "the stream goes on after an error");
        // And through a file, scan first.
        let f = tempfile(&format!("err{}.jsonl", line), text.as_bytes());
        if let Some(file) = JsonlFile::open(&f.0).unwrap() {
            match file.scan() {
                Err(TraceError::Jsonl { line: l3, msg: m3 }) => assert_eq!((l3, &m3), (line, &msg), "{text:?}"),
                other => {
                    // The scan may not see an event's error; the events pass then does.
                    assert!(other.is_ok(), "{text:?}: {other:?}");
                    let e = file.events().unwrap().find_map(Result::err).expect("an error");
                    assert_eq!(e.to_string(), TraceError::Jsonl { line, msg: msg.clone() }.to_string());
                }
            }
        }
    }
}

struct TempFile(std::path::PathBuf);
impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
fn tempfile(name: &str, bytes: &[u8]) -> TempFile {
    let p = std::env::temp_dir().join(format!("allocsim-trace-stream-{}-{name}", std::process::id()));
    std::fs::write(&p, bytes).unwrap();
    TempFile(p)
}

#[test]
fn files_plain_and_gzipped() {
    let s = allocsim_trace::snapshot::from_pickle(&fixture("snap/small_p4.pickle")).unwrap();
    let text = to_jsonl(&s);
    let plain = tempfile("small.jsonl", &text);
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&text).unwrap();
    let gz = gz.finish().unwrap();
    let zipped = tempfile("small.jsonl.gz", &gz);
    for f in [&plain, &zipped] {
        let file = JsonlFile::open(&f.0).unwrap().expect("a JSON Lines file");
        let sc = file.scan().unwrap();
        assert_eq!(sc.segments.len(), s.segments.len());
        let mut traces: Vec<Vec<TraceEntry>> = vec![Vec::new(); s.device_traces.len()];
        for item in file.events().unwrap() {
            let (d, e) = item.unwrap();
            traces[d].push(e);
        }
        assert_eq!(traces, bare(&s));
    }
    // A pickle is not JSON Lines; a cut gzip stream is a gzip error with the file's path.
    let pickle = tempfile("small.pickle", &fixture("snap/small_p4.pickle"));
    assert!(JsonlFile::open(&pickle.0).unwrap().is_none());
    let cut = tempfile("cut.jsonl.gz", &gz[..gz.len() - 12]);
    if let Some(file) = JsonlFile::open(&cut.0).unwrap() {
        let e = file.scan().unwrap_err();
        assert!(matches!(e, TraceError::Gzip(_)), "{e}");
    }
    // A missing file names itself.
    let e = JsonlFile::open(std::path::Path::new("/nonexistent/x.jsonl")).unwrap_err();
    assert!(e.to_string().contains("/nonexistent/x.jsonl"), "{e}");
}
