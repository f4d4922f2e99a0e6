"""Wire codec of core messages (msgpack arrays), shared by every variant.

A message is a msgpack array whose first element is a small integer type code
and whose second and third are the sender's member id and incarnation; the
rest is per type.  Events travel as a flat array, five items per event
(origin, partition, offset, payload, timestamp_ms), which keeps packing and
unpacking a tight loop.  Every decoding failure — bad msgpack, wrong shape,
wrong type — is a RemoteProtocolError: the adapter logs it and drops the
message; it never reaches protocol state.
"""

from __future__ import annotations

from typing import Any, Sequence

import msgpack

from kdsync.core.types import Event, RemoteProtocolError

_packb = msgpack.packb
_unpackb = msgpack.unpackb
MAX_MESSAGE_BYTES = 256 * 1024 * 1024


def pack(fields: Sequence[Any]) -> bytes:
    return _packb(fields, use_bin_type=True)


def unpack(data: bytes, member_ids: frozenset[str] | set[str]) -> list:
    """Decode one message; check the envelope.  Raises RemoteProtocolError."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise RemoteProtocolError("message is not bytes")
    if len(data) > MAX_MESSAGE_BYTES:
        raise RemoteProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        msg = _unpackb(data, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise RemoteProtocolError(f"undecodable message: {exc.__class__.__name__}") from None
    if not isinstance(msg, list) or len(msg) < 3:
        raise RemoteProtocolError("message is not an array of at least 3 items")
    kind, sender, inc = msg[0], msg[1], msg[2]
    if type(kind) is not int or type(inc) is not int:
        raise RemoteProtocolError("bad message header")
    if sender not in member_ids:
        raise RemoteProtocolError(f"message from unknown member {sender!r}")
    return msg


def encode_events(events: Sequence[Event]) -> list:
    flat: list = []
    ext = flat.extend
    for e in events:
        ext((e.origin, e.partition, e.offset, e.payload, e.timestamp_ms))
    return flat


def decode_events(flat: Any) -> tuple[Event, ...]:
    """Flat 5-per-event array → Events; checks every field's type (in C-speed
    passes over the columns rather than a Python loop per field)."""
    if not isinstance(flat, list) or len(flat) % 5:
        raise RemoteProtocolError("events field is not a flat array of 5-tuples")
    if not flat:
        return ()
    if (
        set(map(type, flat[0::5])) != {str}
        or set(map(type, flat[1::5])) != {int}
        or set(map(type, flat[2::5])) != {int}
        or set(map(type, flat[3::5])) != {bytes}
        or set(map(type, flat[4::5])) != {int}
    ):
        raise RemoteProtocolError("bad event fields")
    it = iter(flat)
    new = tuple.__new__
    return tuple([new(Event, t) for t in zip(it, it, it, it, it)])


def want_int(v: Any, what: str, lo: int = 0) -> int:
    if type(v) is not int or v < lo:
        raise RemoteProtocolError(f"bad {what}: {v!r}")
    return v


def want_int_list(v: Any, n: int | None, what: str) -> list[int]:
    if not isinstance(v, list) or (n is not None and len(v) != n) or any(type(x) is not int or x < 0 for x in v):
        raise RemoteProtocolError(f"bad {what}")
    return v


def want_str_list(v: Any, what: str) -> list[str]:
    if not isinstance(v, list) or any(type(x) is not str for x in v):
        raise RemoteProtocolError(f"bad {what}")
    return v
