//! The stage-in: from mount, a copy of the whole object made in the background, in
//! parallel ranged GETs of a few MiB, into node-local memory (a memfd) when it fits the
//! preload's budget, else into an unlinked file in `--stage-dir`. Reads of staged bytes
//! are local reads, and the push splices them into the kernel as from a local archive; a
//! read of bytes in flight waits for them, a read ahead of the copy fetches its own span
//! at once. The copy has no name: it goes with the process, however that ends.

use std::collections::VecDeque;
use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

use super::http::{Client, Target};
use crate::source::scratch;

/// One GET of the copy.
const PIECE: u64 = 4 << 20;
/// GETs of the copies in flight at once, for all objects of the process.
const WORKERS: usize = 8;

/// A copy of an object being made, or made.
#[derive(Debug)]
pub struct Stage {
    file: File,
    size: u64,
    done: Box<[AtomicBool]>,
    /// The next piece a worker takes; pieces before it are in flight or done.
    next: AtomicU64,
    left: AtomicU64,
    failed: AtomicBool,
    lock: Mutex<()>,
    arrived: Condvar,
    /// On the terminal of a foreground server.
    bar: Option<indicatif::ProgressBar>,
    client: Arc<Client>,
    target: Target,
    etag: Option<String>,
    start: Instant,
}

/// What a read found in the copy.
pub enum Found {
    /// The bytes were staged and are in the buffer.
    Read,
    /// Not staged, and not on their way: the reader fetches them itself.
    Fetch,
}

impl Stage {
    /// Starts copying `target` (`size` bytes, `etag`) into memory or `dir`; `None` with a
    /// warning when neither has room.
    pub fn start(
        client: Arc<Client>,
        target: Target,
        etag: Option<String>,
        size: u64,
        dir: Option<&Path>,
        progress: bool,
    ) -> Option<Arc<Stage>> {
        if size == 0 {
            return None;
        }
        let file = match place(size, dir) {
            Ok(f) => f,
            Err(why) => {
                tracing::warn!(
                    "{}: not copied to this node ({why}); reads fetch what they need",
                    target.name
                );
                return None;
            }
        };
        let pieces = size.div_ceil(PIECE);
        let stage = Arc::new(Stage {
            file,
            size,
            done: (0..pieces).map(|_| AtomicBool::new(false)).collect(),
            next: AtomicU64::new(0),
            left: AtomicU64::new(pieces),
            failed: AtomicBool::new(false),
            lock: Mutex::new(()),
            arrived: Condvar::new(),
            bar: progress.then(|| {
                crate::progress::bar(format!("copying {} to this node", target.name), size)
            }),
            client,
            target,
            etag,
            start: Instant::now(),
        });
        pool().add(stage.clone());
        Some(stage)
    }

    /// Copies piece `p`; false when the copy failed.
    fn copy(&self, p: u64, buf: &mut Vec<u8>) -> bool {
        let at = p * PIECE;
        buf.resize(PIECE.min(self.size - at) as usize, 0);
        let fetched = self
            .client
            .get(&self.target, self.etag.as_deref(), at, buf)
            .and_then(|()| {
                self.file
                    .write_all_at(buf, at)
                    .map_err(|e| format!("writing the node-local copy: {e}"))
            });
        if let Err(e) = fetched {
            tracing::warn!("{}: the copy to this node stopped: {e}", self.target.name);
            self.fail();
            return false;
        }
        self.done[p as usize].store(true, Ordering::Release);
        let left = self.left.fetch_sub(1, Ordering::AcqRel) - 1;
        {
            let _g = self.lock.lock();
            self.arrived.notify_all();
        }
        if let Some(b) = &self.bar {
            b.inc(buf.len() as u64);
        }
        // A line in the log at every tenth.
        let pieces = self.done.len() as u64;
        let tenths = |left: u64| (pieces - left) * 10 / pieces;
        if left > 0 && tenths(left) > tenths(left + 1) {
            let secs = self.start.elapsed().as_secs_f64();
            let copied = (pieces - left) * PIECE;
            tracing::info!(
                "{}: {}0% copied to this node ({:.0} MB/s)",
                self.target.name,
                tenths(left),
                copied as f64 / 1e6 / secs.max(1e-3)
            );
        }
        if left == 0 {
            if let Some(b) = &self.bar {
                b.finish_and_clear();
            }
            let secs = self.start.elapsed().as_secs_f64();
            tracing::info!(
                "{}: copied to this node, {:.1} MB in {secs:.1} s ({:.0} MB/s)",
                self.target.name,
                self.size as f64 / 1e6,
                self.size as f64 / 1e6 / secs.max(1e-3)
            );
        }
        true
    }

    fn fail(&self) {
        if let Some(b) = &self.bar {
            b.abandon();
        }
        self.failed.store(true, Ordering::Relaxed);
        let _g = self.lock.lock();
        self.arrived.notify_all();
    }

    /// Fills `buf` from `pos` out of the copy, waiting for pieces in flight.
    pub fn read(&self, pos: u64, buf: &mut [u8]) -> std::io::Result<Found> {
        if buf.is_empty() {
            return Ok(Found::Fetch);
        }
        let (first, last) = (pos / PIECE, (pos + buf.len() as u64 - 1) / PIECE);
        let staged = |p: u64| self.done[p as usize].load(Ordering::Acquire);
        if !(first..=last).all(staged) {
            // Wait only for pieces taken; the rest may be far off. A read of the very
            // next piece (a scan at the front of the copy) takes it and copies it here,
            // rather than fetching its own span and the copy the piece again.
            let untaken = |p: u64| !staged(p) && p >= self.next.load(Ordering::Relaxed);
            if (first..=last).any(untaken) {
                let claimed = first == last
                    && self
                        .next
                        .compare_exchange(first, first + 1, Ordering::Relaxed, Ordering::Relaxed)
                        .is_ok();
                if !claimed {
                    return Ok(Found::Fetch);
                }
                let mut piece = Vec::new();
                if !self.copy(first, &mut piece) {
                    return Ok(Found::Fetch);
                }
            }
            let mut g = self.lock.lock();
            while !(first..=last).all(staged) {
                if self.failed.load(Ordering::Relaxed) {
                    return Ok(Found::Fetch);
                }
                self.arrived.wait(&mut g);
            }
        }
        self.file.read_exact_at(buf, pos)?;
        Ok(Found::Read)
    }

    /// The copy's descriptor when `[pos, pos + len)` is in it, to splice from.
    pub fn fd(&self, pos: u64, len: u64) -> Option<BorrowedFd<'_>> {
        if len == 0 || pos + len > self.size {
            return None;
        }
        let (first, last) = (pos / PIECE, (pos + len - 1) / PIECE);
        (first..=last)
            .all(|p| self.done[p as usize].load(Ordering::Acquire))
            .then(|| self.file.as_fd())
    }

    /// Whether the copy is still being made (read-ahead advice is then not needed).
    pub fn copying(&self) -> bool {
        self.left.load(Ordering::Relaxed) > 0 && !self.failed.load(Ordering::Relaxed)
    }
}

/// The threads that make the copies of every object of the process, oldest object first:
/// a union of many objects copies a few pieces at a time, not a few per object.
struct Pool {
    jobs: Mutex<VecDeque<Arc<Stage>>>,
    queued: Condvar,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<&'static Pool> = OnceLock::new();
    POOL.get_or_init(|| {
        let pool: &'static Pool = Box::leak(Box::new(Pool {
            jobs: Mutex::new(VecDeque::new()),
            queued: Condvar::new(),
        }));
        for i in 0..WORKERS {
            let _ = std::thread::Builder::new()
                .name(format!("archfs-stage-{i}"))
                .spawn(move || pool.work());
        }
        pool
    })
}

impl Pool {
    fn add(&self, stage: Arc<Stage>) {
        self.jobs.lock().push_back(stage);
        self.queued.notify_all();
    }

    fn work(&self) {
        let mut buf = Vec::new();
        loop {
            let (stage, p) = {
                let mut jobs = self.jobs.lock();
                loop {
                    let Some(st) = jobs.front().cloned() else {
                        self.queued.wait(&mut jobs);
                        continue;
                    };
                    let p = st.next.fetch_add(1, Ordering::Relaxed);
                    if p as usize >= st.done.len() || st.failed.load(Ordering::Relaxed) {
                        jobs.pop_front(); // every piece taken: on to the next object
                        continue;
                    }
                    break (st, p);
                }
            };
            stage.copy(p, &mut buf);
            if buf.capacity() > 2 * PIECE as usize {
                buf = Vec::new();
            }
        }
    }
}

/// A nameless file for the copy: a memfd when it fits in 75% of the memory the job may
/// fill (the preload's rule), else an unlinked file in `dir` (or `$TMPDIR`, `/tmp`) with
/// room for it. The copies of this process count against both as soon as they are
/// placed, filled or not, so a union of many objects does not promise the same memory
/// (or disk) to each.
fn place(size: u64, dir: Option<&Path>) -> Result<File, String> {
    static IN_MEMORY: AtomicU64 = AtomicU64::new(0);
    static ON_DISK: AtomicU64 = AtomicU64::new(0);
    let promised = IN_MEMORY.load(Ordering::Relaxed);
    let fits = crate::memory::available()
        .is_none_or(|free| ((promised + size) as f64) < free as f64 * 0.75);
    if fits {
        if let Ok(file) = scratch::memfd() {
            IN_MEMORY.fetch_add(size, Ordering::Relaxed);
            return Ok(file);
        }
    }
    let dir = dir.map_or_else(scratch::default_dir, Path::to_owned);
    let free = free_bytes(&dir).ok_or_else(|| format!("cannot use {}", dir.display()))?;
    let free = free.saturating_sub(ON_DISK.load(Ordering::Relaxed));
    if free < size.saturating_add(1 << 30) {
        return Err(format!(
            "{:.1} GB does not fit in memory nor in {} ({:.1} GB free beside the copies \
             already there); give --stage-dir a node-local disk with room",
            size as f64 / 1e9,
            dir.display(),
            free as f64 / 1e9
        ));
    }
    let file = scratch::temp_file(&dir)
        .map_err(|e| format!("cannot create a file in {}: {e}", dir.display()))?;
    ON_DISK.fetch_add(size, Ordering::Relaxed);
    Ok(file)
}

fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs writes one struct, zero-initialised here, for a valid C string.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    (unsafe { libc::statvfs(c.as_ptr(), &mut st) } == 0)
        .then(|| st.f_bavail as u64 * st.f_frsize as u64)
}
