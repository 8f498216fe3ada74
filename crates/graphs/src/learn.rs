//! Finding the captures in a trace and learning the pattern they repeat (see the crate
//! documentation for the rules).

use std::ops::Range;

use allocsim_model::allocator::{MempoolId, Route};
use allocsim_replay::{Op, Prepared, Program};
use allocsim_shape::fit::SizeFit;
use allocsim_shape::pattern::{self, Ref, TOp, Template, TemplateError, key, match_backwards};
use serde::Serialize;

use crate::GraphsError;

/// Where a request's size comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotSize {
    /// The fit of the steady round's request `k` ([`Recording::fits`]).
    Steady(u32),
    /// A request only the first round makes (library workspaces, a generator's graph state):
    /// the size it had.
    Fixed(u64),
}

/// One recorded round: the ops from its first request (the eager warm-up before the capture) to
/// the capture's last free, and the capture's first and last malloc.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RecordedRound {
    pub batch: u64,
    /// Op indices `[start, end)` in the trace's program.
    pub ops: (usize, usize),
    /// The requests routed to the graph pool (ordinals, inclusive).
    pub capture_requests: (u32, u32),
    /// Requests in the round (warm-up and capture).
    pub requests: u32,
}

/// What was learnt from a trace's captures.
#[derive(Clone, Debug)]
pub struct Recording {
    /// The graph pool every capture went to.
    pub pool: MempoolId,
    /// The recorded rounds, one per capture, in order.
    pub rounds: Vec<RecordedRound>,
    /// The ops before the first round (weights, inputs), replayed as recorded.
    pub prologue_ops: usize,
    /// The requests made in the prologue (ordinals `0..prologue_requests`).
    pub prologue_requests: u32,
    /// The first round's pattern (it makes one-time requests the later ones do not), and where
    /// each of its requests' sizes comes from.
    pub first: Template,
    pub first_sizes: Vec<SlotSize>,
    /// The pattern every later round repeats.
    pub steady: Template,
    /// Which recorded round the steady pattern was read from.
    pub steady_from: usize,
    /// Per steady request: its size as a function of the batch size.
    pub fits: Vec<SizeFit>,
    /// The first round's requests that the later rounds do not make (their recorded sizes are
    /// used at any batch size).
    pub first_only: Vec<u32>,
}

impl Recording {
    /// The smallest and largest recorded batch sizes.
    pub fn range(&self) -> (u64, u64) {
        let lo = self.rounds.iter().map(|r| r.batch).min().unwrap_or(0);
        let hi = self.rounds.iter().map(|r| r.batch).max().unwrap_or(0);
        (lo, hi)
    }

    /// Steady requests whose size no line through the recorded points gives.
    pub fn inexact_fits(&self) -> Vec<u32> {
        (0..self.fits.len() as u32).filter(|&k| !self.fits[k as usize].is_exact()).collect()
    }
}

/// The request each malloc op makes, by op index; and the op of each request.
fn malloc_ops(p: &Program) -> Vec<u32> {
    let mut op_of = vec![u32::MAX; p.requests.len()];
    for (oi, op) in p.ops.iter().enumerate() {
        if let Op::Malloc(q) = *op {
            op_of[q as usize] = oi as u32;
        }
    }
    op_of
}

/// Learns the captures of `p` (recorded at batch sizes `captured`, in order).
pub fn learn(p: &Prepared, captured: &[u64]) -> Result<Recording, GraphsError> {
    let prog = &p.program;
    let mut pools: Vec<MempoolId> = Vec::new();
    for r in &prog.requests {
        if let Route::Private(id) = r.route
            && !pools.contains(&id)
        {
            pools.push(id);
        }
    }
    let pool = match pools.as_slice() {
        [] => return Err(GraphsError::NoCapture),
        [one] => *one,
        many => return Err(GraphsError::SeveralPools(many.to_vec())),
    };
    // The captures: runs of consecutive requests routed to the pool.
    let mut caps: Vec<(u32, u32)> = Vec::new();
    for (q, r) in prog.requests.iter().enumerate() {
        let q = q as u32;
        if r.route != Route::Private(pool) {
            continue;
        }
        match caps.last_mut() {
            Some(last) if last.1 + 1 == q => last.1 = q,
            _ => caps.push((q, q)),
        }
    }
    if caps.len() != captured.len() {
        return Err(GraphsError::CountMismatch { found: caps.len(), pool, given: captured.len() });
    }
    if caps.len() < 2 {
        return Err(GraphsError::Usage("one capture: how sizes follow the batch size needs captures at two batch sizes at least".into()));
    }
    if let Some(&b) = captured.iter().find(|&&b| b == 0) {
        return Err(GraphsError::Usage(format!("batch size {b}: batch sizes are at least 1")));
    }
    let op_of = malloc_ops(prog);
    let n = caps.len();
    // Round k ≥ 1 starts at the first malloc after capture k − 1's last one.
    let mut starts = vec![0usize; n];
    for k in 1..n {
        let e = op_of[caps[k - 1].1 as usize] as usize;
        starts[k] = (e + 1..prog.ops.len()).find(|&oi| matches!(prog.ops[oi], Op::Malloc(_))).expect("capture k has a malloc");
    }
    let last_malloc = |k: usize| op_of[caps[k].1 as usize] as usize;
    // The steady pattern: round 1 when a round follows it, else the last round with the frees of
    // its own requests that come before anything else is freed.
    let steady_from = 1;
    let steady_range = if n > 2 { starts[1]..starts[2] } else { starts[1]..trailing_end(prog, starts[1], last_malloc(1)) };
    let mut steady = template(prog, &p.empty_cache, steady_range.clone())?;
    // Every later round must make the same requests in the same order (sizes aside).
    let mut ec_positions: Vec<usize> = ec_positions(&steady.ops);
    for k in 2..n {
        let range = if k + 1 < n { starts[k]..starts[k + 1] } else { starts[k]..last_malloc(k) + 1 };
        let t = template(prog, &p.empty_cache, range)?;
        let (a, b) = (steady.without_empty_cache(), t.without_empty_cache());
        let complete = k + 1 < n;
        let b_cmp = &b[..];
        let a_cmp = if complete { &a[..] } else { &a[..a.iter().rposition(|o| matches!(o, TOp::Malloc(_))).map_or(0, |i| i + 1).min(a.len())] };
        let same_keys = steady.slots.len() == t.slots.len() && steady.slots.iter().zip(&t.slots).all(|(x, y)| x.key == y.key);
        if a_cmp != b_cmp || !same_keys {
            return Err(GraphsError::Differs(describe_difference(p, captured, 1, k, &steady, &t, a_cmp, b_cmp)));
        }
        for e in self::ec_positions(&t.ops) {
            if !ec_positions.contains(&e) {
                ec_positions.push(e);
            }
        }
    }
    // Every round's empty_cache() calls, at the places any round made one.
    ec_positions.sort();
    let plain = steady.without_empty_cache();
    let mut ops = Vec::with_capacity(plain.len() + ec_positions.len());
    for (i, op) in plain.iter().enumerate() {
        if ec_positions.contains(&i) {
            ops.push(TOp::EmptyCache);
        }
        ops.push(*op);
    }
    if ec_positions.contains(&plain.len()) {
        ops.push(TOp::EmptyCache);
    }
    steady.ops = ops;
    // Sizes from the rounds after the first.
    let round_requests = |k: usize| -> Vec<u32> {
        let end = if k + 1 < n { starts[k + 1] } else { last_malloc(k) + 1 };
        prog.ops[starts[k]..end].iter().filter_map(|o| if let Op::Malloc(q) = *o { Some(q) } else { None }).collect()
    };
    let mut points: Vec<Vec<(u64, u64)>> = vec![Vec::new(); steady.slots.len()];
    for (k, &bs) in captured.iter().enumerate().skip(1) {
        for (j, q) in round_requests(k).into_iter().enumerate() {
            points[j].push((bs, prog.requests[q as usize].size));
        }
    }
    let later_fits: Vec<SizeFit> = points.iter().map(|v| SizeFit::from_points(v)).collect();
    // The first round: the steady requests found in it, from its end backwards (by key, and by
    // size where the later rounds fit a line); what precedes its first one is the prologue.
    let first_end = starts[1];
    let candidates: Vec<usize> = (0..first_end).filter(|&oi| matches!(prog.ops[oi], Op::Malloc(_))).collect();
    let found = match_backwards(steady.slots.len(), candidates.len(), |j, c| {
        let Op::Malloc(q) = prog.ops[candidates[c]] else { unreachable!() };
        let s = &steady.slots[j];
        let fit = &later_fits[j];
        let size_ok = captured.len() < 3 || !fit.is_exact() || fit.at(captured[0]).ok() == Some(prog.requests[q as usize].size);
        key(prog, q) == s.key && size_ok
    });
    let found = match found {
        Ok(f) if !f.is_empty() => f,
        r => {
            return Err(GraphsError::Differs(format!(
                "the first capture (batch size {}) does not make the requests the later captures make ({} of {} found in it{})",
                captured[0],
                r.err().unwrap_or(0),
                steady.slots.len(),
                if captured.len() >= 3 { ", with the sizes the later captures' sizes give at its batch size" } else { "" }
            )));
        }
    };
    let matched: Vec<Option<u32>> = found
        .iter()
        .map(|&c| match prog.ops[candidates[c]] {
            Op::Malloc(q) => Some(q),
            _ => None,
        })
        .collect();
    let first_start = candidates[found[0]];
    let prologue_requests = match prog.ops[first_start] {
        Op::Malloc(q) => q,
        _ => unreachable!(),
    };
    let first = template(prog, &p.empty_cache, first_start..first_end)?;
    let mut first_only = Vec::new();
    let mut first_sizes = Vec::with_capacity(first.slots.len());
    for s in &first.slots {
        match matched.iter().position(|&m| m == Some(s.recorded)) {
            Some(k) => {
                first_sizes.push(SlotSize::Steady(k as u32));
                points[k].push((captured[0], prog.requests[s.recorded as usize].size));
            }
            None => {
                first_sizes.push(SlotSize::Fixed(s.size));
                first_only.push(s.recorded);
            }
        }
    }
    // Frees of earlier requests must be of the prologue's.
    for t in [&first, &steady] {
        for op in &t.ops {
            if let TOp::Free { r: Ref::Earlier(q), .. } | TOp::Complete(Ref::Earlier(q)) = *op
                && q >= prologue_requests
            {
                return Err(GraphsError::Unsupported(format!("a round frees request {q}, made by an earlier round: the captures do not repeat one pattern")));
            }
        }
    }
    if p.program.pool_actions.iter().any(|&(oi, _)| (oi as usize) >= first_start && (oi as usize) < last_malloc(n - 1)) {
        return Err(GraphsError::Unsupported("the graph pool (or another private pool) is released or dropped between the captures".into()));
    }
    let fits: Vec<SizeFit> = points.iter().map(|v| SizeFit::from_points(v)).collect();
    let rounds = (0..n)
        .map(|k| {
            let start = if k == 0 { first_start } else { starts[k] };
            let end = if k + 1 < n { starts[k + 1] } else { trailing_end(prog, starts[k], last_malloc(k)) };
            let requests = prog.ops[start..end].iter().filter(|o| matches!(o, Op::Malloc(_))).count() as u32;
            RecordedRound { batch: captured[k], ops: (start, end), capture_requests: caps[k], requests }
        })
        .collect();
    Ok(Recording { pool, rounds, prologue_ops: first_start, prologue_requests, first, first_sizes, steady, steady_from, fits, first_only })
}

/// The end of the last round: after its last malloc, the frees (and completions, and
/// `empty_cache()` calls) of its own requests, up to the first op that is anything else.
fn trailing_end(p: &Program, start: usize, last_malloc: usize) -> usize {
    let first_req = match p.ops[start] {
        Op::Malloc(q) => q,
        _ => unreachable!("a round starts with a malloc"),
    };
    let own = |q: u32| q >= first_req;
    let mut end = last_malloc + 1;
    while end < p.ops.len() {
        match p.ops[end] {
            Op::Free { req, .. } | Op::Complete(req) if own(req) => end += 1,
            _ => break,
        }
    }
    end
}

/// The positions (in the ops without `EmptyCache`) before which an `EmptyCache` comes.
fn ec_positions(ops: &[TOp]) -> Vec<usize> {
    let mut v = Vec::new();
    let mut i = 0;
    for op in ops {
        if *op == TOp::EmptyCache {
            v.push(i);
        } else {
            i += 1;
        }
    }
    v
}

/// The ops `range` of `p` (a round: it starts with a malloc) as a pattern
/// (`allocsim_shape::pattern::template`): references to earlier requests are the prologue's
/// (checked by the caller); a round may not free a block from before the trace.
fn template(p: &Program, empty_cache: &[bool], range: Range<usize>) -> Result<Template, GraphsError> {
    let first_req = match p.ops[range.start] {
        Op::Malloc(q) => q,
        _ => unreachable!("a round starts with a malloc"),
    };
    let before_trace = || GraphsError::Unsupported("a round frees a block made before the trace began: the captures do not repeat one pattern".into());
    let t = pattern::template(p, empty_cache, range, first_req).map_err(|e| match e {
        TemplateError::Checkpoint(_) => GraphsError::Unsupported(
            "the captures restore their pool to a checkpoint (torch.compile's CUDA-graph trees): not a torch.cuda.graph capture".into(),
        ),
        TemplateError::ForcedRelease => before_trace(),
    })?;
    if t.ops.iter().any(|o| matches!(o, TOp::Free { r: Ref::Pre(_), .. } | TOp::Complete(Ref::Pre(_)))) {
        return Err(before_trace());
    }
    Ok(t)
}

/// Where round `k` first differs from round `a` (the steady pattern), in words.
#[allow(clippy::too_many_arguments)]
fn describe_difference(p: &Prepared, captured: &[u64], a: usize, k: usize, ta: &Template, tb: &Template, oa: &[TOp], ob: &[TOp]) -> String {
    let mut head = format!("the capture at batch size {} does not repeat the one at batch size {}", captured[k], captured[a]);
    if ta.slots.len() != tb.slots.len() {
        head += &format!(" ({} requests in its round against {})", tb.slots.len(), ta.slots.len());
    }
    let describe = |t: &Template, op: Option<&TOp>| -> String {
        match op {
            None => "the round's end".into(),
            Some(TOp::Malloc(s)) => {
                let s = t.slots[*s as usize];
                let site = p.call_site(s.recorded).map(|c| format!(", {c}")).unwrap_or_default();
                format!(
                    "request {} ({} bytes on stream {}{}{site})",
                    s.recorded,
                    p.program.requests[s.recorded as usize].size,
                    s.key.stream,
                    if s.key.private { ", in the graph pool" } else { "" }
                )
            }
            Some(TOp::Free { r: Ref::Local(l), .. } | TOp::Complete(Ref::Local(l))) => {
                format!("the free of request {}", t.slots.get(*l as usize).map_or(0, |s| s.recorded))
            }
            Some(TOp::Free { r: Ref::Earlier(q) | Ref::Pre(q), .. } | TOp::Complete(Ref::Earlier(q) | Ref::Pre(q))) => format!("the free of request {q}"),
            Some(TOp::EmptyCache) => "an empty_cache() call".into(),
        }
    };
    // The first op that differs, or makes a request of another stream, pool or stack.
    let same = |x: &TOp, y: &TOp| match (x, y) {
        (TOp::Malloc(i), TOp::Malloc(j)) => i == j && ta.slots[*i as usize].key == tb.slots[*j as usize].key,
        _ => x == y,
    };
    let at = oa.iter().zip(ob).position(|(x, y)| !same(x, y)).unwrap_or(oa.len().min(ob.len()));
    let (x, y) = (describe(ta, oa.get(at)), describe(tb, ob.get(at)));
    format!("{head}: op {at} of its round is {y}, where the other's is {x}; sizes cannot be carried from one to the other")
}
