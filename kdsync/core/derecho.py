"""The `derecho` variant: round-robin total order of batches with view changes.

Theory of operation
-------------------
*Views.*  The group moves through numbered views.  A view lists its members
in configured rank order with the incarnation of each (a restarted process is
a new incarnation), and the senders among them (members whose role is
"member"; witnesses order and vote but send nothing).  Every process starts
wedged, with no data, in the last view it persisted (view 0, "all configured
members", when it has no hard state), so first formation, restart after a
total outage and a single crash all go through the one view-change path.

*The parts.*  `stream` orders batches within a view (slots, cumulative
acknowledgements, stability, delivery, the send window); `viewchange` ends
a view and agrees on the next (Paxos, ragged trim, joining); `catchup`
fills a new member's gap before a view's start; `states` lists the
member's states and the changes allowed between them; mixed into the node,
`peers` (which messages are the view's, what is sent to peers),
`departure` (clean stops, nudges) and `holes` (a lost slot message asked
for again).  This module holds the member's state and the doors every input
comes through.

*State.*  One `State` says what a member is doing, changed only by the
`_become_*` methods:

  FORMING      in a view with none of its data (first start): wedged
  REJOINING    restarted (new incarnation, amnesiac) in its persisted view,
               or in an installed view that names an older incarnation of
               it, asking to be taken back: wedged
  JOINING      not in the current view (excluded, or told of a newer one):
               waits for the INSTALL that takes it in
  CATCHING_UP  taken into a view, pulling the positions before its start;
               receives the view's slots meanwhile
  CATCHING_UP_WEDGED  the same, while that view is already being changed
  ACTIVE       in a view with its data: ordering and delivering
  WEDGED       the view is over (a suspicion or a view change): no new
               slots, no delivery by stability; reports for the next view

`status` (for adapters) is the state's name, or "minority" while a wedged
member cannot reach a majority of its view.

*Failure suspicion.*  A peer silent for `suspect_ticks` is suspected;
suspicions are gossiped with every heartbeat and never withdrawn within an
active view.  Suspecting wedges the member.  Once wedged, suspicion is just
a timeout (not sticky), so members that hear each other again after a
partition heals form the next view together.

*Exactly once.*  Positions are assigned at delivery by NodeBase._deliver,
which cuts off whatever is at or below its origin watermark: a resubmission
after a crash or a trim is delivered once.
"""

from __future__ import annotations

from typing import Iterable

from kdsync.core.base import NodeBase
from kdsync.core.batch import Batch
from kdsync.core.catchup import Catchup
from kdsync.core.departure import Departures
from kdsync.core.holes import HoleRepair, Holes
from kdsync.core.peers import PeerTalk
from kdsync.core.states import _CATCHING_UP, _STATUS, TRANSITIONS, State, wedged
from kdsync.core.messages import (
    DERECHO_MESSAGES,
    Accept,
    Accepted,
    Ack,
    Append,
    CatchupData,
    CatchupReq,
    Codec,
    Collect,
    Hint,
    Install,
    Join,
    Leave,
    LogData,
    LogReq,
    Nudge,
    Report,
    SlotReq,
    Snapshot,
)
from kdsync.core.stream import Stream
from kdsync.core.types import HardState, LocalProtocolError, LogChunk, RemoteProtocolError, View
from kdsync.core.viewchange import NO_BALLOT, ViewChange, decode_vote, encode_vote

__all__ = ["DerechoNode", "State"]


class DerechoNode(Departures, HoleRepair, PeerTalk, NodeBase):
    protocol = "derecho"
    fenced: tuple | dict = ()  # members fenced after a clean stop (the clock protocol: kdsync.core.fence)
    State = State
    MESSAGES = DERECHO_MESSAGES
    VIEW_CHANGE = ViewChange

    def __init__(self, config, **kw) -> None:
        super().__init__(config, **kw)
        self.rank_of = {m: i for i, m in enumerate(self.members)}
        self.sender_ids = self._senders_of(self.members)
        if not self.sender_ids:
            raise LocalProtocolError("a group needs at least one member with role 'member'")
        self.codec = Codec(self.MESSAGES, self.members, self.decodes)
        hs = self.hard
        members = tuple(hs.members) if hs.members else self.members
        self.view = View(hs.view_id, members, (0,) * len(members), self._senders_of(members), self.next_seq)
        # the view change (viewchange.py): Paxos state from the disk, joiners, leader rounds
        self.vc = self.VIEW_CHANGE(self, tuple(hs.promised),
                                   decode_vote(hs.accepted, self.member_set) if hs.accepted else None)
        self._hard_dirty = True  # the new incarnation
        self.pending: list[Batch] = []  # own batches waiting for a slot
        self.target = None  # the Proposal of the view we are catching up to
        self.catchup = Catchup(self)  # the gap before a view's start, both sides (catchup.py)
        self.view_wm: dict[tuple[str, int], int] = dict(self.watermarks)  # watermarks at view start
        self.joined_views = 0
        self._minority = False
        self._heard_shared = False  # the driver shares the member's liveness (`heard`)
        self.left_incs: dict[str, int] = {}  # peer -> the incarnation of it that announced its leave (departure.py)
        self._reset_view_state()
        self.wedged = True  # forming or rejoining: wedged(state)
        if kw.get("hard_state") is not None:
            self.state = State.REJOINING  # a restart: ask to be taken back
            self.vc.send_join()
        else:
            self.state = State.FORMING
        self._handlers = {
            Append: self._on_append,
            Ack: self._on_ack,
            Collect: self.vc.on_collect,
            Report: self.vc.on_report,
            Accept: self.vc.on_accept,
            Accepted: self.vc.on_accepted,
            Install: self.vc.on_install,
            Join: self.vc.on_join,
            CatchupReq: self.catchup.on_req,
            CatchupData: self.catchup.on_data,
            Snapshot: self.catchup.on_snapshot,
            Hint: self.vc.on_hint,
            LogReq: self.catchup.on_log_req,
            LogData: self.catchup.on_log_data,
            Leave: self._on_leave,
            Nudge: self._on_nudge,
            SlotReq: self._on_slot_req,
        }

    # ------------------------------------------------------------ state
    @property
    def status(self) -> str:
        if self._minority and self.state in (State.FORMING, State.REJOINING, State.WEDGED):
            return "minority"
        return _STATUS[self.state]

    @status.setter
    def status(self, value) -> None:  # NodeBase's constructor sets it; derecho derives it
        pass

    def _holds_view_data(self) -> bool:
        """Holds the current view's slots and everything before its start."""
        return self.state is State.ACTIVE or self.state is State.WEDGED

    def _caught_up(self) -> bool:
        return self.state not in _CATCHING_UP

    def _is_member(self) -> bool:
        return self.state is not State.JOINING and self.me in self.view.members

    def _enter(self, state: State) -> None:
        """The one door of a state change (see TRANSITIONS)."""
        if state not in TRANSITIONS[self.state]:
            raise LocalProtocolError(f"state {self.state.value} -> {state.value} is not a transition of the machine")
        self.state = state
        self.wedged = wedged(state)  # an attribute, set with the state: read on every input

    def _become_active(self, view: View) -> None:
        """Enter `view` holding everything before its start."""
        self.view = view
        self._reset_view_state()
        self.target = None
        self._enter(State.ACTIVE)
        self._entered_view()

    def _become_wedged(self) -> None:
        if self.state is State.ACTIVE:
            self._enter(State.WEDGED)
        elif self.state is State.CATCHING_UP:
            self._enter(State.CATCHING_UP_WEDGED)
        else:
            return
        self.vc.on_wedged()

    _wedge = _become_wedged

    def _become_joining(self, view: View) -> None:
        """Not a member of `view` (the newest known): ask to be taken in."""
        self.view = view
        self._reset_view_state()
        self.target = None
        self._enter(State.JOINING)
        self._hard_dirty = True
        self.vc.send_join()

    def _become_rejoining(self, view: View) -> None:
        """A restarted member of `view` (incarnations unknown, none of its data):
        wedged, asking to be taken back — what a restart from disk starts as."""
        self.view = view
        self._reset_view_state()
        self.target = None
        self._enter(State.REJOINING)
        self._hard_dirty = True  # the view goes to disk: a restart must not fall back to an older one
        self.vc.send_join()

    def _become_catching_up(self, prop) -> None:
        """Taken into the view of `prop`; pull what precedes its start first."""
        self.view = View(prop.new_view, prop.members, prop.incs, self._senders_of(prop.members), -1)
        self._reset_view_state()
        self.target = prop
        self._enter(State.CATCHING_UP)
        self.catchup.begin()

    def _finish_catchup(self, vstart: int) -> None:
        """Caught up to the start of the target view: enter it, keeping what was
        received of it meanwhile."""
        prop = self.target
        self.target = None
        wedged = self.state is State.CATCHING_UP_WEDGED or bool(self.suspected)
        self.view = View(prop.new_view, prop.members, prop.incs, self._senders_of(prop.members), vstart)
        self._enter(State.WEDGED if wedged else State.ACTIVE)
        self._hard_dirty = True  # the view entered goes to disk (until now the disk held the vote for it)
        self._entered_view()
        self._try_deliver()

    def _resubmit_own(self) -> None:
        """Own batches in slots not delivered here go back to the front of pending."""
        back = self.stream.undelivered_own()
        if back:
            self.stats["resubmitted"] += sum(b.count for b in back)
            self.pending[:0] = back

    def _on_log_chunk(self, chunk: LogChunk) -> None:
        self.catchup.on_log_chunk(chunk)

    def _entered_view(self) -> None:
        self.view_wm = dict(self.watermarks)
        self._views.append(self.view)
        self.joined_views += 1

    def _new_stream(self, view: View):
        """The in-view ordering state (a hook: the clock protocol has its own)."""
        return Stream(view, self.me)

    def _senders_of(self, members) -> tuple[str, ...]:
        return tuple(m for m in members if self.cfg.roles.get(m, "member") == "member")

    def _reset_view_state(self) -> None:
        v = self.view
        now = self.now
        self.stream = self._new_stream(v)
        self.ack_progress = {m: now for m in v.members}  # last tick a peer's ack of our slots grew
        self.last_heard = {m: now for m in v.members}
        self.last_sent = {m: -10**9 for m in v.members}
        self.acked_sent: dict[str, tuple | None] = {m: None for m in v.members}  # what we last told each peer
        self.suspected: set[str] = set()
        # peers that left this view cleanly (Leave): suspected for good; also those
        # that left during the view change that made this view, which names them still
        self.departed: set[str] = {m for m, inc in self.left_incs.items()
                                   if m in v.members and v.incarnations[v.members.index(m)] == inc}
        self.silenced: frozenset[str] = frozenset()  # the member's liveness found them silent (adaptive suspicion)
        self._lagging: dict[str, tuple[tuple, int]] = {}  # peer -> (our received vector it lags, since when)
        self._mine_acked: dict[str, int] = {}  # peer -> how many of our slots it acknowledged
        self._ack_round = -1  # round of the earliest data slot received and not yet acknowledged
        self.holes = Holes()  # slots senders announced that have not arrived (kdsync.core.holes)
        self.vc.reset_view()

    # ------------------------------------------------------------- inputs
    def submit(self, batches: Iterable[Batch]) -> None:
        self.pending.extend(self._own_batches(batches))

    def receive(self, sender: str, data: bytes) -> None:
        try:
            self._dispatch(self.codec.decode(data, sender))
        except RemoteProtocolError:
            self.stats["bad_messages"] += 1
            raise
        if self._ahead:  # the view they were held for may be installed now (peers.py)
            self._replay_ahead()

    # ------------------------------------------------------------- stream
    def _on_append(self, msg: Append) -> None:
        if not self._in_current_view(msg):
            return
        s = msg.sender
        self._on_ack_vector(s, msg.recv)
        if self.wedged or s not in self.view.senders:
            return
        k = self.view.senders.index(s)
        grew, data_round = self.stream.add(k, msg.first, msg.slots)
        self._note_hole(k, msg.first + len(msg.slots))
        if msg.slots and not grew:
            self.acked_sent[s] = None  # a retransmission: our acknowledgement was lost, the next heartbeat repeats it
        if grew:
            if data_round >= 0 and (self._ack_round < 0 or data_round < self._ack_round):
                self._ack_round = data_round
            self._try_deliver()

    def _on_ack_vector(self, s: str, recv) -> None:
        if self._merge_ack_vector(s, recv) and not self.wedged:
            self._try_deliver()

    def _merge_ack_vector(self, s: str, recv) -> bool:
        """A peer's received vector, merged; True when a count grew (the caller tries to deliver)."""
        st = self.stream
        if len(recv) != st.n:
            raise RemoteProtocolError("received vector of the wrong length")
        if s not in st.acks or not st.ack(s, recv):
            return False
        k = st.my_k
        if k >= 0 and recv[k] > self._mine_acked.get(s, -1):
            self._mine_acked[s] = recv[k]
            self.ack_progress[s] = self.now
        return True

    def _on_ack(self, msg: Ack) -> None:
        if self._in_current_view(msg):
            senders = self.view.senders
            if not self.wedged and msg.sender in senders and len(msg.recv) == len(senders):
                k = senders.index(msg.sender)
                self._note_hole(k, msg.recv[k])  # the sender's own count: what it has cut
            self._take_ack(msg)

    def _take_ack(self, msg) -> None:
        """An ACK of the current view: acknowledgements, ballot round, suspicions."""
        self.vc.heard_round(msg.round, msg.wedged)
        self._on_ack_vector(msg.sender, msg.recv)
        if (msg.suspected or msg.wedged) and msg.sender not in self.suspected and not self.wedged:
            new = {m for m in msg.suspected if m in self.view.members and m != self.me} - self.suspected
            if new:
                self._suspect(new)
            else:
                self._wedge()  # someone suspects us: this view is over, go and form the next

    def _suspect(self, who: set[str]) -> None:
        who = who - self.suspected
        if not who:
            return
        self.suspected |= who
        self._wedge()
        for p in self.vc.live():
            if p != self.me:
                self._send_ack(p)

    def _try_deliver(self) -> None:
        if self.wedged or not self._caught_up():
            return
        slots = self.stream.deliverable()
        if slots:
            self._deliver(slots[0] if len(slots) == 1 else [b for s in slots for b in s])

    # ------------------------------------------------------------- ticks
    def tick(self) -> None:
        super().tick()
        if self._ahead:
            self._replay_ahead()
        now, cfg, state = self.now, self.cfg, self.state
        if self.leaving:  # nothing but the Leave until the group took note of it
            if not self.left and now - self._leave_sent >= cfg.retransmit_ticks:
                self._send_leave()
            return
        if state in (State.JOINING, State.REJOINING) and now - self.vc.join_sent >= cfg.retransmit_ticks * 4:
            self.vc.send_join()
        if state is State.JOINING:
            return
        v = self.view
        member = self._is_member()
        if member:
            # failure suspicion
            silent = {m for m in v.members if m != self.me and now - self.last_heard[m] > cfg.suspect_ticks}
            silent |= self.departed.difference(self.vc.rejoined)  # a new incarnation of a leaver votes again
            if self.silenced:
                silent |= self.silenced.intersection(v.members).difference((self.me,))
            if state is not State.ACTIVE and state is not State.CATCHING_UP:
                # the view is over anyway: suspicion is just a timeout, not sticky, so
                # members that hear each other again after a partition heals can form
                # the next view together
                if silent != self.suspected:
                    self.suspected = silent
                    if self.vc.round is not None and self.vc.leader() != self.me:
                        self.vc.round = None
            elif silent - self.suspected:
                self._suspect(silent - self.suspected)
            # heartbeats: they also carry the acknowledgements of nulls.  In a
            # view change nothing is acknowledged: when the member's liveness
            # tells us who is alive (`heard`), they only let a peer in a newer
            # view answer with it, and go out once per suspect interval (a
            # member forming hundreds of groups at once is not flooded)
            slow = cfg.suspect_ticks if self._heard_shared and state is not State.ACTIVE \
                and state is not State.CATCHING_UP else cfg.heartbeat_ticks
            for p in v.members:
                if p == self.me:
                    continue
                # suspected peers still hear from us, slowly: a newer view there answers with it
                every = cfg.heartbeat_ticks * 4 if p in self.suspected else slow
                if now - self.last_sent[p] >= every:
                    self._send_ack(p)
        if member and not self.wedged:
            self._nudge_lagging()
            if self.holes.open:
                self._ask_holes()
        # retransmit own slots to lagging peers
        st = self.stream
        if (not self.wedged or self._lift_on) and st.my_k >= 0:  # (taken back in place: kdsync.core.lift)
            k = st.my_k
            for p, acks in st.acks.items():
                if p in self.suspected:
                    continue
                have = acks[k]
                # a null is acknowledged with the next heartbeat: give it that long too
                if have < st.cut_upto and now - self.ack_progress[p] >= cfg.retransmit_ticks + cfg.heartbeat_ticks:
                    self.ack_progress[p] = now
                    self._send_slots(p, have, have + 64)
        self.catchup.tick(now, cfg.retransmit_ticks * 2)
        if member:
            if self.wedged:
                self.vc.step()
            else:
                self._minority = False
                if self.vc.joiners and self.vc.wanted_joiners() and self.vc.leader() == self.me:  # cheap test first
                    self._wedge()
                    self.vc.start_collect()

    def quiet(self) -> bool:
        """Until new input arrives, a tick here only counts time for
        heartbeats and failure suspicion: active, nothing pending, every own
        slot acknowledged by every peer (nothing to retransmit), everything
        received acknowledged to every peer, no suspect, no catch-up, no view
        change or joiner in sight.  A driver may then run its ticks late, in
        pairs (see NodeBase.quiet)."""
        if (self.state is not State.ACTIVE or self.pending or self.suspected or self.target is not None
                or self._ack_round >= 0 or self.vc.round is not None or self.holes.open or self.has_ready()):
            return False
        st = self.stream
        k = st.my_k
        if k >= 0:
            upto = st.cut_upto
            for acks in st.acks.values():
                if acks[k] < upto:
                    return False
        cur = tuple(st.received)
        me = self.me
        for p in self.view.members:
            if p != me and self.acked_sent.get(p) != cur:
                return False
        for acks in st.acks.values():  # a peer has not acknowledged what we hold: we wait for it (Nudge)
            if any(a < c for a, c in zip(acks, cur)):
                return False
        return not self.vc.joiners or not self.vc.wanted_joiners()

    # -------------------------------------------------------------- output
    def _before_ready(self) -> None:
        st = self.stream
        if st.my_k >= 0 and not self.wedged and (st.must_fill() or (self.pending and st.may_open(self.cfg.window))):
            first, slots = st.cut(self.pending, self.cfg.window, self.cfg.max_batch)
            cur = tuple(st.received)
            self._multicast_slots(first, cur, self._slots_message(first, slots, cur))
            self._ack_round = -1  # that vector acknowledges every data slot received so far
            self._try_deliver()
        if self._ack_round >= 0 and min(st.received, default=0) > self._ack_round:
            # acknowledge data once its round is complete here: one vector then
            # covers the whole round (with many senders, one message instead of one
            # per slot); a round that stays incomplete is acknowledged at the tick
            self._flush_urgent_acks()

    def has_ready(self) -> bool:
        if super().has_ready() or (self._ack_round >= 0 and min(self.stream.received, default=0) > self._ack_round):
            return True
        st = self.stream
        if st.my_k < 0 or self.wedged:
            return False
        return st.must_fill() or (bool(self.pending) and st.may_open(self.cfg.window))

    def _hard_state(self) -> HardState:
        in_view = self._caught_up() and self.state is not State.JOINING
        return HardState(
            incarnation=self.incarnation,
            view_id=self.view.view_id if in_view else self.hard.view_id,
            members=self.view.members if in_view else self.hard.members,
            promised=self.vc.promised,
            accepted=encode_vote(*self.vc.accepted) if self.vc.accepted else b"",
        )

    def ready(self):
        rd = super().ready()
        if rd.hard_state is not None:
            self.hard = rd.hard_state
        return rd


_ = NO_BALLOT  # re-exported for tests that build reports by hand
