//! gzip (single-member, multi-member, BGZF, pigz) with entry points inside one deflate
//! stream, as zlib's examples/zran.c does: at a deflate block boundary the decoder's
//! whole state is the bit position and the last 32 KiB of output, so saving those every
//! so often lets a read start near its data instead of at the start of the archive.
//! zlib-rs (through its C API, the only one with `inflatePrime` and `Z_BLOCK`) decodes.

use libz_rs_sys as z;

use super::{Decoder, Input, Point};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::source::Source;

/// zlib's window: what a resumed stream may refer back to.
pub const WINDOW: usize = 32 << 10;
const GZIP: i32 = 31;
const RAW: i32 = -15;

pub struct Inflate {
    /// Boxed: zlib's state points back at its stream, which must not move.
    strm: Box<z::z_stream>,
    input: Input,
    /// Raw deflate (resumed at an entry point): the member's trailer is ours to skip.
    raw: bool,
    out: u64,
    ended: bool,
}

// SAFETY: the stream's pointers refer to the boxed state and to `input`'s buffer, both
// owned by this value and moved with it; zlib-rs keeps no thread-local state.
unsafe impl Send for Inflate {}

fn init(strm: &mut z::z_stream, bits: i32) -> Result<()> {
    // SAFETY: strm is a zeroed stream; zlib-rs fills in its allocator and state.
    let rc = unsafe {
        z::inflateInit2_(
            strm,
            bits,
            z::zlibVersion(),
            std::mem::size_of::<z::z_stream>() as i32,
        )
    };
    if rc != z::Z_OK {
        return Err(Error::corrupt(format!(
            "cannot start inflating (zlib {rc})"
        )));
    }
    Ok(())
}

impl Inflate {
    /// A decoder at the start of the archive.
    pub fn start(src: &Arc<Source>) -> Result<Inflate> {
        let mut strm = Box::<z::z_stream>::default();
        init(&mut strm, GZIP)?;
        Ok(Inflate {
            strm,
            input: Input::new(src.clone(), 0),
            raw: false,
            out: 0,
            ended: false,
        })
    }

    /// A decoder at a saved entry point.
    pub fn resume(src: &Arc<Source>, p: &Point, window: &[u8]) -> Result<Inflate> {
        let mut strm = Box::<z::z_stream>::default();
        init(&mut strm, RAW)?;
        enter(&mut strm, src, p, window)?;
        Ok(Inflate {
            strm,
            input: Input::new(src.clone(), p.input),
            raw: true,
            out: p.output,
            ended: false,
        })
    }

    /// After a member's end: the next member, if one follows.
    fn next_member(&mut self) -> Result<bool> {
        if self.raw {
            self.input.skip(8)?; // CRC-32 and ISIZE, checked only on the indexing pass
        }
        let mut magic = [0u8; 2];
        if self.input.peek(&mut magic)? < 2 || magic != [0x1f, 0x8b] {
            // gzip ignores what follows the last member (tar's zero padding, usually).
            return Ok(false);
        }
        // SAFETY: an initialised stream.
        if unsafe { z::inflateReset2(&mut *self.strm, GZIP) } != z::Z_OK {
            return Err(Error::corrupt("cannot restart inflating"));
        }
        self.raw = false;
        Ok(true)
    }
}

/// Sets a raw stream's bit position and window to an entry point's.
fn enter(strm: &mut z::z_stream, src: &Source, p: &Point, window: &[u8]) -> Result<()> {
    if p.bits > 0 {
        let mut byte = [0u8];
        src.read_exact_at(p.input - 1, &mut byte)?;
        let value = i32::from(byte[0]) >> (8 - p.bits);
        // SAFETY: an initialised stream; bits is below 8.
        unsafe { z::inflatePrime(strm, i32::from(p.bits), value) };
    }
    if !window.is_empty() {
        // SAFETY: window is a valid slice of at most 32 KiB.
        let rc = unsafe { z::inflateSetDictionary(strm, window.as_ptr(), window.len() as u32) };
        if rc != z::Z_OK {
            return Err(Error::corrupt("saved gzip window was refused"));
        }
    }
    Ok(())
}

impl Decoder for Inflate {
    /// zlib's state (~48 KiB) and the input buffer are kept: made anew for every read,
    /// they fragmented the heap around the cache's blocks.
    fn restart(&mut self, src: &Arc<Source>, p: &Point, window: &[u8]) -> Result<bool> {
        let start = *p == Point::default();
        // SAFETY: an initialised stream.
        if unsafe { z::inflateReset2(&mut *self.strm, if start { GZIP } else { RAW }) } != z::Z_OK {
            return Err(Error::corrupt("cannot restart inflating"));
        }
        if !start {
            enter(&mut self.strm, src, p, window)?;
        }
        self.input.reset(src, p.input);
        self.raw = !start;
        self.out = p.output;
        self.ended = false;
        Ok(true)
    }

    fn read(&mut self, out: &mut [u8]) -> Result<usize> {
        let mut done = 0;
        while done < out.len() && !self.ended {
            let rest = &mut out[done..];
            let avail = rest.len().min(u32::MAX as usize);
            let (chunk, at_end) = self.input.chunk()?;
            self.strm.next_in = chunk.as_ptr();
            self.strm.avail_in = chunk.len() as u32;
            self.strm.next_out = rest.as_mut_ptr();
            self.strm.avail_out = avail as u32;
            // SAFETY: next_in/next_out point into live buffers of the given lengths.
            let rc = unsafe { z::inflate(&mut *self.strm, z::Z_BLOCK) };
            let used = chunk.len() - self.strm.avail_in as usize;
            let made = avail - self.strm.avail_out as usize;
            self.input.consume(used);
            done += made;
            self.out += made as u64;
            match rc {
                z::Z_OK | z::Z_BUF_ERROR if used == 0 && made == 0 => {
                    // zlib takes all the input it is given: no progress means none left.
                    return Err(Error::corrupt(if at_end {
                        format!("gzip stream is truncated at offset {}", self.input.pos())
                    } else {
                        "gzip stream stalled".to_string()
                    }));
                }
                z::Z_OK | z::Z_BUF_ERROR => {}
                z::Z_STREAM_END => {
                    if !self.next_member()? {
                        self.ended = true;
                    }
                }
                _ => {
                    return Err(Error::corrupt(format!(
                        "gzip data is damaged near offset {} ({})",
                        self.input.pos(),
                        zmsg(&self.strm)
                    )))
                }
            }
            // A block boundary is a place to record an entry point: hand it up.
            if self.strm.data_type & 0xc0 == 0x80 {
                break;
            }
        }
        Ok(done)
    }

    fn point(&mut self) -> Option<(Point, Vec<u8>)> {
        if self.ended || self.strm.data_type & 0xc0 != 0x80 {
            return None;
        }
        let mut window = vec![0u8; WINDOW];
        let mut len = 0u32;
        // SAFETY: window has room for the 32 KiB zlib may copy.
        unsafe { z::inflateGetDictionary(&*self.strm, window.as_mut_ptr(), &mut len) };
        window.truncate(len as usize);
        Some((
            Point {
                output: self.out,
                input: self.input.pos(),
                bits: (self.strm.data_type & 7) as u8,
            },
            window,
        ))
    }

    fn ended(&self) -> bool {
        self.ended
    }

    fn shrink(&mut self) {
        self.input.shrink();
    }

    fn input_pos(&self) -> u64 {
        self.input.pos()
    }
}

fn zmsg(strm: &z::z_stream) -> String {
    if strm.msg.is_null() {
        return "invalid data".into();
    }
    // SAFETY: zlib's messages are static NUL-terminated strings.
    unsafe { std::ffi::CStr::from_ptr(strm.msg) }
        .to_string_lossy()
        .into_owned()
}

impl Drop for Inflate {
    fn drop(&mut self) {
        // SAFETY: an initialised stream, ended once.
        unsafe { z::inflateEnd(&mut *self.strm) };
    }
}
