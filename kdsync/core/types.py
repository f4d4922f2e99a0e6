"""Values that cross the boundary of the ordering core.

Everything here is a frozen, slotted dataclass: inputs the adapter hands to
`OrderingNode.step()`, and the `Ready` record the node hands back.  Nothing in
this package performs I/O; adapters (simulator, asyncio/TCP runtime, RDMA
runtime) move these values around and report back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kdsync.core.batch import Batch, Event
from kdsync.core.errors import LocalProtocolError, ProtocolError, RemoteProtocolError

__all__ = [
    "Batch", "Delivery", "Event", "HardState", "LocalProtocolError", "LogChunk", "MemberInfo", "NodeConfig",
    "Outgoing", "ProtocolError", "ReadRequest", "Ready", "RemoteProtocolError", "Role", "View",
]

Role = Literal["member", "witness"]
ProtocolName = Literal["derecho", "clock", "sequencer", "mirror"]


class Delivery:
    """A run of consecutive positions of the agreed order, as whole batches.

    The records of `batches`, in order, take positions (`kdsync.seq`)
    `first_seq .. first_seq + count - 1`.  Positions are contiguous from 0
    across views and identical at every member.  `catchup` is True when the
    run was received from a peer to fill the gap a restart left, rather than
    ordered live.  Immutable by convention.
    """

    __slots__ = ("first_seq", "batches", "count", "catchup")

    def __init__(self, first_seq: int, batches: tuple[Batch, ...], catchup: bool = False, count: int | None = None):
        self.first_seq = first_seq
        self.batches = batches
        self.count = sum(b.count for b in batches) if count is None else count
        self.catchup = catchup

    @property
    def end_seq(self) -> int:
        return self.first_seq + self.count

    def events(self) -> list[Event]:
        """The records taken apart (adapters and tests; not the hot path)."""
        out: list[Event] = []
        for b in self.batches:
            out.extend(b.events())
        return out

    def __repr__(self) -> str:
        return f"Delivery({self.first_seq}+{self.count}, {list(self.batches)}{', catchup' if self.catchup else ''})"


@dataclass(frozen=True, slots=True)
class MemberInfo:
    id: str
    role: Role = "member"


@dataclass(frozen=True, slots=True)
class View:
    """An installed membership.  `members` is ordered by rank (rank 0 leads)."""

    view_id: int
    members: tuple[str, ...]
    incarnations: tuple[int, ...]
    senders: tuple[str, ...]  # members with role "member", in rank order
    start_seq: int  # first position ordered in this view

    def rank(self, member: str) -> int:
        return self.members.index(member)


@dataclass(frozen=True, slots=True)
class ReadRequest:
    """Ask the adapter for positions [start, stop) of this member's own
    global topic (durable positions the in-memory log no longer holds).
    Answer with `node.step(LogChunk(start, events))` — possibly in several
    chunks, in order."""

    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class LogChunk:
    """Adapter's answer to a ReadRequest: the records at positions start,
    start+1, ... as batches (cut wherever origin, partition or offset
    contiguity breaks; `kdsync.core.batch.batches_from_events` does it)."""

    start: int
    batches: tuple[Batch, ...]


@dataclass(frozen=True, slots=True)
class HardState:
    """What a member must persist (before sending `Ready.messages`) so that a
    restart keeps its promises: incarnation counter and view-change votes.
    Losing it is safe except during a view change the member voted in."""

    incarnation: int = 0
    view_id: int = 0
    members: tuple[str, ...] = ()
    promised: tuple[int, int] = (0, -1)  # ballot (round, leader rank)
    accepted: bytes = b""  # encoded proposal, empty when none


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One message for one peer. `data` is the encoded message (wire codec)."""

    to: str
    data: bytes


@dataclass(frozen=True, slots=True)
class Ready:
    """Everything the node wants done, in this order:

    1. persist `hard_state` if not None (before any message is sent);
    2. send `messages` (any order; the protocol tolerates loss and reordering);
    3. append `deliveries` to the global topic, in order, then report the
       highest durable position with `node.durable(seq_end)`;
    4. serve `reads` (answer with LogChunk inputs);
    then call `node.advance(ready)`.
    """

    messages: tuple[Outgoing, ...] = ()
    deliveries: tuple[Delivery, ...] = ()
    views: tuple[View, ...] = ()  # views installed since the last Ready
    reads: tuple[ReadRequest, ...] = ()
    hard_state: HardState | None = None
    status: str = ""  # "forming" | "active" | "wedged" | "minority" | "joining" | "catching-up"

    def is_empty(self) -> bool:
        return not (self.messages or self.deliveries or self.views or self.reads or self.hard_state)


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """Static configuration of one member.

    `members` is the full configured group (this member included), in rank
    order; `roles` maps witness ids to "witness" (others are "member").
    Counts are in ticks; the adapter decides how long a tick is.
    """

    member_id: str
    members: tuple[str, ...]
    roles: dict[str, Role] = field(default_factory=dict)
    protocol: ProtocolName = "derecho"
    heartbeat_ticks: int = 2
    suspect_ticks: int = 10
    retransmit_ticks: int = 3
    max_batch: int = 10_000  # events per slot (a larger submitted batch is cut)
    window: int = 2  # own data slots in flight (cut, not yet acknowledged by every peer)
    log_retention: int = 1_000_000  # delivered events kept in memory for catch-up
    catchup_chunk: int = 5_000  # events per catch-up message
    clock_lead_us: int = 0  # clock protocol: own stamps run this far ahead of the clock (a far member's lead)
    auto_lead: bool = False  # clock protocol: choose the lead from measured delays instead (kdsync.core.leads)
    commit_quorum: int = 0  # clock protocol: members that must hold a slot before delivery (0: a majority)
    fence_stops: bool = True  # clock protocol: a clean stop fences the leaver where it may (kdsync.core.fence); False: the view changes
    crash_fence: bool = True  # clock protocol: a member silent while the order waits for it is fenced by all the others (kdsync.core.crash_fence)
    lift_fence: bool = False  # clock protocol: the fenced member's restart is taken back without a view change (kdsync.core.lift)
    adaptive_suspect: bool = False  # suspect_ticks is a ceiling: a peer whose pings came regularly is suspected sooner (kdsync.core.liveness)
