//! Every way a job can end leaves no mount behind, and mount errors say what to do.

mod common;

use std::fs::File;
use std::io::Read;
use std::path::Path;
use std::process::{Child, Command, Stdio};

use common::*;

/// A small image with a few files, built by mksquashfs.
fn small_image(dir: &TempDir) -> std::path::PathBuf {
    let src = dir.join("src");
    std::fs::create_dir_all(src.join("sub")).unwrap();
    std::fs::write(src.join("hello.txt"), b"hello archfs\n").unwrap();
    std::fs::write(src.join("sub/big.bin"), vec![42u8; 1 << 20]).unwrap();
    let img = dir.join("small.sqfs");
    mksquashfs(&src, &img, &[]);
    img
}

fn kill(pid: i32, sig: i32) {
    // SAFETY: kill has no memory preconditions.
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0, "kill {pid} {sig}");
}

fn pids_with_args(needles: &[&[u8]]) -> Vec<i32> {
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
        if needles.iter().all(|n| args.iter().any(|a| a == n)) {
            pids.push(pid);
        }
    }
    pids
}

fn watchdog_pids(mnt: &Path) -> Vec<i32> {
    pids_with_args(&[b"__watchdog", mnt.as_os_str().as_encoded_bytes()])
}

fn foreground(img: &Path, mnt: &Path) -> Child {
    let child = archfs()
        .arg("mount")
        .arg("-f")
        .arg(img)
        .arg(mnt)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    assert!(
        wait_for(20, || is_mounted(mnt)),
        "foreground mount never came up"
    );
    child
}

#[test]
fn ending_signals_unmount_even_with_a_file_open() {
    let dir = TempDir::new("signals");
    let img = small_image(&dir);
    for (name, sig) in [
        ("TERM", libc::SIGTERM),
        ("INT", libc::SIGINT),
        ("HUP", libc::SIGHUP),
    ] {
        let mnt = dir.join(format!("mnt-{name}"));
        let mut server = foreground(&img, &mnt);
        let mut held = File::open(mnt.join("sub/big.bin")).unwrap();
        let mut first = [0u8; 4];
        held.read_exact(&mut first).unwrap();
        assert_eq!(first, [42; 4]);
        kill(server.id() as i32, sig);
        let status = server.wait().unwrap();
        assert!(status.success(), "SIG{name}: server exited with {status}");
        assert!(!is_mounted(&mnt), "SIG{name}: {mnt:?} still mounted");
        assert!(
            !mnt.exists(),
            "SIG{name}: the mount point archfs created was not removed"
        );
        assert!(
            wait_for(10, || watchdog_pids(&mnt).is_empty()),
            "watchdog outlived the server"
        );
        drop(held);
    }
}

#[test]
fn sigkill_of_the_server_leaves_no_stale_mount() {
    let dir = TempDir::new("sigkill");
    let img = small_image(&dir);
    let mnt = dir.join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let mut server = foreground(&img, &mnt);
    assert_eq!(
        std::fs::read(mnt.join("hello.txt")).unwrap(),
        b"hello archfs\n"
    );
    kill(server.id() as i32, libc::SIGKILL);
    server.wait().unwrap();
    assert!(
        wait_for(10, || !is_mounted(&mnt)),
        "stale mount left after SIGKILL"
    );
    // The mount point works again right away.
    let _m = Mount::new(&img, &mnt, &[]);
    assert_eq!(
        std::fs::read(mnt.join("hello.txt")).unwrap(),
        b"hello archfs\n"
    );
}

#[test]
fn background_mount_survives_its_parent_and_unmounts_on_request() {
    let dir = TempDir::new("daemon");
    let img = small_image(&dir);
    let mnt = dir.join("does/not/exist/yet");
    run_ok(archfs().arg("mount").arg(&img).arg(&mnt));
    assert!(is_mounted(&mnt));
    assert_eq!(
        std::fs::read(mnt.join("hello.txt")).unwrap(),
        b"hello archfs\n"
    );
    run_ok(archfs().arg("unmount").arg(&mnt));
    assert!(!is_mounted(&mnt));
    assert!(
        wait_for(10, || !mnt.exists()),
        "created mount point not removed"
    );
    assert!(wait_for(10, || watchdog_pids(&mnt).is_empty()));
}

#[test]
fn mounting_onto_a_stale_mount_recovers_it() {
    let dir = TempDir::new("stale");
    let img = small_image(&dir);
    let mnt = dir.join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let mut server = foreground(&img, &mnt);
    // Kill the watchdog first so nothing cleans up: the state a node is left in when a
    // whole job is SIGKILLed.
    for pid in watchdog_pids(&mnt) {
        kill(pid, libc::SIGKILL);
    }
    kill(server.id() as i32, libc::SIGKILL);
    server.wait().unwrap();
    let err = std::fs::metadata(&mnt).unwrap_err();
    assert_eq!(
        err.raw_os_error(),
        Some(libc::ENOTCONN),
        "expected a stale mount"
    );
    let _m = Mount::new(&img, &mnt, &[]);
    assert_eq!(
        std::fs::read(mnt.join("hello.txt")).unwrap(),
        b"hello archfs\n"
    );
}

#[test]
fn run_passes_the_exit_status_and_unmounts() {
    let dir = TempDir::new("run");
    let img = small_image(&dir);
    let mnt = dir.join("mnt");
    let script = format!(
        "test \"$(cat {}/hello.txt)\" = 'hello archfs' && exit 3",
        mnt.display()
    );
    let out = archfs()
        .arg("run")
        .arg(&img)
        .arg(&mnt)
        .args(["--", "sh", "-c", &script])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3), "{}", stderr_of(&out));
    assert!(!is_mounted(&mnt));
    assert!(!mnt.exists());
}

#[test]
fn run_forwards_sigterm_and_unmounts() {
    let dir = TempDir::new("runterm");
    let img = small_image(&dir);
    let mnt = dir.join("mnt");
    let mut run = archfs()
        .arg("run")
        .arg(&img)
        .arg(&mnt)
        .args([
            "--",
            "sh",
            "-c",
            "trap 'exit 7' TERM; while :; do sleep 0.1; done",
        ])
        .spawn()
        .unwrap();
    assert!(wait_for(20, || is_mounted(&mnt)));
    std::thread::sleep(std::time::Duration::from_millis(300));
    kill(run.id() as i32, libc::SIGTERM);
    let status = run.wait().unwrap();
    assert_eq!(
        status.code(),
        Some(7),
        "the command's own exit status passes through"
    );
    assert!(!is_mounted(&mnt));
}

#[test]
fn run_unmounts_when_the_command_is_killed() {
    let dir = TempDir::new("runkill");
    let img = small_image(&dir);
    let mnt = dir.join("mnt");
    let mut run = archfs()
        .arg("run")
        .arg(&img)
        .arg(&mnt)
        .args(["--", "sleep", "3600.4242"])
        .spawn()
        .unwrap();
    assert!(wait_for(20, || is_mounted(&mnt)));
    // The command itself, not `archfs run`, whose arguments name it too.
    let sleepers = || -> Vec<i32> {
        pids_with_args(&[b"sleep", b"3600.4242"])
            .into_iter()
            .filter(|p| {
                std::fs::read_to_string(format!("/proc/{p}/comm"))
                    .is_ok_and(|c| c.trim() == "sleep")
            })
            .collect()
    };
    assert!(wait_for(10, || !sleepers().is_empty()));
    for pid in sleepers() {
        kill(pid, libc::SIGKILL);
    }
    let status = run.wait().unwrap();
    assert_eq!(status.code(), Some(128 + libc::SIGKILL));
    assert!(!is_mounted(&mnt));
}

#[test]
fn writes_are_refused_with_erofs() {
    let dir = TempDir::new("erofs");
    let img = small_image(&dir);
    let mnt = dir.join("mnt");
    let _m = Mount::new(&img, &mnt, &[]);
    let err = std::fs::OpenOptions::new()
        .write(true)
        .open(mnt.join("hello.txt"))
        .unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS));
    let err = std::fs::write(mnt.join("new"), b"x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS));
}

fn mount_fails(img: &Path, mnt: &Path, expect: &str) {
    let out = archfs().arg("mount").arg(img).arg(mnt).output().unwrap();
    let err = stderr_of(&out);
    assert!(
        !out.status.success(),
        "mount of {img:?} on {mnt:?} succeeded"
    );
    assert!(err.contains(expect), "expected {expect:?} in: {err}");
    assert_eq!(err.trim().lines().count(), 1, "one clear line: {err}");
    assert!(!is_mounted(mnt));
}

#[test]
fn mount_errors_are_one_clear_line() {
    let dir = TempDir::new("errors");
    let img = small_image(&dir);
    let mnt = dir.join("mnt");
    mount_fails(&dir.join("missing.sqfs"), &mnt, "cannot open archive");
    assert!(
        !mnt.exists(),
        "a failed mount must not leave the mount point it created"
    );
    std::fs::write(dir.join("text.sqfs"), b"just some text, not an image").unwrap();
    mount_fails(
        &dir.join("text.sqfs"),
        &mnt,
        "neither a SquashFS image nor a tar archive",
    );
    std::fs::write(dir.join("file"), b"").unwrap();
    mount_fails(&img, &dir.join("file"), "not a directory");
    std::fs::create_dir_all(dir.join("full")).unwrap();
    std::fs::write(dir.join("full/x"), b"").unwrap();
    mount_fails(&img, &dir.join("full"), "not empty");
    let bytes = std::fs::read(&img).unwrap();
    std::fs::write(dir.join("trunc.sqfs"), &bytes[..200]).unwrap();
    mount_fails(&dir.join("trunc.sqfs"), &mnt, "truncated");
    let mut bad = bytes.clone();
    bad[12..16].copy_from_slice(&3000u32.to_le_bytes()); // block size
    std::fs::write(dir.join("badsb.sqfs"), &bad).unwrap();
    mount_fails(&dir.join("badsb.sqfs"), &mnt, "block size");
    let mut lzma = bytes;
    lzma[20] = 2; // the legacy lzma compressor
    std::fs::write(dir.join("lzma.sqfs"), &lzma).unwrap();
    mount_fails(&dir.join("lzma.sqfs"), &mnt, "lzma");
    let _ = Command::new("true").status();
}
