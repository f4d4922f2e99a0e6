"""The view change of the derecho node: Paxos over the next view, the ragged
trim, installation, joining.

Theory of operation
-------------------
A peer silent for `suspect_ticks` is suspected; suspicions are gossiped and
wedge the view (see `derecho`).  The lowest-ranked unsuspected member that
is not a restarted incarnation leads a single-decree Paxos over the next
view: COLLECT(ballot) → REPORT (received vector, durable and next position,
any proposal accepted *in this view's instance*) from every unsuspected
member, which must be a strict majority of the view (the minority side
stays wedged: no split brain) → ACCEPT(proposal) → ACCEPTED from a majority
→ INSTALL.  A new leader after a leader failure re-proposes the
highest-ballot proposal any reporter accepted for this view, so at most one
next view is ever installed.  A vote cast in an older view's instance is
decided history once a newer view exists and never enters a later instance
(it would be re-proposed for the wrong view and refused by every acceptor:
swarm seed 102261).

The proposal carries the ragged trim: per sender, the minimum received
count over the reporters that hold the view's data.  Anything delivered
anywhere was stable, hence received by every reporter, hence inside the
trim; members holding the data deliver the trim in round-robin order and
start the new view at the same position.  A member's own batches that fell
past the trim are resubmitted, ahead of newer ones — never dropped.

When no reporter holds the old view's data (first formation, restart after
a total outage, or only restarted and excluded members left) the new view
starts at the highest *next* position any reporter or joiner reports — not
its durable one: a member may have delivered positions it has not yet made
durable, and a new view starting below them would give those positions
other records.  Every member of the old view and every cluster (member
role) of the configuration must report, or have asked to join telling its
position, first: a member excluded earlier can hold durable positions that
no member of the old view made durable, and no durable position may be
reused.  Positions that were ordered but are durable nowhere (held only in
the memory of processes that all died) are given to new records: no
cluster ever showed them.

A restarted member (new incarnation, amnesiac) or an excluded one sends
JOIN; the leader wedges its view and takes it in with the next view change.
A view can name an incarnation that is gone (chosen from a vote cast before
the crash); that member enters it as a restarted member would from disk, so
the group can still change it even when every process it names is dead.

A vote is kept (and persisted) until a newer vote replaces it: until the
view it chose is on disk, the disk must hold the vote, or a restart could
vote for another value of the same instance (two views with one id).
"""

from __future__ import annotations


from kdsync.core.messages import (
    Accept,
    Accepted,
    Collect,
    Hint,
    Install,
    Join,
    Proposal,
    Report,
    pack,
    unpack_raw,
)
from kdsync.core.stream import ragged_trim
from kdsync.core.types import LocalProtocolError, RemoteProtocolError, View

Ballot = tuple[int, int]
NO_BALLOT: Ballot = (0, -1)


class LeaderRound:
    """The leader's side of one ballot: COLLECT, then ACCEPT (exists only while
    this member leads a view change)."""

    __slots__ = ("ballot", "phase", "reports", "accepts", "proposal", "acceptors", "started", "sent")

    COLLECT = "collect"
    ACCEPT = "accept"

    def __init__(self, ballot: Ballot, now: int) -> None:
        self.ballot = ballot
        self.phase = LeaderRound.COLLECT
        self.reports: dict[str, Report] = {}  # member -> its REPORT (ours too), votes of older instances dropped
        self.accepts: set[str] = set()
        self.proposal: Proposal | None = None
        self.acceptors: tuple[str, ...] = ()
        self.started = now
        self.sent = -10**9


class ViewChangePart:
    """Mixin of DerechoNode: the view change (see module docstring)."""

    # ------------------------------------------------------------ leadership
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

    def _promise(self, b: Ballot) -> bool:
        if b >= self.promised:
            if b != self.promised:
                self.promised = b
                self._hard_dirty = True
            return True
        return False

    def _accepted_here(self) -> tuple[Ballot, Proposal | None]:
        """The vote cast in *this* view's instance, if any (see module docstring)."""
        if self.accepted and self.accepted[1].old_view == self.view.view_id:
            return self.accepted
        return NO_BALLOT, None

    def _step_view_change(self) -> None:
        """Tick work of a wedged member: lead the view change when it is its turn."""
        live = self._live()
        if self.unresponsive and not self._majority(len(live)):
            self.unresponsive.clear()  # they may answer a higher ballot
            live = self._live()
        self._minority = not self._majority(len(live))
        lead = self._leader()
        lr = self.lead_round
        now = self.now
        cfg = self.cfg
        if lead == self.me and lr is not None and lr.phase == LeaderRound.COLLECT and now - lr.started >= cfg.suspect_ticks:
            # heard from but not reporting (an asymmetric link): leave them out
            self.unresponsive |= {m for m in live if m not in lr.reports}
            live = self._live()
        if lead == self.me and self._majority(len(live)):
            if lr is None or now - lr.started >= cfg.suspect_ticks * 2:
                self._start_collect()  # first attempt, or a higher ballot may be blocking us
            elif now - lr.sent >= cfg.retransmit_ticks:
                self._vc_broadcast()
        elif lr is not None:
            self.lead_round = None

    def _wanted_joiners(self) -> bool:
        v = self.view
        for m, (inc, _, _) in self.joiners.items():
            if m not in v.members or v.incarnations[v.members.index(m)] != inc:
                return True
        return False

    # --------------------------------------------------------- leader side
    def _start_collect(self) -> None:
        old = self.lead_round
        rnd = max(self.max_round, self.promised[0], old.ballot[0] if old else 0) + 1
        self.max_round = rnd
        lr = self.lead_round = LeaderRound((rnd, self.rank_of[self.me]), self.now)
        self._promise(lr.ballot)
        self.unresponsive.clear()  # everyone gets another chance with each ballot
        self._vc_broadcast()

    def _vc_broadcast(self) -> None:
        lr = self.lead_round
        lr.sent = self.now
        v = self.view
        if lr.phase == LeaderRound.COLLECT:
            for m in self._live():
                if m == self.me:
                    if m not in lr.reports:
                        lr.reports[m] = self._own_report()
                elif m not in lr.reports:
                    self._send(m, Collect(self.me, self.incarnation, v.view_id, lr.ballot).encode())
            self._leader_progress()
        else:
            data = Accept(self.me, self.incarnation, v.view_id, lr.ballot, lr.proposal).encode()
            for m in lr.acceptors:
                if m not in lr.accepts and m != self.me:
                    self._send(m, data)

    def _own_report(self) -> Report:
        acc_b, acc = self._accepted_here()
        return Report(self.me, self.incarnation, self.view.view_id, self.lead_round.ballot, self._holds_view_data(),
                      tuple(self.stream.received), self.durable_seq, self.next_seq, acc_b, acc)

    def _on_report(self, msg: Report) -> None:
        lr = self.lead_round
        v = self.view
        if msg.view != v.view_id or lr is None or lr.phase != LeaderRound.COLLECT:
            return
        if msg.ballot != lr.ballot or msg.sender not in v.members:
            return
        if len(msg.recv) != len(v.senders):
            raise RemoteProtocolError("received vector of the wrong length")
        if msg.accepted is not None and msg.accepted.old_view != v.view_id:  # decided already (see _accepted_here)
            msg = Report(msg.sender, msg.inc, msg.view, msg.ballot, msg.has_data, msg.recv, msg.durable, msg.next,
                         NO_BALLOT, None)
        self.last_heard[msg.sender] = self.now
        self.unresponsive.discard(msg.sender)
        lr.reports[msg.sender] = msg
        self._leader_progress()

    def _leader_progress(self) -> None:
        lr = self.lead_round
        if lr is None or lr.phase != LeaderRound.COLLECT:
            return
        live = self._live()
        if not self._majority(len(live)) or any(m not in lr.reports for m in live):
            return
        reps = {m: lr.reports[m] for m in live}
        best = None
        for r in reps.values():
            if r.accepted is not None and (best is None or r.acc_ballot > best[0]):
                best = (r.acc_ballot, r.accepted)
        if best is not None:
            prop = best[1]
        else:
            prop = self._new_proposal(live, reps)
            if prop is None:
                return
        lr.proposal = prop
        lr.acceptors = tuple(live)
        lr.phase = LeaderRound.ACCEPT
        lr.accepts = set()
        self._accept_local(lr.ballot, prop)
        self._vc_broadcast()
        self._leader_accept_progress()

    def _new_proposal(self, live: list[str], reps: dict[str, Report]) -> Proposal | None:
        """The next view from the reports (see module docstring), or None when
        nobody holds the old view's data and some member of it, or some cluster
        of the configuration, has not reported or asked to join."""
        v = self.view
        holders = self._trim_holders(live, reps)
        if not holders:
            # every durable prefix must be known before a start is chosen: those of
            # the old view's members, and of every cluster, since a member excluded
            # from the old view may hold positions that no member of it made durable
            # (swarm seed 8935: the old view's only cluster never finished catching
            # up; its start was durable only at the excluded member)
            needed = set(v.members) | set(self.sender_ids)
            if any(m not in reps and m not in self.joiners for m in needed):
                return None
        members = sorted(set(live) | set(self.joiners), key=self.rank_of.__getitem__)
        incs = [reps[m].inc if m in reps else self.joiners[m][0] for m in members]
        extra: tuple = ()
        if holders:
            got = self._trim(live, holders, reps)
            if got is None:
                return None  # the leader is still fetching slots of the trim
            trim, extra = got
            # catch-up is served best by a holder with a global topic (a witness
            # holds only what it ordered since its own last catch-up)
            keepers = [m for m in holders if self.cfg.roles.get(m, "member") == "member"] or holders
            source = self.me if self.me in keepers else keepers[0]
            base = -1
        else:
            trim = [0] * len(v.senders)
            # where each member's delivered prefix ends (`next`, not `durable`: see module docstring)
            nexts = {m: reps[m].next for m in live}
            nexts.update({m: j[2] for m, j in self.joiners.items() if m not in nexts})
            base = max(nexts.values())
            source = min((m for m in members if nexts.get(m, -1) == base), key=self.rank_of.__getitem__)
        return Proposal(v.view_id, v.view_id + 1, members, incs, trim, source, base, extra)

    def _trim_holders(self, live: list[str], reps: dict[str, Report]) -> list[str]:
        """The reporters whose data the trim is taken from (none: the new view
        starts at a base position instead)."""
        return [m for m in live if reps[m].has_data]

    def _trim(self, live: list[str], holders: list[str], reps: dict[str, Report]) -> tuple[list[int], tuple] | None:
        """(ragged trim, proposal extras), or None while not known yet.
        Derecho: the element-wise min over the holders (see module docstring)."""
        return ragged_trim(reps[m].recv for m in holders), ()

    def _accept_local(self, b: Ballot, prop: Proposal) -> None:
        if self._promise(b):
            self.accepted = (b, prop)
            self._hard_dirty = True
            lr = self.lead_round
            if lr is not None and lr.phase == LeaderRound.ACCEPT and b == lr.ballot:
                lr.accepts.add(self.me)

    def _on_accepted(self, msg: Accepted) -> None:
        lr = self.lead_round
        if msg.view != self.view.view_id or lr is None or lr.phase != LeaderRound.ACCEPT:
            return
        if msg.ballot == lr.ballot and msg.sender in self.view.members:
            lr.accepts.add(msg.sender)
            self._leader_accept_progress()

    def _leader_accept_progress(self) -> None:
        lr = self.lead_round
        if lr is None or lr.phase != LeaderRound.ACCEPT or not self._majority(len(lr.accepts)):
            return
        prop = lr.proposal
        inst = Install(self.me, self.incarnation, prop.old_view, prop).encode()
        self.last_install[prop.old_view] = inst
        for m in sorted(set(prop.members) | set(lr.acceptors)):
            if m != self.me:
                self._send(m, inst)
        self._install(prop)

    # ------------------------------------------------------- acceptor side
    def _of_this_view(self, msg: Collect | Accept) -> bool:
        """A leader's message about the current view from one of its members
        (a leader of an older view is told of the current one)."""
        if msg.view < self.view.view_id:
            self._stale_reply(msg.sender, msg.view)
            return False
        return msg.view == self.view.view_id and msg.sender in self.view.members

    def _on_collect(self, msg: Collect) -> None:
        if not self._of_this_view(msg):
            return
        v = self.view
        s = msg.sender
        self.last_heard[s] = self.now
        b = msg.ballot
        self.max_round = max(self.max_round, b[0])
        if not self._promise(b):
            return
        self._wedge()
        # joining members report too: no data, but a vote
        acc_b, acc = self._accepted_here()
        self._send(s, Report(self.me, self.incarnation, v.view_id, b, self._holds_view_data(),
                             tuple(self.stream.received), self.durable_seq, self.next_seq, acc_b, acc).encode())

    def _on_accept(self, msg: Accept) -> None:
        if not self._of_this_view(msg):
            return
        v = self.view
        s = msg.sender
        if msg.proposal.old_view != msg.view:
            raise RemoteProtocolError("proposal for another view")
        b = msg.ballot
        if b >= self.promised:
            self._wedge()
            self._promise(b)
            self.accepted = (b, msg.proposal)
            self._hard_dirty = True
            self._send(s, Accepted(self.me, self.incarnation, v.view_id, b).encode())

    def _on_install(self, msg: Install) -> None:
        prop = msg.proposal
        old = msg.old_view
        if prop.old_view != old:
            raise RemoteProtocolError("install names two views")
        # a joining member knows its view only by a HINT (which may not say its
        # incarnation): the INSTALL that created that view tells whether it is in it
        joining_this = self.state is self.State.JOINING and old == self.view.view_id - 1
        if old < self.view.view_id and not joining_this:
            return
        self.last_install[old] = Install(self.me, self.incarnation, old, prop).encode()
        for stale in [x for x in self.last_install if x < old - 16]:
            del self.last_install[stale]
        self._install(prop)

    # --------------------------------------------------------- installing
    def _install(self, prop: Proposal) -> None:
        """Install the chosen next view (see module docstring)."""
        trimmed = None
        # a base position (nobody held the old view's data when it was chosen)
        # starts the view there: a holder that did not report must not deliver
        # a trim of its own
        if prop.old_view == self.view.view_id and self._holds_view_data() and prop.base_seq < 0:
            trimmed = self.stream.take_trim(prop.trim)
            if trimmed:
                self._deliver([b for s in trimmed for b in s])
        self._resubmit_own()
        # the vote stays until a newer one replaces it: until this view is on
        # disk, the disk must hold the vote that chose it (else a restart could
        # vote for another value of the same instance); once a newer view is,
        # the vote is inert (_accepted_here)
        self._hard_dirty = True
        senders = self._senders_of(prop.members)
        if self.me not in prop.members:
            # excluded: ask to be taken in
            self._become_joining(View(prop.new_view, prop.members, prop.incs, senders, self.next_seq))
            return
        if prop.incs[prop.members.index(self.me)] != self.incarnation:
            # the view names an older incarnation of us (it was chosen from a vote
            # cast before we restarted): we are a restarted member of it, as if we
            # had read it from disk.  Joining from outside would wedge the group
            # for good when every process it names is dead (swarm seeds 26, 209)
            self._become_rejoining(View(prop.new_view, prop.members, (0,) * len(prop.members), senders,
                                        self.next_seq))
            return
        self.joiners = {m: j for m, j in self.joiners.items() if m not in prop.members}
        if trimmed is not None:
            self._become_active(View(prop.new_view, prop.members, prop.incs, senders, self.next_seq))
        elif prop.base_seq >= 0 and self.next_seq == prop.base_seq:
            self._become_active(View(prop.new_view, prop.members, prop.incs, senders, prop.base_seq))
        else:
            # catch up from the source before delivering anything of the new view
            self._become_catching_up(prop)

    def _resubmit_own(self) -> None:
        """Own batches in slots not delivered here go back to the front of pending."""
        back = self.stream.undelivered_own()
        if back:
            self.stats["resubmitted"] += sum(b.count for b in back)
            self.pending[:0] = back

    # ------------------------------------------------------------- joining
    def _send_join(self) -> None:
        data = Join(self.me, self.incarnation, self.durable_seq, self.next_seq).encode()
        for p in self.peers:
            self._send(p, data)
        self.join_sent = self.now

    def _on_join(self, msg: Join) -> None:
        s, inc = msg.sender, msg.inc
        v = self.view
        if s in v.members:
            known = v.incarnations[v.members.index(s)]
            if known == inc:
                # already a member with that incarnation, and it does not know it (its
                # INSTALL was lost): send it the one we saw (swarm seed 7691)
                self._stale_reply(s, v.view_id - 1)
                return
            if known != 0 and self._is_member():
                self._suspect({s})  # its previous incarnation is gone
        self.joiners[s] = (inc, msg.durable, msg.next)
        if s in v.members:
            self.rejoined[s] = inc
            self.last_heard[s] = self.now
        if self._is_member() and (self._leader() != self.me or s in v.members):
            # tell it which view it is asking to join; the leader too when the view
            # names it: it does not know it is a member (it restarted from an older
            # view) and would never report, while the view cannot change without it
            # (swarm seeds 2719, 8295: a restarted leader waited for it forever)
            self._stale_reply(s, -1)

    def _stale_reply(self, peer: str, view_id: int) -> None:
        """`peer` speaks of an older view (or asks to join): help it forward."""
        if self.now - self._hint_sent.get(peer, -10**9) < self.cfg.retransmit_ticks:
            return
        self._hint_sent[peer] = self.now
        inst = self.last_install.get(view_id)
        if inst is not None:
            self._send(peer, inst)
        elif self.state in (self.State.ACTIVE, self.State.WEDGED, self.State.REJOINING) and self._is_member():
            # a restarted member knows its view only from disk (incarnations 0:
            # unknown), but that is enough: the peer joins it, and a view whose
            # members all restarted cannot change without every one of them
            # (swarm seed 8310: one member never saw view 1 installed, the others
            # restarted in it, and nobody told it)
            v = self.view
            self._send(peer, Hint(self.me, self.incarnation, v.view_id, v.members, v.incarnations).encode())

    def _on_hint(self, msg: Hint) -> None:
        v = self.view
        state = self.state
        if msg.view < v.view_id:
            return
        members = msg.members
        if self.me in members:
            if msg.incs[members.index(self.me)] == self.incarnation:
                return  # the INSTALL will follow
            if msg.view == v.view_id and state is not self.State.JOINING:
                return
            # a member of that view whose incarnation there is unknown (a HINT from a
            # restarted member) or older: a restarted member of it (swarm seed 2574: as
            # a joiner from outside it never reported, and the view could not change)
            if state is not self.State.JOINING:
                self._resubmit_own()
            self._become_rejoining(View(msg.view, members, (0,) * len(members), self._senders_of(members),
                                        self.next_seq))
            return
        if msg.view == v.view_id:
            return
        if state is not self.State.JOINING:
            self._resubmit_own()
        self._become_joining(View(msg.view, members, msg.incs, self._senders_of(members), -1))


def encode_vote(ballot: Ballot, prop: Proposal) -> bytes:
    """A vote as HardState.accepted stores it."""
    return pack([list(ballot), prop.data])


def decode_vote(data: bytes, member_ids) -> tuple[Ballot, Proposal]:
    """Inverse of encode_vote.  Raises LocalProtocolError (it is our own disk)."""
    try:
        ballot, pdata = unpack_raw(data)
        if type(ballot) is not list or len(ballot) != 2 or not all(type(x) is int for x in ballot):
            raise RemoteProtocolError("bad ballot")
        return (ballot[0], ballot[1]), Proposal.decode(pdata, member_ids)
    except (RemoteProtocolError, TypeError, ValueError):
        raise LocalProtocolError("hard state holds an unreadable accepted proposal") from None
