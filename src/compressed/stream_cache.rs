//! What the decoded streams of one mount share, bounded together by `--cache-size`: the
//! block cache, gzip decoders parked mid-stretch or idle, and spare block buffers. Each
//! stream had its own, each the whole budget: a union of 1,000 `.tar.gz` shards held 187
//! MiB over an epoch against one `.tar.gz`'s 57 (667 idle decoders with their input
//! buffers), and with partial reads could have cached up to every shard's decoded size.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use super::{Decoder, Parked};
use crate::cache::BlockCache;
use crate::sync::Mutex;

/// A stream's cache keys are its decoded offsets with its tag above this bit.
const TAG_SHIFT: u32 = 44;

/// Idle decoders kept: restarting one saves zlib's allocations.
const IDLE: usize = 16;

/// Evicted blocks' buffers kept to decode into again.
const SPARE_BLOCKS: usize = 256;

/// A parked gzip decoder: zlib's state and 32 KiB window, its input buffer dropped. They
/// take 1/16 of the cache budget: with 64 of them for 1,050 stretches (the 10,000-file
/// bench) most reads found theirs evicted and decoded from the entry point again.
const PARKED_BYTES: u64 = 48 << 10;

/// The cache and decoders of one mount's compressed streams (each stream's blocks keyed
/// under a tag of its own).
pub struct StreamCache {
    cache_bytes: u64,
    pub(super) blocks: BlockCache<Vec<u8>>,
    /// gzip decoders left where a read's decoding ended, by (stream, stretch): the next
    /// read further into the same stretch goes on from there instead of from the entry
    /// point, so a stretch read in any order is decoded about once.
    parked: Mutex<lru::LruCache<(u32, usize), Parked>>,
    /// gzip decoders done with, restarted at the next gzip read's entry point in any
    /// stream (see [`Decoder::restart`]; no other codec's restart).
    idle: Mutex<Vec<Box<dyn Decoder>>>,
    /// Evicted blocks' buffers, decoded into again. With blocks, zlib states and input
    /// buffers freed to malloc and made anew, glibc's arenas held 150-250 MiB of free
    /// memory between the cache's live blocks (peak RSS 720 MiB with a 512 MiB cache on
    /// the bench's tar.gz; 615 MiB recycling them, 500 MiB trimming as well).
    spare: Arc<Mutex<Vec<Vec<u8>>>>,
    next_tag: AtomicU32,
}

impl std::fmt::Debug for StreamCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamCache")
            .field("cache_bytes", &self.cache_bytes)
            .finish_non_exhaustive()
    }
}

impl StreamCache {
    pub fn new(cache_bytes: u64) -> Arc<StreamCache> {
        let spare: Arc<Mutex<Vec<Vec<u8>>>> = Arc::default();
        let recycle = spare.clone();
        Arc::new(StreamCache {
            cache_bytes,
            // 7/8 of the budget; 1/16 for parked decoders, 1/16 for the rest of the
            // server (spare blocks, buffers, the allocator's slack between trims).
            blocks: BlockCache::new("decoded", (cache_bytes - cache_bytes / 8) as usize).recycling(
                move |block: Vec<u8>| {
                    let mut s = recycle.lock();
                    if s.len() < SPARE_BLOCKS {
                        s.push(block);
                    }
                },
            ),
            parked: Mutex::new(lru::LruCache::new(
                std::num::NonZeroUsize::new((cache_bytes / 16 / PARKED_BYTES).max(8) as usize)
                    .expect("at least 8"),
            )),
            idle: Mutex::default(),
            spare,
            next_tag: AtomicU32::new(0),
        })
    }

    /// Where a stream of `len` decoded bytes keeps its blocks: here under a tag of its
    /// own, or in a share of its own where its offsets would reach another's tag (over
    /// 16 TiB decoded, or over a million streams).
    pub(super) fn place(self: &Arc<Self>, len: u64) -> (Arc<StreamCache>, u32) {
        if len < 1 << TAG_SHIFT {
            let tag = self
                .next_tag
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| {
                    (t < (1 << (64 - TAG_SHIFT)) - 1).then_some(t + 1)
                });
            if let Ok(tag) = tag {
                return (self.clone(), tag);
            }
        }
        (StreamCache::new(self.cache_bytes), 0)
    }

    /// The cache key of decoded offset `at` in the stream tagged `tag`.
    pub(super) fn key(tag: u32, at: u64) -> u64 {
        (u64::from(tag) << TAG_SHIFT) | at
    }

    pub(super) fn spare_block(&self) -> Option<Vec<u8>> {
        self.spare.lock().pop()
    }

    pub(super) fn keep_block(&self, b: Vec<u8>) {
        let mut s = self.spare.lock();
        if s.len() < SPARE_BLOCKS {
            s.push(b);
        }
    }

    pub(super) fn unpark(&self, tag: u32, stretch: usize) -> Option<Parked> {
        self.parked.lock().pop(&(tag, stretch))
    }

    /// Parks a decoder (and the decoded offset it stopped at) for stretch `stretch` of
    /// stream `tag`; returns the one it pushed out, if any.
    pub(super) fn park(&self, tag: u32, stretch: usize, parked: Parked) -> Option<Parked> {
        self.parked
            .lock()
            .push((tag, stretch), parked)
            .map(|(_, p)| p)
    }

    pub(super) fn parked_count(&self) -> usize {
        self.parked.lock().len()
    }

    pub(super) fn idle_decoder(&self) -> Option<Box<dyn Decoder>> {
        self.idle.lock().pop()
    }

    pub(super) fn retire(&self, d: Box<dyn Decoder>) {
        let mut idle = self.idle.lock();
        if idle.len() < IDLE {
            idle.push(d);
        }
    }
}
