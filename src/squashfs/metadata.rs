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
                    .compressor
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
    /// Makes the block holding the next byte current. The block stays borrowed by the
    /// cursor, not cloned per read: an `Arc` count touched by every field of every
    /// directory entry was half a lookup's time with four FUSE threads.
    fn load(&mut self) -> Result<()> {
        loop {
            if self.current.is_none() {
                self.current = Some(self.image.meta_block(self.block)?);
            }
            let block = self.current.as_deref().expect("loaded above");
            match self.offset.cmp(&block.data.len()) {
                std::cmp::Ordering::Less => break,
                std::cmp::Ordering::Equal => {
                    self.block = block.next;
                    self.offset = 0;
                    self.current = None;
                }
                std::cmp::Ordering::Greater => {
                    return Err(Error::corrupt(format!(
                        "metadata offset {} beyond block at {}",
                        self.offset, self.block
                    )))
                }
            }
        }
        Ok(())
    }

    /// Copies the next `out.len()` bytes, crossing into following blocks as needed.
    pub fn read(&mut self, mut out: &mut [u8]) -> Result<()> {
        while !out.is_empty() {
            self.load()?;
            let block = self.current.as_deref().expect("loaded");
            let at = self.offset;
            let n = out.len().min(block.data.len() - at);
            out[..n].copy_from_slice(&block.data[at..at + n]);
            self.offset += n;
            out = &mut out[n..];
        }
        Ok(())
    }

    /// The next `n` bytes, borrowed from the current block when they lie within it (as
    /// nearly every directory entry does), else copied into `scratch`.
    pub fn take<'s>(&'s mut self, n: usize, scratch: &'s mut Vec<u8>) -> Result<&'s [u8]> {
        if n == 0 {
            return Ok(&[]);
        }
        self.load()?;
        let at = self.offset;
        let len = self.current.as_deref().map_or(0, |b| b.data.len());
        if len - at >= n {
            self.offset += n;
            let block = self.current.as_deref().expect("loaded");
            return Ok(&block.data[at..at + n]);
        }
        scratch.clear();
        scratch.resize(n, 0);
        self.read(scratch)?;
        Ok(scratch)
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
