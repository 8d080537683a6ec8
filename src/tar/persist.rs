//! The index saved next to the archive (or in the user's cache directory), so a remount
//! of a large archive skips the scan. It is tied to the archive's size, mtime and a
//! checksum of its first and last 64 KiB, protected by a CRC, and validated field by
//! field on load: a stale, corrupt or foreign file is rebuilt, never trusted.

use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::index::{kind_of, Dirent, Index, Node, Segment, NONE, SPARSE};
use crate::archive::{Kind, Source};
use crate::error::{Error, Result};

const MAGIC: &[u8; 8] = b"ARCHFSIX";
const VERSION: u32 = 1;
const NODE_BYTES: usize = 56;

/// What ties an index to one version of one archive built with one set of options.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Identity {
    size: u64,
    mtime_ns: i64,
    content: u32,
    options: u32,
}

impl Identity {
    pub fn of(source: &Source, recursive: bool) -> Result<Identity> {
        let meta = std::fs::metadata(source.path())
            .map_err(|e| Error::io(format!("stat {}", source.path().display()), e))?;
        let size = source.len();
        let edge = 64 << 10;
        let mut crc = crc32fast::Hasher::new();
        crc.update(&source.read_vec(0, edge.min(size) as usize)?);
        let tail = size.saturating_sub(edge);
        crc.update(&source.read_vec(tail, (size - tail) as usize)?);
        Ok(Identity {
            size,
            mtime_ns: meta.mtime() * 1_000_000_000 + meta.mtime_nsec(),
            content: crc.finalize(),
            options: u32::from(recursive),
        })
    }
}

/// Where the index of `archive` lives: beside it when that directory is writable,
/// else under `$XDG_CACHE_HOME/archfs` (or `~/.cache/archfs`).
pub fn default_path(archive: &Path) -> PathBuf {
    let canon = std::fs::canonicalize(archive).unwrap_or_else(|_| archive.to_owned());
    let name = canon
        .file_name()
        .map(|n| n.to_os_string())
        .unwrap_or_default();
    let beside = canon.with_file_name(format!("{}.archfs-index", name.to_string_lossy()));
    let dir = canon.parent().unwrap_or(Path::new("/"));
    if beside.exists() || writable(dir) {
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

fn writable(dir: &Path) -> bool {
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: c is a valid NUL-terminated path.
    unsafe { libc::access(c.as_ptr(), libc::W_OK) == 0 }
}

struct Out(Vec<u8>);

impl Out {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
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

fn encode(index: &Index, id: &Identity) -> Vec<u8> {
    let mut o = Out(Vec::with_capacity(
        64 + index.nodes.len() * (NODE_BYTES + 16),
    ));
    o.0.extend_from_slice(MAGIC);
    o.u32(VERSION);
    o.u64(id.size);
    o.u64(id.mtime_ns as u64);
    o.u32(id.content);
    o.u32(id.options);
    o.u64(index.nodes.len() as u64);
    for n in &index.nodes {
        o.u64(n.size);
        o.u64(n.data);
        o.u64(n.mtime as u64);
        o.u32(n.mtime_nsec);
        o.u32(n.uid);
        o.u32(n.gid);
        o.u32(n.rdev);
        o.u32(n.nlink);
        o.u32(n.xattrs);
        o.u32(n.aux);
        o.u16(n.mode);
        o.u8(n.kind);
        o.u8(n.flags);
    }
    o.u64(index.dirents.len() as u64);
    for d in &index.dirents {
        o.u64(d.name_off);
        o.u32(d.name_len);
        o.u32(d.node);
    }
    o.bytes(&index.strings);
    o.u64(index.segments.len() as u64);
    for s in &index.segments {
        o.u64(s.offset);
        o.u64(s.len);
        o.u64(s.archive_off);
    }
    o.u64(index.xattrs.len() as u64);
    for set in &index.xattrs {
        o.u64(set.len() as u64);
        for (k, v) in set {
            o.bytes(k);
            o.bytes(v);
        }
    }
    let crc = crc32fast::hash(&o.0);
    o.u32(crc);
    o.0
}

/// Writes the index atomically (temporary file, then rename).
pub fn save(path: &Path, index: &Index, id: &Identity) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(&encode(index, id))?;
    f.sync_all()?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

struct In<'a> {
    b: &'a [u8],
    at: usize,
}

impl In<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        let s = self.b.get(self.at..self.at.checked_add(n)?)?;
        self.at += n;
        Some(s)
    }
    fn u8(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }
    fn u16(&mut self) -> Option<u16> {
        Some(u16::from_le_bytes(self.take(2)?.try_into().ok()?))
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
    /// A count of records of `size` bytes that must fit in what is left.
    fn count(&mut self, size: usize) -> Option<usize> {
        let n = usize::try_from(self.u64()?).ok()?;
        (n.checked_mul(size)? <= self.b.len() - self.at).then_some(n)
    }
    fn bytes(&mut self) -> Option<Vec<u8>> {
        let n = self.count(1)?;
        Some(self.take(n)?.to_vec())
    }
}

/// Why a saved index was not used.
#[derive(Debug, PartialEq, Eq)]
pub enum Rejected {
    Missing,
    Stale,
    Corrupt,
}

/// Loads the index at `path` if it belongs to the archive as it is now.
pub fn load(path: &Path, id: &Identity) -> std::result::Result<Index, Rejected> {
    let bytes = std::fs::read(path).map_err(|_| Rejected::Missing)?;
    if bytes.len() < 48 || &bytes[..8] != MAGIC {
        return Err(Rejected::Corrupt);
    }
    let (body, crc) = bytes.split_at(bytes.len() - 4);
    if crc32fast::hash(body) != u32::from_le_bytes(crc.try_into().unwrap()) {
        return Err(Rejected::Corrupt);
    }
    let mut r = In { b: body, at: 8 };
    let header = (|| {
        let version = r.u32()?;
        let saved = Identity {
            size: r.u64()?,
            mtime_ns: r.u64()? as i64,
            content: r.u32()?,
            options: r.u32()?,
        };
        Some((version, saved))
    })();
    match header {
        Some((VERSION, saved)) if saved == *id => {}
        Some((VERSION, _)) => return Err(Rejected::Stale),
        _ => return Err(Rejected::Corrupt),
    }
    let index = decode(&mut r).ok_or(Rejected::Corrupt)?;
    if r.at != body.len() || !valid(&index, id.size) {
        return Err(Rejected::Corrupt);
    }
    Ok(index)
}

fn decode(r: &mut In<'_>) -> Option<Index> {
    let n = r.count(NODE_BYTES)?;
    let mut nodes = Vec::with_capacity(n);
    for _ in 0..n {
        nodes.push(Node {
            size: r.u64()?,
            data: r.u64()?,
            mtime: r.u64()? as i64,
            mtime_nsec: r.u32()?,
            uid: r.u32()?,
            gid: r.u32()?,
            rdev: r.u32()?,
            nlink: r.u32()?,
            xattrs: r.u32()?,
            aux: r.u32()?,
            mode: r.u16()?,
            kind: r.u8()?,
            flags: r.u8()?,
        });
    }
    let n = r.count(16)?;
    let mut dirents = Vec::with_capacity(n);
    for _ in 0..n {
        dirents.push(Dirent {
            name_off: r.u64()?,
            name_len: r.u32()?,
            node: r.u32()?,
        });
    }
    let strings = r.bytes()?;
    let n = r.count(24)?;
    let mut segments = Vec::with_capacity(n);
    for _ in 0..n {
        segments.push(Segment {
            offset: r.u64()?,
            len: r.u64()?,
            archive_off: r.u64()?,
        });
    }
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
    Some(Index {
        nodes,
        dirents,
        strings,
        segments,
        xattrs,
        skipped: Vec::new(),
    })
}

/// Every offset and range in the index points inside the index or the archive, so a
/// CRC-valid file from somewhere else still cannot make a lookup index out of bounds.
fn valid(ix: &Index, archive_len: u64) -> bool {
    let in_range =
        |off: u64, len: u64, total: usize| off.checked_add(len).is_some_and(|e| e <= total as u64);
    if ix.nodes.is_empty() || kind_of(ix.nodes[0].kind) != Kind::Dir {
        return false;
    }
    let nodes_ok = ix.nodes.iter().all(|n| {
        (n.xattrs == NONE || (n.xattrs as usize) < ix.xattrs.len())
            && n.kind <= 6
            && match kind_of(n.kind) {
                Kind::Dir => in_range(n.data, u64::from(n.aux), ix.dirents.len()),
                Kind::Symlink => in_range(n.data, u64::from(n.aux), ix.strings.len()),
                Kind::File if n.flags & SPARSE != 0 => {
                    in_range(n.data, u64::from(n.aux), ix.segments.len())
                }
                Kind::File => n.data.checked_add(n.size).is_some_and(|e| e <= archive_len),
                _ => true,
            }
    });
    nodes_ok
        && ix.dirents.iter().all(|d| {
            (d.node as usize) < ix.nodes.len()
                && in_range(d.name_off, u64::from(d.name_len), ix.strings.len())
        })
        && ix.segments.iter().all(|s| {
            s.archive_off
                .checked_add(s.len)
                .is_some_and(|e| e <= archive_len)
                && s.offset.checked_add(s.len).is_some()
        })
}
