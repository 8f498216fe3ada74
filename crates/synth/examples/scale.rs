//! Scaling measurements for docs/performance.md ("Scale") and the plot docs/scaling.svg.
//!
//! ```sh
//! # Replay time against the number of live blocks (random workload, generated in memory):
//! cargo run --release -p allocsim-synth --example scale -- live 4000000 16,256,4096,65536,1048576 > live.csv
//! # The plot, from the CSV of `allocsim replay` runs (crates/synth/scale.sh) and live.csv:
//! # Generated in memory and replayed (no file, no decoder), one process per count:
//! cargo run --release -p allocsim-synth --example scale -- length 10000000
//! cargo run --release -p allocsim-synth --example scale -- plot cli.csv memory.csv live.csv > docs/scaling.svg
//! ```
//!
//! `live`: for each live-set bound, the random workload (sizes 512 B–8 MiB, log-uniform, seed 1)
//! of N requests is generated into memory, then the program is built and replayed under the
//! default config exactly as `allocsim replay` does (`allocsim_replay::Prepared`), on a simulated
//! device of 16 TiB so that only the live-set bound changes (the allocator never runs out). Each
//! row: bound, peak live blocks, free blocks in the pools at the end (the best-fit sets' size),
//! seconds to build the program, seconds to replay (each the best of three runs), requests per
//! second.

use std::fmt::Write as _;
use std::time::Instant;

use allocsim_model::constants::H200_TOTAL_MEMORY;
use allocsim_replay::replay::{EmptyCacheCalls, ReplayOptions, recorded_placement, replay};
use allocsim_synth::{Spec, Workload, snapshot};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("live") => live(&args[1..]),
        Some("length") => length(&args[1..]),
        Some("plot") => plot(&args[1], &args[2], &args[3]),
        Some("sizes") => sizes(),
        _ => {
            eprintln!("usage: scale live REQUESTS BOUND,... | scale length REQUESTS,... | scale plot CLI.csv MEMORY.csv LIVE.csv | scale sizes");
            std::process::exit(2);
        }
    }
}

/// Bytes per item of what a replay holds.
fn sizes() {
    println!("TraceEntry {}", std::mem::size_of::<allocsim_trace::TraceEntry>());
    println!("Request {}", std::mem::size_of::<allocsim_replay::Request>());
    println!("Op {}", std::mem::size_of::<allocsim_replay::Op>());
    println!("Option<u64> {}", std::mem::size_of::<Option<u64>>());
}

/// Peak resident memory of this process so far (VmHWM), in KiB.
fn vm_hwm_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines().find_map(|l| l.strip_prefix("VmHWM:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok()).unwrap_or(0)
}

/// One process per count (run it once per count: VmHWM only grows): the training workload
/// generated into memory (no file, no decoder), then the program built and replayed as
/// `allocsim replay` does.
fn length(args: &[String]) {
    let n: u64 = args[0].parse().expect("REQUESTS");
    let mut spec = Spec::new(Workload::Training, n, 1);
    spec.frames = false;
    let t0 = Instant::now();
    let (snap, _) = snapshot(&spec);
    let gen_s = t0.elapsed().as_secs_f64();
    let trace = &snap.device_traces[0];
    let t1 = Instant::now();
    let program = allocsim_replay::restore::build_program_default(trace, &[]);
    let build = t1.elapsed().as_secs_f64();
    let opts = ReplayOptions {
        config: Default::default(),
        capacity: None,
        device_memory: H200_TOTAL_MEMORY,
        placement: recorded_placement(trace, H200_TOTAL_MEMORY),
        outside: Default::default(),
    };
    let t2 = Instant::now();
    let out = replay(&program, &opts, EmptyCacheCalls::Infer(trace));
    let rep = t2.elapsed().as_secs_f64();
    assert!(out.ooms.is_empty() && program.unknown_frees == 0);
    println!("{n},{},{gen_s:.2},{build:.2},{rep:.2},{:.0},{},{}", trace.len(), n as f64 / rep, out.peak_reserved, vm_hwm_kib());
}

fn live(args: &[String]) {
    let n: u64 = args[0].parse().expect("REQUESTS");
    println!("live_bound,peak_live_blocks,free_blocks_at_end,requests,build_s,replay_s,requests_per_s");
    for bound in args[1].split(',') {
        let bound: u64 = bound.parse().expect("BOUND");
        let mut spec = Spec::new(Workload::Random, n, 1);
        spec.live_blocks = bound;
        spec.max_size = 8 << 20;
        spec.live_bytes = 1 << 50;
        spec.frames = false;
        let (snap, stats) = snapshot(&spec);
        let trace = &snap.device_traces[0];
        let device_memory = 16u64 << 40;
        let opts = ReplayOptions {
            config: Default::default(),
            capacity: None,
            device_memory,
            placement: recorded_placement(trace, device_memory),
            outside: Default::default(),
        };
        // The best of three (the machine is shared).
        let (mut build, mut rep) = (f64::MAX, f64::MAX);
        let mut last = None;
        for _ in 0..3 {
            let t0 = Instant::now();
            let program = allocsim_replay::restore::build_program_default(trace, &[]);
            build = build.min(t0.elapsed().as_secs_f64());
            let t1 = Instant::now();
            let out = replay(&program, &opts, EmptyCacheCalls::Infer(trace));
            rep = rep.min(t1.elapsed().as_secs_f64());
            assert!(out.ooms.is_empty() && program.unknown_frees == 0);
            last = Some(out);
        }
        let out = last.expect("replayed");
        let free_at_end = out.allocator.live_blocks().filter(|(_, b)| !b.allocated && b.event_count == 0).count();
        println!("{bound},{},{free_at_end},{n},{build:.3},{rep:.3},{:.0}", stats.peak_live_blocks, n as f64 / rep);
    }
}

// ---------------------------------------------------------------------------------------------
// The plot: two panels, log–log.

/// (label, colour, points)
type Series<'a> = (&'a str, &'a str, Vec<(f64, f64)>);

struct Panel<'a> {
    title: &'a str,
    xlabel: &'a str,
    ylabel: &'a str,
    series: Vec<Series<'a>>,
}

fn csv(path: &str) -> Vec<Vec<String>> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    text.lines().skip(1).filter(|l| !l.trim().is_empty()).map(|l| l.split(',').map(str::to_string).collect()).collect()
}

fn num(s: &str) -> f64 {
    s.trim().parse().unwrap_or(f64::NAN)
}

/// cli.csv: requests,entries,file_bytes,gen_s,replay_s,peak_rss_kb (scale.sh);
/// memory.csv: requests,entries,gen_s,build_s,replay_s,requests_per_s,peak_reserved,peak_rss_kb
/// (`length`); live.csv as `live` writes it.
fn plot(cli: &str, memory: &str, live: &str) {
    let c = csv(cli);
    let m = csv(memory);
    let v = csv(live);
    let left = Panel {
        title: "by trace length (training workload)",
        xlabel: "requests",
        ylabel: "seconds  /  GiB",
        series: vec![
            ("allocsim replay t.jsonl (streamed): wall s", "#1f77b4", c.iter().map(|r| (num(&r[0]), num(&r[4]))).collect()),
            ("allocsim replay t.jsonl (streamed): peak RSS GiB", "#d62728", c.iter().map(|r| (num(&r[0]), num(&r[5]) / 1048576.0)).collect()),
            ("in memory: build + replay s", "#17becf", m.iter().map(|r| (num(&r[0]), num(&r[3]) + num(&r[4]))).collect()),
            ("in memory: peak RSS GiB", "#ff9896", m.iter().map(|r| (num(&r[0]), num(&r[7]) / 1048576.0)).collect()),
        ],
    };
    let right = Panel {
        title: "replay by live blocks (random, 4 M requests)",
        xlabel: "live blocks (bound of the random workload)",
        ylabel: "ns per request",
        series: vec![
            ("replay", "#2ca02c", v.iter().map(|r| (num(&r[1]), 1e9 / num(&r[6]))).collect()),
            ("program build", "#9467bd", v.iter().map(|r| (num(&r[1]), 1e9 * num(&r[4]) / num(&r[3]))).collect()),
        ],
    };
    let mut svg = String::new();
    let (w, h) = (960.0, 400.0);
    writeln!(svg, r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#)
        .unwrap();
    writeln!(svg, r#"<rect width="{w}" height="{h}" fill="white"/>"#).unwrap();
    panel(&mut svg, &left, 0.0, 480.0, h);
    panel(&mut svg, &right, 480.0, 480.0, h);
    svg.push_str("</svg>\n");
    print!("{svg}");
}

fn decades(lo: f64, hi: f64) -> (f64, f64) {
    (lo.log10().floor(), hi.log10().ceil().max(lo.log10().floor() + 1.0))
}

fn panel(svg: &mut String, p: &Panel<'_>, x0: f64, w: f64, h: f64) {
    let pts: Vec<(f64, f64)> = p.series.iter().flat_map(|s| s.2.iter().copied()).filter(|&(x, y)| x > 0.0 && y > 0.0).collect();
    let (xl, xh) = decades(pts.iter().map(|p| p.0).fold(f64::MAX, f64::min), pts.iter().map(|p| p.0).fold(0.0, f64::max));
    let (yl, yh) = decades(pts.iter().map(|p| p.1).fold(f64::MAX, f64::min), pts.iter().map(|p| p.1).fold(0.0, f64::max));
    let (ml, mr, mt, mb) = (60.0, 20.0, 40.0, 50.0);
    let (pw, ph) = (w - ml - mr, h - mt - mb);
    let sx = |x: f64| x0 + ml + (x.log10() - xl) / (xh - xl) * pw;
    let sy = |y: f64| mt + ph - (y.log10() - yl) / (yh - yl) * ph;
    writeln!(svg, r#"<text x="{}" y="22" text-anchor="middle" font-size="13" font-weight="bold">{}</text>"#, x0 + ml + pw / 2.0, p.title).unwrap();
    writeln!(svg, r##"<rect x="{}" y="{mt}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>"##, x0 + ml).unwrap();
    let mut d = xl;
    while d <= xh + 1e-9 {
        let x = sx(10f64.powf(d));
        writeln!(
            svg,
            r##"<line x1="{x:.1}" y1="{mt}" x2="{x:.1}" y2="{}" stroke="#ddd"/><text x="{x:.1}" y="{}" text-anchor="middle">1e{}</text>"##,
            mt + ph,
            mt + ph + 16.0,
            d as i64
        )
        .unwrap();
        d += 1.0;
    }
    let mut d = yl;
    while d <= yh + 1e-9 {
        let y = sy(10f64.powf(d));
        let label = if (0.0..6.0).contains(&d) { format!("{}", 10f64.powf(d) as u64) } else { format!("{}", 10f64.powf(d)) };
        writeln!(
            svg,
            r##"<line x1="{}" y1="{y:.1}" x2="{}" y2="{y:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{label}</text>"##,
            x0 + ml,
            x0 + ml + pw,
            x0 + ml - 4.0,
            y + 4.0
        )
        .unwrap();
        d += 1.0;
    }
    writeln!(svg, r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#, x0 + ml + pw / 2.0, h - 12.0, p.xlabel).unwrap();
    writeln!(svg, r#"<text transform="translate({},{}) rotate(-90)" text-anchor="middle">{}</text>"#, x0 + 16.0, mt + ph / 2.0, p.ylabel).unwrap();
    for (i, (label, colour, s)) in p.series.iter().enumerate() {
        let path: Vec<String> = s.iter().filter(|&&(x, y)| x > 0.0 && y > 0.0).map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y))).collect();
        writeln!(svg, r#"<polyline points="{}" fill="none" stroke="{colour}" stroke-width="2"/>"#, path.join(" ")).unwrap();
        for pt in &path {
            let (a, b) = pt.split_once(',').unwrap();
            writeln!(svg, r#"<circle cx="{a}" cy="{b}" r="3.5" fill="{colour}"/>"#).unwrap();
        }
        let ly = mt + 16.0 + 16.0 * i as f64;
        writeln!(
            svg,
            r#"<line x1="{}" y1="{ly}" x2="{}" y2="{ly}" stroke="{colour}" stroke-width="2"/><text x="{}" y="{}">{label}</text>"#,
            x0 + ml + 10.0,
            x0 + ml + 30.0,
            x0 + ml + 36.0,
            ly + 4.0
        )
        .unwrap();
    }
}
