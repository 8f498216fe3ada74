//! A fast hasher for integer keys (addresses, ordinals), for the maps that follow live blocks
//! through a replay. Not DoS-resistant; the keys come from a trace the user chose to replay.
//!
//! Each integer is mixed with a 64 × 64 → 128-bit multiply folded to 64 bits, so that keys that
//! differ only in high bits (512-aligned addresses) still spread over the low bits the table uses.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

#[derive(Default, Clone, Copy)]
pub struct IntHasher(u64);

impl IntHasher {
    #[inline]
    fn add(&mut self, w: u64) {
        let p = ((self.0 ^ w) as u128).wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835);
        self.0 = (p as u64) ^ ((p >> 64) as u64);
    }
}

impl Hasher for IntHasher {
    fn write(&mut self, bytes: &[u8]) {
        for c in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..c.len()].copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
    }
    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.add(i as u64)
    }
    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.add(i)
    }
    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64)
    }
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

pub type IntMap<K, V> = HashMap<K, V, BuildHasherDefault<IntHasher>>;
pub type IntSet<K> = HashSet<K, BuildHasherDefault<IntHasher>>;
