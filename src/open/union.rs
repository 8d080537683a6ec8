//! Opening several archives as one: the members opened side by side, and the one place
//! that chooses what serves them (one tar over a merged index, saved or made now, or a
//! [`Union`] over the members).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{decoding, open_format, open_with, OpenOptions, Opened};
use crate::archive::{Archive, Union};
use crate::cache::CacheConfig;
use crate::error::{Error, Result};
use crate::tar::{Merged, TarArchive};

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
            Merged::One(one) => return Ok(Arc::<TarArchive>::from(one)),
            Merged::Apart(back) => tars = back,
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
