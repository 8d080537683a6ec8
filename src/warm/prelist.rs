//! Listing the whole tree through the mount as soon as it is live, in a process of its
//! own, so the kernel holds every name with its attributes before the job asks for them.
//!
//! The kernel builds an inode and a dentry for every entry of a READDIRPLUS reply, in the
//! thread that lists: about 4 µs an entry, 5 s of one core for ImageNet's 1.28 M files,
//! which made ImageFolder's index 1.8-2.2x slower than on a plain directory. So the two
//! kinds of listing are told apart ([`ListerPid`]): the job's carry no attributes and cost
//! what a plain directory's do, the lister's carry them all, on spare CPU (nice 19). A
//! stat or open by path (a dataset indexed by a file list) then finds its dentry with no
//! LOOKUP round trip: at 1.28 M files, 42.7 s became 6.0 s
//! (docs/history/2026-11-23-to-25-summary-imagenet-scale-machines.md#listing-the-tree-ahead-2026-11-25).
//!
//! A process, not a thread: a server thread blocked on a request to its own mount keeps a
//! killed server from exiting (the kernel waits for the reply without end once the
//! request was read), so its /dev/fuse stays open and the mount stays. The lister dies
//! with the server (PR_SET_PDEATHSIG), and a server ending on its own kills it first.

use std::ffi::{CStr, OsStr};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::sync::{Condvar, Mutex};

/// Kernel memory an entry costs once listed: a fuse inode and a dentry (measured: slab
/// grew by 1.50 GB for 1.28 M entries, 1.17 KB each).
const KERNEL_BYTES_PER_ENTRY: u64 = 1200;

/// Share of available memory the kernel's inodes may take for a listing nobody asked for:
/// a quarter. An epoch makes the same inodes (each file it opens has one), and the kernel
/// reclaims them under pressure; the share bounds what a job that reads a part of a huge
/// tree pays. A tenth put 2 M entries (2.4 GB) at the edge on a node with 24 GB free, so
/// two mounts of one dataset a minute apart differed in whether they listed ahead (the
/// job's listing of a flat root 1.0 s with the listing ahead, 8.0 s without).
const MEMORY_SHARE: u64 = 4;

/// Whether listing `entries` ahead fits in `available` bytes of memory.
pub fn fits(entries: u64, available: Option<u64>) -> bool {
    match available {
        Some(a) => entries.saturating_mul(KERNEL_BYTES_PER_ENTRY) <= a / MEMORY_SHARE,
        None => false,
    }
}

/// Which process lists ahead, so the server can tell its requests from the job's.
///
/// The job's listings need no attributes to be fast; the lister's are what build the
/// kernel's inodes. The kernel is put in its adaptive READDIRPLUS mode, where a listing's
/// first request carries attributes and later ones only after a lookup in that directory.
/// The server answers the job's first request with one entry, so the job lists the rest
/// without attributes (ImageFolder's index at 1.28 M files, listings all without: 1.5 s,
/// all with: 5.0 s, a plain directory: 2.6 s), while the lister asks for attributes on
/// every request by a lookup between them, and bypasses the kernel's listing cache that the
/// job's listing may have filled.
#[derive(Debug, Default)]
pub struct ListerPid {
    pid: AtomicU32,
}

impl ListerPid {
    pub fn new() -> Arc<ListerPid> {
        Arc::new(ListerPid::default())
    }

    /// The lister is process `pid` now (0: there is none).
    pub fn set_lister(&self, pid: u32) {
        self.pid.store(pid, Ordering::Relaxed);
    }

    /// Whether thread `tid` (a FUSE request's pid) belongs to the lister.
    pub fn is_lister(&self, tid: u32) -> bool {
        let pid = self.pid.load(Ordering::Relaxed);
        pid != 0 && Path::new(&format!("/proc/{pid}/task/{tid}")).exists()
    }
}

/// The listing process of a mount. A thread reaps it when it ends, so a finished lister
/// is not left a zombie for the life of the mount; it holds the lock while it reaps, and
/// [`Lister::stop`] kills only under the lock, so no signal can reach a reused pid.
pub struct Lister {
    child: Arc<Mutex<Child>>,
}

impl Lister {
    /// Starts `archfs __prelist ROOT` once the mount is served, its stderr ours or, when
    /// `quiet`, /dev/null.
    pub fn spawn(
        root: &Path,
        ahead: &Arc<ListerPid>,
        debug: bool,
        quiet: bool,
    ) -> std::io::Result<Lister> {
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.arg("__prelist")
            .arg(root)
            .arg("--parent")
            .arg(std::process::id().to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(if quiet {
                Stdio::null()
            } else {
                Stdio::inherit()
            })
            // Out of the mount, so the lister never keeps it busy by its working directory.
            .current_dir("/");
        if debug {
            cmd.arg("--debug");
        }
        let child = cmd.spawn()?;
        let pid = child.id();
        ahead.set_lister(pid);
        let child = Arc::new(Mutex::new(child));
        let (c, a) = (child.clone(), ahead.clone());
        let reaper = std::thread::Builder::new()
            .name("lister-reaper".into())
            .spawn(move || {
                // SAFETY: waitid writes one siginfo_t; WNOWAIT leaves the child to be
                // reaped below, under the lock.
                let ended = unsafe {
                    let mut info: libc::siginfo_t = std::mem::zeroed();
                    libc::waitid(
                        libc::P_PID,
                        pid as libc::id_t,
                        &mut info,
                        libc::WEXITED | libc::WNOWAIT,
                    ) == 0
                };
                if ended {
                    let _ = c.lock().try_wait();
                    // Its pid may be anyone's now.
                    a.set_lister(0);
                    // Merging a union's directories for it left holes in the heap.
                    crate::memory::give_back();
                }
            });
        if let Err(e) = reaper {
            tracing::debug!("no reaper for the listing process: {e}");
        }
        Ok(Lister { child })
    }

    /// Kills the lister and reaps it. A request it has in flight is answered first, so
    /// this is called while the mount is still served; it waits at most two seconds.
    pub fn stop(self) {
        let mut child = self.child.lock();
        // A child already reaped is not signalled (std keeps its status).
        let _ = child.kill();
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline {
            match child.try_wait() {
                Ok(None) => std::thread::sleep(Duration::from_millis(5)),
                _ => return,
            }
        }
        tracing::warn!("the listing process {} did not end", child.id());
    }
}

/// The listing process (`archfs __prelist ROOT --parent PID`).
pub fn main(root: &Path, parent: i32) -> ExitCode {
    // SAFETY: prctl with PR_SET_PDEATHSIG takes a signal number; getppid has no
    // preconditions. Checked after the prctl: the server may have died before it.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong);
        if libc::getppid() != parent {
            return ExitCode::FAILURE;
        }
        // Spare CPU only: on a node whose cores the job keeps busy, the job's own
        // listings and reads come first. Threads inherit it.
        libc::setpriority(libc::PRIO_PROCESS, 0, 19);
    }
    let threads = std::env::var("ARCHFS_PRELIST_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get() / 2))
        .clamp(1, 8);
    let t0 = Instant::now();
    let (dirs, entries) = walk(root, threads);
    tracing::info!(
        "listed {dirs} directories ({entries} entries) ahead in {:.2} s",
        t0.elapsed().as_secs_f64()
    );
    ExitCode::SUCCESS
}

/// Lists every directory under `root` once, with `threads` threads; returns the
/// directories and entries listed. Symlinks are not followed, and a directory that cannot
/// be listed (an I/O error from a damaged archive) is skipped.
///
/// Last directory first: ImageFolder, os.walk and find go in listing order, so from the
/// other end the lister meets them in the middle instead of racing them over the same
/// directories.
pub fn walk(root: &Path, threads: usize) -> (u64, u64) {
    let work = Work {
        stack: Mutex::new(vec![root.to_path_buf()]),
        more: Condvar::new(),
        busy: AtomicUsize::new(0),
        dirs: AtomicU64::new(0),
        entries: AtomicU64::new(0),
    };
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| work.run());
        }
    });
    (
        work.dirs.load(Ordering::Relaxed),
        work.entries.load(Ordering::Relaxed),
    )
}

struct Work {
    /// Directories to list; the last pushed is listed first.
    stack: Mutex<Vec<PathBuf>>,
    more: Condvar,
    /// Threads listing a directory (which may push more).
    busy: AtomicUsize,
    dirs: AtomicU64,
    entries: AtomicU64,
}

impl Work {
    fn run(&self) {
        loop {
            let dir = {
                let mut stack = self.stack.lock();
                loop {
                    if let Some(d) = stack.pop() {
                        self.busy.fetch_add(1, Ordering::SeqCst);
                        break d;
                    }
                    if self.busy.load(Ordering::SeqCst) == 0 {
                        self.more.notify_all();
                        return;
                    }
                    stack = self.more.wait(stack);
                }
            };
            let subdirs = self.list(&dir);
            let mut stack = self.stack.lock();
            stack.extend(subdirs);
            self.busy.fetch_sub(1, Ordering::SeqCst);
            self.more.notify_all();
        }
    }

    /// Reads `dir` to its end with attributes, the kernel building an inode for each
    /// entry. Returns its subdirectories.
    fn list(&self, dir: &Path) -> Vec<PathBuf> {
        // Before the open: tests/prelist.rs stops the lister and needs to know whether it
        // has touched a directory yet.
        tracing::debug!("listing {}", dir.display());
        let Ok(d) = std::fs::File::open(dir) else {
            return Vec::new();
        };
        let fd = d.as_raw_fd();
        let mut subdirs = Vec::new();
        let mut n = 0;
        let mut buf = vec![0u8; BUF_SIZE];
        loop {
            // SAFETY: fd is open (d lives to the end); the buffer is BUF_SIZE bytes.
            let len =
                unsafe { libc::syscall(libc::SYS_getdents64, fd, buf.as_mut_ptr(), buf.len()) };
            if len <= 0 {
                break;
            }
            let mut last: Option<&CStr> = None;
            for (name, kind) in Dirents(&buf[..len as usize]) {
                let bytes = name.to_bytes();
                if bytes == b"." || bytes == b".." {
                    continue;
                }
                n += 1;
                if kind == libc::DT_DIR {
                    subdirs.push(dir.join(OsStr::from_bytes(bytes)));
                }
                last = Some(name);
            }
            // A lookup of a listed name asks the kernel for attributes in the next request
            // (the adaptive mode); any error is for the next request to show.
            if let Some(name) = last {
                let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
                // SAFETY: fd is open, name NUL-terminated, st large enough.
                unsafe {
                    libc::fstatat(
                        fd,
                        name.as_ptr(),
                        st.as_mut_ptr(),
                        libc::AT_SYMLINK_NOFOLLOW,
                    )
                };
            }
        }
        self.dirs.fetch_add(1, Ordering::Relaxed);
        self.entries.fetch_add(n, Ordering::Relaxed);
        subdirs
    }
}

/// A listing's buffer: larger than any FUSE reply (128 KiB), so every entry the kernel
/// made an inode for is returned, and the name looked up is from the last reply.
const BUF_SIZE: usize = 256 << 10;

/// The `linux_dirent64` records of a getdents64 buffer: name and type.
struct Dirents<'a>(&'a [u8]);

impl<'a> Iterator for Dirents<'a> {
    type Item = (&'a CStr, u8);

    fn next(&mut self) -> Option<Self::Item> {
        // d_ino: u64, d_off: i64, d_reclen: u16, d_type: u8, d_name.
        const NAME: usize = 19;
        let b = self.0;
        if b.len() < NAME {
            return None;
        }
        let reclen = usize::from(u16::from_ne_bytes([b[16], b[17]]));
        if reclen < NAME || reclen > b.len() {
            return None;
        }
        let name = CStr::from_bytes_until_nul(&b[NAME..reclen]).ok()?;
        self.0 = &b[reclen..];
        Some((name, b[18]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn imagenet_fits_a_node_and_not_a_small_cgroup() {
        let gib = 1u64 << 30;
        assert!(fits(1_281_167, Some(24 * gib)));
        // 10,000 WebDataset shards of 100 samples, a file and a label each.
        assert!(fits(2_000_001, Some(22 * gib)));
        assert!(!fits(1_281_167, Some(4 * gib)));
        assert!(fits(50_000_000, Some(256 * gib)));
        assert!(!fits(60_000_000, Some(256 * gib)));
        assert!(!fits(10, None));
    }

    #[test]
    fn walk_lists_every_directory_once_and_follows_no_symlink() {
        let r = &std::env::temp_dir().join(format!("archfs-prelist-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(r);
        for d in ["a/b/c", "a/d", "e"] {
            std::fs::create_dir_all(r.join(d)).unwrap();
        }
        for f in ["a/1", "a/b/2", "a/b/c/3", "e/4", "e/5"] {
            std::fs::write(r.join(f), b"x").unwrap();
        }
        std::os::unix::fs::symlink(r, r.join("e/loop")).unwrap();
        for threads in [1, 3] {
            // Directories: root, a, a/b, a/b/c, a/d, e. Entries: a, e; b, d, 1; c, 2; 3;
            // none; 4, 5, loop.
            assert_eq!(walk(r, threads), (6, 11), "{threads} threads");
        }
        std::fs::remove_dir_all(r).unwrap();
    }
}
