//! Open arbitrary bytes as a SquashFS image and walk all of it: every directory, inode,
//! file byte, symlink and xattr. Any panic, abort, hang or huge allocation is a bug.
#![no_main]

use archfs::archive::check::FUZZ_LIMITS;
use archfs::open::fuzz::{check_bytes, Format};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = check_bytes(data, Format::SquashFs, FUZZ_LIMITS);
});
