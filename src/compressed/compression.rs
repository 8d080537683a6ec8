//! Which compressed format an archive is in, told by its magic number, and the decoders
//! each format starts: the one place that maps a format to its code.

use std::sync::Arc;

use super::parallel_decoder::{ParallelDecoder, BUDGET};
use super::{bzip2_blocks, gzip, serial, threads, xz, zstd, Decoder, Point};
use crate::error::Result;
use crate::source::Source;

/// The compressed formats, known by their magic numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    Gzip,
    Zstd,
    Xz,
    Bzip2,
}

impl Compression {
    pub fn detect(magic: &[u8; 4]) -> Option<Compression> {
        match magic {
            [0x1f, 0x8b, _, _] => Some(Compression::Gzip),
            // pzstd opens with a skippable frame.
            [0x28, 0xb5, 0x2f, 0xfd] | [0x50..=0x5f, 0x2a, 0x4d, 0x18] => Some(Compression::Zstd),
            [0xfd, b'7', b'z', b'X'] => Some(Compression::Xz),
            [b'B', b'Z', b'h', _] => Some(Compression::Bzip2),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Compression::Gzip => "gzip",
            Compression::Zstd => "zstd",
            Compression::Xz => "xz",
            Compression::Bzip2 => "bzip2",
        }
    }

    pub(super) fn id(self) -> u8 {
        self as u8
    }

    /// Entry points further apart than this make a read decode for too long (a tenth of
    /// a second or so on one core: xz decodes ~40 MB/s, zstd ~1 GB/s): such an archive
    /// (a zstd archive of one frame, `xz -T0`'s 24 MiB blocks) is served from a decoded
    /// copy instead. pzstd's frames (a few MiB) and bzip2's blocks (900 kB) stay below.
    pub(super) fn max_stretch(self) -> u64 {
        match self {
            Compression::Gzip | Compression::Zstd => 32 << 20,
            Compression::Xz | Compression::Bzip2 => 4 << 20,
        }
    }

    /// The codec whose `id()` is `id`.
    pub fn from_id(id: u8) -> Option<Compression> {
        [
            Compression::Gzip,
            Compression::Zstd,
            Compression::Xz,
            Compression::Bzip2,
        ]
        .into_iter()
        .find(|c| c.id() == id)
    }

    /// A decoder at the start of the archive.
    pub(super) fn start(self, src: &Arc<Source>) -> Result<Box<dyn Decoder>> {
        Ok(match self {
            Compression::Gzip => Box::new(gzip::Inflate::start(src)?),
            Compression::Zstd => Box::new(zstd::Frames::resume(src, &Point::default())?),
            Compression::Xz => Box::new(serial::Serial::xz(src)?),
            Compression::Bzip2 => Box::new(serial::Serial::bzip2(src)),
        })
    }

    /// A decoder for one pass over the whole archive (the indexing pass, a decoded
    /// copy): on several threads where the format has independent pieces.
    pub(super) fn stream(self, src: &Arc<Source>) -> Result<Box<dyn Decoder>> {
        let threads = threads();
        Ok(match self {
            Compression::Zstd => zstd::stream(src, threads)?,
            Compression::Xz => Box::new(serial::Serial::xz_blocks(src, threads)?),
            // On one core too: its pieces are the entry points.
            Compression::Bzip2 => Box::new(ParallelDecoder::new(
                Box::new(bzip2_blocks::Blocks::new(src)),
                bzip2_blocks::decode_blocks(src),
                threads,
                BUDGET,
            )?),
            Compression::Gzip => self.start(src)?,
        })
    }

    /// A decoder at an entry point other than the start.
    pub(super) fn resume(
        self,
        src: &Arc<Source>,
        p: &Point,
        window: &[u8],
    ) -> Result<Box<dyn Decoder>> {
        Ok(match self {
            Compression::Gzip => Box::new(gzip::Inflate::resume(src, p, window)?),
            Compression::Zstd => Box::new(zstd::Frames::resume(src, p)?),
            Compression::Bzip2 => Box::new(bzip2_blocks::BlockRun::new(src, p)),
            Compression::Xz => Box::new(xz::BlockRun::new(src, p)?),
        })
    }
}

/// Decodes the start of the archive into `out`; returns the bytes decoded.
pub fn first_bytes(src: &Arc<Source>, codec: Compression, out: &mut [u8]) -> Result<usize> {
    super::fill(codec.start(src)?.as_mut(), out)
}
