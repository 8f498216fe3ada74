//! `BlockPool::blocks`: a pool's free blocks ordered as PyTorch's `BlockComparatorSize` orders
//! them — by stream, then size, then address — so that `lower_bound` finds the best fit.
//!
//! PyTorch keeps them in a `std::set<Block*, Comparator>`. Every query the allocator makes stays
//! within one stream (`get_free_block`'s and `release_available_cached_blocks`' walks stop at the
//! first block of another stream), so the set is kept per stream: a short list of streams, each
//! with its own sorted sequence of `(size, address)` keys packed into one `u128`
//! (`size << 64 | address`, which orders exactly as the pair does). Only whole-pool walks
//! (`release_blocks`, garbage collection) cross streams; they visit the streams in ascending
//! order, as the comparator does.
//!
//! A sequence is a sorted vector cut into chunks of at most [`CHUNK_MAX`] keys, with the largest
//! key of each chunk in a separate array: a lookup is two binary searches, an insertion or a
//! removal moves at most one chunk's keys. For the few hundred free blocks a pool usually holds
//! that is one chunk and no pointer chasing; a pool of 100 000 free blocks still costs a few
//! hundred nanoseconds per update rather than a move of the whole vector.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::allocator::BlockId;

/// The most keys one chunk holds before it is cut in two.
pub const CHUNK_MAX: usize = 32;

#[inline]
fn pack(size: u64, ptr: u64) -> u128 {
    ((size as u128) << 64) | ptr as u128
}

/// The number of keys in the sorted slice `keys` below `k` (`partition_point(|x| x < k)`): a
/// branchless count for short slices, which are cheaper to scan than to bisect.
#[inline]
fn count_below(keys: &[u128], k: u128) -> usize {
    if keys.len() > 16 {
        return keys.partition_point(|&x| x < k);
    }
    keys.iter().map(|&x| usize::from(x < k)).sum()
}

/// Up to [`CHUNK_MAX`] consecutive keys, inline, sizes apart from addresses: a lookup counts the
/// keys below it (smaller sizes, and equal sizes at lower addresses) in one branch-free pass, with
/// no dependent loads.
#[derive(Clone, Debug)]
struct Chunk {
    len: usize,
    sizes: [u64; CHUNK_MAX],
    ptrs: [u64; CHUNK_MAX],
    ids: [BlockId; CHUNK_MAX],
}

impl Chunk {
    fn new() -> Box<Chunk> {
        Box::new(Chunk { len: 0, sizes: [0; CHUNK_MAX], ptrs: [0; CHUNK_MAX], ids: [0; CHUNK_MAX] })
    }
    /// The first index whose `(size, ptr)` is `>= (size, ptr)`.
    #[inline]
    fn lower_bound(&self, size: u64, ptr: u64) -> usize {
        let n = self.len;
        if ptr == 0 {
            return self.sizes[..n].iter().map(|&x| usize::from(x < size)).sum();
        }
        // Runs of equal sizes can be long (many free blocks of one size): count those below
        // `ptr` in the same pass, branch-free.
        self.sizes[..n].iter().zip(&self.ptrs[..n]).map(|(&x, &p)| usize::from(x < size) + usize::from((x == size) & (p < ptr))).sum()
    }
    #[inline]
    fn is_at(&self, i: usize, size: u64, ptr: u64) -> bool {
        i < self.len && self.sizes[i] == size && self.ptrs[i] == ptr
    }
    #[inline]
    fn key(&self, i: usize) -> u128 {
        pack(self.sizes[i], self.ptrs[i])
    }
    #[inline]
    fn insert_at(&mut self, i: usize, size: u64, ptr: u64, id: BlockId) {
        let n = self.len;
        self.sizes.copy_within(i..n, i + 1);
        self.ptrs.copy_within(i..n, i + 1);
        self.ids.copy_within(i..n, i + 1);
        self.sizes[i] = size;
        self.ptrs[i] = ptr;
        self.ids[i] = id;
        self.len = n + 1;
    }
    #[inline]
    fn remove_at(&mut self, i: usize) -> BlockId {
        let n = self.len;
        let id = self.ids[i];
        self.sizes.copy_within(i + 1..n, i);
        self.ptrs.copy_within(i + 1..n, i);
        self.ids.copy_within(i + 1..n, i);
        self.len = n - 1;
        id
    }
    /// Appends `other[from..]`.
    fn append(&mut self, other: &Chunk, from: usize) {
        let (n, m) = (self.len, other.len - from);
        self.sizes[n..n + m].copy_from_slice(&other.sizes[from..other.len]);
        self.ptrs[n..n + m].copy_from_slice(&other.ptrs[from..other.len]);
        self.ids[n..n + m].copy_from_slice(&other.ids[from..other.len]);
        self.len = n + m;
    }
    fn last(&self) -> u128 {
        self.key(self.len - 1)
    }
}

/// A remembered position `(chunk, index)` (an atomic only so that a shared set stays `Sync`;
/// relaxed loads and stores are plain moves).
#[derive(Debug, Default)]
struct Finger(AtomicU64);

impl Finger {
    #[inline]
    fn get(&self) -> (usize, usize) {
        let v = self.0.load(Relaxed);
        ((v >> 32) as usize, v as u32 as usize)
    }
    #[inline]
    fn set(&self, (ci, i): (usize, usize)) {
        self.0.store(((ci as u64) << 32) | i as u64, Relaxed);
    }
}

impl Clone for Finger {
    fn clone(&self) -> Finger {
        Finger(AtomicU64::new(self.0.load(Relaxed)))
    }
}

/// The free blocks of one stream, ordered by `(size, address)`.
#[derive(Clone, Debug, Default)]
struct SizeSet {
    /// `maxes[i]` is the last key of `chunks[i]`.
    maxes: Vec<u128>,
    /// Boxed: a chunk is a few KiB of fixed arrays, and inserting or removing one shifts the
    /// pointers after it, not the arrays.
    #[allow(clippy::vec_box)]
    chunks: Vec<Box<Chunk>>,
    /// The position the last lookup found. A removal tries it first: `get_free_block` erases
    /// the block its lookup just found. (Checked against the key before use, so a stale finger
    /// costs one compare.)
    finger: Finger,
}

impl SizeSet {
    /// The first position whose key is `>= (size, ptr)`: (chunk, index); `(chunks.len(), 0)` past
    /// the end.
    #[inline]
    fn lower_bound(&self, size: u64, ptr: u64) -> (usize, usize) {
        let ci = count_below(&self.maxes, pack(size, ptr));
        if ci == self.chunks.len() {
            return (ci, 0);
        }
        let i = self.chunks[ci].lower_bound(size, ptr);
        self.finger.set((ci, i));
        (ci, i)
    }

    fn insert(&mut self, size: u64, ptr: u64, id: BlockId) -> bool {
        let k = pack(size, ptr);
        if self.chunks.is_empty() {
            let mut c = Chunk::new();
            c.insert_at(0, size, ptr, id);
            self.chunks.push(c);
            self.maxes.push(k);
            return true;
        }
        let mut ci = count_below(&self.maxes, k);
        if ci == self.chunks.len() {
            ci -= 1;
        }
        let c = &mut self.chunks[ci];
        let mut i = c.lower_bound(size, ptr);
        if c.is_at(i, size, ptr) {
            return false;
        }
        if c.len == CHUNK_MAX {
            // Cut the full chunk in two, then insert into the half the key belongs to.
            let half = CHUNK_MAX / 2;
            let mut right = Chunk::new();
            right.append(c, half);
            c.len = half;
            let left_max = c.last();
            self.maxes.insert(ci, left_max);
            self.chunks.insert(ci + 1, right);
            if i > half {
                ci += 1;
                i -= half;
            }
        }
        let c = &mut self.chunks[ci];
        c.insert_at(i, size, ptr, id);
        if i + 1 == c.len {
            self.maxes[ci] = k;
        }
        true
    }

    fn remove(&mut self, size: u64, ptr: u64) -> Option<BlockId> {
        let (fc, fi) = self.finger.get();
        let (ci, i) = if self.chunks.get(fc).is_some_and(|c| c.is_at(fi, size, ptr)) { (fc, fi) } else { self.lower_bound(size, ptr) };
        let c = self.chunks.get_mut(ci)?;
        if !c.is_at(i, size, ptr) {
            return None;
        }
        let id = c.remove_at(i);
        let n = c.len;
        if n == 0 {
            self.chunks.remove(ci);
            self.maxes.remove(ci);
            return Some(id);
        }
        if i == n {
            self.maxes[ci] = c.last();
        }
        // Keep chunks from thinning out: fold a small chunk's successor into it when both fit.
        if n < CHUNK_MAX / 4 && ci + 1 < self.chunks.len() && n + self.chunks[ci + 1].len <= CHUNK_MAX * 3 / 4 {
            let next = self.chunks.remove(ci + 1);
            self.maxes.remove(ci);
            self.chunks[ci].append(&next, 0);
        }
        Some(id)
    }

    fn len(&self) -> usize {
        self.chunks.iter().map(|c| c.len).sum()
    }
}

/// A pool's free blocks by (stream, size, address): PyTorch's `BlockPool::blocks`.
#[derive(Clone, Debug, Default)]
pub struct FreeSet {
    /// (stream, its blocks), ascending by stream.
    streams: Vec<(u64, SizeSet)>,
    len: usize,
}

impl FreeSet {
    pub fn new() -> FreeSet {
        FreeSet::default()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    #[inline]
    fn stream(&self, stream: u64) -> Option<&SizeSet> {
        self.streams.iter().find(|s| s.0 == stream).map(|s| &s.1)
    }

    /// Inserts `id` under `(stream, size, ptr)`; false if that key is present (nothing changes).
    #[inline]
    pub fn insert(&mut self, (stream, size, ptr): (u64, u64, u64), id: BlockId) -> bool {
        let si = match self.streams.iter().position(|s| s.0 == stream) {
            Some(i) => i,
            None => {
                let at = self.streams.partition_point(|s| s.0 < stream);
                self.streams.insert(at, (stream, SizeSet::default()));
                at
            }
        };
        let added = self.streams[si].1.insert(size, ptr, id);
        self.len += usize::from(added);
        added
    }

    /// Removes the block under `(stream, size, ptr)`.
    #[inline]
    pub fn remove(&mut self, (stream, size, ptr): (u64, u64, u64)) -> Option<BlockId> {
        let si = self.streams.iter().position(|s| s.0 == stream)?;
        let id = self.streams[si].1.remove(size, ptr)?;
        self.len -= 1;
        Some(id)
    }

    pub fn get(&self, (stream, size, ptr): (u64, u64, u64)) -> Option<BlockId> {
        let set = self.stream(stream)?;
        let (ci, i) = set.lower_bound(size, ptr);
        let c = set.chunks.get(ci)?;
        c.is_at(i, size, ptr).then(|| c.ids[i])
    }

    /// A walk of `stream`'s blocks from the lower bound of `(size, ptr)`.
    #[inline]
    fn walk<const UP: bool>(&self, stream: u64, size: u64, ptr: u64) -> Walk<'_, UP> {
        match self.stream(stream) {
            Some(set) => {
                let (ci, i) = set.lower_bound(size, ptr);
                Walk { set: Some(set), ci, i }
            }
            None => Walk { set: None, ci: 0, i: 0 },
        }
    }

    /// The blocks of `stream` from the first `>= (size, ptr)` upward: `(size, ptr, id)`
    /// (`pool.blocks.lower_bound(&key)` and the `++it` after it, up to the stream's end).
    #[inline]
    pub fn range_from(&self, stream: u64, size: u64, ptr: u64) -> Walk<'_, true> {
        self.walk(stream, size, ptr)
    }

    /// The blocks of `stream` below `(size, ptr)`, largest first (`--it` from the lower bound).
    pub fn range_below(&self, stream: u64, size: u64, ptr: u64) -> Walk<'_, false> {
        self.walk(stream, size, ptr)
    }

    /// Every block, in comparator order: `((stream, size, ptr), id)`.
    pub fn iter(&self) -> impl Iterator<Item = ((u64, u64, u64), BlockId)> + '_ {
        self.streams.iter().flat_map(|(stream, set)| set.chunks.iter().flat_map(move |c| (0..c.len).map(move |i| ((*stream, c.sizes[i], c.ptrs[i]), c.ids[i]))))
    }

    /// Every block id, in comparator order.
    pub fn values(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.streams.iter().flat_map(|(_, set)| set.chunks.iter().flat_map(|c| c.ids[..c.len].iter().copied()))
    }

    /// Recounts the blocks (for invariant checks).
    pub fn count(&self) -> usize {
        self.streams.iter().map(|(_, s)| s.len()).sum()
    }
}

/// A walk over one stream's blocks from a position, upward (`UP`, starting at the position) or
/// downward (starting below it): `(size, ptr, id)`.
pub struct Walk<'a, const UP: bool> {
    set: Option<&'a SizeSet>,
    ci: usize,
    i: usize,
}

impl Iterator for Walk<'_, true> {
    type Item = (u64, u64, BlockId);
    #[inline]
    fn next(&mut self) -> Option<Self::Item> {
        let set = self.set?;
        loop {
            let c = set.chunks.get(self.ci)?;
            if self.i < c.len {
                let i = self.i;
                self.i += 1;
                return Some((c.sizes[i], c.ptrs[i], c.ids[i]));
            }
            self.ci += 1;
            self.i = 0;
        }
    }
}

impl Iterator for Walk<'_, false> {
    type Item = (u64, u64, BlockId);
    fn next(&mut self) -> Option<Self::Item> {
        let set = self.set?;
        while self.i == 0 {
            if self.ci == 0 {
                return None;
            }
            self.ci -= 1;
            self.i = set.chunks[self.ci].len;
        }
        self.i -= 1;
        let c = &set.chunks[self.ci];
        Some((c.sizes[self.i], c.ptrs[self.i], c.ids[self.i]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// Random inserts, removals and queries against a `BTreeMap` on the same keys.
    #[test]
    fn agrees_with_btreemap() {
        let mut rng = 0x9e3779b97f4a7c15u64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        for round in 0..4 {
            let mut set = FreeSet::new();
            let mut map: BTreeMap<(u64, u64, u64), BlockId> = BTreeMap::new();
            let universe = [20, 300, 5000][round % 3];
            for step in 0..40_000u32 {
                let key = (next() % 3, (next() % universe) * 512, (next() % universe) << 9);
                match next() % 4 {
                    0 | 1 => {
                        let fresh = !map.contains_key(&key);
                        if fresh {
                            map.insert(key, step);
                        }
                        assert_eq!(set.insert(key, step), fresh);
                    }
                    2 => assert_eq!(set.remove(key), map.remove(&key)),
                    _ => {
                        let want: Vec<_> = map.range(key..).take_while(|(k, _)| k.0 == key.0).take(5).map(|(k, &v)| (k.1, k.2, v)).collect();
                        let got: Vec<_> = set.range_from(key.0, key.1, key.2).take(5).collect();
                        assert_eq!(got, want);
                        let want: Vec<_> = map.range(..key).rev().take_while(|(k, _)| k.0 == key.0).take(5).map(|(k, &v)| (k.1, k.2, v)).collect();
                        let got: Vec<_> = set.range_below(key.0, key.1, key.2).take(5).collect();
                        assert_eq!(got, want);
                        assert_eq!(set.get(key), map.get(&key).copied());
                    }
                }
                assert_eq!(set.len(), map.len());
            }
            assert_eq!(set.count(), map.len());
            let all: Vec<_> = set.iter().collect();
            let want: Vec<_> = map.iter().map(|(k, &v)| (*k, v)).collect();
            assert_eq!(all, want);
            assert!(set.values().eq(map.values().copied()));
        }
    }
}
