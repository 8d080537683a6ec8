//! The integration tests, one binary. Each file here is a module; `cargo nextest` still
//! runs every test in a process of its own. One binary because each links the library
//! with thin LTO: 21 of them took 5-7 minutes of CI's build, most of it linking.
//! One file: `cargo nextest run --release -E 'test(/^tar::/)'`.

mod common;

mod aarch64;
mod cli;
mod compressed;
mod conformance;
mod corrupt;
mod exit_paths;
mod faults;
mod fuzz_regressions;
mod lifecycle;
mod nonroot;
mod parallel;
mod prelist;
mod preload;
mod reader;
mod remote;
mod remote_net;
mod s3_server;
mod stress;
mod tar;
mod tar_dialects;
mod vfs;
