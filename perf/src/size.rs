//! Message sizes as perftest users write them: `64`, `4K`, `16M`, `1G` (powers of 1024).

/// Parses a size; suffixes K, M, G (optionally followed by B or iB) are powers of 1024.
pub(crate) fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let upper = t.to_ascii_uppercase();
    let stripped = upper
        .strip_suffix("IB")
        .or_else(|| upper.strip_suffix('B'))
        .unwrap_or(&upper);
    let (digits, shift) = match stripped.chars().last() {
        Some('K') => (&stripped[..stripped.len() - 1], 10),
        Some('M') => (&stripped[..stripped.len() - 1], 20),
        Some('G') => (&stripped[..stripped.len() - 1], 30),
        _ => (stripped, 0),
    };
    let n: u64 = digits
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a size (examples: 64, 4K, 16M, 1G)"))?;
    n.checked_mul(1 << shift)
        .ok_or_else(|| format!("{text:?} is too large"))
}

/// perftest's `-a` sizes: every power of two from 2 B to 8 MiB.
pub fn all_sizes() -> Vec<u64> {
    (1..=23).map(|p| 1u64 << p).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_suffixes() {
        assert_eq!(parse_size("64"), Ok(64));
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("16m"), Ok(16 << 20));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("2MB"), Ok(2 << 20));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("").is_err());
        assert!(parse_size("99999999999999G").is_err());
    }

    #[test]
    fn all_sizes_span_2_bytes_to_8_mib() {
        let s = all_sizes();
        assert_eq!((s[0], *s.last().unwrap(), s.len()), (2, 8 << 20, 23));
    }
}
