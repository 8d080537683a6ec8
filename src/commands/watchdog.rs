//! `archfs __watchdog` (hidden): the process that unmounts a mount whose server died
//! ([`crate::job::watchdog_main`]).

use std::path::PathBuf;
use std::process::ExitCode;

use super::Failure;

#[derive(clap::Args, Debug)]
pub(super) struct WatchdogArgs {
    path: PathBuf,
    #[arg(long)]
    remove_dir: bool,
}

pub(super) fn run(args: WatchdogArgs) -> Result<ExitCode, Failure> {
    Ok(crate::job::watchdog_main(&args.path, args.remove_dir))
}
