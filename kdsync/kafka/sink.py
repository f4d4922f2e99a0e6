"""The sink side of a member: deliveries written, in order, to this cluster's
global topic, and the durable position they reach.

One idempotent producer (enable.idempotence, acks=all, message.timeout.ms=0:
librdkafka retries retriable errors with backoff for ever, so order and
exactly-once hold while a broker is paused) serves every global topic; one
`GlobalWriter` per global topic produces each `Delivery` and checks the
delivery reports one by one.  When they confirm a contiguous prefix of
positions, the writer reports the new durable end together with the source
offsets of this member's own events below it, which may now be committed.

A failed producer (a fatal idempotence error: out-of-order sequence, fenced
epoch, unknown producer id after a broker lost its state; or a delivery
error; or produce() itself refusing a record, as it does once the producer
is fatal and before its error callback has been served) is recovered in
place (kdsync.producer_recovery): every writer
is `suspend`ed (reports of the failed producer are ignored from then on, new
deliveries are only queued), the failed producer's in-flight requests are
drained, a new producer is made, each global topic's tail above the durable
end is read back (`read_present`: which positions made it), and `resume`
produces, in order, exactly the positions that did not.  Within a partition
records are in position order and a producer's writes land as a prefix, so
what is missing is a suffix, re-produced in order: offsets stay positions and
nothing is written twice.  Without `on_failed` a delivery error is fatal.

Delivery reports are served by `producer.poll()`, which the member calls on
its event loop; every callback of this module runs there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from functools import partial
from typing import Callable, NamedTuple

from confluent_kafka import KafkaException

from kdsync.core import Delivery
from kdsync.fatal import FatalError
from kdsync.kafka.records import H_OOFF, H_OPART, H_ORIGIN, H_OTS, H_SEQ, global_partition, unpack_payload
from kdsync.observability.logs import kv, where

__all__ = ["GlobalWriter", "ReportPoller", "WrittenDelivery", "check_global_partitions", "ensure_global", "make_producer", "producer_conf", "read_present"]

log = logging.getLogger("kdsync.sink")

REPORT_POLL_S = 0.004  # while records await their delivery reports, the producer is polled this often


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
    from kdsync.kafka.topic import TopicSettingsError, TopicSpec, ensure_topics

    try:
        have = ensure_topics(conf, [TopicSpec(global_topic, partitions, replication_factor, dict(config or {}))],
                             timeout=3.0)[global_topic]
    except TopicSettingsError as e:  # the cluster refuses [topics] settings: no retry can fix that
        raise FatalError(f"topics: {e}") from None
    return check_global_partitions(global_topic, have, partitions, shards)


def check_global_partitions(global_topic: str, have: int, partitions: int, shards: int = 1) -> int:
    """`have`, the partition count of `global_topic`, when it is the one asked
    (`partitions`, or at least `shards`); FatalError otherwise (ensure_global)."""
    if shards > 1:
        if have < shards:
            raise FatalError(f"topics.shards = {shards} but {global_topic} already has {have} partitions "
                             f"(shard s writes partition s): add partitions to it or use another global_suffix")
        return have
    if have != partitions:
        raise FatalError(f"topics.global_partitions = {partitions} but {global_topic} already has {have} partitions")
    return have


class ReportPoller:
    """Serves a producer's callbacks (delivery reports, errors) on the loop.
    `poll()` now; `soon()` every REPORT_POLL_S while `outstanding()` (the
    member's tick serves them too, but a tick is long: durable ends and
    commits follow the reports within a few ms).  `producer()` is the
    current producer (re-created in place after a failure) or None;
    `failed(why)`: poll() itself raised a fatal error (seen in CI: the broker
    forgot the idempotent producer's sequence) — error_cb is not always
    called.  `stopping()`: the member serves the last reports itself."""

    def __init__(self, producer: Callable[[], object], failed: Callable[[str], None],
                 outstanding: Callable[[], bool], stopping: Callable[[], bool]):
        self._producer, self._failed, self._outstanding, self._stopping = producer, failed, outstanding, stopping
        self._timer = None

    def poll(self) -> None:
        producer = self._producer()
        if producer is None:
            return
        try:
            producer.poll(0)
        except KafkaException as e:
            err = e.args[0] if e.args else None
            self._failed(f"kafka producer: {err.str() if err is not None else e}")

    def soon(self) -> None:
        """Call on the loop: poll within REPORT_POLL_S, and on while reports are outstanding."""
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(REPORT_POLL_S, self._due)

    async def drain(self, writers: list, timeout: float = 10.0) -> None:
        """At a stop: serve the reports (in a thread, bounded by `timeout`)
        until no writer of `writers` has one outstanding, then have each
        report what is durable, so the offsets of those records get committed."""
        producer = self._producer()
        if producer is None:
            return
        deadline = time.monotonic() + timeout
        while any(w.outstanding for w in writers) and time.monotonic() < deadline:
            await asyncio.to_thread(producer.poll, 0.1)
            await asyncio.sleep(0)  # run the scheduled durable reports
        for w in writers:
            w.report_durable()

    def _due(self) -> None:
        self._timer = None
        if self._stopping():
            return
        self.poll()
        if self._outstanding():
            self.soon()


class GlobalWriter:
    """Writes one ordering node's deliveries to its global topic.

    `start_seq`: the next position the topic lacks; `present`: positions
    already in it beyond a gap (several partitions only), which are confirmed
    without being written again.  Callbacks, all on the event loop:
    `on_durable(end, commits)` — positions below `end` are durable, and
    `commits` (source partition -> next offset) of this member's own events
    may be committed; called once per batch of delivery reports, through
    `schedule` (e.g. `loop.call_soon`).  `on_done(done)` (optional) — at the
    same moment, the `WrittenDelivery`s now wholly durable (one per Delivery,
    not per record: what the member's metrics and trace sample).
    `on_fatal(message)` — a write failed.

    The hot path is per record only where Kafka is: one `produce` and one
    delivery report each; everything else (commits, metrics, the durable
    report) is per batch or per Delivery.
    `shard`: the writer of that shard, which writes partition `shard` alone
    (then `partitions` is 1; docs/shards.md).
    """

    def __init__(self, producer, global_topic: str, partitions: int, start_seq: int, *, origin: str,
                 present: set[int] | None = None, on_durable: Callable[[int, dict[int, int]], None],
                 on_fatal: Callable[[str], None], schedule: Callable[[Callable[[], None]], object],
                 on_done: Callable[[list["WrittenDelivery"]], None] | None = None, clock: Callable[[], float] = time.monotonic,
                 shard: int | None = None, start_offsets: dict[int, int] | None = None,
                 on_failed: Callable[[str], None] | None = None):
        self.producer = producer
        self.shard = shard  # a shard's writer: every record to partition `shard` (docs/shards.md)
        self.global_topic = global_topic
        self.partitions = partitions
        self.origin = origin
        self.present = set(present or ())
        self.on_durable, self.on_fatal, self.schedule, self.on_done = on_durable, on_fatal, schedule, on_done
        self.clock = clock
        self.durable_end = start_seq  # positions below are confirmed
        self.produced_end = start_seq  # next position to produce
        self.written = 0  # records confirmed (a counter the metrics read)
        self._outstanding = 0  # produced, delivery report not yet come
        self._confirmed: set[int] = set()  # seqs confirmed above the durable prefix
        self._own: deque = deque()  # (last seq, partition, last offset) of own batches produced, not yet durable
        self._done: deque = deque()  # WrittenDelivery of each Delivery produced, not yet durable
        self._scheduled = False
        self._origin_b: dict[str, bytes] = {}
        self.on_failed = on_failed  # (message): the producer failed; the member recovers it (module doc)
        self._gen = 0  # producer generation: reports of an earlier one are ignored
        self.suspended = False  # recovering: deliveries are queued, not produced
        self._pending: deque[Delivery] = deque()  # deliveries not wholly durable (re-produced after a failure)
        # partition -> an offset below which every record's position is below durable_end (where a tail read starts)
        self.floors: dict[int, int] = dict(start_offsets or {})

    @property
    def unproduced(self) -> int:
        """Delivered records not handed to the producer yet (queued while suspended)."""
        return self._pending[-1].end_seq - self.produced_end if self._pending else 0

    @property
    def outstanding(self) -> int:
        """Records produced whose delivery report has not come yet."""
        return self._outstanding

    def write(self, d: Delivery) -> None:
        """Produce the records of `d`, which must continue where the last ended
        (else on_fatal); while suspended, queue them."""
        end = self._pending[-1].end_seq if self._pending else self.produced_end
        if d.first_seq != end:
            self.on_fatal(f"internal: delivery at position {d.first_seq} but {self.global_topic} continues at {end}")
            return
        self._pending.append(d)
        if not self.suspended:
            self._produce(d)

    def _produce(self, d: Delivery) -> None:
        seq = d.first_seq
        t0 = self.clock()
        produce, topic, parts, report = self.producer.produce, self.global_topic, self.partitions, self._on_delivery
        present, shard, gen = self.present, self.shard, self._gen
        first_ts = 0
        for b in d.batches:
            ob = self._origin_b.get(b.origin)
            if ob is None:
                ob = self._origin_b[b.origin] = b.origin.encode()
            oh, ph = (H_ORIGIN, ob), (H_OPART, b"%d" % b.partition)
            off = b.first_offset
            tss = b.timestamps_ms()
            if not first_ts:
                first_ts = tss[0]
            for payload, ts in zip(b.payloads(), tss):
                key, value, headers = unpack_payload(payload)
                # the source record's headers, then kdsync's (records.global_headers, in its order)
                headers += ((H_SEQ, b"%d" % seq), oh, ph, (H_OOFF, b"%d" % off), (H_OTS, b"%d" % ts))
                self._outstanding += 1
                if present and seq in present:  # written before a crash, beyond a gap: do not duplicate
                    present.discard(seq)
                    report(gen, seq, None, None)
                else:
                    part = shard if shard is not None else (0 if parts == 1 else global_partition(key, seq, parts))
                    while True:
                        try:
                            produce(topic, value=value, key=key, partition=part,
                                    on_delivery=partial(report, gen, seq), headers=headers)
                            break
                        except BufferError:  # local queue full: serve reports, then retry
                            try:
                                self.producer.poll(0.05)
                            except KafkaException as e:  # fatal, raised by poll (Member.poll_producer)
                                self._refused(seq, e)
                                return
                        except KafkaException as e:  # the producer is fatal (or refuses this record)
                            self._refused(seq, e)
                            return
                seq += 1
                off += 1
            if b.origin == self.origin:
                self._own.append((seq - 1, b.partition, off - 1))
        self.produced_end = seq
        self._done.append(WrittenDelivery(d.first_seq, seq, first_ts, d.catchup, t0, self.clock()))

    def _refused(self, seq: int, e: KafkaException) -> None:
        """produce() raised for position `seq`: the producer failed.  Recover
        (`on_failed`: every writer is suspended and `resume` produces this
        delivery again, it is still pending) or stop (`on_fatal`)."""
        err = e.args[0] if e.args else None
        why = f"writing position {seq} to {self.global_topic} failed: {err.str() if err is not None else e}"
        self.suspend()
        if self.on_failed is not None:
            self.on_failed(why)
        else:
            self.on_fatal(f"{why} (restart the member once the cluster accepts writes; it resumes from the global topic)")

    def _on_delivery(self, gen: int, seq: int, err, msg) -> None:
        # a callback of producer.poll(): an exception escaping it leaves confluent-kafka's
        # error state set (a SystemError later, somewhere else), so none may escape
        try:
            if gen != self._gen:
                return  # a report of a failed producer: the tail read decides what it wrote
            self._outstanding -= 1
            if err is not None:
                why = f"writing position {seq} to {self.global_topic} failed: {err.str()}"
                if self.on_failed is not None:
                    self.on_failed(why)
                else:
                    self.on_fatal(f"{why} (restart the member once the cluster accepts writes; it resumes from the "
                                  f"global topic)")
                return
            if seq < self.durable_end:
                return  # re-confirmed after a recovery (present in the topic)
            self.written += 1
            if seq == self.durable_end:
                off = msg.offset() if msg is not None else None
                if off is not None and off >= 0:  # no offset: acknowledged as a duplicate (a retry after a broker crash)
                    part = msg.partition()
                    if off + 1 > self.floors.get(part, 0):
                        self.floors[part] = off + 1
                end = seq + 1
                confirmed = self._confirmed
                if confirmed:
                    while end in confirmed:
                        confirmed.discard(end)
                        end += 1
                self.durable_end = end
                if not self._scheduled:  # report once per batch of delivery reports
                    self._scheduled = True
                    self.schedule(self.report_durable)
            else:
                self._confirmed.add(seq)
        except Exception as e:  # noqa: BLE001
            log.exception("internal error in a delivery report", **kv(where=where(e)))
            self.on_fatal(f"internal error in a delivery report of position {seq}: {e!r} at {where(e)}")

    def report_durable(self) -> None:
        """Call on_durable with the durable end and the commits it allows now
        (and on_done with the deliveries now wholly durable)."""
        self._scheduled = False
        end = self.durable_end
        commits: dict[int, int] = {}
        pending = self._pending
        while pending and pending[0].end_seq <= end:
            pending.popleft()
        own = self._own
        while own and own[0][0] < end:
            _, part, off = own.popleft()
            commits[part] = off + 1
        if self._done and self._done[0].end_seq <= end:
            now = self.clock()
            done = []
            while self._done and self._done[0].end_seq <= end:
                done.append(self._done.popleft()._replace(durable_t=now))
            if self.on_done is not None:
                self.on_done(done)
        self.on_durable(end, commits)


    # ------------------------------------------------------------ recovery (module doc)
    def suspend(self) -> None:
        """The producer failed: ignore its reports from now on, queue new deliveries."""
        self.suspended = True
        self._gen += 1
        self._outstanding = 0

    def resume(self, producer, present: set[int]) -> None:
        """Go on with `producer`: positions in `present` (read back from the
        topic, at or above durable_end) are confirmed without writing, every
        other pending position is produced again, in order."""
        self.producer = producer
        self._gen += 1
        self._outstanding = 0
        self._confirmed.clear()
        self._own.clear()
        self._done.clear()
        pending = list(self._pending)
        first = pending[0].first_seq if pending else self.durable_end
        self.present = set(present) | set(range(first, self.durable_end))  # the durable head of the first one
        self.produced_end = first
        self.suspended = False
        for d in pending:
            self._produce(d)


def read_present(conf: dict, global_topic: str, floors: dict[int, int], min_seq: int,
                 timeout: float = 60.0) -> set[int]:
    """The positions >= `min_seq` in `global_topic`, read from each partition
    p's offset floors[p] to its end (blocking; raises TimeoutError /
    KafkaException when the brokers do not answer, GlobalGapError when an
    offset is neither read nor explained: kdsync.kafka.gaps.ReadGaps)."""
    from contextlib import closing

    from kdsync.kafka.gaps import ReadGaps
    from kdsync.kafka.records import read_global_headers
    from kdsync.kafka.topic import consumer, read_to_eof

    out: set[int] = set()
    gaps = ReadGaps(conf)  # a position skipped would be written twice
    with closing(consumer(conf)) as c:
        for p, floor in sorted(floors.items()):
            for m in read_to_eof(c, global_topic, p, floor, timeout=timeout, idle=True, poll=0.05, gaps=gaps):
                h = read_global_headers(m.headers())
                if h is not None and h.seq >= min_seq:
                    out.add(h.seq)
    return out


class WrittenDelivery(NamedTuple):
    """One Delivery on its way through the global topic (loop clock, seconds):
    handed to the writer at `write_t`, every record produced by `produced_t`,
    every delivery report in by `durable_t`.  `first_ts_ms`: the source
    timestamp of its first record."""

    first_seq: int
    end_seq: int
    first_ts_ms: int
    catchup: bool
    write_t: float
    produced_t: float
    durable_t: float = 0.0
