"""The record schema of kdsync: how a Kafka record becomes a core event and a
delivered event becomes a record of the global topic.  Every header name is
spelled here and only here.

A global record keeps the source record's key, value and headers and adds,
as UTF-8 decimal strings where numeric:

    kdsync.seq               position in the agreed order, from 0
    kdsync.origin            member id of the cluster where the event was first written
    kdsync.origin.partition  its source partition
    kdsync.origin.offset     its source offset
    kdsync.origin.ts         its source record timestamp (ms)

Inside the core, an event's payload is the source record (key, value,
headers) packed by `pack_payload`.
"""

from __future__ import annotations

import time
import zlib
from typing import NamedTuple

import msgpack

from kdsync.core import Event
from kdsync.fatal import FatalError

__all__ = [
    "H_OOFF", "H_OPART", "H_ORIGIN", "H_OTS", "H_SEQ", "KDSYNC_HEADERS", "ForeignRecordError", "GlobalHeaders",
    "event_from_global", "event_from_source", "global_headers", "global_partition", "global_record",
    "pack_payload", "read_global_headers", "unpack_payload",
]

H_SEQ = "kdsync.seq"
H_ORIGIN = "kdsync.origin"
H_OPART = "kdsync.origin.partition"
H_OOFF = "kdsync.origin.offset"
H_OTS = "kdsync.origin.ts"
KDSYNC_HEADERS = (H_SEQ, H_ORIGIN, H_OPART, H_OOFF, H_OTS)
_PREFIX = "kdsync."  # headers of this namespace are kdsync's, never the source record's

Headers = list[tuple[str, bytes | None]]


class ForeignRecordError(FatalError):
    """A record of a global topic that kdsync did not write (no kdsync headers)."""


class GlobalHeaders(NamedTuple):
    """What kdsync's headers say about a global record."""

    seq: int
    origin: str
    origin_partition: int
    origin_offset: int
    origin_ts: int  # ms; 0 when absent


# ---------------------------------------------------------------- payloads
def pack_payload(key: bytes | None, value: bytes | None, headers) -> bytes:
    """Event.payload of a source record: its key, value and headers (a list of pairs)."""
    return msgpack.packb([key, value, [[k, v] for k, v in (headers or ())]], use_bin_type=True)


def unpack_payload(payload: bytes) -> tuple[bytes | None, bytes | None, Headers]:
    """(key, value, headers) packed by `pack_payload`."""
    key, value, headers = msgpack.unpackb(payload, raw=False)
    return key, value, [(k, v) for k, v in headers]


def event_from_source(origin: str, msg) -> Event:
    """The core event of a consumed source record (a confluent_kafka Message)
    of member `origin`; a record without a timestamp gets the time now."""
    _, ts = msg.timestamp()
    return Event(origin, msg.partition(), msg.offset(), pack_payload(msg.key(), msg.value(), msg.headers()),
                 ts if ts > 0 else int(time.time() * 1000))


# ---------------------------------------------------------------- global records
def global_headers(seq: int, origin: str, partition: int, offset: int, ts_ms: int) -> Headers:
    """kdsync's headers of the global record at position `seq`."""
    return [(H_SEQ, str(seq).encode()), (H_ORIGIN, origin.encode()), (H_OPART, str(partition).encode()),
            (H_OOFF, str(offset).encode()), (H_OTS, str(ts_ms).encode())]


def global_record(seq: int, ev: Event) -> tuple[bytes | None, bytes | None, Headers]:
    """(key, value, headers) of the global record of `ev` at position `seq`:
    the source record with kdsync's headers appended."""
    key, value, headers = unpack_payload(ev.payload)
    return key, value, headers + global_headers(seq, ev.origin, ev.partition, ev.offset, ev.timestamp_ms)


def global_partition(key: bytes | None, seq: int, partitions: int) -> int:
    """Partition of a global record: by key hash (CRC-32, identical in every
    cluster), keyless records by position."""
    if partitions == 1:
        return 0
    return (zlib.crc32(key) if key is not None else seq) % partitions


def _hget(headers, name: str) -> bytes | None:
    for k, v in headers or ():
        if k == name:
            return v
    return None


def read_global_headers(headers) -> GlobalHeaders | None:
    """kdsync's headers of a global record (a list of (name, value) pairs);
    None when it has no `kdsync.seq`.  Raises ValueError when one of the
    others is missing or not a number."""
    seq = _hget(headers, H_SEQ)
    if seq is None:
        return None
    vals = {}
    for name in (H_ORIGIN, H_OPART, H_OOFF):
        vals[name] = _hget(headers, name)
        if vals[name] is None:
            raise ValueError(f"no {name} header")
    return GlobalHeaders(int(seq), vals[H_ORIGIN].decode(), int(vals[H_OPART]), int(vals[H_OOFF]),
                         int(_hget(headers, H_OTS) or b"0"))


def event_from_global(msg) -> tuple[int, Event]:
    """(seq, Event) of a record of a global topic (a confluent_kafka Message).
    Raises ForeignRecordError (a FatalError) when it lacks kdsync's headers:
    something else wrote to the topic."""
    hs = msg.headers() or []
    where = f"{msg.topic()}[{msg.partition()}] offset {msg.offset()}"
    try:
        h = read_global_headers(hs)
    except ValueError as e:
        raise ForeignRecordError(f"{where} has a bad kdsync header ({e}): kdsync must be the only writer of its "
                                 f"global topics (topics.global_suffix)") from None
    if h is None:
        raise ForeignRecordError(f"{where} has no {H_SEQ} header: kdsync must be "
                                 f"the only writer of its global topics (topics.global_suffix)")
    src = [(k, v) for k, v in hs if not k.startswith(_PREFIX)]
    ev = Event(origin=h.origin, partition=h.origin_partition, offset=h.origin_offset,
               payload=pack_payload(msg.key(), msg.value(), src), timestamp_ms=h.origin_ts)
    return h.seq, ev
