//! A forwarding proxy in front of the S3 test server ([`super::s3::S3Server`]), run by the
//! S3 venv's Python from tests/common/proxy.py: it terminates TLS with a test CA's
//! certificate ([`TestCa`]) and/or answers a share of GETs with `503 SlowDown`, and logs
//! every request, so a test can count what it did. The Host header goes upstream as the
//! client signed it (the proxy's address), and SeaweedFS verifies the signature with it.

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{run_ok, TempDir};

const SCRIPT: &str = include_str!("proxy.py");
/// How long `drop` waits after SIGTERM before SIGKILL.
const TERM_GRACE: Duration = Duration::from_secs(2);

/// What the proxy does besides forwarding.
#[derive(Clone, Debug, Default)]
pub struct ProxyOptions {
    /// Serve HTTPS with this certificate and key.
    pub tls: Option<(PathBuf, PathBuf)>,
    /// The share of GETs answered `503 SlowDown`.
    pub fail_rate: f64,
    /// The most 503s in a row for one path and range (default 2).
    pub max_run: Option<u32>,
}

/// A running proxy, stopped on drop.
pub struct Proxy {
    child: Option<Child>,
    port: u16,
    tls: bool,
    dir: TempDir,
}

impl Proxy {
    /// Starts a proxy to `upstream` (`http://127.0.0.1:PORT`), listening once this
    /// returns.
    pub fn start(upstream: &str, options: &ProxyOptions) -> Proxy {
        let port: u16 = upstream
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse().ok())
            .unwrap_or_else(|| panic!("no port in {upstream}"));
        let dir = TempDir::new("proxy");
        std::fs::write(dir.join("proxy.py"), SCRIPT).unwrap();
        let mut cmd = Command::new(super::s3::venv_python());
        cmd.arg("-I")
            .arg(dir.join("proxy.py"))
            .arg(port.to_string())
            .arg(dir.join("requests.log"))
            .arg(format!("--fail-rate={}", options.fail_rate))
            .arg(format!("--max-run={}", options.max_run.unwrap_or(2)));
        if let Some((cert, key)) = &options.tls {
            cmd.arg("--tls").arg(cert).arg(key);
        }
        let stderr = std::fs::File::create(dir.join("stderr.log")).unwrap();
        let mut child = cmd
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run the proxy: {e}"));
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let port = line
            .trim()
            .strip_prefix("listening ")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| {
                panic!(
                    "the proxy did not start: {line:?}\n{}",
                    std::fs::read_to_string(dir.join("stderr.log")).unwrap_or_default()
                )
            });
        Proxy {
            child: Some(child),
            port,
            tls: options.tls.is_some(),
            dir,
        }
    }

    /// `http://127.0.0.1:PORT`, or `https://` with TLS.
    pub fn endpoint(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    /// The request log: one line per request (see tests/common/proxy.py).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("requests.log")).unwrap_or_default()
    }

    /// Lines of the request log that start with `what` (`503`, `fwd`, `tls-fail`).
    pub fn count(&self, what: &str) -> usize {
        let prefix = format!("{what} ");
        self.log()
            .lines()
            .filter(|l| l.starts_with(&prefix))
            .count()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let pgid = child.id() as i32;
        // SAFETY: kill has no memory preconditions; ESRCH (group gone) is fine.
        unsafe { libc::kill(-pgid, libc::SIGTERM) };
        let end = Instant::now() + TERM_GRACE;
        while Instant::now() < end {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // SAFETY: as above.
        unsafe { libc::kill(-pgid, libc::SIGKILL) };
        let _ = child.wait();
    }
}

/// A throwaway certificate authority and a server certificate it signed for 127.0.0.1
/// and localhost, made by the `openssl` command line (scripts/setup installs it).
pub struct TestCa {
    /// The CA's certificate: what AWS_CA_BUNDLE names.
    pub ca: PathBuf,
    /// The server's certificate and key.
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TestCa {
    pub fn new(dir: &Path) -> TestCa {
        std::fs::create_dir_all(dir).unwrap();
        let p = |name: &str| dir.join(name);
        let openssl = || {
            let mut c = Command::new("openssl");
            c.current_dir(dir);
            c
        };
        run_ok(openssl().args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=archfs test CA",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
        ]));
        run_ok(openssl().args([
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-subj",
            "/CN=localhost",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
        ]));
        std::fs::write(
            p("server.ext"),
            "basicConstraints=critical,CA:FALSE\n\
             keyUsage=critical,digitalSignature\n\
             extendedKeyUsage=serverAuth\n\
             subjectAltName=IP:127.0.0.1,DNS:localhost\n",
        )
        .unwrap();
        run_ok(openssl().args([
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "server.ext",
            "-out",
            "server.pem",
        ]));
        TestCa {
            ca: p("ca.pem"),
            cert: p("server.pem"),
            key: p("server.key"),
        }
    }
}
