//! Why a mount, a run or an unmount failed. Each says what to do; `main` prints it as the
//! one line of a failed command, and a background server sends it to the `archfs mount`
//! that started it.

use std::io;
use std::path::PathBuf;

use super::mountpoint::Unusable;

#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// The archives could not be opened.
    #[error(transparent)]
    Archive(#[from] crate::error::Error),
    /// The mount point cannot be mounted on.
    #[error(transparent)]
    MountPoint(#[from] Unusable),
    #[error("--index names the index of one archive; with several, each keeps its own")]
    IndexOfMany,
    #[error(
        "/dev/fuse is missing: this machine or container has no FUSE (ask the \
         administrator to `modprobe fuse`, or start the container with `--device \
         /dev/fuse`); from Python, read the archive without a mount: \
         `archfs.open_archive(ARCHIVE)` or `archfs.torch.ImageFolder(ARCHIVE)`"
    )]
    NoFuse,
    #[error(
        "fusermount3 is not installed, and ordinary users need it to mount FUSE \
         filesystems; install the fuse3 package"
    )]
    NoFusermount,
    /// mount(2) (or fusermount3) refused; `hint` says what usually causes it.
    #[error("cannot mount on {}: {said}{hint}", path.display())]
    Mount {
        path: PathBuf,
        /// The error, on one line.
        said: String,
        hint: &'static str,
    },
    /// `archfs unmount` of a path that is no mount.
    #[error("{} is not mounted", .0.display())]
    NotMounted(PathBuf),
    /// `archfs unmount` failed.
    #[error("cannot unmount {}: {source}", path.display())]
    Unmount { path: PathBuf, source: io::Error },
    /// The server's unmount as it ends failed.
    #[error(
        "cannot unmount {}: {source}; try `fusermount3 -u -z {}`",
        path.display(),
        path.display()
    )]
    UnmountAtEnd { path: PathBuf, source: io::Error },
    #[error("--exit-with {0}: there is no process {0}")]
    NoOwner(i32),
    /// The registry of a `--shared` mount (its errors name it), or its path.
    #[error(transparent)]
    Shared(io::Error),
    /// What the system would not do for the job: a pipe, a thread, a process, a file.
    #[error("cannot {what}: {source}")]
    System { what: String, source: io::Error },
    /// The background server's own error, relayed by the `archfs mount` that started it.
    #[error("{0}")]
    Server(String),
    #[error(
        "the server exited ({0}) before the mount was ready; run with --foreground \
         --debug to see why"
    )]
    ServerExited(String),
    #[error("lost track of the command")]
    LostCommand,
}

impl JobError {
    /// What the system would not do: `cannot {what}: {source}`.
    pub fn system(what: impl Into<String>, source: io::Error) -> JobError {
        JobError::System {
            what: what.into(),
            source,
        }
    }
}
