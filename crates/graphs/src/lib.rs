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

pub mod fit;
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
