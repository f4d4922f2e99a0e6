"""One simulation run: scenario + seed in, summary + trace + violations out.

Theory of operation
-------------------
One `simpy.Environment` (time in seconds) holds everything.  Each member
ticks its node every `TICK_S` from a phase drawn from the seed; the workload
(`sim.workload`: producer batches, one per linger tick and partition) is
appended to the source topic of its cluster and wakes the member's consumer
`produce_ms + consume_ms` after the producer sent (the source acknowledgement
is `produce_ms` after sending: that is the records' `submit_ts`); faults run
from one process in file order; at `duration_s` every partition, link fault
and clock pause ends, and the run goes on for `settle_s` so live members can
converge.  Then the checkers judge the global topics.  The simulation is the
members' `Host`: they reach time, scheduling, the network and the checker
only through it.

Everything random comes from its own `random.Random` seeded with a string
derived from the run seed (string seeds hash with SHA-512, so the stream does
not depend on PYTHONHASHSEED); iteration is over lists in rank or file order,
so the same scenario and seed give the same run, byte for byte.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

import simpy
from simpy.events import Timeout

from kdsync.invariants import TRACE_COLUMNS  # noqa: F401  (the trace schema, for callers of the runner)
from kdsync.testing.stats import percentiles, weighted_percentile
from kdsync.testing.clocks import PERFECT, ClockFault
from kdsync.core import Batch, Delivery, HardState, LocalProtocolError, NodeConfig, OrderingNode, make_node
from kdsync.core.messages import DecodeCache
from sim.observer import MIRROR_TOLERATED, Checker, Violation
from sim.broker_fetch import FetchModel
from sim.faults import FaultPlayer
from sim.kafka import Cluster
from sim.members import SERVICE_RECORDS, SimMember
from sim.network import SimNetwork
from sim.scenario import Scenario, ScenarioError
from sim.trace import TraceSource, batch_acks, batch_counts
from sim.workload import writes

TICK_S = 0.010  # one node tick = 10 ms of simulated time
GRACE_S = 0.5  # stop_when_settled: how long to keep running after convergence
WORKLOAD_BLOCK_S = 1.0  # source topics are written this far ahead (in one go)
# Node counts (ticks): NodeConfig defaults — heartbeat 2 (20 ms), suspect 10
# (100 ms), retransmit 3 (30 ms).  Scenarios with WAN latencies above ~80 ms
# RTT get suspect_ticks scaled to stay above 3 RTTs (see node_config()).



def node_config(s: Scenario, member_id: str) -> NodeConfig:
    """The NodeConfig the simulator gives a member of scenario `s`.

    Failure suspicion must outlast a few round trips, or a slow WAN looks like
    a dead peer: suspect_ticks >= 3 worst-case RTTs (and >= the default).
    With a member CPU model, a member busy with one long service (a fetch
    plus a slot of every sender delivered) must not look dead either:
    suspect_ticks >= 3 such services too.  Heartbeats come 4 times per
    suspicion timeout, not more often (every member heartbeats every peer:
    with 50 sites at the default 2 ticks they would outnumber every other
    message).
    """
    base = NodeConfig(member_id=member_id, members=s.member_ids)
    lead_ms = next(m.clock_lead_ms for m in s.members if m.id == member_id)
    lead_us, auto_lead = int((lead_ms or 0) * 1000), lead_ms is None
    if s.timing is not None:  # the real member's timers, counted in its ticks (kdsync/config.py ticks())
        t = s.timing.resolved(s.protocol)

        def ticks(ms: float) -> int:
            return max(1, round(ms / t["tick_ms"]))

        return NodeConfig(member_id=member_id, members=s.member_ids,
                          roles={m.id: m.role for m in s.members if m.role == "witness"}, protocol=s.protocol,
                          suspect_ticks=ticks(t["suspect_ms"]), heartbeat_ticks=ticks(t["heartbeat_ms"]),
                          retransmit_ticks=ticks(t["retransmit_ms"]), clock_lead_us=lead_us, auto_lead=auto_lead,
                          commit_quorum=s.commit_quorum, adaptive_suspect=s.adaptive_suspect,
                          crash_fence=s.crash_fence, lift_fence=s.lift_fence)
    worst_ms = s.network.default.latency_ms or 1.0
    worst_ms += 3 * (s.network.default.jitter_ms or 0.0)
    for o in s.network.links:
        worst_ms = max(worst_ms, (o.latency_ms or 0.0) + 3 * (o.jitter_ms or 0.0))
    rtt_ticks = 2 * worst_ms / 1000.0 / TICK_S
    suspect = max(base.suspect_ticks, int(3 * rtt_ticks + 0.999))
    c = s.member_cost
    if c is not None and c.costs_anything():
        senders = len(s.clusters)
        service_s = (c.ready_us + c.message_us * 2 * len(s.members)
                     + c.event_us * (SERVICE_RECORDS + senders * base.max_batch)) / 1e6
        suspect = max(suspect, int(3 * (rtt_ticks + service_s / TICK_S) + 0.999))
    return NodeConfig(
        member_id=member_id,
        members=s.member_ids,
        roles={m.id: m.role for m in s.members if m.role == "witness"},
        protocol=s.protocol,
        suspect_ticks=suspect,
        # adaptive suspicion needs pings well inside the ceiling to suspect sooner than it
        heartbeat_ticks=max(base.heartbeat_ticks, suspect // (10 if s.adaptive_suspect else 4)),
        retransmit_ticks=max(base.retransmit_ticks, int(rtt_ticks + 0.999) + 1),
        clock_lead_us=lead_us,
        auto_lead=auto_lead,
        commit_quorum=s.commit_quorum,
        adaptive_suspect=s.adaptive_suspect,
        crash_fence=s.crash_fence,
        lift_fence=s.lift_fence,
    )


@dataclass
class RunResult:
    summary: dict[str, Any]
    violations: list[Violation]
    failing: list[Violation]  # the violations that make the exit code 1
    _trace_source: TraceSource
    _trace: dict[str, list] | None = None

    @property
    def exit_code(self) -> int:
        return 1 if self.failing else 0

    @property
    def trace(self) -> dict[str, list]:
        """column -> values (TRACE_COLUMNS): one row per (member, event in its global topic)."""
        if self._trace is None:
            self._trace = self._trace_source.columns()
        return self._trace

    def trace_chunks(self) -> Iterator[dict[str, list]]:
        """The rows of `trace` in parts (one shard and member each), built one
        at a time: what a writer streams without holding the whole trace."""
        if self._trace is not None:
            yield self._trace
        else:
            yield from self._trace_source.chunks()

    def trace_tables(self) -> Iterator:
        """The rows of `trace` as one `pyarrow.Table` per shard and member."""
        if self._trace is not None:
            import pyarrow as pa

            yield pa.table(self._trace)
        else:
            yield from self._trace_source.tables()


NodeFactory = Callable[..., Any]


def _call(ev) -> None:
    fn, arg = ev.value
    fn(arg)


class _CpuPool:
    """The cores of one site (`member_cost.cores`): at most that many of its
    nodes (one per shard) are served at once; the others wait, first come
    first served."""

    def __init__(self, host: "Simulation", cores: int) -> None:
        self.host = host
        self.free = cores
        self.waiting: deque[SimMember] = deque()

    def acquire(self, node: SimMember) -> None:
        if self.free:
            self.free -= 1
            self.host.after(0.0, node._serve, node.epoch)
        else:
            self.waiting.append(node)

    def release(self) -> None:
        if self.waiting:
            node = self.waiting.popleft()
            self.host.after(0.0, node._serve, node.epoch)
        else:
            self.free += 1


class Simulation:
    """One run: the SimPy environment, the members (as their `Host`), the
    network, the workload, the faults and the checker's observations."""

    def __init__(self, scenario: Scenario, seed: int, node_factory: NodeFactory | None = None) -> None:
        self.scenario = scenario
        self.seed = seed
        self.env = simpy.Environment()
        self.produce_s = scenario.kafka.produce_ms / 1000.0
        self.consume_s = scenario.kafka.consume_ms / 1000.0
        self.poll_s = scenario.kafka.poll_ms / 1000.0
        self.commit_s = scenario.kafka.commit_ms / 1000.0
        self.max_inflight = scenario.kafka.max_inflight
        self.quiesce = scenario.quiesce  # kdsync run's [protocol] quiesce (kdsync.core.liveness)
        self.peers = {m: [p for p in scenario.member_ids if p != m] for m in scenario.member_ids}
        k = scenario.kafka
        self.sink_linger_s = k.sink_linger_ms / 1000.0
        self.sink_extra_s = k.ack_ms / 1000.0
        self.fetch_wait_s = k.fetch_wait_ms / 1000.0  # 0: no fetch model (visible consume_ms after the ack)
        self.fetch_overhead_s = k.fetch_overhead_ms / 1000.0
        self.fetch_check_s = self.fetch_wait_s if k.fetch_check_ms is None else k.fetch_check_ms / 1000.0
        self.written_until: dict[str, float] = {}  # per cluster: its source topic is written up to then
        self.tick_s = scenario.timing.resolved(scenario.protocol)["tick_ms"] / 1000.0 if scenario.timing is not None else TICK_S
        self.node_factory = node_factory or make_node
        self.decodes = DecodeCache()  # a broadcast reaches every node as one object: decoded once
        self.shards = k = scenario.shards
        self.checkers = [Checker(scenario.member_ids, s, k) for s in range(k)]  # one per shard (ordering group)
        self.first_view_s: dict[tuple[str, int], float] = {}  # (member, shard) -> when it first entered a view
        self._witness_disk: dict[tuple[str, int], HardState] = {}
        self.sites = scenario.member_ids  # rank order
        self.clusters = {m.id: Cluster(m.id, k) for m in scenario.members if m.role == "member"}
        self.site_nodes: dict[str, list[SimMember]] = {}
        for spec in scenario.members:
            cfg = node_config(scenario, spec.id)
            self.site_nodes[spec.id] = [SimMember(self, spec.id, cfg, self.clusters.get(spec.id), scenario.member_cost,
                                                  shard, k) for shard in range(k)]
        self.order = [n for site in self.sites for n in self.site_nodes[site]]  # every node, rank then shard
        cost = scenario.member_cost
        self.cpu = {site: _CpuPool(self, cost.cores) for site in self.sites} if cost is not None else {}
        self.network = SimNetwork(self.env, scenario.member_ids, scenario.network, seed, self._on_message)
        self._flush_list: list[SimMember] = []
        self._flush_scheduled = False
        self._majority_cache: dict[str, bool] | None = None
        self.end_s = scenario.duration_s + scenario.settle_s
        self.fetches = FetchModel(self)
        self.faults = FaultPlayer(self)

    @property
    def checker(self) -> Checker:
        """The checker of an unsharded run."""
        return self.checkers[0]

    @property
    def members(self) -> dict[str, SimMember]:
        """site -> its node of shard 0 (every node of an unsharded run)."""
        return {site: nodes[0] for site, nodes in self.site_nodes.items()}

    # ------------------------------------------------------------ the Host
    @property
    def now(self) -> float:
        return self.env.now

    def after(self, delay: float, fn: Callable[[Any], None], arg: Any) -> None:
        """Call fn(arg) `delay` seconds from now."""
        Timeout(self.env, delay, (fn, arg)).callbacks.append(_call)

    def request_flush(self, m: SimMember) -> None:
        """Flush `m` once at this instant, after every input of the instant.

        When nothing else is scheduled for this instant the flush runs at once;
        otherwise one shared zero-delay event flushes everyone who asked."""
        if not self._flush_scheduled and self.env.peek() > self.env.now:
            m.flush()
            return
        m.flush_pending = True
        self._flush_list.append(m)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            Timeout(self.env, 0.0).callbacks.append(self._run_flushes)

    def _run_flushes(self, _e) -> None:
        self._flush_scheduled = False
        todo, self._flush_list = self._flush_list, []
        for m in todo:
            if m.flush_pending:
                m.flush()

    def send(self, src: str, dst: str, data: bytes, shard: int = 0) -> None:
        self.network.send(src, dst, data, shard)

    def make_node(self, config: NodeConfig, **kwargs) -> OrderingNode:
        try:
            return self.node_factory(config, decodes=self.decodes, **kwargs)
        except LocalProtocolError as err:  # the core refuses this configuration: the scenario's fault
            raise ScenarioError(
                f"{self.scenario.name}: protocol {config.protocol} refuses member {config.member_id}: {err}"
            ) from None

    def witness_disk(self, member: str, shard: int = 0) -> HardState | None:
        return self._witness_disk.get((member, shard))

    def save_witness_disk(self, member: str, shard: int, hs: HardState) -> None:
        self._witness_disk[(member, shard)] = hs

    def observe_deliveries(self, node: SimMember, deliveries: tuple[Delivery, ...]) -> None:
        self.checkers[node.shard].on_deliveries(node.id, deliveries, self.in_majority(node.id))

    def observe_gap(self, node: SimMember, expected: int, got: int) -> None:
        self.checkers[node.shard].gap(node.id, expected, got)

    def observe_views(self, node: SimMember, views) -> None:
        self.first_view_s.setdefault((node.id, node.shard), self.env.now)
        self.checkers[node.shard].on_views(node.id, views)

    def group_ready_s(self) -> float | None:
        """When every member (every shard) had entered its first view: the
        instant a real run's writers may start (bench/simreal.py waits for
        it); None if some member never did."""
        want = [(m, sh) for m in self.site_nodes for sh in range(self.shards)]
        if any(w not in self.first_view_s for w in want):
            return None
        return max(self.first_view_s[w] for w in want)

    def clock_fault(self, member: str) -> ClockFault:
        for c in self.scenario.clocks:
            if c.member == member:
                return c.fault()
        return PERFECT

    def cpu_acquire(self, node: SimMember) -> None:
        self.cpu[node.id].acquire(node)

    def cpu_release(self, node: SimMember) -> None:
        self.cpu[node.id].release()

    def _on_message(self, src: str, dst: str, data: bytes, shard: int = 0) -> None:
        self.site_nodes[dst][shard].on_message(src, data)

    # ------------------------------------------------------------ majority
    def topology_changed(self) -> None:
        self._majority_cache = None

    def in_majority(self, member: str) -> bool:
        """Is `member` in a group of up members, connected both ways, larger than half the configuration?"""
        cache = self._majority_cache
        if cache is None:
            cache = self._majority_cache = self._compute_majority()
        return cache.get(member, False)

    def _compute_majority(self) -> dict[str, bool]:
        up = [site for site in self.sites if self.site_nodes[site][0].up]  # a site's nodes fail together
        n = len(self.sites)
        can = self.network.can_send
        out: dict[str, bool] = {}
        seen: set[str] = set()
        for start in up:
            if start in seen:
                continue
            comp, stack = {start}, [start]
            while stack:
                a = stack.pop()
                for b in up:
                    if b not in comp and can(a, b) and can(b, a):
                        comp.add(b)
                        stack.append(b)
            seen |= comp
            for m in comp:
                out[m] = 2 * len(comp) > n
        return out

    # ------------------------------------------------------------- workload
    def _setup_workload(self) -> None:
        s = self.scenario
        for m in s.clusters:
            parts = max((w.partitions for w in s.workload if w.member in ("all", m)), default=0)
            if parts:
                self.clusters[m].ensure_partitions(parts)
                self.env.process(self._producer(m))

    def _producer(self, origin: str):
        """Writes the cluster's source topic one block of WORKLOAD_BLOCK_S ahead:
        the producer batches of `sim.workload`, merged in time order, get their
        offsets; each becomes visible to the consumer produce+consume later
        (the consumer of the shard that orders its partition)."""
        env = self.env
        c = self.clusters[origin]
        nodes = self.site_nodes[origin]
        k = self.shards
        fetching = self.fetch_wait_s > 0.0  # the fetch loops (sim.broker_fetch) hand batches over
        lag = self.produce_s + (0.0 if fetching else self.consume_s)
        wake = self.poll_s <= 0.0 and not fetching
        for block, ws in enumerate(writes(self.scenario, self.seed, origin, WORKLOAD_BLOCK_S)):
            self.written_until[origin] = (block + 1) * WORKLOAD_BLOCK_S
            last_vis: dict[int, float] = {}
            for w in ws:
                part = c.source[w.partition]
                ack = w.t + self.produce_s
                vis = w.t + lag
                part.append(Batch.uniform(origin, w.partition, part.end, w.count, w.payload_bytes,
                                          int(round(w.t * 1000)), fill=_FILL[part.end % len(_FILL)]), ack, vis)
                owner = w.partition % k
                if wake and vis != last_vis.get(owner):  # the consumer wakes when a fetch returns
                    Timeout(env, vis - env.now).callbacks.append(nodes[owner].wake)
                    last_vis[owner] = vis
            nxt = (block + 1) * WORKLOAD_BLOCK_S
            if nxt > env.now:
                yield env.timeout(nxt - env.now)
        self.written_until[origin] = math.inf

    def acknowledged(self) -> int:
        """Records every source cluster acknowledged so far."""
        return sum(c.acknowledged() for c in self.clusters.values())

    def _settle(self):
        yield self.env.timeout(self.scenario.duration_s)
        self.network.heal()
        for m in self.order:
            m.resume()
        self.topology_changed()

    # ---------------------------------------------------------------- ticks
    def _tick(self, ev) -> None:
        m = ev.value
        Timeout(self.env, self.tick_s, m).callbacks.append(self._tick)
        m.on_tick()

    # ------------------------------------------------------------------ run
    def _settled(self) -> bool:
        """Every node up and active in one view (per shard), every global topic
        holding all that was acknowledged."""
        n = self.acknowledged()
        if not all(m.up and m.status == "active" for m in self.order):
            return False
        for shard in range(self.shards):  # a member active in an older view is not done
            views = {getattr(nodes[shard].node, "view", None) for nodes in self.site_nodes.values()}
            if len({v.view_id for v in views if v is not None}) > 1:
                return False
        return all(sum(t.length for t in c.topics) >= n for c in self.clusters.values())

    def _watch_settle(self):
        """Liveness phase shortcut (swarm): once every member is up and active and
        every cluster holds as many records as were acknowledged, run GRACE_S more
        (late wrong deliveries still show) and stop if it is still so.  A view
        change that starts within the grace period (a false suspicion after a
        run of lost heartbeats: swarm seed 1940 of clock) is watched to its end,
        as the full liveness phase would: the shortcut never judges earlier."""
        env = self.env
        yield env.timeout(self.scenario.duration_s)
        while env.now + GRACE_S < self.end_s:
            if self._settled():
                yield env.timeout(GRACE_S)
                if self._settled():
                    self.end_s = env.now
                    Timeout(env, 0.0).callbacks.append(simpy.core.StopSimulation.callback)
                    return
            yield env.timeout(0.1)

    def run(self, progress: Callable[[float], None] | None = None, stop_when_settled: bool = False) -> None:
        phase_rng = random.Random(f"{self.seed}/tick-phase")
        for m in self.order:
            m.start()
            phase = phase_rng.random() * self.tick_s
            Timeout(self.env, phase, m).callbacks.append(self._tick)
            if self.poll_s > 0.0 and m.cluster is not None:
                Timeout(self.env, phase + self.poll_s, m).callbacks.append(self.fetches.poller)
        self._setup_workload()
        if self.fetch_wait_s > 0.0:  # the first fetches, once the producers wrote their first block
            for m in self.order:
                if m.cluster is not None:
                    self.after(0.0, self.fetches.fetch_again, (m, 0.0))
        self.env.process(self.faults.play())
        self.env.process(self._settle())
        if stop_when_settled:
            self.env.process(self._watch_settle())
        step = max(self.end_s / 200.0, self.tick_s) if progress else 0.5
        t = 0.0
        while t < self.end_s:
            t = min(self.end_s, t + step)
            self.env.run(until=t)
            if progress:
                progress(t)
            t = self.env.now  # the settle watcher may have stopped the run early

    # ------------------------------------------------------------- results
    def created_latencies(self):
        """Per record, every cluster: whole ms from its CreateTime in the source
        topic to the CreateTime of its copy in a global topic (the instant the
        member handed it to its producer) — what the real bench measures
        (global record timestamp - kdsync.origin.ts).  The records of a producer
        batch were created evenly over the kafka.linger_ms before it was sent
        (writer_linger_ms: the first opened it writer_linger_ms before, the
        others came evenly after it).  Returns two NumPy arrays of one entry
        per record: the latency (ms) and the CreateTime (simulated s)."""
        import numpy as np

        linger = self.scenario.kafka.linger_ms / 1000.0
        first_opens = self.scenario.kafka.writer_linger_ms / 1000.0  # librdkafka: the first record waits it all
        handed, sent, counts = [], [], []
        for t in (t for c in self.clusters.values() for t in c.topics):
            ack = batch_acks(self.clusters, t)
            ok = ~np.isnan(ack)
            handed.append(np.asarray(t.handed, dtype=np.float64)[ok])
            sent.append(ack[ok] - self.produce_s)
            counts.append(batch_counts(t)[ok])
        if not counts or not sum(len(k) for k in counts):
            return np.zeros(0), np.zeros(0)
        handed, sent, k = np.concatenate(handed), np.concatenate(sent), np.concatenate(counts)
        idx = np.arange(int(k.sum())) - np.repeat(np.cumsum(k) - k, k)  # index of each record in its batch
        if first_opens > 0:
            created = np.repeat(sent, k) - first_opens * (1.0 - idx / np.repeat(k, k))
        else:
            created = np.repeat(sent, k) - linger * (idx + 0.5) / np.repeat(k, k)
        return np.floor(np.repeat(handed, k) * 1000.0) - np.floor(created * 1000.0), created

    def latencies(self) -> list[tuple[float, int]]:
        """(latency ms, records) per delivered batch, every cluster."""
        import numpy as np

        out: list[tuple[float, int]] = []
        for t in (t for c in self.clusters.values() for t in c.topics):
            ack = batch_acks(self.clusters, t)
            ok = ~np.isnan(ack)
            lat = (np.asarray(t.ts, dtype=np.float64)[ok] - ack[ok]) * 1000.0
            out += zip(lat.tolist(), batch_counts(t)[ok].tolist())
        return out


# Source records carry a fill byte that changes with the batch, so a record
# moved to another place is not byte-equal to the one submitted there.
_FILL = [bytes([c]) for c in b"abcdefghijklmnopqrstuvwxyz"]


def run_scenario(
    scenario: Scenario,
    seed: int | None = None,
    *,
    node_factory: NodeFactory | None = None,
    progress: Callable[[float], None] | None = None,
    stop_when_settled: bool = False,
    stages: bool = False,
) -> RunResult:
    """Run `scenario` with `seed` (default: the scenario's own) and judge it.

    `node_factory` replaces `kdsync.core.make_node` (tests use it to plant a
    broken node); `stop_when_settled` ends the liveness phase GRACE_S after
    every member converged instead of at settle_s (the swarm uses it).
    Raises nothing for a bad run: violations are in the result.
    """
    seed = scenario.seed if seed is None else seed
    t0 = time.perf_counter()
    sim = Simulation(scenario, seed, node_factory)
    if stages:
        for m in sim.order:
            m.stages = {}
    sim.run(progress, stop_when_settled)
    wall = time.perf_counter() - t0

    s = scenario
    k = sim.shards
    live = [site for site in sim.clusters if sim.site_nodes[site][0].up]
    violations: list[Violation] = []
    for shard, checker in enumerate(sim.checkers):
        found = checker.finish({site: c.topics[shard] for site, c in sim.clusters.items()}, sim.clusters, live)
        violations += found if k == 1 else [replace(v, detail=f"shard {shard}: {v.detail}") for v in found]

    lat = sorted(sim.latencies())
    n_lat = sum(w for _, w in lat)
    delivered = {site: sum(t.length for t in c.topics) for site, c in sim.clusters.items()}
    n_sub = sim.acknowledged()
    latency = {
        "p50": round(weighted_percentile(lat, 50, linear=True), 3) if n_lat else 0.0,
        "p90": round(weighted_percentile(lat, 90, linear=True), 3) if n_lat else 0.0,
        "p99": round(weighted_percentile(lat, 99, linear=True), 3) if n_lat else 0.0,
        "max": round(lat[-1][0], 3) if lat else 0.0,
    }
    everywhere = min((delivered[m] for m in live), default=0)
    if s.expect.max_p99_ms is not None and latency["p99"] > s.expect.max_p99_ms:
        violations.append(Violation("expect", f"p99 latency {latency['p99']} ms above expect.max_p99_ms {s.expect.max_p99_ms}"))
    if s.expect.min_delivered_fraction is not None and n_sub:
        frac = everywhere / n_sub
        if frac < s.expect.min_delivered_fraction:
            violations.append(
                Violation(
                    "expect",
                    f"delivered fraction {frac:.4f} (fewest at a live member / submitted) below "
                    f"expect.min_delivered_fraction {s.expect.min_delivered_fraction}",
                )
            )
    tolerated = MIRROR_TOLERATED if s.protocol == "mirror" else frozenset()
    failing = [v for v in violations if v.kind not in tolerated]
    for m in sim.order:
        if m.up:
            m._collect_stats()
    counts: dict[str, int] = {}
    for v in violations:
        counts[v.kind] = counts.get(v.kind, 0) + 1
    ready = sim.group_ready_s()
    created_all, created_ready = _created_summaries(sim, ready)
    summary = {
        "scenario": s.name,
        "seed": seed,
        "protocol": s.protocol,
        "members": list(s.member_ids),
        "events_submitted": n_sub,
        "events_delivered": delivered,
        "violations": [v.as_dict() for v in violations],
        "latency_ms": latency,
        "throughput_eps": round(everywhere / s.duration_s, 3),
        "sim_time_s": round(sim.env.now, 6),
        "wall_time_s": round(wall, 3),
        # extensions (docs/outputs.md: keys are only ever added)
        "violation_counts": counts,
        "exit_code": 1 if failing else 0,
        "tick_ms": sim.tick_s * 1000,
        "latency_created_ms": created_all,
        "group_ready_s": None if ready is None else round(ready, 6),
        "latency_created_after_ready_ms": created_ready,
        **({"stages_ms": _stage_means(sim)} if stages else {}),
        "network": {
            "messages": sim.network.sent,
            "dropped": sim.network.dropped,
            "bytes": sim.network.bytes,
            "loopback": sim.network.loopback,
            "misaddressed": sim.network.misaddressed,
        },
        "member_state": {site: _site_state(nodes) for site, nodes in sim.site_nodes.items()},
        "shards": k,
    }
    return RunResult(summary, violations, failing, TraceSource(f"{s.name}:{seed}", sim.clusters, k))


def _stage_means(sim: Simulation) -> dict:
    """run_scenario(stages=True): like kdsync_stage_seconds of the real member,
    mean ms per own source batch — fetch (CreateTime of its first record ->
    the member has it) and ordering (has it -> handed to the producer in its
    own global topic)."""
    linger = sim.scenario.kafka.writer_linger_ms / 1000.0 or sim.scenario.kafka.linger_ms / 1000.0
    fetch, order = [], []
    for m in sim.order:
        c = m.cluster
        for (p, off), (fetched, handed) in (m.stages or {}).items():
            if handed is None or c is None:
                continue
            part = c.source[p]
            i = part.index_of(off)
            created = part.ack[i] - sim.produce_s - linger  # the first record of a producer batch
            fetch.append(fetched - created)
            order.append(handed - fetched)
    mean = (lambda xs: round(1000 * sum(xs) / len(xs), 3) if xs else None)
    return {"fetch": mean(fetch), "ordering": mean(order), "batches": len(fetch)}


def _created_summaries(sim: Simulation, ready: float | None) -> tuple[dict, dict]:
    """latency_created_ms over every record, and over those created once the
    group was ready (none when it never was): one pass over the topics."""
    lat, created = sim.created_latencies()
    return _percentiles(lat), _percentiles(lat[created >= ready] if ready is not None else lat[:0])


def _percentiles(a) -> dict:
    """p50/p90/p99/max (ms, 3 decimals) by the one nearest-rank percentile of
    kdsync.testing.stats: simulated and real figures are the same statistic."""
    return {k: round(v, 3) for k, v in percentiles(a).items()}


def _site_state(nodes: list[SimMember]) -> dict:
    """How a site's node(s) ended; with shards, statuses that differ are joined by '/'."""
    statuses = []
    for n in nodes:
        if n.status not in statuses:
            statuses.append(n.status)
    n0 = nodes[0]
    return {"up": n0.up, "status": "/".join(statuses), "starts": n0.starts, "views": sum(n.views for n in nodes),
            "bad_messages": sum(n.bad_messages for n in nodes), "deduplicated": sum(n.deduplicated for n in nodes),
            **({"slept": sum(n.slept for n in nodes)} if n0.host.quiesce else {})}
