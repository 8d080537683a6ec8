//! Shared helpers for the integration tests: temporary directories, archives built by
//! the real tools, and mounts that are always cleaned up.
#![allow(dead_code)]

pub mod huge;
pub mod proxy;
pub mod rawtar;
pub mod s3;
pub mod suite;
pub mod tree;
pub mod user;

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

pub fn archfs_bin() -> &'static str {
    env!("CARGO_BIN_EXE_archfs")
}

pub fn archfs() -> Command {
    Command::new(archfs_bin())
}

/// A directory under /tmp removed (after lazily unmounting anything left in it) on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        TempDir::new_in(&std::env::temp_dir(), tag)
    }

    /// A temporary directory under `base` (/tmp for what another user must reach,
    /// /dev/shm for trees whose xattrs ext4 cannot hold).
    pub fn new_in(base: &Path, tag: &str) -> TempDir {
        static N: AtomicU32 = AtomicU32::new(0);
        let p = base.join(format!(
            "archfs-test-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    pub fn join(&self, p: impl AsRef<Path>) -> PathBuf {
        self.0.join(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        for m in mounts_under(&self.0) {
            let _ = Command::new("umount").arg("-l").arg(&m).status();
        }
        // Restore permissions the awkward tree removed, so removal can descend.
        let _ = Command::new("chmod")
            .args(["-R", "u+rwx"])
            .arg(&self.0)
            .status();
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Mount points (from /proc/self/mountinfo) at or below `dir`.
pub fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    table
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|p| PathBuf::from(p.replace("\\040", " ")))
        .filter(|p| p.starts_with(dir))
        .collect()
}

pub fn is_mounted(path: &Path) -> bool {
    let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_owned());
    mounts_under(&path).iter().any(|m| m == &path)
}

/// Runs a command to completion, panicking with its output if it fails.
pub fn run_ok(cmd: &mut Command) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

pub fn mksquashfs(src: &Path, img: &Path, args: &[&str]) {
    run_ok(
        Command::new("mksquashfs")
            .arg(src)
            .arg(img)
            .args(["-noappend", "-quiet", "-no-progress"])
            .args(args),
    );
}

/// `tar -cf TAR -C DIR MEMBER` with GNU tar.
pub fn tar_of(dir: &Path, member: &str, tar: &Path) {
    run_ok(
        Command::new("tar")
            .arg("-cf")
            .arg(tar)
            .arg("-C")
            .arg(dir)
            .arg(member),
    );
}

/// A POSIX (pax) tar at `tar` of the tree at `src`, its `user.*` xattrs kept.
pub fn posix_tar(src: &Path, tar: &Path) {
    run_ok(
        Command::new("tar")
            .args([
                "--format=posix",
                "--xattrs",
                "--xattrs-include=user.*",
                "-cf",
            ])
            .arg(tar)
            .arg("-C")
            .arg(src)
            .arg("."),
    );
}

/// What `tar -x` makes of an archive (compressed ones too), as root keeping owners, modes
/// and xattrs: the reference a mounted tar is compared with. A writer's oddities make
/// GNU tar complain of some members; the comparison shows what that costs.
pub fn extract(tar: &Path, into: &Path) {
    std::fs::create_dir_all(into).unwrap();
    let out = Command::new("tar")
        .args([
            "-x",
            "--xattrs",
            "--xattrs-include=*",
            "--same-owner",
            "--numeric-owner",
            "-p",
            "-f",
        ])
        .arg(tar)
        .arg("-C")
        .arg(into)
        .output()
        .unwrap();
    if !out.status.success() {
        eprintln!("tar -x {tar:?}: {}", stderr_of(&out));
    }
}

/// A live `archfs mount` that is unmounted on drop.
pub struct Mount {
    pub path: PathBuf,
}

impl Mount {
    pub fn new(archive: &Path, path: &Path, args: &[&str]) -> Mount {
        run_ok(archfs().arg("mount").arg(archive).arg(path).args(args));
        assert!(
            is_mounted(path),
            "archfs mount returned 0 but {path:?} is not mounted"
        );
        Mount {
            path: path.to_owned(),
        }
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if is_mounted(&self.path) {
            let ok = archfs()
                .arg("unmount")
                .arg(&self.path)
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if !ok {
                let _ = Command::new("umount").arg("-l").arg(&self.path).status();
            }
        }
    }
}

/// Polls `cond` until it holds or `secs` pass.
pub fn wait_for(secs: u64, mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < end {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    cond()
}

/// Every process's pid and arguments.
pub fn processes() -> Vec<(i32, Vec<Vec<u8>>)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        out.push((
            pid,
            cmdline.split(|&b| b == 0).map(<[u8]>::to_vec).collect(),
        ));
    }
    out
}

/// The servers of the mount on `mnt`: their command lines name the mount point.
pub fn pids_of_mount(mnt: &Path) -> Vec<i32> {
    let mnt = mnt.as_os_str().as_encoded_bytes();
    processes()
        .into_iter()
        .filter(|(_, args)| {
            args.iter().any(|a| a.ends_with(b"archfs"))
                && args
                    .iter()
                    .any(|a| matches!(&a[..], b"--ready-fd" | b"-f" | b"--foreground"))
                && args.iter().any(|a| a == mnt)
        })
        .map(|(pid, _)| pid)
        .collect::<Vec<_>>()
        .into_iter()
        // A child the server is starting shows the server's command line until its exec.
        .filter(|&pid| !child_of_a_server(pid, mnt))
        .collect()
}

/// Whether the parent of `pid` is itself a server of `mnt` (see [`pids_of_mount`]).
fn child_of_a_server(pid: i32, mnt: &[u8]) -> bool {
    let ppid: Option<i32> = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(") ")?.1.split(' ').nth(1)?.parse().ok());
    let Some(ppid) = ppid else { return false };
    std::fs::read(format!("/proc/{ppid}/cmdline")).is_ok_and(|c| {
        let args: Vec<&[u8]> = c.split(|&b| b == 0).collect();
        args.iter().any(|a| a.ends_with(b"archfs"))
            && args.contains(&&b"--ready-fd"[..])
            && args.contains(&mnt)
    })
}

pub fn stderr_of(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

pub fn os(s: &str) -> &OsStr {
    OsStr::new(s)
}

/// The value after `key` in /proc/PID/`file` of the server serving `mnt`.
pub fn server_proc(mnt: &Path, file: &str, key: &str) -> String {
    let pids = pids_of_mount(mnt);
    assert_eq!(pids.len(), 1, "one server for {mnt:?}: {pids:?}");
    let text = std::fs::read_to_string(format!("/proc/{}/{file}", pids[0])).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .unwrap_or_else(|| panic!("no {key} in /proc/PID/{file}"))
        .trim()
        .to_owned()
}

/// Peak resident memory (VmHWM) of this process, in bytes.
pub fn own_peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .expect("VmHWM in /proc/self/status")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .expect("VmHWM in kB");
    kib << 10
}

/// Peak resident memory (VmHWM) of the server serving `mnt`, in bytes.
pub fn server_peak_rss(mnt: &Path) -> u64 {
    let kib: u64 = server_proc(mnt, "status", "VmHWM:")
        .trim_end_matches("kB")
        .trim()
        .parse()
        .expect("VmHWM in kB");
    kib << 10
}

/// Sends `sig` to `pid`, which must exist.
pub fn kill(pid: i32, sig: i32) {
    // SAFETY: kill has no memory preconditions.
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0, "kill {pid} {sig}");
}

/// Processes whose arguments include every one of `needles`.
pub fn pids_with_args(needles: &[&[u8]]) -> Vec<i32> {
    processes()
        .into_iter()
        .filter(|(_, args)| needles.iter().all(|n| args.iter().any(|a| a == n)))
        .map(|(pid, _)| pid)
        .collect()
}

/// Watchdog processes of the mount on `mnt`.
pub fn watchdog_pids(mnt: &Path) -> Vec<i32> {
    pids_with_args(&[b"__watchdog", mnt.as_os_str().as_encoded_bytes()])
}

/// `dir/src`: the awkward tree with 2,000 files in its big directory and no 4 GiB file.
pub fn small_awkward_tree(dir: &TempDir) -> PathBuf {
    let src = dir.join("src");
    std::fs::create_dir(&src).unwrap();
    tree::make_awkward_tree(
        &src,
        &tree::TreeSpec {
            big_dir_entries: 2000,
            sparse_4g: false,
            ..tree::TreeSpec::default()
        },
    )
    .unwrap();
    src
}

/// Processes listing `mnt` ahead (src/warm/prelist.rs).
pub fn lister_pids(mnt: &Path) -> Vec<i32> {
    pids_with_args(&[b"__prelist", mnt.as_os_str().as_encoded_bytes()])
}

/// A seeded generator of pseudo-random byte strings (xorshift): `rnd(n)` gives n bytes.
pub fn xorshift_bytes(mut seed: u64) -> impl FnMut(usize) -> Vec<u8> {
    move |n| {
        (0..n)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                (seed >> 24) as u8
            })
            .collect()
    }
}
