"""Benchmark archfs against its peers on one machine, in one run.

Usage (as root: needs drop_caches, loop mounts and /dev/fuse):

    scripts/bench --quick --runs 1                 # ~2,000 files, short caps: checks the harness
    scripts/bench                                  # 20,000 files (~2.2 GB), 3 runs, medians
    scripts/bench --jpeg --files 20000 --out /tmp/archfs-bench/result.md
    scripts/bench --tools archfs,squashfuse_ll,kernel --workloads epoch,meta

Compared: archfs on SquashFS (gzip, zstd: `mksquashfs src img -comp X`) and on a plain tar,
with its default --preload=auto and with --preload=never (`archfs nopreload`); squashfuse and
squashfuse_ll on the same images; the kernel's squashfs driver (loop mount); ratarmount,
archivemount and fuse-archive (when installed) on the tar; the directory on disk; the dataset
untarred into /dev/shm.

`--scale` is a mode of its own (scripts/archbench/scale.py): ImageNet's 1.28 M files as a tar,
a SquashFS image and a plain directory; metadata walks, ImageFolder, first epochs, and the
tar index from 1.28 M to 14 M entries.

`--remote` is another (scripts/archbench/remote.py): archfs on s3:// URLs served by SeaweedFS
in a network namespace behind an emulated link (round trip and rate, `--remote-links`),
against copying first (`aws s3 cp`), ratarmount through fsspec/s3fs and rclone mount; time
to the first batch and to the end of the first epoch, GETs and bytes, beside streaming the
object once over the same link.

`--inproc` is another (scripts/archbench/inproc.py): the in-process reader
(`archfs.open_archive`, `archfs.torch.ImageFolder`) beside the mount and the plain
directory, at 10,000 and 1.28 M files.

`--inproc-remote` is another (scripts/archbench/inproc_remote.py): in-process data loaders
reading JPEGs from S3 over the emulated link, as a DataLoader with W workers: archfs.torch on
a tar and a SquashFS object (with and without FetchAhead), an archfs mount, copy first,
s3torchconnector, LitData (raw and optimized), WebDataset; images/s, first batch, bytes and
requests on the link, peak memory.

`--ranks` is another (scripts/archbench/ranks.py): a job's R ranks x W DataLoader workers
on one node over one archive (local, s3://, copied first): bytes from storage, the node's
peak memory, epochs against R = 1.

Workloads, each cold (readers started, then page cache dropped and a fresh mount, timed from
the moment the mount is live) then warm (second pass, same mount):
shuffled whole-file epochs with 1/2/4 reader processes; 500 single-file read latencies;
metadata walks (`find -type f`, os.stat of every file); torchvision ImageFolder index time and
DataLoader epochs (num_workers 2 and 4, real JPEGs with --jpeg) when torch installs; time to a
usable mount (for tar: without and with a saved index). Server peak RSS (VmHWM) and CPU
seconds (utime+stime) are read from /proc before unmounting.

Every tool x workload is capped (--cap seconds) and reported as "timeout" past it. Everything
mounted is unmounted on exit (normal, error or signal). Datasets, images and the tar are
cached under --workdir and reused. Helpers (ratarmount, Pillow, torch, torchvision) live in a
venv at ~/.cache/archfs-bench/venv, created on first use; the orchestration is stdlib only.
Progress goes to stderr; the markdown report to stdout and to --out.
"""

# The package behind scripts/bench (the command: it puts scripts/ on sys.path and calls main
# below). One module per role; a new benchmark is a module of its own beside these. Each
# imports only modules above it in this list, never one below (no circle):
#   constants  where things are (the command, the venv), the helper modes' names
#   stats      the one median, how a table sums up a metric's runs, percentiles
#   helpers    the helper modes that need none of the rest, each run as a separate process
#              (`bench _read ...`)
#   system     logging and commands, caches and memory, /proc, mounts, the cleanup registry
#   deps       the peers' Debian packages and the bench venv
#   corpus     the dataset tree, its manifest and the archives packed from it
#   tools      each tool compared and how it mounts and unmounts; preflight; the archfs binary
#   workloads  the workloads and the Bench that runs each tool through them
#   report     the markdown report
#   plots      the PNG plots (matplotlib, in the bench venv)
#   scale      the --scale mode
#   inproc     the --inproc mode: the in-process reader beside the mount
#   remote     the --remote mode: s3:// URLs over an emulated network
#   ranks      the --ranks mode: R ranks x W workers of one job on one node
#   nodes      the --nodes mode: one job's nodes sharing one copy of an archive
#   inproc_remote  the --inproc-remote mode: in-process loaders from S3 beside their peers
#   shards     the --shards mode: unions of WebDataset shards
#   cli        the flags and the orchestration of a run
# and this file, which starts a helper mode or a run.

from .constants import HELPER_MODES


def main(argv):
    """scripts/bench ARGV: a helper mode (its name first, before any argument parsing), else
    a benchmark run. A helper process imports its mode's module alone."""
    if argv and argv[0] in HELPER_MODES:
        helper(argv[0])(argv[1:])
        return
    from . import cli
    cli.run(argv, __doc__)


def helper(mode):
    """The function that runs helper MODE (one of constants.HELPER_MODES), from the module of
    the benchmark it serves."""
    if mode == "_remote":
        from .remote import helper as run
    elif mode == "_inproc_remote":
        from .inproc_remote import helper as run
    elif mode == "_node":
        from .nodes import helper_node as run
    elif mode == "_rank":
        from .ranks import helper_rank as run
    else:
        from .helpers import HELPERS
        run = HELPERS[mode]
    return run
