//! Index arbitrary bytes as a compressed tar (gzip, zstd, xz or bzip2, by the magic) and
//! walk all of it: every decoder path, entry points, the decoded-copy path. Any panic,
//! abort, hang or huge allocation is a bug.
#![no_main]

use archfs::archive::check;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = check::check_bytes(data, check::Format::CompressedTar, check::FUZZ_LIMITS);
});
