"""`scripts/bench --inproc-remote`: data loaders that read an image dataset from object
storage inside the training process, side by side in one run, over one emulated link.

    sudo scripts/wheel && sudo scripts/bench --inproc-remote --quick
    sudo scripts/bench --inproc-remote --files 1000 --ir-links 10ms/1gbit --ir-workers 2 \\
        --ir-decode off
    sudo scripts/bench --inproc-remote --ir-scale --quick     # 1,281,167 files of 1-400 B

Why: a job whose images are in S3 reads them with a PyTorch DataLoader; archfs reads them
from one archive object (a tar, a SquashFS image) in the DataLoader's processes, its peers
from loose objects (s3torchconnector, LitData's raw streaming), from their own chunk format
(LitData `optimize`) or from tar shards (WebDataset), or the job copies the archive first.
What the job sees is images per second and the wait for the first batch; what it pays
is bytes and requests on the link and memory on the node.

The network and the server are --remote's (remote.py): SeaweedFS (`weed mini`) in a
network namespace behind a relay that holds each packet for half the round trip, tc tbf
for the rate (`--ir-links`), and counts requests and response bytes for every tool alike.

The data (`--files` real JPEGs of ImageNet's sizes, ~110 KiB mean, files / 1000 classes;
made once under --workdir), uploaded before the link is shaped:
- `data.tar` and `zstd.sqfs` (corpus.build_artifacts), one object each;
- the loose JPEGs, `jpeg/CLASS/NAME.JPEG`, one object each;
- LitData's `optimize()` of the same images, items (JPEG bytes, label), 64 MB chunks,
  inputs in a shuffled order (classes mix in a chunk), under `litdata/`;
- WebDataset shards of ~100 MB (at least 8, so no worker of 8 goes without), keys
  `CLASS_NAME` with `.jpg` and `.cls`, files dealt to shards in a shuffled order, under
  `wds/`.

The tools, each run as a DataLoader(batch_size=256, num_workers=W, persistent_workers=
False) for 2 epochs, with full shuffling where the tool has it:
- `archfs`, `archfs sqfs`: `archfs.torch.ImageFolder("s3://bench/data.tar" or
  ".../zstd.sqfs")`, `shuffle=True`;
- `archfs fetch-ahead`: the tar with `sampler=archfs.torch.FetchAhead(ds, seed=...)`
  (`set_epoch` each epoch): the epoch's order handed to the archive before the workers ask;
- `archfs mount`: `archfs mount s3://bench/data.tar MNT` (the wheel's binary), then
  torchvision's `ImageFolder(MNT)`; the mount counts in the first epoch;
- `copy first`: `aws s3 cp` of data.tar to the node's disk, then
  `archfs.torch.ImageFolder(copy)`; the copy counts in the first epoch;
- `s3torchconnector`: `S3MapDataset.from_prefix("s3://bench/jpeg/")` with the endpoint
  and `S3ClientConfig(force_path_style=True)`, the label from the key's class directory;
- `litdata raw`: `litdata.StreamingRawDataset("s3://bench/jpeg/")` (its batches fetched
  by `__getitems__`, concurrently), labels from the paths; its index of the listing is
  kept local (LitData uploads it into the dataset's prefix by default: the next run, and
  s3torchconnector's listing, would find it);
- `litdata`: `StreamingDataset("s3://bench/litdata/", shuffle=True)` with
  `StreamingDataLoader`. It shuffles the order of chunks and the items within each
  worker's interval of chunks, not across the dataset; it keeps the chunks it fetched
  in its cache directory on the local disk (fresh each run, removed after it; its size
  reported), from which the second epoch reads;
- `webdataset`: `WebDataset("pipe:curl ... shard-{000000..N}.tar", shardshuffle=
  <shards>)` (1.0.2 turns `shardshuffle=True` into 100 with a warning), `.shuffle(1000)`:
  shards in a random order, samples mixed within a buffer of 1000 per worker; `WebLoader`;
- `stream`: the link's floor, not a loader: curl GETs of data.tar whole, one stream and
  `--remote-streams` ranged streams (remote.py's); images per second if the tar
  streamed once. And the first batch's floor: 256 ranged GETs of a file's mean size at
  random places in data.tar, 48 at once, as a full shuffle's first batch needs (S3 has
  no GET of many ranges): what the store's rate of requests allows any such loader.

`--ir-store-apart` puts the store (weed) and the relay on the last CPU and the loaders on
the others, as where the store is other machines: what a request costs the store is then
not taken from the loaders' decoding. The shared default is the harder case for a loader
that makes more requests.

Decode off: a sample is the file's bytes (a batch is counted in the worker: images, bytes,
labels). Decode on: PIL open + convert("RGB") + RandomResizedCrop(224) + ToTensor, the
ImageNet training transform, for every tool alike; batches collated as torch does.

`--ir-scale`: ImageNet's count instead, 1,281,167 files of 1-400 B in 1,000 classes
(--scale's tree: data.tar 1.3 GB; ImageNet's 140 GB do not fit a bench machine's disk),
so what is measured is what each file costs a loader, and opening an index of 1.28 M
entries from the bucket. The tar, its zstd SquashFS image and WebDataset shards of it;
decode off; by default archfs fetch-ahead (tar and SquashFS), WebDataset and the stream
(the loose-object peers would need 1.28 M PUTs first, and already lose at 10,000 files).

Each tool x link x W x decode is one helper process (`bench _inproc_remote run`, the
bench venv's Python), in a memory cgroup of its own (v2, or v1 where the memory controller
is there, as on the bench's VM; none, said so, where neither is writable), with a fresh
XDG_CACHE_HOME (no local tar index: the index `archfs index` saved beside the tar in the
bucket, as a user does once, is fetched) and a job id of its own (no node copy of an
earlier run). Per epoch: images/s, seconds to the first batch and wall seconds, the relay's response
bytes and requests between the epoch's boundaries (the helper reads the relay's counters
itself); in the JSON, images against bytes at each batch, and the link's bytes and the
machine's busy CPU every 0.1 s (where the time went: an idle link, or the cores). The first epoch is timed from nothing: opening the dataset (a copy, a mount, a
listing, a tar's index), then the DataLoader; the second from creating its iterator. The
cgroup's peak (page cache and shared memory included) is read at the end. Every epoch must
yield exactly --files images with the right labels; a count or label mismatch is recorded
and flagged, not fatal. Each run is capped (--cap, default 600 s): what did not finish is
"timeout". The page cache is not dropped: the server's files stay cached (the link is the
bottleneck here, not the server's disk); everything on the client side starts empty.
"""

import importlib
import io
import json
import math
import os
import random
import select
import signal
import struct
import subprocess
import sys
import tarfile
import threading
import time
import traceback

from .constants import SCRIPT, VENV, VPY
from .corpus import build_artifacts, build_dataset, read_manifest
from .deps import ensure_venv, venv_has
from .inproc import install_wheel
from .ranks import JobCgroup
from .remote import (BUCKET, REGION, S3_VENV, SLOTS, RemoteBench, delta, fresh_dir,
                     parse_links, remove, start_server)
from .report import save
from .scale import Scale, classes_for
from .system import REG, force_unmount, log, sh_out

TOOLS = ("archfs", "archfs sqfs", "archfs fetch-ahead", "archfs sqfs fetch-ahead",
         "archfs mount", "copy first",
         "s3torchconnector", "litdata raw", "litdata", "webdataset", "stream")
SCALE_TOOLS = ("archfs fetch-ahead", "archfs sqfs fetch-ahead", "webdataset", "stream")
SCALE_MAX = 400         # --scale's largest file
BATCH = 256
# GETs of an order's first files under way at once (src/source/remote/stage/order.rs).
FIRST_IN_FLIGHT = 48
EPOCHS = 2
SHARD_BYTES = 100e6     # WebDataset's usual shard size
MIN_SHARDS = 8          # split_by_worker leaves a worker without shards below W
SHUFFLE_BUFFER = 1000   # WebDataset's .shuffle(1000)
LITDATA_CHUNK = "64MB"
# The bench venv's packages each tool imports (pip names), installed when missing; zstd
# is LitData's raw index codec, s3fs its listing, awscli copy first's `aws s3 cp`.
PEERS = {"s3torchconnector": "s3torchconnector", "litdata": "litdata", "zstd": "zstd",
         "s3fs": "s3fs", "webdataset": "webdataset", "awscli": "awscli"}

# ---------------------------------------------------------------------------------------------
# Flags
# ---------------------------------------------------------------------------------------------


def add_args(ap):
    g = ap.add_argument_group("in-process remote mode (--inproc-remote)")
    g.add_argument("--inproc-remote", action="store_true", help="in-process data loaders "
                   "(archfs, s3torchconnector, LitData, WebDataset, copy first) reading "
                   "JPEGs from S3 over an emulated link (default 10,000 files, 600 s cap a "
                   "run; --quick: one link 10ms/1gbit, W = 4)")
    g.add_argument("--ir-links", help="link settings, round trip/rate (default "
                   "10ms/1gbit,50ms/1gbit,10ms/none; --quick: 10ms/1gbit)")
    g.add_argument("--ir-workers", help="DataLoader num_workers (default 2,4,8; --quick: 4)")
    g.add_argument("--ir-decode", help="off (bytes), on (PIL + RandomResizedCrop + "
                   "ToTensor), or both (default off,on)")
    g.add_argument("--ir-tools", help="comma-separated: " + ", ".join(TOOLS) +
                   " (default all; --ir-scale: " + ", ".join(SCALE_TOOLS) + ")")
    g.add_argument("--ir-store-apart", action="store_true", help="the store and the link's "
                   "relay on the last CPU, the loaders on the others (as where the store is "
                   "other machines): what the requests cost the store is not the loaders'")
    g.add_argument("--ir-scale", action="store_true", help="ImageNet's 1,281,167 files of "
                   "1-400 B (--files to change the count) as a tar, a zstd image and "
                   "WebDataset shards: the per-file cost and an index of 1.28 M entries; "
                   "decode off")


def resolve(args):
    """The mode's settings from the flags: --quick's where a flag was not given."""
    quick = args.quick
    args.ir_links = parse_links(args.ir_links or
                                ("10ms/1gbit" if quick else "10ms/1gbit,50ms/1gbit,10ms/none"))
    args.ir_workers = [int(w) for w in (args.ir_workers or ("4" if quick else "2,4,8"))
                       .split(",") if w.strip()]
    args.ir_decode = [d.strip() for d in (args.ir_decode or
                                          ("off" if args.ir_scale else "off,on")).split(",")
                      if d.strip()]
    args.ir_tools = [t.strip() for t in (args.ir_tools or ",".join(
        SCALE_TOOLS if args.ir_scale else TOOLS)).split(",") if t.strip()]
    bad = [t for t in args.ir_tools if t not in TOOLS] + \
        [d for d in args.ir_decode if d not in ("off", "on")]
    if bad or not args.ir_links or not args.ir_workers:
        raise SystemExit(f"--inproc-remote: unknown {bad or 'links or workers'}")
    if args.ir_scale and not args.classes_given:
        args.classes = classes_for(args.files)
    if args.ir_scale and ("on" in args.ir_decode or set(args.ir_tools) - set(SCALE_TOOLS)):
        raise SystemExit("--ir-scale: decode off, and only " + ", ".join(SCALE_TOOLS))
    args.jpeg = True

# ---------------------------------------------------------------------------------------------
# The data: the JPEGs, the archives, LitData's chunks, WebDataset's shards (made once)
# ---------------------------------------------------------------------------------------------


def classes_of(manifest):
    """Class directory names in ImageFolder's order (sorted): a label is an index."""
    return sorted({rel.split("/", 1)[0] for rel, _ in manifest})


def wds_shards(ds, src, manifest, seed, data=None):
    """WebDataset's tar shards of the dataset: files dealt to shards in a shuffled order
    (classes mix in a shard), ~SHARD_BYTES each, at least MIN_SHARDS; (dir, count). A
    file's bytes are read under `src`, or got from `data(rel)`."""
    total = sum(s for _, s in manifest)
    n = max(math.ceil(total / SHARD_BYTES), MIN_SHARDS)
    out = os.path.join(ds, f"wds-{n}")
    if os.path.exists(out + ".complete"):
        return out, n
    log(f"writing {n} WebDataset shards")
    remove(out)
    os.makedirs(out)
    label = {c: i for i, c in enumerate(classes_of(manifest))}
    order = list(manifest)
    random.Random(seed).shuffle(order)
    per = -(-len(order) // n)
    for k in range(n):
        with tarfile.open(os.path.join(out, f"shard-{k:06d}.tar"), "w",
                          format=tarfile.USTAR_FORMAT) as t:
            for rel, _ in order[k * per:(k + 1) * per]:
                cls, name = rel.split("/", 1)
                key = f"{cls}_{os.path.splitext(name)[0]}"
                if data:
                    add_member(t, f"{key}.jpg", data(rel))
                else:
                    with open(os.path.join(src, rel), "rb") as f:
                        add_member(t, f"{key}.jpg", f.read())
                add_member(t, f"{key}.cls", str(label[cls]).encode())
    open(out + ".complete", "w").close()
    return out, n


def add_member(t, name, data):
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, 0
    t.addfile(info, io.BytesIO(data))


def litdata_chunks(ds, src, mpath, seed):
    """LitData's `optimize()` of the dataset into 64 MB chunks, run in the bench venv."""
    out = os.path.join(ds, "litdata")
    if os.path.exists(out + ".complete"):
        return out
    log("litdata optimize (bench venv)")
    remove(out)
    r = subprocess.run([VPY, SCRIPT, "_inproc_remote", "optimize", src, mpath, out, str(seed)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"litdata optimize failed: {r.stderr.strip()[-800:]}")
    open(out + ".complete", "w").close()
    return out


def prepare(args):
    """The dataset and every form of it the tools read; name -> path, and the manifest."""
    if args.ir_scale:
        return prepare_scale(args)
    key = f"ds-jpeg-{args.files}f-{args.classes}c-s{args.seed}"
    ds = os.path.join(args.workdir, key)
    os.makedirs(ds, exist_ok=True)
    src, mpath = build_dataset(args, ds)
    manifest = read_manifest(mpath)
    paths = build_artifacts(ds, src, args.classes, images=("zstd",))
    paths["src"] = src
    paths["litdata"] = litdata_chunks(ds, src, mpath, args.seed)
    paths["wds"], paths["wds_shards"] = wds_shards(ds, src, manifest, args.seed)
    return paths, manifest


def prepare_scale(args):
    """--ir-scale's: --scale's tree of 1-400 B files as a tar and a zstd image (made once
    under --workdir), and WebDataset shards of the tar's members."""
    ds = Scale(args).dataset(args.files, args.classes, SCALE_MAX, plain=False)
    manifest = read_manifest(ds["manifest"])
    members = {}

    def data(rel):
        if not members:
            log("reading the tar's members for WebDataset's shards")
            with tarfile.open(ds["tar"]) as t:
                members.update((m.name, t.extractfile(m).read()) for m in t if m.isfile())
        return members[rel]
    paths = {"tar": ds["tar"], "zstd": ds["sqfs"]}
    paths["wds"], paths["wds_shards"] = wds_shards(ds["dir"], None, manifest, args.seed,
                                                   data)
    return paths, manifest


def ensure_peers():
    """The peers' packages in the bench venv (pip, when one is missing); weed, the AWS
    CLI and curl, which nothing here installs."""
    missing = [] if venv_has(", ".join(PEERS)) else \
        [pip for mod, pip in PEERS.items() if not venv_has(mod)]
    if missing:
        log(f"pip install {' '.join(missing)} (bench venv)")
        subprocess.run([VPY, "-m", "pip", "install", "-q", *missing])
    for exe, why in ((os.path.join(S3_VENV, "bin", "weed"), "run scripts/setup"),
                     ("/usr/bin/curl", "apt-get install curl")):
        if not os.path.exists(exe):
            raise SystemExit(f"{exe} missing: {why}")

# ---------------------------------------------------------------------------------------------
# The helper: one tool, 2 epochs, in the bench venv (`bench _inproc_remote run SPEC`)
# ---------------------------------------------------------------------------------------------


class Unavailable(Exception):
    """The tool cannot run here (an import, an API this version lacks): said, not fatal."""


def read_counters(path):
    """The relay's counters page (remote.Counters), read without mapping it."""
    with open(path, "rb") as f:
        return dict(zip(SLOTS, struct.unpack(f"{len(SLOTS)}q", f.read(8 * len(SLOTS)))))


_TRANSFORM = []


def decode(data):
    """The ImageNet training transform of JPEG bytes, the same for every tool."""
    from PIL import Image
    if not _TRANSFORM:
        from torchvision import transforms as T
        _TRANSFORM.append(T.Compose([T.RandomResizedCrop(224), T.ToTensor()]))
    return _TRANSFORM[0](Image.open(io.BytesIO(data)).convert("RGB"))


def read_file(f):
    """archfs.torch's loader (called with a binary file object): the bytes."""
    return f.read()


def read_path(path):
    """torchvision's loader (called with a path): the bytes."""
    with open(path, "rb") as f:
        return f.read()


def tally(batch):
    """Decode off: the batch counted in the worker (images, bytes, sum of labels), so the
    bytes do not cross to the main process; what is measured is the fetching."""
    return len(batch), sum(len(x) for x, _ in batch), sum(int(y) for _, y in batch)


class Sample:
    """bytes, label -> the sample of a decode setting (picklable for any start method)."""

    def __init__(self, on):
        self.on = on

    def __call__(self, data):
        return decode(data) if self.on else data


class S3Sample(Sample):
    """s3torchconnector's transform: its S3Reader -> (sample, label of the key's class)."""

    def __init__(self, on, classes):
        super().__init__(on)
        self.label = {c: i for i, c in enumerate(classes)}

    def __call__(self, reader):
        return super().__call__(reader.read()), self.label[reader.key.split("/")[-2]]


class PairSample(Sample):
    """LitData's and WebDataset's items, (bytes, label) -> (sample, label)."""

    def __call__(self, item):
        data, label = item
        return super().__call__(data), int(label)


class RawLabelled:
    """StreamingRawDataset's items with their labels (from the paths): batches fetched
    through its `__getitems__`, as the DataLoader calls it, concurrently."""

    def __init__(self, raw, classes, sample):
        idx = {c: i for i, c in enumerate(classes)}
        self.raw, self.sample = raw, sample
        self.labels = [idx[f.path.split("/")[-2]] for f in raw.items]

    def __len__(self):
        return len(self.raw)

    def __getitem__(self, i):
        return self.__getitems__([i])[0]

    def __getitems__(self, indices):
        return [(self.sample(b), self.labels[i])
                for i, b in zip(indices, self.raw.__getitems__(indices))]


def loader_args(spec):
    from torch.utils.data import default_collate
    return dict(batch_size=BATCH, num_workers=spec["workers"], persistent_workers=False,
                collate_fn=default_collate if spec["decode"] else tally)


def open_archfs(spec, url, fetch_ahead=False):
    """archfs.torch.ImageFolder on an archive (an object, or the node's copy of it)."""
    from torch.utils.data import DataLoader
    from archfs.torch import ImageFolder
    ds = ImageFolder(url, loader=read_file, transform=Sample(spec["decode"]))
    if not fetch_ahead:
        return DataLoader(ds, shuffle=True, **loader_args(spec)), None
    try:
        from archfs.torch import FetchAhead
    except ImportError as e:
        raise Unavailable(f"archfs.torch.FetchAhead: not in this wheel ({e})")
    sampler = FetchAhead(ds, seed=spec["seed"])
    return DataLoader(ds, sampler=sampler, **loader_args(spec)), sampler


def open_mount(spec):
    """`archfs mount URL MNT` (returns once the mount is live), torchvision's ImageFolder."""
    from torch.utils.data import DataLoader
    from torchvision.datasets import ImageFolder
    os.makedirs(spec["mnt"], exist_ok=True)
    r = subprocess.run([spec["archfs"], "mount", spec["urls"]["tar"], spec["mnt"]],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"archfs mount exited {r.returncode}: {r.stderr.strip()[-400:]}")
    ds = ImageFolder(spec["mnt"], loader=read_path, transform=Sample(spec["decode"]))
    return DataLoader(ds, shuffle=True, **loader_args(spec)), None


def open_copy(spec):
    """`aws s3 cp` of the tar to this node's disk, archfs.torch.ImageFolder on the copy."""
    dest = os.path.join(spec["scratch"], "copy", "data.tar")
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    aws = os.path.join(os.path.dirname(sys.executable), "aws")
    r = subprocess.run([aws, "s3", "cp", "--only-show-errors", spec["urls"]["tar"], dest],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"aws s3 cp: {r.stderr.strip()[-400:]}")
    return open_archfs(spec, dest)


def open_s3torchconnector(spec):
    """S3MapDataset over the loose JPEGs. A custom endpoint is `endpoint=`; SeaweedFS needs
    path-style addressing, which only S3ClientConfig(force_path_style=True) gives (the
    CRT client ignores AWS_ENDPOINT_URL and botocore's settings); keys from AWS_* env."""
    from torch.utils.data import DataLoader
    try:
        from s3torchconnector import S3ClientConfig, S3MapDataset
    except ImportError as e:
        raise Unavailable(f"s3torchconnector: {e}")
    ds = S3MapDataset.from_prefix(spec["urls"]["jpeg"], region=REGION, endpoint=spec["endpoint"],
                                  transform=S3Sample(spec["decode"], spec["classes"]),
                                  s3client_config=S3ClientConfig(force_path_style=True))
    len(ds)  # the listing, here rather than in the first iterator
    return DataLoader(ds, shuffle=True, **loader_args(spec)), None


def obstore_http():
    """LitData fetches through obstore (object_store), which refuses a plain-http endpoint
    ("BadScheme") unless its client options allow it. LitData builds the store itself
    with client options of its own (a module constant), which take the place of any
    from the environment (AWS_ALLOW_HTTP=true is not seen): allow_http is added to that
    constant, here, before the workers fork. Nothing else of LitData's is changed."""
    from litdata.streaming import downloader
    downloader._OBSTORE_CLIENT_OPTIONS = dict(downloader._OBSTORE_CLIENT_OPTIONS,
                                              allow_http="true")


def open_litdata_raw(spec):
    """litdata.StreamingRawDataset over the loose JPEGs, its index kept local."""
    from torch.utils.data import DataLoader
    obstore_http()
    try:
        from litdata import StreamingRawDataset
        from litdata.raw.indexer import FileIndexer
    except ImportError as e:
        raise Unavailable(f"litdata: no StreamingRawDataset in this version ({e})")

    class LocalIndexer(FileIndexer):
        def _upload_to_cloud(self, *a, **kw):
            pass
    raw = StreamingRawDataset(spec["urls"]["jpeg"],
                              cache_dir=os.path.join(spec["scratch"], "litdata-raw-cache"),
                              indexer=LocalIndexer(extensions=[".jpeg"]),
                              storage_options={"endpoint_url": spec["endpoint"]})
    ds = RawLabelled(raw, spec["classes"], Sample(spec["decode"]))
    return DataLoader(ds, shuffle=True, **loader_args(spec)), None


def open_litdata(spec):
    """litdata.StreamingDataset over the optimized chunks, its chunk cache fresh."""
    try:
        from litdata import StreamingDataLoader, StreamingDataset
    except ImportError as e:
        raise Unavailable(f"litdata: {e}")
    obstore_http()
    ds = StreamingDataset(spec["urls"]["litdata"], shuffle=True, seed=spec["seed"],
                          cache_dir=os.path.join(spec["scratch"], "litdata-cache"),
                          storage_options={"endpoint_url": spec["endpoint"]},
                          transform=PairSample(spec["decode"]))
    return StreamingDataLoader(ds, **loader_args(spec)), None


def open_webdataset(spec):
    """WebDataset over the shards by curl (anonymous GETs: the bench bucket allows them)."""
    try:
        import webdataset as wds
    except ImportError as e:
        raise Unavailable(f"webdataset: {e}")
    n = spec["wds_shards"]
    url = (f"pipe:curl -sS -f {spec['endpoint']}/{BUCKET}/wds/"
           f"shard-{{000000..{n - 1:06d}}}.tar")
    ds = (wds.WebDataset(url, shardshuffle=n).shuffle(SHUFFLE_BUFFER)
          .to_tuple("jpg", "cls").map(PairSample(spec["decode"])))
    a = loader_args(spec)
    a.pop("persistent_workers")
    return wds.WebLoader(ds, persistent_workers=False, **a), None


OPENERS = {
    "archfs": lambda s: open_archfs(s, s["urls"]["tar"]),
    "archfs sqfs": lambda s: open_archfs(s, s["urls"]["sqfs"]),
    "archfs fetch-ahead": lambda s: open_archfs(s, s["urls"]["tar"], fetch_ahead=True),
    "archfs sqfs fetch-ahead": lambda s: open_archfs(s, s["urls"]["sqfs"], fetch_ahead=True),
    "archfs mount": open_mount,
    "copy first": open_copy,
    "s3torchconnector": open_s3torchconnector,
    "litdata raw": open_litdata_raw,
    "litdata": open_litdata,
    "webdataset": open_webdataset,
}


def emit(**kw):
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()


def disk_bytes(path):
    """Bytes of the files under path, on its own filesystem (not a live mount's)."""
    total = 0
    for d, dirs, files in os.walk(path):
        dirs[:] = [x for x in dirs if not os.path.ismount(os.path.join(d, x))]
        total += sum(os.lstat(os.path.join(d, f)).st_size for f in files)
    return total


def one_line(e):
    """An exception as one line of the report: its last 400 characters (a DataLoader
    worker's carries the worker's traceback, the cause at its end; a Rust client's
    errors span dozens of lines)."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text if len(text) <= 400 else '...' + text[-400:]}"


def cpu_busy():
    """Seconds the machine's CPUs were busy since boot (every process: the server and the
    relay share the cores with the loader)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return round((sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK"), 2)


def helper_run(argv):
    """_inproc_remote run SPECFILE: the tool's DataLoader for EPOCHS epochs; a JSON line
    after opening and after each epoch (what a timeout leaves is what finished), or the
    error, in one line (the traceback to stderr)."""
    with open(argv[0]) as f:
        spec = json.load(f)
    try:
        epochs(spec)
    except Unavailable as e:
        emit(unavailable=str(e))
    except Exception as e:  # noqa: BLE001 - reported, and the run goes on to the next tool
        traceback.print_exc()
        emit(error=one_line(e))
        sys.exit(1)
    finally:
        if spec["tool"] == "archfs mount":
            subprocess.run([spec["archfs"], "unmount", spec["mnt"]], capture_output=True)


def epochs(spec):
    """Opens the tool's dataset and DataLoader, then runs the epochs; the first timed from
    before opening, the relay's counters read at each boundary."""
    import torch
    importlib.import_module("torchvision")  # archfs.torch imports it: in no tool's time
    torch.manual_seed(spec["seed"])
    counters = spec["counters"]
    t0, c0 = time.perf_counter(), read_counters(counters)
    link = []
    threading.Thread(target=watch_link, args=(counters, t0, c0, link), daemon=True).start()
    loader, sampler = OPENERS[spec["tool"]](spec)
    emit(setup_s=time.perf_counter() - t0, setup_before=c0, setup_after=read_counters(counters))
    for e in range(EPOCHS):
        if sampler is not None:
            sampler.set_epoch(e)
        start, before = (t0, c0) if e == 0 else \
            (time.perf_counter(), read_counters(counters))
        first, images, nbytes, labels, timeline = None, 0, 0, 0, []
        for batch in loader:
            now = time.perf_counter() - start
            if first is None:
                first = now
            if spec["decode"]:
                images += len(batch[1])
                labels += int(batch[1].sum())
            else:
                images, nbytes, labels = (images + batch[0], nbytes + batch[1],
                                          labels + batch[2])
            # Where the time goes: images had against bytes the link brought, each batch.
            down = read_counters(counters)["down_bytes"] - before["down_bytes"]
            timeline.append((round(now, 3), images, down, cpu_busy()))
        emit(epoch=e + 1, images=images, bytes=None if spec["decode"] else nbytes,
             labels=labels, first_s=first, wall_s=time.perf_counter() - start,
             before=before, after=read_counters(counters), timeline=timeline)
    emit(disk_mb=disk_bytes(spec["scratch"]) / 1e6, link=list(link))


def watch_link(counters, t0, c0, link):
    """The link's bytes towards the node every 0.1 s of the run, from the helper's start:
    (seconds, bytes, requests, CPU seconds busy): whether the link idled, and when."""
    while True:
        c = read_counters(counters)
        link.append((round(time.perf_counter() - t0, 2), c["down_bytes"] - c0["down_bytes"],
                     c["get"] - c0["get"], cpu_busy()))
        time.sleep(0.1)


def _litdata_item(inp):
    """optimize()'s function: (path, label) -> (JPEG bytes, label)."""
    path, label = inp
    with open(path, "rb") as f:
        return f.read(), label


def helper_optimize(argv):
    """_inproc_remote optimize SRC MANIFEST OUT SEED: LitData's optimize() of the files, in
    a shuffled order, 64 MB chunks, into the local directory OUT."""
    from litdata import optimize
    src, mpath, out, seed = argv[0], argv[1], argv[2], int(argv[3])
    manifest = read_manifest(mpath)
    label = {c: i for i, c in enumerate(classes_of(manifest))}
    inputs = [(os.path.join(src, rel), label[rel.split("/", 1)[0]]) for rel, _ in manifest]
    random.Random(seed).shuffle(inputs)
    optimize(fn=_litdata_item, inputs=inputs, output_dir=out, chunk_bytes=LITDATA_CHUNK,
             num_workers=os.cpu_count(), reorder_files=False, verbose=False)


def helper(argv):
    """`bench _inproc_remote run|optimize ...`: this mode's helper processes."""
    {"run": helper_run, "optimize": helper_optimize}[argv[0]](argv[1:])

# ---------------------------------------------------------------------------------------------
# The orchestration: a helper process per tool x link x W x decode, in a cgroup of its own
# ---------------------------------------------------------------------------------------------


class MountPoint:
    """A mount point a killed helper may leave mounted: in REG, unmounted on any exit."""

    def __init__(self, path):
        self.name, self.path = f"mount {path}", path

    def unmount(self, force=False):
        force_unmount(self.path)


class Lines:
    """A helper's stdout as JSON lines, each waited for until a deadline."""

    def __init__(self, proc):
        self.proc, self.buf = proc, b""

    def next(self, deadline):
        """The next JSON object; None at EOF; raises TimeoutError past the deadline."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.time()
            if left <= 0:
                raise TimeoutError
            if select.select([fd], [], [], min(left, 1.0))[0]:
                chunk = os.read(fd, 65536)
                if not chunk:
                    return None
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)


class Bench:
    """Every tool at every link x W x decode; results in self.res."""

    def __init__(self, args, net, server, paths, manifest, tmp, archfs_bin):
        self.args, self.net, self.server = args, net, server
        self.paths, self.manifest, self.tmp = paths, manifest, tmp
        self.archfs_bin = archfs_bin
        self.n = len(manifest)
        self.classes = classes_of(manifest)
        label = {c: i for i, c in enumerate(self.classes)}
        self.label_sum = sum(label[rel.split("/", 1)[0]] for rel, _ in manifest)
        self.nbytes = sum(s for _, s in manifest)
        self.tar_size = os.path.getsize(paths["tar"])
        self.res = {}       # section -> tool -> result
        self.streams = {}   # link -> {"1 stream": s, "N streams": s}
        self.floors = {}    # link -> seconds of the first batch's GETs alone
        self.store_apart = None  # where --ir-store-apart put the store and the loaders
        self.notes = []
        self.serial = 0
        self.cgroup_note = None

    def note(self, msg):
        if msg not in self.notes:
            self.notes.append(msg)
        log("  " + msg)

    def spec(self, tool, workers, decode, scratch):
        e = self.server.endpoint
        return {"tool": tool, "decode": decode == "on", "workers": workers,
                "seed": self.args.seed, "counters": self.net.counters.path,
                "scratch": scratch, "endpoint": e, "classes": self.classes,
                "archfs": self.archfs_bin, "mnt": os.path.join(scratch, "mnt"),
                "wds_shards": self.paths["wds_shards"],
                "urls": {"tar": f"s3://{BUCKET}/data.tar", "sqfs": f"s3://{BUCKET}/zstd.sqfs",
                         "jpeg": f"s3://{BUCKET}/jpeg/", "litdata": f"s3://{BUCKET}/litdata/"}}

    def cgroup(self):
        """A memory cgroup for one run, or None (said once) where none can be made."""
        try:
            cg = JobCgroup(f"archfs-bench-ir-{os.getpid()}")
        except (OSError, StopIteration) as e:
            if not self.cgroup_note:
                self.cgroup_note = f"no memory cgroup ({e}): peak memory not measured"
                self.note(self.cgroup_note)
            return None
        if not self.cgroup_note:
            kind = "v2 (memory.peak)" if cg.v2 else \
                "v1 (memory.max_usage_in_bytes: this machine has its memory controller on v1)"
            self.cgroup_note = (f"memory: the peak of a cgroup {kind} holding the helper and "
                                "everything it starts")
        return cg

    def run_tool(self, tool, workers, decode):
        """One helper: the tool's epochs, within the cap; its result."""
        self.serial += 1
        scratch = os.path.join(self.tmp, f"run-{self.serial:03d}")
        remove(scratch)
        os.makedirs(os.path.join(scratch, "tmp"))
        specfile = os.path.join(scratch, "spec.json")
        spec = self.spec(tool, workers, decode, scratch)
        with open(specfile, "w") as f:
            json.dump(spec, f)
        mp = MountPoint(spec["mnt"])
        REG.targets.insert(0, mp)
        cg = self.cgroup()
        if cg:
            REG.targets.insert(0, cg)
        # Nothing of an earlier run: no saved tar index, no node copy of this job's.
        env = dict(os.environ, XDG_CACHE_HOME=os.path.join(scratch, "cache"),
                   TMPDIR=os.path.join(scratch, "tmp"),
                   SLURM_JOB_ID=f"archfs-bench-ir-{os.getpid()}-{self.serial}")
        res = {"epochs": [], "status": "ok"}
        errlog = os.path.join(self.tmp, "logs", f"{self.serial:03d}-{tool.replace(' ', '-')}"
                              f"-W{workers}-{decode}.log")
        os.makedirs(os.path.dirname(errlog), exist_ok=True)
        deadline = time.time() + self.args.cap
        with open(errlog, "w") as err:
            p = subprocess.Popen([VPY, SCRIPT, "_inproc_remote", "run", specfile],
                                 stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                                 env=env, preexec_fn=cg.preexec if cg else None,
                                 start_new_session=True)
        REG.pgids.add(p.pid)
        lines = Lines(p)
        try:
            while True:
                o = lines.next(deadline)
                if o is None:
                    break
                if "epoch" in o:
                    res["epochs"].append(o)
                else:
                    res.update(o)
        except TimeoutError:
            res["status"] = "timeout"
        finally:
            self.stop(p, cg, mp, wait=0 if res["status"] == "timeout" else 30)
        if "unavailable" in res:
            res["status"] = "unavailable"
        elif res["status"] == "ok" and ("error" in res or p.returncode != 0):
            res["status"] = "error"
            res.setdefault("error", f"exit {p.returncode}: " + " ".join(tail(errlog).split()))
        if res["status"] != "ok":
            log(f"  helper log: {errlog}")
        if cg:
            res["peak_mb"] = cg.peak() / 1e6
            res["peak_sampled"] = cg.peak_sample
            cg.remove()
            REG.targets.remove(cg)
        REG.targets.remove(mp)
        remove(scratch)
        return res

    def stop(self, p, cg, mp, wait):
        """The helper ends (within `wait` seconds), or is ended: its process group,
        whatever is left in its cgroup, the mount it may have left."""
        try:
            p.wait(wait)
        except subprocess.TimeoutExpired:
            pass
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
            p.wait()
        REG.pgids.discard(p.pid)
        if cg:
            cg.kill_all()
        mp.unmount()

    def check(self, section, tool, res):
        """What is wrong with a finished run's epochs: a count, the bytes, the labels."""
        for ep in res["epochs"]:
            bad = []
            if ep["images"] != self.n:
                bad.append(f"{ep['images']} images, expected {self.n}")
            if ep["bytes"] is not None and ep["bytes"] != self.nbytes and ep["images"] == self.n:
                bad.append(f"{ep['bytes']} bytes, expected {self.nbytes}")
            if ep["labels"] != self.label_sum and ep["images"] == self.n:
                bad.append(f"labels sum to {ep['labels']}, expected {self.label_sum}")
            if bad:
                ep["mismatch"] = "; ".join(bad)
                self.note(f"{section}: {tool} epoch {ep['epoch']}: {ep['mismatch']}")

    def stream(self, link):
        """The link's floor: remote.py's curl GETs of the tar, 1 stream and N ranged."""
        rb = RemoteBench(self.args, self.net, self.server, self.manifest, self.tmp, {})
        rb.note = self.note
        rb.stream(link, "tar", f"{self.server.endpoint}/{BUCKET}/data.tar", self.tar_size)
        got = rb.res.get(link, {}).get("tar", {}).get("stream", {})
        self.streams[link] = {k: v[0] for k, v in got.items() if not k.endswith("gets")}
        for label, secs in self.streams[link].items():
            log(f"  stream, {label}: {secs:.2f} s ({self.tar_size / 1e6 / secs:.0f} MB/s)")
        self.batch_floor(link)

    def batch_floor(self, link):
        """What the store and the link allow a first batch of a full shuffle: BATCH ranged
        GETs of a file's mean size at random places in data.tar, FIRST_IN_FLIGHT at once
        (curl --parallel, as many connections), as FetchAhead's first files come; nothing else running. S3 has no GET of many ranges, so no loader that
        shuffles the whole dataset fetches its first batch in fewer requests."""
        url = f"{self.server.endpoint}/{BUCKET}/data.tar"
        size = max(1, round(self.nbytes / self.n))
        rng = random.Random(self.args.seed)
        cmd = ["curl", "-Z", "--parallel-max", str(FIRST_IN_FLIGHT)]
        for i in range(BATCH):
            at = rng.randrange(0, self.tar_size - size)
            cmd += (["--next"] if i else []) + [
                "-sS", "-f", "-o", "/dev/null", "-r", f"{at}-{at + size - 1}", url]
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        secs = time.perf_counter() - t0
        if r.returncode:
            self.note(f"{link}: curl batch floor failed: {r.stderr.strip()[:200]}")
            return
        self.floors[link] = secs
        log(f"  first batch floor: {BATCH} GETs of {size} B, {FIRST_IN_FLIGHT} at once: "
            f"{secs:.2f} s")

    def run(self):
        tools = [t for t in self.args.ir_tools if t != "stream"]
        for label, rtt, rate in self.args.ir_links:
            log(f"=== link {label}")
            self.net.shape(rtt, rate)
            if "stream" in self.args.ir_tools:
                self.stream(label)
            for workers in self.args.ir_workers:
                for decode in self.args.ir_decode:
                    section = f"link {label}, W = {workers}, decode {decode}"
                    log(f"--- {section}")
                    out = self.res.setdefault(section, {"link": label, "tools": {}})
                    for tool in tools:
                        t0 = time.time()
                        res = self.run_tool(tool, workers, decode)
                        self.check(section, tool, res)
                        out["tools"][tool] = res
                        for line in tool_lines(tool, res, self):
                            log(f"  {line}")
                        log(f"  ({tool}: {time.time() - t0:.0f} s)")


def tail(path, n=600):
    try:
        with open(path, errors="replace") as f:
            return f.read().strip()[-n:]
    except OSError:
        return ""

# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def tool_lines(tool, res, b):
    """`TOOL epoch E: N img/s, first batch X.XX s, W.W s, F MB fetched (R.RRx the tar),
    Q requests, peak M MB` for each epoch that finished; what happened to the rest."""
    if res["status"] == "unavailable":
        return [f"{tool}: unavailable ({res['unavailable']})"]
    peak = f"{res['peak_mb']:.0f} MB" if "peak_mb" in res else "—"
    out = []
    for ep in res["epochs"]:
        d = delta(ep["before"], ep["after"])
        flag = f" [{ep['mismatch']}]" if "mismatch" in ep else ""
        out.append(f"{tool} epoch {ep['epoch']}: {ep['images'] / ep['wall_s']:.0f} img/s, "
                   f"first batch {ep['first_s']:.2f} s, {ep['wall_s']:.1f} s, "
                   f"{d['mb']:.0f} MB fetched ({d['mb'] * 1e6 / b.tar_size:.2f}x the tar), "
                   f"{d['requests']} requests, peak {peak}{flag}")
    for e in range(len(res["epochs"]) + 1, EPOCHS + 1):
        what = {"timeout": f"timeout (over the {b.args.cap:g} s cap)",
                "error": f"error: {res.get('error', '')[-300:]}"}.get(res["status"], "—")
        out.append(f"{tool} epoch {e}: {what}")
        if res["status"] == "error":
            break
    return out


def img_s(res, epoch=1):
    """Images/s of an epoch that finished whole, else None."""
    eps = [ep for ep in res.get("epochs", []) if ep["epoch"] == epoch and "mismatch" not in ep]
    return eps[0]["images"] / eps[0]["wall_s"] if eps else None


def ratio_lines(tools, stream, n):
    """archfs fetch-ahead's first epoch against the best peer and the link's floor."""
    mine = img_s(tools.get("archfs fetch-ahead", {}))
    if mine is None:
        return ["archfs fetch-ahead: no first epoch to compare"]
    peers = {t: img_s(r) for t, r in tools.items() if not t.startswith("archfs")}
    peers = {t: v for t, v in peers.items() if v}
    out = []
    if peers:
        best = max(peers, key=peers.get)
        out.append(f"archfs fetch-ahead epoch 1 / the best peer ({best}, {peers[best]:.0f} "
                   f"img/s): {mine / peers[best]:.2f}x")
    if stream:
        label = min(stream, key=stream.get)
        floor = n / stream[label]
        out.append(f"archfs fetch-ahead epoch 1 / the stream floor ({n} images in the "
                   f"{label} time of the tar, {stream[label]:.2f} s: {floor:.0f} img/s): "
                   f"{mine / floor:.2f}x")
    return out


def header(args, b, archfs_bin, unavailable):
    """The command, the machine, the versions, the data and the method."""
    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo")
                if x.startswith("model name")), "?")
    pkgs = ["torch", "torchvision", "Pillow", "archfs", "s3torchconnector", "litdata",
            "webdataset", "boto3", "obstore", "s3fs", "awscli"]
    vpy = [VPY, "-c", "import importlib.metadata as m, sys\nfor p in sys.argv[1:]:\n try: "
           "print(p, m.version(p), end=', ')\n except Exception: print(p, '-', end=', ')"] + pkgs
    repo = os.path.dirname(os.path.dirname(SCRIPT))
    dirty = sh_out(["git", "-C", repo, "status", "--porcelain", "src", "python", "native"])
    whose = "" if args.archfs else ", the wheel's"
    machine = [
        f"command: scripts/bench {' '.join(args.argv)}",
        f"date: {time.strftime('%Y-%m-%d %H:%M %Z')}",
        f"cpu: {cpu}, nproc {os.cpu_count()}; kernel {os.uname().release}; memory "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 1e9:.0f} GB",
        f"archfs: {sh_out([archfs_bin, '--version'])} ({archfs_bin}{whose}; "
        f"{sh_out(['git', '-C', repo, 'log', '-1', '--format=%h %s'])[:90]}"
        f"{' + uncommitted changes' if dirty else ''})",
        f"bench venv: {sh_out(vpy).rstrip(', ')}",
        f"weed: {sh_out([os.path.join(S3_VENV, 'bin', 'weed'), 'version']).splitlines()[0]}"]
    if b.store_apart:
        machine.append(f"--ir-store-apart: {b.store_apart}")
    sizes = [s for _, s in b.manifest]
    p = b.paths
    kind = "files of 1-400 B (--ir-scale)" if args.ir_scale else "noise JPEGs"
    litdata = "" if "litdata" not in p else (
        f"LitData chunks {disk_bytes(p['litdata']) / 1e6:.0f} MB "
        f"({len([f for f in os.listdir(p['litdata']) if f.endswith('.bin')])} files of "
        f"{LITDATA_CHUNK}), ")
    data = (f"{b.n} {kind} in {len(b.classes)} classes, {b.nbytes / 1e6:.0f} MB, mean "
            f"{b.nbytes / b.n / 1024:.1f} KiB (max {max(sizes) / 1024:.1f} KiB); data.tar "
            f"{b.tar_size / 1e6:.0f} MB, zstd.sqfs {os.path.getsize(p['zstd']) / 1e6:.0f} MB, "
            f"{litdata}{p['wds_shards']} WebDataset shards "
            f"({disk_bytes(p['wds']) / 1e6:.0f} MB).")
    method = ("Each tool x link x W x decode: a helper process of the bench venv, in a memory "
              f"cgroup of its own, a DataLoader of batch {BATCH}, num_workers W, "
              f"{EPOCHS} epochs. img/s = images / wall time of the epoch. Epoch 1 is timed "
              "from nothing: opening the dataset (a copy, a mount, a listing, a tar's index) "
              "and the DataLoader, to its last batch; epoch 2 from creating the iterator. "
              "MB fetched and requests: response bytes (TCP payload towards the node) and "
              "requests (GET, HEAD, PUT...) the relay counted between the epoch's boundaries "
              "(epoch 1 includes opening); x the tar: MB / data.tar's size. opening: its "
              "seconds and MB, before the DataLoader starts. peak: the "
              "cgroup's peak memory over the run (page cache and shared memory included). "
              "Shuffling: archfs, the mount, copy first, s3torchconnector and LitData raw "
              "shuffle the whole dataset (torch's RandomSampler, FetchAhead's own); LitData "
              "shuffles chunks and items within each worker's chunks; WebDataset shuffles "
              f"the shards and samples within a buffer of {SHUFFLE_BUFFER} per worker. "
              "LitData caches its chunks on the local disk (a fresh cache directory each "
              "run, its size noted); its second epoch reads them there. The ratios compare "
              "archfs fetch-ahead's first epoch with the best first epoch of the peers "
              "(every tool not named archfs) and with the images per second of streaming "
              "the tar once (the faster of 1 and N curl streams).")
    return ["# archfs in-process loaders from S3, beside their peers", "", "```"] + machine + \
        ["```", "", data, "", method, ""] + [f"- {u}" for u in unavailable] + \
        ([""] if unavailable else [])


def report(b, args, head):
    lines = list(head)
    for section, out in b.res.items():
        tools = out["tools"]
        stream = b.streams.get(out["link"], {})
        body = []
        for tool, res in tools.items():
            body += tool_lines(tool, res, b)
        floor = b.floors.get(out["link"])
        if floor is not None:
            body.append(f"first batch floor: {BATCH} ranged GETs of a file's mean size, "
                        f"{FIRST_IN_FLIGHT} at once, nothing else running: {floor:.2f} s")
        if stream:
            body.append("stream: " + ", ".join(
                f"{k} {v:.2f} s ({b.tar_size / 1e6 / v:.0f} MB/s, {b.n / v:.0f} img/s)"
                for k, v in stream.items()))
        opened = [f"{t} {r['setup_s']:.2f} s, "
                  f"{delta(r['setup_before'], r['setup_after'])['mb']:.0f} MB"
                  for t, r in tools.items() if "setup_s" in r]
        if opened:
            body.append("opening (part of epoch 1): " + "; ".join(opened))
        body += ratio_lines(tools, stream, b.n)
        disk = [f"{t} {r['disk_mb']:.0f} MB" for t, r in tools.items()
                if r.get("disk_mb", 0) >= 1]
        lines += [f"## {section}", "", "```"] + body + ["```", ""]
        if disk:
            lines += ["On the node's disk when the last epoch ended (removed after): " +
                      ", ".join(disk) + ".", ""]
    if b.notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in b.notes] + [""]
    return "\n".join(lines)

# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def wheel(args):
    """The wheel from scripts/wheel into the bench venv; while it is being rebuilt (no
    wheel there), the archfs the venv has, said in the report. Returns that note."""
    try:
        install_wheel(args)
        return []
    except SystemExit as e:
        if not venv_has("archfs.torch"):
            raise
        note = f"archfs: the bench venv's installed wheel ({e})"
        log(note)
        return [note]


def store_apart(net, server):
    """--ir-store-apart: the store (weed) and the link's relay on the last CPU, this bench
    and all it starts on the others, as where the store is other machines and the link
    a network: the CPU each GET and packet costs them is then not the loaders' own. The
    threads they start later inherit it. Returns where each went, for the report."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--ir-store-apart: needs 2 CPUs or more")
    leaders = {server.proc.pid, net.relay.pid}
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            with open(f"/proc/{pid}/stat") as f:
                group = int(f.read().rsplit(")", 1)[1].split()[2])
            tasks = os.listdir(f"/proc/{pid}/task")
        except (OSError, IndexError, ValueError):
            continue
        mine = pid == os.getpid()
        if group in leaders or mine:
            for tid in tasks:
                try:
                    os.sched_setaffinity(int(tid), set(cpus[:-1]) if mine else {cpus[-1]})
                except OSError:
                    pass  # a thread that ended
    where = (f"weed and the relay on CPU {cpus[-1]}, the loaders on CPU "
             f"{','.join(map(str, cpus[:-1]))}")
    log(f"  {where}")
    return where


def sidecar_index(archfs_bin, tmp):
    """`archfs index s3://bench/data.tar`: the tar's index beside it, as a user saves it
    once when the dataset is packed (docs/PYTHON.md); without it every job's first open
    scans the whole tar. Before the link is shaped; the runs find it, not a local one
    (each has an XDG_CACHE_HOME of its own)."""
    t0 = time.time()
    env = dict(os.environ, XDG_CACHE_HOME=os.path.join(tmp, "index-cache"))
    r = subprocess.run([archfs_bin, "index", f"s3://{BUCKET}/data.tar"], env=env,
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"archfs index: {r.stderr.strip()[-400:]}")
    log(f"  {r.stdout.strip()} ({time.time() - t0:.1f} s)")


def main(args):
    resolve(args)
    # A fresh machine has no bench venv yet: every tool here is a DataLoader.
    torch_ok, why = ensure_venv(args)
    if not torch_ok:
        raise SystemExit(f"--inproc-remote needs torch in the bench venv: {why}")
    ensure_peers()
    notes = wheel(args)
    archfs_bin = args.archfs or os.path.join(VENV, "bin", "archfs")
    paths, manifest = prepare(args)
    tmp = fresh_dir(os.path.join(args.workdir, "inproc-remote"))
    net, server, _ = start_server(tmp, {"tar": paths["tar"], "zstd": paths["zstd"]})
    # Each form the tools read: --ir-scale's 1.28 M loose objects would take an hour.
    wants = {"jpeg": {"s3torchconnector", "litdata raw"}, "litdata": {"litdata"},
             "wds": {"webdataset"}}
    for prefix, tools in wants.items():
        if tools & set(args.ir_tools):
            server.upload_tree(prefix, paths["src" if prefix == "jpeg" else prefix])
    sidecar_index(archfs_bin, tmp)
    where = store_apart(net, server) if args.ir_store_apart else None
    b = Bench(args, net, server, paths, manifest, tmp, archfs_bin)
    b.store_apart = where
    b.run()
    unavailable = [f"{t}: {r['unavailable']}" for out in b.res.values()
                   for t, r in out["tools"].items() if r["status"] == "unavailable"]
    unavailable = notes + sorted(set(unavailable)) + net.notes()
    if b.cgroup_note:
        unavailable.append(b.cgroup_note)
    save(args.out, report(b, args, header(args, b, archfs_bin, unavailable)),
         {"args": dict(vars(args), ir_links=args.ir_links), "results": b.res,
          "streams": b.streams, "floors": b.floors, "notes": b.notes, "unavailable": unavailable,
          "files": b.n, "bytes": b.nbytes, "tar_bytes": b.tar_size})
    log(f"wrote {args.out}")
