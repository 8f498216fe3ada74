//! Large buffers backed by transparent huge pages where the kernel offers them.

/// An empty vector with room for `capacity` elements, whose memory the kernel is asked to back
/// with transparent huge pages (`madvise(MADV_HUGEPAGE)`): filling a vector of tens of MiB then
/// takes a few page faults of 2 MiB rather than thousands of 4 KiB. Only the pages written are
/// ever backed; where the advice is not available the vector is an ordinary one.
pub fn huge_vec<T>(capacity: usize) -> Vec<T> {
    let v: Vec<T> = Vec::with_capacity(capacity);
    #[cfg(target_os = "linux")]
    {
        let bytes = capacity.saturating_mul(std::mem::size_of::<T>());
        const HUGE: usize = 2 << 20;
        if bytes >= 2 * HUGE {
            let start = v.as_ptr() as usize;
            let aligned = start.next_multiple_of(4096);
            let len = (start + bytes - aligned) & !4095;
            // SAFETY: the range lies inside the vector's own allocation; MADV_HUGEPAGE changes
            // only how the kernel backs it, never its contents.
            unsafe {
                libc::madvise(aligned as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
            }
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::huge_vec;

    #[test]
    fn a_huge_vec_holds_its_capacity_without_moving() {
        let mut v: Vec<u64> = huge_vec(1 << 20);
        assert!(v.is_empty() && v.capacity() >= 1 << 20);
        let at = v.as_ptr();
        v.extend((0..1u64 << 20).map(|i| i * 3));
        assert_eq!(v.as_ptr(), at);
        assert_eq!(v[12345], 12345 * 3);
        assert_eq!(v.len(), 1 << 20);
        let small: Vec<u8> = huge_vec(10);
        assert!(small.capacity() >= 10);
    }
}
