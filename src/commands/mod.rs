//! The command line: `mount`, `unmount`, `run`, and inspection commands that read an
//! archive without mounting it. One file a subcommand, with its arguments and its body;
//! `run` only dispatches.

mod cat;
mod check;
mod completions;
mod index;
mod info;
mod ls;
mod man;
mod mount;
mod prelist;
mod run;
mod serve;
mod unmount;
mod watchdog;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};

use crate::archive::Archive;
use crate::cache::CacheConfig;
use crate::job::JobError;
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
    Mount(mount::MountArgs),
    /// Unmount a mount point (lazily if files are still open there).
    #[command(alias = "umount")]
    Unmount(unmount::UnmountArgs),
    /// Mount, run a command, unmount when it ends; exits with the command's status.
    #[command(
        override_usage = "archfs run [OPTIONS] ARCHIVE... [MOUNTPOINT] -- COMMAND [ARGS]..."
    )]
    Run(run::RunArgs),
    /// Show the archive's format and totals.
    Info(ArchiveArgs),
    /// List a directory inside the archive without mounting it.
    Ls(ls::LsArgs),
    /// Write a file from the archive to standard output without mounting it.
    Cat(cat::CatArgs),
    /// Read every directory, inode, file, symlink and xattr; report damage (exit 1 if any).
    Check(ArchiveArgs),
    /// Index a tar archive once, so every later mount skips the scan: for an
    /// s3://BUCKET/KEY archive the index is stored beside it as KEY.archfs-index (you
    /// need write access to the bucket), so jobs on every node mount at once.
    Index(ArchiveArgs),
    /// Print a shell completion script: `archfs completions bash > ~/.local/share/bash-completion/completions/archfs`.
    Completions(completions::CompletionsArgs),
    /// Print the manual page in roff: `archfs man | man -l -`, or `archfs man mount`.
    Man(man::ManArgs),
    #[command(name = "__watchdog", hide = true)]
    Watchdog(watchdog::WatchdogArgs),
    #[command(name = "__prelist", hide = true)]
    Prelist(prelist::PrelistArgs),
}

/// The archive an inspection command reads, and how to open it.
#[derive(clap::Args, Debug)]
struct ArchiveArgs {
    archive: PathBuf,
    /// As a mount with --recursive shows it.
    #[arg(long)]
    recursive: bool,
    /// Read an s3:// archive with unsigned requests (a public bucket).
    #[arg(long)]
    no_sign_request: bool,
}

impl ArchiveArgs {
    /// Opens the archive as a mount with the same `--recursive` shows it.
    fn open(&self) -> crate::error::Result<Arc<dyn Archive>> {
        crate::open::open_many(
            std::slice::from_ref(&self.archive),
            &CacheConfig::default(),
            &self.options(),
        )
    }

    fn options(&self) -> OpenOptions {
        OpenOptions {
            recursive: self.recursive,
            remote: crate::source::RemoteOptions {
                no_sign_request: self.no_sign_request,
                ..Default::default()
            },
            ..OpenOptions::default()
        }
    }
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
        Cmd::Info(_) | Cmd::Ls(_) | Cmd::Cat(_) | Cmd::Check(_) | Cmd::Completions(_) | Cmd::Man(_)
    ) {
        // Commands that write to stdout end quietly at `| head`, as other tools do. The
        // mount's processes keep SIGPIPE ignored: nothing should end a server.
        // SAFETY: restoring a default signal action has no preconditions.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    match cli.command {
        Cmd::Mount(a) => mount::run(a),
        Cmd::Unmount(a) => unmount::run(a),
        Cmd::Run(a) => run::run(a),
        Cmd::Info(a) => info::run(a),
        Cmd::Ls(a) => ls::run(a),
        Cmd::Cat(a) => cat::run(a),
        Cmd::Check(a) => check::run(a),
        Cmd::Index(a) => index::run(a),
        Cmd::Completions(a) => completions::run(a),
        Cmd::Man(a) => man::run(a),
        Cmd::Watchdog(a) => watchdog::run(a),
        Cmd::Prelist(a) => prelist::run(a),
    }
}
