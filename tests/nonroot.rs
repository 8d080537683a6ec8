//! An ordinary user mounts, reads and unmounts through fusermount3, and the watchdog
//! cleans up after a killed server without root. Everything the user runs and reads is
//! staged under /tmp, wherever the checkout is (CI may clone into a private directory).

use crate::common;

use std::path::Path;

use common::user::{Stage, Who};
use common::*;

fn mount_line(mnt: &Path) -> Option<String> {
    let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let m = mnt.to_str().unwrap();
    table
        .lines()
        .find(|l| l.split(' ').nth(4) == Some(m))
        .map(str::to_owned)
}

#[test]
fn an_ordinary_user_mounts_reads_and_unmounts() {
    let who = Who::user();
    let Who::User { uid, .. } = who else {
        unreachable!()
    };
    let stage = Stage::new("nonroot", who);
    let dir = &stage.dir;
    let src = dir.join("src");
    std::fs::create_dir(&src).unwrap();
    std::fs::write(src.join("hello.txt"), b"hello from a user mount\n").unwrap();
    let img = dir.join("img.sqfs");
    mksquashfs(&src, &img, &[]);
    let home = &stage.work;
    let mnt = home.join("mnt");
    let bin = stage.bin.as_os_str();
    let as_user =
        |args: &[&std::ffi::OsStr]| stage.command(args[0]).args(&args[1..]).output().unwrap();

    let out = as_user(&[bin, "mount".as_ref(), img.as_os_str(), mnt.as_os_str()]);
    assert!(
        out.status.success(),
        "user mount failed: {}",
        stderr_of(&out)
    );
    let line = mount_line(&mnt).expect("mounted");
    assert!(
        line.contains(&format!("user_id={uid}")),
        "not a user mount: {line}"
    );
    assert!(
        line.contains(" - fuse.archfs ") && line.contains(" ro,"),
        "type or options lost on the way through fusermount3: {line}"
    );
    let out = as_user(&["cat".as_ref(), mnt.join("hello.txt").as_os_str()]);
    assert_eq!(
        out.stdout,
        b"hello from a user mount\n",
        "{}",
        stderr_of(&out)
    );
    let out = as_user(&[bin, "unmount".as_ref(), mnt.as_os_str()]);
    assert!(
        out.status.success(),
        "user unmount failed: {}",
        stderr_of(&out)
    );
    assert!(mount_line(&mnt).is_none());
    assert!(!mnt.exists(), "created mount point left behind");

    // The server dies by SIGKILL: the watchdog unmounts through fusermount3 as the user.
    let out = as_user(&[bin, "mount".as_ref(), img.as_os_str(), mnt.as_os_str()]);
    assert!(out.status.success(), "{}", stderr_of(&out));
    let pids = pids_of_mount(&mnt);
    assert_eq!(pids.len(), 1, "server pids {pids:?}");
    // SAFETY: kill has no memory preconditions.
    unsafe { libc::kill(pids[0], libc::SIGKILL) };
    assert!(
        wait_for(60, || mount_line(&mnt).is_none()),
        "stale user mount after SIGKILL"
    );

    // A mount point the user may not write: one clear line that says what to do.
    let root_dir = dir.join("root-owned");
    std::fs::create_dir(&root_dir).unwrap();
    let out = as_user(&[bin, "mount".as_ref(), img.as_os_str(), root_dir.as_os_str()]);
    assert!(!out.status.success());
    let err = stderr_of(&out);
    assert!(err.contains("a directory you own"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");

    // A tar beside which the user cannot write: its index goes to the user's cache.
    let tar = dir.join("data.tar");
    tar_of(&src, "hello.txt", &tar);
    let cache = home.join("cache");
    let out = stage
        .command(bin)
        .arg("run")
        .arg(&tar)
        .arg(&mnt)
        .args(["--", "cat"])
        .arg(mnt.join("hello.txt"))
        .env("XDG_CACHE_HOME", &cache)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert_eq!(out.stdout, b"hello from a user mount\n");
    assert!(!dir.join("data.tar.archfs-index").exists());
    let saved: Vec<_> = std::fs::read_dir(cache.join("archfs")).unwrap().collect();
    assert_eq!(saved.len(), 1, "index saved in $XDG_CACHE_HOME/archfs");

    // allow_other (root's mount here): another user can read only with it.
    let rootmnt = dir.join("rootmnt");
    for (opts, readable) in [(&["-o", "allow_other"][..], true), (&[][..], false)] {
        let m = Mount::new(&img, &rootmnt, opts);
        let out = as_user(&["cat".as_ref(), m.path.join("hello.txt").as_os_str()]);
        assert_eq!(
            out.status.success(),
            readable,
            "{opts:?}: {}",
            stderr_of(&out)
        );
    }

    // `archfs run` as the user.
    let script = format!("cat {}/hello.txt", mnt.display());
    let out = as_user(&[
        bin,
        "run".as_ref(),
        img.as_os_str(),
        mnt.as_os_str(),
        "--".as_ref(),
        "sh".as_ref(),
        "-c".as_ref(),
        script.as_ref(),
    ]);
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert_eq!(out.stdout, b"hello from a user mount\n");
    assert!(mount_line(&mnt).is_none());
}
