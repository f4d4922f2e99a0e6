"""A clean stop without a view change, for the `clock` protocol: the leaver
fences itself (docs/design/wan-ordering.md, "A leaver fences itself").
Mixed into ClockNode before DerechoNode.

Theory of operation
-------------------
A member that stops cleanly cuts nothing more in its view (it wedges), so it
may promise the end of time: every slot of it not held is stamped above any
clock, because there is none.  `leave()` sends FENCE (its sender index and
the slots it cut) to every peer, then repeats FENCE and LEAVE each
retransmit period to the peers that have not answered.

A peer that hears the FENCE of the incarnation its view names, while it is
in the view (active or catching up), *fences* the leaver instead of
suspecting it, when the group loses no fault tolerance by keeping it in the
view (`may_fence`: no other member fenced; the view change's majority and
the trim's n - q + 1 reporters then allow as many further failures as a
view without it would — an odd group of 3 or more with a majority commit
quorum; otherwise the FENCE counts as a LEAVE).  Fenced, the leaver's promise
is infinite once its first `cut` slots are held (`ClockStream.fence`; held
ones are fetched from it as any hole), so C2 never waits for it; its
acknowledgements count no more, so C1, the in-flight window and forgetting
go by the others'; nothing is sent to it but the answer (a FENCE naming it,
once those slots are held) and it is not suspected for its silence while
they are held.  The view does not change: the others never stop delivering.

Safety is the protocol's own.  The promise is true: the leaver's hybrid
clock never stamps again in this view (it could cut only after installing a
newer view, in that view's stream).  A peer that lacks some of its slots
waits for them as for any hole, and suspects the leaver's silence as before
if they never come.  A fenced member is treated as suspected by every view
change (`_become_wedged`, and the tick's silence): it does not report nor
lead, and the next view leaves it out; the trim needs n - q + 1 reporters
of the others, as it needs them when any member is lost.  Mixing with a
peer that suspected the leaver instead (it missed the FENCE, or judged
otherwise) is mixing with a view change, which every member then joins.
The leaver's restart is a new incarnation asking to be taken back: the view
change that takes it in leaves the old one out.  The leaver stops waiting
(`left`) once every peer answered, or one suspects it, or a newer view
exists; a stop waits for that at most LEAVE_WAIT_S (kdsync.stopping).
"""

from __future__ import annotations

from kdsync.core.messages import Fence, Leave
from kdsync.core.types import RemoteProtocolError

__all__ = ["Fencing", "may_fence", "trim_covers"]


def may_fence(size: int, commit_quorum: int) -> bool:
    """Whether a view of `size` members loses no fault tolerance by keeping
    one of them fenced (in the view, never to report) rather than removing
    it: the failures it can still take — a majority of the view for the view
    change, n - q reporters of the others for the trim (`trim_covers`) —
    against a view one smaller."""
    def quorum(n: int) -> int:
        majority = n // 2 + 1
        return majority if commit_quorum <= 0 else min(commit_quorum, majority)

    if size < 3:
        return False
    live = size - 1
    fenced = min(live - (size // 2 + 1), quorum(size) - 1)
    removed = min(live - (live // 2 + 1), quorum(live) - 1)
    return fenced >= 0 and fenced >= removed


def trim_covers(fence_recv, sure_recvs) -> bool:
    """Whether the trim over reporters `sure_recvs` (received vectors) covers
    every slot the fenced member held (its final vector `fence_recv`): then
    n - q reporters of the others are enough (module docstring), one fewer
    than the n - q + 1 the trim needs when any member may have held a slot."""
    return bool(fence_recv) and all(max(r[k] for r in sure_recvs) >= c for k, c in enumerate(fence_recv))


class Fencing:
    """The clean stop of a ClockNode (module docstring)."""

    fenced: dict[str, int]  # member -> the slots it cut: fenced in this view
    fence_recv: tuple = ()  # the fenced member's final received vector (one fence per view)
    _fencing = False  # our leave fences us (else it is derecho's Leave)
    _fence_ok: set[str]  # peers that answered our Fence
    _fence_view = -1  # the view our Fence is for
    _fence_sent = False
    wedged_at = 0  # the tick this member last wedged

    def _reset_view_state(self) -> None:
        self.fenced = {}
        super()._reset_view_state()

    # ------------------------------------------------------------ the leaver
    def leave(self) -> None:
        if self.leaving:
            return
        self._fencing = (self.cfg.fence_stops and self.state is self.State.ACTIVE and self.stream.my_k >= 0
                         and may_fence(len(self.view.members), self.cfg.commit_quorum))
        self._fence_ok = set()
        self._fence_view = self.view.view_id
        super().leave()

    def _send_leave(self, to: str | None = None) -> None:
        if not self._fencing or to is not None or self.view.view_id != self._fence_view:
            super()._send_leave(to)
            return
        again, self._fence_sent = self._fence_sent, True
        self._leave_sent = self.now
        st = self.stream
        fence = Fence(self.me, self.incarnation, self.view.view_id, st.my_k, st.cut_upto, tuple(st.received)).encode()
        leave = Leave(self.me, self.incarnation, self.view.view_id).encode() if again else None
        for p in self.view.members:
            if p != self.me and p not in self._fence_ok:
                self._send(p, fence)
                if leave is not None:  # an older release takes the Leave (a newer one took the Fence)
                    self._send(p, leave)

    @property
    def left(self) -> bool:
        if not self._fencing or self._left:
            return super().left
        return all(p == self.me or p in self._fence_ok or p in self.suspected for p in self.view.members)

    def _send_ack(self, p: str) -> None:
        if self.leaving and self._fencing:
            return  # it would say wedged, and a wedged peer ends the view: a leaver only fences and leaves
        if p in self.fenced and p not in self.vc.rejoined:
            self.last_sent[p] = self.now
            self.acked_sent[p] = tuple(self.stream.received)  # nothing goes to it (it is gone)
            return
        # its restart (a JOIN) hears from us as any suspected peer does: else it would suspect us and lead
        # view changes it cannot finish, whose ballots keep ours from a majority (swarm clock seed 8502282)
        super()._send_ack(p)

    # ------------------------------------------------------------ its peers
    def _on_fence(self, msg: Fence) -> None:
        if not self._in_current_view(msg):
            return
        v = self.view
        if msg.k >= len(v.senders) or msg.cut < 0 or len(msg.recv) != len(v.senders):
            raise RemoteProtocolError("fence names no sender of the view, or a received vector of another length")
        leaver = v.senders[msg.k]
        if leaver != msg.sender:  # an answer to our own Fence
            if leaver == self.me and self.leaving:
                self._fence_ok.add(msg.sender)
            return
        if self.leaving or leaver in self.fenced:
            self._answer_fence(leaver)
            return
        if (self.state in (self.State.ACTIVE, self.State.CATCHING_UP) and not self.fenced and not self._lifted_inc
                and leaver not in self.suspected and may_fence(len(v.members), self.cfg.commit_quorum)):
            self.fenced[leaver] = msg.cut
            self.fence_recv = tuple(msg.recv)
            self.stream.fence(msg.k, msg.cut)
            self._note_hole(msg.k, msg.cut)
            self._answer_fence(leaver)
            self._try_deliver()
        else:  # it leaves as it did before fences: the view changes
            self._on_leave(Leave(msg.sender, msg.inc, msg.view))

    def _answer_fence(self, leaver: str) -> None:
        """Tell the leaver we fenced it, once we hold every slot it cut (it
        answers our requests for them until then)."""
        cut = self.fenced.get(leaver)
        k = self.view.senders.index(leaver)
        if cut is not None and self.stream.received[k] >= cut:
            st = self.stream
            self._send(leaver, Fence(self.me, self.incarnation, self.view.view_id, k, cut, tuple(st.received)).encode())

    def _on_leave(self, msg: Leave) -> None:
        if msg.sender in self.fenced and msg.view == self.view.view_id:
            self._answer_fence(msg.sender)  # the Leave after the Fence, for older releases
            return
        super()._on_leave(msg)

    def _gone_for_good(self):
        """The fenced members a view change neither waits for nor keeps: a
        leaver is (kdsync.core.crash_fence's fence is of a member that may be
        alive)."""
        return self.fenced

    def _held_fences(self) -> list[str]:
        """Fenced members whose slots are all held here: their silence is expected."""
        rcv, senders = self.stream.received, self.view.senders
        return [m for m, cut in self.fenced.items() if rcv[senders.index(m)] >= cut]

    def silent(self, peers: frozenset[str]) -> None:
        super().silent(peers.difference(self._held_fences()) if self.fenced else peers)

    def _fence_tick(self) -> None:
        """Before the view's tick: a fenced member is not silent while the view
        goes on, and is gone (suspected) once it is over."""
        if not self.fenced:
            return
        going = self.state in (self.State.ACTIVE, self.State.CATCHING_UP)
        for m in (self._held_fences() if going else self._gone_for_good()):
            self.last_heard[m] = self.now + 1 if going else -10**9

    def _become_wedged(self) -> None:
        was = self.wedged
        super()._become_wedged()
        if self.wedged and not was:
            self.wedged_at = self.now
        if self.fenced and self.wedged:
            self.suspected.update(self._gone_for_good())  # a view change neither waits for nor keeps a leaver

    _wedge = _become_wedged
