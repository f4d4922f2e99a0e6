"""The simulator's side of the invariant checker (`kdsync.invariants`).

The checks themselves, and their vocabulary, live in `kdsync.invariants`; this
module collects what only the simulator can see while a run goes on — views
each member installed, deliveries a member made while no majority could
reach it (its two-way-connected component of up members was not larger than
half the configuration), positions handed over out of turn — and hands the
final global topics to `kdsync.invariants.check` as runs, one per delivered
batch, so a run of millions of records is judged per batch.  It never looks
at a node's own view of itself.  Kinds (docs/scenario.md): `agreement`,
`integrity`, `loss`, `origin_order`, `split_brain`, plus `expect` for a
scenario's own extra assertions; each violation also names its finer anomaly.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Iterable, Mapping, Sequence

from kdsync.invariants import (
    AGREEMENT,
    KINDS,
    SPLIT_BRAIN,
    OffsetRanges,
    Recorder,
    Run,
    Violation,
    check,
    event_id,
    runs_from_batches,
)
from kdsync.core import Batch, Delivery
from sim.kafka import Cluster, GlobalTopic

# kinds that the mirror baseline is allowed to show (it does not agree on an order)
MIRROR_TOLERATED = frozenset({AGREEMENT, SPLIT_BRAIN})

__all__ = ["KINDS", "MIRROR_TOLERATED", "Checker", "Violation", "event_id"]


class Checker(Recorder):
    """Collects what must be judged during the run; `finish()` judges."""

    def __init__(self, initial_members: Sequence[str] = (), shard: int = 0, shards: int = 1) -> None:
        super().__init__()
        self.initial_members = tuple(initial_members)
        self.shard, self.shards = shard, shards  # the ordering group judged (see partitions_of)

    def on_deliveries(self, member: str, deliveries: Iterable[Delivery], in_majority: bool) -> None:
        """`member` handed these over; `in_majority`: could a majority reach it then?"""
        if in_majority:
            return
        for d in deliveries:
            self.on_minority(member, runs_from_batches(d.batches, d.first_seq))

    def finish(self, topics: Mapping[str, GlobalTopic], sources: Mapping[str, Cluster],
               live: Iterable[str]) -> list[Violation]:
        """Judge the final global topics of one ordering group (member -> its
        global topic, or the partition of its shard, in rank order) against
        what the `sources` clusters acknowledged; `live`: the members up at the
        end (after settle, all in the majority).  Records are compared byte for
        byte with what was submitted."""
        submitted = OffsetRanges()
        for origin, p in self.partitions_of(sources):
            end = sources[origin].source[p].end
            if end:
                submitted.add(origin, p, 0, end)
        return check(
            {m: runs_from_batches(t.batches) for m, t in topics.items()},
            submitted=submitted,
            live=live,
            content=_ContentCheck(topics, sources),
            views=self.views,
            initial_members=self.initial_members,
            minority=self.minority,
            gaps=self.gaps,
        )

    def partitions_of(self, sources: Mapping[str, Cluster]) -> list[tuple[str, int]]:
        """The source partitions this group orders: p with p % shards == shard."""
        return [(o, p) for o, c in sources.items() for p in range(self.shard, len(c.source), self.shards)]


class _ContentCheck:
    """`kdsync.invariants.ContentCheck` over the simulated topics: the records at
    positions run.seq.. of a member's global topic against the source records
    of the same offsets, batch slice against batch slice (bytes compared in
    C); record by record only where a slice differs."""

    def __init__(self, topics: Mapping[str, GlobalTopic], sources: Mapping[str, Cluster]) -> None:
        self.topics, self.sources = topics, sources
        self._want: dict[tuple, Batch | None] = {}  # (origin, partition, first offset, count) -> the source's records

    def whole(self, member: str) -> bool:
        """Every record of `member`'s global topic is the submitted one: each
        delivered batch against the source records of its offsets (joined
        once per distinct batch, which every member delivers alike)."""
        want, get = self._want, self._want.get
        for b in self.topics[member].batches:
            key = (b.origin, b.partition, b.first_offset, b.count)
            w = get(key, False)
            if w is False:
                w = want[key] = self._source_batch(*key)
            if w is None or b.data != w.data or b.lengths != w.lengths or b.timestamps != w.timestamps:
                return False  # the runs say which and where
        return True

    def _source_batch(self, origin: str, partition: int, first_offset: int, count: int) -> Batch | None:
        c = self.sources.get(origin)
        if c is None or partition >= len(c.source):
            return None
        parts = _source_slice(c.source[partition], first_offset, count)
        return None if parts is None else Batch.join(parts)

    def __call__(self, member: str, run: Run) -> tuple[int, int] | None:
        src_c = self.sources.get(run.origin)
        if src_c is None or run.partition >= len(src_c.source):
            return None  # not submitted at all: the foreign check reports it
        src = src_c.source[run.partition]
        topic = self.topics[member]
        bad, first = 0, -1
        i = max(0, bisect_right(topic.firsts, run.seq) - 1)
        done = 0
        while done < run.count and i < len(topic.batches):
            b, pos = topic.batches[i], topic.firsts[i]
            lo = max(run.seq + done, pos)
            hi = min(run.seq + run.count, pos + b.count)
            if lo < hi:
                got = b.slice(lo - pos, hi - pos)
                want = _source_slice(src, got.first_offset, got.count)
                if want is None or not _same_records(got, want):
                    n, at = _count_bad(got, want)
                    if n:
                        if first < 0:
                            first = lo - run.seq + at
                        bad += n
                done = hi - run.seq
            i += 1
        return (bad, first) if bad else None


def _source_slice(src, first_offset: int, count: int) -> list[Batch] | None:
    """The source batches (sliced) holding offsets first_offset..+count, or None past the end."""
    if first_offset + count > src.end:
        return None
    out: list[Batch] = []
    i = bisect_right(src.firsts, first_offset) - 1
    off, end = first_offset, first_offset + count
    while off < end:
        b = src.batches[i]
        take = min(end, b.first_offset + b.count) - off
        out.append(b.slice(off - b.first_offset, off - b.first_offset + take))
        off += take
        i += 1
    return out


def _same_records(got: Batch, want: list[Batch]) -> bool:
    if len(want) == 1:
        w = want[0]
        return got.data == w.data and got.lengths == w.lengths and got.timestamps == w.timestamps
    return (got.data == b"".join(w.data for w in want) and got.lengths == b"".join(w.lengths for w in want)
            and got.timestamps == b"".join(w.timestamps for w in want))


def _count_bad(got: Batch, want: list[Batch] | None) -> tuple[int, int]:
    """(records that differ, index of the first) between a delivered slice and its source."""
    if want is None:
        return 0, -1  # offsets never acknowledged: the foreign check reports them
    ref = [e for w in want for e in w.events()]
    n, first = 0, -1
    for j, e in enumerate(got.events()):
        r = ref[j]
        if (e.payload, e.timestamp_ms) != (r.payload, r.timestamp_ms):
            n += 1
            first = j if first < 0 else first
    return n, first
