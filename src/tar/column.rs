//! A column of unsigned integers kept at the narrowest width that holds every value in
//! it. The tar index stores each field of its records as one column: at ImageNet's scale
//! most fields (sizes of 110 KiB files, offsets in 512-byte blocks, a few distinct
//! owners and modes) fit in one to four bytes, and a field that never varies takes none.

/// Values `0..len`, all of one width. `Const` holds a value shared by every row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Column {
    Const(u64),
    U8(Vec<u8>),
    U16(Vec<u16>),
    U32(Vec<u32>),
    U64(Vec<u64>),
}

impl Default for Column {
    fn default() -> Self {
        Column::Const(0)
    }
}

impl Column {
    /// The narrowest column that holds `values`.
    pub fn new(values: &[u64]) -> Column {
        let Some(&first) = values.first() else {
            return Column::Const(0);
        };
        if values.iter().all(|&v| v == first) {
            return Column::Const(first);
        }
        let max = values.iter().copied().max().unwrap_or(0);
        if max <= u64::from(u8::MAX) {
            Column::U8(values.iter().map(|&v| v as u8).collect())
        } else if max <= u64::from(u16::MAX) {
            Column::U16(values.iter().map(|&v| v as u16).collect())
        } else if max <= u64::from(u32::MAX) {
            Column::U32(values.iter().map(|&v| v as u32).collect())
        } else {
            Column::U64(values.to_vec())
        }
    }

    /// Row `i`; rows past the end read as 0 (callers index within the table's length).
    #[inline]
    pub fn get(&self, i: usize) -> u64 {
        match self {
            Column::Const(v) => *v,
            Column::U8(c) => c.get(i).map_or(0, |&v| u64::from(v)),
            Column::U16(c) => c.get(i).map_or(0, |&v| u64::from(v)),
            Column::U32(c) => c.get(i).map_or(0, |&v| u64::from(v)),
            Column::U64(c) => c.get(i).copied().unwrap_or(0),
        }
    }

    /// Bytes per row.
    pub fn width(&self) -> usize {
        match self {
            Column::Const(_) => 0,
            Column::U8(_) => 1,
            Column::U16(_) => 2,
            Column::U32(_) => 4,
            Column::U64(_) => 8,
        }
    }

    /// Rows stored (0 for a constant).
    fn stored(&self) -> usize {
        match self {
            Column::Const(_) => 0,
            Column::U8(c) => c.len(),
            Column::U16(c) => c.len(),
            Column::U32(c) => c.len(),
            Column::U64(c) => c.len(),
        }
    }

    /// Whether the column has `len` rows (a constant has any number).
    pub fn fits(&self, len: usize) -> bool {
        matches!(self, Column::Const(_)) || self.stored() == len
    }

    /// Heap bytes held.
    pub fn bytes(&self) -> usize {
        self.width() * self.stored()
    }

    /// The width, then the value (constant) or the rows, little-endian.
    pub fn write(&self, out: &mut Vec<u8>) {
        out.push(self.width() as u8);
        match self {
            Column::Const(v) => out.extend_from_slice(&v.to_le_bytes()),
            Column::U8(c) => out.extend_from_slice(c),
            Column::U16(c) => c
                .iter()
                .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
            Column::U32(c) => c
                .iter()
                .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
            Column::U64(c) => c
                .iter()
                .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        }
    }

    /// Reads a column of `len` rows written by [`Column::write`], taking its bytes from
    /// `fill` through a small buffer straight into the typed rows (a whole-column
    /// temporary left the allocator holding the holes: 8 MiB more resident at 1.28 M
    /// entries). `None` if the rows would take more than `available` bytes, the input
    /// runs out, or the width is not one [`Column::write`] writes.
    pub fn read(
        fill: &mut impl FnMut(&mut [u8]) -> Option<()>,
        len: usize,
        available: u64,
    ) -> Option<Column> {
        fn rows<T, const N: usize>(
            fill: &mut impl FnMut(&mut [u8]) -> Option<()>,
            len: usize,
            available: u64,
            from: fn([u8; N]) -> T,
        ) -> Option<Vec<T>> {
            if len.checked_mul(N)? as u64 > available {
                return None;
            }
            let mut out = Vec::with_capacity(len);
            let mut buf = [0u8; 8192];
            while out.len() < len {
                let n = (buf.len() / N).min(len - out.len()) * N;
                fill(&mut buf[..n])?;
                out.extend(
                    buf[..n]
                        .chunks_exact(N)
                        .map(|c| from(c.try_into().unwrap())),
                );
            }
            Some(out)
        }
        let mut width = [0u8; 1];
        fill(&mut width)?;
        Some(match width[0] {
            0 => {
                let mut v = [0u8; 8];
                fill(&mut v)?;
                Column::Const(u64::from_le_bytes(v))
            }
            1 => Column::U8(rows(fill, len, available, |b: [u8; 1]| b[0])?),
            2 => Column::U16(rows(fill, len, available, u16::from_le_bytes)?),
            4 => Column::U32(rows(fill, len, available, u32::from_le_bytes)?),
            8 => Column::U64(rows(fill, len, available, u64::from_le_bytes)?),
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn narrowest_width_and_round_trip() {
        for (values, width) in [
            (vec![], 0),
            (vec![7, 7, 7], 0),
            (vec![0, 255], 1),
            (vec![1, 256], 2),
            (vec![0, 65_536], 4),
            (vec![3, u64::from(u32::MAX) + 1], 8),
            (vec![u64::MAX, 0], 8),
        ] {
            let c = Column::new(&values);
            assert_eq!(c.width(), width, "{values:?}");
            for (i, &v) in values.iter().enumerate() {
                assert_eq!(c.get(i), v);
            }
            let mut out = Vec::new();
            c.write(&mut out);
            out.push(0xaa);
            let (back, left) = read(&out, values.len());
            assert_eq!(back, Some(c));
            assert_eq!(left, 1);
        }
    }

    /// Reads a column from the front of `b`; returns it and the bytes left unread.
    fn read(b: &[u8], len: usize) -> (Option<Column>, usize) {
        let mut at = 0;
        let mut fill = |buf: &mut [u8]| {
            buf.copy_from_slice(b.get(at..at + buf.len())?);
            at += buf.len();
            Some(())
        };
        let c = Column::read(&mut fill, len, b.len() as u64);
        (c, b.len() - at)
    }

    #[test]
    fn short_or_malformed_input_is_refused() {
        let mut out = Vec::new();
        Column::new(&[1, 70_000, 3]).write(&mut out);
        assert!(read(&out[..out.len() - 1], 3).0.is_none());
        // A row count larger than the input is refused before anything is allocated.
        assert!(read(&out, usize::MAX / 8).0.is_none());
        assert!(read(&[3, 0, 0, 0], 1).0.is_none());
        assert!(read(&[], 0).0.is_none());
    }
}
