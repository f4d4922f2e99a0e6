"""The crash-fenced member's return, when it was cut off rather than
crashed (kdsync.core.crash_fence; docs/design/wan-ordering.md, "The cut-off
region's return").  Mixed into ClockNode through CrashFencing.

k, the member every other one capped and fenced (its c: the fence), may have
been cut off, not crashed. A member that fenced k and hears it again (a
clock report newer than its last one before the cap, a leader's message, an
acknowledgement that suspects or wedges) answers FENCE naming k at c — what
a leaver is answered — and takes neither its suspicions nor its wedging. k,
told so while in that view and not leaving, knows that none of its slots at
or past c was delivered anywhere nor will be in this view
(kdsync.core.crash_fence, safety (1)-(3)): it hands its undelivered events
back for resubmission (the origin watermarks drop those below c, which the
others deliver), takes incarnation + 1 — in the hard state of the same
Ready, persisted before its JOIN leaves, as a restart takes it — and asks to
be taken back (REJOINING). The others then wedge on its JOIN and the view
change proposes from their reports alone, as after a restart: the old
incarnation's report and its ballots, run ahead while it was alone, are not
waited for. A k that keeps speaking as the fenced incarnation for
suspect_ticks (an older release ignores a FENCE naming it) is suspected and
the view changes with k in it, as before.
"""

from __future__ import annotations

from kdsync.core.messages import ClockAck, ClockAppend, Fence
from kdsync.core.types import View

__all__ = ["FencedReturn"]


class FencedReturn:
    """Both sides of a fenced member's return: the members that fenced it tell
    it so; it, told, comes back as a new incarnation (module docstring)."""

    def _from_view_member(self, msg) -> bool:
        ok = super()._from_view_member(msg)  # (kdsync.core.silence measures the gap)
        if ok and self._crash_fenced and self.view.senders[self._cap_k] == msg.sender \
                and type(msg) in (ClockAck, ClockAppend) and msg.clock > self._cap_clock \
                and self._lifted_inc.get(msg.sender) != msg.inc:
            self._fenced_spoke(msg.sender)  # fenced, yet alive (cut off, not crashed)
        return ok

    def _fenced_spoke(self, s: str) -> None:
        """The member we fenced spoke again (a newer clock report, or a
        leader's message of the view): it is alive, cut off rather than
        crashed.  Tell it it was fenced (FENCE naming it, at the fence): it
        then asks to be taken back as a new incarnation (`_on_fence`), and
        the view change that takes it needs nothing from its old one.  One
        that keeps speaking as the old incarnation for suspect_ticks (an
        older release ignores a FENCE naming it) is suspected, as before."""
        if self.wedged or s in self.suspected:
            return
        if self._told_since is None:
            self._told_since = self.now
        elif self.now - self._told_since > self.cfg.suspect_ticks:
            self._suspect({s})
            return
        if self.now - self._told_sent >= self.cfg.retransmit_ticks:
            self._told_sent = self.now
            self.stats["fences_told"] = self.stats.get("fences_told", 0) + 1
            self._send(s, Fence(self.me, self.incarnation, self.view.view_id, self._cap_k, self.fenced[s],
                                tuple(self.stream.received)).encode())

    def _take_ack(self, msg) -> None:
        """The member we fenced takes no part in the view: its suspicions and
        its wedging are not ours (it is cut off; a view change is for when it
        asks to be taken back); the rounds it names still raise ours."""
        if self._crash_fenced and msg.sender == self.view.senders[self._cap_k]:
            self.vc.heard_round(msg.round, msg.wedged)
            if msg.wedged or msg.suspected:
                self._fenced_spoke(msg.sender)
            return
        super()._take_ack(msg)

    def _on_fence(self, msg: Fence) -> None:
        """A FENCE naming us, from another member, while we are not leaving:
        the others crash-fenced us (we were cut off).  No slot of ours at or
        past its count was delivered anywhere, nor will be in this view
        (module docstring, safety (1)-(3)): we hand our undelivered events
        back for resubmission and ask to be taken back as a new incarnation,
        persisted before any message names it, as a process restart would."""
        v = self.view
        if (msg.view == v.view_id and 0 <= msg.k < len(v.senders) and v.senders[msg.k] == self.me
                and msg.sender != self.me and msg.cut >= 0 and not self.leaving
                and self.state in (self.State.ACTIVE, self.State.WEDGED, self.State.CATCHING_UP,
                                   self.State.CATCHING_UP_WEDGED)
                and self._from_view_member(msg)):
            self.stats["fenced_rejoins"] = self.stats.get("fenced_rejoins", 0) + 1
            self.incarnation += 1
            self._hard_dirty = True
            self._resubmit_own()
            self._become_rejoining(View(v.view_id, v.members, (0,) * len(v.members), v.senders, self.next_seq))
            return
        super()._on_fence(msg)

    def _gone_for_good(self):
        """The member we fenced may be alive (cut off, not crashed): a view
        change waits for it as for any member, unless a new incarnation of
        it asked to be taken back (the old one is gone, the new one joins) —
        for suspect_ticks: then the new one votes, if the others cannot
        decide without it."""
        if self._crash_fenced:
            s = self.view.senders[self._cap_k]
            if (s not in self.vc.rejoined and s not in self.vc.joiners) \
                    or self.now - self.wedged_at > self.cfg.suspect_ticks:
                # (a restarted one votes, with its persisted promises, once the others took long without it)
                return [m for m in self.fenced if m != s]
        return super()._gone_for_good()
