//! `archfs run`: mount, run a command, unmount when it ends; the exit status is the
//! command's.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use super::serve::ServeArgs;
use super::Failure;

#[derive(clap::Args, Debug)]
pub(super) struct RunArgs {
    /// ARCHIVE... MOUNTPOINT, as for `mount`. The command finds the mount point in
    /// $ARCHFS_MOUNTPOINT too.
    #[arg(required = true, num_args = 1.., value_name = "PATH")]
    paths: Vec<PathBuf>,
    #[command(flatten)]
    serve: ServeArgs,
    /// The command and its arguments, after `--`.
    #[arg(last = true, required = true)]
    command: Vec<OsString>,
}

pub(super) fn run(args: RunArgs) -> Result<ExitCode, Failure> {
    Ok(crate::job::run(
        &args.serve.settings(&args.paths)?,
        &args.command,
    )?)
}
