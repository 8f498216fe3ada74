//! PyTorch versions: the allocator rules that changed between 2.1 and 2.15 (docs/versions.md
//! lists each release's changes and where they were read), selected with `--torch-version X.Y`
//! or, by default, from what the snapshot shows ([`Rules::choose`]).
//!
//! The model is PyTorch 2.11's, measured on a GPU; every other release is read (wheels' headers
//! and library strings, sources where the index holds them, pull requests), not measured. What
//! differs in a way the model can express:
//!
//! | versions | rule |
//! |---|---|
//! | ≤ 2.9 | PyTorch's own CUDA parser: keys of that release only (2.5: no `max_non_split_rounding_mb`, no `pinned_use_background_threads`; ≤ 2.8: no `graph_capture_record_stream_reuse`), `max_split_size_mb` and `max_non_split_rounding_mb` must be **> 20**, numbers through `stoi`, only `' '` is stripped, `,`/`:` are checked, and the errors are `RuntimeError`s: `Unrecognized CachingAllocator option: X`, `CachingAllocator option max_split_size_mb too small, must be > 20`, `garbage_collect_threshold too small, set it 0.0~1.0` / `too big` |
//! | ≤ 2.9 | `roundup_power2_divisions:[…,>:N]` fills from the last explicit interval **inclusive** (overwriting it) |
//! | 2.1–2.4 | not measured, and their sources were read only in part (the ≈2.3/2.4 `get_free_block` and `ExpandableSegment`): 2.5's rules apply (the hard-coded oversize tolerance and the legacy parser are documented for them); which settings keys each accepted was not checked, so 2.5's key set is taken. [`TorchVersion::note`] says so |
//! | ≤ 2.5 | the oversize tolerance is the hard-coded `kLargeBuffer` (20 MiB): the same numbers as 2.6+'s default `max_non_split_rounding_mb`, which 2.5 does not accept |
//! | 2.10 | 2.11's parsers without `large_segment_size_mb` (segments and the tolerance are 20 MiB) |
//! | 2.12+ | `throw_on_cudamalloc_oom` (with an allowed maximum, a request over it is refused at the first `alloc_block`, without the retry chain; `num_oom_rejections`), `pinned_free_catch_all` accepted |
//! | 2.13+ | `pinned_max_round_threshold_mb`, `pinned_max_cached_size_mb` accepted (pinned host memory: no device decision) |
//! | 2.15 | `expandable_segments_reserve` (each new expandable segment reserves that much address space, at most 1.125 × the device), `expandable_segments_reserve_by_class` accepted (a stream's class is set at run time and not recorded: not applied) |
//!
//! Read but not modelled: MemPool `use_on_oom` placement per release (the model is 2.11's,
//! where it moved before the releases), custom allocators (so the 2.7–2.9 MemPool + expandable
//! segments error and the per-pool expandable-segments decision of 2.10+ make no difference),
//! the 2.13 split of CUDA-graph captures from MemPool diversion (`num_active_captures_`: from
//! 2.13 a request routed to a MemPool may release cached blocks and complete cross-stream frees;
//! a snapshot does not say whether a private pool's requests came from a capture or a MemPool),
//! and the `PYTORCH_ALLOC_CONF` fallback (2.10+; allocsim takes the string, not the environment).

use std::fmt;

use allocsim_model::constants::{K_LARGE_BUFFER, MIB, ROUNDUP_INTERVALS};
use allocsim_model::{AllocatorConfig, ConfigError, LaterKeys};
use allocsim_trace::RecordedSettings;

/// A PyTorch release line (`major.minor`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TorchVersion {
    pub major: u32,
    pub minor: u32,
}

impl TorchVersion {
    pub const DEFAULT: TorchVersion = TorchVersion { major: 2, minor: 11 };
    pub const OLDEST: TorchVersion = TorchVersion { major: 2, minor: 1 };
    /// The oldest release whose rules were read in full or measured.
    pub const OLDEST_CHECKED: TorchVersion = TorchVersion { major: 2, minor: 5 };
    pub const NEWEST: TorchVersion = TorchVersion { major: 2, minor: 15 };

    pub const fn new(major: u32, minor: u32) -> TorchVersion {
        TorchVersion { major, minor }
    }

    /// `2.11`, `2.5.1`, `2.11.0+cu130`: the release line; the patch and local parts are ignored.
    pub fn parse(s: &str) -> Result<TorchVersion, String> {
        let core = s.trim().split(['+', '-']).next().unwrap_or("");
        let mut it = core.split('.');
        let num = |p: Option<&str>| p.and_then(|x| x.parse::<u32>().ok());
        let (Some(major), Some(minor)) = (num(it.next()), num(it.next())) else {
            return Err(format!("{s:?} is not a PyTorch version (expected MAJOR.MINOR, e.g. 2.11)"));
        };
        if it.next().is_some_and(|p| p.parse::<u32>().is_err()) {
            return Err(format!("{s:?} is not a PyTorch version (expected MAJOR.MINOR, e.g. 2.11)"));
        }
        let v = TorchVersion { major, minor };
        if v < Self::OLDEST || v > Self::NEWEST {
            let why = if v < Self::OLDEST { " (snapshots before 2.1 record no trace of allocations)" } else { "" };
            return Err(format!("PyTorch {v} is not modelled: allocsim knows the allocator rules of {} to {}{why}", Self::OLDEST, Self::NEWEST));
        }
        Ok(v)
    }

    /// What a user should know about the rules applied for this version (`None`: nothing
    /// beyond the module's table).
    pub fn note(self) -> Option<String> {
        (self < Self::OLDEST_CHECKED).then(|| {
            format!(
                "PyTorch {self}'s allocator was not measured and its sources were read only in part: 2.5's rules apply \
                 (the hard-coded 20 MiB oversize tolerance and the legacy settings parser, documented for ≤ 2.5; the \
                 size rounding, best fit, splitting and retry rules read in the ≈2.4 sources are 2.11's); which settings \
                 keys {self} accepted was not checked"
            )
        })
    }

    fn at_most(self, minor: u32) -> bool {
        self <= TorchVersion::new(2, minor)
    }

    /// The keys this release accepts beyond 2.11's.
    pub fn later_keys(self) -> LaterKeys {
        LaterKeys { v2_12: !self.at_most(11), v2_13: !self.at_most(12), v2_15: !self.at_most(14) }
    }

    /// Whether this release's rules were measured on a GPU (2.11) rather than read from its
    /// wheel and sources (every other release).
    pub fn measured(self) -> bool {
        self == Self::DEFAULT
    }

    /// Parses a `PYTORCH_CUDA_ALLOC_CONF` string as this version's allocator does at process start.
    pub fn parse_config(self, conf: &str) -> Result<AllocatorConfig, ConfigError> {
        if self.at_most(9) {
            return parse_legacy(self, conf);
        }
        if self == TorchVersion::new(2, 10) {
            for item in top_level_items(conf) {
                let key: String = item.split(':').next().unwrap_or("").chars().filter(|c| !c.is_ascii_whitespace()).collect();
                if key == "large_segment_size_mb" {
                    return Err(ConfigError(format!("Unrecognized key '{key}' in CUDA allocator config.")));
                }
            }
        }
        AllocatorConfig::parse_with(conf, self.later_keys())
    }
}

impl fmt::Display for TorchVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

impl Default for TorchVersion {
    fn default() -> Self {
        TorchVersion::DEFAULT
    }
}

/// What a snapshot's `allocator_settings` shows of the release that wrote it: at least
/// `at_least`, at most `at_most`, and why.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Evidence {
    #[serde(serialize_with = "ser_version")]
    pub at_least: TorchVersion,
    #[serde(serialize_with = "ser_version")]
    pub at_most: TorchVersion,
    pub what: String,
}

fn ser_version<S: serde::Serializer>(v: &TorchVersion, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&v.to_string())
}

/// Settings keys (`PYTORCH_CUDA_ALLOC_CONF`) and the release that first accepted them (read in
/// each wheel's `CUDAAllocatorConfig.h` / `AllocatorConfig.h` and `libc10*.so` strings).
const CONF_KEYS_SINCE: &[(&str, (u32, u32))] = &[
    ("max_non_split_rounding_mb", (2, 6)),
    ("pinned_use_background_threads", (2, 6)),
    ("graph_capture_record_stream_reuse", (2, 9)),
    ("per_process_memory_fraction", (2, 10)),
    ("pinned_reserve_segment_size_mb", (2, 10)),
    ("large_segment_size_mb", (2, 11)),
    ("throw_on_cudamalloc_oom", (2, 12)),
    ("pinned_free_catch_all", (2, 12)),
    ("pinned_max_round_threshold_mb", (2, 13)),
    ("pinned_max_cached_size_mb", (2, 13)),
    ("expandable_segments_reserve", (2, 15)),
    ("expandable_segments_reserve_by_class", (2, 15)),
];

/// `allocator_settings` keys and the release that first wrote them (`torch/csrc/cuda/Module.cpp`,
/// read as strings of each wheel's `libtorch_python.so`; 2.3 from its pull request).
const SNAPSHOT_KEYS_SINCE: &[(&str, (u32, u32))] =
    &[("graph_capture_record_stream_reuse", (2, 9)), ("max_round_threshold", (2, 13)), ("max_cached_size", (2, 13))];

/// What `settings` (a snapshot's `allocator_settings`) shows of the release that recorded it:
/// its keys (2.9 added `graph_capture_record_stream_reuse`, 2.13 `max_round_threshold` and
/// `max_cached_size`; a dict without them is older), the keys its settings string uses (each
/// accepted from some release on), and a `max_split_size_mb` of 20 (refused before 2.10).
/// Trace entries show releases too (`annotate` entries 2.14+, `user_metadata` 2.10+,
/// `compile_context` 2.8+) but no rule that differs between the releases they allow: the rules
/// that changed after 2.11 come with settings keys, those before it are the settings string's.
pub fn evidence(settings: &RecordedSettings) -> Vec<Evidence> {
    let v = |(a, b): (u32, u32)| TorchVersion::new(a, b);
    let mut out = Vec::new();
    if let Some(keys) = &settings.keys {
        for &(key, since) in SNAPSHOT_KEYS_SINCE {
            if keys.iter().any(|k| k == key) {
                out.push(Evidence {
                    at_least: v(since),
                    at_most: TorchVersion::NEWEST,
                    what: format!("allocator_settings has '{key}' (written from {} on)", v(since)),
                });
            } else if keys.iter().any(|k| k == "pinned_num_register_threads") {
                // A dict of the 2.3+ shape without a key a later release always writes.
                out.push(Evidence {
                    at_least: TorchVersion::OLDEST,
                    at_most: TorchVersion::new(since.0, since.1 - 1),
                    what: format!("allocator_settings has no '{key}' (written from {} on)", v(since)),
                });
            }
        }
    }
    if let Some(conf) = &settings.alloc_conf {
        for item in top_level_items(conf) {
            let key: String = item.split(':').next().unwrap_or("").chars().filter(|c| !c.is_ascii_whitespace()).collect();
            if let Some(&(_, since)) = CONF_KEYS_SINCE.iter().find(|(k, _)| *k == key) {
                out.push(Evidence {
                    at_least: v(since),
                    at_most: TorchVersion::NEWEST,
                    what: format!("its settings use '{key}' (accepted from {} on)", v(since)),
                });
            }
            let value: String = item.split(':').nth(1).unwrap_or("").trim().to_string();
            if key == "max_split_size_mb" && value == "20" {
                out.push(Evidence {
                    at_least: TorchVersion::new(2, 10),
                    at_most: TorchVersion::NEWEST,
                    what: "its settings have max_split_size_mb:20 (refused before 2.10: must be > 20)".into(),
                });
            }
        }
    }
    out
}

/// Which release's rules a replay uses, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rules {
    pub version: TorchVersion,
    /// Asked for (`--torch-version`); else chosen from the snapshot.
    pub asked: bool,
    /// The releases the snapshot allows (`OLDEST..=NEWEST` without evidence).
    pub allowed: (TorchVersion, TorchVersion),
    pub evidence: Vec<Evidence>,
    /// How the recorded settings were read where it is not plain: a string PyTorch refused, or
    /// values changed at run time (`allocsim_replay::run::settings_in_force`).
    pub settings_note: Option<String>,
}

impl Rules {
    /// The rules for a snapshot recorded with `settings`: `asked` when given; else 2.11 (the
    /// release measured here) where the snapshot allows it, or the allowed release nearest it.
    pub fn choose(asked: Option<TorchVersion>, settings: &RecordedSettings) -> Rules {
        let evidence = evidence(settings);
        let lo = evidence.iter().map(|e| e.at_least).max().unwrap_or(TorchVersion::OLDEST);
        let hi = evidence.iter().map(|e| e.at_most).min().unwrap_or(TorchVersion::NEWEST);
        let version = match asked {
            Some(v) => v,
            // Contradicting evidence (a hand-made file): 2.11.
            None if lo > hi => TorchVersion::DEFAULT,
            None => TorchVersion::DEFAULT.max(lo).min(hi),
        };
        Rules { version, asked: asked.is_some(), allowed: (lo, hi), evidence, settings_note: None }
    }

    /// Whether the snapshot allows this release.
    pub fn consistent(&self) -> bool {
        self.allowed.0 <= self.version && self.version <= self.allowed.1
    }

    /// One line: the rules used, why, and whether they were measured.
    pub fn line(&self) -> String {
        let v = self.version;
        let (lo, hi) = self.allowed;
        let shows = if self.evidence.is_empty() {
            "the snapshot does not show its release".to_string()
        } else {
            let range = if lo > hi {
                "contradicting releases".to_string()
            } else if lo == hi {
                format!("PyTorch {lo}")
            } else if hi == TorchVersion::NEWEST {
                format!("PyTorch {lo} or later")
            } else if lo == TorchVersion::OLDEST {
                format!("PyTorch {hi} or earlier")
            } else {
                format!("PyTorch {lo} to {hi}")
            };
            let what: Vec<&str> = self.evidence.iter().map(|e| e.what.as_str()).collect();
            format!("the snapshot shows {range} ({})", what.join("; "))
        };
        let why = match (self.asked, self.consistent()) {
            (true, true) => format!("asked with --torch-version; {shows}"),
            (true, false) => format!("asked with --torch-version, although {shows}"),
            (false, _) if v == TorchVersion::DEFAULT => format!("the default; {shows}"),
            (false, _) => shows,
        };
        let how = if v.measured() {
            "measured on torch 2.11.0".to_string()
        } else if v > TorchVersion::DEFAULT {
            format!(
                "{v}'s rules are read from its wheel (headers, library strings) and pull requests, not measured: the GPU here runs 2.11; rules not read are 2.11's (docs/versions.md)"
            )
        } else {
            format!("{v}'s rules are read from its wheel and sources, not measured (docs/versions.md)")
        };
        format!("PyTorch {v} ({why}); {how}")
    }

    /// The `rules` object of `--json` output.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "torch_version": self.version.to_string(),
            "asked": self.asked,
            "measured": self.version.measured(),
            "allowed": [self.allowed.0.to_string(), self.allowed.1.to_string()],
            "consistent": self.consistent(),
            "evidence": self.evidence,
            "note": self.line(),
            "settings_note": self.settings_note,
        })
    }
}

/// The `key:value` items of a settings string, split at commas outside `[...]`.
fn top_level_items(conf: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in conf.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth <= 0 => {
                out.push(&conf[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&conf[start..]);
    out.retain(|s| !s.trim().is_empty());
    out
}

fn rt(msg: impl Into<String>) -> ConfigError {
    ConfigError(format!("RuntimeError: {}", msg.into()))
}

/// `std::stoi`: leading white space, a sign, digits; the rest is ignored; out of `int` range is
/// `std::out_of_range`. Negative values are then converted to `size_t` (wrapping).
fn stoi(s: &str) -> Result<i64, ConfigError> {
    let t = s.trim_start();
    let (neg, digits) = match t.as_bytes().first() {
        Some(b'-') => (true, &t[1..]),
        Some(b'+') => (false, &t[1..]),
        _ => (false, t),
    };
    let n = digits.bytes().take_while(u8::is_ascii_digit).count();
    if n == 0 {
        return Err(ConfigError("ValueError: stoi".into()));
    }
    let v: i64 = digits[..n].parse().map_err(|_| ConfigError("IndexError: stoi".into()))?;
    let v = if neg { -v } else { v };
    if v < i32::MIN as i64 || v > i32::MAX as i64 {
        return Err(ConfigError("IndexError: stoi".into()));
    }
    Ok(v)
}

fn stod(s: &str) -> Result<f64, ConfigError> {
    let t = s.trim_start();
    let n = t.char_indices().take_while(|&(i, c)| c.is_ascii_digit() || c == '.' || ((c == '-' || c == '+') && i == 0) || c == 'e' || c == 'E').count();
    let mut k = n;
    while k > 0 {
        if let Ok(v) = t[..k].parse::<f64>() {
            return Ok(v);
        }
        k -= 1;
    }
    Err(ConfigError("ValueError: stod".into()))
}

/// `CUDAAllocatorConfig::parseArgs` of 2.5–2.9 (its own lexer and checks; also taken for 2.1–2.4).
fn parse_legacy(v: TorchVersion, conf: &str) -> Result<AllocatorConfig, ConfigError> {
    let mut c = AllocatorConfig { source: conf.to_string(), ..AllocatorConfig::default() };
    // lexArgs: `,` `:` `[` `]` are tokens; only ' ' is dropped.
    let mut toks: Vec<String> = Vec::new();
    let mut buf = String::new();
    for ch in conf.chars() {
        if matches!(ch, ',' | ':' | '[' | ']') {
            if !buf.is_empty() {
                toks.push(std::mem::take(&mut buf));
            }
            toks.push(ch.to_string());
        } else if ch != ' ' {
            buf.push(ch);
        }
    }
    if !buf.is_empty() {
        toks.push(buf);
    }
    let consume = |i: usize, t: &str| -> Result<(), ConfigError> {
        if toks.get(i).map(String::as_str) == Some(t) { Ok(()) } else { Err(rt(format!("Error parsing CachingAllocator settings, expected {t}"))) }
    };
    let limit_mb = K_LARGE_BUFFER / MIB;
    let mut i = 0;
    while i < toks.len() {
        let key = toks[i].as_str();
        let known = match key {
            "max_split_size_mb"
            | "garbage_collection_threshold"
            | "roundup_power2_divisions"
            | "backend"
            | "expandable_segments"
            | "release_lock_on_cudamalloc"
            | "release_lock_on_hipmalloc"
            | "pinned_use_cuda_host_register"
            | "pinned_use_hip_host_register"
            | "pinned_num_register_threads" => true,
            "max_non_split_rounding_mb" | "pinned_use_background_threads" => !v.at_most(5),
            "graph_capture_record_stream_reuse" => !v.at_most(8),
            _ => false,
        };
        if !known {
            return Err(rt(format!("Unrecognized CachingAllocator option: {key}")));
        }
        consume(i + 1, ":")?;
        i += 2;
        let val = toks.get(i).cloned().ok_or_else(|| rt(format!("Error, expecting {key} value")))?;
        match key {
            "max_split_size_mb" | "max_non_split_rounding_mb" => {
                let mb = stoi(&val)? as u64;
                if mb <= limit_mb {
                    return Err(rt(format!("CachingAllocator option {key} too small, must be > {limit_mb}")));
                }
                let bytes = mb.min(u64::MAX / MIB) * MIB;
                if key == "max_split_size_mb" {
                    c.max_split_size = bytes;
                } else {
                    c.max_non_split_rounding_size = bytes;
                }
            }
            "garbage_collection_threshold" => {
                let g = stod(&val)?;
                if g <= 0.0 {
                    return Err(rt("garbage_collect_threshold too small, set it 0.0~1.0"));
                }
                if g >= 1.0 {
                    return Err(rt("garbage_collect_threshold too big, set it 0.0~1.0"));
                }
                c.garbage_collection_threshold = g;
            }
            "roundup_power2_divisions" => i = parse_roundup_legacy(&mut c, &toks, i)?,
            "backend" => {
                if val != "native" && val != "cudaMallocAsync" {
                    return Err(rt("Unknown allocator backend, options are native and cudaMallocAsync"));
                }
                c.backend_native = val == "native";
            }
            "pinned_num_register_threads" => {
                let n = stoi(&val)? as u64;
                if !n.is_power_of_two() {
                    return Err(rt(format!("Number of register threads has to be power of 2 , got {n}")));
                }
                if n > 128 {
                    return Err(rt(format!("Number of register threads should be less than or equal to 128, got {n}")));
                }
                c.pinned_num_register_threads = n;
            }
            _ => {
                let b = match val.as_str() {
                    "True" => true,
                    "False" => false,
                    _ => return Err(rt(format!("Expected a single True/False argument for {key}"))),
                };
                match key {
                    "expandable_segments" => c.expandable_segments = b,
                    "release_lock_on_cudamalloc" | "release_lock_on_hipmalloc" => c.release_lock_on_cudamalloc = b,
                    "pinned_use_cuda_host_register" | "pinned_use_hip_host_register" => c.pinned_use_cuda_host_register = b,
                    "pinned_use_background_threads" => c.pinned_use_background_threads = b,
                    _ => c.graph_capture_record_stream_reuse = b,
                }
            }
        }
        if i + 1 < toks.len() {
            consume(i + 1, ",")?;
            i += 1;
        }
        i += 1;
    }
    Ok(c)
}

/// `parseRoundUpPower2Divisions` of ≤ 2.9: `>` fills from the last explicit interval inclusive.
fn parse_roundup_legacy(c: &mut AllocatorConfig, toks: &[String], mut i: usize) -> Result<usize, ConfigError> {
    let divs = &mut c.roundup_power2_divisions;
    if toks[i] != "[" {
        let v = stoi(&toks[i])? as u64;
        if !v.is_power_of_two() {
            return Err(rt("For roundups, the divisons has to be power of 2 "));
        }
        divs.fill(v);
        return Ok(i);
    }
    let mut last_index = 0usize;
    let mut first = true;
    loop {
        i += 1;
        if i >= toks.len() {
            return Err(rt("Error parsing roundup_power2_divisions value"));
        }
        if toks[i] == "]" {
            break;
        }
        let key = toks[i].clone();
        if toks.get(i + 1).map(String::as_str) != Some(":") {
            return Err(rt("Error parsing CachingAllocator settings, expected :"));
        }
        i += 2;
        let val = toks.get(i).ok_or_else(|| rt("Error parsing roundup_power2_divisions value"))?;
        let v = stoi(val)? as u64;
        if !(v == 0 || v.is_power_of_two()) {
            return Err(rt("For roundups, the divisons has to be power of 2 or 0 to disable roundup "));
        }
        if key == ">" {
            for d in divs.iter_mut().skip(last_index) {
                *d = v;
            }
        } else {
            let b = stoi(&key)? as u64;
            if !b.is_power_of_two() {
                return Err(rt("For roundups, the intervals have to be power of 2 "));
            }
            let index = (63 - b.leading_zeros() as usize).min(ROUNDUP_INTERVALS - 1);
            if first {
                divs[..index].fill(v);
                first = false;
            }
            divs[index] = v;
            last_index = index;
        }
        if toks.get(i + 1).map(String::as_str) != Some("]") {
            if toks.get(i + 1).map(String::as_str) != Some(",") {
                return Err(rt("Error parsing CachingAllocator settings, expected ,"));
            }
            i += 1;
        }
    }
    Ok(i)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(m: u32) -> TorchVersion {
        TorchVersion::new(2, m)
    }

    #[test]
    fn parses_versions() {
        assert_eq!(TorchVersion::parse("2.11").unwrap(), v(11));
        assert_eq!(TorchVersion::parse("2.5.1").unwrap(), v(5));
        assert_eq!(TorchVersion::parse("2.11.0+cu130").unwrap(), v(11));
        assert_eq!(TorchVersion::parse("2.4").unwrap(), v(4));
        assert!(TorchVersion::parse("2.1").unwrap().note().is_some());
        assert!(TorchVersion::parse("2.5").unwrap().note().is_none());
        assert!(TorchVersion::parse("2.0").unwrap_err().contains("2.1 to 2.15"));
        assert!(TorchVersion::parse("eleven").is_err());
    }

    #[test]
    fn max_split_bound_moved_from_greater_to_at_least() {
        assert_eq!(v(5).parse_config("max_split_size_mb:20").unwrap_err().0, "RuntimeError: CachingAllocator option max_split_size_mb too small, must be > 20");
        assert_eq!(v(9).parse_config("max_split_size_mb:21").unwrap().max_split_size, 21 * MIB);
        assert_eq!(v(10).parse_config("max_split_size_mb:20").unwrap().max_split_size, 20 * MIB);
        assert_eq!(v(11).parse_config("max_split_size_mb:20").unwrap().max_split_size, 20 * MIB);
    }

    #[test]
    fn key_sets() {
        assert_eq!(v(5).parse_config("foo:1").unwrap_err().0, "RuntimeError: Unrecognized CachingAllocator option: foo");
        assert_eq!(
            v(5).parse_config("max_non_split_rounding_mb:64").unwrap_err().0,
            "RuntimeError: Unrecognized CachingAllocator option: max_non_split_rounding_mb"
        );
        assert_eq!(v(6).parse_config("max_non_split_rounding_mb:64").unwrap().max_non_split_rounding_size, 64 * MIB);
        assert!(v(8).parse_config("graph_capture_record_stream_reuse:True").is_err());
        assert!(v(9).parse_config("graph_capture_record_stream_reuse:True").unwrap().graph_capture_record_stream_reuse);
        assert_eq!(v(10).parse_config("large_segment_size_mb:40").unwrap_err().0, "Unrecognized key 'large_segment_size_mb' in CUDA allocator config.");
        assert_eq!(v(11).parse_config("large_segment_size_mb:40").unwrap().large_segment_size, 40 * MIB);
        assert!(v(11).parse_config("throw_on_cudamalloc_oom:True").is_err());
        assert!(v(12).parse_config("throw_on_cudamalloc_oom:True,max_split_size_mb:64").unwrap().max_split_size == 64 * MIB);
        assert!(v(12).parse_config("throw_on_cudamalloc_oom:True").unwrap().throw_on_cudamalloc_oom);
        assert!(v(12).parse_config("expandable_segments_reserve:0.5").is_err());
        assert!(v(12).parse_config("pinned_max_cached_size_mb:64").is_err());
        assert_eq!(v(13).parse_config("pinned_max_cached_size_mb:64").unwrap().pinned_max_cached_size_mb, Some(64));
        let c = v(15).parse_config("expandable_segments_reserve:0.5,expandable_segments:True").unwrap();
        assert!(c.expandable_segments && c.expandable_segments_reserve.is_some());
        assert_eq!(v(11).parse_config("foo:1").unwrap_err().0, "Unrecognized key 'foo' in CUDA allocator config.");
    }

    #[test]
    fn legacy_messages_and_lexing() {
        assert_eq!(v(7).parse_config("garbage_collection_threshold:1.0").unwrap_err().0, "RuntimeError: garbage_collect_threshold too big, set it 0.0~1.0");
        assert_eq!(v(7).parse_config("garbage_collection_threshold:0").unwrap_err().0, "RuntimeError: garbage_collect_threshold too small, set it 0.0~1.0");
        assert_eq!(v(7).parse_config(" max_split_size_mb : 64 ").unwrap().max_split_size, 64 * MIB);
        // Only ' ' is stripped before 2.10: a tab stays in the key.
        assert!(v(7).parse_config("\tmax_split_size_mb:64").unwrap_err().0.starts_with("RuntimeError: Unrecognized CachingAllocator option"));
        assert!(v(11).parse_config("\tmax_split_size_mb:64").is_ok());
    }

    #[test]
    fn roundup_fill_from_last_index() {
        // ≤ 2.9: `>` overwrites the last explicit interval; 2.10+: fills after it.
        let old = v(9).parse_config("roundup_power2_divisions:[256:1,512:2,>:8]").unwrap().roundup_power2_divisions;
        let new = v(10).parse_config("roundup_power2_divisions:[256:1,512:2,>:8]").unwrap().roundup_power2_divisions;
        assert_eq!(&old[7..11], &[1, 1, 8, 8]);
        assert_eq!(&new[7..11], &[1, 1, 2, 8]);
        assert_eq!(v(5).parse_config("roundup_power2_divisions:4").unwrap().roundup_power2_divisions, [4; ROUNDUP_INTERVALS]);
    }

    #[test]
    fn tolerance_numbers_are_the_same() {
        for m in [5, 6, 9, 10, 11, 15] {
            assert_eq!(v(m).parse_config("").unwrap().max_non_split_rounding_size, K_LARGE_BUFFER, "2.{m}");
        }
    }

    fn settings(conf: &str, keys: Option<&[&str]>) -> RecordedSettings {
        RecordedSettings { alloc_conf: Some(conf.into()), keys: keys.map(|k| k.iter().map(|s| s.to_string()).collect()), ..RecordedSettings::torch_default() }
    }

    const KEYS_2_13: [&str; 11] = [
        "PYTORCH_CUDA_ALLOC_CONF",
        "max_split_size",
        "garbage_collection_threshold",
        "expandable_segments",
        "pinned_num_register_threads",
        "release_lock_on_cudamalloc",
        "pinned_use_cuda_host_register",
        "graph_capture_record_stream_reuse",
        "roundup_power2_divisions",
        "max_round_threshold",
        "max_cached_size",
    ];

    #[test]
    fn the_snapshot_shows_its_release() {
        // 2.11's keys: nothing to tell, 2.11's rules, measured.
        let r = Rules::choose(None, &RecordedSettings::torch_default());
        assert_eq!((r.version, r.evidence.len()), (v(11), 0));
        assert!(r.line().contains("measured on torch 2.11.0"), "{}", r.line());
        // 2.13+ writes max_round_threshold and max_cached_size: 2.13's rules, read not measured.
        let r = Rules::choose(None, &settings("", Some(&KEYS_2_13)));
        assert_eq!((r.version, r.allowed), (v(13), (v(13), v(15))));
        let line = r.line();
        assert!(line.contains("PyTorch 2.13 or later") && line.contains("max_round_threshold") && line.contains("not measured"), "{line}");
        // A 2.3–2.8 dict (no graph_capture_record_stream_reuse): the newest it allows, 2.8.
        let old: Vec<&str> = KEYS_2_13[..9].iter().copied().filter(|k| *k != "graph_capture_record_stream_reuse").collect();
        let r = Rules::choose(None, &settings("", Some(&old)));
        assert_eq!((r.version, r.allowed.1), (v(8), v(8)));
        // Settings keys: the release that first accepted them.
        assert_eq!(Rules::choose(None, &settings("throw_on_cudamalloc_oom:True", None)).version, v(12));
        assert_eq!(Rules::choose(None, &settings("expandable_segments:True,expandable_segments_reserve:0.5", None)).version, v(15));
        assert_eq!(Rules::choose(None, &settings("max_split_size_mb:20", None)).allowed.0, v(10));
        // Asked for: used, and a contradiction said.
        let r = Rules::choose(Some(v(11)), &settings("", Some(&KEYS_2_13)));
        assert!(r.version == v(11) && !r.consistent() && r.line().contains("although"), "{}", r.line());
    }
}
