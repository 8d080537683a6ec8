//! `--stage-dir DIR --keep SIZE`: copies that outlive the job, for the next job on the
//! node (a node's SSD). Each is a file `DIR/archfs-copy-TAG`, named and tagged by the
//! object's identity (URL, ETag, size), its board past its data as in any copy, so a
//! later job sees which pieces are in it. A copy is trusted whole only once sealed: its
//! data synced to the disk, then marked so; a copy left unsealed by a job that ended
//! (a node that went down may have lost its page cache) is begun again. Jobs using a copy
//! hold a shared lock on it; the oldest copies no job uses go first when the copies
//! would take more than SIZE together.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use super::board::Board;

const PREFIX: &str = "archfs-copy-";

/// Whether `dir` holds a sealed copy of the object tagged `tag` (`size` bytes): a later
/// job then reads it from its first read, not after an epoch's worth from storage.
pub fn sealed(dir: &Path, tag: u64, size: u64) -> bool {
    let path = dir.join(format!("{PREFIX}{tag:016x}"));
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .ok()
        .and_then(|f| Board::open(f, size).ok())
        .is_some_and(|b| b.tag() == tag && b.sealed())
}

/// Why a copy is not kept (it is then placed as any other).
#[derive(Debug, thiserror::Error)]
pub enum NotKept {
    #[error(
        "{:.1} GB is more than --keep allows ({:.1} GB)",
        *len as f64 / 1e9,
        *bound as f64 / 1e9
    )]
    TooLarge { len: u64, bound: u64 },
    #[error("{} is in use and is not a copy of this object", .0.display())]
    Other(PathBuf),
    #[error("cannot {what} {}: {source}", path.display())]
    Io {
        /// `open`, `make a copy in`, `lock`.
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The kept copy of the object tagged `tag` (`size` bytes in `pieces`) in `dir`: the one
/// an earlier job left when it is this object's and sealed or still being made, else a
/// new one, or why none can be kept.
pub fn open(
    dir: &Path,
    tag: u64,
    size: u64,
    pieces: u64,
    bound: u64,
) -> Result<(File, bool), NotKept> {
    let len = Board::file_len(size, pieces);
    if len > bound {
        return Err(NotKept::TooLarge { len, bound });
    }
    let path = dir.join(format!("{PREFIX}{tag:016x}"));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|source| io("open", &path, source))?;
    let fits = file
        .metadata()
        .ok()
        .filter(|m| m.len() == len)
        .and_then(|_| file.try_clone().ok())
        .and_then(|f| Board::open(f, size).ok())
        .map(|b| (b.tag() == tag, b.sealed() || b.in_use()));
    // The caller holds the node's lock on placing: no other process sets a copy up now.
    // One another job holds is joined as it is; one no process holds is begun again
    // unless it is sealed or its copiers run.
    let alone = try_lock(&file, libc::LOCK_EX | libc::LOCK_NB);
    let reused = match fits {
        Some((true, usable)) => usable || !alone,
        _ if !alone => return Err(NotKept::Other(path)),
        _ => false,
    };
    if !reused {
        file.set_len(0)
            .and_then(|()| super::place::reserve(&file, len))
            .and_then(|()| file.try_clone())
            .and_then(|f| Board::create(f, size, pieces, tag).map(drop))
            .map_err(|source| io("make a copy in", &path, source))?;
    }
    // Used now: the last to go.
    // SAFETY: futimens with null times sets both to now on a descriptor we own.
    unsafe { libc::futimens(file.as_raw_fd(), std::ptr::null()) };
    // Shared while in use: by this job's every process (the descriptor is passed
    // on), and by another job's on the node reading it too.
    lock(&file, libc::LOCK_SH).map_err(|source| io("lock", &path, source))?;
    evict(dir, bound, &path);
    Ok((file, reused))
}

fn io(what: &'static str, path: &Path, source: std::io::Error) -> NotKept {
    NotKept::Io {
        what,
        path: path.to_owned(),
        source,
    }
}

/// Makes the copy whole for a later job: its data on the disk first, then the mark.
pub fn seal(board: &Board) {
    let file = board.file();
    // SAFETY: fdatasync on a descriptor the board holds.
    if unsafe { libc::fdatasync(file.as_raw_fd()) } == 0 {
        board.seal();
    }
}

fn try_lock(file: &File, how: i32) -> bool {
    // SAFETY: flock on a descriptor we own.
    unsafe { libc::flock(file.as_raw_fd(), how) == 0 }
}

fn lock(file: &File, how: i32) -> std::io::Result<()> {
    loop {
        // SAFETY: flock on a descriptor we own.
        if unsafe { libc::flock(file.as_raw_fd(), how) } == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Removes the least recently used copies no process holds until those left take at
/// most `bound` bytes; `keep` stays whatever its age.
fn evict(dir: &Path, bound: u64, keep: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut copies: Vec<(std::time::SystemTime, u64, PathBuf)> = entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(PREFIX))
        .filter_map(|e| {
            let m = e.metadata().ok()?;
            Some((m.modified().ok()?, m.len(), e.path()))
        })
        .collect();
    let mut total: u64 = copies.iter().map(|c| c.1).sum();
    copies.sort();
    for (_, len, path) in copies {
        if total <= bound {
            break;
        }
        if path == keep {
            continue;
        }
        let Ok(f) = File::open(&path) else {
            continue;
        };
        // SAFETY: flock on a descriptor we own; LOCK_NB: a copy in use is skipped.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            continue;
        }
        if std::fs::remove_file(&path).is_ok() {
            tracing::info!(
                "removed the kept copy {} ({:.1} GB): the copies would take more than \
                 --keep allows",
                path.display(),
                len as f64 / 1e9
            );
            total -= len;
        }
    }
}
