//! Formats read front to back only, for now: xz (liblzma) and bzip2. Their archives are
//! served from a decoded copy ([`super::stage`]).

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
}

impl Serial {
    pub fn xz(src: &Arc<Source>) -> Result<Serial> {
        let s =
            liblzma::stream::Stream::new_stream_decoder(u64::MAX, liblzma::stream::CONCATENATED)
                .map_err(|e| Error::corrupt(format!("cannot start the xz decoder: {e}")))?;
        Ok(Serial {
            engine: Engine::Xz(s),
            input: Input::new(src.clone(), 0),
            ended: false,
        })
    }

    pub fn bzip2(src: &Arc<Source>) -> Serial {
        Serial {
            engine: Engine::Bzip2(bzip2::Decompress::new(false)),
            input: Input::new(src.clone(), 0),
            ended: false,
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
