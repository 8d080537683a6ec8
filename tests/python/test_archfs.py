"""The Python package, installed from the wheel into a fresh venv, driving real mounts.
scripts/pytest runs this file as root and as an ordinary user."""

import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

import archfs
from archfs._binary import find_archfs

DEADLINE = 60  # seconds; generous, so a busy machine passes too


def wait_for(cond, secs=DEADLINE):
    end = time.monotonic() + secs
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


@pytest.fixture
def tree(tmp_path):
    src = tmp_path / "src"
    (src / "train" / "cat").mkdir(parents=True)
    (src / "train" / "dog").mkdir(parents=True)
    for i in range(20):
        (src / "train" / "cat" / f"{i}.jpg").write_bytes(bytes([i]) * (1000 + i))
        (src / "train" / "dog" / f"{i}.jpg").write_bytes(bytes([255 - i]) * (3000 + i))
    (src / "which").write_text("squashfs\n")
    return src


@pytest.fixture
def sqfs(tree, tmp_path):
    img = tmp_path / "data.sqfs"
    subprocess.run(["mksquashfs", str(tree), str(img), "-noappend", "-quiet", "-no-progress"],
                   check=True)
    return img


@pytest.fixture
def tar(tree, tmp_path):
    path = tmp_path / "data.tar"
    (tmp_path / "tar-which").write_text("tar\n")
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as t:
        t.add(tree / "train", arcname="train")
        t.add(tmp_path / "tar-which", arcname="which")
    return path


def files(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_squashfs_mounts_in_a_with_block_and_goes_after(sqfs, tree, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    with archfs.mount(sqfs) as root:
        assert isinstance(root, Path)
        assert os.path.ismount(root)
        assert files(root) == files(tree)
    assert not os.path.ismount(root)
    assert not root.exists(), "the mount point archfs made is removed again"


def test_tar_and_a_union_where_the_last_archive_wins(sqfs, tar, tree, tmp_path):
    with archfs.mount(tar) as root:
        assert (root / "which").read_text() == "tar\n"
        assert (root / "train/cat/3.jpg").read_bytes() == (tree / "train/cat/3.jpg").read_bytes()
    mnt = tmp_path / "union"
    with archfs.mount([tar, sqfs], mnt) as root:
        assert root == mnt.resolve()
        assert (root / "which").read_text() == "squashfs\n"
        assert len(list((root / "train/dog").iterdir())) == 20
    assert not os.path.ismount(mnt)


def test_an_exception_in_the_with_block_still_unmounts(sqfs, tmp_path):
    mnt = tmp_path / "mnt"
    with pytest.raises(KeyError):
        with archfs.mount(sqfs, mnt, cache_size="64M", threads=4, preload=False):
            assert os.path.ismount(mnt)
            raise KeyError("boom")
    assert not os.path.ismount(mnt)


def test_a_bad_archive_raises_mount_error_with_the_cli_text(tmp_path):
    bad = tmp_path / "notes.sqfs"
    bad.write_text("just some text, not an image")
    with pytest.raises(archfs.MountError) as err:
        archfs.mount(bad, tmp_path / "mnt")
    assert "neither a SquashFS image nor a tar archive" in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(archfs.MountError, match="cannot open archive"):
        archfs.mount(tmp_path / "missing.sqfs")


def test_the_mount_dies_with_its_sigkilled_owner(sqfs):
    owner = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time, archfs; m = archfs.mount(sys.argv[1]); "
         "print(m.path, flush=True); f = open(m.path / 'which'); time.sleep(3600)", str(sqfs)],
        stdout=subprocess.PIPE, text=True)
    path = owner.stdout.readline().strip()
    assert os.path.ismount(path)
    start = time.monotonic()
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    assert wait_for(lambda: not os.path.ismount(path)), "mount outlived its owner"
    print(f"mount gone {time.monotonic() - start:.3f} s after its owner was SIGKILLed")
    assert wait_for(lambda: not os.path.exists(path))


def test_the_default_mount_point_is_job_private_and_node_local(sqfs, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    m = archfs.mount(sqfs)
    try:
        assert m.path.parent == tmp_path
        assert m.path.name.startswith("archfs-job777-data-")
        assert os.fspath(m) == str(m.path)
    finally:
        m.unmount()
    m.unmount()  # a second call does nothing
    assert not m.path.exists()


def test_the_cli_runs_as_a_module_and_prints_the_mount_point_it_chose(sqfs, tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    run = lambda *args: subprocess.run([sys.executable, "-m", "archfs", *args], env=env,
                                       capture_output=True, text=True, check=True)
    assert run("--version").stdout.startswith("archfs ")
    path = run("mount", str(sqfs)).stdout.strip()
    assert Path(path).parent == tmp_path and os.path.ismount(path)
    run("unmount", path)
    assert not os.path.ismount(path)


def test_the_installed_binary_and_extension_need_no_glibc_newer_than_2_17():
    sys.path.insert(0, str(Path(__file__).parent))
    from glibc_floor import newest_glibc
    import archfs._native

    binary = find_archfs()
    assert Path(binary).parent == Path(sys.executable).parent, "the wheel's binary is used"
    for elf in (binary, archfs._native.__file__):
        newest = tuple(int(x) for x in newest_glibc(elf).split("."))
        assert (2, 0) < newest <= (2, 17), (elf, newest)


RANK = """
import os, sys, archfs
img, want, work, i, how = sys.argv[1:]
want = open(want, "rb").read()
with archfs.mount(img, **({"shared": True} if how == "asked" else {})) as root:
    print(root, flush=True)
    said = False
    while not os.path.exists(os.path.join(work, f"stop-{i}")):
        assert (root / "train/cat/3.jpg").read_bytes() == want
        if not said and os.path.exists(os.path.join(work, "phase2")):
            print("phase2 ok", flush=True)
            said = True
"""


@pytest.mark.parametrize("how", ["asked", "torchrun", "srun"])
def test_eight_ranks_share_one_mount_that_goes_after_the_last(sqfs, tree, tmp_path, monkeypatch,
                                                               how):
    """Asked with shared=True, or by default in ranks a launcher started (torchrun and
    srun say how many there are)."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("SLURM_JOB_ID", "99")
    for var in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(var, raising=False)
    if how != "asked":
        monkeypatch.setenv({"torchrun": "LOCAL_WORLD_SIZE", "srun": "SLURM_STEP_NUM_TASKS"}[how],
                           "8")
    want = tree / "train/cat/3.jpg"
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(sqfs), str(want), str(tmp_path),
                               str(i), how], stdout=subprocess.PIPE, text=True)
             for i in range(8)]
    paths = {r.stdout.readline().strip() for r in ranks}
    assert len(paths) == 1, paths
    path = Path(paths.pop())
    assert path.name.startswith("archfs-job99-data-") and path.name.endswith("-shared")
    assert os.path.ismount(path)
    servers = [p for p in Path("/proc").iterdir() if p.name.isdigit() and
               _args(p)[1:3] == ["__watchdog", str(path)]]
    assert len(servers) == 1, "one server for all ranks"

    # A rank SIGKILLed midway: the server drops it; the others keep reading.
    registry = path.parent / f".{path.name}.archfs-shared"
    ranks[3].kill()
    ranks[3].wait()
    assert wait_for(lambda: len([e for e in registry.iterdir() if e.name != "lock"]) == 7)
    (tmp_path / "phase2").touch()
    for i, r in enumerate(ranks):
        if i != 3:
            assert r.stdout.readline() == "phase2 ok\n", f"rank {i} stopped reading"
    # The ranks leave one by one; the mount goes with the last.
    alive = [i for i in range(8) if i != 3]
    for n, i in enumerate(alive):
        (tmp_path / f"stop-{i}").touch()
        assert ranks[i].wait(timeout=DEADLINE) == 0
        if n < len(alive) - 1:
            assert os.path.ismount(path), f"unmounted while {len(alive) - n - 1} ranks remain"
    assert wait_for(lambda: not os.path.ismount(path))


def test_shared_mounts_of_two_archives_of_one_name_stay_apart(tmp_path, monkeypatch):
    """Two datasets both called data.tar, mounted shared in one job: each rank gets the
    archive it named, never a live mount of the other."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("SLURM_JOB_ID", "98")
    tars = []
    for d in ("imagenet", "places"):
        (tmp_path / d).mkdir()
        (tmp_path / d / f"{d}.txt").write_text(d)
        tar = tmp_path / d / "data.tar"
        with tarfile.open(tar, "w") as t:
            t.add(tmp_path / d / f"{d}.txt", arcname=f"{d}.txt")
        tars.append(tar)
    with archfs.mount(tars[0], shared=True) as a, archfs.mount(tars[1], shared=True) as b:
        assert a != b
        assert os.listdir(a) == ["imagenet.txt"] and os.listdir(b) == ["places.txt"]


def test_a_process_alone_mounts_its_own(sqfs, tmp_path, monkeypatch):
    """No launcher, or a launcher that started one rank: not shared by default."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    for var in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(var, raising=False)
    for env in ({}, {"LOCAL_WORLD_SIZE": "1", "SLURM_STEP_NUM_TASKS": "1"}):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        m = archfs.mount(sqfs)
        try:
            assert not m.shared and not m.path.name.endswith("-shared"), (env, m.path)
        finally:
            m.unmount()


def _args(proc):
    try:
        return (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []
