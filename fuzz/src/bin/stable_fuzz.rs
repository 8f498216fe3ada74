//! A stable-Rust stand-in for `cargo fuzz run` (no nightly, no sanitizers): runs a target over
//! every file of a corpus directory, then over random mutations of them for a fixed time, and
//! saves any input that panics to `artifacts/<target>/crash-<n>`.
//!
//!     cargo run --release --bin stable_fuzz -- decode corpus/decode 600
//!
//! Mutations: bit flips, byte sets to interesting values (0, 0xff, 0x7f, 0x80), deletions,
//! duplications of a range, splices with another corpus file, and truncations. Inputs that decode
//! (for `decode_replay`) are added to the in-memory corpus, a crude stand-in for coverage.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::time::{Duration, Instant};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        if n == 0 { 0 } else { (self.next() % n as u64) as usize }
    }
}

fn mutate(r: &mut Rng, input: &[u8], other: &[u8]) -> Vec<u8> {
    let mut v = input.to_vec();
    for _ in 0..1 + r.below(4) {
        let n = v.len();
        match r.below(7) {
            0 if n > 0 => {
                let i = r.below(n);
                v[i] ^= 1 << r.below(8);
            }
            1 if n > 0 => {
                let i = r.below(n);
                v[i] = [0, 0xff, 0x7f, 0x80, b'J', b'K'][r.below(6)];
            }
            2 if n > 1 => {
                let i = r.below(n);
                let len = 1 + r.below((n - i).min(64));
                v.drain(i..i + len);
            }
            3 if n > 1 => {
                let i = r.below(n);
                let len = 1 + r.below((n - i).min(64));
                let chunk = v[i..i + len].to_vec();
                let at = r.below(n);
                v.splice(at..at, chunk);
            }
            4 if !other.is_empty() && n > 0 => {
                let i = r.below(n);
                let j = r.below(other.len());
                v.truncate(i);
                v.extend_from_slice(&other[j..]);
            }
            5 if n > 0 => v.truncate(r.below(n)),
            _ => {
                let i = r.below(n + 1);
                v.insert(i, r.next() as u8);
            }
        }
    }
    v
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 4 {
        eprintln!("usage: stable_fuzz decode|decode_replay CORPUS_DIR SECONDS [SEED]");
        std::process::exit(2);
    }
    let target: fn(&[u8]) = match args[1].as_str() {
        "decode" => allocsim_fuzz::decode,
        "decode_replay" => allocsim_fuzz::decode_replay,
        t => {
            eprintln!("unknown target {t}");
            std::process::exit(2);
        }
    };
    let dir = PathBuf::from(&args[2]);
    let secs: u64 = args[3].parse().expect("seconds");
    let mut rng = Rng(args.get(4).and_then(|s| s.parse().ok()).unwrap_or(1));
    let mut corpus: Vec<Vec<u8>> = std::fs::read_dir(&dir)
        .map(|d| d.filter_map(|e| e.ok()).filter_map(|e| std::fs::read(e.path()).ok()).collect())
        .unwrap_or_default();
    if corpus.is_empty() {
        corpus.push(Vec::new());
    }
    std::panic::set_hook(Box::new(|_| {}));
    let artifacts = PathBuf::from("artifacts").join(&args[1]);
    let (mut runs, mut crashes) = (0u64, 0u64);
    let deadline = Instant::now() + Duration::from_secs(secs);
    let start_len = corpus.len();
    for input in corpus.clone() {
        if catch_unwind(AssertUnwindSafe(|| target(&input))).is_err() {
            crashes += 1;
            std::fs::create_dir_all(&artifacts).ok();
            std::fs::write(artifacts.join(format!("crash-corpus-{crashes}")), &input).ok();
        }
        runs += 1;
    }
    while Instant::now() < deadline {
        let a = rng.below(corpus.len());
        let b = rng.below(corpus.len());
        let input = mutate(&mut rng, &corpus[a], &corpus[b]);
        if catch_unwind(AssertUnwindSafe(|| target(&input))).is_err() {
            crashes += 1;
            std::fs::create_dir_all(&artifacts).ok();
            std::fs::write(artifacts.join(format!("crash-{crashes}")), &input).ok();
        } else if corpus.len() < 4096 && rng.below(64) == 0 && allocsim_trace::read_trace_bytes(&input).is_ok() {
            corpus.push(input);
        }
        runs += 1;
    }
    println!("{} runs, {} crashes, corpus {} → {} inputs", runs, crashes, start_len, corpus.len());
    std::process::exit(if crashes > 0 { 1 } else { 0 });
}
