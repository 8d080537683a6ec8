//! The listing ahead (src/warm/prelist.rs): once the mount is live a process of the server's
//! lists every directory through it, so the kernel knows every name: a stat or open of any
//! path then needs no LOOKUP request, and listings served from the kernel's cache still
//! show the archive's tree.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::tree::{compare_trees, CompareOpts};
use common::*;

const DEADLINE: u64 = 60;

/// Directories (the root included) and entries under `root`, symlinks not followed.
fn count(root: &Path) -> (u64, u64, Vec<PathBuf>) {
    let (mut dirs, mut entries, mut paths) = (0, 0, Vec::new());
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        dirs += 1;
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            entries += 1;
            let p = e.path();
            if e.file_type().unwrap().is_dir() {
                stack.push(p.clone());
            }
            paths.push(p.strip_prefix(root).unwrap().to_path_buf());
        }
    }
    (dirs, entries, paths)
}

fn log_of(log: &Path) -> String {
    std::fs::read_to_string(log).unwrap_or_default()
}

/// Mounts `archive`, waits for the listing ahead unless `--prelist=never`, stats every
/// path of `expected` by its name (no listing first, as a dataset indexed by a file list
/// does), compares the trees (listing every directory), unmounts; returns the LOOKUP
/// requests the server served and the READDIR requests of the job's listings.
fn lookups(
    archive: &Path,
    expected: &Path,
    dir: &TempDir,
    prelist: &str,
    opts: &CompareOpts,
) -> (u64, u64) {
    let (dirs, entries, paths) = count(expected);
    let mnt = dir.join(format!("mnt-{prelist}"));
    let log = dir.join(format!("server-{prelist}.log"));
    let _ = std::fs::remove_file(&log);
    std::fs::create_dir_all(&mnt).unwrap();
    run_ok(
        archfs()
            .arg("mount")
            .arg(format!("--prelist={prelist}"))
            .arg("--log")
            .arg(&log)
            .arg(archive)
            .arg(&mnt)
            .env("ARCHFS_LOG", "info"),
    );
    if prelist == "auto" {
        let want = format!("listed {dirs} directories ({entries} entries) ahead");
        assert!(
            wait_for(DEADLINE, || log_of(&log).contains(&want)),
            "{archive:?}: no `{want}` in the log: {}",
            log_of(&log)
        );
        // The finished lister is reaped, not left a zombie until unmount.
        let server = pids_of_mount(&mnt);
        assert_eq!(server.len(), 1, "one server for {mnt:?}: {server:?}");
        assert!(
            wait_for(DEADLINE, || zombie_children(server[0]).is_empty()),
            "{archive:?}: zombie children of the server after the listing: {:?}",
            zombie_children(server[0])
        );
    }
    for p in &paths {
        std::fs::symlink_metadata(mnt.join(p)).unwrap_or_else(|e| panic!("{p:?}: {e}"));
    }
    let diffs = compare_trees(expected, &mnt, opts);
    assert!(
        diffs.is_empty(),
        "{archive:?} with --prelist={prelist}: {diffs:#?}"
    );
    run_ok(archfs().arg("unmount").arg(&mnt));
    (served_lookups(&log), served_job_listings(&log))
}

/// `archfs mount ARCHIVE MNT`, its log at `log` filtered by `filter`.
fn mount_logged(archive: &Path, mnt: &Path, log: &Path, filter: &str) -> Command {
    let mut cmd = archfs();
    cmd.args(["mount", "--log"])
        .arg(log)
        .arg(archive)
        .arg(mnt)
        .env("ARCHFS_LOG", filter);
    cmd
}

/// Children of `parent` that have ended and not been reaped.
fn zombie_children(parent: i32) -> Vec<i32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // "PID (COMM) STATE PPID ...": COMM may hold spaces and parentheses.
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let mut f = rest.split_whitespace();
        let (state, ppid) = (f.next(), f.next().and_then(|p| p.parse::<i32>().ok()));
        if state == Some("Z") && ppid == Some(parent) {
            out.push(pid);
        }
    }
    out
}

/// The server's count of LOOKUP requests, logged at unmount.
fn served_lookups(log: &Path) -> u64 {
    logged_count(log, "served ", " LOOKUP requests")
}

/// The count in the server's line `BEFORE<count>AFTER`.
fn logged_count(log: &Path, before: &str, after: &str) -> u64 {
    let log = log_of(log);
    log.lines()
        .find_map(|l| l.split(before).nth(1)?.strip_suffix(after)?.parse().ok())
        .unwrap_or_else(|| panic!("no `{before}N{after}` in the log: {log}"))
}

/// The server's count of READDIR(PLUS) requests of the job's listings, logged at unmount.
fn served_job_listings(log: &Path) -> u64 {
    logged_count(log, "the job's listings sent ", " READDIR requests")
}

/// How many of the names (or directories) the listing ahead put in the kernel's caches
/// may be looked up (listed) again: the kernel frees unused cached names and directory
/// pages when the machine's memory fills with page cache, whatever their timeout. On a
/// busy CI machine 31 of 2,0xx names came back as LOOKUPs; without the listing ahead all
/// of them do.
fn reclaimed(of: u64) -> u64 {
    of / 20
}

fn check(archive: &Path, expected: &Path, dir: &TempDir, opts: &CompareOpts) {
    let (dirs, entries, _) = count(expected);
    let with = lookups(archive, expected, dir, "auto", opts);
    assert!(
        with.0 <= reclaimed(entries),
        "{archive:?}: {} of {entries} names looked up after the listing ahead",
        with.0
    );
    // The comparison's listings came from the kernel, which kept the lister's.
    assert!(
        with.1 <= reclaimed(dirs),
        "{archive:?}: {} of the job's listings of {dirs} directories reached the server \
         after the listing ahead",
        with.1
    );
    // Without it, every name is a LOOKUP and every listing a request: what the
    // assertions above would see.
    let without = lookups(archive, expected, dir, "never", opts);
    assert!(
        without.0 >= entries,
        "{archive:?}: {} LOOKUPs for {entries} entries without the listing ahead",
        without.0
    );
    assert!(
        without.1 >= dirs,
        "{archive:?}: {} READDIRs for {dirs} directories without the listing ahead",
        without.1
    );
}

#[test]
fn after_the_listing_ahead_no_name_is_looked_up_in_a_squashfs_image() {
    let dir = TempDir::new("prelist-sqfs");
    let src = small_awkward_tree(&dir);
    let img = dir.join("t.sqfs");
    mksquashfs(&src, &img, &[]);
    check(&img, &src, &dir, &CompareOpts::default());
}

#[test]
fn after_the_listing_ahead_no_name_is_looked_up_in_a_tar() {
    let dir = TempDir::new("prelist-tar");
    let src = small_awkward_tree(&dir);
    let tar = dir.join("t.tar");
    run_ok(
        Command::new("tar")
            .args(["--format=posix", "-cf"])
            .arg(&tar)
            .arg("-C")
            .arg(&src)
            .arg("."),
    );
    let ex = dir.join("extracted");
    extract(&tar, &ex);
    let opts = CompareOpts {
        xattrs: false,
        ..CompareOpts::default()
    };
    check(&tar, &ex, &dir, &opts);
}

/// The job's own listings make no inodes (so ImageFolder's index is as fast as on a plain
/// directory), and the listing ahead makes them all, also for directories the job listed
/// first and the kernel has cached.
#[test]
fn the_jobs_listings_make_no_inodes_and_the_lister_makes_them_all() {
    let dir = TempDir::new("prelist-job-first");
    // `big` is what the lister lists last (last directory first); the 90,000 names
    // before it keep it busy for a few tenths of a second after the mount.
    let tar = dir.join("names.tar");
    let script = "import sys,tarfile\n\
        def d(t, n):\n\
        \x20   i = tarfile.TarInfo(n); i.type = tarfile.DIRTYPE; i.mode = 0o755; t.addfile(i)\n\
        with tarfile.open(sys.argv[1], 'w') as t:\n\
        \x20   d(t, 'big')\n\
        \x20   for i in range(2000): t.addfile(tarfile.TarInfo(f'big/f{i}'))\n\
        \x20   for c in range(300):\n\
        \x20       d(t, f'd{c:03}')\n\
        \x20       for i in range(300): t.addfile(tarfile.TarInfo(f'd{c:03}/f{i}'))\n";
    run_ok(Command::new("python3").args(["-c", script]).arg(&tar));
    let names = |n: usize| -> Vec<String> {
        let mut v: Vec<String> = (0..n).map(|i| format!("f{i}")).collect();
        v.sort();
        v
    };
    let listed = |d: &Path| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    };
    let mnt = dir.join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let log = dir.join("server.log");
    let big = mnt.join("big");
    let mut caught = false;
    for _ in 0..10 {
        let _ = std::fs::remove_file(&log);
        run_ok(
            mount_logged(&tar, &mnt, &log, "info,archfs::warm::prelist=debug")
                .env("ARCHFS_PRELIST_THREADS", "1"),
        );
        // Past the root (listed first, then the last directory), so the job finds every
        // directory known and looks up only the files it stats.
        let past_root = format!("listing {}", mnt.join("d299").display());
        wait_for(DEADLINE, || log_of(&log).contains(&past_root));
        let listers = lister_pids(&mnt);
        for &p in &listers {
            kill(p, libc::SIGSTOP);
        }
        // Stopped once every thread is; one inside a request stops when it returns.
        let stopped = |p: i32| {
            let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) else {
                return true;
            };
            tasks.flatten().all(|t| {
                std::fs::read_to_string(t.path().join("stat")).map_or(true, |s| {
                    s.rsplit(')')
                        .next()
                        .unwrap()
                        .trim_start()
                        .starts_with(['T', 't', 'Z', 'X'])
                })
            })
        };
        assert!(wait_for(DEADLINE, || listers.iter().all(|&p| stopped(p))));
        if !listers.is_empty() && !log_of(&log).contains(&format!("listing {}", big.display())) {
            caught = true;
            break;
        }
        for &p in &listers {
            kill(p, libc::SIGCONT);
        }
        run_ok(archfs().arg("unmount").arg(&mnt));
    }
    assert!(
        caught,
        "the lister reached {big:?} before it could be stopped, 10 times"
    );

    // The job lists `big` first: no inodes, so each stat is a LOOKUP.
    assert_eq!(listed(&big), names(2000));
    for i in 0..2000 {
        std::fs::symlink_metadata(big.join(format!("f{i}"))).unwrap();
    }
    // And the rest of the tree, filling the kernel's listing cache.
    for c in 0..300 {
        assert_eq!(listed(&mnt.join(format!("d{c:03}"))), names(300));
    }
    for &p in &lister_pids(&mnt) {
        kill(p, libc::SIGCONT);
    }
    let want = "listed 302 directories (92301 entries) ahead";
    assert!(
        wait_for(DEADLINE, || log_of(&log).contains(want)),
        "no `{want}` in the log: {}",
        log_of(&log)
    );
    // Every name is known now, the cached directories' included.
    for c in 0..300 {
        for i in 0..300 {
            std::fs::symlink_metadata(mnt.join(format!("d{c:03}/f{i}"))).unwrap();
        }
    }
    assert_eq!(listed(&big), names(2000));
    run_ok(archfs().arg("unmount").arg(&mnt));
    // One for each file of `big` stat'ed before the lister listed it, (nearly) none after.
    let looked_up = served_lookups(&log);
    assert!(
        (2000..=2000 + reclaimed(90_000)).contains(&looked_up),
        "{looked_up} LOOKUPs: 2000 before the listing ahead, and after it"
    );
}

/// The job lists a large directory while the lister lists it too (a training script
/// listing its flat root as soon as the mount is live): the two do not share the
/// kernel's cache of that listing, so the lister still makes every inode. When they did,
/// the job's listing, without attributes, ran ahead and the lister read on from its
/// cache: at 200,000 names, 111,000-117,000 LOOKUPs after the listing ahead had "listed"
/// them all.
#[test]
fn the_job_listing_beside_the_lister_leaves_no_name_to_look_up() {
    let dir = TempDir::new("prelist-side-by-side");
    let tar = dir.join("flat.tar");
    let n = 200_000;
    let script = "import sys,tarfile\n\
        with tarfile.open(sys.argv[1], 'w') as t:\n\
        \x20   for i in range(int(sys.argv[2])): t.addfile(tarfile.TarInfo(f'f{i:06}'))\n";
    run_ok(
        Command::new("python3")
            .args(["-c", script])
            .arg(&tar)
            .arg(n.to_string()),
    );
    let mnt = dir.join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let log = dir.join("server.log");
    run_ok(&mut mount_logged(&tar, &mnt, &log, "info"));
    assert_eq!(std::fs::read_dir(&mnt).unwrap().count(), n);
    let want = format!("listed 1 directories ({n} entries) ahead");
    assert!(
        wait_for(DEADLINE, || log_of(&log).contains(&want)),
        "no `{want}` in the log: {}",
        log_of(&log)
    );
    for i in 0..n {
        std::fs::symlink_metadata(mnt.join(format!("f{i:06}"))).unwrap();
    }
    run_ok(archfs().arg("unmount").arg(&mnt));
    let looked_up = served_lookups(&log);
    assert!(
        looked_up < n as u64 / 100,
        "{looked_up} LOOKUPs for {n} names the lister had listed"
    );
}
