//! Pushing file data into the kernel's page cache ahead of the readers of a first epoch
//! (FUSE's notify-store), so the files pushed are read with no READ request: no round
//! trip, no wake-up of a server thread, no reply to copy. With `--preload`, once reads show
//! an epoch. On the bench's 10,000-file tar, a cold 2-reader epoch after a listing took
//! 0.73 s with the push against 1.03 s without (3-run medians,
//! docs/history/2026-11-23-to-25-summary-imagenet-scale-machines.md#pushing-files-into-the-page-cache-2026-11-25).
//!
//! The kernel takes a push only for an inode it holds, and fuser reports a push to an
//! unknown one as a success, so only the files of directories listed with their
//! attributes (READDIRPLUS: the kernel made an inode for every entry) are pushed. With the
//! listing ahead (src/warm/prelist.rs), which lists every directory so within seconds of the
//! mount, the whole tree is pushed, each file once its directory is listed. This module
//! sees the archive and a [`Store`] (src/fuse/store.rs writes to /dev/fuse), never fuser.

use std::collections::HashSet;
use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::sync::RwLock;

use crate::archive::{Archive, Kind, ROOT_INO};
use crate::warm::preload;

/// Bytes a push carries at most; each comes from the archive's own read path.
const PIECE: u32 = 1 << 20;
/// Files a pushing thread takes at a time: neighbours in the archive, read in order.
const CLAIM: usize = 64;
/// How long the push waits for more directories to be listed before it ends, with files
/// of unlisted ones left.
const LISTING_WAIT: Duration = Duration::from_secs(2);

/// Sends bytes of a file into the kernel's page cache.
pub trait Store: Send + Sync {
    /// Bytes of file `ino` from `at`.
    fn store(&self, ino: u64, at: u64, data: &[u8]) -> std::io::Result<()>;
    /// `len` bytes of `ino` from `at` that lie verbatim in `fd` at `pos`, moved without a
    /// copy through this process where the store can (`Ok(false)`: it cannot, read them;
    /// an error ends all pushing, as from [`Store::store`]).
    fn store_from(
        &self,
        _ino: u64,
        _at: u64,
        _fd: BorrowedFd<'_>,
        _pos: u64,
        _len: u32,
    ) -> std::io::Result<bool> {
        Ok(false)
    }
}

pub struct Pusher {
    archive: Arc<dyn Archive>,
    /// Directories listed with attributes.
    listed: RwLock<HashSet<u64>>,
    /// The whole tree will be listed (the listing ahead runs): push every file.
    whole_tree: AtomicBool,
    /// Directories the listing ahead has open: one of 2 M entries takes it seconds, and
    /// the push waits for it rather than give up.
    lister_open: AtomicUsize,
    /// The files being pushed, and which of them a reader asked for first.
    /// Held while the push runs: 24 bytes a file (30 MB at 1.28 M files) that nothing
    /// needs once it has ended.
    batch: RwLock<Option<Arc<Batch>>>,
    /// Whether `batch` is set: a READ outside the push reads this, not the lock.
    pushing: AtomicBool,
    store: OnceLock<Box<dyn Store>>,
    started: AtomicBool,
}

/// Files in the order their data lies, each with its directory, and a bit per file set
/// once a READ for it came (its pages are in the kernel already) or it was pushed.
struct Batch {
    /// (where it lies ([`Archive::place`]), file, directory) of each file, by place: the
    /// push's order. The triples as they were gathered, sorted in place: no second copy
    /// at the push's peak.
    files: Vec<(u64, u64, u64)>,
    read: Vec<AtomicU64>,
    /// A bit per inode number up to the largest of the batch's, set by a READ, where the
    /// numbers are dense (at most [`SPARSE`] times as many as the files): a READ marks
    /// its file without finding where it lies. Finding it took 6% of the server's CPU in
    /// a cold epoch of 2 M files (`Archive::place`, then a binary search of 2 M places).
    read_inos: Option<Vec<AtomicU64>>,
}

/// Inode numbers per file above which a batch marks READs by place, not by number.
const SPARSE: u64 = 64;

impl Batch {
    /// From (place, file, directory) triples.
    fn new(mut files: Vec<(u64, u64, u64)>) -> Batch {
        files.sort_unstable();
        files.dedup_by_key(|f| f.0);
        files.shrink_to_fit();
        let bits = |n: u64| (0..n.div_ceil(64)).map(|_| AtomicU64::new(0)).collect();
        let read = bits(files.len() as u64);
        let top = files.iter().map(|f| f.1).max().unwrap_or(0);
        let read_inos = (top <= SPARSE * files.len() as u64).then(|| bits(top + 1));
        Batch {
            files,
            read,
            read_inos,
        }
    }

    /// A READ asked for `ino`, which lies at `place()`.
    fn note(&self, ino: u64, place: impl FnOnce() -> u64) {
        match &self.read_inos {
            Some(bits) => {
                if let Some(word) = bits.get((ino / 64) as usize) {
                    set(word, ino % 64);
                }
            }
            None => self.mark(place()),
        }
    }

    /// The file at `place` was read.
    fn mark(&self, place: u64) {
        if let Ok(i) = self.files.binary_search_by_key(&place, |f| f.0) {
            set(&self.read[i / 64], (i % 64) as u64);
        }
    }

    /// Whether file `i` was read or pushed.
    fn is_read(&self, i: usize) -> bool {
        let bit = |bits: &[AtomicU64], n: u64| {
            bits.get((n / 64) as usize)
                .is_some_and(|w| w.load(Ordering::Relaxed) & (1 << (n % 64)) != 0)
        };
        bit(&self.read, i as u64)
            || self
                .read_inos
                .as_ref()
                .is_some_and(|b| bit(b, self.files[i].1))
    }

    fn set_read(&self, i: usize) {
        set(&self.read[i / 64], (i % 64) as u64);
    }
}

/// Sets bit `n` of `word`, writing only when it is not set yet (a shared line stays
/// shared while READs of files already marked come).
fn set(word: &AtomicU64, n: u64) {
    let bit = 1u64 << n;
    if word.load(Ordering::Relaxed) & bit == 0 {
        word.fetch_or(bit, Ordering::Relaxed);
    }
}

impl Pusher {
    pub fn new(archive: Arc<dyn Archive>) -> Pusher {
        Pusher {
            archive,
            listed: RwLock::new(HashSet::new()),
            whole_tree: AtomicBool::new(false),
            lister_open: AtomicUsize::new(0),
            batch: RwLock::new(None),
            pushing: AtomicBool::new(false),
            store: OnceLock::new(),
            started: AtomicBool::new(false),
        }
    }

    /// How pushes reach the kernel: set once the FUSE session exists.
    pub fn set_store(&self, store: Box<dyn Store>) {
        let _ = self.store.set(store);
    }

    /// `dir` was listed with its entries' attributes: the kernel holds their inodes.
    pub fn note_listed(&self, dir: u64) {
        self.listed.write().insert(dir);
    }

    /// Whether `dir` was listed with its entries' attributes.
    pub fn is_listed(&self, dir: u64) -> bool {
        self.listed.read().contains(&dir)
    }

    /// The listing ahead opened a directory (`true`), or closed one.
    pub fn lister_listing(&self, open: bool) {
        if open {
            self.lister_open.fetch_add(1, Ordering::Relaxed);
        } else {
            self.lister_open.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Every directory is going to be listed with attributes: the push takes the whole
    /// tree, each file once its directory is listed.
    pub fn expect_whole_tree(&self) {
        self.whole_tree.store(true, Ordering::Relaxed);
    }

    /// The files of `dirs` with their place and directory.
    fn files_of(&self, dirs: &[u64], bytes: &mut u64) -> Vec<(u64, u64, u64)> {
        // Sized for every inode up front: grown by doubling, the list of 1.28 M files
        // was copied from 25 MB into 50 MB at the push's peak (server peak RSS 107 MB;
        // 91 MB sized). Pages not filled take no memory; a count too large to reserve
        // (a damaged image's) leaves the growing to the vector.
        let mut files = Vec::new();
        let hint = self.archive.stats().inodes.min(1 << 26) as usize;
        let _ = files.try_reserve_exact(hint);
        for &dir in dirs {
            let Ok(entries) = self.archive.read_dir(dir) else {
                continue;
            };
            for e in entries.iter().filter(|e| e.kind == Kind::File) {
                if let Ok(a) = self.archive.attr(e.ino) {
                    *bytes += a.size;
                    files.push((self.archive.place(e.ino), e.ino, dir));
                }
            }
        }
        files
    }

    /// Every directory of the archive.
    fn all_dirs(&self) -> Vec<u64> {
        let mut dirs = vec![ROOT_INO];
        let mut i = 0;
        while i < dirs.len() {
            if let Ok(entries) = self.archive.read_dir(dirs[i]) {
                dirs.extend(
                    entries
                        .iter()
                        .filter(|e| e.kind == Kind::Dir)
                        .map(|e| e.ino),
                );
            }
            i += 1;
        }
        dirs
    }

    /// A READ asked for `ino`'s data: pushing it would copy it again.
    pub fn note_read(&self, ino: u64) {
        if !self.pushing.load(Ordering::Relaxed) {
            return;
        }
        if let Some(b) = &*self.batch.read() {
            b.note(ino, || self.archive.place(ino));
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
        let dirs: Vec<u64> = if self.whole_tree.load(Ordering::Relaxed) {
            self.all_dirs()
        } else {
            self.listed.read().iter().copied().collect()
        };
        let mut bytes = 0u64;
        let inos = self.files_of(&dirs, &mut bytes);
        if inos.is_empty() {
            return;
        }
        // The pushed pages come on top of the archive's, which the preload caches.
        if let Some(free) = crate::memory::available() {
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
        let batch = Arc::new(Batch::new(inos));
        *self.batch.write() = Some(batch.clone());
        self.pushing.store(true, Ordering::Relaxed);
        // A compressed archive being decoded ahead: a push now would decode its files a
        // second time, beside the copy (a tar.gz epoch took 2.3-2.8 s so, 1.9-2.2 s
        // without pushing). Files read meanwhile are skipped.
        while self.archive.decoding_ahead() {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let started = Instant::now();
        let stop = AtomicBool::new(false);
        let (files, pushed) = (AtomicU64::new(0), AtomicU64::new(0));
        let mut passes = 0;
        // A pass pushes the files of the directories listed so far; the next, those
        // listed meanwhile, until none is left or no listing comes for a while.
        loop {
            passes += 1;
            let listed_before = self.listed.read().len();
            let left = self.pass(store.as_ref(), &batch, &stop, &files, &pushed);
            if left == 0 || stop.load(Ordering::Relaxed) {
                break;
            }
            let waiting = Instant::now();
            let listing = || self.lister_open.load(Ordering::Relaxed) > 0;
            while self.listed.read().len() == listed_before
                && (waiting.elapsed() < LISTING_WAIT || listing())
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            if self.listed.read().len() == listed_before {
                tracing::info!("{left} files not pushed: their directories were not listed");
                break;
            }
        }
        tracing::info!(
            "pushed {} files ({:.1} GB) into the page cache in {:.1} s ({passes} passes)",
            files.into_inner(),
            pushed.into_inner() as f64 / 1e9,
            started.elapsed().as_secs_f64()
        );
        self.pushing.store(false, Ordering::Relaxed);
        *self.batch.write() = None;
        drop(batch);
        crate::memory::give_back();
    }

    /// Pushes, in order, the files not read yet whose directory is listed; returns the
    /// files left for a directory not listed yet.
    fn pass(
        &self,
        store: &dyn Store,
        batch: &Batch,
        stop: &AtomicBool,
        files: &AtomicU64,
        pushed: &AtomicU64,
    ) -> u64 {
        let next = AtomicUsize::new(0);
        let left = AtomicU64::new(0);
        std::thread::scope(|s| {
            for _ in 0..push_threads() {
                s.spawn(|| {
                    while !stop.load(Ordering::Relaxed) {
                        let first = next.fetch_add(CLAIM, Ordering::Relaxed);
                        if first >= batch.files.len() {
                            return;
                        }
                        let last = (first + CLAIM).min(batch.files.len());
                        let mut seen: Option<(u64, bool)> = None;
                        for i in first..last {
                            if batch.is_read(i) {
                                continue;
                            }
                            let (_, ino, dir) = batch.files[i];
                            let listed = match seen {
                                Some((d, l)) if d == dir => l,
                                _ => self.listed.read().contains(&dir),
                            };
                            seen = Some((dir, listed));
                            if !listed {
                                left.fetch_add(1, Ordering::Relaxed);
                                continue;
                            }
                            match self.push_file(store, ino) {
                                Ok(n) => {
                                    batch.set_read(i);
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
        left.into_inner()
    }

    /// Pushes one file whole; the bytes pushed, or the error that ends all pushing (the
    /// mount is gone). A file the archive cannot read is left to the readers' own reads.
    fn push_file(&self, store: &dyn Store, ino: u64) -> std::io::Result<u64> {
        let Ok(size) = self.archive.attr(ino).map(|a| a.size) else {
            return Ok(0);
        };
        if !self.archive.held(ino) {
            return Ok(0);
        }
        let mut at = 0;
        while at < size {
            if let Some((fd, pos, len)) = self.archive.stored_at(ino, at, PIECE) {
                if store.store_from(ino, at, fd, pos, len)? {
                    at += u64::from(len);
                    continue;
                }
            }
            let data = match self.archive.read(ino, at, PIECE) {
                Ok(d) if !d.is_empty() => d,
                _ => break,
            };
            store.store(ino, at, &data)?;
            at += data.len() as u64;
        }
        Ok(at)
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
    fn a_batch_marks_the_files_read_by_place_and_ignores_others() {
        let places: Vec<u64> = (0..200u64).rev().map(|i| i * 3 + 1_000_000).collect();
        let files: Vec<_> = places.iter().map(|&p| (p, p ^ 0xff, 1)).collect();
        let b = Batch::new([files, vec![(1_000_000, 1_000_000 ^ 0xff, 1)]].concat());
        assert_eq!(b.files.len(), 200, "sorted and deduplicated");
        assert!(b.files.windows(2).all(|w| w[0].0 < w[1].0));
        assert!(b.files.iter().all(|&(p, i, _)| i == p ^ 0xff));
        b.mark(1_000_000 + 3 * 70);
        b.mark(1_000_000 + 3 * 199);
        b.mark(1_000_001); // not in the batch
        b.mark(7);
        let read: Vec<usize> = (0..b.files.len()).filter(|&i| b.is_read(i)).collect();
        assert_eq!(read, vec![70, 199]);
    }

    #[test]
    fn a_batch_marks_reads_by_inode_number_where_the_numbers_are_dense() {
        // Places descend as inode numbers rise: the push's order is not the numbers'.
        let files: Vec<_> = (0..200u64).map(|i| (10_000 - i * 7, i + 2, 1)).collect();
        let b = Batch::new(files);
        assert!(b.read_inos.is_some());
        b.note(2, || unreachable!("a dense batch needs no place"));
        b.note(150, || unreachable!());
        b.note(5_000, || unreachable!()); // above every number of the batch
        let read: Vec<u64> = (0..b.files.len())
            .filter(|&i| b.is_read(i))
            .map(|i| b.files[i].1)
            .collect();
        assert_eq!(read, vec![150, 2], "in the order of places");

        // Sparse numbers: marked by place, the place asked for.
        let sparse = Batch::new(vec![(10, 1 << 40, 1), (20, 5, 1)]);
        assert!(sparse.read_inos.is_none());
        sparse.note(1 << 40, || 10);
        assert!(sparse.is_read(0) && !sparse.is_read(1));
    }

    /// A ustar member: header and data padded to 512 bytes.
    fn member(out: &mut Vec<u8>, name: &str, kind: u8, data: &[u8]) {
        let mut h = [0u8; 512];
        h[..name.len()].copy_from_slice(name.as_bytes());
        h[100..108].copy_from_slice(b"0000755\0");
        h[108..116].copy_from_slice(b"0000000\0");
        h[116..124].copy_from_slice(b"0000000\0");
        h[124..136].copy_from_slice(format!("{:011o}\0", data.len()).as_bytes());
        h[136..148].copy_from_slice(b"00000000000\0");
        h[156] = kind;
        h[257..265].copy_from_slice(b"ustar\x0000");
        h[148..156].fill(b' ');
        let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
        h[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
        out.extend_from_slice(&h);
        out.extend_from_slice(data);
        out.resize(out.len().next_multiple_of(512), 0);
    }

    /// Keeps what is pushed; bytes that lie on disk are read, as a store without splice.
    struct Kept(Arc<crate::sync::Mutex<Vec<Pushed>>>);

    /// Inode, offset, bytes.
    type Pushed = (u64, u64, Vec<u8>);

    impl Store for Kept {
        fn store(&self, ino: u64, at: u64, data: &[u8]) -> std::io::Result<()> {
            self.0.lock().push((ino, at, data.to_vec()));
            Ok(())
        }
    }

    /// A union's files are pushed shard by shard, each in its own order (as the preload
    /// reads them), not by inode number, which interleaves the shards.
    #[test]
    fn a_union_is_pushed_member_by_member() {
        let dir = std::env::temp_dir().join(format!("archfs-push-union-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for shard in ["a", "b", "c"] {
            let mut tar = Vec::new();
            for i in 0..4 {
                member(&mut tar, &format!("{shard}{i}"), b'0', shard.as_bytes());
            }
            tar.resize(tar.len() + 1024, 0);
            std::fs::write(dir.join(format!("{shard}.tar")), &tar).unwrap();
        }
        let archive = crate::open::open_many(
            std::slice::from_ref(&dir),
            &crate::cache::CacheConfig::default(),
            &Default::default(),
        )
        .unwrap();
        let stored = Arc::new(crate::sync::Mutex::new(Vec::new()));
        let p = Arc::new(Pusher::new(archive.clone()));
        p.set_store(Box::new(Kept(stored.clone())));
        p.note_listed(ROOT_INO);
        p.start();
        let end = Instant::now() + Duration::from_secs(30);
        while stored.lock().len() < 12 && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(10));
        }
        let names: Vec<String> = stored
            .lock()
            .iter()
            .map(|(_, _, data)| String::from_utf8_lossy(data).into_owned())
            .collect();
        let want: Vec<String> = ["a", "b", "c"]
            .iter()
            .flat_map(|s| std::iter::repeat_n(s.to_string(), 4))
            .collect();
        assert_eq!(names, want);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_whole_tree_is_pushed_each_file_once_its_directory_is_listed() {
        let dir = std::env::temp_dir().join(format!("archfs-push-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut tar = Vec::new();
        for d in ["a", "b"] {
            member(&mut tar, &format!("{d}/"), b'5', b"");
            for i in 0..3 {
                member(
                    &mut tar,
                    &format!("{d}/{i}"),
                    b'0',
                    format!("{d}{i}").as_bytes(),
                );
            }
        }
        tar.resize(tar.len() + 1024, 0);
        let path = dir.join("t.tar");
        std::fs::write(&path, &tar).unwrap();
        let archive = crate::open::open(&path, &crate::cache::CacheConfig::default()).unwrap();
        let ino = |d: &str| archive.lookup(ROOT_INO, d.as_bytes()).unwrap().ino;
        let files_of = |d: &str| -> Vec<u64> {
            let mut v: Vec<u64> = archive
                .read_dir(ino(d))
                .unwrap()
                .iter()
                .map(|e| e.ino)
                .collect();
            v.sort();
            v
        };
        let stored = Arc::new(crate::sync::Mutex::new(Vec::new()));
        let p = Arc::new(Pusher::new(archive.clone()));
        p.set_store(Box::new(Kept(stored.clone())));
        p.expect_whole_tree();
        p.note_listed(ino("a"));
        p.start();
        let pushed = || {
            let mut v: Vec<u64> = stored.lock().iter().map(|s| s.0).collect();
            v.sort();
            v
        };
        let wait = |want: &[u64]| {
            let end = Instant::now() + Duration::from_secs(30);
            while pushed() != want && Instant::now() < end {
                std::thread::sleep(Duration::from_millis(10));
            }
            pushed()
        };
        assert_eq!(
            wait(&files_of("a")),
            files_of("a"),
            "only a's files while b is unlisted"
        );
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(
            pushed(),
            files_of("a"),
            "b's files pushed before b was listed"
        );
        // Listed within LISTING_WAIT: the next pass takes b's files, each once.
        p.note_listed(ino("b"));
        let all = [files_of("a"), files_of("b")].concat();
        assert_eq!(wait(&all), all);
        for (ino, at, data) in stored.lock().iter() {
            assert_eq!(*at, 0);
            assert_eq!(data, &archive.read(*ino, 0, 100).unwrap().to_vec());
        }
        // Nothing left to push: the list of files goes with the push.
        let end = Instant::now() + Duration::from_secs(30);
        while p.batch.read().is_some() && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(p.batch.read().is_none(), "the push ended and kept its list");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
