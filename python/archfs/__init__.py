"""Read SquashFS images and tar archives as filesystems, from Python.

Mounted with FUSE, for unmodified code that reads paths::

    import archfs
    with archfs.mount("imagenet.sqfs") as root:      # a pathlib.Path, live on entry
        ds = torchvision.datasets.ImageFolder(root / "train")

or read in this process, where there is no ``/dev/fuse`` or a mount's per-file cost
shows (``archfs.torch.ImageFolder``, and ``fsspec`` URLs ``archfs://PATH::ARCHIVE``)::

    with archfs.open_archive("imagenet.sqfs") as a:
        data = a.read("train/n01440764/n01440764_10026.JPEG")

``mount`` drives the ``archfs`` binary installed with this package; ``open_archive`` is
the same reader compiled in (``archfs._native``). See docs/PYTHON.md.
"""

from ._mount import Mount, MountError, mount
from .reader import Archive, DirEntry, File, open_archive

__all__ = ["Archive", "DirEntry", "File", "Mount", "MountError", "mount", "open_archive"]
