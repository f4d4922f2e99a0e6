"""Where an event's time goes inside one member: per-stage histograms and the
opt-in latency trace (`kdsync run --trace-latency FILE`).

Stages of one batch of source records (one `SourceRun`: consecutive records
of one source partition), each timed from the end of the previous one:

  fetch      source record timestamp (its first record) -> the consumer thread has it
  handoff    consumer thread -> the member's event loop (submit to the ordering node)
  sent       submit -> the first message the node sends after it (derecho: the
             slot carrying it, unless the send window was closed; mirror and
             sequencer: their first message out)
  delivered  sent (or submit) -> the node delivers it in the agreed order
             (derecho: every member acknowledged it, i.e. stable)
  produced   delivered -> every record of its Delivery handed to the producer
  report     produced -> every delivery report of that Delivery in (durable)
  committed  durable -> its source offsets sent to the group coordinator
             (at most once per second: not on the event's path)

Only this member's own batches have fetch, handoff, sent and delivered;
every Delivery (own or not) has produced and report.  Samples are taken per
batch / per Delivery, never per record, so measuring costs a few
microseconds per batch.  `kdsync_e2e_latency_seconds` still counts every
record (source timestamp -> its Delivery durable), tallied per Delivery
(`kdsync.observability.metrics.observe_many`).

The trace is one JSON line per batch once it is durable: `topic`, `origin`,
`partition`, `first_offset`, `count`, `seq` (position of its first record),
`source_ts` (ms), and the wall-clock time (s) it reached each stage:
`fetched`, `submitted`, `sent`, `delivered`, `produced`, `durable` (null
where the stage does not apply: other members' batches).  With shards
(K > 1) shard S appends to `FILE.shard-S` and every line has `shard`.
"""

from __future__ import annotations

import functools
import json
import time
from array import array
from collections import deque

from kdsync.observability.metrics import observe_many

__all__ = ["ALL_TOPICS", "STAGES", "LatencyTrace", "StageClock", "open_trace", "shard_trace_path"]

ALL_TOPICS = "_all"  # the topic label of histograms shared by many topics ([metrics] topic_histograms)

STAGES = ("fetch", "handoff", "sent", "delivered", "produced", "report", "committed")
_MAX_TRACKED = 100_000  # own batches awaiting delivery; a view change can drop some: never grow without bound


def shard_trace_path(path: str, shard: int | None) -> str:
    """Where shard `shard`'s trace goes: `path` itself for the one ordering
    group (shards = 1), `path.shard-S` for shard S (each shard, in whichever
    worker process it runs, appends to a file of its own)."""
    return path if shard is None else f"{path}.shard-{shard}"


def open_trace(path: str | None, shard: int | None) -> LatencyTrace | None:
    """`--trace-latency`'s file for `shard` (None: no trace); a file that
    cannot be written is a FatalError naming it."""
    if not path:
        return None
    from kdsync.fatal import FatalError

    path = shard_trace_path(path, shard)
    try:
        return LatencyTrace(path, shard)
    except OSError as e:
        raise FatalError(f"--trace-latency: cannot write {path}: {e.strerror}") from None


class LatencyTrace:
    """JSON lines appended to `path` (buffered; flushed at most once a second
    and at close).  `shard`: every line also says which shard it is of."""

    def __init__(self, path: str, shard: int | None = None):
        self.f = open(path, "a", encoding="utf-8", buffering=1 << 16)
        self.rows = 0
        self._flushed = time.monotonic()
        self.shard = shard

    def write(self, rows: list[dict]) -> None:
        w = self.f.write
        for r in rows:
            if self.shard is not None:
                r["shard"] = self.shard
            w(json.dumps(r, separators=(",", ":")) + "\n")
        self.rows += len(rows)
        now = time.monotonic()
        if now - self._flushed > 1.0:
            self._flushed = now
            self.f.flush()

    def close(self) -> None:
        self.f.close()


def _first_ts(batch) -> int:
    return int.from_bytes(batch.timestamps[:8], "little", signed=True)


class _Children(dict):
    """A histogram's children by stage, each made at its first observation:
    a member with a thousand idle topics does not build (and serve on every
    scrape) seven histograms for each."""

    def __init__(self, make):
        super().__init__()
        self._make = make

    def __missing__(self, stage):
        child = self[stage] = self._make(stage)
        return child


class StageClock:
    """The stage times of one topic's batches (module doc), fed by the member:
    `submitted(run, now)`, `sent(now)`, `delivered(delivery, now)` on the
    loop, and `written(done)` as the GlobalWriter's on_done."""

    def __init__(self, topic: str, me: str, metrics, trace: LatencyTrace | None, label: str | None = None):
        """`label`: the topic label of its histograms (ALL_TOPICS: shared by
        the topics past `[metrics] topic_histograms`)."""
        self.me = me
        self.topic = topic
        self.label = label = topic if label is None else label
        self.trace = trace
        self.h = _Children(lambda st, h=metrics.stage: h.labels(label, st))
        self._latency = metrics.latency
        self.consumed = metrics.consumed.labels(topic)
        self.written_c = metrics.written.labels(topic)
        self.own: dict[tuple[int, int], list] = {}  # (partition, first offset) -> record (see submitted)
        self.unsent: list[list] = []
        self.inflight: deque = deque()  # (end_seq, delivered_t, trace rows, source timestamps) per Delivery
        self.wall = time.time() - time.monotonic()  # monotonic -> wall clock

    @functools.cached_property
    def e2e(self):
        return self._latency.labels(self.label)

    def submitted(self, run, now: float) -> None:
        b = run.batch
        self.consumed.inc(b.count)
        ts0 = _first_ts(b)
        if ts0 > 0:
            self.h["fetch"].observe(max(0.0, run.fetched_wall - ts0 / 1000.0))
        if run.fetched_t:
            self.h["handoff"].observe(max(0.0, now - run.fetched_t))
        # [partition, first offset, count, source ts, fetched (monotonic), submitted, sent]
        rec = [b.partition, b.first_offset, b.count, ts0, run.fetched_t, now, 0.0]
        if len(self.own) >= _MAX_TRACKED:
            self.own.clear()
        self.own[(b.partition, b.first_offset)] = rec
        self.unsent.append(rec)

    def sent(self, now: float) -> None:
        h = self.h["sent"]
        for rec in self.unsent:
            rec[6] = now
            h.observe(now - rec[5])
        self.unsent.clear()

    def delivered(self, d, now: float, writes: bool = True) -> None:
        me, own, h = self.me, self.own, self.h["delivered"]
        rows = [] if self.trace is not None else None
        seq = d.first_seq
        for b in d.batches:
            if b.origin == me:
                rec = own.pop((b.partition, b.first_offset), None)
                if rec is not None:  # None: submitted before a restart or cut differently (a view change)
                    h.observe(now - (rec[6] or rec[5]))
                if rows is not None:
                    rows.append((b, seq, rec))
            elif rows is not None:
                rows.append((b, seq, None))
            seq += b.count
        if writes:
            ts = array("q")
            if not d.catchup:
                for b in d.batches:
                    ts.frombytes(b.timestamps)
            self.inflight.append((d.end_seq, now, rows, ts))

    def written(self, done) -> None:
        """GlobalWriter.on_done: these deliveries are durable."""
        inflight = self.inflight
        hp, hr = self.h["produced"], self.h["report"]
        now_wall = time.time()
        now_ms = now_wall * 1000.0
        for wd in done:
            hp.observe(wd.produced_t - wd.write_t)
            hr.observe(wd.durable_t - wd.produced_t)
            self.written_c.inc(wd.end_seq - wd.first_seq)
            while inflight and inflight[0][0] <= wd.end_seq:
                _, delivered_t, rows, ts = inflight.popleft()
                if ts:
                    observe_many(self.e2e, [(now_ms - t) / 1000.0 if t < now_ms else 0.0 for t in ts if t > 0])
                if rows:
                    self._trace(rows, delivered_t, wd)

    def committed(self, delay_s: float) -> None:
        self.h["committed"].observe(delay_s)

    def _trace(self, rows, delivered_t: float, wd) -> None:
        w = self.wall
        out = []
        for b, seq, rec in rows:
            out.append({
                "topic": self.topic, "origin": b.origin, "partition": b.partition, "first_offset": b.first_offset,
                "count": b.count, "seq": seq, "source_ts": _first_ts(b),
                "fetched": round(rec[4] + w, 6) if rec and rec[4] else None,
                "submitted": round(rec[5] + w, 6) if rec else None,
                "sent": round(rec[6] + w, 6) if rec and rec[6] else None,
                "delivered": round(delivered_t + w, 6), "produced": round(wd.produced_t + w, 6),
                "durable": round(wd.durable_t + w, 6)})
        self.trace.write(out)
