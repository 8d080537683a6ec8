"""torchvision's ``ImageFolder`` and ``DatasetFolder`` over an archive read in this
process: the same ``classes``, ``class_to_idx`` and ``samples`` as torchvision's on a
mount of the archive (sample paths relative to the archive root), with no mount::

    from archfs.torch import ImageFolder
    ds = ImageFolder("imagenet.sqfs", root="train", transform=T.ToTensor())
    loader = torch.utils.data.DataLoader(ds, batch_size=256, num_workers=8, shuffle=True)

DataLoader workers under ``fork``, ``forkserver`` and ``spawn`` each read with an
archive of their own: the dataset pickles with its archive's arguments, and a worker
opens the archive at its first sample (a forked one too). Needs torchvision and Pillow
(the ``archfs[torch]`` extra).
"""

import copy
import gc
import io
import os
import random
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch.utils.data

from torchvision.datasets import DatasetFolder as _DatasetFolder
from torchvision.datasets import ImageFolder as _ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS

from .partition import node_shares
from .reader import Archive

__all__ = ["DatasetFolder", "FetchAhead", "ImageFolder", "NodeSampler", "pil_loader"]


def pil_loader(f) -> Any:
    """The default loader: a binary file object to an RGB ``PIL.Image``."""
    from PIL import Image

    img = Image.open(f)
    return img.convert("RGB")


class DatasetFolder(_DatasetFolder):
    """``torchvision.datasets.DatasetFolder`` on directory ``root`` of an archive.

    ``archive`` is an ``archfs.Archive`` or what ``archfs.open_archive`` takes (a path,
    URL or list of them; ``recursive`` and ``cache_size`` as there). ``loader`` is
    called with a binary file object of the sample's bytes (torchvision's with a path);
    ``is_valid_file`` with the sample's path in the archive."""

    def __init__(
        self,
        archive: Union[Archive, Any],
        root: str = "",
        loader: Optional[Callable[[io.BufferedIOBase], Any]] = None,
        extensions: Optional[Union[str, Tuple[str, ...]]] = None,
        transform: Optional[Callable] = None,
        target_transform: Optional[Callable] = None,
        is_valid_file: Optional[Callable[[str], bool]] = None,
        allow_empty: bool = False,
        *,
        recursive: bool = False,
        cache_size: Union[int, str, None] = None,
    ) -> None:
        if not isinstance(archive, Archive):
            archive = Archive(archive, recursive=recursive, cache_size=cache_size)
        self.archive = archive
        _DatasetFolder.__init__(
            self,
            root,
            loader=loader or pil_loader,
            extensions=extensions,
            transform=transform,
            target_transform=target_transform,
            is_valid_file=is_valid_file,
            allow_empty=allow_empty,
        )

    def find_classes(self, directory: str) -> Tuple[List[str], Dict[str, int]]:
        classes = sorted(e.name for e in self.archive.scandir(directory) if e.is_dir())
        if not classes:
            raise FileNotFoundError(f"Couldn't find any class folder in {directory}.")
        return classes, {name: i for i, name in enumerate(classes)}

    def make_dataset(
        self,
        directory: str,
        class_to_idx: Optional[Dict[str, int]] = None,
        extensions: Optional[Union[str, Tuple[str, ...]]] = None,
        is_valid_file: Optional[Callable[[str], bool]] = None,
        allow_empty: bool = False,
    ) -> List[Tuple[str, int]]:
        """torchvision's ``make_dataset``, with the walk and the extension check done by
        the archive (``Archive.files``) rather than by ``os.walk`` in Python."""
        if class_to_idx is None:
            _, class_to_idx = self.find_classes(directory)
        elif not class_to_idx:
            raise ValueError("'class_to_index' must have at least one entry to collect any samples.")
        if (extensions is None) == (is_valid_file is None):
            raise ValueError(
                "Both extensions and is_valid_file cannot be None or not None at the same time"
            )
        # 1.28 M (path, class) tuples set off full collections of every object torch made
        # (~0.1 s each); none of them is in a cycle.
        collecting = gc.isenabled()
        gc.disable()
        try:
            return self._samples(directory, class_to_idx, extensions, is_valid_file, allow_empty)
        finally:
            if collecting:
                gc.enable()

    def _samples(self, directory, class_to_idx, extensions, is_valid_file, allow_empty):
        suffixes = None
        if extensions is not None:
            suffixes = [extensions] if isinstance(extensions, str) else list(extensions)
        instances = []
        available = set()
        for target_class in sorted(class_to_idx):
            index = class_to_idx[target_class]
            target_dir = f"{directory.rstrip('/')}/{target_class}" if directory else target_class
            if not self.archive.isdir(target_dir):
                continue
            paths = self.archive.files(target_dir, suffixes)
            if is_valid_file is not None:
                paths = [p for p in paths if is_valid_file(p)]
            if paths:
                available.add(target_class)
            instances.extend((p, index) for p in paths)
        empty = set(class_to_idx) - available
        if empty and not allow_empty:
            msg = f"Found no valid file for the classes {', '.join(sorted(empty))}. "
            if extensions is not None:
                shown = extensions if isinstance(extensions, str) else ", ".join(extensions)
                msg += f"Supported extensions are: {shown}"
            raise FileNotFoundError(msg)
        return instances

    def __getitem__(self, index: int) -> Tuple[Any, Any]:
        path, target = self.samples[index]
        return self._sample(self.archive.read(path), target)

    def __getitems__(self, indices: List[int]) -> List[Tuple[Any, Any]]:
        """A batch, as the DataLoader asks for it: each file decoded as it lands in the
        node's copy that FetchAhead's order fills (``Archive.read_as_landed``), so the
        workers decode while the copy comes, where they waited for its last block (a
        batch of a full shuffle has files in nearly every block), and fetch no file of
        their own beside it. The files at hand are read in one call (one release of the
        GIL). A subclass with a ``__getitem__`` of its own is asked one sample at a
        time, as it expects."""
        if type(self).__getitem__ is not DatasetFolder.__getitem__:
            return [self[i] for i in indices]
        picked = [self.samples[i] for i in indices]
        out: List[Any] = [None] * len(picked)
        for k, data in self.archive.read_as_landed([p for p, _ in picked]):
            out[k] = self._sample(data, picked[k][1])
        return out

    def _sample(self, data: bytes, target: Any) -> Tuple[Any, Any]:
        sample = self.loader(io.BytesIO(data))
        if self.transform is not None:
            sample = self.transform(sample)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return sample, target


class ImageFolder(DatasetFolder, _ImageFolder):
    """``torchvision.datasets.ImageFolder`` on directory ``root`` of an archive: the
    images of ``root/CLASS/**`` with torchvision's extensions, loaded by Pillow as RGB.
    An instance of torchvision's ImageFolder too."""

    def __init__(
        self,
        archive: Union[Archive, Any],
        root: str = "",
        transform: Optional[Callable] = None,
        target_transform: Optional[Callable] = None,
        loader: Optional[Callable[[io.BufferedIOBase], Any]] = None,
        is_valid_file: Optional[Callable[[str], bool]] = None,
        allow_empty: bool = False,
        *,
        recursive: bool = False,
        cache_size: Union[int, str, None] = None,
    ) -> None:
        DatasetFolder.__init__(
            self,
            archive,
            root,
            loader=loader,
            extensions=IMG_EXTENSIONS if is_valid_file is None else None,
            transform=transform,
            target_transform=target_transform,
            is_valid_file=is_valid_file,
            allow_empty=allow_empty,
            recursive=recursive,
            cache_size=cache_size,
        )
        self.imgs = self.samples


# An order this long (ImageNet's two epochs: 2.56 M) takes a second or two to hand over:
# its first files (16 batches of 256) go first.
_LONG, _HEAD = 200_000, 4096
# Seconds an epoch's first batch waits for the first order to be handed over (placing a
# copy of 140 GB in memory takes ~20 s; the workers would wait for its bytes anyway).
_MADE_WAIT = 120.0


class FetchAhead(torch.utils.data.Sampler):
    """A sampler that hands each epoch's order to the archive before the DataLoader asks
    for it, so the files of an archive in object storage are fetched ahead of the
    workers, many at once, into the node's copy, where every worker and rank of the node
    reads them (``Archive.fetch_ahead``). In place of ``shuffle=True``, or around the
    sampler the job uses::

        loader = DataLoader(ds, batch_size=256, num_workers=8, sampler=FetchAhead(ds))
        loader = DataLoader(ds, ..., sampler=FetchAhead(ds, DistributedSampler(ds)))
        for epoch in range(epochs):
            loader.sampler.set_epoch(epoch)

    ``dataset`` is an ``archfs.torch`` one. Without ``sampler`` it draws a full shuffle
    of the dataset from ``seed`` and the epoch (``shuffle=False``: in order). A sampler
    with ``set_epoch`` (``DistributedSampler``, ``NodeSampler``) draws the same order for
    the same epoch, so the next epoch's files are fetched once this one's are, and the
    link does not idle between epochs; another sampler's order is fetched as it starts.
    The order is what the sampler yields, unchanged. Such an order is handed over as
    soon as it is known (when made, on ``set_epoch``), so fetching starts while the
    DataLoader starts its workers; its first index waits for the first order to be
    handed over, which makes the node's copy the workers then find. Without
    ``set_epoch`` its own shuffle draws a new order each epoch, as ``shuffle=True``
    does."""

    def __init__(
        self,
        dataset: Any,
        sampler: Optional[torch.utils.data.Sampler] = None,
        *,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        archive = getattr(dataset, "archive", None)
        if not isinstance(archive, Archive) or not hasattr(dataset, "samples"):
            raise ValueError(
                "FetchAhead takes an archfs.torch dataset (ImageFolder, DatasetFolder): it "
                "fetches the files of the dataset's archive"
            )
        self.dataset, self.sampler = dataset, sampler
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        self._inodes: Optional[List[int]] = None
        self._handed, self._seq, self._lock = 0, 0, threading.Lock()
        # The epoch's order, handed over before the DataLoader asked; whether an epoch
        # was iterated since set_epoch (the next one then shuffles anew).
        self._ready: Optional[Tuple[int, List[int]]] = None
        self._iterated = False
        # Set once the first order was handed over: the node's copy is made then.
        self._made = threading.Event()
        self._early()

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self._iterated = epoch, False
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)
        self._early()

    def _early(self) -> None:
        """Hands this epoch's order over now, where the epoch alone draws it."""
        if self.sampler is not None and not hasattr(self.sampler, "set_epoch"):
            return
        order = self._order(self.epoch, self.sampler)
        if self._ready == (self.epoch, order):
            return  # handed over when made, and set_epoch asks for the same epoch
        self._ready = (self.epoch, order)
        self._start(order + self._next())

    def _start(self, both: List[int]) -> None:
        # Off the caller's thread: finding 1.28 M files' inodes takes a second once.
        self._seq += 1
        threading.Thread(target=self._hand, args=(both, self._seq), name="archfs-fetch-ahead",
                         daemon=True).start()

    def _order(self, epoch: int, sampler: Any) -> List[int]:
        if sampler is not None:
            return list(iter(sampler))
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator()
        g.manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(n, generator=g).tolist()

    def _next(self) -> List[int]:
        """The next epoch's order, where the sampler draws it from the epoch alone."""
        if self.sampler is None:
            return self._order(self.epoch + 1, None)
        if not hasattr(self.sampler, "set_epoch"):
            return []
        ahead = copy.copy(self.sampler)
        ahead.set_epoch(self.epoch + 1)
        return self._order(self.epoch + 1, ahead)

    def _hand(self, order: List[int], seq: int) -> None:
        try:
            self._hand_over(order, seq)
        finally:
            self._made.set()

    def _hand_over(self, order: List[int], seq: int) -> None:
        native = self.dataset.archive._handle()
        with self._lock:
            if seq < self._handed:
                return  # a later epoch's order was handed already
            self._handed = seq
            if len(order) > _LONG:
                # Meanwhile a worker that waited for its batch a second in vain would
                # read the files one at a time.
                samples = self.dataset.samples
                native.fetch_ahead(native.inodes([samples[i][0] for i in order[:_HEAD]]))
                self._made.set()
            if self._inodes is None:
                self._inodes = native.inodes([p for p, _ in self.dataset.samples])
            inodes = self._inodes
            native.fetch_ahead([inodes[i] for i in order])

    def __iter__(self) -> Iterator[int]:
        if self._iterated and self.sampler is None:
            self.epoch += 1  # no set_epoch since the last epoch: the next order
        self._iterated = True
        ready, self._ready = self._ready, None
        if ready is not None and ready[0] == self.epoch:
            order = ready[1]
        else:
            order = self._order(self.epoch, self.sampler)
            self._start(order + self._next())
        # The DataLoader's workers, started by now, open the archive at their first
        # batch, which it sends once this returns: they find the node's copy made, where
        # each opening before it fetched the archive's tables for itself (a SquashFS
        # image of 1.28 M files: 20 MB a worker).
        self._made.wait(_MADE_WAIT)
        return iter(order)

    def __len__(self) -> int:
        return len(self.sampler) if self.sampler is not None else len(self.dataset)


class NodeSampler(torch.utils.data.Sampler):
    """For a dataset larger than a node: keeps each node of the job on a fixed share of
    the samples, every class in every share, shuffled within the node every epoch and
    split among the node's ranks (``archfs.partition`` says how, and what it does to
    shuffling). In place of ``DistributedSampler``, with ``set_epoch`` as there::

        sampler = NodeSampler(dataset)            # the job's shape from the launcher
        loader = DataLoader(dataset, batch_size=256, sampler=sampler, num_workers=8)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)

    ``dataset`` has ``targets`` (an ImageFolder's, torchvision's or archfs's). Every rank
    of the job draws the same number of samples an epoch (a share's own, wrapped
    around, pad the shorter ones), as DDP needs. The shape, when not given, is the
    launcher's: torchrun's, srun's, mpirun's (with torch.distributed's rank when the
    launcher does not say the node's index)."""

    def __init__(
        self,
        dataset: Any,
        *,
        nodes: Optional[int] = None,
        node: Optional[int] = None,
        ranks_here: Optional[int] = None,
        rank_here: Optional[int] = None,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        from . import _native

        shape = _native.topology()
        if nodes is None:
            nodes = shape.nodes if shape else 1
        if ranks_here is None:
            ranks_here = (shape and shape.ranks_here) or 1
        if rank_here is None:
            rank_here = (shape and shape.rank_here) or 0
        if node is None:
            known = shape.node if shape else 0
            node = known if known is not None else _global_rank() // ranks_here
        if not 0 <= node < nodes or not 0 <= rank_here < ranks_here:
            raise ValueError(
                f"node {node} of {nodes}, rank {rank_here} of {ranks_here} on it: "
                "pass nodes=, node=, ranks_here= and rank_here= as the job has them"
            )
        shares = node_shares(list(dataset.targets), nodes)
        self.dataset = dataset
        self.share = shares[node]
        self.nodes, self.node = nodes, node
        self.ranks_here, self.rank_here = ranks_here, rank_here
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        longest = max(len(s) for s in shares)
        self.num_samples = -(-longest // ranks_here)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def stage(self, **kwargs: Any) -> Any:
        """Copies this node's share of the files, their bytes as stored and no others,
        from storage into the node's memory before the first epoch, so every epoch reads
        them there and each byte of the dataset leaves storage once for the job
        (``archfs.stage.stage_files``, which takes ``kwargs``). Every rank calls it; the
        dataset is an ``archfs.torch`` one over one archive in object storage."""
        from .stage import stage_files

        archive = getattr(self.dataset, "archive", None)
        if archive is None or len(archive.paths) != 1:
            raise ValueError(
                "NodeSampler.stage copies from one archive in object storage: give it an "
                "archfs.torch dataset over one s3:// or https:// URL"
            )
        kwargs.setdefault("no_sign_request", archive._args[3])
        paths = [self.dataset.samples[i][0] for i in self.share]
        return stage_files(archive.paths[0], paths, **kwargs)

    def __iter__(self) -> Iterator[int]:
        order = list(self.share)
        if self.shuffle:
            # The same order on every rank of the node; another on each node and epoch.
            random.Random(f"{self.seed}/{self.epoch}/{self.node}").shuffle(order)
        want = self.num_samples * self.ranks_here
        if order:
            order = (order * (-(-want // len(order))))[:want]
        return iter(order[self.rank_here :: self.ranks_here])

    def __len__(self) -> int:
        return self.num_samples


def _global_rank() -> int:
    """This process's rank in the job: torch.distributed's, else the launcher's."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    for k in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if os.environ.get(k, "").isdigit():
            return int(os.environ[k])
    return 0
