//! A live mount: the checks before it, the FUSE session attached to the mount point and
//! served by threads of this process, its watchdog, the listing ahead, and its unmount.

use std::os::fd::{AsFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::sync::mpsc::Sender;
use std::sync::Arc;

use fuser::{Config, Session, SessionACL};

use super::mountpoint::{self, Prepared};
use super::watchdog::Watchdog;
use super::{attach, Event, JobError, Prelist, Settings};
use crate::archive::Archive;
use crate::fuse::ArchFs;
use crate::vfs::{Readdirplus, Vfs};
use crate::warm::prelist::{self, Lister};
use crate::warm::preload::Trigger;
use crate::warm::push::Pusher;

/// A live mount served by threads of this process, with its watchdog.
pub struct Mount {
    prepared: Prepared,
    watchdog: Option<Watchdog>,
    /// The listing ahead is wanted, and with --debug or not.
    list_ahead: Option<bool>,
    ahead: Arc<prelist::ListerPid>,
    lister: Option<Lister>,
}

/// Whether the kernel gives each request thread a descriptor of its own for the session
/// on `dev` (`FUSE_DEV_IOC_CLONE`, Linux 4.5): tried once here, as libfuse does. Kernels
/// before it (the RHEL 7 family) and qemu-user answer ENOSYS, ENOTTY or EINVAL; the
/// threads then share the one descriptor.
fn clones_descriptors(dev: BorrowedFd<'_>) -> bool {
    use std::os::fd::AsRawFd;
    /// `_IOR(229, 0, uint32_t)`, from linux/fuse.h.
    const FUSE_DEV_IOC_CLONE: libc::c_ulong = 0x8004_e500;
    let probe = match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
    {
        Ok(f) => f,
        Err(e) => {
            tracing::warn!("request threads share one FUSE descriptor: /dev/fuse: {e}");
            return false;
        }
    };
    let mut source = dev.as_raw_fd() as u32;
    // SAFETY: the ioctl reads one u32 (the descriptor to clone) from `source`; `probe` is
    // an open /dev/fuse, closed when it drops (a clone is then just let go).
    let rc = unsafe { libc::ioctl(probe.as_raw_fd(), FUSE_DEV_IOC_CLONE as _, &mut source) };
    tracing::debug!(
        "page size {} bytes; FUSE descriptor clone: {}",
        crate::memory::page_size(),
        if rc == 0 { "yes" } else { "no" }
    );
    if rc == 0 {
        return true;
    }
    let e = std::io::Error::last_os_error();
    tracing::warn!(
        "this kernel cannot clone FUSE descriptors ({e}): the request threads share one, \
         as libfuse does there"
    );
    false
}

impl Mount {
    /// Mounts `archive` on `s.mountpoint` and starts serving it; `events` gets
    /// `Event::Unmounted` when the filesystem is unmounted from outside.
    pub fn new(
        archive: Arc<dyn Archive>,
        s: &Settings,
        trigger: Option<Arc<Trigger>>,
        push: Option<Arc<Pusher>>,
        events: Sender<Event>,
    ) -> Result<Mount, JobError> {
        if !Path::new("/dev/fuse").exists() {
            return Err(JobError::NoFuse);
        }
        if !mountpoint::is_root() && which("fusermount3").is_none() && which("fusermount").is_none()
        {
            return Err(JobError::NoFusermount);
        }
        let fsname = std::fs::canonicalize(&s.archives[0])
            .unwrap_or_else(|_| s.archives[0].clone())
            .to_string_lossy()
            .replace([',', ' '], "_");
        let mut config = Config::default();
        config.n_threads = Some(s.threads.max(1));
        let acl = if s.allow_other {
            SessionACL::All
        } else {
            SessionACL::Owner
        };
        let (inodes, available) = (archive.stats().inodes, crate::memory::available());
        let wanted = s.prelist == Prelist::Auto && s.readdirplus == Readdirplus::Always;
        let list_ahead = wanted && prelist::fits(inodes, available);
        if wanted && !list_ahead {
            tracing::info!(
                "not listing ahead: the kernel's inodes for {inodes} entries would take more \
                 than a quarter of the memory available ({} MiB); the job's listings carry \
                 the attributes of what they list instead",
                available.unwrap_or(0) >> 20
            );
        }
        let ahead = prelist::ListerPid::new();
        if let (true, Some(p)) = (list_ahead, &push) {
            p.expect_whole_tree();
        }
        // A second try covers the mount point vanishing between the checks and mount(2):
        // the server of a previous mount removing the directory it had created.
        let mut attempt = 0;
        let (session, prepared, mut watchdog) = loop {
            let prepared = mountpoint::prepare(&s.mountpoint)?;
            let watchdog = Watchdog::spawn(&prepared.path, prepared.created)
                .map_err(|e| JobError::system("start the unmount watchdog", e))?;
            let fs = ArchFs::new(
                Vfs::new(archive.clone(), trigger.clone())
                    .with_push(push.clone())
                    .with_readdirplus(s.readdirplus, list_ahead.then(|| ahead.clone())),
            );
            let session = attach::mount(&prepared.path, &fsname, s.allow_other).and_then(|fd| {
                let mut config = config.clone();
                config.clone_fd = clones_descriptors(fd.as_fd());
                Session::from_fd(fs, fd, acl, config).inspect_err(|_| {
                    let _ = mountpoint::lazy_unmount(&prepared.path);
                })
            });
            match session {
                Ok(session) => break (session, prepared, watchdog),
                Err(e) => {
                    watchdog.disarm();
                    if prepared.created {
                        let _ = std::fs::remove_dir(&prepared.path);
                    }
                    attempt += 1;
                    if attempt < 2 && e.kind() == std::io::ErrorKind::NotFound {
                        continue;
                    }
                    return Err(explain_mount_error(&prepared.path, s.allow_other, e));
                }
            }
        };
        watchdog.arm();
        if let Some(p) = &push {
            match session.as_fd().try_clone_to_owned() {
                Ok(dev) => p.set_store(Box::new(crate::fuse::store::DevStore::new(dev))),
                Err(e) => tracing::warn!("not pushing files into the page cache: {e}"),
            }
        }
        std::thread::Builder::new()
            .name("archfs-session".into())
            .spawn(move || {
                if let Err(e) = session.run() {
                    tracing::error!("FUSE session ended with an error: {e}");
                }
                let _ = events.send(Event::Unmounted);
            })
            .map_err(|e| JobError::system("start the FUSE session", e))?;
        Ok(Mount {
            prepared,
            watchdog: Some(watchdog),
            list_ahead: list_ahead.then_some(s.debug),
            ahead,
            lister: None,
        })
    }

    pub fn path(&self) -> &Path {
        &self.prepared.path
    }

    /// Starts the listing ahead ([`prelist`]) if wanted, with stderr at /dev/null when
    /// `quiet`, else this process's. Never the terminal's or a pipe of a background
    /// server's caller: one that captures the mount's stderr (Python's `archfs.mount`)
    /// waits until every copy is closed.
    pub fn start_listing(&mut self, quiet: bool) {
        if let Some(debug) = self.list_ahead.take() {
            self.lister = Lister::spawn(self.path(), &self.ahead, debug, quiet)
                .inspect_err(|e| tracing::warn!("cannot start the listing process: {e}"))
                .ok();
        }
    }

    /// Unmounts (lazily if files are still open), stops the watchdog and removes the
    /// mount point if it was created for this mount.
    pub fn unmount(mut self) -> Result<(), JobError> {
        // First, while the mount is served: the lister's open directories would make
        // the unmount lazy.
        if let Some(l) = self.lister.take() {
            l.stop();
        }
        let path = self.prepared.path.clone();
        let result = mountpoint::unmount(&path)
            .map(drop)
            .map_err(|source| JobError::UnmountAtEnd { path, source });
        self.finish();
        result
    }

    /// The filesystem is unmounted: stop the watchdog (which detaches the mount itself if
    /// it is somehow still there) and remove a mount point made for it.
    pub fn finish(&mut self) {
        if let Some(l) = self.lister.take() {
            l.stop();
        }
        if let Some(w) = self.watchdog.take() {
            w.disarm();
        }
        if self.prepared.created {
            let _ = std::fs::remove_dir(&self.prepared.path);
        }
        if let Some((requests, bytes)) = crate::source::remote_totals() {
            tracing::info!(
                "object storage: {requests} requests, {:.1} MB fetched",
                bytes as f64 / 1e6
            );
        }
    }
}

fn explain_mount_error(path: &Path, allow_other: bool, e: std::io::Error) -> JobError {
    let msg = e.to_string().trim().replace('\n', " ");
    let hint = if allow_other && !mountpoint::is_root() {
        " (allow_other needs `user_allow_other` in /etc/fuse.conf)"
    } else if msg.contains("no write access") {
        "; mount on a directory you own, e.g. /dev/shm/$USER/mnt"
    } else if e.kind() == std::io::ErrorKind::PermissionDenied {
        " (you may not use /dev/fuse here: check its permissions or ask the administrator)"
    } else {
        ""
    };
    JobError::Mount {
        path: path.to_owned(),
        said: msg,
        hint,
    }
}

fn which(prog: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join(prog))
        .find(|p| p.is_file())
}
