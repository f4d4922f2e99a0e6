"""The clock protocol's automatic lead (docs/wan.md "A far member";
docs/design/wan-ordering.md "Region failure", point 3).

Theory of operation
-------------------
A member far from every other one makes everyone wait for its clock reports
(C2): they reach the others its one-way delay late.  A *lead* -- its stamps
and promises run that far ahead of its clock -- takes that back; a lead is a
deliberate clock offset, so any value is safe and a wrong one only costs
latency.  docs/wan.md's rule for it:

    lead(j) = (j's one-way delay to its farthest peer)
              - (the largest one-way delay between two other members)

clamped to [0, 3/4 of j's delay to its nearest peer] (a larger lead would
make j's own stamps arrive "from the future" at its neighbours and pull
their clocks along).

*Measuring* (always, whatever the lead).  A member times its own slots: at
most once per PROBE_EVERY_US of its clock it notes when it cut a slot, and
each peer's first acknowledgement that counts it gives one round-trip
sample to that peer (the peer's acknowledgement delay included: at once for
near slots, within a quarter of their age for far ones); a slot held for a
peer (a far link's gap) is timed to it from when it went (`on_sent`).  The
estimate per peer is the smallest of its last SAMPLES samples (queueing
only adds), and the one-way delay is half of it: the rule needs a delay in
each direction, and a round trip measured on one clock needs no
synchronised clocks.

*Gossip.*  The rule needs the delays between the other members too, so each
member -- also one with a configured lead: the far links' gaps
(kdsync.core.far_links) need every row -- sends its row of one-way
estimates (DELAYS, message type 22) to every peer when it changed by more
than CHANGE_US and CHANGE_FRACTION since it last sent it (and to a view's
new members).  A delay a member's row lacks is taken from the other end's
row (`delays`: links are taken as symmetric).  An older release drops DELAYS
with a log line: a member that has no row from some member of its view
keeps its lead where it is (0 at start), so a mixed group runs as without
leads (and holds nothing).

Everything here is a pure function of the node's inputs (the clock it is
handed, the acknowledgements, the rows): the simulator and the real member
choose the same leads from the same delays.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

__all__ = ["Leads", "rule"]

PROBE_EVERY_US = 100_000  # at most one timed slot per 100 ms of the member's clock
PROBE_GIVE_UP_US = 10_000_000  # a peer that never acknowledges the timed slot: stop waiting for it
SAMPLES = 8  # round-trip samples kept per peer (the estimate is their minimum)
CHANGE_US = 2_000  # a row is sent again once an entry moved by more than this...
CHANGE_FRACTION = 0.05  # ...and by more than this fraction
NEAR_FRACTION = 0.75  # the lead stays below this fraction of the delay to the nearest peer
MIN_STEP_US = 1_000  # the lead moves when the rule's value is this far from it


class Leads:
    """Round trips to peers, the rows peers gossip, and the lead chosen
    from them, for one member (module docstring)."""

    __slots__ = ("me", "rtt", "rows", "lead_us", "_one_way", "_probe", "_waiting", "_probe_at", "_sent", "_dirty",
                 "_members")

    def __init__(self, me: str) -> None:
        self.me = me
        self.rtt: dict[str, deque[int]] = {}  # peer -> recent round-trip samples (us)
        self._one_way: dict[str, int] = {}  # peer -> half the smallest of them (`row`)
        self.rows: dict[str, dict[str, int]] = {}  # member -> its one-way delay estimates to others (us)
        self.lead_us = 0
        self._probe: int | None = None  # own slot index being timed
        self._waiting: dict[str, int | None] = {}  # peers whose acknowledgement of it has not come yet
        self._probe_at = -PROBE_EVERY_US  # when it was cut (the node's clock, us)
        self._sent: dict[str, int] = {}  # the row as last sent
        self._dirty: set[str] = set()  # peers that should get the row although it did not change
        self._members: set[str] = set()  # the previous view's members

    # ------------------------------------------------------------ measuring
    def on_cut(self, first: int, peers: Iterable[str], now_us: int, later: Iterable[str] = ()) -> None:
        """Own slots from index `first` were just cut and multicast to
        `peers`; `later`: peers they go to later (kdsync.core.far_links:
        `on_sent` then times them from when they went)."""
        if self._probe is not None and now_us - self._probe_at < PROBE_GIVE_UP_US:
            return
        if now_us - self._probe_at < PROBE_EVERY_US:
            return
        waiting: dict[str, int | None] = {p: now_us for p in peers}
        waiting.update((p, None) for p in later)
        if waiting:
            self._probe, self._probe_at, self._waiting = first, now_us, waiting

    def on_sent(self, peer: str, start: int, stop: int, now_us: int) -> None:
        """Own slots start..stop-1 went to `peer` now, held back until now."""
        if self._probe is not None and start <= self._probe < stop and self._waiting.get(peer, 0) is None:
            self._waiting[peer] = now_us

    def on_ack(self, peer: str, count: int, now_us: int) -> None:
        """`peer` acknowledged our first `count` slots."""
        if self._probe is None or count <= self._probe or peer not in self._waiting:
            return
        sent = self._waiting.pop(peer)
        sample = now_us - (self._probe_at if sent is None else sent)  # None: a retransmission carried it
        if sample >= 0:
            q = self.rtt.get(peer)
            if q is None:
                q = self.rtt[peer] = deque(maxlen=SAMPLES)
            q.append(sample)
            self._one_way[peer] = min(q) // 2
        if not self._waiting:
            self._probe = None

    def new_view(self, members: Iterable[str]) -> None:
        """A view was installed: a timed slot of the old one is void, and new
        members get our row."""
        self._probe = None
        self._waiting = {}
        members = set(members)
        self._dirty |= members - self._members - {self.me}
        self._members = members

    def row(self) -> dict[str, int]:
        """Own one-way delay estimates (half the smallest recent round trip)."""
        return dict(self._one_way)

    def one_way(self, peer: str) -> int | None:
        """Own one-way delay estimate to `peer` (None: not measured yet)."""
        return self._one_way.get(peer)

    # --------------------------------------------------------------- gossip
    def due(self, peers: Iterable[str]) -> tuple[list[str], dict[str, int]]:
        """The peers our row should go to now, and the row: all of them when
        it moved (CHANGE_US and CHANGE_FRACTION), else the new members."""
        row = self.row()
        if not row:
            return [], row
        peers = list(peers)
        moved = set(row) != set(self._sent) or any(
            abs(v - self._sent[p]) > max(CHANGE_US, CHANGE_FRACTION * self._sent[p]) for p, v in row.items())
        if moved:
            self._sent = row
            self._dirty.clear()
            return peers, row
        to = [p for p in peers if p in self._dirty]
        self._dirty.difference_update(to)
        return to, row

    def on_row(self, sender: str, row: dict[str, int]) -> None:
        """A peer's row of one-way delay estimates."""
        self.rows[sender] = dict(row)

    # -------------------------------------------------------------- the lead
    def delays(self, members: Iterable[str]) -> dict[tuple[str, str], int] | None:
        """The one-way delay between every two of `members` (us), as the
        first measured it, else as the second did (links are taken as
        symmetric); None while one is not known."""
        members = list(members)
        rows = {m: self.rows.get(m) or {} for m in members}
        rows[self.me] = self.row()
        out: dict[tuple[str, str], int] = {}
        for a in members:
            for b in members:
                if a != b:
                    d = rows[a].get(b)
                    if d is None:
                        d = rows[b].get(a)
                        if d is None:
                            return None
                    out[a, b] = d
        return out

    def choose(self, members: Iterable[str]) -> int:
        """The lead for this view's `members` by the rule (module docstring),
        or the current one while a member's row or a delay is not known."""
        members = list(members)
        mine = self.row()
        if self.me not in members or len(members) < 2 \
                or any(k != self.me and (k not in mine or k not in self.rows) for k in members):
            return self.lead_us  # every row is needed, our own to every peer
        delay = self.delays(members)
        if delay is None:
            return self.lead_us
        want = rule(self.me, members, delay)
        if abs(want - self.lead_us) >= MIN_STEP_US:
            self.lead_us = want
        return self.lead_us


def rule(j: str, members: Iterable[str], delay: dict[tuple[str, str], int]) -> int:
    """Member j's lead by the rule (module docstring), from the one-way
    delays between the `members` (`Leads.delays`)."""
    others = [m for m in members if m != j]
    mine = [delay[j, p] for p in others]
    between = max((delay[k, x] for k in others for x in others if x != k), default=0)
    return max(0, min(max(mine) - between, int(NEAR_FRACTION * min(mine))))
