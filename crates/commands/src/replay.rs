//! `replay` and `validate`.

use std::io::{self, Write};

use allocsim_model::format::{format_size, oom_message};
use allocsim_replay::program::Request;
use allocsim_replay::replay::Oom;
use allocsim_replay::version::Rules;
use allocsim_replay::{ReplaySpec, ReplaySummary, TorchVersion};
use allocsim_trace::Snapshot;
use serde_json::{Value, json};

use crate::{Answer, Error, Trace, budget_lines};

/// The replay question (`allocsim replay`'s options).
#[derive(Clone, Debug, Default)]
pub struct ReplayOptions {
    /// A `PYTORCH_CUDA_ALLOC_CONF` string (default: the settings recorded in the snapshot).
    pub config: Option<String>,
    /// The allowed maximum (default: the budget inferred from the trace).
    pub capacity: Option<u64>,
    /// The device's total memory (default: as the trace shows it, else an H200's).
    pub device_memory: Option<u64>,
    /// The allowed maximum the trace itself was recorded under.
    pub trace_capacity: Option<u64>,
    /// Also replay under this many plausible segment placements.
    pub placements: Option<usize>,
    /// One device (default: every device with entries).
    pub device: Option<usize>,
    /// The PyTorch release whose rules apply (default: chosen from the snapshot, see
    /// [`allocsim_replay::version::Rules`]).
    pub torch_version: Option<TorchVersion>,
}

impl ReplayOptions {
    /// The replay question these options ask (`other`: a recorded run to take addresses from).
    pub fn spec<'a>(&self, other: Option<&'a Snapshot>) -> ReplaySpec<'a> {
        ReplaySpec {
            config: self.config.clone(),
            capacity: self.capacity,
            device_memory: self.device_memory,
            trace_capacity: self.trace_capacity,
            addresses_from: other,
            placements: self.placements,
            device: self.device,
            torch_version: self.torch_version,
        }
    }
}

/// `replay`: every device (or the one asked for), replayed in memory.
pub fn replay(t: Trace<'_>, addresses_from: Option<&Snapshot>, o: &ReplayOptions) -> Result<ReplayAnswer, Error> {
    let spec = o.spec(addresses_from);
    let all = if o.device.is_some() {
        vec![allocsim_replay::run(t.snapshot, &spec)?.into_summary()]
    } else {
        allocsim_replay::run::run_devices(t.snapshot, &spec)?.into_iter().map(|r| r.into_summary()).collect()
    };
    Ok(ReplayAnswer::new(t.name, o.clone(), all).with_no_history(t.snapshot.no_history_note()))
}

/// [`replay`] of a snapshot read for this replay alone ([`crate::file::replay_file`]): every
/// device's trace is moved into its replay rather than copied. The same answer.
pub fn replay_owned(name: &str, mut snap: Snapshot, addresses_from: Option<&Snapshot>, o: &ReplayOptions) -> Result<ReplayAnswer, Error> {
    if o.device.is_some() {
        // (A device asked for is checked after the settings, as `replay` checks it.)
        return replay(Trace { name, snapshot: &snap }, addresses_from, o);
    }
    let no_history = snap.no_history_note();
    let spec = o.spec(addresses_from);
    let all = allocsim_replay::run::run_devices_owned(&mut snap, &spec)?.into_iter().map(|r| r.into_summary()).collect();
    Ok(ReplayAnswer::new(name, o.clone(), all).with_no_history(no_history))
}

/// What `replay` found: one summary per device.
pub struct ReplayAnswer {
    pub name: String,
    pub options: ReplayOptions,
    /// One per device replayed, in device order.
    pub all: Vec<ReplaySummary>,
    /// What a snapshot without any trace entry can tell, and how to record history.
    pub no_history: Option<String>,
}

impl ReplayAnswer {
    /// From summaries computed elsewhere (the command line's streamed replay of a JSON Lines file).
    pub fn new(name: &str, options: ReplayOptions, all: Vec<ReplaySummary>) -> ReplayAnswer {
        let no_history = all.iter().all(|r| r.entries == 0).then(|| Snapshot::default().no_history_note()).flatten();
        ReplayAnswer { name: name.to_owned(), options, all, no_history }
    }

    /// Which release's rules the replay used, and why (as the replay said, else from the options).
    pub fn rules(&self) -> Rules {
        self.all.iter().find_map(|r| r.rules.clone()).unwrap_or_else(|| Rules::choose(self.options.torch_version, &Default::default()))
    }

    /// With the note of a snapshot without history (`Snapshot::no_history_note`).
    pub fn with_no_history(mut self, note: Option<String>) -> ReplayAnswer {
        self.no_history = note;
        self
    }
}

impl Answer for ReplayAnswer {
    fn write_text(&self, out: &mut dyn Write) -> io::Result<()> {
        write_replay_text(out, self, &self.all)
    }
    fn to_json(&self) -> Value {
        // The device that matters at the top level, and why.
        let choice = allocsim_replay::run::choice_of_replays(&self.all).expect("at least one device is replayed");
        let top = self.all.iter().position(|r| r.device == choice.device).unwrap_or(0);
        let mut v = replay_json(self, &self.all[top], &self.all);
        v["device_choice"] = serde_json::to_value(&choice).expect("JSON");
        v["no_history"] = json!(self.no_history);
        let rules = self.rules();
        v["torch_version_note"] = json!(rules.version.note());
        v["rules"] = rules.to_json();
        v
    }
}

/// The state a truncated trace starts from (`null`: an empty allocator).
fn initial_state_json(r: &ReplaySummary) -> Value {
    match &r.initial {
        None => Value::Null,
        Some(s) => json!({
            "segments": s.segments.len(),
            "reserved_bytes": s.reserved_bytes(),
            "blocks": s.blocks.len(),
            "allocated_blocks": s.allocated_blocks(),
            "allocated_bytes": s.allocated_bytes(),
            "pending_free_blocks": s.pending_blocks(),
            "inferred_block_sizes": s.inferred_sizes,
            "restore_failures": r.outcome.restore_failures,
        }),
    }
}

/// One summary per device, in device order.
fn devices_json(all: &[ReplaySummary]) -> Value {
    let rank = allocsim_replay::run::worst_first(all);
    Value::from(
        all.iter()
            .enumerate()
            .map(|(i, r)| {
                let s = &r.outcome.stats;
                json!({
                    "device": r.device,
                    "rank": rank.iter().position(|&k| k == i),
                    "requests": r.requests,
                    "ooms": r.outcome.ooms.len(),
                    "first_oom": r.outcome.first_oom(),
                    "peak_reserved": r.outcome.peak_reserved,
                    "peak_allocated": s.allocated_bytes.all().peak,
                    "reserved_at_end": s.reserved_bytes.all().current,
                    "num_device_alloc": s.num_device_alloc,
                    "num_device_free": s.num_device_free,
                    "initial_state": initial_state_json(r),
                })
            })
            .collect::<Vec<_>>(),
    )
}

/// The OOM message as PyTorch would print it, with `device_free` from the trace where it recorded
/// one (see `allocsim_replay::oom`); NVML's per-process sentence cannot be known and is left out.
fn message(r: &ReplaySummary, o: &Oom, device_free: u64) -> String {
    let mut info = o.info.clone();
    info.device_free = device_free;
    oom_message(&info, r.device as i32, "")
}

fn oom_json(r: &ReplaySummary, o: &Oom, &(ref req, device_free): &(Request, u64)) -> Value {
    json!({
        "request": o.request,
        "size": o.info.rounded_size,
        "orig_size": o.info.orig_size,
        "alloc_size": o.info.alloc_size,
        "stream": o.info.stream,
        "pool": if o.info.is_small { "small" } else { "large" },
        "recorded_oom": req.recorded_oom,
        "trace_index": req.trace_index,
        "allocated_bytes": o.info.allocated_bytes,
        "reserved_bytes": o.info.reserved_bytes,
        "message": message(r, o, device_free),
    })
}

/// Fragmentation figures of a replay (definitions in `allocsim_report::frag`).
fn fragmentation_json(o: &allocsim_replay::ReplayOutcome) -> Value {
    let s = &o.stats;
    let end = allocsim_report::frag::breakdown(&o.allocator);
    json!({
        "utilization": s.active_bytes.all().peak as f64 / (s.reserved_bytes.all().peak.max(1) as f64),
        "peak_reserved_minus_peak_allocated": s.reserved_bytes.all().peak - s.allocated_bytes.all().peak,
        "at_end": end,
    })
}
/// `replay --json`: the device `r` at the top level, every device in `devices`.
fn replay_json(args: &ReplayAnswer, r: &ReplaySummary, all: &[ReplaySummary]) -> Value {
    let o = &r.outcome;
    let placements: Vec<Value> = r
        .placements
        .iter()
        .map(|(name, p)| json!({"name": name, "first_oom": p.first_oom(), "peak_reserved": p.peak_reserved, "ooms": p.ooms.len()}))
        .collect();
    let mut out = json!({
        "trace": args.name.clone(),
        "device": r.device,
        "config": r.options.config.source,
        "capacity": r.options.capacity,
        "requests": r.requests,
        "stats": o.stats.to_memory_stats(),
        "segment_events": o.segment_events,
        "ooms": o.ooms.iter().zip(&r.oom_requests).map(|(x, q)| oom_json(r, x, q)).collect::<Vec<_>>(),
        "first_oom": o.first_oom(),
        "empty_cache_calls": o.empty_cache_requests,
        "unknown_frees": r.unknown_frees,
        "initial_state": initial_state_json(r),
        "reconstruct_error": r.reconstruct_error,
        "torch_version": args.rules().version.to_string(),
        "devices": devices_json(all),
        "placements": if args.options.placements.is_some() { Value::from(placements) } else { Value::Null },
        "placement_independent": r.options.config.expandable_segments,
        "fragmentation": fragmentation_json(o),
        "budget": r.budget.as_ref().map(|b| b.to_json()),
        "budget_ends": r.budget_ends,
    });
    crate::input::add_not_reproduced_json(&mut out, r.not_reproduced.as_ref());
    out
}

/// `replay` as text: every device, worst first.
fn write_replay_text(out: &mut dyn Write, args: &ReplayAnswer, all: &[ReplaySummary]) -> std::io::Result<()> {
    if all.len() > 1 {
        writeln!(out, "{}: {} devices, each replayed on its own allocator; worst first (most OOMs, then highest peak reserved)", args.name, all.len())?;
    }
    write_rules(out, &args.rules())?;
    if let Some(note) = &args.no_history {
        writeln!(out, "note: {note}")?;
    }
    for &i in &allocsim_replay::run::worst_first(all) {
        write_device_text(out, args, &all[i])?;
    }
    Ok(())
}

fn write_device_text(out: &mut dyn Write, args: &ReplayAnswer, r: &ReplaySummary) -> std::io::Result<()> {
    let o = &r.outcome;
    let placement_independent = r.options.config.expandable_segments;
    let s = &o.stats;
    let conf = if r.options.config.source.is_empty() { "defaults".to_string() } else { r.options.config.source.clone() };
    writeln!(out, "{} (device {}): {} requests replayed under {conf}", args.name, r.device, r.requests)?;
    let mut said_unreproduced = false;
    match &r.budget {
        Some(b) if args.options.capacity.is_none() && (b.kind.is_some() || b.device_memory.source == allocsim_replay::budget::DeviceMemorySource::Inferred) => {
            for line in budget_lines(b) {
                writeln!(out, "  budget            {line}")?;
            }
            said_unreproduced = b.kind.is_some();
        }
        _ => {
            if let Some(c) = r.options.capacity {
                writeln!(out, "  allowed maximum   {} ({c} bytes)", format_size(c))?;
            }
        }
    }
    crate::input::write_not_reproduced(out, r.not_reproduced.as_ref(), said_unreproduced)?;
    if let [lo, hi] = r.budget_ends.as_slice() {
        let at = |e: &allocsim_replay::run::BudgetEnd| match e.first_oom {
            Some(q) => format!("{} OOMs from request {q}", e.ooms),
            None => format!("no OOM, peak reserved {}", format_size(e.peak_reserved)),
        };
        let same = (lo.first_oom, lo.ooms) == (hi.first_oom, hi.ooms) && (lo.first_oom, lo.ooms) == (o.first_oom(), o.ooms.len());
        writeln!(
            out,
            "  uncertainty       at the ends of the inferred allowed maximum: {} allowed → {}; {} allowed → {}{}",
            format_size(lo.capacity),
            at(lo),
            format_size(hi.capacity),
            at(hi),
            if same { " (the same OOMs as replayed)" } else { ": the answer depends on where in that interval the real maximum lies" }
        )?;
    }
    let peak_res = s.reserved_bytes.all().peak as u64;
    let peak_alloc = s.allocated_bytes.all().peak as u64;
    writeln!(
        out,
        "  peak reserved     {}   (peak allocated {}; {} reserved beyond it)",
        format_size(peak_res),
        format_size(peak_alloc),
        format_size(peak_res.saturating_sub(peak_alloc))
    )?;
    let expandable = o.allocator.segments().iter().filter(|g| g.is_expandable).count();
    if expandable > 0 {
        writeln!(
            out,
            "  at the end        {} reserved ({} mapped range{} of expandable segments{}), {} allocated",
            format_size(s.reserved_bytes.all().current as u64),
            expandable,
            if expandable == 1 { "" } else { "s" },
            match s.segment.all().current {
                0 => "; memory_stats()' `segment` counter counts cudaMalloc'd segments only and says 0".to_string(),
                n => format!(", and {n} cudaMalloc'd segments"),
            },
            format_size(s.allocated_bytes.all().current as u64)
        )?;
    } else {
        writeln!(
            out,
            "  at the end        {} reserved in {} segments, {} allocated",
            format_size(s.reserved_bytes.all().current as u64),
            s.segment.all().current,
            format_size(s.allocated_bytes.all().current as u64)
        )?;
    }
    writeln!(
        out,
        "  device calls      {} cudaMalloc/map, {} cudaFree/unmap; {} alloc retries, {} full synchronizations",
        s.num_device_alloc, s.num_device_free, s.num_alloc_retries, s.num_sync_all_streams
    )?;
    let end = allocsim_report::frag::breakdown(&o.allocator);
    writeln!(
        out,
        "  fragmentation     utilization {:.1}% (peak active ÷ peak reserved); at the end {} free, largest block {} ({:.0}% of the free), {} rounding inside live blocks",
        100.0 * s.active_bytes.all().peak as f64 / (peak_res.max(1) as f64),
        format_size(end.free),
        format_size(end.largest_free_block),
        if end.free > 0 { 100.0 * end.largest_free_block as f64 / end.free as f64 } else { 100.0 },
        format_size(end.rounding_waste)
    )?;
    let ec = &o.empty_cache_requests;
    if !ec.is_empty() {
        writeln!(out, "  empty_cache()     {} calls, inferred from the trace's releases", ec.len())?;
    }
    if let Some(init) = &r.initial
        && r.entries == 0
    {
        writeln!(
            out,
            "  final state       {} segments ({} reserved) holding {} live blocks ({} allocated, {} pending free); no trace to replay",
            init.segments.len(),
            format_size(init.reserved_bytes()),
            init.blocks.len(),
            format_size(init.allocated_bytes()),
            init.pending_blocks()
        )?;
    } else if let Some(init) = &r.initial {
        writeln!(
            out,
            "  mid-history       {}: the replay starts from the state reconstructed from the final segments, {} pre-existing blocks ({} allocated in {} blocks, {} pending free) in {} segments ({} reserved); counters count from the trace's start, peaks are the trace's",
            allocsim_replay::restore::why_mid_history(r.entries),
            init.blocks.len(),
            format_size(init.allocated_bytes()),
            init.allocated_blocks(),
            init.pending_blocks(),
            init.segments.len(),
            format_size(init.reserved_bytes())
        )?;
    }
    if let Some(e) = &r.reconstruct_error {
        writeln!(out, "  note              the state at the trace's start could not be reconstructed ({e}); the replay starts from an empty allocator")?;
    }
    if r.unknown_frees > 0 {
        writeln!(out, "  note              {} frees of blocks allocated before the trace began were ignored", r.unknown_frees)?;
    }
    match o.ooms.first().zip(r.oom_requests.first()) {
        None => writeln!(out, "  OOMs              none")?,
        Some((first, &(ref req, device_free))) => {
            writeln!(
                out,
                "  OOMs              {}; the first at request {} ({} on stream {}{}):",
                o.ooms.len(),
                first.request,
                format_size(req.size),
                req.stream,
                if req.recorded_oom { ", an OOM in the trace too" } else { "" }
            )?;
            writeln!(out, "    {}", message(r, first, device_free))?;
            let rest: Vec<String> = o.ooms.iter().skip(1).take(8).map(|x| x.request.to_string()).collect();
            if !rest.is_empty() {
                writeln!(out, "    later OOMs at requests {}{}", rest.join(", "), if o.ooms.len() > 9 { ", ..." } else { "" })?;
            }
        }
    }
    if !r.placements.is_empty() {
        let n = r.placements.len();
        let fits: Vec<u64> = r.placements.iter().filter(|(_, p)| p.first_oom().is_none()).map(|(_, p)| p.peak_reserved).collect();
        let n_oom = n - fits.len();
        let mut line = match (fits.iter().min(), fits.iter().max()) {
            (Some(lo), Some(hi)) if lo == hi => format!("peak reserved {} in every placement without OOM", format_size(*lo)),
            (Some(lo), Some(hi)) => format!(
                "peak reserved {}–{} depending on where the driver places segments ({} sampled placements; a sample, not a bound)",
                format_size(*lo),
                format_size(*hi),
                n
            ),
            _ => String::new(),
        };
        if n_oom > 0 {
            if !line.is_empty() {
                line.push_str("; ");
            }
            line.push_str(&format!("OOM in {n_oom} of {n} placements"));
        }
        writeln!(out, "  placements        {line}")?;
        if placement_independent {
            writeln!(out, "                    (expandable segments: the decisions do not depend on where segments are placed)")?;
        }
        for (name, p) in &r.placements {
            writeln!(
                out,
                "    {name:<11} peak reserved {:>11}   first OOM {}",
                format_size(p.peak_reserved),
                p.first_oom().map_or("none".to_string(), |x| format!("at request {x}"))
            )?;
        }
    }
    Ok(())
}

/// The lines every replay answer starts with: which release's rules, why, and how the recorded
/// settings were read where that is not plain.
fn write_rules(out: &mut dyn Write, rules: &Rules) -> io::Result<()> {
    writeln!(out, "rules: {}", rules.line())?;
    if let Some(note) = rules.version.note() {
        writeln!(out, "note: {note}")?;
    }
    if let Some(note) = &rules.settings_note {
        writeln!(out, "note: {note}")?;
    }
    Ok(())
}

/// `validate`'s options.
#[derive(Clone, Debug, Default)]
pub struct ValidateOptions {
    /// The allowed maximum the trace was recorded under (default: inferred from the trace).
    pub capacity: Option<u64>,
    /// The device's total memory (default: as the trace shows it, else an H200's).
    pub device_memory: Option<u64>,
    /// One device (default: every device with entries).
    pub device: Option<usize>,
    /// The PyTorch release whose rules apply (default: chosen from the snapshot).
    pub torch_version: Option<TorchVersion>,
}

/// `validate`: a replay under the trace's own settings against its recording, for every device
/// with entries (or the one asked for).
pub fn validate(t: Trace<'_>, o: &ValidateOptions) -> Result<ValidateAnswer, Error> {
    let spec = ReplaySpec { capacity: o.capacity, device_memory: o.device_memory, device: o.device, torch_version: o.torch_version, ..ReplaySpec::default() };
    if t.snapshot.device_traces.iter().all(|d| d.is_empty()) && t.snapshot.segments.is_empty() {
        // No entry and no final segment: no recorded fact to check a replay against. (The
        // device indices are still checked, as every command checks them.)
        allocsim_replay::devices::devices_named(t.snapshot)?;
        let rules = spec.rules(&t.snapshot.settings);
        return Ok(ValidateAnswer { name: t.name.to_owned(), devices: Vec::new(), rules, no_history: None });
    }
    let runs = match o.device {
        Some(_) => vec![allocsim_replay::run(t.snapshot, &spec)?],
        None => allocsim_replay::run::run_devices(t.snapshot, &spec)?,
    };
    // The device that matters first (most OOMs, then highest peak reserved), as `replay` lists them.
    let mut order: Vec<usize> = (0..runs.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(runs[i].outcome.ooms.len()), std::cmp::Reverse(runs[i].outcome.peak_reserved), runs[i].device));
    let devices = order
        .into_iter()
        .map(|i| DeviceValidation { device: runs[i].device, budget: runs[i].budget.clone(), validation: allocsim_replay::validate(&runs[i]) })
        .collect();
    let rules = spec.rules(&t.snapshot.settings);
    Ok(ValidateAnswer { name: t.name.to_owned(), devices, rules, no_history: t.snapshot.no_history_note() })
}

/// One device's validation.
pub struct DeviceValidation {
    pub device: usize,
    pub budget: allocsim_replay::Budget,
    pub validation: allocsim_replay::validate::Validation,
}

/// What `validate` found: every device validated, the one that matters first.
pub struct ValidateAnswer {
    pub name: String,
    pub devices: Vec<DeviceValidation>,
    /// Which release's rules, and why.
    pub rules: Rules,
    pub no_history: Option<String>,
}

/// `validate`'s exit status for a trace with nothing to validate (no entries, no final segments).
pub const NOTHING_TO_VALIDATE: i32 = 3;

impl ValidateAnswer {
    /// Every device exact (and at least one validated).
    pub fn exact(&self) -> bool {
        !self.nothing_to_validate() && self.devices.iter().all(|d| d.validation.exact)
    }

    /// Nothing was validated: the trace has no entries and no final segments, or no trace
    /// entries at all (a snapshot taken without memory history, or a list of segments). The
    /// replay of no requests starts from the state the final segments give and reproduces them by
    /// construction, which checks nothing; so it is not called exact. The final segments are still
    /// read for consistency (overlaps, sizes): a contradiction is reported.
    pub fn nothing_to_validate(&self) -> bool {
        self.devices.is_empty() || self.no_history.is_some()
    }
}

impl Answer for ValidateAnswer {
    fn write_text(&self, out: &mut dyn Write) -> io::Result<()> {
        if self.devices.len() > 1 {
            writeln!(out, "{}: {} devices with entries, each validated on its own allocator", self.name, self.devices.len())?;
        }
        write_rules(out, &self.rules)?;
        if self.devices.is_empty() {
            return writeln!(
                out,
                "{}: nothing to validate: the trace has no entries and no final segments (not exact; exit status {NOTHING_TO_VALIDATE})",
                self.name
            );
        }
        if let Some(note) = &self.no_history {
            writeln!(out, "note: {note}")?;
            for d in &self.devices {
                for f in &d.validation.findings {
                    writeln!(out, "{} (device {}): inconsistent final segments: {f}", self.name, d.device)?;
                }
            }
            return writeln!(
                out,
                "{}: nothing to validate: the snapshot has no trace entries, so there is no replay to check against a recording; its final segments were read (not exact; exit status {NOTHING_TO_VALIDATE})",
                self.name
            );
        }
        for d in &self.devices {
            let v = &d.validation;
            writeln!(out, "{} (device {}): replay under its own settings against the recording", self.name, d.device)?;
            for line in budget_lines(&d.budget) {
                writeln!(out, "  budget           {line}")?;
            }
            for (name, a) in
                [("segment events", &v.segment_events), ("OOMs", &v.ooms), ("alloc addresses", &v.alloc_addresses), ("final segments", &v.final_segments)]
            {
                // matched/recorded; the replay's own count where it made more or fewer.
                writeln!(
                    out,
                    "  {name:<16} {}/{} reproduced{}{}",
                    a.matched,
                    a.recorded,
                    if a.simulated != a.recorded { format!(" ({} simulated)", a.simulated) } else { String::new() },
                    a.first_divergence.as_ref().map(|d| format!("; first divergence: {d}")).unwrap_or_default()
                )?;
            }
            for f in &v.findings {
                writeln!(out, "  inconsistent     {f}")?;
            }
            if v.exact {
                writeln!(out, "  exact")?;
            } else if !v.findings.is_empty() {
                writeln!(out, "  NOT exact: the trace contradicts itself or its final segments")?;
            } else if v.settings_changed.is_empty() {
                writeln!(out, "  NOT exact")?;
            } else {
                writeln!(
                    out,
                    "  NOT exact: the settings likely changed during the run (a snapshot records only the last ones, and the replay runs under those throughout):"
                )?;
                for why in &v.settings_changed {
                    writeln!(out, "    - {why}")?;
                }
            }
        }
        Ok(())
    }
    /// The device that matters at the top level (as before several devices were validated),
    /// `exact` for all of them, and every device in `devices`.
    fn to_json(&self) -> Value {
        let one = |d: &DeviceValidation| {
            let mut json = serde_json::to_value(&d.validation).expect("JSON");
            json["device"] = json!(d.device);
            json["budget"] = d.budget.to_json();
            json
        };
        let Some(first) = self.devices.first() else {
            return json!({
                "trace": self.name,
                "exact": false,
                "nothing_to_validate": true,
                "torch_version": self.rules.version.to_string(),
                "rules": self.rules.to_json(),
                "devices": [],
            });
        };
        let mut json = one(first);
        json["exact"] = json!(self.exact());
        json["nothing_to_validate"] = json!(self.nothing_to_validate());
        json["exact_device"] = json!(self.exact() && first.validation.exact);
        json["torch_version"] = json!(self.rules.version.to_string());
        json["rules"] = self.rules.to_json();
        json["devices"] = Value::from(self.devices.iter().map(one).collect::<Vec<_>>());
        json
    }
    /// 0: exact; 1: something differs (or the trace contradicts itself, its final segments
    /// included); 3: nothing to validate.
    fn exit_code(&self) -> i32 {
        if self.devices.iter().any(|d| !d.validation.findings.is_empty()) {
            1
        } else if self.nothing_to_validate() {
            NOTHING_TO_VALIDATE
        } else if self.exact() {
            0
        } else {
            1
        }
    }
}
