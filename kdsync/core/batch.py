"""`Batch`: the unit the core orders — a contiguous run of one origin partition.

Theory of operation
-------------------
Kafka moves records in batches, and so does the core: a `Batch` is records
`first_offset .. first_offset + count - 1` of one `(origin, partition)`, with
their payloads back to back in one `data` blob, their sizes in `lengths`
(`count` little-endian uint32) and their source timestamps in `timestamps`
(`count` little-endian int64, milliseconds).  The core never looks inside the
blobs: it orders, deduplicates and delivers whole batches, and exactly-once
is arithmetic on offsets — a batch that is partly at or below its origin
watermark is sliced (`Batch.slice`), never delivered twice.  Positions stay
per event: a delivered batch of `count` records takes `count` positions.

Only adapters and tests take a batch apart record by record (`events()`,
`payloads()`), at their edge of the system: the member when it produces the
records to Kafka, the test network when it shows a topic.
"""

from __future__ import annotations

import sys
from array import array
from itertools import accumulate
from typing import Iterable, Iterator, NamedTuple, Sequence

from kdsync.core.errors import LocalProtocolError, RemoteProtocolError

_LITTLE = sys.byteorder == "little"
if array("I").itemsize != 4 or array("q").itemsize != 8:  # pragma: no cover - exotic platforms
    raise ImportError("kdsync.core.batch needs 4-byte array('I') and 8-byte array('q')")


class Event(NamedTuple):
    """One source record, as adapters and tests see it (a batch taken apart).

    `(origin, partition, offset)` identifies the event.  `payload` is opaque
    to the core (the Kafka bridge packs key, value and headers into it);
    `timestamp_ms` is the source record's timestamp, carried for latency.
    """

    origin: str
    partition: int
    offset: int
    payload: bytes = b""
    timestamp_ms: int = 0


def _u32(values: Iterable[int]) -> bytes:
    a = array("I", values)
    if not _LITTLE:  # pragma: no cover
        a.byteswap()
    return a.tobytes()


def _i64(values: Iterable[int]) -> bytes:
    a = array("q", values)
    if not _LITTLE:  # pragma: no cover
        a.byteswap()
    return a.tobytes()


def _read(code: str, blob: bytes) -> array:
    a = array(code)
    a.frombytes(blob)
    if not _LITTLE:  # pragma: no cover
        a.byteswap()
    return a


class Batch:
    """Records `first_offset .. first_offset+count-1` of `(origin, partition)`.

    Immutable by convention (slots, no setters used anywhere); equality is by
    value.  Build one with `Batch.of(...)` from payloads, `Batch.from_events`
    from Events, or `Batch.uniform(...)` for synthetic records of one size.
    """

    __slots__ = ("origin", "partition", "first_offset", "count", "data", "lengths", "timestamps")

    def __init__(
        self,
        origin: str,
        partition: int,
        first_offset: int,
        count: int,
        data: bytes,
        lengths: bytes,
        timestamps: bytes,
    ) -> None:
        self.origin = origin
        self.partition = partition
        self.first_offset = first_offset
        self.count = count
        self.data = data
        self.lengths = lengths
        self.timestamps = timestamps

    # ------------------------------------------------------------ building
    @classmethod
    def of(cls, origin: str, partition: int, first_offset: int, payloads: Sequence[bytes],
           timestamps: Sequence[int] | int = 0) -> "Batch":
        """A batch of `payloads` at consecutive offsets from `first_offset`;
        `timestamps` is one per payload, or one value for all."""
        n = len(payloads)
        if n == 0:
            raise LocalProtocolError("a batch holds at least one record")
        ts = _i64([timestamps] * n) if isinstance(timestamps, int) else _i64(timestamps)
        if len(ts) != 8 * n:
            raise LocalProtocolError("one timestamp per payload")
        return cls(origin, partition, first_offset, n, b"".join(payloads), _u32(map(len, payloads)), ts)

    @classmethod
    def uniform(cls, origin: str, partition: int, first_offset: int, count: int, size: int,
                timestamp_ms: int = 0, fill: bytes = b".") -> "Batch":
        """`count` synthetic records of `size` bytes each (the simulator's workload)."""
        if count <= 0:
            raise LocalProtocolError("a batch holds at least one record")
        return cls(origin, partition, first_offset, count, fill[:1] * (size * count),
                   _u32([size]) * count, _i64([timestamp_ms]) * count)

    @classmethod
    def from_events(cls, events: Sequence[Event]) -> "Batch":
        """One batch from Events of one (origin, partition) at consecutive offsets."""
        if not events:
            raise LocalProtocolError("a batch holds at least one record")
        e0 = events[0]
        for i, e in enumerate(events):
            if e.origin != e0.origin or e.partition != e0.partition or e.offset != e0.offset + i:
                raise LocalProtocolError("a batch is a contiguous run of one origin partition")
        return cls.of(e0.origin, e0.partition, e0.offset, [e.payload for e in events],
                      [e.timestamp_ms for e in events])

    # ----------------------------------------------------------- reading
    @property
    def end_offset(self) -> int:
        """The offset after the last record."""
        return self.first_offset + self.count

    def payloads(self) -> list[bytes]:
        """The records' payloads, in offset order."""
        data = self.data
        ends = list(accumulate(_read("I", self.lengths)))
        starts = [0, *ends[:-1]]
        return [data[a:b] for a, b in zip(starts, ends)]

    def timestamps_ms(self) -> list[int]:
        return list(_read("q", self.timestamps))

    def events(self) -> list[Event]:
        """The batch taken apart (for adapters and tests, not the hot path)."""
        o, p, f = self.origin, self.partition, self.first_offset
        return [Event(o, p, f + i, pl, ts) for i, (pl, ts) in enumerate(zip(self.payloads(), self.timestamps_ms()))]

    def slice(self, start: int, stop: int | None = None) -> "Batch":
        """Records with index start..stop-1 (0-based within the batch) as a batch."""
        n = self.count
        stop = n if stop is None else min(stop, n)
        if not 0 <= start < stop:
            raise LocalProtocolError(f"empty or bad slice [{start}, {stop}) of a batch of {n}")
        if start == 0 and stop == n:
            return self
        lens = _read("I", self.lengths)
        lo = sum(lens[:start])
        hi = lo + sum(lens[start:stop])
        return Batch(self.origin, self.partition, self.first_offset + start, stop - start, self.data[lo:hi],
                     self.lengths[4 * start : 4 * stop], self.timestamps[8 * start : 8 * stop])

    @classmethod
    def join(cls, parts: Sequence["Batch"]) -> "Batch":
        """Consecutive batches of one origin partition (each starting where the
        one before ends) as one batch."""
        b0 = parts[0]
        if len(parts) == 1:
            return b0
        end = b0.first_offset
        for b in parts:
            if b.origin != b0.origin or b.partition != b0.partition or b.first_offset != end:
                raise LocalProtocolError("joined batches are a contiguous run of one origin partition")
            end += b.count
        return cls(b0.origin, b0.partition, b0.first_offset, end - b0.first_offset,
                   b"".join([b.data for b in parts]), b"".join([b.lengths for b in parts]),
                   b"".join([b.timestamps for b in parts]))

    def after(self, watermark: int) -> "Batch | None":
        """The part of this batch above `watermark` (an origin offset), or None."""
        if self.first_offset > watermark:
            return self
        if self.first_offset + self.count - 1 <= watermark:
            return None
        return self.slice(watermark + 1 - self.first_offset)

    # ------------------------------------------------------------- wire
    def fields(self) -> list:
        """The batch as a flat msgpack-able list (one wire item per field)."""
        return [self.origin, self.partition, self.first_offset, self.count, self.data, self.lengths, self.timestamps]

    @classmethod
    def from_fields(cls, f) -> "Batch":
        """Inverse of fields(); checks every shape.  Raises RemoteProtocolError."""
        if type(f) is not list or len(f) != 7:
            raise RemoteProtocolError("a batch is an array of 7 fields")
        origin, partition, first, count, data, lengths, ts = f
        if (
            type(origin) is not str
            or type(partition) is not int
            or type(first) is not int
            or type(count) is not int
            or type(data) is not bytes
            or type(lengths) is not bytes
            or type(ts) is not bytes
            or partition < 0
            or first < 0
            or count <= 0
            or len(lengths) != 4 * count
            or len(ts) != 8 * count
        ):
            raise RemoteProtocolError("bad batch fields")
        if sum(_read("I", lengths)) != len(data):
            raise RemoteProtocolError("batch record sizes do not add up to its data")
        return cls(origin, partition, first, count, data, lengths, ts)

    # ---------------------------------------------------------- identity
    def key(self) -> tuple:
        return (self.origin, self.partition, self.first_offset, self.count, self.data, self.lengths, self.timestamps)

    def __eq__(self, other) -> bool:
        return isinstance(other, Batch) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash((self.origin, self.partition, self.first_offset, self.count))

    def __repr__(self) -> str:
        return f"Batch({self.origin}/{self.partition}@{self.first_offset}+{self.count})"


def batches_from_events(events: Iterable[Event]) -> list[Batch]:
    """Cut Events into batches: a new batch wherever origin, partition or
    offset contiguity breaks (for adapters that read records one by one)."""
    out: list[Batch] = []
    run: list[Event] = []
    for e in events:
        if run and (e.origin != run[0].origin or e.partition != run[0].partition or e.offset != run[-1].offset + 1):
            out.append(Batch.from_events(run))
            run = []
        run.append(e)
    if run:
        out.append(Batch.from_events(run))
    return out


def coalesce(batches: Sequence[Batch]) -> list[Batch]:
    """Fewer, larger batches with the same records: the runs of each origin
    partition joined where they are contiguous.  Each partition's records keep
    their order; partitions come in the order of their first batch."""
    runs: dict[tuple[str, int], list[list[Batch]]] = {}
    for b in batches:
        k = (b.origin, b.partition)
        r = runs.get(k)
        if r is None:
            runs[k] = [[b]]
        else:
            last = r[-1][-1]
            if last.first_offset + last.count == b.first_offset:
                r[-1].append(b)
            else:
                r.append([b])
    if len(runs) == len(batches):
        return list(batches)
    return [Batch.join(run) for rs in runs.values() for run in rs]


def read_positions(batches: Iterable[Batch], start: int, stop: int, pos: int = 0) -> list[Batch]:
    """The records at positions [start, stop) of consecutive `batches` whose
    first record is at position `pos`, as batches (those at both ends sliced)."""
    out: list[Batch] = []
    for b in batches:
        end = pos + b.count
        if end > start and pos < stop:
            out.append(b.slice(max(0, start - pos), stop - pos))
        pos = end
        if pos >= stop:
            break
    return out


def iter_events(batches: Iterable[Batch]) -> Iterator[Event]:
    """Every record of `batches`, in order."""
    for b in batches:
        yield from b.events()


def total(batches: Iterable[Batch]) -> int:
    """How many records `batches` hold."""
    return sum(b.count for b in batches)
