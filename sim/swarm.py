"""Swarm testing: one seed → one random scenario that hunts for protocol bugs.

Like TigerBeetle's VOPR, a seed draws a topology (3–5 members, sometimes a
witness), a network (latency, jitter, loss, duplication, reordering, a far
member), a workload (Poisson rates, bursts, several partitions) and a *fault
phase* of `faults_s` seconds in which fault episodes overlap freely:

=====================  ========================================================
episode                what it does
=====================  ========================================================
crash                  one member dies and restarts later
crash-in-view-change   a member dies; while the group is changing its view,
                       a second one (often the next leader) dies too
partition              a random split in two (a majority side, or none)
crash-in-partition     a partition, and a crash on one side while it lasts
pause-leader           the leader's clock stops while a follower restarts
majority-loss          a majority of members crash, or every member is cut
                       off from every other: the group must wedge, then
                       recover when they return
total-outage           every member crashes, then all restart
rolling-restart        every member restarts, one after another
flapping               a link (or a member's every link) goes down and up
                       every 30–300 ms
one-way                one direction of a link drops everything
lossy-link             one direction of a link gets slow and lossy
pause                  one member's clock stops
=====================  ========================================================

A third of the crashes drawn are clean stops instead (SIGTERM: the member
announces its leave, then its process ends; its own stream of draws, so a
seed's other faults are those it always had).  Every crash is followed by a
restart and every link fault and partition ends
before the fault phase does; then a *probe* burst at every cluster demands
liveness after the heal (the healed group must order new events), and the
run settles (`stop_when_settled`: it stops once every member is up and
holds everything acknowledged).  The checkers then demand agreement,
integrity, origin order, no split brain and no loss at every member, and the
swarm demands that every member ends up and active.  Runs stay short (a few
seconds simulated, well under a second of wall time on average), so CI can
afford hundreds of seeds.  The generated scenario is an ordinary `Scenario`,
so a failing seed is written out as YAML and replayed with `kdsync-sim run`.

`run_swarm` runs seeds in this process or as Spark tasks (one task per seed,
`local[*]` by default, any master).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from sim.scenario import Scenario, dump_scenario

PROBE_S = 0.2  # the liveness probe: this long after the fault phase
# Poisson events offered per run at most (rate x clusters x fault phase): a run
# then takes about half a second of wall time on average, so CI affords 200
# seeds in a couple of minutes; raise it when the simulator gets faster.
EVENT_BUDGET = 2400
SETTLE_S = 12.0  # the liveness phase ends earlier once every member has converged
CRASH_FENCE_SHARE = 0.5  # clock seeds run with protocol.crash_fence (the default; the rest without it)
LIFT_SHARE = 0.5  # of those, the share run with protocol.lift_fence (kdsync.core.lift)
EPISODES = (
    ("crash", 3),
    ("crash-in-view-change", 2),
    ("partition", 3),
    ("crash-in-partition", 2),
    ("pause-leader", 2),
    ("majority-loss", 2),
    ("total-outage", 1),
    ("rolling-restart", 1),
    ("flapping", 2),
    ("one-way", 1),
    ("lossy-link", 1),
    ("pause", 1),
)


class _Faults:
    """Builds the fault list of one seed within [0, end) (restarts and ends included)."""

    def __init__(self, rng: random.Random, ids: list[str], end: float, latency_ms: float) -> None:
        self.rng, self.ids, self.end, self.latency_ms = rng, ids, end, latency_ms
        self.out: list[dict] = []
        self.kinds: list[str] = []

    def t(self, x: float) -> float:
        return round(min(max(x, 0.0), self.end - 0.01), 3)

    def crash(self, m: str, at: float, down: float) -> None:
        a = self.t(at)
        self.out.append({"at_s": a, "crash": m})
        self.out.append({"at_s": max(a, self.t(at + down)), "restart": m})

    def partition(self, groups: list[list[str]], at: float, span: float) -> None:
        a = self.t(at)
        until = round(min(a + max(span, 0.01), self.end), 3)
        if until > a:
            self.out.append({"at_s": a, "partition": groups, "until_s": until})

    def link(self, a: str, b: str, at: float, span: float, **props) -> None:
        s = self.t(at)
        until = round(min(s + max(span, 0.01), self.end), 3)
        if until > s:
            self.out.append({"at_s": s, "link": {"from": a, "to": b, **props}, "until_s": until})

    def pause(self, m: str, at: float, span: float) -> None:
        a = self.t(at)
        span = round(min(span, self.end - a), 3)
        if span > 0:
            self.out.append({"at_s": a, "clock_pause": m, "for_s": span})

    def split(self, sizes_from: list[str], majority: bool | None = None) -> list[list[str]]:
        """Two groups: one with a majority (majority=True), none (False: an even
        split, or every member alone), or any (None)."""
        rng, n = self.rng, len(sizes_from)
        ids = list(sizes_from)
        rng.shuffle(ids)
        if majority is False:
            if n % 2 == 0 and rng.random() < 0.5:
                return [sorted(ids[: n // 2]), sorted(ids[n // 2:])]
            return [[m] for m in sorted(ids)]
        k = rng.randint(1, (n - 1) // 2) if majority else rng.randint(1, n - 1)
        return [sorted(ids[:k]), sorted(ids[k:])]

    def episode(self, kind: str) -> None:
        rng, ids, end = self.rng, self.ids, self.end
        n = len(ids)
        at = 0.05 + rng.random() * (end - 0.3)
        self.kinds.append(kind)
        if kind == "crash":
            self.crash(rng.choice(ids), at, 0.05 + rng.random() * 2.0)
        elif kind == "crash-in-view-change":
            first, second = rng.sample(ids, 2)
            if rng.random() < 0.5:  # the member that will lead the view change
                others = [m for m in ids if m != first]
                second = others[0]
            gap = 0.05 + rng.random() * 0.5  # failure suspicion takes ~0.1–0.3 s, the change a few RTTs
            down = 0.2 + rng.random() * 1.5
            self.crash(first, at, gap + down)
            self.crash(second, at + gap, down * rng.random() + 0.05)
        elif kind == "partition":
            self.partition(self.split(ids), at, 0.1 + rng.random() * 2.0)
        elif kind == "crash-in-partition":
            span = 0.3 + rng.random() * 2.0
            self.partition(self.split(ids), at, span)
            self.crash(rng.choice(ids), at + rng.random() * span, 0.05 + rng.random() * 1.5)
        elif kind == "pause-leader":
            follower = rng.choice(ids[1:])
            down = 0.1 + rng.random() * 1.5
            self.crash(follower, at, down)
            # the leader (rank 0) stalls around the follower's return
            self.pause(ids[0], at + down - 0.1 + rng.random() * 0.2, 0.05 + rng.random() * 1.0)
        elif kind == "majority-loss":
            away = rng.sample(ids, n // 2 + 1)
            span = 0.3 + rng.random() * 2.0
            if rng.random() < 0.5:
                for m in away:
                    self.crash(m, at + rng.random() * 0.2, span)
            else:
                self.partition(self.split(ids, majority=False), at, span)
        elif kind == "total-outage":
            for m in ids:
                self.crash(m, at + rng.random() * 0.3, 0.2 + rng.random() * 1.5)
        elif kind == "rolling-restart":
            gap = 0.05 + rng.random() * 0.6
            for i, m in enumerate(rng.sample(ids, n)):
                self.crash(m, at + i * gap, 0.02 + rng.random() * gap)
        elif kind == "flapping":
            a = rng.choice(ids)
            b = rng.choice([x for x in ids if x != a])
            isolate = rng.random() < 0.4  # every link of a, or the one link a-b
            period = 0.03 + rng.random() * 0.27
            t, stop = at, at + 0.5 + rng.random() * 2.0
            while t < min(stop, end - 0.02):
                if isolate:
                    self.partition([[a], [x for x in ids if x != a]], t, period / 2)
                else:
                    self.link(a, b, t, period / 2, loss=1.0)
                    self.link(b, a, t, period / 2, loss=1.0)
                t += period
        elif kind == "one-way":
            a, b = rng.sample(ids, 2)
            self.link(a, b, at, 0.1 + rng.random() * 2.0, loss=1.0)
        elif kind == "lossy-link":
            a, b = rng.sample(ids, 2)
            self.link(a, b, at, 0.1 + rng.random() * 2.0, loss=round(rng.random() * 0.6, 3),
                      latency_ms=round(self.latency_ms * rng.choice([2, 5, 10]), 3))
        elif kind == "pause":
            self.pause(rng.choice(ids), at, 0.05 + rng.random() * 1.5)
        else:  # pragma: no cover - EPISODES and this switch name the same kinds
            raise ValueError(kind)


def swarm_scenario(seed: int, protocol: str = "derecho") -> Scenario:
    """The scenario for swarm seed `seed` (a pure function of its arguments)."""
    return Scenario.model_validate(_draw(seed, protocol)[0])


def _draw(seed: int, protocol: str) -> tuple[dict, list[str]]:
    rng = random.Random(f"swarm2/{seed}")
    n = rng.randint(3, 5)
    ids = [f"m{i}" for i in range(n)]
    members = [{"id": m} for m in ids]
    if rng.random() < 0.3:
        members[-1]["role"] = "witness"
    clusters = [m["id"] for m in members if m.get("role") != "witness"]

    latency = rng.choice([1.0, 5.0, 20.0, 40.0, 80.0])
    default = {
        "latency_ms": latency,
        "jitter_ms": round(latency * rng.random() * 0.2, 3),
        "bandwidth_mbps": rng.choice([100.0, 1000.0, 10000.0]),
    }
    for key, top in (("loss", 0.05), ("duplicate", 0.05), ("reorder", 0.05)):
        if rng.random() < 0.4:
            default[key] = round(rng.random() * top, 4)
    links = []
    if rng.random() < 0.3:  # one far-away member
        far = rng.choice(ids)
        extra = rng.choice([30.0, 80.0, 150.0])
        for other in ids:
            if other != far:
                links.append({"from": far, "to": other, "latency_ms": latency + extra})
                links.append({"from": other, "to": far, "latency_ms": latency + extra})

    faults_s = rng.choice([3.0, 4.0, 6.0, 8.0])
    duration = faults_s + PROBE_S + 0.3
    rate = float(min(rng.choice([10, 25, 50, 100, 200]), EVENT_BUDGET // (len(clusters) * faults_s)))
    workload = [
        {
            "member": "all",
            "rate_eps": rate,
            "partitions": rng.randint(1, 4),
            "payload_bytes": rng.choice([16, 100, 512]),
            "start_s": 0.0,
            "stop_s": faults_s,
        }
    ]
    for _ in range(rng.randint(0, 3)):  # concurrent bursts during the faults
        workload.append(
            {"member": rng.choice(["all", *clusters]), "burst": rng.randint(5, 200), "at_s": round(rng.random() * faults_s, 3)}
        )
    workload.append({"member": "all", "burst": rng.randint(1, 20), "at_s": faults_s + PROBE_S})  # liveness probe

    f = _Faults(rng, ids, faults_s, latency)
    names = [k for k, _ in EPISODES]
    weights = [w for _, w in EPISODES]
    for kind in rng.choices(names, weights, k=rng.randint(1, 6)):
        f.episode(kind)
    stops = random.Random(f"swarm2/{seed}/stop")  # its own stream: the other draws stay as they were
    for x in f.out:  # a third of the process ends are clean stops (SIGTERM: the member leaves, announced)
        if "crash" in x and stops.random() < 1 / 3:
            x["stop"] = x.pop("crash")
    if any("stop" in x for x in f.out):
        f.kinds.append("clean-stop")
    faults = sorted(f.out, key=lambda x: x["at_s"])  # stable: a restart stays after its crash

    clocks = _draw_clocks(seed, ids, duration, members) if protocol == "clock" else []
    kinds = f.kinds + (["clock-faults"] if clocks else [])
    quorum = random.Random(f"swarm2/{seed}/quorum").choice([0, 0, 1, 2]) if protocol == "clock" else 0
    quiesce = random.Random(f"swarm2/{seed}/quiesce").random() < 0.5  # its own stream: the other draws stay as they were
    kinds += ["quiesce"] if quiesce else []
    adaptive = random.Random(f"swarm2/{seed}/adaptive").random() < 0.5  # its own stream, as quiesce's
    kinds += ["adaptive-suspect"] if adaptive else []
    crash_fence = protocol == "clock" and random.Random(f"swarm2/{seed}/crash_fence").random() < CRASH_FENCE_SHARE
    kinds += ["crash-fence"] if crash_fence else []
    lift = crash_fence and random.Random(f"swarm2/{seed}/lift").random() < LIFT_SHARE  # its own stream, as quiesce's
    kinds += ["lift"] if lift else []
    return (
        {
            "name": f"swarm-{seed}",
            "seed": seed,
            "protocol": protocol,
            "duration_s": duration,
            "settle_s": SETTLE_S,
            "members": members,
            "network": {"default": default, "links": links},
            "kafka": {
                "produce_ms": float(rng.choice([1, 2, 5])),
                "consume_ms": float(rng.choice([1, 2])),
                "poll_ms": float(rng.choice([0, 2, 10])),
                "commit_ms": float(rng.choice([10, 50, 200])),
            },
            "workload": workload,
            "faults": faults,
            **({"clocks": clocks} if clocks else {}),
            **({"commit_quorum": quorum} if quorum else {}),
            **({"quiesce": True} if quiesce else {}),
            **({"adaptive_suspect": True} if adaptive else {}),
            "crash_fence": crash_fence,
            **({"lift_fence": True} if lift else {}),
        },
        kinds,
    )


def _draw_clocks(seed: int, ids: list[str], duration: float, members: list[dict]) -> list[dict]:
    """Faulty wall clocks for the clock protocol: offsets up to 0.3 s, drift up
    to 0.2 %, jumps forward and back up to 0.5 s; and clock leads (set on
    `members`).  Their own random stream, so a seed draws the same scenario
    otherwise whatever the protocol."""
    rng = random.Random(f"swarm2/{seed}/clocks")
    if rng.random() < 0.3:
        rng.choice(members)["clock_lead_ms"] = round(rng.uniform(0, 200), 3)
    if rng.random() < 0.2:
        return []
    out = []
    for m in ids:
        if rng.random() < 0.3:
            continue
        c: dict = {"member": m, "offset_ms": round(rng.uniform(-300, 300), 3),
                   "drift_ppm": round(rng.uniform(-2000, 2000), 1)}
        if rng.random() < 0.4:
            c["jumps"] = [{"at_s": round(rng.random() * duration, 3), "by_ms": round(rng.uniform(-500, 500), 3)}
                          for _ in range(rng.randint(1, 2))]
        out.append(c)
    return out


def swarm_episodes(seed: int) -> list[str]:
    """The fault episodes seed `seed` draws, in drawing order (and "quiesce" when its groups may sleep, "adaptive-suspect" when its members suspect early)."""
    return _draw(seed, "derecho")[1]


# ------------------------------------------------------------------ running


@dataclass
class SeedOutcome:
    """What one seed's run left: its problems (empty when it passed)."""

    seed: int
    protocol: str
    problems: list[str] = field(default_factory=list)  # "kind: anomaly: detail" / "liveness: ..."
    states: str = ""  # how every member ended (one line)
    events: int = 0
    wall_s: float = 0.0

    @property
    def failed(self) -> bool:
        return bool(self.problems)


def member_states(summary: dict) -> str:
    """One line of how every member ended (status, process starts, views installed)."""
    return ", ".join(
        f"{m} {st['status'] if st['up'] else 'down'} (starts {st['starts']}, views {st['views']})"
        for m, st in summary["member_state"].items()
    )


def judge(result) -> list[str]:
    """A swarm run's problems: the failing violations, and liveness — every
    member up and active at the end."""
    out = [str(v) for v in result.failing]
    stuck = [m for m, st in result.summary["member_state"].items() if not st["up"] or st["status"] != "active"]
    if stuck:
        out.append(f"liveness: stuck: {', '.join(stuck)} not active after the liveness phase")
    return out


def run_seed(seed: int, protocol: str = "derecho") -> SeedOutcome:
    """Run swarm seed `seed` in this process and judge it."""
    from sim.runner import run_scenario

    t0 = time.perf_counter()
    r = run_scenario(swarm_scenario(seed, protocol), seed, stop_when_settled=True)
    return SeedOutcome(seed, protocol, judge(r), member_states(r.summary), r.summary["events_submitted"],
                       time.perf_counter() - t0)


def run_local(seeds: Iterable[int], protocol: str = "derecho") -> Iterable[SeedOutcome]:
    """Seeds one after another in this process (outcomes as they finish)."""
    for s in seeds:
        yield run_seed(s, protocol)


def run_parallel(seeds: list[int], protocol: str = "derecho", jobs: int = 2) -> list[SeedOutcome]:
    """Seeds in `jobs` worker processes of this machine (started fresh: a forked
    copy of a process holding threads, a Spark gateway or a broker client, is
    unsafe); outcomes in seed order."""
    from concurrent.futures import ProcessPoolExecutor
    from functools import partial
    from multiprocessing import get_context

    if jobs <= 1 or len(seeds) <= 1:
        return list(run_local(seeds, protocol))
    with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
        return list(pool.map(partial(run_seed, protocol=protocol), seeds))


def run_spark(seeds: list[int], protocol: str = "derecho", master: str = "local[*]") -> list[SeedOutcome]:
    """Seeds as Spark tasks (one per seed) on `master`; outcomes in seed order.
    Raises ImportError without PySpark."""
    from functools import partial

    from kdsync.spark.session import spark_session

    spark = spark_session(master, "kdsync-swarm", {"spark.ui.showConsoleProgress": "false"})
    sc = spark.sparkContext
    return sc.parallelize(seeds, len(seeds)).map(partial(run_seed, protocol=protocol)).collect()


def repro_line(seed: int, protocol: str) -> str:
    return f"kdsync-sim swarm --seeds 1 --first {seed} --protocol {protocol} --local"


def run_swarm(
    seeds: int,
    first: int = 0,
    protocol: str = "derecho",
    out: str | Path = "swarm-failures",
    master: str | None = None,
    local: bool = False,
    progress: Callable[[int], None] | None = None,
    echo: Callable[[str], None] = print,
) -> int:
    """`kdsync-sim swarm`: run seeds first..first+seeds-1, print each failing
    seed (problems, member states, repro lines) and one summary line; write
    each failing scenario to `out` as YAML.  In this process with `local`,
    else as Spark tasks on `master` (default local[*]).  Returns 0 when every
    seed passed, 1 otherwise."""
    todo = list(range(first, first + seeds))
    t0 = time.perf_counter()
    if local:
        where = "in-process"
        outcomes = []
        for i, o in enumerate(run_local(todo, protocol)):
            outcomes.append(o)
            if progress:
                progress(i + 1)
    else:
        where = f"Spark {master or 'local[*]'}"
        outcomes = run_spark(todo, protocol, master or "local[*]")
    wall = time.perf_counter() - t0
    failed = [o for o in outcomes if o.failed]
    for o in failed:
        scenario = swarm_scenario(o.seed, protocol)
        d = Path(out)
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"{scenario.name}.yaml"
        path.write_text(dump_scenario(scenario), encoding="utf-8")
        for p in o.problems:
            echo(f"seed {o.seed}: violation: {p}")
        echo(f"seed {o.seed}: members at the end: {o.states}")
        echo(f"repro: kdsync-sim run {path} --seed {o.seed}   (or: {repro_line(o.seed, protocol)})")
    events = sum(o.events for o in outcomes)
    echo(
        f"swarm: {seeds} runs (seeds {first}..{first + seeds - 1}, {protocol}), {len(failed)} failed, {events} events, "
        f"{wall:.1f}s wall, {where}"
        + (f"; failing seeds: {' '.join(str(o.seed) for o in failed)}" if failed else "")
    )
    return 1 if failed else 0
