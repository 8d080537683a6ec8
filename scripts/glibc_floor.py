"""Prints the newest glibc symbol version an ELF binary needs (e.g. 2.17), read from its
.gnu.version_r section, so the check needs no binutils; with --load-align, the smallest
alignment of its LOAD segments instead (65536 or more runs on 64 KiB-page kernels)."""

import struct
import sys


def newest_glibc(path: str) -> str:
    data = open(path, "rb").read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        sys.exit(f"{path}: not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    SHT_GNU_VERNEED = 0x6FFFFFFE
    best = (0,)
    for name, typ, _, _, off, size, link, info, _, _ in sections:
        if typ != SHT_GNU_VERNEED:
            continue
        strtab = sections[link][4]
        pos = off
        for _ in range(info):  # one Verneed per needed library
            _, cnt, _, aux, nxt = struct.unpack_from("<HHIII", data, pos)
            apos = pos + aux
            for _ in range(cnt):
                _, _, _, vname, anext = struct.unpack_from("<IHHII", data, apos)
                end = data.index(b"\0", strtab + vname)
                label = data[strtab + vname:end].decode()
                if label.startswith("GLIBC_") and label[6:7].isdigit():
                    best = max(best, tuple(int(x) for x in label[6:].split(".")))
                apos += anext
            pos += nxt
    return ".".join(map(str, best))


def load_alignment(path: str) -> int:
    """The smallest p_align of the file's PT_LOAD segments: a kernel maps no segment
    aligned below its page size (a 4 KiB-aligned binary fails on a 64 KiB-page arm64)."""
    data = open(path, "rb").read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        sys.exit(f"{path}: not a 64-bit little-endian ELF file")
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    PT_LOAD = 1
    aligns = [struct.unpack_from("<IIQQQQQQ", data, phoff + i * phentsize)[7]
              for i in range(phnum)
              if struct.unpack_from("<I", data, phoff + i * phentsize)[0] == PT_LOAD]
    if not aligns:
        sys.exit(f"{path}: no LOAD segments")
    return min(aligns)


if __name__ == "__main__":
    if sys.argv[1] == "--load-align":
        print(load_alignment(sys.argv[2]))
    else:
        print(newest_glibc(sys.argv[1]))
