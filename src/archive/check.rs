//! A full walk of an archive through the [`Archive`] interface: every directory listed and
//! looked up by name, every inode stat'ed, every file read to its end, every symlink and
//! xattr read. `archfs check` runs it on a user's archive; the fuzz targets and their
//! regression test run it on hostile ones, so it must finish on any input.

use std::collections::HashSet;

use super::{Archive, Kind, ROOT_INO};
use crate::error::Error;

/// Bounds that keep a walk of a hostile archive finite.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Directory entries visited, in all directories together.
    pub entries: u64,
    /// File bytes read, in all files together.
    pub bytes: u64,
    /// Damage reports kept (the count goes on).
    pub reports: usize,
}

impl Limits {
    /// No practical bound: for checking a user's archive.
    pub const ALL: Limits = Limits {
        entries: u64::MAX,
        bytes: u64::MAX,
        reports: 1000,
    };
}

/// What a walk found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Report {
    pub dirs: u64,
    pub files: u64,
    pub symlinks: u64,
    pub others: u64,
    pub bytes: u64,
    /// Damage found, as `path: error`; at most `Limits::reports` of them.
    pub damaged: Vec<String>,
    pub damage_count: u64,
    /// The walk stopped at a limit before seeing everything.
    pub truncated: bool,
}

impl Report {
    fn damage(&mut self, limits: &Limits, path: &[u8], e: &Error) {
        self.damage_count += 1;
        if self.damaged.len() < limits.reports {
            self.damaged
                .push(format!("{}: {e}", String::from_utf8_lossy(path)));
        }
    }
}

const READ_SIZE: u32 = 1 << 20;

/// Walks the whole tree from the root. A directory reached twice (a loop, or an alias the
/// format forbids) is reported and not entered again.
pub fn check(archive: &dyn Archive, limits: Limits) -> Report {
    let mut r = Report::default();
    for line in archive.left_out() {
        r.damage_count += 1;
        if r.damaged.len() < limits.reports {
            r.damaged.push(format!("left out: {line}"));
        }
    }
    let mut seen_dirs = HashSet::new();
    let mut stack = vec![(ROOT_INO, b"/".to_vec())];
    seen_dirs.insert(ROOT_INO);
    let mut entries = 0u64;
    while let Some((dir, path)) = stack.pop() {
        r.dirs += 1;
        check_inode(archive, dir, &path, &limits, &mut r);
        let listing = match archive.read_dir(dir) {
            Ok(l) => l,
            Err(e) => {
                r.damage(&limits, &path, &e);
                continue;
            }
        };
        for e in listing {
            entries += 1;
            if entries > limits.entries {
                r.truncated = true;
                return r;
            }
            let mut child = path.clone();
            if child.len() > 1 {
                child.push(b'/');
            }
            child.extend_from_slice(&e.name);
            if e.name.is_empty() || e.name.contains(&b'/') || e.name.contains(&0) {
                r.damage(
                    &limits,
                    &child,
                    &Error::corrupt("invalid name in a directory"),
                );
                continue;
            }
            match archive.lookup(dir, &e.name) {
                Ok(a) if a.ino == e.ino && a.kind == e.kind => {}
                Ok(a) => r.damage(
                    &limits,
                    &child,
                    &Error::corrupt(format!(
                        "lookup gives inode {} ({:?}), the listing {} ({:?})",
                        a.ino, a.kind, e.ino, e.kind
                    )),
                ),
                Err(err) => r.damage(&limits, &child, &err),
            }
            match e.kind {
                Kind::Dir => {
                    if seen_dirs.insert(e.ino) {
                        stack.push((e.ino, child));
                    } else {
                        r.damage(
                            &limits,
                            &child,
                            &Error::corrupt("directory reached twice (a loop)"),
                        );
                    }
                }
                Kind::File => {
                    r.files += 1;
                    if !read_file(archive, e.ino, &child, &limits, &mut r) {
                        r.truncated = true;
                        return r;
                    }
                }
                Kind::Symlink => {
                    r.symlinks += 1;
                    check_inode(archive, e.ino, &child, &limits, &mut r);
                    if let Err(err) = archive.readlink(e.ino) {
                        r.damage(&limits, &child, &err);
                    }
                }
                _ => {
                    r.others += 1;
                    check_inode(archive, e.ino, &child, &limits, &mut r);
                }
            }
        }
    }
    r
}

/// Stat and xattrs of one inode; the attributes when they could be read.
fn check_inode(
    archive: &dyn Archive,
    ino: u64,
    path: &[u8],
    limits: &Limits,
    r: &mut Report,
) -> Option<super::Attr> {
    let attr = archive
        .attr(ino)
        .map_err(|e| r.damage(limits, path, &e))
        .ok();
    if let Err(e) = archive.xattrs(ino) {
        r.damage(limits, path, &e);
    }
    attr
}

/// Reads a file to its stated size; false when the byte limit ran out.
fn read_file(
    archive: &dyn Archive,
    ino: u64,
    path: &[u8],
    limits: &Limits,
    r: &mut Report,
) -> bool {
    let Some(size) = check_inode(archive, ino, path, limits, r).map(|a| a.size) else {
        return true;
    };
    let mut off = 0u64;
    while off < size {
        if r.bytes >= limits.bytes {
            return false;
        }
        match archive.read(ino, off, READ_SIZE) {
            Ok(d) if d.is_empty() => {
                let msg = format!("file ends at {off} bytes, {size} stated");
                r.damage(limits, path, &Error::corrupt(msg));
                break;
            }
            Ok(d) => {
                off += d.len() as u64;
                r.bytes += d.len() as u64;
            }
            Err(e) => {
                r.damage(limits, path, &e);
                // Go on past the bad block: the rest of the file may be fine.
                off = (off / u64::from(READ_SIZE) + 1) * u64::from(READ_SIZE);
            }
        }
    }
    true
}

/// Limits for archives whose bytes come from a fuzzer: small enough for thousands of
/// runs a second, large enough to reach every structure of a small archive.
pub const FUZZ_LIMITS: Limits = Limits {
    entries: 20_000,
    bytes: 16 << 20,
    reports: 8,
};
