//! `export`: a what-if run written as a snapshot. Checked against the real run of that config
//! (entry by entry: action and size), and read back by our reader and replayed under its own
//! settings, which must reproduce it exactly.

use std::path::Path;

use allocsim_model::AllocatorConfig;
use allocsim_replay::{Prepared, ReplaySpec, run, validate};
use allocsim_report::export::simulated_snapshot;
use allocsim_trace::read_trace;
use allocsim_trace::snapshot::{from_pickle, to_pickle};

const H200: u64 = 150_109_880_320;

#[test]
fn what_if_export_matches_the_real_run_and_round_trips() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let cap = (0.014306077943850566f64 * H200 as f64) as u64;
    let base = read_trace(&root.join("traces/frag__default__2048M.pickle.gz")).unwrap();
    let real = read_trace(&root.join("traces/frag__expandable__2048M.pickle.gz")).unwrap();
    let p = Prepared::new(&base, None, H200, Some(cap)).unwrap();
    let es = AllocatorConfig::parse("expandable_segments:True").unwrap();
    let sim = simulated_snapshot(&p, &es, Some(cap), &p.recorded_placement());
    // The same entries as the real expandable run, in the same order (addresses differ: the
    // driver chose them).
    let shape = |s: &allocsim_trace::Snapshot| s.device_traces[0].iter().map(|e| (e.action, e.size)).collect::<Vec<_>>();
    assert_eq!(shape(&sim), shape(&real));
    assert_eq!(sim.segments.len(), real.segments.len());
    assert_eq!(sim.segments[0].total_size, real.segments[0].total_size);
    assert_eq!(sim.settings.expandable_segments, Some(true));
    // Written as a pickle and read back, it is the same snapshot, and replaying it under its own
    // settings reproduces every event, address and final segment.
    let back = from_pickle(&to_pickle(&sim)).unwrap();
    let (a, b) = (&back.device_traces[0], &sim.device_traces[0]);
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        // Stack ids are renumbered on reading; the frames they name must be the same.
        let same =
            (x.action, x.addr, x.size, x.stream, x.time_us) == (y.action, y.addr, y.size, y.stream, y.time_us) && back.stack(x.stack) == sim.stack(y.stack);
        assert!(same, "entry {i}: read back {x:?}, written {y:?}");
    }
    assert_eq!(back.segments.len(), sim.segments.len());
    let r = run(&back, &ReplaySpec { capacity: Some(cap), ..ReplaySpec::default() }).unwrap();
    let v = validate(&r);
    assert!(v.exact, "{v:?}");
}

/// An exported snapshot keeps the run's `external_annotations` (the optimizer's steps) and each
/// request's `compile_context` / `user_metadata` through the pickle written.
#[test]
fn export_keeps_annotations_and_entry_metadata() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut base = read_trace(&root.join("traces/cudagraph__default__0M.pickle.gz")).unwrap();
    assert_eq!(base.annotations.len(), 16);
    // Give the recorded allocations metadata, as `_set_memory_metadata` would.
    base.entry_metas = vec![allocsim_trace::EntryMeta { compile_context: "N/A".into(), user_metadata: "warmup".into() }];
    let mut tagged = 0;
    for e in base.device_traces[0].iter_mut().filter(|e| e.action == allocsim_trace::Action::Alloc).take(10) {
        e.meta = 1;
        tagged += 1;
    }
    let p = Prepared::new(&base, None, H200, None).unwrap();
    let sim = simulated_snapshot(&p, &p.own, None, &p.recorded_placement());
    let back = from_pickle(&to_pickle(&sim)).unwrap();
    assert_eq!(back.annotations, base.annotations);
    let allocs = back.device_traces[0].iter().filter(|e| e.action == allocsim_trace::Action::Alloc);
    let metas: Vec<&str> = allocs.map(|e| back.user_metadata(e.meta)).collect();
    assert_eq!(metas.iter().take(tagged).collect::<Vec<_>>(), vec![&"warmup"; tagged]);
    assert!(metas[tagged..].iter().all(|m| m.is_empty()));
}
