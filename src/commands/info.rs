//! `archfs info`: the archive's format and totals.

use std::process::ExitCode;

use super::{ArchiveArgs, Failure};

pub(super) fn run(args: ArchiveArgs) -> Result<ExitCode, Failure> {
    let a = args.open()?;
    let s = a.stats();
    println!("format:     {}", a.format());
    println!("size:       {} bytes", s.bytes);
    println!("inodes:     {}", s.inodes);
    println!("block size: {}", s.block_size);
    Ok(ExitCode::SUCCESS)
}
