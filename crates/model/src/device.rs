//! The device under the allocator: `cudaMalloc`/`cudaFree`, the virtual-memory calls of expandable
//! segments, and `cudaMemGetInfo`. [`SimDevice`] simulates one; the `cuda` backend drives a real GPU.

use std::collections::BTreeMap;

/// What the allocator asks of the device. Addresses are chosen by the device (the driver), which is
/// why a simulated device takes a [`Placement`].
pub trait Device {
    /// `cudaMalloc(size)`: `None` when the device is out of memory.
    fn malloc(&mut self, size: u64) -> Option<u64>;
    /// `cudaFree(ptr)` of a segment of `size` bytes.
    fn free(&mut self, ptr: u64, size: u64);
    /// `cuMemAddressReserve(size)` for a new expandable segment: its base address.
    fn reserve(&mut self, size: u64) -> u64;
    /// `cuMemAddressFree` of a whole reservation.
    fn release_reservation(&mut self, base: u64, size: u64);
    /// `cuMemCreate` + `cuMemMap` + `cuMemSetAccess` of `size` bytes (whole pages) at `ptr`:
    /// false when the device is out of memory (nothing stays mapped).
    fn map(&mut self, ptr: u64, size: u64) -> bool;
    /// `cuMemUnmap` + `cuMemRelease` of `size` bytes at `ptr`.
    fn unmap(&mut self, ptr: u64, size: u64);
    /// `cudaMemGetInfo`: (free, total).
    fn mem_get_info(&self) -> (u64, u64);
    /// Device memory held outside this allocator from now on (the CUDA context, other processes,
    /// library workspaces): what `malloc` and `map` can get is the total less this and less what
    /// the allocator holds. A real device knows its own; the default ignores it.
    fn set_outside_memory(&mut self, _bytes: u64) {}
}

/// How a simulated device chooses the address of a new segment.
#[derive(Clone, Debug)]
pub enum Placement {
    /// Addresses taken from a recorded run: a new segment of size S gets the address of the earliest
    /// recorded `segment_alloc` of size S not yet given out whose range no live segment occupies
    /// (so a run that makes the recorded run's cudaMallocs gets its addresses one for one); a new
    /// expandable reservation gets the next recorded reservation base. Falls back to fresh
    /// addresses above all recorded ones.
    Recorded { segments: Vec<(u64, u64)>, reservations: Vec<u64> },
    /// Every new segment above all earlier ones (a bump pointer; freed ranges are never reused).
    Ascending,
    /// Every new segment below all earlier ones.
    Descending,
    /// The lowest free range that fits (freed ranges are reused).
    LowestFit,
    /// A seeded pseudo-random free range.
    Random(u64),
}

const VA_BASE: u64 = 0x7f00_0000_0000;
const VA_ALIGN: u64 = 2 << 20;

/// The first fresh address for segments placed past the recorded ones: aligned, and a gap above
/// the highest recorded address `top`.
fn fresh_above(top: u64) -> u64 {
    top.div_ceil(VA_ALIGN).saturating_mul(VA_ALIGN).saturating_add(1 << 40)
}

/// Whether `[addr, addr + size)` overlaps a live range.
fn occupied(live: &BTreeMap<u64, u64>, addr: u64, size: u64) -> bool {
    let end = addr.saturating_add(size);
    match live.range(..end).next_back() {
        Some((_, &e)) => e > addr,
        None => false,
    }
}

/// A simulated GPU: `total` bytes of memory, of which `outside` are held outside the allocator
/// (changing over time as the caller says), and a placement policy for addresses.
#[derive(Clone, Debug)]
pub struct SimDevice {
    total: u64,
    used: u64,
    outside: u64,
    placement: Placement,
    /// Live address ranges (segments and reservations): start → end.
    live: BTreeMap<u64, u64>,
    /// Recorded addresses by size, in recorded order, and whether each was given out; with the
    /// index before which all were given out.
    recorded_by_size: std::collections::HashMap<u64, (Vec<(u64, bool)>, usize)>,
    next_reservation: usize,
    bump_up: u64,
    bump_down: u64,
    rng: u64,
    /// [`Placement::Recorded`]: segments and reservations placed past the recorded addresses.
    recorded_misses: u64,
}

impl SimDevice {
    pub fn new(total: u64, placement: Placement) -> SimDevice {
        let mut recorded_by_size: std::collections::HashMap<u64, (Vec<(u64, bool)>, usize)> = Default::default();
        let mut top = VA_BASE;
        let mut rng = 0x9e37_79b9_7f4a_7c15;
        match &placement {
            Placement::Recorded { segments, reservations } => {
                for &(addr, size) in segments {
                    recorded_by_size.entry(size).or_default().0.push((addr, false));
                    top = top.max(addr.saturating_add(size));
                }
                for &b in reservations {
                    top = top.max(b.saturating_add(1 << 40));
                }
            }
            Placement::Random(seed) => rng ^= seed.wrapping_mul(0x2545_f491_4f6c_dd1d),
            _ => {}
        }
        let bump_up = fresh_above(top);
        SimDevice {
            total,
            used: 0,
            outside: 0,
            placement,
            live: BTreeMap::new(),
            recorded_by_size,
            next_reservation: 0,
            bump_up,
            bump_down: bump_up + (1 << 46),
            rng,
            recorded_misses: 0,
        }
    }

    /// [`Placement::Recorded`]: more recorded addresses, after those it has (for a replay that
    /// learns them as it goes). A lookup that finds an address among the first addresses of the
    /// list finds the same one when the list is longer, so a replay that never misses
    /// ([`SimDevice::recorded_misses`]) places every segment as it would knowing the whole list.
    pub fn extend_recorded(&mut self, segments: &[(u64, u64)], reservations: &[u64]) {
        if let Placement::Recorded { segments: all_segments, reservations: all_reservations } = &mut self.placement {
            let mut top = self.bump_up;
            for &(addr, size) in segments {
                self.recorded_by_size.entry(size).or_default().0.push((addr, false));
                top = top.max(addr.saturating_add(size));
            }
            for &b in reservations {
                top = top.max(b.saturating_add(1 << 40));
            }
            all_segments.extend_from_slice(segments);
            all_reservations.extend_from_slice(reservations);
            // Fresh addresses stay above every recorded one, learned before or now (as `new`
            // puts them): a segment placed past the list never takes a range a recorded
            // segment placed later would take too.
            if top > self.bump_up {
                self.bump_up = fresh_above(top);
            }
        }
    }

    /// [`Placement::Recorded`]: how many segments and reservations were placed past the
    /// recorded addresses (none left of their size, or all occupied).
    pub fn recorded_misses(&self) -> u64 {
        self.recorded_misses
    }

    pub fn total(&self) -> u64 {
        self.total
    }
    pub fn used(&self) -> u64 {
        self.used
    }
    /// Bytes held outside the allocator ([`Device::set_outside_memory`]).
    pub fn outside(&self) -> u64 {
        self.outside
    }
    /// Whether `size` more bytes fit beside what the allocator and others hold.
    fn fits(&self, size: u64) -> bool {
        self.used.saturating_add(self.outside).saturating_add(size) <= self.total
    }

    fn occupied(&self, addr: u64, size: u64) -> bool {
        occupied(&self.live, addr, size)
    }

    fn lowest_fit(&self, size: u64, from: u64) -> u64 {
        let mut cand = from;
        for (&s, &e) in self.live.range(..) {
            if e <= cand {
                continue;
            }
            if s >= cand.saturating_add(size) {
                break;
            }
            cand = e.div_ceil(VA_ALIGN) * VA_ALIGN;
        }
        cand
    }

    fn next_rand(&mut self) -> u64 {
        // splitmix64
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn place(&mut self, size: u64) -> u64 {
        let addr = match &self.placement {
            Placement::Recorded { .. } => {
                // Entries given out stay given out: skip the leading ones for good, so that many
                // segments of one size cost one step each rather than a scan from the start.
                let found = self.recorded_by_size.get_mut(&size).and_then(|(v, first)| {
                    while *first < v.len() && v[*first].1 {
                        *first += 1;
                    }
                    (*first..v.len()).find(|&i| !v[i].1 && !occupied(&self.live, v[i].0, size))
                });
                match found {
                    Some(i) => {
                        let e = &mut self.recorded_by_size.get_mut(&size).unwrap().0[i];
                        e.1 = true;
                        e.0
                    }
                    None => {
                        self.recorded_misses += 1;
                        self.bump(size)
                    }
                }
            }
            Placement::Ascending => self.bump(size),
            Placement::Descending => {
                self.bump_down -= size.div_ceil(VA_ALIGN) * VA_ALIGN;
                self.bump_down
            }
            Placement::LowestFit => self.lowest_fit(size, VA_BASE),
            Placement::Random(_) => {
                let span = 1u64 << 44;
                let mut a;
                loop {
                    a = VA_BASE + (self.next_rand() % (span / VA_ALIGN)) * VA_ALIGN;
                    if !self.occupied(a, size) {
                        break;
                    }
                }
                a
            }
        };
        debug_assert!(!self.occupied(addr, size), "a segment placed over a live one at {addr:#x}");
        self.live.insert(addr, addr + size);
        addr
    }

    fn bump(&mut self, size: u64) -> u64 {
        let a = self.bump_up;
        self.bump_up += size.div_ceil(VA_ALIGN) * VA_ALIGN;
        a
    }
}

impl Device for SimDevice {
    fn malloc(&mut self, size: u64) -> Option<u64> {
        if !self.fits(size) {
            return None;
        }
        self.used += size;
        Some(self.place(size))
    }
    fn free(&mut self, ptr: u64, size: u64) {
        self.used -= size;
        self.live.remove(&ptr);
    }
    fn reserve(&mut self, size: u64) -> u64 {
        if let Placement::Recorded { reservations, .. } = &self.placement {
            while self.next_reservation < reservations.len() {
                let b = reservations[self.next_reservation];
                self.next_reservation += 1;
                if !self.occupied(b, size) {
                    self.live.insert(b, b + size);
                    return b;
                }
            }
            self.recorded_misses += 1;
            let a = self.bump(size);
            self.live.insert(a, a + size);
            return a;
        }
        self.place(size)
    }
    fn release_reservation(&mut self, base: u64, _size: u64) {
        self.live.remove(&base);
    }
    fn map(&mut self, _ptr: u64, size: u64) -> bool {
        if !self.fits(size) {
            return false;
        }
        self.used += size;
        true
    }
    fn unmap(&mut self, _ptr: u64, size: u64) {
        self.used -= size;
    }
    fn mem_get_info(&self) -> (u64, u64) {
        (self.total.saturating_sub(self.used).saturating_sub(self.outside), self.total)
    }
    fn set_outside_memory(&mut self, bytes: u64) {
        self.outside = bytes;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A segment placed past the recorded list before a recorded address is learned
    /// (`extend_recorded`) must not overlap it when a recorded segment takes that address later.
    #[test]
    fn fresh_addresses_stay_clear_of_addresses_learned_later() {
        let mut d = SimDevice::new(1 << 40, Placement::Recorded { segments: Vec::new(), reservations: Vec::new() });
        let mib = 1 << 20;
        // Nothing is known yet: a 20 MiB segment goes to a fresh address.
        let fresh = d.malloc(20 * mib).unwrap();
        // The recorded run's second segment turns out to sit right above where fresh ones begin.
        let learned = fresh + (40 * mib);
        d.extend_recorded(&[(learned, 2 * mib)], &[]);
        assert_eq!(d.malloc(2 * mib), Some(learned));
        // A further fresh segment must not take the learned segment's range.
        let next = d.malloc(64 * mib).unwrap();
        assert!(next >= learned + 2 * mib || next + 64 * mib <= learned, "{next:#x} overlaps {learned:#x}");
        assert!(!(fresh..fresh + 20 * mib).contains(&next));
        assert_eq!(d.recorded_misses(), 2);
    }
}
