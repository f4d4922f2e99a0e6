"""The member's parts on their own, without brokers: the global-topic writer
(durable prefix, commits of own events, no double writes, fatal errors), the
source's cut into per-partition runs, the hard-state file and the channel
framing.  In-memory stand-ins for the Kafka client here; tests/test_member_*.py
drive the same parts through real brokers and real processes."""

from __future__ import annotations

import pytest

from kdsync.core import Delivery, Event, HardState, RemoteProtocolError
from kdsync.core import batches_from_events
from kdsync.fatal import FatalError
from kdsync.kafka.records import H_SEQ, global_headers, pack_payload
from kdsync.kafka.sink import GlobalWriter
from kdsync.kafka.source import SourceConsumer
from kdsync.state import HardStateFile
from kdsync.transport.channels import frame_channel, split_channel

from helpers import FakeMessage


class FakeProducer:
    """Keeps what was produced; the test decides when (and how) each delivery report comes."""

    def __init__(self):
        self.records = []  # (topic, key, value, headers, partition, on_delivery)

    def produce(self, topic, value=None, key=None, headers=None, partition=-1, on_delivery=None):
        self.records.append((topic, key, value, headers, partition, on_delivery))

    def poll(self, timeout):
        return 0

    def report(self, i, err=None):
        self.records[i][5](err, None)


class Err:
    def str(self):
        return "Broker: not enough replicas"


def ev(origin, part, off):
    return Event(origin, part, off, pack_payload(f"k{off}".encode(), b"v", []), 1000 + off)


def delivery(first, events, catchup=False):
    """A core Delivery of these records (cut into batches as the core hands them over)."""
    return Delivery(first, tuple(batches_from_events(events)), catchup)


def writer(prod, start=0, present=None, partitions=1):
    got = {"durable": [], "done": [], "fatal": [], "scheduled": []}
    w = GlobalWriter(prod, "t-global", partitions, start, origin="me", present=present,
                     on_durable=lambda end, commits: got["durable"].append((end, commits)),
                     on_done=lambda done: got["done"].extend((d.first_seq, d.end_seq, d.catchup) for d in done),
                     on_fatal=got["fatal"].append, schedule=got["scheduled"].append)
    return w, got


def run_scheduled(got):
    while got["scheduled"]:
        got["scheduled"].pop(0)()


def test_writer_reports_the_contiguous_prefix_and_commits_only_own_events_below_it():
    prod = FakeProducer()
    w, got = writer(prod, start=10)
    w.write(delivery(10, (ev("me", 0, 5), ev("dc2", 0, 7), ev("me", 1, 3), ev("me", 0, 6))))
    assert w.produced_end == 14 and w.outstanding == 4
    assert [dict(r[3])[H_SEQ] for r in prod.records] == [b"10", b"11", b"12", b"13"]
    prod.report(1)  # position 11 before 10: nothing durable yet
    run_scheduled(got)
    assert got["durable"] == [] and w.durable_end == 10
    prod.report(0)
    prod.report(2)
    assert w.durable_end == 13 and len(got["scheduled"]) == 1  # one report for the batch of delivery reports
    run_scheduled(got)
    assert got["durable"] == [(13, {0: 6, 1: 4})]  # own events below 13: p0 offset 5, p1 offset 3
    assert got["done"] == []  # the delivery is not wholly durable yet
    prod.report(3)
    run_scheduled(got)
    assert got["durable"][-1] == (14, {0: 7}) and w.outstanding == 0
    assert got["done"] == [(10, 14, False)] and w.written == 4 and got["fatal"] == []
    # the records carry the source record and kdsync's headers, in records.global_headers' order
    key, value, headers = prod.records[2][1:4]
    assert (key, value) == (b"k3", b"v")
    assert headers == global_headers(12, "me", 1, 3, 1003)


def test_writer_skips_positions_already_present_and_refuses_gaps_and_failed_writes():
    prod = FakeProducer()
    w, got = writer(prod, start=2, present={3}, partitions=3)
    w.write(delivery(2, (ev("dc2", 0, 1), ev("dc2", 0, 2)), catchup=True))
    assert len(prod.records) == 1  # position 3 is in the topic already: not written twice
    prod.report(0)
    run_scheduled(got)
    assert got["durable"] == [(4, {})] and got["done"] == [(2, 4, True)] and w.written == 2
    w.write(delivery(9, (ev("me", 0, 9),)))
    assert got["fatal"] == ["internal: delivery at position 9 but t-global continues at 4"]
    w.write(delivery(4, (ev("me", 0, 9),)))
    prod.report(1, Err())
    assert got["fatal"][-1].startswith("writing position 4 to t-global failed: Broker: not enough replicas")
    assert w.durable_end == 4


def Msg(topic, partition, offset):
    return FakeMessage(None, b"v", None, topic, partition, offset, ts=(1, 5))


def test_source_cuts_consumed_records_into_runs_in_their_order():
    s = SourceConsumer({}, "me", loop=None, on_runs=None, on_fatal=None, on_lag=None)
    consumed = {}
    msgs = [Msg("a", 0, 4), Msg("a", 0, 5), Msg("a", 1, 0), Msg("a", 0, 6), Msg("a", 0, 8), Msg("b", 0, 9)]
    runs = s._runs(msgs, consumed)
    assert [(r.topic, r.partition, [e.offset for e in r.events]) for r in runs] == [
        ("a", 0, [4, 5]), ("a", 1, [0]), ("a", 0, [6]), ("a", 0, [8]), ("b", 0, [9])]
    assert all(e.origin == "me" for r in runs for e in r.events)
    assert consumed == {("a", 0): 9, ("a", 1): 1, ("b", 0): 10}


def test_hard_state_file_round_trip_and_corruption(tmp_path):
    f = HardStateFile(tmp_path / "sub" / "t.hardstate")
    assert f.load() is None
    hs = HardState(3, 7, ("dc1", "dc2"), (7, 1), b"\x01\x02")
    f.save(hs)
    assert f.load() == hs and not (tmp_path / "sub" / "t.hardstate.tmp").exists()
    f.path.write_bytes(b"\xc1garbage")
    with pytest.raises(FatalError, match="is corrupt; move it away"):
        f.load()


def test_channels_frame_and_refuse_malformed():
    assert split_channel(frame_channel("topic-1", b"\x00data")) == ("topic-1", b"\x00data")
    for bad in (b"", b"\x00x", b"\x09ab", b"\x02\xff\xfe"):
        with pytest.raises(RemoteProtocolError):
            split_channel(bad)


def test_observe_many_tallies_like_observe():
    from prometheus_client import CollectorRegistry, Histogram

    from kdsync.observability.metrics import LATENCY_BUCKETS, observe_many

    reg = CollectorRegistry()
    h = Histogram("x_seconds", "x", ["t"], buckets=LATENCY_BUCKETS, registry=reg)
    values = [0.0, 0.0005, 0.0007, 0.001, 0.3, 7.0, 100.0, 0.02, 0.02]
    for v in values:
        h.labels("one").observe(v)
    observe_many(h.labels("many"), values)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in reg.collect() for s in fam.samples
               if not s.name.endswith("_created")}
    one = {(n, tuple(x for x in labels if x[0] != "t")): v for (n, labels), v in samples.items() if ("t", "one") in labels}
    many = {(n, tuple(x for x in labels if x[0] != "t")): v for (n, labels), v in samples.items() if ("t", "many") in labels}
    assert one == many and one[("x_seconds_count", ())] == len(values)


class FakeConsumer:
    def __init__(self):
        self.commits = []

    def commit(self, offsets, asynchronous):
        self.commits.append(([(tp.topic, tp.partition, tp.offset) for tp in offsets], asynchronous))


def test_source_commits_at_most_once_per_interval_and_everything_at_the_end():
    delays = []
    s = SourceConsumer({}, "me", loop=None, on_runs=None, on_fatal=None, on_lag=None, commit_interval=3600,
                       on_commit=lambda t, d: delays.append(t))
    c = FakeConsumer()
    s.commit("a", {0: 5})
    s._drain_commits(c)
    assert c.commits == [([("a", 0, 5)], True)]  # the first goes out at once
    s.commit("a", {0: 9, 1: 2})
    s.commit("a", {0: 7})
    s._drain_commits(c)
    assert len(c.commits) == 1  # within the interval: held back...
    assert s._committed == {("a", 0): 9, ("a", 1): 2}  # ...but back-pressure and lag count them durable
    s._drain_commits(c, final=True)
    assert c.commits[-1] == ([("a", 0, 9), ("a", 1, 2)], False)  # the highest offsets, synchronously
    assert delays == ["a", "a"]


def test_source_lag_pass_skips_partitions_paused_with_nothing_consumed_or_committed_since():
    """Issue 26: a thousand idle (paused) partitions are not asked for their
    watermarks at every lag pass; one that moved is, and its lag is told."""
    told = []
    s = SourceConsumer({}, "me", loop=None, on_runs=None, on_fatal=None, on_lag=lambda t, p, lag: told.append((t, p, lag)))
    asked = []

    class C:
        def get_watermark_offsets(self, tp, cached):
            asked.append((tp.topic, tp.partition))
            return 0, 10

    assigned = {("a", p): True for p in range(4)}
    consumed = {("a", p): 10 for p in range(4)}
    s._committed.update({("a", p): 10 for p in range(4)})
    s.idle.paused.update({("a", 0), ("a", 1), ("a", 2)})
    s._update_lag(C(), assigned, consumed)
    assert len(asked) == 4 and sorted(told) == [("a", p, 0) for p in range(4)]  # first pass: every one
    asked.clear()
    s._update_lag(C(), assigned, consumed)
    assert asked == [("a", 3)]  # the paused ones did not move
    s._committed[("a", 1)] = 8  # (a smaller commit would not come; any change counts)
    s.idle.paused.discard(("a", 2))  # resumed
    asked.clear()
    s._update_lag(C(), assigned, consumed)
    assert sorted(asked) == [("a", 1), ("a", 2), ("a", 3)] and told[-1] == ("a", 1, 2)


def test_source_runs_are_batches_with_the_records_timestamps():
    s = SourceConsumer({}, "me", loop=None, on_runs=None, on_fatal=None, on_lag=None)
    runs = s._runs([Msg("a", 0, 4), Msg("a", 0, 5)], {})
    (r,) = runs
    assert (r.batch.origin, r.batch.partition, r.batch.first_offset, r.batch.count) == ("me", 0, 4, 2)
    assert r.batch.timestamps_ms() == [5, 5] and r.fetched_wall > 0 and r.fetched_t > 0
    assert r.batch.payloads() == [pack_payload(None, b"v", None)] * 2


def test_a_failed_producer_is_recovered_in_place_writing_exactly_the_missing_positions_in_order():
    """kdsync.kafka.sink's recovery: after a delivery error the writer is
    suspended (the failed producer's reports are ignored, new deliveries only
    queued); resumed with a new producer and the positions read back from the
    topic, it writes exactly the positions that did not land, in order."""
    old = FakeProducer()
    failed = []
    w, got = writer(old, start=10)
    w.on_failed = failed.append
    w.write(delivery(10, tuple(ev("me", 0, o) for o in range(5, 11))))  # positions 10..15
    old.report(0)
    old.report(1)
    run_scheduled(got)
    assert w.durable_end == 12 and got["durable"][-1] == (12, {})  # own batch 10..15 not wholly durable
    old.report(2, Err())  # position 12's report says failed (but it may have landed)
    assert failed and failed[0].startswith("writing position 12 to t-global failed") and got["fatal"] == []
    w.suspend()
    old.report(3)  # a late report of the failed producer: ignored, the tail read decides
    assert w.durable_end == 12
    w.write(delivery(16, (ev("dc2", 0, 1), ev("me", 0, 11))))  # queued while suspended
    assert len(old.records) == 6
    new = FakeProducer()
    w.resume(new, present={12})  # the tail read found position 12 in the topic
    assert [int(dict(r[3])[H_SEQ]) for r in new.records] == [13, 14, 15, 16, 17]
    for i in range(len(new.records)):
        new.report(i)
    run_scheduled(got)
    assert w.durable_end == 18 and w.outstanding == 0 and got["fatal"] == []
    assert got["durable"][-1] == (18, {0: 12})  # own events below 18: source offset 11 is the last
    assert got["done"][-1] == (16, 18, False)


def test_a_producer_that_refuses_a_record_is_recovered_and_the_delivery_written_again():
    """produce() itself raising (a producer already fatal whose error callback
    has not been served yet) is a producer failure like a failed report: the
    writer suspends, asks for a recovery once, and the delivery it was
    writing is produced again, whole and in order, by the next producer."""
    from confluent_kafka import KafkaError, KafkaException

    class Refusing(FakeProducer):
        def produce(self, *a, **kw):
            if len(self.records) == 2:
                raise KafkaException(KafkaError(KafkaError._FATAL, "Unable to produce message: Local: Fatal error"))
            super().produce(*a, **kw)

    old = Refusing()
    failed = []
    w, got = writer(old, start=0)
    w.on_failed = failed.append
    w.write(delivery(0, tuple(ev("me", 0, o) for o in range(4))))  # positions 0..3: the third is refused
    assert len(failed) == 1 and failed[0].startswith("writing position 2 to t-global failed") and got["fatal"] == []
    assert w.suspended and w.outstanding == 0
    w.write(delivery(4, (ev("dc2", 0, 7),)))  # queued while suspended
    assert len(old.records) == 2
    new = FakeProducer()
    w.resume(new, present={0})  # the tail read found position 0 only
    assert [int(dict(r[3])[H_SEQ]) for r in new.records] == [1, 2, 3, 4]
    for i in range(len(new.records)):
        new.report(i)
    run_scheduled(got)
    assert w.durable_end == 5 and w.outstanding == 0 and got["fatal"] == []


def test_a_fatal_error_raised_by_poll_recovers_the_producer_instead_of_stopping_the_member(tmp_path):
    """A fatal producer error may come out of poll() itself rather than its
    error callback (CI of 2520368: the tick's poll raised
    OUT_OF_ORDER_SEQUENCE_NUMBER and the member stopped with "tick failed").
    Member.poll_producer hands it to the producer recovery, like error_cb."""
    from confluent_kafka import KafkaError, KafkaException

    from kdsync.config import config_from_dict
    from kdsync.member import Member

    class Raising:
        def poll(self, timeout=0):
            raise KafkaException(KafkaError(KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER, "sequence desynchronization",
                                            fatal=True))

    m = Member(config_from_dict({"member": {"id": "dc1", "listen": "127.0.0.1:1"}, "peers": {"dc1": "127.0.0.1:1"},
                                 "kafka": {"bootstrap.servers": "127.0.0.1:1"}, "topics": {"source": "t"}},
                                base_dir=str(tmp_path)))
    failed = []
    m.recovery.failed = failed.append
    m.poll_producer()  # no producer yet: nothing to serve
    m.producer = Raising()
    m.poll_producer()
    assert failed == ["kafka producer: sequence desynchronization"]


def test_read_present_and_floors_come_from_reports():
    """The writer's floors (where a tail read starts) advance with the offsets
    of durable reports, never past a record whose position is not durable."""

    class M:
        def __init__(self, p, o):
            self.p, self.o = p, o

        def partition(self):
            return self.p

        def offset(self):
            return self.o

    prod = FakeProducer()
    w, got = writer(prod, start=0)
    w.floors = {0: 0}
    w.write(delivery(0, tuple(ev("me", 0, o) for o in range(3))))
    prod.records[1][5](None, M(0, 1))  # position 1 before 0: above the gap, the floor stays
    assert w.floors == {0: 0}
    prod.records[0][5](None, M(0, 0))
    assert w.floors == {0: 1}
    prod.records[2][5](None, M(0, None))  # acknowledged as a duplicate after a broker crash: no offset
    assert w.durable_end == 3 and w.floors == {0: 1} and got["fatal"] == []


def test_state_log_group_commit_round_trip_torn_tail_corruption_compaction_and_upgrade(tmp_path):
    """Every group's hard state in one append-only log (kdsync.state.StateLog):
    one append (one fsync) for many topics; a restart reads the latest state
    of each; a record torn by a crash mid-write is cut off, not fatal; a
    record whose checksum fails is; the log is rewritten once it has grown
    well past its live states; an older member's per-topic files are read
    for the topics the log does not hold."""
    from kdsync.state import StateLog

    d = tmp_path / "state"
    log = StateLog(d, compact_bytes=4096)
    assert log.load() == {}
    states = {f"t{i}": HardState(1, i, ("dc1", "dc2", "dc3"), (i, 0), b"") for i in range(200)}
    log.append(list(states.items()))
    log.append([("t7", HardState(1, 9, ("dc1", "dc2"), (9, 1), b"\x01"))])
    log.close()
    again = StateLog(d)
    got = again.load()
    assert got == {**states, "t7": HardState(1, 9, ("dc1", "dc2"), (9, 1), b"\x01")}
    # a torn last record (the crash came mid-write): cut off, the states before it stand
    size = again.path.stat().st_size
    with open(again.path, "ab") as f:
        f.write(b"\x00\x00\x00\x40\x12\x34")
    torn = StateLog(d)
    assert torn.load() == got and torn.path.stat().st_size == size
    torn.append([("t8", HardState(2, 3, ("dc1",), (3, 2), b""))])  # appends after the cut
    torn.close()
    assert StateLog(d).load()["t8"] == HardState(2, 3, ("dc1",), (3, 2), b"")
    # compaction: many appends of the same few topics do not grow the file for ever
    c = StateLog(tmp_path / "c", compact_bytes=4096)
    c.load()
    for k in range(2000):
        c.append([("a", HardState(1, k, ("dc1",), (k, 0), b"")), ("b", HardState(1, k, ("dc1",), (k, 1), b""))])
    assert c.path.stat().st_size < 3 * 4096
    c.close()
    assert StateLog(tmp_path / "c").load() == {"a": HardState(1, 1999, ("dc1",), (1999, 0), b""),
                                               "b": HardState(1, 1999, ("dc1",), (1999, 1), b"")}
    # a flipped byte inside a record: refused with the one line that says what to do
    raw = bytearray(again.path.read_bytes())
    raw[20] ^= 0xFF
    again.path.write_bytes(bytes(raw))
    with pytest.raises(FatalError, match="is corrupt at byte 0; move it away"):
        StateLog(d).load()
    # an upgrade: per-topic files of an older member are read for topics the log lacks
    u = tmp_path / "u"
    HardStateFile(u / "old.hardstate").save(HardState(4, 2, ("dc1", "dc2"), (2, 0), b""))
    HardStateFile(u / "both.hardstate").save(HardState(4, 1, ("dc1",), (1, 0), b""))
    ul = StateLog(u)
    ul.load()
    ul.append([("both", HardState(5, 8, ("dc1",), (8, 0), b""))])
    ul.close()
    assert StateLog(u).load() == {"old": HardState(4, 2, ("dc1", "dc2"), (2, 0), b""),
                                  "both": HardState(5, 8, ("dc1",), (8, 0), b"")}


def test_producer_recovery_goes_on_when_the_failed_producer_raises_its_fatal_error_from_poll(monkeypatch):
    """Seen in CI: the fatal error first surfaced in produce(); the recovery's
    drain of the failed producer then got it raised by poll() and stopped the
    member ("recovering the producer failed").  The failed producer's errors
    are expected while it is replaced: the recovery goes on."""
    import asyncio
    from types import SimpleNamespace

    from confluent_kafka import KafkaError, KafkaException

    import kdsync.producer_recovery as pr

    class Failed:
        def __init__(self):
            self.left, self.polls = 1, 0

        def purge(self, **kw):
            pass

        def __len__(self):
            return self.left

        def poll(self, timeout):
            self.polls += 1
            self.left = 0
            raise KafkaException(KafkaError(KafkaError._FATAL, "sequence desynchronization", fatal=True))

    new = object()
    monkeypatch.setattr(pr, "make_producer", lambda conf: new)
    fatal, soon = [], []
    old = Failed()
    m = SimpleNamespace(stopping=False, pipelines={}, producer=old, producer_conf=dict, fatal=fatal.append,
                        stop_requested=lambda: False, poll_reports_soon=lambda: soon.append(1),
                        metrics=SimpleNamespace(producer_recoveries=SimpleNamespace(inc=lambda: None)))
    r = pr.ProducerRecovery(m)

    async def scenario():
        r.failed("writing position 576 to events-global failed: Unable to produce message: Local: Fatal error")
        while r.active:
            await asyncio.sleep(0.01)

    asyncio.run(scenario())
    assert fatal == [] and old.polls == 1 and m.producer is new and soon == [1]


def test_kafka_requests_sum_every_client_handle_by_type_and_survive_bad_statistics():
    """kdsync_kafka_requests_total (kdsync.observability.kafka_requests): each
    handle's latest cumulative counts, summed by client and request type; a
    handle's newer statistics replace its older ones; librdkafka's internal
    broker is not a broker; unreadable statistics are ignored."""
    import json

    from prometheus_client import CollectorRegistry, generate_latest

    from kdsync.observability.kafka_requests import KafkaRequests

    assert KafkaRequests(0).conf() == {}
    r = KafkaRequests(500)
    assert r.conf()["statistics.interval.ms"] == 500 and r.conf()["stats_cb"] == r.on_stats

    def stats(name, kind, **brokers):
        return json.dumps({"name": name, "type": kind, "brokers": {b: {"req": req} for b, req in brokers.items()}})

    r.on_stats(stats("rdkafka#consumer-1", "consumer", **{"127.0.0.1:9092/1": {"Fetch": 10, "Metadata": 1},
                                                          ":0/internal": {"Fetch": 99}}))
    r.on_stats(stats("rdkafka#consumer-2", "consumer", **{"127.0.0.1:9092/1": {"Fetch": 5, "ListOffsets": 2}}))
    r.on_stats(stats("rdkafka#producer-3", "producer", **{"127.0.0.1:9092/1": {"Produce": 7, "Fetch": 0}}))
    r.on_stats(stats("rdkafka#consumer-1", "consumer", **{"127.0.0.1:9092/1": {"Fetch": 12, "Metadata": 1}}))
    r.on_stats("not json")
    r.on_stats(json.dumps({"type": "consumer"}))  # no handle name
    assert r.totals() == {("consumer", "Fetch"): 17, ("consumer", "Metadata"): 1, ("consumer", "ListOffsets"): 2,
                          ("producer", "Produce"): 7}
    reg = CollectorRegistry()
    reg.register(r)
    text = generate_latest(reg).decode()
    assert 'kdsync_kafka_requests_total{client="consumer",request="Fetch"} 17.0' in text
