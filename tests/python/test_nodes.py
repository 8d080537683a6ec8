"""A job of several nodes stages one archive in object storage: each node reads its share
from the storage and the rest from the other nodes, over the job's MPI (archfs.stage).

Nodes are simulated on this machine as Open MPI's mpirun starts them: each rank runs in a
UTS namespace of its own, named after its node (the node's processes share their copy,
found by user, job and host name), with a mount namespace and a node-local TMPDIR of
its own, so a node's copy and mount are its own. The S3 server is test_remote's, behind
a proxy that counts the bytes it sends. Needs root (namespaces) and mpirun."""

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading

import pytest

from test_archfs import DEADLINE, wait_for  # noqa: E402 - the suite's own helpers
from test_node_copy import (  # noqa: F401 - job is a fixture
    MiB,
    CountingProxy,
    copies,
    job,
    make_image,
    my_processes,
    scratch_dirs,
    upload,
)
from test_remote import s3  # noqa: F401 - the module's S3 server (a fixture)

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("mpirun"),
    reason="nodes are namespaces (root) started by mpirun (scripts/setup installs it)",
)

# A rank of the job: stages the archive with the others, then reads every file, from the
# node's copy in process and, on each node's first rank, through a mount of its own; the
# copy's bytes hashed as the node holds them.
RANK = r"""
import hashlib, json, mmap, os, signal, socket, sys, threading, time, zlib
import archfs, archfs.stage
url, expected, timeout = sys.argv[1], json.load(open(sys.argv[2])), float(sys.argv[3])
if "LOCAL_WORLD_SIZE" in os.environ:  # torchrun's
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
else:
    from mpi4py import MPI
    rank = MPI.COMM_WORLD.rank
os.write(1, f"rank {rank} pid {os.getpid()} host {socket.gethostname()}\n".encode())
if str(rank) == os.environ.get("KILL_RANK"):
    # SIGKILLed once its node holds a quarter of the copy: mid-stage.
    def die():
        copy = archfs._native.NodeCopy(url, make=False, wait=60)
        while copy.left > copy.pieces * 3 // 4:
            time.sleep(0.005)
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=die, daemon=True).start()
staged = archfs.stage.stage(url, timeout=timeout)
copy = staged.copy
digest = hashlib.sha256(mmap.mmap(copy.fileno(), copy.size, prot=mmap.PROT_READ)).hexdigest()
with archfs.open_archive(url, preload="never") as a:
    bad = [n for n in sorted(expected) if zlib.crc32(a.read(n)) != expected[n]]
if rank % int(os.environ["RANKS_PER_NODE"]) == 0:
    with archfs.mount(url, shared=False) as root:
        bad += [n for n in sorted(expected)
                if zlib.crc32((root / n).read_bytes()) != expected[n]]
# One write: the ranks' lines reach mpirun's output whole (print's pieces interleaved).
os.write(1, ("done " + json.dumps(dict(rank=rank, node=staged.node, nodes=staged.nodes,
         host=socket.gethostname(), digest=digest, bad=bad[:5], given_up=staged.given_up,
         received=staged.received, from_storage=staged.from_storage)) + "\n").encode())
"""

# Starts a rank as a node of its own: a UTS namespace named after its node and a mount
# namespace; a TMPDIR of the node's.
NODE = r"""
node=${NODE_INDEX:-$((OMPI_COMM_WORLD_RANK / RANKS_PER_NODE))}
hostname "node$node"
export TMPDIR="$NODES/node$node"
mkdir -p "$TMPDIR"
exec "$@"
"""


def scripts(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    node = tmp_path / "node.sh"
    node.write_text(NODE)
    (tmp_path / "nodes").mkdir(exist_ok=True)
    return script, node


def launch(tmp_path, url, expected, nodes, per_node, timeout, recovery=False, kill=None):
    """mpirun with `nodes` x `per_node` ranks, each a process of its simulated node."""
    script, node = scripts(tmp_path)
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(nodes * per_node),
           "-x", f"RANKS_PER_NODE={per_node}", "-x", f"NODES={tmp_path / 'nodes'}",
           "-x", f"KILL_RANK={kill}"]
    cmd += [arg for k in os.environ if k.startswith(("AWS_", "SLURM_JOB_ID", "XDG_"))
            for arg in ("-x", k)]
    if recovery:
        cmd.append("--enable-recovery")
    cmd += ["unshare", "--uts", "--mount", "--propagation", "private", "sh", str(node),
            sys.executable, str(script), url, str(expected), str(timeout)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def finish(run, seen=""):
    """mpirun's output once it ended; a job still running after the deadline is killed
    and the test fails, with its output."""
    try:
        out, _ = run.communicate(timeout=DEADLINE * 4)
        return seen + out
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        out, _ = run.communicate()
        pytest.fail(f"the job hung:\n{seen}{out}")


def results(out):
    return [json.loads(line.split(" ", 1)[1]) for line in out.splitlines()
            if line.startswith("done ")]


def nothing_left(before):
    """No process of the job holds a copy, and no copy is left on disk."""
    return wait_for(lambda: not copies(set(my_processes()) - before) and not scratch_dirs())


@pytest.mark.parametrize("nodes,per_node", [(2, 1), (4, 2)])
def test_each_byte_leaves_the_storage_once_for_the_job(job, tmp_path, monkeypatch, nodes,
                                                      per_node):
    img, expected = make_image(tmp_path, 96 * MiB, seed=11)
    size = img.stat().st_size
    digest = hashlib.sha256(img.read_bytes()).hexdigest()
    url = upload(job, img, f"nodes{nodes}.sqfs")
    proxy = CountingProxy(int(job.endpoint.rsplit(":", 1)[1]))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    before = set(my_processes())
    run = launch(tmp_path, url, expected, nodes, per_node, timeout=60)
    out = finish(run)
    assert run.returncode == 0, out
    done = results(out)
    assert len(done) == nodes * per_node, out
    for r in done:
        assert r["bad"] == [], r
        assert r["digest"] == digest, f"node {r['node']}'s copy differs from the archive"
        assert r["nodes"] == nodes and r["host"] == f"node{r['node']}", r
        assert r["given_up"] == [], r
    leaders = [r for r in done if r["received"]]
    assert len(leaders) == nodes, "a node received nothing from the others"
    # Each node received the others' shares: (N-1)/N of the object.
    for r in leaders:
        assert abs(r["received"] - size * (nodes - 1) / nodes) <= 4 * MiB + 1, r
        # Its own share from storage (pieces of 4 MiB), and the object's first bytes.
        assert abs(r["from_storage"] - size / nodes) <= 4 * MiB + 64 * 1024, r
    print(f"{nodes} nodes: from storage {proxy.sent / size:.3f}x the archive")
    assert size <= proxy.sent <= 1.1 * size, f"storage sent {proxy.sent / size:.2f}x"
    assert nothing_left(before), "a copy outlived the job"


@pytest.mark.parametrize("nodes,per_node", [(2, 2), (4, 1)])
def test_a_file_on_a_shared_filesystem_is_read_once_for_the_job(job, tmp_path, nodes,
                                                               per_node):
    """The same for a file every node sees (a parallel filesystem's; here one file of this
    machine): each node reads its 1/N of it and the rest from the other nodes; every copy
    equals the file; every file reads back on every node, in process and through a mount,
    from the node's copy. What each process read of the file is counted by archfs as it
    reads it (`from_storage`: no server stands between a node and a file to count)."""
    img, expected = make_image(tmp_path, 96 * MiB, seed=15)
    size = img.stat().st_size
    digest = hashlib.sha256(img.read_bytes()).hexdigest()
    before = set(my_processes())
    run = launch(tmp_path, str(img), expected, nodes, per_node, timeout=60)
    out = finish(run)
    assert run.returncode == 0, out
    done = results(out)
    assert len(done) == nodes * per_node, out
    for r in done:
        assert r["bad"] == [] and r["digest"] == digest and r["given_up"] == [], r
        assert r["nodes"] == nodes and r["host"] == f"node{r['node']}", r
    leaders = [r for r in done if r["received"]]
    assert len(leaders) == nodes, "a node received nothing from the others"
    for r in leaders:
        assert abs(r["received"] - size * (nodes - 1) / nodes) <= 4 * MiB + 1, r
        assert abs(r["from_storage"] - size / nodes) <= 4 * MiB, r
    read = sum(r["from_storage"] for r in done)
    print(f"{nodes} nodes over a file: read {read / size:.3f}x the file")
    assert size <= read <= 1.1 * size, f"the nodes read {read / size:.2f}x the file"
    assert nothing_left(before), "a copy outlived the job"


@pytest.mark.parametrize("recovery", [True, False], ids=["others-finish", "job-aborted"])
def test_a_node_killed_mid_stage(job, tmp_path, monkeypatch, recovery):
    """With mpirun --enable-recovery the others finish, its pieces fetched from storage;
    without, mpirun ends the job. Either way the stage-in does not hang, and nothing is
    left once the job has ended."""
    img, expected = make_image(tmp_path, 96 * MiB, seed=12)
    size = img.stat().st_size
    digest = hashlib.sha256(img.read_bytes()).hexdigest()
    url = upload(job, img, f"killed-{recovery}.sqfs")
    # Slow enough that the stage-in is under way for seconds.
    proxy = CountingProxy(int(job.endpoint.rsplit(":", 1)[1]), rate=32 * MiB)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    before = set(my_processes())
    run = launch(tmp_path, url, expected, 3, 1, timeout=5, recovery=recovery, kill=2)
    if recovery:
        # The others finish the stage-in and read every file. Their MPI_Finalize then
        # hangs: Open MPI 4.1 does so after a rank died under --enable-recovery, with
        # plain mpi4py too. The job ends as SLURM ends one: SIGTERM, then SIGKILL.
        lines = []
        reader = threading.Thread(target=lambda: lines.extend(run.stdout), daemon=True)
        reader.start()
        wait_for(lambda: len(results("".join(lines))) == 2, DEADLINE * 4)
        os.killpg(run.pid, signal.SIGTERM)
        try:
            run.wait(timeout=DEADLINE)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
        reader.join(DEADLINE)
        out = "".join(lines)
    else:
        out = finish(run)
    done = results(out)
    assert "rank 2 pid" in out and '"rank": 2' not in out, "rank 2 was not killed mid-stage"
    if recovery:
        assert sorted(r["rank"] for r in done) == [0, 1], out
        for r in done:
            assert r["bad"] == [] and r["digest"] == digest, r
            assert r["given_up"] == [2], r
        assert "node 2 moved nothing for 5 s" in out, out
        print(f"a node killed: from storage {proxy.sent / size:.3f}x the archive")
        # At most: the others' shares (2/3), what node 2 fetched of its own (up to 1/3),
        # and its pieces not sent before the kill, fetched again by each of the two
        # others (up to 2/3); a few pieces in flight.
        assert proxy.sent <= size * (5 / 3) + 16 * MiB, f"{proxy.sent / size:.2f}x"
    else:
        assert run.returncode != 0 and done == [], out
    assert nothing_left(before), "a copy outlived the job"


def test_a_url_that_is_not_there_fails_on_every_rank(job, tmp_path):
    """No rank waits for a node that will not come: every rank raises, naming the URL."""
    expected = tmp_path / "expected.json"
    expected.write_text("{}")
    run = launch(tmp_path, "s3://node/no-such.sqfs", expected, 2, 1, timeout=60)
    out = finish(run)
    assert run.returncode != 0, out
    assert "StageError: archfs.stage(s3://node/no-such.sqfs): node" in out, out



def test_over_torch_distributed_started_by_torchrun(job, tmp_path, monkeypatch):
    """The same over torch.distributed (gloo), 2 nodes of 2 ranks, each node a torchrun of
    its own as on a cluster: the storage serves the object once."""
    need_torch = pytest.importorskip if not os.environ.get("ARCHFS_TEST_EXTRAS") else None
    if need_torch:
        need_torch("torch")
    img, expected = make_image(tmp_path, 64 * MiB, seed=13)
    size = img.stat().st_size
    digest = hashlib.sha256(img.read_bytes()).hexdigest()
    url = upload(job, img, "torchrun.sqfs")
    proxy = CountingProxy(int(job.endpoint.rsplit(":", 1)[1]))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    script, node = scripts(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    before = set(my_processes())
    runs = [subprocess.Popen(
        ["unshare", "--uts", "--mount", "--propagation", "private", "sh", str(node),
         sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(k),
         "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
         str(script), url, str(expected), "60"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env=dict(os.environ, NODE_INDEX=str(k), RANKS_PER_NODE="2",
                 NODES=str(tmp_path / "nodes"))) for k in range(2)]
    out = "".join(finish(r) for r in runs)
    assert all(r.returncode == 0 for r in runs), out
    done = results(out)
    assert sorted(r["rank"] for r in done) == [0, 1, 2, 3], out
    for r in done:
        assert r["bad"] == [] and r["digest"] == digest and r["given_up"] == [], out
        assert r["host"] == f"node{r['rank'] // 2}" and r["nodes"] == 2, r
    print(f"torchrun, 2 nodes: from storage {proxy.sent / size:.3f}x the archive")
    assert size <= proxy.sent <= 1.1 * size, f"storage sent {proxy.sent / size:.2f}x"
    assert nothing_left(before), "a copy outlived the job"


def test_a_job_script_stages_to_node_local_disks_for_later_mounts(job, tmp_path, monkeypatch):
    """`python -m archfs stage` in a job step (one rank a node) leaves each node a kept
    copy on its disk; a mount there afterwards reads it, not the storage."""
    img, expected = make_image(tmp_path, 48 * MiB, seed=14)
    size = img.stat().st_size
    url = upload(job, img, "kept.sqfs")
    proxy = CountingProxy(int(job.endpoint.rsplit(":", 1)[1]))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    _, node = scripts(tmp_path)
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2",
           "-x", "RANKS_PER_NODE=1", "-x", f"NODES={tmp_path / 'nodes'}"]
    cmd += [a for k in os.environ if k.startswith(("AWS_", "SLURM_JOB_ID", "XDG_"))
            for a in ("-x", k)]
    # The node's directory is $TMPDIR, made by node.sh: the shell expands it there.
    cmd += ["unshare", "--uts", "sh", str(node), "sh", "-c",
            f'exec "{sys.executable}" -m archfs stage {url} --stage-dir "$TMPDIR" --keep 1G']
    run = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    out = finish(run)
    assert run.returncode == 0, out
    assert "from the job's other 1 nodes" in out, out
    staged = proxy.sent
    assert size <= staged <= 1.1 * size, f"storage sent {staged / size:.2f}x"
    names = json.loads(expected.read_text())
    import archfs
    import zlib
    for k in range(2):
        local = tmp_path / "nodes" / f"node{k}"
        with archfs.mount(url, tmp_path / f"mnt{k}", stage_dir=local, keep="1G") as root:
            bad = [n for n in sorted(names) if zlib.crc32((root / n).read_bytes()) != names[n]]
        assert bad == [], bad
    print(f"kept copies: storage sent {staged / size:.3f}x, then {proxy.sent - staged} bytes "
          "for two mounts")
    assert proxy.sent - staged < size / 20, "a mount read the storage, not the kept copy"
