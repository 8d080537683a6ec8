//! zstd: every frame starts a fresh decoder, so each frame boundary is an entry point
//! that needs no saved state (pzstd, `zstd --block-size`-style writers and the seekable
//! format cut their output into frames; `zstd -T0` and `tar --zstd` write one frame).

use zstd::zstd_safe::{get_error_name, DCtx, InBuffer, OutBuffer};

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
