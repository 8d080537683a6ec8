"""Each node's fixed share of a dataset, for a job of many nodes whose dataset is larger
than a node (``archfs.torch.NodeSampler`` draws from it).

A node that reads the same files every epoch reads them from storage once, then from its
own memory (a mount's page cache, the node's copy). Plain 1/N slices of an ImageFolder
would give each node a few classes (its samples are sorted by class); here each class's
samples, in the dataset's order (the archive's, for an ImageFolder over a SquashFS image
or a tar made from the directory), are cut into N contiguous runs, run j of class c going
to node (c + j) mod N: every node gets every class with at least N samples, about 1/N of
each, and its files lie in long runs of the archive (one ranged read a run). What it
does to shuffling: each node shuffles its share every epoch, but a sample never leaves
its node, so a rank sees 1/N of the dataset over the whole run, not a fresh 1/N each
epoch (DALI's ``stick_to_shard``, Mosaic's node assignment do the same). With classes
spread evenly the gradient's expectation is unchanged; the batches a rank draws are
less varied across epochs.
"""

from typing import Dict, List, Sequence


def node_shares(targets: Sequence[int], nodes: int) -> List[List[int]]:
    """Sample indices (0..len(targets)) in `nodes` fixed shares, each in dataset order;
    `targets[i]` is sample i's class. Every index is in exactly one share; share sizes
    differ by at most the number of classes."""
    if nodes < 1:
        raise ValueError(f"nodes must be 1 or more, not {nodes}")
    by_class: Dict[int, List[int]] = {}
    for i, c in enumerate(targets):
        by_class.setdefault(c, []).append(i)
    shares: List[List[int]] = [[] for _ in range(nodes)]
    for k, c in enumerate(sorted(by_class)):
        idx = by_class[c]
        n = len(idx)
        for j in range(nodes):
            shares[(k + j) % nodes].extend(idx[j * n // nodes : (j + 1) * n // nodes])
    for s in shares:
        s.sort()
    return shares


def runs(indices: Sequence[int]) -> List[range]:
    """Sorted indices as ranges of consecutive ones: the runs of the archive a share's
    files lie in."""
    out: List[range] = []
    for i in indices:
        if out and out[-1].stop == i:
            out[-1] = range(out[-1].start, i + 1)
        else:
            out.append(range(i, i + 1))
    return out
