"""Where the archfs binary of this installation is."""

import os
import shutil
import sysconfig


def find_archfs() -> str:
    """The ``archfs`` binary: ``$ARCHFS_BIN``, else the one the wheel put in this
    environment's scripts directory (also a ``pip install --user`` one), else PATH."""
    explicit = os.environ.get("ARCHFS_BIN")
    if explicit:
        return explicit
    for scripts in (sysconfig.get_path("scripts"), sysconfig.get_path("scripts", "posix_user")):
        candidate = os.path.join(scripts, "archfs")
        if os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("archfs")
    if found:
        return found
    raise FileNotFoundError(
        "the archfs binary is not installed with this package; reinstall it with "
        "`pip install --force-reinstall archfs`, or set ARCHFS_BIN"
    )
