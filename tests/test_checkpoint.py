"""Checkpoints without brokers: the start-up rules of `decide_start` on
global partitions described in memory (what `load_start` would have read),
the checkpoint record's codec, the CheckpointWriter's timing against a fake
producer, and the rate-limited librdkafka log adapter.  The same parts run
through real brokers and real member processes in
tests/test_member_checkpoint.py."""

from __future__ import annotations

import asyncio
import json
import logging

import time

import pytest
from confluent_kafka import KafkaError

from kdsync.core import Delivery, Event, batches_from_events
from kdsync.kafka.checkpoint import Checkpoint, CheckpointRounds, CheckpointWriter
from kdsync.kafka.reader import (AFTER_DELETION, ANCHORED, AT_CHECKPOINT, FROM_START, PartitionRead, StartError,
                                 _Keys, _read_partition, decide_start)
from kdsync.kafka.records import global_headers, pack_payload
from kdsync.observability.logs import KafkaClientLog

from helpers import FakeMessage

T = "t-global"


def part(p: int, records, how: str = FROM_START, low: int = 0, end: int | None = None) -> PartitionRead:
    """A partition read: records are (offset, seq, (origin, partition), origin offset)."""
    r = PartitionRead(p, low, records[0][0] if records else low, how)
    keys = KEYS
    for off, seq, key, ooff in records:
        if key not in keys:
            keys.append(key)
        r.add(off, seq, keys.index(key), ooff)
    r.end = end if end is not None else (records[-1][0] + 1 if records else low)
    return r


KEYS: list[tuple[str, int]] = []


@pytest.fixture(autouse=True)
def _keys():
    KEYS.clear()


def linear(first_seq: int, n: int, first_offset: int | None = None, origins=("a", "b")):
    """n records of one partition at consecutive positions, origins taking turns
    (origin offsets = position // len(origins))."""
    off0 = first_seq if first_offset is None else first_offset
    return [(off0 + i, first_seq + i, (origins[(first_seq + i) % len(origins)], 0), (first_seq + i) // len(origins))
            for i in range(n)]


def truth(n: int, origins=("a", "b")) -> dict:
    """Watermarks of positions 0..n-1 laid out by `linear`."""
    wm = {}
    for s in range(n):
        wm[(origins[s % len(origins)], 0)] = s // len(origins)
    return wm


def decide(reads, cp=None):
    return decide_start(T, reads, cp, KEYS)


def test_no_checkpoint_whole_topic_from_position_0():
    s = decide([part(0, linear(0, 10))])
    assert (s.end, s.present, s.lost, s.records, s.seq_base) == (10, set(), None, 10, 0)
    assert s.watermarks == truth(10) and s.ends == (10,)
    empty = decide([part(0, [])])
    assert (empty.end, empty.watermarks, empty.lost) == (0, {}, None)


def test_anchored_checkpoint_reads_only_what_follows_it():
    cp = Checkpoint(T, 100, (100,), truth(100))
    # read from offset 99 (the record before the checkpoint's offset) to the end at 120
    s = decide([part(0, linear(99, 21), ANCHORED)], cp)
    assert (s.end, s.present, s.lost, s.records) == (120, set(), None, 21)
    assert s.watermarks == truth(120)
    # a checkpoint taken while records were in flight: offsets below its position are read again, harmlessly
    cp2 = Checkpoint(T, 100, (90,), truth(100))
    s2 = decide([part(0, linear(89, 31), ANCHORED)], cp2)
    assert (s2.end, s2.watermarks) == (120, truth(120))


def test_checkpoint_says_durable_what_the_topic_lacks_is_refused():
    # T-global deleted and created again, its checkpoint topic kept
    cp = Checkpoint(T, 50, (50,), truth(50))
    with pytest.raises(StartError, match=r"says positions below 50 are durable in t-global, but t-global does "
                                         r"not hold position 0"):
        decide([part(0, [])], cp)
    # the topic ends before the checkpoint's position
    with pytest.raises(StartError, match="does not hold position 40"):
        decide([part(0, linear(0, 40))], cp)


def test_retention_deleted_records_after_an_old_checkpoint_falls_back_to_the_first_record():
    # checkpoint at 100 (offset 100); retention deleted offsets below 300: first record left is position 300
    cp = Checkpoint(T, 100, (100,), truth(100))
    s = decide([part(0, linear(300, 50), AFTER_DELETION, low=300)], cp)
    assert (s.end, s.present, s.lost) == (350, set(), (100, 300))
    assert s.watermarks == truth(350)  # every origin partition has records after the loss: exact
    # an origin partition seen only in the lost range keeps the checkpoint's watermark (documented)
    cp_c = Checkpoint(T, 100, (100,), {**truth(100), ("c", 3): 7})
    assert decide([part(0, linear(300, 50), AFTER_DELETION, low=300)], cp_c).watermarks[("c", 3)] == 7
    # no checkpoint at all (an upgrade) and the oldest records deleted: positions from the first record
    s = decide([part(0, linear(300, 50), AFTER_DELETION, low=300)])
    assert (s.end, s.lost, s.watermarks) == (350, (0, 300), truth(350))


def test_everything_deleted_after_the_checkpoint_is_refused():
    cp = Checkpoint(T, 100, (100,), truth(100))
    with pytest.raises(StartError, match=r"cannot prove the next position of t-global: partition 0 is empty, its "
                                         r"records up to offset 400 were deleted \(retention\) after the "
                                         r"checkpoint at position 100"):
        decide([part(0, [], AFTER_DELETION, low=400, end=400)], cp)
    with pytest.raises(StartError, match="t-global.kdsync holds no checkpoint"):
        decide([part(0, [], AFTER_DELETION, low=400, end=400)])


def test_record_before_the_checkpoint_offset_deleted_but_none_after():
    # retention deleted exactly up to the checkpoint's offset: nothing after it is lost
    cp = Checkpoint(T, 100, (100,), truth(100))
    s = decide([part(0, linear(100, 5), AT_CHECKPOINT, low=100)], cp)
    assert (s.end, s.lost, s.watermarks) == (105, None, truth(105))
    # and when nothing was written since the checkpoint either (a clean stop, then retention)
    s = decide([part(0, [], AT_CHECKPOINT, low=100, end=100)], cp)
    assert (s.end, s.lost, s.watermarks) == (100, None, truth(100))


def test_topic_restored_from_an_archive_that_starts_past_0():
    # kdsync restore writes positions 500.. at offsets 0..: no deletion to see, yet positions below 500 are absent
    s = decide([part(0, linear(500, 20, first_offset=0))])
    assert (s.end, s.lost, s.present, s.seq_base) == (520, (0, 500), set(), 500)
    assert s.watermarks == {k: v for k, v in truth(520).items()}
    # with the old cluster's checkpoint (its offsets no longer fit: load_start read from the first record)
    cp = Checkpoint(T, 300, (300,), truth(300))
    s = decide([part(0, linear(500, 20, first_offset=0))], cp)
    assert (s.end, s.lost, s.watermarks) == (520, (300, 500), truth(520))


def test_one_partition_never_has_a_crash_gap():
    with pytest.raises(StartError, match="t-global has a hole at position 5 .position 6 is present. that no "
                                         "crash explains"):
        decide([part(0, linear(0, 5) + [(5, 6, ("a", 0), 3)])])


def test_several_partitions_crash_gap_is_kept_from_the_checkpoint():
    # 3 partitions by position mod 3; a crash lost position 7 (partition 1) while 8 and 9 landed
    recs = {p: [] for p in range(3)}
    for s_ in list(range(7)) + [8, 9]:
        recs[s_ % 3].append((len(recs[s_ % 3]), s_, ("a", 0), s_))
    s = decide([part(p, recs[p]) for p in range(3)])
    assert (s.end, s.present, s.watermarks) == (7, {8, 9}, {("a", 0): 6})
    # the same from a checkpoint at 6 (offsets 2, 2, 2): anchored reads of each partition
    cp = Checkpoint(T, 6, (2, 2, 2), {("a", 0): 5})
    reads = [part(p, [r for r in recs[p] if r[0] >= 1], ANCHORED) for p in range(3)]
    s = decide(reads, cp)
    assert (s.end, s.present, s.watermarks, s.lost) == (7, {8, 9}, {("a", 0): 6}, None)


def test_several_partitions_restored_past_0_start_after_the_highest_first_record():
    # an archive that starts at position 30: each partition starts somewhere at or after it
    recs = {p: [] for p in range(3)}
    for s_ in range(30, 60):
        recs[s_ % 3].append((len(recs[s_ % 3]), s_, ("a", 0), s_))
    s = decide([part(p, recs[p]) for p in range(3)])
    assert (s.end, s.present, s.lost) == (60, set(), (0, 32))
    # retention deleted different amounts in each partition: positions below the highest first record may be gone
    cut = [[r for r in recs[p] if r[1] >= (40, 35, 50)[p]] for p in range(3)]
    s = decide([part(p, cut[p], AFTER_DELETION, low=cut[p][0][0]) for p in range(3)])
    assert (s.end, s.lost) == (60, (0, 50))


def test_checkpoint_record_codec():
    cp = Checkpoint(T, 120000, (120000, 7), {("dc1", 0): 40000, ("dc2", 3): 39999}, "dc1", 1712345678901)
    raw = cp.encode()
    assert json.loads(raw) == {"version": 1, "topic": T, "member": "dc1", "seq": 120000, "offsets": [120000, 7],
                               "watermarks": [["dc1", 0, 40000], ["dc2", 3, 39999]], "written_ms": 1712345678901}
    assert Checkpoint.decode(raw) == cp
    for bad, why in [(None, "empty"), (b"{", "not JSON"), (b"[1]", "not a JSON object"),
                     (b'{"version": 2}', "unknown version 2"),
                     (b'{"version": 1, "topic": "t", "seq": -1, "offsets": [], "watermarks": []}', "malformed"),
                     (b'{"version": 1, "topic": "t", "seq": 1, "offsets": [1], "watermarks": [[1, 0, 0]]}',
                      "malformed")]:
        with pytest.raises(ValueError, match=why):
            Checkpoint.decode(bad)


class FakeProducer:
    def __init__(self):
        self.records = []

    def produce(self, topic, key=None, value=None, partition=-1, on_delivery=None):
        self.records.append((topic, key, value, partition, on_delivery))

    def flush(self, timeout):
        return 0


def _delivery(first, origin, first_offset, n):
    evs = [Event(origin, 0, first_offset + i, pack_payload(None, b"v", []), 1) for i in range(n)]
    return Delivery(first, tuple(batches_from_events(evs)))


def test_writer_takes_position_and_watermarks_before_measuring_is_used_and_writes_once_durable():
    ends = {"now": (0,)}
    prod = FakeProducer()

    async def scenario():
        w = CheckpointWriter(prod, T, 1, "dc1", start_seq=0, watermarks={}, min_seq=0, last=None,
                             measure=lambda exact=False, timeout=None: ends["now"], interval_s=3600, positions=1000)
        w.delivered(_delivery(0, "a", 0, 10))
        ends["now"] = (6,)  # six records confirmed when the end offsets are read
        await w.take()
        assert prod.records == []  # positions below 10 not durable yet: pending
        w.durable(8)
        assert prod.records == []
        w.durable(10)
        (topic, key, value, partition, done), = prod.records
        assert (topic, key, partition) == ("t-global.kdsync", b"t-global", 0)
        cp = Checkpoint.decode(value)
        assert (cp.seq, cp.offsets, cp.watermarks, cp.member) == (10, (6,), {("a", 0): 9}, "dc1")
        done(None, None)
        assert w.last.seq == 10 and w.written == 1
        await w.take()  # nothing new: nothing written
        assert len(prod.records) == 1
        # `positions` more durable positions take one at once
        w.delivered(_delivery(10, "b", 0, 1000))
        ends["now"] = (1010,)
        w.durable(1010)
        await asyncio.sleep(0.05)
        assert Checkpoint.decode(prod.records[-1][2]).seq == 1010

        class Failed:
            def str(self):
                return "Broker: not enough replicas"

        prod.records[-1][4](Failed(), None)  # that write failed: the next take writes it again
        assert w.last.seq == 10
        await w.take()
        assert len(prod.records) == 3 and Checkpoint.decode(prod.records[-1][2]).seq == 1010
        prod.records[-1][4](None, None)
        assert w.last.seq == 1010 and w.written == 2
        # below min_seq (positions beyond a crash gap were written before): none
        w2 = CheckpointWriter(prod, T, 1, "dc1", start_seq=5, watermarks={}, min_seq=9, last=None,
                              measure=lambda exact=False, timeout=None: (3,), interval_s=3600, positions=1000)
        w2.durable(5)
        await w2.take()
        assert len(prod.records) == 3

    asyncio.run(scenario())


def test_rounds_take_each_writers_checkpoint_every_interval_from_one_timer_and_skip_idle_ones():
    """CheckpointRounds (issue 26): one timer for every writer; a writer's
    measure runs once per interval while its topic moves, never while it is
    idle (nothing delivered since its last measure found nothing new), and
    not after stop()."""
    prod = FakeProducer()
    measured = {"busy": 0, "idle": 0, "stopped": 0}

    def writer(name, interval_s):
        def measure(exact=False, timeout=None):
            measured[name] += 1
            return (0,)
        return CheckpointWriter(prod, T, 1, "dc1", start_seq=0, watermarks={}, min_seq=0, last=None,
                                measure=measure, interval_s=interval_s, positions=10**9)

    async def scenario():
        loop = asyncio.get_running_loop()
        rounds = CheckpointRounds(round_s=0.01)
        busy, idle, stopped = writer("busy", 0.05), writer("idle", 0.05), writer("stopped", 0.05)
        for w in (busy, idle, stopped):
            rounds.add(w)
        assert rounds._timer is not None and len(loop._scheduled) == 1  # one timer for three writers
        stopped.stop()
        end = loop.time() + 0.6
        while loop.time() < end:
            busy.delivered(_delivery(busy.next_seq, "a", busy.next_seq, 1))  # it moves: each measure finds more
            await asyncio.sleep(0.01)
        rounds.close()
        return len(rounds)

    assert asyncio.run(scenario()) == 0
    # 0.6 s / 0.05 s: about 12 measures (rounds of 10 ms late each time: at least 8)
    assert 8 <= measured["busy"] <= 13, measured
    assert measured["idle"] == 1, measured  # its first measure found nothing new: never again
    assert measured["stopped"] == 0, measured


def test_kafka_client_log_rate_limits_per_kind_and_counts_the_suppressed(caplog):
    now = [0.0]
    log = KafkaClientLog(5.0, clock=lambda: now[0])
    fail = "[thrd:127.0.0.1:1/bootstrap]: 127.0.0.1:1/bootstrap: Connect to ipv4#127.0.0.1:1 failed: refused"
    with caplog.at_level(logging.INFO, logger="kdsync.kafka.client"):
        for _ in range(12):  # one every 0.5 s for 6 s
            log.log(logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#producer-1", fail)
            log.log(logging.WARNING, "%s [%s] %s", "FAIL", "rdkafka#producer-1", "other kind")
            now[0] += 0.5
        log.log(logging.ERROR, "%s [%s] %s", "REQTMOUT", "rdkafka#consumer-2", "timed out")
    lines = [(r.levelno, r.getMessage(), r.kv) for r in caplog.records]
    errors = [x for x in lines if x[0] == logging.ERROR and x[2]["facility"] == "FAIL"]
    assert len(errors) == 2 and len([x for x in lines if x[0] == logging.WARNING]) == 2
    assert errors[0][1] == "Connect to ipv4#127.0.0.1:1 failed: refused"
    assert errors[0][2] == {"facility": "FAIL", "client": "rdkafka#producer-1", "thread": "127.0.0.1:1/bootstrap"}
    assert errors[1][2]["suppressed"] == 9  # the 10 calls between t=0 and t=5 minus the first
    assert lines[-1][2]["facility"] == "REQTMOUT" and "suppressed" not in lines[-1][2]


def test_tools_readers_never_print_raw_librdkafka_lines():
    """A reader of the tools (kdsync offsets, audit, demo, archive) against a
    broker that is down: librdkafka's lines come as ``kdsync: kafka: ...``,
    rate-limited, never as raw ``%3|...`` lines (a real client, a real
    refused connection, in a fresh process with no logging configured)."""
    import re
    import subprocess
    import sys

    code = ("import socket, time\n"
            "from confluent_kafka import TopicPartition\n"
            "from kdsync.kafka.topic import consumer\n"
            "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
            "c = consumer(f'127.0.0.1:{port}')\n"
            "c.assign([TopicPartition('t', 0, 0)])\n"
            "t0 = time.monotonic()\n"
            "while time.monotonic() - t0 < 3:\n"
            "    c.poll(0.1)\n"
            "c.close()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    lines = r.stderr.splitlines()
    assert r.returncode == 0, r.stderr
    assert not [x for x in lines if re.match(r"%\d+\|", x)], r.stderr
    fails = [x for x in lines if x.startswith("kdsync: kafka: Connect to ipv4#127.0.0.1:")]
    assert len(fails) == 1, r.stderr  # the connection is retried many times in 3 s: one line per kind per 5 s


# ---------------------------------------------------------------- reading a partition whose oldest records are gone
def Msg(topic, part, offset, seq=None, eof=False):
    headers = None if seq is None else global_headers(seq, ("a", "b")[seq % 2], 0, seq // 2, 1)
    return FakeMessage(None, b"v", headers, topic, part, offset,
                       error=KafkaError(KafkaError._PARTITION_EOF) if eof else None)


class TruncatedPartition:
    """A consumer of one partition holding positions low..end-1 at offsets
    low..end-1 (the records below `low` deleted, as retention does); like
    Tansu, a fetch beyond the end never answers."""

    def __init__(self, low: int, end: int):
        self.low, self.end, self.pos, self.fetches = low, end, None, []

    def assign(self, tps):
        self.pos = max(tps[0].offset, self.low)
        self.fetches.append(self.pos)

    def unassign(self):
        self.pos = None

    def consume(self, n, timeout):
        if self.pos > self.end:
            return []  # never an answer
        out = [Msg(T, 0, o, o) for o in range(self.pos, min(self.end, self.pos + n))]
        self.pos += len(out)
        if self.pos == self.end:
            out.append(Msg(T, 0, self.end, eof=True))
            self.pos += 1  # EOF reported once
        return out


def read_one(c, cp, high=None):
    keys = _Keys()
    r = _read_partition(c, T, 0, c.low, c.end if high is None else high, cp, keys, 5.0)
    return decide_start(T, [r], cp, keys.list), r


def test_reading_a_partition_after_retention_deleted_its_oldest_records():
    wm100 = {("a", 0): 49, ("b", 0): 49}
    # the checkpoint is older than the first record left: read from the first record, positions 100..299 lost
    s, r = read_one(TruncatedPartition(300, 350), Checkpoint(T, 100, (100,), wm100))
    assert (r.how, s.end, s.lost, s.records) == (AFTER_DELETION, 350, (100, 300), 50)
    assert s.watermarks == {("a", 0): 174, ("b", 0): 174}
    # deleted exactly up to the checkpoint's offset: nothing after it lost
    s, r = read_one(TruncatedPartition(300, 350), Checkpoint(T, 300, (300,), {("a", 0): 149, ("b", 0): 149}))
    assert (r.how, s.end, s.lost, s.records) == (AT_CHECKPOINT, 350, None, 50)
    # the checkpoint inside what is left: anchored at the record before its offset
    c = TruncatedPartition(300, 350)
    s, r = read_one(c, Checkpoint(T, 340, (340,), {("a", 0): 169, ("b", 0): 169}))
    assert (r.how, s.end, s.lost, s.records, c.fetches) == (ANCHORED, 350, None, 11, [339])
    # ListOffsets reporting too low an end (Tansu after a multi-record batch): the record is looked for first
    c = TruncatedPartition(300, 350)
    s, r = read_one(c, Checkpoint(T, 340, (340,), {("a", 0): 169, ("b", 0): 169}), high=320)
    assert (r.how, s.end, c.fetches) == (ANCHORED, 350, [339, 339])
    # everything after the checkpoint deleted and nothing left: refused
    with pytest.raises(StartError, match="partition 0 is empty, its records up to offset 400 were deleted"):
        read_one(TruncatedPartition(400, 400), Checkpoint(T, 100, (100,), wm100))


def test_checkpoint_offsets_beyond_the_end_are_not_fetched_forever():
    # a checkpoint of a longer topic (this one was recreated shorter): its offset is past the end, which a
    # broker like Tansu never answers; the short probe gives up and the partition is read from its start
    c = TruncatedPartition(0, 40)
    with pytest.raises(StartError, match="does not hold position 40"):
        read_one(c, Checkpoint(T, 50, (50,), {}), high=40)
    assert c.fetches[0] == 49 and c.fetches[-1] == 0


def test_an_idle_topic_asks_its_cluster_nothing_until_a_delivery_or_a_failed_write():
    """A thousand idle topics must not each ask for end offsets every interval
    (issue 26): a measure taken with nothing in flight is the topic's end at
    that position, and one that found nothing new ends the asking too; the
    next takes skip it until the position moves, or the last write fails (it
    must be written again).  A measure taken while records were in flight is
    taken again (it may be short of them)."""
    calls = []
    prod = FakeProducer()
    ends = {"now": (10,)}

    def measure(exact=False, timeout=None):
        calls.append(exact)
        if "hook" in ends:
            ends["hook"]()  # acknowledgements arrive while the ends are read
        return ends["now"]

    async def scenario():
        w = CheckpointWriter(prod, T, 1, "dc1", start_seq=0, watermarks={}, min_seq=0, last=None,
                             measure=measure, interval_s=3600, positions=1000)
        w.delivered(_delivery(0, "a", 0, 10))
        w.durable(10)
        await w.take()  # nothing in flight: the ends measured are the topic's ends at 10
        assert len(calls) == 1 and len(prod.records) == 1
        prod.records[-1][4](None, None)
        for _ in range(5):
            await w.take()
        assert len(calls) == 1, "an idle topic measured its end offsets again"

        class Failed:
            def str(self):
                return "Broker: request timed out"

        w.delivered(_delivery(10, "a", 10, 5))
        w.durable(15)
        ends["now"] = (15,)
        await w.take()  # the position moved: measured and written
        assert len(calls) == 2 and Checkpoint.decode(prod.records[-1][2]).seq == 15
        await w.take()  # written, not confirmed yet: nothing new, nothing asked
        assert len(calls) == 2 and len(prod.records) == 2
        prod.records[-1][4](Failed(), None)  # ...and then it failed: taken again at once
        await w.take()
        assert len(calls) == 3 and len(prod.records) == 3 and Checkpoint.decode(prod.records[-1][2]).seq == 15
        prod.records[-1][4](None, None)
        # records in flight while measured: measured again at the next take, whether
        # they became durable after the measure (pending) or during it (written at once)
        for first, acked_during in ((15, False), (20, True)):
            w.delivered(_delivery(first, "a", first, 5))
            ends["now"] = (first + 2,)  # two of the five confirmed when the ends are read
            n = len(calls)
            if acked_during:
                ends["hook"] = lambda: w.durable(first + 5)
            await w.take()
            ends.pop("hook", None)
            if not acked_during:
                assert len(prod.records) == 3  # pending: positions below 20 not durable
                w.durable(first + 5)
            assert Checkpoint.decode(prod.records[-1][2]).offsets == (first + 2,)
            prod.records[-1][4](None, None)
            ends["now"] = (first + 5,)
            await w.take()
            assert len(calls) == n + 2, "a measure short of records in flight was not taken again"
            assert Checkpoint.decode(prod.records[-1][2]).offsets == (first + 5,)
            prod.records[-1][4](None, None)
            await w.take()
            assert len(calls) == n + 2
        # a clean stop: exact unless the cluster holds an exact checkpoint of this very position
        n = len(calls)
        await w.final(timeout=0.1)
        assert calls[-1] is True and len(calls) == n + 1
        w.known_exact(25, (25,))
        await w.final(timeout=0.1)
        assert len(calls) == n + 1, "a clean stop of an idle topic read its global topic again"

    asyncio.run(scenario())


def test_a_topic_started_at_known_end_offsets_measures_nothing_until_a_delivery():
    """A member starting a thousand topics read (or, new topics, knew) each
    one's end offsets at start (known_exact): their checkpoint writers ask
    the cluster nothing until a position is delivered."""
    calls = []
    prod = FakeProducer()

    def measure(exact=False, timeout=None):
        calls.append(exact)
        return (3,)

    async def scenario():
        w = CheckpointWriter(prod, T, 1, "dc1", start_seq=0, watermarks={}, min_seq=0, last=None,
                             measure=measure, interval_s=3600, positions=1000)
        w.known_exact(0, (0,))
        for _ in range(3):
            await w.take()
        assert calls == []
        w.delivered(_delivery(0, "a", 0, 3))
        w.durable(3)
        await w.take()
        assert calls == [False] and Checkpoint.decode(prod.records[-1][2]).seq == 3

    asyncio.run(scenario())


def test_end_offsets_are_each_partitions_end_on_a_real_broker(tmp_path):
    """EndOffsets (the checkpoints' measure, one ListOffsets for every
    partition of the topic): each partition's end, 0 for an empty one, a
    shard's own partition alone, in one shared client for many topics; a
    missing topic is an error, not an end."""
    from confluent_kafka import KafkaException, Producer

    from kdsync.kafka.checkpoint import EndOffsets, OffsetsConsumer
    from kdsync.kafka.embedded import embedded_clusters
    from kdsync.kafka.topic import TopicSpec, ensure_topics

    with embedded_clusters(1, log_dir=tmp_path) as (c,):
        conf = {"bootstrap.servers": c.bootstrap}
        ensure_topics(c.bootstrap, [TopicSpec("ends-a", 3), TopicSpec("ends-b", 1)], timeout=60)
        p = Producer({**conf, "linger.ms": 0, "log_level": 3})
        for part, n in ((0, 5), (2, 2)):  # partition 1 of ends-a stays empty
            for i in range(n):  # a batch a record: Tansu reports an end as its last batch's base + 1
                p.produce("ends-a", value=b"x", partition=part)
                assert p.flush(30) == 0
        for i in range(7):
            p.produce("ends-b", value=b"y", partition=0)
        assert p.flush(30) == 0  # 7 records, maybe in one batch: the end may be reported low, never high
        shared = OffsetsConsumer(conf)
        try:
            assert EndOffsets(conf, "ends-a", 3, shared=shared)() == (5, 0, 2)
            (end_b,) = EndOffsets(conf, "ends-b", 1, shared=shared)()
            assert 1 <= end_b <= 7
            assert EndOffsets(conf, "ends-a", 3, shard=2, shared=shared)() == (2,)
            with pytest.raises(KafkaException):
                EndOffsets(conf, "ends-missing", 1, timeout=5.0, shared=shared)()
            # the exact ends (a clean stop's last checkpoint) read to each partition's EOF
            assert EndOffsets(conf, "ends-a", 3, shared=shared)(exact=True, timeout=20.0) == (5, 0, 2)
            # ...and a broker that answers nothing holds them no longer than `timeout`
            # (a stop's deadline), not `self.timeout` per request and per partition
            c.pause()
            try:
                t0 = time.monotonic()
                with pytest.raises((KafkaException, TimeoutError)):
                    EndOffsets(conf, "ends-a", 3, timeout=30.0, shared=shared)(exact=True, timeout=1.5)
                assert time.monotonic() - t0 < 6.0
            finally:
                c.resume()
        finally:
            shared.close()
