//! One error type for everything below the FUSE adapter; it knows its errno so the
//! adapter never has to invent one.

use std::io;

/// Result alias used throughout archfs.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("no such file or directory")]
    NotFound,
    #[error("not a directory")]
    NotDir,
    #[error("is a directory")]
    IsDir,
    #[error("not a symbolic link")]
    NotSymlink,
    #[error("no such extended attribute")]
    NoXattr,
    /// The caller's buffer cannot hold the answer (an extended attribute's value).
    #[error("the buffer is too small for the answer")]
    BufferTooSmall,
    #[error("too many levels of symbolic links")]
    Loop,
    /// An archive (an object in object storage) that is not there: the message says
    /// where it was looked for.
    #[error("{0}")]
    Absent(String),
    /// An archive the credentials may not read: the message says whose they are.
    #[error("{0}")]
    Denied(String),
    /// The archive contradicts itself: a bad offset, size or checksum.
    #[error("corrupt archive: {0}")]
    Corrupt(String),
    /// A valid archive that uses something archfs cannot read (a SquashFS compressor,
    /// a version of the format).
    #[error("{0}")]
    Unsupported(String),
    /// Not an archive in a format archfs reads (an lz4 stream, a directory, a file that
    /// is neither a SquashFS image nor a tar): the message says what to make instead.
    #[error("{0}")]
    NotArchive(String),
    /// What was asked does not apply to what was named (a directory without archives,
    /// an index of a SquashFS image, `..` in a path in an archive): the message says
    /// what to ask instead.
    #[error("{0}")]
    Usage(String),
    /// Past a limit of the system or of archfs (open files, entries in one index, bytes
    /// of a union): the message says how to stay within it.
    #[error("{0}")]
    Limit(String),
    /// The way to an object store is misconfigured (a profile, an endpoint, a CA
    /// bundle): the message says what to fix.
    #[error("{0}")]
    Config(String),
    /// The object store would not serve an archive it has (retries exhausted, no ranged
    /// reads, the object replaced): the message says what was asked and what it said.
    #[error("{0}")]
    Remote(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
}

impl Error {
    /// The errno a filesystem operation that failed with this error returns.
    pub fn errno(&self) -> i32 {
        match self {
            Error::NotFound => libc::ENOENT,
            Error::NotDir => libc::ENOTDIR,
            Error::IsDir => libc::EISDIR,
            Error::NotSymlink => libc::EINVAL,
            Error::NoXattr => libc::ENODATA,
            Error::BufferTooSmall => libc::ERANGE,
            Error::Loop => libc::ELOOP,
            Error::Absent(_) => libc::ENOENT,
            Error::Denied(_) => libc::EACCES,
            Error::Corrupt(_)
            | Error::Unsupported(_)
            | Error::NotArchive(_)
            | Error::Usage(_)
            | Error::Limit(_)
            | Error::Config(_)
            | Error::Remote(_)
            | Error::Io { .. } => libc::EIO,
        }
    }

    /// Says where a corruption was found (`data block at 4096: ...`); other errors pass.
    pub fn at(self, place: impl std::fmt::Display) -> Self {
        match self {
            Error::Corrupt(m) => Error::Corrupt(format!("{place}: {m}")),
            e => e,
        }
    }

    pub fn corrupt(msg: impl Into<String>) -> Self {
        Error::Corrupt(msg.into())
    }

    pub fn io(context: impl Into<String>, source: io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}
