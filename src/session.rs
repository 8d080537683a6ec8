//! Serving a mount: the FUSE threads, the signals that end it, and the watchdog that
//! unmounts when this process dies without a chance to do so itself.

use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;

use fuser::{Config, Session, SessionACL};

use crate::archive::Archive;
use crate::fuse::ArchFs;
use crate::fuse_mount;
use crate::mountpoint::{self, Prepared};
use crate::preload::Trigger;
use crate::vfs::Vfs;

/// Settings of one mount.
#[derive(Clone, Debug)]
pub struct MountConfig {
    pub threads: usize,
    pub allow_other: bool,
    /// Name shown as the mount's source in /proc/mounts.
    pub fsname: String,
    /// `--preload=auto`: starts the preload once reads show a job reading the dataset.
    pub preload: Option<Arc<Trigger>>,
}

/// Something the serving loop must react to.
#[derive(Debug)]
pub enum Event {
    /// SIGTERM, SIGINT or SIGHUP; `from_process` is false when the terminal sent it (the
    /// whole foreground process group got it already).
    Signal { signo: i32, from_process: bool },
    /// The FUSE session ended: someone unmounted the filesystem.
    Ended,
    /// The command under `archfs run` exited.
    Exited(std::process::ExitStatus),
}

const SIGNALS: [i32; 3] = [libc::SIGTERM, libc::SIGINT, libc::SIGHUP];

fn signal_set() -> libc::sigset_t {
    // SAFETY: sigemptyset/sigaddset initialise and fill a plain sigset_t.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in SIGNALS {
            libc::sigaddset(&mut set, s);
        }
        set
    }
}

/// Blocks the ending signals in this thread and every thread it spawns later; call it
/// before any thread exists. Children started by `std::process::Command` get a clean mask.
pub fn block_signals() {
    let set = signal_set();
    // SAFETY: set is initialised; a null old-set pointer is allowed.
    unsafe {
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

/// Delivers blocked ending signals as events, with whether a process sent them.
pub fn events() -> (Sender<Event>, Receiver<Event>) {
    let (tx, rx) = channel();
    let signal_tx = tx.clone();
    std::thread::Builder::new()
        .name("archfs-signals".into())
        .spawn(move || loop {
            let set = signal_set();
            // SAFETY: set is initialised and blocked; info is written by the kernel.
            let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
            let signo = unsafe { libc::sigwaitinfo(&set, &mut info) };
            if signo < 0 {
                continue;
            }
            let from_process = info.si_code == libc::SI_USER || info.si_code == libc::SI_QUEUE;
            if signal_tx
                .send(Event::Signal {
                    signo,
                    from_process,
                })
                .is_err()
            {
                return;
            }
        })
        .expect("spawn signal thread");
    (tx, rx)
}

/// A separate process that lazily unmounts if this one dies (SIGKILL, crash, OOM) while
/// the mount is live, so no "Transport endpoint is not connected" mount is left. It works
/// for ordinary users, who cannot use fuse's auto_unmount without allow_other.
struct Watchdog {
    stdin: ChildStdin,
    child: Child,
}

impl Watchdog {
    /// Started before mounting so it cannot inherit the /dev/fuse descriptor (it would
    /// keep a dead server's connection alive).
    fn spawn(path: &Path, remove_dir: bool) -> std::io::Result<Watchdog> {
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.arg("__watchdog").arg(path);
        if remove_dir {
            cmd.arg("--remove-dir");
        }
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: setsid is async-signal-safe; a new session keeps the terminal's Ctrl-C
        // and the job's process-group signals from reaching the watchdog.
        unsafe {
            cmd.pre_exec(|| {
                libc::setsid();
                Ok(())
            });
        }
        let mut child = cmd.spawn()?;
        let stdin = child.stdin.take().expect("piped stdin");
        Ok(Watchdog { stdin, child })
    }

    fn arm(&mut self) {
        let _ = self.stdin.write_all(b"m");
    }

    fn disarm(mut self) {
        let _ = self.stdin.write_all(b"x");
        drop(self.stdin);
        let _ = self.child.wait();
    }
}

/// The watchdog process: `m` arms it, `x` ends it, end of input while armed unmounts.
pub fn watchdog_main(path: &Path, remove_dir: bool) -> i32 {
    for s in SIGNALS {
        // SAFETY: ignoring a signal has no preconditions.
        unsafe {
            libc::signal(s, libc::SIG_IGN);
        }
    }
    let mut armed = false;
    let mut byte = [0u8; 1];
    let mut stdin = std::io::stdin().lock();
    loop {
        match stdin.read(&mut byte) {
            Ok(1) if byte[0] == b'm' => armed = true,
            Ok(1) if byte[0] == b'x' => return 0,
            Ok(1) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            _ => break,
        }
    }
    if armed {
        let _ = mountpoint::lazy_unmount(path);
        if remove_dir {
            let _ = std::fs::remove_dir(path);
        }
    }
    0
}

/// A live mount served by threads of this process.
pub struct Mount {
    prepared: Prepared,
    watchdog: Option<Watchdog>,
}

/// Mounts `archive` on `path` and starts serving it; `events` gets `Event::Ended` when
/// the filesystem is unmounted from outside.
pub fn mount(
    archive: Arc<dyn Archive>,
    path: &Path,
    cfg: &MountConfig,
    events: Sender<Event>,
) -> Result<Mount, String> {
    if !Path::new("/dev/fuse").exists() {
        return Err(
            "/dev/fuse is missing: this machine has no FUSE support loaded \
                    (ask the administrator to `modprobe fuse`)"
                .into(),
        );
    }
    if !mountpoint::is_root() && which("fusermount3").is_none() && which("fusermount").is_none() {
        return Err(
            "fusermount3 is not installed, and ordinary users need it to mount FUSE \
             filesystems; install the fuse3 package"
                .into(),
        );
    }
    let mut config = Config::default();
    config.n_threads = Some(cfg.threads.max(1));
    config.clone_fd = true;
    let acl = if cfg.allow_other {
        SessionACL::All
    } else {
        SessionACL::Owner
    };

    // A second try covers the mount point vanishing between the checks and mount(2):
    // the server of a previous mount removing the directory it had created.
    let mut attempt = 0;
    let (session, prepared, mut watchdog) = loop {
        let prepared = mountpoint::prepare(path)?;
        let watchdog = Watchdog::spawn(&prepared.path, prepared.created)
            .map_err(|e| format!("cannot start the unmount watchdog: {e}"))?;
        let fs = ArchFs::new(Vfs::new(archive.clone(), cfg.preload.clone()));
        let session =
            fuse_mount::mount(&prepared.path, &cfg.fsname, cfg.allow_other).and_then(|fd| {
                Session::from_fd(fs, fd, acl, config.clone()).inspect_err(|_| {
                    let _ = mountpoint::lazy_unmount(&prepared.path);
                })
            });
        match session {
            Ok(s) => break (s, prepared, watchdog),
            Err(e) => {
                watchdog.disarm();
                if prepared.created {
                    let _ = std::fs::remove_dir(&prepared.path);
                }
                attempt += 1;
                if attempt < 2 && e.kind() == std::io::ErrorKind::NotFound {
                    continue;
                }
                return Err(explain_mount_error(&prepared.path, cfg, e));
            }
        }
    };
    watchdog.arm();
    std::thread::Builder::new()
        .name("archfs-session".into())
        .spawn(move || {
            if let Err(e) = session.run() {
                tracing::error!("FUSE session ended with an error: {e}");
            }
            let _ = events.send(Event::Ended);
        })
        .map_err(|e| format!("cannot start the FUSE session: {e}"))?;
    Ok(Mount {
        prepared,
        watchdog: Some(watchdog),
    })
}

fn explain_mount_error(path: &Path, cfg: &MountConfig, e: std::io::Error) -> String {
    let msg = e.to_string().trim().replace('\n', " ");
    let hint = if cfg.allow_other && !mountpoint::is_root() {
        " (allow_other needs `user_allow_other` in /etc/fuse.conf)"
    } else if msg.contains("no write access") {
        "; mount on a directory you own, e.g. /dev/shm/$USER/mnt"
    } else if e.kind() == std::io::ErrorKind::PermissionDenied {
        " (you may not use /dev/fuse here: check its permissions or ask the administrator)"
    } else {
        ""
    };
    format!("cannot mount on {}: {msg}{hint}", path.display())
}

impl Mount {
    pub fn path(&self) -> &Path {
        &self.prepared.path
    }

    /// Unmounts (lazily if files are still open), stops the watchdog and removes the
    /// mount point if it was created for this mount.
    pub fn unmount(mut self) -> Result<(), String> {
        let result = match mountpoint::unmount(&self.prepared.path) {
            Ok(_) => Ok(()),
            // Already gone: unmounted from outside.
            Err(_) if !mountpoint::is_mount_point(&self.prepared.path) => Ok(()),
            Err(e) => Err(format!(
                "cannot unmount {}: {e}; try `fusermount3 -u -z {}`",
                self.prepared.path.display(),
                self.prepared.path.display()
            )),
        };
        self.finish();
        result
    }

    /// The filesystem is already unmounted: clean up after it.
    pub fn finish(&mut self) {
        if let Some(w) = self.watchdog.take() {
            w.disarm();
        }
        if self.prepared.created {
            let _ = std::fs::remove_dir(&self.prepared.path);
        }
    }
}

fn which(prog: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join(prog))
        .find(|p| p.is_file())
}
