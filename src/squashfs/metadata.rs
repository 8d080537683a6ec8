//! Metadata blocks (inodes, directories, tables): 2-byte headers, at most 8 KiB each once
//! decompressed, read as one stream that runs on from block to block.

use std::sync::Arc;

use super::SquashFs;
use crate::cache::Weighted;
use crate::error::{Error, Result};

pub const BLOCK_SIZE: usize = 8192;

/// The most bytes `span` bytes of the metadata stream on disk can decode to. Every block
/// has a 2-byte header and at least one byte of payload (an empty block is corrupt) and
/// decodes to at most 8 KiB, so a run of zeros can expand about 2,700-fold: bounds on what
/// a table holds must be derived from this, never from the table's size on disk.
pub fn max_decoded(span: u64) -> u64 {
    span / 3 * BLOCK_SIZE as u64
}

pub struct MetaBlock {
    pub data: Vec<u8>,
    /// Position of the block that follows this one on disk.
    pub next: u64,
}

impl Weighted for MetaBlock {
    fn weight(&self) -> usize {
        self.data.capacity() + 64
    }
}

impl SquashFs {
    /// The decompressed metadata block whose header is at `pos`.
    pub fn meta_block(&self, pos: u64) -> Result<Arc<MetaBlock>> {
        self.meta_cache.get_or_load(pos, || {
            let mut hdr = [0u8; 2];
            self.source.read_exact_at(pos, &mut hdr)?;
            let hdr = u16::from_le_bytes(hdr);
            let len = usize::from(hdr & 0x7fff);
            if len == 0 {
                return Err(Error::corrupt(format!("empty metadata block at {pos}")));
            }
            let raw = self.source.read_vec(pos + 2, len)?;
            let data = if hdr & 0x8000 != 0 {
                raw
            } else {
                self.sb
                    .codec
                    .decompress(&raw, BLOCK_SIZE)
                    .map_err(|e| e.at(format_args!("metadata block at {pos}")))?
            };
            if data.is_empty() || data.len() > BLOCK_SIZE {
                return Err(Error::corrupt(format!(
                    "metadata block at {pos} holds {} bytes",
                    data.len()
                )));
            }
            Ok(MetaBlock {
                data,
                next: pos + 2 + len as u64,
            })
        })
    }

    pub fn cursor(&self, block: u64, offset: usize) -> Cursor<'_> {
        Cursor {
            image: self,
            block,
            offset,
            current: None,
        }
    }
}

/// A read position in the metadata stream: an absolute block position and an offset into
/// its decompressed bytes.
pub struct Cursor<'a> {
    image: &'a SquashFs,
    pub block: u64,
    pub offset: usize,
    current: Option<Arc<MetaBlock>>,
}

impl Cursor<'_> {
    /// Copies the next `out.len()` bytes, crossing into following blocks as needed.
    pub fn read(&mut self, mut out: &mut [u8]) -> Result<()> {
        while !out.is_empty() {
            let block = match &self.current {
                Some(b) => b.clone(),
                None => {
                    let b = self.image.meta_block(self.block)?;
                    self.current = Some(b.clone());
                    b
                }
            };
            if self.offset > block.data.len() {
                return Err(Error::corrupt(format!(
                    "metadata offset {} beyond block at {}",
                    self.offset, self.block
                )));
            }
            if self.offset == block.data.len() {
                self.block = block.next;
                self.offset = 0;
                self.current = None;
                continue;
            }
            let n = out.len().min(block.data.len() - self.offset);
            out[..n].copy_from_slice(&block.data[self.offset..self.offset + n]);
            self.offset += n;
            out = &mut out[n..];
        }
        Ok(())
    }

    pub fn skip(&mut self, mut n: usize) -> Result<()> {
        let mut buf = [0u8; 256];
        while n > 0 {
            let k = n.min(buf.len());
            self.read(&mut buf[..k])?;
            n -= k;
        }
        Ok(())
    }

    /// The next `n` bytes, read a block at a time: a hostile length runs into the end of
    /// the metadata before it can allocate more than the stream really decodes to.
    pub fn bytes(&mut self, n: usize) -> Result<Vec<u8>> {
        let mut v = Vec::with_capacity(n.min(BLOCK_SIZE));
        while v.len() < n {
            let at = v.len();
            v.resize(at + (n - at).min(BLOCK_SIZE), 0);
            self.read(&mut v[at..])?;
        }
        Ok(v)
    }

    pub fn u16(&mut self) -> Result<u16> {
        let mut b = [0u8; 2];
        self.read(&mut b)?;
        Ok(u16::from_le_bytes(b))
    }

    pub fn u32(&mut self) -> Result<u32> {
        let mut b = [0u8; 4];
        self.read(&mut b)?;
        Ok(u32::from_le_bytes(b))
    }

    pub fn u64(&mut self) -> Result<u64> {
        let mut b = [0u8; 8];
        self.read(&mut b)?;
        Ok(u64::from_le_bytes(b))
    }
}
