//! Byte sizes on the command line: `1073741824`, `24GiB`, `1.5 GiB`, `512MiB`, `80GB` (decimal).

pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let unit = unit.trim();
    let mult: f64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1048576.0,
        "g" | "gib" => 1073741824.0,
        "t" | "tib" => 1099511627776.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        _ => return Err(format!("unknown size unit {unit:?} in {s:?} (use bytes, KiB, MiB, GiB, TiB, KB, MB, GB or TB)")),
    };
    if num.is_empty() {
        return Err(format!("no number in size {s:?}"));
    }
    if (unit.is_empty() || mult == 1.0)
        && let Ok(v) = num.parse::<u64>() {
            return Ok(v);
        }
    let v: f64 = num.parse().map_err(|_| format!("bad number in size {s:?}"))?;
    let bytes = v * mult;
    if !(0.0..1.8e19).contains(&bytes) {
        return Err(format!("size {s:?} out of range"));
    }
    Ok(bytes.round() as u64)
}

#[cfg(test)]
mod tests {
    use super::parse_size;
    #[test]
    fn sizes() {
        assert_eq!(parse_size("1073741824"), Ok(1 << 30));
        assert_eq!(parse_size("24GiB"), Ok(24 << 30));
        assert_eq!(parse_size("1.5 GiB"), Ok(3 << 29));
        assert_eq!(parse_size("80GB"), Ok(80_000_000_000));
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("GiB").is_err());
    }
}
