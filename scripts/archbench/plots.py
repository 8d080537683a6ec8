"""Plots `scripts/bench` draws of its own results (matplotlib, in the bench venv): the
epoch time of every tool, cold and warm, and in --scale mode the metadata walk against the
number of files, the tar index against the number of entries, and the first epochs."""

import subprocess
import os

from .constants import SCRIPT, VPY
from .deps import venv_has
from .system import log

EPOCH = r'''
import json, sys
sys.path.insert(0, sys.argv[4])  # scripts/, for the bench's one median
from archbench.stats import median_of_numbers
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
doc, outdir = json.load(open(sys.argv[1])), sys.argv[2]
res = doc["results"]
rs = sorted({int(k.rsplit("_", 1)[1]) for v in res.values() for k in v
             if k.startswith("epoch_cold_")})
tools = [t for t in res if any(median_of_numbers(res[t].get(f"epoch_cold_{r}")) for r in rs)]
if tools and rs:
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.9 + 0.32 * len(tools) * len(rs) / 2 + 2))
    for ax, p in ((axes[0], "cold"), (axes[1], "warm")):
        h = 0.8 / len(rs)
        for j, r in enumerate(rs):
            ys = [median_of_numbers(res[t].get(f"epoch_{p}_{r}")) or 0 for t in tools]
            ax.barh([i + j * h for i in range(len(tools))], ys, h, label=f"{r} reader(s)")
        ax.set_yticks([i + 0.4 - h / 2 for i in range(len(tools))], tools)
        ax.invert_yaxis()
        ax.set_xlabel("seconds (lower is better)"); ax.grid(axis="x", alpha=0.3)
        ax.set_title(f"shuffled epoch, {p}")
    axes[1].set_yticks([])
    axes[0].legend()
    fig.tight_layout(); fig.savefig(f"{outdir}/epoch.png", dpi=90)
'''

SCALE = r'''
import json, sys
sys.path.insert(0, sys.argv[4])  # scripts/, for the bench's one median
from archbench.stats import median_of_numbers
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
COLORS = {"archfs tar": "tab:blue", "archfs sqfs": "tab:orange", "squashfuse_ll sqfs": "tab:purple",
          "kernel sqfs": "tab:green", "plain dir": "tab:red"}
res, outdir, files = json.load(open(sys.argv[1]))["results"], sys.argv[2], int(sys.argv[3])
walks = {int(k.split()[1]): v for k, v in res.items() if k.startswith("walk ")}
if "main" in res:
    walks[files] = res["main"]
if len(walks) > 1:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric, title in ((axes[0], "find_cold", "find -type f (cold)"),
                              (axes[1], "stat_cold", "stat of every file (cold)")):
        for tool in ("archfs tar", "archfs sqfs", "squashfuse_ll sqfs", "kernel sqfs", "plain dir"):
            pts = [(n, median_of_numbers(v.get(tool, {}).get(metric)))
                   for n, v in sorted(walks.items())]
            pts = [(n, y) for n, y in pts if y]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=tool, color=COLORS[tool])
        ax.set_xscale("log"); ax.set_yscale("log")
        ax.set_xlabel("files"); ax.set_ylabel("seconds"); ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    fig.tight_layout(); fig.savefig(f"{outdir}/scale-walk.png", dpi=90)
growth = {int(k.split()[1]): v["archfs tar"] for k, v in res.items()
          if k.startswith("growth ") and "archfs tar" in v}
if "index" in res and "archfs tar" in res["index"]:
    growth[files] = res["index"]["archfs tar"]
if len(growth) > 1:
    ns = sorted(growth)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("first_mount", "first mount"), ("remount", "remount, saved index")):
        axes[0].plot([n / 1e6 for n in ns], [median_of_numbers(growth[n].get(key)) for n in ns],
                     marker="o", label=label)
    axes[0].set_xlabel("million entries"); axes[0].set_ylabel("seconds (cold)")
    axes[0].set_title("tar index: mount time"); axes[0].legend(); axes[0].grid(alpha=0.3)
    axes[1].plot([n / 1e6 for n in ns],
                 [median_of_numbers(growth[n].get("remount_rss_mib")
                                    or growth[n].get("remount_hwm_mib")) for n in ns],
                 marker="o", label="server RSS after remount")
    axes[1].plot([n / 1e6 for n in ns],
                 [median_of_numbers(growth[n].get("index_bytes_per_entry")) * n / 2**20
                  for n in ns],
                 marker="o", label="index file")
    axes[1].set_xlabel("million entries"); axes[1].set_ylabel("MiB")
    axes[1].set_title("tar index: memory and file size"); axes[1].legend(); axes[1].grid(alpha=0.3)
    fig.tight_layout(); fig.savefig(f"{outdir}/scale-index.png", dpi=90)
m = res.get("main", {})
tools = [t for t in ("archfs tar", "archfs sqfs", "squashfuse_ll sqfs", "kernel sqfs", "plain dir") if t in m]
tools = [t for t in tools if any(k.startswith("epoch_cold_") for k in m[t])]
rs = sorted({int(k.rsplit("_", 1)[1]) for v in m.values() for k in v if k.startswith("epoch_cold_")})
if tools and rs:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    w = 0.8 / len(tools)
    for ax, p in ((axes[0], "cold"), (axes[1], "warm")):
        for i, tool in enumerate(tools):
            ys = [(median_of_numbers(m[tool].get(f"epoch_{p}_{r}")) or 0)
                  + ((median_of_numbers(m[tool].get(f"list_cold_{r}")) or 0) if p == "cold" else 0)
                  for r in rs]
            ax.bar([j + i * w for j in range(len(rs))], ys, w, label=tool, color=COLORS[tool])
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(rs))], [f"{r} readers" for r in rs])
        ax.set_ylabel("seconds"); ax.grid(axis="y", alpha=0.3)
        ax.set_title(f"{files:,} files: {'first epoch (listing + reads), cold' if p == 'cold' else 'epoch, warm'}")
    axes[0].legend()
    fig.tight_layout(); fig.savefig(f"{outdir}/scale-epoch.png", dpi=90)
'''


def draw(script, json_path, outdir, files=0):
    """Runs one of the plot scripts above with the bench venv's matplotlib."""
    if not venv_has("matplotlib"):
        log("pip install matplotlib (bench venv)")
        subprocess.run([VPY, "-m", "pip", "install", "-q", "matplotlib"])
    os.makedirs(outdir, exist_ok=True)
    r = subprocess.run([VPY, "-c", script, json_path, outdir, str(files),
                        os.path.dirname(SCRIPT)], capture_output=True, text=True)
    if r.returncode != 0:
        log(f"plots failed: {r.stderr.strip()[-300:]}")
    else:
        log(f"plots in {outdir}")
