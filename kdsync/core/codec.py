"""The wire codec of the core's messages (the message types: kdsync.core.messages).

Theory of operation
-------------------
A message travels as a msgpack array `[type, sender, incarnation, *fields]`.
Each message class names its fields once (`FIELDS`: name and kind); `encode()`
writes them in that order and `Codec.decode()` reads them back, checking every
field's shape, so protocol code reads `msg.view`, `msg.recv`, never
`msg[6]`.  Every decoding failure — bad msgpack, wrong arity, a field of the
wrong type, an unknown member, a batch whose sizes do not add up — is a
`RemoteProtocolError`: the adapter logs it and drops the message; nothing of
it reaches protocol state.

A kind is (encode, decode): Python value -> msgpack item, and msgpack item ->
checked Python value.  Batches travel as their seven fields (`Batch.fields()`):
a slot of a thousand records is a handful of msgpack items, not thousands.
`DecodeCache` lets one broadcast's bytes be decoded once for every node a
driver runs.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgpack

from kdsync.core.batch import Batch
from kdsync.core.errors import RemoteProtocolError

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
_packb = msgpack.packb
_unpackb = msgpack.unpackb


def pack(fields) -> bytes:
    return _packb(fields, use_bin_type=True)


def unpack_raw(data) -> Any:
    """msgpack → Python, with every failure a RemoteProtocolError."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise RemoteProtocolError("message is not bytes")
    if len(data) > MAX_MESSAGE_BYTES:
        raise RemoteProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        return _unpackb(data, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise RemoteProtocolError(f"undecodable message: {exc.__class__.__name__}") from None


# ----------------------------------------------------------------- field kinds
# A kind is (encode, decode): Python value -> msgpack item, and msgpack item ->
# checked Python value.  decode(v, name, ids) raises RemoteProtocolError;
# `ids` is the set of configured member ids.
def _bad(name: str, v: Any = None):
    raise RemoteProtocolError(f"bad {name}" + (f": {v!r}" if v is not None and not isinstance(v, (bytes, list)) else ""))


def _int(v, name, ids=None):
    if type(v) is not int or v < 0:
        _bad(name, v)
    return v


def _int_m1(v, name, ids=None):
    if type(v) is not int or v < -1:
        _bad(name, v)
    return v


def _bool(v, name, ids=None):
    if type(v) is not bool:
        _bad(name, v)
    return v


def _bytes(v, name, ids=None):
    if type(v) is not bytes:
        _bad(name)
    return v


def _ints(v, name, ids=None):
    # C-speed checks: these vectors have one entry per member, in every ACK
    if type(v) is not list or (v and (not set(map(type, v)) <= {int} or min(v) < 0)):
        _bad(name)
    return tuple(v)


def _member_ids(v, name, ids):
    if type(v) is not list or any(type(x) is not str or x not in ids for x in v):
        _bad(name)
    return tuple(v)


def _ballot(v, name, ids=None):
    if type(v) is not list or len(v) != 2 or type(v[0]) is not int or type(v[1]) is not int or v[0] < 0 or v[1] < -1:
        _bad(name)
    return (v[0], v[1])


def _batches(v, name, ids=None):
    if type(v) is not list:
        _bad(name)
    return tuple(map(Batch.from_fields, v))


def _slots(v, name, ids=None):
    if type(v) is not list or any(type(s) is not list for s in v):
        _bad(name)
    return tuple(tuple(map(Batch.from_fields, s)) if s else () for s in v)


def _watermarks(v, name, ids=None):
    if type(v) is not list:
        _bad(name)
    out = {}
    for item in v:
        if type(item) is not list or len(item) != 3 or type(item[0]) is not str:
            _bad(name)
        out[(item[0], _int(item[1], "partition"))] = _int_m1(item[2], "offset")
    return out


def _stamped(v, name, ids=None):
    if type(v) is not list:
        _bad(name)
    out = []
    for item in v:
        if type(item) is not list or len(item) != 2 or type(item[1]) is not list:
            _bad(name)
        out.append((_int(item[0], "timestamp"), tuple(map(Batch.from_fields, item[1]))))
    return tuple(out)

def _same(v):
    return v


INT = (_same, _int)
INT_M1 = (_same, _int_m1)
BOOL = (_same, _bool)
BYTES = (_same, _bytes)
INTS = (list, _ints)
MEMBERS = (list, _member_ids)
BALLOT = (list, _ballot)
BATCHES = (lambda v: [b.fields() for b in v], _batches)
SLOTS = (lambda v: [[b.fields() for b in s] for s in v], _slots)
WATERMARKS = (lambda v: [[o, p, off] for (o, p), off in sorted(v.items())], _watermarks)
STAMPED = (lambda v: [[ts, [b.fields() for b in s]] for ts, s in v], _stamped)


class Message:
    """Base of every wire message: `sender`, its incarnation `inc`, then FIELDS.

    Subclasses declare `TYPE`, `FIELDS` ((name, kind), ...) and `__slots__`
    (the field names, in order).  Instances are frozen."""

    __slots__ = ("sender", "inc")
    TYPE: ClassVar[int] = 0
    FIELDS: ClassVar[tuple] = ()

    def __init__(self, sender: str, inc: int, *values) -> None:
        names = self.__slots__
        if len(values) != len(names):
            raise TypeError(f"{type(self).__name__} takes {len(names)} fields, got {len(values)}")
        setter = object.__setattr__
        setter(self, "sender", sender)
        setter(self, "inc", inc)
        for n, v in zip(names, values):
            setter(self, n, v)

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is frozen")

    def encode(self) -> bytes:
        out = [self.TYPE, self.sender, self.inc]
        for name, (enc, _) in self.FIELDS:
            out.append(enc(getattr(self, name)))
        return _packb(out, use_bin_type=True)

    @classmethod
    def from_wire(cls, sender: str, inc: int, rest: list, ids) -> "Message":
        fields = cls.FIELDS
        if len(rest) != len(fields):
            raise RemoteProtocolError(f"{cls.__name__} has {len(fields)} fields, got {len(rest)}")
        return cls(sender, inc, *[dec(v, name, ids) for (name, (_, dec)), v in zip(fields, rest)])

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and all(
            getattr(self, n) == getattr(other, n) for n in ("sender", "inc", *self.__slots__))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        body = ", ".join(f"{n}={getattr(self, n)!r}" for n in self.__slots__)
        return f"{type(self).__name__}({self.sender}#{self.inc}, {body})"


class DecodeCache:
    """Messages decoded lately, by their bytes, for the codecs that share it.

    Messages are immutable, so the same bytes arriving again (a retransmission;
    in the simulator and the in-memory network, a broadcast that reaches every
    node as one object) give the message decoded before.  A node's codec has
    its own cache unless its driver passes one to every node it runs
    (`make_node(..., decodes=DecodeCache())`): then a broadcast is decoded
    once.  Bounded by `max_bytes` of wire data, oldest first out."""

    def __init__(self, max_bytes: int = 8 << 20) -> None:
        self.max_bytes = max_bytes
        self._recent: dict = {}  # bytes -> (codec kind, message, bytes), oldest first
        self._bytes = 0
        self._kinds: dict = {}  # (member ids, classes) -> its token, compared by identity

    def kind(self, member_ids: frozenset, classes: tuple) -> object:
        """The token of the codecs of these messages and members."""
        return self._kinds.setdefault((member_ids, classes), object())

    def get(self, data: bytes):
        return self._recent.get(data)

    def put(self, kind: object, data: bytes, msg: Message) -> None:
        self._bytes += len(data)
        recent = self._recent
        while self._bytes > self.max_bytes and recent:
            self._bytes -= len(recent.pop(next(iter(recent)))[2])
        recent[data] = (kind, msg, data)


class Codec:
    """Decoding for one protocol variant: its message classes and member ids."""

    def __init__(self, classes, member_ids, cache: DecodeCache | None = None) -> None:
        self.table = {c.TYPE: c for c in classes}
        if len(self.table) != len(classes):
            raise ValueError("two message classes share a type code")
        self.member_ids = ids = frozenset(member_ids)
        self.cache = cache if cache is not None else DecodeCache(1 << 20)
        self._kind = self.cache.kind(ids, tuple(classes))

    def decode(self, data, arrived_from: str | None = None) -> Message:
        """Bytes → a message object.  Raises RemoteProtocolError.  The same
        bytes decoded before by a codec of the same messages and members
        sharing this one's `DecodeCache` give the same object."""
        if type(data) is not bytes:
            return self._decode(data, arrived_from)
        hit = self.cache.get(data)
        if hit is not None:
            if hit[0] is not self._kind:  # another kind of codec: decode it here, remember the first
                return self._decode(data, arrived_from)
            msg = hit[1]
            if arrived_from is not None and msg.sender != arrived_from:
                raise RemoteProtocolError(f"message claims to be from {msg.sender!r}, arrived from {arrived_from!r}")
            return msg
        msg = self._decode(data, arrived_from)
        self.cache.put(self._kind, data, msg)
        return msg

    def _decode(self, data, arrived_from: str | None) -> Message:
        raw = unpack_raw(data)
        if type(raw) is not list or len(raw) < 3:
            raise RemoteProtocolError("message is not an array of at least 3 items")
        kind, sender, inc = raw[0], raw[1], raw[2]
        if type(kind) is not int or type(inc) is not int:
            raise RemoteProtocolError("bad message header")
        if sender not in self.member_ids:
            raise RemoteProtocolError(f"message from unknown member {sender!r}")
        if arrived_from is not None and sender != arrived_from:
            raise RemoteProtocolError(f"message claims to be from {sender!r}, arrived from {arrived_from!r}")
        cls = self.table.get(kind)
        if cls is None:
            raise RemoteProtocolError(f"unknown message type {kind}")
        return cls.from_wire(sender, inc, raw[3:], self.member_ids)
