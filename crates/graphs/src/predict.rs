//! Synthesizing the rounds for other batch sizes and replaying them.

use allocsim_model::allocator::Route;
use allocsim_model::{AllocatorConfig, Placement, SimDevice};
use allocsim_replay::run::Limits;
use allocsim_replay::{Op, Prepared, Program, Request};
use serde::Serialize;

use crate::GraphsError;
use allocsim_shape::fit::SizeError;
use allocsim_shape::pattern::{Ref, TOp, Template};

use crate::learn::{Recording, SlotSize};

/// A program for asked batch sizes: the recorded prologue, then one round per batch size.
#[derive(Clone, Debug)]
pub struct Synthesized {
    pub program: Program,
    /// One flag per op: an `empty_cache()` call.
    pub empty_cache: Vec<bool>,
    /// The op index each round ends before (its last op is `end − 1`).
    pub round_ends: Vec<usize>,
    /// The op index the prologue ends before.
    pub prologue_end: usize,
}

impl Recording {
    /// The trace's prologue followed by one round per batch size of `batches` (in that order):
    /// the first with the first recorded round's pattern, the others with the steady one, each
    /// request's size from its fit at that batch size.
    pub fn synthesize(&self, p: &Prepared, batches: &[u64]) -> Result<Synthesized, GraphsError> {
        if batches.is_empty() {
            return Err(GraphsError::Usage("no batch sizes to predict".into()));
        }
        if let Some(&b) = batches.iter().find(|&&b| b == 0) {
            return Err(GraphsError::Usage(format!("batch size {b}: batch sizes are at least 1")));
        }
        let src = &p.program;
        let mut prog = Program {
            requests: src.requests[..self.prologue_requests as usize].to_vec(),
            ops: src.ops[..self.prologue_ops].to_vec(),
            unknown_frees: 0,
            private_pools: src.private_pools.clone(),
            pool_actions: src.pool_actions.iter().copied().filter(|&(oi, _)| (oi as usize) < self.prologue_ops).collect(),
            initial: src.initial.clone(),
            reconstruct_error: src.reconstruct_error.clone(),
        };
        let mut empty_cache: Vec<bool> = p.empty_cache[..self.prologue_ops].to_vec();
        let mut round_ends = Vec::with_capacity(batches.len());
        for (i, &bs) in batches.iter().enumerate() {
            let steady: Vec<SlotSize>;
            let (t, sizes) = if i == 0 {
                (&self.first, &self.first_sizes)
            } else {
                steady = (0..self.steady.slots.len() as u32).map(SlotSize::Steady).collect();
                (&self.steady, &steady)
            };
            self.instantiate(p, t, sizes, bs, &mut prog, &mut empty_cache)?;
            round_ends.push(prog.ops.len());
        }
        Ok(Synthesized { program: prog, empty_cache, round_ends, prologue_end: self.prologue_ops })
    }

    fn instantiate(&self, p: &Prepared, t: &Template, sizes: &[SlotSize], bs: u64, prog: &mut Program, empty_cache: &mut Vec<bool>) -> Result<(), GraphsError> {
        let base = prog.requests.len() as u32;
        for (s, size) in t.slots.iter().zip(sizes) {
            let size = match *size {
                SlotSize::Fixed(b) => b,
                SlotSize::Steady(k) => self.fits[k as usize].at(bs).map_err(|e| {
                    let v = match e {
                        SizeError::NotPositive(v) => v.to_string(),
                        SizeError::Overflow => "too many".to_string(),
                    };
                    GraphsError::Usage(format!(
                        "batch size {bs}: request {} (as recorded) would be {v} bytes by the fit through the recorded sizes; predicting that far outside the recorded batch sizes ({}–{}) is not possible",
                        s.recorded,
                        self.range().0,
                        self.range().1
                    ))
                })?,
            };
            let rec = &p.program.requests[s.recorded as usize];
            prog.requests.push(Request {
                size,
                stream: s.key.stream,
                route: if s.key.private { Route::Private(self.pool) } else { Route::Default },
                recorded_oom: false,
                recorded_addr: 0,
                trace_index: rec.trace_index,
                stack: rec.stack,
                checkpoint: false,
            });
        }
        let r = |x: Ref| match x {
            Ref::Local(k) => base + k,
            Ref::Earlier(q) | Ref::Pre(q) => q,
        };
        for op in &t.ops {
            let (op, ec) = match *op {
                TOp::Malloc(k) => (Op::Malloc(base + k), false),
                TOp::Free { r: x, deferred } => (Op::Free { req: r(x), deferred }, false),
                TOp::Complete(x) => (Op::Complete(r(x)), false),
                TOp::EmptyCache => (Op::ReleaseRun { start: 0, end: 0 }, true),
            };
            prog.ops.push(op);
            empty_cache.push(ec);
        }
        Ok(())
    }
}

/// The memory after one round (its capture ended), as `torch.cuda.memory_reserved()` and
/// `memory_allocated()` read it then.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Reading {
    pub reserved: u64,
    pub allocated: u64,
    /// The graph pool's segments.
    pub pool_reserved: u64,
    pub pool_segments: u32,
}

/// One asked capture's prediction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct CaptureReading {
    pub batch: u64,
    #[serde(flatten)]
    pub after: Reading,
    /// Reserved memory's highest point during the round (warm-up and capture).
    pub round_peak_reserved: u64,
    /// Outside the recorded batch sizes' range.
    pub extrapolated: bool,
    /// Requests that ran out of memory in this round.
    pub ooms: u32,
}

/// The replay of a [`Synthesized`] program.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Prediction {
    /// Before the first round (after what the job did before its first warm-up).
    pub before: Reading,
    pub captures: Vec<CaptureReading>,
    /// `reserved_bytes.all.peak` over the whole run, and the round (index) it was first reached in
    /// (`None`: in the prologue).
    pub peak_reserved: u64,
    pub peak_round: Option<usize>,
    pub ooms: u32,
}

/// Replays `s` (from `rec`, for `batches`) under `config`, `limits` and `placement`.
pub fn replay(p: &Prepared, rec: &Recording, s: &Synthesized, batches: &[u64], config: &AllocatorConfig, limits: &Limits, placement: Placement) -> Prediction {
    let opts = p.options(config, limits, placement);
    let device = SimDevice::new(opts.device_memory, opts.placement.clone());
    let (lo, hi) = rec.range();
    let n = s.round_ends.len();
    let mut before = Reading::default();
    let mut after = vec![Reading::default(); n];
    let mut round_peak = vec![0u64; n];
    let (mut best, mut best_round) = (0u64, None);
    let pool = rec.pool;
    let reading = |alloc: &allocsim_model::CachingAllocator<SimDevice>| reading_of(alloc, pool);
    let outcome = allocsim_replay::replay_observed(
        &s.program,
        &opts,
        device,
        |_, oi| s.empty_cache.get(oi).copied().unwrap_or(false),
        |alloc, oi| {
            // Reserved memory only rises at the end of a malloc (a malloc's own releases come
            // before its new segment): its highest points are seen after ops.
            let cur = alloc.stats.reserved_bytes.all().current as u64;
            let in_round = (oi >= s.prologue_end).then(|| s.round_ends.partition_point(|&e| e <= oi)).filter(|&k| k < n);
            if cur > best {
                best = cur;
                best_round = in_round;
            }
            if let Some(k) = in_round {
                round_peak[k] = round_peak[k].max(cur);
            }
            if oi + 1 == s.prologue_end {
                before = reading(alloc);
            }
            if let Some(k) = s.round_ends.iter().position(|&e| e == oi + 1) {
                after[k] = reading(alloc);
            }
        },
    );
    let mut ooms = vec![0u32; n];
    // The round of each request's malloc.
    let mut round_of = vec![None; s.program.requests.len()];
    for (oi, op) in s.program.ops.iter().enumerate() {
        if let Op::Malloc(q) = *op
            && oi >= s.prologue_end
        {
            round_of[q as usize] = Some(s.round_ends.partition_point(|&e| e <= oi));
        }
    }
    for o in &outcome.ooms {
        if let Some(Some(k)) = round_of.get(o.request as usize)
            && *k < n
        {
            ooms[*k] += 1;
        }
    }
    let captures = batches
        .iter()
        .enumerate()
        .map(|(k, &batch)| CaptureReading {
            batch,
            after: after[k],
            round_peak_reserved: round_peak[k].max(after[k].reserved),
            extrapolated: batch < lo || batch > hi,
            ooms: ooms[k],
        })
        .collect();
    Prediction { before, captures, peak_reserved: outcome.peak_reserved, peak_round: best_round, ooms: outcome.ooms.len() as u32 }
}

/// The readings after each recorded round in the replay of the trace itself (its own requests,
/// settings, `empty_cache()` calls and addresses), which `validate` checks against the recording.
pub fn recorded_readings(p: &Prepared, rec: &Recording) -> Vec<Reading> {
    let opts = p.options(&p.own, &p.limits(None), p.recorded_placement());
    let device = SimDevice::new(opts.device_memory, opts.placement.clone());
    let mut out = vec![Reading::default(); rec.rounds.len()];
    let pool = rec.pool;
    allocsim_replay::replay_observed(
        &p.program,
        &opts,
        device,
        |_, oi| p.empty_cache.get(oi).copied().unwrap_or(false),
        |alloc, oi| {
            if let Some(k) = rec.rounds.iter().position(|r| r.ops.1 == oi + 1) {
                out[k] = reading_of(alloc, pool);
            }
        },
    );
    out
}

fn reading_of(alloc: &allocsim_model::CachingAllocator<SimDevice>, pool: allocsim_model::allocator::MempoolId) -> Reading {
    let (mut pool_reserved, mut pool_segments) = (0, 0);
    for seg in alloc.segments() {
        if seg.pool_id == pool {
            pool_reserved += seg.total_size;
            pool_segments += 1;
        }
    }
    Reading {
        reserved: alloc.stats.reserved_bytes.all().current as u64,
        allocated: alloc.stats.allocated_bytes.all().current as u64,
        pool_reserved,
        pool_segments,
    }
}
