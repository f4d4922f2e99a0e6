"""One simulation run: scenario + seed in, summary + trace + violations out.

Theory of operation
-------------------
One `simpy.Environment` (time in seconds) holds everything.  Each member
ticks its node every `TICK_S` from a phase drawn from the seed; workloads
append to the source topic of their cluster and wake the member's consumer
`produce_ms + consume_ms` after the producer sent (the source acknowledgement
is `produce_ms` after sending: that is the event's `submit_ts`); faults run
from one process in file order; at `duration_s` every partition, link fault
and clock pause ends, and the run goes on for `settle_s` so live members can
converge.  Then the checkers judge the global topics.

Everything random comes from its own `random.Random` seeded with a string
derived from the run seed (string seeds hash with SHA-512, so the stream does
not depend on PYTHONHASHSEED); iteration is over lists in rank or file order,
so the same scenario and seed give the same run, byte for byte.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import simpy
from simpy.events import Timeout

from kdsync.checker import TRACE_COLUMNS
from kdsync.core import Event, NodeConfig, make_node
from sim.checkers import MIRROR_TOLERATED, Checker, Violation
from sim.members import Cluster, Member
from sim.network import Network
from sim.scenario import Scenario

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
    """
    base = NodeConfig(member_id=member_id, members=s.member_ids)
    worst_ms = s.network.default.latency_ms or 1.0
    worst_ms += 3 * (s.network.default.jitter_ms or 0.0)
    for o in s.network.links:
        worst_ms = max(worst_ms, (o.latency_ms or 0.0) + 3 * (o.jitter_ms or 0.0))
    rtt_ticks = 2 * worst_ms / 1000.0 / TICK_S
    suspect = max(base.suspect_ticks, int(3 * rtt_ticks + 0.999))
    return NodeConfig(
        member_id=member_id,
        members=s.member_ids,
        roles={m.id: m.role for m in s.members if m.role == "witness"},
        protocol=s.protocol,
        suspect_ticks=suspect,
        retransmit_ticks=max(base.retransmit_ticks, int(rtt_ticks + 0.999) + 1),
    )


@dataclass
class _TraceSource:
    run_id: str
    clusters: list[tuple[str, Cluster]]
    submit_ts: dict[tuple[str, int, int], float]

    def columns(self) -> dict[str, list]:
        t: dict[str, list] = {c: [] for c in TRACE_COLUMNS}
        nan = float("nan")
        for mid, c in self.clusters:
            evs = c.global_events
            n = len(evs)
            t["run_id"].extend([self.run_id] * n)
            t["member"].extend([mid] * n)
            t["event_id"].extend(f"{e[0]}/{e[1]}/{e[2]}" for e in evs)  # as kdsync audit
            t["origin"].extend(e[0] for e in evs)
            t["origin_partition"].extend(e[1] for e in evs)
            t["origin_offset"].extend(e[2] for e in evs)
            t["seq"].extend(range(n))
            t["submit_ts"].extend(self.submit_ts.get((e[0], e[1], e[2]), nan) for e in evs)
            t["deliver_ts"].extend(c.global_ts)
        return t


@dataclass
class RunResult:
    summary: dict[str, Any]
    violations: list[Violation]
    failing: list[Violation]  # the violations that make the exit code 1
    _trace_source: _TraceSource
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


NodeFactory = Callable[..., Any]


def _arrivals(spec, duration_s: float, rng: random.Random):
    """Send times of one workload entry at one cluster: Poisson, or a burst."""
    if spec.burst is not None:
        for _ in range(spec.burst):
            yield spec.at_s
        return
    stop = duration_s if spec.stop_s is None else spec.stop_s
    t = (spec.start_s or 0.0) + rng.expovariate(spec.rate_eps)
    while t < stop:
        yield t
        t += rng.expovariate(spec.rate_eps)


def _call(ev) -> None:
    fn, arg = ev._value
    fn(arg)


class Simulation:
    def __init__(self, scenario: Scenario, seed: int, node_factory: NodeFactory | None = None) -> None:
        self.scenario = scenario
        self.seed = seed
        self.env = simpy.Environment()
        self.produce_s = scenario.kafka.produce_ms / 1000.0
        self.consume_s = scenario.kafka.consume_ms / 1000.0
        self.poll_s = scenario.kafka.poll_ms / 1000.0
        self.commit_s = scenario.kafka.commit_ms / 1000.0
        self.node_factory = node_factory or make_node
        self.checker = Checker(scenario.member_ids)
        self.witness_disk: dict = {}
        self.members: dict[str, Member] = {}
        for spec in scenario.members:
            cluster = Cluster(spec.id) if spec.role == "member" else None
            self.members[spec.id] = Member(self, spec.id, node_config(scenario, spec.id), cluster)
        self.order = list(self.members.values())  # rank order
        self.network = Network(self.env, scenario.member_ids, scenario.network, seed, self._on_message)
        self._flush_list: list[Member] = []
        self._flush_scheduled = False
        self._majority_cache: dict[str, bool] | None = None
        self.submitted: dict[tuple[str, int, int], Event] = {}
        self.submit_ts: dict[tuple[str, int, int], float] = {}
        self.end_s = scenario.duration_s + scenario.settle_s

    # ----------------------------------------------------------- scheduling
    def after(self, delay: float, fn: Callable[[Any], None], arg: Any) -> None:
        """Call fn(arg) `delay` seconds from now."""
        Timeout(self.env, delay, (fn, arg)).callbacks.append(_call)

    def request_flush(self, m: Member) -> None:
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

    def _on_message(self, src: str, dst: str, data: bytes) -> None:
        self.members[dst].on_message(src, data)

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
        up = [m.id for m in self.order if m.up]
        n = len(self.order)
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
        per_cluster: dict[str, list] = {m: [] for m in s.clusters}
        for i, spec in enumerate(s.workload):
            targets = s.clusters if spec.member == "all" else (spec.member,)
            for m in targets:
                self.members[m].cluster.ensure_partitions(spec.partitions)
                rng = random.Random(f"{self.seed}/workload/{i}/{m}")
                per_cluster[m].append((i, spec, rng, _arrivals(spec, s.duration_s, rng)))
        for m in s.clusters:
            if per_cluster[m]:
                self.env.process(self._producer(self.members[m], per_cluster[m]))

    def _producer(self, member: Member, entries: list):
        """Writes the cluster's source topic one block of WORKLOAD_BLOCK_S ahead:
        arrivals of every workload entry, merged in time order, get their
        offsets; each becomes visible to the consumer produce+consume later."""
        env = self.env
        c = member.cluster
        origin = member.id
        lag = self.produce_s + self.consume_s
        wake = self.poll_s <= 0.0
        submitted, submit_ts = self.submitted, self.submit_ts
        pending = [next(it, None) for (_, _, _, it) in entries]
        block = 0
        while any(t is not None for t in pending):
            block_end = (block + 1) * WORKLOAD_BLOCK_S
            arrivals = []
            for j, (_, spec, rng, it) in enumerate(entries):
                t = pending[j]
                while t is not None and t < block_end:
                    arrivals.append((t, j))
                    t = next(it, None)
                pending[j] = t
            arrivals.sort()  # by time, then entry (file order); stable
            last_vis = None
            for t, j in arrivals:
                _, spec, rng, _ = entries[j]
                p = rng.randrange(spec.partitions) if spec.partitions > 1 else 0
                part = c.source[p]
                off = len(part)
                head = f"{origin}/{p}/{off}/".encode()
                n = spec.payload_bytes
                payload = head + b"." * (n - len(head)) if n > len(head) else head[:n]
                ack = t + self.produce_s
                vis = t + lag
                e = Event(origin, p, off, payload, int(round(t * 1000)))
                part.append(e)
                c.source_ack[p].append(ack)
                c.source_vis[p].append(vis)
                k = (origin, p, off)
                submitted[k] = e
                submit_ts[k] = ack
                if wake and vis != last_vis:  # the consumer wakes when a fetch returns
                    Timeout(env, vis - env.now).callbacks.append(member._wake)
                    last_vis = vis
            block += 1
            if any(t is not None for t in pending):
                yield env.timeout(block * WORKLOAD_BLOCK_S - env.now)

    def _poller(self, ev) -> None:
        """kafka.poll_ms > 0: each member's consume loop hands over a batch every poll_ms."""
        m = ev._value
        Timeout(self.env, self.poll_s, m).callbacks.append(self._poller)
        m.poll()

    # --------------------------------------------------------------- faults
    def _faults(self):
        env = self.env
        net = self.network
        for f in sorted(self.scenario.faults, key=lambda f: f.at_s):  # stable: file order on ties
            if f.at_s > env.now:
                yield env.timeout(f.at_s - env.now)
            a = f.action
            if a == "crash":
                self.members[f.crash].crash()
            elif a == "restart":
                self.members[f.restart].start()
            elif a == "partition":
                groups = [list(g) for g in f.partition]
                net.set_partition(groups)
                if f.until_s is not None:
                    token = net._group
                    self.after(f.until_s - env.now, self._end_partition, token)
            elif a == "heal":
                net.heal()
            elif a == "link":
                lf = f.link
                net.set_link_fault(lf.from_, lf.to, lf)
                if f.until_s is not None:
                    self.after(f.until_s - env.now, self._end_link_fault, (lf.from_, lf.to, lf))
            elif a == "clock_pause":
                self.members[f.clock_pause].pause(env.now + f.for_s)
            self.topology_changed()

    def _end_partition(self, token) -> None:
        if self.network._group is token:
            self.network.set_partition(None)
            self.topology_changed()

    def _end_link_fault(self, arg) -> None:
        src, dst, spec = arg
        if self.network._faults.get((src, dst)) is spec:
            self.network.set_link_fault(src, dst, None)
            self.topology_changed()

    def _settle(self):
        yield self.env.timeout(self.scenario.duration_s)
        self.network.heal()
        for m in self.order:
            m.resume()
        self.topology_changed()

    # ---------------------------------------------------------------- ticks
    def _tick(self, ev) -> None:
        m = ev._value
        Timeout(self.env, TICK_S, m).callbacks.append(self._tick)
        if m.up:
            m.tick()
            m.flush()

    # ------------------------------------------------------------------ run
    def _settled(self) -> bool:
        n = len(self.submitted)
        return all(m.up and (m.cluster is None or len(m.cluster.global_events) >= n) for m in self.order)

    def _watch_settle(self):
        """Liveness phase shortcut (swarm): once every member is up and every
        cluster holds as many events as were acknowledged, run GRACE_S more
        (late wrong deliveries still show) and stop."""
        env = self.env
        yield env.timeout(self.scenario.duration_s)
        while env.now + GRACE_S < self.end_s:
            if self._settled():
                self.end_s = env.now + GRACE_S
                Timeout(env, GRACE_S).callbacks.append(simpy.core.StopSimulation.callback)
                return
            yield env.timeout(0.1)

    def run(self, progress: Callable[[float], None] | None = None, stop_when_settled: bool = False) -> None:
        phase_rng = random.Random(f"{self.seed}/tick-phase")
        for m in self.order:
            m.start()
            phase = phase_rng.random() * TICK_S
            Timeout(self.env, phase, m).callbacks.append(self._tick)
            if self.poll_s > 0.0 and m.cluster is not None:
                Timeout(self.env, phase + self.poll_s, m).callbacks.append(self._poller)
        self._setup_workload()
        self.env.process(self._faults())
        self.env.process(self._settle())
        if stop_when_settled:
            self.env.process(self._watch_settle())
        step = max(self.end_s / 200.0, TICK_S) if progress else 0.5
        t = 0.0
        while t < self.end_s:
            t = min(self.end_s, t + step)
            self.env.run(until=t)
            if progress:
                progress(t)
            t = self.env.now  # the settle watcher may have stopped the run early


def _percentile(sorted_vals: list[float], q: float) -> float:
    if not sorted_vals:
        return 0.0
    pos = (len(sorted_vals) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def run_scenario(
    scenario: Scenario,
    seed: int | None = None,
    *,
    node_factory: NodeFactory | None = None,
    progress: Callable[[float], None] | None = None,
    stop_when_settled: bool = False,
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
    sim.run(progress, stop_when_settled)
    wall = time.perf_counter() - t0

    s = scenario
    topics = {m.id: m.cluster.global_events for m in sim.order if m.cluster is not None}
    live = [m.id for m in sim.order if m.up and m.cluster is not None]
    violations = sim.checker.finish(topics, sim.submitted, live)

    lat: list[float] = []
    submit_ts = sim.submit_ts
    for m in sim.order:
        c = m.cluster
        if c is not None:
            lat.extend((dts - submit_ts[(e[0], e[1], e[2])]) * 1000.0 for e, dts in zip(c.global_events, c.global_ts)
                       if (e[0], e[1], e[2]) in submit_ts)
    lat.sort()
    delivered = {mid: len(t) for mid, t in topics.items()}
    n_sub = len(sim.submitted)
    latency = {
        "p50": round(_percentile(lat, 0.50), 3),
        "p90": round(_percentile(lat, 0.90), 3),
        "p99": round(_percentile(lat, 0.99), 3),
        "max": round(lat[-1], 3) if lat else 0.0,
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
        # extensions (interfaces.md allows new keys)
        "violation_counts": counts,
        "exit_code": 1 if failing else 0,
        "tick_ms": TICK_S * 1000,
        "network": {
            "messages": sim.network.sent,
            "dropped": sim.network.dropped,
            "bytes": sim.network.bytes,
            "loopback": sim.network.loopback,
            "misaddressed": sim.network.misaddressed,
        },
        "member_state": {
            m.id: {
                "up": m.up,
                "status": m.status,
                "starts": m.starts,
                "views": m.views,
                "bad_messages": m.bad_messages,
                "deduplicated": m.deduplicated,
            }
            for m in sim.order
        },
    }
    clusters = [(m.id, m.cluster) for m in sim.order if m.cluster is not None]
    return RunResult(summary, violations, failing, _TraceSource(f"{s.name}:{seed}", clusters, submit_ts))
