//! `allocsim phases` on real H200 recordings (torch 2.11, `traces/field/`): a small HF Llama
//! trained with AdamW for 16 steps of variable sequence length, whose recording script read
//! `max_memory_allocated()` after every step with `reset_peak_memory_stats()` at each step's
//! start (`extra.step_peaks` in the `.json`), and the same model run out of memory in one step
//! under a memory fraction (`log`: the step and `record_function` region it failed in).

mod common;

use allocsim_phases::{Layout, Source, measure};
use allocsim_replay::Prepared;
use common::{root, run, show};
use serde_json::Value;

fn meta(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(root(&format!("traces/field/{name}.json"))).expect("the run's .json")).unwrap()
}

fn phases_json(args: &[&str]) -> Value {
    let o = run(args);
    assert_eq!(o.status.code(), Some(0), "{}", show(args, &o));
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}\n{}", show(args, &o)))
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
}

/// The 16 optimizer steps are the 16 iterations; each iteration's peak allocated is the step's
/// `max_memory_allocated()` reading; the largest is the run's peak, in the step that first read it.
#[test]
fn llama_iterations_are_the_optimizer_steps_with_their_measured_peaks() {
    let m = meta("llama_train__default");
    let step_peaks = u64s(&m["extra"]["step_peaks"]);
    let global = m["extra"]["global_peak_allocated"].as_u64().unwrap();
    assert_eq!(step_peaks.len(), 16);
    let v = phases_json(&["phases", "traces/field/llama_train__default.pickle.gz", "--json"]);
    assert_eq!(v["source"]["kind"], "annotation");
    assert_eq!(v["source"]["names"][0], "Optimizer.step#AdamW.step");
    let its = v["iterations"].as_array().unwrap();
    assert_eq!(its.len(), 16, "one iteration per optimizer step");
    let peaks: Vec<u64> = its.iter().map(|i| i["peak_allocated"].as_u64().unwrap()).collect();
    assert_eq!(peaks, step_peaks);
    assert!(its.iter().all(|i| i["complete"] == true));
    assert_eq!(*peaks.iter().max().unwrap(), global);
    assert_eq!(v["peak_allocated"].as_u64(), Some(global));
    let first_max = step_peaks.iter().position(|&p| p == global).unwrap();
    assert_eq!(v["peak_iteration"].as_u64(), Some(first_max as u64));
    let marked: Vec<usize> = its.iter().enumerate().filter(|(_, i)| i["global_peak"] == true).map(|(k, _)| k).collect();
    assert_eq!(marked, [first_max]);
    // The peak request lies in its iteration, and the largest live call site is listed.
    let it = &its[first_max];
    let q = it["peak_request"].as_u64().unwrap();
    assert!(it["first_request"].as_u64().unwrap() <= q && q <= it["last_request"].as_u64().unwrap());
    assert!(!it["live_at_peak"].as_array().unwrap().is_empty());
    let live: u64 = it["live_at_peak"].as_array().unwrap().iter().map(|s| s["bytes"].as_u64().unwrap()).sum();
    assert!(live <= global);
    // The iterations cover every request, in order.
    let mut next = 0;
    for i in its {
        assert_eq!(i["first_request"].as_u64(), Some(next));
        next = i["last_request"].as_u64().unwrap() + 1;
    }
    assert_eq!(next, v["requests"].as_u64().unwrap());
    // Regions: forward, backward and optimizer once per step, each in its step.
    let regions = v["regions"].as_array().unwrap();
    for name in ["forward", "backward", "optimizer", "Optimizer.step#AdamW.step", "Optimizer.zero_grad#AdamW.zero_grad"] {
        let its: Vec<u64> = regions.iter().filter(|r| r["name"] == name).map(|r| r["iteration"].as_u64().unwrap()).collect();
        let want: Vec<u64> = if name.starts_with("Optimizer.zero_grad") {
            // zero_grad follows the step's end: it opens the next iteration (and the last one's
            // is in the last iteration, which holds no requests after it).
            (1..16).chain([15]).collect()
        } else {
            (0..16).collect()
        };
        assert_eq!(its, want, "{name}");
    }
    // The text form marks the same iteration.
    let o = run(&["phases", "traces/field/llama_train__default.pickle.gz"]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains(&format!("reached in iteration {first_max} at request {q}")), "{text}");
}

/// Without annotations, the repeating request pattern finds the same iterations as the
/// optimizer's annotations (the Llama run, and the tiny MLP recorded with C++ stacks).
#[test]
fn the_request_pattern_finds_the_optimizer_steps() {
    for name in ["llama_train__default", "tiny_annotations__default"] {
        let snap = allocsim_trace::read_trace(&root(&format!("traces/field/{name}.pickle.gz"))).unwrap();
        let p = Prepared::new(&snap, None, 150_109_880_320, None).unwrap();
        let by_steps = Layout::of(&p, None).unwrap();
        assert!(matches!(by_steps.source, Source::Annotation { .. }), "{name}");
        let by_pattern = Layout::from_parts(&p.trace, &p.program.requests, &[], None, &|q| p.call_site(q)).unwrap();
        assert!(matches!(by_pattern.source, Source::Pattern { .. }), "{name}: {:?}", by_pattern.source);
        let starts = |l: &Layout| l.iterations.iter().map(|i| i.span.request_start).collect::<Vec<_>>();
        assert_eq!(starts(&by_pattern), starts(&by_steps), "{name}");
        let a = measure(&p, &by_steps, &p.own, None, &p.recorded_placement(), 0);
        let b = measure(&p, &by_pattern, &p.own, None, &p.recorded_placement(), 0);
        let peaks = |x: &allocsim_phases::Phases| x.iterations.iter().map(|i| i.peaks.peak_allocated).collect::<Vec<_>>();
        assert_eq!(peaks(&a), peaks(&b), "{name}");
    }
}

/// Under the recorded memory fraction the replay runs out of memory where the real run did: in
/// step 9, in `forward` (the recording's log). Iteration 9 holds it (steps 0–8 each ended with an
/// optimizer step); the failed step never reached its optimizer step, so it runs on into step
/// 10's requests and the run has 15 iterations.
#[test]
fn llama_oom_falls_in_its_step_and_region() {
    let m = meta("llama_oom__default");
    let cap = m["cap_bytes"].as_u64().unwrap().to_string();
    let log = m["log"].as_array().expect("the OOM log");
    assert_eq!((log[0]["step"].as_u64(), log[0]["region"].as_str()), (Some(9), Some("forward")));
    let v = phases_json(&["phases", "traces/field/llama_oom__default.pickle.gz", "--capacity", &cap, "--json", "--top", "0"]);
    assert_eq!(v["ooms"].as_u64(), Some(1));
    let q = v["first_oom"].as_u64().unwrap();
    let its = v["iterations"].as_array().unwrap();
    assert_eq!(its.len(), 15);
    let holding: Vec<u64> = its.iter().filter(|i| i["ooms"].as_u64() == Some(1)).map(|i| i["index"].as_u64().unwrap()).collect();
    assert_eq!(holding, [9]);
    assert_eq!(its[9]["first_oom"].as_u64(), Some(q));
    let in_regions: Vec<&str> =
        v["regions"].as_array().unwrap().iter().filter(|r| r["first_oom"].as_u64() == Some(q)).map(|r| r["name"].as_str().unwrap()).collect();
    assert_eq!(in_regions, ["forward"]);
    // The steps before it peak as measured.
    let step_peaks = u64s(&m["extra"]["step_peaks"]);
    let peaks: Vec<u64> = its.iter().map(|i| i["peak_allocated"].as_u64().unwrap()).collect();
    assert_eq!(peaks[..9], step_peaks[..9]);
}

/// `--by NAME` cuts at another annotation; a name that is not there is a user error that lists
/// the names there are.
#[test]
fn by_names_an_annotation() {
    let v = phases_json(&["phases", "traces/field/tiny_annotations__default.pickle.gz", "--by", "forward", "--json", "--top", "0"]);
    assert_eq!(v["source"]["names"][0], "forward");
    assert_eq!(v["iterations"].as_array().unwrap().len(), 4, "three forwards end three iterations, then the rest");
    common::user_error(
        &["phases", "traces/field/tiny_annotations__default.pickle.gz", "--by", "train_step"],
        &["--by \"train_step\"", "forward", "Optimizer.step#AdamW.step"],
    );
}

/// `explain` names the iteration and region: the OOM in step 9's `forward`, and the peak of the
/// training run in iteration 4's `backward` (where the recording's largest step peak was).
#[test]
fn explain_names_the_iteration_and_region() {
    let m = meta("llama_oom__default");
    let cap = m["cap_bytes"].as_u64().unwrap().to_string();
    let v = phases_json(&["explain", "traces/field/llama_oom__default.pickle.gz", "--capacity", &cap, "--json"]);
    assert_eq!(v["phase"]["iteration"].as_u64(), Some(9));
    assert_eq!(v["phase"]["regions"], serde_json::json!(["forward"]));
    let o = run(&["explain", "traces/field/llama_oom__default.pickle.gz", "--capacity", &cap]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("in iteration 9 of 15") && text.contains("inside forward"), "{text}");
    let v = phases_json(&["explain", "traces/field/llama_train__default.pickle.gz", "--at", "peak", "--json"]);
    let step_peaks = u64s(&meta("llama_train__default")["extra"]["step_peaks"]);
    let largest = step_peaks.iter().position(|&p| p == *step_peaks.iter().max().unwrap()).unwrap();
    assert_eq!(v["phase"]["iteration"].as_u64(), Some(largest as u64));
    assert_eq!(v["phase"]["regions"], serde_json::json!(["backward"]));
}

/// `report` draws the iterations as bands on the timeline, the regions along its foot, and a
/// chart of each iteration's peaks with the peak iteration marked.
#[test]
fn report_draws_iterations_and_regions() {
    let dir = std::env::temp_dir().join(format!("allocsim-phases-report-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("r.html");
    let o = run(&["report", "traces/field/llama_train__default.pickle.gz", "-o", out.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", show(&["report"], &o));
    let html = std::fs::read_to_string(&out).unwrap();
    assert_eq!(html.matches(r#"class="iteration-band""#).count(), 16);
    assert_eq!(html.matches(r#"class="iteration-bar""#).count() + html.matches(r#"class="iteration-bar peak""#).count(), 16);
    let peak = html.split(r#"class="iteration-bar peak""#).nth(1).unwrap();
    let title = &peak[peak.find("<title>").unwrap()..peak.find("</title>").unwrap()];
    let step_peaks = u64s(&meta("llama_train__default")["extra"]["step_peaks"]);
    let largest = step_peaks.iter().position(|&p| p == *step_peaks.iter().max().unwrap()).unwrap();
    assert!(title.starts_with(&format!("<title>iteration {largest}:")), "{title}");
    // forward, backward and optimizer (the optimizer's own step is inside the latter) 16 times each
    assert_eq!(html.matches(r#"class="region-band""#).count(), 48);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `sweep` says which iteration each config's reserved memory peaks in: the same iteration
/// `phases` finds under that config (one from the segment events, the other from the allocator's
/// statistics after every op).
#[test]
fn sweep_names_the_peak_iteration_per_config() {
    let trace = "traces/field/llama_oom__default.pickle.gz";
    let v = phases_json(&["sweep", trace, "--grid", "expandable_segments=none,True; max_split_size_mb=none,64", "--placements", "1", "--json"]);
    assert_eq!(v["iterations"].as_u64(), Some(15));
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 4);
    for r in rows {
        let conf = r["conf"].as_str().unwrap();
        let ph = phases_json(&["phases", trace, "--config", conf, "--json", "--top", "0"]);
        for o in r["outcomes"].as_array().unwrap() {
            assert_eq!(o["peak_reserved_iteration"], ph["peak_reserved_iteration"], "{conf}");
            assert_eq!(o["peak_reserved"], ph["peak_reserved"], "{conf}");
        }
    }
}

/// `compare` over a directory of ranks: three copies of the Llama run, one of which makes an
/// extra 2 GiB allocation at the start of step 6's backward. That rank is named as the first to
/// spike, in iteration 6, and the median of every iteration is the run's measured step peak.
#[test]
fn compare_ranks_names_the_rank_that_spiked() {
    use allocsim_trace::{Action, TraceEntry};
    let snap = allocsim_trace::read_trace(&root("traces/field/llama_train__default.pickle.gz")).unwrap();
    let step_peaks = u64s(&meta("llama_train__default")["extra"]["step_peaks"]);
    let dir = std::env::temp_dir().join(format!("allocsim-ranks-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // The 7th backward START (iteration 6).
    let t = snap.annotations.iter().filter(|a| a.name() == Some("backward") && a.is_start() == Some(true)).nth(6).unwrap().time_us;
    let mut spiked = snap.clone();
    let trace = &mut spiked.device_traces[0];
    let i = trace.iter().position(|e| e.time_us >= t).unwrap();
    let at = trace[i].time_us;
    let e = |action, addr| TraceEntry { action, addr, size: 2 << 30, stream: 0, time_us: at, stack: 0, meta: 0 };
    let addr = 0x7e00_0000_0000;
    trace.splice(i..i, [e(Action::Alloc, addr), e(Action::FreeRequested, addr), e(Action::FreeCompleted, addr)]);
    for (k, s) in [(0, &snap), (1, &snap), (2, &spiked)] {
        allocsim_trace::write_trace(s, &dir.join(format!("rank{k}.pickle.gz"))).unwrap();
    }
    std::fs::write(dir.join("notes.txt"), "not a snapshot").unwrap();
    let v = phases_json(&["compare", dir.to_str().unwrap(), "--json"]);
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 3, "the three snapshots, not the notes");
    assert_eq!(u64s(&v["median_iteration_peaks"]), step_peaks);
    let s = &v["first_spike"];
    assert!(s["file"].as_str().unwrap().ends_with("rank2.pickle.gz"), "{s}");
    assert_eq!(s["iteration"].as_u64(), Some(6));
    assert!(s["ratio"].as_f64().unwrap() >= 1.1);
    for r in &rows[..2] {
        assert_eq!(u64s(&r["iteration_peaks"]), step_peaks);
        assert!(r["vs_median"].as_array().unwrap().iter().all(|x| x.as_f64() == Some(1.0)));
    }
    assert!(v["first_oom"].is_null());
    // The same through a glob.
    let glob = dir.join("rank*.pickle.gz");
    let g = phases_json(&["compare", glob.to_str().unwrap(), "--json"]);
    assert_eq!(g["first_spike"], v["first_spike"]);
    // A glob that matches nothing is a user error.
    common::user_error(&["compare", dir.join("nothing*.pickle").to_str().unwrap()], &["no file matches"]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The run that ran out of memory is named, with the recorded time of its `oom` entry: replayed
/// under each file's own budget (inferred from its trace) it runs out where it did; replayed with
/// room enough for both (`--capacity`), no replay runs out and the recorded OOM is named.
#[test]
fn compare_ranks_names_the_oom() {
    let snap = allocsim_trace::read_trace(&root("traces/field/llama_oom__default.pickle.gz")).unwrap();
    let t = &snap.device_traces[0];
    let i = t.iter().position(|e| e.action == allocsim_trace::Action::Oom).unwrap();
    let request = t[..i].iter().filter(|e| matches!(e.action, allocsim_trace::Action::Alloc | allocsim_trace::Action::Oom)).count() as u64;
    let files = ["traces/field/llama_train__default.pickle.gz", "traces/field/llama_oom__default.pickle.gz"];
    let v = phases_json(&["compare", "--ranks", files[0], files[1], "--json"]);
    let o = &v["first_oom"];
    assert!(o["file"].as_str().unwrap().ends_with("llama_oom__default.pickle.gz"), "{o}");
    assert_eq!((o["recorded"].as_bool(), o["request"].as_u64(), o["time_us"].as_i64()), (Some(false), Some(request), Some(t[i].time_us)));
    let v = phases_json(&["compare", "--ranks", files[0], files[1], "--capacity", "100GiB", "--json"]);
    let o = &v["first_oom"];
    assert!(o["file"].as_str().unwrap().ends_with("llama_oom__default.pickle.gz"), "{o}");
    assert_eq!((o["recorded"].as_bool(), o["request"].as_u64(), o["time_us"].as_i64()), (Some(true), None, Some(t[i].time_us)));
}

/// A process that drives two devices records its `record_function` scopes with the device
/// current at the time: device 1's trace is cut by annotations recorded on device 0.
#[test]
fn annotations_of_another_device_serve_when_the_device_has_none() {
    let mut snap = allocsim_trace::read_trace(&root("traces/field/tiny_annotations__default.pickle.gz")).unwrap();
    assert!(snap.annotations.iter().all(|a| a.device == 0));
    let t = std::mem::take(&mut snap.device_traces[0]);
    snap.device_traces.push(t);
    for s in &mut snap.segments {
        s.device = 1;
    }
    let p = Prepared::new(&snap, Some(1), 150_109_880_320, None).unwrap();
    let l = Layout::of(&p, None).unwrap();
    assert!(matches!(l.source, Source::Annotation { .. }));
    assert_eq!(l.iterations.len(), 3);
}

/// Two real data-parallel ranks (`tools/record_ranks.py --backend gloo --one-gpu`: two processes,
/// each with its own caching allocator, on one H200), where rank 1's step 6 ran at 4× the
/// sequence length. `compare` names rank 1 and iteration 6; every iteration peak of each rank is
/// the `max_memory_allocated()` its process read after that step.
#[test]
fn compare_real_ranks_names_the_rank_and_step_that_spiked() {
    let dir = root("traces/field/ranks");
    let v = phases_json(&["compare", dir.to_str().unwrap(), "--json"]);
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for (r, row) in rows.iter().enumerate() {
        let m: Value = serde_json::from_str(&std::fs::read_to_string(dir.join(format!("rank{r}.json"))).unwrap()).unwrap();
        assert!(row["file"].as_str().unwrap().ends_with(&format!("rank{r}.pickle.gz")));
        assert_eq!(u64s(&row["iteration_peaks"]), u64s(&m["step_peaks"]), "rank {r}");
        assert_eq!(row["peak_allocated"].as_u64(), m["global_peak_allocated"].as_u64(), "rank {r}");
    }
    let s = &v["first_spike"];
    assert!(s["file"].as_str().unwrap().ends_with("rank1.pickle.gz"), "{s}");
    assert_eq!(s["iteration"].as_u64(), Some(6));
}

/// The repeats inside one step are not iterations. The batch-size finder of
/// `devfull_findbatch__expandable` ran out of memory in each forward pass it tried and never
/// finished a step (its .json has no `fitting_batch`; the trace no optimizer step): the 6
/// encoder layers of those forward passes repeat 22 times at regular distances, but each keeps
/// its activations, so the live memory climbs from one to the next and they are not iterations.
#[test]
fn forward_layers_are_not_iterations() {
    let name = "devfull_findbatch__expandable";
    assert!(meta(name)["extra"].get("fitting_batch").is_none(), "the run never fitted a batch");
    let snap = allocsim_trace::read_trace(&root(&format!("traces/field/{name}.pickle.gz"))).unwrap();
    let p = Prepared::new(&snap, None, 150_109_880_320, None).unwrap();
    let l = Layout::of(&p, None).unwrap();
    assert!(matches!(l.source, Source::Whole { .. }), "{:?}", l.source);
    assert_eq!(l.iterations.len(), 1);
    // The regions stay: every forward pass it tried.
    assert_eq!(l.regions.iter().filter(|r| r.name == "forward").count(), 5);
}

/// The first step of the Llama run (annotations left out) is one iteration; its first three
/// steps are the three iterations the optimizer's annotations make.
#[test]
fn layers_inside_a_step_are_not_iterations() {
    let snap = allocsim_trace::read_trace(&root("traces/field/llama_train__default.pickle.gz")).unwrap();
    let p = Prepared::new(&snap, None, 150_109_880_320, None).unwrap();
    let steps = Layout::of(&p, None).unwrap();
    for (n, want) in [(1usize, 1usize), (3, 3)] {
        let end = steps.iterations[n - 1].span.end_entry as usize;
        let trace = &p.trace[..end];
        let requests: Vec<_> = p.program.requests.iter().copied().filter(|r| (r.trace_index as usize) < end).collect();
        let l = Layout::from_parts(trace, &requests, &[], None, &|q| p.call_site(q)).unwrap();
        assert_eq!(l.iterations.len(), want, "the first {n} steps: {:?}", l.source);
        if want == 1 {
            assert!(matches!(l.source, Source::Whole { .. }), "{:?}", l.source);
        } else {
            let starts = |l: &Layout| l.iterations.iter().map(|i| i.span.request_start).collect::<Vec<_>>();
            assert_eq!(starts(&l), starts(&steps)[..n], "the first {n} steps");
        }
    }
}
