//! Speed figures (criterion): decoding, replaying, sweeping. The largest reference trace is used
//! when `../shared/traces` is present (synthetic: 450 k entries, 150 k requests), else the largest
//! in `traces/`. Run with `cargo bench --bench replay`; figures are recorded in docs/performance.md.

use std::hint::black_box;
use std::path::{Path, PathBuf};

use allocsim_model::AllocatorConfig;
use allocsim_replay::Prepared;
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
        b.iter(|| allocsim_whatif::sweep::sweep(&p, &points, Some(8810 << 20), 4, &|| {}).len())
    });
    g.finish();
}

criterion_group!(all, benches);
criterion_main!(all);
