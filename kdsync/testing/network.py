"""A seeded, synchronous in-memory network of ordering nodes (etcd raft's
`network` for kdsync): cut, isolate, drop, duplicate, reorder, recover,
crash, stop (a clean one), restart, stabilize.  Every message is the real encoded bytes the node
produced, so the codec is exercised on every hop.  Each member's "global
topic" is a list of delivered batches (`NetworkMember.batches`; `topic()` takes it
apart into Events for tests); a crashed member keeps only that and its hard
state, like a real member keeps only its Kafka topic and state file.

Used by the unit tests, the interaction transcripts and the property test;
it is not used in production.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kdsync.invariants import OffsetRanges, ViewRecord, check, runs_from_batches, watermarks
from kdsync.core import Batch, Event, HardState, LogChunk, NodeConfig, OrderingNode, batches_from_events, make_node
from kdsync.core.batch import read_positions
from kdsync.core.liveness import Dormancy, PeerLiveness, Ping, views_of
from kdsync.core.messages import DecodeCache
from kdsync.testing.clocks import PERFECT, ClockFault




@dataclass
class NetworkMember:
    id: str
    node: OrderingNode | None
    batches: list[Batch] = field(default_factory=list)  # the global topic, in position order
    length: int = 0  # records in it
    hard: HardState | None = None
    up: bool = True
    durable_lag: bool = False  # when True, durability is reported only by flush()

    def truncate(self, n: int) -> None:
        """Keep positions [0, n) (unflushed writes die with the process)."""
        pos = 0
        for i, b in enumerate(self.batches):
            if pos + b.count > n:
                keep = n - pos
                self.batches[i:] = [b.slice(0, keep)] if keep > 0 else []
                break
            pos += b.count
        self.length = min(self.length, n)

    def read(self, start: int, stop: int) -> tuple[Batch, ...]:
        """The batches at positions [start, stop)."""
        return tuple(read_positions(self.batches, start, stop))


class InMemoryNetwork:
    DEFAULT_PROTOCOL = "derecho"  # a test module may run its tests on another protocol
    TICK_US = 1000  # true time per tick, for the members' clocks

    def __init__(self, ids, *, protocol=None, seed=0, witnesses=(), clocks=None, dormancy=False, **cfg):
        self.ids = tuple(ids)
        # dormancy: each member pings its peers and puts its dormant node to sleep, as `kdsync run` does
        # (kdsync.core.liveness); pings travel the network like messages (cut, dropped, ...)
        self.dormancy = dormancy
        self.live: dict[str, PeerLiveness] = {}
        self.dorm: dict[str, Dormancy] = {}
        self.pings = 0
        self.rng = random.Random(seed)
        self.decodes = DecodeCache()  # one broadcast object reaches every node: decoded once
        self.cfg_base = dict(cfg)
        self.protocol = protocol or self.DEFAULT_PROTOCOL
        self.time = 0  # true time, µs (advances with ticks)
        self.clocks: dict[str, ClockFault] = dict(clocks or {})  # member -> its clock's faults
        self.roles = {w: "witness" for w in witnesses}
        self.members: dict[str, NetworkMember] = {}
        self.queue: list[tuple[str, str, bytes]] = []  # (from, to, data)
        self.cut_links: set[tuple[str, str]] = set()
        self.drop_prob: dict[tuple[str, str], float] = {}
        self.lose_once: dict[tuple[str, str, int], list[int]] = {}  # lose_next: (from, to, type) -> [lost]
        self.dup_prob = 0.0
        self.reorder = False
        self.offsets: dict[tuple[str, int], int] = {}
        self.sources: dict[str, list[Event]] = {}  # each origin's source topic
        self.log: list[str] = []  # human-readable trace for transcripts
        self.views: dict[str, list] = {i: [] for i in self.ids}
        self.bad_messages = 0
        self.reads_served = 0
        self.sent_by_type: dict[int, int] = {}  # messages handed to the network, by type code
        self.before_input = None  # called with a member's id before a message or a submit reaches its node
        for i in self.ids:
            self.members[i] = NetworkMember(i, None)
            self._boot(i)

    # --------------------------------------------------------------- members
    def config(self, i: str) -> NodeConfig:
        return NodeConfig(member_id=i, members=self.ids, roles=self.roles, protocol=self.protocol, **self.cfg_base)

    def _boot(self, i: str) -> None:
        m = self.members[i]
        if self.roles.get(i) == "witness":  # no global topic: it starts from nothing, like `kdsync run`'s
            m.batches, m.length = [], 0
        m.node = make_node(
            self.config(i),
            rng=random.Random(self.rng.randrange(2**32)),
            start_seq=m.length,
            watermarks=watermarks(m.batches),
            hard_state=m.hard,
            decodes=self.decodes,
        )
        m.up = True
        if self.dormancy:  # a new process: its liveness starts afresh
            cfg = m.node.cfg
            self.live[i] = PeerLiveness([j for j in self.ids if j != i], cfg.heartbeat_ticks, cfg.suspect_ticks,
                                        cfg.adaptive_suspect)
            self.dorm[i] = Dormancy(self.live[i])
        self._clock(i)

    def crash(self, i: str) -> None:
        m = self.members[i]
        if m.durable_lag and m.node is not None:
            m.truncate(m.node.durable_seq)  # unflushed writes die with the process
        m.node, m.up = None, False
        self.queue = [q for q in self.queue if q[1] != i and q[0] != i]
        self.log.append(f"crash {i}")

    def stop(self, i: str, max_ticks: int = 200) -> int:
        """A clean stop (SIGTERM): the node leaves, the network runs until the
        group took note of it (`left`, bounded), then the process is gone as
        after a crash.  Returns the ticks it took."""
        m = self.members[i]
        m.node.leave()
        self.log.append(f"stop {i}")
        t = 0
        self.stabilize()
        while not m.node.left and t < max_ticks:
            self.tick()
            t += 1
        self.crash(i)
        return t

    def restart(self, i: str) -> None:
        """Restart from what survives: the global topic, the hard state, and the
        source topic from the committed offset (events of this origin that are
        not yet in its own global topic are consumed and submitted again)."""
        self._boot(i)
        m = self.members[i]
        self.log.append(f"restart {i} at position {m.length}")
        if self.roles.get(i) == "witness":
            return
        committed = watermarks(b for b in m.batches if b.origin == i)
        again = [e for e in self.sources.get(i, []) if e.offset > committed.get((i, e.partition), -1)]
        if again:
            m.node.submit(batches_from_events(again))

    def node(self, i: str):
        return self.members[i].node

    # -------------------------------------------------------------- workload
    def make_events(self, origin: str, n: int, partition: int = 0) -> list[Event]:
        k = (origin, partition)
        start = self.offsets.get(k, 0)
        self.offsets[k] = start + n
        evs = [Event(origin, partition, start + j, b"%s:%d" % (origin.encode(), start + j), 0) for j in range(n)]
        self.sources.setdefault(origin, []).extend(evs)
        return evs

    def make_batch(self, origin: str, n: int, partition: int = 0) -> Batch:
        """The next n source records of (origin, partition) as one batch."""
        return Batch.from_events(self.make_events(origin, n, partition))

    def submit(self, i: str, n: int = 1, partition: int = 0) -> list[Event]:
        """n new source records at member i, submitted as one batch; returns them."""
        evs = self.make_events(i, n, partition)
        self._input(i)
        self.node(i).submit([Batch.from_events(evs)])
        return evs

    # --------------------------------------------------------------- faults
    def cut(self, a: str, b: str) -> None:
        self.cut_links |= {(a, b), (b, a)}

    def cut_one_way(self, a: str, b: str) -> None:
        self.cut_links.add((a, b))

    def isolate(self, i: str) -> None:
        for j in self.ids:
            if j != i:
                self.cut(i, j)

    def partition(self, *groups) -> None:
        for g in groups:
            for h in groups:
                if g is not h:
                    for a in g:
                        for b in h:
                            self.cut_links.add((a, b))

    def drop(self, a: str, b: str, prob: float) -> None:
        self.drop_prob[(a, b)] = prob

    def lose_next(self, a: str, b: str, type_code: int) -> list[int]:
        """Lose the next message of type `type_code` (a Message's TYPE) from a
        to b, once; returns a list whose one item counts what was lost (0 or 1)."""
        self.lose_once[(a, b, type_code)] = lost = [0]
        return lost

    def recover(self) -> None:
        self.cut_links.clear()
        self.drop_prob.clear()
        self.dup_prob = 0.0
        self.reorder = False

    # ------------------------------------------------------------------ run
    def _process_ready(self) -> bool:
        progressed = False
        for i in self.ids:
            m = self.members[i]
            n = m.node
            if n is None or not n.has_ready():
                continue
            progressed = True
            rd = n.ready()
            if rd.hard_state is not None:
                m.hard = rd.hard_state
            for out in rd.messages:
                self._enqueue(i, out.to, out.data)
            witness = self.roles.get(i) == "witness"
            for d in rd.deliveries:
                if witness:  # nothing written: positions may jump after a snapshot
                    m.length = d.end_seq
                    continue
                assert d.first_seq == m.length, f"{i}: delivery at {d.first_seq}, topic has {m.length}"
                m.batches.extend(d.batches)
                m.length += d.count
            for v in rd.views:
                self.views[i].append(v)
                self.log.append(f"{i} installs view {v.view_id} {list(v.members)} at {v.start_seq}")
            if rd.deliveries and not m.durable_lag:
                n.durable(m.length)
            for r in rd.reads:
                self.reads_served += 1
                n.step(LogChunk(r.start, m.read(r.start, r.stop)))
            n.advance(rd)
        return progressed

    def flush(self, i: str) -> None:
        """Report everything written as durable (when durable_lag is set)."""
        if self.dormancy:
            self.dorm[i].wake(i, self.node(i))
        self.node(i).durable(self.members[i].length)

    def _clock(self, i: str) -> None:
        n = self.members[i].node
        if n is not None:
            n.clock(self.clocks.get(i, PERFECT).read(self.time))

    def _input(self, i: str) -> None:
        """Before an input reaches member i's node: the test's hook, a sleeping node woken, its clock."""
        if self.before_input is not None:
            self.before_input(i)
        if self.dormancy:
            self.dorm[i].wake(i, self.members[i].node)
        self._clock(i)

    def _enqueue(self, a: str, b: str, data: bytes) -> None:
        if not isinstance(data, Ping):
            t = data[1]  # a msgpack array of < 16 items: the type code is its second byte
            self.sent_by_type[t] = self.sent_by_type.get(t, 0) + 1
        if (a, b) in self.cut_links or not self.members[b].up:
            return
        if self.lose_once and not isinstance(data, Ping):
            lost = self.lose_once.get((a, b, data[1]))
            if lost is not None and not lost[0]:
                lost[0] = 1
                return
        p = self.drop_prob.get((a, b), 0.0)
        if p and self.rng.random() < p:
            return
        self.queue.append((a, b, data))
        if self.dup_prob and self.rng.random() < self.dup_prob:
            self.queue.append((a, b, data))

    def deliver_msgs(self) -> int:
        q, self.queue = self.queue, []
        if self.reorder:
            self.rng.shuffle(q)
        for a, b, data in q:
            n = self.members[b].node
            if n is None or (a, b) in self.cut_links:
                continue
            if self.dormancy:
                ping = isinstance(data, Ping)
                self.live[b].heard(a, ping, bytes(data) if ping else b"")
                if ping:
                    continue
            self._input(b)
            try:
                n.receive(a, data)
            except Exception as exc:  # RemoteProtocolError is logged and survived
                from kdsync.core import RemoteProtocolError

                if not isinstance(exc, RemoteProtocolError):
                    raise
                self.bad_messages += 1
        return len(q)

    def tick(self, n: int = 1, *, settle: bool = True) -> None:
        """n ticks at every live member; after each, run to quiescence (at most
        50 rounds) unless `settle` is False (then step() drives the rounds)."""
        for _ in range(n):
            self.time += self.TICK_US
            for i in self.ids:
                node = self.members[i].node
                if node is None:
                    continue
                if self.dormancy and not self._dormancy_tick(i, node):
                    continue
                self._clock(i)
                node.tick()
            if settle:
                self.stabilize(max_rounds=50)

    def _dormancy_tick(self, i: str, node) -> bool:
        """Member i's liveness tick (pings, a peer fallen silent wakes every
        sleeper); False when its node sleeps (not ticked)."""
        live, dorm = self.live[i], self.dorm[i]
        if live.tick():
            live.views = views_of(node)
            for j in live.peers:
                self.pings += 1
                self._enqueue(i, j, Ping(live.views))
        if live.newly_silent():
            dorm.wake_all()
        dorm.wake_due()
        if dorm.try_sleep(i, node):
            return False
        dorm.refresh(node)
        return True

    def asleep(self) -> list[str]:
        """Members whose node sleeps now (dormancy)."""
        return [i for i in self.ids if self.dormancy and self.dorm[i].is_asleep(i)]

    def step(self) -> bool:
        """One round: every node's Ready handled, then every queued message
        delivered.  Returns False when there was nothing to do."""
        p = self._process_ready()
        if not self.queue and not p:
            return False
        self.deliver_msgs()
        return True

    def stabilize(self, max_rounds: int = 1000) -> None:
        for _ in range(max_rounds):
            if not self.step():
                return

    def run_until(self, cond, max_ticks: int = 2000) -> int:
        """Tick until cond() holds; returns ticks used; raises on timeout."""
        self.stabilize()
        for t in range(max_ticks):
            if cond():
                return t
            self.tick()
        if cond():
            return max_ticks
        raise AssertionError(f"condition not reached within {max_ticks} ticks; {self.describe()}")

    # -------------------------------------------------------------- observe
    def topic(self, i: str) -> list[Event]:
        """Member i's global topic taken apart into Events (index = position)."""
        return [e for b in self.members[i].batches for e in b.events()]

    def topic_len(self, i: str) -> int:
        return self.members[i].length

    def describe(self) -> str:
        parts = []
        for i in self.ids:
            m = self.members[i]
            st = m.node.snapshot() if m.node is not None else {"status": "down"}
            parts.append(f"{i}:{st} topic={m.length}")
        return "; ".join(parts)


def check_invariants(net: InMemoryNetwork, *, agreement=True, submitted=None, live=None) -> list[str]:
    """The outside checker (`kdsync.invariants`) on the network's members: returns
    one line `kind: anomaly: detail` per violation (empty when fine).

    `submitted`: set of (origin, partition, offset) acknowledged (None: no
    loss or foreign check); `live`: members that must hold all of it (default
    every member with a topic); `agreement=False` for the mirror baseline."""
    topics = {i: runs_from_batches(net.members[i].batches) for i in net.ids if net.roles.get(i) != "witness"}
    views = [ViewRecord.of(i, v) for i in net.ids for v in net.views[i]]
    found = check(
        topics,
        submitted=OffsetRanges.from_keys(submitted) if submitted is not None else None,
        live=live,
        agreement=agreement,
        views=views,
        initial_members=net.ids,
    )
    return [str(v) for v in found]


__all__ = ["InMemoryNetwork", "NetworkMember", "check_invariants"]


def assert_whole(net: InMemoryNetwork, ids, submitted, *, members: int, within: int) -> None:
    """`ids` end active in views of `members` members (within `within`
    ticks, then twenty more), the checker finds nothing, and each of them
    holds every event of `submitted` once: the end of a fault test."""
    net.run_until(lambda: all(net.node(i).status == "active" and len(net.node(i).view.members) == members
                              for i in ids), within)
    net.tick(20)
    assert not check_invariants(net, submitted=submitted)
    assert all(len(net.topic(i)) == len(submitted) for i in ids)
