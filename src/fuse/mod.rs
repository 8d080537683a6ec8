//! The serving side: the thin adapter between fuser and [`Vfs`] (one operation, one
//! call, one reply), the operations themselves ([`vfs`], no fuser types) and the push's
//! writes to /dev/fuse ([`store`]). Imports the archive interface and [`crate::warm`].

pub mod store;
pub mod vfs;

use std::collections::HashSet;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use crate::sync::Mutex;
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags,
    IoctlFlags, KernelConfig, LockOwner, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory,
    ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyIoctl, ReplyOpen, ReplyStatfs, ReplyXattr,
    Request,
};

use crate::archive::{Attr, Kind};
use crate::error::Error;
use crate::warm::prelist::Ahead;
use vfs::Vfs;

/// The archive never changes while mounted, so the kernel may keep what it learns.
const TTL: Duration = Duration::from_secs(365 * 24 * 3600);

/// Whether directory listings carry every entry's attributes (READDIRPLUS), so that a
/// walk that stats each file, or a first epoch that opens each one, needs no LOOKUP
/// request per file afterwards.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Readdirplus {
    /// Every listing.
    Always,
    /// The kernel's adaptive mode: the first part of a listing, and parts after a lookup
    /// in that directory.
    Auto,
    Never,
}

pub struct ArchFs {
    vfs: Vfs,
    block_size: u32,
    readdirplus: Readdirplus,
    /// The listing ahead, when on: its listings carry attributes, the job's need not.
    ahead: Option<Arc<Ahead>>,
    /// Errors already logged, so a bad block read a thousand times logs once.
    logged: Mutex<HashSet<String>>,
    /// LOOKUP requests served, logged at unmount: each is a round trip a listing with
    /// attributes (or the listing ahead, src/warm/prelist.rs) would have saved.
    lookups: AtomicU64,
    /// READDIR(PLUS) requests of the job's listings, logged at unmount: none for a
    /// directory the listing ahead has listed, which the kernel keeps (FOPEN_CACHE_DIR).
    job_listings: AtomicU64,
}

impl ArchFs {
    pub fn new(vfs: Vfs, readdirplus: Readdirplus, ahead: Option<Arc<Ahead>>) -> ArchFs {
        let block_size = vfs.archive().stats().block_size;
        ArchFs {
            vfs,
            block_size,
            readdirplus,
            ahead,
            logged: Mutex::new(HashSet::new()),
            lookups: AtomicU64::new(0),
            job_listings: AtomicU64::new(0),
        }
    }

    fn errno(&self, op: &str, ino: u64, e: &Error) -> Errno {
        let code = e.errno();
        if code == libc::EIO {
            let msg = format!("{op} of inode {ino}: {e}");
            let mut logged = self.logged.lock();
            if logged.len() < 10_000 && logged.insert(msg.clone()) {
                tracing::error!("{msg}");
            }
        }
        Errno::from_i32(code)
    }

    fn attr(&self, a: &Attr) -> FileAttr {
        let mtime = if a.mtime >= 0 {
            UNIX_EPOCH + Duration::new(a.mtime as u64, a.mtime_nsec)
        } else {
            UNIX_EPOCH - Duration::from_secs(a.mtime.unsigned_abs())
                + Duration::from_nanos(u64::from(a.mtime_nsec))
        };
        FileAttr {
            ino: INodeNo(a.ino),
            size: a.size,
            blocks: a.blocks,
            atime: mtime,
            mtime,
            ctime: mtime,
            crtime: mtime,
            kind: file_type(a.kind),
            perm: a.perm,
            nlink: a.nlink,
            uid: a.uid,
            gid: a.gid,
            rdev: a.rdev,
            // stdio and Python size their buffers by st_blksize: one archive block.
            blksize: self.block_size,
            flags: 0,
        }
    }
}

impl ArchFs {
    /// The lister asks for the listing of `dir` from `offset`: at its end, the kernel has
    /// taken in every earlier reply, so it holds an inode for every entry.
    fn lister_at(&self, dir: INodeNo, offset: u64, len: usize) {
        if offset >= len as u64 {
            self.vfs.listed_with_attrs(dir.0);
        }
    }
}

fn file_type(kind: Kind) -> FileType {
    match kind {
        Kind::File => FileType::RegularFile,
        Kind::Dir => FileType::Directory,
        Kind::Symlink => FileType::Symlink,
        Kind::BlockDev => FileType::BlockDevice,
        Kind::CharDev => FileType::CharDevice,
        Kind::Fifo => FileType::NamedPipe,
        Kind::Socket => FileType::Socket,
    }
}

impl Filesystem for ArchFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // Readdirplus trades a slower listing (the kernel builds an inode for every entry
        // it lists) for no LOOKUP round trip per file later. At 1.28 M files, cold: `find`
        // 1 s -> 7 s, a stat of every file 64 s -> 9 s, a first epoch 48 s -> 31 s
        // (docs/BENCHMARKS-HISTORY.md, "ImageNet scale").
        let mut wanted = InitFlags::FUSE_PARALLEL_DIROPS | InitFlags::FUSE_CACHE_SYMLINKS;
        // The listing ahead needs the adaptive mode (see prelist::Ahead).
        let mode = match self.ahead {
            Some(_) => Readdirplus::Auto,
            None => self.readdirplus,
        };
        match mode {
            Readdirplus::Always => wanted |= InitFlags::FUSE_DO_READDIRPLUS,
            Readdirplus::Auto => {
                wanted |= InitFlags::FUSE_DO_READDIRPLUS | InitFlags::FUSE_READDIRPLUS_AUTO
            }
            Readdirplus::Never => {}
        }
        if let Err(missing) = config.add_capabilities(wanted) {
            tracing::debug!("kernel lacks capabilities {missing:?}");
            let _ = config.add_capabilities(wanted & !missing);
        }
        if let Err(max) = config.set_max_readahead(1 << 20) {
            let _ = config.set_max_readahead(max);
        }
        let _ = config.set_max_background(64);
        Ok(())
    }

    fn destroy(&mut self) {
        tracing::info!(
            "served {} LOOKUP requests",
            self.lookups.load(Ordering::Relaxed)
        );
        tracing::info!(
            "the job's listings sent {} READDIR requests",
            self.job_listings.load(Ordering::Relaxed)
        );
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        self.lookups.fetch_add(1, Ordering::Relaxed);
        match self.vfs.archive().lookup(parent.0, name.as_bytes()) {
            Ok(a) => reply.entry(&TTL, &self.attr(&a), Generation(0)),
            Err(Error::NotFound) => {
                // Inode 0 with a TTL is a negative entry the kernel caches.
                let mut none = self.attr(&Attr::default());
                none.ino = INodeNo(0);
                reply.entry(&TTL, &none, Generation(0))
            }
            Err(e) => reply.error(self.errno("lookup", parent.0, &e)),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.vfs.archive().attr(ino.0) {
            Ok(a) => reply.attr(&TTL, &self.attr(&a)),
            Err(e) => reply.error(self.errno("getattr", ino.0, &e)),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        match self.vfs.archive().readlink(ino.0) {
            Ok(t) => reply.data(&t),
            Err(e) => reply.error(self.errno("readlink", ino.0, &e)),
        }
    }

    /// Files need no per-open state: ENOSYS tells the kernel to stop sending OPEN and
    /// RELEASE for the rest of the mount and to keep the page cache across opens. The
    /// mount is read-only, so the kernel refuses writes with EROFS before they get here.
    fn open(&self, _req: &Request, _ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        reply.error(Errno::ENOSYS);
    }

    /// Nothing to flush; ENOSYS stops FLUSH on every close after the first, as fuser's
    /// default does, without its warning in the log of every mount.
    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        reply.error(Errno::ENOSYS);
    }

    /// No file here is a device: ENOTTY, what a plain file answers. Python's `open()`
    /// asks each file whether it is a terminal (TCGETS); fuser's default logged a warning
    /// for every one of them.
    fn ioctl(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: IoctlFlags,
        _cmd: u32,
        _in_data: &[u8],
        _out_size: u32,
        reply: ReplyIoctl,
    ) {
        reply.error(Errno::ENOTTY);
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        match self.vfs.read(ino.0, offset, size) {
            Ok(data) => reply.data(&data),
            Err(e) => reply.error(self.errno("read", ino.0, &e)),
        }
    }

    fn opendir(&self, req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let lister = self.ahead.as_ref().is_some_and(|a| a.is_lister(req.pid()));
        // Both listing one directory at once: the job's listing, without attributes,
        // runs ahead and fills the kernel's cache of it, and the lister read on from that
        // cache and made no inodes (2 M entries "listed" in 1.8 s, and 1.7 M LOOKUPs in
        // the epoch after). The second to open neither reads nor fills that cache, and
        // keeps it for the first (KEEP_CACHE).
        match self.vfs.opendir(ino.0, lister) {
            Ok((fh, true)) => reply.opened(FileHandle(fh), FopenFlags::FOPEN_KEEP_CACHE),
            // The lister's listings go to the server even when the kernel has the
            // directory cached from a listing of the job's, which made no inodes (no
            // KEEP_CACHE: the open drops it), and are kept for the job's (CACHE_DIR).
            Ok((fh, _)) if lister => reply.opened(FileHandle(fh), FopenFlags::FOPEN_CACHE_DIR),
            Ok((fh, _)) => reply.opened(
                FileHandle(fh),
                FopenFlags::FOPEN_CACHE_DIR | FopenFlags::FOPEN_KEEP_CACHE,
            ),
            Err(e) => reply.error(self.errno("opendir", ino.0, &e)),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let listing = match self.vfs.listing(fh.0) {
            Ok(l) => l,
            Err(e) => return reply.error(self.errno("readdir", ino.0, &e)),
        };
        // The lister wants attributes: one entry, whose lookup makes the kernel ask for
        // them in the next request.
        let most = if listing.by_lister {
            self.lister_at(ino, offset, listing.entries.len());
            1
        } else {
            self.job_listings.fetch_add(1, Ordering::Relaxed);
            usize::MAX
        };
        for (next, e) in listing.part(offset, most) {
            let name = OsStr::from_bytes(&e.name);
            if reply.add(INodeNo(e.ino), next, file_type(e.kind), name) {
                break;
            }
        }
        reply.ok();
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        let listing = match self.vfs.listing(fh.0) {
            Ok(l) => l,
            Err(e) => return reply.error(self.errno("readdirplus", ino.0, &e)),
        };
        // With the kernel's adaptive mode, later parts of the listing may come as plain
        // READDIR, whose entries the kernel makes no inode for.
        let mut most = usize::MAX;
        if listing.by_lister {
            self.lister_at(ino, offset, listing.entries.len());
        } else {
            self.job_listings.fetch_add(1, Ordering::Relaxed);
            match &self.ahead {
                _ if offset > 0 => {}
                None if self.readdirplus == Readdirplus::Always => {
                    self.vfs.listed_with_attrs(ino.0)
                }
                None => {}
                // The kernel asks because this is the listing's start, not for a lookup
                // in it: one entry (`.`), and the rest comes without attributes.
                Some(_) => most = 1,
            }
        }
        for (next, e) in listing.part(offset, most) {
            let attr = match self.vfs.archive().attr(e.ino) {
                Ok(a) => self.attr(&a),
                Err(err) => return reply.error(self.errno("readdirplus", e.ino, &err)),
            };
            let name = OsStr::from_bytes(&e.name);
            if reply.add(INodeNo(e.ino), next, name, &TTL, &attr, Generation(0)) {
                break;
            }
        }
        reply.ok();
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        self.vfs.releasedir(fh.0);
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let s = self.vfs.archive().stats();
        let bsize = u64::from(s.block_size);
        reply.statfs(
            s.bytes.div_ceil(bsize),
            0,
            0,
            s.inodes,
            0,
            s.block_size,
            s.name_max,
            s.block_size,
        );
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        match self.vfs.getxattr(ino.0, name.as_bytes()) {
            Ok(v) => xattr_reply(reply, &v, size),
            Err(e) => reply.error(self.errno("getxattr", ino.0, &e)),
        }
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        match self.vfs.listxattr(ino.0) {
            Ok(v) => xattr_reply(reply, &v, size),
            Err(e) => reply.error(self.errno("listxattr", ino.0, &e)),
        }
    }
}

/// Size 0 asks for the length; a buffer too small is ERANGE.
fn xattr_reply(reply: ReplyXattr, value: &[u8], size: u32) {
    if size == 0 {
        reply.size(value.len() as u32);
    } else if value.len() > size as usize {
        reply.error(Errno::from_i32(libc::ERANGE));
    } else {
        reply.data(value);
    }
}

impl std::fmt::Debug for ArchFs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArchFs").finish_non_exhaustive()
    }
}
