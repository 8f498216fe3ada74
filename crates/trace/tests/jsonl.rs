//! allocsim's JSON Lines format: round trips and error reporting.

mod common;

use allocsim_trace::{Action, RecordedSettings, Snapshot, TraceEntry, TraceError, jsonl, read_trace_bytes};
use common::{fixture, real_trace};

fn round_trip(s: &Snapshot) -> (Snapshot, String) {
    let mut out = Vec::new();
    jsonl::write(s, &mut out).unwrap();
    let back = jsonl::read(&out).unwrap_or_else(|e| panic!("{e}"));
    (back, String::from_utf8(out).unwrap())
}

#[test]
fn round_trip_small_snapshot() {
    let s = allocsim_trace::snapshot::from_pickle(&fixture("snap/small_p4.pickle")).unwrap();
    let (back, text) = round_trip(&s);
    assert_eq!(back, s);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 1 + 11 + 2);
    assert!(lines[0].starts_with(r#"{"format":"allocsim-trace","version":1,"allocator_settings":{"PYTORCH_CUDA_ALLOC_CONF":"#));
    assert!(lines[0].contains(r#""roundup_power2_divisions":{"1":2,"2":0,"#) && lines[0].ends_with(r#","devices":2}"#));
    assert_eq!(
        lines[6],
        r#"{"device":0,"action":"oom","device_free":147460325376,"size":268435456,"stream":289523248,"time_us":1005,"frames":[{"name":"w_frag","filename":"gpu/record.py","line":56},{"name":"child","filename":"gpu/record.py","line":310},{"name":"<module>","filename":"gpu/record.py","line":407}]}"#
    );
    assert_eq!(lines[7], r#"{"device":0,"action":"segment_map","addr":140000000000000,"size":2097152,"stream":0,"time_us":1006}"#);
    assert!(lines[12].starts_with(r#"{"segment":{"device":0,"address":139919842344960,"total_size":20971520,"#));
    // read_trace_bytes detects the format by the leading '{'
    assert_eq!(read_trace_bytes(text.as_bytes()).unwrap(), s);
}

#[test]
fn round_trip_real_snapshot() {
    let Some(p) = real_trace("frag__default__2048M.pickle.gz") else {
        return;
    };
    let s = allocsim_trace::read_trace(&p).unwrap();
    assert_eq!(round_trip(&s).0, s);
}

#[test]
fn round_trip_edge_cases() {
    // no settings recorded, no stacks, an empty device, extreme values
    let e = |action, addr, size| TraceEntry { action, addr, size, stream: u64::MAX, time_us: i64::MIN, stack: 0, meta: 0 };
    let s = Snapshot {
        device_traces: vec![vec![], vec![e(Action::Alloc, u64::MAX, 0), e(Action::Oom, 0, u64::MAX), e(Action::Annotate, 0, 0)]],
        stacks: vec![vec![]],
        ..Default::default()
    };
    let (back, text) = round_trip(&s);
    assert_eq!(back, s);
    assert!(!text.lines().next().unwrap().contains("allocator_settings"));
    let s = Snapshot { settings: RecordedSettings { present: true, ..Default::default() }, stacks: vec![vec![]], ..Default::default() };
    assert_eq!(round_trip(&s).0, s);
}

#[test]
fn reads_the_documented_example() {
    let text = concat!(
        r#"{"format":"allocsim-trace","version":1,"devices":1,"allocator_settings":{"PYTORCH_CUDA_ALLOC_CONF":"","max_split_size":-1,"garbage_collection_threshold":0.0,"expandable_segments":false,"roundup_power2_divisions":{"1":0,"2":0,"4":0}}}"#,
        "\r\n\n",
        r#"{"device":0,"action":"alloc","addr":139919842344960,"size":6291456,"stream":0,"time_us":1796208315567807,"frames":[{"name":"w_frag","filename":"gpu/record.py","line":56}]}"#,
        "\n",
        r#"{"action":"oom","device_free":5,"size":7,"some_future_key":[1,2]}"#,
        "\n",
        r#"{"segment":{"device":0,"address":139916008751104,"total_size":20971520,"allocated_size":0,"active_size":0,"requested_size":0,"stream":0,"segment_type":"large","segment_pool_id":[0,0],"is_expandable":false,"blocks":[{"address":139916008751104,"size":20971520,"requested_size":6291456,"state":"inactive"}]}}"#,
        "\n",
    );
    let s = jsonl::read(text.as_bytes()).unwrap();
    assert_eq!(s.settings.roundup_power2_divisions, [(1, 0), (2, 0), (4, 0)]);
    assert_eq!(s.settings.max_split_size, Some(-1));
    assert_eq!(s.device_traces.len(), 1);
    let t = &s.device_traces[0];
    assert_eq!((t[0].action, t[0].addr, t[0].stack), (Action::Alloc, 139919842344960, 1));
    assert_eq!(s.stack(1)[0].name, "w_frag");
    assert_eq!((t[1].action, t[1].addr, t[1].size, t[1].stack), (Action::Oom, 5, 7, 0));
    assert_eq!(s.segments.len(), 1);
    assert_eq!(s.segments[0].blocks[0].requested_size, 6291456);
}

#[test]
fn annotations_and_entry_metadata() {
    let text = concat!(
        r#"{"format":"allocsim-trace","version":1,"devices":1}"#,
        "\n",
        r#"{"annotation":{"stage":"START","name":"Optimizer.step#AdamW.step","device":0,"time_us":10}}"#,
        "\n",
        r#"{"action":"alloc","addr":1,"size":2,"time_us":11,"compile_context":"Torch-Compiled Region: 0/0"}"#,
        "\n",
        r#"{"action":"alloc","addr":3,"size":2,"time_us":12,"user_metadata":"step 1"}"#,
        "\n",
        r#"{"action":"alloc","addr":5,"size":2,"time_us":13,"compile_context":"N/A","user_metadata":""}"#,
        "\n",
        r#"{"action":"alloc","addr":7,"size":2,"time_us":14,"compile_context":"Torch-Compiled Region: 0/0"}"#,
        "\n",
        r#"{"annotation":{"time_us":15,"name":"Optimizer.step#AdamW.step","stage":"END"}}"#,
        "\n",
    );
    let s = jsonl::read(text.as_bytes()).unwrap();
    let t = &s.device_traces[0];
    assert_eq!(t.iter().map(|e| e.meta).collect::<Vec<_>>(), [1, 2, 0, 1]);
    assert_eq!(s.compile_context(t[0].meta), "Torch-Compiled Region: 0/0");
    assert_eq!(s.user_metadata(t[0].meta), "");
    assert_eq!((s.compile_context(t[1].meta), s.user_metadata(t[1].meta)), ("N/A", "step 1"));
    assert_eq!((s.compile_context(t[2].meta), s.user_metadata(t[2].meta)), ("N/A", ""));
    assert_eq!(s.annotations.len(), 2);
    let (a, b) = (&s.annotations[0], &s.annotations[1]);
    assert_eq!((a.device, a.time_us, a.name(), a.is_start()), (0, 10, Some("Optimizer.step#AdamW.step"), Some(true)));
    assert_eq!((b.time_us, b.is_start()), (15, Some(false)));
    // key order is kept; equal strings share one allocation
    assert_eq!(&*b.fields[0].0, "name");
    assert!(std::sync::Arc::ptr_eq(&a.fields[1].1, &b.fields[0].1));
    // written back: defaults are left out, annotations come after the events
    let (back, out) = round_trip(&s);
    assert_eq!(back, s);
    let lines: Vec<&str> = out.lines().collect();
    assert!(!lines[3].contains("compile_context") && !lines[3].contains("user_metadata"), "{}", lines[3]);
    assert_eq!(lines[2], r#"{"device":0,"action":"alloc","addr":3,"size":2,"stream":0,"time_us":12,"user_metadata":"step 1"}"#);
    assert_eq!(lines[6], r#"{"annotation":{"name":"Optimizer.step#AdamW.step","stage":"END","device":0,"time_us":15}}"#);
}

fn jsonl_err(text: &str) -> (usize, String) {
    match jsonl::read(text.as_bytes()) {
        Err(TraceError::Jsonl { line, msg }) => (line, msg),
        other => panic!("expected a JSONL error for {text:?}, got {other:?}"),
    }
}

#[test]
fn errors_carry_line_numbers() {
    let h = r#"{"format":"allocsim-trace","version":1,"devices":1}"#;
    let cases = [
        (String::new(), 1, "no header"),
        (r#"{"device":0,"action":"alloc","addr":1,"size":2}"#.to_string(), 1, "header"),
        (r#"{"format":"allocsim-trace","version":2}"#.to_string(), 1, "unsupported version"),
        (r#"{"format":"other","version":1}"#.to_string(), 1, "format"),
        (format!("{h}\n{{\"action\":\"alloc\",\"addr\":1,\"size\":2}}\n{{oops"), 3, ""),
        (format!("{h}\n\n{{\"action\":\"frob\",\"addr\":1,\"size\":2}}"), 3, "unknown action \"frob\""),
        (format!("{h}\n{{\"device\":1,\"action\":\"alloc\",\"addr\":1,\"size\":2}}"), 2, "declares 1 device"),
        (format!("{h}\n{{\"action\":\"oom\",\"size\":2}}"), 2, "device_free"),
        (format!("{h}\n{{\"action\":\"alloc\",\"size\":2}}"), 2, "addr"),
        (format!("{h}\n{{\"action\":\"alloc\",\"addr\":-1,\"size\":2}}"), 2, ""),
        (format!("{h}\n{{\"foo\":1}}"), 2, "neither an event"),
        (format!("{h}\n{{\"annotation\":{{\"name\":3}}}}"), 2, "annotation field \"name\""),
        (format!("{h}\n{{\"annotation\":{{\"time_us\":\"x\"}}}}"), 2, ""),
        (format!("{h}\n{{\"action\":\"alloc\",\"addr\":1,\"size\":2,\"user_metadata\":7}}"), 2, ""),
        (format!("{h}\n{h}"), 2, "second header"),
        (format!("{h}\n{{\"segment\":{{\"address\":1,\"total_size\":2,\"segment_type\":\"huge\"}}}}"), 2, "segment_type"),
        (format!("{h}\n{{\"segment\":{{\"address\":1,\"total_size\":2,\"blocks\":[{{\"address\":1,\"size\":2,\"state\":\"x\"}}]}}}}"), 2, "unknown state"),
    ];
    for (text, line, want) in cases {
        let (l, m) = jsonl_err(&text);
        assert!(l == line && m.contains(want), "{text:?}: got line {l}: {m}; wanted line {line} with {want:?}");
    }
}

/// A header written with its keys in another order (`allocator_settings` first, a snapshot's key)
/// is still allocsim's JSON Lines, for the whole-file reader and the streaming one; a snapshot
/// saved as JSON stays one.
#[test]
fn a_header_with_its_keys_reordered_is_still_json_lines() {
    let text = concat!(
        r#"{"allocator_settings":{"PYTORCH_CUDA_ALLOC_CONF":"","max_split_size":-1,"garbage_collection_threshold":0.0,"expandable_segments":false,"roundup_power2_divisions":{}}, "devices":1, "format" : "allocsim-trace","version":1}"#,
        "\n",
        r#"{"device":0,"action":"alloc","addr":4096,"size":512,"stream":0,"time_us":1}"#,
        "\n",
    );
    assert!(!allocsim_trace::is_json_snapshot(text.as_bytes()));
    let s = read_trace_bytes(text.as_bytes()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(s.device_traces[0].len(), 1);
    assert_eq!(s.device_traces[0][0].size, 512);
    let path = std::env::temp_dir().join(format!("allocsim-reordered-{}.jsonl", std::process::id()));
    std::fs::write(&path, text).unwrap();
    let streamed = allocsim_trace::jsonl_stream::JsonlFile::open(&path);
    std::fs::remove_file(&path).ok();
    assert!(streamed.unwrap().is_some(), "the streaming reader takes it as JSON Lines");
    // A snapshot saved as JSON whose strings mention the format is still a snapshot.
    let snapshot = r#"{"segments":[],"device_traces":[[]],"allocator_settings":{},"note":"format: allocsim-trace"}"#;
    assert!(allocsim_trace::is_json_snapshot(snapshot.as_bytes()));
}
