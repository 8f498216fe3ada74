//! Private pools on real H200 recordings (torch 2.11, `tools/record_field.py`, kept in
//! `traces/field/`): `torch.cuda.MemPool` with `use_mem_pool` (pools dropped mid-run, kept alive
//! across `empty_cache()`, nested, used from two streams, `use_on_oom` and `no_split` under a
//! memory fraction), two `torch.cuda.graph`s sharing one pool, and `torch.compile(mode=
//! "reduce-overhead")` (CUDA-graph trees) inference and training. Most of these pools are gone
//! before the snapshot, so their segments are not in the final segments: the pools are inferred
//! (`crates/replay/src/pools.rs`).

mod common;

use allocsim_model::allocator::Route;
use allocsim_replay::{Prepared, ReplaySpec, TorchVersion, run, validate};
use common::root;
use serde_json::Value;

const POOL_RUNS: &[&str] = &[
    "mempool__default",
    "mempool__expandable",
    "mempool_nested__default",
    "mempool_nested__expandable",
    "mempool_oom__default",
    "mempool_serving__default",
    "mempool_serving__expandable",
    "mempool_serving2__default",
    "mempool_serving2__expandable",
    "mempool_random1__default",
    "mempool_random1__expandable",
    "mempool_random2__default",
    "mempool_random2__expandable",
    "mempool_random4__default",
    "mempool_random4__expandable",
    "mempool_random3__default",
    "mempool_random3__expandable",
    "graphs__default",
    "graphs__expandable",
    "compile_infer__default",
    "compile_infer__expandable",
    "compile_train__default",
    "compile_train__expandable",
];

fn meta(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(root(&format!("traces/field/{name}.json"))).expect("the run's .json")).unwrap()
}

fn prepared(name: &str) -> Prepared {
    let snap = allocsim_trace::read_trace(&root(&format!("traces/field/{name}.pickle.gz"))).unwrap();
    Prepared::new_for(&snap, None, None, None, TorchVersion::DEFAULT).unwrap()
}

/// With no flags, every segment event, OOM, allocation address and final segment is reproduced,
/// and so is every current `memory_stats()` value the job read at the end.
#[test]
fn pool_recordings_replay_exactly_without_flags() {
    let mut errors = Vec::new();
    for name in POOL_RUNS {
        let snap = allocsim_trace::read_trace(&root(&format!("traces/field/{name}.pickle.gz"))).unwrap();
        let r = run(&snap, &ReplaySpec::default()).unwrap();
        let v = validate(&r);
        if !v.exact {
            errors.push(format!("{name}: not exact: {v:?}"));
        }
        let sim = r.outcome.stats.to_memory_stats();
        let m = meta(name);
        for (k, want) in m["memory_stats"].as_object().unwrap() {
            if (k.ends_with(".current") || k == "num_ooms") && sim.get(k).copied() != want.as_i64() {
                errors.push(format!("{name}: memory_stats[{k}] recorded {want}, simulated {:?}", sim.get(k)));
            }
        }
    }
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

/// `w_mempool` makes one MemPool per round (8 rounds: ids (0, 1) to (0, 8), numbered as made);
/// only the last one's segment is alive at the end. The other seven are found from where their
/// blocks went and the order of their segments' releases. (With expandable segments the same
/// search splits one of them in two: both readings replay the trace exactly, see the README's
/// limits.)
#[test]
fn mempool_rounds_are_eight_pools() {
    let name = "mempool__default";
    {
        let p = prepared(name);
        let found = p.pools.as_ref().expect("pools inferred");
        assert_eq!(found.pools.len(), 8, "{name}: {:?}", found.pools);
        assert!(found.pools.iter().any(|&(id, recorded)| id == (0, 8) && recorded), "{name}: (0, 8) is in the final segments");
    }
}

/// `w_mempool_oom`: the two 90 MiB requests the default pools could not serve under the fraction
/// were served from the `use_on_oom` pool's cached 200 MiB block (the first MemPool, (0, 1)); the
/// `no_split` pool's two requests took whole segments.
#[test]
fn mempool_oom_falls_back_to_the_use_on_oom_pool() {
    let p = prepared("mempool_oom__default");
    let spare = p.program.requests[0].recorded_addr;
    let served: Vec<usize> = p
        .program
        .requests
        .iter()
        .enumerate()
        .filter(|(_, r)| !r.recorded_oom && r.size == 90 << 20 && r.recorded_addr >= spare && r.recorded_addr < spare + (200 << 20))
        .map(|(i, _)| i)
        .collect();
    assert_eq!(served.len(), 2);
    for q in served {
        assert_eq!(p.program.requests[q].route, Route::Private((0, 1)), "request {q}");
    }
    let segs = &p.own_outcome.segment_events;
    assert!(segs.iter().any(|e| e.action == allocsim_trace::Action::SegmentFree && e.size == 200 << 20), "the spare pool's segment is freed at the end");
}

/// CUDA-graph trees restore their pool to a checkpoint before recording a graph for a new shape:
/// those allocations are recognised and replayed in place.
#[test]
fn compile_checkpoint_allocations_are_taken_in_place() {
    for name in ["compile_train__default", "compile_infer__default"] {
        let p = prepared(name);
        let n = p.program.requests.iter().filter(|r| r.checkpoint).count();
        assert!(n > 0, "{name}: no checkpoint allocations found");
    }
}
