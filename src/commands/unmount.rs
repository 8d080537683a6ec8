//! `archfs unmount`: a mount point unmounted (lazily if files are still open there), or,
//! with `--leave`, a rank leaving a `--shared` mount.

use std::path::PathBuf;
use std::process::ExitCode;

use super::Failure;
use crate::job;

#[derive(clap::Args, Debug)]
pub(super) struct UnmountArgs {
    mountpoint: PathBuf,
    /// For a --shared mount: process PID leaves it; it is unmounted once no user is left.
    #[arg(long, value_name = "PID")]
    leave: Option<i32>,
}

pub(super) fn run(args: UnmountArgs) -> Result<ExitCode, Failure> {
    match args.leave {
        Some(pid) => job::leave_shared(&args.mountpoint, pid)?,
        None => job::unmount(&args.mountpoint)?,
    }
    Ok(ExitCode::SUCCESS)
}
