//! Filesystem operations over an [`Archive`], with the little state FUSE needs (open
//! directory listings) and no FUSE types, so it is usable and testable without a mount.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use crate::sync::Mutex;

use crate::archive::{Archive, Data, DirEntry, Kind};
use crate::error::{Error, Result};
use crate::warm::preload::Trigger;
use crate::warm::push::Pusher;

/// Entries of a listing whose release gives the heap's free pages back (~64 bytes each:
/// 1 MiB), so a walk of ImageNet's 1,000 class directories of ~1,300 never trims.
const BIG_LISTING: usize = 16_384;

/// An open directory's entries, `.` and `..` first.
#[derive(Clone)]
pub struct Listing {
    pub entries: Arc<Vec<DirEntry>>,
    /// Opened by the listing ahead (src/warm/prelist.rs), whose listings carry attributes.
    pub by_lister: bool,
}

impl Listing {
    /// At most `most` entries from `offset`, each with the offset that follows it.
    pub fn part(&self, offset: u64, most: usize) -> impl Iterator<Item = (u64, &DirEntry)> {
        let from = usize::try_from(offset).unwrap_or(usize::MAX);
        self.entries
            .iter()
            .enumerate()
            .skip(from)
            .take(most)
            .map(|(i, e)| (i as u64 + 1, e))
    }
}

/// An open directory, its listing read at the first READDIR.
#[derive(Clone)]
struct Opened {
    ino: u64,
    entries: Arc<OnceLock<Arc<Vec<DirEntry>>>>,
    by_lister: bool,
}

pub struct Vfs {
    archive: Arc<dyn Archive>,
    /// Open directories: readdir resumes by index, never by re-scanning.
    dirs: Mutex<HashMap<u64, Opened>>,
    next_handle: AtomicU64,
    /// `--preload=auto`, told of every read.
    preload: Option<Arc<Trigger>>,
    push: Option<Arc<Pusher>>,
}

impl Vfs {
    pub fn new(archive: Arc<dyn Archive>, preload: Option<Arc<Trigger>>) -> Vfs {
        Vfs {
            archive,
            dirs: Mutex::new(HashMap::new()),
            next_handle: AtomicU64::new(1),
            preload,
            push: None,
        }
    }

    pub fn with_push(mut self, push: Option<Arc<Pusher>>) -> Vfs {
        self.push = push;
        self
    }

    pub fn archive(&self) -> &dyn Archive {
        &*self.archive
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

    /// A handle to `ino`'s listing, read at the first READDIR: the kernel keeps listings
    /// (FOPEN_CACHE_DIR) and sends OPENDIR and RELEASEDIR alone for one it has, so a
    /// second walk of 1,000 directories merged from 100 shards each read every one of
    /// them again for nothing (0.35 s against one tar's 0.30 s).
    ///
    /// Also says whether the other side (the job for the lister, the lister for the job)
    /// has the directory open now.
    pub fn opendir(&self, ino: u64, by_lister: bool) -> Result<(u64, bool)> {
        if let (true, Some(p)) = (by_lister, &self.push) {
            p.lister_listing(true);
        }
        let fh = self.next_handle.fetch_add(1, Ordering::Relaxed);
        let mut dirs = self.dirs.lock();
        let other = dirs
            .values()
            .any(|o| o.ino == ino && o.by_lister != by_lister);
        dirs.insert(
            fh,
            Opened {
                ino,
                entries: Arc::new(OnceLock::new()),
                by_lister,
            },
        );
        Ok((fh, other))
    }

    /// Open directory `fh`'s listing, read now if this is its first READDIR. The kernel
    /// sends one READDIR at a time for an open directory.
    pub fn listing(&self, fh: u64) -> Result<Listing> {
        let o = self
            .dirs
            .lock()
            .get(&fh)
            .cloned()
            .ok_or_else(|| Error::corrupt(format!("unknown directory handle {fh}")))?;
        let entries = match o.entries.get() {
            Some(e) => e.clone(),
            None => {
                let e = Arc::new(self.read_listing(o.ino)?);
                o.entries.get_or_init(|| e).clone()
            }
        };
        Ok(Listing {
            entries,
            by_lister: o.by_lister,
        })
    }

    fn read_listing(&self, ino: u64) -> Result<Vec<DirEntry>> {
        let entries = self.archive.read_dir(ino)?;
        let mut listing = Vec::with_capacity(entries.len() + 2);
        for name in [&b"."[..], b".."] {
            listing.push(DirEntry {
                ino,
                kind: Kind::Dir,
                name: name.into(),
            });
        }
        listing.extend(entries);
        Ok(listing)
    }

    /// `dir` was listed with its entries' attributes, so the kernel holds their inodes.
    pub fn listed_with_attrs(&self, dir: u64) {
        if let Some(p) = &self.push {
            p.note_listed(dir);
        }
    }

    /// Drops `fh`'s listing. A big one goes back to the system at once: the kernel sends
    /// RELEASEDIR after the listing process has exited, so the heap trim when it ends can
    /// come first and the 200,000 names of a flat root stayed in a FUSE thread's arena
    /// (RSS after a remount's listing ahead 13.6 or 24 MiB, by which came first).
    pub fn releasedir(&self, fh: u64) {
        let Some(gone) = self.dirs.lock().remove(&fh) else {
            return;
        };
        if let (true, Some(p)) = (gone.by_lister, &self.push) {
            p.lister_listing(false);
        }
        let big = gone.entries.get().is_some_and(|e| e.len() >= BIG_LISTING);
        drop(gone);
        if big {
            crate::memory::give_back();
        }
    }

    pub fn getxattr(&self, ino: u64, name: &[u8]) -> Result<Vec<u8>> {
        self.archive
            .xattrs(ino)?
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v)
            .ok_or(Error::NoXattr)
    }

    /// Names as `listxattr(2)` returns them: each followed by a NUL.
    pub fn listxattr(&self, ino: u64) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        for (name, _) in self.archive.xattrs(ino)? {
            out.extend_from_slice(&name);
            out.push(0);
        }
        Ok(out)
    }
}
