"""Wire messages of the core: one frozen, slotted class per message type.

Theory of operation
-------------------
A message travels as a msgpack array `[type, sender, incarnation, *fields]`.
Each class below names its fields once (`FIELDS`: name and kind); `encode()`
writes them in that order and `decode()` reads them back, checking every
field's shape, so protocol code reads `msg.view`, `msg.recv`, never
`msg[6]`.  Every decoding failure — bad msgpack, wrong arity, a field of the
wrong type, an unknown member, a batch whose sizes do not add up — is a
`RemoteProtocolError`: the adapter logs it and drops the message; nothing of
it reaches protocol state.

Batches travel as their seven fields (`Batch.fields()`): a slot of a
thousand records is a handful of msgpack items, not thousands.
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


def _proposal(v, name, ids):
    return Proposal.decode(_bytes(v, name), ids)


def _maybe_proposal(v, name, ids):
    return Proposal.decode(v, ids) if _bytes(v, name) else None


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
PROPOSAL = (lambda p: p.data, _proposal)
MAYBE_PROPOSAL = (lambda p: p.data if p is not None else b"", _maybe_proposal)


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


# ------------------------------------------------------------------ proposal
class Proposal:
    """The value a view change agrees on: the next view and how the old one ends.

    `trim[k]` is how many slots of the old view's sender k every member
    delivers (the ragged trim); `source` serves catch-up; `base_seq` >= 0 when
    nobody held the old view's data (the new view starts there), else -1.
    `extra` (the clock protocol only; empty for derecho, whose bytes it does
    not change) carries trimmed slots some holders lack: per sender index k,
    (k, first index, stamped slots).  Encoded once and compared by bytes.
    """

    __slots__ = ("old_view", "new_view", "members", "incs", "trim", "source", "base_seq", "extra", "data")

    def __init__(self, old_view, new_view, members, incs, trim, source, base_seq, extra=()):
        self.old_view, self.new_view = old_view, new_view
        self.members, self.incs = tuple(members), tuple(incs)
        self.trim, self.source, self.base_seq = tuple(trim), source, base_seq
        self.extra = tuple(extra)
        fields = [old_view, new_view, list(members), list(incs), list(trim), source, base_seq]
        if self.extra:
            fields.append([[k, first, STAMPED[0](slots)] for k, first, slots in self.extra])
        self.data = pack(fields)

    @classmethod
    def decode(cls, data: bytes, member_ids) -> "Proposal":
        """Raises RemoteProtocolError on anything malformed."""
        f = unpack_raw(data)
        if type(f) is not list or len(f) not in (7, 8):
            raise RemoteProtocolError("undecodable proposal")
        extra = _extra(f.pop(), len(f[4]) if type(f[4]) is list else 0) if len(f) == 8 else ()
        old, new, members, incs, trim, source, base = f
        _int(old, "old view")
        if type(new) is not int or new != old + 1:
            raise RemoteProtocolError("a proposal names the view after its old view")
        members = _member_ids(members, "proposal members", member_ids)
        incs = _ints(incs, "incarnations")
        trim = _ints(trim, "trim")
        if not members or len(incs) != len(members) or len(set(members)) != len(members) or source not in members:
            raise RemoteProtocolError("bad proposal membership")
        _int_m1(base, "base position")
        return cls(old, new, members, incs, trim, source, base, extra)

    def __eq__(self, other) -> bool:
        return isinstance(other, Proposal) and self.data == other.data

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"Proposal({self.old_view}->{self.new_view} {list(self.members)} trim={list(self.trim)} "
                f"source={self.source} base={self.base_seq})")


def _extra(v, senders: int) -> tuple:
    """A proposal's trim extras: [[sender index, first, stamped slots], ...]."""
    if type(v) is not list or not v:
        raise RemoteProtocolError("bad proposal extras")
    out = []
    for item in v:
        if type(item) is not list or len(item) != 3:
            raise RemoteProtocolError("bad proposal extras")
        k = _int(item[0], "extra sender")
        if k >= senders:
            raise RemoteProtocolError("proposal extras name no sender")
        out.append((k, _int(item[1], "extra first"), _stamped(item[2], "extra slots")))
    return tuple(out)


# ------------------------------------------------------- derecho (and sequencer)
# `view` is the sender's view id; `recv` a received vector (slots held per sender
# of that view); a ballot is (round, leader rank).
class Append(Message):
    """Own slots first..first+len(slots)-1 of a view, with the received vector."""

    __slots__ = ("view", "first", "slots", "recv")
    TYPE = 1
    FIELDS = (("view", INT), ("first", INT), ("slots", SLOTS), ("recv", INTS))
    view: int
    first: int
    slots: tuple[tuple[Batch, ...], ...]
    recv: tuple[int, ...]


class Ack(Message):
    """Heartbeat and cumulative acknowledgement: received vector, suspicions,
    highest ballot round seen, whether the sender is wedged."""

    __slots__ = ("view", "recv", "suspected", "round", "wedged")
    TYPE = 2
    FIELDS = (("view", INT), ("recv", INTS), ("suspected", MEMBERS), ("round", INT), ("wedged", BOOL))
    view: int
    recv: tuple[int, ...]
    suspected: tuple[str, ...]
    round: int
    wedged: bool


class Collect(Message):
    """Paxos phase 1a of the view change out of `view`."""

    __slots__ = ("view", "ballot")
    TYPE = 3
    FIELDS = (("view", INT), ("ballot", BALLOT))
    view: int
    ballot: tuple[int, int]


class Report(Message):
    """Paxos phase 1b: what the reporter holds of `view` and any vote it cast."""

    __slots__ = ("view", "ballot", "has_data", "recv", "durable", "next", "acc_ballot", "accepted")
    TYPE = 4
    FIELDS = (("view", INT), ("ballot", BALLOT), ("has_data", BOOL), ("recv", INTS), ("durable", INT),
              ("next", INT), ("acc_ballot", BALLOT), ("accepted", MAYBE_PROPOSAL))
    view: int
    ballot: tuple[int, int]
    has_data: bool
    recv: tuple[int, ...]
    durable: int
    next: int
    acc_ballot: tuple[int, int]
    accepted: Proposal | None


class Accept(Message):
    """Paxos phase 2a."""

    __slots__ = ("view", "ballot", "proposal")
    TYPE = 5
    FIELDS = (("view", INT), ("ballot", BALLOT), ("proposal", PROPOSAL))
    view: int
    ballot: tuple[int, int]
    proposal: Proposal


class Accepted(Message):
    """Paxos phase 2b."""

    __slots__ = ("view", "ballot")
    TYPE = 6
    FIELDS = (("view", INT), ("ballot", BALLOT))
    view: int
    ballot: tuple[int, int]


class Install(Message):
    """The chosen next view of `old_view`."""

    __slots__ = ("old_view", "proposal")
    TYPE = 7
    FIELDS = (("old_view", INT), ("proposal", PROPOSAL))
    old_view: int
    proposal: Proposal


class Join(Message):
    """A restarted or excluded member asks to be taken in (its durable and next
    position)."""

    __slots__ = ("durable", "next")
    TYPE = 8
    FIELDS = (("durable", INT), ("next", INT))
    durable: int
    next: int


class CatchupReq(Message):
    """Ask the catch-up source for positions from `start` of view `view`."""

    __slots__ = ("view", "start", "snapshot_ok")
    TYPE = 9
    FIELDS = (("view", INT), ("start", INT), ("snapshot_ok", BOOL))
    view: int
    start: int
    snapshot_ok: bool


class CatchupData(Message):
    """Positions first.. as batches; the view starts at view_start."""

    __slots__ = ("view", "first", "batches", "view_start")
    TYPE = 10
    FIELDS = (("view", INT), ("first", INT), ("batches", BATCHES), ("view_start", INT))
    view: int
    first: int
    batches: tuple[Batch, ...]
    view_start: int


class Snapshot(Message):
    """For a witness: the view start and the origin watermarks there."""

    __slots__ = ("view", "view_start", "watermarks")
    TYPE = 11
    FIELDS = (("view", INT), ("view_start", INT), ("watermarks", WATERMARKS))
    view: int
    view_start: int
    watermarks: dict[tuple[str, int], int]


class Hint(Message):
    """A newer view exists (its id, members and incarnations)."""

    __slots__ = ("view", "members", "incs")
    TYPE = 12
    FIELDS = (("view", INT), ("members", MEMBERS), ("incs", INTS))
    view: int
    members: tuple[str, ...]
    incs: tuple[int, ...]

    @classmethod
    def from_wire(cls, sender, inc, rest, ids):
        msg = super().from_wire(sender, inc, rest, ids)
        if len(msg.members) != len(msg.incs):
            raise RemoteProtocolError("Hint: members and incs differ in length")
        return msg


class Forward(Message):
    """Sequencer variant: a member's own batches, numbered from `first` within
    the view, for the view's sequencer to order; every number below `done`
    is delivered already."""

    __slots__ = ("view", "done", "first", "batches")
    TYPE = 13
    FIELDS = (("view", INT), ("done", INT), ("first", INT), ("batches", BATCHES))
    view: int
    done: int
    first: int
    batches: tuple[Batch, ...]



class LogReq(Message):
    """Ask a member for positions start..stop-1 of its durable global topic
    (catch-up of what the catch-up source no longer holds)."""

    __slots__ = ("start", "stop")
    TYPE = 14
    FIELDS = (("start", INT), ("stop", INT))
    start: int
    stop: int


class LogData(Message):
    """Positions start.. of the sender's durable global topic (none: not here)."""

    __slots__ = ("start", "batches")
    TYPE = 15
    FIELDS = (("start", INT), ("batches", BATCHES))
    start: int
    batches: tuple[Batch, ...]



class Leave(Message):
    """The sender stops cleanly and leaves `view`: its peers suspect it at
    once instead of after suspect_ticks (wire version 2; a peer of an older
    release drops it and suspects the silence, as before)."""

    __slots__ = ("view",)
    TYPE = 20
    FIELDS = (("view", INT),)
    view: int


class Nudge(Message):
    """The sender holds slots of `view` it has not seen the receiver
    acknowledge for a while: the receiver's acknowledgement was lost while
    both were quiet (kdsync.core.liveness), so it is asked to send it again."""

    __slots__ = ("view",)
    TYPE = 21
    FIELDS = (("view", INT),)
    view: int


DERECHO_MESSAGES = (Append, Ack, Collect, Report, Accept, Accepted, Install, Join, CatchupReq, CatchupData,
                    Snapshot, Hint, LogReq, LogData, Leave, Nudge)
SEQUENCER_MESSAGES = DERECHO_MESSAGES + (Forward,)

# -------------------------------------------------------------------- clock
# The clock protocol (kdsync/core/clock.py) keeps derecho's view change
# messages and replaces the stream's: slots carry timestamps, every stream
# message carries a clock report (`cut`, `clock`: "I had cut `cut` slots, and
# every later slot of mine is stamped above `clock`").
class ClockAppend(Message):
    """Own stamped slots first..first+len(slots)-1 of a view, the received
    vector and a clock report."""

    __slots__ = ("view", "first", "slots", "recv", "cut", "clock")
    TYPE = 16
    FIELDS = (("view", INT), ("first", INT), ("slots", STAMPED), ("recv", INTS), ("cut", INT), ("clock", INT))
    view: int
    first: int
    slots: tuple
    recv: tuple
    cut: int
    clock: int


class ClockAck(Message):
    """Derecho's ACK (heartbeat, received vector, suspicions, ballot round,
    wedged) with a clock report."""

    __slots__ = ("view", "recv", "suspected", "round", "wedged", "cut", "clock")
    TYPE = 17
    FIELDS = (("view", INT), ("recv", INTS), ("suspected", MEMBERS), ("round", INT), ("wedged", BOOL),
              ("cut", INT), ("clock", INT))
    view: int
    recv: tuple
    suspected: tuple
    round: int
    wedged: bool
    cut: int
    clock: int


class SlotReq(Message):
    """A view change leader asks for slots first..stop-1 of sender index `k` of `view`."""

    __slots__ = ("view", "k", "first", "stop")
    TYPE = 18
    FIELDS = (("view", INT), ("k", INT), ("first", INT), ("stop", INT))
    view: int
    k: int
    first: int
    stop: int


class SlotData(Message):
    """Sender index k's stamped slots first.. of `view` (an answer to SlotReq)."""

    __slots__ = ("view", "k", "first", "slots")
    TYPE = 19
    FIELDS = (("view", INT), ("k", INT), ("first", INT), ("slots", STAMPED))
    view: int
    k: int
    first: int
    slots: tuple


CLOCK_MESSAGES = (ClockAppend, ClockAck, Collect, Report, Accept, Accepted, Install, Join, CatchupReq, CatchupData,
                  Snapshot, Hint, LogReq, LogData, SlotReq, SlotData, Leave, Nudge)

# ------------------------------------------------------------------- mirror
class MirrorData(Message):
    """Own stream entries first.. as batches; `base` = where the sender
    believes the receiver is durable."""

    __slots__ = ("first", "batches", "base")
    TYPE = 1
    FIELDS = (("first", INT), ("batches", BATCHES), ("base", INT))
    first: int
    batches: tuple[Batch, ...]
    base: int


class MirrorAck(Message):
    """The receiver made the stream of incarnation `stream_inc` durable up to
    `upto`."""

    __slots__ = ("stream_inc", "upto")
    TYPE = 2
    FIELDS = (("stream_inc", INT), ("upto", INT))
    stream_inc: int
    upto: int


MIRROR_MESSAGES = (MirrorData, MirrorAck)
