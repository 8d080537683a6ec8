"""`scripts/bench --nodes`: a job of N nodes staging one archive in object storage
(issue 52), nodes simulated on this machine.

    sudo scripts/wheel && sudo scripts/bench --nodes            # 5,000 files, N = 1, 2, 4
    sudo scripts/bench --nodes --quick                          # 1,000 files

Each node is one rank started by Open MPI's mpirun in a UTS namespace of its own (its
host name is its node's: the node's processes share one copy, found by host name), with a
TMPDIR of its own. The object is the zstd SquashFS image in SeaweedFS behind `--remote`'s
emulated link (`--nodes-link`, default 10ms/1gbit): one link for all nodes, as a shared
filesystem or object store is one system for all; bytes from storage are the response
bytes the relay counted. Between the nodes, MPI's own transport on this machine.

Ways to get the data to every node, each from nothing:
- `together`: archfs.stage over MPI.COMM_WORLD: each node fetches 1/N, the rest comes
  from the other nodes;
- `each`: archfs.stage over MPI.COMM_SELF: every node copies the whole object (what a
  mount with its stage-in does today on every node);
- `copy first`: every node copies the object to its node-local directory with `aws s3 cp`;
- `on demand`: no copy: each node reads its files with a GET each, in process;
- `share`: for a dataset larger than a node: each node copies only its fixed share of
  the files (archfs.partition's, as NodeSampler draws them) with
  archfs.stage.stage_files, the exact bytes they lie in.

Then the first epoch: each node reads its 1/N of one shuffled order (DistributedSampler)
in process, with 2 forked workers (DataLoader's), from the node's copy; with `share`,
its share, shuffled. Reported: bytes
from storage over the archive, time to a full copy on every node (the slowest node's),
the first epoch after it, and both together.
"""

import json
import os
import random
import subprocess
import sys
import time

from .constants import SCRIPT, VPY
from .corpus import write_list, zstd_image
from .inproc import install_wheel
from .ranks import in_workers
from .remote import BUCKET, delta, ensure_deps, parse_links, remove, start_server
from .report import save
from .system import log

WAYS = ("together", "each", "copy first", "on demand", "share")
WORKERS = 2


def helper_node(argv):
    """_node WAY URL LIST SEED: one node of the job (an MPI rank); prints its result."""
    import archfs
    import archfs.stage
    from mpi4py import MPI

    way, url, listfile, seed = argv[0], argv[1], argv[2], int(argv[3])
    comm = MPI.COMM_WORLD
    rank, n = comm.rank, comm.size
    with open(listfile) as f:
        entries = [(p, int(s)) for p, s in (line.rstrip("\n").split("\t") for line in f)]
    comm.Barrier()
    t0 = time.perf_counter()
    source, held = url, None
    order = list(entries)
    random.Random(seed).shuffle(order)
    mine = order[rank::n]
    if way == "share":
        from archfs.partition import node_shares

        classes = [os.path.dirname(p) for p, _ in entries]
        index = {c: i for i, c in enumerate(sorted(set(classes)))}
        mine = [entries[i] for i in node_shares([index[c] for c in classes], n)[rank]]
        random.Random(seed + rank).shuffle(mine)
        held = archfs.stage.stage_files(url, [p for p, _ in mine], quiet=True)
    elif way in ("together", "each"):
        held = archfs.stage.stage(url, comm if way == "together" else MPI.COMM_SELF,
                                  quiet=True)
    elif way == "copy first":
        source = os.path.join(os.environ["TMPDIR"], "data.sqfs")
        aws = os.path.join(os.path.dirname(sys.executable), "aws")
        subprocess.run([aws, "s3", "cp", "--quiet", url, source], check=True)
    copied = time.perf_counter() - t0
    archive = archfs.open_archive(source, preload="never")
    res = in_workers(WORKERS, mine, archive.read)
    res.update(node=rank, copy_s=copied, epoch_s=time.perf_counter() - t0 - copied,
               received=held.received if held else 0)
    # One write: mpirun may interleave the pieces of a print with another rank's line.
    os.write(1, ("result " + json.dumps(res) + "\n").encode())


class NodesBench:
    def __init__(self, args, net, url, listfile, size, tmp):
        self.args, self.net, self.url, self.listfile = args, net, url, listfile
        self.size, self.tmp = size, tmp
        self.res = []

    def case(self, n, way):
        """One job of n nodes; its figures."""
        nodes = os.path.join(self.tmp, f"n{n}-{way.replace(' ', '-')}")
        remove(nodes)
        os.makedirs(nodes)
        node = os.path.join(self.tmp, "node.sh")
        with open(node, "w") as f:
            f.write('hostname "node$OMPI_COMM_WORLD_RANK"\n'
                    'export TMPDIR="$NODES/node$OMPI_COMM_WORLD_RANK"\n'
                    'mkdir -p "$TMPDIR"\nexec "$@"\n')
        env = dict(os.environ, NODES=nodes, SLURM_JOB_ID=f"bench-nodes-{n}-{time.time_ns()}")
        cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(n),
               "-x", "NODES", "-x", "SLURM_JOB_ID"]
        cmd += [a for k in env if k.startswith(("AWS_", "FSSPEC_")) for a in ("-x", k)]
        cmd += ["unshare", "--uts", "sh", node, VPY, SCRIPT, "_node", way, self.url,
                self.listfile, str(self.args.seed)]
        before = self.net.counters.snap()
        t0 = time.perf_counter()
        run = subprocess.run(cmd, capture_output=True, text=True, env=env,
                             timeout=self.args.cap * 20)
        wall = time.perf_counter() - t0
        moved = delta(before, self.net.counters.snap())
        with open(os.path.join(self.tmp, f"n{n}-{way.replace(' ', '-')}.log"), "w") as f:
            f.write(run.stdout + run.stderr)
        outs = [json.loads(line.split(" ", 1)[1]) for line in run.stdout.splitlines()
                if line.startswith("result ")]
        if run.returncode != 0 or len(outs) != n:
            raise SystemExit(f"--nodes {n} {way}: the job failed:\n{run.stderr[-2000:]}")
        errors = sum(o["errors"] for o in outs)
        files = sum(o["files"] for o in outs)
        r = {"nodes": n, "way": way, "storage": moved["mb"] * 1e6 / self.size, "gets": moved["gets"],
             "copy_s": max(o["copy_s"] for o in outs), "epoch_s": max(o["epoch_s"] for o in outs),
             "total_s": max(o["copy_s"] + o["epoch_s"] for o in outs), "wall_s": wall,
             "files": files, "errors": errors,
             "first_error": next((o["first_error"] for o in outs if o["first_error"]), None)}
        log(line(r))
        self.res.append(r)

    def run(self):
        for n in self.args.nodes_counts:
            for way in self.args.nodes_ways:
                self.case(n, way)


def line(r):
    copy = {"on demand": "no copy",
            "share": f"each node's share copied in {r['copy_s']:.1f} s"}.get(
        r["way"], f"full copy on every node in {r['copy_s']:.1f} s")
    bad = f", {r['errors']} ERRORS ({r['first_error']})" if r["errors"] else ""
    return (f"{r['nodes']} node{'s' if r['nodes'] > 1 else ''}, {r['way']}: from storage {r['storage']:.2f}x the archive, "
            f"{copy}, first epoch {r['epoch_s']:.2f} s after it, {r['total_s']:.1f} s in all"
            f"{bad}")


def report(b, args, manifest, label):
    out = [f"# archfs: a job of N nodes staging one archive (`scripts/bench "
           f"{' '.join(args.argv)}`)", "",
           f"{len(manifest)} files ({sum(s for _, s in manifest) / 1e6:.0f} MB) in a zstd "
           f"SquashFS image of {b.size / 1e6:.0f} MB in SeaweedFS behind one emulated link "
           f"({label}) for all nodes; nodes are MPI ranks in UTS namespaces of one machine "
           f"({os.cpu_count()} cores); first epoch: each node reads its 1/N of a shuffled "
           f"order in process with {WORKERS} forked workers; {time.strftime('%Y-%m-%d %H:%M')}.",
           ""]
    out += [f"- {line(r)}" for r in b.res]
    for n in args.nodes_counts:
        base = {r["way"]: r for r in b.res if r["nodes"] == n}
        t = base.get("together")
        if t:
            vs = [f"{w} {base[w]['total_s'] / t['total_s']:.2f}x"
                  for w in WAYS if w != "together" and w in base]
            if vs:
                out.append(f"- {n} node{'s' if n > 1 else ''}: copy and first epoch, others' time over "
                           f"together's: {', '.join(vs)}")
    return "\n".join(out) + "\n"


def add_args(ap):
    g = ap.add_argument_group("nodes mode (--nodes; issue 52)")
    g.add_argument("--nodes", action="store_true", help="a job of N simulated nodes staging "
                   "one archive from S3: together over MPI, each alone, copy first, on "
                   "demand, each node its share of the files")
    g.add_argument("--nodes-counts", default="1,2,4", help="node counts N (default 1,2,4)")
    g.add_argument("--nodes-ways", default=",".join(WAYS))
    g.add_argument("--nodes-link", default="10ms/1gbit", help="the emulated link (--remote's)")


def main(args):
    args.nodes_counts = [int(x) for x in args.nodes_counts.split(",") if x.strip()]
    args.nodes_ways = [w.strip() for w in args.nodes_ways.split(",") if w.strip()]
    bad = [w for w in args.nodes_ways if w not in WAYS]
    if bad:
        raise SystemExit(f"--nodes: unknown {bad}")
    if subprocess.run(["sh", "-c", "command -v mpirun"], capture_output=True).returncode:
        raise SystemExit("--nodes needs Open MPI's mpirun: apt-get install openmpi-bin")
    ensure_deps(args)
    install_wheel(args, need=("mpi4py",))
    image, manifest = zstd_image(args)
    tmp = os.path.join(args.workdir, "nodes")
    remove(tmp)
    os.makedirs(tmp)
    listfile = os.path.join(tmp, "files.list")
    write_list(listfile, manifest)
    net, server, uploaded = start_server(tmp, {"zstd": image})
    (label, rtt, rate), = parse_links(args.nodes_link)
    net.shape(rtt, rate)
    b = NodesBench(args, net, f"s3://{BUCKET}/{uploaded['zstd']}", listfile,
                   os.path.getsize(image), tmp)
    b.run()
    md = report(b, args, manifest, label)
    notes = net.notes()
    if notes:
        md += "\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    out = args.out if os.path.basename(args.out) != "result.md" else \
        os.path.join(args.workdir, "nodes.md")
    save(out, md, {"args": vars(args), "results": b.res, "notes": notes})
    log(f"wrote {out}")
