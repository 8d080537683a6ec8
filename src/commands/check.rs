//! `archfs check`: every directory, inode, file, symlink and xattr read; damage reported,
//! and exit 1 if there is any.

use std::io::Write;
use std::process::ExitCode;

use super::{ArchiveArgs, Failure};
use crate::archive::check::{check, Limits};

pub(super) fn run(args: ArchiveArgs) -> Result<ExitCode, Failure> {
    let a = args.open()?;
    let r = check(&*a, Limits::ALL);
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
