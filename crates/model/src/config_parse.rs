//! The `PYTORCH_CUDA_ALLOC_CONF` tokenizer and parser (2.11 rules and error texts).
//!
//! PyTorch 2.11 has two parsers over the same string (`c10/core/AllocatorConfig.{h,cpp}`,
//! `c10/cuda/CUDAAllocatorConfig.cpp`):
//!
//! * the generic `AcceleratorAllocatorConfig::parseArgs` ("G" keys: `large_segment_size_mb`,
//!   `max_split_size_mb`, `max_non_split_rounding_mb`, `garbage_collection_threshold`,
//!   `roundup_power2_divisions`, `expandable_segments`, `pinned_use_background_threads`);
//! * the CUDA hook `CUDAAllocatorConfig::parseArgs` ("C" keys: `backend`,
//!   `release_lock_on_cudamalloc`, `pinned_use_cuda_host_register`, `pinned_num_register_threads`,
//!   `pinned_reserve_segment_size_mb`, `graph_capture_record_stream_reuse`,
//!   `per_process_memory_fraction`, and the `hip` spellings of the first two of those).
//!
//! Each one walks the whole token list, parses its own keys and `skipKey`s the other parser's keys;
//! a key known to neither is an error. The walk is emulated token for token, including the quirks
//! that were measured on 2.11.0+cu130 (see the tests in `tests/config.rs`):
//!
//! * `ConfigTokenizer::checkToken(i, ":")` / `(i, ",")` only checks that token `i` exists; its
//!   result is ignored, so `max_split_size_mb,100` and `a:1:b:2` are accepted;
//! * numbers go through `std::stoull` / `std::stod`, which read the longest valid prefix
//!   (`100abc` = 100, `1e3` = 1, `0x40` = 0 for integers; `.5`, `0x0.8p0`, `inf`, `nan` for doubles)
//!   and accept a sign (`-1` wraps to 2^64-1 and so clamps to the largest size);
//! * a missing token is an internal assert (a `RuntimeError` in Python, with the file and line
//!   of the 2.11 wheel in its text).
//!
//! # Error texts
//!
//! [`ConfigError`] holds the C++ exception's message (`what()` without backtrace), **without** the
//! Python exception type that `torch` puts in front when it re-raises it. The types, as measured:
//! `TORCH_CHECK_VALUE` failures are `ValueError: <msg>`; internal asserts are
//! `RuntimeError: <msg>`; `std::stoull` / `std::stod` failures have the message `stoull` / `stod`
//! and are `ValueError` when nothing could be parsed (`std::invalid_argument`) and `IndexError` when
//! the value is out of range (`std::out_of_range`, e.g. `99999999999999999999` or `1e-400`).
//!
//! # Process start vs. runtime
//!
//! * At runtime (`torch.cuda.memory._set_allocator_settings` / `_accelerator_setAllocatorSettings`,
//!   i.e. `c10::CachingAllocator::setAllocatorSettings`) the generic parser runs first, then the
//!   CUDA hook. The generic parser rejects an unknown key with `Unrecognized key 'k' in
//!   Accelerator allocator config.` (measured). Settings parsed before the failing key stay applied
//!   and the string is recorded as the current settings even when it fails (measured).
//!   `backend` must name the allocator chosen at load time.
//! * At process start (the environment variable) the string is first walked at library load
//!   (structural errors abort there: measured on 2.11, e.g. `max_split_size_mb` without a value or
//!   an unclosed `[`), and an unknown key is reported by the CUDA parser (`... in CUDA allocator
//!   config.`, measured), so the CUDA parser runs before the generic one there. This order is
//!   inferred from those measurements: which error wins in a string with several errors at process
//!   start could not be measured (those processes crash on the measuring machine).
//!
//! [`apply`] is what `AllocatorConfig::{parse, apply}` call; it uses the process-start rules when the
//! settings are still untouched defaults (what `AllocatorConfig::parse` passes it) and the runtime
//! rules otherwise. [`apply_env`] and [`apply_runtime`] choose explicitly.

use crate::config::{AllocatorConfig, ConfigError, LaterKeys, ReserveSpec};
use crate::constants::{MIB, ROUNDUP_INTERVALS};

/// `kMinLargeAlloc / kMB`: `large_segment_size_mb` must be greater than this.
const MIN_LARGE_SEGMENT_SIZE_MB: u64 = 10;
/// `std::numeric_limits<size_t>::max() / kMB`: MB values are clamped to this before `* kMB`.
const MAX_ALLOWED_MB: u64 = u64::MAX / MIB;
/// `CUDAAllocatorConfig::pinned_max_register_threads()`.
const PINNED_MAX_REGISTER_THREADS: u64 = 128;

/// Keys of the generic parser (`AcceleratorAllocatorConfig::getKeys()` before the CUDA hook adds its own).
const GENERIC_KEYS: [&str; 7] = [
    "large_segment_size_mb",
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "garbage_collection_threshold",
    "roundup_power2_divisions",
    "expandable_segments",
    "pinned_use_background_threads",
];

/// Keys registered by the CUDA hook (`CUDAAllocatorConfig::getKeys()`).
const CUDA_KEYS: [&str; 9] = [
    "backend",
    "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register",
    "release_lock_on_hipmalloc",
    "pinned_use_hip_host_register",
    "graph_capture_record_stream_reuse",
    "pinned_reserve_segment_size_mb",
    "pinned_num_register_threads",
    "per_process_memory_fraction",
];

/// Keys of the generic parser added after 2.11 (2.13: `AllocatorConfig.h`'s `getMutableKeys`).
const GENERIC_KEYS_2_13: [&str; 2] = ["pinned_max_round_threshold_mb", "pinned_max_cached_size_mb"];
/// Keys of the CUDA hook added after 2.11 (`CUDAAllocatorConfig::getKeys()` of 2.12 and 2.15).
const CUDA_KEYS_2_12: [&str; 2] = ["pinned_free_catch_all", "throw_on_cudamalloc_oom"];
const CUDA_KEYS_2_15: [&str; 2] = ["expandable_segments_reserve", "expandable_segments_reserve_by_class"];

/// Whether either parser knows `key` (with the keys of the later release `later`).
fn known_key(key: &str, later: LaterKeys) -> bool {
    GENERIC_KEYS.contains(&key)
        || CUDA_KEYS.contains(&key)
        || (later.v2_12 && CUDA_KEYS_2_12.contains(&key))
        || (later.v2_13 && GENERIC_KEYS_2_13.contains(&key))
        || (later.v2_15 && CUDA_KEYS_2_15.contains(&key))
}

/// Where a settings string comes from; decides the parser order and the unknown-key text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Origin {
    /// `PYTORCH_CUDA_ALLOC_CONF` (or `PYTORCH_ALLOC_CONF`) read at process start.
    Env,
    /// `setAllocatorSettings` at run time.
    Runtime,
}

/// Applies `conf` as read from the environment at process start.
pub(crate) fn apply_env(cfg: &mut AllocatorConfig, conf: &str, later: LaterKeys) -> Result<(), ConfigError> {
    apply_with(cfg, conf, Origin::Env, later)
}

/// Applies `conf` as `setAllocatorSettings` does at run time.
pub(crate) fn apply_runtime(cfg: &mut AllocatorConfig, conf: &str, later: LaterKeys) -> Result<(), ConfigError> {
    apply_with(cfg, conf, Origin::Runtime, later)
}

fn apply_with(cfg: &mut AllocatorConfig, conf: &str, origin: Origin, later: LaterKeys) -> Result<(), ConfigError> {
    let t = Tokenizer::new(conf);
    match origin {
        Origin::Env => {
            load_time_walk(&t)?;
            parse_cuda(cfg, &t, origin, later)?;
            parse_generic(cfg, &t, conf, later)
        }
        Origin::Runtime => {
            parse_generic(cfg, &t, conf, later)?;
            parse_cuda(cfg, &t, origin, later)
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Error texts

fn value_error(msg: impl Into<String>) -> ConfigError {
    ConfigError(msg.into())
}

/// `TORCH_INTERNAL_ASSERT(cond, msg)` as `what()` prints it in the 2.11 wheel.
fn internal_assert(cond: &str, file: &str, line: u32, msg: &str) -> ConfigError {
    ConfigError(format!("{cond} INTERNAL ASSERT FAILED at \"/pytorch/{file}\":{line}, please report a bug to PyTorch. {msg}"))
}

const TOKENIZER_H: &str = "c10/core/AllocatorConfig.h";
const INDEX_OUT_OF_BOUNDS: &str = "Index out of bounds in ConfigTokenizer";
const NO_CLOSING_BRACKET: &str = "Expected closing bracket ']' in ConfigTokenizer but reached end of config";

// ---------------------------------------------------------------------------------------------
// ConfigTokenizer

/// `c10::CachingAllocator::ConfigTokenizer`: `,` `:` `[` `]` are tokens of their own, `isspace`
/// characters are dropped, everything else accumulates into a token.
struct Tokenizer {
    tokens: Vec<String>,
}

/// C `isspace` in the "C" locale.
fn is_c_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r')
}

impl Tokenizer {
    fn new(env: &str) -> Tokenizer {
        let mut tokens = Vec::new();
        let mut buf: Vec<u8> = Vec::new();
        for &b in env.as_bytes() {
            if matches!(b, b',' | b':' | b'[' | b']') {
                if !buf.is_empty() {
                    tokens.push(bytes_to_string(std::mem::take(&mut buf)));
                }
                tokens.push((b as char).to_string());
            } else if !is_c_space(b) {
                buf.push(b);
            }
        }
        if !buf.is_empty() {
            tokens.push(bytes_to_string(buf));
        }
        Tokenizer { tokens }
    }

    fn len(&self) -> usize {
        self.tokens.len()
    }

    /// `operator[]` (its own assert, line 55).
    fn at(&self, i: usize) -> Result<&str, ConfigError> {
        self.tokens.get(i).map(String::as_str).ok_or_else(|| internal_assert("i < config_.size()", TOKENIZER_H, 55, INDEX_OUT_OF_BOUNDS))
    }

    /// `checkIndex` (line 124); used by `checkToken`, `toSizeT`, `toDouble`, `toBool`, `skipKey`.
    fn check_index(&self, i: usize) -> Result<&str, ConfigError> {
        self.tokens.get(i).map(String::as_str).ok_or_else(|| internal_assert("i < config_.size()", TOKENIZER_H, 124, INDEX_OUT_OF_BOUNDS))
    }

    /// `checkToken(i, token)`: in 2.11 it returns whether token `i` is `token` and every caller
    /// ignores that; only the bounds check has an effect.
    fn check_token(&self, i: usize) -> Result<(), ConfigError> {
        self.check_index(i).map(|_| ())
    }

    fn to_size_t(&self, i: usize) -> Result<u64, ConfigError> {
        stoull(self.check_index(i)?)
    }

    fn to_double(&self, i: usize) -> Result<f64, ConfigError> {
        stod(self.check_index(i)?)
    }

    fn to_bool(&self, i: usize) -> Result<bool, ConfigError> {
        match self.check_index(i)? {
            "True" => Ok(true),
            "False" => Ok(false),
            token => Err(value_error(format!("Expected 'True' or 'False' at index {i} in ConfigTokenizer but got '{token}'"))),
        }
    }

    /// `skipKey(i)`: `i` is a key; returns the index of its value token, or of the `]` closing a
    /// list value.
    fn skip_key(&self, i: usize) -> Result<usize, ConfigError> {
        let mut i = i + 1;
        self.check_token(i)?;
        i += 1;
        if self.check_index(i)? != "[" {
            return Ok(i);
        }
        loop {
            i += 1;
            if i >= self.len() || self.tokens[i] == "]" {
                break;
            }
        }
        if i >= self.len() {
            return Err(internal_assert("i < config_.size()", TOKENIZER_H, 115, NO_CLOSING_BRACKET));
        }
        Ok(i)
    }
}

fn bytes_to_string(b: Vec<u8>) -> String {
    // Only ASCII bytes are ever removed from or split off a valid UTF-8 string.
    String::from_utf8(b).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

// ---------------------------------------------------------------------------------------------
// std::stoull / std::stod (libstdc++ over glibc strtoull / strtod)

/// `std::stoull(s)` (base 10): leading white space, an optional sign, then the longest run of
/// digits; the rest of the string is ignored. No digits → `std::invalid_argument("stoull")`;
/// overflow → `std::out_of_range("stoull")`. A `-` negates modulo 2^64, as `strtoull` does.
fn stoull(s: &str) -> Result<u64, ConfigError> {
    let b = s.as_bytes();
    let mut p = 0;
    while p < b.len() && is_c_space(b[p]) {
        p += 1;
    }
    let mut negative = false;
    if p < b.len() && (b[p] == b'+' || b[p] == b'-') {
        negative = b[p] == b'-';
        p += 1;
    }
    let start = p;
    let mut value: u64 = 0;
    let mut overflow = false;
    while p < b.len() && b[p].is_ascii_digit() {
        match value.checked_mul(10).and_then(|v| v.checked_add(u64::from(b[p] - b'0'))) {
            Some(v) => value = v,
            None => overflow = true,
        }
        p += 1;
    }
    if p == start {
        return Err(value_error("stoull")); // std::invalid_argument → Python ValueError
    }
    if overflow {
        return Err(value_error("stoull")); // std::out_of_range → Python IndexError
    }
    Ok(if negative { value.wrapping_neg() } else { value })
}

/// `std::stod(s)`: the longest prefix `strtod` accepts (decimal with optional exponent, hex float
/// `0x…p…`, `inf`/`infinity`, `nan`/`nan(…)`, with an optional sign). Nothing parsed →
/// `std::invalid_argument("stod")`; overflow to infinity or underflow (glibc's `ERANGE`: a non-zero
/// input whose result is zero or subnormal) → `std::out_of_range("stod")`.
fn stod(s: &str) -> Result<f64, ConfigError> {
    let invalid = || value_error("stod"); // std::invalid_argument → Python ValueError
    let out_of_range = || value_error("stod"); // std::out_of_range → Python IndexError
    let b = s.as_bytes();
    let mut p = 0;
    while p < b.len() && is_c_space(b[p]) {
        p += 1;
    }
    let mut negative = false;
    if p < b.len() && (b[p] == b'+' || b[p] == b'-') {
        negative = b[p] == b'-';
        p += 1;
    }
    let rest = &b[p..];
    let sign = if negative { -1.0 } else { 1.0 };
    let starts_with_ci = |word: &[u8]| rest.len() >= word.len() && rest[..word.len()].eq_ignore_ascii_case(word);
    if starts_with_ci(b"inf") {
        return Ok(sign * f64::INFINITY);
    }
    if starts_with_ci(b"nan") {
        return Ok(f64::NAN);
    }
    if rest.len() >= 2 && rest[0] == b'0' && (rest[1] | 0x20) == b'x' {
        if let Some((value, nonzero)) = parse_hex_float(&rest[2..]) {
            return finish_double(sign * value, nonzero).ok_or_else(out_of_range);
        }
        // "0x" with no hex digits: strtod reads the "0".
        return Ok(sign * 0.0);
    }
    // Decimal: digits [. digits] [e [sign] digits], at least one mantissa digit.
    let mut q = 0;
    let mut mantissa_digits = 0;
    let mut nonzero = false;
    while q < rest.len() && rest[q].is_ascii_digit() {
        nonzero |= rest[q] != b'0';
        q += 1;
        mantissa_digits += 1;
    }
    if q < rest.len() && rest[q] == b'.' {
        q += 1;
        while q < rest.len() && rest[q].is_ascii_digit() {
            nonzero |= rest[q] != b'0';
            q += 1;
            mantissa_digits += 1;
        }
    }
    if mantissa_digits == 0 {
        return Err(invalid());
    }
    if q < rest.len() && (rest[q] | 0x20) == b'e' {
        let mut r = q + 1;
        if r < rest.len() && (rest[r] == b'+' || rest[r] == b'-') {
            r += 1;
        }
        if r < rest.len() && rest[r].is_ascii_digit() {
            while r < rest.len() && rest[r].is_ascii_digit() {
                r += 1;
            }
            q = r;
        }
    }
    let text = std::str::from_utf8(&rest[..q]).map_err(|_| invalid())?;
    // Rust's parser needs a digit before the exponent's end and accepts "1." and ".5".
    let value: f64 = text.parse().map_err(|_| invalid())?;
    finish_double(sign * value, nonzero).ok_or_else(out_of_range)
}

/// `None` where glibc sets `ERANGE`.
fn finish_double(v: f64, nonzero_input: bool) -> Option<f64> {
    if v.is_infinite() || (nonzero_input && (v == 0.0 || v.abs() < f64::MIN_POSITIVE)) { None } else { Some(v) }
}

/// The part of a hex float after `0x`: hex digits [. hex digits] [p [sign] digits]. Returns the
/// value and whether any digit was non-zero, or `None` when there is no hex digit.
fn parse_hex_float(b: &[u8]) -> Option<(f64, bool)> {
    let mut q = 0;
    let mut mantissa: u64 = 0;
    let mut exp: i64 = 0;
    let mut digits = 0;
    let mut nonzero = false;
    let mut push = |d: u64, frac: bool, exp: &mut i64| {
        nonzero |= d != 0;
        if mantissa >> 56 == 0 {
            mantissa = mantissa << 4 | d;
            if frac {
                *exp -= 4;
            }
        } else if !frac {
            *exp += 4; // digits beyond 64 bits of precision only scale the integer part
        }
    };
    while q < b.len() && b[q].is_ascii_hexdigit() {
        push(hex_val(b[q]), false, &mut exp);
        q += 1;
        digits += 1;
    }
    if q < b.len() && b[q] == b'.' {
        q += 1;
        while q < b.len() && b[q].is_ascii_hexdigit() {
            push(hex_val(b[q]), true, &mut exp);
            q += 1;
            digits += 1;
        }
    }
    if digits == 0 {
        return None;
    }
    if q < b.len() && (b[q] | 0x20) == b'p' {
        let mut r = q + 1;
        let mut neg = false;
        if r < b.len() && (b[r] == b'+' || b[r] == b'-') {
            neg = b[r] == b'-';
            r += 1;
        }
        if r < b.len() && b[r].is_ascii_digit() {
            let mut e: i64 = 0;
            while r < b.len() && b[r].is_ascii_digit() {
                e = (e * 10 + i64::from(b[r] - b'0')).min(1 << 20);
                r += 1;
            }
            exp += if neg { -e } else { e };
        }
    }
    let exp = exp.clamp(-1 << 20, 1 << 20) as i32;
    let mut v = mantissa as f64;
    // Scale in steps so that intermediate powers of two stay finite.
    let mut e = exp;
    while e > 0 {
        let s = e.min(1000);
        v *= 2f64.powi(s);
        e -= s;
    }
    while e < 0 {
        let s = (-e).min(1000);
        v /= 2f64.powi(s);
        e += s;
    }
    Some((v, nonzero))
}

fn hex_val(c: u8) -> u64 {
    match c {
        b'0'..=b'9' => u64::from(c - b'0'),
        _ => u64::from((c | 0x20) - b'a' + 10),
    }
}

// ---------------------------------------------------------------------------------------------
// The load-time walk (process start only)

/// At library load the environment string is walked once more (the backend is chosen there);
/// a structural error (a key without value, an unclosed `[`) aborts the process there with
/// `skipKey`'s internal asserts, before any value is checked (measured on 2.11).
fn load_time_walk(t: &Tokenizer) -> Result<(), ConfigError> {
    let mut i = 0;
    while i < t.len() {
        i = t.skip_key(i)?;
        if i + 1 < t.len() {
            i += 1;
            t.check_token(i)?;
        }
        i += 1;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// AcceleratorAllocatorConfig::parseArgs

fn parse_generic(cfg: &mut AllocatorConfig, t: &Tokenizer, env: &str, later: LaterKeys) -> Result<(), ConfigError> {
    // Reset on every parse (measured: settings_runtime_reset, non_split_reset_runtime).
    cfg.max_split_size = u64::MAX;
    cfg.roundup_power2_divisions = [0; ROUNDUP_INTERVALS];
    cfg.garbage_collection_threshold = 0.0;
    // `last_allocator_settings_` is recorded before parsing, so also for a string that fails.
    cfg.source = env.to_string();

    // large_segment_size_mb first: the lower bounds of the other two sizes depend on it. Every
    // token is looked at, values included.
    let mut i = 0;
    while i < t.len() {
        if t.tokens[i] == "large_segment_size_mb" {
            i = parse_large_segment_size(cfg, t, i)?;
        }
        i += 1;
    }
    cfg.max_non_split_rounding_size = cfg.large_segment_size;

    let mut i = 0;
    while i < t.len() {
        let key = t.tokens[i].as_str();
        i = match key {
            "large_segment_size_mb" => t.skip_key(i)?,
            "max_split_size_mb" => {
                let (j, v) = parse_size_mb(cfg, t, i, "max_split_size_mb")?;
                cfg.max_split_size = v;
                j
            }
            "max_non_split_rounding_mb" => {
                let (j, v) = parse_size_mb(cfg, t, i, "max_non_split_rounding_mb")?;
                cfg.max_non_split_rounding_size = v;
                j
            }
            "garbage_collection_threshold" => {
                t.check_token(i + 1)?;
                let v = t.to_double(i + 2)?;
                if !(v > 0.0 && v < 1.0) {
                    return Err(value_error("garbage_collect_threshold is invalid, set it in (0.0, 1.0)"));
                }
                cfg.garbage_collection_threshold = v;
                i + 2
            }
            "roundup_power2_divisions" => parse_roundup_power2_divisions(cfg, t, i)?,
            "expandable_segments" => {
                t.check_token(i + 1)?;
                cfg.expandable_segments = t.to_bool(i + 2)?;
                i + 2
            }
            "pinned_use_background_threads" => {
                t.check_token(i + 1)?;
                cfg.pinned_use_background_threads = t.to_bool(i + 2)?;
                i + 2
            }
            // 2.13 (`parsePinnedMaxRoundThreshold`, `parsePinnedMaxCachedSize`): sizes in MB for
            // the pinned host allocator; their checks were not read (any `size_t` is taken).
            "pinned_max_round_threshold_mb" | "pinned_max_cached_size_mb" if later.v2_13 => {
                t.check_token(i + 1)?;
                let v = t.to_size_t(i + 2)?;
                if key == "pinned_max_round_threshold_mb" {
                    cfg.pinned_max_round_threshold_mb = Some(v);
                } else {
                    cfg.pinned_max_cached_size_mb = Some(v);
                }
                i + 2
            }
            _ => {
                // The CUDA hook is registered, so unknown keys are rejected here too.
                if !known_key(key, later) {
                    return Err(value_error(format!("Unrecognized key '{key}' in Accelerator allocator config.")));
                }
                t.skip_key(i)?
            }
        };
        if i + 1 < t.len() {
            i += 1;
            t.check_token(i)?; // the ',' (not compared)
        }
        i += 1;
    }
    Ok(())
}

fn parse_large_segment_size(cfg: &mut AllocatorConfig, t: &Tokenizer, i: usize) -> Result<usize, ConfigError> {
    t.check_token(i + 1)?;
    let v = t.to_size_t(i + 2)?;
    if v <= MIN_LARGE_SEGMENT_SIZE_MB {
        return Err(value_error(format!("CachingAllocator option large_segment_size_mb must be > {MIN_LARGE_SEGMENT_SIZE_MB} MB")));
    }
    cfg.large_segment_size = v.min(MAX_ALLOWED_MB) * MIB;
    Ok(i + 2)
}

/// `max_split_size_mb` / `max_non_split_rounding_mb`: at least `large_segment_size_mb`, clamped to
/// `SIZE_MAX / kMB`, stored in bytes.
fn parse_size_mb(cfg: &AllocatorConfig, t: &Tokenizer, i: usize, name: &str) -> Result<(usize, u64), ConfigError> {
    t.check_token(i + 1)?;
    let min_mb = cfg.large_segment_size / MIB;
    let v = t.to_size_t(i + 2)?;
    if v < min_mb {
        return Err(value_error(format!("CachingAllocator option {name} too small, must be >= {min_mb}")));
    }
    Ok((i + 2, v.min(MAX_ALLOWED_MB) * MIB))
}

/// `parseRoundUpPower2Divisions` (2.10+ `>` semantics: fills from the entry after the last
/// explicit one).
fn parse_roundup_power2_divisions(cfg: &mut AllocatorConfig, t: &Tokenizer, i: usize) -> Result<usize, ConfigError> {
    let divs = &mut cfg.roundup_power2_divisions;
    t.check_token(i + 1)?;
    let mut i = i + 2;
    if t.at(i)? != "[" {
        // Scalar form (kept for backwards compatibility): 0 is rejected here.
        let value = t.to_size_t(i)?;
        if !value.is_power_of_two() {
            return Err(value_error("For roundups, the divisions has to be power of 2 "));
        }
        divs.fill(value);
        return Ok(i);
    }
    let mut last_index = 0usize;
    let mut first_value = true;
    loop {
        i += 1;
        if i >= t.len() || t.tokens[i] == "]" {
            break;
        }
        let value_index = i;
        i += 1;
        t.check_token(i)?;
        i += 1;
        let value = t.to_size_t(i)?;
        if !(value == 0 || value.is_power_of_two()) {
            return Err(value_error("For roundups, the divisions has to be power of 2 or 0 to disable roundup "));
        }
        if t.tokens[value_index] == ">" {
            for d in divs.iter_mut().skip(last_index + 1) {
                *d = value;
            }
        } else {
            let boundary = t.to_size_t(value_index)?;
            if !boundary.is_power_of_two() {
                return Err(value_error("For roundups, the intervals have to be power of 2 "));
            }
            let index = (63 - boundary.leading_zeros() as usize).min(ROUNDUP_INTERVALS - 1);
            if first_value {
                divs[..index].fill(value);
                first_value = false;
            }
            divs[index] = value;
            last_index = index;
        }
        if t.at(i + 1)? != "]" {
            i += 1;
            t.check_token(i)?; // the ',' (not compared)
        }
    }
    if i >= t.len() {
        return Err(internal_assert("i < tokenizer.size()", "c10/core/AllocatorConfig.cpp", 185, NO_CLOSING_BRACKET));
    }
    Ok(i)
}

// ---------------------------------------------------------------------------------------------
// CUDAAllocatorConfig::parseArgs

fn parse_cuda(cfg: &mut AllocatorConfig, t: &Tokenizer, origin: Origin, later: LaterKeys) -> Result<(), ConfigError> {
    let mut i = 0;
    while i < t.len() {
        let key = t.tokens[i].as_str();
        i = match key {
            "backend" => {
                t.check_token(i + 1)?;
                let value = t.at(i + 2)?;
                if value != "native" && value != "cudaMallocAsync" {
                    return Err(value_error("Unknown allocator backend, options are native and cudaMallocAsync"));
                }
                let native = value == "native";
                match origin {
                    // The load-time backend is read from this same string.
                    Origin::Env => cfg.backend_native = native,
                    Origin::Runtime => {
                        if native != cfg.backend_native {
                            let loaded = if cfg.backend_native { "native" } else { "cudaMallocAsync" };
                            return Err(internal_assert(
                                "tokenizer[i] == get()->name()",
                                "c10/cuda/CUDAAllocatorConfig.cpp",
                                44,
                                &format!("Allocator backend parsed at runtime != allocator backend parsed at load time, {value} != {loaded}"),
                            ));
                        }
                    }
                }
                i + 2
            }
            "release_lock_on_hipmalloc" | "release_lock_on_cudamalloc" => {
                t.check_token(i + 1)?;
                cfg.release_lock_on_cudamalloc = t.to_bool(i + 2)?;
                i + 2
            }
            "pinned_use_hip_host_register" | "pinned_use_cuda_host_register" => {
                t.check_token(i + 1)?;
                cfg.pinned_use_cuda_host_register = t.to_bool(i + 2)?;
                i + 2
            }
            "pinned_num_register_threads" => {
                t.check_token(i + 1)?;
                let v = t.to_size_t(i + 2)?;
                if !v.is_power_of_two() {
                    return Err(value_error(format!("Number of register threads has to be power of 2, got {v}")));
                }
                if v > PINNED_MAX_REGISTER_THREADS {
                    return Err(value_error(format!("Number of register threads should be less than or equal to {PINNED_MAX_REGISTER_THREADS}, got {v}")));
                }
                cfg.pinned_num_register_threads = v;
                i + 2
            }
            "pinned_reserve_segment_size_mb" => {
                t.check_token(i + 1)?;
                let v = t.to_size_t(i + 2)?;
                if v == 0 {
                    return Err(value_error("Pinned reserve segment size has to be greater than 0"));
                }
                cfg.pinned_reserve_segment_size_mb = v;
                i + 2
            }
            "graph_capture_record_stream_reuse" => {
                t.check_token(i + 1)?;
                cfg.graph_capture_record_stream_reuse = t.to_bool(i + 2)?;
                i + 2
            }
            "per_process_memory_fraction" => {
                t.check_token(i + 1)?;
                let v = t.to_double(i + 2)?;
                // NaN fails too, as in C++.
                if !(0.0..=1.0).contains(&v) {
                    return Err(value_error("per_process_memory_fraction is invalid, set it in [0.0, 1.0]"));
                }
                cfg.per_process_memory_fraction = Some(v);
                i + 2
            }
            // 2.12 (`parsePinnedFreeCatchAll`, `parseThrowOnCudaMallocOom`): booleans.
            "pinned_free_catch_all" | "throw_on_cudamalloc_oom" if later.v2_12 => {
                t.check_token(i + 1)?;
                let v = t.to_bool(i + 2)?;
                if key == "throw_on_cudamalloc_oom" {
                    cfg.throw_on_cudamalloc_oom = v;
                } else {
                    cfg.pinned_free_catch_all = v;
                }
                i + 2
            }
            // 2.15 (`parseExpandableSegmentsReserve`): an invalid value is ignored (PyTorch warns).
            "expandable_segments_reserve" if later.v2_15 => {
                t.check_token(i + 1)?;
                if let Some(spec) = ReserveSpec::parse(t.check_index(i + 2)?) {
                    cfg.expandable_segments_reserve = Some(spec);
                }
                i + 2
            }
            // 2.15 (`parseExpandableSegmentsReserveByClass`): `[name:value,...]`, a malformed
            // entry skipped; the map replaces the previous one.
            "expandable_segments_reserve_by_class" if later.v2_15 => {
                t.check_token(i + 1)?;
                let mut j = i + 2;
                if t.check_index(j)? != "[" {
                    return Err(value_error(format!("Expected '[' at index {j} in ConfigTokenizer but got '{}'", t.tokens[j])));
                }
                let mut parsed: Vec<(String, ReserveSpec)> = Vec::new();
                while t.check_index(j + 1)? != "]" {
                    j += 1;
                    let name = t.tokens[j].clone();
                    j += 1;
                    t.check_token(j)?;
                    j += 1;
                    if let Some(spec) = ReserveSpec::parse(t.check_index(j)?) {
                        parsed.retain(|(n, _)| *n != name);
                        parsed.push((name, spec));
                    }
                    if t.check_index(j + 1)? == "," {
                        j += 1;
                    }
                }
                cfg.expandable_segments_reserve_by_class = parsed;
                j + 1
            }
            _ => {
                if !known_key(key, later) {
                    return Err(value_error(format!("Unrecognized key '{key}' in CUDA allocator config.")));
                }
                t.skip_key(i)?
            }
        };
        if i + 1 < t.len() {
            i += 1;
            t.check_token(i)?; // the ',' (not compared)
        }
        i += 1;
    }
    Ok(())
}
