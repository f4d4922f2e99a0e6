"""Log recovery of durable embedded brokers (kdsync.kafka.tansu_recovery).

A Tansu broker on S3 killed in the middle of a produce leaves its producer
sequence and high watermark ahead of the last stored batch.  The test makes
exactly that state on a real broker's objects (it advances both, as a produce
cut short after its first two steps does), restarts the broker through
EmbeddedCluster.start — which runs the recovery — and checks that the hole
is gone: a reader reaches the end, new records continue at the next offset,
and the same idempotent producer's next batch is accepted, not refused as
out of order or acknowledged as a duplicate without being stored.
"""

import json

import pytest
from confluent_kafka import Producer

from kdsync.kafka.embedded import bucket_name, embedded_clusters
from kdsync.kafka.topic import ensure_topic, iter_partition

pytestmark = pytest.mark.timeout(120)


def _produce(bootstrap, n, start, p=None):
    p = p or Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 0})
    for i in range(start, start + n):
        p.produce("t", value=b"%d" % i, partition=0)
        p.flush(30)
    return p


def test_a_produce_cut_short_leaves_no_hole_after_recovery():
    with embedded_clusters(1, durable=True) as (c,):
        ensure_topic(c.bootstrap, "t", 1)
        _produce(c.bootstrap, 10, 0)
        c.kill()
        s3, b, root = c.store.client(), bucket_name(c.name), f"clusters/kdsync-{c.name}/"
        wm_key = root + "topics/t/partitions/0000000000/watermark.json"
        wm = json.loads(s3.get_object(Bucket=b, Key=wm_key)["Body"].read())
        meta = json.loads(s3.get_object(Bucket=b, Key=root + "meta.json")["Body"].read())
        assert wm["high"] == 10
        (pid, detail), = meta["producers"].items()
        (epoch, seqs), = detail["sequences"].items()
        assert seqs["t"]["0"] == 10
        seqs["t"]["0"] = 13  # the sequence step of a produce of 3 records...
        wm["high"] = 13  # ...and its watermark step; the batch object was never written
        s3.put_object(Bucket=b, Key=root + "meta.json", Body=json.dumps(meta).encode())
        s3.put_object(Bucket=b, Key=wm_key, Body=json.dumps(wm).encode())
        c.start()
        assert len(c.recoveries) == 2, c.recoveries
        assert "high watermark 13 -> 10" in c.recoveries[0] or "high watermark 13 -> 10" in c.recoveries[1]
        assert any("sequence 13 -> 10" in r for r in c.recoveries)
        _produce(c.bootstrap, 5, 10)
        got = [(m.offset(), int(m.value())) for m in iter_partition(c.bootstrap, "t", 0, timeout=30)]
        assert got == [(i, i) for i in range(15)]  # no hole, nothing lost


def test_recovery_of_a_consistent_log_changes_nothing():
    with embedded_clusters(1, durable=True) as (c,):
        ensure_topic(c.bootstrap, "t", 2)
        _produce(c.bootstrap, 20, 0)
        c.kill()
        c.start()
        assert c.recoveries == []
        got = [int(m.value()) for m in iter_partition(c.bootstrap, "t", 0, timeout=30)]
        assert got == list(range(20))


def test_a_broker_restarted_on_its_data_does_not_call_a_written_topic_empty():
    """A member starts without reading a topic that never held a record
    (kdsync.kafka.topic.empty_topics, issue 26): a durable broker killed
    and restarted on its S3 data must still report a written partition's
    end above 0, whether it holds one multi-record batch or single records."""
    from kdsync.kafka.topic import empty_topics

    with embedded_clusters(1, durable=True) as (c,):
        for t in ("batch", "single", "empty"):
            ensure_topic(c.bootstrap, t, 2)
        p = Producer({"bootstrap.servers": c.bootstrap, "linger.ms": 50})
        for _ in range(5):
            p.produce("batch", value=b"x", partition=1)
        assert p.flush(30) == 0
        p.produce("single", value=b"y", partition=0)
        assert p.flush(30) == 0
        parts = {"batch": 2, "single": 2, "empty": 2}
        assert empty_topics(c.bootstrap, parts, timeout=30) == {"empty"}
        c.kill()
        c.start()
        assert empty_topics(c.bootstrap, parts, timeout=30) == {"empty"}
