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
            source: String::new(),
        }
    }
}

/// A settings string PyTorch would refuse. The message is PyTorch's C++ message, without the Python
/// exception type (`ValueError: `) that Python puts before it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

impl AllocatorConfig {
    /// Parses a `PYTORCH_CUDA_ALLOC_CONF` string onto the defaults, as at process start.
    pub fn parse(conf: &str) -> Result<AllocatorConfig, ConfigError> {
        let mut c = AllocatorConfig::default();
        crate::config_parse::apply_env(&mut c, conf)?;
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
        crate::config_parse::apply_runtime(self, conf)
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
