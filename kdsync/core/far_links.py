"""The clock protocol's far links: acknowledgements carried by the messages
that go anyway, and messages held on links nobody waits for (docs/wan.md
"Messages"; docs/design/wan-ordering.md "Far links").

Theory of operation
-------------------
Every stream message (slots, acknowledgement, clock report) carries the
sender's received vector and clock, so what a peer must hear from us is
owed to it, not a message of its own:

*Far acknowledgements* (`_far_slot`, `_due_to`).  A far slot's sender, and
a third member that needs our acknowledgement or report, must hear from us
by a tick (`_far_due`): within a quarter of the slot's age or of the peer's
delay, counted in ticks.  Any message to it before then carries it
(`_sent`); else an acknowledgement goes alone (`_far_acks`).  A near peer
gets it with the far acknowledgements already due, else at once.

*Held links* (`gaps`, `_held`, `_flush_far`).  Across regions a tick is a
few ms and a one-way delay tens, and a member that sends each peer a
message every tick it cuts a slot pays for a precision most links cannot
use: at Frankfurt, delivery waits ~90 ms for Tokyo's reports whatever
Ireland (10 ms away) sends, so Ireland may hold its messages to Frankfurt
for a few ticks at no cost.  Each heartbeat a member computes, from the
one-way delays every member measures and gossips (kdsync.core.leads) and
the leads the rule gives them, when each member can deliver a slot of
each origin at the soonest -- once every sender's report passed its stamp
(C2) and the commit quorum's acknowledgements, relayed or its own
neighbours', are known (C1) -- and for each peer the least room any use
of our messages there has before such a deadline.  A peer whose gap (half
that room, in ticks, at most FAR_MAX_TICKS) is above 1 gets our messages
at most once per gap: slots cut meanwhile are *owed* to it and go out
together, with the current received vector and clock, with the next
message to it or once the gap has passed (`_flush_far`, each tick).  A
report never counts slots it does not carry (`_send_ack`: else the peer
would ask for them).  Groups above GAPS_MAX_MEMBERS, and members that lack
a delay, hold nothing.

Safety is not involved: a held message is a message the network delayed,
which every protocol rule already allows; the stream, C1, C2 and the view
change never read the gaps.  A gap computed from wrong delays or leads (a
configured lead the rule does not know, a delay that changed) costs at
most FAR_MAX_TICKS ticks per message on that link.  Heartbeats, nudges,
retransmissions, repairs and view-change messages are never held.
"""

from __future__ import annotations

from kdsync.core.leads import rule

__all__ = ["FAR_ACK_AGE_PART", "FAR_ACK_MAX_TICKS", "FAR_MAX_TICKS", "FAR_TICKS", "FarLinks", "SLACK_PART"]

FAR_TICKS = 4  # a slot older than this many ticks on arrival is far: acknowledged with the next message
# a far slot's acknowledgement waits at most this part of its age, counted in
# ticks and at most FAR_ACK_MAX_TICKS of them (so skew cannot hold it long)
FAR_ACK_AGE_PART = 4
FAR_ACK_MAX_TICKS = 8
GAPS_MAX_MEMBERS = 9  # larger groups hold nothing (the gaps' computation grows with the cube of the group)
SLACK_PART = 2  # a peer's gap is at most this part of its slack...
FAR_MAX_TICKS = 4  # ...and at most this many ticks


class FarLinks:
    """Mixin for ClockNode (module docstring): `_gap` per far peer, the
    slots and acknowledgements `_owed` to it."""

    def _init_far_links(self) -> None:
        self._gap: dict[str, int] = {}  # peer -> ticks between stream messages to it (absent: 1)
        self._gap_key: tuple | None = None  # what the last gaps measured were computed from
        self._gap_was: dict[str, int] = {}  # and those gaps
        self._owed: dict[str, int] = {}  # peer -> the first own slot cut and not sent to it yet
        self._owed_ack: set[str] = set()  # peers an acknowledgement or report is due to
        self._far_due: dict[str, int] = {}  # peer -> the tick by which it must hear of far slots we hold

    def _measure_gaps(self) -> None:
        """Each heartbeat: each peer's gap from the measured delays (module docstring)."""
        self._gap = {}
        members = self.view.members
        if not self._tick_us or not self._is_member() or len(members) > GAPS_MAX_MEMBERS:
            return
        delay = self.leads.delays(members)
        if delay is None:
            return  # a delay is not known yet: every gap stays 1
        key = (tuple(members), tuple(delay.values()), self.lead_us, self._quorum(self.view), self._tick_us)
        if key == self._gap_key:
            self._gap = self._gap_was  # the same inputs: the same gaps (never changed in place)
            return
        lead = {m: self.lead_us if m == self.me else rule(m, members, delay) for m in members}
        self._gap = self._gap_was = gaps(self.me, members, delay, lead, key[3], self._tick_us)
        self._gap_key = key

    def _held(self, p: str) -> bool:
        """A message to p now would come within p's gap of the last one."""
        g = self._gap.get(p)
        return g is not None and self.now - self.last_sent[p] < g

    def _reset_view_state(self) -> None:
        super()._reset_view_state()
        self._owed.clear()  # the view's slots: a new view resubmits or trims them
        self._owed_ack.clear()
        self._far_due.clear()

    def _far_slot(self, s: str, due: int, every: bool) -> None:
        """A far slot from sender s arrived: s must hear of it by tick
        `due`, and with `every` (a third member's acknowledgement counts
        toward C1) every other peer by its own wait (`_due_to`); any
        message to one before then acknowledges it (`_sent`)."""
        self._far_due.setdefault(s, due)
        if every:
            for p in self.view.members:
                if p != self.me and p != s and p not in self.suspected:
                    self._due_to(p)

    def _due_to(self, p: str) -> None:
        """An acknowledgement or clock report p needs, not for its own slot:
        to a far peer with the next message to it within a
        FAR_ACK_AGE_PART-th of its delay counted in ticks (at most
        FAR_ACK_MAX_TICKS); to a near one (or one not measured yet) with the
        far acknowledgements already due, else at once."""
        far_due = self._far_due
        if p in far_due:
            return
        d, t = self.leads.one_way(p), self._tick_us
        if d is not None and t and d > FAR_TICKS * t:
            far_due[p] = self.now + min(FAR_ACK_MAX_TICKS, -(-d // (FAR_ACK_AGE_PART * t)))
        else:
            self._near_due(p)

    def _near_due(self, p: str) -> None:
        """A near peer's acknowledgement or report: with the far
        acknowledgements already due (their wait is a small part of the
        delays the order waits for), else at once."""
        far_due = self._far_due
        if not far_due:
            self._ack_to(p)
        elif p not in far_due:
            far_due[p] = min(far_due.values())

    def _sent(self, p: str, cur: tuple) -> None:
        super()._sent(p, cur)
        self._far_due.pop(p, None)  # it carries our received vector

    def _far_acks(self) -> None:
        """Each tick: the acknowledgements of far slots that no message
        carried within their wait (`_far_slot`)."""
        now, gone = self.now, self.wedged or not self._is_member()
        for p in [p for p, t in self._far_due.items() if t <= now]:
            if gone or p in self.suspected or p not in self.view.members:
                del self._far_due[p]
            else:
                self._ack_to(p)
                if self._held(p):
                    self._far_due.pop(p, None)  # owed: it goes with what goes to p once its gap has passed

    def _far_quiet(self) -> bool:
        return not (self._owed or self._owed_ack or self._far_due)

    def _multicast_slots(self, first: int, cur: tuple, data: bytes) -> None:
        """Own new slots from `first` to every unsuspected peer: now, or when
        its gap has passed (owed)."""
        st = self.stream
        k, now, owed = st.my_k, self.now, self._owed
        sent, later = [], []
        for p, acks in st.acks.items():
            if p in self.suspected:
                continue
            if p in owed or self._held(p):
                owed.setdefault(p, first)
                later.append(p)
                self.stats["held"] += 1
                continue
            if acks[k] == first:
                self.ack_progress[p] = now
            self._send(p, data)
            self._sent(p, cur)
            self._owed_ack.discard(p)
            sent.append(p)
        self.leads.on_cut(first, sent, self.now_us, later)

    def _ack_to(self, p: str) -> None:
        """An acknowledgement or clock report is due to p: now, or with what
        goes to it once its gap has passed."""
        if self._held(p):
            self._owed_ack.add(p)
        else:
            self._send_ack(p)

    def _send_owed(self, p: str) -> bool:
        """The slots owed to p, now; False when none were."""
        start = self._owed.pop(p, None)
        st = self.stream
        acks = st.acks.get(p)
        if start is None or acks is None:
            return False
        start = max(start, acks[st.my_k])
        if start >= st.cut_upto:
            return False
        if acks[st.my_k] == start:
            self.ack_progress[p] = self.now
        self._send_slots(p, start, st.cut_upto)
        self.leads.on_sent(p, start, st.cut_upto, self.now_us)
        return True

    def _send_ack(self, p: str) -> None:
        """Any stream message to p carries what is owed to it: a report
        whose cut counts slots p was not sent would make it ask for them.
        The slots' message says nothing of suspicions or a wedge, so with
        either the acknowledgement follows it."""
        self._owed_ack.discard(p)
        if self._send_owed(p) and not (self.wedged or self.suspected):
            return
        super()._send_ack(p)

    def _become_wedged(self) -> None:
        """The view ends: what is owed goes now, so that the trim finds the
        slots where the network would have put them (a view change's leader
        would otherwise fetch them)."""
        super()._become_wedged()
        for p in list(self._owed):
            self._send_owed(p)

    _wedge = _become_wedged

    def _flush_far(self) -> None:
        """Each tick: what is owed to peers whose gap has passed."""
        if not (self._owed or self._owed_ack) or self.wedged or not self._is_member():
            return
        members = self.view.members
        for p in self._owed_ack.union(self._owed):
            if p in self.suspected or p not in members:
                self._owed_ack.discard(p)
                self._owed.pop(p, None)  # retransmission or the view change covers it
            elif not self._held(p):
                self._send_ack(p)


def gaps(me: str, members, delay: dict[tuple[str, str], int], lead: dict[str, int], q: int,
         tick_us: int) -> dict[str, int]:
    """The peers `me` may hold messages for, and for how many ticks (module
    docstring): `delay[a, b]` the one-way delay from a to b, `lead[m]` each
    member's lead (us), `q` the commit quorum.  A slot of origin i is ready at
    j, at the soonest, once every sender's report passed its stamp (C2: each
    sender's delay to j less its lead) and q holders are known there (C1: the
    origin, j, and the quickest q - 2 acknowledgements relayed by third
    members; for j's own slots, its q - 1 nearest peers' round trips).  Our
    messages to j come late by our delay less our lead; the slack of the link
    is the least room any of their uses at any member has before such a
    deadline, and the gap is a SLACK_PART-th of it (the other direction may
    hold its half) in ticks, at most FAR_MAX_TICKS."""
    others = {j: [m for m in members if m != j] for j in members}
    late = {(m, j): delay[m, j] - lead[m] for j in members for m in others[j]}
    crit = {j: max(late[m, j] for m in others[j]) for j in members}
    rtt = {(a, b): delay[a, b] + delay[b, a] for a in members for b in others[a]}

    def soonest(i: str, j: str) -> int:
        """When a slot of origin i can be delivered at j, at the soonest."""
        if i == j:
            c1 = sorted(rtt[j, m] for m in others[j])[q - 2] if q >= 2 else 0
            return max(crit[j], c1)
        c1 = delay[i, j]
        if q >= 3:
            c1 = max(c1, sorted(delay[i, m] + delay[m, j] for m in others[j] if m != i)[min(q - 3, len(members) - 3)])
        return max(crit[j], c1)

    ready = {(i, j): soonest(i, j) for i in members for j in members}
    # (i, j) -> the q - 2 third members whose acknowledgements of i's slots reach j first
    relays = {(i, j): sorted((m for m in others[j] if m != i), key=lambda m: delay[i, m] + delay[m, j])[:max(0, q - 2)]
              for i in members for j in others[i]}

    out: dict[str, int] = {}
    for j in others[me]:
        slack = min(ready[i, j] for i in members) - late[me, j]  # our reports there (C2)
        for i in members:
            if i not in (me, j) and me in relays[i, j]:  # our acknowledgement of i's slots (C1 at j)
                slack = min(slack, ready[i, j] - (delay[i, me] + delay[me, j]))
        for k in members:
            if k not in (me, j) and j in relays[me, k]:  # our slots, acknowledged by j to k (C1 at k)
                slack = min(slack, ready[me, k] - (delay[me, j] + delay[j, k]))
        near = sorted(others[me], key=lambda m: rtt[me, m])[:max(0, q - 1)]
        if j in near:
            slack = min(slack, ready[me, me] - rtt[me, j])  # j's acknowledgement of our slots (our C1)
        if me in sorted(others[j], key=lambda m: rtt[j, m])[:max(0, q - 1)]:
            slack = min(slack, ready[j, j] - rtt[me, j])  # our acknowledgement of j's slots (its C1)
        g = min(FAR_MAX_TICKS, slack // (SLACK_PART * tick_us))
        if g > 1:
            out[j] = g
    return out
