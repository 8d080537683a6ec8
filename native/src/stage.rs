//! `archfs._native.NodeCopy`: the node's copy of an object in object storage, for the
//! stage-in the nodes of a job share (python/archfs/stage.py moves the pieces between
//! nodes with the job's MPI or torch.distributed; this side holds the copy and its
//! board). Waits release the GIL.

use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::time::Duration;

use archfs::source::{
    CopyOf, CopyStatus, LocalFile, NodeCopy as Held, RemoteObject, RemoteOptions, Staging,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

#[pyclass(frozen, module = "archfs._native")]
pub struct NodeCopy {
    inner: Held,
}

fn status(s: CopyStatus) -> &'static str {
    match s {
        CopyStatus::Copied => "copied",
        CopyStatus::Failed => "failed",
        CopyStatus::Pending => "pending",
    }
}

#[pymethods]
impl NodeCopy {
    /// With `make`, places the copy (pieces all free) unless the node has one; else
    /// waits up to `wait` seconds for another process of the job on the node to. With
    /// `ranges` (`(start, end)` of the object), the node's copy of a share of its files:
    /// those bytes only, in a row (`archfs.stage.stage_files`), made here unless the
    /// node has one.
    #[new]
    #[pyo3(signature = (url, make, wait=60.0, no_sign_request=false, stage_dir=None, keep=None, ranges=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        url: PathBuf,
        make: bool,
        wait: f64,
        no_sign_request: bool,
        stage_dir: Option<PathBuf>,
        keep: Option<u64>,
        ranges: Option<Vec<(u64, u64)>>,
    ) -> PyResult<Self> {
        let options = RemoteOptions {
            no_sign_request,
            stage: Staging::Never,
            stage_dir,
            keep,
            ..Default::default()
        };
        let name = url.as_os_str().as_bytes().to_vec();
        let opened = py.detach(|| {
            // A file: on a parallel filesystem, each node reads its share of it.
            let object = match RemoteObject::open(&url, &options) {
                Some(object) => CopyOf::Object(object?),
                None => CopyOf::File(LocalFile::open_to_copy(&url)?),
            };
            let wait = Duration::from_secs_f64(wait.max(0.0));
            match ranges {
                Some(r) => {
                    Held::of_ranges(object, r.into_iter().map(|(a, b)| a..b).collect(), wait)
                }
                None => Held::new(object, make, wait),
            }
        });
        let inner = opened.map_err(|e| crate::open_error(e, &name))?;
        Ok(NodeCopy { inner })
    }

    #[getter]
    fn size(&self) -> u64 {
        self.inner.size()
    }

    #[getter]
    fn pieces(&self) -> u64 {
        self.inner.pieces()
    }

    #[getter]
    fn piece_size(&self) -> u64 {
        Held::PIECE
    }

    /// The copy's file descriptor, to map: its first `size` bytes are the object's.
    fn fileno(&self) -> i32 {
        self.inner.file().as_raw_fd()
    }

    /// Holds every free piece outside `[lo, hi)` for this process to receive, and has
    /// the node fetch the free pieces of `[lo, hi)` from storage; how many it holds.
    fn share(&self, lo: u64, hi: u64) -> PyResult<u64> {
        if lo > hi || hi > self.inner.pieces() {
            return Err(PyValueError::new_err(format!(
                "pieces {lo}..{hi} are not within the copy's {}",
                self.inner.pieces()
            )));
        }
        Ok(self.inner.share(lo..hi))
    }

    /// Whether piece `p` is this process's to receive (now marked arriving).
    fn receive(&self, p: u64) -> bool {
        p < self.inner.pieces() && self.inner.receive(p)
    }

    /// Piece `p`, received into the mapped copy, is in the copy.
    fn landed(&self, p: u64) {
        if p < self.inner.pieces() {
            self.inner.landed(p);
        }
    }

    /// Gives back the pieces held by this process, for the node to fetch from storage;
    /// how many it gave back.
    fn release(&self, py: Python<'_>, pieces: Vec<u64>) -> usize {
        py.detach(|| {
            let n = pieces
                .into_iter()
                .filter(|&p| p < self.inner.pieces() && self.inner.release(p))
                .count();
            self.inner.fetch_free();
            n
        })
    }

    /// Has this process fetch the copy's free pieces from storage.
    fn fetch_free(&self) {
        self.inner.fetch_free();
    }

    /// "copied", "failed" or "pending": piece `p` after waiting up to `timeout` s.
    #[pyo3(signature = (p, timeout=0.0))]
    fn wait(&self, py: Python<'_>, p: u64, timeout: f64) -> &'static str {
        if p >= self.inner.pieces() {
            return "failed";
        }
        let t = Duration::from_secs_f64(timeout.max(0.0));
        status(py.detach(|| self.inner.wait(p, t)))
    }

    /// As `wait`, for the whole copy.
    #[pyo3(signature = (timeout=0.0))]
    fn wait_whole(&self, py: Python<'_>, timeout: f64) -> &'static str {
        let t = Duration::from_secs_f64(timeout.max(0.0));
        status(py.detach(|| self.inner.wait_whole(t)))
    }

    /// Pieces not yet in the copy.
    #[getter]
    fn left(&self) -> u64 {
        self.inner.left()
    }
}

/// Requests this process made of object stores so far, and the bytes they brought with
/// those it read from files into node copies: what it took from shared storage.
#[pyfunction]
pub fn fetched() -> (u64, u64) {
    let (requests, bytes) = archfs::source::remote_totals().unwrap_or((0, 0));
    (requests, bytes + archfs::source::read_from_files())
}

/// The job's shape as its launcher says it (`archfs::topology`).
#[pyclass(frozen, get_all, module = "archfs._native")]
pub struct Topology {
    /// Nodes in the job.
    nodes: u32,
    /// This node's index, when the launcher says it.
    node: Option<u32>,
    /// Ranks on this node, and this rank's index among them, when the launcher says them.
    ranks_here: Option<u32>,
    rank_here: Option<u32>,
    /// The launcher's variables it was read from, for log lines.
    variables: &'static str,
}

/// The job's shape, `None` outside a job.
#[pyfunction]
pub fn topology() -> Option<Topology> {
    archfs::topology::from_env().map(|t| Topology {
        nodes: t.nodes,
        node: t.node,
        ranks_here: t.ranks_here,
        rank_here: t.rank_here,
        variables: t.from,
    })
}
