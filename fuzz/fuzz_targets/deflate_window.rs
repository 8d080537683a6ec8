//! Follow arbitrary bytes as the deflate stream after a gzip entry point, as the indexing
//! pass does to find which window bytes it copies from (src/compressed/window.rs): any
//! panic, hang or huge allocation is a bug. Input: bits (low 3 bits of byte 0), the byte
//! holding them, a window length (2 bytes, at most 32 KiB), the window, the stream.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 4 {
        return;
    }
    let bits = data[0] & 7;
    let prev = data[1];
    let wl = (usize::from(u16::from_le_bytes([data[2], data[3]])) & 0x7fff).min(data.len() - 4);
    let (window, input) = data[4..].split_at(wl);
    let _ = archfs::compressed::sparse_window(window, input, bits, prev);
});
