//! Choosing an archive's format by its content, the one place that knows every format:
//! one archive, or the union of several, opened from paths for a mount, the inspection
//! commands and the tests; and raw bytes opened as a given format for the fuzzers.
//! Above the formats and the archive interface, below the serving side.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::archive::check::{check, Limits, Report};
use crate::archive::{Archive, Union};
use crate::cache::CacheConfig;
use crate::compressed::Codec;
use crate::error::{Error, Result};
use crate::source::{RemoteOptions, Source};
use crate::tar::TarArchive;

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
enum Opened {
    Tar(Arc<TarArchive>, Option<PathBuf>),
    Other(Arc<dyn Archive>),
}

/// `cache` is a SquashFS image's budget; `how` says how compressed tars decode (their
/// cache shared with the mount's other compressed streams); `save` whether a tar's
/// index, if built, is saved now.
fn open_format(
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
    if let Some(codec) = Codec::detect(&magic) {
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
fn decoding(options: &OpenOptions, cache: &CacheConfig) -> crate::tar::Decoding {
    crate::tar::Decoding {
        spacing: options.spacing.unwrap_or(crate::tar::DEFAULT_SPACING),
        shared: crate::compressed::Shared::new(cache.total_bytes),
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
    crate::tar::BuildOptions {
        recursive: options.recursive,
        implied_uid: unsafe_uid(),
        implied_gid: unsafe_gid(),
        implied_mtime: source.mtime(),
    }
}

fn unsafe_uid() -> u32 {
    // SAFETY: getuid has no preconditions.
    unsafe { libc::getuid() }
}

fn unsafe_gid() -> u32 {
    // SAFETY: getgid has no preconditions.
    unsafe { libc::getgid() }
}

/// Opens one archive, or the union of several (directories, and `s3://BUCKET/PREFIX/`
/// names, stand for the archives directly in them, in name order): for names in more
/// than one, the archive given last wins, and directories merge.
pub fn open_many(
    paths: &[std::path::PathBuf],
    cache: &CacheConfig,
    options: &OpenOptions,
) -> Result<Arc<dyn Archive>> {
    let opened = open_all(paths, cache, options);
    crate::compressed::drop_scan_buffer();
    // Once, when all are open: building a tar's index frees millions of small allocations
    // (a name each; 95 against 56 MB resident at 1.28 M entries), and opening a union's
    // members side by side leaves each thread's arena with the holes of its buffers. Once
    // a member, it took 0.4 of the 1.35 s a first mount of 1,000 `.tar.zst` shards took.
    crate::memory::give_back();
    opened
}

fn open_all(
    paths: &[std::path::PathBuf],
    cache: &CacheConfig,
    options: &OpenOptions,
) -> Result<Arc<dyn Archive>> {
    let mut files = Vec::new();
    for p in paths {
        if let Some(objects) = crate::source::list_prefix(p, &options.remote) {
            files.extend(objects?);
        } else if p.is_dir() {
            let mut inside: Vec<_> = std::fs::read_dir(p)
                .map_err(|e| Error::io(format!("cannot list {}", p.display()), e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_file() && !p.to_string_lossy().ends_with(".archfs-index"))
                .collect();
            inside.sort();
            if inside.is_empty() {
                return Err(Error::Usage(format!("{} holds no archives", p.display())));
            }
            files.extend(inside);
        } else {
            files.push(p.clone());
        }
    }
    if files.len() == 1 {
        return open_with(&files[0], cache, options);
    }
    // Objects in object storage hold no descriptor.
    room_for_descriptors(files.iter().filter(|f| !crate::source::is_url(f)).count())?;
    // One budget for the whole union: the SquashFS members split it, the compressed tars
    // share one cache and their decoders (plain tars read through the page cache).
    let per_member = CacheConfig {
        total_bytes: (cache.total_bytes / files.len() as u64).max(1 << 20),
    };
    let options = OpenOptions {
        index: None,
        ..options.clone()
    };
    // Local tars: their merged index, saved by an earlier mount.
    let saved_at = (!files.iter().any(|f| crate::source::is_url(f)))
        .then(|| crate::tar::union_index_path(&files));
    let how = decoding(&options, cache);
    if let Some(path) = &saved_at {
        if let Some(one) = TarArchive::union_from_saved(&files, path, options.recursive, &how) {
            return Ok(Arc::new(one));
        }
    }
    // Where the union's index is saved, its members' are not (unless not merged).
    let members = open_side_by_side(&files, &per_member, &how, &options, saved_at.is_none())?;
    // The opening threads' arenas hold their buffers' pages, freed: back before the
    // merge takes as much again (1,000 .tar.gz shards: peak RSS 119 -> 87-91 MB).
    crate::memory::give_back();
    union_of(members, options.recursive, saved_at.as_deref())
}

/// One tar of tars' merged indexes where every member is a tar (WebDataset), its index
/// saved at `save`, else a [`Union`] over the members, whose own indexes are then saved.
fn union_of(
    members: Vec<Opened>,
    recursive: bool,
    save: Option<&Path>,
) -> Result<Arc<dyn Archive>> {
    let mut tars = Vec::with_capacity(members.len());
    let mut unsaved = Vec::new();
    let mut others: Vec<Arc<dyn Archive>> = Vec::new();
    let keep = |t: &TarArchive, path: Option<PathBuf>| {
        if let Some(path) = path {
            t.save_index(&path, recursive);
        }
    };
    for m in members {
        match m {
            Opened::Tar(t, path) if others.is_empty() => match Arc::try_unwrap(t) {
                Ok(t) => {
                    tars.push(t);
                    unsaved.push(path);
                }
                Err(t) => {
                    keep(&t, path);
                    others.push(t);
                }
            },
            Opened::Tar(t, path) => {
                keep(&t, path);
                others.push(t);
            }
            Opened::Other(a) => others.push(a),
        }
    }
    if others.is_empty() {
        match TarArchive::union(tars, recursive, save)? {
            Ok(one) => return Ok(Arc::new(one)),
            Err(back) => tars = back,
        }
    }
    for (t, path) in tars.iter().zip(unsaved) {
        keep(t, path);
    }
    let mut all: Vec<Arc<dyn Archive>> = tars
        .into_iter()
        .map(|t| Arc::new(t) as Arc<dyn Archive>)
        .collect();
    all.extend(others);
    Ok(Arc::new(Union::new(all)?))
}

/// The soft limit on open files when the process started, when a union raised it.
static FILES_LIMIT_WAS: std::sync::OnceLock<libc::rlimit> = std::sync::OnceLock::new();

/// Raises the soft limit on open files to what a union of `members` archives may hold
/// (its file, the preload's handle of it, a decoded copy): WebDataset mounts thousands
/// of shards, and clusters often set the soft limit to 1,024. Fails, saying what to do,
/// when the hard limit is too low for a descriptor each.
fn room_for_descriptors(members: usize) -> Result<()> {
    const SPARE: u64 = 256;
    if members == 0 {
        return Ok(());
    }
    let members = members as u64;
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit fills the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Ok(());
    }
    // Its own file, the preload's handle of it, a decoded copy.
    let want = (3 * members + SPARE).min(lim.rlim_max);
    if lim.rlim_cur < want {
        let raised = libc::rlimit {
            rlim_cur: want,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: setrlimit reads the struct it is given.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            let _ = FILES_LIMIT_WAS.set(lim);
        }
    }
    if lim.rlim_max < members + SPARE {
        return Err(Error::Limit(format!(
            "{members} archives need about {} open files, and this process may open {} \
             (`ulimit -Hn`): ask the site for a higher limit, or pack the shards into \
             fewer, larger archives",
            members + SPARE,
            lim.rlim_max
        )));
    }
    Ok(())
}

/// Puts back the soft limit on open files a union raised, for a command the job runs
/// (in a child before exec: only a system call).
pub fn restore_files_limit() {
    if let Some(lim) = FILES_LIMIT_WAS.get() {
        // SAFETY: setrlimit reads the struct it is given; async-signal-safe.
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, lim) };
    }
}

/// Archives opened a few at a time: an open waits on round trips to an object store
/// (or on a saved index from a parallel filesystem), which overlap; the first error in
/// name order is the one reported.
fn open_side_by_side(
    files: &[PathBuf],
    cache: &CacheConfig,
    how: &crate::tar::Decoding,
    options: &OpenOptions,
    save: bool,
) -> Result<Vec<Opened>> {
    const AT_ONCE: usize = 16;
    let next = std::sync::atomic::AtomicUsize::new(0);
    type Slot = crate::sync::Mutex<Option<Result<Opened>>>;
    let slots: Vec<Slot> = files.iter().map(|_| Slot::new(None)).collect();
    std::thread::scope(|scope| {
        for _ in 0..AT_ONCE.min(files.len()) {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(f) = files.get(i) else { break };
                let opened = open_format(f, cache, how, options, save);
                let failed = opened.is_err();
                *slots[i].lock() = Some(opened);
                if failed {
                    // The rest need not be opened; later ones still finish what they hold.
                    next.store(files.len(), std::sync::atomic::Ordering::Relaxed);
                }
            });
        }
    });
    let mut members = Vec::with_capacity(files.len());
    for slot in slots {
        match slot.into_inner() {
            Some(opened) => members.push(opened?),
            // Every name before the one that failed was taken and opened, so its error
            // is returned above before a slot left empty is reached.
            None => unreachable!("an archive of the union was not opened, and none failed"),
        }
    }
    Ok(members)
}

/// Builds (or loads) the index of the tar archive `path` and keeps it where every later
/// mount looks first: for an `s3://` object, the object `KEY.archfs-index` beside it, so
/// jobs on every node mount at once; for a local archive, where a mount saves it.
/// Says where it went.
pub fn save_index(path: &Path, options: &OpenOptions) -> Result<String> {
    let archive = open_with(path, &CacheConfig::default(), options)?;
    let source = Source::open_with(path, &options.remote)?;
    let mut magic = [0u8; 4];
    if source.len() >= 4 {
        source.read_exact_at(0, &mut magic)?;
    }
    if &magic == b"hsqs" {
        return Err(Error::Usage(format!(
            "{} is a SquashFS image, which needs no index: it mounts at once",
            path.display()
        )));
    }
    let saved = options
        .index
        .clone()
        .unwrap_or_else(|| crate::tar::persist::default_path(path, source.is_local()));
    drop(archive);
    if source.is_local() {
        return Ok(saved.display().to_string());
    }
    let body = std::fs::read(&saved)
        .map_err(|e| Error::io(format!("cannot read the index {}", saved.display()), e))?;
    crate::source::put_sidecar(path, &options.remote, &body)
}

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
    let source = Source::open(std::path::Path::new(&format!(
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
        Format::Tar => Box::new(crate::tar::TarArchive::build(
            std::sync::Arc::new(source),
            opts,
            &how,
            &mut |_| {},
        )?),
        Format::CompressedTar => {
            let mut magic = [0u8; 4];
            source.read_exact_at(0, &mut magic)?;
            let codec = crate::compressed::Codec::detect(&magic)
                .ok_or_else(|| Error::NotArchive("no compressed format's magic".into()))?;
            Box::new(crate::tar::TarArchive::build_compressed(
                std::sync::Arc::new(source),
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
        Ok(one) => check(&one, limits),
        Err(_) => return Err(Error::Usage("not mergeable".into())),
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
        shared: crate::compressed::Shared::new(cache_bytes),
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
