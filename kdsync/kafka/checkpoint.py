"""Checkpoints: what a member needs to restart, kept next to its global topic.

A restart needs the next position of the global topic `T-global` and the
origin watermarks (highest source offset per origin partition) of the
positions below it.  Reading them off the whole topic takes time that grows
with the topic, and is impossible once retention has deleted its oldest
records.  So each member writes, to a compacted topic `T-global.kdsync` of
its own cluster (one partition, key = the global topic's name), a JSON
record:

    {"version": 1, "topic": "orders-global", "member": "dc1", "seq": 120000,
     "offsets": [120000], "watermarks": [["dc1", 0, 40000], ["dc2", 0, 39999]],
     "written_ms": 1712345678901}

meaning: positions below `seq` are durable in `topic`; `watermarks` are the
origin watermarks of exactly those positions; and in global partition p every
record at an offset below `offsets[p]` has a position below `seq` (records
from `offsets[p]` on may have any position).  Start-up reads the latest
record and then the global topic only from `offsets[p] - 1` (one record
before, to check the checkpoint belongs to this topic) to its end; see
`kdsync.kafka.reader.load_start`.

How a checkpoint is taken (`CheckpointWriter`), without touching the write
path: (1) in a worker thread, ask the cluster for each partition's end offset
E[p] (ListOffsets; a value too low is harmless); (2) back on the event loop,
take Q = the next position delivered to the writer and the watermarks at Q.
Every record below E[p] was produced before step 2, so its position is below
Q: (Q, watermarks, E) is a valid checkpoint (3) once positions below Q are
durable; it is produced then.  One is taken every `interval_ms` (when
anything changed) and as soon as `positions` more positions are durable, one
right at start-up and one at a clean stop (exact: nothing is in flight).  A
member that restarted with positions beyond a gap (several partitions, see
GlobalWriter) takes none until it has passed them.

Shards (`[topics] shards = K > 1`, docs/shards.md): shard s is an ordering
group of its own writing partition s of the global topic only; its
checkpoints live in the same checkpoint topic under key ``T-global/s``
(a topic name never holds ``/``), with ``"shard": s`` and `offsets` holding
the one end offset of partition s.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from kdsync.core import Delivery

__all__ = ["CHECKPOINT_SUFFIX", "Checkpoint", "CheckpointRounds", "CheckpointWriter", "EndOffsets", "OffsetsConsumer", "checkpoint_key", "checkpoint_topic",
           "checkpoint_topic_spec", "ensure_checkpoint_topic", "read_checkpoint"]

log = logging.getLogger("kdsync.checkpoint")

CHECKPOINT_SUFFIX = ".kdsync"  # T-global -> T-global.kdsync
VERSION = 1
TAIL = 8  # records read back from the checkpoint topic's end to find the latest


def checkpoint_topic(global_topic: str) -> str:
    """Name of the checkpoint topic of `global_topic`."""
    return global_topic + CHECKPOINT_SUFFIX


def checkpoint_key(global_topic: str, shard: int | None = None) -> bytes:
    """Key of the checkpoints of `global_topic` (of one shard of it) in its checkpoint topic."""
    return (global_topic if shard is None else f"{global_topic}/{shard}").encode()


@dataclass(frozen=True)
class Checkpoint:
    """Restart state of one global topic as of position `seq` (see module doc)."""

    topic: str
    seq: int
    offsets: tuple[int, ...]  # per global partition: every record below has a position < seq
    watermarks: dict[tuple[str, int], int] = field(default_factory=dict)
    member: str = ""
    written_ms: int = 0
    shard: int | None = None  # a shard's checkpoint: offsets = (end offset of partition `shard`,)

    def encode(self) -> bytes:
        """The record value (JSON, UTF-8)."""
        return json.dumps({
            "version": VERSION, "topic": self.topic, **({} if self.shard is None else {"shard": self.shard}),
            "member": self.member, "seq": self.seq,
            "offsets": list(self.offsets),
            "watermarks": [[o, p, off] for (o, p), off in sorted(self.watermarks.items())],
            "written_ms": self.written_ms or int(time.time() * 1000)}, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, value: bytes | None) -> Checkpoint:
        """A checkpoint from a record value; raises ValueError naming what is wrong."""
        if value is None:
            raise ValueError("empty value")
        try:
            d = json.loads(value)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"not JSON ({e})") from None
        if not isinstance(d, dict):
            raise ValueError("not a JSON object")
        if d.get("version") != VERSION:
            raise ValueError(f"unknown version {d.get('version')!r}")
        try:
            seq = _nonneg(d["seq"])
            offsets = tuple(_nonneg(x) for x in d["offsets"])
            wm = {}
            for o, p, off in d["watermarks"]:
                if not isinstance(o, str):
                    raise TypeError
                wm[(o, _nonneg(p))] = _nonneg(off)
            shard = d.get("shard")
            return cls(str(d["topic"]), seq, offsets, wm, str(d.get("member", "")), int(d.get("written_ms", 0)),
                       None if shard is None else _nonneg(shard))
        except (KeyError, TypeError, ValueError):
            raise ValueError("missing or malformed field (topic, seq, offsets, watermarks)") from None


def _nonneg(x) -> int:
    if not isinstance(x, int) or isinstance(x, bool) or x < 0:
        raise ValueError
    return x


# ---------------------------------------------------------------- topic I/O (blocking)
def ensure_checkpoint_topic(conf: dict, global_topic: str, replication_factor: int | None = None,
                            min_insync_replicas: int | None = None) -> str:
    """Create the checkpoint topic of `global_topic` unless it exists (one
    partition, cleanup.policy=compact, the global topic's replication);
    return its name.  Raises KafkaException / TimeoutError when the brokers do
    not answer, FatalError when the cluster refuses the settings."""
    from kdsync.fatal import FatalError
    from kdsync.kafka.topic import TopicSettingsError, ensure_topics

    spec = checkpoint_topic_spec(global_topic, replication_factor, min_insync_replicas)
    try:
        ensure_topics(conf, [spec], timeout=3.0)
    except TopicSettingsError as e:
        raise FatalError(f"topics: {e}") from None
    return spec.name


def checkpoint_topic_spec(global_topic: str, replication_factor: int | None = None,
                          min_insync_replicas: int | None = None):
    """The TopicSpec of `global_topic`'s checkpoint topic (ensure_checkpoint_topic)."""
    from kdsync.kafka.topic import TopicSpec

    config = {"cleanup.policy": "compact"}
    if min_insync_replicas is not None:
        config["min.insync.replicas"] = str(min_insync_replicas)
    return TopicSpec(checkpoint_topic(global_topic), 1, replication_factor, config)


def read_checkpoint(c, global_topic: str, timeout: float = 30.0, shard: int | None = None) -> Checkpoint | None:
    """The latest valid checkpoint of `global_topic`, read with consumer `c`
    (from `kdsync.kafka.topic.consumer`) off the end of its checkpoint topic;
    None when there is none.  A malformed record is skipped with a WARNING.
    `shard`: the latest of that shard (module doc).
    Raises TimeoutError / KafkaException when the brokers do not answer."""
    from confluent_kafka import KafkaError, KafkaException, TopicPartition

    from kdsync.kafka.topic import read_to_eof

    name = checkpoint_topic(global_topic)
    key = checkpoint_key(global_topic, shard)
    try:
        low, high = c.get_watermark_offsets(TopicPartition(name, 0), timeout=timeout, cached=False)
    except KafkaException as e:
        if e.args[0].code() in (KafkaError._UNKNOWN_PARTITION, KafkaError.UNKNOWN_TOPIC_OR_PART,
                                KafkaError._UNKNOWN_TOPIC):
            return None  # no checkpoint topic (yet)
        raise
    first = max(low, high - TAIL)
    for start in (first, low) if first > low else (first,):
        latest = None
        for m in read_to_eof(c, name, 0, start, timeout=timeout, idle=True, poll=0.02):
            if m.key() != key:
                continue
            try:
                cp = Checkpoint.decode(m.value())
            except ValueError as e:
                log.warning("ignoring a malformed checkpoint", extra={"kv": {"topic": name, "offset": m.offset(),
                                                                            "error": str(e)}})
                continue
            if cp.topic == global_topic and cp.shard == shard:
                latest = cp
        if latest is not None:
            return latest
    return None


class OffsetsConsumer:
    """One consumer shared by every EndOffsets of a member (a member with a
    thousand topics keeps one client open for them, not a thousand), used by
    one thread at a time (`lock`).  Opened on first use; `reset()` drops it
    so the next use opens a new one (after a stalled fetch)."""

    def __init__(self, conf: dict):
        self.conf = conf
        self.lock = threading.Lock()
        self._c = None

    def get(self):
        """The consumer (hold `lock`)."""
        from kdsync.kafka.topic import consumer

        if self._c is None:
            self._c = consumer(self.conf)
        return self._c

    def reset(self) -> None:
        """Close the consumer (hold `lock`, or call when no one uses it)."""
        if self._c is not None:
            self._c.close()
            self._c = None

    close = reset


class EndOffsets:
    """Each partition of `topic`'s end offset as the cluster reports it
    (ListOffsets: never above the true end, possibly below on some brokers),
    read with `shared` (an OffsetsConsumer: the member's one for all its
    topics), or with a consumer of its own when None; any thread.
    `shard`: only partition `shard` (then `partitions` is 1)."""

    def __init__(self, conf: dict, topic: str, partitions: int, timeout: float = 10.0, shard: int | None = None,
                 shared: OffsetsConsumer | None = None):
        self.conf, self.topic, self.partitions, self.timeout = conf, topic, partitions, timeout
        self.ids = [shard] if shard is not None else list(range(partitions))  # the partitions measured
        self._own = shared is None
        self._shared = shared if shared is not None else OffsetsConsumer(conf)

    def __call__(self, exact: bool = False, timeout: float | None = None) -> tuple[int, ...]:
        """The end offsets; `exact`: read on from there to partition EOF
        (for a topic nobody writes at the moment: a clean stop), with a
        consumer of its own for this read, so the last checkpoints of many
        topics are taken side by side.  `timeout`: seconds for all of it (a
        stop's last checkpoint; default: `self.timeout` per request and per
        partition read).  Raises KafkaException / TimeoutError when the
        brokers do not answer, FetchStalledError (the retry asks with a new
        consumer and a longer fetch wait)."""
        from kdsync.kafka.topic import consumer

        if not exact:
            with self._shared.lock:
                c = self._shared.get()
                c.poll(0)  # serves the client's log lines
                return tuple(self._ends(c, self.timeout if timeout is None else min(self.timeout, timeout)))
        deadline = None if timeout is None else time.monotonic() + timeout
        c = consumer(self.conf)
        try:
            ends = self._ends(c, self._left(deadline))
            self._exact(c, ends, deadline)
            return tuple(ends)
        finally:
            c.close()

    def _left(self, deadline: float | None) -> float:
        """Seconds a request may wait: `self.timeout`, or what is left before `deadline`."""
        if deadline is None:
            return self.timeout
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{self.topic}: no exact end offsets within the stop's time")
        return min(self.timeout, left)

    def _ends(self, c, timeout: float) -> list[int]:
        """One ListOffsets (LATEST) for every partition measured: the high
        watermarks `get_watermark_offsets` asked in two requests a partition
        (earliest and latest).  At 1 000 topics checkpointing, those were
        the most frequent requests their broker got (Tansu's cost is per
        request: docs/design/many-topics.md)."""
        from confluent_kafka import KafkaException, TopicPartition

        from kdsync.kafka.topic import LATEST

        asked = [TopicPartition(self.topic, p, LATEST) for p in self.ids]
        got = {}
        for tp in c.offsets_for_times(asked, timeout=timeout):
            if tp.error is not None:
                raise KafkaException(tp.error)
            got[tp.partition] = tp.offset
        if any(got.get(p, -1) < 0 for p in self.ids):
            raise KafkaException(f"{self.topic}: no end offset for partitions "
                                 f"{[p for p in self.ids if got.get(p, -1) < 0]}")
        return [got[p] for p in self.ids]

    def _exact(self, c, ends: list[int], deadline: float | None = None) -> None:
        """Read each partition on from `ends[i]` to partition EOF; update `ends` in place."""
        from kdsync.kafka.gaps import ReadGaps
        from kdsync.kafka.topic import read_to_eof

        for i, high in enumerate(ends):
            p = self.ids[i]
            gen = read_to_eof(c, self.topic, p, high, timeout=self._left(deadline), idle=deadline is None, poll=0.02,
                              gaps=ReadGaps(self.conf))
            last = None
            try:
                while True:
                    last = next(gen).offset()
            except StopIteration as stop:
                ends[i] = stop.value if stop.value is not None else (last + 1 if last is not None else high)

    def close(self) -> None:
        """Close its own consumer (if it opened one; a shared one is its owner's to close)."""
        if self._own:
            with self._shared.lock:
                self._shared.reset()


# ---------------------------------------------------------------- the member's writers' interval
ROUND_S = 1.0  # CheckpointRounds wakes once a second at most


class CheckpointRounds:
    """The interval of every CheckpointWriter of a member from one timer:
    each writer's `due()` every `interval_s` (the first after a random part
    of it: a thousand writers started together do not all measure and write
    in the same instant), checked once per `round_s` (or the shortest
    interval).

    One task per writer sleeping its interval (the earlier way) put a
    thousand timers in the loop's heap and woke the loop 20 times a second
    at 1 000 topics for writers that, idle, had nothing to do."""

    def __init__(self, round_s: float = ROUND_S):
        self.round_s = round_s
        self._due: list[tuple[float, int, CheckpointWriter]] = []  # (when, order added, writer): a heap
        self._order = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def add(self, w: CheckpointWriter) -> None:
        loop = self._loop = self._loop or asyncio.get_running_loop()
        self.round_s = min(self.round_s, w.interval_s)  # `[checkpoint] interval_ms` below a second
        heapq.heappush(self._due, (loop.time() + w.interval_s * random.random(), next(self._order), w))
        if self._timer is None:
            self._timer = loop.call_later(self.round_s, self._round)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._due.clear()

    def __len__(self) -> int:
        return sum(1 for _, _, w in self._due if not w.stopped)

    def _round(self) -> None:
        self._timer = None
        now = self._loop.time()
        due = self._due
        while due and due[0][0] <= now:
            _, _, w = heapq.heappop(due)
            if w.stopped:
                continue
            heapq.heappush(due, (now + w.interval_s, next(self._order), w))
            w.due()
        if due:
            self._timer = self._loop.call_later(self.round_s, self._round)


# ---------------------------------------------------------------- the member's writer
class CheckpointWriter:
    """Takes and writes the checkpoints of one global topic (module doc).

    Driven from the member's event loop: `delivered(d)` for every Delivery
    handed to the GlobalWriter, `durable(end)` whenever the durable end
    advances, `due()` every `interval_s` (CheckpointRounds), `stop()` when
    the member stops and `final()` at a clean stop.
    `measure(exact, timeout=None)` (blocking, run in a thread; an
    EndOffsets) returns the global partitions' end offsets; `producer` is the member's producer (its
    delivery reports are served on the loop); `on_written(cp)` hears of every
    checkpoint the cluster confirms, and of the one read at start (metrics).
    A failed write is logged and taken again later: restarts then start from
    an older checkpoint, which is only slower.
    """

    def __init__(self, producer, global_topic: str, partitions: int, member: str, *, start_seq: int,
                 watermarks: dict[tuple[str, int], int], min_seq: int, last: Checkpoint | None,
                 measure: Callable[..., tuple[int, ...]], interval_s: float, positions: int,
                 shard: int | None = None, on_written: Callable[[Checkpoint], None] | None = None):
        self.producer = producer
        self.shard = shard  # a shard's writer (module doc)
        self.key = checkpoint_key(global_topic, shard)
        self.global_topic = global_topic
        self.topic = checkpoint_topic(global_topic)
        self.partitions = partitions
        self.member = member
        self.wm = dict(watermarks)  # at next_seq
        self.next_seq = start_seq  # next position delivered to the writer
        self.durable_end = start_seq
        self.min_seq = min_seq  # no checkpoint below: positions beyond a gap were written before
        self.last = last  # the latest checkpoint the cluster confirmed (or read at start)
        self._taken = last  # the latest handed to the producer
        self.measure = measure
        self.interval_s = interval_s
        self.positions = positions
        self.written = 0  # checkpoints confirmed by the cluster
        self._pending: Checkpoint | None = None
        self._exact: tuple[int, tuple[int, ...]] | None = None  # (seq, offsets) known to be exact (known_exact)
        self._quiet_at: int | None = None  # next_seq when a measure last found nothing new: measure again once it moves
        self._busy = False
        self._task: asyncio.Future | None = None
        self.stopped = False  # stop(): CheckpointRounds drops it
        self.on_written = on_written  # called with each checkpoint the cluster confirms (and the one read at start)
        if last is not None and on_written is not None:
            on_written(last)

    # ------------------------------------------------------------ from the member
    def delivered(self, d: Delivery) -> None:
        """A Delivery went to the GlobalWriter: advance the position and watermarks."""
        wm = self.wm
        for b in d.batches:
            k = (b.origin, b.partition)
            last = b.first_offset + b.count - 1
            if last > wm.get(k, -1):
                wm[k] = last
        self.next_seq = d.end_seq

    def durable(self, end: int) -> None:
        """Positions below `end` are durable: write a pending checkpoint they
        cover; take one early when `positions` more are durable."""
        self.durable_end = end
        pending = self._pending
        if pending is not None and end >= pending.seq:
            self._write(pending)
        elif (not self._busy and pending is None and self.next_seq >= self.min_seq
              and end - (self._taken.seq if self._taken else 0) >= self.positions):
            self._task = asyncio.ensure_future(self.take())

    def due(self) -> None:
        """The interval is over: take a checkpoint unless one is being taken
        or nothing moved since the last measure (an idle topic: no task, no
        thread, nothing asked of the cluster)."""
        if not self._busy and self._quiet_at != self.next_seq:
            self._task = asyncio.ensure_future(self.take())

    def stop(self) -> None:
        """No more periodic checkpoints; a take in flight is cancelled."""
        self.stopped = True
        if self._task is not None:
            self._task.cancel()

    def known_exact(self, seq: int, offsets: tuple[int, ...]) -> None:
        """The global topic's partitions end at `offsets` at position `seq`
        (read to their end at start): a clean stop with nothing delivered
        since, once a checkpoint of it is confirmed, needs no last read; and
        until a position is delivered there is nothing to measure (a member
        starting a thousand topics does not ask its cluster a thousand
        times: measured, those reads held every worker thread and the GIL
        for seconds)."""
        self._exact = (seq, tuple(offsets))
        if seq == self.next_seq:
            self._quiet_at = seq

    def write_now(self, cp: Checkpoint) -> None:
        """Write `cp` (already durable and valid, e.g. the start-up state)."""
        self._write(cp)

    async def take(self, exact: bool = False, timeout: float | None = None) -> None:
        """Measure the end offsets (`exact`, `timeout`: see EndOffsets), then
        take (and once durable, write) a checkpoint unless nothing changed
        since the last one."""
        if self._busy or (not exact and self._quiet_at == self.next_seq):
            return  # an idle topic asks its cluster nothing
        self._busy = True
        # nothing in flight (every position delivered is durable): the ends measured are
        # the topic's ends at this position, and measuring again before it moves finds
        # the same (at 1 000 topics these second measures were most of an idle member's
        # thread hand-offs and its cluster's ListOffsets for two intervals after traffic)
        q0 = self.next_seq if self.durable_end >= self.next_seq else None
        try:
            try:
                offsets = await (asyncio.to_thread(self.measure, exact) if timeout is None
                                 else asyncio.to_thread(self.measure, exact, timeout=timeout))
            except Exception as e:  # broker away: the next interval tries again
                log.debug("checkpoint: cannot read end offsets", extra={"kv": {"topic": self.global_topic,
                                                                             "error": str(e)}})
                return
            q = self.next_seq
            if q < self.min_seq or len(offsets) != self.partitions:
                return
            last = self._pending or self._taken
            if last is not None and last.seq == q and tuple(last.offsets) == tuple(offsets):
                self._quiet_at = q
                return  # nothing new
            self._quiet_at = None
            cp = Checkpoint(self.global_topic, q, tuple(offsets), dict(self.wm), self.member, shard=self.shard)
            if self.durable_end >= q:
                if self._write(cp) and q == q0:
                    self._quiet_at = q
            else:
                self._pending = cp  # written by durable() once positions below q are durable
        finally:
            self._busy = False

    async def final(self, timeout: float = 5.0) -> None:
        """At a clean stop (the `run()` task cancelled, every delivery report
        in): take a last checkpoint, exact since nothing is in flight, and
        wait up to `timeout` s for the cluster to confirm it."""
        if self._task is not None:
            self._task.cancel()
        deadline = time.monotonic() + timeout
        while self._busy and time.monotonic() < deadline:  # a cancelled take still finishing
            await asyncio.sleep(0.01)
        self._pending = None
        last = self.last
        if last is not None and last.seq == self.next_seq and (last.seq, tuple(last.offsets)) == self._exact:
            return  # the cluster holds an exact checkpoint of where this topic stands (an idle topic)
        await self.take(exact=True, timeout=max(0.5, deadline - time.monotonic()))  # the stop waits for no more
        if self._pending is None:  # written (or nothing new)
            await asyncio.to_thread(self.producer.flush, max(0.1, deadline - time.monotonic()))

    # ------------------------------------------------------------ to the cluster
    def _write(self, cp: Checkpoint) -> bool:
        """Hand `cp` to the producer; False if it could not take it (taken again later)."""
        self._pending = None
        cp = Checkpoint(cp.topic, cp.seq, cp.offsets, cp.watermarks, cp.member, int(time.time() * 1000), cp.shard)

        def done(err, _msg, cp=cp):
            if err is not None:
                log.warning("checkpoint write failed (taken again later)",
                            extra={"kv": {"topic": self.topic, "seq": cp.seq, "error": err.str()}})
                if self._taken is cp:
                    self._taken = self.last  # so the next take does not see "nothing new"
                    self._quiet_at = None
                return
            if self.last is None or cp.seq >= self.last.seq:
                self.last = cp
                if self.on_written is not None:
                    self.on_written(cp)
            self.written += 1
            log.debug("checkpoint written", extra={"kv": {"topic": self.topic, "seq": cp.seq,
                                                          "offsets": ",".join(map(str, cp.offsets))}})

        try:
            self.producer.produce(self.topic, key=self.key, value=cp.encode(), partition=0,
                                  on_delivery=done)
            self._taken = cp
            return True
        except BufferError:
            return False  # the producer's queue is full of global records: the next interval takes it again
        except Exception as e:  # KafkaException: not fatal, the global topic is what matters
            log.warning("checkpoint write failed (taken again later)",
                        extra={"kv": {"topic": self.topic, "seq": cp.seq, "error": str(e)}})
            return False
