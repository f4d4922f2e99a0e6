"""The RDMA transport, tested for real: boot a Debian guest under qemu (TCG),
add a soft-RoCE device (rdma_rxe) there, run tests/rdma inside, and check
what they reported.  Skips -- saying why -- only when this machine cannot run
the VM at all (no qemu and no root to install it, or the guest cannot boot).

Set KDSYNC_SKIP_VM=1 to skip it on purpose (it still says so)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "infra" / "rdma-vm" / "run-tests.sh"

# The "ci" suite of the guest (infra/rdma-vm/run-tests.sh): every behaviour once.  The measurements
# (test_rdma_perf.py, test_member_perf.py) are make bench's; the start stress is make test-rdma-stress.
EXPECTED = {
    "test_device_is_usable",
    "test_send_receive_many_in_order",
    "test_frame_larger_than_all_buffers",
    "test_credits_exhausted_back_pressure",
    "test_peer_that_disappears_and_returns",
    "test_wrong_secret_is_refused",
    "test_mixed_group_rdma_and_tcp",
    "test_three_members_agree_over_rdma",
    "test_a_member_killed_mid_stream_and_restarted_keeps_every_cluster_identical",
    "test_mixed_group_one_member_without_rdma",
    "test_rdma_device_deleted_mid_stream_members_go_on_over_tcp",
}
NOT_IN_CI = {"test_rdma_vs_tcp_latency_and_throughput", "test_member_latency_and_cpu_per_event_rdma_vs_tcp",
             "test_member_starts_stress"}


def _vm_budget() -> int:
    """The qemu limit run-tests.sh gives the ci suite (it scales with the suite's work), or the
    KDSYNC_VM_TIMEOUT the caller set."""
    if os.environ.get("KDSYNC_VM_TIMEOUT"):
        return int(os.environ["KDSYNC_VM_TIMEOUT"])
    try:
        out = subprocess.run(["bash", str(SCRIPT), "--budget"], capture_output=True, text=True, timeout=10,
                             env=dict(os.environ, KDSYNC_VM_SUITE="ci"))
        return int(out.stdout.strip())
    except (OSError, ValueError, subprocess.SubprocessError):
        return 600


# qemu's limit, plus installing qemu and building the guest image on a fresh machine (a cached image: seconds)
IMAGE_BUILD_S = 600
HOST_TIMEOUT_S = _vm_budget() + IMAGE_BUILD_S + 60


def _no_rdma_here() -> str:
    from kdsync.transport.rdma import unavailable_reason

    reason = unavailable_reason()
    if reason is None:
        pytest.skip("skipped: this machine has RDMA; the fallback is tested where it has not")
    return reason


def test_auto_falls_back_to_tcp_and_says_why(caplog):
    """Host side: without pyverbs or a device, "auto" is TCP with one log line."""
    import asyncio
    import logging

    from kdsync.transport import make_transport
    from kdsync.transport.tcp import TcpTransport

    reason = _no_rdma_here()
    peers = {"a": ("127.0.0.1", 0), "b": ("127.0.0.1", 9)}
    with caplog.at_level(logging.INFO, logger="kdsync.transport"):
        t = make_transport("auto", "a", peers["a"], peers, lambda p, m: None)
    assert isinstance(t, TcpTransport)
    lines = [r.getMessage() for r in caplog.records if "using TCP" in r.getMessage()]
    assert len(lines) == 1 and reason in lines[0]
    asyncio.run(t.close())


def test_rdma_kind_fails_with_one_clear_line():
    from kdsync.transport import TransportError, make_transport

    _no_rdma_here()
    peers = {"a": ("127.0.0.1", 7401), "b": ("127.0.0.1", 7402)}
    with pytest.raises(TransportError) as exc:
        make_transport("rdma", "a", peers["a"], peers, lambda p, m: None)
    msg = str(exc.value)
    assert "\n" not in msg and "rdma" in msg and "tcp" in msg


def test_rdma_usable_reports_a_reason_without_raising():
    from kdsync.transport.rdma import rdma_usable

    reason = _no_rdma_here()
    ok, why = rdma_usable("127.0.0.1")
    assert ok is False and why == reason


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return f"({path.name} missing)"


@pytest.mark.slow
@pytest.mark.timeout(HOST_TIMEOUT_S + 30)
def test_rdma_transport_in_soft_roce_vm(tmp_path):
    if os.environ.get("KDSYNC_SKIP_VM") == "1":
        pytest.skip("skipped: KDSYNC_SKIP_VM=1")
    if not sys.platform.startswith("linux"):
        pytest.skip(f"skipped: the VM runner needs Linux, this is {sys.platform}")
    out = tmp_path / "rdma-vm"
    env = dict(os.environ, KDSYNC_VM_SUITE="ci")
    env.pop("KDSYNC_VM_CMD", None)
    proc = subprocess.run(
        ["bash", str(SCRIPT), str(out)], capture_output=True, text=True, timeout=HOST_TIMEOUT_S, env=env, cwd=ROOT
    )
    if proc.returncode == 3:
        reason_file = out / "skip_reason"
        reason = reason_file.read_text().strip() if reason_file.exists() else proc.stderr.strip()[-300:]
        pytest.skip(f"skipped: {reason}")
    assert proc.returncode == 0, (
        f"run-tests.sh exit {proc.returncode}\n--- stderr\n{proc.stderr[-3000:]}\n--- guest.log\n{_tail(out / 'guest.log')}"
        f"\n(the guest's member logs, cores and gdb stacks, if any: {out / 'artifacts'})"
    )

    suite = ET.parse(out / "junit.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert suite is not None
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    assert counts["failures"] == counts["errors"] == counts["skipped"] == 0, counts
    ran = {case.get("name") for case in suite.iter("testcase")}
    assert EXPECTED <= ran, f"missing in-VM tests: {sorted(EXPECTED - ran)}"
    assert not (NOT_IN_CI & ran), f"measurements or stress in the ci suite: {sorted(NOT_IN_CI & ran)}"

    results = json.loads((out / "results.json").read_text())
    assert results["pytest_exit"] == 0
    assert results["group_rdma"]["events"] == 300 and results["group_rdma"]["members"] == 3
    assert results["kdsync_run_rdma"]["events"] == 450 and results["kdsync_run_rdma"]["members"] == 3
    info = (out / "vm-info.txt").read_text()
    assert "rxe0" in info and "ACTIVE" in info
    assert not (out / "artifacts").exists(), "the guest kept cores: a process crashed in native code"
    run = json.loads((out / "run.json").read_text())
    print(f"\nRDMA VM (ci suite): image {run['image_seconds']}s, vm {run['vm_seconds']}s of {run['timeout']}s")
