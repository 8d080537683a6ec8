//! Whole-stream decoders for xz (liblzma) and bzip2: the indexing pass over an xz
//! archive (liblzma decodes the blocks of a multi-block xz, `xz -T0`, on several
//! threads, and the pass stops at each block for its entry point) and the decoding from
//! the start of either.

use super::xz::Block;
use super::{Decoder, Input, Point};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::source::Source;

enum Engine {
    Xz(liblzma::stream::Stream),
    Bzip2(bzip2::Decompress),
}

pub struct Serial {
    engine: Engine,
    input: Input,
    ended: bool,
    /// xz decoder threads; liblzma's threaded decoder reads one stream, so the next of
    /// concatenated streams gets a decoder of its own.
    threads: u32,
    /// xz blocks, where a read stops so its entry point can be recorded.
    blocks: Vec<Block>,
    out: u64,
}

fn xz_decoder(threads: u32) -> Result<liblzma::stream::Stream> {
    let s = if threads > 1 {
        liblzma::stream::MtStreamBuilder::new()
            .threads(threads)
            // Per thread about a block and a dictionary (xz -T0 -9: 200 MiB).
            .memlimit_threading(1 << 30)
            .memlimit_stop(u64::MAX)
            .decoder()
    } else {
        liblzma::stream::Stream::new_stream_decoder(u64::MAX, liblzma::stream::CONCATENATED)
    };
    s.map_err(|e| Error::corrupt(format!("cannot start the xz decoder: {e}")))
}

impl Serial {
    pub fn xz(src: &Arc<Source>) -> Result<Serial> {
        Serial::xz_threads(src, 1)
    }

    pub fn xz_threads(src: &Arc<Source>, threads: usize) -> Result<Serial> {
        let threads = threads.clamp(1, 64) as u32;
        Ok(Serial {
            engine: Engine::Xz(xz_decoder(threads)?),
            input: Input::new(src.clone(), 0),
            ended: false,
            threads,
            blocks: Vec::new(),
            out: 0,
        })
    }

    /// The pass over a whole xz archive, stopping at each block listed in its indexes.
    /// Indexes it cannot read leave the archive without entry points (liblzma's decoder
    /// judges the damage).
    pub fn xz_blocks(src: &Arc<Source>, threads: usize) -> Result<Serial> {
        let mut s = Serial::xz_threads(src, threads)?;
        match super::xz::blocks(src) {
            Ok(b) => s.blocks = b,
            // Then a truncated or damaged archive, which the pass reports.
            Err(e) => tracing::debug!(
                "{}: {e}; its blocks are not entry points",
                src.path().display()
            ),
        }
        Ok(s)
    }

    /// The block starting at the decoded offset `at`, if one does.
    fn block_at(&self, at: u64) -> Option<&Block> {
        let i = self.blocks.partition_point(|b| b.output < at);
        self.blocks.get(i).filter(|b| b.output == at)
    }

    pub fn bzip2(src: &Arc<Source>) -> Serial {
        Serial {
            engine: Engine::Bzip2(bzip2::Decompress::new(false)),
            input: Input::new(src.clone(), 0),
            ended: false,
            threads: 1,
            blocks: Vec::new(),
            out: 0,
        }
    }

    /// After an xz stream decoded on threads: its padding, then another stream or the
    /// end.
    fn next_xz_stream(&mut self) -> Result<bool> {
        super::xz::skip_padding(&mut self.input)?;
        let mut magic = [0u8; 6];
        match self.input.peek(&mut magic)? {
            0 => Ok(false),
            6 if &magic == super::xz::HEADER_MAGIC => {
                self.engine = Engine::Xz(xz_decoder(self.threads)?);
                Ok(true)
            }
            _ => Err(Error::corrupt(format!(
                "xz data is damaged after a stream's end, at offset {}",
                self.input.pos()
            ))),
        }
    }
}

impl Decoder for Serial {
    fn read(&mut self, out: &mut [u8]) -> Result<usize> {
        // Up to the next block's start, so the caller can record it.
        let next = self.blocks.partition_point(|b| b.output <= self.out);
        let room = self.blocks.get(next).map_or(out.len(), |b| {
            (b.output - self.out).min(out.len() as u64) as usize
        });
        let out = &mut out[..room];
        let mut done = 0;
        while done < out.len() && !self.ended {
            let (chunk, at_end) = self.input.chunk()?;
            let (used, made, end) = match &mut self.engine {
                Engine::Xz(s) => {
                    let (i, o) = (s.total_in(), s.total_out());
                    let action = if at_end {
                        liblzma::stream::Action::Finish
                    } else {
                        liblzma::stream::Action::Run
                    };
                    let st = s
                        .process(chunk, &mut out[done..], action)
                        .map_err(|e| Error::corrupt(format!("xz data is damaged: {e}")))?;
                    let end = st == liblzma::stream::Status::StreamEnd;
                    (
                        (s.total_in() - i) as usize,
                        (s.total_out() - o) as usize,
                        end,
                    )
                }
                Engine::Bzip2(d) => {
                    let (i, o) = (d.total_in(), d.total_out());
                    let st = d
                        .decompress(chunk, &mut out[done..])
                        .map_err(|e| Error::corrupt(format!("bzip2 data is damaged: {e}")))?;
                    let end = st == bzip2::Status::StreamEnd;
                    (
                        (d.total_in() - i) as usize,
                        (d.total_out() - o) as usize,
                        end,
                    )
                }
            };
            self.input.consume(used);
            done += made;
            self.out += made as u64;
            if end {
                // pbzip2 writes a stream per block; liblzma reads concatenated xz itself.
                let mut magic = [0u8; 3];
                let more = self.input.peek(&mut magic)? == 3 && &magic == b"BZh";
                if more && matches!(self.engine, Engine::Bzip2(_)) {
                    self.engine = Engine::Bzip2(bzip2::Decompress::new(false));
                } else if self.threads > 1 && matches!(self.engine, Engine::Xz(_)) {
                    self.ended = !self.next_xz_stream()?;
                } else {
                    self.ended = true;
                }
            } else if used == 0 && made == 0 {
                return Err(Error::corrupt(format!(
                    "compressed stream is truncated at offset {}",
                    self.input.pos()
                )));
            }
        }
        Ok(done)
    }

    fn point(&mut self) -> Option<(Point, Vec<u8>)> {
        let b = self
            .block_at(self.out)
            .filter(|_| self.out > 0 && !self.ended)?;
        Some((b.point(), Vec::new()))
    }

    fn ended(&self) -> bool {
        self.ended
    }

    fn input_pos(&self) -> u64 {
        self.input.pos()
    }
}
