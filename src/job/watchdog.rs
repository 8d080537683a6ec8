//! The watchdog: a process of its own that detaches the mount when the server dies
//! without unmounting (SIGKILL, a crash, the OOM killer).

use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, ChildStdin, Command, ExitCode, Stdio};

use super::mountpoint::{self, MountId};
use super::{ENDING, IGNORED};

/// A separate process that detaches the mount when the server is gone and the mount is
/// still there: after SIGKILL, a crash or the OOM killer, or a failed unmount. It works
/// for ordinary users, who cannot use fuse's auto_unmount without allow_other.
///
/// Protocol on its stdin: `m` once the mount is live (the watchdog notes which mount it
/// is), `x` when the server is done; end of input without `x` means the server died.
pub struct Watchdog {
    stdin: ChildStdin,
    child: Child,
}

impl Watchdog {
    /// Started before mounting so it cannot inherit the /dev/fuse descriptor (it would
    /// keep a dead server's connection alive).
    pub fn spawn(path: &Path, remove_dir: bool) -> std::io::Result<Watchdog> {
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.arg("__watchdog").arg(path);
        if remove_dir {
            cmd.arg("--remove-dir");
        }
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: setsid is async-signal-safe; a session of its own keeps the terminal's
        // Ctrl-C and the job's process-group signals away from the watchdog.
        unsafe {
            cmd.pre_exec(|| {
                libc::setsid();
                Ok(())
            });
        }
        let mut child = cmd.spawn()?;
        let stdin = child.stdin.take().expect("piped stdin");
        Ok(Watchdog { stdin, child })
    }

    pub fn arm(&mut self) {
        let _ = self.stdin.write_all(b"m");
    }

    pub fn disarm(mut self) {
        let _ = self.stdin.write_all(b"x");
        drop(self.stdin);
        let _ = self.child.wait();
    }
}

/// The watchdog process (`archfs __watchdog PATH`): waits for the server to finish or
/// die, then detaches the mount it was armed with if that mount is still there.
pub fn watchdog_main(path: &Path, remove_dir: bool) -> ExitCode {
    // Only the server's end decides; a job's signals are for the server.
    for s in ENDING.iter().chain(&IGNORED).chain(&[libc::SIGQUIT]) {
        // SAFETY: ignoring a signal has no preconditions.
        unsafe {
            libc::signal(*s, libc::SIG_IGN);
        }
    }
    let mut mount: Option<MountId> = None;
    let mut byte = [0u8; 1];
    let mut stdin = std::io::stdin().lock();
    loop {
        match stdin.read(&mut byte) {
            Ok(1) if byte[0] == b'm' => mount = mountpoint::entry(path),
            Ok(1) if byte[0] == b'x' => break,
            Ok(1) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            _ => break,
        }
    }
    if mount.is_some_and(|id| mountpoint::is_live(path, &id))
        && mountpoint::lazy_unmount(path).is_ok()
        && remove_dir
    {
        let _ = std::fs::remove_dir(path);
    }
    ExitCode::SUCCESS
}
