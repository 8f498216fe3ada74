//! The fuzz targets' bodies (`fuzz/src/lib.rs`: `decode` and `decode_replay`) over every kept
//! crasher (`tests/fixtures/fuzz`), every seed (`fuzz/seeds`), the hostile fixtures
//! (`tests/fixtures/hostile`) and device-index and size extremes made here. Each input must have
//! one of the outcomes the docs give, checked both in the library (the target bodies) and on the
//! command line (`replay`, `validate`): an answer (exit 0, 1 or 3, with its text), or a clean
//! error (exit 2, one `allocsim: error:` line naming the byte offset, line, entry or segment).
//! The fuzz crate is a workspace of its own (it needs nightly for `cargo fuzz`), so the bodies are
//! repeated here; keep the two in step.

mod common;
use common::*;

use std::path::Path;

const MAX_ENTRIES: usize = 4096;

/// What the library made of an input.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    /// Not decoded: the decoder's error.
    Undecodable(String),
    /// Decoded; per device replayed (at most 4): `Ok(exact)` or the replay's error.
    Replayed(Vec<Result<bool, String>>),
}

/// `decode`: a decoded snapshot must also write back as JSON Lines.
fn decode(name: &str, data: &[u8]) -> Result<allocsim_trace::Snapshot, String> {
    match allocsim_trace::read_trace_bytes(data) {
        Ok(snap) => {
            let mut out = Vec::new();
            allocsim_trace::jsonl::write(&snap, &mut out).unwrap_or_else(|e| panic!("{name}: decoded but does not write back: {e}"));
            Ok(snap)
        }
        Err(e) => Err(e.to_string()),
    }
}

/// `decode_replay`, with each answer checked for consistency: counts never above what they
/// count, and "exact" only with every count full and nothing found.
fn decode_replay(name: &str, data: &[u8]) -> Outcome {
    let mut snap = match decode(name, data) {
        Ok(s) => s,
        Err(e) => {
            // (It may quote the file's own strings, newlines and all; the command line escapes
            // them, `cli_outcome` checks that.)
            assert!(!e.is_empty(), "{name}: an empty error");
            return Outcome::Undecodable(e);
        }
    };
    for t in &mut snap.device_traces {
        t.truncate(MAX_ENTRIES);
    }
    let mut out = Vec::new();
    for device in 0..snap.device_traces.len().min(4) {
        let spec = allocsim_replay::ReplaySpec { device: Some(device), ..Default::default() };
        match allocsim_replay::run(&snap, &spec) {
            Ok(r) => {
                let v = allocsim_replay::validate(&r);
                for (what, a) in
                    [("segment events", &v.segment_events), ("OOMs", &v.ooms), ("alloc addresses", &v.alloc_addresses), ("final segments", &v.final_segments)]
                {
                    assert!(a.matched <= a.recorded, "{name} device {device}: {what} {}/{} reproduced", a.matched, a.recorded);
                    if a.first_divergence.is_none() {
                        assert!(a.matched == a.recorded && a.recorded == a.simulated, "{name} device {device}: {what} without a divergence: {a:?}");
                    }
                }
                if v.exact {
                    assert!(v.findings.is_empty() && v.settings_changed.is_empty(), "{name} device {device}: exact with findings {v:?}");
                }
                out.push(Ok(v.exact));
            }
            Err(e) => {
                let e = e.to_string();
                assert!(
                    ["trace entry", "final segment", "device", "PYTORCH_CUDA_ALLOC_CONF"].iter().any(|w| e.contains(w)),
                    "{name} device {device}: the replay's error names no entry: {e}"
                );
                out.push(Err(e));
            }
        }
    }
    Outcome::Replayed(out)
}

/// Where a command-line error may say the input went wrong.
const LOCATIONS: &[&str] = &[
    "byte ",
    "line ",
    "trace entry ",
    "final segment",
    "device_traces[",
    "segments[",
    "top-level",
    "PyTorch < 2.1",
    "gzip",
    "PYTORCH_CUDA_ALLOC_CONF",
    "has no device",
];

/// `allocsim replay` and `validate` on `path`: an answer, or one error line naming where.
fn cli_outcome(name: &str, path: &str) {
    for cmd in ["replay", "validate"] {
        let args = [cmd, path];
        let o = run(&args);
        let ctx = show(&args, &o);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!err.contains("panicked") && !err.contains("memory allocation"), "{name}: {ctx}");
        match o.status.code() {
            Some(0 | 1) => assert!(!o.stdout.is_empty() && !err.contains("allocsim: error"), "{name}: an answer without text: {ctx}"),
            Some(3) => {
                assert_eq!(cmd, "validate", "{ctx}");
                assert!(String::from_utf8_lossy(&o.stdout).contains("nothing to validate"), "{ctx}");
            }
            Some(2) => {
                let line = err.strip_suffix('\n').unwrap_or_else(|| panic!("{name}: {ctx}"));
                assert!(!line.contains('\n') && line.starts_with("allocsim: error: "), "{name}: not one error line: {ctx}");
                assert!(LOCATIONS.iter().any(|l| line.contains(l)), "{name}: the error names no offset, line, entry or segment: {ctx}");
            }
            _ => panic!("{name}: unexpected exit status: {ctx}"),
        }
    }
}

fn inputs() -> Vec<(String, Vec<u8>)> {
    let mut v = Vec::new();
    for dir in ["tests/fixtures/fuzz", "fuzz/seeds", "tests/fixtures/hostile"] {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
        let Ok(rd) = std::fs::read_dir(&dir) else { continue };
        for e in rd.flatten() {
            let p = e.path();
            if p.is_file() && p.extension().is_none_or(|x| x != "md") {
                v.push((p.display().to_string(), std::fs::read(&p).unwrap()));
            }
        }
    }
    v.sort();
    v
}

#[test]
fn kept_inputs_have_a_documented_outcome() {
    let inputs = inputs();
    assert!(inputs.len() >= 55, "expected the fuzz seeds, crashers and hostile fixtures, found {}", inputs.len());
    let (mut answered, mut refused) = (0, 0);
    for (name, data) in &inputs {
        let t = std::time::Instant::now();
        match std::panic::catch_unwind(|| decode_replay(name, data)) {
            Ok(Outcome::Undecodable(_)) => refused += 1,
            Ok(Outcome::Replayed(_)) => answered += 1,
            Err(_) => panic!("{name} panics"),
        }
        cli_outcome(name, name);
        assert!(t.elapsed().as_secs() < 30, "{name} took {:?}", t.elapsed());
    }
    // Both kinds occur: the seeds include real traces and refused pickles.
    assert!(answered >= 10 && refused >= 10, "{answered} answered, {refused} refused");
    // Specific inputs, specific outcomes.
    let by_name = |n: &str| inputs.iter().find(|(p, _)| p.ends_with(n)).map(|(p, d)| decode_replay(p, d)).unwrap();
    assert_eq!(by_name("hostile/base.pickle"), Outcome::Replayed(vec![Ok(true)]));
    assert_eq!(by_name("hostile/dup_free_completed.pickle"), Outcome::Replayed(vec![Ok(false)]));
    match by_name("hostile/device_2p32.pickle") {
        Outcome::Replayed(v) => assert!(matches!(&v[..], [Err(e)] if e.contains("device 4294967296 is not a device index")), "{v:?}"),
        o => panic!("{o:?}"),
    }
    match by_name("fuzz/frame_longer_than_file.pickle") {
        Outcome::Undecodable(e) => assert!(e.contains("byte 2"), "{e}"),
        o => panic!("{o:?}"),
    }
}

/// A JSON Lines trace of one segment and one allocation in it on `device`, of `size` bytes.
fn jsonl(device: u64, segment_size: u64, size: u64) -> String {
    let a = 0x7f00_0000_0000u64;
    format!(
        "{{\"format\":\"allocsim-trace\",\"version\":1}}\n\
         {{\"device\":{device},\"action\":\"segment_alloc\",\"addr\":{a},\"size\":{segment_size}}}\n\
         {{\"device\":{device},\"action\":\"alloc\",\"addr\":{a},\"size\":{size}}}\n"
    )
}

#[test]
fn device_index_and_size_extremes() {
    let two_mib = 2u64 << 20;
    let cases: Vec<(&str, String, Result<(), &str>)> = vec![
        // The highest device index allowed replays (on its own allocator).
        ("device 65535", jsonl(65535, two_mib, 512), Ok(())),
        ("device 65536", jsonl(65536, two_mib, 512), Err("implausible device 65536")),
        ("device 2^32", jsonl(1 << 32, two_mib, 512), Err("implausible device 4294967296")),
        ("device 2^63", jsonl(1 << 63, two_mib, 512), Err("line 2")),
        ("a block of no bytes", jsonl(0, two_mib, 0), Ok(())),
        ("a request of 2^63 - 1 bytes", jsonl(0, two_mib, (1 << 63) - 1), Err("trace entry 1 (alloc)")),
        ("a request of 2^63 bytes", jsonl(0, two_mib, 1 << 63), Err("is not a possible request")),
        ("a request of 2^64 - 1 bytes", jsonl(0, two_mib, u64::MAX), Err("is not a possible request")),
        ("a segment of 2^60 bytes", jsonl(0, 1 << 60, 512), Err("lies beyond any GPU address space")),
        ("a segment of 2^61 bytes", jsonl(0, 1 << 61, 512), Err("segment size 2305843009213693952 bytes is beyond any device")),
    ];
    for (what, text, expected) in cases {
        let f = TempFile::new(&format!("extreme-{}.jsonl", what.replace(' ', "_").replace('^', "")));
        std::fs::write(&f.0, &text).unwrap();
        cli_outcome(what, f.arg());
        for cmd in ["replay", "validate", "explain"] {
            match expected {
                Ok(()) => {
                    let o = run(&[cmd, f.arg()]);
                    assert!(matches!(o.status.code(), Some(0 | 1)), "{what}: {}", show(&[cmd, f.arg()], &o));
                }
                Err(needle) => {
                    user_error(&[cmd, f.arg()], &[needle]);
                }
            }
        }
    }
}

mod extremes {
    use allocsim_trace::{BlockState, Snapshot, SnapshotBlock, SnapshotSegment};
    use proptest::prelude::*;

    fn device() -> impl Strategy<Value = i64> {
        prop_oneof![0..4i64, Just(65535i64), Just(65536i64), Just(-1i64), Just(i64::MIN), Just(i64::MAX), Just(1i64 << 24), Just(1i64 << 32), any::<i64>(),]
    }

    fn size() -> impl Strategy<Value = u64> {
        prop_oneof![(1u64..64).prop_map(|k| k << 21), Just(0u64), Just(1u64 << 60), Just((1u64 << 60) + 1), Just(1u64 << 63), Just(u64::MAX), any::<u64>(),]
    }

    fn segment(device: i64, address: u64, total_size: u64) -> SnapshotSegment {
        SnapshotSegment {
            device,
            address,
            total_size,
            allocated_size: 0,
            active_size: 0,
            requested_size: 0,
            stream: 0,
            is_small: false,
            pool_id: (0, 0),
            is_expandable: false,
            blocks: vec![SnapshotBlock { address, size: total_size, requested_size: 0, state: BlockState::Inactive, stack: 0 }],
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

        /// Final segments on any device index with any size: a replay of the device that matters
        /// (chosen among the devices named, never one entry per index), or an error naming the
        /// segment, exactly when the index or the size is out of bounds.
        #[test]
        fn device_indices_and_sizes_are_checked(devices in proptest::collection::vec((device(), size()), 1..4)) {
            let mut snap = Snapshot { device_traces: vec![Vec::new()], ..Snapshot::default() };
            for (k, &(d, s)) in devices.iter().enumerate() {
                snap.segments.push(segment(d, 0x7f00_0000_0000 + ((k as u64) << 44), s));
            }
            let t = std::time::Instant::now();
            let r = allocsim_replay::run(&snap, &allocsim_replay::ReplaySpec::default());
            prop_assert!(t.elapsed().as_secs() < 5, "took {:?}", t.elapsed());
            let bad_device = devices.iter().position(|&(d, _)| !(0..65536).contains(&d));
            let bad_size = devices.iter().any(|&(_, s)| s > 1 << 60);
            match (r, bad_device) {
                (Err(e), Some(k)) => {
                    let e = e.to_string();
                    prop_assert!(e.starts_with(&format!("final segment {k} (at ")) && e.contains("is not a device index"), "{e}");
                }
                (Ok(_), Some(k)) => prop_assert!(false, "segment {k} on device {} replayed", devices[k].0),
                (Err(e), None) => {
                    let e = e.to_string();
                    prop_assert!(bad_size || e.contains("final segment at"), "{e}");
                    prop_assert!(e.contains("final segment at"), "{e}");
                }
                (Ok(r), None) => {
                    // The device replayed is the one holding the most bytes, and holds no segment
                    // out of bounds.
                    prop_assert!(devices.iter().filter(|&&(d, _)| d == r.device as i64).all(|&(_, s)| s <= 1 << 60), "{devices:?}");
                }
            }
        }
    }
}
