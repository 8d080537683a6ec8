//! The SquashFS reader through the `Archive` interface, without a mount: images built by
//! mksquashfs with every compressor and layout option are walked and compared with the
//! source tree.

use crate::common;

use std::collections::HashMap;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use archfs::archive::{self, Archive, Kind, ROOT_INO};
use archfs::cache::CacheConfig;
use archfs::error::Error;
use archfs::open;
use common::*;

/// A tree with the cases a reader can get wrong: block boundaries, fragments, sparse
/// blocks, hard links, symlinks, xattrs, and a directory large enough to carry an index.
fn source_tree(dir: &TempDir) -> std::path::PathBuf {
    let src = dir.join("src");
    std::fs::create_dir_all(src.join("big")).unwrap();
    std::fs::create_dir_all(src.join("a/b/c")).unwrap();
    let mut rnd = common::xorshift_bytes(12345);
    for (i, size) in [
        0usize, 1, 4095, 4096, 4097, 65536, 131071, 131072, 131073, 400_000,
    ]
    .into_iter()
    .enumerate()
    {
        std::fs::write(src.join(format!("a/file{i}")), rnd(size)).unwrap();
    }
    std::fs::write(src.join("a/b/zeros"), vec![0u8; 300_000]).unwrap();
    let mut sparse = vec![0u8; 600_000];
    sparse[10] = 1;
    sparse[599_999] = 2;
    std::fs::write(src.join("a/b/sparse"), sparse).unwrap();
    for i in 0..3000 {
        std::fs::write(src.join(format!("big/f{i:05}.jpg")), rnd(i % 700)).unwrap();
    }
    std::fs::hard_link(src.join("a/file3"), src.join("a/b/c/link3")).unwrap();
    std::os::unix::fs::symlink("../file3", src.join("a/b/rel")).unwrap();
    std::os::unix::fs::symlink("/nonexistent/target", src.join("a/dangling")).unwrap();
    std::fs::set_permissions(src.join("a/file1"), std::fs::Permissions::from_mode(0o4751)).unwrap();
    run_ok(
        Command::new("setfattr")
            .args(["-n", "user.note", "-v", "hello"])
            .arg(src.join("a/file2")),
    );
    src
}

fn walk_compare(a: &dyn Archive, ino: u64, dir: &Path, xattrs: bool) -> usize {
    let mut checked = 0;
    let entries = a.read_dir(ino).unwrap();
    let mut on_disk: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_encoded_bytes())
        .collect();
    on_disk.sort();
    let mut names: Vec<_> = entries.iter().map(|e| e.name.to_vec()).collect();
    names.sort();
    assert_eq!(names, on_disk, "names in {dir:?}");
    for e in &entries {
        let path = dir.join(std::ffi::OsStr::from_encoded_bytes_unchecked_safe(&e.name));
        let meta = std::fs::symlink_metadata(&path).unwrap();
        let attr = a.lookup(ino, &e.name).unwrap();
        assert_eq!(
            attr,
            a.attr(e.ino).unwrap(),
            "lookup and attr agree for {path:?}"
        );
        assert_eq!(attr.ino, e.ino);
        assert_eq!(u32::from(attr.perm), meta.mode() & 0o7777, "{path:?}");
        assert_eq!(i64::from(attr.mtime as i32 as i64 == attr.mtime), 1);
        assert_eq!(attr.mtime, meta.mtime(), "{path:?}");
        assert_eq!((attr.uid, attr.gid), (meta.uid(), meta.gid()), "{path:?}");
        let ft = meta.file_type();
        match e.kind {
            Kind::Dir => {
                assert!(ft.is_dir());
                checked += walk_compare(a, e.ino, &path, xattrs);
            }
            Kind::File => {
                assert!(ft.is_file(), "{path:?}");
                assert_eq!(attr.size, meta.len());
                assert_eq!(attr.nlink as u64, meta.nlink(), "{path:?}");
                let want = std::fs::read(&path).unwrap();
                let mut got = Vec::new();
                // Odd-sized reads cross block and fragment boundaries.
                while (got.len() as u64) < attr.size {
                    let d = a.read(e.ino, got.len() as u64, 70_001).unwrap();
                    assert!(!d.is_empty());
                    got.extend_from_slice(&d);
                }
                assert!(a.read(e.ino, attr.size, 10).unwrap().is_empty());
                assert!(got == want, "content of {path:?}");
            }
            Kind::Symlink => {
                assert_eq!(
                    a.readlink(e.ino).unwrap(),
                    std::fs::read_link(&path)
                        .unwrap()
                        .into_os_string()
                        .into_encoded_bytes()
                );
            }
            other => panic!("unexpected {other:?}"),
        }
        if xattrs && e.kind != Kind::Symlink {
            let got: HashMap<_, _> = a.xattrs(e.ino).unwrap().into_iter().collect();
            let out = run_ok(
                Command::new("getfattr")
                    .args(["--absolute-names", "-d", "-m", "-"])
                    .arg(&path),
            );
            let listed = String::from_utf8_lossy(&out.stdout)
                .matches("user.")
                .count();
            assert_eq!(
                got.keys().filter(|k| k.starts_with(b"user.")).count(),
                listed,
                "{path:?}"
            );
        }
        checked += 1;
    }
    checked
}

trait FromBytes {
    fn from_encoded_bytes_unchecked_safe(b: &[u8]) -> &std::ffi::OsStr;
}
impl FromBytes for std::ffi::OsStr {
    fn from_encoded_bytes_unchecked_safe(b: &[u8]) -> &std::ffi::OsStr {
        use std::os::unix::ffi::OsStrExt;
        std::ffi::OsStr::from_bytes(b)
    }
}

#[test]
fn every_compressor_and_layout_reads_back_exactly() {
    let dir = TempDir::new("reader");
    let src = source_tree(&dir);
    let variants: &[&[&str]] = &[
        &["-comp", "gzip"],
        &["-comp", "xz"],
        &["-comp", "lz4"],
        &["-comp", "zstd"],
        &["-comp", "lzo"],
        &["-comp", "xz", "-Xbcj", "x86"],
        &["-comp", "lz4", "-Xhc"],
        &["-comp", "gzip", "-b", "4K"],
        &["-comp", "zstd", "-b", "1M"],
        &["-no-fragments"],
        &["-always-use-fragments"],
        &["-noI", "-noD", "-noF", "-noX"],
        &["-no-xattrs"],
        &["-no-sparse"],
        &["-no-duplicates"],
    ];
    for args in variants {
        let img = dir.join("img.sqfs");
        mksquashfs(&src, &img, args);
        let a = open_with_cache(&img, 1 << 20);
        let n = walk_compare(&*a, ROOT_INO, &src, !args.contains(&"-no-xattrs"));
        assert!(n > 3000, "{args:?}: walked only {n} entries");
    }
}

#[test]
fn lookups_use_the_directory_index_and_miss_cleanly() {
    let dir = TempDir::new("lookup");
    let src = source_tree(&dir);
    let img = dir.join("img.sqfs");
    mksquashfs(&src, &img, &[]);
    let a = open::open(&img, &CacheConfig::default()).unwrap();
    let big = a.lookup(ROOT_INO, b"big").unwrap();
    for i in (0..3000).step_by(7) {
        let name = format!("f{i:05}.jpg");
        let attr = a.lookup(big.ino, name.as_bytes()).unwrap();
        assert_eq!(attr.size, (i % 700) as u64);
        let miss = format!("f{i:05}.jpf");
        assert!(matches!(
            a.lookup(big.ino, miss.as_bytes()),
            Err(Error::NotFound)
        ));
    }
    for miss in [&b"a"[..], b"zzzz", b"f", b"f99999.jpg", b""] {
        assert!(
            matches!(a.lookup(big.ino, miss), Err(Error::NotFound)),
            "{miss:?}"
        );
    }
    let file = a.lookup(ROOT_INO, b"a").unwrap();
    let f0 = a.lookup(file.ino, b"file0").unwrap();
    assert!(matches!(a.lookup(f0.ino, b"x"), Err(Error::NotDir)));
    assert!(matches!(a.readlink(f0.ino), Err(Error::NotSymlink)));
}

/// The archive at `img` with a block cache of `bytes`.
fn open_with_cache(img: &Path, bytes: u64) -> Arc<dyn Archive> {
    open::open(img, &CacheConfig { total_bytes: bytes }).unwrap()
}

#[test]
fn parallel_readers_of_one_archive_agree() {
    let dir = TempDir::new("threads");
    let src = source_tree(&dir);
    let img = dir.join("img.sqfs");
    mksquashfs(&src, &img, &["-comp", "zstd"]);
    // A cache far smaller than the data, so eviction races with the readers.
    let a = open_with_cache(&img, 256 << 10);
    let big = a.lookup(ROOT_INO, b"big").unwrap();
    let entries = a.read_dir(big.ino).unwrap();
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let (a, entries, src) = (&a, &entries, &src);
            s.spawn(move || {
                for k in 0..entries.len() {
                    let e = &entries[(k * 7 + t as usize * 389) % entries.len()];
                    let name = std::str::from_utf8(&e.name).unwrap();
                    let want = std::fs::read(src.join("big").join(name)).unwrap();
                    let got = a.read(e.ino, 0, 1 << 20).unwrap();
                    assert!(*got == *want, "{name}");
                }
            });
        }
    });
}

/// A 16 TiB sparse file: 134 M blocks of 128 KiB, whose 512 MiB block list compresses to
/// about 2 MiB of inode table. No tool builds one in a test's time (see common/huge.rs),
/// so the image is written directly; `huge_sparse_files_written_directly` in the
/// conformance tests checks that writer against the kernel and mounts this file. The reader must neither refuse
/// it nor hold its block list in memory (1.6 GB as two vectors): reads at the start, the
/// middle and the end, forwards and backwards, stay within a small memory budget.
#[test]
fn a_16_tib_sparse_file_reads_without_per_block_memory() {
    use common::huge::{HugeSparse, BLOCK};
    let dir = TempDir::new("huge");
    let img = dir.join("huge.sqfs");
    let size = 16u64 << 40;
    let blocks = size / BLOCK;
    let mid = blocks / 2 + 12_345;
    let file = HugeSparse {
        size,
        data: vec![0, mid, mid + 1, blocks - 1],
    };
    file.write(&img);
    assert!(std::fs::metadata(&img).unwrap().len() < 8 << 20);
    let before = own_peak_rss();
    let a = open_with_cache(&img, 16 << 20);
    let attr = a.lookup(ROOT_INO, b"big").unwrap();
    assert_eq!(attr.size, size);
    let reads: &[(u64, u32)] = &[
        (0, 200_000),
        (size - 1000, 4096),
        (mid * BLOCK - 5000, 300_000),
        (7 << 40, 65536),
        (BLOCK - 10, 20),
        (mid * BLOCK + 100, 1000),
        (size - 2 * BLOCK - 7, 1 << 20),
    ];
    for &(off, len) in reads {
        let got = a.read(attr.ino, off, len).unwrap();
        assert!(
            *got == *file.expected(off, len as usize),
            "read of {len} at {off}"
        );
    }
    // Block by block forwards, as a sequential reader goes.
    for b in (mid - 40)..(mid + 40) {
        let got = a.read(attr.ino, b * BLOCK + 3, 200).unwrap();
        assert!(*got == *file.expected(b * BLOCK + 3, 200), "block {b}");
    }
    assert!(a.read(attr.ino, size, 10).unwrap().is_empty());
    let grew = own_peak_rss().saturating_sub(before);
    assert!(
        grew < 96 << 20,
        "reading the 16 TiB file raised the peak memory by {} MiB",
        grew >> 20
    );
}

/// Symlink targets as long as a 64 KiB-page kernel reads (and longer than x86's 4 KiB),
/// from mksquashfs (a pseudo definition, at most 65,535 bytes) and gensquashfs (a pack
/// file, any length). A target longer than any kernel's page size (256 KiB) is corrupt.
#[test]
fn symlinks_up_to_the_largest_page_size_read_back() {
    let dir = TempDir::new("longlink");
    let empty = dir.join("empty");
    std::fs::create_dir(&empty).unwrap();
    let target = |n: usize| -> String { (0..n).map(|i| (b'a' + (i % 26) as u8) as char).collect() };
    let open = |img: &Path| open::open(img, &CacheConfig::default()).unwrap();
    for n in [4095, 4096, 65535, 65536] {
        let t = target(n);
        if n < 65536 {
            let img = dir.join(format!("mk{n}.sqfs"));
            mksquashfs(&empty, &img, &["-p", &format!("l s 777 0 0 {t}")]);
            let a = open(&img);
            let l = a.lookup(ROOT_INO, b"l").unwrap();
            assert_eq!(l.size, n as u64);
            assert_eq!(a.readlink(l.ino).unwrap(), t.as_bytes(), "mksquashfs, {n}");
        }

        let pack = dir.join("pack.txt");
        std::fs::write(&pack, format!("dir / 0755 0 0\nslink /l 0777 0 0 {t}\n")).unwrap();
        let img = dir.join(format!("gen{n}.sqfs"));
        run_ok(
            Command::new("gensquashfs")
                .arg("--pack-file")
                .arg(&pack)
                .args(["--quiet", "--force"])
                .arg(&img),
        );
        let a = open(&img);
        let l = a.lookup(ROOT_INO, b"l").unwrap();
        assert_eq!(a.readlink(l.ino).unwrap(), t.as_bytes(), "gensquashfs, {n}");
    }
    let pack = dir.join("pack.txt");
    let t = target((256 << 10) + 1);
    std::fs::write(&pack, format!("dir / 0755 0 0\nslink /l 0777 0 0 {t}\n")).unwrap();
    let img = dir.join("too-long.sqfs");
    run_ok(
        Command::new("gensquashfs")
            .arg("--pack-file")
            .arg(&pack)
            .args(["--quiet", "--force"])
            .arg(&img),
    );
    assert!(matches!(
        open(&img).lookup(ROOT_INO, b"l"),
        Err(Error::Corrupt(_))
    ));
}

/// The bytes the push splices from the image (`stored_at`: raw blocks and fragments) are
/// the file's bytes: every file rebuilt from them alone where the image stores data raw,
/// and a compressed image's raw runs agree with its reads.
#[test]
fn raw_ranges_in_the_image_hold_the_files_bytes() {
    use std::os::unix::fs::FileExt;
    let dir = TempDir::new("reader-raw");
    let src = source_tree(&dir);
    for (args, all_raw) in [
        (&["-noI", "-noD", "-noF", "-noX"][..], true),
        (&["-noD", "-noF", "-b", "4K"][..], true),
        (&["-comp", "zstd"][..], false),
    ] {
        let img = dir.join("raw.sqfs");
        mksquashfs(&src, &img, args);
        let a = open_with_cache(&img, 1 << 20);
        let (mut files, mut raw_bytes) = (0, 0u64);
        for e in files_under(&src) {
            let rel = e.strip_prefix(&src).unwrap();
            let meta = std::fs::symlink_metadata(&e).unwrap();
            if !meta.is_file() || meta.len() == 0 {
                continue;
            }
            let want = std::fs::read(&e).unwrap();
            let ino = archive::resolve(&*a, rel).unwrap().ino;
            // Whole-file pieces of up to 64 KiB, from odd offsets too.
            let mut at = 0u64;
            let mut step = 0;
            while at < want.len() as u64 {
                step += 1;
                let Some((fd, pos, len)) = a.stored_at(ino, at, 65536) else {
                    // Only sparse (all-zero) blocks have no raw bytes in such an image.
                    assert!(
                        !all_raw || want[at as usize..].iter().take(4096).all(|&b| b == 0),
                        "{args:?}: {rel:?} has no raw bytes at {at}"
                    );
                    at += 4096;
                    continue;
                };
                assert!(len > 0 && u64::from(len) <= 65536, "{args:?}: {len} bytes");
                let mut got = vec![0u8; len as usize];
                let f = std::fs::File::from(fd.try_clone_to_owned().unwrap());
                f.read_exact_at(&mut got, pos).unwrap();
                let end = at as usize + got.len();
                assert!(
                    end <= want.len() && got == want[at as usize..end],
                    "{args:?}: {rel:?}: {len} raw bytes at {at} differ from the file's"
                );
                raw_bytes += u64::from(len);
                at = end as u64 + (step % 3) * 1000;
            }
            files += 1;
        }
        assert!(files > 3000, "{args:?}: {files} files");
        assert!(
            raw_bytes > 1_000_000,
            "{args:?}: {raw_bytes} raw bytes found"
        );
    }
}

/// Every path under `root`, depth first.
fn files_under(root: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(root).unwrap() {
        let p = e.unwrap().path();
        if std::fs::symlink_metadata(&p).unwrap().is_dir() {
            out.extend(files_under(&p));
        }
        out.push(p);
    }
    out
}

/// `archive::path`, which the Python reader walks by: names to inodes with links
/// followed inside the archive and stopped at its edge, whole reads into a buffer, and
/// the ImageFolder-ordered file list, on an image and a tar of one tree.
#[test]
fn paths_follow_links_inside_the_archive_and_list_files_in_imagefolder_order() {
    use archfs::archive::path::{files_under, read_into, walk, Dirs};
    use std::os::unix::fs::symlink;
    let dir = TempDir::new("paths");
    let src = dir.join("src");
    for d in ["train/b/deep", "train/a", "train/C"] {
        std::fs::create_dir_all(src.join(d)).unwrap();
    }
    let mut rnd = common::xorshift_bytes(9);
    for f in [
        "train/a/2.JPG",
        "train/a/10.jpg",
        "train/b/x.png",
        "train/b/deep/y.jpeg",
        "train/C/z.txt",
    ] {
        std::fs::write(src.join(f), rnd(300_000)).unwrap();
    }
    symlink("../a/10.jpg", src.join("train/b/up.jpg")).unwrap();
    symlink("b", src.join("train/linked")).unwrap();
    symlink("..", src.join("train/b/deep/loop")).unwrap();
    symlink("/etc/passwd", src.join("train/abs.jpg")).unwrap();
    symlink("nowhere.jpg", src.join("train/broken.jpg")).unwrap();
    let img = dir.join("t.sqfs");
    mksquashfs(&src, &img, &["-comp", "gzip"]);
    let tar = dir.join("t.tar");
    run_ok(
        Command::new("tar")
            .arg("-cf")
            .arg(&tar)
            .arg("-C")
            .arg(&src)
            .arg("."),
    );
    for path in [&img, &tar] {
        let a = open::open(path, &CacheConfig::default()).unwrap();
        let a = &*a;
        let want = std::fs::read(src.join("train/a/10.jpg")).unwrap();
        for p in [
            "train/a/10.jpg",
            "/train/b/up.jpg",
            "train/linked/up.jpg",
            "train/./b/deep/../../a/10.jpg",
            "train/linked/deep/loop/up.jpg",
        ] {
            let attr = walk(a, p.as_bytes(), true).unwrap();
            assert_eq!(attr.size, want.len() as u64, "{p}");
            let mut buf = vec![0; want.len() + 10];
            assert_eq!(read_into(a, attr.ino, 0, &mut buf).unwrap(), want.len());
            assert_eq!(&buf[..want.len()], &want[..], "{p}");
            let mut tail = vec![0; 1000];
            assert_eq!(read_into(a, attr.ino, 299_500, &mut tail).unwrap(), 500);
            assert_eq!(&tail[..500], &want[299_500..]);
        }
        assert_eq!(
            walk(a, b"train/b/up.jpg", false).unwrap().kind,
            Kind::Symlink
        );
        for (p, e) in [
            ("train/abs.jpg", Error::NotFound),
            ("train/broken.jpg", Error::NotFound),
            ("../train", Error::NotFound),
            ("train/a/10.jpg/x", Error::NotDir),
            ("train/a/10.jpg/", Error::NotDir),
        ] {
            let got = walk(a, p.as_bytes(), true).unwrap_err();
            assert_eq!(got.errno(), e.errno(), "{p}: {got}");
        }
        // Walks from remembered directories agree with walks from the root, twice over
        // (the second from what the first remembered).
        let dirs = Dirs::default();
        for _ in 0..2 {
            for p in [
                "train/a/10.jpg",
                "/train/b/up.jpg",
                "train/linked/up.jpg",
                "train/b/deep/loop/x.png",
                "train/b/deep/..",
                "train/b/deep/.",
                "train/b/deep/",
                "train/abs.jpg",
                "train/broken.jpg",
                "train/a/10.jpg/x",
                "train/a/nope",
                "nope/x",
            ] {
                for follow in [true, false] {
                    let want = walk(a, p.as_bytes(), follow).map_err(|e| e.errno());
                    let got = dirs.walk(a, p.as_bytes(), follow).map_err(|e| e.errno());
                    assert_eq!(got, want, "{p} follow={follow}");
                }
            }
        }
        let files: Vec<String> = files_under(a, b"train", Some(&[".jpg".into(), ".png".into()]))
            .unwrap()
            .into_iter()
            .map(|p| String::from_utf8(p).unwrap())
            .collect();
        // Directories by path (uppercase first, as Python sorts), names sorted in each,
        // links to directories walked (the loop back up once, not forever), broken and
        // outside links listed as files.
        assert_eq!(
            files,
            [
                "train/abs.jpg",
                "train/broken.jpg",
                "train/a/10.jpg",
                "train/a/2.JPG",
                "train/b/up.jpg",
                "train/b/x.png",
                "train/linked/up.jpg",
                "train/linked/x.png",
            ],
            "{}",
            path.display()
        );
    }
}

/// What a node's copy of a share of the files holds ([`Archive::stored`] of each, and the
/// tables) is all a reader of those files needs: an image with only those bytes (zeros
/// elsewhere) reads each back exactly, and files outside the share do not. A tar
/// member's stored bytes are its data; a compressed tar's members are not in its bytes.
#[test]
fn a_share_of_the_files_reads_back_from_its_stored_ranges_alone() {
    let dir = TempDir::new("reader-stored");
    let src = source_tree(&dir);
    let mut files: Vec<_> = files_under(&src)
        .into_iter()
        .filter(|p| std::fs::symlink_metadata(p).unwrap().is_file())
        .collect();
    // A share is a run of the archive (archfs.partition's are): files sorted by path.
    files.sort();
    let ino = |a: &dyn Archive, p: &Path| {
        archive::resolve(a, p.strip_prefix(&src).unwrap())
            .unwrap()
            .ino
    };
    let read = |a: &dyn Archive, ino: u64| {
        let mut buf = vec![0u8; a.attr(ino).unwrap().size as usize];
        a.read_into(ino, 0, &mut buf).map(|_| buf)
    };
    for args in [
        &[][..],
        &["-comp", "zstd", "-b", "4K"][..],
        &["-noF", "-noD"][..],
    ] {
        let img = dir.join("whole.sqfs");
        mksquashfs(&src, &img, args);
        let a = open_with_cache(&img, 1 << 20);
        let (share, others): (Vec<_>, Vec<_>) = files
            .iter()
            .enumerate()
            .partition(|(i, _)| *i < files.len() / 2);
        let mut ranges = a.tables();
        for (_, p) in &share {
            ranges.extend(a.stored(ino(&*a, p)).unwrap());
        }
        let whole = std::fs::read(&img).unwrap();
        let mut part = vec![0u8; whole.len()];
        let mut held = 0;
        for r in archfs::source::merged(ranges) {
            let r = r.start as usize..r.end as usize;
            part[r.clone()].copy_from_slice(&whole[r.clone()]);
            held += r.len();
        }
        assert!(
            held < whole.len() * 9 / 10,
            "{args:?}: {held} of {} bytes",
            whole.len()
        );
        let part_img = dir.join("part.sqfs");
        std::fs::write(&part_img, &part).unwrap();
        let b = open_with_cache(&part_img, 1 << 20);
        for (_, p) in &share {
            let got = read(&*b, ino(&*b, p)).unwrap_or_else(|e| panic!("{args:?} {p:?}: {e}"));
            assert!(got == std::fs::read(p).unwrap(), "{args:?}: {p:?} differs");
        }
        let missing = others
            .iter()
            .filter(|(_, p)| std::fs::read(p).unwrap().iter().any(|&x| x != 0))
            .filter(|(_, p)| read(&*b, ino(&*b, p)).ok() != Some(std::fs::read(p).unwrap()))
            .count();
        assert!(
            missing > 0,
            "{args:?}: every file outside the share read back too"
        );
    }
    let tar = dir.join("t.tar");
    tar_of(&src, ".", &tar);
    let whole = std::fs::read(&tar).unwrap();
    let a = open_with_cache(&tar, 1 << 20);
    for p in &files {
        let mut got = Vec::new();
        for r in a.stored(ino(&*a, p)).unwrap() {
            got.extend_from_slice(&whole[r.start as usize..r.end as usize]);
        }
        assert!(
            got == std::fs::read(p).unwrap(),
            "tar: {p:?} is not its stored bytes"
        );
    }
    run_ok(Command::new("gzip").arg("-k").arg(&tar));
    let a = open_with_cache(&dir.join("t.tar.gz"), 1 << 20);
    assert_eq!(a.stored(ino(&*a, &files[0])), None);
}
