"""One copy of a remote archive per node, for every process of a job: mounts without
--shared, in-process readers (archfs.open_archive) in forked and spawned workers, as
DataLoader starts them. Against a real S3 server (test_remote's), behind a proxy in this
test that counts the bytes the server sent; as root inside a memory cgroup smaller than
two copies (the OOM killer's count read from the cgroup), and as an ordinary user.

A job's processes are told apart from another job's by SLURM_JOB_ID, as on a cluster:
each test runs as a job of its own."""

import contextlib
import json
import random
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import zlib
from pathlib import Path

import pytest

from archfs._binary import find_archfs
from test_archfs import DEADLINE, wait_for  # noqa: E402 - the suite's own helpers
from test_remote import s3  # noqa: F401 - the module's S3 server (a fixture)

ROOT = os.geteuid() == 0
MiB = 1 << 20
# The object the ranks share: ImageFolder-like, 10 classes of ~110 KiB files.
SIZE = int(os.environ.get("ARCHFS_TEST_NODE_MIB", "1024")) * MiB
FILE = 110 << 10


class CountingProxy:
    """Forwards TCP connections to the S3 server, counting the bytes it sends back;
    `rate` (bytes/s), when given, paces them, so a copy takes a while."""

    def __init__(self, upstream_port, rate=None):
        self.sent = 0
        self.rate = rate
        self.lock = threading.Lock()
        self.started = time.monotonic()
        self.listener = socket.socket()
        # Its connections too (they inherit it): a resume binds the port while they end.
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(256)
        self.port = self.listener.getsockname()[1]
        self.upstream = upstream_port
        self.open = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self):
        return f"http://127.0.0.1:{self.port}"

    def resume(self):
        """The server is back, at the same address."""
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", self.port))
        self.listener.listen(256)
        threading.Thread(target=self._accept, daemon=True).start()

    def reset(self):
        with self.lock:
            self.sent = 0
            self.started = time.monotonic()

    def stop(self):
        """The server is gone: no connection is taken or kept."""
        # shutdown, not close alone: a close leaves the accept under way listening.
        self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        for s in list(self.open):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
                server = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:
                return
            self.open += [client, server]
            pair = [client, server, 2]  # the pumps still using the two sockets
            for a, b, down in [(client, server, False), (server, client, True)]:
                threading.Thread(target=self._pump, args=(a, b, down, pair),
                                 daemon=True).start()

    def _pump(self, src, dst, down, pair):
        buf = bytearray(1 << 20)
        try:
            while True:
                n = src.recv_into(buf)
                if n == 0:
                    break
                if down:
                    with self.lock:
                        self.sent += n
                        ahead = self.sent / self.rate - (time.monotonic() - self.started) \
                            if self.rate else 0
                    if ahead > 0:
                        time.sleep(ahead)
                dst.sendall(memoryview(buf)[:n])
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            # The last pump of a connection closes it: a test's thousands of requests
            # otherwise left pytest holding descriptors past select()'s 1024.
            with self.lock:
                pair[2] -= 1
                last = pair[2] == 0
                if last:
                    self.open = [s for s in self.open if s is not src and s is not dst]
            if last:
                src.close()
                dst.close()


class MemoryCgroup:
    """A cgroup with a hard memory limit under this process's own (v1, as on these
    machines, or v2); processes started with `preexec` run in it from their first
    instruction."""

    def __init__(self, limit):
        own = Path("/proc/self/cgroup").read_text().splitlines()
        v1 = [line.split(":memory:", 1)[1] for line in own if ":memory:" in line]
        name = f"archfs-node-copy-{os.getpid()}"
        if v1:
            self.path = Path("/sys/fs/cgroup/memory") / v1[0].lstrip("/") / name
            self.v2 = False
        else:
            rel = next(line[3:] for line in own if line.startswith("0::"))
            parent = Path("/sys/fs/cgroup") / rel.lstrip("/")
            (parent / "cgroup.subtree_control").write_text("+memory")
            self.path = parent / name
            self.v2 = True
        self.path.mkdir()
        (self.path / ("memory.max" if self.v2 else "memory.limit_in_bytes")).write_text(str(limit))

    def preexec(self):
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def procs(self):
        return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]

    def stat(self, key):
        for line in (self.path / "memory.stat").read_text().splitlines():
            k, v = line.split()
            if k == key:
                return int(v)
        return 0

    def shmem(self):
        return self.stat("shmem" if self.v2 else "total_shmem")

    def oom_kills(self):
        text = (self.path / ("memory.events" if self.v2 else "memory.oom_control")).read_text()
        return sum(int(line.split()[1]) for line in text.splitlines()
                   if line.startswith("oom_kill "))

    def remove(self):
        for pid in self.procs():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert wait_for(lambda: not self.procs()), f"left in {self.path}: {self.procs()}"
        for _ in range(100):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.05)


def make_image(tmp, size, seed):
    """A SquashFS image of random files of ~110 KiB in 10 class directories, data stored
    as it is (random bytes do not compress); the crc32 of each file, by path."""
    src = tmp / "src"
    expected = {}
    rng = __import__("random").Random(seed)
    n = size // FILE
    for i in range(n):
        d = src / f"class{i % 10}"
        d.mkdir(parents=True, exist_ok=True)
        data = rng.randbytes(FILE - 4096 + rng.randrange(8192))
        (d / f"{i:06d}.jpg").write_bytes(data)
        expected[f"class{i % 10}/{i:06d}.jpg"] = zlib.crc32(data)
    img = tmp / "data.sqfs"
    subprocess.run(["mksquashfs", str(src), str(img), "-noappend", "-quiet", "-no-progress",
                    "-noD"], check=True)
    subprocess.run(["rm", "-rf", str(src)], check=True)
    (tmp / "expected.json").write_text(json.dumps(expected))
    return img, tmp / "expected.json"


# Reads every file under a mount, each checked against its crc32.
READ_MOUNT = r"""
import json, os, sys, zlib
root, expected = sys.argv[1], json.load(open(sys.argv[2]))
bad = [n for n in sorted(expected)
       if zlib.crc32(open(os.path.join(root, n), "rb").read()) != expected[n]]
print(f"read {len(expected)} bad {bad[:5]}", flush=True)
sys.exit(1 if bad else 0)
"""

# A rank reading in process: opens the object and hands it a shuffled order (as
# archfs.torch's FetchAhead does), then 4 forked and 4 spawned workers each read an eighth
# of the files (as DataLoader splits a dataset), the archive inherited by the forked ones
# and pickled (opened anew) for the spawned ones.
READ_IN_PROCESS = r"""
import json, multiprocessing as mp, random, sys, zlib
import archfs

def work(archive, names, expected):
    bad = [n for n in names if zlib.crc32(archive.read(n)) != expected[n]]
    if bad:
        print(f"bad {bad[:5]}", flush=True)
    sys.exit(1 if bad else 0)

if __name__ == "__main__":
    url, expected = sys.argv[1], json.load(open(sys.argv[2]))
    names = sorted(expected)
    archive = archfs.open_archive(url)
    order = list(names)
    random.Random(0).shuffle(order)
    archive.fetch_ahead(order)
    workers = [mp.get_context("fork" if k < 4 else "spawn").Process(
                   target=work, args=(archive, names[k::8], expected)) for k in range(8)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    codes = [w.exitcode for w in workers]
    print(f"workers {codes}", flush=True)
    sys.exit(0 if codes == [0] * 8 else 1)
"""


def copies(pids):
    """The node-local copies the processes hold open: (device, inode) of each."""
    found = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if "archfs-stage" in os.readlink(f"/proc/{pid}/fd/{fd}"):
                    st = os.stat(f"/proc/{pid}/fd/{fd}")
                    found.add((st.st_dev, st.st_ino))
            except OSError:
                pass
    return found


def holders(pids):
    """The command lines of the processes among `pids` that hold a copy."""
    out = []
    for pid in pids:
        if copies([pid]):
            out.append(cmdline(pid).replace(b"\0", b" ")[:200])
    return out


def cmdline(pid):
    """The raw command line of `pid`, or b"" if it has gone: a process listed a moment
    ago may exit before it is read."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def my_processes():
    """This user's processes, but this one (pytest)."""
    uid = os.geteuid()
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit() and int(p) != os.getpid():
            try:
                if os.stat(f"/proc/{p}").st_uid == uid:
                    out.append(int(p))
            except OSError:
                pass
    return out


def peak_rss(pids, *args):
    """The peak resident memory (VmHWM) of each process among `pids` whose command line
    has all of `args`."""
    out = []
    for pid in pids:
        have = cmdline(pid).decode(errors="replace").split("\0")
        if not all(a in have for a in args):
            continue
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        out += [int(line.split()[1]) * 1024 for line in status.splitlines()
                if line.startswith("VmHWM:")]
    return out


def scratch_dirs():
    """What copies might leave behind: /dev/shm and $TMPDIR's archfs entries."""
    left = set()
    for d in {"/dev/shm", os.environ.get("TMPDIR", "/tmp")}:
        try:
            left |= {f"{d}/{n}" for n in os.listdir(d) if "archfs-stage" in n}
        except OSError:
            pass
    return left


def until_line(proc, line):
    """Reads `proc`'s output until `line` (log lines come first); keeps what it read."""
    proc.seen = []
    for got in proc.stdout:
        proc.seen.append(got)
        if got.strip() == line:
            return True
    return False


@pytest.fixture
def job(s3, monkeypatch, tmp_path):  # noqa: F811 - the imported fixture
    """The server's AWS_* variables with the endpoint at a counting proxy, a job id of
    the test's own, and an index cache of the test's own."""
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("SLURM_JOB_ID", f"pytest-{uuid.uuid4().hex[:8]}")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return s3


def upload(s3, path, key):  # noqa: F811
    s3.client.create_bucket(Bucket="node") if not getattr(s3, "_node_bucket", False) else None
    s3._node_bucket = True
    s3.client.upload_file(str(path), "node", key)
    return f"s3://node/{key}"


def test_one_copy_for_eight_mounts_and_eight_workers(job, tmp_path, monkeypatch):
    img, expected = make_image(tmp_path, SIZE, seed=1)
    size = img.stat().st_size
    url = upload(job, img, "one.sqfs")
    # A store slower than the readers (~25 s for the copy): they read ahead of it, as
    # from a busy object store. Mounts that kept what they read before the copy held it
    # (their block caches) grew to ~100 MB each, and the OOM killer ended three.
    proxy = CountingProxy(int(job.endpoint.rsplit(":", 1)[1]), rate=40 * MiB)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    # One copy and the processes' own memory (~25 MB each), smaller than two copies at
    # the default size.
    cgroup = MemoryCgroup(size + 900 * MiB) if ROOT else None
    shm_before = cgroup.shmem() if cgroup else 0
    left_before = scratch_dirs()
    preexec = cgroup.preexec if cgroup else None
    archfs_bin = find_archfs()
    mounts = [tmp_path / f"mnt{i}" for i in range(8)]
    logs = [tmp_path / f"mount{i}.log" for i in range(8)]
    env = dict(os.environ, ARCHFS_LOG="info")
    rank = None
    try:
        for m, log in zip(mounts, logs):
            m.mkdir()
            subprocess.run([archfs_bin, "mount", url, str(m), "--log", str(log)], check=True,
                           env=env, preexec_fn=preexec, timeout=DEADLINE)
        readers = [subprocess.Popen([sys.executable, "-c", READ_MOUNT, str(m), str(expected)],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    preexec_fn=preexec) for m in mounts]
        # A file, not `-c`: spawned workers import the main module.
        (tmp_path / "rank.py").write_text(READ_IN_PROCESS)
        rank = subprocess.Popen([sys.executable, str(tmp_path / "rank.py"), url, str(expected)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, preexec_fn=preexec)
        outs = [r.communicate(timeout=10 * DEADLINE)[0] for r in readers]
        rank_out = rank.communicate(timeout=10 * DEADLINE)[0]
        for i, (r, out) in enumerate(zip(readers, outs)):
            ooms = cgroup.oom_kills() if cgroup else 0
            assert r.returncode == 0, \
                f"mount {i} ({ooms} OOM kills): {out}\n{logs[i].read_text()[-3000:]}"
        assert rank.returncode == 0, f"in-process rank: {rank_out}"
        held = copies(cgroup.procs() if cgroup else my_processes())
        assert len(held) == 1, f"{len(held)} copies held on the node: {held}"
        # No mount holds the bytes a second time: ~20 MB each, its cache 512 MiB.
        peaks = peak_rss(cgroup.procs() if cgroup else my_processes(), "mount", url)
        assert len(peaks) == 8, peaks
        assert max(peaks) < 64 * MiB, f"mounts' peak memory: {[p // MiB for p in peaks]} MiB"
        sent = proxy.sent
        print(f"server sent {sent / MiB:.0f} MiB for a {size / MiB:.0f} MiB object "
              f"({sent / size:.3f}x)")
        assert sent <= 1.1 * size, f"the server sent {sent / size:.2f}x the object"
        made = sum(log.read_text().count(": copying ") for log in logs)
        assert made <= 1, "more than one mount made a copy"
        if cgroup:
            assert cgroup.oom_kills() == 0, "the OOM killer ran"
    finally:
        # The end of a job: every process SIGKILLed, servers included.
        if cgroup:
            cgroup_procs = cgroup.procs()
            for pid in cgroup_procs:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            assert wait_for(lambda: not cgroup.procs())
            if sys.exc_info()[0] is not None:
                cgroup.remove()  # a failure above: the cgroup goes all the same
        else:
            if rank:
                rank.kill()
            subprocess.run(["pkill", "-KILL", "-f", f"archfs mount .*{url}"])
        # Servers killed with their watchdogs leave their mounts to the job's end (the
        # life cycle's tests cover that); here they are only cleared away, failed or not.
        for m in mounts:
            subprocess.run(["fusermount3", "-u", "-z", str(m)], capture_output=True)
            subprocess.run(["umount", "-l", str(m)], capture_output=True)
    # Memory back, nothing left behind.
    if cgroup:
        try:
            assert wait_for(lambda: cgroup.shmem() <= shm_before + MiB), \
                f"shared memory left: {cgroup.shmem() - shm_before} bytes"
        finally:
            cgroup.remove()
    assert scratch_dirs() == left_before
    assert wait_for(lambda: not copies(my_processes())), \
        f"a copy outlived the job: {holders(my_processes())}"


@pytest.mark.once
def test_a_stager_killed_mid_copy_leaves_the_others_reading(job, tmp_path, monkeypatch):
    img, expected = make_image(tmp_path, 256 * MiB, seed=2)
    size = img.stat().st_size
    url = upload(job, img, "killed.sqfs")
    proxy = CountingProxy(int(job.endpoint.rsplit(":", 1)[1]), rate=64 * MiB)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    log = tmp_path / "stager.log"
    stager = subprocess.Popen(
        [sys.executable, "-c",
         "import archfs, sys, time; a = archfs.open_archive(sys.argv[1], preload='always'); "
         "print('open', flush=True); time.sleep(600)", url],
        stdout=subprocess.PIPE, stderr=open(log, "w"), text=True,
        env=dict(os.environ, ARCHFS_LOG="info"))
    try:
        assert stager.stdout.readline().strip() == "open"
        assert wait_for(lambda: "copied to this node (" in log.read_text()), log.read_text()
        # A reader that joins the copy under way, then the stager killed mid-copy.
        reader = subprocess.Popen(
            [sys.executable, "-c",
             "import archfs, json, sys, zlib\n"
             "a = archfs.open_archive(sys.argv[1], preload='never')\n"
             "print('open', flush=True); sys.stdin.readline()\n"
             "exp = json.load(open(sys.argv[2]))\n"
             "bad = [n for n in sorted(exp) if zlib.crc32(a.read(n)) != exp[n]]\n"
             "print('bad', bad[:5], flush=True); sys.stdin.readline()\n"
             "sys.exit(1 if bad else 0)\n",
             url, str(expected)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, env=dict(os.environ, ARCHFS_LOG="info"))
        assert until_line(reader, "open")
        assert len(copies([stager.pid, reader.pid])) == 1, "the reader did not join the copy"
        assert "copied to this node, " not in log.read_text(), "the copy ended too soon"
        stager.kill()
        stager.wait()
        reader.stdin.write("go\n")
        reader.stdin.flush()
        until_line(reader, "bad []")
        out = "".join(reader.seen)
        assert out.rstrip().endswith("bad []"), out
        assert "copied to this node, " in out, f"the reader did not finish the copy: {out}"
        print(f"server sent {proxy.sent / size:.3f}x the object")
        # The stager's pieces in flight are fetched again, nothing more.
        assert proxy.sent <= 1.25 * size, f"the server sent {proxy.sent / size:.2f}x"
        # The stager held the hub: a process that comes later finds the copy the reader
        # holds (the reader took the hub over), and fetches none of it.
        sent = proxy.sent
        late = subprocess.Popen(
            [sys.executable, "-c",
             "import archfs, json, sys, zlib\n"
             "a = archfs.open_archive(sys.argv[1], preload='never')\n"
             "exp = json.load(open(sys.argv[2]))\n"
             "bad = [n for n in sorted(exp) if zlib.crc32(a.read(n)) != exp[n]]\n"
             "print('bad', bad[:5], flush=True); sys.stdin.readline()\n",
             url, str(expected)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert until_line(late, "bad []"), "".join(late.seen)
        assert copies([late.pid]) == copies([reader.pid]) != set(), "a second copy"
        assert proxy.sent - sent < size / 20, "the late reader fetched what the copy holds"
        for p in (late, reader):
            p.stdin.write("end\n")
            p.stdin.flush()
            p.wait(timeout=DEADLINE)
        assert reader.returncode == 0
    finally:
        stager.kill()
        stager.wait()


@pytest.mark.skipif(not ROOT, reason="needs root to run a second user")
def test_another_user_gets_a_copy_of_its_own_and_not_the_first(job, tmp_path, monkeypatch):
    img, expected = make_image(tmp_path, 64 * MiB, seed=3)
    size = img.stat().st_size
    url = upload(job, img, "users.sqfs")
    proxy = CountingProxy(int(job.endpoint.rsplit(":", 1)[1]))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    # pytest's directories are root's alone: what the other user reads goes elsewhere.
    shared = Path(tempfile.mkdtemp(prefix="archfs-node-users-"))
    os.chmod(shared, 0o777)
    expected = Path(shutil.copy(expected, shared / "expected.json"))
    os.chmod(expected, 0o644)
    hold = ("import archfs, json, sys, zlib\n"
            "a = archfs.open_archive(sys.argv[1], preload='always')\n"
            "exp = json.load(open(sys.argv[2]))\n"
            "bad = [n for n in sorted(exp) if zlib.crc32(a.read(n)) != exp[n]]\n"
            "print('read', len(exp), 'bad', bad[:5], flush=True); sys.stdin.readline()\n")
    env = dict(os.environ, HOME=str(shared), XDG_CACHE_HOME=str(shared / "cache"))
    mine = subprocess.Popen([sys.executable, "-c", hold, url, str(expected)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    theirs = subprocess.Popen(["setpriv", "--reuid=archfs-test", "--regid=archfs-test",
                               "--clear-groups", "--", sys.executable, "-c", hold, url,
                               str(expected)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        for p in (mine, theirs):
            line = p.stdout.readline()
            assert "bad []" in line, line
        assert len(copies([mine.pid])) == 1 and len(copies([theirs.pid])) == 1
        assert copies([mine.pid]) != copies([theirs.pid]), "the second user got the first's copy"
        assert proxy.sent >= 1.9 * size, "one copy served two users"
        # The first user's hub, asked by the second user, hands over nothing.
        probe = ("import socket, sys\n"
                 "s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
                 "s.connect('\\0' + sys.argv[1])\n"
                 "try:\n"
                 "    s.send(b'want ' + sys.argv[2].encode())\n"
                 "    msg, anc, _, _ = s.recvmsg(8192, socket.CMSG_SPACE(16))\n"
                 "except (BrokenPipeError, ConnectionResetError):\n"
                 "    msg, anc = b'', []\n"
                 "print(len(msg), len(anc))\n")
        prefix = f"@archfs/copies/u{os.geteuid()}/j{os.environ['SLURM_JOB_ID']}/n"
        hubs = {line.split()[-1][1:] for line in open("/proc/net/unix")
                if line.split()[-1].startswith(prefix) and line.rstrip().endswith("/hub")}
        assert len(hubs) == 1, hubs
        hub = hubs.pop()
        out = subprocess.run(["setpriv", "--reuid=archfs-test", "--regid=archfs-test",
                              "--clear-groups", "--", sys.executable, "-c", probe, hub, url],
                             capture_output=True, text=True, timeout=DEADLINE)
        assert out.returncode == 0 and out.stdout.split() == ["0", "0"], \
            f"the hub answered another user: {out.stdout} {out.stderr}"
    finally:
        for p in (mine, theirs):
            p.kill()
            p.wait()
        shutil.rmtree(shared, ignore_errors=True)


def test_mount_takes_the_command_lines_remote_options(job, tmp_path, monkeypatch):
    """archfs.mount's no_sign_request, stage_dir and retry_for reach the server."""
    import archfs

    # Larger than what a mount fetches ahead of its first reads (64 MiB).
    img, expected = make_image(tmp_path, 160 * MiB, seed=4)
    url = upload(job, img, "options.sqfs")
    names = sorted(json.loads(expected.read_text()))
    proxy = CountingProxy(int(job.endpoint.rsplit(":", 1)[1]))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    # Unsigned requests to a bucket that wants signed ones are refused.
    with pytest.raises(archfs.MountError, match="options.sqfs"):
        archfs.mount(url, tmp_path / "unsigned", no_sign_request=True)
    stage = tmp_path / "stage"
    stage.mkdir()
    with archfs.mount(url, tmp_path / "m", stage_dir=stage, retry_for=2, keep="1G",
                      preload=False) as root:
        server = [c for c in map(cmdline, my_processes())
                  if f"--stage-dir\0{stage}".encode() in c]
        assert server, "no server was given --stage-dir"
        assert b"--keep\x001G" in server[0]
        first = (root / names[0]).read_bytes()
        assert zlib.crc32(first) == json.loads(expected.read_text())[names[0]]
        # The server goes: a read not yet served fails within the 2 s given, not the
        # default minute.
        proxy.stop()
        t = time.monotonic()
        with pytest.raises(OSError) as err:
            (root / names[len(names) // 2]).read_bytes()
        took = time.monotonic() - t
        assert err.value.errno == 5 and took < 30, f"{err.value} after {took:.1f} s"


def test_a_look_pulls_what_it_reads_and_an_epoch_starts_the_copy(job, tmp_path, monkeypatch):
    """`archfs ls`, `cat` of a few files and a mount that reads three files fetch a small
    part of the object and make no copy; reads of more files than the epoch rule's 128
    make it."""
    img, expected = make_image(tmp_path, 160 * MiB, seed=5)
    size = img.stat().st_size
    url = upload(job, img, "look.sqfs")
    names = sorted(json.loads(expected.read_text()))
    proxy = CountingProxy(int(job.endpoint.rsplit(":", 1)[1]))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    archfs_bin = find_archfs()
    env = dict(os.environ, ARCHFS_LOG="info")
    subprocess.run([archfs_bin, "ls", url, "class3"], check=True, capture_output=True, env=env)
    for n in names[:3]:
        subprocess.run([archfs_bin, "cat", url, n], check=True, capture_output=True)
    m = tmp_path / "m"
    m.mkdir()
    log = tmp_path / "mount.log"
    subprocess.run([archfs_bin, "mount", url, str(m), "--log", str(log)], check=True, env=env)
    try:
        for n in names[:3]:
            (m / n).read_bytes()
        looked = proxy.sent
        print(f"a look fetched {looked / MiB:.1f} MiB of {size / MiB:.0f} MiB")
        assert looked < size / 10, f"a look fetched {looked / size:.2f}x the object"
        assert ": copying " not in log.read_text()
        for n in names[:200]:
            (m / n).read_bytes()
        assert wait_for(lambda: "copied to this node, " in log.read_text()), log.read_text()
    finally:
        subprocess.run([archfs_bin, "unmount", str(m)])


# A rank that opened and read the object forks a worker once told (the object replaced
# meanwhile); the worker reads every file through the archive it inherited.
FORKED_WORKER = r"""
import json, os, sys, zlib
import archfs
url, expected = sys.argv[1], json.load(open(sys.argv[2]))
names = sorted(expected)
archive = archfs.open_archive(url, preload="always")
bad = [n for n in names if zlib.crc32(archive.read(n)) != expected[n]]
print(f"parent bad {bad[:3]}", flush=True)
print("read", flush=True)
sys.stdin.readline()
pid = os.fork()
if pid == 0:
    bad = [n for n in names if zlib.crc32(archive.read(n)) != expected[n]]
    print(f"worker bad {bad[:3]}", flush=True)
    os._exit(1 if bad else 0)
print(f"worker exit {os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}", flush=True)
"""


def test_a_forked_worker_reads_its_parents_version_without_asking_the_server(
        job, tmp_path, monkeypatch):
    """A DataLoader worker forked each epoch opens the archive again: it takes what its
    parent found (size, ETag) and the node's copy, so it sends the server nothing, and it
    reads the version its parent listed even when the object was replaced since. A new
    process asks the server and reads the new version."""
    (tmp_path / "v1").mkdir()
    (tmp_path / "v2").mkdir()
    img1, exp1 = make_image(tmp_path / "v1", 24 * MiB, seed=7)
    img2, exp2 = make_image(tmp_path / "v2", 24 * MiB, seed=8)
    url = upload(job, img1, "fork.sqfs")
    proxy = CountingProxy(int(job.endpoint.rsplit(":", 1)[1]))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    rank = subprocess.Popen([sys.executable, "-c", FORKED_WORKER, url, str(exp1)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, ARCHFS_LOG="warn"))
    try:
        assert until_line(rank, "read"), rank.seen
        assert "parent bad []\n" in rank.seen, rank.seen
        upload(job, img2, "fork.sqfs")
        proxy.reset()
        connections = len(proxy.open)
        rank.stdin.write("go\n")
        rank.stdin.flush()
        assert until_line(rank, "worker exit 0"), rank.seen
        assert proxy.sent == 0 and len(proxy.open) == connections, \
            f"the worker asked the server: {proxy.sent} bytes back, " \
            f"{(len(proxy.open) - connections) // 2} new connections"
    finally:
        rank.kill()
        rank.wait()
    name, crc = sorted(json.loads(exp2.read_text()).items())[0]
    fresh = subprocess.run([find_archfs(), "cat", url, name], check=True,
                           capture_output=True).stdout
    assert zlib.crc32(fresh) == crc, "a new process read the old version"


def test_one_process_of_a_job_preloads_and_pushes_a_local_archive(job, tmp_path):
    """Four mounts of one local image (the ranks of a job without --shared) and two
    in-process readers: one preload and one push for the node."""
    img, expected = make_image(tmp_path, 32 * MiB, seed=6)
    names = sorted(json.loads(expected.read_text()))
    archfs_bin = find_archfs()
    env = dict(os.environ, ARCHFS_LOG="info")
    mounts, logs = [], []
    try:
        for i in range(4):
            m, log = tmp_path / f"m{i}", tmp_path / f"m{i}.log"
            m.mkdir()
            subprocess.run([archfs_bin, "mount", str(img), str(m), "--log", str(log)],
                           check=True, env=env)
            mounts.append(m)
            logs.append(log)
        # The readers stay until every mount has read: a process that ended leaves the
        # preload to the next (its own preload ended with it).
        readers = [subprocess.Popen(
            [sys.executable, "-c",
             "import archfs, sys; a = archfs.open_archive(sys.argv[1]); "
             "[a.read(n) for n in sys.argv[2:]]; sys.stdin.readline()", str(img), *names[:200]],
            stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for _ in range(2)]
        for m in mounts:
            for n in names[:200]:
                (m / n).read_bytes()
        errs = [r.communicate("end\n", timeout=DEADLINE)[1] for r in readers]
        texts = lambda: [log.read_text() for log in logs] + errs  # noqa: E731
        assert wait_for(lambda: sum("pushed " in t for t in texts()) == 1), texts()
        preloads = sum("files read: preloading" in t for t in texts())
        others = sum("another process of this job on this node preloads" in t for t in texts())
        assert preloads == 1 and others == 5, texts()
        assert sum("another mount of this job on this node pushes" in t for t in texts()) == 3
    finally:
        for m in mounts:
            subprocess.run([archfs_bin, "unmount", str(m)])


def test_a_job_of_many_nodes_reads_on_demand_and_says_why(job, tmp_path, monkeypatch):
    """In a job of 64 nodes `auto` copies nothing to the node (a copy on each would read
    64x the object from storage): one warning says so and what to do; reads are whole."""
    img, expected = make_image(tmp_path, 48 * MiB, seed=21)
    size = img.stat().st_size
    url = upload(job, img, "many-nodes.sqfs")
    proxy = CountingProxy(int(job.endpoint.rsplit(":", 1)[1]))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    reader = subprocess.Popen(
        [sys.executable, "-c",
         "import archfs, json, sys, zlib\n"
         "a = archfs.open_archive(sys.argv[1])\n"
         "exp = json.load(open(sys.argv[2]))\n"
         "bad = [n for n in sorted(exp) if zlib.crc32(a.read(n)) != exp[n]]\n"
         "print('bad', bad[:5], flush=True); sys.stdin.readline()\n",
         url, str(expected)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, SLURM_JOB_NUM_NODES="64"))
    try:
        assert until_line(reader, "bad []"), "".join(reader.seen)
        assert not copies([reader.pid]), "a copy was made in a job of 64 nodes"
    finally:
        reader.stdin.close()
        reader.wait(timeout=DEADLINE)
    err = reader.stderr.read()
    assert err.count("not copied to this node: the job has 64 nodes") == 1, err
    assert "and a copy on each would read 64x the object from storage" in err, err
    assert "archfs.stage.stage(URL)" in err, err
    print(f"64 nodes, on demand: server sent {proxy.sent / size:.2f}x the object")
    assert proxy.sent < 2 * size


# One node of a job whose dataset is larger than a node: stages its share of the files
# (archfs.partition's, as NodeSampler draws them), then reads them and checks each; waits
# on stdin between the steps, so the test reads the server's count at each.
NODE_SHARE = r"""
import json, os, sys, zlib
import archfs, archfs.stage
from archfs.partition import node_shares
url, expected, nodes, node = sys.argv[1], json.load(open(sys.argv[2])), int(sys.argv[3]), int(sys.argv[4])
a = archfs.open_archive(url, preload="never")
names = a.files("", [".jpg"])
classes = sorted({n.split("/")[0] for n in names})
mine = [names[i] for i in node_shares([classes.index(n.split("/")[0]) for n in names], nodes)[node]]
staged = archfs.stage.stage_files(url, mine, quiet=True)
print(f"staged {staged.copy.size} {len(mine)}", flush=True)
sys.stdin.readline()
bad = [n for n in mine if zlib.crc32(a.read(n)) != expected[n]]
print(f"read {len(mine)} bad {bad[:3]}", flush=True)
sys.stdin.readline()
others = [n for n in names if n not in set(mine)][:20]
bad = [n for n in others if zlib.crc32(a.read(n)) != expected[n]]
print(f"others bad {bad[:3]}", flush=True)
json.dump(mine, open(sys.argv[5], "w"))
sys.stdin.readline()
"""


def squashfs_tables(img):
    """Bytes of a SquashFS image from its inode table on: the tables every node copies."""
    sb = img.read_bytes()[:96]
    used, inodes = int.from_bytes(sb[40:48], "little"), int.from_bytes(sb[64:72], "little")
    return used - inodes


def test_each_node_copies_its_share_of_the_files_and_reads_it_there(job, tmp_path, monkeypatch):
    """A dataset larger than a node, 2 nodes each on a fixed share: each node copies the
    bytes its share's files lie in (and the tables), the nodes together about the image
    once; then every read of the share, in the stager, in a new process and through a
    mount on the node, is served from the copy; other files are read on demand."""
    img, expected = make_image(tmp_path, 96 * MiB, seed=31)
    size, tables = img.stat().st_size, squashfs_tables(img)
    url = upload(job, img, "shares.sqfs")
    proxy = CountingProxy(int(job.endpoint.rsplit(":", 1)[1]))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    job_id = os.environ["SLURM_JOB_ID"]
    archfs_bin = find_archfs()
    procs, staged = [], 0
    try:
        for k in range(2):
            # Each node a job id of its own: their hubs and copies are apart, as on two
            # hosts (test_nodes.py runs nodes as UTS namespaces).
            env = dict(os.environ, SLURM_JOB_ID=f"{job_id}-n{k}", ARCHFS_LOG="info")
            p = subprocess.Popen(
                [sys.executable, "-c", NODE_SHARE, url, str(expected), "2", str(k),
                 str(tmp_path / f"share{k}.json")],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True, env=env)
            procs.append(p)
            before = proxy.sent
            line = p.stdout.readline()
            assert line.startswith("staged "), line + p.stderr.read()
            copy, files = map(int, line.split()[1:])
            fetched = proxy.sent - before
            print(f"node {k}: {files} files, copy {copy / MiB:.1f} MiB, fetched "
                  f"{fetched / MiB:.1f} MiB of {size / MiB:.1f} MiB")
            # Its share and the tables, not the image: about half of it.
            assert copy < 0.6 * size, f"node {k} copied {copy / size:.2f}x the image"
            assert copy <= fetched <= copy * 1.02 + 4 * MiB, (copy, fetched)
            staged += fetched
            before = proxy.sent
            p.stdin.write("\n")
            p.stdin.flush()
            assert p.stdout.readline().strip() == f"read {files} bad []"
            assert proxy.sent - before < 64 << 10, f"a read of the share fetched {proxy.sent - before}"
        ratio = staged / size
        print(f"2 nodes staged {ratio:.3f}x the image (tables {tables / MiB:.2f} MiB each)")
        assert ratio <= 1.02 + tables / size, f"the nodes fetched {ratio:.3f}x the image"
        for p in procs:
            p.stdin.write("\n")
            p.stdin.flush()
            assert p.stdout.readline().strip() == "others bad []"
        # A new process and a mount on node 0 read its share from the node's copy.
        mine = json.loads((tmp_path / "share0.json").read_text())
        env = dict(os.environ, SLURM_JOB_ID=f"{job_id}-n0", ARCHFS_LOG="info")
        before = proxy.sent
        subprocess.run(
            [sys.executable, "-c",
             "import archfs, json, sys, zlib\n"
             "a = archfs.open_archive(sys.argv[1])\n"
             "exp = json.load(open(sys.argv[2]))\n"
             "bad = [n for n in json.load(open(sys.argv[3])) if zlib.crc32(a.read(n)) != exp[n]]\n"
             "assert not bad, bad\n",
             url, str(expected), str(tmp_path / "share0.json")], check=True, env=env)
        fresh = proxy.sent - before
        m = tmp_path / "m"
        m.mkdir()
        log = tmp_path / "mount.log"
        subprocess.run([archfs_bin, "mount", url, str(m), "--log", str(log)], check=True, env=env)
        try:
            crcs = json.loads(expected.read_text())
            bad = [n for n in mine if zlib.crc32((m / n).read_bytes()) != crcs[n]]
            assert not bad, bad
        finally:
            subprocess.run([archfs_bin, "unmount", str(m)])
        mounted = proxy.sent - before - fresh
        print(f"node 0's share read again: new process {fresh / 1024:.0f} KiB, mount "
              f"{mounted / 1024:.0f} KiB from the server")
        # A HEAD and the object's first bytes each; no whole copy made.
        assert fresh < 1 * MiB and mounted < 1 * MiB, (fresh, mounted)
        assert ": copying " not in log.read_text().replace("copying this node's share", "")
    finally:
        for p in procs:
            try:
                p.stdin.close()
            except OSError:
                pass
            p.wait(timeout=DEADLINE)
    assert [p.returncode for p in procs] == [0, 0], [p.stderr.read() for p in procs]


# A rank of node 1 of 2 with an archfs.torch dataset: NodeSampler.stage copies the node's
# share; an epoch of the sampler then reads every sample of it, each checked.
SAMPLER_STAGE = r"""
import json, sys, zlib
from archfs.torch import DatasetFolder, NodeSampler
url, expected = sys.argv[1], json.load(open(sys.argv[2]))
ds = DatasetFolder(url, loader=lambda f: f.read(), extensions=(".jpg",))
sampler = NodeSampler(ds, nodes=2, node=1, ranks_here=1, rank_here=0)
staged = sampler.stage(quiet=True)
print(f"staged {staged.copy.size} {len(sampler.share)}", flush=True)
sys.stdin.readline()
bad = [i for i in sampler if zlib.crc32(ds[i][0]) != expected[ds.samples[i][0]]]
print(f"epoch {len(sampler.share)} bad {bad[:3]}", flush=True)
"""


@pytest.mark.once
def test_a_node_sampler_stages_its_share_and_an_epoch_reads_it_there(job, tmp_path, monkeypatch):
    """`NodeSampler.stage()` copies the node's share of an archfs.torch dataset (about
    half the image of 2 nodes); an epoch of the sampler is then served from the copy."""
    from test_reader import torch_or_skip

    torch_or_skip()
    img, expected = make_image(tmp_path, 48 * MiB, seed=41)
    size = img.stat().st_size
    url = upload(job, img, "sampler.sqfs")
    proxy = CountingProxy(int(job.endpoint.rsplit(":", 1)[1]))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    p = subprocess.Popen([sys.executable, "-c", SAMPLER_STAGE, url, str(expected)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        line = p.stdout.readline()
        assert line.startswith("staged "), line + p.stderr.read()
        copy, files = map(int, line.split()[1:])
        staged = proxy.sent
        print(f"node 1 of 2: {files} samples, copy {copy / MiB:.1f} MiB, fetched "
              f"{staged / MiB:.1f} MiB of {size / MiB:.1f} MiB")
        assert 0.4 * size < copy < 0.6 * size, f"copied {copy / size:.2f}x the image"
        assert staged < copy * 1.02 + 4 * MiB, f"fetched {staged / size:.2f}x the image"
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == f"epoch {files} bad []", p.stderr.read()
        print(f"the epoch fetched {(proxy.sent - staged) / 1024:.0f} KiB")
        assert proxy.sent - staged < 64 << 10
    finally:
        p.stdin.close()
        p.wait(timeout=DEADLINE)
    assert p.returncode == 0, p.stderr.read()


# A DataLoader over an archfs.torch dataset of the object with FetchAhead for sampler:
# two epochs, each sample's crc32 against the file's; between them it waits for a line
# on stdin (the test may stop the server then). A fifth argument opens the archive with
# that preload.
FETCH_AHEAD = r"""
import json, operator, sys, zlib
import torch
from archfs import _native
from archfs.torch import DatasetFolder, FetchAhead

if __name__ == "__main__":
    url, expected, ctx, persistent = sys.argv[1:5]
    expected = sorted(json.load(open(expected)).values())
    if len(sys.argv) > 5:
        import archfs
        url = archfs.open_archive(url, preload=sys.argv[5])
    ds = DatasetFolder(url, loader=operator.methodcaller("read"), extensions=(".jpg",))
    sampler = FetchAhead(ds)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=16, sampler=sampler, num_workers=3, multiprocessing_context=ctx,
        persistent_workers=persistent == "1")
    for epoch in range(2):
        sampler.set_epoch(epoch)
        got = sorted(zlib.crc32(b) for files, _ in loader for b in files)
        print(f"epoch {epoch} samples {len(got)} right {got == expected} "
              f"fetched {_native.fetched()[1]}", flush=True)
        sys.stdin.readline()
"""


@contextlib.contextmanager
def fetching_ahead(url, expected, ctx, persistent):
    """FETCH_AHEAD's DataLoader over `url`, its input closed on the way out, and its end
    checked."""
    p = subprocess.Popen([sys.executable, "-c", FETCH_AHEAD, url, str(expected), ctx, persistent],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        yield p
    finally:
        p.stdin.close()
        p.wait(timeout=DEADLINE)
    assert p.returncode == 0, p.stderr.read()


def epoch_done(p, epoch, n):
    """FETCH_AHEAD's line at the end of `epoch`: all `n` samples, right; its words."""
    line = p.stdout.readline().split()
    assert line[:6] == ["epoch", str(epoch), "samples", str(n), "right", "True"], \
        " ".join(line) + p.stderr.read()
    return line


@pytest.mark.once
@pytest.mark.parametrize("fmt,ctx,persistent", [("sqfs", "fork", "0"), ("tar", "spawn", "1")])
def test_a_dataloader_fetches_its_order_ahead_into_the_node_copy(job, tmp_path, monkeypatch,
                                                                 fmt, ctx, persistent):
    """FetchAhead hands each epoch's order to the reader, which fetches the files into
    the node's copy ahead of the workers: the first epoch takes the archive from the
    server about once, in GETs of files (no whole pieces), and the second nothing (with
    forked workers, the server stopped: every byte is read from the copy)."""
    from test_reader import torch_or_skip

    torch_or_skip()
    img, expected = make_image(tmp_path, 24 * MiB, seed=53)
    if fmt == "tar":
        src = tmp_path / "files"
        subprocess.run(["unsquashfs", "-q", "-n", "-d", str(src), str(img)], check=True)
        img = tmp_path / "data.tar"
        subprocess.run(["tar", "-C", str(src), "-cf", str(img), "."], check=True)
    size = img.stat().st_size
    url = upload(job, img, f"ahead.{fmt}")
    proxy = CountingProxy(int(job.endpoint.rsplit(":", 1)[1]))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    if fmt == "tar":
        # The index beside the object, as a user saves it once: no scan at open.
        subprocess.run([find_archfs(), "index", url], check=True, capture_output=True)
        proxy.reset()
    n = len(json.loads(expected.read_text()))
    with fetching_ahead(url, expected, ctx, persistent) as p:
        line = epoch_done(p, 0, n)
        first, ahead = proxy.sent, int(line[7])
        print(f"{fmt}, {ctx} workers: epoch 1 fetched {first / MiB:.1f} MiB of "
              f"{size / MiB:.1f} MiB ({first / size:.3f}x), {ahead / MiB:.1f} MiB of it by "
              "the order")
        assert first < 1.05 * size + MiB, f"fetched {first / size:.2f}x the archive"
        assert ahead > 0, "the order fetched nothing"
        if ctx == "fork":
            proxy.stop()
        p.stdin.write("\n")
        p.stdin.flush()
        epoch_done(p, 1, n)
        print(f"epoch 2 fetched {(proxy.sent - first) / 1024:.0f} KiB")
        assert proxy.sent - first < 64 << 10
        p.stdin.write("\n")
        p.stdin.flush()


@pytest.mark.once
def test_forked_workers_find_the_copy_and_an_images_tables_are_fetched_once(job, tmp_path,
                                                                            monkeypatch):
    """An image of many tiny files is mostly its tables, read at every opening: the
    opening process's (fetched before the node's copy was made) go into the copy, and
    the DataLoader's workers, opening it again, find the copy and read them there. Each
    process fetched them for itself (5x an image of 1.28 M files with 4 processes)."""
    from test_reader import torch_or_skip

    torch_or_skip()
    src, expected = tmp_path / "src", {}
    rng = random.Random(54)
    for i in range(20_000):
        d = src / f"class{i % 10}"
        d.mkdir(parents=True, exist_ok=True)
        data = rng.randbytes(1 + rng.randrange(40))
        (d / f"{i:06d}.jpg").write_bytes(data)
        expected[f"class{i % 10}/{i:06d}.jpg"] = zlib.crc32(data)
    img = tmp_path / "tiny.sqfs"
    subprocess.run(["mksquashfs", str(src), str(img), "-noappend", "-quiet", "-no-progress",
                    "-comp", "zstd"], check=True)
    shutil.rmtree(src)
    (tmp_path / "expected.json").write_text(json.dumps(expected))
    size = img.stat().st_size
    url = upload(job, img, "tiny.sqfs")
    proxy = CountingProxy(int(job.endpoint.rsplit(":", 1)[1]))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    with fetching_ahead(url, tmp_path / "expected.json", "fork", "0") as p:
        epoch_done(p, 0, len(expected))
        sent = proxy.sent
        print(f"epoch 1 fetched {sent / MiB:.2f} MiB of a {size / MiB:.2f} MiB image "
              f"({sent / size:.2f}x)")
        assert sent < 1.05 * size + (64 << 10), f"fetched {sent / size:.2f}x the image"
        p.stdin.write("\n\n")
        p.stdin.flush()


def tar_with_index(job, tmp_path, monkeypatch, size, seed, key, rate=None):
    """An ImageFolder-like tar of ~`size` bytes in the server, its index beside it (as a
    user saves it once), read through a CountingProxy at `rate`: its URL, its size, the
    crc32s of its files and the proxy, its count at 0."""
    img, expected = make_image(tmp_path, size, seed=seed)
    src = tmp_path / "files"
    subprocess.run(["unsquashfs", "-q", "-n", "-d", str(src), str(img)], check=True)
    tar = tmp_path / "data.tar"
    subprocess.run(["tar", "-C", str(src), "-cf", str(tar), "."], check=True)
    shutil.rmtree(src)
    url = upload(job, tar, key)
    proxy = CountingProxy(int(job.endpoint.rsplit(":", 1)[1]), rate=rate)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    # Through the proxy: an index names the endpoint it was made from.
    subprocess.run([find_archfs(), "index", url], check=True, capture_output=True)
    proxy.reset()
    return url, tar.stat().st_size, expected, proxy


@pytest.mark.once
def test_an_ordered_fill_outlives_a_server_gone_for_a_while(job, tmp_path, monkeypatch):
    """The server goes away mid-epoch while FetchAhead fills the copy in order (its
    connections reset, new ones refused), then comes back: the epoch ends with every
    file right, no worker hung, the next epoch from the copy."""
    from test_reader import torch_or_skip

    torch_or_skip()
    # Slow enough that the outage falls inside the first epoch (~4 s).
    url, size, expected, proxy = tar_with_index(job, tmp_path, monkeypatch, 32 * MiB, 54,
                                                "gone.tar", rate=8 * MiB)
    p = subprocess.Popen([sys.executable, "-c", FETCH_AHEAD, url, str(expected), "fork", "0"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    n = len(json.loads(expected.read_text()))
    try:
        assert wait_for(lambda: proxy.sent > size / 4), f"sent {proxy.sent}"
        proxy.stop()
        gone = proxy.sent
        time.sleep(3)  # the outage: not a wait for an event
        assert p.poll() is None, p.stderr.read()
        proxy.resume()
        line = p.stdout.readline().split()
        assert line[:6] == ["epoch", "0", "samples", str(n), "right", "True"], \
            " ".join(line) + p.stderr.read()
        print(f"stopped at {gone / size:.2f} of the object; epoch 1 fetched "
              f"{proxy.sent / size:.3f}x")
        assert proxy.sent < 1.25 * size, f"fetched {proxy.sent / size:.2f}x the archive"
        sent = proxy.sent
        p.stdin.write("\n")
        p.stdin.flush()
        line = p.stdout.readline().split()
        assert line[:6] == ["epoch", "1", "samples", str(n), "right", "True"], \
            " ".join(line) + p.stderr.read()
        assert proxy.sent - sent < 64 << 10, "epoch 2 fetched what the copy holds"
        p.stdin.write("\n")
        p.stdin.flush()
    finally:
        p.stdin.close()
        p.wait(timeout=DEADLINE)
    err = p.stderr.read()
    assert p.returncode == 0 and "panick" not in err, err


def test_a_rank_killed_mid_epoch_leaves_the_other_reading_and_no_copy(job, tmp_path,
                                                                       monkeypatch):
    """Two ranks of a job fill the node's copy in their epochs' order (FetchAhead, forked
    and spawned workers); one is SIGKILLed with its workers mid-epoch. The other's epoch
    ends with every file right, fetching what the dead one had under way again; once it
    ends too, no copy is held, nothing is left in /dev/shm or $TMPDIR, and (as root, in a
    memory cgroup) the shared memory is back."""
    from test_reader import torch_or_skip

    torch_or_skip()
    url, size, expected, proxy = tar_with_index(job, tmp_path, monkeypatch, 64 * MiB, 55,
                                                "ranks.tar", rate=16 * MiB)
    # Room for the ranks' torch (~250 MB a process); the cgroup counts the shared memory.
    cgroup = MemoryCgroup(4096 * MiB) if ROOT else None
    shm_before = cgroup.shmem() if cgroup else 0
    left_before = scratch_dirs()
    n = len(json.loads(expected.read_text()))
    ranks = []
    try:
        for ctx in ("fork", "spawn"):
            ranks.append(subprocess.Popen(
                [sys.executable, "-c", FETCH_AHEAD, url, str(expected), ctx, "0"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True, start_new_session=True,
                preexec_fn=cgroup.preexec if cgroup else None))
        doomed, other = ranks
        assert wait_for(lambda: proxy.sent > size / 4), f"sent {proxy.sent}"
        assert doomed.poll() is None, doomed.stderr.read()
        os.killpg(doomed.pid, signal.SIGKILL)
        doomed.wait(timeout=DEADLINE)
        line = other.stdout.readline().split()
        assert line[:6] == ["epoch", "0", "samples", str(n), "right", "True"], \
            " ".join(line) + other.stderr.read()
        print(f"the job fetched {proxy.sent / size:.3f}x the object")
        assert proxy.sent < 1.5 * size, f"fetched {proxy.sent / size:.2f}x the archive"
        sent = proxy.sent
        for _ in range(2):
            other.stdin.write("\n")
            other.stdin.flush()
        line = other.stdout.readline().split()
        assert line[:6] == ["epoch", "1", "samples", str(n), "right", "True"], \
            " ".join(line) + other.stderr.read()
        # What the dead rank had under way is in the copy too, not fetched each epoch
        # (its grains stayed under way for good, and every read of them waited 2 s).
        assert proxy.sent - sent < 64 << 10, f"epoch 2 fetched {proxy.sent - sent} bytes"
        other.stdin.close()
        other.wait(timeout=DEADLINE)
        assert other.returncode == 0, other.stderr.read()
    finally:
        for r in ranks:
            if r.poll() is None:
                os.killpg(r.pid, signal.SIGKILL)
                r.wait()
    assert wait_for(lambda: not copies(my_processes())), \
        f"a copy outlived the job: {holders(my_processes())}"
    assert scratch_dirs() == left_before
    if cgroup:
        try:
            assert wait_for(lambda: cgroup.shmem() <= shm_before + MiB), \
                f"shared memory left: {cgroup.shmem() - shm_before} bytes"
            assert cgroup.oom_kills() == 0
        finally:
            cgroup.remove()


ORDER_ONLY = r"""
import random, sys
import archfs

a = archfs.open_archive(sys.argv[1])
order = sorted(a.files("", None))
random.Random(1).shuffle(order)
print(a.fetch_ahead(order), flush=True)
sys.stdin.readline()
"""


# A mount's reader, in process: a file every 2 s until told to stop, then every file.
READ_NOW_AND_THEN = r"""
import archfs, json, sys, threading, zlib
a = archfs.open_archive(sys.argv[1])
exp = json.load(open(sys.argv[2]))
names = sorted(exp)
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
print("open", flush=True)
n = 0
while not stop.is_set():
    f = names[n % len(names)]
    assert zlib.crc32(a.read(f)) == exp[f], f
    n += 1
    stop.wait(2)
bad = [f for f in names if zlib.crc32(a.read(f)) != exp[f]]
print("read", n, "bad", bad[:5], flush=True)
"""


def test_an_order_whose_process_ended_leaves_the_copy_to_the_others(job, tmp_path,
                                                                    monkeypatch):
    """A rank hands the node's copy an order and is SIGKILLed before the copy is whole.
    Another process that reads a file now and then (as a mount's reader does) then
    copies the rest, as without an order (only what the order had not brought), rather
    than fetching only the files it reads for good; every file right, and read again,
    nothing fetched."""
    url, size, expected, proxy = tar_with_index(job, tmp_path, monkeypatch, 48 * MiB, 58,
                                                "orphan.tar", rate=8 * MiB)
    n = len(json.loads(expected.read_text()))
    rank = subprocess.Popen([sys.executable, "-c", ORDER_ONLY, url], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    log = tmp_path / "reader.log"
    reader = None
    try:
        assert rank.stdout.readline().strip() == str(n), rank.stderr.read()
        reader = subprocess.Popen(
            [sys.executable, "-c", READ_NOW_AND_THEN, url, str(expected)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True,
            env=dict(os.environ, ARCHFS_LOG="info"))
        assert until_line(reader, "open"), log.read_text()
        assert len(copies([rank.pid, reader.pid])) == 1, "the reader did not join the copy"
        assert wait_for(lambda: proxy.sent > size / 4), f"sent {proxy.sent}"
        assert "copied to this node, " not in log.read_text(), "the copy ended too soon"
        os.killpg(rank.pid, signal.SIGKILL)
        rank.wait(timeout=DEADLINE)
        killed = proxy.sent
        assert wait_for(lambda: "copied to this node, " in log.read_text()), \
            f"the reader did not copy the rest: {proxy.sent / size:.2f}x the archive " \
            f"fetched, {killed / size:.2f}x at the kill\n{log.read_text()}"
        sent = proxy.sent
        reader.stdin.write("stop\n")
        reader.stdin.flush()
        line = reader.stdout.readline().split()
        assert line[:1] + line[2:] == ["read", "bad", "[]"], " ".join(line) + log.read_text()
        print(f"killed at {killed / size:.2f}x; whole after {line[1]} reads, "
              f"{sent / size:.3f}x fetched")
        assert proxy.sent - sent < 64 << 10, f"read again {proxy.sent - sent} bytes"
        assert sent < 1.5 * size, f"fetched {sent / size:.2f}x the archive"
        reader.wait(timeout=DEADLINE)
        assert reader.returncode == 0, log.read_text()
    finally:
        for p in (rank, reader):
            if p and p.poll() is None:
                p.kill()
                p.wait()


def test_a_batch_is_read_as_the_order_brings_its_files(job, tmp_path, monkeypatch):
    """read_as_landed (what an archfs.torch dataset reads a batch with) hands over a
    batch's files as the order lands them in the node's copy, not in the order asked,
    and fetches none of them itself: each byte of the archive comes from the server
    once, every file right."""
    import archfs

    url, size, expected, proxy = tar_with_index(job, tmp_path, monkeypatch, 24 * MiB, 57,
                                                "landed.tar", rate=8 * MiB)
    crcs = json.loads(expected.read_text())
    a = archfs.open_archive(url)
    files = sorted(a.files("", None))
    assert files == sorted(crcs)
    order = files[:]
    random.Random(57).shuffle(order)
    assert a.fetch_ahead(order) == len(order)
    # A batch of files from late in the order, then of the order's first files (fetched
    # one by one first; the others come in its blocks of 8 MiB, seconds later).
    batch = order[len(order) // 2:len(order) // 2 + 30] + order[:10]
    got = list(a.read_as_landed(batch, wait=DEADLINE))
    positions = [k for k, _ in got]
    assert sorted(positions) == list(range(len(batch)))
    assert all(zlib.crc32(data) == crcs[batch[k]] for k, data in got)
    print(f"{len(batch)} files handed over in the order {positions}")
    # (A late file may share a GET with a first one, and land with it.)
    firsts = set(positions[:10]) & set(range(30, 40))
    assert len(firsts) >= 5, "handed over as asked, not as they landed"
    # The rest of the order lands too; nothing came twice.
    assert all(zlib.crc32(a.read(f)) == crcs[f] for f in order)
    print(f"fetched {proxy.sent / size:.3f}x the archive")
    assert proxy.sent < 1.05 * size + MiB, f"fetched {proxy.sent / size:.2f}x the archive"


def test_fetch_ahead_makes_no_copy_when_preload_is_never(job, tmp_path, monkeypatch):
    """preload="never": FetchAhead's order fetches nothing ahead and makes no node copy;
    the epoch reads the files by their own GETs, right."""
    from test_reader import torch_or_skip

    torch_or_skip()
    url, size, expected, proxy = tar_with_index(job, tmp_path, monkeypatch, 8 * MiB, 56,
                                                "never.tar")
    left_before = scratch_dirs()
    p = subprocess.Popen(
        [sys.executable, "-c", FETCH_AHEAD, url, str(expected), "fork", "0", "never"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    n = len(json.loads(expected.read_text()))
    try:
        line = p.stdout.readline().split()
        assert line[:6] == ["epoch", "0", "samples", str(n), "right", "True"], \
            " ".join(line) + p.stderr.read()
        assert copies([p.pid]) == set(), "a copy was made"
        # The archive's first bytes, no file (~110 KiB each).
        assert int(line[7]) < 64 << 10, f"this process fetched {line[7]} bytes ahead"
        assert scratch_dirs() == left_before
        assert proxy.sent < 1.1 * size + MiB, f"fetched {proxy.sent / size:.2f}x the archive"
        p.stdin.write("\n\n")
        p.stdin.flush()
        line = p.stdout.readline().split()
        assert line[:6] == ["epoch", "1", "samples", str(n), "right", "True"], \
            " ".join(line) + p.stderr.read()
    finally:
        p.stdin.close()
        p.wait(timeout=DEADLINE)
    assert p.returncode == 0, p.stderr.read()
