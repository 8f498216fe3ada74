//! `ska::flat_hash_map` / `ska::flat_hash_set` keyed by `MempoolId_t` with `MempoolIdHash`, as
//! PyTorch's allocator keeps `graph_pools_freeable` and `use_on_oom_pools` (c10/util/flat_hash_map.h,
//! `sherwood_v3_table` with the `fibonacci_hash_policy`). Only the order matters to the allocator:
//! `release_cached_blocks` frees the freeable private pools' segments in the table's slot order, and
//! `try_mempool_fallback` tries the `use_on_oom` pools in it, so the table is modelled slot for slot:
//! robin-hood insertion, growth (`grow` → `rehash` to twice the buckets, at a load factor of 0.5 or
//! when a key would sit `max_lookups` slots from its desired one), and backward-shift erasure.

use crate::allocator::MempoolId;

/// `MempoolIdHash`: `first != 0 ? first : second`.
pub fn mempool_id_hash(id: MempoolId) -> u64 {
    if id.0 != 0 { id.0 as u64 } else { id.1 as u64 }
}

const MIN_LOOKUPS: i8 = 4;
const MAX_LOAD_FACTOR: f64 = 0.5;

/// A set of pool ids in `sherwood_v3_table` slot order.
#[derive(Clone, Debug)]
pub struct MempoolIdSet {
    /// (distance from the desired slot, key); `None` = empty (distance −1). The table's last entry
    /// (the special end marker) is not stored.
    slots: Vec<Option<(i8, MempoolId)>>,
    num_slots_minus_one: usize,
    shift: u32,
    max_lookups: i8,
    num_elements: usize,
}

impl Default for MempoolIdSet {
    fn default() -> Self {
        // `empty_default_table()`: min_lookups entries, the last one the end marker.
        MempoolIdSet { slots: vec![None; (MIN_LOOKUPS - 1) as usize], num_slots_minus_one: 0, shift: 63, max_lookups: MIN_LOOKUPS - 1, num_elements: 0 }
    }
}

fn log2(v: usize) -> u32 {
    usize::BITS - 1 - v.leading_zeros()
}

impl MempoolIdSet {
    pub fn len(&self) -> usize {
        self.num_elements
    }
    pub fn is_empty(&self) -> bool {
        self.num_elements == 0
    }

    /// `fibonacci_hash_policy::index_for_hash`.
    fn index_for(&self, id: MempoolId) -> usize {
        (mempool_id_hash(id).wrapping_mul(11400714819323198485) >> self.shift) as usize
    }

    pub fn contains(&self, id: MempoolId) -> bool {
        self.find(id).is_some()
    }

    fn find(&self, id: MempoolId) -> Option<usize> {
        let mut i = self.index_for(id);
        let mut d: i8 = 0;
        while i < self.slots.len() {
            match self.slots[i] {
                Some((dist, k)) if dist >= d => {
                    if k == id {
                        return Some(i);
                    }
                }
                _ => return None,
            }
            i += 1;
            d += 1;
        }
        None
    }

    /// `emplace`: returns false if the key was present.
    pub fn insert(&mut self, id: MempoolId) -> bool {
        let mut i = self.index_for(id);
        let mut d: i8 = 0;
        while i < self.slots.len() {
            match self.slots[i] {
                Some((dist, k)) if dist >= d => {
                    if k == id {
                        return false;
                    }
                }
                _ => break,
            }
            i += 1;
            d += 1;
        }
        self.emplace_new_key(d, i, id);
        true
    }

    fn emplace_new_key(&mut self, d: i8, i: usize, id: MempoolId) {
        let full = (self.num_elements + 1) as f64 > (self.num_slots_minus_one + 1) as f64 * MAX_LOAD_FACTOR;
        if self.num_slots_minus_one == 0 || d == self.max_lookups || full || i >= self.slots.len() {
            self.grow();
            self.insert(id);
            return;
        }
        if self.slots[i].is_none() {
            self.slots[i] = Some((d, id));
            self.num_elements += 1;
            return;
        }
        // Robin hood: the new key takes this slot, the displaced one moves on.
        let result = i;
        let (mut dist, mut to_insert) = (d, id);
        let (od, ok) = self.slots[i].expect("occupied");
        self.slots[i] = Some((dist, to_insert));
        dist = od + 1;
        to_insert = ok;
        let mut j = i + 1;
        loop {
            if j >= self.slots.len() {
                // Past the table (cannot happen within max_lookups): grow like a lookup overflow.
                let kept = self.slots[result].expect("occupied").1;
                self.slots[result] = Some((self.slots[result].expect("occupied").0, to_insert));
                self.grow();
                self.insert(kept);
                return;
            }
            match self.slots[j] {
                None => {
                    self.slots[j] = Some((dist, to_insert));
                    self.num_elements += 1;
                    return;
                }
                Some((cd, ck)) if cd < dist => {
                    self.slots[j] = Some((dist, to_insert));
                    dist = cd + 1;
                    to_insert = ck;
                }
                Some(_) => {
                    dist += 1;
                    if dist == self.max_lookups {
                        // swap(to_insert, result.current->value); grow(); emplace(to_insert)
                        let (rd, rk) = self.slots[result].expect("occupied");
                        self.slots[result] = Some((rd, to_insert));
                        self.grow();
                        self.insert(rk);
                        return;
                    }
                }
            }
            j += 1;
        }
    }

    /// `grow()`: `rehash(max(4, 2 * bucket_count()))`.
    fn grow(&mut self) {
        let buckets = if self.num_slots_minus_one == 0 { 0 } else { self.num_slots_minus_one + 1 };
        self.rehash((2 * buckets).max(4));
    }

    fn rehash(&mut self, num_buckets: usize) {
        let num_buckets = num_buckets.max((self.num_elements as f64 / MAX_LOAD_FACTOR).ceil() as usize);
        let size = num_buckets.max(2).next_power_of_two();
        let shift = 64 - log2(size);
        let old = std::mem::take(&mut self.slots);
        let max_lookups = MIN_LOOKUPS.max(log2(size) as i8);
        self.slots = vec![None; size + max_lookups as usize - 1];
        self.num_slots_minus_one = size - 1;
        self.shift = shift;
        self.max_lookups = max_lookups;
        self.num_elements = 0;
        for (_, k) in old.into_iter().flatten() {
            self.insert(k);
        }
    }

    /// `erase(key)` with backward shift. Returns whether it was present.
    pub fn remove(&mut self, id: MempoolId) -> bool {
        match self.find(id) {
            Some(i) => {
                self.erase_at(i);
                true
            }
            None => false,
        }
    }

    fn erase_at(&mut self, mut i: usize) {
        self.slots[i] = None;
        self.num_elements -= 1;
        while i + 1 < self.slots.len() {
            match self.slots[i + 1] {
                Some((d, k)) if d > 0 => {
                    self.slots[i] = Some((d - 1, k));
                    self.slots[i + 1] = None;
                    i += 1;
                }
                _ => break,
            }
        }
    }

    /// The keys in iteration (slot) order.
    pub fn keys(&self) -> Vec<MempoolId> {
        self.slots.iter().flatten().map(|&(_, k)| k).collect()
    }

    /// Iterates in slot order as PyTorch's `for (it = begin(); it != end();)` loops do when the body
    /// may erase the current key (`it = erase(it)` continues at the same slot, which a backward
    /// shift may have refilled): `visit(key)` returns whether to erase it.
    pub fn visit_erasing(&mut self, mut visit: impl FnMut(MempoolId) -> bool) {
        let mut i = 0;
        while i < self.slots.len() {
            match self.slots[i] {
                Some((_, k)) => {
                    if visit(k) {
                        self.erase_at(i);
                    } else {
                        i += 1;
                    }
                }
                None => i += 1,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fibonacci_slots_and_growth() {
        let mut s = MempoolIdSet::default();
        // Four buckets after the first insertion: slot = (K * h) >> 62.
        s.insert((0, 1));
        assert_eq!(s.slots.len(), 4 + 4 - 1);
        let k = 11400714819323198485u64;
        assert_eq!(s.find((0, 1)), Some((k >> 62) as usize));
        s.insert((0, 2));
        // A third key exceeds the load factor (3 > 4 × 0.5): eight buckets.
        s.insert((0, 3));
        assert_eq!(s.num_slots_minus_one, 7);
        let mut want: Vec<(usize, MempoolId)> = [(0, 1), (0, 2), (0, 3)].iter().map(|&id| ((mempool_id_hash(id).wrapping_mul(k) >> 61) as usize, id)).collect();
        want.sort();
        // Distinct desired slots: iteration is by desired slot.
        if want.windows(2).all(|w| w[0].0 != w[1].0) {
            assert_eq!(s.keys(), want.iter().map(|w| w.1).collect::<Vec<_>>());
        }
        assert!(s.remove((0, 2)));
        assert!(!s.contains((0, 2)));
        assert_eq!(s.len(), 2);
    }

    #[test]
    fn collisions_probe_forward_and_erase_shifts_back() {
        let mut s = MempoolIdSet::default();
        for n in 1..=20 {
            s.insert((0, n));
        }
        assert_eq!(s.len(), 20);
        for n in 1..=20 {
            assert!(s.contains((0, n)), "{n}");
        }
        for n in (1..=20).step_by(3) {
            assert!(s.remove((0, n)));
        }
        for n in 1..=20 {
            assert_eq!(s.contains((0, n)), (n - 1) % 3 != 0, "{n}");
        }
        let mut seen = Vec::new();
        s.visit_erasing(|k| {
            seen.push(k);
            true
        });
        assert_eq!(seen.len(), 13);
        assert!(s.is_empty());
    }
}
