//! PyTorch's `format_size` and the text of its CUDA out-of-memory error (2.11).

use crate::allocator::OutOfMemory;

/// `format_size`: bytes up to 1024, then KiB, MiB, GiB with two decimals.
pub fn format_size(size: u64) -> String {
    if size <= 1024 {
        format!("{size} bytes")
    } else if size <= 1048576 {
        format!("{:.2} KiB", size as f64 / 1024.0)
    } else if size <= 1073741824 {
        format!("{:.2} MiB", size as f64 / 1048576.0)
    } else {
        format!("{:.2} GiB", size as f64 / 1073741824.0)
    }
}

/// The message of `torch.OutOfMemoryError`, as PyTorch 2.11 builds it. `proc_info` is NVML's
/// per-process line (`"Including non-PyTorch memory, this process has X memory in use. "`), which
/// a simulator cannot know unless the caller supplies it.
pub fn oom_message(oom: &OutOfMemory, device_index: i32, proc_info: &str) -> String {
    if oom.preemptive {
        // 2.12+ `throw_on_cudamalloc_oom`: the message's beginning as the 2.12 wheel holds it;
        // what follows "Requested size: " was not read (allocsim gives the segment size).
        return format!(
            "CUDA out of memory. Allocation was preemptively rejected because it would exceed per_process_memory_fraction limit. Requested size: {}",
            format_size(oom.alloc_size)
        );
    }
    let allowed_info = oom.allowed_memory_maximum.map(|a| format!("{} allowed; ", format_size(a))).unwrap_or_default();
    let private_msg = if oom.allocated_in_private_pools > 0 {
        format!("with {} allocated in private pools (e.g., CUDA Graphs), ", format_size(oom.allocated_in_private_pools))
    } else {
        String::new()
    };
    format!(
        "CUDA out of memory. Tried to allocate {}. GPU {} has a total capacity of {} of which {} is free. {}{}Of the allocated memory {} is allocated by PyTorch, {}and {} is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)",
        format_size(oom.alloc_size),
        device_index,
        format_size(oom.device_total),
        format_size(oom.device_free),
        proc_info,
        allowed_info,
        format_size(oom.allocated_bytes + oom.allocated_in_private_pools),
        private_msg,
        format_size(oom.reserved_bytes - oom.allocated_bytes - oom.allocated_in_private_pools),
    )
}
