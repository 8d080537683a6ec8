//! The stage-in: one copy of the whole object per node, for every process of the job
//! there (mounts, in-process readers and their DataLoader workers, the CLI), made in
//! parallel ranged GETs of a few MiB into node-local memory (a memfd) when it fits, else
//! into a nameless file on `--stage-dir`. Reads of copied bytes are local reads, and the
//! push splices them into the kernel as from a local archive; a read of bytes in flight
//! waits for them, a read ahead of the copy fetches its own span at once.
//!
//! The processes find the copy through the node's hub ([`hub`]) and share its progress
//! through the board in the copy's file ([`board`]): every process that has the copy
//! copies its free pieces, at most [`board::COPIERS`] GETs at once for the node, so the
//! copy goes on when any of them ends. The copy has no name: it goes with the last
//! process that holds it, however that ends.

mod board;
mod hub;
mod keep;
mod order;
mod place;
mod share;
mod spans;

pub use order::{fetch_ahead, fetched_ahead, Fill};
pub use share::{NodeCopy, Of as CopyOf, Status};
pub use spans::merged;

use std::collections::VecDeque;
use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::sync::{Condvar, Mutex};

use super::http::{Client, RequestError, Target};
use crate::per_process::{generation, PerProcess};
use board::{Board, Grains, Piece, GRAIN};

/// What the copy marks as copied at once: a read of bytes in flight waits for their
/// piece.
const PIECE: u64 = 4 << 20;
/// Pieces one GET of the copy takes at most. A GET's first round trip moves nothing on
/// its stream, so short GETs leave a far, fast link idle: at 50 ms and ~540 MB/s, one GET
/// a piece copied at 4.4 s what 8 curl streams fetch in 3.5 s.
const RUN: u64 = 16;

/// What a GET of the copy hands over at a time: a read of bytes in the piece arriving
/// is served as soon as they have.
const PART: u64 = 256 << 10;
/// A read waits for bytes of the piece arriving when at most this much is still to come
/// before them (at 1 Gbit/s shared by 8 streams, ~70 ms: about a GET at 50 ms); else it
/// fetches its own. Waiting for a whole piece cost a read up to ~270 ms there.
const WAIT: u64 = 1 << 20;
/// A read of a piece taken for a GET under way waits when at most this much of the GET
/// is still to come before it (a few pieces at 1 Gbit/s: ~130 ms); else it fetches
/// its own bytes, and the node fetches them twice.
const WAIT_TAKEN: u64 = 4 * PIECE;
/// A reader waiting for bytes that do not move for this long checks that their copier
/// still runs, and fetches its own if not.
const STALL: Duration = Duration::from_millis(500);
/// Nodes of a job up to which `Staging::Auto` copies the whole object to every node. On
/// demand, a job reads 1.2-1.3x the object an epoch from storage (`scripts/bench --nodes`,
/// every node its 1/N of the files); a copy on each of N nodes reads N x once. At 16 a
/// job of 13 epochs or more reads less with copies.
const AUTO_NODES: u32 = 16;
/// What a small read of a copy filled in order fetches around itself: SquashFS
/// metadata blocks are read one after another (the chunk of a read without a copy).
const SMALL_FILL: u64 = 128 << 10;
/// How soon a copy being filled in order must be whole for a reader to wait for the
/// order rather than fetch its own bytes: the bench's 1.1 GB at 10-50 ms and 1 Gbit/s
/// takes 10-13 s, and its workers waited (the epoch with decoding 26 s, not 31).
const WAIT_FOR_ORDER: Duration = Duration::from_secs(30);
/// How long a process watches a copy filled in order before it judges by the bytes
/// landed whether the copy will be whole soon: an order's first files come one GET
/// each, too few bytes to tell (ImageNet's count of 1-400 B files: 512 GETs, ~3 s on
/// the bench's machine, 2 MB). Judged after 1 s, 3 of 4 DataLoader workers read their
/// batches one GET a file beside them (1,300-1,500 GETs, the first batch at 4.5-5.8 s).
const PACE_UNKNOWN: Duration = Duration::from_secs(4);
/// Grains between two runs of grains to fetch that one GET fetches with them (64 KiB):
/// a round trip costs more than a few grains fetched again.
const JOINED: u64 = 16;
/// Copying threads of this process, for all its copies.
const WORKERS: usize = board::COPIERS;

/// What a copy is of, and what every process that would share it agrees on.
#[derive(Clone, Debug)]
pub struct Object {
    pub origin: Origin,
    /// What names it in messages: a URL or a path.
    pub name: String,
    pub size: u64,
    pub mtime: i64,
    /// For a copy of a share of the object's files: the object's bytes it holds, in a
    /// row ([`spans`]); `size` is then theirs.
    pub spans: Option<Arc<spans::Spans>>,
}

/// Why bytes of a copy were not copied.
#[derive(Debug, thiserror::Error)]
enum CopyError {
    #[error(transparent)]
    Request(#[from] RequestError),
    #[error("reading {name}: {source}")]
    Read {
        name: String,
        source: std::io::Error,
    },
    #[error("writing the node-local copy: {0}")]
    Write(std::io::Error),
    /// Not an error: the job's order fills the copy now ([`StagedCopy::copy`]).
    #[error("the copy is filled in the job's order now")]
    HandedOver,
}

/// Where a copy's bytes come from.
#[derive(Clone, Debug)]
pub enum Origin {
    /// An object in S3 or over HTTP: ranged GETs, which fail once its ETag changed.
    Remote {
        client: Arc<Client>,
        target: Box<Target>,
        etag: Option<String>,
    },
    /// A file (on a parallel filesystem, read by every node of a job): `pread`.
    /// `place` tells its versions apart ([`crate::source::Storage::place_id`]).
    File { file: Arc<File>, place: u64 },
}

impl Object {
    /// The identity the node's copies are found by. An object: the request URL
    /// (endpoint, bucket, key), the version (ETag, else size and time) and the user's
    /// signing keys' id. A file: its path, device, inode and change time, size.
    fn identity(&self) -> String {
        match &self.origin {
            Origin::Remote { target, etag, .. } => {
                let key = target
                    .signer
                    .as_ref()
                    .map_or("anonymous", |(c, _)| c.access_key.as_str());
                format!(
                    "{} {} {} {} {key}",
                    target.url,
                    etag.as_deref().unwrap_or("-"),
                    self.size,
                    self.mtime
                )
            }
            Origin::File { place, .. } => {
                format!("file {} {place:x} {}", self.name, self.size)
            }
        }
        .replace(['\n', '\0'], " ")
    }

    /// `[at, at + len)` of the copy from its origin, handed to `each` a part at a time
    /// with where it goes in the copy: one ranged GET, or one for each span of a share.
    fn fetch(
        &self,
        (at, len): (u64, u64),
        mut each: impl FnMut(u64, &[u8]) -> Result<(), CopyError>,
    ) -> Result<(), CopyError> {
        let parts = match &self.spans {
            None => vec![(at, len, at)],
            Some(spans) => spans.parts(at, len),
        };
        parts
            .into_iter()
            .try_for_each(|(from, n, to)| match &self.origin {
                Origin::Remote {
                    client,
                    target,
                    etag,
                } => Ok(client.get_parts(
                    target,
                    etag.as_deref(),
                    (from, n),
                    PART,
                    |pos, bytes| each(pos - from + to, bytes),
                )?),
                Origin::File { file, .. } => {
                    let mut buf = vec![0u8; PART.min(n) as usize];
                    let mut done = 0;
                    while done < n {
                        let k = (n - done).min(PART) as usize;
                        file.read_exact_at(&mut buf[..k], from + done)
                            .map_err(|source| CopyError::Read {
                                name: self.name.clone(),
                                source,
                            })?;
                        READ_FROM_FILES.fetch_add(k as u64, Ordering::Relaxed);
                        each(to + done, &buf[..k])?;
                        done += k as u64;
                    }
                    Ok(())
                }
            })
    }

    /// The identity, hashed: what a kept copy is named and checked by.
    fn tag(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.identity().hash(&mut h);
        h.finish()
    }
}

/// Bytes this process read from files into node copies: what a node took from a
/// parallel filesystem.
static READ_FROM_FILES: AtomicU64 = AtomicU64::new(0);

/// Bytes this process has read from files into node copies.
pub fn read_from_files() -> u64 {
    READ_FROM_FILES.load(Ordering::Relaxed)
}

/// A local file's node copies, whole ([`share`]) or of a node's share of its files
/// ([`spans`]), made by `archfs.stage` for a file on a parallel filesystem: looked for at
/// open only when a process of the job on the node holds the hub, so reading a local
/// archive otherwise starts none.
#[derive(Debug, Default)]
pub struct FileCopies {
    whole: Option<Wanted>,
    share: Option<Wanted>,
}

impl FileCopies {
    /// `file`'s copies on the node; `place`: [`crate::source::Storage::place_id`].
    /// `always`: looked for (or to be made) even where no hub runs yet.
    pub fn find(
        file: &File,
        name: &Path,
        (size, mtime, place): (u64, i64, u64),
        always: bool,
    ) -> FileCopies {
        if size == 0 || !(always || hub::running()) {
            return FileCopies::default();
        }
        let Ok(file) = file.try_clone() else {
            return FileCopies::default();
        };
        let object = Object {
            origin: Origin::File {
                file: Arc::new(file),
                place,
            },
            name: name.display().to_string(),
            size,
            mtime,
            spans: None,
        };
        FileCopies {
            share: Wanted::find_share(object.clone(), None),
            whole: Wanted::find(object, None, None, false),
        }
    }

    /// The copy `Wanted` of the whole file (`share`: of a share of its files).
    pub(super) fn wanted(&self, share: bool) -> Option<&Wanted> {
        if share {
            self.share.as_ref()
        } else {
            self.whole.as_ref()
        }
    }

    /// Fills `buf` from `pos` out of a node copy that holds those bytes; false: read
    /// them from the file.
    pub fn read(&self, pos: u64, buf: &mut [u8]) -> std::io::Result<bool> {
        if let Some(share) = self.share.as_ref().and_then(Wanted::stage) {
            if let Some(at) = share.holds(pos, buf.len() as u64) {
                if let Found::Read = share.read(at, buf)? {
                    return Ok(true);
                }
            }
        }
        if let Some(whole) = self.whole.as_ref().and_then(Wanted::stage) {
            if let Found::Read = whole.read(pos, buf)? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// A copy's descriptor holding `[at, at + len)`, and where they are in it.
    pub fn fd(&self, at: u64, len: u64) -> Option<(BorrowedFd<'_>, u64)> {
        if let Some(fd) = self
            .whole
            .as_ref()
            .and_then(Wanted::stage)
            .and_then(|s| s.fd(at, len))
        {
            return Some((fd, at));
        }
        let share = self.share.as_ref().and_then(Wanted::stage)?;
        let pos = share.holds(at, len)?;
        Some((share.fd(pos, len)?, pos))
    }

    /// Whether the node holds a copy of the file, whole or of a share of its files.
    pub fn any(&self) -> bool {
        [&self.whole, &self.share]
            .into_iter()
            .any(|w| w.as_ref().and_then(Wanted::stage).is_some())
    }

    /// Whether the node holds a share of the file's files ([`crate::source::Storage::partial`]).
    pub fn partial(&self) -> bool {
        self.share.as_ref().and_then(Wanted::stage).is_some()
    }

    /// [`crate::source::Storage::held`]: false for bytes outside a share the node holds.
    pub fn held(&self, at: u64, len: u64) -> bool {
        self.share
            .as_ref()
            .and_then(Wanted::stage)
            .is_none_or(|s| s.holds(at, len).is_some())
    }
}

/// The node's staged copy of an object, being made or made.
#[derive(Debug)]
pub struct StagedCopy {
    board: Board,
    object: Object,
    /// The fork generation that last put the copy in this process's pool.
    pooled: AtomicU64,
    /// On the terminal of a foreground server that made the copy.
    bar: Option<indicatif::ProgressBar>,
    start: Instant,
    /// When this process first asked how fast an order brings the copy, and the bytes
    /// in it then ([`StagedCopy::whole_soon`]).
    pace: Mutex<Option<(Instant, u64)>>,
}

/// What a read found in the copy.
pub enum Found {
    /// The bytes were staged and are in the buffer.
    Read,
    /// Not staged, and not on their way: the reader fetches them itself.
    Fetch,
}

/// How an object's copy is come by: found on the node, or made when wanted.
#[derive(Debug)]
pub struct Wanted {
    object: Object,
    /// What the node's hub knows the copy by: the object's identity, and whether it is
    /// of a share of the files.
    id: String,
    share: bool,
    slot: hub::Slot,
    stage: OnceLock<Option<Arc<StagedCopy>>>,
    dir: Option<std::path::PathBuf>,
    progress: bool,
    /// The fork generation the slot was asked for in.
    asked: AtomicU64,
    /// `--keep`: the bytes the copies kept in `dir` may take.
    keep: Option<u64>,
    /// What makes the copy when the node's reads show an epoch.
    starter: Starting,
}

#[derive(Default)]
struct Starting(OnceLock<hub::Starter>);

impl std::fmt::Debug for Starting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.get().is_some() {
            "Starting(set)"
        } else {
            "Starting"
        })
    }
}

impl Wanted {
    /// The copy of `object` another process of the job on this node made, if there is
    /// one; if not, one arrives when some process makes it.
    pub fn find(
        object: Object,
        dir: Option<&Path>,
        keep: Option<u64>,
        progress: bool,
    ) -> Option<Wanted> {
        Self::find_as(object, dir, keep, progress, false)
    }

    /// The node's copy of a share of the object's files ([`spans`]), if some process of
    /// the job on the node made one; if not, one arrives when some process makes it.
    pub fn find_share(object: Object, dir: Option<&Path>) -> Option<Wanted> {
        Self::find_as(object, dir, None, false, true)
    }

    fn find_as(
        object: Object,
        dir: Option<&Path>,
        keep: Option<u64>,
        progress: bool,
        share: bool,
    ) -> Option<Wanted> {
        if object.size == 0 {
            return None;
        }
        let mut id = object.identity();
        if share {
            id.push_str(" share");
        }
        let slot = hub::want(&id);
        Some(Wanted {
            object,
            id,
            share,
            slot,
            stage: OnceLock::new(),
            dir: dir.map(Path::to_owned),
            progress,
            asked: AtomicU64::new(generation()),
            keep,
            starter: Starting::default(),
        })
    }

    /// Whether a sealed copy of the object is kept in `--stage-dir` (`--keep`).
    pub fn kept(&self) -> bool {
        match (&self.dir, self.keep) {
            (Some(dir), Some(_)) => keep::sealed(dir, self.object.tag(), self.object.size),
            _ => false,
        }
    }

    /// Makes the copy with `starter` when the hub says the node's reads show an epoch.
    pub fn on_start(&self, starter: hub::Starter) {
        let _ = self.starter.0.set(starter.clone());
        hub::on_start(&self.id, starter);
    }

    /// A read of a file, counted for the node.
    pub fn seen(&self) {
        self.refresh();
        hub::seen(&self.id);
    }

    /// `Staging::Auto`'s copy, once the node's reads show an epoch: made where copying
    /// the whole object to every node costs the storage no more than reading on demand
    /// would, else not, with a line saying so (once a process).
    pub fn make_if_cheaper(&self) {
        match crate::topology::from_env() {
            Some(t) if t.nodes > AUTO_NODES => {
                static SAID: std::sync::Once = std::sync::Once::new();
                SAID.call_once(|| {
                    tracing::warn!(
                        "{}: not copied to this node: the job has {} nodes (by {}), and a \
                         copy on each would read {}x the object from storage, more than \
                         reads on demand over a few epochs; reads fetch what they need. \
                         To copy it once for the whole job, call archfs.stage.stage(URL) \
                         in every rank first",
                        self.object.name,
                        t.nodes,
                        t.from,
                        t.nodes
                    );
                });
            }
            _ => self.make(),
        }
    }

    /// Makes the copy unless some process of the job on the node has.
    pub fn make(&self) {
        if self.create(false) {
            let _ = self.stage();
        }
    }

    /// Places the copy on the node, all pieces free, unless some process of the job on
    /// the node has; whether the node has one now. `shared`: the job's nodes share the
    /// stage-in ([`share`]), and its log line says so.
    fn create(&self, shared: bool) -> bool {
        let id = &self.id;
        let size = self.object.size;
        let pieces = size.div_ceil(PIECE);
        let name = &self.object.name;
        let slot = hub::make_or_join(id, || {
            if let (Some(dir), Some(bound)) = (&self.dir, self.keep) {
                match keep::open(dir, self.object.tag(), size, pieces, bound) {
                    Ok((file, reused)) => {
                        if reused {
                            tracing::info!("{name}: reading the copy kept in {}", dir.display());
                        } else {
                            tracing::info!(
                                "{name}: copying {:.1} GB to {}, kept there for later jobs",
                                size as f64 / 1e9,
                                dir.display()
                            );
                        }
                        return Some(file);
                    }
                    Err(why) => tracing::warn!("{name}: not kept in {}: {why}", dir.display()),
                }
            }
            let len = Board::file_len(size, pieces);
            match place::place(len, self.dir.as_deref()) {
                Ok((file, placed)) => {
                    match placed {
                        place::Placed::Memory => tracing::info!(
                            "{name}: copying {:.1} GB to this node's memory{}",
                            size as f64 / 1e9,
                            every_node(size, shared)
                        ),
                        place::Placed::Disk(dir) => tracing::warn!(
                            "{name}: copying {:.1} GB to {}: it does not fit in memory{}",
                            size as f64 / 1e9,
                            dir.display(),
                            every_node(size, shared)
                        ),
                    }
                    let init = file
                        .try_clone()
                        .and_then(|f| Board::create(f, size, pieces, self.object.tag()).map(drop));
                    match init {
                        Ok(()) => Some(file),
                        Err(e) => {
                            tracing::warn!("{name}: not copied to this node: {e}");
                            None
                        }
                    }
                }
                Err(why) => {
                    tracing::warn!(
                        "{name}: not copied to this node ({why}); reads fetch what they need"
                    );
                    None
                }
            }
        });
        slot.is_some_and(|s| s.get().is_some())
    }

    /// Places the node's copy of a share of the object's files, holding `spans`, all
    /// free, unless some process of the job on the node has placed one (whose spans
    /// then hold); whether the node has one now.
    fn create_share(&self, spans: &spans::Spans) -> bool {
        let name = &self.object.name;
        let size = spans.len();
        let pieces = size.div_ceil(PIECE);
        let slot = hub::make_or_join(&self.id, || {
            let board_end = Board::file_len(size, pieces);
            let (file, placed) = match place::place(board_end + spans.bytes(), self.dir.as_deref())
            {
                Ok(placed) => placed,
                Err(why) => {
                    tracing::warn!("{name}: this node's share not copied ({why})");
                    return None;
                }
            };
            let init = file
                .try_clone()
                .and_then(|f| Board::create(f, size, pieces, self.object.tag()).map(drop))
                .and_then(|()| spans.write(&file, board_end));
            if let Err(e) = init {
                tracing::warn!("{name}: this node's share not copied: {e}");
                return None;
            }
            tracing::info!(
                "{name}: copying this node's share of its files, {:.2} GB of {:.2} GB, to {}",
                size as f64 / 1e9,
                self.object.size as f64 / 1e9,
                match placed {
                    place::Placed::Memory => "this node's memory".to_owned(),
                    place::Placed::Disk(dir) => dir.display().to_string(),
                }
            );
            Some(file)
        });
        slot.is_some_and(|s| s.get().is_some())
    }

    /// The node's copy to fill in the order the job reads, placed now unless some
    /// process of the job on the node has: from now on no process copies whole pieces
    /// of it ([`order`]).
    pub fn ordered(&self) -> Option<Arc<StagedCopy>> {
        self.create(false);
        let stage = self.unpooled()?;
        stage.board.set_ordered();
        Some(stage.clone())
    }

    /// The copy while a process fills it in the order its job reads and it is not
    /// whole yet (nothing placed, joined or copied here).
    pub fn filling(&self) -> Option<&Arc<StagedCopy>> {
        let stage = self.unpooled()?;
        (stage.board.ordered() && stage.copying()).then_some(stage)
    }

    /// The copy, once this process has it; its free pieces are copied here too.
    pub fn stage(&self) -> Option<&Arc<StagedCopy>> {
        let stage = self.unpooled()?;
        stage.pool_here();
        Some(stage)
    }

    /// The copy, once this process has it, not yet copied by it.
    fn unpooled(&self) -> Option<&Arc<StagedCopy>> {
        self.refresh();
        if let Some(found) = self.stage.get() {
            return found.as_ref();
        }
        let file = self.slot.get()?.try_clone().ok()?;
        self.stage
            .get_or_init(|| StagedCopy::new(file, self.object.clone(), self.progress, self.share))
            .as_ref()
    }
}

/// What copying to every node of a job costs the storage, when the launcher says the job
/// has more than one node and they do not share the stage-in.
fn every_node(size: u64, shared: bool) -> String {
    if shared {
        return " (its share from storage, the rest from the job's other nodes)".into();
    }
    match crate::topology::from_env() {
        Some(t) if t.nodes > 1 => format!(
            " (the job has {} nodes, by {}: each copies the whole object, {:.1} GB from \
             storage in all)",
            t.nodes,
            t.from,
            size as f64 * f64::from(t.nodes) / 1e9
        ),
        _ => String::new(),
    }
}

impl Drop for Wanted {
    fn drop(&mut self) {
        if self.asked.load(Ordering::Relaxed) == generation() {
            hub::unwant(&self.id);
        }
    }
}

impl Wanted {
    /// In a forked child, the parent's tie to the hub is not ours: ask ours, say what
    /// starts the copy, and offer the copy inherited so the node keeps finding it.
    fn refresh(&self) {
        // A load on every read; a write only in a new process (no line shared by the
        // FUSE threads bounced between their cores).
        let now = generation();
        if self.asked.load(Ordering::Relaxed) == now
            || self.asked.swap(now, Ordering::Relaxed) == now
        {
            return;
        }
        let id = &self.id;
        if let Some(starter) = self.starter.0.get() {
            hub::on_start(id, starter.clone());
        }
        let slot = hub::want(id);
        if let Some(Some(stage)) = self.stage.get() {
            if slot.get().is_none() {
                if let Ok(f) = stage.board.file().try_clone() {
                    hub::hold(id, f);
                }
            }
        }
    }
}

impl StagedCopy {
    /// The copy in `file`, made by this process or another.
    fn new(file: File, mut object: Object, progress: bool, share: bool) -> Option<Arc<StagedCopy>> {
        if share {
            match spans::Spans::read(&file) {
                Ok(spans) => {
                    object.size = spans.len();
                    object.spans = Some(Arc::new(spans));
                }
                Err(e) => {
                    tracing::warn!("{}: the node's copy is unusable: {e}", object.name);
                    return None;
                }
            }
        }
        let board = match Board::open(file, object.size) {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!("{}: the node's copy is unusable: {e}", object.name);
                return None;
            }
        };
        let copying = board.left().load(Ordering::Acquire) > 0;
        let bar = (progress && copying).then(|| {
            let bar =
                crate::progress::bar(format!("copying {} to this node", object.name), object.size);
            bar.set_position(
                (object.size.div_ceil(PIECE) - board.left().load(Ordering::Acquire)) * PIECE,
            );
            bar
        });
        Some(Arc::new(StagedCopy {
            board,
            object,
            pooled: AtomicU64::new(u64::MAX),
            bar,
            start: Instant::now(),
            pace: Mutex::new(None),
        }))
    }

    fn me() -> u32 {
        std::process::id()
    }

    /// Puts the copy in this process's pool of copying threads, once a process, and
    /// again once no process fills it in order any more.
    fn pool_here(self: &Arc<Self>) {
        let now = generation();
        if self.pooled.load(Ordering::Relaxed) != now
            && !self.board.ordered()
            && self.pooled.swap(now, Ordering::Relaxed) != now
            && self.copying()
        {
            pool().add(self.clone());
        }
    }

    fn file(&self) -> &File {
        self.board.file()
    }

    /// Copies the `n` pieces from `first`, taken by this process, in one GET, each marked
    /// copied as it arrives; false when the copy failed. Once a process fills the copy in
    /// its job's order, the GET ends after the piece arriving and gives back the rest:
    /// the order's blocks fetch them, once.
    fn copy(&self, first: u64, n: u64) -> bool {
        let size = self.object.size;
        let at = first * PIECE;
        let len = ((first + n) * PIECE).min(size) - at;
        let end = first + n;
        let (from, to) = (at / GRAIN, (at + len).div_ceil(GRAIN));
        if let (true, false) = self.board.grains_touched(from, to) {
            return self.copy_around(first, n);
        }
        let mut held = self.arrive(first);
        let mut handed_over = false;
        let mut arrived = |pos: u64, bytes: &[u8]| -> Result<(), CopyError> {
            self.file()
                .write_all_at(bytes, pos)
                .map_err(CopyError::Write)?;
            let p = pos / PIECE;
            let upto = pos + bytes.len() as u64;
            let piece_end = ((p + 1) * PIECE).min(size);
            if upto < piece_end {
                if self.board.piece(p) == Piece::Arriving(Self::me()) {
                    self.board
                        .filled(p)
                        .store(upto - p * PIECE, Ordering::Release);
                    self.board.wake();
                }
                return Ok(());
            }
            let ordered = p + 1 < end && self.board.ordered();
            let next = (p + 1 < end && !ordered).then(|| self.arrive(p + 1));
            self.landed(p, piece_end - p * PIECE);
            if let Some(g) = std::mem::replace(&mut held, next.flatten()) {
                self.board.put_grains(&g, true);
            }
            if ordered {
                self.give_back(p + 1, end);
                handed_over = true;
                return Err(CopyError::HandedOver);
            }
            Ok(())
        };
        let got = self.object.fetch((at, len), &mut arrived);
        if let Some(g) = held {
            self.board.put_grains(&g, false);
        }
        match got {
            Err(_) if handed_over => true,
            Err(e) => {
                tracing::warn!("{}: the copy to this node stopped: {e}", self.object.name);
                self.fail();
                false
            }
            Ok(()) => true,
        }
    }

    /// [`copy`](Self::copy) of pieces that hold bytes already, none under way (what an
    /// order brought before its process ended, what reads fetched before the copy was
    /// made): only the grains not there, a GET a run of them. A piece whose grains
    /// another process took meanwhile is marked copied by whoever lands the last.
    fn copy_around(&self, first: u64, n: u64) -> bool {
        let size = self.object.size;
        let (at, to) = (first * PIECE, ((first + n) * PIECE).min(size));
        let got = self
            .board
            .take_grains(at / GRAIN, to.div_ceil(GRAIN))
            .is_none_or(|taken| self.fetch_grains(&taken).is_some());
        let me = Self::me();
        for p in first..first + n {
            let from = p * PIECE;
            let upto = (from + PIECE).min(size);
            if got
                && self.board.grains_in(from / GRAIN, upto.div_ceil(GRAIN))
                && self.board.swap(p, Piece::Taken(me), Piece::Arriving(me))
            {
                self.landed(p, upto - from);
            } else {
                self.give_back(p, p + 1);
                self.pieces_filled(from, upto);
            }
        }
        if !got {
            self.fail(); // as `copy`: the GETs' retries ran out
        }
        got
    }

    /// Marks piece `p`, taken by this process, arriving, and its grains no GET has as
    /// under way with it: an order's blocks fetch around them, not them again.
    fn arrive(&self, p: u64) -> Option<Grains> {
        let me = Self::me();
        self.board.swap(p, Piece::Taken(me), Piece::Arriving(me));
        let from = p * PIECE;
        let to = (from + PIECE).min(self.object.size);
        self.board.take_grains(from / GRAIN, to.div_ceil(GRAIN))
    }

    /// Frees the pieces `[first, end)` this process took and has not begun to fetch.
    fn give_back(&self, first: u64, end: u64) {
        let me = Piece::Taken(Self::me());
        for p in first..end {
            self.board.swap(p, me, Piece::Free);
        }
        self.board.next().fetch_min(first, Ordering::AcqRel);
        self.board.wake();
    }

    /// Pieces this process takes for one GET: many while much is left, one at the end,
    /// so the last GETs end together. Pieces held by processes that ended are freed.
    fn claim(&self) -> Option<(u64, u64)> {
        let pieces = self.board.pieces();
        let mut p = self.board.next().load(Ordering::Acquire);
        let mut swept = false;
        loop {
            if self.board.failed() {
                return None;
            }
            if self.board.ordered() {
                // Pooled again when the order's process ends before the copy is whole.
                self.pooled.store(u64::MAX, Ordering::Relaxed);
                return None;
            }
            if p >= pieces {
                // Every piece taken: free those of processes that ended, once.
                if swept || self.board.left().load(Ordering::Acquire) == 0 {
                    return None;
                }
                swept = true;
                (0..pieces).for_each(|q| {
                    self.board.free_if_orphaned(q);
                });
                p = self.board.next().load(Ordering::Acquire);
                continue;
            }
            let want = ((pieces - p) / (2 * WORKERS as u64)).clamp(1, RUN);
            let n = self.take(p, want);
            if n == 0 {
                p += 1;
                continue;
            }
            self.board.next().fetch_max(p + n, Ordering::AcqRel);
            return Some((p, n));
        }
    }

    /// Takes up to `want` free pieces from `first` on for one GET of this process's;
    /// how many it took (0: `first` was not free).
    fn take(&self, first: u64, want: u64) -> u64 {
        let me = Self::me();
        let mut n = 0;
        while n < want && first + n < self.board.pieces() {
            let p = first + n;
            if !self.board.swap(p, Piece::Free, Piece::Taken(me)) {
                break;
            }
            self.board.run(p).store(first, Ordering::Release);
            self.board.filled(p).store(0, Ordering::Release);
            n += 1;
        }
        n
    }

    /// Bytes still to come in the GET that took piece `p` before it arrives.
    fn to_come(&self, p: u64) -> u64 {
        let run = self.board.run(p).load(Ordering::Acquire).min(p);
        for a in (run..p).rev() {
            match self.board.piece(a) {
                Piece::Arriving(_) => {
                    let f = self.board.filled(a).load(Ordering::Acquire);
                    return ((p - a) * PIECE).saturating_sub(f);
                }
                Piece::Copied => return 0,
                _ => {}
            }
        }
        (p - run) * PIECE
    }

    /// Piece `p` (`len` bytes) is in the copy.
    fn landed(&self, p: u64, len: u64) {
        if !self
            .board
            .swap(p, Piece::Arriving(Self::me()), Piece::Copied)
        {
            return; // freed as orphaned meanwhile and taken again: the other counts it
        }
        let at = p * PIECE;
        self.board
            .grains_landed(at / GRAIN, (at + len).div_ceil(GRAIN));
        let left = self.board.left().fetch_sub(1, Ordering::AcqRel) - 1;
        self.board.wake();
        if let Some(b) = &self.bar {
            b.inc(len);
        }
        let name = &self.object.name;
        let size = self.object.size;
        // A line in the log at every tenth.
        let pieces = self.board.pieces();
        let tenths = |left: u64| (pieces - left) * 10 / pieces;
        if left > 0 && tenths(left) > tenths(left + 1) {
            let secs = self.start.elapsed().as_secs_f64();
            let copied = (pieces - left) * PIECE;
            tracing::info!(
                "{name}: {}0% copied to this node ({:.0} MB/s)",
                tenths(left),
                copied as f64 / 1e6 / secs.max(1e-3)
            );
        }
        if left == 0 {
            if let Some(b) = &self.bar {
                b.finish_and_clear();
            }
            keep::seal(&self.board);
            tracing::info!(
                "{name}: copied to this node, {:.1} MB ({:.1} s in this process)",
                size as f64 / 1e6,
                self.start.elapsed().as_secs_f64()
            );
        }
    }

    fn fail(&self) {
        if let Some(b) = &self.bar {
            b.abandon();
        }
        self.board.fail();
    }

    /// Fills `buf` from `pos` out of the copy, waiting for pieces arriving.
    pub fn read(self: &Arc<Self>, pos: u64, buf: &mut [u8]) -> std::io::Result<Found> {
        if buf.is_empty() {
            return Ok(Found::Fetch);
        }
        let board = &self.board;
        let end = pos + buf.len() as u64;
        let (first, last) = (pos / PIECE, (end - 1) / PIECE);
        // Bytes of piece `p` this read needs, from the piece's start.
        let need = |p: u64| end.min((p + 1) * PIECE) - p * PIECE;
        let short = |p: u64| need(p).saturating_sub(board.filled(p).load(Ordering::Acquire));
        let staged = |p: u64| match board.piece(p) {
            Piece::Copied => true,
            Piece::Arriving(_) => short(p) == 0,
            _ => false,
        };
        // In the copy: its pieces, or its grains (an order's, a piece run fetched around
        // them: `copy_around`).
        let there =
            || (first..=last).all(staged) || board.grains_in(pos / GRAIN, end.div_ceil(GRAIN));
        if !there() {
            if board.ordered() {
                return self.fill_for(pos, buf);
            }
            // Pieces no GET has taken are copied here, whole, and read from the copy:
            // every byte the node fetches goes into it once.
            let pieces = last - first + 1;
            if (first..=last).all(|p| board.piece(p) == Piece::Free) {
                let n = self.take(first, pieces);
                if n == pieces {
                    if !self.copy(first, n) {
                        return Ok(Found::Fetch);
                    }
                } else {
                    // Another process took one meanwhile: give back what was taken.
                    self.give_back(first, first + n);
                }
            }
            // Wait only for bytes about to arrive; the rest of a GET may be far off.
            let far = |p: u64| match board.piece(p) {
                Piece::Copied => false,
                Piece::Arriving(_) => short(p) > WAIT,
                Piece::Taken(_) => self.to_come(p) > WAIT_TAKEN,
                Piece::Free => true,
            };
            if !there() && (first..=last).any(far) {
                return Ok(Found::Fetch);
            }
            let mut moved = Instant::now();
            let mut seen = board.arrivals();
            while !there() {
                if board.failed() || (first..=last).any(far) {
                    return Ok(Found::Fetch);
                }
                if moved.elapsed() > STALL {
                    // Nothing arrived for a while: its copier may have ended.
                    if (first..=last).fold(false, |f, p| board.free_if_orphaned(p) | f) {
                        pool().add(self.clone());
                    }
                    if (first..=last).any(far) || moved.elapsed() > 4 * STALL {
                        return Ok(Found::Fetch);
                    }
                }
                board.wait(seen, Duration::from_millis(100));
                let now = board.arrivals();
                if now != seen {
                    seen = now;
                    moved = Instant::now();
                }
            }
        }
        self.file().read_exact_at(buf, pos)?;
        Ok(Found::Read)
    }

    /// The copy's descriptor when `[pos, pos + len)` is in it, to splice from.
    pub fn fd(&self, pos: u64, len: u64) -> Option<BorrowedFd<'_>> {
        if len == 0 || pos + len > self.object.size {
            return None;
        }
        self.has(pos, len).then(|| self.file().as_fd())
    }

    /// How many times bytes landed in the copy (or it failed), to wait on.
    pub fn landings(&self) -> u32 {
        self.board.arrivals()
    }

    /// Waits until [`landings`](Self::landings) is no longer `seen`, or `timeout`
    /// passed; false, at once, unless the copy will be whole soon
    /// ([`whole_soon`](Self::whole_soon)).
    pub fn wait_landing(&self, seen: u32, timeout: Duration) -> bool {
        if !self.whole_soon() {
            return false;
        }
        self.board.wait(seen, timeout);
        true
    }

    /// Whether the copy will be whole within [`WAIT_FOR_ORDER`] at the rate its bytes
    /// landed since this process first asked (yes for [`PACE_UNKNOWN`]): a reader then
    /// waits for the order to bring what it wants. Past that (an object of 140 GB at
    /// 1 GB/s), a batch's files come one a block of the order, so a reader fetches
    /// what it wants itself.
    fn whole_soon(&self) -> bool {
        let landed = self.board.landed();
        let (since, then) = *self.pace.lock().get_or_insert((Instant::now(), landed));
        let secs = since.elapsed().as_secs_f64();
        if secs < PACE_UNKNOWN.as_secs_f64() {
            return true;
        }
        let rate = landed.saturating_sub(then) as f64 / secs;
        self.object.size.saturating_sub(landed) as f64 <= rate * WAIT_FOR_ORDER.as_secs_f64()
    }

    /// Whether `[pos, pos + len)` is in the copy.
    pub fn has(&self, pos: u64, len: u64) -> bool {
        let end = pos + len;
        let (first, last) = (pos / PIECE, (end - 1) / PIECE);
        (first..=last).all(|p| self.board.piece(p) == Piece::Copied)
            || self.board.grains_in(pos / GRAIN, end.div_ceil(GRAIN))
    }

    /// A read of a copy filled in order: the bytes once the order (or another reader)
    /// has them there, else fetched into the copy here, the grains around them (a small
    /// read, of tables or headers, the [`SMALL_FILL`] around it: its neighbours are read
    /// next). Waits for bytes under way at most [`STALL`] x 4 (their GET may have ended
    /// with its process), then fetches its own.
    fn fill_for(&self, pos: u64, buf: &mut [u8]) -> std::io::Result<Found> {
        let board = &self.board;
        let end = pos + buf.len() as u64;
        let (first, last) = (pos / GRAIN, end.div_ceil(GRAIN));
        let (from, to) = if end - pos < SMALL_FILL / 2 {
            let from = pos - pos % SMALL_FILL;
            (from / GRAIN, (from + SMALL_FILL).max(end).div_ceil(GRAIN))
        } else {
            (first, last)
        };
        let to = to.min(self.object.size.div_ceil(GRAIN));
        let since = Instant::now();
        loop {
            let seen = board.arrivals();
            if board.grains_in(first, last) {
                self.file().read_exact_at(buf, pos)?;
                return Ok(Found::Read);
            }
            if let Some(taken) = board.take_grains(from, to) {
                if !self.fill(&taken) {
                    return Ok(Found::Fetch);
                }
                continue;
            }
            // Under way, yet nothing came for a while: their taker may have ended with
            // them (they are let go then; asked only then, not at every wait).
            if since.elapsed() > STALL && board.free_grains_of_the_dead() {
                continue;
            }
            if since.elapsed() > 4 * STALL {
                return Ok(Found::Fetch);
            }
            board.wait(seen, Duration::from_millis(100));
        }
    }

    /// Fetches the grains `taken` into the copy, a GET a run of them, and marks them
    /// there (or free again when a GET failed); whole pieces they complete are marked
    /// copied.
    fn fill(&self, taken: &Grains) -> bool {
        let size = self.object.size;
        let at = taken.first * GRAIN;
        let len = (taken.end * GRAIN).min(size) - at;
        let Some(fetched) = self.fetch_grains(taken) else {
            return false;
        };
        order::FETCHED.fetch_add(fetched, Ordering::Relaxed);
        self.pieces_filled(at, at + len);
        true
    }

    /// Fetches the grains `taken` into the copy, around grains already there (a block of
    /// the order's), one GET a run: the bytes fetched, or `None` when a GET failed (the
    /// grains are free again).
    fn fetch_grains(&self, taken: &Grains) -> Option<u64> {
        let size = self.object.size;
        let mut fetched = 0;
        let got = taken.runs(JOINED).into_iter().try_for_each(|(first, end)| {
            let from = first * GRAIN;
            let n = (end * GRAIN).min(size) - from;
            fetched += n;
            self.object.fetch((from, n), |pos, bytes| {
                self.file()
                    .write_all_at(bytes, pos)
                    .map_err(CopyError::Write)
            })
        });
        self.board.put_grains(taken, got.is_ok());
        if let Err(e) = &got {
            tracing::warn!("{}: {e}", self.object.name);
            return None;
        }
        Some(fetched)
    }

    /// Marks the pieces across `[from, to)` whose grains are all in the copy as copied.
    fn pieces_filled(&self, from: u64, to: u64) {
        let me = Piece::Arriving(Self::me());
        for p in from / PIECE..=(to - 1) / PIECE {
            let at = p * PIECE;
            let upto = (at + PIECE).min(self.object.size);
            if self.board.piece(p) == Piece::Free
                && self.board.grains_in(at / GRAIN, upto.div_ceil(GRAIN))
                && self.board.swap(p, Piece::Free, me)
            {
                self.landed(p, upto - at);
            }
        }
    }

    /// Puts `bytes`, the object's from `pos` (fetched for other reads), into the copy:
    /// its whole grains are marked there, and whole pieces copied. Not in a copy of a
    /// share of the files, which holds them elsewhere.
    pub fn put(&self, pos: u64, bytes: &[u8]) {
        let size = self.object.size;
        let end = pos + bytes.len() as u64;
        let first = pos.div_ceil(GRAIN);
        // Whole grains only; the object's last grain ends at its end.
        let last = if end == size {
            end.div_ceil(GRAIN)
        } else {
            end / GRAIN
        };
        if self.object.spans.is_some() || end > size || first >= last {
            return;
        }
        if self.file().write_all_at(bytes, pos).is_err() {
            return;
        }
        self.board.grains_landed(first, last);
        self.board.wake();
        self.pieces_filled(first * GRAIN, (last * GRAIN).min(size));
    }

    /// Where `[pos, pos + len)` of the object is in this copy of a share of its files,
    /// when it holds them all.
    pub fn holds(&self, pos: u64, len: u64) -> Option<u64> {
        self.object.spans.as_ref()?.find(pos, len)
    }

    /// Whether the copy is still being made (read-ahead advice is then not needed).
    pub fn copying(&self) -> bool {
        self.board.left().load(Ordering::Relaxed) > 0 && !self.board.failed()
    }
}

/// The threads that copy for this process, oldest copy first: a union of many objects
/// copies a few pieces at a time, not a few per object. A thread copies only while it
/// holds one of the board's places for copiers.
struct Pool {
    jobs: Mutex<VecDeque<Arc<StagedCopy>>>,
    queued: Condvar,
}

fn pool() -> &'static Pool {
    static POOL: PerProcess<Pool> = PerProcess::new();
    let (pool, made) = POOL.get_or_make(|| Pool {
        jobs: Mutex::new(VecDeque::new()),
        queued: Condvar::new(),
    });
    if made {
        for i in 0..WORKERS {
            let _ = std::thread::Builder::new()
                .name(format!("archfs-stage-{i}"))
                .spawn(move || pool.work());
        }
    }
    pool
}

impl Pool {
    fn add(&self, stage: Arc<StagedCopy>) {
        let mut jobs = self.jobs.lock();
        if !jobs.iter().any(|s| Arc::ptr_eq(s, &stage)) {
            jobs.push_back(stage);
        }
        drop(jobs);
        self.queued.notify_all();
    }

    fn work(&self) {
        let me = StagedCopy::me();
        loop {
            let stage = {
                let mut jobs = self.jobs.lock();
                loop {
                    match jobs.front().cloned() {
                        Some(st) => break st,
                        None => jobs = self.queued.wait(jobs),
                    }
                }
            };
            if !stage.board.enter(me) {
                // The node's copiers are all busy: look again shortly.
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
            let run = stage.claim();
            match run {
                Some((first, n)) => {
                    stage.copy(first, n);
                }
                None => {
                    let mut jobs = self.jobs.lock();
                    if jobs.front().is_some_and(|s| Arc::ptr_eq(s, &stage)) {
                        jobs.pop_front(); // every piece taken: on to the next object
                    }
                }
            }
            stage.board.leave(me);
        }
    }
}
