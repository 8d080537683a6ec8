"""The command line and the orchestration of a run: the flags, the dataset and archives, the
tools chosen, the run, then the report, the JSON and the plots."""

import argparse
import atexit
import os
import shlex
import shutil
import signal
import time

from . import inproc, inproc_remote, nodes, plots, ranks, remote, scale, shards
from .constants import SCRIPT, TARGET_DIR, VENV, WORKTREE
from .corpus import COMPRESSED_TARS, build_artifacts, build_dataset, read_manifest
from .deps import ensure_debian_peers, ensure_venv
from .report import machine_info, report, save
from .system import (REG, T_START, Failed, Timeout, force_unmount, hold_guest_memory, log,
                     mounted_paths, sh_out)
from .tools import (Archfs, Archivemount, FuseArchive, Kernel, PlainDir, Ratarmount, ShmCopy,
                    Squashfuse, find_archfs, preflight)
from .workloads import Bench

# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def parse_args(argv, usage):
    """The flags; USAGE (the package's docstring) is --help's text."""
    ap = argparse.ArgumentParser(description=usage.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=usage.split("\n\n", 1)[1])
    ap.add_argument("--files", type=int, help="number of files (default 20000; --quick: 2000)")
    ap.add_argument("--classes", type=int, help="class directories (default: files / 1000, at least 10)")
    ap.add_argument("--quick", action="store_true", help="2,000 files, 30 s cap, 200 latency samples")
    ap.add_argument("--jpeg", action="store_true", help="real decodable JPEGs (Pillow) for torch")
    ap.add_argument("--runs", type=int, help="default 3; --remote, --shards: 1")
    ap.add_argument("--no-list-first", dest="list_first", action="store_false",
                    help="cold epochs without the untimed listing of the tree that precedes "
                    "them by default (as ImageFolder's index precedes a first epoch); the "
                    "runs before 2026-11-25 had none")
    ap.add_argument("--cap", type=float, help="seconds per tool x workload pass, cold or warm "
                    "(default 300; --quick, --remote 30); a torch call gets it once per epoch "
                    "and once for ImageFolder")
    ap.add_argument("--workdir", default="/tmp/archfs-bench")
    ap.add_argument("--out", help="markdown report (default WORKDIR/result.md); JSON next to it")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--readers", default="1,2,4", help="reader process counts (default 1,2,4)")
    ap.add_argument("--torch-workers", default="2,4", help="DataLoader num_workers (default "
                    "2,4; empty: the ImageFolder index alone)")
    ap.add_argument("--lat-files", type=int, help="files for the latency workload (default 500)")
    ap.add_argument("--tools", help="comma-separated substrings of tool names to run "
                    "(archfs, squashfuse, squashfuse_ll, kernel, ratarmount, archivemount, "
                    "fuse-archive, plain, shm; 'gzip', 'zstd', 'tar' match variants; naming "
                    "'tar.gz', 'tar.zst', 'tar.xz' or 'tar.bz2' adds the compressed tars)")
    ap.add_argument("--workloads", default="mount,stream,epoch,latency,meta,torch")
    ap.add_argument("--archfs", help="archfs binary (default: "
                    f"{TARGET_DIR}/release/archfs, else REPO/target/release/archfs, else PATH)")
    ap.add_argument("--archfs-src", help="checkout the binary was built from (default: "
                    f"{WORKTREE} if it exists, else this repository)")
    ap.add_argument("--archfs-alt", help="a second archfs binary, e.g. the wheel's, run beside "
                    "the first as 'archfs alt gzip|zstd|tar'")
    ap.add_argument("--archfs-args", default="", help="extra `archfs mount` options, e.g. "
                    "'--cache-size 512M --threads 8'")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("-v", "--verbose", action="store_true", help="log each workload's duration")
    ap.add_argument("--retry-torch", action="store_true", help="retry a failed torch install")
    ap.add_argument("--torch-install-timeout", type=int, default=1200)
    scale.add_args(ap)
    remote.add_args(ap)
    shards.add_args(ap)
    inproc.add_args(ap)
    inproc_remote.add_args(ap)
    ranks.add_args(ap)
    nodes.add_args(ap)
    args = ap.parse_args(argv)
    args.argv = argv
    args.files = args.files or (1_281_167 if args.inproc_remote and args.ir_scale else
                                10000 if args.inproc_remote else
                                1000 if args.remote or (args.nodes and args.quick) else
                                5000 if args.ranks or args.nodes else
                                2000 if args.quick else 20000)
    args.runs = args.runs or (1 if args.remote or args.shards or args.inproc or
                              args.inproc_remote else 3)
    args.classes_given = args.classes
    args.classes = args.classes or max(10, args.files // 1000)
    args.cap = args.cap or (600 if args.inproc_remote else
                            30 if args.quick or args.remote else
                            900 if args.scale or args.inproc else 300)
    args.lat_files = args.lat_files or (200 if args.quick else 500)
    args.readers = [int(x) for x in args.readers.split(",")]
    args.torch_workers = [int(x) for x in args.torch_workers.split(",") if x.strip()]
    args.workloads = set(args.workloads.split(","))
    args.archfs_src = args.archfs_src or (
        WORKTREE if os.path.isdir(WORKTREE) else os.path.dirname(os.path.dirname(SCRIPT)))
    args.workdir = os.path.abspath(args.workdir)
    args.out = os.path.abspath(args.out or os.path.join(
        args.workdir, "inproc-remote.md" if args.inproc_remote else
        "remote-result.md" if args.remote else
        "shards-result.md" if args.shards else "result.md"))
    return args


def main(argv, usage):
    args = parse_args(argv, usage)
    if os.geteuid() != 0:
        raise SystemExit("run as root: cold runs need /proc/sys/vm/drop_caches, the kernel "
                         "driver needs mount -o loop")
    os.makedirs(args.workdir, exist_ok=True)
    mntdir = os.path.join(args.workdir, "mnt")
    os.makedirs(mntdir, exist_ok=True)
    # a previous run that died: lazy-unmount whatever it left under our mount directory
    for mp in mounted_paths():
        if mp.startswith(mntdir + "/"):
            log(f"stale mount {mp}: unmounting")
            force_unmount(mp)

    atexit.register(REG.cleanup)
    hold_guest_memory()

    def on_signal(signum, frame):
        raise SystemExit(128 + signum)
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, on_signal)
    if args.inproc_remote:
        inproc_remote.main(args)
        return
    if args.inproc:
        inproc.main(args)
        return
    if args.ranks:
        ranks.main(args)
        return
    if args.nodes:
        nodes.main(args)
        return
    if args.scale:
        scale.main(args)
        return
    if args.remote:
        remote.main(args)
        return
    if args.shards:
        shards.main(args)
        return

    archfs_bin = find_archfs(args)
    ensure_debian_peers()
    torch_ok, torch_reason = ensure_venv(args)
    unavailable = []
    if torch_reason:
        unavailable.append(torch_reason)
    if torch_ok and "torch" in args.workloads and not args.jpeg:
        unavailable.append("DataLoader epochs skipped: they need decodable images (--jpeg); "
                           "ImageFolder index time measured")

    key = f"ds-{'jpeg' if args.jpeg else 'raw'}-{args.files}f-{args.classes}c-s{args.seed}"
    ds = os.path.join(args.workdir, key)
    os.makedirs(ds, exist_ok=True)
    src, mpath = build_dataset(args, ds)
    # The compressed tars take a few minutes to make and xz/bzip2 a minute a pass to read:
    # only when --tools names them.
    want_compressed = bool(args.tools) and any(
        x in args.tools for x in (".gz", ".zst", ".xz", ".bz2", "tar."))
    paths = build_artifacts(ds, src, args.classes, compressed=want_compressed)
    manifest = read_manifest(mpath)
    REG.images += [paths["gzip"], paths["zstd"]]

    cap = args.cap
    extra = shlex.split(args.archfs_args)

    def M(name):
        return os.path.join(mntdir, name.replace(" ", "-"))
    targets = []
    for c in ("gzip", "zstd"):
        targets.append(Archfs(f"archfs {c}", paths[c], M(f"archfs-{c}"), cap, archfs_bin, extra))
    at = Archfs("archfs tar", paths["tar"], M("archfs-tar"), cap, archfs_bin, extra)
    at.has_index = True
    targets.append(at)
    for name in COMPRESSED_TARS:
        if name in paths:
            ct = Archfs(f"archfs {name}", paths[name], M(f"archfs-{name}"), cap, archfs_bin,
                        extra)
            ct.has_index = True
            targets.append(ct)
    if args.archfs_alt:
        for c in ("gzip", "zstd", "tar"):
            alt = Archfs(f"archfs alt {c}", paths[c], M(f"archfs-alt-{c}"), cap, args.archfs_alt,
                         extra)
            alt.has_index = c == "tar"
            targets.append(alt)
    # What the default --preload=auto buys: the same mounts without it.
    if not any(a.startswith("--preload") for a in extra):
        for c in ("gzip", "zstd", "tar") + tuple(n for n in COMPRESSED_TARS if n in paths):
            targets.append(Archfs(f"archfs nopreload {c}", paths[c], M(f"archfs-nopreload-{c}"),
                                  cap, archfs_bin, extra + ["--preload=never"]))
    for exe in ("squashfuse", "squashfuse_ll"):
        for c in ("gzip", "zstd"):
            if shutil.which(exe):
                targets.append(Squashfuse(f"{exe} {c}", paths[c], M(f"{exe}-{c}"), cap, exe))
            elif c == "gzip":
                unavailable.append(f"{exe}: not installed (apt install squashfuse)")
    for c in ("gzip", "zstd"):
        targets.append(Kernel(f"kernel {c}", paths[c], M(f"kernel-{c}"), cap))
    if os.path.exists(os.path.join(VENV, "bin", "ratarmount")):
        targets.append(Ratarmount("ratarmount tar", paths["tar"], M("ratarmount"), cap))
        if "tar.gz" in paths:
            targets.append(Ratarmount("ratarmount tar.gz", paths["tar.gz"], M("ratarmount-gz"),
                                      cap))
    else:
        unavailable.append("ratarmount: pip install failed")
    for exe, cls in (("fuse-archive", FuseArchive), ("archivemount", Archivemount)):
        if shutil.which(exe):
            targets.append(cls(f"{exe} tar", paths["tar"], M(exe), cap))
        else:
            pol = sh_out(["apt-cache", "policy", exe])
            why = "no Debian package for this release" if "Candidate" not in pol else \
                f"not installed (apt-get install {exe})"
            unavailable.append(f"{exe}: {why}")
    targets.append(PlainDir("plain dir", src, M("plain"), cap))
    targets.append(ShmCopy("/dev/shm", paths["tar"], M("shm"), cap,
                           f"/dev/shm/archfs-bench-{key}"))
    if args.tools:
        want = [w.strip() for w in args.tools.split(",") if w.strip()]

        def chosen(t):
            for w in want:
                if w == "squashfuse":
                    if t.name.startswith("squashfuse ") or t.name == "squashfuse":
                        return True
                elif w in t.name or (w == "shm" and isinstance(t, ShmCopy)):
                    return True
            return False
        targets = [t for t in targets if chosen(t)]
    REG.targets = targets

    log(f"preflight: {len(targets)} targets, {len(manifest)} files")
    for t in targets:
        try:
            preflight(t, src, manifest, cap)
            if isinstance(t, Archfs) and t.has_index:
                log(f"  {t.name}: saved index files: {t.index_files or 'none'}")
        except (Timeout, Failed, OSError) as e:
            if t.name == "archfs tar":
                t.unsupported = "archfs tar: not supported by this build"
                unavailable.append(f"archfs tar: not supported by this build ({e})")
            else:
                t.unsupported = f"preflight failed: {e}"
                unavailable.append(f"{t.name}: preflight failed: {e}")
            log(f"  {t.name}: {t.unsupported}")

    b = Bench(args, targets, manifest, torch_ok, paths)
    b.run()
    info = machine_info(args, archfs_bin, paths, manifest, torch_ok)
    save(args.out, report(b, args, info, unavailable),
         {"args": vars(args), "results": b.res, "streams": b.streams, "notes": b.notes,
          "unavailable": unavailable})
    plots.draw(plots.EPOCH, os.path.splitext(args.out)[0] + ".json",
               args.plot_dir or os.path.join(args.workdir, "plots"))
    log(f"wrote {args.out} in {time.time() - T_START:.0f} s")


def run(argv, usage):
    """A benchmark run; everything mounted or started is undone on the way out. USAGE is
    --help's text."""
    try:
        main(argv, usage)
    finally:
        REG.cleanup()
