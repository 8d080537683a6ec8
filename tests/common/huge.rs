//! A SquashFS image of one sparse file far larger than any tool here builds in a test's
//! time: mksquashfs, gensquashfs and tar2sqfs all visit every block of a sparse file
//! (tar2sqfs, the fastest, takes about 3.5 s a 64 GiB at 1 MiB blocks, so a quarter of an
//! hour for 16 TiB). The image is written directly, laid out as mksquashfs lays out a
//! one-file image: superblock, data blocks, inode table, directory table, id table. The
//! tests that use it check it against the kernel's squashfs driver.

use std::io::Write;
use std::path::Path;

use libdeflater::{CompressionLvl, Compressor};

pub const BLOCK: u64 = 128 << 10;
const META: usize = 8192;
const MTIME: u32 = 1_700_000_000;

/// One regular file, `big`, of `size` bytes in the root; the blocks listed in `data` hold
/// [`pattern`] bytes, every other block is a hole.
pub struct HugeSparse {
    pub size: u64,
    pub data: Vec<u64>,
}

/// The byte at `offset` of block `block` of the file when that block holds data.
pub fn pattern(block: u64, offset: u64) -> u8 {
    (block.wrapping_mul(31) + offset / 7 + 1) as u8
}

impl HugeSparse {
    /// What a read of `len` bytes at `offset` returns.
    pub fn expected(&self, offset: u64, len: usize) -> Vec<u8> {
        let end = (offset + len as u64).min(self.size);
        (offset..end)
            .map(|o| {
                let b = o / BLOCK;
                if self.data.contains(&b) {
                    pattern(b, o % BLOCK)
                } else {
                    0
                }
            })
            .collect()
    }

    /// Writes the image to `path` (gzip metadata, data blocks stored raw, no fragments).
    pub fn write(&self, path: &Path) {
        let mut data = self.data.clone();
        data.sort_unstable();
        data.dedup();
        let blocks = self.size.div_ceil(BLOCK);
        assert!(data.last().is_none_or(|&b| b < blocks));
        let block_len = |b: u64| (self.size - b * BLOCK).min(BLOCK);

        let mut img = vec![0u8; 96];
        for &b in &data {
            img.extend((0..block_len(b)).map(|o| pattern(b, o)));
        }

        // Inode table: the file's extended inode, its block list, then the root directory.
        let mut inodes = MetaWriter::new();
        let holes: u64 = self.size - data.iter().map(|&b| block_len(b)).sum::<u64>();
        inodes.write(&inode_header(9, 0o644, 1));
        inodes.write(&96u64.to_le_bytes()); // blocks_start
        inodes.write(&self.size.to_le_bytes());
        inodes.write(&holes.to_le_bytes()); // sparse bytes
        inodes.write(&1u32.to_le_bytes()); // nlink
        inodes.write(&u32::MAX.to_le_bytes()); // no fragment
        inodes.write(&0u32.to_le_bytes());
        inodes.write(&u32::MAX.to_le_bytes()); // no xattrs
        let mut next = 0;
        for &b in &data {
            inodes.write_zeros(4 * (b - next));
            inodes.write(&(block_len(b) as u32 | 1 << 24).to_le_bytes()); // stored raw
            next = b + 1;
        }
        inodes.write_zeros(4 * (blocks - next));
        let (root_block, root_offset) = inodes.position();
        let name = b"big";
        let listing = 12 + 8 + name.len();
        inodes.write(&inode_header(1, 0o755, 2));
        inodes.write(&0u32.to_le_bytes()); // listing in directory block 0
        inodes.write(&2u32.to_le_bytes()); // nlink
        inodes.write(&(listing as u16 + 3).to_le_bytes());
        inodes.write(&0u16.to_le_bytes()); // listing offset
        inodes.write(&3u32.to_le_bytes()); // parent: inode count + 1 for the root
        let inode_table = img.len() as u64;
        img.extend(inodes.finish());

        // Directory table: one header (one entry, inodes in block 0, base number 1).
        let mut dirs = MetaWriter::new();
        for v in [0u32, 0, 1] {
            dirs.write(&v.to_le_bytes());
        }
        for v in [0u16, 0, 2, name.len() as u16 - 1] {
            dirs.write(&v.to_le_bytes());
        }
        dirs.write(name);
        let dir_table = img.len() as u64;
        img.extend(dirs.finish());

        // Id table: one metadata block holding uid/gid 0, then its pointer, which the kernel
        // requires to end exactly where the image does.
        let mut ids = MetaWriter::new();
        ids.write(&0u32.to_le_bytes());
        let id_block = img.len() as u64;
        img.extend(ids.finish());
        let id_table = img.len() as u64;
        img.extend(id_block.to_le_bytes());
        let bytes_used = img.len() as u64;

        let mut sb = Vec::with_capacity(96);
        sb.extend(b"hsqs");
        sb.extend(2u32.to_le_bytes()); // inodes
        sb.extend(MTIME.to_le_bytes());
        sb.extend((BLOCK as u32).to_le_bytes());
        sb.extend(0u32.to_le_bytes()); // fragments
        sb.extend(1u16.to_le_bytes()); // gzip
        sb.extend((BLOCK.trailing_zeros() as u16).to_le_bytes());
        sb.extend((0x0010u16 | 0x0200).to_le_bytes()); // no fragments, no xattrs
        sb.extend(1u16.to_le_bytes()); // ids
        sb.extend(4u16.to_le_bytes());
        sb.extend(0u16.to_le_bytes());
        sb.extend(((root_block << 16) | root_offset as u64).to_le_bytes());
        sb.extend(bytes_used.to_le_bytes());
        sb.extend(id_table.to_le_bytes());
        sb.extend(u64::MAX.to_le_bytes()); // xattrs
        sb.extend(inode_table.to_le_bytes());
        sb.extend(dir_table.to_le_bytes());
        sb.extend(u64::MAX.to_le_bytes()); // fragments
        sb.extend(u64::MAX.to_le_bytes()); // export
        img[..96].copy_from_slice(&sb);
        // Padded to 4 KiB like mksquashfs's output, for the loop device.
        img.resize(img.len().next_multiple_of(4096), 0);
        let mut f = std::fs::File::create(path).unwrap();
        f.write_all(&img).unwrap();
    }
}

fn inode_header(typ: u16, mode: u16, number: u32) -> Vec<u8> {
    let mut h = Vec::with_capacity(16);
    for v in [typ, mode, 0, 0] {
        h.extend(v.to_le_bytes());
    }
    h.extend(MTIME.to_le_bytes());
    h.extend(number.to_le_bytes());
    h
}

/// Writes a metadata stream: 8 KiB blocks, each zlib-compressed behind a 2-byte header.
struct MetaWriter {
    out: Vec<u8>,
    pending: Vec<u8>,
    zlib: Compressor,
    /// The compressed form of a block of zeros, reused for the long runs of a sparse list.
    zeros: Option<Vec<u8>>,
}

impl MetaWriter {
    fn new() -> MetaWriter {
        MetaWriter {
            out: Vec::new(),
            pending: Vec::with_capacity(META),
            zlib: Compressor::new(CompressionLvl::default()),
            zeros: None,
        }
    }

    /// The next byte's block (relative to the stream's start) and offset in it.
    fn position(&self) -> (u64, usize) {
        (self.out.len() as u64, self.pending.len())
    }

    fn write(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let n = bytes.len().min(META - self.pending.len());
            self.pending.extend_from_slice(&bytes[..n]);
            bytes = &bytes[n..];
            if self.pending.len() == META {
                self.flush();
            }
        }
    }

    fn write_zeros(&mut self, mut n: u64) {
        while n > 0 && !self.pending.is_empty() {
            let k = n.min((META - self.pending.len()) as u64);
            self.write(&vec![0u8; k as usize]);
            n -= k;
        }
        while n >= META as u64 {
            if self.zeros.is_none() {
                self.zeros = Some(self.compress(&[0u8; META]));
            }
            self.out.extend(self.zeros.as_ref().unwrap());
            n -= META as u64;
        }
        self.write(&vec![0u8; n as usize]);
    }

    fn compress(&mut self, data: &[u8]) -> Vec<u8> {
        let mut c = vec![0u8; self.zlib.zlib_compress_bound(data.len())];
        let n = self.zlib.zlib_compress(data, &mut c).unwrap();
        let mut block = Vec::with_capacity(n + 2);
        if n < data.len() {
            block.extend((n as u16).to_le_bytes());
            block.extend(&c[..n]);
        } else {
            block.extend((data.len() as u16 | 0x8000).to_le_bytes());
            block.extend(data);
        }
        block
    }

    fn flush(&mut self) {
        let data = std::mem::take(&mut self.pending);
        let block = self.compress(&data);
        self.out.extend(block);
        self.pending = data;
        self.pending.clear();
    }

    fn finish(mut self) -> Vec<u8> {
        if !self.pending.is_empty() {
            self.flush();
        }
        self.out
    }
}
