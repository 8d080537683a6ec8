//! LZO1X decompression with every length and distance checked, after the Linux kernel's
//! `lzo1x_decompress_safe`. Written here because the crate archfs used first indexed out
//! of bounds (a panic) on a damaged block, which fuzzing found within seconds.

/// Why a block does not decode.
pub type Error = &'static str;

struct Input<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Input<'a> {
    fn byte(&mut self) -> Result<usize, Error> {
        let b = *self.buf.get(self.pos).ok_or("input ends early")?;
        self.pos += 1;
        Ok(usize::from(b))
    }

    fn le16(&mut self) -> Result<usize, Error> {
        Ok(self.byte()? | self.byte()? << 8)
    }

    /// A run length continued in zero bytes (255 each) and a final non-zero byte.
    fn long_length(&mut self, base: usize) -> Result<usize, Error> {
        let mut n = base;
        loop {
            match self.byte()? {
                0 => n = n.checked_add(255).ok_or("length overflows")?,
                b => return Ok(n + b),
            }
        }
    }

    /// Length of an M3 or M4 match: the low `mask` bits of `t`, or a long length when they
    /// are zero, plus 2.
    fn match_length(&mut self, t: usize, mask: usize) -> Result<usize, Error> {
        Ok(match t & mask {
            0 => self.long_length(mask)?,
            n => n,
        } + 2)
    }

    fn literals(&mut self, n: usize) -> Result<&'a [u8], Error> {
        let end = self.pos.checked_add(n).ok_or("literal run overflows")?;
        let s = self
            .buf
            .get(self.pos..end)
            .ok_or("literal run past the input")?;
        self.pos = end;
        Ok(s)
    }
}

fn push_literals(out: &mut Vec<u8>, lit: &[u8], limit: usize) -> Result<(), Error> {
    if out.len() + lit.len() > limit {
        return Err("output past the block size");
    }
    out.extend_from_slice(lit);
    Ok(())
}

/// Copies `len` bytes from `dist` bytes back; overlapping copies repeat a pattern.
fn copy_match(out: &mut Vec<u8>, dist: usize, len: usize, limit: usize) -> Result<(), Error> {
    if dist == 0 || dist > out.len() {
        return Err("match reaches before the start of the block");
    }
    if out.len() + len > limit {
        return Err("output past the block size");
    }
    let start = out.len() - dist;
    for i in 0..len {
        let b = out[start + i];
        out.push(b);
    }
    Ok(())
}

/// Decodes one LZO1X block into at most `limit` bytes.
pub fn decompress(src: &[u8], limit: usize) -> Result<Vec<u8>, Error> {
    let mut out = Vec::with_capacity(limit);
    let mut ip = Input { buf: src, pos: 0 };
    // Literals that follow the last match (0-3), or 4 after a literal run.
    let mut state: usize;
    let first = *src.first().ok_or("empty block")? as usize;
    if first > 17 {
        ip.pos = 1;
        let t = first - 17;
        push_literals(&mut out, ip.literals(t)?, limit)?;
        state = if t < 4 { t } else { 4 };
    } else {
        state = 0;
    }
    loop {
        let t = ip.byte()?;
        let (dist, len, next);
        if t < 16 {
            if state == 0 {
                let n = if t == 0 { ip.long_length(15)? } else { t } + 3;
                push_literals(&mut out, ip.literals(n)?, limit)?;
                state = 4;
                continue;
            }
            next = t & 3;
            let h = ip.byte()?;
            if state == 4 {
                (dist, len) = (1 + 0x800 + (t >> 2) + (h << 2), 3);
            } else {
                (dist, len) = (1 + (t >> 2) + (h << 2), 2);
            }
        } else if t >= 64 {
            next = t & 3;
            dist = 1 + ((t >> 2) & 7) + (ip.byte()? << 3);
            len = (t >> 5) + 1;
        } else if t >= 32 {
            len = ip.match_length(t, 31)?;
            let d = ip.le16()?;
            (dist, next) = (1 + (d >> 2), d & 3);
        } else {
            len = ip.match_length(t, 7)?;
            let d = ip.le16()?;
            let far = ((t & 8) << 11) + (d >> 2);
            if far == 0 {
                // The end marker: 0x11 0x00 0x00.
                if len != 3 {
                    return Err("bad end marker");
                }
                if ip.pos != src.len() {
                    return Err("data after the end marker");
                }
                return Ok(out);
            }
            (dist, next) = (far + 0x4000, d & 3);
        }
        copy_match(&mut out, dist, len, limit)?;
        push_literals(&mut out, ip.literals(next)?, limit)?;
        state = next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples() -> Vec<Vec<u8>> {
        let text: Vec<u8> = (0..30_000u32)
            .flat_map(|i| format!("row {} {}\n", i % 97, i % 13).into_bytes())
            .take(100_000)
            .collect();
        let mut noise = Vec::new();
        let mut x = 12345u64;
        for _ in 0..50_000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            noise.push((x >> 56) as u8);
        }
        vec![
            b"a".to_vec(),
            b"abcabcabcabcabcabcabcabc".to_vec(),
            vec![0u8; 131_072],
            text,
            noise,
        ]
    }

    #[test]
    fn decodes_what_an_encoder_wrote() {
        for data in samples() {
            let blob = lzokay_native::compress(&data).unwrap();
            assert_eq!(decompress(&blob, data.len()).unwrap(), data);
            assert!(decompress(&blob, data.len() - 1).is_err());
        }
    }

    #[test]
    fn damaged_input_is_an_error_never_a_panic() {
        let data = &samples()[3];
        let blob = lzokay_native::compress(data).unwrap();
        for cut in [0, 1, 2, 3, blob.len() / 2, blob.len() - 1] {
            assert!(decompress(&blob[..cut], data.len()).is_err());
        }
        let mut x = 7u64;
        for _ in 0..2000 {
            let mut bad = blob.clone();
            for _ in 0..4 {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                let i = (x >> 33) as usize % bad.len();
                bad[i] ^= (x >> 13) as u8 | 1;
            }
            let _ = decompress(&bad, data.len());
        }
        // A match that reaches before the start of the output.
        assert!(decompress(&[0x12, b'x', 0x40, 0xff, 0x11, 0, 0], 100).is_err());
    }
}
