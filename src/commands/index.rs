//! `archfs index`: a tar archive's index saved once, beside it (for s3://, as
//! KEY.archfs-index in the bucket), so every later mount skips the scan.

use std::process::ExitCode;

use super::{ArchiveArgs, Failure};

pub(super) fn run(args: ArchiveArgs) -> Result<ExitCode, Failure> {
    let to = crate::open::save_index(&args.archive, &args.options())?;
    println!("index of {} saved as {to}", args.archive.display());
    Ok(ExitCode::SUCCESS)
}
