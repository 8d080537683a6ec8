//! Sizes as users write them (`512M`, `2G`, `64KiB`): the command line's `--cache-size`,
//! `--entry-spacing` and `--keep`, and the Python package's `cache_size` and `keep`
//! (through the extension), so both read a size the same way.

/// A size that is not one.
#[derive(Debug, thiserror::Error)]
pub enum SizeError {
    #[error("unknown size suffix in {0:?}; use K, M, G or T")]
    Suffix(String),
    #[error("{0:?} is not a size; write it like 512M or 2G")]
    NotASize(String),
    #[error("size {0:?} is out of range")]
    Range(String),
}

/// Parses a number of bytes with an optional suffix K, M, G or T (powers of 1024, either
/// case, `B` or `iB` after it allowed: `512M`, `512mb`, `64KiB`), or a plain number
/// (`1048576`, `512B`). A fraction counts whole bytes (`1.5K` is 1536). Negative sizes and
/// sizes past 2^64 - 1 are out of range.
pub fn parse_size(s: &str) -> Result<u64, SizeError> {
    let t = s.trim();
    let (num, shift) = split_unit(t).ok_or_else(|| SizeError::Suffix(s.to_owned()))?;
    let num = num.trim();
    let range = || SizeError::Range(s.to_owned());
    // Whole numbers exactly (past 2^53 a float would round them), fractions as floats.
    if let Ok(n) = num.parse::<u64>() {
        return n.checked_mul(1 << shift).ok_or_else(range);
    }
    let n: f64 = num
        .parse()
        .ok()
        .filter(|n: &f64| n.is_finite())
        .ok_or_else(|| SizeError::NotASize(s.to_owned()))?;
    let bytes = n * (1u64 << shift) as f64;
    // 2^64, the first value a u64 cannot hold.
    if !(0.0..18_446_744_073_709_551_616.0).contains(&bytes) {
        return Err(range());
    }
    Ok(bytes as u64)
}

/// Splits `t` into its number and the shift its unit stands for (0 for none, or a bare
/// `B`); `None` for a suffix that is not a size's.
fn split_unit(t: &str) -> Option<(&str, u32)> {
    let lower = t.to_ascii_lowercase();
    // What may follow the unit's letter.
    let (rest, after) = match lower.strip_suffix("ib") {
        Some(rest) => (rest, "ib"),
        None => lower
            .strip_suffix('b')
            .map_or((lower.as_str(), ""), |rest| (rest, "b")),
    };
    let shift = match rest.chars().last() {
        Some('k') => 10,
        Some('m') => 20,
        Some('g') => 30,
        Some('t') => 40,
        // A number of bytes (`1048576`, `512B`); whether it is a number is the caller's.
        Some(c) if !c.is_ascii_alphabetic() && after != "ib" => return Some((&t[..rest.len()], 0)),
        None if after != "ib" => return Some(("", 0)),
        _ => return None,
    };
    Some((&t[..rest.len() - 1], shift))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(s: &str) -> u64 {
        parse_size(s).unwrap_or_else(|e| panic!("{s:?}: {e}"))
    }

    #[test]
    fn suffixes_are_powers_of_1024_in_either_case() {
        assert_eq!(ok("1048576"), 1 << 20);
        assert_eq!(ok("512M"), 512 << 20);
        assert_eq!(ok("512m"), 512 << 20);
        assert_eq!(ok("2G"), 2 << 30);
        assert_eq!(ok("3T"), 3 << 40);
        assert_eq!(ok("128K"), 128 << 10);
        assert_eq!(ok("64KiB"), 64 << 10);
        assert_eq!(ok("64kib"), 64 << 10);
        assert_eq!(ok("64KB"), 64 << 10);
        assert_eq!(ok("64kb"), 64 << 10);
        assert_eq!(ok("512B"), 512);
        assert_eq!(ok(" 512 M "), 512 << 20);
    }

    #[test]
    fn zero_fractions_and_exponents() {
        assert_eq!(ok("0"), 0);
        assert_eq!(ok("0K"), 0);
        assert_eq!(ok("1.5K"), 1536);
        assert_eq!(ok("0.5"), 0);
        assert_eq!(ok("1e3"), 1000);
        assert_eq!(ok("1e3K"), 1_024_000);
    }

    #[test]
    fn the_whole_range_of_u64_and_no_further() {
        assert_eq!(ok("18446744073709551615"), u64::MAX);
        assert_eq!(ok("16777215T"), 16_777_215 << 40);
        assert!(matches!(parse_size("16777216T"), Err(SizeError::Range(_))));
        assert!(ok("16777215.9999T") > 16_777_215 << 40);
        assert!(matches!(parse_size("1e30"), Err(SizeError::Range(_))));
        assert!(matches!(parse_size("-1"), Err(SizeError::Range(_))));
        assert!(matches!(parse_size("-1K"), Err(SizeError::Range(_))));
    }

    #[test]
    fn what_is_not_a_size_says_how_to_write_one() {
        for s in ["5X", "lots", "512BB", "512iB", "512I", "inf", "nan", "1Mx"] {
            let e = parse_size(s).expect_err(s);
            assert!(matches!(e, SizeError::Suffix(_)), "{s:?}: {e}");
        }
        for s in [
            "", " ", "B", "G", "KiB", "1KK", "1_000", "1.2.3", "M5M", "0x10", "infK",
        ] {
            let e = parse_size(s).expect_err(s);
            assert!(matches!(e, SizeError::NotASize(_)), "{s:?}: {e}");
        }
        assert_eq!(
            parse_size("5X").unwrap_err().to_string(),
            "unknown size suffix in \"5X\"; use K, M, G or T"
        );
        assert_eq!(
            parse_size("").unwrap_err().to_string(),
            "\"\" is not a size; write it like 512M or 2G"
        );
    }
}
