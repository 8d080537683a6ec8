//! The indexing pass over a compressed archive: decodes it once, front to back, for the
//! tar scan, and records the entry points on the way.

use std::sync::Arc;

use super::sums::Sums;
use super::{fill, window, Bytes, Compression, Decoder, Point, Points};
use crate::error::{Error, Result};
use crate::source::Source;
use crate::sync::Mutex;

/// The indexing pass: the decoded stream front to back for the tar scan, which only
/// moves forward, with a short stretch kept behind for its look-backs. Entry points are
/// recorded every `spacing` bytes of output.
pub struct Scan<'a> {
    codec: Compression,
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
        codec: Compression,
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
