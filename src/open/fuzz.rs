//! The fuzz targets' entry points (fuzz/fuzz_targets), and the regression test that
//! replays their findings: raw bytes opened as a given format, then walked whole.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::archive::check::{check, Limits, Report};
use crate::archive::Archive;
use crate::cache::CacheConfig;
use crate::error::{Error, Result};
use crate::source::Source;
use crate::tar::{Merged, TarArchive};

/// The formats [`check_bytes`] can be asked to read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    SquashFs,
    /// Indexed with `--recursive`, so nested tars (plain and compressed) are parsed too.
    Tar,
    /// A compressed tar (gzip, zstd, xz, bzip2, by its magic), entry points every 64 KiB.
    CompressedTar,
}

/// Opens `data` (held in an anonymous memory file) as `format` with a 4 MiB cache and
/// walks it. The fuzz targets and the regression test of their findings call this.
pub fn check_bytes(data: &[u8], format: Format, limits: Limits) -> Result<Report> {
    let file = memfd(data)?;
    let source = Source::open(Path::new(&format!(
        "/proc/self/fd/{}",
        std::os::fd::AsRawFd::as_raw_fd(&file)
    )))?;
    let cache = CacheConfig {
        total_bytes: 4 << 20,
    };
    let opts = crate::tar::BuildOptions {
        recursive: true,
        implied_uid: 0,
        implied_gid: 0,
        implied_mtime: 0,
    };
    // Compressed tars (the archive, or members of a plain one) decode to at most 64 MiB.
    let how = fuzz_decoding(cache.total_bytes);
    let archive: Box<dyn Archive> = match format {
        Format::SquashFs => Box::new(crate::squashfs::SquashFs::open(source, &cache)?),
        Format::Tar => Box::new(TarArchive::build(
            Arc::new(source),
            opts,
            &how,
            &mut |_| {},
        )?),
        Format::CompressedTar => {
            let mut magic = [0u8; 4];
            source.read_exact_at(0, &mut magic)?;
            let codec = crate::compressed::Compression::detect(&magic)
                .ok_or_else(|| Error::NotArchive("no compressed format's magic".into()))?;
            Box::new(TarArchive::build_compressed(
                Arc::new(source),
                opts,
                codec,
                &how,
                &mut |_| {},
            )?)
        }
    };
    Ok(check(&*archive, limits))
}

/// Splits `data` into 2 or 3 tar archives (by its first byte; the rest in equal parts of
/// whole 512-byte blocks), indexes each, serves them as one union (one merged index, as a
/// directory of shards is), saves that index in `dir` and walks the union; then opens the
/// union again from the saved index, as a remount does, and walks that. Returns both
/// walks' reports (the second `None` when the saved index was not taken back). The union
/// fuzz target calls this: the merge and the saved file see hostile indexes here.
pub fn check_union_bytes(
    data: &[u8],
    dir: &Path,
    limits: Limits,
) -> Result<(Report, Option<Report>)> {
    let Some((&first, rest)) = data.split_first() else {
        return Err(Error::NotArchive("no input".into()));
    };
    let count = 2 + usize::from(first % 2);
    let each = (rest.len() / count) / 512 * 512;
    let parts: Vec<&[u8]> = (0..count)
        .map(|i| {
            let end = if i + 1 == count {
                rest.len()
            } else {
                (i + 1) * each
            };
            &rest[i * each..end]
        })
        .collect();
    let files = parts.iter().map(|p| memfd(p)).collect::<Result<Vec<_>>>()?;
    let paths: Vec<PathBuf> = files
        .iter()
        .map(|f| format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(f)).into())
        .collect();
    let how = fuzz_decoding(4 << 20);
    let opts = || crate::tar::BuildOptions {
        recursive: false,
        implied_uid: 0,
        implied_gid: 0,
        implied_mtime: 0,
    };
    let mut members = Vec::with_capacity(paths.len());
    for p in &paths {
        let source = Source::open(p)?;
        // As a mount takes a directory's files: those that start as a tar.
        if !crate::tar::is_tar_start(&source) {
            return Err(Error::NotArchive("not a tar".into()));
        }
        members.push(TarArchive::build(
            Arc::new(source),
            opts(),
            &how,
            &mut |_| {},
        )?);
    }
    let saved = dir.join("union.archfs-index");
    let _ = std::fs::remove_file(&saved);
    let merged = match TarArchive::union(members, false, Some(&saved))? {
        Merged::One(one) => check(&*one, limits),
        Merged::Apart(_) => return Err(Error::Usage("not mergeable".into())),
    };
    let again =
        TarArchive::union_from_saved(&paths, &saved, false, &how).map(|one| check(&one, limits));
    Ok((merged, again))
}

/// How [`check_bytes`] and [`check_union_bytes`] decode: entry points every 64 KiB, at
/// most 64 MiB decoded (the fuzz targets' bound on a decompression bomb).
fn fuzz_decoding(cache_bytes: u64) -> crate::tar::Decoding {
    crate::tar::Decoding {
        spacing: 64 << 10,
        stream_cache: crate::compressed::StreamCache::new(cache_bytes),
        stage_dir: None,
        limit: 64 << 20,
    }
}

fn memfd(data: &[u8]) -> Result<std::fs::File> {
    use std::io::Write;
    let mut file = crate::source::scratch::memfd().map_err(|e| Error::io("memfd_create", e))?;
    file.write_all(data)
        .map_err(|e| Error::io("writing the memory file", e))?;
    Ok(file)
}
