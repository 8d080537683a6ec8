//! Regular file data: full blocks stored one after another from `blocks_start`, each
//! compressed on its own (or stored raw, or absent when sparse), and an optional tail
//! packed with other files' tails into a shared fragment block.

use std::sync::Arc;

use super::inode::{Body, NO_FRAGMENT};
use super::SquashFs;
use crate::archive::{Buf, Data};
use crate::cache::Weighted;
use crate::error::{Error, Result};

const UNCOMPRESSED: u32 = 1 << 24;
const SIZE_MASK: u32 = UNCOMPRESSED - 1;

/// Where each block of one file is: decoded once from the inode's size list, then cached,
/// so a read in a large file finds its block without summing the list again.
pub struct Layout {
    pub size: u64,
    sizes: Vec<u32>,
    starts: Vec<u64>,
    fragment: u32,
    frag_offset: u32,
}

impl Weighted for Layout {
    fn weight(&self) -> usize {
        self.sizes.capacity() * 4 + self.starts.capacity() * 8 + 64
    }
}

impl SquashFs {
    fn layout(&self, inode_ref: u64) -> Result<Arc<Layout>> {
        self.layout_cache.get_or_load(inode_ref, || {
            let inode = self.inode(inode_ref)?;
            let f = match inode.body {
                Body::File(f) => f,
                Body::Dir(_) => return Err(Error::IsDir),
                _ => return Err(Error::corrupt("read of an inode that is not a file")),
            };
            let mut c = self.cursor(f.sizes_pos.0, f.sizes_pos.1);
            let n = f.block_count as usize;
            let mut sizes = Vec::with_capacity(n);
            let mut starts = Vec::with_capacity(n);
            let mut pos = f.blocks_start;
            for _ in 0..n {
                let s = c.u32()?;
                if s & SIZE_MASK > self.sb.block_size {
                    return Err(Error::corrupt(format!(
                        "block of {} bytes on disk in a {}-byte block image",
                        s & SIZE_MASK,
                        self.sb.block_size
                    )));
                }
                sizes.push(s);
                starts.push(pos);
                pos += u64::from(s & SIZE_MASK);
            }
            if pos > self.sb.bytes_used {
                return Err(Error::corrupt("file blocks run past the end of the image"));
            }
            Ok(Layout {
                size: f.size,
                sizes,
                starts,
                fragment: f.fragment,
                frag_offset: f.frag_offset,
            })
        })
    }

    /// The decoded block holding chunk `i` of the file, and the byte range of the chunk
    /// within it.
    fn chunk(&self, layout: &Layout, i: u64) -> Result<(Arc<Vec<u8>>, usize, usize)> {
        let bs = u64::from(self.sb.block_size);
        let len = (layout.size - i * bs).min(bs) as usize;
        if let Some(&stored) = layout.sizes.get(i as usize) {
            if stored & SIZE_MASK == 0 {
                return Ok((self.zero_block.clone(), 0, len));
            }
            let pos = layout.starts[i as usize];
            let block = self
                .data_cache
                .get_or_load(pos, || self.load_block(pos, stored))?;
            if block.len() < len {
                return Err(Error::corrupt(format!(
                    "data block at {pos} decodes to {} bytes, expected {len}",
                    block.len()
                )));
            }
            return Ok((block, 0, len));
        }
        if layout.fragment == NO_FRAGMENT {
            return Err(Error::corrupt("file tail has no fragment"));
        }
        let frag = self.fragment(layout.fragment)?;
        if frag.size & SIZE_MASK > self.sb.block_size {
            return Err(Error::corrupt("fragment larger than a block"));
        }
        let block = self
            .frag_cache
            .get_or_load(frag.start, || self.load_block(frag.start, frag.size))?;
        let start = layout.frag_offset as usize;
        if start + len > block.len() {
            return Err(Error::corrupt(format!(
                "file tail of {len} bytes at {start} lies outside its {}-byte fragment",
                block.len()
            )));
        }
        Ok((block, start, len))
    }

    fn load_block(&self, pos: u64, stored: u32) -> Result<Vec<u8>> {
        let len = (stored & SIZE_MASK) as usize;
        if stored & UNCOMPRESSED != 0 {
            // Kept in the cache: an exact allocation, not a reused buffer of any capacity.
            return self.source.read_vec(pos, len);
        }
        let raw = self.source.read_buf(pos, len)?;
        self.sb
            .codec
            .decompress(&raw, self.sb.block_size as usize)
            .map_err(|e| e.at(format_args!("data block at {pos}")))
    }

    pub(super) fn read_file(&self, inode_ref: u64, offset: u64, size: u32) -> Result<Data> {
        let layout = self.layout(inode_ref)?;
        if offset >= layout.size || size == 0 {
            return Ok(Data::Owned(Buf::default()));
        }
        let end = (offset + u64::from(size)).min(layout.size);
        let bs = u64::from(self.sb.block_size);
        let (first, last) = (offset / bs, (end - 1) / bs);
        if first == last {
            let (block, start, _) = self.chunk(&layout, first)?;
            let from = start + (offset - first * bs) as usize;
            let to = start + (end - first * bs) as usize;
            return Ok(Data::Shared(block, from..to));
        }
        let mut out = Buf::take((end - offset) as usize);
        let mut at = 0;
        for i in first..=last {
            let (block, start, len) = self.chunk(&layout, i)?;
            let lo = if i == first {
                (offset - i * bs) as usize
            } else {
                0
            };
            let hi = if i == last {
                (end - i * bs) as usize
            } else {
                len
            };
            out[at..at + hi - lo].copy_from_slice(&block[start + lo..start + hi]);
            at += hi - lo;
        }
        debug_assert_eq!(at, out.len(), "chunk lengths come from the layout");
        Ok(Data::Owned(out))
    }
}
