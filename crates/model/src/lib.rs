//! allocsim-model: PyTorch's CUDA caching allocator (`DeviceCachingAllocator`, 2.11), as a pure model.
pub mod config;
mod config_parse;
pub mod constants;
