//! Open arbitrary bytes as a SquashFS image and walk all of it: every directory, inode,
//! file byte, symlink and xattr. Any panic, abort, hang or huge allocation is a bug.
#![no_main]

use archfs::archive::check;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = check::check_bytes(data, check::Format::SquashFs, check::FUZZ_LIMITS);
});
