//! The indexes of several tar archives merged into one, as if the archives were one tar
//! written one after another (WebDataset's shards): directories merge, and for any other
//! name the archive given last wins. The union is then served by one index, as one tar of
//! the same members is, instead of one index a shard and a map over them: a union of
//! 1,000 shards of 100 samples in per-class directories held 95,000 directories of its
//! members' own and a map of where each name is, 1.3x one tar's memory.

use std::collections::{HashMap, VecDeque};

use super::index::{kind_of, Entries, Index, Node, Segment, XattrSet, NONE, ROOT, SPARSE};
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
    let mut seen_names: Vec<(&[u8], u32, u32)> = Vec::new();
    while let Some(dir) = queue.pop_front() {
        seen_names.clear();
        for (p, &(m, d)) in dir.parts.iter().enumerate() {
            let visited = &mut seen[m as usize][d as usize];
            if std::mem::replace(visited, true) {
                continue;
            }
            let ix = members[m as usize].0;
            for i in ix.children(d) {
                seen_names.push((ix.name(i), p as u32, i as u32));
            }
        }
        // Sorted by name, each name's appearances in member order (members' own
        // listings are sorted and hold a name once). Shards of a dataset written in key
        // order come sorted already: the check is a pass, the sort of a root of 2 M
        // names ~0.5 s.
        let order = |a: &(&[u8], u32, u32), b: &(&[u8], u32, u32)| a.0.cmp(b.0).then(a.1.cmp(&b.1));
        if dir.parts.len() > 1 && !seen_names.is_sorted_by(|a, b| order(a, b).is_le()) {
            seen_names.sort_unstable_by(order);
        }
        let first = out.child.len() as u64;
        let mut k = 0;
        while k < seen_names.len() {
            let name = seen_names[k].0;
            let mut end = k + 1;
            while end < seen_names.len() && seen_names[end].0 == name {
                end += 1;
            }
            let group = &seen_names[k..end];
            k = end;
            // The last appearance decides what the name is.
            let &(_, p, i) = group.last().expect("a group is never empty");
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
                let n = out.nodes.len() as u32;
                out.nodes.push(Node::default());
                out.copy_attrs(members, m, node, n)?;
                queue.push_back(Pending { node: n, parts });
                n
            } else {
                out.copy(members, m, id, node)?
            };
            out.names.extend_from_slice(name);
            out.name_end.push(out.names.len() as u64);
            out.child.push(u64::from(child));
        }
        let d = &mut out.nodes[dir.node as usize];
        d.data = first;
        d.aux = (out.child.len() as u64 - first) as u32;
    }
    Ok(out.finish())
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
            Entries {
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
