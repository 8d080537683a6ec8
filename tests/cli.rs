//! The help, the manual page, the shell completions and the README come from one set of
//! definitions and agree.

use crate::common;

use common::*;

fn long_options(text: &str) -> Vec<String> {
    let mut opts: Vec<String> = text
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
        .filter(|w| w.starts_with("--") && w.len() > 2 && !w[2..].starts_with('-'))
        .map(str::to_owned)
        .collect();
    opts.sort();
    opts.dedup();
    opts
}

#[test]
fn the_readme_and_the_man_page_list_every_option_of_mount_and_run() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    for sub in ["mount", "run"] {
        let help = String::from_utf8(run_ok(archfs().args([sub, "--help"])).stdout).unwrap();
        let man = String::from_utf8(run_ok(archfs().args(["man", sub])).stdout).unwrap();
        let man = man.replace("\\-", "-");
        let options = long_options(&help);
        assert!(options.len() > 8, "{sub}: {options:?}");
        for opt in options
            .iter()
            .filter(|o| !matches!(o.as_str(), "--help" | "--version"))
        {
            assert!(readme.contains(opt.as_str()), "README lacks {sub} {opt}");
            assert!(man.contains(opt.as_str()), "man page of {sub} lacks {opt}");
        }
    }
}

#[test]
fn completions_cover_every_subcommand() {
    for shell in ["bash", "zsh", "fish"] {
        let out = String::from_utf8(run_ok(archfs().args(["completions", shell])).stdout).unwrap();
        for sub in ["mount", "unmount", "run", "info", "ls", "cat", "check"] {
            assert!(out.contains(sub), "{shell} completion lacks {sub}");
        }
        assert!(
            out.contains("auto-mountpoint"),
            "{shell} completion lacks options"
        );
    }
    let out = archfs().args(["completions", "tcsh"]).output().unwrap();
    assert!(!out.status.success());
}
