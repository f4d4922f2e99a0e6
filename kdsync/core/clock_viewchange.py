"""The `clock` protocol's view change (kdsync.core.clock): derecho's Paxos
(kdsync.core.viewchange) with two rules of the trim changed.  A slot may
have been delivered anywhere once a commit quorum held it, so the trim is
the highest received count over the reporters that remember the view, and
the leader puts the slots some holders lack into the proposal, fetching any
it lacks itself first (SlotReq / SlotData); a fenced member (a clean stop,
kdsync.core.fence) does not lead."""

from __future__ import annotations

from kdsync.core.fence import trim_covers
from kdsync.core.messages import Proposal, Report, SlotData, SlotReq
from kdsync.core.types import RemoteProtocolError
from kdsync.core.viewchange import ViewChange

__all__ = ["FETCH_CHUNK", "ClockViewChange"]

FETCH_CHUNK = 64  # slots per SlotReq


class ClockViewChange(ViewChange):
    """The clock protocol's view change: its trim rule (the highest received
    count over the reporters that remember the view, the slots the leader
    lacks fetched first) and the slots a proposal carries (module docstring)."""

    def reset_view(self) -> None:
        super().reset_view()
        self.fetch_sent: dict[tuple[int, int], int] = {}  # (sender index, first) -> tick asked
        self.fetch_stop: dict[tuple[int, int], int] = {}  # (sender index, first) -> the trim it was asked below
        self.late: dict[int, dict[int, object]] = {}  # sender index -> {slot index: slot} that came after we wedged

    def new_proposal(self, live, reps):
        """As derecho's, but a view change that only a fenced member's end
        explains (nobody else suspected, no joiner known here) waits up to a
        retransmit period for its JOIN: it is returning, and the members that
        heard it first wedged on it (kdsync.core.fence); proposing before the
        JOIN arrives would take a second view change to take it in.  A
        leader that does not trust its own count of its slots (told it was
        capped: kdsync.core.crash_fence) may have to catch up to the trim
        instead of delivering it: another holder, trusted if one is, is the
        catch-up source."""
        n = self.n
        if (n.fenced and not self.joiners and n.suspected.issubset(n.fenced)
                and n.now - n.wedged_at < n.cfg.retransmit_ticks):
            return None
        prop = super().new_proposal(live, reps)
        distrusted = n.distrusted_senders()
        if prop is not None and prop.base_seq < 0 and prop.source == n.me and n.stream.my_k in distrusted:
            # (a holder whose own count is distrusted too, the other of two members that capped each other,
            # may have to catch up as well)
            others = [m for m in self.trim_holders(live, reps) if m != n.me and n.cfg.roles.get(m, "member") == "member"]
            others = [m for m in others if m not in {n.view.senders[k] for k in distrusted}] or others
            if others:
                prop = Proposal(prop.old_view, prop.new_view, prop.members, prop.incs, prop.trim,
                                min(others, key=n.rank_of.__getitem__), prop.base_seq, prop.extra)
        return prop

    def may_lead(self, m: str) -> bool:
        """As derecho's, but not a member we capped (kdsync.core.crash_fence)."""
        return super().may_lead(m) and not self.n.refuses_leader(m)

    def of_this_view(self, msg) -> bool:
        """As derecho's, but a member we capped (kdsync.core.crash_fence) does
        not lead us: its COLLECT and ACCEPT are not answered."""
        if not super().of_this_view(msg):
            return False
        if self.n.refuses_leader(msg.sender, msg.inc):
            self.n.refused_leader(msg.sender)
            return False
        return True

    def keep_late(self, k: int, first: int, slots) -> None:
        """Slots of this view that arrived after this member wedged: not
        received (a wedged member counts and acknowledges nothing more), but
        kept, so that a leader whose trim reaches past what it received takes
        them from here instead of fetching them a round trip away (`trim`).
        The slot at an index of one sender in one view is one value, whoever
        sends it."""
        if slots:
            got = self.late.setdefault(k, {})
            for i, slot in enumerate(slots, first):
                got[i] = slot

    def sure(self, live: list[str], reps: dict[str, Report]) -> list[str]:
        """The reporters that remember this view: the incarnation it names
        (0 is unknown: a view read from disk)."""
        n = self.n
        v = n.view
        incs = dict(zip(v.members, v.incarnations))
        return [m for m in live if incs[m] != 0 and reps[m].inc == incs[m]]

    def trim_holders(self, live: list[str], reps: dict[str, Report]) -> list[str]:
        """Holders, when the reporters that remember this view meet every
        commit quorum that may have held a delivered slot (n - q + 1 of them,
        or n - q of the others when they cover every slot a member fenced
        here held: kdsync.core.fence); else none: the base path."""
        n = self.n
        sure = self.sure(live, reps)
        v = n.view
        need = len(v.members) - n._quorum(v) + 1
        if len(sure) < need and not (len(sure) == need - 1 and len(n.fenced) == 1 and sure
                                     and trim_covers(n.fence_recv, [reps[m].recv for m in sure])):
            return []
        for k in n.distrusted_senders():
            if sum(1 for m in sure if m != v.senders[k]) < need:
                return []  # a member capped: its slots are counted from n - q + 1 others (kdsync.core.crash_fence)
        return [m for m in sure if reps[m].has_data]

    def trim(self, live: list[str], holders: list[str], reps: dict[str, Report]):
        """The maximum received count over the reporters that remember the
        view, and the slots from the holders' minimum up to it (fetched first
        when the leader lacks some)."""
        sure = self.sure(live, reps)
        senders = range(len(self.n.view.senders))
        trim = [max(reps[m].recv[k] for m in sure) for k in senders]
        for capped in self.n.distrusted_senders():  # (kdsync.core.crash_fence) its own count of its slots may be
            # past a fence it does not know of; and the others forgot what only it lacked once they fenced it: it
            # catches up instead
            s = self.n.view.senders[capped]
            trim[capped] = max(reps[m].recv[capped] for m in sure if m != s)
            holders = [m for m in holders if m != s] or holders
        low = [min(reps[m].recv[k] for m in holders) for k in senders]
        extra = []
        missing = False
        for k in senders:
            if trim[k] <= low[k]:
                continue
            run = self.n.stream.held_run(k, low[k], trim[k], self.late.get(k))
            if len(run) < trim[k] - low[k]:
                missing = True
                self.fetch(k, low[k] + len(run), trim[k], sure, reps)
            else:
                extra.append((k, low[k], tuple(run)))
        return None if missing else (trim, tuple(extra))

    def fetch(self, k: int, first: int, stop: int, sure: list[str], reps: dict[str, Report]) -> None:
        """Ask a reporter holding sender k's slots first..stop-1 for them
        (at most once per retransmission period)."""
        n = self.n
        key = (k, first)
        if n.now - self.fetch_sent.get(key, -10**9) < n.cfg.retransmit_ticks:
            return
        self.fetch_sent[key] = n.now
        self.fetch_stop[key] = stop
        have = [m for m in sure if m != n.me and reps[m].recv[k] >= stop] or \
               [m for m in sure if m != n.me and reps[m].recv[k] > first]
        if not have:
            return
        to = min(have, key=n.rank_of.__getitem__)
        n._send(to, SlotReq(n.me, n.incarnation, n.view.view_id, k, first, min(stop, first + FETCH_CHUNK)).encode())

    def on_slot_req(self, msg: SlotReq) -> None:
        n = self.n
        v = n.view
        if msg.view != v.view_id or msg.sender not in v.members:
            return
        st = n.stream
        if msg.k >= st.n or msg.stop <= msg.first:
            raise RemoteProtocolError("bad slot request")
        run = st.held_run(msg.k, msg.first, min(msg.stop, msg.first + FETCH_CHUNK))
        if run:
            n._send(msg.sender, SlotData(n.me, n.incarnation, v.view_id, msg.k, msg.first, tuple(run)).encode())

    def on_slot_data(self, msg: SlotData) -> None:
        """Slots this round asked for (`fetch`), counted up to the trim they
        were asked below and no further — also when they fill a hole below
        slots the leader already held past it: the leader's heartbeats carry its
        received vector, and a member still in the old view (a paused one) that
        took a count past the trim for an acknowledgement would deliver slots
        the next view trims away (swarm clock seed 1001180).  Slot data the
        round did not ask for (an answer to a hole asked before this member
        wedged) is dropped."""
        if self.collecting(msg) is None:
            return
        st = self.n.stream
        if msg.k >= st.n:
            raise RemoteProtocolError("slot data names no sender")
        stop = self.fetch_stop.pop((msg.k, msg.first), None)
        if stop is None:
            return
        st.add(msg.k, msg.first, msg.slots[:max(0, stop - msg.first)], limit=stop)
        self.fetch_sent.pop((msg.k, msg.first), None)
        self.leader_progress()

    def install(self, prop) -> None:
        n = self.n
        if prop.extra and prop.base_seq < 0 and prop.old_view == n.view.view_id and n._holds_view_data():
            st = n.stream
            for k, first, slots in prop.extra:
                if k < st.n:
                    st.add(k, first, slots)
        super().install(prop)
