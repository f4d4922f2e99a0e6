"""Machinery every protocol variant shares.

Theory of operation
-------------------
A node accumulates outputs (messages, deliveries, installed views, read
requests, hard state) while it handles inputs.  `ready()` hands them over as
one frozen `Ready` and `advance()` closes the handshake; the node never does
I/O itself.  Delivery goes through one door, `_deliver()`, which applies the
exactly-once rule to whole batches: the part of a batch at or below the
origin watermark of its (origin, partition) was already delivered and is
cut off (`Batch.after`; counted in `stats["deduplicated"]`).  The watermarks
are a pure function of the delivered sequence, so every member that
delivered the same prefix drops the same duplicates and assigns the same
positions.  Delivered runs stay in a bounded in-memory log from which
catch-up is served; older positions are read back from the adapter
(`ReadRequest` → `LogChunk`).  Nothing here touches a record: the cost of
ordering is per batch and per message, never per event.
"""

from __future__ import annotations

import random
from collections import deque
from typing import TYPE_CHECKING, Iterable, Mapping

from kdsync.core.batch import Batch, read_positions
from kdsync.core.types import (
    Delivery,
    HardState,
    LocalProtocolError,
    LogChunk,
    NodeConfig,
    Outgoing,
    ReadRequest,
    Ready,
    View,
)


if TYPE_CHECKING:
    from kdsync.core.messages import DecodeCache

class NodeBase:
    """State and helpers common to every variant (see module docstring)."""

    protocol = "base"

    def __init__(
        self,
        config: NodeConfig,
        *,
        rng: random.Random,
        start_seq: int = 0,
        watermarks: Mapping[tuple[str, int], int] | None = None,
        hard_state: HardState | None = None,
        decodes: DecodeCache | None = None,
    ) -> None:
        if not isinstance(rng, random.Random):
            raise LocalProtocolError("rng must be a random.Random (inject it; never use the module-level one)")
        if config.member_id not in config.members:
            raise LocalProtocolError(f"member id {config.member_id!r} is not among members {list(config.members)}")
        if len(set(config.members)) != len(config.members):
            raise LocalProtocolError("member ids must be unique")
        for m, role in config.roles.items():
            if m not in config.members or role not in ("member", "witness"):
                raise LocalProtocolError(f"bad role {role!r} for {m!r}")
        if start_seq < 0:
            raise LocalProtocolError("start_seq must be >= 0")
        self.cfg = config
        self.rng = rng
        self.decodes = decodes  # shared by the codecs of the nodes one driver runs (messages.DecodeCache)
        self.me = config.member_id
        self.members: tuple[str, ...] = tuple(config.members)
        self.member_set = frozenset(self.members)
        self.peers: tuple[str, ...] = tuple(m for m in self.members if m != self.me)
        self.is_witness = config.roles.get(self.me, "member") == "witness"
        self.hard = hard_state or HardState()
        self.incarnation = (self.hard.incarnation + 1) if hard_state is not None else rng.randrange(1, 2**31)
        self.now = 0  # ticks since start
        self._now_us: int | None = None  # the adapter's clock, when it gives one (see clock())
        # delivery state
        self.next_seq = start_seq
        self.watermarks: dict[tuple[str, int], int] = dict(watermarks or {})
        self.durable_seq = start_seq
        self._log: deque[Delivery] = deque()  # delivered runs kept for catch-up
        self._log_len = 0
        # pending outputs
        self._msgs: list[Outgoing] = []
        self._deliveries: list[Delivery] = []
        self._views: list[View] = []
        self._reads: list[ReadRequest] = []
        self._hard_dirty = hard_state is not None  # a new incarnation must be persisted
        self._outstanding: Ready | None = None
        self.stats = {"delivered": 0, "deduplicated": 0, "resubmitted": 0, "bad_messages": 0, "submitted": 0,
                      "delivered_batches": 0, "holes_asked": 0}
        self.status = "active"

    # ------------------------------------------------------------------ inputs
    def submit(self, batches: Iterable[Batch]) -> None:
        """Local source batches, in origin-offset order per (origin, partition)."""
        raise NotImplementedError

    def _own_batches(self, batches: Iterable[Batch]) -> list[Batch]:
        """Checked and cut to at most max_batch records each; counted as submitted."""
        if self.is_witness:
            raise LocalProtocolError("a witness has no source events to submit")
        out: list[Batch] = []
        mb = self.cfg.max_batch
        n = 0
        for b in batches:
            if type(b) is not Batch:
                raise LocalProtocolError(f"submit() takes Batch objects, not {type(b).__name__}")
            n += b.count
            if b.count <= mb:
                out.append(b)
            else:
                out.extend(b.slice(i, i + mb) for i in range(0, b.count, mb))
        self.stats["submitted"] += n
        return out

    def receive(self, sender: str, data: bytes) -> None:
        """Bytes a peer sent. Raises RemoteProtocolError when malformed."""
        raise NotImplementedError

    def tick(self) -> None:
        self.now += 1

    def clock(self, now_us: int) -> None:
        """The adapter's clock (microseconds, wall time on this member's host):
        given before inputs by drivers of protocols that stamp with physical
        time; others ignore it.  Never read for safety: a clock that is skewed,
        drifts or jumps only delays delivery."""
        self._now_us = now_us

    @property
    def now_us(self) -> int:
        """The last clock given, or the ticks counted as milliseconds when the
        adapter never gives one."""
        t = self._now_us
        return self.now * 1000 if t is None else t

    def quiet(self) -> bool:
        """True when, until the next input (receive, submit, durable), a
        tick of this node can only send heartbeats and count silence towards
        failure suspicion: nothing waits on a retransmission or protocol
        timer.  A driver may then let ticks fall due and run them late, in a
        pair (an idle member wakes half as often); it must run the ticks due
        before it hands the node any input, so time as the node counts it
        stays exact at every input.  False (tick on time) unless a protocol
        says otherwise."""
        return False

    def dormant(self) -> bool:
        """True when the driver may stop ticking this node until input, a
        peer falling silent, or nothing at all (kdsync.core.liveness): it
        is quiet and its peers' liveness may come from the member's.  False
        unless a protocol says otherwise."""
        return False

    def wake(self, ticks: int, heard_ago: Mapping[str, int]) -> None:
        """The driver woke this node after `ticks` ticks of sleep: its time
        moves on (a dormant node's ticks only heartbeat and count silence) and
        it hears its peers' liveness (`heard`)."""
        self.now += ticks
        self.heard(heard_ago)

    def heard(self, heard_ago: Mapping[str, int]) -> None:
        """The member heard peer p `heard_ago[p]` ticks ago (any frame): a
        protocol that suspects silent peers counts from there too."""

    def silent(self, peers: frozenset[str]) -> None:
        """The member's liveness judged `peers` silent now (adaptive
        suspicion, kdsync.core.liveness), sooner than this node's own
        suspect_ticks would: a protocol that suspects silent peers suspects
        them too."""

    def durable(self, seq_end: int) -> None:
        """Positions below `seq_end` are durable in this member's global topic."""
        if seq_end > self.durable_seq:
            self.durable_seq = min(seq_end, self.next_seq)

    def step(self, item) -> None:
        """Generic input door (raft's Step): LogChunk and the inputs above."""
        if isinstance(item, LogChunk):
            self._on_log_chunk(item)
        else:
            raise LocalProtocolError(f"step() does not take {type(item).__name__}")

    def _on_log_chunk(self, chunk: LogChunk) -> None:
        pass

    # ----------------------------------------------------------------- outputs
    def leave(self) -> None:
        """A clean stop: nothing to announce in a protocol without views."""
        self.leaving = True

    @property
    def left(self) -> bool:
        return getattr(self, "leaving", False)

    def has_ready(self) -> bool:
        return bool(self._msgs or self._deliveries or self._views or self._reads or self._hard_dirty)

    def ready(self) -> Ready:
        if self._outstanding is not None:
            raise LocalProtocolError("ready() called again before advance()")
        self._before_ready()
        rd = Ready(
            messages=tuple(self._msgs),
            deliveries=tuple(self._deliveries),
            views=tuple(self._views),
            reads=tuple(self._reads),
            hard_state=self._hard_state() if self._hard_dirty else None,
            status=self.status,
        )
        self._msgs.clear()
        self._deliveries.clear()
        self._views.clear()
        self._reads.clear()
        self._hard_dirty = False
        self._outstanding = rd
        return rd

    def advance(self, rd: Ready) -> None:
        if rd is not self._outstanding:
            raise LocalProtocolError("advance() must be given the last Ready")
        self._outstanding = None

    def _before_ready(self) -> None:
        """Hook: cut batches, flush coalesced messages."""

    def _hard_state(self) -> HardState:
        return HardState(incarnation=self.incarnation)

    # ---------------------------------------------------------------- helpers
    def _send(self, to: str, data: bytes) -> None:
        self._msgs.append(Outgoing(to, data))

    def _deliver(self, batches: Iterable[Batch], catchup: bool = False) -> int:
        """Deliver batches in order at next_seq, cutting off what is at or below
        its origin watermark; returns how many records were kept."""
        wm = self.watermarks
        kept: list[Batch] = []
        n = dup = 0
        for b in batches:
            k = (b.origin, b.partition)
            w = wm.get(k, -1)
            last = b.first_offset + b.count - 1
            if b.first_offset > w:
                kept.append(b)
                n += b.count
                wm[k] = last
            elif last <= w:
                dup += b.count
            else:
                part = b.slice(w + 1 - b.first_offset)
                kept.append(part)
                n += part.count
                dup += b.count - part.count
                wm[k] = last
        if dup:
            self.stats["deduplicated"] += dup
        if kept:
            self._emit(Delivery(self.next_seq, tuple(kept), catchup, n))
        return n

    def _emit(self, d: Delivery) -> None:
        """Append an already-deduplicated run at next_seq."""
        if d.first_seq != self.next_seq:
            raise LocalProtocolError(f"delivery at {d.first_seq} but next position is {self.next_seq}")
        self._deliveries.append(d)
        self._log.append(d)
        self._log_len += d.count
        self.next_seq = d.end_seq
        self.stats["delivered"] += d.count
        self.stats["delivered_batches"] += len(d.batches)
        keep = self.cfg.log_retention
        log = self._log
        while log and self._log_len - log[0].count >= keep and log[0].end_seq <= self.durable_seq:
            self._log_len -= log.popleft().count

    def log_slice(self, start: int, stop: int, limit: int) -> tuple[Batch, ...] | None:
        """The records at positions [start, min(stop, start+limit)) from memory,
        as batches, or None when `start` is older than the in-memory log."""
        if not self._log or start < self._log[0].first_seq:
            return None if start < self.next_seq else ()
        return slice_runs(self._log, start, min(stop, start + limit, self.next_seq))

    def snapshot(self) -> dict:
        """A plain-data view of the node for transcripts and debugging."""
        return {"member": self.me, "status": self.status, "next_seq": self.next_seq}


def slice_runs(runs: Iterable[Delivery], start: int, stop: int) -> tuple[Batch, ...]:
    """The batches holding positions [start, stop) of consecutive deliveries,
    the batches at both ends sliced to fit."""
    out: list[Batch] = []
    for d in runs:
        if d.end_seq <= start:
            continue
        if d.first_seq >= stop:
            break
        out += read_positions(d.batches, start, stop, d.first_seq)
    return tuple(out)


def watermarks_of(batches: Iterable[Batch], into: dict[tuple[str, int], int] | None = None) -> dict[tuple[str, int], int]:
    """Highest origin offset per (origin, partition) in `batches` (merged into `into`)."""
    wm = {} if into is None else into
    for b in batches:
        k = (b.origin, b.partition)
        last = b.first_offset + b.count - 1
        if last > wm.get(k, -1):
            wm[k] = last
    return wm
