"""Mount SquashFS images and tar archives read-only with FUSE, from Python.

    import archfs
    with archfs.mount("imagenet.sqfs") as root:      # a pathlib.Path, live on entry
        ds = torchvision.datasets.ImageFolder(root / "train")

This package drives the ``archfs`` binary installed with it; it has no FUSE code of its
own. See docs/PYTHON.md for every parameter.
"""

from ._mount import Mount, MountError, mount

__all__ = ["Mount", "MountError", "mount"]
