//! The saved index: its file format, where it lives, and what ties it to an archive.
//! Everything that reads or writes its bytes is in this file.
//!
//! It is saved next to the archive (or in the user's cache directory), so a remount of a
//! large archive skips the scan. It is tied to the archive's size and mtime, and to its
//! place on this machine (device, inode, change time) or else, for an archive copied
//! with its index, a checksum of its first and last 64 KiB (an object's ETag instead);
//! protected by a CRC, and validated field by field on load: a stale, corrupt or foreign
//! file is rebuilt, never trusted. A remount of 10,000 small shards read them whole for
//! that checksum (the disk's readahead): 3.4 GB, now 270 MB (their first bytes, for the
//! format, and the indexes).
//!
//! # Layout
//!
//! Integers are little-endian, of the width given (`u8` to `u64`; an `i64` as its two's
//! complement `u64`). `bytes` is a `u64` length and that many bytes. The fields follow
//! one another in this order, with no padding:
//!
//! ```text
//! field       width                 what it is
//! magic       8                     "ARCHFSIX"
//! version     u32                   VERSION below
//! size        u64                   the archive's length in bytes
//! mtime_ns    i64                   its modification time (an object's: from its ETag)
//! place       u64                   its device, inode and change time, 0 if unknown
//! content     u32                   CRC-32 of its first and last 64 KiB (0 for an
//!                                   object, whose ETag names its bytes)
//! options     u32                   bit 0: --recursive
//! under       bytes                 what lies under the tar stream (below)
//! nodes       u64                   node count; node i is inode i + 1
//! mtime_base  i64                   the least mtime; the mtime column adds to it
//! file_shift  u32                   9 or 0: how far a file's data offset is shifted
//! size        column, nodes rows    file: its length; directory: its entry count;
//!                                   symlink: its target's length
//! data        column, nodes rows    file: its data offset >> file_shift; sparse file:
//!                                   its row of sparse; directory: its first entry;
//!                                   symlink: its target's offset in links
//! mtime       column, nodes rows    seconds after mtime_base
//! nsec        column, nodes rows    nanoseconds of the mtime
//! meta        column, nodes rows    the node's row of metas
//! metas       u64 count, 22 each    kind u8 (0 file, 1 directory, 2 symlink, 3 block
//!                                   device, 4 character device, 5 FIFO, 6 socket),
//!                                   flags u8 (1: sparse), mode u16, uid u32, gid u32,
//!                                   nlink u32, rdev u32, xattr set u32 (u32::MAX: none)
//! dirents     u64                   directory entry count
//! name_end    column, dirents rows  where each entry's name ends in names
//! child       column, dirents rows  the node each entry names
//! names       bytes                 entry names end to end; each directory's entries
//!                                   are a run of rows, sorted by name bytes
//! links       bytes                 symlink targets end to end
//! sparse      u64 count, 12 each    first segment u64, segment count u32
//! segments    u64 count, 24 each    offset in the file u64, length u64, data offset u64
//! xattrs      u64 count of sets     each a u64 count of pairs, each pair a name and a
//!                                   value as bytes
//! left out    u64 count (<= 1000)   each a UTF-8 line as bytes
//! crc         u32                   CRC-32 of every byte before it
//! ```
//!
//! The five fields after the version are the archive's [`Identity`]: a saved index is
//! used only if size, mtime and options match, and place or else content does.
//!
//! A column ([`Column`]) is a width `u8` (0, 1, 2, 4 or 8), then for width 0 one `u64`
//! that every row holds, else its rows at that width. The top 16 bits of a data offset
//! ([`BODY_SHIFT`](super::nested::BODY_SHIFT)) name the stream it is in: 0 the archive's
//! tar stream, `k` the `k`-th compressed tar inside it. In a union's index, offsets run
//! through the members one after another, each from a 512-byte boundary.
//!
//! `under` for one archive: a `u32` count of the compressed tars inside it
//! (`--recursive`), each as its offset `u64`, length `u64`, and its entry points as a
//! `u64` length and the points; then, for a compressed archive, its own entry points to
//! the end of the section. Entry points are written and checked by
//! [`Points::encode`]/[`Points::decode`]: the codec's id u8, decoded length u64, spacing
//! u64, a `u64` count of CRC-32s of the decoded blocks (u32 each), a `u64` count of
//! points, each its decoded offset u64, compressed offset u64, bit offset u8 and its
//! window as a `u32` length and bytes.
//!
//! `under` for a union ([`save_union`]): a `u64` member count, then for each member its
//! identity (size, mtime_ns, place, content and options as above: 32 bytes), and its
//! own `under` as `bytes`; the identity at the top of the file is the first member's.
//!
//! # Versions
//!
//! [`VERSION`] changes whenever the layout or the meaning of a field does; a file of
//! another version is rebuilt ([`Rejected::Stale`]), never read or converted.

use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use super::column::Column;
use super::index::{kind_of, Index, Meta, Segment, XattrSet, NONE, ROOT, SPARSE};
use super::nested::{body_of, Nested};
use super::{Body, TarArchive};
use crate::archive::Kind;
use crate::compressed::{Compression, Points};
use crate::error::{Error, Result};
use crate::source::Source;

const MAGIC: &[u8; 8] = b"ARCHFSIX";
/// 6: hard links resolved in archive order, old-style directories, symlinks 0777, sparse
/// sizes where the map ends (indexes of 5 showed those members as tar -x does not), and
/// what was left out, at the end; 5: the archive's place on this machine
/// ([`Storage::place_id`]); 4: compressed tars inside the archive in that section; 3: a
/// section for the decoder's entry points; 2: packed columns (1 had fixed 56-byte nodes
/// and 16-byte entries).
///
/// [`Storage::place_id`]: crate::source::Storage::place_id
const VERSION: u32 = 6;

/// Lines of what the index left out that are saved with it: a hostile archive may have
/// a million members with `..` in their names.
const MAX_LEFT_OUT: usize = 1000;

/// What ties an index to one version of one archive built with one set of options.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Identity {
    size: u64,
    mtime_ns: i64,
    /// Where the archive is (a local file's device, inode and change time), 0 if unknown:
    /// when it matches, the archive is the one indexed and `content` need not be read.
    place: u64,
    /// A checksum of the first and last 64 KiB; `None` until read.
    content: Option<u32>,
    options: u32,
}

impl Identity {
    /// The identity of `source` as far as it is known without reading it.
    pub fn of(source: &Source, recursive: bool) -> Identity {
        Identity {
            size: source.len(),
            mtime_ns: source.version(),
            place: source.place_id(),
            content: None,
            options: u32::from(recursive),
        }
    }

    /// With the checksum of the first and last 64 KiB read. An object's ETag already
    /// names its bytes; reading its tail would cost a round trip, on a link the copy to
    /// the node is filling, before the mount is live.
    pub fn read(mut self, source: &Source) -> Result<Identity> {
        if self.content.is_none() {
            let size = source.len();
            let edge = 64 << 10;
            let mut crc = crc32fast::Hasher::new();
            if !source.tagged() {
                crc.update(&source.read_vec(0, edge.min(size) as usize)?);
                let tail = size.saturating_sub(edge);
                crc.update(&source.read_vec(tail, (size - tail) as usize)?);
            }
            self.content = Some(crc.finalize());
        }
        Ok(self)
    }

    /// As a union's saved index keeps it for each member.
    fn to_bytes(self) -> [u8; 32] {
        let mut b = [0u8; 32];
        b[0..8].copy_from_slice(&self.size.to_le_bytes());
        b[8..16].copy_from_slice(&self.mtime_ns.to_le_bytes());
        b[16..24].copy_from_slice(&self.place.to_le_bytes());
        b[24..28].copy_from_slice(&self.content.unwrap_or(0).to_le_bytes());
        b[28..32].copy_from_slice(&self.options.to_le_bytes());
        b
    }

    /// What [`to_bytes`](Self::to_bytes) wrote.
    fn from_bytes(b: &[u8; 32]) -> Identity {
        let u64_ = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let u32_ = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        Identity {
            size: u64_(0),
            mtime_ns: u64_(8) as i64,
            place: u64_(16),
            content: Some(u32_(24)),
            options: u32_(28),
        }
    }

    /// Whether `saved` names the same archive: same size, modification time and options,
    /// and the same place on this machine, else (an archive copied with its index) the
    /// same first and last 64 KiB.
    pub fn matches(&self, saved: &Identity, source: &Source) -> bool {
        let same = self.size == saved.size
            && self.mtime_ns == saved.mtime_ns
            && self.options == saved.options;
        if !same {
            return false;
        }
        if self.place != 0 && self.place == saved.place {
            return true;
        }
        (*self)
            .read(source)
            .is_ok_and(|id| id.content == saved.content)
    }
}

/// Where the index of `archive` lives: beside it when that directory is writable,
/// else (and for an object, named by its URL) under `$XDG_CACHE_HOME/archfs` (or
/// `~/.cache/archfs`).
pub fn default_path(archive: &Path, local: bool) -> PathBuf {
    let canon = std::fs::canonicalize(archive).unwrap_or_else(|_| archive.to_owned());
    let name = canon
        .file_name()
        .map(|n| n.to_os_string())
        .unwrap_or_default();
    let beside = canon.with_file_name(format!("{}.archfs-index", name.to_string_lossy()));
    let dir = canon.parent().unwrap_or(Path::new("/"));
    if local && (beside.exists() || writable(dir)) {
        return beside;
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir)
        .join("archfs");
    let tag = crc32fast::hash(canon.as_os_str().as_bytes());
    cache.join(format!("{}-{tag:08x}.archfs-index", name.to_string_lossy()))
}

/// Fetches the index kept beside an archive in object storage into `path` (the local
/// index cache), for [`load`] to check like any saved index; `false` when there is none.
pub fn fetch_sidecar(source: &Source, path: &Path) -> bool {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let fetched = (|| {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let mut f = std::fs::File::create(&tmp)?;
        if !source.fetch_sidecar(&mut f)? {
            return Ok(false);
        }
        std::fs::rename(&tmp, path)?;
        Ok::<_, std::io::Error>(true)
    })();
    let _ = std::fs::remove_file(&tmp);
    match fetched {
        Ok(true) => {
            tracing::info!("fetched the index {}.archfs-index", source.path().display());
            true
        }
        Ok(false) => false,
        Err(e) => {
            tracing::warn!(
                "cannot fetch the index {}.archfs-index ({e}); scanning the archive",
                source.path().display()
            );
            false
        }
    }
}

fn writable(dir: &Path) -> bool {
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: c is a valid NUL-terminated path.
    unsafe { libc::access(c.as_ptr(), libc::W_OK) == 0 }
}

struct Out(Vec<u8>);

impl Out {
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn bytes(&mut self, b: &[u8]) {
        self.u64(b.len() as u64);
        self.0.extend_from_slice(b);
    }
}

/// The packed columns as they are in memory, so a remount reads the file in one go and
/// copies it into place with no per-entry work.
fn encode(ix: &Index, id: &Identity, extra: &[u8]) -> Vec<u8> {
    let mut o = Out(Vec::with_capacity(64 + ix.heap_bytes() + extra.len()));
    o.0.extend_from_slice(MAGIC);
    o.u32(VERSION);
    o.u64(id.size);
    o.u64(id.mtime_ns as u64);
    o.u64(id.place);
    o.u32(id.content.unwrap_or(0));
    o.u32(id.options);
    o.bytes(extra);
    encode_nodes(ix, &mut o);
    encode_dirents(ix, &mut o);
    encode_extras(ix, &mut o);
    let crc = crc32fast::hash(&o.0);
    o.u32(crc);
    o.0
}

/// From `nodes` to `metas`.
fn encode_nodes(ix: &Index, o: &mut Out) {
    o.u64(ix.nodes as u64);
    o.u64(ix.mtime_base as u64);
    o.u32(ix.file_shift);
    for c in [&ix.size, &ix.data, &ix.mtime, &ix.nsec, &ix.meta] {
        write_column(c, &mut o.0);
    }
    o.u64(ix.metas.len() as u64);
    for m in &ix.metas {
        o.0.extend_from_slice(&[m.kind, m.flags]);
        o.0.extend_from_slice(&m.mode.to_le_bytes());
        for v in [m.uid, m.gid, m.nlink, m.rdev, m.xattrs] {
            o.u32(v);
        }
    }
}

/// From `dirents` to `names`.
fn encode_dirents(ix: &Index, o: &mut Out) {
    o.u64(ix.dirents as u64);
    write_column(&ix.name_end, &mut o.0);
    write_column(&ix.child, &mut o.0);
    o.bytes(&ix.names);
}

/// From `links` to `left out`.
fn encode_extras(ix: &Index, o: &mut Out) {
    o.bytes(&ix.links);
    o.u64(ix.sparse.len() as u64);
    for &(first, count) in &ix.sparse {
        o.u64(first);
        o.u32(count);
    }
    o.u64(ix.segments.len() as u64);
    for s in &ix.segments {
        o.u64(s.offset);
        o.u64(s.len);
        o.u64(s.archive_off);
    }
    o.u64(ix.xattrs.len() as u64);
    for set in &ix.xattrs {
        o.u64(set.len() as u64);
        for (k, v) in set {
            o.bytes(k);
            o.bytes(v);
        }
    }
    // What was left out, so a remount says it again and `archfs check` finds it.
    let left_out = &ix.skipped[..ix.skipped.len().min(MAX_LEFT_OUT)];
    o.u64(left_out.len() as u64);
    for line in left_out {
        o.bytes(line.as_bytes());
    }
}

/// Writes the index atomically (temporary file, then rename), with `extra`: what the
/// layer under the tar stream keeps (a compressed archive's entry points).
pub fn save(path: &Path, index: &Index, id: &Identity, extra: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(&encode(index, id, extra))?;
    f.sync_all()?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// The saved file read front to back into the columns, with its CRC computed on the way,
/// so a remount holds no second copy of the index (reading the file whole first made a
/// remount peak at twice its resident size: 102 against 54 MiB at 1.28 M entries).
struct In<R> {
    r: R,
    /// Bytes left before the trailing CRC: no count may promise more than this.
    left: u64,
    crc: crc32fast::Hasher,
}

impl<R: Read> In<R> {
    fn fill(&mut self, buf: &mut [u8]) -> Option<()> {
        self.left = self.left.checked_sub(buf.len() as u64)?;
        self.r.read_exact(buf).ok()?;
        self.crc.update(buf);
        Some(())
    }
    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        let mut a = [0u8; N];
        self.fill(&mut a)?;
        Some(a)
    }
    fn u8(&mut self) -> Option<u8> {
        Some(self.array::<1>()?[0])
    }
    fn u16(&mut self) -> Option<u16> {
        Some(u16::from_le_bytes(self.array()?))
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.array()?))
    }
    /// A count of records of `size` bytes that must fit in what is left.
    fn count(&mut self, size: usize) -> Option<usize> {
        let n = usize::try_from(self.u64()?).ok()?;
        (n.checked_mul(size)? as u64 <= self.left).then_some(n)
    }
    fn bytes(&mut self) -> Option<Vec<u8>> {
        let mut v = vec![0; self.count(1)?];
        self.fill(&mut v)?;
        Some(v)
    }
    fn column(&mut self, len: usize) -> Option<Column> {
        let available = self.left;
        read_column(&mut |buf: &mut [u8]| self.fill(buf), len, available)
    }
}

/// Why a saved index was not used.
#[derive(Debug, PartialEq, Eq)]
pub enum Rejected {
    Missing,
    Stale,
    Corrupt,
}

/// Loads the index at `path` if it belongs to the archive as it is now. `extra` reads
/// the section [`save`] was given and says how long the tar stream is (the archive's
/// length, or its decoded length), or refuses it.
pub fn load<T>(
    path: &Path,
    id: &Identity,
    source: &Source,
    extra: impl FnOnce(&[u8]) -> Option<(T, Vec<u64>)>,
) -> std::result::Result<(Index, T), Rejected> {
    let file = std::fs::File::open(path).map_err(|_| Rejected::Missing)?;
    let len = file.metadata().map_err(|_| Rejected::Missing)?.len();
    if len < 48 {
        return Err(Rejected::Corrupt);
    }
    let mut r = In {
        // No larger than the file: a union opens a thousand shards' indexes of a few KiB.
        r: std::io::BufReader::with_capacity(len.min(1 << 20) as usize, file),
        left: len - 4,
        crc: crc32fast::Hasher::new(),
    };
    let header = (|| {
        let magic: [u8; 8] = r.array()?;
        let version = r.u32()?;
        if &magic != MAGIC {
            return Some(Err(Rejected::Corrupt));
        }
        // An index of another version of archfs: built again, like a stale one.
        if version != VERSION {
            return Some(Err(Rejected::Stale));
        }
        Some(Ok(Identity {
            size: r.u64()?,
            mtime_ns: r.u64()? as i64,
            place: r.u64()?,
            content: Some(r.u32()?),
            options: r.u32()?,
        }))
    })();
    match header {
        Some(Ok(saved)) if id.matches(&saved, source) => {}
        Some(Ok(_)) => return Err(Rejected::Stale),
        Some(Err(why)) => return Err(why),
        None => return Err(Rejected::Corrupt),
    }
    let under = r.bytes().ok_or(Rejected::Corrupt)?;
    let index = decode(&mut r).ok_or(Rejected::Corrupt)?;
    let mut crc = [0u8; 4];
    if r.left != 0 || r.r.read_exact(&mut crc).is_err() {
        return Err(Rejected::Corrupt);
    }
    if r.crc.finalize() != u32::from_le_bytes(crc) {
        return Err(Rejected::Corrupt);
    }
    let (under, lens) = extra(&under).ok_or(Rejected::Corrupt)?;
    if !valid(&index, &lens) {
        return Err(Rejected::Corrupt);
    }
    Ok((index, under))
}

/// The index [`encode`] wrote after `under`, up to the CRC.
fn decode(r: &mut In<impl Read>) -> Option<Index> {
    // Rows take at least a byte each in some column (offsets differ, names are not
    // empty): a count larger than the file is a lie, not a reason to loop or allocate.
    let nodes = r.count(1)?;
    let mtime_base = r.u64()? as i64;
    let file_shift = r.u32()?;
    let size = r.column(nodes)?;
    let data = r.column(nodes)?;
    let mtime = r.column(nodes)?;
    let nsec = r.column(nodes)?;
    let meta = r.column(nodes)?;
    let metas = decode_metas(r)?;
    let dirents = r.count(1)?;
    let name_end = r.column(dirents)?;
    let child = r.column(dirents)?;
    let names = r.bytes()?;
    let links = r.bytes()?;
    let n = r.count(12)?;
    let mut sparse = Vec::with_capacity(n);
    for _ in 0..n {
        sparse.push((r.u64()?, r.u32()?));
    }
    let n = r.count(24)?;
    let mut segments = Vec::with_capacity(n);
    for _ in 0..n {
        segments.push(Segment {
            offset: r.u64()?,
            len: r.u64()?,
            archive_off: r.u64()?,
        });
    }
    let xattrs = decode_xattrs(r)?;
    let n = r.count(8)?;
    let mut skipped = Vec::with_capacity(n);
    for _ in 0..n {
        skipped.push(String::from_utf8(r.bytes()?).ok()?);
    }
    Some(Index {
        nodes,
        size,
        data,
        mtime,
        mtime_base,
        nsec,
        meta,
        metas,
        file_shift,
        dirents,
        name_end,
        child,
        names,
        links,
        sparse,
        segments,
        xattrs,
        skipped,
    })
}

fn decode_metas(r: &mut In<impl Read>) -> Option<Vec<Meta>> {
    let n = r.count(22)?;
    let mut metas = Vec::with_capacity(n);
    for _ in 0..n {
        metas.push(Meta {
            kind: r.u8()?,
            flags: r.u8()?,
            mode: r.u16()?,
            uid: r.u32()?,
            gid: r.u32()?,
            nlink: r.u32()?,
            rdev: r.u32()?,
            xattrs: r.u32()?,
        });
    }
    Some(metas)
}

fn decode_xattrs(r: &mut In<impl Read>) -> Option<Vec<XattrSet>> {
    let n = r.count(8)?;
    let mut xattrs = Vec::with_capacity(n);
    for _ in 0..n {
        let m = r.count(16)?;
        let mut set = Vec::with_capacity(m);
        for _ in 0..m {
            set.push((r.bytes()?, r.bytes()?));
        }
        xattrs.push(set);
    }
    Some(xattrs)
}

/// Whether every member's data in `ix` lies below `end` (a union's merged offsets), and
/// the rest of it is sound.
pub fn offsets_within(ix: &Index, end: u64) -> bool {
    valid(ix, &[end])
}

/// Every offset and range in the index points inside the index or the archive, so a
/// CRC-valid file from somewhere else still cannot make a lookup index out of bounds.
fn valid(ix: &Index, lens: &[u64]) -> bool {
    // Data offsets name their body in their top bits: a range must lie within it.
    let in_body = |at: u64, len: u64| {
        let (body, at) = body_of(at);
        lens.get(body)
            .is_some_and(|&l| at.checked_add(len).is_some_and(|e| e <= l))
    };
    let in_range =
        |off: u64, len: u64, total: usize| off.checked_add(len).is_some_and(|e| e <= total as u64);
    let columns_fit = [&ix.size, &ix.data, &ix.mtime, &ix.nsec, &ix.meta]
        .iter()
        .all(|c| c.fits(ix.nodes))
        && ix.name_end.fits(ix.dirents)
        && ix.child.fits(ix.dirents);
    let metas_ok = ix
        .metas
        .iter()
        .all(|m| m.kind <= 6 && (m.xattrs == NONE || (m.xattrs as usize) < ix.xattrs.len()));
    if !columns_fit || !metas_ok || ix.nodes == 0 || ix.file_shift > 9 {
        return false;
    }
    let meta_ok = (0..ix.nodes).all(|i| (ix.meta.get(i) as usize) < ix.metas.len());
    if !meta_ok || kind_of(ix.node(ROOT).kind) != Kind::Dir {
        return false;
    }
    let sparse_ok = ix
        .sparse
        .iter()
        .all(|&(first, count)| in_range(first, u64::from(count), ix.segments.len()));
    let nodes_ok = (0..ix.nodes).all(|i| {
        let m = ix.metas[ix.meta.get(i) as usize];
        let (size, data) = (ix.size.get(i), ix.data.get(i));
        match kind_of(m.kind) {
            Kind::Dir => in_range(data, size, ix.dirents),
            Kind::Symlink => size <= u64::from(u32::MAX) && in_range(data, size, ix.links.len()),
            Kind::File if m.flags & SPARSE != 0 => (data as usize) < ix.sparse.len(),
            Kind::File => data
                .checked_mul(1 << ix.file_shift)
                .is_some_and(|d| in_body(d, size)),
            _ => true,
        }
    });
    let mut last = 0;
    let names_ok = (0..ix.dirents).all(|i| {
        let end = ix.name_end.get(i);
        let ok = end >= last && end <= ix.names.len() as u64;
        last = end;
        ok && (ix.child.get(i) as usize) < ix.nodes
    });
    sparse_ok
        && nodes_ok
        && names_ok
        && ix
            .segments
            .iter()
            .all(|s| in_body(s.archive_off, s.len) && s.offset.checked_add(s.len).is_some())
}

/// A column as the file keeps it: the width, then the value (constant) or the rows.
fn write_column(c: &Column, out: &mut Vec<u8>) {
    out.push(c.width() as u8);
    match c {
        Column::Const(v) => out.extend_from_slice(&v.to_le_bytes()),
        Column::U8(c) => out.extend_from_slice(c),
        Column::U16(c) => c
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        Column::U32(c) => c
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        Column::U64(c) => c
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
    }
}

/// Reads a column of `len` rows written by [`write_column`], taking its bytes from
/// `fill` through a small buffer straight into the typed rows (a whole-column
/// temporary left the allocator holding the holes: 8 MiB more resident at 1.28 M
/// entries). `None` if the rows would take more than `available` bytes, the input
/// runs out, or the width is not one [`write_column`] writes.
fn read_column(
    fill: &mut impl FnMut(&mut [u8]) -> Option<()>,
    len: usize,
    available: u64,
) -> Option<Column> {
    fn rows<T, const N: usize>(
        fill: &mut impl FnMut(&mut [u8]) -> Option<()>,
        len: usize,
        available: u64,
        from: fn([u8; N]) -> T,
    ) -> Option<Vec<T>> {
        if len.checked_mul(N)? as u64 > available {
            return None;
        }
        let mut out = Vec::with_capacity(len);
        let mut buf = [0u8; 8192];
        while out.len() < len {
            let n = (buf.len() / N).min(len - out.len()) * N;
            fill(&mut buf[..n])?;
            out.extend(
                buf[..n]
                    .chunks_exact(N)
                    .map(|c| from(c.try_into().unwrap())),
            );
        }
        Some(out)
    }
    let mut width = [0u8; 1];
    fill(&mut width)?;
    Some(match width[0] {
        0 => {
            let mut v = [0u8; 8];
            fill(&mut v)?;
            Column::Const(u64::from_le_bytes(v))
        }
        1 => Column::U8(rows(fill, len, available, |b: [u8; 1]| b[0])?),
        2 => Column::U16(rows(fill, len, available, u16::from_le_bytes)?),
        4 => Column::U32(rows(fill, len, available, u32::from_le_bytes)?),
        8 => Column::U64(rows(fill, len, available, u64::from_le_bytes)?),
        _ => return None,
    })
}

/// What the saved bytes under a union member's tar stream say of its compression
/// ([`Under::compression`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SavedCompression {
    /// A plain tar.
    Plain,
    /// Compressed in this format.
    Compressed(Compression),
    /// Damaged, of an unknown format, or with nested tars (which a member of a union has
    /// not): the member is indexed again.
    Unreadable,
}

/// The index file's section for what lies under the tar stream: the compressed tars
/// inside a plain archive (offset, length, entry points), then the archive's own entry
/// points if it is compressed.
pub(super) struct Under;

impl Under {
    pub fn encode(a: &TarArchive) -> Vec<u8> {
        let mut o = Vec::new();
        o.extend_from_slice(&(a.nested.len() as u32).to_le_bytes());
        for b in &a.nested {
            if let Body::Decoded(d) = b {
                let p = d.points().encode(d.codec());
                o.extend_from_slice(&d.source().base().to_le_bytes());
                o.extend_from_slice(&d.source().len().to_le_bytes());
                o.extend_from_slice(&(p.len() as u64).to_le_bytes());
                o.extend_from_slice(&p);
            }
        }
        if let Body::Decoded(d) = &a.body {
            o.extend_from_slice(&d.points().encode(d.codec()));
        }
        o
    }

    /// The compression of the archive [`encode`](Self::encode) wrote this for, read from
    /// its entry points' first byte (none: a plain tar).
    pub fn compression(b: &[u8]) -> SavedCompression {
        // A count of nested tars other than zero: a member of a union has none.
        if b.get(..4) != Some(&[0u8; 4][..]) {
            return SavedCompression::Unreadable;
        }
        match b.get(4) {
            None => SavedCompression::Plain,
            Some(&id) => Compression::from_id(id)
                .map_or(SavedCompression::Unreadable, SavedCompression::Compressed),
        }
    }

    /// What [`encode`](Self::encode) wrote, if it fits an archive of `archive_len`
    /// bytes in `codec` (`None`: a plain tar).
    pub fn decode(
        b: &[u8],
        codec: Option<Compression>,
        archive_len: u64,
    ) -> Option<(Option<Points>, Vec<Nested>)> {
        let mut r = b;
        let mut take = |n: u64| -> Option<&[u8]> {
            let (h, t) = r.split_at_checked(usize::try_from(n).ok()?)?;
            r = t;
            Some(h)
        };
        let u64_ = |s: &[u8]| u64::from_le_bytes(s.try_into().unwrap());
        let count = u32::from_le_bytes(take(4)?.try_into().unwrap());
        if count as usize > b.len() / 24 || (count > 0 && codec.is_some()) {
            return None;
        }
        let mut nested = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let (at, len, n) = (u64_(take(8)?), u64_(take(8)?), u64_(take(8)?));
            let blob = take(n)?;
            let c = Compression::from_id(*blob.first()?)?;
            if at.checked_add(len)? > archive_len {
                return None;
            }
            nested.push(Nested {
                at,
                len,
                codec: c,
                points: Points::decode(blob, c, len)?,
            });
        }
        let points = match codec {
            None => r.is_empty().then_some(None)?,
            Some(c) => Some(Points::decode(r, c, archive_len)?),
        };
        Some((points, nested))
    }
}

/// Saves the merged index of a union of `members` at `path`, with each member's
/// identity and what lies under its tar stream.
pub(super) fn save_union(
    path: &Path,
    index: &Index,
    members: &[TarArchive],
    recursive: bool,
) -> Result<()> {
    let mut extra = Vec::new();
    extra.extend_from_slice(&(members.len() as u64).to_le_bytes());
    let mut first = None;
    for m in members {
        let source = m.body.source();
        let id = Identity::of(source, recursive).read(source)?;
        first.get_or_insert(id);
        let under = Under::encode(m);
        extra.extend_from_slice(&id.to_bytes());
        extra.extend_from_slice(&(under.len() as u64).to_le_bytes());
        extra.extend_from_slice(&under);
    }
    let first = first.ok_or_else(|| Error::Usage("a union of no archives".into()))?;
    save(path, index, &first, &extra)
        .map_err(|e| Error::io(format!("cannot save {}", path.display()), e))
}

/// What [`save_union`] wrote for each of `count` members: its identity and what lies
/// under its tar stream.
pub(super) fn decode_union_members(mut b: &[u8], count: usize) -> Option<Vec<(Identity, Vec<u8>)>> {
    let mut take = |n: usize| -> Option<&[u8]> {
        let (h, t) = b.split_at_checked(n)?;
        b = t;
        Some(h)
    };
    let n = u64::from_le_bytes(take(8)?.try_into().ok()?);
    if n != count as u64 {
        return None;
    }
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        let id = Identity::from_bytes(take(32)?.try_into().ok()?);
        let len = usize::try_from(u64::from_le_bytes(take(8)?.try_into().ok()?)).ok()?;
        out.push((id, take(len)?.to_vec()));
    }
    b.is_empty().then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads a column from the front of `b`; returns it and the bytes left unread.
    fn read(b: &[u8], len: usize) -> (Option<Column>, usize) {
        let mut at = 0;
        let mut fill = |buf: &mut [u8]| {
            buf.copy_from_slice(b.get(at..at + buf.len())?);
            at += buf.len();
            Some(())
        };
        let c = read_column(&mut fill, len, b.len() as u64);
        (c, b.len() - at)
    }

    #[test]
    fn columns_round_trip() {
        for values in [
            vec![],
            vec![7, 7, 7],
            vec![0, 255],
            vec![1, 256],
            vec![0, 65_536],
            vec![3, u64::from(u32::MAX) + 1],
            vec![u64::MAX, 0],
        ] {
            let c = Column::new(&values);
            let mut out = Vec::new();
            write_column(&c, &mut out);
            out.push(0xaa);
            let (back, left) = read(&out, values.len());
            assert_eq!(back, Some(c), "{values:?}");
            assert_eq!(left, 1);
        }
    }

    #[test]
    fn short_or_malformed_columns_are_refused() {
        let mut out = Vec::new();
        write_column(&Column::new(&[1, 70_000, 3]), &mut out);
        assert!(read(&out[..out.len() - 1], 3).0.is_none());
        // A row count larger than the input is refused before anything is allocated.
        assert!(read(&out, usize::MAX / 8).0.is_none());
        assert!(read(&[3, 0, 0, 0], 1).0.is_none());
        assert!(read(&[], 0).0.is_none());
    }
}
