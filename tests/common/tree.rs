//! Test-support: build a deterministic "awkward" directory tree and compare trees.
//!
//! [`make_awkward_tree`] creates edge cases that a SquashFS image can represent
//! exactly (odd names, sizes around 4 KiB/128 KiB boundaries, a >4 GiB sparse
//! file, special files, hard links, xattrs, extreme whole-second mtimes). An
//! image built from it with `mksquashfs` and mounted by archfs must therefore
//! compare equal to the source with [`compare_trees`].

// Each integration-test binary uses only part of this module.
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ffi::{CString, OsStr, OsString};
use std::fs::{self, File};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{lchown, symlink, FileExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const GIB: u64 = 1 << 30;

/// What [`make_awkward_tree`] creates beyond the always-present cases.
#[derive(Debug, Clone)]
pub struct TreeSpec {
    /// Number of small files in `bigdir/` (exercises directory indexes).
    pub big_dir_entries: usize,
    /// Create `sparse/big_4g`, a sparse file of 4 GiB + 12345 bytes.
    pub sparse_4g: bool,
    /// Create char/block devices; silently skipped without `CAP_MKNOD`.
    pub devices: bool,
    /// Set `user.*` xattrs; silently skipped if the filesystem lacks support.
    pub xattrs: bool,
}

impl Default for TreeSpec {
    fn default() -> Self {
        Self {
            big_dir_entries: 20_000,
            sparse_4g: true,
            devices: true,
            xattrs: true,
        }
    }
}

/// What [`compare_trees`] checks. Everything except `root_attrs` is on by default.
#[derive(Debug, Clone)]
pub struct CompareOpts {
    /// Compare `user.*` xattrs (names and values).
    pub xattrs: bool,
    /// Compare directory link counts (`2 + subdirectories` on most filesystems).
    pub dir_nlink: bool,
    /// Compare uid/gid.
    pub owners: bool,
    /// Compare regular-file contents.
    pub content: bool,
    /// Compare directories' mtimes (GNU tar sets one when the archive leaves the
    /// directory: where members come out of tree order, it is the extraction's time).
    pub dir_mtime: bool,
    /// Compare mtime/mode/owner of the top directory itself; a mount point's
    /// root often takes these from elsewhere (e.g. mount options).
    pub root_attrs: bool,
}

impl Default for CompareOpts {
    fn default() -> Self {
        Self {
            xattrs: true,
            dir_nlink: true,
            owners: true,
            content: true,
            dir_mtime: true,
            root_attrs: false,
        }
    }
}

/// Builds the awkward tree inside `root`, which must be an existing empty directory.
///
/// Content is deterministic (seeded PRNG), and every entry gets a whole-second
/// mtime, so two trees built from the same spec compare equal. Ownership changes
/// happen only when running as root; mode 0500/0000 entries make the tree hard
/// to delete as non-root, so use [`remove_tree`] for cleanup.
pub fn make_awkward_tree(root: &Path, spec: &TreeSpec) -> io::Result<()> {
    if fs::read_dir(root)?.next().is_some() {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!("{} is not empty", root.display()),
        ));
    }
    let mut g = Gen {
        root,
        rng: Rng(0x9E37_79B9_7F4A_7C15),
        is_root: unsafe { libc::geteuid() } == 0,
        xattrs: spec.xattrs,
        owners: Vec::new(),
        modes: Vec::new(),
        mtimes: HashMap::new(),
    };
    g.names()?;
    g.deep_paths()?;
    g.files()?;
    if spec.sparse_4g {
        g.sparse()?;
    }
    g.empties()?;
    g.bigdir(spec.big_dir_entries)?;
    g.imagenet()?;
    g.symlinks()?;
    g.hardlinks()?;
    g.specials(spec.devices)?;
    g.modes()?;
    g.owners()?;
    g.xattr_cases()?;
    g.times()?;
    g.finish()
}

/// All regular files under `root` as relative paths, sorted (symlinks are not followed).
///
/// Panics on I/O errors: this is test support and a partial list would hide bugs.
pub fn list_files(root: &Path) -> Vec<PathBuf> {
    fn walk(root: &Path, rel: &Path, out: &mut Vec<PathBuf>) {
        let dir = root.join(rel);
        let entries =
            fs::read_dir(&dir).unwrap_or_else(|e| panic!("read_dir {}: {e}", dir.display()));
        for entry in entries {
            let entry = entry.unwrap_or_else(|e| panic!("read_dir {}: {e}", dir.display()));
            let child = rel.join(entry.file_name());
            let ft = entry
                .file_type()
                .unwrap_or_else(|e| panic!("file_type {}: {e}", child.display()));
            if ft.is_dir() {
                walk(root, &child, out);
            } else if ft.is_file() {
                out.push(child);
            }
        }
    }
    let mut out = Vec::new();
    walk(root, Path::new(""), &mut out);
    out.sort();
    out
}

/// Removes a tree made by [`make_awkward_tree`], first making every directory
/// writable so that this also works without root (mode 0500 directories).
pub fn remove_tree(root: &Path) -> io::Result<()> {
    fn unlock(path: &Path) -> io::Result<()> {
        let meta = fs::symlink_metadata(path)?;
        if meta.is_dir() {
            if meta.mode() & 0o700 != 0o700 {
                fs::set_permissions(path, fs::Permissions::from_mode(meta.mode() | 0o700))?;
            }
            for entry in fs::read_dir(path)? {
                let entry = entry?;
                if entry.file_type()?.is_dir() {
                    unlock(&entry.path())?;
                }
            }
        }
        Ok(())
    }
    unlock(root)?;
    fs::remove_dir_all(root)
}

/// Compares two trees without following symlinks and returns human-readable
/// differences (empty = equal), capped at 200 entries.
///
/// Checked per entry: names (raw bytes), file type, `mode & 0o7777`, uid/gid,
/// size (files, symlinks), mtime seconds, symlink target, rdev, nlink, `user.*`
/// xattrs and file content. Hard links are checked by grouping non-directory
/// paths by `(dev, ino)` on each side: the partitions must be identical.
/// Holes in `expected` (found with `SEEK_HOLE`) are only spot-checked on the
/// `actual` side (first and last 64 KiB of each hole) to keep 4 GiB sparse
/// files fast.
pub fn compare_trees(expected: &Path, actual: &Path, opts: &CompareOpts) -> Vec<String> {
    let mut c = Comparer {
        exp_root: expected,
        act_root: actual,
        opts,
        diffs: Diffs::default(),
        exp_links: HashMap::new(),
        act_links: HashMap::new(),
        exp_buf: vec![0; MIB],
        act_buf: vec![0; MIB],
    };
    c.entry(Path::new(""));
    c.links();
    c.diffs.finish()
}

// ---------------------------------------------------------------------------
// Generator
// ---------------------------------------------------------------------------

/// xorshift64*: tiny, seedable, and plenty for test data.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn bytes(&mut self, len: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(len + 8);
        while v.len() < len {
            v.extend_from_slice(&self.next_u64().to_le_bytes());
        }
        v.truncate(len);
        v
    }
}

/// Mode changes, ownership and mtimes are queued and applied in [`Gen::finish`],
/// because chown clears setuid/setgid, a 0500 directory cannot be filled, and
/// creating children bumps the parent's mtime.
struct Gen<'a> {
    root: &'a Path,
    rng: Rng,
    is_root: bool,
    xattrs: bool,
    owners: Vec<(PathBuf, u32, u32)>,
    modes: Vec<(PathBuf, u32)>,
    mtimes: HashMap<PathBuf, i64>,
}

impl Gen<'_> {
    fn abs(&self, rel: impl AsRef<Path>) -> PathBuf {
        self.root.join(rel)
    }

    fn dir(&self, rel: impl AsRef<Path>) -> io::Result<()> {
        fs::create_dir_all(self.abs(rel))
    }

    fn file(&self, rel: impl AsRef<Path>, data: &[u8]) -> io::Result<()> {
        let path = self.abs(rel);
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent)?;
        }
        fs::write(path, data)
    }

    fn rand_file(&mut self, rel: impl AsRef<Path>, len: usize) -> io::Result<()> {
        let data = self.rng.bytes(len);
        self.file(rel, &data)
    }

    fn symlink(&self, target: impl AsRef<Path>, rel: impl AsRef<Path>) -> io::Result<()> {
        symlink(target, self.abs(rel))
    }

    fn link(&self, existing: impl AsRef<Path>, new: impl AsRef<Path>) -> io::Result<()> {
        fs::hard_link(self.abs(existing), self.abs(new))
    }

    fn mknod(&self, rel: impl AsRef<Path>, mode: libc::mode_t, dev: libc::dev_t) -> io::Result<()> {
        let path = cpath(&self.abs(rel))?;
        // SAFETY: `path` is a valid NUL-terminated string.
        if unsafe { libc::mknod(path.as_ptr(), mode, dev) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    fn chmod(&mut self, rel: impl AsRef<Path>, mode: u32) {
        self.modes.push((rel.as_ref().to_path_buf(), mode));
    }

    fn chown(&mut self, rel: impl AsRef<Path>, uid: u32, gid: u32) {
        self.owners.push((rel.as_ref().to_path_buf(), uid, gid));
    }

    fn mtime(&mut self, rel: impl AsRef<Path>, secs: i64) {
        self.mtimes.insert(rel.as_ref().to_path_buf(), secs);
    }

    /// Sets a `user.*` xattr; disables all further xattrs if unsupported.
    fn xattr(&mut self, rel: impl AsRef<Path>, name: &str, value: &[u8]) -> io::Result<()> {
        if !self.xattrs {
            return Ok(());
        }
        let path = cpath(&self.abs(rel))?;
        let name = CString::new(name).expect("xattr name without NUL");
        // SAFETY: valid C strings; `value` is valid for `value.len()` bytes.
        let rc = unsafe {
            libc::lsetxattr(
                path.as_ptr(),
                name.as_ptr(),
                value.as_ptr().cast(),
                value.len(),
                0,
            )
        };
        if rc != 0 {
            let err = io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::ENOTSUP) {
                self.xattrs = false;
                return Ok(());
            }
            return Err(err);
        }
        Ok(())
    }

    /// Unicode, whitespace, control characters, 255-byte names, case twins, non-UTF-8.
    fn names(&mut self) -> io::Result<()> {
        let mut names: Vec<Vec<u8>> = [
            "日本語",
            "émoji_😀",
            "cafe\u{301}", // NFD: combining acute accent
            "caf\u{e9}",   // NFC twin, different bytes
            "zero\u{200b}width",
            "עברית",
            "with space",
            " leading space",
            "trailing space ",
            "new\nline",
            "tab\tname",
            "-rf",
            "--",
            "-",
            ".hidden",
            "..dotdot",
            "...",
            "Case",
            "case",
            "CASE",
            "back\\slash",
            "glob*?[x]",
            "$HOME",
            "quote\"'`",
            "colon:semi;",
            "percent%41",
        ]
        .iter()
        .map(|s| s.as_bytes().to_vec())
        .collect();
        names.push(b"latin1_\xe9\xff\xfe".to_vec());
        names.push(vec![b'x'; 255]);
        names.push("日".repeat(85).into_bytes());
        for name in &names {
            self.file(Path::new("names").join(OsStr::from_bytes(name)), name)?;
        }
        self.file("names/dir with space/child", b"child\n")?;
        self.file("names/日本語_dir/émoji_😀_child", b"child\n")?;
        Ok(())
    }

    /// 40 levels deep, and relative paths longer than 1024 bytes.
    fn deep_paths(&mut self) -> io::Result<()> {
        let mut deep = PathBuf::from("deep");
        for level in 0..40 {
            deep.push(format!("level_{level:02}_{}", "d".repeat(21)));
        }
        self.file(deep.join("leaf.txt"), b"bottom\n")?;
        let mut long = PathBuf::from("longpath");
        for i in 0..4 {
            long.push(format!("{i}{}", "L".repeat(249)));
        }
        self.file(long.join("f".repeat(255)), b"long\n")
    }

    /// Sizes around 4 KiB and 128 KiB boundaries; random and compressible data.
    fn files(&mut self) -> io::Result<()> {
        let sizes = [
            0,
            1,
            4095,
            4096,
            4097,
            65535,
            65536,
            131_071,
            131_072,
            131_073,
            262_143,
            262_144,
            262_145,
            MIB + 17,
            3 * MIB,
        ];
        for size in sizes {
            self.rand_file(format!("files/rand_{size}"), size)?;
        }
        // All-zero blocks become sparse blocks in SquashFS.
        for size in [4096, 131_072, MIB + 5] {
            self.file(format!("files/zeros_{size}"), &vec![0; size])?;
        }
        self.file("files/ff_200000", &vec![0xff; 200_000])?;
        let mut text = Vec::new();
        let mut line = 0;
        while text.len() < 500_000 {
            text.extend_from_slice(format!("The quick brown fox jumps {line}\n").as_bytes());
            line += 1;
        }
        text.truncate(500_000);
        self.file("files/text_500000", &text)?;
        // Alternating random and zero 128 KiB blocks, then a short random tail.
        let mut mixed = Vec::new();
        for i in 0..4 {
            if i % 2 == 0 {
                mixed.extend(self.rng.bytes(128 * KIB));
            } else {
                mixed.resize(mixed.len() + 128 * KIB, 0);
            }
        }
        mixed.extend(self.rng.bytes(1000));
        self.file("files/mixed_blocks", &mixed)?;
        // A full block followed by an all-zero tail (fragment).
        let mut zero_tail = self.rng.bytes(128 * KIB);
        zero_tail.resize(zero_tail.len() + 700, 0);
        self.file("files/zero_tail", &zero_tail)?;
        // Identical files: mksquashfs deduplicates blocks and fragments.
        let dup = self.rng.bytes(300 * KIB);
        self.file("files/dup_a", &dup)?;
        self.file("files/dup_b", &dup)?;
        let dup_small = self.rng.bytes(100);
        self.file("files/dup_small_a", &dup_small)?;
        self.file("files/dup_small_b", &dup_small)
    }

    /// A file > 4 GiB (64-bit sizes/offsets) with data straddling the 4 GiB mark.
    fn sparse(&mut self) -> io::Result<()> {
        self.dir("sparse")?;
        let len = 4 * GIB + 12345;
        let f = File::create(self.abs("sparse/big_4g"))?;
        f.set_len(len)?;
        f.write_all_at(b"START", 0)?;
        f.write_all_at(b"MIB", MIB as u64)?;
        f.write_all_at(b"ACROSS", 4 * GIB - 3)?;
        f.write_all_at(b"E", len - 1)?;
        let f = File::create(self.abs("sparse/holey_1m"))?;
        f.set_len(MIB as u64 + 100)?;
        f.write_all_at(b"x", 500_000)
    }

    fn empties(&mut self) -> io::Result<()> {
        self.file("empty/file", b"")?;
        self.dir("empty/dir")?;
        self.dir("empty/nested/deeper/dir")
    }

    fn bigdir(&mut self, entries: usize) -> io::Result<()> {
        self.dir("bigdir")?;
        for i in 0..entries {
            let len = self.rng.below(600) as usize;
            self.rand_file(format!("bigdir/f{i:06}.jpg"), len)?;
        }
        Ok(())
    }

    /// 5 classes × 30 JPEG-like files with log-normal-ish sizes of 1–200 KiB.
    fn imagenet(&mut self) -> io::Result<()> {
        for wnid in [
            "n01440764",
            "n01443537",
            "n01484850",
            "n01491361",
            "n01494475",
        ] {
            for i in 0..30u64 {
                // Irwin–Hall approximation of N(0, 1); median ~40 KiB.
                let z = (0..12).map(|_| self.rng.unit()).sum::<f64>() - 6.0;
                let len =
                    (40.0 * KIB as f64 * (0.8 * z).exp()).clamp(KIB as f64, 200.0 * KIB as f64);
                let mut data = self.rng.bytes(len as usize);
                data[..4].copy_from_slice(b"\xff\xd8\xff\xe0");
                let n = data.len();
                data[n - 2..].copy_from_slice(b"\xff\xd9");
                let id = 1000 + i * 37 + self.rng.below(37);
                self.file(format!("imagenet/{wnid}/{wnid}_{id}.JPEG"), &data)?;
            }
        }
        Ok(())
    }

    fn symlinks(&mut self) -> io::Result<()> {
        self.dir("links")?;
        self.symlink("../files/rand_1", "links/relative")?;
        self.symlink("../x", "links/dangling_up")?;
        self.symlink("/etc/passwd", "links/absolute")?;
        self.symlink("does/not/exist", "links/dangling")?;
        self.symlink("../files", "links/to_dir")?;
        self.symlink(".", "links/dot")?;
        self.symlink("self_loop", "links/self_loop")?;
        // 4000 bytes, below PATH_MAX, 100-byte components.
        self.symlink(
            format!("{}/", "a".repeat(99)).repeat(40),
            "links/long_target",
        )?;
        self.symlink("../names/日本語", "links/unicode_target")?;
        self.symlink(
            OsStr::from_bytes(b"\xff\xfe/not utf8"),
            "links/non_utf8_target",
        )?;
        self.symlink("a b\nc", "links/newline_target")
    }

    fn hardlinks(&mut self) -> io::Result<()> {
        self.rand_file("hardlinks/a/three", 5000)?;
        self.dir("hardlinks/b")?;
        self.link("hardlinks/a/three", "hardlinks/b/three_2")?;
        self.link("hardlinks/a/three", "hardlinks/three_3")?;
        self.rand_file("hardlinks/pair_1", 200 * KIB)?;
        self.link("hardlinks/pair_1", "hardlinks/pair_2")?;
        self.file("hardlinks/empty_1", b"")?;
        self.link("hardlinks/empty_1", "hardlinks/empty_2")?;
        // No hard-linked symlink: mksquashfs (4.5.1) stores each name as its own inode.
        self.mknod("hardlinks/fifo_1", libc::S_IFIFO | 0o644, 0)?;
        self.link("hardlinks/fifo_1", "hardlinks/fifo_2")
    }

    /// FIFO and socket always; devices only with `CAP_MKNOD`.
    fn specials(&mut self, devices: bool) -> io::Result<()> {
        self.dir("special")?;
        self.mknod("special/fifo", libc::S_IFIFO | 0o644, 0)?;
        // Unlike bind(2), mknod has no sun_path length limit, and needs no privilege.
        self.mknod("special/socket", libc::S_IFSOCK | 0o755, 0)?;
        if !devices {
            return Ok(());
        }
        let devs = [
            ("special/char_1_3", libc::S_IFCHR, 1, 3),
            ("special/block_7_200", libc::S_IFBLK, 7, 200),
            // minor > 255 and major > 255 need the "new" dev_t encoding.
            ("special/block_7_300", libc::S_IFBLK, 7, 300),
            ("special/char_259_70000", libc::S_IFCHR, 259, 70000),
        ];
        for (rel, kind, major, minor) in devs {
            match self.mknod(rel, kind | 0o640, libc::makedev(major, minor)) {
                Err(e) if e.raw_os_error() == Some(libc::EPERM) => return Ok(()),
                r => r?,
            }
        }
        Ok(())
    }

    fn modes(&mut self) -> io::Result<()> {
        let files = [
            ("modes/m0000", 0o000), // empty, so it can be compared without root
            ("modes/m0444", 0o444),
            ("modes/m0600", 0o600),
            ("modes/m0777", 0o777),
            ("modes/setuid", 0o4755),
            ("modes/setgid", 0o2755),
            ("modes/all_bits", 0o7777),
        ];
        for (rel, mode) in files {
            let data: &[u8] = if mode == 0 { b"" } else { b"#!/bin/sh\n" };
            self.file(rel, data)?;
            self.chmod(rel, mode);
        }
        self.file("modes/sticky_dir/inside", b"sticky\n")?;
        self.chmod("modes/sticky_dir", 0o1777);
        self.dir("modes/setgid_dir")?;
        self.chmod("modes/setgid_dir", 0o2775);
        self.file("modes/ro_dir/a", b"a\n")?;
        self.file("modes/ro_dir/sub/b", b"b\n")?;
        self.chmod("modes/ro_dir", 0o500);
        Ok(())
    }

    /// The entries always exist; only their ownership depends on being root.
    fn owners(&mut self) -> io::Result<()> {
        self.file("owners/u1234_g5678", b"1234\n")?;
        self.file("owners/nobody", b"65534\n")?;
        self.file("owners/u100000", b"100000\n")?;
        self.file("owners/u_max", b"4294967294\n")?;
        self.file("owners/root_g1234", b"0:1234\n")?;
        self.file("owners/dir_1234/inside", b"\n")?;
        self.symlink("u1234_g5678", "owners/link_1234")?;
        if self.is_root {
            self.chown("owners/u1234_g5678", 1234, 5678);
            self.chown("owners/nobody", 65534, 65534);
            self.chown("owners/u100000", 100_000, 100_000);
            // (uid_t)-1 means "unchanged", so -2 is the largest usable id.
            self.chown("owners/u_max", u32::MAX - 1, u32::MAX - 1);
            self.chown("owners/root_g1234", 0, 1234);
            self.chown("owners/dir_1234", 1234, 5678);
            self.chown("owners/link_1234", 1234, 5678);
            self.chown("modes/setuid", 1234, 5678);
        }
        Ok(())
    }

    /// user.* xattrs are only allowed on regular files and directories.
    fn xattr_cases(&mut self) -> io::Result<()> {
        self.file("xattrs/comment", b"c\n")?;
        self.xattr("xattrs/comment", "user.comment", b"hello world")?;
        self.file("xattrs/many", b"m\n")?;
        for i in 0..8 {
            self.xattr(
                "xattrs/many",
                &format!("user.key{i}"),
                format!("value {i}").as_bytes(),
            )?;
        }
        self.file("xattrs/empty_value", b"e\n")?;
        self.xattr("xattrs/empty_value", "user.empty", b"")?;
        self.file("xattrs/binary", b"b\n")?;
        let binary: Vec<u8> = (0..=255).collect();
        self.xattr("xattrs/binary", "user.binary", &binary)?;
        // A large value, twice: mksquashfs may store such values out of line and shared.
        let big = self.rng.bytes(3000);
        for rel in ["xattrs/big_value", "xattrs/big_value_dup"] {
            self.file(rel, b"big\n")?;
            self.xattr(rel, "user.big", &big)?;
        }
        self.file("xattrs/long_name", b"l\n")?;
        self.xattr(
            "xattrs/long_name",
            &format!("user.{}", "n".repeat(250)),
            b"255-byte name",
        )?;
        self.file("xattrs/dir/inside", b"\n")?;
        self.xattr("xattrs/dir", "user.dir", b"on a directory")?;
        self.xattr("xattrs/dir", "user.second", b"2")?;
        // Shared by all names of the inode.
        self.xattr("hardlinks/pair_1", "user.linked", b"yes")
    }

    /// SquashFS stores mtimes as u32 seconds: 1970..2106.
    fn times(&mut self) -> io::Result<()> {
        let cases = [
            ("times/epoch_plus_1", 1),
            ("times/y1985", 473_385_600),
            ("times/past_i32_max", 1 << 31),
            ("times/y2099", 4_102_444_799),
            ("times/u32_max", i64::from(u32::MAX)),
        ];
        for (rel, secs) in cases {
            self.file(rel, rel.as_bytes())?;
            self.mtime(rel, secs);
        }
        self.file("times/old_dir/inside", b"\n")?;
        self.mtime("times/old_dir", 1);
        self.symlink("y2099", "times/future_link")?;
        self.mtime("times/future_link", 4_102_444_799);
        self.mtime("empty/dir", 473_385_600);
        Ok(())
    }

    /// Owners, then modes (chown clears setuid), then mtimes bottom-up.
    fn finish(&mut self) -> io::Result<()> {
        for (rel, uid, gid) in &self.owners {
            lchown(self.abs(rel), Some(*uid), Some(*gid))?;
        }
        for (rel, mode) in &self.modes {
            fs::set_permissions(self.abs(rel), fs::Permissions::from_mode(*mode))?;
        }
        self.set_mtimes(Path::new(""))
    }

    /// Post-order, so a directory's mtime is set after all changes inside it.
    fn set_mtimes(&self, rel: &Path) -> io::Result<()> {
        let path = self.abs(rel);
        let meta = fs::symlink_metadata(&path)?;
        if meta.is_dir() {
            let mut names: Vec<OsString> = fs::read_dir(&path)?
                .map(|e| e.map(|e| e.file_name()))
                .collect::<io::Result<_>>()?;
            names.sort();
            for name in names {
                self.set_mtimes(&rel.join(name))?;
            }
        }
        let secs = self
            .mtimes
            .get(rel)
            .copied()
            .unwrap_or_else(|| default_mtime(rel));
        set_mtime_nofollow(&path, secs)
    }
}

/// A per-path whole-second mtime in 2001..2023, so entries differ from each other.
fn default_mtime(rel: &Path) -> i64 {
    let hash = rel
        .as_os_str()
        .as_bytes()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
    1_000_000_000 + (hash % 700_000_000) as i64
}

/// Sets atime and mtime to `secs` with zero nanoseconds, not following symlinks.
fn set_mtime_nofollow(path: &Path, secs: i64) -> io::Result<()> {
    let c = cpath(path)?;
    let ts = libc::timespec {
        tv_sec: secs as libc::time_t,
        tv_nsec: 0,
    };
    let times = [ts, ts];
    // SAFETY: valid C string and a two-element timespec array.
    let rc = unsafe {
        libc::utimensat(
            libc::AT_FDCWD,
            c.as_ptr(),
            times.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn cpath(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
}

// ---------------------------------------------------------------------------
// Comparator
// ---------------------------------------------------------------------------

const MAX_DIFFS: usize = 200;
const HOLE_SAMPLE: u64 = 64 * KIB as u64;

#[derive(Default)]
struct Diffs {
    list: Vec<String>,
    dropped: usize,
}

impl Diffs {
    fn push(&mut self, msg: String) {
        if self.list.len() < MAX_DIFFS {
            self.list.push(msg);
        } else {
            self.dropped += 1;
        }
    }

    fn full(&self) -> bool {
        self.list.len() >= MAX_DIFFS
    }

    fn finish(mut self) -> Vec<String> {
        if self.dropped > 0 {
            self.list.truncate(MAX_DIFFS - 1);
            self.list
                .push(format!("... and {} more differences", self.dropped + 1));
        }
        self.list
    }
}

struct Comparer<'a> {
    exp_root: &'a Path,
    act_root: &'a Path,
    opts: &'a CompareOpts,
    diffs: Diffs,
    exp_links: HashMap<(u64, u64), Vec<PathBuf>>,
    act_links: HashMap<(u64, u64), Vec<PathBuf>>,
    exp_buf: Vec<u8>,
    act_buf: Vec<u8>,
}

/// Debug formatting escapes newlines and invalid UTF-8 in names.
fn show(rel: &Path) -> String {
    if rel.as_os_str().is_empty() {
        "<root>".to_owned()
    } else {
        format!("{rel:?}")
    }
}

fn type_name(mode: u32) -> &'static str {
    match mode & libc::S_IFMT {
        libc::S_IFREG => "file",
        libc::S_IFDIR => "directory",
        libc::S_IFLNK => "symlink",
        libc::S_IFIFO => "fifo",
        libc::S_IFSOCK => "socket",
        libc::S_IFCHR => "char device",
        libc::S_IFBLK => "block device",
        _ => "unknown",
    }
}

fn dev_name(rdev: u64) -> String {
    format!("{}:{}", libc::major(rdev), libc::minor(rdev))
}

impl Comparer<'_> {
    fn diff(&mut self, rel: &Path, what: impl std::fmt::Display) {
        self.diffs.push(format!("{}: {what}", show(rel)));
    }

    fn entry(&mut self, rel: &Path) {
        let exp_path = self.exp_root.join(rel);
        let act_path = self.act_root.join(rel);
        let (e, a) = match (
            fs::symlink_metadata(&exp_path),
            fs::symlink_metadata(&act_path),
        ) {
            (Ok(e), Ok(a)) => (e, a),
            (Err(err), _) => return self.diff(rel, format!("expected side: lstat: {err}")),
            (_, Err(err)) => return self.diff(rel, format!("actual side: lstat: {err}")),
        };
        let (ftype, atype) = (e.mode() & libc::S_IFMT, a.mode() & libc::S_IFMT);
        if ftype != atype {
            return self.diff(
                rel,
                format!("type {} != {}", type_name(e.mode()), type_name(a.mode())),
            );
        }
        let is_dir = ftype == libc::S_IFDIR;
        let top_attrs = !rel.as_os_str().is_empty() || self.opts.root_attrs;

        if top_attrs && e.mode() & 0o7777 != a.mode() & 0o7777 {
            let (em, am) = (e.mode() & 0o7777, a.mode() & 0o7777);
            self.diff(rel, format!("mode {em:04o} != {am:04o}"));
        }
        if top_attrs && self.opts.owners && (e.uid(), e.gid()) != (a.uid(), a.gid()) {
            let msg = format!("uid:gid {}:{} != {}:{}", e.uid(), e.gid(), a.uid(), a.gid());
            self.diff(rel, msg);
        }
        if top_attrs && (!is_dir || self.opts.dir_mtime) && e.mtime() != a.mtime() {
            self.diff(rel, format!("mtime {} != {}", e.mtime(), a.mtime()));
        }
        if (!is_dir || self.opts.dir_nlink) && e.nlink() != a.nlink() {
            self.diff(rel, format!("nlink {} != {}", e.nlink(), a.nlink()));
        }
        if matches!(ftype, libc::S_IFREG | libc::S_IFLNK) && e.size() != a.size() {
            self.diff(rel, format!("size {} != {}", e.size(), a.size()));
        }
        if matches!(ftype, libc::S_IFCHR | libc::S_IFBLK) && e.rdev() != a.rdev() {
            let msg = format!("rdev {} != {}", dev_name(e.rdev()), dev_name(a.rdev()));
            self.diff(rel, msg);
        }
        if ftype == libc::S_IFLNK {
            self.symlink_target(rel, &exp_path, &act_path);
        }
        if self.opts.xattrs {
            self.xattrs(rel, &exp_path, &act_path);
        }
        if !is_dir {
            let rel = rel.to_path_buf();
            self.exp_links
                .entry((e.dev(), e.ino()))
                .or_default()
                .push(rel.clone());
            self.act_links
                .entry((a.dev(), a.ino()))
                .or_default()
                .push(rel);
        }
        if ftype == libc::S_IFREG
            && self.opts.content
            && e.size() == a.size()
            && e.size() > 0
            && !self.diffs.full()
        {
            if let Err(err) = self.content(rel, &exp_path, &act_path, e.size()) {
                self.diff(rel, format!("reading content: {err}"));
            }
        }
        if is_dir {
            self.children(rel, &exp_path, &act_path);
        }
    }

    fn symlink_target(&mut self, rel: &Path, exp_path: &Path, act_path: &Path) {
        match (fs::read_link(exp_path), fs::read_link(act_path)) {
            (Ok(e), Ok(a)) if e != a => self.diff(rel, format!("symlink target {e:?} != {a:?}")),
            (Ok(_), Ok(_)) => {}
            (Err(err), _) => self.diff(rel, format!("expected side: readlink: {err}")),
            (_, Err(err)) => self.diff(rel, format!("actual side: readlink: {err}")),
        }
    }

    fn xattrs(&mut self, rel: &Path, exp_path: &Path, act_path: &Path) {
        let (e, a) = match (user_xattrs(exp_path), user_xattrs(act_path)) {
            (Ok(e), Ok(a)) => (e, a),
            (Err(err), _) => return self.diff(rel, format!("expected side: xattrs: {err}")),
            (_, Err(err)) => return self.diff(rel, format!("actual side: xattrs: {err}")),
        };
        for (name, value) in &e {
            let name_s = String::from_utf8_lossy(name);
            match a.get(name) {
                None => self.diff(rel, format!("xattr {name_s} missing in actual")),
                Some(other) if other != value => self.diff(
                    rel,
                    format!(
                        "xattr {name_s} value {} != {}",
                        abbrev(value),
                        abbrev(other)
                    ),
                ),
                Some(_) => {}
            }
        }
        for name in a.keys().filter(|n| !e.contains_key(*n)) {
            let name_s = String::from_utf8_lossy(name);
            self.diff(rel, format!("xattr {name_s} only in actual"));
        }
    }

    fn children(&mut self, rel: &Path, exp_path: &Path, act_path: &Path) {
        let (e, a) = match (dir_names(exp_path), dir_names(act_path)) {
            (Ok(e), Ok(a)) => (e, a),
            (Err(err), _) => return self.diff(rel, format!("expected side: read_dir: {err}")),
            (_, Err(err)) => return self.diff(rel, format!("actual side: read_dir: {err}")),
        };
        for name in e.difference(&a) {
            self.diffs
                .push(format!("{}: only in expected", show(&rel.join(name))));
        }
        for name in a.difference(&e) {
            self.diffs
                .push(format!("{}: only in actual", show(&rel.join(name))));
        }
        for name in e.intersection(&a) {
            self.entry(&rel.join(name));
        }
    }

    /// Compares data regions of `expected` fully and spot-checks its holes.
    fn content(
        &mut self,
        rel: &Path,
        exp_path: &Path,
        act_path: &Path,
        size: u64,
    ) -> io::Result<()> {
        let ef = File::open(exp_path)?;
        let af = File::open(act_path)?;
        for (start, end, is_data) in regions(&ef, size) {
            let mismatch = if is_data {
                self.compare_range(&ef, &af, start, end)?
            } else {
                let head = (start, end.min(start + HOLE_SAMPLE));
                let tail = (end.saturating_sub(HOLE_SAMPLE).max(head.1), end);
                match self.check_zeros(&af, head.0, head.1)? {
                    None => self.check_zeros(&af, tail.0, tail.1)?,
                    found => found,
                }
            };
            if let Some(msg) = mismatch {
                self.diff(rel, msg);
                return Ok(());
            }
        }
        if af.read_at(&mut self.act_buf[..1], size)? != 0 {
            self.diff(rel, format!("actual returns data past EOF ({size})"));
        }
        Ok(())
    }

    fn compare_range(
        &mut self,
        ef: &File,
        af: &File,
        start: u64,
        end: u64,
    ) -> io::Result<Option<String>> {
        let mut off = start;
        while off < end {
            let len = (end - off).min(MIB as u64) as usize;
            let en = read_full_at(ef, &mut self.exp_buf[..len], off)?;
            let an = read_full_at(af, &mut self.act_buf[..len], off)?;
            if an < en {
                return Ok(Some(format!("short read at {}: {an} of {en} bytes", off)));
            }
            if let Some(i) = (0..en).find(|&i| self.exp_buf[i] != self.act_buf[i]) {
                let at = off + i as u64;
                let (eb, ab) = (self.exp_buf[i], self.act_buf[i]);
                return Ok(Some(format!(
                    "content differs at offset {at}: {eb:#04x} != {ab:#04x}"
                )));
            }
            if en < len {
                break; // expected side shrank while reading
            }
            off += len as u64;
        }
        Ok(None)
    }

    fn check_zeros(&mut self, af: &File, start: u64, end: u64) -> io::Result<Option<String>> {
        let len = (end - start) as usize;
        let n = read_full_at(af, &mut self.act_buf[..len], start)?;
        if n < len {
            return Ok(Some(format!(
                "short read in hole at {start}: {n} of {len} bytes"
            )));
        }
        Ok(self.act_buf[..len].iter().position(|&b| b != 0).map(|i| {
            let at = start + i as u64;
            format!(
                "content differs at offset {at} (hole in expected): {:#04x}",
                self.act_buf[i]
            )
        }))
    }

    /// The hard-link partitions (groups of ≥ 2 paths) must be identical.
    fn links(&mut self) {
        fn groups(map: &mut HashMap<(u64, u64), Vec<PathBuf>>) -> BTreeSet<Vec<PathBuf>> {
            map.drain()
                .filter(|(_, v)| v.len() > 1)
                .map(|(_, mut v)| {
                    v.sort();
                    v
                })
                .collect()
        }
        let e = groups(&mut self.exp_links);
        let a = groups(&mut self.act_links);
        for g in e.difference(&a) {
            self.diffs.push(format!(
                "hard-link group {g:?} in expected is not a group in actual"
            ));
        }
        for g in a.difference(&e) {
            self.diffs.push(format!(
                "hard-link group {g:?} in actual is not a group in expected"
            ));
        }
    }
}

fn dir_names(path: &Path) -> io::Result<BTreeSet<OsString>> {
    fs::read_dir(path)?
        .map(|e| e.map(|e| e.file_name()))
        .collect()
}

/// `(start, end, is_data)` ranges covering `0..size`, using SEEK_DATA/SEEK_HOLE;
/// falls back to one data range where seeking for holes is unsupported.
fn regions(f: &File, size: u64) -> Vec<(u64, u64, bool)> {
    let fd = f.as_raw_fd();
    let seek = |off: u64, whence| {
        // SAFETY: plain lseek on an open descriptor.
        let r = unsafe { libc::lseek(fd, off as libc::off_t, whence) };
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok((r as u64).min(size))
        }
    };
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < size {
        let data = match seek(pos, libc::SEEK_DATA) {
            Ok(d) => d,
            Err(e) if e.raw_os_error() == Some(libc::ENXIO) => size,
            Err(_) => pos,
        };
        if data > pos {
            out.push((pos, data, false));
        }
        if data >= size {
            break;
        }
        let hole = seek(data, libc::SEEK_HOLE).unwrap_or(size);
        out.push((data, hole, true));
        pos = hole;
    }
    out
}

/// Like `read_exact_at`, but returns the byte count instead of failing at EOF.
fn read_full_at(f: &File, buf: &mut [u8], off: u64) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match f.read_at(&mut buf[done..], off + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// `user.*` xattrs of `path` (not following symlinks); none if unsupported.
fn user_xattrs(path: &Path) -> io::Result<BTreeMap<Vec<u8>, Vec<u8>>> {
    let c = cpath(path)?;
    let list = match xattr_buf(|buf, len| {
        // SAFETY: `buf` is valid for `len` bytes (or null with len 0).
        unsafe { libc::llistxattr(c.as_ptr(), buf.cast(), len) }
    }) {
        Err(e) if e.raw_os_error() == Some(libc::ENOTSUP) => return Ok(BTreeMap::new()),
        r => r?,
    };
    let mut out = BTreeMap::new();
    for name in list.split(|&b| b == 0).filter(|n| n.starts_with(b"user.")) {
        let cname = CString::new(name).expect("split at NUL");
        let value = xattr_buf(|buf, len| {
            // SAFETY: as above.
            unsafe { libc::lgetxattr(c.as_ptr(), cname.as_ptr(), buf.cast(), len) }
        })?;
        out.insert(name.to_vec(), value);
    }
    Ok(out)
}

/// Runs a size-query-then-fill xattr call, retrying if the value grew meanwhile.
fn xattr_buf(call: impl Fn(*mut u8, usize) -> isize) -> io::Result<Vec<u8>> {
    loop {
        let len = call(std::ptr::null_mut(), 0);
        if len < 0 {
            return Err(io::Error::last_os_error());
        }
        if len == 0 {
            return Ok(Vec::new());
        }
        let mut buf = vec![0u8; len as usize];
        let n = call(buf.as_mut_ptr(), buf.len());
        if n >= 0 {
            buf.truncate(n as usize);
            return Ok(buf);
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::ERANGE) {
            return Err(err);
        }
    }
}

/// Length and an escaped prefix of a binary value, for messages.
fn abbrev(value: &[u8]) -> String {
    let shown = &value[..value.len().min(32)];
    let more = if value.len() > 32 { "..." } else { "" };
    format!("({} bytes) \"{}{more}\"", value.len(), shown.escape_ascii())
}
