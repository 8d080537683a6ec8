"""The helper modes, each run as a separate process (`bench _read ...`): the readers, the stat
walk, the torch server, the JPEG generator and ImageFolder's index (--scale)."""

import importlib
import json
import math
import multiprocessing
import os
import random
import signal
import statistics
import sys
import time

from .constants import MIB

# ---------------------------------------------------------------------------------------------
# Helper modes: run as separate processes (`bench _read ...`), before any argument parsing.
# ---------------------------------------------------------------------------------------------


def default_signals():
    """In a pool's worker: signals as by default. The bench's handler (SystemExit), copied
    by the fork, made a worker that Pool.terminate signalled clean up, and one hung there
    on a lock its sibling had died holding (the bench waited for it 7 minutes)."""
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_DFL)


def in_processes(fn, jobs, ordered=False, chunk=1):
    """fn over jobs in a process a core; results in order when asked. The workers are let
    finish (close, join), not terminated, once every result is in."""
    pool = multiprocessing.get_context("fork").Pool(os.cpu_count(), default_signals)
    try:
        it = pool.imap(fn, jobs, 4) if ordered else pool.imap_unordered(fn, jobs, chunk)
        yield from it
        pool.close()
        pool.join()
    finally:
        pool.terminate()


def helper_read(argv):
    """_read ROOT LIST START STEP [LATFILE]: read files START::STEP of LIST whole, after 'go'."""
    root, listfile, start, step = argv[0], argv[1], int(argv[2]), int(argv[3])
    latfile = argv[4] if len(argv) > 4 else None
    with open(listfile) as f:
        entries = [line.rstrip("\n").split("\t") for line in f][start::step]
    paths = [(os.path.join(root, p), int(s)) for p, s in entries]
    buf = bytearray(4 * MIB)
    mv = memoryview(buf)
    lats = []
    errors = mismatched = total = 0
    first_error = None
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    sys.stdin.readline()
    t0 = time.perf_counter()
    for p, size in paths:
        t = time.perf_counter()
        try:
            fd = os.open(p, os.O_RDONLY)
            try:
                n = 0
                while True:
                    k = os.readv(fd, [mv])
                    if k == 0:
                        break
                    n += k
            finally:
                os.close(fd)
            total += n
            if n != size:
                mismatched += 1
                if first_error is None:
                    first_error = f"{p}: read {n} bytes, expected {size}"
        except OSError as e:
            errors += 1
            if first_error is None:
                first_error = f"{p}: {e}"
        if latfile:
            lats.append(time.perf_counter() - t)
    elapsed = time.perf_counter() - t0
    if latfile:
        with open(latfile, "w") as f:
            f.write("\n".join(f"{x:.9f}" for x in lats))
    print(json.dumps({"files": len(paths), "bytes": total, "errors": errors,
                      "mismatched": mismatched, "first_error": first_error, "elapsed": elapsed}))


def helper_stat(argv):
    """_stat ROOT LIST: os.stat every file of LIST in order, check sizes."""
    root, listfile = argv[0], argv[1]
    with open(listfile) as f:
        entries = [line.rstrip("\n").split("\t") for line in f]
    paths = [(os.path.join(root, p), int(s)) for p, s in entries]
    errors = 0
    first_error = None
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    sys.stdin.readline()
    t0 = time.perf_counter()
    for p, size in paths:
        try:
            st = os.stat(p)
            if st.st_size != size:
                errors += 1
                first_error = first_error or f"{p}: size {st.st_size}, expected {size}"
        except OSError as e:
            errors += 1
            first_error = first_error or f"{p}: {e}"
    print(json.dumps({"files": len(paths), "errors": errors, "first_error": first_error,
                      "elapsed": time.perf_counter() - t0}))


def _collate(batch):
    return batch


def helper_torch(argv):
    """_torch: a server (venv python). Imports torch once, prints 'ready', then answers one
    JSON request per line {"root", "workers", "epochs"}: ImageFolder index time, then
    DataLoader epochs (decode + ToTensor, batch 32, shuffled)."""
    import torch
    from torch.utils.data import DataLoader
    from torchvision import datasets, transforms
    # ImageFolder's loader, imported before anything is timed.
    importlib.import_module("PIL.Image")
    torch.set_num_threads(1)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    for line in sys.stdin:
        req = json.loads(line)
        try:
            t0 = time.perf_counter()
            ds = datasets.ImageFolder(req["root"], transform=transforms.ToTensor())
            out = {"index_s": time.perf_counter() - t0, "images": len(ds),
                   "classes": len(ds.classes), "epochs": []}
            if req["epochs"]:
                dl = DataLoader(ds, batch_size=32, shuffle=True, num_workers=req["workers"],
                                collate_fn=_collate)
                for _ in range(req["epochs"]):
                    t0 = time.perf_counter()
                    n = 0
                    for batch in dl:
                        n += len(batch)
                    out["epochs"].append(time.perf_counter() - t0)
                    if n != len(ds):
                        out["error"] = f"epoch yielded {n} of {len(ds)} images"
                del dl
            del ds
        except Exception as e:  # noqa: BLE001
            out = {"error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


def _gen_jpeg_one(job):
    import io
    from PIL import Image
    path, target, bpp, seed = job
    rnd = random.Random(seed)
    px = max(64 * 64, target / bpp)
    aspect = rnd.uniform(0.75, 1.33)
    w = max(32, int(math.sqrt(px * aspect)) // 2 * 2)
    h = max(32, int(px / w) // 2 * 2)
    im = Image.frombytes("RGB", (w // 2, h // 2), rnd.randbytes((w // 2) * (h // 2) * 3))
    im = im.resize((w, h), Image.BILINEAR)
    b = io.BytesIO()
    im.save(b, "JPEG", quality=85)
    with open(path, "wb") as f:
        f.write(b.getvalue())


def helper_genjpeg(argv):
    """_genjpeg JOBSFILE: write noise JPEGs (half-resolution noise, upscaled, quality 85)."""
    import io
    from PIL import Image
    with open(argv[0]) as f:
        jobs = json.load(f)
    # calibrate bytes per pixel of this generator
    rnd = random.Random(1)
    sizes = []
    for _ in range(4):
        w, h = 500, 420
        im = Image.frombytes("RGB", (w // 2, h // 2), rnd.randbytes((w // 2) * (h // 2) * 3))
        b = io.BytesIO()
        im.resize((w, h), Image.BILINEAR).save(b, "JPEG", quality=85)
        sizes.append(len(b.getvalue()) / (w * h))
    bpp = statistics.mean(sizes)
    work = [(p, s, bpp, seed) for p, s, seed in jobs]
    for _ in in_processes(_gen_jpeg_one, work, chunk=64):
        pass


def helper_imagefolder(argv):
    """_imagefolder ROOT: ImageFolder's index of ROOT, timed; torchvision's own when it imports,
    else the calls its make_dataset makes."""
    root = argv[0]
    try:
        from torchvision import datasets
    except ImportError:
        datasets = None
    t0 = time.perf_counter()
    if datasets is not None:
        n = len(datasets.ImageFolder(root).samples)
    else:
        exts = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
        classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
        samples = []
        for i, c in enumerate(classes):
            for d, _, fnames in sorted(os.walk(os.path.join(root, c), followlinks=True)):
                for fname in sorted(fnames):
                    path = os.path.join(d, fname)
                    if path.lower().endswith(exts):
                        samples.append((path, i))
        n = len(samples)
    print(json.dumps({"index_s": time.perf_counter() - t0, "images": n}))


def helper_read_archive(argv):
    """_read_archive ARCHIVE LIST START STEP: after 'go', open ARCHIVE in this process
    (archfs.open_archive, as a DataLoader worker does) and read files START::STEP of LIST
    whole by path."""
    import archfs
    archive, listfile, start, step = argv[0], argv[1], int(argv[2]), int(argv[3])
    with open(listfile) as f:
        entries = [line.rstrip("\n").split("\t") for line in f][start::step]
    paths = [(p, int(s)) for p, s in entries]
    errors = total = 0
    first_error = None
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    sys.stdin.readline()
    t0 = time.perf_counter()
    a = archfs.open_archive(archive)
    opened = time.perf_counter() - t0
    read = a.read
    for p, size in paths:
        try:
            n = len(read(p))
            total += n
            if n != size:
                errors += 1
                first_error = first_error or f"{p}: read {n} bytes, expected {size}"
        except OSError as e:
            errors += 1
            first_error = first_error or f"{p}: {e}"
    print(json.dumps({"files": len(paths), "bytes": total, "errors": errors,
                      "first_error": first_error, "open_s": opened,
                      "elapsed": time.perf_counter() - t0}))


def helper_imagefolder_archive(argv):
    """_imagefolder_archive ARCHIVE: archfs.torch.ImageFolder's index of the archive's root,
    timed from opening the archive."""
    from archfs.torch import ImageFolder
    t0 = time.perf_counter()
    n = len(ImageFolder(argv[0]).samples)
    print(json.dumps({"index_s": time.perf_counter() - t0, "images": n}))


# The modes above by name; the other helper modes are their benchmarks' own (archbench.helper).
HELPERS = {"_read": helper_read, "_stat": helper_stat, "_torch": helper_torch,
           "_genjpeg": helper_genjpeg, "_imagefolder": helper_imagefolder,
           "_read_archive": helper_read_archive,
           "_imagefolder_archive": helper_imagefolder_archive}
