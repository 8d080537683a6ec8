//! Tars inside the archive shown as directories (`--recursive`): a plain `.tar` member
//! is scanned where it lies, a compressed one (`.tar.gz`, `.tzst`, ...) is decoded once
//! for its headers and entry points and served as a body of its own. Members' data
//! offsets carry their body in their top bits ([`BODY_SHIFT`]), so the index stays one
//! table of offsets whatever stream a member is in.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::entries::Entry;
use super::header::{Header, BLOCK};

use crate::archive::Kind;
use crate::compressed::{Bytes, Compression, Points};
use crate::error::{Error, Result};
use crate::source::Source;

/// Data offsets above this bit name the body they are in: 0 the archive's own tar
/// stream, `k` the `k`-th compressed tar inside it (`--recursive`).
pub const BODY_SHIFT: u32 = 48;

/// The body and the offset within it of a member's data offset.
pub fn body_of(data: u64) -> (usize, u64) {
    (
        (data >> BODY_SHIFT) as usize,
        data & ((1 << BODY_SHIFT) - 1),
    )
}

/// How deep tars nested in tars are opened as directories (`--recursive`); a deeper one is
/// shown as the plain file it is, so this refuses nothing and bounds the recursion.
pub(super) const MAX_DEPTH: u32 = 8;

/// Names of compressed tars (`--recursive`) and the directory each is shown as.
const COMPRESSED_TARS: [&str; 10] = [
    ".tar.gz",
    ".tgz",
    ".tar.zst",
    ".tar.zstd",
    ".tzst",
    ".tar.xz",
    ".txz",
    ".tar.bz2",
    ".tbz2",
    ".tbz",
];

/// How compressed tars inside a plain archive are opened (`--recursive`).
#[derive(Clone, Debug)]
pub struct Opener {
    pub source: Arc<Source>,
    /// Decoded bytes between entry points, and the most a member may decode to.
    pub spacing: u64,
    pub limit: u64,
}

impl Opener {
    /// The member at `[at, at + len)` if it is a compressed tar.
    fn tar_in(&self, at: u64, len: u64) -> Result<Option<Found>> {
        let mut magic = [0u8; 4];
        if len < 4 {
            return Ok(None);
        }
        self.source.read_exact_at(at, &mut magic)?;
        let Some(codec) = Compression::detect(&magic) else {
            return Ok(None);
        };
        let slice = Arc::new(self.source.slice(at, len)?);
        let mut raw = [0u8; 512];
        let ok = crate::compressed::first_bytes(&slice, codec, &mut raw).is_ok_and(|n| n == 512)
            && !Header::new(&raw).is_zero()
            && Header::new(&raw).checksum_ok();
        Ok(ok.then(|| Found {
            codec,
            source: slice,
            at,
            spacing: self.spacing,
            limit: self.limit,
        }))
    }
}

/// A compressed tar inside the archive, found and about to be indexed: its format, the
/// member as a source of its own, and where it is in the archive.
pub(super) struct Found {
    pub codec: Compression,
    pub source: Arc<Source>,
    pub at: u64,
    pub spacing: u64,
    pub limit: u64,
}

/// A compressed tar inside the archive: where it is, and its entry points.
pub struct Nested {
    pub at: u64,
    pub len: u64,
    pub codec: Compression,
    pub points: Points,
}

/// A member that is a tar, and the directory it is shown as.
pub(super) enum Inside {
    /// A plain tar, scanned where its data lies.
    Plain(Vec<Vec<u8>>),
    /// A compressed tar, read from a slice of the archive file.
    Compressed(Vec<Vec<u8>>, Found),
}

/// What the index builder keeps of the tars inside the archive.
pub(super) struct Nesting {
    /// Whether tars inside are shown as directories (`--recursive`).
    recursive: bool,
    /// How compressed tars inside are opened: set for a plain archive with
    /// `--recursive`.
    opener: Option<Opener>,
    /// The compressed tars opened so far, body 1 first.
    bodies: Vec<Nested>,
    /// The body being scanned, shifted into place for its members' data offsets.
    pub body: u64,
    /// Where the compressed member being scanned starts in the archive, and how far into
    /// it its decoder has read: together, the place the progress bar shows.
    member_at: u64,
    member_read: Arc<AtomicU64>,
}

impl Nesting {
    pub fn new(recursive: bool, opener: Option<Opener>) -> Nesting {
        Nesting {
            recursive,
            opener,
            bodies: Vec::new(),
            body: 0,
            member_at: 0,
            member_read: Arc::default(),
        }
    }

    /// The place in the archive the progress bar shows for a header at `pos`: inside a
    /// compressed member, offsets are decoded ones, and the member's place in the
    /// archive plus what its decoder has read stands for them.
    pub fn progress_at(&self, pos: u64) -> u64 {
        if self.body == 0 {
            pos
        } else {
            self.member_at + self.member_read.load(Ordering::Relaxed)
        }
    }

    /// Whether member `e` of `kind`, at `full` (its path with the prefix of the tar it
    /// is in) and `depth` tars deep, is a tar to show as a directory.
    pub fn inside(
        &self,
        src: &dyn Bytes,
        kind: Kind,
        e: &Entry,
        full: &[&[u8]],
        depth: u32,
    ) -> Result<Option<Inside>> {
        if kind != Kind::File || e.sparse.is_some() || depth >= MAX_DEPTH {
            return Ok(None);
        }
        let dir = || full.iter().map(|c| c.to_vec()).collect::<Vec<_>>();
        let name = full[full.len() - 1];
        if self.recursive
            && name.len() > 4
            && name.ends_with(b".tar")
            && looks_like_tar(src, e.data, e.size)
        {
            let mut inner = dir();
            if let Some(last) = inner.last_mut() {
                last.truncate(last.len() - 4);
            }
            return Ok(Some(Inside::Plain(inner)));
        }
        // Read from a slice of the archive file, so only in a plain archive.
        let Some(opener) = self.opener.as_ref().filter(|_| self.body == 0) else {
            return Ok(None);
        };
        let Some(stem) = compressed_stem(full) else {
            return Ok(None);
        };
        Ok(opener.tar_in(e.data, e.size)?.map(|found| {
            let mut inner = dir();
            *inner.last_mut().unwrap() = stem;
            Inside::Compressed(inner, found)
        }))
    }

    /// What the decoder of a compressed member reports, for [`Nesting::progress_at`].
    pub fn reporter(&self) -> impl FnMut(u64) + Send + 'static {
        let read = self.member_read.clone();
        read.store(0, Ordering::Relaxed);
        move |p| read.store(p, Ordering::Relaxed)
    }

    /// Numbers `found` as the next body and makes it the one being scanned.
    pub fn enter(&mut self, found: &Found) -> Result<()> {
        let id = self.bodies.len() as u64 + 1;
        if id >= 1 << (64 - BODY_SHIFT) {
            return Err(Error::Limit(
                "more compressed tars inside the archive than archfs can open".into(),
            ));
        }
        self.body = id << BODY_SHIFT;
        self.member_at = found.at;
        Ok(())
    }

    /// Back to the archive's own stream after `found` was scanned, keeping its entry
    /// points if the scan succeeded.
    pub fn leave(&mut self, found: &Found, points: Result<Points>) -> Result<()> {
        self.body = 0;
        self.bodies.push(Nested {
            at: found.at,
            len: found.source.len(),
            codec: found.codec,
            points: points?,
        });
        Ok(())
    }

    /// The compressed tars opened inside the archive, in body order (body 1 first).
    pub fn take_bodies(&mut self) -> Vec<Nested> {
        std::mem::take(&mut self.bodies)
    }
}

/// The directory name of a member named like a compressed tar (`a.tar.gz`: `a`).
fn compressed_stem(path: &[&[u8]]) -> Option<Vec<u8>> {
    let name = path.last()?;
    COMPRESSED_TARS.iter().find_map(|s| {
        let stem = name.strip_suffix(s.as_bytes())?;
        (!stem.is_empty()).then(|| stem.to_vec())
    })
}

/// Whether a member's data starts with a valid tar header.
fn looks_like_tar(src: &dyn Bytes, pos: u64, len: u64) -> bool {
    if len < BLOCK {
        return false;
    }
    let mut raw = [0u8; 512];
    if src.read_exact_at(pos, &mut raw).is_err() {
        return false;
    }
    let h = Header::new(&raw);
    !h.is_zero() && h.checksum_ok()
}
