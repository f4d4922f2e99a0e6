"""A fenced member's return without a view change, for the `clock` protocol
(`NodeConfig.lift_fence`; docs/design/wan-ordering.md, "A return without a
view change").  Mixed into ClockNode before kdsync.core.crash_fence.

Theory of operation
-------------------
A member k that crashed, was cut off or stopped cleanly is *fenced* in its
view by every other member (kdsync.core.crash_fence, kdsync.core.fence):
they hold its slots up to the fence c and nobody's C2 waits for it.  Its
restart (or the new incarnation a cut-off member takes once told it was
fenced) used to be taken back by a view change, which wedges every member
for about a round trip to the farthest.  Here it is taken back in place:

1. k', the new incarnation, REJOINING in its view v, asks every other
   member of v to wait for it (LIFT, with a timestamp; resent every
   retransmit period) instead of sending JOIN.
2. A member m of v that fenced k answers LIFTED: from then on its C2 waits
   for k' at every timestamp at or above T_m = the larger of the asked one
   and its own clock + 1 (`ClockStream.lift`) — nothing m delivered is
   stamped that high, since every slot it took raised its clock — and it
   takes k''s slots from c on.  k' counts as a restarted member of the view
   (`rejoined`: it votes, does not lead, remembers nothing of the view); m
   sends it its new slots and counts its acknowledgements, as a holder's
   (C1, forgetting), from m's own counts on.  A member
   that cannot (another view, wedged, no fence of k, another incarnation
   lifted already) answers with cut -1 and k' joins at once; an older
   release drops LIFT, and k' joins after eight retransmit periods or
   suspect_ticks, the longer (a lossy link may take a few periods to carry
   a LIFT and its answer; a restarted process's first frames wait for its
   connections: 250 ms and more on a LAN, where eight periods are 240).
3. k' cuts its first slot only once every other member of v promised, each
   slot stamped above every T_m, numbered from c.  From its first LIFT on it
   reports its clock to every member every REPORT_GAP ticks (a member's C2
   waits for it from its promise on: a report a few ticks old is there when
   it promises, as the far member's reports are every tick); it resends
   what is not acknowledged, and delivers by *following*: it copies the
   order from the member that answered first (LOG_REQ / LOG_DATA, from its
   next position), the way a joiner catches up, never past the position it
   reported in a view change (kdsync.core.catchup).  The others' slots it
   counts and acknowledges, and keeps none: nobody asks k' for them.

Safety.  A slot of k' stamped t exists only once every member that can
deliver in v promised to wait for k' from some T_m <= t, and none had
delivered anything stamped T_m or above then; so no member delivers a slot
stamped above t before it holds k''s report past t, which follows the slot
on the link: the slot is ordered at the same place everywhere.  k' itself
delivers nothing by stability, only positions a member delivered.  A view
change finds k''s slots as any sender's: k' is never a reporter that
remembers the view (its incarnation is not the view's), so the trim comes
from n - q + 1 of the n - 1 others; a delivered slot had q holders (C1), at
least q - 1 of them others, who hold it truly, and (n - q + 1) + (q - 1) >
n - 1: one of them reports it, whatever k' acknowledged.  (So C1 may count
k', which is the one member that can never be such a reporter; the trim of
k is taken from the others as a capped sender's is: kdsync.core.crash_fence.)
k' hands its undelivered slots
back for resubmission when its view ends (origin watermarks drop what was
delivered).  Liveness: a lifted k' is no longer fenced, so a silent k' is
suspected as any member (a second crash in one view costs a view change).
"""

from __future__ import annotations

from kdsync.core.base import watermarks_of
from kdsync.core.batch import read_positions
from kdsync.core.messages import Lift, Lifted, LogData, LogReq
from kdsync.core.stream import NULL
from kdsync.core.types import Delivery, RemoteProtocolError

__all__ = ["LiftFence"]

_END = 1 << 62
REPORT_GAP = 2  # ticks: a clock report goes to a peer that got nothing from us in the last REPORT_GAP ticks
ASK_PERIODS = 8  # retransmit periods (suspect_ticks at least) a restart waits for every promise before it joins


class LiftFence:
    """Both sides of a fenced member's return in place (module docstring)."""

    def __init__(self, config, **kw) -> None:
        super().__init__(config, **kw)
        self._handlers[Lift] = self._on_lift
        self._handlers[Lifted] = self._on_lifted
        self._handlers[LogData] = self._on_log_data

    def _reset_view_state(self) -> None:
        st = getattr(self, "stream", None)
        if st is not None and self._lift_on:
            self._resubmit_own()  # our slots of the view that ends: ordered again (watermarks drop the delivered)
        # the member fenced: (its sender index, the incarnation taken back, our T, the fence)
        self._lift_by: tuple[int, int, int, int] | None = None
        self._lifted_inc: dict[str, int] = {}  # member -> its incarnation taken back in place (kdsync.core.peers)
        # the returning side
        self._lift_asked: int | None = None  # tick of our first LIFT in this view (None: not asked)
        self._lift_sent = -10**9
        self._lift_answers: dict[str, tuple[int, int]] = {}  # member -> (the fence, its T)
        self._lift_on = False  # every member promised: we cut, report and follow
        self._lift_off = False  # we join instead, in this view
        self._follow_src: str | None = None
        self._follow_asked: int | None = None  # tick of our outstanding LOG_REQ (None: none)
        super()._reset_view_state()

    @property
    def status(self) -> str:
        """Taken back in place, we order and deliver: "active" to the adapter."""
        if self._lift_on and self.state is self.State.REJOINING:
            return "active"
        return super().status

    @status.setter
    def status(self, value) -> None:  # NodeBase's constructor sets it; derecho derives it
        pass

    # ------------------------------------------------------------ returning
    def lifts_instead(self) -> bool:
        """Called instead of sending JOIN (kdsync.core.joining): True while we
        ask to be taken back in place, or were (module docstring)."""
        if not self.cfg.lift_fence or self.state is not self.State.REJOINING or self._lift_off or self.leaving:
            return False
        if self._lift_on:
            return True
        if self._lift_asked is None:
            self._lift_asked = self.now
            self._ask_lift()
            return True
        if self.now - self._lift_asked < max(ASK_PERIODS * self.cfg.retransmit_ticks, self.cfg.suspect_ticks):
            return True
        self._give_up()
        return False

    def _give_up(self) -> None:
        self._lift_off = True
        self.stats["lifts_given_up"] = self.stats.get("lifts_given_up", 0) + 1

    def _ask_lift(self) -> None:
        self._lift_sent = self.now
        data = Lift(self.me, self.incarnation, self.view.view_id, self._stamp_now).encode()
        for p in self.view.members:
            if p != self.me and p not in self._lift_answers:
                self._send(p, data)

    def _on_lifted(self, msg: Lifted) -> None:
        v = self.view
        if (self._lift_asked is None or self._lift_on or self._lift_off or self.state is not self.State.REJOINING
                or msg.view != v.view_id or msg.sender not in v.members or msg.sender == self.me):
            return
        if msg.cut < 0:  # it will not: join now
            self._give_up()
            self.vc.send_join()
            return
        if msg.k != self.stream.my_k:
            raise RemoteProtocolError("lifted names another sender")
        self._lift_answers[msg.sender] = (msg.cut, msg.clock)
        if self._follow_src is None:
            self._follow_src = msg.sender  # the first to answer: near, as measured
        answers = self._lift_answers
        if any(p not in answers for p in v.members if p != self.me):
            return
        fences = {c for c, _ in answers.values()}
        if len(fences) != 1:  # cannot happen (one fence per view, every member the same): join
            self._give_up()
            self.vc.send_join()
            return
        self._begin(fences.pop(), max(t for _, t in answers.values()))

    def _begin(self, c: int, floor: int) -> None:
        """Every member promised: our slots go on from the fence c, stamped above `floor`."""
        st = self.stream
        k = st.my_k
        st.received[k] = st.cut_upto = st.next[k] = st.low[k] = c
        for a in st.acks.values():
            a[k] = max(a[k], c)
        st.clock = max(st.clock, floor)
        self._lift_on = True
        self.stats["lifted"] = self.stats.get("lifted", 0) + 1
        self._follow()

    def _lifted_append(self, k: int, msg) -> None:
        """Taken back in place, we deliver by following, so another sender's
        slots are counted and acknowledged, not kept: C1 may count us
        (module docstring), and nobody asks us for them."""
        if msg.slots and k != self.stream.my_k:
            st = self.stream
            st.received[k] = max(st.received[k], msg.first + len(msg.slots))
            self._ack_due.add(msg.sender)

    def _take_ack(self, msg) -> None:
        """A member taken back in place is a restarted member (wedged until
        the next view takes it in): its acknowledgements count, its wedge,
        suspicions and rounds are not ours (it joins when it wants a view
        change)."""
        if self._lifted_inc.get(msg.sender) == msg.inc:
            self._on_ack_vector(msg.sender, msg.recv)  # its acknowledgements count (module docstring)
            return
        super()._take_ack(msg)

    def tick(self) -> None:
        super().tick()
        if self._lift_asked is None or self._lift_off or self.state is not self.State.REJOINING:
            return
        now, cfg = self.now, self.cfg
        st = self.stream
        for p in st.acks:  # our clock, from the first LIFT on: a member's C2 waits for it from its promise on
            if p not in self.suspected and self.last_sent[p] < now - REPORT_GAP:
                self._send_ack(p)
        if not self._lift_on:
            if now - self._lift_sent >= cfg.retransmit_ticks:
                self._ask_lift()
            return
        k = st.my_k  # (what a peer lacks is resent by derecho's tick)
        low = min((a[k] for a in st.acks.values()), default=st.cut_upto)
        store, wm = st.slots[k], self.watermarks
        while st.low[k] < low:  # held by every peer and come back to us as positions: no longer ours to resend
            slot = store.get(st.low[k])
            if slot is not None and slot[1] is not NULL and any(
                    b.first_offset + b.count - 1 > wm.get((b.origin, b.partition), -1) for b in slot[1]):
                break  # not delivered here yet: a view change may still need it resubmitted (`_reset_view_state`)
            store.pop(st.low[k], None)
            st.low[k] += 1
        st.next[k] = max(st.next[k], st.low[k])
        if self._follow_asked is None or now - self._follow_asked >= cfg.retransmit_ticks:
            if self._follow_asked is not None:  # no answer: the next member
                ms = [m for m in self.view.members if m != self.me]
                self._follow_src = ms[(ms.index(self._follow_src) + 1) % len(ms)]
            self._follow()

    def _follow(self) -> None:
        """Ask our source for the positions it delivered past ours."""
        if self.next_seq >= self.catchup._stop():
            self._follow_asked = None  # we reported in a view change: nothing past that until the next view
            return
        self._follow_asked = self.now
        self._send(self._follow_src, LogReq(self.me, self.incarnation, self.next_seq, _END).encode())

    def _on_log_data(self, msg: LogData) -> None:
        if not self._lift_on or self.target is not None or self.state is not self.State.REJOINING:
            self.catchup.on_log_data(msg)
            return
        if msg.sender not in self.view.members or msg.start > self.next_seq:
            return  # (from any member: a position holds the same records everywhere; an answer may come late)
        self._follow_asked = None  # answered: asked again on the tick, or now when it brought positions
        batches = read_positions(msg.batches, self.next_seq, self.catchup._stop(), msg.start)
        if batches:
            watermarks_of(batches, self.watermarks)
            self._emit(Delivery(self.next_seq, tuple(batches), True, sum(b.count for b in batches)))
            self._follow()

    # ------------------------------------------------------------ the others
    def _on_lift(self, msg: Lift) -> None:
        v, s = self.view, msg.sender
        if not self.cfg.lift_fence or s not in v.members or s == self.me:
            return
        k = v.senders.index(s) if s in v.senders else -1
        by = self._lift_by
        if by is not None and by[1] == msg.inc and msg.view == v.view_id:
            self._send(s, Lifted(self.me, self.incarnation, v.view_id, by[0], by[3], by[2]).encode())
            return
        if (msg.view == v.view_id and k >= 0 and by is None and s in self.fenced and not self.wedged
                and not self.leaving and self.state is self.State.ACTIVE
                and msg.inc != v.incarnations[v.members.index(s)] and len(self.fenced) == 1):
            c = self.fenced[s]
            st = self.stream
            if st.received[k] < c:
                return  # its slots up to the fence are on their way here: asked again
            floor = max(msg.clock, st.clock + 1)  # nothing delivered here is stamped this high
            self._lift_by = (k, msg.inc, floor, c)
            self._lifted_inc[s] = msg.inc
            self.vc.rejoined[s] = msg.inc  # a restarted member of the view: votes, does not lead
            del self.fenced[s]
            self._fence_holder = None
            st.lift(k, floor - 1)
            st.acks[s] = list(st.received)  # it counts as holding what we hold (module docstring): sent what follows
            self.ack_progress[s] = self.now
            self.last_heard[s] = self.now
            self.stats["lifts"] = self.stats.get("lifts", 0) + 1
            self._send(s, Lifted(self.me, self.incarnation, v.view_id, k, c, floor).encode())
            return
        if self._cap_k == k >= 0 and not self._crash_fenced and msg.view == v.view_id and not self.wedged:
            return  # our cap of it may become a fence: asked again
        self._send(s, Lifted(self.me, self.incarnation, v.view_id, max(k, 0), -1, 0).encode())
