//! A step at an asked value, synthesized from what was learnt and replayed after a recorded
//! step's end state.

use allocsim_model::allocator::Route;
use allocsim_model::format::oom_message;
use allocsim_model::{AllocatorConfig, Placement, SimDevice};
use allocsim_replay::replay::{Stepper, VecSlots};
use allocsim_replay::run::Limits;
use allocsim_replay::{Op, OutsideMemory, Prepared, Request};
use serde::Serialize;

use crate::fit::SizeError;
use crate::steps::{GKey, Input, Learnt, SOp, SRef, Step};

/// Which sizes a request seen at one value only takes at another value: its dependence on the
/// value is unknown. A size affine in the value with nonnegative terms (every tensor whose one
/// dimension is the value, plus any constant) lies between the recorded size and the recorded
/// size scaled by the value: both ends are replayed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Bound {
    /// No request seen at one value only is asked at another: the sizes are the fits'.
    Fitted,
    /// Those requests at the smaller end (their recorded size, or scaled down).
    Low,
    /// At the larger end.
    High,
}

/// How a step is replayed: settings, limits, placement, the device's memory.
#[derive(Clone, Debug)]
pub struct Setting {
    pub config: AllocatorConfig,
    pub limits: Limits,
    pub placement: Placement,
    /// The device's total memory (a card's), else the trace's.
    pub device_memory: Option<u64>,
}

/// One asked step ready to replay: its requests (ordinals from `base`) and ops (with whether
/// each is an `empty_cache()` call).
#[derive(Clone, Debug)]
pub struct Synthesized {
    pub requests: Vec<Request>,
    pub ops: Vec<(Op, bool)>,
    /// Frees of requests the step after which it runs did not leave alive (left out).
    pub unmatched_frees: u32,
}

/// Why a step cannot be synthesized at a value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SynthError {
    /// The fit of a request gives no positive size there: its recorded ordinal (trace, request)
    /// and the fitted value.
    NotPositive { recorded: (usize, u32), value: String },
}

/// The state after a recorded step: the trace's own program replayed up to that step's end.
#[derive(Clone)]
pub struct After {
    pub stepper: Stepper<SimDevice, VecSlots>,
    /// The requests made so far (the synthesized step's requests are numbered from here).
    pub base: u32,
    /// The requests of that step left alive at its end, in order, with their keys.
    pub crossing: Vec<(u32, GKey)>,
    pub device: usize,
}

/// The replay of a trace's own program, op by op, to stop after any of its steps.
pub struct Runner<'a> {
    pub p: &'a Prepared,
    pub stepper: Stepper<SimDevice, VecSlots>,
    /// The next op's index.
    pub next: usize,
}

impl<'a> Runner<'a> {
    /// A replay of `p`'s program under `setting` (memory held outside the allocator as the trace
    /// had it up to request `base`, then as it was there), with room for `room` requests past
    /// `base`; pool actions only before op `ops_end`.
    pub fn new(p: &'a Prepared, setting: &Setting, base: u32, room: usize, ops_end: usize) -> Runner<'a> {
        let prog = &p.program;
        let limits = Limits { capacity: setting.limits.capacity, outside: outside_until(&setting.limits.outside, base) };
        let mut opts = p.options(&setting.config, &limits, setting.placement.clone());
        if let Some(d) = setting.device_memory {
            opts.device_memory = d;
        }
        let device = SimDevice::new(opts.device_memory, opts.placement.clone());
        let slots = VecSlots::new(prog.requests.len().max(base as usize + room));
        let mut stepper = Stepper::new(&opts, device, slots, &prog.private_pools, prog.initial.as_ref());
        let actions: Vec<_> = prog.pool_actions.iter().copied().filter(|&(oi, _)| (oi as usize) < ops_end).collect();
        stepper.set_pool_actions(&actions);
        Runner { p, stepper, next: 0 }
    }

    /// Replays the ops up to `end` (exclusive).
    pub fn advance_to(&mut self, end: usize) {
        let prog = &self.p.program;
        while self.next < end.min(prog.ops.len()) {
            let oi = self.next;
            let op = prog.ops[oi];
            let flag = self.p.empty_cache.get(oi).copied().unwrap_or(false);
            self.stepper.step(op, prog.request_of(op), |_| flag);
            self.next += 1;
        }
    }
}

/// The requests of `step` it left alive at its end, in order, with their keys across traces.
pub fn crossing(l: &Learnt, p: &Prepared, step: &Step) -> Vec<(u32, GKey)> {
    let prog = &p.program;
    let mut freed = vec![false; (step.requests.1 - step.requests.0) as usize];
    for op in &prog.ops[step.op_range()] {
        if let Op::Free { req, .. } = *op
            && (step.requests.0..step.requests.1).contains(&req)
        {
            freed[(req - step.requests.0) as usize] = true;
        }
    }
    (step.requests.0..step.requests.1)
        .filter(|q| !freed[(q - step.requests.0) as usize])
        .map(|q| {
            let k = crate::pattern::key(prog, q);
            (q, GKey { stream: k.stream, private: k.private, stack: l.stack_maps[step.trace].get(k.stack as usize).copied().unwrap_or(u32::MAX) })
        })
        .collect()
}

/// The request of `a`'s step that a [`SRef::Prev`] (`rank`) of structure `s` names. Of the
/// structure's steps, the latest whose previous step left as many requests alive as `a`'s step
/// did gives it by its rank among those; failing that, the latest step gives its key and rank
/// among those of its key (the first step leaves the weights and the optimizer's state alive
/// besides its gradients).
fn prev_request(l: &Learnt, s: usize, rank: u32, a: &After) -> Option<u32> {
    let steps = &l.structures[s].steps;
    let info = |i: usize| &l.prev_info[i];
    if let Some(&i) = steps.iter().rev().find(|&&i| info(i).crossing == a.crossing.len() && (rank as usize) < info(i).freed.len()) {
        let idx = info(i).freed[rank as usize].0;
        return a.crossing.get(idx as usize).map(|c| c.0);
    }
    let &i = steps.iter().rev().find(|&&i| (rank as usize) < info(i).freed.len())?;
    let (_, key, occ) = info(i).freed[rank as usize];
    a.crossing.iter().filter(|c| c.1 == key).nth(occ as usize).map(|c| c.0)
}

/// Replays trace `input`'s program up to the end of `step` (of that trace) under `setting`,
/// with room for `room` more requests.
pub fn after(l: &Learnt, input: &Input<'_>, step: &Step, setting: &Setting, room: usize) -> After {
    let p = input.prepared;
    let base = step.requests.1;
    let mut r = Runner::new(p, setting, base, room, step.ops.1);
    r.advance_to(step.ops.1);
    After { stepper: r.stepper, base, crossing: crossing(l, p, step), device: p.device }
}

/// Memory held outside the allocator as the trace had it up to request `base`, then as it was
/// there (the synthesized step's requests are numbered from `base`; what the trace held later
/// belongs to requests it made later).
fn outside_until(o: &OutsideMemory, base: u32) -> OutsideMemory {
    if o.steps.is_empty() {
        return o.clone();
    }
    let mut steps: Vec<(u32, u64)> = o.steps.iter().copied().filter(|&(r, _)| r < base).collect();
    if steps.is_empty() {
        steps.push((0, o.at(base)));
    }
    OutsideMemory { steps }
}

/// The size of slot `k` of structure `s` at value `v`.
pub fn size_at(l: &Learnt, s: usize, k: usize, v: u64, bound: Bound) -> Result<u64, SynthError> {
    let f = l.fitted[s].as_ref().expect("a learnt structure");
    let recorded = l.structures[s].recorded[k];
    if f.single_valued(k) && f.seen[k][0] != v && bound != Bound::Fitted {
        let x = f.seen[k][0];
        let y = f.fits[k].at(x).map_err(|_| SynthError::NotPositive { recorded, value: "none".into() })?;
        let scaled = ((y as u128 * v as u128 + x as u128 / 2) / x as u128).clamp(1, u64::MAX as u128) as u64;
        let (lo, hi) = (y.min(scaled), y.max(scaled));
        let size = if bound == Bound::Low { lo } else { hi };
        if size >= allocsim_replay::check::MAX_REQUEST {
            return Err(SynthError::NotPositive { recorded, value: format!("{size} bytes, beyond any tensor") });
        }
        return Ok(size);
    }
    let size = f.fits[k].at(v).map_err(|e| SynthError::NotPositive {
        recorded,
        value: match e {
            SizeError::NotPositive(x) => format!("{x} bytes"),
            SizeError::Overflow => "beyond any size".into(),
        },
    })?;
    // A tensor's byte size is an int64 (the bound a recorded request is checked against).
    if size >= allocsim_replay::check::MAX_REQUEST {
        return Err(SynthError::NotPositive { recorded, value: format!("{size} bytes, beyond any tensor") });
    }
    Ok(size)
}

/// Structure `s`'s step at value `v` (requests numbered from `a.base`).
pub fn synthesize(l: &Learnt, inputs: &[Input<'_>], s: usize, v: u64, bound: Bound, a: &After) -> Result<Synthesized, SynthError> {
    let st = &l.structures[s];
    let mut requests = Vec::with_capacity(st.keys.len());
    for (k, key) in st.keys.iter().enumerate() {
        let size = size_at(l, s, k, v, bound)?;
        let (t, q) = st.recorded[k];
        let rec = &inputs[t].prepared.program.requests[q as usize];
        requests.push(Request {
            size,
            stream: key.stream,
            route: if key.private { rec.route } else { Route::Default },
            recorded_oom: false,
            recorded_addr: 0,
            trace_index: rec.trace_index,
            stack: rec.stack,
            checkpoint: false,
        });
    }
    let mut unmatched = 0u32;
    let base = a.base;
    let mut resolve = |r: SRef| -> Option<Ref0> {
        match r {
            SRef::Local(k) => Some(Ref0::Req(base + k)),
            SRef::Prev(rank) => {
                let q = prev_request(l, s, rank, a);
                if q.is_none() {
                    unmatched += 1;
                }
                q.map(Ref0::Req)
            }
            SRef::Abs { trace, q } => {
                let ok = trace == 0 && q < base;
                if !ok {
                    unmatched += 1;
                }
                ok.then_some(Ref0::Req(q))
            }
            SRef::Pre { trace, pre } => {
                if trace != 0 {
                    unmatched += 1;
                }
                (trace == 0).then_some(Ref0::Pre(pre))
            }
        }
    };
    let mut ops = Vec::with_capacity(st.ops.len());
    for op in &st.ops {
        let o = match *op {
            SOp::Malloc(k) => Some(Op::Malloc(base + k)),
            SOp::Free { r, deferred } => resolve(r).map(|x| match x {
                Ref0::Req(q) => Op::Free { req: q, deferred },
                Ref0::Pre(pre) => Op::FreePre { pre, deferred },
            }),
            SOp::Complete(r) => resolve(r).map(|x| match x {
                Ref0::Req(q) => Op::Complete(q),
                Ref0::Pre(pre) => Op::CompletePre(pre),
            }),
            SOp::EmptyCache => {
                ops.push((Op::ReleaseRun { start: 0, end: 0 }, true));
                None
            }
        };
        if let Some(o) = o {
            ops.push((o, false));
        }
    }
    Ok(Synthesized { requests, ops, unmatched_frees: unmatched })
}

enum Ref0 {
    Req(u32),
    Pre(u32),
}

/// An OOM in a replayed step.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct StepOom {
    /// The request of the step (its rank in the step) and its size.
    pub request: u32,
    pub size: u64,
    /// Where it was made (the call site of the recorded request it stands for).
    pub call_site: Option<String>,
    /// PyTorch's message (without NVML's per-process sentence).
    pub message: String,
}

/// What one replayed step came to: `max_memory_allocated()` and `max_memory_reserved()` after
/// `reset_peak_memory_stats()` at its start, up to its first OOM (an OOM ends a step).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct StepReading {
    pub peak_allocated: u64,
    pub peak_reserved: u64,
    /// At its start, and at its end (or its first OOM).
    pub allocated_before: u64,
    pub reserved_before: u64,
    pub allocated_after: u64,
    pub reserved_after: u64,
    /// `segment_alloc`/`segment_map` events and their bytes.
    pub new_segments: u32,
    pub new_segment_bytes: u64,
    pub oom: Option<StepOom>,
}

/// Replays `s` from the state `a`, on a copy of it.
pub fn replay_step(a: &After, s: &Synthesized, call_site: impl Fn(u32) -> Option<String>) -> StepReading {
    let mut st = a.stepper.clone();
    replay_step_on(&mut st, a.base, a.device, s, call_site)
}

/// Replays `s` on `st` (whose next request is `base`).
pub fn replay_step_on(
    st: &mut Stepper<SimDevice, VecSlots>,
    base: u32,
    device: usize,
    s: &Synthesized,
    call_site: impl Fn(u32) -> Option<String>,
) -> StepReading {
    let stats = |st: &Stepper<SimDevice, VecSlots>| (st.alloc.stats.allocated_bytes.all().current as u64, st.alloc.stats.reserved_bytes.all().current as u64);
    let (allocated_before, reserved_before) = stats(st);
    st.alloc.stats.reset_peak();
    let events_before = st.segment_events().len();
    let ooms_before = st.ooms().len();
    let mut oom = None;
    for &(op, flag) in &s.ops {
        let req = match op {
            Op::Malloc(q) => s.requests.get((q - base) as usize),
            _ => None,
        };
        let step = st.step(op, req, |_| flag);
        if step.oom {
            let Op::Malloc(q) = op else { unreachable!() };
            let info = &st.ooms()[ooms_before].info;
            oom = Some(StepOom {
                request: q - base,
                size: req.map_or(0, |r| r.size),
                call_site: call_site(q - base),
                message: oom_message(info, device as i32, ""),
            });
            break;
        }
    }
    let (allocated_after, reserved_after) = stats(st);
    let (mut new_segments, mut new_segment_bytes) = (0u32, 0u64);
    for e in &st.segment_events()[events_before..] {
        if e.action.reserves() {
            new_segments += 1;
            new_segment_bytes += e.size;
        }
    }
    StepReading {
        peak_allocated: st.alloc.stats.allocated_bytes.all().peak as u64,
        peak_reserved: st.alloc.stats.reserved_bytes.all().peak as u64,
        allocated_before,
        reserved_before,
        allocated_after,
        reserved_after,
        new_segments,
        new_segment_bytes,
        oom,
    }
}
