//! bzip2 blocks decoded in parallel: each ~900 kB block (`bzip2`, `lbzip2`, `pbzip2`)
//! starts with a 48-bit magic at any bit offset and depends on nothing before it, so
//! the blocks are found by their magic and each is decoded as a stream of its own: the
//! stream header, the block's bits moved to a byte boundary, an end-of-stream marker
//! whose combined CRC is the block's own (libbz2 checks both).
//!
//! Each block is also an entry point for reads ([`BlockRun`]): a read decodes ~900 kB.
//!
//! A magic can also occur by chance inside compressed data (once in 2^48 bit offsets,
//! about once in 35 TB): such a block fails its CRC and the pass reports damage.

use std::sync::Arc;

use super::parallel_decoder::{DecodeFn, Piece, Split};
use super::read_window::ReadWindow;
use super::{Decoder, Point};
use crate::error::{Error, Result};
use crate::source::Source;

const BLOCK_MAGIC: u64 = 0x3141_5926_5359;
const END_MAGIC: u64 = 0x1772_4538_5090;
/// Archive bytes scanned for magics at a time (from the window's 4 MiB reads).
const SCAN: usize = 64 << 10;
/// Decoded bytes handed on at a time.
const CHUNK: usize = 1 << 20;

/// Blocks found from their magics. Pieces are bit ranges `[input, end)` of the archive,
/// from a block's magic to the next magic.
pub struct Blocks {
    window: ReadWindow,
    started: bool,
    /// Where the next block starts (found as the end of the last one).
    open: Option<u64>,
    /// Blocks' CRCs combined as the end-of-stream marker's is.
    combined: u32,
    /// Started inside a stream (a read at an entry point), whose combined CRC cannot
    /// be checked: each block's own CRC still is.
    partial: bool,
}

impl Blocks {
    /// The blocks of the streams from the archive's start.
    pub fn new(src: &Arc<Source>) -> Blocks {
        Blocks {
            window: ReadWindow::new(src),
            started: false,
            open: None,
            combined: 0,
            partial: false,
        }
    }

    /// The blocks from the one whose magic is at bit `bit` on.
    pub fn at(src: &Arc<Source>, bit: u64) -> Blocks {
        Blocks {
            window: ReadWindow::new(src),
            started: true,
            open: Some(bit),
            combined: 0,
            partial: true,
        }
    }

    /// The `n` (at most 56) bits at bit offset `bit`, most significant first; None past
    /// the archive's end.
    fn bits(&mut self, bit: u64, n: u32) -> Result<Option<u64>> {
        let need = (bit % 8 + u64::from(n)).div_ceil(8) as usize;
        let Some(b) = self.window.get(bit / 8, need)? else {
            return Ok(None);
        };
        let mut w = [0u8; 8];
        w[..need].copy_from_slice(b);
        Ok(Some((u64::from_be_bytes(w) << (bit % 8)) >> (64 - n)))
    }

    /// The next block or end-of-stream magic at or after bit `from`: its bit offset and
    /// whether it ends the stream.
    fn find(&mut self, from: u64) -> Result<Option<(u64, bool)>> {
        let mut byte = from / 8;
        loop {
            if byte >= self.window.len() {
                return Ok(None);
            }
            let len = SCAN.min((self.window.len() - byte) as usize);
            let data = self.window.get(byte, len)?.ok_or_else(truncated)?;
            // A magic at bit s of byte i fills byte i + 1 with its bits [8 - s, 16 - s):
            // a byte that could be one of those is a candidate, checked whole.
            for j in 1..data.len().max(1) {
                let b = data[j];
                if !CANDIDATE[usize::from(b)] {
                    continue;
                }
                let i = j - 1;
                let mut w = [0u8; 8];
                let have = &data[i..(i + 8).min(data.len())];
                w[..have.len()].copy_from_slice(have);
                let w = u64::from_be_bytes(w);
                for s in 0..8u64 {
                    let bit = (byte + i as u64) * 8 + s;
                    if bit < from || (have.len() as u64) * 8 < s + 48 {
                        continue;
                    }
                    let m = (w << s) >> 16;
                    if m == BLOCK_MAGIC || m == END_MAGIC {
                        return Ok(Some((bit, m == END_MAGIC)));
                    }
                }
            }
            if data.len() < 8 {
                return Ok(None);
            }
            // Overlap by 7 bytes: a magic may straddle the chunks.
            byte += (data.len() - 7) as u64;
        }
    }

    /// After an end-of-stream marker at `bit`: checks the stream's CRC, then finds the
    /// next stream's first block (pbzip2 writes a stream per block) or the end.
    fn next_stream(&mut self, bit: u64) -> Result<Option<u64>> {
        let crc = self.bits(bit + 48, 32)?.ok_or_else(truncated)? as u32;
        let partial = std::mem::take(&mut self.partial);
        if crc != self.combined && !partial {
            return Err(Error::corrupt(format!(
                "bzip2 stream ending at byte {} fails its CRC",
                bit / 8
            )));
        }
        self.combined = 0;
        let next = (bit + 80).div_ceil(8) * 8;
        self.stream_start(next)
    }

    /// The first block of a stream whose header is at bit `bit` (byte-aligned); None
    /// at the end of the archive.
    fn stream_start(&mut self, bit: u64) -> Result<Option<u64>> {
        let header = self.bits(bit, 32)?;
        if bit == 0 && header.is_none_or(|h| h >> 8 != 0x425a68) {
            return Err(Error::corrupt("not a bzip2 stream"));
        }
        match header {
            None => Ok(None),
            Some(h) if h >> 8 == 0x425a68 && (0x31..=0x39).contains(&(h & 0xff)) => {
                let first = bit + 32;
                match self.bits(first, 48)? {
                    Some(BLOCK_MAGIC) => Ok(Some(first)),
                    // An empty stream: its end marker right away.
                    Some(END_MAGIC) => self.next_stream(first),
                    _ => Err(Error::corrupt(format!(
                        "bzip2 data is damaged at byte {}",
                        first / 8
                    ))),
                }
            }
            // bzip2 ignores what follows the last stream.
            Some(_) => Ok(None),
        }
    }
}

fn truncated() -> Error {
    Error::corrupt("bzip2 stream is truncated")
}

/// Bytes that can follow the first byte of a magic, for each bit offset.
static CANDIDATE: [bool; 256] = {
    let mut t = [false; 256];
    let mut s = 0;
    while s < 8 {
        t[((BLOCK_MAGIC >> (32 + s)) & 0xff) as usize] = true;
        t[((END_MAGIC >> (32 + s)) & 0xff) as usize] = true;
        s += 1;
    }
    t
};

impl Split for Blocks {
    fn next(&mut self) -> Result<Option<Piece>> {
        let start = if self.started {
            self.open.take()
        } else {
            self.started = true;
            self.stream_start(0)?
        };
        let Some(start) = start else {
            return Ok(None);
        };
        let crc = self.bits(start + 48, 32)?.ok_or_else(truncated)? as u32;
        self.combined = self.combined.rotate_left(1) ^ crc;
        let (end, last) = self.find(start + 80)?.ok_or_else(truncated)?;
        self.open = if last {
            self.next_stream(end)?
        } else {
            Some(end)
        };
        Ok(Some(Piece { input: start, end }))
    }

    fn entry(&self, piece: &Piece) -> (u64, u8) {
        (piece.input / 8, (piece.input % 8) as u8)
    }
}

/// A read's decoder from an entry point (a block's magic at byte `input`, after `bits`
/// bits of it): the blocks one after another, each decoded as a stream of its own.
pub struct BlockRun {
    blocks: Blocks,
    decode: Arc<DecodeFn>,
    /// The block being handed out, from `used` on.
    block: Vec<u8>,
    used: usize,
    ended: bool,
    input: u64,
}

impl BlockRun {
    pub fn new(src: &Arc<Source>, p: &Point) -> BlockRun {
        BlockRun {
            blocks: Blocks::at(src, p.input * 8 + u64::from(p.bits)),
            decode: decode_blocks(src),
            block: Vec::new(),
            used: 0,
            ended: false,
            input: p.input,
        }
    }
}

impl Decoder for BlockRun {
    fn read(&mut self, out: &mut [u8]) -> Result<usize> {
        let mut done = 0;
        while done < out.len() && !self.ended {
            if self.used == self.block.len() {
                let Some(piece) = self.blocks.next()? else {
                    self.ended = true;
                    break;
                };
                self.input = piece.end / 8;
                self.block.clear();
                self.used = 0;
                let block = &mut self.block;
                (self.decode)(piece, &mut |chunk: &mut Vec<u8>| {
                    if block.is_empty() {
                        std::mem::swap(block, chunk);
                    } else {
                        block.append(chunk);
                    }
                    true
                })?;
                continue;
            }
            let n = (self.block.len() - self.used).min(out.len() - done);
            out[done..done + n].copy_from_slice(&self.block[self.used..self.used + n]);
            self.used += n;
            done += n;
        }
        Ok(done)
    }

    fn ended(&self) -> bool {
        self.ended
    }

    fn input_pos(&self) -> u64 {
        self.input
    }
}

/// Decodes the block in bits `[input, end)` as a stream of its own.
pub fn decode_blocks(src: &Arc<Source>) -> Arc<DecodeFn> {
    let src = src.clone();
    Arc::new(
        move |piece: Piece, emit: &mut dyn FnMut(&mut Vec<u8>) -> bool| {
            let (first, last) = (piece.input / 8, piece.end.div_ceil(8));
            let bytes = src.read_vec(first, (last - first) as usize)?;
            let nbits = piece.end - piece.input;
            // "BZh9" (a block of any level fits), the block, the end marker and the
            // block's CRC (bits 48..80 of the block) as the stream's.
            let mut s = Vec::with_capacity(bytes.len() + 16);
            s.extend_from_slice(b"BZh9");
            let mut w = BitWriter::new(s);
            let shift = piece.input % 8;
            w.copy(&bytes, shift, nbits);
            let crc = read_bits(&bytes, shift + 48, 32);
            w.put(END_MAGIC, 48);
            w.put(crc, 32);
            let stream = w.finish();
            let mut d = bzip2::Decompress::new(false);
            let mut out = vec![0u8; CHUNK];
            let mut made = 0;
            let mut used = 0;
            loop {
                let (i, o) = (d.total_in(), d.total_out());
                let st = d
                    .decompress(&stream[used..], &mut out[made..])
                    .map_err(|e| {
                        Error::corrupt(format!(
                            "bzip2 data is damaged in the block at byte {first}: {e}"
                        ))
                    })?;
                used += (d.total_in() - i) as usize;
                let now = (d.total_out() - o) as usize;
                made += now;
                let end = st == bzip2::Status::StreamEnd;
                if made == out.len() || end {
                    out.truncate(made);
                    if !out.is_empty() && !emit(&mut out) {
                        return Ok(());
                    }
                    out.resize(CHUNK, 0);
                    made = 0;
                }
                if end {
                    return Ok(());
                }
                if now == 0 && used == stream.len() {
                    return Err(Error::corrupt(format!(
                        "bzip2 block at byte {first} is cut short"
                    )));
                }
            }
        },
    )
}

fn read_bits(b: &[u8], bit: u64, n: u32) -> u64 {
    let mut v = 0u64;
    for k in 0..u64::from(n) {
        let p = bit + k;
        v = v << 1 | u64::from(b[(p / 8) as usize] >> (7 - p % 8) & 1);
    }
    v
}

/// Appends bits, most significant first.
struct BitWriter {
    out: Vec<u8>,
    acc: u64,
    n: u32,
}

impl BitWriter {
    fn new(out: Vec<u8>) -> BitWriter {
        BitWriter { out, acc: 0, n: 0 }
    }

    /// Appends the low `n` (at most 56) bits of `v`.
    fn put(&mut self, v: u64, n: u32) {
        self.acc = self.acc << n | (v & ((1u64 << n) - 1));
        self.n += n;
        while self.n >= 8 {
            self.n -= 8;
            self.out.push((self.acc >> self.n) as u8);
        }
    }

    /// Appends `nbits` bits of `src` from bit `shift` of its first byte.
    fn copy(&mut self, src: &[u8], shift: u64, nbits: u64) {
        let mut bit = shift;
        let end = shift + nbits;
        // Up to a byte boundary of the source, then whole bytes.
        while bit < end && bit % 8 != 0 {
            self.put(u64::from(src[(bit / 8) as usize] >> (7 - bit % 8) & 1), 1);
            bit += 1;
        }
        while bit + 8 <= end {
            self.put(u64::from(src[(bit / 8) as usize]), 8);
            bit += 8;
        }
        while bit < end {
            self.put(u64::from(src[(bit / 8) as usize] >> (7 - bit % 8) & 1), 1);
            bit += 1;
        }
    }

    fn finish(mut self) -> Vec<u8> {
        if self.n > 0 {
            let pad = 8 - self.n;
            self.put(0, pad);
        }
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compressed::parallel_decoder::ParallelDecoder;
    use crate::compressed::Decoder;

    fn bzip2(data: &[u8], level: u32) -> Vec<u8> {
        let mut c = ::bzip2::Compress::new(::bzip2::Compression::new(level), 0);
        let mut out = Vec::with_capacity(data.len() + 4096);
        c.compress_vec(data, &mut out, ::bzip2::Action::Finish)
            .unwrap();
        out
    }

    /// Text in some stretches, noise in others: blocks of different lengths, magics at
    /// every bit offset.
    fn data(len: usize, seed: u64) -> Vec<u8> {
        crate::compressed::mixed(len, seed, 15, b"bzip2 blocks\n")
    }

    fn decode_all(bytes: &[u8], name: &str) -> Result<(Vec<u8>, usize)> {
        let src = crate::compressed::source_of(bytes, &format!("bz2-{name}"));
        let mut pieces = Blocks::new(&src);
        let mut n = 0;
        while pieces.next()?.is_some() {
            n += 1;
        }
        let mut a =
            ParallelDecoder::new(Box::new(Blocks::new(&src)), decode_blocks(&src), 3, 1 << 20)?;
        let mut out = Vec::new();
        let mut buf = vec![0u8; 100_000];
        while !a.ended() {
            let k = a.read(&mut buf)?;
            out.extend_from_slice(&buf[..k]);
        }
        Ok((out, n))
    }

    #[test]
    fn every_block_of_every_stream_decodes_on_its_own() {
        let a = data(2_500_000, 3);
        let b = data(700_000, 5);
        // Level 1: 100 kB blocks. Two streams and an empty one, as pbzip2 and `cat` make.
        let mut file = bzip2(&a, 1);
        file.extend(bzip2(&[], 9));
        file.extend(bzip2(&b, 9));
        let (out, blocks) = decode_all(&file, "multi").unwrap();
        assert!(
            out.len() == a.len() + b.len() && out[..a.len()] == a[..] && out[a.len()..] == b[..]
        );
        assert!(blocks >= 26, "{blocks} blocks");
    }

    #[test]
    fn damage_and_truncation_are_errors() {
        let a = data(600_000, 9);
        let good = bzip2(&a, 1);
        let mut bad = good.clone();
        let mid = bad.len() / 2;
        bad[mid] ^= 0x10;
        assert!(decode_all(&bad, "bad").is_err());
        assert!(decode_all(&good[..good.len() - 7], "cut").is_err());
        assert!(decode_all(b"BZh9garbage", "garbage").is_err());
    }
}
