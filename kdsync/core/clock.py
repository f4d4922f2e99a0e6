"""The `clock` variant: derecho's views with Clock-RSM's order inside them,
for members in different regions (docs/wan.md; the design and its safety
argument: docs/design/wan-ordering.md).

Theory of operation
-------------------
*Inside a view* (`ClockStream`): each sender stamps its own slots with a
hybrid logical clock and multicasts them; every member acknowledges a slot
the moment it arrives, with a clock report ("I had cut `cut` slots; every
later slot of mine is stamped above `clock`"), and reports again every tick
while some slot is undelivered here.  A slot is delivered in (timestamp,
sender rank) order once a majority of the view holds it (C1) and every
sender's promise here has passed its timestamp (C2).  Nothing waits for the
farthest member's acknowledgement or for a round-robin turn: a slot costs
about one one-way delay from the farthest sender (C2) or the round trip to
the origin's nearest majority (C1), whichever is larger.

*Acknowledgements* (kdsync.core.far_links).  Every stream message carries
the sender's received vector and clock, so an acknowledgement is a message
only where none goes anyway.  A slot from a near sender is acknowledged to
it at once (its C1 may wait for us); one from a far sender (its age on
arrival, skew included, above FAR_TICKS ticks as measured on the node's
clock) by the next message to it within a quarter of its age counted in
ticks (FAR_ACK_AGE_PART; at most FAR_ACK_MAX_TICKS, so skew cannot hold
it).  A third member gets it when a commit quorum above 2 counts its
acknowledgement, else only when it may lack our clock past the slots (our
last message to it reported a clock below their newest timestamp): far ones
the same way within a quarter of their delay, near ones with the far
acknowledgements already due or at once.  While a slot waits here, every
peer that got nothing from us in the last REPORT_GAP ticks gets a clock
report each tick.

*Far links* (kdsync.core.far_links).  Each member computes, from the delays
every member measures and gossips (kdsync.core.leads), when each member can
deliver at the soonest, and holds its messages to a peer for a few ticks
where nobody's delivery waits for them (the others' reports reach that peer
later anyway).  Five regions at 1 000 events/s: 2.9 peer messages per event
(3.6-3.7 before), p50/p99 within 1 % with a majority quorum (docs/wan.md).

*Repair.*  A receiver that learns of slots it lacks — a later message's
slots arrived first, or the sender's report counts more than it holds — asks
the sender for them (kdsync.core.holes; the sender answers SLOT_DATA, taken
like an arrival).  Three sites 50 ms apart at 2 % loss (seven seeds): p50
57-90 -> 53 ms (51.7 without loss), p99 220-345 -> 106-128 ms.

*Clocks.*  The adapter hands the node its host's wall clock (`clock()`)
before inputs.  Skew, drift and jumps change when C2 holds, never what is
delivered: timestamps of one sender strictly increase (the hybrid clock), and
links are FIFO per view once gaps are filled.

*Lead.*  `clock_lead_us` runs a member's stamps and promises that far ahead
of its clock: a deliberate clock offset, so as safe as any skew.  A member
far from every other one then holds the others back by its distance minus
its lead (its promises arrive that much "earlier"), and its own events wait
its lead longer: docs/wan.md says how to choose it.

*Automatic lead* (`auto_lead`, kdsync.core.leads): the member times its own
slots' acknowledgements, gossips its one-way delay estimates (DELAYS) and
chooses its lead by docs/wan.md's rule; a configured lead overrides it.

*Commit quorum.*  C1 needs a majority of the view by default: learning that
costs two one-way delays (origin -> holder -> here).  `commit_quorum` q
smaller than a majority (2: the origin and this member, so one delay) is
paid for at the view change: the trim needs reports from n - q + 1 members
that remember the view (to meet every q holders), so only q - 1 members may
be lost without a restart.  The view change itself stays a majority Paxos,
so a minority still never installs a view.

*View change* — derecho's Paxos, suspicion, joining and catch-up, with two
rules of the trim changed (see ClockViewChange `trim_holders`, `trim`):

* a slot may have been delivered anywhere once a majority held it (C1), not
  once everyone did, so the trim is the element-wise **maximum** received
  count over the reporters, and the leader puts the trimmed slots some
  holders lack into the proposal (`Proposal.extra`), fetching any it lacks
  itself from a reporter that holds them (SlotReq / SlotData) first;
* the maximum is only sound over reports from members that remember this
  view: a restarted process (a new incarnation) forgot what it acknowledged.
  Unless the reporters with the view's incarnations meet every commit
  quorum (n - q + 1 of them), the leader takes derecho's base path (every
  member and cluster reports its next position; the view starts after the
  highest).

*Promises outlive views* (`_note_clock`).  A report binds every slot its
sender cuts later, in any view of that incarnation (the hybrid clock never
goes back; a message naming an older view was sent before any slot of a
newer one was cut), so a view's stream starts from the highest report
heard from each sender's incarnation in older views.  A member asking to
be taken in reports to every peer each heartbeat, a heartbeat and a tick
ahead of its clock (its own later stamps are above it too): the view that
takes it in need not wait for it to hear of the install and report.

*Crash* (kdsync.core.crash_fence, `crash_fence`).  A sender the order waits
for that falls silent for longer than usual is capped by the member that
notices (it takes none of its slots past those it holds) and by every
member that hears so while it too finds the sender silent; once every other
member's cap is known, the sender is fenced at the largest, as a leaver is.
With `lift_fence` a fenced member's return is taken back in place, each
other member waiting for its clock from a timestamp it promised, without a
view change (kdsync.core.lift).

*Clean stop* (kdsync.core.fence).  A leaver cuts nothing more, so it
promises the end of time: its peers fence it (C2 skips it once its slots
are held, its acknowledgements count no more) and keep their view, where
the group keeps its fault tolerance by it; the next view change leaves it
out.

Delivered slots stay held until every member of the view holds them
(`ClockStream.forget_stable`): the trim's extras start at the holders'
smallest received count, so a slot any reporter may be asked for is never
forgotten.
"""

from __future__ import annotations

from kdsync.core.clock_stream import ClockStream
from kdsync.core.crash_fence import CrashFencing
from kdsync.core.derecho import DerechoNode
from kdsync.core.far_links import FAR_ACK_AGE_PART, FAR_ACK_MAX_TICKS, FAR_TICKS, FarLinks
from kdsync.core.fence import Fencing
from kdsync.core.leads import Leads
from kdsync.core.lift import REPORT_GAP, LiftFence
from kdsync.core.clock_viewchange import ClockViewChange
from kdsync.core.messages import (CLOCK_MESSAGES, Ack, Append, Cap, ClockAck, ClockAppend, Delays, Fence, NoCap, SlotData,
                                  SlotReq)
from kdsync.core.types import RemoteProtocolError, View

__all__ = ["ClockNode"]

# own slots some peer has not acknowledged, at most: across a WAN an
# acknowledgement takes a round trip, and a small window would cost one per slot
IN_FLIGHT = 64
NEVER = 1 << 62


class ClockNode(LiftFence, CrashFencing, Fencing, FarLinks, DerechoNode):
    protocol = "clock"
    MESSAGES = CLOCK_MESSAGES
    VIEW_CHANGE = ClockViewChange

    def __init__(self, config, **kw) -> None:
        self._ack_due: set[str] = set()  # near senders whose slots arrived since our last acknowledgement
        self._due_stamp = -1  # the newest timestamp among those slots
        self._built_clock = -1  # the clock report of the last stream message built
        self._promised: dict[str, tuple[int, int]] = {}  # peer -> (view, clock report of our last message to it)
        self._tick_us = 0  # the tick period as measured on the node's clock (0: not known yet)
        self._last_tick_us: int | None = None
        self.leads = Leads(config.member_id)
        # sender -> (incarnation, view, clock): its highest clock report heard from a view no newer than ours
        self._clocks: dict[str, tuple[int, int, int]] = {}
        self._joining_since = NEVER  # the tick this member started asking to be taken in
        self._init_far_links()
        super().__init__(config, **kw)
        self.stats["held"] = 0  # new slots held for a peer (kdsync.core.far_links)
        h = self._handlers
        del h[Append], h[Ack]  # not in this protocol's codec
        h[ClockAppend] = self._on_clock_append
        h[ClockAck] = self._on_clock_ack
        h[SlotReq] = self.vc.on_slot_req
        h[SlotData] = self._on_slot_data
        h[Delays] = self._on_delays
        h[Fence] = self._on_fence
        h[Cap] = self._on_cap
        h[NoCap] = self._on_nocap

    @property
    def lead_us(self) -> int:
        """The lead in use: the configured one, or the measured one (auto_lead)."""
        return self.leads.lead_us if self.cfg.auto_lead else self.cfg.clock_lead_us

    @property
    def _stamp_now(self) -> int:
        """The time own stamps and promises start from: the clock plus the lead."""
        return self.now_us + self.lead_us

    def _new_stream(self, view: View) -> ClockStream:
        old = getattr(self, "stream", None)
        clock = old.clock if isinstance(old, ClockStream) else 0
        st = ClockStream(view, self.me, clock, self._quorum(view))  # the hybrid clock never goes back
        for s, (inc, vid, c) in self._clocks.items():  # promises outlive views (module doc)
            self._seed(st, view, s, inc, vid, c)
        return st

    def _seed(self, st: ClockStream, view: View, s: str, inc: int, vid: int, clock: int) -> None:
        """Sender s's report of `clock`, from incarnation `inc` in view `vid`,
        is its promise in `view` too when `vid` is older and `inc` is its
        incarnation there (module doc: promises outlive views)."""
        if vid < view.view_id and s != self.me and s in view.senders \
                and inc == view.incarnations[view.members.index(s)] != 0:
            st.seed_promise(view.senders.index(s), clock)

    def _note_clock(self, msg) -> None:
        """Remember msg's clock report for the views to come, and take it as
        a promise in ours if it names an older one (module doc); one naming a
        view newer than ours is left out, since its sender may have cut slots
        of the views in between."""
        vid = msg.view
        if vid > self.view.view_id:
            return
        heard = self._clocks.get(msg.sender)
        if heard is None or heard[0] != msg.inc or msg.clock > heard[2]:
            self._clocks[msg.sender] = (msg.inc, vid, msg.clock)
        if vid < self.view.view_id:
            self._seed(self.stream, self.view, msg.sender, msg.inc, vid, msg.clock)

    def _quorum(self, view: View) -> int:
        """C1's commit quorum in `view`: the configured one, at most a majority."""
        majority = len(view.members) // 2 + 1
        q = self.cfg.commit_quorum
        return majority if q <= 0 else min(q, majority)

    # ------------------------------------------------------------- stream
    def _on_clock_append(self, msg: ClockAppend) -> None:
        self._note_clock(msg)
        if not self._in_current_view(msg):
            return
        s = msg.sender
        self._merge_ack_vector(s, msg.recv)  # one delivery attempt below, once the slots and report are in
        senders = self.view.senders
        if s not in senders:
            self._try_deliver()
            return
        if self.wedged:
            if self.state is self.State.WEDGED:
                self.vc.keep_late(senders.index(s), msg.first, msg.slots)
            elif self._lift_on:
                self._lifted_append(senders.index(s), msg)
            return
        st = self.stream
        k = senders.index(s)
        if st.add(k, msg.first, msg.slots):
            # far (the slot's age, skew included, is more than FAR_TICKS ticks): acknowledged by the next
            # message to its sender, within a quarter of its age (kdsync.core.far_links); near: at once
            age = self.now_us - msg.slots[-1][0] if msg.slots else 0
            if self._tick_us and age > FAR_TICKS * self._tick_us:
                wait = min(FAR_ACK_MAX_TICKS, -(-age // (FAR_ACK_AGE_PART * self._tick_us)))  # >= 1: age > tick
                self._far_slot(s, self.now + wait, self._quorum(self.view) > 2)
            else:
                self._ack_due.add(s)
                self._due_stamp = max(self._due_stamp, msg.slots[-1][0])
        elif msg.slots:
            self.acked_sent[s] = None  # a retransmission: our acknowledgement was lost, the next heartbeat repeats it
        self._note_hole(k, max(msg.first + len(msg.slots), msg.cut))
        st.on_report(k, msg.cut, msg.clock)
        self._try_deliver()

    def _on_clock_ack(self, msg: ClockAck) -> None:
        self._note_clock(msg)
        if not self._in_current_view(msg):
            return
        senders = self.view.senders
        if not self.wedged and msg.sender in senders:
            k = senders.index(msg.sender)
            self._note_hole(k, msg.cut)
            self.stream.on_report(k, msg.cut, msg.clock)
        self._take_ack(msg)  # derecho's: acknowledgements, suspicions, wedging (same field names)
        self._try_deliver()

    def _merge_ack_vector(self, s: str, recv) -> bool:
        grew = super()._merge_ack_vector(s, recv)
        k = self.stream.my_k
        if k >= 0:  # round trips: the lead (auto_lead) and far links' gaps (kdsync.core.far_links)
            self.leads.on_ack(s, recv[k], self.now_us)
        return grew

    # ------------------------------------------------------------- leads
    def _on_delays(self, msg: Delays) -> None:
        if len(msg.peers) != len(msg.delays) or msg.sender in msg.peers or any(d > 60_000_000 for d in msg.delays):
            raise RemoteProtocolError("delays: one delay per peer, under a minute, none to itself")
        self.leads.on_row(msg.sender, dict(zip(msg.peers, msg.delays)))

    def _entered_view(self) -> None:
        super()._entered_view()
        self.leads.new_view(self.view.members)

    def _gossip_delays(self) -> None:
        """Send our delay row where it is due, and choose the lead (kdsync.core.leads)."""
        peers = [p for p in self.view.members if p != self.me and p not in self.suspected]
        to, row = self.leads.due(peers)
        if to:
            peers_, delays = tuple(row), tuple(row.values())
            data = Delays(self.me, self.incarnation, self.view.view_id, peers_, delays).encode()
            for p in to:
                self._send(p, data)
        self.leads.choose(self.view.members)

    # ------------------------------------------------------------- repair
    def _on_slot_data(self, msg: SlotData) -> None:
        """Slots fetched: by a view change's leader (ClockViewChange), or to
        fill a hole in the current view (kdsync.core.holes)."""
        if self.vc.collecting(msg) is not None:
            self.vc.on_slot_data(msg)
            return
        if self.wedged or not self._in_current_view(msg):
            return
        st = self.stream
        if msg.k >= st.n:
            raise RemoteProtocolError("slot data names no sender")
        if st.caps is not None:
            self._keep_beyond(msg)  # a capped sender's slots sent ahead (kdsync.core.crash_fence)
        if st.add(msg.k, msg.first, msg.slots):
            self._ack_due.add(self.view.senders[msg.k])  # acknowledged at once: a repair, not a far slot's first arrival
            self._due_stamp = max(self._due_stamp, msg.slots[-1][0])
        self._try_deliver()

    def _try_deliver(self) -> None:
        if self.wedged or not self._caught_up():
            return
        st = self.stream
        slots = st.deliverable()
        if self.cfg.crash_fence:
            self._note_wait()
        if slots:
            self._deliver(slots[0] if len(slots) == 1 else [b for s in slots for b in s])
            st.forget_stable()  # lazily: a slot acknowledged later goes with the next delivery

    def _ack_message(self, cur: tuple, ahead_us: int = 0) -> bytes:
        cut, clock = self.stream.report(self._stamp_now + ahead_us)  # ahead: own later stamps above it too
        self._built_clock = clock
        return ClockAck(self.me, self.incarnation, self.view.view_id, cur, tuple(sorted(self.suspected)),
                        self.vc.promised[0], self.wedged, cut, clock).encode()

    def _slots_message(self, first: int, slots, cur: tuple) -> bytes:
        cut, clock = self.stream.report(self._stamp_now)
        self._built_clock = clock
        return ClockAppend(self.me, self.incarnation, self.view.view_id, first, tuple(slots), cur, cut,
                           clock).encode()

    # ------------------------------------------------------------- ticks
    def tick(self) -> None:
        self._fence_tick()
        self._crash_fence_tick()
        now_us = self.now_us
        if self._last_tick_us is not None and now_us > self._last_tick_us:
            gap = now_us - self._last_tick_us
            if not self._tick_us:
                self._tick_us = gap
            elif gap <= 4 * self._tick_us:  # a longer one was a sleep (a dormant node is not ticked), not a tick
                self._tick_us = (3 * self._tick_us + gap) // 4
        self._last_tick_us = now_us
        super().tick()
        if self.now % self.cfg.heartbeat_ticks == 0 and self._is_member() and not self.wedged:
            self._gossip_delays()  # the rows: the lead (auto_lead) and the far links' gaps
            self._measure_gaps()
        self._flush_far()
        self._far_acks()
        if not self.wedged and self._is_member() and self.stream.waiting():
            # a clock report per tick while something waits for C2, to each peer
            # that got nothing from us since the previous tick (every message reports)
            last = self.now - REPORT_GAP
            for p in self.view.members:
                if p != self.me and p not in self.suspected and self.last_sent[p] < last and p not in self._lifted_inc:
                    self._ack_to(p)
        self._report_while_joining()

    def _report_while_joining(self) -> None:
        """Asking to be taken in: a clock report to every peer each heartbeat,
        promising a heartbeat and a tick ahead of the clock (each tick until
        the tick's length is known); module doc: promises outlive views."""
        if self.state not in (self.State.JOINING, self.State.REJOINING) or self.leaving \
                or (self._lift_asked is not None and not self._lift_off):
            # (asking to be taken back in place, or taken back: our reports go every few ticks, at our clock,
            # kdsync.core.lift; a report a heartbeat ahead would move every member's clock, so its stamps, ahead)
            self._joining_since = NEVER
            return
        now, hb, tick_us = self.now, self.cfg.heartbeat_ticks, self._tick_us
        self._joining_since = min(self._joining_since, now)
        if tick_us and (now - self._joining_since) % hb:
            return
        data = self._ack_message(tuple(self.stream.received), (hb + 1) * tick_us)
        for p in self.peers:
            self._send(p, data)

    def quiet(self) -> bool:
        return not self._ack_due and self._far_quiet() and not self.stream.waiting() and super().quiet()

    # -------------------------------------------------------------- output
    def _may_cut(self) -> bool:
        return bool(self.pending) and (not self.wedged or self._lift_on) and self.stream.may_cut(IN_FLIGHT)

    def has_ready(self) -> bool:
        return self._ack_due or self._may_cut() or super(DerechoNode, self).has_ready()

    def _before_ready(self) -> None:
        st = self.stream
        if self._may_cut():
            first, slots = st.cut(self.pending, self._stamp_now, IN_FLIGHT, self.cfg.max_batch)
            cur = tuple(st.received)
            self._multicast_slots(first, cur, self._slots_message(first, slots, cur))  # times a slot (leads)
            self._ack_due.clear()  # that message acknowledges and reports
            self._due_stamp = -1
            self._try_deliver()
        if self._ack_due:
            self._send_acks()

    def _send_acks(self) -> None:
        """Acknowledge the near slots that arrived since the last
        acknowledgement, with a clock report.  To every peer when a third
        member's acknowledgement counts toward C1 (a commit quorum above 2).
        Else to the slots' senders, and to a third member only when it may
        lack our clock past them -- our last message to it in this view
        reported a clock below the newest of these slots' timestamps: at it
        the sender and the receiver are the quorum already, so our report
        matters only to its C2.  (Far slots: kdsync.core.far_links.)"""
        due, stamp = self._ack_due, self._due_stamp
        self._ack_due, self._due_stamp = set(), -1
        if self._is_member() and (not self.wedged or self._lift_on):
            every = self._quorum(self.view) > 2
            view, promised = self.view.view_id, self._promised
            for p in self.view.members:
                if p == self.me or p in self.suspected:
                    continue
                if p in due and not every:
                    self._ack_to(p)  # its C1: our acknowledgement may be the one it waits for
                elif every or promised.get(p, (-1, -1)) < (view, stamp):
                    self._due_to(p)  # with our next message to it: its C1 waits for more than ours

    def _sent(self, p: str, cur: tuple) -> None:
        super()._sent(p, cur)  # far_links: it acknowledges p's far slots
        self._promised[p] = (self.view.view_id, self._built_clock)

    def snapshot(self) -> dict:
        snap = super().snapshot()
        snap["clock"] = self.stream.clock
        snap["lead_us"] = self.lead_us
        snap["fenced"] = sorted(self.fenced)
        return snap

