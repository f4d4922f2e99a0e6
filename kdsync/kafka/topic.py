"""Small, synchronous topic helpers shared by the member, the demo and tests.

The tail of a partition is found by reading to partition EOF, never by
ListOffsets alone (Tansu reports the high watermark too low after
multi-record batches; on Kafka with transactions control records take offsets).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

__all__ = ["PartitionEndError", "admin_conf", "consumer", "ensure_topic", "iter_partition", "partition_count",
           "read_partition", "read_to_eof"]


def consumer(bootstrap_or_conf: str | dict) -> Consumer:
    """A consumer for reads to partition EOF (no commits, EOF events on); returns it."""
    conf = {"bootstrap.servers": bootstrap_or_conf} if isinstance(bootstrap_or_conf, str) else dict(bootstrap_or_conf)
    conf.update({
        "group.id": conf.get("group.id", "kdsync-reader"),
        "enable.auto.commit": False,
        "enable.partition.eof": True,
        "auto.offset.reset": "earliest",
        "log_level": conf.get("log_level", 3),
        "fetch.wait.max.ms": conf.get("fetch.wait.max.ms", 10),  # EOF comes after an empty fetch
    })
    return Consumer(conf)


class PartitionEndError(ValueError):
    """A partition ends (partition EOF) before the offset a strict read asked for."""


def read_to_eof(c: Consumer, topic: str, partition: int = 0, start: int = 0, stop: int | None = None, *,
                timeout: float = 30.0, idle: bool = False, strict: bool = False, batch: int = 1000,
                poll: float = 0.2) -> Iterator[Message]:
    """Assign consumer `c` (created with enable.partition.eof) to
    `topic[partition]` at offset `start` and yield its records until partition
    EOF or offset `stop` (exclusive); unassign when done or abandoned.

    The one read-to-EOF loop of kdsync: every reader of a topic's tail uses it.
    `timeout`: seconds to reach EOF or `stop`, counted from the start, or, with
    `idle`, from the last record received.  Raises TimeoutError when it passes.
    Lenient (default): a missing topic or partition reads as empty, transient
    errors are retried, fatal ones raise KafkaException.  `strict` (the range
    must exist): every non-retriable error raises KafkaException, and an EOF
    before `stop` raises PartitionEndError.
    """
    c.assign([TopicPartition(topic, partition, max(start, 0))])  # out of range -> earliest
    try:
        deadline = time.monotonic() + timeout
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no end of {topic}[{partition}] within {timeout}s")
            for m in c.consume(batch, timeout=poll):
                err = m.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        if strict and stop is not None and m.offset() < stop:
                            raise PartitionEndError(f"{topic}[{partition}] ends at {m.offset()}, "
                                                    f"before the requested end {stop}")
                        return
                    if strict:
                        if err.fatal() or not err.retriable():
                            raise KafkaException(err)
                    elif err.code() in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_PARTITION,
                                        KafkaError._UNKNOWN_TOPIC):
                        return  # no topic: empty
                    elif err.fatal():
                        raise KafkaException(err)
                    continue
                if stop is not None and m.offset() >= stop:
                    return
                if idle:
                    deadline = time.monotonic() + timeout
                yield m
                if stop is not None and m.offset() + 1 >= stop:
                    return
    finally:
        c.unassign()


def iter_partition(conf: str | dict, topic: str, partition: int = 0, start: int = 0,
                   stop: int | None = None, timeout: float = 30.0, batch: int = 1000) -> Iterator[Message]:
    """Yield the records of one partition from offset `start` until partition
    EOF (or offset `stop`, exclusive), with a consumer of its own.  Raises
    TimeoutError when EOF is not reached within `timeout` seconds,
    KafkaException on a fatal error."""
    if partition_count(conf, topic) <= partition:
        return  # no such topic/partition: nothing to read
    c = consumer(conf)
    try:
        yield from read_to_eof(c, topic, partition, start, stop, timeout=timeout, batch=batch)
    finally:
        c.close()


def read_partition(conf: str | dict, topic: str, partition: int = 0, start: int = 0,
                   stop: int | None = None, timeout: float = 30.0) -> list[Message]:
    """All records of `topic[partition]` from `start` to its end, as a list."""
    return list(iter_partition(conf, topic, partition, start, stop, timeout))


def partition_count(conf: str | dict, topic: str, timeout: float = 10.0) -> int:
    """Number of partitions of `topic`, 0 if it does not exist."""
    admin = AdminClient(admin_conf(conf))
    md = admin.list_topics(timeout=timeout)  # naming the topic would auto-create it
    t = md.topics.get(topic)
    if t is None or t.error is not None:
        return 0
    return len(t.partitions)


def admin_conf(conf: str | dict) -> dict:
    if isinstance(conf, str):
        return {"bootstrap.servers": conf}
    drop = {"group.id", "enable.auto.commit", "auto.offset.reset", "enable.partition.eof",
            "enable.idempotence", "acks", "linger.ms", "compression.type", "isolation.level",
            "session.timeout.ms", "max.poll.interval.ms", "fetch.wait.max.ms", "batch.num.messages",
            "queue.buffering.max.ms", "queue.buffering.max.messages", "message.timeout.ms", "retries"}
    return {k: v for k, v in conf.items() if k not in drop}


def ensure_topic(conf: str | dict, topic: str, partitions: int = 1, timeout: float = 10.0) -> int:
    """Create `topic` with `partitions` partitions unless it exists; return its
    partition count (which may differ if it already existed)."""
    admin = AdminClient(admin_conf(conf))
    md = admin.list_topics(timeout=timeout)  # naming the topic would auto-create it
    t = md.topics.get(topic)
    if t is not None and t.error is None and t.partitions:
        return len(t.partitions)
    fut = admin.create_topics([NewTopic(topic, partitions, 1)], operation_timeout=timeout)[topic]
    try:
        fut.result(timeout)
    except KafkaException as e:
        if e.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
            raise
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        md = admin.list_topics(timeout=timeout)  # naming the topic would auto-create it
        t = md.topics.get(topic)
        if t is not None and t.error is None and t.partitions:
            return len(t.partitions)
        time.sleep(0.05)
    raise TimeoutError(f"topic {topic} not visible after creation")
