//! Grids of allocator settings: `expandable_segments=True,False; max_split_size_mb=none,64,128`.
//! `none` leaves a key out. Values may be lists in brackets (`roundup_power2_divisions=[256:1,>:4]`);
//! commas inside brackets do not separate values.

use allocsim_model::AllocatorConfig;

/// The grid `allocsim sweep` uses when none is given.
pub const DEFAULT_GRID: &str = "expandable_segments=none,True; max_split_size_mb=none,64,128,512; \
     roundup_power2_divisions=none,2,4,8,[256:1,>:4]; garbage_collection_threshold=none,0.6,0.8";

/// One point of a grid: its settings string and, if PyTorch accepts it, the parsed config.
#[derive(Clone, Debug)]
pub struct GridPoint {
    /// The `PYTORCH_CUDA_ALLOC_CONF` string (empty: defaults).
    pub conf: String,
    pub config: Result<AllocatorConfig, String>,
}

/// Splits `s` on `sep` outside brackets.
fn split_outside_brackets(s: &str, sep: char) -> Vec<String> {
    let mut out = Vec::new();
    let mut depth = 0i32;
    let mut cur = String::new();
    for c in s.chars() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            _ => {}
        }
        if c == sep && depth == 0 {
            out.push(std::mem::take(&mut cur));
        } else {
            cur.push(c);
        }
    }
    out.push(cur);
    out
}

/// Parses a grid into its points, in order (the last key varies fastest), each point's settings
/// as PyTorch 2.11 parses them. A `base` settings string, if given, is put before every point's
/// keys (a grid key overrides it, since PyTorch applies keys left to right).
pub fn parse_grid(grid: &str, base: &str) -> Result<Vec<GridPoint>, String> {
    parse_grid_with(grid, base, |conf| AllocatorConfig::parse(conf).map_err(|e| e.to_string()))
}

/// [`parse_grid`] with each point's settings string parsed by `parse` (a trace's release, as
/// `allocsim_replay::Prepared::parse_config` parses a `--config`).
pub fn parse_grid_with(grid: &str, base: &str, parse: impl Fn(&str) -> Result<AllocatorConfig, String>) -> Result<Vec<GridPoint>, String> {
    let mut axes: Vec<(String, Vec<Option<String>>)> = Vec::new();
    for part in split_outside_brackets(grid, ';') {
        let part = part.trim();
        if part.is_empty() {
            continue;
        }
        let (key, values) = part.split_once('=').ok_or_else(|| format!("grid axis {part:?} is not `key=value,value,...`"))?;
        let key = key.trim();
        if key.is_empty() || key.contains(':') || key.contains(',') {
            return Err(format!("bad key {key:?} in grid axis {part:?}"));
        }
        let vals: Vec<Option<String>> = split_outside_brackets(values, ',')
            .into_iter()
            .map(|v| v.trim().to_string())
            .map(|v| if v.eq_ignore_ascii_case("none") || v.is_empty() { None } else { Some(v) })
            .collect();
        if axes.iter().any(|(k, _)| k == key) {
            return Err(format!("key {key:?} appears twice in the grid"));
        }
        axes.push((key.to_string(), vals));
    }
    let mut points = vec![Vec::<String>::new()];
    for (key, vals) in &axes {
        let mut next = Vec::with_capacity(points.len() * vals.len());
        for p in &points {
            for v in vals {
                let mut q = p.clone();
                if let Some(v) = v {
                    q.push(format!("{key}:{v}"));
                }
                next.push(q);
            }
        }
        points = next;
    }
    Ok(points
        .into_iter()
        .map(|keys| {
            let mut parts: Vec<String> = Vec::new();
            if !base.trim().is_empty() {
                parts.push(base.trim().to_string());
            }
            parts.extend(keys);
            let conf = parts.join(",");
            let config = parse(&conf);
            GridPoint { conf, config }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_the_product_with_none_and_lists() {
        let g = parse_grid("expandable_segments=True,False; roundup_power2_divisions=none,[256:1,>:4]", "").unwrap();
        let confs: Vec<&str> = g.iter().map(|p| p.conf.as_str()).collect();
        assert_eq!(
            confs,
            [
                "expandable_segments:True",
                "expandable_segments:True,roundup_power2_divisions:[256:1,>:4]",
                "expandable_segments:False",
                "expandable_segments:False,roundup_power2_divisions:[256:1,>:4]"
            ]
        );
        assert!(g.iter().all(|p| p.config.is_ok()));
        assert_eq!(g[1].config.as_ref().unwrap().roundup_power2_divisions[8], 1);
    }

    #[test]
    fn invalid_points_carry_pytorchs_error() {
        let g = parse_grid("max_split_size_mb=19,64", "").unwrap();
        assert_eq!(g[0].config.as_ref().unwrap_err(), "CachingAllocator option max_split_size_mb too small, must be >= 20");
        assert!(g[1].config.is_ok());
        let g = parse_grid("large_segment_size_mb=64; max_split_size_mb=40", "").unwrap();
        assert!(g[0].config.as_ref().unwrap_err().contains("must be >= 64"), "{:?}", g[0].config);
    }

    #[test]
    fn default_grid_is_valid() {
        let g = parse_grid(DEFAULT_GRID, "").unwrap();
        assert_eq!(g.len(), 2 * 4 * 5 * 3);
        assert!(g.iter().all(|p| p.config.is_ok()), "{:?}", g.iter().find(|p| p.config.is_err()));
    }

    #[test]
    fn malformed_grids_are_refused() {
        assert!(parse_grid("expandable_segments", "").is_err());
        assert!(parse_grid("a=1; a=2", "").is_err());
    }
}
