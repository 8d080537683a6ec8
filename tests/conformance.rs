//! Mounted trees equal their source and what the kernel's squashfs driver shows for the
//! same image: names, types, modes, owners, sizes, mtimes, symlink targets, hard links,
//! xattrs and every byte. Images come from mksquashfs (every compressor and layout
//! option), gensquashfs and tar2sqfs, built at test time from the awkward tree.

use crate::common;

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
    posix_tar(&src, &tar);
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

/// Writes `len` bytes of `seed`-derived data at `offset` of `path`.
fn write_at(path: &Path, offset: u64, len: usize, seed: u8) {
    use std::os::unix::fs::FileExt;
    let data: Vec<u8> = (0..len)
        .map(|i| (i as u8).wrapping_mul(seed) ^ seed)
        .collect();
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(&data, offset).unwrap();
}

/// A tree holding one sparse file of `size` bytes: data at the start, unaligned in the
/// middle and at the very end, holes between. Its block list is almost all zero entries,
/// so it compresses far below its 4 bytes a block.
fn sparse_tree(dir: &TempDir, size: u64) -> std::path::PathBuf {
    let src = dir.join("src");
    std::fs::create_dir(&src).unwrap();
    let f = src.join("sparse");
    std::fs::File::create(&f).unwrap().set_len(size).unwrap();
    write_at(&f, 0, 1000, 3);
    write_at(&f, size / 2 + 12_345, 300_000, 5);
    write_at(&f, size - 5000, 5000, 7);
    std::fs::write(src.join("small"), b"a small file beside it\n").unwrap();
    src
}

/// squashfs-tools-ng (gensquashfs, tar2sqfs) counts every entry of a directory in its link
/// count, so its images are compared with the kernel's view of them, and with the source
/// except for that.
/// `src` packed by mksquashfs and by gensquashfs, each mount compared with it.
fn check_both_tools(dir: &TempDir, src: &Path) {
    let img = dir.join("mk.sqfs");
    mksquashfs(src, &img, &[]);
    check_image(dir, &img, Some(src), &CompareOpts::default(), "mksquashfs");
    let img = dir.join("gen.sqfs");
    gensquashfs(src, &img, &[]);
    check_ng_image(dir, &img, src);
}

fn check_ng_image(dir: &TempDir, img: &Path, src: &Path) {
    check_image(dir, img, None, &CompareOpts::default(), "squashfs-tools-ng");
    let m = Mount::new(img, &dir.join("mnt"), &[]);
    let opts = CompareOpts {
        dir_nlink: false,
        ..CompareOpts::default()
    };
    assert_same(src, &m.path, &opts, "squashfs-tools-ng: source vs archfs");
}

fn gensquashfs(src: &Path, img: &Path, args: &[&str]) {
    run_ok(
        Command::new("gensquashfs")
            .arg("--pack-dir")
            .arg(src)
            .args(["--keep-time", "--keep-xattr", "--quiet", "--force"])
            .args(args)
            .arg(img),
    );
}

// Sparse files as large as each tool builds in about ten seconds here (each reads or
// zero-checks every block of the holes: mksquashfs 1 to 3 s a GiB here, gensquashfs 0.5 to 2 s,
// tar2sqfs 0.2 s, by load). The 16 TiB case is `huge_sparse_files_written_directly`.

#[test]
fn sparse_5_gib_file_from_mksquashfs() {
    let dir = TempDir::new("conf-sparse-mk");
    let src = sparse_tree(&dir, 5 << 30);
    let img = dir.join("img.sqfs");
    mksquashfs(&src, &img, &[]);
    check_image(
        &dir,
        &img,
        Some(&src),
        &CompareOpts::default(),
        "mksquashfs",
    );
}

#[test]
fn sparse_8_gib_file_from_gensquashfs() {
    let dir = TempDir::new("conf-sparse-gen");
    let src = sparse_tree(&dir, 8 << 30);
    let img = dir.join("img.sqfs");
    gensquashfs(&src, &img, &[]);
    check_ng_image(&dir, &img, &src);
}

#[test]
fn sparse_64_gib_file_from_tar2sqfs() {
    let dir = TempDir::new("conf-sparse-tar");
    let src = sparse_tree(&dir, 64 << 30);
    let tar = dir.join("src.tar");
    // GNU tar writes PAX 1.0 sparse members: the map, then only the data.
    run_ok(
        Command::new("tar")
            .args(["--format=posix", "--sparse", "-C"])
            .arg(&src)
            .arg("-cf")
            .arg(&tar)
            .args(["sparse", "small"]),
    );
    let img = dir.join("img.sqfs");
    run_ok(Command::new("sh").arg("-c").arg(format!(
        "tar2sqfs --quiet --force {} < {}",
        img.display(),
        tar.display()
    )));
    check_ng_image(&dir, &img, &src);
}

/// The directly written image of common/huge.rs, mounted. The kernel checks the writer
/// on a 64 GiB file; at 16 TiB it is no reference: past what its block list index covers
/// (some hundreds of GiB) it walks the list from its last index point for every page, two
/// seconds a 4 KiB read at the end here, and a readahead of the end took minutes. archfs
/// reads the 16 TiB file at its start, middle and end.
#[test]
fn huge_sparse_files_written_directly() {
    use common::huge::{HugeSparse, BLOCK};
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;
    let dir = TempDir::new("conf-huge");
    let spread = |size: u64| {
        let blocks = size / BLOCK;
        let mid = blocks / 2 + 12_345;
        HugeSparse {
            size,
            data: vec![0, mid, blocks - 1],
        }
    };

    let file = spread(64 << 30);
    let img = dir.join("64g.sqfs");
    file.write(&img);
    let m = Mount::new(&img, &dir.join("mnt"), &["--cache-size", "64M"]);
    let k = KernelMount::new(&img, &dir.join("kernel"));
    let ours = std::fs::File::open(m.path.join("big")).unwrap();
    let theirs = std::fs::File::open(k.0.join("big")).unwrap();
    assert_eq!(theirs.metadata().unwrap().len(), file.size);
    assert_eq!(ours.metadata().unwrap().len(), file.size);
    // SAFETY: a valid descriptor; advice only. Single pages, no readahead.
    unsafe { libc::posix_fadvise(theirs.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM) };
    let mid = file.data[1] * BLOCK;
    for off in [0, mid - 2048, mid + 100_000, 7 << 30, file.size - 4096] {
        let mut a = vec![0u8; 4096];
        let mut b = vec![0u8; 4096];
        ours.read_exact_at(&mut a, off).unwrap();
        theirs.read_exact_at(&mut b, off).unwrap();
        assert!(a == b, "archfs and the kernel differ at {off}");
        assert!(a == file.expected(off, 4096), "content at {off}");
    }
    drop((ours, theirs, m, k));

    let file = spread(16 << 40);
    let img = dir.join("16t.sqfs");
    file.write(&img);
    let m = Mount::new(&img, &dir.join("mnt"), &["--cache-size", "64M"]);
    let ours = std::fs::File::open(m.path.join("big")).unwrap();
    assert_eq!(ours.metadata().unwrap().len(), file.size);
    let mid = file.data[1] * BLOCK;
    for (off, len) in [
        (0, 200_000),
        (mid - 5000, 300_000),
        (7 << 40, 65536),
        (file.size - 100_000, 100_000),
    ] {
        let mut a = vec![0u8; len];
        ours.read_exact_at(&mut a, off).unwrap();
        assert!(a == file.expected(off, len), "content at {off}");
    }
}

/// 100,000 empty files in one directory: a listing of some 400 headers and 3 MiB that
/// spans hundreds of metadata blocks, an index of hundreds of entries, and an inode table
/// of near-identical inodes that compresses many times over. Every name is looked up and
/// stat'ed through the mount (contents and xattrs are empty, so not read: over FUSE that
/// alone takes tens of seconds). gensquashfs is left out: it takes about 50 s over such a
/// directory here, and counts the files in the directory's link count.
#[test]
fn a_directory_of_100_000_empty_files() {
    let dir = TempDir::new("conf-100k");
    let src = dir.join("src");
    let many = src.join("many");
    std::fs::create_dir_all(&many).unwrap();
    for i in 0..100_000 {
        std::fs::File::create(many.join(format!("empty-file-number-{i:06}"))).unwrap();
    }
    std::fs::write(src.join("beside"), b"x").unwrap();
    let img = dir.join("mk.sqfs");
    mksquashfs(&src, &img, &[]);
    let m = Mount::new(&img, &dir.join("mnt"), &[]);
    let opts = CompareOpts {
        content: false,
        xattrs: false,
        ..CompareOpts::default()
    };
    assert_same(&src, &m.path, &opts, "mksquashfs");
    let listed = std::fs::read_dir(m.path.join("many")).unwrap().count();
    assert_eq!(listed, 100_000);
}

/// Symlink targets up to the longest symlink(2) accepts (4095 bytes: PATH_MAX with its
/// NUL), through both tools. Longer ones, which tools write and 64 KiB-page kernels read,
/// are in reader.rs: this kernel and FUSE stop at one page.
#[test]
fn long_symlinks() {
    let dir = TempDir::new("conf-links");
    let src = dir.join("src");
    std::fs::create_dir(&src).unwrap();
    std::fs::write(src.join("file"), b"x").unwrap();
    for n in [255usize, 1024, 4000, 4095] {
        let target: String = (0..n)
            .map(|i| if i % 50 == 49 { '/' } else { 'd' })
            .collect();
        std::os::unix::fs::symlink(&target, src.join(format!("link{n}"))).unwrap();
    }
    check_both_tools(&dir, &src);
}

/// Values of the largest size Linux allows (XATTR_SIZE_MAX, 64 KiB), a file with many
/// names, and thousands of distinct values, so the key/value and id tables span many
/// metadata blocks. Built on tmpfs: ext4 keeps values to one 4 KiB block.
#[test]
fn large_xattr_values_and_tables() {
    let dir = TempDir::new_in(Path::new("/dev/shm"), "conf-xattrs");
    let src = dir.join("src");
    std::fs::create_dir(&src).unwrap();
    let set = |p: &Path, name: &str, value: &[u8]| {
        let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
        let n = std::ffi::CString::new(name).unwrap();
        // SAFETY: valid C strings; value is valid for its length.
        let rc = unsafe {
            libc::setxattr(
                c.as_ptr(),
                n.as_ptr(),
                value.as_ptr().cast(),
                value.len(),
                0,
            )
        };
        assert_eq!(
            rc,
            0,
            "setxattr {name}: {}",
            std::io::Error::last_os_error()
        );
    };
    let mut rnd = common::xorshift_bytes(0x2545_F491_4F6C_DD1D);
    let big = src.join("big-values");
    std::fs::write(&big, b"x").unwrap();
    set(&big, "user.max", &rnd(65536));
    set(&big, "user.zeros", &[0u8; 65000]);
    let names = src.join("many-names");
    std::fs::write(&names, b"y").unwrap();
    // Not empty: gensquashfs drops xattrs with empty values.
    for i in 1..=300 {
        set(&names, &format!("user.name-{i:04}"), &rnd(i));
    }
    let many = src.join("many");
    std::fs::create_dir(&many).unwrap();
    for i in 0..5000 {
        let f = many.join(format!("f{i:04}"));
        std::fs::write(&f, b"").unwrap();
        set(&f, "user.v", &rnd(100 + i % 300));
    }
    check_both_tools(&dir, &src);
}
