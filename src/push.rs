//! Pushing file data into the kernel's page cache ahead of the readers of a first epoch
//! (FUSE's notify-store), so the files pushed are read with no READ request: no round
//! trip, no wake-up of a server thread, no reply to copy. With `--preload`, once reads show
//! an epoch. On the bench's 10,000-file tar, a cold 2-reader epoch after a listing took
//! 0.71-0.89 s with the push against 1.14-1.36 s without (docs/BENCHMARKS.md).
//!
//! The kernel takes a push only for an inode it holds, and fuser reports a push to an
//! unknown one as a success, so only the files of directories listed with their
//! attributes (READDIRPLUS: the kernel made an inode for every entry) are pushed. This
//! module sees the archive and a `store` callback, never fuser.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use parking_lot::Mutex;

use crate::archive::{Archive, Kind};
use crate::preload;

/// Bytes a push carries at most; each comes from the archive's own read path.
const PIECE: u32 = 1 << 20;
/// Files a pushing thread takes at a time: neighbours in the archive, read in order.
const CLAIM: usize = 64;

/// Sends bytes of a file to the kernel: `store(ino, offset, data)`.
pub type Store = Box<dyn Fn(u64, u64, &[u8]) -> std::io::Result<()> + Send + Sync>;

pub struct Pusher {
    archive: Arc<dyn Archive>,
    /// Directories listed with attributes, not yet pushed.
    listed: Mutex<HashSet<u64>>,
    /// The files being pushed, and which of them a reader asked for first.
    batch: OnceLock<Batch>,
    store: OnceLock<Store>,
    started: AtomicBool,
}

/// Files in inode order (archive order for tar and for mksquashfs's images), with a bit
/// per file set once a READ for it came: its pages are in the kernel already.
struct Batch {
    inos: Vec<u64>,
    read: Vec<AtomicU64>,
}

impl Batch {
    fn new(mut inos: Vec<u64>) -> Batch {
        inos.sort_unstable();
        inos.dedup();
        let read = (0..inos.len().div_ceil(64))
            .map(|_| AtomicU64::new(0))
            .collect();
        Batch { inos, read }
    }

    fn mark(&self, ino: u64) {
        if let Ok(i) = self.inos.binary_search(&ino) {
            let bit = 1u64 << (i % 64);
            let word = &self.read[i / 64];
            if word.load(Ordering::Relaxed) & bit == 0 {
                word.fetch_or(bit, Ordering::Relaxed);
            }
        }
    }

    fn is_read(&self, i: usize) -> bool {
        self.read[i / 64].load(Ordering::Relaxed) & (1 << (i % 64)) != 0
    }
}

impl Pusher {
    pub fn new(archive: Arc<dyn Archive>) -> Pusher {
        Pusher {
            archive,
            listed: Mutex::new(HashSet::new()),
            batch: OnceLock::new(),
            store: OnceLock::new(),
            started: AtomicBool::new(false),
        }
    }

    /// How pushes reach the kernel: set once the FUSE session exists.
    pub fn set_store(&self, store: Store) {
        let _ = self.store.set(store);
    }

    /// `dir` was listed with its entries' attributes: the kernel holds their inodes.
    pub fn note_listed(&self, dir: u64) {
        if !self.started.load(Ordering::Relaxed) {
            self.listed.lock().insert(dir);
        }
    }

    /// A READ asked for `ino`'s data: pushing it would copy it again.
    pub fn note_read(&self, ino: u64) {
        if let Some(b) = self.batch.get() {
            b.mark(ino);
        }
    }

    /// Pushes the files of the directories listed so far, on a thread of its own, when
    /// they fit in memory beside the archive's own pages.
    pub fn start(self: &Arc<Self>) {
        if self.started.swap(true, Ordering::Relaxed) {
            return;
        }
        let me = self.clone();
        let spawned = std::thread::Builder::new()
            .name("push".into())
            .spawn(move || me.run());
        if let Err(e) = spawned {
            tracing::warn!("cannot start pushing files to the page cache: {e}");
        }
    }

    fn run(&self) {
        let Some(store) = self.store.get() else {
            return;
        };
        let dirs: Vec<u64> = self.listed.lock().drain().collect();
        let mut inos = Vec::new();
        let mut bytes = 0u64;
        for dir in dirs {
            let Ok(entries) = self.archive.read_dir(dir) else {
                continue;
            };
            for e in entries.iter().filter(|e| e.kind == Kind::File) {
                if let Ok(a) = self.archive.attr(e.ino) {
                    bytes += a.size;
                    inos.push(e.ino);
                }
            }
        }
        if inos.is_empty() {
            return;
        }
        // The pushed pages come on top of the archive's, which the preload caches.
        if let Some(free) = preload::available_memory() {
            let archive: u64 = self
                .archive
                .extents()
                .iter()
                .map(|e| e.range.end - e.range.start)
                .sum();
            if (archive + bytes) as f64 > free as f64 * preload::MEMORY_SHARE {
                tracing::info!(
                    "not pushing {} files into the page cache: with the archive they would \
                     take more than {:.0}% of the memory free",
                    inos.len(),
                    preload::MEMORY_SHARE * 100.0
                );
                return;
            }
        }
        let batch = self.batch.get_or_init(|| Batch::new(inos));
        // A compressed archive being decoded ahead: a push now would decode its files a
        // second time, beside the copy (a tar.gz epoch took 2.3-2.8 s so, 1.9-2.2 s
        // without pushing). Files read meanwhile are skipped.
        while self.archive.decoding_ahead() {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let started = Instant::now();
        let workers = push_threads();
        let next = AtomicUsize::new(0);
        let stop = AtomicBool::new(false);
        let (files, pushed) = (AtomicU64::new(0), AtomicU64::new(0));
        std::thread::scope(|s| {
            for _ in 0..workers {
                s.spawn(|| {
                    while !stop.load(Ordering::Relaxed) {
                        let first = next.fetch_add(CLAIM, Ordering::Relaxed);
                        if first >= batch.inos.len() {
                            return;
                        }
                        let last = (first + CLAIM).min(batch.inos.len());
                        for i in first..last {
                            if batch.is_read(i) {
                                continue;
                            }
                            match self.push_file(store, batch.inos[i]) {
                                Ok(n) => {
                                    files.fetch_add(1, Ordering::Relaxed);
                                    pushed.fetch_add(n, Ordering::Relaxed);
                                }
                                Err(e) => {
                                    tracing::debug!("pushing stopped: {e}");
                                    stop.store(true, Ordering::Relaxed);
                                    return;
                                }
                            }
                        }
                    }
                });
            }
        });
        tracing::info!(
            "pushed {} files ({:.1} GB) into the page cache in {:.1} s",
            files.into_inner(),
            pushed.into_inner() as f64 / 1e9,
            started.elapsed().as_secs_f64()
        );
    }

    /// Pushes one file whole; the bytes pushed, or the error that ends all pushing (the
    /// mount is gone). A file the archive cannot read is left to the readers' own reads.
    fn push_file(&self, store: &Store, ino: u64) -> std::io::Result<u64> {
        let mut at = 0;
        loop {
            let data = match self.archive.read(ino, at, PIECE) {
                Ok(d) if !d.is_empty() => d,
                _ => return Ok(at),
            };
            store(ino, at, &data)?;
            at += data.len() as u64;
            if data.len() < PIECE as usize {
                return Ok(at);
            }
        }
    }
}

/// Pushing threads: half the cores, 1 to 4; the rest are the readers'. On 2 cores a second
/// thread made a cold 2-reader epoch of the bench's gzip image 10% faster (1.88-1.95
/// against 2.09-2.24 s) and of its tar 5-40% slower (0.87-1.15 against 0.75-0.83 s), so
/// one. `ARCHFS_PUSH_THREADS` overrides it, for measuring on larger nodes.
fn push_threads() -> usize {
    std::env::var("ARCHFS_PUSH_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get() / 2))
        .clamp(1, 4)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_marks_the_files_read_by_inode_and_ignores_others() {
        let inos: Vec<u64> = (0..200u64).rev().map(|i| i * 3 + 1_000_000).collect();
        let b = Batch::new([inos.clone(), vec![1_000_000]].concat());
        assert_eq!(b.inos.len(), 200, "sorted and deduplicated");
        assert!(b.inos.windows(2).all(|w| w[0] < w[1]));
        b.mark(1_000_000 + 3 * 70);
        b.mark(1_000_000 + 3 * 199);
        b.mark(1_000_001); // not in the batch
        b.mark(7);
        let read: Vec<usize> = (0..b.inos.len()).filter(|&i| b.is_read(i)).collect();
        assert_eq!(read, vec![70, 199]);
    }
}
