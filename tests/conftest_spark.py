"""Shared fixtures of the Spark pipeline tests (imported by tests/test_spark_*,
test_audit*, test_archive*): one local[2] SparkSession per test process, and
helpers that build kdsync-shaped source and global topics with a plain
producer (no member runtime involved)."""

from __future__ import annotations

import atexit
from dataclasses import dataclass

import pytest

SPARK_CONF = {
    "spark.sql.shuffle.partitions": "4",
    "spark.default.parallelism": "4",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.driver.memory": "1g",
}

_session = None


def get_spark():
    """The one SparkSession of this test process (local[2]), built on first use."""
    global _session
    if _session is None:
        pytest.importorskip("pyspark")
        from kdsync.spark.session import spark_session

        _session = spark_session("local[2]", "kdsync-tests", SPARK_CONF)
        atexit.register(_session.stop)
    return _session


@pytest.fixture(scope="session")
def spark():
    return get_spark()


@dataclass
class Rec:
    """One source event as the tests build it."""

    origin: str
    partition: int
    offset: int
    ts: int
    key: bytes
    value: bytes

    @property
    def event_id(self) -> str:
        return f"{self.origin}/{self.partition}/{self.offset}"


def produce_sources(clusters, topic: str, per_cluster: int, partitions: int = 2) -> dict[str, list[Rec]]:
    """Write `per_cluster` records into `topic` of every cluster; return them
    with the offsets and timestamps the brokers gave (read back to EOF)."""
    from confluent_kafka import Producer

    from kdsync.kafka.topic import ensure_topic, read_partition

    out: dict[str, list[Rec]] = {}
    for c in clusters:
        ensure_topic(c.bootstrap, topic, partitions)
        p = Producer({"bootstrap.servers": c.bootstrap, "linger.ms": 5, "log_level": 3})
        for i in range(per_cluster):
            p.produce(topic, key=f"{c.name}-k{i}".encode(), value=f"{c.name}-v{i}".encode(), partition=i % partitions)
        assert p.flush(30) == 0
        recs = []
        for part in range(partitions):
            for m in read_partition(c.bootstrap, topic, part):
                recs.append(Rec(c.name, part, m.offset(), m.timestamp()[1], m.key(), m.value()))
        assert len(recs) == per_cluster
        out[c.name] = recs
    return out


def agreed_order(sources: dict[str, list[Rec]]) -> list[Rec]:
    """A total order of all source events that keeps each origin partition in
    offset order: round robin over (origin, partition) streams."""
    streams = {}
    for recs in sources.values():
        for r in sorted(recs, key=lambda r: (r.partition, r.offset)):
            streams.setdefault((r.origin, r.partition), []).append(r)
    order, keys = [], sorted(streams)
    while any(streams[k] for k in keys):
        for k in keys:
            if streams[k]:
                order.append(streams[k].pop(0))
    return order


def write_global(cluster, topic: str, order: list[Rec], seqs: list[int] | None = None,
                 deliver_delay_ms: int = 40) -> None:
    """Write `order` into `topic` (one partition) of `cluster` with the kdsync
    headers; record k gets kdsync.seq = seqs[k] (default k) and a timestamp
    `deliver_delay_ms` after its source timestamp."""
    from confluent_kafka import Producer

    from kdsync.kafka.records import global_headers
    from kdsync.kafka.topic import ensure_topic

    ensure_topic(cluster.bootstrap, topic, 1)
    p = Producer({"bootstrap.servers": cluster.bootstrap, "linger.ms": 5, "log_level": 3,
                  "max.in.flight.requests.per.connection": 1})
    for k, r in enumerate(order):
        seq = k if seqs is None else seqs[k]
        p.produce(topic, key=r.key, value=r.value, partition=0, timestamp=r.ts + deliver_delay_ms,
                  headers=global_headers(seq, r.origin, r.partition, r.offset, r.ts))
    assert p.flush(30) == 0
