"""The in-process reader (archfs.open_archive, fsspec's archfs://, archfs.torch), from the
wheel, on archives the real tools make from a generated tree with awkward cases, compared
with that tree. scripts/pytest runs this file as root, as an ordinary user, and as an
ordinary user in a mount namespace whose /dev has no fuse (NO_FUSE below)."""

import errno
import io
import os
import pickle
import random
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

import pytest

import archfs

ROOT = os.geteuid() == 0
# Where /dev/fuse is missing (scripts/pytest's third run), what would be compared with a
# mount is compared with the source tree, which the mount equals (test_archfs.py).
NO_FUSE = not os.path.exists("/dev/fuse")
NON_UTF8 = os.fsdecode(b"bad-\xff\xfe-name.bin")
LONG = "L" * 200


def xattrs_work(path):
    try:
        os.setxattr(path, "user.archfs", b"probe")
        os.removexattr(path, "user.archfs")
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """Every kind of entry a dataset archive may hold, with set modes, owners, times and
    (where the filesystem takes them) extended attributes."""
    src = tmp_path_factory.mktemp("reader") / "src"
    rnd = random.Random(7)
    for d in ["train/cat", "train/dog/deep/er", "empty-dir", "modes"]:
        (src / d).mkdir(parents=True)
    for i in range(30):
        (src / f"train/cat/{i}.jpg").write_bytes(rnd.randbytes(rnd.randrange(0, 40_000)))
        (src / f"train/dog/{i:03}.JPEG").write_bytes(bytes([i]) * (1000 + 37 * i))
    (src / "train/dog/deep/er/far.txt").write_text("far down\n")
    (src / "big.bin").write_bytes(rnd.randbytes(3 * (1 << 20) + 17))
    (src / "empty").write_bytes(b"")
    (src / "sp ace & ünïcode ✓.txt").write_text("names\n")
    (src / NON_UTF8).write_bytes(b"not utf-8\n")
    (src / LONG).write_bytes(b"long name\n")
    os.link(src / "train/cat/0.jpg", src / "hard-link.jpg")
    os.symlink("train/cat/1.jpg", src / "link-to-file")
    os.symlink("../big.bin", src / "train/link-up")
    os.symlink("train/dog", src / "link-dir")
    os.symlink("nowhere", src / "broken")
    os.symlink("/etc/hostname", src / "abs-link")
    os.symlink("loop-b", src / "loop-a")
    os.symlink("loop-a", src / "loop-b")
    for name, mode in [("exec.sh", 0o755), ("private", 0o600), ("setuid", 0o4755),
                       ("sticky-dir", 0o1777)]:
        p = src / "modes" / name
        p.mkdir() if name.endswith("dir") else p.write_bytes(name.encode())
        os.chmod(p, mode)
    os.mkfifo(src / "pipe")
    if ROOT:
        os.chown(src / "modes/private", 1234, 5678)
    if xattrs_work(src / "big.bin"):
        os.setxattr(src / "big.bin", "user.archfs.note", b"x" * 100)
        os.setxattr(src / "train/cat", "user.archfs.dir", b"\x00\x01binary")
    # Times last, leaves first: each entry a time of its own, nanoseconds too.
    for i, p in enumerate(sorted(src.rglob("*"), key=lambda p: -len(p.parts))):
        os.utime(p, ns=(1_600_000_000_123_456_789 + i * 1_000_000_007,) * 2,
                 follow_symlinks=False)
    return src


def build(kind, src, out):
    """The archive `kind` of `src`, made by the tool users make it with."""
    srcs, outs = str(src), str(out)
    if kind.startswith("sqfs-mksquashfs"):
        comp = kind.rsplit("-", 1)[1]
        subprocess.run(["mksquashfs", srcs, outs, "-noappend", "-quiet", "-no-progress",
                        "-comp", comp, "-b", "64K"], check=True)
    elif kind == "sqfs-gensquashfs":
        subprocess.run(["gensquashfs", "-q", "-D", srcs, "-k", "-x", "-b", "65536", outs],
                       check=True)
    elif kind == "tar-python":
        with tarfile.open(outs, "w", format=tarfile.PAX_FORMAT) as t:
            for p in sorted(src.iterdir()):
                t.add(p, arcname=p.name)
    elif kind == "tar-bsdtar":
        subprocess.run(["bsdtar", "-cf", outs, "-C", srcs, "."], check=True)
    else:
        flag = {"tar-gnu": [], "tar.gz": ["-z"], "tar.zst": ["--zstd"], "tar.xz": ["-J"],
                "tar.bz2": ["-j"]}[kind]
        subprocess.run(["tar", "--format=posix", "--xattrs", "--xattrs-include=user.*",
                        *flag, "-cf", outs, "-C", srcs, "."], check=True)
    return out


KINDS = ["sqfs-mksquashfs-gzip", "sqfs-mksquashfs-zstd", "sqfs-gensquashfs", "tar-gnu",
         "tar-bsdtar", "tar-python", "tar.gz", "tar.zst", "tar.xz", "tar.bz2"]
# Formats whose writer kept the tree's user.* extended attributes.
KEEP_XATTRS = {"sqfs-mksquashfs-gzip", "sqfs-mksquashfs-zstd", "sqfs-gensquashfs", "tar-gnu",
               "tar.gz", "tar.zst", "tar.xz", "tar.bz2", "tar-bsdtar"}


@pytest.fixture(scope="module", params=KINDS)
def made(request, tree, tmp_path_factory):
    kind = request.param
    out = tmp_path_factory.mktemp(kind) / f"data.{kind.split('-')[0]}"
    return kind, build(kind, tree, out)


def walk_source(src):
    """(relative path, lstat) of everything under `src`, parents first."""
    out = []
    todo = [""]
    while todo:
        rel = todo.pop()
        for e in sorted(os.scandir(src / rel if rel else src), key=lambda e: e.name):
            r = f"{rel}/{e.name}" if rel else e.name
            st = e.stat(follow_symlinks=False)
            out.append((r, st))
            if stat.S_ISDIR(st.st_mode):
                todo.append(r)
    return out


def test_every_name_type_mode_owner_time_link_xattr_and_byte_equals_the_tree(made, tree):
    kind, path = made
    a = archfs.open_archive(path)
    by_ino = {}
    for rel, st in walk_source(tree):
        got = a.lstat(rel)
        where = f"{kind}: {rel!r}"
        assert stat.S_IFMT(got.st_mode) == stat.S_IFMT(st.st_mode), where
        assert stat.S_IMODE(got.st_mode) == stat.S_IMODE(st.st_mode), where
        assert (got.st_uid, got.st_gid) == (st.st_uid, st.st_gid), where
        if not stat.S_ISLNK(st.st_mode):
            # mksquashfs and GNU tar's posix format keep seconds for links' own times.
            assert got.st_mtime_ns // 10**9 == st.st_mtime_ns // 10**9, where
        if stat.S_ISDIR(st.st_mode):
            assert sorted(a.listdir(rel)) == sorted(os.listdir(tree / rel)), where
        elif stat.S_ISLNK(st.st_mode):
            assert a.readlink(rel) == os.readlink(tree / rel), where
        elif stat.S_ISREG(st.st_mode):
            assert got.st_size == st.st_size, where
            assert a.read(rel) == (tree / rel).read_bytes(), where
            by_ino.setdefault(st.st_ino, set()).add(got.st_ino)
        if kind in KEEP_XATTRS and not stat.S_ISLNK(st.st_mode):
            want = {k: os.getxattr(tree / rel, k) for k in os.listxattr(tree / rel)
                    if k.startswith("user.")}
            have = {k: a.getxattr(rel, k) for k in a.listxattr(rel) if k.startswith("user.")}
            assert have == want, where
    if kind != "sqfs-gensquashfs":  # `gensquashfs -D` packs hard links apart (the kernel agrees)
        assert all(len(inos) == 1 for inos in by_ino.values()), f"{kind}: hard links apart"
    assert sorted(a.listdir()) == sorted(os.listdir(tree))
    assert sorted(a.listdir(b"")) == sorted(os.listdir(os.fsencode(tree)))


def test_links_are_followed_inside_the_archive_and_stop_at_its_edge(made, tree):
    kind, path = made
    a = archfs.open_archive(path)
    assert a.read("link-to-file") == (tree / "train/cat/1.jpg").read_bytes()
    assert a.read("train/link-up") == (tree / "big.bin").read_bytes()
    assert sorted(a.listdir("link-dir")) == sorted(os.listdir(tree / "train/dog"))
    assert a.read("link-dir/deep/er/far.txt") == b"far down\n"
    assert a.stat("link-dir").st_ino == a.stat("train/dog").st_ino
    assert a.read("/train/./dog/../cat/2.jpg") == (tree / "train/cat/2.jpg").read_bytes()
    with pytest.raises(FileNotFoundError):
        a.stat("broken")
    with pytest.raises(FileNotFoundError):
        a.read("abs-link")  # it would leave the archive
    with pytest.raises(FileNotFoundError):
        a.read("../big.bin")
    with pytest.raises(OSError) as e:
        a.read("loop-a")
    assert e.value.errno == errno.ELOOP
    assert a.lstat("abs-link").st_size == len("/etc/hostname")


def test_errors_are_the_os_errors_python_code_expects(made):
    kind, path = made
    a = archfs.open_archive(path)
    with pytest.raises(FileNotFoundError, match="no such file or directory") as e:
        a.read("train/cat/missing.jpg")
    assert e.value.filename == "train/cat/missing.jpg"
    with pytest.raises(IsADirectoryError):
        a.read("train")
    with pytest.raises(IsADirectoryError):
        a.open("train")
    with pytest.raises(NotADirectoryError):
        a.listdir("big.bin")
    with pytest.raises(NotADirectoryError):
        a.read("big.bin/x")
    with pytest.raises(OSError) as e:
        a.getxattr("empty", "user.none")
    assert e.value.errno == errno.ENODATA


def test_a_file_object_reads_seeks_and_tells_as_a_local_file_does(made, tree):
    kind, path = made
    a = archfs.open_archive(path)
    want = (tree / "big.bin").read_bytes()
    with a.open("big.bin") as f, open(tree / "big.bin", "rb") as g:
        assert isinstance(f, io.BufferedReader) and f.seekable() and f.readable()
        rnd = random.Random(3)
        for _ in range(200):
            at = rnd.randrange(0, len(want) + 10)
            assert f.seek(at) == g.seek(at)
            n = rnd.choice([0, 1, 100, 4096, 70_000, 1 << 20])
            assert f.read(n) == g.read(n)
            assert f.tell() == g.tell()
        f.seek(-5, io.SEEK_END)
        assert f.read() == want[-5:]
        buf = bytearray(1000)
        f.seek(10)
        assert f.readinto(buf) == 1000 and bytes(buf) == want[10:1010]
    # A buffer far larger than the file: filled with what the file holds, nothing
    # allocated for the rest.
    raw = a.open("train/dog/003.JPEG", buffering=0)
    huge = bytearray(64 << 20)
    assert raw.readinto(huge) == (tree / "train/dog/003.JPEG").stat().st_size
    with a.open("sp ace & ünïcode ✓.txt", "r") as t:
        assert t.read() == "names\n"
    raw = a.open("train/dog/005.JPEG", buffering=0)
    assert raw.read() == (tree / "train/dog/005.JPEG").read_bytes()
    with pytest.raises(ValueError, match="read-only"):
        a.open("empty", "wb")


def test_read_many_partial_reads_scandir_walk_and_files(made, tree):
    kind, path = made
    a = archfs.open_archive(path)
    names = [f"train/cat/{i}.jpg" for i in range(30)]
    assert a.read_many(names) == [(tree / n).read_bytes() for n in names]
    assert a.read_many(names, threads=4) == [(tree / n).read_bytes() for n in names]
    # Nothing is filled in order here: every file at hand, in the order asked.
    assert list(a.read_as_landed(names)) == list(enumerate(a.read_many(names)))
    with pytest.raises(FileNotFoundError):
        list(a.read_as_landed(names[:2] + ["train/cat/none.jpg"]))
    whole = (tree / "big.bin").read_bytes()
    assert a.read("big.bin", 1 << 20, 100_000) == whole[1 << 20:(1 << 20) + 100_000]
    assert a.read("big.bin", len(whole) - 3, 100) == whole[-3:]
    assert a.read("big.bin", len(whole) + 5) == b""
    entries = {e.name: e for e in a.scandir("")}
    assert entries["link-dir"].is_dir() and entries["link-dir"].is_symlink()
    assert not entries["link-dir"].is_dir(follow_symlinks=False)
    assert entries["big.bin"].is_file() and entries["big.bin"].stat().st_size == len(whole)
    assert not entries["broken"].is_file() and not entries["broken"].is_dir()
    assert entries["train"].path == "train" and os.fspath(entries["empty"]) == "empty"
    walked = {root: (sorted(d), sorted(f)) for root, d, f in a.walk("train")}
    assert walked["train/dog/deep/er"] == ([], ["far.txt"])
    assert walked["train"] == (["cat", "dog"], ["link-up"])
    # ImageFolder's order: directories by path, names sorted in each, links followed.
    got = a.files("train", [".jpg", ".jpeg"])
    want = []
    for root, _, fnames in sorted(os.walk(tree / "train", followlinks=True)):
        for f in sorted(fnames):
            if f.lower().endswith((".jpg", ".jpeg")):
                want.append(os.path.relpath(os.path.join(root, f), tree))
    assert got == want


def test_threads_read_in_parallel_and_all_bytes_are_right(made, tree):
    kind, path = made
    a = archfs.open_archive(path)
    names = [str(p.relative_to(tree)) for p in tree.rglob("*")
             if p.is_file() and not p.is_symlink()]
    want = {n: (tree / n).read_bytes() for n in names}
    bad = []

    def reader(seed):
        order = list(names)
        random.Random(seed).shuffle(order)
        for n in order:
            if a.read(n) != want[n]:
                bad.append(n)
        with a.open("big.bin") as f:
            if f.read() != want["big.bin"]:
                bad.append("big.bin (file object)")

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bad == []


def test_it_pickles_as_its_arguments_and_a_forked_child_reads_with_its_own(made, tree):
    kind, path = made
    a = archfs.open_archive(path, cache_size="16M")
    want = (tree / "train/cat/4.jpg").read_bytes()
    assert a.read("train/cat/4.jpg") == want
    b = pickle.loads(pickle.dumps(a))
    assert b._native is None, "unpickled, it opens at first use"
    assert b.read("train/cat/4.jpg") == want
    parent_forks = a._forks
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            ok = a.read("train/cat/4.jpg") == want and a._forks == 1 + parent_forks
            os.write(w, b"ok" if ok else b"bad")
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 10) == b"ok"
    os.waitpid(pid, 0)
    assert a.read("train/cat/4.jpg") == want, "the parent's handle is untouched"


def test_what_is_not_an_archive_or_is_damaged_gives_clear_errors(tmp_path, tree):
    notes = tmp_path / "notes.txt"
    notes.write_text("just text\n" * 100)
    with pytest.raises(ValueError, match="neither a SquashFS image nor a tar archive"):
        archfs.open_archive(notes)
    with pytest.raises(FileNotFoundError, match="cannot open archive"):
        archfs.open_archive(tmp_path / "missing.sqfs")
    with pytest.raises(ValueError, match="cache_size"):
        archfs.open_archive(notes, cache_size="lots")
    # Damage in the middle of a compressed image: every file either reads right or
    # fails with EIO naming it; nothing else escapes.
    img = build("sqfs-mksquashfs-gzip", tree, tmp_path / "d.sqfs")
    data = bytearray(img.read_bytes())
    rnd = random.Random(11)
    for at in rnd.sample(range(96, len(data) // 2), 40):
        data[at] ^= 0x5A
    img.write_bytes(bytes(data))
    try:
        a = archfs.open_archive(img)
    except (ValueError, OSError) as e:
        assert str(e)
        return
    eio = 0
    for root, _, fnames in os.walk(tree):
        for f in fnames:
            rel = os.path.relpath(os.path.join(root, f), tree)
            try:
                a.read(rel)
            except OSError as e:
                assert e.errno in (errno.EIO, errno.ENOENT, errno.ENOTDIR, errno.ELOOP), e
                eio += e.errno == errno.EIO
    print(f"{eio} files of the damaged image gave EIO")


def test_a_file_cut_short_under_an_open_archive_gives_eio_naming_it(tmp_path, tree):
    # Large reads are written straight into the `bytes` returned, small ones copied from
    # a buffer: a file that ends before its size says fails either way, by every call,
    # and no half-filled `bytes` escapes.
    path = build("tar-gnu", tree, tmp_path / "cut.tar")
    a = archfs.open_archive(path)
    small = [f"train/dog/{i:03}.JPEG" for i in range(3)]
    assert a.read_many(small) == [(tree / n).read_bytes() for n in small]
    with tarfile.open(path) as t:
        big = t.getmember("./big.bin")
    os.truncate(path, big.offset_data + (1 << 20))
    for call in (lambda: a.read("big.bin"),
                 lambda: a.read("big.bin", 1 << 20, 1 << 20),
                 lambda: a.read_many(small + ["big.bin"]),
                 lambda: a.read_many(["big.bin"] + small, threads=2),
                 lambda: a.open("big.bin").read()):
        with pytest.raises(OSError) as e:
            call()
        assert e.value.errno == errno.EIO and e.value.filename == "big.bin", e.value
    assert a.read("big.bin", 0, 1000) == (tree / "big.bin").read_bytes()[:1000]


def resident(path):
    """Bytes of `path` in the page cache, as fincore(1) counts them."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES",
                          str(path)], capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


def test_preload_streams_the_archive_into_the_page_cache_when_asked(tmp_path, tree):
    # A tar of the tree padded with a large member, so that its pages are many; a copy of
    # it for each case, so that no earlier case's preload (a thread that outlives its
    # Archive) touches the file a later case looks at.
    (tmp_path / "src").mkdir()
    shutil.copytree(tree / "train", tmp_path / "src/train", symlinks=True)
    (tmp_path / "src/pad.bin").write_bytes(random.Random(5).randbytes(48 << 20))
    built = build("tar-gnu", tmp_path / "src", tmp_path / "pre.tar")
    size = built.stat().st_size
    names = [f"train/cat/{i}.jpg" for i in range(30)]

    def cold_copy(case):
        """A copy of the tar, out of the page cache."""
        path = tmp_path / f"pre-{case}.tar"
        shutil.copyfile(built, path)
        with open(path, "rb") as f:
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        assert resident(path) < size // 4, "the test needs the archive out of memory"
        return path

    def preloaded(path, deadline=120.0):
        # The preload asks the kernel to read ahead and waits for each piece's end: most
        # of the file, if not every page of it, is what it promises.
        end = time.monotonic() + deadline
        while time.monotonic() < end:
            if resident(path) >= size * 9 // 10:
                return True
            time.sleep(0.2)
        return False

    # "never", and "auto" before an epoch: reads bring in what they read and no more.
    for when in ("never", "auto", False):
        path = cold_copy(when)
        a = archfs.open_archive(path, preload=when)
        assert [a.read(n) for n in names] == [(tree / n).read_bytes() for n in names]
        time.sleep(1.0)
        assert resident(path) < size // 2, (when, resident(path), size)
    # "auto" once 128 files have been read; "always" (and True) at once.
    path = cold_copy("auto-epoch")
    a = archfs.open_archive(path, preload="auto")
    for _ in range(5):
        a.read_many(names)
    assert preloaded(path), ("auto: not preloaded after 150 reads", resident(path), size)
    for when in ("always", True):
        path = cold_copy(f"{when}-now")
        a = archfs.open_archive(path, preload=when)
        assert preloaded(path), (f"{when}: not preloaded", resident(path), size)
        assert pickle.loads(pickle.dumps(a))._args == a._args
    with pytest.raises(ValueError, match="preload 'often'"):
        archfs.open_archive(path, preload="often")


# fsspec


def test_fsspec_finds_the_protocol_and_reads_listings_ranges_and_chained_urls(tree, tmp_path):
    fsspec = need("fsspec")
    img = build("sqfs-mksquashfs-zstd", tree, tmp_path / "data.sqfs")
    assert "archfs" in fsspec.available_protocols()
    fs = fsspec.filesystem("archfs", fo=str(img))
    assert sorted(fs.ls("train/cat", detail=False)) == sorted(
        f"train/cat/{n}" for n in os.listdir(tree / "train/cat"))
    info = fs.info("archfs://big.bin")
    assert info["type"] == "file" and info["size"] == (tree / "big.bin").stat().st_size
    assert fs.info("train")["type"] == "directory"
    assert fs.info("link-dir")["islink"] and fs.info("link-dir")["type"] == "directory"
    assert fs.isdir("train/dog") and fs.isfile("empty") and not fs.exists("nope")
    whole = (tree / "big.bin").read_bytes()
    assert fs.cat_file("big.bin", 10, 20) == whole[10:20]
    assert fs.cat_file("big.bin", -4) == whole[-4:]
    got = fs.cat_ranges(["big.bin", "train/cat/3.jpg", "nope"], [0, 5, 0], [3, 50, 1])
    assert got[:2] == [whole[:3], (tree / "train/cat/3.jpg").read_bytes()[5:50]]
    assert isinstance(got[2], FileNotFoundError)
    assert fs.cat("train/dog/000.JPEG") == (tree / "train/dog/000.JPEG").read_bytes()
    assert sorted(fs.find("train/dog")) == sorted(
        f"train/dog/{p}" for p in ["deep/er/far.txt", *os.listdir(tree / "train/dog")]
        if p != "deep")
    with fsspec.open(f"archfs://train/dog/deep/er/far.txt::{img}") as f:
        assert f.read() == b"far down\n"
    with fsspec.open(f"archfs://big.bin::file://{img}", "rb") as f:
        f.seek(1 << 20)
        assert f.read(10) == whole[1 << 20:(1 << 20) + 10]
    with pytest.raises(NotImplementedError):
        fs.open("new", "wb")


# torchvision


def image_tree(root):
    """Real images of several formats and extensions, as ImageFolder meets them."""
    from PIL import Image
    rnd = random.Random(5)
    for cls in ["cat", "dog", "emu"]:
        (root / cls / "more").mkdir(parents=True)
    n = 0
    for cls in ["cat", "dog", "emu"]:
        for name, fmt in [("a.jpg", "JPEG"), ("b.JPEG", "JPEG"), ("c.png", "PNG"),
                          ("more/d.Png", "PNG"), ("e.bmp", "BMP")]:
            n += 1
            im = Image.new("RGB", (24 + n, 16), tuple(rnd.randrange(256) for _ in range(3)))
            im.putpixel((1, 1), (n, 2 * n, 3 * n))
            im.save(root / cls / name, fmt)
        (root / cls / "notes.txt").write_text("not an image")
    os.symlink("../cat/a.jpg", root / "dog/linked.jpg")
    os.symlink("dog", root / "linked-class")
    (root / "loose.jpg").write_bytes((root / "cat/a.jpg").read_bytes())


def need(module):
    """The module, or a skip where it is not installed; scripts/pytest installs every one
    and sets ARCHFS_TEST_EXTRAS, so there a missing one fails instead."""
    if os.environ.get("ARCHFS_TEST_EXTRAS"):
        return __import__(module)
    return pytest.importorskip(module)


def torch_or_skip():
    need("torch")
    need("torchvision")


@pytest.mark.once
def test_imagefolder_equals_torchvisions_on_a_mount_under_every_start_method(tmp_path):
    torch_or_skip()
    import torch
    import torchvision
    from torchvision.transforms import ToTensor
    from archfs.torch import ImageFolder

    src = tmp_path / "images"
    image_tree(src)
    img = tmp_path / "images.sqfs"
    subprocess.run(["mksquashfs", str(src), str(img), "-noappend", "-quiet", "-no-progress"],
                   check=True)
    tar = tmp_path / "images.tar"
    subprocess.run(["tar", "-cf", str(tar), "-C", str(src), "."], check=True)
    def theirs_on(root):
        theirs = torchvision.datasets.ImageFolder(str(root), transform=ToTensor())
        want = [(x, int(y)) for x, y in torch.utils.data.DataLoader(theirs, batch_size=None)]
        return theirs, want, [(os.path.relpath(p, root), c) for p, c in theirs.samples]

    if NO_FUSE:
        theirs, want, want_samples = theirs_on(src)
    else:
        with archfs.mount(img, tmp_path / "mnt") as mnt:
            theirs, want, want_samples = theirs_on(mnt)
    # A file object of the archive is what Pillow opens, as it opens a local file.
    from PIL import Image
    with archfs.open_archive(img).open("emu/more/d.Png") as f, Image.open(f) as im:
        with Image.open(src / "emu/more/d.Png") as want_im:
            assert im.size == want_im.size and im.tobytes() == want_im.tobytes()
    for archive in (img, tar):
        ours = ImageFolder(archive, transform=ToTensor())
        assert isinstance(ours, torchvision.datasets.ImageFolder)
        assert ours.classes == theirs.classes and ours.class_to_idx == theirs.class_to_idx
        assert ours.samples == want_samples and ours.imgs == ours.samples
        assert ours.targets == theirs.targets
        for method in ("fork", "forkserver", "spawn"):
            loader = torch.utils.data.DataLoader(
                ours, batch_size=None, num_workers=2, multiprocessing_context=method)
            got = [(x, int(y)) for x, y in loader]
            assert len(got) == len(want), method
            for (gx, gy), (wx, wy) in zip(got, want):
                assert gy == wy and torch.equal(gx, wx), method
        # Batches: the DataLoader asks __getitems__, which reads a batch's files in one
        # call; a subclass's own __getitem__ is still what it gets.
        batched = torch.utils.data.DataLoader(ours, batch_size=3, num_workers=2,
                                              collate_fn=list)
        got = [(x, int(y)) for batch in batched for x, y in batch]
        assert len(got) == len(want)
        assert all(gy == wy and torch.equal(gx, wx) for (gx, gy), (wx, wy) in zip(got, want))

        class Marked(ImageFolder):
            def __getitem__(self, i):
                x, y = super().__getitem__(i)
                return x, y + 100
        marked = Marked(archive, transform=ToTensor()).__getitems__([2, 0])
        assert [y for _, y in marked] == [want[2][1] + 100, want[0][1] + 100]
        assert torch.equal(marked[0][0], want[2][0])


def test_datasetfolder_takes_loaders_filters_and_roots_inside_the_archive(tmp_path):
    torch_or_skip()
    import torchvision
    from archfs.torch import DatasetFolder, ImageFolder

    src = tmp_path / "images"
    image_tree(src / "train")
    tar = tmp_path / "images.tar"
    with tarfile.open(tar, "w") as t:
        t.add(src / "train", arcname="train")
    a = archfs.open_archive(tar)
    ds = DatasetFolder(a, "train", loader=lambda f: len(f.read()), extensions=(".txt",))
    assert [(os.path.basename(p), c) for p, c in ds.samples] == [("notes.txt", i)
                                                                for i in range(4)]
    assert ds[0] == (len("not an image"), 0)
    only_png = ImageFolder(tar, "train", is_valid_file=lambda p: p.endswith(".png"))
    theirs = torchvision.datasets.ImageFolder(
        str(src / "train"), is_valid_file=lambda p: p.endswith(".png"))
    assert only_png.samples == [(os.path.relpath(p, src), c) for p, c in theirs.samples]
    with pytest.raises(FileNotFoundError, match="Found no valid file for the classes"):
        DatasetFolder(a, "train", loader=len, extensions=(".tiff",))
    with pytest.raises(FileNotFoundError):
        ImageFolder(a, "nope")


# Without /dev/fuse

NO_FUSE_CHILD = r"""
import os, sys, archfs
img, want_file = sys.argv[1:]
assert not os.path.exists("/dev/fuse"), "the namespace still has /dev/fuse"
try:
    archfs.mount(img, os.path.join(os.environ["TMPDIR"], "mnt"))
    sys.exit("mounted without /dev/fuse")
except archfs.MountError as e:
    assert "/dev/fuse is missing" in str(e) and "open_archive" in str(e), str(e)
a = archfs.open_archive(img)
assert a.read("train/cat/7.jpg") == open(want_file, "rb").read()
print("read without FUSE as uid", os.getuid())
"""


def test_without_dev_fuse_the_reader_works_and_mount_says_to_use_it(tree):
    """A mount namespace whose /dev is a fresh tmpfs with null, zero and urandom only, as
    in a container started without --device /dev/fuse; as root and as an ordinary user."""
    if NO_FUSE:
        with pytest.raises(archfs.MountError, match="/dev/fuse is missing.*open_archive"):
            archfs.mount(build("sqfs-mksquashfs-gzip", tree, tree.parent / "nf.sqfs"))
        return
    if shutil.which("unshare") is None:
        pytest.fail("unshare (util-linux) is missing: scripts/setup installs it")
    # A directory the ordinary user can reach, whoever runs the test.
    work = Path(tempfile.mkdtemp(prefix="archfs-nofuse-", dir="/tmp"))
    try:
        os.chmod(work, 0o755)
        img = build("sqfs-mksquashfs-gzip", tree, work / "data.sqfs")
        shutil.copy(tree / "train/cat/7.jpg", work / "want")
        (work / "no_fuse.py").write_text(NO_FUSE_CHILD)
        (work / "tmp").mkdir(mode=0o777)
        os.chmod(work / "tmp", 0o777)
        for p in work.iterdir():
            os.chmod(p, 0o777 if p.is_dir() else 0o644)
        users = [[]]
        if ROOT:
            users.append(["setpriv", "--reuid=archfs-test", "--regid=archfs-test",
                          "--clear-groups", "--"])
            prefix = ["unshare", "-m", "--propagation", "private"]
        else:
            prefix = ["unshare", "-r", "-m", "--propagation", "private"]
        for user in users:
            inner = " && ".join([
                f"mkdir -p {work}/olddev && mount --rbind /dev {work}/olddev",
                "mount -t tmpfs -o mode=755 none /dev",
                *[f"touch /dev/{d} && mount --bind {work}/olddev/{d} /dev/{d}"
                  for d in ("null", "zero", "urandom")],
                f"umount -l {work}/olddev",
                " ".join([*user, "env", f"TMPDIR={work}/tmp", sys.executable,
                          f"{work}/no_fuse.py", str(img), f"{work}/want"]),
            ])
            run = subprocess.run([*prefix, "sh", "-c", inner], capture_output=True, text=True)
            if run.returncode != 0 and not ROOT and "Operation not permitted" in run.stderr:
                pytest.skip("this kernel lets no ordinary user make a mount namespace "
                            "(the root run covers the ordinary user there)")
            assert run.returncode == 0, run.stderr
            assert "read without FUSE" in run.stdout
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_members_read_in_process_as_gnu_tar_extracts_them(tmp_path):
    """The tar cases of tests/tar_dialects.rs that a Python writer makes, read in process
    and through archfs.torch: hard links to themselves (a directory archived twice by GNU
    tar, and Python's tarfile), a link to a member given again later and to one that
    comes later, an old-style directory, symlink modes, a name holding a NUL."""
    src = tmp_path / "src"
    image_tree(src / "twice")
    os.link(src / "twice/cat/a.jpg", src / "twice/cat/a-again.jpg")
    tar = tmp_path / "cases.tar"
    # Named twice, each file with a second name is stored the second time as a hard
    # link to itself.
    subprocess.run(["tar", "-cf", str(tar), "-C", str(src), "twice", "twice"], check=True)
    with tarfile.open(tar, "a", format=tarfile.GNU_FORMAT) as t:
        def add(name, type=tarfile.REGTYPE, data=b"", mode=0o644, link=""):
            i = tarfile.TarInfo(name)
            i.type, i.size, i.mode, i.linkname, i.mtime = type, len(data), mode, link, 1_700_000_000
            t.addfile(i, io.BytesIO(data))
        add("py", tarfile.DIRTYPE, mode=0o755)
        add("py/a", data=b"a, first")
        add("py/b", tarfile.LNKTYPE, link="py/a")
        add("py/a", data=b"a, given again")
        add("py/self", data=b"self")
        add("py/self", tarfile.LNKTYPE, link="py/self")
        add("py/early", tarfile.LNKTYPE, link="py/later")
        add("py/later", data=b"later")
        add("py/old-dir/", tarfile.AREGTYPE, mode=0o750)
        add("py/old-dir/f", data=b"in an old-style directory")
        add("py/sym", tarfile.SYMTYPE, mode=0o755, link="a")
        add("py/nul\0cut", data=b"named up to the NUL")
    ex = tmp_path / "ex"
    ex.mkdir()
    subprocess.run(["tar", "-x", "-p", "--numeric-owner", "-f", str(tar), "-C", str(ex)])
    assert (ex / "py/b").read_bytes() == b"a, first" and not (ex / "py/early").exists()
    a = archfs.open_archive(tar)
    for dirpath, dirnames, filenames in os.walk(ex):
        rel = os.path.relpath(dirpath, ex)
        rel = "" if rel == "." else rel
        assert sorted(a.listdir(rel)) == sorted(dirnames + filenames), rel
        for name in [rel] + [os.path.join(rel, n) for n in dirnames + filenames]:
            if not name:
                continue
            want, got = os.lstat(ex / name), a.lstat(name)
            where = repr(name)
            assert stat.S_IFMT(got.st_mode) == stat.S_IFMT(want.st_mode), where
            assert stat.S_IMODE(got.st_mode) == stat.S_IMODE(want.st_mode), where
            assert got.st_nlink == want.st_nlink, where
            if stat.S_ISREG(want.st_mode):
                assert a.read(name) == (ex / name).read_bytes(), where
            if stat.S_ISLNK(want.st_mode):
                assert a.readlink(name) == os.readlink(ex / name), where
    assert a.lstat("twice/cat/a.jpg").st_ino == a.lstat("twice/cat/a-again.jpg").st_ino
    torch_or_skip()
    import torchvision
    from archfs.torch import ImageFolder
    theirs = torchvision.datasets.ImageFolder(str(ex / "twice"))
    ours = ImageFolder(tar, "twice")
    assert [(os.path.relpath(p, "twice"), c) for p, c in ours.samples] == [
        (os.path.relpath(p, ex / "twice"), c) for p, c in theirs.samples]


def test_node_shares_cover_every_file_once_with_every_class_on_every_node():
    from archfs.partition import node_shares, runs

    rng = random.Random(5)
    # 40 classes of 1-300 samples, sorted by class as an ImageFolder's are.
    targets = [c for c in range(40) for _ in range(rng.randrange(1, 300))]
    for nodes in (1, 2, 4, 7):
        shares = node_shares(targets, nodes)
        assert sorted(i for s in shares for i in s) == list(range(len(targets)))
        sizes = [len(s) for s in shares]
        assert max(sizes) - min(sizes) <= 40, sizes
        for c in range(40):
            n = targets.count(c)
            got = [sum(targets[i] == c for i in s) for s in shares]
            assert all(n // nodes <= g <= -(-n // nodes) for g in got), (c, n, got)
        # One run of the archive a class, at most, on each node.
        assert all(len(runs(s)) <= 40 for s in shares)
    with pytest.raises(ValueError):
        node_shares(targets, 0)


@pytest.mark.once
def test_node_sampler_keeps_each_node_on_its_share_and_shuffles_it(tmp_path):
    torch_or_skip()
    from archfs.partition import node_shares
    from archfs.torch import ImageFolder, NodeSampler

    src = tmp_path / "classes"
    for c in range(6):
        (src / f"c{c}").mkdir(parents=True)
        for i in range(5 + 7 * c):
            (src / f"c{c}" / f"{i:03d}.jpg").write_bytes(b"x" * i)
    img = tmp_path / "classes.sqfs"
    subprocess.run(["mksquashfs", str(src), str(img), "-noappend", "-quiet", "-no-progress"],
                   check=True)
    ds = ImageFolder(str(img))
    nodes, ranks = 4, 2
    shares = node_shares(ds.targets, nodes)
    seen = {}
    for epoch in range(3):
        for node in range(nodes):
            drawn = []
            for r in range(ranks):
                s = NodeSampler(ds, nodes=nodes, node=node, ranks_here=ranks, rank_here=r,
                                seed=1)
                s.set_epoch(epoch)
                got = list(s)
                assert len(got) == len(s) == -(-max(map(len, shares)) // ranks)
                drawn += got
            # The node's ranks draw its share, all of it, padded by its own samples.
            assert set(drawn) == set(shares[node])
            assert {ds.targets[i] for i in drawn} == set(range(6)), "a class missing"
            seen[epoch, node] = drawn
    assert all(seen[0, n] != seen[1, n] for n in range(nodes)), "not reshuffled"
    # The shape from the launcher's variables (srun's).
    env = dict(SLURM_JOB_NUM_NODES="4", SLURM_NODEID="2", SLURM_NTASKS_PER_NODE="2",
               SLURM_LOCALID="1")
    code = ("import sys; from archfs.torch import ImageFolder, NodeSampler\n"
            "s = NodeSampler(ImageFolder(sys.argv[1]), seed=1)\n"
            "print(s.nodes, s.node, s.ranks_here, s.rank_here)")
    out = subprocess.run([sys.executable, "-c", code, str(img)], capture_output=True,
                         text=True, env={**os.environ, **env}, timeout=120)
    assert out.stdout.split() == ["4", "2", "2", "1"], out.stderr


def test_fetch_ahead_keeps_the_samplers_order_and_shuffles_every_epoch_anew(tmp_path):
    """FetchAhead yields its sampler's order unchanged (DistributedSampler's, epoch by
    epoch), and without one a full shuffle per epoch from its seed; on a local archive it
    fetches nothing and reads as without it."""
    torch_or_skip()
    import torch.utils.data as tud
    from archfs.torch import FetchAhead, ImageFolder

    src = tmp_path / "classes"
    for c in range(3):
        (src / f"c{c}").mkdir(parents=True)
        for i in range(20):
            (src / f"c{c}" / f"{i:03d}.jpg").write_bytes(bytes([c, i]) * 9)
    img = tmp_path / "classes.sqfs"
    subprocess.run(["mksquashfs", str(src), str(img), "-noappend", "-quiet", "-no-progress"],
                   check=True)
    ds = ImageFolder(str(img), loader=lambda f: f.read())
    assert ds.archive.fetch_ahead([p for p, _ in ds.samples]) == 0, "a local file fetched"
    inner = tud.DistributedSampler(ds, num_replicas=3, rank=1, seed=5)
    plain = tud.DistributedSampler(ds, num_replicas=3, rank=1, seed=5)
    ahead = FetchAhead(ds, inner)
    assert len(ahead) == len(plain) == 20
    for epoch in range(3):
        ahead.set_epoch(epoch)
        plain.set_epoch(epoch)
        assert list(ahead) == list(plain), f"epoch {epoch}"
    own = FetchAhead(ds, seed=3)
    orders = []
    for epoch in range(3):
        own.set_epoch(epoch)
        orders.append(list(own))
        assert sorted(orders[-1]) == list(range(len(ds)))
    assert len({tuple(o) for o in orders}) == 3, "the same order in two epochs"
    again = FetchAhead(ds, seed=3)
    again.set_epoch(2)
    assert list(again) == orders[2], "not drawn from the seed and the epoch"
    unset = FetchAhead(ds, seed=3)
    assert [list(unset) for _ in range(3)] == orders, "an epoch without set_epoch: not anew"
    loader = tud.DataLoader(ds, batch_size=7, sampler=FetchAhead(ds, shuffle=False))
    got = [b for batch, _ in loader for b in batch]
    assert got == [(src / p).read_bytes() for p, _ in ds.samples]
    with pytest.raises(ValueError, match="archfs.torch dataset"):
        FetchAhead(list(range(5)))
