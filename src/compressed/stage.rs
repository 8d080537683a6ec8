//! A decoded copy of a compressed archive, in memory (a memfd) when it fits in 3/4 of the
//! free memory, else in an unlinked file on node-local disk (`--stage-dir`, else
//! `$TMPDIR`, else /tmp).
//!
//! For formats a read cannot enter in the middle, a background pass decodes the archive
//! once, front to back, and reads wait only until the copy passes their end, so the first
//! files are served long before it is complete. With entry points (`--preload` of a gzip
//! or zstd archive), every core decodes stretches between them in parallel, and a read
//! of a stretch not yet copied is decoded in place meanwhile ([`Stage::try_read`]).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

use super::{fill, Codec, Decoder, Points, BLOCK};
use crate::error::{Error, Result};
use crate::source::{scratch, Source};

pub struct Stage {
    file: File,
    progress: Mutex<Progress>,
    moved: Condvar,
    /// Parallel copies: the state of each stretch between entry points ([`FREE`],
    /// [`BUSY`], [`COPIED`], [`FAILED`]).
    copied: Option<(Arc<Points>, Box<[AtomicU8]>)>,
    /// A reader waits on this front-to-back copy: it goes before the others queued.
    urgent: std::sync::atomic::AtomicBool,
    /// A front-to-back copy's turn to run ([`Slot`]), and what wakes its thread for it.
    granted: std::sync::atomic::AtomicBool,
    slot: Condvar,
    /// Threads still copying, whether the copy's end was told, its length and start.
    running: AtomicUsize,
    done: std::sync::atomic::AtomicBool,
    len: u64,
    started: std::time::Instant,
}

#[derive(Default)]
struct Progress {
    /// Decoded bytes written so far.
    upto: u64,
    failed: Option<String>,
}

impl Stage {
    /// Starts copying front to back; returns at once.
    pub fn start(
        source: Arc<Source>,
        codec: Codec,
        points: Arc<Points>,
        dir: Option<&Path>,
    ) -> Result<Arc<Stage>> {
        // Reserved like a parallel copy's, so the copies of many shards together decide
        // between memory and disk.
        let len = points.len();
        let pending = PENDING.fetch_add(len, Ordering::AcqRel) + len;
        let stage = match Stage::new(len, pending, dir, None) {
            Ok(s) => Arc::new(s),
            Err(e) => {
                PENDING.fetch_sub(len, Ordering::AcqRel);
                return Err(e);
            }
        };
        let s = stage.clone();
        let spawned = spawn(&stage, "archfs-stage", source.clone(), move || {
            let _slot = Slot::take(&s);
            let copied = s.copy(&source, codec, &points);
            PENDING.fetch_sub(len, Ordering::AcqRel);
            copied
        });
        if let Err(e) = spawned {
            PENDING.fetch_sub(len, Ordering::AcqRel);
            return Err(e);
        }
        Ok(stage)
    }

    /// Queues a copy of the stretches between entry points for the copying threads
    /// (`threads` of them, shared by every archive of the mount: a union of 1,000
    /// shards copies one or two at a time, not all at once); returns at once. `None`
    /// when the copy would not fit in memory, with the copies still under way, and
    /// `memory_only`.
    pub fn start_parallel(
        source: Arc<Source>,
        codec: Codec,
        points: Arc<Points>,
        dir: Option<&Path>,
        threads: usize,
        memory_only: bool,
    ) -> Result<Option<Arc<Stage>>> {
        let len = points.len();
        let pending = PENDING.fetch_add(len, Ordering::AcqRel) + len;
        if memory_only && !fits(pending) {
            PENDING.fetch_sub(len, Ordering::AcqRel);
            return Ok(None);
        }
        let copied = (0..points.count()).map(|_| AtomicU8::new(FREE)).collect();
        let stage = match Stage::new(len, pending, dir, Some((points, copied))) {
            Ok(s) => Arc::new(s),
            Err(e) => {
                PENDING.fetch_sub(len, Ordering::AcqRel);
                return Err(e);
            }
        };
        JOBS.lock().push_back(Arc::new(Job {
            stage: stage.clone(),
            source,
            codec,
            next: AtomicUsize::new(0),
        }));
        QUEUED.notify_all();
        while WORKERS.load(Ordering::Acquire) < threads.max(1) {
            let n = WORKERS.fetch_add(1, Ordering::AcqRel);
            std::thread::Builder::new()
                .name(format!("archfs-stage-{n}"))
                .spawn(copy_jobs)
                .map_err(|e| Error::io("cannot start a decoding thread", e))?;
        }
        Ok(Some(stage))
    }

    /// `room`: the memory the copies under way, this one's included, are to take: in a
    /// memfd if that fits.
    fn new(
        len: u64,
        room: u64,
        dir: Option<&Path>,
        copied: Option<(Arc<Points>, Box<[AtomicU8]>)>,
    ) -> Result<Stage> {
        let file = match (fits(room), dir) {
            (true, None) => scratch::memfd().or_else(|_| temp_file(&scratch::default_dir()))?,
            (_, Some(d)) => temp_file(d)?,
            (false, None) => temp_file(&scratch::default_dir())?,
        };
        Ok(Stage {
            file,
            progress: Mutex::new(Progress::default()),
            moved: Condvar::new(),
            copied,
            urgent: Default::default(),
            granted: Default::default(),
            slot: Condvar::new(),
            running: AtomicUsize::new(0),
            done: Default::default(),
            len,
            started: std::time::Instant::now(),
        })
    }

    /// Decodes front to back, a block at a time, each checked against its CRC from the
    /// indexing pass; a failure is kept for the readers that wait.
    fn copy(&self, source: &Arc<Source>, codec: Codec, points: &Points) -> Result<()> {
        let result = self.copy_front_to_back(source, codec, points);
        if let Err(e) = &result {
            self.progress.lock().failed = Some(e.to_string());
        }
        self.moved.notify_all();
        result
    }

    fn copy_front_to_back(
        &self,
        source: &Arc<Source>,
        codec: Codec,
        points: &Points,
    ) -> Result<()> {
        let mut dec = codec.stream(source)?;
        let mut block = vec![0u8; BLOCK as usize];
        let mut at = 0u64;
        for i in 0..points.count() {
            let end = points.end_of(i);
            while at < end {
                let b = &mut block[..BLOCK.min(end - at) as usize];
                if fill(dec.as_mut(), b)? < b.len() {
                    return Err(Error::corrupt(format!(
                        "the archive decodes to fewer bytes than its index says ({})",
                        points.len()
                    )));
                }
                points.verify(i, at, b)?;
                self.write(b, at)?;
                at += b.len() as u64;
                self.progress.lock().upto = at;
                self.moved.notify_all();
            }
        }
        Ok(())
    }

    /// Copies the stretches between entry points taken from `next` in turn, skipping
    /// those a reader took first.
    fn copy_stretches(&self, source: &Arc<Source>, codec: Codec, next: &AtomicUsize) -> Result<()> {
        let Some((points, _)) = &self.copied else {
            return Ok(());
        };
        let mut block = vec![0u8; BLOCK as usize];
        let mut dec: Option<Box<dyn Decoder>> = None;
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= points.count() {
                return Ok(());
            }
            if !self.claim(i) {
                continue;
            }
            let p = points.points[i];
            let reused = match &mut dec {
                Some(d) => d.restart(&p, &points.window(i)?)?,
                None => false,
            };
            if !reused {
                dec = Some(points.decoder(i, codec, source)?);
            }
            let d = dec.as_mut().expect("a decoder");
            if !self.copy_one(i, d.as_mut(), &mut block)? {
                dec = None;
            }
        }
    }

    /// Takes stretch `i` to copy, unless it is taken.
    fn claim(&self, i: usize) -> bool {
        self.copied.as_ref().is_some_and(|(_, c)| {
            c[i].compare_exchange(FREE, BUSY, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        })
    }

    /// Decodes the claimed stretch `i` with `dec` (at its entry point) into the copy;
    /// false when it fails to decode or to match its CRCs (left to in-place reads, which
    /// report the damage).
    fn copy_one(&self, i: usize, dec: &mut dyn Decoder, block: &mut [u8]) -> Result<bool> {
        let (points, copied) = self.copied.as_ref().expect("a parallel copy");
        let (mut at, end) = (points.points[i].output, points.end_of(i));
        while at < end {
            let b = &mut block[..BLOCK.min(end - at) as usize];
            let ok = fill(dec, b).is_ok_and(|n| n == b.len()) && points.verify(i, at, b).is_ok();
            if !ok {
                copied[i].store(FAILED, Ordering::Release);
                return Ok(false);
            }
            if let Err(e) = self.write(b, at) {
                copied[i].store(FAILED, Ordering::Release);
                return Err(e);
            }
            at += b.len() as u64;
        }
        copied[i].store(COPIED, Ordering::Release);
        Ok(true)
    }

    fn write(&self, b: &[u8], at: u64) -> Result<()> {
        self.file
            .write_all_at(b, at)
            .map_err(|e| Error::io("cannot write the decoded copy (is the disk full?)", e))
    }

    /// Whether every byte of the copy is written (or its decoding gave up).
    pub fn complete(&self) -> bool {
        if self.parallel() {
            return self.done.load(Ordering::Acquire);
        }
        let p = self.progress.lock();
        p.upto >= self.len || p.failed.is_some()
    }

    /// Whether this is a parallel copy, made from the entry points.
    pub fn parallel(&self) -> bool {
        self.copied.is_some()
    }

    /// Fills `out` from `pos` from the copy; false if a parallel copy does not hold all
    /// of it yet. The stretches no one has taken yet are copied first, here, with
    /// decoders from `decoder` handed back to `done`: a read's decoding then counts
    /// toward the copy instead of being done twice.
    pub fn try_read(
        &self,
        pos: u64,
        out: &mut [u8],
        decoder: &dyn Fn(usize) -> Result<Box<dyn Decoder>>,
        done: &dyn Fn(Box<dyn Decoder>),
    ) -> Result<bool> {
        let Some((points, copied)) = &self.copied else {
            self.read_exact_at(pos, out)?;
            return Ok(true);
        };
        let end = pos + out.len() as u64;
        let (first, last) = (points.before(pos), points.before(end.max(1) - 1));
        for i in first..=last {
            if copied[i].load(Ordering::Acquire) == COPIED {
                continue;
            }
            if !self.claim(i) {
                return Ok(false); // another thread is on it, or it failed
            }
            let mut dec = match decoder(i) {
                Ok(d) => d,
                Err(e) => {
                    copied[i].store(FREE, Ordering::Release);
                    return Err(e);
                }
            };
            let mut block = crate::source::Buf::take(BLOCK as usize);
            let ok = self.copy_one(i, dec.as_mut(), &mut block)?;
            done(dec);
            if !ok {
                return Ok(false);
            }
        }
        self.file
            .read_exact_at(out, pos)
            .map_err(|e| Error::io("read of the decoded copy", e))?;
        Ok(true)
    }

    /// Fills `out` from `pos` once the copy has got that far.
    pub fn read_exact_at(&self, pos: u64, out: &mut [u8]) -> Result<()> {
        let end = pos + out.len() as u64;
        let mut p = self.progress.lock();
        while p.upto < end {
            if let Some(e) = &p.failed {
                return Err(Error::corrupt(format!("the decoded copy failed: {e}")));
            }
            // Its slot goes before those of copies nobody waits on.
            self.urgent.store(true, Ordering::Release);
            self.moved.wait(&mut p);
        }
        drop(p);
        self.file
            .read_exact_at(out, pos)
            .map_err(|e| Error::io("read of the decoded copy", e))
    }
}

/// Runs `copy` on a thread of its own; the last of a copy's threads to end says so.
fn spawn(
    stage: &Arc<Stage>,
    name: &str,
    source: Arc<Source>,
    copy: impl FnOnce() -> Result<()> + Send + 'static,
) -> Result<()> {
    stage.running.fetch_add(1, Ordering::Relaxed);
    let this = stage.clone();
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            if let Err(e) = copy() {
                tracing::error!("decoding {}: {e}", source.path().display());
            }
            if this.running.fetch_sub(1, Ordering::AcqRel) == 1 {
                tracing::info!(
                    "decoded copy of {} complete: {} MiB in {:.1} s",
                    source.path().display(),
                    this.len >> 20,
                    this.started.elapsed().as_secs_f64()
                );
            }
        })
        .map(|_| ())
        .map_err(|e| {
            stage.running.fetch_sub(1, Ordering::Relaxed);
            Error::io("cannot start the decoding thread", e)
        })
}

/// One of the few front-to-back copies that decode at once (a thread a core): a union of
/// hundreds of single-frame zstd shards would otherwise decode them all at the same time
/// from mount, each with its decoder's window (MiBs). A copy a reader waits on goes
/// first; the others in the order they were queued.
struct Slot;

struct Slots {
    running: usize,
    waiting: Vec<Arc<Stage>>,
}

static SLOTS: Mutex<Slots> = Mutex::new(Slots {
    running: 0,
    waiting: Vec::new(),
});

impl Slot {
    /// Waits for a slot for `stage`'s copy. A freed slot is granted to one waiter, woken
    /// alone: a union of 1,000 single-frame shards queues 1,000 copies, and waking them
    /// all at each freed slot kept 2 cores busy in the scheduler (a cold epoch 3.9x one
    /// tar's).
    fn take(stage: &Arc<Stage>) -> Slot {
        let mut s = SLOTS.lock();
        stage.granted.store(false, Ordering::Release);
        s.waiting.push(stage.clone());
        Slot::grant(&mut s);
        while !stage.granted.load(Ordering::Acquire) {
            stage.slot.wait(&mut s);
        }
        Slot
    }

    /// Hands free slots to waiters: a copy a reader waits on first, else the oldest.
    fn grant(s: &mut Slots) {
        while s.running < super::threads() && !s.waiting.is_empty() {
            let next = s
                .waiting
                .iter()
                .position(|w| w.urgent.load(Ordering::Acquire))
                .unwrap_or(0);
            let w = s.waiting.remove(next);
            s.running += 1;
            w.granted.store(true, Ordering::Release);
            w.slot.notify_one();
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut s = SLOTS.lock();
        s.running -= 1;
        Slot::grant(&mut s);
    }
}

/// A parallel copy, queued for the copying threads.
struct Job {
    stage: Arc<Stage>,
    source: Arc<Source>,
    codec: Codec,
    /// The next stretch to take.
    next: AtomicUsize,
}

static JOBS: Mutex<std::collections::VecDeque<Arc<Job>>> =
    Mutex::new(std::collections::VecDeque::new());
static QUEUED: Condvar = Condvar::new();
static WORKERS: AtomicUsize = AtomicUsize::new(0);
/// Bytes of parallel copies not yet complete (memory they are still to take).
static PENDING: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A copying thread: works on the oldest queued copy with the others until none of its
/// stretches is left to take, then on the next.
fn copy_jobs() {
    loop {
        let job = {
            let mut jobs = JOBS.lock();
            while jobs.is_empty() {
                QUEUED.wait(&mut jobs);
            }
            jobs[0].clone()
        };
        let s = &job.stage;
        s.running.fetch_add(1, Ordering::AcqRel);
        if let Err(e) = s.copy_stretches(&job.source, job.codec, &job.next) {
            tracing::error!("decoding {}: {e}", job.source.path().display());
            // Its other stretches are left to the readers.
            job.next.store(usize::MAX / 2, Ordering::Release);
        }
        {
            let mut jobs = JOBS.lock();
            if jobs.front().is_some_and(|j| Arc::ptr_eq(j, &job)) {
                jobs.pop_front();
            }
        }
        if s.running.fetch_sub(1, Ordering::AcqRel) == 1 && !s.done.swap(true, Ordering::AcqRel) {
            PENDING.fetch_sub(s.len, Ordering::AcqRel);
            tracing::info!(
                "decoded copy of {} complete: {} MiB in {:.1} s",
                job.source.path().display(),
                s.len >> 20,
                s.started.elapsed().as_secs_f64()
            );
        }
    }
}

/// States of a stretch in a parallel copy.
const FREE: u8 = 0;
const BUSY: u8 = 1;
const COPIED: u8 = 2;
const FAILED: u8 = 3;

/// Whether `len` bytes fit in 3/4 of the free memory (or the free memory is unknown).
fn fits(len: u64) -> bool {
    crate::memory::available().is_none_or(|free| (len as f64) < free as f64 * 0.75)
}

/// A file nobody else can open, gone when the server exits.
fn temp_file(dir: &Path) -> Result<File> {
    scratch::temp_file(dir).map_err(|e| {
        Error::io(
            format!(
                "cannot create a decoded copy in {} (give another with --stage-dir)",
                dir.display()
            ),
            e,
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    fn stage() -> Arc<Stage> {
        Arc::new(Stage::new(1, 1, None, None).unwrap())
    }

    /// At most a thread a core decodes a front-to-back copy at once; a copy a reader
    /// waits on goes before those queued earlier.
    #[test]
    fn slots_bound_the_copies_and_an_urgent_one_goes_first() {
        let cores = crate::compressed::threads();
        let (held_tx, held_rx) = mpsc::channel();
        let (go_tx, go_rx) = mpsc::channel::<()>();
        let go_rx = Arc::new(Mutex::new(go_rx));
        let holders: Vec<_> = (0..cores)
            .map(|_| {
                let (held, go) = (held_tx.clone(), go_rx.clone());
                std::thread::spawn(move || {
                    let s = stage();
                    let _slot = Slot::take(&s);
                    held.send(()).unwrap();
                    go.lock().recv().unwrap();
                })
            })
            .collect();
        for _ in 0..cores {
            held_rx.recv().unwrap();
        }
        // Two more queue behind them, the second made urgent.
        let (order_tx, order_rx) = mpsc::channel();
        let (a, b) = (stage(), stage());
        let queue = |s: Arc<Stage>, name: &'static str| {
            let order = order_tx.clone();
            std::thread::spawn(move || {
                let _slot = Slot::take(&s);
                order.send(name).unwrap();
            })
        };
        let ta = queue(a.clone(), "a");
        while SLOTS.lock().waiting.iter().all(|w| !Arc::ptr_eq(w, &a)) {
            std::thread::yield_now();
        }
        let tb = queue(b.clone(), "b");
        while SLOTS.lock().waiting.iter().all(|w| !Arc::ptr_eq(w, &b)) {
            std::thread::yield_now();
        }
        assert!(
            order_rx.try_recv().is_err(),
            "a copy started beyond the slots"
        );
        b.urgent.store(true, Ordering::Release);
        go_tx.send(()).unwrap();
        assert_eq!(order_rx.recv().unwrap(), "b");
        for _ in 1..cores {
            go_tx.send(()).unwrap();
        }
        assert_eq!(order_rx.recv().unwrap(), "a");
        for t in holders.into_iter().chain([ta, tb]) {
            t.join().unwrap();
        }
    }
}
