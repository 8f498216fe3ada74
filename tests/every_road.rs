//! Every road to `replay`'s answer gives the same answer, on generated traces of every workload
//! recorded under random settings and allowed maxima, asked random questions.
//!
//! `allocsim replay FILE` reaches its answer by one of several roads (`allocsim_commands::file`):
//! a pickle's first pass that keeps the entries, with a replay beside it under the settings read
//! from the file's end or assumed; a first pass that only scans, then the entries streamed
//! (`compact_first: 0`); a JSON Lines file streamed; any of them falling back to the compact
//! in-memory replay; and `--in-memory`, the general decoders and the in-memory replay, the
//! reference. Here each generated trace is written as a plain pickle, a gzip'd pickle and JSON
//! Lines, and on each file every road must give the same text and JSON, byte for byte.
//!
//! The traces: `allocsim synth`'s workloads (training, varlen, kvcache, random; 1–3 streams, so
//! cross-stream frees), either replayed under a random config and allowed maximum and written as
//! the snapshot that run would record (`allocsim_report::export::simulated_snapshot`: its OOMs, its
//! `empty_cache()`-free retries, its settings in `allocator_settings`), or the generated entries
//! labelled with settings they were not made under (a trace its own settings do not reproduce:
//! the budget inference and the fallbacks run); some cut as a history turned on mid-run records
//! them (the state at the start reconstructed from the final segments). The questions: the trace's own settings or
//! another config, with or without an allowed maximum. On the trace's own question the commands
//! agree too: `replay`, `compare`, `explain --at peak` and `validate` give one peak reserved and
//! one device memory.

mod common;

use allocsim_commands::file::{ReplayFile, replay_file};
use allocsim_commands::replay::ReplayOptions;
use allocsim_commands::{Answer, Error};
use allocsim_model::AllocatorConfig;
use allocsim_replay::Prepared;
use allocsim_replay::stream::{StreamInput, Streamed, replay_stream};
use allocsim_report::export::{recorded_settings, simulated_snapshot};
use allocsim_synth::{Spec, Workload};
use allocsim_trace::jsonl_stream::JsonlFile;
use allocsim_trace::write_trace;
use common::TempFile;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use std::sync::atomic::{AtomicUsize, Ordering};

const H200: u64 = 150_109_880_320;
const MIB: u64 = 1 << 20;

/// The settings a trace is recorded under or asked about.
const CONFS: [&str; 6] = [
    "",
    "expandable_segments:True",
    "max_split_size_mb:128",
    "garbage_collection_threshold:0.6",
    "roundup_power2_divisions:4",
    "max_split_size_mb:64,roundup_power2_divisions:[256:1,>:4]",
];

/// `(text, JSON)` of `replay` of `path` by one road; an error as its message.
fn answer(f: ReplayFile<'_>, o: &ReplayOptions) -> Result<(String, String), String> {
    replay_file(f, o, &mut |_| {}).map(|a| (a.text(), a.json())).map_err(|e: Error| e.to_string())
}

#[derive(Debug, Clone)]
struct Case {
    workload: usize,
    seed: u64,
    requests: u64,
    streams: u32,
    /// Index into [`CONFS`]: the settings the trace is recorded under.
    recorded: usize,
    /// The recorded run's allowed maximum as a percentage of its uncapped peak reserved.
    cap_percent: Option<u64>,
    /// Label the generated entries with [`CONFS`]`[recorded]` instead of replaying them under it.
    relabel: bool,
    /// Index into [`CONFS`] of the asked config (`None`: the trace's own settings).
    ask: Option<usize>,
    /// Ask under an allowed maximum (this percentage of the uncapped peak reserved).
    ask_cap_percent: Option<u64>,
    /// Index into [`CARDS`]: the device the trace is recorded on.
    card: usize,
    /// Keep only the entries after this percentage of them, as a history turned on mid-run
    /// records (the final segments stay whole).
    cut_percent: Option<u64>,
}

/// The devices' total memory: an H200's, an H100's (80 GB), a B200's.
const CARDS: [u64; 3] = [H200, 85_017_493_504, 191_514_411_008];

fn case() -> impl Strategy<Value = Case> {
    (
        0..Workload::ALL.len(),
        any::<u64>(),
        200u64..3000,
        1u32..=3,
        0..CONFS.len(),
        prop::option::of(40u64..100),
        any::<bool>(),
        prop::option::of(0..CONFS.len()),
        prop::option::of(40u64..120),
        (0..CARDS.len(), prop::option::of(5u64..70)),
    )
        .prop_map(|(workload, seed, requests, streams, recorded, cap_percent, relabel, ask, ask_cap_percent, (card, cut_percent))| Case {
            workload,
            seed,
            requests,
            streams,
            recorded,
            cap_percent,
            relabel,
            ask,
            ask_cap_percent,
            card,
            cut_percent,
        })
}

/// Whether the one-pass replay of a JSON Lines file answers `options`' question itself.
fn one_pass_answers(path: &std::path::Path, options: &ReplayOptions) -> bool {
    let file = JsonlFile::open(path).unwrap().expect("a JSON Lines file");
    let scan = file.scan().unwrap();
    let input = StreamInput { settings: &scan.header.settings, devices: scan.header.devices, segments: &scan.segments, segment_entries: &scan.segment_entries };
    matches!(replay_stream(&input, &options.spec(None), || file.events()), Ok(Streamed::Done(_)))
}

/// The property on one case; whether the one-pass stream answered its JSON Lines file itself.
fn check(c: &Case) -> Result<bool, TestCaseError> {
    let mut streamed = false;
    let spec = Spec { streams: c.streams, ..Spec::new(Workload::ALL[c.workload], c.requests, c.seed) };
    let (generated, _) = allocsim_synth::snapshot(&spec);
    let p = Prepared::new(&generated, None, CARDS[c.card], None).expect("a generated trace prepares");
    let peak = p.own_outcome.peak_reserved.max(2 * MIB);
    let percent = |pc: u64| (peak / 100 * pc).div_ceil(2 * MIB) * 2 * MIB;
    let config = AllocatorConfig::parse(CONFS[c.recorded]).unwrap();
    let mut snap = if c.relabel {
        allocsim_trace::Snapshot { settings: recorded_settings(&config), ..generated }
    } else {
        simulated_snapshot(&p, &config, c.cap_percent.map(percent), &p.recorded_placement())
    };
    if let Some(pc) = c.cut_percent {
        for t in &mut snap.device_traces {
            let n = t.len() * pc as usize / 100;
            t.drain(..n);
        }
    }
    let options = ReplayOptions { config: c.ask.map(|i| CONFS[i].to_string()), capacity: c.ask_cap_percent.map(percent), ..ReplayOptions::default() };
    let tag = format!("{:x}-{}", c.seed, std::process::id());
    for ext in ["pickle", "pickle.gz", "jsonl"] {
        let f = TempFile::new(&format!("road-{tag}.{ext}"));
        write_trace(&snap, &f.0).unwrap();
        if ext == "pickle.gz" && c.ask.is_none() && c.ask_cap_percent.is_none() {
            commands_agree(&f, c)?;
        }
        let reference = answer(ReplayFile { in_memory: true, ..ReplayFile::new(&f.0) }, &options);
        if ext == "jsonl" {
            streamed = one_pass_answers(&f.0, &options);
        }
        for (road, rf) in [("the default road", ReplayFile::new(&f.0)), ("scanned first", ReplayFile { compact_first: 0, ..ReplayFile::new(&f.0) })] {
            let got = answer(rf, &options);
            prop_assert_eq!(&got, &reference, "{:?}: .{} by {} differs from --in-memory", c, ext, road);
        }
    }
    Ok(streamed)
}

/// On the trace's own question, `replay`, `compare A A` (replayed under its own settings, side
/// A), `explain --at peak` and `validate` give one peak reserved and one device memory; a
/// recording the replay reproduces gives `compare`'s recorded sides that peak too.
fn commands_agree(f: &TempFile, c: &Case) -> Result<(), TestCaseError> {
    let u = |v: &serde_json::Value, what: &str| v.as_u64().unwrap_or_else(|| panic!("{c:?}: {what}: {v}"));
    let replay = common::json(&["replay", "--json", f.arg()]);
    let v = common::run(&["validate", "--json", f.arg()]);
    prop_assert!(matches!(v.status.code(), Some(0 | 1)), "{:?}: validate exited {:?}", c, v.status.code());
    let validate: serde_json::Value = serde_json::from_slice(&v.stdout).unwrap();
    let explain = common::json(&["explain", "--at", "peak", "--json", f.arg()]);
    let compare = common::json(&["compare", "--json", f.arg(), "--config-b", CONFS[c.recorded]]);
    let peak = u(&replay["stats"]["reserved_bytes.all.peak"], "replay");
    prop_assert_eq!(u(&compare["peak_reserved"][0], "compare"), peak, "{:?}: compare's peak", c);
    prop_assert_eq!(u(&explain["free"]["reserved"], "explain"), peak, "{:?}: explain --at peak's peak", c);
    let dm = [&replay, &validate, &explain].map(|j| u(&j["budget"]["device_memory"], "device memory"));
    prop_assert!(dm.iter().all(|&d| d == dm[0]), "{:?}: device memory (replay, validate, explain) {:?}", c, dm);
    if v.status.code() == Some(0) {
        let recorded = common::json(&["compare", "--json", f.arg(), f.arg()]);
        prop_assert_eq!(u(&recorded["peak_reserved"][0], "compare A A"), peak, "{:?}: the recorded peak", c);
    }
    Ok(())
}

/// The property over 64 random cases (a failing case is shrunk and printed); at least a fifth of
/// them answered by the one-pass stream itself (about half are: the others start mid-history,
/// need a budget inferred or carry settings their trace was not made under, and go to the
/// in-memory replay), so the roads compared are not the in-memory one twice.
#[test]
fn every_road_gives_the_in_memory_answer() {
    const CASES: u32 = 64;
    let mut runner = TestRunner::new(Config { cases: CASES, ..Config::default() });
    let streamed = AtomicUsize::new(0);
    let r = runner.run(&case(), |c| {
        if check(&c)? {
            streamed.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    });
    if let Err(e) = r {
        panic!("{e}");
    }
    let n = streamed.load(Ordering::Relaxed);
    eprintln!("{n} of {CASES} JSON Lines files streamed to their answer");
    assert!(n * 5 >= CASES as usize, "only {n} of {CASES} JSON Lines files streamed to their answer");
}

/// Cases this test found where the roads disagreed, kept: a capped training run with expandable
/// segments on an H200, whose OOM entries (free + reserved) made the in-memory reading of the
/// reservations' spacing cluster both pools' reservations as one (the streamed road said "an
/// H200's bytes, within …", the in-memory one "not in the trace"); and a capped run on a
/// B200-sized device, where the streamed road assumed an H200 and printed "a total capacity of
/// 139.80 GiB of which 176.78 GiB is free" while the in-memory one read 177.86 GiB from the OOMs.
#[test]
fn the_disagreements_found_stay_fixed() {
    let found = [
        Case {
            workload: 0,
            seed: 10889223195992619114,
            requests: 523,
            streams: 1,
            recorded: 1,
            cap_percent: Some(88),
            relabel: false,
            ask: None,
            ask_cap_percent: None,
            card: 0,
            cut_percent: None,
        },
        Case {
            workload: 1,
            seed: 12693413801816830621,
            requests: 256,
            streams: 2,
            recorded: 2,
            cap_percent: Some(42),
            relabel: false,
            ask: None,
            ask_cap_percent: None,
            card: 2,
            cut_percent: None,
        },
        // A free block inserted twice into its pool (the model's
        // `insert_into_blocks` assertion) on the speculative road.
        Case {
            workload: 1,
            seed: 9594158606167631955,
            requests: 2708,
            streams: 2,
            recorded: 0,
            cap_percent: Some(56),
            relabel: false,
            ask: None,
            ask_cap_percent: None,
            card: 0,
            cut_percent: None,
        },
    ];
    for c in &found {
        check(c).unwrap_or_else(|e| panic!("{e}"));
    }
}
