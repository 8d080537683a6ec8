//! A SquashFS 4.0 reader written for random access from many threads: positional reads,
//! one shared cache of decoded blocks, no lock around the image file. Imports the
//! archive interface, [`crate::source`] and [`crate::cache`]; never fuser.
//!
//! Format reference: squashfs-tools-ng's doc/format.adoc.

mod compressor;
mod dir;
mod file;
mod inode;
mod lzo;
mod metadata;
mod superblock;
mod table;
mod xattr;

use std::os::fd::BorrowedFd;
use std::sync::Arc;

pub use compressor::Compressor;
use inode::{Body, Inode, NO_XATTR};
use metadata::MetaBlock;
pub use superblock::Superblock;
use superblock::NO_TABLE;
use xattr::XattrTable;

use crate::archive::{Archive, Attr, Data, DirEntry, Extent, Kind, Stats, ROOT_INO};
use crate::cache::{BlockCache, CacheConfig};
use crate::error::{Error, Result};
use crate::source::Source;

pub struct SquashFs {
    source: Source,
    sb: Superblock,
    ids: Vec<u32>,
    frag_ptrs: Vec<u64>,
    xattrs: Option<XattrTable>,
    meta_cache: BlockCache<MetaBlock>,
    frag_cache: BlockCache<Vec<u8>>,
    data_cache: BlockCache<Vec<u8>>,
    layout_cache: BlockCache<file::Layout>,
    /// Large directories' tables of names, for lookups (dir.rs).
    dir_cache: BlockCache<dir::Table>,
    zero_block: Arc<Vec<u8>>,
}

impl SquashFs {
    /// Reads the superblock and the small tables; everything else is read on demand.
    pub fn open(source: Source, cache: &CacheConfig) -> Result<SquashFs> {
        let mut raw = [0u8; superblock::SIZE];
        if source.len() < superblock::SIZE as u64 {
            return Err(Error::corrupt(format!(
                "{} is only {} bytes, smaller than a SquashFS superblock",
                source.path().display(),
                source.len()
            )));
        }
        source.read_exact_at(0, &mut raw)?;
        let sb = Superblock::parse(&raw, source.len())?;
        // The tables follow the data: every lookup and listing reads them.
        let tables = sb.inode_table.min(sb.bytes_used);
        source.wanted_first(tables, sb.bytes_used - tables);
        let (meta, frag, data) = cache.split(u64::from(sb.inode_count));
        let frag_ptrs = if sb.frag_count > 0 && sb.frag_table != NO_TABLE {
            table::read_pointers(
                &source,
                sb.frag_table,
                u64::from(sb.frag_count),
                16,
                sb.bytes_used,
                "fragment",
            )?
        } else {
            Vec::new()
        };
        let xattrs = if sb.xattr_table != NO_TABLE {
            Some(XattrTable::load(&source, sb.xattr_table, sb.bytes_used)?)
        } else {
            None
        };
        let mut fs = SquashFs {
            zero_block: Arc::new(vec![0u8; sb.block_size as usize]),
            source,
            sb,
            ids: Vec::new(),
            frag_ptrs,
            xattrs,
            // Of ~128 bytes an inode: 48 for metadata blocks, 64 for the tables of names
            // of large directories (~41 bytes a name, and room for uneven shards), 16
            // for the layouts of files with blocks (a file held in a fragment needs none).
            meta_cache: BlockCache::new("metadata", meta * 3 / 8),
            layout_cache: BlockCache::new("layout", meta / 8),
            dir_cache: BlockCache::with_shards("directory", meta / 2, 4),
            frag_cache: BlockCache::new("fragment", frag),
            data_cache: BlockCache::new("data", data),
        };
        if fs.sb.frag_count > 0 && fs.frag_ptrs.is_empty() {
            return Err(Error::corrupt(
                "fragments are used but the fragment table is missing",
            ));
        }
        fs.ids = fs.load_ids()?;
        let root = fs.inode(fs.sb.root_inode)?;
        if root.kind != Kind::Dir {
            return Err(Error::corrupt("the root inode is not a directory"));
        }
        Ok(fs)
    }

    pub fn superblock(&self) -> &Superblock {
        &self.sb
    }

    /// FUSE needs the root at 1 and never sees 0; every other inode is its reference
    /// plus 2, which is never 1 (references start at 0) and costs no table.
    fn to_ref(&self, ino: u64) -> u64 {
        if ino == ROOT_INO {
            self.sb.root_inode
        } else {
            ino.wrapping_sub(2)
        }
    }

    fn to_ino(&self, inode_ref: u64) -> u64 {
        if inode_ref == self.sb.root_inode {
            ROOT_INO
        } else {
            inode_ref + 2
        }
    }

    fn dir_inode(&self, ino: u64) -> Result<inode::DirInode> {
        match self.inode(self.to_ref(ino))?.body {
            Body::Dir(d) => Ok(d),
            _ => Err(Error::NotDir),
        }
    }

    fn make_attr(&self, ino: u64, inode: &Inode) -> Result<Attr> {
        let (size, rdev) = match &inode.body {
            Body::File(f) => (f.size, 0),
            Body::Dir(d) => (u64::from(d.file_size), 0),
            Body::Symlink(t) => (t.len() as u64, 0),
            Body::Device(dev) => (0, *dev),
            Body::Ipc => (0, 0),
        };
        Ok(Attr {
            ino,
            kind: inode.kind,
            perm: inode.perm,
            nlink: inode.nlink,
            uid: self.id(inode.uid_idx)?,
            gid: self.id(inode.gid_idx)?,
            size,
            blocks: size.div_ceil(512),
            mtime: i64::from(inode.mtime),
            mtime_nsec: 0,
            rdev,
        })
    }
}

impl Archive for SquashFs {
    fn format(&self) -> String {
        format!(
            "SquashFS 4.0, {}, {} KiB blocks",
            self.sb.compressor.name(),
            self.sb.block_size / 1024
        )
    }

    fn attr(&self, ino: u64) -> Result<Attr> {
        let inode = self.inode(self.to_ref(ino))?;
        self.make_attr(ino, &inode)
    }

    fn lookup(&self, dir: u64, name: &[u8]) -> Result<Attr> {
        let inode_ref = self
            .find_in_dir(self.to_ref(dir), name)?
            .ok_or(Error::NotFound)?;
        let inode = self.inode(inode_ref)?;
        self.make_attr(self.to_ino(inode_ref), &inode)
    }

    fn read_dir(&self, dir: u64) -> Result<Vec<DirEntry>> {
        let d = self.dir_inode(dir)?;
        let mut entries = self.list_dir(&d)?;
        // A name given twice (a hostile image) is listed twice, as the kernel lists it,
        // each time as the entry a lookup of it finds: a listing that carries attributes
        // (READDIRPLUS) must not hand the kernel the other one.
        let sorted = entries.windows(2).all(|w| w[0].name < w[1].name);
        if !sorted {
            let mut seen = std::collections::HashSet::new();
            let twice: std::collections::HashSet<Vec<u8>> = entries
                .iter()
                .filter(|e| !seen.insert(e.name.as_slice()))
                .map(|e| e.name.clone())
                .collect();
            for e in entries.iter_mut().filter(|e| twice.contains(&e.name)) {
                if let Some(found) = self.find_in_dir(self.to_ref(dir), &e.name)? {
                    let kind = self
                        .make_attr(self.to_ino(found), &self.inode(found)?)?
                        .kind;
                    (e.inode_ref, e.kind) = (found, kind);
                }
            }
        }
        Ok(entries
            .into_iter()
            .map(|e| DirEntry {
                ino: self.to_ino(e.inode_ref),
                kind: e.kind,
                name: e.name.into_boxed_slice(),
            })
            .collect())
    }

    fn read(&self, ino: u64, offset: u64, size: u32) -> Result<Data> {
        self.read_file(self.to_ref(ino), offset, size)
    }

    fn stored_at(&self, ino: u64, offset: u64, size: u32) -> Option<(BorrowedFd<'_>, u64, u32)> {
        self.stored_at(self.to_ref(ino), offset, size)
    }

    fn read_into(&self, ino: u64, offset: u64, buf: &mut [u8]) -> Result<usize> {
        self.read_into(self.to_ref(ino), offset, buf)
    }

    fn stored(&self, ino: u64) -> Option<Vec<std::ops::Range<u64>>> {
        self.stored_ranges(self.to_ref(ino)).ok()
    }

    fn stored_in(&self, ino: u64) -> Option<(&Source, Vec<std::ops::Range<u64>>)> {
        Some((&self.source, self.stored(ino)?))
    }

    fn held(&self, ino: u64) -> bool {
        !self.source.partial()
            || self.stored(ino).is_none_or(|rs| {
                rs.iter()
                    .all(|r| self.source.held(r.start, r.end - r.start))
            })
    }

    /// The superblock with the compressor's options, and the tables, which follow the
    /// data in every image mksquashfs writes (as in `extents`).
    fn tables(&self) -> Vec<std::ops::Range<u64>> {
        let split = self.sb.inode_table.min(self.sb.bytes_used);
        vec![0..split.min(4096), split..self.sb.bytes_used]
    }

    fn readlink(&self, ino: u64) -> Result<Vec<u8>> {
        match self.inode(self.to_ref(ino))?.body {
            Body::Symlink(t) => Ok(t),
            _ => Err(Error::NotSymlink),
        }
    }

    fn xattrs(&self, ino: u64) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        let inode = self.inode(self.to_ref(ino))?;
        if inode.xattr == NO_XATTR {
            return Ok(Vec::new());
        }
        self.read_xattrs(inode.xattr)
    }

    fn stats(&self) -> Stats {
        Stats {
            bytes: self.sb.bytes_used,
            block_size: self.sb.block_size,
            inodes: u64::from(self.sb.inode_count),
            name_max: 256,
        }
    }

    /// An inode is its reference plus 2: a metadata block's start in the inode table above
    /// 16 bits of offset into it.
    fn ino_end(&self) -> u64 {
        let table = self.sb.dir_table.saturating_sub(self.sb.inode_table);
        table
            .saturating_add(1)
            .saturating_mul(1 << 16)
            .saturating_add(2)
    }

    /// Tables follow the data in every image mksquashfs writes: the inode table starts
    /// where data and fragment blocks end.
    fn extents(&self) -> Vec<Extent> {
        if !self.source.is_local() || self.source.copied() {
            return Vec::new();
        }
        let path = self.source.path().to_owned();
        let split = self.sb.inode_table.min(self.sb.bytes_used);
        vec![
            Extent {
                path: path.clone(),
                range: split..self.sb.bytes_used,
                metadata: true,
            },
            Extent {
                path,
                range: 0..split,
                metadata: false,
            },
        ]
    }
}
