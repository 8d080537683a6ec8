//! Faults: the archive changes under a live mount, the server dies under load, and
//! hundreds of mount cycles leak nothing. (The OOM killer is in tests/lifecycle.rs.)

use crate::common;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::channel;
use std::sync::Arc;
use std::time::{Duration, Instant};

use archfs::cache::CacheConfig;
use archfs::job::{self, Settings};
use archfs::open;
use common::*;

fn dataset(dir: &TempDir, n: usize) -> PathBuf {
    let src = dir.join("src");
    std::fs::create_dir_all(&src).unwrap();
    for i in 0..n {
        // Text compresses, so blocks are really compressed.
        let body: String = (0..(2000 + i * 97 % 40_000))
            .map(|k| char::from(b'a' + ((k * 7 + i) % 26) as u8))
            .collect();
        std::fs::write(src.join(format!("f{i:04}.txt")), body).unwrap();
    }
    src
}

#[test]
fn truncated_or_removed_archive_under_a_live_mount() {
    let dir = TempDir::new("fault-trunc");
    let src = dataset(&dir, 300);
    let img = dir.join("img.sqfs");
    mksquashfs(&src, &img, &["-no-fragments"]);
    let m = Mount::new(&img, &dir.join("mnt"), &[]);
    assert_eq!(
        std::fs::read(m.path.join("f0000.txt")).unwrap(),
        std::fs::read(src.join("f0000.txt")).unwrap()
    );
    // Truncate the image to its first quarter: later files' blocks are gone.
    let len = std::fs::metadata(&img).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&img)
        .unwrap()
        .set_len(len / 4)
        .unwrap();
    let mut eio = 0;
    for i in (200..300).rev() {
        match std::fs::read(m.path.join(format!("f{i:04}.txt"))) {
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
                eio += 1;
            }
            Ok(data) => assert_eq!(
                data,
                std::fs::read(src.join(format!("f{i:04}.txt"))).unwrap()
            ),
        }
    }
    assert!(eio > 50, "reads of lost data fail with EIO ({eio})");
    // The server is up: the root still answers and the first file still reads.
    assert!(std::fs::metadata(&m.path).unwrap().is_dir());
    assert!(std::fs::read(m.path.join("f0000.txt")).is_ok());
    drop(m);
    assert!(!is_mounted(&dir.join("mnt")));

    // Removed: the open descriptor keeps the data, so reads go on working.
    let tar = dir.join("t.tar");
    tar_of(&src, ".", &tar);
    let m = Mount::new(&tar, &dir.join("mnt2"), &[]);
    std::fs::remove_file(&tar).unwrap();
    for i in (0..300).step_by(13) {
        let f = format!("f{i:04}.txt");
        assert_eq!(
            std::fs::read(m.path.join(&f)).unwrap(),
            std::fs::read(src.join(&f)).unwrap()
        );
    }
    drop(m);
    assert!(!is_mounted(&dir.join("mnt2")));
}

#[test]
fn sigkill_under_load_gives_errors_not_hangs() {
    let dir = TempDir::new("fault-kill");
    let src = dataset(&dir, 400);
    let img = dir.join("img.sqfs");
    mksquashfs(&src, &img, &[]);
    let mnt = dir.join("mnt");
    let _m = Mount::new(&img, &mnt, &["--cache-size", "1M"]);
    let stop = Arc::new(AtomicBool::new(false));
    let errors = Arc::new(AtomicU64::new(0));
    let (done_tx, done_rx) = channel();
    for t in 0..6 {
        let (mnt, stop, errors, done) =
            (mnt.clone(), stop.clone(), errors.clone(), done_tx.clone());
        std::thread::spawn(move || {
            let mut i = t;
            while !stop.load(Ordering::Relaxed) {
                if std::fs::read(mnt.join(format!("f{:04}.txt", i % 400))).is_err() {
                    errors.fetch_add(1, Ordering::Relaxed);
                }
                i += 7;
            }
            let _ = done.send(());
        });
    }
    std::thread::sleep(Duration::from_millis(500));
    let pids = pids_of_mount(&mnt);
    assert_eq!(pids.len(), 1);
    // SAFETY: kill has no memory preconditions.
    unsafe { libc::kill(pids[0], libc::SIGKILL) };
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::Relaxed);
    for _ in 0..6 {
        done_rx
            .recv_timeout(Duration::from_secs(60))
            .expect("a reader hung after the server died");
    }
    assert!(
        wait_for(60, || !is_mounted(&mnt)),
        "stale mount after SIGKILL under load"
    );
    // The next mount on the same point works.
    let m = Mount::new(&img, &mnt, &[]);
    assert_eq!(
        std::fs::read(m.path.join("f0001.txt")).unwrap(),
        std::fs::read(src.join("f0001.txt")).unwrap()
    );
}

fn count(dir: &str) -> usize {
    std::fs::read_dir(dir).unwrap().count()
}

#[test]
fn two_hundred_mount_cycles_leak_nothing() {
    let dir = TempDir::new("fault-cycles");
    let src = dataset(&dir, 20);
    let img = dir.join("img.sqfs");
    mksquashfs(&src, &img, &[]);
    let mnt = dir.join("mnt");
    let want = std::fs::read(src.join("f0003.txt")).unwrap();

    // In this process, through the library: threads and descriptors come back to where
    // they started.
    let settings = Settings {
        archives: vec![img.clone()],
        mountpoint: mnt.clone(),
        auto_mountpoint: false,
        shared: false,
        cache_size: 8 << 20,
        threads: 4,
        allow_other: false,
        recursive: false,
        index: None,
        preload: job::Preload::Never,
        prelist: job::Prelist::Never,
        readdirplus: archfs::vfs::Readdirplus::Always,
        entry_spacing: archfs::tar::DEFAULT_SPACING,
        stage_dir: None,
        keep: None,
        no_sign_request: false,
        retry_for: std::time::Duration::from_secs(60),
        debug: false,
    };
    let mut baseline = None;
    for cycle in 0..200 {
        let a = open::open(
            &img,
            &CacheConfig {
                total_bytes: 8 << 20,
            },
        )
        .unwrap();
        let (tx, rx) = channel();
        let m = job::Mount::new(a, &settings, None, None, tx).unwrap();
        assert_eq!(std::fs::read(mnt.join("f0003.txt")).unwrap(), want);
        m.unmount().unwrap();
        // The session thread reports its end once the kernel lets go.
        rx.recv_timeout(Duration::from_secs(60))
            .expect("session did not end");
        assert!(!is_mounted(&mnt));
        if cycle == 9 {
            std::thread::sleep(Duration::from_millis(200));
            baseline = Some((count("/proc/self/task"), count("/proc/self/fd")));
        }
    }
    let end = Instant::now() + Duration::from_secs(60);
    let (threads, fds) = baseline.unwrap();
    while Instant::now() < end && count("/proc/self/task") > threads {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        count("/proc/self/task") <= threads,
        "threads leaked: {} > {threads}",
        count("/proc/self/task")
    );
    assert!(
        count("/proc/self/fd") <= fds,
        "descriptors leaked: {} > {fds}",
        count("/proc/self/fd")
    );

    // Through the CLI: no servers or watchdogs are left behind.
    for _ in 0..50 {
        run_ok(archfs().arg("mount").arg(&img).arg(&mnt));
        assert_eq!(std::fs::read(mnt.join("f0003.txt")).unwrap(), want);
        run_ok(archfs().arg("unmount").arg(&mnt));
        // The server created the mount point; `unmount` returns once it is gone again.
        assert!(
            !mnt.exists(),
            "mount point left when `archfs unmount` returned"
        );
    }
    assert!(
        wait_for(60, || pids_of_mount(&mnt).is_empty()),
        "servers left running"
    );
    assert!(!is_mounted(&mnt));
}

/// A server whose mount was detached while a file stayed open lives on until that file is
/// closed; when it then ends, it must not unmount whatever is mounted on the path by now.
#[test]
fn a_late_ending_server_leaves_the_next_mount_alone() {
    let dir = TempDir::new("fault-late");
    let src = dataset(&dir, 5);
    let img = dir.join("img.sqfs");
    mksquashfs(&src, &img, &[]);
    let mnt = dir.join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let want = std::fs::read(src.join("f0003.txt")).unwrap();

    run_ok(archfs().arg("mount").arg(&img).arg(&mnt));
    let first = pids_of_mount(&mnt);
    assert_eq!(first.len(), 1, "one server: {first:?}");
    let held = std::fs::File::open(mnt.join("f0001.txt")).unwrap();
    // Busy, so this falls back to a lazy unmount and the first server keeps serving `held`.
    run_ok(archfs().arg("unmount").arg(&mnt));
    assert!(!is_mounted(&mnt));
    run_ok(archfs().arg("mount").arg(&img).arg(&mnt));
    assert!(alive(first[0]));

    drop(held);
    assert!(
        wait_for(60, || !alive(first[0])),
        "the first server did not exit once its last file was closed"
    );
    assert!(
        is_mounted(&mnt),
        "the first server unmounted the second mount"
    );
    assert_eq!(std::fs::read(mnt.join("f0003.txt")).unwrap(), want);
    run_ok(archfs().arg("unmount").arg(&mnt));
}

/// Running or sleeping, not exited (a zombie's parent may never reap it in a container).
fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(") ").map(|(_, rest)| !rest.starts_with('Z')))
        .unwrap_or(false)
}
