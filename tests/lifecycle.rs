//! Every way a job ends leaves no mount behind, as root and as an ordinary user, with
//! files held open under the mount, and `archfs run` treats a Python training script as
//! an init wrapper should: a clean signal state, every signal passed on, its exit status
//! returned, the mount there until it has ended.
//!
//! The promise is "gone within 2 s"; the tests wait on events up to [`DEADLINE`] so they
//! pass on a busy machine, and print how long each ending took.

use crate::common;

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus, Stdio};
use std::time::Instant;

use common::user::{MemoryCgroup, Stage, Who, PYTHON};
use common::*;

const DEADLINE: u64 = 60;

/// Two tests of `check`: as root, and as an ordinary user.
macro_rules! as_root_and_as_a_user {
    ($check:ident) => {
        mod $check {
            #[test]
            fn as_root() {
                super::$check(super::Who::Root);
            }

            #[test]
            fn as_an_ordinary_user() {
                super::$check(super::Who::user());
            }
        }
    };
}

/// A staged image, mount point and training script for one actor.
/// What every job's tree holds: `hello.txt`, which [`Job::assert_readable`] reads, and
/// `sub/big.bin`, which [`Job::hold`] keeps open.
fn base_tree(src: &Path) {
    std::fs::create_dir_all(src.join("sub")).unwrap();
    std::fs::write(src.join("hello.txt"), b"hello archfs\n").unwrap();
    std::fs::write(src.join("sub/big.bin"), vec![42u8; 1 << 20]).unwrap();
}

struct Job {
    stage: Stage,
    img: PathBuf,
    mnt: PathBuf,
    log: PathBuf,
    script: PathBuf,
    /// Options of `mount` and `run` besides the defaults.
    opts: Vec<&'static str>,
}

impl Job {
    fn new(tag: &str, who: Who) -> Job {
        let stage = Stage::new(&format!("{tag}-{}", who.name()), who);
        let src = stage.dir.join("src");
        base_tree(&src);
        let img = stage.dir.join("small.sqfs");
        mksquashfs(&src, &img, &[]);
        let script =
            stage.place(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/common/train.py"));
        Job {
            img,
            // Made by archfs, as the actor, and removed again.
            mnt: stage.work.join("mnt"),
            log: stage.work.join("train.log"),
            script,
            stage,
            opts: Vec::new(),
        }
    }

    fn who(&self) -> &'static str {
        self.stage.who.name()
    }

    /// `archfs mount` in the background; the server's pid.
    fn mount(&self) -> i32 {
        let out = self
            .stage
            .archfs()
            .arg("mount")
            .arg("--log")
            .arg(self.stage.work.join("server.log"))
            .args(&self.opts)
            .arg(&self.img)
            .arg(&self.mnt)
            .env("ARCHFS_LOG", "info")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}: mount: {}",
            self.who(),
            stderr_of(&out)
        );
        let pids = pids_of_mount(&self.mnt);
        let args = |pid: &i32| std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        assert_eq!(
            pids.len(),
            1,
            "{}: one server: {:?}",
            self.who(),
            pids.iter()
                .map(|p| (p, String::from_utf8_lossy(&args(p)).replace('\0', " ")))
                .collect::<Vec<_>>()
        );
        pids[0]
    }

    /// Mounts a GNU tar of `src`, named `name`, from now on.
    fn use_tar_of(&mut self, src: &Path, name: &str) {
        self.img = self.stage.dir.join(name);
        run_ok(
            std::process::Command::new("tar")
                .arg("-cf")
                .arg(&self.img)
                .arg("-C")
                .arg(src)
                .arg("."),
        );
    }

    /// A process of the actor's that holds a file under the mount open, as a DataLoader
    /// worker does, until dropped.
    fn hold(&self) -> Holder {
        let mut child = self
            .stage
            .command(PYTHON)
            .args([
                "-c",
                "import sys,time; f=open(sys.argv[1],'rb'); f.read(1); \
                 print('holding', flush=True); time.sleep(3600)",
            ])
            .arg(self.mnt.join("sub/big.bin"))
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(
            line,
            "holding\n",
            "{}: the holder could not open a file",
            self.who()
        );
        Holder(child)
    }

    /// Waits until the mount is gone, and says how long that took.
    fn gone(&self, since: Instant, what: &str) {
        assert!(
            wait_for(DEADLINE, || !is_mounted(&self.mnt)),
            "{}: {what}: the mount is still there",
            self.who()
        );
        eprintln!(
            "{}: {what}: mount gone after {:.3} s",
            self.who(),
            since.elapsed().as_secs_f64()
        );
        assert!(
            wait_for(DEADLINE, || watchdog_pids(&self.mnt).is_empty()),
            "{}: {what}: the watchdog outlived the mount",
            self.who()
        );
        assert!(
            wait_for(DEADLINE, || lister_pids(&self.mnt).is_empty()),
            "{}: {what}: the listing process outlived the mount",
            self.who()
        );
        assert!(
            wait_for(DEADLINE, || pids_of_mount(&self.mnt).is_empty()),
            "{}: {what}: the server outlived the mount",
            self.who()
        );
    }

    /// The actor reads a file through the mount.
    fn assert_readable(&self) {
        let out = self
            .stage
            .command("cat")
            .arg(self.mnt.join("hello.txt"))
            .output()
            .unwrap();
        assert_eq!(
            out.stdout,
            b"hello archfs\n",
            "{}: {}",
            self.who(),
            stderr_of(&out)
        );
    }

    /// `archfs run IMG MNT -- python3 train.py MNT LOG HOW`, started.
    fn run(&self, how: &str) -> Child {
        self.command_for_run(how).spawn().unwrap()
    }

    fn command_for_run(&self, how: &str) -> std::process::Command {
        let _ = std::fs::remove_file(&self.log);
        let mut cmd = self.stage.archfs();
        cmd.arg("run")
            .args(&self.opts)
            .arg(&self.img)
            .arg(&self.mnt)
            .args(["--", PYTHON])
            .arg(&self.script)
            .arg(&self.mnt)
            .arg(&self.log)
            .arg(how);
        cmd
    }

    fn log_lines(&self) -> Vec<String> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    fn wait_log(&self, line: &str) {
        assert!(
            wait_for(DEADLINE, || self.log_lines().iter().any(|l| l == line)),
            "{}: the script never logged {line:?}: {:?}",
            self.who(),
            self.log_lines()
        );
    }

    /// The pid the script logged under `key` (`pid`, `worker`).
    fn logged_pid(&self, key: &str) -> i32 {
        self.log_lines()
            .iter()
            .find_map(|l| l.strip_prefix(key)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {key} in {:?}", self.log_lines()))
    }

    /// Ends the processes the script left behind (its worker, or itself).
    fn reap(&self) {
        for key in ["worker ", "pid "] {
            if let Some(pid) = self
                .log_lines()
                .iter()
                .find_map(|l| l.strip_prefix(key)?.trim().parse::<i32>().ok())
            {
                // SAFETY: kill has no memory preconditions.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    }
}

struct Holder(Child);

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        self.reap();
    }
}

fn wait(child: &mut Child) -> ExitStatus {
    let end = Instant::now() + std::time::Duration::from_secs(DEADLINE);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(Instant::now() < end, "the process did not end");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

fn server_endings(who: Who) {
    let j = Job::new("server", who);
    for (name, sig) in [
        ("SIGTERM", libc::SIGTERM),
        ("SIGINT", libc::SIGINT),
        ("SIGHUP", libc::SIGHUP),
        ("SIGKILL", libc::SIGKILL),
    ] {
        let server = j.mount();
        let holder = j.hold();
        let t = Instant::now();
        kill(server, sig);
        j.gone(t, &format!("{name} to the server, a file held open"));
        assert!(
            wait_for(DEADLINE, || !j.mnt.exists()),
            "{}: {name}: the mount point archfs created is still there",
            j.who()
        );
        drop(holder);
    }

    // SIGUSR1/SIGUSR2 are for the training code's checkpoints: the mount stays.
    let server = j.mount();
    for sig in [libc::SIGUSR1, libc::SIGUSR2] {
        kill(server, sig);
        let log = j.stage.work.join("server.log");
        assert!(
            wait_for(DEADLINE, || std::fs::read_to_string(&log)
                .unwrap_or_default()
                .contains(&format!("signal {sig} ignored"))),
            "{}: signal {sig} never reached the server",
            j.who()
        );
    }
    j.assert_readable();

    // The server and its watchdog SIGKILLed together (a job's cgroup killed): the mount is
    // left stale, and the next mount on the path recovers it.
    let holder = j.hold();
    for pid in watchdog_pids(&j.mnt) {
        kill(pid, libc::SIGKILL);
    }
    kill(server, libc::SIGKILL);
    assert!(wait_for(DEADLINE, || pids_of_mount(&j.mnt).is_empty()));
    // A stat sent while the dying server's descriptor is being closed ends with
    // "Software caused connection abort"; once it is closed, every one with "not
    // connected".
    let stat = || stderr_of(&j.stage.command("stat").arg(&j.mnt).output().unwrap());
    assert!(
        wait_for(DEADLINE, || stat().contains("not connected")),
        "{}: expected a stale mount: {}",
        j.who(),
        stat()
    );
    let server = j.mount();
    j.assert_readable();
    drop(holder);
    let t = Instant::now();
    kill(server, libc::SIGTERM);
    j.gone(t, "SIGTERM after recovering a stale mount");
}

as_root_and_as_a_user!(server_endings);

/// Every signal sent to `run` reaches the Python command, which handles it while the
/// mount is still there; SIGTERM ends it with its own status.
fn run_passes_signals_on(who: Who) {
    let j = Job::new("runsig", who);
    let mut run = j.run("wait");
    j.wait_log("ready readable True");
    assert!(
        j.log_lines()
            .contains(&"blocked 0000000000000000".to_string()),
        "{}: the command started with signals blocked: {:?}",
        j.who(),
        j.log_lines()
    );
    for (name, sig) in [
        ("SIGHUP", libc::SIGHUP),
        ("SIGINT", libc::SIGINT),
        ("SIGQUIT", libc::SIGQUIT),
        ("SIGUSR1", libc::SIGUSR1),
        ("SIGUSR2", libc::SIGUSR2),
        ("SIGCONT", libc::SIGCONT),
        ("SIGALRM", libc::SIGALRM),
        ("SIGWINCH", libc::SIGWINCH),
    ] {
        kill(run.id() as i32, sig);
        j.wait_log(&format!("signal {name} readable True"));
    }
    let t = Instant::now();
    kill(run.id() as i32, libc::SIGTERM);
    let status = wait(&mut run);
    assert_eq!(
        status.code(),
        Some(7),
        "{}: the command's own status",
        j.who()
    );
    assert!(j
        .log_lines()
        .contains(&"signal SIGTERM readable True".to_string()));
    j.gone(t, "SIGTERM to run, a worker holding a file");
    assert!(wait_for(DEADLINE, || !j.mnt.exists()));
}

as_root_and_as_a_user!(run_passes_signals_on);

/// However the command ends, `run` returns its status as a shell reports it and leaves
/// no mount, though a worker of the command still holds a file open.
fn run_endings(who: Who) {
    let j = Job::new("runend", who);
    for (how, code) in [("exit0", 0), ("exit3", 3), ("abort", 128 + libc::SIGABRT)] {
        let mut run = j.run(how);
        let status = wait(&mut run);
        assert_eq!(
            status.code(),
            Some(code),
            "{}: {how}: {:?}",
            j.who(),
            j.log_lines()
        );
        let t = Instant::now();
        j.gone(t, &format!("command {how}, a worker holding a file"));
        j.reap();
    }

    // SIGKILL of the command.
    let mut run = j.run("sleep");
    j.wait_log("ready readable True");
    kill(j.logged_pid("pid "), libc::SIGKILL);
    let status = wait(&mut run);
    assert_eq!(status.code(), Some(128 + libc::SIGKILL), "{}", j.who());
    j.gone(Instant::now(), "command SIGKILLed");
    j.reap();

    // The kernel's OOM killer ends the command.
    let cgroup = MemoryCgroup::new(&format!("oom-{}", j.who()), 96 << 20);
    let mut run = j.run("oom");
    j.wait_log("ready readable True");
    cgroup.add(j.logged_pid("pid "));
    std::fs::write(j.stage.work.join("go"), b"").unwrap();
    let status = wait(&mut run);
    std::fs::remove_file(j.stage.work.join("go")).unwrap();
    assert_eq!(status.code(), Some(128 + libc::SIGKILL), "{}", j.who());
    assert!(cgroup.oom_kills() >= 1, "{}: not the OOM killer", j.who());
    j.gone(Instant::now(), "command OOM-killed");
    j.reap();

    // `run` itself SIGKILLed: the watchdog detaches the mount under the running command.
    let mut run = j.run("sleep");
    j.wait_log("ready readable True");
    let t = Instant::now();
    kill(run.id() as i32, libc::SIGKILL);
    wait(&mut run);
    j.gone(t, "run SIGKILLed, the command still running");
    j.reap();

    // A command that cannot be run: 127, as a shell says, and no mount.
    let out = j
        .stage
        .archfs()
        .arg("run")
        .arg(&j.img)
        .arg(&j.mnt)
        .args(["--", "/no/such/command"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(127), "{}", stderr_of(&out));
    assert!(stderr_of(&out).contains("cannot run /no/such/command"));
    assert!(!is_mounted(&j.mnt));
}

as_root_and_as_a_user!(run_endings);

/// Compressed tars end the same way: a gzip tar read in place, the same decoded ahead by
/// `--preload` (its copying threads running, or idle in their pool, at the signal), and
/// an xz tar served from a decoded copy that a background thread makes.
fn compressed_endings(who: Who) {
    let mut j = Job::new("compressed", who);
    let src = j.stage.dir.join("csrc");
    std::fs::create_dir_all(src.join("sub")).unwrap();
    std::fs::write(src.join("hello.txt"), b"hello archfs\n").unwrap();
    std::fs::write(src.join("sub/big.bin"), xorshift_bytes(3)(32 << 20)).unwrap();
    // (format, writer, options, whether it is decoded ahead from mount): pzstd's frames
    // are decoded ahead by the default --preload=auto, xz in one block is copied at mount.
    for (ext, tool, opts, ahead) in [
        ("tar.gz", "gzip -1", vec![], false),
        ("tar.gz", "gzip -1", vec!["--preload=always"], true),
        ("tar.zst", "pzstd -q -p 2", vec![], true),
        ("tar.xz", "xz -0", vec![], false),
    ] {
        j.opts = opts;
        let archive = j.stage.dir.join(format!("data.{ext}"));
        let ext = format!("{ext} {}", j.opts.join(" "));
        run_ok(std::process::Command::new("sh").arg("-c").arg(format!(
            "tar -cf - -C {} . | {tool} > {}",
            src.display(),
            archive.display()
        )));
        j.img = archive;
        for (name, sig) in [("SIGTERM", libc::SIGTERM), ("SIGKILL", libc::SIGKILL)] {
            let _ = std::fs::remove_file(j.stage.work.join("server.log"));
            let server = j.mount();
            if ahead {
                let log = std::fs::read_to_string(j.stage.work.join("server.log")).unwrap();
                assert!(log.contains("--preload: decoding"), "{}: {log}", j.who());
            }
            let holder = j.hold();
            let t = Instant::now();
            kill(server, sig);
            j.gone(t, &format!("{ext}: {name} to the server, a file held open"));
            drop(holder);
        }
        let mut run = j.run("exit0");
        let status = wait(&mut run);
        assert_eq!(
            status.code(),
            Some(0),
            "{}: {ext}: {:?}",
            j.who(),
            j.log_lines()
        );
        j.gone(Instant::now(), &format!("{ext}: command exit0"));
        j.reap();
    }
}

as_root_and_as_a_user!(compressed_endings);

/// A first epoch starts the preload and the push into the page cache (a thread of the
/// server writing to /dev/fuse): the server still ends on SIGTERM and SIGKILL with a
/// reader holding a file open, and `run` ends with its Python command.
fn push_endings(who: Who) {
    let mut j = Job::new("push", who);
    let src = j.stage.dir.join("psrc");
    base_tree(&src);
    let mut bytes = xorshift_bytes(5);
    for i in 0..2000 {
        let d = src.join(format!("data/c{}", i % 8));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join(format!("f{i}.bin")), bytes(128 << 10)).unwrap();
    }
    j.use_tar_of(&src, "data.tar");
    let epoch = "import os,sys,time; m=sys.argv[1]; \
        n=sorted(os.path.join(d,f) for d,_,fs in os.walk(os.path.join(m,'data')) for f in fs); \
        [open(p,'rb').read() for p in n[:200]]; f=open(n[-1],'rb'); f.read(1); \
        print('holding', flush=True); time.sleep(3600)";
    let log = j.stage.work.join("server.log");
    for (name, sig) in [("SIGTERM", libc::SIGTERM), ("SIGKILL", libc::SIGKILL)] {
        let _ = std::fs::remove_file(&log);
        let server = j.mount();
        let mut reader = j
            .stage
            .command(PYTHON)
            .args(["-c", epoch])
            .arg(&j.mnt)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(reader.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(
            line,
            "holding\n",
            "{}: the reader did not get going",
            j.who()
        );
        let holder = Holder(reader);
        let started = || std::fs::read_to_string(&log).unwrap_or_default();
        assert!(
            wait_for(DEADLINE, || started().contains("files read: preloading")),
            "{}: 200 files read and no preload: {}",
            j.who(),
            started()
        );
        let t = Instant::now();
        kill(server, sig);
        j.gone(
            t,
            &format!("{name} to the server while pushing, a file held open"),
        );
        drop(holder);
    }
    let mut run = j.run("epoch");
    let status = wait(&mut run);
    assert_eq!(status.code(), Some(0), "{}: {:?}", j.who(), j.log_lines());
    assert!(
        j.log_lines()
            .contains(&"epoch 200 of 2000 files read".to_string()),
        "{}: {:?}",
        j.who(),
        j.log_lines()
    );
    j.gone(Instant::now(), "command exit0 while pushing");
    j.reap();
}

as_root_and_as_a_user!(push_endings);

/// The server lists the tree ahead in a process of its own (src/warm/prelist.rs): `mount` with
/// its stderr captured returns while it lists; `archfs unmount` while it lists returns
/// with the server gone; SIGTERM and SIGKILL to the server while it lists, a reader
/// holding a file open, still leave no mount and no lister, and neither does `run` with
/// a Python command that ends at once.
fn prelist_endings(who: Who) {
    let mut j = Job::new("prelist", who);
    let src = j.stage.dir.join("lsrc");
    base_tree(&src);
    // 100,000 names: at the kernel's ~4 µs an entry the listing takes most of a second,
    // while the signal follows the mount within a Python start-up. Written by Python's
    // tarfile: creating as many files first took this VM's /tmp 51 s.
    j.img = j.stage.dir.join("names.tar");
    let script = "import sys,tarfile\n\
        with tarfile.open(sys.argv[1], 'w') as t:\n\
        \x20   t.add(sys.argv[2], arcname='.')\n\
        \x20   for c in range(100):\n\
        \x20       d = tarfile.TarInfo(f'data/c{c:03}'); d.type = tarfile.DIRTYPE; d.mode = 0o755\n\
        \x20       t.addfile(d)\n\
        \x20       for i in range(1000): t.addfile(tarfile.TarInfo(f'data/c{c:03}/f{i}'))\n";
    run_ok(
        std::process::Command::new(PYTHON)
            .args(["-c", script])
            .arg(&j.img)
            .arg(&src),
    );
    // The listing takes a few tenths of a second; on a loaded machine `mount` may return
    // after it, so each step below mounts again (up to TRIES times) until it catches the
    // lister running.
    const TRIES: usize = 10;
    let unmount = |j: &Job, what: &str| {
        let t = Instant::now();
        run_ok(j.stage.archfs().arg("unmount").arg(&j.mnt));
        // `unmount` ends the listing first, so the unmount is not lazy and the server
        // has exited when the command returns.
        assert!(
            pids_of_mount(&j.mnt).is_empty(),
            "{}: {what}: the server outlived `archfs unmount`",
            j.who()
        );
        j.gone(t, what);
    };
    // As Python's archfs.mount() runs it: no --log, stderr captured to its end. That end
    // must come once the mount is live, not once the listing ends (the lister must not
    // hold the pipe), so the lister is seen running after some of these mounts.
    let mut caught = false;
    for _ in 0..TRIES {
        let out = j
            .stage
            .archfs()
            .arg("mount")
            .arg(&j.img)
            .arg(&j.mnt)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}: {}", j.who(), stderr_of(&out));
        for pid in lister_pids(&j.mnt) {
            caught = true;
            let fd2 = std::fs::read_link(format!("/proc/{pid}/fd/2")).unwrap_or_default();
            assert!(
                !fd2.to_string_lossy().starts_with("pipe:"),
                "{}: the lister holds the caller's stderr {fd2:?}",
                j.who()
            );
        }
        unmount(&j, "archfs unmount while listing ahead");
        if caught {
            break;
        }
    }
    assert!(
        caught,
        "{}: `mount` with its stderr captured returned after the listing ended, {TRIES} times",
        j.who()
    );
    for (name, sig) in [("SIGTERM", libc::SIGTERM), ("SIGKILL", libc::SIGKILL)] {
        let server = (0..TRIES)
            .find_map(|_| {
                let server = j.mount();
                if lister_pids(&j.mnt).is_empty() {
                    unmount(&j, "archfs unmount after the listing");
                    return None;
                }
                Some(server)
            })
            .unwrap_or_else(|| panic!("{}: the lister never seen running", j.who()));
        let holder = j.hold();
        // Usually still listing: the holder's Python starts in well under the listing's
        // time, but a loaded machine may say otherwise.
        let listing = !lister_pids(&j.mnt).is_empty();
        eprintln!("{}: {name} while listing: {listing}", j.who());
        let t = Instant::now();
        kill(server, sig);
        j.gone(t, &format!("{name} to the server while listing ahead"));
        drop(holder);
    }
    let mut run = j
        .stage
        .archfs()
        .arg("run")
        .arg(&j.img)
        .arg(&j.mnt)
        .args(["--", PYTHON, "-c", "import os,sys; os.stat(sys.argv[1])"])
        .arg(j.mnt.join("hello.txt"))
        .spawn()
        .unwrap();
    let status = wait(&mut run);
    assert_eq!(status.code(), Some(0), "{}", j.who());
    j.gone(Instant::now(), "run's command ended while listing ahead");
}

as_root_and_as_a_user!(prelist_endings);

/// `run` started as a shell starts a background job (SIGINT and SIGQUIT ignored), with
/// SIGTERM blocked as well, still gives its command an empty mask and default actions.
#[test]
fn run_gives_the_command_a_clean_signal_state() {
    for who in [Who::Root, Who::user()] {
        let j = Job::new("runclean", who);
        let mut cmd = j.stage.archfs();
        cmd.arg("run")
            .arg(&j.img)
            .arg(&j.mnt)
            .args(["--", "cat", "/proc/self/status"]);
        // SAFETY: signal and sigprocmask are async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                libc::signal(libc::SIGINT, libc::SIG_IGN);
                libc::signal(libc::SIGQUIT, libc::SIG_IGN);
                let mut set: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut set);
                libc::sigaddset(&mut set, libc::SIGTERM);
                libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
                Ok(())
            });
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{}", stderr_of(&out));
        let status = String::from_utf8(out.stdout).unwrap();
        for key in ["SigBlk:", "SigIgn:"] {
            let line = status.lines().find(|l| l.starts_with(key)).unwrap();
            assert!(
                line.ends_with("0000000000000000"),
                "{}: the command started with {line}",
                who.name()
            );
        }
        assert!(!is_mounted(&j.mnt));
    }
}

/// Ctrl-C at a terminal reaches the command (it had SIGINT blocked before), and the mount
/// stays until it has ended. `run` does not pass the terminal's SIGINT on again; the count
/// below catches a second one only if it arrives after the first was handled.
fn ctrl_c_at_a_terminal_reaches_the_command(who: Who) {
    let j = Job::new("ctrlc", who);
    let (mut master, mut slave) = (0, 0);
    // SAFETY: openpty writes two descriptors; null name, termios and size are allowed.
    let rc = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    assert_eq!(rc, 0, "openpty");
    // SAFETY: openpty just returned these descriptors to us.
    let (master, slave): (std::fs::File, std::os::fd::OwnedFd) = unsafe {
        use std::os::fd::FromRawFd;
        (
            std::fs::File::from_raw_fd(master),
            std::os::fd::OwnedFd::from_raw_fd(slave),
        )
    };
    let mut cmd = j.command_for_run("wait");
    cmd.stdin(Stdio::from(slave));
    // SAFETY: setsid and ioctl are async-signal-safe. A session of its own with the pty
    // as its terminal makes `run` and its command the terminal's foreground group.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            if libc::ioctl(0, libc::TIOCSCTTY, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut run = cmd.spawn().unwrap();
    j.wait_log("ready readable True");
    std::io::Write::write_all(&mut &master, b"\x03").unwrap();
    j.wait_log("signal SIGINT readable True");
    kill(run.id() as i32, libc::SIGTERM);
    assert_eq!(wait(&mut run).code(), Some(7), "{}", j.who());
    let sigints = j
        .log_lines()
        .iter()
        .filter(|l| l.starts_with("signal SIGINT"))
        .count();
    assert_eq!(sigints, 1, "{}: {:?}", j.who(), j.log_lines());
    assert!(!is_mounted(&j.mnt));
}

as_root_and_as_a_user!(ctrl_c_at_a_terminal_reaches_the_command);

/// `--exit-with PID`: the mount goes when its owner dies, SIGKILL included; with no mount
/// point given, one is made under $TMPDIR, named after the SLURM job, and printed.
fn owner_ends(who: Who) {
    let mut j = Job::new("owner", who);
    let mut owner = j
        .stage
        .command(PYTHON)
        .args(["-c", "import time; time.sleep(3600)"])
        .spawn()
        .unwrap();
    let out = j
        .stage
        .archfs()
        .arg("mount")
        .arg("--exit-with")
        .arg(owner.id().to_string())
        .arg(&j.img)
        .env("TMPDIR", &j.stage.work)
        .env("SLURM_JOB_ID", "4242")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}: {}", j.who(), stderr_of(&out));
    let printed = String::from_utf8(out.stdout).unwrap();
    let mnt = PathBuf::from(printed.trim_end());
    assert_eq!(mnt.parent(), Some(j.stage.work.as_path()), "{printed:?}");
    assert!(
        mnt.file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("archfs-job4242-small-"),
        "{printed:?}"
    );
    assert!(is_mounted(&mnt), "{}: {mnt:?} not mounted", j.who());
    j.mnt = mnt;
    let holder = j.hold();
    let t = Instant::now();
    owner.kill().unwrap();
    owner.wait().unwrap();
    j.gone(t, "the --exit-with owner SIGKILLed, a file held open");
    assert!(wait_for(DEADLINE, || !j.mnt.exists()), "{}", j.who());
    drop(holder);
}

as_root_and_as_a_user!(owner_ends);
