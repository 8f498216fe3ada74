//! Requests matched across repetitions of one piece of work (a CUDA-graph capture round, a
//! training step) whatever their sizes: what identifies a request, a stretch of ops as a pattern
//! of such requests, and two ways of matching one pattern's requests to another's.
//!
//! * A request is identified by its **key**: its stream, whether it went to a private pool, and
//!   its recorded call stack ([`SlotKey`]). Sizes are what the shape changes; the key is what it
//!   does not.
//! * A stretch of ops becomes a [`Template`]: its requests numbered from 0 in order (their keys
//!   and recorded sizes), frees and completions by the request they free (the stretch's own, or
//!   an earlier one by ordinal), and the release runs that were `empty_cache()` calls.
//! * [`match_backwards`]: a pattern's requests found, in order, inside a longer stretch that
//!   makes more (graphs' first capture round, which also makes one-time requests).
//! * [`align`]: two patterns with requests the other does not make (a library that switches
//!   algorithms at a size makes buffers of its own past it): the pairs of equal keys, in order,
//!   that make the most pairs whose sizes one fit explains.

use std::ops::Range;

use allocsim_model::allocator::Route;
use allocsim_replay::{Op, Program};
use allocsim_trace::StackId;

/// What identifies a request across repetitions, whatever its size: its stream, whether it went
/// to a private pool, and its recorded call stack.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SlotKey {
    pub stream: u64,
    pub private: bool,
    pub stack: StackId,
}

/// The key of request `q` of `p`.
pub fn key(p: &Program, q: u32) -> SlotKey {
    let r = &p.requests[q as usize];
    SlotKey { stream: r.stream, private: matches!(r.route, Route::Private(_)), stack: r.stack }
}

/// A request an op of a pattern refers to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Ref {
    /// The pattern's own `k`-th request.
    Local(u32),
    /// A request made before the pattern's stretch, by its ordinal.
    Earlier(u32),
    /// A block allocated before the trace began (`Program::initial`'s block `pre`).
    Pre(u32),
}

/// One op of a pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TOp {
    /// The pattern's `k`-th request.
    Malloc(u32),
    Free {
        r: Ref,
        deferred: bool,
    },
    Complete(Ref),
    /// An `empty_cache()` call (a release run the trace's own replay read as one).
    EmptyCache,
}

/// One request of a pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    pub key: SlotKey,
    /// Its requested bytes in the stretch the pattern was read from.
    pub size: u64,
    /// The recorded request it stands for (in the stretch the pattern was read from).
    pub recorded: u32,
}

/// A stretch's ops, with its requests numbered from 0.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Template {
    pub ops: Vec<TOp>,
    pub slots: Vec<Slot>,
}

impl Template {
    /// The ops without the `empty_cache()` calls.
    pub fn without_empty_cache(&self) -> Vec<TOp> {
        self.ops.iter().copied().filter(|o| *o != TOp::EmptyCache).collect()
    }

    /// The keys of its requests, in order.
    pub fn keys(&self) -> Vec<SlotKey> {
        self.slots.iter().map(|s| s.key).collect()
    }
}

/// Why a stretch of ops cannot be a pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TemplateError {
    /// A request `_cuda_setCheckpointPoolState` made (torch.compile's CUDA-graph trees restoring
    /// a pool to a checkpoint): not a malloc a shape can change. Its recorded ordinal.
    Checkpoint(u32),
    /// A release at the very start of a trace cut by the ring buffer (`Op::ForcedRelease`).
    ForcedRelease,
}

/// The ops `ops` of `p` as a pattern: requests from `first_request` on renumbered from 0,
/// references to earlier requests kept by ordinal ([`Ref::Earlier`]) and to blocks from before the
/// trace as [`Ref::Pre`], release runs that were `empty_cache()` calls (`empty_cache`: one flag
/// per op, as the trace's own replay decided) kept as such, the others dropped (the model's own
/// mallocs make them).
pub fn template(p: &Program, empty_cache: &[bool], ops: Range<usize>, first_request: u32) -> Result<Template, TemplateError> {
    let mut t = Template::default();
    let r = |q: u32| if q >= first_request { Ref::Local(q - first_request) } else { Ref::Earlier(q) };
    for oi in ops {
        match p.ops[oi] {
            Op::Malloc(q) => {
                let req = &p.requests[q as usize];
                if req.checkpoint {
                    return Err(TemplateError::Checkpoint(q));
                }
                t.ops.push(TOp::Malloc(q - first_request));
                t.slots.push(Slot { key: key(p, q), size: req.size, recorded: q });
            }
            Op::Free { req, deferred } => t.ops.push(TOp::Free { r: r(req), deferred }),
            Op::Complete(req) => t.ops.push(TOp::Complete(r(req))),
            Op::ReleaseRun { .. } => {
                if empty_cache.get(oi).copied().unwrap_or(false) {
                    t.ops.push(TOp::EmptyCache);
                }
            }
            Op::FreePre { pre, deferred } => t.ops.push(TOp::Free { r: Ref::Pre(pre), deferred }),
            Op::CompletePre(pre) => t.ops.push(TOp::Complete(Ref::Pre(pre))),
            Op::ForcedRelease { .. } => return Err(TemplateError::ForcedRelease),
        }
    }
    Ok(t)
}

/// Finds `wanted` (a pattern's requests, in order) among `candidates` (a longer stretch's
/// requests, in order) from the end backwards: each wanted request, last first, takes the latest
/// candidate before the previous one taken whose request `accept(wanted index, candidate index)`
/// allows. Returns the candidate index of each wanted request, or how many were found when not
/// all were.
pub fn match_backwards(wanted: usize, candidates: usize, accept: impl Fn(usize, usize) -> bool) -> Result<Vec<usize>, usize> {
    let mut found = vec![0usize; wanted];
    let mut j = wanted;
    for c in (0..candidates).rev() {
        if j == 0 {
            break;
        }
        if accept(j - 1, c) {
            found[j - 1] = c;
            j -= 1;
        }
    }
    if j == 0 { Ok(found) } else { Err(wanted - j) }
}

/// How far (in requests) an alignment may stray from the diagonal beyond the difference in
/// length: the band [`align`] searches.
pub const ALIGN_BAND: usize = 512;

/// The most cells (requests × band) [`align`]'s dynamic programming fills (64 MiB of scores);
/// past that only the common start and end are paired.
pub const ALIGN_MAX_CELLS: usize = 1 << 24;

/// Pairs requests of two patterns (`a`, `b`: their keys ([`SlotKey`], or keys across traces), in order): pairs `(i, j)` increasing in
/// both, of equal keys, the most pairs that `strong(i, j)` accepts (sizes one fit explains) first,
/// then the most pairs. A strong pair counts as four plain ones, so a plain pair never displaces
/// a strong one that three plain ones do not outweigh.
///
/// The common start and end (equal keys, strong pairs) are paired directly; the rest by dynamic
/// programming inside a band around the diagonal ([`ALIGN_BAND`] requests beyond the difference
/// in length), which holds any alignment whose insertions and deletions stay within it; where
/// that band would hold more than [`ALIGN_MAX_CELLS`] cells, the rest is left unpaired.
pub fn align<K: PartialEq>(a: &[K], b: &[K], strong: impl Fn(usize, usize) -> bool) -> Vec<(usize, usize)> {
    let same = |i: usize, j: usize| a[i] == b[j] && strong(i, j);
    let mut head = 0;
    while head < a.len() && head < b.len() && same(head, head) {
        head += 1;
    }
    let mut tail = 0;
    while tail < a.len() - head && tail < b.len() - head && same(a.len() - 1 - tail, b.len() - 1 - tail) {
        tail += 1;
    }
    let (n, m) = (a.len() - head - tail, b.len() - head - tail);
    let mut pairs: Vec<(usize, usize)> = (0..head).map(|i| (i, i)).collect();
    let band_cells = (n + 1).saturating_mul(n.abs_diff(m) + 2 * ALIGN_BAND + 1);
    if n > 0 && m > 0 && band_cells <= ALIGN_MAX_CELLS {
        // Row i (0..=n) holds columns j in [i + lo, i + hi] ∩ [0, m].
        let lo = -((n.saturating_sub(m) + ALIGN_BAND) as i64);
        let hi = (m.saturating_sub(n) + ALIGN_BAND) as i64;
        let width = (hi - lo + 1) as usize;
        let at = |i: usize, j: usize| -> Option<usize> {
            let d = j as i64 - i as i64;
            (lo..=hi).contains(&d).then(|| i * width + (d - lo) as usize)
        };
        let mut score = vec![0u32; (n + 1) * width];
        let get = |score: &[u32], i: usize, j: usize| at(i, j).map_or(0, |k| score[k]);
        let gain = |i: usize, j: usize| -> u32 {
            let (x, y) = (head + i, head + j);
            if a[x] != b[y] {
                0
            } else if strong(x, y) {
                4
            } else {
                1
            }
        };
        for i in 1..=n {
            let jlo = (i as i64 + lo).max(1) as usize;
            let jhi = ((i as i64 + hi).min(m as i64)).max(0) as usize;
            for j in jlo..=jhi {
                let mut s = get(&score, i - 1, j).max(get(&score, i, j - 1));
                let g = gain(i - 1, j - 1);
                if g > 0 {
                    s = s.max(get(&score, i - 1, j - 1) + g);
                }
                if let Some(k) = at(i, j) {
                    score[k] = s;
                }
            }
        }
        // Back from (n, m) (inside the band: the band holds the last diagonal).
        let mut mid = Vec::new();
        let (mut i, mut j) = (n, m);
        while i > 0 && j > 0 {
            let s = get(&score, i, j);
            let g = gain(i - 1, j - 1);
            if g > 0 && s == get(&score, i - 1, j - 1) + g {
                mid.push((head + i - 1, head + j - 1));
                i -= 1;
                j -= 1;
            } else if at(i - 1, j).is_some() && s == get(&score, i - 1, j) {
                i -= 1;
            } else {
                j -= 1;
            }
        }
        mid.reverse();
        pairs.extend(mid);
    }
    pairs.extend((0..tail).rev().map(|t| (a.len() - 1 - t, b.len() - 1 - t)));
    pairs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(stack: u32) -> SlotKey {
        SlotKey { stream: 0, private: false, stack }
    }

    #[test]
    fn inserted_requests_with_the_same_key_are_placed_by_size() {
        // A backward pass with no stacks (every key the same): a larger shape makes two more
        // requests before the constant one (65536000 bytes) and one after.
        let a_sizes = [100u64, 65536000, 7];
        let b_sizes = [200u64, 32, 32, 65536000, 9, 14];
        let a: Vec<SlotKey> = a_sizes.iter().map(|_| k(0)).collect();
        let b: Vec<SlotKey> = b_sizes.iter().map(|_| k(0)).collect();
        // Strong: equal sizes for the constant one, else the growing ones (b's are larger).
        let strong = |i: usize, j: usize| (a_sizes[i] == 65536000) == (b_sizes[j] == 65536000) && a_sizes[i] <= b_sizes[j];
        let p = align(&a, &b, strong);
        assert_eq!(p, [(0, 0), (1, 3), (2, 5)]);
    }

    #[test]
    fn keys_must_be_equal_and_ends_are_paired_directly() {
        let a = [k(1), k(2), k(3), k(4)];
        let b = [k(1), k(9), k(3), k(4)];
        assert_eq!(align(&a, &b, |_, _| true), [(0, 0), (2, 2), (3, 3)]);
        assert_eq!(align(&a, &[], |_, _| true), []);
        let long: Vec<SlotKey> = (0..2000).map(|i| k(i % 7)).collect();
        let mut other = long.clone();
        other.insert(1000, k(99));
        let p = align(&long, &other, |_, _| true);
        assert_eq!(p.len(), 2000);
        assert!(p.iter().all(|&(i, j)| long[i] == other[j]));
    }

    #[test]
    fn backwards_match() {
        // wanted keys 1, 2 among 1 1 2 9 2: the last 2, then the 1 before it.
        let c = [1, 1, 2, 9, 2];
        let w = [1, 2];
        assert_eq!(match_backwards(2, 5, |i, j| w[i] == c[j]), Ok(vec![1, 4]));
        assert_eq!(match_backwards(2, 5, |i, j| w[i] == c[j] && j < 1), Err(0));
    }
}
