//! The interface every format's decoder implements, so the indexing pass, reads and
//! decoded copies drive gzip, zstd, xz and bzip2 alike.

use std::sync::Arc;

use super::Point;
use crate::error::Result;
use crate::source::Source;

/// A decoder somewhere in the archive.
pub trait Decoder: Send {
    /// Decodes into `out`; returns early (possibly with 0 bytes) at an entry point, so
    /// the caller can record it. Fewer bytes than asked does not mean the end: `ended`.
    fn read(&mut self, out: &mut [u8]) -> Result<usize>;
    /// The entry point the decoder is at, with its window, if it is at one (asked of
    /// the indexing pass's decoder only).
    fn point(&mut self) -> Option<(Point, Vec<u8>)> {
        None
    }
    fn ended(&self) -> bool;
    /// Archive bytes consumed so far, for progress bars.
    fn input_pos(&self) -> u64;
    /// Frees what can be had again (read-ahead input) before the decoder is parked.
    fn shrink(&mut self) {}
    /// Moves the decoder to entry point `p` (the start: `Point::default()`) of the
    /// archive `src` (any of the mount's), keeping its allocations; false where that is
    /// not supported.
    fn restart(&mut self, _src: &Arc<Source>, _p: &Point, _window: &[u8]) -> Result<bool> {
        Ok(false)
    }
}

/// Fills `out` completely unless the stream ends first; returns the bytes written.
pub(super) fn fill(dec: &mut dyn Decoder, out: &mut [u8]) -> Result<usize> {
    let mut done = 0;
    while done < out.len() && !dec.ended() {
        done += dec.read(&mut out[done..])?;
    }
    Ok(done)
}

/// A decoder and the decoded offset it stopped at.
pub(super) type Parked = (u64, Box<dyn Decoder>);
