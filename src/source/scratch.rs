//! Nameless node-local files for copies of an archive (a decoded compressed tar, an
//! object copied from storage): a memfd, or a file unlinked as soon as it is made, so
//! the copy goes with the process however it ends.

use std::fs::File;
use std::os::fd::FromRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

/// Where a copy goes when none is given: `$TMPDIR`, else `/tmp`.
pub fn default_dir() -> PathBuf {
    std::env::var_os("TMPDIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/tmp"))
}

/// An anonymous in-memory file. Called through `syscall`: glibc's wrapper is 2.27+.
pub fn memfd() -> std::io::Result<File> {
    // SAFETY: a NUL-terminated name and flags; the result is checked.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_memfd_create,
            c"archfs-stage".as_ptr(),
            libc::MFD_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a new descriptor that nothing else owns.
    Ok(unsafe { File::from_raw_fd(fd as i32) })
}

/// A file in `dir` nobody else can open, gone when the process exits.
pub fn temp_file(dir: &Path) -> std::io::Result<File> {
    static N: AtomicU32 = AtomicU32::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let path = dir.join(format!(".archfs-stage-{}-{n}", std::process::id()));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)?;
    let _ = std::fs::remove_file(&path);
    Ok(file)
}
