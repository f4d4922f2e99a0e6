"""The leader's side of the view change (kdsync.core.viewchange): one
ballot's round — COLLECT, the REPORTs (those offered early by members that
wedged on their own included), the proposal, ACCEPT, a majority of
ACCEPTED, INSTALL — as a mixin of ViewChange, which holds the Paxos state
(promise, vote, the round this member leads) and the acceptor's side."""

from __future__ import annotations

from kdsync.core.messages import Accept, Accepted, Collect, Install, Proposal, Report
from kdsync.core.stream import ragged_trim
from kdsync.core.types import RemoteProtocolError

Ballot = tuple[int, int]
NO_BALLOT: Ballot = (0, -1)


class LeaderRound:
    """The leader's side of one ballot: COLLECT, then ACCEPT (exists only while
    this member leads a view change)."""

    __slots__ = ("ballot", "phase", "reports", "accepts", "proposal", "acceptors", "started", "sent", "gap", "wanted")

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
        self.gap = 0  # ticks from the last send to the next retransmission (0: retransmit_ticks)
        self.wanted: set[str] = set()  # suspected members whose report the base path waits for (asked too)


class Leading:
    """The leader's side of ViewChange (module docstring): needs its `n`
    (the node), `round`, `eager`, `max_round`, `promised`, `unresponsive`,
    `joiners`, `last_install`, and its `promise`, `live`, `majority`,
    `leader`, `accepted_here`, `install`."""

    def start_collect(self) -> None:
        n = self.n
        old = self.round
        rnd = max(self.max_round, self.taken_round, self.promised[0], old.ballot[0] if old else 0) + 1
        # a ballot of ours that members reported for already (on_wedged),
        # when we never used it (every ballot we used is at most our promise),
        # no round above it was heard of but theirs (their promises raise
        # max_round through their acknowledgements: that one does not count)
        # and no other leader is known to use its round (`taken_round`)
        me = n.rank_of[n.me]
        ahead = [r.ballot[0] for r in self.eager.values()
                 if (r.ballot[0], me) > self.promised and self.taken_round < r.ballot[0] >= self.max_round
                 and (old is None or r.ballot[0] > old.ballot[0])]
        if ahead:
            rnd = max(ahead, key=lambda r: (ahead.count(r), r))
        else:
            # none in hand yet: the round members wedging on their own offer us (on_wedged), when the
            # only rounds above it heard of are wedged peers' promises of it — their reports may be on
            # the way (isolation seed 28 of Region failure waited a second round trip to Oregon).  Not a
            # round another leader is known to use (`taken_round`): our ballot of it would stay below
            # theirs wherever they were promised (swarm clock seed 9300287)
            offer = max(self.awake_round, self.promised[0]) + 1
            if (offer == self.max_round and offer > self.taken_round and (offer, me) > self.promised
                    and (old is None or offer > old.ballot[0])):
                rnd = offer
        self.max_round = max(self.max_round, rnd)
        lr = self.round = LeaderRound((rnd, n.rank_of[n.me]), n.now)
        self.promise(lr.ballot)
        self.unresponsive.clear()  # everyone gets another chance with each ballot
        live = set(self.live())
        for m, r in self.eager.items():
            if r.ballot == lr.ballot and m in live:
                lr.reports[m] = r
        self.broadcast()

    def broadcast(self) -> None:
        n = self.n
        lr = self.round
        lr.sent = n.now
        v = n.view
        if lr.phase == LeaderRound.COLLECT:
            for m in [*self.live(), *sorted(lr.wanted)]:
                if m == n.me:
                    if m not in lr.reports:
                        lr.reports[m] = self.own_report()
                elif m not in lr.reports:
                    n._send(m, Collect(n.me, n.incarnation, v.view_id, lr.ballot).encode())
            self.leader_progress()
        else:
            data = Accept(n.me, n.incarnation, v.view_id, lr.ballot, lr.proposal).encode()
            # our own vote goes with it (ACCEPTED, as every voter's): of five members an acceptor holding
            # it and one more installs (ViewChange.learn), half a round trip to us before our INSTALL.
            # Only when we voted (accept_local, on disk in the same Ready): an ACCEPT alone says nothing
            # of the leader's vote (an older release sends it also after it promised a higher ballot)
            vote = Accepted(n.me, n.incarnation, v.view_id, lr.ballot).encode() if n.me in lr.accepts else None
            for m in lr.acceptors:
                if m not in lr.accepts and m != n.me:
                    n._send(m, data)
                    if vote is not None:
                        n._send(m, vote)

    def own_report(self) -> Report:
        return self.report(self.round.ballot)

    def collecting(self, msg) -> LeaderRound | None:
        """The round this member leads, if it collects reports and `msg`
        speaks of the current view."""
        lr = self.round
        if msg.view != self.n.view.view_id or lr is None or lr.phase != LeaderRound.COLLECT:
            return None
        return lr

    def on_report(self, msg: Report) -> None:
        n = self.n
        v = n.view
        if msg.view != v.view_id or msg.sender not in v.members:
            return
        if len(msg.recv) != len(v.senders):
            raise RemoteProtocolError("received vector of the wrong length")
        if msg.accepted is not None and msg.accepted.old_view != v.view_id:  # decided already (see accepted_here)
            msg = Report(msg.sender, msg.inc, msg.view, msg.ballot, msg.has_data, msg.recv, msg.durable, msg.next,
                         NO_BALLOT, None)
        lr = self.round
        if msg.ballot[1] == n.rank_of[n.me] and (lr is None or msg.ballot > lr.ballot):
            # a member that wedged reported for a ballot of ours we have not
            # started yet (on_wedged): kept for that round; a round of ours
            # below it would be refused by that member, so it starts again
            self.eager[msg.sender] = msg
            if lr is not None and n.wedged and self.leader() == n.me:
                self.start_collect()
            return
        if msg.ballot[1] != n.rank_of[n.me]:
            self.heard_round(msg.ballot[0], True)  # another leader's round, promised: ours must go above it
            self.taken(msg.ballot)
        lr = self.collecting(msg)
        if lr is None or msg.ballot != lr.ballot:
            return
        n.last_heard[msg.sender] = n.now
        self.unresponsive.discard(msg.sender)
        lr.reports[msg.sender] = msg
        self.leader_progress()

    def leader_progress(self) -> None:
        lr = self.round
        if lr is None or lr.phase != LeaderRound.COLLECT:
            return
        live = self.live()
        if not self.majority(len(live)) or any(m not in lr.reports for m in live):
            return
        reps = {m: lr.reports[m] for m in live}
        best = None
        for r in reps.values():
            if r.accepted is not None and (best is None or r.acc_ballot > best[0]):
                best = (r.acc_ballot, r.accepted)
        if best is not None:
            prop = best[1]
        else:
            prop = self.new_proposal(live, reps)
            if prop is None:
                return
        lr.proposal = prop
        lr.acceptors = tuple(live)
        lr.phase = LeaderRound.ACCEPT
        lr.accepts = set()
        lr.gap = 0
        self.accept_local(lr.ballot, prop)
        self.broadcast()
        self.leader_accept_progress()

    def new_proposal(self, live: list[str], reps: dict[str, Report]) -> Proposal | None:
        """The next view from the reports (see module docstring), or None when
        nobody holds the old view's data and some member of it, or some cluster
        of the configuration, has not reported or asked to join."""
        n = self.n
        v = n.view
        holders = self.trim_holders(live, reps)
        if not holders:
            # a suspected member of the view that answered this round's COLLECT is alive: the base path
            # takes it in as it takes a joiner (its report names its incarnation and delivered prefix),
            # where it used to wait for a JOIN that a member nobody excluded never sends (swarm clock
            # seed 9303115: the leader suspected the member whose report it waited for)
            lr = self.round  # the round we lead (None: called outside one, as a unit test does)
            answered = {m: r for m, r in lr.reports.items() if m not in reps} if lr is not None else {}
            reps = {**reps, **answered}
            live = [m for m in v.members if m in reps]
            # every durable prefix must be known before a start is chosen: those of
            # the old view's members, and of every cluster, since a member excluded
            # from the old view may hold positions that no member of it made durable
            # (swarm seed 8935: the old view's only cluster never finished catching
            # up; its start was durable only at the excluded member)
            needed = set(v.members) | set(n.sender_ids)
            missing = {m for m in needed if m not in reps and m not in self.joiners}
            if missing:
                ask = {m for m in missing if m in v.members} - lr.wanted if lr is not None else set()
                if ask:  # suspected members of the view: asked now and with each retransmission (broadcast)
                    lr.wanted |= ask
                    for m in sorted(ask):
                        n._send(m, Collect(n.me, n.incarnation, v.view_id, lr.ballot).encode())
                return None
        members = sorted(set(live) | set(self.joiners), key=n.rank_of.__getitem__)
        incs = [reps[m].inc if m in reps else self.joiners[m][0] for m in members]
        extra: tuple = ()
        if holders:
            got = self.trim(live, holders, reps)
            if got is None:
                return None  # the leader is still fetching slots of the trim
            trim, extra = got
            # catch-up is served best by a holder with a global topic (a witness
            # holds only what it ordered since its own last catch-up)
            keepers = [m for m in holders if n.cfg.roles.get(m, "member") == "member"] or holders
            source = n.me if n.me in keepers else keepers[0]
            base = -1
        else:
            trim = [0] * len(v.senders)
            # where each member's delivered prefix ends (`next`, not `durable`: see module docstring)
            nexts = {m: reps[m].next for m in live}
            nexts.update({m: j[2] for m, j in self.joiners.items() if m not in nexts})
            base = max(nexts.values())
            source = min((m for m in members if nexts.get(m, -1) == base), key=n.rank_of.__getitem__)
        return Proposal(v.view_id, v.view_id + 1, members, incs, trim, source, base, extra)

    def trim_holders(self, live: list[str], reps: dict[str, Report]) -> list[str]:
        """The reporters whose data the trim is taken from (none: the new view
        starts at a base position instead)."""
        return [m for m in live if reps[m].has_data]

    def trim(self, live: list[str], holders: list[str], reps: dict[str, Report]) -> tuple[list[int], tuple] | None:
        """(ragged trim, proposal extras), or None while not known yet.
        Derecho: the element-wise min over the holders (see module docstring)."""
        return ragged_trim(reps[m].recv for m in holders), ()

    def accept_local(self, b: Ballot, prop: Proposal) -> None:
        """The leader votes for its own proposal unless it promised a higher
        ballot meanwhile (persisted in the Ready that sends its ACCEPT, and
        its ACCEPTED goes with the ACCEPT: `broadcast`)."""
        n = self.n
        if self.promise(b):
            self.accepted = (b, prop)
            n._hard_dirty = True
            lr = self.round
            if lr is not None and lr.phase == LeaderRound.ACCEPT and b == lr.ballot:
                lr.accepts.add(n.me)

    def leader_accept_progress(self) -> None:
        n = self.n
        lr = self.round
        if lr is None or lr.phase != LeaderRound.ACCEPT or not self.majority(len(lr.accepts)):
            return
        prop = lr.proposal
        inst = Install(n.me, n.incarnation, prop.old_view, prop).encode()
        self.last_install[prop.old_view] = inst
        for m in sorted(set(prop.members) | set(lr.acceptors)):
            if m != n.me:
                n._send(m, inst)
        self.install(prop)
