"""Machine helpers: the log, running commands, dropping caches, holding a VM's memory, /proc,
mounts, and the registry that undoes everything a run mounts or starts."""

import atexit
import os
import shutil
import signal
import subprocess
import sys
import time

from .constants import HELPER_MODES, MIB

# ---------------------------------------------------------------------------------------------
# Small utilities
# ---------------------------------------------------------------------------------------------

T_START = time.time()


def log(msg):
    print(f"[{time.time() - T_START:7.1f}s] {msg}", file=sys.stderr, flush=True)


def sh(cmd, timeout=None, check=False, **kw):
    """Run a command (list or shell string), return CompletedProcess with text output."""
    return subprocess.run(cmd, shell=isinstance(cmd, str), capture_output=True, text=True,
                          timeout=timeout, check=check, **kw)


def sh_out(cmd, timeout=60):
    try:
        r = sh(cmd, timeout=timeout)
        return (r.stdout + r.stderr).strip()
    except Exception as e:  # noqa: BLE001
        return f"({e})"


def drop_caches():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


REPORTING = "/sys/module/page_reporting/parameters/page_reporting_order"
# What hold_guest_memory found, for the report.
MEMORY_NOTE = []


DAMON = "/sys/kernel/mm/damon/admin/kdamonds"


def hold_page_cache():
    """Stops the VM's DAMON schemes for the run, restored at exit. The bench's VM runs one
    that pages out file pages idle for about a minute: during a cold pass of 1.28 M small
    files that takes minutes, the pages read first are gone before the warm pass, which then
    reads the disk (the plain directory's warm 2-reader epoch took 11.2 s where 4 readers
    took 4.64 s,
    docs/history/2026-11-26-unions-locks-object-storage-in-process.md#in-process-reader-3-runs-with-damons-page-out-stopped-2026-11-26-later).
    HPC nodes run no such scheme."""
    try:
        names = sorted(n for n in os.listdir(DAMON) if n.isdigit())
    except OSError:
        return
    stopped = []
    for n in names:
        state = os.path.join(DAMON, n, "state")
        try:
            with open(state) as f:
                if f.read().strip() != "on":
                    continue
            with open(state, "w") as f:
                f.write("off\n")
            stopped.append(state)
        except OSError as e:
            log(f"could not stop DAMON's kdamond {n} ({e}): warm figures may include "
                "pages it paged out")
    def restore():
        for state in stopped:
            try:
                with open(state, "w") as f:
                    f.write("on\n")
            except OSError:
                pass
    atexit.register(restore)
    if stopped:
        MEMORY_NOTE.append(f"DAMON's page-out stopped for the run ({len(stopped)} kdamond)")
        log(MEMORY_NOTE[-1])


def hold_guest_memory():
    """Stops a VM's free page reporting for the run, restored at exit. With it, memory the
    guest frees (drop_caches, an unmount) is handed back to the host within seconds, and
    the next cold read pays the host for every page cache page it fills: on the bench's VM
    `cat` of a cold 1.1 GB file took 0.31-0.33 s right after drop_caches and 1.79-1.85 s
    six seconds later (sys time 1.8 s), 0.33-0.34 s with reporting off. Cold figures then
    depend on timing, not on the tools. Memory already handed back is touched once here.
    The VM's page-out scheme is stopped too (hold_page_cache)."""
    hold_page_cache()
    try:
        with open(REPORTING) as f:
            was = f.read().strip()
        with open(REPORTING, "w") as f:
            f.write("11\n")  # above the largest free block's order: nothing is reported
    except OSError:
        return
    def restore():
        with open(REPORTING, "w") as f:
            f.write(was + "\n")
    atexit.register(restore)
    avail = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    t0 = time.perf_counter()
    # All a run may fill: 8 GB (19 s) left the first tool of the 10,000-shard run to pay
    # the host for its pages (page cache, pushed files and kernel inodes of 2 M files, over
    # 10 GB): its cold epoch 36.9 s against the next tool's 26.1 s, 25 s each by hand.
    # At most 32 GB (about 75 s): a larger VM would spend minutes on it.
    n = int(min(avail * 0.85, 32e9)) // MIB * MIB
    buf = bytearray(n)
    buf[::4096] = bytes(len(range(0, n, 4096)))
    del buf
    MEMORY_NOTE.append(f"free page reporting to the host turned off for the run (order {was} "
                       f"-> 11), {n / 1e9:.0f} GB of free memory touched once "
                       f"({time.perf_counter() - t0:.1f} s)")
    log(MEMORY_NOTE[-1])


def mounted_paths():
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4]
            out.append(mp.encode().decode("unicode_escape"))
    return out


def is_mounted(path):
    return os.path.realpath(path) in mounted_paths()


def proc_cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return None


def proc_ppid(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def find_server_pids(token, mnt, exclude=("__watchdog",) + HELPER_MODES):
    """PIDs whose command line has TOKEN in some argument and MNT as an argument (not our
    own reader helpers, which are running when a cold pass mounts and name MNT too)."""
    pids = []
    me = os.getpid()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        cl = proc_cmdline(int(d))
        if not cl:
            continue
        if any(token in a for a in cl) and mnt in cl and not any(x in cl for x in exclude):
            pids.append(int(d))
    # keep the top of the matched tree (children are counted through the parent below)
    top = [p for p in pids if proc_ppid(p) not in pids]
    return sorted(top) or sorted(pids)


CLK = os.sysconf("SC_CLK_TCK")


def proc_stats(pid):
    """(cpu seconds utime+stime (+ reaped children), VmHWM KiB) of a live process, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        cpu = sum(int(x) for x in fields[11:15]) / CLK
        hwm = 0
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    hwm = int(line.split()[1])
        return cpu, hwm
    except (OSError, IndexError, ValueError):
        return None


def pgroup_members(pgid):
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[2]) == pgid:
                        out.add(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return out


def pid_alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Timeout(Exception):
    pass


class Failed(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# Cleanup registry: everything this run mounts or starts, undone on any exit path
# ---------------------------------------------------------------------------------------------


class Registry:
    def __init__(self):
        self.targets = []      # targets that may hold a mount
        self.pgids = set()     # reader/helper process groups
        self.paths = []        # directories to remove at exit (shm copies)
        self.images = []       # images that may be attached to loop devices
        self.done = False

    def cleanup(self):
        if self.done:
            return
        self.done = True
        for pg in list(self.pgids):
            try:
                os.killpg(pg, signal.SIGKILL)
            except OSError:
                pass
        for t in self.targets:
            try:
                t.unmount(force=True)
            except Exception as e:  # noqa: BLE001
                log(f"cleanup: {t.name}: {e}")
        for img in self.images:
            detach_loops(img)
        for p in self.paths:
            shutil.rmtree(p, ignore_errors=True)


REG = Registry()


def detach_loops(img):
    r = sh(["losetup", "-j", img])
    for line in r.stdout.splitlines():
        dev = line.split(":", 1)[0]
        if dev.startswith("/dev/loop"):
            sh(["losetup", "-d", dev])


def force_unmount(mnt):
    for cmd in (["fusermount3", "-u", "-z", mnt], ["umount", "-l", mnt]):
        if not is_mounted(mnt):
            return
        try:
            sh(cmd, timeout=30)
        except subprocess.TimeoutExpired:
            pass
