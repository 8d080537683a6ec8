//! `archfs cat`: a file of the archive to standard output, without a mount.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use super::{ArchiveArgs, Failure};
use crate::archive;

#[derive(clap::Args, Debug)]
pub(super) struct CatArgs {
    #[command(flatten)]
    archive: ArchiveArgs,
    path: PathBuf,
}

pub(super) fn run(args: CatArgs) -> Result<ExitCode, Failure> {
    let a = args.archive.open()?;
    let attr = archive::resolve(&*a, &args.path)?;
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
