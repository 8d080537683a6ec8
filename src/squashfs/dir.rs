//! Directory listings: runs of entries under headers that share a metadata block and an
//! inode number base, sorted by name; large directories carry an index of the listing so
//! a lookup starts near its name instead of scanning from the top.

use super::inode::{Body, DirInode};
use super::metadata::{Cursor, BLOCK_SIZE};
use super::superblock::{u16_at, u32_at};
use super::SquashFs;
use crate::archive::names::NameIndex;
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

    /// The inode reference of `name`: in a listing longer than a metadata block,
    /// from the directory's table of names, made on its first lookup and kept in the
    /// cache; else by a scan of the listing. (tar2sqfs writes no directory index: a lookup
    /// in its 1,300-entry directories scanned half of them.)
    /// The table is found by the directory's inode reference, before its inode is read.
    pub fn find_in_dir(&self, dir_ref: u64, name: &[u8]) -> Result<Option<u64>> {
        if let Some(table) = self.dir_cache.get(dir_ref) {
            return Ok(table.find(name));
        }
        let dir = match self.inode(dir_ref)?.body {
            Body::Dir(d) => d,
            _ => return Err(Error::NotDir),
        };
        // A table takes about what its listing does. Where tables no longer fit, the
        // directory is scanned: a table made per lookup would cost a whole listing each.
        let len = Self::listing_len(&dir);
        if len <= BLOCK_SIZE as u64 || self.dir_cache.room(dir_ref) < len as usize {
            return self.scan_dir(&dir, name);
        }
        let table = self.dir_cache.get_or_load(dir_ref, || {
            // Records take no more than the listing: 8 bytes and the name an entry, where
            // the listing has 8 and the name, and a 12-byte header a run of entries.
            let mut r = Records {
                bytes: Vec::with_capacity(len as usize),
                at: Vec::new(),
                sorted: true,
            };
            let c = self.cursor(
                self.sb.dir_table + u64::from(dir.block),
                usize::from(dir.offset),
            );
            walk(c, len, |e| {
                r.push(e.inode_ref, e.name);
                Ok(true)
            })?;
            Ok(Table::new(r))
        })?;
        if !table.sorted {
            // Where the kernel's scan and a table could differ (a name twice, names out
            // of order), its scan decides.
            return self.scan_dir(&dir, name);
        }
        Ok(table.find(name))
    }

    /// Finds `name`, scanning from the directory index entry closest before it: a
    /// shuffled epoch over 1.28 M files in 1,000 directories scanned ~140 entries a
    /// lookup (13 µs of 22 µs a file read in process), which the table above avoids.
    fn scan_dir(&self, dir: &DirInode, name: &[u8]) -> Result<Option<u64>> {
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
        // The kernel's rule (namei.c), which decides for a listing out of order or with a
        // name twice (a hostile image): the first entry of the name from where the index
        // points, and no further than the first entry whose first byte is past the name's.
        walk(self.cursor(block, offset), remaining, |e| {
            if e.name == name {
                found = Some(e.inode_ref);
                return Ok(false);
            }
            Ok(e.name.first() <= name.first())
        })?;
        Ok(found)
    }
}

/// A large directory's entries under a hash of their names: a lookup reads one slot
/// and one record.
pub struct Table {
    /// Records: the name's length - 1 (a byte), the inode reference (48 bits) in 7
    /// bytes, then the name.
    records: Vec<u8>,
    /// Record positions by name.
    index: NameIndex,
    /// Whether every name is greater than the one before, as mksquashfs writes them.
    sorted: bool,
}

/// The name of the record at `at`.
fn name_at(records: &[u8], at: usize) -> &[u8] {
    let len = usize::from(records[at]) + 1;
    records.get(at + 8..at + 8 + len).unwrap_or_default()
}

/// A table's records as the listing is walked: no entry of its own, no name allocated.
#[derive(Default)]
struct Records {
    bytes: Vec<u8>,
    at: Vec<u32>,
    sorted: bool,
}

impl Records {
    fn push(&mut self, inode_ref: u64, name: &[u8]) {
        if let Some(&last) = self.at.last() {
            self.sorted &= name_at(&self.bytes, last as usize) < name;
        }
        // A listing is at most 4 GiB (its size is a u32), names at most 256 bytes.
        self.at.push(self.bytes.len() as u32);
        self.bytes.push((name.len() - 1) as u8);
        self.bytes.extend_from_slice(&inode_ref.to_le_bytes()[..7]);
        self.bytes.extend_from_slice(name);
    }
}

impl Table {
    fn new(r: Records) -> Table {
        let names = r.at.iter().map(|&at| (name_at(&r.bytes, at as usize), at));
        let index = NameIndex::new(r.at.len(), names);
        Table {
            records: r.bytes,
            index,
            sorted: r.sorted,
        }
    }

    /// The inode reference of `name`.
    fn find(&self, name: &[u8]) -> Option<u64> {
        let at =
            self.index
                .find(name, |at| name_at(&self.records, at as usize) == name)? as usize;
        let mut inode_ref = [0u8; 8];
        inode_ref[..7].copy_from_slice(&self.records[at + 1..at + 8]);
        Some(u64::from_le_bytes(inode_ref))
    }
}

impl crate::cache::Weighted for Table {
    fn weight(&self) -> usize {
        self.records.len() + self.index.bytes() + 64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_finds_every_name_and_no_other() {
        // Names of every length a listing allows (1 to 256 bytes), each unique by its
        // prefix, and near-misses of each.
        let names: Vec<Vec<u8>> = (0..3000u32)
            .map(|i| {
                let mut n = format!("{i:x}.").into_bytes();
                n.resize(n.len().max(1 + (i as usize * 31) % 256), b'x');
                n
            })
            .collect();
        let want = |i: usize| (i as u64) << 16 | 0xffff_0000_0000;
        let mut r = Records {
            sorted: true,
            ..Records::default()
        };
        for (i, n) in names.iter().enumerate() {
            r.push(want(i), n);
        }
        let t = Table::new(r);
        for (i, n) in names.iter().enumerate() {
            assert_eq!(t.find(n), Some(want(i)), "{}", String::from_utf8_lossy(n));
            for other in [[n.as_slice(), b"x"].concat(), n[..n.len() - 1].to_vec()] {
                if !names.contains(&other) {
                    assert_eq!(t.find(&other), None);
                }
            }
        }
        assert_eq!(t.find(b""), None);
    }
}
