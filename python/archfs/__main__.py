"""``python -m archfs ARGS``: the archfs command line, and ``python -m archfs stage``
(``archfs.stage``'s, for job scripts)."""

import os
import sys

from ._binary import find_archfs


def main() -> None:
    if sys.argv[1:2] == ["stage"]:
        # Needs the job's MPI or torch.distributed, which the binary does not link.
        from .stage import main as stage

        sys.exit(stage(sys.argv[2:]))
    binary = find_archfs()
    os.execv(binary, [binary, *sys.argv[1:]])


if __name__ == "__main__":
    main()
