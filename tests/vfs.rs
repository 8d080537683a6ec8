//! The filesystem's operations (`archfs::vfs::Vfs`) driven directly, without a mount:
//! over a SquashFS image and a tar made at test time by mksquashfs and GNU tar, lookups,
//! attributes, reads, listings through a collecting `DirectoryReplier`, directory
//! handles, errors with their errno, and the listing-ahead protocol that
//! tests/prelist.rs sees only through the counts a mount logs.

use crate::common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use archfs::archive::{Archive, Attr, Kind, ROOT_INO};
use archfs::cache::CacheConfig;
use archfs::error::Error;
use archfs::open;
use archfs::vfs::{DirectoryEntry, DirectoryReplier, Opened, Readdirplus, Vfs, Xattr};
use archfs::warm::prelist::ListerPid;
use archfs::warm::push::Pusher;
use common::*;

/// Files in `many/`: more than one small reply holds, so offsets matter.
const MANY: usize = 300;

/// A tree with a directory of [`MANY`] files, a nested directory, a symlink, files of
/// sizes around block boundaries and one with an extended attribute.
fn source_tree(dir: &TempDir) -> PathBuf {
    let src = dir.join("src");
    std::fs::create_dir_all(src.join("many")).unwrap();
    std::fs::create_dir_all(src.join("a/b")).unwrap();
    let mut rnd = xorshift_bytes(54);
    for i in 0..MANY {
        std::fs::write(src.join(format!("many/f{i:04}")), rnd(i % 97)).unwrap();
    }
    for (name, size) in [("empty", 0), ("small", 100), ("block", 131_073)] {
        std::fs::write(src.join("a").join(name), rnd(size)).unwrap();
    }
    std::fs::write(src.join("a/b/deep"), b"deep").unwrap();
    std::fs::set_permissions(src.join("a/small"), std::fs::Permissions::from_mode(0o640)).unwrap();
    std::os::unix::fs::symlink("b/deep", src.join("a/link")).unwrap();
    run_ok(
        Command::new("setfattr")
            .args(["-n", "user.note", "-v", "hello"])
            .arg(src.join("a/small")),
    );
    src
}

/// Archives of one tree, each with its format's name.
type Archives = Vec<(&'static str, Arc<dyn Archive>)>;

/// The tree of [`source_tree`] as a SquashFS image and as a POSIX tar, each opened.
fn archives(dir: &TempDir, src: &Path) -> Archives {
    let img = dir.join("t.sqfs");
    mksquashfs(src, &img, &[]);
    let tar = dir.join("t.tar");
    posix_tar(src, &tar);
    [("squashfs", img), ("tar", tar)]
        .into_iter()
        .map(|(name, path)| (name, open::open(&path, &CacheConfig::default()).unwrap()))
        .collect()
}

/// A fresh tree in a directory of its own, and its archives.
fn fixtures(tag: &str) -> (TempDir, PathBuf, Archives) {
    let dir = TempDir::new(&format!("vfs-{tag}"));
    let src = source_tree(&dir);
    let archives = archives(&dir, &src);
    (dir, src, archives)
}

/// One entry as a test keeps it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Got {
    ino: u64,
    offset: u64,
    kind: Kind,
    name: Vec<u8>,
    attr: Option<Attr>,
}

/// A replier that takes at most `room` entries, as a kernel buffer of some size does.
struct Collect {
    room: usize,
    got: Vec<Got>,
}

impl Collect {
    fn new() -> Collect {
        Collect::with_room(usize::MAX)
    }

    fn with_room(room: usize) -> Collect {
        Collect {
            room,
            got: Vec::new(),
        }
    }

    fn names(&self) -> Vec<String> {
        self.got
            .iter()
            .map(|g| String::from_utf8_lossy(&g.name).into_owned())
            .collect()
    }
}

impl DirectoryReplier for Collect {
    fn add(&mut self, e: DirectoryEntry<'_>) -> bool {
        if self.got.len() == self.room {
            return true;
        }
        self.got.push(Got {
            ino: e.ino,
            offset: e.offset,
            kind: e.kind,
            name: e.name.to_vec(),
            attr: e.attr,
        });
        false
    }
}

/// The errno of `r`'s error; a panic when it succeeded.
fn errno<T>(r: Result<T, Error>) -> i32 {
    match r {
        Ok(_) => panic!("no error"),
        Err(e) => e.errno(),
    }
}

/// A thread id that is no thread of this process, so never the lister's: beyond any
/// kernel's pid_max (2^22).
const JOB: u32 = u32::MAX / 2;

/// The current thread's id: the lister's, once the ListerPid names this process.
fn this_thread() -> u32 {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::gettid() as u32 }
}

/// A Vfs as a mount with the listing ahead builds it: the lister is this process, so a
/// request from [`this_thread`] is the lister's and one from [`JOB`] the job's.
fn with_ahead(archive: &Arc<dyn Archive>) -> (Vfs, Arc<Pusher>) {
    let ahead = ListerPid::new();
    ahead.set_lister(std::process::id());
    let push = Arc::new(Pusher::new(archive.clone()));
    let vfs = Vfs::new(archive.clone(), None)
        .with_push(Some(push.clone()))
        .with_readdirplus(Readdirplus::Always, Some(ahead));
    (vfs, push)
}

/// A Vfs without the listing ahead, the job's listings with attributes as `plus` says.
fn without_ahead(archive: &Arc<dyn Archive>, plus: Readdirplus) -> (Vfs, Arc<Pusher>) {
    let push = Arc::new(Pusher::new(archive.clone()));
    let vfs = Vfs::new(archive.clone(), None)
        .with_push(Some(push.clone()))
        .with_readdirplus(plus, None);
    (vfs, push)
}

fn ino_of(vfs: &Vfs, path: &str) -> u64 {
    path.split('/').fold(ROOT_INO, |dir, name| {
        vfs.lookup(dir, name.as_bytes())
            .unwrap()
            .unwrap_or_else(|| panic!("{path}: no {name}"))
            .ino
    })
}

/// The names of `dir` on disk, sorted, after `.` and `..`.
fn expected_names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    [".".to_string(), "..".to_string()]
        .into_iter()
        .chain(names)
        .collect()
}

#[test]
fn lookups_and_attributes_match_the_source_tree() {
    let (_dir, src, archives) = fixtures("lookup");
    for (format, archive) in &archives {
        let vfs = Vfs::new(archive.clone(), None);
        let mut looked_up = 0;
        for path in [
            "a", "a/empty", "a/small", "a/block", "a/link", "a/b", "a/b/deep",
        ] {
            let meta = std::fs::symlink_metadata(src.join(path)).unwrap();
            let mut dir = ROOT_INO;
            let mut attr = None;
            for name in path.split('/') {
                attr = vfs.lookup(dir, name.as_bytes()).unwrap();
                looked_up += 1;
                dir = attr.as_ref().unwrap().ino;
            }
            let attr = attr.unwrap();
            assert_eq!(vfs.getattr(attr.ino).unwrap(), attr, "{format} {path}");
            let kind = match meta.file_type() {
                t if t.is_dir() => Kind::Dir,
                t if t.is_symlink() => Kind::Symlink,
                _ => Kind::File,
            };
            assert_eq!(attr.kind, kind, "{format} {path}");
            assert_eq!(
                u32::from(attr.perm),
                meta.mode() & 0o7777,
                "{format} {path}"
            );
            assert_eq!(attr.mtime, meta.mtime(), "{format} {path}");
            if kind != Kind::Dir {
                assert_eq!(attr.size, meta.len(), "{format} {path}");
            }
        }
        // A missing name is no error but a negative entry the kernel caches.
        assert_eq!(vfs.lookup(ROOT_INO, b"nothing").unwrap(), None, "{format}");
        let a = ino_of(&vfs, "a");
        assert_eq!(vfs.lookup(a, b"smal").unwrap(), None, "{format}");
        looked_up += 3;
        assert_eq!(vfs.served().lookups, looked_up, "{format}: LOOKUPs counted");
        assert_eq!(vfs.getattr(ROOT_INO).unwrap().kind, Kind::Dir, "{format}");
        assert_eq!(vfs.blksize(), archive.stats().block_size, "{format}");
        let s = vfs.statfs();
        let stats = archive.stats();
        assert_eq!(s.files, stats.inodes, "{format}");
        assert_eq!(s.block_size, stats.block_size, "{format}");
        assert_eq!(
            s.blocks,
            stats.bytes.div_ceil(u64::from(stats.block_size)),
            "{format}"
        );
        assert!(s.blocks > 0, "{format}: {s:?}");
    }
}

#[test]
fn reads_and_links_give_the_source_s_bytes() {
    let (_dir, src, archives) = fixtures("read");
    for (format, archive) in &archives {
        let vfs = Vfs::new(archive.clone(), None);
        for path in ["a/empty", "a/small", "a/block", "a/b/deep", "many/f0096"] {
            let want = std::fs::read(src.join(path)).unwrap();
            let ino = ino_of(&vfs, path);
            let mut got = Vec::new();
            // Odd sizes cross block boundaries.
            loop {
                let d = vfs.read(ino, got.len() as u64, 40_001).unwrap();
                if d.is_empty() {
                    break;
                }
                got.extend_from_slice(&d);
            }
            assert!(
                got == want,
                "{format} {path}: {} of {} bytes",
                got.len(),
                want.len()
            );
            assert!(vfs
                .read(ino, want.len() as u64 + 10, 10)
                .unwrap()
                .is_empty());
        }
        let link = ino_of(&vfs, "a/link");
        assert_eq!(vfs.readlink(link).unwrap(), b"b/deep", "{format}");
    }
}

#[test]
fn errors_carry_the_errno_a_process_sees() {
    let (_dir, _src, archives) = fixtures("errors");
    for (format, archive) in &archives {
        let vfs = Vfs::new(archive.clone(), None);
        let (a, small) = (ino_of(&vfs, "a"), ino_of(&vfs, "a/small"));
        assert_eq!(errno(vfs.lookup(small, b"x")), libc::ENOTDIR, "{format}");
        assert_eq!(errno(vfs.readlink(small)), libc::EINVAL, "{format}");
        assert_eq!(errno(vfs.readlink(a)), libc::EINVAL, "{format}");
        assert_eq!(errno(vfs.read(a, 0, 10)), libc::EISDIR, "{format}");
        // A file opened as a directory: the error comes with its first listing.
        let o = vfs.opendir(small, JOB).unwrap();
        assert_eq!(
            errno(vfs.readdir(o.fh, 0, &mut Collect::new())),
            libc::ENOTDIR,
            "{format}"
        );
        assert_eq!(
            errno(vfs.readdirplus(o.fh, 0, &mut Collect::new())),
            libc::ENOTDIR,
            "{format}"
        );
        vfs.releasedir(o.fh);
    }
}

#[test]
fn xattrs_answer_a_buffer_of_any_size() {
    let (_dir, _src, archives) = fixtures("xattr");
    for (format, archive) in &archives {
        let vfs = Vfs::new(archive.clone(), None);
        let (small, empty) = (ino_of(&vfs, "a/small"), ino_of(&vfs, "a/empty"));
        assert_eq!(
            vfs.getxattr(small, b"user.note", 0).unwrap(),
            Xattr::Size(5),
            "{format}"
        );
        assert_eq!(
            vfs.getxattr(small, b"user.note", 5).unwrap(),
            Xattr::Data(b"hello".to_vec()),
            "{format}"
        );
        assert_eq!(
            errno(vfs.getxattr(small, b"user.note", 4)),
            libc::ERANGE,
            "{format}"
        );
        assert_eq!(
            errno(vfs.getxattr(small, b"user.other", 100)),
            libc::ENODATA,
            "{format}"
        );
        assert_eq!(
            errno(vfs.getxattr(empty, b"user.note", 100)),
            libc::ENODATA,
            "{format}"
        );
        let Xattr::Data(names) = vfs.listxattr(small, 1024).unwrap() else {
            panic!("{format}: no names");
        };
        let user: Vec<&[u8]> = names
            .split(|&b| b == 0)
            .filter(|n| n.starts_with(b"user."))
            .collect();
        assert_eq!(user, [&b"user.note"[..]], "{format}");
        assert_eq!(names.last(), Some(&0), "{format}: each name ends in a NUL");
        assert_eq!(
            vfs.listxattr(small, 0).unwrap(),
            Xattr::Size(names.len() as u32),
            "{format}"
        );
        assert_eq!(
            errno(vfs.listxattr(small, names.len() as u32 - 1)),
            libc::ERANGE,
            "{format}"
        );
    }
}

#[test]
fn a_listing_resumes_at_any_offset_and_stops_when_the_reply_is_full() {
    let (_dir, src, archives) = fixtures("readdir");
    for (format, archive) in &archives {
        let vfs = Vfs::new(archive.clone(), None);
        let many = ino_of(&vfs, "many");
        let o = vfs.opendir(many, JOB).unwrap();
        let mut all = Collect::new();
        vfs.readdir(o.fh, 0, &mut all).unwrap();
        let mut names = all.names();
        // `.` and `..` first, then the archive's order, whatever it is.
        names[2..].sort();
        assert_eq!(names, expected_names(&src.join("many")), "{format}");
        assert_eq!(all.got[0].ino, many, "{format}: `.` is the directory");
        let offsets: Vec<u64> = all.got.iter().map(|g| g.offset).collect();
        assert_eq!(
            offsets,
            (1..=MANY as u64 + 2).collect::<Vec<_>>(),
            "{format}"
        );
        assert!(all.got.iter().all(|g| g.attr.is_none()), "{format}");
        for g in &all.got[2..] {
            let name = std::str::from_utf8(&g.name).unwrap();
            assert_eq!(
                vfs.lookup(many, &g.name).unwrap().unwrap().ino,
                g.ino,
                "{name}"
            );
            assert_eq!(g.kind, Kind::File, "{format} {name}");
        }

        // A reply that holds 7 entries, then the next request from where it stopped.
        let (mut parts, mut requests) = (Vec::new(), 0);
        let mut offset = 0;
        loop {
            let mut part = Collect::with_room(7);
            vfs.readdir(o.fh, offset, &mut part).unwrap();
            if part.got.is_empty() {
                break;
            }
            requests += 1;
            offset = part.got.last().unwrap().offset;
            parts.extend(part.got);
        }
        assert_eq!(parts, all.got, "{format}: the parts make the whole listing");
        assert_eq!(requests, (MANY + 2).div_ceil(7), "{format}: full replies");

        // From the middle, and past the end.
        let mut rest = Collect::new();
        vfs.readdir(o.fh, 100, &mut rest).unwrap();
        assert_eq!(rest.got, all.got[100..], "{format}");
        let mut none = Collect::new();
        vfs.readdir(o.fh, MANY as u64 + 2, &mut none).unwrap();
        vfs.readdir(o.fh, u64::MAX, &mut none).unwrap();
        assert!(none.got.is_empty(), "{format}");

        // With attributes: the same entries, each with its own.
        let mut plus = Collect::new();
        vfs.readdirplus(o.fh, 0, &mut plus).unwrap();
        assert_eq!(plus.got.len(), all.got.len(), "{format}");
        for (p, g) in plus.got.iter().zip(&all.got) {
            assert_eq!((p.ino, p.offset, &p.name), (g.ino, g.offset, &g.name));
            let attr = p.attr.as_ref().expect("attributes");
            assert_eq!(*attr, vfs.getattr(p.ino).unwrap(), "{format}");
        }
        vfs.releasedir(o.fh);
    }
}

#[test]
fn handles_are_distinct_and_a_released_one_is_an_error() {
    let (_dir, _src, archives) = fixtures("handles");
    for (format, archive) in &archives {
        let vfs = Vfs::new(archive.clone(), None);
        let a = ino_of(&vfs, "a");
        let (x, y) = (
            vfs.opendir(a, JOB).unwrap(),
            vfs.opendir(ROOT_INO, JOB).unwrap(),
        );
        assert_ne!(x.fh, y.fh, "{format}");
        // Each handle lists its own directory.
        let (mut in_a, mut in_root) = (Collect::new(), Collect::new());
        vfs.readdir(x.fh, 2, &mut in_a).unwrap();
        vfs.readdir(y.fh, 2, &mut in_root).unwrap();
        let mut names = in_a.names();
        names.sort();
        assert_eq!(names, ["b", "block", "empty", "link", "small"], "{format}");
        let mut names = in_root.names();
        names.sort();
        assert_eq!(names, ["a", "many"], "{format}");

        vfs.releasedir(x.fh);
        for r in [
            vfs.readdir(x.fh, 0, &mut Collect::new()),
            vfs.readdirplus(x.fh, 0, &mut Collect::new()),
        ] {
            let e = r.expect_err("a released handle");
            assert_eq!(e.errno(), libc::EIO, "{format}: {e}");
            assert!(e.to_string().contains("handle"), "{format}: {e}");
        }
        // Releasing again, or a handle never given, changes nothing.
        vfs.releasedir(x.fh);
        vfs.releasedir(12_345);
        let mut again = Collect::new();
        vfs.readdir(y.fh, 2, &mut again).unwrap();
        assert_eq!(
            again.got, in_root.got,
            "{format}: the other handle still lists"
        );
        // A handle is never given twice.
        let z = vfs.opendir(a, JOB).unwrap();
        assert!(z.fh != x.fh && z.fh != y.fh, "{format}");
        vfs.releasedir(y.fh);
        vfs.releasedir(z.fh);
    }
}

/// Without the listing ahead, `--readdirplus=always` makes every job's listing carry
/// attributes and tells the push the directory's inodes are in the kernel; `auto` and
/// `never` do not. Every listing of the job's is counted.
#[test]
fn without_the_listing_ahead_readdirplus_always_marks_listed_directories() {
    let (_dir, _src, archives) = fixtures("plus");
    for (format, archive) in &archives {
        for plus in [Readdirplus::Always, Readdirplus::Auto, Readdirplus::Never] {
            let (vfs, push) = without_ahead(archive, plus);
            assert_eq!(vfs.kernel_readdirplus(), plus, "{format}");
            let (a, many) = (ino_of(&vfs, "a"), ino_of(&vfs, "many"));
            let o = vfs.opendir(many, JOB).unwrap();
            let open = Opened {
                fh: o.fh,
                keep_cache: true,
                cache_dir: true,
            };
            assert_eq!(o, open, "{format} {plus:?}: the job's open");
            let mut all = Collect::new();
            vfs.readdirplus(o.fh, 0, &mut all).unwrap();
            assert_eq!(all.got.len(), MANY + 2, "{format} {plus:?}: every entry");
            assert_eq!(
                push.is_listed(many),
                plus == Readdirplus::Always,
                "{format} {plus:?}"
            );
            // A listing's later parts and plain READDIRs mark nothing.
            let o2 = vfs.opendir(a, JOB).unwrap();
            vfs.readdirplus(o2.fh, 1, &mut Collect::new()).unwrap();
            vfs.readdir(o2.fh, 0, &mut Collect::new()).unwrap();
            assert!(!push.is_listed(a), "{format} {plus:?}");
            assert_eq!(vfs.served().job_listings, 3, "{format} {plus:?}");
            vfs.releasedir(o.fh);
            vfs.releasedir(o2.fh);
        }
    }
}

/// With the listing ahead, the job's listing asks for attributes only at its start (the
/// kernel's adaptive mode); it gets one entry, so the rest comes as plain READDIRs,
/// which the kernel makes no inodes for.
#[test]
fn with_the_listing_ahead_the_job_s_listing_carries_one_entry_s_attributes() {
    let (_dir, src, archives) = fixtures("ahead-job");
    for (format, archive) in &archives {
        let (vfs, push) = with_ahead(archive);
        assert_eq!(vfs.kernel_readdirplus(), Readdirplus::Auto, "{format}");
        let many = ino_of(&vfs, "many");
        let o = vfs.opendir(many, JOB).unwrap();
        assert!(o.keep_cache && o.cache_dir, "{format}: {o:?}");
        let mut first = Collect::new();
        vfs.readdirplus(o.fh, 0, &mut first).unwrap();
        assert_eq!(first.names(), ["."], "{format}: one entry");
        assert!(first.got[0].attr.is_some(), "{format}");
        let mut rest = Collect::new();
        vfs.readdir(o.fh, first.got[0].offset, &mut rest).unwrap();
        assert_eq!(
            rest.got.len(),
            MANY + 1,
            "{format}: the rest in one READDIR"
        );
        assert!(rest.got.iter().all(|g| g.attr.is_none()), "{format}");
        let mut names: Vec<String> = first.names().into_iter().chain(rest.names()).collect();
        names[2..].sort();
        assert_eq!(names, expected_names(&src.join("many")), "{format}");
        // A READDIRPLUS later in the listing (after a lookup in it) is answered whole.
        let mut later = Collect::new();
        vfs.readdirplus(o.fh, 5, &mut later).unwrap();
        assert_eq!(later.got.len(), MANY + 2 - 5, "{format}");
        assert!(later.got.iter().all(|g| g.attr.is_some()), "{format}");
        // The job's listings never tell the push the kernel holds the inodes.
        assert!(!push.is_listed(many), "{format}");
        assert_eq!(vfs.served().job_listings, 3, "{format}");
        vfs.releasedir(o.fh);
    }
}

/// The lister's plain READDIRs get one entry each, so that the kernel looks it up and
/// asks for the next part with attributes; its request at the end marks the directory
/// listed, and none of its requests count as the job's.
#[test]
fn the_lister_gets_one_entry_a_readdir_and_its_last_request_marks_the_directory() {
    let (_dir, _src, archives) = fixtures("ahead-lister");
    for (format, archive) in &archives {
        let (vfs, push) = with_ahead(archive);
        let a = ino_of(&vfs, "a");
        let o = vfs.opendir(a, this_thread()).unwrap();
        let lister_open = Opened {
            fh: o.fh,
            keep_cache: false,
            cache_dir: true,
        };
        assert_eq!(
            o, lister_open,
            "{format}: the lister's open drops the job's cache"
        );
        let len = 2 + 5;
        let mut offset = 0;
        let mut seen = Vec::new();
        while offset < len {
            // Its READDIRPLUS gives every entry left, with attributes.
            let mut plus = Collect::new();
            vfs.readdirplus(o.fh, offset, &mut plus).unwrap();
            assert_eq!(plus.got.len() as u64, len - offset, "{format}");
            assert!(plus.got.iter().all(|g| g.attr.is_some()), "{format}");
            let mut one = Collect::new();
            vfs.readdir(o.fh, offset, &mut one).unwrap();
            assert_eq!(one.got.len(), 1, "{format} at {offset}");
            offset = one.got[0].offset;
            seen.extend(one.names());
            assert!(!push.is_listed(a), "{format}: marked at {offset}");
        }
        assert_eq!(seen.len() as u64, len, "{format}: {seen:?}");
        let mut end = Collect::new();
        vfs.readdir(o.fh, len, &mut end).unwrap();
        assert!(end.got.is_empty(), "{format}");
        assert!(
            push.is_listed(a),
            "{format}: the request at the end marks it"
        );
        assert_eq!(vfs.served().job_listings, 0, "{format}: no job's listing");

        // Its READDIRPLUS at the end marks a directory too.
        let b = ino_of(&vfs, "a/b");
        let o2 = vfs.opendir(b, this_thread()).unwrap();
        vfs.readdirplus(o2.fh, 0, &mut Collect::new()).unwrap();
        assert!(!push.is_listed(b), "{format}");
        vfs.readdirplus(o2.fh, 3, &mut Collect::new()).unwrap();
        assert!(push.is_listed(b), "{format}");
        vfs.releasedir(o.fh);
        vfs.releasedir(o2.fh);
    }
}

/// A directory open by the job and the lister at once: the second to open keeps the
/// kernel's cache of the listing and does not fill it.
#[test]
fn the_second_side_to_open_a_directory_keeps_the_first_s_cache() {
    let (_dir, _src, archives) = fixtures("ahead-both");
    for (format, archive) in &archives {
        let (vfs, _push) = with_ahead(archive);
        let many = ino_of(&vfs, "many");
        let second = |o: Opened| Opened {
            fh: o.fh,
            keep_cache: true,
            cache_dir: false,
        };
        let job = vfs.opendir(many, JOB).unwrap();
        let lister = vfs.opendir(many, this_thread()).unwrap();
        assert_eq!(lister, second(lister), "{format}: the lister second");
        // Another of the job's opens meanwhile: the lister has it open.
        let job2 = vfs.opendir(many, JOB).unwrap();
        assert_eq!(job2, second(job2), "{format}: the job second");
        vfs.releasedir(job.fh);
        vfs.releasedir(job2.fh);
        // The job's gone: the lister alone again, and the job second once more.
        let lister2 = vfs.opendir(many, this_thread()).unwrap();
        assert!(
            !lister2.keep_cache && lister2.cache_dir,
            "{format}: {lister2:?}"
        );
        let job3 = vfs.opendir(many, JOB).unwrap();
        assert_eq!(job3, second(job3), "{format}: the job second");
        // Another directory is no other side's.
        let a = vfs.opendir(ino_of(&vfs, "a"), JOB).unwrap();
        assert!(a.keep_cache && a.cache_dir, "{format}: {a:?}");
        for o in [lister, lister2, job3, a] {
            vfs.releasedir(o.fh);
        }
        // Without the listing ahead, every request is the job's.
        let (plain, _) = without_ahead(archive, Readdirplus::Always);
        let o = plain.opendir(many, this_thread()).unwrap();
        assert!(o.keep_cache && o.cache_dir, "{format}: {o:?}");
        let mut all = Collect::new();
        plain.readdir(o.fh, 0, &mut all).unwrap();
        assert_eq!(all.got.len(), MANY + 2, "{format}");
    }
}
