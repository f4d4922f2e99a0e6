"""What docs/brokers.md says about the two embedded brokers, checked on real
processes: how each answers an idle fetch, aborted transactions read
`read_committed`, retention of old records on noida, and a kdsync group on
noida given committed and aborted transactions in every cluster.

If a broker release changes one of these, the test fails and docs/brokers.md
is due an update (as tests/test_embedded.py does for Tansu's ListOffsets)."""

from __future__ import annotations

import json
import time

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from kdsync.kafka.embedded import EmbeddedCluster
from kdsync.kafka.topic import ensure_topic, read_partition
from kdsync.testing.local import LocalGroup, check_global_topics

from helpers import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _idle_fetches_per_s(bootstrap: str, wait_ms: int) -> float:
    """Fetch requests a second of one consumer on an empty partition (librdkafka's statistics)."""
    stats: list[dict] = []
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "idle", "fetch.wait.max.ms": wait_ms,
                  "statistics.interval.ms": 500, "stats_cb": lambda s: stats.append(json.loads(s))})
    try:
        c.assign([TopicPartition("empty", 0, 0)])
        deadline = time.monotonic() + 20
        while len(stats) < 5 and time.monotonic() < deadline:  # 2 s of statistics after the first
            c.poll(0.1)
    finally:
        c.close()
    assert len(stats) >= 5, "no librdkafka statistics"

    def fetches(s):
        return sum(b["req"].get("Fetch", 0) for b in s["brokers"].values())

    return (fetches(stats[-1]) - fetches(stats[0])) / ((stats[-1]["ts"] - stats[0]["ts"]) / 1e6)


@pytest.mark.parametrize("broker", ["tansu", "noida"])
def test_an_idle_fetch_waits_on_tansu_and_comes_back_at_once_on_noida(tmp_path, broker):
    with EmbeddedCluster("idle", broker=broker, log_dir=tmp_path) as c:
        ensure_topic(c.bootstrap, "empty")
        rate = _idle_fetches_per_s(c.bootstrap, 500)
    if broker == "tansu":
        assert rate < 10, rate  # one fetch per 500 ms wait
    else:
        assert rate > 1000, rate  # the wait is ignored: the client asks again at once


@pytest.mark.parametrize("broker", ["tansu", "noida"])
def test_aborted_records_read_committed(tmp_path, broker):
    """Tansu 0.6 returns aborted records to a read_committed consumer; noida hides them, as Kafka does."""
    with EmbeddedCluster("tx", broker=broker, log_dir=tmp_path) as c:
        ensure_topic(c.bootstrap, "t")
        p = Producer({"bootstrap.servers": c.bootstrap, "transactional.id": "tx1"})
        p.init_transactions(10)
        for kind in ("commit", "abort", "commit"):
            p.begin_transaction()
            for _ in range(5):
                p.produce("t", value=kind.encode())
            assert p.flush(10) == 0  # in the log before the abort (else librdkafka drops them unsent)
            p.commit_transaction(10) if kind == "commit" else p.abort_transaction(10)
        committed = [m.value() for m in read_partition({"bootstrap.servers": c.bootstrap,
                                                        "isolation.level": "read_committed"}, "t")]
        everything = [m.value() for m in read_partition({"bootstrap.servers": c.bootstrap,
                                                         "isolation.level": "read_uncommitted"}, "t")]
    assert committed.count(b"commit") == 10 and everything.count(b"abort") == 5
    assert committed.count(b"abort") == (5 if broker == "tansu" else 0)


def test_noida_deletes_records_older_than_the_retention(tmp_path):
    """Records stamped in 1970 under the default 7-day retention are gone
    within seconds on noida (so tests stamp their records with recent times)."""
    with EmbeddedCluster("old", broker="noida", log_dir=tmp_path) as c:
        ensure_topic(c.bootstrap, "t")
        p = Producer({"bootstrap.servers": c.bootstrap, "linger.ms": 20})
        for i in range(50):
            p.produce("t", value=b"x", timestamp=1_000_000 + i)
        assert p.flush(10) == 0
        assert len(read_partition(c.bootstrap, "t")) == 50
        wait_until(lambda: not read_partition(c.bootstrap, "t", timeout=5), 60, "noida's retention", poll=0.5)


def test_a_group_on_noida_orders_committed_transactions_and_never_an_aborted_one(tmp_path):
    """Every cluster gets a committed, an aborted and a committed transaction
    of 5 records: every global topic holds the 30 committed records, the same
    at the same offsets, none aborted; each member accounted one control and
    one aborted gap in its source partition."""
    with LocalGroup(3, tmp_path, broker="noida", metrics=True) as g:
        g.start_brokers()
        g.start_members()
        g.wait_ready(60)
        for i in g.data:
            p = Producer({"bootstrap.servers": g.bootstrap(i), "transactional.id": f"tx-{g.names[i]}"})
            p.init_transactions(10)
            for t, kind in enumerate(("commit", "abort", "commit")):
                p.begin_transaction()
                for j in range(5):
                    p.produce(g.topic, key=f"{g.names[i]}-{t}-{j}".encode(), value=kind.encode())
                assert p.flush(10) == 0
                p.commit_transaction(10) if kind == "commit" else p.abort_transaction(10)
        # each origin's aborted records sit between its two committed
        # transactions: copied, they would be among the first 30 (origin order)
        got = g.wait_for(30, 60)
        ok, detail = check_global_topics(got, expected=30)
        assert ok, detail
        assert all(r.value == b"commit" for v in got.values() for r in v)

        def gaps(i):
            m = g.metrics(i)
            return {k: m.get(("kdsync_source_gaps_total", (("kind", k),)), 0) for k in ("aborted", "refetched")}

        # the aborted records' offsets were accounted as aborted, none re-fetched as missing
        wait_until(lambda: all(gaps(i)["aborted"] >= 1 and gaps(i)["refetched"] == 0 for i in g.data), 10,
                   "each member to account the aborted records' gap")
