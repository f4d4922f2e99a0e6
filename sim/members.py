"""The adapter that drives one member's ordering node inside the simulation.

Theory of operation
-------------------
`SimMember` owns the node (the real `kdsync.core` object) while the process
is up, and drives it the way `kdsync/core/__init__.py` documents:

* inputs — peer bytes (`receive`), consumed source batches (`submit`, all
  that one fetch returned in one call), `durable`, `LogChunk` answers,
  `tick` — are fed in as they happen; after any input the member asks the
  host for one flush at the current instant, so `ready()` runs once per
  simulated instant, not once per input;
* a flush does the Ready handshake: persist hard state to the disk, send the
  messages, append deliveries to the global topic (durable `produce_ms`
  later, then `node.durable(end)`), answer reads `consume_ms` later,
  `advance()`.

*Shards.*  With `shards: K` a site runs K nodes, one per shard: node s
orders the source partitions p with p % K == s and writes partition s of
the site's global topic; the K nodes fail together (one site) and share the
site's `member_cost.cores`.

*CPU.*  With a `member_cost` in the scenario, a member is one server with a
queue, like the single-threaded real member: an input that arrives while it
is busy waits; a service takes every input waiting, runs one Ready
handshake, and its outputs (messages, deliveries, reads) leave when the
service time has passed — ready_us + message_us per peer message in and
out + event_us per record submitted or delivered.  Under load inputs pile
up and one service answers many of them (coalescing), and a member that
cannot keep up falls behind, as a real one does.  A service takes every
peer message and tick waiting but at most SERVICE_RECORDS fetched records
(a backlog does not starve heartbeats), and the consumer pauses while
`kafka.max_inflight` records are consumed but not yet durable.  Without it a member costs
nothing and answers at the instant of its inputs.

A crash drops the node object, the consumer position and every produce not
yet acknowledged by the brokers (`epoch` bumps, so callbacks scheduled by the
dead process are ignored).  A restart builds a new node from the durable
state: start_seq = length of the global topic, watermarks = highest origin
offset per (origin, partition) in it, hard state from disk; the consumer
resumes from the committed offsets (committed `commit_ms` after the member's
own records became durable), so already ordered records are submitted again
and the core's exactly-once rule must drop them.  A clock pause holds every
input until the member resumes.

The member talks to the rest of the simulation only through `Host` (time,
scheduling, the network, the checker's observations): it never imports the
runner.
"""

from __future__ import annotations

import random
from collections import deque
from functools import partial
from typing import Any, Callable, Protocol

from kdsync.core import Batch, Delivery, HardState, LogChunk, NodeConfig, OrderingNode, RemoteProtocolError
from kdsync.core.liveness import Dormancy, Ping, PeerLiveness, views_of
from kdsync.testing.clocks import ClockFault
from sim.kafka import Cluster
from sim.quantiles import inverse_cdf
from sim.scenario import MemberCostSpec

__all__ = ["Host", "SimMember"]


SERVICE_RECORDS = 5_000  # records one service takes at most (cost model)


class Host(Protocol):
    """What a member needs from the simulation around it."""

    seed: int
    produce_s: float
    consume_s: float
    sink_linger_s: float  # the member's producer: linger.ms
    sink_extra_s: float  # replication ack (acks=all) after the broker append (produce_s)
    commit_s: float
    max_inflight: int  # records consumed and not yet durable before a consumer pauses
    quiesce: bool  # kdsync run's [protocol] quiesce: idle nodes sleep, members ping (kdsync.core.liveness)
    peers: dict[str, list[str]]  # member -> the other members
    tick_s: float  # one tick of the nodes

    @property
    def now(self) -> float: ...

    def after(self, delay: float, fn: Callable[[Any], None], arg: Any) -> None:
        """Call fn(arg) `delay` seconds from now."""

    def request_flush(self, member: "SimMember") -> None:
        """Call member.flush() once at this instant, after its inputs."""

    def send(self, src: str, dst: str, data: bytes, shard: int) -> None:
        """To shard `shard`'s node at member `dst`."""

    def make_node(self, config: NodeConfig, **kwargs) -> OrderingNode:
        """The node for `config`; raises ScenarioError when the core refuses it."""

    def witness_disk(self, member: str, shard: int) -> HardState | None: ...

    def save_witness_disk(self, member: str, shard: int, hs: HardState) -> None: ...

    def observe_deliveries(self, node: "SimMember", deliveries: tuple[Delivery, ...]) -> None:
        """The checker's view of what a node handed over (split-brain check)."""

    def observe_gap(self, node: "SimMember", expected: int, got: int) -> None: ...

    def observe_views(self, node: "SimMember", views) -> None:
        """The checker's view of the views a node installed (split-brain check)."""

    def cpu_acquire(self, node: "SimMember") -> None:
        """Call node._serve(epoch) when one of its site's cores is free."""

    def clock_fault(self, member: str) -> ClockFault:
        """The member's wall clock (scenario `clocks:`; exact by default)."""

    def cpu_release(self, node: "SimMember") -> None:
        """The node's service is over: its core is free."""

    def topology_changed(self) -> None:
        """A process went down or came up (the majority bookkeeping)."""


class SimMember:
    """One kdsync member process (and, unless a witness, its cluster)."""

    def __init__(self, host: Host, member_id: str, config: NodeConfig, cluster: Cluster | None,
                 cost: MemberCostSpec | None = None, shard: int = 0, shards: int = 1) -> None:
        self.host = host
        self.shard = shard  # this node orders source partitions p with p % shards == shard
        self.shards = shards
        self.max_inflight = host.max_inflight
        self._throttled = False  # the consumer paused on back-pressure
        self.topic = cluster.topics[shard] if cluster is not None else None
        self.cost = cost if cost is not None and cost.costs_anything() else None
        self._queue: deque[tuple[Callable[[], None], int, int, int]] = deque()  # (input, messages, records, ticks) waiting for the CPU
        self.busy = False  # a service is running (cost model)
        self.cpu_s = 0.0  # total service time (cost model)
        self.id = member_id
        self.config = config
        self.cluster = cluster
        self.node: OrderingNode | None = None
        self.up = False
        self.stopping = False  # a clean stop was asked of this process (its leave may wait out a clock pause)
        self.epoch = 0  # bumps on crash: stale callbacks compare against it
        self.starts = 0
        self.paused_until = -1.0
        self._buffer: list[Callable[[], None]] = []  # inputs held during a clock pause
        self.flush_pending = False
        self.positions: list[int] = []  # consumer position (next offset) per source partition
        self._cursor: list[int] = []  # index of the batch holding positions[p]
        self.status = ""
        self.views = 0
        self.bad_messages = 0
        self.deduplicated = 0
        self.slept = 0  # quiesce: times the node fell asleep
        self._wakeup_rng = random.Random(f"{host.seed}/wakeup/{member_id}/{shard}")
        self.fetched_upto = -1.0  # kafka.fetch_wait_ms: the snapshot time of the last fetch (the broker side)
        self._sink_batch: list | None = None
        self.clock_fault = host.clock_fault(member_id)
        self.uses_clock = config.protocol == "clock"
        self._clock_at, self._clock_node = -1.0, None  # the instant and node the clock was last given (_clock)
        self.dorm: Dormancy | None = None  # quiesce: this process's liveness and sleeping node
        self.stages: dict | None = None  # (partition, first offset) -> [fetched, handed] of own batches (bench)  # the member's producer batch while it lingers: [(deliveries, handed)]

    # ------------------------------------------------------------ life cycle
    def start(self) -> None:
        if self.up and self.stopping:
            self.crash()  # a clean stop still under way (waiting for its group, or its pause): that process ends
        if self.up:
            return
        c = self.cluster
        host = self.host
        name = self.id if self.shards == 1 else f"{self.id}/{self.shard}"
        kwargs: dict = {"rng": random.Random(f"{host.seed}/node/{name}/{self.starts}")}
        if c is not None:
            kwargs.update(start_seq=self.topic.length, watermarks=dict(self.topic.watermarks),
                          hard_state=c.disks[self.shard])
            self.positions = list(c.committed)
            self._cursor = [part.index_of(off) for part, off in zip(c.source, self.positions)]
        else:
            kwargs["hard_state"] = host.witness_disk(self.id, self.shard)
        self.starts += 1
        self.node = host.make_node(self.config, **kwargs)
        cfg = self.config
        if host.quiesce or cfg.adaptive_suspect:  # a new process: its liveness starts afresh
            self.dorm = Dormancy(PeerLiveness(host.peers[self.id], cfg.heartbeat_ticks, cfg.suspect_ticks,
                                              cfg.adaptive_suspect))
        self.up = True
        self.paused_until = -1.0
        self._buffer.clear()
        if c is not None:
            host.after(host.consume_s, self._poll_cb, self.epoch)
        host.request_flush(self)

    def crash(self) -> None:
        if not self.up:
            return
        self._collect_stats()
        self.up = False
        self.node = None
        self.dorm = None
        self.epoch += 1
        self._buffer.clear()
        self._queue.clear()
        self._sink_batch = None  # a lingering batch dies with the process
        self.busy = False
        self.paused_until = -1.0
        self.stopping = False
        self.status = "down"

    def stop(self, bound_s: float) -> None:
        """A clean stop (SIGTERM): the node leaves (`OrderingNode.leave`); the
        process ends once the group took note of it, or `bound_s` later at
        the latest, and is then down as after a crash (memory gone, disk and
        cluster kept)."""
        if not self.up or self.stopping:
            return
        self.stopping = True
        self._input(lambda: self.node.leave())
        self.host.after(self.host.tick_s, self._stop_check, (self.epoch, self.host.now + bound_s))

    def _stop_check(self, arg) -> None:
        epoch, deadline = arg
        if epoch != self.epoch or not self.up:
            return
        if (self.node is not None and self.node.left and not self.busy) or self.host.now >= deadline:
            self.crash()
            self.host.topology_changed()
            return
        self.host.after(self.host.tick_s, self._stop_check, arg)

    def pause(self, until: float) -> None:
        if self.up:
            self.paused_until = max(self.paused_until, until)
            self.host.after(until - self.host.now, self._resume_cb, self.epoch)

    def resume(self) -> None:
        """End a clock pause now (run every input held meanwhile, in order)."""
        if not self.up or self.paused_until < 0:
            return
        self.paused_until = -1.0
        held, self._buffer = self._buffer, []
        if self.cost is not None:
            self._queue.extend((fn, 0, 0, 0) for fn in held)
            self.poll()
            self._kick()
            return
        for fn in held:
            if self.node is None:
                break
            fn()
        self.poll()
        self.host.request_flush(self)

    def _resume_cb(self, epoch: int) -> None:
        if epoch == self.epoch and self.paused_until >= 0 and self.host.now >= self.paused_until:
            self.resume()

    @property
    def paused(self) -> bool:
        return self.paused_until >= 0

    def _collect_stats(self) -> None:
        if self.node is not None:
            self.deduplicated += int(self.node.stats.get("deduplicated", 0))
        if self.dorm is not None:
            self.slept += self.dorm.slept
            self.dorm.slept = 0

    # ---------------------------------------------------------------- inputs
    def _input(self, fn: Callable[..., None], *args: Any, msgs: int = 0, events: int = 0, ticks: int = 0) -> None:
        """fn(*args) now, or held (a clock pause) or queued for the CPU (the cost model)."""
        if self.paused_until >= 0:
            self._buffer.append(partial(fn, *args) if args else fn)
            return
        if self.cost is not None:
            self._queue.append((partial(fn, *args) if args else fn, msgs, events, ticks))
            self._kick()
            return
        fn(*args)  # no closure on the common path (hot: every message)
        if not self.flush_pending:
            self.host.request_flush(self)

    def on_message(self, src: str, data: bytes) -> None:
        if not self.up:
            return  # a dead process receives nothing
        if self.dorm is not None:
            ping = isinstance(data, Ping)  # the member-level ping of `quiesce`: never handed to a node
            self.dorm.liveness.heard(src, ping, bytes(data) if ping else b"")
            if ping:
                return
        self._input(self._receive, src, data, msgs=1)

    def _wake(self) -> None:
        """Before any input reaches the node: a sleeping node wakes (quiesce)."""
        if self.dorm is not None and self.dorm.asleep:
            self.dorm.wake(0, self.node)

    def _clock(self) -> None:
        """The node's wall clock reading now (before every input; only the
        clock protocol reads it)."""
        if self.uses_clock:
            now = self.host.now
            node = self.node
            if now != self._clock_at or node is not self._clock_node:  # once per instant and node
                self._clock_at, self._clock_node = now, node
                node.clock(self.clock_fault.read(int(now * 1e6)))

    def _receive(self, src: str, data: bytes) -> None:
        self._wake()
        self._clock()
        try:
            self.node.receive(src, data)
        except RemoteProtocolError:
            self.bad_messages += 1

    def on_tick(self) -> None:
        """One tick of the node (a tick is its own instant; with the cost model it
        waits for the CPU like any input)."""
        if not self.up or self.paused_until >= 0:
            return
        if self.cost is not None:
            self._input(self._tick_node, ticks=1)
            return
        self._tick_node()
        self.flush()

    def _tick_node(self) -> None:
        d = self.dorm
        if d is not None:  # the member's liveness tick: pings, a silent peer wakes the node, which may sleep
            live = d.liveness
            if live.tick():
                live.views = views_of(self.node)
                for p in live.peers:
                    self.host.send(self.id, p, Ping(live.views), self.shard)
            if live.newly_silent():
                d.wake_all()
            d.wake_due()
            if self.host.quiesce and d.try_sleep(0, self.node):
                return
            d.refresh(self.node)
        self._clock()
        self.node.tick()

    def wake(self, _arg: Any = None) -> None:
        """A fetch returned (kafka.poll_ms = 0): hand it over at once.  Whatever
        process is running now consumes it (the source topic outlives crashes)."""
        self.poll()

    def _poll_cb(self, epoch: int) -> None:
        if epoch == self.epoch:
            self.poll()

    def poll(self, horizon: float | None = None) -> None:
        """Fetch every batch visible past the consumer position (visible by
        `horizon`: a fetch's snapshot; default now); submit them in one call."""
        if not self.up or self.paused_until >= 0 or self.cluster is None:
            return
        src = self.cluster.source
        # float slack: the wake-up time is vis, give or take an ulp
        horizon = (self.host.now if horizon is None else horizon) + 1e-9
        pos, cur = self.positions, self._cursor
        while len(pos) < len(src):
            pos.append(0)
            cur.append(0)
        out: list[Batch] = []
        # back-pressure, like the real member: records consumed but not yet durable in
        # its global topic stay under max_inflight (the consumer pauses meanwhile)
        wm = self.topic.watermarks
        me = self.id
        room = self.max_inflight - sum(pos[p] - wm.get((me, p), -1) - 1
                                       for p in range(self.shard, len(src), self.shards))
        self._throttled = False
        for p in range(self.shard, len(src), self.shards):
            part = src[p]
            i = cur[p]
            batches, vis = part.batches, part.vis
            n = len(batches)
            while i < n and vis[i] <= horizon:
                if room <= 0:
                    self._throttled = True
                    break
                b = batches[i]
                room -= b.first_offset + b.count - pos[p]
                skip = pos[p] - b.first_offset
                out.append(b.slice(skip) if skip > 0 else b)
                if self.stages is not None:
                    self.stages[(p, out[-1].first_offset)] = [self.host.now, None]
                pos[p] = b.first_offset + b.count
                i += 1
            cur[p] = i
        if out:
            if self.cost is not None:
                self._input(self._submit, out, events=sum(b.count for b in out))
                return
            self._submit(out)
            if not self.flush_pending:
                self.host.request_flush(self)

    def _submit(self, out: list[Batch]) -> None:
        self._wake()
        self.node.submit(out)

    def _durable(self, end: int) -> None:
        self._wake()
        self.node.durable(end)

    # ----------------------------------------------------------------- flush
    def flush(self) -> None:
        """The Ready handshake, once per simulated instant (no cost model)."""
        self.flush_pending = False
        if self.node is None or self.paused_until >= 0:
            return
        self._emit(self._handshake())

    def _handshake(self) -> list:
        """Drain the node's Ready records; returns them (with hard state
        already recorded on the node side: the disk is written on emit)."""
        node = self.node
        self._clock()
        out = []
        rounds = 0
        while node.has_ready() and rounds < 16:
            rounds += 1
            rd = node.ready()
            out.append(rd)
            node.advance(rd)
        return out

    def _emit(self, ready_list: list) -> None:
        """Do the I/O of Ready records, in their order (see kdsync.core.Ready)."""
        host = self.host
        send = host.send
        me = self.id
        shard = self.shard
        for rd in ready_list:
            if rd.hard_state is not None:
                if self.cluster is not None:
                    self.cluster.disks[shard] = rd.hard_state
                else:
                    host.save_witness_disk(self.id, shard, rd.hard_state)
            for m in rd.messages:
                send(me, m.to, m.data, shard)
            if rd.deliveries:
                self._deliver(rd.deliveries)
            for r in rd.reads:
                host.after(host.consume_s, self._serve_read, (self.epoch, r.start, r.stop))
            if rd.views:
                self.views += len(rd.views)
                host.observe_views(self, rd.views)
            if rd.status:
                self.status = rd.status

    # ------------------------------------------------------------- the CPU
    def _kick(self) -> None:
        """Ask for a core of the site (after the other inputs of this instant) if idle."""
        if not self.busy and self._queue and self.paused_until < 0:
            self.busy = True
            delay = self._wakeup_delay()
            if delay > 0.0:  # an idle process waits for the scheduler first
                self.host.after(delay, self._woken, self.epoch)
                return
            self.host.cpu_acquire(self)

    def _wakeup_delay(self) -> float:
        c = self.cost
        if c.wakeup_quantiles_us:  # the measured distribution, by inverse CDF
            return inverse_cdf(c.wakeup_quantiles_us, self._wakeup_rng.random()) / 1e6
        if c.wakeup_us > 0.0:
            return self._wakeup_rng.expovariate(1e6 / c.wakeup_us)
        return 0.0

    def _woken(self, epoch: int) -> None:
        if epoch == self.epoch and self.busy:
            self.host.cpu_acquire(self)

    def _serve(self, epoch: int) -> None:
        """A core is ours: take every waiting input, one Ready handshake."""
        if epoch != self.epoch or self.node is None or self.paused_until >= 0:
            # died, or paused, since it asked: give the core back (a paused member waits)
            self.host.cpu_release(self)
            if epoch == self.epoch:
                self.busy = False
            return
        # every peer message and tick waiting, and fetched records up to SERVICE_RECORDS
        # (the real member drains its sockets every loop iteration and takes a
        # bounded fetch: heartbeats are not starved behind a backlog)
        q = self._queue
        msgs_in = events_in = 0
        records = 0
        held: list[tuple[Callable[[], None], int, int, int]] = []
        ticks = 0
        while q:
            fn, m, e, k = q.popleft()
            if e and records and records + e > SERVICE_RECORDS:
                held.append((fn, m, e, k))  # a fetch for the next service; messages and ticks go first
                continue
            records += e
            msgs_in += m
            events_in += e
            ticks += k
            fn()
        q.extend(held)
        out = self._handshake()
        c = self.cost
        msgs_out = sum(len(rd.messages) for rd in out)
        events_out = sum(d.count for rd in out for d in rd.deliveries)
        t = (c.ready_us * max(1, len(out)) + c.message_us * (msgs_in + msgs_out)
             + c.event_us * (events_in + events_out) + c.tick_us * ticks) / 1e6 * c.slowdown
        self.cpu_s += t
        self.host.after(t, self._served, (epoch, out))

    def _served(self, arg) -> None:
        epoch, out = arg
        self.host.cpu_release(self)
        if epoch != self.epoch:
            return  # the process died meanwhile: its outputs never left
        self._emit(out)
        self.busy = False
        self._kick()

    def _deliver(self, deliveries: tuple[Delivery, ...]) -> None:
        host = self.host
        host.observe_deliveries(self, deliveries)
        if self.cluster is None:  # a witness has no global topic: durable as soon as handed over
            host.after(0.0, self._witness_durable_cb, (self.epoch, deliveries[-1].end_seq))
            return
        now = host.now
        if self.stages is not None:
            me = self.id
            for d in deliveries:
                for b in d.batches:
                    st = self.stages.get((b.partition, b.first_offset)) if b.origin == me else None
                    if st is not None and st[1] is None:
                        st[1] = now
        if host.sink_linger_s <= 0.0:
            host.after(host.produce_s + host.sink_extra_s, self._durable_cb, (self.epoch, [(deliveries, now)]))
            return
        # the member's producer (linger.ms): the first delivery opens a batch that
        # leaves sink_linger_s later with everything handed over meanwhile
        if self._sink_batch is None:
            self._sink_batch = []
            host.after(host.sink_linger_s, self._sink_send, self.epoch)
        self._sink_batch.append((deliveries, now))

    def _sink_send(self, epoch: int) -> None:
        if epoch != self.epoch or self._sink_batch is None:
            return
        batch, self._sink_batch = self._sink_batch, None
        self.host.after(self.host.produce_s + self.host.sink_extra_s, self._durable_cb, (epoch, batch))

    def _durable_cb(self, arg) -> None:
        epoch, handed_over = arg
        if epoch != self.epoch:
            return  # the producer died before the brokers acknowledged: the append is lost
        topic = self.topic
        now = self.host.now
        me = self.id
        commits: dict[int, int] = {}
        for deliveries, handed in handed_over:
            for d in deliveries:
                if d.first_seq != topic.length:
                    self.host.observe_gap(self, topic.length, d.first_seq)
                for b in d.batches:
                    topic.append(b, now, handed)
                    if b.origin == me:
                        commits[b.partition] = b.first_offset + b.count
        if commits:
            self.host.after(self.host.commit_s, self._commit_cb, (self.epoch, commits))
            if self._throttled:  # room again for the paused consumer
                self.poll()
        end = topic.length
        self._input(self._durable, end)

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
            self._input(self._durable, end)

    def _serve_read(self, arg) -> None:
        epoch, start, stop = arg
        if epoch != self.epoch or self.cluster is None:
            return
        topic = self.topic
        stop = min(stop, topic.length)
        chunk = max(1, self.config.catchup_chunk)

        def answer() -> None:
            self._wake()
            for s in range(start, stop, chunk):
                self.node.step(LogChunk(s, tuple(topic.read(s, min(stop, s + chunk)))))

        self._input(answer, events=max(0, stop - start))
