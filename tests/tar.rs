//! Tar archives made by GNU tar in every --format, by Python's tarfile and by bsdtar,
//! mounted and compared with what `tar -x` extracts from the same archive.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::tree::{make_awkward_tree, CompareOpts, TreeSpec};
use common::*;

fn awkward(dir: &TempDir, spec: TreeSpec) -> PathBuf {
    let src = dir.join("src");
    std::fs::create_dir(&src).unwrap();
    make_awkward_tree(&src, &spec).unwrap();
    src
}

fn small() -> TreeSpec {
    TreeSpec {
        big_dir_entries: 2000,
        sparse_4g: false,
        ..TreeSpec::default()
    }
}

/// Runs a tar writer; members it cannot store in the chosen format are its business,
/// so only a missing archive is a failure.
fn make_tar(cmd: &mut Command, tar: &Path) {
    let out = cmd.output().unwrap();
    assert!(tar.exists(), "{cmd:?} made no archive: {}", stderr_of(&out));
}

/// The conformance suite shared with SquashFS (tests/common/suite.rs).
fn assert_same(expected: &Path, actual: &Path, opts: &CompareOpts, what: &str) {
    common::suite::check_mount(expected, actual, opts, what);
}

fn check_against_extraction(dir: &TempDir, tar: &Path, what: &str, opts: &CompareOpts) {
    let ex = dir.join(format!("extracted-{what}"));
    extract(tar, &ex);
    let mnt = dir.join(format!("mnt-{what}"));
    let m = Mount::new(tar, &mnt, &["--cache-size", "16M"]);
    assert_same(&ex, &m.path, opts, what);
    drop(m);
    // Again from the index the first mount saved: the packed file must serve the same.
    let saved = tar.with_file_name(format!(
        "{}.archfs-index",
        tar.file_name().unwrap().to_string_lossy()
    ));
    assert!(saved.exists(), "{what}: no index saved at {saved:?}");
    let m = Mount::new(tar, &mnt, &["--cache-size", "16M"]);
    assert_same(&ex, &m.path, opts, &format!("{what}, saved index"));
}

fn gnu_tar(dir: &TempDir, src: &Path, format: &str, extra: &[&str]) -> PathBuf {
    let tar = dir.join(format!("{format}.tar"));
    make_tar(
        Command::new("tar")
            .arg(format!("--format={format}"))
            .args(extra)
            .arg("-cf")
            .arg(&tar)
            .arg("-C")
            .arg(src)
            .arg("."),
        &tar,
    );
    tar
}

#[test]
fn gnu_tar_every_format_matches_tar_x() {
    let dir = TempDir::new("tar-formats");
    let src = awkward(&dir, small());
    for format in ["gnu", "oldgnu", "posix", "ustar", "v7"] {
        let extra: &[&str] = if format == "posix" {
            &["--xattrs", "--xattrs-include=user.*"]
        } else {
            &[]
        };
        let tar = gnu_tar(&dir, &src, format, extra);
        let opts = CompareOpts {
            xattrs: format == "posix",
            root_attrs: true,
            ..CompareOpts::default()
        };
        check_against_extraction(&dir, &tar, format, &opts);
    }
}

#[test]
fn sparse_files_in_every_sparse_format() {
    let dir = TempDir::new("tar-sparse");
    let src = awkward(
        &dir,
        TreeSpec {
            big_dir_entries: 10,
            ..TreeSpec::default()
        },
    );
    for (name, format, extra) in [
        ("oldgnu-sparse", "gnu", &["--sparse"][..]),
        ("pax00", "posix", &["--sparse", "--sparse-version=0.0"]),
        ("pax01", "posix", &["--sparse", "--sparse-version=0.1"]),
        ("pax10", "posix", &["--sparse", "--sparse-version=1.0"]),
    ] {
        let tar = dir.join(format!("{name}.tar"));
        make_tar(
            Command::new("tar")
                .arg(format!("--format={format}"))
                .args(extra)
                .arg("-cf")
                .arg(&tar)
                .arg("-C")
                .arg(&src)
                .args(["./sparse", "./files"]),
            &tar,
        );
        let opts = CompareOpts {
            xattrs: false,
            ..CompareOpts::default()
        };
        check_against_extraction(&dir, &tar, name, &opts);
        std::fs::remove_file(&tar).unwrap();
        let _ = std::fs::remove_dir_all(dir.join(format!("extracted-{name}")));
    }
}

#[test]
fn python_tarfile_and_bsdtar_archives() {
    let dir = TempDir::new("tar-writers");
    let src = awkward(&dir, small());
    for (name, fmt) in [("py-pax", "PAX_FORMAT"), ("py-gnu", "GNU_FORMAT")] {
        let tar = dir.join(format!("{name}.tar"));
        let script = format!(
            "import tarfile\nwith tarfile.open({:?}, 'w', format=tarfile.{fmt}) as t:\n    t.add({:?}, arcname='.')\n",
            tar.to_str().unwrap(),
            src.to_str().unwrap()
        );
        make_tar(Command::new("python3").arg("-c").arg(script), &tar);
        let opts = CompareOpts {
            xattrs: false,
            root_attrs: true,
            ..CompareOpts::default()
        };
        check_against_extraction(&dir, &tar, name, &opts);
    }
    // bsdtar: compared with the source itself. Neither extraction is a faithful
    // reference here: GNU tar leaves some directory mtimes at "now" for bsdtar's member
    // order, and bsdtar's extraction merges names that differ only in Unicode
    // normalisation. The archive records everything but sockets, so drop that first.
    std::fs::remove_file(src.join("special/socket")).unwrap();
    let tar = dir.join("bsd.tar");
    make_tar(
        Command::new("bsdtar")
            .args(["--format=pax", "-cf"])
            .arg(&tar)
            .arg("-C")
            .arg(&src)
            .arg("."),
        &tar,
    );
    let m = Mount::new(&tar, &dir.join("mnt-bsdtar"), &[]);
    let opts = CompareOpts {
        root_attrs: true,
        ..CompareOpts::default()
    };
    assert_same(&src, &m.path, &opts, "bsdtar");
}

/// Writes a tar with Python's tarfile from (name, content or None for a directory).
fn python_tar(tar: &Path, members: &[(&str, Option<&str>)]) {
    let mut script = String::from("import tarfile, io\nt = tarfile.open(");
    script += &format!(
        "{:?}, 'w', format=tarfile.GNU_FORMAT)\n",
        tar.to_str().unwrap()
    );
    for (name, content) in members {
        match content {
            Some(c) => {
                script += &format!(
                    "i = tarfile.TarInfo({name:?}); d = {c:?}.encode(); i.size = len(d); i.mtime = 1700000000; t.addfile(i, io.BytesIO(d))\n"
                )
            }
            None => {
                script += &format!(
                    "i = tarfile.TarInfo({name:?}); i.type = tarfile.DIRTYPE; i.mode = 0o755; i.mtime = 1700000000; t.addfile(i)\n"
                )
            }
        }
    }
    script += "t.close()\n";
    run_ok(Command::new("python3").arg("-c").arg(script));
}

#[test]
fn duplicates_dotdot_and_absolute_names() {
    let dir = TempDir::new("tar-names");
    let tar = dir.join("names.tar");
    python_tar(
        &tar,
        &[
            ("a.txt", Some("first")),
            ("dir", None),
            ("dir/b.txt", Some("b")),
            ("a.txt", Some("second wins")),
            ("../escape.txt", Some("must not appear")),
            ("dir/../../escape2.txt", Some("must not appear")),
            ("/abs/path.txt", Some("absolute, stripped")),
            ("./dot//slashes/", None),
            ("./dot//slashes/c.txt", Some("c")),
            ("implied/deep/d.txt", Some("d")),
        ],
    );
    let mnt = dir.join("mnt");
    let m = Mount::new(&tar, &mnt, &[]);
    assert_eq!(
        std::fs::read_to_string(m.path.join("a.txt")).unwrap(),
        "second wins"
    );
    assert_eq!(
        std::fs::read_to_string(m.path.join("abs/path.txt")).unwrap(),
        "absolute, stripped"
    );
    assert_eq!(
        std::fs::read_to_string(m.path.join("dot/slashes/c.txt")).unwrap(),
        "c"
    );
    assert_eq!(
        std::fs::read_to_string(m.path.join("implied/deep/d.txt")).unwrap(),
        "d"
    );
    assert!(std::fs::metadata(m.path.join("implied")).unwrap().is_dir());
    let mut names: Vec<_> = std::fs::read_dir(&m.path)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["a.txt", "abs", "dir", "dot", "implied"]);
    assert!(
        !dir.join("escape.txt").exists()
            && !dir.path().parent().unwrap().join("escape.txt").exists()
    );
    // The same as GNU tar leaves it (it also skips `..` members and strips `/`).
    let ex = dir.join("ex");
    extract(&tar, &ex);
    let opts = CompareOpts {
        xattrs: false,
        ..CompareOpts::default()
    };
    // Implied directories get extraction-time attributes from tar -x: compare files only.
    for f in [
        "a.txt",
        "abs/path.txt",
        "dot/slashes/c.txt",
        "implied/deep/d.txt",
        "dir/b.txt",
    ] {
        assert_eq!(
            std::fs::read(ex.join(f)).unwrap(),
            std::fs::read(m.path.join(f)).unwrap(),
            "{f}"
        );
    }
    let _ = opts;
}

#[test]
fn imagenet_tar_of_tars_mounts_recursively() {
    let dir = TempDir::new("tar-imagenet");
    let classes = ["n01440764", "n01443537", "n01484850"];
    let inner = dir.join("inner");
    std::fs::create_dir(&inner).unwrap();
    let mut expected = Vec::new();
    for (ci, class) in classes.iter().enumerate() {
        let cdir = dir.join(format!("src/{class}"));
        std::fs::create_dir_all(&cdir).unwrap();
        for i in 0..40 {
            let name = format!("{class}_{i}.JPEG");
            let data: Vec<u8> = (0..(1000 + i * 3000 + ci * 7))
                .map(|k| (k * 31 + i) as u8)
                .collect();
            std::fs::write(cdir.join(&name), &data).unwrap();
            expected.push((format!("{class}/{name}"), data));
        }
        // Like ILSVRC2012_img_train.tar: each class tar holds its files at top level.
        run_ok(
            Command::new("tar")
                .arg("-cf")
                .arg(inner.join(format!("{class}.tar")))
                .arg("-C")
                .arg(&cdir)
                .arg("."),
        );
    }
    let outer = dir.join("ILSVRC2012_img_train.tar");
    run_ok(
        Command::new("tar")
            .arg("-cf")
            .arg(&outer)
            .arg("-C")
            .arg(&inner)
            .args(classes.map(|c| format!("{c}.tar"))),
    );
    let mnt = dir.join("train");
    let m = Mount::new(&outer, &mnt, &["--recursive"]);
    let mut listed: Vec<_> = std::fs::read_dir(&m.path)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    listed.sort();
    assert_eq!(listed, classes);
    for (rel, data) in expected.iter().rev() {
        assert!(std::fs::read(m.path.join(rel)).unwrap() == *data, "{rel}");
    }
    drop(m);
    // Without --recursive the class tars are plain files.
    let m = Mount::new(&outer, &mnt, &[]);
    assert!(std::fs::metadata(m.path.join("n01440764.tar"))
        .unwrap()
        .is_file());
}

#[test]
fn damaged_archives_and_compressed_non_tars_are_refused_clearly() {
    let dir = TempDir::new("tar-bad");
    let tar = dir.join("ok.tar");
    python_tar(
        &tar,
        &[("a.txt", Some(&"x".repeat(5000))), ("b.txt", Some("b"))],
    );
    let bytes = std::fs::read(&tar).unwrap();
    let mnt = dir.join("mnt");
    let fails = |path: &Path, expect: &str| {
        let out = archfs().arg("mount").arg(path).arg(&mnt).output().unwrap();
        let err = stderr_of(&out);
        assert!(!out.status.success(), "{path:?} mounted");
        assert!(err.contains(expect), "expected {expect:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(!is_mounted(&mnt));
    };
    std::fs::write(dir.join("trunc.tar"), &bytes[..512 + 3000]).unwrap();
    fails(&dir.join("trunc.tar"), "truncated");
    // A damaged first header: this is no tar archive anyone can read.
    let mut bad = bytes.clone();
    bad[10] ^= 0x11;
    std::fs::write(dir.join("badsum.tar"), &bad).unwrap();
    fails(
        &dir.join("badsum.tar"),
        "neither a SquashFS image nor a tar archive",
    );
    // A damaged header later on: GNU tar and bsdtar skip to the next header and extract
    // the rest; so does archfs, saying what it skipped, and `archfs check` fails.
    let mut bad = bytes.clone();
    let second = 512 + 5120; // the second member's header
    bad[second + 10] ^= 0x11;
    std::fs::write(dir.join("badsum2.tar"), &bad).unwrap();
    let out = archfs()
        .arg("mount")
        .arg(dir.join("badsum2.tar"))
        .arg(&mnt)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    let m = Mount { path: mnt.clone() };
    assert!(stderr_of(&out).contains("bytes at offset 5632 where a tar header should be"));
    assert_eq!(
        std::fs::read(m.path.join("a.txt")).unwrap(),
        "x".repeat(5000).as_bytes()
    );
    assert!(!m.path.join("b.txt").exists());
    drop(m);
    let check = archfs()
        .arg("check")
        .arg(dir.join("badsum2.tar"))
        .output()
        .unwrap();
    assert!(!check.status.success());
    assert!(String::from_utf8_lossy(&check.stdout).contains("left out: "));
    for (ext, tool) in [
        ("gz", "gzip"),
        ("zst", "zstd"),
        ("xz", "xz"),
        ("bz2", "bzip2"),
    ] {
        if Command::new(tool).arg("--version").output().is_err() {
            continue;
        }
        // A compressed file that is not a tar (tests/compressed.rs mounts the real ones).
        let out = dir.join(format!("c.txt.{ext}"));
        run_ok(Command::new("sh").arg("-c").arg(format!(
            "echo just some text | {tool} -c > {}",
            out.display()
        )));
        fails(&out, &format!("{tool}-compressed but holds no tar archive"));
    }
}

#[test]
fn the_index_is_saved_reused_and_rebuilt_when_stale_or_damaged() {
    let dir = TempDir::new("tar-index");
    let src = dir.join("src");
    std::fs::create_dir_all(src.join("d")).unwrap();
    for i in 0..50 {
        std::fs::write(src.join(format!("d/f{i}")), format!("file {i}")).unwrap();
    }
    let tar = dir.join("data.tar");
    tar_of(&src, "d", &tar);
    let mnt = dir.join("mnt");
    let log = dir.join("log");
    let mount = |extra: &[&str]| {
        let _ = std::fs::remove_file(&log);
        let mut args = vec!["--debug", "--log", log.to_str().unwrap()];
        args.extend_from_slice(extra);
        Mount::new(&tar, &mnt, &args)
    };
    let logged = || std::fs::read_to_string(&log).unwrap_or_default();

    // Default place: beside the archive.
    let m = mount(&[]);
    assert_eq!(
        std::fs::read_to_string(m.path.join("d/f7")).unwrap(),
        "file 7"
    );
    drop(m);
    let beside = dir.join("data.tar.archfs-index");
    assert!(beside.exists(), "index not saved beside the archive");
    let m = mount(&[]);
    assert!(logged().contains("using the saved index"), "{}", logged());
    drop(m);

    // Stale: the archive grew.
    std::fs::write(src.join("d/new"), "appended").unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    run_ok(
        Command::new("tar")
            .arg("-rf")
            .arg(&tar)
            .arg("-C")
            .arg(&src)
            .arg("d/new"),
    );
    let m = mount(&[]);
    assert!(logged().contains("out of date"), "{}", logged());
    assert_eq!(
        std::fs::read_to_string(m.path.join("d/new")).unwrap(),
        "appended"
    );
    drop(m);

    // Damaged: flipped bytes in the saved file.
    let mut ix = std::fs::read(&beside).unwrap();
    let mid = ix.len() / 2;
    ix[mid] ^= 0xff;
    std::fs::write(&beside, &ix).unwrap();
    let m = mount(&[]);
    assert!(logged().contains("damaged"), "{}", logged());
    assert_eq!(
        std::fs::read_to_string(m.path.join("d/f49")).unwrap(),
        "file 49"
    );
    drop(m);

    // Foreign: another archive's index in its place.
    let other = dir.join("other.tar");
    python_tar(&other, &[("zzz", Some("other"))]);
    let _m = Mount::new(&other, &dir.join("mnt2"), &[]);
    drop(_m);
    std::fs::copy(dir.join("other.tar.archfs-index"), &beside).unwrap();
    let m = mount(&[]);
    assert!(logged().contains("out of date"), "{}", logged());
    assert!(m.path.join("d/f0").exists() && !m.path.join("zzz").exists());
    drop(m);

    // Copied elsewhere with its index (`cp -p`: another inode, the same bytes and times):
    // the index follows it, checked by the archive's first and last 64 KiB.
    let moved = dir.join("moved");
    std::fs::create_dir_all(&moved).unwrap();
    run_ok(
        Command::new("cp")
            .arg("-p")
            .arg(&tar)
            .arg(&beside)
            .arg(&moved),
    );
    let moved_tar = moved.join("data.tar");
    let mount_moved = || {
        let _ = std::fs::remove_file(&log);
        Mount::new(
            &moved_tar,
            &mnt,
            &["--debug", "--log", log.to_str().unwrap()],
        )
    };
    let m = mount_moved();
    assert!(logged().contains("using the saved index"), "{}", logged());
    drop(m);
    // Other bytes of the same length written over it in place, its time put back: the
    // same inode and size and time, another change time: rebuilt.
    let mut bytes = std::fs::read(&moved_tar).unwrap();
    let at = bytes
        .windows(6)
        .position(|w| w == b"file 7")
        .expect("d/f7's data");
    bytes[at..at + 6].copy_from_slice(b"FILE 7");
    let mtime = std::fs::metadata(&moved_tar).unwrap().modified().unwrap();
    std::fs::write(&moved_tar, &bytes).unwrap();
    std::fs::File::options()
        .write(true)
        .open(&moved_tar)
        .unwrap()
        .set_modified(mtime)
        .unwrap();
    let m = mount_moved();
    assert!(logged().contains("out of date"), "{}", logged());
    assert_eq!(
        std::fs::read_to_string(m.path.join("d/f7")).unwrap(),
        "FILE 7"
    );
    drop(m);

    // A chosen place.
    let chosen = dir.join("elsewhere/ix");
    let m = mount(&["--index", chosen.to_str().unwrap()]);
    drop(m);
    assert!(chosen.exists());
}

/// ImageNet's shape (a directory per class, `n01440764_10026.JPEG` names, files of one
/// owner and mode): the packed index stays under 50 bytes an entry in memory and on disk.
#[test]
fn an_imagenet_shaped_index_takes_under_50_bytes_an_entry() {
    let dir = TempDir::new("tar-compact");
    let tar = dir.join("train.tar");
    let script = r#"
import io, sys, tarfile
with tarfile.open(sys.argv[1], "w", format=tarfile.GNU_FORMAT) as t:
    for c in range(20):
        d = "train/n%08d" % (1440764 + c)
        for i in range(1000):
            data = b"x" * (i % 300)
            info = tarfile.TarInfo("%s/%s_%d.JPEG" % (d, d[6:], 10000 + i))
            info.size, info.mtime, info.uid, info.gid = len(data), 1_300_000_000 + i, 1000, 1000
            t.addfile(info, io.BytesIO(data))
"#;
    run_ok(Command::new("python3").arg("-c").arg(script).arg(&tar));
    let entries = 20 * 1000 + 20 + 1;
    let open = || {
        archfs::tar::open(
            std::sync::Arc::new(archfs::source::Source::open(&tar).unwrap()),
            archfs::tar::BuildOptions::default(),
            None,
            None,
            &archfs::tar::Decoding::default(),
        )
        .unwrap()
    };
    let built = open();
    let in_memory = built.index().heap_bytes();
    let on_disk = std::fs::metadata(dir.join("train.tar.archfs-index"))
        .unwrap()
        .len() as usize;
    let loaded = open();
    assert_eq!(built.index(), loaded.index(), "the saved index differs");
    for (what, bytes) in [("in memory", in_memory), ("on disk", on_disk)] {
        let per = bytes as f64 / entries as f64;
        eprintln!("{what}: {bytes} bytes, {per:.1} an entry");
        assert!(per < 50.0, "{what}: {per:.1} bytes an entry");
    }
}

#[test]
fn several_archives_and_a_directory_of_shards_show_as_one_tree() {
    let dir = TempDir::new("tar-union");
    let a = dir.join("a.tar");
    python_tar(
        &a,
        &[
            ("common/x.txt", Some("from a")),
            ("only_a.txt", Some("a")),
            ("dir/sub/a1", Some("a1")),
            ("clash", None),
            ("turned", Some("a file in a")),
        ],
    );
    let bsrc = dir.join("bsrc");
    std::fs::create_dir_all(bsrc.join("common")).unwrap();
    std::fs::create_dir_all(bsrc.join("dir/sub")).unwrap();
    std::fs::write(bsrc.join("common/x.txt"), "from b").unwrap();
    std::fs::write(bsrc.join("only_b.txt"), "b").unwrap();
    std::fs::write(bsrc.join("dir/sub/b1"), "b1").unwrap();
    std::fs::write(bsrc.join("clash"), "a file in b replaces a's directory").unwrap();
    std::fs::create_dir_all(bsrc.join("turned")).unwrap();
    std::fs::write(
        bsrc.join("turned/inside"),
        "b's directory replaces a's file",
    )
    .unwrap();
    let b = dir.join("b.sqfs");
    mksquashfs(&bsrc, &b, &[]);
    // The same with two tars.
    let b_tar = gnu_tar(&dir, &bsrc, "gnu", &[]);
    one_tree_of_two(&dir, &a, &b);
    // Beside a SquashFS image a tar is not merged: its own index is saved.
    assert!(dir.join("a.tar.archfs-index").exists());
    one_tree_of_two(&dir, &a, &b_tar);

    // WebDataset: a directory of shards.
    let shards = dir.join("shards");
    std::fs::create_dir(&shards).unwrap();
    let mut expected = Vec::new();
    for s in 0..12 {
        let mut members = Vec::new();
        let mut contents = Vec::new();
        for k in 0..30 {
            let key = s * 30 + k;
            contents.push((
                format!("{key:06}.jpg"),
                format!("jpeg {key} {}", "x".repeat(key % 500)),
            ));
            contents.push((format!("{key:06}.cls"), format!("{}", key % 10)));
        }
        // The same name in two shards: the later shard (by file name) wins.
        contents.push(("dup.txt".to_string(), format!("shard {s}")));
        for (n, c) in &contents {
            members.push((n.as_str(), Some(c.as_str())));
        }
        python_tar(&shards.join(format!("shard-{s:04}.tar")), &members);
        expected.extend(contents);
    }
    let m = Mount::new(&shards, &dir.join("wds"), &[]);
    let names = std::fs::read_dir(&m.path).unwrap().count();
    assert_eq!(names, 12 * 60 + 1);
    for (n, c) in expected.iter().filter(|(n, _)| n != "dup.txt").step_by(7) {
        assert_eq!(std::fs::read_to_string(m.path.join(n)).unwrap(), *c, "{n}");
    }
    assert_eq!(
        std::fs::read_to_string(m.path.join("dup.txt")).unwrap(),
        "shard 11"
    );
    assert!(std::fs::metadata(m.path.join("nonexistent.jpg")).is_err());
    drop(m);
    // The shards' merged index was saved beside them; a remount uses it, and a shard
    // rewritten since, or the saved index damaged, has it built again.
    let saved: Vec<_> = std::fs::read_dir(&shards)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().contains(".archfs-union-"))
        .collect();
    assert_eq!(
        saved.len(),
        1,
        "the union's index beside the shards: {saved:?}"
    );
    let own = std::fs::read_dir(&shards)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .ends_with(".tar.archfs-index")
        })
        .count();
    assert_eq!(own, 0, "the shards' own indexes were saved");
    let dup = |m: &Mount| std::fs::read_to_string(m.path.join("dup.txt")).unwrap();
    let m = Mount::new(&shards, &dir.join("wds"), &[]);
    assert_eq!(dup(&m), "shard 11");
    drop(m);
    // Written again with a longer name in one file: the same size, the same offsets.
    let mut again: Vec<(&str, Option<&str>)> = expected[11 * 61..12 * 61 - 1]
        .iter()
        .map(|(n, c)| (n.as_str(), Some(c.as_str())))
        .collect();
    again.push(("dup.txt", Some("shard eleven")));
    let before = std::fs::metadata(shards.join("shard-0011.tar"))
        .unwrap()
        .len();
    python_tar(&shards.join("shard-0011.tar"), &again);
    assert_eq!(
        std::fs::metadata(shards.join("shard-0011.tar"))
            .unwrap()
            .len(),
        before
    );
    let m = Mount::new(&shards, &dir.join("wds"), &[]);
    assert_eq!(dup(&m), "shard eleven");
    assert_eq!(
        std::fs::read_to_string(m.path.join("000359.jpg")).unwrap(),
        expected[11 * 61 + 58].1
    );
    drop(m);
    // Written again smaller.
    python_tar(
        &shards.join("shard-0011.tar"),
        &[("dup.txt", Some("shard 11, written again"))],
    );
    let m = Mount::new(&shards, &dir.join("wds"), &[]);
    assert_eq!(dup(&m), "shard 11, written again");
    assert!(std::fs::metadata(m.path.join("000359.jpg")).is_err());
    assert_eq!(
        std::fs::read_to_string(m.path.join("000007.jpg")).unwrap(),
        expected[14].1
    );
    drop(m);
    let mut bytes = std::fs::read(&saved[0]).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    std::fs::write(&saved[0], bytes).unwrap();
    let m = Mount::new(&shards, &dir.join("wds"), &[]);
    assert_eq!(dup(&m), "shard 11, written again");
    assert_eq!(std::fs::read_dir(&m.path).unwrap().count(), 11 * 60 + 1);
    drop(m);

    // No name in two shards (the listing is then the members' own, unmerged), one with
    // a directory of its own.
    let unique = dir.join("unique");
    std::fs::create_dir(&unique).unwrap();
    for s in 0..8 {
        let mut members: Vec<(String, Option<String>)> = (0..20)
            .map(|k| (format!("{:06}.jpg", s * 20 + k), Some(format!("u{s}/{k}"))))
            .collect();
        if s == 5 {
            members.push(("only5/deep.txt".into(), Some("deep in 5".into())));
        }
        let members: Vec<_> = members
            .iter()
            .map(|(n, c)| (n.as_str(), c.as_deref()))
            .collect();
        python_tar(&unique.join(format!("u-{s:04}.tar")), &members);
    }
    let m = Mount::new(&unique, &dir.join("u"), &[]);
    // `find` stats a large directory's entries in inode order: that order must be the
    // listing's, or it outruns the listing ahead and each stat is a LOOKUP.
    let files: Vec<u64> = std::fs::read_dir(&m.path)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_type().unwrap().is_file())
        .map(|e| std::os::unix::fs::DirEntryExt::ino(&e))
        .collect();
    assert_eq!(files.len(), 8 * 20);
    assert!(
        files.windows(2).all(|w| w[0] < w[1]),
        "inode numbers follow the listing: {files:?}"
    );
    let mut names: Vec<_> = std::fs::read_dir(&m.path)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names.len(), 8 * 20 + 1);
    assert_eq!(names[0], "000000.jpg");
    assert_eq!(names.last().unwrap(), "only5");
    assert_eq!(
        std::fs::read_to_string(m.path.join("000047.jpg")).unwrap(),
        "u2/7"
    );
    assert_eq!(
        std::fs::read_to_string(m.path.join("only5/deep.txt")).unwrap(),
        "deep in 5"
    );
    assert!(std::fs::metadata(m.path.join("only5")).unwrap().is_dir());
}

/// `a` and `b` mounted together: the archive given last wins, directories merge, and the
/// listing says what the last archive has under each name, once.
fn one_tree_of_two(dir: &TempDir, a: &Path, b: &Path) {
    let mnt = dir.join("mnt");
    run_ok(archfs().arg("mount").arg(a).arg(b).arg(&mnt));
    let m = Mount { path: mnt.clone() };
    let read = |p: &str| std::fs::read_to_string(m.path.join(p)).unwrap();
    assert_eq!(
        read("common/x.txt"),
        "from b",
        "the archive given last wins"
    );
    assert_eq!(read("only_a.txt"), "a");
    assert_eq!(read("only_b.txt"), "b");
    assert_eq!(read("dir/sub/a1"), "a1");
    assert_eq!(read("dir/sub/b1"), "b1");
    assert_eq!(read("clash"), "a file in b replaces a's directory");
    assert_eq!(read("turned/inside"), "b's directory replaces a's file");
    // The listing says what the last archive has under each name, once.
    let mut kinds: Vec<(String, bool)> = std::fs::read_dir(&m.path)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let dir = e.file_type().unwrap().is_dir();
            (e.file_name().into_string().unwrap(), dir)
        })
        .collect();
    kinds.sort();
    let want = [
        ("clash", false),
        ("common", true),
        ("dir", true),
        ("only_a.txt", false),
        ("only_b.txt", false),
        ("turned", true),
    ];
    assert_eq!(kinds, want.map(|(n, d)| (n.to_string(), d)));
    let turned: Vec<_> = std::fs::read_dir(m.path.join("turned"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(turned, ["inside"]);
    let mut sub: Vec<_> = std::fs::read_dir(m.path.join("dir/sub"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    sub.sort();
    assert_eq!(sub, ["a1", "b1"], "directories merge");
}

/// Shards of one tree, as WebDataset's writers deal a dataset out (every directory in
/// each shard, the other entries spread among them), mount as `tar -x` of each, one
/// after another, makes (sparse files, hard links, symlinks, devices, xattrs), and again
/// from their saved indexes.
#[test]
fn shards_of_one_tree_mount_as_their_extraction_one_after_another() {
    use std::os::unix::ffi::OsStrExt;
    let dir = TempDir::new("tar-shards-of-a-tree");
    let src = awkward(&dir, small());
    // A sparse file small enough for this test: data, a hole, data.
    std::fs::create_dir(src.join("sparse")).unwrap();
    let holes = std::fs::File::create(src.join("sparse/holes")).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&holes, b"start", 0).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&holes, &[7u8; 70_000], 3 << 20).unwrap();
    drop(holes);
    let (mut dirs, mut others) = (vec![b".".to_vec()], Vec::new());
    let mut stack = vec![src.clone()];
    while let Some(d) = stack.pop() {
        let mut inside: Vec<_> = std::fs::read_dir(&d)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        inside.sort();
        for p in inside {
            let rel = [b"./", p.strip_prefix(&src).unwrap().as_os_str().as_bytes()].concat();
            if std::fs::symlink_metadata(&p).unwrap().is_dir() {
                dirs.push(rel);
                stack.push(p);
            } else {
                others.push(rel);
            }
        }
    }
    assert!(others.len() > 100, "the tree has {} files", others.len());
    let shards = dir.join("shards");
    std::fs::create_dir(&shards).unwrap();
    let ex = dir.join("extracted");
    // Hard links in one shard (a shard's own links), the sparse file in the last (its
    // data far from where the merged index's offsets start).
    let shard_of = |i: usize, name: &[u8]| match name {
        n if n.starts_with(b"./hardlinks/") => 1,
        n if n.starts_with(b"./sparse/") => 2,
        _ => i % 3,
    };
    for k in 0..3 {
        let mut list = Vec::new();
        let mine = others
            .iter()
            .enumerate()
            .filter(|(i, n)| shard_of(*i, n) == k)
            .map(|(_, n)| n);
        for name in dirs.iter().chain(mine) {
            list.extend_from_slice(name);
            list.push(0);
        }
        let listed = dir.join(format!("list-{k}"));
        std::fs::write(&listed, list).unwrap();
        let tar = shards.join(format!("shard-{k}.tar"));
        make_tar(
            Command::new("tar")
                .args([
                    "--format=posix",
                    "--xattrs",
                    "--xattrs-include=user.*",
                    "--sparse",
                ])
                .args(["--no-recursion", "--null", "-cf"])
                .arg(&tar)
                .arg("-C")
                .arg(&src)
                .arg("-T")
                .arg(&listed),
            &tar,
        );
        extract(&tar, &ex);
    }
    // GNU tar leaves a directory it extracts into with the time of that extraction; the
    // union shows the last archive's entry (the source's), as for one tar holding it twice.
    for d in &dirs {
        let rel = std::ffi::OsStr::from_bytes(d);
        run_ok(
            Command::new("touch")
                .arg("-r")
                .arg(src.join(rel))
                .arg(ex.join(rel)),
        );
    }
    let opts = CompareOpts {
        root_attrs: true,
        ..CompareOpts::default()
    };
    for pass in ["indexed", "from saved indexes"] {
        let m = Mount::new(&shards, &dir.join("mnt"), &[]);
        assert_same(&ex, &m.path, &opts, pass);
    }
}

/// A union of more shards than a cluster's usual soft limit on open files (1,024) mounts:
/// archfs raises the limit for itself, not for the command `archfs run` starts.
#[test]
fn more_shards_than_the_soft_limit_on_open_files() {
    use std::os::unix::process::CommandExt;
    let dir = TempDir::new("tar-many-shards");
    let shards = dir.join("shards");
    std::fs::create_dir(&shards).unwrap();
    let n = 1100;
    let script = format!(
        r#"
import io, tarfile
for s in range({n}):
    with tarfile.open("{dir}/s-%05d.tar" % s, "w") as t:
        body = b"sample %d" % s
        i = tarfile.TarInfo("%06d.cls" % s); i.size = len(body); i.mtime = 1700000000
        t.addfile(i, io.BytesIO(body))
"#,
        dir = shards.display()
    );
    run_ok(Command::new("python3").arg("-c").arg(script));
    let soft_1024 = |cmd: &mut Command| {
        // SAFETY: setrlimit in the child before exec, async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                let mut l = libc::rlimit {
                    rlim_cur: 0,
                    rlim_max: 0,
                };
                libc::getrlimit(libc::RLIMIT_NOFILE, &mut l);
                l.rlim_cur = 1024;
                libc::setrlimit(libc::RLIMIT_NOFILE, &l);
                Ok(())
            });
        }
    };
    let mnt = dir.join("mnt");
    let mut cmd = archfs();
    cmd.arg("run").arg(&shards).arg(&mnt).args([
        "--",
        "python3",
        "-c",
        "import os, resource; n = len(os.listdir(os.environ['ARCHFS_MOUNTPOINT'])); \
         last = open(os.environ['ARCHFS_MOUNTPOINT'] + '/001099.cls').read(); \
         print(n, last, resource.getrlimit(resource.RLIMIT_NOFILE)[0])",
    ]);
    soft_1024(&mut cmd);
    let out = run_ok(&mut cmd);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("{n} sample 1099 1024"),
        "{}",
        stderr_of(&out)
    );
    assert!(!is_mounted(&mnt));
}

#[test]
fn a_pax_member_over_8_gib() {
    let dir = TempDir::new("tar-huge");
    let tar = dir.join("huge.tar");
    // Header from Python's tarfile (PAX carries the size), then a hole standing for
    // 9 GiB of zeros, the member's last bytes, and the end blocks: a sparse archive.
    let script = format!(
        r#"
import tarfile
size = 9 * 2**30 + 100
i = tarfile.TarInfo("big/huge.bin"); i.size = size; i.mtime = 1700000000
hdr = i.tobuf(format=tarfile.PAX_FORMAT)
with open({path:?}, "wb") as f:
    f.write(hdr)
    f.seek(len(hdr) + size - 5)
    f.write(b"TAIL!")
    f.seek(len(hdr) + (size + 511) // 512 * 512)
    f.write(b"\0" * 1024)
"#,
        path = tar.to_str().unwrap()
    );
    run_ok(Command::new("python3").arg("-c").arg(script));
    let m = Mount::new(&tar, &dir.join("mnt"), &[]);
    let f = m.path.join("big/huge.bin");
    let size = 9u64 * (1 << 30) + 100;
    assert_eq!(std::fs::metadata(&f).unwrap().len(), size);
    use std::io::{Read, Seek, SeekFrom};
    let mut h = std::fs::File::open(&f).unwrap();
    h.seek(SeekFrom::Start(size - 4096)).unwrap();
    let mut tail = Vec::new();
    h.read_to_end(&mut tail).unwrap();
    assert_eq!(tail.len(), 4096);
    assert!(tail[..4091].iter().all(|&b| b == 0));
    assert_eq!(&tail[4091..], b"TAIL!");
}

/// A PAX 1.0 sparse member with 1.5 million regions: GNU tar writes a line a region, so
/// its map (20 MB here) outgrows any fixed cap on metadata (it was 16 MiB). The regions
/// are one byte each to keep the archive small; GNU tar lists the member, and the reader
/// finds every sampled region and the holes between.
#[test]
fn a_pax_sparse_map_of_a_million_regions() {
    use archfs::archive::ROOT_INO;
    use archfs::cache::CacheConfig;
    use archfs::open;
    let dir = TempDir::new("tar-regions");
    let tar = dir.join("regions.tar");
    let regions: u64 = 1_500_000;
    let script = format!(
        r#"
import io, tarfile
n = {regions}
real = n * 8192
lines = [str(n)]
for i in range(n):
    lines += [str(i * 8192), "1"]
m = ("\n".join(lines) + "\n").encode()
m += b"\0" * (-len(m) % 512)
data = bytes((i % 251) + 1 for i in range(n))
ti = tarfile.TarInfo("GNUSparseFile.0/sparse")
ti.size = len(m) + len(data)
ti.pax_headers = {{"GNU.sparse.major": "1", "GNU.sparse.minor": "0",
    "GNU.sparse.name": "sparse", "GNU.sparse.realsize": str(real)}}
with tarfile.open("{tar}", "w", format=tarfile.PAX_FORMAT) as t:
    t.addfile(ti, io.BytesIO(m + data))
"#,
        tar = tar.display()
    );
    run_ok(Command::new("python3").arg("-c").arg(&script));
    let listed = run_ok(Command::new("tar").arg("-tvf").arg(&tar));
    let listed = String::from_utf8_lossy(&listed.stdout);
    assert!(
        listed.contains(&format!(" {} ", regions * 8192)) && listed.contains("sparse"),
        "GNU tar lists: {listed}"
    );
    let a = open::open(&tar, &CacheConfig::default()).unwrap();
    let attr = a.lookup(ROOT_INO, b"sparse").unwrap();
    // GNU tar lists the real size, but extracts as far as the map reaches (its own maps
    // end on an empty region at the real size; this one has none), and so does archfs.
    assert_eq!(attr.size, (regions - 1) * 8192 + 1);
    for i in [0, 1, 777_777, regions - 1] {
        let got = a.read(attr.ino, i * 8192, 8192).unwrap();
        let mut want = vec![0u8; 8192];
        want[0] = (i % 251) as u8 + 1;
        want.truncate((attr.size - i * 8192).min(8192) as usize);
        assert!(*got == *want, "region {i}");
    }
}
