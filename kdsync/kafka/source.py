"""The source side of a member: its own cluster's source topics, consumed in a
thread, handed to the event loop as runs of one partition.

Kafka's blocking calls stay off the loop: one thread consumes every source
topic in batches, commits offsets and refreshes watermarks.  Each batch is cut
into runs — consecutive offsets of one partition, in the order they were
consumed — and handed to the loop in one call (`on_runs`).  An offset is
committed only once the member says its event is durable in the global topic
(`commit`; enable.auto.commit is off).  When too many consumed records are not
committed yet, the thread stops fetching (back-pressure).

Assignment is manual: a topic is consumed once the member adds it
(`add_topic`), every partition from max(committed offset, the start the
member gives), and partitions that appear later are picked up by the next
metadata refresh.

Idle partitions: with many partitions, one that brought no record for a while
is paused and its end offset watched instead of fetched (kdsync.kafka.idle_watch).

Fetches that come back empty while records wait (stalled fetch): a broker
that answers every fetch with nothing although its high watermark is ahead
of the consumer is re-asked by a new client at the same positions with twice
the fetch wait (up to MAX_FETCH_WAIT_MS), once per `stall_s` (and at least
three fetch waits: a long wait may rightly return nothing); each time is
one WARNING line and `on_restart`.  A partition nothing was consumed from
yet counts from the offset it was assigned at (librdkafka knows no position
for it: a member started on a partition whose first fetches already come
back empty was never re-asked, and stalled for good — issue 41).  Tansu on S3 storage does this: it lists
the partition's objects within the fetch's wait and stops listing when the
wait is over, so once a partition holds more objects than it can list in
`fetch.wait.max.ms` every fetch is empty (docs/durable.md).  A broker that
works never triggers it: records arrive.

Gaps (kdsync.kafka.gaps): a run of records that starts above the next offset
expected of its partition is a gap; it is accepted only when a look at the
broker accounts for every offset in it (transaction markers, aborted records,
compaction, retention), else the records after it are not handed over and
the partition is fetched again from the expected offset — never skipped.

Transactions (kdsync.kafka.transactions): with `txn_probe`, a probe started
with the consumer (it runs while the member opens its topics; the thread
takes its answer before the first fetch) asks the broker whether
read_committed readers see aborted records; on one
that shows them (or cannot be asked), every run is checked against its
batches' headers and a partition holds at its first transactional record.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Callable

from kdsync.core import Batch, Event
from kdsync.kafka.gaps import GAP_RETRY_MAX_S, GAP_STALL_S, GapLook, Pending, accounting_on
from kdsync.kafka.idle_watch import IdleWatch
from kdsync.kafka.records import pack_payload
from kdsync.kafka.transactions import TxnGuard
from kdsync.observability.logs import kv
from kdsync.observability.profiler import profiler

__all__ = ["MAX_FETCH_WAIT_MS", "MAX_INFLIGHT", "SourceConsumer", "SourceRun", "consumer_conf"]

log = logging.getLogger("kdsync.source")

POLL_S = 0.25  # an idle consumer thread wakes 4 times/s (commits and stop wait that long, at most)
MAX_INFLIGHT = 50_000  # source records consumed but not yet durable+committed before the consumer pauses
STALL_S = 2.0  # records wait and every fetch came back empty this long: a new client with a longer wait
MAX_FETCH_WAIT_MS = 5000  # the longest fetch wait the stall escape asks for
IDLE_DEFAULTS = (10.0, 0.5, 100, 2.0)  # [topics] idle_after_ms, idle_watch_ms, hot_partitions, idle_watch_long_ms
LAG_PER_S = 200  # lag sampled every second, or this many partitions a second (1 000: every 5 s)
METADATA_S = 30.0  # metadata refresh once every topic's partitions are assigned (added partitions)
DISCOVER_S = 5.0  # with `on_topics` (topic discovery): the metadata every 5 s, or DISCOVER_PER_TOPIC_S
DISCOVER_PER_TOPIC_S = 0.03  # per consumed topic (30 s at 1 000), at most METADATA_S
IDLE_POLL_S = 0.05  # the consumer's poll while partitions are watched: a watch's answer is picked up soon


def consumer_conf(member_id: str, overrides: dict) -> dict:
    """librdkafka properties of this member's consumers: kdsync's defaults,
    then the configured `overrides`, then what kdsync cannot do without."""
    conf = {"group.id": f"kdsync-{member_id}", "auto.offset.reset": "earliest", "fetch.wait.max.ms": 10,
            "log_level": 3, "socket.connection.setup.timeout.ms": 5000}
    conf.update(overrides)
    conf["enable.auto.commit"] = False  # an offset is committed only once its event is durable
    conf["enable.auto.offset.store"] = False
    return conf


class SourceRun:
    """Records of one source partition at consecutive offsets, as one core
    `Batch` (origin = this member), with when the consumer thread got them
    (`fetched_wall`: time.time(), `fetched_t`: time.monotonic())."""

    __slots__ = ("topic", "partition", "batch", "fetched_wall", "fetched_t")

    def __init__(self, topic: str, partition: int, batch: Batch, fetched_wall: float = 0.0, fetched_t: float = 0.0):
        self.topic, self.partition, self.batch = topic, partition, batch
        self.fetched_wall, self.fetched_t = fetched_wall, fetched_t

    @property
    def events(self) -> list[Event]:
        """The records taken apart (tests; not the hot path)."""
        return self.batch.events()


class SourceConsumer:
    """Consumes the source topics in a thread of its own.

    `on_runs(runs)` and `on_fatal(message)` are called in the event loop's
    thread (through `loop.call_soon_threadsafe`), `on_lag(topic, partition,
    lag)` in the consumer thread.  `conf` comes from `consumer_conf` (plus an
    `error_cb`).  `shard` = (s, K): the consumer of shard s, which reads the
    source partitions p with p mod K = s only.
    """

    def __init__(self, conf: dict, origin: str, loop: asyncio.AbstractEventLoop, *,
                 on_runs: Callable[[list[SourceRun]], None], on_fatal: Callable[[str], None],
                 on_lag: Callable[[str, int, int], None], batch: int = 1000, max_inflight: int = MAX_INFLIGHT,
                 commit_interval: float = 1.0, on_commit: Callable[[str, float], None] | None = None,
                 shard: tuple[int, int] | None = None, stall_s: float = STALL_S,
                 on_restart: Callable[[int], None] | None = None, idle: tuple = IDLE_DEFAULTS,
                 on_topics: Callable[[list[str]], None] | None = None,
                 on_gap: Callable[[str], None] | None = None, txn_probe: bool = False,
                 client_extra: dict | None = None):
        # the source follows its topics for ever: a partition EOF means nothing here
        self.conf = {**conf, "enable.partition.eof": False}
        # properties of the source's own client alone (its librdkafka statistics): the idle watch's
        # and the looks' clients are made from self.conf and never polled, so nothing would serve theirs
        self._own = dict(client_extra or {})
        self.origin = origin
        self.loop = loop
        self.on_runs, self.on_fatal, self.on_lag = on_runs, on_fatal, on_lag
        self.batch = batch
        self.max_inflight = max_inflight
        self.shard = shard  # (s, K): consume only source partitions p with p % K == s (docs/shards.md)
        self._topics: dict[str, dict[int, int]] = {}  # topic -> partition -> lowest offset to consume
        self._pending = False  # an added topic not yet seen in the metadata
        self._lag_sent: dict[tuple[str, int], int] = {}  # the lag last told on_lag, per partition
        # partitions paused (idle) at the last lag pass -> (committed, consumed) then: while paused and
        # neither moves, no fetch moved their cached watermark either, so the lag pass skips them
        self._lag_paused: dict[tuple[str, int], tuple[int, int | None]] = {}
        self._commit_q: queue.Queue = queue.Queue()
        self._committed: dict[tuple[str, int], int] = {}  # source offsets durably ordered below (committed soon)
        self._to_commit: dict[tuple[str, int], int] = {}  # of those, not sent to the coordinator yet
        self._inflight = 0  # consumed records not yet committed, as last summed (back-pressure)
        self._moved = True  # consumed or committed positions moved since: sum again (1 000 partitions, 20 times/s)
        self.commit_interval = commit_interval
        self._last_commit = float("-inf")
        self.commits = 0  # commit requests sent
        self.on_commit = on_commit  # (topic, seconds since the oldest commit it carries was queued), this thread
        self._queued_at: dict[str, float] = {}
        self.stall_s = stall_s
        self.on_restart = on_restart  # (new fetch.wait.max.ms), consumer thread: a stalled fetch was re-asked
        # (every topic name in the cluster), loop thread, after each metadata refresh: the member's
        # topic discovery rides on the listing the source makes anyway (one listing, not two)
        self.on_topics = on_topics
        self.restarts = 0
        self.held_back = True  # paused, back-pressured or not started: not fetching is no stall (kdsync.observability.stalls)
        # topic -> partition -> records above the consumed position (last high watermark)
        self._unfetched: dict[str, dict[int, int]] = {}
        self._stop = threading.Event()
        self._resume = threading.Event()
        self._resume.set()
        self._thread: threading.Thread | None = None
        # idle partitions paused and watched (kdsync.kafka.idle_watch): (after s, watch s, hot partitions)
        self.idle = IdleWatch(self.conf, *idle)
        # gap accounting (kdsync.kafka.gaps): partitions whose gap is being re-fetched, and the look
        self.gap_check = accounting_on()
        self.gaps: dict[str, int] = {}  # kind -> gaps counted (tests; `on_gap` feeds the metric)
        self.on_gap = on_gap  # (kind), consumer thread: kdsync_source_gaps_total{kind}
        self._pending_gaps: dict[tuple[str, int], Pending] = {}
        self._look = GapLook({k: v for k, v in self.conf.items() if not callable(v)})
        self._unverified_said: set[tuple[str, int]] = set()
        # transactional records on a broker that may hand over aborted ones (kdsync.kafka.transactions)
        txn_id = f"kdsync-txn-probe-{origin}" + (f"-s{shard[0]}" if shard else "")
        self.txn = TxnGuard(self.conf, self._look, txn_id) if txn_probe else None
        if self.txn is not None:
            self.txn.prefetch()  # while the member opens its topics, not before the first fetch

    # ------------------------------------------------------------ the loop's side
    def add_topic(self, topic: str, start: dict[int, int]) -> None:
        """Consume `topic`, each partition p from at least offset start.get(p, 0)."""
        self._topics[topic] = dict(start)
        self._pending = True  # metadata soon: its partitions are assigned within 0.5 s

    def commit(self, topic: str, offsets: dict[int, int]) -> None:
        """Commit `offsets` (partition -> next offset) of `topic` soon, in the consumer thread."""
        if offsets:
            self._commit_q.put((topic, offsets, time.monotonic()))

    def start(self) -> None:
        """Start the consumer thread."""
        self._thread = threading.Thread(target=self._run, name="kdsync-consumer", daemon=True)
        self._thread.start()

    def pause(self) -> None:
        """Hand over no more records; commits still go out."""
        self._resume.clear()

    def close(self, timeout: float = 15.0) -> None:
        """Stop the thread after a last synchronous commit; blocks up to `timeout` s."""
        self._stop.set()
        self._resume.set()
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------ the thread
    def _run(self) -> None:
        prof = profiler(f"{self.origin}-consumer")
        try:
            self._consume()
        finally:
            if prof is not None:
                prof()

    def _consume(self) -> None:
        from confluent_kafka import Consumer

        if self.txn is not None:
            self.txn.start()  # before the first fetch: what the broker's read_committed can be trusted with
        c = Consumer({**self.conf, **self._own})
        assigned: dict[tuple[str, int], bool] = {}
        consumed: dict[tuple[str, int], int] = {}  # next offset to consume, per source partition
        last_meta = 0.0
        last_lag = 0.0
        last_record = time.monotonic()  # when a record last arrived (or the stall clock was reset)
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now - last_meta > self._metadata_every(assigned):
                    last_meta = now
                    self._refresh(c, assigned)
                self._drain_commits(c)
                self.idle.step(c, now)
                if self._pending_gaps:
                    self._retry_gaps(c, now)
                if self.txn is not None and self.txn.retry:
                    self._retry_txn(c, now)
                if assigned and now - last_record > self._stall_after():
                    last_record = now
                    waiting = self._waiting(c, assigned, consumed)
                    if waiting:
                        c = self._reask(c, assigned, consumed, waiting)
                if not self._resume.wait(POLL_S):
                    self.held_back = True
                    last_record = time.monotonic()  # paused: not fetching is no stall
                    continue
                # back-pressure: too many consumed records not yet durably ordered and committed
                if self._moved:
                    self._moved = False
                    self._inflight = sum(nxt - self._committed.get(tp, 0) for tp, nxt in consumed.items())
                if self._inflight > self.max_inflight:
                    self.held_back = True
                    last_record = time.monotonic()
                    self._stop.wait(0.02)
                    continue
                if not assigned:
                    self._stop.wait(0.1)
                    continue
                self.held_back = False
                if now - last_lag > max(1.0, len(assigned) / LAG_PER_S):
                    last_lag = now
                    self._update_lag(c, assigned, consumed)
                # poll() returns as soon as one record is there; consume(n, timeout) would
                # wait for n records or the timeout, adding up to the timeout to latency
                if self.idle.paused and len(self.idle.paused) == len(assigned):
                    # nothing to fetch (every partition idle): sleep until the watch's answer
                    # or its next query (1 000 idle topics: 6 wake-ups/s, not 20), then serve the client
                    self.idle.wait(POLL_S, self._stop)
                    first = c.poll(0)
                else:
                    first = c.poll(POLL_S if not self.idle.paused else IDLE_POLL_S)
                if first is None:
                    continue
                last_record = time.monotonic()
                runs = self._runs([first] + c.consume(self.batch - 1, timeout=0), consumed, c)
                if runs:
                    self.loop.call_soon_threadsafe(self.on_runs, runs)
        except Exception as e:  # a bug or an unexpected client error: stop with one line
            self.loop.call_soon_threadsafe(self.on_fatal, f"kafka consumer: {e}")
        finally:
            self._drain_commits(c, final=True)
            c.close()
            self.idle.close()

    def _runs(self, msgs: list, consumed: dict[tuple[str, int], int], c=None) -> list[SourceRun]:
        """Cut consumed messages into runs (a new run at every change of
        partition and every offset gap), keeping their order; each run is
        one Batch, built without a Python object per record beyond its payload.
        A run that starts above the offset expected of its partition is a gap
        (`_gap`): unless accounted for, that run and the partition's later
        ones in `msgs` are dropped (the partition is fetched again)."""
        runs: list[SourceRun] = []
        wall, mono = time.time(), time.monotonic()
        origin = self.origin
        now_ms = 0
        cur = None  # [topic, partition, first offset, next offset, payloads, timestamps]
        parts: list = []
        last: dict[tuple[str, int], list] = {}  # the latest run of each partition in msgs
        expect = self.idle.next  # next offset to consume of every assigned partition
        check = self.gap_check and c is not None
        pending = self._pending_gaps
        held: set[tuple[str, int]] = set()  # partitions whose records in msgs are dropped (a gap re-fetched)
        for m in msgs:
            err = m.error()
            if err is not None:
                if err.fatal():
                    self.loop.call_soon_threadsafe(self.on_fatal, f"kafka consumer: {err.str()}")
                else:
                    log.warning("consumer", **kv(error=err.str()))
                continue
            topic, part, off = m.topic(), m.partition(), m.offset()
            if cur is None or cur[3] != off or cur[1] != part or cur[0] != topic:
                tp = (topic, part)
                prev = last.get(tp)
                exp = prev[3] if prev is not None else expect.get(tp)
                cur = [topic, part, off, off, [], []]
                if held and tp in held:
                    pass  # dropped: not in parts
                elif check and exp is not None and off > exp and not self._gap(c, tp, exp, off):
                    held.add(tp)
                else:
                    if pending and tp in pending and (exp is None or off <= exp):
                        self._gap_closed(tp, off)
                    parts.append(cur)
                    last[tp] = cur
            cur[3] = off + 1
            cur[4].append(pack_payload(m.key(), m.value(), m.headers()))
            ts = m.timestamp()[1]
            if ts <= 0:  # a record without a timestamp gets the time now
                ts = now_ms = now_ms or int(wall * 1000)
            cur[5].append(ts)
        self._moved = True
        if self.txn is not None and self.txn.on and c is not None:
            parts = self._txn_cut(c, parts)
        for topic, part, first, nxt, payloads, tss in parts:
            consumed[(topic, part)] = nxt
            self.idle.consumed((topic, part), nxt, mono)
            runs.append(SourceRun(topic, part, Batch.of(origin, part, first, payloads, tss), wall, mono))
        if self.txn is not None and self.txn.held:
            for tp in self.txn.held:  # held for good: never paused and resumed by the idle watch
                self.idle.last.pop(tp, None)
        return runs

    # ------------------------------------------------------------ transactions (kdsync.kafka.transactions)
    def _txn_cut(self, c, parts: list) -> list:
        """`parts` as the transaction guard lets them through: a run is cut
        where its partition stops (held at a transactional record, or its
        look failed), the partition paused and sought back there."""
        from confluent_kafka import TopicPartition

        out, stopped = [], set()
        for part in parts:
            tp = (part[0], part[1])
            if tp in stopped:
                continue
            first, nxt = part[2], part[3]
            ok = self.txn.allowed(c, tp, first, nxt)
            if ok < nxt:
                stopped.add(tp)
                tpo = TopicPartition(tp[0], tp[1], ok)
                c.pause([tpo])
                try:
                    c.seek(tpo)
                except Exception as e:  # noqa: BLE001 - paused: a retry seeks again
                    log.debug("seek failed", **kv(topic=tp[0], partition=tp[1], error=str(e)))
                if ok == first:
                    continue
                part[3] = ok
                del part[4][ok - first:], part[5][ok - first:]
            out.append(part)
        return out

    def _retry_txn(self, c, now: float) -> None:
        """Resume the partitions whose failed batch-header look is due again."""
        from confluent_kafka import TopicPartition

        for (t, p), off in self.txn.due(now):
            tpo = TopicPartition(t, p, off)
            try:
                c.seek(tpo)
            except Exception:  # noqa: BLE001 - the partition's fetcher not started yet: resume alone
                pass
            c.resume([tpo])

    # ------------------------------------------------------------ gaps (kdsync.kafka.gaps)
    def _count_gap(self, kind: str) -> None:
        self.gaps[kind] = self.gaps.get(kind, 0) + 1
        if self.on_gap is not None:
            self.on_gap(kind)

    def _gap(self, c, tp: tuple[str, int], exp: int, off: int) -> bool:
        """Offsets [exp, off) of `tp` were not handed over: True when a look
        accounts for every one (the run is accepted); else the partition is
        sought back to `exp` and paused until its retry (False: drop the run)."""
        from confluent_kafka import TopicPartition

        now = time.monotonic()
        p = self._pending_gaps.get(tp)
        if p is not None and p.unverified and p.start == exp and p.end == off:
            # a cluster the look cannot ask: the same gap after a re-fetch is what librdkafka gives
            del self._pending_gaps[tp]
            self._count_gap("unverified")
            if tp not in self._unverified_said:
                self._unverified_said.add(tp)
                log.warning("source gap accepted unverified: the broker skipped these offsets twice and the "
                            "look cannot ask it (security.protocol)", **kv(topic=tp[0], partition=tp[1],
                                                                           offsets=f"{exp}..{off - 1}"))
            return True
        acct = self._look.account(c, tp[0], tp[1], exp, off)
        if not acct.missing:
            if p is not None:
                del self._pending_gaps[tp]
            for kind in acct.kinds:
                self._count_gap(kind)
            if "retention" in acct.kinds:
                log.warning("source records were deleted (retention) before they were consumed", **kv(
                    topic=tp[0], partition=tp[1], offsets=f"{exp}..{exp + acct.kinds['retention'] - 1}"))
            else:
                log.debug("source gap accounted for", **kv(topic=tp[0], partition=tp[1], offsets=f"{exp}..{off - 1}",
                                                          **acct.kinds))
            return True
        if p is None or p.start != exp:
            p = self._pending_gaps[tp] = Pending(exp, off, now, acct.broker, unverified=acct.unverified)
        p.end, p.broker = off, acct.broker if acct.broker != "?" else p.broker
        p.tries += 1
        p.retry_at = now + (0.0 if p.tries == 1 else min(GAP_RETRY_MAX_S, 0.05 * 2 ** p.tries))
        missing = ",".join(f"{lo}..{hi - 1}" for lo, hi in acct.missing[:5])
        if p.tries == 1:
            log.info("source gap: records the broker did not hand over; fetching them again", **kv(
                topic=tp[0], partition=tp[1], offsets=f"{exp}..{off - 1}", missing=missing, broker=p.broker,
                **({"look": acct.error} if acct.error else {})))
        p.missing, p.error = missing, acct.error
        self._say_stalled(tp, p, now)
        tpo = TopicPartition(tp[0], tp[1], exp)
        c.pause([tpo])
        try:
            c.seek(tpo)
        except Exception as e:  # noqa: BLE001 - not fetching yet: the retry seeks again
            log.debug("seek failed", **kv(topic=tp[0], partition=tp[1], error=str(e)))
        return False

    def _retry_gaps(self, c, now: float) -> None:
        """Resume the partitions whose gap is due for a re-fetch (sought back to its start)."""
        from confluent_kafka import TopicPartition

        due = [(tp, p) for tp, p in self._pending_gaps.items() if p.retry_at and p.retry_at <= now]
        for tp, p in due:
            p.retry_at = 0.0  # resumed: the next answer decides
            tpo = TopicPartition(tp[0], tp[1], p.start)
            try:
                c.seek(tpo)
            except Exception:  # noqa: BLE001 - the partition's fetcher not started yet: resume alone
                pass
            c.resume([tpo])
            if tp in self.idle.paused:  # the watch had it paused: it stays fetched until consumed
                self.idle.paused.discard(tp)
                self.idle.paused_at.pop(tp, None)
        for tp, p in self._pending_gaps.items():
            self._say_stalled(tp, p, now)

    @staticmethod
    def _say_stalled(tp: tuple[str, int], p: Pending, now: float) -> None:
        """A gap not closed for GAP_STALL_S: one `stalled:` line (kdsync.observability.stalls' vocabulary)."""
        if not p.stalled and now - p.since >= GAP_STALL_S:
            p.stalled = True
            log.warning("stalled: a source partition holds at records the broker does not hand over", **kv(
                topic=tp[0], partition=tp[1], offsets=f"{p.start}..{p.end - 1}", missing=p.missing,
                broker=p.broker, tries=p.tries, for_s=round(now - p.since, 1),
                **({"look": p.error} if p.error else {})))

    def _gap_closed(self, tp: tuple[str, int], off: int) -> None:
        """The re-fetch of `tp` brought the expected offset: one WARNING, counted."""
        p = self._pending_gaps.pop(tp)
        self._count_gap("refetched")
        log.warning("source gap closed by a re-fetch: the broker skipped records it holds", **kv(
            topic=tp[0], partition=tp[1], offsets=f"{p.start}..{p.end - 1}", broker=p.broker, tries=p.tries,
            after_s=round(time.monotonic() - p.since, 2)))
        if p.stalled:
            log.info("stall over", **kv(topic=tp[0], partition=tp[1], stage="source gap"))

    def _waiting(self, c, assigned, consumed) -> dict[tuple[str, int], int]:
        """Partitions whose high watermark (from the last fetch responses) is
        ahead of the next offset to consume: partition -> records waiting."""
        from confluent_kafka import TopicPartition

        out = {}
        paused = self.idle.paused  # not fetched: no fetch answer to be stalled (the watch asks their ends)
        for (t, p) in list(assigned):
            if (t, p) in paused or (self.txn is not None and self.txn.stopped((t, p))):
                continue
            try:
                _, hi = c.get_watermark_offsets(TopicPartition(t, p), cached=True)
                pos = c.position([TopicPartition(t, p)])[0].offset
            except Exception:
                continue
            nxt = consumed.get((t, p))
            if nxt is None:  # nothing consumed yet: librdkafka has no position (-1001); the assigned offset
                nxt = pos if pos is not None and pos >= 0 else self.idle.next.get((t, p), -1)
            if hi is not None and nxt >= 0 and hi > nxt:
                out[(t, p)] = hi - nxt
        return out

    def _stall_after(self) -> float:
        """Seconds of empty fetches while records wait that make a stall:
        stall_s, and at least three fetch waits (a client asking with a long
        wait may rightly get nothing for that long)."""
        return max(self.stall_s, 3 * int(self.conf.get("fetch.wait.max.ms", 500)) / 1000)

    def _reask(self, c, assigned, consumed, waiting: dict[tuple[str, int], int]):
        """Every fetch came back empty for stall_s while `waiting` records
        wait: close `c` and return a new client at the same positions with
        twice the fetch wait (module doc)."""
        from confluent_kafka import Consumer, TopicPartition

        old = int(self.conf.get("fetch.wait.max.ms", 500))
        wait = min(MAX_FETCH_WAIT_MS, max(old * 2, 20))
        self.restarts += 1
        log.warning("source fetches return nothing while records wait; asking again with a new client and a "
                    "longer fetch wait (a broker that reads its storage within the fetch wait, e.g. Tansu on S3: "
                    "see docs/durable.md)", **kv(waiting=sum(waiting.values()), partitions=len(waiting),
                                                  stalled_s=self.stall_s, fetch_wait_ms=f"{old}->{wait}"))
        if wait == old:
            return c  # at the cap: nothing more to try; the stall detector reports the stage
        self.conf["fetch.wait.max.ms"] = wait
        positions = []
        for (t, p) in assigned:
            nxt = consumed.get((t, p))
            if nxt is None:
                try:
                    nxt = c.position([TopicPartition(t, p)])[0].offset
                except Exception:
                    nxt = -1
            if nxt is None or nxt < 0:
                nxt = self._committed.get((t, p), 0)
            positions.append(TopicPartition(t, p, nxt))
        self._drain_commits(c, final=True)
        c.close()
        c = Consumer({**self.conf, **self._own})
        c.incremental_assign(positions)
        held = [tp for tp in positions if self.txn is not None and self.txn.stopped((tp.topic, tp.partition))]
        if held:  # held partitions stay held in the new client
            c.pause(held)
        self.idle.reset(time.monotonic())
        if self.on_restart is not None:
            self.on_restart(wait)
        return c

    def _metadata_every(self, assigned: dict) -> float:
        """Seconds between metadata refreshes: 0.5 while an added topic waits
        for its partitions; else METADATA_S (added partitions: a thousand
        topics' metadata every 5 s cost a member ~1 % of a core), or the
        discovery interval when `on_topics` listens (5 s, 30 s at 1 000 topics)."""
        if self._topics and (self._pending or not assigned):
            return 0.5
        if self.on_topics is None:
            return METADATA_S if self._topics else float("inf")
        return min(METADATA_S, max(DISCOVER_S, DISCOVER_PER_TOPIC_S * len(self._topics)))

    def _refresh(self, c, assigned: dict[tuple[str, int], bool]) -> None:
        """Assign the partitions of added topics not assigned yet; tell
        `on_topics` every topic the cluster has."""
        from confluent_kafka import TopicPartition

        new = []
        try:
            md = c.list_topics(timeout=5)
        except Exception as e:
            log.warning("source metadata unavailable", **kv(error=str(e)))
            return
        if self.on_topics is not None:
            self.loop.call_soon_threadsafe(self.on_topics, list(md.topics))
        self._pending = False
        for t in list(self._topics):
            tm = md.topics.get(t)
            if tm is None or tm.error is not None:
                self._pending = True  # not in the metadata yet: asked again soon
                continue
            for p in tm.partitions:
                if (t, p) not in assigned and (self.shard is None or p % self.shard[1] == self.shard[0]):
                    new.append(TopicPartition(t, p))
        if not new:
            return
        try:
            committed = c.committed(new, timeout=10)
        except Exception as e:
            log.warning("reading committed offsets failed", **kv(error=str(e)))
            return
        for tp in committed:
            start = max(tp.offset if tp.offset >= 0 else 0, self._topics[tp.topic].get(tp.partition, 0))
            tp.offset = start
            self._committed.setdefault((tp.topic, tp.partition), start)
            self._moved = True
            assigned[(tp.topic, tp.partition)] = True
            self.idle.assigned((tp.topic, tp.partition), start, time.monotonic())
            log.info("consuming", **kv(topic=tp.topic, partition=tp.partition, offset=start))
        c.incremental_assign(committed)

    def unfetched(self, topic: str) -> int:
        """Records of `topic` above the consumed position, as of the last
        high watermarks (any thread)."""
        return sum(list(self._unfetched.get(topic, {}).values()))

    def _update_lag(self, c, assigned, consumed: dict[tuple[str, int], int]) -> None:
        """lag = source high watermark (from fetch responses, which Tansu
        reports right) - offset below which every event is durably ordered;
        also the records above the consumed position (`unfetched`)."""
        from confluent_kafka import TopicPartition

        last = self._lag_sent
        paused, was_paused = self.idle.paused, self._lag_paused
        self._lag_paused = {}
        for (t, p) in list(assigned):
            tp = (t, p)
            if tp in paused:
                now = self._lag_paused[tp] = (self._committed.get(tp, 0), consumed.get(tp))
                if was_paused.get(tp) == now:
                    continue  # paused at the last pass, nothing consumed or committed since (1 000 idle partitions)
            try:
                lo, hi = c.get_watermark_offsets(TopicPartition(t, p), cached=True)
            except Exception:
                continue
            if hi is not None and hi >= 0:
                done = self._committed.get((t, p), 0)
                lag = max(0, hi - done)
                if last.get((t, p)) != lag:  # a thousand idle partitions: nothing to tell
                    last[(t, p)] = lag
                    self.on_lag(t, p, lag)
                held = self.txn is not None and tp in self.txn.held  # said once by its own stalled line
                self._unfetched.setdefault(t, {})[p] = 0 if held else max(0, hi - consumed.get((t, p), done))

    def _drain_commits(self, c, final: bool = False) -> None:
        """Take the queued commits (durable below: back-pressure and lag see
        them at once); send them to the group coordinator at most once per
        `commit_interval` (and at the end): a commit is one broker request,
        and a restart starts from the global topic's watermarks anyway."""
        from confluent_kafka import KafkaException, TopicPartition

        merged = self._to_commit
        while True:
            try:
                topic, commits, t = self._commit_q.get_nowait()
            except queue.Empty:
                break
            self._moved = True
            if topic not in self._queued_at:
                self._queued_at[topic] = t
            for p, off in commits.items():
                tp = (topic, p)
                if off > merged.get(tp, 0):
                    merged[tp] = off
                if off > self._committed.get(tp, 0):
                    self._committed[tp] = off
        if not merged:
            return
        now = time.monotonic()
        if not final and now - self._last_commit < self.commit_interval:
            return
        self._last_commit = now
        tps = [TopicPartition(t, p, off) for (t, p), off in sorted(merged.items())]
        merged.clear()
        if self.on_commit is not None:
            for topic, t in self._queued_at.items():
                self.on_commit(topic, now - t)
        self._queued_at.clear()
        try:
            c.commit(offsets=tps, asynchronous=not final)
            self.commits += 1
        except KafkaException as e:
            # not fatal: a later commit covers it; on restart the watermarks skip what is durable
            log.warning("offset commit failed", **kv(error=str(e)))
