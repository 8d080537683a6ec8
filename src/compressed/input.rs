//! Archive bytes for a decoder, read ahead in large `pread`s: the decoders take input a
//! few bytes at a time.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::source::Source;

/// Archive bytes read ahead of a decoder in large `pread`s.
pub struct Input {
    src: Arc<Source>,
    buf: Vec<u8>,
    used: usize,
    /// Archive offset just past `buf`.
    next: u64,
}

const INPUT_CHUNK: u64 = 128 << 10;

impl Input {
    pub fn new(src: Arc<Source>, at: u64) -> Input {
        Input {
            src,
            buf: Vec::new(),
            used: 0,
            next: at,
        }
    }

    /// The buffered bytes, refilled when empty; `true` with an empty slice at the end
    /// of the archive.
    pub fn chunk(&mut self) -> Result<(&[u8], bool)> {
        if self.used == self.buf.len() {
            let len = INPUT_CHUNK.min(self.src.len().saturating_sub(self.next));
            self.buf.resize(len as usize, 0);
            self.src.read_exact_at(self.next, &mut self.buf)?;
            self.next += len;
            self.used = 0;
        }
        let rest = &self.buf[self.used..];
        Ok((rest, rest.is_empty()))
    }

    pub fn source(&self) -> &Arc<Source> {
        &self.src
    }

    /// Moves to offset `at` of archive `src`, keeping the buffer's memory.
    pub fn reset(&mut self, src: &Arc<Source>, at: u64) {
        if !Arc::ptr_eq(&self.src, src) {
            self.src = src.clone();
        }
        self.buf.clear();
        self.used = 0;
        self.next = at;
    }

    /// Drops the buffered input (read again from the archive when needed).
    pub fn shrink(&mut self) {
        self.next = self.pos();
        self.buf = Vec::new();
        self.used = 0;
    }

    pub fn consume(&mut self, n: usize) {
        self.used = (self.used + n).min(self.buf.len());
    }

    /// Archive offset of the next byte a decoder gets.
    pub fn pos(&self) -> u64 {
        self.next - (self.buf.len() - self.used) as u64
    }

    pub fn skip(&mut self, mut n: usize) -> Result<()> {
        while n > 0 {
            let (c, end) = self.chunk()?;
            if end {
                return Err(Error::corrupt("compressed stream is truncated"));
            }
            let k = c.len().min(n);
            self.consume(k);
            n -= k;
        }
        Ok(())
    }

    /// Copies the next bytes without consuming them; fewer at the end of the archive.
    pub fn peek(&mut self, out: &mut [u8]) -> Result<usize> {
        let at = self.pos();
        let n = (out.len() as u64).min(self.src.len().saturating_sub(at)) as usize;
        self.src.read_exact_at(at, &mut out[..n])?;
        Ok(n)
    }
}
