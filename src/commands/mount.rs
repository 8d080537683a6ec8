//! `archfs mount`: archives mounted, by a server that runs on in the background (or in the
//! foreground, `-f`), alone or `--shared` by the ranks of a job on a node.

use std::path::PathBuf;
use std::process::ExitCode;

use super::serve::ServeArgs;
use super::Failure;
use crate::job;

#[derive(clap::Args, Debug)]
pub(super) struct MountArgs {
    /// ARCHIVE... MOUNTPOINT: one or more SquashFS images or tar archives (a directory
    /// stands for the archives in it, e.g. WebDataset shards), then the mount point.
    /// Several show as one tree: directories merge, and the archive given last wins for
    /// any other name. A single PATH is an archive, mounted as with --auto-mountpoint.
    #[arg(required = true, num_args = 1.., value_name = "PATH")]
    paths: Vec<PathBuf>,
    #[command(flatten)]
    serve: ServeArgs,
    /// Unmount and exit when process PID ends, however it ends (SIGKILL included): a
    /// notebook or a training rank that owns the mount.
    #[arg(long, value_name = "PID")]
    exit_with: Option<i32>,
    /// One mount for all ranks of a job on a node: the first mounts, the others wait until
    /// it is live and use it; it goes once every rank has left (`archfs unmount --leave`)
    /// or died. A rank is the --exit-with PID, else the calling process. The mount point
    /// is the same for all (with --auto-mountpoint: named after the job and the archive).
    #[arg(long)]
    shared: bool,
    /// Serve in the foreground instead of returning once the mount is live.
    #[arg(short, long)]
    foreground: bool,
    /// Where the background server writes its log (default: discarded).
    #[arg(long, value_name = "FILE")]
    log: Option<PathBuf>,
    /// Internal: the descriptor on which the server reports readiness to its parent.
    #[arg(long, hide = true)]
    ready_fd: Option<i32>,
}

pub(super) fn run(args: MountArgs) -> Result<ExitCode, Failure> {
    let mut s = args.serve.settings(&args.paths)?;
    // The server itself: in the foreground, or the child `mount_in_background` started.
    if args.foreground || args.ready_fd.is_some() {
        if args.shared {
            if args.foreground {
                return Err(Failure::SharedInForeground);
            }
            s.shared = true;
            if s.auto_mountpoint {
                s.mountpoint = job::shared_mountpoint(&s.archives);
            }
        }
        let server = job::Server {
            log: args.log,
            ready_fd: args.ready_fd,
            exit_with: args.exit_with,
        };
        return Ok(job::serve(&s, &server)?);
    }
    let path = if args.shared {
        // SAFETY: getppid has no preconditions.
        let owner = args.exit_with.unwrap_or_else(|| unsafe { libc::getppid() });
        s.shared = true;
        if s.auto_mountpoint {
            s.mountpoint = job::shared_mountpoint(&s.archives);
        }
        job::mount_shared(&s, owner)?
    } else {
        job::mount_in_background()?
    };
    if s.auto_mountpoint {
        println!("{}", path.display());
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::commands::{Cli, Cmd};
    use crate::job::Preload;

    fn mount_args(argv: &[&str]) -> MountArgs {
        match Cli::try_parse_from(argv).unwrap().command {
            Cmd::Mount(m) => m,
            other => panic!("parsed as {other:?}"),
        }
    }

    #[test]
    fn preload_defaults_to_auto_and_a_bare_flag_takes_no_path() {
        let m = mount_args(&["archfs", "mount", "a.sqfs", "mnt"]);
        assert_eq!(m.serve.preload, Preload::Auto);
        let m = mount_args(&["archfs", "mount", "--preload", "a.sqfs", "mnt"]);
        assert_eq!(m.serve.preload, Preload::Always);
        assert_eq!(m.paths, [PathBuf::from("a.sqfs"), PathBuf::from("mnt")]);
        let m = mount_args(&["archfs", "mount", "a.sqfs", "mnt", "--preload=never"]);
        assert_eq!(m.serve.preload, Preload::Never);
        assert!(Cli::try_parse_from(["archfs", "mount", "--preload=soon", "a", "m"]).is_err());
    }
}
