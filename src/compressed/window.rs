//! Sparse gzip windows: of the 32 KiB window saved with an entry point, only the bytes
//! the deflate stream after it copies from are needed to resume there. The others are
//! zeroed, so the saved window compresses to almost nothing when the data does not (a
//! window of JPEG bytes is referred to in a few places; rapidgzip saves its windows
//! the same way).
//!
//! Finding those bytes means following the stream's Huffman codes for one window's
//! length of output: [`sparse`] decodes it here (as zlib's puff.c does, with tables),
//! and its output is compared with what the indexing pass decoded, so a window is only
//! thinned when this decoder read the stream exactly as zlib did.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;

use super::gzip::WINDOW;
use super::Point;
use crate::error::{Error, Result};
use crate::source::Source;

/// Archive bytes the check of a sparse window may read past its entry point: a
/// window's length of output takes at most ~33 KiB of deflate input (stored blocks).
const INPUT: u64 = 128 << 10;
/// Output past an entry point compared with the sparse decoder's: past a window's
/// length it copies nothing from the window; the last copy may reach 258 bytes further
/// (a stored block's bytes are literals).
pub const CHECKED: usize = WINDOW + 258;

/// A window as saved: zstd-compressed.
pub fn pack(window: &[u8]) -> Box<[u8]> {
    if window.is_empty() {
        return Box::default();
    }
    ::zstd::bulk::compress(window, 1)
        .unwrap_or_default()
        .into_boxed_slice()
}

/// Windows queued to every thinner at once (each ~65 KiB with the output after it): a
/// union's first mount indexes 16 shards side by side on 2 cores, and their threads'
/// queues of 64 held 67 MB. Past this bound an indexing pass thins its own.
static QUEUED: AtomicUsize = AtomicUsize::new(0);
const QUEUED_MAX: usize = 64;

/// Thins and packs the indexing pass's windows on a thread of its own: the pass keeps
/// one core busy inflating, and the sparse decoder's work (a window's length of output
/// per entry point) then costs it nothing.
pub struct Thinner {
    src: Arc<Source>,
    jobs: Option<mpsc::SyncSender<Job>>,
    done: mpsc::Receiver<(usize, Box<[u8]>)>,
    worker: Option<std::thread::JoinHandle<()>>,
    /// Windows sent, and handed back.
    sent: usize,
    back: usize,
    got: Vec<(usize, Box<[u8]>)>,
}

/// Entry point `i`'s whole window and the output that follows it (up to [`CHECKED`]).
struct Job {
    i: usize,
    p: Point,
    window: Vec<u8>,
    after: Vec<u8>,
}

impl Thinner {
    pub fn new(src: Arc<Source>) -> Result<Thinner> {
        let (jobs, todo) = mpsc::sync_channel::<Job>(QUEUED_MAX);
        let (tell, done) = mpsc::channel();
        let from = src.clone();
        let worker = std::thread::Builder::new()
            .name("archfs-windows".into())
            .spawn(move || {
                // Every job is taken off the queue and the count, even once no one
                // waits for the result.
                let mut told = true;
                for job in todo {
                    if told {
                        let packed = thin_and_pack(&from, &job);
                        told = tell.send((job.i, packed)).is_ok();
                    }
                    QUEUED.fetch_sub(1, Ordering::AcqRel);
                }
            })
            .map_err(|e| Error::io("cannot start the window thread", e))?;
        Ok(Thinner {
            src,
            jobs: Some(jobs),
            done,
            worker: Some(worker),
            sent: 0,
            back: 0,
            got: Vec::new(),
        })
    }

    pub fn send(&mut self, i: usize, p: Point, window: Vec<u8>, after: Vec<u8>) {
        let job = Job {
            i,
            p,
            window,
            after,
        };
        if QUEUED.fetch_add(1, Ordering::AcqRel) >= QUEUED_MAX {
            QUEUED.fetch_sub(1, Ordering::AcqRel);
            let packed = thin_and_pack(&self.src, &job);
            self.got.push((i, packed));
            return;
        }
        match &self.jobs {
            Some(jobs) if jobs.send(job).is_ok() => self.sent += 1,
            _ => {
                QUEUED.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }

    /// The windows packed so far, not waiting for more.
    pub fn ready(&mut self) -> impl Iterator<Item = (usize, Box<[u8]>)> + '_ {
        let before = self.got.len();
        self.got.extend(self.done.try_iter());
        self.back += self.got.len() - before;
        self.got.drain(..)
    }

    /// Waits for every window sent.
    pub fn finish(mut self) -> Result<Vec<(usize, Box<[u8]>)>> {
        self.jobs = None;
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
        let mut all: Vec<_> = self.done.try_iter().collect();
        if self.back + all.len() != self.sent {
            return Err(Error::corrupt("the window thread stopped early"));
        }
        // With those an indexing pass thinned itself (past the bound on queued windows).
        all.append(&mut self.got);
        Ok(all)
    }
}

/// The window thinned where the check allows it, packed.
fn thin_and_pack(src: &Source, job: &Job) -> Box<[u8]> {
    let thin = checked(src, job);
    pack(thin.as_deref().unwrap_or(&job.window))
}

/// The job's window made sparse, if the sparse decoder made the output the indexing
/// pass did.
fn checked(src: &Source, job: &Job) -> Option<Vec<u8>> {
    let p = &job.p;
    let from = p.input.checked_sub(u64::from(p.bits > 0))?;
    let len = INPUT.min(src.len().saturating_sub(from)) as usize;
    let input = src.read_vec(from, len).ok()?;
    let (prev, input) = match p.bits {
        0 => (0, &input[..]),
        _ => (*input.first()?, input.get(1..)?),
    };
    let (thin, made) = sparse(&job.window, input, p.bits, prev)?;
    let made = &made[..made.len().min(CHECKED)];
    (job.after.get(..made.len())? == made).then_some(thin)
}

/// Follows the deflate stream in `input` (starting `bits` bits before its first byte, in
/// the top of `prev`) from a block boundary until it has made a window's length of
/// output or ends; returns the window with the bytes it never copies from zeroed, and
/// the output it made. `None` when the stream cannot be followed that far in `input`
/// or is invalid: the caller keeps the whole window.
pub fn sparse(window: &[u8], input: &[u8], bits: u8, prev: u8) -> Option<(Vec<u8>, Vec<u8>)> {
    let mut r = Bits {
        src: input,
        pos: 0,
        buf: if bits > 0 {
            u64::from(prev >> (8 - bits))
        } else {
            0
        },
        n: u32::from(bits),
    };
    let wl = window.len();
    let mut used = vec![false; wl];
    // The window then the output, so a copy is one slice operation either way.
    let mut out = Vec::with_capacity(wl + WINDOW + 258);
    out.extend_from_slice(window);
    let mut fixed: Option<(Huffman, Huffman)> = None;
    while out.len() - wl < WINDOW {
        let last = r.take(1)? == 1;
        match r.take(2)? {
            0 => {
                r.align();
                let len = r.take(16)?;
                if len != !r.take(16)? & 0xffff {
                    return None;
                }
                for _ in 0..len {
                    out.push(r.take(8)? as u8);
                }
            }
            1 => {
                let (lit, dist) = fixed.get_or_insert_with(fixed_codes);
                codes(&mut r, lit, dist, &mut out, &mut used)?;
            }
            2 => {
                let (lit, dist) = dynamic_codes(&mut r)?;
                codes(&mut r, &lit, &dist, &mut out, &mut used)?;
            }
            _ => return None,
        }
        if last {
            break; // the member ends; a next one starts with no window
        }
    }
    let thin = window
        .iter()
        .zip(&used)
        .map(|(&b, &u)| if u { b } else { 0 })
        .collect();
    out.drain(..wl);
    Some((thin, out))
}

/// Little-endian bit reader over a slice.
struct Bits<'a> {
    src: &'a [u8],
    pos: usize,
    buf: u64,
    n: u32,
}

impl Bits<'_> {
    /// Buffers at least `k` (at most 32) bits; false when the input runs out first.
    fn fill(&mut self, k: u32) -> bool {
        while self.n < k {
            let Some(&b) = self.src.get(self.pos) else {
                return false;
            };
            self.buf |= u64::from(b) << self.n;
            self.pos += 1;
            self.n += 8;
        }
        true
    }

    fn take(&mut self, k: u32) -> Option<u32> {
        if !self.fill(k) {
            return None;
        }
        let v = (self.buf & ((1u64 << k) - 1)) as u32;
        self.buf >>= k;
        self.n -= k;
        Some(v)
    }

    /// Drops the bits up to the next byte boundary (a stored block's start).
    fn align(&mut self) {
        let k = self.n % 8;
        self.buf >>= k;
        self.n -= k;
    }

    fn decode(&mut self, h: &Huffman) -> Option<u16> {
        // Near the end of the input fewer bits may be there than the longest code.
        self.fill(h.bits);
        let e = h.table[(self.buf & ((1u64 << h.bits) - 1)) as usize];
        let len = u32::from(e & 15);
        if len == 0 || len > self.n {
            return None;
        }
        self.buf >>= len;
        self.n -= len;
        Some(e >> 4)
    }
}

/// A canonical Huffman code as one table indexed by the next `bits` input bits: each
/// entry is `symbol << 4 | code length` (0: no such code).
struct Huffman {
    table: Vec<u16>,
    bits: u32,
}

impl Huffman {
    fn new(lengths: &[u8]) -> Option<Huffman> {
        let mut count = [0u16; 16];
        for &l in lengths {
            count[usize::from(l)] += 1;
        }
        count[0] = 0;
        // Over-subscribed codes are invalid; incomplete ones are allowed (a lone
        // distance code) and their missing entries stay 0.
        let mut left = 1i32;
        for &c in &count[1..] {
            left = (left << 1) - i32::from(c);
            if left < 0 {
                return None;
            }
        }
        let bits = (1..16).rev().find(|&l| count[l] > 0).unwrap_or(1) as u32;
        let mut next = [0u32; 16];
        let mut code = 0u32;
        for l in 1..16 {
            code = (code + u32::from(count[l - 1])) << 1;
            next[l] = code;
        }
        let mut table = vec![0u16; 1 << bits];
        for (sym, &l) in lengths.iter().enumerate() {
            if l == 0 {
                continue;
            }
            let l = u32::from(l);
            let c = next[l as usize];
            next[l as usize] += 1;
            let rev = (c.reverse_bits() >> (32 - l)) as usize;
            for e in table.iter_mut().skip(rev).step_by(1 << l) {
                *e = (sym as u16) << 4 | l as u16;
            }
        }
        Some(Huffman { table, bits })
    }
}

fn fixed_codes() -> (Huffman, Huffman) {
    let mut l = [0u8; 288];
    l[..144].fill(8);
    l[144..256].fill(9);
    l[256..280].fill(7);
    l[280..].fill(8);
    (
        Huffman::new(&l).expect("fixed code"),
        Huffman::new(&[5u8; 30]).expect("fixed code"),
    )
}

const CL_ORDER: [usize; 19] = [
    16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15,
];

fn dynamic_codes(r: &mut Bits) -> Option<(Huffman, Huffman)> {
    let nlit = r.take(5)? as usize + 257;
    let ndist = r.take(5)? as usize + 1;
    let ncl = r.take(4)? as usize + 4;
    if nlit > 286 || ndist > 30 {
        return None;
    }
    let mut cl = [0u8; 19];
    for &i in &CL_ORDER[..ncl] {
        cl[i] = r.take(3)? as u8;
    }
    let cl = Huffman::new(&cl)?;
    let mut lengths = Vec::with_capacity(nlit + ndist);
    while lengths.len() < nlit + ndist {
        let (value, times) = match r.decode(&cl)? {
            s @ 0..=15 => (s as u8, 1),
            16 => (*lengths.last()?, 3 + r.take(2)?),
            17 => (0, 3 + r.take(3)?),
            18 => (0, 11 + r.take(7)?),
            _ => return None,
        };
        if lengths.len() + times as usize > nlit + ndist {
            return None;
        }
        lengths.extend(std::iter::repeat_n(value, times as usize));
    }
    if lengths[256] == 0 {
        return None; // no end-of-block code
    }
    Some((
        Huffman::new(&lengths[..nlit])?,
        Huffman::new(&lengths[nlit..])?,
    ))
}

const LEN_BASE: [u16; 29] = [
    3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 15, 17, 19, 23, 27, 31, 35, 43, 51, 59, 67, 83, 99, 115, 131,
    163, 195, 227, 258,
];
const LEN_EXTRA: [u8; 29] = [
    0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0,
];
const DIST_BASE: [u16; 30] = [
    1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33, 49, 65, 97, 129, 193, 257, 385, 513, 769, 1025, 1537,
    2049, 3073, 4097, 6145, 8193, 12289, 16385, 24577,
];
const DIST_EXTRA: [u8; 30] = [
    0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13,
    13,
];

/// One block's codes, to its end or until a window's length of output is made; copies
/// that reach into the window mark the bytes they take.
fn codes(
    r: &mut Bits,
    lit: &Huffman,
    dist: &Huffman,
    out: &mut Vec<u8>,
    used: &mut [bool],
) -> Option<()> {
    let wl = used.len();
    while out.len() - wl < WINDOW {
        let sym = usize::from(r.decode(lit)?);
        if sym < 256 {
            out.push(sym as u8);
            continue;
        }
        if sym == 256 {
            return Some(());
        }
        let i = sym - 257;
        let len = usize::from(*LEN_BASE.get(i)?) + r.take(u32::from(LEN_EXTRA[i]))? as usize;
        let j = usize::from(r.decode(dist)?);
        let d = usize::from(*DIST_BASE.get(j)?) + r.take(u32::from(DIST_EXTRA[j]))? as usize;
        let from = out.len().checked_sub(d)?;
        for u in used.iter_mut().take(wl.min(from + len)).skip(from) {
            *u = true;
        }
        for k in from..from + len {
            out.push(out[k]);
        }
    }
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use libz_rs_sys as z;

    /// Raw deflate of `data` at `level`: one stream, so its blocks copy from across
    /// their boundaries as real archives' do.
    fn deflate(data: &[u8], level: i32) -> Vec<u8> {
        let mut strm = Box::<z::z_stream>::default();
        let mut out = vec![0u8; data.len() + data.len() / 10 + 1024];
        // SAFETY: buffers live across the calls and are as long as declared.
        unsafe {
            assert_eq!(
                z::deflateInit2_(
                    &mut *strm,
                    level,
                    z::Z_DEFLATED,
                    -15,
                    8,
                    z::Z_DEFAULT_STRATEGY,
                    z::zlibVersion(),
                    std::mem::size_of::<z::z_stream>() as i32,
                ),
                z::Z_OK
            );
            strm.next_in = data.as_ptr();
            strm.avail_in = data.len() as u32;
            strm.next_out = out.as_mut_ptr();
            strm.avail_out = out.len() as u32;
            assert_eq!(z::deflate(&mut *strm, z::Z_FINISH), z::Z_STREAM_END);
            out.truncate(strm.total_out as usize);
            z::deflateEnd(&mut *strm);
        }
        out
    }

    /// A raw inflate stream (no zlib or gzip wrapper), to be ended by the caller;
    /// boxed, as zlib's state points back at it.
    fn raw_inflate() -> Box<z::z_stream> {
        let mut strm = Box::<z::z_stream>::default();
        // SAFETY: a zeroed stream, initialised once.
        let rc = unsafe {
            z::inflateInit2_(
                &mut *strm,
                -15,
                z::zlibVersion(),
                std::mem::size_of::<z::z_stream>() as i32,
            )
        };
        assert_eq!(rc, z::Z_OK);
        strm
    }

    /// A block boundary: input byte, bits before it, output, window.
    type Boundary = (usize, u8, usize, Vec<u8>);

    /// Every block boundary of a raw deflate stream, and its output.
    fn boundaries(stream: &[u8]) -> (Vec<Boundary>, Vec<u8>) {
        let mut strm = raw_inflate();
        let mut out = vec![0u8; 64 << 20];
        let mut found = Vec::new();
        // SAFETY: as above; the stream is fed whole, the output is large enough.
        unsafe {
            strm.next_in = stream.as_ptr();
            strm.avail_in = stream.len() as u32;
            strm.next_out = out.as_mut_ptr();
            strm.avail_out = out.len() as u32;
            loop {
                let rc = z::inflate(&mut *strm, z::Z_BLOCK);
                if rc == z::Z_STREAM_END {
                    break;
                }
                assert_eq!(rc, z::Z_OK);
                if strm.data_type & 0xc0 == 0x80 {
                    let mut w = vec![0u8; WINDOW];
                    let mut wl = 0u32;
                    z::inflateGetDictionary(&*strm, w.as_mut_ptr(), &mut wl);
                    w.truncate(wl as usize);
                    found.push((
                        strm.total_in as usize,
                        (strm.data_type & 7) as u8,
                        strm.total_out as usize,
                        w,
                    ));
                }
            }
            out.truncate(strm.total_out as usize);
            z::inflateEnd(&mut *strm);
        }
        (found, out)
    }

    /// Text with repeats (many copies into the window) and stretches of noise (few).
    fn mixed(len: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(len);
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let words = ["archfs ", "squashfs ", "tar ", "window ", "deflate ", "\n"];
        while v.len() < len {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if (v.len() >> 16) % 3 == 2 {
                v.push(x as u8); // noise
            } else {
                v.extend_from_slice(words[(x % 6) as usize].as_bytes());
            }
        }
        v.truncate(len);
        v
    }

    #[test]
    fn thinned_windows_resume_every_block_boundary() {
        let data = mixed(3 << 20);
        for level in [2, 6, 9] {
            let stream = deflate(&data, level);
            let (points, all) = boundaries(&stream);
            assert_eq!(all, data);
            assert!(points.len() > 10, "level {level}: {} blocks", points.len());
            let mut zeroed = 0;
            for (input, bits, output, window) in &points {
                if window.len() < WINDOW || *output == data.len() {
                    continue;
                }
                let prev = stream[input - 1];
                let (thin, made) = sparse(window, &stream[*input..], *bits, prev)
                    .unwrap_or_else(|| panic!("level {level}: block at {input} not followed"));
                assert_eq!(made, data[*output..(output + made.len())]);
                assert!(made.len() >= WINDOW.min(data.len() - output));
                zeroed += thin.iter().zip(window).filter(|(t, w)| t != w).count();
                // zlib resumes from the thinned window and makes the same bytes.
                assert_eq!(
                    resume(&stream, *input, *bits, &thin, 256 << 10),
                    data[*output..(output + (256 << 10)).min(data.len())],
                    "level {level}, block at {input}"
                );
            }
            assert!(zeroed > 0, "level {level}: nothing thinned");
        }
    }

    fn resume(stream: &[u8], input: usize, bits: u8, window: &[u8], len: usize) -> Vec<u8> {
        let mut strm = raw_inflate();
        let mut out = vec![0u8; len];
        // SAFETY: as above.
        unsafe {
            if bits > 0 {
                z::inflatePrime(
                    &mut *strm,
                    i32::from(bits),
                    i32::from(stream[input - 1]) >> (8 - bits),
                );
            }
            z::inflateSetDictionary(&mut *strm, window.as_ptr(), window.len() as u32);
            strm.next_in = stream[input..].as_ptr();
            strm.avail_in = (stream.len() - input) as u32;
            strm.next_out = out.as_mut_ptr();
            strm.avail_out = len as u32;
            let rc = z::inflate(&mut *strm, z::Z_SYNC_FLUSH);
            assert!(rc == z::Z_OK || rc == z::Z_STREAM_END, "zlib {rc}");
            out.truncate(strm.total_out as usize);
            z::inflateEnd(&mut *strm);
        }
        out
    }

    #[test]
    fn noise_windows_are_mostly_zeroed() {
        let mut data = mixed(64 << 10);
        let mut x = 7u64;
        data.extend((0..(2 << 20)).map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 33) as u8
        }));
        let stream = deflate(&data, 6);
        let (points, _) = boundaries(&stream);
        let (input, bits, _, window) = points
            .iter()
            .find(|p| p.2 > (1 << 20) && p.3.len() == WINDOW)
            .expect("a block boundary in the noise");
        let (thin, _) = sparse(window, &stream[*input..], *bits, stream[input - 1]).unwrap();
        let kept = thin.iter().filter(|&&b| b != 0).count();
        assert!(kept < WINDOW / 20, "{kept} of {WINDOW} bytes kept");
    }

    #[test]
    fn damage_is_not_followed() {
        let data = mixed(1 << 20);
        let stream = deflate(&data, 6);
        let (points, _) = boundaries(&stream);
        let (input, bits, _, window) = &points[points.len() / 2];
        // A truncated input cannot make a window's length of output.
        assert!(sparse(
            window,
            &stream[*input..input + 16],
            *bits,
            stream[input - 1]
        )
        .is_none());
        // Reserved block type 3.
        assert!(sparse(window, &[0xff; 64], 0, 0).is_none());
    }
}
