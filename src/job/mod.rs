//! The life of a mount in a job, top to bottom: `archfs mount` starting a background server
//! ([`mount_in_background`]), the server itself ([`serve`]), `archfs run` ([`run`]) and
//! `archfs unmount` ([`unmount`]), `--shared` mounts ([`mount_shared`], [`leave_shared`])
//! and where a mount point goes when none is given. Beside it, what they share: a live
//! [`Mount`] (`mount.rs`, attached by [`attach`] on a path [`mountpoint`] checked), its
//! `watchdog.rs` process, the `signals.rs` and watchers, the [`shared`] registry. The top
//! floor: imports the archive interface, [`crate::open`], [`crate::warm`] and [`crate::fuse`].
//!
//! Every way a job ends leaves no mount behind:
//! - SIGTERM, SIGINT or SIGHUP to the server: it unmounts, lazily if files are still open;
//! - the server killed (SIGKILL, a crash, the OOM killer): its watchdog process sees the
//!   pipe from the server close and detaches the mount;
//! - the server and its watchdog killed together: the next mount on the path recovers it;
//! - under `run`, the command ending in any way: `run` unmounts once it has ended, and
//!   meanwhile passes signals on to it, like an init wrapper (tini, dumb-init).

pub mod attach;
mod error;
mod mount;
pub mod mountpoint;
pub mod shared;
mod signals;
mod watchdog;

use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, ExitStatus, Stdio};
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::time::Duration;

use crate::archive::DecodeAhead;
use crate::cache::CacheConfig;
use crate::vfs::Readdirplus;

use crate::warm::preload::{self, Trigger};
use crate::warm::push::Pusher;
pub use error::JobError;
pub use mount::Mount;
use shared::{Locked, Registry};
use signals::{block_signals, reset_signals, watch_owner, watch_signals, watch_users};
pub use watchdog::watchdog_main;

/// What to mount and how; the command line fills it in.
#[derive(Clone, Debug)]
pub struct Settings {
    pub archives: Vec<PathBuf>,
    pub mountpoint: PathBuf,
    /// The mount point was chosen by [`default_mountpoint`], not given.
    pub auto_mountpoint: bool,
    /// One mount shared by the ranks registered in its [`Registry`].
    pub shared: bool,
    /// Bytes of decoded SquashFS blocks kept in memory.
    pub cache_size: u64,
    /// FUSE request threads.
    pub threads: usize,
    pub allow_other: bool,
    pub recursive: bool,
    /// Where a tar archive's index is kept (default: beside it, or the cache dir).
    pub index: Option<PathBuf>,
    /// Decoded bytes between a compressed tar's entry points.
    pub entry_spacing: u64,
    /// Where a decoded copy of a compressed tar goes when memory is short.
    pub stage_dir: Option<PathBuf>,
    /// `--keep`: copies stay in `stage_dir` for later jobs, up to this many bytes.
    pub keep: Option<u64>,
    /// Unsigned requests for s3:// archives.
    pub no_sign_request: bool,
    /// How long a request to an object store may be retried.
    pub retry_for: std::time::Duration,
    pub preload: Preload,
    pub readdirplus: Readdirplus,
    pub prelist: Prelist,
    pub debug: bool,
}

/// When `--preload` streams the archives into the page cache. The variants' comments stay
/// out of `--help` (`help = None`): the option's own text says what each value does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Preload {
    /// Once reads show an epoch (see [`preload::Trigger`]).
    #[value(help = None::<&str>)]
    Auto,
    /// As soon as the mount is live.
    #[value(help = None::<&str>)]
    Always,
    Never,
}

/// Whether `--prelist` lists the tree through the mount once it is live
/// ([`crate::warm::prelist`]): `Auto` does when listings carry attributes and the kernel's
/// inodes fit in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Prelist {
    Auto,
    Never,
}

/// How the server process runs, beside what it mounts.
#[derive(Clone, Debug, Default)]
pub struct Server {
    /// Where the log goes (default: the terminal in the foreground, else nowhere).
    pub log: Option<PathBuf>,
    /// Set when started by [`mount_in_background`]: where to report the mount live.
    pub ready_fd: Option<i32>,
    /// Unmount and exit when this process ends.
    pub exit_with: Option<i32>,
}

/// Signals that end a server: it unmounts and exits 0.
const ENDING: [i32; 3] = [libc::SIGTERM, libc::SIGINT, libc::SIGHUP];

/// Signals a server takes and ignores. `sbatch --signal`, `scancel --signal` and
/// requeue helpers send SIGUSR1/SIGUSR2 to every process of a job so the training code
/// can checkpoint; their default action would kill the server and the mount under it.
const IGNORED: [i32; 2] = [libc::SIGUSR1, libc::SIGUSR2];

/// Signals `run` passes on to the command, as tini does: all that ask a program to do
/// something, not those that report its own faults or stop it at a terminal.
const FORWARDED: [i32; 9] = [
    libc::SIGHUP,
    libc::SIGINT,
    libc::SIGQUIT,
    libc::SIGUSR1,
    libc::SIGUSR2,
    libc::SIGALRM,
    libc::SIGTERM,
    libc::SIGCONT,
    libc::SIGWINCH,
];

/// `archfs mount` without `--foreground`: runs this same command line again as the
/// server, in a session of its own, and returns the mount point once it reports the
/// mount live (or fails with its error).
pub fn mount_in_background() -> Result<PathBuf, JobError> {
    let mut fds = [0i32; 2];
    // SAFETY: fds has room for two descriptors.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        let e = std::io::Error::last_os_error();
        return Err(JobError::system("create a pipe", e));
    }
    // SAFETY: pipe2 just returned these descriptors to us.
    let (read_end, write_end) =
        unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    let exe = std::env::current_exe().map_err(|e| JobError::system("find archfs itself", e))?;
    let mut cmd = Command::new(&exe);
    // `mount --ready-fd 3 ...`: right after the subcommand, before any `--`.
    let mut args = std::env::args_os().skip(1);
    cmd.args(args.next())
        .args(["--ready-fd", "3"])
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    // The server keeps our stderr until the mount is ready (progress bars, warnings),
    // then switches to --log or /dev/null.
    let wfd = write_end.as_raw_fd();
    // SAFETY: dup2 and setsid are async-signal-safe. Its own session keeps a terminal's
    // Ctrl-C and hang-up away from the server; `archfs unmount` or a signal ends it.
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(wfd, 3) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            libc::setsid();
            Ok(())
        });
    }
    let mut server = cmd
        .spawn()
        .map_err(|e| JobError::system(format!("start the server {}", exe.display()), e))?;
    drop(write_end);
    let mut reply = Vec::new();
    let mut byte = [0u8; 1];
    let mut reader = std::fs::File::from(read_end);
    while let Ok(1) = reader.read(&mut byte) {
        if byte[0] == b'\n' {
            break;
        }
        reply.push(byte[0]);
    }
    if let Some(path) = reply.strip_prefix(b"ok ") {
        return Ok(PathBuf::from(std::ffi::OsStr::from_bytes(path)));
    }
    let reply = String::from_utf8_lossy(&reply).into_owned();
    let status = server.wait();
    match reply.strip_prefix("error: ") {
        Some(msg) => Err(JobError::Server(msg.to_string())),
        None => Err(JobError::ServerExited(
            status.map_or_else(|e| e.to_string(), |s| s.to_string()),
        )),
    }
}

/// The server, in the foreground or started by [`mount_in_background`] (`ready_fd`):
/// mounts, serves until an ending signal, the end of its owner (`--exit-with`) or an
/// unmount from outside, then cleans up.
pub fn serve(s: &Settings, server: &Server) -> Result<ExitCode, JobError> {
    let (log, ready_fd) = (server.log.as_deref(), server.ready_fd);
    crate::memory::bound_free_heap();
    let handled: Vec<i32> = ENDING.iter().chain(&IGNORED).copied().collect();
    block_signals(&handled);
    crate::logging::init(s.debug, log.is_some());
    let mut ready = Ready::new(ready_fd);
    // With --log everything goes there; without, a background server shows startup
    // warnings and progress on the terminal, then goes quiet once the mount is ready.
    if log.is_some() {
        redirect_stderr(log)?;
    }
    let (tx, rx) = channel();
    watch_signals(&handled, tx.clone());
    let mount = match server.exit_with {
        Some(pid) if !s.shared => watch_owner(pid, tx.clone()),
        _ => Ok(()),
    }
    // A progress bar of the node-local copy where someone watches: a foreground server
    // with its log on the terminal.
    .and_then(|()| open_and_mount(s, tx.clone(), ready_fd.is_none() && log.is_none()));
    let (mut mount, plan) = match mount {
        Ok(m) => m,
        Err(e) if ready_fd.is_some() => {
            // The parent prints it.
            ready.send(&format!("error: {e}"));
            return Ok(ExitCode::FAILURE);
        }
        Err(e) => return Err(e),
    };
    // Before the mount is reported live, so `archfs mount` returns with the lister
    // started; quiet when the server's stderr is about to go to /dev/null.
    mount.start_listing(ready_fd.is_some() && log.is_none());
    ready.send_path(mount.path());
    crate::compressed::release_copies();
    if s.auto_mountpoint && ready_fd.is_none() {
        println!("{}", mount.path().display());
    }
    if ready_fd.is_some() && log.is_none() {
        redirect_stderr(None)?;
    }
    if let Some(plan) = plan {
        plan.start_once_per_node(&crate::node::archives_key(&s.archives));
    }
    if s.shared {
        watch_users(Registry::of(mount.path()), tx)?;
    }
    loop {
        match rx.recv() {
            Ok(Event::Unused(_lock)) => {
                // Unmounted under the registry's lock: a rank arriving now waits, then
                // mounts anew.
                tracing::info!("no user left: unmounting {}", mount.path().display());
                mount.unmount()?;
                return Ok(ExitCode::SUCCESS);
            }
            Ok(Event::Signal { signo, .. }) if IGNORED.contains(&signo) => {
                tracing::info!("signal {signo} ignored: the mount stays");
            }
            Ok(Event::Signal { signo, .. }) => {
                tracing::info!("signal {signo}: unmounting {}", mount.path().display());
                mount.unmount()?;
                return Ok(ExitCode::SUCCESS);
            }
            Ok(Event::OwnerEnded(pid)) => {
                tracing::info!("process {pid} ended: unmounting {}", mount.path().display());
                mount.unmount()?;
                return Ok(ExitCode::SUCCESS);
            }
            Ok(Event::Unmounted) | Err(_) => {
                mount.finish();
                return Ok(ExitCode::SUCCESS);
            }
            Ok(Event::Exited(_)) => {}
        }
    }
}

/// `archfs run`: mounts, runs the command, passes signals on to it, and unmounts once it
/// has ended; the exit status is the command's, 128+N if signal N ended it, 127 if it
/// was not found and 126 if it could not be run.
pub fn run(s: &Settings, command: &[OsString]) -> Result<ExitCode, JobError> {
    block_signals(&FORWARDED);
    crate::logging::init(s.debug, false);
    let (tx, rx) = channel();
    watch_signals(&FORWARDED, tx.clone());
    let (mut mount, plan) = open_and_mount(s, tx.clone(), false)?;
    if let Some(plan) = plan {
        plan.start_once_per_node(&crate::node::archives_key(&s.archives));
    }
    mount.start_listing(false);
    let mut cmd = Command::new(&command[0]);
    cmd.args(&command[1..])
        .env("ARCHFS_MOUNTPOINT", mount.path());
    // SAFETY: reset_signals (sigaction, sigprocmask) and restore_files_limit (setrlimit)
    // only make async-signal-safe system calls.
    unsafe {
        cmd.pre_exec(|| {
            reset_signals();
            crate::open::restore_files_limit();
            Ok(())
        });
    }
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            mount.unmount()?;
            let name = command[0].to_string_lossy();
            eprintln!("archfs: cannot run {name}: {e}");
            let code = if e.kind() == std::io::ErrorKind::NotFound {
                127
            } else {
                126
            };
            return Ok(ExitCode::from(code));
        }
    };
    let pid = child.id() as i32;
    std::thread::Builder::new()
        .name("archfs-wait".into())
        .spawn(move || {
            if let Ok(status) = child.wait() {
                let _ = tx.send(Event::Exited(status));
            }
        })
        .map_err(|e| JobError::system("start a thread", e))?;
    let status = loop {
        match rx.recv() {
            // A terminal's Ctrl-C or hang-up reached the command already: it is in the
            // same foreground process group.
            Ok(Event::Signal {
                signo,
                from_process,
            }) => {
                if from_process {
                    // SAFETY: kill has no memory preconditions; pid is our unreaped child.
                    unsafe { libc::kill(pid, signo) };
                }
            }
            Ok(Event::Unmounted) => tracing::warn!(
                "{} was unmounted while the command runs",
                mount.path().display()
            ),
            Ok(Event::Exited(status)) => break status,
            Ok(Event::OwnerEnded(_) | Event::Unused(_)) => {}
            Err(_) => return Err(JobError::LostCommand),
        }
    };
    mount.unmount()?;
    Ok(ExitCode::from(exit_code(status)))
}

/// A shell's view of how a process ended: its code, or 128+N for signal N.
fn exit_code(status: ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(c), _) => c as u8,
        (None, Some(sig)) => (128 + sig).clamp(0, 255) as u8,
        _ => 1,
    }
}

/// `archfs unmount`: unmounts (lazily if files are open) and, when that took effect at
/// once, waits for the server to exit, so the mount point it created is gone on return.
pub fn unmount(mountpoint: &Path) -> Result<(), JobError> {
    let path = std::fs::canonicalize(mountpoint).unwrap_or_else(|_| mountpoint.to_owned());
    if !mountpoint::is_mount_point(&path) {
        return Err(JobError::NotMounted(path));
    }
    let servers = mountpoint::servers_of(&path);
    // The listing ahead has a directory open most of the time it runs, which would make
    // the unmount lazy and this command return before the server is gone; it only warms
    // the kernel's caches, so it ends first (a request it has in flight is answered).
    let listers = mountpoint::listers_of(&path);
    for &pid in &listers {
        // SAFETY: kill has no memory preconditions; EPERM for another user's is harmless.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    mountpoint::wait_for_end(&listers, Duration::from_secs(2));
    let how = match mountpoint::unmount(&path) {
        Ok(how) => how,
        Err(source) => return Err(JobError::Unmount { path, source }),
    };
    // After a lazy unmount the server exits when the last open file is closed.
    if how == mountpoint::Unmounted::Now {
        mountpoint::wait_for_end(&servers, Duration::from_secs(5));
    }
    Ok(())
}

/// `archfs mount --shared`: registers `owner` as a user of the mount and mounts it unless
/// it is live already, all under the registry's lock, so other ranks wait for it to be
/// live. Returns the mount point.
pub fn mount_shared(s: &Settings, owner: i32) -> Result<PathBuf, JobError> {
    let path = std::path::absolute(&s.mountpoint).map_err(JobError::Shared)?;
    let registry = Registry::of(&path);
    let lock = registry.lock().map_err(JobError::Shared)?;
    registry.join(&lock, owner).map_err(JobError::Shared)?;
    let live = mountpoint::is_mount_point(&path) && std::fs::metadata(&path).is_ok();
    let result = if live {
        Ok(path)
    } else {
        mount_in_background()
    };
    if result.is_err() {
        registry.leave(&lock, owner);
    }
    result
}

/// `archfs unmount --leave PID`: `pid` stops using a shared mount, which is unmounted if
/// no one else uses it.
pub fn leave_shared(mountpoint: &Path, pid: i32) -> Result<(), JobError> {
    let path = std::fs::canonicalize(mountpoint).unwrap_or_else(|_| mountpoint.to_owned());
    let registry = Registry::of(&path);
    let lock = registry.lock().map_err(JobError::Shared)?;
    registry.leave(&lock, pid);
    if registry.live_users(&lock) == 0 && mountpoint::is_mount_point(&path) {
        unmount(&path)?;
    }
    Ok(())
}

/// A job-private, node-local mount point for a mount of `archive`, not yet made: under
/// `$TMPDIR`, else /dev/shm, else /tmp (the first that is a writable directory), named
/// after the SLURM job (or the user), the archive and this process.
pub fn default_mountpoint(archive: &Path) -> PathBuf {
    job_directory(archive, &std::process::id().to_string())
}

/// The mount point all ranks of a job on this node agree on for a `--shared` mount of
/// `archives`: [`default_mountpoint`] with their identity ([`crate::node::archives_key`])
/// for the process: two datasets both named `data.sqfs` get a mount each (by name alone,
/// the second joined the first's mount and read the other dataset).
pub fn shared_mountpoint(archives: &[PathBuf]) -> PathBuf {
    let key = crate::node::archives_key(archives);
    let first = archives
        .first()
        .map(PathBuf::as_path)
        .unwrap_or(Path::new(""));
    job_directory(first, &format!("{}-shared", &key[..8]))
}

/// `BASE/archfs-OWNER-NAME-SUFFIX`.
fn job_directory(archive: &Path, suffix: &str) -> PathBuf {
    let writable = |d: &Path| {
        let Ok(c) = std::ffi::CString::new(d.as_os_str().as_encoded_bytes()) else {
            return false;
        };
        // SAFETY: c is a valid NUL-terminated path.
        d.is_dir() && unsafe { libc::access(c.as_ptr(), libc::W_OK | libc::X_OK) } == 0
    };
    let base = std::env::var_os("TMPDIR")
        .map(PathBuf::from)
        .into_iter()
        .chain(["/dev/shm".into(), "/tmp".into()])
        .find(|d| writable(d))
        .unwrap_or_else(|| "/tmp".into());
    let owner = match std::env::var("SLURM_JOB_ID") {
        Ok(job) if !job.is_empty() => format!("job{job}"),
        // SAFETY: getuid has no preconditions.
        _ => format!("uid{}", unsafe { libc::getuid() }),
    };
    let stem = archive
        .file_stem()
        .map(|s| s.to_string_lossy().replace(['/', ' '], "_"))
        .unwrap_or_default();
    base.join(format!("archfs-{owner}-{stem}-{suffix}"))
}

/// Opens the archives and mounts them; also what `--preload=always` will read.
fn open_and_mount(
    s: &Settings,
    events: Sender<Event>,
    progress: bool,
) -> Result<(Mount, Option<preload::Plan>), JobError> {
    if s.index.is_some() && s.archives.len() > 1 {
        return Err(JobError::IndexOfMany);
    }
    let cache = CacheConfig {
        total_bytes: s.cache_size,
    };
    let options = crate::open::OpenOptions {
        recursive: s.recursive,
        index: s.index.clone(),
        spacing: Some(s.entry_spacing),
        stage_dir: s.stage_dir.clone(),
        remote: crate::source::RemoteOptions {
            no_sign_request: s.no_sign_request,
            stage: match s.preload {
                Preload::Never => crate::source::Staging::Never,
                Preload::Auto => crate::source::Staging::Auto,
                Preload::Always => crate::source::Staging::Always,
            },
            stage_dir: s.stage_dir.clone(),
            keep: s.keep,
            retry_for: Some(s.retry_for),
            progress,
        },
    };
    // Copies of compressed archives start once the mount is live ([`serve`]).
    crate::compressed::hold_copies();
    let archive = crate::open::open_many(&s.archives, &cache, &options)?;
    tracing::info!("{}: {}", s.archives[0].display(), archive.format());
    // `always` decides what fits (and warns) before the mount goes live, while the
    // terminal still shows warnings.
    // A compressed archive is decoded ahead as well: in memory when it fits, or with
    // `always` into --stage-dir.
    // Files of listed directories are pushed into the page cache once reads show an
    // epoch (src/warm/push.rs).
    // One mount of the job on the node pushes: eight ranks' mounts would each hold the
    // whole tree in the page cache.
    let push = (s.preload != Preload::Never).then(|| Arc::new(Pusher::new(archive.clone())));
    let key = crate::node::archives_key(&s.archives);
    let start_push = {
        let push = push.clone();
        let key = key.clone();
        move || {
            let Some(p) = &push else {
                return;
            };
            if crate::node::first_for("push", &key) {
                p.start();
            } else {
                tracing::info!("another mount of this job on this node pushes the files");
            }
        }
    };
    let (trigger, plan) = match s.preload {
        Preload::Never => (None, None),
        Preload::Auto => {
            archive.decode_ahead(DecodeAhead::Far);
            let a = Arc::downgrade(&archive);
            let trigger = Trigger::new(archive.extents())
                .once_per_node(key)
                .then(move || {
                    if let Some(a) = a.upgrade() {
                        a.decode_ahead(DecodeAhead::Memory);
                    }
                    start_push();
                });
            (Some(Arc::new(trigger)), None)
        }
        Preload::Always => {
            let plan = preload::Plan::new(archive.extents(), crate::memory::available());
            if let Some(why) = &plan.skipped {
                tracing::warn!("{why}");
            }
            archive.decode_ahead(DecodeAhead::Any);
            // The stream starts now; the push, like `auto`'s, when reads show an epoch.
            let trigger = Trigger::new(Vec::new()).then(start_push);
            (Some(Arc::new(trigger)), Some(plan))
        }
    };
    let mount = Mount::new(archive, s, trigger, push, events)?;
    // fuser's handshake reads the kernel's INIT into a zeroed 16 MiB buffer and frees
    // it; where an index was just built, the buffer lands in the holes the build left,
    // and its pages stay resident (server RSS after the first mount of a 200,000-entry
    // tar: 28 MB; 11.7 MB with this, as after a remount).
    crate::memory::give_back();
    Ok((mount, plan))
}

/// Something a serving loop reacts to.
#[derive(Debug)]
pub enum Event {
    /// A handled signal; `from_process` is false when the kernel sent it for a terminal
    /// (Ctrl-C, hang-up): the whole foreground process group got it already.
    Signal { signo: i32, from_process: bool },
    /// The FUSE session ended: someone unmounted the filesystem.
    Unmounted,
    /// The command under `run` ended.
    Exited(ExitStatus),
    /// The process named by `--exit-with` ended.
    OwnerEnded(i32),
    /// Every user of a `--shared` mount has left; the registry's lock is held.
    Unused(Locked),
}

/// Tells the parent of a background server whether the mount came up.
struct Ready(Option<std::fs::File>);

impl Ready {
    fn new(fd: Option<i32>) -> Ready {
        Ready(fd.map(|fd| {
            // SAFETY: the parent passed this descriptor to us for exactly this purpose.
            let f = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
            // Children (the watchdog) must not hold it open, or the parent waits on them.
            // SAFETY: fcntl on a descriptor we own.
            unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
            f
        }))
    }

    fn send_path(&mut self, path: &Path) {
        if let Some(mut f) = self.0.take() {
            let mut line = b"ok ".to_vec();
            line.extend_from_slice(path.as_os_str().as_bytes());
            line.push(b'\n');
            let _ = f.write_all(&line);
        }
    }

    fn send(&mut self, line: &str) {
        if let Some(mut f) = self.0.take() {
            // One line: the parent reads up to the first newline.
            let _ = f.write_all(format!("{}\n", line.replace('\n', " ")).as_bytes());
        }
    }
}

/// Points stderr (and so the log) at `path`, or at /dev/null.
fn redirect_stderr(path: Option<&Path>) -> Result<(), JobError> {
    let target = match path {
        Some(p) => std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(p)
            .map_err(|e| JobError::system(format!("open log file {}", p.display()), e))?,
        None => std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/null")
            .map_err(|e| JobError::system("open /dev/null", e))?,
    };
    // SAFETY: both descriptors are open; dup2 replaces fd 2 atomically.
    unsafe { libc::dup2(target.as_raw_fd(), 2) };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_read_as_a_shell_reports_them() {
        assert_eq!(exit_code(ExitStatus::from_raw(3 << 8)), 3);
        assert_eq!(exit_code(ExitStatus::from_raw(libc::SIGKILL)), 137);
        assert_eq!(exit_code(ExitStatus::from_raw(libc::SIGTERM)), 143);
    }
}
