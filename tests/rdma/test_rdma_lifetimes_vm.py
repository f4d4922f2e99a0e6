"""The verbs-object lifetime rule of kdsync/transport/rdma.py (issue 44), on
the real pyverbs and rxe0: an RDMA transport dropped without close() and
collected as cyclic garbage leaves RDMA usable in its process
(tests/rdma/drop_unclosed.py, in a subprocess so that a native crash is an
exit status).  The same drop with the module's finalizers removed (how it was
before issue 44) is run too and its outcome recorded in results.json, not
asserted: the collector's order decides it."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _no_core() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # an expected crash leaves no core for the artifacts


def _drop(addr: str, port: int, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HERE / "drop_unclosed.py"), addr, str(port), *flags],
                          capture_output=True, text=True, timeout=180, preexec_fn=_no_core,
                          env=dict(os.environ, PYTHONFAULTHANDLER="1"))


def _outcome(p: subprocess.CompletedProcess) -> str:
    if p.returncode < 0:
        return f"killed by {signal.Signals(-p.returncode).name}"
    return "OK" if p.returncode == 0 and p.stdout.rstrip().endswith("OK") else f"exit {p.returncode}"


def test_a_transport_dropped_unclosed_is_collected_and_rdma_goes_on(addr, ports, results):
    fixed = _drop(addr, ports[0])
    before = _drop(addr, ports[2], "--without-finalizers")
    results["lifetimes"] = {"dropped_unclosed_with_finalizers": _outcome(fixed),
                            "dropped_unclosed_without_finalizers": _outcome(before),
                            "without_finalizers_tail": (before.stdout + before.stderr)[-1500:]}
    assert _outcome(fixed) == "OK", fixed.stdout[-3000:] + fixed.stderr[-3000:]
