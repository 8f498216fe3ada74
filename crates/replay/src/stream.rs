//! A replay in one pass over a stream of trace entries, in memory bounded by the live set.
//!
//! [`replay_stream`] answers the question [`crate::run::run`] answers (one device, or every device
//! with entries) without holding the trace: each entry is checked ([`crate::check`]), turned into
//! ops as it comes ([`ProgramBuilder`], the rules of [`crate::program`]), and the ops drive the
//! allocator through the same [`Stepper`] as an in-memory replay. What is kept is what is live:
//! the blocks of live requests (by ordinal), the addresses of live blocks (to name the request a
//! free refers to), pending cross-stream frees, and a lookahead of a few entries: the entry after
//! a free, a run of releases, and the ops up to the next malloc, which the `empty_cache()`
//! inference ([`Inference`]) tries on a clone of the allocator. When the config differs from the
//! trace's own settings, two allocators run in lock-step: one under the trace's own settings
//! (and allowed maximum) infers the `empty_cache()` calls, the other applies them, which is what
//! [`crate::run::run`] does in two passes.
//!
//! Where the entries are decoded as they are read ([`Decoding::InStream`]: a file), the reader
//! keeps the caller's thread and the replay runs in a second one, which takes the entries in
//! batches of [`BATCH`] (on two cores a pass then costs about the longer of the two rather than
//! their sum); entries already in memory ([`Decoding::Done`]) are replayed on the caller's thread.
//!
//! What a stream needs before its entries comes from a first pass (for a JSON Lines file,
//! `allocsim_trace::jsonl_stream::scan`): the recorded settings, the final segments (private
//! pools) and the segment events (the recorded run's addresses).
//!
//! Where one pass cannot give [`crate::run::run`]'s answer, [`replay_stream`] says so
//! ([`Streamed::Fallback`]) and the caller replays in memory:
//! * `--addresses-from` and `--placements` (other traces, several replays);
//! * a trace that starts mid-history ([`MidHistory`]: a free, release or unmap of something the
//!   trace did not allocate): its initial state is reconstructed backwards from the final
//!   segments ([`crate::restore`]), which takes the whole trace;
//! * final segments that the trace did not allocate ([`EmptyStart`]), for the same reason.
//!
//! Whether the trace has cross-stream frees at all is a property of the whole trace that decides
//! some frees (see [`ProgramBuilder`]); when a free was decided before the first cross-stream free
//! was seen, the stream is replayed once more knowing it.
//!
//! Not kept (so not in the result): each request's address and the per-op flags
//! ([`crate::replay::ReplayOutcome::addresses`], [`crate::replay::ReplayOutcome::empty_cache`]).
//! Kept, and growing with the trace rather than with the live set: the model's segment events,
//! OOMs and `empty_cache()` request numbers (the output), and the recorded segment events of the
//! first pass (the recorded run's addresses), all proportional to the segment events and OOMs, not
//! to the requests.

use std::collections::VecDeque;

use allocsim_model::allocator::EventKind;
use allocsim_model::{AllocatorConfig, SimDevice};
use allocsim_trace::hash::IntMap;
use allocsim_trace::{Action, RecordedSettings, Snapshot, SnapshotSegment, TraceEntry};

use crate::budget::RecordedEvent;
use crate::check::{LiveBlocks, TraceCheckError, check_entry, check_segment_devices, check_segments};
use crate::mid_history::MidHistory;
use crate::oom::{RecordedMemory, device_free_with};
use crate::program::{Built, Op, ProgramBuilder, Request};
use crate::replay::{Ahead, Inference, MapSlots, ReplayOptions, Stepper, recorded_device_calls, recorded_placement_from};
use crate::restore::EmptyStart;
use crate::run::{ReplaySpec, ReplaySummary, RunError, same_settings};

/// What a stream's replay needs before its entries.
#[derive(Clone, Copy, Debug)]
pub struct StreamInput<'a> {
    /// The settings the trace recorded.
    pub settings: &'a RecordedSettings,
    /// The number of devices the trace declares (`None`: one more than the highest device seen).
    pub devices: Option<usize>,
    /// The final segments, every device's.
    pub segments: &'a [SnapshotSegment],
    /// By device: its segment entries (`segment_alloc`, `segment_free`, `segment_map`,
    /// `segment_unmap`) in trace order.
    pub segment_entries: &'a [Vec<TraceEntry>],
}

/// The outcome of [`replay_stream`].
#[derive(Debug)]
pub enum Streamed {
    /// One summary per device replayed, in device order (as [`crate::run::run_devices`], or
    /// [`crate::run::run`] for one device).
    Done(Vec<ReplaySummary>),
    /// One pass cannot give the in-memory answer, for this reason: replay in memory.
    Fallback(String),
}

/// Why [`replay_stream`] failed: the question or the trace (as [`crate::run::run`] would say), or
/// reading the stream.
#[derive(Debug)]
pub enum StreamError<E> {
    Run(RunError),
    Read(E),
}

impl<E: std::fmt::Display> std::fmt::Display for StreamError<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StreamError::Run(e) => e.fmt(f),
            StreamError::Read(e) => e.fmt(f),
        }
    }
}

impl<E: std::fmt::Debug + std::fmt::Display> std::error::Error for StreamError<E> {}

/// Replays the entries `open()` streams, as `spec` asks, in one pass (two when the trace has
/// cross-stream frees that the first pass learned of too late; `open` is called once per pass).
/// The stream yields `(device, entry)` in trace order; a read error ends the replay with that
/// error, which comes before any error about the question or the trace (as when a trace is read
/// whole first).
pub fn replay_stream<I, E>(input: &StreamInput<'_>, spec: &ReplaySpec<'_>, open: impl FnMut() -> Result<I, E>) -> Result<Streamed, StreamError<E>>
where
    I: Iterator<Item = Result<(usize, TraceEntry), E>>,
{
    replay_stream_with(input, spec, open, Decoding::InStream)
}

/// Where the entries of a stream are decoded, which decides where its replay runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decoding {
    /// The iterator decodes (or decompresses) as it is advanced: the replay runs beside it, in a
    /// thread of its own, and takes the entries in batches.
    InStream,
    /// The iterator yields entries already decoded (in memory, or by another thread): the replay
    /// runs on the caller's thread.
    Done,
}

/// [`replay_stream`], with the replay run where `decoding` says.
pub fn replay_stream_with<I, E>(
    input: &StreamInput<'_>,
    spec: &ReplaySpec<'_>,
    mut open: impl FnMut() -> Result<I, E>,
    decoding: Decoding,
) -> Result<Streamed, StreamError<E>>
where
    I: Iterator<Item = Result<(usize, TraceEntry), E>>,
{
    if spec.addresses_from.is_some() {
        return Ok(Streamed::Fallback("--addresses-from takes another run's whole trace".into()));
    }
    if spec.placements.is_some() {
        return Ok(Streamed::Fallback("--placements replays the trace once per placement".into()));
    }
    let (own, config) = match spec.configs(input.settings) {
        Ok(c) => c,
        Err(e) => {
            // A whole-trace read reports a bad line before a bad setting.
            for item in open().map_err(StreamError::Read)? {
                item.map_err(StreamError::Read)?;
            }
            return Err(StreamError::Run(e));
        }
    };
    if let Err(e) = check_segment_devices(input.segments) {
        // A final segment on a device no machine has: the whole read says which.
        return Err(StreamError::Run(e.into()));
    }
    if let Some(why) = starts_with_segments(input, spec.device) {
        // Known from the first pass alone: no need to stream the entries before reading whole.
        return Ok(Streamed::Fallback(why));
    }
    let trace_capacity = spec.trace_capacity_for(&own, &config);
    // No --capacity: the trace's own (`crate::run::Prepared::limits`).
    let own_settings = same_settings(&config, &own) && spec.capacity.or(trace_capacity) == trace_capacity;
    let ctx = Ctx { input, speculating: false, spec, own, config, trace_capacity, own_settings, probe: None };
    let mut cross: Vec<Option<bool>> = Vec::new();
    for _ in 0..2 {
        let events = open().map_err(StreamError::Read)?;
        let done = match decoding {
            Decoding::InStream => pass_beside(&ctx, events, &cross)?,
            Decoding::Done => pass(&ctx, events, &cross)?,
        };
        match done {
            Pass::Done(mut v) => {
                v.iter_mut().for_each(|s| s.rules = Some(spec.rules(input.settings)));
                return Ok(Streamed::Done(v));
            }
            Pass::Fallback(why) => return Ok(Streamed::Fallback(why)),
            Pass::Again(known) => cross = known,
        }
    }
    Ok(Streamed::Fallback("the cross-stream frees could not be settled in two passes".into()))
}

/// What [`replay_speculating`] answered, and the segment events it learned, by device.
#[derive(Debug)]
pub struct Speculated {
    pub summaries: Vec<ReplaySummary>,
    pub segment_entries: Vec<Vec<TraceEntry>>,
    /// The settings it assumed in the end (those given, or expandable segments where pages were
    /// mapped).
    pub settings: RecordedSettings,
    /// Replayed under an allowed maximum it tried (the summaries' budget is that one, given):
    /// the value, and the flips of every comparison the replay made with it
    /// ([`CachingAllocator::limit_probe`]). Its answer is the in-memory replay's only with the
    /// budget [`crate::budget::speculated`] infers from the whole trace in its place.
    ///
    /// [`CachingAllocator::limit_probe`]: allocsim_model::CachingAllocator::limit_probe
    pub tried: Option<(u64, Vec<u64>)>,
    /// How many times the maximum tried changed to the one a replay beside it ran under (an
    /// `Alt`), rather than by a replay from the first entry.
    pub promoted: usize,
}

impl Speculated {
    /// The answer, once the caller has checked what the replay assumed against `snap` (the file
    /// read whole; see [`replay_speculating`]): the summaries, and where a maximum was tried, the
    /// budget [`crate::budget::speculated`] infers from the whole trace in place of the one
    /// tried. `None` where only the in-memory replay answers: the maximum tried is not the one
    /// inferred, or the question is under other settings and the maximum only known to lie in an
    /// interval (then the answer also replays both ends of it).
    pub fn answer(mut self, snap: &Snapshot, spec: &ReplaySpec<'_>) -> Option<Vec<ReplaySummary>> {
        self.summaries.iter_mut().for_each(|s| s.rules = Some(spec.rules(&snap.settings)));
        let Some((tried, checks)) = &self.tried else { return Some(self.summaries) };
        let [mut summary]: [ReplaySummary; 1] = self.summaries.try_into().ok()?;
        if snap.device_traces.iter().enumerate().any(|(d, t)| d != summary.device && !t.is_empty()) {
            return None;
        }
        let trace = snap.device_traces.get(summary.device)?;
        let (own, _) = spec.configs(&snap.settings).ok()?;
        let memory = summary.budget.as_ref()?.device_memory.clone();
        let budget = crate::budget::speculated(trace, &own, memory, *tried, checks, &summary.outcome)?;
        if !summary.own_settings && budget.allowed_is_interval() {
            return None;
        }
        summary.budget = Some(budget);
        Some(vec![summary])
    }
}

/// A one-pass replay that starts before a first pass has read the file: with the final segments
/// (torch writes them before the traces) and assumed settings (torch writes them after), the
/// segment events learned as the entries come (each recorded address reaches the simulated
/// device before the op that may take it). Its answer is [`replay_stream`]'s when what it
/// assumed holds, which the caller checks once the file is read: the settings and the final
/// segments are the file's, and the segment events are those returned. Itself it checks the
/// rest: no segment was placed past the addresses learned so far (a replay that never misses
/// places every segment as one knowing the whole list does), and the device's memory inferred
/// from every segment event is the one assumed. `None` where it cannot answer so: final
/// segments in private pools (their routing needs every `segment_alloc` first), a question one
/// pass cannot answer, a trace that needs a second pass, or a failed assumption (the reason).
///
/// A replay that leaves the recorded segment events once the trace has shown an OOM of an
/// allowed maximum (`set_per_process_memory_fraction`) on one device starts again from the first
/// entry (`events` gives back what it read, [`allocsim_trace::Rewind`]) under the maximum the
/// entries so far point to ([`crate::budget::Walker::capacity_to_try`]), and goes on if that
/// replay does not leave them ([`Speculated::tried`]). Under such a maximum, a copy of the
/// replay under the maximum on the other side of the first comparison that may flip runs beside
/// it, and takes its place when the entries come to point there (`Alt`,
/// [`Speculated::promoted`]).
///
/// `settings_assumed`: the settings were not read from the file (a gzip'd file holds them after
/// its entries). Then a replay that assumed settings without expandable segments and sees pages
/// mapped starts again assuming them; and where the settings assumed do not replay the trace,
/// the entries are read to their end and the replay starts again under the file's
/// ([`allocsim_trace::Rewind::settings_at_end`], [`Speculated::settings`]).
pub fn replay_speculating<I, E>(
    segments: &[SnapshotSegment],
    settings: &RecordedSettings,
    settings_assumed: bool,
    spec: &ReplaySpec<'_>,
    events: I,
) -> Result<Speculated, String>
where
    I: Iterator<Item = Result<(usize, TraceEntry), E>> + allocsim_trace::Rewind,
{
    if spec.addresses_from.is_some() || spec.placements.is_some() {
        return Err("the question takes more than one pass".into());
    }
    if segments.iter().any(|s| s.pool_id != (0, 0)) {
        return Err("final segments in private pools".into());
    }
    if check_segment_devices(segments).is_err() {
        return Err("a final segment on a device no machine has".into());
    }
    let (mut settings, mut settings_assumed) = (settings.clone(), settings_assumed);
    let mut events = events;
    // A replay starts again (only on one device's trace) from the entries read so far
    // (`Rewind`), and the bounds they give the allowed maximum.
    let mut keep = true;
    let mut tried: Option<u64> = None;
    let mut walker: Option<crate::budget::Walker> = None;
    let mut promoted = 0;
    // The attempt since which the settings are the file's (learned after its entries).
    let mut learned_at = 0;
    'attempts: for attempt in 0.. {
        let (own, config) = spec.configs(&settings).map_err(|e| e.to_string())?;
        let input = StreamInput { settings: &settings, devices: None, segments, segment_entries: &[] };
        let trace_capacity = spec.trace_capacity_for(&own, &config);
        // (Under a maximum tried, the question is the trace's own unless it asks for another.)
        let capacity = tried.or(trace_capacity);
        let own_settings = same_settings(&config, &own) && spec.capacity.or(capacity) == capacity;
        let mut probe: Option<allocsim_model::allocator::LimitProbe> = tried.map(|_| Default::default());
        let ctx = Ctx {
            input: &input,
            speculating: true,
            spec,
            own: own.clone(),
            config: config.clone(),
            trace_capacity: capacity,
            own_settings,
            probe: probe.clone(),
        };
        let mut r = Replayer::new(&ctx, &[]);
        // The entries read so far first (when it starts again), then the rest.
        let stopped = match events.read_so_far() {
            Some(mut again) => again.any(|(_, e)| !r.push(0, e)),
            None => return Err("the entries read were not kept".into()),
        };
        // Why this replay stopped, and the maximum to try next.
        let mut left: Option<(String, Option<u64>)> = stopped.then(|| (r.fallback.take().unwrap_or_default(), None));
        if left.is_none() {
            for item in events.by_ref() {
                let (d, e) = item.map_err(read_error)?;
                keep &= d == 0;
                if let Some(w) = walker.as_mut().filter(|_| keep) {
                    w.push(&e);
                    if tried.is_some() && (e.action.is_segment_event() || e.action == Action::Oom) {
                        r.set_alt_bounds(w.bounds());
                    }
                }
                let pushed = r.push(d, e);
                // An OOM that excludes the maximum tried (the replay would leave the recorded
                // segment events later, or make other decisions than the one the whole trace
                // points to), or a replay that left them where the entries now point elsewhere.
                let moved = match (tried, &walker) {
                    (Some(t), Some(w)) if !pushed || e.action == Action::Oom => w.capacity_to_try().filter(|&n| n != t),
                    _ => None,
                };
                if let Some(next) = moved
                    && let Some(p) = r.promote(next)
                {
                    // The replay under it ran beside: it goes on.
                    (tried, probe) = (Some(next), Some(p));
                    promoted += 1;
                    continue;
                }
                if !pushed {
                    left = Some((r.fallback.take().unwrap_or_default(), None));
                    break;
                }
                if let Some(next) = moved {
                    left = Some(("the maximum tried is not the one the trace points to".into(), Some(next)));
                    break;
                }
            }
        }
        if left.is_none()
            && let (Some(t), Some(w)) = (tried, &walker)
            && let Some(next) = w.capacity_to_try().filter(|&n| n != t)
            && let Some(p) = r.promote(next)
        {
            // (The entries after the last OOM moved the maximum they point to.)
            (tried, probe) = (Some(next), Some(p));
            promoted += 1;
        }
        let Some((why, mut next)) = left else {
            if settings_assumed
                && let Some(end) = events.settings_at_end().filter(|&s| *s != settings).cloned()
                && events.read_so_far().is_some()
            {
                // Replayed to the end under settings other than the file's: again under its.
                (settings, settings_assumed, tried, walker, learned_at) = (end, false, None, None, attempt + 1);
                continue;
            }
            let checks = probe.map(|p| std::mem::take(&mut *p.lock().expect("limit probe")));
            return speculated::<E>(r, settings.clone(), tried.zip(checks), promoted);
        };
        let Some(device_memory) = r.streams.first().and_then(Option::as_ref).map(|s| s.device_memory) else { return Err(why) };
        if !keep || r.streams.len() != 1 {
            return Err(why);
        }
        drop(r);
        // The maximum to try next, or why there is none.
        let verdict: Result<u64, String> = 'verdict: {
            if attempt - learned_at >= MAX_TRIED {
                break 'verdict Err(why);
            }
            let expandable = RecordedSettings::torch_expandable();
            let maps = match events.read_so_far() {
                Some(mut read) => read.find(|(_, e)| e.action.is_segment_event()).is_some_and(|(_, e)| e.action == Action::SegmentMap),
                None => return Err(why),
            };
            if settings_assumed && tried.is_none() && settings != expandable && maps {
                // Pages mapped where segments were assumed (a gzip'd file, whose settings come last):
                // expandable segments, most likely set as their documentation spells them.
                settings = expandable;
                continue 'attempts;
            }
            if trace_capacity.is_some() {
                break 'verdict Err(why);
            }
            // Under a maximum tried, a replay may start again later in the trace.
            events.keep_all();
            let w = walker.get_or_insert_with(|| {
                let mut w = crate::budget::Walker::new(&own, device_memory);
                if let Some(read) = events.read_so_far() {
                    read.for_each(|(_, e)| w.push(&e));
                }
                w
            });
            next = next.or_else(|| w.capacity_to_try());
            if next.is_none() && tried.is_none() {
                // Left before any OOM of an allowed maximum (its garbage collection, or the releases
                // of a retry): read on to the first one, and try the maximum it points to; unless
                // the trace starts mid-history (then no maximum makes it replay from empty).
                let mid_history = || if why.contains("mid-history") { why.clone() } else { format!("{why}: the trace starts mid-history") };
                let mut start = crate::mid_history::PreExisting::default();
                if events.read_so_far().is_none_or(|mut read| read.any(|(_, e)| start.push(&e))) {
                    return Err(mid_history());
                }
                for item in events.by_ref() {
                    let (dev, e) = item.map_err(read_error)?;
                    if dev != 0 {
                        return Err(why);
                    }
                    if start.push(&e) {
                        return Err(mid_history());
                    }
                    w.push(&e);
                    if e.action == Action::Oom {
                        next = w.capacity_to_try();
                        if next.is_some() {
                            break;
                        }
                    }
                }
            }
            next.filter(|&n| Some(n) != tried).ok_or(why)
        };
        match verdict {
            Ok(n) => tried = Some(n),
            Err(why) => {
                // Settings other than those assumed may explain why the replay left (a gzip'd
                // file, whose settings come after its entries): read to the end, and start
                // again under the file's.
                let learned = if settings_assumed { settings_after_the_end(&mut events, &settings)? } else { None };
                let Some(end) = learned else { return Err(why) };
                (settings, settings_assumed, tried, walker, learned_at) = (end, false, None, None, attempt + 1);
            }
        }
    }
    unreachable!("the loop returns")
}

/// Reads `events` to their end, keeping every entry, and gives the settings the file holds
/// after them where they are not `assumed` (`None` also where the entries read were not all kept:
/// no replay can start again).
fn settings_after_the_end<I, E>(events: &mut I, assumed: &RecordedSettings) -> Result<Option<RecordedSettings>, String>
where
    I: Iterator<Item = Result<(usize, TraceEntry), E>> + allocsim_trace::Rewind,
{
    events.keep_all();
    if events.read_so_far().is_none() {
        return Ok(None);
    }
    for item in events.by_ref() {
        item.map_err(read_error)?;
    }
    Ok(events.settings_at_end().filter(|&s| s != assumed).cloned())
}

/// How many allowed maxima [`replay_speculating`] tries, one after another.
const MAX_TRIED: usize = 6;

/// The end of [`replay_speculating`]'s replay, which assumed `settings`.
fn speculated<E>(r: Replayer<'_, '_>, settings: RecordedSettings, tried: Option<(u64, Vec<u64>)>, promoted: usize) -> Result<Speculated, String> {
    let learned = r.streams.iter().map(|s| s.as_ref().and_then(|s| s.speculation.as_ref()).map_or(Vec::new(), |sp| sp.seen.clone())).collect();
    match r.finish::<E>() {
        Ok(Pass::Done(summaries)) => Ok(Speculated { summaries, segment_entries: learned, settings, tried, promoted }),
        Ok(Pass::Fallback(why)) => Err(why),
        Ok(Pass::Again(_)) => Err("a second pass is needed (cross-stream frees learned late)".into()),
        Err(StreamError::Run(e)) => Err(e.to_string()),
        Err(StreamError::Read(e)) => Err(read_error(e)),
    }
}

/// What a read error is in [`replay_speculating`]'s reasons for not answering (the decoders
/// that read the file whole then name it).
fn read_error<E>(_: E) -> String {
    "a read error".to_string()
}

/// A device whose final segments hold segments or pages its segment events did not allocate
/// ([`EmptyStart`]): its trace may start mid-history, and only the whole read reconstructs the
/// state it starts from. Decided from the first pass's segment events alone, so real snapshots
/// (history is usually turned on after the first CUDA allocation) do not stream twice.
fn starts_with_segments(input: &StreamInput<'_>, only: Option<usize>) -> Option<String> {
    let devices = input.segment_entries.len().max(input.segments.iter().map(|s| s.device.max(0) as usize + 1).max().unwrap_or(0));
    (0..devices).filter(|&d| only.is_none_or(|o| o == d)).find_map(|d| {
        let segments: Vec<SnapshotSegment> = input.segments.iter().filter(|s| s.device == d as i64).cloned().collect();
        let mut start = EmptyStart::new(&segments);
        for e in input.segment_entries.get(d).map_or(&[][..], |v| v.as_slice()) {
            start.push(e);
        }
        (!start.finish()).then(|| format!("device {d}'s final segments hold segments or pages its trace did not allocate: the trace may start mid-history"))
    })
}

struct Ctx<'a> {
    input: &'a StreamInput<'a>,
    /// [`replay_speculating`]: the segment events are learned as the entries come.
    speculating: bool,
    spec: &'a ReplaySpec<'a>,
    own: AllocatorConfig,
    config: AllocatorConfig,
    trace_capacity: Option<u64>,
    own_settings: bool,
    /// Set on the own replay's allocator ([`replay_speculating`] under a maximum it tries).
    probe: Option<allocsim_model::allocator::LimitProbe>,
}

enum Pass {
    Done(Vec<ReplaySummary>),
    Fallback(String),
    /// Replay again, knowing by device whether the trace has cross-stream frees.
    Again(Vec<Option<bool>>),
}

/// Entries handed to the replay thread at a time.
const BATCH: usize = 4096;

/// One pass on the caller's thread.
fn pass<I, E>(ctx: &Ctx<'_>, events: I, cross: &[Option<bool>]) -> Result<Pass, StreamError<E>>
where
    I: Iterator<Item = Result<(usize, TraceEntry), E>>,
{
    let mut r = Replayer::new(ctx, cross);
    for item in events {
        let (d, e) = item.map_err(StreamError::Read)?;
        if !r.push(d, e) {
            break;
        }
    }
    if let Some(why) = r.fallback {
        return Ok(Pass::Fallback(why));
    }
    r.finish()
}

/// One pass: the caller's thread reads the stream (decoding, decompressing) and hands the entries
/// in batches to a second thread, which replays them as they come; the answer is the one
/// [`pass`] gives, entry for entry (the replay thread takes the entries in stream order, and a
/// read error is reported only where the replay had not already stopped before it).
fn pass_beside<I, E>(ctx: &Ctx<'_>, events: I, cross: &[Option<bool>]) -> Result<Pass, StreamError<E>>
where
    I: Iterator<Item = Result<(usize, TraceEntry), E>>,
{
    std::thread::scope(|scope| {
        let (to_replay, batches) = std::sync::mpsc::sync_channel::<Vec<(usize, TraceEntry)>>(4);
        let (give_back, returned) = std::sync::mpsc::channel::<Vec<(usize, TraceEntry)>>();
        let replay = scope.spawn(move || {
            let mut r = Replayer::new(ctx, cross);
            for mut batch in batches {
                let stopped = batch.drain(..).any(|(d, e)| !r.push(d, e));
                if stopped {
                    // Dropping the receiver tells the reader to stop.
                    break;
                }
                // The reader may be gone already: then the batch is simply dropped.
                let _ = give_back.send(batch);
            }
            r
        });
        let mut batch = Vec::with_capacity(BATCH);
        let mut read_error = None;
        for item in events {
            match item {
                Ok(x) => batch.push(x),
                Err(e) => {
                    read_error = Some(e);
                    break;
                }
            }
            if batch.len() == BATCH {
                if to_replay.send(batch).is_err() {
                    // The replay stopped: it falls back to the in-memory replay.
                    batch = Vec::new();
                    break;
                }
                batch = returned.try_recv().unwrap_or_else(|_| Vec::with_capacity(BATCH));
            }
        }
        if !batch.is_empty() {
            let _ = to_replay.send(batch);
        }
        drop(to_replay);
        let r = match replay.join() {
            Ok(r) => r,
            Err(panic) => std::panic::resume_unwind(panic),
        };
        if let Some(why) = r.fallback {
            return Ok(Pass::Fallback(why));
        }
        if let Some(e) = read_error {
            return Err(StreamError::Read(e));
        }
        r.finish()
    })
}

/// The replay side of [`pass`]: one [`DeviceStream`] per device the stream names.
struct Replayer<'c, 'a> {
    ctx: &'c Ctx<'a>,
    cross: &'c [Option<bool>],
    streams: Vec<Option<DeviceStream<'a>>>,
    highest: Option<usize>,
    /// Why the replay stopped: only the in-memory replay gives the answer.
    fallback: Option<String>,
}

impl<'c, 'a> Replayer<'c, 'a> {
    fn new(ctx: &'c Ctx<'a>, cross: &'c [Option<bool>]) -> Self {
        Replayer { ctx, cross, streams: Vec::new(), highest: None, fallback: None }
    }

    fn known(&self, d: usize) -> Option<bool> {
        self.cross.get(d).copied().flatten()
    }

    /// The next entry; `false`: the replay stopped (see `fallback`).
    fn push(&mut self, d: usize, e: TraceEntry) -> bool {
        self.highest = Some(self.highest.map_or(d, |h| h.max(d)));
        if self.ctx.spec.device.is_some_and(|w| w != d) {
            return true;
        }
        if self.streams.len() <= d {
            self.streams.resize_with(d + 1, || None);
        }
        let known = self.known(d);
        let ctx = self.ctx;
        let s = self.streams[d].get_or_insert_with(|| DeviceStream::new(ctx, d, known));
        match s.push(e) {
            Ok(()) => true,
            Err(why) => {
                self.fallback = Some(why);
                false
            }
        }
    }

    /// [`replay_speculating`] under a maximum tried: the bounds the entries so far give the
    /// allowed maximum, for the [`Alt`] of device 0's own replay. An alternative they exclude is
    /// dropped (and another may be forked).
    fn set_alt_bounds(&mut self, bounds: Option<(u64, u64)>) {
        if let Some(Some(s)) = self.streams.first_mut()
            && s.speculation.is_some()
            && s.target.is_none()
            && s.own.alloc.limit_probe.is_some()
        {
            s.alt_bounds = bounds;
            if s.alt.as_ref().is_some_and(|a| bounds.is_none_or(|(lo, hi)| a.capacity < lo || a.capacity > hi)) {
                s.alt = None;
            }
        }
    }

    /// Device 0's own replay becomes its [`Alt`] under `capacity`, when it has one (also after
    /// the own replay stopped, when it stopped for leaving the recorded segment events): the
    /// alternative's comparisons with the maximum.
    fn promote(&mut self, capacity: u64) -> Option<allocsim_model::allocator::LimitProbe> {
        let s = self.streams.first_mut()?.as_mut()?;
        if self.fallback.is_some() && s.diverged.is_none() {
            return None;
        }
        let probe = s.promote(capacity)?;
        self.fallback = None;
        Some(probe)
    }

    fn finish<E>(mut self) -> Result<Pass, StreamError<E>> {
        let ctx = self.ctx;
        if self.streams.iter().all(Option::is_none) {
            // Without entries only the final state can be analysed, which the whole read does.
            return Ok(Pass::Fallback("the trace has no entries".into()));
        }
        let count = ctx.input.devices.unwrap_or(self.highest.map_or(0, |h| h + 1));
        let run: Vec<usize> = match ctx.spec.device {
            Some(d) => vec![d],
            None => {
                let with_entries: Vec<usize> = (0..self.streams.len()).filter(|&d| self.streams[d].is_some()).collect();
                if with_entries.is_empty() { vec![crate::devices::device_with_most_segments(ctx.input.segments).unwrap_or(0)] } else { with_entries }
            }
        };
        let mut out = Vec::new();
        let mut again = false;
        let mut learned: Vec<Option<bool>> = vec![None; count.max(self.streams.len())];
        for d in run {
            if d >= count {
                return Err(StreamError::Run(RunError::NoDevice(d, count)));
            }
            let known = self.known(d);
            let s = self.streams.get_mut(d).and_then(Option::take).unwrap_or_else(|| DeviceStream::new(ctx, d, known));
            let (finished, seen) = s.finish().map_err(StreamError::Run)?;
            learned[d] = Some(seen);
            match finished {
                Finished::Done(summary) => out.push(*summary),
                Finished::Fallback(why) => return Ok(Pass::Fallback(why)),
                Finished::Again => again = true,
            }
        }
        Ok(if again { Pass::Again(learned) } else { Pass::Done(out) })
    }
}

/// Whether the segment events show a private pool's release: a small-pool segment (2 MiB)
/// released right before a larger one. The default pools never release in that order
/// (`empty_cache()` and an OOM's retry release the large pool first, a malloc's own releases only
/// large segments); a MemPool destructor's `emptyCache(id)` and a freeable pool's release do.
fn private_pool_signature(segment_entries: &[TraceEntry]) -> bool {
    segment_entries.windows(2).any(|w| {
        w[0].action == Action::SegmentFree
            && w[1].action == Action::SegmentFree
            && w[0].size == allocsim_model::constants::K_SMALL_BUFFER
            && w[1].size > allocsim_model::constants::K_SMALL_BUFFER
    })
}

/// An op waiting for the lookahead its decision needs.
struct Queued {
    op: Op,
    request: Option<Request>,
    /// See [`Built::entries`].
    entries: Vec<TraceEntry>,
}

impl From<Built<'_>> for Queued {
    fn from(b: Built<'_>) -> Queued {
        Queued { op: b.op, request: b.request, entries: b.entries.to_vec() }
    }
}

/// The queued ops from the front on.
struct QueueAhead<'a>(&'a VecDeque<Queued>);

impl Ahead for QueueAhead<'_> {
    fn op(&self, k: usize) -> Option<Op> {
        self.0.get(k).map(|q| q.op)
    }
    fn request(&self, k: usize) -> Request {
        self.0[k].request.expect("a queued malloc carries its request")
    }
    fn release_entries(&self, k: usize) -> &[TraceEntry] {
        &self.0[k].entries
    }
    fn device_calls_before(&self, k: usize) -> Vec<(EventKind, u64, u64)> {
        recorded_device_calls(&self.0[k].entries)
    }
}

/// Whether the queue holds what [`Inference::decide`] looks at for its front op: the ops up to
/// the next malloc, or to an op that ends the search.
fn lookahead_ready(queue: &VecDeque<Queued>) -> bool {
    for q in queue.iter().skip(1) {
        match q.op {
            Op::Complete(_) | Op::CompletePre(_) | Op::ReleaseRun { .. } => continue,
            _ => return true,
        }
    }
    false
}

enum Finished {
    Done(Box<ReplaySummary>),
    Fallback(String),
    Again,
}

/// What a speculating [`DeviceStream`] learns and assumed (see [`replay_speculating`]).
struct Speculating {
    seen: Vec<TraceEntry>,
    /// Recorded addresses were learned (else the devices' lists are the whole trace's: empty).
    learned: bool,
    addresses: crate::replay::RecordedAddresses,
    memory: crate::budget::DeviceMemory,
    segments: Vec<SnapshotSegment>,
    large_segment_size: u64,
}

/// One device's replay as its entries come.
struct DeviceStream<'a> {
    device: usize,
    device_memory: u64,
    /// `--device-memory` given: no OOM entry can change it.
    memory_given: bool,
    budget: crate::budget::Budget,
    own_settings: bool,
    options: ReplayOptions,
    /// Entries pushed.
    index: usize,
    /// The first entry out of bounds (then entries are only counted).
    entry_error: Option<TraceCheckError>,
    /// The blocks the trace allocated and has not freed (an allocation over one is an error).
    live: LiveBlocks,
    /// Final segments out of bounds (then entries are only checked).
    segments_error: Option<TraceCheckError>,
    /// Entries are only checked, not replayed: the final segments are out of bounds, or a segment
    /// entry of the first pass is (the stream will name it when it gets there).
    check_only: bool,
    /// The first pass's segment entries of this device, and how many the stream has matched.
    segment_entries: &'a [TraceEntry],
    segments_seen: usize,
    /// [`replay_speculating`]: the segment entries seen so far, the recorded addresses they
    /// give, and what the replay assumed (the device's memory, its final segments, the size of
    /// a large segment) to check at the end.
    speculation: Option<Box<Speculating>>,
    mid: MidHistory,
    empty_start: EmptyStart,
    recorded: RecordedMemory,
    /// The bytes the trace had reserved before each `oom` entry (by trace index).
    reserved_before_oom: IntMap<u32, u64>,
    /// The recorded segment events and OOMs, each at its request ordinal (as
    /// [`crate::budget::recorded_events`] gives them), for `Budget::reproduces`.
    recorded_events: Vec<RecordedEvent>,
    recorded_ooms: Vec<u32>,
    recorded_requests: u32,
    builder: ProgramBuilder,
    queue: VecDeque<Queued>,
    /// The op index of the queue's front.
    ops: usize,
    inference: Inference,
    /// Under the trace's own settings: infers the `empty_cache()` calls.
    own: Stepper<SimDevice, MapSlots>,
    /// Under the requested config, when it is not the own: applies them.
    target: Option<Stepper<SimDevice, MapSlots>>,
    /// The requests of the reported replay's OOMs.
    oom_requests: Vec<Request>,
    /// How many of the own replay's segment events were found to be the recorded ones, and the
    /// first that is not.
    compared: usize,
    diverged: Option<usize>,
    /// [`replay_speculating`] under a maximum tried: the bounds the entries so far give the
    /// allowed maximum, while a replay under another maximum may still be forked ([`Alt`]).
    alt_bounds: Option<(u64, u64)>,
    alt: Option<Box<Alt>>,
}

/// The own replay under another allowed maximum than the one [`replay_speculating`] tries, run
/// in lock-step with it from the first malloc whose comparison with the maximum goes otherwise
/// under the two (see [`DeviceStream::fork_alt`]): when the entries come to point to this one,
/// it takes the own replay's place ([`Replayer::promote`]) rather than a replay from the first
/// entry.
struct Alt {
    capacity: u64,
    stepper: Stepper<SimDevice, MapSlots>,
    inference: Inference,
    /// Its own comparisons, those of the own replay before the fork included.
    probe: allocsim_model::allocator::LimitProbe,
    oom_requests: Vec<Request>,
    compared: usize,
}

impl<'a> DeviceStream<'a> {
    fn new(ctx: &Ctx<'a>, device: usize, cross_stream: Option<bool>) -> DeviceStream<'a> {
        let segments: Vec<SnapshotSegment> = ctx.input.segments.iter().filter(|s| s.device == device as i64).cloned().collect();
        let mut segment_entries: &'a [TraceEntry] = ctx.input.segment_entries.get(device).map_or(&[], |v| v.as_slice());
        let segments_error = check_segments(device, &segments).err();
        // Out-of-bounds addresses must not reach the simulated device (the in-memory path checks
        // the whole trace first).
        let sane = segment_entries.iter().all(|e| check_entry(device, 0, e).is_ok());
        let check_only = segments_error.is_some() || !sane;
        if check_only {
            segment_entries = &[];
        }
        let memory = match ctx.spec.device_memory {
            Some(d) => crate::budget::DeviceMemory::given(d),
            None => crate::budget::infer_device_memory(segment_entries, &segments, ctx.own.large_segment_size),
        };
        let device_memory = memory.bytes;
        let speculation = ctx.speculating.then(|| {
            Box::new(Speculating {
                seen: Vec::new(),
                learned: false,
                addresses: crate::replay::RecordedAddresses::new(device_memory),
                memory: memory.clone(),
                segments: segments.clone(),
                large_segment_size: ctx.own.large_segment_size,
            })
        });
        // A stream replays under the budget given or none: one that needs a budget inferred is
        // replayed in memory (see `crate::budget::streamed_reproduces`).
        let budget = match ctx.trace_capacity {
            Some(c) => crate::budget::Budget::given(c, memory),
            None => crate::budget::Budget::none(memory),
        };
        let placement = recorded_placement_from(segment_entries, device_memory, None);
        let own_options =
            ReplayOptions { config: ctx.own.clone(), capacity: ctx.trace_capacity, device_memory, placement: placement.clone(), outside: Default::default() };
        let options = ReplayOptions {
            config: ctx.config.clone(),
            capacity: ctx.spec.capacity.or(ctx.trace_capacity),
            device_memory,
            placement: placement.clone(),
            outside: Default::default(),
        };
        let stepper = |o: &ReplayOptions| Stepper::new(o, SimDevice::new(device_memory, o.placement.clone()), MapSlots::default(), &[], None);
        let mut own = stepper(&own_options);
        own.alloc.limit_probe = ctx.probe.clone();
        let target = (!ctx.own_settings).then(|| stepper(&options));
        let segment_allocs = segment_entries.iter().filter(|e| e.action == Action::SegmentAlloc).map(|e| e.addr);
        DeviceStream {
            device,
            device_memory,
            memory_given: ctx.spec.device_memory.is_some(),
            budget,
            own_settings: ctx.own_settings,
            options,
            index: 0,
            entry_error: None,
            live: LiveBlocks::default(),
            segments_error,
            check_only,
            segment_entries,
            segments_seen: 0,
            speculation,
            mid: MidHistory::default(),
            empty_start: EmptyStart::new(&segments),
            recorded: RecordedMemory::default(),
            reserved_before_oom: IntMap::default(),
            recorded_events: Vec::new(),
            recorded_ooms: Vec::new(),
            recorded_requests: 0,
            builder: ProgramBuilder::new(&segments, segment_allocs, None, cross_stream),
            queue: VecDeque::new(),
            ops: 0,
            inference: Inference::default(),
            own,
            target,
            oom_requests: Vec::new(),
            compared: 0,
            diverged: None,
            alt_bounds: None,
            alt: None,
        }
    }

    /// The next entry; `Err`: replay in memory, for this reason.
    fn push(&mut self, e: TraceEntry) -> Result<(), String> {
        if self.entry_error.is_some() {
            return Ok(());
        }
        let index = self.index;
        self.index += 1;
        if let Err(err) = check_entry(self.device, index, &e).and_then(|()| self.live.push(self.device, index, &e)) {
            self.entry_error = Some(err);
            return Ok(());
        }
        if self.check_only {
            return Ok(());
        }
        if e.action.is_segment_event()
            && let Some(sp) = &mut self.speculation
        {
            // Learned as it comes: the recorded address goes to the simulated devices before
            // the op that may take it.
            sp.seen.push(e);
            let (segments, reservations): (&[(u64, u64)], &[u64]) = match sp.addresses.push(&e) {
                crate::replay::Recorded::Segment(a, size) => (&[(a, size)], &[]),
                crate::replay::Recorded::Reservation(b) => (&[], &[b]),
                crate::replay::Recorded::Nothing => (&[], &[]),
            };
            if !segments.is_empty() || !reservations.is_empty() {
                sp.learned = true;
                self.own.alloc.device.extend_recorded(segments, reservations);
                if let Some(t) = &mut self.target {
                    t.alloc.device.extend_recorded(segments, reservations);
                }
                if let Some(a) = &mut self.alt {
                    a.stepper.alloc.device.extend_recorded(segments, reservations);
                }
            }
        } else if e.action.is_segment_event() {
            if self.segment_entries.get(self.segments_seen) != Some(&e) {
                return Err(format!("device {}'s segment events differ from the first pass's (the file changed?)", self.device));
            }
            self.segments_seen += 1;
        }
        if self.mid.push(&e) {
            return Err(format!(
                "device {}'s trace starts mid-history (entry {index}: a {} at {:#x} it did not allocate)",
                self.device,
                e.action.as_str(),
                e.addr
            ));
        }
        self.empty_start.push(&e);
        match e.action {
            Action::Oom => {
                self.reserved_before_oom.insert(index as u32, self.recorded.reserved());
                self.recorded_ooms.push(self.recorded_requests);
                self.recorded_requests += 1;
            }
            Action::Alloc => self.recorded_requests += 1,
            a if a.is_segment_event() => self.recorded_events.push((self.recorded_requests, a, e.addr, e.size)),
            _ => {}
        }
        self.recorded.push(&e, self.device_memory);
        if !self.memory_given && self.recorded.least_device_memory() > self.device_memory {
            // The device memory read from the segment events, raised by this OOM
            // (`budget::infer_device_memory`): the whole trace is needed for it.
            return Err(format!(
                "device {}'s OOM entry {index} shows more device memory than assumed ({} reserved and free, {} assumed)",
                self.device,
                self.recorded.least_device_memory(),
                self.device_memory
            ));
        }
        let queue = &mut self.queue;
        self.builder.push(e, &mut |b| queue.push_back(b.into()));
        self.step(false);
        self.compare_segment_events()
    }

    /// Compares the own replay's new segment events with the recorded ones. `Err` where the
    /// answer is already known to come from the in-memory replay:
    /// * a speculating replay that leaves the recorded segment events (as a trace that starts
    ///   mid-history does, or one under other settings than those assumed) stops at once: its
    ///   answer would rarely be taken, and it would take the first pass's core;
    /// * otherwise, once the difference is one a memory budget may explain (see
    ///   [`crate::budget::budget_may_explain`]: a release where the recording does something
    ///   else, or a trace with OOM entries), which [`DeviceStream::finish`] would find at the end,
    ///   unless the budget is given or a second pass may replay differently (a free decided
    ///   before the trace's cross-stream frees were known).
    fn compare_segment_events(&mut self) -> Result<(), String> {
        let speculating = self.speculation.is_some();
        if !speculating && self.budget.kind.is_some() {
            return Ok(());
        }
        if let (Some(a), Some(sp)) = (&mut self.alt, &self.speculation) {
            // An alternative that leaves the recorded segment events is dropped.
            let simulated = a.stepper.segment_events();
            while a.compared < simulated.len() && sp.seen.get(a.compared).is_some_and(|r| crate::budget::same_segment_event(r, &simulated[a.compared])) {
                a.compared += 1;
            }
            if a.compared < simulated.len() && a.compared < sp.seen.len() {
                self.alt = None;
            }
        }
        let simulated = self.own.segment_events();
        if self.diverged.is_none() {
            let recorded = match &self.speculation {
                Some(sp) => sp.seen.as_slice(),
                None => self.segment_entries,
            };
            while self.compared < simulated.len() {
                match recorded.get(self.compared) {
                    Some(r) if crate::budget::same_segment_event(r, &simulated[self.compared]) => self.compared += 1,
                    // (What a speculating replay learns so far is not yet the whole list.)
                    None if speculating => break,
                    _ => {
                        self.diverged = Some(self.compared);
                        break;
                    }
                }
            }
        }
        let Some(i) = self.diverged else { return Ok(()) };
        if speculating {
            return Err(format!("device {}'s replay leaves its recorded segment events", self.device));
        }
        if crate::budget::budget_may_explain_at(simulated.get(i), !self.reserved_before_oom.is_empty()) && !self.builder.speculated() {
            return Err(self.needs_budget());
        }
        Ok(())
    }

    /// Before an op of the own replay under the maximum tried, with `r` the malloc whose
    /// comparisons it may make (its own, or the one the `empty_cache()` inference tries): when
    /// that malloc would miss the cache and its first comparison with the maximum
    /// (`total_allocated_memory + alloc_size > allowed`) flip at a value `v` inside the bounds
    /// the entries give, and no comparison so far flipped between the maximum tried and the one
    /// the entries would point to on the other side of `v` (the roundest there,
    /// [`crate::budget::pick_used`]), a copy of the own replay under that other maximum: every
    /// decision so far was the same under both.
    fn fork_alt(&mut self, r: &Request) {
        let alloc = &self.own.alloc;
        let (Some((lo, hi)), Some(tried)) = (self.alt_bounds, alloc.allowed_memory_maximum) else { return };
        if r.checkpoint || alloc.config.garbage_collection_threshold > 0.0 {
            // (Other comparisons come first: no copy.)
            return;
        }
        let v = alloc.fraction_check_flip(r.size);
        if v <= lo || v > hi || alloc.finds_cached_block(r.size, r.stream, r.route) {
            return;
        }
        let capacity = if v <= tried { crate::budget::pick_used(lo, v - 1) } else { crate::budget::pick_used(v, hi) };
        let Some(probe) = &alloc.limit_probe else { return };
        let checks = probe.lock().expect("limit probe").clone();
        let (a, b) = (capacity.min(tried), capacity.max(tried));
        if capacity == tried || checks.iter().any(|&c| a < c && c <= b) {
            return;
        }
        let mut stepper = self.own.under_maximum(capacity);
        let probe = std::sync::Arc::new(std::sync::Mutex::new(checks));
        stepper.alloc.limit_probe = Some(probe.clone());
        self.alt = Some(Box::new(Alt {
            capacity,
            stepper,
            inference: self.inference.clone(),
            probe,
            oom_requests: self.oom_requests.clone(),
            compared: self.compared,
        }));
    }

    /// The own replay becomes the alternative's, under `capacity` (see [`Alt`]): its comparisons
    /// with the maximum, or `None` where there is no such alternative.
    fn promote(&mut self, capacity: u64) -> Option<allocsim_model::allocator::LimitProbe> {
        let a = self.alt.take().filter(|a| a.capacity == capacity)?;
        let Alt { capacity, stepper, inference, probe, oom_requests, compared } = *a;
        self.diverged = None;
        self.own = stepper;
        self.inference = inference;
        self.oom_requests = oom_requests;
        self.compared = compared;
        self.options.capacity = Some(capacity);
        self.budget = crate::budget::Budget::given(capacity, self.budget.device_memory.clone());
        Some(probe)
    }

    fn needs_budget(&self) -> String {
        format!("device {}'s own replay needs the memory budget inferred from its whole trace", self.device)
    }

    /// Applies the queued ops whose decisions can be made (all of them when `done`).
    fn step(&mut self, done: bool) {
        while let Some(front) = self.queue.front() {
            let (op, request) = (front.op, front.request);
            let decided = matches!(op, Op::ReleaseRun { .. } | Op::Complete(_) | Op::CompletePre(_));
            if decided && !done && !lookahead_ready(&self.queue) {
                break;
            }
            let oi = self.ops;
            if self.alt.is_none() && self.alt_bounds.is_some() && !matches!(op, Op::Free { .. } | Op::FreePre { .. } | Op::ForcedRelease { .. }) {
                // The malloc whose comparisons this op may make: its own, or (a release run or a
                // completion) the next one's, which the `empty_cache()` inference tries.
                let next = self.queue.iter().find_map(|q| matches!(q.op, Op::Malloc(_)).then_some(q.request).flatten());
                if let Some(r) = next {
                    self.fork_alt(&r);
                }
            }
            let ahead = QueueAhead(&self.queue);
            if let Some(a) = &mut self.alt {
                let inference = &mut a.inference;
                if a.stepper.step(op, request.as_ref(), |alloc| inference.decide(alloc, oi, &ahead)).oom
                    && let Some(r) = request
                {
                    a.oom_requests.push(r);
                }
            }
            let inference = &mut self.inference;
            let own = self.own.step(op, request.as_ref(), |alloc| inference.decide(alloc, oi, &ahead));
            let oom = match &mut self.target {
                Some(t) => t.step(op, request.as_ref(), |_| own.flag).oom,
                None => own.oom,
            };
            if oom && let Some(r) = request {
                self.oom_requests.push(r);
            }
            self.queue.pop_front();
            self.ops += 1;
        }
    }

    /// The end of the stream: the summary, and whether the trace has cross-stream frees.
    fn finish(mut self) -> Result<(Finished, bool), RunError> {
        if let Some(e) = self.entry_error.take().or(self.segments_error.take()) {
            return Err(e.into());
        }
        if self.check_only {
            let why = format!("device {}'s segment events differ from the first pass's (the file changed?)", self.device);
            return Ok((Finished::Fallback(why), false));
        }
        let queue = &mut self.queue;
        self.builder.finish(&mut |b| queue.push_back(b.into()));
        self.step(true);
        let seen = self.builder.seen_cross_stream();
        let speculation = self.speculation.take();
        if let Some(sp) = &speculation {
            // What was assumed must be what the whole trace shows: no segment placed past the
            // addresses learned (unless none were: then the devices' lists were the whole
            // trace's, empty, all along), and the device's memory inferred from every segment
            // event.
            let misses = self.own.alloc.device.recorded_misses() + self.target.as_ref().map_or(0, |t| t.alloc.device.recorded_misses());
            let misses = if sp.learned { misses } else { 0 };
            // The replay depends on the device's memory in bytes alone; the summary also says
            // how it is known, which the whole trace tells (expandable segments' reservations).
            let memory = match sp.memory.source {
                crate::budget::DeviceMemorySource::Given => Some(sp.memory.clone()),
                _ => Some(crate::budget::infer_device_memory(&sp.seen, &sp.segments, sp.large_segment_size)).filter(|m| m.bytes == sp.memory.bytes),
            };
            let Some(memory) = memory.filter(|_| misses == 0) else {
                return Ok((Finished::Fallback("the speculation did not hold".into()), seen));
            };
            self.budget.device_memory = memory;
            // The placement the summary reports: the whole recorded list, as a first pass gives it.
            self.options.placement = recorded_placement_from(&sp.seen, self.device_memory, None);
        }
        if !self.memory_given {
            // What the OOM entries add to the segment events' reading (`budget::infer_device_memory`).
            let memory = crate::budget::raised_by_ooms(self.budget.device_memory.clone(), self.recorded.least_device_memory());
            if memory.bytes != self.device_memory {
                let why =
                    format!("device {}'s OOM entries narrow its device memory to {} bytes, not the {} assumed", self.device, memory.bytes, self.device_memory);
                return Ok((Finished::Fallback(why), seen));
            }
            self.budget.device_memory = memory;
        }
        let segment_entries: &[TraceEntry] = match &speculation {
            Some(sp) => &sp.seen,
            None => self.segment_entries,
        };
        if speculation.is_none() && self.segments_seen != self.segment_entries.len() {
            let why = format!("device {}'s segment events differ from the first pass's (the file changed?)", self.device);
            return Ok((Finished::Fallback(why), seen));
        }
        if !self.empty_start.finish() {
            let why = format!("device {}'s final segments hold segments or pages its trace did not allocate: the trace may start mid-history", self.device);
            return Ok((Finished::Fallback(why), seen));
        }
        if self.builder.speculated() && seen {
            return Ok((Finished::Again, seen));
        }
        if self.budget.kind.is_none()
            && !segment_entries.is_empty()
            && crate::budget::budget_may_explain(segment_entries, self.own.segment_events(), !self.reserved_before_oom.is_empty())
        {
            // The trace's own replay needs its memory budget inferred, which takes the whole trace.
            return Ok((Finished::Fallback(self.needs_budget()), seen));
        }
        if self.own_settings && private_pool_signature(segment_entries) && crate::budget::first_difference(segment_entries, self.own.segment_events()).is_some()
        {
            // The in-memory replay then searches for private pools (gone before the snapshot, so
            // not in the final segments), which takes the whole trace.
            let why = format!("device {}'s own replay differs from its recorded segment events: private pools are inferred from the whole trace", self.device);
            return Ok((Finished::Fallback(why), seen));
        }
        self.own.complete_held();
        self.budget.reproduces = crate::budget::made_recorded(&self.recorded_events, &self.recorded_ooms, self.own.segment_events(), self.own.ooms());
        if self.budget.recording_not_reproduced(|| !self.recorded_events.is_empty() || !self.recorded_ooms.is_empty()) {
            // The answer must say what the trace shows of other settings in force for part of
            // the run (`Replayed::settings_change_evidence`), which reads the whole trace.
            let why = format!("device {}'s own replay does not make its recorded segment events and OOMs", self.device);
            return Ok((Finished::Fallback(why), seen));
        }
        let mut reported = match self.target {
            Some(t) => t,
            None => self.own,
        };
        reported.complete_held();
        let outcome = reported.finish(Vec::new(), Vec::new());
        let (recorded, reserved) = (&self.recorded, &self.reserved_before_oom);
        let oom_requests = outcome
            .ooms
            .iter()
            .zip(&self.oom_requests)
            .map(|(o, r)| {
                let free = device_free_with(
                    r,
                    &o.info,
                    self.own_settings,
                    self.device_memory,
                    false,
                    || reserved.get(&r.trace_index).copied().unwrap_or(0),
                    || recorded.outside(),
                );
                (*r, free)
            })
            .collect();
        let summary = ReplaySummary {
            device: self.device,
            options: self.options,
            own_settings: self.own_settings,
            requests: self.builder.requests() as usize,
            entries: self.index,
            outcome,
            oom_requests,
            unknown_frees: self.builder.unknown_frees,
            initial: None,
            reconstruct_error: None,
            placements: Vec::new(),
            streamed: true,
            budget: Some(self.budget),
            budget_ends: Vec::new(),
            rules: None,
            not_reproduced: None,
        };
        Ok((Finished::Done(Box::new(summary)), seen))
    }
}
