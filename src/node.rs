//! What the processes of one job on one node find of each other: abstract Unix sockets,
//! named by user, job and what they hold. A name is bound while a process holds its
//! socket and freed by the kernel when the last holder ends, SIGKILL included, so nothing
//! is left on disk and no later start has anything to clean. Names are visible node-wide
//! (per network namespace) to every user, so both ends check the other's user: another
//! user's process is never served nor believed. Descriptors (a memfd) pass as
//! SCM_RIGHTS. A leaf: nothing here knows what is shared.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Once;
use std::time::{Duration, Instant};

/// The job a name belongs to: the batch system's job id, else none (the user's
/// processes on the node then share).
pub fn job() -> String {
    ["SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "FLUX_JOB_ID"]
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|j| !j.is_empty()))
        .map(|j| j.replace(['/', '\0'], "_"))
        .unwrap_or_else(|| "-".into())
}

fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

/// `archfs/KIND/uUID/jJOB/nHOST/KEY`: private to this user and job by its checks, not by
/// the kernel (abstract names have no permissions). HOST, the host name hashed, tells
/// nodes apart that share a network namespace: the nodes a test makes of one machine
/// (each its own UTS namespace), or containers of one job.
pub fn name(kind: &str, key: &str) -> String {
    format!("archfs/{kind}/u{}/j{}/n{:08x}/{key}", euid(), job(), host())
}

/// The host name, hashed to 32 bits (a name must fit in 107 bytes).
fn host() -> u32 {
    use std::hash::{Hash, Hasher};
    static HOST: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *HOST.get_or_init(|| {
        let mut buf = [0u8; 256];
        // SAFETY: gethostname writes at most `buf.len()` bytes into `buf`.
        let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
        let name = if rc == 0 { &buf[..] } else { &[][..] };
        let name = name.split(|&b| b == 0).next().unwrap_or_default();
        let mut h = std::collections::hash_map::DefaultHasher::new();
        name.hash(&mut h);
        h.finish() as u32
    })
}

/// A seqpacket socket of this process's (each send one message, boundaries kept, with
/// or without descriptors) that a forked child does not keep (see [`INHERITED`]).
#[derive(Debug)]
pub struct Sock(OwnedFd);

impl Sock {
    fn new(fd: OwnedFd) -> Sock {
        close_in_children(fd.as_raw_fd());
        Sock(fd)
    }

    fn open() -> io::Result<Sock> {
        // SAFETY: socket makes a new descriptor; checked.
        let fd =
            unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a new descriptor nothing else owns.
        Ok(Sock::new(unsafe { OwnedFd::from_raw_fd(fd) }))
    }
}

impl AsRawFd for Sock {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

impl Drop for Sock {
    fn drop(&mut self) {
        let fd = self.0.as_raw_fd();
        for slot in &INHERITED {
            let _ = slot.compare_exchange(fd, -1, Ordering::AcqRel, Ordering::Acquire);
        }
    }
}

/// The abstract address of `name`, and its length.
fn address(name: &str) -> io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    // SAFETY: sockaddr_un is plain data.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as _;
    let bytes = name.as_bytes();
    if bytes.len() + 1 > addr.sun_path.len() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "name too long"));
    }
    for (d, &b) in addr.sun_path[1..].iter_mut().zip(bytes) {
        *d = b as _;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + 1 + bytes.len();
    Ok((addr, len as libc::socklen_t))
}

/// A new socket, bound or connected (`call`) to `name`'s address.
fn at(
    name: &str,
    call: unsafe extern "C" fn(libc::c_int, *const libc::sockaddr, libc::socklen_t) -> libc::c_int,
) -> io::Result<Sock> {
    let sock = Sock::open()?;
    let (addr, len) = address(name)?;
    // SAFETY: bind or connect with a valid address of `len` bytes.
    if unsafe {
        call(
            sock.as_raw_fd(),
            (&addr as *const libc::sockaddr_un).cast(),
            len,
        )
    } != 0
    {
        return Err(io::Error::last_os_error());
    }
    Ok(sock)
}

/// Listens on `name`; `None` when another process holds it.
pub fn listen(name: &str) -> io::Result<Option<Sock>> {
    let sock = match at(name, libc::bind) {
        Ok(s) => s,
        Err(e) if e.raw_os_error() == Some(libc::EADDRINUSE) => return Ok(None),
        Err(e) => return Err(e),
    };
    // SAFETY: listen on a bound socket we own.
    if unsafe { libc::listen(sock.as_raw_fd(), 128) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(Some(sock))
}

/// Connects to `name` when some process of this user listens there; `None` when no one
/// does. A name held by another user's process is an error: that process is not ours.
pub fn connect(name: &str) -> io::Result<Option<Sock>> {
    let sock = match at(name, libc::connect) {
        Ok(s) => s,
        Err(e) if matches!(e.raw_os_error(), Some(libc::ECONNREFUSED | libc::ENOENT)) => {
            return Ok(None)
        }
        Err(e) => return Err(e),
    };
    let peer = peer(&sock)?;
    if peer.uid != euid() {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "the node-wide name {name} is held by user {}, not by this user",
                peer.uid
            ),
        ));
    }
    Ok(Some(sock))
}

/// Accepts a connection of this user's, with its process; others are closed at once.
/// `None` also when none is waiting (for a non-blocking listener).
pub fn accept(listener: &Sock) -> io::Result<Option<(Sock, i32)>> {
    // SAFETY: accept4 on a listening socket we own; the result is checked.
    let fd = unsafe {
        libc::accept4(
            listener.as_raw_fd(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            libc::SOCK_CLOEXEC,
        )
    };
    if fd < 0 {
        let e = io::Error::last_os_error();
        return match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(None),
            _ => Err(e),
        };
    }
    // SAFETY: a new descriptor nothing else owns.
    let sock = Sock::new(unsafe { OwnedFd::from_raw_fd(fd) });
    let peer = peer(&sock)?;
    if peer.uid != euid() {
        tracing::warn!(
            "user {} (process {}) asked for this user's node-local copies; refused",
            peer.uid,
            peer.pid
        );
        return Ok(None);
    }
    Ok(Some((sock, peer.pid)))
}

/// Makes [`accept`] on `sock` return at once when no one waits.
pub fn nonblocking(sock: &Sock) {
    // SAFETY: fcntl on a descriptor we own.
    unsafe {
        let flags = libc::fcntl(sock.as_raw_fd(), libc::F_GETFL);
        libc::fcntl(sock.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK);
    }
}

/// The process at the other end of `s`, as the kernel saw it connect.
fn peer(s: &Sock) -> io::Result<libc::ucred> {
    // SAFETY: ucred is plain data; getsockopt writes at most `len` bytes into it.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred)
}

/// Sends `payload` as one message, with `fds` attached.
pub fn send(s: &Sock, payload: &[u8], fds: &[RawFd]) -> io::Result<()> {
    let mut iov = libc::iovec {
        iov_base: payload.as_ptr() as *mut _,
        iov_len: payload.len(),
    };
    let bytes = std::mem::size_of_val(fds);
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(bytes as u32) } as usize;
    let mut control = vec![0u64; space.div_ceil(8)];
    // SAFETY: msghdr is plain data; every pointer set stays valid during sendmsg, and
    // the CMSG_* macros walk within `control`, sized by CMSG_SPACE for `fds`.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if !fds.is_empty() {
            msg.msg_control = control.as_mut_ptr().cast();
            msg.msg_controllen = space as _;
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(bytes as u32) as _;
            std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c).cast(), fds.len());
        }
        loop {
            if libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) >= 0 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

/// Receives one message into `buf` and the descriptors sent with it. Zero bytes: the
/// other end closed.
pub fn recv(s: &Sock, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    recv_fds(s.as_raw_fd(), buf)
}

/// Receives one message on socket `fd` into `buf` and the descriptors sent with it
/// (close-on-exec): how many bytes came, and the descriptors. Zero bytes: the other end
/// closed.
pub fn recv_fds(fd: RawFd, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // Room for a few descriptors, 8-byte aligned.
    let mut control = [0u64; 16];
    // SAFETY: msghdr is plain data; the pointers set below stay valid during recvmsg.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control) as _;
    let n = loop {
        // SAFETY: msg describes buffers owned by this frame.
        let n = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    let mut fds = Vec::new();
    // SAFETY: the kernel filled msg's control buffer; CMSG_* walk within it, and each
    // descriptor in an SCM_RIGHTS message is new to this process.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c) as *const RawFd;
                let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize)
                    / std::mem::size_of::<RawFd>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok((n, fds))
}

/// What names a set of archives alike in every process of the job: a local file by its
/// device, inode, size and change time (the same file under another path is the same
/// archive), anything else (a URL) as written; hashed, for a name.
pub fn archives_key(paths: &[std::path::PathBuf]) -> String {
    use std::hash::{Hash, Hasher};
    use std::os::unix::fs::MetadataExt;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for p in paths {
        match std::fs::metadata(p) {
            Ok(m) => (m.dev(), m.ino(), m.size(), m.ctime(), m.ctime_nsec()).hash(&mut h),
            Err(_) => p.hash(&mut h),
        }
    }
    format!("{:016x}", h.finish())
}

/// Whether this process is the first of the job on the node to ask for `what` of
/// `key`; the first keeps it until it ends (a forked child does not inherit it). A name
/// that cannot be had for another reason (another user holds it) answers yes: the work
/// is done twice rather than not at all.
pub fn first_for(what: &str, key: &str) -> bool {
    match listen(&name(what, key)) {
        Ok(Some(sock)) => {
            std::mem::forget(sock);
            true
        }
        Ok(None) => false,
        Err(_) => true,
    }
}

/// Whether process `pid` exists and is not a zombie.
pub fn running(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with(['Z', 'X'])),
        // No /proc (or not ours to read): the signal said it exists.
        Err(e) => e.kind() != io::ErrorKind::NotFound,
    }
}

/// A node-wide lock, for all users: held while its name is bound. What it guards
/// (deciding where a copy goes and reserving its room) is short and rare, so a waiter
/// polls. Freed on drop or when the holder ends, however it ends.
pub struct NodeLock(#[allow(dead_code)] Sock);

impl NodeLock {
    /// Waits up to `patience` for `what`; `None` when another process held it all along
    /// (the caller goes on unguarded rather than hang).
    pub fn take(what: &str, patience: Duration) -> Option<NodeLock> {
        let name = format!("archfs/lock/{what}");
        let until = Instant::now() + patience;
        loop {
            match listen(&name) {
                Ok(Some(l)) => return Some(NodeLock(l)),
                Ok(None) if Instant::now() < until => std::thread::sleep(Duration::from_millis(5)),
                _ => return None,
            }
        }
    }
}

/// Sockets a forked child must not keep: a child that never serves a listener it holds
/// would keep its name bound with no one to answer. Closed in the child by an atfork
/// handler (close is async-signal-safe).
static INHERITED: [AtomicI32; 64] = [const { AtomicI32::new(-1) }; 64];

extern "C" fn close_inherited() {
    for slot in &INHERITED {
        let fd = slot.swap(-1, Ordering::AcqRel);
        if fd >= 0 {
            // SAFETY: a socket of the parent's that this child was never to use.
            unsafe { libc::close(fd) };
        }
    }
}

fn close_in_children(fd: RawFd) {
    static HOOK: Once = Once::new();
    // SAFETY: registers a handler that only closes descriptors and swaps atomics.
    HOOK.call_once(|| unsafe {
        libc::pthread_atfork(None, None, Some(close_inherited));
    });
    // Past 64 held at once a child keeps the rest: it closes them when it ends.
    let _ = INHERITED.iter().find(|s| {
        s.compare_exchange(-1, fd, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_is_held_once_and_freed_with_its_holder() {
        let name = format!("archfs/test/{}/held", std::process::id());
        assert!(connect(&name).unwrap().is_none());
        let l = listen(&name).unwrap().expect("free");
        assert!(listen(&name).unwrap().is_none(), "bound twice");
        let c = connect(&name).unwrap().expect("listened");
        let (s, pid) = accept(&l).unwrap().expect("same user");
        assert_eq!(pid, std::process::id() as i32);
        let memfd = crate::source::scratch::memfd().unwrap();
        send(&s, b"hello", &[memfd.as_raw_fd()]).unwrap();
        send(&s, b"again", &[]).unwrap();
        let mut buf = [0u8; 16];
        let (n, fds) = recv(&c, &mut buf).unwrap();
        assert_eq!((&buf[..n], fds.len()), (&b"hello"[..], 1));
        let (n, fds) = recv(&c, &mut buf).unwrap();
        assert_eq!(
            (&buf[..n], fds.len()),
            (&b"again"[..], 0),
            "messages ran together"
        );
        drop(l);
        assert!(listen(&name).unwrap().is_some(), "not freed");
        drop(s);
        let (n, _) = recv(&c, &mut buf).unwrap();
        assert_eq!(n, 0, "no end of stream when the holder closed");
    }
}
