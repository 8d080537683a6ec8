//! Several archives shown as one tree: directories merge, and for any other name the
//! archive given last wins, as if they were extracted one after another.

use std::collections::HashMap;
use std::os::fd::BorrowedFd;
use std::sync::{Arc, OnceLock};

use parking_lot::RwLock;

use super::{Archive, Attr, Data, DirEntry, Extent, Kind, Stats, ROOT_INO};
use crate::error::{Error, Result};

/// Inodes of members live above this bit, tagged with the member; merged directories
/// below it.
const MEMBER_SHIFT: u32 = 48;

type Parts = Vec<(u16, u64)>;

struct MergedDir {
    /// The same directory in each member that has it, in command-line order.
    parts: Parts,
    /// For directories merged from many members: which members have each name, so a
    /// lookup does not probe every member (WebDataset mounts hundreds of shards).
    names: OnceLock<HashMap<Box<[u8]>, Vec<u16>>>,
}

#[derive(Default)]
struct Dirs {
    list: Vec<Arc<MergedDir>>,
    ids: HashMap<Parts, u64>,
}

pub struct Union {
    members: Vec<Arc<dyn Archive>>,
    dirs: RwLock<Dirs>,
}

const PROBE_LIMIT: usize = 4;

impl Union {
    pub fn new(members: Vec<Arc<dyn Archive>>) -> Result<Union> {
        if members.is_empty() || members.len() > usize::from(u16::MAX) {
            return Err(Error::Unsupported(
                "a union needs 1 to 65535 archives".into(),
            ));
        }
        let u = Union {
            members,
            dirs: RwLock::new(Dirs::default()),
        };
        let root: Parts = (0..u.members.len() as u16).map(|m| (m, ROOT_INO)).collect();
        let id = u.dir_id(root);
        debug_assert_eq!(id, ROOT_INO);
        Ok(u)
    }

    fn dir_id(&self, parts: Parts) -> u64 {
        if let Some(&id) = self.dirs.read().ids.get(&parts) {
            return id;
        }
        let mut d = self.dirs.write();
        if let Some(&id) = d.ids.get(&parts) {
            return id;
        }
        let id = d.list.len() as u64 + 1;
        d.list.push(Arc::new(MergedDir {
            parts: parts.clone(),
            names: OnceLock::new(),
        }));
        d.ids.insert(parts, id);
        id
    }

    fn merged(&self, ino: u64) -> Option<Arc<MergedDir>> {
        if ino >> MEMBER_SHIFT != 0 {
            return None;
        }
        self.dirs
            .read()
            .list
            .get(ino.checked_sub(1)? as usize)
            .cloned()
    }

    fn tag(member: u16, ino: u64) -> Result<u64> {
        if ino >> MEMBER_SHIFT != 0 {
            return Err(Error::Unsupported(
                "inode number too large for a union".into(),
            ));
        }
        Ok((u64::from(member) + 1) << MEMBER_SHIFT | ino)
    }

    fn untag(&self, ino: u64) -> Result<(&dyn Archive, u64)> {
        let m = (ino >> MEMBER_SHIFT) as usize;
        let a = m
            .checked_sub(1)
            .and_then(|m| self.members.get(m))
            .ok_or(Error::NotFound)?;
        Ok((&**a, ino & ((1 << MEMBER_SHIFT) - 1)))
    }

    /// Members of `dir` that may hold `name`.
    fn candidates(&self, dir: &MergedDir, name: &[u8]) -> Result<Vec<(u16, u64)>> {
        if dir.parts.len() <= PROBE_LIMIT {
            return Ok(dir.parts.clone());
        }
        if dir.names.get().is_none() {
            let mut names: HashMap<Box<[u8]>, Vec<u16>> = HashMap::new();
            for &(m, ino) in &dir.parts {
                for e in self.members[usize::from(m)].read_dir(ino)? {
                    names.entry(e.name).or_default().push(m);
                }
            }
            let _ = dir.names.set(names);
        }
        let names = dir.names.get().expect("set above");
        Ok(names
            .get(name)
            .map(|ms| {
                dir.parts
                    .iter()
                    .filter(|(m, _)| ms.contains(m))
                    .copied()
                    .collect()
            })
            .unwrap_or_default())
    }

    /// The winner among `found` (last member), merged with same-named directories.
    fn resolve(&self, found: Vec<(u16, Attr)>) -> Result<Attr> {
        let (m, last) = found.last().cloned().ok_or(Error::NotFound)?;
        if last.kind != Kind::Dir {
            let mut a = last;
            a.ino = Self::tag(m, a.ino)?;
            return Ok(a);
        }
        let parts: Parts = found
            .iter()
            .filter(|(_, a)| a.kind == Kind::Dir)
            .map(|(m, a)| (*m, a.ino))
            .collect();
        let mut a = last;
        a.ino = self.dir_id(parts);
        Ok(a)
    }
}

impl Archive for Union {
    fn format(&self) -> String {
        format!("union of {} archives", self.members.len())
    }

    fn attr(&self, ino: u64) -> Result<Attr> {
        if let Some(d) = self.merged(ino) {
            let &(m, mino) = d.parts.last().ok_or(Error::NotFound)?;
            let mut a = self.members[usize::from(m)].attr(mino)?;
            a.ino = ino;
            return Ok(a);
        }
        let (a, i) = self.untag(ino)?;
        let mut attr = a.attr(i)?;
        attr.ino = ino;
        Ok(attr)
    }

    fn lookup(&self, dir: u64, name: &[u8]) -> Result<Attr> {
        let d = self.merged(dir).ok_or(Error::NotDir)?;
        let mut found = Vec::new();
        for (m, ino) in self.candidates(&d, name)? {
            match self.members[usize::from(m)].lookup(ino, name) {
                Ok(a) => found.push((m, a)),
                Err(Error::NotFound) => {}
                Err(e) => return Err(e),
            }
        }
        self.resolve(found)
    }

    fn read_dir(&self, dir: u64) -> Result<Vec<DirEntry>> {
        let d = self.merged(dir).ok_or(Error::NotDir)?;
        let mut by_name: HashMap<Box<[u8]>, Vec<(u16, DirEntry)>> = HashMap::new();
        let mut order: Vec<Box<[u8]>> = Vec::new();
        for &(m, ino) in &d.parts {
            for e in self.members[usize::from(m)].read_dir(ino)? {
                let slot = by_name.entry(e.name.clone()).or_default();
                if slot.is_empty() {
                    order.push(e.name.clone());
                }
                slot.push((m, e));
            }
        }
        let mut out = Vec::with_capacity(order.len());
        for name in order {
            let found = &by_name[&name];
            let (m, last) = found.last().expect("non-empty");
            let ino = if last.kind == Kind::Dir {
                let parts = found
                    .iter()
                    .filter(|(_, e)| e.kind == Kind::Dir)
                    .map(|(m, e)| (*m, e.ino))
                    .collect();
                self.dir_id(parts)
            } else {
                Self::tag(*m, last.ino)?
            };
            out.push(DirEntry {
                ino,
                kind: last.kind,
                name,
            });
        }
        Ok(out)
    }

    fn read(&self, ino: u64, offset: u64, size: u32) -> Result<Data> {
        if self.merged(ino).is_some() {
            return Err(Error::IsDir);
        }
        let (a, i) = self.untag(ino)?;
        a.read(i, offset, size)
    }

    fn stored_at(&self, ino: u64, offset: u64, size: u32) -> Option<(BorrowedFd<'_>, u64, u32)> {
        if self.merged(ino).is_some() {
            return None;
        }
        let (a, i) = self.untag(ino).ok()?;
        a.stored_at(i, offset, size)
    }

    fn readlink(&self, ino: u64) -> Result<Vec<u8>> {
        if self.merged(ino).is_some() {
            return Err(Error::NotSymlink);
        }
        let (a, i) = self.untag(ino)?;
        a.readlink(i)
    }

    fn xattrs(&self, ino: u64) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        if let Some(d) = self.merged(ino) {
            let &(m, mino) = d.parts.last().ok_or(Error::NotFound)?;
            return self.members[usize::from(m)].xattrs(mino);
        }
        let (a, i) = self.untag(ino)?;
        a.xattrs(i)
    }

    fn stats(&self) -> Stats {
        let mut s = Stats {
            bytes: 0,
            block_size: 4096,
            inodes: 0,
            name_max: 255,
        };
        for m in &self.members {
            let t = m.stats();
            s.bytes += t.bytes;
            s.inodes += t.inodes;
            s.block_size = s.block_size.max(t.block_size);
        }
        s
    }

    fn extents(&self) -> Vec<Extent> {
        self.members.iter().flat_map(|m| m.extents()).collect()
    }

    fn decode_ahead(&self, which: super::Ahead) {
        for m in &self.members {
            m.decode_ahead(which);
        }
    }

    fn decoding_ahead(&self) -> bool {
        self.members.iter().any(|m| m.decoding_ahead())
    }
}
