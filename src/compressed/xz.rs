//! xz blocks as entry points. A multi-block archive (`xz -T0`, `--block-size`) lists
//! its blocks in the index at the end of each stream; every block decodes on its own
//! from its header. The indexing pass takes the blocks from the indexes ([`blocks`])
//! and a read decodes from a block's header ([`BlockRun`]) with liblzma's raw decoder.
//! A block's check is not verified here: the indexing pass's stream decoder checked it,
//! and every decoded block is compared with that pass's CRC.

use std::sync::Arc;

use liblzma::stream::{Action, Filters, Status, Stream};

use super::{Decoder, Input, Point};
use crate::error::{Error, Result};
use crate::source::Source;

pub const HEADER_MAGIC: &[u8; 6] = b"\xfd7zXZ\0";
const FOOTER_MAGIC: &[u8; 2] = b"YZ";
/// Stream header and footer.
const FRAME: u64 = 12;
/// An index larger than this is refused (a real one takes 2-20 bytes a block).
const MAX_INDEX: u64 = 256 << 20;

/// A block: its header's archive offset, its decoded offset, its stream's check type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    pub input: u64,
    pub output: u64,
    pub check: u8,
}

impl Block {
    /// The entry point a read starts from.
    pub fn point(&self) -> Point {
        Point {
            output: self.output,
            input: self.input,
            bits: self.check,
        }
    }
}

fn damaged(what: &str) -> Error {
    Error::corrupt(format!("xz archive is damaged: {what}"))
}

/// Bytes of a check of type `check`.
fn check_size(check: u8) -> u64 {
    match check {
        0 => 0,
        c => 4 << ((c - 1) / 3),
    }
}

/// A variable-length integer at the start of `b`: its value and length.
fn vli(b: &[u8]) -> Option<(u64, usize)> {
    let mut v = 0u64;
    for (i, &x) in b.iter().enumerate().take(9) {
        v |= u64::from(x & 0x7f) << (7 * i);
        if x & 0x80 == 0 {
            // No needless trailing zero byte.
            return (i == 0 || x != 0).then_some((v, i + 1));
        }
    }
    None
}

/// The variable-length integer at `*at` of `b`, moving `at` past it.
fn vli_at(b: &[u8], at: &mut usize) -> Option<u64> {
    let (v, n) = vli(b.get(*at..)?)?;
    *at += n;
    Some(v)
}

/// The stream flags' check type, after checking the reserved bits.
fn check_of(flags: &[u8]) -> Result<u8> {
    if flags[0] != 0 || flags[1] & 0xf0 != 0 {
        return Err(damaged("unsupported stream flags"));
    }
    Ok(flags[1])
}

/// Every block of every stream, front to back, from the streams' indexes (read back to
/// front from the end of the archive).
pub fn blocks(src: &Source) -> Result<Vec<Block>> {
    let mut streams: Vec<Vec<(u64, u64, u8)>> = Vec::new();
    let mut end = src.len();
    loop {
        end = skip_padding_back(src, end)?;
        if end == 0 {
            break;
        }
        if end < 2 * FRAME {
            return Err(Error::corrupt("xz stream is truncated"));
        }
        let mut foot = [0u8; 12];
        src.read_exact_at(end - FRAME, &mut foot)?;
        if &foot[10..] != FOOTER_MAGIC {
            return Err(Error::corrupt(
                "xz stream is truncated: no stream footer at its end",
            ));
        }
        if crc32fast::hash(&foot[4..10]) != u32::from_le_bytes(foot[..4].try_into().unwrap()) {
            return Err(damaged("a stream footer fails its CRC"));
        }
        let check = check_of(&foot[8..10])?;
        let index_len = (u64::from(u32::from_le_bytes(foot[4..8].try_into().unwrap())) + 1) * 4;
        if index_len > MAX_INDEX || index_len + 2 * FRAME > end {
            return Err(damaged("an index size is impossible"));
        }
        let index_at = end - FRAME - index_len;
        let index = src.read_vec(index_at, index_len as usize)?;
        let records = parse_index(&index)?;
        let padded = records
            .iter()
            .fold(0u64, |a, r| a.saturating_add(r.0.div_ceil(4) * 4));
        let start = index_at
            .checked_sub(padded.saturating_add(FRAME))
            .ok_or_else(|| damaged("an index lists more blocks than fit"))?;
        let mut head = [0u8; 12];
        src.read_exact_at(start, &mut head)?;
        if &head[..6] != HEADER_MAGIC
            || head[6..8] != foot[8..10]
            || crc32fast::hash(&head[6..8]) != u32::from_le_bytes(head[8..].try_into().unwrap())
        {
            return Err(damaged("a stream header does not match its index"));
        }
        let mut at = start + FRAME;
        streams.push(
            records
                .into_iter()
                .map(|(unpadded, size)| {
                    let b = (at, size, check);
                    at += unpadded.div_ceil(4) * 4;
                    b
                })
                .collect(),
        );
        end = start;
    }
    let mut out = Vec::new();
    let mut output = 0u64;
    for (input, size, check) in streams.into_iter().rev().flatten() {
        out.push(Block {
            input,
            output,
            check,
        });
        output = output
            .checked_add(size)
            .ok_or_else(|| damaged("sizes overflow"))?;
    }
    Ok(out)
}

/// The offset before the stream padding (zero bytes, a multiple of four) that ends at
/// `end`.
fn skip_padding_back(src: &Source, mut end: u64) -> Result<u64> {
    let mut buf = vec![0u8; 64 << 10];
    while end > 0 {
        let n = (buf.len() as u64).min(end) as usize;
        let b = &mut buf[..n];
        src.read_exact_at(end - n as u64, b)?;
        let zeros = b.iter().rev().take_while(|&&x| x == 0).count() / 4 * 4;
        end -= zeros as u64;
        if zeros < n {
            break;
        }
    }
    Ok(end)
}

/// An index's records (unpadded size, decoded size), after checking its CRC.
fn parse_index(b: &[u8]) -> Result<Vec<(u64, u64)>> {
    let bad = || damaged("an index is malformed");
    let (body, crc) = b.split_at(b.len() - 4);
    if crc32fast::hash(body) != u32::from_le_bytes(crc.try_into().unwrap()) {
        return Err(damaged("an index fails its CRC"));
    }
    if body.first() != Some(&0) {
        return Err(bad());
    }
    let mut at = 1;
    let count = vli_at(body, &mut at).ok_or_else(bad)?;
    if count > body.len() as u64 / 2 {
        return Err(bad());
    }
    let records = (0..count)
        .map(|_| {
            let unpadded = vli_at(body, &mut at).ok_or_else(bad)?;
            let size = vli_at(body, &mut at).ok_or_else(bad)?;
            // A block header, at least a byte of data, and the check.
            if !(5..=1 << 62).contains(&unpadded) {
                return Err(bad());
            }
            Ok((unpadded, size))
        })
        .collect::<Result<Vec<_>>>()?;
    if at.div_ceil(4) * 4 != body.len() || body[at..].iter().any(|&x| x != 0) {
        return Err(bad());
    }
    Ok(records)
}

/// Moves `input` past stream padding (zero bytes).
pub fn skip_padding(input: &mut Input) -> Result<()> {
    let mut b = [0u8; 4096];
    loop {
        let n = input.peek(&mut b)?;
        let zeros = b[..n].iter().take_while(|&&x| x == 0).count();
        input.skip(zeros)?;
        if zeros < n || n == 0 {
            return Ok(());
        }
    }
}

/// A read's decoder from a block's header on: the blocks one after another (into the
/// next stream, if the read goes that far).
pub struct BlockRun {
    input: Input,
    check: u8,
    /// The block being decoded: its raw decoder, and its header's and data's bytes so
    /// far (the padding after the data aligns their sum).
    block: Option<(Stream, u64)>,
    ended: bool,
}

impl BlockRun {
    pub fn new(src: &Arc<Source>, p: &Point) -> Result<BlockRun> {
        if p.bits > 15 {
            return Err(damaged("an entry point's check type is impossible"));
        }
        Ok(BlockRun {
            input: Input::new(src.clone(), p.input),
            check: p.bits,
            block: None,
            ended: false,
        })
    }

    /// `n` bytes at the input, consumed.
    fn take(&mut self, n: usize) -> Result<Vec<u8>> {
        let mut b = vec![0u8; n];
        if self.input.peek(&mut b)? < n {
            return Err(Error::corrupt("xz stream is truncated"));
        }
        self.input.skip(n)?;
        Ok(b)
    }

    /// Starts the block whose header is at the input, or passes an index, a stream
    /// footer, padding and the next stream's header; false at the archive's end.
    fn next_block(&mut self) -> Result<bool> {
        let mut first = [0u8; 1];
        if self.input.peek(&mut first)? == 0 {
            return Ok(false);
        }
        if first[0] == 0 {
            self.pass_index()?;
            return self.next_stream();
        }
        let size = (usize::from(first[0]) + 1) * 4;
        let h = self.take(size)?;
        let (body, crc) = h.split_at(size - 4);
        if crc32fast::hash(body) != u32::from_le_bytes(crc.try_into().unwrap()) {
            return Err(damaged("a block header fails its CRC"));
        }
        let flags = body[1];
        if flags & 0x3c != 0 {
            return Err(damaged("a block header has unsupported flags"));
        }
        let bad = || damaged("a block header is malformed");
        let mut at = 2;
        for present in [flags & 0x40 != 0, flags & 0x80 != 0] {
            if present {
                vli_at(body, &mut at).ok_or_else(bad)?;
            }
        }
        let mut filters = Filters::new();
        for _ in 0..=(flags & 3) {
            let id = vli_at(body, &mut at).ok_or_else(bad)?;
            let len = vli_at(body, &mut at).ok_or_else(bad)? as usize;
            let props = body.get(at..at.saturating_add(len)).ok_or_else(bad)?;
            at += len;
            let f = &mut filters;
            let added = match id {
                0x21 => f.lzma2_properties(props),
                0x03 => f.delta_properties(props),
                0x04 => f.x86_properties(props),
                0x05 => f.powerpc_properties(props),
                0x06 => f.ia64_properties(props),
                0x07 => f.arm_properties(props),
                0x08 => f.arm_thumb_properties(props),
                0x09 => f.sparc_properties(props),
                0x0a => f.arm64_properties(props),
                0x0b => f.riscv_properties(props),
                _ => return Err(damaged(&format!("unknown filter {id:#x}"))),
            };
            added.map_err(|e| damaged(&format!("filter {id:#x}: {e}")))?;
        }
        let stream = Stream::new_raw_decoder(&filters)
            .map_err(|e| damaged(&format!("cannot start a block's decoder: {e}")))?;
        self.block = Some((stream, size as u64));
        Ok(true)
    }

    /// Passes an index: its record count and records, padding and CRC (checked by the
    /// indexing pass).
    fn pass_index(&mut self) -> Result<()> {
        let mut b = [0u8; 10];
        self.take(1)?;
        let mut len = 1usize;
        let mut vli_at_input = |this: &mut Self| -> Result<u64> {
            let n = this.input.peek(&mut b)?;
            let (v, k) = vli(&b[..n]).ok_or_else(|| damaged("an index is malformed"))?;
            this.input.skip(k)?;
            len += k;
            Ok(v)
        };
        let count = vli_at_input(self)?;
        for _ in 0..count.saturating_mul(2) {
            vli_at_input(self)?;
        }
        let pad = len.div_ceil(4) * 4 - len;
        self.take(pad + 4)?;
        Ok(())
    }

    /// After an index: the stream footer, padding, then the next stream's header or
    /// the end.
    fn next_stream(&mut self) -> Result<bool> {
        self.take(FRAME as usize)?;
        skip_padding(&mut self.input)?;
        let mut h = [0u8; 12];
        match self.input.peek(&mut h)? {
            0 => Ok(false),
            12 if &h[..6] == HEADER_MAGIC => {
                self.check = check_of(&h[6..8])?;
                self.input.skip(12)?;
                self.next_block()
            }
            _ => Err(damaged("data after a stream is not a stream")),
        }
    }
}

impl Decoder for BlockRun {
    fn read(&mut self, out: &mut [u8]) -> Result<usize> {
        let mut done = 0;
        while done < out.len() && !self.ended {
            let Some((stream, used)) = &mut self.block else {
                self.ended = !self.next_block()?;
                continue;
            };
            let (chunk, at_end) = self.input.chunk()?;
            let (i, o) = (stream.total_in(), stream.total_out());
            let st = stream
                .process(chunk, &mut out[done..], Action::Run)
                .map_err(|e| damaged(&e.to_string()))?;
            let (took, made) = (
                (stream.total_in() - i) as usize,
                (stream.total_out() - o) as usize,
            );
            *used += took as u64;
            self.input.consume(took);
            done += made;
            if st == Status::StreamEnd {
                let pad = used.div_ceil(4) * 4 - *used;
                self.block = None;
                self.take((pad + check_size(self.check)) as usize)?;
            } else if took == 0 && made == 0 && at_end {
                return Err(Error::corrupt("xz stream is truncated"));
            }
        }
        Ok(done)
    }

    fn ended(&self) -> bool {
        self.ended
    }

    fn input_pos(&self) -> u64 {
        self.input.pos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compressed::{fill, source_of};

    /// xz of `data` in blocks of `block` bytes, with `check` (liblzma's threaded encoder,
    /// as `xz -T0`).
    fn xz(data: &[u8], block: u64, check: liblzma::stream::Check) -> Vec<u8> {
        let mut b = liblzma::stream::MtStreamBuilder::new();
        b.threads(2).block_size(block).preset(1).check(check);
        let mut s = b.encoder().unwrap();
        let mut out = Vec::with_capacity(data.len() + 4096);
        let mut input = data;
        loop {
            let before = s.total_in();
            out.reserve(1 << 20);
            let st = s
                .process_vec(input, &mut out, liblzma::stream::Action::Finish)
                .unwrap();
            input = &input[(s.total_in() - before) as usize..];
            if st == Status::StreamEnd {
                return out;
            }
        }
    }

    /// Text and noise, so blocks decode to LZMA chunks and stored chunks.
    fn data(len: usize, seed: u64) -> Vec<u8> {
        crate::compressed::mixed(len, seed, 14, b"xz blocks\n")
    }

    /// Two streams (different checks) with stream padding between: the blocks from their
    /// indexes, and every block decoded on from its own header to the archive's end.
    #[test]
    fn every_block_of_every_stream_decodes_from_its_header() {
        use liblzma::stream::Check;
        let (a, b) = (data(700_000, 1), data(500_000, 2));
        let mut bytes = xz(&a, 100_000, Check::Crc64);
        bytes.extend_from_slice(&[0; 8]);
        bytes.extend(xz(&b, 64 << 10, Check::Sha256));
        let src = source_of(&bytes, "xz-streams");
        let found = blocks(&src).unwrap();
        let want: Vec<u64> = (0..7)
            .map(|i| i * 100_000)
            .chain((0..8).map(|i| 700_000 + i * (64 << 10)))
            .collect();
        assert_eq!(found.iter().map(|b| b.output).collect::<Vec<_>>(), want);
        assert_eq!(found[0].check, 4);
        assert_eq!(found[7].check, 10);
        let whole: Vec<u8> = [a, b].concat();
        for blk in &found {
            let mut d = BlockRun::new(&src, &blk.point()).unwrap();
            let mut out = vec![0u8; whole.len() - blk.output as usize];
            assert_eq!(fill(&mut d, &mut out).unwrap(), out.len(), "{blk:?}");
            assert!(
                out == whole[blk.output as usize..],
                "block at {}",
                blk.output
            );
            assert!(d.read(&mut [0u8; 16]).unwrap() == 0 && d.ended());
        }
    }

    /// Any byte of the stream footer, index or header damaged, or the archive cut
    /// anywhere: an error (or blocks a read then checks), never a panic.
    #[test]
    fn damaged_indexes_and_truncation_are_errors() {
        let bytes = xz(&data(300_000, 3), 50_000, liblzma::stream::Check::Crc32);
        let good = blocks(&source_of(&bytes, "xz-good")).unwrap();
        for at in (0..bytes.len()).rev().take(200).chain(0..40) {
            let mut b = bytes.clone();
            b[at] ^= 0x41;
            let got = blocks(&source_of(&b, "xz-bad"));
            assert!(got.is_err() || got.unwrap() == good, "byte {at}");
        }
        for cut in [1, 11, 12, 13, 100, bytes.len() / 2, bytes.len() - 1] {
            assert!(
                blocks(&source_of(&bytes[..cut], "xz-cut")).is_err(),
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn vli_round_trips_and_refuses_overlong_forms() {
        assert_eq!(vli(&[0x00]), Some((0, 1)));
        assert_eq!(vli(&[0x7f]), Some((127, 1)));
        assert_eq!(vli(&[0x80, 0x01]), Some((128, 2)));
        assert_eq!(vli(&[0x80, 0x00]), None);
        assert_eq!(vli(&[0x80]), None);
        assert_eq!(vli(&[0xff; 10]), None);
    }

    #[test]
    fn check_sizes() {
        let sizes: Vec<u64> = [0, 1, 4, 10, 15].into_iter().map(check_size).collect();
        assert_eq!(sizes, [0, 4, 8, 32, 64]);
    }
}
