//! allocsim-graphs: what capturing CUDA graphs for other batch sizes into one shared graph pool
//! would reserve, learnt from a trace that captured a few and answered by replaying through the
//! model.
//!
//! Serving engines capture one graph per batch size, largest first, into one pool
//! (`pool = torch.cuda.graph_pool_handle()`; per batch size: an eager warm-up on a side stream,
//! then `with torch.cuda.graph(g, pool=pool): y = model(x)`). The trace of such a job holds, per
//! capture, a **round**: the warm-up's requests (default pools), an `empty_cache()` (made by
//! `torch.cuda.graph`), the capture's requests (routed to the graph pool on the capture stream)
//! and their frees. The rules:
//!
//! * **Captures.** The requests routed to a private pool (`allocsim_replay::pools` infers the
//!   routes; a graph pool alive at the end is named by the final segments) form runs of
//!   consecutive requests, one per capture. One private pool only; the recorded batch sizes are
//!   given (a trace does not record them), one per capture, in order.
//! * **Rounds.** Round `k ≥ 1` runs from the first request after capture `k − 1` to the last op
//!   before round `k + 1`; the last round ends with the frees of its own requests that follow its
//!   last one. The ops are kept as a pattern: each request by its stream, pool and recorded stack
//!   (not its size), each free by the request it frees, `empty_cache()` calls (release runs the
//!   trace's own replay read as such) where any round made one; release runs a malloc made itself
//!   are left to the model.
//! * **One pattern.** Every round after the first must repeat round 1's pattern (the last round
//!   up to its last request). Where one does not (a capture whose op sequence depends on the
//!   batch size), the answer is that, not a guess.
//! * **The first round** makes one-time requests besides (library workspaces for the new
//!   streams, a generator's graph state). Round 1's requests are found in it from its end
//!   backwards, by stream, pool, stack and — with three or more captures — by the size the later
//!   rounds' sizes give at its batch size; its other requests keep their recorded size at any
//!   batch size, and whatever precedes the first one found is the **prologue** (weights, …),
//!   replayed as recorded.
//! * **Sizes.** Each request's requested size, over the rounds, as a function of the batch size:
//!   constant, exactly affine (`a + b·bs` through every point), else piecewise linear between the
//!   recorded points (said in the answer).
//! * **Prediction.** The prologue, then one round per asked batch size in the asked order (the
//!   first with the first round's pattern), replayed through the model under any settings; the
//!   readings after each round are what `memory_reserved()` / `memory_allocated()` would show
//!   after that capture, with the graph pool's own segments.
//!
//! What the job does after its last capture (replays, teardown) is not replayed.

pub mod learn;
pub mod predict;

use allocsim_model::allocator::MempoolId;

pub use learn::{RecordedRound, Recording, learn};
pub use predict::{CaptureReading, Prediction, Reading, Synthesized, replay};

/// Why a trace's captures cannot answer the question.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GraphsError {
    /// No request went to a private pool.
    NoCapture,
    /// Requests went to several private pools.
    SeveralPools(Vec<MempoolId>),
    /// The trace holds `found` captures into `pool`, but `given` batch sizes were given.
    CountMismatch { found: usize, pool: MempoolId, given: usize },
    /// The captures do not repeat one pattern (the text says where).
    Differs(String),
    /// A trace this does not handle.
    Unsupported(String),
    /// A question that cannot be asked.
    Usage(String),
}

impl std::fmt::Display for GraphsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GraphsError::NoCapture => f.write_str("no request of this trace went to a private pool: no CUDA-graph capture to learn from"),
            GraphsError::SeveralPools(p) => write!(
                f,
                "requests went to {} private pools ({}): graphs answers for captures into one shared pool",
                p.len(),
                p.iter().map(|(a, b)| format!("({a}, {b})")).collect::<Vec<_>>().join(", ")
            ),
            GraphsError::CountMismatch { found, pool, given } => write!(
                f,
                "the trace holds {found} capture{} into graph pool ({}, {}) (runs of requests routed to it), but {given} recorded batch size{} {} given",
                if *found == 1 { "" } else { "s" },
                pool.0,
                pool.1,
                if *given == 1 { "" } else { "s" },
                if *given == 1 { "was" } else { "were" }
            ),
            GraphsError::Differs(m) | GraphsError::Unsupported(m) | GraphsError::Usage(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for GraphsError {}

use allocsim_model::AllocatorConfig;
use allocsim_replay::run::Limits;
use allocsim_replay::{OutsideMemory, Prepared};
use serde::Serialize;

/// What to predict: the recorded batch sizes (one per capture in the trace, in order), the asked
/// ones (in the order the job would capture them), the settings and limits, and how many
/// plausible segment placements to replay under.
#[derive(Clone, Debug)]
pub struct Question<'a> {
    pub captured: &'a [u64],
    pub batches: &'a [u64],
    pub config: &'a AllocatorConfig,
    pub limits: &'a Limits,
    pub placements: usize,
}

/// A recorded capture and the trace's own replay after it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RecordedCapture {
    pub batch: u64,
    /// Requests of its round (warm-up and capture), and of those the ones in the graph pool.
    pub requests: u32,
    pub capture_requests: u32,
    pub after: Reading,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// The pattern the rounds repeat, in numbers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Pattern {
    /// Requests per round, and of those routed to the graph pool.
    pub requests: u32,
    pub pool_requests: u32,
    /// `empty_cache()` calls per round.
    pub empty_cache_calls: u32,
    /// Requests whose size does not change with the batch size, grows on a line through every
    /// recorded point, or only piecewise (their recorded request ordinals in the steady round,
    /// and the largest distance of a point from the line through the outermost two).
    pub constant: u32,
    pub affine: u32,
    /// Requests whose size no line but a parabola gives through every recorded point.
    #[serde(skip_serializing_if = "is_zero")]
    pub quadratic: u32,
    pub piecewise: Vec<(u32, u64)>,
    /// The first round's extra requests (recorded ordinals) and their bytes, kept at any batch size.
    pub first_only: Vec<u32>,
    pub first_only_bytes: u64,
    /// The recorded round the pattern was read from.
    pub from_batch: u64,
}

/// Whether predicting the recorded batch sizes gives the trace's own replay back.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SelfCheck {
    pub rounds: usize,
    /// Rounds after which reserved, allocated and the graph pool's bytes all agree.
    pub agree: usize,
    /// The first that does not: its batch size, the prediction and the trace's own replay.
    pub first_difference: Option<(u64, Reading, Reading)>,
}

/// One placement's prediction.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PlacementPrediction {
    pub name: String,
    pub prediction: Prediction,
}

/// The answer: what was learnt, how well it gives the recording back, and the prediction.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct GraphsAnswer {
    pub pool: MempoolId,
    pub recorded: Vec<RecordedCapture>,
    pub pattern: Pattern,
    pub self_check: SelfCheck,
    /// Under the trace's own segment addresses (by size, where the synthesized run asks for the
    /// same sizes), then under the other placements asked for.
    pub prediction: Prediction,
    pub placements: Vec<PlacementPrediction>,
    /// Expandable segments: addresses cannot change a decision, one placement is replayed.
    pub placement_independent: bool,
    /// Per asked capture: the lowest and highest reserved after it across placements.
    pub reserved_ranges: Vec<(u64, u64)>,
    /// The lowest and highest peak reserved across placements.
    pub peak_range: (u64, u64),
    /// Asked batch sizes outside the recorded ones' range.
    pub extrapolated: Vec<u64>,
    pub recorded_range: (u64, u64),
}

/// Learns the captures of `p` and predicts `q`.
pub fn predict(p: &Prepared, q: &Question<'_>) -> Result<GraphsAnswer, GraphsError> {
    let rec = learn(p, q.captured)?;
    // Memory held outside the allocator that changed over the trace (a neighbour process, read
    // from OOM entries) is given by the trace's request numbers, which synthesized rounds do not
    // follow: the most it held applies throughout.
    let limits = match q.limits.outside.steps.len() {
        0 | 1 => q.limits.clone(),
        _ => Limits { capacity: q.limits.capacity, outside: OutsideMemory { steps: vec![(0, q.limits.outside.max())] } },
    };
    let q = &Question { limits: &limits, ..q.clone() };
    let own = predict::recorded_readings(p, &rec);
    let recorded: Vec<RecordedCapture> = rec
        .rounds
        .iter()
        .zip(&own)
        .map(|(r, a)| RecordedCapture { batch: r.batch, requests: r.requests, capture_requests: r.capture_requests.1 - r.capture_requests.0 + 1, after: *a })
        .collect();
    // Self-check: the recorded batch sizes, under the trace's own settings and addresses.
    let again = rec.synthesize(p, q.captured)?;
    let mine = replay(p, &rec, &again, q.captured, &p.own, &p.limits(None), p.recorded_placement());
    let agree = mine.captures.iter().zip(&own).filter(|(m, o)| m.after == **o).count();
    let first_difference = mine.captures.iter().zip(&own).find(|(m, o)| m.after != **o).map(|(m, o)| (m.batch, m.after, *o));
    let self_check = SelfCheck { rounds: own.len(), agree, first_difference };
    let pool_requests = rec.steady.slots.iter().filter(|s| s.key.private).count() as u32;
    let piecewise: Vec<(u32, u64)> = rec
        .fits
        .iter()
        .enumerate()
        .filter_map(|(k, f)| match f {
            allocsim_shape::fit::SizeFit::Piecewise { deviation, .. } => Some((rec.steady.slots[k].recorded, *deviation)),
            _ => None,
        })
        .collect();
    let pattern = Pattern {
        requests: rec.steady.slots.len() as u32,
        pool_requests,
        empty_cache_calls: rec.steady.ops.iter().filter(|o| **o == allocsim_shape::pattern::TOp::EmptyCache).count() as u32,
        constant: rec.fits.iter().filter(|f| matches!(f, allocsim_shape::fit::SizeFit::Constant { .. })).count() as u32,
        affine: rec.fits.iter().filter(|f| matches!(f, allocsim_shape::fit::SizeFit::Affine { .. })).count() as u32,
        quadratic: rec.fits.iter().filter(|f| matches!(f, allocsim_shape::fit::SizeFit::Quadratic { .. })).count() as u32,
        piecewise,
        first_only: rec.first_only.clone(),
        first_only_bytes: rec.first_only.iter().map(|&r| p.program.requests[r as usize].size).sum(),
        from_batch: rec.rounds[rec.steady_from].batch,
    };
    let s = rec.synthesize(p, q.batches)?;
    let placement_independent = q.config.expandable_segments;
    let mut list = vec![("recorded".to_string(), p.recorded_placement())];
    if !placement_independent {
        list.extend(p.placements(q.placements.max(1)).into_iter().skip(1));
    }
    // On rayon's pool (one thread a core), however many placements are asked for.
    use rayon::prelude::*;
    let runs: Vec<PlacementPrediction> =
        list.into_par_iter().map(|(name, pl)| PlacementPrediction { name, prediction: replay(p, &rec, &s, q.batches, q.config, q.limits, pl) }).collect();
    let reserved_ranges = (0..q.batches.len())
        .map(|k| {
            let v = runs.iter().map(|r| r.prediction.captures[k].after.reserved);
            (v.clone().min().unwrap_or(0), v.max().unwrap_or(0))
        })
        .collect();
    let peaks = runs.iter().map(|r| r.prediction.peak_reserved);
    let peak_range = (peaks.clone().min().unwrap_or(0), peaks.max().unwrap_or(0));
    let recorded_range = rec.range();
    let extrapolated = q.batches.iter().copied().filter(|&b| b < recorded_range.0 || b > recorded_range.1).collect();
    let mut runs = runs.into_iter();
    let prediction = runs.next().expect("the recorded placement").prediction;
    Ok(GraphsAnswer {
        pool: rec.pool,
        recorded,
        pattern,
        self_check,
        prediction,
        placements: runs.collect(),
        placement_independent,
        reserved_ranges,
        peak_range,
        extrapolated,
        recorded_range,
    })
}
