//! Index arbitrary bytes as a compressed tar (gzip, zstd, xz or bzip2, by the magic) and
//! walk all of it: every decoder path, entry points, the decoded-copy path. Any panic,
//! abort, hang or huge allocation is a bug.
#![no_main]

use archfs::archive::check::FUZZ_LIMITS;
use archfs::open::fuzz::{check_bytes, Format};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = check_bytes(data, Format::CompressedTar, FUZZ_LIMITS);
});
