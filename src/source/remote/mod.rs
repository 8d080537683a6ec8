//! Archives in object storage (`s3://BUCKET/KEY`) or behind a plain URL, as a kind of
//! [`Storage`]: size and ETag taken once at open, every read a ranged GET conditional
//! on that ETag (an object replaced under a mount gives EIO, never a mix of old and new
//! bytes). A read fetches what it needs: the first read of a file of up to 2 MiB (a tar
//! member, a SquashFS file's blocks) the whole file in one GET, kept until the kernel's
//! next reads of it; a large read exactly its span; a small one (headers, metadata
//! blocks) the 128 KiB chunk around it, kept in a small cache. A scan's read-ahead advice
//! fetches its chunks in the background, in GETs of a few MiB, and a SquashFS image's
//! tables are fetched so at once. A mount also copies the whole object to the node
//! ([`stage`]), and what is copied is read as a local file is.

mod config;
mod http;
mod sigv4;
mod stage;
mod url;

use std::collections::VecDeque;
use std::os::fd::BorrowedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::sync::{Condvar, Mutex};

use super::Storage;
use crate::cache::BlockCache;
use crate::error::{Error, Result};
use crate::per_process::PerProcess;
pub use http::totals as remote_totals;
pub use stage::{
    fetch_ahead, fetched_ahead, merged, read_from_files, CopyOf, FileCopies, Fill, NodeCopy,
    Status as CopyStatus,
};
pub use url::is_url;
use url::Location;

/// Chunks small reads are fetched and cached in.
const CHUNK: u64 = 128 << 10;
/// Reads up to this size go through the chunk cache; larger ones fetch their span.
const SMALL: usize = 64 << 10;
/// Bytes of chunks kept, for all objects of the process together: a union of a thousand
/// shards holds no more than one object.
const CHUNK_CACHE: usize = 128 << 20;
/// One GET of read-ahead.
const AHEAD_GET: u64 = 4 << 20;
/// Threads that fetch read-ahead, for all objects.
const AHEAD_THREADS: usize = 4;
/// How far a sequential stream of large reads (a big file, read through) is fetched
/// ahead of itself, so it costs a round trip per this much rather than per FUSE read.
const STREAM_AHEAD: u64 = 2 << 20;
/// Sequential streams followed per object.
const STREAMS: usize = 16;
/// A file up to this size is fetched whole by its first read: the kernel reads it in
/// 128 KiB requests, each of which would otherwise cost a round trip (and a small tail
/// across a chunk boundary two).
const SPAN_GET: u64 = 2 << 20;
/// Bytes of such files kept until the rest of each is read, for all objects together.
const SPAN_CACHE: usize = 32 << 20;

/// Reads of files after which `Staging::Auto` makes the node's copy: the preload's rule
/// for local archives (a training epoch gets there within a fraction of a second; a
/// listing, `info` or a look at a few files never does).
pub(crate) const AUTO_AFTER_READS: u64 = 128;

/// When a process makes the node's copy of an object. A copy another process of the job
/// on the node made is read in every case.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Staging {
    /// Never (`archfs cat`, `--preload=never`).
    #[default]
    Never,
    /// Once reads show an epoch: after [`AUTO_AFTER_READS`] reads of files.
    Auto,
    /// At once.
    Always,
}

/// How to reach remote archives, from the command line.
#[derive(Clone, Debug, Default)]
pub struct RemoteOptions {
    /// Send S3 requests unsigned (a public bucket), as the AWS CLI's flag of that name.
    pub no_sign_request: bool,
    /// When to copy the whole object to the node in the background.
    pub stage: Staging,
    /// Where the copy goes when it does not fit in memory.
    pub stage_dir: Option<PathBuf>,
    /// Keep copies in `stage_dir` for later jobs, up to this many bytes in all.
    pub keep: Option<u64>,
    /// How long one request may be retried before its read fails (default 60 s).
    pub retry_for: Option<std::time::Duration>,
    /// Show the copy's progress on the terminal (a foreground server).
    pub progress: bool,
}

/// An object in S3 or at an HTTP(S) URL.
#[derive(Debug)]
pub struct RemoteObject {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    client: Arc<http::Client>,
    target: http::Target,
    name: PathBuf,
    size: u64,
    etag: Option<String>,
    mtime: i64,
    /// What tells this object's chunks from others' in the cache ([`chunks`]).
    id: u64,
    /// The node's copy, found or made.
    stage: Option<stage::Wanted>,
    /// The node's copy of its share of the files, when the job made one
    /// (`archfs.stage.stage_files`): no whole copy is made then.
    share: Option<stage::Wanted>,
    staging: Staging,
    /// Reads of files so far, up to [`AUTO_AFTER_READS`].
    reads: std::sync::atomic::AtomicU64,
    /// The node's copy reached this process, and what was fetched before was let go.
    staged: std::sync::atomic::AtomicBool,
    /// The object's first bytes, fetched with its size: a format's first reads.
    first: Box<[u8]>,
    /// Where recent large reads ended, and how far past that was fetched ahead.
    streams: Mutex<Vec<(u64, u64)>>,
    /// Spans whose GETs into the chunks are under way: a read of them waits for those
    /// rather than fetching the bytes a second time.
    pending: Mutex<Vec<(u64, u64)>>,
    landed: Condvar,
}

impl RemoteObject {
    /// `None` when `name` is a local path.
    pub fn open(name: &Path, options: &RemoteOptions) -> Option<Result<RemoteObject>> {
        let location = Location::parse(name)?;
        Some(
            location
                .map_err(Error::from)
                .and_then(|l| Self::open_at(l, options)),
        )
    }

    fn open_at(location: Location, options: &RemoteOptions) -> Result<RemoteObject> {
        if let Location::S3Prefix { .. } = location {
            return Err(Error::Usage(format!(
                "{} is a prefix, not an object: mount it to see the archives under it as \
                 one tree, or name one object (s3://BUCKET/KEY)",
                location.name()
            )));
        }
        let (target, ca_bundle) = target(&location, options)?;
        let client = http::Client::shared(ca_bundle.as_ref())?;
        let (meta, how) = match inherited(&target.url) {
            Some(meta) => (meta, " (as the process it was forked from found it)"),
            None => {
                let meta = client.head(&target)?;
                remember(&target.url, &meta);
                (meta, "")
            }
        };
        tracing::info!(
            "{}: {} bytes, ETag {}, from {}{how}",
            target.name,
            meta.size,
            meta.etag.as_deref().unwrap_or("none"),
            target.endpoint
        );
        let object = stage::Object {
            origin: stage::Origin::Remote {
                client: client.clone(),
                target: Box::new(target.clone()),
                etag: meta.etag.clone(),
            },
            name: target.name.clone(),
            size: meta.size,
            mtime: meta.mtime,
            spans: None,
        };
        let share = stage::Wanted::find_share(object.clone(), options.stage_dir.as_deref());
        let stage = stage::Wanted::find(
            object,
            options.stage_dir.as_deref(),
            options.keep,
            options.progress,
        );
        // At once when asked, or when a copy an earlier job kept is there whole.
        if let Some(s) = &stage {
            if options.stage == Staging::Always || s.kept() {
                s.make();
            }
        }
        let inner = Arc::new_cyclic(|me: &std::sync::Weak<Inner>| {
            if let (Some(s), Staging::Auto) = (&stage, options.stage) {
                let me = me.clone();
                s.on_start(Arc::new(move || {
                    if let Some(inner) = me.upgrade() {
                        if inner.share().is_some() {
                            return;
                        }
                        if let Some(s) = &inner.stage {
                            s.make_if_cheaper();
                        }
                    }
                }));
            }
            Inner {
                stage,
                share,
                staging: options.stage,
                reads: std::sync::atomic::AtomicU64::new(0),
                staged: std::sync::atomic::AtomicBool::new(false),
                first: meta.first.into_boxed_slice(),
                client,
                name: PathBuf::from(location.name()),
                target,
                size: meta.size,
                etag: meta.etag,
                mtime: meta.mtime,
                id: next_id(),
                streams: Mutex::new(Vec::with_capacity(STREAMS)),
                pending: Mutex::new(Vec::new()),
                landed: Condvar::new(),
            }
        });
        if options.stage == Staging::Auto {
            epoch().objects.lock().push(Arc::downgrade(&inner));
        }
        Ok(RemoteObject { inner })
    }
}

/// A new object's id, which tells its chunks from others' in the cache.
fn next_id() -> u64 {
    static IDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    IDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// What each process learned of the objects it opened, by URL, with the fork generation
/// it was learned in (its first bytes left out), kept through a fork on purpose: a
/// DataLoader worker forked each epoch opens the archive again, and takes its parent's
/// answer rather than a round trip of its own (two on a new connection: 20 ms on a 10 ms
/// link, a sixth of a small epoch). It also reads the version its parent listed; its GETs
/// still send that ETag. A process opening an object again asks the server again. A plain
/// lock, not [`PerProcess`]: the child reads the parent's, with `try_lock` (one held at
/// the fork stays held: the child then asks the server).
static SEEN: std::sync::Mutex<std::collections::BTreeMap<String, (u64, http::Meta)>> =
    std::sync::Mutex::new(std::collections::BTreeMap::new());

fn remember(url: &str, meta: &http::Meta) {
    if let Ok(mut seen) = SEEN.try_lock() {
        let meta = http::Meta {
            first: Vec::new(),
            ..meta.clone()
        };
        seen.insert(url.to_owned(), (crate::per_process::generation(), meta));
    }
}

/// The object as an ancestor of this process found it (never this process's own).
fn inherited(url: &str) -> Option<http::Meta> {
    let seen = SEEN.try_lock().ok()?;
    let (generation, meta) = seen.get(url)?;
    (*generation < crate::per_process::generation()).then(|| meta.clone())
}

/// The request target of `location` and the CA bundle to trust.
fn target(
    location: &Location,
    options: &RemoteOptions,
) -> std::result::Result<(http::Target, Option<PathBuf>), config::ConfigError> {
    let budget = options.retry_for.unwrap_or(http::BUDGET);
    match location {
        Location::Http { url } => {
            let (host, path) = url::split_url(url);
            let endpoint = format!("{}://{host}", &url[..url.find("://").unwrap_or(0)]);
            let ca = std::env::var_os("AWS_CA_BUNDLE").map(PathBuf::from);
            Ok((
                http::Target {
                    url: url.clone(),
                    host,
                    path,
                    name: url.clone(),
                    endpoint,
                    signer: None,
                    credentials_from: "none (a plain URL is read anonymously)".into(),
                    budget,
                },
                ca,
            ))
        }
        Location::S3 { bucket, key }
        | Location::S3Prefix {
            bucket,
            prefix: key,
        } => {
            let is_object = matches!(location, Location::S3 { .. });
            let home = std::env::var_os("HOME").map(PathBuf::from);
            let cfg = config::resolve(
                &|k| std::env::var(k).ok(),
                home.as_deref(),
                options.no_sign_request,
            )?;
            let endpoint = cfg
                .endpoint
                .clone()
                .unwrap_or_else(|| format!("https://s3.{}.amazonaws.com", cfg.region));
            let key = url::encode_key(key);
            // A bucket name with dots or capitals cannot be a host name (the TLS
            // certificate would not match): botocore puts it in the path.
            let dns_safe = bucket
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
            let url = if !is_object && (cfg.path_style || !dns_safe) {
                format!("{endpoint}/{bucket}")
            } else if !is_object {
                let (scheme, host) = endpoint.split_once("://").unwrap_or(("https", &endpoint));
                format!("{scheme}://{bucket}.{host}/")
            } else if cfg.path_style || !dns_safe {
                format!("{endpoint}/{bucket}/{key}")
            } else {
                let (scheme, host) = endpoint.split_once("://").unwrap_or(("https", &endpoint));
                format!("{scheme}://{bucket}.{host}/{key}")
            };
            let (host, path) = url::split_url(&url);
            let signer = cfg.credentials.clone().map(|c| (c, cfg.region.clone()));
            let credentials_from = cfg.credentials_from.clone();
            Ok((
                http::Target {
                    url,
                    host,
                    path,
                    name: location.name(),
                    endpoint: format!("{endpoint} (endpoint from {})", cfg.endpoint_from),
                    signer,
                    credentials_from,
                    budget,
                },
                cfg.ca_bundle,
            ))
        }
    }
}

/// The objects directly under an `s3://BUCKET/PREFIX/` name, in name order, as
/// `s3://` names (index sidecars and empty "folder" markers left out); `None` when
/// `name` is no such prefix.
pub fn list_prefix(name: &Path, options: &RemoteOptions) -> Option<Result<Vec<PathBuf>>> {
    let Ok(location) = Location::parse(name)? else {
        return None;
    };
    let Location::S3Prefix { bucket, prefix } = &location else {
        return None;
    };
    let listed = target(&location, options)
        .map_err(Error::from)
        .and_then(|(t, ca)| Ok((t, http::Client::shared(ca.as_ref())?)))
        .and_then(|(t, client)| {
            // Whatever its kind: a prefix that cannot be listed is an error of the
            // store's (a ValueError in Python), as it always was, not a missing file.
            client
                .list(&t, prefix)
                .map_err(|e| Error::Remote(e.to_string()))
        });
    Some(match listed {
        Err(e) => Err(e),
        Ok(keys) => {
            let names: Vec<PathBuf> = keys
                .into_iter()
                .filter(|(k, size)| !(k.ends_with(SIDECAR) || k.ends_with('/') && *size == 0))
                .map(|(k, _)| PathBuf::from(format!("s3://{bucket}/{k}")))
                .collect();
            if names.is_empty() {
                Err(Error::Usage(format!(
                    "there are no objects directly under {}: check the prefix (it ends \
                     in /; objects in deeper \"folders\" are not included)",
                    location.name()
                )))
            } else {
                Ok(names)
            }
        }
    })
}

/// What the index saved beside an archive is called after the archive's name.
pub const SIDECAR: &str = ".archfs-index";

/// The object `name` + [`SIDECAR`], given `body`: the index every later mount of the
/// archive, on any node, loads instead of scanning it. Only `s3://` names.
pub fn put_sidecar(name: &Path, options: &RemoteOptions, body: &[u8]) -> Result<String> {
    let sidecar = sidecar_location(name)?;
    let (t, ca) = target(&sidecar, options)?;
    let client = http::Client::shared(ca.as_ref())?;
    client.put(&t, body)?;
    Ok(sidecar.name())
}

fn sidecar_location(name: &Path) -> Result<Location> {
    match Location::parse(name) {
        Some(Ok(Location::S3 { bucket, key })) => Ok(Location::S3 {
            bucket,
            key: format!("{key}{SIDECAR}"),
        }),
        Some(Ok(Location::Http { url })) => Ok(Location::Http {
            url: format!("{url}{SIDECAR}"),
        }),
        _ => Err(Error::Usage(format!(
            "{} is not an object in S3: a sidecar index is written beside s3://BUCKET/KEY",
            name.display()
        ))),
    }
}

/// Files fetched whole by their first read ([`SPAN_GET`]), oldest first: (object id,
/// where the bytes start, the bytes).
#[derive(Default)]
struct Spans {
    list: VecDeque<(u64, u64, Arc<[u8]>)>,
    bytes: usize,
}

fn spans() -> &'static Mutex<Spans> {
    static SPANS: PerProcess<Mutex<Spans>> = PerProcess::new();
    SPANS.get(Mutex::default)
}

impl Spans {
    fn copy(&self, id: u64, pos: u64, buf: &mut [u8]) -> bool {
        let end = pos + buf.len() as u64;
        let found = self
            .list
            .iter()
            .rev()
            .find(|(i, at, b)| *i == id && *at <= pos && end <= at + b.len() as u64);
        if let Some((_, at, b)) = found {
            let from = (pos - at) as usize;
            buf.copy_from_slice(&b[from..from + buf.len()]);
        }
        found.is_some()
    }

    fn add(&mut self, id: u64, at: u64, bytes: Arc<[u8]>) {
        self.bytes += bytes.len();
        self.list.push_back((id, at, bytes));
        while self.bytes > SPAN_CACHE {
            match self.list.pop_front() {
                Some((_, _, b)) => self.bytes -= b.len(),
                None => break,
            }
        }
    }
}

/// The chunks of every object of the process, keyed by [`Inner::key`].
fn chunks() -> &'static BlockCache<Vec<u8>> {
    static CHUNKS: PerProcess<BlockCache<Vec<u8>>> = PerProcess::new();
    CHUNKS.get(|| BlockCache::new("remote chunk", CHUNK_CACHE))
}

impl Inner {
    /// The cache key of chunk `c` of this object: 2^40 chunks of 128 KiB an object.
    fn key(&self, c: u64) -> u64 {
        self.id << 40 | c
    }

    fn get(&self, at: u64, buf: &mut [u8]) -> std::io::Result<()> {
        self.client
            .get(&self.target, self.etag.as_deref(), at, buf)
            .map_err(|e| {
                tracing::error!("{e}");
                std::io::Error::other(e)
            })
    }

    /// Waits while a GET under way holds all of `[at, to)`.
    fn wait_pending(&self, at: u64, to: u64) {
        let mut pending = self.pending.lock();
        while pending.iter().any(|&(f, t)| f <= at && to <= t) {
            pending = self.landed.wait(pending);
        }
    }

    /// The chunk `index`, fetched once however many readers want it at the same time.
    fn chunk(&self, index: u64) -> std::io::Result<Arc<Vec<u8>>> {
        if let Some(c) = chunks().get(self.key(index)) {
            return Ok(c);
        }
        self.wait_pending(index * CHUNK, ((index + 1) * CHUNK).min(self.size));
        chunks()
            .get_or_load(self.key(index), || {
                let at = index * CHUNK;
                let mut v = vec![0u8; CHUNK.min(self.size - at) as usize];
                // The message already names the request; the kind is the caller's (EIO).
                self.get(at, &mut v)
                    .map_err(|e| Error::Remote(e.to_string()))?;
                Ok(v)
            })
            .map_err(|e| std::io::Error::other(e.to_string()))
    }

    /// Fills `buf` from `pos` out of a file fetched whole, waiting for a GET of one
    /// under way that holds it.
    fn span_hit(&self, pos: u64, buf: &mut [u8]) -> bool {
        let end = pos + buf.len() as u64;
        loop {
            if spans().lock().copy(self.id, pos, buf) {
                return true;
            }
            let mut pending = self.pending.lock();
            if !pending.iter().any(|&(f, t)| f <= pos && end <= t) {
                drop(pending);
                // A GET that landed between the two looks.
                return spans().lock().copy(self.id, pos, buf);
            }
            pending = self.landed.wait(pending);
        }
    }

    /// Fetches `[pos, end)` in one GET into [`spans`] and fills `buf` from its start;
    /// reads of the rest wait for it meanwhile.
    fn fetch_through(&self, pos: u64, end: u64, buf: &mut [u8]) -> std::io::Result<()> {
        self.pending.lock().push((pos, end));
        let mut bytes = vec![0u8; (end - pos) as usize];
        let got = self.get(pos, &mut bytes);
        if got.is_ok() {
            buf.copy_from_slice(&bytes[..buf.len()]);
            spans().lock().add(self.id, pos, bytes.into());
        }
        self.span_done((pos, end));
        got
    }

    /// The GET of `span` is over (its bytes kept, or not): the reads waiting on it go on.
    fn span_done(&self, span: (u64, u64)) {
        let mut pending = self.pending.lock();
        if let Some(i) = pending.iter().position(|&p| p == span) {
            pending.swap_remove(i);
        }
        drop(pending);
        self.landed.notify_all();
    }

    /// Notes a large read of `[pos, pos + len)`; when it continues an earlier one (a
    /// file read through), the span to fetch ahead of the stream.
    fn follow(&self, pos: u64, len: u64) -> Option<(u64, u64)> {
        let end = pos + len;
        let mut streams = self.streams.lock();
        let Some(s) = streams.iter_mut().find(|(e, _)| *e == pos) else {
            if streams.len() == STREAMS {
                streams.remove(0);
            }
            streams.push((end, end));
            return None;
        };
        s.0 = end;
        if s.1 >= end + STREAM_AHEAD / 2 {
            return None;
        }
        let from = s.1.max(end);
        s.1 = end + STREAM_AHEAD;
        Some((from, end + STREAM_AHEAD - from))
    }

    /// Fills `buf` from `pos` if every chunk it spans is cached, or about to be (a GET
    /// of them under way).
    fn cached_span(&self, pos: u64, buf: &mut [u8]) -> bool {
        let end = pos + buf.len() as u64;
        let mut held = Vec::new();
        for c in pos / CHUNK..end.div_ceil(CHUNK) {
            let chunk = chunks().get(self.key(c)).or_else(|| {
                self.wait_pending(c * CHUNK, ((c + 1) * CHUNK).min(self.size));
                chunks().get(self.key(c))
            });
            match chunk {
                Some(chunk) => held.push(chunk),
                None => return false,
            }
        }
        for (i, chunk) in held.iter().enumerate() {
            let c_at = (pos / CHUNK + i as u64) * CHUNK;
            let from = pos.max(c_at);
            let to = end.min(c_at + chunk.len() as u64);
            if to <= from {
                return false;
            }
            buf[(from - pos) as usize..(to - pos) as usize]
                .copy_from_slice(&chunk[(from - c_at) as usize..(to - c_at) as usize]);
        }
        true
    }

    /// Fetches the chunks of `[at, at + len)` in one GET (up to [`AHEAD_GET`]) and keeps
    /// them; reads of them wait meanwhile. On failure (`false`), the reader that needs
    /// the bytes fetches them itself and reports.
    fn fetch_span(&self, at: u64, len: u64) -> bool {
        let (from, to) = chunk_span(at, len, self.size);
        if to <= from {
            return true;
        }
        self.pending.lock().push((from, to));
        let mut buf = vec![0u8; (to - from) as usize];
        let fetched = self.get(from, &mut buf).is_ok();
        if fetched {
            for (i, piece) in buf.chunks(CHUNK as usize).enumerate() {
                let c = from / CHUNK + i as u64;
                let _ = chunks().get_or_load(self.key(c), || Ok(piece.to_vec()));
            }
        }
        self.span_done((from, to));
        fetched
    }

    /// Fetches `[at, at + len)` in a few large GETs and keeps its chunks.
    fn fetch_ahead(&self, at: u64, len: u64) {
        // Not once the node has a copy: its reads serve what was wanted (a DataLoader
        // worker opening a SquashFS image each epoch fetched its tables again, 176 KiB),
        // nor once it has its share of the files: reads outside it are few, and ahead of
        // reads through the share it fetched what the share holds.
        if self.stage().is_some() || self.share().is_some() {
            return;
        }
        let last = (at + len).min(self.size).div_ceil(CHUNK);
        let mut c = at / CHUNK;
        while c < last {
            if chunks().get(self.key(c)).is_some() {
                c += 1;
                continue;
            }
            let n = (AHEAD_GET / CHUNK).min(last - c);
            if !self.fetch_span(c * CHUNK, n * CHUNK) {
                return;
            }
            c += n;
        }
    }
}

impl RemoteObject {
    /// Whether the node-local copy is being made (and will soon hold what is read).
    fn copying(&self) -> bool {
        self.inner.stage().is_some_and(|s| s.copying())
    }

    /// The node's copy while some process fills it in order and it is not whole: its
    /// bytes land as that order brings them.
    fn filling(&self) -> Option<&Arc<stage::StagedCopy>> {
        self.inner.stage.as_ref()?.filling()
    }
}

impl Inner {
    /// The node's copy, once there is one.
    fn stage(&self) -> Option<&Arc<stage::StagedCopy>> {
        use std::sync::atomic::Ordering;
        let stage = self.stage.as_ref()?.stage()?;
        if !self.staged.load(Ordering::Relaxed) && !self.staged.swap(true, Ordering::Relaxed) {
            // Every read is served from the copy now: what was fetched for reads
            // before it is let go (a mount on each of 8 ranks held ~150 MB of it), into
            // the copy while it is being made (an image's tables, read at its opening:
            // 20 MB at 1.28 M files, else fetched again).
            let id = self.id;
            let held = chunks().take(|k| k >> 40 == id);
            if stage.copying() {
                for (k, bytes) in held {
                    stage.put((k & ((1 << 40) - 1)) * CHUNK, &bytes);
                }
            }
            let mut spans = spans().lock();
            spans.list.retain(|(i, _, _)| *i != id);
            spans.bytes = spans.list.iter().map(|(_, _, b)| b.len()).sum();
        }
        Some(stage)
    }

    /// The node's copy of its share of the files, once there is one.
    fn share(&self) -> Option<&Arc<stage::StagedCopy>> {
        self.share.as_ref()?.stage()
    }

    /// Counts a read of a file; with `Staging::Auto`, the one that shows an epoch makes
    /// the node's copy (in the background: placing it may take a while).
    fn note_read(self: &Arc<Self>) {
        use std::sync::atomic::Ordering;
        let Some(wanted) = &self.stage else {
            return;
        };
        if self.staging != Staging::Auto || self.reads.load(Ordering::Relaxed) >= AUTO_AFTER_READS {
            return;
        }
        if wanted.stage().is_some() || self.share().is_some() {
            self.reads.store(AUTO_AFTER_READS, Ordering::Relaxed);
            return;
        }
        // Counted for the node (the hub starts the copy at its epoch), and here, in case
        // the hub cannot be reached.
        wanted.seen();
        if self.reads.fetch_add(1, Ordering::Relaxed) + 1 == AUTO_AFTER_READS {
            start_copies(vec![self.clone()]);
        }
        epoch().note(self);
    }
}

/// Makes the node's copies of `objects`, in order, on a thread of its own (placing a
/// copy may take a while).
fn start_copies(objects: Vec<Arc<Inner>>) {
    let _ = std::thread::Builder::new()
        .name("archfs-stage-start".into())
        .spawn(move || {
            for inner in objects {
                if let Some(s) = &inner.stage {
                    s.make_if_cheaper();
                }
            }
        });
}

/// The reads of files of this process's remote objects with `Staging::Auto`, together:
/// once they show an epoch, every such object is copied, as a local union is preloaded
/// whole, rather than each shard of a union after its own 128 reads (~13% of a shard of
/// 1,000 files fetched twice).
struct Epoch {
    reads: std::sync::atomic::AtomicU64,
    objects: Mutex<Vec<std::sync::Weak<Inner>>>,
}

fn epoch() -> &'static Epoch {
    static EPOCH: PerProcess<Epoch> = PerProcess::new();
    EPOCH.get(|| Epoch {
        reads: std::sync::atomic::AtomicU64::new(0),
        objects: Mutex::new(Vec::new()),
    })
}

impl Epoch {
    fn note(&self, inner: &Arc<Inner>) {
        use std::sync::atomic::Ordering;
        if self.reads.load(Ordering::Relaxed) >= AUTO_AFTER_READS {
            return;
        }
        {
            let mut objects = self.objects.lock();
            if !objects
                .iter()
                .any(|o| std::ptr::eq(o.as_ptr(), Arc::as_ptr(inner)))
            {
                objects.push(Arc::downgrade(inner));
            }
        }
        if self.reads.fetch_add(1, Ordering::Relaxed) + 1 == AUTO_AFTER_READS {
            let objects = std::mem::take(&mut *self.objects.lock());
            start_copies(
                objects
                    .iter()
                    .filter_map(std::sync::Weak::upgrade)
                    .collect(),
            );
        }
    }
}

impl RemoteObject {
    /// Fills `buf` from `pos` without a request of its own: from the object's first
    /// bytes, the node-local copy, or a file fetched whole.
    fn at_hand(&self, buf: &mut [u8], pos: u64) -> std::io::Result<bool> {
        let inner = &self.inner;
        if let Some(first) = usize::try_from(pos)
            .ok()
            .and_then(|p| inner.first.get(p..p.checked_add(buf.len())?))
        {
            buf.copy_from_slice(first);
            return Ok(true);
        }
        if let Some(share) = inner.share() {
            if let Some(at) = share.holds(pos, buf.len() as u64) {
                if let stage::Found::Read = share.read(at, buf)? {
                    return Ok(true);
                }
            }
        }
        if let Some(stage) = inner.stage() {
            if let stage::Found::Read = stage.read(pos, buf)? {
                return Ok(true);
            }
        }
        Ok(inner.span_hit(pos, buf))
    }
}

impl Storage for RemoteObject {
    fn read_through(&self, buf: &mut [u8], pos: u64, end: u64) -> std::io::Result<()> {
        self.inner.note_read();
        let want = pos + buf.len() as u64;
        let end = end.min(self.inner.size).max(want);
        // A large file, or a large read of all that is left of one: as any read (a
        // stream of reads through a file is fetched ahead of itself).
        if end - pos > SPAN_GET || (end == want && buf.len() > SMALL) {
            return self.read_exact_at(buf, pos);
        }
        if self.at_hand(buf, pos)? || self.inner.cached_span(pos, buf) {
            return Ok(());
        }
        // A small file whole: its exact bytes, not the chunks around them, which a
        // shuffled reader is unlikely to want next.
        if end == want {
            return self.inner.get(pos, buf);
        }
        self.inner.fetch_through(pos, end, buf)
    }

    fn read_exact_at(&self, buf: &mut [u8], pos: u64) -> std::io::Result<()> {
        let inner = &self.inner;
        if self.at_hand(buf, pos)? {
            return Ok(());
        }
        if buf.len() > SMALL {
            // Fetched ahead (by a scan, or for a stream of reads through a large file):
            // served from the chunks, else its own exact GET.
            let ahead = inner.follow(pos, buf.len() as u64);
            if inner.cached_span(pos, buf) {
                if let Some((from, len)) = ahead {
                    self.will_need(from, len);
                }
                return Ok(());
            }
            // The next part of a stream: fetched with what follows it, in one GET.
            if let Some((from, len)) = ahead.filter(|_| !self.copying() && inner.share().is_none())
            {
                let _ = inner.fetch_span(pos, from + len - pos);
                if inner.cached_span(pos, buf) {
                    return Ok(());
                }
            }
            return inner.get(pos, buf);
        }
        let mut done = 0;
        while done < buf.len() {
            let at = pos + done as u64;
            let chunk = inner.chunk(at / CHUNK)?;
            let off = (at % CHUNK) as usize;
            let n = (chunk.len().saturating_sub(off)).min(buf.len() - done);
            if n == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            buf[done..done + n].copy_from_slice(&chunk[off..off + n]);
            done += n;
        }
        Ok(())
    }

    fn size(&self) -> u64 {
        self.inner.size
    }

    fn path(&self) -> &Path {
        &self.inner.name
    }

    fn mtime(&self) -> i64 {
        self.inner.mtime
    }

    /// The ETag's hash: what ties a saved index to this version of the object.
    fn version(&self) -> i64 {
        let tag = self.inner.etag.as_deref().unwrap_or("");
        let mut h = crc32fast::Hasher::new();
        h.update(tag.as_bytes());
        h.update(self.inner.target.url.as_bytes());
        (i64::from(h.finalize()) << 31) ^ self.inner.size as i64
    }

    fn tagged(&self) -> bool {
        self.inner.etag.is_some()
    }

    fn will_need(&self, at: u64, len: u64) {
        // Not when the node's copy will serve the scan: what read-ahead fetched would be
        // fetched again into the copy (and held in every process).
        let inner = &self.inner;
        if inner.staging == Staging::Never && inner.stage().is_none() && inner.share().is_none() {
            ahead().push(self.inner.clone(), at, len, false);
        }
    }

    /// Fetched by the read-ahead threads in GETs of [`AHEAD_GET`], the end first (a
    /// format reads its tables from there), up to half the chunk cache.
    fn wanted_first(&self, at: u64, len: u64) {
        let end = at.saturating_add(len).min(self.inner.size);
        let at = at.max(end.saturating_sub(CHUNK_CACHE as u64 / 2));
        if at < end {
            ahead().push(self.inner.clone(), at, end - at, true);
        }
    }

    fn fd(&self, at: u64, len: u64) -> Option<(BorrowedFd<'_>, u64)> {
        if let Some(fd) = self.inner.stage().and_then(|s| s.fd(at, len)) {
            return Some((fd, at));
        }
        // A node's share of the files holds them in a row: read there, not fetched.
        let share = self.inner.share()?;
        let pos = share.holds(at, len)?;
        Some((share.fd(pos, len)?, pos))
    }

    fn partial(&self) -> bool {
        self.inner.share().is_some()
    }

    fn in_node_copy(&self) -> bool {
        self.inner.stage().is_some()
    }

    /// Not where the node holds a share of the files (they are read there) or the whole
    /// copy.
    fn fill(&self) -> Option<stage::Fill> {
        if self.inner.share().is_some() {
            return None;
        }
        // `preload="never"`: an order makes no copy, but fills one another process made.
        if self.inner.staging == Staging::Never && self.inner.stage().is_none() {
            return None;
        }
        let stage = self.inner.stage.as_ref()?.ordered()?;
        // What this process fetched before the copy was made (an image's tables) goes
        // into it before the order starts, which would fetch it again.
        let _ = self.inner.stage();
        stage.copying().then(|| stage::Fill(stage))
    }

    fn held(&self, at: u64, len: u64) -> bool {
        self.inner
            .share()
            .is_none_or(|s| s.holds(at, len).is_some())
    }

    fn landed(&self, at: u64, len: u64) -> bool {
        self.filling().is_none_or(|s| s.has(at, len))
    }

    fn landings(&self) -> Option<u32> {
        Some(self.filling()?.landings())
    }

    fn wait_landing(&self, seen: u32, timeout: Duration) -> bool {
        self.filling()
            .is_some_and(|s| s.wait_landing(seen, timeout))
    }

    /// A scan of the whole object (a tar's index build) is about to start: unless the
    /// job said never, the node's copy is made first and the scan reads it.
    fn will_scan(&self) {
        if self.inner.staging != Staging::Never {
            if let Some(s) = &self.inner.stage {
                s.make();
            }
        }
    }

    fn reopen(&self) -> std::io::Result<Arc<dyn Storage>> {
        Ok(Arc::new(RemoteObject {
            inner: self.inner.clone(),
        }))
    }

    fn is_local(&self) -> bool {
        false
    }

    /// The sidecar object `KEY.archfs-index` beside this one, fetched whole into `to`.
    fn fetch_sidecar(&self, to: &mut std::fs::File) -> std::io::Result<bool> {
        let location = sidecar_location(&self.inner.name).map_err(std::io::Error::other)?;
        let options = RemoteOptions {
            no_sign_request: self.inner.target.signer.is_none(),
            retry_for: Some(self.inner.target.budget),
            ..RemoteOptions::default()
        };
        let (t, _) = target(&location, &options).map_err(std::io::Error::other)?;
        self.inner
            .client
            .get_to(&t, to)
            .map_err(std::io::Error::other)
    }
}

/// The chunks one GET fetches for `[at, at + len)` of an object of `size` bytes: whole
/// chunks (the object's last one as long as it is), at most [`AHEAD_GET`] from the one
/// `at` is in.
fn chunk_span(at: u64, len: u64, size: u64) -> (u64, u64) {
    let from = at - at % CHUNK;
    let to = (at + len).min(size).min(from + AHEAD_GET);
    let to = if to < size {
        to.div_ceil(CHUNK) * CHUNK
    } else {
        to
    };
    (from, to.min(size))
}

/// `[at, at + len)` of an object of `size` bytes as read-ahead GETs of [`AHEAD_GET`]
/// each, from the chunk `at` is in: (where, how many bytes).
fn ahead_pieces(at: u64, len: u64, size: u64) -> impl Iterator<Item = (u64, u64)> {
    let end = at.saturating_add(len).min(size);
    (at - at % CHUNK..end)
        .step_by(AHEAD_GET as usize)
        .map(move |p| (p, AHEAD_GET.min(end - p)))
}

/// Read-ahead requests, served by a few threads for every remote object of the process.
struct ReadAheadQueue {
    queue: Mutex<VecDeque<(Arc<Inner>, u64, u64)>>,
    ready: Condvar,
}

fn ahead() -> &'static ReadAheadQueue {
    static AHEAD: PerProcess<ReadAheadQueue> = PerProcess::new();
    let (a, made) = AHEAD.get_or_make(|| ReadAheadQueue {
        queue: Mutex::new(VecDeque::new()),
        ready: Condvar::new(),
    });
    if made {
        for i in 0..AHEAD_THREADS {
            let _ = std::thread::Builder::new()
                .name(format!("archfs-ahead-{i}"))
                .spawn(move || loop {
                    let (inner, at, len) = {
                        let mut q = a.queue.lock();
                        loop {
                            if let Some(job) = q.pop_front() {
                                break job;
                            }
                            q = a.ready.wait(q);
                        }
                    };
                    inner.fetch_ahead(at, len);
                });
        }
    }
    a
}

impl ReadAheadQueue {
    /// Queues `[at, at + len)` in pieces, so the threads fetch them side by side: behind
    /// what is queued, or (`first`) ahead of it, the end first.
    fn push(&self, inner: Arc<Inner>, at: u64, len: u64, first: bool) {
        let mut q = self.queue.lock();
        for (p, n) in ahead_pieces(at, len, inner.size) {
            if first {
                q.push_front((inner.clone(), p, n));
            } else {
                q.push_back((inner.clone(), p, n));
            }
        }
        drop(q);
        self.ready.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicU64};
    use std::time::Duration;

    /// Requests sent by this process so far.
    fn requests() -> u64 {
        http::totals().map_or(0, |(n, _)| n)
    }

    /// An object of `size` bytes, its first bytes `first`, at an address where no server
    /// listens: any GET fails at once, so what a test reads came from what is kept.
    fn object(size: u64, first: Vec<u8>) -> Arc<Inner> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        let url = format!("http://127.0.0.1:{port}/object");
        Arc::new(Inner {
            client: http::Client::shared(None).unwrap(),
            target: http::Target {
                url: url.clone(),
                host: format!("127.0.0.1:{port}"),
                path: "/object".into(),
                name: url.clone(),
                endpoint: format!("http://127.0.0.1:{port}"),
                signer: None,
                credentials_from: "none".into(),
                budget: Duration::from_millis(1),
            },
            name: PathBuf::from(url),
            size,
            etag: None,
            mtime: 0,
            id: next_id(),
            stage: None,
            share: None,
            staging: Staging::Never,
            reads: AtomicU64::new(0),
            staged: AtomicBool::new(false),
            first: first.into_boxed_slice(),
            streams: Mutex::new(Vec::with_capacity(STREAMS)),
            pending: Mutex::new(Vec::new()),
            landed: Condvar::new(),
        })
    }

    /// The byte at `pos` of every test object: a wrong offset shows.
    fn byte(pos: u64) -> u8 {
        (pos.wrapping_mul(2_654_435_761) >> 13) as u8
    }

    fn bytes(from: u64, to: u64) -> Vec<u8> {
        (from..to).map(byte).collect()
    }

    /// Puts chunks `cs` of `inner` in the chunk cache.
    fn cache_chunks(inner: &Inner, cs: std::ops::Range<u64>) {
        for c in cs {
            let to = ((c + 1) * CHUNK).min(inner.size);
            chunks()
                .get_or_load(inner.key(c), || Ok(bytes(c * CHUNK, to)))
                .unwrap();
        }
    }

    #[test]
    fn a_get_fetches_whole_chunks_up_to_its_size() {
        let big = 1 << 40;
        // Within one chunk: that chunk.
        assert_eq!(chunk_span(CHUNK + 5, 10, big), (CHUNK, 2 * CHUNK));
        // Across a boundary: both.
        assert_eq!(chunk_span(2 * CHUNK - 1, 2, big), (CHUNK, 3 * CHUNK));
        // A long span: one GET's worth from the first chunk.
        assert_eq!(
            chunk_span(3 * CHUNK + 7, 100 * CHUNK, big),
            (3 * CHUNK, 3 * CHUNK + AHEAD_GET)
        );
        // The object's last chunk as long as it is.
        let size = 5 * CHUNK + 100;
        assert_eq!(chunk_span(5 * CHUNK + 1, CHUNK, size), (5 * CHUNK, size));
        assert_eq!(chunk_span(4 * CHUNK, 10 * CHUNK, size), (4 * CHUNK, size));
        // At the end: the chunk the end is in, if any.
        assert_eq!(chunk_span(size, 10, size), (5 * CHUNK, size));
        let (from, to) = chunk_span(5 * CHUNK, 10, 5 * CHUNK);
        assert!(to <= from, "{from}..{to}");
    }

    #[test]
    fn read_ahead_is_queued_in_gets_of_a_few_mib_from_a_chunk_boundary() {
        let size = 100 * AHEAD_GET;
        let at = 3 * CHUNK + 7;
        let len = 3 * AHEAD_GET + 5;
        let pieces: Vec<_> = ahead_pieces(at, len, size).collect();
        assert_eq!(pieces.len(), 4, "{pieces:?}");
        assert_eq!(pieces[0].0, 3 * CHUNK);
        let mut p = 3 * CHUNK;
        for &(at, n) in &pieces {
            assert_eq!(at, p, "contiguous: {pieces:?}");
            assert!(n > 0 && n <= AHEAD_GET, "{pieces:?}");
            p += n;
        }
        assert_eq!(p, at + len, "to the span's end");
        // Clipped at the object's end; nothing past it.
        let tail: Vec<_> = ahead_pieces(size - 10, AHEAD_GET, size).collect();
        assert_eq!(tail, [(size - CHUNK, CHUNK)]);
        assert_eq!(ahead_pieces(size, 10, size).count(), 0);
        assert_eq!(ahead_pieces(u64::MAX - 3, 10, size).count(), 0);
    }

    #[test]
    fn files_fetched_whole_are_found_within_their_bytes_newest_first() {
        let mut spans = Spans::default();
        spans.add(1, 100, bytes(100, 150).into());
        let mut buf = [0u8; 10];
        assert!(spans.copy(1, 110, &mut buf));
        assert_eq!(buf[..], bytes(110, 120)[..]);
        assert!(spans.copy(1, 140, &mut buf), "up to the span's last byte");
        assert!(!spans.copy(1, 141, &mut buf), "past its end");
        assert!(!spans.copy(1, 95, &mut buf), "before its start");
        assert!(!spans.copy(2, 110, &mut buf), "another object's");
        // A newer fetch of the same bytes is the one read.
        spans.add(1, 100, vec![7u8; 50].into());
        assert!(spans.copy(1, 110, &mut buf));
        assert_eq!(buf, [7u8; 10]);
        // Bounded by bytes, the oldest going first.
        let piece = SPAN_CACHE / 4;
        for i in 0..5u64 {
            spans.add(3, i << 32, vec![i as u8; piece].into());
        }
        assert!(spans.bytes <= SPAN_CACHE, "{} bytes", spans.bytes);
        assert_eq!(
            spans.bytes,
            spans.list.iter().map(|(_, _, b)| b.len()).sum::<usize>()
        );
        assert!(!spans.copy(1, 110, &mut buf), "the oldest went");
        assert!(!spans.copy(3, 0, &mut buf), "the oldest went");
        assert!(spans.copy(3, 4 << 32, &mut buf));
        assert_eq!(buf, [4u8; 10]);
    }

    #[test]
    fn a_stream_of_large_reads_is_fetched_ahead_of_itself() {
        let inner = object(1 << 40, Vec::new());
        let len = 256 << 10;
        assert_eq!(inner.follow(0, len), None, "one read is no stream");
        let mut fetched = None;
        let mut gets = 0;
        for i in 1..64u64 {
            let end = (i + 1) * len;
            if let Some((from, n)) = inner.follow(i * len, len) {
                gets += 1;
                // Each fetch carries on from the last one, never behind the read.
                assert!(from >= end, "read {i}: fetch from {from}");
                if let Some(to) = fetched {
                    assert_eq!(from, to, "read {i}: contiguous");
                }
                fetched = Some(from + n);
            }
            let ahead = fetched.expect("fetched ahead from the second read") - end;
            assert!(ahead >= STREAM_AHEAD / 2, "read {i}: {ahead} bytes ahead");
        }
        // Once each half window, not each read.
        let stream = 63 * len;
        assert!(
            gets <= stream.div_ceil(STREAM_AHEAD / 2) + 1,
            "{gets} fetches for {stream} bytes"
        );
        // Reads elsewhere are streams of their own; once there are too many, the oldest
        // is forgotten.
        let next = 64 * len;
        assert_eq!(inner.follow(1 << 35, len), None);
        assert!(
            inner.follow((1 << 35) + len, len).is_some(),
            "a second stream"
        );
        for s in 0..STREAMS as u64 {
            assert_eq!(inner.follow((s + 1) << 36, len), None);
        }
        assert_eq!(
            inner.follow(next, len),
            None,
            "the first stream was forgotten"
        );
    }

    #[test]
    fn reads_within_cached_chunks_or_the_first_bytes_send_no_request() {
        let size = 4 * CHUNK + 100;
        let inner = object(size, bytes(0, 1000));
        let other = object(size, Vec::new());
        cache_chunks(&inner, 0..5);
        let obj = RemoteObject {
            inner: inner.clone(),
        };
        let before = requests();
        // Small reads: across a chunk boundary, and the object's short last chunk.
        for (at, n) in [(CHUNK - 100, 5000), (4 * CHUNK, 100), (10, 20)] {
            let mut buf = vec![0u8; n];
            obj.read_exact_at(&mut buf, at).unwrap();
            assert!(buf == bytes(at, at + n as u64), "{n} bytes at {at}");
        }
        // A large read, served from the chunks it spans.
        let mut buf = vec![0u8; SMALL + 1];
        obj.read_exact_at(&mut buf, CHUNK + 3).unwrap();
        assert!(buf == bytes(CHUNK + 3, CHUNK + 3 + buf.len() as u64));
        let mut buf = vec![0u8; 3 * CHUNK as usize];
        assert!(inner.cached_span(50, &mut buf));
        assert!(buf == bytes(50, 50 + 3 * CHUNK));
        assert_eq!(requests(), before, "nothing was asked of the server");
        // Another object's chunks of the same numbers are not these.
        let mut buf = vec![0u8; 100];
        assert!(!other.cached_span(0, &mut buf));
        // Nor is a span one of whose chunks is not cached.
        chunks().forget(|k| k == inner.key(2));
        let mut buf = vec![0u8; 2 * CHUNK as usize];
        assert!(!inner.cached_span(CHUNK, &mut buf));
    }

    /// The one test that sends a request: to where no server listens.
    #[test]
    fn a_chunk_not_cached_is_asked_of_the_server() {
        let inner = object(3 * CHUNK, Vec::new());
        let obj = RemoteObject {
            inner: inner.clone(),
        };
        let before = requests();
        let mut buf = [0u8; 10];
        assert!(obj.read_exact_at(&mut buf, CHUNK).is_err());
        assert!(requests() > before, "no request was sent");
        assert!(
            chunks().get(inner.key(1)).is_none(),
            "a failed GET keeps nothing"
        );
    }

    #[test]
    fn a_read_waits_for_the_get_under_way_that_holds_it() {
        let inner = object(1 << 20, Vec::new());
        let mut buf = [0u8; 20];
        assert!(
            !inner.span_hit(10, &mut buf),
            "nothing fetched, nothing under way"
        );
        inner.pending.lock().push((0, 1000));
        let waiter = {
            let inner = inner.clone();
            std::thread::spawn(move || {
                let mut buf = [0u8; 20];
                let hit = inner.span_hit(10, &mut buf);
                (hit, buf)
            })
        };
        std::thread::sleep(Duration::from_millis(100));
        assert!(!waiter.is_finished(), "the read did not wait");
        spans().lock().add(inner.id, 0, bytes(0, 1000).into());
        inner.span_done((0, 1000));
        let (hit, got) = waiter.join().unwrap();
        assert!(hit);
        assert_eq!(got[..], bytes(10, 30)[..]);
        assert!(inner.pending.lock().is_empty());
        // A read outside what is under way does not wait for it.
        inner.pending.lock().push((0, 1000));
        assert!(!inner.span_hit(2000, &mut buf));
        inner.span_done((0, 1000));
    }
}
