"""Idle source partitions, paused and watched (issue 26, docs/operations.md
"Many source topics per member").

The source consumer fetches every partition it is assigned with a short wait
(`fetch.wait.max.ms` = 10: an event reaches the ordering within ~10 ms).  A
fetch costs the broker per partition, data or not: measured on Tansu, one
idle consumer over 1 000 partitions keeps the broker at 89 % of a core with a
10 ms wait and still 25 % with 500 ms (Tansu answers a fetch when its wait is
over, not when a record arrives, so a long wait is also a slow one).  A
ListOffsets over the same 1 000 partitions every 0.5 s costs it ~3 %.

So a member fetches at most `hot` partitions continuously.  When it
consumes more, a partition that brought no record for `after_s`, and beyond
the `hot` most recently active ones any that is caught up, is paused (its
high watermark from the last fetch response is the next offset to consume):
the consumer stops fetching it.  Every `watch_s` the paused partitions' end
offsets are asked with ListOffsets, without blocking the consumer thread
(one query for them all runs in the watch's own thread with a client of its
own, `Consumer.offsets_for_times` with LATEST, WATCH_CHUNK partitions a call;
the answers are picked up by a later call), and a partition whose end is
above its next offset is resumed; its record is then fetched like any other.
A partition paused for LONG_IDLE_S is asked every `long_watch_s` instead
(`[topics] idle_watch_long_ms`, 2 s): at 1 000 topics idle for minutes the
watch was a fifth of an idle member's CPU and most of its source thread's
wake-ups (stop 37), and a topic silent for a minute can wait for its next
record a little longer.  A burst over a thousand partitions thus makes them hot for a second, not for
`after_s` (measured: one record into each of 1 000 topics, fetched at once,
saturated each broker for the whole idle period and its producers timed out).
The cost: the first record after a pause waits up to `watch_s` more
(`long_watch_s` after a minute of silence).

Sound on brokers that report a low end: Tansu answers the end of a partition
as the last batch's base offset + 1, never more than the true end and always
above the first offset of any batch appended after the next offset to
consume — so "end > next" is exactly "a record waits" (a test checks it on a
real broker).  Nothing is lost when a watch fails: the partition stays paused
and is asked again at the next watch (one warning per minute).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

from kdsync.kafka.topic import LATEST
from kdsync.observability.logs import kv

__all__ = ["IdleWatch"]

log = logging.getLogger("kdsync.source")

WATCH_CHUNK = 200  # partitions per offsets_for_times call: librdkafka matches each answer in the
# request's list (quadratic): 1 000 partitions in one call cost 11.5 ms of CPU, in 5 calls 5 ms (probe on Tansu)
ASSIGNED_IDLE_S = 1.0  # a partition that brought nothing since its assignment is idle this soon
LONG_IDLE_S = 60.0  # a partition paused this long is watched every `long_watch_s` (module doc)


class IdleWatch:
    """The idle partitions of one source consumer (module doc).  Every
    method runs in the consumer's thread."""

    def __init__(self, conf: dict, after_s: float, watch_s: float, hot: int, long_watch_s: float | None = None):
        self.conf = conf
        self.after_s, self.watch_s, self.hot = after_s, watch_s, hot
        self.long_watch_s = max(watch_s, long_watch_s if long_watch_s is not None else watch_s)
        self.paused_at: dict[tuple[str, int], float] = {}  # when each paused partition was paused
        self._recent_tps: list | None = None  # the chunks of those paused < LONG_IDLE_S; None: rebuild
        self._recent_until = float("inf")  # when the oldest of them turns long-idle
        self._next_full = 0.0  # the next query of every paused partition
        self.next: dict[tuple[str, int], int] = {}  # next offset to consume, per assigned partition
        self.last: dict[tuple[str, int], float] = {}  # when a record (or the assignment) last came
        self.paused: set[tuple[str, int]] = set()
        self.pauses = self.resumes = 0  # counters (tests, metrics)
        self._pool: ThreadPoolExecutor | None = None  # the watch's thread and client, made when first needed
        self._client = None
        self._asked: Future | None = None  # the query under way: its answer, a list of TopicPartition
        self._query_tps: list | None = None  # the paused partitions as TopicPartition(LATEST) chunks; None: rebuild
        self._next_watch = self._next_scan = 0.0
        self._warned = float("-inf")

    @property
    def enabled(self) -> bool:
        return self.after_s > 0 and len(self.next) > self.hot

    def assigned(self, tp: tuple[str, int], offset: int, now: float) -> None:
        """A new partition: idle once it brought nothing for ASSIGNED_IDLE_S
        (a thousand new, empty topics are watched within a second, not
        fetched at full speed for `after_s` while their groups form)."""
        self.next[tp] = offset
        self.last[tp] = now - self.after_s + min(self.after_s, ASSIGNED_IDLE_S)

    def consumed(self, tp: tuple[str, int], nxt: int, now: float) -> None:
        self.next[tp] = nxt
        self.last[tp] = now

    def reset(self, now: float) -> None:
        """The consumer was replaced: nothing is paused in the new one."""
        self.paused.clear()
        self.paused_at.clear()
        self._query_tps = self._recent_tps = None
        self._asked = None
        for tp in self.last:
            self.last[tp] = now

    def step(self, c, now: float) -> None:
        """Pause the partitions that fell idle, resume the watched ones a
        record came to; cheap when there is nothing to do."""
        if self._asked is not None:
            self._answers(c)
        if not self.enabled:
            if self.paused:
                self._resume(c, list(self.paused))
            return
        if now >= self._next_scan:
            self._next_scan = now + min(1.0, self.after_s / 4)
            self._pause_idle(c, now)
        if self.paused and self._asked is None and now >= self._next_watch:
            full = now >= self._next_full
            if full:
                self._next_full = now + self.long_watch_s
            recent = self._ask(full, now)
            self._next_watch = now + self.watch_s if recent else self._next_full

    def wait(self, timeout: float, stop: threading.Event) -> None:
        """The consumer thread while every partition is paused (nothing to
        fetch): block until the query under way is answered, or the next
        one is due, or `timeout` (or `stop`)."""
        asked = self._asked
        if asked is not None:
            wait_futures([asked], timeout)
        else:
            stop.wait(max(0.0, min(timeout, self._next_watch - time.monotonic(), self._next_scan - time.monotonic())))

    def _pause_idle(self, c, now: float) -> None:
        from confluent_kafka import TopicPartition

        limit = now - self.after_s
        awake = [(t, tp) for tp, t in self.last.items() if tp not in self.paused]
        over = len(awake) - self.hot  # beyond the hot ones: the least recently active go first
        if over <= 0 and all(t > limit for t, _ in awake):
            return
        awake.sort()
        idle = []
        for t, tp in awake:
            if t > limit and over <= 0:
                break
            try:
                _, hi = c.get_watermark_offsets(TopicPartition(*tp), cached=True)
            except Exception:  # noqa: BLE001 - no fetch answer yet: not known to be caught up
                continue
            if hi is not None and 0 <= hi <= self.next[tp]:
                idle.append(tp)
                over -= 1
        if idle:
            c.pause([TopicPartition(t, p) for t, p in idle])
            self.paused.update(idle)
            for tp in idle:
                self.paused_at[tp] = now
            self._query_tps = self._recent_tps = None
            self._next_watch = min(self._next_watch, now + self.watch_s)
            self.pauses += len(idle)
            log.debug("source partitions idle: paused and watched", **kv(partitions=len(idle)))

    def _ask(self, full: bool = True, now: float | None = None) -> bool:
        """Ask the end offsets of every paused partition (`full`), or of
        those paused less than LONG_IDLE_S ago; True when some of those are
        (the next query is then due in `watch_s`, else in `long_watch_s`)."""
        now = time.monotonic() if now is None else now
        if self._recent_tps is None or now >= self._recent_until:  # rebuilt when the paused set changed
            old = now - LONG_IDLE_S
            recent = [tp for tp in self.paused if self.paused_at.get(tp, now) > old]
            self._recent_tps = _chunks(recent)
            self._recent_until = min((self.paused_at.get(tp, now) for tp in recent), default=float("inf")) + LONG_IDLE_S
        if full:
            if self._query_tps is None:  # built again only when the paused set changed (1 000: ~1 ms of CPU)
                self._query_tps = _chunks(self.paused)
            chunks = self._query_tps
        else:
            chunks = self._recent_tps
        if chunks:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="kdsync-idle-watch")
            self._asked = self._pool.submit(self._query, chunks, max(1.0, 4 * self.watch_s))
        return bool(self._recent_tps)

    def _query(self, chunks: list[list], timeout: float) -> list:
        """The watch's thread: the end offsets of the partitions in `chunks`
        (a call in the client per chunk: a Python future per partition cost
        a member with 1 000 idle partitions ~10 % of a core, one call for
        them all twice what WATCH_CHUNK a call costs)."""
        from kdsync.kafka.topic import consumer

        if self._client is None:
            self._client = consumer(self.conf)
        return [tp for chunk in chunks for tp in self._client.offsets_for_times(chunk, timeout=timeout)]

    def _answers(self, c) -> None:
        asked = self._asked
        if not asked.done():
            return
        self._asked = None
        try:
            answers = asked.result()
        except Exception as e:  # noqa: BLE001 - they stay paused, asked again at the next watch
            self._failed(e)
            return
        moved = []
        for tp in answers:
            key = (tp.topic, tp.partition)
            if tp.error is not None:
                self._failed(tp.error)
            elif key in self.paused and tp.offset > self.next[key]:
                moved.append(key)
        if moved:
            self._resume(c, moved)

    def close(self) -> None:
        """Stop the watch's thread and close its client (the consumer's thread, at its end)."""
        if self._pool is not None:
            self._pool.submit(self._close_client)
            self._pool.shutdown(wait=True)
            self._pool = None

    def _close_client(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _resume(self, c, tps: list[tuple[str, int]]) -> None:
        from confluent_kafka import TopicPartition

        c.resume([TopicPartition(t, p) for t, p in tps])
        self._query_tps = self._recent_tps = None
        now = time.monotonic()
        for tp in tps:
            self.paused.discard(tp)
            self.paused_at.pop(tp, None)
            self.last[tp] = now
        self.resumes += len(tps)

    def _failed(self, e: Exception) -> None:
        now = time.monotonic()
        if now - self._warned >= 60:
            self._warned = now
            log.warning("watching idle source partitions failed; they are asked again", **kv(error=str(e)))


def _chunks(tps) -> list[list]:
    """`tps` as TopicPartition(LATEST) lists of WATCH_CHUNK each (one offsets_for_times call each)."""
    from confluent_kafka import TopicPartition

    q = [TopicPartition(t, p, LATEST) for t, p in tps]
    return [q[i:i + WATCH_CHUNK] for i in range(0, len(q), WATCH_CHUNK)]
