//! Archives in object storage over the networks users have: HTTPS with a site's own CA,
//! an object store that sheds load with 503s, the credentials file LUMI's `lumio-conf`
//! writes, and jobs that end in every way while a node-local copy of the object is held.
//! A real S3 server (SeaweedFS, tests/common/s3.rs), with a forwarding proxy in front
//! where the network needs to misbehave (tests/common/proxy.rs); trees are compared with
//! their source.

use crate::common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::proxy::{Proxy, ProxyOptions, TestCa};
use common::s3::S3Server;
use common::tree::CompareOpts;
use common::*;

/// How long anything that should happen at once may take on a busy machine.
const DEADLINE: u64 = 60;

/// What the log says once the whole object is copied to the node (the server also logs
/// "N0% copied to this node" on the way).
const COPIED: &str = ": copied to this node, ";

/// `archfs ARGS` with the server's environment and `extra` over it.
fn archfs_with(s3: &S3Server, args: &[&str], extra: &[(&str, &str)]) -> std::process::Output {
    let mut cmd = archfs();
    s3.apply_env(&mut cmd).args(args);
    for (k, v) in extra {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

/// The one line of a failed command's stderr, checked to be one line.
fn one_line_error(out: &std::process::Output, what: &str) -> String {
    assert!(!out.status.success(), "{what}: succeeded");
    let err = stderr_of(out);
    assert_eq!(err.trim().lines().count(), 1, "{what}: one line, got {err}");
    err.trim().to_owned()
}

/// A test CA made in `dir`, and a proxy serving `s3` over TLS with its certificate.
fn tls_proxy(s3: &S3Server, dir: &TempDir) -> (TestCa, Proxy) {
    let ca = TestCa::new(&dir.join("ca"));
    let proxy = Proxy::start(
        &s3.endpoint(),
        &ProxyOptions {
            tls: Some((ca.cert.clone(), ca.key.clone())),
            ..ProxyOptions::default()
        },
    );
    (ca, proxy)
}

/// An S3 endpoint behind TLS with a certificate from a CA made for the test: trusted
/// through AWS_CA_BUNDLE (or SSL_CERT_FILE, or the profile's `ca_bundle`); without it,
/// refused in one line that names the certificate, well within the deadline.
#[test]
fn https_with_a_test_ca_from_aws_ca_bundle() {
    let dir = TempDir::new("net-tls");
    let src = small_awkward_tree(&dir);
    let img = dir.join("img.sqfs");
    mksquashfs(&src, &img, &["-comp", "zstd"]);
    let s3 = S3Server::start();
    s3.create_bucket("data");
    s3.put("data", "img.sqfs", &img);
    let (ca, proxy) = tls_proxy(&s3, &dir);
    let https = proxy.endpoint();
    assert!(https.starts_with("https://127.0.0.1:"), "{https}");
    let ca_pem = ca.ca.display().to_string();
    let url = "s3://data/img.sqfs";

    let mnt = dir.join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let mut cmd = archfs();
    s3.apply_env(&mut cmd)
        .env("AWS_ENDPOINT_URL", &https)
        .env("AWS_CA_BUNDLE", &ca.ca)
        .env_remove("SSL_CERT_FILE")
        .env("XDG_CACHE_HOME", dir.join("cache"))
        .arg("mount")
        .arg(url)
        .arg(&mnt);
    run_ok(&mut cmd);
    let m = Mount { path: mnt };
    common::suite::check_mount(
        &src,
        &m.path,
        &CompareOpts::default(),
        "SquashFS over HTTPS",
    );
    drop(m);
    assert!(
        proxy.count("fwd") > 0 && proxy.count("tls-fail") == 0,
        "not served through the TLS proxy:\n{}",
        proxy.log()
    );

    // The same CA from SSL_CERT_FILE, and from the profile's ca_bundle.
    let want = std::fs::read(src.join("files/rand_262145")).unwrap();
    let conf = dir.join("aws-config");
    std::fs::write(&conf, format!("[default]\nca_bundle = {ca_pem}\n")).unwrap();
    let conf = conf.display().to_string();
    for (how, extra) in [
        ("SSL_CERT_FILE", vec![("SSL_CERT_FILE", ca_pem.as_str())]),
        ("ca_bundle", vec![("AWS_CONFIG_FILE", conf.as_str())]),
    ] {
        let mut extra = extra;
        extra.push(("AWS_ENDPOINT_URL", &https));
        let out = archfs_with(&s3, &["cat", url, "files/rand_262145"], &extra);
        assert!(out.status.success(), "{how}: {}", stderr_of(&out));
        assert_eq!(out.stdout, want, "{how}");
    }

    // Without the CA: refused, in one line that names the certificate, not after a hang.
    let failed_handshakes = proxy.count("tls-fail");
    let t = Instant::now();
    let mut cmd = archfs();
    s3.apply_env(&mut cmd)
        .env("AWS_ENDPOINT_URL", &https)
        .env_remove("SSL_CERT_FILE")
        .arg("mount")
        .arg(url)
        .arg(dir.join("mnt2"));
    let out = cmd.output().unwrap();
    let took = t.elapsed();
    let err = one_line_error(&out, "mount without the CA");
    eprintln!("refused after {:.1} s: {err}", took.as_secs_f64());
    assert!(err.to_lowercase().contains("certificate"), "{err}");
    assert!(err.contains(url) && err.contains(&https), "{err}");
    assert!(took < Duration::from_secs(DEADLINE), "{took:?}");
    assert!(!is_mounted(&dir.join("mnt2")));
    // The proxy notes the refused handshake on its own thread, maybe after archfs exits.
    assert!(
        wait_for(30, || proxy.count("tls-fail") > failed_handshakes),
        "no refused handshake:\n{}",
        proxy.log()
    );
}

/// A certificate that does not verify will not verify on the next attempt either: the
/// error should come after one handshake and say where to give the CA.
#[test]
fn an_untrusted_certificate_fails_at_once_and_says_what_to_do() {
    let dir = TempDir::new("net-tls-once");
    let s3 = S3Server::start();
    s3.create_bucket("data");
    s3.put_bytes("data", "x.tar", &[0u8; 10240]);
    let (_ca, proxy) = tls_proxy(&s3, &dir);
    let t = Instant::now();
    let mut cmd = archfs();
    s3.apply_env(&mut cmd)
        .env("AWS_ENDPOINT_URL", proxy.endpoint())
        .env_remove("SSL_CERT_FILE")
        .args(["info", "s3://data/x.tar"]);
    let out = cmd.output().unwrap();
    let err = one_line_error(&out, "info without the CA");
    let took = t.elapsed();
    assert!(err.contains("AWS_CA_BUNDLE"), "{err}");
    // The proxy logs the refused handshake on its own time.
    wait_for(30, || proxy.count("tls-fail") > 0);
    assert_eq!(
        proxy.count("tls-fail"),
        1,
        "after {:.1} s: {err}\n{}",
        took.as_secs_f64(),
        proxy.log()
    );
}

/// Files of every size from empty to a few MiB in nested directories, seeded.
fn random_tree(root: &Path, seed: u64, files: usize) {
    let mut bytes = xorshift_bytes(seed);
    for i in 0..files {
        let d = root.join(format!("d{}/e{}", i % 7, i % 3));
        std::fs::create_dir_all(&d).unwrap();
        let size = match i % 50 {
            0 => 0,
            1 => (3 << 20) + i * 7,
            _ => (i * 7919) % (300 << 10),
        };
        std::fs::write(d.join(format!("f{i:04}.bin")), bytes(size)).unwrap();
    }
}

/// Reads every file under MNT in shuffled order with four threads and compares it with
/// the same file under REF; the listings must match too. Prints the number of files.
const SHUFFLED_READ: &str = r#"
import os, random, sys, threading
mnt, ref, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
def walk(root):
    return sorted(os.path.relpath(os.path.join(d, f), root)
                  for d, _, fs in os.walk(root) for f in fs)
names = walk(ref)
got = walk(mnt)
if got != names:
    sys.exit(f"listing differs: {len(got)} names, {len(names)} expected")
random.Random(seed).shuffle(names)
bad = []
def read(part):
    for n in part:
        try:
            with open(os.path.join(mnt, n), "rb") as a, open(os.path.join(ref, n), "rb") as b:
                if a.read() != b.read():
                    bad.append(f"{n}: other bytes")
        except OSError as e:
            bad.append(f"{n}: {e}")
threads = [threading.Thread(target=read, args=(names[i::4],)) for i in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
if bad:
    sys.exit(f"{len(bad)} files wrong: {bad[:5]}")
print(len(names))
"#;

/// 30% of the GETs answered `503 SlowDown` (never more than twice in a row for one
/// range, as a store that sheds load does): a tar and a SquashFS, copied to the node
/// or read by ranged GETs only (`--preload=never`), give every byte of every file, read
/// in shuffled order by parallel readers.
#[test]
fn reads_retry_through_503_slowdown() {
    let dir = TempDir::new("net-503");
    let src = dir.join("src");
    random_tree(&src, 503, 240);
    let tar = dir.join("data.tar");
    tar_of(&src, ".", &tar);
    let img = dir.join("data.sqfs");
    mksquashfs(&src, &img, &["-comp", "gzip"]);
    let script = dir.join("read.py");
    std::fs::write(&script, SHUFFLED_READ).unwrap();
    let s3 = S3Server::start();
    s3.create_bucket("data");
    s3.put("data", "data.tar", &tar);
    s3.put("data", "data.sqfs", &img);
    let proxy = Proxy::start(
        &s3.endpoint(),
        &ProxyOptions {
            fail_rate: 0.3,
            ..ProxyOptions::default()
        },
    );
    let mut seed = 0;
    for key in ["data.tar", "data.sqfs"] {
        for opts in [&[][..], &["--preload=never"]] {
            let what = format!("{key} {}", opts.join(" "));
            let (before, sent) = (proxy.count("503"), proxy.count("fwd GET"));
            let mnt = dir.join("mnt");
            std::fs::create_dir_all(&mnt).unwrap();
            let mut cmd = archfs();
            s3.apply_env(&mut cmd)
                .env("AWS_ENDPOINT_URL", proxy.endpoint())
                .env("XDG_CACHE_HOME", dir.join("cache"))
                .arg("mount")
                .arg(format!("s3://data/{key}"))
                .arg(&mnt)
                .args(opts);
            run_ok(&mut cmd);
            let m = Mount { path: mnt };
            seed += 1;
            let out = Command::new(common::user::PYTHON)
                .arg(&script)
                .arg(&m.path)
                .arg(&src)
                .arg(seed.to_string())
                .output()
                .unwrap();
            assert!(out.status.success(), "{what}: {}", stderr_of(&out));
            assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "240", "{what}");
            drop(m);
            let refused = proxy.count("503") - before;
            eprintln!(
                "{what}: {refused} of {} GETs answered 503",
                refused + proxy.count("fwd GET") - sent
            );
            if opts.contains(&"--preload=never") {
                // Hundreds of ranged GETs, each refused with a chance of 0.3: some were.
                assert!(refused > 0, "{what}: no 503 sent:\n{}", proxy.log());
            }
        }
    }
    assert!(proxy.count("503") > 0);
    assert_eq!(proxy.count("upstream-fail"), 0, "{}", proxy.log());
}

/// `archfs` with no AWS_* variable of the machine's or the harness's, HOME at `home`
/// and `vars` set: credentials and endpoint come from ~/.aws only.
fn archfs_from_home(home: &Path, vars: &[(&str, &str)]) -> Command {
    let mut cmd = archfs();
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("AWS_") {
            cmd.env_remove(k);
        }
    }
    cmd.env("HOME", home)
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .env("XDG_CACHE_HOME", home.join("cache"))
        .envs(vars.iter().copied());
    cmd
}

/// The name in a line of `archfs ls`: `MODE NLINK UID GID SIZE MTIME NAME[ -> TARGET]`.
fn listed_name(line: &str) -> String {
    let mut rest = line;
    for _ in 0..6 {
        rest = rest.trim_start();
        rest = &rest[rest.find(' ').unwrap_or(rest.len())..];
    }
    let name = &rest[1.min(rest.len())..];
    if line.starts_with('l') {
        name.rsplit_once(" -> ").map_or(name, |(n, _)| n).to_owned()
    } else {
        name.to_owned()
    }
}

/// What `lumio-conf` (LUMI-O-tools, internal/toolConfig/aws_util.go) leaves in ~/.aws: the
/// project's profile in `credentials` with go-ini's aligned keys, also copied to
/// [default] with `original_name`, and a `[services NAME]` block with the endpoint
/// appended to `config`.
fn lumio_conf(home: &Path, profile: &str, project: &str, secret: &str, endpoint: &str) {
    let aws = home.join(".aws");
    std::fs::create_dir_all(&aws).unwrap();
    let keys = format!(
        "aws_access_key_id     = {}\naws_secret_access_key = {secret}\n\
         services              = {profile}\nproject_id            = {project}\n",
        common::s3::ACCESS_KEY
    );
    std::fs::write(
        aws.join("credentials"),
        format!("[{profile}]\n{keys}\n[default]\n{keys}original_name         = {profile}\n\n"),
    )
    .unwrap();
    std::fs::write(
        aws.join("config"),
        format!(
            "[services {profile}]\ns3           = \n  endpoint_url = {endpoint}\n  \
             multipart_chunksize = 15\n"
        ),
    )
    .unwrap();
}

/// A named profile and its endpoint as LUMI's `lumio-conf` writes them: `archfs ls` and a
/// mount find both with AWS_PROFILE (and without, from [default]); a wrong secret in the
/// file gives one line that names the profile and the file, never the secret.
#[test]
fn a_lumio_conf_profile_gives_keys_and_endpoint() {
    let dir = TempDir::new("net-lumio");
    let src = small_awkward_tree(&dir);
    let tar = dir.join("x.tar");
    tar_of(&src, ".", &tar);
    let ex = dir.join("extracted");
    extract(&tar, &ex);
    let s3 = S3Server::start();
    s3.create_bucket("data");
    s3.put("data", "x.tar", &tar);
    let home = dir.join("home");
    let profile = "lumi-465000000";
    lumio_conf(
        &home,
        profile,
        "465000000",
        common::s3::SECRET_KEY,
        &s3.endpoint(),
    );
    let url = "s3://data/x.tar";
    let mut top: Vec<String> = std::fs::read_dir(&ex)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    top.sort();
    for vars in [&[("AWS_PROFILE", profile)][..], &[]] {
        let out = run_ok(archfs_from_home(&home, vars).args(["ls", url, "/"]));
        let mut listed: Vec<String> = String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(listed_name)
            .collect();
        listed.sort();
        assert_eq!(listed, top, "archfs ls with {vars:?}");
    }
    let mnt = dir.join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    run_ok(
        archfs_from_home(&home, &[("AWS_PROFILE", profile)])
            .arg("mount")
            .arg(url)
            .arg(&mnt),
    );
    let m = Mount { path: mnt };
    common::suite::check_mount(&ex, &m.path, &CompareOpts::default(), "lumio-conf profile");
    drop(m);

    let wrong = "wr0ng/SECRET+lumio0123456789abcdefghij";
    lumio_conf(&home, profile, "465000000", wrong, &s3.endpoint());
    let out = archfs_from_home(&home, &[("AWS_PROFILE", profile)])
        .args(["info", url])
        .output()
        .unwrap();
    let err = one_line_error(&out, "a wrong secret");
    let creds = home.join(".aws/credentials");
    for want in [
        "secret key does not match".to_owned(),
        format!("profile {profile} in {}", creds.display()),
        format!("(services {profile})"),
    ] {
        assert!(err.contains(&want), "{err:?} lacks {want:?}");
    }
    assert!(
        !err.contains(wrong) && !err.contains(common::s3::SECRET_KEY),
        "{err}"
    );
}

/// A filesystem of its own for `--stage-dir`: ext4 in an image on a loop device, so its
/// free space moves only with what archfs writes there. Unmounted on drop.
struct ScratchFs {
    root: std::path::PathBuf,
    /// The directory given to --stage-dir, owned by the user who runs archfs.
    dir: std::path::PathBuf,
}

impl ScratchFs {
    fn new(at: &Path, who: common::user::Who) -> ScratchFs {
        let img = at.with_extension("img");
        // Room for a copy and the GiB archfs leaves free; sparse, so it costs little.
        std::fs::File::create(&img)
            .unwrap()
            .set_len(2 << 30)
            .unwrap();
        run_ok(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&img));
        std::fs::create_dir_all(at).unwrap();
        run_ok(Command::new("mount").args(["-o", "loop"]).arg(&img).arg(at));
        let dir = at.join("stage");
        std::fs::create_dir(&dir).unwrap();
        if let common::user::Who::User { uid, gid } = who {
            std::os::unix::fs::chown(&dir, Some(uid), Some(gid)).unwrap();
        }
        ScratchFs {
            root: at.to_owned(),
            dir,
        }
    }

    /// statvfs's free bytes for unprivileged users.
    fn free(&self) -> u64 {
        use std::os::unix::ffi::OsStrExt;
        let c = std::ffi::CString::new(self.dir.as_os_str().as_bytes()).unwrap();
        // SAFETY: a zeroed struct statvfs is valid; statvfs writes into it, given a
        // valid C string.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut st) }, 0);
        st.f_bavail as u64 * st.f_frsize as u64
    }

    /// Processes holding a file in the stage directory open: (pid, link).
    fn holders(&self) -> Vec<(i32, String)> {
        let dir = self.dir.display().to_string();
        open_files(|link| link.starts_with(&dir))
    }
}

impl Drop for ScratchFs {
    fn drop(&mut self) {
        let ok = Command::new("umount")
            .arg(&self.root)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            let _ = Command::new("umount").arg("-l").arg(&self.root).status();
        }
    }
}

/// Open descriptors of every process whose target `keep` selects: (pid, target).
fn open_files(keep: impl Fn(&str) -> bool) -> Vec<(i32, String)> {
    let mut out = Vec::new();
    for (pid, _) in processes() {
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if let Ok(link) = std::fs::read_link(fd.path()) {
                let link = link.display().to_string();
                if keep(&link) {
                    out.push((pid, link));
                }
            }
        }
    }
    out
}

/// archfs processes (the run, server, watchdog or lister) of the mount on `mnt`.
fn archfs_pids(mnt: &Path) -> Vec<i32> {
    let mnt = mnt.as_os_str().as_encoded_bytes();
    processes()
        .into_iter()
        .filter(|(_, args)| {
            args.first().is_some_and(|a| a.ends_with(b"archfs")) && args.iter().any(|a| a == mnt)
        })
        .map(|(pid, _)| pid)
        .collect()
}

/// The job under `archfs run`: reads every file of REF through MNT and compares, keeps
/// a file open and starts a "DataLoader worker" in a session of its own that holds
/// another open and outlives it, logs `read N`, then ends as HOW says: `exit0` once a
/// file `go` is beside LOG, `wait` when a signal ends it.
const JOB_PY: &str = r#"
import os, subprocess, sys, time
mnt, ref, log, how = sys.argv[1:5]
def record(line):
    with open(log, "a") as f:
        f.write(line + "\n")
record("pid %d" % os.getpid())
names = sorted(os.path.relpath(os.path.join(d, f), ref) for d, _, fs in os.walk(ref) for f in fs)
for n in names:
    with open(os.path.join(mnt, n), "rb") as a, open(os.path.join(ref, n), "rb") as b:
        assert a.read() == b.read(), n
held = open(os.path.join(mnt, "sub/big.bin"), "rb")
held.read(1)
worker = subprocess.Popen(
    [sys.executable, "-c", "import sys,time; f=open(sys.argv[1],'rb'); f.read(1); "
     "print('holding', flush=True); time.sleep(3600)", os.path.join(mnt, "hello.txt")],
    stdout=subprocess.PIPE, start_new_session=True)
assert worker.stdout.readline() == b"holding\n"
record("worker %d" % worker.pid)
record("read %d" % len(names))
if how == "exit0":
    while not os.path.exists(os.path.join(os.path.dirname(log), "go")):
        time.sleep(0.05)
    sys.exit(0)
while True:
    time.sleep(3600)
"#;

/// A rank of a DDP job: waits for the shared mount, reads every file of REF through MNT
/// and compares, logs `NAME read N`, and sleeps until killed.
const RANK_PY: &str = r#"
import os, sys, time
mnt, ref, log, name = sys.argv[1:5]
while not os.path.exists(os.path.join(mnt, "hello.txt")):
    time.sleep(0.05)
names = sorted(os.path.relpath(os.path.join(d, f), ref) for d, _, fs in os.walk(ref) for f in fs)
for n in names:
    with open(os.path.join(mnt, n), "rb") as a, open(os.path.join(ref, n), "rb") as b:
        assert a.read() == b.read(), n
with open(log, "a") as f:
    f.write("%s read %d\n" % (name, len(names)))
time.sleep(3600)
"#;

/// How a job under `archfs run` ends.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Ending {
    /// The command exits 0.
    Exit,
    /// SIGTERM to `archfs run`, which passes it on.
    TermRun,
    /// SIGTERM to the whole process group, as SLURM signals a job step.
    TermGroup,
    /// SIGINT to `archfs run`, which passes it on.
    IntRun,
    /// SIGKILL to `archfs run`, the server of the mount.
    KillServer,
}

/// Runs its closure on drop while the thread panics: what a failed assertion would leave
/// running (a job that sleeps for an hour, a rank that holds a shared mount) is killed.
struct OnPanic<F: FnMut()>(F);

impl<F: FnMut()> Drop for OnPanic<F> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            (self.0)();
        }
    }
}

/// Waits up to [`DEADLINE`] for the child to exit.
fn wait_child(child: &mut std::process::Child, what: &str) -> std::process::ExitStatus {
    let end = Instant::now() + Duration::from_secs(DEADLINE);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(Instant::now() < end, "{what}: did not end");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Life-cycle endings of jobs on an s3:// tar, with the node-local copy in memory (or, in
/// a memory cgroup too small for it, in --stage-dir): however the job ends, the mount,
/// every archfs process and the copy are gone, and the stage directory's space is back.
/// Then `--shared`: two ranks, one server, the mount gone with the last rank.
fn remote_endings(who: common::user::Who) {
    use common::user::{MemoryCgroup, Stage, Who, PYTHON};
    let stage = Stage::new(&format!("net-life-{}", who.name()), who);
    let name = who.name();
    let reference = stage.dir.join("ref");
    std::fs::create_dir_all(reference.join("sub")).unwrap();
    std::fs::write(reference.join("hello.txt"), b"hello archfs\n").unwrap();
    let mut bytes = xorshift_bytes(30);
    std::fs::write(reference.join("sub/big.bin"), bytes(1 << 20)).unwrap();
    for i in 0..24 {
        std::fs::write(
            reference.join(format!("f{i:02}")),
            bytes((100 << 10) + i * 4099),
        )
        .unwrap();
    }
    let files = 26;
    let tar = stage.dir.join("job.tar");
    tar_of(&reference, ".", &tar);
    let job_py = stage.dir.join("job.py");
    std::fs::write(&job_py, JOB_PY).unwrap();
    let rank_py = stage.dir.join("rank.py");
    std::fs::write(&rank_py, RANK_PY).unwrap();
    let s3 = S3Server::start();
    s3.create_bucket("data");
    s3.put("data", "job.tar", &tar);
    // For the memory cgroup: the same files and 100 MiB more, which cannot be copied
    // into memory under a 128 MiB limit (a copy goes to memory only below 3/4 of what the
    // cgroup leaves free, src/source/remote/stage.rs).
    const BIG: u64 = 100 << 20;
    const LIMIT: u64 = 128 << 20;
    if who == Who::Root {
        let big_src = stage.dir.join("big-src");
        run_ok(Command::new("cp").arg("-a").arg(&reference).arg(&big_src));
        std::fs::File::create(big_src.join("pad.bin"))
            .unwrap()
            .set_len(BIG)
            .unwrap();
        let big = stage.dir.join("big.tar");
        tar_of(&big_src, ".", &big);
        s3.put("data", "big.tar", &big);
    }
    run_ok(
        Command::new("chmod")
            .args(["-R", "a+rX"])
            .arg(stage.dir.path()),
    );
    let fs = ScratchFs::new(&stage.dir.join("scratch"), who);
    let mnt = stage.work.join("mnt");
    let log = stage.work.join("job.log");
    let log_lines = || std::fs::read_to_string(&log).unwrap_or_default();
    let logged_pid = |key: &str| -> Option<i32> {
        log_lines()
            .lines()
            .find_map(|l| l.strip_prefix(key)?.trim().parse().ok())
    };
    let reap = || {
        for key in ["worker ", "pid "] {
            if let Some(pid) = logged_pid(key) {
                // SAFETY: kill has no memory preconditions.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    };
    // Everything gone: mount, processes, copy, its space.
    let all_gone = |what: &str, free_before: u64, t: Instant| {
        assert!(
            wait_for(DEADLINE, || !is_mounted(&mnt)),
            "{name}: {what}: still mounted"
        );
        eprintln!(
            "{name}: {what}: mount gone after {:.3} s",
            t.elapsed().as_secs_f64()
        );
        assert!(
            wait_for(DEADLINE, || archfs_pids(&mnt).is_empty()),
            "{name}: {what}: archfs processes left: {:?}",
            archfs_pids(&mnt)
        );
        assert!(
            wait_for(DEADLINE, || fs.holders().is_empty()),
            "{name}: {what}: the copy is still open: {:?}",
            fs.holders()
        );
        // The copy's blocks are freed once its last descriptor closes.
        assert!(
            wait_for(DEADLINE, || fs.free() + (1 << 20) >= free_before),
            "{name}: {what}: {} bytes of the stage directory not freed",
            free_before.saturating_sub(fs.free())
        );
        let left: Vec<_> = std::fs::read_dir(&fs.dir).unwrap().flatten().collect();
        assert!(
            left.is_empty(),
            "{name}: {what}: left in --stage-dir: {left:?}"
        );
    };

    let cases = [
        (Ending::Exit, false),
        (Ending::TermRun, false),
        (Ending::TermGroup, false),
        (Ending::IntRun, false),
        (Ending::KillServer, who == Who::Root),
    ];
    for (ending, in_cgroup) in cases {
        let what = format!(
            "{ending:?}{}",
            if in_cgroup { " in a memory cgroup" } else { "" }
        );
        let _ = std::fs::remove_file(&log);
        let _ = std::fs::remove_file(stage.work.join("go"));
        let free_before = fs.free();
        let key = if in_cgroup { "big.tar" } else { "job.tar" };
        let cgroup = in_cgroup.then(|| MemoryCgroup::new("net-stage", LIMIT));
        // In the cgroup from its first instruction: a shell that waits to be moved, then
        // execs archfs.
        let mut cmd = if in_cgroup {
            let mut c = stage.command("sh");
            c.args(["-c", "read _ && exec \"$@\" </dev/null", "sh"])
                .arg(&stage.bin)
                .stdin(std::process::Stdio::piped());
            c
        } else {
            let mut c = stage.archfs();
            c.stdin(std::process::Stdio::null());
            c
        };
        let err_path = stage.work.join("run.err");
        let how = if ending == Ending::Exit {
            "exit0"
        } else {
            "wait"
        };
        s3.apply_env(&mut cmd)
            .env("ARCHFS_LOG", "info")
            .env("XDG_CACHE_HOME", &stage.work)
            .args(["run", "--preload=always", &format!("s3://data/{key}")])
            .arg(&mnt)
            .arg("--stage-dir")
            .arg(&fs.dir)
            .args(["--", PYTHON])
            .arg(&job_py)
            .arg(&mnt)
            .arg(&reference)
            .arg(&log)
            .arg(how)
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&err_path).unwrap());
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let mut run = cmd.spawn().unwrap();
        let pid = run.id() as i32;
        let _cleanup = OnPanic(|| {
            // SAFETY: kill has no memory preconditions; the group is the run's own.
            unsafe { libc::kill(-pid, libc::SIGKILL) };
            reap();
        });
        if let Some(cg) = &cgroup {
            cg.add(pid);
            use std::io::Write;
            run.stdin.take().unwrap().write_all(b"go\n").unwrap();
        }
        let stderr = || std::fs::read_to_string(&err_path).unwrap_or_default();
        let ready = wait_for(DEADLINE, || {
            log_lines().contains("read ") || run.try_wait().unwrap().is_some()
        });
        assert!(
            ready && log_lines().contains(&format!("read {files}\n")),
            "{name}: {what}: the job did not read the tree: {}\n{}",
            log_lines(),
            stderr()
        );
        assert!(
            wait_for(DEADLINE, || stderr().contains(COPIED)),
            "{name}: {what}: no node-local copy: {}",
            stderr()
        );
        let copies = open_files(|l| l.contains("archfs-stage"))
            .into_iter()
            .filter(|(p, _)| *p == pid)
            .map(|(_, l)| l)
            .collect::<Vec<_>>();
        if in_cgroup {
            let on_disk = fs.holders();
            assert!(
                on_disk.iter().any(|(p, _)| *p == pid),
                "{name}: {what}: the copy is not in --stage-dir: {copies:?}"
            );
            let used = free_before.saturating_sub(fs.free());
            assert!(
                used >= BIG,
                "{name}: {what}: {used} bytes used in --stage-dir, not the copy's {BIG}"
            );
        } else {
            assert!(
                copies.iter().any(|l| l.starts_with("/memfd:archfs-stage")),
                "{name}: {what}: the copy is not in memory: {copies:?}"
            );
        }
        let running = archfs_pids(&mnt);
        assert!(
            running.contains(&pid) && !watchdog_pids(&mnt).is_empty(),
            "{name}: {what}: run {pid} and a watchdog should serve {mnt:?}: {running:?}"
        );
        let t = Instant::now();
        match ending {
            Ending::Exit => std::fs::write(stage.work.join("go"), b"").unwrap(),
            Ending::TermGroup => {
                // SAFETY: kill has no memory preconditions; the group is the run's own.
                assert_eq!(unsafe { libc::kill(-pid, libc::SIGTERM) }, 0);
            }
            Ending::TermRun => kill(pid, libc::SIGTERM),
            Ending::IntRun => kill(pid, libc::SIGINT),
            Ending::KillServer => kill(pid, libc::SIGKILL),
        }
        let status = wait_child(&mut run, &what);
        use std::os::unix::process::ExitStatusExt;
        let expected = match ending {
            Ending::Exit => status.code() == Some(0),
            Ending::TermRun | Ending::TermGroup => status.code() == Some(128 + libc::SIGTERM),
            Ending::IntRun => status.code() == Some(128 + libc::SIGINT),
            Ending::KillServer => status.signal() == Some(libc::SIGKILL),
        };
        assert!(expected, "{name}: {what}: {status}\n{}", stderr());
        all_gone(&what, free_before, t);
        reap();
        if let Some(cg) = &cgroup {
            assert_eq!(cg.oom_kills(), 0, "{name}: {what}: the OOM killer ran");
        }
    }

    // --shared: two ranks mount the same object on the same mount point.
    let free_before = fs.free();
    let ranks: Vec<_> = ["rank0", "rank1"]
        .iter()
        .map(|r| {
            stage
                .command(PYTHON)
                .arg(&rank_py)
                .arg(&mnt)
                .arg(&reference)
                .arg(&log)
                .arg(r)
                .spawn()
                .unwrap()
        })
        .collect();
    let rank_pids: Vec<i32> = ranks.iter().map(|r| r.id() as i32).collect();
    let _cleanup = OnPanic(|| {
        for &pid in &rank_pids {
            // SAFETY: kill has no memory preconditions.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    });
    let shared_log = stage.work.join("shared.log");
    let mounts: Vec<_> = ranks
        .iter()
        .map(|rank| {
            let mut cmd = stage.archfs();
            s3.apply_env(&mut cmd)
                .env("XDG_CACHE_HOME", &stage.work)
                .env("ARCHFS_LOG", "info")
                .args(["mount", "--shared", "--preload=always"])
                .args(["--exit-with", &rank.id().to_string()])
                .arg("--log")
                .arg(&shared_log)
                .arg("--stage-dir")
                .arg(&fs.dir)
                .arg("s3://data/job.tar")
                .arg(&mnt)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for m in mounts {
        let out = m.wait_with_output().unwrap();
        assert!(out.status.success(), "{name}: shared: {}", stderr_of(&out));
    }
    let servers = pids_of_mount(&mnt);
    assert_eq!(servers.len(), 1, "{name}: shared: one server: {servers:?}");
    for r in ["rank0", "rank1"] {
        let line = format!("{r} read {files}");
        assert!(
            wait_for(DEADLINE, || log_lines().contains(&line)),
            "{name}: shared: {r} did not read the tree: {}",
            log_lines()
        );
    }
    let copied = || std::fs::read_to_string(&shared_log).unwrap_or_default();
    assert!(
        wait_for(DEADLINE, || copied().contains(COPIED)),
        "{name}: shared: no node-local copy: {}",
        copied()
    );
    let copies = open_files(|l| l.starts_with("/memfd:archfs-stage"));
    assert!(
        copies.iter().any(|(p, _)| *p == servers[0]),
        "{name}: shared: the server holds no copy: {copies:?}"
    );
    let registry = mnt.parent().unwrap().join(format!(
        ".{}.archfs-shared",
        mnt.file_name().unwrap().to_string_lossy()
    ));
    let users = || {
        std::fs::read_dir(&registry)
            .map(|d| d.flatten().filter(|e| e.file_name() != "lock").count())
            .unwrap_or(0)
    };
    assert_eq!(users(), 2, "{name}: shared: two ranks registered");
    let mut ranks = ranks.into_iter();
    let mut first = ranks.next().unwrap();
    first.kill().unwrap();
    first.wait().unwrap();
    // The server has seen the rank go: the mount stays for the other.
    assert!(
        wait_for(DEADLINE, || users() == 1),
        "{name}: shared: the dead rank is still registered"
    );
    assert!(is_mounted(&mnt), "{name}: shared: gone with one rank left");
    assert_eq!(pids_of_mount(&mnt), servers, "{name}: shared");
    let out = stage
        .command("cat")
        .arg(mnt.join("hello.txt"))
        .output()
        .unwrap();
    assert_eq!(out.stdout, b"hello archfs\n", "{name}: {}", stderr_of(&out));
    let mut second = ranks.next().unwrap();
    let t = Instant::now();
    second.kill().unwrap();
    second.wait().unwrap();
    all_gone("shared, both ranks gone", free_before, t);
}

#[test]
fn remote_endings_as_root() {
    remote_endings(common::user::Who::Root);
}

#[test]
fn remote_endings_as_an_ordinary_user() {
    remote_endings(common::user::Who::user());
}
