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

use crate::sync::{Condvar, Mutex};

use super::{fill, Codec, Decoder, Points, BLOCK};
use crate::error::{Error, Result};
use crate::per_process::PerProcess;
use crate::source::{scratch, Source};

pub struct Stage {
    /// Made when the first bytes are written: a union of 1,000 shards opens without
    /// 1,000 memfds (its remount took 0.05 s more).
    file: std::sync::OnceLock<File>,
    /// Where the file goes: memory if the copies under way fit, else `dir` or scratch.
    room: u64,
    dir: Option<std::path::PathBuf>,
    progress: Mutex<Progress>,
    moved: Condvar,
    /// Parallel copies: the state of each stretch between entry points ([`FREE`],
    /// [`BUSY`], [`COPIED`], [`FAILED`]).
    copied: Option<(Arc<Points>, Box<[AtomicU8]>)>,
    /// A reader waits on this front-to-back copy: it goes before the others queued.
    urgent: std::sync::atomic::AtomicBool,
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
        let pending = copies().pending.fetch_add(len, Ordering::AcqRel) + len;
        let stage = match Stage::new(len, pending, dir, None) {
            Ok(s) => Arc::new(s),
            Err(e) => {
                copies().pending.fetch_sub(len, Ordering::AcqRel);
                return Err(e);
            }
        };
        queue(Job {
            stage: stage.clone(),
            source,
            codec,
            next: AtomicUsize::new(0),
            whole: Some(points),
        })?;
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
        memory_only: bool,
    ) -> Result<Option<Arc<Stage>>> {
        let len = points.len();
        let pending = copies().pending.fetch_add(len, Ordering::AcqRel) + len;
        if memory_only && !fits(pending) {
            copies().pending.fetch_sub(len, Ordering::AcqRel);
            return Ok(None);
        }
        let copied = (0..points.count()).map(|_| AtomicU8::new(FREE)).collect();
        let stage = match Stage::new(len, pending, dir, Some((points, copied))) {
            Ok(s) => Arc::new(s),
            Err(e) => {
                copies().pending.fetch_sub(len, Ordering::AcqRel);
                return Err(e);
            }
        };
        queue(Job {
            stage: stage.clone(),
            source,
            codec,
            next: AtomicUsize::new(0),
            whole: None,
        })?;
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
        Ok(Stage {
            file: std::sync::OnceLock::new(),
            room,
            dir: dir.map(Path::to_owned),
            progress: Mutex::new(Progress::default()),
            moved: Condvar::new(),
            copied,
            urgent: Default::default(),
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
    /// those a reader took first, until none is left or a reader waits on a
    /// front-to-back copy still queued (that one goes first).
    fn copy_stretches(&self, source: &Arc<Source>, codec: Codec, next: &AtomicUsize) -> Result<()> {
        let Some((points, _)) = &self.copied else {
            return Ok(());
        };
        let mut block = vec![0u8; BLOCK as usize];
        let mut dec: Option<Box<dyn Decoder>> = None;
        loop {
            if urgent_queued() {
                return Ok(());
            }
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= points.count() {
                return Ok(());
            }
            if !self.claim(i) {
                continue;
            }
            let p = points.points[i];
            let reused = match &mut dec {
                Some(d) => d.restart(source, &p, &points.window(i)?)?,
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

    /// The copy's file, made on first use.
    fn file(&self) -> Result<&File> {
        if let Some(f) = self.file.get() {
            return Ok(f);
        }
        let made = match (fits(self.room), &self.dir) {
            (true, None) => scratch::memfd().or_else(|_| temp_file(&scratch::default_dir()))?,
            (_, Some(d)) => temp_file(d)?,
            (false, None) => temp_file(&scratch::default_dir())?,
        };
        Ok(self.file.get_or_init(|| made))
    }

    fn write(&self, b: &[u8], at: u64) -> Result<()> {
        self.file()?
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

    /// Stretches between entry points of a parallel copy.
    fn stretches(&self) -> usize {
        self.copied.as_ref().map_or(0, |(points, _)| points.count())
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
        self.file()?
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
            // Its slot goes before those of copies nobody waits on (and past the hold).
            if !self.urgent.swap(true, Ordering::AcqRel) {
                let c = copies();
                let _jobs = c.jobs.lock();
                c.queued.notify_all();
            }
            p = self.moved.wait(p);
        }
        drop(p);
        self.file()?
            .read_exact_at(out, pos)
            .map_err(|e| Error::io("read of the decoded copy", e))
    }
}

/// A copy queued for the copying threads, a thread a core for every archive of the
/// process: a union of 1,000 shards decodes one or two at a time, not all at once from
/// mount, each with its decoder's window (MiBs) and a thread of its own.
struct Job {
    stage: Arc<Stage>,
    source: Arc<Source>,
    codec: Codec,
    /// The next stretch to take (a parallel copy).
    next: AtomicUsize,
    /// A front-to-back copy: one thread makes it, those a reader waits on first.
    whole: Option<Arc<Points>>,
}

/// Queues `job` and starts the copying threads not yet started.
fn queue(job: Job) -> Result<()> {
    let c = copies();
    c.jobs.lock().push_back(Arc::new(job));
    c.queued.notify_all();
    while c.workers.load(Ordering::Acquire) < super::threads() {
        let n = c.workers.fetch_add(1, Ordering::AcqRel);
        std::thread::Builder::new()
            .name(format!("archfs-stage-{n}"))
            .spawn(copy_jobs)
            .map_err(|e| Error::io("cannot start a decoding thread", e))?;
    }
    Ok(())
}

/// The copies of this process and the threads that make them.
struct Copies {
    jobs: Mutex<std::collections::VecDeque<Arc<Job>>>,
    queued: Condvar,
    /// Copying threads started.
    workers: AtomicUsize,
    /// Bytes of parallel copies not yet complete (memory they are still to take).
    pending: std::sync::atomic::AtomicU64,
    /// Set while a mount opens its archives: copies nobody waits on wait for the mount
    /// to be live, rather than decode on the cores the opening needs (a union of 1,000
    /// single-frame .tar.zst shards queues 1,000 copies as it opens).
    held: std::sync::atomic::AtomicBool,
}

fn copies() -> &'static Copies {
    static COPIES: PerProcess<Copies> = PerProcess::new();
    COPIES.get(|| Copies {
        jobs: Mutex::new(std::collections::VecDeque::new()),
        queued: Condvar::new(),
        workers: AtomicUsize::new(0),
        pending: std::sync::atomic::AtomicU64::new(0),
        held: std::sync::atomic::AtomicBool::new(false),
    })
}

/// Holds back copies nobody waits on until [`release_copies`].
pub fn hold_copies() {
    copies().held.store(true, Ordering::Release);
}

/// Lets the copies held back by [`hold_copies`] go.
pub fn release_copies() {
    let c = copies();
    c.held.store(false, Ordering::Release);
    let _jobs = c.jobs.lock();
    c.queued.notify_all();
}

/// A copying thread: takes a front-to-back copy a reader waits on, else the oldest
/// queued copy; works on a parallel one with the others until none of its stretches is
/// left to take.
fn copy_jobs() {
    loop {
        let job = {
            let mut jobs = copies().jobs.lock();
            loop {
                match pick(&jobs) {
                    Some(i) if jobs[i].whole.is_some() => break jobs.remove(i).expect("queued"),
                    Some(i) => break jobs[i].clone(),
                    None => jobs = copies().queued.wait(jobs),
                }
            }
        };
        let s = &job.stage;
        s.running.fetch_add(1, Ordering::AcqRel);
        let copied = match &job.whole {
            Some(points) => s.copy(&job.source, job.codec, points),
            None => s.copy_stretches(&job.source, job.codec, &job.next),
        };
        if let Err(e) = copied {
            tracing::error!("decoding {}: {e}", job.source.path().display());
            // Its other stretches are left to the readers.
            job.next.store(usize::MAX / 2, Ordering::Release);
        }
        // Told after leaving, so that the last thread out sees what all of them took.
        let last = s.running.fetch_sub(1, Ordering::AcqRel) == 1;
        let taken = job.whole.is_some() || job.next.load(Ordering::Acquire) >= s.stretches();
        if job.whole.is_none() && taken {
            let mut jobs = copies().jobs.lock();
            if let Some(i) = jobs.iter().position(|j| Arc::ptr_eq(j, &job)) {
                jobs.remove(i);
            }
        }
        if last && taken && !s.done.swap(true, Ordering::AcqRel) {
            copies().pending.fetch_sub(s.len, Ordering::AcqRel);
            tracing::info!(
                "decoded copy of {} complete: {} MiB in {:.1} s",
                job.source.path().display(),
                s.len >> 20,
                s.started.elapsed().as_secs_f64()
            );
        }
    }
}

/// Whether a reader waits on a front-to-back copy no thread has taken yet.
fn urgent_queued() -> bool {
    copies()
        .jobs
        .lock()
        .iter()
        .any(|j| j.whole.is_some() && j.stage.urgent.load(Ordering::Acquire))
}

/// The job a copying thread takes: a copy a reader waits on, else the oldest.
fn pick(jobs: &std::collections::VecDeque<Arc<Job>>) -> Option<usize> {
    let urgent = jobs
        .iter()
        .position(|j| j.stage.urgent.load(Ordering::Acquire));
    let held = copies().held.load(Ordering::Acquire);
    urgent.or((!jobs.is_empty() && !held).then_some(0))
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

    fn stage() -> Arc<Stage> {
        Arc::new(Stage::new(1, 1, None, None).unwrap())
    }

    fn job(whole: bool) -> Arc<Job> {
        let exe = std::env::current_exe().unwrap();
        Arc::new(Job {
            stage: stage(),
            source: Arc::new(Source::open(&exe).unwrap()),
            codec: Codec::Zstd,
            next: AtomicUsize::new(0),
            whole: whole.then(Default::default),
        })
    }

    /// A copy a reader waits on goes before those queued earlier, whatever its kind;
    /// else the oldest.
    #[test]
    fn a_copy_a_reader_waits_on_goes_first() {
        let mut jobs: std::collections::VecDeque<_> =
            [job(false), job(true), job(true)].into_iter().collect();
        assert_eq!(pick(&jobs), Some(0));
        jobs[2].stage.urgent.store(true, Ordering::Release);
        assert_eq!(pick(&jobs), Some(2));
        jobs.clear();
        assert_eq!(pick(&jobs), None);
    }
}
