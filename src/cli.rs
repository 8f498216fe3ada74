//! Command-line interface: `replay`, `validate`, `convert`.

use std::path::{Path, PathBuf};

use allocsim_model::constants::H200_TOTAL_MEMORY;
use allocsim_model::format::{format_size, oom_message};
use allocsim_model::{AllocatorConfig, Placement};
use allocsim_replay::{EmptyCacheCalls, Program, ReplayOptions, ReplayOutcome, plausible_placements, recorded_placement, replay};
use allocsim_trace::{Action, BlockState, Snapshot, SnapshotSegment, TraceEntry};
use clap::{Parser, Subcommand};
use serde_json::{Value, json};

use crate::size::parse_size;

#[derive(Parser)]
#[command(name = "allocsim", version, about = "Replays PyTorch CUDA caching-allocator snapshots through an exact model of the allocator (PyTorch 2.11 rules)")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args, Clone)]
struct ReplayArgs {
    /// A snapshot from `torch.cuda.memory._dump_snapshot()` (.pickle, .pickle.gz) or an allocsim .jsonl trace.
    trace: PathBuf,
    /// A `PYTORCH_CUDA_ALLOC_CONF` string (default: the settings recorded in the snapshot).
    #[arg(long)]
    config: Option<String>,
    /// The allowed maximum, as `set_per_process_memory_fraction` gives it: bytes or e.g. `24GiB`.
    #[arg(long, value_parser = parse_size)]
    capacity: Option<u64>,
    /// The device's total memory (for `per_process_memory_fraction` and expandable reservations).
    #[arg(long, value_parser = parse_size, default_value_t = H200_TOTAL_MEMORY)]
    device_memory: u64,
    /// The allowed maximum the trace itself was recorded under (to tell its `empty_cache()` calls
    /// from the releases its own OOM retries made). Default: `--capacity` when replaying under the
    /// trace's own settings, else none.
    #[arg(long, value_parser = parse_size)]
    trace_capacity: Option<u64>,
    /// Give new segments the addresses another recorded run of the same requests gave them.
    #[arg(long)]
    addresses_from: Option<PathBuf>,
    /// Also replay under N plausible segment placements and report each outcome.
    #[arg(long)]
    placements: Option<usize>,
    /// Which device's trace to replay (default: the first with entries).
    #[arg(long)]
    device: Option<usize>,
}

#[derive(Subcommand)]
enum Command {
    /// Replay a snapshot's requests and report what the allocator does.
    Replay {
        #[command(flatten)]
        args: ReplayArgs,
        /// Print one JSON object (stats, segment events, OOMs, placements).
        #[arg(long)]
        json: bool,
    },
    /// Replay a snapshot under its own settings and check every recorded segment event, OOM,
    /// allocation address and the final segments.
    Validate {
        trace: PathBuf,
        /// The allowed maximum the trace was recorded under.
        #[arg(long, value_parser = parse_size)]
        capacity: Option<u64>,
        #[arg(long, value_parser = parse_size, default_value_t = H200_TOTAL_MEMORY)]
        device_memory: u64,
        #[arg(long)]
        json: bool,
    },
    /// Convert between a snapshot pickle and allocsim's JSON Lines trace format.
    Convert {
        input: PathBuf,
        /// Output path; `.jsonl` writes JSON Lines.
        #[arg(short, long)]
        output: PathBuf,
    },
}

/// An error for the user: one line, exit code 2.
struct UserError(String);

impl<E: std::fmt::Display> From<E> for UserError {
    fn from(e: E) -> Self {
        UserError(e.to_string())
    }
}

pub fn main() -> i32 {
    let cli = Cli::parse();
    let r = match cli.command {
        Command::Replay { args, json } => cmd_replay(&args, json),
        Command::Validate { trace, capacity, device_memory, json } => cmd_validate(&trace, capacity, device_memory, json),
        Command::Convert { input, output } => cmd_convert(&input, &output),
    };
    match r {
        Ok(code) => code,
        Err(UserError(msg)) => {
            eprintln!("allocsim: error: {msg}");
            2
        }
    }
}

fn load(path: &Path) -> Result<Snapshot, UserError> {
    allocsim_trace::read_trace(path).map_err(|e| UserError(format!("{}: {e}", path.display())))
}

fn pick_device(snap: &Snapshot, device: Option<usize>) -> Result<usize, UserError> {
    match device {
        Some(d) if d < snap.device_traces.len() => Ok(d),
        Some(d) => Err(UserError(format!("the snapshot has no device {d} ({} device traces)", snap.device_traces.len()))),
        None => Ok(snap.device_traces.iter().position(|t| !t.is_empty()).unwrap_or(0)),
    }
}

/// The settings the snapshot was recorded under.
fn recorded_config(snap: &Snapshot) -> Result<AllocatorConfig, UserError> {
    let s = &snap.settings;
    match &s.alloc_conf {
        Some(conf) => AllocatorConfig::parse(conf)
            .map_err(|e| UserError(format!("the snapshot's recorded PYTORCH_CUDA_ALLOC_CONF {conf:?} is not valid for PyTorch 2.11: {e}"))),
        None => {
            // No settings string recorded: rebuild from the recorded values.
            let mut c = AllocatorConfig::default();
            if let Some(m) = s.max_split_size.filter(|&m| m > 0) {
                c.max_split_size = m as u64;
            }
            if let Some(g) = s.garbage_collection_threshold {
                c.garbage_collection_threshold = g;
            }
            if let Some(e) = s.expandable_segments {
                c.expandable_segments = e;
            }
            Ok(c)
        }
    }
}

fn same_settings(a: &AllocatorConfig, b: &AllocatorConfig) -> bool {
    let (mut a, mut b) = (a.clone(), b.clone());
    a.source.clear();
    b.source.clear();
    a == b
}

/// Everything one `replay` invocation computes.
struct Replayed {
    device: usize,
    program: Program,
    options: ReplayOptions,
    outcome: ReplayOutcome,
    placements: Vec<(String, ReplayOutcome)>,
    trace: Vec<TraceEntry>,
    /// The snapshot's final segments of this device.
    segments: Vec<SnapshotSegment>,
}

fn run_replay(args: &ReplayArgs) -> Result<Replayed, UserError> {
    let snap = load(&args.trace)?;
    let device = pick_device(&snap, args.device)?;
    let trace = snap.device_traces.get(device).cloned().unwrap_or_default();
    let segments: Vec<_> = snap.segments.iter().filter(|s| s.device == device as i64).cloned().collect();
    let own = recorded_config(&snap)?;
    let config = match &args.config {
        Some(c) => AllocatorConfig::parse(c).map_err(|e| UserError(format!("--config {c:?}: {e}")))?,
        None => own.clone(),
    };
    let program = Program::build(&trace, &segments);
    let own_settings = same_settings(&config, &own);
    let placement = match &args.addresses_from {
        Some(p) => {
            let other = load(p)?;
            let t = other.device_traces.get(device).map(|v| v.as_slice()).unwrap_or(&[]);
            recorded_placement(t, args.device_memory)
        }
        None => recorded_placement(&trace, args.device_memory),
    };
    let options = ReplayOptions { config, capacity: args.capacity, device_memory: args.device_memory, placement };
    // Where were the empty_cache() calls? Decided under the trace's own settings and addresses.
    let trace_capacity = args.trace_capacity.or(if own_settings { args.capacity } else { None });
    let infer_opts = ReplayOptions {
        config: own.clone(),
        capacity: trace_capacity,
        device_memory: args.device_memory,
        placement: recorded_placement(&trace, args.device_memory),
    };
    let self_run = own_settings && trace_capacity == args.capacity && args.addresses_from.is_none();
    let (outcome, flags) = if self_run {
        let o = replay(&program, &options, EmptyCacheCalls::Infer(&trace));
        let f = o.empty_cache.clone();
        (o, f)
    } else {
        let inferred = replay(&program, &infer_opts, EmptyCacheCalls::Infer(&trace));
        let f = inferred.empty_cache;
        (replay(&program, &options, EmptyCacheCalls::Given(&f)), f)
    };
    let mut placements = Vec::new();
    if let Some(n) = args.placements {
        let list = plausible_placements(&trace, args.device_memory, n);
        placements = std::thread::scope(|s| {
            let handles: Vec<_> = list
                .into_iter()
                .map(|(name, pl)| {
                    let mut o = options.clone();
                    o.placement = pl;
                    let (program, flags) = (&program, &flags);
                    s.spawn(move || (name, replay(program, &o, EmptyCacheCalls::Given(flags))))
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("placement replay panicked")).collect()
        });
    }
    Ok(Replayed { device, program, options, outcome, placements, trace, segments })
}

fn oom_json(r: &Replayed, o: &allocsim_replay::replay::Oom) -> Value {
    let req = &r.program.requests[o.request as usize];
    json!({
        "request": o.request,
        "size": o.info.rounded_size,
        "orig_size": o.info.orig_size,
        "alloc_size": o.info.alloc_size,
        "stream": o.info.stream,
        "pool": if o.info.is_small { "small" } else { "large" },
        "recorded_oom": req.recorded_oom,
        "trace_index": req.trace_index,
        "message": oom_message(&o.info, r.device as i32, ""),
    })
}

fn cmd_replay(args: &ReplayArgs, as_json: bool) -> Result<i32, UserError> {
    let r = run_replay(args)?;
    let o = &r.outcome;
    let empty_cache_requests: Vec<u32> = empty_cache_requests(&r.program, &o.empty_cache);
    let placement_independent = r.options.config.expandable_segments;
    if as_json {
        let placements: Vec<Value> = r
            .placements
            .iter()
            .map(|(name, p)| json!({"name": name, "first_oom": p.first_oom(), "peak_reserved": p.peak_reserved, "ooms": p.ooms.len()}))
            .collect();
        let out = json!({
            "trace": args.trace.display().to_string(),
            "device": r.device,
            "config": r.options.config.source,
            "capacity": r.options.capacity,
            "requests": r.program.requests.len(),
            "stats": o.stats.to_memory_stats(),
            "segment_events": o.segment_events,
            "ooms": o.ooms.iter().map(|x| oom_json(&r, x)).collect::<Vec<_>>(),
            "first_oom": o.first_oom(),
            "empty_cache_calls": empty_cache_requests,
            "unknown_frees": r.program.unknown_frees,
            "placements": if args.placements.is_some() { Value::from(placements) } else { Value::Null },
            "placement_independent": placement_independent,
        });
        println!("{}", serde_json::to_string(&out).expect("JSON"));
        return Ok(0);
    }
    let s = &o.stats;
    let conf = if r.options.config.source.is_empty() { "(defaults)".to_string() } else { r.options.config.source.clone() };
    println!("{}: device {}, {} requests, config {conf}", args.trace.display(), r.device, r.program.requests.len());
    if let Some(c) = r.options.capacity {
        println!("  allowed maximum      {} ({c} bytes)", format_size(c));
    }
    println!(
        "  peak reserved        {}   peak allocated {}   peak active {}",
        format_size(s.reserved_bytes.all().peak as u64),
        format_size(s.allocated_bytes.all().peak as u64),
        format_size(s.active_bytes.all().peak as u64)
    );
    println!(
        "  at end               reserved {} in {} segments, allocated {}",
        format_size(s.reserved_bytes.all().current as u64),
        s.segment.all().current,
        format_size(s.allocated_bytes.all().current as u64)
    );
    println!(
        "  device calls         {} alloc/map, {} free/unmap; {} retries, {} OOMs, {} full synchronizations",
        s.num_device_alloc, s.num_device_free, s.num_alloc_retries, s.num_ooms, s.num_sync_all_streams
    );
    if !empty_cache_requests.is_empty() {
        println!("  empty_cache() calls  {} (inferred from the trace's releases)", empty_cache_requests.len());
    }
    if r.program.unknown_frees > 0 {
        println!("  note: {} frees of blocks allocated before the trace began were ignored (the trace starts mid-history)", r.program.unknown_frees);
    }
    for x in o.ooms.iter().take(5) {
        let req = &r.program.requests[x.request as usize];
        println!(
            "  OOM at request {} ({} on stream {}{}):",
            x.request,
            format_size(req.size),
            req.stream,
            if req.recorded_oom { ", also an OOM in the trace" } else { "" }
        );
        println!("    {}", oom_message(&x.info, r.device as i32, ""));
    }
    if o.ooms.len() > 5 {
        println!("  ... {} more OOMs", o.ooms.len() - 5);
    }
    if !r.placements.is_empty() {
        let peaks: Vec<u64> = r.placements.iter().filter(|(_, p)| p.first_oom().is_none()).map(|(_, p)| p.peak_reserved).collect();
        let n_oom = r.placements.iter().filter(|(_, p)| p.first_oom().is_some()).count();
        if placement_independent {
            println!("  placements           expandable segments: decisions do not depend on segment addresses");
        }
        match (peaks.iter().min(), peaks.iter().max()) {
            (Some(lo), Some(hi)) => println!(
                "  placements           peak reserved {}–{} across {} placements; OOM in {} of {}",
                format_size(*lo),
                format_size(*hi),
                r.placements.len(),
                n_oom,
                r.placements.len()
            ),
            _ => println!("  placements           OOM in {n_oom} of {}", r.placements.len()),
        }
        for (name, p) in &r.placements {
            println!(
                "    {name:<12} peak reserved {:>12}  first OOM {}",
                format_size(p.peak_reserved),
                p.first_oom().map_or("none".to_string(), |x| format!("request {x}"))
            );
        }
    }
    let _ = &r.trace;
    Ok(0)
}

fn empty_cache_requests(program: &Program, flags: &[bool]) -> Vec<u32> {
    let mut next = 0u32;
    let mut out = Vec::new();
    for (op, &f) in program.ops.iter().zip(flags) {
        match *op {
            allocsim_replay::Op::Malloc(r) => next = r + 1,
            _ if f => out.push(next),
            _ => {}
        }
    }
    out
}

fn cmd_validate(path: &Path, capacity: Option<u64>, device_memory: u64, as_json: bool) -> Result<i32, UserError> {
    let args = ReplayArgs {
        trace: path.to_path_buf(),
        config: None,
        capacity,
        device_memory,
        trace_capacity: None,
        addresses_from: None,
        placements: None,
        device: None,
    };
    let r = run_replay(&args)?;
    let v = crate::cli::validate_report(&r);
    if as_json {
        println!("{}", serde_json::to_string(&v).expect("JSON"));
    } else {
        println!("{}: validation against the recording (device {})", path.display(), r.device);
        for key in ["segment_events", "ooms", "alloc_addresses", "final_segments"] {
            let x = &v[key];
            println!("  {key:<16} {}/{} match{}", x["matched"], x["recorded"], x["first_divergence"].as_str().map(|s| format!("; first divergence: {s}")).unwrap_or_default());
        }
    }
    Ok(if v["exact"].as_bool() == Some(true) { 0 } else { 1 })
}

/// Compares a self replay with its recording.
fn validate_report(r: &Replayed) -> Value {
    let o = &r.outcome;
    // Segment events, in order, with the request ordinal.
    let mut recorded = Vec::new();
    let mut req = 0u32;
    let mut recorded_ooms = Vec::new();
    for e in &r.trace {
        match e.action {
            Action::SegmentAlloc | Action::SegmentFree | Action::SegmentMap | Action::SegmentUnmap => {
                recorded.push((req, e.action.as_str(), e.addr, e.size))
            }
            Action::Alloc => req += 1,
            Action::Oom => {
                recorded_ooms.push(req);
                req += 1
            }
            _ => {}
        }
    }
    let sim: Vec<_> = o.segment_events.iter().map(|e| (e.request, e.action, e.addr, e.size)).collect();
    let seg_matched = recorded.iter().zip(&sim).take_while(|(a, b)| a == b).count();
    let seg_div = (seg_matched < recorded.len().max(sim.len())).then(|| {
        format!(
            "event {seg_matched}: recorded {} vs simulated {}",
            recorded.get(seg_matched).map_or("nothing".into(), |x| format!("{} {} bytes at {:#x} (request {})", x.1, x.3, x.2, x.0)),
            sim.get(seg_matched).map_or("nothing".into(), |x| format!("{} {} bytes at {:#x} (request {})", x.1, x.3, x.2, x.0))
        )
    });
    let sim_ooms: Vec<u32> = o.ooms.iter().map(|x| x.request).collect();
    let oom_matched = recorded_ooms.iter().filter(|x| sim_ooms.contains(x)).count();
    let oom_div = (recorded_ooms != sim_ooms).then(|| format!("recorded OOMs at requests {recorded_ooms:?}, simulated at {sim_ooms:?}"));
    let mut addr_total = 0;
    let mut addr_ok = 0;
    let mut addr_div = None;
    for (i, q) in r.program.requests.iter().enumerate() {
        if q.recorded_oom {
            continue;
        }
        addr_total += 1;
        if o.addresses[i] == Some(q.recorded_addr) {
            addr_ok += 1;
        } else if addr_div.is_none() {
            addr_div = Some(format!("request {i}: recorded {:#x}, simulated {}", q.recorded_addr, o.addresses[i].map_or("OOM".into(), |a| format!("{a:#x}"))));
        }
    }
    // Final segments: (address, total_size, [(block size, state)]).
    let (seg_total, seg_ok, seg_final_div) = compare_final_segments(r);
    let exact = seg_div.is_none() && oom_div.is_none() && addr_div.is_none() && seg_final_div.is_none();
    json!({
        "exact": exact,
        "segment_events": {"recorded": recorded.len(), "simulated": sim.len(), "matched": seg_matched, "first_divergence": seg_div},
        "ooms": {"recorded": recorded_ooms.len(), "simulated": sim_ooms.len(), "matched": oom_matched, "first_divergence": oom_div},
        "alloc_addresses": {"recorded": addr_total, "matched": addr_ok, "first_divergence": addr_div},
        "final_segments": {"recorded": seg_total, "matched": seg_ok, "first_divergence": seg_final_div},
    })
}

/// Compares the snapshot's final segments (address, size, and each block's size and state) with
/// the model's.
fn compare_final_segments(r: &Replayed) -> (usize, usize, Option<String>) {
    let a = &r.outcome.allocator;
    let sim: Vec<(u64, u64, Vec<(u64, BlockState)>)> = a
        .segments()
        .into_iter()
        .map(|s| {
            let blocks = s
                .blocks
                .iter()
                .map(|&id| {
                    let b = a.block(id);
                    let st = if b.allocated {
                        BlockState::ActiveAllocated
                    } else if b.event_count > 0 {
                        BlockState::ActivePendingFree
                    } else {
                        BlockState::Inactive
                    };
                    (b.size, st)
                })
                .collect();
            (s.address, s.total_size, blocks)
        })
        .collect();
    let rec: Vec<(u64, u64, Vec<(u64, BlockState)>)> =
        r.segments.iter().map(|s| (s.address, s.total_size, s.blocks.iter().map(|b| (b.size, b.state)).collect())).collect();
    let ok = rec.iter().filter(|s| sim.contains(s)).count();
    let div = if rec == sim {
        None
    } else {
        let i = rec.iter().zip(&sim).take_while(|(x, y)| x == y).count();
        Some(format!(
            "segment {i}: recorded {}, simulated {} ({} recorded, {} simulated segments)",
            rec.get(i).map_or("none".into(), |s| format!("{:#x} ({} bytes, {} blocks)", s.0, s.1, s.2.len())),
            sim.get(i).map_or("none".into(), |s| format!("{:#x} ({} bytes, {} blocks)", s.0, s.1, s.2.len())),
            rec.len(),
            sim.len()
        ))
    };
    (rec.len(), ok, div)
}

fn cmd_convert(input: &Path, output: &Path) -> Result<i32, UserError> {
    let snap = load(input)?;
    let ext = output.extension().and_then(|e| e.to_str()).unwrap_or("");
    if ext != "jsonl" {
        return Err(UserError(format!("{}: only .jsonl output is supported (JSON Lines trace)", output.display())));
    }
    let f = std::fs::File::create(output).map_err(|e| UserError(format!("{}: {e}", output.display())))?;
    let mut w = std::io::BufWriter::new(f);
    allocsim_trace::jsonl::write(&snap, &mut w).map_err(|e| UserError(format!("{}: {e}", output.display())))?;
    let n: usize = snap.device_traces.iter().map(|t| t.len()).sum();
    eprintln!("wrote {} ({} trace entries, {} segments)", output.display(), n, snap.segments.len());
    Ok(0)
}

#[allow(dead_code)]
fn unused(_: Placement) {}
