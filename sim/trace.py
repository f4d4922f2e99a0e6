"""The trace of a finished run, built from the simulated clusters in columns.

Theory of operation
-------------------
A run's global topics hold *batches* (`sim.kafka`), one per delivered source
batch; the trace (docs/outputs.md, `kdsync.invariants.TRACE_COLUMNS`) has
one row per (member, record).  Everything here works per batch in NumPy and
per record in Arrow, never with a Python step per record or per batch beyond
reading the batches' fields once: the clock protocol delivers seven times
derecho's batches on the same events (a slot per input), and the trace, the
latency summaries and the byte checks were a fifth of its simulated run.

* `batch_acks(sources, topic)`: when the origin cluster acknowledged each
  batch of a global topic (its records' `submit_ts`; NaN for a batch no
  source holds), computed once per topic and kept on it;
* `TraceSource`: the trace as one Arrow table per (shard, member), the rows
  `kdsync-sim run --out` writes and `RunResult.trace` holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping

import numpy as np

from kdsync.invariants import TRACE_COLUMNS
from sim.kafka import Cluster, GlobalTopic


def batch_acks(sources: Mapping[str, Cluster], topic: GlobalTopic) -> np.ndarray:
    """Per batch of `topic`: when its origin cluster acknowledged its first
    record (the batch's source batch; NaN if no source holds it).  Kept on
    the topic until it grows."""
    cached = topic.acks
    n = len(topic.batches)
    if cached is not None and len(cached) == n:
        return cached
    out = np.full(n, np.nan)
    groups: dict[tuple[str, int], list[int]] = {}
    for i, b in enumerate(topic.batches):
        groups.setdefault((b.origin, b.partition), []).append(i)
    batches = topic.batches
    for (origin, p), idx in groups.items():
        c = sources.get(origin)
        if c is None or p >= len(c.source):
            continue
        src = c.source[p]
        if not src.firsts:
            continue
        at = np.asarray(idx)
        first = np.fromiter((batches[i].first_offset for i in idx), dtype=np.int64, count=len(idx))
        held = first < src.end
        j = np.searchsorted(np.asarray(src.firsts, dtype=np.int64), first[held], side="right") - 1
        out[at[held]] = np.asarray(src.ack)[j]
    topic.acks = out
    return out


def batch_counts(topic: GlobalTopic) -> np.ndarray:
    """The record count of each batch of `topic`."""
    return np.fromiter((x.count for x in topic.batches), dtype=np.int64, count=len(topic.batches))


def batch_columns(topic: GlobalTopic) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """(record counts, partitions, first offsets, origins) of the batches of `topic`."""
    b = topic.batches
    n = len(b)
    counts = batch_counts(topic)
    parts = np.fromiter((x.partition for x in b), dtype=np.int64, count=n)
    firsts = np.fromiter((x.first_offset for x in b), dtype=np.int64, count=n)
    return counts, parts, firsts, [x.origin for x in b]


@dataclass
class TraceSource:
    run_id: str
    clusters: dict[str, Cluster]
    shards: int = 1

    def columns(self) -> dict[str, list]:
        """One row per (member, record in its global topic): expanded only here.
        With shards, each shard (one partition of every global topic) is a run of
        its own (`run_id` ends in /SHARD): its positions are per partition."""
        t: dict[str, list] = {c: [] for c in TRACE_COLUMNS}
        for part in self.chunks():
            for name, values in part.items():
                t[name].extend(values)
        return t

    def chunks(self) -> Iterator[dict[str, list]]:
        """The rows of `columns()`, one (shard, member) at a time."""
        for table in self.tables():
            yield table.to_pydict()

    def tables(self) -> Iterator:
        """The rows as one `pyarrow.Table` (columns TRACE_COLUMNS) per (shard,
        member), built one at a time: a writer that streams them holds one
        member's global topic in memory, not every member's (50 sites x
        800 000 events is 40 M rows)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        for shard in range(self.shards):
            run_id = self.run_id if self.shards == 1 else f"{self.run_id}/{shard}"
            for mid, c in self.clusters.items():
                topic = c.topics[shard]
                n = topic.length
                counts, parts, firsts, origins = batch_columns(topic)
                starts = np.cumsum(counts) - counts  # position of each batch's first record
                offsets = np.arange(n, dtype=np.int64) + np.repeat(firsts - starts, counts)
                origin = pa.array(origins, pa.string()).take(pa.array(np.repeat(np.arange(len(origins)), counts)))
                part = pa.array(np.repeat(parts, counts))
                off = pa.array(offsets)
                event_id = pc.binary_join_element_wise(origin, pc.cast(part, pa.string()),
                                                       pc.cast(off, pa.string()), "/")  # as kdsync audit
                yield pa.table({
                    "run_id": pa.array([run_id] * n, pa.string()),
                    "member": pa.array([mid] * n, pa.string()),
                    "event_id": event_id,
                    "origin": origin,
                    "origin_partition": part,
                    "origin_offset": off,
                    "seq": pa.array(np.arange(n, dtype=np.int64)),
                    "submit_ts": pa.array(np.repeat(batch_acks(self.clusters, topic), counts)),
                    "deliver_ts": pa.array(np.repeat(np.asarray(topic.ts, dtype=np.float64), counts)),
                })
