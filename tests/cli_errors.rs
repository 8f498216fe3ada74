//! The `allocsim` binary on bad input and on the recorded traces.
//!
//! Bad input (a truncated or corrupt trace, a pickle that would construct Python objects, a pickle
//! that is not a snapshot, a settings string PyTorch refuses, a bad size, a missing file) must end
//! with exit status 2 and one line `allocsim: error: ...` on stderr that names the problem, and
//! never with a panic. Argument errors are clap's (`error: ...`, exit status 2).
//!
//! The good-input tests compare the replay with what the real allocator did
//! (`traces/*.json`: `memory_stats()` and the OOM log recorded next to each snapshot).

use std::path::{Path, PathBuf};

use serde_json::Value;

mod common;
use common::*;

fn frag_trace() -> PathBuf {
    root("traces/frag__default__2048M.pickle.gz")
}

/// A plain (uncompressed) protocol-4 snapshot pickle, written by the trace crate's fixture script.
fn plain_snapshot(protocol: u8) -> PathBuf {
    root(&format!("crates/trace/tests/fixtures/snap/small_p{protocol}.pickle"))
}

/// A file under the system temp dir, removed when dropped.
struct TempFile(PathBuf);

impl TempFile {
    fn new(name: &str) -> TempFile {
        TempFile(std::env::temp_dir().join(format!("allocsim-cli-test-{}-{name}", std::process::id())))
    }
    fn with(name: &str, bytes: &[u8]) -> TempFile {
        let t = TempFile::new(name);
        std::fs::write(&t.0, bytes).unwrap_or_else(|e| panic!("{}: {e}", t.0.display()));
        t
    }
    fn path(&self) -> &Path {
        &self.0
    }
    fn arg(&self) -> &str {
        self.0.to_str().expect("UTF-8 temp path")
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// splitmix64 bytes: deterministic "random" input.
fn pseudo_random_bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut s = seed;
    let mut out = Vec::with_capacity(n + 8);
    while out.len() < n {
        s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(n);
    out
}

// ---------------------------------------------------------------------------------------------
// Corrupt and foreign input
// ---------------------------------------------------------------------------------------------

#[test]
fn truncated_gzip() {
    let gz = std::fs::read(frag_trace()).unwrap();
    let half = TempFile::with("half.pickle.gz", &gz[..gz.len() / 2]);
    let line = user_error(&["replay", half.arg()], &["gzip", half.arg()]);
    assert!(line.contains("deflate") || line.contains("end of file"), "{line}");
    // Other cut points, through the header, the deflate stream and the trailer; every command.
    for cut in [2, 10, 100, gz.len() - 8, gz.len() - 1] {
        let t = TempFile::with(&format!("cut{cut}.pickle.gz"), &gz[..cut]);
        user_error(&["replay", t.arg()], &["gzip"]);
        user_error(&["validate", t.arg()], &["gzip"]);
        let out = TempFile::new(&format!("cut{cut}.jsonl"));
        user_error(&["convert", t.arg(), "-o", out.arg()], &["gzip"]);
        assert!(!out.path().exists(), "convert wrote {} from a truncated input", out.path().display());
    }
}

#[test]
fn truncated_plain_pickle() {
    for protocol in [2u8, 4] {
        let path = plain_snapshot(protocol);
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        // The whole file is a good snapshot...
        success(&["replay", path.to_str().unwrap()]);
        // ...and every prefix of it is refused cleanly.
        let mut cuts: Vec<usize> = (0..bytes.len()).step_by(37).collect();
        cuts.extend([bytes.len() / 2, bytes.len() - 1]);
        for cut in cuts {
            let t = TempFile::with(&format!("p{protocol}-cut{cut}.pickle"), &bytes[..cut]);
            user_error(&["replay", t.arg()], &[t.arg()]);
        }
        // Cut in half: the message says it is a pickle problem.
        let t = TempFile::with(&format!("p{protocol}-half.pickle"), &bytes[..bytes.len() / 2]);
        user_error(&["replay", t.arg()], &["pickle"]);
        // Without the final STOP opcode (protocol 4: inside the last FRAME).
        let t = TempFile::with(&format!("p{protocol}-nostop.pickle"), &bytes[..bytes.len() - 1]);
        user_error(&["replay", t.arg()], &["pickle", "truncated"]);
    }
}

#[test]
fn empty_file() {
    let t = TempFile::with("empty.pickle", b"");
    user_error(&["replay", t.arg()], &["not a memory snapshot", "the file is empty"]);
}

#[test]
fn random_bytes() {
    for seed in 0..8u64 {
        let mut b = pseudo_random_bytes(seed, 4096);
        // Not gzip's magic, not JSON: taken as a pickle.
        if b[0] == 0x1f || b[0] == b'{' || b[0].is_ascii_whitespace() {
            b[0] = 0xbb;
        }
        let t = TempFile::with(&format!("random{seed}.bin"), &b);
        user_error(&["replay", t.arg()], &["pickle", t.arg()]);
        user_error(&["validate", t.arg()], &["pickle"]);
    }
    // Random bytes behind gzip's magic.
    let mut b = vec![0x1f, 0x8b];
    b.extend(pseudo_random_bytes(99, 4096));
    let t = TempFile::with("random.gz", &b);
    user_error(&["replay", t.arg()], &["gzip"]);
    // Random bytes that start like JSON.
    let mut b = b"{".to_vec();
    b.extend(pseudo_random_bytes(98, 4096));
    let t = TempFile::with("random.jsonl", &b);
    user_error(&["replay", t.arg()], &["JSON Lines", "line 1"]);
}

#[test]
fn pickle_with_global_opcode() {
    // `pickle.dumps(collections.OrderedDict(a=1), protocol=2)`: GLOBAL collections.OrderedDict.
    let ordered_dict = b"\x80\x02ccollections\nOrderedDict\nq\x00)Rq\x01X\x01\x00\x00\x00aq\x02K\x01s.";
    let t = TempFile::with("global.pickle", ordered_dict);
    let line = user_error(&["replay", t.arg()], &["GLOBAL"]);
    assert!(!line.contains("STACK_GLOBAL"), "{line}");
    // The classic exploit: GLOBAL os.system, REDUCE. Refused, never executed.
    let marker = TempFile::new("pwned");
    let cmd = format!("touch {}", marker.arg());
    let mut exploit = b"\x80\x02cos\nsystem\n(X".to_vec();
    exploit.extend((cmd.len() as u32).to_le_bytes());
    exploit.extend(cmd.as_bytes());
    exploit.extend(b"tR.");
    let t = TempFile::with("exploit.pickle", &exploit);
    user_error(&["replay", t.arg()], &["GLOBAL"]);
    user_error(&["validate", t.arg()], &["GLOBAL"]);
    assert!(!marker.path().exists(), "the pickle was executed");
    // Protocol 4: STACK_GLOBAL.
    let p4 = b"\x80\x04\x95)\x00\x00\x00\x00\x00\x00\x00\x8c\x0bcollections\x94\x8c\x0bOrderedDict\x94\x93\x94)R\x94\x8c\x01a\x94K\x01s.";
    let t = TempFile::with("stack_global.pickle", p4);
    user_error(&["replay", t.arg()], &["STACK_GLOBAL"]);
}

#[test]
fn pickle_that_is_not_a_snapshot() {
    // `pickle.dumps([1, 2, 3], protocol=4)`
    let list = b"\x80\x04\x95\x0b\x00\x00\x00\x00\x00\x00\x00]\x94(K\x01K\x02K\x03e.";
    let t = TempFile::with("list.pickle", list);
    user_error(&["replay", t.arg()], &["not a memory snapshot", "list"]);
    user_error(&["validate", t.arg()], &["not a memory snapshot"]);
    let out = TempFile::new("list.jsonl");
    user_error(&["convert", t.arg(), "-o", out.arg()], &["not a memory snapshot"]);
    // A dict without `device_traces` (a snapshot taken without memory history).
    let no_traces = root("crates/trace/tests/fixtures/snap/no_traces.pickle");
    user_error(&["replay", no_traces.to_str().unwrap()], &["device_traces"]);
    // `pickle.dumps(42, protocol=2)`
    let t = TempFile::with("int.pickle", b"\x80\x02K*.");
    user_error(&["replay", t.arg()], &["not a memory snapshot"]);
}

#[test]
fn bad_jsonl() {
    let header = r#"{"format":"allocsim-trace","version":1,"devices":1}"#;
    let cases: &[(&str, String, &[&str])] = &[
        ("syntax", "{not json\n".into(), &["line 1"]),
        ("version", r#"{"format":"allocsim-trace","version":99,"devices":1}"#.to_string() + "\n", &["version"]),
        ("type", format!("{header}\n{}\n", r#"{"device":0,"action":"alloc","addr":"x","size":512,"stream":0}"#), &["line 2"]),
        ("device", format!("{header}\n{}\n", r#"{"device":7,"action":"alloc","addr":1,"size":512,"stream":0}"#), &["line 2", "device 7"]),
    ];
    for (name, text, needles) in cases {
        let t = TempFile::with(&format!("bad-{name}.jsonl"), text.as_bytes());
        user_error(&["replay", t.arg()], needles);
    }
}

/// The metadata .json written beside a recording (pretty-printed JSON, not a snapshot) is named
/// for what it is, not reported as a JSON Lines syntax error alone.
#[test]
fn a_recordings_metadata_json_is_not_a_trace() {
    let meta = root("traces/field/test_cuda/test_notifies_oom__default.json");
    for cmd in ["replay", "validate", "explain"] {
        user_error(&[cmd, meta.to_str().unwrap()], &["line 1", "unfinished JSON object", "first key is one of segments", "metadata, not a trace"]);
    }
    // A JSON Lines file whose header line is cut short is not called metadata.
    let t = TempFile::with("cut-header.jsonl", br#"{"format":"allocsim-trace","vers"#);
    let e = user_error(&["replay", t.arg()], &["line 1"]);
    assert!(!e.contains("metadata"), "{e}");
}

// ---------------------------------------------------------------------------------------------
// Bad settings and arguments
// ---------------------------------------------------------------------------------------------

#[test]
fn unknown_config_key() {
    let t = frag_trace();
    user_error(&["replay", t.to_str().unwrap(), "--config", "foo_bar:1"], &["Unrecognized key 'foo_bar' in CUDA allocator config."]);
}

#[test]
fn max_split_size_too_small() {
    let t = frag_trace();
    user_error(&["replay", t.to_str().unwrap(), "--config", "max_split_size_mb:19"], &["max_split_size_mb", "must be >= 20"]);
    // 20 is the smallest accepted.
    success(&["replay", t.to_str().unwrap(), "--config", "max_split_size_mb:20"]);
}

#[test]
fn bad_capacity_is_a_clap_error() {
    let t = frag_trace();
    let args = ["replay", t.to_str().unwrap(), "--capacity", "12parsecs"];
    let o = run(&args);
    let err = String::from_utf8_lossy(&o.stderr);
    let ctx = show(&args, &o);
    assert_eq!(o.status.code(), Some(2), "{ctx}");
    assert!(!err.contains("panicked"), "{ctx}");
    assert!(err.starts_with("error:"), "{ctx}");
    assert!(err.contains("'12parsecs'") && err.contains("--capacity"), "{ctx}");
    assert!(err.contains("parsecs"), "{ctx}");
    assert!(o.stdout.is_empty(), "{ctx}");
    // Other refused sizes.
    for bad in ["GiB", "", "-5", "1e999GiB"] {
        let o = run(&["replay", t.to_str().unwrap(), "--capacity", bad]);
        assert_eq!(o.status.code(), Some(2), "--capacity {bad:?}: {}", show(&args, &o));
        assert!(!String::from_utf8_lossy(&o.stderr).contains("panicked"));
    }
}

#[test]
fn missing_file() {
    let missing = root("traces/does_not_exist.pickle.gz");
    let m = missing.to_str().unwrap();
    user_error(&["replay", m], &[m, "No such file"]);
    user_error(&["validate", m], &[m, "No such file"]);
    let out = TempFile::new("missing.jsonl");
    user_error(&["convert", m, "-o", out.arg()], &[m, "No such file"]);
    assert!(!out.path().exists());
    // --addresses-from names its file too.
    let t = frag_trace();
    user_error(&["replay", t.to_str().unwrap(), "--addresses-from", m], &[m, "No such file"]);
    // A directory is not a trace.
    user_error(&["replay", std::env::temp_dir().to_str().unwrap()], &["directory"]);
}

/// The I/O error already names the file; the CLI must not put the path in front again
/// (`allocsim: error: X: X: No such file or directory` was a bug).
#[test]
fn missing_file_names_the_path_once() {
    let missing = root("traces/does_not_exist.pickle.gz");
    let m = missing.to_str().unwrap();
    let line = user_error(&["replay", m], &[m]);
    assert_eq!(line.matches(m).count(), 1, "{line}");
}

#[test]
fn convert_refuses_other_output_formats_and_unwritable_paths() {
    let t = frag_trace();
    let out = TempFile::new("out.txt");
    user_error(&["convert", t.to_str().unwrap(), "-o", out.arg()], &[".jsonl"]);
    assert!(!out.path().exists());
    let nodir = std::env::temp_dir().join(format!("allocsim-no-such-dir-{}", std::process::id())).join("x.jsonl");
    user_error(&["convert", t.to_str().unwrap(), "-o", nodir.to_str().unwrap()], &[nodir.to_str().unwrap()]);
}

#[test]
fn device_not_in_the_snapshot() {
    let t = frag_trace();
    user_error(&["replay", t.to_str().unwrap(), "--device", "5"], &["device 5"]);
}

// ---------------------------------------------------------------------------------------------
// Good input
// ---------------------------------------------------------------------------------------------

fn recorded(json_rel: &str) -> Value {
    let p = root(json_rel);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// PyTorch's OOM message without NVML's per-process sentence, which the replay cannot know.
fn without_process_info(msg: &str) -> String {
    match msg.find("Including non-PyTorch memory") {
        Some(i) => {
            let rest = &msg[i..];
            let end = rest.find("memory in use. ").map(|j| j + "memory in use. ".len()).expect("end of the process sentence");
            format!("{}{}", &msg[..i], &rest[end..])
        }
        None => msg.to_string(),
    }
}

#[test]
fn replay_frag_under_its_recorded_capacity() {
    let rec = recorded("traces/frag__default__2048M.json");
    let cap = rec["cap_bytes"].as_u64().expect("cap_bytes");
    assert_eq!(cap, 2147483648);
    let t = frag_trace();
    let v = json(&["replay", t.to_str().unwrap(), "--capacity", &cap.to_string(), "--json"]);
    let stats = v["stats"].as_object().expect("stats");
    assert_eq!(stats["num_ooms"], 3);
    // Every stat PyTorch's memory_stats() recorded at the end of the run.
    let want = rec["memory_stats"].as_object().expect("memory_stats");
    let mut diffs = Vec::new();
    for (k, w) in want {
        if stats.get(k) != Some(w) {
            diffs.push(format!("{k}: recorded {w}, replayed {:?}", stats.get(k)));
        }
    }
    assert!(diffs.is_empty(), "{} stats differ:\n{}", diffs.len(), diffs.join("\n"));
    assert_eq!(stats["reserved_bytes.all.peak"], rec["max_memory_reserved"]);
    assert_eq!(stats["allocated_bytes.all.peak"], rec["max_memory_allocated"]);
    // The OOMs: requests 300, 301, 302, each an OOM in the recording too, with PyTorch's message.
    let ooms = v["ooms"].as_array().expect("ooms");
    let requests: Vec<u64> = ooms.iter().map(|o| o["request"].as_u64().unwrap()).collect();
    assert_eq!(requests, [300, 301, 302]);
    assert_eq!(v["first_oom"], 300);
    assert!(ooms.iter().all(|o| o["recorded_oom"] == true), "{ooms:?}");
    let logged: Vec<&str> =
        rec["log"].as_array().expect("log").iter().filter_map(|e| e["exception"].as_str()).filter(|m| m.starts_with("CUDA out of memory")).collect();
    assert_eq!(logged.len(), ooms.len(), "OOMs in the recorded log: {logged:?}");
    for (o, m) in ooms.iter().zip(&logged) {
        assert_eq!(o["message"].as_str().unwrap(), without_process_info(m));
    }
    // The segments at the end: as many as recorded.
    assert_eq!(stats["segment.all.current"], rec["segments_at_end"]);
}

#[test]
fn validate_unet512() {
    let t = root("traces/unet512__default__0M.pickle.gz");
    let out = success(&["validate", t.to_str().unwrap()]);
    assert!(out.contains("exact") && !out.contains("NOT exact"), "{out}");
    let v: Value = serde_json::from_str(success(&["validate", t.to_str().unwrap(), "--json"]).trim()).expect("JSON");
    assert_eq!(v["exact"], true, "{v}");
}

/// `convert` to JSON Lines, then replaying the .jsonl gives exactly the replay of the pickle.
#[test]
fn convert_then_replay_matches_the_pickle() {
    let cases: &[(&str, &[&str])] = &[
        ("traces/frag__default__2048M.pickle.gz", &["--capacity", "2147483648"]),
        ("traces/unet512__default__0M.pickle.gz", &[]),
        ("traces/multistream__default__0M.pickle.gz", &["--config", "expandable_segments:True"]),
    ];
    for (rel, extra) in cases {
        let src = root(rel);
        let jsonl = TempFile::new(&format!("{}.jsonl", src.file_name().unwrap().to_str().unwrap()));
        let o = run(&["convert", src.to_str().unwrap(), "-o", jsonl.arg()]);
        assert_eq!(o.status.code(), Some(0), "{}", show(&["convert", rel], &o));
        assert!(String::from_utf8_lossy(&o.stderr).starts_with("wrote "), "{}", show(&["convert", rel], &o));
        let replay = |trace: &str| {
            let mut args = vec!["replay", trace];
            args.extend_from_slice(extra);
            args.push("--json");
            let mut v = json(&args);
            v.as_object_mut().unwrap().remove("trace");
            v
        };
        let a = replay(src.to_str().unwrap());
        let b = replay(jsonl.arg());
        assert_eq!(a["stats"], b["stats"], "{rel}: stats differ");
        assert_eq!(a, b, "{rel}: replay of the .jsonl differs from the pickle's");
        // validate reads the .jsonl as well as the pickle.
        let va = run(&["validate", src.to_str().unwrap(), "--json"]);
        let vb = run(&["validate", jsonl.arg(), "--json"]);
        assert_eq!(va.status.code(), vb.status.code(), "{rel}");
        assert_eq!(va.stdout, vb.stdout, "{rel}: validate differs");
    }
}

/// A text file, an empty file and a file of white space are named as what they are (issue 27:
/// "hello" used to be "BINGET: memo key 101 not found", an empty file "input ended before the STOP
/// opcode"), plain and gzip'd, by the streamed and the in-memory reading alike.
#[test]
fn text_and_empty_files_are_named_as_such() {
    let gz = |b: &[u8]| {
        use std::io::Write;
        let mut z = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        z.write_all(b).unwrap();
        z.finish().unwrap()
    };
    let cases: [(&str, Vec<u8>, &[&str]); 5] = [
        ("hello.txt", b"hello\n".to_vec(), &["the file is text (\"hello\")", "neither a snapshot pickle"]),
        ("hello.txt.gz", gz(b"hello\n"), &["the file is text (\"hello\")"]),
        ("notes.md", "# r\u{e9}sum\u{e9} of the run\n".as_bytes().to_vec(), &["the file is text (\"# r\u{e9}sum\u{e9} of the run\")"]),
        ("empty.pickle", Vec::new(), &["the file is empty", "_dump_snapshot"]),
        ("blank.json", b"  \n\t\n".to_vec(), &["the file holds only white space"]),
    ];
    for (name, bytes, needles) in cases {
        let f = TempFile::with(name, &bytes);
        for cmd in [&["replay", f.arg()][..], &["replay", f.arg(), "--in-memory"], &["validate", f.arg()], &["explain", f.arg()]] {
            let err = user_error(cmd, needles);
            assert!(!err.contains("memo key") && !err.contains("STOP opcode"), "{name}: {err}");
        }
    }
    // Bytes that are not text keep the decoder's error, which names the byte.
    let f = TempFile::with("zeros.bin", &[0xfc, 0x00, 0x01]);
    user_error(&["replay", f.arg()], &["pickle error at byte 0", "0xfc"]);
}
