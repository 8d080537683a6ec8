//! zstd: every frame starts a fresh decoder, so each frame boundary is an entry point
//! that needs no saved state (pzstd, `zstd --block-size`-style writers and the seekable
//! format cut their output into frames; `zstd -T0` and `tar --zstd` write one frame).

use zstd::zstd_safe::{get_error_name, DCtx, InBuffer, OutBuffer};

use super::ahead::{Ahead, DecodeFn, Piece, Split, Window};
use super::{Decoder, Input, Point};
use std::sync::Arc;

use crate::archive::Source;
use crate::error::{Error, Result};

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
        window: Window::new(src),
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
    Ok(Box::new(Ahead::new(
        Box::new(split),
        decode_frames(src),
        threads,
        super::ahead::BUDGET,
    )?))
}

/// How far the first frame is followed to tell a multi-frame archive: a frame longer
/// than this is decoded by one thread anyway.
const PROBE: u64 = 256 << 20;
const ZSTD_MAGIC: u32 = 0xfd2f_b528;
/// Decoded bytes handed on at a time.
const CHUNK: usize = 1 << 20;

/// Finds frames from their headers and block headers, without decoding.
struct FrameSplit {
    window: Window,
    at: u64,
}

impl FrameSplit {
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
            let magic = u32::from_le_bytes(self.read(start)?);
            if magic & 0xffff_fff0 == 0x184d_2a50 {
                let size = u32::from_le_bytes(self.read(start + 4)?);
                self.at = start + 8 + u64::from(size);
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

/// Decodes one frame, checking it ends where its headers said.
fn decode_frames(src: &Arc<Source>) -> Arc<DecodeFn> {
    let src = src.clone();
    Arc::new(
        move |piece: Piece, emit: &mut dyn FnMut(&mut Vec<u8>) -> bool| {
            // Workers read different frames through one descriptor, whose readahead the
            // kernel then turns down as for random reads: ask for the frame at once.
            src.will_need(piece.input, piece.end - piece.input);
            let mut dctx = DCtx::create();
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
