//! Byte sizes on the command line and in Python: `1073741824`, `2e9`, `24GiB`, `1.5 GiB`,
//! `512MiB`, `64K` (binary, as `K`/`M`/`G`/`T` are in `PYTORCH_CUDA_ALLOC_CONF` and PyTorch's
//! messages). Decimal units (`KB`, `MB`, `GB`, `TB`) are refused with a hint: a PyTorch user's
//! "2GB" usually means the 2 GiB PyTorch prints, while its letter means 2,000,000,000 bytes, and
//! the difference (7%) is the size of many OOMs.

/// Bytes from a size.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    // A plain number, in any notation a float has (`2e9`), that is a whole number of bytes.
    if let Ok(v) = t.parse::<u64>() {
        return Ok(v);
    }
    if !t.is_empty() && t.chars().all(|c| c.is_ascii_digit() || matches!(c, '.' | 'e' | 'E' | '+' | '-')) {
        return match t.parse::<f64>() {
            Ok(v) if (0.0..1.8e19).contains(&v) && v.fract() == 0.0 => Ok(v as u64),
            Ok(_) => Err(format!("size {s:?} is not a whole number of bytes in range")),
            Err(_) => Err(format!("bad number in size {s:?}")),
        };
    }
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let unit = unit.trim();
    if num.is_empty() {
        return Err(format!("no number in size {s:?} (write e.g. 24GiB, or the bytes)"));
    }
    let mult: f64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1048576.0,
        "g" | "gib" => 1073741824.0,
        "t" | "tib" => 1099511627776.0,
        "kb" | "mb" | "gb" | "tb" => {
            let binary = format!("{}iB", &unit[..1].to_ascii_uppercase());
            let decimal = match unit.to_ascii_lowercase().as_str() {
                "kb" => 1e3,
                "mb" => 1e6,
                "gb" => 1e9,
                _ => 1e12,
            };
            let bytes = num.parse::<f64>().map(|v| format!("{:.0}", v * decimal)).unwrap_or_else(|_| "the bytes".into());
            return Err(format!(
                "size {s:?}: {unit} is ambiguous: write {num}{binary} for what PyTorch prints as {num} {binary}, or {bytes} for {num}×10^{} bytes",
                match unit.to_ascii_lowercase().as_str() {
                    "kb" => 3,
                    "mb" => 6,
                    "gb" => 9,
                    _ => 12,
                }
            ));
        }
        _ => return Err(format!("unknown size unit {unit:?} in {s:?} (use bytes, KiB, MiB, GiB or TiB)")),
    };
    let v: f64 = num.parse().map_err(|_| format!("bad number in size {s:?}"))?;
    let bytes = v * mult;
    if !(0.0..1.8e19).contains(&bytes) {
        return Err(format!("size {s:?} out of range"));
    }
    Ok(bytes.round() as u64)
}

/// A list of sizes as the command line takes one: comma-separated (`24GiB,80GiB`).
pub fn parse_sizes(s: &str) -> Result<Vec<u64>, String> {
    s.split(',').filter(|x| !x.trim().is_empty()).map(parse_size).collect()
}

#[cfg(test)]
mod tests {
    use super::{parse_size, parse_sizes};
    #[test]
    fn sizes() {
        assert_eq!(parse_size("1073741824"), Ok(1 << 30));
        assert_eq!(parse_size("2e9"), Ok(2_000_000_000));
        assert_eq!(parse_size("24GiB"), Ok(24 << 30));
        assert_eq!(parse_size("24G"), Ok(24 << 30));
        assert_eq!(parse_size("1.5 GiB"), Ok(3 << 29));
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("GiB").is_err());
        assert!(parse_size("1.5").is_err(), "not a whole number of bytes");
        assert!(parse_size("-5").is_err());
        let e = parse_size("2GB").unwrap_err();
        assert!(e.contains("2GiB") && e.contains("2000000000"), "{e}");
        assert_eq!(parse_sizes("24GiB, 80GiB"), Ok(vec![24 << 30, 80 << 30]));
    }
}
