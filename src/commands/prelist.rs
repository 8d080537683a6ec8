//! `archfs __prelist` (hidden): the process that lists a mount's tree ahead of the job
//! ([`crate::warm::prelist`]).

use std::path::PathBuf;
use std::process::ExitCode;

use super::Failure;

#[derive(clap::Args, Debug)]
pub(super) struct PrelistArgs {
    root: PathBuf,
    #[arg(long)]
    parent: i32,
    #[arg(long)]
    debug: bool,
}

pub(super) fn run(args: PrelistArgs) -> Result<ExitCode, Failure> {
    crate::logging::init(args.debug, true);
    Ok(crate::warm::prelist::main(&args.root, args.parent))
}
