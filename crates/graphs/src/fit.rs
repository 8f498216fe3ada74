//! A request's size as a function of the batch size, from the sizes it had at the recorded batch
//! sizes: exactly affine (`a + b·bs`, `b` a fraction) where every recorded point lies on one line,
//! else piecewise linear between the recorded points (and said).

use serde::Serialize;

/// How one request's size follows the batch size.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SizeFit {
    /// The same size at every recorded batch size.
    Constant { size: u64 },
    /// `size(bs) = y0 + (bs − x0)·num/den` through every recorded point.
    Affine { x0: u64, y0: u64, num: i64, den: u64 },
    /// No line goes through every point: linear between neighbouring recorded batch sizes,
    /// extended from the outermost two beyond them. `deviation`: the largest distance (bytes)
    /// of a point from the line through the outermost two.
    Piecewise { points: Vec<(u64, u64)>, deviation: u64 },
}

/// Why a size cannot be predicted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SizeError {
    /// The fitted size is zero or negative at this batch size.
    NotPositive(i128),
}

impl SizeFit {
    /// The fit through `points` (batch size, requested bytes); at least one point. Two points at
    /// one batch size with different sizes keep the larger.
    pub fn from_points(points: &[(u64, u64)]) -> SizeFit {
        let mut pts: Vec<(u64, u64)> = points.to_vec();
        pts.sort();
        let mut dedup: Vec<(u64, u64)> = Vec::new();
        for (x, y) in pts {
            match dedup.last_mut() {
                Some(last) if last.0 == x => last.1 = last.1.max(y),
                _ => dedup.push((x, y)),
            }
        }
        let pts = dedup;
        if pts.iter().all(|p| p.1 == pts[0].1) {
            return SizeFit::Constant { size: pts[0].1 };
        }
        // pts has at least two distinct batch sizes here (sizes differ).
        let (first, last) = (pts[0], pts[pts.len() - 1]);
        let dx = (last.0 - first.0) as i128;
        let dy = last.1 as i128 - first.1 as i128;
        let g = gcd(dy.unsigned_abs(), dx as u128).max(1) as i128;
        let (num, den) = (dy / g, dx / g);
        let on_line = |(x, y): (u64, u64)| (y as i128 - first.1 as i128) * den == (x as i128 - first.0 as i128) * num;
        if pts.iter().all(|&p| on_line(p)) {
            return SizeFit::Affine { x0: first.0, y0: first.1, num: num as i64, den: den as u64 };
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

    /// The size at batch size `bs` (rounded to the nearest byte where the line falls between).
    pub fn at(&self, bs: u64) -> Result<u64, SizeError> {
        let v: i128 = match self {
            SizeFit::Constant { size } => return Ok(*size),
            SizeFit::Affine { x0, y0, num, den } => line(*x0, *y0, *num as i128, *den as i128, bs),
            SizeFit::Piecewise { points, .. } => {
                if let Some(&(_, y)) = points.iter().find(|p| p.0 == bs) {
                    return Ok(y);
                }
                // The segment holding bs, else the outermost one on its side.
                let k = points.partition_point(|p| p.0 < bs).clamp(1, points.len() - 1);
                let (a, b) = (points[k - 1], points[k]);
                line(a.0, a.1, b.1 as i128 - a.1 as i128, (b.0 - a.0) as i128, bs)
            }
        };
        if v <= 0 { Err(SizeError::NotPositive(v)) } else { Ok(v as u64) }
    }

    /// Whether every recorded point lies on the fit (constant or affine).
    pub fn is_exact(&self) -> bool {
        !matches!(self, SizeFit::Piecewise { .. })
    }
}

/// `y0 + (x − x0)·num/den`, to the nearest integer (halves away from zero).
fn line(x0: u64, y0: u64, num: i128, den: i128, x: u64) -> i128 {
    let t = (x as i128 - x0 as i128) * num;
    let q = if t >= 0 { (2 * t + den) / (2 * den) } else { -((-2 * t + den) / (2 * den)) };
    y0 as i128 + q
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
    }

    #[test]
    fn fractional_slope_and_constant() {
        let f = SizeFit::from_points(&[(2, 10), (4, 13), (6, 16)]);
        assert_eq!(f, SizeFit::Affine { x0: 2, y0: 10, num: 3, den: 2 });
        assert_eq!(f.at(3), Ok(12)); // 11.5 rounds up
        assert_eq!(SizeFit::from_points(&[(1, 8), (64, 8)]), SizeFit::Constant { size: 8 });
        assert_eq!(SizeFit::from_points(&[(7, 8)]).at(100), Ok(8));
    }

    #[test]
    fn piecewise_where_no_line_fits() {
        let f = SizeFit::from_points(&[(1, 100), (2, 300), (4, 400)]);
        assert!(!f.is_exact());
        assert_eq!(f.at(2), Ok(300));
        assert_eq!(f.at(3), Ok(350));
        assert_eq!(f.at(8), Ok(600)); // the last segment, extended
        assert_eq!(f.at(0), Err(SizeError::NotPositive(-100)));
    }
}
