"""``archfs.mount``: a mount that lives as long as its ``with`` block, or this process."""

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence, Union

from ._binary import find_archfs

PathLike = Union[str, "os.PathLike[str]"]


class MountError(RuntimeError):
    """archfs could not mount or unmount; the message is the command line's own, which
    says what to do."""


class Mount:
    """A live mount. A context manager whose ``with`` block gets the mount point as a
    ``pathlib.Path``; leaving the block, by an exception too, unmounts. ``os.fspath``
    gives the mount point as well."""

    def __init__(self, path: Path, shared: bool = False) -> None:
        self.path = path
        self.shared = shared
        self._mounted = True

    def unmount(self) -> None:
        """Unmounts, lazily if files are still open there; a second call does nothing.
        A shared mount is left, and unmounted only when no other process uses it.
        Raises MountError if the mount is still there when it should not be."""
        if not self._mounted:
            return
        self._mounted = False
        leave = ["--leave", str(os.getpid())] if self.shared else []
        done = subprocess.run(
            [find_archfs(), "unmount", *leave, str(self.path)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        if done.returncode != 0 and os.path.ismount(self.path):
            raise MountError(_message(done.stderr))

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, *exc: object) -> None:
        self.unmount()

    def __fspath__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        state = "mounted" if self._mounted else "unmounted"
        return f"<archfs.Mount {str(self.path)!r} {state}>"


def mount(
    archives: Union[PathLike, Sequence[PathLike]],
    mountpoint: Optional[PathLike] = None,
    *,
    cache_size: Union[int, str, None] = None,
    threads: Optional[int] = None,
    preload: Union[bool, str, None] = None,
    recursive: bool = False,
    allow_other: bool = False,
    log: Optional[PathLike] = None,
    shared: Optional[bool] = None,
    no_sign_request: bool = False,
    stage_dir: Optional[PathLike] = None,
    retry_for: Optional[float] = None,
    keep: Union[int, str, None] = None,
) -> Mount:
    """Mounts one archive, several (shown as one tree: the last wins for a name in more
    than one), or a directory of them (e.g. WebDataset shards), exactly as ``archfs
    mount`` does, and returns once the mount is live.

    With no ``mountpoint``, a job-private directory is made under ``$TMPDIR``, else
    /dev/shm, else /tmp, and removed again on unmount. The mount also goes when this
    process ends in any way, SIGKILL included. Raises MountError with the command
    line's message when the mount fails.

    ``shared=True``: all processes of a job on this node that mount the same archives
    this way share one mount (DDP ranks): the first mounts, the others wait until it is
    live, and it goes when the last has left or died. The default, ``None``, is ``True``
    in one of several ranks a launcher started (torchrun, srun, mpirun), else ``False``:
    each rank's own mount would hold its own kernel page cache of the files it read (up
    to a copy of the dataset each, over epochs). Without sharing, each rank's mount of an
    s3:// archive still reads the node's one copy.

    ``no_sign_request``, ``stage_dir``, ``keep`` and ``retry_for`` are the command line's
    ``--no-sign-request`` (a public bucket), ``--stage-dir`` (a node-local disk for a copy
    that does not fit in memory), ``--keep`` (copies kept there for later jobs, up to this
    size in all) and ``--retry-for`` (seconds a request to an object store may be
    retried).
    """
    if isinstance(archives, (str, os.PathLike)):
        archives = [archives]
    paths = [os.fspath(a) for a in archives]
    if not paths:
        raise ValueError("archfs.mount needs at least one archive")
    argv = [find_archfs(), "mount", "--exit-with", str(os.getpid())]
    if cache_size is not None:
        argv += ["--cache-size", str(cache_size)]
    if threads is not None:
        argv += ["--threads", str(threads)]
    if preload is not None:
        when = {True: "always", False: "never"}.get(preload, preload)  # type: ignore[arg-type]
        argv.append(f"--preload={when}")
    if recursive:
        argv.append("--recursive")
    if allow_other:
        argv += ["-o", "allow_other"]
    if log is not None:
        argv += ["--log", os.fspath(log)]
    if shared is None:
        shared = one_of_several_ranks()
    if shared:
        argv.append("--shared")
    if no_sign_request:
        argv.append("--no-sign-request")
    if stage_dir is not None:
        argv += ["--stage-dir", os.fspath(stage_dir)]
    if retry_for is not None:
        argv += ["--retry-for", str(retry_for)]
    if keep is not None:
        argv += ["--keep", str(keep)]
    if mountpoint is None:
        argv += ["--auto-mountpoint", "--", *paths]
    else:
        argv += ["--", *paths, os.fspath(mountpoint)]
    done = subprocess.run(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    if done.returncode != 0:
        raise MountError(_message(done.stderr))
    if done.stderr:
        sys.stderr.write(done.stderr)  # warnings, e.g. a --preload that does not fit
    if mountpoint is None:
        return Mount(Path(done.stdout.strip()), shared)
    return Mount(Path(os.path.realpath(mountpoint)), shared)


# What launchers tell a rank about the ranks beside it: torchrun's ranks on this node,
# Open MPI's and MPICH's (Intel MPI's, Cray MPICH's) ranks on this node, srun's tasks.
LAUNCHER_SIZES = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                  "SLURM_STEP_NUM_TASKS")


def one_of_several_ranks() -> bool:
    """Whether a launcher started this process as one of several ranks."""
    for var in LAUNCHER_SIZES:
        try:
            if int(os.environ.get(var, "")) > 1:
                return True
        except ValueError:
            pass
    return False


def _message(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    last = lines[-1] if lines else "archfs failed without a message"
    return last[len("archfs: "):] if last.startswith("archfs: ") else last
