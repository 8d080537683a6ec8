//! `archfs index`: an archive's index built once and kept where later mounts look first,
//! beside an object in object storage too.

use std::path::Path;

use super::{open_with, OpenOptions};
use crate::cache::CacheConfig;
use crate::error::{Error, Result};
use crate::source::Source;

/// Builds (or loads) the index of the tar archive `path` and keeps it where every later
/// mount looks first: for an `s3://` object, the object `KEY.archfs-index` beside it, so
/// jobs on every node mount at once; for a local archive, where a mount saves it.
/// Says where it went.
pub fn save_index(path: &Path, options: &OpenOptions) -> Result<String> {
    let archive = open_with(path, &CacheConfig::default(), options)?;
    let source = Source::open_with(path, &options.remote)?;
    let mut magic = [0u8; 4];
    if source.len() >= 4 {
        source.read_exact_at(0, &mut magic)?;
    }
    if &magic == b"hsqs" {
        return Err(Error::Usage(format!(
            "{} is a SquashFS image, which needs no index: it mounts at once",
            path.display()
        )));
    }
    let saved = options
        .index
        .clone()
        .unwrap_or_else(|| crate::tar::persist::default_path(path, source.is_local()));
    drop(archive);
    if source.is_local() {
        return Ok(saved.display().to_string());
    }
    let body = std::fs::read(&saved)
        .map_err(|e| Error::io(format!("cannot read the index {}", saved.display()), e))?;
    crate::source::put_sidecar(path, &options.remote, &body)
}
