//! `allocsim compare`: two runs of the same requests side by side.

use std::collections::HashMap;

/// One side of a comparison: its segment events on the request axis and where requests came from.
#[derive(Clone, Debug)]
pub struct Side {
    pub label: String,
    /// Reserved before the first request: the segments a trace that starts mid-history begins
    /// with (`Program::initial`, the one reconstruction of that state), else 0.
    pub reserved_at_start: u64,
    /// (request ordinal, +bytes for alloc/map, −bytes for free/unmap).
    pub reserved_deltas: Vec<(u32, i64)>,
    pub peak_reserved: u64,
    pub peak_allocated: u64,
    pub first_oom: Option<u32>,
    pub requests: u32,
    /// Call site of each request that made a new segment (or mapped pages), with the bytes.
    pub new_segment_sites: Vec<(String, u64)>,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct SiteDiff {
    pub site: String,
    pub a_bytes: u64,
    pub b_bytes: u64,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct Comparison {
    pub a: String,
    pub b: String,
    pub peak_reserved: (u64, u64),
    pub peak_allocated: (u64, u64),
    pub first_oom: (Option<u32>, Option<u32>),
    /// The first request after which reserved memory differs: (request, reserved A, reserved B).
    pub first_divergence: Option<(u32, u64, u64)>,
    /// The request after which the difference in reserved memory is largest.
    pub largest_gap: Option<(u32, u64, u64)>,
    /// Bytes of new segments by call site, largest difference first.
    pub sites: Vec<SiteDiff>,
    pub requests: (u32, u32),
}

/// Reserved bytes after each request 0..n (events at request k happen before or during request k).
fn reserved_after(side: &Side, n: u32) -> Vec<u64> {
    let mut out = vec![0u64; n as usize];
    let mut cur = i64::try_from(side.reserved_at_start).unwrap_or(i64::MAX);
    let mut it = side.reserved_deltas.iter().peekable();
    for (k, slot) in out.iter_mut().enumerate() {
        while let Some(&&(r, d)) = it.peek() {
            if r as usize > k {
                break;
            }
            cur = cur.saturating_add(d);
            it.next();
        }
        *slot = cur.max(0) as u64;
    }
    out
}

pub fn compare(a: &Side, b: &Side) -> Comparison {
    let n = a.requests.min(b.requests);
    let ra = reserved_after(a, n);
    let rb = reserved_after(b, n);
    let first_divergence = (0..n as usize).find(|&k| ra[k] != rb[k]).map(|k| (k as u32, ra[k], rb[k]));
    let largest_gap = (0..n as usize).max_by_key(|&k| ra[k].abs_diff(rb[k])).filter(|&k| ra[k] != rb[k]).map(|k| (k as u32, ra[k], rb[k]));
    let mut sites: HashMap<String, (u64, u64)> = HashMap::new();
    for (s, bytes) in &a.new_segment_sites {
        sites.entry(s.clone()).or_default().0 += bytes;
    }
    for (s, bytes) in &b.new_segment_sites {
        sites.entry(s.clone()).or_default().1 += bytes;
    }
    let mut sites: Vec<SiteDiff> = sites.into_iter().map(|(site, (a_bytes, b_bytes))| SiteDiff { site, a_bytes, b_bytes }).collect();
    sites.sort_by(|x, y| y.a_bytes.abs_diff(y.b_bytes).cmp(&x.a_bytes.abs_diff(x.b_bytes)).then(x.site.cmp(&y.site)));
    Comparison {
        a: a.label.clone(),
        b: b.label.clone(),
        peak_reserved: (a.peak_reserved, b.peak_reserved),
        peak_allocated: (a.peak_allocated, b.peak_allocated),
        first_oom: (a.first_oom, b.first_oom),
        first_divergence,
        largest_gap,
        sites,
        requests: (a.requests, b.requests),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn side(label: &str, deltas: Vec<(u32, i64)>, sites: Vec<(&str, u64)>) -> Side {
        Side {
            label: label.into(),
            reserved_at_start: 0,
            reserved_deltas: deltas,
            peak_reserved: 0,
            peak_allocated: 0,
            first_oom: None,
            requests: 5,
            new_segment_sites: sites.into_iter().map(|(s, b)| (s.to_string(), b)).collect(),
        }
    }

    #[test]
    fn finds_first_divergence_and_attributes_sites() {
        let a = side("a", vec![(0, 20), (2, 20)], vec![("x.py:1", 20), ("y.py:2", 20)]);
        let b = side("b", vec![(0, 20), (3, 60), (4, -60)], vec![("x.py:1", 20), ("y.py:2", 60)]);
        let c = compare(&a, &b);
        assert_eq!(c.first_divergence, Some((2, 40, 20)));
        assert_eq!(c.largest_gap, Some((3, 40, 80)));
        assert_eq!(c.sites[0].site, "y.py:2");
        assert_eq!((c.sites[0].a_bytes, c.sites[0].b_bytes), (20, 60));
    }

    #[test]
    fn reserved_counts_from_the_start_state() {
        let mut a = side("a", vec![(1, 20)], vec![]);
        a.reserved_at_start = 100;
        let b = side("b", vec![(1, 20)], vec![]);
        assert_eq!(reserved_after(&a, 3), vec![100, 120, 120]);
        // Same events from different start states: they differ from the first request.
        assert_eq!(compare(&a, &b).first_divergence, Some((0, 100, 0)));
    }
}
