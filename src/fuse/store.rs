//! The push's way into the kernel: FUSE notify-store messages written to /dev/fuse here
//! rather than through fuser, so that bytes lying verbatim in the archive file (a tar's
//! members) go by splice(2): the archive's page-cache pages are handed to the kernel
//! through a pipe and copied once, into the FUSE file's pages. Through fuser's notifier
//! they were read into this process first, which on 2 cores is a third of what a cold
//! tar epoch copies
//! (docs/history/2026-11-23-to-25-summary-imagenet-scale-machines.md#splicing-the-push-what-bounds-a-cold-epoch-here-2026-11-25-later).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};

use crate::sync::Mutex;

use crate::warm::push::Store;

/// FUSE_NOTIFY_STORE (include/uapi/linux/fuse.h).
const NOTIFY_STORE: i32 = 4;
/// `fuse_out_header` and `fuse_notify_store_out`.
const HEADER: usize = 16 + 24;
/// The pipe size asked for: fs.pipe-max-size's default, allowed to any user.
const PIPE_BYTES: usize = 1 << 20;

/// Notify-store messages on a connection's /dev/fuse descriptor.
pub struct DevStore {
    dev: OwnedFd,
    /// Pipes for splicing, one per pushing thread at a time.
    pipes: Mutex<Vec<Pipe>>,
    /// splice(2) failed once in a way that will not change: read instead.
    no_splice: AtomicBool,
}

struct Pipe {
    read: OwnedFd,
    write: OwnedFd,
    /// Pages the pipe holds.
    slots: u64,
}

impl Pipe {
    fn new() -> io::Result<Pipe> {
        let mut fds = [0; 2];
        // SAFETY: `fds` has room for the two descriptors pipe2 writes.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: pipe2 succeeded, so both are open descriptors owned by no one else.
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // SAFETY: fcntl on a descriptor we own; a smaller pipe is fine, it is measured.
        let bytes = unsafe {
            libc::fcntl(
                write.as_raw_fd(),
                libc::F_SETPIPE_SZ,
                PIPE_BYTES as libc::c_int,
            );
            libc::fcntl(write.as_raw_fd(), libc::F_GETPIPE_SZ)
        };
        if bytes <= 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Pipe {
            read,
            write,
            // A pipe holds a page a buffer: 256 of 4 KiB pages, 16 of 64 KiB ones.
            slots: bytes as u64 / crate::memory::page_size() as u64,
        })
    }
}

fn header(ino: u64, at: u64, len: u32) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[0..4].copy_from_slice(&(HEADER as u32 + len).to_ne_bytes());
    h[4..8].copy_from_slice(&NOTIFY_STORE.to_ne_bytes());
    // unique (8..16) is 0: a notification.
    h[16..24].copy_from_slice(&ino.to_ne_bytes());
    h[24..32].copy_from_slice(&at.to_ne_bytes());
    h[32..36].copy_from_slice(&len.to_ne_bytes());
    h
}

/// What the kernel says of a store: an inode it no longer holds is no failure.
fn sent(rc: isize) -> io::Result<()> {
    if rc >= 0 {
        return Ok(());
    }
    match io::Error::last_os_error() {
        e if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        e => Err(e),
    }
}

impl DevStore {
    /// Pushes through `dev`, a duplicate of the session's /dev/fuse descriptor.
    pub fn new(dev: OwnedFd) -> DevStore {
        DevStore {
            dev,
            pipes: Mutex::new(Vec::new()),
            no_splice: Default::default(),
        }
    }

    /// One message, header `h` and the `len` bytes at `pos` of `fd`, through `pipe`.
    /// `Ok(false)`: the source ended early or cannot splice; the pipe may hold part of the
    /// message then and is dropped.
    fn splice_one(
        &self,
        pipe: &Pipe,
        h: [u8; HEADER],
        src: (BorrowedFd<'_>, u64),
        len: u32,
    ) -> io::Result<bool> {
        let (fd, pos) = src;
        // SAFETY: writes `h`, which lives across the call, to a pipe we own.
        let n = unsafe { libc::write(pipe.write.as_raw_fd(), h.as_ptr().cast(), HEADER) };
        if n != HEADER as isize {
            return Ok(false);
        }
        let mut off = pos as libc::loff_t;
        let mut left = len as usize;
        while left > 0 {
            // SAFETY: splice between descriptors we hold, `off` outlives the call.
            let n = unsafe {
                libc::splice(
                    fd.as_raw_fd(),
                    &mut off,
                    pipe.write.as_raw_fd(),
                    std::ptr::null_mut(),
                    left,
                    0,
                )
            };
            if n <= 0 {
                let e = io::Error::last_os_error();
                if n < 0 && matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS)) {
                    self.no_splice.store(true, Ordering::Relaxed);
                }
                return Ok(false);
            }
            left -= n as usize;
        }
        // SAFETY: splice from our pipe to /dev/fuse; the kernel takes the whole message.
        let n = unsafe {
            libc::splice(
                pipe.read.as_raw_fd(),
                std::ptr::null_mut(),
                self.dev.as_raw_fd(),
                std::ptr::null_mut(),
                HEADER + len as usize,
                0,
            )
        };
        if n < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL) {
            // A kernel whose /dev/fuse takes no splice: written from memory from now on.
            self.no_splice.store(true, Ordering::Relaxed);
            return Ok(false);
        }
        sent(n).map(|()| true)
    }
}

impl Store for DevStore {
    fn store(&self, ino: u64, at: u64, data: &[u8]) -> io::Result<()> {
        let h = header(ino, at, data.len() as u32);
        let iov = [
            libc::iovec {
                iov_base: h.as_ptr() as *mut _,
                iov_len: HEADER,
            },
            libc::iovec {
                iov_base: data.as_ptr() as *mut _,
                iov_len: data.len(),
            },
        ];
        // SAFETY: both buffers outlive the call; the kernel only reads them.
        sent(unsafe { libc::writev(self.dev.as_raw_fd(), iov.as_ptr(), 2) })
    }

    fn store_from(
        &self,
        ino: u64,
        at: u64,
        fd: BorrowedFd<'_>,
        pos: u64,
        len: u32,
    ) -> io::Result<bool> {
        if self.no_splice.load(Ordering::Relaxed) {
            return Ok(false);
        }
        let pipe = match self.pipes.lock().pop() {
            Some(p) => p,
            None => match Pipe::new() {
                Ok(p) => p,
                Err(_) => return Ok(false),
            },
        };
        // The whole message must be in the pipe before /dev/fuse takes it: the header
        // takes a page, the bytes one per page they touch.
        let room = (pipe.slots.saturating_sub(2) * crate::memory::page_size() as u64) as u32;
        if room == 0 {
            return Ok(false);
        }
        let mut done = 0u32;
        while done < len {
            let n = (len - done).min(room);
            let h = header(ino, at + u64::from(done), n);
            match self.splice_one(&pipe, h, (fd, pos + u64::from(done)), n) {
                Ok(true) => done += n,
                // The pipe may hold part of a message: it goes. The caller reads instead.
                Ok(false) => return Ok(false),
                Err(e) => return Err(e),
            }
        }
        self.pipes.lock().push(pipe);
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    /// The messages in `bytes`: (inode, offset, data), each header checked.
    fn messages(mut bytes: &[u8]) -> Vec<(u64, u64, Vec<u8>)> {
        let word = |b: &[u8], at: usize, n: usize| -> u64 {
            let mut v = [0u8; 8];
            v[..n].copy_from_slice(&b[at..at + n]);
            u64::from_ne_bytes(v)
        };
        let mut out = Vec::new();
        while !bytes.is_empty() {
            let len = word(bytes, 0, 4) as usize;
            assert_eq!(word(bytes, 4, 4), NOTIFY_STORE as u64, "code");
            assert_eq!(word(bytes, 8, 8), 0, "unique of a notification");
            let size = word(bytes, 32, 4) as usize;
            assert_eq!(len, HEADER + size, "length in the header");
            out.push((
                word(bytes, 16, 8),
                word(bytes, 24, 8),
                bytes[HEADER..len].to_vec(),
            ));
            bytes = &bytes[len..];
        }
        out
    }

    /// A regular file takes spliced pipes as /dev/fuse does, and keeps what it was sent.
    #[test]
    fn bytes_from_memory_and_from_a_file_arrive_as_store_messages() {
        let dir = std::env::temp_dir().join(format!("archfs-store-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        // A multiplicative hash of the position: a byte from the wrong place shows.
        let src: Vec<u8> = (0u32..3 << 20)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
            .collect();
        std::fs::write(dir.join("archive"), &src).unwrap();
        let archive = std::fs::File::open(dir.join("archive")).unwrap();
        let sent = std::fs::File::create(dir.join("sent")).unwrap();
        let store = DevStore::new(sent.into());

        store.store(7, 0, b"hello").unwrap();
        // Unaligned and longer than a pipe holds: several messages.
        let (pos, len) = (1000, (5 << 19) + 3);
        assert!(store
            .store_from(9, 4096, archive.as_fd(), pos, len)
            .unwrap());
        assert!(
            !store.no_splice.load(Ordering::Relaxed),
            "splice was given up"
        );
        // Past the end of the file: not sent, so read instead.
        assert!(!store
            .store_from(9, 0, archive.as_fd(), src.len() as u64 - 10, 20)
            .unwrap());

        let got = messages(&std::fs::read(dir.join("sent")).unwrap());
        assert_eq!(got[0], (7, 0, b"hello".to_vec()));
        let spliced = &got[1..];
        assert!(spliced.len() >= 3, "{} messages", spliced.len());
        let mut at = 4096;
        for (ino, offset, data) in spliced {
            assert_eq!((*ino, *offset), (9, at));
            assert!(data.len() <= PIPE_BYTES - 2 * crate::memory::page_size());
            let from = (pos + at - 4096) as usize;
            assert!(*data == src[from..from + data.len()], "bytes at {at}");
            at += data.len() as u64;
        }
        assert_eq!(at, 4096 + u64::from(len), "every byte sent once");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
