"""Finding (and installing, where this machine allows) the command-line tools
some tests run: Debian packages via apt-get when root, Python tools from the
project's `lint` extra in the venv."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def ensure_tool(cmd: str, package: str) -> str:
    """Path of `cmd`, apt-installing Debian `package` if we can; pytest.skip otherwise."""
    path = shutil.which(cmd)
    if path:
        return path
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip(f"skipped: {cmd} is not installed and apt-get cannot be used here (not root / no apt)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env, timeout=300)
    r = subprocess.run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", package], capture_output=True, text=True, env=env, timeout=600
    )
    path = shutil.which(cmd)
    if r.returncode != 0 or not path:
        pytest.skip(f"skipped: apt-get install {package} failed: {(r.stderr or r.stdout).strip()[-200:]}")
    return path


def venv_tool(cmd: str, package: str) -> str:
    """Path of `cmd` installed by a pip package of the `lint` extra next to this
    Python (make test installs it); pytest.skip naming the package otherwise."""
    path = Path(sys.executable).parent / cmd
    if path.is_file() and os.access(path, os.X_OK):
        return str(path)
    found = shutil.which(cmd)
    if found:
        return found
    pytest.skip(f"skipped: {cmd} not found; it comes from the pip package {package} (pip install -e '.[lint]', "
                f"which make test does)")


def kdsync_metrics() -> dict[str, tuple[str, set[str]]]:
    """Every metric family a member exports: name -> (type, sample names), read
    from a live MemberMetrics registry (its transport and core collectors included)."""
    from types import SimpleNamespace

    from kdsync.observability.metrics import MemberMetrics

    peer = SimpleNamespace(bytes_in=1, bytes_out=1, frames_in=1, frames_out=1, connected=True, refused=0, refusals={})
    m = MemberMetrics(peers=lambda: {"dc2": peer}, cores=lambda: {"t": {"delivered": 1}},
                      links=lambda: ({"dc2": "rdma"}, (True, {"dc2": 0})))
    out = {}
    for fam in m.registry.collect():
        if fam.type == "counter":
            samples = {fam.name + "_total"}
        elif fam.type == "histogram":
            samples = {fam.name + s for s in ("_bucket", "_sum", "_count")}
        else:
            samples = {fam.name}
        out[fam.name] = (fam.type, samples)
    return out
