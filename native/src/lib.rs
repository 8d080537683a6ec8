//! `archfs._native`: the archive interface for a Python process that reads an archive in
//! place, where there is no `/dev/fuse` or where a mount's open/close per file costs more
//! than the read. Thin: paths in, bytes and stat fields out, every call's work done with
//! the GIL released. The Python package (python/archfs/reader.py) builds the API users
//! see on top of it.

mod stage;

use std::ffi::OsStr;
use std::mem::ManuallyDrop;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::PathBuf;
use std::sync::Arc;

use archfs::archive::path::{files_under, read_into, walk, Dirs};
use archfs::archive::{Archive as Reader, Attr, Kind};
use archfs::cache::CacheConfig;
use archfs::error::Error;
use archfs::open::{open_many, OpenOptions};
use archfs::source::{RemoteOptions, Staging};
use archfs::warm::preload::{Plan, Trigger};
use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyFloat, PyString};

/// A directory entry: name, `S_IFMT` bits, its `os.stat_result` when asked for.
type Entry<'py> = (Bound<'py, PyString>, u32, Option<Bound<'py, PyAny>>);

/// An open archive (or union of archives). Its threads and locks belong to the process
/// that opened it: in a child made by `fork` it is never used (the Python side opens
/// its own) and never dropped, since dropping could wait on threads the child lacks.
#[pyclass(frozen, module = "archfs._native")]
struct Archive {
    inner: ManuallyDrop<Arc<dyn Reader>>,
    pid: u32,
    /// Directories reads went through, by path (`archive::path::Dirs`).
    dirs: Dirs,
    /// `preload="auto"`: streams the archive into the page cache once reads show an
    /// epoch, as a mount does (each DataLoader worker has one; the page cache is shared,
    /// and a worker finding the pages there reads nothing again).
    trigger: Option<Trigger>,
}

impl Drop for Archive {
    fn drop(&mut self) {
        if self.pid == std::process::id() {
            // SAFETY: dropped once, here, and never used again.
            unsafe { ManuallyDrop::drop(&mut self.inner) };
        }
    }
}

#[pymethods]
impl Archive {
    #[new]
    #[pyo3(signature = (paths, recursive=false, cache_size=None, no_sign_request=false, preload="auto"))]
    fn new(
        py: Python<'_>,
        paths: Vec<PathBuf>,
        recursive: bool,
        cache_size: Option<u64>,
        no_sign_request: bool,
        preload: &str,
    ) -> PyResult<Self> {
        if paths.is_empty() {
            return Err(PyValueError::new_err("no archive given"));
        }
        let cache = CacheConfig {
            total_bytes: cache_size.unwrap_or(DEFAULT_CACHE).max(1 << 20),
        };
        let stage = match preload {
            "auto" => Staging::Auto,
            "always" => Staging::Always,
            "never" => Staging::Never,
            _ => {
                return Err(PyValueError::new_err(format!(
                    "preload {preload:?} is not \"auto\", \"always\" or \"never\""
                )))
            }
        };
        // Remote archives: one copy on the node for every process of the job, made once
        // reads show an epoch (`auto`), read by all.
        let options = OpenOptions {
            recursive,
            remote: RemoteOptions {
                no_sign_request,
                stage,
                ..Default::default()
            },
            ..Default::default()
        };
        let opened = py.detach(|| open_many(&paths, &cache, &options));
        let name = paths[0].as_os_str().as_bytes().to_vec();
        let inner = opened.map_err(|e| open_error(e, &name))?;
        // One process of the job on the node preloads (DataLoader's workers and every
        // rank open the same archive).
        let key = archfs::node::archives_key(&paths);
        let trigger = match preload {
            "auto" => Some(Trigger::new(inner.extents()).once_per_node(key)),
            "always" => {
                Plan::new(inner.extents(), archfs::memory::available()).start_once_per_node(&key);
                None
            }
            _ => None,
        };
        Ok(Archive {
            inner: ManuallyDrop::new(inner),
            pid: std::process::id(),
            dirs: Dirs::default(),
            trigger,
        })
    }

    /// The format, as `archfs info` names it.
    fn format(&self) -> String {
        self.inner.format()
    }

    /// The `os.stat_result` of `path`, its last link followed when `follow`.
    fn stat<'py>(&self, py: Python<'py>, path: Name, follow: bool) -> PyResult<Bound<'py, PyAny>> {
        let (a, dirs) = (self.archive(), &self.dirs);
        let attr = py
            .detach(|| dirs.walk(a, &path.0, follow))
            .map_err(|e| to_py(e, &path.0))?;
        stat_result(py, &attr)
    }

    /// The entries of directory `path` as (name, kind, `os.stat_result` or None): `kind`
    /// is the file type's `S_IFMT` bits; the `os.stat_result` when `attrs`.
    fn listdir<'py>(&self, py: Python<'py>, path: Name, attrs: bool) -> PyResult<Vec<Entry<'py>>> {
        let a = self.archive();
        let found = py
            .detach(|| -> archfs::error::Result<_> {
                let dir = walk(a, &path.0, true)?;
                if dir.kind != Kind::Dir {
                    return Err(Error::NotDir);
                }
                let entries = a.read_dir(dir.ino)?;
                let stats = if attrs {
                    entries
                        .iter()
                        .map(|e| a.attr(e.ino).map(Some))
                        .collect::<Result<Vec<_>, _>>()?
                } else {
                    entries.iter().map(|_| None).collect()
                };
                Ok((entries, stats))
            })
            .map_err(|e| to_py(e, &path.0))?;
        let (entries, stats) = found;
        (entries.iter().zip(stats))
            .map(|(e, s)| {
                let st = s.map(|s| stat_result(py, &s)).transpose()?;
                Ok((name(py, &e.name), kind_bits(e.kind), st))
            })
            .collect()
    }

    /// Bytes `offset..offset+size` of file `path` (to its end when `size` is None),
    /// links followed.
    #[pyo3(signature = (path, offset=0, size=None))]
    fn read<'py>(
        &self,
        py: Python<'py>,
        path: Name,
        offset: u64,
        size: Option<u64>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let (a, dirs) = (self.archive(), &self.dirs);
        self.note_read(offset);
        let found = py
            .detach(|| read_small(a, dirs, &path.0, offset, size))
            .map_err(|e| to_py(e, &path.0))?;
        match found {
            Found::Read(data) => Ok(PyBytes::new(py, &data)),
            Found::Large { ino, len } => {
                filled(py, len, |buf| read_all(a, ino, offset, buf)).map_err(|e| e.into_py(&path.0))
            }
        }
    }

    /// Each of `paths` whole, in one call: the GIL released twice for all of them (to
    /// find them and read the small ones, then to read the large ones into their
    /// `bytes`), the large ones by `threads` threads at once (bytes of a remote archive
    /// not yet on the node then come in as many GETs at a time).
    #[pyo3(signature = (paths, threads=1))]
    fn read_many<'py>(
        &self,
        py: Python<'py>,
        paths: Vec<Name>,
        threads: usize,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let (a, dirs) = (self.archive(), &self.dirs);
        let found = py.detach(|| {
            let mut out = Vec::with_capacity(paths.len());
            for p in &paths {
                self.note_read(0);
                match read_small(a, dirs, &p.0, 0, None) {
                    Ok(f) => out.push(f),
                    Err(e) => return Err((e, p.0.clone())),
                }
            }
            Ok(out)
        });
        let found = found.map_err(|(e, p)| to_py(e, &p))?;
        let mut out = Vec::with_capacity(found.len());
        let mut large = Vec::new();
        for (i, f) in found.into_iter().enumerate() {
            match f {
                Found::Read(data) => out.push(PyBytes::new(py, &data)),
                Found::Large { ino, len } => {
                    out.push(uninit_bytes(py, len)?);
                    large.push((i, ino, len));
                }
            }
        }
        if !large.is_empty() {
            // SAFETY: each object is new, referenced by `out` alone until returned, and
            // its buffer is `len` bytes long; the GIL is released, so nothing reads it
            // while it is written.
            let mut bufs: Vec<(&mut [u8], u64, usize)> = large
                .iter()
                .map(|&(i, ino, len)| (unsafe { bytes_buffer(&out[i], len) }, ino, i))
                .collect();
            py.detach(|| read_all_of(a, &mut bufs, threads))
                .map_err(|(e, i): (Error, usize)| to_py(e, &paths[i].0))?;
        }
        Ok(out)
    }

    /// The inode numbers of the files at `paths` (links followed; 0 for a path that is
    /// missing or no file): what [`Archive::fetch_ahead`] takes, found once a dataset.
    fn inodes(&self, py: Python<'_>, paths: Vec<Name>) -> Vec<u64> {
        let (a, dirs) = (self.archive(), &self.dirs);
        py.detach(|| {
            paths
                .iter()
                .map(|p| match dirs.walk(a, &p.0, true) {
                    Ok(attr) if attr.kind == Kind::File => attr.ino,
                    _ => 0,
                })
                .collect()
        })
    }

    /// Fetches the files `inos` (from `inodes`) in this order into the node's copy of
    /// the objects they are in, in the background, in place of the order this process
    /// gave last; the number of files it will fetch (those of local archives and
    /// compressed tars are read as they are).
    fn fetch_ahead(&self, py: Python<'_>, inos: Vec<u64>) -> usize {
        let a = self.archive();
        py.detach(|| archfs::archive::fetch_ahead(a, &inos))
    }

    /// The positions in `inos` (from `inodes`) of the files read now without waiting for
    /// the node's copy being filled in order to bring them; when none is, waits up to
    /// `wait` seconds for bytes to land ([`archfs::archive::landed`]).
    fn landed(&self, py: Python<'_>, inos: Vec<u64>, wait: f64) -> Vec<usize> {
        let a = self.archive();
        let wait = std::time::Duration::from_secs_f64(wait.max(0.0));
        py.detach(|| archfs::archive::landed(a, &inos, wait))
    }

    /// The inode number and size of the file at `path` (links followed), for a file
    /// object's reads by [`Archive::pread`].
    fn open(&self, py: Python<'_>, path: Name) -> PyResult<(u64, u64)> {
        let (a, dirs) = (self.archive(), &self.dirs);
        let attr = py
            .detach(|| match dirs.walk(a, &path.0, true)? {
                d if d.kind == Kind::Dir => Err(Error::IsDir),
                f => Ok(f),
            })
            .map_err(|e| to_py(e, &path.0))?;
        Ok((attr.ino, attr.size))
    }

    /// Up to `size` bytes from `offset` of the file with inode `ino` (from `open`);
    /// errors name it `path`.
    fn pread<'py>(
        &self,
        py: Python<'py>,
        ino: u64,
        offset: u64,
        size: usize,
        path: Name,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let a = self.archive();
        self.note_read(offset);
        // No more than the file holds: a caller's buffer may be far larger.
        let left = py
            .detach(|| a.attr(ino))
            .map_err(|e| to_py(e, &path.0))?
            .size
            .saturating_sub(offset);
        let len = size.min(usize::try_from(left).unwrap_or(usize::MAX));
        filled(py, len, |buf| read_all(a, ino, offset, buf)).map_err(|e| e.into_py(&path.0))
    }

    /// A symbolic link's target.
    fn readlink<'py>(&self, py: Python<'py>, path: Name) -> PyResult<Bound<'py, PyString>> {
        let a = self.archive();
        let target = py
            .detach(|| {
                let attr = walk(a, &path.0, false)?;
                a.readlink(attr.ino)
            })
            .map_err(|e| to_py(e, &path.0))?;
        Ok(name(py, &target))
    }

    /// Extended attributes of `path` as (name, value).
    fn xattrs<'py>(
        &self,
        py: Python<'py>,
        path: Name,
        follow: bool,
    ) -> PyResult<Vec<(Bound<'py, PyString>, Bound<'py, PyBytes>)>> {
        let a = self.archive();
        let all = py
            .detach(|| {
                let attr = walk(a, &path.0, follow)?;
                a.xattrs(attr.ino)
            })
            .map_err(|e| to_py(e, &path.0))?;
        Ok(all
            .iter()
            .map(|(k, v)| (name(py, k), PyBytes::new(py, v)))
            .collect())
    }

    /// Where the files at `paths` lie in the archive as stored, with the archive's
    /// tables: sorted and merged `(start, end)` byte ranges, what a node's copy of a
    /// share of the files holds (`archfs.stage.stage_files`). ValueError when a file's
    /// bytes do not lie in the archive's own (a compressed tar, a union).
    fn stored<'py>(&self, py: Python<'py>, paths: Vec<Name>) -> PyResult<Vec<(u64, u64)>> {
        let a = self.archive();
        let found = py.detach(|| {
            let mut out = a.tables();
            for p in &paths {
                let attr = walk(a, &p.0, true).map_err(|e| (e, p))?;
                match a.stored(attr.ino) {
                    Some(r) => out.extend(r),
                    None => {
                        return Err((
                            Error::Unsupported(format!(
                                "its files do not lie whole in its own bytes ({}): stage the \
                                 whole archive (archfs.stage.stage) or read on demand",
                                a.format()
                            )),
                            p,
                        ))
                    }
                }
            }
            Ok(archfs::source::merged(out))
        });
        found
            .map(|r| r.into_iter().map(|r| (r.start, r.end)).collect())
            .map_err(|(e, p)| match e {
                Error::Unsupported(why) => PyValueError::new_err(why),
                e => to_py(e, &p.0),
            })
    }

    /// The files under directory `root` as `root/.../name` paths, in the order an
    /// ImageFolder index takes them (see `archfs::archive::path::files_under`), only
    /// those ending in one of `suffixes` (lowercase) when given.
    #[pyo3(signature = (root, suffixes=None))]
    fn files<'py>(
        &self,
        py: Python<'py>,
        root: Name,
        suffixes: Option<Vec<String>>,
    ) -> PyResult<Vec<Bound<'py, PyString>>> {
        let a = self.archive();
        let found = py
            .detach(|| files_under(a, &root.0, suffixes.as_deref()))
            .map_err(|e| to_py(e, &root.0))?;
        Ok(found.iter().map(|p| name(py, p)).collect())
    }
}

impl Archive {
    /// The archive, borrowed for a call (no reference count touched a read).
    fn archive(&self) -> &dyn Reader {
        &**self.inner
    }

    /// Counts a read for `preload="auto"` (one atomic load once it has started).
    fn note_read(&self, offset: u64) {
        if let Some(t) = &self.trigger {
            t.note_read(offset);
        }
    }
}

/// The block cache of one process, as a mount's (an upper bound, filled as read):
/// DataLoader runs several processes, each with its own. A shuffled pass over 1.28 M
/// files of a zstd image read 32 us a file with 128 MiB (fragments decompressed again
/// and again), 5.7 us with 512 MiB.
const DEFAULT_CACHE: u64 = 512 << 20;

/// A path as the OS takes it: `bytes` as they are, `str` encoded as `os.fsencode` does
/// (undecodable bytes back from their surrogates), a path-like object by `os.fspath`.
struct Name(Vec<u8>);

impl<'a, 'py> FromPyObject<'a, 'py> for Name {
    type Error = PyErr;

    fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if let Ok(b) = obj.cast::<PyBytes>() {
            return Ok(Name(b.as_bytes().to_vec()));
        }
        if let Ok(s) = obj.extract::<std::ffi::OsString>() {
            return Ok(Name(s.into_vec()));
        }
        let py = obj.py();
        let fspath = py.import("os")?.getattr("fspath")?.call1((obj,))?;
        if fspath.is_instance_of::<PyBytes>() {
            return Ok(Name(fspath.cast::<PyBytes>()?.as_bytes().to_vec()));
        }
        Ok(Name(fspath.extract::<std::ffi::OsString>()?.into_vec()))
    }
}

/// What [`read_small`] found: the bytes of a small read, or the file a large one needs
/// a buffer for.
enum Found {
    Read(Vec<u8>),
    Large { ino: u64, len: usize },
}

/// Reads up to this many bytes go through a buffer of ours and are copied into their
/// `bytes`, found and read in one release of the GIL; larger ones are read straight into
/// an unfilled `bytes` after it is made, one copy of the data as `os.read` makes (the
/// zeroed buffer and the second copy made a 110 KiB JPEG 19 us against a plain file's
/// 13.5 us).
const SMALL_READ: usize = 16 << 10;

/// Finds `path` and reads `offset..offset+size` of it (to its end when `size` is None)
/// when that is small.
fn read_small(
    a: &dyn Reader,
    dirs: &Dirs,
    path: &[u8],
    offset: u64,
    size: Option<u64>,
) -> archfs::error::Result<Found> {
    let attr = dirs.walk(a, path, true)?;
    if attr.kind == Kind::Dir {
        return Err(Error::IsDir);
    }
    let left = attr.size.saturating_sub(offset);
    let want = size.map_or(left, |s| s.min(left));
    let len = usize::try_from(want)
        .map_err(|_| Error::Limit("the file is too large to read at once".into()))?;
    if len > SMALL_READ {
        return Ok(Found::Large { ino: attr.ino, len });
    }
    let mut buf = vec![0; len];
    read_all(a, attr.ino, offset, &mut buf)?;
    Ok(Found::Read(buf))
}

/// Fills `buf` from `offset` of file `ino`: a file that ends before its size says is
/// damaged.
fn read_all(a: &dyn Reader, ino: u64, offset: u64, buf: &mut [u8]) -> archfs::error::Result<()> {
    let n = read_into(a, ino, offset, buf)?;
    if n < buf.len() {
        return Err(Error::corrupt(format!(
            "the file holds {n} of the {} bytes its size says",
            buf.len()
        )));
    }
    Ok(())
}

/// Fills each `(buf, ino, i)` of `bufs` with file `ino`, `threads` at a time; the first
/// error met, with its `i`.
fn read_all_of(
    a: &dyn Reader,
    bufs: &mut [(&mut [u8], u64, usize)],
    threads: usize,
) -> Result<(), (Error, usize)> {
    let one = |(buf, ino, i): &mut (&mut [u8], u64, usize)| {
        read_all(a, *ino, 0, buf).map_err(|e| (e, *i))
    };
    let threads = threads.clamp(1, bufs.len().max(1));
    if threads == 1 {
        return bufs.iter_mut().try_for_each(one);
    }
    let per = bufs.len().div_ceil(threads);
    std::thread::scope(|s| {
        let runs: Vec<_> = bufs
            .chunks_mut(per)
            .map(|part| s.spawn(move || part.iter_mut().try_for_each(one)))
            .collect();
        runs.into_iter()
            .try_for_each(|r| r.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
    })
}

/// Why [`filled`] failed: the read, or Python (no memory for the object).
enum Fill {
    Read(Error),
    Py(PyErr),
}

impl Fill {
    fn into_py(self, path: &[u8]) -> PyErr {
        match self {
            Fill::Read(e) => to_py(e, path),
            Fill::Py(e) => e,
        }
    }
}

/// A `bytes` of `len` bytes written by `fill` with the GIL released, returned only once
/// `fill` has written all of it.
fn filled<'py>(
    py: Python<'py>,
    len: usize,
    fill: impl FnOnce(&mut [u8]) -> archfs::error::Result<()> + Send,
) -> Result<Bound<'py, PyBytes>, Fill> {
    let bytes = uninit_bytes(py, len).map_err(Fill::Py)?;
    // SAFETY: `bytes` is new and referenced here alone; with the GIL released nothing
    // else can reach it while `fill` writes it.
    let buf = unsafe { bytes_buffer(&bytes, len) };
    py.detach(|| fill(buf)).map_err(Fill::Read)?;
    Ok(bytes)
}

/// A new `bytes` of `len` bytes whose contents are not yet written: it must be filled
/// (see [`bytes_buffer`]) before Python code can see it.
fn uninit_bytes(py: Python<'_>, len: usize) -> PyResult<Bound<'_, PyBytes>> {
    let n = isize::try_from(len).map_err(|_| PyValueError::new_err("read too large"))?;
    // SAFETY: a null source asks CPython for an object of `n` unset bytes; a null result
    // is an error Python has set.
    unsafe {
        let ptr = pyo3::ffi::PyBytes_FromStringAndSize(std::ptr::null(), n);
        Ok(Bound::from_owned_ptr_or_err(py, ptr)?.cast_into_unchecked())
    }
}

/// The buffer of a `bytes` of `len` bytes, writable.
///
/// # Safety
/// `bytes` must be new (from [`uninit_bytes`] with `len`) and reachable by no other code until the
/// returned slice is dropped.
unsafe fn bytes_buffer<'a>(bytes: &Bound<'_, PyBytes>, len: usize) -> &'a mut [u8] {
    let ptr = pyo3::ffi::PyBytes_AsString(bytes.as_ptr()).cast::<u8>();
    std::slice::from_raw_parts_mut(ptr, len)
}

/// The `os.stat_result` of an entry, with the fields `os.stat` fills. Made here rather
/// than in Python from a tuple of fields: 20,000 stats took 0.027 s against 0.030.
fn stat_result<'py>(py: Python<'py>, a: &Attr) -> PyResult<Bound<'py, PyAny>> {
    static STAT_RESULT: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let ty = STAT_RESULT.get_or_try_init(py, || -> PyResult<_> {
        Ok(py.import("os")?.getattr("stat_result")?.unbind())
    })?;
    let mode = kind_bits(a.kind) | u32::from(a.perm);
    let fields = (
        mode, a.ino, 0u32, a.nlink, a.uid, a.gid, a.size, a.mtime, a.mtime, a.mtime,
    );
    let t = PyFloat::new(py, a.mtime as f64 + f64::from(a.mtime_nsec) / 1e9);
    let ns = i128::from(a.mtime) * 1_000_000_000 + i128::from(a.mtime_nsec);
    let more = PyDict::new(py);
    for k in [
        intern!(py, "st_atime"),
        intern!(py, "st_mtime"),
        intern!(py, "st_ctime"),
    ] {
        more.set_item(k, &t)?;
    }
    // One Python int for the three (an i128 converts slowly under the stable ABI).
    let ns = match i64::try_from(ns) {
        Ok(ns) => ns.into_pyobject(py)?.into_any(),
        Err(_) => ns.into_pyobject(py)?.into_any(),
    };
    for k in [
        intern!(py, "st_atime_ns"),
        intern!(py, "st_mtime_ns"),
        intern!(py, "st_ctime_ns"),
    ] {
        more.set_item(k, &ns)?;
    }
    more.set_item(intern!(py, "st_blksize"), 4096)?;
    more.set_item(intern!(py, "st_blocks"), a.blocks)?;
    more.set_item(intern!(py, "st_rdev"), a.rdev)?;
    ty.bind(py).call1((fields, more))
}

fn kind_bits(k: Kind) -> u32 {
    match k {
        Kind::File => libc::S_IFREG,
        Kind::Dir => libc::S_IFDIR,
        Kind::Symlink => libc::S_IFLNK,
        Kind::BlockDev => libc::S_IFBLK,
        Kind::CharDev => libc::S_IFCHR,
        Kind::Fifo => libc::S_IFIFO,
        Kind::Socket => libc::S_IFSOCK,
    }
}

/// A name as `os.fsdecode` gives it (undecodable bytes as surrogates), as `os.listdir`
/// on a mount would.
fn name<'py>(py: Python<'py>, bytes: &[u8]) -> Bound<'py, PyString> {
    OsStr::from_bytes(bytes)
        .into_pyobject(py)
        .expect("an OsStr always converts")
}

/// An error of a call on `path` as the `OSError` subclass its errno picks
/// (`FileNotFoundError`, `NotADirectoryError`, ...), with the CLI's wording.
fn to_py(e: Error, path: &[u8]) -> PyErr {
    let errno = match &e {
        Error::Io { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
        e => e.errno(),
    };
    Python::attach(|py| PyOSError::new_err((errno, e.to_string(), name(py, path).unbind())))
}

/// An archive that cannot be opened: not an archive (or one archfs cannot read, or one
/// past a limit, or an object store that would not serve it) is a `ValueError`; a
/// missing or unreadable file the `OSError` of its errno.
fn open_error(e: Error, path: &[u8]) -> PyErr {
    match e {
        Error::Unsupported(m)
        | Error::NotArchive(m)
        | Error::Usage(m)
        | Error::Limit(m)
        | Error::Config(m)
        | Error::Remote(m) => PyValueError::new_err(m),
        Error::Corrupt(m) => PyValueError::new_err(format!(
            "{}: corrupt archive: {m}",
            String::from_utf8_lossy(path)
        )),
        e => to_py(e, path),
    }
}

/// Bytes from a size as the command line takes it (`512M`, `2G`, `64KiB`: K, M, G, T are
/// powers of 1024), so the Python package reads `cache_size` and `keep` as the command
/// line reads `--cache-size` and `--keep`.
#[pyfunction]
fn parse_size(size: &str) -> PyResult<u64> {
    archfs::size::parse_size(size).map_err(|e| PyValueError::new_err(e.to_string()))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // Warnings (a copy that does not fit, a hub that does not answer) on stderr, as
    // the command line gives them; more with ARCHFS_LOG.
    archfs::logging::init(false, false);
    m.add_class::<Archive>()?;
    m.add_class::<stage::Topology>()?;
    m.add_class::<stage::NodeCopy>()?;
    m.add_function(wrap_pyfunction!(stage::fetched, m)?)?;
    m.add_function(wrap_pyfunction!(stage::topology, m)?)?;
    m.add_function(wrap_pyfunction!(parse_size, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
