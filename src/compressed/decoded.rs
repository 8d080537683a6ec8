//! The decoded stream of an indexed compressed archive, served from the nearest entry point
//! into the mount's shared block cache, or from a decoded copy.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use super::{fill, threads, Compression, DecodedCopy, Decoder, Points, StreamCache, BLOCK};
use crate::archive::Data;
use crate::error::{Error, Result};
use crate::source::{Buf, Source};
use crate::sync::Mutex;

/// The decoded stream of an indexed archive, for serving reads.
pub struct Decoded {
    source: Arc<Source>,
    codec: Compression,
    points: Arc<Points>,
    /// The block cache, parked and idle decoders, spare buffers: shared with the other
    /// streams of the mount, this one's blocks keyed under `tag`.
    cache: Arc<StreamCache>,
    tag: u32,
    /// One decoder at a time per stretch between entry points (striped): a second reader
    /// of the same neighbourhood waits and finds the blocks cached.
    locks: Box<[Mutex<()>]>,
    /// A decoded copy: made from the start for a format without entry points inside,
    /// or by `--preload` ([`Decoded::decode_ahead`]).
    copy: std::sync::OnceLock<Arc<DecodedCopy>>,
    stage_dir: Option<std::path::PathBuf>,
    /// Bytes decoded for reads, and asked for by them: how much a read decodes in vain
    /// (logged at unmount, to tune `--entry-spacing` and `--cache-size` by).
    decoded: std::sync::atomic::AtomicU64,
    asked: std::sync::atomic::AtomicU64,
}

/// Mean decoded bytes between entry points above which reads decode far
/// ([`crate::archive::DecodeAhead::Far`]).
const FAR: u64 = 1 << 20;

/// Decoded bytes between returns of the allocator's free pages to the system.
const TRIM_EVERY: u64 = 64 << 20;

/// Gives the pages of free heap memory back: glibc keeps them in each thread's arena,
/// between live blocks (80 MiB of peak RSS on the bench's tar.gz; ~2% more CPU).
fn trim_heap() {
    #[cfg(target_env = "gnu")]
    // SAFETY: a plain call into glibc's allocator.
    unsafe {
        libc::malloc_trim(0);
    }
}

impl Drop for Decoded {
    fn drop(&mut self) {
        let (asked, decoded) = (self.asked.load(Relaxed), self.decoded.load(Relaxed));
        if asked > 0 && self.copy.get().is_none() {
            tracing::info!(
                "{}: reads asked for {} MiB and decoded {} MiB ({:.2}x); {} MiB cached, {} \
                 decoders parked (with the mount's other compressed streams)",
                self.source.path().display(),
                asked >> 20,
                decoded >> 20,
                decoded as f64 / asked as f64,
                self.cache.blocks.bytes() >> 20,
                self.cache.parked_count()
            );
        }
    }
}

const LOCKS: usize = 64;
/// How far past a read a miss decodes within its member: the rest of a file read in
/// pieces (sequentially) is decoded once, and a random read in a large member does not
/// decode to the end of a long stretch.
const AHEAD: u64 = 4 << 20;

impl Decoded {
    /// `cache`: the cache and decoders of the mount's compressed streams; `stage_dir`:
    /// where a decoded copy goes when one is needed and does not fit in memory.
    pub fn new(
        source: Arc<Source>,
        codec: Compression,
        points: Points,
        cache: &Arc<StreamCache>,
        stage_dir: Option<&std::path::Path>,
    ) -> Result<Decoded> {
        let points = Arc::new(points);
        let (cache, tag) = cache.place(points.len());
        let spread = points.spacing.saturating_mul(4);
        let copy_now = if points.widest() > codec.max_stretch().max(spread)
            || (points.count() == 1 && points.len() > spread)
        {
            tracing::info!(
                "{}: this {} archive has {} entry point(s) for {} MiB decoded; serving it \
                 from a decoded copy made in the background (recompress it in independent \
                 pieces, e.g. `pzstd` or `bgzip`, to read it in place)",
                source.path().display(),
                codec.name(),
                points.count(),
                points.len() >> 20
            );
            Some(DecodedCopy::start(
                source.clone(),
                codec,
                points.clone(),
                stage_dir,
            )?)
        } else {
            None
        };
        Ok(Decoded {
            source,
            codec,
            points,
            cache,
            tag,
            locks: (0..LOCKS).map(|_| Mutex::new(())).collect(),
            copy: copy_now.map_or_else(std::sync::OnceLock::new, std::sync::OnceLock::from),
            stage_dir: stage_dir.map(std::path::Path::to_path_buf),
            decoded: Default::default(),
            asked: Default::default(),
        })
    }

    pub fn source(&self) -> &Source {
        &self.source
    }

    pub fn codec(&self) -> Compression {
        self.codec
    }

    pub fn points(&self) -> &Points {
        &self.points
    }

    pub fn len(&self) -> u64 {
        self.points.len
    }

    pub fn is_empty(&self) -> bool {
        self.points.len == 0
    }

    /// Whether reads come from a decoded copy made from the start.
    pub fn staged(&self) -> bool {
        self.copy.get().is_some_and(|s| !s.parallel())
    }

    /// Starts decoding the whole archive in the background, on every core from the
    /// entry points, into a copy later reads are served from; until a stretch is copied
    /// its reads decode it in place.
    pub fn decode_ahead(&self, which: crate::archive::DecodeAhead) {
        use crate::archive::DecodeAhead;
        let far = self.points.len() / self.points.count() as u64 > FAR;
        if self.copy.get().is_some() || (which == DecodeAhead::Far && !far) {
            return;
        }
        let memory_only = which != DecodeAhead::Any;
        let threads = threads();
        match DecodedCopy::start_parallel(
            self.source.clone(),
            self.codec,
            self.points.clone(),
            self.stage_dir.as_deref(),
            memory_only,
        ) {
            Ok(Some(s)) => {
                tracing::info!(
                    "--preload: decoding {} ({} MiB) on {threads} threads into a copy",
                    self.source.path().display(),
                    self.points.len() >> 20
                );
                let _ = self.copy.set(s);
            }
            Ok(None) => tracing::info!(
                "--preload: {} decodes to {} MiB, more than fits in memory; reads decode \
                 it in place (--preload=always copies it to --stage-dir)",
                self.source.path().display(),
                self.points.len() >> 20
            ),
            Err(e) => tracing::warn!("--preload: {e}; reads decode in place"),
        }
    }

    /// Whether a decoded copy is being made in the background.
    pub fn decoding_ahead(&self) -> bool {
        self.copy.get().is_some_and(|s| !s.complete())
    }

    /// `len` bytes at `pos`. A miss decodes on to `horizon` (the end of the member being
    /// read, at most the next entry point), so the rest of a file read in pieces is
    /// cached by its first read.
    pub fn read(&self, pos: u64, len: usize, horizon: u64) -> Result<Data> {
        let end = pos + len as u64;
        if end > self.points.len {
            return Err(Error::corrupt(format!(
                "read at {pos} past the end of the decoded archive ({} bytes)",
                self.points.len
            )));
        }
        self.asked.fetch_add(len as u64, Relaxed);
        if let Some(copy) = self.copy.get() {
            let mut out = Buf::take(len);
            if copy.try_read(pos, &mut out, &|i| self.decoder(i), &|d| self.retire(d))? {
                return Ok(Data::Owned(out));
            }
        }
        let mut out: Option<Buf> = None;
        let mut at = pos;
        while at < end {
            let i = self.points.before(at);
            let base = self.points.points[i].output;
            let key = base + (at - base) / BLOCK * BLOCK;
            let block = match self.cache.blocks.get(self.key(key)) {
                Some(b) => b,
                None => self.decode(i, key, horizon.clamp(end, end + AHEAD))?,
            };
            let from = (at - key) as usize;
            let upto = (end - key).min(block.len() as u64) as usize;
            if from >= upto {
                return Err(Error::corrupt("decoded block is shorter than expected"));
            }
            if upto == block.len() {
                self.cache.blocks.demote(self.key(key));
            }
            if out.is_none() && at == pos && upto as u64 + key == end {
                return Ok(Data::Shared(block, from..upto)); // one block: no copy
            }
            let o = out.get_or_insert_with(|| Buf::take(len));
            let dst = (at - pos) as usize;
            o[dst..dst + upto - from].copy_from_slice(&block[from..upto]);
            at = key + upto as u64;
        }
        Ok(Data::Owned(out.unwrap_or_default()))
    }

    /// Decodes the stretch from entry point `i` on to the block at `key` and beyond it
    /// up to `horizon`, caching every block made; returns the one at `key`.
    fn decode(&self, i: usize, key: u64, horizon: u64) -> Result<Arc<Vec<u8>>> {
        let _one = self.locks[i % LOCKS].lock();
        let blocks = &self.cache.blocks;
        if let Some(b) = blocks.get(self.key(key)) {
            return Ok(b); // decoded while we waited
        }
        let p = self.points.points[i];
        let stop = self.points.end_of(i);
        // Only gzip's decoders are parked where they stop: other formats decode the
        // whole stretch (a zstd frame, a bzip2 block), or each later read of it would
        // decode from its start again (pzstd's frames: 33x the bytes read).
        let horizon = match self.codec {
            Compression::Gzip => horizon.clamp(key + 1, stop),
            _ => stop,
        };
        let (mut at, mut dec) = match self.cache.unpark(self.tag, i) {
            Some((at, d)) if at <= key => (at, d),
            other => {
                if let Some((_, d)) = other {
                    self.retire(d);
                }
                (p.output, self.decoder(i)?)
            }
        };
        let mut wanted = None;
        // Blocks already cached are decoded again on the way (to move the decoder on)
        // into a scratch buffer.
        let mut scratch: Option<Vec<u8>> = None;
        while at < horizon {
            let size = BLOCK.min(stop - at) as usize;
            let mut block = scratch
                .take()
                .or_else(|| self.cache.spare_block())
                .unwrap_or_default();
            block.resize(size, 0);
            if fill(dec.as_mut(), &mut block)? < size {
                return Err(Error::corrupt(format!(
                    "the {} stream ends before its index says ({at} of {} bytes)",
                    self.codec.name(),
                    self.points.len
                )));
            }
            self.points.verify(i, at, &block)?;
            let before = self.decoded.fetch_add(size as u64, Relaxed);
            if (before + size as u64) / TRIM_EVERY != before / TRIM_EVERY {
                trim_heap();
            }
            let b = match blocks.get(self.key(at)) {
                Some(b) => {
                    scratch = Some(block);
                    b
                }
                None => blocks.get_or_load(self.key(at), || Ok(block))?,
            };
            if at == key {
                wanted = Some(b);
            } else if at < key {
                // Decoded on the way to the read: of a file read before as often as not.
                blocks.demote(self.key(at));
            }
            at += size as u64;
        }
        if let Some(b) = scratch {
            self.cache.keep_block(b);
        }
        // A zstd decoder holds its frame's window (pzstd: several MiB): not worth keeping.
        if at < stop && self.codec == Compression::Gzip {
            dec.shrink();
            if let Some((_, d)) = self.cache.park(self.tag, i, (at, dec)) {
                self.retire(d);
            }
        } else {
            self.retire(dec);
        }
        wanted.ok_or_else(|| Error::corrupt("decoded block not found"))
    }

    /// A decoder at entry point `i`: an idle one moved there (the idle are gzip's, of
    /// any of the mount's streams), else a new one.
    fn decoder(&self, i: usize) -> Result<Box<dyn Decoder>> {
        if self.codec == Compression::Gzip {
            if let Some(mut d) = self.cache.idle_decoder() {
                if d.restart(
                    &self.source,
                    &self.points.points[i],
                    &self.points.window(i)?,
                )? {
                    return Ok(d);
                }
            }
        }
        self.points.decoder(i, self.codec, &self.source)
    }

    /// Keeps a decoder done with for [`Decoded::decoder`]. Only gzip's restart: a zstd
    /// decoder holds its frame's window (pzstd: several MiB) and is dropped.
    fn retire(&self, d: Box<dyn Decoder>) {
        if self.codec != Compression::Gzip {
            return;
        }
        self.cache.retire(d);
    }

    /// The cache key of this stream's decoded offset `at`.
    fn key(&self, at: u64) -> u64 {
        StreamCache::key(self.tag, at)
    }
}
