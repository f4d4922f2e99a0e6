"""Real `kdsync run` members with Kafka over soft-RoCE (issue 21): three
embedded Tansu clusters in the guest, one member per cluster whose peer
links run over rxe0 (`[transport] kind = "rdma"`), paced writes into every
cluster at once, then every global topic identical and exactly once; a
member killed with SIGKILL mid-stream and restarted, its links back over
RDMA; a mixed group where one member runs TCP only; and the RDMA device
deleted under running members (`rdma link delete rxe0`), which go on over
TCP.  The guest runs the project's own virtualenv (shared read-only with
the source tree): confluent-kafka and the Tansu binary come from there."""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kdsync.testing.local import LocalGroup, check_global_topics, write_events

VENV_SITE = Path(__file__).resolve().parents[2] / ".venv" / "lib" / "python3.11" / "site-packages"
pytestmark = pytest.mark.skipif(not (VENV_SITE / "confluent_kafka").is_dir(),
                                reason=f"the project's virtualenv is not shared with the guest ({VENV_SITE})")


def rdma_group(addr: str, workdir: Path, kind: str = "rdma") -> LocalGroup:
    """Three members listening and dialling on the guest's rxe0 address
    (rdma_cm reaches no RDMA device through 127.0.0.1), peer links over RDMA."""
    return LocalGroup(3, workdir, tick_ms=20, heartbeat_ms=200, suspect_ms=3000, retransmit_ms=200, metrics=True,
                      extra={"transport": {"kind": kind}}, host=addr)


def _start(g: LocalGroup, overrides: dict[int, dict] | None = None) -> None:
    """Brokers, then the members (member i's config with `overrides[i]`), every one active."""
    g.start_brokers()
    for i in range(g.n):
        g.start_member(i, **(overrides or {}).get(i, {}))
    g.wait_ready(timeout=180)


def rdma_links(g: LocalGroup, i: int) -> set[str]:
    """Peers member i saw an RDMA link come up to, from its log."""
    return set(re.findall(r'msg="peer (\S+): RDMA link up via rxe0"', g.log_text(i)))


def _write_all(g: LocalGroup, n: int, tag: str, rate: float) -> None:
    """n paced records into every cluster at once; each writer's failure is raised here."""
    with ThreadPoolExecutor(g.n) as ex:
        acked = list(ex.map(lambda i: write_events(g.bootstrap(i), g.topic, n, f"{tag}-{i}", rate=rate, timeout=120),
                            range(g.n)))
    assert acked == [n] * g.n, acked


def _fault_mid_stream(g: LocalGroup, per_cluster: int, tag: str, fault) -> None:
    """Paced writes into every cluster (30 records/s each); `fault()` once a
    tenth of them is ordered in every cluster, while the writers still run."""
    writer = threading.Thread(target=_write_all, args=(g, per_cluster, tag, 30.0))
    writer.start()
    g.wait_for(per_cluster * g.n // 10, timeout=60)
    fault()
    writer.join()


def _agree(g: LocalGroup, expected: int, timeout: float) -> None:
    got = g.wait_for(expected, timeout=timeout)
    ok, detail = check_global_topics(got, expected=expected)
    assert ok, detail + "\n" + "\n".join(g.log_text(i)[-2000:] for i in range(g.n))


@pytest.mark.timeout(420)
def test_a_member_killed_mid_stream_and_restarted_keeps_every_cluster_identical(addr, tmp_path, results):
    """Three clusters ordered over RDMA (every member reached both peers over
    RDMA, none over TCP alone), then dc3 killed mid-stream and restarted:
    every global topic identical and exactly once."""
    with rdma_group(addr, tmp_path) as g:
        t0 = time.monotonic()
        _start(g)
        ready_s = time.monotonic() - t0

        def kill() -> None:
            g.signal_member(2, signal.SIGKILL)
            g.wait_member(2)

        _fault_mid_stream(g, 150, "k", kill)
        g.start_member(2)
        g.wait_ready(timeout=180)
        _agree(g, 450, timeout=240)
        log = g.log_text(2)
        assert log.count('msg="transport rdma listening') >= 2  # both lives of dc3 listened on rxe0
        for i in range(g.n):  # every member reached both peers over RDMA (dc3 in both its lives)
            assert rdma_links(g, i) == set(g.names) - {g.names[i]}, g.log_text(i)[-3000:]
        results["kdsync_run_rdma"] = {"members": g.n, "events": 450, "ready_s": round(ready_s, 1)}



@pytest.mark.timeout(420)
def test_mixed_group_one_member_without_rdma(addr, tmp_path):
    """dc3 runs `kind = "tcp"`: dc1 and dc2 talk RDMA to each other and serve dc3 over TCP."""
    with rdma_group(addr, tmp_path) as g:
        _start(g, {2: {"transport": {"kind": "tcp"}}})
        _write_all(g, 100, "m", rate=50)
        _agree(g, 300, timeout=180)
        for i, other in ((0, "dc2"), (1, "dc1")):
            assert rdma_links(g, i) == {other}, g.log_text(i)[-3000:]
            assert re.search(r'msg="peer dc3: using TCP because RDMA connect failed', g.log_text(i)), g.log_text(i)[-3000:]
            m = g.metrics(i)
            assert m[("kdsync_peer_path", (("path", "rdma"), ("peer", other)))] == 1.0
            assert m[("kdsync_peer_path", (("path", "tcp"), ("peer", "dc3")))] == 1.0
        assert 'msg="transport tcp listening' in g.log_text(2) and "transport rdma" not in g.log_text(2)


@pytest.fixture
def rxe0_deleted_later():
    """Hands the test a function that deletes rxe0 in the background; after
    the test (members gone: soft-RoCE's removal waits for every process
    holding the device) waits for the deletion and adds rxe0 back for the
    tests that follow."""
    procs: list[subprocess.Popen] = []

    def delete() -> None:
        procs.append(subprocess.Popen(["rdma", "link", "delete", "rxe0"]))

    yield delete
    for p in procs:
        p.wait(timeout=60)
    if procs:
        subprocess.run(["rdma", "link", "add", "rxe0", "type", "rxe", "netdev", "eth0"], check=True)
        deadline = time.monotonic() + 10
        while "ACTIVE" not in subprocess.run(["rdma", "link", "show", "rxe0/1"], capture_output=True, text=True).stdout:
            assert time.monotonic() < deadline, "rxe0 did not come back ACTIVE"
            time.sleep(0.1)


def _device_gone(g: LocalGroup, i: int) -> bool:
    m = g.metrics(i)
    return m.get(("kdsync_rdma_device_up", ())) == 0.0 and all(
        m.get(("kdsync_peer_path", (("path", "tcp"), ("peer", p)))) == 1.0 for p in g.names if p != g.names[i])


@pytest.mark.timeout(420)
def test_rdma_device_deleted_mid_stream_members_go_on_over_tcp(addr, tmp_path, rxe0_deleted_later):
    """`kind = "auto"` members ordering over RDMA lose the device mid-stream:
    one warning each, the metrics say TCP, and nothing is lost, duplicated or
    reordered in any cluster."""
    with rdma_group(addr, tmp_path, kind="auto") as g:
        _start(g)
        assert all(rdma_links(g, i) == set(g.names) - {g.names[i]} for i in range(g.n))

        def delete_device() -> None:
            rxe0_deleted_later()
            deadline = time.monotonic() + 60
            while not all(_device_gone(g, i) for i in range(g.n)):
                assert time.monotonic() < deadline, [g.metrics(i) for i in range(g.n)]
                time.sleep(0.2)

        _fault_mid_stream(g, 150, "d", delete_device)
        _write_all(g, 50, "after", rate=50)  # and after the loss, TCP only
        _agree(g, 600, timeout=240)
        for i in range(g.n):
            log = g.log_text(i)
            assert len(re.findall(r'msg="RDMA device rxe0 is gone', log)) == 1, log[-3000:]
            m = g.metrics(i)
            assert sum(v for (name, _), v in m.items() if name == "kdsync_rdma_fallbacks_total") >= 1, m
            assert g.procs[i].poll() is None
