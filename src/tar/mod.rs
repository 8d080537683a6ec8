//! Tar archives (v7, ustar, GNU, PAX) served in place: an index of the headers, and
//! reads at the members' offsets through the shared block cache. Imports the archive
//! interface, [`crate::source`], [`crate::cache`] and [`crate::compressed`]; never fuser.
//!
//! One structure a module, in the order an archive goes through them:
//! - `header`: one 512-byte header block in its dialects, and PAX records;
//! - `blocks`: how header blocks are read, through a window that adapts to the members;
//! - `entries`: the members of a tar stream, the extension headers (GNU long names,
//!   PAX, old GNU sparse) folded into the member they describe;
//! - `builder`: the walk over the entries that builds the index, as `tar -x` would
//!   leave the tree;
//! - `nested`: tars inside the archive shown as directories (`--recursive`);
//! - `index` and `column`: the packed table that answers lookups;
//! - `merge` and `union`: several archives served as one;
//! - `persist`: the saved index, its byte layout documented at its top;
//! - this file: the archive as the mount serves it, and opening one.

mod blocks;
mod builder;
mod column;
mod entries;
mod header;
pub mod index;
mod merge;
mod nested;
pub mod persist;
mod union;

pub use union::{union_index_path, Merged};

use std::collections::HashMap;
use std::ops::Range;
use std::os::fd::BorrowedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use index::{kind_of, Index, Node, SPARSE};

use crate::sync::RwLock;

use crate::archive::names::NameIndex;
use crate::archive::{Archive, Attr, Data, DirEntry, Extent, Kind, Stats, ROOT_INO};
use crate::compressed::{Compression, Decoded, Points, Scan};
use crate::error::{Error, Result};
use crate::source::{Buf, Source};

pub use builder::BuildOptions;

/// Entry points every 128 KiB of decoded data: on the bench's tar.gz a cold shuffled
/// epoch took 7.25 s at 1 MiB, 4.49 s at 256 KiB, 4.11 s at 128 KiB and 4.04 s at
/// 64 KiB, with saved indexes of 0.05-0.15% of the archive (sparse windows).
pub const DEFAULT_SPACING: u64 = 128 << 10;

/// Whether `raw` is a non-empty header with a valid checksum.
pub fn header_ok(raw: &[u8; 512]) -> bool {
    let h = header::Header::new(raw);
    !h.is_zero() && h.checksum_ok()
}

/// Whether `source` starts with a tar header whose checksum holds (or with an empty
/// tar's zeros).
pub fn is_tar_start(source: &Source) -> bool {
    let mut raw = [0u8; 512];
    if source.len() < 512 || source.read_exact_at(0, &mut raw).is_err() {
        return false;
    }
    header_ok(&raw) || (raw.iter().all(|&b| b == 0) && source.len() % 512 == 0)
}

/// What `st_blksize` and `statfs` report: stdio and Python size their buffers by it.
const IO_SIZE: u32 = 128 << 10;

/// Members of a plain tar are read straight from the archive file with `pread`, into the
/// reading thread's buffer. The kernel's page cache of the archive is the only cache: a
/// chunk cache of our own (until this was measured) read a whole 128 KiB chunk into a new
/// buffer for each small read that missed, held 523 MiB in a 10,000-file epoch, and cost
/// ~30% more server CPU
/// (docs/history/2026-11-23-to-25-summary-imagenet-scale-machines.md#what-each-choice-bought).
/// A compressed tar is read through its decoded view, which caches what it decodes.
pub struct TarArchive {
    body: Body,
    /// Compressed tars inside a plain one (`--recursive`), body 1 first.
    nested: Vec<Body>,
    index: Index,
    /// Hash indexes of large directories' names by directory, made on first lookup:
    /// ~12 bytes a name (16 MiB at 1.28 M files).
    hashed: RwLock<HashMap<u32, NameIndex>>,
    /// A union of tars ([`TarArchive::union`]): where each member's stream starts in
    /// the index's data offsets, `body` the first member's and `nested` the others'.
    /// Empty for one archive.
    starts: Vec<u64>,
}

/// Directories of more names than this are looked up by hash, the others by binary
/// search.
const HASHED_FROM: usize = 32;

/// Where the tar stream is.
pub enum Body {
    Plain(Arc<Source>),
    Decoded(Box<Decoded>),
}

impl Body {
    pub fn source(&self) -> &Source {
        match self {
            Body::Plain(s) => s,
            Body::Decoded(d) => d.source(),
        }
    }

    fn len(&self) -> u64 {
        match self {
            Body::Plain(s) => s.len(),
            Body::Decoded(d) => d.len(),
        }
    }

    /// `len` bytes at `pos` of a member whose data ends at `member_end`.
    fn read(&self, pos: u64, len: usize, member_end: u64) -> Result<Data> {
        match self {
            Body::Plain(s) => Ok(Data::Owned(s.read_buf_through(pos, len, member_end)?)),
            Body::Decoded(d) => d.read(pos, len, member_end),
        }
    }

    fn read_into(&self, pos: u64, out: &mut [u8], member_end: u64) -> Result<()> {
        match self {
            Body::Plain(s) => s.read_through(pos, out, member_end),
            Body::Decoded(d) => {
                out.copy_from_slice(&d.read(pos, out.len(), member_end)?);
                Ok(())
            }
        }
    }
}

/// How compressed data is decoded: a compressed archive's, and with `--recursive`
/// compressed tars inside a plain one.
#[derive(Clone, Debug)]
pub struct Decoding {
    /// Decoded bytes between entry points.
    pub spacing: u64,
    /// The decoded-block cache and decoders, shared by every compressed stream of the
    /// mount (a union's shards, compressed tars inside an archive).
    pub stream_cache: Arc<crate::compressed::StreamCache>,
    /// Where a decoded copy goes when one is needed and memory is short.
    pub stage_dir: Option<std::path::PathBuf>,
    /// Decoded bytes beyond which an archive is refused (the fuzz targets' bound on a
    /// decompression bomb; `u64::MAX` for users, whose disk is the bound).
    pub limit: u64,
}

impl Default for Decoding {
    fn default() -> Decoding {
        Decoding {
            spacing: DEFAULT_SPACING,
            stream_cache: crate::compressed::StreamCache::new(
                crate::cache::CacheConfig::default().total_bytes,
            ),
            stage_dir: None,
            limit: u64::MAX,
        }
    }
}

impl TarArchive {
    /// Indexes the archive in one pass over its headers (and, with `--recursive`, one
    /// over each compressed tar inside it).
    pub fn build(
        source: Arc<Source>,
        opts: BuildOptions,
        how: &Decoding,
        progress: &mut dyn FnMut(u64),
    ) -> Result<TarArchive> {
        let len = source.len();
        let opener = opts.recursive.then(|| nested::Opener {
            source: source.clone(),
            spacing: how.spacing,
            limit: how.limit,
        });
        let mut b = builder::Builder::new(opts, opener, progress);
        b.scan(source.as_ref(), 0, len, &[], 0)?;
        let nested = b.take_bodies();
        let index = b.finish();
        say_left_out(Some(source.path()), &index.skipped);
        TarArchive::from_index(Body::Plain(source), nested, how, index)
    }

    /// Indexes a compressed archive in one pass that decodes it, recording entry points
    /// on the way.
    pub fn build_compressed(
        source: Arc<Source>,
        opts: BuildOptions,
        codec: Compression,
        how: &Decoding,
        progress: &mut (dyn FnMut(u64) + Send),
    ) -> Result<TarArchive> {
        let (index, points) = {
            let scan = Scan::new(&source, codec, how.spacing, how.limit, progress)?;
            let mut quiet = |_| {};
            let mut b = builder::Builder::new(opts, None, &mut quiet);
            b.scan(&scan, 0, u64::MAX >> 1, &[], 0)?;
            let points = scan.finish()?;
            b.check_within(points.len())?;
            (b.finish(), points)
        };
        say_left_out(Some(source.path()), &index.skipped);
        let decoded = Decoded::new(
            source,
            codec,
            points,
            &how.stream_cache,
            how.stage_dir.as_deref(),
        )?;
        TarArchive::from_index(Body::Decoded(Box::new(decoded)), Vec::new(), how, index)
    }

    /// `nested`: the compressed tars inside a plain archive.
    pub fn from_index(
        body: Body,
        nested: Vec<nested::Nested>,
        how: &Decoding,
        index: Index,
    ) -> Result<TarArchive> {
        let nested = nested
            .into_iter()
            .map(|n| {
                let slice = Arc::new(body.source().slice(n.at, n.len)?);
                let d = Decoded::new(
                    slice,
                    n.codec,
                    n.points,
                    &how.stream_cache,
                    how.stage_dir.as_deref(),
                )?;
                Ok(Body::Decoded(Box::new(d)))
            })
            .collect::<Result<_>>()?;
        Ok(TarArchive {
            body,
            nested,
            index,
            hashed: RwLock::default(),
            starts: Vec::new(),
        })
    }

    pub fn body(&self) -> &Body {
        &self.body
    }

    /// The archive's stream and those of compressed tars inside it, or a union's
    /// members' streams.
    fn bodies(&self) -> impl Iterator<Item = &Body> {
        std::iter::once(&self.body).chain(&self.nested)
    }

    pub fn index(&self) -> &Index {
        &self.index
    }

    fn node(&self, ino: u64) -> Result<(u32, Node)> {
        let id = self.id(ino)?;
        Ok((id, self.index.node(id)))
    }

    /// The index's node of inode `ino`.
    fn id(&self, ino: u64) -> Result<u32> {
        Ok(ino
            .checked_sub(1)
            .filter(|&i| i < self.index.node_count() as u64)
            .ok_or(Error::NotFound)? as u32)
    }

    fn make_attr(&self, id: u32, n: &Node) -> Attr {
        let kind = kind_of(n.kind);
        let stored = if n.flags & SPARSE != 0 {
            self.index.sparse_map(n).iter().map(|s| s.len).sum()
        } else if kind == Kind::File {
            n.size
        } else {
            0
        };
        Attr {
            ino: u64::from(id) + 1,
            kind,
            perm: n.mode,
            nlink: n.nlink,
            uid: n.uid,
            gid: n.gid,
            size: n.size,
            blocks: stored.div_ceil(512),
            mtime: n.mtime,
            mtime_nsec: n.mtime_nsec,
            rdev: n.rdev,
        }
    }

    /// The body a member's data offset is in, and the offset within it.
    fn body_at(&self, data: u64) -> Result<(&Body, u64)> {
        if !self.starts.is_empty() {
            let k = self.starts.partition_point(|&s| s <= data) - 1;
            let body = if k == 0 {
                &self.body
            } else {
                &self.nested[k - 1]
            };
            return Ok((body, data - self.starts[k]));
        }
        match nested::body_of(data) {
            (0, at) => Ok((&self.body, at)),
            (k, at) => self
                .nested
                .get(k - 1)
                .map(|b| (b, at))
                .ok_or_else(|| Error::corrupt("a member's data is in no archive")),
        }
    }

    fn read_sparse(&self, n: &Node, offset: u64, end: u64) -> Result<Data> {
        let map_end = match self.index.sparse_map(n).last() {
            Some(s) => self.body_at(s.archive_off)?.1 + s.len,
            None => 0,
        };
        let mut out = Buf::take((end - offset) as usize);
        out.fill(0);
        let map = self.index.sparse_map(n);
        let start = map.partition_point(|s| s.offset + s.len <= offset);
        for s in &map[start..] {
            if s.offset >= end {
                break;
            }
            let lo = s.offset.max(offset);
            let hi = (s.offset + s.len).min(end);
            let (body, at) = self.body_at(s.archive_off)?;
            body.read_into(
                at + (lo - s.offset),
                &mut out[(lo - offset) as usize..(hi - offset) as usize],
                map_end,
            )?;
        }
        Ok(Data::Owned(out))
    }
}

impl TarArchive {
    /// Node `name` among directory `dir`'s `entries`.
    fn find(&self, dir: u32, entries: Range<usize>, name: &[u8]) -> Option<u32> {
        if entries.len() <= HASHED_FROM {
            return self.index.find(entries, name);
        }
        let start = entries.start;
        let is = |i: u32| self.index.name(start + i as usize) == name;
        // Found under the read lock: no count of references taken a lookup.
        let known = self.hashed.read().get(&dir).map(|h| h.find(name, is));
        let i = match known {
            Some(found) => found,
            None => {
                let names = entries.map(|i| (self.index.name(i), (i - start) as u32));
                let h = NameIndex::new(names.len(), names);
                let found = h.find(name, is);
                self.hashed.write().entry(dir).or_insert(h);
                found
            }
        }?;
        Some(self.index.child(start + i as usize))
    }
}

/// Logs what an index left out: the first lines, and how many more `archfs check` lists.
/// A union's lines name their member already (`archive` is `None`).
pub(crate) fn say_left_out(archive: Option<&Path>, lines: &[String]) {
    const SHOWN: usize = 20;
    let on = archive
        .map(|p| format!("{}: ", p.display()))
        .unwrap_or_default();
    for s in lines.iter().take(SHOWN) {
        tracing::warn!("{on}skipped {s}");
    }
    if lines.len() > SHOWN {
        let more = lines.len() - SHOWN;
        tracing::warn!("{on}skipped {more} more members (`archfs check` lists them)");
    }
}

impl Archive for TarArchive {
    /// Each line names its archive: a merged union's name their member already.
    fn left_out(&self) -> Vec<String> {
        if !self.starts.is_empty() {
            return self.index.skipped.clone();
        }
        let name = self.body.source().path().display().to_string();
        self.index
            .skipped
            .iter()
            .map(|s| format!("{name}: {s}"))
            .collect()
    }

    fn format(&self) -> String {
        let codec = match &self.body {
            Body::Plain(_) => String::new(),
            Body::Decoded(d) => format!(
                " ({}, {} entry point{}{}{})",
                d.codec().name(),
                d.points().count(),
                if d.points().count() == 1 { "" } else { "s" },
                match d.points().window_bytes() {
                    0 => String::new(),
                    w => format!(", windows {} KiB", w.div_ceil(1024)),
                },
                if d.staged() {
                    ", served from a decoded copy"
                } else {
                    ""
                }
            ),
        };
        let nested = match self.nested.len() {
            0 => String::new(),
            _ if !self.starts.is_empty() => String::new(),
            1 => ", 1 compressed tar inside".into(),
            n => format!(", {n} compressed tars inside"),
        };
        let (what, codec) = match self.starts.len() {
            0 => ("tar".to_string(), codec),
            n => (format!("union of {n} tar archives"), String::new()),
        };
        format!(
            "{what}{codec}{nested}, {} inodes, {} entries, index {} MiB",
            self.index.node_count(),
            self.index.dirent_count(),
            self.index.heap_bytes() >> 20
        )
    }

    fn attr(&self, ino: u64) -> Result<Attr> {
        let (id, n) = self.node(ino)?;
        Ok(self.make_attr(id, &n))
    }

    fn lookup(&self, dir: u64, name: &[u8]) -> Result<Attr> {
        let (id, n) = self.node(dir)?;
        if kind_of(n.kind) != Kind::Dir {
            return Err(Error::NotDir);
        }
        let entries = n.data as usize..n.data as usize + n.aux as usize;
        let child = self.find(id, entries, name).ok_or(Error::NotFound)?;
        Ok(self.make_attr(child, &self.index.node(child)))
    }

    fn read_dir(&self, dir: u64) -> Result<Vec<DirEntry>> {
        let id = self.id(dir)?;
        if kind_of(self.index.kind(id)) != Kind::Dir {
            return Err(Error::NotDir);
        }
        Ok(self
            .index
            .children(id)
            .map(|i| {
                let child = self.index.child(i);
                DirEntry {
                    ino: u64::from(child) + 1,
                    kind: kind_of(self.index.kind(child)),
                    name: self.index.name(i).into(),
                }
            })
            .collect())
    }

    fn read(&self, ino: u64, offset: u64, size: u32) -> Result<Data> {
        let (_, n) = self.node(ino)?;
        match kind_of(n.kind) {
            Kind::File => {}
            Kind::Dir => return Err(Error::IsDir),
            _ => return Err(Error::corrupt("read of an inode that is not a file")),
        }
        if offset >= n.size || size == 0 {
            return Ok(Data::Owned(Buf::default()));
        }
        let end = (offset + u64::from(size)).min(n.size);
        if n.flags & SPARSE != 0 {
            return self.read_sparse(&n, offset, end);
        }
        let (body, at) = self.body_at(n.data)?;
        body.read(at + offset, (end - offset) as usize, at + n.size)
    }

    fn stored_at(&self, ino: u64, offset: u64, size: u32) -> Option<(BorrowedFd<'_>, u64, u32)> {
        let (_, n) = self.node(ino).ok()?;
        if kind_of(n.kind) != Kind::File || n.flags & SPARSE != 0 || offset >= n.size {
            return None;
        }
        let len = u64::from(size).min(n.size - offset);
        match self.body_at(n.data).ok()? {
            (Body::Plain(s), at) => {
                let (fd, pos) = s.stored_at(at.checked_add(offset)?, len)?;
                Some((fd, pos, len as u32))
            }
            (Body::Decoded(_), _) => None,
        }
    }

    fn stored(&self, ino: u64) -> Option<Vec<std::ops::Range<u64>>> {
        let (_, n) = self.node(ino).ok()?;
        if kind_of(n.kind) != Kind::File || n.flags & SPARSE != 0 {
            return None;
        }
        match self.body_at(n.data).ok()? {
            (body @ Body::Plain(_), at) if std::ptr::eq(body, &self.body) => {
                Some((n.size > 0).then(|| at..at + n.size).into_iter().collect())
            }
            _ => None,
        }
    }

    fn stored_in(&self, ino: u64) -> Option<(&Source, Vec<Range<u64>>)> {
        Some((self.body.source(), self.stored(ino)?))
    }

    fn held(&self, ino: u64) -> bool {
        let source = self.body.source();
        !source.partial()
            || self
                .stored(ino)
                .is_none_or(|rs| rs.iter().all(|r| source.held(r.start, r.end - r.start)))
    }

    fn readlink(&self, ino: u64) -> Result<Vec<u8>> {
        let (_, n) = self.node(ino)?;
        if kind_of(n.kind) != Kind::Symlink {
            return Err(Error::NotSymlink);
        }
        Ok(self.index.symlink_target(&n).to_vec())
    }

    fn xattrs(&self, ino: u64) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        let (_, n) = self.node(ino)?;
        Ok(match n.xattrs {
            index::NONE => Vec::new(),
            i => self.index.xattr_set(i).cloned().unwrap_or_default(),
        })
    }

    fn stats(&self) -> Stats {
        Stats {
            // A union's members; compressed tars inside one archive are in its file.
            bytes: match self.starts.len() {
                0 => self.body.len(),
                _ => self.bodies().map(Body::len).sum(),
            },
            block_size: IO_SIZE,
            inodes: self.index.node_count() as u64,
            name_max: 255,
        }
    }

    /// Node `id` is inode `id + 1`.
    fn ino_end(&self) -> u64 {
        self.index.node_count() as u64 + 1
    }

    /// The index is in memory, so every byte of the archive is data.
    fn extents(&self) -> Vec<Extent> {
        // A union's members' files; compressed tars inside one archive are in its file.
        let files = if self.starts.is_empty() {
            1
        } else {
            self.starts.len()
        };
        self.bodies()
            .take(files)
            .map(Body::source)
            .filter(|s| s.is_local() && !s.copied())
            .map(|source| Extent {
                path: source.path().to_owned(),
                range: 0..source.len(),
                metadata: false,
            })
            .collect()
    }

    /// A file's data offset: a union's nodes are numbered directory by directory, not
    /// in archive order.
    fn place(&self, ino: u64) -> u64 {
        self.id(ino)
            .ok()
            .and_then(|id| self.index.file_offset(id))
            .unwrap_or(ino)
    }

    fn decode_ahead(&self, which: crate::archive::DecodeAhead) {
        for b in self.bodies() {
            if let Body::Decoded(d) = b {
                d.decode_ahead(which);
            }
        }
    }

    fn decoding_ahead(&self) -> bool {
        self.bodies()
            .any(|b| matches!(b, Body::Decoded(d) if d.decoding_ahead()))
    }
}

/// Whether a compressed archive decodes to a tar header (or an empty tar's zeros).
fn decodes_to_tar(source: &Arc<Source>, codec: Compression) -> bool {
    let mut raw = [0u8; 512];
    let Ok(n) = crate::compressed::first_bytes(source, codec, &mut raw) else {
        return false;
    };
    n == 512 && (header_ok(&raw) || raw.iter().all(|&b| b == 0))
}

/// Opens a tar archive (plain, or compressed as `codec` says) from its saved index
/// when that matches the archive as it is now, else scans it (with a progress bar on a
/// terminal) and saves the index for next time.
pub fn open(
    source: Arc<Source>,
    opts: BuildOptions,
    index_path: Option<&Path>,
    codec: Option<Compression>,
    how: &Decoding,
) -> Result<Arc<TarArchive>> {
    let recursive = opts.recursive;
    let (archive, unsaved) = open_unsaved(source, opts, index_path, codec, how)?;
    if let Some(path) = unsaved {
        archive.save_index(&path, recursive);
    }
    Ok(archive)
}

/// Like [`open`], but an index it had to build is not saved: where it would go comes
/// back with the archive. A union of local tars saves one merged index instead, and its
/// members' own only when they cannot be merged: 1,000 shards' index files, created
/// side by side in one directory, took ~45% of a first mount's time.
pub fn open_unsaved(
    source: Arc<Source>,
    opts: BuildOptions,
    index_path: Option<&Path>,
    codec: Option<Compression>,
    how: &Decoding,
) -> Result<(Arc<TarArchive>, Option<PathBuf>)> {
    debug_assert_eq!(ROOT_INO, 1);
    // The entry-point spacing is not part of it: an index built with another serves as
    // well (delete it to rebuild with a new --entry-spacing).
    let id = persist::Identity::of(&source, opts.recursive);
    let path = index_path
        .map(Path::to_owned)
        .unwrap_or_else(|| persist::default_path(source.path(), source.is_local()));
    let archive_len = source.len();
    let load = || {
        persist::load(&path, &id, &source, |extra| {
            let (points, nested) = persist::Under::decode(extra, codec, archive_len)?;
            let lens = std::iter::once(points.as_ref().map_or(archive_len, Points::len))
                .chain(nested.iter().map(|n| n.points.len()))
                .collect();
            Some(((points, nested), lens))
        })
    };
    let mut saved = load();
    if saved.is_err() && index_path.is_none() && persist::fetch_sidecar(&source, &path) {
        saved = load();
    }
    match saved {
        Ok((index, (points, nested))) => {
            tracing::info!("using the saved index {}", path.display());
            say_left_out(Some(source.path()), &index.skipped);
            let body = match (codec, points) {
                (Some(codec), Some(points)) => Body::Decoded(Box::new(Decoded::new(
                    source,
                    codec,
                    points,
                    &how.stream_cache,
                    how.stage_dir.as_deref(),
                )?)),
                _ => Body::Plain(source),
            };
            return Ok((
                Arc::new(TarArchive::from_index(body, nested, how, index)?),
                None,
            ));
        }
        Err(persist::Rejected::Missing) => {}
        Err(why) => say_rejected(&why, &path),
    }
    let archive = index_archive(source, opts, codec, how)?;
    // The memory the build freed is given back once all archives are open (open_many).
    Ok((Arc::new(archive), Some(path)))
}

/// Says why the saved index at `path` is rebuilt: a line each for the first few (after
/// an upgrade, each of 10,000 shards would say so), the others with `--debug`.
fn say_rejected(why: &persist::Rejected, path: &Path) {
    static SAID: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let said = SAID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let what = if *why == persist::Rejected::Stale {
        "out of date"
    } else {
        "damaged"
    };
    match said {
        0..3 => tracing::warn!(
            "the saved index {} is {what}; rebuilding it",
            path.display()
        ),
        3 => tracing::warn!(
            "more saved indexes are out of date or damaged; rebuilding them (each is \
             named with --debug)"
        ),
        _ => tracing::debug!(
            "the saved index {} is {what}; rebuilding it",
            path.display()
        ),
    }
}

/// Indexes the archive (compressed as `codec` says), with a progress bar on a terminal
/// when it takes over a second.
fn index_archive(
    source: Arc<Source>,
    opts: BuildOptions,
    codec: Option<Compression>,
    how: &Decoding,
) -> Result<TarArchive> {
    let started = Instant::now();
    let label = format!("indexing {}", source.path().display());
    let archive_len = source.len();
    let mut bar: Option<indicatif::ProgressBar> = None;
    let mut progress = |pos: u64| {
        if bar.is_none() && started.elapsed() > Duration::from_secs(1) {
            let b = crate::progress::bar(label.clone(), archive_len);
            bar = Some(b);
        }
        if let Some(b) = &bar {
            b.set_position(pos);
        }
    };
    // The scan reads (nearly) every block: an archive in object storage is copied to the
    // node first, so that its bytes are fetched once, not by the scan and the copy.
    source.will_scan();
    let archive = match codec {
        None => TarArchive::build(source, opts, how, &mut progress)?,
        Some(c) => {
            // Only here, before a scan: an archive with a saved index was a tar when it
            // was indexed, and decoding the start of each of 1,000 shards cost a remount
            // a third of its time.
            if !decodes_to_tar(&source, c) {
                return Err(Error::NotArchive(format!(
                    "{} is {}-compressed but holds no tar archive (or is damaged at its \
                     start); archfs mounts compressed tar archives and SquashFS images",
                    source.path().display(),
                    c.name()
                )));
            }
            TarArchive::build_compressed(source, opts, c, how, &mut progress)?
        }
    };
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    tracing::info!(
        "indexed {} entries in {:.2} s",
        archive.index.dirent_count(),
        started.elapsed().as_secs_f64()
    );
    Ok(archive)
}

impl TarArchive {
    /// Saves this archive's index at `path` for the next mount; says so if it cannot.
    pub fn save_index(&self, path: &Path, recursive: bool) {
        let source = self.body.source();
        let saved = match persist::Identity::of(source, recursive).read(source) {
            Ok(id) => persist::save(path, &self.index, &id, &persist::Under::encode(self))
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if let Err(e) = saved {
            tracing::warn!("cannot save the index to {}: {e}", path.display());
        }
    }
}
