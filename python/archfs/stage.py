"""``archfs.stage``: one copy of an archive in object storage or on a parallel filesystem on
every node of a job, each byte read from the storage once for the whole job, not once per
node.

Every rank of the job calls it (it is collective)::

    from mpi4py import MPI
    import archfs
    archfs.stage("s3://bucket/imagenet.sqfs", MPI.COMM_WORLD)
    with archfs.mount("s3://bucket/imagenet.sqfs") as root:   # reads the node's copy
        ...

Ranks are grouped into nodes by host name. Of N nodes, node k fetches the k-th 1/N of
the object from storage, and sends each of its pieces, as it arrives, to the other nodes
with the job's own engine (MPI, or torch.distributed's gloo; point-to-point,
non-blocking), which write the pieces they receive straight into their copy (the copy's memory is mapped here: nothing is copied on
the way). A node that sends nothing for ``timeout`` seconds (it died, or stalled) is left
out: its pieces are fetched from storage. The copy is the node's (see
``archfs.mount``, ``archfs.open_archive``): it lives while any process of the job on the
node holds it, this call's result included, and goes with the last.
"""

import mmap
import socket
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from . import _native
from .reader import parse_size

# Pieces of its own a node sends at once, to every other node; and pieces a node
# receives from each other node at once. Pieces go straight between the copies' mapped
# memory: these bound the requests under way, not buffers.
SEND_AHEAD = 4
RECEIVE_AHEAD = 2


class StageError(RuntimeError):
    """The node's copy could not be made; the message says why and what to do."""


class Staged:
    """The node's copy, held: while this lives, the node keeps its copy. What the stage-in
    did is in ``nodes``, ``node`` (this one's index), ``seconds``, ``from_storage`` (bytes
    this process fetched from the object store), ``received`` and ``sent`` (bytes over the
    job's network) and ``given_up`` (nodes left out)."""

    def __init__(self, copy: Any, nodes: int, node: int) -> None:
        self.copy = copy
        self.nodes = nodes
        self.node = node
        self.seconds = 0.0
        self.received = 0
        self.sent = 0
        self.from_storage = 0
        self.given_up: List[int] = []

    def __repr__(self) -> str:
        return (
            f"<archfs.Staged node {self.node} of {self.nodes}, {self.copy.size} bytes, "
            f"{self.copy.left} pieces to come>"
        )


def stage(
    url: str,
    comm: Any = None,
    *,
    timeout: float = 60.0,
    no_sign_request: bool = False,
    stage_dir: Optional[str] = None,
    keep: Union[int, str, None] = None,
    quiet: bool = False,
) -> Staged:
    """Makes the node's copy of the object at ``url`` (or of a file every node sees, at a
    path on a parallel filesystem) on every node of the job, each node
    reading its share from storage and the rest from the other nodes over ``comm``: an
    mpi4py communicator or a torch.distributed process group (``None``: torch.distributed's
    default group when it is set up, else ``MPI.COMM_WORLD``). Collective: every rank of
    ``comm`` calls it. Returns when this node's copy is whole.

    ``timeout``: seconds a node may go without moving a piece before the others fetch
    its pieces from storage themselves. ``stage_dir``/``keep`` as ``archfs mount``'s
    ``--stage-dir``/``--keep`` (copies kept on a node-local disk for later jobs and
    mounts: ``python -m archfs stage`` makes them from a job script). ``quiet``: no
    summary line on stderr (rank 0's)."""
    start = time.monotonic()
    fetched = _native.fetched()[1]
    net = _engine(comm)
    hosts = net.allgather(socket.gethostname())
    order = list(dict.fromkeys(hosts))
    nodes, node = len(order), order.index(hosts[net.rank])
    leader = hosts.index(hosts[net.rank]) == net.rank
    leaders = net.split(leader, node)
    options: Dict[str, Any] = dict(
        no_sign_request=no_sign_request, stage_dir=stage_dir, keep=parse_size(keep, "keep")
    )
    copy, error = None, None
    try:
        copy = _native.NodeCopy(url, make=leader, wait=timeout, **options)
    except (OSError, ValueError) as e:
        error = f"{hosts[net.rank]}: {e}"
    # Every rank learns of any failure, so none waits on a node that will not come.
    errors = [e for e in net.allgather(error) if e]
    if errors:
        raise StageError(f"archfs.stage({url}): " + "; ".join(errors))
    staged = Staged(copy, nodes, node)
    if leader:
        _exchange(staged, leaders, timeout)
    # No collective past the exchange: a node may have died in it.
    _finish(staged, f"archfs.stage({url})", timeout, start, fetched)
    if net.rank == 0 and not quiet:
        print(
            f"archfs: {url}: {copy.size / 1e9:.2f} GB on this node in {staged.seconds:.1f} s: "
            f"{staged.from_storage / 1e9:.2f} GB from storage, {staged.received / 1e9:.2f} GB "
            f"from the job's other {nodes - 1} nodes"
            + (f" (nodes left out: {staged.given_up})" if staged.given_up else ""),
            file=sys.stderr,
            flush=True,
        )
    return staged


def stage_files(
    url: str,
    paths: Sequence[str],
    *,
    timeout: float = 60.0,
    no_sign_request: bool = False,
    stage_dir: Optional[str] = None,
    quiet: bool = False,
) -> Staged:
    """For a dataset larger than a node, each node on a fixed share of its files
    (``archfs.torch.NodeSampler``, whose ``stage`` calls this): copies the bytes the files
    at ``paths`` lie in, and the archive's tables, from the object at ``url`` into the
    node's memory (``stage_dir`` where they do not fit). Those bytes only, each fetched
    from storage once for the node: over the job, each byte of the dataset once. Reads
    of these files by any process of the job on the node (``archfs.open_archive``,
    ``archfs.torch``, ``archfs.mount``) are then served from the copy; other files are
    read on demand. Every rank of the node may call it with the same share: the first
    places the copy, all fetch its pieces, and each returns when it is whole.

    A SquashFS image or a plain tar (a compressed tar's members do not lie in its own
    bytes: stage it whole with ``stage``). ``timeout``: seconds the copy may go without
    a piece arriving before this process fetches what no process has taken."""
    from .reader import Archive

    start = time.monotonic()
    fetched = _native.fetched()[1]
    archive = Archive(url, no_sign_request=no_sign_request, preload="never")
    try:
        ranges = archive._handle().stored(list(paths))
        copy = _native.NodeCopy(
            url, make=True, wait=timeout, no_sign_request=no_sign_request,
            stage_dir=stage_dir, ranges=ranges,
        )
    except (OSError, ValueError) as e:
        raise StageError(f"archfs.stage_files({url}): {e}") from None
    staged = Staged(copy, 1, 0)
    copy.fetch_free()
    _finish(staged, f"archfs.stage_files({url})", timeout, start, fetched)
    shape = _native.topology()
    if not quiet and (shape is None or not shape.rank_here):
        print(
            f"archfs: {url}: this node's share, {len(paths)} files in {copy.size / 1e9:.2f} "
            f"GB, on this node in {staged.seconds:.1f} s ({staged.from_storage / 1e9:.2f} GB "
            "fetched by this process)",
            file=sys.stderr,
            flush=True,
        )
    return staged


def _finish(staged: Staged, what: str, timeout: float, start: float, fetched: int) -> None:
    """Waits for the node's copy to be whole, and notes the time and the bytes this
    process fetched since ``start``. Whenever nothing arrives for ``timeout`` seconds (the
    process moving the pieces stopped), this process fetches what no process has
    taken. Raises StageError when the copy failed."""
    copy = staged.copy
    state, left, moved = copy.wait_whole(0), copy.left, time.monotonic()
    while state == "pending":
        state = copy.wait_whole(1.0)
        if copy.left != left:
            left, moved = copy.left, time.monotonic()
        elif time.monotonic() - moved > timeout:
            copy.fetch_free()
            moved = time.monotonic()
    staged.seconds = time.monotonic() - start
    staged.from_storage = _native.fetched()[1] - fetched
    if state != "copied":
        raise StageError(
            f"{what}: the copy on {socket.gethostname()} failed (the warning above says "
            "why); reads there fetch from storage"
        )


def _ranges(pieces: int, nodes: int) -> List[Tuple[int, int]]:
    """Each node's share: a contiguous run of pieces (long GETs), sizes within one."""
    return [(j * pieces // nodes, (j + 1) * pieces // nodes) for j in range(nodes)]


def _exchange(staged: Staged, net: Any, timeout: float) -> None:
    """The leaders' part: fetch this node's share, send it, receive the others'."""
    copy, k = staged.copy, net.rank
    n = net.size
    shape = net.allgather((copy.size, copy.left == 0))
    if any(s[0] != copy.size for s in shape):
        raise StageError(
            "the nodes see different versions of the object (sizes "
            f"{sorted({s[0] for s in shape})}): it was replaced during the stage-in; run again"
        )
    if all(whole for _, whole in shape):
        return
    ranges = _ranges(copy.pieces, n)
    lo, hi = ranges[k]
    copy.share(lo, hi)
    if n == 1:
        return
    whole_here = shape[k][1]
    data = mmap.mmap(copy.fileno(), copy.size)
    view = memoryview(data)
    ps = copy.piece_size

    def length(p: int) -> int:
        return min((p + 1) * ps, copy.size) - p * ps

    def span(p: int) -> memoryview:
        return view[p * ps : p * ps + length(p)]

    send_to = [j for j in range(n) if j != k and not shape[j][1]]
    receive_from = [] if whole_here else [j for j in range(n) if j != k]
    next_send = lo
    sending: List[Tuple[int, List[Tuple[int, Any]]]] = []
    next_receive = {j: ranges[j][0] for j in receive_from}
    receiving: Dict[int, List[Tuple[int, Any, bool, Any]]] = {j: [] for j in receive_from}
    moved = {j: time.monotonic() for j in range(n)}
    dead: set = set()

    abandoned: List[Any] = []

    def give_up(j: int, why: str) -> None:
        dead.add(j)
        staged.given_up.append(j)
        held = [q for q, req, into, _ in receiving.get(j, [])]
        # Cancelled, then completed or freed below: MPI_Finalize may wait for requests
        # left under way.
        mine = [req for _, req, _, _ in receiving.get(j, [])]
        mine += [req for _, reqs in sending for jj, req in reqs if jj == j]
        for req in mine:
            net.cancel(req)
        abandoned.extend(mine)
        receiving[j] = []
        start_q = next_receive.get(j, ranges[j][1])
        released = copy.release(held + list(range(start_q, ranges[j][1])))
        next_receive[j] = ranges[j][1]
        print(
            f"archfs: node {k}: node {j} {why}: its {released} pieces left are "
            "fetched from storage here",
            file=sys.stderr,
            flush=True,
        )

    try:
        while True:
            busy = False
            # This node's pieces, to every other node, as each lands here.
            while len(sending) < SEND_AHEAD and next_send < hi:
                state = copy.wait(next_send, 0)
                if state == "pending":
                    break
                if state == "failed":
                    next_send = hi  # the others give up on this node and fetch its share
                    break
                reqs = []
                for j in send_to:
                    if j in dead:
                        continue
                    try:
                        reqs.append((j, net.isend(span(next_send), j)))
                    except net.errors as e:
                        give_up(j, f"cannot be sent to ({e})")
                sending.append((next_send, reqs))
                next_send += 1
                busy = True
            for entry in list(sending):
                p, reqs = entry
                left = []
                for j, req in reqs:
                    if j in dead:
                        continue
                    try:
                        if net.done(req):
                            moved[j] = time.monotonic()
                            staged.sent += length(p)
                            continue
                    except net.errors as e:
                        give_up(j, f"failed ({e})")
                        continue
                    left.append((j, req))
                if left:
                    entry[1][:] = left
                else:
                    sending.remove(entry)
                    busy = True
            # The other nodes' pieces, in each node's order (MPI keeps a sender's order).
            for j in receive_from:
                if j in dead:
                    continue
                pending = receiving[j]
                while len(pending) < RECEIVE_AHEAD and next_receive[j] < ranges[j][1]:
                    q = next_receive[j]
                    into = copy.receive(q)
                    # A piece the node has (or another process brings): received and dropped.
                    buf = span(q) if into else bytearray(length(q))
                    try:
                        pending.append((q, net.irecv(buf, j), into, buf))
                    except net.errors as e:
                        if into:
                            copy.release([q])
                        give_up(j, f"cannot be received from ({e})")
                        break
                    next_receive[j] += 1
                while pending and j not in dead:
                    q, req, into, _ = pending[0]
                    try:
                        if not net.done(req):
                            break
                    except net.errors as e:
                        give_up(j, f"failed ({e})")
                        break
                    pending.pop(0)
                    if into:
                        copy.landed(q)
                    staged.received += length(q)
                    moved[j] = time.monotonic()
                    busy = True
            now = time.monotonic()
            for j in range(n):
                waiting = receiving.get(j) or any(
                    any(jj == j for jj, _ in reqs) for _, reqs in sending
                )
                if j not in dead and waiting and now - moved[j] > timeout:
                    give_up(j, f"moved nothing for {timeout:.0f} s")
            done_receiving = all(
                j in dead or (not receiving[j] and next_receive[j] >= ranges[j][1])
                for j in receive_from
            )
            if next_send >= hi and not sending and done_receiving:
                break
            if not busy:
                if next_send < hi and len(sending) < SEND_AHEAD:
                    copy.wait(next_send, 0.002)
                else:
                    time.sleep(0.0005)
    finally:
        _let_go(net, abandoned)
        try:
            view.release()
            data.close()
        except BufferError:
            pass  # a cancelled request may still hold it: the mapping goes at exit


def _let_go(net: Any, requests: List[Any]) -> None:
    """Completes cancelled requests, for a second at most; frees those still held."""
    until = time.monotonic() + 1.0
    for req in requests:
        try:
            while not net.done(req) and time.monotonic() < until:
                time.sleep(0.001)
            if not net.done(req):
                net.free(req)
        except net.errors:
            pass


def _engine(comm: Any) -> Any:
    """The job's engine: torch.distributed's group when ``comm`` is one, or none is given
    and torch.distributed is set up; else MPI."""
    torch_dist = sys.modules.get("torch.distributed")
    if comm is None and torch_dist is not None and torch_dist.is_initialized():
        return _Torch(None)
    if comm is not None and type(comm).__module__.startswith("torch"):
        return _Torch(comm)
    return _Mpi(comm)


class _Torch:
    """The same over torch.distributed: a gloo group of the job's ranks (or of ``group``'s)
    of its own, so its messages never meet the job's and NCCL jobs work too (pieces are
    in host memory). Pieces go as uint8 tensors over the mapped copy itself."""

    def __init__(self, group: Any, ranks: Optional[List[int]] = None) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.errors = (RuntimeError,)
        if ranks is None:
            ranks = (
                list(range(dist.get_world_size()))
                if group is None
                else dist.get_process_group_ranks(group)
            )
        self.ranks = ranks
        self.group = dist.new_group(ranks=ranks, backend="gloo")
        me = dist.get_rank()
        self.rank = ranks.index(me) if me in ranks else -1
        self.size = len(ranks)

    def allgather(self, value: Any) -> List[Any]:
        out: List[Any] = [None] * self.size
        self.dist.all_gather_object(out, value, group=self.group)
        return out

    def split(self, member: bool, key: int) -> "_Torch":
        flags = self.allgather((member, key, self.ranks[self.rank]))
        ranks = [r for m, _, r in sorted(flags, key=lambda f: (f[1], f[2])) if m]
        # new_group is collective over the whole job: every rank makes it.
        return _Torch(None, ranks)

    def _tensor(self, buf: Any) -> Any:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a read-only view: sent, never written
            return self.torch.frombuffer(buf, dtype=self.torch.uint8)

    def isend(self, buf: Any, dest: int) -> Any:
        return _Waited(self.dist.isend(self._tensor(buf), self.ranks[dest], group=self.group))

    def irecv(self, buf: Any, source: int) -> Any:
        return _Waited(self.dist.irecv(self._tensor(buf), self.ranks[source], group=self.group))

    def done(self, req: Any) -> bool:
        return req.done()

    def cancel(self, req: Any) -> None:
        pass  # gloo has no cancel: a late piece brings the same bytes

    def free(self, req: Any) -> None:
        pass


class _Waited:
    """A gloo send or receive, waited for on a thread of its own: gloo marks its point to
    point requests complete only in ``wait``, never for ``is_completed``."""

    def __init__(self, work: Any) -> None:
        self.error: Optional[BaseException] = None
        self.finished = threading.Event()
        threading.Thread(target=self._wait, args=(work,), daemon=True).start()

    def _wait(self, work: Any) -> None:
        try:
            work.wait()
        except RuntimeError as e:
            self.error = e
        self.finished.set()

    def done(self) -> bool:
        if self.error is not None:
            raise self.error
        return self.finished.is_set()


class _Mpi:
    """What the stage-in needs of MPI, over a duplicate of the user's communicator (its
    messages never meet the job's own); errors raise rather than abort the job."""

    def __init__(self, comm: Any) -> None:
        try:
            from mpi4py import MPI
        except ImportError as e:
            raise StageError(
                "archfs.stage needs mpi4py (pip install archfs[mpi]; it loads the MPI the "
                "job runs with, under mpirun or srun), or torch.distributed set up first "
                "(torchrun; init_process_group)"
            ) from e
        self.MPI = MPI
        self.errors = (MPI.Exception,)
        self.comm = (comm if comm is not None else MPI.COMM_WORLD).Dup()
        self.comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()

    def allgather(self, value: Any) -> List[Any]:
        return self.comm.allgather(value)

    def split(self, member: bool, key: int) -> "_Mpi":
        part = self.comm.Split(0 if member else self.MPI.UNDEFINED, key)
        wrapped = _Mpi.__new__(_Mpi)
        wrapped.MPI, wrapped.errors, wrapped.comm = self.MPI, self.errors, part
        if part != self.MPI.COMM_NULL:
            wrapped.rank, wrapped.size = part.Get_rank(), part.Get_size()
        return wrapped

    def isend(self, buf: Any, dest: int) -> Any:
        return self.comm.Isend(buf, dest=dest, tag=7)

    def irecv(self, buf: Any, source: int) -> Any:
        return self.comm.Irecv(buf, source=source, tag=7)

    def done(self, req: Any) -> bool:
        return bool(req.Test())

    def cancel(self, req: Any) -> None:
        try:
            req.Cancel()
        except self.errors:
            pass

    def free(self, req: Any) -> None:
        req.Free()


def main(argv: Sequence[str]) -> int:
    """``python -m archfs stage URL [...]``, in every rank of a job step (``srun
    --ntasks-per-node=1``, ``mpirun``): copies the object to a node-local disk on every
    node, each byte read from storage once, kept there for the job's mounts and readers
    (``archfs mount URL --stage-dir DIR --keep SIZE``)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m archfs stage", description=main.__doc__)
    ap.add_argument("url", help="s3://BUCKET/KEY or https://...")
    ap.add_argument("--stage-dir", required=True, help="a node-local directory")
    ap.add_argument("--keep", required=True, help="bytes the kept copies may take, e.g. 200G")
    ap.add_argument("--timeout", type=float, default=60.0,
                    help="seconds a node may move nothing before it is left out")
    ap.add_argument("--no-sign-request", action="store_true")
    args = ap.parse_args(argv)
    if "://" not in args.url:
        print(f"archfs: {args.url}: a file's node copies live with the job's processes, "
              "not on disk: call archfs.stage.stage(PATH) in every rank of the job (or "
              "copy it to node-local disks with mpiFileUtils' dbcast)", file=sys.stderr)
        return 2
    try:
        stage(args.url, timeout=args.timeout, no_sign_request=args.no_sign_request,
              stage_dir=args.stage_dir, keep=args.keep)
    except StageError as e:
        print(f"archfs: {e}", file=sys.stderr)
        return 1
    return 0
