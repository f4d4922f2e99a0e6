"""The `derecho` variant: round-robin total order with view changes.

Theory of operation
-------------------
*Views.*  The group moves through numbered views.  A view lists its members
in configured rank order with the incarnation of each (a restarted process is
a new incarnation), and the senders among them (members whose role is
"member"; witnesses order and vote but send nothing).  Every process starts
wedged, with no data, in the last view it persisted (view 0, "all configured
members", when it has no hard state), so first formation, restart after a
total outage and a single crash all go through the one view-change path.

*Ordering within a view.*  Each sender cuts its pending events into slots
(one slot per `ready()`, at most `max_batch` events; an empty slot is a null).
Slot r of the sender of rank k sits at round-robin position r*n + k.  Every
member keeps `received[k]`, the number of contiguous slots it holds from
sender k, and multicasts that vector piggybacked on its slots or as an ack.
A slot is *stable* when every member of the view has acknowledged it; slots
are delivered strictly in round-robin order as they become stable, so every
member delivers the same sequence.  A sender that falls behind the highest
round any sender reached fills the gap with nulls (its next slot carries data
if it has some); an idle group creates no slots and exchanges only
heartbeats.  Lost slots are retransmitted to the peer whose ack lags.

*Failure and view change.*  A peer silent for `suspect_ticks` is suspected;
suspicions are gossiped with every heartbeat and never withdrawn within a
view.  Suspecting wedges a member: it stops cutting slots, accepting slots and
delivering by stability.  The lowest-ranked unsuspected member leads a
single-decree Paxos over the next view: COLLECT(ballot) → REPORT (received
vector, durable position, any proposal already accepted) from every
unsuspected member, which must be a strict majority of the view (the minority
side stays wedged: no split brain) → ACCEPT(proposal) → ACCEPTED from a
majority → INSTALL.  A new leader after a leader failure re-proposes the
highest-ballot proposal any reporter accepted, so at most one next view is
ever installed.  The proposal carries the ragged trim: for each sender the
minimum received count over the reporters.  Anything delivered anywhere was
stable, hence received by every reporter, hence inside the trim; members
holding the data deliver the trim in round-robin order and start the new view
at the same position.  A member's own events that fell past the trim are
resubmitted (in order, ahead of newer ones) — never dropped.

*Joining and catch-up.*  A restarted member (new incarnation, amnesiac) or
an excluded one sends JOIN; the leader adds it in the next view change.  A
member that cannot deliver the trim itself (joiner, amnesiac, or still
catching up) pulls positions [its next position, view start) from the
proposal's catch-up source — from the source's memory log, or through the
source's adapter (ReadRequest → LogChunk) for positions only its global
topic still holds — before it delivers anything of the new view.  A witness
takes a snapshot (view start + origin watermarks) instead of the events.
When no reporter holds data of the old view (first formation, total restart)
the new view starts at the highest durable position any member reports and
every reporter of the old view must be present (not just a majority), so no
durable position can be reused.

*Exactly once.*  Positions are assigned at delivery by NodeBase._deliver,
which drops any event at or below its origin watermark: a resubmission after
a crash or a trim is delivered once.
"""

from __future__ import annotations

from typing import Iterable

from kdsync.core import codec
from kdsync.core.base import NodeBase
from kdsync.core.codec import decode_events, encode_events, want_int, want_int_list, want_str_list
from kdsync.core.types import Delivery, Event, HardState, LocalProtocolError, LogChunk, ReadRequest, RemoteProtocolError, View

# message type codes
APPEND, ACK, COLLECT, REPORT, ACCEPT, ACCEPTED, INSTALL, JOIN, CATCHUP_REQ, CATCHUP_DATA, SNAPSHOT, HINT = range(1, 13)

Ballot = tuple[int, int]
NO_BALLOT: Ballot = (0, -1)


def ragged_trim(received_vectors) -> list[int]:
    """Per sender, the number of slots every reporter holds (element-wise min)."""
    vecs = list(received_vectors)
    if not vecs:
        raise ValueError("ragged trim of no reports")
    return [min(col) for col in zip(*vecs)]


def stable_counts(received_vectors) -> list[int]:
    """Per sender, how many slots are stable: received by every member (the
    same element-wise min, over the acks of the whole view)."""
    return ragged_trim(received_vectors)


def round_robin(limits, start_round: int = 0, start_k: int = 0):
    """Slots (round, sender index) with round < limits[k], in delivery order,
    starting at (start_round, start_k).  Global slot position = round*n + k."""
    n = len(limits)
    r, k = start_round, start_k
    top = max(limits, default=0)
    while n and r < top:
        if r < limits[k]:
            yield r, k
        k += 1
        if k == n:
            k, r = 0, r + 1


class Proposal:
    """The value a view change agrees on (encoded once, compared by bytes)."""

    __slots__ = ("old_view", "new_view", "members", "incs", "trim", "source", "base_seq", "data")

    def __init__(self, old_view, new_view, members, incs, trim, source, base_seq):
        self.old_view, self.new_view = old_view, new_view
        self.members, self.incs = tuple(members), tuple(incs)
        self.trim, self.source, self.base_seq = tuple(trim), source, base_seq
        self.data = codec.pack([old_view, new_view, list(members), list(incs), list(trim), source, base_seq])

    @classmethod
    def decode(cls, data: bytes, member_ids) -> "Proposal":
        try:
            f = codec._unpackb(data, raw=False)
            old, new, members, incs, trim, source, base = f
        except Exception:
            raise RemoteProtocolError("undecodable proposal") from None
        want_int(old, "old view")
        want_int(new, "new view", old + 1)
        want_str_list(members, "members")
        want_int_list(incs, len(members), "incarnations")
        want_int_list(trim, None, "trim")
        if not members or any(m not in member_ids for m in members) or source not in members:
            raise RemoteProtocolError("proposal names unknown members")
        if type(base) is not int or base < -1:
            raise RemoteProtocolError("bad base position")
        return cls(old, new, members, incs, trim, source, base)


class DerechoNode(NodeBase):
    protocol = "derecho"

    def __init__(self, config, **kw) -> None:
        super().__init__(config, **kw)
        self.rank_of = {m: i for i, m in enumerate(self.members)}
        self.sender_ids = tuple(m for m in self.members if config.roles.get(m, "member") == "member")
        if not self.sender_ids:
            raise LocalProtocolError("a group needs at least one member with role 'member'")
        hs = self.hard
        members = tuple(hs.members) if hs.members else self.members
        self.view = View(hs.view_id, members, (0,) * len(members), self._senders_of(members), self.next_seq)
        self.has_data = False  # holds slots of self.view (false when amnesiac or view 0)
        self.caught_up = True  # next_seq is the right position for this view
        self.wedged = True
        self.promised: Ballot = tuple(hs.promised)  # type: ignore[assignment]
        self.accepted: tuple[Ballot, Proposal] | None = None
        if hs.accepted:
            try:  # [ballot, proposal] as written by _hard_state
                ballot, data = codec._unpackb(hs.accepted, raw=False)
                self.accepted = (_want_ballot(ballot), Proposal.decode(data, self.member_set))
            except Exception:
                raise LocalProtocolError("hard state holds an unreadable accepted proposal") from None
        self.status = "forming"
        self._hard_dirty = True  # the new incarnation
        self._reset_view_state()
        self.pending: list[Event] = []  # own events waiting for a slot
        self.joiners: dict[str, tuple[int, int, int]] = {}  # id -> (incarnation, durable, next)
        self.last_install: dict[int, bytes] = {}  # old view id -> INSTALL message we saw
        self.excluded = False
        # catch-up
        self.target: Proposal | None = None  # view we are catching up to
        self.target_start = -1  # its start position once known
        self.catchup_source: str | None = None
        self.catchup_asked = -10**9
        self.serving: dict[int, list[tuple[str, int]]] = {}  # read start -> [(peer, view)]
        self.view_wm: dict[tuple[str, int], int] = dict(self.watermarks)  # watermarks at view start
        self._hint_sent: dict[str, int] = {}
        self.joined_views = 0
        self.max_round = self.promised[0]
        self.rejoining = kw.get("hard_state") is not None  # a restart: ask to be taken back
        if self.rejoining:
            self._send_join()

    # ------------------------------------------------------------ view state
    def _senders_of(self, members) -> tuple[str, ...]:
        return tuple(m for m in members if self.cfg.roles.get(m, "member") == "member")

    def _reset_view_state(self) -> None:
        v = self.view
        n = len(v.senders)
        self.received = [0] * n
        self.slots: list[dict[int, tuple[Event, ...]]] = [dict() for _ in range(n)]
        self.acks = {m: [0] * n for m in v.members}
        self.ack_progress = {m: self.now for m in v.members}
        self.mine_progress_val: dict[str, int] = {}
        self.last_heard = {m: self.now for m in v.members}
        self.last_sent = {m: -10**9 for m in v.members}
        self.acked_sent = {m: None for m in v.members}
        self.suspected: set[str] = set()
        self.unresponsive: set[str] = set()  # heard from, but not answering our COLLECT
        self.rejoined: dict[str, int] = {}  # view member -> its new incarnation
        self.deliver_round, self.deliver_k = 0, 0
        self.my_k = v.senders.index(self.me) if self.me in v.senders else -1
        self.cut_upto = 0  # own slots multicast
        self._ack_dirty = False
        # view change (leader side)
        self.ballot: Ballot | None = None
        self.phase = ""
        self.reports: dict[str, list] = {}
        self.accepts: set[str] = set()
        self.proposal: Proposal | None = None
        self.vc_sent = -10**9
        self.vc_started = 0

    def _is_member(self) -> bool:
        return self.me in self.view.members and not self.excluded

    def _leader(self) -> str | None:
        for m in self.view.members:
            # a restarted member votes but does not lead: it holds no data and
            # waits to be taken back
            if m not in self.suspected and m not in self.unresponsive and m not in self.rejoined:
                return m
        return None

    def _live(self) -> list[str]:
        return [m for m in self.view.members if m not in self.suspected and m not in self.unresponsive]

    def _majority(self, count: int) -> bool:
        return 2 * count > len(self.view.members)

    # ------------------------------------------------------------------ input
    def submit(self, events: Iterable[Event]) -> None:
        if self.is_witness:
            raise LocalProtocolError("a witness has no source events to submit")
        n0 = len(self.pending)
        self.pending.extend(events)
        self.stats["submitted"] += len(self.pending) - n0

    def receive(self, sender: str, data: bytes) -> None:
        try:
            msg = codec.unpack(data, self.member_set)
            if msg[1] != sender:
                raise RemoteProtocolError(f"message claims to be from {msg[1]!r}, arrived from {sender!r}")
            handler = _HANDLERS.get(msg[0])
            if handler is None:
                raise RemoteProtocolError(f"unknown message type {msg[0]}")
            handler(self, msg)
        except RemoteProtocolError:
            self.stats["bad_messages"] += 1
            raise
        except (TypeError, ValueError, IndexError, KeyError) as exc:
            self.stats["bad_messages"] += 1
            raise RemoteProtocolError(f"malformed message: {exc}") from None

    def _from_view_member(self, msg) -> bool:
        """True when msg comes from the current incarnation of a member of our view."""
        s, inc = msg[1], msg[2]
        v = self.view
        if s not in v.members:
            return False
        known = v.incarnations[v.members.index(s)]
        if known == 0 or known == inc:
            self.last_heard[s] = self.now
            return True
        if self.rejoined.get(s) == inc:
            # a restarted member: alive (it may vote in the view change, with its
            # persisted promises) but it holds none of this view's data
            self.last_heard[s] = self.now
        return False  # another incarnation: a late message of a dead one, or a restart (JOIN handles it)

    def _stale_reply(self, peer: str, view_id: int) -> None:
        """peer speaks of an older view: help it forward."""
        if self.now - self._hint_sent.get(peer, -10**9) < self.cfg.retransmit_ticks:
            return
        self._hint_sent[peer] = self.now
        inst = self.last_install.get(view_id)
        if inst is not None:
            self._send(peer, inst)
        elif self.status in ("active", "wedged") and self.caught_up and self._is_member():
            v = self.view
            self._send(peer, codec.pack((HINT, self.me, self.incarnation, v.view_id, list(v.members), list(v.incarnations))))

    # APPEND: [t, s, inc, view, first, slots, recv]
    def _in_current_view(self, msg) -> bool:
        """msg[3] names our view and comes from the current incarnation of one of
        its members; an older view gets a helping reply instead."""
        view_id = want_int(msg[3], "view")
        if view_id != self.view.view_id:
            if view_id < self.view.view_id:
                self._stale_reply(msg[1], view_id)
            return False
        return self._from_view_member(msg)

    def _on_append(self, msg) -> None:
        if not self._in_current_view(msg):
            return
        s = msg[1]
        self._on_ack_vector(s, msg[6])
        if self.wedged or s not in self.view.senders:
            return
        k = self.view.senders.index(s)
        first = want_int(msg[4], "first slot")
        slots = msg[5]
        if not isinstance(slots, list):
            raise RemoteProtocolError("slots is not an array")
        have = self.received[k]
        store = self.slots[k]
        for j, flat in enumerate(slots):
            idx = first + j
            if idx >= have and idx not in store:
                store[idx] = decode_events(flat)
        while have in store:
            have += 1
        if have > self.received[k]:
            self.received[k] = have
            self._ack_dirty = True
            self._try_deliver()

    def _on_ack_vector(self, s: str, recv) -> None:
        n = len(self.view.senders)
        recv = want_int_list(recv, n, "received vector")
        cur = self.acks[s]
        changed = False
        for k in range(n):
            if recv[k] > cur[k]:
                cur[k] = recv[k]
                changed = True
        if changed:
            if self.my_k >= 0 and recv[self.my_k] > self.mine_progress_val.get(s, -1):
                self.mine_progress_val[s] = recv[self.my_k]
                self.ack_progress[s] = self.now
            if not self.wedged:
                self._try_deliver()

    # ACK: [t, s, inc, view, recv, suspected]
    def _on_ack(self, msg) -> None:
        if not self._in_current_view(msg):
            return
        sus = want_str_list(msg[5], "suspected")
        if len(msg) > 6:
            self.max_round = max(self.max_round, want_int(msg[6], "round"))
        self._on_ack_vector(msg[1], msg[4])
        peer_wedged = len(msg) > 7 and msg[7] is True
        if (sus or peer_wedged) and msg[1] not in self.suspected and self.has_data and not self.wedged:
            new = {m for m in sus if m in self.view.members and m != self.me} - self.suspected
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
        for p in self._live():
            if p != self.me:
                self._send_ack(p)

    def _wedge(self) -> None:
        if not self.wedged:
            self.wedged = True
            if self.status == "active":
                self.status = "wedged"

    # ------------------------------------------------------------- delivery
    def _try_deliver(self) -> None:
        if self.wedged or not self.caught_up or self.target is not None:
            return
        v = self.view
        n = len(v.senders)
        if n == 0:
            return
        live_acks = [self.acks[m] for m in v.members if m != self.me]
        r, k = self.deliver_round, self.deliver_k
        received = self.received
        while True:
            if received[k] <= r:
                break
            if any(a[k] <= r for a in live_acks):
                break
            evs = self.slots[k].pop(r)
            if evs:
                self._deliver(evs)
            k += 1
            if k == n:
                k, r = 0, r + 1
        self.deliver_round, self.deliver_k = r, k

    # ------------------------------------------------------------- view change
    def _promise(self, b: Ballot) -> bool:
        if b >= self.promised:
            if b != self.promised:
                self.promised = b
                self._hard_dirty = True
            return True
        return False

    # COLLECT: [t, s, inc, view, round, rank]
    def _on_collect(self, msg) -> None:
        view_id = want_int(msg[3], "view")
        s = msg[1]
        if view_id < self.view.view_id:
            self._stale_reply(s, view_id)
            return
        if view_id > self.view.view_id or s not in self.view.members:
            return
        self.last_heard[s] = self.now
        b = (want_int(msg[4], "ballot"), want_int(msg[5], "ballot rank"))
        self.max_round = max(self.max_round, b[0])
        if not self._promise(b):
            return
        self._wedge()
        self._send_report(s, b)  # joining members report too: no data, but a vote

    def _accepted_here(self) -> tuple[Ballot, Proposal | None]:
        """The proposal accepted in *this* view's Paxos instance, if any.

        A proposal accepted for an older view (kept in hard state across a
        restart, or while the member learned of a newer view by HINT) belongs
        to an instance that is already decided: a newer view exists.  Carried
        into this view's instance it would be re-proposed for the wrong view
        and refused by every acceptor, wedging the group forever (swarm seed
        102261)."""
        if self.accepted and self.accepted[1].old_view == self.view.view_id:
            return self.accepted
        return NO_BALLOT, None

    def _send_report(self, to: str, b: Ballot) -> None:
        acc_b, acc = self._accepted_here()
        data_ok = self.has_data and self.caught_up and self.target is None
        self._send(
            to,
            codec.pack(
                (
                    REPORT,
                    self.me,
                    self.incarnation,
                    self.view.view_id,
                    b[0],
                    b[1],
                    data_ok,
                    list(self.received),
                    self.durable_seq,
                    self.next_seq,
                    list(acc_b),
                    acc.data if acc else b"",
                )
            ),
        )

    # REPORT: [t, s, inc, view, round, rank, has_data, recv, durable, next, acc_ballot, acc]
    def _on_report(self, msg) -> None:
        if want_int(msg[3], "view") != self.view.view_id or self.phase != "collect":
            return
        b = (want_int(msg[4], "ballot"), want_int(msg[5], "ballot rank"))
        s = msg[1]
        if b != self.ballot or s not in self.view.members:
            return
        recv = want_int_list(msg[7], len(self.view.senders), "received vector")
        acc_b = _want_ballot(msg[10])
        acc = Proposal.decode(msg[11], self.member_set) if msg[11] else None
        if acc is not None and acc.old_view != self.view.view_id:
            acc_b, acc = NO_BALLOT, None  # decided already (see _accepted_here)
        self.last_heard[s] = self.now
        self.unresponsive.discard(s)
        self.reports[s] = [msg[2], bool(msg[6]), recv, want_int(msg[8], "durable"), want_int(msg[9], "next"), tuple(acc_b), acc]
        self._leader_progress()

    def _start_collect(self) -> None:
        rnd = max(self.max_round, self.promised[0], self.ballot[0] if self.ballot else 0) + 1
        self.max_round = rnd
        self.vc_started = self.now
        self.ballot = (rnd, self.rank_of[self.me])
        self._promise(self.ballot)
        self.phase = "collect"
        self.unresponsive.clear()  # everyone gets another chance with each ballot
        self.reports = {}
        self.accepts = set()
        self.proposal = None
        self._vc_broadcast()

    def _vc_broadcast(self) -> None:
        self.vc_sent = self.now
        b = self.ballot
        if self.phase == "collect":
            for m in self._live():
                if m == self.me:
                    if self.me not in self.reports:
                        self.reports[self.me] = self._self_report()
                elif m not in self.reports:
                    self._send(m, codec.pack((COLLECT, self.me, self.incarnation, self.view.view_id, b[0], b[1])))
            self._leader_progress()
        elif self.phase == "accept":
            for m in self.proposal_acceptors:
                if m not in self.accepts and m != self.me:
                    self._send(m, codec.pack((ACCEPT, self.me, self.incarnation, self.view.view_id, b[0], b[1], self.proposal.data)))

    def _self_report(self) -> list:
        acc_b, acc = self._accepted_here()
        data_ok = self.has_data and self.caught_up and self.target is None
        return [self.incarnation, data_ok, list(self.received), self.durable_seq, self.next_seq, acc_b, acc]

    def _leader_progress(self) -> None:
        if self.phase != "collect":
            return
        live = self._live()
        if not self._majority(len(live)):
            return
        if any(m not in self.reports for m in live):
            return
        reps = {m: self.reports[m] for m in live}
        best = None
        for m, r in reps.items():
            if r[6] is not None and (best is None or r[5] > best[0]):
                best = (r[5], r[6])
        if best is not None:
            prop = best[1]
        else:
            holders = [m for m in live if reps[m][1]]
            if not holders and any(m not in reps and m not in self.joiners for m in self.view.members):
                # nobody holds the old view's data: every member of it must report (or
                # have rejoined, telling its position), so no durable position is reused
                return
            members = sorted(set(live) | set(self.joiners), key=self.rank_of.__getitem__)
            incs = [reps[m][0] if m in reps else self.joiners[m][0] for m in members]
            n = len(self.view.senders)
            if holders:
                trim = ragged_trim(reps[m][2] for m in holders)
                source = self.me if self.me in holders else holders[0]
                base = -1
            else:
                trim = [0] * n
                durables = {m: reps[m][4] for m in live}
                durables.update({m: j[2] for m, j in self.joiners.items() if m not in durables})
                top = max(durables.values())
                source = min((m for m in members if durables.get(m, -1) == top), key=self.rank_of.__getitem__)
                base = top
            prop = Proposal(self.view.view_id, self.view.view_id + 1, members, incs, trim, source, base)
        self.proposal = prop
        self.proposal_acceptors = live
        self.phase = "accept"
        self.accepts = set()
        self._accept_local(self.ballot, prop)
        self._vc_broadcast()
        self._leader_accept_progress()

    def _accept_local(self, b: Ballot, prop: Proposal) -> None:
        if self._promise(b):
            self.accepted = (b, prop)
            self._hard_dirty = True
            if self.phase == "accept" and b == self.ballot:
                self.accepts.add(self.me)

    # ACCEPT: [t, s, inc, view, round, rank, proposal]
    def _on_accept(self, msg) -> None:
        view_id = want_int(msg[3], "view")
        s = msg[1]
        if view_id < self.view.view_id:
            self._stale_reply(s, view_id)
            return
        if view_id != self.view.view_id or s not in self.view.members:
            return
        b = (want_int(msg[4], "ballot"), want_int(msg[5], "ballot rank"))
        prop = Proposal.decode(msg[6], self.member_set)
        if prop.old_view != view_id:
            raise RemoteProtocolError("proposal for another view")
        if b >= self.promised:
            self._wedge()
            self._promise(b)
            self.accepted = (b, prop)
            self._hard_dirty = True
            self._send(s, codec.pack((ACCEPTED, self.me, self.incarnation, view_id, b[0], b[1])))

    # ACCEPTED: [t, s, inc, view, round, rank]
    def _on_accepted(self, msg) -> None:
        if want_int(msg[3], "view") != self.view.view_id or self.phase != "accept":
            return
        b = (want_int(msg[4], "ballot"), want_int(msg[5], "ballot rank"))
        if b == self.ballot and msg[1] in self.view.members:
            self.accepts.add(msg[1])
            self._leader_accept_progress()

    def _leader_accept_progress(self) -> None:
        if self.phase != "accept" or not self._majority(len(self.accepts)):
            return
        prop = self.proposal
        inst = codec.pack((INSTALL, self.me, self.incarnation, prop.old_view, prop.data))
        self.last_install[prop.old_view] = inst
        for m in sorted(set(prop.members) | set(self.proposal_acceptors)):
            if m != self.me:
                self._send(m, inst)
        self._install(prop)

    # INSTALL: [t, s, inc, old view, proposal]
    def _on_install(self, msg) -> None:
        old = want_int(msg[3], "view")
        prop = Proposal.decode(msg[4], self.member_set)
        if prop.old_view != old:
            raise RemoteProtocolError("install names two views")
        if old < self.view.view_id:
            return
        self.last_install[old] = codec.pack((INSTALL, self.me, self.incarnation, old, prop.data))
        for stale in [v for v in self.last_install if v < old - 16]:
            del self.last_install[stale]
        if old > self.view.view_id:
            # we missed views in between: we cannot deliver that view's trim
            self.has_data = False
        self._install(prop)

    def _install(self, prop: Proposal) -> None:
        """Install the chosen next view (see module docstring)."""
        old_view = self.view
        i_hold = (
            self.has_data
            and self.caught_up
            and self.target is None
            and old_view.view_id == prop.old_view
            and len(prop.trim) == len(self.received)
            and all(have >= t for have, t in zip(self.received, prop.trim))
        )
        if i_hold:
            self._deliver_trim(prop.trim)
        self._resubmit_own()
        senders = self._senders_of(prop.members)
        if self.me not in prop.members or prop.incs[prop.members.index(self.me)] != self.incarnation:
            # excluded (or a newer incarnation of us is wanted, which cannot be): rejoin
            self.view = View(prop.new_view, prop.members, prop.incs, senders, self.next_seq)
            self._reset_view_state()
            self.excluded = True
            self.has_data = False
            self.status = "joining"
            self.wedged = True
            self.accepted = None
            self._hard_dirty = True
            self._send_join()
            return
        self.excluded = False
        self.accepted = None
        self.joiners = {m: j for m, j in self.joiners.items() if m not in prop.members}
        self._hard_dirty = True
        if i_hold:
            start = self.next_seq
            self._enter_view(prop, start)
        elif prop.base_seq >= 0 and self.next_seq == prop.base_seq:
            self._enter_view(prop, prop.base_seq)
        else:
            # catch up from the source before delivering anything of the new view
            self.view = View(prop.new_view, prop.members, prop.incs, senders, -1)
            self._reset_view_state()
            self.target = prop
            self.target_start = prop.base_seq
            self.catchup_source = prop.source
            self.caught_up = False
            self.has_data = True  # it receives the new view's slots
            self.wedged = False
            self.status = "catching-up"
            self.catchup_asked = -10**9
            self._ask_catchup()

    def _enter_view(self, prop: Proposal, start: int) -> None:
        senders = self._senders_of(prop.members)
        self.view = View(prop.new_view, prop.members, prop.incs, senders, start)
        self._reset_view_state()
        self.target = None
        self.caught_up = True
        self.has_data = True
        self.wedged = False
        self.rejoining = False
        self.status = "active"
        self.view_wm = dict(self.watermarks)
        self._views.append(self.view)
        self.joined_views += 1

    def _deliver_trim(self, trim) -> None:
        n = len(self.view.senders)
        if n == 0:
            return
        for r, k in round_robin(trim, self.deliver_round, self.deliver_k):
            evs = self.slots[k].pop(r, None)
            if evs is None:
                raise LocalProtocolError(f"trim includes slot {r} of {self.view.senders[k]} that this member lacks")
            if evs:
                self._deliver(evs)
        self.deliver_round, self.deliver_k = max(trim, default=0), 0

    def _resubmit_own(self) -> None:
        """Own events in slots not delivered here go back to the front of pending."""
        if self.my_k < 0:
            return
        store = self.slots[self.my_k]
        back: list[Event] = []
        for idx in sorted(store):
            back.extend(store[idx])
        store.clear()
        if back:
            self.stats["resubmitted"] += len(back)
            self.pending[:0] = back

    # ------------------------------------------------------------- joining
    def _send_join(self) -> None:
        data = codec.pack((JOIN, self.me, self.incarnation, self.durable_seq, self.next_seq))
        for p in self.peers:
            self._send(p, data)
        self.vc_sent = self.now

    # JOIN: [t, s, inc, durable, next]
    def _on_join(self, msg) -> None:
        s, inc = msg[1], msg[2]
        durable, nxt = want_int(msg[3], "durable"), want_int(msg[4], "next")
        v = self.view
        if s in v.members:
            known = v.incarnations[v.members.index(s)]
            if known == inc:
                return  # already a member with that incarnation
            if known != 0 and self._is_member():
                self._suspect({s})  # its previous incarnation is gone
        self.joiners[s] = (inc, durable, nxt)
        if s in v.members:
            self.rejoined[s] = inc
            self.last_heard[s] = self.now
        if self._is_member() and self.status == "active" and self._leader() != self.me:
            self._stale_reply(s, -1)

    # HINT: [t, s, inc, view, members, incs]
    def _on_hint(self, msg) -> None:
        view_id = want_int(msg[3], "view")
        members = want_str_list(msg[4], "members")
        incs = want_int_list(msg[5], len(members), "incarnations")
        if view_id <= self.view.view_id and self.status != "joining":
            return
        if view_id < self.view.view_id:
            return
        if self.me in members and incs[members.index(self.me)] == self.incarnation:
            return  # the INSTALL will follow
        if self.status != "joining":
            self._resubmit_own()
            self.view = View(view_id, tuple(members), tuple(incs), self._senders_of(members), -1)
            self._reset_view_state()
            self.excluded = True
            self.has_data = False
            self.status = "joining"
            self.wedged = True
            self._send_join()

    # ------------------------------------------------------------- catch-up
    def _ask_catchup(self) -> None:
        if self.target is None or self.catchup_source is None:
            return
        self.catchup_asked = self.now
        if self.catchup_source == self.me:
            return
        self._send(
            self.catchup_source,
            codec.pack((CATCHUP_REQ, self.me, self.incarnation, self.target.new_view, self.next_seq, self.is_witness)),
        )

    # CATCHUP_REQ: [t, s, inc, view, from, snapshot_ok]
    def _on_catchup_req(self, msg) -> None:
        s = msg[1]
        view_id = want_int(msg[3], "view")
        start = want_int(msg[4], "from")
        if view_id != self.view.view_id or self.target is not None or not self.caught_up or self.status == "joining":
            return
        vstart = self.view.start_seq
        if msg[5] and self.view.start_seq >= 0:
            wm = [[o, p, off] for (o, p), off in sorted(self.view_wm.items())]
            self._send(s, codec.pack((SNAPSHOT, self.me, self.incarnation, view_id, vstart, wm)))
            return
        if start >= vstart:
            self._send(s, codec.pack((CATCHUP_DATA, self.me, self.incarnation, view_id, vstart, [], vstart)))
            return
        evs = self.log_slice(start, vstart, self.cfg.catchup_chunk)
        if evs is None:
            stop = min(vstart, start + self.cfg.catchup_chunk)
            waiting = self.serving.setdefault(start, [])
            if not waiting:
                self._reads.append(ReadRequest(start, min(stop, self.durable_seq)))
            if (s, view_id) not in waiting:
                waiting.append((s, view_id))
            return
        self._send(s, codec.pack((CATCHUP_DATA, self.me, self.incarnation, view_id, start, encode_events(evs), vstart)))

    def _on_log_chunk(self, chunk: LogChunk) -> None:
        waiting = self.serving.pop(chunk.start, [])
        for peer, view_id in waiting:
            self._send(
                peer,
                codec.pack(
                    (CATCHUP_DATA, self.me, self.incarnation, view_id, chunk.start, encode_events(chunk.events), self.view.start_seq)
                ),
            )

    # CATCHUP_DATA: [t, s, inc, view, first, events, view_start]
    def _on_catchup_data(self, msg) -> None:
        if self.target is None or want_int(msg[3], "view") != self.target.new_view:
            return
        first = want_int(msg[4], "first")
        vstart = want_int(msg[6], "view start")
        evs = decode_events(msg[5])
        if first > self.next_seq:
            return
        skip = self.next_seq - first
        evs = evs[skip:] if skip < len(evs) else ()
        if self.next_seq + len(evs) > vstart:
            raise RemoteProtocolError("catch-up data past the view start")
        if evs:
            wm = self.watermarks
            for e in evs:
                k = (e.origin, e.partition)
                if e.offset > wm.get(k, -1):
                    wm[k] = e.offset
            self._emit(Delivery(self.next_seq, tuple(evs), catchup=True))
        if self.next_seq == vstart:
            self._finish_catchup(vstart)
        else:
            self._ask_catchup()

    # SNAPSHOT: [t, s, inc, view, view_start, [[origin, partition, offset]...]]
    def _on_snapshot(self, msg) -> None:
        if self.target is None or want_int(msg[3], "view") != self.target.new_view:
            return
        vstart = want_int(msg[4], "view start")
        wm = {}
        for item in msg[5]:
            if not isinstance(item, list) or len(item) != 3 or type(item[0]) is not str:
                raise RemoteProtocolError("bad snapshot entry")
            wm[(item[0], want_int(item[1], "partition"))] = want_int(item[2], "offset", -1)
        if not self.is_witness:
            return  # members need the events themselves
        self.watermarks = wm
        self.next_seq = self.durable_seq = vstart
        self._log.clear()
        self._log_len = 0
        self._finish_catchup(vstart)

    def _finish_catchup(self, vstart: int) -> None:
        prop = self.target
        keep_slots, keep_recv, keep_acks = self.slots, self.received, self.acks
        keep_heard = self.last_heard
        self.target = None
        self.catchup_source = None
        self.rejoining = False
        v = View(prop.new_view, prop.members, prop.incs, self._senders_of(prop.members), vstart)
        self.view = v
        self.caught_up = True
        self.status = "wedged" if (self.suspected or self.wedged) else "active"
        self.view_wm = dict(self.watermarks)
        self._views.append(v)
        self.joined_views += 1
        # keep what we received of the new view while catching up
        self.slots, self.received, self.acks, self.last_heard = keep_slots, keep_recv, keep_acks, keep_heard
        self._try_deliver()

    # --------------------------------------------------------------- ticks
    def tick(self) -> None:
        super().tick()
        now = self.now
        cfg = self.cfg
        if self.status == "joining" or self.rejoining:
            if now - self.vc_sent >= cfg.retransmit_ticks * 4:
                self._send_join()
            if self.status == "joining":
                return
        v = self.view
        # failure suspicion
        if self._is_member():
            silent = {m for m in v.members if m != self.me and now - self.last_heard[m] > cfg.suspect_ticks}
            if not self.has_data or self.wedged:
                # once wedged (or forming) the view is over anyway: suspicion is just a
                # timeout, not sticky, so members that hear each other again after a
                # partition heals can form the next view together
                if silent != self.suspected:
                    self.suspected = silent
                    if self.phase and self._leader() != self.me:
                        self.phase = ""
            elif silent - self.suspected:
                self._suspect(silent - self.suspected)
        # heartbeats / acks
        if self._is_member():
            for p in v.members:
                if p == self.me:
                    continue
                # suspected peers still hear from us, slowly: a newer view there answers with it
                every = cfg.heartbeat_ticks * (4 if p in self.suspected else 1)
                if now - self.last_sent[p] >= every:
                    self._send_ack(p)
        # retransmit own slots to lagging peers
        if not self.wedged and self.my_k >= 0:
            k = self.my_k
            for p in v.members:
                if p == self.me or p in self.suspected:
                    continue
                have = self.acks[p][k]
                if have < self.cut_upto and now - self.ack_progress[p] >= cfg.retransmit_ticks:
                    self.ack_progress[p] = now
                    self._send_slots(p, have, min(self.cut_upto, have + 64))
        # catch-up
        if self.target is not None and now - self.catchup_asked >= cfg.retransmit_ticks * 2:
            self._ask_catchup()
        # view change
        if self.wedged and self._is_member():
            if self.unresponsive and not self._majority(len(self._live())):
                self.unresponsive.clear()  # they may answer a higher ballot
            lead = self._leader()
            live = self._live()
            if not self._majority(len(live)):
                self.status = "minority"
            elif self.status == "minority":
                self.status = "wedged" if v.view_id > 0 else "forming"
            if lead == self.me and self.phase == "collect" and now - self.vc_started >= cfg.suspect_ticks:
                # heard from but not reporting (an asymmetric link): leave them out
                self.unresponsive |= {m for m in live if m not in self.reports}
                live = self._live()
            if lead == self.me and self._majority(len(live)):
                if self.phase == "" or now - self.vc_started >= cfg.suspect_ticks * 2:
                    self._start_collect()  # first attempt, or a higher ballot may be blocking us
                elif now - self.vc_sent >= cfg.retransmit_ticks:
                    self._vc_broadcast()
            elif self.phase:
                self.phase = ""
        elif not self.wedged and self._leader() == self.me and self._wanted_joiners():
            self._wedge()
            self._start_collect()

    def _wanted_joiners(self) -> bool:
        v = self.view
        for m, (inc, _, _) in self.joiners.items():
            if m not in v.members or v.incarnations[v.members.index(m)] != inc:
                return True
        return False

    def _send_ack(self, p: str) -> None:
        self.last_sent[p] = self.now
        self._send(
            p,
            codec.pack((ACK, self.me, self.incarnation, self.view.view_id, list(self.received), sorted(self.suspected), self.promised[0], self.wedged)),
        )
        self.acked_sent[p] = tuple(self.received)

    def _send_slots(self, p: str, start: int, stop: int) -> None:
        k = self.my_k
        store = self.slots[k]
        slots = []
        for idx in range(start, stop):
            evs = store.get(idx)
            if evs is None:
                break  # delivered everywhere already
            slots.append(encode_events(evs))
        if not slots:
            return
        self.last_sent[p] = self.now
        self.acked_sent[p] = tuple(self.received)
        self._send(p, codec.pack((APPEND, self.me, self.incarnation, self.view.view_id, start, slots, list(self.received))))

    # -------------------------------------------------------------- output
    def _before_ready(self) -> None:
        if self.wedged or self.my_k < 0 or self.status not in ("active", "catching-up"):
            self._flush_acks()
            return
        k = self.my_k
        target = max(self.received)
        count = self.received[k]
        new_first = count
        store = self.slots[k]
        pend = self.pending
        mb = self.cfg.max_batch
        while pend:
            chunk = tuple(pend[:mb])
            del pend[:mb]
            store[count] = chunk
            count += 1
        while count < target:
            store[count] = ()
            count += 1
        if count > new_first:
            self.received[k] = count
            self.cut_upto = count
            slots = [encode_events(store[i]) for i in range(new_first, count)]
            for p in self.view.members:
                if p != self.me and p not in self.suspected:
                    if self.acks[p][k] == new_first:
                        self.ack_progress[p] = self.now
                    self.last_sent[p] = self.now
                    self.acked_sent[p] = tuple(self.received)
                    self._send(p, codec.pack((APPEND, self.me, self.incarnation, self.view.view_id, new_first, slots, list(self.received))))
            self._try_deliver()
        self._flush_acks()

    def _flush_acks(self) -> None:
        self._ack_dirty = False
        if not self._is_member() or self.status in ("joining",):
            return
        cur = tuple(self.received)
        for p in self.view.members:
            if p != self.me and p not in self.suspected and self.acked_sent.get(p) != cur:
                self._send_ack(p)

    def has_ready(self) -> bool:
        if super().has_ready():
            return True
        if self._ack_dirty:
            return True
        if self.my_k < 0 or self.wedged or self.status not in ("active", "catching-up"):
            return False
        return bool(self.pending) or self.received[self.my_k] < max(self.received)

    def _hard_state(self) -> HardState:
        return HardState(
            incarnation=self.incarnation,
            view_id=self.view.view_id if self.caught_up and not self.excluded else self.hard.view_id,
            members=self.view.members if self.caught_up and not self.excluded else self.hard.members,
            promised=self.promised,
            accepted=codec.pack([list(self.accepted[0]), self.accepted[1].data]) if self.accepted else b"",
        )

    def ready(self):
        rd = super().ready()
        if rd.hard_state is not None:
            self.hard = rd.hard_state
        return rd

    def snapshot(self) -> dict:
        return {
            "member": self.me,
            "status": self.status,
            "view": self.view.view_id,
            "members": list(self.view.members),
            "next_seq": self.next_seq,
            "suspected": sorted(self.suspected),
            "received": list(self.received),
            "phase": self.phase,
        }


_HANDLERS = {
    APPEND: DerechoNode._on_append,
    ACK: DerechoNode._on_ack,
    COLLECT: DerechoNode._on_collect,
    REPORT: DerechoNode._on_report,
    ACCEPT: DerechoNode._on_accept,
    ACCEPTED: DerechoNode._on_accepted,
    INSTALL: DerechoNode._on_install,
    JOIN: DerechoNode._on_join,
    CATCHUP_REQ: DerechoNode._on_catchup_req,
    CATCHUP_DATA: DerechoNode._on_catchup_data,
    SNAPSHOT: DerechoNode._on_snapshot,
    HINT: DerechoNode._on_hint,
}


def _want_ballot(v) -> tuple[int, int]:
    if not isinstance(v, list) or len(v) != 2 or type(v[0]) is not int or type(v[1]) is not int or v[0] < 0 or v[1] < -1:
        raise RemoteProtocolError("bad ballot")
    return (v[0], v[1])
