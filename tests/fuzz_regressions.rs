//! The fuzz targets' bodies (`fuzz/src/lib.rs`: `decode` and `decode_replay`) over every kept
//! crasher (`tests/fixtures/fuzz`) and every seed (`fuzz/seeds`): none may panic. The fuzz crate is
//! a workspace of its own (it needs nightly for `cargo fuzz`), so the bodies are repeated here;
//! keep the two in step.

use std::path::Path;

const MAX_ENTRIES: usize = 4096;

fn decode(data: &[u8]) {
    if let Ok(snap) = allocsim_trace::read_trace_bytes(data) {
        let mut out = Vec::new();
        let _ = allocsim_trace::jsonl::write(&snap, &mut out);
    }
}

fn decode_replay(data: &[u8]) {
    let Ok(mut snap) = allocsim_trace::read_trace_bytes(data) else { return };
    for t in &mut snap.device_traces {
        t.truncate(MAX_ENTRIES);
    }
    for device in 0..snap.device_traces.len().min(4) {
        let spec = allocsim_replay::ReplaySpec { device: Some(device), ..Default::default() };
        if let Ok(r) = allocsim_replay::run(&snap, &spec) {
            let _ = allocsim_replay::validate(&r);
        }
    }
}

fn inputs() -> Vec<(String, Vec<u8>)> {
    let mut v = Vec::new();
    for dir in ["tests/fixtures/fuzz", "fuzz/seeds"] {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
        let Ok(rd) = std::fs::read_dir(&dir) else { continue };
        for e in rd.flatten() {
            let p = e.path();
            if p.is_file() && p.extension().is_none_or(|x| x != "md") {
                v.push((p.display().to_string(), std::fs::read(&p).unwrap()));
            }
        }
    }
    v.sort();
    v
}

#[test]
fn kept_inputs_neither_panic_nor_hang() {
    let inputs = inputs();
    assert!(inputs.len() >= 40, "expected the fuzz seeds and crashers, found {}", inputs.len());
    for (name, data) in &inputs {
        let t = std::time::Instant::now();
        if std::panic::catch_unwind(|| {
            decode(data);
            decode_replay(data);
        })
        .is_err()
        {
            panic!("{name} panics");
        }
        assert!(t.elapsed().as_secs() < 20, "{name} took {:?}", t.elapsed());
    }
}
