//! A stage-in the nodes of a job share: each node fetches its share of the pieces from
//! storage, and the job's own engine (MPI, torch.distributed; driven from Python,
//! python/archfs/stage.py) carries every piece from the node that fetched it straight
//! into the other nodes' copies. So the storage serves each byte once per job, not once
//! per node.
//!
//! The pieces other nodes fetch are held by the process that receives them (taken, as
//! for a GET of its own) until they land, so no process of the node fetches them from
//! storage meanwhile, and a read of one fetches only its own bytes. A piece given back
//! (its node died or stalled), or held by a process that ended, is free again and the
//! node's copiers fetch it from storage like any other.

use std::fs::File;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::board::Piece;
use super::spans::Spans;
use super::{pool, StagedCopy, Wanted, PIECE};
use crate::error::{Error, Result};
use crate::source::remote::RemoteObject;
use crate::source::{LocalFile, Storage};

/// The node's copy of one object, held open for the process that moves its pieces
/// between the nodes: while this lives, the node keeps the copy.
#[derive(Debug)]
pub struct NodeCopy {
    _of: Of,
    stage: Arc<StagedCopy>,
}

/// What a [`NodeCopy`] is a copy of.
#[derive(Debug)]
pub enum Of {
    /// An object in S3 or over HTTP.
    Object(RemoteObject),
    /// A file on a parallel filesystem (opened with [`LocalFile::open_to_copy`]).
    File(LocalFile),
}

impl Of {
    /// The node's copy, whole or of a share of the files.
    fn wanted(&self, share: bool) -> Option<&Wanted> {
        match self {
            Of::Object(o) if share => o.inner.share.as_ref(),
            Of::Object(o) => o.inner.stage.as_ref(),
            Of::File(f) => f.copies().wanted(share),
        }
    }

    fn name(&self) -> String {
        match self {
            Of::Object(o) => o.inner.target.name.clone(),
            Of::File(f) => f.path().display().to_string(),
        }
    }

    fn size(&self) -> u64 {
        match self {
            Of::Object(o) => o.inner.size,
            Of::File(f) => f.size(),
        }
    }
}

/// The copy `wanted` in this process, once some process of the node has placed it.
fn held(wanted: &Wanted, name: &str, wait: Duration) -> Result<Arc<StagedCopy>> {
    let start = Instant::now();
    loop {
        if let Some(s) = wanted.unpooled() {
            return Ok(s.clone());
        }
        if start.elapsed() > wait {
            return Err(Error::Limit(format!(
                "{name}: no process of this job on this node made its copy within {} s",
                wait.as_secs()
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Where a piece, or the whole copy, stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Copied,
    /// The copy stopped on an error: readers fetch their own bytes.
    Failed,
    /// Not there yet.
    Pending,
}

impl NodeCopy {
    /// The node's copy of `object`. With `make`, made here if no process of the job on
    /// the node has made it, its pieces all free and none fetched yet ([`NodeCopy::share`]
    /// starts that); else waited for, up to `wait`, until some process makes it.
    pub fn new(object: Of, make: bool, wait: Duration) -> Result<NodeCopy> {
        let name = object.name();
        let wanted = object
            .wanted(false)
            .ok_or_else(|| Error::Usage(format!("{name} is empty: there is nothing to copy")))?;
        if make && !wanted.create(true) {
            return Err(Error::Limit(format!(
                "{name}: no copy could be placed on this node (the warning above says why)"
            )));
        }
        let stage = held(wanted, &name, wait)?;
        Ok(NodeCopy { _of: object, stage })
    }

    /// The node's copy of the bytes of `ranges` of `object` (where a share of its files
    /// lies, [`super::spans`]), made here, all free, unless some process of the job on
    /// the node has made one: then that one, whatever ranges it holds.
    /// [`NodeCopy::fetch_free`] starts the copying.
    pub fn of_ranges(
        object: Of,
        ranges: Vec<std::ops::Range<u64>>,
        wait: Duration,
    ) -> Result<NodeCopy> {
        let name = object.name();
        let wanted = object
            .wanted(true)
            .ok_or_else(|| Error::Usage(format!("{name} is empty: there is nothing to copy")))?;
        let spans = Spans::new(ranges, object.size()).ok_or_else(|| {
            Error::Usage(format!("{name}: the files given hold no bytes to copy"))
        })?;
        if !wanted.create_share(&spans) {
            return Err(Error::Limit(format!(
                "{name}: no copy could be placed on this node (the warning above says why)"
            )));
        }
        let stage = held(wanted, &name, wait)?;
        Ok(NodeCopy { _of: object, stage })
    }

    pub fn size(&self) -> u64 {
        self.stage.object.size
    }

    pub fn pieces(&self) -> u64 {
        self.stage.board.pieces()
    }

    /// The bytes a piece holds (the last may be short).
    pub const PIECE: u64 = PIECE;

    /// Where piece `p` is in the object, and its length.
    pub fn span(&self, p: u64) -> (u64, u64) {
        let at = p * PIECE;
        (at, (at + PIECE).min(self.size()) - at)
    }

    /// The copy's file: its first [`NodeCopy::size`] bytes are the object's, to map and
    /// receive pieces into, or send them from.
    pub fn file(&self) -> &File {
        self.stage.file()
    }

    /// Holds for this process every free piece outside `mine` (they come from the other
    /// nodes, [`NodeCopy::receive`]), then has the node's copiers fetch the free pieces
    /// of `mine` from storage. How many pieces it holds.
    pub fn share(&self, mine: std::ops::Range<u64>) -> u64 {
        let board = &self.stage.board;
        let me = StagedCopy::me();
        let pieces = board.pieces();
        let mut held = 0;
        for p in (0..mine.start).chain(mine.end..pieces) {
            if board.swap(p, Piece::Free, Piece::Taken(me)) {
                // From the first piece: a read of it is far from arriving, and fetches
                // its own bytes rather than wait.
                board.run(p).store(0, Ordering::Release);
                board.filled(p).store(0, Ordering::Release);
                held += 1;
            }
        }
        board.next().fetch_max(mine.start, Ordering::AcqRel);
        let size = self.size();
        let here = (mine.end * PIECE).min(size) - (mine.start * PIECE).min(size);
        tracing::info!(
            "{}: this node copies {:.1} GB of it from storage, the job's other nodes the \
             other {:.1} GB",
            self.stage.object.name,
            here as f64 / 1e9,
            (size - here) as f64 / 1e9
        );
        self.fetch_free();
        held
    }

    /// Whether piece `p` is this process's to receive into the copy, marked arriving
    /// now; false when the node has it or another process brings it.
    pub fn receive(&self, p: u64) -> bool {
        let me = StagedCopy::me();
        self.stage
            .board
            .swap(p, Piece::Taken(me), Piece::Arriving(me))
    }

    /// Piece `p`, received into the copy's file, is in the copy.
    pub fn landed(&self, p: u64) {
        self.stage.landed(p, self.span(p).1);
    }

    /// Gives back piece `p` held by this process, for the node to fetch from storage;
    /// false when it did not hold it. Then [`NodeCopy::fetch_free`].
    pub fn release(&self, p: u64) -> bool {
        let board = &self.stage.board;
        let piece = board.piece(p);
        if piece.owner() != Some(StagedCopy::me()) || !board.swap(p, piece, Piece::Free) {
            return false;
        }
        board.filled(p).store(0, Ordering::Release);
        board.next().fetch_min(p, Ordering::AcqRel);
        board.wake();
        true
    }

    /// Has this process's copiers fetch the copy's free pieces from storage.
    pub fn fetch_free(&self) {
        if self.stage.copying() {
            pool().add(self.stage.clone());
        }
    }

    /// Pieces not yet in the copy.
    pub fn left(&self) -> u64 {
        self.stage.board.left().load(Ordering::Acquire)
    }

    pub fn status(&self, p: u64) -> Status {
        let board = &self.stage.board;
        if board.piece(p) == Piece::Copied {
            Status::Copied
        } else if board.failed() {
            Status::Failed
        } else {
            Status::Pending
        }
    }

    /// Waits up to `timeout` for piece `p` to be in the copy.
    pub fn wait(&self, p: u64, timeout: Duration) -> Status {
        self.wait_for(|| self.status(p), timeout)
    }

    /// Waits up to `timeout` for the whole copy.
    pub fn wait_whole(&self, timeout: Duration) -> Status {
        let whole = || {
            if self.left() == 0 {
                Status::Copied
            } else if self.stage.board.failed() {
                Status::Failed
            } else {
                Status::Pending
            }
        };
        self.wait_for(whole, timeout)
    }

    /// Waits for `done` to say other than pending, on the board's arrivals; pieces held
    /// by processes that ended meanwhile are freed and fetched here.
    fn wait_for(&self, done: impl Fn() -> Status, timeout: Duration) -> Status {
        let board = &self.stage.board;
        let start = Instant::now();
        let mut swept = Instant::now();
        loop {
            let seen = board.arrivals();
            match done() {
                Status::Pending => {}
                s => return s,
            }
            let waited = start.elapsed();
            if waited >= timeout {
                return Status::Pending;
            }
            if swept.elapsed() > super::STALL {
                swept = Instant::now();
                let orphans = (0..board.pieces()).filter(|&p| board.free_if_orphaned(p));
                if orphans.count() > 0 {
                    self.fetch_free();
                }
            }
            board.wait(seen, (timeout - waited).min(Duration::from_millis(100)));
        }
    }
}
