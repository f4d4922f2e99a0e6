"""The sink side of a member: deliveries written, in order, to this cluster's
global topic, and the durable position they reach.

One idempotent producer (enable.idempotence, acks=all, message.timeout.ms=0:
librdkafka retries retriable errors with backoff for ever, so order and
exactly-once hold while a broker is paused) serves every global topic; one
`GlobalWriter` per global topic produces each `Delivery` and checks the
delivery reports one by one.  When they confirm a contiguous prefix of
positions, the writer reports the new durable end together with the source
offsets of this member's own events below it, which may now be committed.  A
delivery error is fatal: nothing is silently lost, the member stops and its
restart recovers from the global topic.

Delivery reports are served by `producer.poll()`, which the member calls on
its event loop; every callback of this module runs there.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from kdsync.core import Delivery, Event
from kdsync.errors import FatalError
from kdsync.kafka.records import global_partition, global_record

__all__ = ["GlobalWriter", "ensure_global", "make_producer", "producer_conf"]


def producer_conf(overrides: dict) -> dict:
    """librdkafka properties of the global-topic producer: kdsync's defaults,
    then the configured `overrides`, then idempotence (order depends on it)."""
    conf = {"acks": "all", "linger.ms": 1, "message.timeout.ms": 0, "retry.backoff.ms": 100,
            "retry.backoff.max.ms": 2000, "log_level": 3, "queue.buffering.max.messages": 1_000_000}
    conf.update(overrides)
    conf["enable.idempotence"] = True
    return conf


def make_producer(conf: dict):
    """A confluent_kafka Producer for `conf` (from `producer_conf`, plus an error_cb)."""
    from confluent_kafka import Producer

    return Producer(conf)


def ensure_global(conf: dict, global_topic: str, partitions: int, replication_factor: int | None = None,
                  config: dict[str, str] | None = None, shards: int = 1) -> int:
    """Create the global topic with `partitions` partitions (and the [topics]
    replication factor and topic configs) unless it exists; return its
    partition count.  Raises FatalError when an existing topic has another
    count (positions would land elsewhere than in the other clusters) or the
    cluster refuses the settings, KafkaException/TimeoutError when the brokers
    do not answer.  `shards` > 1: created with one partition per shard, and
    refused only when an existing topic has fewer (docs/shards.md)."""
    from kdsync.kafka.topic import TopicSettingsError, ensure_topic

    try:
        have = ensure_topic(conf, global_topic, partitions, timeout=3.0, replication_factor=replication_factor,
                            config=config)
    except TopicSettingsError as e:  # the cluster refuses [topics] settings: no retry can fix that
        raise FatalError(f"topics: {e}") from None
    if shards > 1:
        if have < shards:
            raise FatalError(f"topics.shards = {shards} but {global_topic} already has {have} partitions "
                             f"(shard s writes partition s): add partitions to it or use another global_suffix")
        return have
    if have != partitions:
        raise FatalError(f"topics.global_partitions = {partitions} but {global_topic} already has {have} partitions")
    return have


class GlobalWriter:
    """Writes one ordering node's deliveries to its global topic.

    `start_seq`: the next position the topic lacks; `present`: positions
    already in it beyond a gap (several partitions only), which are confirmed
    without being written again.  Callbacks, all on the event loop:
    `on_durable(end, commits)` — positions below `end` are durable, and
    `commits` (source partition -> next offset) of this member's own events
    may be committed; called once per batch of delivery reports, through
    `schedule` (e.g. `loop.call_soon`).  `on_written(event, catchup)` — one
    record confirmed.  `on_fatal(message)` — a write failed.  `shard`: the
    writer of that shard, which writes partition `shard` alone (then
    `partitions` is 1).
    """

    def __init__(self, producer, global_topic: str, partitions: int, start_seq: int, *, origin: str,
                 present: set[int] | None = None, on_durable: Callable[[int, dict[int, int]], None],
                 on_written: Callable[[Event, bool], None], on_fatal: Callable[[str], None],
                 schedule: Callable[[Callable[[], None]], object], shard: int | None = None):
        self.producer = producer
        self.shard = shard  # a shard's writer: every record to partition `shard` (docs/shards.md)
        self.global_topic = global_topic
        self.partitions = partitions
        self.origin = origin
        self.present = set(present or ())
        self.on_durable, self.on_written, self.on_fatal, self.schedule = on_durable, on_written, on_fatal, schedule
        self.durable_end = start_seq  # positions below are confirmed
        self.produced_end = start_seq  # next position to produce
        self._pending: dict[int, Event] = {}  # seq -> event produced, report outstanding
        self._confirmed: set[int] = set()  # seqs confirmed above the durable prefix
        self._own: deque = deque()  # (seq, partition, offset) of own events produced, not yet durable
        self._scheduled = False

    @property
    def outstanding(self) -> int:
        """Records produced whose delivery report has not come yet."""
        return len(self._pending)

    def write(self, d: Delivery) -> None:
        """Produce the records of `d`, which must continue where the last ended
        (else on_fatal)."""
        p = self.producer
        seq = d.first_seq
        if seq != self.produced_end:
            self.on_fatal(f"internal: delivery at position {seq} but {self.global_topic} continues at "
                          f"{self.produced_end}")
            return
        for ev in d.events():
            key, value, headers = global_record(seq, ev)
            self._pending[seq] = ev
            if ev.origin == self.origin:
                self._own.append((seq, ev.partition, ev.offset))
            if self.present and seq in self.present:  # written before a crash, beyond a gap: do not duplicate
                self.present.discard(seq)
                self._on_delivery(seq, True, None, None)
                seq += 1
                continue
            cb = (lambda err, msg, s=seq, c=d.catchup: self._on_delivery(s, c, err, msg))
            while True:
                try:
                    p.produce(self.global_topic, value=value, key=key, headers=headers,
                              partition=global_partition(key, seq, self.partitions) if self.shard is None
                              else self.shard, on_delivery=cb)
                    break
                except BufferError:  # local queue full: serve reports, then retry
                    p.poll(0.05)
            seq += 1
        self.produced_end = seq

    def _on_delivery(self, seq: int, catchup: bool, err, msg) -> None:
        ev = self._pending.pop(seq, None)
        if err is not None:
            self.on_fatal(f"writing position {seq} to {self.global_topic} failed: {err.str()} "
                          f"(restart the member once the cluster accepts writes; it resumes from the global topic)")
            return
        if ev is None:
            return
        self.on_written(ev, catchup)
        self._confirmed.add(seq)
        if seq == self.durable_end:
            end = seq
            while end in self._confirmed:
                self._confirmed.discard(end)
                end += 1
            self.durable_end = end
            if not self._scheduled:  # report once per batch of delivery reports
                self._scheduled = True
                self.schedule(self.report_durable)

    def report_durable(self) -> None:
        """Call on_durable with the durable end and the commits it allows now."""
        self._scheduled = False
        commits: dict[int, int] = {}
        own = self._own
        while own and own[0][0] < self.durable_end:
            _, part, off = own.popleft()
            commits[part] = off + 1
        self.on_durable(self.durable_end, commits)
