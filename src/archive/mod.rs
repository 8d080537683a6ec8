//! The interface every archive format implements. The FUSE adapter, the CLI's inspection
//! commands and the tests all go through it, so a format is tested once, without a mount.

mod buf;
pub mod check;
mod source;
mod union;

use std::ops::{Deref, Range};
use std::os::fd::BorrowedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use buf::Buf;
#[cfg(test)]
pub use source::tests::resident;
pub use source::{advice_piece, will_need, Source};
pub use union::Union;

use crate::cache::CacheConfig;
use crate::compressed::Codec;
use crate::error::{Error, Result};

/// The inode number of the archive's root directory (FUSE's root is 1 too).
pub const ROOT_INO: u64 = 1;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Kind {
    #[default]
    File,
    Dir,
    Symlink,
    BlockDev,
    CharDev,
    Fifo,
    Socket,
}

/// What `stat` shows for one inode.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Attr {
    pub ino: u64,
    pub kind: Kind,
    /// Permission bits including setuid, setgid and sticky (`mode & 0o7777`).
    pub perm: u16,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    /// Allocated 512-byte blocks.
    pub blocks: u64,
    pub mtime: i64,
    pub mtime_nsec: u32,
    /// Device number in the kernel's `new_encode_dev` form.
    pub rdev: u32,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirEntry {
    pub ino: u64,
    pub kind: Kind,
    pub name: Box<[u8]>,
}

/// Totals for `statfs`.
#[derive(Clone, Copy, Debug)]
pub struct Stats {
    pub bytes: u64,
    pub block_size: u32,
    pub inodes: u64,
    pub name_max: u32,
}

/// A byte range of an archive file, for warming the page cache ahead of reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Extent {
    pub path: PathBuf,
    pub range: Range<u64>,
    /// Directory and inode tables: worth caching even when the data is not.
    pub metadata: bool,
}

/// Bytes returned by a read: a slice of a cached block when one block covers the request
/// (no copy), or a buffer of the reading thread's (a read spanning blocks, a tar member).
pub enum Data {
    Shared(Arc<Vec<u8>>, Range<usize>),
    Owned(Buf),
}

impl Deref for Data {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Data::Shared(block, range) => &block[range.clone()],
            Data::Owned(v) => v,
        }
    }
}

/// A read-only archive: inode numbers are stable for the life of the object, and
/// `ROOT_INO` is the root directory.
pub trait Archive: Send + Sync {
    /// Short name of the format, for logs and `archfs info`.
    fn format(&self) -> String;
    fn attr(&self, ino: u64) -> Result<Attr>;
    /// Finds `name` in directory `dir`; `Error::NotFound` when absent.
    fn lookup(&self, dir: u64, name: &[u8]) -> Result<Attr>;
    /// All entries of a directory, without `.` and `..`, in archive order.
    fn read_dir(&self, dir: u64) -> Result<Vec<DirEntry>>;
    /// Up to `size` bytes from `offset`; fewer only at end of file.
    fn read(&self, ino: u64, offset: u64, size: u32) -> Result<Data>;
    /// Where bytes `offset..` of file `ino`, up to `size` and the end of the file, lie
    /// verbatim in a file on disk: the descriptor, the position and the length. The push
    /// splices such bytes into the kernel without copying them through this process.
    /// `None`: read them.
    fn stored_at(&self, _ino: u64, _offset: u64, _size: u32) -> Option<(BorrowedFd<'_>, u64, u32)> {
        None
    }
    fn readlink(&self, ino: u64) -> Result<Vec<u8>>;
    /// Extended attributes as full names (`user.x`) and values.
    fn xattrs(&self, ino: u64) -> Result<Vec<(Vec<u8>, Vec<u8>)>>;
    fn stats(&self) -> Stats;
    /// The byte ranges of the archive files that serving reads touches, metadata first.
    fn extents(&self) -> Vec<Extent>;
    /// `--preload` of a compressed archive: decode all of it in the background into a
    /// copy reads are then served from.
    fn decode_ahead(&self, _which: Ahead) {}
    /// Whether a decoded copy is still being made: reads meanwhile decode in place.
    fn decoding_ahead(&self) -> bool {
        false
    }
}

/// Which compressed archives [`Archive::decode_ahead`] starts decoding, and where to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ahead {
    /// Those whose reads would decode far (entry points over a MiB apart: xz and bzip2
    /// blocks, pzstd frames), into memory if it fits: `--preload=auto` at mount, since
    /// a read before the copy decodes a whole block or frame for one file.
    Far,
    /// All, into memory if it fits (`--preload=auto` once reads show an epoch).
    Memory,
    /// All, into memory if it fits, else onto --stage-dir (`--preload=always`).
    Any,
}

/// Opens an archive, choosing the format by its content rather than its name.
pub fn open(path: &Path, cache: &CacheConfig) -> Result<Arc<dyn Archive>> {
    open_with(path, cache, &OpenOptions::default())
}

/// Like [`open`], with format-specific options.
pub fn open_with(
    path: &Path,
    cache: &CacheConfig,
    options: &OpenOptions,
) -> Result<Arc<dyn Archive>> {
    let source = Source::open(path)?;
    let mut magic = [0u8; 4];
    if source.len() >= 4 {
        source.read_exact_at(0, &mut magic)?;
    }
    if &magic == b"hsqs" {
        return Ok(Arc::new(crate::squashfs::SquashFs::open(source, cache)?));
    }
    let how = crate::tar::Decoding {
        spacing: options.spacing.unwrap_or(DEFAULT_SPACING),
        cache_bytes: cache.total_bytes,
        stage_dir: options.stage_dir.clone(),
        limit: u64::MAX,
    };
    if let Some(codec) = Codec::detect(&magic) {
        let source = Arc::new(source);
        if !decodes_to_tar(&source, codec) {
            return Err(Error::Unsupported(format!(
                "{} is {}-compressed but holds no tar archive (or is damaged at its start); \
                 archfs mounts compressed tar archives and SquashFS images",
                path.display(),
                codec.name()
            )));
        }
        let opts = tar_options(options, &source);
        return Ok(crate::tar::open(
            source,
            opts,
            options.index.as_deref(),
            Some(codec),
            &how,
        )?);
    }
    if magic == [0x04, 0x22, 0x4d, 0x18] {
        return Err(Error::Unsupported(format!(
            "{} is an lz4-compressed archive, which archfs cannot read; decompress it once \
             (`lz4 -d FILE`) or recompress it with gzip, zstd, xz or bzip2",
            path.display()
        )));
    }
    if is_tar(&source) {
        let opts = tar_options(options, &source);
        return Ok(crate::tar::open(
            Arc::new(source),
            opts,
            options.index.as_deref(),
            None,
            &how,
        )?);
    }
    Err(Error::Unsupported(format!(
        "{} is neither a SquashFS image nor a tar archive; create an image with \
         `mksquashfs DIR {}`",
        path.display(),
        path.display()
    )))
}

/// Options that apply to some formats only.
#[derive(Clone, Debug, Default)]
pub struct OpenOptions {
    /// Show `.tar` members of a tar archive as directories.
    pub recursive: bool,
    /// Where a tar archive's index is kept (default: beside it, or the cache dir).
    pub index: Option<std::path::PathBuf>,
    /// Decoded bytes between the entry points of a compressed tar (default
    /// [`DEFAULT_SPACING`]).
    pub spacing: Option<u64>,
    /// Where a decoded copy of a compressed tar goes when it does not fit in memory.
    pub stage_dir: Option<PathBuf>,
}

/// Entry points every 128 KiB of decoded data: on the bench's tar.gz a cold shuffled
/// epoch took 7.25 s at 1 MiB, 4.49 s at 256 KiB, 4.11 s at 128 KiB and 4.04 s at
/// 64 KiB, with saved indexes of 0.05-0.15% of the archive (sparse windows).
pub const DEFAULT_SPACING: u64 = 128 << 10;

fn tar_options(options: &OpenOptions, source: &Source) -> crate::tar::BuildOptions {
    crate::tar::BuildOptions {
        recursive: options.recursive,
        implied_uid: unsafe_uid(),
        implied_gid: unsafe_gid(),
        implied_mtime: source.mtime(),
    }
}

/// Whether the first 512 decoded bytes are a tar header.
fn decodes_to_tar(source: &Arc<Source>, codec: Codec) -> bool {
    let mut raw = [0u8; 512];
    let Ok(n) = crate::compressed::first_bytes(source, codec, &mut raw) else {
        return false;
    };
    n == 512 && (crate::tar::header_ok(&raw) || raw.iter().all(|&b| b == 0))
}

/// A tar archive starts with a header whose checksum holds (or is empty).
fn is_tar(source: &Source) -> bool {
    let mut raw = [0u8; 512];
    if source.len() < 512 || source.read_exact_at(0, &mut raw).is_err() {
        return false;
    }
    let h = crate::tar::header_ok(&raw);
    h || (raw.iter().all(|&b| b == 0) && source.len() % 512 == 0)
}

fn unsafe_uid() -> u32 {
    // SAFETY: getuid has no preconditions.
    unsafe { libc::getuid() }
}

fn unsafe_gid() -> u32 {
    // SAFETY: getgid has no preconditions.
    unsafe { libc::getgid() }
}

/// Walks `path` (relative to the archive root; `/` and `.` components are ignored) to
/// its inode, for the inspection commands.
pub fn resolve(archive: &dyn Archive, path: &Path) -> Result<Attr> {
    use std::os::unix::ffi::OsStrExt;
    let mut attr = archive.attr(ROOT_INO)?;
    for comp in path.components() {
        match comp {
            std::path::Component::Normal(name) => {
                attr = archive.lookup(attr.ino, name.as_bytes())?;
            }
            std::path::Component::ParentDir => {
                return Err(Error::Unsupported(
                    "`..` is not allowed in archive paths".into(),
                ))
            }
            _ => {}
        }
    }
    Ok(attr)
}

/// Opens one archive, or the union of several (directories stand for the archives in
/// them, in name order): for names in more than one, the archive given last wins, and
/// directories merge.
pub fn open_many(
    paths: &[std::path::PathBuf],
    cache: &CacheConfig,
    options: &OpenOptions,
) -> Result<Arc<dyn Archive>> {
    let mut files = Vec::new();
    for p in paths {
        if p.is_dir() {
            let mut inside: Vec<_> = std::fs::read_dir(p)
                .map_err(|e| Error::io(format!("cannot list {}", p.display()), e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_file() && !p.to_string_lossy().ends_with(".archfs-index"))
                .collect();
            inside.sort();
            if inside.is_empty() {
                return Err(Error::Unsupported(format!(
                    "{} holds no archives",
                    p.display()
                )));
            }
            files.extend(inside);
        } else {
            files.push(p.clone());
        }
    }
    if files.len() == 1 {
        return open_with(&files[0], cache, options);
    }
    // One budget for the whole union: the SquashFS members split it (tar members read
    // through the page cache and hold no blocks).
    let per_member = CacheConfig {
        total_bytes: (cache.total_bytes / files.len() as u64).max(1 << 20),
    };
    let options = OpenOptions {
        index: None,
        ..options.clone()
    };
    let members = files
        .iter()
        .map(|f| open_with(f, &per_member, &options))
        .collect::<Result<Vec<_>>>()?;
    Ok(Arc::new(Union::new(members)?))
}
