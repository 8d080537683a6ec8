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
//! into a copy in memory or on node-local disk (`stage.rs`), and served from there.

mod ahead;
mod bzip2_blocks;
mod gzip;
mod serial;
mod shared;
mod stage;
mod window;
mod xz;
mod zstd;

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use crate::sync::Mutex;

use crate::archive::Data;
use crate::error::{Error, Result};
use crate::source::{Buf, Source};
pub use shared::Shared;
pub use stage::{hold_copies, release_copies, Stage};
/// The sparse-window decoder, for its fuzz target.
pub use window::sparse as sparse_window;

/// The compressed formats, known by their magic numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Codec {
    Gzip,
    Zstd,
    Xz,
    Bzip2,
}

impl Codec {
    pub fn detect(magic: &[u8; 4]) -> Option<Codec> {
        match magic {
            [0x1f, 0x8b, _, _] => Some(Codec::Gzip),
            // pzstd opens with a skippable frame.
            [0x28, 0xb5, 0x2f, 0xfd] | [0x50..=0x5f, 0x2a, 0x4d, 0x18] => Some(Codec::Zstd),
            [0xfd, b'7', b'z', b'X'] => Some(Codec::Xz),
            [b'B', b'Z', b'h', _] => Some(Codec::Bzip2),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Codec::Gzip => "gzip",
            Codec::Zstd => "zstd",
            Codec::Xz => "xz",
            Codec::Bzip2 => "bzip2",
        }
    }

    fn id(self) -> u8 {
        self as u8
    }

    /// Entry points further apart than this make a read decode for too long (a tenth of
    /// a second or so on one core: xz decodes ~40 MB/s, zstd ~1 GB/s): such an archive
    /// (a zstd archive of one frame, `xz -T0`'s 24 MiB blocks) is served from a decoded
    /// copy instead. pzstd's frames (a few MiB) and bzip2's blocks (900 kB) stay below.
    fn max_stretch(self) -> u64 {
        match self {
            Codec::Gzip | Codec::Zstd => 32 << 20,
            Codec::Xz | Codec::Bzip2 => 4 << 20,
        }
    }

    /// The codec whose `id()` is `id`.
    pub fn from_id(id: u8) -> Option<Codec> {
        [Codec::Gzip, Codec::Zstd, Codec::Xz, Codec::Bzip2]
            .into_iter()
            .find(|c| c.id() == id)
    }

    /// A decoder at the start of the archive.
    fn start(self, src: &Arc<Source>) -> Result<Box<dyn Decoder>> {
        Ok(match self {
            Codec::Gzip => Box::new(gzip::Inflate::start(src)?),
            Codec::Zstd => Box::new(zstd::Frames::resume(src, &Point::default())?),
            Codec::Xz => Box::new(serial::Serial::xz(src)?),
            Codec::Bzip2 => Box::new(serial::Serial::bzip2(src)),
        })
    }

    /// A decoder for one pass over the whole archive (the indexing pass, a decoded
    /// copy): on several threads where the format has independent pieces.
    fn stream(self, src: &Arc<Source>) -> Result<Box<dyn Decoder>> {
        let threads = threads();
        Ok(match self {
            Codec::Zstd => zstd::stream(src, threads)?,
            Codec::Xz => Box::new(serial::Serial::xz_blocks(src, threads)?),
            // On one core too: its pieces are the entry points.
            Codec::Bzip2 => Box::new(ahead::Ahead::new(
                Box::new(bzip2_blocks::Blocks::new(src)),
                bzip2_blocks::decode_blocks(src),
                threads,
                ahead::BUDGET,
            )?),
            Codec::Gzip => self.start(src)?,
        })
    }

    /// A decoder at an entry point other than the start.
    fn resume(self, src: &Arc<Source>, p: &Point, window: &[u8]) -> Result<Box<dyn Decoder>> {
        Ok(match self {
            Codec::Gzip => Box::new(gzip::Inflate::resume(src, p, window)?),
            Codec::Zstd => Box::new(zstd::Frames::resume(src, p)?),
            Codec::Bzip2 => Box::new(bzip2_blocks::BlockRun::new(src, p)),
            Codec::Xz => Box::new(xz::BlockRun::new(src, p)?),
        })
    }
}

/// A place where decoding can start: `output` bytes into the decoded stream, at byte
/// `input` of the archive. `bits`: gzip, after the last `bits` bits of the byte before;
/// bzip2, after the first `bits` bits of that byte; xz, the stream's check type.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Point {
    pub output: u64,
    pub input: u64,
    pub bits: u8,
}

/// A decoder somewhere in the archive.
pub trait Decoder: Send {
    /// Decodes into `out`; returns early (possibly with 0 bytes) at an entry point, so
    /// the caller can record it. Fewer bytes than asked does not mean the end: `ended`.
    fn read(&mut self, out: &mut [u8]) -> Result<usize>;
    /// The entry point the decoder is at, with its window, if it is at one (asked of
    /// the indexing pass's decoder only).
    fn point(&mut self) -> Option<(Point, Vec<u8>)> {
        None
    }
    fn ended(&self) -> bool;
    /// Archive bytes consumed so far, for progress bars.
    fn input_pos(&self) -> u64;
    /// Frees what can be had again (read-ahead input) before the decoder is parked.
    fn shrink(&mut self) {}
    /// Moves the decoder to entry point `p` (the start: `Point::default()`) of the
    /// archive `src` (any of the mount's), keeping its allocations; false where that is
    /// not supported.
    fn restart(&mut self, _src: &Arc<Source>, _p: &Point, _window: &[u8]) -> Result<bool> {
        Ok(false)
    }
}

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

/// Fills `out` completely unless the stream ends first; returns the bytes written.
fn fill(dec: &mut dyn Decoder, out: &mut [u8]) -> Result<usize> {
    let mut done = 0;
    while done < out.len() && !dec.ended() {
        done += dec.read(&mut out[done..])?;
    }
    Ok(done)
}

/// Decodes the start of the archive into `out`; returns the bytes decoded.
pub fn first_bytes(src: &Arc<Source>, codec: Codec, out: &mut [u8]) -> Result<usize> {
    fill(codec.start(src)?.as_mut(), out)
}

/// Archive bytes read ahead of a decoder in large `pread`s.
pub struct Input {
    src: Arc<Source>,
    buf: Vec<u8>,
    used: usize,
    /// Archive offset just past `buf`.
    next: u64,
}

const INPUT_CHUNK: u64 = 128 << 10;

impl Input {
    pub fn new(src: Arc<Source>, at: u64) -> Input {
        Input {
            src,
            buf: Vec::new(),
            used: 0,
            next: at,
        }
    }

    /// The buffered bytes, refilled when empty; `true` with an empty slice at the end
    /// of the archive.
    pub fn chunk(&mut self) -> Result<(&[u8], bool)> {
        if self.used == self.buf.len() {
            let len = INPUT_CHUNK.min(self.src.len().saturating_sub(self.next));
            self.buf.resize(len as usize, 0);
            self.src.read_exact_at(self.next, &mut self.buf)?;
            self.next += len;
            self.used = 0;
        }
        let rest = &self.buf[self.used..];
        Ok((rest, rest.is_empty()))
    }

    pub fn source(&self) -> &Arc<Source> {
        &self.src
    }

    /// Moves to offset `at` of archive `src`, keeping the buffer's memory.
    pub fn reset(&mut self, src: &Arc<Source>, at: u64) {
        if !Arc::ptr_eq(&self.src, src) {
            self.src = src.clone();
        }
        self.buf.clear();
        self.used = 0;
        self.next = at;
    }

    /// Drops the buffered input (read again from the archive when needed).
    pub fn shrink(&mut self) {
        self.next = self.pos();
        self.buf = Vec::new();
        self.used = 0;
    }

    pub fn consume(&mut self, n: usize) {
        self.used = (self.used + n).min(self.buf.len());
    }

    /// Archive offset of the next byte a decoder gets.
    pub fn pos(&self) -> u64 {
        self.next - (self.buf.len() - self.used) as u64
    }

    pub fn skip(&mut self, mut n: usize) -> Result<()> {
        while n > 0 {
            let (c, end) = self.chunk()?;
            if end {
                return Err(Error::corrupt("compressed stream is truncated"));
            }
            let k = c.len().min(n);
            self.consume(k);
            n -= k;
        }
        Ok(())
    }

    /// Copies the next bytes without consuming them; fewer at the end of the archive.
    pub fn peek(&mut self, out: &mut [u8]) -> Result<usize> {
        let at = self.pos();
        let n = (out.len() as u64).min(self.src.len().saturating_sub(at)) as usize;
        self.src.read_exact_at(at, &mut out[..n])?;
        Ok(n)
    }
}

/// The entry points of one archive; gzip windows kept sparse (`window.rs`) and
/// zstd-compressed: a window of text shrinks 3-4x compressed, one of JPEG bytes only
/// when the bytes the stream never copies from are zeroed. With them, a CRC-32
/// of every decoded block, taken in the indexing pass: a read that decodes from the
/// middle of a stream has no checksum of the format's to check (gzip's covers a whole
/// member), and damage or a change of the archive since it was indexed must give EIO,
/// not wrong bytes.
#[derive(Debug, Default)]
pub struct Points {
    points: Vec<Point>,
    windows: Vec<Box<[u8]>>,
    /// Length of the decoded stream.
    len: u64,
    /// The spacing asked for when they were recorded.
    spacing: u64,
    /// One per [`BLOCK`] of each stretch between entry points (the last one shorter).
    sums: Vec<u32>,
    /// Index in `sums` of each stretch's first block.
    first_sum: Vec<usize>,
}

/// CRCs of the decoded blocks, taken as the indexing pass decodes.
#[derive(Default)]
struct Sums {
    crc: crc32fast::Hasher,
    start: u64,
    at: u64,
    sums: Vec<u32>,
}

impl Sums {
    fn feed(&mut self, mut bytes: &[u8]) {
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
    fn close(&mut self) {
        if self.at > self.start {
            self.sums.push(std::mem::take(&mut self.crc).finalize());
        }
        self.start = self.at;
    }
}

impl Points {
    fn push(&mut self, p: Point, packed: Box<[u8]>) {
        self.points.push(p);
        self.windows.push(packed);
    }

    fn window(&self, i: usize) -> Result<Vec<u8>> {
        let w = &self.windows[i];
        if w.is_empty() {
            return Ok(Vec::new());
        }
        ::zstd::bulk::decompress(w, gzip::WINDOW)
            .map_err(|_| Error::corrupt("a saved gzip window is damaged"))
    }

    /// A decoder at entry point `i` (the first is the archive's start).
    fn decoder(&self, i: usize, codec: Codec, src: &Arc<Source>) -> Result<Box<dyn Decoder>> {
        if i == 0 {
            return codec.start(src);
        }
        codec.resume(src, &self.points[i], &self.window(i)?)
    }

    /// The entry point at or before `pos`.
    fn before(&self, pos: u64) -> usize {
        self.points
            .partition_point(|p| p.output <= pos)
            .saturating_sub(1)
    }

    /// Fills in `first_sum`; false when the sums do not match the stretches.
    fn index_sums(&mut self) -> bool {
        let mut n = 0usize;
        self.first_sum = (0..self.points.len())
            .map(|i| {
                let first = n;
                n += (self.end_of(i) - self.points[i].output).div_ceil(BLOCK) as usize;
                first
            })
            .collect();
        n == self.sums.len()
    }

    /// Checks a block decoded from stretch `i` at `at` against the indexing pass.
    fn verify(&self, i: usize, at: u64, block: &[u8]) -> Result<()> {
        let k = self.first_sum[i] + ((at - self.points[i].output) / BLOCK) as usize;
        if self.sums.get(k) != Some(&crc32fast::hash(block)) {
            return Err(Error::corrupt(format!(
                "the data decoded at {at} differs from when the archive was indexed: the \
                 compressed archive is damaged or was changed there"
            )));
        }
        Ok(())
    }

    /// Where the stretch decoded from point `i` ends.
    fn end_of(&self, i: usize) -> u64 {
        self.points.get(i + 1).map_or(self.len, |p| p.output)
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn count(&self) -> usize {
        self.points.len()
    }

    /// The longest stretch between entry points.
    fn widest(&self) -> u64 {
        (0..self.points.len())
            .map(|i| self.end_of(i) - self.points[i].output)
            .max()
            .unwrap_or(0)
    }

    /// Bytes in memory (and, give or take, on disk).
    fn bytes(&self) -> usize {
        self.points.len() * (std::mem::size_of::<Point>() + 16) + self.window_bytes()
    }

    /// The saved gzip windows' bytes, as kept (sparse and compressed).
    pub fn window_bytes(&self) -> usize {
        self.windows.iter().map(|w| w.len()).sum()
    }

    /// The form saved in the index file.
    pub fn encode(&self, codec: Codec) -> Vec<u8> {
        let mut o = Vec::with_capacity(self.bytes() + 32);
        o.push(codec.id());
        o.extend_from_slice(&self.len.to_le_bytes());
        o.extend_from_slice(&self.spacing.to_le_bytes());
        o.extend_from_slice(&(self.sums.len() as u64).to_le_bytes());
        for s in &self.sums {
            o.extend_from_slice(&s.to_le_bytes());
        }
        o.extend_from_slice(&(self.points.len() as u64).to_le_bytes());
        for (p, w) in self.points.iter().zip(&self.windows) {
            o.extend_from_slice(&p.output.to_le_bytes());
            o.extend_from_slice(&p.input.to_le_bytes());
            o.push(p.bits);
            o.extend_from_slice(&(w.len() as u32).to_le_bytes());
            o.extend_from_slice(w);
        }
        o
    }

    /// Reads what [`encode`](Self::encode) wrote, refusing anything that does not fit
    /// an archive of `archive_len` bytes in `codec`.
    pub fn decode(b: &[u8], codec: Codec, archive_len: u64) -> Option<Points> {
        let mut r = b;
        let mut take = |n: usize| -> Option<&[u8]> {
            let (h, t) = r.split_at_checked(n)?;
            r = t;
            Some(h)
        };
        let u64_ = |s: &[u8]| u64::from_le_bytes(s.try_into().unwrap());
        if take(1)?[0] != codec.id() {
            return None;
        }
        let len = u64_(take(8)?);
        let spacing = u64_(take(8)?);
        let sums = u64_(take(8)?);
        if sums > b.len() as u64 / 4 {
            return None;
        }
        let sums = (0..sums)
            .map(|_| Some(u32::from_le_bytes(take(4)?.try_into().unwrap())))
            .collect::<Option<Vec<u32>>>()?;
        let n = u64_(take(8)?);
        if n == 0 || n > b.len() as u64 / 21 {
            return None;
        }
        let mut pts = Points {
            len,
            spacing,
            sums,
            ..Points::default()
        };
        for _ in 0..n {
            let p = Point {
                output: u64_(take(8)?),
                input: u64_(take(8)?),
                bits: take(1)?[0],
            };
            let wl = u32::from_le_bytes(take(4)?.try_into().unwrap()) as usize;
            let w = take(wl)?;
            let ok = match pts.points.last() {
                None => p == Point::default(),
                Some(q) => p.output > q.output && p.input >= q.input,
            };
            let most_bits = if codec == Codec::Xz { 15 } else { 7 };
            if !ok || p.bits > most_bits || p.output >= len.max(1) || p.input > archive_len {
                return None;
            }
            pts.points.push(p);
            pts.windows.push(w.into());
        }
        (r.is_empty() && pts.index_sums()).then_some(pts)
    }
}

/// The indexing pass: the decoded stream front to back for the tar scan, which only
/// moves forward, with a short stretch kept behind for its look-backs. Entry points are
/// recorded every `spacing` bytes of output.
pub struct Scan<'a> {
    codec: Codec,
    src: Arc<Source>,
    state: Mutex<ScanState<'a>>,
}

struct ScanState<'a> {
    dec: Box<dyn Decoder>,
    src: Arc<Source>,
    /// Decoded bytes `[start, start + filled)` at the front of `buf`, which keeps its
    /// length, so decoding into it writes no zeros first.
    buf: Vec<u8>,
    filled: usize,
    start: u64,
    points: Points,
    /// The last entry point's whole window, until a window's length of output past it
    /// is decoded to check its sparse form against.
    unthinned: Option<Vec<u8>>,
    thinner: Option<window::Thinner>,
    /// Archive offset the next entry point must be past, so that saved windows stay
    /// within [`WINDOW_SHARE`] of the archive (text: each keeps a few KiB).
    next_input: u64,
    sums: Sums,
    spacing: u64,
    limit: u64,
    progress: &'a mut (dyn FnMut(u64) + Send),
}

/// Saved windows take at most 1/100 of the archive: entry points are spread further than
/// the spacing asked for where the windows do not thin (text).
const WINDOW_SHARE: u64 = 100;

/// Decoded bytes kept behind the scan; more is dropped as it moves on.
const KEEP: usize = 1 << 20;
const STEP: usize = 256 << 10;

thread_local! {
    /// The last scan's buffer on this thread (at most [`KEEP`] + 17 [`STEP`]s), already
    /// written: the threads that index a union's members go from shard to shard, and a
    /// new buffer for each was zeroed and faulted in as it grew, a fifth of the CPU of a
    /// first mount of 1,000 `.tar.zst` shards.
    static SCAN_BUFFER: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Frees this thread's kept scan buffer (once the archives are open).
pub fn drop_scan_buffer() {
    SCAN_BUFFER.set(Vec::new());
}

impl Drop for ScanState<'_> {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.buf);
        let _ = SCAN_BUFFER.try_with(|b| {
            let kept = b.take();
            b.set(if kept.len() >= buf.len() { kept } else { buf });
        });
    }
}

impl<'a> Scan<'a> {
    pub fn new(
        src: &Arc<Source>,
        codec: Codec,
        spacing: u64,
        limit: u64,
        progress: &'a mut (dyn FnMut(u64) + Send),
    ) -> Result<Scan<'a>> {
        let spacing = spacing.max(64 << 10);
        let mut points = Points {
            spacing,
            ..Points::default()
        };
        points.push(Point::default(), Box::default());
        Ok(Scan {
            codec,
            src: src.clone(),
            state: Mutex::new(ScanState {
                dec: codec.stream(src)?,
                src: src.clone(),
                buf: SCAN_BUFFER.try_with(|b| b.take()).unwrap_or_default(),
                filled: 0,
                start: 0,
                points,
                unthinned: None,
                thinner: None,
                next_input: 0,
                sums: Sums::default(),
                spacing,
                limit,
                progress,
            }),
        })
    }

    /// Decodes to the end (checking what the format checks: gzip's CRCs, zstd's
    /// checksums) and returns the entry points.
    pub fn finish(&self) -> Result<Points> {
        let mut s = self.state.lock();
        while s.more()? {}
        let end = s.end();
        s.thin(end, true)?;
        if let Some(t) = s.thinner.take() {
            for (i, packed) in t.finish()? {
                s.points.windows[i] = packed;
            }
        }
        let mut points = std::mem::take(&mut s.points);
        points.len = s.end();
        // A frame that ends the archive leaves an entry point with nothing after it.
        while points.points.len() > 1 && points.points.last().unwrap().output >= points.len {
            points.points.pop();
            points.windows.pop();
        }
        s.sums.close();
        points.sums = std::mem::take(&mut s.sums.sums);
        if !points.index_sums() {
            return Err(Error::corrupt(
                "block checksums do not match the entry points",
            ));
        }
        Ok(points)
    }
}

impl ScanState<'_> {
    fn end(&self) -> u64 {
        self.start + self.filled as u64
    }

    /// Hands the last entry point's window to be made sparse once the stream decoded up
    /// to `decoded` holds a window's length of output past it to check against (or
    /// `now`: the stream ended or another point follows).
    fn thin(&mut self, decoded: u64, now: bool) -> Result<()> {
        let Some(p) = self.points.points.last().copied() else {
            return Ok(());
        };
        if self.unthinned.is_none() || (!now && decoded < p.output + window::CHECKED as u64) {
            return Ok(());
        }
        let whole = self.unthinned.take().unwrap_or_default();
        let from = p.output.saturating_sub(self.start) as usize;
        let upto = (decoded.saturating_sub(self.start) as usize).min(from + window::CHECKED);
        let after = self.buf[..self.filled]
            .get(from..upto)
            .unwrap_or_default()
            .to_vec();
        let thinner = match &mut self.thinner {
            Some(t) => t,
            None => self.thinner.insert(window::Thinner::new(self.src.clone())?),
        };
        thinner.send(self.points.points.len() - 1, p, whole, after);
        // Windows that did not thin (text) spread the next entry points further.
        for (i, packed) in thinner.ready() {
            let at = self.points.points[i].input + packed.len() as u64 * WINDOW_SHARE;
            self.next_input = self.next_input.max(at);
            self.points.windows[i] = packed;
        }
        Ok(())
    }

    /// Decodes one step more; false at the end of the stream.
    fn more(&mut self) -> Result<bool> {
        if self.dec.ended() {
            return Ok(false);
        }
        if self.end() > self.limit {
            return Err(Error::Limit(format!(
                "the archive decodes to more than {} bytes",
                self.limit
            )));
        }
        // Dropped in large pieces, so the kept tail is moved once per few MiB decoded
        // (moving it every step cost the zstd index 2.8x its decoder's time).
        if self.filled >= KEEP + 16 * STEP {
            let drop = self.filled - KEEP;
            self.buf.copy_within(drop..self.filled, 0);
            self.filled = KEEP;
            self.start += drop as u64;
        }
        let have = self.filled;
        if self.buf.len() < have + STEP {
            self.buf.resize(have + STEP, 0);
        }
        let mut done = 0;
        while done < STEP && !self.dec.ended() {
            let n = self.dec.read(&mut self.buf[have + done..have + STEP])?;
            self.sums.feed(&self.buf[have + done..have + done + n]);
            done += n;
            // What `thin` below sees as decoded.
            self.filled = have + done;
            let at = self.start + (have + done) as u64;
            let last = self.points.points.last().map_or(0, |p| p.output);
            if at >= last + self.spacing && self.dec.input_pos() >= self.next_input {
                if let Some((p, w)) = self.dec.point() {
                    debug_assert_eq!(p.output, at);
                    self.thin(at, true)?;
                    self.points.push(p, Box::default());
                    self.unthinned = (!w.is_empty()).then_some(w);
                    self.sums.close();
                }
            }
        }
        self.thin(self.end(), false)?;
        (self.progress)(self.dec.input_pos());
        Ok(true)
    }
}

/// A random-access byte space: an archive file, or the decoded contents of a
/// compressed one. The tar scan reads through it.
pub trait Bytes: Sync {
    fn read_exact_at(&self, pos: u64, buf: &mut [u8]) -> Result<()>;
    /// The length when it is at most `upto`, else some value above `upto`: a stream
    /// being decoded knows its length only at its end.
    fn len_within(&self, upto: u64) -> Result<u64>;
    /// A hint that `[at, at + len)` is read soon.
    fn will_need(&self, _at: u64, _len: u64) {}
    fn read_vec(&self, pos: u64, len: usize) -> Result<Vec<u8>> {
        let mut v = vec![0u8; len];
        self.read_exact_at(pos, &mut v)?;
        Ok(v)
    }
}

impl Bytes for Source {
    fn read_exact_at(&self, pos: u64, buf: &mut [u8]) -> Result<()> {
        Source::read_exact_at(self, pos, buf)
    }
    fn len_within(&self, _upto: u64) -> Result<u64> {
        Ok(self.len())
    }
    fn will_need(&self, at: u64, len: u64) {
        Source::will_need(self, at, len)
    }
}

impl Bytes for Scan<'_> {
    fn read_exact_at(&self, pos: u64, out: &mut [u8]) -> Result<()> {
        let mut s = self.state.lock();
        let end = pos + out.len() as u64;
        if pos < s.start {
            // Behind what the scan keeps: decode it again from an entry point.
            drop(s);
            return self.read_behind(pos, out);
        }
        while s.end() < end {
            if !s.more()? {
                return Err(Error::corrupt(format!(
                    "the archive ends at {} bytes decoded, before the {} bytes at {pos} \
                     it needs: truncated?",
                    s.end(),
                    out.len()
                )));
            }
        }
        let from = (pos - s.start) as usize;
        out.copy_from_slice(&s.buf[from..from + out.len()]);
        Ok(())
    }

    /// Damage found on the way is reported as what it is, not as an early end.
    fn len_within(&self, upto: u64) -> Result<u64> {
        let mut s = self.state.lock();
        while s.end() < upto {
            if !s.more()? {
                return Ok(s.end());
            }
        }
        Ok(u64::MAX >> 1)
    }
}

impl Scan<'_> {
    fn read_behind(&self, pos: u64, out: &mut [u8]) -> Result<()> {
        let (mut at, mut dec) = {
            let s = self.state.lock();
            let i = s.points.before(pos);
            (
                s.points.points[i].output,
                s.points.decoder(i, self.codec, &self.src)?,
            )
        };
        let mut skip = vec![0u8; STEP];
        while at < pos {
            let n = ((pos - at) as usize).min(STEP);
            let got = fill(dec.as_mut(), &mut skip[..n])?;
            if got < n {
                return Err(Error::corrupt("the archive ends early"));
            }
            at += n as u64;
        }
        if fill(dec.as_mut(), out)? < out.len() {
            return Err(Error::corrupt("the archive ends early"));
        }
        Ok(())
    }
}

/// The decoded stream of an indexed archive, for serving reads.
pub struct Decoded {
    source: Arc<Source>,
    codec: Codec,
    points: Arc<Points>,
    /// The block cache, parked and idle decoders, spare buffers: shared with the other
    /// streams of the mount, this one's blocks keyed under `tag`.
    shared: Arc<Shared>,
    tag: u32,
    /// One decoder at a time per stretch between entry points (striped): a second reader
    /// of the same neighbourhood waits and finds the blocks cached.
    locks: Box<[Mutex<()>]>,
    /// A decoded copy: made from the start for a format without entry points inside,
    /// or by `--preload` ([`Decoded::decode_ahead`]).
    stage: std::sync::OnceLock<Arc<Stage>>,
    stage_dir: Option<std::path::PathBuf>,
    /// Bytes decoded for reads, and asked for by them: how much a read decodes in vain
    /// (logged at unmount, to tune `--entry-spacing` and `--cache-size` by).
    decoded: std::sync::atomic::AtomicU64,
    asked: std::sync::atomic::AtomicU64,
}

/// Mean decoded bytes between entry points above which reads decode far
/// ([`crate::archive::Ahead::Far`]).
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
        if asked > 0 && self.stage.get().is_none() {
            tracing::info!(
                "{}: reads asked for {} MiB and decoded {} MiB ({:.2}x); {} MiB cached, {} \
                 decoders parked (with the mount's other compressed streams)",
                self.source.path().display(),
                asked >> 20,
                decoded >> 20,
                decoded as f64 / asked as f64,
                self.shared.blocks.bytes() >> 20,
                self.shared.parked_count()
            );
        }
    }
}

/// A decoder and the decoded offset it stopped at.
type Parked = (u64, Box<dyn Decoder>);

/// Decoded blocks in the cache: large enough that a file of ~110 KiB is two or three,
/// small enough that the cache keeps the neighbourhoods in use.
const BLOCK: u64 = 64 << 10;
const LOCKS: usize = 64;
/// How far past a read a miss decodes within its member: the rest of a file read in
/// pieces (sequentially) is decoded once, and a random read in a large member does not
/// decode to the end of a long stretch.
const AHEAD: u64 = 4 << 20;

impl Decoded {
    /// `shared`: the cache and decoders of the mount's compressed streams; `stage_dir`:
    /// where a decoded copy goes when one is needed and does not fit in memory.
    pub fn new(
        source: Arc<Source>,
        codec: Codec,
        points: Points,
        shared: &Arc<Shared>,
        stage_dir: Option<&std::path::Path>,
    ) -> Result<Decoded> {
        let points = Arc::new(points);
        let (shared, tag) = shared.place(points.len());
        let spread = points.spacing.saturating_mul(4);
        let stage_now = if points.widest() > codec.max_stretch().max(spread)
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
            Some(Stage::start(
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
            shared,
            tag,
            locks: (0..LOCKS).map(|_| Mutex::new(())).collect(),
            stage: stage_now.map_or_else(std::sync::OnceLock::new, std::sync::OnceLock::from),
            stage_dir: stage_dir.map(std::path::Path::to_path_buf),
            decoded: Default::default(),
            asked: Default::default(),
        })
    }

    pub fn source(&self) -> &Source {
        &self.source
    }

    pub fn codec(&self) -> Codec {
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
        self.stage.get().is_some_and(|s| !s.parallel())
    }

    /// Starts decoding the whole archive in the background, on every core from the
    /// entry points, into a copy later reads are served from; until a stretch is copied
    /// its reads decode it in place.
    pub fn decode_ahead(&self, which: crate::archive::Ahead) {
        use crate::archive::Ahead;
        let far = self.points.len() / self.points.count() as u64 > FAR;
        if self.stage.get().is_some() || (which == Ahead::Far && !far) {
            return;
        }
        let memory_only = which != Ahead::Any;
        let threads = threads();
        match Stage::start_parallel(
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
                let _ = self.stage.set(s);
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
        self.stage.get().is_some_and(|s| !s.complete())
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
        if let Some(stage) = self.stage.get() {
            let mut out = Buf::take(len);
            if stage.try_read(pos, &mut out, &|i| self.decoder(i), &|d| self.retire(d))? {
                return Ok(Data::Owned(out));
            }
        }
        let mut out: Option<Buf> = None;
        let mut at = pos;
        while at < end {
            let i = self.points.before(at);
            let base = self.points.points[i].output;
            let key = base + (at - base) / BLOCK * BLOCK;
            let block = match self.shared.blocks.get(self.key(key)) {
                Some(b) => b,
                None => self.decode(i, key, horizon.clamp(end, end + AHEAD))?,
            };
            let from = (at - key) as usize;
            let upto = (end - key).min(block.len() as u64) as usize;
            if from >= upto {
                return Err(Error::corrupt("decoded block is shorter than expected"));
            }
            if upto == block.len() {
                self.shared.blocks.demote(self.key(key));
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
        let blocks = &self.shared.blocks;
        if let Some(b) = blocks.get(self.key(key)) {
            return Ok(b); // decoded while we waited
        }
        let p = self.points.points[i];
        let stop = self.points.end_of(i);
        // Only gzip's decoders are parked where they stop: other formats decode the
        // whole stretch (a zstd frame, a bzip2 block), or each later read of it would
        // decode from its start again (pzstd's frames: 33x the bytes read).
        let horizon = match self.codec {
            Codec::Gzip => horizon.clamp(key + 1, stop),
            _ => stop,
        };
        let (mut at, mut dec) = match self.shared.unpark(self.tag, i) {
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
                .or_else(|| self.shared.spare_block())
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
            self.shared.keep_block(b);
        }
        // A zstd decoder holds its frame's window (pzstd: several MiB): not worth keeping.
        if at < stop && self.codec == Codec::Gzip {
            dec.shrink();
            if let Some((_, d)) = self.shared.park(self.tag, i, (at, dec)) {
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
        if self.codec == Codec::Gzip {
            if let Some(mut d) = self.shared.idle_decoder() {
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
        if self.codec != Codec::Gzip {
            return;
        }
        self.shared.retire(d);
    }

    /// The cache key of this stream's decoded offset `at`.
    fn key(&self, at: u64) -> u64 {
        Shared::key(self.tag, at)
    }
}
