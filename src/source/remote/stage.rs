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
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::sync::{Condvar, Mutex};

use super::http::{Client, Target};
use crate::per_process::PerProcess;
use crate::source::scratch;

/// What the copy marks as copied at once: a read of bytes in flight waits for their
/// piece.
const PIECE: u64 = 4 << 20;
/// Pieces one GET of the copy takes at most. A GET's first round trip moves nothing on
/// its stream, so short GETs leave a far, fast link idle: at 50 ms and ~540 MB/s, one GET
/// a piece copied at 4.4 s what 8 curl streams fetch in 3.5 s.
const RUN: u64 = 16;

/// What a GET of the copy hands over at a time: a read of bytes in the piece arriving
/// is served as soon as they have.
const PART: u64 = 256 << 10;
/// A read waits for bytes of the piece arriving when at most this much is still to come
/// before them (at 1 Gbit/s shared by 8 streams, ~70 ms: about a GET at 50 ms); else it
/// fetches its own. Waiting for a whole piece cost a read up to ~270 ms there.
const WAIT: u64 = 1 << 20;

/// A piece not copied, nor the next to arrive in a GET under way: a read of it fetches
/// its own bytes rather than wait for the GET to get there.
const LATER: u8 = 0;
/// The piece arriving in a GET under way: a read of it waits, if its bytes are near.
const NEXT: u8 = 1;
const DONE: u8 = 2;
/// GETs of the copies in flight at once, for all objects of the process.
const WORKERS: usize = 8;

/// A copy of an object being made, or made.
#[derive(Debug)]
pub struct Stage {
    file: File,
    size: u64,
    /// Each piece's [`LATER`], [`NEXT`] or [`DONE`].
    state: Box<[AtomicU8]>,
    /// Bytes of each [`NEXT`] piece arrived, from its start.
    filled: Box<[AtomicU64]>,
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
            state: (0..pieces).map(|_| AtomicU8::new(LATER)).collect(),
            filled: (0..pieces).map(|_| AtomicU64::new(0)).collect(),
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

    /// Copies the `n` pieces from `first` in one GET, each marked copied as it arrives;
    /// false when the copy failed.
    fn copy(&self, first: u64, n: u64) -> bool {
        let at = first * PIECE;
        let len = ((first + n) * PIECE).min(self.size) - at;
        let etag = self.etag.as_deref();
        self.state[first as usize].store(NEXT, Ordering::Release);
        let end = first + n;
        let fetched = self
            .client
            .get_parts(&self.target, etag, (at, len), PART, |pos, bytes| {
                self.file
                    .write_all_at(bytes, pos)
                    .map_err(|e| format!("writing the node-local copy: {e}"))?;
                let p = pos / PIECE;
                let upto = pos + bytes.len() as u64;
                let piece_end = ((p + 1) * PIECE).min(self.size);
                if upto < piece_end {
                    self.filled[p as usize].store(upto - p * PIECE, Ordering::Release);
                    let _g = self.lock.lock();
                    self.arrived.notify_all();
                    return Ok(());
                }
                if p + 1 < end {
                    self.state[p as usize + 1].store(NEXT, Ordering::Release);
                }
                self.landed(p, piece_end - p * PIECE);
                Ok(())
            });
        if let Err(e) = fetched {
            tracing::warn!("{}: the copy to this node stopped: {e}", self.target.name);
            self.fail();
            return false;
        }
        true
    }

    /// Pieces a worker takes for one GET: many while much is left, one at the end, so
    /// the last GETs end together.
    fn claim(&self) -> Option<(u64, u64)> {
        let pieces = self.state.len() as u64;
        let mut next = self.next.load(Ordering::Relaxed);
        loop {
            if next >= pieces || self.failed.load(Ordering::Relaxed) {
                return None;
            }
            let n = ((pieces - next) / (2 * WORKERS as u64)).clamp(1, RUN);
            match self.next.compare_exchange_weak(
                next,
                next + n,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Some((next, n)),
                Err(now) => next = now,
            }
        }
    }

    /// Piece `p` (`len` bytes) is in the copy.
    fn landed(&self, p: u64, len: u64) {
        self.state[p as usize].store(DONE, Ordering::Release);
        let left = self.left.fetch_sub(1, Ordering::AcqRel) - 1;
        {
            let _g = self.lock.lock();
            self.arrived.notify_all();
        }
        if let Some(b) = &self.bar {
            b.inc(len);
        }
        // A line in the log at every tenth.
        let pieces = self.state.len() as u64;
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
        let end = pos + buf.len() as u64;
        let (first, last) = (pos / PIECE, (end - 1) / PIECE);
        let state = |p: u64| self.state[p as usize].load(Ordering::Acquire);
        // Bytes of piece `p` this read needs, from the piece's start.
        let need = |p: u64| end.min((p + 1) * PIECE) - p * PIECE;
        let short =
            |p: u64| need(p).saturating_sub(self.filled[p as usize].load(Ordering::Acquire));
        let staged = |p: u64| state(p) == DONE || (state(p) == NEXT && short(p) == 0);
        if !(first..=last).all(staged) {
            // A read of the very next piece (a scan at the front of the copy) takes it
            // and copies it here, rather than fetching its own span and the copy the
            // piece again.
            let untaken = |p: u64| !staged(p) && p >= self.next.load(Ordering::Relaxed);
            if (first..=last).any(untaken) {
                let claimed = first == last
                    && self
                        .next
                        .compare_exchange(first, first + 1, Ordering::Relaxed, Ordering::Relaxed)
                        .is_ok();
                if !claimed || !self.copy(first, 1) {
                    return Ok(Found::Fetch);
                }
            }
            // Wait only for bytes about to arrive; the rest of a GET may be far off.
            if (first..=last).any(|p| state(p) == LATER || (state(p) == NEXT && short(p) > WAIT)) {
                return Ok(Found::Fetch);
            }
            let mut g = self.lock.lock();
            while !(first..=last).all(staged) {
                if self.failed.load(Ordering::Relaxed) {
                    return Ok(Found::Fetch);
                }
                g = self.arrived.wait(g);
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
            .all(|p| self.state[p as usize].load(Ordering::Acquire) == DONE)
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
    static POOL: PerProcess<Pool> = PerProcess::new();
    let (pool, made) = POOL.get_or_make(|| Pool {
        jobs: Mutex::new(VecDeque::new()),
        queued: Condvar::new(),
    });
    if made {
        for i in 0..WORKERS {
            let _ = std::thread::Builder::new()
                .name(format!("archfs-stage-{i}"))
                .spawn(move || pool.work());
        }
    }
    pool
}

impl Pool {
    fn add(&self, stage: Arc<Stage>) {
        self.jobs.lock().push_back(stage);
        self.queued.notify_all();
    }

    fn work(&self) {
        loop {
            let (stage, (first, n)) = {
                let mut jobs = self.jobs.lock();
                loop {
                    let Some(st) = jobs.front().cloned() else {
                        jobs = self.queued.wait(jobs);
                        continue;
                    };
                    match st.claim() {
                        Some(run) => break (st, run),
                        None => {
                            jobs.pop_front(); // every piece taken: on to the next object
                        }
                    }
                }
            };
            stage.copy(first, n);
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
