//! Lookup tables (ids, fragments, xattr ids): an array of u64 pointers to metadata blocks
//! that hold fixed-size entries.

use super::metadata::BLOCK_SIZE;
use super::SquashFs;
use crate::error::{Error, Result};
use crate::source::Source;

/// The pointer array of a table of `count` entries of `entry_size` bytes at `start`.
pub fn read_pointers(
    source: &Source,
    start: u64,
    count: u64,
    entry_size: u64,
    limit: u64,
    what: &str,
) -> Result<Vec<u64>> {
    let blocks = (count * entry_size).div_ceil(BLOCK_SIZE as u64);
    if start + blocks * 8 > limit {
        return Err(Error::corrupt(format!(
            "{what} table of {count} entries does not fit in the image"
        )));
    }
    let raw = source.read_vec(start, (blocks * 8) as usize)?;
    let ptrs: Vec<u64> = raw
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    if let Some(p) = ptrs.iter().find(|&&p| p >= limit) {
        return Err(Error::corrupt(format!(
            "{what} table points to {p}, outside the image"
        )));
    }
    Ok(ptrs)
}

/// Where a fragment block is stored.
#[derive(Clone, Copy, Debug)]
pub struct Fragment {
    pub start: u64,
    pub size: u32,
}

impl SquashFs {
    /// Reads all uid/gid values at open: at most 65,536 of them.
    pub fn load_ids(&self) -> Result<Vec<u32>> {
        let count = u64::from(self.sb.id_count);
        let ptrs = read_pointers(
            &self.source,
            self.sb.id_table,
            count,
            4,
            self.sb.bytes_used,
            "id",
        )?;
        let mut ids = Vec::with_capacity(count as usize);
        let mut c = self.cursor(ptrs[0], 0);
        for _ in 0..count {
            ids.push(c.u32()?);
        }
        Ok(ids)
    }

    pub fn id(&self, idx: u16) -> Result<u32> {
        self.ids
            .get(usize::from(idx))
            .copied()
            .ok_or_else(|| Error::corrupt(format!("id index {idx} outside the id table")))
    }

    pub fn fragment(&self, idx: u32) -> Result<Fragment> {
        if idx >= self.sb.frag_count {
            return Err(Error::corrupt(format!(
                "fragment {idx} outside the fragment table ({} entries)",
                self.sb.frag_count
            )));
        }
        let per_block = BLOCK_SIZE as u32 / 16;
        let ptr = self.frag_ptrs[(idx / per_block) as usize];
        let mut c = self.cursor(ptr, ((idx % per_block) * 16) as usize);
        let start = c.u64()?;
        let size = c.u32()?;
        Ok(Fragment { start, size })
    }
}
