//! Where a copy goes, decided for the whole node: in memory (a memfd) when it fits in 75%
//! of the memory the job may fill (the preload's rule), else in a nameless file on
//! `--stage-dir`, else nowhere. Its room is reserved at once (fallocate) under a
//! node-wide lock, so the kernel's own counters (MemAvailable, the cgroup's usage, the
//! disk's free blocks) show it to the next process that decides: concurrent starts on a
//! node never promise the same memory twice.

use crate::source::scratch;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// The node-wide lock ([`crate::node::NodeLock`]) under which copies are placed.
pub const LOCK: &str = "place";

/// Where the copy went, for the log.
pub enum Placed {
    Memory,
    Disk(std::path::PathBuf),
}

/// Why a copy has no place on the node.
#[derive(Debug, thiserror::Error)]
pub enum NoRoom {
    #[error("cannot use {}", .0.display())]
    Unusable(PathBuf),
    #[error(
        "{:.1} GB fits neither in {in_memory} nor in {} ({:.1} GB free); give --stage-dir a \
         node-local disk with room",
        *size as f64 / 1e9,
        dir.display(),
        *free as f64 / 1e9
    )]
    Full {
        size: u64,
        /// `the 12.3 GB the job may fill`, or `memory` when that is unknown.
        in_memory: String,
        dir: PathBuf,
        free: u64,
    },
    #[error("cannot create a file in {}: {source}", dir.display())]
    Create {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot reserve room in {}: {source}", dir.display())]
    Reserve {
        dir: PathBuf,
        source: std::io::Error,
    },
}

/// A file of `size` bytes, its room taken, and where it is; the error says why there
/// is none. The caller holds the node's lock on placing ([`LOCK`]).
pub fn place(size: u64, dir: Option<&Path>) -> Result<(File, Placed), NoRoom> {
    let free = crate::memory::available_now();
    let fits = free.is_none_or(|free| (size as f64) < free as f64 * 0.75);
    if fits {
        if let Ok(file) = scratch::memfd() {
            if reserve(&file, size).is_ok() {
                return Ok((file, Placed::Memory));
            }
        }
    }
    let dir = dir.map_or_else(scratch::default_dir, Path::to_owned);
    let Some(room) = free_bytes(&dir) else {
        return Err(NoRoom::Unusable(dir));
    };
    let in_memory = match free {
        Some(f) => format!("the {:.1} GB the job may fill", f as f64 / 1e9),
        None => "memory".into(),
    };
    if room < size.saturating_add(1 << 30) {
        return Err(NoRoom::Full {
            size,
            in_memory,
            dir,
            free: room,
        });
    }
    let file = match scratch::temp_file(&dir) {
        Ok(file) => file,
        Err(source) => return Err(NoRoom::Create { dir, source }),
    };
    if let Err(source) = reserve(&file, size) {
        return Err(NoRoom::Reserve { dir, source });
    }
    Ok((file, Placed::Disk(dir)))
}

/// Allocates `size` bytes of `file`, where the file system can (else only its length).
pub fn reserve(file: &File, size: u64) -> std::io::Result<()> {
    // SAFETY: fallocate on a descriptor we own.
    let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, size as libc::off_t) };
    if rc == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
        return file.set_len(size);
    }
    Err(e)
}

fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs writes one struct, zero-initialised here, for a valid C string.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    (unsafe { libc::statvfs(c.as_ptr(), &mut st) } == 0)
        .then(|| st.f_bavail as u64 * st.f_frsize as u64)
}
