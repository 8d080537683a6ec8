//! The local file, the first kind of [`Storage`]: `pread` needs no lock, and the kernel
//! reads ahead on advice and splices from the file's page cache.

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use std::sync::Arc;

use super::Storage;
use crate::error::{Error, Result};

/// An archive in a local file (or on a parallel filesystem mounted as one).
#[derive(Debug)]
pub struct LocalFile {
    file: File,
    len: u64,
    mtime: i64,
    mtime_ns: i64,
    /// [`Storage::place_id`]: device, inode and change time.
    place: u64,
    path: PathBuf,
    /// Bytes the kernel reads of one `POSIX_FADV_WILLNEED` ([`advice_piece`]).
    advice: Option<u64>,
    /// The node's copies of the file, made by the job's stage-in (`archfs.stage`).
    copies: Arc<super::remote::FileCopies>,
}

impl LocalFile {
    pub fn open(path: &Path) -> Result<LocalFile> {
        Self::open_as(path, false)
    }

    /// For a stage-in of the file to the node (`archfs.stage`): its node copies are
    /// looked for, or made, even where no process of the job on the node has any.
    pub fn open_to_copy(path: &Path) -> Result<LocalFile> {
        Self::open_as(path, true)
    }

    /// The node's copies of the file.
    pub fn copies(&self) -> &super::remote::FileCopies {
        &self.copies
    }

    fn open_as(path: &Path, copy: bool) -> Result<LocalFile> {
        let file = File::open(path).map_err(|e| {
            let hint = match e.kind() {
                std::io::ErrorKind::NotFound => "check the path",
                std::io::ErrorKind::PermissionDenied => "check its permissions",
                _ => "",
            };
            Error::io(
                format!("cannot open archive {} ({hint})", path.display()),
                e,
            )
        })?;
        let meta = file
            .metadata()
            .map_err(|e| Error::io(format!("cannot stat {}", path.display()), e))?;
        if meta.is_dir() {
            return Err(Error::NotArchive(format!(
                "{} is a directory, not an archive",
                path.display()
            )));
        }
        use std::os::unix::fs::MetadataExt;
        let mut local = LocalFile {
            advice: advice_piece(&file),
            file,
            len: meta.len(),
            mtime: meta.mtime(),
            mtime_ns: meta.mtime() * 1_000_000_000 + meta.mtime_nsec(),
            copies: Default::default(),
            place: {
                let mut h = crc32fast::Hasher::new();
                for v in [
                    meta.dev(),
                    meta.ino(),
                    meta.ctime() as u64,
                    meta.ctime_nsec() as u64,
                ] {
                    h.update(&v.to_le_bytes());
                }
                let lo = u64::from(h.clone().finalize());
                h.update(b"hi");
                (u64::from(h.finalize()) << 32 | lo).max(1)
            },
            path: path.to_owned(),
        };
        local.copies = Arc::new(super::remote::FileCopies::find(
            &local.file,
            path,
            (local.len, local.mtime, local.place),
            copy,
        ));
        Ok(local)
    }
}

impl Storage for LocalFile {
    fn read_exact_at(&self, buf: &mut [u8], pos: u64) -> std::io::Result<()> {
        if self.copies.read(pos, buf)? {
            return Ok(());
        }
        self.file.read_exact_at(buf, pos)
    }

    fn size(&self) -> u64 {
        self.len
    }

    fn path(&self) -> &Path {
        &self.path
    }

    fn is_local(&self) -> bool {
        true
    }

    fn mtime(&self) -> i64 {
        self.mtime
    }

    fn version(&self) -> i64 {
        self.mtime_ns
    }

    fn place_id(&self) -> u64 {
        self.place
    }

    fn will_need(&self, at: u64, len: u64) {
        if self.copies.any() {
            return;
        }
        // Asked for in 1 MiB pieces, a scan's first bytes come sooner: a cold first
        // index of the bench's 1.1 GB tar took 0.46-0.58 s so, 0.42-0.99 s (mostly
        // 0.9) in the disk's 8 MiB readahead pieces.
        let piece = self.advice.map_or(len, |a| a.min(1 << 20));
        will_need(&self.file, at, len, piece);
    }

    fn fd(&self, at: u64, len: u64) -> Option<(BorrowedFd<'_>, u64)> {
        self.copies.fd(at, len).or(Some((self.file.as_fd(), at)))
    }

    fn held(&self, at: u64, len: u64) -> bool {
        self.copies.held(at, len)
    }

    fn partial(&self) -> bool {
        self.copies.partial()
    }

    fn copied(&self) -> bool {
        self.copies.any()
    }

    /// Through a descriptor of its own (reads at other places through one descriptor
    /// make the kernel take both for random reads); falls back to a copy of this one's.
    fn reopen(&self) -> std::io::Result<Arc<dyn Storage>> {
        use std::os::fd::AsRawFd;
        let proc = PathBuf::from(format!("/proc/self/fd/{}", self.file.as_raw_fd()));
        let file = File::open(&proc).or_else(|_| self.file.try_clone())?;
        Ok(Arc::new(LocalFile {
            file,
            len: self.len,
            mtime: self.mtime,
            mtime_ns: self.mtime_ns,
            place: self.place,
            path: self.path.clone(),
            advice: self.advice,
            copies: self.copies.clone(),
        }))
    }
}

/// Asks the kernel to start reading `[at, at + len)` of `file` into the page cache,
/// without waiting, `piece` bytes a call (see [`advice_piece`]).
pub fn will_need(file: &File, at: u64, len: u64, piece: u64) {
    use std::os::fd::AsRawFd;
    let end = at.saturating_add(len);
    let mut at = at;
    while at < end {
        let n = piece.max(crate::memory::page_size() as u64).min(end - at);
        // SAFETY: posix_fadvise only reads its arguments; the file is open.
        unsafe {
            libc::posix_fadvise(
                file.as_raw_fd(),
                at as libc::off_t,
                n as libc::off_t,
                libc::POSIX_FADV_WILLNEED,
            )
        };
        at += n;
    }
}

/// How much of `file` one `POSIX_FADV_WILLNEED` call is sure to read: the kernel reads at
/// most the larger of the device's readahead size and its largest request and drops the
/// rest (a 64 MiB call cached 8 MiB on the bench's disk; a disk with the default 128 KiB
/// readahead would cache as little as 128 KiB of it). The readahead size, from sysfs.
/// `None` where it is not known or readahead is off (tmpfs, Lustre and other filesystems
/// without a device number's bdi): advice may then do nothing, and whoever must have the
/// data reads it.
/// Read once a device: a union of 10,000 shards asks for each as it opens them, and again
/// as the preload reads them.
pub fn advice_piece(file: &File) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    type Known = crate::sync::Mutex<Vec<(u64, Option<u64>)>>;
    static KNOWN: crate::per_process::PerProcess<Known> = crate::per_process::PerProcess::new();
    let known = KNOWN.get(|| crate::sync::Mutex::new(Vec::new()));
    let dev = file.metadata().ok()?.dev();
    if let Some(&(_, piece)) = known.lock().iter().find(|(d, _)| *d == dev) {
        return piece;
    }
    let piece = device_piece(dev);
    known.lock().push((dev, piece));
    piece
}

fn device_piece(dev: u64) -> Option<u64> {
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    let id = format!("{major}:{minor}");
    [
        format!("/sys/class/bdi/{id}/read_ahead_kb"),
        format!("/sys/dev/block/{id}/queue/read_ahead_kb"),
        // A partition: its disk's queue.
        format!("/sys/dev/block/{id}/../queue/read_ahead_kb"),
    ]
    .iter()
    .find_map(|p| std::fs::read_to_string(p).ok()?.trim().parse::<u64>().ok())
    .filter(|&kb| kb > 0)
    .map(|kb| kb << 10)
}

#[cfg(test)]
pub mod tests {
    use super::*;

    /// Pages of `[0, len)` of `file` in the page cache, by mincore over a mapping.
    pub fn resident(file: &File, len: usize) -> usize {
        use std::os::fd::AsRawFd;
        // SAFETY: a fresh read-only shared mapping of an open file, unmapped below; mincore
        // writes one byte per page into a vector of that many.
        unsafe {
            let map = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            );
            assert_ne!(map, libc::MAP_FAILED);
            let mut vec = vec![0u8; len.div_ceil(crate::memory::page_size())];
            assert_eq!(libc::mincore(map, len, vec.as_mut_ptr()), 0);
            libc::munmap(map, len);
            vec.iter().filter(|&&b| b & 1 == 1).count()
        }
    }

    /// One call for 48 MiB is cut to the device's readahead size by the kernel (8 MiB on
    /// the bench's disk); in pieces, all of it arrives.
    #[test]
    fn advice_in_pieces_brings_the_whole_range() {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target");
        let path = dir.join(format!("advice-{}", std::process::id()));
        let len = 48usize << 20;
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        let file = File::open(&path).unwrap();
        file.sync_all().unwrap();
        std::fs::remove_file(&path).unwrap();
        let piece = advice_piece(&file).expect(
            "the test's file is on a block device with readahead (target/ on a local disk)",
        );
        assert!(piece >= 4096, "{piece}");
        use std::os::fd::AsRawFd;
        // SAFETY: posix_fadvise only reads its arguments. Drops the file's clean pages.
        let dropped =
            unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        assert_eq!(dropped, 0);
        let pages = len / crate::memory::page_size();
        assert!(resident(&file, len) < pages / 2, "pages not dropped");
        will_need(&file, 0, len as u64, piece);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let mut have = resident(&file, len);
        while have < pages && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(50));
            have = resident(&file, len);
        }
        assert_eq!(have, pages, "pages read ahead");
        // The data is the file's.
        let mut back = vec![0u8; 4096];
        file.read_exact_at(&mut back, len as u64 - 4096).unwrap();
        assert_eq!(back, data[len - 4096..]);
    }

    #[test]
    fn no_advice_piece_on_tmpfs() {
        let path = PathBuf::from(format!("/dev/shm/archfs-advice-{}", std::process::id()));
        std::fs::write(&path, b"x").unwrap();
        let file = File::open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(advice_piece(&file), None);
    }
}
