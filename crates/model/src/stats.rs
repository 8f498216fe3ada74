//! `torch.cuda.memory_stats()`: `Stat`, `StatArray` and `DeviceStats`
//! (`c10/core/CachingDeviceAllocator.h` in 2.11).

use std::collections::BTreeMap;

/// One statistic: `current`, `peak`, `allocated` (sum of increases), `freed` (sum of decreases).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stat {
    pub current: i64,
    pub peak: i64,
    pub allocated: i64,
    pub freed: i64,
}

impl Stat {
    #[inline]
    pub fn increase(&mut self, amount: u64) {
        self.current += amount as i64;
        self.peak = self.peak.max(self.current);
        self.allocated += amount as i64;
    }
    #[inline]
    pub fn decrease(&mut self, amount: u64) {
        self.current -= amount as i64;
        self.freed += amount as i64;
    }
    pub fn reset_peak(&mut self) {
        self.peak = self.current;
    }
}

/// Which pool a statistic is kept for, besides the aggregate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatType {
    Aggregate = 0,
    SmallPool = 1,
    LargePool = 2,
}

/// `all`, `small_pool`, `large_pool`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatArray(pub [Stat; 3]);

impl StatArray {
    /// Increases the aggregate and the pool's stat (`for_each_selected_stat_type`).
    #[inline]
    pub fn increase(&mut self, small: bool, amount: u64) {
        self.0[0].increase(amount);
        self.0[if small { 1 } else { 2 }].increase(amount);
    }
    #[inline]
    pub fn decrease(&mut self, small: bool, amount: u64) {
        self.0[0].decrease(amount);
        self.0[if small { 1 } else { 2 }].decrease(amount);
    }
    pub fn all(&self) -> &Stat {
        &self.0[0]
    }
}

/// Every statistic of `memory_stats()` for one device.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceStats {
    pub allocation: StatArray,
    pub segment: StatArray,
    pub active: StatArray,
    pub inactive_split: StatArray,
    pub allocated_bytes: StatArray,
    pub reserved_bytes: StatArray,
    pub active_bytes: StatArray,
    pub inactive_split_bytes: StatArray,
    pub requested_bytes: StatArray,
    pub oversize_allocations: Stat,
    pub oversize_segments: Stat,
    pub num_alloc_retries: i64,
    pub num_ooms: i64,
    pub num_sync_all_streams: i64,
    pub num_device_alloc: i64,
    pub num_device_free: i64,
    /// `num_oom_rejections` (2.12+): requests `throw_on_cudamalloc_oom` refused.
    pub num_oom_rejections: i64,
    /// `max_split_size` at allocator construction; −1 = unlimited.
    pub max_split_size: i64,
}

impl DeviceStats {
    /// `reset_peak_memory_stats()`.
    pub fn reset_peak(&mut self) {
        for a in [
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
        ] {
            for s in a.0.iter_mut() {
                s.reset_peak();
            }
        }
        self.oversize_allocations.reset_peak();
        self.oversize_segments.reset_peak();
    }

    /// The flat dictionary `torch.cuda.memory_stats()` returns, with PyTorch's key names.
    pub fn to_memory_stats(&self) -> BTreeMap<String, i64> {
        let mut m = BTreeMap::new();
        let arrays: [(&str, &StatArray); 9] = [
            ("allocation", &self.allocation),
            ("segment", &self.segment),
            ("active", &self.active),
            ("inactive_split", &self.inactive_split),
            ("allocated_bytes", &self.allocated_bytes),
            ("reserved_bytes", &self.reserved_bytes),
            ("active_bytes", &self.active_bytes),
            ("inactive_split_bytes", &self.inactive_split_bytes),
            ("requested_bytes", &self.requested_bytes),
        ];
        for (name, arr) in arrays {
            for (pool, s) in ["all", "small_pool", "large_pool"].iter().zip(arr.0.iter()) {
                put_stat(&mut m, &format!("{name}.{pool}"), s);
            }
        }
        put_stat(&mut m, "oversize_allocations", &self.oversize_allocations);
        put_stat(&mut m, "oversize_segments", &self.oversize_segments);
        m.insert("num_alloc_retries".into(), self.num_alloc_retries);
        m.insert("num_ooms".into(), self.num_ooms);
        m.insert("num_sync_all_streams".into(), self.num_sync_all_streams);
        m.insert("num_device_alloc".into(), self.num_device_alloc);
        m.insert("num_device_free".into(), self.num_device_free);
        m.insert("max_split_size".into(), self.max_split_size);
        // 2.12+ has the key always; 2.11 has none, so it is shown only once it counts something.
        if self.num_oom_rejections != 0 {
            m.insert("num_oom_rejections".into(), self.num_oom_rejections);
        }
        m
    }
}

fn put_stat(m: &mut BTreeMap<String, i64>, prefix: &str, s: &Stat) {
    m.insert(format!("{prefix}.current"), s.current);
    m.insert(format!("{prefix}.peak"), s.peak);
    m.insert(format!("{prefix}.allocated"), s.allocated);
    m.insert(format!("{prefix}.freed"), s.freed);
}
