//! Positional reads on the archive file. `pread` needs no lock, so parallel readers never
//! queue behind each other for I/O.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::Buf;
use crate::error::{Error, Result};

#[derive(Debug)]
pub struct Source {
    file: File,
    /// Where this source starts in the file (a member of an archive: [`Source::slice`]).
    base: u64,
    len: u64,
    mtime: i64,
    path: PathBuf,
}

impl Source {
    pub fn open(path: &Path) -> Result<Source> {
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
            return Err(Error::Unsupported(format!(
                "{} is a directory, not an archive",
                path.display()
            )));
        }
        use std::os::unix::fs::MetadataExt;
        Ok(Source {
            file,
            base: 0,
            len: meta.len(),
            mtime: meta.mtime(),
            path: path.to_owned(),
        })
    }

    /// The same file through a descriptor of its own, so that a reader that moves through
    /// the file on its own course keeps its own kernel readahead (reads at other places
    /// through one descriptor make the kernel take both for random reads). Falls back to
    /// a copy of this one's descriptor.
    pub fn reopen(&self) -> Result<Source> {
        use std::os::fd::AsRawFd;
        let proc = PathBuf::from(format!("/proc/self/fd/{}", self.file.as_raw_fd()));
        let file = File::open(&proc)
            .or_else(|_| self.file.try_clone())
            .map_err(|e| Error::io(format!("cannot reopen {}", self.path.display()), e))?;
        Ok(Source {
            file,
            base: self.base,
            len: self.len,
            mtime: self.mtime,
            path: self.path.clone(),
        })
    }

    /// Bytes `[at, at + len)` of this source as a source of its own, through a
    /// descriptor of its own (a compressed tar inside a tar).
    pub fn slice(&self, at: u64, len: u64) -> Result<Source> {
        if at.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(Error::corrupt(format!(
                "a member at {at} of {len} bytes is past the end of {}",
                self.path.display()
            )));
        }
        let mut s = self.reopen()?;
        s.base += at;
        s.len = len;
        Ok(s)
    }

    /// Asks the kernel to start reading `[at, at + len)` into the page cache, without
    /// waiting: a scan that will read it soon overlaps that I/O with its own work. In
    /// pieces, as the kernel reads at most the device's readahead size (`read_ahead_kb`,
    /// often 128 KiB) or largest request of one call and drops the rest.
    pub fn will_need(&self, at: u64, len: u64) {
        use std::os::fd::AsRawFd;
        const PIECE: u64 = 1 << 20;
        let end = at.saturating_add(len).min(self.len);
        let mut at = at;
        while at < end {
            let n = PIECE.min(end - at);
            // SAFETY: posix_fadvise only reads its arguments; the file is open.
            unsafe {
                libc::posix_fadvise(
                    self.file.as_raw_fd(),
                    (self.base + at) as libc::off_t,
                    n as libc::off_t,
                    libc::POSIX_FADV_WILLNEED,
                )
            };
            at += n;
        }
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    /// Where this source starts in its file (0 unless it is a [`slice`](Self::slice)).
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Modification time of the archive file (seconds).
    pub fn mtime(&self) -> i64 {
        self.mtime
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Fills `buf` from `pos`; a range past the end of the file means the archive is
    /// truncated or an offset in it is corrupt.
    pub fn read_exact_at(&self, pos: u64, buf: &mut [u8]) -> Result<()> {
        let end = pos.checked_add(buf.len() as u64);
        if end.is_none_or(|end| end > self.len) {
            return Err(Error::corrupt(format!(
                "read of {} bytes at offset {pos} is past the end of the archive ({} bytes): truncated?",
                buf.len(),
                self.len
            )));
        }
        self.file.read_exact_at(buf, self.base + pos).map_err(|e| {
            Error::io(
                format!("read at offset {pos} of {}", self.path.display()),
                e,
            )
        })
    }

    /// Reads `len` bytes at `pos` into one of this thread's reusable buffers.
    pub fn read_buf(&self, pos: u64, len: usize) -> Result<Buf> {
        let mut buf = Buf::take(len);
        self.read_exact_at(pos, &mut buf)?;
        Ok(buf)
    }

    /// Reads `len` bytes at `pos` into a new buffer.
    pub fn read_vec(&self, pos: u64, len: usize) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; len];
        self.read_exact_at(pos, &mut buf)?;
        Ok(buf)
    }
}
