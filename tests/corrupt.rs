//! Corrupt images give clean errors: EIO for the read that hits a bad block (logged
//! once) while everything else keeps working, and no panic or hang for damaged tables.

use crate::common;

use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use archfs::archive::check::{check, FUZZ_LIMITS};
use archfs::cache::CacheConfig;
use archfs::open;
use common::*;

/// Text that compresses well, so gzip blocks are really compressed (and checksummed).
fn text(n: usize, tag: &str) -> Vec<u8> {
    let mut v = Vec::with_capacity(n);
    let mut i = 0u64;
    while v.len() < n {
        v.extend_from_slice(format!("{tag} line {i} {}\n", i * 7919 % 10007).as_bytes());
        i += 1;
    }
    v.truncate(n);
    v
}

fn image(dir: &TempDir) -> (std::path::PathBuf, Vec<u8>) {
    let src = dir.join("src");
    std::fs::create_dir_all(src.join("d")).unwrap();
    // mksquashfs writes data blocks first, in directory order: a.bin's first block
    // starts right after the 96-byte superblock.
    std::fs::write(src.join("a.bin"), text(400_000, "a")).unwrap();
    std::fs::write(src.join("d/small.txt"), text(5000, "s")).unwrap();
    std::fs::write(src.join("z.bin"), text(300_000, "z")).unwrap();
    let img = dir.join("img.sqfs");
    mksquashfs(&src, &img, &[]);
    let bytes = std::fs::read(&img).unwrap();
    (img, bytes)
}

#[test]
fn a_corrupt_data_block_fails_only_its_reads() {
    let dir = TempDir::new("corrupt-block");
    let (img, mut bytes) = image(&dir);
    for b in &mut bytes[200..260] {
        *b ^= 0x5a;
    }
    let bad = dir.join("bad.sqfs");
    std::fs::write(&bad, &bytes).unwrap();
    let mnt = dir.join("mnt");
    let log = dir.join("server.log");
    let m = Mount::new(&bad, &mnt, &["--log", log.to_str().unwrap()]);
    let src = dir.join("src");
    for _ in 0..3 {
        let err = std::fs::read(m.path.join("a.bin")).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    }
    // Later blocks of the same file, other files and the tree still work.
    let mut f = std::fs::File::open(m.path.join("a.bin")).unwrap();
    f.seek(SeekFrom::Start(131072 * 2)).unwrap();
    let mut rest = Vec::new();
    f.read_to_end(&mut rest).unwrap();
    assert_eq!(
        rest,
        std::fs::read(src.join("a.bin")).unwrap()[131072 * 2..]
    );
    assert_eq!(
        std::fs::read(m.path.join("z.bin")).unwrap(),
        std::fs::read(src.join("z.bin")).unwrap()
    );
    assert_eq!(
        std::fs::read(m.path.join("d/small.txt")).unwrap(),
        std::fs::read(src.join("d/small.txt")).unwrap()
    );
    drop(m);
    let log = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<_> = log
        .lines()
        .filter(|l| l.contains("data block at"))
        .collect();
    assert_eq!(lines.len(), 1, "one log line for the bad block:\n{log}");
    drop(img);
}

#[test]
fn flipped_bytes_anywhere_never_panic_or_hang() {
    let dir = TempDir::new("corrupt-any");
    let src = dir.join("src");
    std::fs::create_dir(&src).unwrap();
    common::tree::make_awkward_tree(
        &src,
        &common::tree::TreeSpec {
            big_dir_entries: 600,
            sparse_4g: false,
            ..Default::default()
        },
    )
    .unwrap();
    let img = dir.join("img.sqfs");
    mksquashfs(&src, &img, &["-b", "4K", "-comp", "zstd"]);
    let good = std::fs::read(&img).unwrap();
    let sb_end = 96;
    // Corrupt the tables at the end of the image (inodes, directories, fragments, ids,
    // xattrs) more often than data: that is where a reader can be led astray.
    let tables_start = u64::from_le_bytes(good[64..72].try_into().unwrap()) as usize;
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let bad = dir.join("bad.sqfs");
    let mut opened = 0;
    for round in 0..300 {
        let mut bytes = good.clone();
        let span = if round % 4 == 0 {
            sb_end..good.len()
        } else {
            tables_start..good.len()
        };
        for _ in 0..1 + next() % 8 {
            let at = span.start + (next() as usize % (span.end - span.start));
            bytes[at] = next() as u8;
        }
        if round % 10 == 0 {
            bytes.truncate(bytes.len() - (next() as usize % 4096));
        }
        std::fs::write(&bad, &bytes).unwrap();
        if let Ok(a) = open::open(
            &bad,
            &CacheConfig {
                total_bytes: 1 << 20,
            },
        ) {
            opened += 1;
            check(&*a, FUZZ_LIMITS);
        }
    }
    assert!(
        opened > 100,
        "most corruptions leave the superblock intact ({opened})"
    );
}

#[test]
fn a_mount_with_damaged_metadata_keeps_serving_and_unmounts() {
    let dir = TempDir::new("corrupt-meta");
    let (_, mut bytes) = image(&dir);
    let dir_table = u64::from_le_bytes(bytes[72..80].try_into().unwrap()) as usize;
    for b in &mut bytes[dir_table + 4..dir_table + 40] {
        *b = !*b;
    }
    let bad = dir.join("bad.sqfs");
    std::fs::write(&bad, &bytes).unwrap();
    let mnt = dir.join("mnt");
    let m = Mount::new(&bad, &mnt, &[]);
    let listing = std::fs::read_dir(&m.path);
    if let Ok(entries) = listing {
        for e in entries.flatten() {
            let _ = std::fs::read(e.path());
        }
    }
    // The server is still alive and answers.
    assert!(std::fs::metadata(&m.path).unwrap().is_dir());
    let path: &Path = &m.path;
    assert!(is_mounted(path));
}
