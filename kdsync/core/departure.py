"""Clean stops and lost acknowledgements: two small duties of a view member,
mixed into DerechoNode (and so ClockNode and SequencerNode).

Theory of operation
-------------------
*Leaving.*  A member that stops cleanly (SIGTERM) calls `leave()`: it wedges
(no more slots), sends LEAVE to every peer of its view and then only
repeats it, every retransmit period, and answers a view change's COLLECT or
ACCEPT with it.  A peer that hears LEAVE from the current incarnation of a
view member suspects it at once (`departed`: it stays suspected for the
rest of the view, whatever it sends, unless it comes back as a new
incarnation asking to be taken back) and acknowledges, naming it among the
suspected; the leaver is `left` once a peer's message names it suspected or
speaks of a newer view (it then sends its Leave once more).  A member may
stop during a view change whose next view still names it (it reported
before it stopped): so a peer keeps the leaver departed across the views it
installs while they name the same incarnation (`left_incs`), and takes a
Leave naming an older view from the incarnation its view names — else the
next view would wait a whole silence to lose it (measured on the real geo
run: 1.8 s).  Suspecting early is as safe as suspecting late:
safety rests on the view change's majorities, never on suspicion being
right.  What it saves is `suspect_ticks` of waiting — across regions, the
seconds the group would otherwise spend waiting for a silence.  The
leaver's own batches not delivered are not durable anywhere, so the adapter
consumes them again after its restart (exactly once: the origin watermarks).

*Nudging.*  A member that holds slots a peer has not acknowledged for a
retransmit period and a heartbeat sends it NUDGE, and the peer answers with
its acknowledgement.  Without it, an acknowledgement lost just before both
went quiet (kdsync.core.liveness: quiet nodes are not ticked and send no
heartbeat) was never repeated, and the waiting member never delivered
(swarm seed 15 with clean stops).  For the same reason a member is not quiet
while a peer lags what it holds.

Both messages are new in this release; a member of an older one drops them
as unknown (one log line) and behaves as it always did.
"""

from __future__ import annotations

from operator import ge

from kdsync.core.messages import Accept, Collect, Leave, Message, Nudge

__all__ = ["Departures"]


class Departures:
    """The leave / nudge duties of a DerechoNode (module docstring).  Needs the
    node's view, suspicions, stream, `_wedge`, `_suspect`, `_send`, `_send_ack`."""

    leaving = False  # leave() was called: a clean stop (no more slots, no view change led)
    _left = False  # a peer showed it took note of our leave
    _leave_sent = -10**9

    def leave(self) -> None:
        """Stop cleanly (the adapter's SIGTERM): cut no more slots and tell
        the view's peers; they suspect this member at once, instead of after
        `suspect_ticks` of silence, and form the next view without it.  The
        node then only repeats its Leave (every retransmit period) and
        answers a view change's COLLECT/ACCEPT with it; `left` turns True
        once a peer shows it took note.  Own batches not delivered are not
        durable anywhere: the adapter consumes them again after its restart."""
        if self.leaving:
            return
        self.leaving = True
        self._wedge()
        self._send_leave()

    @property
    def left(self) -> bool:
        """The group took note of our leave (or there is nobody to tell)."""
        return self.leaving and (self._left or not [m for m in self.view.members if m != self.me])

    def _send_leave(self, to: str | None = None) -> None:
        self._leave_sent = self.now
        data = Leave(self.me, self.incarnation, self.view.view_id).encode()
        for p in ([to] if to is not None else self.view.members):
            if p != self.me:
                self._send(p, data)

    def _leaving_answer(self, msg: Message) -> bool:
        """While leaving: note that the group moved on, answer a view change
        with Leave; True when `msg` is handled (not passed on)."""
        view = getattr(msg, "view", None)
        if view is not None and view > self.view.view_id:
            if not self._left:  # the view may still name us (we left during its view change): tell it again
                self._send_leave()
            self._left = True  # a view newer than ours exists: the group moved on
        elif self.me in (getattr(msg, "suspected", None) or ()):
            self._left = True  # it suspects us now
        if isinstance(msg, (Collect, Accept)):
            self._send_leave(msg.sender)
            return True
        return False

    def _on_nudge(self, msg: Nudge) -> None:
        """A peer waits for our acknowledgement (lost while we were quiet): send it."""
        if self._in_current_view(msg) and msg.sender in self.view.members and self._is_member():
            self.acked_sent[msg.sender] = None
            self._send_ack(msg.sender)

    def _nudge_lagging(self) -> None:
        """Peers that have not acknowledged what we hold for a retransmit
        period and a heartbeat: their acknowledgement may have been lost while
        they went quiet, and nothing else would make them repeat it."""
        st = self.stream
        cur = st.received
        now = self.now
        wait = self.cfg.retransmit_ticks + self.cfg.heartbeat_ticks
        for p, acks in st.acks.items():
            if p in self.suspected or all(map(ge, acks, cur)):
                self._lagging.pop(p, None)
                continue
            lag = self._lagging.get(p)
            if lag is None or all(map(ge, acks, lag[0])):
                self._lagging[p] = (tuple(cur), now)  # a new gap (it acknowledged the one watched): watch it
            elif now - lag[1] >= wait:
                self._lagging[p] = (lag[0], now)
                self._send(p, Nudge(self.me, self.incarnation, self.view.view_id).encode())

    def _on_leave(self, msg: Leave) -> None:
        """A peer leaves cleanly: suspect it now, and tell it we did.  Its
        Leave may name an older view than ours (it stopped during the view
        change that made ours, and the view still names it): the process
        that announced its stop is the one our view names (same
        incarnation), so it departs from ours too."""
        s = msg.sender
        if s == self.me:
            return
        if msg.view < self.view.view_id and s in self.view.members:
            if self.view.incarnations[self.view.members.index(s)] != msg.inc:
                return
        elif not self._in_current_view(msg):
            return
        self.left_incs[s] = msg.inc
        self.departed.add(msg.sender)
        if msg.sender not in self.suspected:
            if not self.wedged:  # active or catching up: the view is over
                self._suspect({msg.sender})
            else:
                self.suspected.add(msg.sender)
                if self.vc.round is not None and self.vc.leader() != self.me:
                    self.vc.round = None
        self._send_ack(msg.sender)  # its suspected list names the leaver: it may go
