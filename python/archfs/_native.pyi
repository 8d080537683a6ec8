"""The contract between the Rust extension (native/src) and the package above it.

``archfs._native`` is not the API users call: python/archfs/reader.py, stage.py and
torch.py build that on it. Paths (``_Name``) are ``str`` (encoded as ``os.fsencode``
does), ``bytes`` as they are, or path-like; names come back as ``os.fsdecode`` gives
them. Errors of a call on a path are the ``OSError`` subclass of their errno; an archive
that cannot be opened is a ``ValueError`` (or the ``OSError`` of a missing file).
"""

import os
from typing import List, Literal, Optional, Sequence, Tuple, Union

_Name = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]
_Status = Literal["copied", "failed", "pending"]

__version__: str

class Archive:
    """An open archive or union of archives, for the process that opened it."""

    def __init__(
        self,
        paths: Sequence[Union[str, "os.PathLike[str]"]],
        recursive: bool = False,
        cache_size: Optional[int] = None,
        no_sign_request: bool = False,
        preload: Literal["auto", "always", "never"] = "auto",
    ) -> None: ...
    def format(self) -> str: ...
    def stat(self, path: _Name, follow: bool) -> os.stat_result: ...
    def listdir(
        self, path: _Name, attrs: bool
    ) -> List[Tuple[str, int, Optional[os.stat_result]]]:
        """(name, ``S_IFMT`` bits, its ``os.stat_result`` when ``attrs``) in archive order."""
    def read(self, path: _Name, offset: int = 0, size: Optional[int] = None) -> bytes: ...
    def read_many(self, paths: Sequence[_Name], threads: int = 1) -> List[bytes]: ...
    def inodes(self, paths: Sequence[_Name]) -> List[int]:
        """Inode numbers of the files (0 for a path missing or not a file)."""
    def landed(self, inos: Sequence[int], wait: float) -> List[int]:
        """Positions of the files read without waiting for the node's copy to bring
        them; when none is, waits up to ``wait`` seconds for bytes to land."""
    def fetch_ahead(self, inos: Sequence[int]) -> int:
        """Fetches those files into the node's copy, in this order; how many it will."""
    def open(self, path: _Name) -> Tuple[int, int]:
        """(inode, size) of a file, for ``pread``."""
    def pread(self, ino: int, offset: int, size: int, path: _Name) -> bytes: ...
    def readlink(self, path: _Name) -> str: ...
    def xattrs(self, path: _Name, follow: bool) -> List[Tuple[str, bytes]]: ...
    def stored(self, paths: Sequence[_Name]) -> List[Tuple[int, int]]:
        """Sorted, merged (start, end) byte ranges of those files and the tables."""
    def files(self, root: _Name, suffixes: Optional[Sequence[str]] = None) -> List[str]: ...

class NodeCopy:
    """The node's copy of an object (or of a file), shared by the job's processes."""

    def __init__(
        self,
        url: Union[str, "os.PathLike[str]"],
        make: bool,
        wait: float = 60.0,
        no_sign_request: bool = False,
        stage_dir: Optional[Union[str, "os.PathLike[str]"]] = None,
        keep: Optional[int] = None,
        ranges: Optional[Sequence[Tuple[int, int]]] = None,
    ) -> None: ...
    @property
    def size(self) -> int: ...
    @property
    def pieces(self) -> int: ...
    @property
    def piece_size(self) -> int: ...
    @property
    def left(self) -> int: ...
    def fileno(self) -> int: ...
    def share(self, lo: int, hi: int) -> int: ...
    def receive(self, p: int) -> bool: ...
    def landed(self, p: int) -> None: ...
    def release(self, pieces: Sequence[int]) -> int: ...
    def fetch_free(self) -> None: ...
    def wait(self, p: int, timeout: float = 0.0) -> _Status: ...
    def wait_whole(self, timeout: float = 0.0) -> _Status: ...

class Topology:
    """The job's shape as its launcher says it."""

    nodes: int
    node: Optional[int]
    ranks_here: Optional[int]
    rank_here: Optional[int]
    variables: str

def topology() -> Optional[Topology]:
    """The job's shape, ``None`` outside a job."""

def parse_size(size: str) -> int:
    """``512M``-style sizes (K, M, G, T: powers of 1024), as the command line reads them;
    ``ValueError`` saying what is wrong."""

def fetched() -> Tuple[int, int]:
    """(requests, bytes) this process took from shared storage so far."""
