//! `allocsim synth`: a seeded synthetic snapshot (see `allocsim_synth`).

use std::path::PathBuf;
use std::time::Instant;

use allocsim_model::format::format_size;
use allocsim_synth::{Spec, Workload};

use crate::common::UserError;
use crate::output::Io;
use crate::size::parse_size;

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum WorkloadArg {
    /// Transformer training steps: parameters and Adam states once, then per step activations
    /// through the layers, freed in reverse by the backward, gradients, workspaces.
    Training,
    /// Training with a sequence length drawn per step (activations scale with it).
    Varlen,
    /// LLM inference: a K/V cache per request and layer, re-allocated larger every few tokens;
    /// requests arrive and finish.
    Kvcache,
    /// Log-uniform sizes (512 B .. --max-size), random frees, bounded live set.
    Random,
}

#[derive(clap::Args)]
pub struct SynthArgs {
    #[arg(long, value_enum)]
    pub workload: WorkloadArg,
    /// Number of allocation requests (`alloc` entries): e.g. `100000`, `250k`, `10M` (decimal).
    #[arg(long, value_parser = parse_count, default_value = "100000")]
    pub requests: u64,
    /// The same seed (and options) gives the same trace, byte for byte.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// CUDA streams (1..=8). Training: all-reduce buckets on the extra streams, their gradients
    /// freed late (`record_stream`); kvcache: requests spread over the streams; random: random
    /// streams, some frees completing late.
    #[arg(long, default_value_t = 1)]
    pub streams: u32,
    /// Random workload: at most this many live blocks.
    #[arg(long, default_value_t = allocsim_synth::DEFAULT_LIVE_BLOCKS)]
    pub live_blocks: u64,
    /// Random workload: at most this many live bytes.
    #[arg(long, value_parser = parse_size, default_value = "64GiB")]
    pub live_bytes: u64,
    /// Random workload: the largest request.
    #[arg(long, value_parser = parse_size, default_value = "256MiB")]
    pub max_size: u64,
    /// Leave the Python stacks out (smaller JSON Lines; like `context=None`).
    #[arg(long)]
    pub no_frames: bool,
    /// Output: `.jsonl` (streamed, constant memory), `.jsonl.gz`, `.pickle` or `.pickle.gz` (a torch
    /// snapshot; built in memory first). `validate` does not apply to the result: a synthetic trace
    /// has no segment events to check; `replay`, `sweep`, `fit`, `explain`, `report` work.
    #[arg(short, long)]
    pub output: PathBuf,
}

/// A count with an optional decimal suffix: `1000`, `10k`, `2.5M`, `1G`.
fn parse_count(s: &str) -> Result<u64, String> {
    let t = s.trim().replace('_', "");
    let (num, mult) = match t.char_indices().last() {
        Some((i, 'k' | 'K')) => (&t[..i], 1e3),
        Some((i, 'M')) => (&t[..i], 1e6),
        Some((i, 'G')) => (&t[..i], 1e9),
        _ => (&t[..], 1.0),
    };
    if mult == 1.0 {
        return num.parse::<u64>().map_err(|_| format!("not a count: {s:?} (e.g. 100000, 250k, 10M)"));
    }
    let v: f64 = num.parse().map_err(|_| format!("not a count: {s:?} (e.g. 100000, 250k, 10M)"))?;
    if !(0.0..1e15).contains(&v) {
        return Err(format!("count {s:?} out of range"));
    }
    Ok((v * mult).round() as u64)
}

pub fn cmd_synth(a: &SynthArgs, io: &mut Io<'_>) -> Result<i32, UserError> {
    let workload = match a.workload {
        WorkloadArg::Training => Workload::Training,
        WorkloadArg::Varlen => Workload::Varlen,
        WorkloadArg::Kvcache => Workload::KvCache,
        WorkloadArg::Random => Workload::Random,
    };
    let spec = Spec {
        workload,
        requests: a.requests,
        seed: a.seed,
        streams: a.streams,
        live_blocks: a.live_blocks,
        live_bytes: a.live_bytes,
        max_size: a.max_size,
        frames: !a.no_frames,
    };
    spec.check().map_err(UserError)?;
    let t0 = Instant::now();
    let st = allocsim_synth::write_file(&spec, &a.output)?;
    let bytes = std::fs::metadata(&a.output).map(|m| m.len()).unwrap_or(0);
    writeln!(
        io.err,
        "wrote {} ({}): {} requests, {} trace entries of the {} workload (seed {}, {} stream{}) in {:.1} s; peak live {} in {} blocks; {} late-completing frees",
        a.output.display(),
        format_size(bytes),
        st.requests,
        st.entries,
        workload.name(),
        a.seed,
        a.streams,
        if a.streams == 1 { "" } else { "s" },
        t0.elapsed().as_secs_f64(),
        format_size(st.peak_live_bytes),
        st.peak_live_blocks,
        st.deferred_frees,
    )?;
    writeln!(io.err, "  synthetic: no segment events, so `allocsim validate` has nothing to check; replay, sweep, fit, explain and report apply")?;
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::parse_count;
    #[test]
    fn counts() {
        assert_eq!(parse_count("1000"), Ok(1000));
        assert_eq!(parse_count("250k"), Ok(250_000));
        assert_eq!(parse_count("2.5M"), Ok(2_500_000));
        assert_eq!(parse_count("50M"), Ok(50_000_000));
        assert!(parse_count("M").is_err());
        assert!(parse_count("ten").is_err());
    }
}
