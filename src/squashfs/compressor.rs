//! Decompressors for the codecs mksquashfs writes. Every call is bounded: a block that
//! would decompress past its limit is corrupt, never a reason to grow a buffer.

use std::cell::RefCell;
use std::io::Read;

use crate::error::{Error, Result};

/// A SquashFS compressor id (superblock field `compression_id`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compressor {
    Gzip,
    Lzo,
    Xz,
    Lz4,
    Zstd,
}

impl Compressor {
    /// Maps the on-disk id; ids archfs cannot decode are an error naming the compressor.
    pub fn from_id(id: u16) -> Result<Compressor> {
        match id {
            1 => Ok(Compressor::Gzip),
            2 => Err(Error::Unsupported(
                "the image uses the legacy lzma compressor, which archfs does not read; \
                 repack it with `mksquashfs ... -comp xz` (or zstd)"
                    .into(),
            )),
            3 => Ok(Compressor::Lzo),
            4 => Ok(Compressor::Xz),
            5 => Ok(Compressor::Lz4),
            6 => Ok(Compressor::Zstd),
            other => Err(Error::Unsupported(format!(
                "the image uses unknown compressor id {other}; archfs reads gzip, lzo, xz, lz4 and zstd"
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Compressor::Gzip => "gzip",
            Compressor::Lzo => "lzo",
            Compressor::Xz => "xz",
            Compressor::Lz4 => "lz4",
            Compressor::Zstd => "zstd",
        }
    }

    /// Decompresses `src`, which must expand to at most `limit` bytes.
    pub fn decompress(self, src: &[u8], limit: usize) -> Result<Vec<u8>> {
        let out = match self {
            Compressor::Gzip => gzip(src, limit)?,
            Compressor::Zstd => zstd(src, limit)?,
            Compressor::Lz4 => {
                let mut out = vec![0u8; limit];
                let n = lz4_flex::block::decompress_into(src, &mut out)
                    .map_err(|e| bad(self, e.to_string()))?;
                out.truncate(n);
                out
            }
            Compressor::Xz => {
                let mut out = Vec::with_capacity(limit);
                liblzma::read::XzDecoder::new(src)
                    .take(limit as u64 + 1)
                    .read_to_end(&mut out)
                    .map_err(|e| bad(self, e.to_string()))?;
                out
            }
            Compressor::Lzo => {
                super::lzo::decompress(src, limit).map_err(|e| bad(self, e.into()))?
            }
        };
        if out.len() > limit {
            return Err(bad(self, format!("expands past {limit} bytes")));
        }
        Ok(out)
    }
}

fn bad(codec: Compressor, what: String) -> Error {
    Error::corrupt(format!(
        "{} block does not decompress: {what}",
        codec.name()
    ))
}

fn gzip(src: &[u8], limit: usize) -> Result<Vec<u8>> {
    thread_local! {
        static INFLATE: RefCell<libdeflater::Decompressor> =
            RefCell::new(libdeflater::Decompressor::new());
    }
    INFLATE.with(|cell| {
        let mut out = vec![0u8; limit];
        let n = cell
            .borrow_mut()
            .zlib_decompress(src, &mut out)
            .map_err(|e| match e {
                libdeflater::DecompressionError::InsufficientSpace => {
                    bad(Compressor::Gzip, format!("expands past {limit} bytes"))
                }
                other => bad(Compressor::Gzip, other.to_string()),
            })?;
        out.truncate(n);
        Ok(out)
    })
}

fn zstd(src: &[u8], limit: usize) -> Result<Vec<u8>> {
    thread_local! {
        static DCTX: RefCell<Option<zstd::bulk::Decompressor<'static>>> = const { RefCell::new(None) };
    }
    DCTX.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            *slot = Some(
                zstd::bulk::Decompressor::new()
                    .map_err(|e| bad(Compressor::Zstd, e.to_string()))?,
            );
        }
        let d = slot.as_mut().expect("just set");
        d.decompress(src, limit)
            .map_err(|e| bad(Compressor::Zstd, e.to_string()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn sample() -> Vec<u8> {
        (0..20_000u32)
            .flat_map(|i| (i % 251).to_le_bytes())
            .collect()
    }

    #[test]
    fn round_trips_and_limits() {
        let data = sample();
        let gz = {
            let mut c = libdeflater::Compressor::new(libdeflater::CompressionLvl::default());
            let mut out = vec![0u8; c.zlib_compress_bound(data.len())];
            let n = c.zlib_compress(&data, &mut out).unwrap();
            out.truncate(n);
            out
        };
        let zs = zstd::bulk::compress(&data, 3).unwrap();
        let l4 = lz4_flex::block::compress(&data);
        let xz = {
            let mut e = liblzma::write::XzEncoder::new(Vec::new(), 6);
            e.write_all(&data).unwrap();
            e.finish().unwrap()
        };
        let lzo = lzokay_native::compress(&data).unwrap();
        for (codec, blob) in [
            (Compressor::Gzip, gz),
            (Compressor::Zstd, zs),
            (Compressor::Lz4, l4),
            (Compressor::Xz, xz),
            (Compressor::Lzo, lzo),
        ] {
            assert_eq!(
                codec.decompress(&blob, data.len()).unwrap(),
                data,
                "{codec:?}"
            );
            assert!(
                codec.decompress(&blob, data.len() - 1).is_err(),
                "{codec:?} must refuse to expand past the limit"
            );
            assert!(codec
                .decompress(&blob[..blob.len() / 2], data.len())
                .is_err());
        }
    }

    #[test]
    fn unknown_ids_name_the_problem() {
        let e = Compressor::from_id(2).unwrap_err().to_string();
        assert!(e.contains("lzma"), "{e}");
        assert!(Compressor::from_id(99).is_err());
    }
}
