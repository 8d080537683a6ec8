//! Regular file data: full blocks stored one after another from `blocks_start`, each
//! compressed on its own (or stored raw, or absent when sparse), and an optional tail
//! packed with other files' tails into a shared fragment block.

use std::os::fd::BorrowedFd;
use std::sync::{Arc, OnceLock};

use crate::sync::Mutex;

use super::inode::{Body, NO_FRAGMENT};
use super::table::Fragment;
use super::SquashFs;
use crate::archive::Data;
use crate::cache::Weighted;
use crate::error::{Error, Result};
use crate::source::Buf;

const UNCOMPRESSED: u32 = 1 << 24;
/// Files of up to this many blocks more are read on through ([`SquashFs::run_end`]).
const RUN_BLOCKS: u64 = 16;
const SIZE_MASK: u32 = UNCOMPRESSED - 1;

/// How many samples of a file's block list a [`Layout`] keeps at most: 24 KiB. Files of up
/// to this many blocks (128 MiB at 128 KiB blocks) keep every block's position; a larger
/// file keeps every Nth, so a 16 TiB sparse file (134 M blocks) costs 24 KiB, not 1.6 GB.
const MAX_SAMPLES: u64 = 1024;

/// Where one block of a file is: its data on disk and its entry in the block size list.
#[derive(Clone, Copy, Debug)]
struct Mark {
    /// Index of the block in the file.
    index: u64,
    /// Where its data starts in the image.
    start: u64,
    /// Its size entry (size on disk, and the uncompressed flag).
    stored: u32,
    /// Where its size entry is in the metadata stream: block position and offset.
    meta: (u64, u32),
}

/// How to find the blocks of one file. The size list (4 bytes a block, in the inode
/// table) is read lazily: a block's position is the sum of the sizes before it, so the
/// layout keeps a sample every `stride` blocks, filled in as reads reach further, plus
/// where the last read ended so sequential reads sum one entry each.
pub struct Layout {
    pub size: u64,
    fragment: u32,
    frag_offset: u32,
    block_count: u64,
    stride: u64,
    /// Where the size list and the data start: the walk from block 0.
    origin: Mark,
    walk: Mutex<Walk>,
    /// The fragment's entry, once read: both `stored_at` and `read` want it.
    tail: OnceLock<Fragment>,
}

struct Walk {
    /// `samples[k]` is block `k * stride`; filled in order, never past `block_count`.
    samples: Vec<Mark>,
    /// The block after the last one looked up, with its entry not yet read.
    next: Mark,
}

impl Weighted for Layout {
    fn weight(&self) -> usize {
        // The capacity is reserved up front, so the weight never changes once cached.
        self.walk.lock().samples.capacity() * std::mem::size_of::<Mark>() + 160
    }
}

/// Size entries read at once while summing: one metadata block's worth.
const BATCH: u64 = 2048;

impl Layout {
    /// Block `i` (below `block_count`): where its data starts and its size entry. Sums at
    /// most `stride` entries, or one when reads go forward block by block.
    fn block(&self, fs: &SquashFs, i: u64) -> Result<(u64, u32)> {
        let mut w = self.walk.lock();
        let k = i / self.stride;
        if let Some(s) = w.samples.get(k as usize) {
            if s.index == i {
                return Ok((s.start, s.stored));
            }
        }
        // Start from the nearest known point at or before `i`: the sample, or where the
        // last lookup stopped if that is nearer.
        let sample = w
            .samples
            .get((k as usize).min(w.samples.len().saturating_sub(1)))
            .copied();
        let mut at = match (sample, w.next) {
            (_, n) if n.index <= i && sample.is_none_or(|s| n.index > s.index) => n,
            (Some(s), _) => s,
            (None, _) => self.origin,
        };
        let mut c = fs.cursor(at.meta.0, at.meta.1 as usize);
        let mut buf = [0u8; 4 * BATCH as usize];
        let mut found = None;
        while at.index <= i {
            // A batch ends at `i` and at the next sample, so every sample starts a batch
            // and the cursor's position is that sample's.
            let until = (i + 1)
                .min((at.index / self.stride + 1) * self.stride)
                .min(at.index + BATCH);
            let record = at.index == w.samples.len() as u64 * self.stride;
            let meta = (c.block, c.offset as u32);
            let bytes = &mut buf[..4 * (until - at.index) as usize];
            c.read(bytes)?;
            for e in bytes.chunks_exact(4) {
                let stored = u32::from_le_bytes(e.try_into().unwrap());
                let len = u64::from(stored & SIZE_MASK);
                if len > u64::from(fs.sb.block_size) {
                    return Err(Error::corrupt(format!(
                        "block of {len} bytes on disk in a {}-byte block image",
                        fs.sb.block_size
                    )));
                }
                if at.start.saturating_add(len) > fs.sb.bytes_used {
                    return Err(Error::corrupt("file blocks run past the end of the image"));
                }
                if record && at.index % self.stride == 0 {
                    w.samples.push(Mark { stored, meta, ..at });
                }
                if at.index == i {
                    found = Some((at.start, stored));
                }
                at.index += 1;
                at.start += len;
            }
            at.meta = (c.block, c.offset as u32);
        }
        w.next = at;
        found.ok_or_else(|| Error::corrupt("block list walk missed its block"))
    }
}

/// A value from the cache, or one made for a single use.
enum Held<T> {
    Shared(Arc<T>),
    Own(T),
}

impl<T> std::ops::Deref for Held<T> {
    type Target = T;
    fn deref(&self) -> &T {
        match self {
            Held::Shared(v) => v,
            Held::Own(v) => v,
        }
    }
}

impl SquashFs {
    /// How to find the blocks of the file at `inode_ref`. Only files with blocks are
    /// cached: a file held whole in a fragment needs nothing past its inode, and caching
    /// it cost an insertion and an eviction a file (1.28 M small files overflow the cache).
    fn layout(&self, inode_ref: u64) -> Result<Held<Layout>> {
        if let Some(l) = self.layout_cache.get(inode_ref) {
            return Ok(Held::Shared(l));
        }
        let layout = self.new_layout(inode_ref)?;
        if layout.block_count == 0 {
            return Ok(Held::Own(layout));
        }
        let mut made = Some(layout);
        self.layout_cache
            .get_or_load(inode_ref, || match made.take() {
                Some(l) => Ok(l),
                None => self.new_layout(inode_ref),
            })
            .map(Held::Shared)
    }

    fn new_layout(&self, inode_ref: u64) -> Result<Layout> {
        let inode = self.inode(inode_ref)?;
        let f = match inode.body {
            Body::File(f) => f,
            Body::Dir(_) => return Err(Error::IsDir),
            _ => return Err(Error::corrupt("read of an inode that is not a file")),
        };
        let stride = f.block_count.div_ceil(MAX_SAMPLES).max(1);
        let origin = Mark {
            index: 0,
            start: f.blocks_start,
            stored: 0,
            meta: (f.sizes_pos.0, f.sizes_pos.1 as u32),
        };
        Ok(Layout {
            size: f.size,
            fragment: f.fragment,
            frag_offset: f.frag_offset,
            block_count: f.block_count,
            stride,
            origin,
            walk: Mutex::new(Walk {
                samples: Vec::with_capacity(f.block_count.div_ceil(stride) as usize),
                next: origin,
            }),
            tail: OnceLock::new(),
        })
    }

    /// Where the fragment holding the file's tail is stored, checked to lie in the image.
    fn tail(&self, layout: &Layout) -> Result<Fragment> {
        if let Some(f) = layout.tail.get() {
            return Ok(*f);
        }
        let f = self.fragment(layout.fragment)?;
        let len = f.size & SIZE_MASK;
        if len > self.sb.block_size {
            return Err(Error::corrupt("fragment larger than a block"));
        }
        if f.start.saturating_add(u64::from(len)) > self.sb.bytes_used {
            return Err(Error::corrupt(format!(
                "fragment {} at {} runs past the end of the image",
                layout.fragment, f.start
            )));
        }
        Ok(*layout.tail.get_or_init(|| f))
    }

    /// The decoded block holding chunk `i` of the file, and the byte range of the chunk
    /// within it.
    fn chunk(&self, layout: &Layout, i: u64) -> Result<(Arc<Vec<u8>>, usize, usize)> {
        let bs = u64::from(self.sb.block_size);
        let len = (layout.size - i * bs).min(bs) as usize;
        if i < layout.block_count {
            let (pos, stored) = layout.block(self, i)?;
            if stored & SIZE_MASK == 0 {
                return Ok((self.zero_block.clone(), 0, len));
            }
            let block = self.data_cache.get_or_load(pos, || {
                self.load_block(pos, stored, self.run_end(layout, i, pos, stored))
            })?;
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
        let frag = self.tail(layout)?;
        let block = self.frag_cache.get_or_load(frag.start, || {
            self.load_block(
                frag.start,
                frag.size,
                frag.start + u64::from(frag.size & SIZE_MASK),
            )
        })?;
        let start = layout.frag_offset as usize;
        if start + len > block.len() {
            return Err(Error::corrupt(format!(
                "file tail of {len} bytes at {start} lies outside its {}-byte fragment",
                block.len()
            )));
        }
        Ok((block, start, len))
    }

    /// Where the stored blocks of a file of a few blocks end, from block `i` at `pos`:
    /// a reader of block `i` reads on through them ([`Source::read_through`]). A long
    /// file's block list is not walked for this: just block `i`.
    fn run_end(&self, layout: &Layout, i: u64, pos: u64, stored: u32) -> u64 {
        let own = pos + u64::from(stored & SIZE_MASK);
        if layout.block_count - i > RUN_BLOCKS {
            return own;
        }
        layout
            .block(self, layout.block_count - 1)
            .map_or(own, |(p, s)| (p + u64::from(s & SIZE_MASK)).max(own))
    }

    /// The block of `stored` bytes at `pos`, decoded; its reader reads on to `end`.
    fn load_block(&self, pos: u64, stored: u32, end: u64) -> Result<Vec<u8>> {
        let len = (stored & SIZE_MASK) as usize;
        if stored & UNCOMPRESSED != 0 {
            // Kept in the cache: an exact allocation, not a reused buffer of any capacity.
            let mut v = vec![0u8; len];
            self.source.read_through(pos, &mut v, end)?;
            return Ok(v);
        }
        let raw = self.source.read_buf_through(pos, len, end)?;
        self.sb
            .compressor
            .decompress(&raw, self.sb.block_size as usize)
            .map_err(|e| e.at(format_args!("data block at {pos}")))
    }

    /// Where bytes from `offset` of the file lie raw in the image, up to `size`: the run
    /// of blocks stored uncompressed (one after another on disk) from the one holding
    /// `offset`, or the file's tail in a fragment stored uncompressed. JPEG data does not
    /// compress, so mksquashfs stores most of such a dataset raw. `None` otherwise.
    pub(super) fn stored_at(
        &self,
        inode_ref: u64,
        offset: u64,
        size: u32,
    ) -> Option<(BorrowedFd<'_>, u64, u32)> {
        let layout = self.layout(inode_ref).ok()?;
        self.stored_in(&layout, offset, size)
    }

    /// [`Archive::read_into`](crate::archive::Archive::read_into) with the file looked
    /// up once, not once by `stored_at` and again by `read`.
    pub(super) fn read_into(&self, inode_ref: u64, offset: u64, buf: &mut [u8]) -> Result<usize> {
        let layout = self.layout(inode_ref)?;
        crate::archive::path::fill(
            offset,
            buf,
            |at, n| self.stored_in(&layout, at, n),
            |at, n| self.read_layout(&layout, at, n),
        )
    }

    fn stored_in(
        &self,
        layout: &Layout,
        offset: u64,
        size: u32,
    ) -> Option<(BorrowedFd<'_>, u64, u32)> {
        let (start, n) = self.raw_run(layout, offset, size)?;
        let (fd, pos) = self.source.stored_at(start, n)?;
        Some((fd, pos, n as u32))
    }

    /// Where the bytes from `offset` lie as they are in the image, up to `size`: the
    /// start and length of the run of blocks stored uncompressed from the one holding
    /// `offset`, or of the file's tail in a fragment stored uncompressed.
    fn raw_run(&self, layout: &Layout, offset: u64, size: u32) -> Option<(u64, u64)> {
        if offset >= layout.size {
            return None;
        }
        let bs = u64::from(self.sb.block_size);
        let want = u64::from(size).min(layout.size - offset);
        let (first, within) = (offset / bs, offset % bs);
        // The bytes of chunk `i` raw on disk: where they start and how many.
        let raw = |i: u64| -> Option<(u64, u64)> {
            let len = (layout.size - i * bs).min(bs);
            let (start, stored, room) = if i < layout.block_count {
                let (pos, stored) = layout.block(self, i).ok()?;
                (pos, stored, u64::from(stored & SIZE_MASK))
            } else {
                let frag = self.tail(layout).ok()?;
                let room =
                    u64::from(frag.size & SIZE_MASK).checked_sub(u64::from(layout.frag_offset))?;
                (frag.start + u64::from(layout.frag_offset), frag.size, room)
            };
            (stored & UNCOMPRESSED != 0 && room >= len).then_some((start, len))
        };
        let (start, len) = raw(first)?;
        let mut end = start + len;
        let mut got = len - within;
        let mut i = first + 1;
        while got < want && i < layout.block_count {
            match raw(i) {
                Some((s, l)) if s == end => {
                    end += l;
                    got += l;
                    i += 1;
                }
                _ => break,
            }
        }
        Some((start + within, got.min(want)))
    }

    /// Where the file's bytes lie in the image as stored: its blocks (one run) and the
    /// fragment block that holds its tail with other files' tails.
    pub(super) fn stored_ranges(&self, inode_ref: u64) -> Result<Vec<std::ops::Range<u64>>> {
        let layout = self.layout(inode_ref)?;
        let mut out = Vec::with_capacity(2);
        if layout.block_count > 0 {
            let (pos, stored) = layout.block(self, layout.block_count - 1)?;
            let end = pos + u64::from(stored & SIZE_MASK);
            if end > layout.origin.start {
                out.push(layout.origin.start..end);
            }
        }
        let bs = u64::from(self.sb.block_size);
        if layout.size > layout.block_count * bs && layout.fragment != NO_FRAGMENT {
            let f = self.tail(&layout)?;
            out.push(f.start..f.start + u64::from(f.size & SIZE_MASK));
        }
        Ok(out)
    }

    pub(super) fn read_file(&self, inode_ref: u64, offset: u64, size: u32) -> Result<Data> {
        let layout = self.layout(inode_ref)?;
        self.read_layout(&layout, offset, size)
    }

    /// Bytes stored as they are in a file the kernel caches (a local image, the node's
    /// copy of a remote one, made or being made) are read from there, not decoded into
    /// the block cache as well: eight mounts of one image on a node each held ~250 MB of
    /// it, and while the copy was being made, a memory cgroup holding one copy and
    /// eight mounts ran out.
    fn read_layout(&self, layout: &Layout, offset: u64, size: u32) -> Result<Data> {
        let want = u64::from(size).min(layout.size.saturating_sub(offset));
        if let Some((start, n)) = self
            .raw_run(layout, offset, size)
            .filter(|&(_, n)| n == want)
        {
            let fd = self.source.stored_at(start, n);
            if fd.is_some() || self.source.in_node_copy() {
                let mut buf = Buf::take(n as usize);
                match fd {
                    Some((fd, pos)) => crate::archive::path::read_fd(fd, pos, &mut buf)?,
                    // Waits for the copy to hold them, or brings them there.
                    None => self.source.read_exact_at(start, &mut buf)?,
                }
                return Ok(Data::Owned(buf));
            }
        }
        self.read_in(layout, offset, size)
    }

    fn read_in(&self, layout: &Layout, offset: u64, size: u32) -> Result<Data> {
        if offset >= layout.size || size == 0 {
            return Ok(Data::Owned(Buf::default()));
        }
        let end = offset.saturating_add(u64::from(size)).min(layout.size);
        let bs = u64::from(self.sb.block_size);
        let (first, last) = (offset / bs, (end - 1) / bs);
        if first == last {
            let (block, start, _) = self.chunk(layout, first)?;
            let from = start + (offset - first * bs) as usize;
            let to = start + (end - first * bs) as usize;
            return Ok(Data::Shared(block, from..to));
        }
        let mut out = Buf::take((end - offset) as usize);
        let mut at = 0;
        for i in first..=last {
            let (block, start, len) = self.chunk(layout, i)?;
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
