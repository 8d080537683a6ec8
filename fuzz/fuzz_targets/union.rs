//! Split arbitrary bytes into 2 or 3 tar archives, merge their indexes into one union,
//! save it and load it back as a remount does, and walk both. Any panic, hang or huge
//! allocation is a bug, and so is a saved union that is not taken back or walks
//! differently from the merge.
#![no_main]

use archfs::archive::check::FUZZ_LIMITS;
use archfs::open::fuzz::check_union_bytes;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let dir = std::env::temp_dir().join(format!("archfs-fuzz-union-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    if let Ok((merged, again)) = check_union_bytes(data, &dir, FUZZ_LIMITS) {
        assert_eq!(Some(merged), again, "the saved union is not the merge");
    }
});
