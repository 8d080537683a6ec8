//! Several archives shown as one tree: directories merge, and for any other name the
//! archive given last wins, as if they were extracted one after another.

use foldhash::{HashMap, HashMapExt};
use std::os::fd::BorrowedFd;
use std::sync::{Arc, OnceLock};

use crate::sync::RwLock;

use super::{Archive, Attr, Data, DirEntry, Extent, Kind, Stats, ROOT_INO};
use crate::error::{Error, Result};

/// Inodes of members have this bit set and are numbered one member after another (a
/// member's inode `i` is its first number plus `i`); merged directories are the small
/// numbers without it. So a shard's files have consecutive numbers as one tar's do: the
/// kernel hashes FUSE inodes by their low bits (with the member in bits 48-63, 200,000
/// files of 1,000 shards fell into some 200 hash chains and a `find` spent 15.8 s in the
/// kernel), and `find` stats a large directory's entries in inode order (with the member in
/// the low bits it went across every shard for each file number, ahead of the listing
/// ahead: 2,500-4,400 LOOKUP round trips in a walk of 200,000 files, none for one tar).
const MEMBER_BIT: u64 = 1 << 63;
type Parts = Vec<(u16, u64)>;

struct MergedDir {
    /// The same directory in each member that has it, in command-line order.
    parts: Parts,
    /// For directories merged from many members: where in `parts` each name is, so a
    /// lookup neither probes nor scans every member (WebDataset mounts thousands of
    /// shards).
    names: OnceLock<Names>,
}

/// Where in a merged directory's `parts` each name is: one word per name and part
/// holding it, the name's hash in the high 48 bits and the part in the low 16, sorted, so
/// a lookup is a binary search and the map copies no name (a collision only adds a probe:
/// the member's own lookup decides). 8 bytes a name and part: a hash map of name to part
/// took ~35 a name (its table at its load factor), 7 MB for the root of 1,000 flat shards
/// of 200 names, more than half one tar's whole index of the same files.
struct Names {
    sorted: Vec<u64>,
    distinct: usize,
}

const PART_BITS: u32 = 16;

impl Names {
    /// From the [`word`](Self::word) of each name in each part.
    fn new(words: Vec<u64>) -> Names {
        let mut sorted = words;
        sorted.sort_unstable();
        sorted.shrink_to_fit();
        let distinct = sorted
            .chunk_by(|a, b| a >> PART_BITS == b >> PART_BITS)
            .count();
        Names { sorted, distinct }
    }

    fn word(name: &[u8], part: usize) -> u64 {
        (hash_of(name) << PART_BITS) | part as u64
    }

    /// The parts that may hold `name`, as indexes into `parts`, in order.
    fn parts(&self, name: &[u8]) -> Vec<usize> {
        let key = hash_of(name) << PART_BITS;
        let from = self.sorted.partition_point(|&w| w < key);
        self.sorted[from..]
            .iter()
            .take_while(|&&w| w >> PART_BITS == key >> PART_BITS)
            .map(|&w| (w & ((1 << PART_BITS) - 1)) as usize)
            .collect()
    }

    /// Distinct name hashes.
    fn len(&self) -> usize {
        self.distinct
    }
}

/// The union's one hash, of a name or of a directory's parts: fixed, so a process's
/// maps are the same from run to run.
fn hash_of<T: std::hash::Hash + ?Sized>(value: &T) -> u64 {
    use std::hash::BuildHasher;
    foldhash::fast::FixedState::with_seed(0).hash_one(value)
}

/// Merged directories by number (from 1), and found by their parts: by a hash of them,
/// so the parts are not held twice (16 bytes a member for each directory merged from
/// every member), and the few whose hash was taken in a list.
#[derive(Default)]
struct Dirs {
    list: Vec<Arc<MergedDir>>,
    ids: HashMap<u64, u64>,
    collided: Vec<u64>,
}

impl Dirs {
    fn find(&self, hash: u64, parts: &[(u16, u64)]) -> Option<u64> {
        let same = |id: &u64| self.list[(*id - 1) as usize].parts == parts;
        self.ids
            .get(&hash)
            .filter(|id| same(id))
            .or_else(|| self.collided.iter().find(|id| same(id)))
            .copied()
    }
}

pub struct Union {
    members: Vec<Arc<dyn Archive>>,
    /// Each member's first inode number, without [`MEMBER_BIT`], and one past the last
    /// member's at the end.
    first: Vec<u64>,
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
        let mut first = Vec::with_capacity(members.len() + 1);
        let mut next = 0u64;
        for m in &members {
            first.push(next);
            next = next
                .checked_add(m.ino_end())
                .filter(|&n| n < MEMBER_BIT)
                .ok_or_else(|| Error::Unsupported("too many inode numbers for a union".into()))?;
        }
        first.push(next);
        let u = Union {
            members,
            first,
            dirs: RwLock::new(Dirs::default()),
        };
        let root: Parts = (0..u.members.len() as u16).map(|m| (m, ROOT_INO)).collect();
        let id = u.dir_id(root);
        debug_assert_eq!(id, ROOT_INO);
        Ok(u)
    }

    fn dir_id(&self, parts: Parts) -> u64 {
        let hash = hash_of(&parts);
        if let Some(id) = self.dirs.read().find(hash, &parts) {
            return id;
        }
        let mut guard = self.dirs.write();
        let d = &mut *guard;
        if let Some(id) = d.find(hash, &parts) {
            return id;
        }
        let id = d.list.len() as u64 + 1;
        d.list.push(Arc::new(MergedDir {
            parts,
            names: OnceLock::new(),
        }));
        match d.ids.entry(hash) {
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(id);
            }
            std::collections::hash_map::Entry::Occupied(_) => d.collided.push(id),
        }
        id
    }

    fn merged(&self, ino: u64) -> Option<Arc<MergedDir>> {
        if ino & MEMBER_BIT != 0 {
            return None;
        }
        self.dirs
            .read()
            .list
            .get(ino.checked_sub(1)? as usize)
            .cloned()
    }

    /// Member `member`'s inode `ino` as the union's.
    fn tag(&self, member: u16, ino: u64) -> Result<u64> {
        let m = usize::from(member);
        if ino >= self.first[m + 1] - self.first[m] {
            return Err(Error::corrupt(format!(
                "inode {ino} out of its archive's range"
            )));
        }
        Ok(MEMBER_BIT | (self.first[m] + ino))
    }

    /// The member holding the union's inode `ino`, its number and its inode there.
    fn untag(&self, ino: u64) -> Result<(&dyn Archive, usize, u64)> {
        if ino & MEMBER_BIT == 0 {
            return Err(Error::NotFound);
        }
        let n = ino & !MEMBER_BIT;
        let m = self.first.partition_point(|&f| f <= n).wrapping_sub(1);
        let a = self.members.get(m).ok_or(Error::NotFound)?;
        Ok((&**a, m, n - self.first[m]))
    }

    /// Members of `dir` that may hold `name`.
    fn candidates(&self, dir: &MergedDir, name: &[u8]) -> Result<Vec<(u16, u64)>> {
        if dir.parts.len() <= PROBE_LIMIT {
            return Ok(dir.parts.clone());
        }
        if dir.names.get().is_none() {
            let mut words = Vec::new();
            for (i, &(m, ino)) in dir.parts.iter().enumerate() {
                for e in self.members[usize::from(m)].read_dir(ino)? {
                    words.push(Names::word(&e.name, i));
                }
            }
            let _ = dir.names.set(Names::new(words));
        }
        let names = dir.names.get().expect("set above");
        Ok(names
            .parts(name)
            .into_iter()
            .map(|i| dir.parts[i])
            .collect())
    }

    /// The winner among `found` (last member), merged with same-named directories.
    fn resolve(&self, found: Vec<(u16, Attr)>) -> Result<Attr> {
        let (m, last) = found.last().cloned().ok_or(Error::NotFound)?;
        if last.kind != Kind::Dir {
            let mut a = last;
            a.ino = self.tag(m, a.ino)?;
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
        let (a, _, i) = self.untag(ino)?;
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

    /// Every member's listing, merged: a name's first appearance places it, its last
    /// decides what it is. Built with one map lookup per entry and no copy of any name
    /// (1,000 shards of 200 entries: was 0.68 s of allocation, hashing and copying).
    fn read_dir(&self, dir: u64) -> Result<Vec<DirEntry>> {
        let d = self.merged(dir).ok_or(Error::NotDir)?;
        let mut all: Vec<(u16, DirEntry)> = Vec::new();
        // The lookups' map, from the same listings, while they are at hand.
        let mut words = (d.parts.len() > PROBE_LIMIT && d.names.get().is_none()).then(Vec::new);
        for (i, &(m, ino)) in d.parts.iter().enumerate() {
            let listed = self.members[usize::from(m)].read_dir(ino)?;
            if let Some(words) = &mut words {
                words.extend(listed.iter().map(|e| Names::word(&e.name, i)));
            }
            all.extend(listed.into_iter().map(|e| (m, e)));
        }
        if let Some(words) = words {
            let _ = d.names.set(Names::new(words));
        }
        // As many distinct name hashes as entries: no name is in two members (shards of
        // a dataset), so nothing is merged.
        if d.names.get().is_some_and(|n| n.len() == all.len()) {
            return all
                .into_iter()
                .map(|(m, mut e)| {
                    e.ino = match e.kind {
                        Kind::Dir => self.dir_id(vec![(m, e.ino)]),
                        _ => self.tag(m, e.ino)?,
                    };
                    Ok(e)
                })
                .collect();
        }
        // Where each name first appears; the later appearances of names in several
        // members (directories, or a file that a later member replaces).
        let mut first_of = Vec::with_capacity(all.len());
        let mut again: Vec<(usize, usize)> = Vec::new();
        {
            let mut first: HashMap<&[u8], usize> = HashMap::with_capacity(all.len());
            for (i, (_, e)) in all.iter().enumerate() {
                let f = *first.entry(&e.name).or_insert(i);
                first_of.push(f);
                if f != i {
                    again.push((f, i));
                }
            }
        }
        again.sort_unstable();
        let mut out = Vec::with_capacity(all.len() - again.len());
        let mut later = again.iter().peekable();
        for i in 0..all.len() {
            if first_of[i] != i {
                continue;
            }
            // Most names are in one member only: no group to gather.
            let mut group = Vec::new();
            while let Some(&&(_, j)) = later.peek().filter(|(f, _)| *f == i) {
                if group.is_empty() {
                    group.push(i);
                }
                group.push(j);
                later.next();
            }
            let last = group.last().copied().unwrap_or(i);
            let (m, kind, ino) = (all[last].0, all[last].1.kind, all[last].1.ino);
            let ino = if kind == Kind::Dir {
                if group.is_empty() {
                    group.push(i);
                }
                let parts = group
                    .iter()
                    .filter(|&&g| all[g].1.kind == Kind::Dir)
                    .map(|&g| (all[g].0, all[g].1.ino))
                    .collect();
                self.dir_id(parts)
            } else {
                self.tag(m, ino)?
            };
            out.push(DirEntry {
                ino,
                kind,
                name: std::mem::take(&mut all[i].1.name),
            });
        }
        Ok(out)
    }

    fn read(&self, ino: u64, offset: u64, size: u32) -> Result<Data> {
        if self.merged(ino).is_some() {
            return Err(Error::IsDir);
        }
        let (a, _, i) = self.untag(ino)?;
        a.read(i, offset, size)
    }

    fn stored_at(&self, ino: u64, offset: u64, size: u32) -> Option<(BorrowedFd<'_>, u64, u32)> {
        if self.merged(ino).is_some() {
            return None;
        }
        let (a, _, i) = self.untag(ino).ok()?;
        a.stored_at(i, offset, size)
    }

    fn read_into(&self, ino: u64, offset: u64, buf: &mut [u8]) -> Result<usize> {
        if self.merged(ino).is_some() {
            return Err(Error::IsDir);
        }
        let (a, _, i) = self.untag(ino)?;
        a.read_into(i, offset, buf)
    }

    /// Member by member, each in its own order (a member's place need not follow its
    /// inode numbers).
    fn place(&self, ino: u64) -> u64 {
        match self.untag(ino) {
            Ok((a, m, i)) => (m as u64) << 47 | a.place(i),
            Err(_) => ino,
        }
    }

    fn readlink(&self, ino: u64) -> Result<Vec<u8>> {
        if self.merged(ino).is_some() {
            return Err(Error::NotSymlink);
        }
        let (a, _, i) = self.untag(ino)?;
        a.readlink(i)
    }

    fn xattrs(&self, ino: u64) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        if let Some(d) = self.merged(ino) {
            let &(m, mino) = d.parts.last().ok_or(Error::NotFound)?;
            return self.members[usize::from(m)].xattrs(mino);
        }
        let (a, _, i) = self.untag(ino)?;
        a.xattrs(i)
    }

    fn ino_end(&self) -> u64 {
        MEMBER_BIT | self.first[self.members.len()]
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_give_every_part_holding_a_name_in_order() {
        let words = vec![
            Names::word(b"a", 5),
            Names::word(b"b", 3),
            Names::word(b"a", 0),
            Names::word(b"a", 9),
        ];
        let names = Names::new(words);
        assert_eq!(names.parts(b"a"), [0, 5, 9]);
        assert_eq!(names.parts(b"b"), [3]);
        assert!(names.parts(b"c").is_empty());
        assert_eq!(names.len(), 2);
    }

    #[test]
    fn directories_whose_parts_hash_alike_are_told_apart() {
        let dir = |parts: Parts| {
            Arc::new(MergedDir {
                parts,
                names: OnceLock::new(),
            })
        };
        let (one, two) = (vec![(0, 1)], vec![(1, 1)]);
        let mut d = Dirs::default();
        d.list.push(dir(one.clone()));
        d.list.push(dir(two.clone()));
        // Both under one hash, as a collision would put them.
        d.ids.insert(7, 1);
        d.collided.push(2);
        assert_eq!(d.find(7, &one), Some(1));
        assert_eq!(d.find(7, &two), Some(2));
        assert_eq!(d.find(7, &[(2, 1)]), None);
    }
}
