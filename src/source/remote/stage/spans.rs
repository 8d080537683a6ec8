//! A node's copy of a share of an object's files (a dataset larger than a node, each node
//! on its fixed share): the byte ranges the share's files lie in, one after another in
//! the copy, so the copy takes the share's bytes and no more, and the storage serves each
//! of them once. The copy's pieces and board are those of a whole copy, over the spans'
//! bytes in a row; a read of the object lying in one span is a read of the copy there.
//!
//! The spans go in the copy's file past its board, so a process that finds the copy on
//! the node knows what it holds without being told.

use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;

const MAGIC: u64 = u64::from_le_bytes(*b"archfsS1");
/// The trailer at the file's end: the table's offset, its spans, the magic.
const TRAILER: u64 = 24;

/// Sorted, disjoint ranges of an object, and where each starts in the copy.
#[derive(Debug, PartialEq, Eq)]
pub struct Spans {
    /// (start in the object, start in the copy), with one past the last span at the end.
    starts: Vec<(u64, u64)>,
    lens: Vec<u64>,
}

impl Spans {
    /// `ranges` cut to the object's `size`, sorted and merged; `None` when empty.
    pub fn new(ranges: Vec<Range<u64>>, size: u64) -> Option<Spans> {
        let ranges = merged(
            ranges
                .into_iter()
                .map(|r| r.start.min(size)..r.end.min(size))
                .collect(),
        );
        if ranges.is_empty() {
            return None;
        }
        let (mut starts, mut lens, mut at) = (Vec::new(), Vec::new(), 0);
        for r in ranges {
            starts.push((r.start, at));
            lens.push(r.end - r.start);
            at += r.end - r.start;
        }
        Some(Spans { starts, lens })
    }

    /// The bytes the copy holds.
    pub fn len(&self) -> u64 {
        self.starts.last().map_or(0, |&(_, at)| at) + self.lens.last().copied().unwrap_or(0)
    }

    /// Where `[pos, pos + len)` of the object is in the copy, when it lies in one span.
    pub fn find(&self, pos: u64, len: u64) -> Option<u64> {
        let k = self
            .starts
            .partition_point(|&(s, _)| s <= pos)
            .checked_sub(1)?;
        let (start, at) = self.starts[k];
        (pos + len <= start + self.lens[k]).then_some(at + pos - start)
    }

    /// `[at, at + len)` of the copy as parts of the object: (start in the object, length,
    /// start in the copy).
    pub fn parts(&self, at: u64, len: u64) -> Vec<(u64, u64, u64)> {
        let end = at + len;
        let mut k = self
            .starts
            .partition_point(|&(_, a)| a <= at)
            .saturating_sub(1);
        let mut out = Vec::new();
        while k < self.starts.len() {
            let (start, a) = self.starts[k];
            if a >= end {
                break;
            }
            let from = at.max(a);
            let to = end.min(a + self.lens[k]);
            if to > from {
                out.push((start + from - a, to - from, from));
            }
            k += 1;
        }
        out
    }

    /// Writes the spans at `at` of `file` (of `at` + [`Spans::bytes`] bytes).
    pub fn write(&self, file: &File, at: u64) -> std::io::Result<()> {
        let mut buf = Vec::with_capacity(self.bytes() as usize);
        for (&(start, _), &len) in self.starts.iter().zip(&self.lens) {
            buf.extend(start.to_le_bytes());
            buf.extend(len.to_le_bytes());
        }
        buf.extend(at.to_le_bytes());
        buf.extend((self.lens.len() as u64).to_le_bytes());
        buf.extend(MAGIC.to_le_bytes());
        file.write_all_at(&buf, at)
    }

    /// What [`Spans::write`] takes.
    pub fn bytes(&self) -> u64 {
        16 * self.lens.len() as u64 + TRAILER
    }

    /// The spans written at the end of `file`.
    pub fn read(file: &File) -> std::io::Result<Spans> {
        let bad =
            |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_owned());
        let end = file.metadata()?.len();
        let mut t = [0u8; TRAILER as usize];
        file.read_exact_at(
            &mut t,
            end.checked_sub(TRAILER).ok_or_else(|| bad("no spans"))?,
        )?;
        let word = |b: &[u8], i: usize| u64::from_le_bytes(b[8 * i..8 * i + 8].try_into().unwrap());
        if word(&t, 2) != MAGIC {
            return Err(bad("no spans in the copy"));
        }
        let (at, n) = (word(&t, 0), word(&t, 1));
        if n.checked_mul(16).and_then(|b| b.checked_add(at + TRAILER)) != Some(end) {
            return Err(bad("the copy's spans are damaged"));
        }
        let mut table = vec![0u8; 16 * n as usize];
        file.read_exact_at(&mut table, at)?;
        let ranges = (0..n as usize)
            .map(|i| {
                let (s, l) = (word(&table, 2 * i), word(&table, 2 * i + 1));
                s..s.saturating_add(l)
            })
            .collect();
        Spans::new(ranges, u64::MAX).ok_or_else(|| bad("the copy holds no spans"))
    }
}

/// `ranges` sorted, empty ones left out, overlapping and adjacent ones merged.
pub fn merged(mut ranges: Vec<Range<u64>>) -> Vec<Range<u64>> {
    ranges.retain(|r| r.start < r.end);
    ranges.sort_by_key(|r| r.start);
    let mut out: Vec<Range<u64>> = Vec::with_capacity(ranges.len());
    for r in ranges {
        match out.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_merge_map_and_cut_into_parts() {
        let s = Spans::new(vec![50..60, 0..10, 5..20, 20..25, 90..200], 100).unwrap();
        // 0..25, 50..60, 90..100: 45 bytes.
        assert_eq!(s.len(), 45);
        assert_eq!(s.find(0, 25), Some(0));
        assert_eq!(s.find(52, 8), Some(27));
        assert_eq!(s.find(95, 5), Some(40));
        // Across a gap, past a span, before all, in a gap: not in the copy.
        assert_eq!(s.find(20, 31), None);
        assert_eq!(s.find(55, 6), None);
        assert_eq!(s.find(30, 1), None);
        assert_eq!(s.find(95, 6), None);
        assert_eq!(s.parts(0, 45), vec![(0, 25, 0), (50, 10, 25), (90, 10, 35)]);
        assert_eq!(s.parts(20, 10), vec![(20, 5, 20), (50, 5, 25)]);
        assert_eq!(s.parts(30, 15), vec![(55, 5, 30), (90, 10, 35)]);
        assert!(Spans::new(vec![100..200, 7..7], 100).is_none());
    }

    #[test]
    fn spans_written_after_the_data_read_back() {
        let f = tempfile_in_memory();
        let s = Spans::new(vec![4096..8192, 1..3, 1 << 40..(1 << 40) + 5], u64::MAX).unwrap();
        f.set_len(1000 + s.bytes()).unwrap();
        s.write(&f, 1000).unwrap();
        assert_eq!(Spans::read(&f).unwrap(), s);
        f.set_len(1000 + s.bytes() + 1).unwrap();
        assert!(Spans::read(&f).is_err());
    }

    fn tempfile_in_memory() -> File {
        let fd = unsafe { libc::memfd_create(c"spans-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        use std::os::fd::FromRawFd;
        // SAFETY: a new descriptor of ours.
        unsafe { File::from_raw_fd(fd) }
    }
}
