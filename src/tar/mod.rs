//! Tar archives (v7, ustar, GNU, PAX) served in place: an index of the headers, and
//! reads at the members' offsets through the shared block cache.

mod column;
mod header;
pub mod index;
pub mod persist;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use index::{kind_of, Index, Node, SPARSE};

use crate::archive::{Archive, Attr, Buf, Data, DirEntry, Extent, Kind, Source, Stats, ROOT_INO};
use crate::compressed::{Codec, Decoded, Scan};
use crate::error::{Error, Result};

pub use index::BuildOptions;

/// Whether `raw` is a non-empty header with a valid checksum.
pub fn header_ok(raw: &[u8; 512]) -> bool {
    let h = header::Header::new(raw);
    !h.is_zero() && h.checksum_ok()
}

/// What `st_blksize` and `statfs` report: stdio and Python size their buffers by it.
const IO_SIZE: u32 = 128 << 10;

/// Members of a plain tar are read straight from the archive file with `pread`, into the
/// reading thread's buffer. The kernel's page cache of the archive is the only cache: a
/// chunk cache of our own (until this was measured) read a whole 128 KiB chunk into a new
/// buffer for each small read that missed, held 520 MiB in a 10,000-file epoch, and cost
/// ~30% more server CPU (docs/BENCHMARKS.md). A compressed tar is read through its
/// decoded view, which caches what it decodes.
pub struct TarArchive {
    body: Body,
    index: Index,
}

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
            Body::Plain(s) => Ok(Data::Owned(s.read_buf(pos, len)?)),
            Body::Decoded(d) => d.read(pos, len, member_end),
        }
    }

    fn read_into(&self, pos: u64, out: &mut [u8], member_end: u64) -> Result<()> {
        match self {
            Body::Plain(s) => s.read_exact_at(pos, out),
            Body::Decoded(d) => {
                out.copy_from_slice(&d.read(pos, out.len(), member_end)?);
                Ok(())
            }
        }
    }
}

/// How a compressed archive is opened.
#[derive(Clone, Debug)]
pub struct Compressed {
    pub codec: Codec,
    /// Decoded bytes between entry points.
    pub spacing: u64,
    /// The decoded-block cache.
    pub cache_bytes: u64,
    /// Where a decoded copy goes when one is needed and memory is short.
    pub stage_dir: Option<std::path::PathBuf>,
    /// Decoded bytes beyond which the archive is refused (the fuzz target's bound on a
    /// decompression bomb; `u64::MAX` for users, whose disk is the bound).
    pub limit: u64,
}

impl TarArchive {
    /// Indexes the archive in one pass over its headers.
    pub fn build(
        source: Arc<Source>,
        opts: BuildOptions,
        progress: &mut dyn FnMut(u64),
    ) -> Result<TarArchive> {
        let len = source.len();
        let mut b = index::Builder::new(source.as_ref(), opts, progress);
        b.scan(0, len, &[], 0)?;
        let index = b.finish();
        for s in &index.skipped {
            tracing::warn!("{}: skipped {s}", source.path().display());
        }
        Ok(TarArchive::from_index(Body::Plain(source), index))
    }

    /// Indexes a compressed archive in one pass that decodes it, recording entry points
    /// on the way.
    pub fn build_compressed(
        source: Arc<Source>,
        opts: BuildOptions,
        how: &Compressed,
        progress: &mut (dyn FnMut(u64) + Send),
    ) -> Result<TarArchive> {
        let (index, points) = {
            let scan = Scan::new(&source, how.codec, how.spacing, how.limit, progress)?;
            let mut quiet = |_| {};
            let mut b = index::Builder::new(&scan, opts, &mut quiet);
            b.scan(0, u64::MAX >> 1, &[], 0)?;
            let points = scan.finish()?;
            b.check_within(points.len())?;
            (b.finish(), points)
        };
        for s in &index.skipped {
            tracing::warn!("{}: skipped {s}", source.path().display());
        }
        let decoded = Decoded::new(
            source,
            how.codec,
            points,
            how.cache_bytes,
            how.stage_dir.as_deref(),
        )?;
        Ok(TarArchive::from_index(
            Body::Decoded(Box::new(decoded)),
            index,
        ))
    }

    pub fn from_index(body: Body, index: Index) -> TarArchive {
        TarArchive { body, index }
    }

    pub fn body(&self) -> &Body {
        &self.body
    }

    pub fn index(&self) -> &Index {
        &self.index
    }

    fn node(&self, ino: u64) -> Result<(u32, Node)> {
        let id = ino
            .checked_sub(1)
            .filter(|&i| i < self.index.node_count() as u64)
            .ok_or(Error::NotFound)? as u32;
        Ok((id, self.index.node(id)))
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

    fn read_sparse(&self, n: &Node, offset: u64, end: u64) -> Result<Data> {
        let map_end = self
            .index
            .sparse_map(n)
            .last()
            .map_or(0, |s| s.archive_off + s.len);
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
            self.body.read_into(
                s.archive_off + (lo - s.offset),
                &mut out[(lo - offset) as usize..(hi - offset) as usize],
                map_end,
            )?;
        }
        Ok(Data::Owned(out))
    }
}

impl Archive for TarArchive {
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
        format!(
            "tar{codec}, {} inodes, {} entries, index {} MiB",
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
        let child = self.index.find(id, name).ok_or(Error::NotFound)?;
        Ok(self.make_attr(child, &self.index.node(child)))
    }

    fn read_dir(&self, dir: u64) -> Result<Vec<DirEntry>> {
        let (id, n) = self.node(dir)?;
        if kind_of(n.kind) != Kind::Dir {
            return Err(Error::NotDir);
        }
        Ok(self
            .index
            .children(id)
            .map(|i| {
                let child = self.index.child(i);
                DirEntry {
                    ino: u64::from(child) + 1,
                    kind: kind_of(self.index.node(child).kind),
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
        self.body
            .read(n.data + offset, (end - offset) as usize, n.data + n.size)
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
            bytes: self.body.len(),
            block_size: IO_SIZE,
            inodes: self.index.node_count() as u64,
            name_max: 255,
        }
    }

    /// The index is in memory, so every byte of the archive is data.
    fn extents(&self) -> Vec<Extent> {
        let source = self.body.source();
        vec![Extent {
            path: source.path().to_owned(),
            range: 0..source.len(),
            metadata: false,
        }]
    }

    fn decode_ahead(&self, memory_only: bool) {
        if let Body::Decoded(d) = &self.body {
            d.decode_ahead(memory_only);
        }
    }
}

/// Opens a tar archive (plain, or compressed as `compressed` says) from its saved index
/// when that matches the archive as it is now, else scans it (with a progress bar on a
/// terminal) and saves the index for next time.
pub fn open(
    source: Arc<Source>,
    opts: BuildOptions,
    index_path: Option<&Path>,
    compressed: Option<&Compressed>,
) -> Result<Arc<TarArchive>> {
    debug_assert_eq!(ROOT_INO, 1);
    // The entry-point spacing is not part of it: an index built with another serves as
    // well (delete it to rebuild with a new --entry-spacing).
    let id = persist::Identity::of(&source, opts.recursive)?;
    let path = index_path
        .map(Path::to_owned)
        .unwrap_or_else(|| persist::default_path(source.path()));
    let archive_len = source.len();
    let saved = persist::load(&path, &id, |extra| match compressed {
        None => extra.is_empty().then_some((None, archive_len)),
        Some(c) => {
            let points = crate::compressed::Points::decode(extra, c.codec, archive_len)?;
            let len = points.len();
            Some((Some(points), len))
        }
    });
    match saved {
        Ok((index, points)) => {
            tracing::info!("using the saved index {}", path.display());
            let body = match (compressed, points) {
                (Some(c), Some(points)) => Body::Decoded(Box::new(Decoded::new(
                    source,
                    c.codec,
                    points,
                    c.cache_bytes,
                    c.stage_dir.as_deref(),
                )?)),
                _ => Body::Plain(source),
            };
            return Ok(Arc::new(TarArchive::from_index(body, index)));
        }
        Err(persist::Rejected::Missing) => {}
        Err(why) => tracing::warn!(
            "the saved index {} is {}; rebuilding it",
            path.display(),
            if why == persist::Rejected::Stale {
                "out of date"
            } else {
                "damaged"
            }
        ),
    }
    let started = Instant::now();
    let mut bar: Option<indicatif::ProgressBar> = None;
    let mut progress = |pos: u64| {
        if bar.is_none() && started.elapsed() > Duration::from_secs(1) {
            let b = indicatif::ProgressBar::with_draw_target(
                Some(archive_len),
                indicatif::ProgressDrawTarget::stderr(),
            );
            b.set_style(
                indicatif::ProgressStyle::with_template(
                    "indexing {prefix} {wide_bar} {bytes}/{total_bytes} {bytes_per_sec} {eta}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            bar = Some(b);
        }
        if let Some(b) = &bar {
            b.set_position(pos);
        }
    };
    let archive = match compressed {
        None => TarArchive::build(source, opts, &mut progress)?,
        Some(c) => TarArchive::build_compressed(source, opts, c, &mut progress)?,
    };
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    let extra = match &archive.body {
        Body::Plain(_) => Vec::new(),
        Body::Decoded(d) => d.points().encode(d.codec()),
    };
    tracing::info!(
        "indexed {} entries in {:.2} s",
        archive.index.dirent_count(),
        started.elapsed().as_secs_f64()
    );
    if let Err(e) = persist::save(&path, &archive.index, &id, &extra) {
        tracing::warn!("cannot save the index to {}: {e}", path.display());
    }
    // The build freed millions of small allocations (a name each) that glibc keeps for
    // reuse; the server would carry them for the whole job (95 against 56 MB resident at
    // 1.28 M entries).
    // SAFETY: malloc_trim has no preconditions.
    unsafe { libc::malloc_trim(0) };
    Ok(Arc::new(archive))
}
