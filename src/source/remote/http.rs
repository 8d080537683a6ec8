//! The requests archfs sends to an object store: ranged GETs, the first for size and
//! ETag, the others read straight into the caller's buffer, on a blocking client shared by every thread,
//! with one limit on requests in flight and retries with backoff and jitter. A request
//! that fails past its retries is one error that says what and where, never a hang: a
//! [`RequestError`], whose kind alone decides the [`Error`] it becomes.

use std::io::Read;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use crate::sync::{Condvar, Mutex};
use ureq::tls::{RootCerts, TlsConfig};

use super::config::Credentials;
use super::sigv4;
use crate::error::Error;
use crate::per_process::PerProcess;

/// Requests answered, and body bytes read, by every client of the process.
static REQUESTS: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);

/// Requests answered and body bytes read so far; `None` before the first.
pub fn totals() -> Option<(u64, u64)> {
    let n = REQUESTS.load(Ordering::Relaxed);
    (n > 0).then(|| (n, BYTES.load(Ordering::Relaxed)))
}

/// Requests in flight at once, for all objects of a mount ([`Client::shared`]): room for
/// a DataLoader's order fetched ahead (48 GETs of ~110 KiB fill a 50 ms, 1 Gbit/s link)
/// and the reads it has not reached.
const IN_FLIGHT: usize = 64;
/// Bytes the first GET of an object fetches: what a format reads first (a tar header, a
/// SquashFS superblock, a compressed stream's header), within a new connection's first
/// window of ten segments, so it costs no more round trips than one byte.
pub const FIRST: u64 = 8 << 10;
/// Attempts of one request (how long they may take together is [`Target::budget`]).
const ATTEMPTS: u32 = 8;
/// The default of that budget.
pub const BUDGET: Duration = Duration::from_secs(60);

/// One object and how to reach it.
#[derive(Clone, Debug)]
pub struct Target {
    /// The request URL.
    pub url: String,
    /// `host[:port]` and the percent-encoded path, as signed.
    pub host: String,
    pub path: String,
    /// `s3://bucket/key` or the URL: what messages name.
    pub name: String,
    /// Where it is served from, for messages.
    pub endpoint: String,
    /// Signing keys and region; `None`: anonymous.
    pub signer: Option<(Credentials, String)>,
    /// Where the credentials came from, for messages (never the secret).
    pub credentials_from: String,
    /// How long the attempts of one request may take together before it fails.
    pub budget: Duration,
}

/// What HEAD says of an object.
#[derive(Clone, Debug)]
pub struct Meta {
    pub size: u64,
    pub etag: Option<String>,
    /// Seconds since the epoch; 0 when the server sent none.
    pub mtime: i64,
    /// The object's first bytes (all of it when it is smaller than [`FIRST`]).
    pub first: Vec<u8>,
}

/// Why a request failed: what [`Error`] (and so errno, and Python exception) it becomes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// 404: no such key (or, over plain HTTP, no such object).
    NoSuchKey,
    /// 404 NoSuchBucket.
    NoSuchBucket,
    /// 403: the credentials (or their absence) may not read it.
    Denied,
    /// 412: the object's ETag changed since it was opened.
    Replaced,
    /// The bucket is in another region than the request was signed for.
    WrongRegion,
    /// The server does not serve parts of objects.
    NoRanges,
    /// The server's TLS certificate is not trusted.
    Untrusted,
    /// What might have passed (a reset, a timeout, 5xx) failed past the retries.
    GaveUp,
    /// An answer archfs cannot read (no Content-Range, a malformed listing).
    Malformed,
    /// The caller's handling of the bytes failed (writing the node's copy).
    Local,
    /// Any other status, or a request that cannot be sent.
    Other,
}

/// A request that failed: what was asked, what the server (or the transport) said, and
/// what to do about it.
#[derive(Debug)]
pub struct RequestError {
    kind: Kind,
    /// `GET s3://BUCKET/KEY (bytes=0-8191) from ENDPOINT`; `None` for what is said of
    /// an answer as a whole (a malformed listing names it itself).
    what: Option<String>,
    why: String,
}

impl std::fmt::Display for RequestError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.what {
            Some(what) => write!(f, "{what}: {}", self.why),
            None => f.write_str(&self.why),
        }
    }
}

impl std::error::Error for RequestError {}

/// The one place a failed request becomes an [`Error`]: by its kind, so a Python caller
/// gets `FileNotFoundError` for a missing object or bucket, `PermissionError` for one
/// the credentials may not read, whatever the message says.
impl From<RequestError> for Error {
    fn from(e: RequestError) -> Error {
        let message = e.to_string();
        match e.kind {
            Kind::NoSuchKey | Kind::NoSuchBucket => Error::Absent(message),
            Kind::Denied => Error::Denied(message),
            Kind::Replaced
            | Kind::WrongRegion
            | Kind::NoRanges
            | Kind::Untrusted
            | Kind::GaveUp
            | Kind::Malformed
            | Kind::Local
            | Kind::Other => Error::Remote(message),
        }
    }
}

/// A CA bundle that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    #[error("cannot read the CA bundle {}: {source}", path.display())]
    Unreadable {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the CA bundle {} holds no certificate", path.display())]
    Empty { path: PathBuf },
}

impl From<BundleError> for Error {
    fn from(e: BundleError) -> Error {
        Error::Config(e.to_string())
    }
}

/// The blocking HTTP client of one mount.
pub struct Client {
    /// Connections for reads (and the rest but the copy's GETs): kept apart from the
    /// copy's, so that a read finds one it used a moment ago, with the server's window
    /// already open, rather than a new one in slow start or one the copy left idle.
    agent: ureq::Agent,
    /// Connections for the copy's long GETs ([`get_parts`](Self::get_parts)).
    bulk: ureq::Agent,
    slots: Mutex<usize>,
    freed: Condvar,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Client")
    }
}

impl Client {
    /// The process's client for `ca_bundle`: one per bundle, so the limit on requests in
    /// flight holds for all objects of a mount together.
    pub fn shared(ca_bundle: Option<&PathBuf>) -> Result<Arc<Client>, BundleError> {
        // A forked child's own: the parent's pooled connections are the parent's.
        type Clients = Mutex<Vec<(Option<PathBuf>, Arc<Client>)>>;
        static CLIENTS: PerProcess<Clients> = PerProcess::new();
        let mut clients = CLIENTS.get(|| Mutex::new(Vec::new())).lock();
        if let Some((_, c)) = clients.iter().find(|(k, _)| k.as_ref() == ca_bundle) {
            return Ok(c.clone());
        }
        let c = Client::new(ca_bundle)?;
        clients.push((ca_bundle.cloned(), c.clone()));
        Ok(c)
    }

    /// A client trusting the CA certificates in `ca_bundle`, else those of
    /// `SSL_CERT_FILE` or the system's bundle, else Mozilla's.
    fn new(ca_bundle: Option<&PathBuf>) -> Result<Arc<Client>, BundleError> {
        let roots = match roots(ca_bundle)? {
            Some(certs) => RootCerts::Specific(Arc::new(certs)),
            None => RootCerts::WebPki,
        };
        let agent = || {
            ureq::Agent::config_builder()
                .http_status_as_error(false)
                .max_idle_connections(IN_FLIGHT)
                .max_idle_connections_per_host(IN_FLIGHT)
                .timeout_connect(Some(Duration::from_secs(10)))
                .timeout_recv_response(Some(Duration::from_secs(30)))
                .timeout_recv_body(Some(Duration::from_secs(60)))
                .user_agent(concat!("archfs/", env!("CARGO_PKG_VERSION")))
                .tls_config(TlsConfig::builder().root_certs(roots.clone()).build())
                .build()
                .new_agent()
        };
        Ok(Arc::new(Client {
            agent: agent(),
            bulk: agent(),
            slots: Mutex::new(IN_FLIGHT),
            freed: Condvar::new(),
        }))
    }

    /// Size, ETag and modification time of the object, and its first [`FIRST`] bytes,
    /// from a ranged GET rather than a HEAD: an error comes with S3's XML body (which
    /// bucket or key is missing), a server that ignores ranges is found at once, and the
    /// format's first look at the archive costs no round trip of its own.
    pub fn head(&self, t: &Target) -> Result<Meta, RequestError> {
        let range = format!("bytes=0-{}", FIRST - 1);
        self.send(t, &Call::range(range, None), |resp| {
            let h = resp.headers();
            let text = |k: &str| h.get(k).and_then(|v| v.to_str().ok());
            if resp.status().as_u16() != 206 {
                return Err(no_ranges(resp.status().as_u16()));
            }
            let size = text("content-range")
                .and_then(|v| v.rsplit_once('/'))
                .and_then(|(_, total)| total.trim().parse().ok())
                .ok_or_else(|| {
                    Failure::Final(Kind::Malformed, "the server sent no Content-Range".into())
                })?;
            let mut meta = Meta {
                size,
                etag: text("etag").map(str::to_owned),
                mtime: text("last-modified").and_then(http_date).unwrap_or(0),
                first: vec![0; size.min(FIRST) as usize],
            };
            resp.body_mut()
                .as_reader()
                .read_exact(&mut meta.first)
                .map_err(|e| Failure::Retry(format!("reading the response: {e}")))?;
            BYTES.fetch_add(meta.first.len() as u64, Ordering::Relaxed);
            finish(resp)?;
            Ok(meta)
        })
    }

    /// Fills `buf` with the object's bytes from `at`, in one ranged GET that fails unless
    /// the object still has `etag`.
    pub fn get(
        &self,
        t: &Target,
        etag: Option<&str>,
        at: u64,
        buf: &mut [u8],
    ) -> Result<(), RequestError> {
        if buf.is_empty() {
            return Ok(());
        }
        let range = format!("bytes={}-{}", at, at + buf.len() as u64 - 1);
        self.send(t, &Call::range(range, etag), |resp| {
            if resp.status().as_u16() != 206 {
                return Err(no_ranges(resp.status().as_u16()));
            }
            resp.body_mut()
                .as_reader()
                .read_exact(buf)
                .map_err(|e| Failure::Retry(format!("reading the response: {e}")))?;
            BYTES.fetch_add(buf.len() as u64, Ordering::Relaxed);
            finish(resp)
        })
    }

    /// Bytes `[at, at + len)` of the object in one ranged GET that fails unless the
    /// object still has `etag`, handed to `each` as they arrive, `part` bytes at a time
    /// (the last part may be shorter) with their offset. A retry skips what was handed
    /// over already, so every part is handed over once. An error of `each` ends the
    /// request as [`Kind::Local`].
    pub fn get_parts<E: std::fmt::Display>(
        &self,
        t: &Target,
        etag: Option<&str>,
        (at, len): (u64, u64),
        part: u64,
        mut each: impl FnMut(u64, &[u8]) -> Result<(), E>,
    ) -> Result<(), RequestError> {
        if len == 0 {
            return Ok(());
        }
        let range = format!("bytes={}-{}", at, at + len - 1);
        let mut handed = 0;
        let mut buf = Vec::new();
        let call = Call {
            bulk: true,
            ..Call::range(range, etag)
        };
        self.send(t, &call, |resp| {
            if resp.status().as_u16() != 206 {
                return Err(no_ranges(resp.status().as_u16()));
            }
            let mut body = resp.body_mut().as_reader();
            let mut got = 0;
            while got < len {
                let n = part.min(len - got);
                buf.resize(n as usize, 0);
                body.read_exact(&mut buf)
                    .map_err(|e| Failure::Retry(format!("reading the response: {e}")))?;
                BYTES.fetch_add(n, Ordering::Relaxed);
                if got >= handed {
                    each(at + got, &buf).map_err(|e| Failure::Final(Kind::Local, e.to_string()))?;
                    handed = got + n;
                }
                got += n;
            }
            finish(resp)
        })
    }

    /// The whole object written to `out`; `false` when there is no such object.
    pub fn get_to(&self, t: &Target, out: &mut std::fs::File) -> Result<bool, RequestError> {
        use std::io::{Seek, Write};
        let call = Call {
            missing_ok: true,
            ..Call::plain("GET")
        };
        self.send(t, &call, |resp| {
            if resp.status().as_u16() == 404 {
                return Ok(false);
            }
            let again = |e: std::io::Error| Failure::Retry(format!("reading the response: {e}"));
            out.set_len(0).and_then(|()| out.rewind()).map_err(again)?;
            let mut body = resp.body_mut().with_config().limit(u64::MAX).reader();
            let n = std::io::copy(&mut body, out).map_err(again)?;
            BYTES.fetch_add(n, Ordering::Relaxed);
            out.flush().map_err(again)?;
            Ok(true)
        })
    }

    /// Stores `body` as the object.
    pub fn put(&self, t: &Target, body: &[u8]) -> Result<(), RequestError> {
        let call = Call {
            body,
            ..Call::plain("PUT")
        };
        self.send(t, &call, finish)
    }

    /// The keys and sizes of the objects directly under `prefix` in the bucket `t`
    /// (a ListObjectsV2 with `/` as delimiter, every page), in name order.
    pub fn list(&self, t: &Target, prefix: &str) -> Result<Vec<(String, u64)>, RequestError> {
        let mut found = Vec::new();
        let mut token: Option<String> = None;
        loop {
            // Sorted by name, as signing wants.
            let mut query = vec![
                ("continuation-token", token.clone()),
                ("delimiter", Some("/".to_owned())),
                ("list-type", Some("2".to_owned())),
                ("prefix", Some(prefix.to_owned())),
            ];
            query.retain(|(_, v)| v.is_some());
            let query = query
                .iter()
                .map(|(k, v)| format!("{k}={}", query_encode(v.as_deref().unwrap_or(""))))
                .collect::<Vec<_>>()
                .join("&");
            let call = Call {
                query: &query,
                ..Call::plain("GET")
            };
            let page = self.send(t, &call, |resp| {
                resp.body_mut()
                    .with_config()
                    .limit(64 << 20)
                    .read_to_string()
                    .map_err(|e| Failure::Retry(format!("reading the listing: {e}")))
            })?;
            for item in xml_elements(&page, "Contents") {
                let key = xml_field(item, "Key").map(|k| xml_unescape(&k));
                let size = xml_field(item, "Size").and_then(|s| s.parse().ok());
                match (key, size) {
                    (Some(k), Some(s)) => found.push((k, s)),
                    _ => {
                        return Err(RequestError {
                            kind: Kind::Malformed,
                            what: None,
                            why: format!("the listing of {} is malformed", t.name),
                        })
                    }
                }
            }
            token = xml_field(&page, "NextContinuationToken").map(|k| xml_unescape(&k));
            let truncated = xml_field(&page, "IsTruncated").is_some_and(|v| v == "true");
            if !truncated || token.is_none() {
                break;
            }
        }
        found.sort();
        Ok(found)
    }

    /// Sends one request, retrying what may pass (transport errors, 5xx, 429, 408) with
    /// exponential backoff and full jitter until `ATTEMPTS` or the target's retry budget
    /// run out; no attempt outlasts the budget.
    fn send<T>(
        &self,
        t: &Target,
        call: &Call<'_>,
        mut done: impl FnMut(&mut ureq::http::Response<ureq::Body>) -> Result<T, Failure>,
    ) -> Result<T, RequestError> {
        let start = Instant::now();
        let what = match &call.range {
            Some(r) => format!("{} {} ({r}) from {}", call.method, t.name, t.endpoint),
            None => format!("{} {} from {}", call.method, t.name, t.endpoint),
        };
        let mut attempt = 0;
        loop {
            attempt += 1;
            let left = t.budget.saturating_sub(start.elapsed());
            let mut answered = Duration::ZERO;
            let result = {
                let _slot = self.slot();
                self.once(t, call, left.max(Duration::from_secs(1)))
                    .map_err(transport)
                    .and_then(|mut resp| {
                        answered = start.elapsed();
                        classify(t, call, &mut resp).and_then(|()| done(&mut resp))
                    })
            };
            REQUESTS.fetch_add(1, Ordering::Relaxed);
            tracing::trace!(
                "{what}: {} in {:.1} ms (answered in {:.1} ms)",
                if result.is_ok() { "done" } else { "failed" },
                start.elapsed().as_secs_f64() * 1e3,
                answered.as_secs_f64() * 1e3
            );
            match result {
                Ok(v) => return Ok(v),
                Err(Failure::Final(kind, why)) => {
                    return Err(RequestError {
                        kind,
                        what: Some(what),
                        why,
                    })
                }
                Err(Failure::Retry(why)) => {
                    let pause = backoff(attempt);
                    if attempt >= ATTEMPTS || start.elapsed() + pause > t.budget {
                        return Err(RequestError {
                            kind: Kind::GaveUp,
                            what: Some(what),
                            why: format!(
                                "{why} (gave up after {attempt} attempts in {:.1} s)",
                                start.elapsed().as_secs_f64()
                            ),
                        });
                    }
                    tracing::debug!("{what}: {why}; retrying in {pause:?}");
                    std::thread::sleep(pause);
                }
            }
        }
    }

    fn once(
        &self,
        t: &Target,
        call: &Call<'_>,
        timeout: Duration,
    ) -> Result<ureq::http::Response<ureq::Body>, ureq::Error> {
        let mut headers: Vec<(&str, String)> = Vec::new();
        if let Some(r) = &call.range {
            headers.push(("range", r.clone()));
        }
        if let Some(e) = call.etag {
            headers.push(("if-match", e.to_owned()));
        }
        if let Some((creds, region)) = &t.signer {
            let req = sigv4::Request {
                method: call.method,
                host: &t.host,
                uri: &t.path,
                query: call.query,
                headers: &[],
                body: call.body,
            };
            headers.extend(sigv4::sign(creds, region, &req, SystemTime::now()));
        }
        let url = if call.query.is_empty() {
            t.url.clone()
        } else {
            format!("{}?{}", t.url, call.query)
        };
        // Each phase within what is left of the budget. Not `timeout_global`: with it,
        // ureq resolves the host on a new thread for every request (measured: 2,008
        // threads for 2,000 GETs).
        let within = |limit: u64| Some(timeout.min(Duration::from_secs(limit)));
        if call.method == "PUT" {
            let mut req = self.agent.put(&url);
            for (k, v) in &headers {
                req = req.header(*k, v);
            }
            return req
                .config()
                .timeout_connect(within(10))
                .timeout_send_body(within(600))
                .timeout_recv_response(within(30))
                .build()
                .send(call.body);
        }
        let agent = if call.bulk { &self.bulk } else { &self.agent };
        let mut req = agent.get(&url);
        for (k, v) in &headers {
            req = req.header(*k, v);
        }
        req.config()
            .timeout_connect(within(10))
            .timeout_recv_response(within(30))
            .timeout_recv_body(within(60))
            .build()
            .call()
    }

    /// Waits for a free request slot; it is given back when the guard drops.
    fn slot(&self) -> Slot<'_> {
        let mut free = self.slots.lock();
        while *free == 0 {
            free = self.freed.wait(free);
        }
        *free -= 1;
        Slot(self)
    }
}

struct Slot<'a>(&'a Client);

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        *self.0.slots.lock() += 1;
        self.0.freed.notify_one();
    }
}

/// What to send beside the target.
struct Call<'a> {
    method: &'static str,
    query: &'a str,
    range: Option<String>,
    etag: Option<&'a str>,
    body: &'a [u8],
    /// A 404 is an answer, not an error.
    missing_ok: bool,
    /// One of the copy's GETs ([`Client::bulk`]).
    bulk: bool,
}

impl<'a> Call<'a> {
    fn plain(method: &'static str) -> Call<'a> {
        Call {
            method,
            query: "",
            range: None,
            etag: None,
            body: b"",
            missing_ok: false,
            bulk: false,
        }
    }

    fn range(range: String, etag: Option<&'a str>) -> Call<'a> {
        Call {
            range: Some(range),
            etag,
            ..Call::plain("GET")
        }
    }
}

/// How one attempt failed.
enum Failure {
    /// Worth another attempt.
    Retry(String),
    Final(Kind, String),
}

/// Reads a response to its end, so that its connection goes back to the pool for the
/// next request: one left unread is closed, and the next pays a TCP (and TLS) handshake
/// and slow start again (measured: a connection per GET, ~270 ms a GET at 50 ms RTT).
fn finish(resp: &mut ureq::http::Response<ureq::Body>) -> Result<(), Failure> {
    let mut rest = resp.body_mut().with_config().limit(64 << 10).reader();
    std::io::copy(&mut rest, &mut std::io::sink())
        .map(drop)
        .map_err(|e| Failure::Retry(format!("reading the response: {e}")))
}

/// A request that got no answer: worth retrying (a reset, a timeout, a refused
/// connection), unless the server's certificate is not trusted, which no retry mends.
fn transport(e: ureq::Error) -> Failure {
    let said = e.to_string();
    let tls =
        matches!(e, ureq::Error::Rustls(_) | ureq::Error::Tls(_)) || said.contains("certificate");
    if tls {
        return Failure::Final(
            Kind::Untrusted,
            format!(
                "{said}; the server's TLS certificate is not trusted: point AWS_CA_BUNDLE \
                 (or ca_bundle in the profile, or SSL_CERT_FILE) at your site's CA bundle"
            ),
        );
    }
    match e {
        ureq::Error::BadUri(_) | ureq::Error::RequireHttpsOnly(_) => {
            Failure::Final(Kind::Other, said)
        }
        _ => Failure::Retry(said),
    }
}

fn no_ranges(status: u16) -> Failure {
    Failure::Final(
        Kind::NoRanges,
        format!(
            "the server answered a range request with status {status} instead of 206: it \
         does not serve parts of objects, which archfs needs; copy the archive to a \
         local path instead"
        ),
    )
}

/// An error status as a [`Failure`] that says what to do about it.
fn classify(
    t: &Target,
    call: &Call<'_>,
    resp: &mut ureq::http::Response<ureq::Body>,
) -> Result<(), Failure> {
    let status = resp.status().as_u16();
    if (200..300).contains(&status) || (status == 404 && call.missing_ok) {
        return Ok(());
    }
    let body = resp
        .body_mut()
        .with_config()
        .limit(64 << 10)
        .read_to_string()
        .unwrap_or_default();
    let code = xml_field(&body, "Code");
    let message = xml_field(&body, "Message");
    let said = match (&code, &message) {
        (Some(c), Some(m)) => format!("{status} {c}: {m}"),
        (Some(c), None) => format!("{status} {c}"),
        _ => format!("status {status}"),
    };
    if matches!(status, 408 | 429 | 500 | 502 | 503 | 504) {
        return Err(Failure::Retry(said));
    }
    let creds = &t.credentials_from;
    let (kind, hint) = match (status, code.as_deref().unwrap_or("")) {
        (403, "SignatureDoesNotMatch") => (
            Kind::Denied,
            format!("the secret key does not match the access key (credentials from {creds})"),
        ),
        (403, "InvalidAccessKeyId") => (
            Kind::Denied,
            format!(
                "the access key is unknown to {} (credentials from {creds})",
                t.endpoint
            ),
        ),
        (403, _) if t.signer.is_none() => (
            Kind::Denied,
            "anonymous access refused: configure credentials (AWS_ACCESS_KEY_ID, \
             AWS_PROFILE or ~/.aws/credentials)"
                .to_owned(),
        ),
        (403, _) => (
            Kind::Denied,
            format!(
                "access denied to these credentials (from {creds}); for a public object \
                 try --no-sign-request"
            ),
        ),
        (404, "NoSuchBucket") => (
            Kind::NoSuchBucket,
            "there is no such bucket: check the name and the endpoint".into(),
        ),
        (404, _) => (
            Kind::NoSuchKey,
            "there is no such object: check the bucket and key".into(),
        ),
        (412, _) => (
            Kind::Replaced,
            "the object was replaced since it was mounted (its ETag changed); remount to \
             read the new one"
                .into(),
        ),
        (301 | 307 | 400, "PermanentRedirect" | "AuthorizationHeaderMalformed") => (
            Kind::WrongRegion,
            "the bucket is in another region: set AWS_REGION".into(),
        ),
        _ => (Kind::Other, String::new()),
    };
    Err(Failure::Final(
        kind,
        if hint.is_empty() {
            said
        } else {
            format!("{said}; {hint}")
        },
    ))
}

/// The bodies of the `<name>` elements of an XML document.
fn xml_elements<'a>(body: &'a str, name: &str) -> Vec<&'a str> {
    let (open, close) = (format!("<{name}>"), format!("</{name}>"));
    let mut out = Vec::new();
    let mut rest = body;
    while let Some(i) = rest.find(&open) {
        let after = &rest[i + open.len()..];
        let Some(j) = after.find(&close) else { break };
        out.push(&after[..j]);
        rest = &after[j + close.len()..];
    }
    out
}

/// XML's escapes undone (`&amp;`, `&lt;`, `&#38;`...).
fn xml_unescape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('&') {
        out.push_str(&rest[..i]);
        rest = &rest[i..];
        let Some(end) = rest.find(';') else { break };
        let entity = &rest[1..end];
        let c = match entity {
            "amp" => Some('&'),
            "lt" => Some('<'),
            "gt" => Some('>'),
            "quot" => Some('"'),
            "apos" => Some('\''),
            _ => entity
                .strip_prefix("#x")
                .and_then(|h| u32::from_str_radix(h, 16).ok())
                .or_else(|| entity.strip_prefix('#').and_then(|d| d.parse().ok()))
                .and_then(char::from_u32),
        };
        match c {
            Some(c) => {
                out.push(c);
                rest = &rest[end + 1..];
            }
            None => {
                out.push('&');
                rest = &rest[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// A query value percent-encoded as SigV4 wants: every byte but the unreserved ones.
fn query_encode(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for &b in v.as_bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The text of the first `<name>` element of an S3 error body.
fn xml_field(body: &str, name: &str) -> Option<String> {
    let open = format!("<{name}>");
    let start = body.find(&open)? + open.len();
    let end = body[start..].find("</")? + start;
    Some(body[start..end].trim().to_owned()).filter(|s| !s.is_empty())
}

/// 50 ms doubling to at most 5 s, with full jitter: clients that failed together do
/// not come back together.
fn backoff(attempt: u32) -> Duration {
    let cap = (50u64 << attempt.min(7)).min(5000);
    let noise = {
        let t = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos() as u64);
        let mut x = t ^ (std::process::id() as u64) << 32 ^ u64::from(attempt);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    Duration::from_millis(cap / 2 + noise % (cap / 2 + 1))
}

/// Seconds since the epoch of an HTTP date (`Wed, 25 Nov 2026 16:00:00 GMT`).
fn http_date(s: &str) -> Option<i64> {
    let mut f = s.split_whitespace().skip(1);
    let day: i64 = f.next()?.parse().ok()?;
    let months = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let name = f.next()?;
    let month = months.iter().position(|m| *m == name)? as i64 + 1;
    let year: i64 = f.next()?.parse().ok()?;
    let mut hms = f.next()?.split(':').map(|p| p.parse::<i64>().ok());
    let (h, m, sec) = (hms.next()??, hms.next()??, hms.next()??);
    // Days from 1970-01-01 to the date (the inverse of `sigv4::civil`).
    let y = year - i64::from(month <= 2);
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days * 86_400 + h * 3600 + m * 60 + sec)
}

/// The certificates to trust: `ca_bundle`, else `SSL_CERT_FILE`, else the system's
/// bundle where the distribution keeps it; `None` leaves Mozilla's roots.
fn roots(
    ca_bundle: Option<&PathBuf>,
) -> Result<Option<Vec<ureq::tls::Certificate<'static>>>, BundleError> {
    let env = std::env::var_os("SSL_CERT_FILE").map(PathBuf::from);
    let explicit = ca_bundle.cloned().or(env);
    let path = match &explicit {
        Some(p) => p.clone(),
        None => match [
            "/etc/ssl/certs/ca-certificates.crt",
            "/etc/pki/tls/certs/ca-bundle.crt",
            "/etc/ssl/ca-bundle.pem",
            "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem",
        ]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        {
            Some(p) => p,
            None => return Ok(None),
        },
    };
    let pem = std::fs::read(&path).map_err(|source| BundleError::Unreadable {
        path: path.clone(),
        source,
    })?;
    let certs: Vec<_> = ureq::tls::parse_pem(&pem)
        .filter_map(|item| match item {
            Ok(ureq::tls::PemItem::Certificate(c)) => Some(c),
            _ => None,
        })
        .collect();
    if certs.is_empty() {
        if explicit.is_some() {
            return Err(BundleError::Empty { path });
        }
        return Ok(None);
    }
    Ok(Some(certs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_dates() {
        assert_eq!(http_date("Thu, 01 Jan 1970 00:00:00 GMT"), Some(0));
        assert_eq!(
            http_date("Wed, 25 Nov 2026 16:00:01 GMT"),
            Some(1_795_622_401)
        );
        assert_eq!(
            http_date("Thu, 29 Feb 2024 12:00:00 GMT"),
            Some(1_709_208_000)
        );
        assert_eq!(http_date("garbage"), None);
    }

    #[test]
    fn error_bodies() {
        let body = "<?xml version=\"1.0\"?><Error><Code>NoSuchKey</Code>\
                    <Message>The specified key does not exist.</Message></Error>";
        assert_eq!(xml_field(body, "Code").as_deref(), Some("NoSuchKey"));
        assert_eq!(
            xml_field(body, "Message").as_deref(),
            Some("The specified key does not exist.")
        );
        assert_eq!(xml_field("<Error></Error>", "Code"), None);
        let list = "<ListBucketResult><Contents><Key>a&amp;b &#228;.tar</Key><Size>3</Size>\
                    </Contents><Contents><Key>c</Key><Size>0</Size></Contents></ListBucketResult>";
        let items = xml_elements(list, "Contents");
        assert_eq!(items.len(), 2);
        assert_eq!(
            xml_unescape(&xml_field(items[0], "Key").unwrap()),
            "a&b ä.tar"
        );
        assert_eq!(xml_unescape("x &bogus; &amp"), "x &bogus; &amp");
        assert_eq!(query_encode("a b/c~"), "a%20b%2Fc~");
    }

    fn target(signed: bool) -> Target {
        Target {
            url: "https://b.s3.example/k".into(),
            host: "b.s3.example".into(),
            path: "/k".into(),
            name: "s3://b/k".into(),
            endpoint: "https://s3.example".into(),
            signer: signed.then(|| {
                let keys = Credentials {
                    access_key: "AKID".into(),
                    secret_key: "secret".into(),
                    session_token: None,
                };
                (keys, "us-east-1".into())
            }),
            credentials_from: "the test".into(),
            budget: BUDGET,
        }
    }

    /// The kind `classify` gives an answer of `status` with S3's error `code`.
    fn kind_of(status: u16, code: Option<&str>, signed: bool) -> Kind {
        let body = code.map_or(String::new(), |c| {
            format!("<Error><Code>{c}</Code><Message>m</Message></Error>")
        });
        let mut resp = ureq::http::Response::builder()
            .status(status)
            .body(ureq::Body::builder().data(body))
            .unwrap();
        match classify(&target(signed), &Call::plain("GET"), &mut resp) {
            Err(Failure::Final(kind, _)) => kind,
            Err(Failure::Retry(why)) => panic!("{status} {code:?}: retried ({why})"),
            Ok(()) => panic!("{status} {code:?}: taken as an answer"),
        }
    }

    /// The error a failed request of `kind` becomes, whatever its message says: the
    /// message here claims the opposite of every kind.
    fn error_of(kind: Kind) -> Error {
        Error::from(RequestError {
            kind,
            what: Some("GET s3://b/k from https://s3.example".into()),
            why: "access denied; there is no such object".into(),
        })
    }

    #[test]
    fn statuses_become_kinds() {
        assert_eq!(kind_of(404, Some("NoSuchKey"), true), Kind::NoSuchKey);
        assert_eq!(kind_of(404, None, false), Kind::NoSuchKey);
        assert_eq!(kind_of(404, Some("NoSuchBucket"), true), Kind::NoSuchBucket);
        for code in [
            "AccessDenied",
            "SignatureDoesNotMatch",
            "InvalidAccessKeyId",
        ] {
            assert_eq!(kind_of(403, Some(code), true), Kind::Denied, "{code}");
        }
        assert_eq!(kind_of(403, Some("AccessDenied"), false), Kind::Denied);
        assert_eq!(
            kind_of(412, Some("PreconditionFailed"), true),
            Kind::Replaced
        );
        assert_eq!(
            kind_of(301, Some("PermanentRedirect"), true),
            Kind::WrongRegion
        );
        assert_eq!(
            kind_of(400, Some("AuthorizationHeaderMalformed"), true),
            Kind::WrongRegion
        );
        assert_eq!(kind_of(400, Some("InvalidArgument"), true), Kind::Other);
        assert_eq!(kind_of(405, None, true), Kind::Other);
    }

    #[test]
    fn kinds_become_errors_by_kind_not_message() {
        assert!(matches!(error_of(Kind::NoSuchKey), Error::Absent(_)));
        assert!(matches!(error_of(Kind::NoSuchBucket), Error::Absent(_)));
        assert!(matches!(error_of(Kind::Denied), Error::Denied(_)));
        for kind in [
            Kind::Replaced,
            Kind::WrongRegion,
            Kind::NoRanges,
            Kind::Untrusted,
            Kind::GaveUp,
            Kind::Malformed,
            Kind::Local,
            Kind::Other,
        ] {
            assert!(matches!(error_of(kind), Error::Remote(_)), "{kind:?}");
        }
        // The errno a read through the mount gets, and what Python raises.
        assert_eq!(error_of(Kind::NoSuchKey).errno(), libc::ENOENT);
        assert_eq!(error_of(Kind::Denied).errno(), libc::EACCES);
        assert_eq!(error_of(Kind::GaveUp).errno(), libc::EIO);
    }

    #[test]
    fn messages_say_what_was_asked_and_why() {
        let e = error_of(Kind::Other);
        assert_eq!(
            e.to_string(),
            "GET s3://b/k from https://s3.example: access denied; there is no such object"
        );
        let listing = RequestError {
            kind: Kind::Malformed,
            what: None,
            why: "the listing of s3://b/ is malformed".into(),
        };
        assert_eq!(listing.to_string(), "the listing of s3://b/ is malformed");
    }

    #[test]
    fn backoff_grows_and_is_capped() {
        for a in 1..20 {
            let d = backoff(a);
            let cap = (50u64 << a.min(7)).min(5000);
            assert!(d >= Duration::from_millis(cap / 2), "{a}: {d:?}");
            assert!(d <= Duration::from_millis(cap), "{a}: {d:?}");
        }
    }
}
