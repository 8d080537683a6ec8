//! archfs: mount SquashFS images and tar archives read-only with FUSE, built for
//! datasets of many small files read in parallel by training jobs on HPC clusters.
//!
//! Layers, bottom up, each importing only those below it:
//! - [`cache`]: the shared block cache, bounded by bytes; [`memory`]: what the job may fill;
//!   [`per_process`]: process-wide values a forked child makes anew; [`sync`]: locks a
//!   forked child can use; [`node`]: what the processes of a job on one node share;
//!   [`topology`]: the job's nodes and ranks, as its launcher says them; [`size`]: `512M`
//!   as users write sizes; [`logging`]; [`progress`]: bars for work someone waits on;
//! - [`source`]: where the bytes come from (a local file, an object in S3 or over HTTP, a
//!   node's staged copy of one), positional reads;
//! - the formats: [`squashfs`], [`tar`] and [`compressed`] (random access into gzip,
//!   zstd, xz and bzip2 streams, for the tar above them);
//! - [`archive`]: the interface the formats implement, unions, the full check walk;
//! - [`open`]: choosing the format by content, the one place that knows every format;
//! - [`warm`]: having bytes in the page cache before the job asks (preload, push, prelist);
//! - [`vfs`]: the filesystem's operations, each returning what the adapter replies (open
//!   directories, the listing-ahead protocol, which errno); no fuser types;
//! - [`fuse`]: the thin fuser adapter over [`vfs`] (one call, one reply), and the push's
//!   writes to /dev/fuse;
//! - [`job`]: the life cycle (mounting, serving, signals, `run`, unmounting on every exit
//!   path); [`commands`]: the command line, one module a subcommand.
//!
//! Nothing below [`fuse`] and [`job`] imports fuser. They and [`commands`] are the
//! default-on `mount` feature, which brings fuser and clap; the Python extension builds
//! without it, and so does `cargo check --no-default-features --lib`, which fails on an
//! import of fuser or clap anywhere else.

pub mod archive;
pub mod cache;
#[cfg(feature = "mount")]
pub mod commands;
pub mod compressed;
pub mod error;
#[cfg(feature = "mount")]
pub mod fuse;
#[cfg(feature = "mount")]
pub mod job;
pub mod logging;
pub mod memory;
pub mod node;
pub mod open;
pub mod per_process;
pub mod progress;
pub mod size;
pub mod source;
pub mod squashfs;
pub mod sync;
pub mod tar;
pub mod topology;
pub mod vfs;
pub mod warm;
