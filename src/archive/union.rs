//! Several archives shown as one tree: directories merge, and for any other name the
//! archive given last wins, as if they were extracted one after another. A union of tars
//! alone is served from one merged index instead (`crate::tar::TarArchive::union`).

use foldhash::{HashMap, HashMapExt};
use std::collections::hash_map::Entry;
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
/// A merged directory's parts: the same directory in each member that has it, as the
/// union's number of its inode there, so a part is 8 bytes (a member and an inode were
/// 16 with padding: 1.5 MB for 1,000 class directories in 95 of 1,000 shards each).
type Parts = Vec<u64>;

struct MergedDir {
    /// The same directory in each member that has it, in command-line order.
    parts: Parts,
    /// For directories merged from many members: where in `parts` each name is, so a
    /// lookup neither probes nor scans every member (WebDataset mounts thousands of
    /// shards).
    names: OnceLock<Names>,
}

/// Where in a merged directory's `parts` each name is: one word per name and part
/// holding it, the top bits of the name's hash above the part's index, sorted, so a
/// lookup is a binary search and the map copies no name (a collision only adds a probe:
/// the member's own lookup decides). 4 bytes a name and part where the hash bits left
/// beside the part keep collisions under one in 16 lookups (95 shards of a class
/// directory; the 1,000 class names of 1,000 shards), else 8 (48 bits of hash: a root of
/// 10,000 flat shards, 2 M names). A hash map of name to part took ~35 bytes a name (its
/// table at its load factor), 7 MB for the root of 1,000 flat shards of 200 names, more
/// than half one tar's whole index of the same files.
struct Names {
    narrow: Vec<u32>,
    wide: Vec<u64>,
    /// The bits of a narrow word that hold the part.
    part_bits: u32,
}

/// The bits of a wide word that hold the part (a union has at most 65,535 members).
const PART_BITS: u32 = 16;

impl Names {
    /// From the [`word`](Self::word) of each name in each of `parts` parts.
    fn new(mut words: Vec<u64>, parts: usize) -> Names {
        let part_bits = (usize::BITS - parts.saturating_sub(1).leading_zeros()).max(1);
        if part_bits <= PART_BITS && words.len() << 4 <= 1 << (32 - part_bits) {
            let mut narrow: Vec<u32> = words.iter().map(|&w| Self::narrow(w, part_bits)).collect();
            narrow.sort_unstable();
            return Names {
                narrow,
                wide: Vec::new(),
                part_bits,
            };
        }
        words.sort_unstable();
        words.shrink_to_fit();
        Names {
            narrow: Vec::new(),
            wide: words,
            part_bits,
        }
    }

    /// A name's wide word: the low 48 bits of its hash above the part.
    fn word(hash: u64, part: usize) -> u64 {
        (hash << PART_BITS) | part as u64
    }

    /// A wide word's narrow one: the top bits of its hash above the part.
    fn narrow(wide: u64, part_bits: u32) -> u32 {
        let hash = (wide >> (32 + part_bits)) as u32;
        (hash << part_bits) | (wide & ((1 << PART_BITS) - 1)) as u32
    }

    /// The parts that may hold `name`, as indexes into `parts`, in order.
    fn parts(&self, name: &[u8]) -> Vec<usize> {
        let key = Self::word(hash_of(name), 0);
        if !self.wide.is_empty() {
            return Self::matching(&self.wide, key, PART_BITS);
        }
        Self::matching(
            &self.narrow,
            Self::narrow(key, self.part_bits),
            self.part_bits,
        )
    }

    /// The parts of the words in `sorted` whose hash bits are `key`'s.
    fn matching<W: Copy + Ord + Into<u64>>(sorted: &[W], key: W, part_bits: u32) -> Vec<usize> {
        let hash = key.into() >> part_bits;
        let from = sorted.partition_point(|&w| w < key);
        sorted[from..]
            .iter()
            .take_while(|&&w| w.into() >> part_bits == hash)
            .map(|&w| (w.into() & ((1 << part_bits) - 1)) as usize)
            .collect()
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
    fn find(&self, hash: u64, parts: &[u64]) -> Option<u64> {
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
            return Err(Error::Limit("a union needs 1 to 65535 archives".into()));
        }
        let mut first = Vec::with_capacity(members.len() + 1);
        let mut next = 0u64;
        for m in &members {
            first.push(next);
            next = next
                .checked_add(m.ino_end())
                .filter(|&n| n < MEMBER_BIT)
                .ok_or_else(|| Error::Limit("too many inode numbers for a union".into()))?;
        }
        first.push(next);
        let u = Union {
            members,
            first,
            dirs: RwLock::new(Dirs::default()),
        };
        let root = (0..u.members.len() as u16)
            .map(|m| u.tag(m, ROOT_INO))
            .collect::<Result<Parts>>()?;
        let id = u.dir_id(root);
        debug_assert_eq!(id, ROOT_INO);
        Ok(u)
    }

    fn dir_id(&self, mut parts: Parts) -> u64 {
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
        parts.shrink_to_fit();
        d.list.push(Arc::new(MergedDir {
            parts,
            names: OnceLock::new(),
        }));
        match d.ids.entry(hash) {
            Entry::Vacant(v) => {
                v.insert(id);
            }
            Entry::Occupied(_) => d.collided.push(id),
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

    /// The member and its inode of a merged directory's part.
    fn part_of(&self, part: u64) -> (u16, u64) {
        let n = part & !MEMBER_BIT;
        let m = self.first.partition_point(|&f| f <= n) - 1;
        (m as u16, n - self.first[m])
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
            return Ok(dir.parts.iter().map(|&p| self.part_of(p)).collect());
        }
        if dir.names.get().is_none() {
            let mut words = Vec::new();
            for (i, &p) in dir.parts.iter().enumerate() {
                let (m, ino) = self.part_of(p);
                for e in self.members[usize::from(m)].read_dir(ino)? {
                    words.push(Names::word(hash_of(&e.name[..]), i));
                }
            }
            let _ = dir.names.set(Names::new(words, dir.parts.len()));
        }
        let names = dir.names.get().expect("set above");
        Ok(names
            .parts(name)
            .into_iter()
            .map(|i| self.part_of(dir.parts[i]))
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
        let parts = found
            .iter()
            .filter(|(_, a)| a.kind == Kind::Dir)
            .map(|(m, a)| self.tag(*m, a.ino))
            .collect::<Result<Parts>>()?;
        let mut a = last;
        a.ino = self.dir_id(parts);
        Ok(a)
    }
}

impl Archive for Union {
    fn format(&self) -> String {
        format!("union of {} archives", self.members.len())
    }

    fn left_out(&self) -> Vec<String> {
        self.members.iter().flat_map(|m| m.left_out()).collect()
    }

    fn attr(&self, ino: u64) -> Result<Attr> {
        if let Some(d) = self.merged(ino) {
            let (m, mino) = self.part_of(*d.parts.last().ok_or(Error::NotFound)?);
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

    /// Every member's listing, merged as it is read: a name's first appearance places
    /// it, its last decides what it is. A name seen again is found by its hash (no copy
    /// of any name: 1,000 shards of 200 entries were 0.68 s of allocation, hashing and
    /// copying) and dropped at once, so a root merged from 1,000 per-class shards holds
    /// its 1,000 names, not the 95,000 appearances (10 MB at the peak of its listing).
    /// The listing's readers look names up next (the kernel's adaptive READDIRPLUS gives
    /// attributes with the first batch of a directory only), so the lookups' map is made
    /// here from the same listings.
    fn read_dir(&self, dir: u64) -> Result<Vec<DirEntry>> {
        let d = self.merged(dir).ok_or(Error::NotDir)?;
        let mut out: Vec<(u16, DirEntry)> = Vec::new();
        // Where each name hash was first placed; names whose hash another took.
        let mut placed: HashMap<u64, usize> = HashMap::new();
        let mut collided: Vec<usize> = Vec::new();
        // For names seen in several members: the directories among their appearances.
        let mut merged: HashMap<usize, Parts> = HashMap::new();
        // The lookups' map, from the same listings, while they are at hand.
        let mut words = (d.parts.len() > PROBE_LIMIT && d.names.get().is_none()).then(Vec::new);
        for (i, &p) in d.parts.iter().enumerate() {
            let (m, ino) = self.part_of(p);
            for e in self.members[usize::from(m)].read_dir(ino)? {
                let hash = hash_of(&e.name[..]);
                if let Some(words) = &mut words {
                    words.push(Names::word(hash, i));
                }
                let same = |&k: &usize| out[k].1.name == e.name;
                let slot = match placed.get(&hash) {
                    None => None,
                    Some(k) if same(k) => Some(*k),
                    Some(_) => collided.iter().copied().find(same).or_else(|| {
                        collided.push(out.len());
                        None
                    }),
                };
                let Some(k) = slot else {
                    placed.entry(hash).or_insert(out.len());
                    out.push((m, e));
                    continue;
                };
                let parts = match merged.entry(k) {
                    Entry::Occupied(o) => o.into_mut(),
                    Entry::Vacant(v) => {
                        let (pm, pe) = &out[k];
                        v.insert(match pe.kind {
                            Kind::Dir => vec![self.tag(*pm, pe.ino)?],
                            _ => Parts::new(),
                        })
                    }
                };
                if e.kind == Kind::Dir {
                    parts.push(self.tag(m, e.ino)?);
                }
                out[k] = (
                    m,
                    DirEntry {
                        name: std::mem::take(&mut out[k].1.name),
                        ..e
                    },
                );
            }
        }
        if let Some(words) = words {
            let _ = d.names.set(Names::new(words, d.parts.len()));
        }
        out.into_iter()
            .enumerate()
            .map(|(k, (m, mut e))| {
                e.ino = match (e.kind, merged.remove(&k)) {
                    (Kind::Dir, Some(parts)) => self.dir_id(parts),
                    (Kind::Dir, None) => self.dir_id(vec![self.tag(m, e.ino)?]),
                    _ => self.tag(m, e.ino)?,
                };
                Ok(e)
            })
            .collect()
    }

    fn read(&self, ino: u64, offset: u64, size: u32) -> Result<Data> {
        if self.merged(ino).is_some() {
            return Err(Error::IsDir);
        }
        let (a, _, i) = self.untag(ino)?;
        a.read(i, offset, size)
    }

    fn stored_in(&self, ino: u64) -> Option<(&crate::source::Source, Vec<std::ops::Range<u64>>)> {
        if self.merged(ino).is_some() {
            return None;
        }
        let (a, _, i) = self.untag(ino).ok()?;
        a.stored_in(i)
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
            let (m, mino) = self.part_of(*d.parts.last().ok_or(Error::NotFound)?);
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

    fn decode_ahead(&self, which: super::DecodeAhead) {
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
        let word = |name: &[u8], part| Names::word(hash_of(name), part);
        let words = vec![word(b"a", 5), word(b"b", 3), word(b"a", 0), word(b"a", 9)];
        // 4-byte words, then 8-byte ones for more names than 4-byte hashes tell apart.
        for (parts, narrow) in [(10, true), (1 << 15, false)] {
            let mut words = words.clone();
            words.resize(words.len() + parts * 2, word(b"many", 1));
            let names = Names::new(words, parts);
            assert_eq!(names.wide.is_empty(), narrow);
            assert_eq!(names.parts(b"a"), [0, 5, 9]);
            assert_eq!(names.parts(b"b"), [3]);
            assert!(names.parts(b"c").is_empty());
        }
    }

    #[test]
    fn directories_whose_parts_hash_alike_are_told_apart() {
        let dir = |parts: Parts| {
            Arc::new(MergedDir {
                parts,
                names: OnceLock::new(),
            })
        };
        let (one, two) = (vec![MEMBER_BIT | 1], vec![MEMBER_BIT | 2]);
        let mut d = Dirs::default();
        d.list.push(dir(one.clone()));
        d.list.push(dir(two.clone()));
        // Both under one hash, as a collision would put them.
        d.ids.insert(7, 1);
        d.collided.push(2);
        assert_eq!(d.find(7, &one), Some(1));
        assert_eq!(d.find(7, &two), Some(2));
        assert_eq!(d.find(7, &[MEMBER_BIT | 3]), None);
    }
}
