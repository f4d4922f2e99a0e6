"""Joining, mixed into ViewChange: a restarted (amnesiac) or excluded member
asks to be taken back (JOIN, repeated by the node's tick); a member that
hears JOIN records the joiner for the leader's next view change, wedges
on the first JOIN of that incarnation when the joiner is the one member
missing from the view (its report then reaches the leader without a
COLLECT round trip: ViewChange.on_wedged) and tells the joiner
which view it asks to join; a peer that speaks of an older view
gets the INSTALL of the view after it, or a HINT naming the current one
(`stale_reply`), and a HINT moves its receiver to rejoin or join that view.
Each rule here was forced by a swarm seed named where it applies.  Needs
the view change's `n` (the node), `joiners`, `rejoined`, `hint_sent`,
`join_sent`, `last_install` and `leader()`."""

from __future__ import annotations

from kdsync.core.messages import Hint, Join
from kdsync.core.types import View

__all__ = ["Joining"]


class Joining:
    """The joining duties of a ViewChange (module docstring)."""

    def send_join(self) -> None:
        n = self.n
        if n.leaving or n.lifts_instead():
            return  # a member that left cleanly does not ask to be taken back; one taken back in place need not
        data = Join(n.me, n.incarnation, n.durable_seq, n.next_seq).encode()
        for p in n.peers:
            n._send(p, data)
        self.join_sent = n.now

    def on_join(self, msg: Join) -> None:
        n = self.n
        s, inc = msg.sender, msg.inc
        v = n.view
        if s in v.members:
            known = v.incarnations[v.members.index(s)]
            if known == inc:
                # already a member with that incarnation, and it does not know it (its
                # INSTALL was lost): send it the one we saw (swarm seed 7691)
                self.stale_reply(s, v.view_id - 1)
                return
        self.joiners[s] = (inc, msg.durable, msg.next)  # before the suspicion below: a leader may propose in it
        if s in v.members:
            if known != 0 and n._is_member():
                n._suspect({s})  # its previous incarnation is gone
            self.rejoined[s] = inc
            n.last_heard[s] = n.now
        elif (self.join_wedged.get(s) != inc and n.state is n.State.ACTIVE
              and self.leader() not in (None, n.me) and self._only_absent(s)):
            # the leader takes it in at once (its tick): wedge and report now
            # (on_wedged) rather than a round trip later, on its COLLECT.  Once
            # per joiner incarnation: a leader that never hears it would install
            # a view without it, and the JOIN repeats
            self.join_wedged[s] = inc
            n._wedge()
        if n._is_member() and (self.leader() != n.me or s in v.members):
            # tell it which view it is asking to join; the leader too when the view
            # names it: it does not know it is a member (it restarted from an older
            # view) and would never report, while the view cannot change without it
            # (swarm seeds 2719, 8295: a restarted leader waited for it forever)
            self.stale_reply(s, -1)

    def _only_absent(self, joiner: str) -> bool:
        """Whether `joiner` is the one configured member missing from the view.
        Only then do the others wedge on its JOIN: with two or more away (two
        regions restarting together) the leader, fed early reports, would take
        the first JOIN it hears alone, and the second would cost a second view
        change; the COLLECT's round trip lets the other JOINs arrive first."""
        members = self.n.view.members
        return all(p == joiner or p in members for p in self.n.peers)

    def stale_reply(self, peer: str, view_id: int) -> None:
        """`peer` speaks of an older view (or asks to join): help it forward."""
        n = self.n
        if n.now - self.hint_sent.get(peer, -10**9) < n.cfg.retransmit_ticks:
            return
        self.hint_sent[peer] = n.now
        inst = self.last_install.get(view_id)
        if inst is not None:
            n._send(peer, inst)
        elif n.state in (n.State.ACTIVE, n.State.WEDGED, n.State.REJOINING) and n._is_member():
            # a restarted member knows its view only from disk (incarnations 0:
            # unknown), but that is enough: the peer joins it, and a view whose
            # members all restarted cannot change without every one of them
            # (swarm seed 8310: one member never saw view 1 installed, the others
            # restarted in it, and nobody told it)
            v = n.view
            n._send(peer, Hint(n.me, n.incarnation, v.view_id, v.members, v.incarnations).encode())

    def on_hint(self, msg: Hint) -> None:
        n = self.n
        v = n.view
        state = n.state
        if msg.view < v.view_id:
            return
        # a member of our view answering our JOIN is alive, even while it sends us
        # nothing else (a member that fenced our previous incarnation): a rejoiner
        # that suspected it would lead a view change it cannot finish, and its
        # ballots would keep the true leader's from a majority (swarm seed 8400061)
        n._from_view_member(msg)
        members = msg.members
        if n.me in members:
            if msg.incs[members.index(n.me)] == n.incarnation:
                return  # the INSTALL will follow
            if msg.view == v.view_id and state is not n.State.JOINING:
                return
            # a member of that view whose incarnation there is unknown (a HINT from a
            # restarted member) or older: a restarted member of it (swarm seed 2574: as
            # a joiner from outside it never reported, and the view could not change)
            if state is not n.State.JOINING:
                n._resubmit_own()
            n._become_rejoining(View(msg.view, members, (0,) * len(members), n._senders_of(members), n.next_seq))
            return
        if msg.view == v.view_id:
            return
        if state is not n.State.JOINING:
            n._resubmit_own()
        n._become_joining(View(msg.view, members, msg.incs, n._senders_of(members), -1))
