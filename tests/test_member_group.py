"""`kdsync run` end to end: three embedded brokers and three member processes,
all real processes started here (Tansu unless $KDSYNC_TEST_BROKER says
noida; the first two tests run on both brokers whatever it says).  Every test checks the global topics offset
by offset (kdsync.testing.local.check_global_topics): same event at the same offset in
every cluster, seq == offset, no duplicate, nothing lost.
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import threading
import time

import pytest

from kdsync.testing.fault_proxy import FaultProxy
from kdsync.testing.local import LocalGroup, check_global_topics, read_global

from helpers import assert_agree, kill_9_mid_stream, member_logs, wait_until, write_all

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]


@pytest.fixture
def broker():
    """The embedded broker of `group`: None is LocalGroup's default
    ($KDSYNC_TEST_BROKER, else tansu); a test parametrizes it to run on both."""
    return None


@pytest.fixture
def group(tmp_path, request, broker):
    protocol = getattr(request, "param", "derecho")  # a test may ask for another protocol (indirect)
    g = LocalGroup(3, tmp_path, topic="events", protocol=protocol, metrics=True, tick_ms=5,
                   heartbeat_ms=20, suspect_ms=300, retransmit_ms=30, broker=broker,
                   extra={"metrics": {"kafka_stats_ms": 300}})
    try:
        g.start_brokers()
        yield g
    finally:
        g.close()


# the groups of this file agree within 40 s unless a test says otherwise
_assert_agree = functools.partial(assert_agree, timeout=40.0)


# (protocol, broker): both protocols on Tansu, derecho on noida as well
ON_BOTH_BROKERS = [("derecho", "tansu"), ("clock", "tansu"), ("derecho", "noida")]


@pytest.mark.parametrize("group,broker", ON_BOTH_BROKERS, indirect=["group"])
def test_concurrent_writes_identical_global_topics(group):
    g = group
    g.start_members()
    g.wait_ready()
    total = write_all(g, 400, "a")
    got = _assert_agree(g, total)
    # every event of every cluster is there once, with its key, value and origin headers
    keys = {r.key for r in got["dc1"]}
    assert keys == {f"a-{n}-{i}".encode() for n in g.names for i in range(400)}
    origins = {r.origin for r in got["dc2"]}
    assert origins == set(g.names)
    # origin order: offsets of each origin partition increase along the global order
    for name in g.names:
        offs = [r.origin_offset for r in got["dc3"] if r.origin == name]
        assert offs == sorted(offs) == list(range(400))
    # metrics: positions, view, bytes per peer, latency histogram
    m = g.metrics(0)
    assert m[("kdsync_delivered_position", (("topic", "events"),))] == total
    assert m[("kdsync_live_members", (("topic", "events"),))] == 3
    assert m[("kdsync_peer_bytes_total", (("direction", "out"), ("peer", "dc2")))] > 0
    assert m[("kdsync_e2e_latency_seconds_count", (("topic", "events"),))] == total
    assert m[("kdsync_core_events_total", (("kind", "delivered"), ("topic", "events")))] == total
    assert m[("kdsync_core_events_total", (("kind", "deduplicated"), ("topic", "events")))] == 0
    assert ("kdsync_core_events_total", (("kind", "resubmitted"), ("topic", "events"))) in m
    assert m[("kdsync_view_id", (("topic", "events"),))] >= 1
    # a TCP member's links: path "tcp" for every peer, no RDMA gauges
    assert {(k[1], v) for k, v in m.items() if k[0] == "kdsync_peer_path" and v == 1} == {
        ((("path", "tcp"), ("peer", p)), 1.0) for p in ("dc2", "dc3")}
    assert not any(k[0].startswith("kdsync_rdma_") for k in m)
    # the Kafka requests of its clients, by type (librdkafka statistics every 300 ms)
    req = "kdsync_kafka_requests_total"
    wait_until(lambda: g.metrics(0).get((req, (("client", "producer"), ("request", "Produce"))), 0) > 0
               and g.metrics(0).get((req, (("client", "consumer"), ("request", "Fetch"))), 0) > 0, 10,
               "dc1's Produce and Fetch requests to be counted")


@pytest.mark.parametrize("group,broker", ON_BOTH_BROKERS, indirect=["group"])
def test_kill_9_mid_stream_then_restart(group):
    g = group
    g.start_members()
    g.wait_ready()
    writers = kill_9_mid_stream(g, 1, 600, "k", 300.0, seen=150, timeout=20)
    time.sleep(0.5)  # let the survivors notice the crash (suspect_ms=300) while writes go on
    g.start_member(1)
    writers.join()
    _assert_agree(g, 1800, timeout=60)


@pytest.mark.parametrize("group", ["clock"], indirect=True)
def test_coalesced_wakes_keep_one_order_through_a_kill_9(group):
    """[member] coalesce_us (kdsync.eventloop): the loop rests up to 5 ms
    before it looks at input again; a member killed mid-stream and restarted
    still leaves every cluster identical, each event once."""
    g = group
    g.extra = {**g.extra, "member": {"coalesce_us": 5000}}
    g.start_members()
    g.wait_ready()
    assert all("loop wake-ups coalesced" in g.log_text(i) for i in range(3)), member_logs(g)
    writers = kill_9_mid_stream(g, 2, 400, "c", 300.0, seen=100, timeout=20)
    g.start_member(2)
    writers.join()
    _assert_agree(g, 1200, timeout=60)


def test_isolated_member_delivers_nothing_then_catches_up(tmp_path):
    proxies: dict[tuple[int, int], FaultProxy] = {}
    g = LocalGroup(3, tmp_path, topic="events", metrics=True, tick_ms=5, heartbeat_ms=20, suspect_ms=300,
                   peer_address=lambda i, j: f"127.0.0.1:{proxies[(i, j)].port}")
    try:
        for i in range(3):
            for j in range(3):
                if i != j:
                    proxies[(i, j)] = FaultProxy(("127.0.0.1", g.ports[j])).start()  # cut() resets, heal() forwards
        g.start_brokers()
        g.start_members()
        g.wait_ready()
        _assert_agree(g, write_all(g, 100, "before"))
        for (i, j), p in proxies.items():  # isolate dc3
            if 2 in (i, j):
                p.cut()
        wait_until(lambda: not g.is_active(2), 10, "dc3 to notice it is cut off")
        write_all(g, 100, "during")
        got = g.wait_for(500, 30, members=[0, 1])
        ok, detail = check_global_topics(got, expected=500)  # dc1, dc2: their own 200 plus dc3's 100 written before
        assert ok, detail + member_logs(g)
        # the isolated member wrote nothing new: still the 300 ordered before the cut
        time.sleep(0.5)
        assert len(read_global(g.bootstrap(2), g.global_topic)) == 300
        for p in proxies.values():
            p.heal()
        _assert_agree(g, 600, timeout=60)
    finally:
        g.close()
        for p in proxies.values():
            p.close()


def test_broker_paused_nothing_lost(group):
    g = group
    g.start_members()
    g.wait_ready()
    writers = threading.Thread(target=write_all, args=(g, 300, "p", 150.0, [0, 1]))
    writers.start()
    time.sleep(0.5)
    g.clusters[2].pause()
    try:
        time.sleep(4)
    finally:
        g.clusters[2].resume()
    writers.join()
    write_all(g, 100, "after")
    _assert_agree(g, 900, timeout=60)
    assert all(p.poll() is None for p in g.procs), member_logs(g)
    # librdkafka's own lines come through the members' log format, never raw (%3|...)
    for i in range(g.n):
        assert not [x for x in g.log_text(i).splitlines() if x.startswith("%")], member_logs(g)


def test_wrong_secret_refused_and_garbage_ignored(group):
    import asyncio

    from kdsync.transport import make_transport

    g = group
    g.start_members()
    g.wait_ready()

    async def impostor():
        t = make_transport("tcp", "dc2", ("127.0.0.1", 0), {"dc1": ("127.0.0.1", g.ports[0]), "dc2": ("127.0.0.1", 0)},
                           lambda p, d: None, secret=b"wrong secret")
        await t.start()
        try:
            for _ in range(50):
                t.send("dc1", b"\x06events" + os.urandom(20))
                await asyncio.sleep(0.02)
        finally:
            await t.close()

    asyncio.run(impostor())
    refused = ("kdsync_peer_refused_total", (("peer", "dc2"), ("reason", "secret")))
    wait_until(lambda: g.metrics(0).get(refused, 0) >= 1, 10, "dc1 to count the refused impostor")
    for _ in range(20):  # garbage on the member port
        with socket.create_connection(("127.0.0.1", g.ports[0])) as s:
            s.sendall(os.urandom(512))
    with socket.create_connection(("127.0.0.1", g.ports[1])) as s:
        s.sendall(b"\x00" * 100_000)
    _assert_agree(g, write_all(g, 200, "g"))
    assert all(g.is_active(i) for i in range(3))
    assert "refused" in g.log_text(0).lower() or "handshake" in g.log_text(0).lower()


def test_sigterm_clean_stop_and_restart(group):
    g = group
    g.start_members()
    g.wait_ready()
    _assert_agree(g, write_all(g, 200, "s1"))
    g.signal_member(0, signal.SIGTERM)
    assert g.wait_member(0, timeout=30) == 0, member_logs(g)
    assert "member stopped" in g.log_text(0)
    g.start_member(0)
    g.wait_ready(members=[0], timeout=30)
    _assert_agree(g, 600 + write_all(g, 100, "s2"))


def test_a_stop_stuck_on_a_paused_broker_ends_within_stop_timeout(group):
    """SIGTERM while the member's broker answers nothing (SIGSTOP): every
    step of the clean stop waits for that broker (about 25 s measured), so
    with `[member] stop_timeout_ms = 3000` the member must give up at 3 s:
    exit 1, one line naming the step it was stuck in, every thread's stack
    in its log (kdsync.stopping).  Then the broker resumes, the member
    restarts and nothing is lost or written twice."""
    g = group
    g.extra = {**g.extra, "member": {"stop_timeout_ms": 3000}}
    g.start_members()
    g.wait_ready()
    _assert_agree(g, write_all(g, 150, "s1"))
    g.clusters[2].pause()
    try:
        t0 = time.monotonic()
        g.signal_member(2, signal.SIGTERM)
        rc = g.wait_member(2, timeout=30)
        took = time.monotonic() - t0
    finally:
        g.clusters[2].resume()
    text = g.log_text(2)
    assert rc == 1, member_logs(g)
    assert took < 15, f"the stop took {took:.1f} s with stop_timeout_ms = 3000"
    assert "kdsync run: the stop did not finish within 3 s (stuck in: " in text, member_logs(g)
    assert 'msg="stop did not finish"' in text and "Thread 0x" in text  # its log line, then every stack
    g.start_member(2)
    g.wait_ready(members=[2], timeout=60)
    _assert_agree(g, 450 + write_all(g, 100, "s2"), timeout=90)


def _openssl(*args, cwd):
    import subprocess

    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.mark.skipif(__import__("shutil").which("openssl") is None, reason="needs the openssl command")
def test_members_over_mutual_tls(tmp_path):
    """Certificates from the config (relative paths), a CA for mutual TLS;
    a member whose certificate is not signed by the CA is kept out."""
    pki = tmp_path / "pki"
    pki.mkdir()
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=kdsync-test-ca", cwd=pki)
    for name in ("dc1", "dc2", "dc3", "rogue"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=pki)
        if name == "rogue":  # self-signed: not from our CA
            _openssl("x509", "-req", "-in", f"{name}.csr", "-signkey", f"{name}.key", "-out", f"{name}.pem",
                     "-days", "2", cwd=pki)
        else:
            _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                     "-out", f"{name}.pem", "-days", "2", cwd=pki)
    g = LocalGroup(3, tmp_path, topic="events", metrics=True, tick_ms=5, suspect_ms=300)
    try:
        g.start_brokers()

        def tls(cert):
            return {"tls": {"certfile": f"pki/{cert}.pem", "keyfile": f"pki/{cert}.key", "cafile": "pki/ca.pem"}}

        for i, name in enumerate(g.names):
            g.start_member(i, transport=tls(name))
        g.wait_ready()
        _assert_agree(g, write_all(g, 100, "tls"))
        assert "with TLS" in g.log_text(0)
        # dc3 restarts with a certificate the CA did not sign: the others refuse it
        g.stop_member(2)
        g.start_member(2, transport=tls("rogue"))
        time.sleep(2)
        assert not g.is_active(2)
        write_all(g, 50, "tls2", idx=[0, 1])
        got = g.wait_for(400, 30, members=[0, 1])
        ok, detail = check_global_topics(got, expected=400)
        assert ok, detail + member_logs(g)
        assert len(read_global(g.bootstrap(2), g.global_topic)) == 300
    finally:
        g.close()
