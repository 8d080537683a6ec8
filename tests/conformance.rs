//! Mounted trees equal their source and what the kernel's squashfs driver shows for the
//! same image: names, types, modes, owners, sizes, mtimes, symlink targets, hard links,
//! xattrs and every byte. Images come from mksquashfs (every compressor and layout
//! option), gensquashfs and tar2sqfs, built at test time from the awkward tree.

mod common;

use std::path::Path;
use std::process::Command;

use common::tree::{make_awkward_tree, CompareOpts, TreeSpec};
use common::*;

fn awkward(dir: &TempDir, spec: TreeSpec) -> std::path::PathBuf {
    let src = dir.join("src");
    std::fs::create_dir(&src).unwrap();
    make_awkward_tree(&src, &spec).unwrap();
    src
}

fn small_spec() -> TreeSpec {
    TreeSpec {
        sparse_4g: false,
        ..TreeSpec::default()
    }
}

/// The kernel driver's view of `img`, unmounted on drop.
struct KernelMount(std::path::PathBuf);

impl KernelMount {
    fn new(img: &Path, mnt: &Path) -> KernelMount {
        std::fs::create_dir_all(mnt).unwrap();
        run_ok(
            Command::new("mount")
                .args(["-t", "squashfs", "-o", "loop,ro"])
                .arg(img)
                .arg(mnt),
        );
        KernelMount(mnt.to_owned())
    }
}

impl Drop for KernelMount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

fn assert_same(expected: &Path, actual: &Path, opts: &CompareOpts, what: &str) {
    common::suite::check_mount(expected, actual, opts, what);
}

/// Mounts `img` with archfs and compares it with `src` (when given) and with the
/// kernel driver's mount of the same image.
fn check_image(dir: &TempDir, img: &Path, src: Option<&Path>, opts: &CompareOpts, what: &str) {
    let mnt = dir.join("mnt");
    let m = Mount::new(img, &mnt, &["--cache-size", "64M"]);
    if let Some(src) = src {
        assert_same(src, &m.path, opts, &format!("{what}: source vs archfs"));
    }
    let kmnt = dir.join("kernel");
    let _k = KernelMount::new(img, &kmnt);
    let strict = CompareOpts {
        root_attrs: true,
        ..CompareOpts::default()
    };
    assert_same(
        &kmnt,
        &m.path,
        &strict,
        &format!("{what}: kernel vs archfs"),
    );
}

#[test]
fn full_tree_with_sparse_4g_file_gzip() {
    let dir = TempDir::new("conf-full");
    let src = awkward(&dir, TreeSpec::default());
    let img = dir.join("img.sqfs");
    mksquashfs(&src, &img, &[]);
    check_image(&dir, &img, Some(&src), &CompareOpts::default(), "gzip");
}

fn compressor(comp: &str, extra: &[&str]) {
    let dir = TempDir::new(&format!("conf-{comp}"));
    let src = awkward(&dir, small_spec());
    let img = dir.join("img.sqfs");
    let mut args = vec!["-comp", comp];
    args.extend_from_slice(extra);
    mksquashfs(&src, &img, &args);
    check_image(&dir, &img, Some(&src), &CompareOpts::default(), comp);
}

#[test]
fn xz() {
    compressor("xz", &["-Xbcj", "x86"]);
}

#[test]
fn lz4() {
    compressor("lz4", &["-Xhc"]);
}

#[test]
fn zstd() {
    compressor("zstd", &["-Xcompression-level", "19"]);
}

#[test]
fn lzo() {
    compressor("lzo", &[]);
}

#[test]
fn layouts_fragments_block_sizes_and_uncompressed() {
    let dir = TempDir::new("conf-layouts");
    let src = awkward(
        &dir,
        TreeSpec {
            big_dir_entries: 3000,
            ..small_spec()
        },
    );
    let img = dir.join("img.sqfs");
    for args in [
        &["-no-fragments"][..],
        &["-always-use-fragments", "-b", "4K"],
        &["-b", "1M", "-comp", "zstd"],
        &["-noI", "-noD", "-noF", "-noX"],
        &["-no-sparse", "-no-duplicates"],
    ] {
        mksquashfs(&src, &img, args);
        let mnt = dir.join("mnt");
        let m = Mount::new(&img, &mnt, &["--cache-size", "8M"]);
        assert_same(&src, &m.path, &CompareOpts::default(), &format!("{args:?}"));
    }
    mksquashfs(&src, &img, &["-no-xattrs", "-all-root"]);
    let m = Mount::new(&img, &dir.join("mnt"), &[]);
    let lossy = CompareOpts {
        xattrs: false,
        owners: false,
        ..CompareOpts::default()
    };
    assert_same(&src, &m.path, &lossy, "-no-xattrs -all-root");
    assert!(xattr_names(&m.path.join("xattrs")).is_empty());
}

fn xattr_names(p: &Path) -> String {
    let out = run_ok(
        Command::new("getfattr")
            .args(["--absolute-names", "-R", "-d"])
            .arg(p),
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn gensquashfs_and_tar2sqfs_images_match_the_kernel() {
    let dir = TempDir::new("conf-ng");
    let src = awkward(
        &dir,
        TreeSpec {
            big_dir_entries: 5000,
            ..small_spec()
        },
    );
    let img = dir.join("gen.sqfs");
    run_ok(
        Command::new("gensquashfs")
            .args(["--pack-dir"])
            .arg(&src)
            .args([
                "--keep-time",
                "--keep-xattr",
                "--quiet",
                "--force",
                "-c",
                "zstd",
            ])
            .arg(&img),
    );
    check_image(&dir, &img, None, &CompareOpts::default(), "gensquashfs");

    let tar = dir.join("src.tar");
    run_ok(
        Command::new("tar")
            .args([
                "--format=posix",
                "--xattrs",
                "--xattrs-include=user.*",
                "-C",
            ])
            .arg(&src)
            .args(["-cf"])
            .arg(&tar)
            .arg("."),
    );
    let img2 = dir.join("tar.sqfs");
    let out = run_ok(Command::new("sh").arg("-c").arg(format!(
        "tar2sqfs --quiet --force -c gzip {} < {}",
        img2.display(),
        tar.display()
    )));
    drop(out);
    check_image(&dir, &img2, None, &CompareOpts::default(), "tar2sqfs");
}

#[test]
fn statfs_reports_the_image_totals() {
    let dir = TempDir::new("conf-statfs");
    let src = awkward(
        &dir,
        TreeSpec {
            big_dir_entries: 100,
            ..small_spec()
        },
    );
    let img = dir.join("img.sqfs");
    mksquashfs(&src, &img, &["-b", "64K"]);
    let m = Mount::new(&img, &dir.join("mnt"), &[]);
    let info =
        String::from_utf8(run_ok(Command::new(common::archfs_bin()).arg("info").arg(&img)).stdout)
            .unwrap();
    let inodes: u64 = info
        .lines()
        .find_map(|l| l.strip_prefix("inodes:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let out = run_ok(
        Command::new("stat")
            .args(["-f", "-c", "%S %b %c %l"])
            .arg(&m.path),
    );
    let fields: Vec<u64> = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(|f| f.parse().unwrap())
        .collect();
    let size = std::fs::metadata(&img).unwrap().len();
    assert_eq!(fields[0], 65536, "block size");
    assert!(
        fields[1] * 65536 >= size - 4096 && fields[1] * 65536 <= size + 65536,
        "blocks {fields:?}"
    );
    assert_eq!(fields[2], inodes, "inodes");
    assert_eq!(fields[3], 256, "name max");
}
