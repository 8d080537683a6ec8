"""`scripts/bench --remote`: archfs on an archive in object storage, over an emulated
network, beside the ways a training job gets such an archive today (issue 30).

    sudo scripts/bench --remote                        # 1,000 files, 4 link settings, 1 run
    sudo scripts/bench --remote --files 500 --remote-links 10ms/1gbit --remote-formats tar

Why: a job whose dataset is an object in S3 either copies it to the node first (`aws s3
cp`, then mounts the copy) or mounts the URL. What the user waits for is the first batch
and the end of the first epoch; what bounds both is the link, so each is also put beside
streaming the object once over the same link.

The network. This machine's kernel has no netem (CONFIG_NET_SCH_NETEM is not set; of the
shaping qdiscs only tbf and htb are built), so the delay is made in user space: the S3
server runs in a network namespace of its own, joined to the host by two TUN devices, and
a relay process (`bench _remote relay`) moves the packets between them, holding each for
half the round trip; `tc tbf` on both devices caps the rate. The TUN devices carry
TSO/GSO packets (a virtio-net header), so the relay handles up to 64 KiB at a time while
TCP sees an MTU of 1500: both ends run the kernel's own TCP, with its windows, slow start
and this machine's buffer limits. The relay also counts, for every tool alike, the HTTP
requests (TCP payloads that start with `GET `, `HEAD `...) and the response bytes (TCP
payload towards the host). Traffic stays on this machine: a private /30 between the two
devices, with an `unreachable` route for it while the bench runs.

The server: SeaweedFS (`weed mini` from target/s3-venv, which scripts/setup makes), run as
tests/common/s3.rs runs it, inside the namespace; the archives are uploaded with boto3 (an
independent client) before the link is shaped. Teardown on any exit path (error, Ctrl-C):
mounts first, then weed (SIGTERM, SIGKILL after a grace period), the relay, the route,
the namespace.

Compared, per link setting and archive (data.tar, the zstd SquashFS image):
- `copy first`: `aws s3 cp` (the AWS CLI, its default 8 MiB parts, 10 in flight) to the
  local disk, then archfs on the copy;
- `archfs`: archfs on the s3:// URL (the node-local copy from mount, reads ahead of it
  fetch their own spans), and `archfs nopreload` with --preload=never (ranged reads
  alone);
- `ratarmount`: ratarmount on the s3:// URL through fsspec/s3fs (tar only);
- `rclone+archfs`: `rclone mount --vfs-cache-mode full` of the bucket, archfs on the
  object inside it;
- the streaming limit: curl GETs of the whole object, one stream, and N ranged streams;
- the link's floor for a first batch: curl fetching the batch's files one after another,
  one ranged GET each on one warm connection, the link idle (no tool beats it: a reader
  asks for one file at a time).

Each tool, from nothing on the node (no copy, no saved index, fresh cache directories):
pass 1 mounts and one reader reads the first 32 files of a shuffled order (the first
batch: copy + mount + those reads); pass 2 mounts again and 2 reader processes read every
file in shuffled order (cold), then again (warm, same mount); for a tar, pass 3 is a later
job on a fresh node that finds the index pass 2 saved (a shared ~/.cache): mount and
first batch again (copy first: with the time of its copy). The page cache is not dropped:
the server's files stay cached (an object store is not the bottleneck here, the link is).
The relay runs on the same 2 cores as everything else: the streaming rows say what the
link gives in practice (about 600 MB/s unshaped on the bench's VM).
"""

import collections
import fcntl
import json
import mmap
import os
import random
import select
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time

from .constants import SCRIPT, VENV, VPY
from .corpus import build_artifacts, build_dataset, read_manifest, write_list
from .deps import ensure_venv, venv_has
from .system import (REG, Failed, Timeout, force_unmount, log, mounted_paths, proc_cmdline,
                     proc_stats, sh, sh_out)
from .report import save
from .stats import median_or_failure
from .tools import Archfs, Ratarmount, Target, find_archfs
from .workloads import read_pass

REPO = os.path.dirname(os.path.dirname(SCRIPT))
S3_VENV = os.environ.get("ARCHFS_S3_VENV", os.path.join(REPO, "target", "s3-venv"))
BUCKET = "bench"
ACCESS_KEY = "AKIAARCHFSBENCH00001"
SECRET_KEY = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYARCHFSBENCH"
REGION = "us-east-1"
NETNS = "archfs-bench-s3"
DEV_HOST, DEV_NS = "abench-h", "abench-n"
# The /30 between the two devices (the host's end, the server's end).
SUBNETS = ["10.213.7.0", "10.213.77.0", "172.29.213.0"]
S3_PORT = 8333
# weed's gRPC ports also name sockets in the shared /tmp (/tmp/seaweedfs-*-PORT.sock):
# kept clear of the test harness's ports (below the ephemeral range).
PORTS = {"master.port": 46333, "master.port.grpc": 46334, "volume.port": 46335,
         "volume.port.grpc": 46336, "filer.port": 46337, "filer.port.grpc": 46338,
         "s3.port.grpc": 46339, "admin.port": 46340, "admin.port.grpc": 46341}
WEED_STARTED = "All enabled components are running"
WEED_GRACE = 5          # seconds between SIGTERM and SIGKILL (tests/common/s3.rs: TERM_GRACE)
BATCH = 32              # files in the first batch
READERS = 2             # reader processes of an epoch
PUT_THREADS = 16        # PUTs in flight when uploading a tree of loose files
TOOLS = ("copy first", "archfs", "archfs nopreload", "ratarmount", "rclone+archfs")

# ---------------------------------------------------------------------------------------------
# Flags
# ---------------------------------------------------------------------------------------------


def add_args(ap):
    g = ap.add_argument_group("remote mode (--remote; issue 30)")
    g.add_argument("--remote", action="store_true", help="archfs on s3:// URLs over an emulated "
                   "network against copy-first, ratarmount and rclone (default 1,000 files, "
                   "1 run, 30 s cap a pass; --files, --runs, --cap, --jpeg apply)")
    g.add_argument("--remote-links", default="10ms/1gbit,50ms/1gbit,10ms/10gbit,50ms/10gbit",
                   help="link settings, round trip/rate (tc units; rate 'none' for no cap)")
    g.add_argument("--remote-formats", default="tar,zstd",
                   help="archives uploaded: tar, zstd, gzip (the bench's SquashFS images)")
    g.add_argument("--remote-tools", default=",".join(TOOLS),
                   help="comma-separated: " + ", ".join(TOOLS))
    g.add_argument("--remote-streams", type=int, default=8,
                   help="parallel ranged streams of the streaming limit (default 8, as the "
                   "node-local copy)")


def parse_links(spec):
    """'10ms/1gbit,50ms/none' -> [(label, rtt seconds, tc rate or None)]."""
    out = []
    for item in spec.split(","):
        if not item.strip():
            continue
        rtt, _, rate = item.strip().partition("/")
        secs = float(rtt[:-2]) / 1e3 if rtt.endswith("ms") else float(rtt.rstrip("s"))
        rate = None if rate in ("", "none") else rate
        out.append((item.strip(), secs, rate))
    return out


def rate_bytes(rate):
    """tc's rate units (kbit, mbit, gbit, bit, or bytes: kbps...) in bytes per second."""
    units = {"gbit": 1e9 / 8, "mbit": 1e6 / 8, "kbit": 1e3 / 8, "bit": 1 / 8,
             "gbps": 1e9, "mbps": 1e6, "kbps": 1e3, "bps": 1}
    for u, f in units.items():
        if rate.lower().endswith(u):
            return float(rate[:-len(u)]) * f
    return float(rate) / 8

# ---------------------------------------------------------------------------------------------
# The relay: packets between the two TUN devices, each held for half the round trip
# ---------------------------------------------------------------------------------------------


TUNSETIFF, TUNSETOFFLOAD = 0x400454CA, 0x400454D0
IFF_TUN, IFF_NO_PI, IFF_VNET_HDR = 0x0001, 0x1000, 0x4000
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6 = 1, 2, 4
VNET_HDR = 10           # struct virtio_net_hdr, the default TUNSETVNETHDRSZ
QUEUE_LIMIT = 256 << 20  # bytes held per direction before packets are dropped
# The counters page the relay writes and the bench reads (int64 slots).
SLOTS = ["delay_up_us", "delay_down_us", "get", "head", "other_req", "connections",
         "down_bytes", "up_bytes", "dropped", "packets"]
SLOT = {name: i for i, name in enumerate(SLOTS)}
METHODS = {b"GET ": "get", b"HEAD": "head", b"PUT ": "other_req", b"POST": "other_req",
           b"DELE": "other_req"}


def open_tun(name):
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(),
                                           IFF_TUN | IFF_NO_PI | IFF_VNET_HDR))
    fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6)
    return fd


def tcp_payload(pkt):
    """(offset of the TCP payload, its length, TCP flags) of an IPv4 TCP packet after the
    virtio-net header, else None."""
    ip = VNET_HDR
    if len(pkt) < ip + 40 or pkt[ip] >> 4 != 4 or pkt[ip + 9] != 6:
        return None
    tcp = ip + (pkt[ip] & 0xF) * 4
    start = tcp + (pkt[tcp + 12] >> 4) * 4
    total = int.from_bytes(pkt[ip + 2:ip + 4], "big")
    return start, ip + total - start, pkt[tcp + 13]


def count_up(c, pkt):
    """Host to server: requests by method, and new connections (SYN without ACK)."""
    t = tcp_payload(pkt)
    if t is None:
        return
    start, n, flags = t
    if flags & 0x12 == 0x02:
        c[SLOT["connections"]] += 1
    if n >= 4:
        m = METHODS.get(bytes(pkt[start:start + 4]))
        if m:
            c[SLOT[m]] += 1
    c[SLOT["up_bytes"]] += max(0, n)


def count_down(c, pkt):
    t = tcp_payload(pkt)
    if t is not None:
        c[SLOT["down_bytes"]] += max(0, t[1])


def pump(src, dst, counters, delay_slot, count):
    """Moves packets from src to dst, each after the delay in counters[delay_slot]."""
    q = collections.deque()
    queued = 0
    os.set_blocking(src, False)
    while True:
        now = time.monotonic()
        while q and q[0][0] <= now:
            _, pkt = q.popleft()
            queued -= len(pkt)
            try:
                os.write(dst, pkt)
            except OSError:
                pass
        timeout = max(0.0, q[0][0] - now) if q else 1.0
        if not select.select([src], [], [], timeout)[0]:
            continue
        delay = counters[delay_slot] / 1e6
        for _ in range(256):
            try:
                pkt = os.read(src, 65536 + 256)
            except BlockingIOError:
                break
            counters[SLOT["packets"]] += 1
            count(counters, pkt)
            if queued + len(pkt) > QUEUE_LIMIT:
                counters[SLOT["dropped"]] += 1
                continue
            q.append((time.monotonic() + delay, pkt))
            queued += len(pkt)


def helper_relay(argv):
    """_remote relay HOSTDEV NSDEV COUNTERS: create both TUN devices, print 'ready', then
    relay until killed (the devices go with the process)."""
    host, ns, path = argv
    fd_h, fd_n = open_tun(host), open_tun(ns)
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), 8 * len(SLOTS))
    counters = memoryview(mm).cast("q")
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    # The two directions in two threads: os.read and os.write release the GIL.
    down = threading.Thread(target=pump, daemon=True,
                            args=(fd_n, fd_h, counters, SLOT["delay_down_us"], count_down))
    down.start()
    pump(fd_h, fd_n, counters, SLOT["delay_up_us"], count_up)


class Counters:
    """The relay's counters page, as the bench reads it."""

    def __init__(self, path):
        self.path = path
        with open(path, "wb") as f:
            f.write(bytes(8 * len(SLOTS)))
        with open(path, "r+b") as f:
            self.mm = mmap.mmap(f.fileno(), 8 * len(SLOTS))
        self.c = memoryview(self.mm).cast("q")

    def set_delay(self, one_way):
        self.c[SLOT["delay_up_us"]] = self.c[SLOT["delay_down_us"]] = int(one_way * 1e6)

    def snap(self):
        return {name: self.c[i] for i, name in enumerate(SLOTS)}


def delta(a, b):
    """What the relay saw between snapshots a and b: GETs, other requests, MB down."""
    return {"gets": b["get"] - a["get"],
            "requests": sum(b[k] - a[k] for k in ("get", "head", "other_req")),
            "connections": b["connections"] - a["connections"],
            "mb": (b["down_bytes"] - a["down_bytes"]) / 1e6}

# ---------------------------------------------------------------------------------------------
# The network: namespace, TUN pair, addresses, shaping; undone by REG
# ---------------------------------------------------------------------------------------------


class Network:
    """The emulated link. In REG.targets (after every mount), so any exit path tears it down."""
    name = "emulated network"

    def __init__(self, tmp):
        self.tmp = tmp
        self.relay = None
        self.counters = None
        self.route = None
        self.host_ip = self.server_ip = None

    def start(self):
        self.teardown_leftovers()
        net = pick_subnet()
        prefix, last = net.rsplit(".", 1)
        self.host_ip, self.server_ip = f"{prefix}.{int(last) + 1}", f"{prefix}.{int(last) + 2}"
        self.route = f"{net}/30"
        self.counters = Counters(os.path.join(self.tmp, "relay-counters"))
        self.relay = subprocess.Popen(
            [sys.executable, SCRIPT, "_remote", "relay", DEV_HOST, DEV_NS, self.counters.path],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, start_new_session=True)
        if self.relay.stdout.readline().strip() != b"ready":
            raise SystemExit("the relay did not start (is /dev/net/tun there? root?)")
        # Nothing for these addresses leaves by another way, even once the devices are gone.
        ip(["route", "add", "unreachable", self.route])
        ip(["netns", "add", NETNS])
        ip(["link", "set", DEV_NS, "netns", NETNS])
        ip(["link", "set", DEV_HOST, "txqueuelen", "10000"])
        ip(["addr", "add", self.host_ip, "peer", self.server_ip, "dev", DEV_HOST])
        ip(["link", "set", DEV_HOST, "up"])
        ipn = ["-n", NETNS]
        ip(ipn + ["link", "set", DEV_NS, "txqueuelen", "10000"])
        ip(ipn + ["addr", "add", self.server_ip, "peer", self.host_ip, "dev", DEV_NS])
        ip(ipn + ["link", "set", DEV_NS, "up"])
        ip(ipn + ["link", "set", "lo", "up"])
        log(f"network: namespace {NETNS}, {self.host_ip} <-> {self.server_ip} over "
            f"{DEV_HOST}/{DEV_NS} (relay pid {self.relay.pid})")

    def shape(self, rtt, rate):
        """Half the round trip each way in the relay; tbf at `rate` on both devices."""
        self.counters.set_delay(rtt / 2)
        for pre, dev in (([], DEV_HOST), (["-n", NETNS], DEV_NS)):
            if rate is None:
                sh(["tc"] + pre + ["qdisc", "del", "dev", dev, "root"])
                continue
            bps = rate_bytes(rate)
            # burst: a millisecond at the rate, at least four 64 KiB packets; a queue of
            # 20 ms at the rate, at least 4 MiB.
            burst = max(int(bps / 1000), 256 << 10)
            limit = max(int(bps * 0.02), 4 << 20)
            cmd = ["tc"] + pre + ["qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                                  "burst", str(burst), "limit", str(limit)]
            r = sh(cmd)
            if r.returncode != 0:
                raise SystemExit(f"{' '.join(cmd)}: {r.stderr.strip()}")

    def notes(self):
        """What to say about the relay itself: its CPU time, packets it dropped."""
        c = self.counters.snap()
        cpu = proc_stats(self.relay.pid) if self.relay else None
        out = [f"the relay moved {c['packets']} packets with {cpu[0]:.1f} s of CPU"] if cpu else []
        if c["dropped"]:
            out.append(f"the relay dropped {c['dropped']} packets (queue over "
                       f"{QUEUE_LIMIT >> 20} MiB)")
        return out

    def teardown_leftovers(self):
        """A run that was SIGKILLed leaves its relay (which holds the devices), namespace
        and route: remove them."""
        for d in os.listdir("/proc"):
            cl = proc_cmdline(int(d)) if d.isdigit() else None
            if cl and "_remote" in cl and "relay" in cl and DEV_HOST in cl:
                os.kill(int(d), signal.SIGKILL)
        remove_netns()
        for net in SUBNETS:
            sh(["ip", "route", "del", "unreachable", f"{net}/30"])

    def unmount(self, force=False):
        """Teardown (the name REG calls): relay, namespace, route."""
        if self.relay:
            try:
                os.killpg(self.relay.pid, signal.SIGKILL)
            except OSError:
                pass
            self.relay.wait()
            self.relay = None
        remove_netns()
        if self.route:
            sh(["ip", "route", "del", "unreachable", self.route])
            self.route = None


def ip(args):
    r = sh(["ip"] + args)
    if r.returncode != 0:
        raise SystemExit(f"ip {' '.join(args)}: {r.stderr.strip()}")


def pick_subnet():
    """The first of SUBNETS that no address or route of this machine touches."""
    used = sh_out(["ip", "-4", "addr"]) + sh_out(["ip", "-4", "route"])
    for net in SUBNETS:
        if net.rsplit(".", 1)[0] + "." not in used:
            return net
    raise SystemExit(f"every candidate subnet is in use: {SUBNETS}")


def remove_netns():
    """SIGKILL to anything left in the namespace, then the namespace."""
    if NETNS not in sh_out(["ip", "netns", "list"]).split():
        return
    for pid in sh_out(["ip", "netns", "pids", NETNS]).split():
        if pid.isdigit():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass
    sh(["ip", "netns", "del", NETNS])

# ---------------------------------------------------------------------------------------------
# The S3 server: weed mini in the namespace, as tests/common/s3.rs starts it
# ---------------------------------------------------------------------------------------------


def identities():
    """The bench's identity (admin), and anonymous reads of the bench bucket (curl's
    streaming GETs need no signature)."""
    return json.dumps({"identities": [
        {"name": "archfs-bench", "credentials": [{"accessKey": ACCESS_KEY,
                                                  "secretKey": SECRET_KEY}],
         "actions": ["Admin", "Read", "List", "Tagging", "Write"]},
        {"name": "anonymous", "actions": [f"Read:{BUCKET}", f"List:{BUCKET}"]}]}, indent=1)


class S3Server:
    """weed mini in NETNS; in REG.targets before the network, so it stops first."""
    name = "s3 server"

    def __init__(self, tmp, net):
        self.dir = os.path.join(tmp, "s3")
        self.net = net
        self.proc = None
        self.endpoint = f"http://{net.server_ip}:{S3_PORT}"

    def weed_args(self):
        d = self.dir
        args = ["mini", f"-dir={d}/data", "-ip=127.0.0.1", "-ip.bind=0.0.0.0",
                "-master.telemetry=false", "-master.resumeState=false",
                "-volume.preStopSeconds=0", f"-filer.localSocket={d}/filer.sock",
                f"-s3.port={S3_PORT}", f"-s3.localSocket={d}/s3.sock",
                f"-s3.config={d}/s3.json", "-s3.port.iceberg=0", "-s3.port.lance=0",
                "-admin.ui=false", "-webdav=false"]
        return args + [f"-{flag}={port}" for flag, port in PORTS.items()]

    def start(self):
        weed = os.path.join(S3_VENV, "bin", "weed")
        shutil.rmtree(self.dir, ignore_errors=True)
        os.makedirs(os.path.join(self.dir, "data"))
        os.makedirs(os.path.join(self.dir, "home"))
        with open(os.path.join(self.dir, "s3.json"), "w") as f:
            f.write(identities())
        self.log = os.path.join(self.dir, "weed.log")
        t0 = time.time()
        with open(self.log, "ab") as lf:
            # Nothing of the machine's environment: weed takes AWS_* for an identity.
            self.proc = subprocess.Popen(
                ["ip", "netns", "exec", NETNS, weed] + self.weed_args(), cwd=self.dir,
                env={"PATH": "/usr/bin:/bin", "HOME": os.path.join(self.dir, "home")},
                stdin=subprocess.DEVNULL, stdout=lf, stderr=lf, start_new_session=True)
        s3_client(["wait", "60"], self.endpoint)
        while WEED_STARTED not in open(self.log, errors="replace").read():
            if self.proc.poll() is not None or time.time() - t0 > 90:
                raise SystemExit(f"weed did not start: see {self.log}")
            time.sleep(0.05)
        log(f"s3 server: weed mini in {NETNS} at {self.endpoint} ({time.time() - t0:.1f} s)")

    def upload(self, paths):
        """name -> local path; returns name -> object key."""
        s3_client(["mb", BUCKET], self.endpoint)
        keys = {}
        for name, path in paths.items():
            key = os.path.basename(path)
            t0 = time.time()
            s3_client(["put", BUCKET, key, path], self.endpoint)
            log(f"  uploaded {key} ({os.path.getsize(path) / 1e6:.0f} MB, "
                f"{time.time() - t0:.1f} s)")
            keys[name] = key
        return keys

    def upload_tree(self, prefix, path):
        """Every file under directory `path` as PREFIX/RELATIVE PATH, in parallel (a
        dataset of loose files: one PUT each); returns the number of objects."""
        t0 = time.time()
        n = int(s3_client(["putdir", BUCKET, prefix, path], self.endpoint).split()[-1])
        log(f"  uploaded {n} files under {prefix}/ ({tree_bytes(path) / 1e6:.0f} MB, "
            f"{time.time() - t0:.1f} s, {PUT_THREADS} in flight)")
        return n

    def unmount(self, force=False):
        """Stop (the name REG calls): SIGTERM to weed's group, SIGKILL after the grace."""
        if not self.proc:
            return
        pg = self.proc.pid
        for sig, wait in ((signal.SIGTERM, WEED_GRACE), (signal.SIGKILL, 10)):
            try:
                os.killpg(pg, sig)
            except OSError:
                break
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                log(f"s3 server: weed outlived {sig.name} by {wait} s")
        self.proc = None
        for f in os.listdir("/tmp"):
            if f.startswith("seaweedfs-") and f.endswith(".sock") and \
                    any(f.endswith(f"-{p}.sock") for p in PORTS.values()):
                try:
                    os.unlink(os.path.join("/tmp", f))
                except OSError:
                    pass


def s3_client(argv, endpoint):
    """Runs `_remote s3 ...` (below) with the S3 venv's Python, which has boto3."""
    env = dict(aws_env(endpoint), PATH="/usr/bin:/bin")
    r = subprocess.run([os.path.join(S3_VENV, "bin", "python"), SCRIPT, "_remote", "s3"] + argv,
                       env=env, capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise SystemExit(f"s3 client {argv[:2]}: {r.stderr.strip()[-600:]}")
    return r.stdout


def tree_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def put_tree(c, bucket, prefix, root):
    """PUTs every file under root as PREFIX/RELATIVE PATH, PUT_THREADS at a time (a
    dataset of loose files is one small PUT a file: one at a time, each waits for its
    own round trips); checks that the listing holds them all, each of its size.
    Returns how many."""
    from concurrent.futures import ThreadPoolExecutor
    files = {}
    for d, _, names in os.walk(root):
        for name in names:
            p = os.path.join(d, name)
            files[f"{prefix}/{os.path.relpath(p, root)}"] = p
    with ThreadPoolExecutor(PUT_THREADS) as pool:
        list(pool.map(lambda kv: c.upload_file(kv[1], bucket, kv[0]), files.items()))
    listed = {}
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        listed.update((o["Key"], o["Size"]) for o in page.get("Contents", []))
    wrong = [k for k, p in files.items() if listed.get(k) != os.path.getsize(p)]
    if wrong:
        raise SystemExit(f"{len(wrong)} of {len(files)} files not uploaded whole: {wrong[:3]}")
    return len(files)


def helper_s3(argv):
    """_remote s3 wait SECS | mb BUCKET | put BUCKET KEY PATH | putdir BUCKET PREFIX DIR:
    boto3, the independent client, with the AWS_* variables the bench sets."""
    import boto3
    from botocore.config import Config
    c = boto3.client("s3", config=Config(s3={"addressing_style": "path"},
                                         retries={"mode": "standard", "max_attempts": 5},
                                         max_pool_connections=PUT_THREADS))
    op, args = argv[0], argv[1:]
    if op == "wait":
        end = time.monotonic() + float(args[0])
        while True:
            try:
                c.list_buckets()
                return
            except Exception as e:  # noqa: BLE001 - not serving yet
                if time.monotonic() > end:
                    raise SystemExit(f"not serving: {e!r}")
                time.sleep(0.05)
    elif op == "mb":
        c.create_bucket(Bucket=args[0])
    elif op == "put":
        c.upload_file(args[2], args[0], args[1])
        size = c.head_object(Bucket=args[0], Key=args[1])["ContentLength"]
        if size != os.path.getsize(args[2]):
            raise SystemExit(f"uploaded {size} bytes of {os.path.getsize(args[2])}")
    elif op == "putdir":
        print(put_tree(c, args[0], args[1], args[2]))


def aws_env(endpoint):
    """The AWS_* variables that point every tool at the bench's server, and nothing of the
    machine's own AWS configuration."""
    return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_ENDPOINT_URL": endpoint, "AWS_REGION": REGION, "AWS_DEFAULT_REGION": REGION,
            "AWS_CONFIG_FILE": "/nonexistent/archfs-bench", "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/archfs-bench",
            # s3fs (ratarmount's fsspec backend) takes its endpoint from here too.
            "FSSPEC_S3_ENDPOINT_URL": endpoint}


def helper(argv):
    """`bench _remote relay|s3 ...`: the remote bench's helper processes."""
    {"relay": helper_relay, "s3": helper_s3}[argv[0]](argv[1:])

# ---------------------------------------------------------------------------------------------
# The tools: how each gets from a URL to a mounted tree
# ---------------------------------------------------------------------------------------------


def fresh_dir(tmp):
    """`tmp` empty, after unmounting what a run that died left mounted under it."""
    for mp in mounted_paths():
        if mp.startswith(tmp + "/"):
            log(f"stale mount {mp}: unmounting")
            force_unmount(mp)
    remove(tmp)
    os.makedirs(tmp)
    return tmp


def remove(path):
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


class Foreground(Target):
    """A FUSE server that does not return once mounted (ratarmount on a URL: its fsspec
    threads forbid daemonizing; rclone mount): started in the background, mounted once the
    tree lists."""
    proc = None

    def mount(self):
        os.makedirs(self.mnt, exist_ok=True)
        self.logfile = self.mnt + ".log"
        t0 = time.perf_counter()
        with open(self.logfile, "ab") as lf:
            self.proc = subprocess.Popen(self.mount_cmd(), stdin=subprocess.DEVNULL, stdout=lf,
                                         stderr=lf, start_new_session=True)
        self.pids = [self.proc.pid]
        while not self.lists():
            rc = self.proc.poll()
            if rc is not None:
                self.unmount(force=True)
                raise Failed(f"{self.name} exited {rc}: {self.log_tail()}")
            if time.perf_counter() - t0 > self.cap:
                self.unmount(force=True)
                raise Timeout("mount")
            time.sleep(0.002)
        return time.perf_counter() - t0

    def lists(self):
        try:
            return bool(os.listdir(self.mnt))
        except OSError:
            return False

    def unmount(self, force=False):
        super().unmount(force)
        if self.proc:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            self.proc = None


class RatarmountUrl(Foreground, Ratarmount):
    def __init__(self, name, url, mnt, cap, index):
        Ratarmount.__init__(self, name, url, mnt, cap)
        self.index = index

    def index_path(self):
        return self.index

    def mount_cmd(self):
        return [os.path.join(VENV, "bin", "ratarmount"), "-f", "--index-file", self.index,
                self.source, self.mnt]


class Rclone(Foreground):
    def __init__(self, mnt, cap, cache_dir, conf):
        super().__init__("rclone", BUCKET, mnt, cap)
        self.cache_dir, self.conf = cache_dir, conf

    def mount_cmd(self):
        return ["rclone", "mount", f"abench:{BUCKET}", self.mnt, "--config", self.conf,
                "--read-only", "--vfs-cache-mode", "full", "--cache-dir", self.cache_dir]


class RcloneArchfs(Target):
    """rclone's mount of the bucket, and archfs on the object inside it."""

    def __init__(self, name, rclone, archfs):
        super().__init__(name, archfs.source, archfs.mnt, archfs.cap)
        self.rclone, self.archfs = rclone, archfs

    def mount(self):
        secs = self.rclone.mount()
        try:
            secs += self.archfs.mount()
        except (Failed, Timeout):
            self.rclone.unmount(force=True)
            raise
        self.pids = self.archfs.pids + self.rclone.pids
        return secs

    def unmount(self, force=False):
        self.archfs.unmount(force)
        self.rclone.unmount(force)
        self.pids = []


class Tool:
    """One way from the object to a tree: its mount (a Target), what a fresh node has not
    got (saved indexes, caches) and, for copy first, the copy made before mounting."""

    def __init__(self, name, target, indexes=(), caches=(), copy=None):
        self.name, self.target, self.copy = name, target, copy
        self.indexes, self.caches = list(indexes), list(caches)

    def reset(self, keep_index=False):
        for p in self.caches + ([] if keep_index else self.indexes):
            remove(p)

    def prepare(self):
        """Seconds spent before mounting: `aws s3 cp` of the object for copy first."""
        if not self.copy:
            return 0.0
        url, dest = self.copy
        remove(dest)
        t0 = time.perf_counter()
        try:
            r = sh([os.path.join(VENV, "bin", "aws"), "s3", "cp", "--only-show-errors", url,
                    dest], timeout=self.target.cap)
        except subprocess.TimeoutExpired:
            raise Timeout("aws s3 cp")
        if r.returncode != 0:
            raise Failed(f"aws s3 cp: {r.stderr.strip()[-300:]}")
        return time.perf_counter() - t0

    def cleanup(self):
        self.target.unmount(force=True)
        if self.copy:
            remove(self.copy[1])
        self.reset()


def make_tools(args, names, fmt, key, url, d, archfs_bin, extra):
    """The tools of `names` for one archive: d is a scratch directory of this archive."""
    tar = fmt == "tar"
    cap = args.cap

    def idx(tag):
        return os.path.join(d, f"{tag}.archfs-index")

    def archfs(name, source, tag, more=()):
        a = Archfs(name, source, os.path.join(d, "mnt-" + tag), cap, archfs_bin,
                   (["--index", idx(tag)] if tar else []) + list(more) + extra)
        a.has_index = tar
        return a
    out = []
    for name in names:
        if name == "copy first":
            local = os.path.join(d, "copy", key)
            os.makedirs(os.path.dirname(local), exist_ok=True)
            out.append(Tool(name, archfs(name, local, "copy"), [idx("copy")], copy=(url, local)))
        elif name == "archfs":
            out.append(Tool(name, archfs(name, url, "url"), [idx("url")]))
        elif name == "archfs nopreload":
            out.append(Tool(name, archfs(name, url, "never", ["--preload=never"]),
                            [idx("never")]))
        elif name == "ratarmount" and tar:
            index = os.path.join(d, "ratarmount.index.sqlite")
            out.append(Tool(name, RatarmountUrl(name, url, os.path.join(d, "mnt-rat"), cap,
                                                index), [index]))
        elif name == "rclone+archfs":
            cache = os.path.join(d, "rclone-cache")
            rc = Rclone(os.path.join(d, "mnt-bucket"), cap, cache, os.path.join(d, "rclone.conf"))
            open(rc.conf, "w").close()
            inner = archfs(name, os.path.join(rc.mnt, key), "rclone")
            out.append(Tool(name, RcloneArchfs(name, rc, inner), [idx("rclone")], [cache]))
    return out

# ---------------------------------------------------------------------------------------------
# The measurement
# ---------------------------------------------------------------------------------------------


class RemoteBench:
    """Runs every tool through its passes at every link setting; results in self.res."""

    def __init__(self, args, net, server, manifest, tmp, spans):
        self.args, self.net, self.server = args, net, server
        self.manifest = manifest
        self.spans = spans  # file -> (offset, size) of its data in data.tar
        self.tmp = tmp
        self.res = {}     # link -> archive -> tool -> metric -> [values]
        self.notes = []

    def rec(self, link, fmt, tool, metric, value):
        self.res.setdefault(link, {}).setdefault(fmt, {}).setdefault(tool, {}) \
            .setdefault(metric, []).append(value)

    def note(self, msg):
        if msg not in self.notes:
            self.notes.append(msg)
        log("  " + msg)

    def orders(self, run):
        """This run's lists: the first batch's files, the cold and the warm epoch's."""
        rnd = random.Random(self.args.seed * 7919 + run)
        out = {}
        for name in ("batch", "cold", "warm"):
            order = list(self.manifest)
            rnd.shuffle(order)
            if name == "batch":
                order = order[:BATCH]
            out[name] = (os.path.join(self.tmp, f"remote-{name}.tsv"), order)
            write_list(out[name][0], order)
        return out

    def stream(self, link, fmt, url, size):
        """The link's limit: the whole object by curl, one stream, then N ranged streams."""
        n = self.args.remote_streams
        for label, parts in (("1 stream", 1), (f"{n} streams", n)):
            step = -(-size // parts)
            ranges = [["-r", f"{i * step}-{min(size, (i + 1) * step) - 1}"] if parts > 1 else []
                      for i in range(parts)]
            cmds = [["curl", "-sS", "-f", "-o", "/dev/null", "-w", "%{size_download}", *r, url]
                    for r in ranges]
            a = self.net.counters.snap()
            t0 = time.perf_counter()
            procs = [subprocess.Popen(c, stdout=subprocess.PIPE, text=True) for c in cmds]
            got = sum(int(p.communicate()[0] or 0) for p in procs)
            secs = time.perf_counter() - t0
            if got != size or any(p.returncode for p in procs):
                self.note(f"{link} {fmt}: curl {label}: {got} of {size} bytes")
                continue
            self.rec(link, fmt, "stream", label, secs)
            seen = delta(a, self.net.counters.snap())
            self.rec(link, fmt, "stream", label + " gets", seen["gets"])

    def batch_floor(self, link, fmt, url, size, run):
        """What the link allows a first batch: the batch's files fetched by curl one after
        another (as one reader reads them), each one ranged GET of its span in data.tar
        (the same sizes in the image), on one kept-alive connection warmed by one GET
        first, as archfs's reads ride on the connection its mount used. The mount's own
        round trips come on top."""
        order = self.orders(run)["batch"][1]
        each = ["-sS", "-f", "-o", "/dev/null", "-w", "%{time_total}\n"]
        cmd = ["curl", *each, "-r", "0-8191", url]
        for rel, _ in order:
            at, n = self.spans[rel]
            at = max(0, min(at, size - n))
            cmd += ["--next", *each, "-r", f"{at}-{at + n - 1}", url]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        times = [float(x) for x in r.stdout.split()]
        if r.returncode or len(times) != len(order) + 1:
            self.note(f"{link} {fmt}: curl batch floor failed: {r.stderr.strip()[:200]}")
            return
        self.rec(link, fmt, "stream", "batch floor", sum(times[1:]))

    def measure(self, link, fmt, tool, run):
        lists = self.orders(run)
        t = tool.target
        R = {}

        def mark(metric, value):
            R[metric] = value
            self.rec(link, fmt, tool.name, metric, value)

        def count(prefix, a, b):
            for k, v in delta(a, b).items():
                mark(f"{prefix}_{k}", v)

        def mounting(metric, snaps):
            def go():
                snaps.append(self.net.counters.snap())
                mark(metric, t.mount())
                snaps.append(self.net.counters.snap())
            return go

        def reads(name, readers, before_go=None):
            path, order = lists[name]
            wall, _ = read_pass(t.root, path, readers, lambda: time.time() + self.args.cap,
                                len(order), sum(s for _, s in order), before_go=before_go)
            return wall

        tool.reset()
        a = self.net.counters.snap()
        prep = tool.prepare()
        if tool.copy:
            mark("copy_s", prep)
            count("copy", a, self.net.counters.snap())
        # Pass 1: a fresh mount, the first batch.
        s1 = []
        wall = reads("batch", 1, mounting("mount_s", s1))
        mark("batch_s", prep + R["mount_s"] + wall)
        count("batch", s1[0], self.net.counters.snap())
        t.unmount()
        # Pass 2: a fresh mount again (nothing saved), a cold epoch, a warm one.
        tool.reset()
        s2 = []
        mark("cold_s", reads("cold", READERS, mounting("mount2_s", s2)))
        c = self.net.counters.snap()
        mark("first_epoch_s", prep + R["mount2_s"] + R["cold_s"])
        count("cold", s2[0], c)
        mark("warm_s", reads("warm", READERS))
        w = self.net.counters.snap()
        count("warm", c, w)
        cpu, hwm = t.stats()
        if cpu is not None:
            mark("cpu_s", cpu)
            mark("rss_mib", hwm)
        t.unmount()
        count("after", w, self.net.counters.snap())
        # A tar, pass 3: a later job on a fresh node that finds the index pass 2 saved (in
        # a shared ~/.cache): a fresh mount, the first batch (copy first: its copy again).
        if fmt == "tar":
            tool.reset(keep_index=True)
            s3 = []
            wall = reads("batch", 1, mounting("remount_s", s3))
            mark("batch_idx_s", prep + R["remount_s"] + wall)
            t.unmount()

    def guarded(self, link, fmt, tool, run):
        try:
            self.measure(link, fmt, tool, run)
            return
        except Timeout as e:
            marker, msg = "timeout", f"over the {self.args.cap:g} s cap ({e})"
        except Failed as e:
            marker, msg = "error", str(e)
        finally:
            tool.cleanup()
        self.note(f"{link} {fmt} {tool.name}: {msg}")
        # The first pass without a figure is the one that failed; later ones did not run.
        got = self.res.get(link, {}).get(fmt, {}).get(tool.name, {})
        passes = ("batch_s", "cold_s", "warm_s") + (("batch_idx_s",) if fmt == "tar" else ())
        failed = next((m for m in passes if len(got.get(m, [])) <= run), None)
        for m in {"cold_s": ["cold_s", "first_epoch_s"]}.get(failed, [failed] if failed else []):
            self.rec(link, fmt, tool.name, m, marker)

    def run(self, links, keys, tools_for):
        """Every run: every link setting, every archive, the streams, then every tool."""
        for run in range(self.args.runs):
            for label, rtt, rate in links:
                log(f"=== run {run + 1}/{self.args.runs}, link {label}")
                self.net.shape(rtt, rate)
                for fmt, (key, size) in keys.items():
                    url = f"{self.server.endpoint}/{BUCKET}/{key}"
                    self.stream(label, fmt, url, size)
                    self.batch_floor(label, fmt, url, size, run)
                    for tool in tools_for[fmt]:
                        t0 = time.time()
                        self.guarded(label, fmt, tool, run)
                        log(f"  {fmt} {tool.name}: {time.time() - t0:.1f} s")

# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def fmt_s(v, cap=None):
    if v is None:
        return "—"
    if v == "timeout" and cap:
        return f"> {cap:g} (cap)"
    return v if isinstance(v, str) else f"{v:.2f}"


def fmt_io(r, prefix):
    g, mb, c = (median_or_failure(r.get(f"{prefix}_{m}"))
                for m in ("gets", "mb", "connections"))
    if not all(isinstance(x, (int, float)) for x in (g, mb, c)):
        return "—"
    return f"{g:.0f} / {mb:.0f} ({c:.0f})"


def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows])


def tool_rows(res, cap):
    hdr = ["tool", "copy s", "mount s", "first batch s", "first batch, saved index s (mount)",
           "cold epoch s", "to end of first epoch s", "warm epoch s",
           "GETs / MB (connections): first batch", "to end of first epoch", "warm epoch",
           "after", "server peak RSS MiB", "server CPU s"]
    rows = []
    for name, r in res.items():
        if name == "stream":
            continue
        first = fmt_io(r, "cold")
        if "copy_gets" in r:
            first = f"{fmt_io(r, 'copy')} (copy)"
        rss = median_or_failure(r.get("rss_mib"))
        def f(m):
            return fmt_s(median_or_failure(r.get(m)), cap)
        idx = f("batch_idx_s") + (f" ({f('remount_s')})" if "remount_s" in r else "")
        rows.append([name, f("copy_s"), f("mount_s"), f("batch_s"), idx, f("cold_s"),
                     f("first_epoch_s"), f("warm_s"),
                     fmt_io(r, "batch"), first,
                     fmt_io(r, "warm"), fmt_io(r, "after"),
                     "—" if rss is None else f"{rss:.0f}", f("cpu_s")])
    return hdr, rows


def ratios(res, n, size, cap):
    """archfs (and archfs --preload=never) against each peer; every tool against the
    streaming limit."""
    out = []

    def val(tool, m):
        return median_or_failure(res.get(tool, {}).get(m))
    for mine in ("archfs", "archfs nopreload"):
        if mine not in res:
            continue
        for peer in ("copy first", "ratarmount", "rclone+archfs"):
            if peer not in res:
                continue
            parts = []
            for m, label in (("batch_s", "first batch"),
                             ("batch_idx_s", "first batch from a saved index"),
                             ("first_epoch_s", "end of first epoch"), ("warm_s", "warm epoch")):
                a, b = val(mine, m), val(peer, m)
                if a is None or b is None:
                    continue
                if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0:
                    parts.append(f"{label} **{a / b:.2f}×** ({a:.2f} vs {b:.2f} s)")
                elif isinstance(a, (int, float)) and b == "timeout":
                    parts.append(f"{label} **< {a / cap:.2f}×** ({a:.2f} s vs over the "
                                 f"{cap:g} s cap)")
                else:
                    parts.append(f"{label} n/a ({fmt_s(a, cap)} vs {fmt_s(b, cap)})")
            out.append(f"- {mine} / {peer}: " + "; ".join(parts))
    s1, sn = val("stream", "1 stream"), val("stream", f"{n} streams")
    if isinstance(s1, float) and isinstance(sn, float):
        out.append(f"- streaming the object once ({size / 1e6:.0f} MB, curl): 1 stream "
                   f"{s1:.2f} s ({size / 1e6 / s1:.0f} MB/s), {n} ranged streams {sn:.2f} s "
                   f"({size / 1e6 / sn:.0f} MB/s)")
        best = min(s1, sn)
        for tool in res:
            v = val(tool, "first_epoch_s")
            if tool != "stream" and isinstance(v, (int, float)):
                out.append(f"- {tool}: end of first epoch / streaming once (the faster): "
                           f"**{v / best:.2f}×** ({v:.2f} vs {best:.2f} s)")
    floor = val("stream", "batch floor")
    if isinstance(floor, float):
        out.append(f"- the link's floor for a first batch (curl: the batch's {BATCH} files one "
                   f"after another, one ranged GET each, one warm connection, idle link; "
                   f"no mount): {floor:.2f} s")
        for tool in res:
            saved = val(tool, "batch_idx_s")
            v = val(tool, "batch_s") if saved is None else saved
            if tool not in ("stream", "copy first") and isinstance(v, (int, float)):
                what = "first batch" + ("" if saved is None else " from a saved index")
                out.append(f"- {tool}: {what} / the link's floor: **{v / floor:.2f}×** "
                           f"({v:.2f} vs {floor:.2f} s)")
    return out


def report(b, args, links, keys, header):
    lines = header + [""]
    for label, _, _ in links:
        for fmt, (key, size) in keys.items():
            res = b.res.get(label, {}).get(fmt, {})
            hdr, rows = tool_rows(res, args.cap)
            lines += [f"### Link {label}: {key} ({size / 1e6:.0f} MB)", "", table(hdr, rows), ""]
            lines += ratios(res, args.remote_streams, size, args.cap) + [""]
    if b.notes:
        lines += ["### Unavailable, failed, timed out", ""] + [f"- {x}" for x in b.notes] + [""]
    return "\n".join(lines)


def header(args, archfs_bin, manifest, keys, unavailable):
    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo")
                if x.startswith("model name")), "?")
    vpy = [VPY, "-c", "import importlib.metadata as m, sys; "
           "print(', '.join(f'{p} {m.version(p)}' for p in sys.argv[1:]))",
           "ratarmount", "ratarmountcore", "s3fs", "fsspec", "awscli", "botocore"]
    rd = sh_out(["sysctl", "-n", "net.ipv4.tcp_rmem"]).split()
    wr = sh_out(["ip", "netns", "exec", NETNS, "sysctl", "-n", "net.ipv4.tcp_wmem"]).split()
    dirty = sh_out(["git", "-C", REPO, "status", "--porcelain", "src"])
    versions = [
        f"archfs: {sh_out([archfs_bin, '--version'])} ({archfs_bin}; "
        f"{sh_out(['git', '-C', REPO, 'log', '-1', '--format=%h %s'])[:100]}"
        f"{' + uncommitted changes in src/' if dirty else ''})",
        f"python packages (bench venv): {sh_out(vpy)}",
        f"rclone: {sh_out(['rclone', 'version']).splitlines()[0]}",
        f"weed: {sh_out([os.path.join(S3_VENV, 'bin', 'weed'), 'version']).splitlines()[0]}",
        f"cpu: {cpu}, nproc {os.cpu_count()}; kernel {os.uname().release}",
        f"TCP buffers: client tcp_rmem max {rd[-1] if rd else '?'} B, server tcp_wmem max "
        f"{wr[-1] if wr else '?'} B (this machine's defaults)"]
    total = sum(s for _, s in manifest)
    sizes = ", ".join(f"{k} {s / 1e6:.0f} MB" for k, s in keys.values())
    method = (f"{len(manifest)} files ({'noise JPEGs' if args.jpeg else 'JPEG-like random bytes'}"
              f", {total / 1e6:.0f} MB; {sizes}); medians of {args.runs} run(s); cap "
              f"{args.cap:g} s a pass. Links: RTT/rate, the RTT made by a user-space relay "
              "between two TUN devices (no netem in this kernel), the rate by tc tbf on both. "
              "Each tool starts from nothing on the node (no copy, no saved index, empty "
              "caches). first batch = copy + mount + one reader's first 32 files of a "
              "shuffled order (pass 1); cold epoch = 2 reader processes, every file in "
              "shuffled order, from the mount being live, on a second fresh mount (pass 2); "
              "to end of first epoch = copy + mount + cold epoch of pass 2; warm = again on "
              "the same mount. GETs / MB: requests starting with GET and TCP payload bytes "
              "towards the node, as the relay saw them; 'to end of first epoch' runs from "
              "the mount command (copy first: the copy's), 'after' from the warm epoch's end "
              "to the unmount (background copies still running). Page cache not dropped: "
              "the server's files stay cached. Ratios: time of archfs / time of the peer "
              "(below 1: archfs faster).")
    return [f"## archfs remote benchmark, {time.strftime('%Y-%m-%d')}", "", "```"] + \
        versions + ["```", "", method, ""] + [f"- {u}" for u in unavailable]

# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def ensure_deps(args):
    """The bench venv with ratarmount (deps.ensure_venv), plus the AWS CLI and s3fs; rclone
    from Debian; weed and boto3 from target/s3-venv (scripts/setup). Returns what is
    missing, as notes."""
    missing = []
    ns = argparse_copy(args, no_torch=True)
    ensure_venv(ns)
    if not os.path.exists(os.path.join(VENV, "bin", "aws")) or not venv_has("s3fs, boto3"):
        log("pip install awscli s3fs boto3 (bench venv)")
        subprocess.run([VPY, "-m", "pip", "install", "-q", "awscli", "s3fs", "boto3"])
    if not shutil.which("rclone"):
        log("apt-get install rclone")
        sh(["apt-get", "install", "-y", "-qq", "rclone"], timeout=900,
           env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
    for exe, why in ((os.path.join(S3_VENV, "bin", "weed"), "run scripts/setup"),
                     (shutil.which("mksquashfs") or "mksquashfs", "run scripts/setup"),
                     (os.path.join(VENV, "bin", "aws"), "pip install awscli failed")):
        if not os.path.exists(exe):
            raise SystemExit(f"{exe} missing: {why}")
    if not venv_has("s3fs"):
        missing.append("ratarmount: s3fs did not install (pip install s3fs)")
    if not shutil.which("rclone"):
        missing.append("rclone: not installed (apt-get install rclone)")
    if not shutil.which("curl"):
        raise SystemExit("curl missing (apt-get install curl)")
    return missing


def argparse_copy(args, **kw):
    import argparse
    ns = argparse.Namespace(**vars(args))
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def tar_spans(tar):
    """file -> (offset, size) of its data in the tar."""
    import tarfile
    with tarfile.open(tar) as t:
        return {m.name: (m.offset_data, m.size) for m in t if m.isfile()}


def set_env(endpoint):
    """Every tool this run starts reads these: the AWS_* of aws_env (the machine's own are
    removed: a CA bundle makes rclone's S3 client fail on plain http) and rclone's remote."""
    for k in list(os.environ):
        if k.startswith("AWS_") or k.startswith("RCLONE_"):
            del os.environ[k]
    os.environ.update(aws_env(endpoint))
    os.environ.update({"RCLONE_CONFIG_ABENCH_TYPE": "s3", "RCLONE_CONFIG_ABENCH_PROVIDER": "Other",
                       "RCLONE_CONFIG_ABENCH_ENV_AUTH": "false",
                       "RCLONE_CONFIG_ABENCH_ACCESS_KEY_ID": ACCESS_KEY,
                       "RCLONE_CONFIG_ABENCH_SECRET_ACCESS_KEY": SECRET_KEY,
                       "RCLONE_CONFIG_ABENCH_ENDPOINT": endpoint,
                       "RCLONE_CONFIG_ABENCH_REGION": REGION})


def start_server(tmp, paths):
    """The emulated network and SeaweedFS behind it (both torn down by REG on any exit),
    every tool pointed at it, `paths` (name -> file) uploaded while the link is not
    shaped; (network, server, name -> object key)."""
    net = Network(tmp)
    REG.targets.append(net)
    net.start()
    server = S3Server(tmp, net)
    REG.targets.insert(REG.targets.index(net), server)
    server.start()
    set_env(server.endpoint)
    net.shape(0, None)
    return net, server, server.upload(paths)


def main(args):
    links = parse_links(args.remote_links)
    formats = [f.strip() for f in args.remote_formats.split(",") if f.strip()]
    names = [n.strip() for n in args.remote_tools.split(",") if n.strip()]
    bad = [n for n in names if n not in TOOLS] + \
        [f for f in formats if f not in ("tar", "zstd", "gzip")]
    if bad or not links:
        raise SystemExit(f"--remote: unknown {bad or 'links'}")
    archfs_bin = find_archfs(args)
    unavailable = ensure_deps(args)
    if "ratarmount" in names and "tar" not in formats:
        unavailable.append("ratarmount: run on the tar only (--remote-formats has none)")
    key = f"ds-{'jpeg' if args.jpeg else 'raw'}-{args.files}f-{args.classes}c-s{args.seed}"
    ds = os.path.join(args.workdir, key)
    os.makedirs(ds, exist_ok=True)
    src, mpath = build_dataset(args, ds)
    paths = build_artifacts(ds, src, args.classes)
    manifest = read_manifest(mpath)
    tmp = fresh_dir(os.path.join(args.workdir, "remote"))

    net, server, uploaded = start_server(tmp, {f: paths[f] for f in formats})
    keys = {f: (uploaded[f], os.path.getsize(paths[f])) for f in formats}
    extra = args.archfs_args.split()
    tools_for = {}
    for fmt in formats:
        d = os.path.join(tmp, fmt)
        os.makedirs(d)
        url = f"s3://{BUCKET}/{keys[fmt][0]}"
        tools_for[fmt] = make_tools(args, names, fmt, keys[fmt][0], url, d, archfs_bin, extra)
        for t in tools_for[fmt]:
            REG.targets.insert(0, t.target)
    b = RemoteBench(args, net, server, manifest, tmp, tar_spans(paths["tar"]))
    b.run(links, keys, tools_for)
    unavailable += net.notes()
    save(args.out, report(b, args, links, keys, header(args, archfs_bin, manifest, keys,
                                                       unavailable)),
         {"args": vars(args), "links": links, "archives": keys, "results": b.res,
          "notes": b.notes, "unavailable": unavailable})
    log(f"wrote {args.out}")
