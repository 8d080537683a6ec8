"""What the bench installs: the peers' Debian packages and the venv with ratarmount, Pillow
and torch."""

import glob
import os
import shutil
import subprocess
import sys

from .constants import VENV, VPY
from .system import log, sh, sh_out

# ---------------------------------------------------------------------------------------------
# Venv with ratarmount, Pillow, torch
# ---------------------------------------------------------------------------------------------


def venv_has(modules):
    if not os.path.exists(VPY):
        return False
    r = subprocess.run([VPY, "-c", f"import {modules}"], capture_output=True)
    return r.returncode == 0


def ensure_debian_peers():
    """Installs the peers Debian packages (squashfuse, archivemount, fuse-archive where the
    release has it) and the fixture tools; returns what could not be installed."""
    want = {"squashfuse": "squashfuse", "archivemount": "archivemount",
            "fuse-archive": "fuse-archive", "mksquashfs": "squashfs-tools",
            "fusermount3": "fuse3"}
    missing = [pkg for exe, pkg in want.items() if not shutil.which(exe)]
    if not missing:
        return
    if not os.path.exists("/var/lib/apt/lists/lock") or not glob.glob("/var/lib/apt/lists/*Packages*"):
        sh(["apt-get", "update", "-qq"], timeout=600)
    have = [p for p in missing if "Candidate: (none)" not in sh_out(["apt-cache", "policy", p])
            and "Candidate" in sh_out(["apt-cache", "policy", p])]
    if have:
        log(f"apt-get install {' '.join(have)}")
        sh(["apt-get", "install", "-y", "-qq"] + have, timeout=900,
           env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))


def ensure_venv(args):
    """Returns (torch_ok, reason)."""
    if not os.path.exists(VPY):
        log(f"creating venv {VENV}")
        subprocess.run([sys.executable, "-m", "venv", VENV], check=True)
        subprocess.run([VPY, "-m", "pip", "install", "-q", "-U", "pip"])
    if not venv_has("ratarmount, PIL") and not os.path.exists(os.path.join(VENV, "bin", "ratarmount")):
        log("pip install ratarmount Pillow")
        subprocess.run([VPY, "-m", "pip", "install", "-q", "ratarmount", "Pillow"])
    elif not venv_has("PIL"):
        subprocess.run([VPY, "-m", "pip", "install", "-q", "Pillow"])
    if args.no_torch:
        return False, "torch skipped (--no-torch)"
    if venv_has("torch, torchvision"):
        return True, None
    marker = os.path.join(os.path.dirname(VENV), "torch-install-failed")
    if os.path.exists(marker) and not args.retry_torch:
        with open(marker) as f:
            return False, f"torch unavailable ({f.read().strip()}; --retry-torch to try again)"
    log(f"pip install torch torchvision (up to {args.torch_install_timeout} s)")
    try:
        r = subprocess.run([VPY, "-m", "pip", "install", "-q", "torch", "torchvision"],
                           capture_output=True, text=True, timeout=args.torch_install_timeout)
        reason = None if r.returncode == 0 else f"pip failed: {r.stderr.strip()[-200:]}"
    except subprocess.TimeoutExpired:
        reason = f"pip install took over {args.torch_install_timeout} s"
    if reason is None and venv_has("torch, torchvision"):
        return True, None
    reason = reason or "import torch failed after install"
    with open(marker, "w") as f:
        f.write(reason)
    return False, f"torch unavailable ({reason})"
