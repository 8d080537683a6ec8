//! Read buffers that each thread reuses. A fresh buffer per FUSE read made the kernel
//! fault in and zero new pages for the `pread` into it (page faults and `clear_page`:
//! ~10% of the server's CPU in a FUSE-cold tar epoch, perf). A buffer dropped goes back to
//! its thread's spares, so the next read writes into pages that are already mapped.

use std::cell::RefCell;
use std::ops::{Deref, DerefMut};

/// Spares kept per thread, and the largest buffer worth keeping (a FUSE read is at most
/// 1 MiB; a SquashFS block at most 1 MiB).
const SPARES: usize = 2;
const MAX_KEPT: usize = 2 << 20;

thread_local! {
    static SPARE: RefCell<Vec<Vec<u8>>> = const { RefCell::new(Vec::new()) };
}

/// A byte buffer that returns to its thread's spares when dropped.
#[derive(Default)]
pub struct Buf(Vec<u8>);

impl Buf {
    /// A buffer of `len` bytes. Their content is unspecified (a reused buffer keeps old
    /// bytes): callers overwrite all of it.
    pub fn take(len: usize) -> Buf {
        let mut v = SPARE.with(|s| s.borrow_mut().pop()).unwrap_or_default();
        // Growing zero-fills only the new part; shrinking touches nothing.
        v.resize(len, 0);
        Buf(v)
    }

    /// Keeps the first `len` bytes.
    pub fn truncate(&mut self, len: usize) {
        self.0.truncate(len);
    }
}

impl Deref for Buf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0
    }
}

impl DerefMut for Buf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.0);
        if v.capacity() == 0 || v.capacity() > MAX_KEPT {
            return;
        }
        // `try_with`: a buffer dropped while its thread exits is simply freed.
        let _ = SPARE.try_with(|s| {
            let mut s = s.borrow_mut();
            if s.len() < SPARES {
                s.push(v);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dropped_buffer_is_reused_by_the_next_take_on_its_thread() {
        let first = Buf::take(100 << 10);
        let ptr = first.as_ptr();
        drop(first);
        let second = Buf::take(90 << 10);
        assert_eq!(second.as_ptr(), ptr);
        assert_eq!(second.len(), 90 << 10);
        let grown = {
            drop(second);
            Buf::take(120 << 10)
        };
        assert_eq!(grown.len(), 120 << 10);
    }

    #[test]
    fn oversized_buffers_are_not_kept() {
        let big = Buf::take(MAX_KEPT + 1);
        let ptr = big.as_ptr();
        drop(big);
        let next = Buf::take(16);
        assert_ne!(next.as_ptr(), ptr);
    }
}
