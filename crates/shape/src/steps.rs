//! A job's steps, the shape value of each, and how each request follows the value (see the
//! crate documentation for the rules).

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

use allocsim_phases::Layout;
use allocsim_replay::{Op, Prepared};
use allocsim_trace::Frame;
use serde::Serialize;

use crate::ScaleError;
use crate::fit::{SizeFit, distinct_points};
use crate::pattern::{self, Ref, SlotKey, TOp, TemplateError};

/// The largest shape value taken (2^40: a trillion tokens, pixels or samples), in a region's
/// name or given: past it a value is refused, so that no arithmetic on values overflows.
pub const MAX_VALUE: u64 = 1 << 40;

/// One trace to learn from, and the value of each of its iterations when they are given rather
/// than annotated.
#[derive(Clone, Copy)]
pub struct Input<'a> {
    pub name: &'a str,
    pub prepared: &'a Prepared,
    /// `--values`: one per iteration of the `phases` layout (`None`: not told, not learnt from);
    /// `None` here: the values are the `record_function` regions named `PARAM=VALUE`.
    pub values: Option<&'a [Option<u64>]>,
}

/// Where a trace's steps come from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum StepsFrom {
    /// `record_function` regions named `PARAM=VALUE`.
    Annotations { name: String },
    /// The iterations of the `phases` layout, with `--values`.
    Values { iterations: String, given: usize, iterations_found: usize },
}

/// One step of one trace.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Step {
    pub trace: usize,
    /// Its number in its trace: the layout's iteration, or the annotated region's rank.
    pub index: usize,
    pub value: Option<u64>,
    /// Ops `[start, end)` of its trace's program, and its requests.
    pub ops: (usize, usize),
    pub requests: (u32, u32),
    /// Ends with its boundary (an `END` annotation, or the next repetition).
    pub complete: bool,
    /// The trace recorded an OOM inside it (the job's step was cut short).
    pub recorded_oom: bool,
}

impl Step {
    pub fn op_range(&self) -> Range<usize> {
        self.ops.0..self.ops.1
    }
}

/// What a step was used for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Role {
    /// Learnt from: one of the steps of this structure.
    Learnt { structure: usize },
    /// The trace's first step, whose requests no later step repeats (it also sets up: the model,
    /// the optimizer's state); `more_requests` than the steady structure of its value has.
    First { more_requests: i64 },
    /// A later step at the same value makes other requests (a warm-up step; a library's first
    /// call): the later one's structure is learnt.
    Superseded { by: usize },
    /// No value given for it.
    NoValue,
    /// Its value was held out (`--hold-out`): not learnt from.
    HeldOut,
    /// Cut off by the trace's start or end.
    Incomplete,
    /// Cut short by a recorded OOM.
    RecordedOom,
    /// Its ops cannot be a pattern (a CUDA-graph tree's checkpoint, a release from before the
    /// trace).
    Unusable,
}

/// A request's key across traces: its stream, pool, and stack by content.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct GKey {
    pub stream: u64,
    pub private: bool,
    /// Index into [`Learnt::stacks`].
    pub stack: u32,
}

/// A request a step's op refers to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SRef {
    /// The step's own `k`-th request.
    Local(u32),
    /// One of the requests the previous step made and left alive at its end that this step
    /// frees (gradients freed at the next `zero_grad()`), by its rank among those (in the order
    /// they were made). Not by key, nor by rank among all the previous step left alive: the same
    /// parameter's gradient is made by another kernel, with another stack, where a library
    /// switches algorithms (embedding backward past 3,072 indices), and the first step leaves
    /// the weights and the optimizer's state alive besides. Which requests of the step a
    /// prediction follows these are: [`PrevInfo`].
    Prev(u32),
    /// Any other earlier request of that trace, by ordinal.
    Abs { trace: u32, q: u32 },
    /// A block from before that trace began.
    Pre { trace: u32, pre: u32 },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SOp {
    Malloc(u32),
    Free { r: SRef, deferred: bool },
    Complete(SRef),
    EmptyCache,
}

/// What a step freed of what the step before it left alive: how many that one left alive, and
/// for each request freed ([`SRef::Prev`]'s rank), its rank among those, its key, and its rank
/// among those of its key.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrevInfo {
    pub crossing: usize,
    pub freed: Vec<(u32, GKey, u32)>,
}

/// Steps that make the same requests (by key) in the same order with the same frees: one
/// structure, whatever the sizes.
#[derive(Clone, Debug)]
pub struct Structure {
    pub keys: Vec<GKey>,
    pub ops: Vec<SOp>,
    pub steps: Vec<usize>,
    /// The recorded request each slot stands for (trace, ordinal), in its first step.
    pub recorded: Vec<(usize, u32)>,

    /// Per slot: (value, size) in each of its steps.
    pub points: Vec<Vec<(u64, u64)>>,
    /// Slots whose size differed between two steps at one value (the larger is kept).
    pub conflicts: u32,
}

impl Structure {
    /// Its distinct values, increasing.
    pub fn values(&self, steps: &[Step]) -> Vec<u64> {
        let mut v: Vec<u64> = self.steps.iter().filter_map(|&s| steps[s].value).collect();
        v.sort_unstable();
        v.dedup();
        v
    }
}

/// A structure's requests with their sizes fitted over every step that makes them (its own, and
/// the other structures' requests aligned with them).
#[derive(Clone, Debug)]
pub struct Fitted {
    pub fits: Vec<SizeFit>,
    /// Per slot: the distinct values it was seen at.
    pub seen: Vec<Vec<u64>>,
    /// Per other structure (by index): the slot of it aligned with each slot of this one (empty
    /// for the structures not next to this one in value order).
    pub aligned: Vec<Vec<Option<u32>>>,
}

impl Fitted {
    /// Whether slot `k` was seen at one value only (its dependence on the value is not known).
    pub fn single_valued(&self, k: usize) -> bool {
        self.seen[k].len() == 1
    }
}

/// What was learnt from the traces.
#[derive(Clone, Debug)]
pub struct Learnt {
    pub param: String,
    pub from: Vec<StepsFrom>,
    pub steps: Vec<Step>,
    pub roles: Vec<Role>,
    pub structures: Vec<Structure>,
    /// The structure learnt for each recorded value.
    pub by_value: BTreeMap<u64, usize>,
    /// Per structure learnt for some value: its fits (`None` for the others).
    pub fitted: Vec<Option<Fitted>>,
    /// Every call stack, by content (the traces' own ids map into it).
    pub stacks: Vec<Vec<Frame>>,
    /// Per trace: its stack ids → [`Learnt::stacks`].
    pub stack_maps: Vec<Vec<u32>>,
    /// Values at which steps of different traces, each the last at it in its trace, differ (the
    /// first trace's is learnt).
    pub ambiguous_values: Vec<u64>,
    /// Per step: what it freed of what the step before it left alive.
    pub prev_info: Vec<PrevInfo>,
}

/// The steps of one trace.
pub fn find_steps(input: &Input<'_>, trace: usize, param: &str, by: Option<&str>) -> Result<(Vec<Step>, StepsFrom), ScaleError> {
    let p = input.prepared;
    let layout = Layout::of(p, by).map_err(|e| ScaleError::Usage(format!("{}: {e}", input.name)))?;
    let op_index = p.program.op_trace_indices(&p.trace, &p.segments);
    let op_at = |entry: u32| op_index.partition_point(|&i| i < entry);
    let oom_in = |r: (u32, u32)| p.program.requests[r.0 as usize..r.1 as usize].iter().any(|q| q.recorded_oom);
    let mut steps = Vec::new();
    let from = match input.values {
        None => {
            let prefix = format!("{param}=");
            let mut last_end = 0u32;
            for r in &layout.regions {
                let Some(v) = r.name.strip_prefix(&prefix) else { continue };
                let value: u64 = v.trim().parse().map_err(|_| {
                    ScaleError::Usage(format!(
                        "{}: the region {:?} does not give {param} as a whole number (annotate steps with record_function(\"{param}=N\"))",
                        input.name, r.name
                    ))
                })?;
                if value == 0 || value > MAX_VALUE {
                    return Err(ScaleError::Usage(format!("{}: the region {:?} gives {param} as {value}: shape values are 1 to 2^40", input.name, r.name)));
                }
                // A region inside another of the same parameter is part of that step.
                if r.span.start_entry < last_end {
                    continue;
                }
                last_end = r.span.end_entry;
                let requests = (r.span.request_start, r.span.request_end);
                steps.push(Step {
                    trace,
                    index: steps.len(),
                    value: Some(value),
                    ops: (op_at(r.span.start_entry), op_at(r.span.end_entry)),
                    requests,
                    complete: !r.open_start && !r.open_end,
                    recorded_oom: oom_in(requests),
                });
            }
            if steps.is_empty() {
                let mut names: Vec<&str> = Vec::new();
                for r in &layout.regions {
                    if !names.contains(&r.name.as_str()) {
                        names.push(&r.name);
                    }
                }
                let has = if names.is_empty() {
                    "no record_function annotations".to_string()
                } else {
                    let mut shown: Vec<&str> = names.iter().take(8).copied().collect();
                    if names.len() > 8 {
                        shown.push("…");
                    }
                    format!("annotations {}", shown.join(", "))
                };
                return Err(ScaleError::Usage(format!(
                    "{}: no record_function regions named {param}=VALUE (it has {has}); annotate each step (allocsim.torch.step({param}=N)) or give the value of each iteration with --values v1,v2,…",
                    input.name
                )));
            }
            StepsFrom::Annotations { name: param.to_string() }
        }
        Some(values) => {
            let n = layout.iterations.len();
            if values.len() > n {
                return Err(ScaleError::Usage(format!(
                    "{}: {} values given but the trace has {n} iteration{} ({}): one value per iteration",
                    input.name,
                    values.len(),
                    if n == 1 { "" } else { "s" },
                    iterations_in_words(&layout)
                )));
            }
            if let Some(v) = values.iter().flatten().find(|&&v| v == 0 || v > MAX_VALUE) {
                return Err(ScaleError::Usage(format!("{}: --values {v}: shape values are 1 to 2^40", input.name)));
            }
            for it in &layout.iterations {
                let requests = (it.span.request_start, it.span.request_end);
                steps.push(Step {
                    trace,
                    index: it.index,
                    value: values.get(it.index).copied().flatten(),
                    ops: (op_at(it.span.start_entry), op_at(it.span.end_entry)),
                    requests,
                    complete: it.complete,
                    recorded_oom: oom_in(requests),
                });
            }
            StepsFrom::Values { iterations: iterations_in_words(&layout), given: values.len(), iterations_found: n }
        }
    };
    Ok((steps, from))
}

fn iterations_in_words(l: &Layout) -> String {
    match &l.source {
        allocsim_phases::Source::Annotation { names } => format!("iterations end at each {}", names.join(", ")),
        allocsim_phases::Source::Pattern { marker, .. } => format!("iterations from the repeating request pattern, each starting at {marker}"),
        allocsim_phases::Source::Whole { reason } => format!("one iteration, the whole trace: {reason}"),
    }
}

/// A step's ops in cross-trace terms.
struct StepPattern {
    keys: Vec<GKey>,
    ops: Vec<SOp>,
    sizes: Vec<u64>,
    recorded: Vec<u32>,
}

/// Learns how each request of the steps follows the value; steps at a value of `hold_out` are
/// not learnt from.
pub fn learn(param: &str, inputs: &[Input<'_>], steps_per_trace: Vec<(Vec<Step>, StepsFrom)>, hold_out: &[u64]) -> Result<Learnt, ScaleError> {
    // Stacks by content, across traces.
    let mut stacks: Vec<Vec<Frame>> = Vec::new();
    let mut ids: HashMap<Vec<Frame>, u32> = HashMap::new();
    let mut stack_maps = Vec::with_capacity(inputs.len());
    for inp in inputs {
        let map: Vec<u32> = inp
            .prepared
            .stacks
            .iter()
            .map(|f| {
                *ids.entry(f.clone()).or_insert_with(|| {
                    stacks.push(f.clone());
                    (stacks.len() - 1) as u32
                })
            })
            .collect();
        stack_maps.push(map);
    }
    let gkey = |t: usize, k: SlotKey| GKey { stream: k.stream, private: k.private, stack: stack_maps[t].get(k.stack as usize).copied().unwrap_or(u32::MAX) };
    let mut steps: Vec<Step> = Vec::new();
    let mut from = Vec::new();
    for (s, f) in steps_per_trace {
        steps.extend(s);
        from.push(f);
    }
    let n = steps.len();
    let mut roles: Vec<Role> = vec![Role::NoValue; n];
    // Requests each step leaves alive at its end (freed later), in order.
    let crossing: Vec<Vec<u32>> = steps
        .iter()
        .map(|st| {
            let prog = &inputs[st.trace].prepared.program;
            let mut freed = vec![false; (st.requests.1 - st.requests.0) as usize];
            for op in &prog.ops[st.op_range()] {
                if let Op::Free { req, .. } = *op
                    && (st.requests.0..st.requests.1).contains(&req)
                {
                    freed[(req - st.requests.0) as usize] = true;
                }
            }
            (st.requests.0..st.requests.1).filter(|q| !freed[(q - st.requests.0) as usize]).collect()
        })
        .collect();
    // Each usable step's pattern.
    let mut patterns: Vec<Option<StepPattern>> = Vec::with_capacity(n);
    let mut prev_info: Vec<PrevInfo> = vec![PrevInfo::default(); n];
    for (i, st) in steps.iter().enumerate() {
        let usable = if st.value.is_none() {
            Err(Role::NoValue)
        } else if st.value.is_some_and(|v| hold_out.contains(&v)) {
            Err(Role::HeldOut)
        } else if !st.complete {
            Err(Role::Incomplete)
        } else if st.recorded_oom {
            Err(Role::RecordedOom)
        } else {
            Ok(())
        };
        if let Err(r) = usable {
            roles[i] = r;
            patterns.push(None);
            continue;
        }
        let p = inputs[st.trace].prepared;
        let t = match pattern::template(&p.program, &p.empty_cache, st.op_range(), st.requests.0) {
            Ok(t) => t,
            Err(TemplateError::Checkpoint(_) | TemplateError::ForcedRelease) => {
                roles[i] = Role::Unusable;
                patterns.push(None);
                continue;
            }
        };
        // The previous step of the same trace, when it ends where this one starts or before.
        let prev = (i > 0 && steps[i - 1].trace == st.trace && steps[i - 1].ops.1 <= st.ops.0).then(|| i - 1);
        let prog = &p.program;
        let tr = st.trace;
        // What this step frees of what the previous step left alive, in the order they were made.
        let mut freed_prev: Vec<u32> = Vec::new();
        if let Some(pi) = prev {
            for o in &t.ops {
                if let TOp::Free { r: Ref::Earlier(q), .. } | TOp::Complete(Ref::Earlier(q)) = *o
                    && crossing[pi].binary_search(&q).is_ok()
                {
                    freed_prev.push(q);
                }
            }
            freed_prev.sort_unstable();
            freed_prev.dedup();
            let keys: Vec<GKey> = crossing[pi].iter().map(|&q| gkey(tr, pattern::key(prog, q))).collect();
            prev_info[i] = PrevInfo {
                crossing: crossing[pi].len(),
                freed: freed_prev
                    .iter()
                    .map(|q| {
                        let idx = crossing[pi].binary_search(q).expect("freed from the crossing");
                        let key = keys[idx];
                        (idx as u32, key, keys[..idx].iter().filter(|&&k| k == key).count() as u32)
                    })
                    .collect(),
            };
        }
        let sref = |r: Ref| -> SRef {
            match r {
                Ref::Local(k) => SRef::Local(k),
                Ref::Pre(pre) => SRef::Pre { trace: tr as u32, pre },
                Ref::Earlier(q) => match freed_prev.binary_search(&q) {
                    Ok(rank) => SRef::Prev(rank as u32),
                    Err(_) => SRef::Abs { trace: tr as u32, q },
                },
            }
        };
        let ops = t
            .ops
            .iter()
            .map(|o| match *o {
                TOp::Malloc(k) => SOp::Malloc(k),
                TOp::Free { r, deferred } => SOp::Free { r: sref(r), deferred },
                TOp::Complete(r) => SOp::Complete(sref(r)),
                TOp::EmptyCache => SOp::EmptyCache,
            })
            .collect();
        patterns.push(Some(StepPattern {
            keys: t.slots.iter().map(|s| gkey(tr, s.key)).collect(),
            ops,
            sizes: t.slots.iter().map(|s| s.size).collect(),
            recorded: t.slots.iter().map(|s| s.recorded).collect(),
        }));
    }
    // Structures: steps with the same keys and ops.
    let mut structures: Vec<Structure> = Vec::new();
    let mut index: HashMap<(Vec<GKey>, Vec<SOp>), usize> = HashMap::new();
    let mut structure_of: Vec<Option<usize>> = vec![None; n];
    for (i, pat) in patterns.iter().enumerate() {
        let Some(pat) = pat else { continue };
        let s = *index.entry((pat.keys.clone(), pat.ops.clone())).or_insert_with(|| {
            structures.push(Structure {
                keys: pat.keys.clone(),
                ops: pat.ops.clone(),
                steps: Vec::new(),
                recorded: pat.recorded.iter().map(|&q| (steps[i].trace, q)).collect(),
                points: Vec::new(),
                conflicts: 0,
            });
            structures.len() - 1
        });
        structures[s].steps.push(i);
        structure_of[i] = Some(s);
        roles[i] = Role::Learnt { structure: s };
    }
    // A trace's first step that no later step repeats sets up besides (not learnt from).
    let mut first_steps = Vec::new();
    for t in 0..inputs.len() {
        if let Some(i) = steps.iter().position(|s| s.trace == t)
            && let Some(s) = structure_of[i]
            && !structures[s].steps.iter().any(|&j| j != i && steps[j].trace == t)
        {
            first_steps.push((i, s));
            structure_of[i] = None;
            structures[s].steps.retain(|&j| j != i);
        }
    }
    // Within a trace, a step whose structure differs from a later step's at the same value was
    // superseded by it.
    for i in 0..n {
        let Some(s) = structure_of[i] else { continue };
        let later = (i + 1..n).filter(|&j| steps[j].trace == steps[i].trace && steps[j].value == steps[i].value).filter_map(|j| structure_of[j]).next_back();
        if let Some(b) = later
            && b != s
        {
            roles[i] = Role::Superseded { by: b };
            structure_of[i] = None;
        }
    }
    // The structure of each value: the first trace's where traces differ.
    let mut by_value: BTreeMap<u64, usize> = BTreeMap::new();
    let mut ambiguous_values = Vec::new();
    for i in 0..n {
        let Some(s) = structure_of[i] else { continue };
        let v = steps[i].value.expect("value");
        match by_value.get(&v) {
            None => {
                by_value.insert(v, s);
            }
            Some(&b) if b != s => {
                if !ambiguous_values.contains(&v) {
                    ambiguous_values.push(v);
                }
                roles[i] = Role::Superseded { by: b };
                structure_of[i] = None;
            }
            _ => {}
        }
    }
    // Keep only the steps each structure is learnt from.
    for (s, st) in structures.iter_mut().enumerate() {
        st.steps.retain(|&i| structure_of[i] == Some(s));
        let mut pts: Vec<Vec<(u64, u64)>> = vec![Vec::new(); st.keys.len()];
        let mut conflicts = vec![false; st.keys.len()];
        for &i in &st.steps {
            let pat = patterns[i].as_ref().expect("pattern");
            let v = steps[i].value.expect("value");
            for (k, &size) in pat.sizes.iter().enumerate() {
                conflicts[k] |= pts[k].iter().any(|&(x, y)| x == v && y != size);
                pts[k].push((v, size));
            }
        }
        st.points = pts;
        st.conflicts = conflicts.iter().filter(|&&c| c).count() as u32;
    }
    for (i, _) in first_steps {
        let v = steps[i].value.expect("value");
        let steady = by_value.get(&v).or_else(|| by_value.values().next()).map_or(0, |&b| structures[b].keys.len() as i64);
        roles[i] = Role::First { more_requests: patterns[i].as_ref().map_or(0, |p| p.keys.len() as i64) - steady };
    }
    if by_value.is_empty() {
        return Err(ScaleError::Usage(describe_nothing_learnt(param, &steps, &roles)));
    }
    let live: Vec<usize> = {
        let mut v: Vec<usize> = by_value.values().copied().collect();
        v.sort_unstable();
        v.dedup();
        v
    };
    // Number the structures learnt for some value first, by their smallest value; the others after.
    let mut order: Vec<usize> = live.clone();
    order.sort_by_key(|&s| by_value.iter().find(|(_, b)| **b == s).map(|(v, _)| *v));
    order.extend((0..structures.len()).filter(|s| !live.contains(s)));
    let mut new_of = vec![0usize; structures.len()];
    for (new, &old) in order.iter().enumerate() {
        new_of[old] = new;
    }
    let mut slots: Vec<Option<Structure>> = structures.into_iter().map(Some).collect();
    let structures: Vec<Structure> = order.iter().map(|&o| slots[o].take().expect("each once")).collect();
    for r in roles.iter_mut() {
        match r {
            Role::Learnt { structure } => *structure = new_of[*structure],
            Role::Superseded { by } => *by = new_of[*by],
            _ => {}
        }
    }
    for s in by_value.values_mut() {
        *s = new_of[*s];
    }
    let live: Vec<usize> = (0..live.len()).collect();
    // Structures next to each other in value order (where the structure changes between two
    // recorded values).
    let mut neighbours: Vec<Vec<usize>> = vec![Vec::new(); structures.len()];
    let seq: Vec<usize> = by_value.values().copied().collect();
    for w in seq.windows(2) {
        if w[0] != w[1] {
            for (a, b) in [(w[0], w[1]), (w[1], w[0])] {
                if !neighbours[a].contains(&b) {
                    neighbours[a].push(b);
                }
            }
        }
    }
    let fitted = (0..structures.len()).map(|s| live.contains(&s).then(|| fit_structure(&structures, s, &neighbours[s]))).collect();
    Ok(Learnt { param: param.to_string(), from, steps, roles, structures, by_value, fitted, stacks, stack_maps, ambiguous_values, prev_info })
}

fn describe_nothing_learnt(param: &str, steps: &[Step], roles: &[Role]) -> String {
    let count = |f: &dyn Fn(&Role) -> bool| roles.iter().filter(|r| f(r)).count();
    let with_value = steps.iter().filter(|s| s.value.is_some()).count();
    format!(
        "no step to learn from: {} step{} found, {with_value} with a value of {param}; {} held out, {} cut short by a recorded OOM, {} cut off by the trace's start or end, {} the first step (whose requests no later step repeats), {} unusable",
        steps.len(),
        if steps.len() == 1 { "" } else { "s" },
        count(&|r| matches!(r, Role::HeldOut)),
        count(&|r| matches!(r, Role::RecordedOom)),
        count(&|r| matches!(r, Role::Incomplete)),
        count(&|r| matches!(r, Role::First { .. })),
        count(&|r| matches!(r, Role::Unusable)),
    )
}

/// One slot's recorded points, for [`consistent`]: one point per value (`None` when it had two
/// sizes at one value), and their fit.
struct Own {
    points: Option<Vec<(u64, u64)>>,
    fit: SizeFit,
}

impl Own {
    fn of(points: &[(u64, u64)]) -> Own {
        let d = distinct_points(points);
        let clean = points.iter().all(|&(x, y)| d.binary_search_by_key(&x, |p| p.0).is_ok_and(|k| d[k].1 == y));
        let fit = SizeFit::from_points(&d);
        Own { points: clean.then_some(d), fit }
    }

    fn checked(&self) -> bool {
        self.points.as_ref().is_some_and(|d| self.fit.checked_by(d.len()))
    }
}

/// Whether one exact fit explains two slots' sizes (`a`, `b`: their recorded points), checked on
/// a value it was not made from. A slot whose own points no exact fit explains cannot be part of
/// one; a slot whose own fit is checked decides alone (any exact fit through more points agrees
/// with it on its own); else both have three values at most and the union is fitted.
fn consistent(a: &Own, b: &Own) -> bool {
    let (Some(pa), Some(pb)) = (&a.points, &b.points) else { return false };
    if !a.fit.is_exact() || !b.fit.is_exact() {
        return false;
    }
    let on = |f: &SizeFit, pts: &[(u64, u64)]| pts.iter().all(|&(x, y)| f.at(x) == Ok(y));
    if a.checked() {
        return on(&a.fit, pb);
    }
    if b.checked() {
        return on(&b.fit, pa);
    }
    let mut u: Vec<(u64, u64)> = pa.iter().chain(pb).copied().collect();
    u.sort_unstable();
    u.dedup();
    if u.windows(2).any(|w| w[0].0 == w[1].0) {
        return false;
    }
    SizeFit::from_points(&u).checked_by(u.len())
}

/// The fits of structure `s`: its own points and those of the requests aligned with its own in
/// `neighbours`, the structures next to it in value order (only those: a job whose every value
/// makes other requests costs two alignments per structure, not one per pair).
fn fit_structure(structures: &[Structure], s: usize, neighbours: &[usize]) -> Fitted {
    let me = &structures[s];
    let mut points: Vec<Vec<(u64, u64)>> = me.points.clone();
    let mut aligned: Vec<Vec<Option<u32>>> = vec![Vec::new(); structures.len()];
    for &o in neighbours {
        let other = &structures[o];
        let (mine, theirs): (Vec<Own>, Vec<Own>) = (me.points.iter().map(|p| Own::of(p)).collect(), other.points.iter().map(|p| Own::of(p)).collect());
        let pairs = pattern::align(&me.keys, &other.keys, |i, j| consistent(&mine[i], &theirs[j]));
        let mut map = vec![None; me.keys.len()];
        for (i, j) in pairs {
            map[i] = Some(j as u32);
            points[i].extend_from_slice(&other.points[j]);
        }
        aligned[o] = map;
    }
    let fits: Vec<SizeFit> = points.iter().map(|p| SizeFit::from_points(p)).collect();
    let seen = points
        .iter()
        .map(|p| {
            let mut v: Vec<u64> = p.iter().map(|x| x.0).collect();
            v.sort_unstable();
            v.dedup();
            v
        })
        .collect();
    Fitted { fits, seen, aligned }
}
