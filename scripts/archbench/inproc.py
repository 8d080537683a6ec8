"""`scripts/bench --inproc`: the in-process reader (issue 32) beside the mount and the plain
directory, side by side in one run.

    sudo scripts/wheel && sudo scripts/bench --inproc          # 10,000 and 1,281,167 files,
                                                              # and 10,000 of 110 KiB
    sudo scripts/bench --inproc --inproc-files 10000 --runs 1

The trees are --scale's (ImageNet's shape, 1-400 byte files: what is measured is the
per-file cost) and one of 10,000 files of 1 B-220 KiB (ImageNet's mean size), as a tar, a
SquashFS image (tar2sqfs, zstd) and the plain directory on the same disk. The wheel from
scripts/wheel is installed into the bench venv, whose Python runs the in-process helpers.

Workloads, each on a fresh mount (or a fresh process) with the page cache dropped (cold)
and again (warm):
- ImageFolder's index: torchvision's `ImageFolder(root)` on the plain directory and on the
  mount, `archfs.torch.ImageFolder(archive)` in process (opening the archive included);
- shuffled epochs with 2 and 4 reader processes, every file read whole once: `open`/`read`
  on the directory and the mount; in process, each reader opens the archive (as a
  DataLoader worker does, each epoch: included in the time) and reads each file by path.
"""

import glob
import json
import os
import platform
import subprocess
import sys
import time

from .constants import SCRIPT, VPY
from .corpus import read_manifest
from .deps import ensure_venv
from .scale import Scale, argparse_ns_no_torch, classes_for, fmt, table
from .stats import median_or_last
from .system import Failed, Timeout, drop_caches, log
from .workloads import read_pass, run_group


# Largest file of the trees: --scale's (what is measured is the per-file cost), and one of
# ImageNet's mean size (110 KiB, where copying the bytes is most of a read; random bytes
# of their own, incompressible as JPEGs are).
TINY, LARGE = 400, 220 << 10


class InProcess:
    """The archive read by archfs.open_archive in the helper processes: nothing mounted."""

    kind = "inproc"

    def __init__(self, name, archive):
        self.name, self.archive = name, archive

    def fresh(self):
        drop_caches()


def install_wheel(args, need=("torch", "torchvision", "PIL")):
    """The wheel from scripts/wheel into the bench venv, and what the helpers import."""
    wheels = sorted(glob.glob(os.path.join(args.inproc_wheel_dir,
                                           f"archfs-*_{platform.machine()}.*whl")))
    if not wheels:
        raise SystemExit(f"no wheel in {args.inproc_wheel_dir}: run scripts/wheel first")
    log(f"pip install {os.path.basename(wheels[-1])} into the bench venv")
    subprocess.run([VPY, "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps",
                    wheels[-1]], check=True)
    for mod in need:
        r = subprocess.run([VPY, "-c", f"import {mod}"], capture_output=True)
        if r.returncode != 0:
            log(f"pip install {mod} into the bench venv")
            pkg = {"PIL": "Pillow"}.get(mod, mod)
            subprocess.run([VPY, "-m", "pip", "install", "-q", pkg], check=True)


class Bench(Scale):
    def targets_for(self, ds, tag):
        ts = [t for t in self.targets(ds, tag)
              if t.name in ("archfs tar", "archfs sqfs", "plain dir")]
        return ts + [InProcess("in-process tar", ds["tar"]),
                     InProcess("in-process sqfs", ds["sqfs"])]

    def index(self, section, t, n):
        def f():
            for p in ("cold", "warm"):
                if p == "cold":
                    t.fresh() if isinstance(t, InProcess) else self.fresh(t)
                if isinstance(t, InProcess):
                    r = subprocess.run([VPY, SCRIPT, "_imagefolder_archive", t.archive],
                                       capture_output=True, text=True, timeout=self.args.cap)
                else:
                    r = subprocess.run([VPY, SCRIPT, "_imagefolder", t.root],
                                       capture_output=True, text=True, timeout=self.args.cap)
                if r.returncode != 0:
                    raise Failed(f"ImageFolder: {r.stderr.strip()[-300:]}")
                o = json.loads(r.stdout.strip().splitlines()[-1])
                if o["images"] != n:
                    raise Failed(f"ImageFolder found {o['images']} images, expected {n}")
                self.rec(section, t.name, f"index_{p}", o["index_s"])
        self.guarded_any(section, t, "index", f)

    def epochs_any(self, section, t, manifest, run):
        n, nbytes = len(manifest), sum(s for _, s in manifest)
        for readers in self.args.readers:
            lf = self.shuffled(manifest, run, readers, "inproc-order.tsv")

            def f(readers=readers):
                for p in ("cold", "warm"):
                    if isinstance(t, InProcess):
                        cmds = [[VPY, SCRIPT, "_read_archive", t.archive, lf, str(i),
                                 str(readers)] for i in range(readers)]
                        wall, outs, _ = run_group(
                            cmds, lambda: time.time() + self.args.cap,
                            t.fresh if p == "cold" else None)
                        got = (sum(o["files"] for o in outs), sum(o["bytes"] for o in outs))
                        bad = [o["first_error"] for o in outs if o["errors"]]
                        if bad or got != (n, nbytes):
                            raise Failed(f"wrong data: {got}, expected {(n, nbytes)}; {bad[:1]}")
                        self.rec(section, t.name, f"open_{p}_{readers}",
                                 max(o["open_s"] for o in outs))
                    else:
                        before = (lambda: self.fresh(t)) if p == "cold" else None
                        wall, _ = read_pass(t.root, lf, readers,
                                            lambda: time.time() + self.args.cap, n, nbytes,
                                            before_go=before)
                    self.rec(section, t.name, f"epoch_{p}_{readers}", wall)
            self.guarded_any(section, t, f"epoch_{readers}", f)

    def guarded_any(self, section, t, what, fn):
        if not isinstance(t, InProcess):
            return self.guarded(section, t, what, fn)
        try:
            fn()
        except (Timeout, subprocess.TimeoutExpired) as e:
            self.note(f"{section}: {t.name}: {what}: over the {self.args.cap:g} s cap ({e})")
            self.rec(section, t.name, what, "timeout")
        except Failed as e:
            self.note(f"{section}: {t.name}: {what}: {e}")
            self.rec(section, t.name, what, "error")

    def run_inproc(self):
        a = self.args
        shapes = [(files, TINY, f"{files} files") for files in a.inproc_files]
        shapes += [(files, LARGE, f"{files} files of 1 B-220 KiB") for files in a.inproc_large]
        for files, max_size, section in shapes:
            classes = classes_for(files)
            ds = self.dataset(files, classes, max_size, unique=max_size == LARGE)
            manifest = read_manifest(ds["manifest"])
            ts = self.targets_for(ds, f"inproc{files}-{max_size}")
            for run in range(a.runs):
                log(f"=== in-process run {run + 1}/{a.runs}: {files} files")
                for t in ts:
                    log(t.name)
                    if "index" in a.inproc_workloads:
                        self.index(section, t, len(manifest))
                    if "epoch" in a.inproc_workloads:
                        self.epochs_any(section, t, manifest, run)
                    if not isinstance(t, InProcess):
                        t.unmount(force=False)


def report(b, args):
    lines = ["# archfs in-process reader, mount and plain directory", "",
             f"`scripts/bench {' '.join(args.argv)}`; {args.runs} run(s), medians. Trees of "
             "1-400 byte files (--scale's shape) unless said; cold = page cache dropped, fresh "
             "mount or process. In process: `archfs.open_archive` in each reader process (its open "
             "counted in the epoch), `archfs.torch.ImageFolder` for the index.", ""]
    for section, tools in b.res.items():
        metrics = sorted({m for t in tools.values() for m in t}, key=order_key)
        names = list(tools)
        rows = []
        for m in metrics:
            rows.append([m] + [fmt(median_or_last(tools[t].get(m, []))) for t in names])
        lines += [f"## {section}", "", table(["seconds"] + names, rows), ""]
        base = tools.get("plain dir", {})
        ratio_rows = []
        for m in metrics:
            if m.startswith("open"):
                continue
            pv = median_or_last(base.get(m, []))
            row = [m]
            for t in names:
                v = median_or_last(tools[t].get(m, []))
                row.append(f"{v / pv:.2f}x" if isinstance(v, float) and isinstance(pv, float)
                           and pv > 0 else "-")
            ratio_rows.append(row)
        lines += ["against the plain directory:", "", table(["ratio"] + names, ratio_rows), ""]
    if b.notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in b.notes] + [""]
    return "\n".join(lines)


def order_key(m):
    return (m.split("_")[0] != "index", m)


def add_args(ap):
    g = ap.add_argument_group("in-process mode (--inproc; issue 32)")
    g.add_argument("--inproc", action="store_true", help="the in-process reader beside the "
                   "mount and the plain directory")
    g.add_argument("--inproc-files", default="10000,1281167")
    g.add_argument("--inproc-large", default="10000", help="file counts of the tree of "
                   "1 B-220 KiB files (ImageNet's mean size); empty for none")
    g.add_argument("--inproc-workloads", default="index,epoch")
    g.add_argument("--inproc-wheel-dir", default=os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        "target", "wheels"), help="where scripts/wheel left the wheel")


def main(args):
    args.inproc_files = [int(x) for x in args.inproc_files.split(",") if x.strip()]
    args.inproc_large = [int(x) for x in args.inproc_large.split(",") if x.strip()]
    args.inproc_workloads = set(args.inproc_workloads.split(","))
    args.readers = [r for r in args.readers if r >= 2] or [2, 4]
    args.tools = args.tools or "archfs,plain"
    ensure_venv(argparse_ns_no_torch(args))
    install_wheel(args)
    b = Bench(args)
    b.run_inproc()
    md = report(b, args)
    print(md)
    out = args.out if args.out != os.path.join(args.workdir, "result.md") else \
        os.path.join(args.workdir, "inproc.md")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        f.write(md + "\n")
    with open(os.path.splitext(out)[0] + ".json", "w") as f:
        json.dump({"argv": args.argv, "results": b.res, "notes": b.notes}, f, indent=1)
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run through scripts/bench --inproc")
