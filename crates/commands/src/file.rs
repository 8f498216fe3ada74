//! Commands on a trace file: reading it, and `replay`'s choice of how.
//!
//! `replay` of a JSON Lines trace or a snapshot pickle first tries the one-pass replay
//! (`allocsim_replay::stream`: a first pass for the final segments, segment events and settings,
//! then the entries as they are decoded, in memory bounded by the live set). Where one pass cannot
//! give the answer (a trace that starts mid-history, final segments the trace did not allocate,
//! `--placements`, `--addresses-from`, a shape the stream does not read), the trace is read into
//! memory and replayed there: a pickle of the shape torch writes by the stream's machine
//! ([`allocsim_trace::pickle_stream::PickleFile::compact`]: one pass, entries of 48 bytes, each
//! stack converted once), anything else by the general decoders. `in_memory` reads it with the
//! general decoders alone ([`allocsim_trace::read_trace_whole`]), the reference the other paths
//! are tested against. Every path gives the same answer.
//!
//! A pickle's first pass keeps the whole snapshot when it holds at most
//! [`COMPACT_FIRST_ENTRIES`] entries (48 MiB of them;
//! [`allocsim_trace::pickle_stream::PickleFile::first_pass`]), so a small file is read once: its
//! entries are replayed from memory, in one pass when that gives the answer, else in memory
//! (as a trace that starts mid-history needs). While that first pass reads, a second thread
//! already replays the entries it hands over, with the settings read from the file's end where
//! it is plain, else assumed (torch writes them after the traces), learning the segment events
//! as they come
//! ([`allocsim_replay::stream::replay_speculating`]); when the file turns out to hold what that
//! replay assumed, its answer is taken and the replay from memory is not needed. (Where it
//! assumed the settings, a gzip'd file's, and they do not replay the trace, it starts again
//! under those the first pass finds after the entries.) A larger
//! file's first pass is a scan, and its entries are read again, streamed or compactly.
//!
//! Why a trace that starts mid-history is not streamed: its replay starts from the state
//! `allocsim_replay::restore::reconstruct` undoes backwards from the final segments through the
//! whole trace, and that state is then settled (`allocsim_replay::settle`: blocks freed in the
//! trace but allocated before it are grown and the trace replayed again, up to 32 times), its
//! budget inferred (`allocsim_replay::budget`, more replays) and its private pools searched
//! (`allocsim_replay::pools`): each of these needs the whole trace, several times. The final
//! segments do come first in the file, but the blocks live at the start are those the trace frees
//! without having allocated them, which are known only at its end.

use std::path::Path;

use allocsim_replay::ReplaySummary;
use allocsim_replay::stream::{Decoding, Speculated, StreamError, StreamInput, Streamed, replay_speculating, replay_stream, replay_stream_with};
use allocsim_trace::jsonl_stream::JsonlFile;
use allocsim_trace::pickle_stream::{FirstPass, PickleFile, PickleScan};
use allocsim_trace::{RecordedSettings, Snapshot, TraceEntry, TraceError};

use crate::Error;
use crate::error::trace_error;
use crate::replay::{ReplayAnswer, ReplayOptions};

/// A trace file read into memory: by [`allocsim_trace::read_trace`] (a torch-shaped pickle by
/// the stream's machine), or with `whole` by the general decoders alone. Its error names it.
pub fn read_trace(path: &Path, whole: bool) -> Result<Snapshot, Error> {
    let r = if whole { allocsim_trace::read_trace_whole(path) } else { allocsim_trace::read_trace(path) };
    r.map_err(|e| trace_error(&path.display().to_string(), e))
}

/// At most this many entries, a pickle's first pass keeps them all (see the module
/// documentation).
pub const COMPACT_FIRST_ENTRIES: u64 = 1 << 20;

/// Where [`replay_file`] reads its traces, and how.
#[derive(Clone, Copy, Debug)]
pub struct ReplayFile<'a> {
    pub path: &'a Path,
    /// Another recorded run of the same requests, whose segment addresses the replay takes.
    pub addresses_from: Option<&'a Path>,
    /// Read the traces whole with the general decoders before replaying (see the module
    /// documentation).
    pub in_memory: bool,
    /// A pickle's first pass keeps its entries when there are at most this many
    /// ([`COMPACT_FIRST_ENTRIES`]; 0: never, every pickle is scanned first).
    pub compact_first: u64,
}

impl<'a> ReplayFile<'a> {
    /// `path`, replayed the default way.
    pub fn new(path: &'a Path) -> ReplayFile<'a> {
        ReplayFile { path, addresses_from: None, in_memory: false, compact_first: COMPACT_FIRST_ENTRIES }
    }
}

/// Above this size on disk, a trace that is replayed in memory after all says why (`note`).
const NOTE_FALLBACK_ABOVE: u64 = 1 << 30;

/// `replay` of a trace file (see the module documentation): every device with entries, or
/// `options.device`. `note` hears what the command line prints as notes: why a file over 1 GiB
/// is replayed in memory rather than streamed.
pub fn replay_file(f: ReplayFile<'_>, options: &ReplayOptions, note: &mut dyn FnMut(&str)) -> Result<ReplayAnswer, Error> {
    let name = f.path.display().to_string();
    let mut read = None;
    if !f.in_memory && f.addresses_from.is_none() && options.placements.is_none() {
        let streamed = if let Some(file) = JsonlFile::open(f.path).map_err(|e| trace_error(&name, e))? {
            stream_jsonl(&file, options, note)?
        } else if let Some(file) = PickleFile::open(f.path).map_err(|e| trace_error(&name, e))? {
            let (first, speculated) = first_pass_replaying(&file, f.compact_first, options);
            match first {
                Ok(FirstPass::Whole(snap)) => {
                    let holds = speculated.as_ref().is_some_and(|s| s.holds_for(&snap));
                    debug_speculation(&format!("holds: {holds}"), true);
                    // Retries told by stacks, which a stream of entries does not keep: in memory.
                    let retries = allocsim_replay::budget::shows_malloc_retries(&snap);
                    let answer = speculated.filter(|_| holds && !retries).and_then(|s| s.speculated.answer(&snap, &options.spec(None)));
                    let v = match answer {
                        Some(v) => Some(v),
                        None if retries => None,
                        None => stream_snapshot(&snap, f.path, file.len(), options, note)?,
                    };
                    read = Some(snap);
                    v
                }
                Ok(FirstPass::Scan(scan)) => stream_pickle(&file, scan, options, note)?,
                Err(e) => {
                    fallback_note(f.path, file.len(), &e.to_string(), note);
                    None
                }
            }
        } else {
            None
        };
        if let Some(v) = streamed {
            return Ok(ReplayAnswer::new(&name, options.clone(), v));
        }
    }
    let snap = match read {
        Some(s) => s,
        None => read_trace(f.path, f.in_memory)?,
    };
    let other = f.addresses_from.map(|p| read_trace(p, f.in_memory)).transpose()?;
    if f.in_memory {
        // The reference path: the snapshot kept whole.
        return crate::replay::replay(crate::Trace { name: &name, snapshot: &snap }, other.as_ref(), options);
    }
    crate::replay::replay_owned(&name, snap, other.as_ref(), options)
}

/// A one-pass replay that ran beside a pickle's first pass, and what it assumed.
struct Beside {
    /// The final segments it started from.
    segments: Vec<allocsim_trace::SnapshotSegment>,
    speculated: Speculated,
}

impl Beside {
    /// Whether what the replay assumed is what the file holds (see
    /// [`allocsim_replay::stream::replay_speculating`]): then its answer is the one-pass replay's
    /// of the snapshot read.
    fn holds_for(&self, snap: &Snapshot) -> bool {
        let learned = &self.speculated.segment_entries;
        snap.settings == self.speculated.settings
            && snap.settings.keys == self.speculated.settings.keys
            && snap.segments.len() == self.segments.len()
            && snap.segments.iter().zip(&self.segments).all(|(s, early)| {
                // (The segments read early do not keep their blocks' stacks.)
                let mut s = s.clone();
                s.blocks.iter_mut().for_each(|b| b.stack = 0);
                s == *early
            })
            && learned.len() <= snap.device_traces.len()
            && snap.device_traces.iter().enumerate().all(|(d, t)| {
                let seen = learned.get(d).map_or(&[][..], |v| v.as_slice());
                let recorded = t.iter().filter(|e| e.action.is_segment_event()).map(|e| TraceEntry { stack: 0, meta: 0, ..*e });
                seen.iter().copied().eq(recorded)
            })
    }
}

/// `ALLOCSIM_DEBUG_SPECULATION=FILE`: a line to FILE, after what is there (`append`) or in its
/// place. (Not stderr: the command line holds its lock.)
fn debug_speculation(line: &str, append: bool) {
    if let Some(path) = std::env::var_os("ALLOCSIM_DEBUG_SPECULATION") {
        let f = std::fs::OpenOptions::new().write(true).create(true).append(append).truncate(!append).open(path);
        let _ = f.and_then(|mut f| std::io::Write::write_all(&mut f, format!("{line}\n").as_bytes()));
    }
}

/// A pickle's first pass ([`PickleFile::first_pass`], with at most `max_entries` entries kept),
/// and beside it, in a second thread, the one-pass replay of the entries as the first pass reads
/// them, with the settings read from a plain file's end, else assumed (the file holds them only
/// after the traces). When
/// the first pass read the whole snapshot and the assumptions hold ([`Beside::holds_for`]), that
/// replay's answer is the answer, and the decoding and the replay took the time of the longer
/// rather than of both. (`ALLOCSIM_DEBUG_SPECULATION=FILE` writes to FILE whether that replay
/// answered, or why not, and whether what it assumed held.)
fn first_pass_replaying(file: &PickleFile, max_entries: u64, options: &ReplayOptions) -> (Result<FirstPass, TraceError>, Option<Beside>) {
    if max_entries == 0 {
        return (file.first_pass(0), None);
    }
    let (tee, mut teed) = allocsim_trace::pickle_stream::tee();
    let spec = options.spec(None);
    std::thread::scope(|scope| {
        let replay = scope.spawn(move || {
            // The settings from the file's end where it can be read alone (a plain file), else
            // torch's defaults.
            let tail = file.tail_settings(allocsim_model::AllocatorConfig::recorded_max_split_size);
            let assumed = tail.is_none();
            let settings = tail.unwrap_or_else(RecordedSettings::torch_default);
            let segments = teed.segments()?;
            let speculated = replay_speculating(&segments, &settings, assumed, &spec, teed);
            if std::env::var_os("ALLOCSIM_DEBUG_SPECULATION").is_some() {
                debug_speculation(
                    &format!(
                        "{:?}",
                        speculated.as_ref().map(|s| format!("answered (maximum tried: {:?}, promoted {})", s.tried.as_ref().map(|t| t.0), s.promoted))
                    ),
                    false,
                );
            }
            let speculated = speculated.ok()?;
            Some(Beside { segments, speculated })
        });
        let first = file.first_pass_teed(max_entries, tee);
        match replay.join() {
            Ok(beside) => (first, beside),
            Err(panic) => std::panic::resume_unwind(panic),
        }
    })
}

/// Replays a snapshot already read (a pickle's first pass) in one pass over its entries, as they
/// would have been streamed; `None` when only the in-memory replay gives the answer.
fn stream_snapshot(snap: &Snapshot, path: &Path, len: u64, options: &ReplayOptions, note: &mut dyn FnMut(&str)) -> Result<Option<Vec<ReplaySummary>>, Error> {
    let bare = |e: &TraceEntry| TraceEntry { stack: 0, meta: 0, ..*e };
    let segment_entries: Vec<Vec<TraceEntry>> =
        snap.device_traces.iter().map(|t| t.iter().filter(|e| e.action.is_segment_event()).map(bare).collect()).collect();
    let input = StreamInput { settings: &snap.settings, devices: Some(snap.device_traces.len()), segments: &snap.segments, segment_entries: &segment_entries };
    let events = || {
        let it = snap.device_traces.iter().enumerate().flat_map(move |(d, t)| t.iter().map(move |e| Ok((d, bare(e)))));
        Ok::<_, std::convert::Infallible>(it)
    };
    // The entries are in memory: the replay runs on this thread.
    let r = replay_stream_with(&input, &options.spec(None), events, Decoding::Done);
    answer_of(r, path, len, note, |e| match e {})
}

/// `replay_file`'s reading of a one-pass replay's outcome: the summaries, or `None` (only the
/// in-memory replay answers; a large file says why), or the error. `read_error` says what a read
/// error becomes: an error, or `None` (the file is read whole instead, by decoders that read it
/// or name what is wrong with it).
fn answer_of<E: std::fmt::Display>(
    r: Result<Streamed, StreamError<E>>,
    path: &Path,
    len: u64,
    note: &mut dyn FnMut(&str),
    read_error: impl FnOnce(E) -> Option<Error>,
) -> Result<Option<Vec<ReplaySummary>>, Error> {
    match r {
        Ok(Streamed::Done(v)) => Ok(Some(v)),
        Ok(Streamed::Fallback(why)) => {
            fallback_note(path, len, &why, note);
            Ok(None)
        }
        Err(StreamError::Read(e)) => {
            let why = e.to_string();
            match read_error(e) {
                Some(err) => Err(err),
                None => {
                    fallback_note(path, len, &why, note);
                    Ok(None)
                }
            }
        }
        Err(StreamError::Run(e)) => Err(e.into()),
    }
}

/// Says why a large file is replayed in memory.
fn fallback_note(path: &Path, len: u64, why: &str, note: &mut dyn FnMut(&str)) {
    if len > NOTE_FALLBACK_ABOVE {
        note(&format!("{}: replaying in memory ({why})", path.display()));
    }
}

/// Replays a JSON Lines trace in one pass over its events (after a first pass for its final
/// segments); `None` when only the in-memory replay gives the answer.
fn stream_jsonl(file: &JsonlFile, options: &ReplayOptions, note: &mut dyn FnMut(&str)) -> Result<Option<Vec<ReplaySummary>>, Error> {
    let path = file.path();
    let name = path.display().to_string();
    let scan = file.scan().map_err(|e| trace_error(&name, e))?;
    if allocsim_replay::budget::segment_events_allow_retries(&scan.segment_entries) {
        // A malloc's retry is told by the entries' stacks, which a stream does not keep.
        return Ok(None);
    }
    let input = StreamInput { settings: &scan.header.settings, devices: scan.header.devices, segments: &scan.segments, segment_entries: &scan.segment_entries };
    let r = replay_stream(&input, &options.spec(None), || file.events());
    answer_of(r, path, file.len(), note, |e| Some(trace_error(&name, e)))
}

/// Replays a snapshot pickle in one pass over its entries (after `scan`, the first pass: its
/// segments, segment events and settings); `None` when only the in-memory replay gives the answer: a shape
/// the stream does not read, an invalid file (whose error the general decoder reports), or a
/// question one pass cannot answer.
fn stream_pickle(file: &PickleFile, scan: PickleScan, options: &ReplayOptions, note: &mut dyn FnMut(&str)) -> Result<Option<Vec<ReplaySummary>>, Error> {
    let path = file.path();
    if allocsim_replay::budget::segment_events_allow_retries(&scan.segment_entries) {
        // A malloc's retry is told by the entries' stacks, which a stream does not keep.
        return Ok(None);
    }
    let input = StreamInput { settings: &scan.settings, devices: Some(scan.devices), segments: &scan.segments, segment_entries: &scan.segment_entries };
    let r = replay_stream(&input, &options.spec(None), || file.events());
    // Whatever the stream could not read, the other decoders read or name.
    answer_of(r, path, file.len(), note, |_| None)
}
