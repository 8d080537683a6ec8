//! The 512-byte tar header in its dialects (v7, ustar, GNU, PAX), and PAX records.

use crate::error::{Error, Result};

pub const BLOCK: u64 = 512;

/// (offset, length) runs of data in a sparse file.
pub type SparseMap = Vec<(u64, u64)>;

/// One decoded header block.
#[derive(Debug, Clone)]
pub struct Header<'a> {
    raw: &'a [u8; 512],
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    V7,
    Ustar,
    Gnu,
}

impl<'a> Header<'a> {
    pub fn new(raw: &'a [u8; 512]) -> Header<'a> {
        Header { raw }
    }

    pub fn is_zero(&self) -> bool {
        self.raw.iter().all(|&b| b == 0)
    }

    /// Whether the stored checksum matches (tar writers differ on signed or unsigned sums).
    pub fn checksum_ok(&self) -> bool {
        let Ok(stored) = octal(&self.raw[148..156]) else {
            return false;
        };
        let mut unsigned = 0u64;
        let mut signed = 0i64;
        for (i, &b) in self.raw.iter().enumerate() {
            let b = if (148..156).contains(&i) { b' ' } else { b };
            unsigned += u64::from(b);
            signed += i64::from(b as i8);
        }
        stored == unsigned || stored as i64 == signed
    }

    pub fn dialect(&self) -> Dialect {
        match &self.raw[257..265] {
            b"ustar\x0000" => Dialect::Ustar,
            b"ustar  \x00" => Dialect::Gnu,
            m if &m[..5] == b"ustar" => Dialect::Ustar,
            _ => Dialect::V7,
        }
    }

    pub fn typeflag(&self) -> u8 {
        self.raw[156]
    }

    /// The name field joined with the ustar prefix (GNU headers use that space for
    /// other fields).
    pub fn path(&self) -> Vec<u8> {
        let name = c_str(&self.raw[0..100]);
        if self.dialect() == Dialect::Ustar {
            let prefix = c_str(&self.raw[345..500]);
            if !prefix.is_empty() {
                let mut p = prefix.to_vec();
                p.push(b'/');
                p.extend_from_slice(name);
                return p;
            }
        }
        name.to_vec()
    }

    pub fn link_name(&self) -> Vec<u8> {
        c_str(&self.raw[157..257]).to_vec()
    }

    pub fn mode(&self) -> Result<u32> {
        Ok(number(&self.raw[100..108])? as u32)
    }
    pub fn uid(&self) -> Result<u64> {
        number(&self.raw[108..116])
    }
    pub fn gid(&self) -> Result<u64> {
        number(&self.raw[116..124])
    }
    pub fn size(&self) -> Result<u64> {
        number(&self.raw[124..136])
    }
    pub fn mtime(&self) -> Result<i64> {
        signed_number(&self.raw[136..148])
    }
    pub fn dev(&self) -> Result<(u64, u64)> {
        if self.dialect() == Dialect::V7 {
            return Ok((0, 0));
        }
        Ok((number(&self.raw[329..337])?, number(&self.raw[337..345])?))
    }

    /// Old GNU sparse header: up to 4 (offset, length) pairs and whether extension
    /// blocks follow. (Its real size is not the file's: GNU tar extracts as far as the
    /// map reaches.)
    pub fn gnu_sparse(&self) -> Result<(SparseMap, bool)> {
        let mut map = Vec::new();
        for i in 0..4 {
            let at = 386 + i * 24;
            if self.raw[at] == 0 {
                break;
            }
            map.push((
                number(&self.raw[at..at + 12])?,
                number(&self.raw[at + 12..at + 24])?,
            ));
        }
        Ok((map, self.raw[482] != 0))
    }
}

/// An old GNU sparse extension block: 21 pairs and a continuation flag.
pub fn gnu_sparse_ext(raw: &[u8; 512]) -> Result<(SparseMap, bool)> {
    let mut map = Vec::new();
    for i in 0..21 {
        let at = i * 24;
        if raw[at] == 0 {
            break;
        }
        map.push((number(&raw[at..at + 12])?, number(&raw[at + 12..at + 24])?));
    }
    Ok((map, raw[504] != 0))
}

/// The length of `b` up to its first NUL: where every extractor ends a name.
pub fn c_len(b: &[u8]) -> usize {
    b.iter().position(|&c| c == 0).unwrap_or(b.len())
}

/// `b` up to its first NUL.
pub fn c_str(b: &[u8]) -> &[u8] {
    &b[..c_len(b)]
}

fn octal(field: &[u8]) -> Result<u64> {
    let s = c_str(field);
    let s: &[u8] = {
        let start = s.iter().position(|&c| c != b' ').unwrap_or(s.len());
        let end = s.iter().rposition(|&c| c != b' ').map_or(start, |e| e + 1);
        &s[start..end.max(start)]
    };
    let mut n: u64 = 0;
    for &c in s {
        if !(b'0'..=b'7').contains(&c) {
            return Err(Error::corrupt(format!(
                "tar header has a bad number {:?}",
                String::from_utf8_lossy(field)
            )));
        }
        n = n
            .checked_mul(8)
            .and_then(|n| n.checked_add(u64::from(c - b'0')))
            .ok_or_else(|| Error::corrupt("tar header number overflows"))?;
    }
    Ok(n)
}

/// Octal, or GNU's base-256 (first byte 0x80) for values that do not fit.
fn number(field: &[u8]) -> Result<u64> {
    match field[0] {
        0x80 => {
            let mut n: u64 = 0;
            for &b in &field[1..] {
                if n >> 56 != 0 {
                    return Err(Error::corrupt("tar header number overflows"));
                }
                n = (n << 8) | u64::from(b);
            }
            Ok(n)
        }
        0xff => Err(Error::corrupt("negative number in a tar header field")),
        _ => octal(field),
    }
}

/// Like `number`, but base-256 may be negative (mtimes before 1970).
fn signed_number(field: &[u8]) -> Result<i64> {
    if field[0] == 0xff {
        let mut n: i64 = -1;
        for &b in &field[1..] {
            n = (n << 8) | i64::from(b);
        }
        return Ok(n);
    }
    number(field).map(|n| n as i64)
}

/// A PAX record's key and value.
pub type PaxRecord<'a> = (&'a [u8], &'a [u8]);

/// The `key=value` records of a PAX extended header, up to the first malformed one, and
/// why that one is (GNU tar, too, applies the records before it and goes on).
pub fn pax_records(data: &[u8]) -> (Vec<PaxRecord<'_>>, Option<&'static str>) {
    let mut out = Vec::new();
    let mut rest = data;
    while !rest.is_empty() {
        if rest.iter().all(|&b| b == 0) {
            break;
        }
        let Some(sp) = rest.iter().position(|&b| b == b' ') else {
            return (out, Some("a record without a length"));
        };
        let Some(len) = std::str::from_utf8(&rest[..sp])
            .ok()
            .and_then(|s| s.parse::<usize>().ok())
        else {
            return (out, Some("a record with a bad length"));
        };
        if len <= sp + 1 || len > rest.len() || rest[len - 1] != b'\n' {
            return (out, Some("a record whose length does not fit"));
        }
        let record = &rest[sp + 1..len - 1];
        let Some(eq) = record.iter().position(|&b| b == b'=') else {
            return (out, Some("a record without '='"));
        };
        out.push((&record[..eq], &record[eq + 1..]));
        rest = &rest[len..];
    }
    (out, None)
}

/// A PAX time like `1700000000.123456789` or `-1.5`, as seconds and nanoseconds.
pub fn pax_time(v: &[u8]) -> Option<(i64, u32)> {
    let s = std::str::from_utf8(v).ok()?;
    let (neg, s) = match s.strip_prefix('-') {
        Some(r) => (true, r),
        None => (false, s),
    };
    let (int, frac) = s.split_once('.').unwrap_or((s, ""));
    let secs: i64 = int.parse().ok()?;
    let mut nanos = 0u32;
    for (i, c) in frac.bytes().take(9).enumerate() {
        if !c.is_ascii_digit() {
            return None;
        }
        nanos += u32::from(c - b'0') * 10u32.pow(8 - i as u32);
    }
    if neg {
        if nanos == 0 {
            Some((-secs, 0))
        } else {
            Some((-secs - 1, 1_000_000_000 - nanos))
        }
    } else {
        Some((secs, nanos))
    }
}

pub fn pax_number(v: &[u8]) -> Option<u64> {
    std::str::from_utf8(v).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_in_octal_and_base256() {
        assert_eq!(number(b"0000644\0").unwrap(), 0o644);
        assert_eq!(number(b"   755 \0").unwrap(), 0o755);
        let mut big = [0u8; 12];
        big[0] = 0x80;
        big[11] = 1;
        big[10] = 2;
        assert_eq!(number(&big).unwrap(), 0x201);
        let neg = [0xffu8; 12];
        assert_eq!(signed_number(&neg).unwrap(), -1);
        assert!(number(b"12x4\0\0\0\0").is_err());
    }

    #[test]
    fn pax_records_and_times() {
        let data = b"30 mtime=1700000000.123456789\n20 path=a/b c/d.txt\n";
        let (r, bad) = pax_records(data);
        assert_eq!(bad, None);
        assert_eq!(r[0].0, b"mtime");
        assert_eq!(pax_time(r[0].1), Some((1_700_000_000, 123_456_789)));
        assert_eq!(r[1].1, b"a/b c/d.txt");
        assert_eq!(pax_time(b"-1.5"), Some((-2, 500_000_000)));
        assert_eq!(
            pax_records(b"99 path=x\n").1,
            Some("a record whose length does not fit")
        );
        // The records before a malformed one stand.
        let (r, bad) = pax_records(b"10 path=a\nxx path=b\n");
        assert_eq!(
            (r, bad),
            (
                vec![(&b"path"[..], &b"a"[..])],
                Some("a record with a bad length")
            )
        );
    }
}
