//! Inodes: a 16-byte common header, then a body that depends on the type. Basic and
//! extended variants decode into one shape.

use super::metadata::max_decoded;
use super::SquashFs;
use crate::archive::Kind;
use crate::error::{Error, Result};

pub const NO_XATTR: u32 = u32::MAX;
pub const NO_FRAGMENT: u32 = u32::MAX;

/// The kernel refuses a symlink longer than its page size (fs/squashfs/inode.c: "Corrupted
/// symlink" when `i_size > PAGE_SIZE`), and the largest page size Linux runs with is 256 KiB
/// (hexagon, powerpc 44x). Tools write longer targets (tar2sqfs keeps a PAX linkpath of any
/// length), and x86's 4 KiB is not the limit: a 64 KiB-page arm64 kernel reads 64 KiB ones.
const MAX_SYMLINK: usize = 256 << 10;

#[derive(Clone, Debug)]
pub struct Inode {
    pub kind: Kind,
    pub perm: u16,
    pub uid_idx: u16,
    pub gid_idx: u16,
    pub mtime: u32,
    pub nlink: u32,
    pub xattr: u32,
    pub body: Body,
}

#[derive(Clone, Debug)]
pub enum Body {
    Dir(DirInode),
    File(FileInode),
    Symlink(Vec<u8>),
    Device(u32),
    Ipc,
}

#[derive(Clone, Debug)]
pub struct DirInode {
    /// Listing start: block relative to the directory table, offset in that block.
    pub block: u32,
    pub offset: u16,
    /// Listing size plus 3 (the on-disk convention for `.` and `..`).
    pub file_size: u32,
    pub index_count: u16,
    /// Where the directory index entries start (right after the inode).
    pub index_pos: (u64, usize),
}

#[derive(Clone, Debug)]
pub struct FileInode {
    pub blocks_start: u64,
    pub size: u64,
    pub fragment: u32,
    pub frag_offset: u32,
    /// Number of full blocks stored as blocks (the tail may live in a fragment).
    pub block_count: u64,
    /// Where the block size list starts.
    pub sizes_pos: (u64, usize),
}

impl SquashFs {
    /// Decodes the inode at reference `r` (metadata block << 16 | offset).
    pub fn inode(&self, r: u64) -> Result<Inode> {
        let block = r >> 16;
        let offset = (r & 0xffff) as usize;
        if offset >= super::metadata::BLOCK_SIZE || block >= self.sb.dir_table - self.sb.inode_table
        {
            return Err(Error::corrupt(format!(
                "inode reference {r:#x} is out of range"
            )));
        }
        let mut c = self.cursor(self.sb.inode_table + block, offset);
        let typ = c.u16()?;
        let mode = c.u16()?;
        let uid_idx = c.u16()?;
        let gid_idx = c.u16()?;
        let mtime = c.u32()?;
        let _number = c.u32()?;
        let kind = match typ {
            1 | 8 => Kind::Dir,
            2 | 9 => Kind::File,
            3 | 10 => Kind::Symlink,
            4 | 11 => Kind::BlockDev,
            5 | 12 => Kind::CharDev,
            6 | 13 => Kind::Fifo,
            7 | 14 => Kind::Socket,
            t => return Err(Error::corrupt(format!("inode {r:#x} has unknown type {t}"))),
        };
        let mut nlink = 1;
        let mut xattr = NO_XATTR;
        let body = match typ {
            1 => {
                let block = c.u32()?;
                nlink = c.u32()?;
                let file_size = u32::from(c.u16()?);
                let offset = c.u16()?;
                let _parent = c.u32()?;
                Body::Dir(DirInode {
                    block,
                    offset,
                    file_size,
                    index_count: 0,
                    index_pos: (c.block, c.offset),
                })
            }
            8 => {
                nlink = c.u32()?;
                let file_size = c.u32()?;
                let block = c.u32()?;
                let _parent = c.u32()?;
                let index_count = c.u16()?;
                let offset = c.u16()?;
                xattr = c.u32()?;
                Body::Dir(DirInode {
                    block,
                    offset,
                    file_size,
                    index_count,
                    index_pos: (c.block, c.offset),
                })
            }
            2 | 9 => {
                let (blocks_start, size, fragment, frag_offset) = if typ == 2 {
                    let start = u64::from(c.u32()?);
                    let frag = c.u32()?;
                    let off = c.u32()?;
                    let size = u64::from(c.u32()?);
                    (start, size, frag, off)
                } else {
                    let start = c.u64()?;
                    let size = c.u64()?;
                    let _sparse = c.u64()?;
                    nlink = c.u32()?;
                    let frag = c.u32()?;
                    let off = c.u32()?;
                    xattr = c.u32()?;
                    (start, size, frag, off)
                };
                let bs = u64::from(self.sb.block_size);
                let block_count = if fragment == NO_FRAGMENT {
                    size.div_ceil(bs)
                } else {
                    size / bs
                };
                // Each block has a 4-byte size entry in the inode table after this inode.
                // Compare the list with what the rest of the table can decode to, not with
                // its size on disk: a sparse file's list of zero entries compresses ~100:1
                // (a 16 TiB file's 512 MiB list fits in a few MiB). The list is read lazily,
                // so a large count costs no memory; this only catches a plain lie early.
                let room = max_decoded(self.sb.dir_table.saturating_sub(c.block));
                if block_count.saturating_mul(4) > room {
                    return Err(Error::corrupt(format!(
                        "file inode {r:#x} claims {size} bytes, more than its block list can describe"
                    )));
                }
                Body::File(FileInode {
                    blocks_start,
                    size,
                    fragment,
                    frag_offset,
                    block_count,
                    sizes_pos: (c.block, c.offset),
                })
            }
            3 | 10 => {
                nlink = c.u32()?;
                let len = c.u32()? as usize;
                if len > MAX_SYMLINK {
                    return Err(Error::corrupt(format!(
                        "symlink inode {r:#x} has a {len}-byte target"
                    )));
                }
                let target = c.bytes(len)?;
                if typ == 10 {
                    xattr = c.u32()?;
                }
                Body::Symlink(target)
            }
            4 | 5 | 11 | 12 => {
                nlink = c.u32()?;
                let dev = c.u32()?;
                if typ >= 11 {
                    xattr = c.u32()?;
                }
                Body::Device(dev)
            }
            _ => {
                nlink = c.u32()?;
                if typ >= 13 {
                    xattr = c.u32()?;
                }
                Body::Ipc
            }
        };
        Ok(Inode {
            kind,
            perm: mode & 0o7777,
            uid_idx,
            gid_idx,
            mtime,
            nlink,
            xattr,
            body,
        })
    }
}
