//! The allocator's constants (`c10/core/AllocatorConfig.h` in 2.11).

/// All sizes are rounded to multiples of this (`kMinBlockSize`).
pub const K_MIN_BLOCK_SIZE: u64 = 512;
/// Largest rounded size served by the small pool, inclusive (`kSmallSize`).
pub const K_SMALL_SIZE: u64 = 1 << 20;
/// Small-pool segment size and small expandable page (`kSmallBuffer`).
pub const K_SMALL_BUFFER: u64 = 2 << 20;
/// Rounded sizes below this get a `large_segment_size` segment (`kMinLargeAlloc`).
pub const K_MIN_LARGE_ALLOC: u64 = 10 << 20;
/// Larger requests get segments rounded to this (`kRoundLarge`).
pub const K_ROUND_LARGE: u64 = 2 << 20;
/// Default large segment / large expandable page (`kLargeBuffer`).
pub const K_LARGE_BUFFER: u64 = 20 << 20;
/// Number of `roundup_power2_divisions` intervals.
pub const ROUNDUP_INTERVALS: usize = 16;
pub const MIB: u64 = 1 << 20;
/// The H200 the reference traces were recorded on (`totalGlobalMem`).
pub const H200_TOTAL_MEMORY: u64 = 150_109_880_320;
