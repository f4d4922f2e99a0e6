"""Durable clusters under whole-data-centre faults, with real processes.

Every cluster is a Tansu broker keeping its log in its own bucket of one S3
store (moto's server: `LocalGroup(durable=True)`), so a broker killed with
SIGKILL comes back with its data on the same port.  The faults: a broker
killed mid-stream while its member stays up; a data-centre outage (broker and
member of one cluster killed together for 30 s while the other clusters keep
taking writes, then both restarted on the same data); and a crash of every
broker and every member at once, then a restart of all.  Writers are paced
idempotent producers that retry until acknowledged, so every event is
acknowledged; afterwards every global topic must be identical, every event in
it exactly once, each origin partition in order (`check_global_topics`).
"""

from __future__ import annotations

import signal
import time

import pytest

from kdsync.testing import local
from kdsync.testing.local import DURABLE_LINGER_MS, LocalGroup, check_global_topics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

RATE = 60.0  # events/s per cluster: durable Tansu on moto is slow, and the box has 2 cores


def _logs(g: LocalGroup) -> str:
    """Each member's warnings and errors, then its last lines (a failure's
    output is cut in the middle by CI: what a member said last comes first)."""
    out = []
    for i, n in enumerate(g.names):
        lines = g.log_text(i).splitlines()
        loud = [x for x in lines if "level=warning" in x or "level=error" in x][-15:]
        exited = "" if g.procs[i] is None or g.procs[i].poll() is None else f" (exited {g.procs[i].poll()})"
        out.append(f"--- {n}{exited}: warnings and errors\n" + "\n".join(loud) + f"\n--- {n}: last lines\n"
                   + "\n".join(lines[-25:]))
    return "\n".join(out)


class Writers(local.Writers):
    """kdsync.testing.local.Writers at RATE on durable clusters; join() fails on any writer error."""

    def __init__(self, g: LocalGroup, n: int, tag: str, rate: float = RATE):
        super().__init__(g, n, tag, rate, linger_ms=DURABLE_LINGER_MS, timeout=300)

    def join(self) -> int:
        acked = super().join(400)
        assert not self.errors, self.errors
        return acked


def _wait_written(g: LocalGroup, i: int, n: int, timeout: float = 90.0) -> None:
    """Until cluster i's global topic holds at least n records."""
    got = g.wait_for(n, timeout, members=[i], poll=0.2)
    assert len(got[g.names[i]]) >= n, f"{g.names[i]} holds {len(got[g.names[i]])} < {n}\n" + _logs(g)


def _assert_agree(g: LocalGroup, acked: int, timeout: float = 240.0):
    """Every acknowledged event in its source topic (the brokers lost none:
    kdsync.kafka.tansu_recovery repairs a produce cut short by a crash), every
    global topic identical, every source record in it exactly once, in origin
    order."""
    src = g.read_sources()
    present = sum(len(v) for v in src.values())
    assert present == acked, f"{present} source records for {acked} acknowledged writes\n" + _logs(g)
    got = g.wait_for(present, timeout, poll=0.5)
    ok, detail = check_global_topics(got, expected=present)
    assert ok, detail + "\n" + _logs(g)
    keys = {k for v in src.values() for (_, _, k) in v}
    assert {r.key for r in got[g.names[0]]} == keys, "the global topics do not hold exactly the source records"
    return got


@pytest.fixture
def durable(tmp_path):
    # expect_stalls: Tansu on the S3 store may hand over no source records for 10 s and more on a busy box
    # (CI's neighbours: the member asks again with new clients and longer fetch waits, "stall over" after 11 s);
    # a stall of the member's own stages (ordering, produce, delivery report) still fails the test
    g = LocalGroup(3, tmp_path, durable=True, metrics=True, source_partitions=2, tick_ms=20, heartbeat_ms=60,
                   suspect_ms=1000, retransmit_ms=100, expect_stalls=("fetch",))
    try:
        g.start_brokers()
        g.start_members()
        g.wait_ready(60)
        yield g
    finally:
        g.close()


def test_broker_killed_mid_stream_while_its_member_stays_up(durable):
    g = durable
    # dc2's writes and its source reads wait for its broker: with its restart on a busy box longer
    # than stall_after_ms, dc2 says "stalled" in the stages that need that broker ("delivery report",
    # "fetch": its consumer holds the last high watermark while the broker is away) — no other stage,
    # and no other member
    g.expect_stalls = True
    w = Writers(g, 900, "bk")
    _wait_written(g, 1, 300)
    g.clusters[1].kill()  # SIGKILL: the log stays in the S3 store
    assert g.procs[1].poll() is None
    time.sleep(3)  # the outage itself: writes into dc2 wait in their producer, dc1/dc3 go on
    g.clusters[1].start()
    total = w.join()
    _assert_agree(g, total)
    assert g.procs[1].poll() is None, "dc2's member must ride out its broker's crash\n" + _logs(g)
    own_broker = ('stage="delivery report"', "stage=fetch ")
    other = [x for x in g.stalls() if not (x.startswith("dc2:") and any(s in x for s in own_broker))]
    assert not other, other


def test_data_centre_outage_broker_and_member_killed_together_for_30_s(durable):
    g = durable
    w = Writers(g, 3600, "dc")
    _wait_written(g, 2, 600)
    g.signal_member(2, signal.SIGKILL)
    g.clusters[2].kill()
    g.wait_member(2)
    down = time.monotonic()
    before = len(g.wait_for(0, 5, members=[0])["dc1"])
    # the outage: dc1 and dc2 keep taking writes and keep ordering (a majority)
    _wait_written(g, 0, before + 500, timeout=28)
    time.sleep(max(0.0, 30 - (time.monotonic() - down)))  # the rest of the 30 s outage
    g.clusters[2].start()
    g.start_member(2)
    total = w.join()
    _assert_agree(g, total)


def test_every_broker_and_member_crash_and_restart_on_their_data(durable):
    g = durable
    first = Writers(g, 300, "w1").join()
    _assert_agree(g, first)
    for i in range(g.n):  # everything at once: a total outage
        g.signal_member(i, signal.SIGKILL)
        g.clusters[i].kill()
    for i in range(g.n):
        g.wait_member(i)
    for i in range(g.n):
        g.clusters[i].start()
    g.start_members()
    g.wait_ready(90)
    got = g.wait_for(first, 60, poll=0.5)
    assert all(len(v) == first for v in got.values()), "the restarted clusters lost records\n" + _logs(g)
    second = Writers(g, 300, "w2").join()
    _assert_agree(g, first + second)


def test_a_broker_that_forgot_the_producer_state_is_met_with_a_new_producer(durable):
    """A broker that comes back without the idempotent producer's state (here:
    its sequence for the global topic reset to 0 while the member is frozen)
    answers the member's next batch with OUT_OF_ORDER_SEQUENCE_NUMBER, fatal to
    a confluent-kafka producer.  The member must re-create its producer in
    place, read the global topic's tail back and write only what is missing:
    it stays up, counts one recovery, and every topic ends identical."""
    g = durable
    w = Writers(g, 300, "ps")
    _wait_written(g, 1, 200)
    g.signal_member(1, signal.SIGSTOP)
    try:
        _forget_producer_state(g.clusters[1], g.global_topic)
    finally:
        g.signal_member(1, signal.SIGCONT)
    # written after the reset, so that dc2's member writes to the broker that forgot
    # (the first writes may all be in its global topic already on a busy machine)
    total = w.join() + Writers(g, 300, "ps2").join()
    _assert_agree(g, total)
    assert g.procs[1].poll() is None, "dc2's member must recover its producer in place\n" + _logs(g)
    m = g.metrics(1)
    assert m.get(("kdsync_producer_recoveries_total", ())) >= 1, _logs(g)
    assert "producer failed; re-creating it" in g.log_text(1)


def _forget_producer_state(c, topic: str) -> None:
    """Restart durable broker `c` with every idempotent producer's sequence
    for `topic` reset to 0 (a broker that lost its producer state)."""
    import json

    from kdsync.kafka.embedded import bucket_name

    c.kill()  # down while its state is changed (a running broker would write meta.json over it)
    s3, b, key = c.store.client(), bucket_name(c.name), f"clusters/kdsync-{c.name}/meta.json"
    meta = json.loads(s3.get_object(Bucket=b, Key=key)["Body"].read())
    reset = 0
    for detail in meta["producers"].values():
        for topics in detail["sequences"].values():
            for part in topics.get(topic, {}):
                topics[topic][part] = 0
                reset += 1
    assert reset, meta
    s3.put_object(Bucket=b, Key=key, Body=json.dumps(meta).encode())
    c.start()  # the broker comes back reading the forgotten state


def test_the_harness_writer_replaces_a_fatal_producer_without_writing_twice(tmp_path, caplog):
    """The tests' application writer (kdsync.testing.local.write_events) meets
    the same fatal error as the member above; it reads its topic back and
    writes only what is missing: every key once."""
    from kdsync.kafka.embedded import embedded_clusters
    from kdsync.kafka.topic import ensure_topic, iter_partition
    from kdsync.testing.local import _RecoveringWriter

    with embedded_clusters(1, log_dir=tmp_path, durable=True) as (c,):
        ensure_topic(c.bootstrap, "app", 2)
        w = _RecoveringWriter(c.bootstrap, "app", "w", linger_ms=5, timeout=60)
        for i in range(100):
            w.produce(i)
        assert w.p.flush(60) == 0
        _forget_producer_state(c, "app")
        for i in range(100, 200):
            w.produce(i)
        assert w.finish() == 200
        assert w.gen > 1, "the broker's forgotten state did not fail the producer"
        assert "producer failed" in caplog.text
        keys = [m.key() for p in range(2) for m in iter_partition(c.bootstrap, "app", p, timeout=30, idle=True)]
        assert sorted(keys) == sorted(f"w-{i}".encode() for i in range(200))
