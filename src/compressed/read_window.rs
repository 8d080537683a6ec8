//! Archive bytes read in large windows, for the formats whose pieces are found from
//! headers spread through the archive (zstd frames, bzip2 blocks).

use std::sync::Arc;

use crate::error::Result;
use crate::source::Source;

/// Archive bytes read in large windows, for finding pieces from headers spread through
/// the archive: a small `pread` of a cold file waits for the disk each time (a pzstd
/// archive's 8,500 block headers took longer than decoding it).
pub struct ReadWindow {
    src: Arc<Source>,
    buf: Vec<u8>,
    base: u64,
}

/// Bytes read at a time.
const WIDTH: usize = 4 << 20;

impl ReadWindow {
    /// Reads through a descriptor of its own (see [`Source::reopen`]): sharing one with
    /// the workers made a cold pzstd index take 0.6-1.9 s against 0.7 s for `zstd -dc`.
    pub fn new(src: &Arc<Source>) -> ReadWindow {
        ReadWindow {
            src: src.reopen().map(Arc::new).unwrap_or_else(|_| src.clone()),
            buf: Vec::new(),
            base: 0,
        }
    }

    pub fn len(&self) -> u64 {
        self.src.len()
    }

    /// The archive, through the window's own descriptor.
    pub fn src(&self) -> &Source {
        &self.src
    }

    /// The `len` bytes at `at`; `None` if the archive ends first.
    pub fn get(&mut self, at: u64, len: usize) -> Result<Option<&[u8]>> {
        let end = at + len as u64;
        if end > self.src.len() {
            return Ok(None);
        }
        if at < self.base || end > self.base + self.buf.len() as u64 {
            let n = WIDTH.max(len).min((self.src.len() - at) as usize);
            self.buf.resize(n, 0);
            self.src.read_exact_at(at, &mut self.buf)?;
            self.base = at;
        }
        let from = (at - self.base) as usize;
        Ok(Some(&self.buf[from..from + len]))
    }
}
