//! Attaching a FUSE connection to a directory: mount(2) as root, `fusermount3` otherwise.
//!
//! fuser can mount too, but a fuser 0.18 session unmounts its path again when it ends (its
//! "still mounted?" check always answers yes). When the filesystem was unmounted from
//! outside and a new mount has already taken the path, that late unmount removes the new
//! mount. So archfs mounts here, hands the descriptor to `Session::from_fd`, and unmounts
//! only through `mountpoint`, only while it knows the mount is its own.

use std::ffi::CString;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};

use super::mountpoint::{fusermount_missing, is_root};

/// Mounts a read-only FUSE filesystem of type `fuse.archfs` on `path` (a directory) and
/// returns the /dev/fuse descriptor to serve it from.
pub fn mount(path: &Path, fsname: &str, allow_other: bool) -> io::Result<OwnedFd> {
    if is_root() {
        match mount_sys(path, fsname, allow_other) {
            // In a user namespace root may still lack CAP_SYS_ADMIN: let fusermount3 try.
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => {}
            other => return other,
        }
    }
    mount_fusermount(path, fsname, allow_other)
}

fn cstring(bytes: &[u8]) -> io::Result<CString> {
    CString::new(bytes).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "contains NUL"))
}

fn mount_sys(path: &Path, fsname: &str, allow_other: bool) -> io::Result<OwnedFd> {
    let dev = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")?;
    // SAFETY: geteuid/getegid have no preconditions.
    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    let data = format!(
        "fd={},rootmode=40000,user_id={uid},group_id={gid},default_permissions{}",
        dev.as_raw_fd(),
        if allow_other { ",allow_other" } else { "" }
    );
    let source = cstring(fsname.as_bytes())?;
    let target = cstring(path.as_os_str().as_bytes())?;
    let data = cstring(data.as_bytes())?;
    let flags = libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOATIME;
    // SAFETY: every pointer is a valid NUL-terminated string that outlives the call.
    let rc = unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            c"fuse.archfs".as_ptr(),
            flags,
            data.as_ptr().cast(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(dev.into())
}

/// fusermount3's `-o` list escapes commas and backslashes in values with a backslash.
fn escape_option(value: &str) -> String {
    value.replace('\\', "\\\\").replace(',', "\\,")
}

fn mount_fusermount(path: &Path, fsname: &str, allow_other: bool) -> io::Result<OwnedFd> {
    let mut opts = format!(
        "ro,nosuid,nodev,noatime,default_permissions,subtype=archfs,fsname={}",
        escape_option(fsname)
    );
    if allow_other {
        opts.push_str(",allow_other");
    }
    let (ours, theirs) = UnixStream::pair()?;
    let theirs_fd = theirs.as_raw_fd();
    let mut last = None;
    for prog in ["fusermount3", "fusermount"] {
        let mut cmd = Command::new(prog);
        cmd.arg("-o")
            .arg(&opts)
            .arg("--")
            .arg(path)
            .env("_FUSE_COMMFD", theirs_fd.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        // SAFETY: fcntl is async-signal-safe; it keeps the socket open across exec.
        unsafe {
            cmd.pre_exec(move || {
                if libc::fcntl(theirs_fd, libc::F_SETFD, 0) < 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                last = Some(e);
                continue;
            }
            Err(e) => return Err(e),
        };
        drop(theirs);
        let received = receive_fd(&ours);
        drop(ours);
        let mut stderr = String::new();
        if let Some(mut s) = child.stderr.take() {
            let _ = s.read_to_string(&mut stderr);
        }
        let status = child.wait()?;
        return match received {
            Ok(fd) => Ok(fd),
            Err(_) => {
                let msg = stderr.trim();
                let kind = if msg.contains("user_allow_other") || msg.contains("ermission denied") {
                    io::ErrorKind::PermissionDenied
                } else if msg.contains("No such file or directory") {
                    io::ErrorKind::NotFound
                } else {
                    io::ErrorKind::Other
                };
                Err(io::Error::new(
                    kind,
                    format!("{prog} failed ({status}): {msg}"),
                ))
            }
        };
    }
    Err(fusermount_missing(last))
}

/// Receives the /dev/fuse descriptor fusermount3 sends as SCM_RIGHTS.
fn receive_fd(sock: &UnixStream) -> io::Result<OwnedFd> {
    let mut byte = [0u8; 1];
    let (n, fds) = crate::node::recv_fds(sock.as_raw_fd(), &mut byte)?;
    if n == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "fusermount3 exited without sending the FUSE descriptor",
        ));
    }
    fds.into_iter().next().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            "fusermount3 sent no FUSE descriptor",
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn option_values_escape_commas_and_backslashes() {
        assert_eq!(escape_option("/data/a,b.sqfs"), "/data/a\\,b.sqfs");
        assert_eq!(escape_option("x\\y"), "x\\\\y");
    }
}
