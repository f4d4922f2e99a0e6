"""Reading a member's global topic back: at start (where to resume) and for
catch-up reads (positions the ordering node no longer holds in memory).

Both read to partition EOF with `kdsync.kafka.topic.read_to_eof`, never by
ListOffsets alone.  Blocking: the member runs them in a worker thread.
"""

from __future__ import annotations

from contextlib import closing
from typing import NamedTuple

from kdsync.core import Event
from kdsync.kafka.records import event_from_global
from kdsync.kafka.topic import consumer, iter_partition, read_to_eof

__all__ = ["GlobalReader", "GlobalScan", "scan_global"]


class GlobalScan(NamedTuple):
    """What a global topic holds, read to its end."""

    end: int  # end of the contiguous prefix of positions: the next position to write
    watermarks: dict[tuple[str, int], int]  # (origin, partition) -> highest origin offset in the prefix
    present: set[int]  # positions present beyond the prefix


def scan_global(conf: dict, global_topic: str, partitions: int, timeout: float = 60.0) -> GlobalScan:
    """Read every partition of the global topic to its end.

    With one partition the prefix is the whole topic.  With several, a crash
    can leave position k missing in one partition while k+1 landed in
    another: the node restarts at k, and positions already present above it
    are not written again when they are delivered (see GlobalWriter).  Raises
    ForeignRecordError on a record kdsync did not write, TimeoutError or
    KafkaException when the brokers do not answer."""
    events: dict[int, Event] = {}
    for p in range(partitions):
        for m in iter_partition(conf, global_topic, p, timeout=timeout):
            seq, ev = event_from_global(m)
            events[seq] = ev
    end = 0
    while end in events:
        end += 1
    wm: dict[tuple[str, int], int] = {}
    for seq in range(end):
        ev = events[seq]
        k = (ev.origin, ev.partition)
        if ev.offset > wm.get(k, -1):
            wm[k] = ev.offset
    return GlobalScan(end, wm, {seq for seq in events if seq > end})


class GlobalReader:
    """Answers reads of positions [start, stop) of one global topic, with one
    long-lived consumer (`conf` as for the source consumer, in consumer group
    `group_id`, which commits nothing).  Not thread-safe: one read at a time."""

    def __init__(self, conf: dict, group_id: str, global_topic: str, partitions: int):
        self.conf = {**conf, "group.id": group_id, "fetch.wait.max.ms": 10}
        self.global_topic = global_topic
        self.partitions = partitions
        self._c = None

    def read(self, start: int, stop: int, timeout: float = 60.0) -> list[Event]:
        """The events at positions [start, stop) (fewer if the topic ends
        first).  One partition: seq == offset, read from `start`; several: scan.
        Raises TimeoutError, KafkaException or ForeignRecordError."""
        if self._c is None:
            self._c = consumer(self.conf)
        found: dict[int, Event] = {}
        for p in range(self.partitions):
            one = self.partitions == 1
            with closing(read_to_eof(self._c, self.global_topic, p, start if one else 0, timeout=timeout)) as recs:
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
