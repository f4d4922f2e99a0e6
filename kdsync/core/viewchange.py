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

Three shortcuts save time without changing what is chosen.  A
member that wedges on its own (a suspicion, a leave, a peer's wedge) reports
at once to the leader it sees, for the ballot that leader would start next
(`on_wedged`); the leader starts its round at that ballot when it never used
it, and the reports it holds count (`eager`).  Every voter sends ACCEPTED to
every member, and a voter installs once a majority voted for its ballot
(`learn`) — the leader's own vote included: it sends its ACCEPTED with its
ACCEPT when it voted (an older release sends none, and its voters wait as
before); the leader's INSTALL still goes to everyone.  Members so install
at different instants: a message of the next view is held until it
is installed here (kdsync.core.peers, `_hold_ahead`).

The leader's round lives in kdsync.core.leading (`Leading`, a mixin of
ViewChange); the joining rules in kdsync.core.joining.

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
cluster ever showed them.  A member the leader suspects is asked too when
its report is missing; one that answers is alive and taken into the new
view as a joiner is (leading.py `new_proposal`).

Liveness of the ballots: a member refusing a COLLECT or ACCEPT below its
promise answers with its report for the ballot it promised (`refuse`), and
no round the leader picks is at or below one another member is known to
use (`taken_round`; leading.py `start_collect`).

A restarted member (new incarnation, amnesiac) or an excluded one sends
JOIN; the leader wedges its view and takes it in with the next view change
(kdsync.core.joining: JOIN, and the HINT that helps a member of an older
view forward).
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
    Install,
    Proposal,
    Report,
    pack,
    unpack_raw,
)
from kdsync.core.joining import Joining
from kdsync.core.leading import NO_BALLOT, Ballot, LeaderRound, Leading
from kdsync.core.types import LocalProtocolError, RemoteProtocolError, View


MAX_PATIENCE = 8  # a view change's rounds wait at most 8x suspect_ticks (ViewChange.step)


class ViewChange(Leading, Joining):
    """The view change of one DerechoNode (module docstring): the Paxos state
    (promise, vote, highest round seen, the round this member leads), the
    joiners waiting, the INSTALLs seen, and the handlers of the view-change
    messages on both sides.

    The node owns one (`node.vc`) and hands it the messages and its tick when
    wedged.  This object reads the node's view, suspicions and stream, sends
    through it, and moves it between states through its `_become_*` doors (the
    node's TRANSITIONS table).  A protocol with another trim rule subclasses it
    (kdsync.core.clock's ClockViewChange)."""

    def __init__(self, node, promised: Ballot, accepted: tuple[Ballot, Proposal] | None) -> None:
        self.n = node
        self.promised: Ballot = promised
        self.accepted = accepted  # (ballot, proposal): the vote, persisted until a newer one replaces it
        self.max_round = promised[0]
        # the highest round another leader is known to have used (its COLLECT or ACCEPT came, or a refusal
        # named its ballot): a round heard of only through acknowledgements may be one offered to us
        # (leading.py `start_collect`), never one of these
        self.taken_round = 0
        # the highest round heard of but from the acknowledgements of wedged peers: an early
        # report's ballot (on_wedged) is chosen from it, so that members wedging one after
        # another offer the same ballot (a wedged peer's round may be its own early offer)
        self.awake_round = promised[0]
        self.joiners: dict[str, tuple[int, int, int]] = {}  # id -> (incarnation, durable, next)
        self.join_wedged: dict[str, int] = {}  # joiner -> the incarnation whose first JOIN wedged us (joining.py)
        self.last_install: dict[int, bytes] = {}  # old view id -> the INSTALL message we saw
        self.hint_sent: dict[str, int] = {}  # peer -> tick of the last helping reply
        self.join_sent = -10**9
        self.reset_view()

    def heard_round(self, rnd: int, wedged: bool) -> None:
        """A peer's acknowledgement named its promised round (`wedged`: made wedged)."""
        if rnd > self.max_round:
            self.max_round = rnd
        if not wedged and rnd > self.awake_round:
            self.awake_round = rnd

    def reset_view(self) -> None:
        """A new view: no round led, nobody unresponsive or restarted in it."""
        self.unresponsive: set[str] = set()  # heard from, but not answering our COLLECT
        self.rejoined: dict[str, int] = {}  # view member -> its new incarnation
        self.round: LeaderRound | None = None  # the round this member leads
        self.patience = 1  # x the round's timeouts: doubles with each round that timed out in this view
        self.round_seen = False  # a COLLECT or ACCEPT of this view came: no report of our own ballot choice
        self.eager_sent = False  # our own report went to the leader on wedging (on_wedged)
        self.eager: dict[str, Report] = {}  # leader side: reports that came before our round (member -> report)
        self.learned: dict[Ballot, set[str]] = {}  # ballot -> members that sent ACCEPTED for it in this view
        # our delivered prefix's end in our first report of this view (None: none sent): catch-up delivers
        # nothing past it until the next view is installed, since a leader may start that view there
        self.reported_next: int | None = None

    def report(self, b: Ballot) -> Report:
        """Our report for ballot `b` of the current view's change.  From now on
        in this view our delivered prefix must not grow past its `next`
        (`reported_next`; kdsync.core.catchup: a leader that found no holder
        of the view's data starts the next view at the highest `next`
        reported, and positions we delivered past ours would be given other
        records — swarm clock seed 9040162)."""
        n = self.n
        if self.reported_next is None:
            self.reported_next = n.next_seq
        acc_b, acc = self.accepted_here()
        return Report(n.me, n.incarnation, n.view.view_id, b, n._holds_view_data(),
                      tuple(n.stream.received), n.durable_seq, n.next_seq, acc_b, acc)

    # ------------------------------------------------------------ leadership
    def leader(self) -> str | None:
        return next((m for m in self.n.view.members if self.may_lead(m)), None)

    def may_lead(self, m: str) -> bool:
        """A restarted member votes but does not lead: it holds no data and
        waits to be taken back; nor does one that stopped for good (fenced: clock)."""
        n = self.n
        return m not in n.suspected and m not in self.unresponsive and m not in self.rejoined and m not in n.fenced

    def live(self) -> list[str]:
        n = self.n
        return [m for m in n.view.members if m not in n.suspected and m not in self.unresponsive]

    def majority(self, count: int) -> bool:
        return 2 * count > len(self.n.view.members)

    def promise(self, b: Ballot) -> bool:
        n = self.n
        if b >= self.promised:
            if b != self.promised:
                self.promised = b
                n._hard_dirty = True
            return True
        return False

    def accepted_here(self) -> tuple[Ballot, Proposal | None]:
        """The vote cast in *this* view's instance, if any (see module docstring)."""
        n = self.n
        if self.accepted and self.accepted[1].old_view == n.view.view_id:
            return self.accepted
        return NO_BALLOT, None

    def step(self) -> None:
        """Tick work of a wedged member: lead the view change when it is its turn."""
        n = self.n
        live = self.live()
        if self.unresponsive and not self.majority(len(live)):
            self.unresponsive.clear()  # they may answer a higher ballot
            live = self.live()
        n._minority = not self.majority(len(live))
        lead = self.leader()
        lr = self.round
        now = n.now
        cfg = n.cfg
        # a round that timed out may only have been slow (a member busy forming
        # hundreds of groups answers late): each one in this view waits twice
        # as long, and retransmissions within a round back off up to
        # suspect_ticks, so the load does not grow while answers are late
        wait = cfg.suspect_ticks * self.patience
        if lead == n.me and lr is not None and lr.phase == LeaderRound.COLLECT and now - lr.started >= wait:
            # heard from but not reporting (an asymmetric link): leave them out
            self.unresponsive |= {m for m in live if m not in lr.reports}
            live = self.live()
        if lead == n.me and self.majority(len(live)):
            if lr is None or now - lr.started >= wait * 2:
                if lr is not None:
                    self.patience = min(self.patience * 2, MAX_PATIENCE)
                self.start_collect()  # first attempt, or a higher ballot may be blocking us
            elif now - lr.sent >= (lr.gap or cfg.retransmit_ticks):
                lr.gap = min(2 * (lr.gap or cfg.retransmit_ticks), max(cfg.suspect_ticks, cfg.retransmit_ticks))
                self.broadcast()
            # the reports may be complete without a new one: a member left or was
            # suspected since the last report, or every report came early (on_wedged)
            self.leader_progress()
        elif lr is not None:
            self.round = None

    def wanted_joiners(self) -> bool:
        n = self.n
        v = n.view
        for m, (inc, _, _) in self.joiners.items():
            if m not in v.members or v.incarnations[v.members.index(m)] != inc:
                return True
        return False

    def on_accepted(self, msg: Accepted) -> None:
        n = self.n
        if msg.view != n.view.view_id or msg.sender not in n.view.members:
            return
        lr = self.round
        if lr is not None and lr.phase == LeaderRound.ACCEPT and msg.ballot == lr.ballot:
            lr.accepts.add(msg.sender)
            self.leader_accept_progress()
            return
        self.learned.setdefault(msg.ballot, set()).add(msg.sender)
        self.learn(msg.ballot)

    def learn(self, b: Ballot) -> None:
        """An acceptor that voted for ballot `b` of this view installs the
        proposal once a majority of the view voted for `b`: a value accepted
        by a majority at one ballot is chosen (every vote at `b` is for the
        one proposal its leader made)."""
        n = self.n
        if n.state is not n.State.WEDGED or self.round is not None:
            return  # a leader learns from its own round; others wait for the INSTALL
        acc = self.accepted
        if acc is None or acc[0] != b or acc[1].old_view != n.view.view_id:
            return
        votes = self.learned.get(b, set()) | {n.me}
        if not self.majority(len(votes & set(n.view.members))):
            return
        prop = acc[1]
        self.last_install[prop.old_view] = Install(n.me, n.incarnation, prop.old_view, prop).encode()
        self.install(prop)

    # ------------------------------------------------------- acceptor side
    def on_wedged(self) -> None:
        """This member just wedged on its own (a suspicion, a peer's wedge, a
        leave): report at once to the leader it sees, for the ballot that
        leader would start next, as if its COLLECT had arrived this instant,
        instead of waiting a round trip for it.  Paxos does not care who
        chose the ballot: the promise is ours and on disk before the report
        leaves (the Ready contract), and the leader uses a ballot of its own
        only once.  A leader whose round differs asks again (COLLECT): the
        report is an offer, never needed.  The round offered is above
        `awake_round`, so that members wedging one after another offer the
        same ballot (the first ones' early promises reach the later ones in
        their acknowledgements, marked wedged)."""
        n = self.n
        if self.eager_sent or self.round_seen or getattr(n, "leaving", False) or not n._is_member():
            return
        lead = self.leader()
        if lead is None or lead == n.me:
            return
        self.eager_sent = True
        b = (max(self.awake_round, self.promised[0]) + 1, n.rank_of[lead])
        if not self.promise(b):
            return
        n._send(lead, self.report(b).encode())

    def of_this_view(self, msg: Collect | Accept) -> bool:
        """A leader's message about the current view from one of its members
        (a leader of an older view is told of the current one)."""
        n = self.n
        if msg.view < n.view.view_id:
            self.stale_reply(msg.sender, msg.view)
            return False
        return msg.view == n.view.view_id and msg.sender in n.view.members

    def taken(self, b: Ballot) -> None:
        """Ballot `b` is another member's: its round is not ours to take."""
        if b[1] != self.n.rank_of.get(self.n.me) and b[0] > self.taken_round:
            self.taken_round = b[0]

    def on_collect(self, msg: Collect) -> None:
        n = self.n
        self.taken(msg.ballot)
        if not self.of_this_view(msg):
            return
        s = msg.sender
        n.last_heard[s] = n.now
        b = msg.ballot
        self.max_round = max(self.max_round, b[0])
        self.awake_round = max(self.awake_round, b[0])
        if not self.promise(b):
            self.refuse(s)
            return
        self.round_seen = True
        n._wedge()
        # joining members report too: no data, but a vote
        n._send(s, self.report(b).encode())

    def refuse(self, leader: str) -> None:
        """`leader`'s COLLECT or ACCEPT is below our promise: send it our report
        for the ballot we promised, so that its next round starts above that
        one (leading.py `on_report`).  Without it a leader that never hears
        our round (we are restarting and send no acknowledgements; it was
        paused while the others ran rounds) climbs one round per timed-out
        attempt: swarm clock seed 9304842 took fifteen attempts, 12 s.  The
        report is a promise we made already; a leader of another rank keeps
        none of it but the round."""
        if self.promised[0] > 0:
            self.n._send(leader, self.report(self.promised).encode())

    def on_accept(self, msg: Accept) -> None:
        n = self.n
        self.taken(msg.ballot)
        if not self.of_this_view(msg):
            return
        v = n.view
        s = msg.sender
        if msg.proposal.old_view != msg.view:
            raise RemoteProtocolError("proposal for another view")
        b = msg.ballot
        if b < self.promised:
            self.refuse(s)
            return
        self.round_seen = True
        n._wedge()
        self.promise(b)
        self.accepted = (b, msg.proposal)
        n._hard_dirty = True
        # the vote goes to every member, not only the leader: each learns
        # the choice from a majority of votes (on_accepted) half a round
        # trip before the leader's INSTALL would reach it
        data = Accepted(n.me, n.incarnation, v.view_id, b).encode()
        for m in v.members:
            if m == s or (m != n.me and m not in n.suspected):  # the leader always, even when suspected
                n._send(m, data)
        self.learn(b)

    def on_install(self, msg: Install) -> None:
        n = self.n
        prop = msg.proposal
        old = msg.old_view
        if prop.old_view != old:
            raise RemoteProtocolError("install names two views")
        # a joining member knows its view only by a HINT (which may not say its
        # incarnation): the INSTALL that created that view tells whether it is in it
        joining_this = n.state is n.State.JOINING and old == n.view.view_id - 1
        if old < n.view.view_id and not joining_this:
            return
        self.last_install[old] = Install(n.me, n.incarnation, old, prop).encode()
        for stale in [x for x in self.last_install if x < old - 16]:
            del self.last_install[stale]
        self.install(prop)

    # --------------------------------------------------------- installing
    def install(self, prop: Proposal) -> None:
        """Install the chosen next view (see module docstring)."""
        n = self.n
        trimmed = None
        # a base position (nobody held the old view's data when it was chosen)
        # starts the view there: a holder that did not report must not deliver
        # a trim of its own
        if prop.old_view == n.view.view_id and n._holds_view_data() and prop.base_seq < 0:
            trimmed = n.stream.take_trim(prop.trim)
            if trimmed:
                n._deliver([b for s in trimmed for b in s])
        n._resubmit_own()
        # the vote stays until a newer one replaces it: until this view is on
        # disk, the disk must hold the vote that chose it (else a restart could
        # vote for another value of the same instance); once a newer view is,
        # the vote is inert (accepted_here)
        n._hard_dirty = True
        senders = n._senders_of(prop.members)
        if n.me not in prop.members:
            # excluded: ask to be taken in
            n._become_joining(View(prop.new_view, prop.members, prop.incs, senders, n.next_seq))
            return
        if prop.incs[prop.members.index(n.me)] != n.incarnation:
            # the view names an older incarnation of us (it was chosen from a vote
            # cast before we restarted): we are a restarted member of it, as if we
            # had read it from disk.  Joining from outside would wedge the group
            # for good when every process it names is dead (swarm seeds 26, 209)
            n._become_rejoining(View(prop.new_view, prop.members, (0,) * len(prop.members), senders, n.next_seq))
            return
        self.joiners = {m: j for m, j in self.joiners.items() if m not in prop.members}
        if trimmed is not None:
            n._become_active(View(prop.new_view, prop.members, prop.incs, senders, n.next_seq))
        elif prop.base_seq >= 0 and n.next_seq == prop.base_seq:
            n._become_active(View(prop.new_view, prop.members, prop.incs, senders, prop.base_seq))
        else:
            # catch up from the source before delivering anything of the new view
            n._become_catching_up(prop)


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
