"""archfs.mount on s3:// URLs, against a real S3 server (SeaweedFS's `weed mini`) that this
module starts on loopback and fills with boto3. scripts/pytest stages `weed` (from the venv
scripts/setup makes) and names it in ARCHFS_WEED, and installs boto3 beside pytest; it runs
this file as root and as an ordinary user, who then runs the server too.

Objects are read through a mount, and in this process by archfs.open_archive and fsspec's
archfs protocol, forked children included."""

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest

import archfs

from test_archfs import DEADLINE, wait_for  # noqa: E402 - the suite's own helpers
ACCESS_KEY = "AKIAARCHFSPYTEST0001"
SECRET_KEY = "pyTest/secret+0123456789abcdefghijklmnop"
STARTED = "All enabled components are running"


def free_ports(n):
    """n free loopback ports; each held until all are found, so they differ. weed's
    maintenance worker dials the admin port + 10000: kept a valid port."""
    held, ports = [], []
    while len(ports) < n:
        s = socket.socket()
        s.bind(("0.0.0.0", 0))
        port = s.getsockname()[1]
        held.append(s)
        if port + 10000 <= 65535 or len(ports) != 8:
            ports.append(port)
    for s in held:
        s.close()
    return ports


class PortTaken(Exception):
    """Another process bound one of the ports first: try others."""


class S3:
    """A `weed mini` on loopback with one identity; stopped by `stop`."""

    def __init__(self, weed, root):
        import boto3
        from botocore.config import Config

        self.root = root
        # The data in memory: a volume server refuses every write once its disk has less
        # than 1% free, as a CI machine's disk filled by builds and test data had.
        shm = Path("/dev/shm")
        self.data = Path(tempfile.mkdtemp(prefix="archfs-test-weed-", dir=shm)) \
            if shm.is_dir() else root / "data"
        self.data.mkdir(exist_ok=True)
        (root / "s3.json").write_text(json.dumps({"identities": [{
            "name": "archfs-pytest",
            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}))
        p = dict(zip(["master", "master.port.grpc", "volume", "volume.port.grpc", "filer",
                      "filer.port.grpc", "s3", "s3.port.grpc", "admin", "admin.port.grpc"],
                     free_ports(10)))
        self.ports = list(p.values())
        args = [weed, "mini", f"-dir={self.data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                "-master.telemetry=false", "-master.resumeState=false",
                # Volumes not sized from the disk's free space (tests/common/s3.rs says why).
                "-master.volumeSizeLimitMB=64", "-volume.max=100",
                "-volume.preStopSeconds=0", "-s3.port.iceberg=0", "-s3.port.lance=0",
                "-admin.ui=false", "-webdav=false", f"-s3.config={root / 's3.json'}",
                f"-filer.localSocket={root / 'filer.sock'}",
                f"-s3.localSocket={root / 's3.sock'}"]
        for name in ["master", "volume", "filer", "s3", "admin"]:
            args.append(f"-{name}.port={p[name]}")
            args.append(f"-{name}.port.grpc={p[name + '.port.grpc']}")
        self.log = root / "weed.log"
        with open(self.log, "wb") as log:
            # Nothing of ours: weed takes AWS_* for an identity and WEED_* for settings.
            self.proc = subprocess.Popen(
                args, cwd=root, env={"PATH": "/usr/bin:/bin", "HOME": str(root)},
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        self.endpoint = f"http://127.0.0.1:{p['s3']}"
        self.client = boto3.client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1",
            aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
            config=Config(s3={"addressing_style": "path"}, connect_timeout=5, read_timeout=60,
                          retries={"mode": "standard", "max_attempts": 5}))

        def serving():
            if self.proc.poll() is not None:
                if "not available" in self.tail() or "address already in use" in self.tail():
                    shutil.rmtree(self.data, ignore_errors=True)
                    raise PortTaken(self.tail())
                pytest.fail(f"weed exited: {self.tail()}")
            if STARTED not in self.log.read_text(errors="replace"):
                return False
            try:
                self.client.list_buckets()
                return True
            except Exception:  # noqa: BLE001 - not up yet
                return False

        if not wait_for(serving):
            self.stop()
            pytest.fail(f"weed did not serve within {DEADLINE} s: {self.tail()}")

    def tail(self):
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])

    def env(self):
        none = str(self.root / "no-such-aws-file")
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": "us-east-1",
                "AWS_CONFIG_FILE": none, "AWS_SHARED_CREDENTIALS_FILE": none,
                "AWS_EC2_METADATA_DISABLED": "true"}

    def stop(self):
        """SIGTERM to weed's group, SIGKILL after a grace period (its volume server's
        shutdown hangs now and then); then the gRPC sockets it leaves in /tmp."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass
        shutil.rmtree(self.data, ignore_errors=True)
        for port in self.ports:
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                try:
                    sock.unlink()
                except OSError:
                    pass


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    weed = os.environ.get("ARCHFS_WEED")
    if not weed or not os.access(weed, os.X_OK):
        pytest.fail("ARCHFS_WEED names no weed binary: run these tests through scripts/pytest "
                    "(after scripts/setup)")
    for attempt in range(3):
        try:
            server = S3(weed, tmp_path_factory.mktemp("s3"))
            break
        except PortTaken:
            if attempt == 2:
                raise
    yield server
    server.stop()


@pytest.fixture
def aws(s3, monkeypatch):
    """The server's AWS_* variables, and none of the machine's, for archfs."""
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    return s3


@pytest.fixture
def tree(tmp_path):
    src = tmp_path / "src"
    for kind, base in [("cat", 3), ("dog", 7)]:
        (src / "train" / kind).mkdir(parents=True)
        for i in range(30):
            data = bytes((base * i + j) % 251 for j in range(1000 + 997 * i))
            (src / "train" / kind / f"{i}.jpg").write_bytes(data)
    (src / "which").write_text("s3\n")
    return src


def files(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_an_s3_tar_and_squashfs_mount_as_local_ones_do(aws, tree, tmp_path, monkeypatch):
    aws.client.create_bucket(Bucket="formats")
    tar = tmp_path / "data.tar"
    with tarfile.open(tar, "w", format=tarfile.PAX_FORMAT) as t:
        t.add(tree, arcname=".")
    img = tmp_path / "data.sqfs"
    subprocess.run(["mksquashfs", str(tree), str(img), "-noappend", "-quiet", "-no-progress"],
                   check=True)
    aws.client.upload_file(str(tar), "formats", "sets/data.tar")
    aws.client.upload_file(str(img), "formats", "sets/data.sqfs")
    want = files(tree)
    for url in ["s3://formats/sets/data.tar", "s3://formats/sets/data.sqfs"]:
        mnt = tmp_path / "mnt"
        with archfs.mount(url, mnt, preload=False) as root:
            assert os.path.ismount(root)
            assert files(root) == want, url
        assert not os.path.ismount(mnt)
    # No mount point given: one is made for the job, named after the object, and removed.
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("SLURM_JOB_ID", "31")
    m = archfs.mount("s3://formats/sets/data.tar")
    try:
        assert m.path.parent == tmp_path and m.path.name.startswith("archfs-job31-data"), m.path
        assert files(m.path) == want
    finally:
        m.unmount()
    assert not m.path.exists()


def test_an_s3_object_in_a_union_with_a_local_image(aws, tree, tmp_path):
    aws.client.create_bucket(Bucket="union")
    tar = tmp_path / "data.tar"
    with tarfile.open(tar, "w") as t:
        t.add(tree, arcname=".")
    aws.client.upload_file(str(tar), "union", "data.tar")
    local = tmp_path / "local"
    (local / "extra").mkdir(parents=True)
    (local / "which").write_text("local\n")
    (local / "extra" / "only-here").write_text("local only\n")
    img = tmp_path / "local.sqfs"
    subprocess.run(["mksquashfs", str(local), str(img), "-noappend", "-quiet", "-no-progress"],
                   check=True)
    with archfs.mount(["s3://union/data.tar", img], tmp_path / "mnt") as root:
        assert (root / "which").read_text() == "local\n", "the last archive wins"
        assert (root / "extra/only-here").read_text() == "local only\n"
        assert (root / "train/dog/29.jpg").read_bytes() == (tree / "train/dog/29.jpg").read_bytes()
        assert len(list((root / "train/cat").iterdir())) == 30


def test_a_missing_object_raises_mount_error_naming_it(aws, tmp_path):
    aws.client.create_bucket(Bucket="empty")
    with pytest.raises(archfs.MountError) as err:
        archfs.mount("s3://empty/absent.tar", tmp_path / "mnt")
    msg = str(err.value)
    assert "s3://empty/absent.tar" in msg and "no such object" in msg, msg
    assert "\n" not in msg and SECRET_KEY not in msg
    assert not os.path.ismount(tmp_path / "mnt")


def in_child(fn, secs=DEADLINE):
    """fn() in a child made by os.fork, as DataLoader makes its workers: what it returned
    (bytes), or a failure if it hung past `secs`."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(w, fn())
        finally:
            os._exit(0)
    os.close(w)
    # poll, not select: the suite's process may hold descriptors past 1024.
    poller = select.poll()
    poller.register(r, select.POLLIN)
    if not poller.poll(secs * 1000):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail(f"a forked child hung for {secs} s")
    out = os.read(r, 1 << 16)
    os.waitpid(pid, 0)
    return out


def test_s3_objects_read_in_process_in_forked_children_and_through_fsspec(aws, tree, tmp_path):
    import fsspec

    aws.client.create_bucket(Bucket="inproc")
    tar = tmp_path / "data.tar.gz"
    subprocess.run(["tar", "-czf", str(tar), "-C", str(tree), "."], check=True)
    img = tmp_path / "data.sqfs"
    subprocess.run(["mksquashfs", str(tree), str(img), "-noappend", "-quiet", "-no-progress"],
                   check=True)
    aws.client.upload_file(str(tar), "inproc", "shards/a.tar.gz")
    aws.client.upload_file(str(img), "inproc", "b.sqfs")
    want = files(tree)
    names = sorted(want)
    for url in ["s3://inproc/shards/a.tar.gz", "s3://inproc/b.sqfs", "s3://inproc/shards/"]:
        a = archfs.open_archive(url)
        assert dict(zip(names, a.read_many(names))) == want, url
        # The parent has read (its copy and connections are under way): a child reads
        # with threads and connections of its own.
        got = in_child(lambda: b"ok" if a.read_many(names) == [want[n] for n in names]
                       else b"bad")
        assert got == b"ok", url
        fs = fsspec.filesystem("archfs", fo=url)
        assert sorted(fs.ls("train", detail=False)) == ["train/cat", "train/dog"]
        assert fs.cat_file("train/dog/5.jpg", 3, 10) == want["train/dog/5.jpg"][3:10]
    with pytest.raises(FileNotFoundError, match="no such object"):
        archfs.open_archive("s3://inproc/absent.sqfs")


def test_what_the_store_refuses_raises_the_exception_of_its_kind(aws, monkeypatch):
    """A missing object or bucket is FileNotFoundError, credentials the store refuses
    PermissionError: by the kind of the failed request, not its message's words."""
    aws.client.create_bucket(Bucket="kinds")
    aws.client.put_object(Bucket="kinds", Key="x.tar", Body=bytes(10240))
    with pytest.raises(FileNotFoundError, match="no such object"):
        archfs.open_archive("s3://kinds/absent.tar")
    with pytest.raises(FileNotFoundError, match="no such bucket"):
        archfs.open_archive("s3://no-such-bucket-kinds/x.tar")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong/secret+0123456789abcdefghijklmnop")
    with pytest.raises(PermissionError, match="secret key does not match") as err:
        archfs.open_archive("s3://kinds/x.tar")
    assert "wrong/secret" not in str(err.value)
