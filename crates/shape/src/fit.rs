//! A request's size as a function of a shape value (a batch size, a sequence length, an image
//! side), from the sizes it had at the recorded values: constant, exactly affine (`a + b·x`, `b`
//! a fraction), exactly quadratic (image sides; attention without a fused kernel), else piecewise
//! linear between the recorded points (and said, with how far the points are from a line).
//!
//! A fit is *exact* when it goes through every recorded point; it is *checked* when there is a
//! point it was not made from (a constant from one point, a line from two, a parabola from
//! three): see [`SizeFit::checked_by`]. Arithmetic is on integers (`i128`): a size is never
//! rounded on the way, only the final value at an unrecorded point (to the nearest byte).

use serde::Serialize;

/// How one request's size follows the shape value.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SizeFit {
    /// The same size at every recorded value.
    Constant { size: u64 },
    /// `size(x) = y0 + (x − x0)·num/den` through every recorded point.
    Affine { x0: u64, y0: u64, num: i64, den: u64 },
    /// The parabola through these three points goes through every recorded point (and no line
    /// does).
    Quadratic { points: [(u64, u64); 3] },
    /// No line or parabola goes through every point: linear between neighbouring recorded
    /// values, extended from the outermost two beyond them. `deviation`: the largest distance
    /// (bytes) of a point from the line through the outermost two.
    Piecewise { points: Vec<(u64, u64)>, deviation: u64 },
}

/// Why a size cannot be predicted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SizeError {
    /// The fitted size is zero or negative at this value.
    NotPositive(i128),
    /// The value is too far out for the arithmetic, or the size beyond 64 bits.
    Overflow,
}

/// The recorded points with one point per value, in increasing value: two points at one value
/// with different sizes keep the larger.
pub fn distinct_points(points: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut pts: Vec<(u64, u64)> = points.to_vec();
    pts.sort();
    let mut dedup: Vec<(u64, u64)> = Vec::with_capacity(pts.len());
    for (x, y) in pts {
        match dedup.last_mut() {
            Some(last) if last.0 == x => last.1 = last.1.max(y),
            _ => dedup.push((x, y)),
        }
    }
    dedup
}

impl SizeFit {
    /// The fit through `points` (value, requested bytes); at least one point. Two points at one
    /// value with different sizes keep the larger ([`distinct_points`]). The simplest exact fit
    /// wins: constant, then affine, then quadratic (three values at least), else piecewise.
    pub fn from_points(points: &[(u64, u64)]) -> SizeFit {
        let pts = distinct_points(points);
        if pts.iter().all(|p| p.1 == pts[0].1) {
            return SizeFit::Constant { size: pts[0].1 };
        }
        // pts has at least two distinct values here (sizes differ).
        let (first, last) = (pts[0], pts[pts.len() - 1]);
        let dx = (last.0 - first.0) as i128;
        let dy = last.1 as i128 - first.1 as i128;
        let g = gcd(dy.unsigned_abs(), dx as u128).max(1) as i128;
        let (num, den) = (dy / g, dx / g);
        let on_line = |(x, y): (u64, u64)| (y as i128 - first.1 as i128) * den == (x as i128 - first.0 as i128) * num;
        if pts.iter().all(|&p| on_line(p)) {
            return SizeFit::Affine { x0: first.0, y0: first.1, num: num as i64, den: den as u64 };
        }
        if pts.len() >= 3 {
            let three = [first, pts[pts.len() / 2], last];
            if pts.iter().all(|&(x, y)| parabola(&three, x).is_some_and(|(n, d)| n == y as i128 * d)) {
                return SizeFit::Quadratic { points: three };
            }
        }
        let deviation = pts
            .iter()
            .map(|&(x, y)| {
                let line = first.1 as f64 + (x as f64 - first.0 as f64) * num as f64 / den as f64;
                (y as f64 - line).abs().round() as u64
            })
            .max()
            .unwrap_or(0);
        SizeFit::Piecewise { points: pts, deviation }
    }

    /// The size at value `x` (rounded to the nearest byte where the fit falls between).
    pub fn at(&self, x: u64) -> Result<u64, SizeError> {
        let v: i128 = match self {
            SizeFit::Constant { size } => return Ok(*size),
            SizeFit::Affine { x0, y0, num, den } => line(*x0, *y0, *num as i128, *den as i128, x),
            SizeFit::Quadratic { points } => {
                if let Some(&(_, y)) = points.iter().find(|p| p.0 == x) {
                    return Ok(y);
                }
                let (n, d) = parabola(points, x).ok_or(SizeError::Overflow)?;
                nearest(n, d)
            }
            SizeFit::Piecewise { points, .. } => {
                if let Some(&(_, y)) = points.iter().find(|p| p.0 == x) {
                    return Ok(y);
                }
                // The segment holding x, else the outermost one on its side.
                let k = points.partition_point(|p| p.0 < x).clamp(1, points.len() - 1);
                let (a, b) = (points[k - 1], points[k]);
                line(a.0, a.1, b.1 as i128 - a.1 as i128, (b.0 - a.0) as i128, x)
            }
        };
        if v <= 0 { Err(SizeError::NotPositive(v)) } else { u64::try_from(v).map_err(|_| SizeError::Overflow) }
    }

    /// Whether every recorded point lies on the fit (constant, affine or quadratic).
    pub fn is_exact(&self) -> bool {
        !matches!(self, SizeFit::Piecewise { .. })
    }

    /// How many recorded values the fit is made from: 1 (constant), 2 (a line), 3 (a parabola),
    /// every one (piecewise).
    pub fn parameters(&self) -> usize {
        match self {
            SizeFit::Constant { .. } => 1,
            SizeFit::Affine { .. } => 2,
            SizeFit::Quadratic { .. } => 3,
            SizeFit::Piecewise { points, .. } => points.len(),
        }
    }

    /// Whether an exact fit through `values` distinct recorded values was checked on a value it
    /// was not made from.
    pub fn checked_by(&self, values: usize) -> bool {
        self.is_exact() && values > self.parameters()
    }

    /// The fit's name in words.
    pub fn kind(&self) -> &'static str {
        match self {
            SizeFit::Constant { .. } => "constant",
            SizeFit::Affine { .. } => "affine",
            SizeFit::Quadratic { .. } => "quadratic",
            SizeFit::Piecewise { .. } => "piecewise",
        }
    }
}

/// `y0 + (x − x0)·num/den`, to the nearest integer (halves away from zero).
fn line(x0: u64, y0: u64, num: i128, den: i128, x: u64) -> i128 {
    let t = (x as i128 - x0 as i128) * num;
    y0 as i128 + nearest(t, den)
}

/// `n / d` (`d > 0`) to the nearest integer, halves away from zero.
fn nearest(n: i128, d: i128) -> i128 {
    if n >= 0 { (2 * n + d) / (2 * d) } else { -((-2 * n + d) / (2 * d)) }
}

/// The parabola through three points of distinct values at `x`, as a fraction `(n, d)` with
/// `d > 0` (Lagrange's form over the common denominator); `None` on overflow.
fn parabola(p: &[(u64, u64); 3], x: u64) -> Option<(i128, i128)> {
    let [(a, ya), (b, yb), (c, yc)] = p.map(|(x, y)| (x as i128, y as i128));
    let x = x as i128;
    // ya·(x−b)(x−c)/((a−b)(a−c)) + yb·(x−a)(x−c)/((b−a)(b−c)) + yc·(x−a)(x−b)/((c−a)(c−b)),
    // over d = (a−b)(a−c)(b−c): the terms' numerators ya·(x−b)(x−c)·(b−c), −yb·(x−a)(x−c)·(a−c),
    // yc·(x−a)(x−b)·(a−b).
    let m = |u: i128, v: i128| u.checked_mul(v);
    let ta = m(m(m(ya, x - b)?, x - c)?, b - c)?;
    let tb = m(m(m(yb, x - a)?, x - c)?, a - c)?;
    let tc = m(m(m(yc, x - a)?, x - b)?, a - b)?;
    let n = ta.checked_sub(tb)?.checked_add(tc)?;
    let d = m(m(a - b, a - c)?, b - c)?;
    if d == 0 {
        return None;
    }
    Some(if d < 0 { (-n, -d) } else { (n, d) })
}

fn gcd(mut a: u128, mut b: u128) -> u128 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn affine_through_every_point() {
        // An activation of bs × 16 × 1024 floats, and a bias of 4096 bytes on top.
        let pts: Vec<(u64, u64)> = [1u64, 2, 4, 8, 256].iter().map(|&b| (b, 65536 * b + 4096)).collect();
        let f = SizeFit::from_points(&pts);
        assert_eq!(f, SizeFit::Affine { x0: 1, y0: 69632, num: 65536, den: 1 });
        assert_eq!(f.at(512), Ok(65536 * 512 + 4096));
        assert_eq!(f.at(3), Ok(65536 * 3 + 4096));
        assert!(f.checked_by(5));
        assert!(!SizeFit::from_points(&pts[..2]).checked_by(2));
    }

    #[test]
    fn fractional_slope_and_constant() {
        let f = SizeFit::from_points(&[(2, 10), (4, 13), (6, 16)]);
        assert_eq!(f, SizeFit::Affine { x0: 2, y0: 10, num: 3, den: 2 });
        assert_eq!(f.at(3), Ok(12)); // 11.5 rounds up
        assert_eq!(SizeFit::from_points(&[(1, 8), (64, 8)]), SizeFit::Constant { size: 8 });
        assert_eq!(SizeFit::from_points(&[(7, 8)]).at(100), Ok(8));
        assert!(!SizeFit::from_points(&[(7, 8)]).checked_by(1));
    }

    #[test]
    fn quadratic_where_no_line_fits() {
        // An attention score matrix: batch 8 × 16 heads × L × L halves, plus 4096 bytes.
        let q = |l: u64| 8 * 16 * l * l * 2 + 4096;
        let pts: Vec<(u64, u64)> = [128u64, 256, 384, 512].iter().map(|&l| (l, q(l))).collect();
        let f = SizeFit::from_points(&pts);
        assert!(matches!(f, SizeFit::Quadratic { .. }), "{f:?}");
        assert!(f.checked_by(4));
        assert_eq!(f.at(4096), Ok(q(4096)));
        assert_eq!(f.at(300), Ok(q(300)));
        // A parabola with a fractional leading term: the nearest byte.
        let f = SizeFit::from_points(&[(1, 1), (2, 2), (3, 4)]); // (x² − x + 2)/2
        assert_eq!(f.at(4), Ok(7));
        assert_eq!(f.at(6), Ok(16));
        // Three points always lie on a parabola: not checked.
        assert!(!f.checked_by(3));
    }

    #[test]
    fn piecewise_where_no_line_fits() {
        let f = SizeFit::from_points(&[(1, 100), (2, 300), (4, 400), (5, 900)]);
        assert!(!f.is_exact());
        assert_eq!(f.at(2), Ok(300));
        assert_eq!(f.at(3), Ok(350));
        assert_eq!(f.at(8), Ok(2400)); // the last segment, extended
        assert_eq!(f.at(0), Err(SizeError::NotPositive(-100)));
        assert_eq!(f.at(u64::MAX), Err(SizeError::Overflow));
        // Not every point on the parabola through the first, middle and last.
        assert_eq!(SizeFit::from_points(&[(1, 100), (2, 300), (4, 400)]).kind(), "quadratic");
    }
}
