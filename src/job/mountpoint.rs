//! The mount point: checks before mounting, recovery of stale mounts, and unmounting
//! with a lazy fallback, as root through umount2(2) and otherwise through fusermount3.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// What `prepare` did, so the caller can undo it.
#[derive(Debug)]
pub struct Prepared {
    pub path: PathBuf,
    /// The directory did not exist and was created; remove it after unmounting.
    pub created: bool,
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Why a path cannot be mounted on, and what to do.
#[derive(Debug, thiserror::Error)]
pub enum Unusable {
    #[error(
        "{} is a stale mount (\"Transport endpoint is not connected\") and unmounting it \
         failed: {source}; run `fusermount3 -u -z {}`",
        path.display(),
        path.display()
    )]
    Stale { path: PathBuf, source: io::Error },
    #[error(
        "mount point {} is not a directory; give an empty directory (or a path that does \
         not exist yet)",
        .0.display()
    )]
    NotDir(PathBuf),
    #[error(
        "{} is already a mount point; unmount it first with `archfs unmount {}`",
        .0.display(),
        .0.display()
    )]
    Mounted(PathBuf),
    #[error(
        "mount point {} is not empty; mount on an empty directory so nothing is hidden",
        .0.display()
    )]
    NotEmpty(PathBuf),
    /// It cannot be created, looked at, resolved or listed.
    #[error("cannot {what} mount point {}: {source}", path.display())]
    Io {
        /// `create`, `use`, `resolve`, `read`.
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
}

/// Makes `path` ready to mount on: recovers a stale FUSE mount left by a crashed server,
/// creates a missing directory, and refuses a file, a live mount or a non-empty directory.
pub fn prepare(path: &Path) -> Result<Prepared, Unusable> {
    let failed = |what, source| Unusable::Io {
        what,
        path: path.to_owned(),
        source,
    };
    let mut created = false;
    match std::fs::metadata(path) {
        Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => {
            tracing::warn!("{} is a stale mount; unmounting it first", path.display());
            lazy_unmount(path).map_err(|source| Unusable::Stale {
                path: path.to_owned(),
                source,
            })?;
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            std::fs::create_dir_all(path).map_err(|e| failed("create", e))?;
            created = true;
        }
        Err(e) => return Err(failed("use", e)),
        Ok(m) if !m.is_dir() => return Err(Unusable::NotDir(path.to_owned())),
        Ok(_) => {}
    }
    let path = std::fs::canonicalize(path).map_err(|e| failed("resolve", e))?;
    if is_mount_point(&path) {
        return Err(Unusable::Mounted(path));
    }
    let mut entries = std::fs::read_dir(&path).map_err(|source| Unusable::Io {
        what: "read",
        path: path.clone(),
        source,
    })?;
    if entries.next().is_some() {
        return Err(Unusable::NotEmpty(path));
    }
    Ok(Prepared { path, created })
}

/// Whether `path` (canonical) is listed in this process's mount table.
pub fn is_mount_point(path: &Path) -> bool {
    entry(path).is_some()
}

/// One mount in the mount table: its mount ID and device. The pair names that mount and
/// no other while it exists, so a later mount on the same path is never mistaken for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountId {
    id: Vec<u8>,
    dev: Vec<u8>,
}

/// The topmost mount on `path` (canonical), if any.
pub fn entry(path: &Path) -> Option<MountId> {
    let table = std::fs::read("/proc/self/mountinfo").ok()?;
    let want = path.as_os_str().as_bytes();
    table.rsplit(|&b| b == b'\n').find_map(|line| {
        let f: Vec<&[u8]> = line.split(|&b| b == b' ').take(5).collect();
        (f.len() == 5 && unescape(f[4]) == want).then(|| MountId {
            id: f[0].to_vec(),
            dev: f[2].to_vec(),
        })
    })
}

/// Whether the mount `id` on `path` is still in the mount table.
pub fn is_live(path: &Path, id: &MountId) -> bool {
    let Ok(table) = std::fs::read("/proc/self/mountinfo") else {
        return false;
    };
    let want = path.as_os_str().as_bytes();
    table.split(|&b| b == b'\n').any(|line| {
        let f: Vec<&[u8]> = line.split(|&b| b == b' ').take(5).collect();
        f.len() == 5 && f[0] == id.id && f[2] == id.dev && unescape(f[4]) == want
    })
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape(field: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(field.len());
    let mut i = 0;
    while i < field.len() {
        if field[i] == b'\\' && i + 3 < field.len() {
            let oct = &field[i + 1..i + 4];
            if oct.iter().all(|c| (b'0'..=b'7').contains(c)) {
                out.push((oct[0] - b'0') * 64 + (oct[1] - b'0') * 8 + (oct[2] - b'0'));
                i += 4;
                continue;
            }
        }
        out.push(field[i]);
        i += 1;
    }
    out
}

fn cpath(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains NUL"))
}

fn fusermount(args: &[&str], path: &Path) -> io::Result<()> {
    let mut last = None;
    for prog in ["fusermount3", "fusermount"] {
        match Command::new(prog).args(args).arg(path).output() {
            Ok(out) if out.status.success() => return Ok(()),
            Ok(out) => {
                let msg = String::from_utf8_lossy(&out.stderr)
                    .trim()
                    .replace('\n', " ");
                return Err(io::Error::other(format!(
                    "{prog} {} failed: {msg}",
                    args.join(" ")
                )));
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(fusermount_missing(last))
}

/// The error for neither fusermount3 nor fusermount on PATH, with what to install.
pub fn fusermount_missing(last: Option<io::Error>) -> io::Error {
    io::Error::new(
        io::ErrorKind::NotFound,
        format!(
            "fusermount3 is not installed ({}); install the fuse3 package",
            last.map(|e| e.to_string()).unwrap_or_default()
        ),
    )
}

/// Detaches the mount now; the kernel finishes it once the last open file is closed.
pub fn lazy_unmount(path: &Path) -> io::Result<()> {
    if is_root() {
        let c = cpath(path)?;
        // SAFETY: c is a valid NUL-terminated path.
        if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } == 0 {
            return Ok(());
        }
        return Err(io::Error::last_os_error());
    }
    fusermount(&["-u", "-z"], path)
}

/// The servers of the mount on `path` (canonical), found in /proc as the parents of its
/// watchdogs (`archfs __watchdog PATH`, started with the canonical path), whatever the
/// server's own command line says. `archfs unmount` waits for them, so the mount point a
/// server created is gone when the command returns.
pub fn servers_of(path: &Path) -> Vec<i32> {
    helpers_of(b"__watchdog", path)
        .into_iter()
        .filter_map(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| s.rsplit_once(") ")?.1.split(' ').nth(1)?.parse().ok())
        })
        .collect()
}

/// The processes listing the mount on `path` (canonical) ahead (`archfs __prelist PATH`,
/// src/warm/prelist.rs).
pub fn listers_of(path: &Path) -> Vec<i32> {
    helpers_of(b"__prelist", path)
}

/// Processes started as `archfs TAG PATH ...`.
fn helpers_of(tag: &[u8], path: &Path) -> Vec<i32> {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let want = path.as_os_str().as_bytes();
    let mut pids = Vec::new();
    for e in procs.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
        if args.get(1) == Some(&tag) && args.get(2) == Some(&want) {
            pids.push(pid);
        }
    }
    pids
}

/// Waits up to `timeout` for the processes to end with every thread: a process whose
/// first thread is a zombie while another is still blocked in a FUSE request keeps its
/// open files, and so keeps a mount busy.
pub fn wait_for_end(pids: &[i32], timeout: std::time::Duration) {
    let threads =
        |pid: i32| std::fs::read_dir(format!("/proc/{pid}/task")).map_or(0, |d| d.count());
    let end = std::time::Instant::now() + timeout;
    while pids
        .iter()
        .any(|&p| start_time(p).is_some() || threads(p) > 1)
        && std::time::Instant::now() < end
    {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// The start time of a live (not zombie) process, in clock ticks since boot.
pub fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.rsplit_once(") ")?.1;
    if rest.starts_with('Z') || rest.starts_with('X') {
        return None;
    }
    // Field 22 of stat; `rest` starts at field 3.
    rest.split(' ').nth(19)?.parse().ok()
}

/// How an unmount went: at once, or detached while files stay open.
#[derive(Debug, PartialEq, Eq)]
pub enum Unmounted {
    Now,
    Lazily,
}

/// Unmounts `path`; if that fails while the mount is still there (files open: EBUSY, or
/// anything else), detaches it lazily. Decided by the mount table, never by a tool's
/// message: `fusermount3 -u` says nothing useful when the mount is busy.
pub fn unmount(path: &Path) -> io::Result<Unmounted> {
    let plain = if is_root() {
        let c = cpath(path)?;
        // SAFETY: c is a valid NUL-terminated path.
        if unsafe { libc::umount2(c.as_ptr(), 0) } == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    } else {
        fusermount(&["-u"], path)
    };
    match plain {
        Ok(()) => Ok(Unmounted::Now),
        Err(_) if !is_mount_point(path) => Ok(Unmounted::Now),
        Err(plain) => match lazy_unmount(path) {
            Ok(()) => Ok(Unmounted::Lazily),
            Err(_) if !is_mount_point(path) => Ok(Unmounted::Lazily),
            Err(lazy) => Err(io::Error::new(lazy.kind(), format!("{plain}; then {lazy}"))),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unescapes_mountinfo_paths() {
        assert_eq!(unescape(br"/tmp/a\040b"), b"/tmp/a b");
        assert_eq!(unescape(br"/x\134y"), b"/x\\y");
        assert_eq!(unescape(br"/end\04"), br"/end\04");
    }

    #[test]
    fn root_is_a_mount_point() {
        assert!(is_mount_point(Path::new("/")));
        assert!(!is_mount_point(Path::new("/definitely/not/mounted")));
    }
}
