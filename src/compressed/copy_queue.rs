//! The process's copying threads and the queue of decoded copies they make: one queue for
//! every archive of every mount in the process, so a union of 1,000 shards decodes one or
//! two at a time rather than all at once.
//!
//! The one process-wide switch of the compressed streams lives here: [`hold_copies`],
//! which the job (`crate::job`) sets while a mount opens its archives and clears with
//! [`release_copies`] once the mount is live. A switch rather than an option: the queue and
//! its threads outlive any one mount's options, and the hold is read by every copying
//! thread as it picks its next job.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use super::{threads, Compression, DecodedCopy, Points};
use crate::error::{Error, Result};
use crate::per_process::PerProcess;
use crate::source::Source;
use crate::sync::{Condvar, Mutex};

/// A copy queued for the copying threads, a thread a core for every archive of the
/// process: a union of 1,000 shards decodes one or two at a time, not all at once from
/// mount, each with its decoder's window (MiBs) and a thread of its own.
pub(super) struct Job {
    pub(super) copy: Arc<DecodedCopy>,
    pub(super) source: Arc<Source>,
    pub(super) codec: Compression,
    /// The next stretch to take (a parallel copy).
    pub(super) next: AtomicUsize,
    /// A front-to-back copy: one thread makes it, those a reader waits on first.
    pub(super) whole: Option<Arc<Points>>,
}

/// Queues `job` and starts the copying threads not yet started.
pub(super) fn queue(job: Job) -> Result<()> {
    let c = copies();
    c.jobs.lock().push_back(Arc::new(job));
    c.queued.notify_all();
    while c.workers.load(Ordering::Acquire) < threads() {
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
    pending: AtomicU64,
    /// Set while a mount opens its archives: copies nobody waits on wait for the mount
    /// to be live, rather than decode on the cores the opening needs (a union of 1,000
    /// single-frame .tar.zst shards queues 1,000 copies as it opens).
    held: AtomicBool,
}

fn copies() -> &'static Copies {
    static COPIES: PerProcess<Copies> = PerProcess::new();
    COPIES.get(|| Copies {
        jobs: Mutex::new(std::collections::VecDeque::new()),
        queued: Condvar::new(),
        workers: AtomicUsize::new(0),
        pending: AtomicU64::new(0),
        held: AtomicBool::new(false),
    })
}

/// Adds a copy of `len` bytes to those under way; returns the bytes of all of them, what
/// decides between memory and disk.
pub(super) fn reserve(len: u64) -> u64 {
    copies().pending.fetch_add(len, Ordering::AcqRel) + len
}

/// Takes back what [`reserve`] added, for a copy not made.
pub(super) fn unreserve(len: u64) {
    copies().pending.fetch_sub(len, Ordering::AcqRel);
}

/// Wakes the copying threads to pick again: a reader waits on a copy, or the hold ended.
pub(super) fn wake() {
    let c = copies();
    let _jobs = c.jobs.lock();
    c.queued.notify_all();
}

/// Holds back copies nobody waits on until [`release_copies`].
pub fn hold_copies() {
    copies().held.store(true, Ordering::Release);
}

/// Lets the copies held back by [`hold_copies`] go.
pub fn release_copies() {
    let c = copies();
    c.held.store(false, Ordering::Release);
    wake();
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
        let s = &job.copy;
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
pub(super) fn urgent_queued() -> bool {
    copies()
        .jobs
        .lock()
        .iter()
        .any(|j| j.whole.is_some() && j.copy.urgent.load(Ordering::Acquire))
}

/// The job a copying thread takes: a copy a reader waits on, else the oldest.
fn pick(jobs: &std::collections::VecDeque<Arc<Job>>) -> Option<usize> {
    let urgent = jobs
        .iter()
        .position(|j| j.copy.urgent.load(Ordering::Acquire));
    let held = copies().held.load(Ordering::Acquire);
    urgent.or((!jobs.is_empty() && !held).then_some(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stage() -> Arc<DecodedCopy> {
        Arc::new(DecodedCopy::new(1, 1, None, None).unwrap())
    }

    fn job(whole: bool) -> Arc<Job> {
        let exe = std::env::current_exe().unwrap();
        Arc::new(Job {
            copy: stage(),
            source: Arc::new(Source::open(&exe).unwrap()),
            codec: Compression::Zstd,
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
        jobs[2].copy.urgent.store(true, Ordering::Release);
        assert_eq!(pick(&jobs), Some(2));
        jobs.clear();
        assert_eq!(pick(&jobs), None);
    }
}
