//! Paths inside an archive as a process reading it in place sees them (the Python
//! reader, where no mount and no kernel walk them): names to inodes with symbolic links
//! followed, whole files read into a caller's buffer, and the sorted walk an
//! ImageFolder-style dataset index makes.
//!
//! The archive root is a wall: `..` at the root, and links that leave the archive
//! (absolute targets, or `..` past the root), are not found, where a mount would lead
//! outside it.

use super::{Archive, Attr, Data, Kind, ROOT_INO};
use crate::error::{Error, Result};

/// Links followed in one walk before giving up, as Linux's `MAXSYMLINKS`.
const MAX_LINKS: u32 = 40;

/// Walks `path` (`/`-separated, relative to the root; a leading `/` is the root too) to
/// its inode, following symbolic links on the way and, when `follow`, the last one.
pub fn walk(archive: &dyn Archive, path: &[u8], follow: bool) -> Result<Attr> {
    let mut links = 0;
    let mut trail = vec![archive.attr(ROOT_INO)?];
    walk_from(archive, &mut trail, path, follow, &mut links)?;
    Ok(trail.pop().expect("the walk keeps the root"))
}

/// Walks `path` from the last directory on `trail` (the directories from the root),
/// leaving its inode last on `trail`.
fn walk_from(
    archive: &dyn Archive,
    trail: &mut Vec<Attr>,
    path: &[u8],
    follow: bool,
    links: &mut u32,
) -> Result<()> {
    if path.first() == Some(&b'/') {
        trail.truncate(1);
    }
    let names: Vec<&[u8]> = path
        .split(|&b| b == b'/')
        .filter(|n| !n.is_empty() && *n != b".")
        .collect();
    for (i, name) in names.iter().enumerate() {
        let here = trail.last().expect("the walk keeps the root");
        if here.kind != Kind::Dir {
            return Err(Error::NotDir);
        }
        if *name == b".." {
            if trail.len() == 1 {
                return Err(Error::NotFound);
            }
            trail.pop();
            continue;
        }
        let attr = archive.lookup(here.ino, name)?;
        let last = i + 1 == names.len();
        if attr.kind == Kind::Symlink && (follow || !last) {
            *links += 1;
            if *links > MAX_LINKS {
                return Err(Error::Loop);
            }
            let target = archive.readlink(attr.ino)?;
            if target.first() == Some(&b'/') || target.is_empty() {
                return Err(Error::NotFound);
            }
            walk_from(archive, trail, &target, true, links)?;
        } else {
            trail.push(attr);
        }
    }
    // A trailing `/` asks for a directory, as open(2) does.
    if path.last() == Some(&b'/') && trail.last().is_some_and(|a| a.kind != Kind::Dir) {
        return Err(Error::NotDir);
    }
    Ok(())
}

/// Reads bytes `offset..` of file `ino` into `buf`, as many as fit or the file holds:
/// straight from the archive file where they lie there verbatim (one `pread` into the
/// caller's buffer), else through the format's reader. Returns how many it read.
pub fn read_into(archive: &dyn Archive, ino: u64, offset: u64, buf: &mut [u8]) -> Result<usize> {
    archive.read_into(ino, offset, buf)
}

/// [`Archive::read_into`] from a file's `stored_at` and `read`, given as closures over
/// (offset, size), so a format can look its file up once for both.
pub fn fill<'a>(
    offset: u64,
    buf: &mut [u8],
    stored_at: impl Fn(u64, u32) -> Option<(std::os::fd::BorrowedFd<'a>, u64, u32)>,
    read: impl Fn(u64, u32) -> Result<Data>,
) -> Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        let at = offset + done as u64;
        let want = u32::try_from(buf.len() - done).unwrap_or(u32::MAX);
        if let Some((fd, pos, len)) = stored_at(at, want) {
            let len = len as usize;
            read_fd(fd, pos, &mut buf[done..done + len])?;
            done += len;
            continue;
        }
        let data = read(at, want)?;
        if data.is_empty() {
            break;
        }
        buf[done..done + data.len()].copy_from_slice(&data);
        done += data.len();
    }
    Ok(done)
}

/// Fills `buf` from `fd` at `pos` (a file ending first is damage).
pub(crate) fn read_fd(fd: std::os::fd::BorrowedFd<'_>, pos: u64, buf: &mut [u8]) -> Result<()> {
    use std::os::fd::AsRawFd;
    let mut done = 0;
    while done < buf.len() {
        let rest = &mut buf[done..];
        // SAFETY: pread writes at most `rest.len()` bytes into `rest`, which we own.
        let n = unsafe {
            libc::pread(
                fd.as_raw_fd(),
                rest.as_mut_ptr().cast(),
                rest.len(),
                (pos + done as u64) as libc::off_t,
            )
        };
        match n {
            n if n > 0 => done += n as usize,
            0 => return Err(Error::corrupt("the archive ends inside a file's data")),
            _ => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(Error::io("cannot read the archive", e));
                }
            }
        }
    }
    Ok(())
}

/// The files under directory `dir`, as `root/sub/name` paths (`root` as given), in the
/// order an ImageFolder index takes them: directories by their full path, names sorted
/// in each, links to directories followed (each directory once, as a loop guard).
/// Only names whose lowercased form ends with one of `suffixes`, when given.
pub fn files_under(
    archive: &dyn Archive,
    root: &[u8],
    suffixes: Option<&[String]>,
) -> Result<Vec<Vec<u8>>> {
    let top = walk(archive, root, true)?;
    if top.kind != Kind::Dir {
        return Err(Error::NotDir);
    }
    let root = root.strip_suffix(b"/").unwrap_or(root).to_vec();
    // Each directory: its path, inode and the directory it was found in. Walked with a
    // stack of its own: a hostile archive may nest a directory 100,000 deep.
    let mut dirs: Vec<(Vec<u8>, u64, usize)> = vec![(root, top.ino, usize::MAX)];
    let mut files: Vec<(usize, Vec<u8>)> = Vec::new();
    let mut stack = vec![0];
    while let Some(d) = stack.pop() {
        for entry in archive.read_dir(dirs[d].1)? {
            let mut full = dirs[d].0.clone();
            if !full.is_empty() {
                full.push(b'/');
            }
            full.extend_from_slice(&entry.name);
            let (mut kind, mut target) = (entry.kind, entry.ino);
            if kind == Kind::Symlink {
                // What the link leads to; a broken link is a file, as os.walk has it.
                if let Ok(attr) = walk(archive, &full, true) {
                    (kind, target) = (attr.kind, attr.ino);
                }
            }
            if kind != Kind::Dir {
                if suffixes.is_none_or(|s| has_suffix(&entry.name, s)) {
                    files.push((d, full));
                }
            } else if !leads_back(&dirs, d, target) {
                dirs.push((full, target, d));
                stack.push(dirs.len() - 1);
            }
        }
    }
    // Directories in the order of their paths, names in each in order.
    let mut order: Vec<usize> = (0..dirs.len()).collect();
    order.sort_by(|&a, &b| dirs[a].0.cmp(&dirs[b].0));
    let mut rank = vec![0; dirs.len()];
    for (r, &d) in order.iter().enumerate() {
        rank[d] = r;
    }
    files.sort_unstable_by(|a, b| rank[a.0].cmp(&rank[b.0]).then_with(|| a.1.cmp(&b.1)));
    Ok(files.into_iter().map(|(_, p)| p).collect())
}

/// Whether directory `target` is `d` or one above it: a link back up is not walked again.
fn leads_back(dirs: &[(Vec<u8>, u64, usize)], mut d: usize, target: u64) -> bool {
    while d != usize::MAX {
        if dirs[d].1 == target {
            return true;
        }
        d = dirs[d].2;
    }
    false
}

/// Whether `name`, lowercased as Python's `str.lower` does (bytes that are not UTF-8:
/// ASCII only), ends with one of `suffixes`.
fn has_suffix(name: &[u8], suffixes: &[String]) -> bool {
    match std::str::from_utf8(name) {
        Ok(s) => {
            let lower = s.to_lowercase();
            suffixes.iter().any(|x| lower.ends_with(x.as_str()))
        }
        Err(_) => {
            let lower = name.to_ascii_lowercase();
            suffixes.iter().any(|x| lower.ends_with(x.as_bytes()))
        }
    }
}

/// The directories reads went through, by the path that named them: a shuffled epoch
/// names each of ImageNet's 1,000 class directories 1,280 times, and one hash lookup of
/// `train/n01440764` replaces its walk from the root (two binary searches of a 1.28 M-entry
/// tar index, ~0.4 µs). The archive is read-only: what a path names never changes.
#[derive(Default)]
pub struct Dirs {
    map: crate::sync::RwLock<std::collections::HashMap<Box<[u8]>, Attr>>,
}

/// Directories remembered before the map starts over.
const MAX_DIRS: usize = 1 << 16;

impl Dirs {
    /// [`walk`], from the remembered directory of everything before the last `/`.
    pub fn walk(&self, archive: &dyn Archive, path: &[u8], follow: bool) -> Result<Attr> {
        let Some(slash) = path.iter().rposition(|&b| b == b'/') else {
            return walk(archive, path, follow);
        };
        let (dir, name) = (&path[..slash], &path[slash + 1..]);
        if dir.is_empty() || name.is_empty() || name == b"." || name == b".." {
            return walk(archive, path, follow);
        }
        let known = self.map.read().get(dir).cloned();
        let d = match known {
            Some(d) => d,
            None => {
                let d = walk(archive, dir, true)?;
                if d.kind == Kind::Dir {
                    let mut map = self.map.write();
                    if map.len() >= MAX_DIRS {
                        map.clear();
                    }
                    map.insert(dir.into(), d.clone());
                }
                d
            }
        };
        if d.kind != Kind::Dir {
            return Err(Error::NotDir);
        }
        let attr = archive.lookup(d.ino, name)?;
        if attr.kind == Kind::Symlink && follow {
            // Its target may climb out of `dir`: walked with the directories above.
            return walk(archive, path, follow);
        }
        Ok(attr)
    }
}
