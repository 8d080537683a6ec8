//! `--preload`: streams the archive files into the OS page cache with a few large parallel
//! reads, in the background. A first epoch then finds its shuffled small reads in memory,
//! and the (parallel) filesystem under the archive sees big sequential reads instead of one
//! small random read per file. `always` starts once the mount is live; `auto`, the default,
//! waits for a [`Trigger`]: reads of many files, so a job that lists the tree or opens a
//! few files does not read the whole archive.
//!
//! Metadata (SquashFS directory and inode tables) goes first, so listing the tree is fast
//! early; the data follows only when it fits in the memory free for the page cache, since
//! a preload that evicts its own start before the epoch reaches it is wasted I/O.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use crate::sync::Mutex;

use crate::archive::Extent;

/// Reads in flight at once. On an earlier session's virtio disk, buffered reads of a cold
/// 1.1 GB tar ran at 386 MB/s with one reader, 872 with two, 1458 with four 8 MiB readers
/// and 1848 MB/s with four 2 MiB readers
/// (docs/history/2026-11-23-to-25-summary-imagenet-scale-machines.md#what-each-choice-bought).
const READERS: usize = 4;
/// Bytes per read.
const CHUNK: u64 = 2 << 20;
/// Share of the free memory the preloaded data may take; the rest stays for the job.
pub const MEMORY_SHARE: f64 = 0.75;

/// Files whose first bytes `auto` waits to see read: a training epoch gets there within a
/// fraction of a second, while looking at a few files, listing or `stat`ing the tree
/// (ImageFolder's index) never does.
pub const AUTO_AFTER_FILES: u64 = 128;

/// `--preload=auto`: starts the preload at the [`AUTO_AFTER_FILES`]th read at offset 0
/// (a file's start), deciding then what fits in free memory.
#[derive(Debug)]
pub struct Trigger {
    starts: AtomicU64,
    extents: Mutex<Option<Vec<Extent>>>,
    then: Mutex<Option<Then>>,
    /// The archives' key ([`crate::node::archives_key`]): one process of the job on the
    /// node preloads them.
    node_key: Mutex<Option<String>>,
}

/// What else starts with the preload (decoding a compressed archive ahead).
pub struct Then(pub Box<dyn FnOnce() + Send + Sync>);

impl std::fmt::Debug for Then {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Then")
    }
}

impl Trigger {
    pub fn new(extents: Vec<Extent>) -> Trigger {
        Trigger {
            starts: AtomicU64::new(0),
            extents: Mutex::new(Some(extents)),
            then: Mutex::new(None),
            node_key: Mutex::new(None),
        }
    }

    /// Preloads only in the first process of the job on the node to get there.
    pub fn once_per_node(self, key: String) -> Trigger {
        *self.node_key.lock() = Some(key);
        self
    }

    /// Runs `then` as well when the preload starts.
    pub fn then(self, then: impl FnOnce() + Send + Sync + 'static) -> Trigger {
        *self.then.lock() = Some(Then(Box::new(then)));
        self
    }

    /// Counts a read of `offset`; one atomic load once the preload has started.
    pub fn note_read(&self, offset: u64) {
        if offset != 0 || self.starts.load(Ordering::Relaxed) >= AUTO_AFTER_FILES {
            return;
        }
        if self.starts.fetch_add(1, Ordering::Relaxed) + 1 != AUTO_AFTER_FILES {
            return;
        }
        let Some(extents) = self.extents.lock().take() else {
            return;
        };
        let plan = Plan::new(extents, crate::memory::available());
        let first = match self.node_key.lock().as_deref() {
            Some(key) => crate::node::first_for("preload", key),
            None => true,
        };
        if !first {
            tracing::info!("another process of this job on this node preloads the archive");
        } else {
            match &plan.skipped {
                Some(why) => tracing::info!("{AUTO_AFTER_FILES} files read: {why}"),
                None if plan.extents.is_empty() => {}
                None => tracing::info!(
                    "{AUTO_AFTER_FILES} files read: preloading {}",
                    human(plan.bytes())
                ),
            }
            plan.start();
        }
        if let Some(Then(then)) = self.then.lock().take() {
            then();
        }
    }

    #[cfg(test)]
    fn fired(&self) -> bool {
        self.extents.lock().is_none()
    }
}

/// What to read, decided before the mount goes live so a warning reaches the terminal.
#[derive(Debug, PartialEq)]
pub struct Plan {
    pub extents: Vec<Extent>,
    /// Why the data part was left out, if it was.
    pub skipped: Option<String>,
}

impl Plan {
    /// Everything when it fits in `MEMORY_SHARE` of `available` (or when that is unknown),
    /// else the metadata alone.
    pub fn new(extents: Vec<Extent>, available: Option<u64>) -> Plan {
        let total: u64 = extents.iter().map(|e| e.range.end - e.range.start).sum();
        match available {
            Some(free) if total as f64 > free as f64 * MEMORY_SHARE => {
                let skipped = format!(
                    "--preload: the archives take {}, more than {:.0}% of the {} of memory \
                     free for the page cache; preloading the metadata only (a node with more \
                     memory, or a smaller archive, gets the data preloaded too)",
                    human(total),
                    MEMORY_SHARE * 100.0,
                    human(free),
                );
                Plan {
                    extents: extents.into_iter().filter(|e| e.metadata).collect(),
                    skipped: Some(skipped),
                }
            }
            _ => Plan {
                extents,
                skipped: None,
            },
        }
    }

    pub fn bytes(&self) -> u64 {
        self.extents
            .iter()
            .map(|e| e.range.end - e.range.start)
            .sum()
    }

    /// Starts the readers on a background thread and returns at once.
    /// Starts the reading unless another process of the job on the node has (its page
    /// cache is this one's).
    pub fn start_once_per_node(self, key: &str) {
        if self.extents.is_empty() {
            return;
        }
        if crate::node::first_for("preload", key) {
            self.start();
        } else {
            tracing::info!("another process of this job on this node preloads the archive");
        }
    }

    pub fn start(self) {
        if self.extents.is_empty() {
            return;
        }
        let spawned = std::thread::Builder::new()
            .name("preload".into())
            .spawn(move || self.run());
        if let Err(e) = spawned {
            tracing::warn!("--preload: cannot start a thread: {e}");
        }
    }

    fn run(self) {
        // The readers inherit this, so the mount's FUSE threads and its readers, which
        // share the cores, come first. It helps only a little: a cold `find` over a tar's
        // 10,000 members while the preload ran took 0.18-0.24 s at normal priority and
        // 0.14-0.20 s at nice 10 (0.04-0.05 s without a preload); page-cache insertion
        // in the kernel, not scheduling, is most of that cost.
        // SAFETY: setpriority on this thread's id has no memory preconditions. The raw
        // syscall, as gettid(3) is newer than glibc 2.17, the oldest the wheel supports.
        unsafe {
            let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
            libc::setpriority(libc::PRIO_PROCESS, tid, 10);
        }
        let started = Instant::now();
        // Paths, not open files: a union of 10,000 shards would hold 10,000 more
        // descriptors. A reading thread opens the file of its chunk.
        let mut files = Vec::new();
        // Each file's place in `files` (a search of it for each extent took 2.9 s of a
        // core at 10,000 shards).
        let mut seen = std::collections::HashMap::new();
        let mut chunks = Vec::new();
        for e in &self.extents {
            let f = match seen.get(e.path.as_path()) {
                Some(&i) => i,
                None => match File::open(&e.path) {
                    // Already in memory: nothing to read.
                    Ok(file) if in_memory(&file) => continue,
                    Ok(file) => {
                        let piece = crate::source::advice_piece(&file);
                        files.push((e.path.as_path(), piece));
                        seen.insert(e.path.as_path(), files.len() - 1);
                        files.len() - 1
                    }
                    Err(err) => {
                        tracing::warn!("--preload: cannot open {}: {err}", e.path.display());
                        continue;
                    }
                },
            };
            let mut at = e.range.start;
            while at < e.range.end {
                let len = CHUNK.min(e.range.end - at);
                chunks.push((f, at, len as usize));
                at += len;
            }
        }
        // Small files (a union's shards) are taken a few at a time, all asked for before
        // the reader waits on the first, so that as many bytes are in flight as with
        // whole chunks of one file.
        let bytes: u64 = chunks.iter().map(|c| c.2 as u64).sum();
        let mean = bytes / chunks.len().max(1) as u64;
        let group = (CHUNK / mean.max(1)).clamp(1, 16) as usize;
        let next = AtomicUsize::new(0);
        let failed = AtomicBool::new(false);
        std::thread::scope(|s| {
            for _ in 0..READERS.min(chunks.len()) {
                s.spawn(|| {
                    let mut scratch = Vec::new();
                    let mut open: Vec<(usize, File)> = Vec::new();
                    while !failed.load(Ordering::Relaxed) {
                        let i = next.fetch_add(group, Ordering::Relaxed);
                        let Some(taken) = chunks.get(i..chunks.len().min(i + group)) else {
                            return;
                        };
                        if taken.is_empty() {
                            return;
                        }
                        // The files of the group, opened once each (one, for a large file).
                        open.retain(|(f, _)| taken.iter().any(|c| c.0 == *f));
                        for &(f, at, len) in taken {
                            if !open.iter().any(|(o, _)| *o == f) {
                                // Gone since it was planned: reads will say so.
                                if let Ok(file) = File::open(files[f].0) {
                                    open.push((f, file));
                                }
                            }
                            if let (Some(piece), Some((_, file))) =
                                (files[f].1, open.iter().find(|(o, _)| *o == f))
                            {
                                crate::source::will_need(file, at, len as u64, piece.min(CHUNK));
                            }
                        }
                        for &(f, at, len) in taken {
                            let Some((_, file)) = open.iter().find(|(o, _)| *o == f) else {
                                continue;
                            };
                            if let Err(e) = fetch(file, files[f].1, at, len, &mut scratch) {
                                tracing::warn!(
                                    "--preload stopped: reading {} at {at}: {e}; reads go on \
                                     from the file as they come",
                                    files[f].0.display()
                                );
                                failed.store(true, Ordering::Relaxed);
                                return;
                            }
                        }
                    }
                });
            }
        });
        if !failed.load(Ordering::Relaxed) {
            let secs = started.elapsed().as_secs_f64();
            tracing::info!(
                "preloaded {} in {secs:.1} s ({:.0} MB/s)",
                human(self.bytes()),
                self.bytes() as f64 / secs.max(1e-6) / 1e6
            );
        }
    }
}

/// Waits for `[at, at + len)` of `file` to be in the page cache. Where the kernel takes
/// advice (`piece`), the caller has asked it to read the range ahead (no copy to this
/// process), and the wait is a one-byte read of its end. On the bench's 1.1 GB tar, four
/// threads doing this in 2 MiB chunks cached the file in 0.79-0.84 s, four threads reading
/// the chunks into buffers in 1.06-1.42 s (and spent a core copying)
/// (docs/history/2026-11-23-to-25-summary-imagenet-scale-machines.md#what-each-choice-bought).
/// Where the advice is not known to be taken (`piece` is `None`), the chunk is read into
/// `scratch`.
fn fetch(
    file: &File,
    piece: Option<u64>,
    at: u64,
    len: usize,
    scratch: &mut Vec<u8>,
) -> std::io::Result<()> {
    if piece.is_some() {
        // Asked for by the caller in one call where the device takes it whole (in 1 MiB
        // pieces a cold epoch of the bench's tar took 0.82-1.10 s against 0.74-0.90 s).
        let mut last = [0u8; 1];
        return file.read_exact_at(&mut last, at + len as u64 - 1);
    }
    scratch.resize(len, 0);
    file.read_exact_at(&mut scratch[..len], at)
}

/// A file on tmpfs (`/dev/shm`, a `$TMPDIR` in memory): its pages are its storage.
fn in_memory(file: &File) -> bool {
    use std::os::fd::AsRawFd;
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    // SAFETY: fstatfs writes one statfs struct, zero-initialised here, for an open fd.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    let ok = unsafe { libc::fstatfs(file.as_raw_fd(), &mut st) } == 0;
    ok && st.f_type as i64 == TMPFS_MAGIC
}

fn human(bytes: u64) -> String {
    let b = bytes as f64;
    match bytes {
        0..1_000_000 => format!("{:.0} kB", b / 1e3),
        1_000_000..1_000_000_000 => format!("{:.0} MB", b / 1e6),
        _ => format!("{:.1} GB", b / 1e9),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn extent(range: std::ops::Range<u64>, metadata: bool) -> Extent {
        Extent {
            path: PathBuf::from("a.sqfs"),
            range,
            metadata,
        }
    }

    #[test]
    fn plan_keeps_data_only_when_it_fits() {
        let all = vec![extent(900..1000, true), extent(0..900, false)];
        assert_eq!(Plan::new(all.clone(), Some(2000)).extents, all);
        assert_eq!(Plan::new(all.clone(), None).extents, all);
        let small = Plan::new(all.clone(), Some(1000));
        assert_eq!(small.extents, vec![extent(900..1000, true)]);
        assert!(small.skipped.unwrap().contains("metadata only"));
        assert_eq!(Plan::new(all, None).bytes(), 1000);
    }

    #[test]
    fn trigger_fires_at_the_start_of_the_nth_file() {
        let t = Trigger::new(Vec::new());
        for _ in 0..1000 {
            t.note_read(128 << 10);
        }
        for _ in 1..AUTO_AFTER_FILES {
            t.note_read(0);
        }
        assert!(!t.fired());
        t.note_read(0);
        assert!(t.fired());
        t.note_read(0);
        assert!(t.fired());
    }

    /// Without advice known to be taken, a chunk is read: it is in the page cache after.
    #[test]
    fn a_chunk_without_advice_is_read_into_the_cache() {
        use std::os::fd::AsRawFd;
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target");
        let path = dir.join(format!("preload-fetch-{}", std::process::id()));
        let len = 8usize << 20;
        std::fs::write(&path, vec![7u8; len]).unwrap();
        let file = File::open(&path).unwrap();
        file.sync_all().unwrap();
        std::fs::remove_file(&path).unwrap();
        // SAFETY: posix_fadvise only reads its arguments. Drops the file's clean pages.
        let dropped =
            unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        assert_eq!(dropped, 0);
        let resident = crate::source::resident;
        assert!(resident(&file, len) < 256, "pages not dropped");
        let mut scratch = Vec::new();
        fetch(&file, None, 1 << 20, 2 << 20, &mut scratch).unwrap();
        let have = resident(&file, len);
        assert!(have >= 512, "{have} pages resident, the chunk is 512");
    }

    #[test]
    fn tmpfs_files_are_in_memory_and_disk_files_not() {
        let shm = std::path::PathBuf::from(format!("/dev/shm/archfs-pl-{}", std::process::id()));
        std::fs::write(&shm, b"x").unwrap();
        let f = File::open(&shm).unwrap();
        std::fs::remove_file(&shm).unwrap();
        assert!(in_memory(&f));
        assert!(!in_memory(&File::open(env!("CARGO_MANIFEST_DIR")).unwrap()));
    }
}
