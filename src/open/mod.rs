//! Choosing an archive's format by its content, the one place that knows every format,
//! for a mount, the inspection commands and the tests. Above the formats and the archive
//! interface, below the serving side. Built on it: several archives opened as one
//! ([`union`]), an index exported for later mounts ([`index_export`]), and raw bytes opened
//! as a given format for the fuzzers ([`fuzz`]).

pub mod fuzz;
mod index_export;
mod union;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::archive::Archive;
use crate::cache::CacheConfig;
use crate::compressed::Compression;
use crate::error::{Error, Result};
use crate::source::{RemoteOptions, Source};
use crate::tar::TarArchive;

pub use index_export::save_index;
pub use union::{open_many, restore_files_limit};

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
    Ok(
        match open_format(path, cache, &decoding(options, cache), options, true)? {
            Opened::Tar(t, _) => t,
            Opened::Other(a) => a,
        },
    )
}

/// An archive as opened: tars as what they are, so that a union of them can merge
/// their indexes, with where a tar's index goes if it was built and not yet saved.
pub(super) enum Opened {
    Tar(Arc<TarArchive>, Option<PathBuf>),
    Other(Arc<dyn Archive>),
}

/// `cache` is a SquashFS image's budget; `how` says how compressed tars decode (their
/// cache shared with the mount's other compressed streams); `save` whether a tar's
/// index, if built, is saved now.
pub(super) fn open_format(
    path: &Path,
    cache: &CacheConfig,
    how: &crate::tar::Decoding,
    options: &OpenOptions,
    save: bool,
) -> Result<Opened> {
    let source = Source::open_with(path, &options.remote)?;
    let mut magic = [0u8; 4];
    if source.len() >= 4 {
        source.read_exact_at(0, &mut magic)?;
    }
    if &magic == b"hsqs" {
        let image = crate::squashfs::SquashFs::open(source, cache)?;
        return Ok(Opened::Other(Arc::new(image)));
    }
    let tar = |source: Source, codec| {
        let opts = tar_options(options, &source);
        let recursive = opts.recursive;
        let index = options.index.as_deref();
        let (t, mut unsaved) = crate::tar::open_unsaved(Arc::new(source), opts, index, codec, how)?;
        if save {
            if let Some(path) = unsaved.take() {
                t.save_index(&path, recursive);
            }
        }
        Ok(Opened::Tar(t, unsaved))
    };
    if let Some(codec) = Compression::detect(&magic) {
        return tar(source, Some(codec));
    }
    if magic == [0x04, 0x22, 0x4d, 0x18] {
        return Err(Error::NotArchive(format!(
            "{} is an lz4-compressed archive, which archfs cannot read; decompress it once \
             (`lz4 -d FILE`) or recompress it with gzip, zstd, xz or bzip2",
            path.display()
        )));
    }
    if crate::tar::is_tar_start(&source) {
        return tar(source, None);
    }
    Err(Error::NotArchive(format!(
        "{} is neither a SquashFS image nor a tar archive; create an image with \
         `mksquashfs DIR {}`",
        path.display(),
        path.display()
    )))
}

/// How compressed tars are decoded.
pub(super) fn decoding(options: &OpenOptions, cache: &CacheConfig) -> crate::tar::Decoding {
    crate::tar::Decoding {
        spacing: options.spacing.unwrap_or(crate::tar::DEFAULT_SPACING),
        stream_cache: crate::compressed::StreamCache::new(cache.total_bytes),
        stage_dir: options.stage_dir.clone(),
        limit: u64::MAX,
    }
}

/// Options that apply to some formats only.
#[derive(Clone, Debug, Default)]
pub struct OpenOptions {
    /// Show `.tar` members of a tar archive as directories.
    pub recursive: bool,
    /// Where a tar archive's index is kept (default: beside it, or the cache dir).
    pub index: Option<std::path::PathBuf>,
    /// Decoded bytes between the entry points of a compressed tar (default
    /// [`crate::tar::DEFAULT_SPACING`]).
    pub spacing: Option<u64>,
    /// Where a decoded copy of a compressed tar goes when it does not fit in memory.
    pub stage_dir: Option<PathBuf>,
    /// How to reach archives in object storage.
    pub remote: RemoteOptions,
}

fn tar_options(options: &OpenOptions, source: &Source) -> crate::tar::BuildOptions {
    let (uid, gid) = mounting_user();
    crate::tar::BuildOptions {
        recursive: options.recursive,
        implied_uid: uid,
        implied_gid: gid,
        implied_mtime: source.mtime(),
    }
}

/// The user and group of this process: the owner shown for the directories a tar archive
/// only implies (no header of their own), as if the user who mounts had made them.
fn mounting_user() -> (u32, u32) {
    // SAFETY: getuid and getgid have no preconditions and cannot fail.
    unsafe { (libc::getuid(), libc::getgid()) }
}
