"""DerechoNode's conversation with the peers of its view, mixed in like
kdsync.core.departure and kdsync.core.holes: which messages count as the
view's (`_in_current_view`: the current incarnation of a member of this
view; an older view gets a helping reply), what the node sends them
(acknowledgements, its own slots, their multicast; `_ack_message` and
`_slots_message` are the hooks the clock protocol overrides), what the
member's liveness layer tells it (`heard`, `dormant`) and the node's
`snapshot` for logs and tests.  Needs the node's view, stream, suspicions,
incarnation, `last_heard` / `last_sent` / `acked_sent` / `ack_progress`,
`vc` and `_send`."""

from __future__ import annotations

from kdsync.core.errors import RemoteProtocolError
from kdsync.core.messages import Ack, Append, Message

__all__ = ["AHEAD_MAX", "PeerTalk"]

AHEAD_MAX = 256  # messages of the next view held, at most, until it is installed here


class PeerTalk:
    """The peer-facing duties of a DerechoNode (module docstring)."""

    _ahead: list[Message] | None = None  # messages of the next view, held (`_hold_ahead`)
    _lifted_inc: dict[str, int] = {}  # member -> its incarnation taken back in this view (clock: kdsync.core.lift)
    _lift_on = False  # this member was taken back in place: it cuts and resends while wedged (kdsync.core.lift)

    def lifts_instead(self) -> bool:
        """Ask to be taken back in place instead of joining (clock: kdsync.core.lift)."""
        return False

    def _from_view_member(self, msg: Message) -> bool:
        """True when msg comes from the current incarnation of a member of our view."""
        s, inc = msg.sender, msg.inc
        v = self.view
        if s not in v.members:
            return False
        # a member taken back in place is its new incarnation (clock: kdsync.core.lift); the old one is gone
        known = self._lifted_inc.get(s) or v.incarnations[v.members.index(s)]
        if known == 0 or known == inc:
            self.last_heard[s] = self.now
            return True
        if self.vc.rejoined.get(s) == inc:
            # a restarted member: alive (it may vote in the view change, with its
            # persisted promises) but it holds none of this view's data
            self.last_heard[s] = self.now
        return False  # another incarnation: a late message of a dead one, or a restart (JOIN handles it)

    def _in_current_view(self, msg: Message) -> bool:
        """msg names our view and comes from the current incarnation of one of
        its members; an older view gets a helping reply instead, the next
        view's message is held until we are in it (`_hold_ahead`)."""
        if msg.view != self.view.view_id:
            if msg.view < self.view.view_id:
                self.vc.stale_reply(msg.sender, msg.view)
            elif msg.view == self.view.view_id + 1:
                self._hold_ahead(msg)
            return False
        return self._from_view_member(msg)

    def _dispatch(self, msg: Message) -> None:
        if self.leaving and self._leaving_answer(msg):
            return
        self._handlers[type(msg)](msg)

    def _hold_ahead(self, msg: Message) -> None:
        """A message of the view after ours: its sender installed that view
        before us (members learn the choice from the votes, each when a
        majority's reached it, kdsync.core.viewchange).  Dropped, the slots
        it carries waited for a retransmission (derecho's first slots of a
        view: a quarter of a second on five regions); held instead, up to
        AHEAD_MAX, and handled once we are in that view — as if the network
        had delayed it, which every handler already allows for."""
        ahead = self._ahead
        if ahead is None or (ahead and ahead[0].view != msg.view):
            ahead = self._ahead = []
        if len(ahead) < AHEAD_MAX and (not ahead or ahead[-1] is not msg):
            ahead.append(msg)
            self.stats["held_ahead"] = self.stats.get("held_ahead", 0) + 1

    def _replay_ahead(self) -> None:
        """After an input: the messages held for the view we are in now, handled
        (those of a view we passed, dropped; a bad one counted, as on arrival)."""
        ahead, vid = self._ahead, self.view.view_id
        if ahead[0].view > vid:
            return
        self._ahead = None
        for msg in ahead:
            if msg.view == self.view.view_id:
                try:
                    self._dispatch(msg)
                except RemoteProtocolError:
                    self.stats["bad_messages"] += 1

    def dormant(self) -> bool:
        """Quiet (nothing but heartbeats and silence counting until input):
        the driver may stop ticking this node (kdsync.core.liveness).  A
        retransmission that reaches it is input and wakes it; the slots it
        repeats make the next heartbeat to its sender due (`_on_append`), so
        an acknowledgement that was lost is sent again."""
        return self.quiet()

    def heard(self, heard_ago) -> None:
        self._heard_shared = True
        now, last = self.now, self.last_heard
        for p, ago in heard_ago.items():
            t = last.get(p)
            if t is not None and now - ago > t:
                last[p] = now - ago

    def silent(self, peers: frozenset[str]) -> None:
        self.silenced = peers  # the tick suspects them (with those silent for suspect_ticks)

    def _send_ack(self, p: str) -> None:
        cur = tuple(self.stream.received)
        self._send(p, self._ack_message(cur))
        self._sent(p, cur)

    def _send_slots(self, p: str, start: int, stop: int) -> None:
        st = self.stream
        slots = st.own_slots(start, stop)
        if not slots:
            return
        cur = tuple(st.received)
        self._send(p, self._slots_message(start, slots, cur))
        self._sent(p, cur)

    def _sent(self, p: str, cur: tuple) -> None:
        """A stream message (acknowledging received vector `cur`) went to `p`: its last one built."""
        self.last_sent[p] = self.now
        self.acked_sent[p] = cur

    def _ack_message(self, cur: tuple) -> bytes:
        """An ACK carrying received vector `cur` (a hook: the clock protocol adds its report)."""
        return Ack(self.me, self.incarnation, self.view.view_id, cur, tuple(sorted(self.suspected)),
                   self.vc.promised[0], self.wedged).encode()

    def _slots_message(self, first: int, slots, cur: tuple) -> bytes:
        """Own slots from `first` with received vector `cur` (a hook, as `_ack_message`)."""
        return Append(self.me, self.incarnation, self.view.view_id, first, tuple(slots), cur).encode()

    def _multicast_slots(self, first: int, cur: tuple, data: bytes) -> None:
        """Send own new slots from `first` (encoded in `data`, carrying the
        received vector `cur`) to every unsuspected peer."""
        k = self.stream.my_k
        now = self.now
        for p, acks in self.stream.acks.items():
            if p not in self.suspected:
                if acks[k] == first:
                    self.ack_progress[p] = now
                self._send(p, data)
                self._sent(p, cur)

    def _flush_urgent_acks(self) -> None:
        self._ack_round = -1
        if self._is_member():
            cur = tuple(self.stream.received)
            for p in self.view.members:
                if p != self.me and p not in self.suspected and self.acked_sent.get(p) != cur:
                    self._send_ack(p)

    def snapshot(self) -> dict:
        lr = self.vc.round
        return {
            "member": self.me,
            "status": self.status,
            "state": self.state.value,
            "view": self.view.view_id,
            "members": list(self.view.members),
            "next_seq": self.next_seq,
            "suspected": sorted(self.suspected),
            "received": list(self.stream.received),
            "phase": lr.phase if lr is not None else "",
        }
