"""Reading a member's global topic back: at start (where to resume) and for
catch-up reads (positions the ordering node no longer holds in memory).

Both read to partition EOF with `kdsync.kafka.topic.read_to_eof`, never by
ListOffsets alone.  Blocking: the member runs them in a worker thread.

Start-up (`load_start`) reads the latest checkpoint (kdsync.kafka.checkpoint)
and then each global partition only from the checkpoint's offset to its end,
so it takes the same time whatever the topic's length.  `decide_start` turns
what was read into the start position, the origin watermarks and the
positions already written beyond a gap; its docstring has the rules for a
topic whose oldest records were deleted (retention) or that was restored
from an archive starting past position 0.
"""

from __future__ import annotations

import bisect
import logging
from array import array
from contextlib import closing
from dataclasses import dataclass, field
from itertools import chain
from typing import NamedTuple

from kdsync.core import Event
from kdsync.fatal import FatalError
from kdsync.kafka.checkpoint import Checkpoint, checkpoint_topic, read_checkpoint
from kdsync.kafka.gaps import ReadGaps
from kdsync.kafka.records import GlobalHeaders, event_from_global, read_global_headers
from kdsync.kafka.topic import FetchStalledError, consumer, read_to_eof

__all__ = ["GlobalReader", "GlobalStart", "PartitionRead", "StartError", "decide_start", "load_start"]

log = logging.getLogger("kdsync.start")

# consume() waits this long for a full batch: a short read (the few records after a checkpoint) ends
# this long after its partition EOF
POLL = 0.02


class StartError(FatalError):
    """The positions of a global topic cannot be proven at start; str() is one line."""


class GlobalStart(NamedTuple):
    """Where a member resumes writing a global topic."""

    end: int  # the next position to write
    watermarks: dict[tuple[str, int], int]  # (origin, partition) -> highest origin offset below `end`
    present: set[int]  # positions already in the topic beyond `end` (a crash gap, several partitions)
    ends: tuple[int, ...]  # each partition's end offset, as read
    records: int  # records read to get here
    checkpoint: Checkpoint | None  # the checkpoint started from
    lost: tuple[int, int] | None  # positions [a, b) gone from the topic before a checkpoint covered them
    seq_base: int  # one partition: kdsync.seq - offset (0 unless restored from an archive starting past 0)


# how a partition was read (see decide_start)
ANCHORED, FROM_START, AT_CHECKPOINT, AFTER_DELETION = "anchored", "from-start", "at-checkpoint", "after-deletion"


@dataclass
class PartitionRead:
    """The records of one global partition read at start: offsets, positions,
    (origin, partition) index into the shared key list, origin offsets (arrays:
    a million records take 32 MB)."""

    partition: int
    low: int  # log start offset: records below were deleted
    start: int  # offset the read started from
    how: str = FROM_START
    anchor: int = 0  # ANCHORED: index of the record just before the checkpoint's offset
    end: int = 0  # partition end (EOF offset)
    offsets: array = field(default_factory=lambda: array("q"))
    seqs: array = field(default_factory=lambda: array("q"))
    keys: array = field(default_factory=lambda: array("l"))
    origin_offsets: array = field(default_factory=lambda: array("q"))

    def add(self, offset: int, seq: int, key: int, origin_offset: int) -> None:
        self.offsets.append(offset)
        self.seqs.append(seq)
        self.keys.append(key)
        self.origin_offsets.append(origin_offset)


class _Keys:
    """(origin, partition) <-> small int, shared by the partitions read."""

    def __init__(self):
        self.index: dict[tuple[str, int], int] = {}
        self.list: list[tuple[str, int]] = []

    def of(self, k: tuple[str, int]) -> int:
        i = self.index.get(k)
        if i is None:
            i = self.index[k] = len(self.list)
            self.list.append(k)
        return i


def _position(m) -> GlobalHeaders:
    try:
        h = read_global_headers(m.headers())
    except ValueError:
        h = None
    if h is None:
        event_from_global(m)  # raises ForeignRecordError naming the record
    return h


def _read(c, topic: str, p: int, start: int, low: int, keys: _Keys, timeout: float,
          gaps: ReadGaps | None = None) -> PartitionRead:
    r = PartitionRead(p, low, start)
    gen = read_to_eof(c, topic, p, start, timeout=timeout, idle=True, poll=POLL, gaps=gaps)
    of = keys.of
    end = None
    try:
        while True:
            m = next(gen)
            h = _position(m)
            r.add(m.offset(), h.seq, of((h.origin, h.origin_partition)), h.origin_offset)
    except StopIteration as stop:
        end = stop.value
    finally:
        gen.close()
    r.end = end if end is not None else (r.offsets[-1] + 1 if r.offsets else start)
    return r


def _exists(c, topic: str, p: int, offset: int, timeout: float = 2.0, gaps: ReadGaps | None = None) -> bool:
    """Whether topic[p] holds a record at `offset` at or beyond what
    ListOffsets reported as its end (Tansu reports too low an end after
    multi-record batches, and never answers a fetch beyond the end: hence a
    short timeout)."""
    try:
        with closing(read_to_eof(c, topic, p, offset, offset + 1, timeout=timeout, poll=POLL, gaps=gaps)) as recs:
            return any(m.offset() == offset for m in recs)
    except TimeoutError:
        return False


def _read_partition(c, topic: str, p: int, low: int, high: int, cp: Checkpoint | None, keys: _Keys,
                    timeout: float, index: int | None = None, gaps: ReadGaps | None = None) -> PartitionRead:
    """Read partition p from where the checkpoint says (module doc of
    kdsync.kafka.checkpoint), checking the record just before; from its
    first record when there is no checkpoint or it does not fit.  `low`,
    `high`: the partition's offsets as ListOffsets reports them (`high` may
    be too low; a read never starts beyond it, as some brokers then never
    report the end).  `index`: p's place in the checkpoint's offsets (a
    shard's checkpoint has one; default p).  `gaps`: the read's gap
    accounting (kdsync.kafka.gaps.ReadGaps)."""
    seq = cp.seq if cp is not None else 0
    h = cp.offsets[p if index is None else index] if cp is not None else None
    if h is not None and h >= 1 and h - 1 >= low:
        first = h - 1 if h - 1 < high or _exists(c, topic, p, h - 1, gaps=gaps) else max(low, high - 1)
        r = _read(c, topic, p, first, low, keys, timeout, gaps)
        i = bisect.bisect_left(r.offsets, h - 1)
        if i < len(r.offsets) and r.offsets[i] == h - 1 and r.seqs[i] < seq:
            r.how = ANCHORED  # records read before the anchor have positions below it: harmless
            r.anchor = i
            return r
        log.warning("checkpoint offsets do not fit the global topic (restored or recreated since?); "
                    "reading the partition from its first record",
                    extra={"kv": {"topic": topic, "partition": p, "checkpoint_offset": h, "checkpoint_seq": seq}})
        if first > low:
            r = _read(c, topic, p, low, low, keys, timeout, gaps)
    elif h is not None and h >= low:  # h == 0, or the record before h was deleted but none after
        r = _read(c, topic, p, h, low, keys, timeout, gaps)
        if h == 0:
            r.how = FROM_START
            return r
        if not r.seqs or r.seqs[0] >= seq:
            r.how = AT_CHECKPOINT
            return r
        # a record below the checkpoint's position at its offset: the offsets do not fit; h == low, so
        # these are the partition's records from its first one
    else:
        r = _read(c, topic, p, low, low, keys, timeout, gaps)
    r.how = FROM_START if low == 0 else AFTER_DELETION
    return r


def load_start(conf: dict, global_topic: str, partitions: int, timeout: float = 60.0,
               shard: int | None = None) -> GlobalStart:
    """Read the latest checkpoint of `global_topic` and the topic from there
    to its end; return where to resume (see `decide_start`).  `timeout`
    counts from the last record received, so a long read that progresses
    never times out; an offset of the topic neither read nor explained
    (kdsync.kafka.gaps.ReadGaps) is fetched again, and raises GlobalGapError
    when it cannot be.  `shard`: the start of that shard, which owns partition
    `shard` alone (its checkpoints, kdsync.kafka.checkpoint; `partitions` is
    then 1).  Raises StartError (positions cannot be proven),
    ForeignRecordError (a record kdsync did not write), TimeoutError or
    KafkaException (the brokers do not answer)."""
    from confluent_kafka import TopicPartition

    keys = _Keys()
    gaps = ReadGaps(conf)  # every position between the checkpoint and the end is read, or the start fails
    with closing(consumer(conf)) as c:
        cp = read_checkpoint(c, global_topic, timeout, shard=shard)
        ids = [shard] if shard is not None else list(range(partitions))
        if cp is not None and len(cp.offsets) != len(ids):
            log.warning("checkpoint is for another partition count; ignoring its offsets",
                        extra={"kv": {"topic": global_topic, "partitions": partitions, "checkpoint": len(cp.offsets)}})
            cp = Checkpoint(cp.topic, cp.seq, (), cp.watermarks, cp.member, cp.written_ms, cp.shard)
        marks = [c.get_watermark_offsets(TopicPartition(global_topic, p), timeout=timeout, cached=False)
                 for p in ids]
        offsets_cp = cp if cp is not None and cp.offsets else None
        reads = [_read_partition(c, global_topic, p, max(low, 0), max(high, 0), offsets_cp, keys, timeout, i, gaps)
                 for i, (p, (low, high)) in enumerate(zip(ids, marks))]
    return decide_start(global_topic, reads, cp, keys.list)


def decide_start(global_topic: str, reads: list[PartitionRead], cp: Checkpoint | None,
                 keys: list[tuple[str, int]]) -> GlobalStart:
    """Where to resume, from the partitions read at start and the checkpoint
    (None: none yet, e.g. after an upgrade from a version without them).

    Per partition, a floor: every record of it with a position at or above
    the floor has been read.  Anchored at the checkpoint (the record before
    its offset was read and is below its position): that record's position
    + 1.  Read from offset 0: 0.  Read from the checkpoint's offset, the
    record before deleted: the checkpoint's position.  Read from the first
    record left after deletions (retention): that record's position; none
    left: unknown, and the start is refused.  Below the highest floor,
    positions may be gone; from there, the first position missing is where
    writing resumes.  Positions missing below it while later ones are present
    are a crash gap only if some partition holds nothing at or above it
    (several partitions, see GlobalWriter); otherwise the topic does not
    start at position 0 (restored from an archive that starts later) and the
    floors of partitions read from offset 0 become their first record's
    position too; still unexplained: refused.  The watermarks are the
    checkpoint's, raised by every record read below the start: exact for
    every origin partition with a record since the checkpoint; when
    positions were lost between the checkpoint and the first record left
    (`lost`), an origin partition seen only there keeps the checkpoint's
    value.  Raises StartError when the checkpoint says positions are durable
    that the topic does not hold, or the next position cannot be proven."""
    seq = cp.seq if cp is not None else 0
    name = global_topic
    cpt = checkpoint_topic(global_topic)
    for r in reads:
        if r.how == AFTER_DELETION and not r.seqs:
            where = (f"after the checkpoint at position {seq} (offset {cp.offsets[r.partition]})"
                     if cp is not None and cp.offsets else f"and {cpt} holds no checkpoint")
            raise StartError(f"cannot prove the next position of {name}: partition {r.partition} is empty, its "
                             f"records up to offset {r.low} were deleted (retention) {where}; restore {name} from "
                             f"an archive (kdsync restore) or another cluster, see docs/operations.md")
    P = len(reads)
    one = P == 1
    if one:
        seqs = reads[0].seqs
        if any(a >= b for a, b in zip(seqs, seqs[1:])):
            seqs = sorted(seqs)
    else:
        seqs = sorted(chain.from_iterable(r.seqs for r in reads))
    n = len(seqs)

    def walk(x: int) -> tuple[int, int]:
        """(first position >= x not in the topic, index of the first record beyond it)."""
        i = bisect.bisect_left(seqs, x)
        k = x
        while i < n and seqs[i] <= k:
            if seqs[i] == k:
                k += 1
            i += 1
        return k, i

    def explained(k: int) -> bool:
        return not one and any(not r.seqs or r.seqs[-1] < k for r in reads)

    def floor(r: PartitionRead, restored: bool) -> int:
        if r.how == ANCHORED:
            return r.seqs[r.anchor] + 1
        if r.how == AT_CHECKPOINT:
            return seq
        if r.how == FROM_START and not restored:
            return 0
        return r.seqs[0] if r.seqs else 0

    for restored in (False, True):
        top = max((floor(r, restored) for r in reads), default=0)
        if top < seq:
            k, _ = walk(top)
            if k < seq:
                if not restored:
                    continue  # perhaps restored from an archive that starts past 0: floors from the records
                raise StartError(f"{cpt} says positions below {seq} are durable in {name}, but {name} does not "
                                 f"hold position {k} (was {name} deleted and created again? then delete {cpt} "
                                 f"too, or restore {name}), see docs/operations.md")
        x = max(seq, top)
        start, i = walk(x)
        if i >= n or explained(start):
            break
        if restored:
            raise StartError(f"{name} has a hole at position {start} (position {seqs[i]} is present) that no "
                             f"crash explains; kdsync must be the only writer of its global topics")
    present = set(seqs[i:]) if i < n else set()
    present.discard(start)
    wm = dict(cp.watermarks) if cp is not None else {}
    for r in reads:
        for s_, k_, off in zip(r.seqs, r.keys, r.origin_offsets):
            if s_ < start:
                key = keys[k_]
                if off > wm.get(key, -1):
                    wm[key] = off
    ends = tuple(r.end for r in reads)
    base = 0
    if one:
        r = reads[0]
        base = (r.seqs[-1] - r.offsets[-1]) if r.seqs else start - r.end
    return GlobalStart(start, wm, present, ends, sum(len(r.seqs) for r in reads), cp,
                       (seq, x) if x > seq else None, base)


class GlobalReader:
    """Answers reads of positions [start, stop) of one global topic, with one
    long-lived consumer (`conf` as for the source consumer, in consumer group
    `group_id`, which commits nothing).  Not thread-safe: one read at a time.
    `shard`: the positions of that shard, in partition `shard` alone (then
    `partitions` is 1)."""

    def __init__(self, conf: dict, group_id: str, global_topic: str, partitions: int, seq_base: int = 0,
                 shard: int | None = None):
        self.conf = {**conf, "group.id": group_id, "fetch.wait.max.ms": 10}
        self.global_topic = global_topic
        self.partitions = partitions
        self.ids = [shard] if shard is not None else list(range(partitions))
        self.seq_base = seq_base  # one partition: position - offset (a topic restored from past position 0)
        self._c = None
        self.gaps = ReadGaps(conf)

    def read(self, start: int, stop: int, timeout: float = 60.0) -> list[Event]:
        """The events at positions [start, stop) (fewer if the topic ends
        first).  One partition: read from offset `start - seq_base`; several: scan.
        Raises TimeoutError, KafkaException, ForeignRecordError or
        GlobalGapError (an offset the broker does not hand over)."""
        if self._c is None:
            self._c = consumer(self.conf)
        try:
            return self._read(start, stop, timeout)
        except FetchStalledError:
            self.close()  # the retry asks with a new consumer (and a longer fetch wait)
            raise

    def _read(self, start: int, stop: int, timeout: float) -> list[Event]:
        found: dict[int, Event] = {}
        for p in self.ids:
            one = len(self.ids) == 1
            first = max(0, start - self.seq_base) if one else 0
            with closing(read_to_eof(self._c, self.global_topic, p, first, timeout=timeout, gaps=self.gaps)) as recs:
                for m in recs:
                    seq, ev = event_from_global(m)
                    if start <= seq < stop:
                        found[seq] = ev
                    if one and seq + 1 >= stop:
                        break
        out = []
        for s in range(start, stop):
            if s not in found:
                break
            out.append(found[s])
        return out

    def close(self) -> None:
        """Close the consumer (if one was opened)."""
        if self._c is not None:
            self._c.close()
            self._c = None
