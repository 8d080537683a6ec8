"""Where the bench's things are and what its helper modes are called. A leaf: it imports
nothing from the package, so every module may import it."""

import os

# The command helper processes are started as (`bench _read ...`): scripts/bench.
SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
# Its helper modes, each a first argument that runs one helper process (archbench.main):
# also how a run tells its own helpers from a tool's server among the processes naming a
# mount point (system.find_server_pids).
HELPER_MODES = ("_read", "_stat", "_torch", "_genjpeg", "_imagefolder", "_remote",
                "_read_archive", "_imagefolder_archive", "_rank", "_node", "_inproc_remote")
VENV = os.path.expanduser("~/.cache/archfs-bench/venv")
VPY = os.path.join(VENV, "bin", "python")
WORKTREE = "/tmp/archfs-bench-wt"
TARGET_DIR = "/tmp/archfs-bench-target"
MIB = 1 << 20
