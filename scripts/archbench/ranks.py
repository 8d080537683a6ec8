"""`scripts/bench --ranks`: a job's R ranks x W DataLoader workers on one node, all reading
one archive (issue 51), as torchrun starts them.

    sudo scripts/wheel && sudo scripts/bench --ranks       # 5,000 files, R = 1, 2, 4, 8
    sudo scripts/bench --ranks --files 2000 --ranks-counts 1,4 --ranks-workers 4

Why: a job is not one process. Each of R ranks runs the README's script, `archfs.mount(URL)`
(no `shared=True`: Python's default) or `archfs.open_archive(URL)` in process, and forks W
DataLoader workers. The node must hold one copy and fetch the archive from storage once,
whatever R is.

Each rank is a process of the bench venv's Python with the wheel from scripts/wheel
(`bench _rank`); ranks start together (after `go`, as torchrun's), and each epoch every
rank reads its share of one shuffled order (rank::R, as DistributedSampler), split among W
forked workers (worker::W, each reading whole files by path). Four epochs, reshuffled
each; an epoch's time is the last rank's; reported: the first (from nothing) and the
median of the other three. `mount`: the rank mounts (timed within the first epoch),
its workers read files under the mount; `shared`: the same with `shared=True` (one mount
for the ranks of the node). `inproc`: the rank opens the archive (as
archfs.torch.ImageFolder indexes it), each worker reads through the inherited handle.

Sources, each from nothing (the image's pages evicted, no copy anywhere):
- `local`: the zstd SquashFS image on this machine's disk (standing in for the shared
  filesystem); bytes from storage are the disk's reads (/sys/dev/block/.../stat);
- `s3`: the image as an object in SeaweedFS behind the emulated link of `--remote`
  (`--ranks-link`, default 10ms/1gbit); bytes from storage are the response bytes the
  relay counted;
- `copy first`: what careful users do today: the job copies the object to the node's disk
  once (`aws s3 cp`, timed and counted in the first epoch), then every rank reads the
  copy as `local`.

Every rank, worker, mount and copy runs in one memory cgroup made for the scenario (v1 or
v2, no limit): its peak usage is the node's memory for the job (the kernel's own peak),
and a sampler (20 Hz) gives what it held at its sampled peak: shared memory (a node copy
in a memfd), the page cache, anonymous memory (the readers' and the servers' own). After
the last epoch every process must be gone and the cgroup empty (the copy with them).
"""

import json
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time

from .constants import SCRIPT, VPY
from .corpus import write_list, zstd_image
from .inproc import install_wheel
from .remote import BUCKET, delta, ensure_deps, parse_links, remove, start_server
from .report import save
from .stats import median
from .system import REG, Failed, Timeout, log, sh

SOURCES = ("local", "s3", "copy first")
MODES = ("mount", "shared", "inproc")
EPOCHS = 4

# ---------------------------------------------------------------------------------------------
# The rank: one process of the job (run as `bench _rank ...` by the bench venv's Python)
# ---------------------------------------------------------------------------------------------


def read_share(get, files):
    """Reads every (path, size) of files whole through get(path) -> bytes."""
    n = total = errors = 0
    first = None
    for p, size in files:
        try:
            k = len(get(p))
        except OSError as e:
            errors += 1
            first = first or f"{p}: {e}"
            continue
        n += 1
        total += k
        if k != size:
            errors += 1
            first = first or f"{p}: read {k} bytes, expected {size}"
    return {"files": n, "bytes": total, "errors": errors, "first_error": first}


def in_workers(workers, share, get):
    """share[w::workers] read by `workers` forked processes (DataLoader's fork workers, new
    each epoch); their results summed."""
    kids = []
    for w in range(workers):
        r, wr = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                res = read_share(get, share[w::workers])
            except BaseException as e:  # noqa: BLE001 - reported, not raised, in a child
                res = {"files": 0, "bytes": 0, "errors": 1, "first_error": repr(e)}
            os.write(wr, json.dumps(res).encode())
            os._exit(0)
        os.close(wr)
        kids.append((pid, r))
    out = {"files": 0, "bytes": 0, "errors": 0, "first_error": None}
    for pid, r in kids:
        with os.fdopen(r, "rb") as f:
            data = f.read()
        _, status = os.waitpid(pid, 0)
        res = json.loads(data) if data else {
            "files": 0, "bytes": 0, "errors": 1,
            "first_error": f"worker ended with status {status} and no result"}
        for k in ("files", "bytes", "errors"):
            out[k] += res[k]
        out["first_error"] = out["first_error"] or res["first_error"]
    return out


def helper_rank(argv):
    """_rank MODE SOURCE LIST RANK RANKS WORKERS EPOCHS SEED: one rank; prints 'ready',
    then per epoch waits for 'go' and prints its result as JSON."""
    import archfs
    mode, source, listfile = argv[0], argv[1], argv[2]
    rank, ranks, workers, epochs, seed = (int(x) for x in argv[3:8])
    with open(listfile) as f:
        entries = [(p, int(s)) for p, s in (line.rstrip("\n").split("\t") for line in f)]
    print("ready", flush=True)
    handle = None
    for epoch in range(epochs):
        if sys.stdin.readline().strip() != "go":
            return
        t0 = time.perf_counter()
        opened = None
        if handle is None:
            if mode in ("mount", "shared"):
                handle = archfs.mount(source, shared=mode == "shared")
                root = str(handle.path)

                def get(p):
                    with open(os.path.join(root, p), "rb") as f:
                        return f.read()
            else:
                handle = archfs.open_archive(source)
                get = handle.read
            opened = time.perf_counter() - t0
        order = list(entries)
        random.Random(seed * 1000 + epoch).shuffle(order)
        res = in_workers(workers, order[rank::ranks], get)
        res.update(epoch=epoch, elapsed=time.perf_counter() - t0, open_s=opened)
        print(json.dumps(res), flush=True)
    if mode in ("mount", "shared"):
        handle.unmount()

# ---------------------------------------------------------------------------------------------
# The node: a memory cgroup for the job's processes, and what it held at its peak
# ---------------------------------------------------------------------------------------------


class JobCgroup:
    """A memory cgroup without a limit, under the bench's own (v1 or v2). Processes started
    with `preexec` run in it from their first instruction; a thread samples it."""

    def __init__(self, name):
        own = open("/proc/self/cgroup").read().splitlines()
        v1 = [line.split(":memory:", 1)[1] for line in own if ":memory:" in line]
        if v1:
            self.path = os.path.join("/sys/fs/cgroup/memory", v1[0].lstrip("/"), name)
            self.v2 = False
        else:
            rel = next(line[3:] for line in own if line.startswith("0::"))
            parent = os.path.join("/sys/fs/cgroup", rel.lstrip("/"))
            with open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
                f.write("+memory")
            self.path = os.path.join(parent, name)
            self.v2 = True
        self.remove()
        os.mkdir(self.path)
        self.peak_sample = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()

    def read(self, name):
        with open(os.path.join(self.path, name)) as f:
            return f.read()

    def preexec(self):
        with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    def procs(self):
        try:
            return [int(p) for p in self.read("cgroup.procs").split()]
        except OSError:
            return []

    def usage(self):
        return int(self.read("memory.current" if self.v2 else "memory.usage_in_bytes"))

    def peak(self):
        """The kernel's peak of the cgroup's usage (v2 before 5.19 has none: the sampled)."""
        try:
            return int(self.read("memory.peak" if self.v2 else "memory.max_usage_in_bytes"))
        except OSError:
            return self.peak_sample.get("usage", 0)

    def breakdown(self):
        st = dict(line.split() for line in self.read("memory.stat").splitlines())
        if self.v2:
            shmem, file, anon = int(st["shmem"]), int(st["file"]), int(st["anon"])
        else:
            shmem, file, anon = (int(st["total_shmem"]), int(st["total_cache"]),
                                 int(st["total_rss"]))
        return {"shmem": shmem, "page_cache": file - shmem, "anon": anon}

    def sample(self):
        while not self.stop.wait(0.05):
            try:
                u = self.usage()
                if u > self.peak_sample.get("usage", -1):
                    self.peak_sample = dict(self.breakdown(), usage=u)
            except (OSError, KeyError, ValueError):
                pass

    def oom_kills(self):
        text = self.read("memory.events" if self.v2 else "memory.oom_control")
        return sum(int(line.split()[1]) for line in text.splitlines()
                   if line.startswith("oom_kill "))

    def kill_all(self):
        for pid in self.procs():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def remove(self):
        """SIGKILL to whatever is left, then the cgroup itself."""
        if hasattr(self, "stop"):
            self.stop.set()
        if not os.path.isdir(self.path):
            return
        end = time.time() + 30
        while self.procs() and time.time() < end:
            self.kill_all()
            time.sleep(0.05)
        while time.time() < end:
            try:
                os.rmdir(self.path)
                return
            except OSError:
                time.sleep(0.05)
        log(f"could not remove {self.path}")

    name = "job cgroup"

    def unmount(self, force=False):
        """What REG calls at exit."""
        self.remove()


def evict(path):
    """The file's pages out of the page cache: a cold archive, while Python, the wheel and
    the S3 server's files stay cached (drop_caches made every rank read its interpreter
    from the disk again, counted as the archive's)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_read_bytes(path):
    """Bytes read so far from the block device holding path (its partition's counters)."""
    st = os.stat(path)
    with open(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat") as f:
        return int(f.read().split()[2]) * 512

# ---------------------------------------------------------------------------------------------
# A scenario: R ranks over one source, two epochs
# ---------------------------------------------------------------------------------------------


class Job:
    """The R rank processes of one scenario, started in the cgroup, driven epoch by epoch."""

    def __init__(self, cmds, cgroup, env, cap, logs):
        self.cap = cap
        self.procs = []
        self.logs = {}
        for i, c in enumerate(cmds):
            with open(f"{logs}-rank{i}.log", "w") as err:
                p = subprocess.Popen(c, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=err, text=True, env=env,
                                     preexec_fn=cgroup.preexec, start_new_session=True)
            self.logs[p.pid] = err.name
            REG.pgids.add(p.pid)
            self.procs.append(p)
        for p in self.procs:
            line = self.line(p, time.time() + 120)
            if line.strip() != "ready":
                raise Failed(f"rank did not start: {line!r} {self.stderr(p)}")

    def stderr(self, p):
        with open(self.logs[p.pid], errors="replace") as f:
            return f.read()[-600:]

    def line(self, p, deadline):
        while not select.select([p.stdout], [], [], 0.5)[0]:
            if time.time() > deadline:
                raise Timeout("rank")
            if p.poll() is not None:
                break
        return p.stdout.readline()

    def epoch(self):
        """'go' to every rank; (seconds until the last rank's result, the results)."""
        t0 = time.perf_counter()
        for p in self.procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        deadline = time.time() + self.cap
        outs = []
        for p in self.procs:
            line = self.line(p, deadline)
            if not line.strip():
                raise Failed(f"rank ended without a result: {self.stderr(p)}")
            outs.append(json.loads(line))
        return time.perf_counter() - t0, outs

    def finish(self):
        for p in self.procs:
            try:
                p.stdin.close()
            except OSError:
                pass
        end = time.time() + 60
        for p in self.procs:
            try:
                p.wait(max(1, end - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            REG.pgids.discard(p.pid)


class RanksBench:
    def __init__(self, args, net, server, manifest, image, url, tmp):
        self.args, self.net, self.server = args, net, server
        self.manifest, self.image, self.url, self.tmp = manifest, image, url, tmp
        self.size = os.path.getsize(image)
        self.listfile = os.path.join(tmp, "files.tsv")
        write_list(self.listfile, manifest)
        self.expect = (len(manifest), sum(s for _, s in manifest))
        self.res = []
        self.notes = []
        self.serial = 0

    def note(self, msg):
        if msg not in self.notes:
            self.notes.append(msg)
        log("  " + msg)

    def copy_first(self, cgroup, env):
        """`aws s3 cp` of the object to this node's disk, in the job's cgroup."""
        dest = os.path.join(self.tmp, "copy", os.path.basename(self.image))
        remove(dest)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        t0 = time.perf_counter()
        r = subprocess.run([os.path.join(os.path.dirname(VPY), "aws"), "s3", "cp",
                            "--only-show-errors", self.url, dest], env=env,
                           capture_output=True, text=True, timeout=self.args.cap,
                           preexec_fn=cgroup.preexec)
        if r.returncode != 0:
            raise Failed(f"aws s3 cp: {r.stderr.strip()[-300:]}")
        return dest, time.perf_counter() - t0

    def scenario(self, source, mode, ranks):
        a = self.args
        self.serial += 1
        # Every scenario is a job of its own: its ranks share what a job's ranks share.
        env = dict(os.environ, SLURM_JOB_ID=f"archfs-bench-{os.getpid()}-{self.serial}")
        env.setdefault("ARCHFS_LOG", "info")
        row = {"source": source, "mode": mode, "ranks": ranks, "workers": a.ranks_workers}
        evict(self.image)
        cg = JobCgroup(f"archfs-bench-ranks-{os.getpid()}")
        REG.targets.insert(0, cg)
        disk0, net0 = disk_read_bytes(self.image), self.net.counters.snap()
        job = None
        try:
            target, copy_s = (self.url if source == "s3" else self.image), 0.0
            if source == "copy first":
                target, copy_s = self.copy_first(cg, env)
                row["copy_s"] = copy_s
            cmds = [[VPY, SCRIPT, "_rank", mode, target, self.listfile, str(r), str(ranks),
                     str(a.ranks_workers), str(EPOCHS), str(a.seed)] for r in range(ranks)]
            logs = os.path.join(self.tmp, f"{self.serial:02d}-{source.replace(' ', '-')}-"
                                f"{mode}-R{ranks}")
            job = Job(cmds, cg, env, a.cap, logs)
            for e in range(EPOCHS):
                at = self.net.counters.snap()
                wall, outs = job.epoch()
                row.setdefault("epoch_gets", []).append(
                    delta(at, self.net.counters.snap())["gets"])
                row.setdefault("epochs_s", []).append(wall)
                files = sum(o["files"] for o in outs)
                nbytes = sum(o["bytes"] for o in outs)
                bad = [o["first_error"] for o in outs if o["errors"]]
                if bad or (files, nbytes) != self.expect:
                    raise Failed(f"epoch {e + 1}: {files} files, {nbytes} bytes (expected "
                                 f"{self.expect}); {bad[:1]}")
                if e == 0:
                    row["open_s"] = max(o["open_s"] for o in outs)
            job.finish()
            row["first_s"] = row["epochs_s"][0] + copy_s
            row["later_s"] = median(row["epochs_s"][1:])
            # The ranks are gone: so must be their mounts, workers and the node's copy.
            end = time.time() + 60
            while cg.procs() and time.time() < end:
                time.sleep(0.1)
            row["left"] = len(cg.procs())
            row["shmem_after"] = cg.breakdown()["shmem"]
        except (Failed, Timeout) as e:
            row["error"] = str(e)
            self.note(f"{source} {mode} R={ranks}: {e}")
        finally:
            if job:
                for p in job.procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
                    REG.pgids.discard(p.pid)
            seen = delta(net0, self.net.counters.snap())
            row["net_mb"] = seen["mb"]
            row["gets"] = seen["gets"]
            row["disk_mb"] = (disk_read_bytes(self.image) - disk0) / 1e6
            row["peak_mib"] = cg.peak() / 2**20
            row["at_peak"] = {k: v / 2**20 for k, v in cg.peak_sample.items()}
            row["oom_kills"] = cg.oom_kills()
            cg.remove()
            REG.targets.remove(cg)
        # What came from the storage the source stands for: the link for s3 and copy
        # first, the disk for a local archive.
        row["storage_mb"] = row["disk_mb"] if source == "local" else row["net_mb"]
        row["storage_x"] = row["storage_mb"] / (self.size / 1e6)
        self.res.append(row)
        log(f"  {source} {mode} R={ranks}: " + ", ".join(
            f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
            if k not in ("source", "mode", "ranks", "at_peak")))

    def run(self):
        for source in self.args.ranks_sources:
            for mode in self.args.ranks_modes:
                for ranks in self.args.ranks_counts:
                    self.scenario(source, mode, ranks)

# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def fmt(v, spec=".2f"):
    return "—" if v is None else format(v, spec)


def report(b, args, header):
    size_mib = b.size / 2**20
    out = [header, ""]
    out.append("| source | mode | R | first epoch s | vs R=1 | later epochs s | vs R=1 | "
               "from storage (x archive) | peak MiB | at peak: shmem / page cache / anon MiB"
               " | OOM kills |")
    out.append("|" + "---|" * 11)
    base = {}
    for r in b.res:
        key = (r["source"], r["mode"])
        if r["ranks"] == min(args.ranks_counts) and "error" not in r:
            base[key] = r
    for r in b.res:
        one = base.get((r["source"], r["mode"]))
        if "error" in r:
            out.append(f"| {r['source']} | {r['mode']} | {r['ranks']} | error: {r['error']} "
                       "| | | | | | | |")
            continue

        def vs(m):
            return fmt(r[m] / one[m]) + "x" if one and one.get(m) else "—"
        p = r["at_peak"]
        out.append(
            f"| {r['source']} | {r['mode']} | {r['ranks']} | {fmt(r['first_s'])} | "
            f"{vs('first_s')} | {fmt(r['later_s'])} | {vs('later_s')} | "
            f"{r['storage_mb']:.0f} MB ({r['storage_x']:.3f}x) | {r['peak_mib']:.0f} | "
            f"{p.get('shmem', 0):.0f} / {p.get('page_cache', 0):.0f} / {p.get('anon', 0):.0f} "
            f"| {r['oom_kills']} |")
    out += ["", f"The archive: {b.size / 1e6:.0f} MB ({size_mib:.0f} MiB)."]
    # The targets of issue 51.
    ok = [r for r in b.res if "error" not in r]
    s3 = [r for r in ok if r["source"] == "s3"]
    if s3:
        xs = [r["storage_x"] for r in s3]
        out.append(f"- Bytes from storage, s3, any R: {min(xs):.3f}-{max(xs):.3f}x the "
                   "archive (target 1.0-1.1x).")
    local = [r for r in ok if r["source"] == "local"]
    if local:
        xs = [r["storage_x"] for r in local]
        out.append(f"- Bytes from the disk, local, any R: {min(xs):.3f}-{max(xs):.3f}x.")
    for r in ok:
        if r["left"] or r["shmem_after"] > 1 << 20:
            out.append(f"- {r['source']} {r['mode']} R={r['ranks']}: {r['left']} processes and "
                       f"{r['shmem_after'] / 2**20:.0f} MiB of shared memory left after the job")
    by = {(r["source"], r["mode"], r["ranks"]): r for r in ok}
    for ranks in args.ranks_counts:
        s, loc = by.get(("s3", "inproc", ranks)), by.get(("local", "inproc", ranks))
        if s and loc:
            out.append(f"- In process, R={ranks}: later epochs from the node's copy "
                       f"{s['later_s']:.2f} s against {loc['later_s']:.2f} s from a local "
                       f"file: {s['later_s'] / loc['later_s']:.2f}x (target within 1.1x).")
    for mode in args.ranks_modes:
        for ranks in args.ranks_counts:
            s, c = by.get(("s3", mode, ranks)), by.get(("copy first", mode, ranks))
            if s and c:
                out.append(f"- {mode}, R={ranks}: first epoch from s3 {s['first_s']:.2f} s "
                           f"against copy first {c['first_s']:.2f} s (copy "
                           f"{c['copy_s']:.2f} s): {s['first_s'] / c['first_s']:.2f}x.")
    if b.notes:
        out += ["", "Notes:"] + [f"- {n}" for n in b.notes]
    return "\n".join(out)


def header(args, manifest, size, link):
    return "\n".join([
        f"# archfs: R ranks x {args.ranks_workers} workers on one node (`scripts/bench "
        f"{' '.join(args.argv)}`)", "",
        f"{len(manifest)} files ({sum(s for _, s in manifest) / 1e6:.0f} MB) in a zstd "
        f"SquashFS image of {size / 1e6:.0f} MB; link for s3 and copy first: {link}; "
        f"{EPOCHS} epochs; {os.cpu_count()} cores; {time.strftime('%Y-%m-%d %H:%M')}."])

# ---------------------------------------------------------------------------------------------
# Flags and the run
# ---------------------------------------------------------------------------------------------


def add_args(ap):
    g = ap.add_argument_group("ranks mode (--ranks; issue 51)")
    g.add_argument("--ranks", action="store_true", help="R ranks x W workers on one node over "
                   "one archive, local, s3 and copy first (default 5,000 files)")
    g.add_argument("--ranks-counts", default="1,2,4,8", help="rank counts R (default 1,2,4,8)")
    g.add_argument("--ranks-workers", type=int, default=2, help="DataLoader workers a rank")
    g.add_argument("--ranks-sources", default=",".join(SOURCES))
    g.add_argument("--ranks-modes", default=",".join(MODES))
    g.add_argument("--ranks-link", default="10ms/1gbit", help="the emulated link (--remote's)")


def main(args):
    args.ranks_counts = [int(x) for x in args.ranks_counts.split(",") if x.strip()]
    args.ranks_sources = [s.strip() for s in args.ranks_sources.split(",") if s.strip()]
    args.ranks_modes = [m.strip() for m in args.ranks_modes.split(",") if m.strip()]
    bad = [s for s in args.ranks_sources if s not in SOURCES] + \
        [m for m in args.ranks_modes if m not in MODES]
    if bad:
        raise SystemExit(f"--ranks: unknown {bad}")
    ensure_deps(args)
    install_wheel(args, need=())
    image, manifest = zstd_image(args)
    tmp = os.path.join(args.workdir, "ranks")
    remove(tmp)
    os.makedirs(tmp)
    net, server, uploaded = start_server(tmp, {"zstd": image})
    obj = uploaded["zstd"]
    (label, rtt, rate), = parse_links(args.ranks_link)
    net.shape(rtt, rate)
    b = RanksBench(args, net, server, manifest, image, f"s3://{BUCKET}/{obj}", tmp)
    b.run()
    notes = net.notes()
    md = report(b, args, header(args, manifest, b.size, label))
    if notes:
        md += "\n" + "\n".join(f"- {n}" for n in notes)
    out = args.out if os.path.basename(args.out) != "result.md" else \
        os.path.join(args.workdir, "ranks.md")
    save(out, md, {"args": vars(args), "results": b.res, "notes": b.notes + notes})
    sh(["sync"])
    log(f"wrote {out}")
