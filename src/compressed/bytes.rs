//! The byte space the tar scan reads through, so a tar is read alike whether it is plain
//! or inside a compressed archive.

use crate::error::Result;
use crate::source::Source;

/// A random-access byte space: an archive file, or the decoded contents of a
/// compressed one. The tar scan reads through it.
pub trait Bytes: Sync {
    fn read_exact_at(&self, pos: u64, buf: &mut [u8]) -> Result<()>;
    /// The length when it is at most `upto`, else some value above `upto`: a stream
    /// being decoded knows its length only at its end.
    fn len_within(&self, upto: u64) -> Result<u64>;
    /// A hint that `[at, at + len)` is read soon.
    fn will_need(&self, _at: u64, _len: u64) {}
    fn read_vec(&self, pos: u64, len: usize) -> Result<Vec<u8>> {
        let mut v = vec![0u8; len];
        self.read_exact_at(pos, &mut v)?;
        Ok(v)
    }
}

impl Bytes for Source {
    fn read_exact_at(&self, pos: u64, buf: &mut [u8]) -> Result<()> {
        Source::read_exact_at(self, pos, buf)
    }
    fn len_within(&self, _upto: u64) -> Result<u64> {
        Ok(self.len())
    }
    fn will_need(&self, at: u64, len: u64) {
        Source::will_need(self, at, len)
    }
}
