"""The Kafka model of one cluster: source topic, committed offsets, global topic, disk.

Theory of operation
-------------------
What a member's cluster holds, and what survives a crash of the member.  The
brokers themselves never fail in this model.  Both topics hold *batches*
(what producers send and fetches return), so the model costs per batch,
never per record:

* the source topic, per partition: batches in offset order, each with the
  time the brokers acknowledged it (the records' `submit_ts`) and the time
  it becomes visible to the member's consumer;
* the committed input offsets (where a restarted consumer resumes);
* the global topic: delivered batches in position order, each with the time
  it became durable;
* the member's disk (`HardState`).
"""

from __future__ import annotations

from bisect import bisect_right

from kdsync.core import Batch, HardState
from kdsync.core.batch import read_positions
from kdsync.invariants import watermarks


class SourcePartition:
    """One partition of the source topic: batches in offset order."""

    __slots__ = ("batches", "firsts", "ack", "vis", "end")

    def __init__(self) -> None:
        self.batches: list[Batch] = []
        self.firsts: list[int] = []  # first offset of each batch
        self.ack: list[float] = []  # when the brokers acknowledged it (submit_ts of its records)
        self.vis: list[float] = []  # when it reaches the member's consumer
        self.end = 0  # next offset

    def append(self, b: Batch, ack: float, vis: float) -> None:
        self.batches.append(b)
        self.firsts.append(b.first_offset)
        self.ack.append(ack)
        self.vis.append(vis)
        self.end = b.first_offset + b.count

    def index_of(self, offset: int) -> int:
        """Index of the batch holding `offset` (len(batches) at the end)."""
        if offset >= self.end:
            return len(self.batches)
        return bisect_right(self.firsts, offset) - 1

    def ack_time(self, offset: int) -> float:
        return self.ack[bisect_right(self.firsts, offset) - 1]

    def next_ack_after(self, t: float) -> float:
        """When the first batch acknowledged after `t` is (inf if none yet)."""
        i = bisect_right(self.ack, t)
        return self.ack[i] if i < len(self.ack) else float("inf")


class GlobalTopic:
    """The durable global topic of one cluster: batches in position order."""

    __slots__ = ("batches", "firsts", "ts", "handed", "length", "watermarks", "acks")

    def __init__(self) -> None:
        self.batches: list[Batch] = []
        self.firsts: list[int] = []  # position of each batch's first record
        self.ts: list[float] = []  # when each became durable
        self.handed: list[float] = []  # when the member handed it to its producer (the record's CreateTime)
        self.length = 0
        self.watermarks: dict[tuple[str, int], int] = {}
        self.acks = None  # sim.trace.batch_acks: per batch, when its source acknowledged it (set after the run)

    def append(self, b: Batch, now: float, handed: float | None = None) -> None:
        self.batches.append(b)
        self.firsts.append(self.length)
        self.ts.append(now)
        self.handed.append(now if handed is None else handed)
        self.length += b.count
        watermarks((b,), self.watermarks)

    def read(self, start: int, stop: int) -> list[Batch]:
        """The batches at positions [start, stop), sliced to fit."""
        i = max(0, bisect_right(self.firsts, start) - 1)
        if not self.batches:
            return []
        b = self.batches
        return read_positions((b[j] for j in range(i, len(b))), start, stop, self.firsts[i])


class Cluster:
    """One Kafka cluster: source topic, committed offsets, the global topic
    (one partition per shard) and the member's disk (one hard state per shard)."""

    __slots__ = ("name", "source", "committed", "topics", "disks")

    def __init__(self, name: str, shards: int = 1) -> None:
        self.name = name
        self.source: list[SourcePartition] = []
        self.committed: list[int] = []  # per partition: next offset to consume after a restart
        self.topics = [GlobalTopic() for _ in range(shards)]  # global partition s = shard s's order
        self.disks: list[HardState | None] = [None] * shards

    @property
    def topic(self) -> GlobalTopic:
        """The global topic of an unsharded run (shard 0)."""
        return self.topics[0]

    def ensure_partitions(self, n: int) -> None:
        while len(self.source) < n:
            self.source.append(SourcePartition())
            self.committed.append(0)

    def acknowledged(self) -> int:
        """Records the source topic holds (every write is acknowledged)."""
        return sum(p.end for p in self.source)
