//! Compressed archives (gzip, zstd, xz, bzip2) as a random-access byte space, so a tar
//! inside one is served in place like a plain tar. Imports [`crate::source`],
//! [`crate::cache`] and [`crate::memory`] (and the archive interface's read types).
//!
//! One pass over the archive decodes it front to back for the tar scan and records entry
//! points on the way: places a decoder can start from (a gzip deflate block boundary with
//! its 32 KiB window, a zstd frame, an xz block, a bzip2 block). A read then decodes from
//! the nearest entry point before it, into the shared block cache as fixed-size blocks,
//! so the next reads of the same neighbourhood cost a copy. An archive whose entry points
//! are too far apart (one zstd frame, one xz block) is decoded once, in the background,
//! into a copy in memory or on node-local disk, and served from there.
//!
//! The modules, one structure each:
//! - [`Compression`]: which format, by its magic number, and the decoders it starts;
//! - [`Decoder`]: what every format's decoder does; [`Input`]: the archive bytes it reads;
//! - [`Scan`]: the indexing pass, which records the [`Points`] (with their block
//!   checksums, `sums.rs`) that the tar's index saves;
//! - [`Decoded`]: the stream reads are served from, through the mount's [`StreamCache`]
//!   or a [`DecodedCopy`], which the process's copying threads make (`copy_queue.rs`);
//! - `parallel_decoder.rs`: independent pieces decoded on several threads for one pass,
//!   `read_window.rs`: the archive read in large windows to find them;
//! - the formats: `gzip.rs` (with `window.rs`, its sparse windows), `zstd.rs`, `xz.rs`,
//!   `bzip2_blocks.rs`, and `serial.rs` for a stream decoded front to back;
//! - [`Bytes`]: the byte space the tar scan reads, plain or decoded.

mod bytes;
mod compression;
mod copy_queue;
mod decoded;
mod decoded_copy;
mod decoder;
mod input;
mod parallel_decoder;
mod points;
mod read_window;
mod scan;
mod stream_cache;
mod sums;

mod bzip2_blocks;
mod gzip;
mod serial;
mod window;
mod xz;
mod zstd;

pub use bytes::Bytes;
pub use compression::{first_bytes, Compression};
pub use copy_queue::{hold_copies, release_copies};
pub use decoded::Decoded;
pub use decoded_copy::DecodedCopy;
pub use decoder::Decoder;
pub use input::Input;
pub use points::{Point, Points};
pub use scan::{drop_scan_buffer, Scan};
pub use stream_cache::StreamCache;
/// The sparse-window decoder, for its fuzz target.
pub use window::sparse as sparse_window;

use decoder::{fill, Parked};

#[cfg(test)]
use crate::source::Source;
#[cfg(test)]
use std::sync::Arc;

/// Decoded blocks in the cache: large enough that a file of ~110 KiB is two or three,
/// small enough that the cache keeps the neighbourhoods in use. The indexing pass sums
/// blocks of this size, and decoded copies are written in them.
const BLOCK: u64 = 64 << 10;

/// Threads for a pass over a whole archive: one a core, at most 8.
fn threads() -> usize {
    // Asked once: each call reads the cgroup's files.
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *THREADS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get().min(8)))
}

/// Test data: noise in one of every three stretches of `1 << shift` bytes, `text`'s
/// letters in the others, so compressors write blocks of every kind and length.
#[cfg(test)]
fn mixed(len: usize, seed: u64, shift: u32, text: &[u8]) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if (i >> shift) % 3 == 0 {
                x as u8
            } else {
                text[(x % text.len() as u64) as usize]
            }
        })
        .collect()
}

/// Test data as an archive file (removed at once: the source keeps it open).
#[cfg(test)]
fn source_of(bytes: &[u8], name: &str) -> Arc<Source> {
    let path = std::env::temp_dir().join(format!("archfs-{}-{name}", std::process::id()));
    std::fs::write(&path, bytes).unwrap();
    let src = Arc::new(Source::open(&path).unwrap());
    std::fs::remove_file(&path).unwrap();
    src
}
