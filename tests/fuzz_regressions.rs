//! Every input the fuzzers ever found a crash, hang or memory blow-up with (fuzz/regressions/)
//! is opened and walked again through the same entry point the fuzz targets use, and must
//! end in time with a result or an error, never a panic.

use crate::common;

use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use archfs::archive::check::FUZZ_LIMITS;
use archfs::open::fuzz::{check_bytes, check_union_bytes, Format};

fn replay(dir: &str, format: Format) -> usize {
    replay_with(dir, move |data| {
        let _ = check_bytes(data, format, FUZZ_LIMITS);
    })
}

/// Runs `check` on every input in fuzz/regressions/DIR, each in a thread that must end
/// within 60 s without a panic.
fn replay_with(dir: &str, check: impl Fn(&[u8]) + Send + Copy + 'static) -> usize {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/regressions")
        .join(dir);
    let mut n = 0;
    let mut inputs: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| !p.file_name().unwrap().to_string_lossy().starts_with('.'))
        .collect();
    inputs.sort();
    for path in inputs {
        let data = std::fs::read(&path).unwrap();
        let (tx, rx) = mpsc::channel();
        let name = path.display().to_string();
        let worker = std::thread::spawn(move || {
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(&data)));
            let _ = tx.send(outcome.is_ok());
        });
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(true) => {}
            Ok(false) => panic!("{name}: panicked"),
            Err(_) => panic!("{name}: still running after 60 s (a hang)"),
        }
        worker.join().unwrap();
        n += 1;
    }
    n
}

#[test]
fn squashfs_findings_fail_cleanly() {
    assert!(replay("squashfs", Format::SquashFs) > 0);
}

#[test]
fn compressed_findings_fail_cleanly() {
    replay("compressed", Format::CompressedTar);
}

#[test]
fn tar_findings_fail_cleanly() {
    // The directory may hold only its placeholder until the tar fuzzer finds something.
    replay("tar", Format::Tar);
}

#[test]
fn union_findings_fail_cleanly() {
    replay_with("union", |data| {
        let dir = common::TempDir::new("fuzz-union");
        if let Ok((merged, again)) = check_union_bytes(data, dir.path(), FUZZ_LIMITS) {
            assert_eq!(Some(merged), again, "the saved union is not the merge");
        }
    });
}
