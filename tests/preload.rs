//! `--preload` streams the archive into the page cache after mounting, `--preload=auto`
//! (the default) once many files have been read, and the preloaded mount serves exactly
//! the same tree.

use crate::common;

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::Command;

use archfs::warm::preload::AUTO_AFTER_FILES;
use common::tree::{make_awkward_tree, CompareOpts, TreeSpec};
use common::*;

/// Share of the file's pages in the page cache (mincore over a read-only mapping).
fn resident(path: &Path) -> f64 {
    let f = File::open(path).unwrap();
    let len = f.metadata().unwrap().len() as usize;
    let page = 4096;
    let mut vec = vec![0u8; len.div_ceil(page)];
    // SAFETY: a fresh shared read-only mapping of an open file, unmapped below; mincore
    // writes one byte per page into `vec`, which has room for every page.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        );
        assert_ne!(p, libc::MAP_FAILED, "mmap {path:?}");
        assert_eq!(libc::mincore(p, len, vec.as_mut_ptr()), 0, "mincore");
        libc::munmap(p, len);
    }
    vec.iter().filter(|&&b| b & 1 != 0).count() as f64 / vec.len() as f64
}

/// Writes the file back and drops its pages, as after a reboot or on another node.
fn evict(path: &Path) {
    let f = File::open(path).unwrap();
    f.sync_all().unwrap();
    // SAFETY: fadvise on an open descriptor.
    let r = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(r, 0);
    assert!(
        resident(path) < 0.05,
        "{path:?} still cached after POSIX_FADV_DONTNEED: this test needs a filesystem \
         with a page cache under /tmp"
    );
}

/// 24 MB of incompressible small files, which the tests read, and a 48 MiB one they never
/// read: the image is mostly data, so a server that read nearly all of it read the data,
/// not just the tables, and more than the files read through the mount and their
/// read-ahead.
fn data_tree(dir: &TempDir) -> std::path::PathBuf {
    let src = dir.join("src");
    std::fs::create_dir(&src).unwrap();
    make_awkward_tree(
        &src,
        &TreeSpec {
            big_dir_entries: 300,
            sparse_4g: false,
            ..TreeSpec::default()
        },
    )
    .unwrap();
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    for i in 0..200 {
        let d = src.join(format!("class{}", i % 8));
        std::fs::create_dir_all(&d).unwrap();
        let bytes: Vec<u8> = (0..120 * 1024)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        std::fs::write(d.join(format!("img{i}.jpg")), bytes).unwrap();
    }
    std::fs::create_dir(src.join("unread")).unwrap();
    let mut big = vec![0u8; 48 << 20];
    File::open("/dev/urandom")
        .and_then(|mut r| std::io::Read::read_exact(&mut r, &mut big))
        .unwrap();
    std::fs::write(src.join("unread/big.bin"), big).unwrap();
    src
}

/// Lists and stats the whole tree through the mount, then reads `files` of the small ones.
fn use_mount(mnt: &Path, files: usize) {
    let mut read = 0;
    for class in 0..8 {
        let d = mnt.join(format!("class{class}"));
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            std::fs::metadata(&p).unwrap();
            if read < files {
                std::fs::read(&p).unwrap();
                read += 1;
            }
        }
    }
    assert_eq!(read, files, "the tree has too few files to read");
}

/// Share of `archive` the server of `mnt` has read from storage (`read_bytes` of
/// /proc/PID/io, which counts read-ahead the server asked for too). Unlike page-cache
/// residency this stays put when the kernel reclaims pages: this machine's kdamond pages
/// out page cache idle for seconds
/// (docs/history/2026-11-23-to-25-summary-imagenet-scale-machines.md#the-machines).
fn server_read(mnt: &Path, archive: &Path) -> f64 {
    let bytes: u64 = server_proc(mnt, "io", "read_bytes:").parse().unwrap();
    bytes as f64 / std::fs::metadata(archive).unwrap().len() as f64
}

fn check(archive: &Path, src: &Path, dir: &TempDir, name: &str) {
    let mnt = dir.join(format!("{name}-plain"));
    std::fs::create_dir(&mnt).unwrap();
    // A tar's first mount reads it all to build the index it saves; later mounts load that.
    drop(Mount::new(archive, &mnt, &[]));
    // By default, mounting reads the superblock and tables (or the saved index), and
    // listing the tree or reading a few files reads little more.
    let few = AUTO_AFTER_FILES as usize - 1;
    evict(archive);
    let m = Mount::new(archive, &mnt, &[]);
    use_mount(&m.path, few);
    std::thread::sleep(std::time::Duration::from_millis(500));
    let before = server_read(&m.path, archive);
    assert!(
        before < 0.5,
        "{name}: {before:.2} of the archive read after reading {few} files"
    );
    // One more file read starts the preload: the unread big file comes in too.
    use_mount(&m.path, few + 1);
    assert!(
        wait_for(60, || server_read(&m.path, archive) > 0.99),
        "{name}: --preload=auto read only {:.3} of the archive after {} files were read",
        server_read(&m.path, archive),
        few + 1
    );
    // The small files no one read are pushed into the mount's own page cache (their
    // directories were listed with attributes), and read back as the source has them.
    let unread: Vec<_> = (0..8)
        .flat_map(|c| std::fs::read_dir(m.path.join(format!("class{c}"))).unwrap())
        .map(|e| e.unwrap().path())
        .skip(few + 1)
        .collect();
    assert!(unread.len() >= 50, "{name}: {} unread files", unread.len());
    let pushed = || unread.iter().map(|p| resident(p)).sum::<f64>() / unread.len() as f64;
    assert!(
        wait_for(60, || pushed() > 0.8),
        "{name}: only {:.2} of the pages of {} files never read are in the page cache",
        pushed(),
        unread.len()
    );
    for p in &unread {
        let rel = p.strip_prefix(&m.path).unwrap();
        assert!(
            std::fs::read(p).unwrap() == std::fs::read(src.join(rel)).unwrap(),
            "{name}: {rel:?} differs from the source after it was pushed"
        );
    }
    // The big file goes in many pushes (a tar's spliced from the archive file, in pieces
    // a pipe holds, none of them page-aligned).
    let big = m.path.join("unread/big.bin");
    assert!(
        wait_for(60, || resident(&big) > 0.8),
        "{name}: only {:.2} of the big file's pages pushed",
        resident(&big)
    );
    assert!(
        std::fs::read(&big).unwrap() == std::fs::read(src.join("unread/big.bin")).unwrap(),
        "{name}: the big file differs from the source after it was pushed"
    );
    drop(m);

    // With --preload=never the same reads leave the unread file out.
    evict(archive);
    let m = Mount::new(archive, &mnt, &["--preload=never"]);
    use_mount(&m.path, 200);
    std::thread::sleep(std::time::Duration::from_millis(500));
    let never = server_read(&m.path, archive);
    assert!(
        never < 0.9,
        "{name}: {never:.2} of the archive read with --preload=never"
    );
    drop(m);

    evict(archive);
    let mnt = dir.join(format!("{name}-preload"));
    std::fs::create_dir(&mnt).unwrap();
    let m = Mount::new(archive, &mnt, &["--preload"]);
    // Nothing reads through the mount until the preload is seen complete.
    assert!(
        wait_for(60, || server_read(&m.path, archive) > 0.99),
        "{name}: with --preload only {:.3} of the archive was read after 60 s",
        server_read(&m.path, archive)
    );
    common::suite::check_mount(src, &m.path, &CompareOpts::default(), name);
}

#[test]
fn preload_streams_squashfs_and_tar_into_the_page_cache() {
    let dir = TempDir::new("preload");
    let src = data_tree(&dir);
    let img = dir.join("data.sqfs");
    mksquashfs(&src, &img, &["-comp", "zstd", "-xattrs"]);
    check(&img, &src, &dir, "squashfs");

    let tar = dir.join("data.tar");
    run_ok(
        Command::new("tar")
            .args(["--format=pax", "--xattrs", "--xattrs-include=*", "-cf"])
            .arg(&tar)
            .arg("-C")
            .arg(&src)
            .arg("."),
    );
    let extracted = dir.join("x");
    std::fs::create_dir(&extracted).unwrap();
    run_ok(
        Command::new("tar")
            .args(["-x", "--xattrs", "--xattrs-include=*", "--same-owner"])
            .args(["--numeric-owner", "-p", "-f"])
            .arg(&tar)
            .arg("-C")
            .arg(&extracted),
    );
    check(&tar, &extracted, &dir, "tar");
}
