//! Running archfs as its users do: as an ordinary user (through fusermount3, with
//! /dev/fuse at mode 0666 as on a cluster) or as root, from a directory that user can
//! reach whatever the checkout's location, with Debian's Python for training scripts.

use std::ffi::OsStr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::{archfs_bin, run_ok, TempDir};

/// The ordinary user the tests act as.
pub const USER: &str = "archfs-test";

/// A Python every user can run (a pyenv under /root is out of an ordinary user's reach).
pub const PYTHON: &str = "/usr/bin/python3";

/// Who runs a command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Who {
    Root,
    User { uid: u32, gid: u32 },
}

impl Who {
    /// The test user, made on first use; /dev/fuse opened to all as on ordinary installs.
    pub fn user() -> Who {
        if !Command::new("id")
            .arg(USER)
            .output()
            .unwrap()
            .status
            .success()
        {
            // Tests run in parallel: another may have made the user meanwhile.
            let _ = Command::new("useradd")
                .args([
                    "--system",
                    "--no-create-home",
                    "--shell",
                    "/usr/sbin/nologin",
                    USER,
                ])
                .output();
        }
        std::fs::set_permissions("/dev/fuse", std::fs::Permissions::from_mode(0o666)).unwrap();
        let id = |flag: &str| -> u32 {
            String::from_utf8(run_ok(Command::new("id").args([flag, USER])).stdout)
                .unwrap()
                .trim()
                .parse()
                .unwrap()
        };
        Who::User {
            uid: id("-u"),
            gid: id("-g"),
        }
    }

    /// `prog` run as this user, with no supplementary groups.
    pub fn command(&self, prog: impl AsRef<OsStr>) -> Command {
        match *self {
            Who::Root => Command::new(prog),
            Who::User { uid, gid } => {
                let mut c = Command::new("setpriv");
                c.arg(format!("--reuid={uid}"))
                    .arg(format!("--regid={gid}"))
                    .args(["--clear-groups", "--"])
                    .arg(prog);
                c
            }
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Who::Root => "root",
            Who::User { .. } => "user",
        }
    }
}

/// A directory under /tmp that `who` can reach, holding a copy of the archfs binary and
/// a work directory `who` owns; commands run with that as their working directory.
pub struct Stage {
    pub who: Who,
    pub dir: TempDir,
    pub bin: PathBuf,
    pub work: PathBuf,
}

impl Stage {
    pub fn new(tag: &str, who: Who) -> Stage {
        // Not $TMPDIR: CI may point it into a private directory.
        let dir = TempDir::new_in(Path::new("/tmp"), tag);
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let bin = dir.join("archfs");
        std::fs::copy(archfs_bin(), &bin).unwrap();
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
        let work = dir.join("work");
        std::fs::create_dir(&work).unwrap();
        if let Who::User { uid, gid } = who {
            std::os::unix::fs::chown(&work, Some(uid), Some(gid)).unwrap();
        }
        Stage {
            who,
            dir,
            bin,
            work,
        }
    }

    /// `prog` as `who`, in the work directory.
    pub fn command(&self, prog: impl AsRef<OsStr>) -> Command {
        let mut c = self.who.command(prog);
        c.current_dir(&self.work).env("HOME", &self.work);
        c
    }

    /// The staged archfs as `who`.
    pub fn archfs(&self) -> Command {
        self.command(&self.bin)
    }

    /// Copies `file` into the stage, readable by all, and returns its path there.
    pub fn place(&self, file: &Path) -> PathBuf {
        let to = self.dir.join(file.file_name().unwrap());
        std::fs::copy(file, &to).unwrap();
        std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o644)).unwrap();
        to
    }
}

/// A memory cgroup with a hard limit, so a command in it meets the kernel's OOM killer;
/// removed on drop. cgroup v1 (a `memory` hierarchy) or v2 (the memory controller
/// enabled for this process's cgroup's children).
pub struct MemoryCgroup {
    path: PathBuf,
    v2: bool,
}

impl MemoryCgroup {
    pub fn new(tag: &str, limit: u64) -> MemoryCgroup {
        let own = std::fs::read_to_string("/proc/self/cgroup").unwrap();
        let name = format!("archfs-{tag}-{}", std::process::id());
        let v1 = own
            .lines()
            .find_map(|l| l.split_once(":memory:").map(|(_, p)| p.to_owned()));
        let (path, v2) = match v1 {
            Some(rel) => (
                Path::new("/sys/fs/cgroup/memory")
                    .join(rel.trim_start_matches('/'))
                    .join(&name),
                false,
            ),
            None => {
                let rel = own
                    .lines()
                    .find_map(|l| l.strip_prefix("0::"))
                    .expect("no memory cgroup: neither a v1 memory hierarchy nor cgroup v2");
                let parent = Path::new("/sys/fs/cgroup").join(rel.trim_start_matches('/'));
                let _ = std::fs::write(parent.join("cgroup.subtree_control"), "+memory");
                (parent.join(&name), true)
            }
        };
        std::fs::create_dir(&path)
            .unwrap_or_else(|e| panic!("cannot make memory cgroup {path:?} for the OOM test: {e}"));
        let limit = limit.to_string();
        if v2 {
            std::fs::write(path.join("memory.max"), &limit).unwrap();
            let _ = std::fs::write(path.join("memory.swap.max"), "0");
        } else {
            std::fs::write(path.join("memory.limit_in_bytes"), &limit).unwrap();
            let _ = std::fs::write(path.join("memory.memsw.limit_in_bytes"), &limit);
        }
        MemoryCgroup { path, v2 }
    }

    pub fn add(&self, pid: i32) {
        std::fs::write(self.path.join("cgroup.procs"), pid.to_string()).unwrap();
    }

    /// How many processes the OOM killer killed in this cgroup.
    pub fn oom_kills(&self) -> u64 {
        let file = if self.v2 {
            "memory.events"
        } else {
            "memory.oom_control"
        };
        std::fs::read_to_string(self.path.join(file))
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("oom_kill "))
            .map_or(0, |n| n.trim().parse().unwrap())
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        for _ in 0..100 {
            if std::fs::remove_dir(&self.path).is_ok() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }
}
