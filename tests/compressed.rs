//! Compressed tar archives (gzip, zstd, xz, bzip2) made by every writer users have,
//! mounted and compared with what `tar -x` extracts from the same file; reads at random
//! offsets through the entry points, checked byte for byte without a mount; damage,
//! truncation and a damaged saved index.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;

use archfs::archive;
use archfs::cache::CacheConfig;
use archfs::open::{self, OpenOptions};
use common::tree::{make_awkward_tree, CompareOpts, TreeSpec};
use common::*;

/// Entry points this close together give even the small fixtures several of them.
const SPACING: &str = "256K";

/// The awkward tree plus a few MiB of compressible data, so gzip writes many dynamic
/// deflate blocks and entry points fall mid-byte with a full window behind them.
fn fixture(dir: &TempDir) -> PathBuf {
    let src = dir.join("src");
    std::fs::create_dir(&src).unwrap();
    make_awkward_tree(
        &src,
        &TreeSpec {
            big_dir_entries: 500,
            sparse_4g: false,
            ..TreeSpec::default()
        },
    )
    .unwrap();
    std::fs::write(src.join("words.txt"), words(3 << 20, 7)).unwrap();
    src
}

/// Text-like bytes: a small alphabet, so every compressor finds matches.
fn words(len: usize, seed: u64) -> Vec<u8> {
    let mut next = xorshift_bytes(seed);
    next(len)
        .into_iter()
        .map(|b| b"etaoin shrdlu\n"[(b % 14) as usize])
        .collect()
}

fn pax_tar(dir: &TempDir, src: &Path) -> PathBuf {
    let tar = dir.join("base.tar");
    posix_tar(src, &tar);
    tar
}

/// `sh -c` with `$IN` and `$OUT` set.
fn compress(script: &str, input: &Path, out: &Path) {
    run_ok(
        Command::new("sh")
            .arg("-c")
            .arg(script)
            .env("IN", input)
            .env("OUT", out),
    );
    assert!(out.exists(), "{script} made nothing");
}

fn index_of(archive: &Path) -> PathBuf {
    archive.with_file_name(format!(
        "{}.archfs-index",
        archive.file_name().unwrap().to_string_lossy()
    ))
}

/// Mounts `archive` twice (indexing it, then from the saved index) and compares each
/// with `tar -x` of the same file (xattrs too, if the writer stores them); returns what
/// `archfs info` says of it.
fn check(dir: &TempDir, archive: &Path, what: &str, xattrs: bool) -> String {
    let ex = dir.join(format!("x-{what}"));
    extract(archive, &ex);
    let mnt = dir.join(format!("m-{what}"));
    let opts = CompareOpts {
        xattrs,
        root_attrs: true,
        ..CompareOpts::default()
    };
    for pass in ["indexed", "saved index"] {
        let m = Mount::new(
            archive,
            &mnt,
            &["--cache-size", "8M", "--entry-spacing", SPACING],
        );
        common::suite::check_mount(&ex, &m.path, &opts, &format!("{what}, {pass}"));
        assert!(index_of(archive).exists(), "{what}: no index saved");
    }
    let info = run_ok(archfs().arg("info").arg(archive));
    std::fs::remove_dir_all(&ex).unwrap();
    String::from_utf8_lossy(&info.stdout).into_owned()
}

/// The number in "N entry points" of `archfs info`.
fn entry_points(info: &str) -> usize {
    let at = info.find(" entry point").expect(info);
    info[..at]
        .rsplit(|c: char| !c.is_ascii_digit())
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// The saved gzip windows' size in `archfs info`'s line.
fn window_kib(info: &str) -> usize {
    let at = info.find("windows ").expect(info) + "windows ".len();
    info[at..].split(' ').next().unwrap().parse().unwrap()
}

/// `n` compressed shards of `files` text files each (`part{s:02}/{i}.txt`), made by
/// `tools[s % tools.len()]`, in `dir/shards`; the same files, all together, in `dir/all`.
fn shards(dir: &TempDir, n: usize, files: usize, tools: &[&str]) -> (PathBuf, PathBuf) {
    let (shards, all) = (dir.join("shards"), dir.join("all"));
    std::fs::create_dir(&shards).unwrap();
    for s in 0..n {
        let src = dir.join(format!("s{s}"));
        let part = format!("part{s:02}");
        std::fs::create_dir_all(src.join(&part)).unwrap();
        std::fs::create_dir_all(all.join(&part)).unwrap();
        for i in 0..files {
            let body = words(30_000 + i * 999, s as u64 * 100 + i as u64);
            std::fs::write(src.join(&part).join(format!("{i}.txt")), &body).unwrap();
            std::fs::write(all.join(&part).join(format!("{i}.txt")), &body).unwrap();
        }
        let tar = dir.join(format!("s{s}.tar"));
        tar_of(&src, ".", &tar);
        let tool = tools[s % tools.len()];
        let out = shards.join(format!("s{s:02}.tar.c"));
        compress(&format!("{tool} < \"$IN\" > \"$OUT\""), &tar, &out);
    }
    (shards, all)
}

/// Reads every file of [`shards`] through the mount.
fn check_shards(mnt: &Path, all: &Path, n: usize, files: usize, what: &str) {
    for s in 0..n {
        for i in 0..files {
            let rel = format!("part{s:02}/{i}.txt");
            assert!(
                std::fs::read(mnt.join(&rel)).unwrap() == std::fs::read(all.join(&rel)).unwrap(),
                "{rel} ({what})"
            );
        }
    }
}

#[test]
fn gzip_from_every_writer_matches_tar_x() {
    let dir = TempDir::new("gz-writers");
    let src = fixture(&dir);
    let tar = pax_tar(&dir, &src);
    for (name, script) in [
        ("gzip", "gzip -6 -c < \"$IN\" > \"$OUT\""),
        ("gzip-1", "gzip -1 -c < \"$IN\" > \"$OUT\""),
        ("pigz", "pigz -p 2 -c < \"$IN\" > \"$OUT\""),
        // Many small members: a gzip member for every 64 KiB.
        ("bgzip", "bgzip -c < \"$IN\" > \"$OUT\""),
        (
            "concat",
            "head -c 1000000 \"$IN\" | gzip -c > \"$OUT\"; tail -c +1000001 \"$IN\" | gzip -c >> \"$OUT\"",
        ),
    ] {
        let gz = dir.join(format!("{name}.tar.gz"));
        compress(script, &tar, &gz);
        let info = check(&dir, &gz, name, true);
        assert!(info.contains("gzip"), "{info}");
        assert!(
            entry_points(&info) >= 20,
            "{name}: expected an entry point every {SPACING}: {info}"
        );
    }
}

#[test]
fn zstd_frames_are_entry_points_and_one_frame_is_staged() {
    let dir = TempDir::new("zst-writers");
    let src = fixture(&dir);
    let tar = pax_tar(&dir, &src);
    let one = dir.join("one.tar.zst");
    compress(
        "zstd -q --single-thread -c < \"$IN\" > \"$OUT\"",
        &tar,
        &one,
    );
    let info = check(&dir, &one, "zstd", true);
    assert!(info.contains("decoded copy"), "{info}");
    // pzstd's frames, and frames of every kind of header (with and without checksums
    // and sizes, skippable frames between, one shaped like pzstd's size of the next
    // frame but giving a wrong size) cut from the tar and concatenated: decoded in
    // parallel by the indexing pass.
    for (name, frames, script) in [
        ("pzstd", 2, "pzstd -q -p 2 -c < \"$IN\" > \"$OUT\""),
        (
            "zstd-cat",
            3,
            "head -c 1000000 \"$IN\" | zstd -q --no-check -c > \"$OUT\"; \
             printf '\\120\\052\\115\\030\\003\\0\\0\\0abc' >> \"$OUT\"; \
             printf '\\120\\052\\115\\030\\004\\0\\0\\0\\144\\0\\0\\0' >> \"$OUT\"; \
             tail -c +1000001 \"$IN\" | head -c 1000000 | zstd -q -19 --no-content-size -c >> \"$OUT\"; \
             tail -c +2000001 \"$IN\" | zstd -q -c >> \"$OUT\"",
        ),
    ] {
        let many = dir.join(format!("{name}.tar.zst"));
        compress(script, &tar, &many);
        let info = check(&dir, &many, name, true);
        assert!(
            entry_points(&info) >= frames && !info.contains("decoded copy"),
            "{info}"
        );
    }
}

/// xz blocks and bzip2 blocks are entry points; an xz archive of one block is staged.
#[test]
fn xz_and_bzip2_from_every_writer_match_tar_x() {
    let dir = TempDir::new("xz-bz2-writers");
    let src = fixture(&dir);
    let tar = pax_tar(&dir, &src);
    // (writer, entry points at least: 1 means served from a decoded copy)
    for (name, points, script) in [
        ("xz", 1, "xz -c < \"$IN\" > \"$OUT\""),
        (
            "xz-T2",
            8,
            "xz -T2 --block-size=300KiB -c < \"$IN\" > \"$OUT\"",
        ),
        // Filters before LZMA2 and every check type.
        (
            "xz-filters",
            8,
            "xz --x86 --delta=dist=4 --lzma2=preset=1 --block-size=300KiB --check=sha256 \
             -c < \"$IN\" > \"$OUT\"",
        ),
        (
            "xz-none",
            8,
            "xz -T2 --block-size=300KiB --check=none -c < \"$IN\" > \"$OUT\"",
        ),
        // Concatenated streams with stream padding between, and a check of each kind:
        // liblzma's threaded decoder reads one stream, archfs starts the next.
        (
            "xz-cat",
            4,
            "head -c 1000000 \"$IN\" | xz -T2 --block-size=300KiB --check=crc32 -c > \"$OUT\"; \
             printf '\\0\\0\\0\\0' >> \"$OUT\"; \
             tail -c +1000001 \"$IN\" | xz -T2 --block-size=1MiB -c >> \"$OUT\"",
        ),
        ("bzip2", 3, "bzip2 -c < \"$IN\" > \"$OUT\""),
        ("bzip2-1", 8, "bzip2 -1 -c < \"$IN\" > \"$OUT\""),
        ("lbzip2", 3, "lbzip2 -n 2 -c < \"$IN\" > \"$OUT\""),
        // A stream per block.
        ("pbzip2", 8, "pbzip2 -p2 -b1 -c < \"$IN\" > \"$OUT\""),
    ] {
        let file = dir.join(format!("{name}.tar.c"));
        compress(script, &tar, &file);
        let info = check(&dir, &file, name, true);
        let staged = info.contains("decoded copy");
        assert!(
            (points == 1) == staged && entry_points(&info) >= points,
            "{name}: {info}"
        );
    }
}

#[test]
fn python_tarfile_compressed_archives_match_tar_x() {
    let dir = TempDir::new("py-compressed");
    let src = fixture(&dir);
    for mode in ["gz", "bz2", "xz"] {
        let archive = dir.join(format!("py.tar.{mode}"));
        let script = format!(
            "import tarfile\nwith tarfile.open({:?}, 'w:{mode}', format=tarfile.PAX_FORMAT) as t:\n    t.add({:?}, arcname='.')\n",
            archive.to_str().unwrap(),
            src.to_str().unwrap()
        );
        run_ok(Command::new("python3").arg("-c").arg(script));
        // tarfile stores no xattrs.
        check(&dir, &archive, &format!("py-{mode}"), false);
    }
}

/// Reads a large member at random offsets and lengths, and across every multiple of the
/// spacing, through the archive interface with a cache too small to hold it, so most
/// reads decode from an entry point.
#[test]
fn random_reads_through_every_entry_point_match_the_source() {
    let dir = TempDir::new("gz-random");
    let src = dir.join("src");
    std::fs::create_dir(&src).unwrap();
    // Stretches of text (copies everywhere) and of noise (few): deflate's window is
    // mostly unused in the second, so the saved windows shrink to a fraction.
    let mut noise = xorshift_bytes(12);
    let data: Vec<u8> = (0..12)
        .flat_map(|i| {
            if i % 2 == 0 {
                words(1 << 20, i)
            } else {
                noise(1 << 20)
            }
        })
        .collect();
    std::fs::write(src.join("big"), &data).unwrap();
    let tar = dir.join("big.tar");
    tar_of(&src, "big", &tar);
    // The smallest spacing: several entry points in one step of the indexing pass.
    let spacing = 64u64 << 10;
    // (name, entry points at least, writer)
    for (name, least, script) in [
        ("gz", 20, "gzip -6 -c < \"$IN\" > \"$OUT\""),
        ("pzstd", 2, "pzstd -q -p 2 -c < \"$IN\" > \"$OUT\""),
        ("bz2", 30, "bzip2 -1 -c < \"$IN\" > \"$OUT\""),
        (
            "xz",
            16,
            "xz -T2 --block-size=700KiB -c < \"$IN\" > \"$OUT\"",
        ),
    ] {
        let file = dir.join(format!("big.tar.{name}"));
        compress(script, &tar, &file);
        let options = OpenOptions {
            spacing: Some(spacing),
            ..OpenOptions::default()
        };
        let cache = CacheConfig {
            total_bytes: 2 << 20,
        };
        for pass in ["indexed", "saved index"] {
            let a = open::open_with(&file, &cache, &options).unwrap();
            assert!(
                !a.format().contains("decoded copy") && entry_points(&a.format()) >= least,
                "{name}: {}",
                a.format()
            );
            if name == "gz" {
                // Only deflate block ends qualify, so they come somewhat further apart;
                // in the text, further still, so its windows stay within 1% of the archive.
                let points = entry_points(&a.format());
                let whole = points * 32;
                assert!(
                    window_kib(&a.format()) * 3 < whole,
                    "windows not thinned: {} (whole: {whole} KiB)",
                    a.format()
                );
            }
            let ino = archive::resolve(a.as_ref(), Path::new("big")).unwrap().ino;
            let check = |off: u64, len: u32| {
                let got = a.read(ino, off, len).unwrap();
                let end = (off as usize + len as usize).min(data.len());
                assert!(
                    got[..] == data[off as usize..end],
                    "{name} ({pass}): read of {len} at {off} differs"
                );
            };
            let mut off = spacing;
            while off < data.len() as u64 {
                check(off - 3, 7);
                check(off.saturating_sub(70_000), 140_000);
                off += spacing;
            }
            let mut rnd = xorshift_bytes(99);
            for _ in 0..300 {
                let r = rnd(8);
                let v = u64::from_le_bytes(r.try_into().unwrap());
                let off = v % data.len() as u64;
                let len = (v >> 40) as u32 % (300 << 10) + 1;
                check(off, len);
            }
            check(data.len() as u64 - 10, 100);
        }
    }
}

/// Damage in the middle of an indexed archive (its size, mtime and ends unchanged, so
/// the saved index still applies) fails the reads of the files decoded from the damaged
/// stretch with EIO, and only those; a truncated archive or one damaged at the start is
/// refused at mount with one clear line.
#[test]
fn damage_gives_eio_for_the_files_in_it_and_truncation_is_refused() {
    let dir = TempDir::new("gz-damage");
    let src = dir.join("src");
    std::fs::create_dir(&src).unwrap();
    let mut rnd = xorshift_bytes(5);
    for i in 0..200 {
        std::fs::write(src.join(format!("f{i:03}")), rnd(100_000)).unwrap();
    }
    let tar = dir.join("d.tar");
    tar_of(&src, ".", &tar);
    for (name, script) in [
        ("gz", "gzip -c < \"$IN\" > \"$OUT\""),
        ("pzstd", "pzstd -q -p 2 -c < \"$IN\" > \"$OUT\""),
        ("bz2", "bzip2 -1 -c < \"$IN\" > \"$OUT\""),
        ("xz", "xz -T2 --block-size=400KiB -c < \"$IN\" > \"$OUT\""),
    ] {
        let file = dir.join(format!("d.tar.{name}"));
        compress(script, &tar, &file);
        let mnt = dir.join(format!("m-{name}"));
        drop(Mount::new(&file, &mnt, &["--entry-spacing", SPACING]));
        let info = run_ok(archfs().arg("info").arg(&file));
        let points = entry_points(&String::from_utf8_lossy(&info.stdout));
        let orig = std::fs::read(&file).unwrap();
        let mut bytes = orig.clone();
        let mtime = std::fs::metadata(&file).unwrap().modified().unwrap();
        let mid = bytes.len() / 2;
        for b in &mut bytes[mid..mid + 16] {
            *b ^= 0x5a;
        }
        std::fs::write(&file, &bytes).unwrap();
        std::fs::File::options()
            .write(true)
            .open(&file)
            .unwrap()
            .set_modified(mtime)
            .unwrap();
        let m = Mount::new(&file, &mnt, &["--entry-spacing", SPACING]);
        let (mut bad, mut good) = (0, 0);
        for i in 0..200 {
            let name = format!("f{i:03}");
            match std::fs::read(m.path.join(&name)) {
                Ok(got) => {
                    assert!(
                        got == std::fs::read(src.join(&name)).unwrap(),
                        "{name} differs"
                    );
                    good += 1;
                }
                Err(e) => {
                    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{name}: {e}");
                    bad += 1;
                }
            }
        }
        // The damage reaches the files decoded from the same stretch: a few 100 KB files
        // in gzip's 256 KiB stretches, a frame's worth in pzstd's.
        let most = if name == "gz" { 8 } else { 200 / points + 3 };
        assert!(
            (1..=most).contains(&bad),
            "{name}: {bad} unreadable (at most {most} expected), {good} read"
        );
        drop(m);

        // Truncated, and damaged at the start: refused at mount.
        let cut = dir.join(format!("cut.tar.{name}"));
        std::fs::write(&cut, &orig[..orig.len() * 2 / 3]).unwrap();
        let out = archfs().arg("mount").arg(&cut).arg(&mnt).output().unwrap();
        assert!(!out.status.success() && !is_mounted(&mnt));
        let err = stderr_of(&out);
        assert!(err.contains("truncated"), "{name}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        let start = dir.join(format!("start.tar.{name}"));
        compress(script, &tar, &start);
        let mut s = std::fs::read(&start).unwrap();
        for b in &mut s[20..60] {
            *b ^= 0xa5;
        }
        std::fs::write(&start, &s).unwrap();
        let out = archfs()
            .arg("mount")
            .arg(&start)
            .arg(&mnt)
            .output()
            .unwrap();
        assert!(!out.status.success() && !is_mounted(&mnt));
        let err = stderr_of(&out);
        assert!(err.contains("damaged"), "{name}: {err}");
    }
}

/// A damaged saved index is rebuilt, and a directory of compressed shards mounts as one
/// tree.
#[test]
fn shards_mount_as_a_union_and_a_damaged_index_is_rebuilt() {
    let dir = TempDir::new("gz-shards");
    let (shards, all) = shards(&dir, 3, 20, &["gzip -c", "pzstd -q -c", "bgzip -c"]);
    let mnt = dir.join("mnt");
    for pass in ["indexed", "saved"] {
        let m = Mount::new(&shards, &mnt, &[]);
        check_shards(&m.path, &all, 3, 20, pass);
    }
    // The union saved its merged index and not its members' own.
    let saved: Vec<_> = std::fs::read_dir(&shards)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".archfs-index"))
        .collect();
    assert!(
        saved.len() == 1 && saved[0].starts_with(".archfs-union-"),
        "{saved:?}"
    );
    // One shard mounted alone saves its own.
    let one = shards.join("s00.tar.c");
    drop(Mount::new(&one, &mnt, &[]));
    let ix = index_of(&one);
    let mut b = std::fs::read(&ix).unwrap();
    let at = b.len() / 2;
    b[at] ^= 0xff;
    std::fs::write(&ix, &b).unwrap();
    let log = dir.join("log");
    let m = Mount::new(&one, &mnt, &["--debug", "--log", log.to_str().unwrap()]);
    assert!(std::fs::read_to_string(&log).unwrap().contains("damaged"));
    assert!(
        std::fs::read(m.path.join("part00/3.txt")).unwrap()
            == std::fs::read(all.join("part00/3.txt")).unwrap()
    );
}

/// `--preload` decodes a gzip or zstd archive ahead, on every core from its entry points,
/// into a copy: reads before a stretch is copied decode it in place, reads after come
/// from the copy; both equal `tar -x`.
#[test]
fn preload_decodes_ahead_into_a_copy_that_reads_match() {
    let dir = TempDir::new("preload-decoded");
    let src = fixture(&dir);
    let tar = pax_tar(&dir, &src);
    let ex = dir.join("x");
    extract(&tar, &ex);
    let opts = CompareOpts {
        xattrs: true,
        root_attrs: true,
        ..CompareOpts::default()
    };
    for (name, script, preload) in [
        ("gz", "gzip -c < \"$IN\" > \"$OUT\"", "--preload=always"),
        // `auto` starts once 128 files have been read: during the first comparison.
        (
            "pzstd",
            "pzstd -q -p 2 -c < \"$IN\" > \"$OUT\"",
            "--preload=auto",
        ),
    ] {
        let file = dir.join(format!("p.tar.{name}"));
        compress(script, &tar, &file);
        let log = dir.join(format!("{name}.log"));
        let mnt = dir.join(format!("m-{name}"));
        let m = Mount::new(
            &file,
            &mnt,
            &[
                preload,
                "--cache-size",
                "8M",
                "--entry-spacing",
                "64K",
                "--debug",
                "--log",
                log.to_str().unwrap(),
            ],
        );
        common::suite::check_mount(&ex, &m.path, &opts, &format!("{name}, while copying"));
        let read_log = || std::fs::read_to_string(&log).unwrap_or_default();
        assert!(
            wait_for(120, || read_log().contains("decoded copy of")),
            "{name}: the decoded copy did not finish: {}",
            read_log()
        );
        assert!(read_log().contains("--preload: decoding"), "{}", read_log());
        common::suite::check_mount(&ex, &m.path, &opts, &format!("{name}, copied"));
    }
}

/// Threads of `server` that make decoded copies.
fn stage_threads(server: i32) -> usize {
    std::fs::read_dir(format!("/proc/{server}/task"))
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.unwrap().path().join("comm")).ok())
        .filter(|c| c.starts_with("archfs-stage"))
        .count()
}

/// Copying threads archfs runs at most: one a core, at most 8.
fn cores() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |c| c.get())
        .min(8)
}

/// `--preload` of a directory of many shards: every shard's copy is made, by one pool of
/// at most a thread a core (which stays, idle, for later copies), not by threads of every
/// shard at once.
#[test]
fn preload_of_many_shards_copies_them_with_a_few_threads() {
    let dir = TempDir::new("preload-shards");
    let n = 24;
    let (shards, all) = shards(&dir, n, 8, &["gzip -c"]);
    let log = dir.join("log");
    let mnt = dir.join("mnt");
    let m = Mount::new(
        &shards,
        &mnt,
        &[
            "--preload=always",
            "--entry-spacing",
            "64K",
            "--debug",
            "--log",
            log.to_str().unwrap(),
        ],
    );
    let read_log = || std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        wait_for(120, || read_log().matches("decoded copy of").count() >= n),
        "not every shard was copied: {}",
        read_log()
    );
    let copying = stage_threads(pids_of_mount(&mnt)[0]);
    assert!(
        (1..=cores()).contains(&copying),
        "{copying} copying threads for {} cores",
        cores()
    );
    check_shards(&m.path, &all, n, 8, "copied");
}

/// Shards in one zstd frame each (`tar --zstd`): every one served from its decoded copy,
/// a few decoding at once on a pool of threads (a thread a shard, waiting its turn, was
/// 1,000 threads for 1,000 shards), a read of a shard not yet copied putting its copy
/// first.
#[test]
fn single_frame_shards_are_copied_a_few_at_a_time() {
    let dir = TempDir::new("staged-shards");
    // 30 files make a shard of ~1.3 MB: too far to read in place from its one frame.
    let n = 16;
    let (shards, all) = shards(&dir, n, 30, &["zstd -q --single-thread -c"]);
    let log = dir.join("log");
    let mnt = dir.join("mnt");
    let m = Mount::new(
        &shards,
        &mnt,
        &["--preload=never", "--debug", "--log", log.to_str().unwrap()],
    );
    // Queued for one pool of a thread a core, not a thread of each shard.
    let copying = stage_threads(pids_of_mount(&mnt)[0]);
    assert!(
        copying <= cores(),
        "{copying} copying threads for {} cores",
        cores()
    );
    // The last shard first: its copy may still be queued behind the others.
    for s in (0..n).rev() {
        let rel = format!("part{s:02}/29.txt");
        assert!(
            std::fs::read(m.path.join(&rel)).unwrap() == std::fs::read(all.join(&rel)).unwrap(),
            "{rel}"
        );
    }
    check_shards(&m.path, &all, n, 30, "staged");
    let read_log = || std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        wait_for(120, || read_log().matches("decoded copy of").count() >= n),
        "not every shard was copied: {}",
        read_log()
    );
}

/// `--recursive` shows compressed tars inside a tar as directories (named without the
/// suffix), each equal to `tar -x` of the member, from the first mount and from the
/// saved index; members that only look like one stay files.
#[test]
fn recursive_opens_compressed_tars_inside_a_tar() {
    let dir = TempDir::new("recursive-compressed");
    let src = fixture(&dir);
    let tar = pax_tar(&dir, &src);
    let outer_src = dir.join("outer");
    let shards = outer_src.join("shards");
    std::fs::create_dir_all(&shards).unwrap();
    // (member, writer): every format, in place and staged (one zstd frame).
    let members = [
        ("a.tar.gz", "gzip -c"),
        ("b.tgz", "pigz -p 2 -c"),
        ("c.tar.zst", "pzstd -q -p 2 -c"),
        ("d.tzst", "zstd -q --single-thread -c"),
        ("e.tar.xz", "xz -T2 --block-size=300KiB -c"),
        ("f.tar.bz2", "bzip2 -1 -c"),
    ];
    for (name, tool) in members {
        compress(
            &format!("{tool} < \"$IN\" > \"$OUT\""),
            &tar,
            &shards.join(name),
        );
    }
    // Named like compressed tars, but not: a gzip of text, and text.
    compress(
        "gzip -c < \"$IN\" > \"$OUT\"",
        &src.join("words.txt"),
        &shards.join("g.tar.gz"),
    );
    std::fs::write(shards.join("h.tar.xz"), b"not compressed").unwrap();
    let outer = dir.join("outer.tar");
    tar_of(&outer_src, ".", &outer);
    let ex = dir.join("x");
    extract(&tar, &ex);
    let mnt = dir.join("mnt");
    // The inner tars' `./` gives each directory its attributes, as `tar -x` into it.
    let opts = CompareOpts {
        xattrs: true,
        root_attrs: true,
        ..CompareOpts::default()
    };
    for pass in ["indexed", "saved index"] {
        let m = Mount::new(&outer, &mnt, &["--recursive", "--cache-size", "32M"]);
        for (name, _) in members {
            let stem = name.split('.').next().unwrap();
            let inner = m.path.join("shards").join(stem);
            assert!(
                !m.path.join("shards").join(name).exists(),
                "{name} ({pass})"
            );
            common::suite::check_mount(&ex, &inner, &opts, &format!("{name}, {pass}"));
        }
        for name in ["g.tar.gz", "h.tar.xz"] {
            assert!(
                std::fs::read(m.path.join("shards").join(name)).unwrap()
                    == std::fs::read(shards.join(name)).unwrap(),
                "{name} ({pass})"
            );
        }
        drop(m);
        // The inspection commands see what the mount shows.
        let info = run_ok(archfs().args(["info", "--recursive"]).arg(&outer));
        let info = String::from_utf8_lossy(&info.stdout);
        assert!(info.contains("6 compressed tars inside"), "{info}");
        let cat = archfs()
            .args(["cat", "--recursive"])
            .arg(&outer)
            .arg("shards/f/words.txt")
            .output()
            .unwrap();
        assert!(
            cat.status.success() && cat.stdout == std::fs::read(src.join("words.txt")).unwrap()
        );
    }
    // Without --recursive they are the files they are.
    let m = Mount::new(&outer, &mnt, &[]);
    assert!(
        std::fs::read(m.path.join("shards/a.tar.gz")).unwrap()
            == std::fs::read(shards.join("a.tar.gz")).unwrap()
    );
}
