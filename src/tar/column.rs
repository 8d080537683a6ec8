//! A column of unsigned integers kept at the narrowest width that holds every value in
//! it. The tar index stores each field of its records as one column: at ImageNet's scale
//! most fields (sizes of 110 KiB files, offsets in 512-byte blocks, a few distinct
//! owners and modes) fit in one to four bytes, and a field that never varies takes none.
//! Its bytes in a saved index are [`super::persist`]'s.

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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn narrowest_width() {
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
        }
    }
}
