//! How much memory the job may still fill: what decides whether a decoded copy, a
//! preload or a push fits. A leaf: formats and the serving side both ask it.

use std::path::Path;

/// The kernel's page size: 4 KiB on x86_64, 4, 16 or 64 KiB on aarch64 (some
/// Grace-Hopper kernels use 64). Read once.
pub fn page_size() -> usize {
    static SIZE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    // SAFETY: sysconf has no preconditions.
    *SIZE.get_or_init(|| match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        n if n > 0 => n as usize,
        _ => 4096,
    })
}

/// Memory the page cache can grow into: the kernel's MemAvailable, lowered to what the
/// memory cgroup (a batch job's limit) leaves, counting the cgroup's page cache as free
/// but not its shared memory (copies in memfds, which cannot be reclaimed).
/// Read at most every 100 ms: a union of 1,000 compressed shards asks once a shard as it
/// opens them, each time ~15 files of /proc and /sys.
pub fn available() -> Option<u64> {
    use std::time::{Duration, Instant};
    type Last = crate::sync::Mutex<Option<(Instant, Option<u64>)>>;
    static LAST: crate::per_process::PerProcess<Last> = crate::per_process::PerProcess::new();
    let mut last = LAST.get(|| crate::sync::Mutex::new(None)).lock();
    if let Some((at, free)) = *last {
        if at.elapsed() < Duration::from_millis(100) {
            return free;
        }
    }
    let free = read_available();
    *last = Some((Instant::now(), free));
    free
}

/// [`available`] read now, for a decision another process may have just changed.
pub fn available_now() -> Option<u64> {
    read_available()
}

fn read_available() -> Option<u64> {
    let system = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| meminfo_available(&t));
    let cgroup = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|t| cgroup_headroom(&t, Path::new("/sys/fs/cgroup")));
    match (system, cgroup) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Gives the heap's free pages back to the system, after work that leaves holes: opening
/// a union's members side by side leaves each opening thread's malloc arena with those of
/// its buffers (a union of 1,000 shards in per-class directories: 37 -> 31 MB of RSS
/// after mount), and so does merging its directories for the listing ahead (24.3 ->
/// 19.8 MB once listed), and the push's list of files once it has ended. It walks
/// every arena: once after such work, not once a piece of it.
pub fn give_back() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks the allocator's own free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Fixes glibc's thresholds for the server's heap. glibc raises its mmap threshold to the
/// size of each large block freed (up to 32 MiB) and its trim threshold to twice that, so
/// after a few large buffers each FUSE thread's arena keeps megabytes it freed. A union
/// of 1,000 shards in per-class directories held 56 MB after a listing and an epoch, 31
/// MB with these thresholds (peak 56 -> 37 MB). The mmap threshold stays at glibc's
/// highest: at 1 MiB each shard's zstd window was a fresh mapping and the first mount of
/// 1,000 pzstd shards took 1.8 s instead of 1.3-1.5 s. Thresholds the user set
/// (`MALLOC_*_THRESHOLD_`, `GLIBC_TUNABLES`) are left alone.
pub fn bound_free_heap() {
    if thresholds_set_by_user(|v| std::env::var(v).ok()) {
        return;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets the allocator's parameters.
    unsafe {
        // Free memory over 1 MiB at the top of an arena goes back to the system.
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 20);
    }
}

/// Whether the environment (`var`) sets glibc's mmap or trim threshold.
fn thresholds_set_by_user(var: impl Fn(&str) -> Option<String>) -> bool {
    ["MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"]
        .iter()
        .any(|v| var(v).is_some())
        || var("GLIBC_TUNABLES").is_some_and(|t| {
            t.contains("glibc.malloc.mmap_threshold") || t.contains("glibc.malloc.trim_threshold")
        })
}

fn meminfo_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The least headroom over this process's memory cgroup and its ancestors, for cgroup v2
/// (`0::/path`) and v1 (`N:memory:/path`). `None` when no limit is set.
fn cgroup_headroom(self_cgroup: &str, root: &Path) -> Option<u64> {
    let read = |p: &Path| std::fs::read_to_string(p).ok();
    let num = |p: &Path| read(p).and_then(|t| t.trim().parse::<u64>().ok());
    let stat = |p: &Path, key: &str| {
        read(p).and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok())
        })
    };
    let mut best: Option<u64> = None;
    for line in self_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let (mut dir, v2) = match controllers {
            "" => (root.join(path.trim_start_matches('/')), true),
            c if c.split(',').any(|c| c == "memory") => (
                root.join("memory").join(path.trim_start_matches('/')),
                false,
            ),
            _ => continue,
        };
        loop {
            let st = dir.join("memory.stat");
            let (max, used, cache) = if v2 {
                (
                    num(&dir.join("memory.max")),
                    num(&dir.join("memory.current")),
                    stat(&st, "file")
                        .map(|c: u64| c.saturating_sub(stat(&st, "shmem").unwrap_or(0))),
                )
            } else {
                (
                    num(&dir.join("memory.limit_in_bytes")).filter(|&l| l < 1 << 60),
                    num(&dir.join("memory.usage_in_bytes")),
                    stat(&st, "total_cache")
                        .map(|c: u64| c.saturating_sub(stat(&st, "total_shmem").unwrap_or(0))),
                )
            };
            if let (Some(max), Some(used)) = (max, used) {
                let free = max.saturating_sub(used.saturating_sub(cache.unwrap_or(0)));
                best = Some(best.map_or(free, |b| b.min(free)));
            }
            if dir == root || !dir.pop() || !dir.starts_with(root) {
                break;
            }
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo() {
        let t = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(meminfo_available(t), Some(20_000_000 * 1024));
        assert_eq!(meminfo_available("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn thresholds_the_user_set_are_seen() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |v: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == v)
                    .map(|(_, x)| x.to_string())
            }
        };
        assert!(!thresholds_set_by_user(env(&[])));
        assert!(thresholds_set_by_user(env(&[(
            "MALLOC_TRIM_THRESHOLD_",
            "0"
        )])));
        assert!(thresholds_set_by_user(env(&[(
            "MALLOC_MMAP_THRESHOLD_",
            "1"
        )])));
        const TUNED: &str = "glibc.malloc.tcache_count=0:glibc.malloc.mmap_threshold=4096";
        assert!(thresholds_set_by_user(env(&[("GLIBC_TUNABLES", TUNED)])));
        const OTHER: &str = "glibc.malloc.tcache_count=0";
        assert!(!thresholds_set_by_user(env(&[("GLIBC_TUNABLES", OTHER)])));
    }

    #[test]
    fn cgroup_v2_and_v1_limits() {
        let root = std::env::temp_dir().join(format!("archfs-cg-{}", std::process::id()));
        let job = root.join("slurm/job_7");
        std::fs::create_dir_all(&job).unwrap();
        std::fs::write(root.join("slurm/memory.max"), "max\n").unwrap();
        std::fs::write(root.join("slurm/memory.current"), "5000\n").unwrap();
        std::fs::write(job.join("memory.max"), "10000\n").unwrap();
        std::fs::write(job.join("memory.current"), "6000\n").unwrap();
        std::fs::write(job.join("memory.stat"), "anon 3000\nfile 2500\nshmem 500\n").unwrap();
        // 10000 - (6000 - (2500 - 500)): the job's page cache counts as free, its shared
        // memory does not.
        assert_eq!(cgroup_headroom("0::/slurm/job_7\n", &root), Some(6000));
        assert_eq!(cgroup_headroom("0::/\n", &root), None);

        let v1 = root.join("memory/job_8");
        std::fs::create_dir_all(&v1).unwrap();
        std::fs::write(v1.join("memory.limit_in_bytes"), "8000\n").unwrap();
        std::fs::write(v1.join("memory.usage_in_bytes"), "7000\n").unwrap();
        std::fs::write(
            v1.join("memory.stat"),
            "cache 10\ntotal_cache 1000\ntotal_shmem 0\n",
        )
        .unwrap();
        std::fs::write(
            root.join("memory/memory.limit_in_bytes"),
            "9223372036854771712\n",
        )
        .unwrap();
        let text = "12:cpu,cpuacct:/job_8\n4:memory:/job_8\n0::/\n";
        assert_eq!(cgroup_headroom(text, &root), Some(2000));
        std::fs::remove_dir_all(&root).unwrap();
    }
}
