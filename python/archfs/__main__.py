"""``python -m archfs ARGS``: the archfs command line."""

import os
import sys

from ._binary import find_archfs


def main() -> None:
    binary = find_archfs()
    os.execv(binary, [binary, *sys.argv[1:]])


if __name__ == "__main__":
    main()
