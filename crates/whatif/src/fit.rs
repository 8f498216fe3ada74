//! `allocsim fit`: the smallest allowed maximum, to the 2 MiB, at which a trace runs without OOM.
//!
//! The search replays at a capacity and asks whether any request ran out of memory. The uncapped
//! peak (rounded up to 2 MiB) is where the search starts from above; it usually fits, but the
//! fraction check counts a request's whole segment size even where expandable segments would map
//! less, so the upper end grows until it fits. Bisection below it assumes that fitting
//! is monotone in the capacity, which the allocator does not guarantee (a tighter cap triggers
//! releases that can leave less fragmentation later), so every capacity in a window below the
//! answer is also replayed; a smaller fitting capacity found there replaces the answer and the
//! window moves down with it.

use allocsim_model::{AllocatorConfig, Placement};
use allocsim_replay::Prepared;
use rayon::prelude::*;

pub const STEP: u64 = 2 << 20;
/// How many capacities below the answer are replayed one by one.
pub const EDGE_WINDOW: u64 = 32;

#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Fit {
    /// The smallest allowed maximum without OOM; `None` if the trace does not fit in the device.
    pub capacity: Option<u64>,
    /// Peak reserved without any cap.
    pub uncapped_peak_reserved: u64,
    /// Peak allocated (a floor no capacity can go under).
    pub peak_allocated: u64,
    /// Capacities replayed one by one below the answer, all of which ran out of memory.
    pub checked_below: u64,
    /// A smaller capacity that fits was found below a larger one that did not (fitting is not
    /// monotone near the edge for this trace).
    pub non_monotone: bool,
    pub replays: usize,
}

/// Finds the smallest fitting capacity for `config` under `placement`: the whole trace without
/// any OOM.
pub fn fit(prepared: &Prepared, config: &AllocatorConfig, placement: &Placement) -> Fit {
    fit_where(prepared, config, placement, |o| o.first_oom().is_none())
}

/// [`fit`] with another meaning of "fits": the smallest capacity whose replay `fits` accepts
/// (`explain` asks for the request it explains and every request the recorded run served, since
/// OOMs the job caught and survived are part of what it did).
pub fn fit_where(prepared: &Prepared, config: &AllocatorConfig, placement: &Placement, accept: impl Fn(&allocsim_replay::ReplayOutcome) -> bool + Sync) -> Fit {
    let mut replays = 0usize;
    let uncapped = prepared.replay(config, None, placement.clone());
    replays += 1;
    let peak_allocated = uncapped.stats.allocated_bytes.all().peak as u64;
    let uncapped_peak = uncapped.peak_reserved;
    if !accept(&uncapped) {
        return Fit { capacity: None, uncapped_peak_reserved: uncapped_peak, peak_allocated, checked_below: 0, non_monotone: false, replays };
    }
    let fits = |steps: u64| accept(&prepared.replay(config, Some(steps * STEP), placement.clone()));
    // The uncapped peak usually fits, but not always: the fraction check adds a request's whole
    // segment size (alloc_size) even where expandable segments would map less. Grow until it fits.
    // Invariant afterwards: fits(hi), !fits(lo) (capacity 0 never fits a trace with a request).
    let max_steps = prepared.device_memory / STEP;
    let mut lo = 0u64;
    let mut hi = uncapped_peak.div_ceil(STEP).max(1);
    let mut grow = 1u64;
    loop {
        replays += 1;
        if fits(hi) {
            break;
        }
        lo = hi;
        if hi >= max_steps {
            return Fit { capacity: None, uncapped_peak_reserved: uncapped_peak, peak_allocated, checked_below: 0, non_monotone: false, replays };
        }
        hi = (hi + grow).min(max_steps);
        grow *= 2;
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        replays += 1;
        if fits(mid) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    let mut non_monotone = false;
    let mut checked_below;
    loop {
        let from = hi.saturating_sub(EDGE_WINDOW).max(1);
        let below: Vec<u64> = (from..hi).collect();
        checked_below = below.len() as u64;
        let found: Vec<u64> = below.par_iter().copied().filter(|&k| fits(k)).collect();
        replays += below.len();
        match found.into_iter().min() {
            Some(k) => {
                non_monotone = true;
                hi = k;
            }
            None => break,
        }
    }
    Fit { capacity: Some(hi * STEP), uncapped_peak_reserved: uncapped_peak, peak_allocated, checked_below, non_monotone, replays }
}

/// Replays `prepared` under `config` and `placement` on a card of `card` bytes of which `outside`
/// are held outside the allocator (the CUDA context, other libraries): the allowed maximum is what
/// is left. Whether a card fits is this replay's answer, not a comparison with a fitted capacity
/// (fitting need not be monotone in the capacity).
pub fn on_card(prepared: &Prepared, config: &AllocatorConfig, placement: &Placement, card: u64, outside: u64) -> allocsim_replay::ReplayOutcome {
    let usable = card.saturating_sub(outside);
    let mut opts = prepared.options(config, &allocsim_replay::run::Limits::capacity(Some(usable)), placement.clone());
    opts.device_memory = card;
    allocsim_replay::replay(&prepared.program, &opts, allocsim_replay::EmptyCacheCalls::Given(&prepared.empty_cache))
}

/// How a fitted allowed maximum compares with the budget the trace itself had.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AgainstBudget {
    /// The trace's budget, wherever in its inferred range, is enough.
    Fits,
    /// Not enough anywhere in its range.
    DoesNotFit,
    /// Enough for part of the range only: the answer depends on where the real value lies.
    Depends,
}

/// Compares the smallest fitting allowed maximum (`fit_lo..=fit_hi` across placements) with the
/// trace's own budget: its allowed maximum (an interval when inferred), else what the allocator
/// could have at its first device-full OOM. Returns the verdict and the budget's range; `None`
/// when the trace had no budget.
pub fn against_budget(fit_lo: u64, fit_hi: u64, budget: &allocsim_replay::Budget) -> Option<(AgainstBudget, u64, u64)> {
    let (lo, hi) = match (budget.allowed_low, budget.allowed_high) {
        (Some(l), Some(h)) => (l, h),
        _ => {
            let b = budget.device_full.first()?.available;
            (b, b)
        }
    };
    let verdict = if fit_hi <= lo {
        AgainstBudget::Fits
    } else if fit_lo > hi {
        AgainstBudget::DoesNotFit
    } else {
        AgainstBudget::Depends
    };
    Some((verdict, lo, hi))
}

/// Memory outside the allocator as the trace's OOM entries show it (see `allocsim_replay::oom`).
pub fn outside_memory_from_ooms(prepared: &Prepared) -> Option<u64> {
    allocsim_replay::oom::outside_memory_from_ooms(&prepared.trace, prepared.device_memory)
}

pub use allocsim_replay::oom::DEFAULT_OUTSIDE_MEMORY;
