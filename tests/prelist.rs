//! The listing ahead (src/prelist.rs): once the mount is live a process of the server's
//! lists every directory through it, so the kernel knows every name: a stat or open of any
//! path then needs no LOOKUP request, and listings served from the kernel's cache still
//! show the archive's tree.

mod common;

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
/// does), compares the trees, unmounts; returns the LOOKUP requests the server served.
fn lookups(
    archive: &Path,
    expected: &Path,
    dir: &TempDir,
    prelist: &str,
    opts: &CompareOpts,
) -> u64 {
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
    let log = log_of(&log);
    log.lines()
        .find_map(|l| {
            l.split("served ")
                .nth(1)?
                .strip_suffix(" LOOKUP requests")?
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no LOOKUP count in the log: {log}"))
}

fn check(archive: &Path, expected: &Path, dir: &TempDir, opts: &CompareOpts) {
    let (_, entries, _) = count(expected);
    assert_eq!(
        lookups(archive, expected, dir, "auto", opts),
        0,
        "{archive:?}: names looked up after the listing ahead"
    );
    // Without it, every name is a LOOKUP: what the assertion above would see.
    let without = lookups(archive, expected, dir, "never", opts);
    assert!(
        without >= entries,
        "{archive:?}: {without} LOOKUPs for {entries} entries without the listing ahead"
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
