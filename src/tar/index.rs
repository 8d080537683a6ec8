//! The index of a tar archive, packed: a compact table of inodes and sorted directory
//! entries that answers every lookup without touching the archive again. The builder
//! ([`super::builder`]) fills it in one pass over the headers; a merge of several
//! ([`super::merge`]) and a saved index ([`super::persist`]) make one too.

use std::collections::HashMap;
use std::ops::Range;

use super::column::Column;
use super::header;

use crate::archive::Kind;

/// No node, or no xattr set.
pub const NONE: u32 = u32::MAX;
pub const ROOT: u32 = 0;

/// Node flags.
pub const SPARSE: u8 = 1;

/// One inode, unpacked. For a file `data` is the archive offset of its bytes (or, when
/// sparse, the first of `aux` segments); for a directory it is the first of `aux`
/// entries; for a symlink it is the offset of the target in `links`, `aux` long.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Node {
    pub size: u64,
    pub data: u64,
    pub mtime: i64,
    pub mtime_nsec: u32,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u32,
    pub nlink: u32,
    pub xattrs: u32,
    pub aux: u32,
    pub mode: u16,
    pub kind: u8,
    pub flags: u8,
}

/// A run of real data in a sparse file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    pub offset: u64,
    pub len: u64,
    pub archive_off: u64,
}

pub type XattrSet = Vec<(Vec<u8>, Vec<u8>)>;

/// The fields of a node that few distinct values cover (kind, mode, owner, link count,
/// device, xattr set): each distinct combination is stored once, and a node holds its
/// number in that table.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Meta {
    pub kind: u8,
    pub flags: u8,
    pub mode: u16,
    pub uid: u32,
    pub gid: u32,
    pub nlink: u32,
    pub rdev: u32,
    pub xattrs: u32,
}

/// The index, packed: one `Column` a field, at the narrowest width its values need.
/// A node's `size` column holds a directory's entry count and a symlink's target length;
/// its `data` column a file's offset in units of `1 << file_shift` bytes, a directory's
/// first entry, a symlink's target offset in `links`, or a sparse file's row in `sparse`.
/// Directory entries are ranges of the dirent columns, sorted by name; the names of all
/// entries lie end to end in `names`, in entry order.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Index {
    pub(super) nodes: usize,
    pub(super) size: Column,
    pub(super) data: Column,
    pub(super) mtime: Column,
    pub(super) mtime_base: i64,
    pub(super) nsec: Column,
    pub(super) meta: Column,
    pub(super) metas: Vec<Meta>,
    pub(super) file_shift: u32,
    pub(super) dirents: usize,
    pub(super) name_end: Column,
    pub(super) child: Column,
    pub(super) names: Vec<u8>,
    /// Symlink targets, end to end.
    pub(super) links: Vec<u8>,
    /// (first segment, count) of each sparse file.
    pub(super) sparse: Vec<(u64, u32)>,
    pub(super) segments: Vec<Segment>,
    pub(super) xattrs: Vec<XattrSet>,
    /// Members that were left out (unsafe names, dangling hard links), for the log.
    pub skipped: Vec<String>,
}

pub fn kind_code(k: Kind) -> u8 {
    match k {
        Kind::File => 0,
        Kind::Dir => 1,
        Kind::Symlink => 2,
        Kind::BlockDev => 3,
        Kind::CharDev => 4,
        Kind::Fifo => 5,
        Kind::Socket => 6,
    }
}

pub fn kind_of(code: u8) -> Kind {
    match code {
        1 => Kind::Dir,
        2 => Kind::Symlink,
        3 => Kind::BlockDev,
        4 => Kind::CharDev,
        5 => Kind::Fifo,
        6 => Kind::Socket,
        _ => Kind::File,
    }
}

impl Meta {
    /// The fields of `n` that few distinct values cover.
    fn of(n: &Node) -> Meta {
        Meta {
            kind: n.kind,
            flags: n.flags,
            mode: n.mode,
            uid: n.uid,
            gid: n.gid,
            nlink: n.nlink,
            rdev: n.rdev,
            xattrs: n.xattrs,
        }
    }
}

/// How far a file's data offset is shifted in the `data` column. Tar puts every member's
/// data on a 512-byte boundary, nested tars included, so offsets in blocks take 9 bits
/// less; a writer that did not is still served.
fn file_shift(nodes: &[Node]) -> u32 {
    let is_plain_file = |n: &Node| kind_of(n.kind) == Kind::File && n.flags & SPARSE == 0;
    if nodes
        .iter()
        .all(|n| !is_plain_file(n) || n.data % header::BLOCK == 0)
    {
        9
    } else {
        0
    }
}

impl Index {
    /// Packs the builder's nodes into the node columns.
    fn pack_nodes(&mut self, nodes: &[Node]) {
        let file_shift = file_shift(nodes);
        let mtime_base = nodes.iter().map(|n| n.mtime).min().unwrap_or(0);
        let mut metas: Vec<Meta> = Vec::new();
        let mut meta_ids: HashMap<Meta, u64> = HashMap::new();
        let mut sparse = Vec::new();
        let (mut size, mut data, mut mtime, mut nsec, mut meta) = (
            Vec::with_capacity(nodes.len()),
            Vec::with_capacity(nodes.len()),
            Vec::with_capacity(nodes.len()),
            Vec::with_capacity(nodes.len()),
            Vec::with_capacity(nodes.len()),
        );
        for n in nodes {
            let m = Meta::of(n);
            let id = *meta_ids.entry(m).or_insert_with(|| {
                metas.push(m);
                metas.len() as u64 - 1
            });
            meta.push(id);
            mtime.push(n.mtime.wrapping_sub(mtime_base) as u64);
            nsec.push(u64::from(n.mtime_nsec));
            let (s, d) = match kind_of(n.kind) {
                Kind::Dir => (u64::from(n.aux), n.data),
                Kind::Symlink => (n.size, n.data),
                Kind::File if n.flags & SPARSE != 0 => {
                    sparse.push((n.data, n.aux));
                    (n.size, sparse.len() as u64 - 1)
                }
                Kind::File => (n.size, n.data >> file_shift),
                _ => (0, 0),
            };
            size.push(s);
            data.push(d);
        }
        self.nodes = nodes.len();
        self.size = Column::new(&size);
        self.data = Column::new(&data);
        self.mtime = Column::new(&mtime);
        self.mtime_base = mtime_base;
        self.nsec = Column::new(&nsec);
        self.meta = Column::new(&meta);
        self.metas = metas;
        self.file_shift = file_shift;
        self.sparse = sparse;
    }

    pub fn node_count(&self) -> usize {
        self.nodes
    }

    pub fn dirent_count(&self) -> usize {
        self.dirents
    }

    /// Bytes the packed index holds in memory.
    pub fn heap_bytes(&self) -> usize {
        let cols = [
            &self.size,
            &self.data,
            &self.mtime,
            &self.nsec,
            &self.meta,
            &self.name_end,
            &self.child,
        ];
        cols.iter().map(|c| c.bytes()).sum::<usize>()
            + self.metas.len() * std::mem::size_of::<Meta>()
            + self.names.len()
            + self.links.len()
            + self.sparse.len() * 16
            + self.segments.len() * std::mem::size_of::<Segment>()
    }

    /// Node `id`'s kind alone: a listing needs no more, and unpacking every field reads
    /// five columns an entry.
    pub fn kind(&self, id: u32) -> u8 {
        self.metas[self.meta.get(id as usize) as usize].kind
    }

    /// Node `id` (below [`Index::node_count`]) with every field unpacked.
    pub fn node(&self, id: u32) -> Node {
        let i = id as usize;
        let m = self.metas[self.meta.get(i) as usize];
        let mut n = Node {
            mtime: self.mtime_base.wrapping_add(self.mtime.get(i) as i64),
            mtime_nsec: self.nsec.get(i) as u32,
            uid: m.uid,
            gid: m.gid,
            rdev: m.rdev,
            nlink: m.nlink,
            xattrs: m.xattrs,
            mode: m.mode,
            kind: m.kind,
            flags: m.flags,
            ..Node::default()
        };
        let (size, data) = (self.size.get(i), self.data.get(i));
        match kind_of(m.kind) {
            Kind::Dir => (n.data, n.aux) = (data, size as u32),
            Kind::Symlink => (n.data, n.size, n.aux) = (data, size, size as u32),
            Kind::File if m.flags & SPARSE != 0 => {
                let (first, count) = self.sparse[data as usize];
                (n.data, n.size, n.aux) = (first, size, count);
            }
            Kind::File => (n.data, n.size) = (data << self.file_shift, size),
            _ => {}
        }
        n
    }

    /// Where node `id`'s data starts, if it is a file stored in one piece.
    pub fn file_offset(&self, id: u32) -> Option<u64> {
        let m = self.metas[self.meta.get(id as usize) as usize];
        (kind_of(m.kind) == Kind::File && m.flags & SPARSE == 0)
            .then(|| self.data.get(id as usize) << self.file_shift)
    }

    /// The name of directory entry `i`.
    pub fn name(&self, i: usize) -> &[u8] {
        let start = if i == 0 { 0 } else { self.name_end.get(i - 1) };
        &self.names[start as usize..self.name_end.get(i) as usize]
    }

    /// The node directory entry `i` names.
    pub fn child(&self, i: usize) -> u32 {
        self.child.get(i) as u32
    }

    /// The entries of directory `dir`, sorted by name: from three columns, not every
    /// field (a union lists the same directory in each of thousands of members).
    pub fn children(&self, dir: u32) -> Range<usize> {
        if kind_of(self.kind(dir)) != Kind::Dir {
            return 0..0;
        }
        let i = dir as usize;
        let first = self.data.get(i) as usize;
        first..first + self.size.get(i) as u32 as usize
    }

    /// Binary search of a directory's `entries` ([`Index::children`]): they are sorted
    /// by name bytes.
    pub fn find(&self, entries: Range<usize>, name: &[u8]) -> Option<u32> {
        let (mut lo, mut hi) = (entries.start, entries.end);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            match self.name(mid).cmp(name) {
                std::cmp::Ordering::Less => lo = mid + 1,
                std::cmp::Ordering::Greater => hi = mid,
                std::cmp::Ordering::Equal => return Some(self.child(mid)),
            }
        }
        None
    }

    pub fn symlink_target(&self, n: &Node) -> &[u8] {
        &self.links[n.data as usize..n.data as usize + n.aux as usize]
    }

    pub fn sparse_map(&self, n: &Node) -> &[Segment] {
        &self.segments[n.data as usize..n.data as usize + n.aux as usize]
    }

    pub fn xattr_set(&self, i: u32) -> Option<&XattrSet> {
        self.xattrs.get(i as usize)
    }
}

/// A tree's directory entries, unpacked: names end to end, where each ends, the node
/// each names; each directory's a range of them (its node's `data` and `aux`).
pub(super) struct Dirents {
    pub names: Vec<u8>,
    pub name_end: Vec<u64>,
    pub child: Vec<u64>,
}

impl Index {
    /// The index of `nodes` and their `entries`, link counts set from the tree.
    pub(super) fn assemble(
        nodes: &mut [Node],
        mut entries: Dirents,
        mut links: Vec<u8>,
        mut segments: Vec<Segment>,
        xattrs: Vec<XattrSet>,
        skipped: Vec<String>,
    ) -> Index {
        let child = &entries.child;
        count_links(nodes, child);
        entries.names.shrink_to_fit();
        links.shrink_to_fit();
        segments.shrink_to_fit();
        let mut ix = Index {
            dirents: child.len(),
            name_end: Column::new(&entries.name_end),
            child: Column::new(child),
            names: entries.names,
            links,
            segments,
            xattrs,
            skipped,
            ..Index::default()
        };
        ix.pack_nodes(nodes);
        ix
    }
}

/// Sets each node's link count from the tree: a name each for a non-directory, two and
/// one a subdirectory for a directory.
fn count_links(nodes: &mut [Node], child: &[u64]) {
    for n in nodes.iter_mut() {
        n.nlink = if kind_of(n.kind) == Kind::Dir { 2 } else { 0 };
    }
    for &c in child {
        let n = &mut nodes[c as usize];
        // A directory's count is its own two plus one per subdirectory, below.
        if kind_of(n.kind) != Kind::Dir {
            n.nlink += 1;
        }
    }
    for i in 0..nodes.len() {
        if kind_of(nodes[i].kind) != Kind::Dir {
            continue;
        }
        let (s, c) = (nodes[i].data as usize, nodes[i].aux as usize);
        let subdirs = child[s..s + c]
            .iter()
            .filter(|&&d| kind_of(nodes[d as usize].kind) == Kind::Dir)
            .count() as u32;
        nodes[i].nlink = 2 + subdirs;
    }
}
