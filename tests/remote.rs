//! Archives in object storage: a real S3 server (SeaweedFS, tests/common/s3.rs) holds
//! archives uploaded with boto3, archfs mounts them by `s3://` URL with credentials and
//! endpoint from the environment, and the tree is compared with the source or with what
//! `tar -x` extracts from the same archive.

use crate::common;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::s3::{S3Server, PUBLIC_BUCKET};
use common::tree::CompareOpts;
use common::*;

/// `archfs mount URL MNT` with the server's environment, unmounted on drop.
fn mount(s3: &S3Server, cache: &Path, url: &str, mnt: &Path, args: &[&str]) -> Mount {
    std::fs::create_dir_all(mnt).unwrap();
    let mut cmd = archfs();
    s3.apply_env(&mut cmd)
        .env("XDG_CACHE_HOME", cache)
        .arg("mount")
        .arg(url)
        .arg(mnt)
        .args(args);
    run_ok(&mut cmd);
    assert!(is_mounted(mnt), "{url}: not mounted on {mnt:?}");
    Mount {
        path: mnt.to_owned(),
    }
}

/// An inspection command on a URL with the server's environment and `extra` over it.
fn inspect(s3: &S3Server, args: &[&str], extra: &[(&str, &str)]) -> std::process::Output {
    let mut cmd = archfs();
    s3.apply_env(&mut cmd).args(args);
    for (k, v) in extra {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

#[test]
fn squashfs_and_tars_from_s3_equal_their_source() {
    let dir = TempDir::new("remote-formats");
    let src = small_awkward_tree(&dir);
    let s3 = S3Server::start();
    s3.create_bucket("data");
    let cache = dir.join("cache");

    let img = dir.join("img.sqfs");
    mksquashfs(&src, &img, &["-comp", "zstd"]);
    s3.put("data", "sets/img.sqfs", &img);
    let m = mount(
        &s3,
        &cache,
        "s3://data/sets/img.sqfs",
        &dir.join("mnt-sqfs"),
        &[],
    );
    common::suite::check_mount(&src, &m.path, &CompareOpts::default(), "SquashFS from S3");
    drop(m);

    let tar = dir.join("data.tar");
    tar_of(&src, ".", &tar);
    let ex = dir.join("extracted");
    extract(&tar, &ex);
    let gz = dir.join("data.tar.gz");
    run_ok(Command::new("sh").arg("-c").arg(format!(
        "gzip -c < {} > {}",
        tar.display(),
        gz.display()
    )));
    for (key, file) in [("data.tar", &tar), ("data.tar.gz", &gz)] {
        s3.put("data", key, file);
        let url = format!("s3://data/{key}");
        for pass in ["first mount", "saved index"] {
            let m = mount(&s3, &cache, &url, &dir.join("mnt-tar"), &[]);
            common::suite::check_mount(
                &ex,
                &m.path,
                &CompareOpts::default(),
                &format!("{url}, {pass}"),
            );
        }
        // The index of an object is kept in the cache directory, never beside it.
        let saved: Vec<PathBuf> = std::fs::read_dir(cache.join("archfs"))
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .collect();
        assert!(
            saved.iter().any(|p| p.to_string_lossy().contains(key)),
            "{url}: no index saved in {saved:?}"
        );
    }

    // The inspection commands take URLs too.
    let out = inspect(
        &s3,
        &["cat", "s3://data/sets/img.sqfs", "files/rand_3145728"],
        &[],
    );
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert_eq!(
        out.stdout,
        std::fs::read(src.join("files/rand_3145728")).unwrap()
    );
    let out = inspect(&s3, &["check", "s3://data/data.tar.gz"], &[]);
    assert!(out.status.success(), "{}", stderr_of(&out));
}

#[test]
fn errors_name_the_object_and_what_to_do() {
    let dir = TempDir::new("remote-errors");
    let s3 = S3Server::start();
    s3.create_bucket("data");
    s3.put_bytes("data", "x.tar", &[0u8; 10240]);
    let fails = |args: &[&str], extra: &[(&str, &str)], wants: &[&str]| {
        let out = inspect(&s3, args, extra);
        let err = stderr_of(&out);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert_eq!(
            err.trim().lines().count(),
            1,
            "{args:?}: one line, got {err}"
        );
        for w in wants {
            assert!(err.contains(w), "{args:?}: {err:?} lacks {w:?}");
        }
        assert!(
            !err.contains(common::s3::SECRET_KEY),
            "{args:?} shows the secret: {err}"
        );
        err
    };
    fails(
        &["info", "s3://data/absent.sqfs"],
        &[],
        &["s3://data/absent.sqfs", "no such object"],
    );
    fails(
        &["info", "s3://nobucket/x.tar"],
        &[],
        &["s3://nobucket/x.tar", "no such bucket"],
    );
    fails(
        &["info", "s3://data/x.tar"],
        &[(
            "AWS_SECRET_ACCESS_KEY",
            "wrong/secret+0123456789abcdefghijklmnop",
        )],
        &["secret key does not match", "environment"],
    );
    fails(
        &["info", "s3://data/x.tar"],
        &[("AWS_ACCESS_KEY_ID", "AKIAUNKNOWN000000000")],
        &["access key is unknown", &s3.endpoint()],
    );
    fails(&["info", "s3:///x.tar"], &[], &["names no bucket"]);
    fails(
        &["ls", "s3://nobucket/shards/"],
        &[],
        &["s3://nobucket/shards/", "no such bucket"],
    );
    // Nothing listens there: the retries end, with the endpoint named.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let endpoint = format!("http://127.0.0.1:{closed}");
    fails(
        &["info", "s3://data/x.tar"],
        &[("AWS_ENDPOINT_URL", &endpoint)],
        &[&endpoint, "gave up after"],
    );
    drop(dir);
}

#[test]
fn a_public_bucket_reads_without_credentials() {
    let dir = TempDir::new("remote-public");
    let src = small_awkward_tree(&dir);
    let tar = dir.join("p.tar");
    tar_of(&src, ".", &tar);
    let s3 = S3Server::start();
    s3.create_bucket(PUBLIC_BUCKET);
    s3.put(PUBLIC_BUCKET, "p.tar", &tar);
    let url = format!("s3://{PUBLIC_BUCKET}/p.tar");
    let none = [("AWS_ACCESS_KEY_ID", ""), ("AWS_SECRET_ACCESS_KEY", "")];
    let out = inspect(
        &s3,
        &["cat", &url, "files/rand_262145", "--no-sign-request"],
        &none,
    );
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert_eq!(
        out.stdout,
        std::fs::read(src.join("files/rand_262145")).unwrap()
    );
    // The same object over plain HTTP, path-style, without any AWS configuration.
    let http = format!("{}/{PUBLIC_BUCKET}/p.tar", s3.endpoint());
    let out = Command::new(archfs_bin())
        .args(["cat", &http, "files/rand_262145"])
        .env("XDG_CACHE_HOME", dir.join("cache"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert_eq!(
        out.stdout,
        std::fs::read(src.join("files/rand_262145")).unwrap()
    );
}

#[test]
fn an_object_replaced_under_a_mount_gives_eio_never_new_bytes() {
    let dir = TempDir::new("remote-replaced");
    let old = dir.join("old");
    let new = dir.join("new");
    for (root, seed) in [(&old, 1u64), (&new, 2)] {
        std::fs::create_dir_all(root).unwrap();
        let mut bytes = xorshift_bytes(seed);
        // Members of 5 MiB: the index scan jumps from header to header and fetches
        // little of their data, so most of it is read only after the object changed.
        for i in 0..8 {
            std::fs::write(root.join(format!("f{i}")), bytes(5 << 20)).unwrap();
        }
    }
    let (old_tar, new_tar) = (dir.join("old.tar"), dir.join("new.tar"));
    tar_of(&old, ".", &old_tar);
    tar_of(&new, ".", &new_tar);
    let s3 = S3Server::start();
    s3.create_bucket("data");
    s3.put("data", "d.tar", &old_tar);
    let m = mount(
        &s3,
        &dir.join("cache"),
        "s3://data/d.tar",
        &dir.join("mnt"),
        &["--preload=never"],
    );
    assert_eq!(
        std::fs::read(m.path.join("f0")).unwrap(),
        std::fs::read(old.join("f0")).unwrap()
    );
    s3.put("data", "d.tar", &new_tar);
    // Same layout, other bytes: every read not yet served fails rather than mixing.
    let f = std::fs::File::open(m.path.join("f5")).unwrap();
    let mut buf = vec![0u8; 200 << 10];
    let err = f.read_exact_at(&mut buf, 2 << 20).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
}

#[test]
fn the_node_local_copy_serves_every_read_once_made() {
    let dir = TempDir::new("remote-stage");
    let src = small_awkward_tree(&dir);
    let tar = dir.join("s.tar");
    tar_of(&src, ".", &tar);
    let ex = dir.join("extracted");
    extract(&tar, &ex);
    let img = dir.join("s.sqfs");
    mksquashfs(&src, &img, &[]);
    let mut s3 = S3Server::start();
    s3.create_bucket("data");
    s3.put("data", "s.tar", &tar);
    s3.put("data", "s.sqfs", &img);
    let cache = dir.join("cache");
    let mut mounts = Vec::new();
    for (key, reference) in [("s.tar", &ex), ("s.sqfs", &src)] {
        let log = dir.join(format!("{key}.log"));
        let mnt = dir.join(format!("mnt-{key}"));
        std::fs::create_dir_all(&mnt).unwrap();
        let mut cmd = archfs();
        s3.apply_env(&mut cmd)
            .env("XDG_CACHE_HOME", &cache)
            .env("ARCHFS_LOG", "info")
            .args(["mount", "--preload=always", &format!("s3://data/{key}")])
            .arg(&mnt)
            .arg("--log")
            .arg(&log);
        run_ok(&mut cmd);
        let m = Mount { path: mnt };
        let copied = wait_for(120, || {
            std::fs::read_to_string(&log).is_ok_and(|t| t.contains(": copied to this node, "))
        });
        assert!(
            copied,
            "{key}: no copy within 120 s: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        mounts.push((m, reference.clone(), key));
    }
    // With the server gone, every byte comes from the copies.
    s3.stop();
    for (m, reference, key) in &mounts {
        common::suite::check_mount(reference, &m.path, &CompareOpts::default(), key);
    }
}

/// A job as users run it: `archfs run s3://... -- python3 train.py`, as root and as an
/// ordinary user; the object store restarts mid-epoch and the epoch goes on; when the
/// command ends the mount and the server are gone.
#[test]
fn a_python_job_reads_through_a_server_restart_as_root_and_as_a_user() {
    use common::user::{Stage, Who, PYTHON};
    for who in [Who::Root, Who::user()] {
        let stage = Stage::new(&format!("remote-job-{}", who.name()), who);
        let reference = stage.dir.join("ref");
        std::fs::create_dir(&reference).unwrap();
        let mut bytes = xorshift_bytes(7);
        for i in 0..40 {
            std::fs::write(
                reference.join(format!("f{i:02}")),
                bytes((150 << 10) + i * 999),
            )
            .unwrap();
        }
        let tar = stage.dir.join("job.tar");
        tar_of(&reference, ".", &tar);
        run_ok(
            Command::new("chmod")
                .args(["-R", "a+rX"])
                .arg(stage.dir.path()),
        );
        let mut s3 = S3Server::start();
        s3.create_bucket("data");
        s3.put("data", "job.tar", &tar);
        // Reads half the files, says so, waits for the go, reads the rest; every byte
        // is compared with the reference.
        let script = r#"
import os, sys, time
mnt, ref, work = sys.argv[1:4]
names = sorted(os.listdir(ref))
def check(n):
    with open(os.path.join(mnt, n), 'rb') as a, open(os.path.join(ref, n), 'rb') as b:
        assert a.read() == b.read(), n
for n in names[:20]:
    check(n)
open(os.path.join(work, 'half'), 'w').close()
while not os.path.exists(os.path.join(work, 'go')):
    time.sleep(0.05)
for n in names[20:]:
    check(n)
print('read', len(names))
"#;
        let mnt = stage.work.join("mnt");
        let mut cmd = stage.archfs();
        s3.apply_env(&mut cmd)
            .env("XDG_CACHE_HOME", &stage.work)
            .env("ARCHFS_LOG", "warn,archfs::source::remote::http=debug")
            .args(["run", "s3://data/job.tar"])
            .arg(&mnt)
            .args(["--preload=never", "--", PYTHON, "-c", script])
            .arg(&mnt)
            .arg(&reference)
            .arg(&stage.work)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        let child = cmd.spawn().unwrap();
        let half = stage.work.join("half");
        assert!(
            wait_for(120, || half.exists()),
            "{}: no half epoch",
            who.name()
        );
        // The rest of the epoch starts while the server is going down: its reads are
        // refused until it is back, and retried.
        let go = stage.work.join("go");
        let later = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(500));
            std::fs::write(go, b"").unwrap();
        });
        s3.restart();
        later.join().unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}: {}\n{}",
            who.name(),
            String::from_utf8_lossy(&out.stdout),
            stderr_of(&out)
        );
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "read 40");
        eprintln!(
            "{}: {} retries",
            who.name(),
            stderr_of(&out).matches("retrying").count()
        );
        assert!(!is_mounted(&mnt), "{}: still mounted", who.name());
        let mnt_arg = mnt.as_os_str().as_encoded_bytes();
        assert!(
            wait_for(30, || pids_with_args(&[mnt_arg]).is_empty()),
            "{}: processes of the mount left",
            who.name()
        );
    }
}

/// `s3://BUCKET/PREFIX/` stands for the archives directly under the prefix, in name
/// order, as a local directory of shards does: the union equals the shards' files
/// together; deeper "folders" and index sidecars are left out.
#[test]
fn a_prefix_is_the_union_of_the_archives_directly_under_it() {
    let dir = TempDir::new("remote-prefix");
    let s3 = S3Server::start();
    s3.create_bucket("data");
    let all = dir.join("all");
    let mut bytes = xorshift_bytes(11);
    for shard in 0..3 {
        let root = dir.join(format!("shard{shard}"));
        for i in 0..5 {
            let name = format!("{:06}.jpg", shard * 5 + i);
            for into in [&root, &all] {
                std::fs::create_dir_all(into).unwrap();
            }
            let data = bytes(3000 + shard * 1000 + i * 77);
            write_twice(&root, &all, &name, &data);
        }
        let tar = dir.join(format!("shard-{shard}.tar"));
        tar_of(&root, ".", &tar);
        s3.put("data", &format!("shards/shard-{shard}.tar"), &tar);
    }
    // One shard as a SquashFS image: a union mixes formats.
    let extra = dir.join("extra");
    std::fs::create_dir_all(&extra).unwrap();
    std::fs::write(extra.join("labels.txt"), b"cat\ndog\n").unwrap();
    std::fs::write(all.join("labels.txt"), b"cat\ndog\n").unwrap();
    let img = dir.join("extra.sqfs");
    mksquashfs(&extra, &img, &["-all-root"]);
    s3.put("data", "shards/zz-extra.sqfs", &img);
    // Not part of the union: a deeper folder, a sidecar, a folder marker.
    s3.put("data", "shards/deeper/other.tar", &dir.join("shard-0.tar"));
    s3.put_bytes("data", "shards/shard-0.tar.archfs-index", b"not an index");
    s3.put_bytes("data", "shards/", b"");

    let m = mount(
        &s3,
        &dir.join("cache"),
        "s3://data/shards/",
        &dir.join("mnt"),
        &[],
    );
    let opts = CompareOpts {
        root_attrs: false,
        ..CompareOpts::default()
    };
    common::suite::check_mount(&all, &m.path, &opts, "s3://data/shards/");
    drop(m);

    let out = inspect(&s3, &["ls", "s3://data/shards/"], &[]);
    assert!(out.status.success(), "{}", stderr_of(&out));
    let listing = String::from_utf8_lossy(&out.stdout);
    assert_eq!(listing.lines().count(), 16, "{listing}");
    assert!(listing.contains("000014.jpg") && listing.contains("labels.txt"));

    let out = inspect(&s3, &["ls", "s3://data/nothing-here/"], &[]);
    assert!(!out.status.success());
    let err = stderr_of(&out);
    assert!(
        err.contains("no objects directly under s3://data/nothing-here/"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

/// `archfs index s3://...` stores the index beside the archive as KEY.archfs-index;
/// a mount on another node (an empty cache) fetches it instead of scanning; once the
/// archive is replaced the sidecar no longer matches and the mount scans the new one.
#[test]
fn a_sidecar_index_is_written_once_and_used_by_every_later_mount() {
    let dir = TempDir::new("remote-sidecar");
    let s3 = S3Server::start();
    s3.create_bucket("data");
    let src = small_awkward_tree(&dir);
    let tar = dir.join("d.tar");
    tar_of(&src, ".", &tar);
    let ex = dir.join("ex");
    extract(&tar, &ex);
    s3.put("data", "sets/d.tar", &tar);

    let writer_cache = dir.join("writer-cache");
    let out = inspect(
        &s3,
        &["index", "s3://data/sets/d.tar"],
        &[("XDG_CACHE_HOME", writer_cache.to_str().unwrap())],
    );
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("s3://data/sets/d.tar.archfs-index"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let (size, _) = s3.head("data", "sets/d.tar.archfs-index");
    assert!(size > 100, "sidecar of {size} bytes");

    // Another node: nothing cached; the log says where the index came from.
    let mount_logged = |cache: &Path, log: &Path| {
        let mnt = dir.join("mnt");
        std::fs::create_dir_all(&mnt).unwrap();
        let mut cmd = archfs();
        s3.apply_env(&mut cmd)
            .env("XDG_CACHE_HOME", cache)
            .env("ARCHFS_LOG", "info")
            .args(["mount", "s3://data/sets/d.tar"])
            .arg(&mnt)
            .args(["--preload=never", "--log"])
            .arg(log);
        run_ok(&mut cmd);
        Mount { path: mnt }
    };
    let log = dir.join("node2.log");
    let m = mount_logged(&dir.join("node2-cache"), &log);
    common::suite::check_mount(&ex, &m.path, &CompareOpts::default(), "with the sidecar");
    drop(m);
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("fetched the index"), "{text}");
    assert!(
        !text.contains("indexed "),
        "scanned despite the sidecar: {text}"
    );

    // The archive replaced: the sidecar is out of date, the new archive is scanned.
    std::fs::write(src.join("new-file"), b"added later").unwrap();
    tar_of(&src, ".", &tar);
    let ex2 = dir.join("ex2");
    extract(&tar, &ex2);
    s3.put("data", "sets/d.tar", &tar);
    let log = dir.join("node3.log");
    let m = mount_logged(&dir.join("node3-cache"), &log);
    common::suite::check_mount(&ex2, &m.path, &CompareOpts::default(), "stale sidecar");
    drop(m);
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("out of date") && text.contains("indexed "),
        "{text}"
    );

    // A SquashFS image needs none.
    let img = dir.join("i.sqfs");
    mksquashfs(&src, &img, &[]);
    s3.put("data", "i.sqfs", &img);
    let out = inspect(&s3, &["index", "s3://data/i.sqfs"], &[]);
    assert!(!out.status.success());
    assert!(
        stderr_of(&out).contains("needs no index"),
        "{}",
        stderr_of(&out)
    );
}

/// The object store gone for good mid-epoch: reads that need it fail with EIO once the
/// retry budget (--retry-for) is spent, never hang, whether the server stalls (stopped
/// with SIGSTOP: connections open, no answer) or is gone (connections refused); then
/// the mount unmounts cleanly.
#[test]
fn a_server_gone_mid_epoch_gives_eio_within_the_retry_budget() {
    let dir = TempDir::new("remote-gone");
    let root = dir.join("root");
    std::fs::create_dir_all(&root).unwrap();
    let mut bytes = xorshift_bytes(5);
    // Members of 5 MiB: past the first 16 MiB (fetched ahead by the index scan) the scan
    // jumps from header to header, so their data is fetched only when read.
    for i in 0..6 {
        std::fs::write(root.join(format!("f{i}")), bytes(5 << 20)).unwrap();
    }
    let tar = dir.join("g.tar");
    tar_of(&root, ".", &tar);
    let mut s3 = S3Server::start();
    s3.create_bucket("data");
    s3.put("data", "g.tar", &tar);
    let m = mount(
        &s3,
        &dir.join("cache"),
        "s3://data/g.tar",
        &dir.join("mnt"),
        &["--preload=never", "--retry-for=4"],
    );
    assert_eq!(
        std::fs::read(m.path.join("f0")).unwrap(),
        std::fs::read(root.join("f0")).unwrap()
    );
    let read_fails = |name: &str| {
        let started = std::time::Instant::now();
        let f = std::fs::File::open(m.path.join(name)).unwrap();
        let mut buf = vec![0u8; 200 << 10];
        match f.read_exact_at(&mut buf, 2 << 20) {
            Ok(()) => panic!("{name}: read with the server gone"),
            Err(e) => assert_eq!(e.raw_os_error(), Some(libc::EIO), "{name}: {e}"),
        }
        started.elapsed()
    };
    let pid = s3.pid().unwrap();
    // SAFETY: signals to the server's process group, started by this test.
    assert_eq!(unsafe { libc::kill(-pid, libc::SIGSTOP) }, 0);
    let stalled = read_fails("f4");
    assert_eq!(unsafe { libc::kill(-pid, libc::SIGCONT) }, 0);
    s3.stop();
    let refused = read_fails("f5");
    eprintln!("EIO after {stalled:?} (stalled), {refused:?} (refused)");
    // 4 s of budget; the rest is slack for a busy machine, far below a hang.
    for took in [stalled, refused] {
        assert!(took.as_secs() < 40, "EIO only after {took:?}");
    }
    let mnt = m.path.clone();
    drop(m);
    assert!(!is_mounted(&mnt));
    let arg = mnt.as_os_str().as_encoded_bytes();
    assert!(wait_for(30, || pids_with_args(&[arg]).is_empty()));
}

/// A large file read through, with no node-local copy: the object store sees a request
/// per couple of MiB (the stream is fetched ahead of itself), not one per FUSE read of
/// 128 KiB; and the bytes are right.
#[test]
fn a_large_file_read_through_costs_few_requests() {
    let dir = TempDir::new("remote-stream");
    let root = dir.join("root");
    std::fs::create_dir_all(&root).unwrap();
    let size = 40 << 20;
    std::fs::write(root.join("big"), xorshift_bytes(9)(size)).unwrap();
    let tar = dir.join("b.tar");
    tar_of(&root, ".", &tar);
    let img = dir.join("b.sqfs");
    mksquashfs(&root, &img, &["-noD"]);
    let s3 = S3Server::start();
    s3.create_bucket("data");
    s3.put("data", "b.tar", &tar);
    s3.put("data", "b.sqfs", &img);
    for key in ["b.tar", "b.sqfs"] {
        let log = dir.join(format!("{key}.log"));
        let mnt = dir.join(format!("mnt-{key}"));
        std::fs::create_dir_all(&mnt).unwrap();
        let mut cmd = archfs();
        s3.apply_env(&mut cmd)
            .env("XDG_CACHE_HOME", dir.join("cache"))
            .env("ARCHFS_LOG", "info")
            .args(["mount", &format!("s3://data/{key}")])
            .arg(&mnt)
            .args(["--preload=never", "--log"])
            .arg(&log);
        run_ok(&mut cmd);
        let m = Mount { path: mnt };
        assert!(
            std::fs::read(m.path.join("big")).unwrap() == std::fs::read(root.join("big")).unwrap()
        );
        drop(m);
        let text = std::fs::read_to_string(&log).unwrap();
        let requests: u64 = text
            .split("object storage: ")
            .nth(1)
            .and_then(|t| t.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{key}: no request count in {text}"));
        eprintln!("{key}: {requests} requests for {} MiB", size >> 20);
        // One per FUSE read would be 320.
        assert!(requests <= 80, "{key}: {requests} requests");
    }
}

/// A cold read of a file of a few hundred KiB, with no node-local copy, is one GET of
/// the file's bytes, however many 128 KiB reads the kernel splits it into: a tar member
/// and a SquashFS file's blocks alike. (Before: a GET per FUSE read, and a small tail
/// across a 128 KiB boundary two GETs of whole chunks.)
#[test]
fn a_cold_file_is_one_get_of_its_bytes() {
    let dir = TempDir::new("remote-onefile");
    let root = dir.join("root");
    std::fs::create_dir_all(&root).unwrap();
    let mut bytes = xorshift_bytes(21);
    let n = 40;
    let mut total = 0;
    for i in 0..n {
        // 90 KB to 441 KB: one to four reads of 128 KiB.
        let len = 90_000 + i * 9_001;
        std::fs::write(root.join(format!("f{i:02}.jpg")), bytes(len)).unwrap();
        total += len;
    }
    let tar = dir.join("f.tar");
    tar_of(&root, ".", &tar);
    let img = dir.join("f.sqfs");
    mksquashfs(&root, &img, &["-noD", "-no-fragments"]);
    let s3 = S3Server::start();
    s3.create_bucket("data");
    s3.put("data", "f.tar", &tar);
    s3.put("data", "f.sqfs", &img);
    let cache = dir.join("cache");
    for key in ["f.tar", "f.sqfs"] {
        let url = format!("s3://data/{key}");
        let mnt = dir.join(format!("mnt-{key}"));
        // The tar's first mount builds and saves its index; the second finds it.
        drop(mount(&s3, &cache, &url, &mnt, &["--preload=never"]));
        let log = dir.join(format!("{key}.log"));
        let mut cmd = archfs();
        s3.apply_env(&mut cmd)
            .env("XDG_CACHE_HOME", &cache)
            .env("ARCHFS_LOG", "info,archfs::source::remote::http=trace")
            .args(["mount", &url])
            .arg(&mnt)
            .args(["--preload=never", "--prelist=never", "--log"])
            .arg(&log);
        run_ok(&mut cmd);
        let m = Mount { path: mnt };
        // A shuffled order (17 is prime to 40).
        for i in (0..n).map(|k| k * 17 % n) {
            let name = format!("f{i:02}.jpg");
            assert!(
                std::fs::read(m.path.join(&name)).unwrap()
                    == std::fs::read(root.join(&name)).unwrap(),
                "{key}: {name} differs"
            );
        }
        drop(m);
        let text = std::fs::read_to_string(&log).unwrap();
        // Every ranged GET but the first one of the object (its size and first 8 KiB).
        let spans: Vec<(u64, u64)> = text
            .split("(bytes=")
            .skip(1)
            .filter_map(|r| {
                let (a, b) = r.split(')').next()?.split_once('-')?;
                Some((a.parse().ok()?, b.parse().ok()?))
            })
            .filter(|&(a, _)| a != 0)
            .collect();
        let fetched: u64 = spans.iter().map(|(a, b)| b + 1 - a).sum();
        eprintln!(
            "{key}: {} GETs, {fetched} bytes for {n} files of {total} bytes",
            spans.len()
        );
        // One a file, and one for an image's tables.
        assert!(
            spans.len() <= n + 1,
            "{key}: {} GETs: {spans:?}",
            spans.len()
        );
        assert!(
            fetched <= total as u64 + (total as u64) / 10 + (1 << 20),
            "{key}: fetched {fetched} bytes for {total}"
        );
    }
}

/// The first mount of a tar (no index anywhere) scans it while the node-local copy is
/// made: the scan reads the copy's bytes as they land, so the object is fetched about
/// once in all, not once for the scan and once for the copy.
#[test]
fn a_first_mount_fetches_the_archive_about_once() {
    let dir = TempDir::new("remote-once");
    let root = dir.join("root");
    std::fs::create_dir_all(&root).unwrap();
    let mut bytes = xorshift_bytes(13);
    for i in 0..1500 {
        let sub = root.join(format!("c{}", i % 10));
        std::fs::create_dir_all(&sub).unwrap();
        std::fs::write(sub.join(format!("{i:05}.jpg")), bytes(60_000 + i * 37)).unwrap();
    }
    let tar = dir.join("once.tar");
    tar_of(&root, ".", &tar);
    let size = std::fs::metadata(&tar).unwrap().len();
    let s3 = S3Server::start();
    s3.create_bucket("data");
    s3.put("data", "once.tar", &tar);
    let log = dir.join("once.log");
    let mnt = dir.join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let mut cmd = archfs();
    s3.apply_env(&mut cmd)
        .env("XDG_CACHE_HOME", dir.join("cache"))
        .env("ARCHFS_LOG", "info,archfs::source::remote::http=trace")
        .args(["mount", "s3://data/once.tar"])
        .arg(&mnt)
        .arg("--log")
        .arg(&log);
    run_ok(&mut cmd);
    let m = Mount { path: mnt };
    // The copy starts once reads show an epoch (`auto`): the first files are fetched by
    // their readers, the rest come from the copy.
    let ex = dir.join("ex");
    extract(&tar, &ex);
    common::suite::check_mount(&ex, &m.path, &CompareOpts::default(), "first mount");
    assert!(wait_for(120, || std::fs::read_to_string(&log)
        .is_ok_and(|t| t.contains(": copied to this node, "))));
    drop(m);
    let text = std::fs::read_to_string(&log).unwrap();
    let fetched: f64 = text
        .split("requests, ")
        .nth(1)
        .and_then(|t| t.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no byte count in {text}"));
    let ratio = fetched * 1e6 / size as f64;
    eprintln!("fetched {fetched} MB of a {size}-byte object: {ratio:.2}x");
    if ratio >= 1.25 {
        // Which requests: the copy's 4 MiB pieces, or the scan's and the readers' own.
        let mut sizes = std::collections::BTreeMap::<u64, (u32, u64)>::new();
        for range in text.split("(bytes=").skip(1) {
            let span = range.split(')').next().unwrap_or("");
            if let Some((a, b)) = span.split_once('-') {
                let (a, b): (u64, u64) = (a.parse().unwrap_or(0), b.parse().unwrap_or(0));
                let e = sizes.entry(b + 1 - a).or_default();
                e.0 += 1;
                e.1 += b + 1 - a;
            }
        }
        panic!("fetched {ratio:.2}x the object; requests by size: {sizes:?}");
    }
}

/// A prefix with more objects than one page of a listing (S3 sends 1,000 keys a page):
/// every page is read, and the union has a file from each of the 1,005 shards.
#[test]
fn a_prefix_of_more_than_a_page_of_objects_is_listed_whole() {
    let dir = TempDir::new("remote-pages");
    let shards = dir.join("shards");
    std::fs::create_dir_all(&shards).unwrap();
    // Shards as WebDataset writes them: Python's tarfile, one sample each.
    let script = r#"
import io, sys, tarfile
for i in range(1005):
    with tarfile.open(f"{sys.argv[1]}/shard-{i:04d}.tar", "w") as t:
        data = f"sample {i}\n".encode()
        info = tarfile.TarInfo(f"{i:06d}.cls")
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
"#;
    run_ok(Command::new("python3").args(["-c", script]).arg(&shards));
    let s3 = S3Server::start();
    s3.create_bucket("data");
    s3.put_dir("data", "many/", &shards);
    let out = inspect(
        &s3,
        &["ls", "s3://data/many/"],
        &[("XDG_CACHE_HOME", dir.join("cache").to_str().unwrap())],
    );
    assert!(out.status.success(), "{}", stderr_of(&out));
    let listing = String::from_utf8_lossy(&out.stdout);
    assert_eq!(listing.lines().count(), 1005, "{listing}");
    assert!(listing.contains("001004.cls") && listing.contains("000000.cls"));
    let out = inspect(
        &s3,
        &["cat", "s3://data/many/", "001004.cls"],
        &[("XDG_CACHE_HOME", dir.join("cache").to_str().unwrap())],
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "sample 1004\n");
}

/// A web server that ignores ranges (Python's http.server answers every GET with the
/// whole file) is named for what it lacks, at once, in one line.
#[test]
fn a_server_without_ranges_is_refused_with_one_line() {
    use std::io::BufRead;
    let dir = TempDir::new("remote-norange");
    let www = dir.join("www");
    std::fs::create_dir_all(&www).unwrap();
    std::fs::write(www.join("x.tar"), vec![0u8; 10240]).unwrap();
    let mut server = Command::new("python3")
        .args(["-u", "-m", "http.server", "0", "--bind", "127.0.0.1"])
        .current_dir(&www)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(server.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    // "Serving HTTP on 127.0.0.1 port 40123 (http://127.0.0.1:40123/) ..."
    let port = line
        .split(" port ")
        .nth(1)
        .and_then(|t| t.split(' ').next())
        .unwrap_or_else(|| panic!("no port in {line:?}"));
    let url = format!("http://127.0.0.1:{port}/x.tar");
    let out = Command::new(archfs_bin())
        .args(["info", &url])
        .env("XDG_CACHE_HOME", dir.join("cache"))
        .output()
        .unwrap();
    let _ = server.kill();
    let _ = server.wait();
    assert!(!out.status.success());
    let err = stderr_of(&out);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains(&url) && err.contains("does not serve parts of objects"),
        "{err}"
    );
}

/// The shards of a union are copied to the node together once the mount's reads show an
/// epoch (128 files of any of them), not each after 128 reads of its own: here no shard
/// has that many files.
/// `data` as `name` in a shard's tree and in the tree of all shards, with one time: written
/// a moment apart, one run in 16 crossed a second.
fn write_twice(shard: &Path, all: &Path, name: &str, data: &[u8]) {
    std::fs::write(shard.join(name), data).unwrap();
    let when = std::fs::metadata(shard.join(name))
        .unwrap()
        .modified()
        .unwrap();
    let copy = std::fs::File::create(all.join(name)).unwrap();
    std::io::Write::write_all(&mut &copy, data).unwrap();
    copy.set_modified(when).unwrap();
}

#[test]
fn a_unions_shards_are_copied_together_once_reads_show_an_epoch() {
    let dir = TempDir::new("remote-epoch");
    let s3 = S3Server::start();
    s3.create_bucket("data");
    let all = dir.join("all");
    let mut bytes = xorshift_bytes(17);
    for shard in 0..3 {
        let root = dir.join(format!("shard{shard}"));
        std::fs::create_dir_all(&root).unwrap();
        std::fs::create_dir_all(&all).unwrap();
        for i in 0..60 {
            let name = format!("{:06}.jpg", shard * 60 + i);
            let data = bytes(20_000 + i * 101);
            write_twice(&root, &all, &name, &data);
        }
        let tar = dir.join(format!("shard-{shard}.tar"));
        tar_of(&root, ".", &tar);
        s3.put("data", &format!("shards/shard-{shard}.tar"), &tar);
    }
    let log = dir.join("mount.log");
    let mnt = dir.join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let mut cmd = archfs();
    s3.apply_env(&mut cmd)
        .env("XDG_CACHE_HOME", dir.join("cache"))
        .env("ARCHFS_LOG", "info")
        .env("SLURM_JOB_ID", format!("epoch-{}", std::process::id()))
        .args(["mount", "s3://data/shards/"])
        .arg(&mnt)
        .arg("--log")
        .arg(&log);
    run_ok(&mut cmd);
    let m = Mount { path: mnt };
    let opts = CompareOpts {
        root_attrs: false,
        ..CompareOpts::default()
    };
    common::suite::check_mount(&all, &m.path, &opts, "s3://data/shards/");
    let copied = || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .matches(": copied to this node, ")
            .count()
    };
    assert!(
        wait_for(120, || copied() == 3),
        "{} of 3 shards copied: {}",
        copied(),
        std::fs::read_to_string(&log).unwrap_or_default()
    );
}

/// `--stage-dir DIR --keep SIZE`: the next job on the node reads the copy a job left
/// instead of fetching the object again, and a copy that would take the kept copies past
/// SIZE removes the least recently used one no job holds.
#[test]
fn a_kept_copy_serves_the_next_job_and_the_oldest_goes_first() {
    let dir = TempDir::new("remote-keep");
    let s3 = S3Server::start();
    s3.create_bucket("data");
    let mut bytes = xorshift_bytes(23);
    let mut trees = Vec::new();
    for key in ["a", "b"] {
        let root = dir.join(key);
        std::fs::create_dir_all(&root).unwrap();
        for i in 0..100 {
            std::fs::write(root.join(format!("{i:04}.jpg")), bytes(80_000 + i * 13)).unwrap();
        }
        let tar = dir.join(format!("{key}.tar"));
        tar_of(&root, ".", &tar);
        s3.put("data", &format!("{key}.tar"), &tar);
        let ex = dir.join(format!("{key}-ex"));
        extract(&tar, &ex);
        trees.push((key, ex, std::fs::metadata(&tar).unwrap().len()));
    }
    let kept = dir.join("kept");
    std::fs::create_dir_all(&kept).unwrap();
    // Room for one copy (8.1 MB and its board) and not two.
    let bound = "12M";
    let copies = || -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(&kept)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };
    let job = |n: u32, key: &str, reference: &Path| -> String {
        let log = dir.join(format!("job{n}.log"));
        let mnt = dir.join(format!("mnt{n}"));
        std::fs::create_dir_all(&mnt).unwrap();
        let mut cmd = archfs();
        s3.apply_env(&mut cmd)
            .env("XDG_CACHE_HOME", dir.join("cache"))
            .env("ARCHFS_LOG", "info")
            .env("SLURM_JOB_ID", format!("keep-{n}-{}", std::process::id()))
            .args(["mount", "--preload=always", "--keep", bound, "--stage-dir"])
            .arg(&kept)
            .arg(format!("s3://data/{key}.tar"))
            .arg(&mnt)
            .arg("--log")
            .arg(&log);
        run_ok(&mut cmd);
        let m = Mount { path: mnt };
        let text = || std::fs::read_to_string(&log).unwrap_or_default();
        assert!(
            wait_for(120, || text().contains(": copied to this node, ")
                || text().contains("reading the copy kept in")),
            "job {n}: {}",
            text()
        );
        common::suite::check_mount(reference, &m.path, &CompareOpts::default(), key);
        drop(m);
        assert!(
            wait_for(30, || text().contains(" MB fetched")),
            "{}",
            text()
        );
        text()
    };
    let fetched = |log: &str| -> f64 {
        log.split("requests, ")
            .nth(1)
            .and_then(|t| t.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no byte count in {log}"))
    };
    let (_, a_ref, a_size) = &trees[0];
    let first = job(1, "a", a_ref);
    assert!(first.contains("kept there for later jobs"), "{first}");
    assert_eq!(copies().len(), 1, "{:?}", copies());
    let second = job(2, "a", a_ref);
    assert!(second.contains("reading the copy kept in"), "{second}");
    let again = fetched(&second) * 1e6;
    assert!(
        again < *a_size as f64 / 10.0,
        "the second job fetched {again} bytes of a {a_size}-byte object"
    );
    let a_copy = copies();
    let (_, b_ref, _) = &trees[1];
    let third = job(3, "b", b_ref);
    assert!(third.contains("removed the kept copy"), "{third}");
    let now = copies();
    assert!(now.len() == 1 && now != a_copy, "{a_copy:?} then {now:?}");
}

/// The node's side of a stage-in the job's nodes share (what archfs.stage drives): the
/// pieces of other nodes are held, not fetched from storage, until they land or are
/// given back; given back, they are fetched like any other. The copy equals the object.
#[test]
fn a_shared_stage_in_holds_the_other_nodes_pieces_until_they_land() {
    use archfs::source::{CopyOf, CopyStatus, NodeCopy, RemoteObject, RemoteOptions};
    use std::time::Duration;

    let dir = TempDir::new("remote-share");
    let obj = dir.join("obj.bin");
    // 5 pieces of 4 MiB, the last short.
    let bytes: Vec<u8> = (0..18u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(&obj, &bytes).unwrap();
    let s3 = S3Server::start();
    s3.create_bucket("data");
    s3.put("data", "obj.bin", &obj);
    // This test's process reads with the server's variables (nextest: a process a test).
    for (k, v) in s3.env() {
        std::env::set_var(k, v);
    }
    std::env::set_var("SLURM_JOB_ID", format!("share-{}", std::process::id()));
    let object = RemoteObject::open(Path::new("s3://data/obj.bin"), &RemoteOptions::default())
        .unwrap()
        .unwrap();
    let copy = NodeCopy::new(CopyOf::Object(object), true, Duration::from_secs(30)).unwrap();
    assert_eq!((copy.size(), copy.pieces()), (18 << 20, 5));
    // This node fetches pieces 0 and 1; 2, 3 and 4 are the other nodes'.
    assert_eq!(copy.share(0..2), 3);
    for p in 0..2 {
        assert_eq!(
            copy.wait(p, Duration::from_secs(60)),
            CopyStatus::Copied,
            "piece {p}"
        );
    }
    assert_eq!(copy.wait_whole(Duration::from_secs(2)), CopyStatus::Pending);
    assert_eq!(
        copy.status(2),
        CopyStatus::Pending,
        "a held piece was fetched"
    );
    // Piece 2 arrives from another node.
    assert!(copy.receive(2));
    assert!(!copy.receive(2), "a piece received twice");
    let (at, len) = copy.span(2);
    copy.file()
        .write_all_at(&bytes[at as usize..(at + len) as usize], at)
        .unwrap();
    copy.landed(2);
    assert_eq!(copy.status(2), CopyStatus::Copied);
    assert_eq!(copy.left(), 2);
    // Its node died: pieces 3 and 4 are given back and fetched here.
    assert!(copy.release(3) && copy.release(4));
    assert!(!copy.release(0), "a copied piece given back");
    copy.fetch_free();
    assert_eq!(copy.wait_whole(Duration::from_secs(60)), CopyStatus::Copied);
    let mut got = vec![0u8; bytes.len()];
    copy.file().read_exact_at(&mut got, 0).unwrap();
    assert!(got == bytes, "the copy differs from the object");
}

/// Files handed to `fetch_ahead` in a shuffled order, from a union of a tar and a
/// SquashFS image in S3, land in the node's copies of both: with the server stopped,
/// every file reads back exactly, in another order.
#[test]
fn files_fetched_ahead_read_back_with_the_server_gone() {
    use archfs::archive::path::{files_under, read_into, walk};
    use archfs::cache::CacheConfig;
    use archfs::open::{open_many, OpenOptions};
    use archfs::source::{fetched_ahead, RemoteOptions, Staging};

    let dir = TempDir::new("remote-ahead");
    let mut want = std::collections::BTreeMap::new();
    let mut seed = 0x9e37_79b9_u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for (tree, files) in [("t", 150), ("s", 150)] {
        for i in 0..files {
            let rel = format!("{tree}/c{}/{tree}{i:04}.jpg", i % 7);
            let len = 1 + next() as usize % (160 << 10);
            let data: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            let path = dir.join(format!("src/{rel}"));
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, &data).unwrap();
            want.insert(rel, data);
        }
    }
    tar_of(&dir.join("src"), "t", &dir.join("t.tar"));
    std::fs::create_dir_all(dir.join("only-s")).unwrap();
    std::fs::rename(dir.join("src/s"), dir.join("only-s/s")).unwrap();
    mksquashfs(&dir.join("only-s"), &dir.join("s.sqfs"), &["-comp", "zstd"]);
    let mut s3 = S3Server::start();
    s3.create_bucket("data");
    s3.put("data", "t.tar", &dir.join("t.tar"));
    s3.put("data", "s.sqfs", &dir.join("s.sqfs"));
    for (k, v) in s3.env() {
        std::env::set_var(k, v);
    }
    // The tar's index saved beside it, as a user does once: else its scan would copy
    // the tar whole before any order.
    let out = inspect(
        &s3,
        &["index", "s3://data/t.tar"],
        &[("XDG_CACHE_HOME", dir.join("indexer").to_str().unwrap())],
    );
    assert!(out.status.success(), "{}", stderr_of(&out));
    std::env::set_var("SLURM_JOB_ID", format!("ahead-{}", std::process::id()));
    std::env::set_var("XDG_CACHE_HOME", dir.join("cache"));
    // Auto, as a job opens it: an order makes the copy (Never would make none).
    let options = OpenOptions {
        remote: RemoteOptions {
            stage: Staging::Auto,
            ..RemoteOptions::default()
        },
        ..OpenOptions::default()
    };
    let urls = [
        PathBuf::from("s3://data/t.tar"),
        PathBuf::from("s3://data/s.sqfs"),
    ];
    let union = open_many(&urls, &CacheConfig::default(), &options).unwrap();
    let mut names = files_under(&*union, b"", None).unwrap();
    assert_eq!(names.len(), want.len());
    // A shuffled order, as a sampler draws one.
    for i in (1..names.len()).rev() {
        names.swap(i, next() as usize % (i + 1));
    }
    let inos: Vec<u64> = names
        .iter()
        .map(|n| walk(&*union, n, true).unwrap().ino)
        .collect();
    assert_eq!(archfs::archive::fetch_ahead(&*union, &inos), names.len());
    let bytes: u64 = want.values().map(|d| d.len() as u64).sum();
    // Done once past the files' bytes (with the grains around them) and still.
    let mut last = 0;
    let still = || {
        std::thread::sleep(std::time::Duration::from_millis(500));
        let now = fetched_ahead();
        let done = now >= bytes && now == last;
        last = now;
        done
    };
    assert!(
        wait_for(120, still),
        "fetched ahead {} of {bytes} bytes",
        fetched_ahead()
    );
    s3.stop();
    for name in names.iter().rev() {
        let rel = String::from_utf8(name.clone()).unwrap();
        let ino = walk(&*union, name, true).unwrap().ino;
        let mut got = vec![0u8; want[&rel].len() + 1];
        let n = read_into(&*union, ino, 0, &mut got)
            .unwrap_or_else(|e| panic!("{rel} with the server gone: {e}"));
        assert!(got[..n] == want[&rel][..], "{rel} differs");
    }
}
