"""Per-peer liveness shared by every ordering node of a member, and the
driver's rule for dormant nodes (docs/design/many-topics.md).

A member runs one ordering node per source topic.  Without this module each
node heartbeats every peer and is ticked every tick, so a member with a
thousand idle topics pays a thousand times for knowing its peers are alive.
With it (CockroachDB's coalesced heartbeats and quiesced ranges, TiKV's
hibernate regions):

* `PeerLiveness` is the member's one failure detector: it counts the
  member's ticks, says when to ping every peer (one frame per peer per
  `heartbeat_ticks`, whatever the number of topics), hears any frame from a
  peer, and says which peers are silent (more than `suspect_ticks`).
* `Dormancy` holds the nodes that sleep.  A node whose `dormant()` is true
  (quiet: a tick could only heartbeat and count silence) is put to sleep:
  the driver neither ticks it nor hears its heartbeats.  Before any input
  reaches a sleeping node (a peer message, a submit, a durable report, a read
  answered), the driver wakes it with `wake(key, node)`: the node's time
  moves on by the ticks it slept and its last-heard time of each peer is
  raised to the member's.  When a peer falls silent, the driver wakes every
  sleeper (`wake_all`): each then suspects the peer at its next tick, within
  `suspect_ticks` as before.  Awake nodes hear the member's liveness too
  (`refresh`), so no node suspects a peer whose node sleeps.
* Silence is judged with a tolerance learned from what the member saw in
  the last `WINDOW_SUSPECTS` suspect intervals (issue 43: a late loop is
  not a silent peer): its own loop running late (`late(ticks)`: the box is
  busy, and its peers share it or are as loaded), and a peer's near misses
  (a gap between two of its pings — one per heartbeat whatever its traffic
  — of more than two heartbeats that ended before the peer was suspected:
  its loop or link runs late).  A peer is silent once unheard for more than
  `suspect_ticks` plus the larger of the two, at most `TOLERANCE_SUSPECTS`
  x `suspect_ticks` more; with nothing late in the window the tolerance is
  0 and a crash is found as before.  Measured on one box running three
  brokers and three members with a thousand topics, a burst into every
  topic stalled loops for 1-1.8 s and made peers look dead (see
  docs/design/many-topics.md).
* Adaptive suspicion (`adaptive`, `[protocol] adaptive_suspect`, issue
  42): `suspect_ticks` becomes the ceiling.  A peer whose pings came
  regularly is silent sooner: once unheard for more than ADAPT_GAPS x the
  longest gap between two of its pings in the window (never less than
  ADAPT_FLOOR_HEARTBEATS heartbeats), plus the member's own lateness.
  Across regions `suspect_ms` must stay above the worst round trip and its
  jitter (3 000 ms in docs/wan.md), yet pings arrive every heartbeat on
  every healthy link: a crashed region is then found in a few heartbeats,
  not in `suspect_ms`.  A link that loses pings or runs late widens its own
  gap, and so its limit, at once; until ADAPT_SAMPLES pings of a peer were
  seen in the window its limit is the ceiling.  Silent peers are handed to
  the awake nodes (`Dormancy.refresh` -> `node.silent`), which suspect
  them as if they had left.
* `ViewDigest` sums up the views of a member's groups in 8 bytes, carried by
  every ping (`Ping`).  While every peer's digest equals the member's, every
  group is in the same view at every member and sleeping nodes need no idle
  heartbeat round (`Dormancy.wake_due` does nothing): an idle member sends
  its pings and nothing else.  A digest that differs (a group changing view,
  a member left in an older view, a topic one member does not have yet)
  brings the idle rounds back until they agree again.

Safety never rests on this: suspicion only starts view changes, which are
safe under any pattern of suspicion.  A node sleeps only when every peer
speaks this protocol (has pinged): a peer of an older version heartbeats
per topic and would suspect a sleeping node.

Pure like the rest of kdsync.core: no clock, no I/O; the member, the
simulator and the in-memory network drive it with ticks and frames.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Iterable

__all__ = ["Dormancy", "PeerLiveness", "Ping", "ViewDigest", "views_of"]


class Ping(bytes):
    """A member-level ping as the in-memory network and the simulator carry
    it: its bytes are the sender's ViewDigest (b"": none, an older member)."""


class ViewDigest:
    """The views of a member's groups in 8 bytes: the XOR over its groups of
    a hash of (group key, view id), kept as views are installed (`set`).
    Two members with equal digests have (but with odds of 2**-64) the same
    groups in the same views."""

    def __init__(self) -> None:
        self._of: dict[str, int] = {}
        self._x = 0

    @staticmethod
    def _h(key: str, view_id: int) -> int:
        return int.from_bytes(hashlib.blake2b(f"{key}\0{view_id}".encode(), digest_size=8).digest(), "big")

    def set(self, key: str, view_id: int) -> None:
        """Group `key` installed view `view_id`."""
        h = self._h(key, view_id)
        self._x ^= self._of.get(key, 0) ^ h
        self._of[key] = h

    def value(self) -> bytes:
        return self._x.to_bytes(8, "big")


def views_of(node) -> bytes:
    """The ViewDigest of a driver with the one group `node` (the in-memory
    network, the simulator); b"" before it has a view."""
    view = getattr(node, "view", None)
    if view is None:
        return b""
    d = ViewDigest()
    d.set("", view.view_id)
    return d.value()


WINDOW_SUSPECTS = 20  # lateness and near misses count for 10 to 20 suspect intervals (two halves)
# the tolerance is at most this many suspect intervals: one box running three
# brokers and three members with a thousand topics stalled loops for 1-1.8 s
# with suspect_ms 500, and a cap of one interval still let one through
TOLERANCE_SUSPECTS = 3
# adaptive suspicion: silent after this many times the longest ping gap seen,
# never sooner than this many heartbeats, and only once this many pings of
# the peer were seen in the window (a lost ping doubles a gap: with 3 gaps of
# a clean link, a single loss widens the limit before it could mislead)
ADAPT_GAPS = 3
ADAPT_FLOOR_HEARTBEATS = 4
ADAPT_SAMPLES = 8


class PeerLiveness:
    """A member's liveness of its peers, in the member's ticks (module doc)."""

    def __init__(self, peers: Iterable[str], heartbeat_ticks: int, suspect_ticks: int, adaptive: bool = False):
        if heartbeat_ticks < 1 or suspect_ticks < 1:
            raise ValueError("heartbeat_ticks and suspect_ticks must be >= 1")
        self.peers = tuple(peers)
        self.heartbeat_ticks = heartbeat_ticks
        self.suspect_ticks = suspect_ticks
        self.now = 0
        self.heard_at = {p: 0 for p in self.peers}
        # the tolerance's memory, in two halves of the window: worst near miss
        # per peer, and the member's own worst lateness under the key None
        self._near = 2 * heartbeat_ticks  # a gap longer than this is late
        self._cap = TOLERANCE_SUSPECTS * suspect_ticks
        self._half = max(1, WINDOW_SUSPECTS * suspect_ticks // 2)
        self._half_start = 0
        self._cur: dict[str | None, int] = {}
        self._prev: dict[str | None, int] = {}
        self._pinged_at: dict[str, int] = {}  # when each peer's last ping came
        self.speaks: set[str] = set()  # peers that ping (run this protocol): only then may nodes sleep
        self.views = b""  # this member's ViewDigest, as its pings carry it (the driver keeps it)
        self.peer_views: dict[str, bytes] = {}  # each peer's, from its last ping
        self._pinged = -heartbeat_ticks
        self._silent: frozenset[str] = frozenset()
        self.adaptive = adaptive
        # adaptive suspicion's memory, in the same two halves: per peer the
        # longest ping gap and the number of pings
        self._gap_cur: dict[str, int] = {}
        self._gap_prev: dict[str, int] = {}
        self._n_cur: dict[str, int] = {}
        self._n_prev: dict[str, int] = {}

    def tick(self) -> bool:
        """One tick of the member; True when a ping to every peer is due now."""
        self.now += 1
        if self.now - self._half_start >= self._half:
            self._prev, self._cur, self._half_start = self._cur, {}, self.now
            self._gap_prev, self._gap_cur, self._n_prev, self._n_cur = self._gap_cur, {}, self._n_cur, {}
        if self.now - self._pinged >= self.heartbeat_ticks:
            self._pinged = self.now
            return True
        return False

    def heard(self, peer: str, ping: bool = False, views: bytes = b"") -> None:
        """A frame from `peer` arrived (`ping`: the member-level ping, which
        carries the peer's ViewDigest `views`)."""
        if peer in self.heard_at:
            self.heard_at[peer] = now = self.now
            if ping:
                last = self._pinged_at.get(peer)
                self._pinged_at[peer] = now
                if self.adaptive and last is not None:
                    self._n_cur[peer] = self._n_cur.get(peer, 0) + 1
                    if now - last > self._gap_cur.get(peer, 0):
                        self._gap_cur[peer] = now - last
                if last is not None and now - last > self._near:
                    gap = now - last  # late: a near miss if it ended before suspicion (`tolerance` then)
                    if gap <= self.suspect_ticks + self.tolerance(peer) and gap > self._cur.get(peer, 0):
                        self._cur[peer] = min(gap, self._cap)
                self.speaks.add(peer)
                self.peer_views[peer] = views

    def late(self, ticks: int) -> None:
        """The member's loop ran `ticks` tick periods late (its timer fired
        that late): the box is busy, so its peers get that much more time
        before they are silent (module doc)."""
        if ticks > self._cur.get(None, 0):
            self._cur[None] = min(ticks, self._cap)

    def tolerance(self, peer: str) -> int:
        """Ticks of silence `peer` gets beyond suspect_ticks: the member's
        own worst lateness or the peer's worst near miss in the window (at
        most TOLERANCE_SUSPECTS x suspect_ticks)."""
        cur, prev = self._cur, self._prev
        return max(cur.get(None, 0), prev.get(None, 0), cur.get(peer, 0), prev.get(peer, 0))

    def limit(self, peer: str) -> int:
        """Ticks of silence after which `peer` is silent: suspect_ticks plus
        its tolerance; with `adaptive`, sooner when its pings came regularly
        (module doc)."""
        ceiling = self.suspect_ticks + self.tolerance(peer)
        if not self.adaptive or self._n_cur.get(peer, 0) + self._n_prev.get(peer, 0) < ADAPT_SAMPLES:
            return ceiling
        gap = max(self._gap_cur.get(peer, 0), self._gap_prev.get(peer, 0))
        own = max(self._cur.get(None, 0), self._prev.get(None, 0))
        return min(ceiling, max(ADAPT_GAPS * gap, ADAPT_FLOOR_HEARTBEATS * self.heartbeat_ticks) + own)

    @property
    def silent(self) -> frozenset[str]:
        """The peers silent at the last `newly_silent` call."""
        return self._silent

    def heard_ago(self) -> dict[str, int]:
        """Ticks since each peer was last heard (as they passed)."""
        now = self.now
        return {p: now - t for p, t in self.heard_at.items()}

    def ago(self) -> dict[str, int]:
        """Ticks of silence that count, for each peer: since it was last
        heard, less its tolerance (never below 0).  A peer is silent once
        this passes suspect_ticks; the nodes hear it (`Dormancy.refresh`)."""
        if not self._cur and not self._prev:
            return self.heard_ago()
        now, tol = self.now, self.tolerance
        return {p: max(0, now - t - tol(p)) for p, t in self.heard_at.items()}

    def newly_silent(self) -> frozenset[str]:
        """Peers silent for more than their `limit` (suspect_ticks plus their
        tolerance, or sooner with `adaptive`) that were not at the last call."""
        now, limit = self.now, self.limit
        silent = frozenset(p for p, t in self.heard_at.items() if now - t > limit(p))
        new = silent - self._silent
        self._silent = silent
        return new

    def all_speak(self) -> bool:
        return len(self.speaks) == len(self.peers)

    def views_agree(self) -> bool:
        """Every peer's last ping carried this member's (non-empty) ViewDigest."""
        v = self.views
        return bool(v) and len(self.peer_views) == len(self.peers) and all(
            self.peer_views.get(p) == v for p in self.peers)


IDLE_ROUNDS = 10  # a sleeping node wakes for one heartbeat round every IDLE_ROUNDS * suspect_ticks


class Dormancy:
    """The sleeping nodes of one member, by key (the topic), with when each
    fell asleep in `liveness` ticks (module doc).  A node that has slept
    `idle_ticks` is woken for one heartbeat round (`wake_due`): a peer that
    moved to a newer view without this member (an asymmetric partition
    excluded it) tells it so when it hears that heartbeat, and a node of
    ours left in an older view hears of the newer one — what per-topic
    heartbeats did every heartbeat, done every `idle_ticks`."""

    def __init__(self, liveness: PeerLiveness, idle_ticks: int | None = None):
        self.liveness = liveness
        self.idle_ticks = idle_ticks if idle_ticks is not None else IDLE_ROUNDS * liveness.suspect_ticks
        self.asleep: dict[Hashable, tuple[int, object]] = {}  # key -> (fell asleep at, node); in that order
        self._woken: set[Hashable] = set()  # woken since their last tick: ticked once before they sleep again
        self.slept = 0  # nodes put to sleep (counter)

    def is_asleep(self, key: Hashable) -> bool:
        return key in self.asleep

    def try_sleep(self, key: Hashable, node) -> bool:
        """Before a tick of `node`: put it to sleep if it is dormant, every
        peer speaks this protocol, and it was ticked since it was last woken;
        True when it sleeps (now or already): do not tick it."""
        if key in self.asleep:
            return True
        if key in self._woken:  # its next tick first: it may suspect the peer whose silence woke it
            self._woken.discard(key)
            return False
        if not self.liveness.all_speak() or not node.dormant():
            return False
        self.asleep[key] = (self.liveness.now, node)
        self.slept += 1
        return True

    def wake(self, key: Hashable, node) -> None:
        """Before input reaches `node`: if it sleeps, wake it (its time moves
        on by the ticks it slept, its peers' liveness is the member's)."""
        entry = self.asleep.pop(key, None)
        if entry is not None:
            self._woken.add(key)
            node.wake(self.liveness.now - entry[0], self.liveness.ago())

    def wake_all(self) -> None:
        """Wake every sleeper (a peer fell silent: each then suspects it)."""
        for key, (_, node) in list(self.asleep.items()):
            self.wake(key, node)

    def wake_due(self) -> None:
        """Wake the sleepers that slept `idle_ticks` (oldest first: the dict
        keeps the order they fell asleep in, so this stops at the first one
        not due), at most 2 x len(asleep) / idle_ticks of them per tick:
        groups that fell asleep together (a thousand formed at start) then
        take their idle rounds spread over half an idle period rather than
        all in one tick, whose heartbeats and answers would hold the member's
        loop past its peers' suspect interval (measured: every group of
        1 000 fell back into a view change every 20-30 s).  A sleeper's idle
        round thus comes within 1.5 x idle_ticks.  Nothing while every peer's
        views agree with the member's (ViewDigest): no group of any member
        is in another view, so there is nothing an idle round could tell."""
        if self.liveness.views_agree():
            return
        limit = self.liveness.now - self.idle_ticks
        budget = max(1, -(-2 * len(self.asleep) // self.idle_ticks))
        while self.asleep and budget:
            key, (since, node) = next(iter(self.asleep.items()))
            if since > limit:
                return
            self.wake(key, node)
            budget -= 1

    def refresh(self, node) -> None:
        """An awake node hears the member's liveness (before its tick), and
        with adaptive suspicion the peers found silent sooner than its own
        suspect_ticks."""
        live = self.liveness
        node.heard(live.ago())
        if live.adaptive:
            node.silent(live.silent)
