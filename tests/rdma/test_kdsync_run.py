"""Real `kdsync run` members with Kafka over soft-RoCE (issue 21): three
embedded Tansu clusters in the guest, one member per cluster whose peer
links run over rxe0 (`[transport] kind = "rdma"`), paced writes into every
cluster at once, then every global topic identical and exactly once; and a
member killed with SIGKILL mid-stream and restarted, its links back over
RDMA.  The guest runs the project's own virtualenv (shared read-only with
the source tree): confluent-kafka and the Tansu binary come from there."""

from __future__ import annotations

import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kdsync.testing.local import LocalGroup, check_global_topics, write_events

VENV_SITE = Path(__file__).resolve().parents[2] / ".venv" / "lib" / "python3.11" / "site-packages"
pytestmark = pytest.mark.skipif(not (VENV_SITE / "confluent_kafka").is_dir(),
                                reason=f"the project's virtualenv is not shared with the guest ({VENV_SITE})")


def rdma_group(addr: str, workdir: Path) -> LocalGroup:
    """Three members listening and dialling on the guest's rxe0 address
    (rdma_cm reaches no RDMA device through 127.0.0.1), peer links over RDMA."""
    return LocalGroup(3, workdir, tick_ms=20, heartbeat_ms=200, suspect_ms=3000, retransmit_ms=200, metrics=True,
                      extra={"transport": {"kind": "rdma"}}, host=addr)


def rdma_links(g: LocalGroup, i: int) -> set[str]:
    """Peers member i saw an RDMA link come up to, from its log."""
    return set(re.findall(r'msg="peer (\S+): RDMA link up via rxe0"', g.log_text(i)))


def _write_all(g: LocalGroup, n: int, tag: str, rate: float) -> None:
    """n paced records into every cluster at once; each writer's failure is raised here."""
    with ThreadPoolExecutor(g.n) as ex:
        acked = list(ex.map(lambda i: write_events(g.bootstrap(i), g.topic, n, f"{tag}-{i}", rate=rate, timeout=120),
                            range(g.n)))
    assert acked == [n] * g.n, acked


def _agree(g: LocalGroup, expected: int, timeout: float) -> None:
    got = g.wait_for(expected, timeout=timeout)
    ok, detail = check_global_topics(got, expected=expected)
    assert ok, detail + "\n" + "\n".join(g.log_text(i)[-2000:] for i in range(g.n))


@pytest.mark.timeout(420)
def test_three_clusters_ordered_over_rdma_identical_and_exactly_once(addr, tmp_path, results):
    g = rdma_group(addr, tmp_path)
    try:
        t0 = time.monotonic()
        g.start_brokers()
        g.start_members()
        g.wait_ready(timeout=180)
        ready_s = time.monotonic() - t0
        _write_all(g, 100, "a", rate=50)
        _agree(g, 300, timeout=180)
        for i in range(g.n):  # every member reached both peers over RDMA, none over TCP alone
            assert rdma_links(g, i) == set(g.names) - {g.names[i]}, g.log_text(i)[-3000:]
        results["kdsync_run_rdma"] = {"members": g.n, "events": 300, "ready_s": round(ready_s, 1)}
    finally:
        g.close()


@pytest.mark.timeout(420)
def test_a_member_killed_mid_stream_and_restarted_keeps_every_cluster_identical(addr, tmp_path):
    g = rdma_group(addr, tmp_path)
    try:
        g.start_brokers()
        g.start_members()
        g.wait_ready(timeout=180)
        writer = threading.Thread(target=_write_all, args=(g, 150, "k", 30.0))
        writer.start()
        time.sleep(2.0)  # mid-stream: the writers run for 5 s
        g.signal_member(2, signal.SIGKILL)
        g.wait_member(2)
        writer.join()
        g.start_member(2)
        g.wait_ready(timeout=180)
        _agree(g, 450, timeout=240)
        log = g.log_text(2)
        assert log.count('msg="transport rdma listening') >= 2  # both lives of dc3 listened on rxe0
        assert rdma_links(g, 2) == {"dc1", "dc2"}
    finally:
        g.close()

