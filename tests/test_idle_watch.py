"""Idle source partitions paused and watched (kdsync.kafka.idle_watch) on a
real broker: a partition that fell idle stops being fetched, and a record
written to it at any moment — one, or a batch Tansu reports with a low end
offset — is still consumed, once, in order."""

import asyncio
import random
import time

import pytest

from kdsync.kafka.embedded import embedded_clusters
from kdsync.kafka.source import SourceConsumer, consumer_conf
from kdsync.kafka.topic import TopicSpec, ensure_topics

pytestmark = pytest.mark.timeout(240)

TOPICS = [f"idle-{i}" for i in range(4)]


def produce(bootstrap: str, records: list[tuple[str, bytes]], linger_ms: int = 0) -> None:
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": linger_ms, "log_level": 3})
    for topic, value in records:
        p.produce(topic, value=value, partition=0)
    assert p.flush(30) == 0


async def consume_while(bootstrap: str, body, idle=(0.3, 0.1, 1)):
    """Run a SourceConsumer over TOPICS while `body(source, got)` runs (in a thread)."""
    loop = asyncio.get_running_loop()
    got: dict[str, list[int]] = {t: [] for t in TOPICS}  # source offsets consumed
    fatal: list[str] = []

    def on_runs(runs):
        for r in runs:
            got[r.topic].extend(e.offset for e in r.events)

    src = SourceConsumer(consumer_conf("w", {"bootstrap.servers": bootstrap}), "w", loop, on_runs=on_runs,
                         on_fatal=fatal.append, on_lag=lambda *a: None, idle=idle)
    for t in TOPICS:
        src.add_topic(t, {})
    src.start()
    try:
        await asyncio.to_thread(body, src, got)
    finally:
        src.close()
    assert not fatal, fatal
    return src, got


def until(cond, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.parametrize("long_idle", [False, True], ids=["watched", "long-idle"])
def test_idle_partitions_are_paused_and_every_record_written_later_is_consumed_once_in_order(tmp_path, monkeypatch,
                                                                                              long_idle):
    from kdsync.kafka import idle_watch

    if long_idle:  # partitions turn long-idle within the rounds: asked every 0.4 s, the others every 0.1 s
        monkeypatch.setattr(idle_watch, "LONG_IDLE_S", 0.3)
    rng = random.Random(7)
    with embedded_clusters(1, log_dir=tmp_path) as (c,):
        ensure_topics(c.bootstrap, [TopicSpec(t) for t in TOPICS], timeout=60)
        sent: dict[str, list[bytes]] = {t: [] for t in TOPICS}

        def body(src, got):
            idle = src.idle
            until(lambda: len(idle.next) == len(TOPICS), what="assignment")
            until(lambda: len(idle.paused) == len(TOPICS), what="every idle partition paused")
            for round_ in range(12):
                # records at random moments around the pause: before it, right after it, while watched
                time.sleep(rng.choice([0.0, 0.05, 0.2, 0.35, 0.5]))
                topic = rng.choice(TOPICS)
                batch = [(topic, b"%s-%d-%d" % (topic.encode(), round_, i)) for i in range(rng.choice([1, 1, 5]))]
                produce(c.bootstrap, batch, linger_ms=20)  # a batch of 5 is one batch: Tansu's end is low
                sent[topic].extend(v for _, v in batch)
            until(lambda: all(len(got[t]) >= len(sent[t]) for t in TOPICS), what="every record consumed")
            until(lambda: len(idle.paused) == len(TOPICS), what="paused again")

        src, got = asyncio.run(consume_while(c.bootstrap, body, idle=(0.3, 0.1, 1, 0.4 if long_idle else 0.1)))
        assert got == {t: list(range(len(sent[t]))) for t in TOPICS}  # exactly once, in order
        assert src.idle.resumes >= len({t for t in TOPICS if sent[t]}) and src.idle.pauses > len(TOPICS)


def test_with_no_more_partitions_than_hot_nothing_is_paused(tmp_path):
    with embedded_clusters(1, log_dir=tmp_path) as (c,):
        ensure_topics(c.bootstrap, [TopicSpec(t) for t in TOPICS], timeout=60)

        def body(src, got):
            until(lambda: len(src.idle.next) == len(TOPICS), what="assignment")
            time.sleep(1.0)  # ten idle periods: would pause every partition with hot = 1
            assert not src.idle.paused and src.idle.pauses == 0
            produce(c.bootstrap, [(TOPICS[0], b"x")])
            until(lambda: got[TOPICS[0]] == [0], what="the record")

        asyncio.run(consume_while(c.bootstrap, body, idle=(0.1, 0.1, len(TOPICS) + 1)))


def test_beyond_the_hot_partitions_the_least_recently_active_are_watched(tmp_path):
    with embedded_clusters(1, log_dir=tmp_path) as (c,):
        ensure_topics(c.bootstrap, [TopicSpec(t) for t in TOPICS], timeout=60)

        def body(src, got):
            idle = src.idle
            until(lambda: len(idle.next) == len(TOPICS), what="assignment")
            until(lambda: len(idle.paused) == len(TOPICS), what="new empty partitions watched")
            for i, t in enumerate(TOPICS):  # one record each, oldest first: the last two are the hot ones
                produce(c.bootstrap, [(t, b"r")])
                until(lambda: got[t] == [0], what=f"the record of {t}")
            until(lambda: idle.paused == {(t, 0) for t in TOPICS[:2]}, what="the two least recently active paused")

        # idle_after 60 s: only the hot limit pauses here
        src, got = asyncio.run(consume_while(c.bootstrap, body, idle=(60.0, 0.1, 2)))
        assert got == {t: [0] for t in TOPICS}


class _Client:
    """offsets_for_times of a client whose partitions all end at `end` (records the calls)."""

    def __init__(self, end: int):
        self.end, self.calls = end, []

    def offsets_for_times(self, tps, timeout):
        from confluent_kafka import TopicPartition

        self.calls.append(len(tps))
        return [TopicPartition(tp.topic, tp.partition, self.end) for tp in tps]


class _Consumer:
    def __init__(self):
        self.resumed = []

    def resume(self, tps):
        self.resumed.extend((tp.topic, tp.partition) for tp in tps)


def test_the_watch_asks_in_chunks_and_resumes_every_partition_a_record_came_to(monkeypatch):
    from kdsync.kafka import idle_watch
    from kdsync.kafka.idle_watch import IdleWatch

    monkeypatch.setattr(idle_watch, "WATCH_CHUNK", 2)
    w = IdleWatch({}, after_s=1.0, watch_s=0.1, hot=0)
    w._client = client = _Client(end=5)
    for i in range(5):
        w.assigned((f"t{i}", 0), 5 if i < 3 else 4, now=0.0)  # t3, t4: a record waits (end 5 > next 4)
    w.paused.update(w.next)
    w._ask()
    w._asked.result(timeout=10)
    c = _Consumer()
    w._answers(c)
    assert client.calls == [2, 2, 1]  # 5 partitions, 2 a call
    assert sorted(c.resumed) == [("t3", 0), ("t4", 0)] and w.paused == {("t0", 0), ("t1", 0), ("t2", 0)}
    w._ask()  # the paused set changed: the query is built again, of the 3 left
    w._asked.result(timeout=10)
    assert client.calls[3:] == [2, 1]
    w.close()


def test_with_every_partition_paused_the_consumer_sleeps_until_the_watch_answers():
    import threading
    from concurrent.futures import Future

    from kdsync.kafka.idle_watch import IdleWatch

    w = IdleWatch({}, after_s=1.0, watch_s=0.5, hot=0)
    w._asked = f = Future()
    threading.Timer(0.05, f.set_result, ([],)).start()
    t0 = time.monotonic()
    w.wait(30.0, threading.Event())  # returns with the answer, not at the timeout
    assert f.done() and time.monotonic() - t0 < 10
    w._asked = None
    w._next_watch = w._next_scan = time.monotonic() + 60
    stop = threading.Event()
    threading.Timer(0.05, stop.set).start()
    t0 = time.monotonic()
    w.wait(30.0, stop)  # no query under way: until the next one is due, or stop
    assert stop.is_set() and time.monotonic() - t0 < 10


class _Named(_Client):
    """_Client that records the partitions each query asked."""

    def __init__(self, end: int):
        super().__init__(end)
        self.asked: list[set] = []

    def offsets_for_times(self, tps, timeout):
        self.asked.append({tp.topic for tp in tps})
        return super().offsets_for_times(tps, timeout)


def test_partitions_paused_a_minute_are_watched_every_long_interval_the_others_every_watch():
    from kdsync.kafka.idle_watch import LONG_IDLE_S, IdleWatch

    w = IdleWatch({}, after_s=1.0, watch_s=0.5, hot=0, long_watch_s=2.0)
    w._client = client = _Named(end=5)
    for t, paused_at in (("old", 0.0), ("new", 50.0)):
        w.assigned((t, 0), 5, now=0.0)  # caught up: end 5 = next 5, nothing resumed
        w.paused.add((t, 0))
        w.paused_at[(t, 0)] = paused_at
    c = _Consumer()

    def queries(t0: float, t1: float) -> list[set]:
        """Step the watch every 0.1 s over [t0, t1); the topics each query asked."""
        n = len(client.asked)
        for k in range(round((t1 - t0) * 10)):
            w.step(c, t0 + k / 10)
            if w._asked is not None:
                w._asked.result(timeout=10)
        return [set(x) for x in client.asked[n:]]

    # "old" was paused a minute ago: asked with every partition every 2 s, "new" every 0.5 s
    got = queries(100.0, 104.0)
    assert got.count({"old", "new"}) == 2 and got.count({"new"}) == 6 and len(got) == 8, got
    # "new" turns long-idle at 110: from then on one query of both every 2 s, nothing between
    got = queries(50.0 + LONG_IDLE_S + 1, 50.0 + LONG_IDLE_S + 7)
    assert got and all(q == {"old", "new"} for q in got) and len(got) == 3, got
    # a partition paused now is asked within watch_s, not at the next long query (as _pause_idle leaves it)
    now = 50.0 + LONG_IDLE_S + 7
    w.assigned(("fresh", 0), 5, now=0.0)
    w.paused.add(("fresh", 0))
    w.paused_at[("fresh", 0)] = now
    w._query_tps = w._recent_tps = None
    w._next_watch = min(w._next_watch, now + 0.5)
    got = queries(now, now + 0.6)
    assert any("fresh" in q for q in got), got
    assert not c.resumed
    w.close()
