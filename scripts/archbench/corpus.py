"""The dataset: a tree of JPEG-like files (or real JPEGs), its manifest, and the archives
packed from it (data.tar, SquashFS with gzip and zstd, the compressed tars)."""

import json
import math
import os
import random
import shlex
import shutil
import subprocess

from .constants import MIB, SCRIPT, VPY
from .system import log, sh

# ---------------------------------------------------------------------------------------------
# Dataset, tar and images
# ---------------------------------------------------------------------------------------------


def gen_sizes(n, seed, mean=110 * 1024, sigma=0.5):
    """Log-normal sizes with the given mean (sigma 0.5: ~71% of files under 128 KiB)."""
    rnd = random.Random(seed)
    mu = math.log(mean) - sigma * sigma / 2
    return [int(min(4 * MIB, max(2048, rnd.lognormvariate(mu, sigma)))) for _ in range(n)]


def build_dataset(args, ds):
    src = os.path.join(ds, "src")
    manifest = os.path.join(ds, "files.tsv")
    if os.path.exists(manifest) and os.path.exists(os.path.join(ds, ".src-complete")):
        return src, manifest
    log(f"generating {args.files} files in {args.classes} classes ({'JPEG' if args.jpeg else 'raw'})")
    shutil.rmtree(src, ignore_errors=True)
    sizes = gen_sizes(args.files, args.seed)
    rels = []
    for i in range(args.files):
        c = i % args.classes
        cls = f"n{c:08d}"
        rels.append(f"{cls}/{cls}_{i // args.classes:06d}.JPEG")
    for c in range(args.classes):
        os.makedirs(os.path.join(src, f"n{c:08d}"), exist_ok=True)
    if args.jpeg:
        jobs = [(os.path.join(src, r), s, args.seed * 1000003 + i)
                for i, (r, s) in enumerate(zip(rels, sizes))]
        jf = os.path.join(ds, "jobs.json")
        with open(jf, "w") as f:
            json.dump(jobs, f)
        r = subprocess.run([VPY, SCRIPT, "_genjpeg", jf])
        if r.returncode != 0:
            raise SystemExit("JPEG generation failed (is Pillow in the venv?)")
        os.unlink(jf)
    else:
        # JPEG-like entropy: random bytes with a slightly skewed byte distribution, so that
        # gzip/zstd save ~1.5% and mksquashfs stores blocks compressed, as with real JPEGs.
        table = bytes((b if b >= 16 else 255 - b) for b in range(256))
        for r, s in zip(rels, sizes):
            with open(os.path.join(src, r), "wb") as f:
                f.write(os.urandom(s).translate(table))
    with open(manifest + ".tmp", "w") as f:
        for r in rels:
            f.write(f"{r}\t{os.path.getsize(os.path.join(src, r))}\n")
    os.replace(manifest + ".tmp", manifest)
    open(os.path.join(ds, ".src-complete"), "w").close()
    return src, manifest


def build_artifacts(ds, src, classes, compressed=False, images=("gzip", "zstd")):
    """data.tar, the SquashFS images of `images` (compressors) and, when asked, the
    compressed tars of src, each made once and kept beside it; name -> path."""
    out = {}
    tar = os.path.join(ds, "data.tar")
    if not os.path.exists(tar + ".complete"):
        log("writing data.tar")
        names = sorted(os.listdir(src))
        sh(["tar", "-C", src, "--sort=name", "-cf", tar, *names], check=True)
        open(tar + ".complete", "w").close()
    out["tar"] = tar
    for comp in images:
        img = os.path.join(ds, f"{comp}.sqfs")
        if not os.path.exists(img + ".complete"):
            log(f"mksquashfs -comp {comp}")
            r = sh(["mksquashfs", src, img, "-comp", comp, "-noappend", "-no-progress"])
            if r.returncode != 0:
                raise SystemExit(f"mksquashfs failed: {r.stderr}")
            with open(img + ".log", "w") as f:
                f.write(r.stdout)
            open(img + ".complete", "w").close()
        out[comp] = img
    if compressed:
        # The compressed tars of issue 16, each made by the tool users have for it.
        for name, cmd in COMPRESSED_TARS.items():
            path = tar + name[3:]
            if not os.path.exists(path + ".complete"):
                log(f"compressing data.tar: {cmd}")
                with open(tar, "rb") as i, open(path, "wb") as o:
                    subprocess.run(shlex.split(cmd), stdin=i, stdout=o, check=True)
                open(path + ".complete", "w").close()
            out[name] = path
    return out


# name -> writer (stdin to stdout), and the single-thread decoder the first index is
# measured against.
COMPRESSED_TARS = {
    "tar.gz": "gzip -6 -c",
    "tar.zst": "pzstd -3 -p 2 -c",
    "tar.xz": "xz -T0 -c",
    "tar.bz2": "lbzip2 -n 2 -c",
}
DECODERS = {"tar.gz": "gzip -dc", "tar.zst": "zstd -T1 -dc", "tar.xz": "xz -T1 -dc",
            "tar.bz2": "bzip2 -dc"}


def read_manifest(path):
    with open(path) as f:
        return [(p, int(s)) for p, s in (line.rstrip("\n").split("\t") for line in f)]


def write_list(path, entries):
    with open(path, "w") as f:
        for p, s in entries:
            f.write(f"{p}\t{s}\n")


def zstd_image(args):
    """The bench's dataset as a zstd SquashFS image, made once per dataset; (image path,
    manifest)."""
    key = f"ds-{'jpeg' if args.jpeg else 'raw'}-{args.files}f-{args.classes}c-s{args.seed}"
    ds = os.path.join(args.workdir, key)
    os.makedirs(ds, exist_ok=True)
    src, mpath = build_dataset(args, ds)
    return build_artifacts(ds, src, args.classes)["zstd"], read_manifest(mpath)
