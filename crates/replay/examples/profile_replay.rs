//! Replays a trace many times under one config (for `perf`): `profile_replay TRACE [CONF] [N]`.
use allocsim_model::AllocatorConfig;
use allocsim_replay::Prepared;
use std::io::Read;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let bytes = std::fs::read(&args[1]).unwrap();
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(&bytes[..]).read_to_end(&mut raw).unwrap();
    let snap = allocsim_trace::snapshot::from_pickle(&raw).unwrap();
    let p = Prepared::new(&snap, None, 150_109_880_320, None).unwrap();
    let cfg = AllocatorConfig::parse(args.get(2).map(|s| s.as_str()).unwrap_or("")).unwrap();
    let n: usize = args.get(3).map(|s| s.parse().unwrap()).unwrap_or(50);
    if std::env::var("SIZES").is_ok() {
        sizes(&p);
        return;
    }
    let pl = p.recorded_placement();
    let t = std::time::Instant::now();
    let mut x = 0;
    for _ in 0..n {
        x += p.replay(&cfg, None, pl.clone()).peak_reserved;
    }
    let dt = t.elapsed().as_secs_f64();
    let reqs = p.program.requests.len() as f64 * n as f64;
    eprintln!("{x} {:.1} ns/request, {:.2} M req/s", dt * 1e9 / reqs, reqs / dt / 1e6);
}

#[allow(dead_code)]
fn sizes(p: &Prepared) {
    use allocsim_replay::replay::{EmptyCacheCalls, ReplayOptions, replay_observed};
    let opts =
        ReplayOptions { config: p.own.clone(), capacity: None, device_memory: p.device_memory, placement: p.recorded_placement(), outside: Default::default() };
    let dev = allocsim_model::SimDevice::new(opts.device_memory, opts.placement.clone());
    let mut hist = std::collections::BTreeMap::new();
    let flags = EmptyCacheCalls::Given(&p.empty_cache);
    let _ = flags;
    replay_observed(
        &p.program,
        &opts,
        dev,
        |_, i| p.empty_cache[i],
        |a, i| {
            if i % 97 == 0 {
                let l = a.pools[0].blocks.len();
                let s = a.pools[1].blocks.len();
                *hist.entry((l / 64, s / 64)).or_insert(0) += 1;
            }
        },
    );
    eprintln!("(large/64, small/64) -> samples: {hist:?}");
}
