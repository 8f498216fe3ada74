//! Writing snapshots: `snapshot::to_pickle` round-trips every real trace and the fixtures, JSON
//! Lines sits in between losslessly, `write_trace` picks formats by name, and (where `python3` is
//! available) CPython loads what we wrote into the same objects torch's own pickle holds, in a
//! shape that torch's memory_viz tooling accepts.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use allocsim_trace::snapshot::{from_pickle, to_pickle};
use allocsim_trace::{
    Action, Annotation, BlockState, EntryMeta, Frame, OutputFormat, RecordedSettings, Snapshot, SnapshotBlock, SnapshotSegment, TraceEntry, jsonl, read_trace,
    read_trace_bytes, write_trace,
};
use common::fixture;

/// Every snapshot pickle under `traces/` and `../shared/traces/` (absent folders are skipped).
fn real_traces() -> Vec<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut out = Vec::new();
    let shared = common::reference::shared(&root, "traces");
    for dir in [Some(root.join("traces")), shared].into_iter().flatten() {
        let Ok(rd) = std::fs::read_dir(&dir) else {
            panic!("{} cannot be read", dir.display());
        };
        let mut files: Vec<PathBuf> = rd
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                let n = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
                n.ends_with(".pickle") || n.ends_with(".pickle.gz")
            })
            .collect();
        files.sort();
        out.extend(files);
    }
    out
}

fn raw_pickle(path: &Path) -> Vec<u8> {
    use std::io::Read;
    let b = std::fs::read(path).unwrap();
    if b.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        flate2::read::MultiGzDecoder::new(&b[..]).read_to_end(&mut out).unwrap();
        out
    } else {
        b
    }
}

fn jsonl_roundtrip(s: &Snapshot) -> Snapshot {
    let mut buf = Vec::new();
    jsonl::write(s, &mut buf).unwrap();
    jsonl::read(&buf).unwrap()
}

fn fr(name: &str, filename: &str, line: i64) -> Frame {
    Frame { name: name.into(), filename: filename.into(), line }
}

/// A snapshot exercising every field: two devices, oom, big values, shared and unshared stacks.
fn synthetic() -> Snapshot {
    let e = |action, addr, size, stream, time_us, stack| TraceEntry { action, addr, size, stream, time_us, stack, meta: 0 };
    let with_meta = |meta, e: TraceEntry| TraceEntry { meta, ..e };
    let s = |x: &str| -> std::sync::Arc<str> { x.into() };
    let ann = |stage: &str, name: &str, device, time_us| Annotation { device, time_us, fields: vec![(s("stage"), s(stage)), (s("name"), s(name))] };
    Snapshot {
        segments: vec![
            SnapshotSegment {
                device: 0,
                address: 0x7f00_0000_0000,
                total_size: 20 << 20,
                allocated_size: 6 << 20,
                active_size: 6 << 20,
                requested_size: 6_000_000,
                stream: u64::MAX,
                is_small: false,
                pool_id: (0, 0),
                is_expandable: false,
                blocks: vec![
                    SnapshotBlock { address: 0x7f00_0000_0000, size: 6 << 20, requested_size: 6_000_000, state: BlockState::ActiveAllocated, stack: 1 },
                    SnapshotBlock { address: 0x7f00_0060_0000, size: 14 << 20, requested_size: 0, state: BlockState::Inactive, stack: 0 },
                ],
            },
            SnapshotSegment {
                device: 1,
                address: u64::MAX - (2 << 20) + 1,
                total_size: 2 << 20,
                allocated_size: 512,
                active_size: 1024,
                requested_size: 1000,
                stream: 0x5555_0000_1234,
                is_small: true,
                pool_id: (1, -7),
                is_expandable: true,
                blocks: vec![
                    SnapshotBlock { address: u64::MAX - (2 << 20) + 1, size: 512, requested_size: 500, state: BlockState::ActivePendingFree, stack: 2 },
                    SnapshotBlock { address: u64::MAX - (2 << 20) + 513, size: (2 << 20) - 512, requested_size: 7, state: BlockState::Inactive, stack: 0 },
                ],
            },
        ],
        device_traces: vec![
            vec![
                e(Action::SegmentAlloc, 0x7f00_0000_0000, 20 << 20, u64::MAX, 1_700_000_000_000_000, 1),
                with_meta(1, e(Action::Alloc, 0x7f00_0000_0000, 6_000_000, u64::MAX, 1_700_000_000_000_001, 1)),
                e(Action::Oom, 147_460_325_376, 1 << 40, 0, 1_700_000_000_000_002, 2),
                e(Action::Snapshot, 0, 6 << 20, 0, -5, 0),
            ],
            vec![],
            vec![
                e(Action::SegmentMap, 1 << 60, 2 << 20, 7, 3, 0),
                with_meta(2, e(Action::FreeRequested, 1 << 60, 500, 7, 4, 2)),
                with_meta(3, e(Action::FreeCompleted, 1 << 60, 500, 7, 5, 2)),
                e(Action::SegmentUnmap, 1 << 60, 2 << 20, 7, 6, 0),
                e(Action::SegmentFree, 1 << 60, 2 << 20, 7, 7, 1),
                e(Action::Annotate, 0, 0, 0, 8, 0),
            ],
        ],
        settings: RecordedSettings {
            alloc_conf: Some("expandable_segments:True,roundup_power2_divisions:[256:8,>:2]".into()),
            max_split_size: Some(-1),
            garbage_collection_threshold: Some(0.6),
            expandable_segments: Some(true),
            roundup_power2_divisions: vec![(1, 0), (256, 8), (32768, 2)],
            present: true,
            keys: None,
        },
        stacks: vec![
            vec![],
            vec![fr("w_frag", "gpu/record.py", 56), fr("<module>", "gpu/record.py", 407)],
            vec![fr("名前", "/very/long/".repeat(40).as_str(), -1), fr("w_frag", "gpu/record.py", 56), fr("w_frag", "gpu/record.py", 56)],
        ],
        annotations: vec![
            ann("START", "Optimizer.step#AdamW.step", 0, 1_700_000_000_000_000),
            ann("END", "Optimizer.step#AdamW.step", 0, 1_700_000_000_000_002),
            ann("START", "forward", 2, -1),
            Annotation { device: 2, time_us: 9, fields: vec![(s("name"), s("é")), (s(""), s("x"))] },
            Annotation { device: 0, time_us: 0, fields: vec![] },
        ],
        entry_metas: vec![
            EntryMeta { compile_context: "Torch-Compiled Region: 0/0".into(), user_metadata: String::new() },
            EntryMeta { compile_context: "N/A".into(), user_metadata: "step 3".into() },
            EntryMeta { compile_context: "".into(), user_metadata: "ü".into() },
        ],
        segments_only: false,
    }
}

#[test]
fn synthetic_roundtrips() {
    let s = synthetic();
    assert_eq!(from_pickle(&to_pickle(&s)).unwrap(), s);
    assert_eq!(jsonl_roundtrip(&s), s);

    // settings absent (pre-2.1 shape) or partly absent stay so
    let mut t = s.clone();
    t.settings = RecordedSettings::default();
    assert_eq!(from_pickle(&to_pickle(&t)).unwrap(), t);
    t.settings = RecordedSettings { present: true, max_split_size: Some(128 << 20), ..Default::default() };
    assert_eq!(from_pickle(&to_pickle(&t)).unwrap(), t);

    // empty snapshot
    let e = Snapshot { stacks: vec![vec![]], ..Default::default() };
    assert_eq!(from_pickle(&to_pickle(&e)).unwrap(), e);
}

#[test]
fn layout_matches_torch_2_11() {
    use allocsim_trace::pickle::decode;
    let b = to_pickle(&synthetic());
    let d = decode(&b).unwrap();
    let keys = |v| -> Vec<String> { d.dict(v).unwrap().iter().map(|&(k, _)| d.str(k).unwrap().to_owned()).collect() };
    let root = d.root();
    assert_eq!(keys(root), ["segments", "device_traces", "allocator_settings", "external_annotations"]);
    let seg = d.items(d.dict_get(root, "segments").unwrap()).unwrap()[0];
    assert_eq!(
        keys(seg),
        [
            "device",
            "address",
            "total_size",
            "allocated_size",
            "active_size",
            "requested_size",
            "stream",
            "segment_type",
            "segment_pool_id",
            "is_expandable",
            "frames",
            "blocks"
        ]
    );
    assert!(matches!(d.dict_get(seg, "segment_pool_id"), Some(allocsim_trace::pickle::Value::Tuple(_))));
    // torch writes int64_t(stream): u64::MAX is -1
    assert_eq!(d.dict_get(seg, "stream"), Some(allocsim_trace::pickle::Value::Int(-1)));
    let blk = d.items(d.dict_get(seg, "blocks").unwrap()).unwrap()[1];
    assert_eq!(keys(blk), ["address", "size", "requested_size", "state", "frames"]);
    let traces = d.items(d.dict_get(root, "device_traces").unwrap()).unwrap();
    assert_eq!(traces.len(), 3);
    let t0 = d.items(traces[0]).unwrap();
    let with_frames = ["action", "addr", "size", "stream", "time_us", "compile_context", "user_metadata", "frames"];
    assert_eq!(keys(t0[0]), with_frames);
    assert_eq!(keys(t0[2])[1], "device_free");
    assert_eq!(keys(t0[3]), with_frames[..7]); // no stack: no 'frames'
    assert_eq!(d.str(d.dict_get(t0[0], "compile_context").unwrap()), Some("N/A"));
    assert_eq!(d.str(d.dict_get(t0[0], "user_metadata").unwrap()), Some(""));
    assert_eq!(d.str(d.dict_get(t0[1], "compile_context").unwrap()), Some("Torch-Compiled Region: 0/0"));
    let t2 = d.items(traces[2]).unwrap();
    assert_eq!(d.str(d.dict_get(t2[1], "user_metadata").unwrap()), Some("step 3"));
    assert_eq!(d.str(d.dict_get(t2[2], "compile_context").unwrap()), Some(""));
    assert_eq!(d.str(d.dict_get(t2[2], "user_metadata").unwrap()), Some("ü"));
    // torch 2.11: {stage, name, device, time_us}
    let anns = d.items(d.dict_get(root, "external_annotations").unwrap()).unwrap();
    assert_eq!(anns.len(), 5);
    assert_eq!(keys(anns[0]), ["stage", "name", "device", "time_us"]);
    assert_eq!(d.str(d.dict_get(anns[1], "stage").unwrap()), Some("END"));
    assert_eq!(d.dict_get(anns[2], "device"), Some(allocsim_trace::pickle::Value::Int(2)));
    assert_eq!(keys(anns[3]), ["name", "", "device", "time_us"]);
    // one list object per stack, shared by blocks and entries
    assert_eq!(d.dict_get(t0[0], "frames"), d.dict_get(t0[1], "frames"));
    let b0 = d.items(d.dict_get(seg, "blocks").unwrap()).unwrap()[0];
    assert_eq!(d.dict_get(t0[0], "frames"), d.dict_get(b0, "frames"));
    let settings = d.dict_get(root, "allocator_settings").unwrap();
    assert_eq!(
        keys(settings),
        [
            "PYTORCH_CUDA_ALLOC_CONF",
            "max_split_size",
            "garbage_collection_threshold",
            "expandable_segments",
            "pinned_num_register_threads",
            "release_lock_on_cudamalloc",
            "pinned_use_cuda_host_register",
            "graph_capture_record_stream_reuse",
            "roundup_power2_divisions"
        ]
    );
    assert_eq!(keys(d.dict_get(settings, "roundup_power2_divisions").unwrap()), ["1", "256", "32768"]);
}

#[test]
fn fixtures_roundtrip() {
    for p in [2, 4, 5] {
        let s = from_pickle(&fixture(&format!("snap/small_p{p}.pickle"))).unwrap();
        assert_eq!(from_pickle(&to_pickle(&s)).unwrap(), s, "small_p{p}");
        assert_eq!(from_pickle(&to_pickle(&jsonl_roundtrip(&s))).unwrap(), s, "small_p{p} via jsonl");
    }
}

/// pickle → Snapshot → pickle → Snapshot is the identity, and so is pickle → JSON Lines → pickle,
/// for every real trace. Also reports where our bytes equal torch's own file byte for byte.
#[test]
fn real_traces_roundtrip() {
    let traces = real_traces();
    let check = |path: &PathBuf| -> bool {
        let name = path.file_name().unwrap().to_string_lossy();
        let raw = raw_pickle(path);
        let s = from_pickle(&raw).unwrap_or_else(|e| panic!("{name}: {e}"));
        let ours = to_pickle(&s);
        let back = from_pickle(&ours).unwrap_or_else(|e| panic!("{name}: ours does not decode: {e}"));
        assert!(back == s, "{name}: pickle round trip differs");
        let via_jsonl = jsonl_roundtrip(&s);
        assert!(via_jsonl == s, "{name}: JSON Lines round trip differs");
        assert!(to_pickle(&via_jsonl) == ours, "{name}: pickle via JSON Lines differs in bytes");
        // Without stacks nothing is left to choose: the bytes must be torch's exactly. (With
        // stacks, torch makes one frames list per captured traceback, where we make one per
        // distinct stack, and keeps segment-level stacks, which a Snapshot drops.)
        assert!(ours == raw || s.stacks.len() > 1, "{name}: has no stacks but is not written byte for byte");
        ours == raw
    };
    // round-robin over the cores (the traces are sorted by name, so big ones sit together)
    let n = std::thread::available_parallelism().map_or(1, |n| n.get()).min(8);
    let identical: usize = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..n)
            .map(|k| {
                let traces = &traces;
                sc.spawn(move || traces.iter().skip(k).step_by(n).filter(|p| check(p)).count())
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).sum()
    });
    eprintln!("{} real traces round-trip; {identical} written byte-identical to torch's file", traces.len());
}

/// The files `allocsim convert` writes: pickle.gz → .jsonl → .pickle.gz → .pickle, each read back
/// with `read_trace`, all equal to the original snapshot.
#[test]
fn convert_chain_through_files() {
    let Some(src) = real_traces().into_iter().find(|p| p.to_string_lossy().contains("multistream__default")) else {
        return;
    };
    let dir = scratch_dir("chain");
    let orig = read_trace(&src).unwrap();
    let mut prev = orig.clone();
    for name in ["t.jsonl", "t.pickle.gz", "t.jsonl.gz", "t.pickle"] {
        let path = dir.join(name);
        write_trace(&prev, &path).unwrap();
        prev = read_trace(&path).unwrap();
        assert!(prev == orig, "{name}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn write_trace_picks_format_by_name() {
    let dir = scratch_dir("write");
    let s = synthetic();
    for (name, want, gz) in [
        ("a.jsonl", OutputFormat::Jsonl, false),
        ("a.jsonl.gz", OutputFormat::Jsonl, true),
        ("a.pickle", OutputFormat::Pickle, false),
        ("a.pickle.gz", OutputFormat::Pickle, true),
        ("A.PKL.GZ", OutputFormat::Pickle, true),
    ] {
        let path = dir.join(name);
        assert_eq!(write_trace(&s, &path).unwrap(), (want, gz), "{name}");
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(bytes.starts_with(&[0x1f, 0x8b]), gz, "{name}");
        if want == OutputFormat::Pickle && !gz {
            assert_eq!(bytes, to_pickle(&s));
        }
        assert_eq!(read_trace(&path).unwrap(), s, "{name}");
        assert_eq!(read_trace_bytes(&bytes).unwrap(), s, "{name}");
    }
    for bad in ["a.json", "a.gz", "a", "a.pickle.bz2"] {
        let err = write_trace(&s, &dir.join(bad)).unwrap_err().to_string();
        assert!(err.contains("unknown output format"), "{bad}: {err}");
        assert!(!dir.join(bad).exists());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------------------------------------
// CPython

fn scratch_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("allocsim-trace-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn python3() -> bool {
    let ok = Command::new("python3").args(["-c", "import pickle"]).output().is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("note: python3 not found; skipping the CPython checks");
    }
    ok
}

/// Checks one pickle we wrote (argv[1]) against the original torch pickle (argv[2], may be gzip'd):
/// CPython loads it; per device and action the counts and byte totals are equal; the segments
/// and traces are equal as Python objects; CPython re-pickles it to the same bytes; only opcodes
/// MemoryViz.js's unpickler knows are used; and the keys torch's memory_viz tooling reads are
/// there.
const CHECK_PY: &str = r#"
import collections, gzip, pickle, pickletools, sys

ours_bytes = open(sys.argv[1], 'rb').read()
ours = pickle.load(open(sys.argv[1], 'rb'))
f = open(sys.argv[2], 'rb')
orig = pickle.load(gzip.open(sys.argv[2]) if f.read(2) == b'\x1f\x8b' else open(sys.argv[2], 'rb'))

def tally(snap):
    t = collections.Counter()
    for dev, trace in enumerate(snap['device_traces']):
        for e in trace:
            t[(dev, e['action'], 'n')] += 1
            t[(dev, e['action'], 'size')] += e['size']
    return t

assert tally(ours) == tally(orig), 'per-action counts/sizes differ'
assert len(ours['segments']) == len(orig['segments'])
assert sum(s['total_size'] for s in ours['segments']) == sum(s['total_size'] for s in orig['segments'])

# Entries that carried an empty 'frames' list are written without one (no stack either way).
def norm(e):
    return {k: v for k, v in e.items() if not (k == 'frames' and v == [])}
for dev, (a, b) in enumerate(zip(ours['device_traces'], orig['device_traces'])):
    assert len(a) == len(b), dev
    for i, (x, y) in enumerate(zip(a, b)):
        assert norm(x) == norm(y), (dev, i, x, y)
# A Snapshot keeps no segment-level stacks: segment 'frames' are written as [].
def seg_norm(segs):
    return [{k: v for k, v in s.items() if k != 'frames'} for s in segs]
assert seg_norm(ours['segments']) == seg_norm(orig['segments']), 'segments differ'
assert all(s['frames'] == [] for s in ours['segments'])
assert ours['external_annotations'] == orig.get('external_annotations', []), 'annotations differ'
rec = {k: v for k, v in orig.get('allocator_settings', {}).items()}
assert all(ours['allocator_settings'].get(k) == v for k, v in rec.items()), 'settings differ'

# Canonical: CPython's own pickler writes exactly these bytes for the loaded objects.
assert pickle.dumps(ours, protocol=4) == ours_bytes, 'CPython re-pickles differently'

# MemoryViz.js (torch/utils/viz/MemoryViz.js) has its own unpickler: only these opcodes.
viz_ops = {'PROTO', 'FRAME', 'STOP', 'MARK', 'NONE', 'NEWTRUE', 'NEWFALSE', 'BININT', 'BININT1',
           'BININT2', 'LONG1', 'BINFLOAT', 'SHORT_BINUNICODE', 'BINUNICODE', 'EMPTY_DICT', 'DICT',
           'SETITEM', 'SETITEMS', 'EMPTY_LIST', 'LIST', 'APPEND', 'APPENDS', 'EMPTY_TUPLE',
           'TUPLE', 'TUPLE1', 'TUPLE2', 'TUPLE3', 'MEMOIZE', 'BINPUT', 'LONG_BINPUT', 'BINGET',
           'LONG_BINGET'}
used = {op.name for op, _, _ in pickletools.genops(ours_bytes)}
assert used <= viz_ops, used - viz_ops
proto = next(pickletools.genops(ours_bytes))
assert proto[0].name == 'PROTO' and 2 <= proto[1] <= 4

# Keys read by torch/cuda/_memory_viz.py (segments/memory/compare via _write_blocks and
# _block_extra, segsum, trace) and by MemoryViz.js (annotate_snapshot, process_alloc_data,
# MemoryView, format_frames, snapshot_change).
def frames_ok(fr):
    assert isinstance(fr, list)
    for x in fr:
        assert isinstance(x['name'], str) and isinstance(x['filename'], str) and isinstance(x['line'], int)
assert isinstance(ours['segments'], list) and isinstance(ours['device_traces'], list)
for seg in ours['segments']:
    for k in ('device', 'address', 'total_size', 'allocated_size', 'stream'):
        assert isinstance(seg[k], int), k
    frames_ok(seg['frames'])
    off = seg['address']
    for b in seg['blocks']:
        assert 'history' not in b
        assert b['state'] in ('active_allocated', 'active_pending_free', 'inactive')
        assert isinstance(b['size'], int) and isinstance(b['requested_size'], int)
        assert b['address'] == off  # MemoryViz.js recomputes it as this running sum
        off += b['size']
        frames_ok(b['frames'])
    assert off == seg['address'] + seg['total_size']
for trace in ours['device_traces']:
    for e in trace:
        assert isinstance(e['action'], str) and isinstance(e['size'], int) and isinstance(e['stream'], int)
        assert isinstance(e['device_free' if e['action'] == 'oom' else 'addr'], int)
        frames_ok(e.get('frames', []))
print('ok')
"#;

#[test]
fn cpython_loads_real_traces_like_torchs_own() {
    if !python3() {
        return;
    }
    let dir = scratch_dir("py");
    let script = dir.join("check.py");
    std::fs::write(&script, CHECK_PY).unwrap();
    let mut n = 0;
    for path in real_traces() {
        // keep the test quick (pickletools is slow): the traces under 2.5 MB cover every action,
        // both segment kinds, streams, graphs' private pools and expandable segments
        if raw_pickle(&path).len() > 2_500_000 {
            continue;
        }
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let s = read_trace(&path).unwrap();
        let out = dir.join(name.replace(".gz", ""));
        std::fs::write(&out, to_pickle(&s)).unwrap();
        let r = Command::new("python3").arg(&script).arg(&out).arg(&path).output().unwrap();
        assert!(
            r.status.success() && String::from_utf8_lossy(&r.stdout).contains("ok"),
            "{name}: {}{}",
            String::from_utf8_lossy(&r.stdout),
            String::from_utf8_lossy(&r.stderr)
        );
        n += 1;
    }
    eprintln!("{n} written snapshots checked by CPython");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The brief's one-liner: `pickle.load` accepts a written `.pickle`.
#[test]
fn cpython_pickle_load_accepts_written_file() {
    if !python3() {
        return;
    }
    let dir = scratch_dir("load");
    let path = dir.join("synthetic.pickle");
    write_trace(&synthetic(), &path).unwrap();
    let r = Command::new("python3")
        .args(["-c", "import pickle,sys; d = pickle.load(open(sys.argv[1],'rb')); print(len(d['device_traces'][0]), d['segments'][1]['stream'], d['device_traces'][0][2]['device_free'])"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    assert_eq!(String::from_utf8_lossy(&r.stdout).trim(), "4 93823560585780 147460325376");
    let _ = std::fs::remove_dir_all(&dir);
}
