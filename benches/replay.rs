//! Speed figures (criterion): decoding (and a gzip'd file's settings read from its end), replaying,
//! sweeping. The largest reference trace is used
//! when `../shared/traces` is present (synthetic: 450 k entries, 150 k requests), else the largest
//! in `traces/`. Run with `cargo bench --bench replay`; figures are recorded in docs/performance.md.
//! `ALLOCSIM_BENCH_PICKLE=FILE` adds the `real_pickle` group: a snapshot of your own (a real one,
//! with C++ frames, is the case it is for) read compactly, read by the general decoders, and
//! replayed from its path as `allocsim replay` does.

use std::hint::black_box;
use std::path::{Path, PathBuf};

use allocsim_model::AllocatorConfig;
use allocsim_model::free_set::FreeSet;
use allocsim_replay::Prepared;
use allocsim_replay::run::Limits;
use allocsim_synth::{Spec, Workload};
use allocsim_whatif::grid::{DEFAULT_GRID, parse_grid};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};

const H200: u64 = 150_109_880_320;

fn largest_trace() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let shared = root.join("../shared/traces/synthetic__default__0M.pickle.gz");
    if shared.exists() {
        return shared;
    }
    root.join("traces/multistream__default__0M.pickle.gz")
}

fn gunzip(bytes: &[u8]) -> Vec<u8> {
    use std::io::Read;
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(bytes).read_to_end(&mut out).unwrap();
    out
}

fn benches(c: &mut Criterion) {
    let path = largest_trace();
    let raw = gunzip(&std::fs::read(&path).unwrap());
    let snap = allocsim_trace::snapshot::from_pickle(&raw).unwrap();
    let p = Prepared::new(&snap, None, H200, None).unwrap();
    let n = p.program.requests.len() as u64;
    eprintln!("{}: {} MB of pickle, {} entries, {n} requests", path.display(), raw.len() / 1_000_000, snap.device_traces[0].len());

    let mut g = c.benchmark_group("decode");
    g.throughput(Throughput::Bytes(raw.len() as u64));
    g.sample_size(10);
    g.bench_function("pickle_to_snapshot", |b| b.iter(|| allocsim_trace::snapshot::from_pickle(black_box(&raw)).unwrap()));
    // The stream (`pickle_stream`): the first pass (segments, segment events, settings) and the
    // events, from the same bytes in memory.
    let file = allocsim_trace::pickle_stream::PickleFile::from_bytes(raw.clone());
    g.bench_function("pickle_stream_scan", |b| b.iter(|| black_box(file.scan().unwrap().entries)));
    g.bench_function("pickle_stream_events", |b| b.iter(|| black_box(file.events().unwrap().map(|e| e.unwrap().1.size).sum::<u64>())));
    g.finish();

    // The settings of the gzip'd file from its last deflate blocks (`gzip_tail`), what the replay
    // beside the first pass waits for before it starts.
    let max_split_size_of = AllocatorConfig::recorded_max_split_size;
    let found = allocsim_trace::pickle_stream::gzip_tail_settings(&path, max_split_size_of).is_some();
    eprintln!("{}: settings from the last deflate blocks: {}", path.display(), if found { "read" } else { "not read" });
    let mut g = c.benchmark_group("gzip_tail");
    g.sample_size(20);
    g.bench_function("settings", |b| b.iter(|| black_box(allocsim_trace::pickle_stream::gzip_tail_settings(black_box(&path), max_split_size_of).is_some())));
    g.finish();

    // A kvcache snapshot with stacks, as `allocsim synth` + `convert` writes it (665 k entries,
    // ≈ 38 MB of pickle; benches/pickle_stream.sh times the CLI on such files beside CPython).
    let (kv, _) = allocsim_synth::snapshot(&Spec::new(Workload::KvCache, 222_000, 1));
    let kv_raw = allocsim_trace::snapshot::to_pickle(&kv);
    let kv_file = allocsim_trace::pickle_stream::PickleFile::from_bytes(kv_raw.clone());
    let mut g = c.benchmark_group("decode_kvcache_665k");
    g.throughput(Throughput::Bytes(kv_raw.len() as u64));
    g.sample_size(10);
    g.bench_function("pickle_to_snapshot", |b| b.iter(|| allocsim_trace::snapshot::from_pickle(black_box(&kv_raw)).unwrap().device_traces.len()));
    g.bench_function("pickle_stream_scan", |b| b.iter(|| black_box(kv_file.scan().unwrap().entries)));
    g.bench_function("pickle_stream_events", |b| b.iter(|| black_box(kv_file.events().unwrap().map(|e| e.unwrap().1.size).sum::<u64>())));
    g.finish();

    let mut g = c.benchmark_group("replay");
    g.throughput(Throughput::Elements(n));
    g.sample_size(10);
    for (name, conf, cap) in [
        ("default", "", None),
        ("expandable_segments", "expandable_segments:True", None),
        ("gc_0.6_capped", "garbage_collection_threshold:0.6", Some(8810u64 << 20)),
        ("max_split_128_capped", "max_split_size_mb:128", Some(8810u64 << 20)),
    ] {
        let cfg = AllocatorConfig::parse(conf).unwrap();
        let placement = p.recorded_placement();
        g.bench_function(name, |b| b.iter(|| black_box(p.replay(&cfg, cap, placement.clone()).peak_reserved)));
    }
    g.finish();

    let mut g = c.benchmark_group("sweep");
    g.sample_size(10);
    let points = parse_grid(DEFAULT_GRID, "").unwrap();
    g.bench_function("default_grid_4_placements", |b| {
        b.iter(|| allocsim_whatif::sweep::sweep(&p, &points, &Limits::capacity(Some(8810 << 20)), 4, &|| {}).len())
    });
    g.bench_function("default_grid_4_placements_uncapped", |b| b.iter(|| allocsim_whatif::sweep::sweep(&p, &points, &Limits::capacity(None), 4, &|| {}).len()));
    g.finish();

    // The sweep target: the default grid over a 1-million-event trace (333 334 requests,
    // three entries each), generated in memory; decoding is not part of it (done once, shared).
    let mut g = c.benchmark_group("sweep_1m_events");
    g.sample_size(10);
    for workload in [Workload::Training, Workload::Varlen, Workload::KvCache] {
        let (snap, _) = allocsim_synth::snapshot(&Spec { frames: false, ..Spec::new(workload, 333_334, 1) });
        let p = Prepared::new(&snap, None, H200, None).unwrap();
        let peak = p.own_outcome.peak_reserved;
        eprintln!("{}: {} entries, peak reserved {peak}", workload.name(), snap.device_traces[0].len());
        for (cap_name, cap) in [("uncapped", None), ("capped_at_own_peak", Some(peak))] {
            let t = std::time::Instant::now();
            let rows = allocsim_whatif::sweep::sweep(&p, &points, &Limits::capacity(cap), 4, &|| {});
            let secs = t.elapsed().as_secs_f64();
            let shared = rows.iter().flat_map(|r| &r.outcomes).filter(|o| o.same_as.is_some()).count();
            let total: usize = rows.iter().map(|r| r.outcomes.len()).sum();
            eprintln!("  {cap_name}: {} of {total} outcomes replayed; one run {secs:.2} s", total - shared);
            // Capped sweeps run configs into OOM and release storms (seconds each): timed once above.
            if cap.is_none() {
                g.bench_function(format!("{}_{cap_name}", workload.name()), |b| {
                    b.iter(|| allocsim_whatif::sweep::sweep(&p, &points, &Limits::capacity(cap), 4, &|| {}).len())
                });
            }
        }
    }
    g.finish();

    // The free-block set alone: a pool of 64 free blocks, one block out and one in, then a
    // best-fit lookup (the set operations of one malloc/free pair).
    let mut g = c.benchmark_group("free_set");
    let mut rng = 12345u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let keys: Vec<(u64, u64, u64)> = (0..4096).map(|_| (0, (next() % 2048) * 512, (next() % (1 << 30)) << 9)).collect();
    let mut set = FreeSet::new();
    for k in &keys[..64] {
        set.insert(*k, 1);
    }
    let mut i = 0usize;
    g.throughput(Throughput::Elements(1));
    g.bench_function("remove_insert_lookup_64", |b| {
        b.iter(|| {
            let (out, inn) = (keys[i % 4096], keys[(i + 64) % 4096]);
            i += 1;
            set.remove(out);
            set.insert(inn, 2);
            black_box(set.range_from(0, inn.1, 0).next())
        })
    });
    g.finish();
}

/// `ALLOCSIM_BENCH_PICKLE`: a snapshot file (plain or gzip'd) read the ways `allocsim replay`
/// reads one. Without it, says so and measures nothing.
fn real_pickle(c: &mut Criterion) {
    let Some(path) = std::env::var_os("ALLOCSIM_BENCH_PICKLE").map(PathBuf::from) else {
        eprintln!("real_pickle: ALLOCSIM_BENCH_PICKLE is not set (a snapshot file to measure): skipped");
        return;
    };
    let Ok(Some(file)) = allocsim_trace::pickle_stream::PickleFile::open(&path) else {
        eprintln!("real_pickle: {} is missing or not a pickle: skipped", path.display());
        return;
    };
    let mut g = c.benchmark_group("real_pickle");
    g.throughput(Throughput::Bytes(file.len()));
    g.sample_size(10);
    // One pass of the stream's machine into a `Snapshot` (what `replay` does with a trace that
    // starts mid-history), and the general decoders (`replay --in-memory`).
    g.bench_function("compact", |b| b.iter(|| black_box(file.compact().unwrap().device_traces.len())));
    g.bench_function("read_trace_whole", |b| b.iter(|| black_box(allocsim_trace::read_trace_whole(&path).unwrap().device_traces.len())));
    // `allocsim replay FILE` less the printing.
    g.bench_function("replay_file", |b| {
        b.iter(|| {
            let f = allocsim_commands::file::ReplayFile::new(&path);
            let a = allocsim_commands::file::replay_file(f, &Default::default(), &mut |_| {}).unwrap();
            black_box(a.all.len())
        })
    });
    g.finish();
}

criterion_group!(all, benches, real_pickle);
criterion_main!(all);
