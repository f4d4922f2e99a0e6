"""Tests that run INSIDE the soft-RoCE VM (infra/rdma-vm/run-tests.sh).

On the host they are not collected: they need an RDMA device and Debian's
python3-pyverbs, which only the guest has.  The host side is
tests/test_rdma_vm.py, which boots the VM and checks what these tests wrote.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest

IN_VM = os.environ.get("KDSYNC_IN_VM") == "1"
if not IN_VM:
    collect_ignore_glob = ["*.py"]

_RESULTS: dict = {}


def pytest_configure(config):
    # Which suite runs a test (infra/rdma-vm/run-tests.sh, KDSYNC_VM_SUITE): unmarked tests are "ci" (each
    # behaviour once: make test, make test-rdma); "bench" measures (make bench); "stress" repeats member
    # starts (make test-rdma-stress).
    config.addinivalue_line("markers", "bench: RDMA/TCP measurements, run by make bench (KDSYNC_VM_SUITE=bench)")
    config.addinivalue_line("markers", "stress: member start/stop stress, make test-rdma-stress (KDSYNC_VM_SUITE=stress)")


@pytest.fixture(scope="session")
def addr() -> str:
    """The guest address rxe0 serves (qemu user networking gives 10.0.2.15)."""
    return os.environ.get("KDSYNC_RDMA_ADDR", "10.0.2.15")


@pytest.fixture(scope="session")
def results() -> dict:
    """Measurements the tests record; written to $KDSYNC_VM_OUT/results.json."""
    return _RESULTS


_PORT_BASE = itertools.count(17400, 10)


@pytest.fixture
def ports() -> list[int]:
    """Fresh port numbers per test (the TCP fallback binds the same numbers,
    and a closed listener's port may linger)."""
    base = next(_PORT_BASE)
    return [base + i for i in range(10)]


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("KDSYNC_VM_OUT")
    if IN_VM and out:
        data = dict(_RESULTS)
        data["pytest_exit"] = int(exitstatus)
        # rxe's own counters over the whole run (retransmissions, RNR, ...).
        hw = Path("/sys/class/infiniband/rxe0/ports/1/hw_counters")
        if hw.is_dir():
            data["rxe_counters"] = {f.name: int(f.read_text().strip() or 0) for f in sorted(hw.iterdir()) if f.is_file()}
        Path(out, "results.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
