//! The conformance checks every format must pass, run over a live mount against a
//! reference tree (the source, a kernel mount, or `tar -x` output).

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use super::tree::{compare_trees, list_files, CompareOpts};

fn errno_of(r: std::io::Result<impl Sized>) -> Option<i32> {
    r.err().and_then(|e| e.raw_os_error())
}

/// Everything a reader can observe: the whole tree attribute by attribute, the errors of
/// operations a read-only archive refuses, and content under parallel readers.
pub fn check_mount(reference: &Path, mnt: &Path, opts: &CompareOpts, what: &str) {
    let diffs = compare_trees(reference, mnt, opts);
    assert!(
        diffs.is_empty(),
        "{what}: {} differences:\n{}",
        diffs.len(),
        diffs.join("\n")
    );

    // Errors: absent names, wrong types, writes.
    assert_eq!(
        errno_of(std::fs::metadata(mnt.join("no such name"))),
        Some(libc::ENOENT)
    );
    assert_eq!(
        errno_of(std::fs::metadata(mnt.join("no/such/dir"))),
        Some(libc::ENOENT)
    );
    let files = list_files(reference);
    let file = mnt.join(
        files
            .iter()
            .find(|f| !f.as_os_str().is_empty())
            .expect("a file"),
    );
    assert_eq!(
        errno_of(std::fs::metadata(file.join("x"))),
        Some(libc::ENOTDIR)
    );
    assert_eq!(errno_of(std::fs::read_link(&file)), Some(libc::EINVAL));
    assert_eq!(
        errno_of(std::fs::write(mnt.join("new-file"), b"x")),
        Some(libc::EROFS)
    );
    assert_eq!(
        errno_of(std::fs::create_dir(mnt.join("new-dir"))),
        Some(libc::EROFS)
    );
    assert_eq!(errno_of(std::fs::remove_file(&file)), Some(libc::EROFS));
    let c = CString::new(file.as_os_str().as_bytes()).unwrap();
    let name = CString::new("user.absent").unwrap();
    // SAFETY: valid C strings; a null buffer of size 0 asks for the length only.
    let r = unsafe { libc::getxattr(c.as_ptr(), name.as_ptr(), std::ptr::null_mut(), 0) };
    assert_eq!(r, -1);
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::ENODATA)
    );

    // Parallel readers see the same bytes.
    if opts.content {
        std::thread::scope(|s| {
            for t in 0..4usize {
                let files = &files;
                s.spawn(move || {
                    for rel in files.iter().skip(t).step_by(3) {
                        let want = std::fs::metadata(reference.join(rel)).unwrap();
                        if want.len() > 64 << 20 {
                            continue; // sparse giants: compare_trees covers them
                        }
                        let a = std::fs::read(reference.join(rel)).unwrap();
                        let b = std::fs::read(mnt.join(rel)).unwrap();
                        assert!(a == b, "{what}: parallel read of {rel:?} differs");
                    }
                });
            }
        });
    }
}
