//! `archfs man [SUBCOMMAND]`: the manual page in roff, made from the same definitions as
//! `--help`.

use std::process::ExitCode;

use clap::CommandFactory;

use super::{Cli, Failure};

#[derive(clap::Args, Debug)]
pub(super) struct ManArgs {
    /// A subcommand whose page to print instead of the main one.
    subcommand: Option<String>,
}

pub(super) fn run(args: ManArgs) -> Result<ExitCode, Failure> {
    let cmd = Cli::command();
    let page = match args.subcommand {
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
