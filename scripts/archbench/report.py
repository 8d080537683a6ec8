"""The markdown report: a table per workload, the ratios archfs / peer, the notes, and the
header with the machine, the dataset and the method."""

import datetime
import json
import os
import shutil
import statistics
import sys

from .constants import VENV, VPY
from .corpus import COMPRESSED_TARS, DECODERS
from .stats import median, median_or_failure
from .system import MEMORY_NOTE, sh_out
from .tools import ShmCopy

# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def save(out, md, data):
    """Prints the report and writes it to `out`, with its figures beside it as JSON
    (`args` made serializable: sets as sorted lists)."""
    print(md)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        f.write(md + "\n")
    data["args"] = {k: (sorted(v) if isinstance(v, set) else v) for k, v in data["args"].items()}
    with open(os.path.splitext(out)[0] + ".json", "w") as f:
        json.dump(data, f, indent=1)


def fnum(x, digits=None):
    if x is None:
        return "—"
    if isinstance(x, str):
        return x
    if digits is None:
        digits = 2 if abs(x) < 10 else 1 if abs(x) < 100 else 0
    return f"{x:.{digits}f}"


def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def report(b, args, info, unavailable):
    R = b.res
    n = len(b.manifest)
    mb = b.total_bytes / 1e6
    targets = b.targets
    lines = []

    def g(t, m):
        return median_or_failure(R[t.name].get(m))

    def unsup_row(t, ncols):
        return [t.name, t.unsupported] + ["—"] * (ncols - 2)

    # -- epochs
    hdr = ["tool"] + [f"{p} {r}r" for p in ("cold", "warm") for r in args.readers]
    rows = []
    for t in targets:
        if t.unsupported:
            rows.append(unsup_row(t, len(hdr)))
            continue
        row = [t.name]
        for p in ("cold", "warm"):
            for r in args.readers:
                v = g(t, f"epoch_{p}_{r}")
                if isinstance(v, (int, float)):
                    row.append(f"{v:.2f} s · {n / v:.0f} f/s · {mb / v:.0f} MB/s")
                else:
                    row.append(fnum(v))
        rows.append(row)
    lines += [f"### Shuffled whole-file epoch ({n} files, {mb:.0f} MB; wall time, files/s, MB/s;"
              f" 1/2/4 reader processes)", "", table(hdr, rows), ""]

    # -- latency, metadata, mount, resources
    hdr = ["tool", "mount s", "mount w/ index s", "read p50/p99 cold ms", "read p50/p99 warm ms",
           "find cold s", "find warm s", "stat cold s", "stat warm s",
           "server CPU s (2r epoch)", "readers CPU s (2r cold)", "server peak RSS MiB"]
    rows = []
    for t in targets:
        if t.unsupported:
            rows.append(unsup_row(t, len(hdr)))
            continue
        mi = g(t, "mount_idx")
        if mi == "no saved index" and g(t, "mount_2nd") is not None:
            mi = f"no saved index (remount {fnum(g(t, 'mount_2nd'))})"
        mount = g(t, "mount")
        if t.kind == "dir" and not isinstance(t, ShmCopy):
            mount = "—"
        rows.append([
            t.name + (" (untar)" if isinstance(t, ShmCopy) else ""),
            fnum(mount), fnum(mi) if t.has_index else "—",
            f"{fnum(g(t, 'lat_cold_p50'))} / {fnum(g(t, 'lat_cold_p99'))}",
            f"{fnum(g(t, 'lat_warm_p50'))} / {fnum(g(t, 'lat_warm_p99'))}",
            fnum(g(t, "find_cold")), fnum(g(t, "find_warm")),
            fnum(g(t, "stat_cold")), fnum(g(t, "stat_warm")),
            fnum(g(t, "srv_cpu_2")) if t.kind == "fuse" else "(in kernel)" if t.kind == "kernel" else "—",
            fnum(g(t, "readers_cpu_cold_2")),
            fnum(max((v for v in R[t.name].get("srv_hwm", []) if isinstance(v, float)),
                     default=None), 0) if t.kind == "fuse" else "—",
        ])
    lines += [f"### Latency ({args.lat_files} random files, 1 process), metadata walk, mount time,"
              " resources", "", table(hdr, rows), ""]

    # -- torch
    if b.torch_ok and "torch" in args.workloads:
        if args.jpeg:
            hdr = ["tool", "ImageFolder index s"] + [f"DataLoader nw={w} {p}"
                                                      for w in args.torch_workers
                                                      for p in ("cold", "warm")]
        else:
            hdr = ["tool", "ImageFolder index s (cold)"]
        rows = []
        for t in targets:
            if t.unsupported:
                rows.append(unsup_row(t, len(hdr)))
                continue
            row = [t.name, fnum(g(t, "imagefolder"))]
            if args.jpeg:
                for w in args.torch_workers:
                    for p in ("cold", "warm"):
                        v = g(t, f"dl_{p}_{w}")
                        row.append(f"{v:.2f} s · {n / v:.0f} img/s" if isinstance(v, (int, float))
                                   else fnum(v))
            rows.append(row)
        title = ("### torchvision ImageFolder + DataLoader (decode + ToTensor, batch 32, shuffle)"
                 if args.jpeg else "### torchvision ImageFolder index construction "
                 "(DataLoader epochs need --jpeg)")
        lines += [title, "", table(hdr, rows), ""]

    # -- ratios
    by = {t.name: t for t in targets}

    def ratio(a, bn, metric, label):
        ta, tb = by.get(a), by.get(bn)
        if not ta or not tb:
            return None
        va = g(ta, metric) if not ta.unsupported else ta.unsupported
        vb = g(tb, metric) if not tb.unsupported else tb.unsupported
        if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and vb > 0:
            return f"- {label}: **{va / vb:.2f}×** ({a} {fnum(va)} s vs {bn} {fnum(vb)} s)"
        return f"- {label}: n/a ({a}: {fnum(va)}, {bn}: {fnum(vb)})"

    rl = []
    for c in ("gzip", "zstd"):
        rl.append(ratio(f"archfs {c}", f"squashfuse_ll {c}", "epoch_cold_2",
                        f"cold epoch, 2 readers, {c}: archfs / squashfuse_ll"))
        rl.append(ratio(f"archfs {c}", f"kernel {c}", "epoch_cold_2",
                        f"cold epoch, 2 readers, {c}: archfs / kernel"))
    for c in ("gzip", "zstd"):
        rl.append(ratio(f"archfs {c}", "plain dir", "epoch_warm_2",
                        f"warm epoch, 2 readers, {c}: archfs / plain directory"))
        rl.append(ratio(f"archfs {c}", f"squashfuse {c}", "epoch_warm_2",
                        f"warm epoch, 2 readers, {c}: archfs / squashfuse"))
        rl.append(ratio(f"archfs {c}", f"squashfuse_ll {c}", "epoch_warm_2",
                        f"warm epoch, 2 readers, {c}: archfs / squashfuse_ll"))
    for c in ("gzip", "zstd"):
        rl.append(ratio(f"archfs {c}", f"kernel {c}", "find_cold",
                        f"metadata walk (find, cold), {c}: archfs / kernel"))
        rl.append(ratio(f"archfs {c}", f"kernel {c}", "stat_cold",
                        f"stat of every file (cold), {c}: archfs / kernel"))
        rl.append(ratio(f"archfs {c}", f"kernel {c}", "imagefolder",
                        f"ImageFolder index (cold), {c}: archfs / kernel"))
    for c in ("gzip", "zstd"):
        rl.append(ratio(f"archfs nopreload {c}", f"squashfuse_ll {c}", "epoch_cold_2",
                        f"cold epoch, 2 readers, {c}: archfs --preload=never / squashfuse_ll"))
        rl.append(ratio(f"archfs nopreload {c}", f"kernel {c}", "epoch_cold_2",
                        f"cold epoch, 2 readers, {c}: archfs --preload=never / kernel"))
    rl.append(ratio("archfs tar", "ratarmount tar", "epoch_cold_2",
                    "tar, cold epoch, 2 readers: archfs / ratarmount"))
    rl.append(ratio("archfs nopreload tar", "ratarmount tar", "epoch_cold_2",
                    "tar, cold epoch, 2 readers: archfs --preload=never / ratarmount"))
    rl.append(ratio("archfs tar", "ratarmount tar", "epoch_warm_2",
                    "tar, warm epoch, 2 readers: archfs / ratarmount"))
    rl.append(ratio("archfs tar", "ratarmount tar", "stat_cold",
                    "tar, stat of every file (cold): archfs / ratarmount"))
    at = by.get("archfs tar")
    if at and not at.unsupported and g(at, "mount_idx") == "no saved index":
        rl.append(ratio("archfs tar", "ratarmount tar", "mount",
                        "tar mount: archfs (no saved index, full scan) / ratarmount without index"))
        mr = by.get("ratarmount tar")
        va, vb = g(at, "mount_2nd"), g(mr, "mount_idx") if mr else None
        if isinstance(va, (int, float)) and isinstance(vb, (int, float)):
            rl.append(f"- tar remount: archfs (rescan, no saved index) / ratarmount with index: "
                      f"**{va / vb:.2f}×** ({fnum(va)} s vs {fnum(vb)} s)")
    else:
        rl.append(ratio("archfs tar", "ratarmount tar", "mount_idx",
                        "tar mount with saved index: archfs / ratarmount"))
        rl.append(ratio("archfs tar", "ratarmount tar", "mount",
                        "tar mount without index: archfs / ratarmount"))
    for c, path in sorted(b.streams.items()):
        st = median_or_failure(path)
        ep = g(by[f"archfs {c}"], "epoch_cold_2") if f"archfs {c}" in by else None
        if isinstance(st, (int, float)) and isinstance(ep, (int, float)):
            rl.append(f"- cold epoch, 2 readers, {c}: archfs / streaming the archive once "
                      f"(`cat > /dev/null`, cold): **{ep / st:.2f}×** ({fnum(ep)} s vs "
                      f"{fnum(st)} s)")
    for c in COMPRESSED_TARS:
        t = by.get(f"archfs {c}")
        if not t or t.unsupported:
            continue
        rl.append(ratio(f"archfs {c}", "archfs tar", "epoch_cold_2",
                        f"cold epoch, 2 readers: archfs {c} / archfs on the plain tar"))
        rl.append(ratio(f"archfs {c}", f"ratarmount {c}", "epoch_cold_2",
                        f"cold epoch, 2 readers, {c}: archfs / ratarmount"))
        dec, mount = median_or_failure(b.streams.get(f"{c} decode", [])), g(t, "mount")
        if isinstance(dec, (int, float)) and isinstance(mount, (int, float)):
            rl.append(f"- {c} first mount (index and entry points, cold) / `{DECODERS[c]} > "
                      f"/dev/null` (cold): **{mount / dec:.2f}×** ({fnum(mount)} s vs "
                      f"{fnum(dec)} s)")
        size = sum(os.path.getsize(f) for f in t.index_files if os.path.isfile(f))
        if size:
            rl.append(f"- {c} saved index: {size / 2**20:.1f} MiB, "
                      f"{100 * size / os.path.getsize(t.source):.2f}% of the archive; remount "
                      f"{fnum(g(t, 'mount_idx'))} s")
    lines += ["### Ratios archfs / peer (time; below 1 = archfs faster)", ""]
    lines += [x for x in rl if x] + [""]

    notes = []
    notes += [f"- {u}" for u in unavailable]
    notes += [f"- {x}" for x in b.notes]
    if notes:
        lines += ["### Unavailable, failed, timed out", ""] + notes + [""]

    body = "\n".join(lines)
    head = [f"## archfs benchmark, {info['date']}", "", "```", info["machine"], "```", "",
            info["dataset"], "", info["method"], ""]
    return "\n".join(head) + "\n" + body


def first_line_with(text, word):
    return next((x for x in text.splitlines() if word in x), text.splitlines()[0] if text else "?")


def machine_info(args, archfs_bin, paths, manifest, torch_ok):
    cpu = "?"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    commit = sh_out(["git", "-C", args.archfs_src, "log", "-1", "--format=%h %s"]) \
        if os.path.isdir(args.archfs_src) else "?"
    sqf_ver = sh_out("dpkg-query -W -f '${Version}' squashfuse")
    torch_ver = sh_out([VPY, "-c", "import importlib.metadata as m; "
                        "print(m.version('torch'), '/ torchvision', m.version('torchvision'))"])
    versions = [
        f"archfs: {sh_out([archfs_bin, '--version'])} ({archfs_bin}; {args.archfs_src} at {commit})",
        f"squashfuse / squashfuse_ll: Debian package {sqf_ver}",
        f"ratarmount: {sh_out([os.path.join(VENV, 'bin', 'ratarmount'), '--version']).splitlines()[0]}",
        f"archivemount: {first_line_with(sh_out(['archivemount', '--version']), 'archivemount') if shutil.which('archivemount') else 'not installed'}",
        f"fuse-archive: {sh_out(['fuse-archive', '--version']).splitlines()[0] if shutil.which('fuse-archive') else 'not installed'}",
        f"mksquashfs: {sh_out(['mksquashfs', '-version']).splitlines()[0]}",
        f"fuse3: {sh_out(['fusermount3', '--version'])}",
        f"python: {sys.version.split()[0]}"
        + (f", torch {torch_ver}" if torch_ok else ""),
    ] + [f"memory: {m}" for m in MEMORY_NOTE]
    machine = "\n".join([
        f"date:    {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"cpu:     {cpu}, nproc {os.cpu_count()}",
        f"kernel:  {os.uname().release}",
        "free -g:", sh_out(["free", "-g"]),
        *versions,
    ])
    sizes = [s for _, s in manifest]
    total = sum(sizes)
    under = sum(1 for s in sizes if s < 128 * 1024)

    def sz(p):
        return os.path.getsize(p) / 1e6
    dataset = (f"Dataset: {len(sizes)} files in {args.classes} class directories "
               f"({'noise JPEGs, decodable' if args.jpeg else 'JPEG-like random bytes'}), "
               f"{total / 1e6:.0f} MB, mean {statistics.mean(sizes) / 1024:.0f} KiB, "
               f"median {median(sizes) / 1024:.0f} KiB, {100 * under / len(sizes):.0f}% "
               f"under 128 KiB. data.tar {sz(paths['tar']):.0f} MB; "
               f"`mksquashfs src img -comp gzip` {sz(paths['gzip']):.0f} MB; "
               f"`-comp zstd` {sz(paths['zstd']):.0f} MB.")
    method = (f"Medians of {args.runs} run(s); cap {args.cap:g} s per tool × workload × pass. "
              "Cold = the reader processes start, then `sync; echo 3 > /proc/sys/vm/drop_caches` "
              "and a fresh mount, and the clock starts as the mount is live; warm = a "
              "second pass (new shuffle) on the same mount. Readers: separate processes, "
              "os.open + readv(4 MiB) to EOF, file sizes checked; the shuffled list is dealt "
              "round-robin to the readers; wall time from a common start. MB = 10^6 bytes. "
              "archfs rows use the default --preload=auto; `archfs nopreload` rows the same "
              "mounts with --preload=never. "
              "Server CPU = utime+stime of the FUSE server over the 2-reader epoch mount "
              "(cold + warm pass); peak RSS = VmHWM, max over mounts. /dev/shm: 'mount s' is the "
              "untar time from a cold tar; its files stay in RAM, so cold = warm there.")
    return {"date": datetime.date.today().isoformat(), "machine": machine, "dataset": dataset,
            "method": method}
