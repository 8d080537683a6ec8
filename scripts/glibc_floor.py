"""Prints the newest glibc symbol version an ELF binary needs (e.g. 2.17), read from its
.gnu.version_r section, so the check needs no binutils."""

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


if __name__ == "__main__":
    print(newest_glibc(sys.argv[1]))
