"""Wire messages of the core: one frozen, slotted class per message type
(the codec they share — field kinds, `Message`, `Codec`, `DecodeCache` — is
kdsync.core.codec, re-exported here).

Theory of operation
-------------------
Each class below names its fields once (`FIELDS`: name and kind, see
kdsync.core.codec); protocol code reads `msg.view`, `msg.recv`.  The tuples at
the end of each section (`DERECHO_MESSAGES`, `CLOCK_MESSAGES`,
and kdsync.core.mirror's `MIRROR_MESSAGES`) are the messages a protocol's codec accepts; a type code
not in them is a `RemoteProtocolError` (an older release drops a newer
message that way, and carries on).
"""

from __future__ import annotations

from kdsync.core.codec import (  # noqa: F401 - re-exported: the codec's names are imported from here too
    BALLOT,
    BATCHES,
    BOOL,
    BYTES,
    INT,
    INT_M1,
    INTS,
    MAX_MESSAGE_BYTES,
    MEMBERS,
    SLOTS,
    STAMPED,
    WATERMARKS,
    Codec,
    DecodeCache,
    Message,
    _bytes,
    _int,
    _int_m1,
    _ints,
    _member_ids,
    _stamped,
    pack,
    unpack_raw,
)
from kdsync.core.batch import Batch
from kdsync.core.errors import RemoteProtocolError


def _proposal(v, name, ids):
    return Proposal.decode(_bytes(v, name), ids)


def _maybe_proposal(v, name, ids):
    return Proposal.decode(v, ids) if _bytes(v, name) else None


PROPOSAL = (lambda p: p.data, _proposal)
MAYBE_PROPOSAL = (lambda p: p.data if p is not None else b"", _maybe_proposal)


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


class SlotReq(Message):
    """Slots first..stop-1 of sender index `k` of `view` are asked for: by a
    view change's leader (clock), or by a receiver that lacks them, of their
    sender (kdsync.core.holes)."""

    __slots__ = ("view", "k", "first", "stop")
    TYPE = 18
    FIELDS = (("view", INT), ("k", INT), ("first", INT), ("stop", INT))
    view: int
    k: int
    first: int
    stop: int


DERECHO_MESSAGES = (Append, Ack, Collect, Report, Accept, Accepted, Install, Join, CatchupReq, CatchupData,
                    Snapshot, Hint, LogReq, LogData, Leave, Nudge, SlotReq)
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


class SlotData(Message):
    """Sender index k's stamped slots first.. of `view` (an answer to SlotReq)."""

    __slots__ = ("view", "k", "first", "slots")
    TYPE = 19
    FIELDS = (("view", INT), ("k", INT), ("first", INT), ("slots", STAMPED))
    view: int
    k: int
    first: int
    slots: tuple


class Delays(Message):
    """The sender's one-way delay estimates to `peers` (us, half its smallest
    recent round trip to each): the rows the clock protocol's automatic
    lead is chosen from (kdsync.core.leads).  An older release drops it and
    its peers keep their leads where they are."""

    __slots__ = ("view", "peers", "delays")
    TYPE = 22
    FIELDS = (("view", INT), ("peers", MEMBERS), ("delays", INTS))
    view: int
    peers: tuple
    delays: tuple


class Fence(Message):
    """Sender index `k` of `view` cut `cut` slots in it and will cut none
    again (a clean stop, kdsync.core.fence); `recv`: its received vector,
    final (it counts nothing more).  From that sender: the announcement (its
    peers stop waiting for its clock once they hold those slots, instead of
    changing the view); from another member: its answer, it fenced the
    sender and holds them (`recv` is then the answerer's) — also to a member
    fenced by the others while it was cut off, which then rejoins as a new
    incarnation (kdsync.core.crash_fence).  An older release drops it and
    takes the Leave that follows, as before."""

    __slots__ = ("view", "k", "cut", "recv")
    TYPE = 23
    FIELDS = (("view", INT), ("k", INT), ("cut", INT), ("recv", INTS))
    view: int
    k: int
    cut: int
    recv: tuple


class Cap(Message):
    """The sender found sender index `k` of `view` silent while its order
    waited for it, and takes none of its slots past its first `count` in
    this view while `attempt` may still fence k (a crash fence,
    kdsync.core.crash_fence): once every member but k capped one attempt,
    each fences k at the largest count.  An older release drops it (and so
    never caps: its peers change the view as before)."""

    __slots__ = ("view", "k", "attempt", "count", "echo")
    TYPE = 24
    FIELDS = (("view", INT), ("k", INT), ("attempt", INT), ("count", INT), ("echo", BOOL))
    view: int
    k: int
    attempt: int
    count: int
    echo: bool  # an answer to the receiver's own CAP (not answered again)


class NoCap(Message):
    """The sender heard sender index `k` of `view` after a CAP of `attempt`
    came, and will never cap that attempt: no fence comes of it, and the
    members that capped it lift their caps (kdsync.core.crash_fence)."""

    __slots__ = ("view", "k", "attempt")
    TYPE = 25
    FIELDS = (("view", INT), ("k", INT), ("attempt", INT))
    view: int
    k: int
    attempt: int


class Lift(Message):
    """The new incarnation of the sender fenced in `view` asks to be waited
    for from timestamp `clock` on, in that view, without a view change
    (kdsync.core.lift).  An older release drops it: the asker then joins."""

    __slots__ = ("view", "clock")
    TYPE = 26
    FIELDS = (("view", INT), ("clock", INT))
    view: int
    clock: int


class Lifted(Message):
    """The answer to Lift: the sender waits for sender index `k` of `view`
    at every timestamp at or above `clock` and takes its slots from `cut`
    (the fence) on; `cut` -1: it does not (the asker joins instead)."""

    __slots__ = ("view", "k", "cut", "clock")
    TYPE = 27
    FIELDS = (("view", INT), ("k", INT), ("cut", INT_M1), ("clock", INT))
    view: int
    k: int
    cut: int
    clock: int


CLOCK_MESSAGES = (ClockAppend, ClockAck, Collect, Report, Accept, Accepted, Install, Join, CatchupReq, CatchupData,
                  Snapshot, Hint, LogReq, LogData, SlotReq, SlotData, Leave, Nudge, Delays, Fence, Cap, NoCap,
                  Lift, Lifted)
