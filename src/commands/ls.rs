//! `archfs ls`: a directory of the archive listed as `ls -l` would, without a mount.

use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::process::ExitCode;

use super::{ArchiveArgs, Failure};
use crate::archive::{self, Kind};

#[derive(clap::Args, Debug)]
pub(super) struct LsArgs {
    #[command(flatten)]
    archive: ArchiveArgs,
    #[arg(default_value = "/")]
    path: PathBuf,
}

pub(super) fn run(args: LsArgs) -> Result<ExitCode, Failure> {
    let a = args.archive.open()?;
    let path = args.path;
    let attr = archive::resolve(&*a, &path)?;
    let mut out = std::io::stdout().lock();
    let entries = if attr.kind == Kind::Dir {
        a.read_dir(attr.ino)?
            .into_iter()
            .map(|e| (e.name.to_vec(), e.ino))
            .collect()
    } else {
        vec![(path.as_os_str().as_bytes().to_vec(), attr.ino)]
    };
    for (name, ino) in entries {
        let at = a.attr(ino)?;
        write!(
            out,
            "{} {:>3} {:>6} {:>6} {:>12} {:>11} ",
            mode_string(at.kind, at.perm),
            at.nlink,
            at.uid,
            at.gid,
            at.size,
            at.mtime
        )?;
        out.write_all(&name)?;
        if at.kind == Kind::Symlink {
            out.write_all(b" -> ")?;
            out.write_all(&a.readlink(ino)?)?;
        }
        out.write_all(b"\n")?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `drwxr-xr-x`, as `ls -l` writes a mode.
fn mode_string(kind: Kind, perm: u16) -> String {
    let t = match kind {
        Kind::File => '-',
        Kind::Dir => 'd',
        Kind::Symlink => 'l',
        Kind::BlockDev => 'b',
        Kind::CharDev => 'c',
        Kind::Fifo => 'p',
        Kind::Socket => 's',
    };
    let mut s = String::from(t);
    for shift in [6, 3, 0] {
        let bits = (perm >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}
