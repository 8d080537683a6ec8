//! Independent pieces of an archive (zstd frames, bzip2 blocks) decoded on several threads at once and
//! handed on in order, so one pass over a multi-frame archive (the first index, a
//! decoded copy) runs at the speed of all cores rather than one.
//!
//! Workers take the next piece in archive order and decode it in chunks; the reader
//! takes the chunks piece by piece. Decoded bytes waiting for the reader are bounded:
//! a worker ahead of the reader waits when the budget is spent, while the worker of the
//! piece the reader is on never waits, so a piece of any size (one huge frame) streams
//! through.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::sync::{Condvar, Mutex};

use super::{Decoder, Point};
use crate::error::{Error, Result};

/// A piece of the archive that decodes on its own: `[input, end)` of the archive.
#[derive(Clone, Copy, Debug)]
pub struct Piece {
    pub input: u64,
    pub end: u64,
}

/// How a format is cut into pieces, front to back.
pub trait Split: Send + 'static {
    /// The piece after the last one returned; `None` at the end of the archive.
    fn next(&mut self) -> Result<Option<Piece>>;
    /// Where a read can start decoding `piece`, as an entry point's archive byte and
    /// bits (the pieces of bzip2 are bit ranges).
    fn entry(&self, piece: &Piece) -> (u64, u8) {
        (piece.input, 0)
    }
}

/// Decodes a piece, handing its output on in chunks: the sink takes the vector's
/// contents and leaves a used one in its place, stale bytes and all (recycled: fresh 1
/// MiB allocations cost a page fault per 4 KiB, more than the decoding of stored zstd
/// blocks); stops early when the sink returns false.
pub type DecodeFn = dyn Fn(Piece, &mut dyn FnMut(&mut Vec<u8>) -> bool) -> Result<()> + Send + Sync;

/// Decoded bytes ahead of the reader, over all workers.
pub const BUDGET: usize = 64 << 20;

enum Chunk {
    Data(Vec<u8>),
    /// The piece ended.
    End,
    Failed(Error),
}

struct State {
    /// Next piece to hand out, and the reader's.
    next: u64,
    head: u64,
    /// Where each handed-out piece starts in the archive (byte, bits).
    starts: BTreeMap<u64, (u64, u8)>,
    ready: BTreeMap<(u64, u32), Chunk>,
    buffered: usize,
    /// Chunk buffers the reader is done with.
    spare: Vec<Vec<u8>>,
    /// No pieces are left to hand out.
    exhausted: bool,
    /// The reader is gone: workers stop.
    stop: bool,
}

/// What the workers and the reader share: the chunks decoded and waiting, and the pieces
/// still to take.
struct Handoff {
    state: Mutex<State>,
    moved: Condvar,
    split: Mutex<Box<dyn Split>>,
    decode: Arc<DecodeFn>,
    budget: usize,
}

/// The reader's side: a [`Decoder`] that hands on the workers' output in archive order,
/// with an entry point at the start of each piece.
pub struct ParallelDecoder {
    handoff: Arc<Handoff>,
    workers: Vec<std::thread::JoinHandle<()>>,
    chunk: Vec<u8>,
    used: usize,
    /// Next chunk of the head piece.
    index: u32,
    /// Decoded bytes so far, and whether the reader is between pieces.
    out: u64,
    between: bool,
    ended: bool,
    input: u64,
}

impl ParallelDecoder {
    /// Starts `threads` workers that keep at most about `budget` decoded bytes ahead.
    pub fn new(
        split: Box<dyn Split>,
        decode: Arc<DecodeFn>,
        threads: usize,
        budget: usize,
    ) -> Result<ParallelDecoder> {
        let handoff = Arc::new(Handoff {
            state: Mutex::new(State {
                next: 0,
                head: 0,
                starts: BTreeMap::new(),
                ready: BTreeMap::new(),
                buffered: 0,
                spare: Vec::new(),
                exhausted: false,
                stop: false,
            }),
            moved: Condvar::new(),
            split: Mutex::new(split),
            decode,
            budget,
        });
        let mut ahead = ParallelDecoder {
            handoff,
            workers: Vec::new(),
            chunk: Vec::new(),
            used: 0,
            index: 0,
            out: 0,
            between: true,
            ended: false,
            input: 0,
        };
        for i in 0..threads.max(1) {
            let s = ahead.handoff.clone();
            let worker = std::thread::Builder::new()
                .name(format!("archfs-decode-{i}"))
                .spawn(move || s.work())
                // Dropping `ahead` stops the workers already started.
                .map_err(|e| Error::io("cannot start a decoding thread", e))?;
            ahead.workers.push(worker);
        }
        Ok(ahead)
    }
}

impl Handoff {
    fn work(&self) {
        while let Some((seq, piece)) = self.take() {
            let mut index = 0u32;
            let last = match (self.decode)(piece, &mut |d| {
                let spare = self.state.lock().spare.pop().unwrap_or_default();
                self.put(seq, &mut index, Chunk::Data(std::mem::replace(d, spare)))
            }) {
                Ok(()) => Chunk::End,
                Err(e) => Chunk::Failed(e),
            };
            if !self.put(seq, &mut index, last) {
                return;
            }
        }
    }

    /// The next piece in archive order, with its number; `None` when there is none or
    /// the reader is gone (a failure to find one is queued for the reader).
    fn take(&self) -> Option<(u64, Piece)> {
        let mut split = self.split.lock();
        {
            let st = self.state.lock();
            if st.stop || st.exhausted {
                return None;
            }
        }
        let got = split.next();
        let mut st = self.state.lock();
        let seq = st.next;
        let piece = match got {
            Ok(Some(p)) => {
                st.starts.insert(seq, split.entry(&p));
                Some((seq, p))
            }
            Ok(None) => None,
            Err(e) => {
                st.ready.insert((seq, 0), Chunk::Failed(e));
                None
            }
        };
        match piece {
            Some(_) => st.next += 1,
            None => {
                st.next += u64::from(st.ready.contains_key(&(seq, 0)));
                st.exhausted = true;
            }
        }
        self.moved.notify_all();
        piece
    }

    /// Queues a chunk of piece `seq`, waiting for room unless the reader is on it;
    /// false once the reader is gone.
    fn put(&self, seq: u64, index: &mut u32, chunk: Chunk) -> bool {
        let len = match &chunk {
            Chunk::Data(d) => d.len(),
            _ => 0,
        };
        let mut st = self.state.lock();
        while !st.stop && st.head != seq && st.buffered + len > self.budget {
            st = self.moved.wait(st);
        }
        if st.stop {
            return false;
        }
        st.buffered += len;
        st.ready.insert((seq, *index), chunk);
        *index += 1;
        self.moved.notify_all();
        true
    }
}

impl Decoder for ParallelDecoder {
    fn read(&mut self, out: &mut [u8]) -> Result<usize> {
        let mut done = 0;
        while done < out.len() && !self.ended {
            if self.used < self.chunk.len() {
                let k = (self.chunk.len() - self.used).min(out.len() - done);
                out[done..done + k].copy_from_slice(&self.chunk[self.used..self.used + k]);
                self.used += k;
                done += k;
                self.out += k as u64;
                self.between = false;
                continue;
            }
            let mut st = self.handoff.state.lock();
            let key = (st.head, self.index);
            let chunk = loop {
                if let Some(c) = st.ready.remove(&key) {
                    break c;
                }
                if st.exhausted && st.head >= st.next {
                    self.ended = true;
                    return Ok(done);
                }
                st = self.handoff.moved.wait(st);
            };
            match chunk {
                Chunk::Data(d) => {
                    st.buffered -= d.len();
                    let old = std::mem::replace(&mut self.chunk, d);
                    // Handed back with its stale bytes: a worker's resize to the chunk
                    // size then writes nothing (zeroing every chunk was 10% of a pzstd
                    // index's CPU).
                    if st.spare.len() < 8 && old.capacity() > 0 {
                        st.spare.push(old);
                    }
                    self.used = 0;
                    self.index += 1;
                }
                Chunk::End => {
                    let head = st.head;
                    st.starts.remove(&head);
                    st.head += 1;
                    self.index = 0;
                    self.between = true;
                    self.input = st.starts.get(&st.head).map_or(self.input, |s| s.0);
                    self.handoff.moved.notify_all();
                    // A piece ended: an entry point, for the caller to record.
                    return Ok(done);
                }
                Chunk::Failed(e) => return Err(e),
            }
            self.handoff.moved.notify_all();
        }
        Ok(done)
    }

    fn point(&mut self) -> Option<(Point, Vec<u8>)> {
        if !self.between || self.ended {
            return None;
        }
        // The next piece may not be handed out yet: its start is known once it is.
        let mut st = self.handoff.state.lock();
        let (input, bits) = loop {
            if let Some(&start) = st.starts.get(&st.head) {
                break start;
            }
            if st.exhausted {
                return None;
            }
            st = self.handoff.moved.wait(st);
        };
        Some((
            Point {
                output: self.out,
                input,
                bits,
            },
            Vec::new(),
        ))
    }

    fn ended(&self) -> bool {
        self.ended
    }

    fn input_pos(&self) -> u64 {
        self.input
    }
}

impl Drop for ParallelDecoder {
    fn drop(&mut self) {
        self.handoff.state.lock().stop = true;
        self.handoff.moved.notify_all();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pieces of 0-99 chunks of 0-300 bytes; piece `bad` fails to decode.
    struct Counted {
        n: u64,
        of: u64,
    }

    impl Split for Counted {
        fn next(&mut self) -> Result<Option<Piece>> {
            self.n += 1;
            Ok((self.n <= self.of).then_some(Piece {
                input: self.n * 10,
                end: self.n * 10 + 10,
            }))
        }
    }

    fn bytes_of(i: u64) -> Vec<Vec<u8>> {
        (0..(i * 37) % 100)
            .map(|c| vec![(i + c) as u8; ((i * 7 + c * 13) % 300) as usize])
            .collect()
    }

    fn decoder(bad: u64) -> Arc<DecodeFn> {
        Arc::new(
            move |p: Piece, emit: &mut dyn FnMut(&mut Vec<u8>) -> bool| {
                let i = p.input / 10;
                if i == bad {
                    return Err(Error::corrupt(format!("piece {i}")));
                }
                for mut c in bytes_of(i) {
                    if !emit(&mut c) {
                        return Ok(());
                    }
                }
                Ok(())
            },
        )
    }

    fn read_all(a: &mut ParallelDecoder, points: &mut Vec<Point>) -> Result<Vec<u8>> {
        let mut got = Vec::new();
        let mut buf = [0u8; 77];
        while !a.ended() {
            if let Some((p, _)) = a.point() {
                points.push(p);
            }
            let n = a.read(&mut buf)?;
            got.extend_from_slice(&buf[..n]);
        }
        Ok(got)
    }

    #[test]
    fn pieces_come_in_order_with_their_entry_points_under_a_small_budget() {
        for (threads, budget) in [(1, 1 << 20), (3, 1), (4, 500)] {
            let mut a = ParallelDecoder::new(
                Box::new(Counted { n: 0, of: 60 }),
                decoder(0),
                threads,
                budget,
            )
            .unwrap();
            let mut points = Vec::new();
            let got = read_all(&mut a, &mut points).unwrap();
            let want: Vec<u8> = (1..=60).flat_map(bytes_of).flatten().collect();
            assert!(got == want, "{threads} threads, budget {budget}");
            // Each piece's start, where its output starts (pieces with no output too).
            let mut out = 0u64;
            for (i, p) in (1..=60u64).zip(&points) {
                assert_eq!((p.input, p.output), (i * 10, out), "piece {i}");
                out += bytes_of(i).iter().map(|c| c.len() as u64).sum::<u64>();
            }
            assert_eq!(points.len(), 60);
        }
    }

    #[test]
    fn a_failed_piece_is_reported_after_the_pieces_before_it() {
        let mut a =
            ParallelDecoder::new(Box::new(Counted { n: 0, of: 60 }), decoder(30), 3, 1000).unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 100];
        let err = loop {
            match a.read(&mut buf) {
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) => break e,
            }
            assert!(!a.ended(), "ended without the error");
        };
        assert!(err.to_string().contains("piece 30"), "{err}");
        let want: Vec<u8> = (1..30).flat_map(bytes_of).flatten().collect();
        assert!(got == want);
    }

    #[test]
    fn dropping_the_reader_early_stops_the_workers() {
        let mut a = ParallelDecoder::new(Box::new(Counted { n: 0, of: 10_000 }), decoder(0), 4, 64)
            .unwrap();
        let mut buf = [0u8; 10];
        a.read(&mut buf).unwrap();
        drop(a); // joins the workers: a hang here fails the test by its timeout
    }
}
