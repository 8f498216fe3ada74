//! Allocator settings (`PYTORCH_CUDA_ALLOC_CONF`), PyTorch 2.11: `c10/core/AllocatorConfig.cpp` and
//! `c10/cuda/CUDAAllocatorConfig.cpp`, plus the size rules that depend on them (`round_size`,
//! `get_allocation_size`).

use crate::constants::*;

/// The settings that change allocator decisions, as the allocator holds them after parsing.
#[derive(Clone, Debug, PartialEq)]
pub struct AllocatorConfig {
    /// `max_split_size_mb` in bytes; `u64::MAX` = unlimited (PyTorch's SIZE_MAX, shown as −1 in stats).
    pub max_split_size: u64,
    /// `max_non_split_rounding_mb` in bytes (default = `large_segment_size`).
    pub max_non_split_rounding_size: u64,
    /// `roundup_power2_divisions`: one entry per interval (index 0: < 2 MiB, i: [2^i, 2^(i+1)) MiB, 15: ≥ 32 GiB).
    pub roundup_power2_divisions: [u64; ROUNDUP_INTERVALS],
    /// `garbage_collection_threshold`; 0 = off.
    pub garbage_collection_threshold: f64,
    pub expandable_segments: bool,
    /// `large_segment_size_mb` in bytes (2.11; default kLargeBuffer = 20 MiB).
    pub large_segment_size: u64,
    /// `per_process_memory_fraction` (2.10+), applied when the device allocator is created.
    pub per_process_memory_fraction: Option<f64>,
    pub release_lock_on_cudamalloc: bool,
    pub graph_capture_record_stream_reuse: bool,
    pub pinned_use_cuda_host_register: bool,
    pub pinned_num_register_threads: u64,
    pub pinned_use_background_threads: bool,
    pub pinned_reserve_segment_size_mb: u64,
    /// `backend` (`native` or `cudaMallocAsync`).
    pub backend_native: bool,
    /// `throw_on_cudamalloc_oom` (2.12+): with an allowed maximum, a request whose new segment
    /// would exceed it is refused before the driver is called, without the retry chain.
    pub throw_on_cudamalloc_oom: bool,
    /// `pinned_free_catch_all` (2.12+; the pinned host allocator only).
    pub pinned_free_catch_all: bool,
    /// `pinned_max_round_threshold_mb`, `pinned_max_cached_size_mb` (2.13+; the pinned host
    /// allocator only), in MB as given.
    pub pinned_max_round_threshold_mb: Option<u64>,
    pub pinned_max_cached_size_mb: Option<u64>,
    /// `expandable_segments_reserve` (2.15+): the address space each new expandable segment
    /// reserves, when valid (an invalid value is ignored with a warning, as PyTorch does).
    pub expandable_segments_reserve: Option<ReserveSpec>,
    /// `expandable_segments_reserve_by_class` (2.15+): reserves of named stream classes. Streams
    /// are put in a class at run time (`setExpandableSegmentReserveClassForStream`), which a
    /// snapshot does not record: kept, not applied.
    pub expandable_segments_reserve_by_class: Vec<(String, ReserveSpec)>,
    /// The string these settings were parsed from (`allocator_settings["PYTORCH_CUDA_ALLOC_CONF"]`).
    pub source: String,
}

impl Default for AllocatorConfig {
    fn default() -> Self {
        AllocatorConfig {
            max_split_size: u64::MAX,
            max_non_split_rounding_size: K_LARGE_BUFFER,
            roundup_power2_divisions: [0; ROUNDUP_INTERVALS],
            garbage_collection_threshold: 0.0,
            expandable_segments: false,
            large_segment_size: K_LARGE_BUFFER,
            per_process_memory_fraction: None,
            release_lock_on_cudamalloc: false,
            graph_capture_record_stream_reuse: false,
            pinned_use_cuda_host_register: false,
            pinned_num_register_threads: 1,
            pinned_use_background_threads: false,
            pinned_reserve_segment_size_mb: 0,
            backend_native: true,
            throw_on_cudamalloc_oom: false,
            pinned_free_catch_all: false,
            pinned_max_round_threshold_mb: None,
            pinned_max_cached_size_mb: None,
            expandable_segments_reserve: None,
            expandable_segments_reserve_by_class: Vec::new(),
            source: String::new(),
        }
    }
}

/// An `expandable_segments_reserve` value (2.15, `ExpandableSegmentReserveSpec`): a fraction of
/// the device's memory (`0.5`), or GiB (`40G`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReserveSpec {
    pub is_fraction: bool,
    pub value: f64,
}

impl ReserveSpec {
    /// `resolveBytes(total_global_mem)`: the bytes, saturating at `SIZE_MAX`.
    pub fn resolve_bytes(&self, total: u64) -> u64 {
        let bytes = if self.is_fraction { self.value * total as f64 } else { self.value * (1u64 << 30) as f64 };
        if bytes >= u64::MAX as f64 { u64::MAX } else { bytes as u64 }
    }

    /// `parseReserveSpec(token)`: a trailing `G`/`g` means GiB, else a fraction; the number must
    /// parse whole, be finite and positive, else `None` (PyTorch warns and keeps its default).
    pub fn parse(token: &str) -> Option<ReserveSpec> {
        let gib = token.ends_with(['G', 'g']);
        let num = if gib { &token[..token.len() - 1] } else { token };
        // `istringstream >> double` in the C locale, then `eof()`: the whole token is the number.
        let ok = !num.is_empty() && num.bytes().all(|b| b.is_ascii_digit() || matches!(b, b'.' | b'e' | b'E' | b'+' | b'-'));
        let value: f64 = if ok { num.parse().ok()? } else { return None };
        (value.is_finite() && value > 0.0).then_some(ReserveSpec { is_fraction: !gib, value })
    }
}

/// Which keys a release line accepts beyond 2.11's (the parsers are otherwise 2.11's).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LaterKeys {
    /// 2.12+: `throw_on_cudamalloc_oom`, `pinned_free_catch_all`.
    pub v2_12: bool,
    /// 2.13+: `pinned_max_round_threshold_mb`, `pinned_max_cached_size_mb`.
    pub v2_13: bool,
    /// 2.15+: `expandable_segments_reserve`, `expandable_segments_reserve_by_class`.
    pub v2_15: bool,
}

/// A settings string PyTorch would refuse. The message is PyTorch's C++ message, without the Python
/// exception type (`ValueError: `) that Python puts before it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

impl AllocatorConfig {
    /// Parses a `PYTORCH_CUDA_ALLOC_CONF` string onto the defaults, as at process start.
    pub fn parse(conf: &str) -> Result<AllocatorConfig, ConfigError> {
        AllocatorConfig::parse_with(conf, LaterKeys::default())
    }

    /// [`AllocatorConfig::parse`] accepting the keys of a later release (`later`).
    pub fn parse_with(conf: &str, later: LaterKeys) -> Result<AllocatorConfig, ConfigError> {
        let mut c = AllocatorConfig::default();
        crate::config_parse::apply_env(&mut c, conf, later)?;
        Ok(c)
    }

    /// The `max_split_size` a snapshot's `allocator_settings` records for the settings string
    /// `conf` (the allocator's `size_t`, so `SIZE_MAX` reads as −1); `None` where `conf` is refused.
    pub fn recorded_max_split_size(conf: &str) -> Option<i64> {
        AllocatorConfig::parse(conf).ok().map(|c| c.max_split_size as i64)
    }

    /// Re-parses a full settings string onto the current settings, as `_set_allocator_settings` does:
    /// `max_split_size`, `roundup_power2_divisions`, `garbage_collection_threshold` and
    /// `max_non_split_rounding_size` are reset first; other keys keep their value when absent.
    pub fn apply(&mut self, conf: &str) -> Result<(), ConfigError> {
        crate::config_parse::apply_runtime(self, conf, LaterKeys::default())
    }

    /// [`AllocatorConfig::apply`] accepting the keys of a later release (`later`).
    pub fn apply_with(&mut self, conf: &str, later: LaterKeys) -> Result<(), ConfigError> {
        crate::config_parse::apply_runtime(self, conf, later)
    }

    /// The address space a new expandable segment reserves on a device of `total` bytes, in
    /// pages of `segment_size`: `1.125 × total` rounded up to pages (`numSegments`), or (2.15)
    /// `expandable_segments_reserve` where it is smaller (`clamp_reserve_bytes`), at least one
    /// page.
    pub fn expandable_reservation_pages(&self, total: u64, segment_size: u64) -> u64 {
        let full = total + total / 8;
        let bytes = match self.expandable_segments_reserve {
            Some(r) => r.resolve_bytes(total).min(full),
            None => full,
        };
        bytes.div_ceil(segment_size).max(1)
    }

    /// `roundup_power2_divisions(size)`: the divisions of the interval `size` falls in.
    pub fn roundup_power2_divisions_for(&self, size: u64) -> u64 {
        let log = 63 - size.max(1).leading_zeros() as u64;
        let index = log.saturating_sub(20);
        self.roundup_power2_divisions[index.min(ROUNDUP_INTERVALS as u64 - 1) as usize]
    }

    /// `round_size`: every request is rounded to at least 512 bytes and a multiple of 512, or to the
    /// next power-of-two division when `roundup_power2_divisions` applies.
    pub fn round_size(&self, size: u64) -> u64 {
        if size < K_MIN_BLOCK_SIZE {
            return K_MIN_BLOCK_SIZE;
        }
        let divisions = self.roundup_power2_divisions_for(size);
        if divisions > 1 && size > K_MIN_BLOCK_SIZE.wrapping_mul(divisions) {
            roundup_power2_next_division(size, divisions)
        } else {
            K_MIN_BLOCK_SIZE * size.div_ceil(K_MIN_BLOCK_SIZE)
        }
    }

    /// `get_allocation_size`: the size of the segment cudaMalloc'd for a rounded request.
    pub fn get_allocation_size(&self, rounded: u64) -> u64 {
        if rounded <= K_SMALL_SIZE {
            K_SMALL_BUFFER
        } else if rounded < K_MIN_LARGE_ALLOC {
            self.large_segment_size
        } else {
            K_ROUND_LARGE * rounded.div_ceil(K_ROUND_LARGE)
        }
    }

    /// Garbage collection runs only with a threshold and a memory fraction (`allowed_memory_maximum`).
    pub fn gc_enabled(&self) -> bool {
        self.garbage_collection_threshold > 0.0
    }
}

/// `roundup_power2_next_division(size, divisions)`.
pub fn roundup_power2_next_division(size: u64, divisions: u64) -> u64 {
    if size.is_power_of_two() {
        return size;
    }
    let floor = 1u64 << (63 - size.leading_zeros());
    let log2_div = 63 - divisions.leading_zeros();
    let step = floor >> log2_div;
    if step == 0 {
        return 2 * floor;
    }
    let f = size & !(step - 1);
    if f == size { size } else { f + step }
}
