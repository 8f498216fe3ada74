//! The generator: deterministic, well-formed (frees only of live blocks), and every workload
//! replays through allocsim-replay without unknown frees.

use std::collections::HashMap;

use allocsim_replay::{ReplaySpec, run};
use allocsim_synth::{Spec, Workload, snapshot, write_jsonl};
use allocsim_trace::{Action, TraceEntry};

fn spec(w: Workload, requests: u64, seed: u64, streams: u32) -> Spec {
    let mut s = Spec::new(w, requests, seed);
    s.streams = streams;
    s
}

fn jsonl(s: &Spec) -> Vec<u8> {
    let mut out = Vec::new();
    write_jsonl(s, &mut out).unwrap();
    out
}

#[test]
fn same_seed_same_bytes_other_seed_other_trace() {
    for w in Workload::ALL {
        let a = spec(w, 5_000, 7, 2);
        assert_eq!(jsonl(&a), jsonl(&a), "{w:?}: JSON Lines differ between two runs of one seed");
        let (sa, _) = snapshot(&a);
        let (sb, _) = snapshot(&a);
        assert_eq!(allocsim_trace::snapshot::to_pickle(&sa), allocsim_trace::snapshot::to_pickle(&sb), "{w:?}: pickles differ between two runs of one seed");
        assert_ne!(jsonl(&a), jsonl(&spec(w, 5_000, 8, 2)), "{w:?}: seeds 7 and 8 gave the same trace");
    }
}

#[test]
fn streamed_jsonl_is_the_trace_crates_jsonl_and_round_trips() {
    for w in Workload::ALL {
        for frames in [true, false] {
            let mut s = spec(w, 3_000, 1, 3);
            s.frames = frames;
            let (snap, stats) = snapshot(&s);
            let mut written = Vec::new();
            allocsim_trace::jsonl::write(&snap, &mut written).unwrap();
            let streamed = jsonl(&s);
            assert!(streamed == written, "{w:?} frames={frames}: streamed JSON Lines differ from jsonl::write");
            assert_eq!(allocsim_trace::read_trace_bytes(&streamed).unwrap(), snap, "{w:?}: JSON Lines round trip");
            let pickle = allocsim_trace::snapshot::to_pickle(&snap);
            assert_eq!(allocsim_trace::read_trace_bytes(&pickle).unwrap(), snap, "{w:?}: pickle round trip");
            assert_eq!(stats.requests, 3_000);
            assert_eq!(stats.entries as usize, snap.device_traces[0].len());
            assert_eq!(snap.settings.alloc_conf.as_deref(), Some(""));
            assert!(snap.segments.is_empty());
            assert_eq!(snap.stacks.len() > 1, frames);
        }
    }
}

/// Every free names a live block, every completion a pending one, addresses are unique among live
/// blocks, time increases, and the trace holds exactly the requested number of allocations.
fn check_well_formed(w: Workload, streams: u32, trace: &[TraceEntry], requests: u64) -> (u64, u64) {
    #[derive(PartialEq)]
    enum St {
        Live,
        Pending,
    }
    let mut blocks: HashMap<u64, (St, u64, u64)> = HashMap::new();
    let (mut allocs, mut late) = (0u64, 0u64);
    let mut prev_time = i64::MIN;
    for (i, e) in trace.iter().enumerate() {
        assert!(e.time_us > prev_time, "{w:?}/{streams}: entry {i}: time_us does not increase");
        prev_time = e.time_us;
        match e.action {
            Action::Alloc => {
                allocs += 1;
                assert!(e.size > 0);
                assert!(blocks.insert(e.addr, (St::Live, e.size, e.stream)).is_none(), "{w:?}/{streams}: entry {i}: address {:#x} reused while in use", e.addr);
            }
            Action::FreeRequested => {
                let b = blocks.get_mut(&e.addr).unwrap_or_else(|| panic!("{w:?}/{streams}: entry {i}: free of unknown {:#x}", e.addr));
                assert!(b.0 == St::Live, "{w:?}/{streams}: entry {i}: double free");
                assert_eq!((b.1, b.2), (e.size, e.stream), "{w:?}/{streams}: entry {i}: free with another size or stream");
                b.0 = St::Pending;
            }
            Action::FreeCompleted => {
                let b = blocks.remove(&e.addr).unwrap_or_else(|| panic!("{w:?}/{streams}: entry {i}: completion of unknown {:#x}", e.addr));
                assert!(b.0 == St::Pending, "{w:?}/{streams}: entry {i}: completion before free_requested");
                if !(i > 0 && trace[i - 1].action == Action::FreeRequested && trace[i - 1].addr == e.addr) {
                    late += 1;
                }
            }
            a => panic!("{w:?}/{streams}: entry {i}: unexpected action {a:?}"),
        }
    }
    assert_eq!(allocs, requests, "{w:?}/{streams}");
    assert_eq!(trace.last().map(|e| e.action), Some(Action::Alloc), "{w:?}/{streams}: should end at its last request");
    (allocs, late)
}

#[test]
fn frees_only_of_live_blocks_and_late_completions_with_streams() {
    for w in Workload::ALL {
        for streams in [1, 3] {
            let s = spec(w, 20_000, 3, streams);
            let (snap, stats) = snapshot(&s);
            let (_, late) = check_well_formed(w, streams, &snap.device_traces[0], 20_000);
            assert_eq!(late, stats.deferred_frees);
            let used: std::collections::BTreeSet<u64> = snap.device_traces[0].iter().map(|e| e.stream).collect();
            assert_eq!(used.len(), streams as usize, "{w:?}: streams used {used:?}");
            if streams > 1 && matches!(w, Workload::Training | Workload::Varlen | Workload::Random) {
                assert!(late > 0, "{w:?}: no late-completing frees with {streams} streams");
            }
            if streams == 1 {
                assert_eq!(late, 0, "{w:?}: late completions on one stream");
            }
        }
    }
}

#[test]
fn random_live_set_stays_within_its_bounds() {
    let mut s = spec(Workload::Random, 30_000, 5, 1);
    s.live_blocks = 500;
    s.live_bytes = 8 << 30;
    s.max_size = 64 << 20;
    let (snap, stats) = snapshot(&s);
    assert!(stats.peak_live_blocks <= 500 && stats.peak_live_blocks >= 450, "{stats:?}");
    assert!(stats.peak_live_bytes <= 8 << 30);
    let t = &snap.device_traces[0];
    let allocs: Vec<u64> = t.iter().filter(|e| e.action == Action::Alloc).map(|e| e.size).collect();
    assert!(allocs.iter().all(|&x| (512..=64 << 20).contains(&x)));
    // Log-uniform: about as many requests below 64 KiB (7 octaves of 17) as the octaves say.
    let small = allocs.iter().filter(|&&x| x < 64 << 10).count() as f64 / allocs.len() as f64;
    assert!((small - 7.0 / 17.0).abs() < 0.03, "{small}");
}

#[test]
fn every_workload_replays_without_unknown_frees() {
    for w in Workload::ALL {
        for streams in [1, 2] {
            let s = spec(w, 20_000, 11, streams);
            let (snap, _) = snapshot(&s);
            let r = run(&snap, &ReplaySpec::default()).unwrap_or_else(|e| panic!("{w:?}: {e}"));
            assert_eq!(r.program.unknown_frees, 0, "{w:?}/{streams}");
            assert_eq!(r.program.requests.len(), 20_000);
            assert!(r.program.initial.is_none() && r.program.reconstruct_error.is_none(), "{w:?}: read as mid-history");
            assert!(r.outcome.ooms.is_empty(), "{w:?}/{streams}: OOM on an H200 at request {:?}", r.outcome.first_oom());
            assert!(r.empty_cache_requests().is_empty());
            assert!(r.outcome.peak_reserved > 0);
        }
    }
}
