//! The 96-byte superblock at offset 0: where every table starts, and the checks that keep
//! a corrupt one from sending reads anywhere.

use super::compressor::Compressor;
use crate::error::{Error, Result};

pub const SIZE: usize = 96;
/// Marks an absent optional table (xattrs, fragments, export).
pub const NO_TABLE: u64 = u64::MAX;

#[derive(Clone, Debug)]
pub struct Superblock {
    pub inode_count: u32,
    pub mod_time: u32,
    pub block_size: u32,
    pub frag_count: u32,
    pub compressor: Compressor,
    pub flags: u16,
    pub id_count: u16,
    pub root_inode: u64,
    pub bytes_used: u64,
    pub id_table: u64,
    pub xattr_table: u64,
    pub inode_table: u64,
    pub dir_table: u64,
    pub frag_table: u64,
    pub export_table: u64,
}

/// Little-endian fields of on-disk structures (the superblock, directory entries).
pub(super) fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
pub(super) fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

impl Superblock {
    /// Parses and validates the superblock of an image of `file_len` bytes.
    pub fn parse(b: &[u8; SIZE], file_len: u64) -> Result<Superblock> {
        if &b[0..4] != b"hsqs" {
            return Err(Error::NotArchive(
                "not a SquashFS image (no 'hsqs' magic at offset 0)".into(),
            ));
        }
        let (major, minor) = (u16_at(b, 28), u16_at(b, 30));
        if (major, minor) != (4, 0) {
            return Err(Error::Unsupported(format!(
                "SquashFS version {major}.{minor} is not supported; archfs reads 4.0 images \
                 (repack with a current mksquashfs)"
            )));
        }
        let sb = Superblock {
            inode_count: u32_at(b, 4),
            mod_time: u32_at(b, 8),
            block_size: u32_at(b, 12),
            frag_count: u32_at(b, 16),
            compressor: Compressor::from_id(u16_at(b, 20))?,
            flags: u16_at(b, 24),
            id_count: u16_at(b, 26),
            root_inode: u64_at(b, 32),
            bytes_used: u64_at(b, 40),
            id_table: u64_at(b, 48),
            xattr_table: u64_at(b, 56),
            inode_table: u64_at(b, 64),
            dir_table: u64_at(b, 72),
            frag_table: u64_at(b, 80),
            export_table: u64_at(b, 88),
        };
        let block_log = u16_at(b, 22);
        let bad = |what: String| Err(Error::corrupt(format!("superblock: {what}")));
        if !(4096..=1 << 20).contains(&sb.block_size)
            || !sb.block_size.is_power_of_two()
            || u32::from(block_log) >= 32
            || 1u32 << block_log != sb.block_size
        {
            return bad(format!(
                "block size {} (log {block_log}) is not a power of two between 4 KiB and 1 MiB",
                sb.block_size
            ));
        }
        if sb.bytes_used > file_len {
            return Err(Error::corrupt(format!(
                "the image is truncated: its superblock says {} bytes, the file has {file_len}",
                sb.bytes_used
            )));
        }
        if sb.id_count == 0 {
            return bad("the id table is empty".into());
        }
        let end = sb.bytes_used;
        let tables = [
            ("inode table", sb.inode_table),
            ("directory table", sb.dir_table),
            ("id table", sb.id_table),
        ];
        for (name, start) in tables {
            if start < SIZE as u64 || start >= end {
                return bad(format!("{name} starts at {start}, outside the image"));
            }
        }
        if sb.inode_table >= sb.dir_table {
            return bad("the inode table does not precede the directory table".into());
        }
        for (name, start) in [
            ("fragment table", sb.frag_table),
            ("xattr table", sb.xattr_table),
            ("export table", sb.export_table),
        ] {
            if start != NO_TABLE && (start < SIZE as u64 || start >= end) {
                return bad(format!("{name} starts at {start}, outside the image"));
            }
        }
        Ok(sb)
    }
}
