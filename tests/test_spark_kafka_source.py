"""The kdsync-kafka Spark data source against a real broker (Tansu, or noida
with KDSYNC_TEST_BROKER=noida), and its range planning as a pure function."""

from __future__ import annotations

import time

import pytest
from conftest_spark import get_spark

from kdsync.spark.kafka_source import plan_ranges


def test_plan_ranges_last_range_is_open_to_eof():
    # the broker claims high=10 but may hold more: the last range has no end
    r = plan_ranges("t", {0: (0, 10), 1: (5, 5)}, {}, {}, max_records=4)
    assert [(x.partition, x.start, x.end) for x in r] == [(0, 0, 4), (0, 4, 8), (0, 8, None), (1, 5, None)]


def test_plan_ranges_starting_and_ending_offsets():
    r = plan_ranges("t", {0: (2, 100), 1: (0, 7)}, {0: 50, 1: 0}, {1: 7}, max_records=30)
    assert [(x.partition, x.start, x.end) for x in r] == [(0, 50, 80), (0, 80, None), (1, 0, 7)]
    # a checkpoint below the low watermark (retention) starts at the low watermark
    r = plan_ranges("t", {0: (40, 60)}, {0: 10}, {}, max_records=100)
    assert [(x.start, x.end) for x in r] == [(40, None)]


@pytest.fixture(scope="module")
def two_clusters():
    from kdsync.kafka.embedded import embedded_clusters
    from kdsync.testing.local import default_broker

    with embedded_clusters(2, names=["a", "b"], broker=default_broker()) as cs:
        yield cs


# source timestamps of the records: a minute ago, well inside the default 7-day
# retention (a broker that enforces it, as Kafka and noida do, would delete
# records stamped in 1970 at once)
T0 = int(time.time() * 1000) - 60_000


def _produce(cluster, topic, n, partitions):
    from confluent_kafka import Producer

    from kdsync.kafka.topic import ensure_topic

    ensure_topic(cluster.bootstrap, topic, partitions)
    # linger makes multi-record batches: Tansu then under-reports the high watermark
    p = Producer({"bootstrap.servers": cluster.bootstrap, "linger.ms": 50, "batch.num.messages": 1000,
                  "log_level": 3})
    for i in range(n):
        p.produce(topic, key=b"k%d" % i, value=b"v%d" % i, partition=i % partitions,
                  headers=[("i", str(i).encode()), ("nil", None)], timestamp=T0 + i)
    assert p.flush(30) == 0


@pytest.mark.timeout(300)
def test_reads_every_record_in_parallel_ranges(two_clusters):
    from confluent_kafka import Consumer, TopicPartition

    from kdsync.spark.kafka_source import read_topic

    a, b = two_clusters
    _produce(a, "src", 600, 2)
    _produce(b, "src", 90, 3)
    c = Consumer({"bootstrap.servers": a.bootstrap, "group.id": "probe", "log_level": 0})
    highs = [c.get_watermark_offsets(TopicPartition("src", p), timeout=10, cached=False)[1] for p in range(2)]
    c.close()
    spark = get_spark()
    df = read_topic(spark, {}, ["src", "absent"], clusters={"a": a.bootstrap, "b": b.bootstrap},
                    maxRecordsPerRange=70)
    rows = df.select("cluster", "partition", "offset", "key", "value", "headers", "timestamp").collect()
    assert len(rows) == 690
    got_a = sorted((r["partition"], r["offset"]) for r in rows if r["cluster"] == "a")
    assert got_a == sorted((p, o) for p in range(2) for o in range(300))
    # whatever the broker reported as the end, reading to EOF found everything
    assert sum(highs) <= 600
    one = next(r for r in rows if r["cluster"] == "a" and r["partition"] == 1 and r["offset"] == 0)
    assert (one["key"], one["value"], one["timestamp"]) == (b"k1", b"v1", T0 + 1)
    assert [(h["key"], h["value"]) for h in one["headers"]] == [("i", b"1"), ("nil", None)]
    assert sorted({r["partition"] for r in rows if r["cluster"] == "b"}) == [0, 1, 2]
    # one Spark task per planned range: cluster a cut by what its broker reported
    # (Tansu's under-reported highs included), one open range per partition of b
    planned = plan_ranges("src", {p: (0, highs[p]) for p in range(2)}, {}, {}, 70)
    assert df.rdd.getNumPartitions() == len(planned) + 3


@pytest.mark.timeout(300)
def test_offset_options_and_missing_topic(two_clusters):
    from kdsync.spark.kafka_source import read_topic

    a, _ = two_clusters
    _produce(a, "win", 50, 1)
    spark = get_spark()
    df = read_topic(spark, a.bootstrap, "win", startingOffsets={"0": 10}, endingOffsets={"0": 20})
    assert sorted(r["offset"] for r in df.select("offset").collect()) == list(range(10, 20))
    assert read_topic(spark, a.bootstrap, "no-such-topic").count() == 0
