//! The GPU backend. Without a CUDA driver (CI) only the clean error is checked; with one, real traces
//! are replayed on GPU 0 and every segment event must move the device's used memory by exactly the
//! model's reserved delta.

use std::path::PathBuf;

use allocsim_cuda::{CudaDevice, CudaError, driver_present, replay_on_gpu};
use allocsim_replay::{ReplaySpec, run};

/// `traces/` of the repository; `./traces` when the test binary runs elsewhere (on the GPU machine,
/// from the repository root).
fn traces_dir() -> PathBuf {
    let d = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../traces");
    if d.is_dir() { d } else { PathBuf::from("traces") }
}

/// The GPU, or `None` (and why) where there is none.
fn gpu() -> Option<CudaDevice> {
    match CudaDevice::new(0) {
        Ok(d) => Some(d),
        Err(e @ CudaError::NoDriver) => {
            assert!(!driver_present());
            eprintln!("skipped: {e}");
            None
        }
        Err(e) => {
            eprintln!("skipped: a CUDA driver is present but GPU 0 is not usable: {e}");
            None
        }
    }
}

#[test]
fn no_driver_is_a_clean_error() {
    if driver_present() {
        eprintln!("skipped: a CUDA driver is present");
        return;
    }
    let e = CudaDevice::new(0).expect_err("no driver, no device");
    assert_eq!(e, CudaError::NoDriver);
    assert_eq!(e.to_string(), "no CUDA driver found (libcuda.so could not be loaded)");
    let snap = allocsim_trace::read_trace(&traces_dir().join("emptycache__default__0M.pickle.gz")).unwrap();
    let r = run(&snap, &ReplaySpec::default()).unwrap();
    let e = replay_on_gpu(&r.program, &r.options, &r.outcome.empty_cache, 0).expect_err("no driver");
    assert_eq!(e, CudaError::NoDriver);
}

/// The largest trace in `traces/` (by requests) and the multistream one, under their own settings and
/// under `expandable_segments:True`.
#[test]
fn real_traces_match_the_device_on_a_gpu() {
    let Some(dev) = gpu() else { return };
    eprintln!("GPU 0: {} ({} bytes, page granularity {})", dev.context().name().unwrap(), dev.total(), dev.granularity());
    drop(dev);
    let mut traces: Vec<(usize, PathBuf)> = std::fs::read_dir(traces_dir())
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.to_string_lossy().ends_with(".pickle.gz"))
        .map(|p| {
            let snap = allocsim_trace::read_trace(&p).unwrap();
            let n = run(&snap, &ReplaySpec::default()).unwrap().program.requests.len();
            (n, p)
        })
        .collect();
    traces.sort();
    let mut chosen = vec![traces.last().unwrap().1.clone()];
    let ms = traces_dir().join("multistream__default__0M.pickle.gz");
    if ms.exists() && !chosen.contains(&ms) {
        chosen.push(ms);
    }
    for path in chosen {
        let snap = allocsim_trace::read_trace(&path).unwrap();
        for config in [None, Some("expandable_segments:True".to_string())] {
            let spec = ReplaySpec { config: config.clone(), ..ReplaySpec::default() };
            let r = run(&snap, &spec).unwrap();
            let rep = replay_on_gpu(&r.program, &r.options, &r.outcome.empty_cache, 0).unwrap();
            eprintln!("{} under {:?}:\n{rep}", path.display(), config);
            assert!(rep.segment_events > 0, "{}: no segment events", path.display());
            assert_eq!(rep.events_checked, rep.segment_events);
            assert!(rep.mismatches.is_empty(), "{}: {:?}", path.display(), rep.mismatches);
            assert!(rep.driver_errors.is_empty(), "{}: {:?}", path.display(), rep.driver_errors);
            assert_eq!(rep.leaked_bytes, 0);
        }
    }
}
