//! A background mount outlives its parent and goes on request; writes are refused; mount
//! errors are one line that says what to do. How jobs end is in tests/lifecycle.rs.

use crate::common;

use std::path::Path;
use std::process::Command;

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
        wait_for(60, || !mnt.exists()),
        "created mount point not removed"
    );
    assert!(wait_for(60, || watchdog_pids(&mnt).is_empty()));
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
