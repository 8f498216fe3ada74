//! Data-driven check of the model against the scripted probe cases run on the real allocator
//! (torch 2.11.0+cu130, one H200): `shared/reference/probe-cases/oracle_cases_2.11.json` and
//! `oracle_cases_extra_2.11.json` (scripts in `cases.json` / `cases_extra.json`, see that
//! directory's README.md).
//!
//! Every case the model can express is replayed op by op, and at every step the model is compared
//! with what the real allocator did:
//! * each allocation's pointer (`ptr`) and each OOM (`exception`, the message up to NVML's
//!   per-process text, which is taken from the recorded message, as is `device_free`);
//! * at each `state` op: the segment layout (address, total size, type, expandable, stream, pool,
//!   allocated/active/requested sums and every block's `[size, requested_size, state]`) and every
//!   stat key the oracle recorded;
//! * at each `snapshot` op: the snapshot's segments, and (when history was recorded from the start
//!   and the ring did not wrap) the trace's `segment_alloc/segment_free/segment_map/segment_unmap`
//!   (addr + size) and `oom` (rounded size) entries against the model's `events`, in order;
//! * `final_stats` at the end; `check_invariants()` after every op;
//! * config-error cases (`err_*`): `AllocatorConfig::parse` returns the recorded message (without
//!   the `ValueError: ` prefix).
//!
//! MemPool and CUDA-graph ops drive the private-pool calls PyTorch makes for them:
//! * `pool_enter` (first use of a pool: `torch.cuda.MemPool(use_on_oom, no_split)`, that is
//!   `create_or_incref_pool`, `set_use_on_oom`, `set_no_split`; then `use_mem_pool`:
//!   `begin_allocate_to_pool` with the calling thread's filter), `pool_exit`
//!   (`end_allocate_to_pool` + `release_pool`), `pool_del` (`MemPool::~MemPool`:
//!   `release_pool` + `emptyCache(id)`);
//! * `graph` (`torch.cuda.graph`: `empty_cache()`, the capture's two 8-byte generator-state
//!   tensors in the default pool on the capture stream, `begin_allocate_to_pool` with the capture
//!   stream's filter, the listed allocations, all but the last (the graph's output) freed in
//!   reverse, `end_allocate_to_pool`), `graph_del` (the output and the generator-state tensors
//!   freed, `release_pool`). The capture stream is read off the recorded trace.
//!
//! Cases in [`KNOWN_FAILURES`] are known disagreements between the model and the recorded truth;
//! they are reported but do not fail the test. Remove an entry once the model is fixed (the test
//! prints a note when a listed case passes).
//!
//! Run: `cargo test -p allocsim-model --test probe_cases -- --nocapture` to see the report.

use std::collections::{BTreeMap, HashMap};

use allocsim_model::allocator::{Block, SegmentView};
use allocsim_model::constants::{MIB, ROUNDUP_INTERVALS};
use allocsim_model::format::oom_message;
use allocsim_model::{AllocatorConfig, BlockId, CachingAllocator, EventKind, Placement, PoolFilter, Route, SimDevice};
use serde_json::Value;

#[path = "../../../tests/support/reference.rs"]
mod reference;

const ORACLE_FILES: &[&str] = &["oracle_cases_2.11.json", "oracle_cases_extra_2.11.json"];

/// Cases where the model disagrees with the recorded truth: (case name, diagnosis). The test
/// reports them but passes. Remove an entry when the model is fixed.
const KNOWN_FAILURES: &[(&str, &str)] = &[];

/// Cases the model expresses: all of them.
const EXPRESSIBLE_CASES: usize = reference::PROBE_CASES;

/// At most this many mismatch lines are kept per case.
const MAX_MISMATCHES: usize = 40;

type Alloc = CachingAllocator<SimDevice>;

// ---------------------------------------------------------------------------------------------
// Config: the real parser, cross-checked by a minimal stand-in.
// ---------------------------------------------------------------------------------------------

/// True once `AllocatorConfig::parse` accepts non-empty settings strings.
fn parser_ready() -> bool {
    AllocatorConfig::parse("expandable_segments:True").is_ok()
}

/// A minimal stand-in for `AllocatorConfig::apply` that sets the fields for the settings strings
/// the probe cases use (spec §11: whitespace dropped; every parse resets `max_split_size`,
/// `roundup_power2_divisions`, `garbage_collection_threshold` and `max_non_split_rounding_size`
/// (to `large_segment_size`, parsed in a pre-pass); other keys keep their value).
/// It cross-checks the decision fields `parse`/`apply` produce, and builds the configs by itself
/// should `parse` reject non-empty strings (then the `err_*` cases are skipped).
fn fallback_apply(cfg: &mut AllocatorConfig, conf: &str) -> Result<(), String> {
    let s: String = conf.chars().filter(|c| !c.is_whitespace()).collect();
    let mut items: Vec<(String, String)> = Vec::new();
    let (mut depth, mut cur) = (0i32, String::new());
    for ch in s.chars().chain(std::iter::once(',')) {
        match ch {
            '[' => {
                depth += 1;
                cur.push(ch)
            }
            ']' => {
                depth -= 1;
                cur.push(ch)
            }
            ',' if depth == 0 => {
                if !cur.is_empty() {
                    let (k, v) = cur.split_once(':').ok_or_else(|| format!("no ':' in {cur:?}"))?;
                    items.push((k.to_string(), v.to_string()));
                }
                cur.clear();
            }
            _ => cur.push(ch),
        }
    }
    let num = |v: &str| v.parse::<u64>().map_err(|e| format!("{v:?}: {e}"));
    for (k, v) in &items {
        if k == "large_segment_size_mb" {
            cfg.large_segment_size = num(v)? * MIB;
        }
    }
    cfg.max_split_size = u64::MAX;
    cfg.roundup_power2_divisions = [0; ROUNDUP_INTERVALS];
    cfg.garbage_collection_threshold = 0.0;
    cfg.max_non_split_rounding_size = cfg.large_segment_size;
    for (k, v) in &items {
        match k.as_str() {
            "large_segment_size_mb" => {}
            "max_split_size_mb" => cfg.max_split_size = num(v)? * MIB,
            "max_non_split_rounding_mb" => cfg.max_non_split_rounding_size = num(v)? * MIB,
            "garbage_collection_threshold" => cfg.garbage_collection_threshold = v.parse().map_err(|e| format!("{e}"))?,
            "per_process_memory_fraction" => cfg.per_process_memory_fraction = Some(v.parse().map_err(|e| format!("{e}"))?),
            "expandable_segments" => {
                cfg.expandable_segments = match v.as_str() {
                    "True" => true,
                    "False" => false,
                    _ => return Err(format!("bad bool {v:?}")),
                }
            }
            "roundup_power2_divisions" => {
                if let Some(list) = v.strip_prefix('[').and_then(|x| x.strip_suffix(']')) {
                    let mut first = true;
                    let mut last_index = 0usize;
                    for entry in list.split(',') {
                        let (kk, vv) = entry.split_once(':').ok_or("bad list entry")?;
                        let val = num(vv)?;
                        if kk == ">" {
                            for e in last_index + 1..ROUNDUP_INTERVALS {
                                cfg.roundup_power2_divisions[e] = val;
                            }
                        } else {
                            let mb = num(kk)?;
                            let index = (63 - mb.max(1).leading_zeros() as usize).min(ROUNDUP_INTERVALS - 1);
                            if first {
                                for e in 0..index {
                                    cfg.roundup_power2_divisions[e] = val;
                                }
                                first = false;
                            }
                            cfg.roundup_power2_divisions[index] = val;
                            last_index = index;
                        }
                    }
                } else {
                    cfg.roundup_power2_divisions = [num(v)?; ROUNDUP_INTERVALS];
                }
            }
            other => return Err(format!("stand-in parser: unknown key {other:?}")),
        }
    }
    cfg.source = conf.to_string();
    Ok(())
}

/// The decision-relevant fields of a config, for the parser cross-check.
fn config_key(c: &AllocatorConfig) -> String {
    format!(
        "max_split_size={} max_non_split_rounding_size={} roundup={:?} gc={} expandable={} large_segment_size={} fraction={:?}",
        c.max_split_size,
        c.max_non_split_rounding_size,
        c.roundup_power2_divisions,
        c.garbage_collection_threshold,
        c.expandable_segments,
        c.large_segment_size,
        c.per_process_memory_fraction
    )
}

// ---------------------------------------------------------------------------------------------
// Comparable segment layouts
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Debug, PartialEq)]
struct Seg {
    addr: u64,
    total: u64,
    ty: String,
    exp: bool,
    stream: u64,
    pool: (i64, i64),
    alloc: u64,
    active: u64,
    req: u64,
    blocks: Vec<(u64, u64, String)>,
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("expected an unsigned integer, got {v}"))
}
fn pair(v: &Value) -> (i64, i64) {
    (v[0].as_i64().unwrap(), v[1].as_i64().unwrap())
}

/// A `segs` entry of a `state` op.
fn seg_from_state(s: &Value) -> Seg {
    Seg {
        addr: u(&s["addr"]),
        total: u(&s["total"]),
        ty: s["type"].as_str().unwrap().to_string(),
        exp: s["exp"].as_bool().unwrap(),
        stream: u(&s["stream"]),
        pool: pair(&s["pool"]),
        alloc: u(&s["alloc"]),
        active: u(&s["active"]),
        req: u(&s["req"]),
        blocks: s["blocks"].as_array().unwrap().iter().map(|b| (u(&b[0]), u(&b[1]), b[2].as_str().unwrap().to_string())).collect(),
    }
}

/// A segment of a raw snapshot.
fn seg_from_snapshot(s: &Value) -> Seg {
    Seg {
        addr: u(&s["address"]),
        total: u(&s["total_size"]),
        ty: s["segment_type"].as_str().unwrap().to_string(),
        exp: s["is_expandable"].as_bool().unwrap(),
        stream: u(&s["stream"]),
        pool: pair(&s["segment_pool_id"]),
        alloc: u(&s["allocated_size"]),
        active: u(&s["active_size"]),
        req: u(&s["requested_size"]),
        blocks: s["blocks"].as_array().unwrap().iter().map(|b| (u(&b["size"]), u(&b["requested_size"]), b["state"].as_str().unwrap().to_string())).collect(),
    }
}

fn block_state(b: &Block) -> &'static str {
    if b.allocated {
        "active_allocated"
    } else if b.event_count > 0 {
        "active_pending_free"
    } else {
        "inactive"
    }
}

fn seg_from_model(a: &Alloc, s: &SegmentView) -> Seg {
    let mut seg = Seg {
        addr: s.address,
        total: s.total_size,
        ty: if s.is_small { "small" } else { "large" }.to_string(),
        exp: s.is_expandable,
        stream: s.stream,
        pool: s.pool_id,
        alloc: 0,
        active: 0,
        req: 0,
        blocks: Vec::new(),
    };
    for &id in &s.blocks {
        let b = a.block(id);
        let st = block_state(b);
        if b.allocated {
            seg.alloc += b.size;
        }
        if st != "inactive" {
            seg.active += b.size;
            seg.req += b.requested_size;
        }
        seg.blocks.push((b.size, b.requested_size, st.to_string()));
    }
    seg
}

fn fmt_blocks(blocks: &[(u64, u64, String)]) -> String {
    let v: Vec<String> = blocks.iter().map(|(s, r, st)| format!("[{s},{r},{st}]")).collect();
    v.join(" ")
}

fn fmt_seg(s: &Seg) -> String {
    format!(
        "{{addr {:#x} total {} {}{} stream {} pool {:?} alloc {} active {} req {} blocks {}}}",
        s.addr,
        s.total,
        s.ty,
        if s.exp { " expandable" } else { "" },
        s.stream,
        s.pool,
        s.alloc,
        s.active,
        s.req,
        fmt_blocks(&s.blocks)
    )
}

/// Compares two layouts; appends one line per difference to `out` (prefixed with `at`).
fn compare_segments(at: &str, recorded: &[Seg], model: &[Seg], out: &mut Vec<String>) {
    let model_by_addr: BTreeMap<u64, &Seg> = model.iter().map(|s| (s.addr, s)).collect();
    let rec_by_addr: BTreeMap<u64, &Seg> = recorded.iter().map(|s| (s.addr, s)).collect();
    for r in recorded {
        let Some(m) = model_by_addr.get(&r.addr) else {
            out.push(format!("{at}: recorded segment {} missing from the model", fmt_seg(r)));
            continue;
        };
        let mut diffs = Vec::new();
        if r.total != m.total {
            diffs.push(format!("total_size recorded {} vs model {}", r.total, m.total));
        }
        if r.ty != m.ty {
            diffs.push(format!("type recorded {} vs model {}", r.ty, m.ty));
        }
        if r.exp != m.exp {
            diffs.push(format!("is_expandable recorded {} vs model {}", r.exp, m.exp));
        }
        if r.stream != m.stream {
            diffs.push(format!("stream recorded {} vs model {}", r.stream, m.stream));
        }
        if r.pool != m.pool {
            diffs.push(format!("pool recorded {:?} vs model {:?}", r.pool, m.pool));
        }
        if r.alloc != m.alloc {
            diffs.push(format!("allocated_size recorded {} vs model {}", r.alloc, m.alloc));
        }
        if r.active != m.active {
            diffs.push(format!("active_size recorded {} vs model {}", r.active, m.active));
        }
        if r.req != m.req {
            diffs.push(format!("requested_size recorded {} vs model {}", r.req, m.req));
        }
        if r.blocks != m.blocks {
            let only_stale_req =
                r.blocks.len() == m.blocks.len() && r.blocks.iter().zip(&m.blocks).all(|(x, y)| x.0 == y.0 && x.2 == y.2 && (x.1 == y.1 || x.2 == "inactive"));
            let mut first = String::new();
            for (i, (x, y)) in r.blocks.iter().zip(&m.blocks).enumerate() {
                if x != y {
                    first = format!("; first difference at block {i}: recorded [{},{},{}] vs model [{},{},{}]", x.0, x.1, x.2, y.0, y.1, y.2);
                    break;
                }
            }
            diffs.push(format!(
                "blocks differ{}{first}: recorded {} vs model {}",
                if only_stale_req { " (ONLY the stale requested_size of inactive blocks)" } else { "" },
                fmt_blocks(&r.blocks),
                fmt_blocks(&m.blocks)
            ));
        }
        for d in diffs {
            out.push(format!("{at}: segment {:#x}: {d}", r.addr));
        }
    }
    for m in model {
        if !rec_by_addr.contains_key(&m.addr) {
            out.push(format!("{at}: model has segment {} that the real allocator did not have", fmt_seg(m)));
        }
    }
}

fn compare_stats(at: &str, recorded: &Value, a: &Alloc, out: &mut Vec<String>) {
    let model = a.stats.to_memory_stats();
    for (k, v) in recorded.as_object().unwrap() {
        let want = v.as_i64().unwrap();
        match model.get(k) {
            None => out.push(format!("{at}: stat {k} recorded {want}, missing from the model's memory_stats()")),
            Some(&got) if got != want => out.push(format!("{at}: stat {k} recorded {want} vs model {got}")),
            _ => {}
        }
    }
}

// ---------------------------------------------------------------------------------------------
// What the recorded run tells us beyond the ops: addresses, stream values, event timing.
// ---------------------------------------------------------------------------------------------

fn op_of(ev: &Value) -> (&str, &[Value]) {
    let op = ev["op"].as_array().expect("op is an array");
    (op[0].as_str().expect("op name"), &op[1..])
}

/// The `history` op that starts recording: (op index, max_entries, actions skipped, records
/// everything (`enabled='all'`)).
fn history_start(events: &[Value]) -> Option<(usize, u64, Vec<String>, bool)> {
    for (i, ev) in events.iter().enumerate() {
        let (name, args) = op_of(ev);
        match name {
            "history" => return Some((i, u(&args[0]), vec![], true)),
            "history_skip" => {
                let skip = args[1].as_array().unwrap().iter().map(|x| x.as_str().unwrap().to_string()).collect();
                return Some((i, u(&args[0]), skip, true));
            }
            "history_mode" => return Some((i, u(&args[3]), vec![], args[0].as_str() == Some("all"))),
            _ => {}
        }
    }
    None
}

/// The trace of the last `snapshot` op: (op index, entries).
fn last_trace(events: &[Value]) -> Option<(usize, &Vec<Value>)> {
    events.iter().enumerate().rev().find_map(|(i, ev)| {
        let tr = ev.get("snapshot")?.get("device_traces")?.get(0)?.as_array()?;
        Some((i, tr))
    })
}

/// Whether the last snapshot's trace holds every entry since the start of the case.
fn trace_complete(events: &[Value]) -> Option<(usize, usize, Vec<String>)> {
    let (h, max_entries, skip, all) = history_start(events)?;
    let (si, trace) = last_trace(events)?;
    if !all || h != 0 || trace.len() as u64 >= max_entries || si < h {
        return None;
    }
    Some((h, si, skip))
}

/// Recorded addresses for `Placement::Recorded`: segment_alloc (addr, size) in order from the
/// trace, then every other non-expandable segment seen in `segs` / snapshots in order of first
/// appearance; reservation bases = the first segment_map of each expandable reservation.
fn recorded_placement(events: &[Value], total: u64) -> Placement {
    let mut segments: Vec<(u64, u64)> = Vec::new();
    let mut reservations: Vec<u64> = Vec::new();
    // An expandable reservation is max_handles × page with max_handles = ceil((t + t/8) / page)
    // (spec §7.1): every page of it starts below base + t + t/8, and the next reservation starts
    // at or above that.
    let reservation_span = total + total / 8;
    if let Some((_, trace)) = last_trace(events) {
        for t in trace {
            let (addr, size) = (t["addr"].as_u64().unwrap_or(0), u(&t["size"]));
            match t["action"].as_str().unwrap() {
                "segment_alloc" => segments.push((addr, size)),
                "segment_map" if !reservations.iter().any(|&b| addr >= b && addr < b + reservation_span) => {
                    reservations.push(addr);
                }
                _ => {}
            }
        }
    }
    for ev in events {
        let mut segs: Vec<Seg> = ev.get("segs").and_then(|s| s.as_array()).map(|v| v.iter().map(seg_from_state).collect()).unwrap_or_default();
        if let Some(ss) = ev.get("snapshot").and_then(|s| s.get("segments")).and_then(|s| s.as_array()) {
            segs.extend(ss.iter().map(seg_from_snapshot));
        }
        for s in segs {
            if s.exp {
                if !reservations.iter().any(|&b| s.addr >= b && s.addr < b + reservation_span) {
                    reservations.push(s.addr);
                }
            } else if !segments.contains(&(s.addr, s.total)) {
                segments.push((s.addr, s.total));
            }
        }
    }
    Placement::Recorded { segments, reservations }
}

/// The raw `cudaStream_t` of each side-stream name, from where its allocations landed.
fn stream_values(events: &[Value]) -> HashMap<String, u64> {
    let mut out = HashMap::new();
    let mut synthetic = 0x5eed_0000u64;
    let all_segs: Vec<Seg> = events
        .iter()
        .flat_map(|ev| {
            let mut v: Vec<Seg> = ev.get("segs").and_then(|s| s.as_array()).map(|v| v.iter().map(seg_from_state).collect()).unwrap_or_default();
            if let Some(ss) = ev.get("snapshot").and_then(|s| s.get("segments")).and_then(|s| s.as_array()) {
                v.extend(ss.iter().map(seg_from_snapshot));
            }
            v
        })
        .collect();
    let trace_allocs: Vec<(u64, u64)> =
        last_trace(events).map(|(_, tr)| tr.iter().filter(|t| t["action"] == "alloc").map(|t| (u(&t["addr"]), u(&t["stream"]))).collect()).unwrap_or_default();
    for ev in events {
        let (name, args) = op_of(ev);
        let s = match name {
            "alloc_s" => args[2].as_str().unwrap(),
            "record_stream" => args[1].as_str().unwrap(),
            "sleep" => args[0].as_str().unwrap(),
            _ => continue,
        };
        if out.contains_key(s) && name != "alloc_s" {
            continue;
        }
        let mut value = None;
        if name == "alloc_s"
            && let Some(ptr) = ev.get("ptr").and_then(|p| p.as_u64())
        {
            value = trace_allocs
                .iter()
                .find(|&&(a, _)| a == ptr)
                .map(|&(_, s)| s)
                .or_else(|| all_segs.iter().find(|sg| sg.addr <= ptr && ptr < sg.addr + sg.total && sg.stream != 0).map(|sg| sg.stream));
        }
        match value {
            Some(v) => {
                out.insert(s.to_string(), v);
            }
            None => {
                out.entry(s.to_string()).or_insert_with(|| {
                    synthetic += 0x100;
                    synthetic
                });
            }
        }
    }
    out
}

/// The stream a `graph` op captured on: the stream of the first recorded allocation on a stream
/// no `alloc_s` names (the capture stream is torch's own side stream).
fn capture_stream(events: &[Value]) -> u64 {
    let named: Vec<u64> = stream_values(events).into_values().collect();
    last_trace(events)
        .and_then(|(_, tr)| tr.iter().filter(|t| t["action"] == "alloc").map(|t| u(&t["stream"])).find(|&s| s != 0 && !named.contains(&s)))
        .expect("a graph case's trace shows its capture stream")
}

/// For each cross-stream free (free after record_stream), the op index of the malloc at whose
/// start its events had completed (the real allocator's `process_events`), read off the recorded
/// trace; `None` = completed by a synchronize the model performs itself (empty_cache), or never.
/// Falls back to "the next malloc after the free" without a usable trace.
fn pending_completions(events: &[Value], pending_free_ops: &[usize]) -> HashMap<usize, Option<usize>> {
    let is_malloc = |i: usize| matches!(op_of(&events[i]).0, "alloc" | "alloc_s");
    let next_malloc = |f: usize| (f + 1..events.len()).find(|&i| is_malloc(i));
    let fallback: HashMap<usize, Option<usize>> = pending_free_ops.iter().map(|&f| (f, next_malloc(f))).collect();
    let Some((h, si, skip)) = trace_complete(events) else { return fallback };
    if ["alloc", "oom", "free_requested", "free_completed", "snapshot"].iter().any(|a| skip.iter().any(|s| s == a)) {
        return fallback;
    }
    let trace = last_trace(events).unwrap().1;
    // Anchors: each op's own trace entry.
    let mut anchors: Vec<(usize, &str)> = Vec::new();
    for (i, ev) in events.iter().enumerate().take(si).skip(h) {
        let a = match op_of(ev).0 {
            "alloc" | "alloc_s" => {
                if ev.get("exception").is_some() {
                    "oom"
                } else {
                    "alloc"
                }
            }
            "free" => "free_requested",
            "state" | "snapshot" => "snapshot",
            _ => continue,
        };
        anchors.push((i, a));
    }
    let recorded: Vec<(usize, &str)> = trace
        .iter()
        .enumerate()
        .filter_map(|(j, t)| {
            let a = t["action"].as_str().unwrap();
            matches!(a, "alloc" | "oom" | "free_requested" | "snapshot").then_some((j, a))
        })
        .collect();
    if recorded.len() != anchors.len() || recorded.iter().zip(&anchors).any(|(r, a)| r.1 != a.1) {
        return fallback;
    }
    // op owning each trace entry: the op of the first anchor at or after it.
    let mut owner: Vec<Option<usize>> = vec![None; trace.len()];
    let mut k = 0;
    for (j, o) in owner.iter_mut().enumerate() {
        while k < recorded.len() && recorded[k].0 < j {
            k += 1;
        }
        *o = (k < recorded.len()).then(|| anchors[k].0);
    }
    let anchor_pos: HashMap<usize, usize> = recorded.iter().zip(&anchors).map(|(r, a)| (a.0, r.0)).collect();
    let mut out = HashMap::new();
    for &f in pending_free_ops {
        let Some(&jf) = anchor_pos.get(&f) else {
            out.insert(f, fallback[&f]);
            continue;
        };
        let addr = &trace[jf]["addr"];
        let done = (jf + 1..trace.len()).find(|&j| trace[j]["action"] == "free_completed" && &trace[j]["addr"] == addr);
        let q = done.and_then(|j| owner[j]);
        let by_model = |q: usize| (f + 1..q).any(|i| op_of(&events[i]).0 == "empty_cache");
        out.insert(
            f,
            match q {
                Some(q) if !by_model(q) && is_malloc(q) => Some(q),
                Some(_) => None,
                None => None,
            },
        );
    }
    out
}

// ---------------------------------------------------------------------------------------------
// OOM messages
// ---------------------------------------------------------------------------------------------

/// Parses a `format_size` text back to bytes.
fn parse_size(s: &str) -> Option<u64> {
    let (num, unit) = s.trim().split_once(' ')?;
    let n: f64 = num.parse().ok()?;
    let mul = match unit {
        "bytes" => 1.0,
        "KiB" => 1024.0,
        "MiB" => 1048576.0,
        "GiB" => 1073741824.0,
        _ => return None,
    };
    Some((n * mul).round() as u64)
}

/// (device_free, proc_info) as the recorded message shows them.
fn oom_parts(msg: &str) -> Option<(u64, String)> {
    let a = msg.find(" of which ")? + " of which ".len();
    let b = a + msg[a..].find(" is free. ")?;
    let free = parse_size(&msg[a..b])?;
    let rest = &msg[b + " is free. ".len()..];
    let end = rest.find("Of the allocated memory")?;
    let middle = &rest[..end];
    let proc_info = match middle.rfind("memory in use. ") {
        Some(p) => middle[..p + "memory in use. ".len()].to_string(),
        None => String::new(),
    };
    Some((free, proc_info))
}

// ---------------------------------------------------------------------------------------------
// Replay of one case
// ---------------------------------------------------------------------------------------------

enum Outcome {
    Pass(Vec<String>),
    Skip(String),
    Fail(Vec<String>),
}

fn event_name(k: EventKind) -> &'static str {
    match k {
        EventKind::SegmentAlloc => "segment_alloc",
        EventKind::SegmentFree => "segment_free",
        EventKind::SegmentMap => "segment_map",
        EventKind::SegmentUnmap => "segment_unmap",
        EventKind::Oom => "oom",
    }
}

fn run_case(case: &Value, use_parser: bool) -> Outcome {
    let name = case["name"].as_str().unwrap();
    let events = case["events"].as_array().unwrap();
    let total = u(&case["total_memory"]);
    let mut out: Vec<String> = Vec::new();
    let mut notes: Vec<String> = Vec::new();

    // --- configuration -------------------------------------------------------------------
    let env = &case["env"];
    let conf = env.get("PYTORCH_CUDA_ALLOC_CONF").or_else(|| env.get("PYTORCH_ALLOC_CONF")).and_then(|v| v.as_str()).unwrap_or("").to_string();
    let config_error = events.iter().find_map(|ev| ev.get("exception")?.as_str()?.strip_prefix("ValueError: ").map(str::to_string));
    if !use_parser && config_error.is_some() {
        return Outcome::Skip("config-error case: AllocatorConfig::parse rejects every non-empty string".into());
    }
    let cfg = if use_parser {
        match (AllocatorConfig::parse(&conf), &config_error) {
            (Err(e), Some(want)) => {
                if &e.0 != want {
                    out.push(format!("[{name}] parse({conf:?}): recorded error {want:?} vs model error {:?}", e.0));
                    return Outcome::Fail(out);
                }
                return Outcome::Pass(vec![format!("config error reproduced: {want:?}")]);
            }
            (Ok(_), Some(want)) => {
                out.push(format!("[{name}] parse({conf:?}): recorded error {want:?} but the model's parser accepted it"));
                return Outcome::Fail(out);
            }
            (Err(e), None) => {
                out.push(format!("[{name}] parse({conf:?}) failed with {:?}, but the real allocator accepted it", e.0));
                return Outcome::Fail(out);
            }
            (Ok(c), None) => {
                let mut expect = AllocatorConfig::default();
                if fallback_apply(&mut expect, &conf).is_ok() && config_key(&expect) != config_key(&c) {
                    out.push(format!("[{name}] parse({conf:?}) gives {} but the spec (§11) says {}", config_key(&c), config_key(&expect)));
                }
                c
            }
        }
    } else {
        let mut c = AllocatorConfig::default();
        if let Err(e) = fallback_apply(&mut c, &conf) {
            return Outcome::Skip(format!("stand-in config parser cannot express {conf:?}: {e}"));
        }
        c
    };

    // --- device with the recorded addresses -------------------------------------------------
    let placement = recorded_placement(events, total);
    let mut a: Alloc = CachingAllocator::new(cfg, SimDevice::new(total, placement.clone()));
    // PyTorch creates the device allocator lazily (first CUDA allocation / fraction call), so a
    // runtime `settings` op before that is part of the construction-time config (e.g. the
    // `max_split_size` stat, case `non_split_reset_runtime`): rebuild the model allocator then.
    let mut touched = false;
    let streams = stream_values(events);

    // Cross-stream frees and when they complete.
    let mut recorded_uses: HashMap<String, Vec<u64>> = HashMap::new();
    let mut pending_free_ops = Vec::new();
    {
        let mut uses: HashMap<&str, bool> = HashMap::new();
        for (i, ev) in events.iter().enumerate() {
            let (op, args) = op_of(ev);
            match op {
                "record_stream" => {
                    uses.insert(args[0].as_str().unwrap(), true);
                }
                "free" if uses.remove(args[0].as_str().unwrap()).is_some() => pending_free_ops.push(i),
                _ => {}
            }
        }
    }
    let completions = pending_completions(events, &pending_free_ops);
    // (token, op index of the malloc at whose start it completes)
    let mut pending: Vec<(u64, Option<usize>)> = Vec::new();

    let trace_cmp = trace_complete(events);
    let mut model_events: Vec<(String, u64, u64)> = Vec::new();
    let mut events_from = 0usize;

    let mut tags: HashMap<String, (BlockId, u64)> = HashMap::new();
    // MemPools by name, the pools entered (innermost last), and each graph's live blocks.
    let mut mempools: HashMap<String, (i64, i64)> = HashMap::new();
    let mut entered: Vec<(i64, i64)> = Vec::new();
    let mut graphs: HashMap<String, ((i64, i64), Vec<BlockId>)> = HashMap::new();
    // What was compared: states, pointers, OOM messages, snapshots, trace segment/oom events.
    let (mut n_states, mut n_ptrs, mut n_ooms, mut n_snaps, mut n_trace) = (0, 0, 0, 0, 0);

    for (i, ev) in events.iter().enumerate() {
        if out.len() >= MAX_MISMATCHES {
            out.push(format!("[{name}] ... (stopped after {MAX_MISMATCHES} mismatches)"));
            break;
        }
        let (op, args) = op_of(ev);
        let at = format!("[{name}] op #{i} {}", ev["op"]);
        touched |= matches!(op, "alloc" | "alloc_s" | "fraction" | "fraction_bytes" | "empty_cache");
        match op {
            "history" | "history_skip" | "history_mode" => events_from = model_events.len(),
            "history_off" | "sleep" | "sync" => {}
            "alloc" | "alloc_s" => {
                let tag = args[0].as_str().unwrap().to_string();
                let size = u(&args[1]);
                let stream = if op == "alloc_s" { streams[args[2].as_str().unwrap()] } else { 0 };
                // process_events: cross-stream frees whose events completed before this malloc.
                let due: Vec<u64> = pending.iter().filter(|p| p.1 == Some(i)).map(|p| p.0).collect();
                pending.retain(|p| p.1 != Some(i));
                for t in due {
                    a.complete_free(t);
                }
                let result = a.malloc(size, stream, Route::Default);
                match (result, ev.get("ptr").and_then(|p| p.as_u64()), ev.get("exception").and_then(|e| e.as_str())) {
                    (Ok(id), Some(ptr), _) => {
                        let got = a.block(id).ptr;
                        n_ptrs += 1;
                        if got != ptr {
                            out.push(format!("{at}: ptr recorded {ptr:#x} vs model {got:#x}"));
                        }
                        tags.insert(tag, (id, stream));
                    }
                    (Ok(id), None, Some(exc)) => {
                        out.push(format!("{at}: the real allocator raised {exc:?} but the model allocated at {:#x}", a.block(id).ptr));
                        tags.insert(tag, (id, stream));
                    }
                    (Err(oom), Some(ptr), _) => {
                        out.push(format!("{at}: the real allocator allocated at {ptr:#x} but the model raised OOM: {}", oom_message(&oom, 0, "")));
                    }
                    (Err(oom), None, Some(exc)) => {
                        let want = exc.strip_prefix("OutOfMemoryError: ").unwrap_or(exc);
                        match oom_parts(want) {
                            Some((device_free, proc_info)) => {
                                let mut o = oom.clone();
                                o.device_free = device_free;
                                let got = oom_message(&o, 0, &proc_info);
                                n_ooms += 1;
                                if got != want {
                                    out.push(format!("{at}: OOM message differs\n      recorded: {want}\n      model:    {got}"));
                                }
                            }
                            None => out.push(format!("{at}: cannot parse the recorded OOM message {want:?}")),
                        }
                    }
                    (r, p, e) => out.push(format!("{at}: unexpected combination: model {:?}, recorded ptr {p:?}, exception {e:?}", r.is_ok())),
                }
            }
            "record_stream" => {
                let tag = args[0].as_str().unwrap();
                let s = streams[args[1].as_str().unwrap()];
                recorded_uses.entry(tag.to_string()).or_default().push(s);
            }
            "free" => {
                let tag = args[0].as_str().unwrap();
                let Some((id, alloc_stream)) = tags.remove(tag) else {
                    out.push(format!("{at}: tag {tag:?} has no live model block (earlier divergence)"));
                    continue;
                };
                let uses = recorded_uses.remove(tag).unwrap_or_default();
                let cross = uses.iter().any(|&s| s != alloc_stream);
                if let Some(token) = a.free(id, cross) {
                    pending.push((token, completions.get(&i).copied().flatten()));
                }
            }
            "empty_cache" => a.empty_cache(),
            "pool_enter" => {
                let id = pair(&ev["pool_id"]);
                let opt = |k: &str| args.get(1).and_then(|o| o.get(k)).and_then(|v| v.as_bool()).unwrap_or(false);
                if !mempools.contains_key(args[0].as_str().unwrap()) {
                    a.mem_pool_new(id, opt("use_on_oom"), opt("no_split"));
                    mempools.insert(args[0].as_str().unwrap().to_string(), id);
                }
                a.begin_allocate_to_pool(id, PoolFilter::CurrentThread);
                entered.push(id);
            }
            "pool_exit" => {
                let id = entered.pop().expect("pool_exit without pool_enter");
                a.end_allocate_to_pool(id);
                a.release_pool(id);
            }
            "pool_del" => {
                let id = mempools.remove(args[0].as_str().unwrap()).expect("pool_del of an unknown pool");
                a.mem_pool_drop(id);
            }
            "graph" => {
                let id = pair(&ev["pool_id"]);
                let cs = capture_stream(events);
                a.empty_cache();
                let mut live = Vec::new();
                for _ in 0..2 {
                    live.push(a.malloc(8, cs, Route::Default).expect("generator state"));
                }
                a.begin_allocate_to_pool(id, PoolFilter::Stream(cs));
                let sizes: Vec<u64> = args[1].as_array().unwrap().iter().map(u).collect();
                let blocks: Vec<BlockId> = sizes.iter().map(|&sz| a.malloc(sz, cs, Route::Default).expect("capture allocation")).collect();
                for &b in blocks[..blocks.len() - 1].iter().rev() {
                    a.free(b, false);
                }
                a.end_allocate_to_pool(id);
                live.insert(0, *blocks.last().unwrap());
                graphs.insert(args[0].as_str().unwrap().to_string(), (id, live));
            }
            "graph_del" => {
                let (id, live) = graphs.remove(args[0].as_str().unwrap()).expect("graph_del of an unknown graph");
                for b in live {
                    a.free(b, false);
                }
                a.release_pool(id);
            }
            "fraction" => a.set_memory_fraction(args[0].as_f64().unwrap()),
            "fraction_bytes" => match ev.get("fraction").and_then(|f| f.as_f64()) {
                // set_per_process_memory_fraction(f) with the f the script passed: allowed = (size_t)(f * total).
                Some(f) => a.set_memory_fraction(f),
                None => a.set_allowed_memory_maximum(Some(u(&args[0]))),
            },
            "settings" => {
                let s = args[0].as_str().unwrap();
                if use_parser {
                    let mut expect = a.config.clone();
                    let fb = fallback_apply(&mut expect, s);
                    if let Err(e) = a.config.apply(s) {
                        out.push(format!("{at}: apply({s:?}) failed with {:?}, the real allocator accepted it", e.0));
                    } else if fb.is_ok() && config_key(&expect) != config_key(&a.config) {
                        out.push(format!("{at}: apply({s:?}) gives {} but the spec (§11) says {}", config_key(&a.config), config_key(&expect)));
                    }
                } else if let Err(e) = fallback_apply(&mut a.config, s) {
                    return Outcome::Skip(format!("stand-in config parser cannot express {s:?}: {e}"));
                }
                if !touched {
                    a = CachingAllocator::new(a.config.clone(), SimDevice::new(total, placement.clone()));
                }
            }
            "state" => {
                let recorded: Vec<Seg> = ev["segs"].as_array().unwrap().iter().map(seg_from_state).collect();
                let model: Vec<Seg> = a.segments().iter().map(|s| seg_from_model(&a, s)).collect();
                compare_segments(&at, &recorded, &model, &mut out);
                compare_stats(&at, &ev["stats"], &a, &mut out);
                n_states += 1;
            }
            "snapshot" => {
                let snap = &ev["snapshot"];
                let recorded: Vec<Seg> = snap["segments"].as_array().unwrap().iter().map(seg_from_snapshot).collect();
                let model: Vec<Seg> = a.segments().iter().map(|s| seg_from_model(&a, s)).collect();
                compare_segments(&format!("{at} (snapshot segments)"), &recorded, &model, &mut out);
                n_snaps += 1;
                if let Some((_, si, ref skip)) = trace_cmp
                    && si == i
                {
                    let keep =
                        |act: &str| matches!(act, "segment_alloc" | "segment_free" | "segment_map" | "segment_unmap" | "oom") && !skip.iter().any(|s| s == act);
                    let rec: Vec<(String, u64, u64)> = snap["device_traces"][0]
                        .as_array()
                        .unwrap()
                        .iter()
                        .filter(|t| keep(t["action"].as_str().unwrap()))
                        .map(|t| {
                            let act = t["action"].as_str().unwrap().to_string();
                            let addr = if act == "oom" { 0 } else { u(&t["addr"]) };
                            (act, addr, u(&t["size"]))
                        })
                        .collect();
                    let mine: Vec<(String, u64, u64)> = model_events[events_from..].iter().filter(|e| keep(&e.0)).cloned().collect();
                    n_trace = rec.len();
                    if rec != mine {
                        let n = rec.iter().zip(&mine).take_while(|(x, y)| x == y).count();
                        let f = |v: &[(String, u64, u64)]| v.iter().map(|(k, a, s)| format!("{k}({a:#x},{s})")).collect::<Vec<_>>().join(" ");
                        out.push(format!("{at}: trace segment events differ from entry {n} on\n      recorded: {}\n      model:    {}", f(&rec), f(&mine)));
                    }
                }
            }
            other => {
                out.push(format!("{at}: op `{other}` is not supported by this test"));
            }
        }
        if let Err(e) = a.check_invariants() {
            out.push(format!("{at}: check_invariants failed: {e}"));
        }
        for e in a.events.drain(..) {
            let addr = if e.kind == EventKind::Oom { 0 } else { e.addr };
            model_events.push((event_name(e.kind).to_string(), addr, e.size));
        }
    }

    if out.len() < MAX_MISMATCHES {
        compare_stats(&format!("[{name}] final_stats"), &case["final_stats"], &a, &mut out);
    }
    notes.insert(0, format!("{n_states} states, {n_ptrs} ptrs, {n_ooms} OOM messages, {n_snaps} snapshots, {n_trace} trace segment/oom events"));
    if trace_cmp.is_none() && last_trace(events).is_some() {
        notes.push("trace not compared (history not from the start, not 'all', or the ring wrapped)".into());
    }
    if !use_parser && !conf.is_empty() {
        notes.push(format!("config {conf:?} built by the test's stand-in parser"));
    }
    if out.is_empty() { Outcome::Pass(notes) } else { Outcome::Fail(out) }
}

#[test]
fn probe_cases_match_the_real_allocator() {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let Some(dir) = reference::shared(&repo, "reference/probe-cases") else { return };
    let use_parser = parser_ready();
    if !use_parser {
        println!(
            "note: AllocatorConfig::parse rejects non-empty strings; configs are built by the test's stand-in \
             parser and the err_* cases are skipped"
        );
    }
    let mut passed = Vec::new();
    let mut skipped = Vec::new();
    let mut known = Vec::new();
    let mut fixed = Vec::new();
    let mut failed: Vec<(String, Vec<String>)> = Vec::new();
    for file in ORACLE_FILES {
        let path = dir.join(file);
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        let cases: Vec<Value> = serde_json::from_str(&text).unwrap_or_else(|e| panic!("parsing {}: {e}", path.display()));
        for case in &cases {
            let name = case["name"].as_str().unwrap().to_string();
            let known_reason = KNOWN_FAILURES.iter().find(|k| k.0 == name).map(|k| k.1);
            match run_case(case, use_parser) {
                Outcome::Pass(notes) => {
                    if known_reason.is_some() {
                        fixed.push(name.clone());
                    }
                    passed.push(if notes.is_empty() { name } else { format!("{name} ({})", notes.join("; ")) });
                }
                Outcome::Skip(why) => skipped.push(format!("{name}: {why}")),
                Outcome::Fail(lines) => match known_reason {
                    Some(r) => known.push((name, r, lines)),
                    None => failed.push((name, lines)),
                },
            }
        }
    }
    reference::expect_count("probe cases", passed.len() + skipped.len() + known.len() + failed.len(), reference::PROBE_CASES);
    // Every case but the MemPool / CUDA-graph ones runs.
    reference::expect_count("probe cases run", passed.len() + known.len() + failed.len(), EXPRESSIBLE_CASES);
    println!("\n=== probe cases: {} passed, {} skipped, {} known failures, {} new failures ===", passed.len(), skipped.len(), known.len(), failed.len());
    for p in &passed {
        println!("  PASS  {p}");
    }
    for s in &skipped {
        println!("  SKIP  {s}");
    }
    for (n, r, lines) in &known {
        println!("  KNOWN FAILURE  {n}: {r}");
        for l in lines {
            println!("      {l}");
        }
    }
    for n in &fixed {
        println!("  NOTE  {n} is listed in KNOWN_FAILURES but now passes: remove it from the list");
    }
    if !failed.is_empty() {
        let mut msg = String::new();
        for (n, lines) in &failed {
            msg.push_str(&format!("\n  FAIL {n}:\n"));
            for l in lines {
                msg.push_str(&format!("    {l}\n"));
            }
        }
        panic!("{} probe case(s) disagree with the real allocator:{msg}", failed.len());
    }
}
