"""``archfs.open_archive``: an archive read inside this process, without a mount.

For nodes without ``/dev/fuse`` (pods, containers, login nodes), and for datasets whose
files are small enough that a mount's open and close per file cost more than the read:
here a file is one call and, where its bytes lie verbatim in the archive, one ``pread``.
Every format and option a mount takes works here (SquashFS, tar and compressed tars with
their saved indexes, unions of shards, ``recursive``, ``s3://`` and ``https://``).

Paths are relative to the archive root (a leading ``/`` is the root too) and follow
symbolic links inside the archive; a link that leaves the archive is not found.

An ``Archive`` belongs to the process that opened it; in a child made by ``fork`` it
opens the archive again on first use, and it pickles as its arguments, so DataLoader
workers under ``fork``, ``forkserver`` and ``spawn`` each read with their own.
"""

import io
import os
import stat as _stat
from typing import Iterator, List, Optional, Sequence, Tuple, Union

from . import _native

PathLike = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]


def open_archive(
    path_or_paths: Union[PathLike, Sequence[PathLike]],
    *,
    recursive: bool = False,
    cache_size: Union[int, str, None] = None,
    no_sign_request: bool = False,
    preload: Union[bool, str] = "auto",
) -> "Archive":
    """Opens an archive, or the union of several (a directory stands for the archives
    in it, in name order; the last wins for a name in more than one), and returns an
    ``Archive``. Raises ``ValueError`` for what is not an archive archfs reads, and the
    ``OSError`` of its errno for a missing or unreadable file.

    ``preload`` streams local archives into the page cache in the background, as a
    mount does: ``"auto"`` once 128 files have been read (an epoch, not a look at a few
    files), ``"always"`` (or ``True``) at once, ``"never"`` (or ``False``); only when the
    archives fit in three quarters of the memory free for the page cache."""
    archive = Archive(
        path_or_paths,
        recursive=recursive,
        cache_size=cache_size,
        no_sign_request=no_sign_request,
        preload=preload,
    )
    archive._handle()
    return archive


class Archive:
    """An open archive. Its methods release the GIL while they work, so threads read in
    parallel. Use ``open_archive`` to open one; the constructor opens on first use."""

    def __init__(
        self,
        path_or_paths: Union[PathLike, Sequence[PathLike]],
        *,
        recursive: bool = False,
        cache_size: Union[int, str, None] = None,
        no_sign_request: bool = False,
        preload: Union[bool, str] = "auto",
    ) -> None:
        if isinstance(path_or_paths, (str, bytes, os.PathLike)):
            path_or_paths = [path_or_paths]
        paths = [os.fsdecode(p) for p in path_or_paths]
        when = {True: "always", False: "never"}.get(preload, preload)  # type: ignore[call-overload]
        if when not in ("auto", "always", "never"):
            raise ValueError(f"preload {preload!r} is not 'auto', 'always' or 'never'")
        self._args = (
            paths, bool(recursive), parse_size(cache_size), bool(no_sign_request), when
        )
        self._native = None
        self._forks = None

    def _handle(self) -> "_native.Archive":
        native = self._native
        if native is None or self._forks != _FORKS[0]:
            # The parent's threads are not in a forked child: open again here. The
            # parent's handle is left to it (dropping it here would wait on them).
            native = _native.Archive(*self._args)
            self._native, self._forks = native, _FORKS[0]
        return native

    def __reduce__(self):
        return (_unpickle, self._args)

    def __repr__(self) -> str:
        return f"<archfs.Archive {' '.join(self._args[0])!r}>"

    def __enter__(self) -> "Archive":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Lets go of the archive now (it is opened again if used later)."""
        self._native = None

    @property
    def paths(self) -> List[str]:
        return list(self._args[0])

    @property
    def format(self) -> str:
        """The format, as ``archfs info`` names it."""
        return self._handle().format()

    # Metadata

    def stat(self, path: PathLike = "", *, follow_symlinks: bool = True) -> os.stat_result:
        """``os.stat`` of a path in the archive (``os.lstat`` without following)."""
        return self._handle().stat(path, follow_symlinks)

    def lstat(self, path: PathLike = "") -> os.stat_result:
        return self.stat(path, follow_symlinks=False)

    def exists(self, path: PathLike) -> bool:
        try:
            self._handle().stat(path, True)
        except OSError:
            return False
        return True

    def isdir(self, path: PathLike) -> bool:
        try:
            return _stat.S_ISDIR(self._handle().stat(path, True).st_mode)
        except OSError:
            return False

    def isfile(self, path: PathLike) -> bool:
        try:
            return _stat.S_ISREG(self._handle().stat(path, True).st_mode)
        except OSError:
            return False

    def listdir(self, path: PathLike = "") -> list:
        """Names in a directory, in archive order (``bytes`` for a ``bytes`` path)."""
        names = [n for n, _, _ in self._handle().listdir(path, False)]
        return [os.fsencode(n) for n in names] if isinstance(path, bytes) else names

    def scandir(self, path: PathLike = "") -> Iterator["DirEntry"]:
        """Entries of a directory with their stat fields, as ``os.scandir`` gives them."""
        parent = os.fsdecode(path).strip("/")
        for name, kind, st in self._handle().listdir(path, True):
            yield DirEntry(self, parent, name, kind, st)

    def walk(self, top: PathLike = "") -> Iterator[tuple]:
        """``os.walk(top, followlinks=True)`` over the archive, top down."""
        todo = [os.fsdecode(top).strip("/")]
        while todo:
            root = todo.pop()
            dirs, files = [], []
            for e in self.scandir(root):
                (dirs if e.is_dir() else files).append(e.name)
            yield root, dirs, files
            todo.extend(_join(root, d) for d in reversed(dirs))

    def files(self, root: PathLike = "", suffixes: Optional[Sequence[str]] = None) -> List[str]:
        """Every file under ``root`` as ``root/.../name``, directories in order of their
        paths and names sorted in each (ImageFolder's order), links to directories
        followed; only names whose lowercase ends with one of ``suffixes`` if given
        (``str.lower().endswith``, as torchvision checks extensions)."""
        wanted = None if suffixes is None else list(suffixes)
        return self._handle().files(root, wanted)

    def readlink(self, path: PathLike) -> str:
        return self._handle().readlink(path)

    def listxattr(self, path: PathLike, *, follow_symlinks: bool = True) -> List[str]:
        return [k for k, _ in self._handle().xattrs(path, follow_symlinks)]

    def getxattr(self, path: PathLike, attribute: str, *, follow_symlinks: bool = True) -> bytes:
        for k, v in self._handle().xattrs(path, follow_symlinks):
            if k == attribute:
                return v
        import errno

        raise OSError(errno.ENODATA, "no such extended attribute", os.fsdecode(path))

    # Data

    def read(self, path: PathLike, offset: int = 0, size: Optional[int] = None) -> bytes:
        """A file's bytes: all of it, or ``size`` bytes from ``offset``."""
        native = self._native
        if native is None or self._forks != _FORKS[0]:
            native = self._handle()
        return native.read(path, offset, size)

    def read_many(self, paths: Sequence[PathLike], threads: int = 1) -> List[bytes]:
        """Several files whole, in one call (one release of the GIL), ``threads`` of
        them read at once: from object storage, bytes not yet on the node are then
        fetched that many at a time."""
        return self._handle().read_many(list(paths), threads)

    def read_as_landed(
        self, paths: Sequence[PathLike], wait: float = 1.0
    ) -> Iterator[Tuple[int, bytes]]:
        """Each of the files ``paths`` whole, as ``(position in paths, bytes)``: first
        those a read finds where it reads them, then the others as the node's copy being
        filled in order (``fetch_ahead``) brings them, so the caller works on each while
        the rest come. Once nothing landed for ``wait`` seconds, the process that gave
        the order ended, or where the order will not have the whole copy soon, the files
        not there are read one by one as ``read`` reads them (fetched if they must be).
        For a local archive: in order."""
        paths = list(paths)
        native = self._handle()
        inos = native.inodes(paths)
        left = list(range(len(paths)))
        while left:
            ready = native.landed([inos[k] for k in left], wait)
            if not ready:
                wait = 0.0  # waited once in vain: the rest as they are read
            take = [left[j] for j in ready] or left[:1]
            yield from zip(take, native.read_many([paths[k] for k in take], 1))
            if len(take) == len(left):
                return
            taken = set(take)
            left = [k for k in left if k not in taken]

    def fetch_ahead(self, paths: Sequence[PathLike]) -> int:
        """Fetches the files ``paths``, in this order, from object storage into the
        node's copy of the archive, in the background, many requests at once, ahead of
        the reads that will want them; every process of the job on the node then reads
        them there. Replaces the order this process gave before. Returns how many files
        it will fetch: none for a local archive or a compressed tar, which are read as
        they are. ``archfs.torch.FetchAhead`` calls it with a DataLoader's order."""
        native = self._handle()
        return native.fetch_ahead(native.inodes(list(paths)))

    def open(self, path: PathLike, mode: str = "rb", buffering: int = -1):
        """A file in the archive as a binary file object (``read``, ``readinto``,
        ``seek``, ``tell``; buffered unless ``buffering=0``), as PIL and friends take.
        Text mode: ``"r"`` wraps it in ``io.TextIOWrapper``."""
        if mode not in ("rb", "r", "br", "rt"):
            raise ValueError(f"archives are read-only: mode {mode!r} is not 'rb' or 'r'")
        native = self._handle()
        ino, size = native.open(path)
        raw = File(native, ino, size, os.fsdecode(path))
        if "b" in mode and buffering == 0:
            return raw
        size = buffering if buffering and buffering > 0 else io.DEFAULT_BUFFER_SIZE * 16
        buffered = io.BufferedReader(raw, buffer_size=size)
        return buffered if "b" in mode else io.TextIOWrapper(buffered)


class File(io.RawIOBase):
    """One file of an archive, read by position."""

    def __init__(self, native: "_native.Archive", ino: int, size: int, name: str) -> None:
        super().__init__()
        self._native, self._ino, self._size, self.name = native, ino, size, name
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        view = memoryview(b).cast("B")
        data = self._native.pread(self._ino, self._pos, len(view), self.name)
        n = len(data)
        view[:n] = data
        self._pos += n
        return n

    def readall(self) -> bytes:
        data = self._native.pread(
            self._ino, self._pos, max(self._size - self._pos, 0), self.name
        )
        self._pos += len(data)
        return data

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            pos = offset
        elif whence == io.SEEK_CUR:
            pos = self._pos + offset
        elif whence == io.SEEK_END:
            pos = self._size + offset
        else:
            raise ValueError(f"invalid whence ({whence})")
        if pos < 0:
            raise OSError(22, "Invalid argument: a negative position", self.name)
        self._pos = pos
        return pos

    def tell(self) -> int:
        return self._pos

    def __repr__(self) -> str:
        return f"<archfs.File {self.name!r}>"


class DirEntry:
    """One entry of ``Archive.scandir``, as ``os.DirEntry``."""

    __slots__ = ("_archive", "name", "path", "_kind", "_lstat", "_stat")

    def __init__(
        self, archive: Archive, parent: str, name: str, kind: int, st: os.stat_result
    ) -> None:
        self._archive, self.name, self.path = archive, name, _join(parent, name)
        self._kind, self._lstat, self._stat = kind, st, None

    def inode(self) -> int:
        return self._lstat.st_ino

    def is_symlink(self) -> bool:
        return self._kind == _stat.S_IFLNK

    def _followed(self) -> Optional[os.stat_result]:
        if self._kind != _stat.S_IFLNK:
            return self._lstat
        if self._stat is None:
            try:
                self._stat = self._archive._handle().stat(self.path, True)
            except OSError:
                return None
        return self._stat

    def is_dir(self, *, follow_symlinks: bool = True) -> bool:
        st = self._followed() if follow_symlinks else self._lstat
        return st is not None and _stat.S_ISDIR(st.st_mode)

    def is_file(self, *, follow_symlinks: bool = True) -> bool:
        st = self._followed() if follow_symlinks else self._lstat
        return st is not None and _stat.S_ISREG(st.st_mode)

    def stat(self, *, follow_symlinks: bool = True) -> os.stat_result:
        if follow_symlinks and self._kind == _stat.S_IFLNK:
            return self._archive.stat(self.path)
        return self._lstat

    def __fspath__(self) -> str:
        return self.path

    def __repr__(self) -> str:
        return f"<archfs.DirEntry {self.name!r}>"


def parse_size(size: Union[int, str, None], what: str = "cache_size") -> Optional[int]:
    """``512M``-style sizes (K, M, G, T: powers of 1024), read as the command line reads
    them (one parser, in the extension). ``what`` names the argument in the error."""
    if size is None or isinstance(size, int):
        return size
    try:
        return _native.parse_size(str(size))
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None


def _unpickle(paths, recursive, cache_size, no_sign_request, preload="auto") -> Archive:
    return Archive(
        paths,
        recursive=recursive,
        cache_size=cache_size,
        no_sign_request=no_sign_request,
        preload=preload,
    )


# Forks of this process since it imported archfs: an Archive opened in fewer is its
# parent's. Counted by a hook rather than compared by os.getpid(), a system call a read.
_FORKS = [0]


def _forked() -> None:
    _FORKS[0] += 1


os.register_at_fork(after_in_child=_forked)


def _join(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name
