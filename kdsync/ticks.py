"""`kdsync run`'s clock: the tick timer of one member's ordering nodes.

Every timeout in the core is counted in ticks (kdsync.core), and the member
ticks every node once per `protocol.tick_ms`, measured on the loop's clock.
While every node is quiet (core NodeBase.quiet) the timer skips a period: an
idle member wakes for a pair of ticks every other period.  Any input runs the
ticks already due first (`due`), so a node counts time exactly at every
input, and input that makes a node busy puts the timer back on time
(`wake_if_busy`).  tests/core/test_late_ticks.py drives this rule through
faults on the in-memory network.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Callable

from kdsync.core.liveness import Dormancy, PeerLiveness, ViewDigest
from kdsync.observability.logs import kv
from kdsync.transport.channels import frame_channel

log = logging.getLogger("kdsync.member")

__all__ = ["PING_CHANNEL", "Coalesced", "FormingSlots", "GroupTicks", "Pulse", "Sleepers", "TickClock", "wall_us"]

MAX_CATCH_UP = 5  # a stalled loop catches up a few ticks, not hundreds
# Coalesced drains in one callback unless given a budget.  Cutting the member's work
# into 20 ms slices (tick passes, TCP reads, drains) was tried for 1 000 topics and
# removed: with slices, 100 topics at 1 000 events/s had groups stalled 10-17 s in view
# changes after one peer was judged silent (docs/design/many-topics.md).
DRAIN_BUDGET_S = float("inf")


def wall_us() -> int:
    """The host's wall clock in µs: what the `clock` protocol stamps with
    (NTP-synchronised hosts keep its delivery short; skew never costs safety)."""
    return time.time_ns() // 1000


class TickClock:
    """`quiet()`: every node is quiet; `on_ticks(n, now, late)`: tick every
    node `n` times, the timer `late` whole periods after its time (the loop
    was busy or starved); `on_error(e)`: `on_ticks` raised (a core bug: the member stops
    loudly rather than run without a clock); `stopping()`: the member stops."""

    def __init__(self, loop: asyncio.AbstractEventLoop, tick_ms: int, *, quiet: Callable[[], bool],
                 on_ticks: Callable[[int, float, int], None], on_error: Callable[[Exception], None],
                 stopping: Callable[[], bool]):
        self.loop = loop
        self.period = tick_ms / 1000.0
        self.next = 0.0
        self.late = False  # the timer skips a period: every node was quiet
        self.worst_delay = 0.0  # the longest the timer ran after its time since the last `take_delay` (s)
        self._timer: asyncio.TimerHandle | None = None
        self._when = 0.0
        self._quiet, self._on_ticks, self._on_error, self._stopping = quiet, on_ticks, on_error, stopping

    def start(self) -> None:
        self.next = self.loop.time() + self.period
        self._arm()

    def stop(self) -> None:
        self.late = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def due(self) -> None:
        """Input is about to reach a node: while ticks run late, run the
        ticks already due first."""
        if self.late and self.loop.time() >= self.next:
            self._run(at_least=0)

    def wake_if_busy(self, node) -> None:
        """`node` just processed input: if it is busy again while the timer
        runs late, put the next tick on time."""
        if self.late and self._timer is not None and not node.quiet():
            self._timer.cancel()
            self._arm()

    def _arm(self) -> None:
        late = self._quiet()
        self.late = late
        self._when = when = self.next + self.period if late else self.next
        self._timer = self.loop.call_at(when, self._on_timer)

    def take_delay(self) -> float:
        """The longest the tick timer ran after its time since the last call
        (the member's loop was busy or starved of CPU), and reset it."""
        d, self.worst_delay = self.worst_delay, 0.0
        return d

    def _on_timer(self) -> None:
        self._timer = None
        self.worst_delay = max(self.worst_delay, self.loop.time() - self._when)
        if self._stopping():
            return
        try:
            self._run(at_least=1)
        except Exception as e:  # noqa: BLE001 - reported to the member, which stops
            self._on_error(e)
            return
        self._arm()

    def _run(self, at_least: int) -> None:
        period = self.period
        now = self.loop.time()
        n = 0
        while self.next <= now and n < MAX_CATCH_UP:
            self.next += period
            n += 1
        if self.next <= now:
            self.next = now + period
        n = max(n, at_least)
        if n:
            late = int((now - self._when) / period) if now > self._when else 0
            self._on_ticks(n, now, late)


class Pulse:
    """Called inside a long pass of the loop (a drain of a thousand nodes, a
    tick pass over them, a batch frame of a thousand groups' messages, the
    Readys released by one fsync): at most every `period_s` it runs
    `beat()` — the member's pings queued and the transport's queue written
    now (`Transport.flush_now`) instead of after the pass.

    Why: what a pass sends leaves after it, so a member whose pass ran a
    second (a burst into 1 000 topics) was silent to its peers for that
    second, and with `suspect_ms` 500 they judged it dead and changed the
    view of every group (issue 43: 5 213 views).  A late loop is not a
    silent peer: its peers hear it every `period_s` however long its pass.

    A pass begins at `start()`, or, `auto`, at the first call since the
    loop last got back to its callbacks (the pulse disarms itself with
    `call_soon` on the running loop)."""

    def __init__(self, beat: Callable[[], None], period_s: float, clock: Callable[[], float] = time.perf_counter,
                 auto: bool = False):
        self.beat, self.period, self.clock, self.auto = beat, period_s, clock, auto
        self.next = float("inf")  # armed by start(), or by the first call of a pass (loop given)
        self._disarm_due = False

    def start(self) -> None:
        """A pass begins."""
        self.next = self.clock() + self.period

    def _disarm(self) -> None:
        self._disarm_due = False
        self.next = float("inf")

    def __call__(self) -> None:
        now = self.clock()
        if now >= self.next:
            self.next = now + self.period
            self.beat()
        elif self.auto and not self._disarm_due:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # not on a loop (a test driving a part alone): no pass to time
                return
            if self.next == float("inf"):
                self.next = now + self.period
            self._disarm_due = True
            loop.call_soon(self._disarm)


class Coalesced:
    """`run(item)` once soon for every item added (`add`), however often it
    is added before it runs, first added first run, in slices of the loop
    of at most `budget_s` each.

    The member drains a node once for all the peer messages that reached it
    in a loop iteration.  One callback per node (the earlier way) put
    hundreds of callbacks in one loop iteration when a read touched hundreds
    of topics, and the tick timer, queued behind them, ran up to a second
    late (measured at 1 000 topics: its pings late, peers suspected).  One
    callback for all of them, cut by time, keeps every iteration short.
    `pulse` (the member's `Pulse`): called at every `add` — the adds of one
    read may be a batch frame of a thousand groups' messages."""

    def __init__(self, loop: asyncio.AbstractEventLoop, run: Callable[[object], None],
                 budget_s: float = DRAIN_BUDGET_S, pulse: Pulse | None = None):
        self.loop, self._run, self.budget, self.pulse = loop, run, budget_s, pulse
        self._todo: dict[int, object] = {}  # id(item) -> item, in the order added
        self._scheduled = False

    def add(self, item) -> None:
        if self.pulse is not None:
            self.pulse()
        if self._todo.setdefault(id(item), item) is item and not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self._drain)

    def discard(self, item) -> None:
        self._todo.pop(id(item), None)

    def _drain(self) -> None:
        self._scheduled = False
        todo, run = self._todo, self._run
        end = time.perf_counter() + self.budget
        try:
            while todo:
                run(todo.pop(next(iter(todo))))
                if time.perf_counter() >= end:
                    break
        finally:  # also when run() raised (the loop logs it): the rest still run
            if todo and not self._scheduled:
                self._scheduled = True
                self.loop.call_soon(self._drain)


PING_CHANNEL = "__kdsync.live"  # never a source topic (`__` topics are internal), so older members drop it


class Sleepers:
    """The member's side of kdsync.core.liveness: one ping per peer per
    heartbeat whatever the number of topics, every frame heard, and the
    pipelines whose node sleeps.  `send(peer, frame)` sends on the peer
    link; `sleep`: nodes may sleep (`[protocol] quiesce`) — pings go out and
    awake nodes hear the member's liveness either way, so peers that sleep
    are never suspected by this member's awake nodes."""

    def __init__(self, peers, heartbeat_ticks: int, suspect_ticks: int, send: Callable[[str, bytes], None],
                 sleep: bool = True, adaptive: bool = False):
        self.live = PeerLiveness(peers, heartbeat_ticks, suspect_ticks, adaptive)
        self.dorm = Dormancy(self.live)
        self.sleep = sleep
        self._send = send
        self.views = ViewDigest()  # the member's groups' views (the handshake sets them as installed)
        self._ago = self.live.ago()

    def on_ticks(self, n: int, late: int = 0) -> None:
        """The member ticks (before its nodes): pings due go out; a peer
        fallen silent wakes every sleeping node (each then suspects it);
        nodes that slept long wake for a heartbeat round (Dormancy.wake_due).
        `late`: tick periods the timer ran late — the busier the member's
        box, the longer a peer may be silent (PeerLiveness.late)."""
        live = self.live
        due = False
        for _ in range(n):
            due |= live.tick()
        if late:
            live.late(late)
        if due:  # once, however many ticks a late pass runs
            self.ping()
        silent = live.newly_silent()
        if silent:
            ago = live.heard_ago()
            for peer in sorted(silent):
                log.warning("peer silent", **kv(peer=peer, ticks=ago[peer], tolerance=live.tolerance(peer),
                                                asleep=len(self.dorm.asleep)))
            self.dorm.wake_all()
        self.dorm.wake_due()
        self.refresh(n)

    def ping(self) -> None:
        """The member's ping (its ViewDigest) to every peer: at every
        heartbeat, and in a long pass of the loop (`Pulse`)."""
        live = self.live
        live.views = self.views.value()
        ping = frame_channel(PING_CHANNEL, live.views)
        for peer in live.peers:
            try:
                self._send(peer, ping)
            except Exception:  # noqa: BLE001 - a peer link down: its silence says the rest
                pass

    def refresh(self, n: int = 1) -> None:
        """What every awake node hears before the `n` ticks it runs next:
        how long ago each peer was heard, counted from the node's time after
        them (ago - n; negative: heard during them).  The node runs its ticks
        after hearing this, so the member's plain reading would have it count
        the pass's ticks of silence twice: with a loop 5 ticks late, every
        awake group would suspect a peer heard 6 ticks ago (suspect_ticks 10)
        that the member still hears.  So a node suspects a peer in the pass
        where the member finds it silent, and not before."""
        self._ago = {p: a - n for p, a in self.live.ago().items()}

    def skip(self, topic: str, node) -> bool:
        """Before a node's ticks: True when it sleeps (do not tick it);
        otherwise it hears the member's liveness first."""
        if self.sleep and self.dorm.try_sleep(topic, node):
            return True
        node.heard(self._ago)  # Dormancy.refresh, with the pass's one reading of the liveness
        if self.live.adaptive:
            node.silent(self.live.silent)
        return False

    def heard(self, peer: str, channel: str, body: bytes = b"") -> bool:
        """A frame from `peer` on `channel`; True when it was a ping (nothing
        more to do; its body is the peer's ViewDigest, b"" from older members)."""
        ping = channel == PING_CHANNEL
        self.live.heard(peer, ping, bytes(body) if ping else b"")
        return ping

    def awake(self, groups: dict):
        """The keys of `groups` whose node is awake: in `groups`' order,
        or as a set when few are (a thousand topics with a few awake are
        then not walked one by one at every tick)."""
        awake = groups.keys() - self.dorm.asleep.keys()
        return awake if 8 * len(awake) < len(groups) else [t for t in groups if t in awake]

    def wake(self, topic: str, node) -> None:
        """Before input reaches `node`."""
        if self.dorm.asleep:
            self.dorm.wake(topic, node)


VIEW_CHANGE = frozenset({"forming", "joining", "wedged", "minority"})  # node statuses of a group changing view


class FormingSlots:
    """At most `slots` of a member's groups in a view change are ticked at
    once; the others wait their turn, first come first served, and a group
    that has not finished after `slice_ticks` ticks goes to the back of the
    line when another waits.

    Why: a member starting a thousand topics, or whose peer died under a
    thousand groups, has that many view changes to run.  Run at once, their
    rounds and retransmissions outgrow what one process answers within a
    suspect interval, peers are suspected for lateness, leaders duel and no
    group forms (measured: 1 000 topics, 0 views in 70 s).  A group's view
    change needs ticks only where it is led (a follower answers COLLECT,
    ACCEPT and INSTALL as they arrive), and safety never depends on when a
    node is ticked, only its progress does: a waiting group keeps its time
    still until its turn."""

    def __init__(self, slots: int, slice_ticks: int) -> None:
        self.slots = slots
        self.slice = slice_ticks
        self.admitted: dict[str, int] = {}  # topic -> ticks it ran in this turn
        self._line: deque[str] = deque()
        self._waiting: set[str] = set()

    def refill(self) -> None:
        """Before a round of ticks: groups whose turn is over go behind those
        waiting, and the first in line take the free slots."""
        if self._waiting:
            for t in [t for t, used in self.admitted.items() if used >= self.slice]:
                del self.admitted[t]
                self._waiting.add(t)
                self._line.append(t)
        while len(self.admitted) < self.slots and self._line:
            t = self._line.popleft()
            if t in self._waiting:
                self._waiting.discard(t)
                self.admitted[t] = 0

    def tick_wanted(self, topic: str, status: str, n: int = 1) -> bool:
        """Whether to tick `topic`'s node (`status`) `n` times now."""
        if status not in VIEW_CHANGE:
            self.admitted.pop(topic, None)
            self._waiting.discard(topic)
            return True
        used = self.admitted.get(topic)
        if used is None:
            if topic not in self._waiting:
                self._waiting.add(topic)
                self._line.append(topic)
            return False
        self.admitted[topic] = used + n
        return True

    @property
    def waiting(self) -> int:
        return len(self._waiting)


class GroupTicks:
    """One pass of the tick timer over a member's groups (its `on_ticks`)
    and the timer's question whether they are all quiet (its `quiet`).

    `groups` maps a topic to its pipeline (anything with a `.node`), read at
    every pass; `sleepers` says which nodes sleep and what the awake ones hear
    of the member's liveness; `forming` admits the groups in a view change;
    `process(pipeline)` drains a node that was ticked (the member's pulses:
    `Pulse`); `after(now)` runs once at the end of every pass (the member's
    producer poll and health sample)."""

    def __init__(self, groups: dict, sleepers: Sleepers, forming: FormingSlots, process: Callable[[object], None],
                 after: Callable[[float], None]):
        self.groups, self.sleepers, self.forming, self.process, self.after = groups, sleepers, forming, process, after

    def quiet(self) -> bool:
        """Every awake node is quiet (a sleeping node is not asked: a thousand idle topics)."""
        groups, asleep = self.groups, self.sleepers.dorm.asleep
        if not groups or len(asleep) == len(groups):
            return bool(groups)
        return all(groups[t].node.quiet() for t in self.sleepers.awake(groups))

    def __call__(self, n: int, now: float, late: int = 0) -> None:
        groups, sleepers, forming = self.groups, self.sleepers, self.forming
        sleepers.on_ticks(n, late)
        forming.refill()
        asleep = sleepers.dorm.asleep  # not visited: a thousand idle topics cost nothing here
        for t in (sleepers.awake(groups) if len(asleep) < len(groups) else ()):
            p = groups.get(t)
            if p is None or t in asleep or sleepers.skip(t, p.node) or not forming.tick_wanted(t, p.node.status, n):
                continue
            p.node.clock(wall_us())
            for _ in range(n):
                p.node.tick()
            self.process(p)
        self.after(now)
