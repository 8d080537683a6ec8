//! A decoded copy of a compressed archive, in memory (a memfd) when it fits in 3/4 of the
//! free memory, else in an unlinked file on node-local disk (`--stage-dir`, else
//! `$TMPDIR`, else /tmp).
//!
//! For formats a read cannot enter in the middle, a background pass decodes the archive
//! once, front to back, and reads wait only until the copy passes their end, so the first
//! files are served long before it is complete. With entry points (`--preload` of a gzip
//! or zstd archive), every core decodes stretches between them in parallel, and a read
//! of a stretch not yet copied is decoded in place meanwhile ([`DecodedCopy::try_read`]).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;

use crate::sync::{Condvar, Mutex};

use super::copy_queue::{self, Job};
use super::{fill, Compression, Decoder, Points, BLOCK};
use crate::error::{Error, Result};
use crate::source::{scratch, Source};

/// A compressed archive's decoded copy, being made or made, that reads are served from.
pub struct DecodedCopy {
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
    pub(super) urgent: std::sync::atomic::AtomicBool,
    /// Threads still copying, whether the copy's end was told, its length and start.
    pub(super) running: AtomicUsize,
    pub(super) done: std::sync::atomic::AtomicBool,
    pub(super) len: u64,
    pub(super) started: std::time::Instant,
}

#[derive(Default)]
struct Progress {
    /// Decoded bytes written so far.
    upto: u64,
    failed: Option<String>,
}

impl DecodedCopy {
    /// Starts copying front to back; returns at once.
    pub fn start(
        source: Arc<Source>,
        codec: Compression,
        points: Arc<Points>,
        dir: Option<&Path>,
    ) -> Result<Arc<DecodedCopy>> {
        // Reserved like a parallel copy's, so the copies of many shards together decide
        // between memory and disk.
        let len = points.len();
        let pending = copy_queue::reserve(len);
        DecodedCopy::queue(source, codec, len, pending, dir, None, Some(points))
    }

    /// Queues a copy of the stretches between entry points for the copying threads
    /// (`threads` of them, shared by every archive of the mount: a union of 1,000
    /// shards copies one or two at a time, not all at once); returns at once. `None`
    /// when the copy would not fit in memory, with the copies still under way, and
    /// `memory_only`.
    pub fn start_parallel(
        source: Arc<Source>,
        codec: Compression,
        points: Arc<Points>,
        dir: Option<&Path>,
        memory_only: bool,
    ) -> Result<Option<Arc<DecodedCopy>>> {
        let len = points.len();
        let pending = copy_queue::reserve(len);
        if memory_only && !fits(pending) {
            copy_queue::unreserve(len);
            return Ok(None);
        }
        let copied = (0..points.count()).map(|_| AtomicU8::new(FREE)).collect();
        let copied = Some((points, copied));
        DecodedCopy::queue(source, codec, len, pending, dir, copied, None).map(Some)
    }

    /// Makes a copy of `len` bytes (reserved, `pending` in all with the others under way)
    /// and queues it for the copying threads; the reservation is taken back if the copy
    /// cannot be made.
    fn queue(
        source: Arc<Source>,
        codec: Compression,
        len: u64,
        pending: u64,
        dir: Option<&Path>,
        copied: Option<(Arc<Points>, Box<[AtomicU8]>)>,
        whole: Option<Arc<Points>>,
    ) -> Result<Arc<DecodedCopy>> {
        let copy = match DecodedCopy::new(len, pending, dir, copied) {
            Ok(c) => Arc::new(c),
            Err(e) => {
                copy_queue::unreserve(len);
                return Err(e);
            }
        };
        copy_queue::queue(Job {
            copy: copy.clone(),
            source,
            codec,
            next: AtomicUsize::new(0),
            whole,
        })?;
        Ok(copy)
    }

    /// `room`: the memory the copies under way, this one's included, are to take: in a
    /// memfd if that fits.
    pub(super) fn new(
        len: u64,
        room: u64,
        dir: Option<&Path>,
        copied: Option<(Arc<Points>, Box<[AtomicU8]>)>,
    ) -> Result<DecodedCopy> {
        Ok(DecodedCopy {
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
    pub(super) fn copy(
        &self,
        source: &Arc<Source>,
        codec: Compression,
        points: &Points,
    ) -> Result<()> {
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
        codec: Compression,
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
    pub(super) fn copy_stretches(
        &self,
        source: &Arc<Source>,
        codec: Compression,
        next: &AtomicUsize,
    ) -> Result<()> {
        let Some((points, _)) = &self.copied else {
            return Ok(());
        };
        let mut block = vec![0u8; BLOCK as usize];
        let mut dec: Option<Box<dyn Decoder>> = None;
        loop {
            if copy_queue::urgent_queued() {
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
    pub(super) fn stretches(&self) -> usize {
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
                copy_queue::wake();
            }
            p = self.moved.wait(p);
        }
        drop(p);
        self.file()?
            .read_exact_at(out, pos)
            .map_err(|e| Error::io("read of the decoded copy", e))
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
