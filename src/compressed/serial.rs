//! Formats read front to back only, for now: xz (liblzma) and bzip2. Their archives are
//! served from a decoded copy ([`super::stage`]). liblzma decodes the blocks of a
//! multi-block xz (`xz -T0`) on several threads.

use super::{Decoder, Input, Point};
use std::sync::Arc;

use crate::archive::Source;
use crate::error::{Error, Result};

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
}

const XZ_MAGIC: &[u8; 6] = b"\xfd7zXZ\0";

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
        })
    }

    pub fn bzip2(src: &Arc<Source>) -> Serial {
        Serial {
            engine: Engine::Bzip2(bzip2::Decompress::new(false)),
            input: Input::new(src.clone(), 0),
            ended: false,
            threads: 1,
        }
    }

    /// After an xz stream decoded on threads: its padding, then another stream or the
    /// end.
    fn next_xz_stream(&mut self) -> Result<bool> {
        let mut b = [0u8; 4096];
        loop {
            let n = self.input.peek(&mut b)?;
            let zeros = b[..n].iter().take_while(|&&x| x == 0).count();
            self.input.skip(zeros)?;
            if zeros < n || n == 0 {
                break;
            }
        }
        let mut magic = [0u8; 6];
        match self.input.peek(&mut magic)? {
            0 => Ok(false),
            6 if &magic == XZ_MAGIC => {
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
        None
    }

    fn ended(&self) -> bool {
        self.ended
    }

    fn input_pos(&self) -> u64 {
        self.input.pos()
    }
}
