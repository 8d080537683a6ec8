"""`scripts/bench --scale`: archfs at ImageNet scale (issue 15), side by side in one run.

    sudo scripts/bench --scale                          # 1,281,167 files, all workloads (~40 min)
    sudo scripts/bench --scale --scale-files 100000 --runs 1 --scale-growth '' --scale-walk ''

Creating 1.28 M real files and running mksquashfs over them takes over 20 minutes, so the
namespace is written straight as a tar stream (ImageNet's shape: 1,000 class directories of
~1,282 files named like n01440764_10026.JPEG; tiny files of 1-400 bytes, so the tar is 1.3 GB
and what is measured is the per-file cost), `tar2sqfs` turns it into a SquashFS image, and
`tar -x` into a plain directory on the same disk. Compared on the same tree: archfs on the
tar and on the image, the kernel's squashfs driver on the image, the plain directory, and
with `--tools` squashfuse_ll.

Workloads, each on a fresh mount with the page cache dropped (cold) and again on the same
mount (warm):
- `find ROOT -type f` (a listing, as ImageFolder's index) and `find ROOT -type f -printf
  '%s'` (a stat of every file in walk order);
- ImageFolder's index: torchvision's `ImageFolder(root)` when the bench venv has torchvision,
  else the calls its `make_dataset` makes (sorted scandir of the classes, `os.walk` of each,
  extension check: no stat), which is the same work on the filesystem;
- a first epoch as training runs it: that listing, then every file opened and read whole in
  shuffled order by 1, 2 and 4 reader processes;
- the tar index: first mount (cold, no saved index), remount from the saved index (cold),
  index file bytes and server peak RSS per entry; `cat TAR > /dev/null` cold for reference;
- growth (`--scale-growth`): the same index figures for tars of N empty members (up to 14 M,
  ImageNet-21k's count);
- walk against size (`--scale-walk`): find and stat, cold, at several file counts.

Results: a markdown report (stdout and --out), JSON beside it, and PNG plots in --plot-dir
(matplotlib from the bench venv).
"""

import glob
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import time

from . import plots
from .constants import SCRIPT, VPY
from .corpus import read_manifest, write_list
from .deps import ensure_venv, venv_has
from .stats import median_or_last
from .system import REG, Failed, Timeout, drop_caches, log, sh
from .tools import Archfs, Kernel, PlainDir, Squashfuse, find_archfs
from .workloads import read_pass, run_group

IMAGENET_FILES = 1_281_167
IMAGENET_CLASSES = 1000
PER_CLASS = 1282


def classes_for(files):
    """ImageNet's shape: directories of ~1,282 files, 1,000 of them at 1.28 M."""
    return min(IMAGENET_CLASSES, max(10, -(-files // PER_CLASS)))


def tar_header(name, size, typeflag, mode, mtime):
    h = bytearray(512)
    n = name.encode()
    if len(n) > 100:
        raise ValueError(f"name too long for ustar: {name}")
    h[0:len(n)] = n
    h[100:108] = b"%07o\0" % mode
    h[108:116] = b"0001750\0"
    h[116:124] = b"0001750\0"
    h[124:136] = b"%011o\0" % size
    h[136:148] = b"%011o\0" % mtime
    h[148:156] = b"        "
    h[156] = ord(typeflag)
    h[257:265] = b"ustar\x0000"
    h[265:270] = b"user\0"
    h[297:302] = b"user\0"
    h[148:156] = b"%06o\0 " % sum(h)
    return h


def write_tar(path, files, classes, seed, max_size, keep_manifest=True, unique=False):
    """Writes an ImageNet-shaped tar: `classes` directories, `files` members dealt evenly,
    sizes uniform in 1..max_size (0: empty members). Members are slices of one random blob
    (quick to write) unless `unique`: then random bytes of their own, as JPEGs are (slices
    of one blob packed together compress, which JPEGs do not). Returns the manifest
    [(relpath, size)] if asked for (14 M tuples would take gigabytes)."""
    rnd = random.Random(seed)
    blob = rnd.randbytes(max_size + 512)
    manifest = []
    mtime = 1_600_000_000
    tmp = path + ".tmp"
    with open(tmp, "wb", buffering=16 << 20) as f:
        for c in range(classes):
            cls = f"n{c:08d}"
            f.write(tar_header(cls + "/", 0, "5", 0o755, mtime))
            for j in range(c, files, classes):
                rel = f"{cls}/{cls}_{j // classes:06d}.JPEG"
                size = rnd.randint(1, max_size) if max_size else 0
                f.write(tar_header(rel, size, "0", 0o644, mtime + j % 86400))
                if size:
                    off = j % 512
                    f.write(rnd.randbytes(size) if unique else blob[off:off + size])
                    f.write(bytes(-size % 512))
                if keep_manifest:
                    manifest.append((rel, size))
        f.write(bytes(1024))
    os.replace(tmp, path)
    return manifest


def vm_rss_mib(pids):
    """Resident memory now (VmRSS) of the server processes; None if one is gone."""
    total = 0
    for p in pids or []:
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(x.split()[1]) for x in f if x.startswith("VmRSS:"))
        except (OSError, StopIteration):
            return None
    return total / 1024 if pids else None


class Scale:
    def __init__(self, args):
        self.args = args
        self.res = {}      # section -> tool -> metric -> [values]
        self.notes = []
        self.mntdir = os.path.join(args.workdir, "mnt")
        self.tmp = os.path.join(args.workdir, "tmp")
        os.makedirs(self.mntdir, exist_ok=True)
        os.makedirs(self.tmp, exist_ok=True)
        self.archfs_bin = find_archfs(args)
        self.extra = shlex.split(args.archfs_args)
        self.alt = shlex.split(args.scale_alt_args) if args.scale_alt_args else None

    # -- recording ---------------------------------------------------------------------------

    def rec(self, section, tool, metric, value):
        self.res.setdefault(section, {}).setdefault(tool, {}).setdefault(metric, []).append(value)
        if self.args.verbose:
            log(f"    {section} / {tool} / {metric}: {value}")

    def note(self, msg):
        if msg not in self.notes:
            self.notes.append(msg)
        log("  " + msg)

    # -- data --------------------------------------------------------------------------------

    def dataset(self, files, classes, max_size, plain=True, sqfs=True, keep_manifest=True,
                unique=False):
        """tar, image and plain directory of one shape, cached under --workdir."""
        own = "-unique" if unique else ""
        key = f"scale-{files}f-{classes}c-{max_size}b{own}-s{self.args.seed}"
        d = os.path.join(self.args.workdir, key)
        os.makedirs(d, exist_ok=True)
        tar = os.path.join(d, "data.tar")
        manifest_path = os.path.join(d, "files.tsv")
        if not os.path.exists(tar + ".complete"):
            log(f"writing {files} members in {classes} directories to {tar}")
            t0 = time.perf_counter()
            manifest = write_tar(tar, files, classes, self.args.seed, max_size, keep_manifest,
                                 unique)
            if keep_manifest:
                write_list(manifest_path + ".tmp", manifest)
                os.replace(manifest_path + ".tmp", manifest_path)
            open(tar + ".complete", "w").close()
            log(f"  {time.perf_counter() - t0:.0f} s, {os.path.getsize(tar) / 1e9:.2f} GB")
        out = {"dir": d, "tar": tar, "manifest": manifest_path, "files": files}
        img = os.path.join(d, "zstd.sqfs")
        if sqfs and not os.path.exists(img + ".complete"):
            log("tar2sqfs -c zstd")
            t0 = time.perf_counter()
            with open(tar, "rb") as f:
                r = subprocess.run(["tar2sqfs", "-q", "-f", "-c", "zstd", img], stdin=f,
                                   capture_output=True, text=True)
            if r.returncode != 0:
                raise SystemExit(f"tar2sqfs failed: {r.stderr.strip()[-300:]}")
            open(img + ".complete", "w").close()
            log(f"  {time.perf_counter() - t0:.0f} s")
        if sqfs:
            out["sqfs"] = img
            REG.images.append(img)
        src = os.path.join(d, "src")
        if plain and not os.path.exists(src + ".complete"):
            log("tar -x into a plain directory")
            shutil.rmtree(src, ignore_errors=True)
            os.makedirs(src)
            subprocess.run(["tar", "-xf", tar, "-C", src], check=True)
            open(src + ".complete", "w").close()
        if plain:
            out["src"] = src
        return out

    def targets(self, ds, tag):
        cap = self.args.cap

        def M(name):
            return os.path.join(self.mntdir, f"{tag}-{name}")
        ts = [Archfs("archfs tar", ds["tar"], M("archfs-tar"), cap, self.archfs_bin,
                     self.extra)]
        if self.alt is not None:
            ts.append(Archfs("archfs alt tar", ds["tar"], M("archfs-alt-tar"), cap,
                             self.archfs_bin, self.extra + self.alt))
        if "sqfs" in ds:
            ts.append(Archfs("archfs sqfs", ds["sqfs"], M("archfs-sqfs"), cap,
                             self.archfs_bin, self.extra))
            if self.alt is not None:
                ts.append(Archfs("archfs alt sqfs", ds["sqfs"], M("archfs-alt-sqfs"), cap,
                                 self.archfs_bin, self.extra + self.alt))
            if shutil.which("squashfuse_ll"):
                ts.append(Squashfuse("squashfuse_ll sqfs", ds["sqfs"], M("sqfs-ll"), cap,
                                     "squashfuse_ll"))
            ts.append(Kernel("kernel sqfs", ds["sqfs"], M("kernel"), cap))
        if "src" in ds:
            ts.append(PlainDir("plain dir", ds["src"], M("plain"), cap))
        want = [w.strip() for w in (self.args.tools or "archfs,kernel,plain").split(",")]
        ts = [t for t in ts if any(w and w in t.name for w in want)]
        REG.targets.extend(ts)
        return ts

    def fresh(self, t):
        t.unmount()
        drop_caches()
        return t.mount()

    def index_files(self, tar):
        base = os.path.basename(tar)
        return [f for f in glob.glob(tar + ".archfs-index")
                + glob.glob(os.path.expanduser(f"~/.cache/archfs/{glob.escape(base)}-*"))
                if os.path.isfile(f)]

    # -- workloads ---------------------------------------------------------------------------

    def timed_shell(self, cmd, expect=None):
        t0 = time.perf_counter()
        try:
            r = sh(cmd, timeout=self.args.cap)
        except subprocess.TimeoutExpired:
            raise Timeout(cmd)
        dt = time.perf_counter() - t0
        if r.returncode != 0:
            raise Failed(f"{cmd}: {r.stderr.strip()[-200:]}")
        if expect is not None and r.stdout.strip() != str(expect):
            raise Failed(f"{cmd}: printed {r.stdout.strip()[:80]}, expected {expect}")
        return dt

    def listing(self, root, n):
        """ImageFolder's index of root; returns seconds."""
        r = sh([self.py, SCRIPT, "_imagefolder", root], timeout=self.args.cap)
        if r.returncode != 0:
            raise Failed(f"ImageFolder: {r.stderr.strip()[-300:]}")
        o = json.loads(r.stdout.strip().splitlines()[-1])
        if o["images"] != n:
            raise Failed(f"ImageFolder found {o['images']} images, expected {n}")
        return o["index_s"]

    def guarded(self, section, t, what, fn):
        try:
            fn()
        except Timeout as e:
            self.note(f"{section}: {t.name}: {what}: over the {self.args.cap:g} s cap ({e})")
            self.rec(section, t.name, what, "timeout")
        except Failed as e:
            self.note(f"{section}: {t.name}: {what}: {e}")
            self.rec(section, t.name, what, "error")
        finally:
            t.unmount(force=False)

    def walks(self, section, t, n, warm=True, paths=None):
        """find and a stat walk; with `paths` (a shuffled list file) also a stat of every
        file by its path with no listing first, as a dataset indexed by a file list does."""
        find = f"find {shlex.quote(t.root)} -type f | wc -l"
        stat = f"find {shlex.quote(t.root)} -type f -printf '%s\\n' | wc -l"
        for name, cmd in (("find", find), ("stat", stat)):
            def f(name=name, cmd=cmd):
                self.fresh(t)
                self.rec(section, t.name, f"{name}_cold", self.timed_shell(cmd, n))
                if warm:
                    self.rec(section, t.name, f"{name}_warm", self.timed_shell(cmd, n))
            self.guarded(section, t, name, f)
        if not paths:
            return

        def statpath():
            for p in ("cold", "warm") if warm else ("cold",):
                go = (lambda: self.fresh(t)) if p == "cold" else None
                _, outs, _ = run_group(
                    [[sys.executable, SCRIPT, "_stat", t.root, paths]],
                    lambda: time.time() + self.args.cap, go)
                if outs[0]["errors"]:
                    raise Failed(f"{outs[0]['errors']} errors, {outs[0]['first_error']}")
                self.rec(section, t.name, f"statpath_{p}", outs[0]["elapsed"])
        self.guarded(section, t, "statpath", statpath)

    def imagefolder(self, section, t, n):
        def f():
            self.fresh(t)
            self.rec(section, t.name, "imagefolder_cold", self.listing(t.root, n))
            self.rec(section, t.name, "imagefolder_warm", self.listing(t.root, n))
        self.guarded(section, t, "imagefolder", f)

    def shuffled(self, manifest, run, readers, name):
        """A list file of `manifest` in the shuffled order of run `run` with `readers`."""
        rnd = random.Random(self.args.seed * 7919 + run * 31 + readers)
        order = list(manifest)
        rnd.shuffle(order)
        lf = os.path.join(self.tmp, name)
        write_list(lf, order)
        return lf

    def epochs(self, section, t, manifest, run):
        n, nbytes = len(manifest), sum(s for _, s in manifest)
        for readers in self.args.readers:
            lf = self.shuffled(manifest, run, readers, "scale-order.tsv")
            listed = {}

            def cold_start():
                self.fresh(t)
                listed["s"] = self.listing(t.root, n)

            def f(readers=readers):
                for p in ("cold", "warm"):
                    before = cold_start if p == "cold" else None
                    wall, _ = read_pass(t.root, lf, readers,
                                        lambda: time.time() + self.args.cap, n, nbytes,
                                        before_go=before)
                    if p == "cold":
                        self.rec(section, t.name, f"list_cold_{readers}", listed["s"])
                    self.rec(section, t.name, f"epoch_{p}_{readers}", wall)
                cpu, hwm = t.stats()
                if hwm is not None:
                    self.rec(section, t.name, "srv_hwm_mib", hwm)
            self.guarded(section, t, f"epoch_cold_{readers}", f)

    def tar_index(self, section, t, tar, n_entries):
        """First mount, remount from the saved index, index bytes, server RSS."""
        def f():
            for x in self.index_files(tar):
                os.unlink(x)
            self.rec(section, t.name, "first_mount", self.fresh(t))
            _, hwm = t.stats()
            if hwm is not None:
                self.rec(section, t.name, "first_hwm_mib", hwm)
            t.unmount()
            files = self.index_files(tar)
            if not files:
                raise Failed("no saved index after the first mount")
            size = sum(os.path.getsize(x) for x in files)
            self.rec(section, t.name, "index_bytes_per_entry", size / n_entries)
            self.rec(section, t.name, "remount", self.fresh(t))
            _, hwm = t.stats()
            rss = vm_rss_mib(t.pids)
            if hwm is not None and rss is not None:
                self.rec(section, t.name, "remount_hwm_mib", hwm)
                self.rec(section, t.name, "remount_rss_mib", rss)
                self.rec(section, t.name, "remount_rss_per_entry", rss * 2**20 / n_entries)
        self.guarded(section, t, "index", f)
        drop_caches()
        self.rec(section, "cat tar", "first_mount", self.timed_shell(f"cat {shlex.quote(tar)} "
                                                                     "> /dev/null"))

    # -- the run ---------------------------------------------------------------------------

    def run(self):
        a = self.args
        self.py = VPY if venv_has("torchvision") else sys.executable
        self.imagefolder_kind = ("torchvision.datasets.ImageFolder(root)"
                                 if self.py == VPY else
                                 "torchvision's make_dataset steps (scandir + os.walk + "
                                 "extension check; torchvision not in the bench venv)")
        main = None
        if a.scale_files:
            classes = a.classes_given or classes_for(a.scale_files)
            main = self.dataset(a.scale_files, classes, 400)
            manifest = read_manifest(main["manifest"])
            n = len(manifest)
            ts = self.targets(main, "main")
            paths = os.path.join(self.tmp, "scale-paths.tsv")
            order = list(manifest)
            random.Random(a.seed).shuffle(order)
            write_list(paths, order)
            for run in range(a.runs):
                log(f"=== scale run {run + 1}/{a.runs}: {n} files")
                for t in ts:
                    log(t.name)
                    if "index" in a.scale_workloads and t.name == "archfs tar":
                        self.tar_index("index", t, main["tar"], n + classes)
                    if "meta" in a.scale_workloads:
                        self.walks("main", t, n, paths=paths)
                    if "imagefolder" in a.scale_workloads:
                        self.imagefolder("main", t, n)
                    if "epoch" in a.scale_workloads and any(
                            w in t.name for w in a.scale_epoch_tools.split(",")):
                        self.epochs("main", t, manifest, run)
        for files in a.scale_walk:
            if main and files == a.scale_files:
                continue
            ds = self.dataset(files, classes_for(files), 400)
            log(f"=== walk at {files} files")
            for t in self.targets(ds, f"walk{files}"):
                self.walks(f"walk {files}", t, files, warm=False)
        for entries in a.scale_growth:
            classes = max(1, -(-entries // PER_CLASS))
            ds = self.dataset(entries, classes, 0, plain=False, sqfs=False, keep_manifest=False)
            log(f"=== tar index at {entries} entries")
            t = self.targets(ds, f"growth{entries}")[0]
            for _ in range(a.runs):
                self.tar_index(f"growth {entries}", t, ds["tar"], entries + classes)
            # the growth tars are large and quick to write again
            for x in (ds["tar"], ds["tar"] + ".complete"):
                os.unlink(x)
            for x in self.index_files(ds["tar"]):
                os.unlink(x)
        return main


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def fmt(x, unit=""):
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    return (f"{x:.3g}" if x < 100 else f"{x:.0f}") + unit


def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def ratio_row(tools, res, metric, base="plain dir"):
    b = median_or_last(res.get(base, {}).get(metric))
    cells = []
    for tool in tools:
        v = median_or_last(res.get(tool, {}).get(metric))
        if isinstance(v, (int, float)) and isinstance(b, (int, float)) and b > 0:
            cells.append(f"{fmt(v)} s ({v / b:.2f}×)")
        else:
            cells.append(fmt(v))
    return cells


def report(s, main, args):
    res = s.res
    out = [f"## ImageNet scale: {args.scale_files:,} files, {args.runs} run(s) "
           f"({time.strftime('%Y-%m-%d')})", ""]
    out.append("`sudo scripts/bench " + " ".join(shlex.quote(x) for x in args.argv) + "`. "
               "Cold = page cache dropped and a fresh mount; warm = again on the same mount. "
               "Medians; in brackets the ratio to the plain directory (ext4, same disk).")
    out.append("")
    m = res.get("main", {})
    tools = [t for t in TOOLS if t in m]
    if tools:
        rows = []
        for label, metric in (("`find -type f`, cold", "find_cold"),
                              ("`find -type f`, warm", "find_warm"),
                              ("stat of every file (`find -printf %s`), cold", "stat_cold"),
                              ("stat of every file, warm", "stat_warm"),
                              ("stat of every file by path, no listing, cold", "statpath_cold"),
                              ("stat of every file by path, warm", "statpath_warm"),
                              ("ImageFolder index, cold", "imagefolder_cold"),
                              ("ImageFolder index, warm", "imagefolder_warm")):
            rows.append([label] + ratio_row(tools, m, metric))
        for r in args.readers:
            rows.append([f"first epoch, {r} reader(s): listing, cold"]
                        + ratio_row(tools, m, f"list_cold_{r}"))
            rows.append([f"first epoch, {r} reader(s): reading, cold"]
                        + ratio_row(tools, m, f"epoch_cold_{r}"))
            rows.append([f"epoch, {r} reader(s), warm"] + ratio_row(tools, m, f"epoch_warm_{r}"))
        rows.append(["server peak RSS"]
                    + [fmt(median_or_last(m.get(t, {}).get("srv_hwm_mib")), " MiB")
                       for t in tools])
        out += [table(["workload"] + tools, rows), ""]
        out.append(f"ImageFolder index: {s.imagefolder_kind}. First epoch = that listing on a "
                   "fresh cold mount, then every file opened and read whole, shuffled, dealt "
                   "round-robin to the reader processes.")
        out.append("")
    idx = res.get("index", {}).get("archfs tar")
    growth = sorted((int(k.split()[1]), v["archfs tar"]) for k, v in res.items()
                    if k.startswith("growth ") and "archfs tar" in v)
    cats = {k: v.get("cat tar", {}) for k, v in res.items()}
    if idx or growth:
        rows = []
        pts = ([(args.scale_files, idx, cats.get("index"))] if idx else []) + \
            [(n, v, cats.get(f"growth {n}")) for n, v in growth]
        for n, v, cat in pts:
            rows.append([f"{n:,}" + (" (tiny files)" if v is idx else " (empty)"),
                         fmt(median_or_last(v.get("first_mount")), " s"),
                         fmt(median_or_last((cat or {}).get("first_mount")), " s"),
                         fmt(median_or_last(v.get("remount")), " s"),
                         fmt(median_or_last(v.get("index_bytes_per_entry")), " B"),
                         fmt(median_or_last(v.get("remount_rss_mib")), " MiB"),
                         fmt(median_or_last(v.get("remount_rss_per_entry")), " B"),
                         fmt(median_or_last(v.get("remount_hwm_mib")), " MiB"),
                         fmt(median_or_last(v.get("first_hwm_mib")), " MiB")])
        out += ["#### Tar index: mount time and memory against the number of entries", "",
                table(["members", "first mount (cold)", "`cat tar` (cold)",
                       "remount, saved index (cold)", "index file / entry",
                       "server RSS after remount", "RSS / entry", "peak RSS, remount",
                       "peak RSS, first mount"],
                      rows), ""]
    walks = sorted((int(k.split()[1]), v) for k, v in res.items() if k.startswith("walk "))
    if m:
        walks.append((args.scale_files, m))
    walks.sort(key=lambda x: x[0])
    if len(walks) > 1:
        tools = [t for t in TOOLS if any(t in v for _, v in walks)]
        rows = []
        for n, v in walks:
            rows.append([f"{n:,}"] + [f"{fmt(median_or_last(v.get(t, {}).get('find_cold')))} / "
                                      f"{fmt(median_or_last(v.get(t, {}).get('stat_cold')))}"
                                      for t in tools])
        out += ["#### Metadata walk against the number of files (cold; find s / stat s)", "",
                table(["files"] + tools, rows), ""]
    if s.notes:
        out += ["Notes:", ""] + [f"- {x}" for x in s.notes] + [""]
    return "\n".join(out)


TOOLS = ("archfs tar", "archfs alt tar", "archfs sqfs", "archfs alt sqfs", "squashfuse_ll sqfs",
         "kernel sqfs", "plain dir")


def add_args(ap):
    g = ap.add_argument_group("scale mode (--scale; issue 15)")
    g.add_argument("--scale", action="store_true", help="ImageNet-scale namespace: metadata "
                   "walks, ImageFolder, first epochs, tar index growth")
    g.add_argument("--scale-files", type=int, default=IMAGENET_FILES,
                   help=f"files of the main tree (default {IMAGENET_FILES:,}; 0 skips it)")
    g.add_argument("--scale-workloads", default="index,meta,imagefolder,epoch")
    g.add_argument("--scale-walk", default="10000,100000",
                   help="other file counts for the walk-against-size plot (cold find and stat)")
    g.add_argument("--scale-growth", default="4000000,14000000",
                   help="tar index growth points: tars of this many empty members")
    g.add_argument("--scale-epoch-tools", default="archfs,plain",
                   help="tools that run the first epochs (the kernel driver's cold epoch at "
                   "1.28 M files takes minutes a reader count)")
    g.add_argument("--scale-alt-args", help="archfs options for a second archfs of each "
                   "format, run beside the first as 'archfs alt tar|sqfs' (e.g. --prelist=never)")
    g.add_argument("--plot-dir", help="where PNG plots go (default WORKDIR/plots)")


def main(args):
    args.scale_walk = [int(x) for x in args.scale_walk.split(",") if x.strip()]
    args.scale_growth = [int(x) for x in args.scale_growth.split(",") if x.strip()]
    args.scale_workloads = set(args.scale_workloads.split(","))
    s = Scale(args)
    ensure_venv(argparse_ns_no_torch(args))
    main_ds = s.run()
    md = report(s, main_ds, args)
    print(md)
    out = args.out if args.out != os.path.join(args.workdir, "result.md") else \
        os.path.join(args.workdir, "scale.md")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        f.write(md + "\n")
    jpath = os.path.splitext(out)[0] + ".json"
    with open(jpath, "w") as f:
        json.dump({"argv": args.argv, "results": s.res, "notes": s.notes}, f, indent=1)
    plots.draw(plots.SCALE, jpath, args.plot_dir or os.path.join(args.workdir, "plots"),
               args.scale_files)
    log(f"wrote {out} and {jpath}")


def argparse_ns_no_torch(args):
    """ensure_venv's arguments for a venv without torch (ImageFolder uses torchvision only
    when an earlier bench run installed it)."""
    ns = type("NS", (), {})()
    ns.no_torch, ns.retry_torch, ns.torch_install_timeout = True, False, 0
    return ns
