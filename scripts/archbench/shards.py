"""`scripts/bench --shards`: a directory of tar shards against one tar of the same files
and against the files on disk (issue 31).

    sudo scripts/bench --shards                         # 1,000 shards (200,000 files), 5 shapes
    sudo scripts/bench --shards --shard-counts 1000,10000 --shard-shapes flat,classes
    sudo scripts/bench --shards --shard-counts 20 --bigdir-files 2000 --cap 60   # a check

Why: datasets ship as WebDataset shards (thousands of tars of ~100 samples each), and
`archfs mount SHARDS/ MNT` shows them as one tree, a union. A job should not pay for the
sharding: the target is a union within 1.2x of one tar of the same members in the same
order, on every workload, at 10^5-10^6 files; and both beside the files extracted on the
same disk.

Shapes, written by Python's tarfile (seeded random bytes, fixed mtime; many shards at a
time in one process a core; cached under --workdir by shape, count and seed):
- `flat`: N shards (`shards/shard-00000.tar`...) of 100 samples, each `KEY.jpg` (2-20 KiB
  of random bytes) and `KEY.cls` (its class number as text), all in the root; KEY is the
  sample's global number, zero-padded;
- `classes`: the same samples as `nXXXXXXXX/KEY.jpg` and `.cls`, in 1,000 class
  directories (ImageNet's), each sample's class drawn at random, so every shard holds many
  classes as WebDataset shards do;
- `gz`, `zst`: the flat shards compressed: gzip level 9 (the stream tarfile's "w:gz"
  writes, the header's time fixed), `pzstd -3`; their one tar is compressed alike
  (one.tar.gz, one.tar.zst), their plain directory is flat's;
- `bigdir`: one tar holding one directory of --bigdir-files files (COCO's train2017 has
  118,287 in one directory), against its extraction only (no union).
Each union shape also has `one.tar` (the shards' members concatenated, in order) and a
plain directory (`tar -x` of one.tar on the same disk).

Tools: archfs on the shards directory (`archfs union`), archfs on the one tar (`archfs one
tar`), the plain directory; archfs with its default options (and --archfs-args). Each
workload on a fresh mount with the page cache dropped (cold), some again on the same
mount (warm):
- mount: first mount with no saved index (every shard indexed), remount from the saved
  indexes; saved index bytes; server peak RSS at the first mount, RSS after the remount
  once its listing ahead is done, and per file;
- stat walk: `find ROOT -type f -printf '%s\\n'` (cold, warm; the sizes it prints summed
  and checked);
- listing as a training job's index does: flat and bigdir one `os.listdir` of the
  directory (names only); classes the calls of ImageFolder's make_dataset (sorted scandir
  of the classes, `os.walk` of each);
- epoch: that listing on a fresh cold mount, then 2 reader processes read every file whole
  in a shuffled order (workloads.read_pass); again, warm, on the same mount.

archfs's mount returns once the mount is live, so it is timed alone: the harness's
readiness check (a listing of the root) would list a flat root's every file inside the
mount time and warm the kernel's caches before each cold pass.

Results: a table a shape with the median seconds of each tool and the ratios union / one
tar, union / plain directory, one tar / plain directory (below 1: faster); the markdown
report (stdout and --out) with its JSON beside it (report.save).
"""

import gzip
import io
import os
import random
import shlex
import shutil
import subprocess
import sys
import tarfile
import time

from .constants import SCRIPT
from .corpus import COMPRESSED_TARS, read_manifest, write_list
from .helpers import in_processes
from .report import save, table
from .scale import vm_rss_mib
from .stats import median_or_failure
from .system import MEMORY_NOTE, REG, Failed, Timeout, drop_caches, log, sh, sh_out
from .tools import Archfs, PlainDir, find_archfs
from .workloads import read_pass

SAMPLES = 100           # samples a shard (WebDataset's usual ~100 MB shards hold more, larger)
CLASSES = 1000
MTIME = 1_600_000_000
JPG = (2048, 20480)     # size range of a .jpg, bytes
BIGDIR = "train"        # the one directory of the bigdir tar
PIECE = 1000            # files a process writes at a time for bigdir
READERS = 2
SHAPES = ("flat", "classes", "gz", "zst", "bigdir")
UNION, ONE, PLAIN = "archfs union", "archfs one tar", "plain dir"
SUFFIX = {"flat": ".tar", "classes": ".tar", "gz": ".tar.gz", "zst": ".tar.zst"}
INDEX = ".archfs-index"
PZSTD = shlex.split(COMPRESSED_TARS["tar.zst"])     # pzstd -3 -p 2 -c, as the local bench
# Bytes written a sample (a bigdir file), for the free space check: the tar headers and
# padding, each copy (shards, one tar), and the extracted files' 4 KiB blocks.
DISK = {"flat": 45_000, "classes": 45_000, "gz": 27_000, "zst": 27_000, "bigdir": 40_000}

# ---------------------------------------------------------------------------------------------
# Flags
# ---------------------------------------------------------------------------------------------


def add_args(ap):
    g = ap.add_argument_group("shards mode (--shards; issue 31)")
    g.add_argument("--shards", action="store_true", help="a union of tar shards against one "
                   "tar of the same files and the extracted directory (default 1,000 shards "
                   "of 100 samples, 1 run, 300 s cap a pass; --runs, --cap, --seed apply)")
    g.add_argument("--shard-counts", default="1000", help="shards in a union, comma-separated "
                   "(x 100 samples x 2 files: 10000 is 2 M files)")
    g.add_argument("--shard-shapes", default=",".join(SHAPES),
                   help="comma-separated: " + ", ".join(SHAPES))
    g.add_argument("--bigdir-files", type=int, default=100_000,
                   help="files in bigdir's one directory (default 100,000)")
    g.add_argument("--shard-kib", default=f"{JPG[0] >> 10}-{JPG[1] >> 10}",
                   help="size range of a sample's .jpg in KiB (default 2-20; smaller makes "
                   "10,000 shards fit a small disk: it is the per-file cost that is measured)")

# ---------------------------------------------------------------------------------------------
# The archives: written a part (a shard) at a time, by a process a core
# ---------------------------------------------------------------------------------------------


def sample_members(shape, key, cls, data):
    """(name, bytes) of one sample in the tar, as WebDataset writes it."""
    if shape == "bigdir":
        return [(f"{BIGDIR}/{key}.jpg", data)]
    pre = f"n{cls:08d}/" if shape == "classes" else ""
    return [(f"{pre}{key}.jpg", data), (f"{pre}{key}.cls", b"%d\n" % cls)]


def write_part(job):
    """Writes samples first..first+count to a tar at `path`; returns where its members end
    (before the end-of-archive blocks, for concat) and [(name, size)]. Seeded by the first
    sample alone, so flat and classes hold the same bytes and classes."""
    path, shape, seed, first, count, jpg = job
    rnd = random.Random(seed * 1_000_003 + first)
    members = []
    with open(path, "wb", buffering=1 << 20) as f, tarfile.open(fileobj=f, mode="w") as tf:
        for k in range(first, first + count):
            cls = rnd.randrange(CLASSES)
            data = rnd.randbytes(rnd.randint(*jpg))
            for name, blob in sample_members(shape, f"{k:08d}", cls, data):
                ti = tarfile.TarInfo(name)
                ti.size, ti.mtime = len(blob), MTIME
                tf.addfile(ti, io.BytesIO(blob))
                members.append((name, len(blob)))
        end = tf.offset
    return end, members


def concat(parts, out, head=b""):
    """One tar of the parts' members in order: `head`, each part's members (copied in the
    kernel), then the end of archive as tarfile writes it (two zero blocks, padding to a
    record)."""
    with open(out + ".tmp", "wb", buffering=0) as o:
        o.write(head)
        for path, end in parts:
            with open(path, "rb") as i:
                left = end
                while left:
                    k = os.copy_file_range(i.fileno(), o.fileno(), left)
                    if not k:
                        raise SystemExit(f"{path}: shorter than {end} bytes")
                    left -= k
        pos = o.tell() + 2 * tarfile.BLOCKSIZE
        o.write(bytes(2 * tarfile.BLOCKSIZE + (-pos % tarfile.RECORDSIZE)))
    os.replace(out + ".tmp", out)


def gzip_file(job):
    """What tarfile's "w:gz" writes (the tar stream through GzipFile at level 9), with a
    fixed header time."""
    src, dst = job
    with open(src, "rb") as i, open(dst, "wb") as raw, \
            gzip.GzipFile(filename="", mode="wb", compresslevel=9, fileobj=raw,
                          mtime=MTIME) as o:
        shutil.copyfileobj(i, o, 1 << 20)


def pzstd_batch(files):
    """pzstd over hard links of the flat shards in the zst directory: FILE.zst beside each,
    the link removed. One core a batch (a shard is one pzstd frame)."""
    r = sh(PZSTD[:1] + ["-q", "-3", "-p", "1", "-f", "--rm", "--"] + files)
    if r.returncode != 0:
        raise SystemExit(f"pzstd: {r.stderr.strip()[-300:]}")


def shard_name(i, count, suffix):
    return f"shard-{i:0{max(5, len(str(count - 1)))}d}{suffix}"

# ---------------------------------------------------------------------------------------------
# The datasets, cached under --workdir
# ---------------------------------------------------------------------------------------------


def ds_dir(args, shape, count):
    unit = "f" if shape == "bigdir" else f"x{SAMPLES}"
    kib = "" if args.jpg == JPG else f"-k{args.jpg[0] >> 10}-{args.jpg[1] >> 10}"
    return os.path.join(args.workdir, f"shards-{shape}-{count}{unit}{kib}-s{args.seed}")


def built(args, shape, count):
    return os.path.exists(os.path.join(ds_dir(args, shape, count), ".complete"))


def check_space(args, plan):
    """Fails before writing anything when the datasets still to build will not fit."""
    need = 0
    scale = max(0.2, sum(args.jpg) / sum(JPG))
    for shape, count in plan:
        if not built(args, shape, count):
            need += DISK[shape] * scale * (count if shape == "bigdir" else count * SAMPLES)
        if shape in ("gz", "zst") and ("flat", count) not in plan and not built(args, "flat",
                                                                                  count):
            need += DISK["flat"] * scale * count * SAMPLES
    free = shutil.disk_usage(args.workdir).free
    if need > free * 0.9:
        raise SystemExit(f"--shards: the datasets to build need about {need / 1e9:.0f} GB, "
                         f"{args.workdir} has {free / 1e9:.0f} GB free")


def extract(tar, src):
    shutil.rmtree(src, ignore_errors=True)
    os.makedirs(src)
    subprocess.run(["tar", "-xf", tar, "-C", src], check=True)


def build_tars(d, shape, seed, count, jpg):
    """flat, classes: the shards, their manifest, one.tar and its extraction."""
    shards = os.path.join(d, "shards")
    shutil.rmtree(shards, ignore_errors=True)
    os.makedirs(shards)
    jobs = [(os.path.join(shards, shard_name(i, count, ".tar")), shape, seed, i * SAMPLES,
             SAMPLES, jpg) for i in range(count)]
    parts = []
    with open(os.path.join(d, "files.tsv"), "w") as mf:
        for i, (end, members) in enumerate(in_processes(write_part, jobs, ordered=True)):
            parts.append((jobs[i][0], end))
            mf.writelines(f"{p}\t{s}\n" for p, s in members)
            if (i + 1) % max(1, count // 10) == 0:
                log(f"  {i + 1} of {count} shards")
    log("  one.tar")
    concat(parts, os.path.join(d, "one.tar"))
    log("  tar -x one.tar")
    extract(os.path.join(d, "one.tar"), os.path.join(d, "src"))


def build_compressed(d, shape, flat):
    """gz, zst: flat's shards and one.tar compressed (one.tar first: it takes a core while
    the other does the shards)."""
    shards = os.path.join(d, "shards")
    shutil.rmtree(shards, ignore_errors=True)
    os.makedirs(shards)
    names = [os.path.basename(p) for p in flat["shards"]]
    one = os.path.join(d, "one" + SUFFIX[shape])
    if shape == "gz":
        jobs = [(flat["one"], one)] + [(os.path.join(flat["union"], n),
                                        os.path.join(shards, n + ".gz")) for n in names]
        for _ in in_processes(gzip_file, jobs):
            pass
        return
    for n in names:
        os.link(os.path.join(flat["union"], n), os.path.join(shards, n))
    batches = [[os.path.join(shards, n) for n in names[i:i + 200]]
               for i in range(0, len(names), 200)]
    with open(flat["one"], "rb") as i, open(one, "wb") as o:
        p = subprocess.Popen(PZSTD, stdin=i, stdout=o)
        for _ in in_processes(pzstd_batch, batches):
            pass
        if p.wait() != 0:
            raise SystemExit(f"{' '.join(PZSTD)} one.tar failed")


def build_bigdir(d, seed, files, jpg):
    """One tar: the directory BIGDIR, then its files, written in pieces and concatenated."""
    pieces = os.path.join(d, "pieces")
    shutil.rmtree(pieces, ignore_errors=True)
    os.makedirs(pieces)
    jobs = [(os.path.join(pieces, f"{i:07d}.tar"), "bigdir", seed, i, min(PIECE, files - i),
             jpg) for i in range(0, files, PIECE)]
    parts = []
    with open(os.path.join(d, "files.tsv"), "w") as mf:
        # Consumed whole: a generator left suspended inside its pool (zip stops at the
        # end of `jobs`) is closed later, and the pool's teardown from there hung.
        written = list(in_processes(write_part, jobs, ordered=True))
        for job, (end, members) in zip(jobs, written):
            parts.append((job[0], end))
            mf.writelines(f"{p}\t{s}\n" for p, s in members)
    ti = tarfile.TarInfo(BIGDIR)
    ti.type, ti.mode, ti.mtime = tarfile.DIRTYPE, 0o755, MTIME
    concat(parts, os.path.join(d, "one.tar"),
           ti.tobuf(tarfile.DEFAULT_FORMAT, tarfile.ENCODING, "surrogateescape"))
    shutil.rmtree(pieces)
    extract(os.path.join(d, "one.tar"), os.path.join(d, "src"))


def dataset(args, shape, count):
    """The archives of a shape, built once: {union: the shards directory (bigdir: None),
    shards: the archives in it, one: the one tar, src: the plain directory, manifest}."""
    d = ds_dir(args, shape, count)
    flat = dataset(args, "flat", count) if shape in ("gz", "zst") else None
    if not built(args, shape, count):
        log(f"building {shape} ({count} {'files' if shape == 'bigdir' else 'shards'}) "
            f"in {d}")
        t0 = time.perf_counter()
        os.makedirs(d, exist_ok=True)
        if shape == "bigdir":
            build_bigdir(d, args.seed, count, args.jpg)
        elif flat:
            build_compressed(d, shape, flat)
        else:
            build_tars(d, shape, args.seed, count, args.jpg)
        open(os.path.join(d, ".complete"), "w").close()
        log(f"  {time.perf_counter() - t0:.0f} s")
    union = None if shape == "bigdir" else os.path.join(d, "shards")
    # (the shards directory also holds the indexes archfs saves beside them)
    shards = sorted(os.path.join(union, n) for n in os.listdir(union)
                    if n.endswith(SUFFIX[shape])) if union else []
    base = flat or {"src": os.path.join(d, "src"), "manifest": os.path.join(d, "files.tsv")}
    return {"union": union, "shards": shards, "one": os.path.join(d, "one" + SUFFIX.get(
        shape, ".tar")), "src": base["src"], "manifest": base["manifest"]}


def saved_indexes(archives):
    """The index files archfs saved for these archives: beside each, or in ~/.cache/archfs
    (NAME-CRC.archfs-index), and a union's merged index beside the first
    (.archfs-union-HASH.archfs-index)."""
    out = [a + INDEX for a in archives if os.path.isfile(a + INDEX)]
    if len(archives) > 1:
        d = os.path.dirname(archives[0])
        out += [os.path.join(d, f) for f in os.listdir(d)
                if f.startswith(".archfs-union-") and f.endswith(INDEX)]
    cache = os.path.expanduser("~/.cache/archfs")
    names = {os.path.basename(a) for a in archives}
    if os.path.isdir(cache):
        out += [os.path.join(cache, f) for f in os.listdir(cache)
                if f.endswith(INDEX) and f[:-len(INDEX)].rsplit("-", 1)[0] in names]
    return out

# ---------------------------------------------------------------------------------------------
# The tools and the workloads
# ---------------------------------------------------------------------------------------------


class LiveArchfs(Archfs):
    """archfs with the archives whose saved indexes a first mount removes."""

    live_on_return = True

    def __init__(self, name, source, mnt, cap, binary, extra, archives):
        super().__init__(name, source, mnt, cap, binary, extra)
        self.archives = archives


def children(pid):
    """The child processes of `pid` (any of its threads')."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    out = []
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/children") as f:
                out += f.read().split()
        except OSError:
            pass
    return out


def listing(root, shape):
    """What a job lists before its first epoch; returns (seconds, files seen). Run in a
    process of its own (LISTER), which the cap can stop."""
    t0 = time.perf_counter()
    if shape == "classes":
        n = 0
        for c in sorted(e.name for e in os.scandir(root) if e.is_dir()):
            for _, _, files in os.walk(os.path.join(root, c)):
                n += len(files)
    else:
        n = len(os.listdir(os.path.join(root, BIGDIR) if shape == "bigdir" else root))
    return time.perf_counter() - t0, n


LISTER = [sys.executable, "-c", "import sys; from archbench.shards import listing; "
          "print(*listing(*sys.argv[1:]))"]


class ShardBench:
    def __init__(self, args):
        self.args = args
        self.res = {}       # section ("flat 1000") -> tool -> metric -> [values]
        self.notes = []
        self.mntdir = os.path.join(args.workdir, "mnt")
        self.tmp = os.path.join(args.workdir, "tmp")
        os.makedirs(self.tmp, exist_ok=True)
        self.archfs_bin = find_archfs(args)
        self.extra = shlex.split(args.archfs_args)

    def rec(self, section, tool, metric, value):
        self.res.setdefault(section, {}).setdefault(tool, {}).setdefault(metric, []) \
            .append(value)
        if self.args.verbose:
            log(f"    {section} / {tool} / {metric}: {value}")

    def note(self, msg):
        if msg not in self.notes:
            self.notes.append(msg)
        log("  " + msg)

    def targets(self, shape, ds):
        def M(tag):
            return os.path.join(self.mntdir, f"shards-{shape}-{tag}")
        cap = self.args.cap
        ts = []
        if ds["union"]:
            ts.append(LiveArchfs(UNION, ds["union"], M("union"), cap, self.archfs_bin,
                                 self.extra, ds["shards"]))
        ts.append(LiveArchfs(ONE, ds["one"], M("one"), cap, self.archfs_bin, self.extra,
                             [ds["one"]]))
        ts.append(PlainDir(PLAIN, ds["src"], M("plain"), cap))
        REG.targets.extend(ts)
        return ts

    def fresh(self, t):
        t.unmount()
        drop_caches()
        return t.mount()

    def guarded(self, section, t, what, metrics, fn):
        """fn(); a timeout or failure marks the metrics it left without a figure."""
        got = {m: len(self.res.get(section, {}).get(t.name, {}).get(m, [])) for m in metrics}
        try:
            fn()
            return
        except Timeout as e:
            marker, msg = "timeout", f"over the {self.args.cap:g} s cap ({e})"
        except Failed as e:
            marker, msg = "error", str(e)
        finally:
            t.unmount()
        self.note(f"{section}: {t.name}: {what}: {msg}")
        for m in metrics:
            if len(self.res.get(section, {}).get(t.name, {}).get(m, [])) == got[m]:
                self.rec(section, t.name, m, marker)

    def stat_walk(self, root, n, nbytes):
        """`find ROOT -type f -printf '%s\\n'`, timed; the sizes it printed checked against
        the manifest's. No shell, so the cap stops find itself."""
        t0 = time.perf_counter()
        try:
            r = sh(["find", root, "-type", "f", "-printf", "%s\n"], timeout=self.args.cap)
        except subprocess.TimeoutExpired:
            raise Timeout("find")
        dt = time.perf_counter() - t0
        sizes = r.stdout.split()
        if r.returncode != 0 or len(sizes) != n or sum(map(int, sizes)) != nbytes:
            raise Failed(f"find: {len(sizes)} files, expected {n} of {nbytes} bytes in all; "
                         f"{r.stderr.strip()[-200:]}")
        return dt

    def listed(self, root, shape, n):
        try:
            r = sh(LISTER + [root, shape], timeout=self.args.cap, cwd=os.path.dirname(SCRIPT))
        except subprocess.TimeoutExpired:
            raise Timeout("listing")
        if r.returncode != 0:
            raise Failed(f"listing: {r.stderr.strip()[-200:]}")
        secs, seen = r.stdout.split()
        if int(seen) != n:
            raise Failed(f"the listing found {seen} files, expected {n}")
        return float(secs)

    # -- workloads ---------------------------------------------------------------------------

    def w_mount(self, section, t, n):
        """First mount with no saved index, then a remount from the saved ones."""
        def f():
            for x in saved_indexes(t.archives):
                os.unlink(x)
            self.rec(section, t.name, "first_mount", self.fresh(t))
            _, hwm = t.stats()
            if hwm is not None:
                self.rec(section, t.name, "first_hwm_mib", hwm)
            t.unmount()
            saved = saved_indexes(t.archives)
            # A union of local tars saves its merged index alone, one tar its own.
            if len(saved) != 1:
                raise Failed(f"{len(saved)} saved indexes for {len(t.archives)} archives")
            self.rec(section, t.name, "index_mib",
                     sum(os.path.getsize(x) for x in saved) / 2**20)
            self.rec(section, t.name, "remount", self.fresh(t))
            # What the mount holds once its listing ahead (a child process of the server,
            # merging every directory through it) is done, not in the middle of it.
            deadline = time.time() + 120
            while any(children(p) for p in t.pids or []) and time.time() < deadline:
                time.sleep(0.05)
            rss = vm_rss_mib(t.pids)
            if rss is not None:
                self.rec(section, t.name, "remount_rss_mib", rss)
                self.rec(section, t.name, "rss_per_file", rss * 2**20 / n)
        self.guarded(section, t, "mount", ["first_mount", "remount"], f)

    def w_stat(self, section, t, manifest):
        n, nbytes = len(manifest), sum(s for _, s in manifest)

        def f():
            self.fresh(t)
            self.rec(section, t.name, "stat_cold", self.stat_walk(t.root, n, nbytes))
            self.rec(section, t.name, "stat_warm", self.stat_walk(t.root, n, nbytes))
        self.guarded(section, t, "stat walk", ["stat_cold", "stat_warm"], f)

    def w_listing(self, section, t, shape, n):
        def f():
            self.fresh(t)
            self.rec(section, t.name, "list_cold", self.listed(t.root, shape, n))
        self.guarded(section, t, "listing", ["list_cold"], f)

    def orders(self, manifest, run):
        """This run's shuffled lists of every file, for the cold and the warm epoch."""
        rnd = random.Random(self.args.seed * 7919 + run)
        lists = {}
        for p in ("cold", "warm"):
            order = list(manifest)
            rnd.shuffle(order)
            lists[p] = os.path.join(self.tmp, f"shards-{p}.tsv")
            write_list(lists[p], order)
        return lists

    def w_epoch(self, section, t, shape, manifest, lists):
        """The listing on a fresh cold mount, then every file read by READERS processes in
        a shuffled order (timed from their common start); again, warm, in another order."""
        n, nbytes = len(manifest), sum(s for _, s in manifest)
        got = {}

        def cold_start():
            self.fresh(t)
            got["list"] = self.listed(t.root, shape, n)

        def f():
            before = 0.0
            for p in ("cold", "warm"):
                wall, _ = read_pass(t.root, lists[p], READERS,
                                    lambda: time.time() + self.args.cap, n, nbytes,
                                    before_go=cold_start if p == "cold" else None)
                if p == "cold":
                    self.rec(section, t.name, "first_epoch", got["list"] + wall)
                self.rec(section, t.name, f"epoch_{p}", wall)
                # The server's share: a warm pass that costs it CPU found pages or
                # inodes gone from the kernel's caches.
                cpu, _ = t.stats()
                if cpu is not None:
                    self.rec(section, t.name, f"epoch_{p}_cpu", cpu - before)
                    before = cpu
            _, hwm = t.stats()
            if hwm is not None:
                self.rec(section, t.name, "epoch_hwm_mib", hwm)
        self.guarded(section, t, "epoch", ["first_epoch", "epoch_cold", "epoch_warm"], f)

    def run_shape(self, section, shape, ds):
        """Every run, every tool through every workload; returns the number of files."""
        manifest = read_manifest(ds["manifest"])
        n = len(manifest)
        ts = self.targets(shape, ds)
        for run in range(self.args.runs):
            log(f"=== {section}: run {run + 1}/{self.args.runs}, {n} files")
            lists = self.orders(manifest, run)
            for t in ts:
                t0 = time.time()
                if isinstance(t, Archfs):
                    self.w_mount(section, t, n)
                self.w_stat(section, t, manifest)
                self.w_listing(section, t, shape, n)
                self.w_epoch(section, t, shape, manifest, lists)
                log(f"  {t.name}: {time.time() - t0:.1f} s")
        return n

# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


ROWS = [("first mount, no saved index", "first_mount", "s"),
        ("remount from the saved indexes", "remount", "s"),
        ("saved indexes", "index_mib", "MiB"),
        ("server peak RSS, first mount", "first_hwm_mib", "MiB"),
        ("server RSS after the remount and its listing ahead", "remount_rss_mib", "MiB"),
        ("RSS after the remount / file", "rss_per_file", "B"),
        ("stat walk (`find -printf %s`), cold", "stat_cold", "s"),
        ("stat walk, warm", "stat_warm", "s"),
        ("listing, cold", "list_cold", "s"),
        ("first epoch, cold: listing + reading", "first_epoch", "s"),
        ("first epoch, cold: reading", "epoch_cold", "s"),
        ("epoch, warm", "epoch_warm", "s"),
        ("server CPU, cold epoch (with its mount and listing)", "epoch_cold_cpu", "s"),
        ("server CPU, warm epoch", "epoch_warm_cpu", "s"),
        ("server peak RSS over the epochs", "epoch_hwm_mib", "MiB")]


def cell(v, unit):
    if v is None:
        return "—"
    if isinstance(v, str):
        return v
    return (f"{v:.3g}" if v < 100 else f"{v:.0f}") + f" {unit}"


def ratio(a, b, bold):
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0:
        return f"**{a / b:.2f}×**" if bold else f"{a / b:.2f}×"
    return "—"


def shape_table(res, tools):
    """A row a workload: each tool's median, then the ratios between the tools (the
    target's, union / one tar, in bold)."""
    pairs = [(a, b) for a, b in ((UNION, ONE), (UNION, PLAIN), (ONE, PLAIN))
             if a in tools and b in tools]
    short = {UNION: "union", ONE: "one tar", PLAIN: "plain dir"}
    hdr = ["workload"] + list(tools) + [f"{short[a]} / {short[b]}" for a, b in pairs]
    rows = []
    for label, metric, unit in ROWS:
        v = {t: median_or_failure(res.get(t, {}).get(metric)) for t in tools}
        if all(x is None for x in v.values()):
            continue
        rows.append([label] + [cell(v[t], unit) for t in tools]
                    + [ratio(v[a], v[b], (a, b) == (UNION, ONE)) for a, b in pairs])
    return table(hdr, rows)


def mb(paths):
    return sum(os.path.getsize(p) for p in paths) / 1e6


def describe(shape, count, ds, n):
    """A line on what a section mounts."""
    one = f"{os.path.basename(ds['one'])} {mb([ds['one']]):.0f} MB"
    if shape == "bigdir":
        return f"one tar of one directory of {n:,} .jpg files ({one}); one.tar extracted"
    plain = "flat's plain directory" if shape in ("gz", "zst") else "one.tar extracted"
    return (f"{count:,} shards of {SAMPLES} samples ({n:,} files, {mb(ds['shards']):.0f} MB of "
            f"`{SUFFIX[shape]}`); {one}; {plain}")


def header(args, archfs_bin, sections):
    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo")
                if x.startswith("model name")), "?")
    src = args.archfs_src
    dirty = sh_out(["git", "-C", src, "status", "--porcelain", "src"])
    versions = [
        f"archfs: {sh_out([archfs_bin, '--version'])} ({archfs_bin}; "
        f"{sh_out(['git', '-C', src, 'log', '-1', '--format=%h %s'])[:100]}"
        f"{' + uncommitted changes in src/' if dirty else ''})",
        f"cpu: {cpu}, nproc {os.cpu_count()}; kernel {os.uname().release}",
        f"python {sys.version.split()[0]}; {sh_out(['pzstd', '-V']).splitlines()[0]}; "
        f"{sh_out(['tar', '--version']).splitlines()[0]}",
    ] + [f"memory: {m}" for m in MEMORY_NOTE]
    method = (f"Medians of {args.runs} run(s); cap {args.cap:g} s a pass. Cold = page cache "
              "dropped (`echo 3 > drop_caches`) and a fresh mount (archfs timed until `archfs "
              "mount` returns, live); warm = again on the same mount. archfs with its default "
              "options" + (f" and `{args.archfs_args}`" if args.archfs_args else "") + "; "
              "remount and the later workloads find the indexes the first mount saved "
              "(beside each archive). Listing: flat and bigdir one `os.listdir`, classes "
              "ImageFolder's make_dataset calls (sorted scandir, `os.walk` of each class). "
              f"First epoch: that listing on a fresh cold mount, then {READERS} reader "
              "processes read every file whole (os.open + readv to EOF, sizes checked) in a "
              "shuffled order dealt round-robin, timed from their common start; warm: another "
              "order on the same mount. Ratios: time (or memory) of the first / of the second "
              "(below 1: the first is faster); the target is union / one tar within 1.2x.")
    return [f"## archfs shards benchmark (issue 31), {time.strftime('%Y-%m-%d')}", "", "```"] \
        + versions + ["```", "", method, ""] \
        + [f"- `{s}`: {d}" for s, d in sections.items()] + [""]


def report(b, args, archfs_bin, sections):
    lines = header(args, archfs_bin, {s: d for s, (d, _) in sections.items()})
    for section, (_, tools) in sections.items():
        lines += [f"### {section}", "", shape_table(b.res.get(section, {}), tools), ""]
    if b.notes:
        lines += ["### Failed, timed out", ""] + [f"- {x}" for x in b.notes] + [""]
    return "\n".join(lines)

# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def ensure_pzstd():
    """pzstd, from Debian's zstd package."""
    if shutil.which("pzstd"):
        return
    log("apt-get install zstd (pzstd)")
    sh(["apt-get", "install", "-y", "-qq", "zstd"], timeout=900,
       env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
    if not shutil.which("pzstd"):
        raise SystemExit("pzstd missing: apt-get install zstd")


def main(args):
    counts = [int(x) for x in args.shard_counts.split(",") if x.strip()]
    shapes = [s.strip() for s in args.shard_shapes.split(",") if s.strip()]
    bad = [s for s in shapes if s not in SHAPES]
    if bad or not counts or min(counts) < 1 or args.bigdir_files < 1:
        raise SystemExit(f"--shards: bad --shard-shapes {bad} or counts")
    try:
        lo, hi = (int(float(x) * 1024) for x in args.shard_kib.split("-"))
    except ValueError:
        raise SystemExit(f"--shard-kib {args.shard_kib}: want MIN-MAX, e.g. 2-20")
    if not 0 < lo <= hi:
        raise SystemExit(f"--shard-kib {args.shard_kib}: want 0 < MIN <= MAX")
    args.jpg = (lo, hi)
    plan = [(s, c) for c in counts for s in shapes if s != "bigdir"]
    if "bigdir" in shapes:
        plan.append(("bigdir", args.bigdir_files))
    if "zst" in shapes:
        ensure_pzstd()
    check_space(args, plan)
    b = ShardBench(args)
    sections = {}
    for shape, count in plan:
        ds = dataset(args, shape, count)
        section = f"{shape} {count}"
        n = b.run_shape(section, shape, ds)
        tools = [UNION] * bool(ds["union"]) + [ONE, PLAIN]
        sections[section] = (describe(shape, count, ds, n), tools)
    save(args.out, report(b, args, b.archfs_bin, sections),
         {"args": vars(args), "sections": {s: d for s, (d, _) in sections.items()},
          "results": b.res, "notes": b.notes})
    log(f"wrote {args.out}")
