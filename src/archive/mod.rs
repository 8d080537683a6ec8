//! The interface every archive format implements, the union of several, and the full
//! walk `archfs check` makes. The FUSE adapter, the CLI's inspection commands and the
//! tests all go through it, so a format is tested once, without a mount. Imports no
//! format: choosing one is [`crate::open`]'s.

pub mod check;
pub mod names;
pub mod path;
mod union;

use std::ops::{Deref, Range};
use std::os::fd::BorrowedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use union::Union;

use crate::error::{Error, Result};
use crate::source::{Buf, Source};

/// The inode number of the archive's root directory (FUSE's root is 1 too).
pub const ROOT_INO: u64 = 1;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Kind {
    #[default]
    File,
    Dir,
    Symlink,
    BlockDev,
    CharDev,
    Fifo,
    Socket,
}

/// What `stat` shows for one inode.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Attr {
    pub ino: u64,
    pub kind: Kind,
    /// Permission bits including setuid, setgid and sticky (`mode & 0o7777`).
    pub perm: u16,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    /// Allocated 512-byte blocks.
    pub blocks: u64,
    pub mtime: i64,
    pub mtime_nsec: u32,
    /// Device number in the kernel's `new_encode_dev` form.
    pub rdev: u32,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirEntry {
    pub ino: u64,
    pub kind: Kind,
    pub name: Box<[u8]>,
}

/// Totals for `statfs`.
#[derive(Clone, Copy, Debug)]
pub struct Stats {
    pub bytes: u64,
    pub block_size: u32,
    pub inodes: u64,
    pub name_max: u32,
}

/// A byte range of an archive file, for warming the page cache ahead of reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Extent {
    pub path: PathBuf,
    pub range: Range<u64>,
    /// Directory and inode tables: worth caching even when the data is not.
    pub metadata: bool,
}

/// Bytes returned by a read: a slice of a cached block when one block covers the request
/// (no copy), or a buffer of the reading thread's (a read spanning blocks, a tar member).
pub enum Data {
    Shared(Arc<Vec<u8>>, Range<usize>),
    Owned(Buf),
}

impl Deref for Data {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Data::Shared(block, range) => &block[range.clone()],
            Data::Owned(v) => v,
        }
    }
}

/// Fetches files `inos` of `archive`, in this order, into the node's copies of the
/// objects they are stored in, in the background, in place of this process's last
/// order ([`crate::source::fetch_ahead`]); the number of files it will fetch. Files not
/// stored whole in an object's own bytes (a compressed tar's, a local archive's) are
/// left to their reads.
pub fn fetch_ahead(archive: &dyn Archive, inos: &[u64]) -> usize {
    let mut spans = Vec::new();
    let mut files = 0;
    // The fill of the last source seen: a union's files come from many, one at a time.
    let mut last: Option<(*const Source, Option<(crate::source::Fill, u64)>)> = None;
    for &ino in inos {
        let Some((source, ranges)) = archive.stored_in(ino) else {
            continue;
        };
        let fill = match &last {
            Some((s, fill)) if std::ptr::eq(*s, source) => fill.clone(),
            _ => {
                let fill = source.fill();
                last = Some((source as *const Source, fill.clone()));
                fill
            }
        };
        let Some((fill, base)) = fill else {
            continue;
        };
        files += 1;
        spans.extend(
            ranges
                .into_iter()
                .map(|r| (fill.clone(), base + r.start, r.end - r.start)),
        );
    }
    // The tables first: every worker's lookups read them.
    if let Some((fill, base)) = last.and_then(|(_, fill)| fill) {
        // In GETs of a few MiB, side by side, each read as soon as it is there.
        const PART: u64 = 4 << 20;
        let tables = archive.tables().into_iter();
        let tables: Vec<_> = tables
            .flat_map(|r| {
                (r.start..r.end)
                    .step_by(PART as usize)
                    .map(move |at| (at, r.end))
            })
            .map(|(at, end)| (fill.clone(), base + at, PART.min(end - at)))
            .collect();
        spans.splice(0..0, tables);
    }
    crate::source::fetch_ahead(spans);
    files
}

/// The positions in `inos` of the files a read finds whole where it reads them: all
/// but those in a node's copy being filled in order ([`fetch_ahead`]) whose bytes have
/// not landed yet. When there are none, waits for bytes to land while the order's
/// process runs, the copy will be whole soon
/// ([`crate::source::Storage::wait_landing`]) and nothing landed for less than `wait`.
/// A DataLoader worker decodes its batch's files as the order brings them, rather than
/// waiting for the last (under a full shuffle a batch has files in nearly every block of
/// the object) or fetching them one GET each beside the order's blocks: at 1.28 M files
/// those took a third of the server's GETs while the first batch waited for its own.
pub fn landed(archive: &dyn Archive, inos: &[u64], wait: Duration) -> Vec<usize> {
    let mut quiet = (Instant::now(), None);
    loop {
        let mut first = None;
        let mut ready = Vec::new();
        for (i, &ino) in inos.iter().enumerate() {
            let Some((source, ranges)) = archive.stored_in(ino) else {
                ready.push(i);
                continue;
            };
            // The count before the look: what lands after it wakes the wait below.
            let seen = source.landings();
            if ranges
                .iter()
                .all(|r| source.landed(r.start, r.end - r.start))
            {
                ready.push(i);
            } else if first.is_none() {
                first = seen.map(|n| (source, n));
            }
        }
        let Some((source, seen)) = first.filter(|_| ready.is_empty()) else {
            return ready;
        };
        if quiet.1 != Some(seen) {
            quiet = (Instant::now(), Some(seen));
        }
        let left = wait.saturating_sub(quiet.0.elapsed());
        // Short steps: a union's other objects land on boards of their own.
        if left.is_zero() || !source.wait_landing(seen, left.min(Duration::from_millis(50))) {
            return ready;
        }
    }
}

/// A read-only archive: inode numbers are stable for the life of the object, and
/// `ROOT_INO` is the root directory.
pub trait Archive: Send + Sync {
    /// Short name of the format, for logs and `archfs info`.
    fn format(&self) -> String;
    fn attr(&self, ino: u64) -> Result<Attr>;
    /// Finds `name` in directory `dir`; `Error::NotFound` when absent.
    fn lookup(&self, dir: u64, name: &[u8]) -> Result<Attr>;
    /// All entries of a directory, without `.` and `..`, in archive order.
    fn read_dir(&self, dir: u64) -> Result<Vec<DirEntry>>;
    /// Up to `size` bytes from `offset`; fewer only at end of file.
    fn read(&self, ino: u64, offset: u64, size: u32) -> Result<Data>;
    /// Where bytes `offset..` of file `ino`, up to `size` and the end of the file, lie
    /// verbatim in a file on disk: the descriptor, the position and the length. The push
    /// splices such bytes into the kernel without copying them through this process.
    /// `None`: read them.
    fn stored_at(&self, _ino: u64, _offset: u64, _size: u32) -> Option<(BorrowedFd<'_>, u64, u32)> {
        None
    }
    /// Bytes `offset..` of file `ino` into `buf`, as many as fit or the file holds: by
    /// `pread` where [`Archive::stored_at`] finds them, else by [`Archive::read`]. For
    /// the in-process reader, which has a buffer where the mount has a pipe.
    fn read_into(&self, ino: u64, offset: u64, buf: &mut [u8]) -> Result<usize> {
        path::fill(
            offset,
            buf,
            |at, n| self.stored_at(ino, at, n),
            |at, n| self.read(ino, at, n),
        )
    }
    /// Where file `ino`'s data lies among the others': files taken in this order are
    /// read front to back (the push's order). Inode numbers, where they were handed out
    /// in archive order.
    fn place(&self, ino: u64) -> u64 {
        ino
    }
    fn readlink(&self, ino: u64) -> Result<Vec<u8>>;
    /// Extended attributes as full names (`user.x`) and values.
    fn xattrs(&self, ino: u64) -> Result<Vec<(Vec<u8>, Vec<u8>)>>;
    fn stats(&self) -> Stats;
    /// One past the largest inode number this archive hands out: a union numbers its
    /// members' inodes one after another from it.
    fn ino_end(&self) -> u64;
    /// Members the archive holds but does not show, one line each (a hard link tar -x
    /// cannot make, a damaged header skipped): `archfs check` counts them as damage.
    fn left_out(&self) -> Vec<String> {
        Vec::new()
    }
    /// The byte ranges of the archive files that serving reads touches, metadata first.
    fn extents(&self) -> Vec<Extent>;
    /// Where file `ino`'s bytes lie in the archive as stored (compressed blocks, the
    /// fragment block its tail shares with others): what a node's copy of a share of the
    /// files holds. `None` where they do not lie in the archive's own bytes (a member of a
    /// compressed tar or of a nested archive, a sparse member, a union).
    fn stored(&self, _ino: u64) -> Option<Vec<Range<u64>>> {
        None
    }
    /// [`Archive::stored`], with the source those ranges are of: for a union, the
    /// member's. What [`fetch_ahead`] fetches.
    fn stored_in(&self, _ino: u64) -> Option<(&Source, Vec<Range<u64>>)> {
        None
    }
    /// Whether file `ino` is read without fetching bytes the node does not hold: false
    /// for a file outside the node's share of a remote archive's files. The push leaves
    /// such files to their readers.
    fn held(&self, _ino: u64) -> bool {
        true
    }
    /// The archive's tables (superblock, directories, inodes, fragments), which every
    /// read of a path needs: in a node's copy of a share too. Empty: none apart from the
    /// files.
    fn tables(&self) -> Vec<Range<u64>> {
        Vec::new()
    }
    /// `--preload` of a compressed archive: decode all of it in the background into a
    /// copy reads are then served from.
    fn decode_ahead(&self, _which: DecodeAhead) {}
    /// Whether a decoded copy is still being made: reads meanwhile decode in place.
    fn decoding_ahead(&self) -> bool {
        false
    }
}

/// Which compressed archives [`Archive::decode_ahead`] starts decoding, and where to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeAhead {
    /// Those whose reads would decode far (entry points over a MiB apart: xz and bzip2
    /// blocks, pzstd frames), into memory if it fits: `--preload=auto` at mount, since
    /// a read before the copy decodes a whole block or frame for one file.
    Far,
    /// All, into memory if it fits (`--preload=auto` once reads show an epoch).
    Memory,
    /// All, into memory if it fits, else onto --stage-dir (`--preload=always`).
    Any,
}

/// Walks `path` (relative to the archive root; `/` and `.` components are ignored) to
/// its inode, for the inspection commands.
pub fn resolve(archive: &dyn Archive, path: &Path) -> Result<Attr> {
    use std::os::unix::ffi::OsStrExt;
    let mut attr = archive.attr(ROOT_INO)?;
    for comp in path.components() {
        match comp {
            std::path::Component::Normal(name) => {
                attr = archive.lookup(attr.ino, name.as_bytes())?;
            }
            std::path::Component::ParentDir => {
                return Err(Error::Usage("`..` is not allowed in archive paths".into()))
            }
            _ => {}
        }
    }
    Ok(attr)
}
