//! Tar archives served as one, as if written one after another (WebDataset's shards):
//! one index merged from the members' ([`super::merge`]), saved once beside the first
//! member, so a remount loads one index as one tar's does and never the members' (a
//! merge holds the members' indexes and its own at once: 45 MB at the peak for 1,000
//! shards of 200 entries, against 12 MB for one tar's remount).

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::index::Index;
use super::persist::{self, Identity, Rejected, SavedCompression, Under};
use super::{merge, Body, Decoding, TarArchive};
use crate::compressed::Decoded;
use crate::error::{Error, Result};
use crate::source::Source;
use crate::sync::RwLock;

/// Where the merged index of the union of `members` (local files) is kept: beside the
/// first, named by all of them, or in the cache directory.
pub fn union_index_path(members: &[PathBuf]) -> PathBuf {
    let mut crc = crc32fast::Hasher::new();
    for m in members {
        let canon = std::fs::canonicalize(m).unwrap_or_else(|_| m.clone());
        crc.update(canon.as_os_str().as_bytes());
        crc.update(&[0]);
    }
    let name = members[0].with_file_name(format!(".archfs-union-{:08x}", crc.finalize()));
    persist::default_path(&name, true)
}

/// What [`TarArchive::union`] made of its members.
pub enum Merged {
    /// One tar archive over the merged index.
    One(Box<TarArchive>),
    /// The members, given back unmerged: one holds compressed tars of its own
    /// (`--recursive`), or all of them hold over 4 billion entries.
    Apart(Vec<TarArchive>),
}

impl TarArchive {
    /// Tar archives served as one: directories merge, and for any other name the archive
    /// given last wins; the members come back [`Merged::Apart`] where they cannot be
    /// merged. With `save`, the merged index is kept there for the next mount.
    pub fn union(
        mut members: Vec<TarArchive>,
        recursive: bool,
        save: Option<&Path>,
    ) -> Result<Merged> {
        if members.is_empty()
            || members
                .iter()
                .any(|m| !m.nested.is_empty() || !m.starts.is_empty())
        {
            return Ok(Merged::Apart(members));
        }
        let starts = starts_of(members.iter().map(|m| &m.body))?;
        let indexes: Vec<Index> = members
            .iter_mut()
            .map(|m| std::mem::take(&mut m.index))
            .collect();
        let parts: Vec<(&Index, u64)> = indexes.iter().zip(starts.iter().copied()).collect();
        let merged = merge::merge(&parts);
        drop(parts);
        let mut index = match merged {
            Ok(index) => index,
            Err(Error::Limit(_)) => {
                for (m, ix) in members.iter_mut().zip(indexes) {
                    m.index = ix;
                }
                return Ok(Merged::Apart(members));
            }
            Err(e) => return Err(e),
        };
        // Each member said what it left out when it was indexed; the union keeps it for
        // `archfs check` and its next mount, by member.
        index.skipped = members
            .iter()
            .zip(&indexes)
            .flat_map(|(m, ix)| {
                let name = m.body.source().path().display().to_string();
                ix.skipped.iter().map(move |s| format!("{name}: {s}"))
            })
            .collect();
        drop(indexes);
        if let Some(path) = save {
            if let Err(e) = persist::save_union(path, &index, &members, recursive) {
                tracing::warn!("cannot save the union's index to {}: {e}", path.display());
            }
        }
        let mut bodies: Vec<Body> = Vec::with_capacity(members.len());
        bodies.extend(members.into_iter().map(|m| m.body));
        let body = bodies.remove(0);
        Ok(Merged::One(Box::new(TarArchive {
            body,
            nested: bodies,
            index,
            hashed: RwLock::default(),
            starts,
        })))
    }

    /// The union of the tar archives `files` from the merged index saved at `path`, when
    /// it matches every one of them as they are now; `None` otherwise (nothing is said:
    /// the members are then opened one by one and the index built again).
    pub fn union_from_saved(
        files: &[PathBuf],
        path: &Path,
        recursive: bool,
        how: &Decoding,
    ) -> Option<TarArchive> {
        if !path.exists() {
            return None;
        }
        let sources = open_sources(files)?;
        let first = &sources[0];
        let id = Identity::of(first, recursive);
        let loaded = persist::load(path, &id, first, |extra| {
            let members = persist::decode_union_members(extra, sources.len())?;
            // Offsets are checked against the members' streams once those are known.
            Some((members, vec![u64::MAX >> 16]))
        });
        let (index, members) = match loaded {
            Ok(loaded) => loaded,
            Err(Rejected::Missing) => return None,
            Err(why) => {
                tracing::info!(
                    "the union's saved index {} is {why:?}; rebuilding it",
                    path.display()
                );
                return None;
            }
        };
        let mut bodies = member_bodies(sources, members, recursive, how)?;
        let starts = starts_of(bodies.iter()).ok()?;
        let end = bodies.last().map(|b| b.len()).unwrap_or(0) + starts.last().copied().unwrap_or(0);
        if !persist::offsets_within(&index, end) {
            return None;
        }
        tracing::info!("using the union's saved index {}", path.display());
        super::say_left_out(None, &index.skipped);
        let body = bodies.remove(0);
        Some(TarArchive {
            body,
            nested: bodies,
            index,
            hashed: RwLock::default(),
            starts,
        })
    }
}

/// The members' streams as the union's saved index describes them (`members`: each
/// one's identity and what lies under its tar stream); `None` if one changed since.
fn member_bodies(
    sources: Vec<Arc<Source>>,
    members: Vec<(Identity, Vec<u8>)>,
    recursive: bool,
    how: &Decoding,
) -> Option<Vec<Body>> {
    let mut bodies = Vec::with_capacity(sources.len());
    for (source, (saved, under)) in sources.into_iter().zip(members) {
        if !Identity::of(&source, recursive).matches(&saved, &source) {
            tracing::info!(
                "{} changed since the union's index was saved; rebuilding it",
                source.path().display()
            );
            return None;
        }
        // The member is as it was saved: its compression is known without reading it.
        let codec = match Under::compression(&under) {
            SavedCompression::Plain => None,
            SavedCompression::Compressed(c) => Some(c),
            SavedCompression::Unreadable => return None,
        };
        let len = source.len();
        let (points, nested) = Under::decode(&under, codec, len)?;
        if !nested.is_empty() {
            return None;
        }
        bodies.push(match (codec, points) {
            (Some(codec), Some(points)) => Body::Decoded(Box::new(
                Decoded::new(
                    source,
                    codec,
                    points,
                    &how.stream_cache,
                    how.stage_dir.as_deref(),
                )
                .ok()?,
            )),
            (None, None) => Body::Plain(source),
            _ => return None,
        });
    }
    Some(bodies)
}

/// Where each member's stream starts in the merged index's data offsets: one after
/// another, each from a 512-byte boundary so offsets stay in blocks.
fn starts_of<'a>(bodies: impl Iterator<Item = &'a Body>) -> Result<Vec<u64>> {
    let mut starts = Vec::new();
    let mut end = 0u64;
    for b in bodies {
        starts.push(end);
        end = end
            .checked_add(b.len().next_multiple_of(512))
            .ok_or_else(|| Error::Limit("the archives hold over 2^64 bytes".into()))?;
    }
    Ok(starts)
}

/// The members' files, opened (16 at a time: 10,000 cold opens one after another take
/// seconds) and not read: a remount of 10,000 shards read the first block of each to
/// tell its format, 10,000 reads across the disk, where the saved index says it.
/// `None` if one cannot be opened.
fn open_sources(files: &[PathBuf]) -> Option<Vec<Arc<Source>>> {
    const AT_ONCE: usize = 16;
    let chunk = files.len().div_ceil(AT_ONCE).max(1);
    let opened: Vec<Option<Vec<Arc<Source>>>> = std::thread::scope(|s| {
        let handles: Vec<_> = files
            .chunks(chunk)
            .map(|part| {
                s.spawn(move || {
                    part.iter()
                        .map(|f| Source::open(f).ok().map(Arc::new))
                        .collect::<Option<Vec<_>>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().ok().flatten())
            .collect()
    });
    let all: Vec<_> = opened.into_iter().collect::<Option<Vec<_>>>()?;
    Some(all.into_iter().flatten().collect())
}
