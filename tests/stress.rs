//! Load: more readers than FUSE threads (threads and processes), random files and random
//! ranges, lookups, listings, stats and xattr calls mixed in, for a bounded time, with a
//! cache far smaller than the data so eviction races with the readers. Every byte is
//! checked against the source; the counts are printed for docs/RELIABILITY.md#load.

use crate::common;

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::tree::list_files;
use common::*;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

#[derive(Default)]
struct Counts {
    reads: AtomicU64,
    bytes: AtomicU64,
    meta: AtomicU64,
}

fn worker(
    src: &Path,
    mnt: &Path,
    files: &[PathBuf],
    dirs: &[PathBuf],
    seed: u64,
    until: Instant,
    c: &Counts,
) {
    let mut rng = Rng(seed | 1);
    while Instant::now() < until {
        let rel = &files[rng.below(files.len() as u64) as usize];
        let want_len = std::fs::metadata(src.join(rel)).unwrap().len();
        match rng.below(10) {
            0..=5 => {
                // A random range, like a DataLoader reading a file in pieces.
                let off = if want_len > 0 { rng.below(want_len) } else { 0 };
                let len = (rng.below(300_000) as usize).min((want_len - off) as usize);
                let mut a = vec![0u8; len];
                let mut b = vec![0u8; len];
                let mut fa = std::fs::File::open(src.join(rel)).unwrap();
                fa.seek(SeekFrom::Start(off)).unwrap();
                fa.read_exact(&mut a).unwrap();
                let mut fb = std::fs::File::open(mnt.join(rel))
                    .unwrap_or_else(|e| panic!("open {rel:?}: {e}"));
                fb.seek(SeekFrom::Start(off)).unwrap();
                fb.read_exact(&mut b)
                    .unwrap_or_else(|e| panic!("read {rel:?}@{off}+{len}: {e}"));
                assert!(a == b, "wrong bytes in {rel:?} at {off}+{len}");
                c.reads.fetch_add(1, Ordering::Relaxed);
                c.bytes.fetch_add(len as u64, Ordering::Relaxed);
            }
            6 | 7 if want_len < (64 << 20) => {
                let a = std::fs::read(src.join(rel)).unwrap();
                let b = std::fs::read(mnt.join(rel)).unwrap();
                assert!(a == b, "wrong bytes in {rel:?}");
                c.reads.fetch_add(1, Ordering::Relaxed);
                c.bytes.fetch_add(a.len() as u64, Ordering::Relaxed);
            }
            8 => {
                let d = &dirs[rng.below(dirs.len() as u64) as usize];
                let n_src = std::fs::read_dir(src.join(d)).unwrap().count();
                let n_mnt = std::fs::read_dir(mnt.join(d)).unwrap().count();
                assert_eq!(n_src, n_mnt, "listing of {d:?}");
                c.meta.fetch_add(1, Ordering::Relaxed);
            }
            _ => {
                let m = std::fs::metadata(mnt.join(rel)).unwrap();
                assert_eq!(m.len(), want_len, "size of {rel:?}");
                let _ = std::fs::metadata(mnt.join(rel).with_extension("absent"));
                let c_path =
                    std::ffi::CString::new(mnt.join(rel).into_os_string().into_encoded_bytes())
                        .unwrap();
                let mut buf = [0u8; 4096];
                // SAFETY: valid path and buffer.
                let n =
                    unsafe { libc::listxattr(c_path.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
                assert!(n >= 0, "listxattr {rel:?}");
                c.meta.fetch_add(3, Ordering::Relaxed);
            }
        }
    }
}

fn dirs_of(root: &Path) -> Vec<PathBuf> {
    let mut out = vec![PathBuf::new()];
    let mut i = 0;
    while i < out.len() {
        let d = root.join(&out[i]);
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            if e.file_type().unwrap().is_dir() {
                out.push(out[i].join(e.file_name()));
            }
        }
        i += 1;
    }
    out
}

fn stress(archive: &Path, src: &Path, mnt: &Path, what: &str) {
    let _m = Mount::new(archive, mnt, &["--cache-size", "2M", "--threads", "2"]);
    let files: Vec<PathBuf> = list_files(src);
    let dirs = dirs_of(src);
    let counts = Counts::default();
    let secs = 8;
    let until = Instant::now() + Duration::from_secs(secs);
    // Reader processes: Python, reading random whole files and comparing.
    let script = r#"
import os, random, sys, time
src, mnt, seed, secs = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
files = [l.rstrip("\n") for l in open(sys.argv[5], encoding="utf-8", errors="surrogateescape")]
r = random.Random(seed); n = 0; end = time.time() + secs
while time.time() < end:
    f = r.choice(files)
    a = open(os.path.join(src, f), "rb").read(); b = open(os.path.join(mnt, f), "rb").read()
    if a != b: print("DIFF", f); sys.exit(1)
    n += 1
print(n)
"#;
    let list = mnt.with_extension("list");
    let text: Vec<u8> = files
        .iter()
        .filter(|f| !f.as_os_str().as_encoded_bytes().contains(&b'\n'))
        .filter(|f| std::fs::metadata(src.join(f)).unwrap().len() < (64 << 20))
        .flat_map(|f| {
            let mut v = f.as_os_str().as_encoded_bytes().to_vec();
            v.push(b'\n');
            v
        })
        .collect();
    std::fs::write(&list, text).unwrap();
    let procs: Vec<_> = (0..3)
        .map(|p| {
            Command::new("python3")
                .arg("-c")
                .arg(script)
                .arg(src)
                .arg(mnt)
                .arg(p.to_string())
                .arg(secs.to_string())
                .arg(&list)
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let (files, dirs, counts) = (&files, &dirs, &counts);
            s.spawn(move || worker(src, mnt, files, dirs, 0x9e37 + t * 7919, until, counts));
        }
    });
    let mut proc_reads = 0u64;
    for p in procs {
        let out = p.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "reader process: {text}");
        proc_reads += text.trim().parse::<u64>().unwrap();
    }
    counts.reads.fetch_add(proc_reads, Ordering::Relaxed);
    eprintln!(
        "{what}: {} reads ({proc_reads} by 3 processes), {} bytes verified by the threads, {} metadata ops, 0 errors",
        counts.reads.load(Ordering::Relaxed),
        counts.bytes.load(Ordering::Relaxed),
        counts.meta.load(Ordering::Relaxed)
    );
    assert!(counts.reads.load(Ordering::Relaxed) > 100);
    // Memory stays within the cache budget plus the stated fixed overhead
    // (docs/RELIABILITY.md#memory), however much data went through.
    let hwm = server_peak_rss(mnt);
    eprintln!(
        "{what}: server peak RSS {} KiB with a 2 MiB cache",
        hwm >> 10
    );
    assert!(
        hwm < (2 << 20) + SERVER_OVERHEAD,
        "server peak RSS {hwm} bytes exceeds the 2 MiB cache plus {SERVER_OVERHEAD}"
    );
}

/// Memory a server needs besides its block cache: code, FUSE request buffers of its
/// threads, allocator slack (the tree here has a few thousand entries).
const SERVER_OVERHEAD: u64 = 48 << 20;

#[test]
fn stress_squashfs() {
    let dir = TempDir::new("stress-sqfs");
    let src = small_awkward_tree(&dir);
    let img = dir.join("img.sqfs");
    mksquashfs(&src, &img, &["-comp", "zstd", "-b", "64K"]);
    stress(&img, &src, &dir.join("mnt"), "squashfs");
}

#[test]
fn stress_tar() {
    let dir = TempDir::new("stress-tar");
    let src = small_awkward_tree(&dir);
    std::fs::remove_file(src.join("special/socket")).unwrap(); // tar cannot store sockets
    let tar = dir.join("t.tar");
    let _ = Command::new("tar")
        .args(["--format=posix", "-cf"])
        .arg(&tar)
        .arg("-C")
        .arg(&src)
        .arg(".")
        .output();
    stress(&tar, &src, &dir.join("mnt"), "tar");
}
