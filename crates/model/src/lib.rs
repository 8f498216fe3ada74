//! allocsim-model: PyTorch's CUDA caching allocator (`DeviceCachingAllocator`, 2.11), as a pure
//! model with no I/O. See `ARCHITECTURE.md` at the repository root.
//!
//! * [`config`]: `PYTORCH_CUDA_ALLOC_CONF` and the size rules (`round_size`, `get_allocation_size`).
//! * [`allocator`]: the allocator itself ([`CachingAllocator`]).
//! * [`device`]: the device trait and the simulated device ([`SimDevice`]) with its address placements.
//! * [`stats`]: the counters of `memory_stats()`.
//! * [`format`]: PyTorch's `format_size` and OOM message.
pub mod allocator;
pub mod config;
mod config_parse;
pub mod constants;
pub mod device;
pub mod flat_hash_map;
pub mod format;
pub mod free_set;
pub mod stats;

pub use allocator::{BlockId, CachingAllocator, Event, EventKind, OutOfMemory, PoolFilter, Route};
pub use config::{AllocatorConfig, ConfigError, LaterKeys, ReserveSpec};
pub use device::{Device, Placement, SimDevice};
pub use stats::DeviceStats;
