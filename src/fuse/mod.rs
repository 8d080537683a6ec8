//! The serving side: the thin adapter between fuser and [`Vfs`] (one operation, one
//! call, one reply: every decision is the Vfs's) and the push's writes to /dev/fuse
//! ([`store`]). The one module besides [`crate::job`] that imports fuser.

pub mod store;

use std::collections::HashSet;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
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
use crate::vfs::{DirectoryEntry, DirectoryReplier, Readdirplus, Vfs, Xattr, TTL};

pub struct ArchFs {
    vfs: Vfs,
    blksize: u32,
    /// Errors already logged, so a bad block read a thousand times logs once.
    logged: Mutex<HashSet<String>>,
}

impl ArchFs {
    pub fn new(vfs: Vfs) -> ArchFs {
        ArchFs {
            blksize: vfs.blksize(),
            vfs,
            logged: Mutex::new(HashSet::new()),
        }
    }

    /// `e`'s errno, an I/O error logged once.
    fn errno(&self, op: &str, ino: INodeNo, e: &Error) -> Errno {
        let code = e.errno();
        if code == libc::EIO {
            let msg = format!("{op} of inode {}: {e}", ino.0);
            let mut logged = self.logged.lock();
            if logged.len() < 10_000 && logged.insert(msg.clone()) {
                tracing::error!("{msg}");
            }
        }
        Errno::from_i32(code)
    }
}

fn file_attr(a: &Attr, blksize: u32) -> FileAttr {
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
        blksize,
        flags: 0,
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

impl DirectoryReplier for ReplyDirectory {
    fn add(&mut self, e: DirectoryEntry<'_>) -> bool {
        let name = OsStr::from_bytes(e.name);
        ReplyDirectory::add(self, INodeNo(e.ino), e.offset, file_type(e.kind), name)
    }
}

/// A READDIRPLUS reply, with the `st_blksize` its attributes carry.
struct WithAttrs<'a>(&'a mut ReplyDirectoryPlus, u32);

impl DirectoryReplier for WithAttrs<'_> {
    fn add(&mut self, e: DirectoryEntry<'_>) -> bool {
        // The Vfs gives every entry of a READDIRPLUS listing its attributes.
        debug_assert!(e.attr.is_some(), "no attributes for a READDIRPLUS entry");
        let attr = e.attr.unwrap_or(Attr {
            ino: e.ino,
            kind: e.kind,
            ..Attr::default()
        });
        let name = OsStr::from_bytes(e.name);
        let attr = file_attr(&attr, self.1);
        self.0
            .add(INodeNo(e.ino), e.offset, name, &TTL, &attr, Generation(0))
    }
}

impl Filesystem for ArchFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // Readdirplus trades a slower listing (the kernel builds an inode for every entry
        // it lists) for no LOOKUP round trip per file later. At 1.28 M files, tar, cold:
        // `find` 0.6 s -> 2.6 s, a stat of every file 31.0 s -> 4.7 s, a first epoch with
        // 2 readers 23.2 s -> 17.0 s
        // (docs/history/2026-11-23-to-25-summary-imagenet-scale-machines.md#imagenet-scale-1281167-files-2026-11-24-commit-fb867ba).
        let mut wanted = InitFlags::FUSE_PARALLEL_DIROPS | InitFlags::FUSE_CACHE_SYMLINKS;
        match self.vfs.kernel_readdirplus() {
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
        let served = self.vfs.served();
        tracing::info!("served {} LOOKUP requests", served.lookups);
        tracing::info!(
            "the job's listings sent {} READDIR requests",
            served.job_listings
        );
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        match self.vfs.lookup(parent.0, name.as_bytes()) {
            Ok(Some(a)) => reply.entry(&TTL, &file_attr(&a, self.blksize), Generation(0)),
            // Inode 0 with a TTL is a negative entry the kernel caches.
            Ok(None) => reply.entry(
                &TTL,
                &file_attr(&Attr::default(), self.blksize),
                Generation(0),
            ),
            Err(e) => reply.error(self.errno("lookup", parent, &e)),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.vfs.getattr(ino.0) {
            Ok(a) => reply.attr(&TTL, &file_attr(&a, self.blksize)),
            Err(e) => reply.error(self.errno("getattr", ino, &e)),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        match self.vfs.readlink(ino.0) {
            Ok(t) => reply.data(&t),
            Err(e) => reply.error(self.errno("readlink", ino, &e)),
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
            Err(e) => reply.error(self.errno("read", ino, &e)),
        }
    }

    fn opendir(&self, req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.vfs.opendir(ino.0, req.pid()) {
            Ok(o) => {
                let mut flags = FopenFlags::empty();
                flags.set(FopenFlags::FOPEN_KEEP_CACHE, o.keep_cache);
                flags.set(FopenFlags::FOPEN_CACHE_DIR, o.cache_dir);
                reply.opened(FileHandle(o.fh), flags)
            }
            Err(e) => reply.error(self.errno("opendir", ino, &e)),
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
        match self.vfs.readdir(fh.0, offset, &mut reply) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(self.errno("readdir", ino, &e)),
        }
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        match self
            .vfs
            .readdirplus(fh.0, offset, &mut WithAttrs(&mut reply, self.blksize))
        {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(self.errno("readdirplus", ino, &e)),
        }
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
        let s = self.vfs.statfs();
        reply.statfs(
            s.blocks,
            0,
            0,
            s.files,
            0,
            s.block_size,
            s.name_max,
            s.block_size,
        );
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        match self.vfs.getxattr(ino.0, name.as_bytes(), size) {
            Ok(x) => xattr_reply(reply, x),
            Err(e) => reply.error(self.errno("getxattr", ino, &e)),
        }
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        match self.vfs.listxattr(ino.0, size) {
            Ok(x) => xattr_reply(reply, x),
            Err(e) => reply.error(self.errno("listxattr", ino, &e)),
        }
    }
}

fn xattr_reply(reply: ReplyXattr, x: Xattr) {
    match x {
        Xattr::Size(n) => reply.size(n),
        Xattr::Data(v) => reply.data(&v),
    }
}

impl std::fmt::Debug for ArchFs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArchFs").finish_non_exhaustive()
    }
}
