//! The index of a tar archive: one pass over the headers, skipping file data, builds a
//! compact table of inodes and sorted directory entries that answers every lookup
//! without touching the archive again.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::column::Column;
use super::header::{self, Header, BLOCK};

use crate::archive::Kind;
use crate::compressed::{Bytes, Codec, Points, Scan};
use crate::error::{Error, Result};
use crate::source::Source;

pub const NONE: u32 = u32::MAX;
/// An entry that removes what its name held (a hard link to a directory, which
/// extractors fail to make after removing the file in its way).
const GONE: u32 = u32::MAX - 1;
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

impl Index {
    /// Packs the builder's nodes into the node columns.
    fn pack_nodes(&mut self, nodes: &[Node]) {
        let is_plain_file = |n: &Node| kind_of(n.kind) == Kind::File && n.flags & SPARSE == 0;
        // Tar puts every member's data on a 512-byte boundary, nested tars included, so
        // offsets in blocks take 9 bits less; a writer that did not is still served.
        let file_shift = if nodes
            .iter()
            .all(|n| !is_plain_file(n) || n.data % header::BLOCK == 0)
        {
            9
        } else {
            0
        };
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
            let m = Meta {
                kind: n.kind,
                flags: n.flags,
                mode: n.mode,
                uid: n.uid,
                gid: n.gid,
                nlink: n.nlink,
                rdev: n.rdev,
                xattrs: n.xattrs,
            };
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

/// Splits a member name into safe components: leading `/`, empty and `.` components
/// are dropped (like GNU tar); a name with `..` is refused.
pub fn normalize(path: &[u8]) -> Option<Vec<&[u8]>> {
    let mut out = Vec::new();
    for c in path.split(|&b| b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => return None,
            c => out.push(c),
        }
    }
    Some(out)
}

/// Settings of an index build.
#[derive(Clone, Debug, Default)]
pub struct BuildOptions {
    /// Show nested `.tar` members as directories (`--recursive`).
    pub recursive: bool,
    /// uid/gid/mtime for directories the archive only implies.
    pub implied_uid: u32,
    pub implied_gid: u32,
    pub implied_mtime: i64,
}

struct RawEntry {
    parent: u32,
    name: Vec<u8>,
    node: u32,
    seq: u64,
    /// A hard link: resolved against the finished tree.
    link: Option<Vec<u8>>,
}

/// Collects members as the headers are read, then sorts them into an [`Index`].
pub struct Builder<'a> {
    opts: BuildOptions,
    /// Compressed tars inside the archive (`--recursive`): how to open them, and those
    /// opened so far. Members' data offsets carry their body in their top bits
    /// ([`BODY_SHIFT`]; 0 is the archive's own stream).
    members: Option<Members>,
    bodies: Vec<Nested>,
    body: u64,
    /// Where the compressed member being scanned starts in the archive, and how far into
    /// it its decoder has read: together, the place the progress bar shows.
    member_at: u64,
    member_read: Arc<AtomicU64>,
    nodes: Vec<Node>,
    entries: Vec<RawEntry>,
    dirs: HashMap<Vec<u8>, u32>,
    /// Symlink targets.
    links: Vec<u8>,
    segments: Vec<Segment>,
    xattrs: Vec<XattrSet>,
    skipped: Vec<String>,
    seq: u64,
    /// The end of the last member's data: past the archive's end means it is truncated.
    data_end: u64,
    progress: &'a mut dyn FnMut(u64),
}

/// Data offsets above this bit name the body they are in: 0 the archive's own tar
/// stream, `k` the `k`-th compressed tar inside it (`--recursive`).
pub const BODY_SHIFT: u32 = 48;

/// The body and the offset within it of a member's data offset.
pub fn body_of(data: u64) -> (usize, u64) {
    (
        (data >> BODY_SHIFT) as usize,
        data & ((1 << BODY_SHIFT) - 1),
    )
}

/// How compressed tars inside a plain archive are opened (`--recursive`).
#[derive(Clone, Debug)]
pub struct Members {
    pub source: Arc<Source>,
    /// Decoded bytes between entry points, and the most a member may decode to.
    pub spacing: u64,
    pub limit: u64,
}

impl Members {
    /// The member at `[at, at + len)` if it is a compressed tar.
    fn tar_in(&self, at: u64, len: u64) -> Result<Option<Found>> {
        let mut magic = [0u8; 4];
        if len < 4 {
            return Ok(None);
        }
        self.source.read_exact_at(at, &mut magic)?;
        let Some(codec) = Codec::detect(&magic) else {
            return Ok(None);
        };
        let slice = Arc::new(self.source.slice(at, len)?);
        let mut raw = [0u8; 512];
        let ok = crate::compressed::first_bytes(&slice, codec, &mut raw).is_ok_and(|n| n == 512)
            && !Header::new(&raw).is_zero()
            && Header::new(&raw).checksum_ok();
        Ok(ok.then(|| Found {
            codec,
            source: slice,
            at,
            spacing: self.spacing,
            limit: self.limit,
        }))
    }
}

/// A compressed tar inside the archive, found and about to be indexed: its format, the
/// member as a source of its own, and where it is in the archive.
struct Found {
    codec: Codec,
    source: Arc<Source>,
    at: u64,
    spacing: u64,
    limit: u64,
}

/// A compressed tar inside the archive: where it is, and its entry points.
pub struct Nested {
    pub at: u64,
    pub len: u64,
    pub codec: Codec,
    pub points: Points,
}

/// Names of compressed tars (`--recursive`) and the directory each is shown as.
const COMPRESSED_TARS: [&str; 10] = [
    ".tar.gz",
    ".tgz",
    ".tar.zst",
    ".tar.zstd",
    ".tzst",
    ".tar.xz",
    ".txz",
    ".tar.bz2",
    ".tbz2",
    ".tbz",
];

/// The directory name of a member named like a compressed tar (`a.tar.gz`: `a`).
fn compressed_stem(path: &[&[u8]]) -> Option<Vec<u8>> {
    let name = path.last()?;
    COMPRESSED_TARS.iter().find_map(|s| {
        let stem = name.strip_suffix(s.as_bytes())?;
        (!stem.is_empty()).then(|| stem.to_vec())
    })
}

/// How deep tars nested in tars are opened as directories (`--recursive`); a deeper one is
/// shown as the plain file it is, so this refuses nothing and bounds the recursion.
const MAX_DEPTH: u32 = 8;

/// A member's attributes gathered from its header and any PAX/GNU extensions.
#[derive(Default)]
struct Member {
    path: Vec<u8>,
    link: Vec<u8>,
    typeflag: u8,
    mode: u32,
    uid: u64,
    gid: u64,
    mtime: i64,
    mtime_nsec: u32,
    size: u64,
    rdev: u32,
    xattrs: XattrSet,
    sparse: Option<Sparse>,
}

#[derive(Default)]
struct Sparse {
    map: Vec<(u64, u64)>,
    /// PAX 1.0 keeps the map at the start of the data.
    map_in_data: bool,
}

fn new_encode_dev(major: u64, minor: u64) -> u32 {
    let (major, minor) = (major as u32, minor as u32);
    (minor & 0xff) | ((major & 0xfff) << 8) | ((minor & !0xff) << 12)
}

impl<'a> Builder<'a> {
    /// `members`: how compressed tars inside a plain archive are opened with
    /// `--recursive` (they are read from slices of its file).
    pub fn new(
        opts: BuildOptions,
        members: Option<Members>,
        progress: &'a mut dyn FnMut(u64),
    ) -> Self {
        let root = Node {
            kind: kind_code(Kind::Dir),
            mode: 0o755,
            uid: opts.implied_uid,
            gid: opts.implied_gid,
            mtime: opts.implied_mtime,
            xattrs: NONE,
            ..Node::default()
        };
        let mut dirs = HashMap::new();
        dirs.insert(Vec::new(), ROOT);
        Builder {
            opts,
            members,
            bodies: Vec::new(),
            body: 0,
            member_at: 0,
            member_read: Arc::default(),
            nodes: vec![root],
            entries: Vec::new(),
            dirs,
            links: Vec::new(),
            segments: Vec::new(),
            xattrs: Vec::new(),
            skipped: Vec::new(),
            seq: 0,
            data_end: 0,
            progress,
        }
    }

    /// The directory node for `path`, creating it and any parents the archive only implies.
    fn dir(&mut self, comps: &[&[u8]]) -> u32 {
        let key = comps.join(&b'/');
        if let Some(&n) = self.dirs.get(&key) {
            return n;
        }
        let parent = self.dir(&comps[..comps.len() - 1]);
        let node = self.push_node(Node {
            kind: kind_code(Kind::Dir),
            mode: 0o755,
            uid: self.opts.implied_uid,
            gid: self.opts.implied_gid,
            mtime: self.opts.implied_mtime,
            xattrs: NONE,
            ..Node::default()
        });
        self.dirs.insert(key, node);
        self.push_entry(parent, comps[comps.len() - 1].to_vec(), node, None);
        node
    }

    fn push_node(&mut self, n: Node) -> u32 {
        self.nodes.push(n);
        (self.nodes.len() - 1) as u32
    }

    fn push_entry(&mut self, parent: u32, name: Vec<u8>, node: u32, link: Option<Vec<u8>>) {
        self.seq += 1;
        self.entries.push(RawEntry {
            parent,
            name,
            node,
            seq: self.seq,
            link,
        });
    }

    /// Reads the members of the tar stored at `[start, end)` of `src`, placing them
    /// under `prefix`.
    pub fn scan(
        &mut self,
        src: &dyn Bytes,
        start: u64,
        end: u64,
        prefix: &[Vec<u8>],
        depth: u32,
    ) -> Result<()> {
        let mut pos = start;
        let mut global: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        let mut local: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        let mut long_name: Option<Vec<u8>> = None;
        let mut long_link: Option<Vec<u8>> = None;
        let mut reader = BlockReader::new(src);
        // Where blocks that are not headers began, where one was expected: GNU tar and
        // bsdtar skip them to the next header ("Skipping to next header").
        let mut damage: Option<u64> = None;
        loop {
            // A stream being decoded learns its length only at its end.
            let end = end.min(src.len_within(pos + BLOCK)?);
            if pos + BLOCK > end {
                if pos == end || damage.is_some() {
                    break; // no end-of-archive blocks: accepted, like GNU tar
                }
                return Err(Error::corrupt(format!(
                    "tar archive is truncated: it ends at offset {end}, before the header \
                     expected at {pos}"
                )));
            }
            let raw = reader.block(pos)?;
            let h = Header::new(&raw);
            if h.is_zero() {
                break;
            }
            if !h.checksum_ok() {
                if pos == start {
                    return Err(Error::corrupt(format!(
                        "tar header at offset {pos} has a bad checksum; the archive is \
                         damaged there (check it with `tar -tvf`)"
                    )));
                }
                damage.get_or_insert(pos);
                (long_name, long_link) = (None, None);
                local.clear();
                pos += BLOCK;
                continue;
            }
            if let Some(from) = damage.take() {
                self.skipped.push(damaged(from, pos));
            }
            // Inside a compressed member, offsets are decoded ones: the member's place in
            // the archive plus what its decoder has read stands for them.
            (self.progress)(if self.body == 0 {
                pos
            } else {
                self.member_at + self.member_read.load(Ordering::Relaxed)
            });
            let size = h.size()?;
            let data_start = pos + BLOCK;
            let typeflag = h.typeflag();
            // PAX records and GNU long names have no size limit in the format (GNU tar
            // archives paths longer than PATH_MAX, and a member's xattrs can reach several
            // MiB), and what they say is kept in the index anyway: bounded by the archive,
            // one byte of memory a byte of archive, not by a guess.
            let read_meta = |what: &str| -> Result<Vec<u8>> {
                if data_start.saturating_add(size) > end {
                    return Err(Error::corrupt(format!(
                        "{what} of {size} bytes at offset {pos} is too large or truncated"
                    )));
                }
                src.read_vec(data_start, size as usize)
            };
            let past_data = data_start.saturating_add(size.div_ceil(BLOCK).saturating_mul(BLOCK));
            match typeflag {
                // `X`: Solaris' and star's extended header, read as POSIX's `x`.
                b'x' | b'X' | b'g' => {
                    let data = read_meta("PAX header")?;
                    let (recs, bad) = header::pax_records(&data);
                    if let Some(why) = bad {
                        // GNU tar applies the records before a malformed one and goes on.
                        self.skipped.push(format!(
                            "the rest of the PAX header at offset {pos} ({why}), as tar -x does"
                        ));
                    }
                    let recs = recs.into_iter().map(|(k, v)| (k.to_vec(), v.to_vec()));
                    if typeflag == b'g' {
                        global.extend(recs);
                    } else {
                        // A second `x` before a member replaces the first, for GNU tar
                        // and bsdtar alike.
                        local = recs.collect();
                    }
                    pos = past_data;
                    continue;
                }
                b'L' | b'K' => {
                    // A name ends at its first NUL, as every extractor reads it.
                    let mut data = read_meta("GNU long name")?;
                    data.truncate(header::c_len(&data));
                    if typeflag == b'L' {
                        long_name = Some(data);
                    } else {
                        long_link = Some(data);
                    }
                    pos = past_data;
                    continue;
                }
                // A GNU volume label names the archive, not a member; the rest of a file
                // continued from another volume cannot stand alone. GNU tar extracts
                // neither and skips their data.
                b'V' | b'M' => {
                    if typeflag == b'M' {
                        let name = long_name.take().unwrap_or_else(|| h.path());
                        self.skipped.push(format!(
                            "{}: continued from another volume of a multi-volume archive",
                            String::from_utf8_lossy(&name)
                        ));
                    }
                    (long_name, long_link) = (None, None);
                    local.clear();
                    if data_start.saturating_add(size) > end {
                        return Err(Error::corrupt(format!(
                            "tar archive is truncated: the header at offset {pos} has {size} \
                             bytes of data, more than the archive holds"
                        )));
                    }
                    pos = past_data;
                    continue;
                }
                _ => {}
            }
            let (maj, min) = h.dev()?;
            let mut m = Member {
                path: long_name.take().unwrap_or_else(|| h.path()),
                link: long_link.take().unwrap_or_else(|| h.link_name()),
                typeflag,
                mode: h.mode()?,
                uid: h.uid()?,
                gid: h.gid()?,
                mtime: h.mtime()?,
                size,
                rdev: new_encode_dev(maj, min),
                ..Member::default()
            };
            let mut data_pos = data_start;
            if typeflag == b'S' {
                let (mut map, mut more) = h.gnu_sparse()?;
                while more {
                    // Each 512-byte extension block adds 21 entries: the map is bounded
                    // by the archive, not by a count.
                    if data_pos + BLOCK > end {
                        return Err(Error::corrupt("GNU sparse map is truncated"));
                    }
                    let ext = reader.block(data_pos)?;
                    let (m2, more2) = header::gnu_sparse_ext(&ext)?;
                    map.extend(m2);
                    more = more2;
                    data_pos += BLOCK;
                }
                m.sparse = Some(Sparse {
                    map,
                    map_in_data: false,
                });
            }
            self.apply_pax(&mut m, global.iter().chain(local.iter()))?;
            local.clear();
            // Old archives mark a directory by a trailing `/` on a file's name; GNU tar
            // and bsdtar read it so, with no data whatever its size field says.
            if matches!(m.typeflag, b'0' | 0 | b'7') && m.path.last() == Some(&b'/') {
                m.typeflag = b'5';
            }
            let stored = m.size;
            // Links, devices, FIFOs and directories have no data, whatever their size
            // field says: GNU tar and bsdtar read the next header right after theirs.
            let has_data = !matches!(m.typeflag, b'1'..=b'6');
            if has_data && stored > end.saturating_sub(data_pos) {
                // A stream being decoded does not know its end yet: `end` is not it.
                let ends = if end >= u64::MAX >> 1 {
                    "the archive is shorter".to_string()
                } else {
                    format!("the archive ends at {end}")
                };
                return Err(Error::corrupt(format!(
                    "tar archive is truncated: member {:?} needs {stored} bytes at offset \
                     {data_pos}, {ends}",
                    String::from_utf8_lossy(&m.path)
                )));
            }
            // Below `end`, which is below 2^63: no overflow.
            if has_data {
                self.data_end = self.data_end.max(data_pos + stored);
            }
            let next = if has_data {
                data_pos + stored.div_ceil(BLOCK) * BLOCK
            } else {
                data_pos
            };
            self.add_member(src, m, data_pos, stored, prefix, depth)?;
            pos = next;
        }
        if let Some(from) = damage {
            self.skipped.push(damaged(from, pos));
        }
        Ok(())
    }

    fn apply_pax<'r>(
        &mut self,
        m: &mut Member,
        records: impl Iterator<Item = &'r (Vec<u8>, Vec<u8>)>,
    ) -> Result<()> {
        let mut sparse_name = None;
        let mut sparse_major = None;
        let mut real_size = None;
        let mut map01 = None;
        let mut map00: Vec<u64> = Vec::new();
        for (k, v) in records {
            match k.as_slice() {
                b"path" => m.path = header::c_str(v).to_vec(),
                b"linkpath" => m.link = header::c_str(v).to_vec(),
                b"size" => m.size = header::pax_number(v).unwrap_or(m.size),
                b"uid" => m.uid = header::pax_number(v).unwrap_or(m.uid),
                b"gid" => m.gid = header::pax_number(v).unwrap_or(m.gid),
                b"mtime" => {
                    if let Some((s, ns)) = header::pax_time(v) {
                        m.mtime = s;
                        m.mtime_nsec = ns;
                    }
                }
                b"GNU.sparse.name" => sparse_name = Some(header::c_str(v).to_vec()),
                b"GNU.sparse.major" => sparse_major = header::pax_number(v),
                b"GNU.sparse.size" | b"GNU.sparse.realsize" => real_size = header::pax_number(v),
                b"GNU.sparse.map" => map01 = Some(v.clone()),
                b"GNU.sparse.offset" | b"GNU.sparse.numbytes" => {
                    map00.push(header::pax_number(v).unwrap_or(0))
                }
                k if k.starts_with(b"SCHILY.xattr.") => {
                    set_xattr(&mut m.xattrs, k[13..].to_vec(), v.clone());
                }
                k if k.starts_with(b"LIBARCHIVE.xattr.") => {
                    if let Some(val) = base64(v) {
                        set_xattr(&mut m.xattrs, percent_decode(&k[17..]), val);
                    }
                }
                _ => {}
            }
        }
        if let Some(name) = sparse_name {
            m.path = name;
        }
        // The real size marks a sparse member; its size is where its map ends.
        if real_size.is_some() {
            let mut sp = Sparse::default();
            if sparse_major == Some(1) {
                sp.map_in_data = true;
            } else if let Some(map) = map01 {
                let nums: Vec<u64> = map
                    .split(|&b| b == b',')
                    .map(|x| header::pax_number(x).unwrap_or(0))
                    .collect();
                sp.map = nums.chunks_exact(2).map(|c| (c[0], c[1])).collect();
            } else {
                sp.map = map00.chunks_exact(2).map(|c| (c[0], c[1])).collect();
            }
            m.sparse = Some(sp);
        }
        Ok(())
    }

    fn add_member(
        &mut self,
        src: &dyn Bytes,
        mut m: Member,
        data_pos: u64,
        stored: u64,
        prefix: &[Vec<u8>],
        depth: u32,
    ) -> Result<()> {
        let display = String::from_utf8_lossy(&m.path).into_owned();
        let Some(comps) = normalize(&m.path) else {
            self.skipped.push(format!("{display}: name contains `..`"));
            return Ok(());
        };
        let mut full: Vec<&[u8]> = prefix.iter().map(Vec::as_slice).collect();
        full.extend(comps.iter().copied());
        let kind = match m.typeflag {
            b'5' | b'D' => Kind::Dir,
            b'2' => Kind::Symlink,
            b'3' => Kind::CharDev,
            b'4' => Kind::BlockDev,
            b'6' => Kind::Fifo,
            b'1' => {
                // Hard link: resolved against the finished tree.
                let Some(target) = normalize(&m.link) else {
                    self.skipped
                        .push(format!("{display}: link target contains `..`"));
                    return Ok(());
                };
                if full.is_empty() {
                    return Ok(());
                }
                let mut t: Vec<&[u8]> = prefix.iter().map(Vec::as_slice).collect();
                t.extend(target);
                let parent = self.dir(&full[..full.len() - 1]);
                let name = full[full.len() - 1].to_vec();
                self.push_entry(parent, name, NONE, Some(t.join(&b'/')));
                return Ok(());
            }
            _ => Kind::File,
        };
        if full.is_empty() {
            // `./` itself: the root's attributes.
            if kind == Kind::Dir && prefix.is_empty() {
                let xattrs = self.intern_xattrs(std::mem::take(&mut m.xattrs));
                let root = &mut self.nodes[ROOT as usize];
                root.mode = (m.mode & 0o7777) as u16;
                root.uid = m.uid as u32;
                root.gid = m.gid as u32;
                root.mtime = m.mtime;
                root.mtime_nsec = m.mtime_nsec;
                root.xattrs = xattrs;
            }
            return Ok(());
        }
        // A nested tar shown as a directory.
        if self.opts.recursive
            && kind == Kind::File
            && m.sparse.is_none()
            && depth < MAX_DEPTH
            && full[full.len() - 1].len() > 4
            && full[full.len() - 1].ends_with(b".tar")
            && looks_like_tar(src, data_pos, stored)
        {
            let mut inner: Vec<Vec<u8>> = full.iter().map(|c| c.to_vec()).collect();
            if let Some(last) = inner.last_mut() {
                last.truncate(last.len() - 4);
            }
            self.member_dir(&inner, &m);
            return self.scan(src, data_pos, data_pos + stored, &inner, depth + 1);
        }
        // A compressed tar shown as a directory: read from a slice of the archive file,
        // so only in a plain archive (`members` is set for one, with `--recursive`).
        let compressed = match (&self.members, compressed_stem(&full)) {
            (Some(members), Some(stem))
                if self.body == 0
                    && kind == Kind::File
                    && m.sparse.is_none()
                    && depth < MAX_DEPTH =>
            {
                members.tar_in(data_pos, stored)?.map(|found| (found, stem))
            }
            _ => None,
        };
        if let Some((found, stem)) = compressed {
            let mut inner: Vec<Vec<u8>> = full.iter().map(|c| c.to_vec()).collect();
            *inner.last_mut().unwrap() = stem;
            self.member_dir(&inner, &m);
            return self
                .scan_compressed(found, &inner, depth + 1)
                .map_err(|e| Error::corrupt(format!("in the member {display}: {e}")));
        }
        let xattrs = self.intern_xattrs(std::mem::take(&mut m.xattrs));
        let mut node = Node {
            kind: kind_code(kind),
            mode: (m.mode & 0o7777) as u16,
            uid: m.uid as u32,
            gid: m.gid as u32,
            mtime: m.mtime,
            mtime_nsec: m.mtime_nsec,
            xattrs,
            ..Node::default()
        };
        match kind {
            Kind::Dir => {
                let n = self.dir(&full);
                self.nodes[n as usize] = node;
                // Re-adding the entry makes a later duplicate win over an earlier file.
                let parent = self.dir(&full[..full.len() - 1]);
                self.push_entry(parent, full[full.len() - 1].to_vec(), n, None);
                return Ok(());
            }
            Kind::Symlink => {
                // Linux has no mode of a symlink's own: every extractor shows 0777.
                node.mode = 0o777;
                node.data = self.links.len() as u64;
                node.aux = m.link.len() as u32;
                node.size = m.link.len() as u64;
                self.links.extend_from_slice(&m.link);
            }
            Kind::BlockDev | Kind::CharDev => node.rdev = m.rdev,
            Kind::File => match m.sparse.take() {
                Some(sp) => {
                    match self.sparse_file(src, &mut node, sp, data_pos, stored, &display) {
                        Ok(()) => {}
                        // A map that contradicts itself spoils this member, not the
                        // archive: its data's extent comes from the header.
                        Err(Error::Corrupt(why)) => {
                            self.skipped.push(format!("{display}: {why}"));
                            return Ok(());
                        }
                        Err(e) => return Err(e),
                    }
                }
                None => {
                    node.size = stored;
                    node.data = self.body | data_pos;
                }
            },
            _ => {}
        }
        let parent = self.dir(&full[..full.len() - 1]);
        let id = self.push_node(node);
        self.push_entry(parent, full[full.len() - 1].to_vec(), id, None);
        Ok(())
    }

    /// The directory an archive member is shown as, with the member's owner and times
    /// and its mode, with search permission wherever it is readable.
    fn member_dir(&mut self, path: &[Vec<u8>], m: &Member) {
        let comps: Vec<&[u8]> = path.iter().map(Vec::as_slice).collect();
        let node = self.dir(&comps);
        let n = &mut self.nodes[node as usize];
        n.mode = ((m.mode & 0o7777) | ((m.mode & 0o444) >> 2)) as u16;
        n.uid = m.uid as u32;
        n.gid = m.gid as u32;
        n.mtime = m.mtime;
        n.mtime_nsec = m.mtime_nsec;
    }

    /// Indexes a compressed tar inside the archive as a body of its own, decoding it
    /// once for its headers and entry points.
    fn scan_compressed(&mut self, found: Found, prefix: &[Vec<u8>], depth: u32) -> Result<()> {
        let read = self.member_read.clone();
        read.store(0, Ordering::Relaxed);
        let mut report = move |p| read.store(p, Ordering::Relaxed);
        let scan = Scan::new(
            &found.source,
            found.codec,
            found.spacing,
            found.limit,
            &mut report,
        )?;
        let id = self.bodies.len() as u64 + 1;
        if id >= 1 << (64 - BODY_SHIFT) {
            return Err(Error::Limit(
                "more compressed tars inside the archive than archfs can open".into(),
            ));
        }
        self.body = id << BODY_SHIFT;
        self.member_at = found.at;
        let outer_end = std::mem::take(&mut self.data_end);
        let points = self
            .scan(&scan, 0, u64::MAX >> 1, prefix, depth)
            .and_then(|()| scan.finish())
            .and_then(|p| self.check_within(p.len()).map(|()| p));
        self.body = 0;
        self.data_end = outer_end;
        self.bodies.push(Nested {
            at: found.at,
            len: found.source.len(),
            codec: found.codec,
            points: points?,
        });
        Ok(())
    }

    /// The compressed tars opened inside the archive, in body order (body 1 first).
    pub fn take_bodies(&mut self) -> Vec<Nested> {
        std::mem::take(&mut self.bodies)
    }

    fn sparse_file(
        &mut self,
        src: &dyn Bytes,
        node: &mut Node,
        mut sp: Sparse,
        mut data_pos: u64,
        mut stored: u64,
        display: &str,
    ) -> Result<()> {
        if sp.map_in_data {
            // PAX 1.0: decimal numbers, one per line: count, then offset/length pairs,
            // padded to a block boundary. GNU tar writes a line a region, so a file of a
            // million regions has a map of some 20 MiB: it is parsed a block at a time,
            // and bounded by the member's stored data, which holds it.
            let mut partial = Vec::new();
            let mut lines: Vec<u64> = Vec::new();
            let mut want = None;
            let mut off = data_pos;
            while want.is_none_or(|w| lines.len() < w) {
                if off + BLOCK > data_pos + stored {
                    return Err(Error::corrupt(format!(
                        "sparse map of {display} is truncated"
                    )));
                }
                partial.extend(src.read_vec(off, BLOCK as usize)?);
                off += BLOCK;
                let Some(p) = partial.iter().rposition(|&b| b == b'\n') else {
                    continue;
                };
                for l in partial[..p].split(|&b| b == b'\n') {
                    lines.push(
                        header::pax_number(l).ok_or_else(|| {
                            Error::corrupt(format!("bad sparse map in {display}"))
                        })?,
                    );
                }
                partial.drain(..=p);
                if let (None, Some(&count)) = (want, lines.first()) {
                    // Each pair takes at least four bytes ("0\n0\n") of the stored data:
                    // a larger count is a lie, not a reason to overflow.
                    if count > stored / 4 {
                        return Err(Error::corrupt(format!(
                            "sparse map of {display} claims {count} regions"
                        )));
                    }
                    want = Some(1 + 2 * count as usize);
                }
            }
            lines.truncate(want.unwrap_or(0));
            sp.map = lines[1..].chunks_exact(2).map(|c| (c[0], c[1])).collect();
            stored -= off - data_pos;
            data_pos = off;
        }
        let first = self.segments.len() as u64;
        let mut at = data_pos;
        let mut last_end = 0u64;
        for &(offset, len) in &sp.map {
            if offset.checked_add(len).is_none_or(|e| e > i64::MAX as u64) || offset < last_end {
                return Err(Error::corrupt(format!(
                    "sparse map of {display} is inconsistent"
                )));
            }
            last_end = offset + len;
            if len > 0 {
                self.segments.push(Segment {
                    offset,
                    len,
                    archive_off: self.body | at,
                });
            }
            at += len;
        }
        if at - data_pos > stored {
            return Err(Error::corrupt(format!(
                "sparse map of {display} describes more data than is stored"
            )));
        }
        node.flags |= SPARSE;
        // GNU tar makes the file as long as its map reaches (a writer ends a map on a hole
        // with an empty region at the file's end), whatever size the header claims: a
        // claim of 2^63 - 1 bytes over a 3-byte map gives 3 bytes, not a size that
        // cannot be read.
        node.size = last_end;
        node.data = first;
        node.aux = (self.segments.len() as u64 - first) as u32;
        Ok(())
    }

    fn intern_xattrs(&mut self, set: XattrSet) -> u32 {
        if set.is_empty() {
            return NONE;
        }
        self.xattrs.push(set);
        (self.xattrs.len() - 1) as u32
    }

    /// Resolves each hard link as `tar -x` makes it: to what its target names at that
    /// point of the archive, in archive order. So a link to a member given again later
    /// keeps the earlier one's data, a link to itself (as `tar -u` writes) or to what its
    /// name already is changes nothing, and a link to a member that comes later or is not
    /// there is left out (GNU tar and bsdtar fail to make it), its name keeping what it
    /// held; a link to a directory fails too, after the extractors removed the file its
    /// name held. `entries` are sorted by (parent, name, seq); each link gets the node
    /// its name holds from then on (`NONE`: nothing, `GONE`: removed).
    fn resolve_links(&mut self, entries: &mut [RawEntry]) {
        let mut links: Vec<usize> = (0..entries.len())
            .filter(|&i| entries[i].link.is_some())
            .collect();
        if links.is_empty() {
            return;
        }
        links.sort_by_key(|&i| entries[i].seq);
        // What (parent, name) held just before `seq`: the last version made before it,
        // links before it resolved already (one step: a million failed links to one
        // name cost no more than one).
        let before = |entries: &[RawEntry], parent: u32, name: &[u8], seq: u64| {
            let end = entries
                .partition_point(|e| (e.parent, e.name.as_slice(), e.seq) < (parent, name, seq));
            let e = entries[..end].last()?;
            (e.parent == parent && e.name == name).then_some(e.node)
        };
        let held = |node: Option<u32>| node.filter(|&n| n != NONE && n != GONE);
        for i in links {
            let (seq, target) = (entries[i].seq, entries[i].link.take().unwrap_or_default());
            let mut node = Some(ROOT);
            for c in target.split(|&b| b == b'/') {
                node = node
                    .filter(|&n| kind_of(self.nodes[n as usize].kind) == Kind::Dir)
                    .and_then(|dir| held(before(entries, dir, c, seq)));
            }
            let was = before(entries, entries[i].parent, &entries[i].name, seq);
            let shown = String::from_utf8_lossy(&target);
            let name = String::from_utf8_lossy(&entries[i].name).into_owned();
            entries[i].node = match node {
                Some(n) if kind_of(self.nodes[n as usize].kind) != Kind::Dir => n,
                // GNU tar counts a directory's link to itself as done.
                Some(_) if held(was) == node => node.unwrap_or(NONE),
                Some(_) => {
                    self.skipped
                        .push(format!("{name}: hard link to the directory {shown}"));
                    match held(was) {
                        Some(w) if kind_of(self.nodes[w as usize].kind) != Kind::Dir => GONE,
                        _ => was.unwrap_or(NONE),
                    }
                }
                None => {
                    self.skipped.push(format!(
                        "{name}: hard link to {shown}, which is not in the archive before it"
                    ));
                    was.unwrap_or(NONE)
                }
            };
        }
    }

    /// For a stream whose length was not known during the scan: every member's data
    /// must lie within its `len` bytes.
    pub fn check_within(&self, len: u64) -> Result<()> {
        if self.data_end > len {
            return Err(Error::corrupt(format!(
                "tar archive is truncated: its members reach {} bytes, it has {len}",
                self.data_end
            )));
        }
        Ok(())
    }

    /// Resolves hard links, keeps the last member of each name (a later one replaces an
    /// earlier, as `tar -x` does), sorts the entries and counts links.
    pub fn finish(mut self) -> Index {
        let mut entries = std::mem::take(&mut self.entries);
        entries.sort_by(|a, b| (a.parent, &a.name, a.seq).cmp(&(b.parent, &b.name, b.seq)));
        self.resolve_links(&mut entries);
        // Keep the last of each (parent, name): a later member replaces an earlier one.
        let mut kept: Vec<RawEntry> = Vec::with_capacity(entries.len());
        for e in entries {
            if let Some(last) = kept.last_mut() {
                if last.parent == e.parent && last.name == e.name {
                    *last = e;
                    continue;
                }
            }
            kept.push(e);
        }
        // Names that links removed or never made.
        kept.retain(|e| e.node != GONE && e.node != NONE);
        // Names end to end; children ranges; link counts.
        let mut names = Vec::new();
        let mut name_end = Vec::with_capacity(kept.len());
        let mut child = Vec::with_capacity(kept.len());
        let mut starts: Vec<(u32, u64, u32)> = Vec::new();
        for e in &kept {
            match starts.last_mut() {
                Some(s) if s.0 == e.parent => s.2 += 1,
                _ => starts.push((e.parent, child.len() as u64, 1)),
            }
            names.extend_from_slice(&e.name);
            name_end.push(names.len() as u64);
            child.push(u64::from(e.node));
        }
        drop(kept);
        for n in &mut self.nodes {
            if kind_of(n.kind) == Kind::Dir {
                (n.data, n.aux) = (0, 0);
            }
        }
        for (parent, start, count) in starts {
            let p = &mut self.nodes[parent as usize];
            p.data = start;
            p.aux = count;
        }
        Index::assemble(
            &mut self.nodes,
            Entries {
                names,
                name_end,
                child,
            },
            self.links,
            self.segments,
            self.xattrs,
            self.skipped,
        )
    }
}

/// A tree's directory entries, unpacked: names end to end, where each ends, the node
/// each names; each directory's a range of them (its node's `data` and `aux`).
pub(super) struct Entries {
    pub names: Vec<u8>,
    pub name_end: Vec<u64>,
    pub child: Vec<u64>,
}

impl Index {
    /// The index of `nodes` and their `entries`, link counts set from the tree.
    pub(super) fn assemble(
        nodes: &mut [Node],
        mut entries: Entries,
        mut links: Vec<u8>,
        mut segments: Vec<Segment>,
        xattrs: Vec<XattrSet>,
        skipped: Vec<String>,
    ) -> Index {
        let child = &entries.child;
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

fn set_xattr(set: &mut XattrSet, name: Vec<u8>, value: Vec<u8>) {
    match set.iter_mut().find(|(n, _)| *n == name) {
        Some(slot) => slot.1 = value,
        None => set.push((name, value)),
    }
}

fn percent_decode(s: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        if s[i] == b'%' && i + 2 < s.len() {
            let hex = std::str::from_utf8(&s[i + 1..i + 3]).unwrap_or("zz");
            if let Ok(b) = u8::from_str_radix(hex, 16) {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(s[i]);
        i += 1;
    }
    out
}

fn base64(s: &[u8]) -> Option<Vec<u8>> {
    let val = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    };
    let s: Vec<u8> = s
        .iter()
        .copied()
        .filter(|&c| c != b'=' && !c.is_ascii_whitespace())
        .collect();
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    for chunk in s.chunks(4) {
        let mut n = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            n |= val(c)? << (18 - 6 * i);
        }
        let bytes = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&bytes[..chunk.len().saturating_sub(1)]);
    }
    Some(out)
}

/// The log line for the blocks in `[from, to)` that were skipped for not being headers.
fn damaged(from: u64, to: u64) -> String {
    format!(
        "{} bytes at offset {from} where a tar header should be (a damaged header, or data \
         its size field left out), up to the next header, as tar -x does; \
         `tar -tvf` shows the place",
        to - from
    )
}

/// Whether a member's data starts with a valid tar header.
fn looks_like_tar(src: &dyn Bytes, pos: u64, len: u64) -> bool {
    if len < BLOCK {
        return false;
    }
    let mut raw = [0u8; 512];
    if src.read_exact_at(pos, &mut raw).is_err() {
        return false;
    }
    let h = Header::new(&raw);
    !h.is_zero() && h.checksum_ok()
}

/// Reads header blocks through a window that adapts to the members: where headers are
/// close together (small members) a 64 KiB read brings many at once, and the kernel is
/// asked to read ahead of the scan so that the disk works while headers are parsed;
/// where they are far apart (ImageNet's 110 KiB JPEGs) a 4 KiB read fetches one without
/// pulling in file data, so indexing reads little more than the headers themselves.
struct BlockReader<'a> {
    src: &'a dyn Bytes,
    buf: Vec<u8>,
    at: u64,
    /// Whether the last refill was a jump past the previous window.
    far: bool,
    /// Where the read-ahead asked for so far ends.
    advised: u64,
}

const WINDOW: u64 = 64 << 10;
const SMALL_WINDOW: u64 = 4 << 10;
/// Read-ahead of a dense scan. At 1.28 M tiny members (a 1.3 GB tar) the cold first index
/// took 4.5 s without it, against 1.6 s to stream the file and 1.8 s to index it warm.
const AHEAD: u64 = 16 << 20;

impl<'a> BlockReader<'a> {
    fn new(src: &'a dyn Bytes) -> Self {
        BlockReader {
            src,
            buf: Vec::new(),
            at: 0,
            far: false,
            advised: 0,
        }
    }

    fn block(&mut self, pos: u64) -> Result<[u8; 512]> {
        if pos < self.at || pos + BLOCK > self.at + self.buf.len() as u64 {
            let end = self.at + self.buf.len() as u64;
            self.far = pos > end + WINDOW;
            let window = if self.far { SMALL_WINDOW } else { WINDOW };
            let len = window
                .min(self.src.len_within(pos + window)?.saturating_sub(pos))
                .max(BLOCK);
            if !self.far && pos + AHEAD / 2 > self.advised {
                let from = self.advised.max(pos);
                self.src.will_need(from, AHEAD);
                self.advised = from + AHEAD;
            }
            self.buf = self.src.read_vec(pos, len as usize)?;
            self.at = pos;
        }
        let off = (pos - self.at) as usize;
        Ok(self.buf[off..off + 512].try_into().unwrap())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_normalised_and_dotdot_refused() {
        assert_eq!(
            normalize(b"./a//b/./c/").unwrap(),
            vec![&b"a"[..], b"b", b"c"]
        );
        assert_eq!(
            normalize(b"/etc/passwd").unwrap(),
            vec![&b"etc"[..], b"passwd"]
        );
        assert!(normalize(b"a/../../x").is_none());
        assert!(normalize(b"./").unwrap().is_empty());
    }

    #[test]
    fn base64_and_percent() {
        assert_eq!(base64(b"aGVsbG8=").unwrap(), b"hello");
        assert_eq!(base64(b"AAEC").unwrap(), vec![0, 1, 2]);
        assert_eq!(percent_decode(b"user.a%3Db"), b"user.a=b");
    }

    #[test]
    fn device_numbers_use_the_new_encoding() {
        assert_eq!(new_encode_dev(1, 3), 0x103);
        assert_eq!(
            new_encode_dev(7, 300),
            (300 & 0xff) | (7 << 8) | ((300 & !0xff) << 12)
        );
    }
}
