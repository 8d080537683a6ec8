//! The archive names that are not local paths: `s3://BUCKET/KEY`, `https://...`,
//! `http://...`, and how each becomes a request URL.

use std::path::Path;

use crate::error::Error;

/// Where an object is, as the user named it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Location {
    /// A key in a bucket, reached through the configured S3 endpoint and signed.
    S3 { bucket: String, key: String },
    /// The objects directly under a prefix (`s3://BUCKET/PREFIX/`, or a whole bucket):
    /// a union, like a local directory of archives.
    S3Prefix { bucket: String, prefix: String },
    /// A plain URL, read anonymously.
    Http { url: String },
}

/// A name that is a URL but names no object.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum BadName {
    #[error(
        "{0} names no bucket: write s3://BUCKET/KEY, or s3://BUCKET/PREFIX/ for the \
         archives under a prefix"
    )]
    NoBucket(String),
    #[error("{0} names no object: write https://HOST/PATH")]
    NoObject(String),
}

impl From<BadName> for Error {
    fn from(e: BadName) -> Error {
        Error::Usage(e.to_string())
    }
}

impl Location {
    /// `None` for a local path; an error for a URL that names no object.
    pub fn parse(name: &Path) -> Option<Result<Location, BadName>> {
        let name = name.to_str()?;
        if let Some(rest) = name.strip_prefix("s3://") {
            let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
            let (bucket, key) = (bucket.to_owned(), key.to_owned());
            return Some(if bucket.is_empty() {
                Err(BadName::NoBucket(name.to_owned()))
            } else if key.is_empty() || key.ends_with('/') {
                Ok(Location::S3Prefix {
                    bucket,
                    prefix: key,
                })
            } else {
                Ok(Location::S3 { bucket, key })
            });
        }
        let lower = name.get(..8).unwrap_or(name).to_ascii_lowercase();
        if lower.starts_with("http://") || lower.starts_with("https://") {
            let after = &name[name.find("://").unwrap() + 3..];
            return Some(match after.split_once('/') {
                Some((host, path)) if !host.is_empty() && !path.is_empty() => Ok(Location::Http {
                    url: name.to_owned(),
                }),
                _ => Err(BadName::NoObject(name.to_owned())),
            });
        }
        None
    }

    /// How the object is named in messages.
    pub fn name(&self) -> String {
        match self {
            Location::S3 { bucket, key } => format!("s3://{bucket}/{key}"),
            Location::S3Prefix { bucket, prefix } => format!("s3://{bucket}/{prefix}"),
            Location::Http { url } => url.clone(),
        }
    }
}

/// Whether `name` is an object URL rather than a local path.
pub fn is_url(name: &Path) -> bool {
    Location::parse(name).is_some()
}

/// Percent-encodes a key for a request path as S3 and SigV4 expect: every byte but the
/// unreserved ones and `/`.
pub fn encode_key(key: &str) -> String {
    let mut out = String::with_capacity(key.len());
    for &b in key.as_bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~' | b'/') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The host (with port) and the path of an `http(s)://` URL; the query is kept in the
/// path, as sent.
pub fn split_url(url: &str) -> (String, String) {
    let after = &url[url.find("://").map_or(0, |i| i + 3)..];
    match after.split_once('/') {
        Some((host, path)) => (host.to_owned(), format!("/{path}")),
        None => (after.to_owned(), "/".to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_paths() {
        let s3 = |b: &str, k: &str| {
            Some(Ok(Location::S3 {
                bucket: b.into(),
                key: k.into(),
            }))
        };
        assert_eq!(
            Location::parse(Path::new("s3://b/k.sqfs")),
            s3("b", "k.sqfs")
        );
        assert_eq!(
            Location::parse(Path::new("s3://b/d/e f.tar")),
            s3("b", "d/e f.tar")
        );
        assert!(matches!(
            Location::parse(Path::new("s3:///k")),
            Some(Err(_))
        ));
        let prefix = |b: &str, p: &str| {
            Some(Ok(Location::S3Prefix {
                bucket: b.into(),
                prefix: p.into(),
            }))
        };
        assert_eq!(Location::parse(Path::new("s3://b")), prefix("b", ""));
        assert_eq!(Location::parse(Path::new("s3://b/")), prefix("b", ""));
        assert_eq!(
            Location::parse(Path::new("s3://b/shards/")),
            prefix("b", "shards/")
        );
        assert!(matches!(
            Location::parse(Path::new("HTTPS://h.example/x.tar")),
            Some(Ok(Location::Http { .. }))
        ));
        assert!(matches!(
            Location::parse(Path::new("https://h/")),
            Some(Err(_))
        ));
        assert_eq!(Location::parse(Path::new("data/s3://x")), None);
        assert_eq!(Location::parse(Path::new("/tmp/a.sqfs")), None);
    }

    #[test]
    fn keys_are_encoded_but_slashes() {
        assert_eq!(encode_key("a b/c+d~e.f"), "a%20b/c%2Bd~e.f");
        assert_eq!(encode_key("ä"), "%C3%A4");
        assert_eq!(
            split_url("http://127.0.0.1:8333/b/k?x=1"),
            ("127.0.0.1:8333".into(), "/b/k?x=1".into())
        );
    }
}
