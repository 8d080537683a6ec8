//! The CRC-32 of every decoded block, taken by the indexing pass: a read that decodes from
//! the middle of a stream has no checksum of the format's to check (see [`super::Points`]).

use super::BLOCK;

/// CRCs of the decoded blocks, taken as the indexing pass decodes.
#[derive(Default)]
pub(super) struct Sums {
    crc: crc32fast::Hasher,
    start: u64,
    at: u64,
    pub(super) sums: Vec<u32>,
}

impl Sums {
    pub(super) fn feed(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let k = ((self.start + BLOCK - self.at) as usize).min(bytes.len());
            self.crc.update(&bytes[..k]);
            self.at += k as u64;
            bytes = &bytes[k..];
            if self.at == self.start + BLOCK {
                self.close();
            }
        }
    }

    /// Ends the block being summed (at a block's end, an entry point or the end).
    pub(super) fn close(&mut self) {
        if self.at > self.start {
            self.sums.push(std::mem::take(&mut self.crc).finalize());
        }
        self.start = self.at;
    }
}
