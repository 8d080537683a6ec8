//! `--shared`: one mount per node for all ranks of a job. Each rank registers itself in a
//! directory beside the mount point; the first mounts while holding a lock the others
//! wait on, so no rank sees a half-ready mount; the server unmounts once every registered
//! rank has left or died (SIGKILL included: a dead rank's entry names a process that no
//! longer exists).

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use super::mountpoint::start_time;

/// The registry of one shared mount point: `.NAME.archfs-shared/` beside it, holding
/// `lock` and one `PID-STARTTIME` file per rank (the start time tells a reused pid apart).
pub struct Registry {
    dir: PathBuf,
}

/// The registry's lock, held until dropped.
#[derive(Debug)]
pub struct Locked(#[allow(dead_code)] File);

impl Registry {
    pub fn of(mountpoint: &Path) -> Registry {
        let name = mountpoint
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let parent = mountpoint.parent().unwrap_or(Path::new("/"));
        Registry {
            dir: parent.join(format!(".{name}.archfs-shared")),
        }
    }

    /// Waits for the registry's lock: whoever holds it may mount, join, leave or
    /// unmount without anyone else seeing a state in between.
    pub fn lock(&self) -> io::Result<Locked> {
        std::fs::create_dir_all(&self.dir).map_err(|e| self.error("create", e))?;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(self.dir.join("lock"))
            .map_err(|e| self.error("open", e))?;
        loop {
            // SAFETY: flock on a descriptor we own.
            if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } == 0 {
                return Ok(Locked(f));
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(self.error("lock", e));
            }
        }
    }

    fn error(&self, what: &str, e: io::Error) -> io::Error {
        io::Error::new(
            e.kind(),
            format!(
                "cannot {what} the shared-mount registry {}: {e}",
                self.dir.display()
            ),
        )
    }

    fn entry(&self, pid: i32) -> io::Result<PathBuf> {
        let start = start_time(pid).ok_or_else(|| {
            io::Error::other(format!("there is no process {pid} to share the mount"))
        })?;
        Ok(self.dir.join(format!("{pid}-{start}")))
    }

    /// Registers process `pid` as a user of the mount (under the lock).
    pub fn join(&self, _lock: &Locked, pid: i32) -> io::Result<()> {
        File::create(self.entry(pid)?).map(drop)
    }

    /// Removes process `pid` (under the lock).
    pub fn leave(&self, _lock: &Locked, pid: i32) {
        if let Ok(entry) = self.entry(pid) {
            let _ = std::fs::remove_file(entry);
        }
    }

    /// Drops the entries of processes that have ended; returns how many are left (under
    /// the lock).
    pub fn live_users(&self, _lock: &Locked) -> usize {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return 0;
        };
        let mut live = 0;
        for e in entries.flatten() {
            let name = e.file_name();
            let Some((pid, start)) = name.to_str().and_then(|n| n.split_once('-')) else {
                continue;
            };
            let alive = pid
                .parse()
                .ok()
                .and_then(start_time)
                .is_some_and(|s| s.to_string() == start);
            if alive {
                live += 1;
            } else {
                let _ = std::fs::remove_file(e.path());
            }
        }
        live
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dead_or_reused_pid_is_no_user() {
        let dir = std::env::temp_dir().join(format!("archfs-shared-unit-{}", std::process::id()));
        let reg = Registry::of(&dir.join("mnt"));
        let lock = reg.lock().unwrap();
        let me = std::process::id() as i32;
        reg.join(&lock, me).unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id() as i32;
        let _ = reg.join(&lock, pid);
        child.wait().unwrap();
        std::fs::write(reg.dir.join(format!("{me}-1")), b"").unwrap(); // our pid, reused
        assert_eq!(reg.live_users(&lock), 1);
        reg.leave(&lock, me);
        assert_eq!(reg.live_users(&lock), 0);
        drop(lock);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
