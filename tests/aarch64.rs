//! The aarch64 build (Grace-Hopper nodes), run under Debian's qemu-user: the binary the
//! aarch64 wheel ships (scripts/wheel --target aarch64 leaves it in target/bin/aarch64;
//! scripts/test builds it first) mounts every format like the x86_64 build, with 4 KiB
//! and with 64 KiB pages, falls back to one FUSE descriptor (qemu has no clone ioctl),
//! leaves no mount when killed, and its inspection commands print what x86_64's print.
//! What emulation cannot prove (a real arm64 kernel's FUSE, its page cache at 64 KiB, the
//! speed) is said in docs/FORMATS.md, with the command to run on a real node.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::tree::CompareOpts;
use common::*;

/// The guest page sizes tried: qemu's default (the host's 4 KiB) and a 64 KiB-page
/// kernel's, as `qemu-aarch64 -p` (QEMU_PAGESIZE) gives it to the program.
const PAGES: [Option<u32>; 2] = [None, Some(65536)];

fn arm_bin() -> PathBuf {
    let bin = std::env::var_os("ARCHFS_AARCH64_BIN").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bin/aarch64/archfs"),
        PathBuf::from,
    );
    assert!(
        bin.exists(),
        "no aarch64 build at {bin:?}: run scripts/wheel --target aarch64 (scripts/test does)"
    );
    assert!(
        Path::new("/proc/sys/fs/binfmt_misc/qemu-aarch64").exists(),
        "the kernel does not run aarch64 programs under qemu: run scripts/setup"
    );
    bin
}

/// The aarch64 `archfs`, run through binfmt_misc (it starts itself again for its server
/// and watchdog, so qemu must be the kernel's choice, not only this command's).
fn arm(page: Option<u32>) -> Command {
    let mut cmd = Command::new(arm_bin());
    cmd.env("QEMU_LD_PREFIX", "/usr/aarch64-linux-gnu");
    match page {
        Some(p) => cmd.env("QEMU_PAGESIZE", p.to_string()),
        None => cmd.env_remove("QEMU_PAGESIZE"),
    };
    cmd
}

/// A mount by the aarch64 build, unmounted on drop; `log` is what `archfs mount` said.
struct ArmMount {
    path: PathBuf,
    log: String,
}

impl ArmMount {
    fn new(page: Option<u32>, archive: &Path, mnt: &Path) -> ArmMount {
        // The page size the server sees, and its word on the FUSE descriptor.
        let out = run_ok(
            arm(page)
                .env("ARCHFS_LOG", "warn,archfs::job::mount=debug")
                .arg("mount")
                .arg(archive)
                .arg(mnt),
        );
        assert!(
            is_mounted(mnt),
            "{archive:?}: archfs mount returned 0, no mount"
        );
        ArmMount {
            path: mnt.to_owned(),
            log: stderr_of(&out),
        }
    }
}

impl Drop for ArmMount {
    fn drop(&mut self) {
        if is_mounted(&self.path) {
            let _ = archfs().arg("unmount").arg(&self.path).status();
            let _ = Command::new("umount").arg("-l").arg(&self.path).status();
        }
    }
}

fn page_name(page: Option<u32>) -> String {
    page.map_or("default pages".into(), |p| format!("{} KiB pages", p >> 10))
}

/// Archives of the awkward tree in every format, each with the tree it must show: the
/// source for mksquashfs's images, what `tar -x` extracts for GNU tar's, and for
/// gensquashfs (which keeps no hard links and counts links its own way) and bsdtar the
/// x86_64 build's mount (`None`), which tests/conformance.rs and tests/tar.rs hold equal
/// to the kernel's and to the source.
fn every_format(dir: &TempDir, src: &Path) -> Vec<(String, PathBuf, Option<PathBuf>, CompareOpts)> {
    let mut out = Vec::new();
    let strict = CompareOpts::default();
    for comp in ["gzip", "zstd", "xz", "lz4", "lzo"] {
        let img = dir.join(format!("mksquashfs-{comp}.sqfs"));
        mksquashfs(src, &img, &["-comp", comp, "-b", "64K"]);
        out.push((
            format!("mksquashfs {comp}"),
            img,
            Some(src.to_owned()),
            strict.clone(),
        ));
    }
    let img = dir.join("gensquashfs.sqfs");
    run_ok(
        Command::new("gensquashfs")
            .args(["-q", "-k", "-x", "-b", "65536", "-D"])
            .arg(src)
            .arg(&img),
    );
    out.push(("gensquashfs".into(), img, None, strict.clone()));
    for (name, flags) in [
        ("tar", &[][..]),
        ("tar.gz", &["-z"][..]),
        ("tar.zst", &["--zstd"][..]),
        ("tar.xz", &["-J"][..]),
        ("tar.bz2", &["-j"][..]),
    ] {
        let tar = dir.join(format!("gnu.{name}"));
        run_ok(
            Command::new("tar")
                .args(["--format=posix", "--xattrs", "--xattrs-include=user.*"])
                .args(flags)
                .arg("-cf")
                .arg(&tar)
                .arg("-C")
                .arg(src)
                .arg("."),
        );
        let ex = dir.join(format!("extracted-{name}"));
        extract(&tar, &ex);
        let opts = CompareOpts {
            root_attrs: true,
            ..CompareOpts::default()
        };
        out.push((format!("GNU {name}"), tar, Some(ex), opts));
    }
    let tar = dir.join("bsdtar.tar");
    run_ok(
        Command::new("bsdtar")
            .arg("-cf")
            .arg(&tar)
            .arg("-C")
            .arg(src)
            .arg("."),
    );
    // GNU tar's extraction of bsdtar's member order leaves some directory times at "now"
    // (tests/tar.rs compares bsdtar's archive with the source): the x86_64 mount here.
    out.push(("bsdtar".into(), tar, None, CompareOpts::default()));
    out
}

#[test]
fn the_aarch64_build_mounts_every_format_as_the_source_with_4k_and_64k_pages() {
    let dir = TempDir::new_in(Path::new("/dev/shm"), "arm-formats");
    let src = small_awkward_tree(&dir);
    let archives = every_format(&dir, &src);
    for page in PAGES {
        for (what, archive, reference, opts) in &archives {
            let what = format!("aarch64, {}: {what}", page_name(page));
            let mnt = dir.join("mnt");
            let x86 = reference
                .is_none()
                .then(|| Mount::new(archive, &dir.join("x86"), &[]));
            let reference = reference
                .as_deref()
                .or(x86.as_ref().map(|m| m.path.as_path()));
            let m = ArmMount::new(page, archive, &mnt);
            common::suite::check_mount(reference.unwrap(), &m.path, opts, &what);
            drop(m);
            drop(x86);
            assert!(
                wait_for(60, || !is_mounted(&mnt)),
                "{what}: still mounted after unmount"
            );
        }
        // The sample shipped in the repository, against the x86_64 build's mount of it.
        let sample = Path::new(env!("CARGO_MANIFEST_DIR")).join("sample/sample.sqfs");
        let x86 = Mount::new(&sample, &dir.join("x86"), &[]);
        let m = ArmMount::new(page, &sample, &dir.join("mnt"));
        let strict = CompareOpts {
            root_attrs: true,
            ..CompareOpts::default()
        };
        let what = format!("aarch64, {}: sample.sqfs", page_name(page));
        common::suite::check_mount(&x86.path, &m.path, &strict, &what);
        let size = page.unwrap_or(4096);
        assert!(
            m.log.contains(&format!("page size {size} bytes")),
            "{what}: the server did not see {size}-byte pages: {:?}",
            m.log
        );
        // qemu-user has no FUSE_DEV_IOC_CLONE: the threads share one descriptor.
        assert!(
            m.log.contains("cannot clone FUSE descriptors"),
            "{what}: no word of the shared descriptor in {:?}",
            m.log
        );
    }
}

/// The one server process of the aarch64 mount on `mnt`.
fn server(mnt: &Path) -> i32 {
    let mut pids = Vec::new();
    assert!(
        wait_for(60, || {
            pids = pids_of_mount(mnt);
            pids.len() == 1
        }),
        "one server for {mnt:?}: {pids:?}"
    );
    pids[0]
}

#[test]
fn killing_the_aarch64_server_by_sigterm_or_sigkill_leaves_no_mount() {
    let dir = TempDir::new("arm-kill");
    let src = small_awkward_tree(&dir);
    let img = dir.join("img.sqfs");
    mksquashfs(&src, &img, &["-comp", "zstd"]);
    let file = common::tree::list_files(&src)
        .pop()
        .expect("a file in the tree");
    for page in PAGES {
        for sig in [libc::SIGTERM, libc::SIGKILL] {
            let what = format!("aarch64, {}, signal {sig}", page_name(page));
            let mnt = dir.join("mnt");
            let m = ArmMount::new(page, &img, &mnt);
            // A file held open and read from, as a DataLoader worker's is when the job
            // ends: the mount must go all the same.
            let mut held = std::fs::File::open(mnt.join(&file)).unwrap();
            let mut head = [0u8; 100];
            let _ = std::io::Read::read(&mut held, &mut head).unwrap();
            kill(server(&mnt), sig);
            let gone = wait_for(120, || !is_mounted(&mnt));
            drop(held);
            assert!(
                gone,
                "{what}: {mnt:?} still mounted 120 s after the server died"
            );
            drop(m);
        }
    }
}

fn outputs(cmd: &mut Command) -> (Option<i32>, Vec<u8>, String) {
    let out: Output = cmd.output().unwrap();
    let err = stderr_of(&out);
    (out.status.code(), out.stdout, err)
}

#[test]
fn info_ls_cat_and_check_print_what_the_x86_64_build_prints() {
    let dir = TempDir::new("arm-inspect");
    let src = small_awkward_tree(&dir);
    let img = dir.join("img.sqfs");
    mksquashfs(&src, &img, &["-comp", "xz"]);
    let tar = dir.join("data.tar.gz");
    run_ok(
        Command::new("tar")
            .arg("-czf")
            .arg(&tar)
            .arg("-C")
            .arg(&src)
            .arg("."),
    );
    let sample = Path::new(env!("CARGO_MANIFEST_DIR")).join("sample/sample.sqfs");
    // A damaged copy: `check` must find the same damage and exit 1 on both.
    let damaged = dir.join("damaged.sqfs");
    let mut bytes = std::fs::read(&img).unwrap();
    let mid = bytes.len() / 3;
    for b in &mut bytes[mid..mid + 64] {
        *b ^= 0x5a;
    }
    std::fs::write(&damaged, bytes).unwrap();
    // x86_64 reads first and saves the tar's index beside it: aarch64 reads that index.
    let file = common::tree::list_files(&src)
        .into_iter()
        .find(|p| p.starts_with("files"))
        .expect("a file under files/");
    let file = file.to_str().unwrap().to_owned();
    for archive in [&sample, &img, &tar, &damaged] {
        let a = archive.to_str().unwrap();
        for args in [
            vec!["info", a],
            vec!["ls", a],
            vec!["ls", a, "bigdir"],
            vec!["cat", a, &file],
            vec!["check", a],
        ] {
            if archive == &sample && args[0] == "cat" {
                continue;
            }
            let x86 = outputs(archfs().args(&args));
            for page in PAGES {
                let arm = outputs(arm(page).args(&args));
                assert_eq!(
                    (arm.0, &arm.1),
                    (x86.0, &x86.1),
                    "archfs {args:?}, aarch64 with {} against x86_64: stderr {:?} / {:?}",
                    page_name(page),
                    arm.2,
                    x86.2
                );
            }
        }
    }
}
