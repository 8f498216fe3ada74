//! `explain` against real OOMs: PyTorch's own message (from the run's .json) reproduced exactly
//! (but for NVML's per-process sentences, which a trace cannot show), the blocks that pin the
//! fragmented segments named, and the alternatives checked against the recorded runs.

use std::path::{Path, PathBuf};

use allocsim_model::AllocatorConfig;
use allocsim_model::format::format_size;
use allocsim_replay::Prepared;
use allocsim_report::explain::{At, CANDIDATES, explain, verdict_lines};
use allocsim_trace::read_trace;

const H200: u64 = 150_109_880_320;

#[path = "support/reference.rs"]
mod reference;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn meta(path: &Path) -> serde_json::Value {
    let s = path.to_str().unwrap().trim_end_matches(".pickle.gz").to_string() + ".json";
    serde_json::from_str(&std::fs::read_to_string(s).unwrap()).unwrap()
}

fn cap(m: &serde_json::Value) -> u64 {
    (m["fraction"].as_f64().unwrap() * m["device_total_memory"].as_f64().unwrap()) as u64
}

/// PyTorch's message without NVML's per-process sentences ("Process N has X memory in use. " and
/// "Including non-PyTorch memory, this process has X memory in use. ").
fn without_nvml(msg: &str) -> String {
    let start = msg.find(" is free. ").unwrap() + " is free. ".len();
    let rest = &msg[start..];
    let keep_from =
        rest.find(" allowed; ").map(|i| rest[..i].rfind(". ").map_or(0, |j| j + 2)).unwrap_or_else(|| rest.find("Of the allocated memory").unwrap());
    format!("{}{}", &msg[..start], &rest[keep_from..])
}

#[test]
fn frag_oom_is_explained_to_the_byte() {
    let path = root().join("traces/frag__default__2048M.pickle.gz");
    let m = meta(&path);
    let c = cap(&m);
    let p = Prepared::new(&read_trace(&path).unwrap(), None, H200, Some(c)).unwrap();
    let x = explain(&p, &p.own, Some(c), &p.recorded_placement(), At::FirstOom, CANDIDATES).expect("frag runs out of memory");
    let real = m["log"][0]["exception"].as_str().unwrap();
    assert_eq!(x.message.as_deref(), Some(without_nvml(real).as_str()));
    assert_eq!(x.request, 300);
    // The 256 MiB request cannot use 1.36 GiB of free memory: it is in 14 MiB pieces that the
    // 6 MiB tensors allocated at gpu/record.py:56 pin.
    assert_eq!(x.usable_largest_block, 14 << 20);
    assert_eq!(x.free.pinned_by_live_blocks, x.free.unallocated());
    assert!(x.pinning_sites[0].call_site.starts_with("gpu/record.py:56"), "{:?}", x.pinning_sites[0]);
    assert_eq!(x.pinning_sites[0].live_bytes, 606 << 20);
    // expandable_segments:True does not save frag: the recorded expandable run ran out of memory
    // at the same request, and so does the replay.
    let es = x.alternatives.iter().find(|a| a.conf == "expandable_segments:True").unwrap();
    assert_eq!(es.first_oom, Some(300));
    let real_es = read_trace(&root().join("traces/frag__expandable__2048M.pickle.gz")).unwrap();
    let real_es_first_oom = real_es.device_traces[0]
        .iter()
        .filter(|e| matches!(e.action, allocsim_trace::Action::Alloc | allocsim_trace::Action::Oom))
        .position(|e| e.action == allocsim_trace::Action::Oom);
    assert_eq!(real_es_first_oom, Some(300));
    // Nothing among the settings saves it; only more memory does, and the smallest allowed
    // maximum under which request 300 and every request before it are served is exact to the
    // 2 MiB.
    assert!(x.alternatives.iter().all(|a| !a.avoids));
    let smallest = x.smallest_capacity.unwrap();
    let first_oom_up_to_300 = |cap: u64| p.replay(&p.own, Some(cap), p.recorded_placement()).ooms.iter().map(|o| o.request).find(|&r| r <= 300);
    assert_eq!(first_oom_up_to_300(smallest), None);
    assert!(first_oom_up_to_300(smallest - (2 << 20)).is_some());
    assert_eq!(x.fix, Some(allocsim_report::explain::Fix::Memory { needed: smallest, had: 2 << 30 }));
}

#[test]
fn synthetic_oom_is_explained_to_the_byte() {
    let Some(path) = reference::shared(&root(), "traces/synthetic__default__8810M.pickle.gz") else { return };
    let m = meta(&path);
    let c = cap(&m);
    let p = Prepared::new(&read_trace(&path).unwrap(), None, H200, Some(c)).unwrap();
    let x = explain(&p, &p.own, Some(c), &p.recorded_placement(), At::FirstOom, &["expandable_segments:True"]).unwrap();
    let real = m["log"].as_array().unwrap().iter().find_map(|l| l["exception"].as_str()).unwrap();
    assert_eq!(x.message.as_deref(), Some(without_nvml(real).as_str()));
    // Expandable segments get past this request (the recorded expandable run had no OOM at all
    // here; the replay's later OOM comes after the request sequences diverge).
    assert!(x.alternatives[0].avoids);
}

#[test]
fn explaining_a_served_request_and_the_peak() {
    let path = root().join("traces/unet512__default__0M.pickle.gz");
    let p = Prepared::new(&read_trace(&path).unwrap(), None, H200, None).unwrap();
    let cfg = AllocatorConfig::default();
    assert!(explain(&p, &cfg, None, &p.recorded_placement(), At::FirstOom, &[]).is_none(), "no OOM to explain");
    let x = explain(&p, &cfg, None, &p.recorded_placement(), At::Request(5), &[]).unwrap();
    assert!(x.message.is_none());
    assert_eq!(x.request, 5);
    let v = verdict_lines(&x, &[], true, true, &cfg, None, &p);
    assert!(v.len() == 1 && v[0].starts_with("Request 5: ") && v[0].contains(", served ("), "{v:?}");
    let peak = explain(&p, &cfg, None, &p.recorded_placement(), At::Peak, &[]).unwrap();
    assert_eq!(peak.free.reserved, p.own_outcome.peak_reserved, "the state after the peak's request holds the peak");
    assert!(!peak.at_start);
    let v = verdict_lines(&peak, &[], true, true, &cfg, None, &p);
    let expect = format!("Peak reserved: {}, reached by request {}: ", format_size(p.own_outcome.peak_reserved), peak.request);
    assert!(v.len() == 1 && v[0].starts_with(&expect), "{v:?} does not start with {expect:?}");
}

/// A recording whose only segment was reserved before the history began, then only an OOM: its
/// peak reserved is the state it started from, explained before the first op.
#[test]
fn a_peak_no_request_reached_is_the_starting_state() {
    let path = root().join("traces/field/test_cuda/test_notifies_oom__default.pickle.gz");
    let p = Prepared::new(&read_trace(&path).unwrap(), None, H200, None).unwrap();
    let cfg = AllocatorConfig::default();
    let peak = explain(&p, &cfg, None, &p.recorded_placement(), At::Peak, &[]).unwrap();
    assert!(peak.at_start && peak.steps.is_empty() && peak.message.is_none());
    assert_eq!((peak.free.reserved, peak.free.allocated), (2 << 20, 0), "one 2 MiB small-pool segment, free");
    assert_eq!(peak.free.reserved, p.own_outcome.peak_reserved);
    let v = verdict_lines(&peak, &[], true, true, &cfg, None, &p);
    assert_eq!(v, ["Peak reserved at the start: 2.00 MiB reserved before memory history was turned on, which no request grew past (0 bytes allocated then)."]);
}

#[test]
fn nvml_sentences_are_what_is_removed() {
    let m = "CUDA out of memory. Tried to allocate 1.00 MiB. GPU 0 has a total capacity of 1.00 GiB of which 2.00 MiB is free. Process 4 has 1.00 MiB memory in use. Including non-PyTorch memory, this process has 9.00 MiB memory in use. 8.00 MiB allowed; Of the allocated memory 1 bytes is allocated by PyTorch";
    assert_eq!(
        without_nvml(m),
        "CUDA out of memory. Tried to allocate 1.00 MiB. GPU 0 has a total capacity of 1.00 GiB of which 2.00 MiB is free. 8.00 MiB allowed; Of the allocated memory 1 bytes is allocated by PyTorch"
    );
}
