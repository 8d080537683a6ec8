//! The tar headers and member orders that other writers leave, each archive mounted and
//! compared with what GNU tar extracts from it (and bsdtar, where the two agree): hard
//! links to themselves and to members given again, names holding a NUL, old-style
//! directories, star's `X` headers, volume labels and continued files, two `x` headers
//! in a row, symlink modes, sizes the archive does not hold, damage between members, and
//! a SquashFS directory holding a name twice, against the kernel. Archives come from the
//! real writers where one writes the case (GNU tar, bsdtar, Python's tarfile), else
//! block by block from the format's documents (tests/common/rawtar.rs).

use crate::common;

use std::collections::BTreeSet;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::rawtar::{Head, RawTar, GNU, V7};
use common::tree::{compare_trees, CompareOpts};
use common::*;

/// One archive a case, its members under a directory named after the case.
struct Case {
    name: &'static str,
    tar: PathBuf,
    /// bsdtar extracts it as GNU tar does.
    bsd_agrees: bool,
}

fn write(dir: &TempDir, name: &str, bytes: Vec<u8>) -> PathBuf {
    let path = dir.join(format!("plain/{name}.tar"));
    std::fs::write(&path, bytes).unwrap();
    path
}

/// Hard links as `tar -x` makes them, in archive order: to a member given again later,
/// to a link, to themselves, to a later member, to a directory.
fn links_raw() -> Vec<u8> {
    let mut t = RawTar::new();
    t.dir("links-raw/")
        .file("links-raw/a", b"a, first")
        .head(Head::new(b"links-raw/b", b'1').link(b"links-raw/a"))
        .head(Head::new(b"links-raw/c", b'1').link(b"links-raw/b"))
        .file("links-raw/b", b"b, given again")
        .head(Head::new(b"links-raw/d", b'1').link(b"links-raw/b"))
        .head(Head::new(b"links-raw/early", b'1').link(b"links-raw/later"))
        .file("links-raw/later", b"later")
        .file("links-raw/self", b"self")
        .head(Head::new(b"links-raw/self", b'1').link(b"links-raw/self"))
        .dir("links-raw/sub/")
        .file("links-raw/sub/f", b"in sub")
        .head(Head::new(b"links-raw/sub", b'1').link(b"links-raw/sub"))
        .head(Head::new(b"links-raw/to-dir", b'1').link(b"links-raw/sub"))
        .head(Head::new(b"links-raw/sym", b'2').link(b"a").mode(0o777))
        .head(Head::new(b"links-raw/sym", b'1').link(b"links-raw/sym"))
        .head(Head::new(b"links-raw/sym-link", b'1').link(b"links-raw/sym"))
        .file("links-raw/over", b"over, first")
        .head(Head::new(b"links-raw/over", b'1').link(b"links-raw/absent"))
        .end()
}

/// Names end at their first NUL, whether they come in a GNU long name (`L`, `K`) or a
/// PAX record.
fn nul() -> Vec<u8> {
    let mut t = RawTar::new();
    t.dir("nul/")
        .with_data(
            Head::new(b"././@LongLink", b'L').magic(GNU),
            b"nul/long\0after the NUL\0",
        )
        .head(Head::new(b"ignored", b'0').magic(GNU).size(4))
        .data(b"long")
        .pax(b'x', &[(b"path", b"nul/pax\0after")])
        .file("ignored-too", b"pax")
        .with_data(
            Head::new(b"././@LongLink", b'K').magic(GNU),
            b"nul/long\0junk",
        )
        .head(Head::new(b"nul/hard", b'1').magic(GNU))
        .pax(b'x', &[(b"linkpath", b"target\0junk")])
        .head(Head::new(b"nul/sym", b'2').mode(0o777))
        .end()
}

/// A trailing `/` makes a file's header a directory's, with no data whatever its size.
fn olddir() -> Vec<u8> {
    let mut t = RawTar::new();
    t.dir("olddir/")
        .head(Head::new(b"olddir/v7/", b'0').magic(V7).mode(0o750))
        .head(Head::new(b"olddir/v7/f", b'0').magic(V7).size(2))
        .data(b"v7")
        .head(Head::new(b"olddir/nul/", 0).magic(V7).mode(0o700))
        .head(Head::new(b"olddir/contiguous/", b'7'))
        .pax(b'x', &[(b"path", b"olddir/pax/")])
        .head(Head::new(b"ignored", b'0').mode(0o711))
        .head(Head::new(b"olddir/sized/", b'0').size(5))
        .file("olddir/after-sized", b"right after the directory's header")
        .end()
}

/// star's and Solaris' extended header, `X`, read as POSIX's `x`.
fn star_x() -> Vec<u8> {
    let mut t = RawTar::new();
    t.dir("star-x/")
        .pax(
            b'X',
            &[
                (b"path", b"star-x/from-the-X-header"),
                (b"mtime", b"1234567890.5"),
            ],
        )
        .file("star-x/header-name", b"named by X")
        .end()
}

/// A second `x` before one member replaces the first, record for record.
fn two_x() -> Vec<u8> {
    let mut t = RawTar::new();
    t.dir("two-x/")
        .pax(b'x', &[(b"path", b"two-x/first"), (b"linkpath", b"first")])
        .pax(b'x', &[(b"linkpath", b"second")])
        .head(Head::new(b"two-x/header", b'2').mode(0o777))
        .pax(b'x', &[(b"path", b"two-x/one")])
        .pax(b'x', &[(b"path", b"two-x/two")])
        .file("two-x/neither", b"two")
        .end()
}

/// Symlinks show 0777 whatever mode their header gives.
fn symlink_modes() -> Vec<u8> {
    let mut t = RawTar::new();
    t.dir("symlink-modes/")
        .head(
            Head::new(b"symlink-modes/0755", b'2')
                .link(b"t")
                .mode(0o755),
        )
        .head(Head::new(b"symlink-modes/0000", b'2').link(b"t").mode(0))
        .end()
}

/// Sizes a header claims beyond what the archive holds, and a PAX time that does not
/// parse (the header's stands).
fn sizes() -> Vec<u8> {
    let mut base256 = [0u8; 12];
    base256[0] = 0x80;
    base256[4..].copy_from_slice(&(i64::MAX as u64).to_be_bytes());
    let mut block = Head::new(b"sizes/old-gnu-sparse", b'S')
        .magic(GNU)
        .size(3)
        .block();
    // One region of 3 bytes at 0, and a real size of 2^63 - 1 in base-256.
    block[386..398].copy_from_slice(b"00000000000\0");
    block[398..410].copy_from_slice(b"00000000003\0");
    block[483..495].copy_from_slice(&base256);
    block[148..156].copy_from_slice(b"        ");
    let sum: u32 = block.iter().map(|&b| u32::from(b)).sum();
    block[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
    let mut t = RawTar::new();
    t.dir("sizes/")
        .pax(
            b'x',
            &[
                (b"GNU.sparse.major", b"1"),
                (b"GNU.sparse.minor", b"0"),
                (b"GNU.sparse.name", b"sizes/pax-sparse"),
                (b"GNU.sparse.realsize", b"9223372036854775807"),
            ],
        )
        .head(Head::new(b"sizes/GNUSparseFile.0/pax-sparse", b'0').size(1024))
        .data(b"1\n0\n3\n")
        .data(b"abc");
    t.0.extend_from_slice(&block);
    t.data(b"xyz")
        .pax(b'x', &[(b"mtime", b"not a time")])
        .file("sizes/bad-pax-mtime", b"the header's mtime")
        .end()
}

/// Blocks that are not headers where one should be: data after a directory's header
/// (its size says nothing), and a malformed PAX header, whose good records stand.
fn damage() -> Vec<u8> {
    let mut t = RawTar::new();
    t.dir("damage/")
        .head(Head::new(b"damage/dir-with-data/", b'5').size(600))
        .data(&[b'Q'; 600])
        .file("damage/after", b"found again")
        .with_data(
            Head::new(b"PaxHeaders.0/g", b'x'),
            b"22 path=damage/good-x\nnonsense",
        )
        .file(
            "damage/bad-x-header-name",
            b"named by the record before the bad one",
        )
        .end()
}

/// A GNU dump directory (`D`, whose data lists its entries) and types no reader knows,
/// which GNU tar extracts as files.
fn other_types() -> Vec<u8> {
    let mut t = RawTar::new();
    t.dir("other-types/")
        .with_data(
            Head::new(b"other-types/dumpdir/", b'D').magic(GNU),
            &[b'Y'; 600],
        )
        .file("other-types/dumpdir/in-it", b"after the dump list")
        .with_data(Head::new(b"other-types/unknown-Q", b'Q'), b"data of Q")
        .with_data(
            Head::new(b"other-types/old-GNU-N", b'N').magic(GNU),
            b"data of N",
        )
        .end()
}

/// A GNU tar run, with `tar_args` after `-C src`.
fn gnu_tar(dir: &TempDir, name: &str, tar_args: &[&str]) -> PathBuf {
    let tar = dir.join(format!("plain/{name}.tar"));
    let out = Command::new("tar")
        .arg("-f")
        .arg(&tar)
        .arg("-C")
        .arg(dir.join("src"))
        .args(tar_args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "tar {tar_args:?}: {}",
        stderr_of(&out)
    );
    tar
}

/// A source tree for the real writers: a file with a second name, a directory, a symlink.
fn source(dir: &TempDir, case: &str) {
    let root = dir.join(format!("src/{case}"));
    std::fs::create_dir_all(root.join("d")).unwrap();
    std::fs::write(root.join("bar"), b"bar\n").unwrap();
    std::fs::hard_link(root.join("bar"), root.join("bar.ln")).unwrap();
    std::fs::write(root.join("d/f"), b"in d\n").unwrap();
    std::fs::write(root.join("lone"), b"one name\n").unwrap();
    symlink("bar", root.join("s")).unwrap();
}

fn cases(dir: &TempDir) -> Vec<Case> {
    std::fs::create_dir_all(dir.join("plain")).unwrap();
    let case = |name, tar, bsd_agrees| Case {
        name,
        tar,
        bsd_agrees,
    };
    let mut out = vec![
        case("links-raw", write(dir, "links-raw", links_raw()), true),
        // bsdtar takes a long link name with a NUL in it whole.
        case("nul", write(dir, "nul", nul()), false),
        case("olddir", write(dir, "olddir", olddir()), true),
        case("star-x", write(dir, "star-x", star_x()), true),
        // bsdtar makes a regular file of the symlink whose target only PAX gives.
        case("two-x", write(dir, "two-x", two_x()), false),
        case(
            "symlink-modes",
            write(dir, "symlink-modes", symlink_modes()),
            true,
        ),
        case(
            "other-types",
            write(dir, "other-types", other_types()),
            true,
        ),
        // bsdtar takes the sparse real size, and 0 for a bad PAX time.
        case("sizes", write(dir, "sizes", sizes()), false),
        // bsdtar drops every record of a malformed PAX header, GNU tar those after the
        // bad one.
        case("damage", write(dir, "damage", damage()), false),
    ];
    // GNU tar given a directory twice writes each file with a second name as a hard
    // link to itself the second time; `-r` appends a file again; `--label` writes a
    // volume label.
    source(dir, "gnu-twice");
    let tar = gnu_tar(dir, "gnu-twice", &["-c", "gnu-twice", "gnu-twice"]);
    std::fs::write(dir.join("src/gnu-twice/lone"), b"appended with -r\n").unwrap();
    gnu_tar(dir, "gnu-twice", &["-r", "gnu-twice/lone", "gnu-twice/bar"]);
    // `-u` appends what is newer than the archive's copy.
    let lone = dir.join("src/gnu-twice/lone");
    std::fs::write(&lone, b"appended with -u\n").unwrap();
    let later = std::time::SystemTime::now() + std::time::Duration::from_secs(60);
    std::fs::File::options()
        .write(true)
        .open(&lone)
        .unwrap()
        .set_modified(later)
        .unwrap();
    gnu_tar(dir, "gnu-twice", &["-u", "gnu-twice"]);
    out.push(case("gnu-twice", tar, true));
    source(dir, "label");
    let tar = gnu_tar(dir, "label", &["-c", "--label=Volume 1", "label"]);
    out.push(case("label", tar, true));
    // bsdtar given a directory twice, in each format it writes.
    for (name, format) in [
        ("bsd-pax", "pax"),
        ("bsd-gnutar", "gnutar"),
        ("bsd-ustar", "ustar"),
        ("bsd-v7", "v7tar"),
    ] {
        source(dir, name);
        let tar = dir.join(format!("plain/{name}.tar"));
        run_ok(
            Command::new("bsdtar")
                .arg(format!("--format={format}"))
                .arg("-cf")
                .arg(&tar)
                .arg("-C")
                .arg(dir.join("src"))
                .args([name, name]),
        );
        out.push(case(name, tar, true));
    }
    // The second volume of a GNU multi-volume archive starts with the rest of a file
    // (`M`), which it cannot show alone. (Its directory is in the first volume only, so it
    // stays out of the union, where it would be one tar -x makes at its own time.)
    std::fs::create_dir_all(dir.join("alone")).unwrap();
    let root = dir.join("src/multivolume");
    std::fs::create_dir_all(&root).unwrap();
    std::fs::write(root.join("big"), xorshift_bytes(5)(15_000)).unwrap();
    std::fs::write(root.join("small"), b"whole in volume 2\n").unwrap();
    let v1 = dir.join("volume-1.tar");
    let v2 = dir.join("alone/multivolume.tar");
    run_ok(
        Command::new("tar")
            .args(["-c", "-M", "--tape-length=10", "-f"])
            .arg(&v1)
            .arg("-f")
            .arg(&v2)
            .arg("-C")
            .arg(dir.join("src"))
            .args(["multivolume/big", "multivolume/small"]),
    );
    out.push(case("multivolume", v2, false));
    out
}

/// `bsdtar -x`, as root keeping owners and modes.
fn bsd_extract(tar: &Path, into: &Path) {
    std::fs::create_dir_all(into).unwrap();
    let _ = Command::new("bsdtar")
        .args(["-x", "--numeric-owner", "-p", "-f"])
        .arg(tar)
        .arg("-C")
        .arg(into)
        .output()
        .unwrap();
}

fn same(expected: &Path, actual: &Path, what: &str) {
    same_but(expected, actual, what, true)
}

fn same_but(expected: &Path, actual: &Path, what: &str, dir_mtime: bool) {
    let opts = CompareOpts {
        xattrs: false,
        dir_mtime,
        ..CompareOpts::default()
    };
    let diffs = compare_trees(expected, actual, &opts);
    assert!(diffs.is_empty(), "{what}:\n{}", diffs.join("\n"));
}

/// The in-process reader (what `archfs.open_archive` and `archfs.torch` use) against the
/// extraction of `case`: every name, type, mode, link count, size, mtime, target and byte.
fn same_in_process(reference: &Path, archive: &Path, case: &str) {
    use archfs::archive::{resolve, Kind};
    use std::os::unix::fs::MetadataExt;
    let a = archfs::open::open(archive, &archfs::cache::CacheConfig::default()).unwrap();
    let mut dirs = vec![PathBuf::from(case)];
    while let Some(rel) = dirs.pop() {
        let listed: BTreeSet<Vec<u8>> = a
            .read_dir(resolve(&*a, &rel).unwrap().ino)
            .unwrap()
            .into_iter()
            .map(|e| e.name.to_vec())
            .collect();
        assert_eq!(listed, names(&reference.join(&rel)), "{rel:?}, in process");
        for name in listed {
            let rel = rel.join(std::ffi::OsStr::from_bytes(&name));
            let (want, got) = (
                std::fs::symlink_metadata(reference.join(&rel)).unwrap(),
                resolve(&*a, &rel).unwrap(),
            );
            let kind = match want.file_type() {
                t if t.is_dir() => Kind::Dir,
                t if t.is_symlink() => Kind::Symlink,
                t if t.is_file() => Kind::File,
                _ => got.kind,
            };
            let what = format!("{rel:?}, in process");
            assert_eq!(got.kind, kind, "{what}");
            assert_eq!(u32::from(got.perm), want.mode() & 0o7777, "{what}");
            match kind {
                Kind::Dir => dirs.push(rel),
                Kind::Symlink => {
                    let target = std::fs::read_link(reference.join(&rel)).unwrap();
                    assert_eq!(a.readlink(got.ino).unwrap(), target.as_os_str().as_bytes());
                }
                _ => {
                    assert_eq!((got.nlink, got.mtime), (want.nlink() as u32, want.mtime()));
                    let mut bytes = Vec::new();
                    while (bytes.len() as u64) < got.size {
                        let d = a.read(got.ino, bytes.len() as u64, 1 << 20).unwrap();
                        assert!(!d.is_empty(), "{what}: short");
                        bytes.extend_from_slice(&d);
                    }
                    assert_eq!(
                        bytes,
                        std::fs::read(reference.join(&rel)).unwrap(),
                        "{what}"
                    );
                }
            }
        }
    }
}

fn names(dir: &Path) -> BTreeSet<Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().as_bytes().to_vec())
        .collect()
}

#[test]
fn every_case_mounts_as_tar_x_extracts_it_plain_compressed_and_in_a_union() {
    let dir = TempDir::new("dialects");
    let cases = cases(&dir);
    let (gnu, bsd, union) = (dir.join("gnu"), dir.join("bsd"), dir.join("union"));
    for c in &cases {
        extract(&c.tar, &gnu);
        bsd_extract(&c.tar, &bsd);
        if c.tar.starts_with(dir.join("plain")) {
            extract(&c.tar, &union);
        }
    }
    // What each case is about, seen in the reference, so that a writer that changed
    // its ways shows here rather than as a vacuous comparison.
    let read = |p: &str| std::fs::read(gnu.join(p)).unwrap();
    assert_eq!(read("links-raw/c"), b"a, first");
    assert_eq!(read("links-raw/self"), b"self");
    assert!(!gnu.join("links-raw/early").exists());
    assert_eq!(read("nul/long"), b"long");
    assert!(gnu.join("olddir/sized").is_dir());
    assert_eq!(read("other-types/unknown-Q"), b"data of Q");
    assert!(gnu.join("other-types/dumpdir/in-it").exists());
    assert!(gnu.join("star-x/from-the-X-header").exists());
    assert_eq!(
        std::fs::read_link(gnu.join("two-x/header")).unwrap(),
        Path::new("second")
    );
    assert!(gnu.join("two-x/two").exists());
    assert_eq!(read("sizes/pax-sparse"), b"abc");
    assert_eq!(read("gnu-twice/bar"), b"bar\n");
    let gnu_twice = cases.iter().find(|c| c.name == "gnu-twice").unwrap();
    let listing = run_ok(Command::new("tar").arg("-tvf").arg(&gnu_twice.tar)).stdout;
    assert!(
        String::from_utf8_lossy(&listing).contains("gnu-twice/bar link to gnu-twice/bar"),
        "GNU tar no longer writes a hard link to itself"
    );
    assert_eq!(read("gnu-twice/lone"), b"appended with -u\n");
    assert_eq!(
        names(&gnu.join("multivolume")),
        BTreeSet::from([b"small".to_vec()])
    );

    let mnt = dir.join("mnt");
    for c in &cases {
        let out = archfs()
            .arg("mount")
            .arg(&c.tar)
            .arg(&mnt)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}: {}", c.name, stderr_of(&out));
        let log = stderr_of(&out);
        let m = Mount { path: mnt.clone() };
        // GNU tar sets a directory's time when the archive leaves it: a directory given
        // twice gets the extraction's time from the second pass's files. bsdtar, which
        // sets them at the end, checks those times below.
        let twice = c.name.contains("twice") || c.name.starts_with("bsd-");
        same_but(&gnu.join(c.name), &m.path.join(c.name), c.name, !twice);
        if c.bsd_agrees {
            same(
                &bsd.join(c.name),
                &m.path.join(c.name),
                &format!("{}, bsdtar", c.name),
            );
        }
        drop(m);
        same_in_process(&gnu, &c.tar, c.name);
        // What is left out is said.
        let said = match c.name {
            "links-raw" => vec!["links-raw/later, which is not in the archive before it"],
            "damage" => vec!["where a tar header should be", "PAX header"],
            "multivolume" => vec!["continued from another volume"],
            _ => vec![],
        };
        for s in &said {
            assert!(log.contains(s), "{}: the log lacks {s:?}: {log}", c.name);
        }
        // The same without a mount: `ls`, `cat` and `check`.
        let ls = run_ok(archfs().arg("ls").arg(&c.tar).arg(c.name));
        let listed: BTreeSet<Vec<u8>> = ls
            .stdout
            .split(|&b| b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| {
                // `MODE NLINK UID GID SIZE MTIME NAME[ -> TARGET]`
                let l = String::from_utf8_lossy(l);
                let name = l.split_whitespace().skip(6).collect::<Vec<_>>().join(" ");
                name.split(" -> ").next().unwrap().as_bytes().to_vec()
            })
            .collect();
        let root = gnu.join(c.name);
        let text = String::from_utf8_lossy(&ls.stdout);
        assert_eq!(listed, names(&root), "{}: archfs ls:\n{text}", c.name);
        for f in names(&root) {
            let rel = root.join(std::ffi::OsStr::from_bytes(&f));
            if std::fs::symlink_metadata(&rel).unwrap().is_file() {
                let inner = format!("{}/{}", c.name, String::from_utf8_lossy(&f));
                let cat = run_ok(archfs().arg("cat").arg(&c.tar).arg(&inner));
                assert_eq!(
                    cat.stdout,
                    std::fs::read(&rel).unwrap(),
                    "archfs cat {inner}"
                );
            }
        }
        // `check` reads the index the mount saved: what was left out counts as damage.
        let check = archfs().arg("check").arg(&c.tar).output().unwrap();
        let report = String::from_utf8_lossy(&check.stdout);
        assert_eq!(
            check.status.success(),
            said.is_empty(),
            "{}: {report}",
            c.name
        );
        for s in &said {
            assert!(
                report.contains(s),
                "{}: check lacks {s:?}: {report}",
                c.name
            );
        }
    }

    // All of them as one union, as every compressed form, and again from the index the
    // first mount saved: the cases' directories side by side, as their extractions.
    let plain = dir.join("plain");
    for (ext, tool) in [
        ("gz", "gzip"),
        ("zst", "zstd"),
        ("xz", "xz"),
        ("bz2", "bzip2"),
    ] {
        let shards = dir.join(format!("shards-{ext}"));
        std::fs::create_dir_all(&shards).unwrap();
        for c in cases.iter().filter(|c| c.tar.starts_with(&plain)) {
            let to = shards.join(format!("{}.tar.{ext}", c.name));
            let bytes = run_ok(Command::new(tool).arg("-c").arg(&c.tar)).stdout;
            std::fs::write(to, bytes).unwrap();
        }
        let m = Mount::new(&shards, &mnt, &[]);
        // Directories given twice: as above (each case's mount checked their times).
        same_but(&union, &m.path, &format!("union of .tar.{ext}"), false);
    }
    for what in ["union of plain tars", "union from its saved index"] {
        let m = Mount::new(&plain, &mnt, &[]);
        same_but(&union, &m.path, what, false);
    }
    // `check` of a union names what each member left out: tars merged into one index,
    // and a tar beside a SquashFS image (a union of the two).
    let mixed = dir.join("mixed");
    std::fs::create_dir_all(mixed.join("src/sq")).unwrap();
    std::fs::write(mixed.join("src/sq/file"), b"x").unwrap();
    mksquashfs(&mixed.join("src"), &mixed.join("a.sqfs"), &[]);
    std::fs::remove_dir_all(mixed.join("src")).unwrap();
    std::fs::copy(plain.join("links-raw.tar"), mixed.join("b.tar")).unwrap();
    for (union, member) in [(&plain, "links-raw.tar"), (&mixed, "b.tar")] {
        let check = archfs().arg("check").arg(union).output().unwrap();
        let report = String::from_utf8_lossy(&check.stdout);
        assert!(!check.status.success(), "{report}");
        let said = format!(
            "left out: {}: early: hard link to",
            union.join(member).display()
        );
        assert!(report.contains(&said), "{union:?}: {report}");
    }
}

/// Archives of random member lists from Python's tarfile: names drawn from a few so that
/// they repeat, directories given twice, files, symlinks, and hard links to earlier and
/// later members, to directories and to themselves, long names among them. Each mount
/// equals GNU tar's extraction of the same archive.
#[test]
fn random_member_lists_mount_as_gnu_tar_extracts_them() {
    let dir = TempDir::new("dialects-random");
    let script = r#"
import io, random, sys, tarfile
out, seed = sys.argv[1], int(sys.argv[2])
rnd = random.Random(seed)
long = "l" * 120
dirs = ["d", "d/e", long]
files = ["f", "g", "d/f", "d/e/f", "d/" + "n" * 110, long + "/f", long + "/" + "m" * 150]
fmt = rnd.choice([tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
with tarfile.open(out, "w", format=fmt) as t:
    for d in dirs[:2] + [long]:
        i = tarfile.TarInfo(d); i.type = tarfile.DIRTYPE; i.mode = 0o755; i.mtime = 1000
        t.addfile(i)
    for n in range(rnd.randrange(5, 40)):
        r = rnd.random()
        i = tarfile.TarInfo(rnd.choice(files))
        i.mtime = 1_700_000_000 + n
        if r < 0.1:
            i = tarfile.TarInfo(rnd.choice(dirs)); i.type = tarfile.DIRTYPE
            i.mode = rnd.choice([0o755, 0o700]); i.mtime = 2000 + n
            t.addfile(i)
        elif r < 0.45:
            data = (f"{n} " * rnd.randrange(0, 300)).encode()
            i.size = len(data); i.mode = 0o644
            t.addfile(i, io.BytesIO(data))
        elif r < 0.6:
            i.type = tarfile.SYMTYPE; i.linkname = rnd.choice(["f", "d/e", "x"])
            t.addfile(i)
        else:
            i.type = tarfile.LNKTYPE
            i.linkname = i.name if r < 0.7 else rnd.choice(files + dirs + ["absent"])
            t.addfile(i)
"#;
    let mnt = dir.join("mnt");
    let mut links = 0;
    for seed in 0..24 {
        let tar = dir.join(format!("r{seed}.tar"));
        run_ok(
            Command::new("python3")
                .arg("-c")
                .arg(script)
                .arg(&tar)
                .arg(seed.to_string()),
        );
        let ex = dir.join(format!("ex{seed}"));
        extract(&tar, &ex);
        let m = Mount::new(&tar, &mnt, &[]);
        // GNU tar sets a directory's time when the archive leaves it, so a member put in
        // it afterwards leaves the extraction's time: random orders say nothing there.
        same_but(&ex, &m.path, &format!("seed {seed}"), false);
        drop(m);
        let listing = run_ok(Command::new("tar").arg("-tvf").arg(&tar)).stdout;
        links += String::from_utf8_lossy(&listing)
            .matches(" link to ")
            .count();
    }
    assert!(links > 50, "the archives held {links} hard links");
}

/// A SquashFS directory holding a name twice, and names out of order (neither of which
/// mksquashfs writes): every lookup finds what the kernel's driver finds, in a listing
/// that fits a metadata block (scanned) and in one that does not (a table).
#[test]
fn a_squashfs_directory_with_a_name_twice_resolves_as_the_kernels() {
    let dir = TempDir::new("dialects-sqfs");
    let src = dir.join("src");
    for (d, count) in [("small", 3), ("large", 800)] {
        std::fs::create_dir_all(src.join(d)).unwrap();
        for i in 0..count {
            let name = format!("n{i:04}");
            std::fs::write(src.join(d).join(&name), format!("{d} {name}\n")).unwrap();
        }
    }
    let img = dir.join("img.sqfs");
    // Uncompressed metadata, so names can be changed in place.
    mksquashfs(&src, &img, &["-noI", "-noD", "-noF", "-noX", "-all-root"]);
    let mut bytes = std::fs::read(&img).unwrap();
    let mut rename = |from: &str, to: &str| {
        let at = bytes
            .windows(from.len())
            .rposition(|w| w == from.as_bytes())
            .unwrap_or_else(|| panic!("{from} not in the image"));
        bytes[at..at + to.len()].copy_from_slice(to.as_bytes());
    };
    rename("n0001", "n0000"); // small: n0000 twice
    rename("n0002", "n0000"); // small: three times
    rename("n0400", "n0399"); // large: twice, mid-listing
    rename("n0700", "n0001"); // large: out of order
    std::fs::write(&img, &bytes).unwrap();

    let kmnt = dir.join("kernel");
    std::fs::create_dir_all(&kmnt).unwrap();
    run_ok(
        Command::new("mount")
            .args(["-t", "squashfs", "-o", "loop,ro"])
            .arg(&img)
            .arg(&kmnt),
    );
    let m = Mount::new(&img, &dir.join("mnt"), &[]);
    let result = std::panic::catch_unwind(|| {
        for d in ["small", "large"] {
            let listed = |root: &Path| {
                let mut v: Vec<Vec<u8>> = std::fs::read_dir(root.join(d))
                    .unwrap()
                    .map(|e| e.unwrap().file_name().as_bytes().to_vec())
                    .collect();
                v.sort();
                v
            };
            assert_eq!(listed(&m.path), listed(&kmnt), "{d}: listings");
            let mut names = listed(&kmnt);
            names.extend([b"n0400".to_vec(), b"n0700".to_vec(), b"absent".to_vec()]);
            for n in names {
                let rel = Path::new(d).join(std::ffi::OsStr::from_bytes(&n));
                let k = std::fs::read(kmnt.join(&rel)).ok();
                let a = std::fs::read(m.path.join(&rel)).ok();
                assert_eq!(a, k, "{rel:?}");
            }
        }
        let read = |p: &str| std::fs::read_to_string(kmnt.join(p)).unwrap();
        // The kernel's choices, so the comparison above is not between two misses.
        assert_eq!(read("small/n0000"), "small n0000\n");
        assert_eq!(read("large/n0399"), "large n0399\n");
    });
    let _ = Command::new("umount").arg(&kmnt).status();
    result.unwrap();
}
