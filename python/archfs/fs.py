"""fsspec's ``archfs`` protocol: an archive as a read-only fsspec filesystem, read in
this process by ``archfs.open_archive``::

    fs = fsspec.filesystem("archfs", fo="imagenet.sqfs")       # or s3://BUCKET/KEY
    fs.ls("train")
    with fsspec.open("archfs://train/x.JPEG::/data/imagenet.sqfs") as f: ...

Registered through the ``fsspec.specs`` entry point when fsspec is installed (the
``archfs[fsspec]`` extra). ``fo`` is an archive path or ``s3://``/``http(s)://`` URL
(archfs reads those itself), or a list of them for a union.
"""

import os

from fsspec.spec import AbstractFileSystem

from .reader import Archive, parse_size

_DIR, _LINK = 0o040000, 0o120000
_REMOTE = {"s3": "s3", "s3a": "s3", "http": "http", "https": "https"}


class ArchiveFileSystem(AbstractFileSystem):
    """An archive, or a union of archives, as a read-only filesystem."""

    protocol = "archfs"
    root_marker = ""
    cachable = True

    def __init__(
        self,
        fo="",
        target_protocol=None,
        target_options=None,
        recursive=False,
        cache_size=None,
        no_sign_request=False,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if isinstance(fo, Archive):
            self.archive = fo
        else:
            paths = fo if isinstance(fo, (list, tuple)) else [fo]
            if not paths or not all(paths):
                raise ValueError("fsspec's archfs needs fo=ARCHIVE: a path or s3:// URL")
            self.archive = Archive(
                [_location(p, target_protocol) for p in paths],
                recursive=recursive,
                cache_size=parse_size(cache_size),
                no_sign_request=no_sign_request,
            )
            self.archive._handle()

    @classmethod
    def _strip_protocol(cls, path):
        path = super()._strip_protocol(path)
        return path.strip("/")

    def ls(self, path, detail=True, **kwargs):
        path = self._strip_protocol(path)
        st = self.archive.stat(path)
        if not _is_dir(st.st_mode):
            entries = [self._entry(path, st, self.archive.lstat(path))]
        else:
            entries = [
                self._entry(e.path, None, e.stat(follow_symlinks=False))
                for e in self.archive.scandir(path)
            ]
        return entries if detail else [e["name"] for e in entries]

    def info(self, path, **kwargs):
        path = self._strip_protocol(path)
        lst = self.archive.lstat(path)
        st = self.archive.stat(path) if lst.st_mode & 0o170000 == _LINK else lst
        return self._entry(path, st, lst)

    def _entry(self, path, st, lst):
        islink = lst.st_mode & 0o170000 == _LINK
        if st is None:
            st = self.archive.stat(path) if islink else lst
        return {
            "name": path,
            "size": st.st_size,
            "type": "directory" if _is_dir(st.st_mode) else "file",
            "mode": st.st_mode,
            "uid": st.st_uid,
            "gid": st.st_gid,
            "mtime": st.st_mtime,
            "ino": st.st_ino,
            "nlink": st.st_nlink,
            "islink": islink,
            **({"destination": self.archive.readlink(path)} if islink else {}),
        }

    def _open(self, path, mode="rb", block_size=None, **kwargs):
        if "r" not in mode or any(c in mode for c in "wa+x"):
            raise NotImplementedError("archfs archives are read-only")
        return self.archive.open(self._strip_protocol(path), "rb")

    def cat_file(self, path, start=None, end=None, **kwargs):
        path = self._strip_protocol(path)
        if start is None and end is None:
            return self.archive.read(path)
        size = self.archive.stat(path).st_size
        start = _position(start, size, 0)
        end = _position(end, size, size)
        return self.archive.read(path, start, max(end - start, 0))

    def cat_ranges(self, paths, starts, ends, max_gap=None, on_error="return", **kwargs):
        if not (len(paths) == len(starts) == len(ends)) and not (
            isinstance(starts, int) or isinstance(ends, int)
        ):
            raise ValueError("paths, starts and ends must be of the same length")
        n = len(paths)
        starts = [starts] * n if isinstance(starts, int) or starts is None else starts
        ends = [ends] * n if isinstance(ends, int) or ends is None else ends
        out = []
        for p, s, e in zip(paths, starts, ends):
            try:
                out.append(self.cat_file(p, s, e))
            except Exception as err:
                if on_error != "return":
                    raise
                out.append(err)
        return out

    def ukey(self, path):
        return str((self.archive.paths, self.info(path)["ino"]))


def _is_dir(mode):
    return mode & 0o170000 == _DIR


def _position(at, size, default):
    if at is None:
        return default
    return max(size + at, 0) if at < 0 else min(at, size)


def _location(fo, protocol):
    """The archive ``fo`` names, as archfs opens it: fsspec's chaining hands over the
    target protocol apart from a path with it stripped."""
    fo = os.fsdecode(fo)
    if protocol in (None, "file", "local") or "://" in fo:
        return fo[len("file://") :] if fo.startswith("file://") else fo
    if protocol in _REMOTE:
        return f"{_REMOTE[protocol]}://{fo}"
    raise ValueError(
        f"archfs reads archives from local paths, s3:// and http(s):// URLs, not "
        f"{protocol}://; copy the archive to one of those"
    )
