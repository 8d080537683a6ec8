//! The indexes of several tar archives merged into one, as if the archives were one tar
//! written one after another (WebDataset's shards): directories merge, and for any other
//! name the archive given last wins. The union is then served by one index, as one tar of
//! the same members is, instead of one index a shard and a map over them: a union of
//! 1,000 shards of 100 samples in per-class directories held 95,000 directories of its
//! members' own and a map of where each name is, 1.3x one tar's memory.

use std::collections::{HashMap, VecDeque};

use super::index::{kind_of, Dirents, Index, Node, Segment, XattrSet, NONE, ROOT, SPARSE};
use crate::archive::Kind;
use crate::error::{Error, Result};

/// A directory of the merged tree still to be filled: its node, and the same directory
/// in each member that has it (member, node), in member order.
struct Pending {
    node: u32,
    parts: Vec<(u32, u32)>,
}

/// Merges `members`, each an index and where its tar stream starts in the merged one's
/// offsets (its data offsets move up by that much; the caller maps them back to the
/// member's stream). Members must not hold compressed tars of their own (`--recursive`).
pub fn merge(members: &[(&Index, u64)]) -> Result<Index> {
    let total: usize = members.iter().map(|(ix, _)| ix.node_count()).sum();
    if total >= NONE as usize || members.len() >= NONE as usize {
        return Err(Error::Limit(
            "too many entries for one index: over 4 billion".into(),
        ));
    }
    let mut out = Out::default();
    let last_root = members
        .last()
        .map(|(ix, _)| ix.node(ROOT))
        .unwrap_or_default();
    out.nodes.push(Node::default());
    out.copy_attrs(
        members,
        members.len().saturating_sub(1) as u32,
        last_root,
        0,
    )?;
    // Each member directory is merged once: a damaged index whose directories loop would
    // otherwise be walked for ever.
    let mut seen: Vec<Vec<bool>> = members
        .iter()
        .map(|(ix, _)| vec![false; ix.node_count()])
        .collect();
    let mut queue = VecDeque::from([Pending {
        node: 0,
        parts: (0..members.len() as u32).map(|m| (m, ROOT)).collect(),
    }]);
    // (name, part, member entry) of every appearance in the directory being merged.
    let mut appearances: Vec<Appearance> = Vec::new();
    while let Some(dir) = queue.pop_front() {
        list_names(members, &dir, &mut seen, &mut appearances);
        out.fill_dir(members, &dir, &appearances, &mut queue)?;
    }
    Ok(out.finish())
}

/// A name in one of the members' directories being merged: the name, the part
/// ([`Pending::parts`]) it is in, and its entry in that member.
type Appearance<'m> = (&'m [u8], u32, u32);

/// The names of `dir`'s parts not merged before, into `out`: sorted by name, each
/// name's appearances in member order.
fn list_names<'m>(
    members: &[(&'m Index, u64)],
    dir: &Pending,
    seen: &mut [Vec<bool>],
    out: &mut Vec<Appearance<'m>>,
) {
    out.clear();
    for (p, &(m, d)) in dir.parts.iter().enumerate() {
        let visited = &mut seen[m as usize][d as usize];
        if std::mem::replace(visited, true) {
            continue;
        }
        let ix = members[m as usize].0;
        for i in ix.children(d) {
            out.push((ix.name(i), p as u32, i as u32));
        }
    }
    // Members' own listings are sorted and hold a name once. Shards of a dataset
    // written in key order come sorted already: the check is a pass, the sort of a root
    // of 2 M names ~0.5 s.
    let order = |a: &Appearance, b: &Appearance| a.0.cmp(b.0).then(a.1.cmp(&b.1));
    if dir.parts.len() > 1 && !out.is_sorted_by(|a, b| order(a, b).is_le()) {
        out.sort_unstable_by(order);
    }
}

/// The merged index as it is built, unpacked.
#[derive(Default)]
struct Out {
    nodes: Vec<Node>,
    names: Vec<u8>,
    name_end: Vec<u64>,
    child: Vec<u64>,
    links: Vec<u8>,
    segments: Vec<Segment>,
    xattrs: Vec<XattrSet>,
    xattr_ids: HashMap<XattrSet, u32>,
    /// Nodes of several names in a member (hard links), once each: (member, node) to
    /// the merged node.
    linked: HashMap<(u32, u32), u32>,
}

impl Out {
    /// Makes merged directory `dir` the entries of its sorted `names`: the last
    /// appearance of a name decides what it is, and a directory's appearances become
    /// the parts of a merged directory, queued to be filled in turn.
    fn fill_dir(
        &mut self,
        members: &[(&Index, u64)],
        dir: &Pending,
        names: &[Appearance],
        queue: &mut VecDeque<Pending>,
    ) -> Result<()> {
        let first = self.child.len() as u64;
        for group in names.chunk_by(|a, b| a.0 == b.0) {
            let &(name, p, i) = group.last().expect("a group is never empty");
            let (m, _) = dir.parts[p as usize];
            let ix = members[m as usize].0;
            let id = ix.child(i as usize);
            let node = ix.node(id);
            let child = if kind_of(node.kind) == Kind::Dir {
                let parts = group
                    .iter()
                    .filter_map(|&(_, p, i)| {
                        let (m, _) = dir.parts[p as usize];
                        let c = members[m as usize].0.child(i as usize);
                        (kind_of(members[m as usize].0.kind(c)) == Kind::Dir).then_some((m, c))
                    })
                    .collect();
                let n = self.nodes.len() as u32;
                self.nodes.push(Node::default());
                self.copy_attrs(members, m, node, n)?;
                queue.push_back(Pending { node: n, parts });
                n
            } else {
                self.copy(members, m, id, node)?
            };
            self.names.extend_from_slice(name);
            self.name_end.push(self.names.len() as u64);
            self.child.push(u64::from(child));
        }
        let d = &mut self.nodes[dir.node as usize];
        d.data = first;
        d.aux = (self.child.len() as u64 - first) as u32;
        Ok(())
    }

    /// A copy of member `m`'s node `id` (`node`, unpacked), or the copy made already of
    /// a node with more than one name.
    fn copy(&mut self, members: &[(&Index, u64)], m: u32, id: u32, node: Node) -> Result<u32> {
        if node.nlink > 1 {
            if let Some(&n) = self.linked.get(&(m, id)) {
                return Ok(n);
            }
        }
        let n = self.nodes.len() as u32;
        self.nodes.push(Node::default());
        self.copy_attrs(members, m, node, n)?;
        if node.nlink > 1 {
            self.linked.insert((m, id), n);
        }
        Ok(n)
    }

    /// Member `m`'s `node` as merged node `n`: its data where the merged index finds it.
    fn copy_attrs(&mut self, members: &[(&Index, u64)], m: u32, node: Node, n: u32) -> Result<()> {
        let Some(&(ix, base)) = members.get(m as usize) else {
            return Ok(());
        };
        let moved = |at: u64| {
            at.checked_add(base)
                .ok_or_else(|| Error::corrupt("a member's data lies past 2^64"))
        };
        let mut to = node;
        to.xattrs = match node.xattrs {
            NONE => NONE,
            i => {
                let set = ix.xattr_set(i).cloned().unwrap_or_default();
                let next = self.xattrs.len() as u32;
                let id = *self.xattr_ids.entry(set.clone()).or_insert(next);
                if id == next {
                    self.xattrs.push(set);
                }
                id
            }
        };
        match kind_of(node.kind) {
            Kind::Dir => (to.data, to.aux) = (0, 0),
            Kind::Symlink => {
                to.data = self.links.len() as u64;
                self.links.extend_from_slice(ix.symlink_target(&node));
            }
            Kind::File if node.flags & SPARSE != 0 => {
                to.data = self.segments.len() as u64;
                for s in ix.sparse_map(&node) {
                    self.segments.push(Segment {
                        archive_off: moved(s.archive_off)?,
                        ..*s
                    });
                }
            }
            Kind::File => to.data = moved(node.data)?,
            _ => {}
        }
        self.nodes[n as usize] = to;
        Ok(())
    }

    fn finish(mut self) -> Index {
        Index::assemble(
            &mut self.nodes,
            Dirents {
                names: self.names,
                name_end: self.name_end,
                child: self.child,
            },
            self.links,
            self.segments,
            self.xattrs,
            Vec::new(),
        )
    }
}
