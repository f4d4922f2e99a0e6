"""The member's parts on their own, without brokers: the global-topic writer
(durable prefix, commits of own events, no double writes, fatal errors), the
source's cut into per-partition runs, the hard-state file and the channel
framing.  In-memory stand-ins for the Kafka client here; tests/test_member_*.py
drive the same parts through real brokers and real processes."""

from __future__ import annotations

import pytest

from kdsync.core import Delivery, Event, HardState, RemoteProtocolError
from kdsync.core import batches_from_events
from kdsync.errors import FatalError
from kdsync.kafka.records import H_SEQ, pack_payload
from kdsync.kafka.sink import GlobalWriter
from kdsync.kafka.source import SourceConsumer
from kdsync.state import HardStateFile
from kdsync.transport.channels import frame_channel, split_channel


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
    got = {"durable": [], "written": [], "fatal": [], "scheduled": []}
    w = GlobalWriter(prod, "t-global", partitions, start, origin="me", present=present,
                     on_durable=lambda end, commits: got["durable"].append((end, commits)),
                     on_written=lambda e, catchup: got["written"].append((e.offset, catchup)),
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
    prod.report(3)
    run_scheduled(got)
    assert got["durable"][-1] == (14, {0: 7}) and w.outstanding == 0
    assert got["written"] == [(7, False), (5, False), (3, False), (6, False)] and got["fatal"] == []


def test_writer_skips_positions_already_present_and_refuses_gaps_and_failed_writes():
    prod = FakeProducer()
    w, got = writer(prod, start=2, present={3}, partitions=3)
    w.write(delivery(2, (ev("dc2", 0, 1), ev("dc2", 0, 2)), catchup=True))
    assert len(prod.records) == 1  # position 3 is in the topic already: not written twice
    prod.report(0)
    run_scheduled(got)
    assert got["durable"] == [(4, {})] and got["written"] == [(2, True), (1, True)]
    w.write(delivery(9, (ev("me", 0, 9),)))
    assert got["fatal"] == ["internal: delivery at position 9 but t-global continues at 4"]
    w.write(delivery(4, (ev("me", 0, 9),)))
    prod.report(1, Err())
    assert got["fatal"][-1].startswith("writing position 4 to t-global failed: Broker: not enough replicas")
    assert w.durable_end == 4


class Msg:
    def __init__(self, topic, partition, offset):
        self.t, self.p, self.o = topic, partition, offset

    def error(self):
        return None

    def topic(self):
        return self.t

    def partition(self):
        return self.p

    def offset(self):
        return self.o

    def key(self):
        return None

    def value(self):
        return b"v"

    def headers(self):
        return None

    def timestamp(self):
        return (1, 5)


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
