//! Tar archives written block by block from the format's documents (POSIX pax, GNU tar's
//! manual, star's), for the headers no writer at hand makes: old-style directories,
//! names holding a NUL, star's `X` headers, volume labels, two `x` headers in a row.

// Each integration-test binary uses only part of this module.
#![allow(dead_code)]

/// A header's fields; `Head::new` fills what a plain ustar member has.
#[derive(Clone)]
pub struct Head {
    pub name: Vec<u8>,
    pub typeflag: u8,
    pub size: u64,
    pub mode: u32,
    pub mtime: u64,
    pub link: Vec<u8>,
    /// `ustar\000` (POSIX), `ustar  \0` (GNU) or zeros (v7).
    pub magic: [u8; 8],
    /// Written as given instead of `size` in octal (GNU's base-256, for one).
    pub size_field: Option<[u8; 12]>,
}

pub const USTAR: [u8; 8] = *b"ustar\x0000";
pub const GNU: [u8; 8] = *b"ustar  \0";
pub const V7: [u8; 8] = [0; 8];

impl Head {
    pub fn new(name: &[u8], typeflag: u8) -> Head {
        Head {
            name: name.to_vec(),
            typeflag,
            size: 0,
            mode: if typeflag == b'5' { 0o755 } else { 0o644 },
            mtime: 1_700_000_000,
            link: Vec::new(),
            magic: USTAR,
            size_field: None,
        }
    }

    pub fn size(mut self, size: u64) -> Head {
        self.size = size;
        self
    }

    pub fn mode(mut self, mode: u32) -> Head {
        self.mode = mode;
        self
    }

    pub fn link(mut self, link: &[u8]) -> Head {
        self.link = link.to_vec();
        self
    }

    pub fn magic(mut self, magic: [u8; 8]) -> Head {
        self.magic = magic;
        self
    }

    /// The 512-byte block.
    pub fn block(&self) -> [u8; 512] {
        let mut h = [0u8; 512];
        let put = |h: &mut [u8; 512], at: usize, bytes: &[u8]| {
            h[at..at + bytes.len()].copy_from_slice(bytes)
        };
        put(&mut h, 0, &self.name[..self.name.len().min(100)]);
        put(&mut h, 100, format!("{:07o}\0", self.mode).as_bytes());
        put(&mut h, 108, b"0000000\0");
        put(&mut h, 116, b"0000000\0");
        match self.size_field {
            Some(f) => put(&mut h, 124, &f),
            None => put(&mut h, 124, format!("{:011o}\0", self.size).as_bytes()),
        }
        put(&mut h, 136, format!("{:011o}\0", self.mtime).as_bytes());
        h[156] = self.typeflag;
        put(&mut h, 157, &self.link[..self.link.len().min(100)]);
        put(&mut h, 257, &self.magic);
        put(&mut h, 148, b"        ");
        let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
        put(&mut h, 148, format!("{sum:06o}\0 ").as_bytes());
        h
    }
}

/// An archive under construction.
#[derive(Default)]
pub struct RawTar(pub Vec<u8>);

impl RawTar {
    pub fn new() -> RawTar {
        RawTar::default()
    }

    /// A header and no data.
    pub fn head(&mut self, h: Head) -> &mut Self {
        self.0.extend_from_slice(&h.block());
        self
    }

    /// Bytes padded to the next block.
    pub fn data(&mut self, data: &[u8]) -> &mut Self {
        self.0.extend_from_slice(data);
        self.0.resize(self.0.len().next_multiple_of(512), 0);
        self
    }

    pub fn dir(&mut self, name: &str) -> &mut Self {
        self.head(Head::new(name.as_bytes(), b'5'))
    }

    pub fn file(&mut self, name: &str, data: &[u8]) -> &mut Self {
        self.head(Head::new(name.as_bytes(), b'0').size(data.len() as u64))
            .data(data)
    }

    /// A header of `typeflag` whose data is `data` (GNU `L`/`K` long names, say).
    pub fn with_data(&mut self, h: Head, data: &[u8]) -> &mut Self {
        self.head(h.size(data.len() as u64)).data(data)
    }

    /// A PAX extended header of type `typeflag` (`x`, `g`, or star's `X`) with `records`.
    pub fn pax(&mut self, typeflag: u8, records: &[(&[u8], &[u8])]) -> &mut Self {
        let mut body = Vec::new();
        for (k, v) in records {
            let rest = k.len() + v.len() + 3; // ' ', '=', '\n'
            let mut len = rest + 1;
            while len.to_string().len() + rest != len {
                len += 1;
            }
            body.extend_from_slice(len.to_string().as_bytes());
            body.push(b' ');
            body.extend_from_slice(k);
            body.push(b'=');
            body.extend_from_slice(v);
            body.push(b'\n');
        }
        self.with_data(Head::new(b"PaxHeaders.0/member", typeflag), &body)
    }

    /// The two zero blocks that end an archive.
    pub fn end(&mut self) -> Vec<u8> {
        self.0.extend_from_slice(&[0u8; 1024]);
        std::mem::take(&mut self.0)
    }
}
