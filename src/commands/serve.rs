//! The options of a mount, which `mount` and `run` share, and the [`Settings`] they make.

use std::path::PathBuf;

use super::Failure;
use crate::job::{self, Prelist, Preload, Settings};
use crate::size::parse_size;
use crate::vfs::Readdirplus;

#[derive(clap::Args, Debug)]
pub(super) struct ServeArgs {
    /// Bytes of decompressed blocks kept in memory (K, M, G suffixes, powers of 1024).
    #[arg(long, value_name = "SIZE", default_value = "512M", value_parser = parse_size)]
    cache_size: u64,
    /// FUSE request threads [default: twice the CPUs, 4 to 64].
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
    /// Mount options, comma-separated; `allow_other` lets other users read the mount
    /// (ordinary users need `user_allow_other` in /etc/fuse.conf for it).
    #[arg(short = 'o', value_name = "OPTIONS", value_delimiter = ',')]
    options: Vec<String>,
    /// Log every request and more (to the terminal with --foreground, or to --log).
    #[arg(long)]
    debug: bool,
    /// Every PATH is an archive: mount on a new job-private, node-local directory
    /// ($TMPDIR, else /dev/shm, else /tmp; named after $SLURM_JOB_ID) and print its path,
    /// so a job script can write `MNT=$(archfs mount data.sqfs)`. Removed on unmount.
    #[arg(long)]
    auto_mountpoint: bool,
    /// Show tar archives inside a tar archive as directories, named without `.tar`
    /// (compressed ones too, inside a plain tar: without `.tar.gz`, `.tgz`, `.tar.zst`,
    /// `.tar.xz`, `.tar.bz2`...).
    #[arg(long)]
    recursive: bool,
    /// Where a tar archive's index is saved and looked for [default: ARCHIVE.archfs-index
    /// beside the archive if that directory is writable, else ~/.cache/archfs/].
    #[arg(long, value_name = "FILE")]
    index: Option<PathBuf>,
    /// Read the archives into the OS page cache in the background, in a few large parallel
    /// reads, so a first epoch's shuffled reads find them in memory: `auto` once 128 files
    /// have been read, `always` (bare `--preload`) once mounted, or `never`. The data is
    /// left out when it would not fit in free memory. A compressed tar is also decoded
    /// ahead, on every core, into a copy in memory (with `auto`, from mount when its entry
    /// points are over a MiB apart; with `always`, on --stage-dir when it does not fit).
    #[arg(
        long,
        value_enum,
        value_name = "WHEN",
        default_value_t = Preload::Auto,
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "always"
    )]
    pub(super) preload: Preload,
    /// Whether directory listings carry each entry's attributes, so that stat or open of
    /// a listed file needs no further request: `always`, `auto` (the kernel decides per
    /// listing) or `never`. With the listing ahead, the lister's carry them, the job's not.
    #[arg(long, value_enum, value_name = "WHEN", default_value_t = Readdirplus::Always)]
    readdirplus: Readdirplus,
    /// List the whole tree in the background once mounted (last directory first, on
    /// spare CPU), so the kernel knows every name and its attributes before the job asks:
    /// a stat or open by path needs no request. The job's own listings then carry no
    /// attributes, which makes them as fast as a plain directory's (ImageFolder's index).
    /// `auto` does when `--readdirplus always` and the kernel's inodes (1.2 KB an entry)
    /// fit in a quarter of free memory; `never` does not.
    #[arg(long, value_enum, value_name = "WHEN", default_value_t = Prelist::Auto)]
    prelist: Prelist,
    /// Compressed tar archives: decoded bytes between the places a read can start
    /// decoding (gzip keeps the part of a 32 KiB window the data refers to for each).
    /// Smaller spends index for faster random reads. Applies when the index is built:
    /// delete a saved one to change it.
    #[arg(long, value_name = "SIZE", default_value = "128K", value_parser = parse_size)]
    entry_spacing: u64,
    /// Where the decoded copy of a compressed tar goes when it does not fit in memory: one
    /// that cannot be read in place (zstd in one frame, xz in one block or in blocks over
    /// 4 MiB), or any with `--preload=always` [default: $TMPDIR, else /tmp].
    #[arg(long, value_name = "DIR")]
    stage_dir: Option<PathBuf>,
    /// Keep the copies of s3:// and https:// archives in --stage-dir (a node-local disk)
    /// for later jobs on the node, up to SIZE in all (K, M, G, T), the least recently
    /// used removed first; a later job checks a copy is of the same object and whole
    /// before it reads it.
    #[arg(long, value_name = "SIZE", value_parser = parse_size, requires = "stage_dir")]
    keep: Option<u64>,
    /// Send unsigned requests for s3:// archives (a public bucket), as the AWS CLI's flag
    /// of that name. Otherwise credentials, endpoint and region come from where the AWS
    /// CLI finds them (AWS_* variables, ~/.aws/credentials, ~/.aws/config).
    #[arg(long)]
    no_sign_request: bool,
    /// How long a request to an object store may be retried (backoff and jitter on 5xx,
    /// 429/503 SlowDown, resets, stalls) before the read that needs it fails with EIO.
    #[arg(long, value_name = "SECONDS", default_value_t = 60.0)]
    retry_for: f64,
}

impl ServeArgs {
    /// What `mount` and `run` were asked for, checked: `paths` is ARCHIVE... MOUNTPOINT,
    /// or archives only with `--auto-mountpoint` or a single PATH.
    pub(super) fn settings(&self, paths: &[PathBuf]) -> Result<Settings, Failure> {
        let auto_mountpoint = self.auto_mountpoint || paths.len() == 1;
        let (mountpoint, archives) = if auto_mountpoint {
            (job::default_mountpoint(&paths[0]), paths)
        } else {
            let (last, rest) = paths.split_last().expect("clap requires one");
            (last.clone(), rest)
        };
        let mut allow_other = false;
        for o in &self.options {
            match o.as_str() {
                "allow_other" => allow_other = true,
                "ro" | "" => {}
                other => return Err(Failure::MountOption(other.to_owned())),
            }
        }
        Ok(Settings {
            archives: archives.to_vec(),
            mountpoint,
            auto_mountpoint,
            shared: false,
            cache_size: self.cache_size,
            threads: self.threads.unwrap_or_else(default_threads),
            allow_other,
            recursive: self.recursive,
            index: self.index.clone(),
            entry_spacing: self.entry_spacing,
            stage_dir: self.stage_dir.clone(),
            keep: self.keep,
            no_sign_request: self.no_sign_request,
            retry_for: std::time::Duration::try_from_secs_f64(self.retry_for)
                .ok()
                .filter(|d| !d.is_zero())
                .ok_or(Failure::RetryFor)?,
            preload: self.preload,
            readdirplus: self.readdirplus,
            prelist: self.prelist,
            debug: self.debug,
        })
    }
}

fn default_threads() -> usize {
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
    // A big node runs 32+ DataLoader workers; each thread serves one request at a time.
    (cpus * 2).clamp(4, 64)
}
