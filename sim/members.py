"""The Kafka model of one cluster and the adapter that drives one member's node.

Theory of operation
-------------------
`Cluster` is what a member's Kafka cluster holds and what survives a crash:
the source topic (partitions of acknowledged events), the committed input
offsets, the durable global topic, and the member's disk (`HardState`).  The
brokers themselves never fail in this model.

`Member` owns the node (the real `kdsync.core` object) while the process is
up, and drives it the way `kdsync/core/__init__.py` documents:

* inputs — peer bytes (`receive`), consumed source events (`submit`, all that
  one fetch returned in one call), `durable`, `LogChunk` answers, `tick` —
  are fed in as they happen; after any input the member asks the simulation
  for one flush at the current instant, so `ready()` runs once per simulated
  instant, not once per input;
* a flush does the Ready handshake: persist hard state to the disk, send the
  messages, append deliveries to the global topic (durable `produce_ms` later,
  then `node.durable(end)`), answer reads `consume_ms` later, `advance()`.

A crash drops the node object, the consumer position and every produce not
yet acknowledged by the brokers (`epoch` bumps, so callbacks scheduled by the
dead process are ignored).  A restart builds a new node from the durable
state: start_seq = length of the global topic, watermarks = highest origin
offset per (origin, partition) in it, hard state from disk; the consumer
resumes from the committed offsets (committed `commit_ms` after the member's
own events became durable), so already ordered events are submitted again and
the core's exactly-once rule must drop them.  A clock pause buffers
every input until the member resumes.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Callable

from kdsync.core import Event, HardState, LocalProtocolError, LogChunk, NodeConfig, RemoteProtocolError
from sim.scenario import ScenarioError

if TYPE_CHECKING:
    from sim.runner import Simulation


class Cluster:
    """One Kafka cluster: source topic, committed offsets, global topic, the member's disk."""

    __slots__ = ("name", "source", "source_ack", "source_vis", "committed", "global_events", "global_ts", "watermarks", "disk")

    def __init__(self, name: str) -> None:
        self.name = name
        self.source: list[list[Event]] = []  # per partition, index = offset
        self.source_ack: list[list[float]] = []  # ack time (s) of source[p][o]
        self.source_vis: list[list[float]] = []  # when source[p][o] reaches the consumer
        self.committed: list[int] = []  # per partition: next offset to consume after a restart
        self.global_events: list[Event] = []  # durable global topic, index = kdsync.seq
        self.global_ts: list[float] = []  # when each record became durable
        self.watermarks: dict[tuple[str, int], int] = {}
        self.disk: HardState | None = None

    def ensure_partitions(self, n: int) -> None:
        while len(self.source) < n:
            self.source.append([])
            self.source_ack.append([])
            self.source_vis.append([])
            self.committed.append(0)


class Member:
    """One kdsync member process (and, unless a witness, its cluster)."""

    def __init__(self, sim: "Simulation", member_id: str, config: NodeConfig, cluster: Cluster | None) -> None:
        self.sim = sim
        self.id = member_id
        self.config = config
        self.cluster = cluster
        self.node = None
        self.up = False
        self.epoch = 0  # bumps on crash: stale callbacks compare against it
        self.starts = 0
        self.paused_until = -1.0
        self._buffer: list[Callable[[], None]] = []  # inputs held during a clock pause
        self.flush_pending = False
        self.positions: list[int] = []  # consumer position per source partition
        self.status = ""
        self.views = 0
        self.bad_messages = 0
        self.deduplicated = 0

    # ------------------------------------------------------------ life cycle
    def start(self) -> None:
        if self.up:
            return
        c = self.cluster
        kwargs: dict = {"rng": random.Random(f"{self.sim.seed}/node/{self.id}/{self.starts}")}
        if c is not None:
            kwargs.update(start_seq=len(c.global_events), watermarks=dict(c.watermarks), hard_state=c.disk)
            self.positions = list(c.committed)
        else:
            kwargs["hard_state"] = self.sim.witness_disk.get(self.id)
        self.starts += 1
        try:
            self.node = self.sim.node_factory(self.config, **kwargs)
        except LocalProtocolError as err:  # the core refuses this configuration
            raise ScenarioError(
                f"{self.sim.scenario.name}: protocol {self.config.protocol} refuses member {self.id}: {err}"
            ) from None
        self.up = True
        self.paused_until = -1.0
        self._buffer.clear()
        if c is not None:
            self.sim.after(self.sim.consume_s, self._poll_cb, self.epoch)
        self.sim.request_flush(self)

    def crash(self) -> None:
        if not self.up:
            return
        self._collect_stats()
        self.up = False
        self.node = None
        self.epoch += 1
        self._buffer.clear()
        self.paused_until = -1.0
        self.status = "down"

    def pause(self, until: float) -> None:
        if self.up:
            self.paused_until = max(self.paused_until, until)
            self.sim.after(until - self.sim.env.now, self._resume_cb, self.epoch)

    def resume(self) -> None:
        """End a clock pause now (run every input held meanwhile, in order)."""
        if not self.up or self.paused_until < 0:
            return
        self.paused_until = -1.0
        held, self._buffer = self._buffer, []
        for fn in held:
            if self.node is None:
                break
            fn()
        self.poll()
        self.sim.request_flush(self)

    def _resume_cb(self, epoch: int) -> None:
        if epoch == self.epoch and self.paused_until >= 0 and self.sim.env.now >= self.paused_until:
            self.resume()

    @property
    def paused(self) -> bool:
        return self.paused_until >= 0

    def _collect_stats(self) -> None:
        node = self.node
        stats = getattr(node, "stats", None)
        if isinstance(stats, dict):
            self.deduplicated += int(stats.get("deduplicated", 0))

    # ---------------------------------------------------------------- inputs
    def _input(self, fn: Callable[[], None]) -> None:
        if self.paused_until >= 0:
            self._buffer.append(fn)
            return
        fn()
        if not self.flush_pending:
            self.sim.request_flush(self)

    def on_message(self, src: str, data: bytes) -> None:
        if not self.up:
            return  # a dead process receives nothing
        if self.paused_until >= 0:
            self._buffer.append(lambda: self._receive(src, data))
            return
        try:
            self.node.receive(src, data)
        except RemoteProtocolError:
            self.bad_messages += 1
        if not self.flush_pending:
            self.sim.request_flush(self)

    def _receive(self, src: str, data: bytes) -> None:
        try:
            self.node.receive(src, data)
        except RemoteProtocolError:
            self.bad_messages += 1

    def tick(self) -> None:
        """One tick; the ticker flushes right after (a tick is its own instant)."""
        if self.up and self.paused_until < 0:
            self.node.tick()

    def _wake(self, ev) -> None:
        """A fetch returned (kafka.poll_ms = 0): hand it over at once.  Whatever
        process is running now consumes it (the source topic outlives crashes)."""
        self.poll()

    def _poll_cb(self, epoch: int) -> None:
        if epoch == self.epoch:
            self.poll()

    def poll(self) -> None:
        """Fetch everything visible past the consumer position; submit it in one call."""
        if not self.up or self.paused_until >= 0 or self.cluster is None:
            return
        c = self.cluster
        src, vis = c.source, c.source_vis
        horizon = self.sim.env.now + 1e-9  # float slack: the wake-up time is vis, give or take an ulp
        pos = self.positions
        while len(pos) < len(src):
            pos.append(0)
        batch: list[Event] = []
        for p, part in enumerate(src):
            i = start = pos[p]
            v = vis[p]
            n = len(part)
            while i < n and v[i] <= horizon:
                i += 1
            if i > start:
                batch.extend(part[start:i])
                pos[p] = i
        if batch:
            self.node.submit(batch)
            if not self.flush_pending:
                self.sim.request_flush(self)

    # ----------------------------------------------------------------- flush
    def flush(self) -> None:
        """The Ready handshake, once per simulated instant."""
        self.flush_pending = False
        node = self.node
        if node is None or self.paused_until >= 0:
            return
        sim = self.sim
        rounds = 0
        while node.has_ready() and rounds < 16:
            rounds += 1
            rd = node.ready()
            if rd.hard_state is not None:
                if self.cluster is not None:
                    self.cluster.disk = rd.hard_state
                else:
                    sim.witness_disk[self.id] = rd.hard_state
            send = sim.network.send
            me = self.id
            for m in rd.messages:
                send(me, m.to, m.data)
            if rd.deliveries:
                self._deliver(rd.deliveries)
            for r in rd.reads:
                sim.after(sim.consume_s, self._serve_read, (self.epoch, r.start, r.stop))
            if rd.views:
                self.views += len(rd.views)
                sim.checker.on_views(self.id, rd.views)
            if rd.status:
                self.status = rd.status
            node.advance(rd)

    def _deliver(self, deliveries) -> None:
        sim = self.sim
        sim.checker.on_deliveries(self.id, deliveries, sim.in_majority(self.id))
        if self.cluster is None:  # a witness has no global topic: durable as soon as handed over
            sim.after(0.0, self._witness_durable_cb, (self.epoch, deliveries[-1].end_seq))
            return
        sim.after(sim.produce_s, self._durable_cb, (self.epoch, deliveries))

    def _durable_cb(self, arg) -> None:
        epoch, deliveries = arg
        if epoch != self.epoch:
            return  # the producer died before the brokers acknowledged: the append is lost
        c = self.cluster
        now = self.sim.env.now
        ge, gts, wm = c.global_events, c.global_ts, c.watermarks
        me = self.id
        commits: dict[int, int] = {}
        for d in deliveries:
            if d.first_seq != len(ge):
                self.sim.checker.gap(me, len(ge), d.first_seq)
            for e in d.events:
                ge.append(e)
                gts.append(now)
                k = (e[0], e[1])
                if e[2] > wm.get(k, -1):
                    wm[k] = e[2]
                if e[0] == me:
                    commits[e[1]] = e[2] + 1
        if commits:
            self.sim.after(self.sim.commit_s, self._commit_cb, (self.epoch, commits))
        end = len(ge)
        self._input(lambda: self.node.durable(end))

    def _commit_cb(self, arg) -> None:
        epoch, commits = arg
        if epoch != self.epoch:
            return  # died before the commit went out: those offsets are consumed again
        committed = self.cluster.committed
        for p, off in commits.items():
            if p < len(committed) and off > committed[p]:
                committed[p] = off

    def _witness_durable_cb(self, arg) -> None:
        epoch, end = arg
        if epoch == self.epoch:
            self._input(lambda: self.node.durable(end))

    def _serve_read(self, arg) -> None:
        epoch, start, stop = arg
        if epoch != self.epoch or self.cluster is None:
            return
        ge = self.cluster.global_events
        stop = min(stop, len(ge))
        chunk = max(1, self.config.catchup_chunk)

        def answer() -> None:
            for s in range(start, stop, chunk):
                self.node.step(LogChunk(s, tuple(ge[s : min(stop, s + chunk)])))

        self._input(answer)
