//! The shared block cache: sharded LRU maps bounded by bytes, with single-flight loading.
//! A leaf below the formats: imports nothing of the crate but its errors.
//!
//! When several readers miss the same block at once, one decompresses it and the others
//! wait on the same slot. Blocks are handed out as `Arc`s, so eviction never frees a block
//! a reader still holds. Metadata, fragments and data get separate budgets so a stream
//! of data blocks cannot push out the inodes and directories every lookup needs.

use std::hash::BuildHasherDefault;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use crate::sync::Mutex;
use lru::LruCache;

use crate::error::{Error, Result};

/// How the user's `--cache-size` is split between the kinds of blocks.
#[derive(Clone, Copy, Debug)]
pub struct CacheConfig {
    pub total_bytes: u64,
}

impl CacheConfig {
    pub const DEFAULT_BYTES: u64 = 512 << 20;

    /// Metadata gets room for about 128 bytes an inode (inode, directory entry and name,
    /// with room to spare), at least 4 MiB and at most half: every lookup needs it, and at
    /// 1.28 M files a fixed 1/8 was too small, so a shuffled stat of every file
    /// decompressed a metadata block for most lookups. Fragments get 1/2 (datasets of
    /// small files live in them), whole data blocks the rest.
    pub fn split(&self, inodes: u64) -> (usize, usize, usize) {
        let total = self.total_bytes as usize;
        let wanted = usize::try_from(inodes.saturating_mul(128)).unwrap_or(usize::MAX);
        let meta = wanted.clamp((4 << 20).min(total / 2), total / 2);
        let frag = total / 2;
        let data = total.saturating_sub(meta + frag);
        (meta, frag, data)
    }
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            total_bytes: Self::DEFAULT_BYTES,
        }
    }
}

/// Something the cache can hold and weigh.
pub trait Weighted: Send + Sync {
    fn weight(&self) -> usize;
}

impl Weighted for Vec<u8> {
    fn weight(&self) -> usize {
        self.capacity()
    }
}

#[derive(Debug)]
struct Slot<V> {
    value: OnceLock<Option<Arc<V>>>,
    /// Bytes this slot added to its shard's total (0 until loaded and still present).
    charged: AtomicUsize,
}

#[derive(Debug)]
struct Shard<V> {
    map: LruCache<u64, Arc<Slot<V>>, BuildHasherDefault<IdentityHasher>>,
    bytes: usize,
}

/// A byte-bounded cache of decoded blocks keyed by their position in the archive.
pub struct BlockCache<V> {
    shards: Box<[Mutex<Shard<V>>]>,
    shard_budget: usize,
    name: &'static str,
    /// Takes back what is evicted when no reader holds it any more.
    recycle: Option<Box<dyn Fn(V) + Send + Sync>>,
}

const SHARDS: usize = 16;

impl<V> std::fmt::Debug for BlockCache<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockCache")
            .field("name", &self.name)
            .field("budget", &(self.shard_budget * self.shards.len()))
            .finish()
    }
}

impl<V: Weighted> BlockCache<V> {
    pub fn new(name: &'static str, budget: usize) -> Self {
        Self::with_shards(name, budget, SHARDS)
    }

    /// A cache of `shards` parts, each with its share of the budget: fewer for a few
    /// large values (a shard full of one holds no second).
    pub fn with_shards(name: &'static str, budget: usize, shards: usize) -> Self {
        let n = shards.max(1);
        let shards = (0..n)
            .map(|_| {
                Mutex::new(Shard {
                    map: LruCache::unbounded_with_hasher(Default::default()),
                    bytes: 0,
                })
            })
            .collect();
        BlockCache {
            shards,
            shard_budget: (budget / n).max(1),
            name,
            recycle: None,
        }
    }

    /// Hands evicted blocks no reader holds to `recycle` instead of freeing them.
    pub fn recycling(mut self, recycle: impl Fn(V) + Send + Sync + 'static) -> Self {
        self.recycle = Some(Box::new(recycle));
        self
    }

    fn shard(&self, key: u64) -> &Mutex<Shard<V>> {
        let h = key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32;
        &self.shards[h as usize % self.shards.len()]
    }

    /// Bytes the part of the cache `key` goes to holds below its budget: a value larger
    /// would evict others, and large values that evict each other in turn cost more
    /// than they save.
    pub fn room(&self, key: u64) -> usize {
        let s = self.shard(key).lock();
        self.shard_budget.saturating_sub(s.bytes)
    }

    /// The block at `key` if it is loaded; never loads or waits.
    pub fn get(&self, key: u64) -> Option<Arc<V>> {
        let slot = self.shard(key).lock().map.get(&key)?.clone();
        slot.value.get().and_then(|v| v.clone())
    }

    /// Makes the block at `key` the first to go: it has been read to its end, and what
    /// was decoded ahead of the readers is worth more.
    pub fn demote(&self, key: u64) {
        self.shard(key).lock().map.demote(&key);
    }

    /// Returns the block at `key`, running `load` if no reader has it or is loading it.
    pub fn get_or_load(&self, key: u64, load: impl FnOnce() -> Result<V>) -> Result<Arc<V>> {
        let shard = self.shard(key);
        let slot = {
            let mut s = shard.lock();
            match s.map.get(&key) {
                Some(slot) => slot.clone(),
                None => {
                    let slot = Arc::new(Slot {
                        value: OnceLock::new(),
                        charged: AtomicUsize::new(0),
                    });
                    s.map.put(key, slot.clone());
                    slot
                }
            }
        };
        if let Some(Some(v)) = slot.value.get() {
            return Ok(v.clone());
        }
        let mut error = None;
        let mut loaded_here = false;
        let value = slot.value.get_or_init(|| {
            loaded_here = true;
            match load() {
                Ok(v) => Some(Arc::new(v)),
                Err(e) => {
                    error = Some(e);
                    None
                }
            }
        });
        match value {
            Some(v) => {
                if loaded_here {
                    self.charge(shard, key, &slot, v.weight());
                }
                Ok(v.clone())
            }
            None => {
                // Forget the failure so a later read tries again (the file may have been
                // a transient I/O error); readers that waited on it get an error too.
                let mut s = shard.lock();
                if s.map.peek(&key).is_some_and(|cur| Arc::ptr_eq(cur, &slot)) {
                    s.map.pop(&key);
                }
                Err(error.unwrap_or_else(|| {
                    Error::corrupt(format!("{} block at {key} failed to load", self.name))
                }))
            }
        }
    }

    fn charge(&self, shard: &Mutex<Shard<V>>, key: u64, slot: &Arc<Slot<V>>, weight: usize) {
        let mut s = shard.lock();
        if !s.map.peek(&key).is_some_and(|cur| Arc::ptr_eq(cur, slot)) {
            return; // evicted while loading: nobody accounts for it, the reader drops it
        }
        slot.charged.store(weight, Ordering::Relaxed);
        s.bytes += weight;
        while s.bytes > self.shard_budget && s.map.len() > 1 {
            let Some((old_key, old)) = s.map.pop_lru() else {
                break;
            };
            if old_key == key {
                // Never evict the block just loaded; put it back at the front.
                s.map.put(old_key, old);
                continue;
            }
            s.bytes -= old.charged.load(Ordering::Relaxed);
            if let Some(recycle) = &self.recycle {
                let value = Arc::try_unwrap(old).ok().and_then(|s| s.value.into_inner());
                if let Some(v) = value.flatten().and_then(|v| Arc::try_unwrap(v).ok()) {
                    recycle(v);
                }
            }
        }
    }

    /// Drops every block whose key `gone` picks (those of an archive read elsewhere
    /// from now on); readers holding one keep it.
    pub fn forget(&self, gone: impl Fn(u64) -> bool) {
        self.take(gone);
    }

    /// Drops every block whose key `gone` picks, and returns those loaded, with their
    /// keys.
    pub fn take(&self, gone: impl Fn(u64) -> bool) -> Vec<(u64, Arc<V>)> {
        let mut out = Vec::new();
        for shard in self.shards.iter() {
            let mut s = shard.lock();
            let keys: Vec<u64> = s.map.iter().map(|(k, _)| *k).filter(|&k| gone(k)).collect();
            for k in keys {
                if let Some(slot) = s.map.pop(&k) {
                    s.bytes -= slot.charged.load(Ordering::Relaxed);
                    if let Some(Some(v)) = slot.value.get() {
                        out.push((k, v.clone()));
                    }
                }
            }
        }
        out
    }

    /// Bytes currently held (for tests and `--debug` statistics).
    pub fn bytes(&self) -> usize {
        self.shards.iter().map(|s| s.lock().bytes).sum()
    }
}

/// Keys are archive offsets, already well spread once multiplied in `shard`; the map
/// inside a shard hashes them with a cheap mix as well.
#[derive(Debug, Default)]
struct IdentityHasher(u64);

impl std::hash::Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0.wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 << 8) | u64::from(*b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn metadata_share_follows_the_inode_count_within_the_total() {
        let c = CacheConfig::default();
        let total = CacheConfig::DEFAULT_BYTES as usize;
        for inodes in [0u64, 10_000, 1_281_167, 14_000_000, u64::MAX] {
            let (meta, frag, data) = c.split(inodes);
            assert!(meta + frag + data <= total, "{inodes}");
            assert!(meta >= 4 << 20 && meta <= total / 2, "{inodes}: {meta}");
        }
        assert_eq!(c.split(10_000).0, 4 << 20);
        assert!(c.split(1_281_167).0 >= 1_281_167 * 100);
        assert_eq!(c.split(14_000_000).0, total / 2);
        let tiny = CacheConfig {
            total_bytes: 1 << 20,
        };
        let (meta, frag, data) = tiny.split(1_000_000);
        assert_eq!((meta, frag, data), (512 << 10, 512 << 10, 0));
    }

    #[test]
    fn stays_within_budget_and_keeps_blocks_in_use() {
        let cache = BlockCache::<Vec<u8>>::new("test", 16 * 1024);
        let held = cache.get_or_load(0, || Ok(vec![7u8; 1024])).unwrap();
        for key in 1..200u64 {
            cache
                .get_or_load(key * 4096, || Ok(vec![1u8; 1024]))
                .unwrap();
        }
        assert!(
            cache.bytes() <= 16 * 1024 + SHARDS * 1024,
            "{}",
            cache.bytes()
        );
        assert_eq!(held[0], 7, "an evicted block stays valid for its holder");
    }

    #[test]
    fn concurrent_misses_load_once() {
        let cache = Arc::new(BlockCache::<Vec<u8>>::new("test", 1 << 20));
        let loads = Arc::new(AtomicU32::new(0));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (cache, loads) = (cache.clone(), loads.clone());
                std::thread::spawn(move || {
                    cache
                        .get_or_load(42, || {
                            loads.fetch_add(1, Ordering::SeqCst);
                            std::thread::sleep(std::time::Duration::from_millis(50));
                            Ok(vec![1u8; 100])
                        })
                        .unwrap()
                        .len()
                })
            })
            .collect();
        for t in threads {
            assert_eq!(t.join().unwrap(), 100);
        }
        assert_eq!(loads.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn failures_are_not_cached() {
        let cache = BlockCache::<Vec<u8>>::new("test", 1 << 20);
        assert!(cache.get_or_load(5, || Err(Error::corrupt("bad"))).is_err());
        assert_eq!(cache.get_or_load(5, || Ok(vec![1])).unwrap()[0], 1);
    }
}
