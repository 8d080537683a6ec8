//! The command line: `mount`, `unmount`, `run`, and inspection commands that read an
//! archive without mounting it.

use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::archive::{self, Archive, Kind};
use crate::cache::CacheConfig;
use crate::mountpoint;
use crate::preload;
use crate::session::{self, Event, MountConfig};

#[derive(Parser, Debug)]
#[command(
    name = "archfs",
    version,
    about = "Mount SquashFS images read-only with FUSE, \
    fast, for datasets of many small files",
    propagate_version = true
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Mount an archive; returns once the mount is live, the server runs on in the background.
    #[command(override_usage = "archfs mount [OPTIONS] ARCHIVE... MOUNTPOINT")]
    Mount(MountArgs),
    /// Unmount a mount point (lazily if files are still open there).
    #[command(alias = "umount")]
    Unmount { mountpoint: PathBuf },
    /// Mount, run a command, unmount when it ends; exits with the command's status.
    #[command(override_usage = "archfs run [OPTIONS] ARCHIVE... MOUNTPOINT -- COMMAND [ARGS]...")]
    Run {
        /// ARCHIVE... MOUNTPOINT, as for `mount`.
        #[arg(required = true, num_args = 2.., value_name = "PATH")]
        paths: Vec<PathBuf>,
        #[command(flatten)]
        serve: ServeArgs,
        /// The command and its arguments, after `--`.
        #[arg(last = true, required = true)]
        command: Vec<OsString>,
    },
    /// Show the archive's format and totals.
    Info { archive: PathBuf },
    /// List a directory inside the archive without mounting it.
    Ls {
        archive: PathBuf,
        #[arg(default_value = "/")]
        path: PathBuf,
    },
    /// Write a file from the archive to standard output without mounting it.
    Cat { archive: PathBuf, path: PathBuf },
    /// Read every directory, inode, file, symlink and xattr; report damage (exit 1 if any).
    Check { archive: PathBuf },
    #[command(name = "__watchdog", hide = true)]
    Watchdog {
        path: PathBuf,
        #[arg(long)]
        remove_dir: bool,
    },
}

#[derive(Args, Debug)]
struct MountArgs {
    /// ARCHIVE... MOUNTPOINT: one or more SquashFS images or tar archives (a directory
    /// stands for the archives in it, e.g. WebDataset shards), then the mount point.
    /// Several show as one tree: directories merge, and the archive given last wins for
    /// any other name.
    #[arg(required = true, num_args = 2.., value_name = "PATH")]
    paths: Vec<PathBuf>,
    #[command(flatten)]
    serve: ServeArgs,
    /// Serve in the foreground instead of returning once the mount is live.
    #[arg(short, long)]
    foreground: bool,
    /// Where the background server writes its log (default: discarded).
    #[arg(long, value_name = "FILE")]
    log: Option<PathBuf>,
    /// Internal: the descriptor on which the server reports readiness to its parent.
    #[arg(long, hide = true)]
    ready_fd: Option<i32>,
}

#[derive(Args, Debug)]
struct ServeArgs {
    /// Bytes of decompressed blocks kept in memory (K, M, G suffixes, powers of 1024).
    #[arg(long, value_name = "SIZE", default_value = "512M", value_parser = parse_size)]
    cache_size: u64,
    /// FUSE request threads [default: twice the CPUs, 4 to 16].
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
    /// Mount options, comma-separated; `allow_other` lets other users read the mount
    /// (ordinary users need `user_allow_other` in /etc/fuse.conf for it).
    #[arg(short = 'o', value_name = "OPTIONS", value_delimiter = ',')]
    options: Vec<String>,
    /// Log every request and more (to the terminal with --foreground, or to --log).
    #[arg(long)]
    debug: bool,
    /// Show tar archives inside a tar archive as directories (named without `.tar`).
    #[arg(long)]
    recursive: bool,
    /// Where a tar archive's index is saved and looked for [default: ARCHIVE.archfs-index
    /// beside the archive if that directory is writable, else ~/.cache/archfs/].
    #[arg(long, value_name = "FILE")]
    index: Option<PathBuf>,
    /// Read the archives into the OS page cache in the background, in a few large parallel
    /// reads, so a first epoch's shuffled reads find them in memory: `auto` once 128 files
    /// have been read, `always` (bare `--preload`) once mounted, or `never`. The data is
    /// left out when it would not fit in free memory.
    #[arg(
        long,
        value_enum,
        value_name = "WHEN",
        default_value_t = Preload::Auto,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "always"
    )]
    preload: Preload,
}

#[derive(Clone, Copy, Debug, PartialEq, ValueEnum)]
enum Preload {
    Auto,
    Always,
    Never,
}

/// Parses `512M`, `2G`, `1048576`, `64KiB`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix('B'))
        .unwrap_or(t);
    let (num, shift) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                _ => return Err(format!("unknown size suffix in {s:?}; use K, M, G or T")),
            };
            (&t[..i], shift)
        }
        _ => (t, 0),
    };
    let n: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a size; write it like 512M or 2G"))?;
    if !(0.0..1e19).contains(&n) {
        return Err(format!("size {s:?} is out of range"));
    }
    Ok((n * (1u64 << shift) as f64) as u64)
}

struct Failure(String);

impl<E: std::fmt::Display> From<E> for Failure {
    fn from(e: E) -> Self {
        Failure(e.to_string())
    }
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(Failure(msg)) => {
            eprintln!("archfs: {msg}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<ExitCode, Failure> {
    match cli.command {
        Cmd::Mount(args) if args.foreground || args.ready_fd.is_some() => serve(args),
        Cmd::Mount(_) => daemonize(),
        Cmd::Unmount { mountpoint } => {
            let path = std::fs::canonicalize(&mountpoint).unwrap_or(mountpoint);
            if !mountpoint::is_mount_point(&path) {
                return Err(Failure(format!("{} is not mounted", path.display())));
            }
            let servers = mountpoint::servers_of(&path);
            let how = mountpoint::unmount(&path)
                .map_err(|e| format!("cannot unmount {}: {e}", path.display()))?;
            // The server exits, removing a mount point it created, once it sees the
            // unmount; after a lazy one that waits for the last open file to close.
            if how == mountpoint::Unmounted::Now {
                mountpoint::wait_for_exit(&servers, std::time::Duration::from_secs(5));
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Run {
            paths,
            serve,
            command,
        } => {
            let (mountpoint, archives) = paths.split_last().expect("clap requires two");
            run_command(archives, mountpoint, &serve, &command)
        }
        Cmd::Info { archive } => {
            let a = archive::open(&archive, &CacheConfig::default())?;
            let s = a.stats();
            println!("format:     {}", a.format());
            println!("size:       {} bytes", s.bytes);
            println!("inodes:     {}", s.inodes);
            println!("block size: {}", s.block_size);
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Ls { archive, path } => {
            let a = archive::open(&archive, &CacheConfig::default())?;
            let attr = archive::resolve(&*a, &path)?;
            let mut out = std::io::stdout().lock();
            let entries = if attr.kind == Kind::Dir {
                a.read_dir(attr.ino)?
                    .into_iter()
                    .map(|e| (e.name.to_vec(), e.ino))
                    .collect()
            } else {
                vec![(path.as_os_str().as_bytes().to_vec(), attr.ino)]
            };
            for (name, ino) in entries {
                let at = a.attr(ino)?;
                write!(
                    out,
                    "{} {:>3} {:>6} {:>6} {:>12} {:>11} ",
                    mode_string(at.kind, at.perm),
                    at.nlink,
                    at.uid,
                    at.gid,
                    at.size,
                    at.mtime
                )?;
                out.write_all(&name)?;
                if at.kind == Kind::Symlink {
                    out.write_all(b" -> ")?;
                    out.write_all(&a.readlink(ino)?)?;
                }
                out.write_all(b"\n")?;
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Cat { archive, path } => {
            let a = archive::open(&archive, &CacheConfig::default())?;
            let attr = archive::resolve(&*a, &path)?;
            let mut out = std::io::stdout().lock();
            let mut off = 0;
            while off < attr.size {
                let data = a.read(attr.ino, off, 1 << 20)?;
                if data.is_empty() {
                    break;
                }
                out.write_all(&data)?;
                off += data.len() as u64;
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Check { archive } => {
            let a = archive::open(&archive, &CacheConfig::default())?;
            let r = archive::check::check(&*a, archive::check::Limits::ALL);
            let mut out = std::io::stdout().lock();
            for line in &r.damaged {
                writeln!(out, "damaged: {line}")?;
            }
            writeln!(
                out,
                "{} directories, {} files ({} bytes read), {} symlinks, {} other; {} damaged",
                r.dirs, r.files, r.bytes, r.symlinks, r.others, r.damage_count
            )?;
            Ok(if r.damage_count == 0 {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        Cmd::Watchdog { path, remove_dir } => Ok(ExitCode::from(session::watchdog_main(
            &path, remove_dir,
        ) as u8)),
    }
}

fn mode_string(kind: Kind, perm: u16) -> String {
    let t = match kind {
        Kind::File => '-',
        Kind::Dir => 'd',
        Kind::Symlink => 'l',
        Kind::BlockDev => 'b',
        Kind::CharDev => 'c',
        Kind::Fifo => 'p',
        Kind::Socket => 's',
    };
    let mut s = String::from(t);
    for shift in [6, 3, 0] {
        let bits = (perm >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

/// `to_file`: stderr is about to go to a --log file, so no colour codes.
fn init_logging(debug: bool, to_file: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("ARCHFS_LOG").unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new(if debug { "debug" } else { "warn" })
    });
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(!to_file && std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .try_init();
}

fn default_threads() -> usize {
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
    (cpus * 2).clamp(4, 16)
}

fn mount_config(archives: &[PathBuf], serve: &ServeArgs) -> Result<MountConfig, Failure> {
    let mut allow_other = false;
    for o in &serve.options {
        match o.as_str() {
            "allow_other" => allow_other = true,
            "ro" | "" => {}
            other => {
                return Err(Failure(format!(
                    "unknown mount option {other:?}; archfs knows allow_other"
                )))
            }
        }
    }
    Ok(MountConfig {
        threads: serve.threads.unwrap_or_else(default_threads),
        allow_other,
        fsname: std::fs::canonicalize(&archives[0])
            .unwrap_or_else(|_| archives[0].clone())
            .to_string_lossy()
            .replace([',', ' '], "_"),
        preload: None,
    })
}

fn open_archive(paths: &[PathBuf], serve: &ServeArgs) -> Result<Arc<dyn Archive>, Failure> {
    if serve.index.is_some() && paths.len() > 1 {
        return Err(Failure(
            "--index names the index of one archive; with several, each keeps its own".into(),
        ));
    }
    let cache = CacheConfig {
        total_bytes: serve.cache_size,
    };
    let options = archive::OpenOptions {
        recursive: serve.recursive,
        index: serve.index.clone(),
    };
    Ok(archive::open_many(paths, &cache, &options)?)
}

/// Sets up `--preload`: for `always`, what to read once mounted, decided (and any warning
/// shown) before the mount is live; for `auto`, the mount's trigger.
fn preload_plan(
    archive: &dyn Archive,
    serve: &ServeArgs,
    cfg: &mut MountConfig,
) -> Option<preload::Plan> {
    match serve.preload {
        Preload::Never => None,
        Preload::Auto => {
            cfg.preload = Some(Arc::new(preload::Trigger::new(archive.extents())));
            None
        }
        Preload::Always => {
            let plan = preload::Plan::new(archive.extents(), preload::available_memory());
            if let Some(why) = &plan.skipped {
                tracing::warn!("{why}");
            }
            Some(plan)
        }
    }
}

/// Points stderr (and so the log) at `path`, or at /dev/null.
fn redirect_stderr(path: Option<&Path>) -> Result<(), Failure> {
    let target = match path {
        Some(p) => std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(p)
            .map_err(|e| format!("cannot open log file {}: {e}", p.display()))?,
        None => std::fs::OpenOptions::new().write(true).open("/dev/null")?,
    };
    use std::os::fd::AsRawFd;
    // SAFETY: both descriptors are open; dup2 replaces fd 2 atomically.
    unsafe { libc::dup2(target.as_raw_fd(), 2) };
    Ok(())
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

    fn send(&mut self, line: &str) {
        if let Some(mut f) = self.0.take() {
            // One line: the parent reads up to the first newline.
            let _ = f.write_all(format!("{}\n", line.replace('\n', " ")).as_bytes());
        }
    }
}

/// `archfs mount` without --foreground: start the server as a child in its own session
/// and return once it reports the mount live, with its error otherwise.
fn daemonize() -> Result<ExitCode, Failure> {
    let mut fds = [0i32; 2];
    // SAFETY: fds has room for two descriptors.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(Failure(format!(
            "cannot create a pipe: {}",
            std::io::Error::last_os_error()
        )));
    }
    // SAFETY: pipe2 just returned these descriptors to us.
    let (read_end, write_end) =
        unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args(std::env::args_os().skip(1))
        .args(["--ready-fd", "3"])
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    // The server keeps our stderr until the mount is ready (progress bars, warnings),
    // then switches to --log or /dev/null.
    let wfd = fds[1];
    // SAFETY: dup2 and setsid are async-signal-safe.
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(wfd, 3) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            libc::setsid();
            Ok(())
        });
    }
    let mut child = cmd.spawn()?;
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
    let reply = String::from_utf8_lossy(&reply).into_owned();
    if reply == "ok" {
        return Ok(ExitCode::SUCCESS);
    }
    if let Some(msg) = reply.strip_prefix("error: ") {
        let _ = child.wait();
        return Err(Failure(msg.to_string()));
    }
    let status = child.wait()?;
    Err(Failure(format!(
        "the server exited ({status}) before the mount was ready; run with --foreground \
         --debug to see why"
    )))
}

/// `archfs mount --foreground`, and the background server: serve until a signal or an
/// unmount from outside, then clean up.
fn serve(args: MountArgs) -> Result<ExitCode, Failure> {
    session::block_signals();
    init_logging(args.serve.debug, args.log.is_some());
    let mut ready = Ready::new(args.ready_fd);
    let daemon = args.ready_fd.is_some();
    // With --log everything goes there; without, a background server shows startup
    // warnings and progress on the terminal, then goes quiet once the mount is ready.
    if args.log.is_some() {
        redirect_stderr(args.log.as_deref())?;
    }
    let (tx, rx) = session::events();
    let (mountpoint, archives) = args.paths.split_last().expect("clap requires two");
    let setup = mount_config(archives, &args.serve).and_then(|mut cfg| {
        let archive = open_archive(archives, &args.serve)?;
        tracing::info!("{}: {}", archives[0].display(), archive.format());
        let plan = preload_plan(&*archive, &args.serve, &mut cfg);
        Ok((session::mount(archive, mountpoint, &cfg, tx)?, plan))
    });
    let (mut mount, plan) = match setup {
        Ok(m) => m,
        Err(Failure(msg)) if daemon => {
            // The parent prints it.
            ready.send(&format!("error: {msg}"));
            return Ok(ExitCode::FAILURE);
        }
        Err(e) => return Err(e),
    };
    ready.send("ok");
    if daemon && args.log.is_none() {
        redirect_stderr(None)?;
    }
    if let Some(plan) = plan {
        plan.start();
    }
    loop {
        match rx.recv() {
            Ok(Event::Signal { signo, .. }) => {
                tracing::info!("signal {signo}: unmounting {}", mount.path().display());
                mount.unmount()?;
                return Ok(ExitCode::SUCCESS);
            }
            Ok(Event::Ended) | Err(_) => {
                mount.finish();
                return Ok(ExitCode::SUCCESS);
            }
            Ok(Event::Exited(_)) => {}
        }
    }
}

/// `archfs run`: mount, run the command, forward signals to it, unmount when it ends.
fn run_command(
    archives: &[PathBuf],
    mountpoint: &Path,
    serve: &ServeArgs,
    command: &[OsString],
) -> Result<ExitCode, Failure> {
    session::block_signals();
    init_logging(serve.debug, false);
    let (tx, rx) = session::events();
    let mut cfg = mount_config(archives, serve)?;
    let archive = open_archive(archives, serve)?;
    let plan = preload_plan(&*archive, serve, &mut cfg);
    let mount = session::mount(archive, mountpoint, &cfg, tx.clone())?;
    if let Some(plan) = plan {
        plan.start();
    }
    let child = Command::new(&command[0]).args(&command[1..]).spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            mount.unmount()?;
            return Err(Failure(format!(
                "cannot run {}: {e}",
                command[0].to_string_lossy()
            )));
        }
    };
    let pid = child.id() as i32;
    std::thread::spawn(move || {
        if let Ok(status) = child.wait() {
            let _ = tx.send(Event::Exited(status));
        }
    });
    let status = loop {
        match rx.recv() {
            Ok(Event::Signal {
                signo,
                from_process,
            }) => {
                // A terminal's Ctrl-C reached the command already (same process group).
                if from_process {
                    // SAFETY: kill has no memory preconditions.
                    unsafe { libc::kill(pid, signo) };
                }
            }
            Ok(Event::Ended) => {
                tracing::warn!(
                    "{} was unmounted while the command runs",
                    mountpoint.display()
                )
            }
            Ok(Event::Exited(status)) => break status,
            Err(_) => return Err(Failure("lost track of the command".into())),
        }
    };
    mount.unmount()?;
    let code = match (status.code(), status.signal()) {
        (Some(c), _) => c,
        (None, Some(sig)) => 128 + sig,
        _ => 1,
    };
    Ok(ExitCode::from(code.clamp(0, 255) as u8))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mount_args(argv: &[&str]) -> MountArgs {
        match Cli::try_parse_from(argv).unwrap().command {
            Cmd::Mount(m) => m,
            other => panic!("parsed as {other:?}"),
        }
    }

    #[test]
    fn preload_defaults_to_auto_and_a_bare_flag_takes_no_path() {
        let m = mount_args(&["archfs", "mount", "a.sqfs", "mnt"]);
        assert_eq!(m.serve.preload, Preload::Auto);
        let m = mount_args(&["archfs", "mount", "--preload", "a.sqfs", "mnt"]);
        assert_eq!(m.serve.preload, Preload::Always);
        assert_eq!(m.paths, [PathBuf::from("a.sqfs"), PathBuf::from("mnt")]);
        let m = mount_args(&["archfs", "mount", "a.sqfs", "mnt", "--preload=never"]);
        assert_eq!(m.serve.preload, Preload::Never);
        assert!(Cli::try_parse_from(["archfs", "mount", "--preload=soon", "a", "m"]).is_err());
    }
}
