//! The command line: `mount`, `unmount`, `run`, and inspection commands that read an
//! archive without mounting it.

use std::ffi::OsString;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, CommandFactory, Parser, Subcommand, ValueEnum};

use crate::archive::{self, Kind};
use crate::cache::CacheConfig;
use crate::job::{self, JobError, Settings};
use crate::open::OpenOptions;

#[derive(Parser, Debug)]
#[command(
    name = "archfs",
    version,
    about = "Mount SquashFS images and tar archives read-only with FUSE, \
    fast, for datasets of many small files",
    propagate_version = true
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Mount archives; returns once the mount is live, the server runs on in the background.
    #[command(
        override_usage = "archfs mount [OPTIONS] ARCHIVE... MOUNTPOINT\n       \
                                archfs mount [OPTIONS] ARCHIVE    (prints the mount point it chose)"
    )]
    Mount(MountArgs),
    /// Unmount a mount point (lazily if files are still open there).
    #[command(alias = "umount")]
    Unmount {
        mountpoint: PathBuf,
        /// For a --shared mount: process PID leaves it; it is unmounted once no user is left.
        #[arg(long, value_name = "PID")]
        leave: Option<i32>,
    },
    /// Mount, run a command, unmount when it ends; exits with the command's status.
    #[command(
        override_usage = "archfs run [OPTIONS] ARCHIVE... [MOUNTPOINT] -- COMMAND [ARGS]..."
    )]
    Run {
        /// ARCHIVE... MOUNTPOINT, as for `mount`. The command finds the mount point in
        /// $ARCHFS_MOUNTPOINT too.
        #[arg(required = true, num_args = 1.., value_name = "PATH")]
        paths: Vec<PathBuf>,
        #[command(flatten)]
        serve: ServeArgs,
        /// The command and its arguments, after `--`.
        #[arg(last = true, required = true)]
        command: Vec<OsString>,
    },
    /// Show the archive's format and totals.
    Info {
        archive: PathBuf,
        /// As a mount with --recursive shows it.
        #[arg(long)]
        recursive: bool,
        /// Read an s3:// archive with unsigned requests (a public bucket).
        #[arg(long)]
        no_sign_request: bool,
    },
    /// List a directory inside the archive without mounting it.
    Ls {
        archive: PathBuf,
        #[arg(default_value = "/")]
        path: PathBuf,
        /// As a mount with --recursive shows it.
        #[arg(long)]
        recursive: bool,
        /// Read an s3:// archive with unsigned requests (a public bucket).
        #[arg(long)]
        no_sign_request: bool,
    },
    /// Write a file from the archive to standard output without mounting it.
    Cat {
        archive: PathBuf,
        path: PathBuf,
        /// As a mount with --recursive shows it.
        #[arg(long)]
        recursive: bool,
        /// Read an s3:// archive with unsigned requests (a public bucket).
        #[arg(long)]
        no_sign_request: bool,
    },
    /// Read every directory, inode, file, symlink and xattr; report damage (exit 1 if any).
    Check {
        archive: PathBuf,
        /// As a mount with --recursive shows it.
        #[arg(long)]
        recursive: bool,
        /// Read an s3:// archive with unsigned requests (a public bucket).
        #[arg(long)]
        no_sign_request: bool,
    },
    /// Index a tar archive once, so every later mount skips the scan: for an
    /// s3://BUCKET/KEY archive the index is stored beside it as KEY.archfs-index (you
    /// need write access to the bucket), so jobs on every node mount at once.
    Index {
        archive: PathBuf,
        /// As a mount with --recursive shows it.
        #[arg(long)]
        recursive: bool,
        /// Read an s3:// archive with unsigned requests (a public bucket).
        #[arg(long)]
        no_sign_request: bool,
    },
    /// Print a shell completion script: `archfs completions bash > ~/.local/share/bash-completion/completions/archfs`.
    Completions { shell: clap_complete::Shell },
    /// Print the manual page in roff: `archfs man | man -l -`, or `archfs man mount`.
    Man {
        /// A subcommand whose page to print instead of the main one.
        subcommand: Option<String>,
    },
    #[command(name = "__watchdog", hide = true)]
    Watchdog {
        path: PathBuf,
        #[arg(long)]
        remove_dir: bool,
    },
    #[command(name = "__prelist", hide = true)]
    Prelist {
        root: PathBuf,
        #[arg(long)]
        parent: i32,
        #[arg(long)]
        debug: bool,
    },
}

#[derive(Args, Debug)]
struct MountArgs {
    /// ARCHIVE... MOUNTPOINT: one or more SquashFS images or tar archives (a directory
    /// stands for the archives in it, e.g. WebDataset shards), then the mount point.
    /// Several show as one tree: directories merge, and the archive given last wins for
    /// any other name. A single PATH is an archive, mounted as with --auto-mountpoint.
    #[arg(required = true, num_args = 1.., value_name = "PATH")]
    paths: Vec<PathBuf>,
    #[command(flatten)]
    serve: ServeArgs,
    /// Unmount and exit when process PID ends, however it ends (SIGKILL included): a
    /// notebook or a training rank that owns the mount.
    #[arg(long, value_name = "PID")]
    exit_with: Option<i32>,
    /// One mount for all ranks of a job on a node: the first mounts, the others wait until
    /// it is live and use it; it goes once every rank has left (`archfs unmount --leave`)
    /// or died. A rank is the --exit-with PID, else the calling process. The mount point
    /// is the same for all (with --auto-mountpoint: named after the job and the archive).
    #[arg(long)]
    shared: bool,
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
    /// FUSE request threads [default: twice the CPUs, 4 to 64].
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
    /// Mount options, comma-separated; `allow_other` lets other users read the mount
    /// (ordinary users need `user_allow_other` in /etc/fuse.conf for it).
    #[arg(short = 'o', value_name = "OPTIONS", value_delimiter = ',')]
    options: Vec<String>,
    /// Log every request and more (to the terminal with --foreground, or to --log).
    #[arg(long)]
    debug: bool,
    /// Every PATH is an archive: mount on a new job-private, node-local directory
    /// ($TMPDIR, else /dev/shm, else /tmp; named after $SLURM_JOB_ID) and print its path,
    /// so a job script can write `MNT=$(archfs mount data.sqfs)`. Removed on unmount.
    #[arg(long)]
    auto_mountpoint: bool,
    /// Show tar archives inside a tar archive as directories, named without `.tar`
    /// (compressed ones too, inside a plain tar: without `.tar.gz`, `.tgz`, `.tar.zst`,
    /// `.tar.xz`, `.tar.bz2`...).
    #[arg(long)]
    recursive: bool,
    /// Where a tar archive's index is saved and looked for [default: ARCHIVE.archfs-index
    /// beside the archive if that directory is writable, else ~/.cache/archfs/].
    #[arg(long, value_name = "FILE")]
    index: Option<PathBuf>,
    /// Read the archives into the OS page cache in the background, in a few large parallel
    /// reads, so a first epoch's shuffled reads find them in memory: `auto` once 128 files
    /// have been read, `always` (bare `--preload`) once mounted, or `never`. The data is
    /// left out when it would not fit in free memory. A compressed tar is also decoded
    /// ahead, on every core, into a copy in memory (with `auto`, from mount when its entry
    /// points are over a MiB apart; with `always`, on --stage-dir when it does not fit).
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
    /// Whether directory listings carry each entry's attributes, so that stat or open of
    /// a listed file needs no further request: `always`, `auto` (the kernel decides per
    /// listing) or `never`. With the listing ahead, the lister's carry them, the job's not.
    #[arg(long, value_enum, value_name = "WHEN", default_value_t = Readdirplus::Always)]
    readdirplus: Readdirplus,
    /// List the whole tree in the background once mounted (last directory first, on
    /// spare CPU), so the kernel knows every name and its attributes before the job asks:
    /// a stat or open by path needs no request. The job's own listings then carry no
    /// attributes, which makes them as fast as a plain directory's (ImageFolder's index).
    /// `auto` does when `--readdirplus always` and the kernel's inodes (1.2 KB an entry)
    /// fit in a quarter of free memory; `never` does not.
    #[arg(long, value_enum, value_name = "WHEN", default_value_t = Prelist::Auto)]
    prelist: Prelist,
    /// Compressed tar archives: decoded bytes between the places a read can start
    /// decoding (gzip keeps the part of a 32 KiB window the data refers to for each).
    /// Smaller spends index for faster random reads. Applies when the index is built:
    /// delete a saved one to change it.
    #[arg(long, value_name = "SIZE", default_value = "128K", value_parser = parse_size)]
    entry_spacing: u64,
    /// Where the decoded copy of a compressed tar goes when it does not fit in memory: one
    /// that cannot be read in place (zstd in one frame, xz in one block or in blocks over
    /// 4 MiB), or any with `--preload=always` [default: $TMPDIR, else /tmp].
    #[arg(long, value_name = "DIR")]
    stage_dir: Option<PathBuf>,
    /// Keep the copies of s3:// and https:// archives in --stage-dir (a node-local disk)
    /// for later jobs on the node, up to SIZE in all (K, M, G, T), the least recently
    /// used removed first; a later job checks a copy is of the same object and whole
    /// before it reads it.
    #[arg(long, value_name = "SIZE", value_parser = parse_size, requires = "stage_dir")]
    keep: Option<u64>,
    /// Send unsigned requests for s3:// archives (a public bucket), as the AWS CLI's flag
    /// of that name. Otherwise credentials, endpoint and region come from where the AWS
    /// CLI finds them (AWS_* variables, ~/.aws/credentials, ~/.aws/config).
    #[arg(long)]
    no_sign_request: bool,
    /// How long a request to an object store may be retried (backoff and jitter on 5xx,
    /// 429/503 SlowDown, resets, stalls) before the read that needs it fails with EIO.
    #[arg(long, value_name = "SECONDS", default_value_t = 60.0)]
    retry_for: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, ValueEnum)]
enum Readdirplus {
    Always,
    Auto,
    Never,
}

#[derive(Clone, Copy, Debug, PartialEq, ValueEnum)]
enum Prelist {
    Auto,
    Never,
}

#[derive(Clone, Copy, Debug, PartialEq, ValueEnum)]
enum Preload {
    Auto,
    Always,
    Never,
}

/// A size that is not one.
#[derive(Debug, thiserror::Error)]
pub enum SizeError {
    #[error("unknown size suffix in {0:?}; use K, M, G or T")]
    Suffix(String),
    #[error("{0:?} is not a size; write it like 512M or 2G")]
    NotASize(String),
    #[error("size {0:?} is out of range")]
    Range(String),
}

/// Parses `512M`, `2G`, `1048576`, `64KiB`.
pub fn parse_size(s: &str) -> Result<u64, SizeError> {
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
                _ => return Err(SizeError::Suffix(s.to_owned())),
            };
            (&t[..i], shift)
        }
        _ => (t, 0),
    };
    let n: f64 = num
        .trim()
        .parse()
        .map_err(|_| SizeError::NotASize(s.to_owned()))?;
    if !(0.0..1e19).contains(&n) {
        return Err(SizeError::Range(s.to_owned()));
    }
    Ok((n * (1u64 << shift) as f64) as u64)
}

/// Why a command failed: `main` prints it, one line that says what to do, and exits 1.
#[derive(Debug, thiserror::Error)]
enum Failure {
    /// Mounting, running or unmounting.
    #[error(transparent)]
    Job(#[from] JobError),
    /// Opening or reading an archive for an inspection command.
    #[error(transparent)]
    Archive(#[from] crate::error::Error),
    /// Writing to standard output.
    #[error(transparent)]
    Output(#[from] std::io::Error),
    #[error("--shared mounts serve in the background; drop -f")]
    SharedInForeground,
    #[error("unknown mount option {0:?}; archfs knows allow_other")]
    MountOption(String),
    #[error("--retry-for takes a positive number of seconds")]
    RetryFor,
    #[error("no subcommand {0:?}; see archfs --help")]
    NoSubcommand(String),
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("archfs: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<ExitCode, Failure> {
    if matches!(
        cli.command,
        Cmd::Info { .. }
            | Cmd::Ls { .. }
            | Cmd::Cat { .. }
            | Cmd::Check { .. }
            | Cmd::Completions { .. }
            | Cmd::Man { .. }
    ) {
        // Commands that write to stdout end quietly at `| head`, as other tools do. The
        // mount's processes keep SIGPIPE ignored: nothing should end a server.
        // SAFETY: restoring a default signal action has no preconditions.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    match cli.command {
        Cmd::Mount(args) if args.foreground || args.ready_fd.is_some() => {
            let mut s = settings(&args.paths, &args.serve)?;
            if args.shared {
                if args.foreground {
                    return Err(Failure::SharedInForeground);
                }
                s.shared = true;
                if s.auto_mountpoint {
                    s.mountpoint = job::shared_mountpoint(&s.archives);
                }
            }
            let server = job::Server {
                log: args.log,
                ready_fd: args.ready_fd,
                exit_with: args.exit_with,
            };
            Ok(job::serve(&s, &server)?)
        }
        Cmd::Mount(args) => {
            let mut s = settings(&args.paths, &args.serve)?;
            let path = if args.shared {
                // SAFETY: getppid has no preconditions.
                let owner = args.exit_with.unwrap_or_else(|| unsafe { libc::getppid() });
                s.shared = true;
                if s.auto_mountpoint {
                    s.mountpoint = job::shared_mountpoint(&s.archives);
                }
                job::mount_shared(&s, owner)?
            } else {
                job::mount_in_background()?
            };
            if s.auto_mountpoint {
                println!("{}", path.display());
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Unmount { mountpoint, leave } => {
            match leave {
                Some(pid) => job::leave_shared(&mountpoint, pid)?,
                None => job::unmount(&mountpoint)?,
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Run {
            paths,
            serve,
            command,
        } => Ok(job::run(&settings(&paths, &serve)?, &command)?),
        Cmd::Info {
            archive,
            recursive,
            no_sign_request,
        } => {
            let a = inspect(&archive, recursive, no_sign_request)?;
            let s = a.stats();
            println!("format:     {}", a.format());
            println!("size:       {} bytes", s.bytes);
            println!("inodes:     {}", s.inodes);
            println!("block size: {}", s.block_size);
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Ls {
            archive,
            path,
            recursive,
            no_sign_request,
        } => {
            let a = inspect(&archive, recursive, no_sign_request)?;
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
        Cmd::Cat {
            archive,
            path,
            recursive,
            no_sign_request,
        } => {
            let a = inspect(&archive, recursive, no_sign_request)?;
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
        Cmd::Index {
            archive,
            recursive,
            no_sign_request,
        } => {
            let options = inspect_options(recursive, no_sign_request);
            let to = crate::open::save_index(&archive, &options)?;
            println!("index of {} saved as {to}", archive.display());
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Check {
            archive,
            recursive,
            no_sign_request,
        } => {
            let a = inspect(&archive, recursive, no_sign_request)?;
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
        Cmd::Completions { shell } => {
            let mut cmd = Cli::command();
            clap_complete::generate(shell, &mut cmd, "archfs", &mut std::io::stdout());
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Man { subcommand } => {
            let cmd = Cli::command();
            let page = match subcommand {
                None => cmd,
                Some(name) => {
                    let sub = cmd
                        .find_subcommand(&name)
                        .ok_or_else(|| Failure::NoSubcommand(name.clone()))?;
                    sub.clone().name(format!("archfs-{name}"))
                }
            };
            clap_mangen::Man::new(page).render(&mut std::io::stdout())?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Watchdog { path, remove_dir } => Ok(job::watchdog_main(&path, remove_dir)),
        Cmd::Prelist {
            root,
            parent,
            debug,
        } => {
            job::init_logging(debug, true);
            Ok(crate::warm::prelist::main(&root, parent))
        }
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

fn default_threads() -> usize {
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
    // A big node runs 32+ DataLoader workers; each thread serves one request at a time.
    (cpus * 2).clamp(4, 64)
}

/// What `mount` and `run` were asked for, checked.
fn settings(paths: &[PathBuf], serve: &ServeArgs) -> Result<Settings, Failure> {
    let auto_mountpoint = serve.auto_mountpoint || paths.len() == 1;
    let (mountpoint, archives) = if auto_mountpoint {
        (job::default_mountpoint(&paths[0]), paths)
    } else {
        let (last, rest) = paths.split_last().expect("clap requires one");
        (last.clone(), rest)
    };
    let mut allow_other = false;
    for o in &serve.options {
        match o.as_str() {
            "allow_other" => allow_other = true,
            "ro" | "" => {}
            other => return Err(Failure::MountOption(other.to_owned())),
        }
    }
    Ok(Settings {
        archives: archives.to_vec(),
        mountpoint,
        auto_mountpoint,
        shared: false,
        cache_size: serve.cache_size,
        threads: serve.threads.unwrap_or_else(default_threads),
        allow_other,
        recursive: serve.recursive,
        index: serve.index.clone(),
        entry_spacing: serve.entry_spacing,
        stage_dir: serve.stage_dir.clone(),
        keep: serve.keep,
        no_sign_request: serve.no_sign_request,
        retry_for: std::time::Duration::try_from_secs_f64(serve.retry_for)
            .ok()
            .filter(|d| !d.is_zero())
            .ok_or(Failure::RetryFor)?,
        preload: match serve.preload {
            Preload::Auto => job::Preload::Auto,
            Preload::Always => job::Preload::Always,
            Preload::Never => job::Preload::Never,
        },
        readdirplus: match serve.readdirplus {
            Readdirplus::Always => crate::vfs::Readdirplus::Always,
            Readdirplus::Auto => crate::vfs::Readdirplus::Auto,
            Readdirplus::Never => crate::vfs::Readdirplus::Never,
        },
        prelist: serve.prelist == Prelist::Auto,
        debug: serve.debug,
    })
}

/// Opens an archive for an inspection command, as a mount with the same `--recursive`
/// shows it.
fn inspect(
    path: &std::path::Path,
    recursive: bool,
    no_sign_request: bool,
) -> crate::error::Result<std::sync::Arc<dyn archive::Archive>> {
    let options = inspect_options(recursive, no_sign_request);
    crate::open::open_many(&[path.to_owned()], &CacheConfig::default(), &options)
}

fn inspect_options(recursive: bool, no_sign_request: bool) -> OpenOptions {
    OpenOptions {
        recursive,
        remote: crate::source::RemoteOptions {
            no_sign_request,
            ..Default::default()
        },
        ..OpenOptions::default()
    }
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
