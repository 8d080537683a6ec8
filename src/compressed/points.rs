//! The entry points of a compressed archive, recorded by the indexing pass and saved in
//! the tar's index: where a read can start decoding, with the block checksums that check
//! what it decodes.

use std::sync::Arc;

use super::{gzip, Compression, Decoder, BLOCK};
use crate::error::{Error, Result};
use crate::source::Source;

/// A place where decoding can start: `output` bytes into the decoded stream, at byte
/// `input` of the archive. `bits`: gzip, after the last `bits` bits of the byte before;
/// bzip2, after the first `bits` bits of that byte; xz, the stream's check type.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Point {
    pub output: u64,
    pub input: u64,
    pub bits: u8,
}

/// The entry points of one archive; gzip windows kept sparse (`window.rs`) and
/// zstd-compressed: a window of text shrinks 3-4x compressed, one of JPEG bytes only
/// when the bytes the stream never copies from are zeroed. With them, a CRC-32
/// of every decoded block, taken in the indexing pass: a read that decodes from the
/// middle of a stream has no checksum of the format's to check (gzip's covers a whole
/// member), and damage or a change of the archive since it was indexed must give EIO,
/// not wrong bytes.
#[derive(Debug, Default)]
pub struct Points {
    pub(super) points: Vec<Point>,
    pub(super) windows: Vec<Box<[u8]>>,
    /// Length of the decoded stream.
    pub(super) len: u64,
    /// The spacing asked for when they were recorded.
    pub(super) spacing: u64,
    /// One per [`BLOCK`] of each stretch between entry points (the last one shorter).
    pub(super) sums: Vec<u32>,
    /// Index in `sums` of each stretch's first block.
    pub(super) first_sum: Vec<usize>,
}

impl Points {
    pub(super) fn push(&mut self, p: Point, packed: Box<[u8]>) {
        self.points.push(p);
        self.windows.push(packed);
    }

    pub(super) fn window(&self, i: usize) -> Result<Vec<u8>> {
        let w = &self.windows[i];
        if w.is_empty() {
            return Ok(Vec::new());
        }
        ::zstd::bulk::decompress(w, gzip::WINDOW)
            .map_err(|_| Error::corrupt("a saved gzip window is damaged"))
    }

    /// A decoder at entry point `i` (the first is the archive's start).
    pub(super) fn decoder(
        &self,
        i: usize,
        codec: Compression,
        src: &Arc<Source>,
    ) -> Result<Box<dyn Decoder>> {
        if i == 0 {
            return codec.start(src);
        }
        codec.resume(src, &self.points[i], &self.window(i)?)
    }

    /// The entry point at or before `pos`.
    pub(super) fn before(&self, pos: u64) -> usize {
        self.points
            .partition_point(|p| p.output <= pos)
            .saturating_sub(1)
    }

    /// Fills in `first_sum`; false when the sums do not match the stretches.
    pub(super) fn index_sums(&mut self) -> bool {
        let mut n = 0usize;
        self.first_sum = (0..self.points.len())
            .map(|i| {
                let first = n;
                n += (self.end_of(i) - self.points[i].output).div_ceil(BLOCK) as usize;
                first
            })
            .collect();
        n == self.sums.len()
    }

    /// Checks a block decoded from stretch `i` at `at` against the indexing pass.
    pub(super) fn verify(&self, i: usize, at: u64, block: &[u8]) -> Result<()> {
        let k = self.first_sum[i] + ((at - self.points[i].output) / BLOCK) as usize;
        if self.sums.get(k) != Some(&crc32fast::hash(block)) {
            return Err(Error::corrupt(format!(
                "the data decoded at {at} differs from when the archive was indexed: the \
                 compressed archive is damaged or was changed there"
            )));
        }
        Ok(())
    }

    /// Where the stretch decoded from point `i` ends.
    pub(super) fn end_of(&self, i: usize) -> u64 {
        self.points.get(i + 1).map_or(self.len, |p| p.output)
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn count(&self) -> usize {
        self.points.len()
    }

    /// The longest stretch between entry points.
    pub(super) fn widest(&self) -> u64 {
        (0..self.points.len())
            .map(|i| self.end_of(i) - self.points[i].output)
            .max()
            .unwrap_or(0)
    }

    /// Bytes in memory (and, give or take, on disk).
    pub(super) fn bytes(&self) -> usize {
        self.points.len() * (std::mem::size_of::<Point>() + 16) + self.window_bytes()
    }

    /// The saved gzip windows' bytes, as kept (sparse and compressed).
    pub fn window_bytes(&self) -> usize {
        self.windows.iter().map(|w| w.len()).sum()
    }

    /// The form saved in the index file.
    pub fn encode(&self, codec: Compression) -> Vec<u8> {
        let mut o = Vec::with_capacity(self.bytes() + 32);
        o.push(codec.id());
        o.extend_from_slice(&self.len.to_le_bytes());
        o.extend_from_slice(&self.spacing.to_le_bytes());
        o.extend_from_slice(&(self.sums.len() as u64).to_le_bytes());
        for s in &self.sums {
            o.extend_from_slice(&s.to_le_bytes());
        }
        o.extend_from_slice(&(self.points.len() as u64).to_le_bytes());
        for (p, w) in self.points.iter().zip(&self.windows) {
            o.extend_from_slice(&p.output.to_le_bytes());
            o.extend_from_slice(&p.input.to_le_bytes());
            o.push(p.bits);
            o.extend_from_slice(&(w.len() as u32).to_le_bytes());
            o.extend_from_slice(w);
        }
        o
    }

    /// Reads what [`encode`](Self::encode) wrote, refusing anything that does not fit
    /// an archive of `archive_len` bytes in `codec`.
    pub fn decode(b: &[u8], codec: Compression, archive_len: u64) -> Option<Points> {
        let mut r = b;
        let mut take = |n: usize| -> Option<&[u8]> {
            let (h, t) = r.split_at_checked(n)?;
            r = t;
            Some(h)
        };
        let u64_ = |s: &[u8]| u64::from_le_bytes(s.try_into().unwrap());
        if take(1)?[0] != codec.id() {
            return None;
        }
        let len = u64_(take(8)?);
        let spacing = u64_(take(8)?);
        let sums = u64_(take(8)?);
        if sums > b.len() as u64 / 4 {
            return None;
        }
        let sums = (0..sums)
            .map(|_| Some(u32::from_le_bytes(take(4)?.try_into().unwrap())))
            .collect::<Option<Vec<u32>>>()?;
        let n = u64_(take(8)?);
        if n == 0 || n > b.len() as u64 / 21 {
            return None;
        }
        let mut pts = Points {
            len,
            spacing,
            sums,
            ..Points::default()
        };
        for _ in 0..n {
            let p = Point {
                output: u64_(take(8)?),
                input: u64_(take(8)?),
                bits: take(1)?[0],
            };
            let wl = u32::from_le_bytes(take(4)?.try_into().unwrap()) as usize;
            let w = take(wl)?;
            let ok = match pts.points.last() {
                None => p == Point::default(),
                Some(q) => p.output > q.output && p.input >= q.input,
            };
            let most_bits = if codec == Compression::Xz { 15 } else { 7 };
            if !ok || p.bits > most_bits || p.output >= len.max(1) || p.input > archive_len {
                return None;
            }
            pts.points.push(p);
            pts.windows.push(w.into());
        }
        (r.is_empty() && pts.index_sums()).then_some(pts)
    }
}
