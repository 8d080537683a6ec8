//! `archfs completions SHELL`: a completion script, made from the same definitions as
//! `--help`.

use std::process::ExitCode;

use clap::CommandFactory;

use super::{Cli, Failure};

#[derive(clap::Args, Debug)]
pub(super) struct CompletionsArgs {
    shell: clap_complete::Shell,
}

pub(super) fn run(args: CompletionsArgs) -> Result<ExitCode, Failure> {
    let mut cmd = Cli::command();
    clap_complete::generate(args.shell, &mut cmd, "archfs", &mut std::io::stdout());
    Ok(ExitCode::SUCCESS)
}
