//! Where an archive's bytes come from, under every format. The formats read a [`Source`],
//! a window of a [`Storage`]: a local file ([`LocalFile`]) or an object in S3 or over
//! HTTP ([`RemoteObject`]), read through the node's staged copy of it when there is one.
//! Imports the crate's foundations (errors, locks, per-process values, memory, the node,
//! the job's topology, progress) and the block cache, which keeps small remote reads.

mod buf;
mod file;
pub mod remote;
pub mod scratch;

use std::os::fd::BorrowedFd;
use std::path::Path;
use std::sync::Arc;

pub use buf::Buf;
#[cfg(test)]
pub use file::tests::resident;
pub use file::{advice_piece, will_need, LocalFile};
pub use remote::{
    fetch_ahead, fetched_ahead, is_url, list_prefix, merged, put_sidecar, read_from_files,
    remote_totals, CopyOf, CopyStatus, Fill, NodeCopy, RemoteObject, RemoteOptions, Staging,
    SIDECAR,
};

use crate::error::{Error, Result};

/// What the formats need of the bytes of one archive, wherever they are kept. Reads are
/// positional and take `&self`, so parallel readers never queue behind each other.
pub trait Storage: Send + Sync + std::fmt::Debug {
    /// Fills `buf` from byte `pos`; [`Source`] keeps every read within [`size`](Self::size).
    fn read_exact_at(&self, buf: &mut [u8], pos: u64) -> std::io::Result<()>;
    /// Bytes in all.
    fn size(&self) -> u64;
    /// What names the archive in messages: a path, or the URL of an object.
    fn path(&self) -> &Path;
    /// Whether [`path`](Self::path) is a file of this machine: an index may be saved
    /// beside it, and the preload streams it into the page cache.
    fn is_local(&self) -> bool;
    /// Modification time in seconds: what a tar member without one shows.
    fn mtime(&self) -> i64;
    /// Changes whenever the bytes may have: what ties a saved index or a cached copy to
    /// this version of the archive (a local file's modification time in nanoseconds).
    fn version(&self) -> i64;
    /// What names these exact bytes on this machine without reading them, 0 where
    /// nothing does: a local file's device, inode and change time (a write, `cp -p`,
    /// `touch -r`, a file renamed over it: each changes one of them).
    fn place_id(&self) -> u64 {
        0
    }
    /// Whether [`version`](Self::version) comes from the server's tag of these exact
    /// bytes (an object's ETag), so that nothing need be read to tell one version from
    /// another. A local file's modification time survives `cp -p` and `touch -r`: no.
    fn tagged(&self) -> bool {
        false
    }
    /// Fills `buf` from `pos`, a read that its reader will likely follow with the rest
    /// of `[pos, end)` (a file's data): a store that fetches over a network may fetch
    /// that at once, so the rest costs no round trips of its own.
    fn read_through(&self, buf: &mut [u8], pos: u64, _end: u64) -> std::io::Result<()> {
        self.read_exact_at(buf, pos)
    }
    /// Starts fetching `[at, at + len)` without waiting, so a scan that reads it soon
    /// overlaps that I/O with its own work. Where nothing can be fetched ahead: nothing.
    fn will_need(&self, _at: u64, _len: u64) {}
    /// `[at, at + len)` is what a format reads before anything else (SquashFS's
    /// tables): where the bytes come over a network, they are fetched now, the end
    /// first, ahead of any copy of the whole. A local file's are read first by the
    /// preload: nothing.
    fn wanted_first(&self, _at: u64, _len: u64) {}
    /// The format is about to read the whole archive (a tar's index scan).
    fn will_scan(&self) {}
    /// Whether `[at, at + len)` is read without fetching bytes the node does not hold:
    /// false only for an object whose node holds a share of its files, not these bytes
    /// (the push leaves such files to their readers).
    fn held(&self, _at: u64, _len: u64) -> bool {
        true
    }
    /// Whether `[at, at + len)` is read now without a GET: false only for bytes of a
    /// node's copy being filled in order ([`fetch_ahead`]) that have not landed in it.
    fn landed(&self, _at: u64, _len: u64) -> bool {
        true
    }
    /// How many times bytes landed in the copy being filled in order, to wait on with
    /// [`wait_landing`](Self::wait_landing); `None` where none is.
    fn landings(&self) -> Option<u32> {
        None
    }
    /// Waits until the count of landings is no longer `seen`, or `timeout` passed;
    /// false, at once, where nothing is worth waiting for (no copy being filled in
    /// order, or one that will not be whole soon).
    fn wait_landing(&self, _seen: u32, _timeout: std::time::Duration) -> bool {
        false
    }
    /// Whether the node holds only a share of its files ([`Storage::held`] may say no).
    fn partial(&self) -> bool {
        false
    }
    /// Whether a local file is read from the node's copy of it (made by the job's
    /// stage-in): it is then not streamed into the page cache nor read ahead from the
    /// shared filesystem.
    fn copied(&self) -> bool {
        false
    }
    /// A descriptor holding `[at, at + len)`, and where they start in it, that the
    /// kernel can splice from (a local file, a staged copy, a node's share of the files);
    /// `None` where those bytes must be read into this process.
    fn fd(&self, _at: u64, _len: u64) -> Option<(BorrowedFd<'_>, u64)> {
        None
    }
    /// Whether reads are served from a node-local copy, made or being made, which will
    /// hold every byte once: bytes stored as they are need then no second home in this
    /// process (a block cache), even before [`fd`](Self::fd) finds them there.
    fn in_node_copy(&self) -> bool {
        false
    }
    /// The node's copy to fill in the order the job will read ([`fetch_ahead`]), placed
    /// now if there is none: an object's. `None` where reads need nothing fetched ahead.
    fn fill(&self) -> Option<Fill> {
        None
    }
    /// The same bytes through a handle of its own, so that a reader that moves through
    /// them on its own course keeps its own read-ahead.
    fn reopen(&self) -> std::io::Result<Arc<dyn Storage>>;
    /// Writes the index kept beside the archive where it is stored (an object's
    /// `KEY.archfs-index`) into `to`; `false` when there is none. A local archive's index
    /// is read where it lies, so: `false`.
    fn fetch_sidecar(&self, _to: &mut std::fs::File) -> std::io::Result<bool> {
        Ok(false)
    }
}

/// Bytes `[base, base + len)` of a [`Storage`]: a whole archive, or a member of one that
/// is an archive itself (a compressed tar inside a tar).
#[derive(Debug)]
pub struct Source {
    store: Arc<dyn Storage>,
    base: u64,
    len: u64,
}

impl Source {
    /// The archive at `path`: a local file, or an object if it is a URL
    /// (`s3://BUCKET/KEY`, `https://...`).
    pub fn open(path: &Path) -> Result<Source> {
        Source::open_with(path, &RemoteOptions::default())
    }

    /// Like [`open`](Self::open), with how to reach objects.
    pub fn open_with(path: &Path, remote: &RemoteOptions) -> Result<Source> {
        if let Some(object) = RemoteObject::open(path, remote) {
            return Ok(Source::new(Arc::new(object?)));
        }
        Ok(Source::new(Arc::new(LocalFile::open(path)?)))
    }

    /// All of `store`.
    pub fn new(store: Arc<dyn Storage>) -> Source {
        Source {
            base: 0,
            len: store.size(),
            store,
        }
    }

    /// The same bytes through a handle of their own ([`Storage::reopen`]).
    pub fn reopen(&self) -> Result<Source> {
        let store = self
            .store
            .reopen()
            .map_err(|e| Error::io(format!("cannot reopen {}", self.path().display()), e))?;
        Ok(Source {
            store,
            base: self.base,
            len: self.len,
        })
    }

    /// Bytes `[at, at + len)` of this source as a source of its own, through a handle
    /// of its own (a compressed tar inside a tar).
    pub fn slice(&self, at: u64, len: u64) -> Result<Source> {
        if at.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(Error::corrupt(format!(
                "a member at {at} of {len} bytes is past the end of {}",
                self.path().display()
            )));
        }
        let mut s = self.reopen()?;
        s.base += at;
        s.len = len;
        Ok(s)
    }

    /// Asks for `[at, at + len)` to be fetched ahead, without waiting
    /// ([`Storage::will_need`]).
    pub fn will_need(&self, at: u64, len: u64) {
        let end = at.saturating_add(len).min(self.len);
        self.store.will_need(self.base + at, end.saturating_sub(at));
    }

    /// Asks for `[at, at + len)` to be fetched before anything else
    /// ([`Storage::wanted_first`]).
    /// Says the whole archive is about to be read (see [`Storage::will_scan`]).
    pub fn will_scan(&self) {
        self.store.will_scan();
    }

    pub fn wanted_first(&self, at: u64, len: u64) {
        let end = at.saturating_add(len).min(self.len);
        self.store
            .wanted_first(self.base + at, end.saturating_sub(at));
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where this source starts in its storage (0 unless it is a [`slice`](Self::slice)).
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Modification time of the archive (seconds).
    pub fn mtime(&self) -> i64 {
        self.store.mtime()
    }

    /// What ties saved state to this version of the archive ([`Storage::version`]).
    pub fn version(&self) -> i64 {
        self.store.version()
    }

    pub fn path(&self) -> &Path {
        self.store.path()
    }

    /// The index kept beside the whole archive in its store ([`Storage::fetch_sidecar`]),
    /// written into `to`; `false` when there is none or this is part of an archive.
    pub fn fetch_sidecar(&self, to: &mut std::fs::File) -> std::io::Result<bool> {
        if self.base != 0 || self.len != self.store.size() {
            return Ok(false);
        }
        self.store.fetch_sidecar(to)
    }

    /// Whether [`version`](Self::version) is the store's tag of these bytes
    /// ([`Storage::tagged`]).
    pub fn tagged(&self) -> bool {
        self.store.tagged()
    }

    /// [`Storage::place_id`] of the whole storage; 0 for a part of it.
    pub fn place_id(&self) -> u64 {
        if self.base != 0 || self.len != self.store.size() {
            return 0;
        }
        self.store.place_id()
    }

    /// [`Storage::held`].
    pub fn held(&self, at: u64, len: u64) -> bool {
        self.store.held(at, len)
    }

    /// [`Storage::landed`], `at` within this source.
    pub fn landed(&self, at: u64, len: u64) -> bool {
        self.store.landed(self.base + at, len)
    }

    /// [`Storage::landings`].
    pub fn landings(&self) -> Option<u32> {
        self.store.landings()
    }

    /// [`Storage::wait_landing`].
    pub fn wait_landing(&self, seen: u32, timeout: std::time::Duration) -> bool {
        self.store.wait_landing(seen, timeout)
    }

    /// [`Storage::partial`].
    pub fn partial(&self) -> bool {
        self.store.partial()
    }

    /// [`Storage::fill`], and where this source starts in it.
    pub fn fill(&self) -> Option<(Fill, u64)> {
        Some((self.store.fill()?, self.base))
    }

    /// [`Storage::in_node_copy`].
    pub fn in_node_copy(&self) -> bool {
        self.store.in_node_copy()
    }

    /// [`Storage::copied`].
    pub fn copied(&self) -> bool {
        self.store.copied()
    }

    /// Whether the archive is a file of this machine ([`Storage::is_local`]).
    pub fn is_local(&self) -> bool {
        self.store.is_local()
    }

    /// Fills `buf` from `pos`; a range past the end of the source means the archive is
    /// truncated or an offset in it is corrupt.
    pub fn read_exact_at(&self, pos: u64, buf: &mut [u8]) -> Result<()> {
        self.read_in(pos, buf, None)
    }

    /// Like [`read_exact_at`](Self::read_exact_at), for a read of data its reader will
    /// likely read on through to `end` ([`Storage::read_through`]).
    pub fn read_through(&self, pos: u64, buf: &mut [u8], end: u64) -> Result<()> {
        self.read_in(pos, buf, Some(end))
    }

    fn read_in(&self, pos: u64, buf: &mut [u8], through: Option<u64>) -> Result<()> {
        let end = pos.checked_add(buf.len() as u64);
        if end.is_none_or(|end| end > self.len) {
            return Err(Error::corrupt(format!(
                "read of {} bytes at offset {pos} is past the end of the archive ({} bytes): truncated?",
                buf.len(),
                self.len
            )));
        }
        let read = match through {
            Some(t) => self
                .store
                .read_through(buf, self.base + pos, self.base + t.min(self.len)),
            None => self.store.read_exact_at(buf, self.base + pos),
        };
        read.map_err(|e| {
            Error::io(
                format!("read at offset {pos} of {}", self.path().display()),
                e,
            )
        })
    }

    /// Where `[pos, pos + len)` lies in a file the kernel can splice from, to move it
    /// without a copy into this process (see [`crate::archive::Archive::stored_at`]);
    /// `None` past the end or where the storage has no such file.
    pub fn stored_at(&self, pos: u64, len: u64) -> Option<(BorrowedFd<'_>, u64)> {
        let end = pos.checked_add(len)?;
        if end > self.len {
            return None;
        }
        self.store.fd(self.base + pos, len)
    }

    /// Reads `len` bytes at `pos` into one of this thread's reusable buffers.
    pub fn read_buf(&self, pos: u64, len: usize) -> Result<Buf> {
        let mut buf = Buf::take(len);
        self.read_exact_at(pos, &mut buf)?;
        Ok(buf)
    }

    /// Reads `len` bytes at `pos` of data read on through to `end` into one of this
    /// thread's reusable buffers ([`read_through`](Self::read_through)).
    pub fn read_buf_through(&self, pos: u64, len: usize, end: u64) -> Result<Buf> {
        let mut buf = Buf::take(len);
        self.read_through(pos, &mut buf, end)?;
        Ok(buf)
    }

    /// Reads `len` bytes at `pos` into a new buffer.
    pub fn read_vec(&self, pos: u64, len: usize) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; len];
        self.read_exact_at(pos, &mut buf)?;
        Ok(buf)
    }
}
