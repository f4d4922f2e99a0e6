"""The workload as producer batches: what each cluster's source topic receives.

Theory of operation
-------------------
A real producer does not send records one by one: it collects them for
`linger.ms` and sends one batch per partition.  So does this model.  Time
is cut into producer ticks of `kafka.linger_ms`; for every workload entry,
cluster, tick and partition the number of new records is Poisson with mean
rate × tick / partitions (drawn for a whole block of ticks at once, with
NumPy), and every non-empty (tick, partition) becomes one `Batch` written
at the tick's end.  A burst writes its records at `at_s`, spread over the
partitions (multinomial).  With `linger_ms: 0` each record is its own batch
at its own Poisson arrival time (the exact, slow model).  `arrivals: paced`
replaces the Poisson arrivals of a rate by one record every 1/rate (a paced
writer, as the real bench's), gathered into ticks or lingered the same way.

Everything is drawn from generators seeded by a string derived from the
run seed (SHA-256 → PCG64), so a run is the same on every machine and for
every PYTHONHASHSEED.  The cost is per batch, never per record: at 100 000
records per second and 5 ms ticks a cluster writes a few hundred batches a
second whatever the rate.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from sim.scenario import Scenario, WorkloadSpec


@dataclass(frozen=True, slots=True)
class Write:
    """`count` records for one partition of one cluster, sent at `t` (seconds)."""

    t: float
    entry: int  # workload entry index (ties at one instant keep file order)
    partition: int
    count: int
    payload_bytes: int


def _generator(seed: int, *parts) -> np.random.Generator:
    digest = hashlib.sha256("/".join(map(str, (seed, *parts))).encode()).digest()
    return np.random.Generator(np.random.PCG64(int.from_bytes(digest[:16], "little")))


def writes(s: Scenario, seed: int, cluster: str, block_s: float) -> Iterator[list[Write]]:
    """The writes at `cluster`, block by block of `block_s` seconds, each block
    in time order (entry order on ties).  Pure function of its arguments."""
    tick = s.kafka.linger_ms / 1000.0
    entries = [(i, w) for i, w in enumerate(s.workload) if w.member in ("all", cluster)]
    streams = [_entry_writes(s, seed, cluster, i, w, tick, block_s) for i, w in entries]
    pending = [next(st, None) for st in streams]
    block = 0
    while any(p is not None for p in pending):
        end = (block + 1) * block_s
        out: list[Write] = []
        for j, st in enumerate(streams):
            while pending[j] is not None and pending[j].t < end:
                out.append(pending[j])
                pending[j] = next(st, None)
        out.sort(key=lambda w: (w.t, w.entry))
        yield out
        block += 1


def _entry_writes(s: Scenario, seed: int, cluster: str, i: int, w: WorkloadSpec, tick: float,
                  block_s: float) -> Iterator[Write]:
    parts = w.partitions
    if w.burst is not None:
        rng = _generator(seed, "workload", i, cluster)
        counts = rng.multinomial(w.burst, [1.0 / parts] * parts) if parts > 1 else [w.burst]
        for p, n in enumerate(counts):
            if n:
                yield Write(w.at_s, i, p, int(n), w.payload_bytes)
        return
    start = w.start_s or 0.0
    stop = s.duration_s if w.stop_s is None else w.stop_s
    paced = w.arrivals == "paced"
    if paced or tick <= 0.0:  # record by record: paced, or Poisson without ticks (the exact model)
        if paced:
            exact = _paced(w, i, start, stop, random.Random(f"{seed}/workload/{i}/{cluster}/paced"))
        else:
            exact = _exact(w, i, start, stop, random.Random(f"{seed}/workload/{i}/{cluster}"))
        if tick > 0.0:
            yield from _per_tick(exact, tick)
            return
        linger = s.kafka.writer_linger_ms / 1000.0
        yield from (_librdkafka_batches(exact, linger) if linger > 0 else exact)
        return
    rng = _generator(seed, "workload", i, cluster)
    lam = w.rate_eps * tick / parts
    first = int(start / tick)
    last = int(stop / tick + 0.999999)  # ticks whose end lies in (start, stop]
    per_block = max(1, int(round(block_s / tick)))
    for b0 in range(first, last, per_block):
        b1 = min(last, b0 + per_block)
        counts = rng.poisson(lam, size=(b1 - b0, parts))
        ticks, ps = np.nonzero(counts)
        for t, p in zip(ticks.tolist(), ps.tolist()):
            at = (b0 + t + 1) * tick
            if start < at <= stop:
                yield Write(at, i, p, int(counts[t, p]), w.payload_bytes)


def _exact(w: WorkloadSpec, i: int, start: float, stop: float, rng: random.Random) -> Iterator[Write]:
    """linger_ms 0: Poisson arrivals, one record each."""
    t = start + rng.expovariate(w.rate_eps)
    while t < stop:
        p = rng.randrange(w.partitions) if w.partitions > 1 else 0
        yield Write(t, i, p, 1, w.payload_bytes)
        t += rng.expovariate(w.rate_eps)


def _paced(w: WorkloadSpec, i: int, start: float, stop: float, rng: random.Random) -> Iterator[Write]:
    """arrivals: paced — one record every 1/rate from a random phase (a paced
    writer, as bench.load's), each to a random partition (keys hashed)."""
    gap = 1.0 / w.rate_eps
    t = start + rng.random() * gap
    while t < stop:
        yield Write(t, i, rng.randrange(w.partitions) if w.partitions > 1 else 0, 1, w.payload_bytes)
        t += gap


def _per_tick(arrivals: Iterator[Write], tick: float) -> Iterator[Write]:
    """Exact arrivals gathered into producer ticks (as the Poisson model's):
    one Write per (tick, partition) at the tick's end, in time order."""
    cur, counts, tmpl = None, {}, None
    for a in arrivals:
        k = int(a.t / tick)
        if k != cur:
            for p in sorted(counts):
                yield Write((cur + 1) * tick, tmpl.entry, p, counts[p], tmpl.payload_bytes)
            cur, counts = k, {}
        counts[a.partition] = counts.get(a.partition, 0) + 1
        tmpl = a
    for p in sorted(counts):
        yield Write((cur + 1) * tick, tmpl.entry, p, counts[p], tmpl.payload_bytes)


def _librdkafka_batches(arrivals: Iterator[Write], linger: float) -> Iterator[Write]:
    """kafka.writer_linger_ms: librdkafka's linger.ms over exact arrivals — the
    first record of a partition opens a batch that is sent `linger` later with
    every record of that partition that arrived meanwhile.  In send order."""
    open_: dict[int, list] = {}  # partition -> [first arrival, count, template]
    for a in arrivals:
        due = sorted((b[0] + linger, p) for p, b in open_.items() if b[0] + linger <= a.t)
        for t, p in due:
            first, n, tmpl = open_.pop(p)
            yield Write(t, tmpl.entry, p, n, tmpl.payload_bytes)
        b = open_.get(a.partition)
        if b is None:
            open_[a.partition] = [a.t, 1, a]
        else:
            b[1] += 1
    for t, p in sorted((b[0] + linger, p) for p, b in open_.items()):
        first, n, tmpl = open_[p]
        yield Write(t, tmpl.entry, p, n, tmpl.payload_bytes)
