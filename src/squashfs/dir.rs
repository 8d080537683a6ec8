//! Directory listings: runs of entries under headers that share a metadata block and an
//! inode number base, sorted by name; large directories carry an index of the listing so
//! a lookup starts near its name instead of scanning from the top.

use std::cmp::Ordering;

use super::inode::DirInode;
use super::metadata::{Cursor, BLOCK_SIZE};
use super::superblock::{u16_at, u32_at};
use super::SquashFs;
use crate::archive::Kind;
use crate::error::{Error, Result};

/// One entry of a listing, its inode given as a reference into the inode table.
pub struct RawEntry {
    pub inode_ref: u64,
    pub kind: Kind,
    pub name: Vec<u8>,
}

/// An entry as the walk meets it, its name borrowed from the metadata block: a lookup
/// compares hundreds of names and keeps one.
struct EntryRef<'a> {
    inode_ref: u64,
    kind: Kind,
    name: &'a [u8],
}

impl EntryRef<'_> {
    fn owned(&self) -> RawEntry {
        RawEntry {
            inode_ref: self.inode_ref,
            kind: self.kind,
            name: self.name.to_vec(),
        }
    }
}

/// The kernel's limits (fs/squashfs/squashfs_fs.h, enforced in dir.c and namei.c):
/// SQUASHFS_DIR_COUNT entries under one header and SQUASHFS_NAME_LEN-byte names; both tools
/// split runs at 256 entries, and Linux names are at most 255 bytes.
const MAX_HEADER_COUNT: u64 = 256;
const MAX_NAME: usize = 256;

fn kind_of(typ: u16) -> Result<Kind> {
    Ok(match typ {
        1 => Kind::Dir,
        2 => Kind::File,
        3 => Kind::Symlink,
        4 => Kind::BlockDev,
        5 => Kind::CharDev,
        6 => Kind::Fifo,
        7 => Kind::Socket,
        t => {
            return Err(Error::corrupt(format!(
                "directory entry of unknown type {t}"
            )))
        }
    })
}

/// Reads entries from `c` until `remaining` listing bytes are consumed or `visit`
/// returns false.
fn walk(
    mut c: Cursor<'_>,
    mut remaining: u64,
    mut visit: impl FnMut(EntryRef<'_>) -> Result<bool>,
) -> Result<()> {
    let mut scratch = Vec::new();
    while remaining > 0 {
        if remaining < 12 {
            return Err(Error::corrupt("directory listing ends inside a header"));
        }
        let header = c.take(12, &mut scratch)?;
        let count = u64::from(u32_at(header, 0)) + 1;
        let start = u32_at(header, 4);
        remaining -= 12;
        if count > MAX_HEADER_COUNT {
            return Err(Error::corrupt(format!(
                "directory header claims {count} entries"
            )));
        }
        for _ in 0..count {
            if remaining < 8 {
                return Err(Error::corrupt("directory listing ends inside an entry"));
            }
            let fields = c.take(8, &mut scratch)?;
            let offset = u16_at(fields, 0);
            let typ = u16_at(fields, 4);
            let name_len = usize::from(u16_at(fields, 6)) + 1;
            remaining -= 8;
            if name_len > MAX_NAME || name_len as u64 > remaining {
                return Err(Error::corrupt(format!(
                    "directory entry name of {name_len} bytes"
                )));
            }
            let name = c.take(name_len, &mut scratch)?;
            remaining -= name_len as u64;
            if name.contains(&b'/') || name.contains(&0) || name == b"." || name == b".." {
                return Err(Error::corrupt(format!(
                    "directory entry with an illegal name {:?}",
                    String::from_utf8_lossy(name)
                )));
            }
            let entry = EntryRef {
                inode_ref: (u64::from(start) << 16) | u64::from(offset),
                kind: kind_of(typ)?,
                name,
            };
            if !visit(entry)? {
                return Ok(());
            }
        }
    }
    Ok(())
}

impl SquashFs {
    fn listing_len(dir: &DirInode) -> u64 {
        u64::from(dir.file_size).saturating_sub(3)
    }

    /// Every entry of the directory, in listing (name) order.
    pub fn list_dir(&self, dir: &DirInode) -> Result<Vec<RawEntry>> {
        let c = self.cursor(
            self.sb.dir_table + u64::from(dir.block),
            usize::from(dir.offset),
        );
        let mut out = Vec::new();
        walk(c, Self::listing_len(dir), |e| {
            out.push(e.owned());
            Ok(true)
        })?;
        Ok(out)
    }

    /// Finds `name`: in a listing longer than a metadata block, by a binary search of
    /// the directory's table of names, made on its first lookup and kept in the cache;
    /// else by a scan of the listing. (tar2sqfs writes no directory index: a lookup in
    /// its 1,300-entry directories scanned half of them.)
    pub fn find_in_dir(&self, dir: &DirInode, name: &[u8]) -> Result<Option<RawEntry>> {
        if Self::listing_len(dir) <= BLOCK_SIZE as u64 {
            return self.scan_dir(dir, name);
        }
        let key = (u64::from(dir.block) << 16) | u64::from(dir.offset);
        if let Some(table) = self.dir_cache.get(key) {
            return Ok(table.find(name));
        }
        // A table takes about what its listing does. Where tables no longer fit, the
        // directory is scanned: a table made per lookup would cost a whole listing each.
        if self.dir_cache.room(key) < Self::listing_len(dir) as usize {
            return self.scan_dir(dir, name);
        }
        let table = self
            .dir_cache
            .get_or_load(key, || Ok(Table::new(self.list_dir(dir)?)))?;
        Ok(table.find(name))
    }

    /// Finds `name`, scanning from the directory index entry closest before it: a
    /// shuffled epoch over 1.28 M files in 1,000 directories scanned ~140 entries a
    /// lookup (13 µs of 22 µs a file read in process), which the table above avoids.
    fn scan_dir(&self, dir: &DirInode, name: &[u8]) -> Result<Option<RawEntry>> {
        let mut block = self.sb.dir_table + u64::from(dir.block);
        let mut skipped = 0u64;
        if dir.index_count > 0 {
            let (ib, io) = dir.index_pos;
            let mut ic = self.cursor(ib, io);
            for _ in 0..dir.index_count {
                let index = ic.u32()?;
                let start = ic.u32()?;
                let len = ic.u32()? as usize + 1;
                if len > MAX_NAME {
                    // The kernel stops using the index here (namei.c) and scans on from
                    // the best entry so far: the listing itself may well be sound.
                    break;
                }
                let iname = ic.bytes(len)?;
                if iname.as_slice() > name {
                    break;
                }
                skipped = u64::from(index);
                block = self.sb.dir_table + u64::from(start);
            }
        }
        let remaining = Self::listing_len(dir)
            .checked_sub(skipped)
            .ok_or_else(|| Error::corrupt("directory index points past its listing"))?;
        let offset = (skipped as usize + usize::from(dir.offset)) % BLOCK_SIZE;
        let mut found = None;
        walk(self.cursor(block, offset), remaining, |e| {
            Ok(match e.name.cmp(name) {
                Ordering::Less => true,
                Ordering::Equal => {
                    found = Some(e.owned());
                    false
                }
                Ordering::Greater => false,
            })
        })?;
        Ok(found)
    }
}

/// A large directory's names, sorted as the listing is, for lookups by binary search.
pub struct Table {
    names: Vec<u8>,
    /// Where each name ends in `names`.
    ends: Vec<u32>,
    /// Each entry's inode reference (48 bits) and type (3 bits): 8 bytes, so that the
    /// tables of 1.28 M names take ~32 bytes a name.
    entries: Vec<u64>,
}

const KINDS: [Kind; 7] = [
    Kind::File,
    Kind::Dir,
    Kind::Symlink,
    Kind::BlockDev,
    Kind::CharDev,
    Kind::Fifo,
    Kind::Socket,
];

impl Table {
    fn new(listing: Vec<RawEntry>) -> Table {
        let mut t = Table {
            names: Vec::with_capacity(listing.iter().map(|e| e.name.len()).sum()),
            ends: Vec::with_capacity(listing.len()),
            entries: Vec::with_capacity(listing.len()),
        };
        for e in listing {
            t.names.extend_from_slice(&e.name);
            t.ends.push(t.names.len() as u32);
            let kind = KINDS.iter().position(|&k| k == e.kind).unwrap_or(0) as u64;
            t.entries.push(e.inode_ref << 3 | kind);
        }
        t
    }

    fn name(&self, i: usize) -> &[u8] {
        let start = if i == 0 { 0 } else { self.ends[i - 1] as usize };
        &self.names[start..self.ends[i] as usize]
    }

    fn find(&self, name: &[u8]) -> Option<RawEntry> {
        let (mut lo, mut hi) = (0, self.entries.len());
        while lo < hi {
            let mid = (lo + hi) / 2;
            match self.name(mid).cmp(name) {
                Ordering::Less => lo = mid + 1,
                Ordering::Greater => hi = mid,
                Ordering::Equal => {
                    let packed = self.entries[mid];
                    return Some(RawEntry {
                        inode_ref: packed >> 3,
                        kind: KINDS[(packed & 7) as usize],
                        name: name.to_vec(),
                    });
                }
            }
        }
        None
    }
}

impl crate::cache::Weighted for Table {
    fn weight(&self) -> usize {
        self.names.len() + self.ends.len() * 4 + self.entries.len() * 8 + 64
    }
}
