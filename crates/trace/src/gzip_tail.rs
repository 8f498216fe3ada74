//! The last bytes of a gzip'd file's contents, read without inflating what comes before them.
//!
//! A snapshot pickle holds its `allocator_settings` after its entries, and the replay that runs
//! beside the first pass wants them before it starts (`PickleFile::tail_settings`). In a plain
//! file they are a seek away; in a gzip'd one, the deflate stream must in general be inflated
//! from its start. But deflate data is a run of blocks, and a block with its own Huffman codes
//! can be inflated from its first bit on: only its matches reach back, up to 32 KiB, into the
//! output before it.
//!
//! So [`known_tail`] walks back from the end of the compressed data, bit position by bit
//! position, keeps those where a block header that zlib would accept starts
//! (`could_start_block`: the block type, the counts, and Huffman codes zlib builds), and
//! inflates from there to the end twice: with the 32 KiB before it taken as all `0x90` bytes,
//! then as all `0xFF`. A byte that comes out the same both times is the file's byte; one copied,
//! however indirectly, from the unknown window comes out as the fill, so differs. The caller gets
//! the bytes and which of them are known. A position is taken only where both inflates end
//! their stream exactly where the gzip trailer begins, so a header that merely looks valid does
//! not pass; and what is read this way is still only an assumption of the replay, which the
//! first pass checks against the settings it reads.
//!
//! Known bytes stay known from an earlier start, so where they do not satisfy the caller the
//! search goes on to earlier blocks, up to [`MAX_INFLATES`] starts within the last [`SEARCH`]
//! bytes of the file; then it gives up (`None`), and the replay assumes torch's defaults as
//! before. Strings deflate keeps copying (a dict's opening, a common integer) stay unknown from
//! any start, so giving up early costs little. Blocks of the fixed code (zlib-ng's and
//! zlib-rs's level 1 writes only those) have no header to check: such a file gives `None`.
//!
//! Measured on the 2-core development machine, on a 4 MB gzip'd kvcache recording: the last
//! block starts 124 k bit positions before the end (0.8 ms to find), and its two inflates
//! (192 KB out) take 0.2 ms each.

use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

/// How far before the end of a gzip'd file block starts are looked for.
pub const SEARCH: u64 = 256 << 10;
/// The most inflates from candidate block starts (each inflates to the end twice).
pub const MAX_INFLATES: usize = 3;
/// The most output all inflates together make before the search gives up.
const MAX_OUTPUT: u64 = 16 << 20;
/// Deflate's window: how far back a match may copy.
const WINDOW: usize = 32 << 10;
/// The gzip trailer after the deflate data: CRC-32 and size.
const TRAILER: usize = 8;

/// The end of the gzip'd file `path`'s contents, inflated from a block near it without the rest
/// (see the module documentation), given to `take` until it answers `Some`: the last at most
/// `keep` bytes from the block's start on, and for each whether it is known to be the file's
/// byte. `None` where no block start within [`SEARCH`] bytes of the end gives `take` what it
/// wants (or the file cannot be read).
pub fn known_tail<T>(path: &Path, keep: usize, take: impl FnMut(&[u8], &[bool]) -> Option<T>) -> Option<T> {
    let mut f = std::fs::File::open(path).ok()?;
    let len = f.metadata().ok()?.len();
    let start = len.saturating_sub(SEARCH);
    f.seek(SeekFrom::Start(start)).ok()?;
    let mut end = Vec::with_capacity((len - start) as usize);
    f.read_to_end(&mut end).ok()?;
    known_tail_of(&end, keep, take)
}

/// [`known_tail`] of the last bytes of a gzip'd file (`end`, which ends with the trailer).
pub fn known_tail_of<T>(end: &[u8], keep: usize, mut take: impl FnMut(&[u8], &[bool]) -> Option<T>) -> Option<T> {
    if end.len() <= TRAILER {
        return None;
    }
    // The bits, with zeros after them so that any position can read eight bytes.
    let mut padded = end.to_vec();
    padded.extend_from_slice(&[0; 16]);
    let data_bits = (end.len() - TRAILER) * 8;
    let (mut inflates, mut output) = (0, 0);
    for p in (0..data_bits.saturating_sub(3)).rev() {
        if !could_start_block(&padded, p, data_bits) {
            continue;
        }
        inflates += 1;
        let read = inflate_to_end(&end[p / 8..], p % 8, FILLS[0], keep, &mut output).and_then(|a| {
            let b = inflate_to_end(&end[p / 8..], p % 8, FILLS[1], keep, &mut output)?;
            // (The same code lengths: the same number of bytes out.)
            let known: Vec<bool> = a.iter().zip(&b).map(|(x, y)| x == y).collect();
            Some((a, known))
        });
        if let Some(t) = read.and_then(|(bytes, known)| take(&bytes, &known)) {
            return Some(t);
        }
        if inflates == MAX_INFLATES || output > MAX_OUTPUT {
            break;
        }
    }
    None
}

/// The `n` (at most 56) bits at bit position `p` of `d`, first bit lowest (deflate's order).
#[inline]
fn bits(d: &[u8], p: usize, n: u32) -> u32 {
    let w = u64::from_le_bytes(d[p / 8..p / 8 + 8].try_into().expect("eight bytes"));
    ((w >> (p % 8)) & ((1u64 << n) - 1)) as u32
}

/// The two values the unknown bytes before a block are taken as, one then the other. (Both have
/// nine-bit codes in deflate's fixed code, which [`primed`] relies on.)
const FILLS: [u8; 2] = [0x90, 0xFF];

/// Raw deflate data whose first block is the one at bit `skip` of `from` (`from` from its first
/// byte on), at the same bit of a byte as there, so that a stored block later on (a sync flush)
/// finds its byte boundary where the compressor put it: before it, one block of fixed codes
/// holding as many `fill` literals (nine bits each) as make its length `skip` modulo 8, whose
/// last bits share the first byte.
fn primed(from: &[u8], skip: usize, fill: u8) -> Vec<u8> {
    let mut w = BitWriter::default();
    w.put(0b010, 3); // not the last block; fixed codes
    for _ in 0..primer_literals(skip) {
        // 144..=255: the nine-bit codes 110010000 onwards, sent first bit first.
        w.put_code(0b1_1001_0000 + u32::from(fill - 144), 9);
    }
    w.put_code(0, 7); // end of block
    debug_assert_eq!(w.len % 8, skip);
    let mut out = w.bytes;
    let (full, part) = (w.len / 8, w.len % 8);
    out.truncate(full + usize::from(part > 0));
    if part > 0 {
        let last = out.pop().expect("the partial byte");
        out.push(last | (from[0] & (0xFFu8 << part)));
        out.extend_from_slice(&from[1..]);
    } else {
        out.extend_from_slice(from);
    }
    out
}

/// How many literals [`primed`]'s block holds before a block at bit `skip` of a byte.
fn primer_literals(skip: usize) -> usize {
    (skip + 6) % 8
}

#[derive(Default)]
struct BitWriter {
    bytes: Vec<u8>,
    len: usize,
}

impl BitWriter {
    /// `n` bits of `v`, lowest first.
    fn put(&mut self, v: u32, n: usize) {
        for i in 0..n {
            if self.len.is_multiple_of(8) {
                self.bytes.push(0);
            }
            let bit = ((v >> i) & 1) as u8;
            *self.bytes.last_mut().expect("a byte") |= bit << (self.len % 8);
            self.len += 1;
        }
    }
    /// A Huffman code of `n` bits, highest first.
    fn put_code(&mut self, code: u32, n: usize) {
        for i in (0..n).rev() {
            self.put((code >> i) & 1, 1);
        }
    }
}

/// Whether a deflate block with its own Huffman codes, one zlib accepts, could start at bit `p`
/// (the data ending at bit `end`): the block type, counts in range, and three codes that zlib's
/// `inflate_table` builds (the code-length code complete; the literal/length and distance codes
/// not over-subscribed, and incomplete only as a single one-bit code, or, for distances, no code
/// at all; end-of-block coded). Stored and fixed-code blocks are not taken: a stored block's
/// four-byte check passes by chance too often (and its bytes, copied as they are, would look
/// known), and a fixed-code block has no header to check; an earlier block of the other kind is
/// found instead.
fn could_start_block(d: &[u8], p: usize, end: usize) -> bool {
    bits(d, p + 1, 2) == 2 && dynamic_header_is_valid(d, p + 3, end)
}

/// The order in which a dynamic block gives its code-length code's lengths.
const CL_ORDER: [usize; 19] = [16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15];

fn dynamic_header_is_valid(d: &[u8], mut p: usize, end: usize) -> bool {
    let counts = bits(d, p, 14);
    p += 14;
    let (hlit, hdist, hclen) = ((counts & 31) as usize + 257, ((counts >> 5) & 31) as usize + 1, (counts >> 10) as usize + 4);
    if hlit > 286 || hdist > 30 || p + 3 * hclen > end {
        return false;
    }
    if !code_length_code_is_complete(d, p, hclen) {
        return false;
    }
    let mut cl = [0u8; 19];
    for &sym in &CL_ORDER[..hclen] {
        cl[sym] = bits(d, p, 3) as u8;
        p += 3;
    }
    let table = decode_table(&cl);
    let n = hlit + hdist;
    let mut lens = [0u8; 286 + 30];
    let mut i = 0;
    while i < n {
        if p > end {
            return false;
        }
        let (sym, len) = table[bits(d, p, 7) as usize];
        p += len as usize;
        let (value, repeat) = match sym {
            0..=15 => (sym, 1),
            16 if i > 0 => {
                p += 2;
                (lens[i - 1], 3 + bits(d, p - 2, 2) as usize)
            }
            17 => {
                p += 3;
                (0, 3 + bits(d, p - 3, 3) as usize)
            }
            18 => {
                p += 7;
                (0, 11 + bits(d, p - 7, 7) as usize)
            }
            _ => return false,
        };
        if i + repeat > n {
            return false;
        }
        lens[i..i + repeat].fill(value);
        i += repeat;
    }
    let (lit, dist) = lens[..n].split_at(hlit);
    lit[256] != 0 && builds(lit, false) && builds(dist, true)
}

/// Whether the `hclen` three-bit code lengths at bit `p` make a complete code (the test that
/// rejects most positions, so done on one load: four lengths at a time through [`KRAFT4`]).
#[inline]
fn code_length_code_is_complete(d: &[u8], p: usize, hclen: usize) -> bool {
    let w = u64::from_le_bytes(d[p / 8..p / 8 + 8].try_into().expect("eight bytes")) >> (p % 8);
    // (At least 57 bits are read: all 19 lengths.)
    let mut w = w & ((1u64 << (3 * hclen)) - 1);
    let mut sum = 0;
    while w != 0 {
        sum += u32::from(KRAFT4[(w & 0xFFF) as usize]);
        w >>= 12;
    }
    sum == 1 << 7
}

/// For four three-bit code lengths, the sum of their Kraft terms in units of 2^-7.
static KRAFT4: [u16; 4096] = {
    let mut t = [0u16; 4096];
    let mut x = 0;
    while x < 4096 {
        let mut j = 0;
        while j < 4 {
            let l = (x >> (3 * j)) & 7;
            if l > 0 {
                t[x] += 1 << (7 - l);
            }
            j += 1;
        }
        x += 1;
    }
    t
};

/// Whether zlib's `inflate_table` builds a literal/length or distance code of these lengths.
fn builds(lens: &[u8], distances: bool) -> bool {
    let Some(sum) = kraft(lens, 15) else { return false };
    let used = lens.iter().filter(|&&l| l > 0).count();
    sum == 1 << 15 || (used == 1 && lens.contains(&1)) || (distances && used == 0)
}

/// The Kraft sum of the code lengths, in units of 2^-`max`; `None` when over-subscribed.
fn kraft(lens: &[u8], max: u32) -> Option<u32> {
    let sum: u32 = lens.iter().filter(|&&l| l > 0).map(|&l| 1u32 << (max - u32::from(l))).sum();
    (sum <= 1 << max).then_some(sum)
}

/// For each value of the next seven bits, the code-length code's symbol and its length
/// (canonical codes, sent first bit first, so reversed against the bit order).
fn decode_table(cl: &[u8; 19]) -> [(u8, u8); 128] {
    let mut count = [0u16; 8];
    for &l in cl {
        count[l as usize] += 1;
    }
    count[0] = 0;
    let mut next = [0u16; 8];
    for len in 1..8 {
        next[len] = (next[len - 1] + count[len - 1]) << 1;
    }
    let mut table = [(u8::MAX, 7u8); 128];
    for (sym, &l) in cl.iter().enumerate() {
        if l == 0 {
            continue;
        }
        let code = next[l as usize];
        next[l as usize] += 1;
        let reversed = (code.reverse_bits() >> (16 - l)) as usize;
        for hi in 0..(1usize << (7 - l)) {
            table[reversed | (hi << l)] = (sym as u8, l);
        }
    }
    table
}

/// Inflates the raw deflate data from bit `skip` of `from` (a block start) to the end of its
/// stream with the window before it all `fill`, and gives the output's last at most `keep` bytes;
/// `None` unless the stream ends where the gzip trailer (the last 8 bytes of `from`) begins.
/// What it makes is added to `output`; it gives up once that passes [`MAX_OUTPUT`].
fn inflate_to_end(from: &[u8], skip: usize, fill: u8, keep: usize, output: &mut u64) -> Option<Vec<u8>> {
    use flate2::{Decompress, FlushDecompress, Status};
    const STEP: usize = 256 << 10;
    let data = primed(from, skip, fill);
    let mut z = Decompress::new(false);
    z.set_dictionary(&[fill; WINDOW]).ok()?;
    let mut out: Vec<u8> = Vec::with_capacity(keep + 2 * STEP);
    loop {
        if out.capacity() - out.len() < STEP {
            let drop = out.len().saturating_sub(keep);
            out.drain(..drop);
            out.reserve(STEP);
        }
        let (inn, outn) = (z.total_in(), z.total_out());
        let status = z.decompress_vec(&data[inn as usize..], &mut out, FlushDecompress::None);
        *output += z.total_out() - outn;
        if status.ok()? == Status::StreamEnd {
            break;
        }
        if (z.total_in(), z.total_out()) == (inn, outn) || *output > MAX_OUTPUT {
            return None;
        }
    }
    // The stream ends in the byte before the trailer.
    if data.len() - z.total_in() as usize != TRAILER {
        return None;
    }
    // Not the primer's literals (the first output, where it was all kept), nor more than `keep`.
    let primer = primer_literals(skip) as u64;
    let kept_from = z.total_out() - out.len() as u64;
    let drop = (out.len().saturating_sub(keep) as u64).max(primer.saturating_sub(kept_from));
    out.drain(..drop as usize);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn gzip(data: &[u8], level: u32) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::new(level));
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    /// Text that compresses as a snapshot does: much repetition, some variety.
    fn sample(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed;
        let mut v = Vec::new();
        while v.len() < n {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let words = ["alloc", "free_requested", "free_completed", "segment_alloc", "frames", "size", "addr", "stream"];
            v.extend_from_slice(words[(x >> 33) as usize % words.len()].as_bytes());
            v.extend_from_slice(format!("{}", (x >> 40) % 4096).as_bytes());
        }
        v.truncate(n);
        v
    }

    /// Checks the bytes said to be known against the contents' end; gives how many are known.
    fn check(data: &[u8], bytes: &[u8], known: &[bool]) -> usize {
        assert_eq!(bytes.len(), known.len());
        assert!(bytes.len() <= data.len(), "{} bytes given of contents of {}", bytes.len(), data.len());
        let at = data.len() - bytes.len();
        for (i, (&b, &k)) in bytes.iter().zip(known).enumerate() {
            assert!(!k || b == data[at + i], "byte {} of {} said known, but wrong", at + i, data.len());
        }
        known.iter().filter(|&&k| k).count()
    }

    #[test]
    fn the_known_bytes_are_the_contents_bytes() {
        for (n, level) in [(3 << 20, 6), (3 << 20, 9), (5 << 20, 2), (100_000, 6), (2_000, 9)] {
            let mut data = sample(n, n as u64 + u64::from(level));
            data.extend_from_slice(b"THE END: settings");
            let gz = gzip(&data, level);
            let from = gz.len().saturating_sub(SEARCH as usize);
            let known = known_tail_of(&gz[from..], 1 << 20, |b, k| Some(check(&data, b, k))).expect("a block start");
            assert!(known >= 17, "{n} bytes at level {level}: only {known} known");
        }
    }

    /// Sync flushes (as pigz writes between its chunks) put empty stored blocks between the
    /// others, which must find their byte boundary where the compressor put it, whatever bit of
    /// a byte the block inflated from starts at.
    #[test]
    fn stored_blocks_after_the_start_keep_their_byte_boundaries() {
        let mut data = sample(2 << 20, 11);
        data.extend_from_slice(b"THE END: settings");
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::new(6));
        for chunk in data.chunks(20_000) {
            e.write_all(chunk).unwrap();
            e.flush().unwrap();
        }
        let gz = e.finish().unwrap();
        assert!(gz.windows(4).filter(|w| *w == [0, 0, 0xFF, 0xFF]).count() >= 50, "the sync flushes are there");
        let from = gz.len() - SEARCH as usize;
        // Inflated from a block before the last flush: through its stored block.
        let mut seen = Vec::new();
        let got = known_tail_of(&gz[from..], 1 << 20, |b, k| {
            seen.push((b.len(), check(&data, b, k)));
            (b.len() > 30_000).then_some(())
        });
        assert!(got.is_some(), "{seen:?}");
        assert!(seen.iter().all(|&(_, known)| known >= 17), "{seen:?}");
    }

    #[test]
    fn the_search_goes_back_until_the_caller_has_what_it_wants() {
        let data = sample(4 << 20, 7);
        let gz = gzip(&data, 9);
        let from = gz.len() - SEARCH as usize;
        let mut seen = Vec::new();
        let got = known_tail_of(&gz[from..], 1 << 20, |b, k| {
            seen.push((b.len(), check(&data, b, k)));
            (b.len() >= 300_000).then_some(b.len())
        });
        assert!(got.is_some(), "{seen:?}");
        // Each earlier block start gives more bytes, and knows at least what the later one knew.
        assert!(seen.len() >= 2 && seen.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1), "{seen:?}");
    }

    #[test]
    fn what_is_not_deflate_gives_nothing() {
        assert_eq!(known_tail_of(&[0u8; 100], 10, |t, _| Some(t.len())), None);
        assert_eq!(known_tail_of(&[1, 2, 3], 10, |t, _| Some(t.len())), None);
        let mut gz = gzip(&sample(1 << 20, 3), 6);
        let n = gz.len();
        gz.truncate(n - 1000);
        assert_eq!(known_tail_of(&gz, 10, |t, _| Some(t.len())), None);
    }
}
