//! Extended attributes: an id table maps an inode's xattr index to a run of key/value
//! pairs; large values are stored once, out of line, and referenced.

use super::metadata::BLOCK_SIZE;
use super::table::read_pointers;
use super::SquashFs;
use crate::error::{Error, Result};
use crate::source::Source;

/// The xattr id table, read at open.
pub struct XattrTable {
    kv_start: u64,
    /// The key/value area ends where the id table's header starts.
    kv_end: u64,
    count: u32,
    ptrs: Vec<u64>,
}

/// Each key/value pair takes at least 8 bytes: type, name size, value size.
const MIN_PAIR: u64 = 8;

impl XattrTable {
    pub fn load(source: &Source, start: u64, limit: u64) -> Result<XattrTable> {
        let mut hdr = [0u8; 16];
        source.read_exact_at(start, &mut hdr)?;
        let kv_start = u64::from_le_bytes(hdr[0..8].try_into().unwrap());
        let count = u32::from_le_bytes(hdr[8..12].try_into().unwrap());
        if kv_start >= limit || kv_start > start {
            return Err(Error::corrupt("xattr table starts outside the image"));
        }
        let ptrs = read_pointers(source, start + 16, u64::from(count), 16, limit, "xattr id")?;
        Ok(XattrTable {
            kv_start,
            kv_end: start,
            count,
            ptrs,
        })
    }
}

impl SquashFs {
    pub fn read_xattrs(&self, idx: u32) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        let Some(table) = &self.xattrs else {
            return Err(Error::corrupt(
                "inode has xattrs but the image has no xattr table",
            ));
        };
        if idx >= table.count {
            return Err(Error::corrupt(format!(
                "xattr index {idx} outside the table"
            )));
        }
        let per_block = BLOCK_SIZE as u32 / 16;
        let mut c = self.cursor(
            table.ptrs[(idx / per_block) as usize],
            ((idx % per_block) * 16) as usize,
        );
        let kv_ref = c.u64()?;
        let count = c.u32()?;
        let _size = c.u32()?;
        // Counts and sizes are bounded by what the key/value area can decode to, not by
        // Linux's 64 KiB XATTR_SIZE_MAX: the format stores 32-bit sizes, tar2sqfs copies
        // PAX xattrs of any size, and the kernel lists such a value and answers ERANGE for
        // it rather than refusing the image. Values are read a block at a time, so a lie
        // fails at the end of the metadata instead of allocating what it claims.
        let room = super::metadata::max_decoded(table.kv_end - table.kv_start);
        if u64::from(count) * MIN_PAIR > room {
            return Err(Error::corrupt(format!(
                "xattr set {idx} claims {count} pairs, more than the table can hold"
            )));
        }
        let too_big = |len: usize| -> Result<()> {
            if len as u64 > room {
                return Err(Error::corrupt(format!("xattr value of {len} bytes")));
            }
            Ok(())
        };
        let mut kv = self.cursor(table.kv_start + (kv_ref >> 16), (kv_ref & 0xffff) as usize);
        let mut out = Vec::new();
        for _ in 0..count {
            let typ = kv.u16()?;
            let name_len = usize::from(kv.u16()?);
            let prefix: &[u8] = match typ & 0xff {
                0 => b"user.",
                1 => b"trusted.",
                2 => b"security.",
                t => return Err(Error::corrupt(format!("xattr of unknown type {t}"))),
            };
            let mut name = prefix.to_vec();
            name.extend(kv.bytes(name_len)?);
            let value_len = kv.u32()? as usize;
            too_big(value_len)?;
            let value = if typ & 0x100 != 0 {
                if value_len != 8 {
                    return Err(Error::corrupt("out-of-line xattr reference is not 8 bytes"));
                }
                let vref = kv.u64()?;
                let mut vc = self.cursor(table.kv_start + (vref >> 16), (vref & 0xffff) as usize);
                let len = vc.u32()? as usize;
                too_big(len)?;
                vc.bytes(len)?
            } else {
                kv.bytes(value_len)?
            };
            out.push((name, value));
        }
        Ok(out)
    }
}
