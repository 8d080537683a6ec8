//! The index builder: walks a tar stream's entries ([`super::entries`]) once, collecting
//! each member as a node and a name in its directory, then sorts the names into the
//! packed [`Index`] the way `tar -x` leaves the tree: a later member of a name replaces
//! an earlier one, hard links resolve in archive order, directories the archive only
//! implies are made.

use std::collections::HashMap;

use super::entries::{self, Entries, Entry, Sparse};
use super::index::{
    kind_code, kind_of, Dirents, Index, Node, Segment, XattrSet, NONE, ROOT, SPARSE,
};
use super::nested::{Found, Inside, Nested, Nesting, Opener};

use crate::archive::Kind;
use crate::compressed::{Bytes, Scan};
use crate::error::{Error, Result};

/// An entry that removes what its name held (a hard link to a directory, which
/// extractors fail to make after removing the file in its way).
const GONE: u32 = u32::MAX - 1;

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

/// A name as the archive gives it, before the names are sorted into directories.
struct Dirent {
    parent: u32,
    name: Vec<u8>,
    node: u32,
    /// Archive order.
    seq: u64,
    /// A hard link: resolved against the finished tree.
    link: Option<Vec<u8>>,
}

/// Collects members as the headers are read, then sorts them into an [`Index`].
pub struct Builder<'a> {
    opts: BuildOptions,
    /// The tars inside the archive (`--recursive`), and which stream is being scanned.
    nesting: Nesting,
    nodes: Vec<Node>,
    entries: Vec<Dirent>,
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

impl<'a> Builder<'a> {
    /// `opener`: how compressed tars inside a plain archive are opened with
    /// `--recursive` (they are read from slices of its file).
    pub fn new(
        opts: BuildOptions,
        opener: Option<Opener>,
        progress: &'a mut dyn FnMut(u64),
    ) -> Self {
        let mut dirs = HashMap::new();
        dirs.insert(Vec::new(), ROOT);
        Builder {
            nodes: vec![implied_dir(&opts)],
            nesting: Nesting::new(opts.recursive, opener),
            opts,
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
        let mut entries = Entries::new(src, start, end);
        while let Some(e) = entries.next() {
            self.skipped.append(&mut entries.notes);
            let e = e?;
            (self.progress)(self.nesting.progress_at(e.at));
            if e.has_data() {
                self.data_end = self.data_end.max(e.data + e.size);
            }
            self.add_member(src, e, prefix, depth)?;
        }
        self.skipped.append(&mut entries.notes);
        Ok(())
    }

    /// Adds member `e` of the tar placed under `prefix`, `depth` tars deep.
    fn add_member(
        &mut self,
        src: &dyn Bytes,
        mut e: Entry,
        prefix: &[Vec<u8>],
        depth: u32,
    ) -> Result<()> {
        let path = std::mem::take(&mut e.path);
        let display = String::from_utf8_lossy(&path).into_owned();
        let Some(comps) = normalize(&path) else {
            self.skipped.push(format!("{display}: name contains `..`"));
            return Ok(());
        };
        let mut full: Vec<&[u8]> = prefix.iter().map(Vec::as_slice).collect();
        full.extend(comps.iter().copied());
        let kind = match e.typeflag {
            b'5' | b'D' => Kind::Dir,
            b'2' => Kind::Symlink,
            b'3' => Kind::CharDev,
            b'4' => Kind::BlockDev,
            b'6' => Kind::Fifo,
            b'1' => return self.add_hard_link(&e.link, prefix, &full, &display),
            _ => Kind::File,
        };
        if full.is_empty() {
            // `./` itself: the root's attributes.
            if kind == Kind::Dir && prefix.is_empty() {
                self.set_root(e);
            }
            return Ok(());
        }
        if let Some(inside) = self.nesting.inside(src, kind, &e, &full, depth)? {
            return self.scan_inside(src, inside, &e, depth, &display);
        }
        self.add_node(src, kind, e, &full, &display)
    }

    /// A hard link at `full` to `link` (in the tar placed under `prefix`): resolved
    /// against the finished tree ([`Builder::resolve_links`]).
    fn add_hard_link(
        &mut self,
        link: &[u8],
        prefix: &[Vec<u8>],
        full: &[&[u8]],
        display: &str,
    ) -> Result<()> {
        let Some(target) = normalize(link) else {
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
        Ok(())
    }

    /// The archive's entry for `./` gives the root its attributes.
    fn set_root(&mut self, mut e: Entry) {
        let xattrs = self.intern_xattrs(std::mem::take(&mut e.xattrs));
        let root = &mut self.nodes[ROOT as usize];
        root.mode = (e.mode & 0o7777) as u16;
        root.uid = e.uid as u32;
        root.gid = e.gid as u32;
        root.mtime = e.mtime;
        root.mtime_nsec = e.mtime_nsec;
        root.xattrs = xattrs;
    }

    /// Adds member `e` at `full` as a node of `kind` with a name in its directory.
    fn add_node(
        &mut self,
        src: &dyn Bytes,
        kind: Kind,
        mut e: Entry,
        full: &[&[u8]],
        display: &str,
    ) -> Result<()> {
        let xattrs = self.intern_xattrs(std::mem::take(&mut e.xattrs));
        let mut node = Node {
            kind: kind_code(kind),
            mode: (e.mode & 0o7777) as u16,
            uid: e.uid as u32,
            gid: e.gid as u32,
            mtime: e.mtime,
            mtime_nsec: e.mtime_nsec,
            xattrs,
            ..Node::default()
        };
        match kind {
            Kind::Dir => {
                let n = self.dir(full);
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
                node.aux = e.link.len() as u32;
                node.size = e.link.len() as u64;
                self.links.extend_from_slice(&e.link);
            }
            Kind::BlockDev | Kind::CharDev => node.rdev = e.rdev,
            Kind::File => match e.sparse.take() {
                Some(sp) => match self.sparse_file(src, &mut node, sp, e.data, e.size, display) {
                    Ok(()) => {}
                    // A map that contradicts itself spoils this member, not the
                    // archive: its data's extent comes from the header.
                    Err(Error::Corrupt(why)) => {
                        self.skipped.push(format!("{display}: {why}"));
                        return Ok(());
                    }
                    Err(e) => return Err(e),
                },
                None => {
                    node.size = e.size;
                    node.data = self.nesting.body | e.data;
                }
            },
            _ => {}
        }
        let parent = self.dir(&full[..full.len() - 1]);
        let id = self.push_node(node);
        self.push_entry(parent, full[full.len() - 1].to_vec(), id, None);
        Ok(())
    }

    /// The directory node for `path`, creating it and any parents the archive only implies.
    fn dir(&mut self, comps: &[&[u8]]) -> u32 {
        let key = comps.join(&b'/');
        if let Some(&n) = self.dirs.get(&key) {
            return n;
        }
        let parent = self.dir(&comps[..comps.len() - 1]);
        let node = self.push_node(implied_dir(&self.opts));
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
        self.entries.push(Dirent {
            parent,
            name,
            node,
            seq: self.seq,
            link,
        });
    }

    fn intern_xattrs(&mut self, set: XattrSet) -> u32 {
        if set.is_empty() {
            return NONE;
        }
        self.xattrs.push(set);
        (self.xattrs.len() - 1) as u32
    }

    /// Member `e`, a tar, shown as the directory `inside` names and filled with its
    /// members.
    fn scan_inside(
        &mut self,
        src: &dyn Bytes,
        inside: Inside,
        e: &Entry,
        depth: u32,
        display: &str,
    ) -> Result<()> {
        match inside {
            Inside::Plain(dir) => {
                self.member_dir(&dir, e);
                self.scan(src, e.data, e.data + e.size, &dir, depth + 1)
            }
            Inside::Compressed(dir, found) => {
                self.member_dir(&dir, e);
                self.scan_compressed(found, &dir, depth + 1)
                    .map_err(|e| Error::corrupt(format!("in the member {display}: {e}")))
            }
        }
    }

    /// The directory an archive member is shown as, with the member's owner and times
    /// and its mode, with search permission wherever it is readable.
    fn member_dir(&mut self, path: &[Vec<u8>], e: &Entry) {
        let comps: Vec<&[u8]> = path.iter().map(Vec::as_slice).collect();
        let node = self.dir(&comps);
        let n = &mut self.nodes[node as usize];
        n.mode = ((e.mode & 0o7777) | ((e.mode & 0o444) >> 2)) as u16;
        n.uid = e.uid as u32;
        n.gid = e.gid as u32;
        n.mtime = e.mtime;
        n.mtime_nsec = e.mtime_nsec;
    }

    /// Indexes a compressed tar inside the archive as a body of its own, decoding it
    /// once for its headers and entry points.
    fn scan_compressed(&mut self, found: Found, prefix: &[Vec<u8>], depth: u32) -> Result<()> {
        let mut report = self.nesting.reporter();
        let scan = Scan::new(
            &found.source,
            found.codec,
            found.spacing,
            found.limit,
            &mut report,
        )?;
        self.nesting.enter(&found)?;
        let outer_end = std::mem::take(&mut self.data_end);
        let points = self
            .scan(&scan, 0, u64::MAX >> 1, prefix, depth)
            .and_then(|()| scan.finish())
            .and_then(|p| self.check_within(p.len()).map(|()| p));
        self.data_end = outer_end;
        self.nesting.leave(&found, points)
    }

    /// The compressed tars opened inside the archive, in body order (body 1 first).
    pub fn take_bodies(&mut self) -> Vec<Nested> {
        self.nesting.take_bodies()
    }

    /// Makes `node` the sparse file `sp` maps, its `stored` bytes at `data_pos`.
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
            let off;
            (sp.map, off) = entries::map_in_data(src, data_pos, stored, display)?;
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
                    archive_off: self.nesting.body | at,
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

    /// Resolves each hard link as `tar -x` makes it: to what its target names at that
    /// point of the archive, in archive order. So a link to a member given again later
    /// keeps the earlier one's data, a link to itself (as `tar -u` writes) or to what its
    /// name already is changes nothing, and a link to a member that comes later or is not
    /// there is left out (GNU tar and bsdtar fail to make it), its name keeping what it
    /// held; a link to a directory fails too, after the extractors removed the file its
    /// name held. `entries` are sorted by (parent, name, seq); each link gets the node
    /// its name holds from then on (`NONE`: nothing, `GONE`: removed).
    fn resolve_links(&mut self, entries: &mut [Dirent]) {
        let mut links: Vec<usize> = (0..entries.len())
            .filter(|&i| entries[i].link.is_some())
            .collect();
        if links.is_empty() {
            return;
        }
        links.sort_by_key(|&i| entries[i].seq);
        for i in links {
            let (seq, target) = (entries[i].seq, entries[i].link.take().unwrap_or_default());
            let node = self.link_target(entries, &target, seq);
            let was = held_before(entries, entries[i].parent, &entries[i].name, seq);
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

    /// The node the path `target` names just before `seq`, walked from the root.
    fn link_target(&self, entries: &[Dirent], target: &[u8], seq: u64) -> Option<u32> {
        let mut node = Some(ROOT);
        for c in target.split(|&b| b == b'/') {
            node = node
                .filter(|&n| kind_of(self.nodes[n as usize].kind) == Kind::Dir)
                .and_then(|dir| held(held_before(entries, dir, c, seq)));
        }
        node
    }

    /// Resolves hard links, keeps the last member of each name (a later one replaces an
    /// earlier, as `tar -x` does), sorts the entries and counts links.
    pub fn finish(mut self) -> Index {
        let mut entries = std::mem::take(&mut self.entries);
        entries.sort_by(|a, b| (a.parent, &a.name, a.seq).cmp(&(b.parent, &b.name, b.seq)));
        self.resolve_links(&mut entries);
        let kept = last_of_each_name(entries);
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
            Dirents {
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

/// A directory the archive only implies (and the root before `./` says otherwise).
fn implied_dir(opts: &BuildOptions) -> Node {
    Node {
        kind: kind_code(Kind::Dir),
        mode: 0o755,
        uid: opts.implied_uid,
        gid: opts.implied_gid,
        mtime: opts.implied_mtime,
        xattrs: NONE,
        ..Node::default()
    }
}

/// What (parent, name) held just before `seq` in `entries` (sorted by parent, name,
/// seq): the last version made before it, links before it resolved already (one step: a
/// million failed links to one name cost no more than one).
fn held_before(entries: &[Dirent], parent: u32, name: &[u8], seq: u64) -> Option<u32> {
    let end =
        entries.partition_point(|e| (e.parent, e.name.as_slice(), e.seq) < (parent, name, seq));
    let e = entries[..end].last()?;
    (e.parent == parent && e.name == name).then_some(e.node)
}

/// A node, if `node` is one (not nothing, not removed).
fn held(node: Option<u32>) -> Option<u32> {
    node.filter(|&n| n != NONE && n != GONE)
}

/// The last of each (parent, name) of sorted `entries` (a later member replaces an
/// earlier one), without the names that links removed or never made.
fn last_of_each_name(entries: Vec<Dirent>) -> Vec<Dirent> {
    let mut kept: Vec<Dirent> = Vec::with_capacity(entries.len());
    for e in entries {
        if let Some(last) = kept.last_mut() {
            if last.parent == e.parent && last.name == e.name {
                *last = e;
                continue;
            }
        }
        kept.push(e);
    }
    kept.retain(|e| e.node != GONE && e.node != NONE);
    kept
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
}
