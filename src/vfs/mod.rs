//! The filesystem's operations over an [`Archive`], each returning what the FUSE adapter
//! ([`crate::fuse`]) replies: attributes, bytes, open handles with their cache flags,
//! directory entries through a [`DirectoryReplier`]. Every decision is made here (which
//! errno, which cache flags, which listings carry attributes), so the whole filesystem
//! is testable without a mount (tests/vfs.rs); the adapter only converts and replies,
//! and answers itself only the requests no operation here serves (OPEN and FLUSH, which
//! files need none of, and IOCTL). No fuser types: nothing here or below imports fuser.

mod dir;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::sync::Mutex;

use crate::archive::{Archive, Attr, Data};
use crate::error::{Error, Result};
use crate::warm::prelist::ListerPid;
use crate::warm::preload::Trigger;
use crate::warm::push::Pusher;
pub use dir::{DirectoryEntry, DirectoryReplier, Opened, Readdirplus};

/// How long the kernel may keep what it learns (attributes, names, negative entries):
/// the archive never changes while mounted.
pub const TTL: Duration = Duration::from_secs(365 * 24 * 3600);

pub struct Vfs {
    archive: Arc<dyn Archive>,
    /// Open directories: readdir resumes by index, never by re-scanning.
    dirs: Mutex<std::collections::HashMap<u64, dir::OpenDir>>,
    next_handle: AtomicU64,
    /// `--preload=auto`, told of every read.
    preload: Option<Arc<Trigger>>,
    push: Option<Arc<Pusher>>,
    /// Which of the job's listings carry attributes.
    plus: Readdirplus,
    /// The listing ahead, when on: its listings carry attributes, the job's need not.
    ahead: Option<Arc<ListerPid>>,
    /// LOOKUP requests served: each is a round trip a listing with attributes (or the
    /// listing ahead, src/warm/prelist.rs) would have saved.
    lookups: AtomicU64,
    /// READDIR(PLUS) requests of the job's listings: none for a directory the listing
    /// ahead has listed, which the kernel keeps (FOPEN_CACHE_DIR).
    job_listings: AtomicU64,
}

/// Requests that show whether the kernel's caches did their work, logged at unmount.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Served {
    pub lookups: u64,
    pub job_listings: u64,
}

/// What `statfs(2)` shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Statfs {
    /// Blocks of `block_size` the archive's contents take.
    pub blocks: u64,
    pub files: u64,
    pub block_size: u32,
    pub name_max: u32,
}

/// An extended attribute's value or a list of names, as `getxattr(2)` and
/// `listxattr(2)` answer a buffer of a given size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Xattr {
    /// The buffer size was 0: how many bytes the answer takes.
    Size(u32),
    Data(Vec<u8>),
}

impl Xattr {
    /// `value` for a buffer of `size` bytes: size 0 asks for the length, and a buffer
    /// too small is ERANGE.
    fn fit(value: Vec<u8>, size: u32) -> Result<Xattr> {
        if size == 0 {
            Ok(Xattr::Size(value.len() as u32))
        } else if value.len() > size as usize {
            Err(Error::BufferTooSmall)
        } else {
            Ok(Xattr::Data(value))
        }
    }
}

impl Vfs {
    pub fn new(archive: Arc<dyn Archive>, preload: Option<Arc<Trigger>>) -> Vfs {
        Vfs {
            archive,
            dirs: Mutex::new(std::collections::HashMap::new()),
            next_handle: AtomicU64::new(1),
            preload,
            push: None,
            plus: Readdirplus::Always,
            ahead: None,
            lookups: AtomicU64::new(0),
            job_listings: AtomicU64::new(0),
        }
    }

    pub fn with_push(mut self, push: Option<Arc<Pusher>>) -> Vfs {
        self.push = push;
        self
    }

    /// Which listings carry attributes: `plus` for the job's, unless `ahead` (the
    /// listing ahead) is on, whose listings carry them instead.
    pub fn with_readdirplus(mut self, plus: Readdirplus, ahead: Option<Arc<ListerPid>>) -> Vfs {
        self.plus = plus;
        self.ahead = ahead;
        self
    }

    /// `st_blksize`: one archive block, which stdio and Python size their buffers by.
    pub fn blksize(&self) -> u32 {
        self.archive.stats().block_size
    }

    /// The READDIRPLUS mode to ask the kernel for: the listing ahead needs the adaptive
    /// one (see [`ListerPid`]).
    pub fn kernel_readdirplus(&self) -> Readdirplus {
        match self.ahead {
            Some(_) => Readdirplus::Auto,
            None => self.plus,
        }
    }

    pub fn served(&self) -> Served {
        Served {
            lookups: self.lookups.load(Ordering::Relaxed),
            job_listings: self.job_listings.load(Ordering::Relaxed),
        }
    }

    /// `name` in directory `parent`; `None` when there is no such name, which the
    /// adapter replies as a negative entry (inode 0 with a TTL) that the kernel caches.
    pub fn lookup(&self, parent: u64, name: &[u8]) -> Result<Option<Attr>> {
        self.lookups.fetch_add(1, Ordering::Relaxed);
        match self.archive.lookup(parent, name) {
            Ok(a) => Ok(Some(a)),
            Err(Error::NotFound) => Ok(None),
            Err(e) => Err(e),
        }
    }

    pub fn getattr(&self, ino: u64) -> Result<Attr> {
        self.archive.attr(ino)
    }

    pub fn readlink(&self, ino: u64) -> Result<Vec<u8>> {
        self.archive.readlink(ino)
    }

    pub fn read(&self, ino: u64, offset: u64, size: u32) -> Result<Data> {
        if let Some(t) = &self.preload {
            t.note_read(offset);
        }
        if let Some(p) = &self.push {
            p.note_read(ino);
        }
        // Bytes that lie as they are in a file the kernel caches (a local archive, the
        // node's copy of a remote one) are read from there, not kept in the block cache
        // too: eight mounts of one image on a node each held ~250 MB of it.
        if self.archive.stored_at(ino, offset, size).is_some() {
            let mut buf = crate::source::Buf::take(size as usize);
            let n = self.archive.read_into(ino, offset, &mut buf)?;
            buf.truncate(n);
            return Ok(Data::Owned(buf));
        }
        self.archive.read(ino, offset, size)
    }

    pub fn statfs(&self) -> Statfs {
        let s = self.archive.stats();
        Statfs {
            blocks: s.bytes.div_ceil(u64::from(s.block_size)),
            files: s.inodes,
            block_size: s.block_size,
            name_max: s.name_max,
        }
    }

    /// Attribute `name` of `ino`, for a buffer of `size` bytes.
    pub fn getxattr(&self, ino: u64, name: &[u8], size: u32) -> Result<Xattr> {
        let value = self
            .archive
            .xattrs(ino)?
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v)
            .ok_or(Error::NoXattr)?;
        Xattr::fit(value, size)
    }

    /// `ino`'s attribute names, each followed by a NUL, for a buffer of `size` bytes.
    pub fn listxattr(&self, ino: u64, size: u32) -> Result<Xattr> {
        let mut out = Vec::new();
        for (name, _) in self.archive.xattrs(ino)? {
            out.extend_from_slice(&name);
            out.push(0);
        }
        Xattr::fit(out, size)
    }
}
