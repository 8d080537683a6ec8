//! Archives in object storage (`s3://BUCKET/KEY`) or behind a plain URL, as a kind of
//! [`Storage`]: size and ETag taken once at open, every read a ranged GET conditional
//! on that ETag (an object replaced under a mount gives EIO, never a mix of old and new
//! bytes). A read fetches what it needs: a large one (a file's blocks, a tar member)
//! exactly its span, a small one (headers, metadata blocks) the 128 KiB chunk around it,
//! kept in a small cache; a scan's read-ahead advice fetches its chunks in the
//! background, in GETs of a few MiB. A mount also copies the whole object to the node
//! ([`stage`]), and what is copied is read as a local file is.

mod config;
mod http;
mod sigv4;
mod stage;
mod url;

use std::collections::VecDeque;
use std::os::fd::BorrowedFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use parking_lot::{Condvar, Mutex};

use super::Storage;
use crate::cache::BlockCache;
use crate::error::{Error, Result};
pub use url::is_url;
use url::Location;

/// Chunks small reads are fetched and cached in.
const CHUNK: u64 = 128 << 10;
/// Reads up to this size go through the chunk cache; larger ones fetch their span.
const SMALL: usize = 64 << 10;
/// Bytes of chunks kept per object.
const CHUNK_CACHE: usize = 64 << 20;
/// One GET of read-ahead.
const AHEAD_GET: u64 = 4 << 20;
/// Threads that fetch read-ahead, for all objects.
const AHEAD_THREADS: usize = 4;

/// How to reach remote archives, from the command line.
#[derive(Clone, Debug, Default)]
pub struct RemoteOptions {
    /// Send S3 requests unsigned (a public bucket), as the AWS CLI's flag of that name.
    pub no_sign_request: bool,
    /// Copy the whole object to the node in the background (a mount; not `archfs cat`).
    pub stage: bool,
    /// Where the copy goes when it does not fit in memory.
    pub stage_dir: Option<PathBuf>,
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
    chunks: BlockCache<Vec<u8>>,
    stage: Option<Arc<stage::Stage>>,
}

impl RemoteObject {
    /// `None` when `name` is a local path.
    pub fn open(name: &Path, options: &RemoteOptions) -> Option<Result<RemoteObject>> {
        let location = Location::parse(name)?;
        Some(
            location
                .map_err(Error::Unsupported)
                .and_then(|l| Self::open_at(l, options)),
        )
    }

    fn open_at(location: Location, options: &RemoteOptions) -> Result<RemoteObject> {
        let (target, ca_bundle) = target(&location, options).map_err(Error::Unsupported)?;
        let client = http::Client::shared(ca_bundle.as_ref()).map_err(Error::Unsupported)?;
        let meta = client.head(&target).map_err(Error::Unsupported)?;
        tracing::info!(
            "{}: {} bytes, ETag {}, from {}",
            target.name,
            meta.size,
            meta.etag.as_deref().unwrap_or("none"),
            target.endpoint
        );
        let stage = options.stage.then(|| {
            stage::Stage::start(
                client.clone(),
                target.clone(),
                meta.etag.clone(),
                meta.size,
                options.stage_dir.as_deref(),
            )
        });
        Ok(RemoteObject {
            inner: Arc::new(Inner {
                stage: stage.flatten(),
                client,
                name: PathBuf::from(location.name()),
                target,
                size: meta.size,
                etag: meta.etag,
                mtime: meta.mtime,
                chunks: BlockCache::new("remote chunk", CHUNK_CACHE),
            }),
        })
    }
}

/// The request target of `location` and the CA bundle to trust.
fn target(
    location: &Location,
    options: &RemoteOptions,
) -> std::result::Result<(http::Target, Option<PathBuf>), String> {
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
                },
                ca,
            ))
        }
        Location::S3 { bucket, key } => {
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
            let url = if cfg.path_style || !dns_safe {
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
                },
                cfg.ca_bundle,
            ))
        }
    }
}

impl Inner {
    fn get(&self, at: u64, buf: &mut [u8]) -> std::io::Result<()> {
        self.client
            .get(&self.target, self.etag.as_deref(), at, buf)
            .map_err(|e| {
                tracing::error!("{e}");
                std::io::Error::other(e)
            })
    }

    /// The chunk `index`, fetched once however many readers want it at the same time.
    fn chunk(&self, index: u64) -> std::io::Result<Arc<Vec<u8>>> {
        self.chunks
            .get_or_load(index, || {
                let at = index * CHUNK;
                let mut v = vec![0u8; CHUNK.min(self.size - at) as usize];
                // The message already names the request; the kind is the caller's (EIO).
                self.get(at, &mut v)
                    .map_err(|e| Error::Unsupported(e.to_string()))?;
                Ok(v)
            })
            .map_err(|e| std::io::Error::other(e.to_string()))
    }

    /// Fetches `[at, at + len)` in a few large GETs and keeps its chunks.
    fn fetch_ahead(&self, at: u64, len: u64) {
        let first = at / CHUNK;
        let last = (at + len).min(self.size).div_ceil(CHUNK);
        let mut c = first;
        while c < last {
            if self.chunks.get(c).is_some() {
                c += 1;
                continue;
            }
            let n = (AHEAD_GET / CHUNK).min(last - c);
            let from = c * CHUNK;
            let to = ((c + n) * CHUNK).min(self.size);
            let mut buf = vec![0u8; (to - from) as usize];
            if self.get(from, &mut buf).is_err() {
                return; // the reader that needs these bytes fetches them and reports
            }
            for (i, piece) in buf.chunks(CHUNK as usize).enumerate() {
                let _ = self.chunks.get_or_load(c + i as u64, || Ok(piece.to_vec()));
            }
            c += n;
        }
    }
}

impl Storage for RemoteObject {
    fn read_exact_at(&self, buf: &mut [u8], pos: u64) -> std::io::Result<()> {
        let inner = &self.inner;
        if let Some(stage) = &inner.stage {
            if let stage::Found::Read = stage.read(pos, buf)? {
                return Ok(());
            }
        }
        if buf.len() > SMALL {
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

    fn will_need(&self, at: u64, len: u64) {
        if !self.inner.stage.as_ref().is_some_and(|s| s.copying()) {
            ahead().push(self.inner.clone(), at, len);
        }
    }

    fn fd(&self, at: u64, len: u64) -> Option<BorrowedFd<'_>> {
        self.inner.stage.as_ref()?.fd(at, len)
    }

    fn reopen(&self) -> std::io::Result<Arc<dyn Storage>> {
        Ok(Arc::new(RemoteObject {
            inner: self.inner.clone(),
        }))
    }

    fn is_local(&self) -> bool {
        false
    }
}

/// Read-ahead requests, served by a few threads for every remote object of the process.
struct Ahead {
    queue: Mutex<VecDeque<(Arc<Inner>, u64, u64)>>,
    ready: Condvar,
}

fn ahead() -> &'static Ahead {
    static AHEAD: OnceLock<&'static Ahead> = OnceLock::new();
    AHEAD.get_or_init(|| {
        let a: &'static Ahead = Box::leak(Box::new(Ahead {
            queue: Mutex::new(VecDeque::new()),
            ready: Condvar::new(),
        }));
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
                            a.ready.wait(&mut q);
                        }
                    };
                    inner.fetch_ahead(at, len);
                });
        }
        a
    })
}

impl Ahead {
    /// Queues `[at, at + len)` in pieces, so the threads fetch them side by side.
    fn push(&self, inner: Arc<Inner>, at: u64, len: u64) {
        let end = at.saturating_add(len).min(inner.size);
        let mut q = self.queue.lock();
        let mut p = at - at % CHUNK;
        while p < end {
            let n = AHEAD_GET.min(end - p);
            q.push_back((inner.clone(), p, n));
            p += n;
        }
        drop(q);
        self.ready.notify_all();
    }
}
