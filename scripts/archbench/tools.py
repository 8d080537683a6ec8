"""The tools compared (archfs, squashfuse, squashfuse_ll, the kernel driver, ratarmount,
archivemount, fuse-archive, the plain directory, a /dev/shm copy): how each mounts and
unmounts; the preflight check of each; which archfs binary."""

import os
import random
import shutil
import signal
import subprocess
import time

from .constants import SCRIPT, TARGET_DIR, VENV, WORKTREE
from .system import (REG, Failed, Timeout, detach_loops, find_server_pids, force_unmount,
                     is_mounted, log, pid_alive, proc_cmdline, proc_stats, sh)

# ---------------------------------------------------------------------------------------------
# Targets: what is measured. mount() returns seconds to a usable mount point.
# ---------------------------------------------------------------------------------------------


class Target:
    kind = "fuse"
    server_token = None
    source = None
    # Mounted once the mount command returns (archfs returns once the mount is live), not
    # once the root lists something: a listing of a flat root of 200,000 files would count
    # in the mount time and fill the kernel's caches before a cold pass.
    live_on_return = False
    has_index = False    # tar tools: mount time measured without and with a saved index

    def __init__(self, name, source, mnt, cap):
        self.name = name
        self.source = source
        self.mnt = mnt
        self.cap = cap
        self.root = mnt
        self.pids = []
        self.unsupported = None   # a reason: row printed with it instead of numbers
        self.read_timed_out = False
        self.logfile = None

    # -- to override
    def mount_cmd(self):
        raise NotImplementedError

    def unmount_cmds(self):
        return [["fusermount3", "-u", self.mnt], ["umount", self.mnt]]

    def remove_index(self):
        pass

    def index_present(self):
        return False

    # -- generic
    def mount(self):
        os.makedirs(self.mnt, exist_ok=True)
        if is_mounted(self.mnt):
            force_unmount(self.mnt)
        self.logfile = os.path.join(os.path.dirname(self.mnt), f"{os.path.basename(self.mnt)}.log")
        t0 = time.perf_counter()
        with open(self.logfile, "ab") as lf:
            try:
                r = subprocess.run(self.mount_cmd(), stdin=subprocess.DEVNULL, stdout=lf,
                                   stderr=lf, timeout=self.cap, start_new_session=True)
            except subprocess.TimeoutExpired:
                # A server has a session of its own and mounts on: stopped here, or the
                # next pass finds its mount.
                if self.server_token:
                    self.pids = find_server_pids(self.server_token, self.mnt)
                self.unmount(force=True)
                raise Timeout("mount")
        if r.returncode != 0 or (self.live_on_return and not is_mounted(self.mnt)):
            self.unmount(force=True)
            raise Failed(f"mount exited {r.returncode}: {self.log_tail()}")
        while not self.live_on_return:
            if is_mounted(self.mnt):
                try:
                    if os.listdir(self.mnt):
                        break
                except OSError:
                    pass
            if time.perf_counter() - t0 > self.cap:
                self.unmount(force=True)
                raise Timeout("mount")
            time.sleep(0.002)
        elapsed = time.perf_counter() - t0
        if self.server_token:
            self.pids = find_server_pids(self.server_token, self.mnt)
        return elapsed

    def log_tail(self):
        try:
            with open(self.logfile, errors="replace") as f:
                return " | ".join(f.read().strip().splitlines()[-3:])
        except OSError:
            return ""

    def stats(self):
        """(server CPU s, server peak RSS MiB) of the current mount, or (None, None)."""
        if not self.pids:
            return None, None
        cpu = hwm = 0
        for p in self.pids:
            s = proc_stats(p)
            if s is None:
                return None, None
            cpu += s[0]
            hwm += s[1]
        return cpu, hwm / 1024

    def unmount(self, force=False):
        if is_mounted(self.mnt):
            for cmd in self.unmount_cmds():
                try:
                    sh(cmd, timeout=30 if not force else 10)
                except (subprocess.TimeoutExpired, FileNotFoundError):
                    pass
                if not is_mounted(self.mnt):
                    break
            if is_mounted(self.mnt):
                force_unmount(self.mnt)
        deadline = time.time() + (10 if not force else 3)
        for p in self.pids:
            while pid_alive(p) and time.time() < deadline:
                time.sleep(0.01)
            cl = proc_cmdline(p)
            if pid_alive(p) and cl and self.mnt in cl:
                for sig in (signal.SIGTERM, signal.SIGKILL):
                    try:
                        os.kill(p, sig)
                    except OSError:
                        break
                    t = time.time()
                    while pid_alive(p) and time.time() - t < 3:
                        time.sleep(0.01)
                    if not pid_alive(p):
                        break
        self.pids = []
        if force and is_mounted(self.mnt):
            force_unmount(self.mnt)


class Archfs(Target):
    server_token = "--ready-fd"

    def __init__(self, name, source, mnt, cap, binary, extra):
        super().__init__(name, source, mnt, cap)
        self.binary = binary
        self.extra = extra
        self.index_files = []   # sidecar files a tar mount left behind (a saved index)

    def mount_cmd(self):
        return [self.binary, "mount", *self.extra, self.source, self.mnt]

    def unmount_cmds(self):
        return [[self.binary, "unmount", self.mnt], ["fusermount3", "-u", self.mnt]]

    def remove_index(self):
        for f in self.index_files:
            if os.path.isdir(f):
                shutil.rmtree(f, ignore_errors=True)
            elif os.path.exists(f):
                os.unlink(f)

    def index_present(self):
        return bool(self.index_files) and all(os.path.exists(f) for f in self.index_files)


class Squashfuse(Target):
    def __init__(self, name, source, mnt, cap, exe):
        super().__init__(name, source, mnt, cap)
        self.exe = exe
        self.server_token = exe

    def mount_cmd(self):
        return [self.exe, self.source, self.mnt]

    def stats(self):
        # squashfuse_ll's argv[0] also contains "squashfuse"; find_server_pids matched the mnt
        return super().stats()


class Kernel(Target):
    kind = "kernel"

    def mount_cmd(self):
        return ["mount", "-t", "squashfs", "-o", "loop,ro", self.source, self.mnt]

    def unmount_cmds(self):
        return [["umount", self.mnt]]

    def unmount(self, force=False):
        super().unmount(force)
        detach_loops(self.source)


class Ratarmount(Target):
    server_token = "ratarmount"
    has_index = True

    def index_path(self):
        return self.source + ".index.sqlite"

    def mount_cmd(self):
        return [os.path.join(VENV, "bin", "ratarmount"), "--index-file", self.index_path(),
                self.source, self.mnt]

    def remove_index(self):
        if os.path.exists(self.index_path()):
            os.unlink(self.index_path())

    def index_present(self):
        return os.path.exists(self.index_path())


class Archivemount(Target):
    server_token = "archivemount"

    def mount_cmd(self):
        return ["archivemount", "-o", "readonly", self.source, self.mnt]

    def unmount_cmds(self):
        return [["fusermount3", "-u", self.mnt], ["fusermount", "-u", self.mnt],
                ["umount", self.mnt]]


class FuseArchive(Target):
    server_token = "fuse-archive"

    def mount_cmd(self):
        return ["fuse-archive", self.source, self.mnt]


class PlainDir(Target):
    kind = "dir"

    def __init__(self, name, source, mnt, cap):
        super().__init__(name, source, mnt, cap)
        self.root = source

    def mount(self):
        return None

    def unmount(self, force=False):
        pass


class ShmCopy(Target):
    """The dataset untarred into /dev/shm: 'mount' is the untar, kept across workloads."""
    kind = "dir"

    def __init__(self, name, source, mnt, cap, shmdir):
        super().__init__(name, source, mnt, cap)
        self.root = shmdir
        REG.paths.append(shmdir)

    def extract(self):
        shutil.rmtree(self.root, ignore_errors=True)
        os.makedirs(self.root)
        t0 = time.perf_counter()
        try:
            r = sh(["tar", "-xf", self.source, "-C", self.root], timeout=self.cap)
        except subprocess.TimeoutExpired:
            shutil.rmtree(self.root, ignore_errors=True)
            raise Timeout("untar")
        if r.returncode != 0:
            raise Failed(f"tar -x: {r.stderr.strip()[-200:]}")
        return time.perf_counter() - t0

    def mount(self):
        if not os.path.isdir(self.root) or not os.listdir(self.root):
            self.extract()
        return None

    def unmount(self, force=False):
        if force:
            shutil.rmtree(self.root, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Preflight: does each tool mount, list and return the right bytes?
# ---------------------------------------------------------------------------------------------


def preflight(t, src, manifest, cap):
    if t.kind == "dir":
        t.mount()
        return
    watch = [os.path.dirname(t.source), os.path.expanduser("~/.cache/archfs")]

    def snapshot():
        s = set()
        for d in watch:
            if os.path.isdir(d):
                s |= {os.path.join(d, x) for x in os.listdir(d)}
        return s
    if isinstance(t, Archfs) and t.has_index:
        # An index left by an earlier run would be loaded, not written: the first mount
        # would then time a load, and no sidecar would show up as new below.
        name = os.path.basename(t.source)
        for f in snapshot():
            b = os.path.basename(f)
            if b.startswith(name) and b.endswith(".archfs-index") and os.path.isfile(f):
                os.unlink(f)
    before = snapshot()
    try:
        t.mount()
        n = sum(len(fs) for _, _, fs in os.walk(t.root))
        if n != len(manifest):
            raise Failed(f"{n} files visible, expected {len(manifest)}")
        for p, s in random.Random(5).sample(manifest, min(20, len(manifest))):
            with open(os.path.join(t.root, p), "rb") as a, open(os.path.join(src, p), "rb") as b:
                if a.read() != b.read():
                    raise Failed(f"{p}: content differs from the source")
        if t.server_token and not t.pids:
            log(f"  {t.name}: server process not found (no RSS/CPU figures)")
    finally:
        t.unmount(force=False)
    if isinstance(t, Archfs) and t.has_index:
        new = snapshot() - before
        t.index_files = sorted(x for x in new if not x.endswith(".index.sqlite")
                               and os.path.basename(t.source) in os.path.basename(x)
                               or x.startswith(os.path.expanduser("~/.cache/archfs")))


# ---------------------------------------------------------------------------------------------
# The archfs binary
# ---------------------------------------------------------------------------------------------


def find_archfs(args):
    cands = [args.archfs] if args.archfs else [
        os.path.join(TARGET_DIR, "release", "archfs"),
        os.path.join(os.path.dirname(os.path.dirname(SCRIPT)), "target", "release", "archfs"),
        shutil.which("archfs") or ""]
    for c in cands:
        if c and os.access(c, os.X_OK):
            return os.path.abspath(c)
    if not args.archfs and os.path.isdir(WORKTREE):
        log(f"building archfs in {WORKTREE}")
        subprocess.run(["cargo", "build", "--release", "--target-dir", TARGET_DIR],
                       cwd=WORKTREE, check=True)
        return os.path.join(TARGET_DIR, "release", "archfs")
    raise SystemExit("archfs binary not found: pass --archfs PATH (or build: git -C REPO worktree "
                     f"add {WORKTREE} HEAD && cd {WORKTREE} && cargo build --release "
                     f"--target-dir {TARGET_DIR})")
