//! Many readers at once, in threads and in processes, read shuffled files through one
//! mount whose cache is far smaller than the data, and every byte is checked.

use crate::common;

use std::io::Write;
use std::process::Command;

use common::tree::{list_files, make_awkward_tree, TreeSpec};
use common::*;

fn shuffled<T: Clone>(items: &[T], mut seed: u64) -> Vec<T> {
    let mut v = items.to_vec();
    for i in (1..v.len()).rev() {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        v.swap(i, (seed % (i as u64 + 1)) as usize);
    }
    v
}

#[test]
fn threads_and_processes_read_shuffled_files_correctly() {
    let dir = TempDir::new("parallel");
    let src = dir.join("src");
    std::fs::create_dir(&src).unwrap();
    make_awkward_tree(
        &src,
        &TreeSpec {
            big_dir_entries: 3000,
            sparse_4g: false,
            ..TreeSpec::default()
        },
    )
    .unwrap();
    let img = dir.join("img.sqfs");
    mksquashfs(&src, &img, &["-comp", "zstd"]);
    let mnt = dir.join("mnt");
    let _m = Mount::new(&img, &mnt, &["--cache-size", "4M", "--threads", "4"]);
    let files = list_files(&src);
    assert!(files.len() > 3000);

    let mut procs = Vec::new();
    for p in 0..3u64 {
        let list = dir.join(format!("list{p}"));
        let mut f = std::fs::File::create(&list).unwrap();
        for rel in shuffled(&files, 1000 + p) {
            // Names with newlines cannot go through a line-based list: threads cover them.
            let s = rel.to_str();
            if let Some(s) = s.filter(|s| !s.contains('\n')) {
                writeln!(f, "{s}").unwrap();
            }
        }
        let script = format!(
            "cd {src} && while IFS= read -r f; do cmp -s -- \"$f\" \"{mnt}/$f\" || {{ echo \"DIFF $f\"; exit 1; }}; done < {list}",
            src = src.display(),
            mnt = mnt.display(),
            list = list.display()
        );
        procs.push(Command::new("bash").arg("-c").arg(script).spawn().unwrap());
    }
    std::thread::scope(|s| {
        for t in 0..6u64 {
            let (files, src, mnt) = (&files, &src, &mnt);
            s.spawn(move || {
                for rel in shuffled(files, t) {
                    let want = std::fs::read(src.join(&rel)).unwrap();
                    let got = std::fs::read(mnt.join(&rel))
                        .unwrap_or_else(|e| panic!("read {rel:?}: {e}"));
                    assert!(got == want, "content of {rel:?} differs");
                }
            });
        }
    });
    for mut p in procs {
        assert!(
            p.wait().unwrap().success(),
            "a reader process saw different bytes"
        );
    }
}
