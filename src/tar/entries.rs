//! The members of a tar stream, one [`Entry`] each: the headers that only extend the next
//! one (GNU long names and links, PAX `x` and global `g` records, Solaris' and star's
//! `X`, old GNU sparse extension blocks) are folded into the entry they describe, and
//! what a reader skips (volume labels, damaged blocks) is skipped here with a note of
//! it, so the index builder sees members only. A member whose sparse map is at the start
//! of its data (PAX 1.0) has its map read by [`map_in_data`] when it is indexed.

use super::blocks::BlockReader;
use super::header::{self, Header, SparseMap, BLOCK};
use super::index::XattrSet;

use crate::compressed::Bytes;
use crate::error::{Error, Result};

/// A member's attributes gathered from its header and any PAX/GNU extensions.
#[derive(Default)]
pub(super) struct Entry {
    pub path: Vec<u8>,
    pub link: Vec<u8>,
    pub typeflag: u8,
    pub mode: u32,
    pub uid: u64,
    pub gid: u64,
    pub mtime: i64,
    pub mtime_nsec: u32,
    /// Bytes stored in the archive for it (a PAX `size` overrides the header's).
    pub size: u64,
    pub rdev: u32,
    pub xattrs: XattrSet,
    pub sparse: Option<Sparse>,
    /// Where its data starts: after its header and any old GNU sparse extension blocks.
    pub data: u64,
    /// Where its own header is (the last of those describing it).
    pub at: u64,
}

impl Entry {
    /// Links, devices, FIFOs and directories have no data, whatever their size field
    /// says: GNU tar and bsdtar read the next header right after theirs.
    pub fn has_data(&self) -> bool {
        !matches!(self.typeflag, b'1'..=b'6')
    }
}

/// A sparse member's map of where its data runs are.
#[derive(Default)]
pub(super) struct Sparse {
    pub map: SparseMap,
    /// PAX 1.0 keeps the map at the start of the data.
    pub map_in_data: bool,
}

/// The members of the tar stored at `[start, end)` of a source, in archive order. After
/// an error it yields nothing more.
pub(super) struct Entries<'s> {
    src: &'s dyn Bytes,
    reader: BlockReader<'s>,
    start: u64,
    end: u64,
    /// The next header's offset.
    pos: u64,
    global: Vec<(Vec<u8>, Vec<u8>)>,
    local: Vec<(Vec<u8>, Vec<u8>)>,
    long_name: Option<Vec<u8>>,
    long_link: Option<Vec<u8>>,
    /// Where blocks that are not headers began, where one was expected: GNU tar and
    /// bsdtar skip them to the next header ("Skipping to next header").
    damage: Option<u64>,
    done: bool,
    /// What was left out on the way, for the log and `archfs check`: the caller takes
    /// them after each entry, so they keep their place among its own.
    pub notes: Vec<String>,
}

impl<'s> Entries<'s> {
    pub fn new(src: &'s dyn Bytes, start: u64, end: u64) -> Entries<'s> {
        Entries {
            src,
            reader: BlockReader::new(src),
            start,
            end,
            pos: start,
            global: Vec::new(),
            local: Vec::new(),
            long_name: None,
            long_link: None,
            damage: None,
            done: false,
            notes: Vec::new(),
        }
    }

    /// The next member, or `None` at the end of the archive (end-of-archive blocks, or
    /// the end of the stream where a header would start).
    fn read_entry(&mut self) -> Result<Option<Entry>> {
        loop {
            let pos = self.pos;
            // A stream being decoded learns its length only at its end.
            let end = self.end.min(self.src.len_within(pos + BLOCK)?);
            if pos + BLOCK > end {
                if pos == end || self.damage.is_some() {
                    return Ok(None); // no end-of-archive blocks: accepted, like GNU tar
                }
                return Err(Error::corrupt(format!(
                    "tar archive is truncated: it ends at offset {end}, before the header \
                     expected at {pos}"
                )));
            }
            let raw = self.reader.block(pos)?;
            let h = Header::new(&raw);
            if h.is_zero() {
                return Ok(None);
            }
            if !h.checksum_ok() {
                self.not_a_header(pos)?;
                continue;
            }
            if let Some(from) = self.damage.take() {
                self.notes.push(damaged(from, pos));
            }
            let size = h.size()?;
            if !self.extension(&h, size, end)? {
                return self.member(&h, size, end).map(Some);
            }
        }
    }

    /// A block at `pos` where a header should be whose checksum fails: the archive is
    /// refused if it is the first, else skipped with what extended the next header.
    fn not_a_header(&mut self, pos: u64) -> Result<()> {
        if pos == self.start {
            return Err(Error::corrupt(format!(
                "tar header at offset {pos} has a bad checksum; the archive is \
                 damaged there (check it with `tar -tvf`)"
            )));
        }
        self.damage.get_or_insert(pos);
        (self.long_name, self.long_link) = (None, None);
        self.local.clear();
        self.pos += BLOCK;
        Ok(())
    }

    /// Reads header `h` (at `self.pos`, with `size` bytes of data) if it only extends
    /// the next one or is no member (a volume label); `false` if it is a member's.
    fn extension(&mut self, h: &Header, size: u64, end: u64) -> Result<bool> {
        let pos = self.pos;
        let data_start = pos + BLOCK;
        let past_data = data_start.saturating_add(size.div_ceil(BLOCK).saturating_mul(BLOCK));
        let typeflag = h.typeflag();
        match typeflag {
            // `X`: Solaris' and star's extended header, read as POSIX's `x`.
            b'x' | b'X' | b'g' => {
                let data = self.read_meta("PAX header", size, end)?;
                let (recs, bad) = header::pax_records(&data);
                if let Some(why) = bad {
                    // GNU tar applies the records before a malformed one and goes on.
                    self.notes.push(format!(
                        "the rest of the PAX header at offset {pos} ({why}), as tar -x does"
                    ));
                }
                let recs = recs.into_iter().map(|(k, v)| (k.to_vec(), v.to_vec()));
                if typeflag == b'g' {
                    self.global.extend(recs);
                } else {
                    // A second `x` before a member replaces the first, for GNU tar
                    // and bsdtar alike.
                    self.local = recs.collect();
                }
            }
            b'L' | b'K' => {
                // A name ends at its first NUL, as every extractor reads it.
                let mut data = self.read_meta("GNU long name", size, end)?;
                data.truncate(header::c_len(&data));
                if typeflag == b'L' {
                    self.long_name = Some(data);
                } else {
                    self.long_link = Some(data);
                }
            }
            // A GNU volume label names the archive, not a member; the rest of a file
            // continued from another volume cannot stand alone. GNU tar extracts
            // neither and skips their data.
            b'V' | b'M' => {
                if typeflag == b'M' {
                    let name = self.long_name.take().unwrap_or_else(|| h.path());
                    self.notes.push(format!(
                        "{}: continued from another volume of a multi-volume archive",
                        String::from_utf8_lossy(&name)
                    ));
                }
                (self.long_name, self.long_link) = (None, None);
                self.local.clear();
                if data_start.saturating_add(size) > end {
                    return Err(Error::corrupt(format!(
                        "tar archive is truncated: the header at offset {pos} has {size} \
                         bytes of data, more than the archive holds"
                    )));
                }
            }
            _ => return Ok(false),
        }
        self.pos = past_data;
        Ok(true)
    }

    /// The data of the extension header at `self.pos`. PAX records and GNU long names
    /// have no size limit in the format (GNU tar archives paths longer than PATH_MAX,
    /// and a member's xattrs can reach several MiB), and what they say is kept in the
    /// index anyway: bounded by the archive, one byte of memory a byte of archive, not
    /// by a guess.
    fn read_meta(&self, what: &str, size: u64, end: u64) -> Result<Vec<u8>> {
        let (pos, data_start) = (self.pos, self.pos + BLOCK);
        if data_start.saturating_add(size) > end {
            return Err(Error::corrupt(format!(
                "{what} of {size} bytes at offset {pos} is too large or truncated"
            )));
        }
        self.src.read_vec(data_start, size as usize)
    }

    /// The member whose header `h` is at `self.pos`, with the extensions read before it
    /// applied; moves past its data.
    fn member(&mut self, h: &Header, size: u64, end: u64) -> Result<Entry> {
        let pos = self.pos;
        let typeflag = h.typeflag();
        let (maj, min) = h.dev()?;
        let mut e = Entry {
            path: self.long_name.take().unwrap_or_else(|| h.path()),
            link: self.long_link.take().unwrap_or_else(|| h.link_name()),
            typeflag,
            mode: h.mode()?,
            uid: h.uid()?,
            gid: h.gid()?,
            mtime: h.mtime()?,
            size,
            rdev: new_encode_dev(maj, min),
            data: pos + BLOCK,
            at: pos,
            ..Entry::default()
        };
        if typeflag == b'S' {
            e.sparse = Some(self.gnu_sparse(h, &mut e.data, end)?);
        }
        e.apply_pax(self.global.iter().chain(self.local.iter()));
        self.local.clear();
        // Old archives mark a directory by a trailing `/` on a file's name; GNU tar
        // and bsdtar read it so, with no data whatever its size field says.
        if matches!(e.typeflag, b'0' | 0 | b'7') && e.path.last() == Some(&b'/') {
            e.typeflag = b'5';
        }
        let stored = e.size;
        if e.has_data() && stored > end.saturating_sub(e.data) {
            // A stream being decoded does not know its end yet: `end` is not it.
            let ends = if end >= u64::MAX >> 1 {
                "the archive is shorter".to_string()
            } else {
                format!("the archive ends at {end}")
            };
            return Err(Error::corrupt(format!(
                "tar archive is truncated: member {:?} needs {stored} bytes at offset \
                 {}, {ends}",
                String::from_utf8_lossy(&e.path),
                e.data
            )));
        }
        // Below `end`, which is below 2^63: no overflow.
        self.pos = if e.has_data() {
            e.data + stored.div_ceil(BLOCK) * BLOCK
        } else {
            e.data
        };
        Ok(e)
    }

    /// An old GNU sparse member's map: the header's, then its extension blocks' from
    /// `*data_pos` on (which moves past them).
    fn gnu_sparse(&mut self, h: &Header, data_pos: &mut u64, end: u64) -> Result<Sparse> {
        let (mut map, mut more) = h.gnu_sparse()?;
        while more {
            // Each 512-byte extension block adds 21 entries: the map is bounded
            // by the archive, not by a count.
            if *data_pos + BLOCK > end {
                return Err(Error::corrupt("GNU sparse map is truncated"));
            }
            let ext = self.reader.block(*data_pos)?;
            let (m2, more2) = header::gnu_sparse_ext(&ext)?;
            map.extend(m2);
            more = more2;
            *data_pos += BLOCK;
        }
        Ok(Sparse {
            map,
            map_in_data: false,
        })
    }
}

impl Iterator for Entries<'_> {
    type Item = Result<Entry>;

    fn next(&mut self) -> Option<Result<Entry>> {
        if self.done {
            return None;
        }
        let item = self.read_entry().transpose();
        match &item {
            Some(Ok(_)) => {}
            Some(Err(_)) => self.done = true,
            None => {
                self.done = true;
                if let Some(from) = self.damage.take() {
                    self.notes.push(damaged(from, self.pos));
                }
            }
        }
        item
    }
}

impl Entry {
    /// Applies PAX records, global ones first: names, owner, times, size, xattrs and
    /// the GNU sparse formats' records.
    fn apply_pax<'r>(&mut self, records: impl Iterator<Item = &'r (Vec<u8>, Vec<u8>)>) {
        let mut sparse_name = None;
        let mut sparse_major = None;
        let mut real_size = None;
        let mut map01 = None;
        let mut map00: Vec<u64> = Vec::new();
        for (k, v) in records {
            match k.as_slice() {
                b"path" => self.path = header::c_str(v).to_vec(),
                b"linkpath" => self.link = header::c_str(v).to_vec(),
                b"size" => self.size = header::pax_number(v).unwrap_or(self.size),
                b"uid" => self.uid = header::pax_number(v).unwrap_or(self.uid),
                b"gid" => self.gid = header::pax_number(v).unwrap_or(self.gid),
                b"mtime" => {
                    if let Some((s, ns)) = header::pax_time(v) {
                        self.mtime = s;
                        self.mtime_nsec = ns;
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
                    set_xattr(&mut self.xattrs, k[13..].to_vec(), v.clone());
                }
                k if k.starts_with(b"LIBARCHIVE.xattr.") => {
                    if let Some(val) = base64(v) {
                        set_xattr(&mut self.xattrs, percent_decode(&k[17..]), val);
                    }
                }
                _ => {}
            }
        }
        if let Some(name) = sparse_name {
            self.path = name;
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
            self.sparse = Some(sp);
        }
    }
}

/// A PAX 1.0 sparse map, at the start of a member's `stored` bytes of data at
/// `data_pos`: decimal numbers, one per line: count, then offset/length pairs, padded
/// to a block boundary. Returns the map and where the file's data starts after it. GNU
/// tar writes a line a region, so a file of a million regions has a map of some 20 MiB:
/// it is parsed a block at a time, and bounded by the member's stored data, which holds
/// it.
pub(super) fn map_in_data(
    src: &dyn Bytes,
    data_pos: u64,
    stored: u64,
    display: &str,
) -> Result<(SparseMap, u64)> {
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
                header::pax_number(l)
                    .ok_or_else(|| Error::corrupt(format!("bad sparse map in {display}")))?,
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
    let map = lines[1..].chunks_exact(2).map(|c| (c[0], c[1])).collect();
    Ok((map, off))
}

fn new_encode_dev(major: u64, minor: u64) -> u32 {
    let (major, minor) = (major as u32, minor as u32);
    (minor & 0xff) | ((major & 0xfff) << 8) | ((minor & !0xff) << 12)
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

#[cfg(test)]
mod tests {
    use super::*;

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
