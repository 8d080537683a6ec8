//! A decoded copy of a compressed archive, for formats a read cannot enter in the middle.
//! A background thread decodes the archive once, front to back, into memory (a memfd)
//! when it fits in 3/4 of the free memory, else into an unlinked file on node-local disk
//! (`--stage-dir`, else `$TMPDIR`, else /tmp). Reads wait only until the copy passes
//! their end, so the first files are served long before the copy is complete.

use std::fs::File;
use std::os::fd::FromRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

use super::{fill, Codec, Points, BLOCK};
use crate::archive::Source;
use crate::error::{Error, Result};

pub struct Stage {
    file: File,
    progress: Mutex<Progress>,
    moved: Condvar,
}

#[derive(Default)]
struct Progress {
    /// Decoded bytes written so far.
    upto: u64,
    failed: Option<String>,
}

impl Stage {
    /// Starts copying; returns at once.
    pub fn start(
        source: Arc<Source>,
        codec: Codec,
        points: Arc<Points>,
        dir: Option<&Path>,
    ) -> Result<Arc<Stage>> {
        let len = points.len();
        let fits =
            crate::preload::available_memory().is_none_or(|free| (len as f64) < free as f64 * 0.75);
        let file = match (fits, dir) {
            (true, None) => memfd().or_else(|_| temp_file(&default_dir()))?,
            (_, Some(d)) => temp_file(d)?,
            (false, None) => temp_file(&default_dir())?,
        };
        let stage = Arc::new(Stage {
            file,
            progress: Mutex::new(Progress::default()),
            moved: Condvar::new(),
        });
        let s = stage.clone();
        std::thread::Builder::new()
            .name("archfs-stage".into())
            .spawn(move || {
                let started = std::time::Instant::now();
                let result = s.copy(&source, codec, &points);
                let mut p = s.progress.lock();
                match result {
                    Ok(()) => tracing::info!(
                        "decoded copy of {} complete: {} MiB in {:.1} s",
                        source.path().display(),
                        len >> 20,
                        started.elapsed().as_secs_f64()
                    ),
                    Err(e) => {
                        tracing::error!("decoding {}: {e}", source.path().display());
                        p.failed = Some(e.to_string());
                    }
                }
                drop(p);
                s.moved.notify_all();
            })
            .map_err(|e| Error::io("cannot start the decoding thread", e))?;
        Ok(stage)
    }

    /// Decodes front to back, a block at a time, each checked against its CRC from the
    /// indexing pass.
    fn copy(&self, source: &Arc<Source>, codec: Codec, points: &Points) -> Result<()> {
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
                self.file.write_all_at(b, at).map_err(|e| {
                    Error::io("cannot write the decoded copy (is the disk full?)", e)
                })?;
                at += b.len() as u64;
                self.progress.lock().upto = at;
                self.moved.notify_all();
            }
        }
        Ok(())
    }

    /// Fills `out` from `pos` once the copy has got that far.
    pub fn read_exact_at(&self, pos: u64, out: &mut [u8]) -> Result<()> {
        let end = pos + out.len() as u64;
        let mut p = self.progress.lock();
        while p.upto < end {
            if let Some(e) = &p.failed {
                return Err(Error::corrupt(format!("the decoded copy failed: {e}")));
            }
            self.moved.wait(&mut p);
        }
        drop(p);
        self.file
            .read_exact_at(out, pos)
            .map_err(|e| Error::io("read of the decoded copy", e))
    }
}

fn default_dir() -> PathBuf {
    std::env::var_os("TMPDIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/tmp"))
}

/// An anonymous in-memory file. Called through `syscall`: glibc's wrapper is 2.27+.
fn memfd() -> std::io::Result<File> {
    // SAFETY: a NUL-terminated name and flags; the result is checked.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_memfd_create,
            c"archfs-stage".as_ptr(),
            libc::MFD_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a new descriptor that nothing else owns.
    Ok(unsafe { File::from_raw_fd(fd as i32) })
}

/// A file nobody else can open, gone when the server exits.
fn temp_file(dir: &Path) -> Result<File> {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = dir.join(format!(".archfs-stage-{}-{n}", std::process::id()));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)
        .map_err(|e| {
            Error::io(
                format!(
                    "cannot create a decoded copy in {} (give another with --stage-dir)",
                    dir.display()
                ),
                e,
            )
        })?;
    let _ = std::fs::remove_file(&path);
    Ok(file)
}
