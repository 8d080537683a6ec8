"""The workloads (mount, stream, shuffled epochs, latency, metadata walks, torch) and the
Bench that runs each tool through them."""

import glob
import json
import os
import random
import select
import shlex
import signal
import subprocess
import sys
import time

from .constants import SCRIPT, VPY
from .corpus import DECODERS, write_list
from .stats import percentile
from .system import REG, Failed, Timeout, drop_caches, log, pgroup_members, sh
from .tools import ShmCopy

# ---------------------------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------------------------


def run_group(cmds, deadline, before_go=None, start_timeout=300):
    """Start commands (own process groups), wait for each to print 'ready', call before_go()
    (then the deadline is computed by calling deadline()), send 'go' to all, wait for all.
    Returns (wall seconds, [stdout json], [(utime+stime) of each])."""
    procs = []
    try:
        for c in cmds:
            p = subprocess.Popen(c, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, start_new_session=True)
            REG.pgids.add(p.pid)
            procs.append(p)
        t_start = time.time()
        for p in procs:
            while not select.select([p.stdout], [], [], 1.0)[0]:
                if time.time() - t_start > start_timeout:
                    raise Timeout("helper start")
            line = p.stdout.readline()
            if line.strip() != "ready":
                p.wait()
                raise Failed(f"helper did not start: {line!r} {p.stderr.read()[-300:]}")
        if before_go:
            before_go()
        if callable(deadline):
            deadline = deadline()
        t0 = time.perf_counter()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        pending = {p.pid: p for p in procs}
        rus = {}
        while pending:
            for pid in list(pending):
                wpid, status, ru = os.wait4(pid, os.WNOHANG)
                if wpid:
                    rus[pid] = (status, ru)
                    pending[pid].returncode = os.waitstatus_to_exitcode(status)
                    del pending[pid]
            if not pending:
                break
            if time.time() > deadline:
                raise Timeout("read")
            time.sleep(0.001)
        wall = time.perf_counter() - t0
        outs = []
        for p in procs:
            out = p.stdout.read()
            if p.returncode != 0:
                raise Failed(f"helper exited {p.returncode}: {p.stderr.read()[-300:]}")
            outs.append(json.loads(out.strip().splitlines()[-1]))
        cpu = [rus[p.pid][1].ru_utime + rus[p.pid][1].ru_stime for p in procs]
        return wall, outs, cpu
    finally:
        for p in procs:
            if p.returncode is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass
                try:
                    os.waitpid(p.pid, 0)
                except ChildProcessError:
                    pass
            REG.pgids.discard(p.pid)
            for s in (p.stdin, p.stdout, p.stderr):
                try:
                    s.close()
                except Exception:  # noqa: BLE001
                    pass


def read_pass(root, listfile, n_readers, deadline, expect_files, expect_bytes, latfile=None,
              before_go=None):
    cmds = [[sys.executable, SCRIPT, "_read", root, listfile, str(i), str(n_readers)]
            + ([latfile] if latfile else []) for i in range(n_readers)]
    wall, outs, cpu = run_group(cmds, deadline, before_go)
    files = sum(o["files"] for o in outs)
    nbytes = sum(o["bytes"] for o in outs)
    bad = [o["first_error"] for o in outs if o["errors"] or o["mismatched"]]
    if bad or files != expect_files or nbytes != expect_bytes:
        raise Failed(f"wrong data: {files} files, {nbytes} bytes "
                     f"(expected {expect_files}, {expect_bytes}); {bad[:1]}")
    return wall, sum(cpu)


class TorchServer:
    """One long-lived torch helper: torch is imported once (and stays mapped, so dropping the
    page cache does not evict it) instead of once per measurement."""

    def __init__(self, logfile):
        self.p = None
        self.logfile = logfile

    def start(self):
        if self.p and self.p.poll() is None:
            return
        self.log = open(self.logfile, "a")
        self.p = subprocess.Popen([VPY, SCRIPT, "_torch"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=self.log, text=True,
                                  start_new_session=True)
        REG.pgids.add(self.p.pid)
        line = self._line(time.time() + 600)
        if line is None or line.strip() != "ready":
            self.stop()
            raise Failed(f"torch helper did not start (see {self.logfile})")

    def _line(self, deadline):
        while not select.select([self.p.stdout], [], [], 0.5)[0]:
            if time.time() > deadline or self.p.poll() is not None:
                return None
        return self.p.stdout.readline()

    def stop(self):
        if self.p:
            group = pgroup_members(self.p.pid) | {self.p.pid}
            try:
                os.killpg(self.p.pid, signal.SIGKILL)
            except OSError:
                pass
            self.p.wait()
            REG.pgids.discard(self.p.pid)
            self.p = None
            # shared-memory segments of the killed server and DataLoader workers
            for pid in group:
                for f in glob.glob(f"/dev/shm/torch_{pid}_*"):
                    try:
                        os.unlink(f)
                    except OSError:
                        pass

    def call(self, req, before, cap):
        self.start()
        before()
        self.p.stdin.write(json.dumps(req) + "\n")
        self.p.stdin.flush()
        line = self._line(time.time() + cap)
        if not line:
            timed_out = self.p.poll() is None
            self.stop()   # kills the DataLoader workers too (same process group)
            if timed_out:
                raise Timeout("torch")
            raise Failed(f"torch helper died (see {self.logfile})")
        return json.loads(line)


class Bench:
    def __init__(self, args, targets, manifest, torch_ok, archives):
        self.args = args
        self.archives = archives     # name -> path, streamed cold for reference
        self.streams = {}
        self.targets = targets
        self.manifest = manifest
        self.total_bytes = sum(s for _, s in manifest)
        self.torch_ok = torch_ok
        self.res = {t.name: {} for t in targets}
        self.notes = []
        self.tmp = os.path.join(args.workdir, "tmp")
        os.makedirs(self.tmp, exist_ok=True)
        self.torch = TorchServer(os.path.join(self.tmp, "torch.log"))

    def rec(self, t, metric, value):
        self.res[t.name].setdefault(metric, []).append(value)

    def note(self, t, what, msg):
        line = f"{t.name}: {what}: {msg}"
        if line not in self.notes:
            self.notes.append(line)
        log("  " + line)

    def fresh(self, t, cold=True):
        """Drop caches and mount; returns mount seconds (None for directories)."""
        t.unmount()
        if cold:
            drop_caches()
        return t.mount()

    def cold_start(self, t, p):
        """For a cold pass, what run_group does once the helpers are ready: drop caches and
        mount. Mounting only then starts the clock as the mount goes live, so a server's
        background work (archfs --preload) gets no head start while the helpers start."""
        return (lambda: self.fresh(t)) if p == "cold" else None

    def guarded(self, t, what, metrics, fn):
        """Run fn(); on Timeout/Failed record a marker in every metric not yet recorded."""
        before = {m: len(self.res[t.name].get(m, [])) for m in metrics}
        t0 = time.time()
        try:
            fn()
            if self.args.verbose:
                log(f"  {what}: {time.time() - t0:.1f} s")
            return True
        except Timeout as e:
            marker = "timeout"
            self.note(t, what, f"over the {self.args.cap:g} s cap ({e})")
        except Failed as e:
            marker = "error"
            self.note(t, what, str(e))
        finally:
            try:
                t.unmount()
            except Exception as e:  # noqa: BLE001
                self.note(t, "unmount", str(e))
        for m in metrics:
            if len(self.res[t.name].get(m, [])) == before[m]:
                self.rec(t, m, marker)
        return False

    # -- workloads ------------------------------------------------------------------------

    def w_mount(self, t, run):
        if t.kind == "dir" and not isinstance(t, ShmCopy):
            return
        if isinstance(t, ShmCopy):
            def f():
                drop_caches()
                self.rec(t, "mount", t.extract())
            self.guarded(t, "untar to /dev/shm", ["mount"], f)
            return
        if t.has_index:
            def f():
                t.remove_index()
                self.rec(t, "mount", self.fresh(t))
                t.unmount()
                if t.index_present():
                    self.rec(t, "mount_idx", self.fresh(t))
                else:
                    self.rec(t, "mount_idx", "no saved index")
                    self.rec(t, "mount_2nd", self.fresh(t))
            self.guarded(t, "mount", ["mount", "mount_idx"], f)
        else:
            self.guarded(t, "mount", ["mount"], lambda: self.rec(t, "mount", self.fresh(t)))

    def w_epoch(self, t, run, readers):
        ms = [f"epoch_cold_{readers}", f"epoch_warm_{readers}"]
        if t.read_timed_out:
            for m in ms:
                self.rec(t, m, "timeout")
            return
        rnd = random.Random(self.args.seed * 7919 + run * 31 + readers)
        lists = []
        for p in ("cold", "warm"):
            order = list(self.manifest)
            rnd.shuffle(order)
            lf = os.path.join(self.tmp, f"order-{p}.tsv")
            write_list(lf, order)
            lists.append(lf)

        def f():
            for p, lf in zip(("cold", "warm"), lists):
                deadline = time.time() + self.args.cap
                go = self.cold_start(t, p)
                if go and self.args.list_first:
                    def go(t=t):
                        # A training job lists the tree (ImageFolder's index) before its
                        # first epoch: untimed, as the scale bench times it on its own.
                        self.fresh(t)
                        sh(["find", t.root, "-type", "f"], timeout=self.args.cap)
                wall, cpu = read_pass(t.root, lf, readers, deadline, len(self.manifest),
                                      self.total_bytes, before_go=go)
                self.rec(t, f"epoch_{p}_{readers}", wall)
                self.rec(t, f"readers_cpu_{p}_{readers}", cpu)
            cpu, hwm = t.stats()
            if cpu is not None:
                self.rec(t, f"srv_cpu_{readers}", cpu)
                self.rec(t, "srv_hwm", hwm)
        if not self.guarded(t, f"epoch {readers} readers", ms, f):
            if self.res[t.name][ms[0]][-1] == "timeout":
                t.read_timed_out = True

    def w_latency(self, t, run):
        ms = ["lat_cold_p50", "lat_cold_p99", "lat_warm_p50", "lat_warm_p99"]
        rnd = random.Random(self.args.seed * 104729 + run)
        sample = rnd.sample(self.manifest, min(self.args.lat_files, len(self.manifest)))
        lf = os.path.join(self.tmp, "lat.tsv")
        write_list(lf, sample)
        latf = os.path.join(self.tmp, "lat.out")

        def f():
            for p in ("cold", "warm"):
                deadline = time.time() + self.args.cap
                read_pass(t.root, lf, 1, deadline, len(sample), sum(s for _, s in sample), latf,
                          before_go=self.cold_start(t, p))
                with open(latf) as fh:
                    lats = [float(x) for x in fh.read().split()]
                self.rec(t, f"lat_{p}_p50", percentile(lats, 0.5) * 1e3)
                self.rec(t, f"lat_{p}_p99", percentile(lats, 0.99) * 1e3)
            cpu, hwm = t.stats()
            if hwm is not None:
                self.rec(t, "srv_hwm", hwm)
        self.guarded(t, "latency", ms, f)

    def w_meta(self, t, run):
        n = len(self.manifest)
        rnd = random.Random(self.args.seed * 15485863 + run)
        order = list(self.manifest)
        rnd.shuffle(order)
        lf = os.path.join(self.tmp, "stat.tsv")
        write_list(lf, order)

        def find():
            self.fresh(t)
            for p in ("cold", "warm"):
                deadline = time.time() + self.args.cap
                t0 = time.perf_counter()
                try:
                    r = sh(f"find {shlex.quote(t.root)} -type f | wc -l",
                           timeout=max(1, deadline - time.time()))
                except subprocess.TimeoutExpired:
                    raise Timeout("find")
                dt = time.perf_counter() - t0
                if r.stdout.strip() != str(n):
                    raise Failed(f"find counted {r.stdout.strip()} files, expected {n}")
                self.rec(t, f"find_{p}", dt)

        def stat():
            for p in ("cold", "warm"):
                deadline = time.time() + self.args.cap
                _, outs, _ = run_group([[sys.executable, SCRIPT, "_stat", t.root, lf]], deadline,
                                       self.cold_start(t, p))
                if outs[0]["errors"]:
                    raise Failed(f"stat: {outs[0]['errors']} errors, {outs[0]['first_error']}")
                self.rec(t, f"stat_{p}", outs[0]["elapsed"])
        self.guarded(t, "find", ["find_cold", "find_warm"], find)
        self.guarded(t, "stat", ["stat_cold", "stat_warm"], stat)

    def torch_call(self, t, workers, epochs):
        """Torch is already imported; drop caches and mount, then time ImageFolder/DataLoader."""
        o = self.torch.call({"root": t.root, "workers": workers, "epochs": epochs},
                            lambda: self.fresh(t), self.args.cap * (1 + epochs))
        if o.get("error"):
            raise Failed(o["error"])
        if o["images"] != len(self.manifest):
            raise Failed(f"ImageFolder found {o['images']} images, expected {len(self.manifest)}")
        return o

    def w_torch(self, t, run):
        # torch is imported before the caches are dropped and the mount is made
        if not self.args.jpeg or not self.args.torch_workers:
            def f():
                o = self.torch_call(t, 0, 0)
                self.rec(t, "imagefolder", o["index_s"])
            self.guarded(t, "ImageFolder", ["imagefolder"], f)
            return
        for i, w in enumerate(self.args.torch_workers):
            ms = [f"dl_cold_{w}", f"dl_warm_{w}"] + (["imagefolder"] if i == 0 else [])
            if t.read_timed_out:
                for m in ms:
                    self.rec(t, m, "timeout")
                continue

            def f(w=w, first=(i == 0)):
                o = self.torch_call(t, w, 2)
                if first:
                    self.rec(t, "imagefolder", o["index_s"])
                self.rec(t, f"dl_cold_{w}", o["epochs"][0])
                self.rec(t, f"dl_warm_{w}", o["epochs"][1])
            if not self.guarded(t, f"DataLoader num_workers={w}", ms, f):
                if self.res[t.name][ms[0]][-1] == "timeout":
                    t.read_timed_out = True

    def w_stream(self, archives, run=0):
        """The floor of a cold epoch: streaming each archive file once from a cold cache;
        for a compressed tar, also its single-thread decoder (the first index's floor).
        The order turns with each run: data.tar, streamed first in every run, took 1.95,
        1.91 and 0.69 s in one bench, the images of the same size after it 0.36-0.56 s."""
        items = list(archives.items())
        k = run % max(1, len(items))
        for name, path in items[k:] + items[:k]:
            drop_caches()
            t0 = time.perf_counter()
            sh(f"cat {shlex.quote(path)} > /dev/null", check=True)
            self.streams.setdefault(name, []).append(time.perf_counter() - t0)
            if name in DECODERS:
                drop_caches()
                t0 = time.perf_counter()
                sh(f"{DECODERS[name]} {shlex.quote(path)} > /dev/null", check=True)
                self.streams.setdefault(f"{name} decode", []).append(time.perf_counter() - t0)

    def run(self):
        wl = self.args.workloads
        for run in range(self.args.runs):
            log(f"=== run {run + 1}/{self.args.runs}")
            if "stream" in wl:
                self.w_stream(self.archives, run)
            for t in self.targets:
                if t.unsupported:
                    continue
                log(f"{t.name}")
                if "mount" in wl:
                    self.w_mount(t, run)
                if "epoch" in wl:
                    for r in self.args.readers:
                        self.w_epoch(t, run, r)
                if "latency" in wl:
                    self.w_latency(t, run)
                if "meta" in wl:
                    self.w_meta(t, run)
                if "torch" in wl and self.torch_ok:
                    self.w_torch(t, run)
                t.unmount()
        self.torch.stop()
