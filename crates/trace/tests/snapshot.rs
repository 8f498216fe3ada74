//! Snapshot conversion: small fixtures shaped like torch 2.11 snapshots, malformed ones, and a real
//! snapshot recorded with torch 2.11 (expected values computed with CPython's pickle).

mod common;

use allocsim_trace::snapshot::from_pickle;
use allocsim_trace::{Action, BlockState, Frame, Snapshot, TraceError};
use common::{fixture, real_trace};

fn fr(name: &str, line: i64) -> Frame {
    Frame { name: name.into(), filename: "gpu/record.py".into(), line }
}

fn small(p: u32) -> Snapshot {
    from_pickle(&fixture(&format!("snap/small_p{p}.pickle"))).unwrap_or_else(|e| panic!("protocol {p}: {e}"))
}

#[test]
fn small_snapshot() {
    let s = small(4);
    assert_eq!(s.device_traces.len(), 2);
    let t = &s.device_traces[0];
    assert_eq!(t.len(), 10);
    let actions: Vec<_> = t.iter().map(|e| e.action).collect();
    use Action::*;
    assert_eq!(actions, [SegmentAlloc, Alloc, Alloc, FreeRequested, FreeCompleted, Oom, SegmentMap, SegmentUnmap, SegmentFree, Snapshot]);
    assert_eq!((t[0].addr, t[0].size, t[0].stream, t[0].time_us), (139919842344960, 20971520, 0, 1000));
    // streams up to 2**64-1 (pickled as LONG1)
    assert_eq!(t[2].stream, u64::MAX);
    // oom: addr holds device_free
    assert_eq!((t[5].addr, t[5].size, t[5].stream), (147460325376, 268435456, 289523248));

    // stacks: interned by content in first-use order
    let abc = vec![fr("w_frag", 56), fr("child", 310), fr("<module>", 407)];
    assert_eq!(s.stacks[0], Vec::<Frame>::new());
    assert_eq!(s.stacks[1], abc);
    assert_eq!(s.stacks[2], abc[1..]);
    assert_eq!(s.stacks[3], abc[2..]);
    let ids: Vec<_> = t.iter().map(|e| e.stack).collect();
    assert_eq!(ids, [1, 1, 2, 2, 3, 1, 0, 0, 1, 0]);
    assert_eq!(s.device_traces[1][0].stack, 1);
    assert_eq!(s.device_traces[1][0].size, 1024);

    assert_eq!(s.segments.len(), 2);
    let g = &s.segments[0];
    assert_eq!((g.device, g.address, g.total_size), (0, 139919842344960, 20971520));
    assert_eq!((g.allocated_size, g.active_size, g.requested_size), (6291456, 6292480, 6291968));
    assert!(!g.is_small && !g.is_expandable && g.pool_id == (0, 0));
    let states: Vec<_> = g.blocks.iter().map(|b| b.state).collect();
    assert_eq!(states, [BlockState::ActiveAllocated, BlockState::ActivePendingFree, BlockState::Inactive]);
    assert_eq!(g.blocks[0].stack, 1);
    assert_eq!(s.stacks[g.blocks[1].stack as usize], abc[1..2]);
    assert_eq!(g.blocks[1].stack, 4);
    assert_eq!(g.blocks[2].stack, 0);
    assert_eq!((g.blocks[1].size, g.blocks[1].requested_size), (1024, 512));
    let h = &s.segments[1];
    assert_eq!((h.device, h.address, h.stream), (1, (1u64 << 63) + 4096, u64::MAX));
    assert!(h.is_small && h.is_expandable && h.pool_id == (1, 7));
    assert_eq!(s.stacks.len(), 5);

    let st = &s.settings;
    assert!(st.present);
    assert_eq!(st.alloc_conf.as_deref(), Some("expandable_segments:True,roundup_power2_divisions:[256:4]"));
    assert_eq!(st.max_split_size, Some(134217728));
    assert_eq!(st.garbage_collection_threshold, Some(0.6));
    assert_eq!(st.expandable_segments, Some(true));
    let want: Vec<(u64, u64)> = (0..16)
        .map(|i| {
            (
                1u64 << i,
                if i == 0 {
                    2
                } else if i == 8 {
                    4
                } else {
                    0
                },
            )
        })
        .collect();
    assert_eq!(st.roundup_power2_divisions, want);
}

#[test]
fn protocols_agree() {
    let s4 = small(4);
    assert_eq!(small(2), s4);
    assert_eq!(small(5), s4);
}

fn not_snapshot(file: &str) -> String {
    match from_pickle(&fixture(file)) {
        Err(TraceError::NotSnapshot(m)) => m,
        other => panic!("{file}: expected NotSnapshot, got {other:?}"),
    }
}

#[test]
fn helpful_errors() {
    let m = not_snapshot("snap/unknown_action.pickle");
    assert!(m.contains("frobnicate") && m.contains("device_traces[0][2]"), "{m}");
    let m = not_snapshot("snap/toplevel_list.pickle");
    assert!(m.contains("top-level is a list"), "{m}");
    let m = not_snapshot("snap/no_traces.pickle");
    assert!(m.contains("no 'device_traces'") && m.contains("'segments'"), "{m}");
    let m = not_snapshot("snap/pre21.pickle");
    assert!(
        m.starts_with("snapshot from PyTorch < 2.1 (blocks carry 'history', no 'device_traces')")
            && m.contains("torch.cuda.memory._record_memory_history(max_entries=100000)"),
        "{m}"
    );
    match from_pickle(&fixture("refuse/ordered_dict_p4.pickle")) {
        Err(e @ TraceError::Pickle(_)) => assert!(e.to_string().contains("STACK_GLOBAL"), "{e}"),
        other => panic!("{other:?}"),
    }
}

/// frag__default__2048M (torch 2.11, one H200): ground truth from CPython's pickle.
#[test]
fn real_snapshot_frag() {
    let Some(p) = real_trace("frag__default__2048M.pickle.gz") else {
        return;
    };
    let s = allocsim_trace::read_trace(&p).unwrap();
    assert_eq!(s.device_traces.len(), 1);
    let t = &s.device_traces[0];
    assert_eq!(t.len(), 1003);
    let count = |a: Action| t.iter().filter(|e| e.action == a).count();
    let bytes = |a: Action| t.iter().filter(|e| e.action == a).map(|e| e.size).sum::<u64>();
    assert_eq!(count(Action::Alloc), 300);
    assert_eq!(count(Action::FreeRequested), 300);
    assert_eq!(count(Action::FreeCompleted), 300);
    assert_eq!(count(Action::SegmentAlloc), 100);
    assert_eq!(count(Action::Oom), 3);
    assert_eq!(bytes(Action::Alloc), 1887436800);
    assert_eq!(bytes(Action::FreeCompleted), 1887436800);
    assert_eq!(bytes(Action::SegmentAlloc), 2097152000);
    assert_eq!(bytes(Action::Oom), 1879048192);
    let oom: Vec<_> = t.iter().enumerate().filter(|(_, e)| e.action == Action::Oom).map(|(i, e)| (i, e.addr, e.size)).collect();
    assert_eq!(oom, [(798, 147460325376, 268435456), (799, 147460325376, 536870912), (800, 147460325376, 1073741824)]);
    assert_eq!(s.stack(t[798].stack), [fr("w_frag", 61), fr("child", 310), fr("<module>", 407)]);
    let e = t[0];
    assert_eq!((e.action, e.addr, e.size, e.stream, e.time_us), (Action::SegmentAlloc, 139919842344960, 20971520, 0, 1796208315567803));
    assert_eq!(s.stack(e.stack), [fr("w_frag", 56), fr("child", 310), fr("<module>", 407)]);
    let e = t[1002];
    assert_eq!((e.action, e.addr, e.size, e.time_us), (Action::FreeCompleted, 139916021334016, 6291456, 1796208315608134));
    assert_eq!(s.stack(e.stack), [fr("child", 310), fr("<module>", 407)]);
    assert_eq!(s.stacks.len(), 6); // 5 distinct non-empty stacks + the empty one

    assert_eq!(s.segments.len(), 100);
    assert!(s.segments.iter().all(|g| g.blocks.len() == 1 && g.blocks[0].state == BlockState::Inactive));
    let g = &s.segments[0];
    assert_eq!((g.device, g.address, g.total_size, g.allocated_size), (0, 139916008751104, 20971520, 0));
    assert_eq!((g.blocks[0].requested_size, g.is_small, g.is_expandable, g.pool_id), (6291456, false, false, (0, 0)));

    let st = &s.settings;
    assert!(st.present);
    assert_eq!(st.alloc_conf.as_deref(), Some(""));
    assert_eq!(st.max_split_size, Some(-1));
    assert_eq!(st.garbage_collection_threshold, Some(0.0));
    assert_eq!(st.expandable_segments, Some(false));
    assert_eq!(st.roundup_power2_divisions, (0..16).map(|i| (1u64 << i, 0)).collect::<Vec<_>>());
}

/// `external_annotations` of a real torch 2.11 snapshot (cudagraph__default__0M: an SGD step
/// captured in a CUDA graph; the optimizer's record_function scopes), as CPython's `pickle.load`
/// shows them: 16 entries, START/END of `Optimizer.zero_grad#SGD.zero_grad` and
/// `Optimizer.step#SGD.step` four times each, keys `stage, name, device, time_us`.
#[test]
fn real_snapshot_annotations() {
    let p = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../traces/cudagraph__default__0M.pickle.gz");
    let s = allocsim_trace::read_trace(&p).unwrap();
    assert_eq!(s.annotations.len(), 16);
    let a = &s.annotations[0];
    assert_eq!((a.device, a.time_us, a.name(), a.is_start()), (0, 1796208421395351, Some("Optimizer.zero_grad#SGD.zero_grad"), Some(true)));
    assert_eq!(a.fields.iter().map(|(k, _)| &**k).collect::<Vec<_>>(), ["stage", "name"]);
    let z = s.annotations.last().unwrap();
    assert_eq!((z.time_us, z.name(), z.is_start()), (1796208421640692, Some("Optimizer.step#SGD.step"), Some(false)));
    let steps = s.annotations.iter().filter(|a| a.name() == Some("Optimizer.step#SGD.step")).count();
    assert_eq!(steps, 8);
    // every entry has torch's defaults ('N/A', '')
    assert!(s.entry_metas.is_empty());
    assert!(s.device_traces[0].iter().all(|e| e.meta == 0));
}

/// Annotations and per-entry metadata that are not what torch writes are refused with the entry
/// named.
#[test]
fn bad_annotations_and_metadata() {
    use allocsim_trace::pickle_write::{PyValue as V, dumps};
    let st = |x: &str| V::Str(x.into());
    let entry = |extra: Vec<(V, V)>| {
        let mut e = vec![(st("action"), st("alloc")), (st("addr"), V::Int(1)), (st("size"), V::Int(2))];
        e.extend(extra);
        V::Dict(e)
    };
    let snap = |trace: Vec<V>, ann: V| {
        V::Dict(vec![(st("segments"), V::List(vec![])), (st("device_traces"), V::List(vec![V::List(trace)])), (st("external_annotations"), ann)])
    };
    let err = |v: &V| match from_pickle(&dumps(v)) {
        Err(TraceError::NotSnapshot(m)) => m,
        other => panic!("expected NotSnapshot, got {other:?}"),
    };
    let m = err(&snap(vec![], V::List(vec![V::Dict(vec![(st("name"), V::Int(3))])])));
    assert!(m.contains("external_annotations[0]['name']") && m.contains("expected a str"), "{m}");
    let m = err(&snap(vec![], V::Dict(vec![])));
    assert!(m.contains("'external_annotations' is a dict"), "{m}");
    let m = err(&snap(vec![], V::List(vec![V::Dict(vec![(st("time_us"), st("x"))])])));
    assert!(m.contains("external_annotations[0]['time_us']"), "{m}");
    let m = err(&snap(vec![entry(vec![(st("user_metadata"), V::None)])], V::List(vec![])));
    assert!(m.contains("device_traces[0][0]['user_metadata']"), "{m}");
    // None for the list, and absent keys, are fine
    let ok = from_pickle(&dumps(&snap(vec![entry(vec![])], V::None))).unwrap();
    assert!(ok.annotations.is_empty() && ok.device_traces[0][0].meta == 0);
    let ok = from_pickle(&dumps(&snap(
        vec![entry(vec![(st("compile_context"), st("c")), (st("user_metadata"), st("u"))])],
        V::List(vec![V::Dict(vec![(st("device"), V::Int(1)), (st("stage"), st("START"))])]),
    )))
    .unwrap();
    assert_eq!((ok.compile_context(1), ok.user_metadata(1)), ("c", "u"));
    assert_eq!(ok.annotations[0].device, 1);
    assert_eq!(ok.annotations[0].time_us, 0);
}
