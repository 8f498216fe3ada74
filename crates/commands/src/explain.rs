//! `explain`: why a request ran out of memory (logic: `allocsim_report::explain`).

use std::io::{self, Write};

use allocsim_model::AllocatorConfig;
use allocsim_model::format::format_size as fs;
use allocsim_replay::settings_change::NotReproduced;
use allocsim_report::explain::{At, CANDIDATES, Explanation, OomCause};
use allocsim_trace::Snapshot;
use serde_json::Value;

use crate::{Answer, Error, Trace, TraceOptions};

/// `explain`'s question.
#[derive(Clone, Debug)]
pub struct ExplainOptions {
    pub trace: TraceOptions,
    /// `oom` (the OOM that ended the run: `allocsim_report::explain::ending_oom`), `first` (the
    /// first request that runs out of memory in the replay), a request number N (0-based, as in
    /// `replay --json`), or `peak`. Default: `oom`.
    pub at: Option<String>,
    /// Settings to replay under (default: the trace's own).
    pub config: Option<String>,
    /// The allowed maximum, as `set_per_process_memory_fraction` gives it (default: the trace's
    /// own budget, inferred from it).
    pub capacity: Option<u64>,
    /// How many pinned segments and call sites to list.
    pub top: usize,
}

impl Default for ExplainOptions {
    fn default() -> Self {
        ExplainOptions { trace: TraceOptions::default(), at: None, config: None, capacity: None, top: 5 }
    }
}

/// `explain` (`addresses_from`: a recorded run whose segment addresses the replay takes).
pub fn explain(t: Trace<'_>, addresses_from: Option<&Snapshot>, a: &ExplainOptions) -> Result<ExplainAnswer, Error> {
    let (p, config) = a.trace.prepare_for(t.snapshot, a.config.as_deref(), a.capacity)?;
    if p.program.requests.is_empty() {
        // No history: the final state is all there is to explain.
        return Ok(ExplainAnswer::FinalState { name: t.name.to_owned(), device: p.device, state: allocsim_report::explain::final_state(&p), top: a.top });
    }
    let placement = match addresses_from {
        Some(other) => allocsim_replay::recorded_placement(other.device_traces.get(p.device).map_or(&[], |v| v.as_slice()), p.device_memory),
        None => p.recorded_placement(),
    };
    let own = p.is_own(&config, a.capacity);
    let at = match a.at.as_deref() {
        None | Some("oom") | Some("last") => At::EndingOom,
        Some("first") => At::FirstOom,
        Some("peak") => At::Peak,
        Some(n) => At::Request(n.parse().map_err(|_| Error::Usage(format!("--at {n:?}: expected oom, first, peak or a request number")))?),
    };
    if let At::Request(n) = at
        && n as usize >= p.program.requests.len()
    {
        return Err(Error::Usage(format!(
            "--at {n}: the trace has {} requests (0 to {})",
            p.program.requests.len(),
            p.program.requests.len().saturating_sub(1)
        )));
    }
    let Some(x) = allocsim_report::explain::explain(&p, &config, a.capacity, &placement, at, CANDIDATES) else {
        let not_reproduced = p.not_reproduced();
        return Ok(ExplainAnswer::NoOom { name: t.name.to_owned(), config: config.source.clone(), capacity: a.capacity, not_reproduced });
    };
    let asked = matches!(at, At::Request(_) | At::Peak);
    // Every OOM of the replay, with its cause, to say whether the others share this one's.
    let outcome = if own { p.own_outcome.clone() } else { p.replay_under(&config, &p.limits(a.capacity), placement.clone()) };
    let causes = allocsim_report::explain::oom_causes(&p, &outcome);
    let not_reproduced = p.not_reproduced();
    Ok(ExplainAnswer::Explained(Box::new(Explained { x, config, top: a.top, prepared: p, capacity: a.capacity, causes, own, asked, not_reproduced })))
}

/// What `explain` found.
pub enum ExplainAnswer {
    /// Nothing ran out of memory (asked for `oom`).
    NoOom {
        name: String,
        config: String,
        capacity: Option<u64>,
        /// The trace's own replay is not the recording (which may have run out of memory).
        not_reproduced: Option<NotReproduced>,
    },
    /// A snapshot without history (a segments list, or recording off): its final state.
    FinalState {
        name: String,
        device: usize,
        state: allocsim_report::explain::FinalState,
        top: usize,
    },
    Explained(Box<Explained>),
}

/// An explanation and what its text needs besides.
pub struct Explained {
    pub x: Explanation,
    pub config: AllocatorConfig,
    pub top: usize,
    pub prepared: allocsim_replay::Prepared,
    pub capacity: Option<u64>,
    /// Every OOM of the replay, with its cause.
    pub causes: Vec<OomCause>,
    /// Whether the replay is under the trace's own settings and budget.
    pub own: bool,
    /// The request was asked for (`--at N` or `peak`) rather than found as the OOM that ended
    /// the run.
    pub asked: bool,
    /// The trace's own replay is not the recording.
    pub not_reproduced: Option<NotReproduced>,
}

impl Answer for ExplainAnswer {
    fn write_text(&self, out: &mut dyn Write) -> io::Result<()> {
        match self {
            ExplainAnswer::NoOom { name, config, capacity, not_reproduced } => {
                writeln!(
                    out,
                    "{name}: no request runs out of memory under {}{} — nothing to explain at `oom` (try --at peak or --at N)",
                    if config.is_empty() { "the defaults" } else { config },
                    capacity.map_or(String::new(), |c| format!(" with {} allowed", fs(c)))
                )?;
                crate::input::write_not_reproduced(out, not_reproduced.as_ref(), false)
            }
            ExplainAnswer::FinalState { name, device, state, top } => write_final_state(out, name, *device, state, *top),
            ExplainAnswer::Explained(e) => {
                let cx = Context { prepared: &e.prepared, capacity: e.capacity };
                write_verdict(out, e)?;
                crate::input::write_not_reproduced(out, e.not_reproduced.as_ref(), false)?;
                if e.x.message.is_some() {
                    write_oom_table(out, &e.x, &e.causes, e.own)?;
                }
                writeln!(out)?;
                writeln!(out, "Details")?;
                write_explanation(out, &e.x, &e.config, e.top, &cx)
            }
        }
    }
    fn to_json(&self) -> Value {
        match self {
            ExplainAnswer::NoOom { not_reproduced, .. } => {
                let mut out = serde_json::json!({"explanation": null, "reason": "no OOM"});
                crate::input::add_not_reproduced_json(&mut out, not_reproduced.as_ref());
                out
            }
            ExplainAnswer::FinalState { state, .. } => serde_json::json!({"explanation": null, "reason": "no trace entries", "final_state": state}),
            ExplainAnswer::Explained(e) => {
                let mut out = serde_json::to_value(&e.x).expect("JSON");
                out["verdict"] = verdict_lines(e).into();
                out["budget"] = e.prepared.budget.to_json();
                out["ooms"] = serde_json::to_value(&e.causes).expect("JSON");
                crate::input::add_not_reproduced_json(&mut out, e.not_reproduced.as_ref());
                out
            }
        }
    }
}
/// `explain` on a snapshot without history: its final state, and the live blocks that pin free
/// memory (`top` of them).
fn write_final_state(out: &mut dyn Write, name: &str, device: usize, f: &allocsim_report::explain::FinalState, top: usize) -> io::Result<()> {
    writeln!(
        out,
        "{name} (device {device}), final state: {} reserved in {} segments, {} allocated, {} free (largest free block {}); {} of the free is in segments that live blocks keep from being released",
        fs(f.reserved),
        f.segments,
        fs(f.allocated),
        fs(f.free),
        fs(f.largest_free_block),
        fs(f.pinned_free)
    )?;
    if !f.pinning_sites.is_empty() {
        writeln!(out, "Live blocks that keep free memory from being released, by where they were allocated:")?;
        for s in f.pinning_sites.iter().take(top) {
            writeln!(
                out,
                "  {:>12} free pinned by {} block{} ({}) from {}",
                fs(s.pinned_free),
                s.blocks,
                if s.blocks == 1 { "" } else { "s" },
                fs(s.live_bytes),
                s.call_site
            )?;
        }
    }
    if !f.pinned.is_empty() {
        writeln!(out, "Segments whose free memory live blocks pin (most free first; {} such segments):", f.pinned.len())?;
        for s in f.pinned.iter().take(top) {
            writeln!(
                out,
                "  {:#x}  {} segment, {} free (largest {}), held by {} live block{}",
                s.address,
                fs(s.size),
                fs(s.free),
                fs(s.largest_free_block),
                s.live.len(),
                if s.live.len() == 1 { "" } else { "s" }
            )?;
        }
    }
    Ok(())
}

/// What `explain` knows of the replay besides the explanation: the prepared trace (its budget)
/// and `--capacity`.
pub struct Context<'a> {
    pub prepared: &'a allocsim_replay::Prepared,
    pub capacity: Option<u64>,
}

/// The explained OOM in at most six lines (`allocsim_report::explain::verdict_lines`).
pub fn verdict_lines(e: &Explained) -> Vec<String> {
    allocsim_report::explain::verdict_lines(&e.x, &e.causes, e.own, e.asked, &e.config, e.capacity, &e.prepared)
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

/// The verdict: the explained OOM (or the request or state asked for) in a few lines.
fn write_verdict(out: &mut dyn Write, e: &Explained) -> io::Result<()> {
    for l in verdict_lines(e) {
        writeln!(out, "{l}")?;
    }
    Ok(())
}

/// Every OOM of the replay in a short table, repeats (the same size, call site, cause and fate)
/// grouped, those the job survived marked.
fn write_oom_table(out: &mut dyn Write, x: &Explanation, causes: &[OomCause], own: bool) -> io::Result<()> {
    if causes.len() < 2 {
        return Ok(());
    }
    type Key<'a> = (u64, Option<&'a str>, &'static str, bool, bool);
    let mut groups: Vec<(Key<'_>, Vec<u32>)> = Vec::new();
    for c in causes {
        let key: Key<'_> = (c.size, c.call_site.as_deref(), c.limit, c.fragmentation, c.survived);
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => v.push(c.request),
            None => groups.push((key, vec![c.request])),
        }
    }
    let survived = causes.iter().filter(|c| c.survived).count();
    writeln!(out)?;
    if own {
        writeln!(out, "The {} OOMs the trace recorded (the job went on after {survived}):", causes.len())?;
    } else {
        writeln!(out, "The replay's {} OOMs:", causes.len())?;
    }
    for ((size, site, limit, frag, went_on), reqs) in &groups {
        let shown: Vec<String> = reqs.iter().take(4).map(|r| r.to_string()).collect();
        let more = if reqs.len() > 4 { format!(" … ({} in all)", reqs.len()) } else { String::new() };
        let label = format!("request{} {}{more}", plural(reqs.len()), shown.join(", "));
        let cause = match (*limit, *frag) {
            (_, true) => "fragmentation",
            ("device_full", false) => "device full",
            _ => "over the maximum",
        };
        let fate = if reqs.contains(&x.request) {
            "explained above"
        } else if *went_on {
            "survived"
        } else {
            "ended the run"
        };
        writeln!(out, "  {label:<30} {:>11}  {cause:<16} {fate:<15} {}", fs(*size), site.map_or("(no stack)".to_string(), |s| format!("from {s}")))?;
    }
    Ok(())
}

/// How many Python frames of a stack `explain` prints.
const STACK_FRAMES: usize = 8;

/// The Python frames of a stack, innermost first (the C++ frames are counted, not printed: they
/// are in `--json`).
fn write_stack(out: &mut dyn Write, frames: &[allocsim_trace::Frame]) -> io::Result<()> {
    let python: Vec<_> = allocsim_trace::frames::python_frames(frames).collect();
    let native = frames.len() - python.len();
    if python.len() > 1 {
        for f in python.iter().take(STACK_FRAMES) {
            writeln!(out, "      {}", allocsim_trace::frames::frame_text(f))?;
        }
        if python.len() > STACK_FRAMES {
            writeln!(out, "      ... {} more Python frames", python.len() - STACK_FRAMES)?;
        }
    }
    if native > 0 && !python.is_empty() {
        writeln!(out, "      ({native} C++ frames not shown; `--json` has the whole stack)")?;
    }
    Ok(())
}

/// `explain` as text: the request, the allocator's steps, where the free memory is, what pins it,
/// and what would have worked (`top`: how many pinned segments and sites to list).
pub fn write_explanation(out: &mut dyn Write, x: &Explanation, config: &AllocatorConfig, top: usize, cx: &Context<'_>) -> io::Result<()> {
    if x.at_start {
        writeln!(out, "The state when the trace began (the peak reserved: no request grew past it):")?;
    } else {
        write_request(out, x, config, cx)?;
    }
    write_free(out, x, top, cx)
}

/// The explained request, where it came from, and what the allocator did for it.
fn write_request(out: &mut dyn Write, x: &Explanation, config: &AllocatorConfig, cx: &Context<'_>) -> io::Result<()> {
    let (p, capacity) = (cx.prepared, cx.capacity);
    let pool = if x.small { "small pool" } else { "large pool" };
    writeln!(
        out,
        "Request {}: {} ({} bytes, rounded to {}) on stream {}, {pool}{}",
        x.request,
        fs(x.orig_size),
        x.orig_size,
        fs(x.rounded_size),
        x.stream,
        if x.recorded_oom { "; it ran out of memory in the trace too" } else { "" }
    )?;
    match &x.call_site {
        Some(s) => writeln!(out, "  from {s}")?,
        None => writeln!(out, "  (the trace recorded no stack for it)")?,
    }
    write_stack(out, &x.frames)?;
    if let Some(ph) = &x.phase {
        write_phase(out, ph)?;
    }
    writeln!(out, "  a new segment for it would be {}", fs(x.alloc_size))?;
    writeln!(out)?;
    writeln!(out, "What the allocator did:")?;
    for (i, l) in x.step_lines.iter().enumerate() {
        writeln!(out, "  {}. {l}", i + 1)?;
    }
    match &x.message {
        Some(m) => {
            let _ = m;
            writeln!(out, "  → out of memory (PyTorch's message is above, without NVML's per-process sentence, which a trace cannot show)")?;
            if capacity.is_none() {
                for line in crate::budget_lines(&p.budget) {
                    writeln!(out, "    budget: {line}")?;
                }
            }
            if config.expandable_segments {
                writeln!(out, "    (its hint to set expandable_segments:True does not apply: it is already on — pytorch/pytorch#173049)")?;
            }
        }
        None => writeln!(out, "  → served")?,
    }
    Ok(())
}

/// Where the reserved but unallocated memory is, what pins it, and (after an OOM) what other
/// settings do on the same requests.
fn write_free(out: &mut dyn Write, x: &Explanation, top: usize, cx: &Context<'_>) -> io::Result<()> {
    let (p, capacity) = (cx.prepared, cx.capacity);
    let pool = if x.small { "small pool" } else { "large pool" };
    writeln!(out)?;
    let f = &x.free;
    writeln!(out, "Where the {} reserved but not allocated is ({} reserved, {} allocated):", fs(f.unallocated()), fs(f.reserved), fs(f.allocated))?;
    let mut row = |label: &str, v: u64| -> io::Result<()> {
        if v > 0 {
            writeln!(out, "  {label:<58} {:>12}", fs(v))?;
        }
        Ok(())
    };
    row("free, in segments that live blocks keep from being released", f.pinned_by_live_blocks)?;
    row("free, in completely free segments", f.in_free_segments)?;
    row("  of which in the small pool (≤ 1 MiB requests only)", if x.small { 0 } else { f.free_small_pool })?;
    row("  of which in the large pool (> 1 MiB requests only)", if x.small { f.free_large_pool } else { 0 })?;
    row("  of which in private pools (CUDA graphs, MemPools)", f.free_private_pools)?;
    row("blocks waiting for cross-stream frees (record_stream)", f.pending_frees)?;
    row("rounding inside live blocks (allocated − requested)", f.rounding_waste)?;
    let other_streams: u64 = f.per_pool.iter().filter(|p| p.stream != x.stream).map(|p| p.free).sum();
    row("  free memory cached on other streams", other_streams)?;
    for pp in &f.private_pools {
        writeln!(
            out,
            "  private pool {:?}: {} reserved ({:.1}% of all) in {} segment{}, {} allocated, {} free{}",
            pp.pool_id,
            fs(pp.reserved),
            100.0 * pp.share_of_reserved,
            pp.segments,
            if pp.segments == 1 { "" } else { "s" },
            fs(pp.allocated),
            fs(pp.free),
            if pp.freeable { "; no longer serving requests (its users are gone), held by its live blocks until they go" } else { "" }
        )?;
    }
    if !x.at_start {
        writeln!(
            out,
            "  usable by this request (stream {}, {pool}): {} free, the largest contiguous block {} (needed {})",
            x.stream,
            fs(x.usable_free),
            fs(x.usable_largest_block),
            fs(x.rounded_size)
        )?;
    }
    writeln!(out, "  largest contiguous free block anywhere: {}; gap concentration Σgap²/(Σgap)² = {:.4}", fs(f.largest_free_block), f.gap_concentration)?;
    if !x.pinning_sites.is_empty() {
        writeln!(out)?;
        writeln!(out, "Live blocks that keep free memory from being released, by where they were allocated:")?;
        for s in x.pinning_sites.iter().take(top) {
            writeln!(
                out,
                "  {:>12} free pinned by {} block{} ({}) from {}",
                fs(s.pinned_free),
                s.blocks,
                if s.blocks == 1 { "" } else { "s" },
                fs(s.live_bytes),
                s.call_site
            )?;
        }
    }
    if !x.pinned.is_empty() {
        writeln!(out)?;
        writeln!(out, "Segments whose free memory live blocks pin (most free first; {} such segments):", x.pinned.len())?;
        for s in x.pinned.iter().take(top) {
            writeln!(
                out,
                "  {:#x}  {} {}segment{}, {} free (largest {}), held by {} live block{}:",
                s.address,
                fs(s.size),
                if s.expandable { "expandable " } else { "" },
                if s.pool_id != (0, 0) { format!(" of private pool {:?}", s.pool_id) } else { String::new() },
                fs(s.free),
                fs(s.largest_free_block),
                s.live.len(),
                if s.live.len() == 1 { "" } else { "s" }
            )?;
            for b in s.live.iter().take(4) {
                let req = if b.request == u32::MAX { "a block from before the trace".to_string() } else { format!("request {}", b.request) };
                writeln!(out, "      {} ({req}){}", fs(b.size), b.call_site.as_ref().map(|c| format!(" at {c}")).unwrap_or_default())?;
            }
            if s.live.len() > 4 {
                writeln!(out, "      ... {} more", s.live.len() - 4)?;
            }
        }
        if x.pinned.len() > top {
            let rest: u64 = x.pinned.iter().skip(top).map(|s| s.free).sum();
            writeln!(out, "  ... {} more segments with {} free", x.pinned.len() - top, fs(rest))?;
        }
    }
    if x.message.is_some() {
        writeln!(out)?;
        let limits = p.limits(capacity);
        writeln!(
            out,
            "Other settings, on the same requests{}:",
            match (capacity, limits.capacity, limits.outside.is_empty()) {
                (Some(c), _, _) => format!(", {} allowed", fs(c)),
                (None, Some(c), _) if p.budget.allowed_is_interval() => format!(
                    ", {} allowed: the inferred maximum, between {} and {}",
                    fs(c),
                    fs(p.budget.allowed_low.unwrap_or(c)),
                    fs(p.budget.allowed_high.unwrap_or(c))
                ),
                (None, Some(c), _) => format!(", {} allowed (inferred)", fs(c)),
                (None, None, false) => ", the memory the device had free as the trace shows it".to_string(),
                (None, None, true) => String::new(),
            }
        )?;
        // Settings with the same outcome share a row.
        let mut rows: Vec<(String, Vec<&str>)> = Vec::new();
        for alt in &x.alternatives {
            let verdict = match (&alt.rejected, alt.first_oom) {
                (Some(e), _) => format!("rejected by PyTorch: {e}"),
                (None, None) => format!("no OOM at all; peak reserved {}", fs(alt.peak_reserved)),
                (None, Some(_)) if alt.fixes => {
                    format!("serves this request and every one before it that the run served; peak reserved {}", fs(alt.peak_reserved))
                }
                (None, Some(_)) if alt.avoids => {
                    format!(
                        "gets past this request, but runs out of memory at request {}, which the run served",
                        alt.new_oom.unwrap_or(alt.first_oom.unwrap_or(x.request))
                    )
                }
                (None, Some(o)) => match alt.new_oom {
                    Some(n) if n < x.request => format!("runs out of memory at this request too, and first at request {n}, which the run served"),
                    _ if o == x.request => "runs out of memory at the same request".to_string(),
                    _ => "runs out of memory at this request too".to_string(),
                },
            };
            let depends = if alt.depends_on_allowed_maximum { " (depends on where in the inferred interval the allowed maximum lies)" } else { "" };
            let verdict = format!("{verdict}{depends}");
            match rows.iter_mut().find(|(v, _)| *v == verdict) {
                Some((_, confs)) => confs.push(&alt.conf),
                None => rows.push((verdict, vec![&alt.conf])),
            }
        }
        for (verdict, confs) in &rows {
            writeln!(out, "  {}", confs.join("; "))?;
            writeln!(out, "      {verdict}")?;
        }
        for n in &x.not_tried {
            writeln!(out, "  not tried: {n}")?;
        }
        let saved: Vec<&str> = x.alternatives.iter().filter(|a| a.fixes).map(|a| a.conf.as_str()).collect();
        let past: Vec<&str> = x.alternatives.iter().filter(|a| a.avoids && !a.fixes).map(|a| a.conf.as_str()).collect();
        if !saved.is_empty() {
            writeln!(out, "  → this request and every one before it that the run served are served under: {}", saved.join("; "))?;
        } else if !past.is_empty() {
            writeln!(out, "  → these get past this request, but a request before it that the run served runs out of memory: {}", past.join("; "))?;
        } else {
            writeln!(out, "  → none of these settings avoids this OOM; only more memory does:")?;
        }
        if let Some(c) = x.smallest_capacity {
            writeln!(
                out,
                "  {}: the smallest allowed maximum (to 2 MiB) under which, with these settings, this request and every one before it that the run served are served",
                fs(c)
            )?;
        }
    }
    Ok(())
}

/// Where the explained request falls: its iteration and annotated regions (nothing when the
/// trace has neither).
fn write_phase(out: &mut dyn Write, ph: &allocsim_phases::PhaseAt) -> io::Result<()> {
    use allocsim_phases::Source;
    let regions = if ph.regions.is_empty() { String::new() } else { format!(", inside {}", ph.regions.join(" › ")) };
    let Some(i) = ph.iteration else {
        if !regions.is_empty() {
            writeln!(out, "  {}", &regions[2..])?;
        }
        return Ok(());
    };
    let how = match &ph.source {
        Source::Annotation { names } => format!("iterations end at each `{}`", names.join("`/`")),
        Source::Pattern { repeats, .. } => {
            format!("iterations from a request pattern that repeats {repeats} times, the live memory returning to one level between repeats")
        }
        Source::Whole { .. } => {
            if !regions.is_empty() {
                writeln!(out, "  {}", &regions[2..])?;
            }
            return Ok(());
        }
    };
    let partial = if ph.complete { "" } else { ", after the last one" };
    writeln!(out, "  in iteration {i} of {} ({how}{partial}){regions}", ph.iterations)
}
