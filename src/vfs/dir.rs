//! Open directories: their handles, the listing read once per handle and resumed by
//! offset, the cache flags each open gets, and the listing-ahead protocol, which decides
//! which listings carry attributes ([`crate::warm::prelist::ListerPid`] says why).

use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};

use super::Vfs;
use crate::archive::{Attr, DirEntry, Kind};
use crate::error::{Error, Result};

/// Entries of a listing whose release gives the heap's free pages back (~64 bytes each:
/// 1 MiB), so a walk of ImageNet's 1,000 class directories of ~1,300 never trims.
const BIG_LISTING: usize = 16_384;

/// Whether directory listings carry every entry's attributes (READDIRPLUS), so that a
/// walk that stats each file, or a first epoch that opens each one, needs no LOOKUP
/// request per file afterwards. `--readdirplus` takes it (the variants' comments stay out
/// of `--help`: the option's own text says what each value does).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "mount", derive(clap::ValueEnum))]
pub enum Readdirplus {
    /// Every listing.
    #[cfg_attr(feature = "mount", value(help = None::<&str>))]
    Always,
    /// The kernel's adaptive mode: the first part of a listing, and parts after a lookup
    /// in that directory.
    #[cfg_attr(feature = "mount", value(help = None::<&str>))]
    Auto,
    Never,
}

/// One entry of a directory listing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirectoryEntry<'a> {
    pub ino: u64,
    /// The offset of the entry after this one: where a listing resumes.
    pub offset: u64,
    pub kind: Kind,
    pub name: &'a [u8],
    /// The entry's attributes: in every entry of a READDIRPLUS reply, in none of a
    /// READDIR one.
    pub attr: Option<Attr>,
}

/// Where a listing's entries go: the kernel's reply buffer in the adapter, a vector in
/// tests.
pub trait DirectoryReplier {
    /// Adds `entry`; `true` when the reply is full and `entry` was left out.
    fn add(&mut self, entry: DirectoryEntry<'_>) -> bool;
}

/// An open directory's handle and how the kernel may cache its listing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Opened {
    pub fh: u64,
    /// The kernel keeps the listing it has cached (FOPEN_KEEP_CACHE).
    pub keep_cache: bool,
    /// The kernel caches this open's listing (FOPEN_CACHE_DIR).
    pub cache_dir: bool,
}

/// An open directory, its listing read at the first READDIR.
#[derive(Clone)]
pub(super) struct OpenDir {
    ino: u64,
    entries: Arc<OnceLock<Arc<Vec<DirEntry>>>>,
    /// Opened by the listing ahead (src/warm/prelist.rs), whose listings carry attributes.
    by_lister: bool,
}

/// An open directory's entries, `.` and `..` first.
struct Listing {
    ino: u64,
    entries: Arc<Vec<DirEntry>>,
    by_lister: bool,
}

impl Listing {
    /// At most `most` entries from `offset`, each with the offset that follows it.
    fn part(&self, offset: u64, most: usize) -> impl Iterator<Item = (u64, &DirEntry)> {
        let from = usize::try_from(offset).unwrap_or(usize::MAX);
        self.entries
            .iter()
            .enumerate()
            .skip(from)
            .take(most)
            .map(|(i, e)| (i as u64 + 1, e))
    }
}

impl Vfs {
    /// A handle to `ino`'s listing for the request of thread `tid`, the listing read at
    /// the first READDIR: the kernel keeps listings (FOPEN_CACHE_DIR) and sends OPENDIR
    /// and RELEASEDIR alone for one it has, so a second walk of 1,000 directories merged
    /// from 100 shards each read every one of them again for nothing (0.35 s against
    /// one tar's 0.30 s).
    pub fn opendir(&self, ino: u64, tid: u32) -> Result<Opened> {
        let by_lister = self.ahead.as_ref().is_some_and(|a| a.is_lister(tid));
        if let (true, Some(p)) = (by_lister, &self.push) {
            p.lister_listing(true);
        }
        let fh = self.next_handle.fetch_add(1, Ordering::Relaxed);
        let mut dirs = self.dirs.lock();
        // The other side (the job for the lister, the lister for the job) has it open.
        let other = dirs
            .values()
            .any(|o| o.ino == ino && o.by_lister != by_lister);
        dirs.insert(
            fh,
            OpenDir {
                ino,
                entries: Arc::new(OnceLock::new()),
                by_lister,
            },
        );
        Ok(match (other, by_lister) {
            // Both listing one directory at once: the job's listing, without attributes,
            // runs ahead and fills the kernel's cache of it, and the lister read on from
            // that cache and made no inodes (2 M entries "listed" in 1.8 s, and 1.7 M
            // LOOKUPs in the epoch after). The second to open neither reads nor fills
            // that cache, and keeps it for the first.
            (true, _) => Opened {
                fh,
                keep_cache: true,
                cache_dir: false,
            },
            // The lister's listings go to the server even when the kernel has the
            // directory cached from a listing of the job's, which made no inodes (the
            // open drops it), and are kept for the job's.
            (false, true) => Opened {
                fh,
                keep_cache: false,
                cache_dir: true,
            },
            (false, false) => Opened {
                fh,
                keep_cache: true,
                cache_dir: true,
            },
        })
    }

    /// Entries of open directory `fh` from `offset` into `replier`, without attributes.
    pub fn readdir(&self, fh: u64, offset: u64, replier: &mut impl DirectoryReplier) -> Result<()> {
        let listing = self.listing(fh)?;
        // The lister wants attributes: one entry, whose lookup makes the kernel ask for
        // them in the next request.
        let most = if listing.by_lister {
            self.lister_at(&listing, offset);
            1
        } else {
            self.job_listings.fetch_add(1, Ordering::Relaxed);
            usize::MAX
        };
        for (next, e) in listing.part(offset, most) {
            let entry = DirectoryEntry {
                ino: e.ino,
                offset: next,
                kind: e.kind,
                name: &e.name,
                attr: None,
            };
            if replier.add(entry) {
                break;
            }
        }
        Ok(())
    }

    /// Entries of open directory `fh` from `offset` into `replier`, with attributes.
    pub fn readdirplus(
        &self,
        fh: u64,
        offset: u64,
        replier: &mut impl DirectoryReplier,
    ) -> Result<()> {
        let listing = self.listing(fh)?;
        // With the kernel's adaptive mode, later parts of the listing may come as plain
        // READDIR, whose entries the kernel makes no inode for.
        let mut most = usize::MAX;
        if listing.by_lister {
            self.lister_at(&listing, offset);
        } else {
            self.job_listings.fetch_add(1, Ordering::Relaxed);
            match &self.ahead {
                _ if offset > 0 => {}
                None if self.plus == Readdirplus::Always => self.listed_with_attrs(listing.ino),
                None => {}
                // The kernel asks because this is the listing's start, not for a lookup
                // in it: one entry (`.`), and the rest comes without attributes.
                Some(_) => most = 1,
            }
        }
        for (next, e) in listing.part(offset, most) {
            let attr = self
                .archive
                .attr(e.ino)
                .map_err(|err| err.at(format_args!("inode {}", e.ino)))?;
            let entry = DirectoryEntry {
                ino: e.ino,
                offset: next,
                kind: e.kind,
                name: &e.name,
                attr: Some(attr),
            };
            if replier.add(entry) {
                break;
            }
        }
        Ok(())
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

    /// Open directory `fh`'s listing, read now if this is its first READDIR. The kernel
    /// sends one READDIR at a time for an open directory.
    fn listing(&self, fh: u64) -> Result<Listing> {
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
            ino: o.ino,
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

    /// The lister asks for `listing` from `offset`: at its end, the kernel has taken in
    /// every earlier reply, so it holds an inode for every entry.
    fn lister_at(&self, listing: &Listing, offset: u64) {
        if offset >= listing.entries.len() as u64 {
            self.listed_with_attrs(listing.ino);
        }
    }

    /// `dir` was listed with its entries' attributes, so the kernel holds their inodes.
    fn listed_with_attrs(&self, dir: u64) {
        if let Some(p) = &self.push {
            p.note_listed(dir);
        }
    }
}
