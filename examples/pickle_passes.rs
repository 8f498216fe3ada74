//! Times each pass `allocsim replay` makes over a snapshot pickle, on its own:
//!     cargo run --release --example pickle_passes -- FILE
//! (the scan, the entries' decoding, the compact read, the first pass that keeps small files, and
//! the whole `replay_file`), to see where a replay's time goes.
use std::path::Path;
use std::time::Instant;

use allocsim_commands::file::{ReplayFile, replay_file};
use allocsim_commands::replay::ReplayOptions;
use allocsim_trace::pickle_stream::{FirstPass, PickleFile};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args().nth(1).ok_or("usage: pickle_passes FILE")?;
    let file = PickleFile::open(Path::new(&path))?.ok_or("not a pickle")?;
    let t = Instant::now();
    let scan = file.scan()?;
    println!("scan             {:>8.3} s  ({} segment events)", t.elapsed().as_secs_f64(), scan.segment_entries.iter().map(Vec::len).sum::<usize>());
    let t = Instant::now();
    let mut n = 0u64;
    for item in file.events()? {
        item?;
        n += 1;
    }
    println!("events           {:>8.3} s  ({n} entries)", t.elapsed().as_secs_f64());
    let t = Instant::now();
    let snap = file.compact()?;
    println!("compact          {:>8.3} s  ({} entries)", t.elapsed().as_secs_f64(), snap.device_traces.iter().map(Vec::len).sum::<usize>());
    drop(snap);
    let t = Instant::now();
    let first = file.first_pass(1 << 20)?;
    println!("first_pass       {:>8.3} s  ({})", t.elapsed().as_secs_f64(), if matches!(first, FirstPass::Whole(_)) { "whole" } else { "scan" });
    drop(first);
    let t = Instant::now();
    let answer = replay_file(ReplayFile::new(Path::new(&path)), &ReplayOptions::default(), &mut |_| {})?;
    println!("replay_file      {:>8.3} s", t.elapsed().as_secs_f64());
    drop(answer);
    let t = Instant::now();
    let answer = replay_file(ReplayFile { compact_first: 0, ..ReplayFile::new(Path::new(&path)) }, &ReplayOptions::default(), &mut |_| {})?;
    println!("replay_file scan {:>8.3} s  (scanned first whatever the size)", t.elapsed().as_secs_f64());
    drop(answer);
    Ok(())
}
