//! zstd: every frame starts a fresh decoder, so each frame boundary is an entry point
//! that needs no saved state (pzstd, `zstd --block-size`-style writers and the seekable
//! format cut their output into frames; `zstd -T0` and `tar --zstd` write one frame).

use zstd::zstd_safe::{
    decompress_bound, find_frame_compressed_size, get_error_name, DCtx, InBuffer, OutBuffer,
};

use super::parallel_decoder::{DecodeFn, ParallelDecoder, Piece, Split};
use super::read_window::ReadWindow;
use super::{Decoder, Input, Point};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::source::Source;

pub struct Frames {
    dctx: DCtx<'static>,
    input: Input,
    out: u64,
    /// Between frames: the next input byte starts one.
    between: bool,
    ended: bool,
}

impl Frames {
    /// A decoder at the frame that starts at `p` (the archive's start is one).
    pub fn resume(src: &Arc<Source>, p: &Point) -> Result<Frames> {
        Ok(Frames {
            dctx: DCtx::create(),
            input: Input::new(src.clone(), p.input),
            out: p.output,
            between: true,
            ended: false,
        })
    }
}

impl Decoder for Frames {
    fn read(&mut self, out: &mut [u8]) -> Result<usize> {
        let mut done = 0;
        while done < out.len() && !self.ended {
            let (chunk, at_end) = self.input.chunk()?;
            if at_end {
                if self.between {
                    self.ended = true;
                    break;
                }
                return Err(Error::corrupt(format!(
                    "zstd stream is truncated at offset {}",
                    self.input.pos()
                )));
            }
            let mut inb = InBuffer::around(chunk);
            let mut outb = OutBuffer::around(&mut out[done..]);
            let rc = self.dctx.decompress_stream(&mut outb, &mut inb);
            let (used, made) = (inb.pos(), outb.pos());
            self.input.consume(used);
            done += made;
            self.out += made as u64;
            match rc {
                Ok(0) => {
                    self.between = true;
                    break; // a frame ended: an entry point
                }
                Ok(_) => self.between = false,
                Err(code) => {
                    return Err(Error::corrupt(format!(
                        "zstd data is damaged near offset {} ({})",
                        self.input.pos(),
                        get_error_name(code)
                    )))
                }
            }
        }
        Ok(done)
    }

    fn point(&mut self) -> Option<(Point, Vec<u8>)> {
        (self.between && !self.ended).then(|| {
            (
                Point {
                    output: self.out,
                    input: self.input.pos(),
                    bits: 0,
                },
                Vec::new(),
            )
        })
    }

    fn ended(&self) -> bool {
        self.ended
    }

    fn input_pos(&self) -> u64 {
        self.input.pos()
    }
}

/// A pass over the whole archive: its frames decoded on `threads` threads when it has
/// several, else one decoder.
pub fn stream(src: &Arc<Source>, threads: usize) -> Result<Box<dyn Decoder>> {
    let mut split = FrameSplit {
        window: ReadWindow::new(src),
        at: 0,
    };
    let several = threads > 1
        && match split.frame(PROBE)? {
            Some(p) => p.end < src.len(),
            None => false,
        };
    if !several {
        return Ok(Box::new(Frames::resume(src, &Point::default())?));
    }
    split.at = 0;
    Ok(Box::new(ParallelDecoder::new(
        Box::new(split),
        decode_frames(src),
        threads,
        super::parallel_decoder::BUDGET,
    )?))
}

/// How far the first frame is followed to tell a multi-frame archive: a frame longer
/// than this is decoded by one thread anyway.
const PROBE: u64 = 256 << 20;
const ZSTD_MAGIC: u32 = 0xfd2f_b528;
/// The skippable frame pzstd writes before each frame.
const PZSTD_MAGIC: u32 = 0x184d_2a50;

/// A skippable frame's magic: 0x184d2a50 to 0x184d2a5f.
fn skippable(magic: u32) -> bool {
    magic & 0xffff_fff0 == PZSTD_MAGIC
}
/// Frames up to this size (compressed, and decoded) are decoded in one call.
const WHOLE: u64 = 32 << 20;
/// Decoded bytes handed on at a time.
const CHUNK: usize = 1 << 20;

/// Finds frames from their headers and block headers, without decoding.
struct FrameSplit {
    window: ReadWindow,
    at: u64,
}

impl FrameSplit {
    /// `N` bytes read on their own, not through the window: frame headers read so are
    /// all the splitter reads of a pzstd archive.
    fn peek<const N: usize>(&mut self, at: u64) -> Result<[u8; N]> {
        let mut b = [0u8; N];
        if at + N as u64 > self.window.len() {
            return Err(Error::corrupt(format!(
                "zstd stream is truncated at offset {at}"
            )));
        }
        self.window.src().read_exact_at(at, &mut b)?;
        Ok(b)
    }

    /// pzstd puts a 4-byte skippable frame holding the next frame's compressed size
    /// before each frame: with it the frame is found from its two ends, without reading
    /// its block headers, which are spread through all of it. Trusted only when a frame
    /// starts there and the archive ends or another frame starts after it; the decoder
    /// checks the frame ends there.
    fn hinted(&mut self, magic: u32, size: u32, limit: u64) -> Result<Option<Piece>> {
        if magic != PZSTD_MAGIC || size != 4 {
            return Ok(None);
        }
        let start = self.at;
        let len = u64::from(u32::from_le_bytes(self.peek(start - 4)?));
        let end = start + len;
        if len < 6 || len > limit || end > self.window.len() {
            return Ok(None);
        }
        let ok = |m: u32| m == ZSTD_MAGIC || skippable(m);
        if !ok(u32::from_le_bytes(self.peek(start)?))
            || end + 4 <= self.window.len() && !ok(u32::from_le_bytes(self.peek(end)?))
            || end < self.window.len() && end + 4 > self.window.len()
        {
            return Ok(None);
        }
        Ok(Some(Piece { input: start, end }))
    }

    fn read<const N: usize>(&mut self, at: u64) -> Result<[u8; N]> {
        match self.window.get(at, N)? {
            Some(b) => Ok(b.try_into().expect("N bytes")),
            None => Err(Error::corrupt(format!(
                "zstd stream is truncated at offset {at}"
            ))),
        }
    }

    /// The next frame (skipping skippable frames), if it ends within `limit` bytes.
    fn frame(&mut self, limit: u64) -> Result<Option<Piece>> {
        loop {
            if self.at >= self.window.len() {
                return Ok(None);
            }
            let start = self.at;
            let magic = u32::from_le_bytes(self.peek(start)?);
            if skippable(magic) {
                let size = u32::from_le_bytes(self.peek(start + 4)?);
                self.at = start + 8 + u64::from(size);
                if let Some(piece) = self.hinted(magic, size, limit)? {
                    self.at = piece.end;
                    return Ok(Some(piece));
                }
                continue;
            }
            if magic != ZSTD_MAGIC {
                return Err(Error::corrupt(format!(
                    "zstd data is damaged near offset {start} (no frame starts there)"
                )));
            }
            let [fhd] = self.read(start + 4)?;
            let single = fhd >> 5 & 1;
            let fcs = match fhd >> 6 {
                0 => u64::from(single),
                1 => 2,
                2 => 4,
                _ => 8,
            };
            let did = [0, 1, 2, 4][usize::from(fhd & 3)];
            let mut at = start + 5 + u64::from(1 - single) + did + fcs;
            loop {
                if at - start > limit {
                    return Ok(None);
                }
                let h = self.read::<3>(at)?;
                let h = u32::from(h[0]) | u32::from(h[1]) << 8 | u32::from(h[2]) << 16;
                let size = u64::from(h >> 3);
                at += 3 + match h >> 1 & 3 {
                    0 | 2 => size,
                    1 => 1,
                    _ => {
                        return Err(Error::corrupt(format!(
                            "zstd data is damaged near offset {at} (reserved block type)"
                        )))
                    }
                };
                if h & 1 == 1 {
                    break;
                }
            }
            at += u64::from(fhd >> 2 & 1) * 4;
            if at > self.window.len() {
                return Err(Error::corrupt(format!(
                    "zstd stream is truncated at offset {}",
                    self.window.len()
                )));
            }
            self.at = at;
            return Ok(Some(Piece {
                input: start,
                end: at,
            }));
        }
    }
}

impl Split for FrameSplit {
    fn next(&mut self) -> Result<Option<Piece>> {
        self.frame(u64::MAX)
    }
}

thread_local! {
    /// A worker's copy of the frame it decodes, kept for the next.
    static FRAME: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    /// Its decoded output buffer.
    static OUT: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Decodes a frame read whole into memory with one call into a buffer its blocks say it
/// fits (stored blocks copied once, not through the decoder's window as well): a warm
/// pzstd index took 0.18-0.20 s so against 0.24-0.32 s streaming. False when its decoded
/// size could pass [`WHOLE`]; the caller streams it then.
fn whole_frame(
    src: &Source,
    dctx: &mut DCtx<'static>,
    piece: Piece,
    out: &mut Vec<u8>,
) -> Result<bool> {
    FRAME.with_borrow_mut(|frame| {
        let len = (piece.end - piece.input) as usize;
        if frame.len() < len {
            frame.resize(len, 0);
        }
        let frame = &mut frame[..len];
        src.read_exact_at(piece.input, frame)?;
        let damaged = |code| {
            Error::corrupt(format!(
                "zstd data is damaged in the frame at offset {} ({})",
                piece.input,
                get_error_name(code)
            ))
        };
        if find_frame_compressed_size(frame).map_err(damaged)? != len {
            return Err(Error::corrupt(format!(
                "zstd frame at offset {} does not end where its size says",
                piece.input
            )));
        }
        let bound = decompress_bound(frame).map_err(damaged)?;
        if bound > WHOLE {
            return Ok(false);
        }
        out.clear();
        out.reserve(bound as usize);
        dctx.decompress(out, frame).map_err(damaged)?;
        Ok(true)
    })
}

/// Decodes one frame, checking it ends where its headers said.
fn decode_frames(src: &Arc<Source>) -> Arc<DecodeFn> {
    let src = src.clone();
    Arc::new(
        move |piece: Piece, emit: &mut dyn FnMut(&mut Vec<u8>) -> bool| {
            let mut dctx = DCtx::create();
            // A frame decoded whole is read in one call, which the kernel reads ahead as
            // one batch; advising it (or 32 MiB past it) first made a cold first index of
            // the bench's tar.zst 0.49-0.71 s against 0.38-0.42 s in 4 of 5 runs without
            // (0.66 s in one; page reporting off; `zstd -T1 -dc` 0.39-0.43 s).
            if piece.end - piece.input <= WHOLE {
                // The buffer the sink hands back is this thread's for the next frame.
                let mut out = OUT.take();
                let whole = whole_frame(&src, &mut dctx, piece, &mut out)?;
                if whole && !out.is_empty() {
                    emit(&mut out);
                }
                OUT.set(out);
                if whole {
                    return Ok(());
                }
            }
            // Workers read different frames through one descriptor, whose readahead the
            // kernel then turns down as for random reads: ask for the frame at once.
            src.will_need(piece.input, piece.end - piece.input);
            let mut input = Input::new(src.clone(), piece.input);
            let mut out = vec![0u8; CHUNK];
            let mut made = 0;
            loop {
                let left = (piece.end - input.pos()) as usize;
                let (chunk, _) = input.chunk()?;
                let chunk = &chunk[..chunk.len().min(left)];
                let mut inb = InBuffer::around(chunk);
                let mut outb = OutBuffer::around(&mut out[made..]);
                let rc = dctx
                    .decompress_stream(&mut outb, &mut inb)
                    .map_err(|code| {
                        Error::corrupt(format!(
                            "zstd data is damaged in the frame at offset {} ({})",
                            piece.input,
                            get_error_name(code)
                        ))
                    })?;
                let (used, now, empty) = (inb.pos(), outb.pos(), chunk.is_empty());
                made += now;
                input.consume(used);
                if made == out.len() || rc == 0 {
                    out.truncate(made);
                    if !out.is_empty() && !emit(&mut out) {
                        return Ok(());
                    }
                    out.resize(CHUNK, 0);
                    made = 0;
                }
                if rc == 0 {
                    if input.pos() != piece.end {
                        return Err(Error::corrupt(format!(
                            "zstd frame at offset {} ends before its blocks say",
                            piece.input
                        )));
                    }
                    return Ok(());
                }
                if used == 0 && now == 0 && empty {
                    return Err(Error::corrupt(format!(
                        "zstd frame at offset {} is cut short",
                        piece.input
                    )));
                }
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compressed::source_of;

    /// pzstd's layout: each frame after a skippable frame holding its compressed size.
    fn pzstd(parts: &[Vec<u8>]) -> (Vec<u8>, Vec<Piece>) {
        let mut file = Vec::new();
        let mut pieces = Vec::new();
        for p in parts {
            let mut c = zstd::bulk::Compressor::new(3).unwrap();
            c.include_checksum(true).unwrap();
            let frame = c.compress(p).unwrap();
            file.extend(PZSTD_MAGIC.to_le_bytes());
            file.extend(4u32.to_le_bytes());
            file.extend((frame.len() as u32).to_le_bytes());
            let input = file.len() as u64;
            file.extend(&frame);
            pieces.push(Piece {
                input,
                end: file.len() as u64,
            });
        }
        (file, pieces)
    }

    fn decode_all(src: &Arc<Source>) -> Result<Vec<u8>> {
        let mut d = stream(src, 2)?;
        let mut out = Vec::new();
        let mut buf = vec![0u8; 300_000];
        while !d.ended() {
            let k = d.read(&mut buf)?;
            out.extend_from_slice(&buf[..k]);
        }
        Ok(out)
    }

    #[test]
    fn pzstd_sizes_find_frames_and_wrong_ones_are_not_trusted() {
        // The second frame decodes past what is decoded in one call: it streams.
        let parts = [
            crate::compressed::mixed(3_000_000, 1, 16, b"pzstd\n"),
            crate::compressed::mixed(WHOLE as usize + 5_000_000, 2, 20, b"ab"),
            crate::compressed::mixed(700_000, 3, 12, b"frames\n"),
        ];
        let (mut file, pieces) = pzstd(&parts);
        let src = source_of(&file, "zstd-good");
        let mut split = FrameSplit {
            window: ReadWindow::new(&src),
            at: 0,
        };
        for p in &pieces {
            split.at = p.input;
            let hinted = split.hinted(PZSTD_MAGIC, 4, u64::MAX).unwrap().unwrap();
            assert_eq!((hinted.input, hinted.end), (p.input, p.end));
        }
        assert_eq!(decode_all(&src).unwrap(), parts.concat());

        // A size one short, and one past the end of the archive: not trusted, the
        // frames are found from their block headers.
        let at = pieces[1].input as usize - 4;
        file[at..at + 4]
            .copy_from_slice(&((pieces[1].end - pieces[1].input - 1) as u32).to_le_bytes());
        let at = pieces[2].input as usize - 4;
        file[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        let src = source_of(&file, "zstd-wrong");
        let mut split = FrameSplit {
            window: ReadWindow::new(&src),
            at: pieces[1].input,
        };
        assert!(split.hinted(PZSTD_MAGIC, 4, u64::MAX).unwrap().is_none());
        let mut split = FrameSplit {
            window: ReadWindow::new(&src),
            at: 0,
        };
        for p in &pieces {
            let f = split.frame(u64::MAX).unwrap().unwrap();
            assert_eq!((f.input, f.end), (p.input, p.end));
        }
        assert!(split.frame(u64::MAX).unwrap().is_none());
        assert_eq!(decode_all(&src).unwrap(), parts.concat());

        // Damage inside a frame found by its size is an error (its checksum), not other
        // bytes.
        let (mut file, pieces) = pzstd(&parts);
        let mid = ((pieces[0].input + pieces[0].end) / 2) as usize;
        file[mid] ^= 0x55;
        assert!(decode_all(&source_of(&file, "zstd-bad")).is_err());
    }
}
