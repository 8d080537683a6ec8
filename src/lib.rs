//! archfs: mount SquashFS images and tar archives read-only with FUSE, built for
//! datasets of many small files read in parallel by training jobs on HPC clusters.
//!
//! Layers, bottom up: [`archive::Source`] (positional reads), [`cache`] (shared block
//! cache), format readers ([`squashfs`], [`tar`], [`compressed`]), the
//! [`archive::Archive`] interface, [`vfs`] (directory handles, no FUSE types), [`fuse`]
//! (the thin fuser adapter), [`fuse_store`] (pushes into the kernel's page cache) and
//! [`job`] (the life cycle: mounting, serving, signals, `run`, unmounting on every exit
//! path).

pub mod archive;
pub mod cache;
pub mod cli;
pub mod compressed;
pub mod error;
pub mod fuse;
pub mod fuse_mount;
pub mod fuse_store;
pub mod job;
pub mod mountpoint;
pub mod prelist;
pub mod preload;
pub mod push;
pub mod shared;
pub mod squashfs;
pub mod tar;
pub mod vfs;
