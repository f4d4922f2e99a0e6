"""The record schema (kdsync/kafka/records.py): the header names are the
interface's, a record survives the round trip source -> event -> global
record -> event, and a record kdsync did not write is refused with one line.
Unit tests on stand-in messages; the real-broker tests cover the same code
through `kdsync run`."""

from __future__ import annotations

import pytest

from kdsync.fatal import FatalError
from kdsync.kafka.records import (
    KDSYNC_HEADERS,
    ForeignRecordError,
    event_from_global,
    event_from_source,
    global_partition,
    global_record,
    pack_payload,
    read_global_headers,
    unpack_payload,
)

from helpers import FakeMessage as Msg  # key, value, headers, topic=, partition=, offset=, ts=


def test_header_names_are_the_interface():
    # interfaces.md, "Records in the global topic": these exact names, in this order of meaning
    assert KDSYNC_HEADERS == ("kdsync.seq", "kdsync.origin", "kdsync.origin.partition", "kdsync.origin.offset",
                              "kdsync.origin.ts")


def test_source_record_round_trips_through_the_global_topic():
    src = Msg(b"k", b"v", [("app", b"x"), ("nil", None)], topic="src", partition=3, offset=41, ts=(1, 1700))
    ev = event_from_source("dc2", src)
    assert (ev.origin, ev.partition, ev.offset, ev.timestamp_ms) == ("dc2", 3, 41, 1700)
    key, value, headers = global_record(7, ev)
    assert (key, value) == (b"k", b"v")
    assert headers[:2] == [("app", b"x"), ("nil", None)]  # the source's headers first, as they were
    assert dict(headers[2:]) == {"kdsync.seq": b"7", "kdsync.origin": b"dc2", "kdsync.origin.partition": b"3",
                                 "kdsync.origin.offset": b"41", "kdsync.origin.ts": b"1700"}
    seq, back = event_from_global(Msg(key, value, headers, topic="src-global", offset=7))
    assert seq == 7 and back == ev
    h = read_global_headers(headers)
    assert (h.seq, h.origin, h.origin_partition, h.origin_offset, h.origin_ts) == (7, "dc2", 3, 41, 1700)


def test_payload_packing_keeps_none_and_bytes():
    p = pack_payload(None, b"\x00\xff", None)
    assert unpack_payload(p) == (None, b"\x00\xff", [])


def test_a_record_without_timestamp_gets_the_time_now():
    ev = event_from_source("dc1", Msg(None, b"v", None, ts=(0, -1)))
    assert ev.timestamp_ms > 1_600_000_000_000


def test_foreign_records_are_fatal_with_one_line():
    with pytest.raises(ForeignRecordError) as e:
        event_from_global(Msg(b"k", b"v", [("app", b"x")], topic="src-global", partition=0, offset=0))
    assert str(e.value).startswith("src-global[0] offset 0 has no kdsync.seq header")
    assert isinstance(e.value, FatalError) and "\n" not in str(e.value)
    with pytest.raises(ForeignRecordError, match="offset 5 has a bad kdsync header .no kdsync.origin header"):
        event_from_global(Msg(b"k", b"v", [("kdsync.seq", b"3")], topic="g", offset=5))
    with pytest.raises(ForeignRecordError, match="bad kdsync header"):
        event_from_global(Msg(b"k", b"v", [("kdsync.seq", b"three")], topic="g"))
    assert read_global_headers([("app", b"x")]) is None


def test_global_partition_by_key_hash_or_position():
    assert global_partition(b"anything", 5, 1) == 0
    assert global_partition(None, 5, 3) == 2
    # CRC-32 of the key: the same partition in every cluster, whatever the position
    assert {global_partition(b"user-1", s, 4) for s in range(10)} == {global_partition(b"user-1", 0, 4)}
