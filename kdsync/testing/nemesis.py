"""A Jepsen-style nemesis: real clusters and members under a seeded fault schedule.

    make nemesis SEED=3 MINUTES=5 [PROTOCOL=clock DELAY_MS=20]
    python -m kdsync.testing.nemesis --seed 3 --minutes 5 [--protocol clock] [--delay-ms 20]
                                     [--workdir DIR] [--out FILE.json]

Three durable clusters (Tansu on a local S3 store, `LocalGroup(durable=True)`)
and three `kdsync run` members whose peer links each go through a
`FaultProxy`.  Paced idempotent writers put events into every cluster for
the whole run while the nemesis applies one fault at a time, drawn from the
seed (`schedule`): kill -9 of one member and of two at once (majority loss),
SIGSTOP pauses of a member and of a broker, a member black-holed from both
peers, one link black-holed while the third member sees both, a broker
killed and restarted on its data, a rolling restart of every member.  Each
fault lasts 2-8 s and is healed before a 1-4 s quiet gap and the next one.

Then everything is healed and the run waits for convergence: every global
topic holding every record of every source topic.  It reports the faults by
kind, the events (acknowledged, in the source topics, ordered), the time to
converge after the last heal, and the anomalies: any violation of agreement,
exactly-once or origin order (`check_global_topics`), a source record missing
from the global topics or one there that no source holds, a member that
exited on its own, an acknowledged write missing from its source topic (the
embedded brokers recover their logs before a restart, as Kafka does:
kdsync.kafka.tansu_recovery).

`protocol` is the members' ordering protocol (derecho by default; clock, the
WAN protocol, runs the same schedule); with `delay_ms` every directed peer
link also goes through a delay proxy (kdsync.testing.delay_proxy) behind its
fault proxy: regions `delay_ms` apart one way.

Exit 0 with no anomaly, 1 otherwise.  docs/nemesis.md.
"""

from __future__ import annotations

import json
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["FAULTS", "Fault", "Report", "run", "schedule"]

FAULTS = ("kill_member", "kill_majority", "pause_member", "pause_broker", "isolate_member", "cut_link",
          "restart_broker", "rolling_restart")
RATE = 20.0  # events/s per cluster: three durable clusters share one local S3 store and two cores
CONVERGE_S = 300.0


@dataclass(frozen=True)
class Fault:
    kind: str
    targets: tuple[int, ...]  # member / cluster indices
    duration: float  # seconds the fault holds (rolling_restart: unused, it takes what it takes)
    gap: float  # quiet seconds after its heal


def schedule(seed: int, seconds: float, n: int = 3) -> list[Fault]:
    """The faults of a run, drawn from `seed` alone: one after another, each
    2-8 s then a 1-4 s gap, until `seconds` of them (the same seed, the same
    schedule)."""
    rng = random.Random(seed)
    out: list[Fault] = []
    total = 0.0
    while total < seconds:
        kind = rng.choice(FAULTS)
        if kind in ("kill_majority", "cut_link"):
            targets = tuple(sorted(rng.sample(range(n), 2)))
        elif kind == "rolling_restart":
            targets = tuple(range(n))
        else:
            targets = (rng.randrange(n),)
        f = Fault(kind, targets, round(rng.uniform(2.0, 8.0), 2), round(rng.uniform(1.0, 4.0), 2))
        out.append(f)
        total += (f.duration if kind != "rolling_restart" else 6.0 * n) + f.gap
    return out


@dataclass
class Report:
    seed: int
    minutes: float
    protocol: str = "derecho"
    delay_ms: float = 0.0
    faults: dict[str, int] = field(default_factory=dict)
    fault_seconds: float = 0.0  # wall time from the first fault to the last heal
    acknowledged: int = 0
    in_sources: int = 0
    broker_lost: int = 0  # acknowledged by a broker, not in its source topic
    ordered: dict[str, int] = field(default_factory=dict)
    converge_s: float | None = None
    anomalies: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items()))
        return [
            f"nemesis seed {self.seed} ({self.protocol}" + (f", links {self.delay_ms:g} ms one way" if self.delay_ms
                                                             else "")
            + f"): {sum(self.faults.values())} faults in {self.fault_seconds:.0f} s ({kinds})",
            f"events      {self.acknowledged} acknowledged, {self.in_sources} in the source topics"
            + (f" (the brokers lost {self.broker_lost} acknowledged writes)" if self.broker_lost else "")
            + f", ordered {' / '.join(map(str, self.ordered.values()))}",
            "converged   " + (f"{self.converge_s:.1f} s after the last heal" if self.converge_s is not None
                              else "NO"),
            f"anomalies   {len(self.anomalies)}" + (": " + "; ".join(self.anomalies[:5]) if self.anomalies else ""),
        ]



def _kill(g, i: int) -> None:
    g.signal_member(i, signal.SIGKILL)
    g.wait_member(i)


# fault kind -> (inject it on target i, heal target i); links are cut and healed through the proxies
_ON_TARGET = {
    "kill_member": (_kill, lambda g, i: g.start_member(i)),
    "kill_majority": (_kill, lambda g, i: g.start_member(i)),
    "pause_member": (lambda g, i: g.signal_member(i, signal.SIGSTOP), lambda g, i: g.signal_member(i, signal.SIGCONT)),
    "pause_broker": (lambda g, i: g.clusters[i].pause(), lambda g, i: g.clusters[i].resume()),
    "restart_broker": (lambda g, i: g.clusters[i].kill(), lambda g, i: g.clusters[i].start()),
}

class _Nemesis:
    """Applies and heals faults on a LocalGroup whose links run through `proxies[(i, j)]`."""

    def __init__(self, g, proxies, log):
        self.g, self.proxies, self.log = g, proxies, log

    def _links(self, a: int, b: int | None = None):
        return [p for (i, j), p in self.proxies.items() if (b is None and a in (i, j)) or {i, j} == {a, b}]

    def apply(self, f: Fault) -> None:
        g, k = self.g, f.kind
        self.log(f"fault {k} {','.join(g.names[i] for i in f.targets)} for {f.duration:.1f} s")
        if k == "rolling_restart":
            for i in f.targets:
                g.signal_member(i, signal.SIGTERM)
                if g.wait_member(i, 60) != 0:  # 1: the stop passed [member] stop_timeout_ms (its log names the step)
                    self.log(f"  {g.names[i]}: the stop did not finish cleanly (exit 1); restarted")
                g.start_member(i)
                _until(lambda i=i: g.is_active(i), 60)
            return
        for i in f.targets:
            if k in _ON_TARGET:
                _ON_TARGET[k][0](g, i)
            elif k == "isolate_member":
                for p in self._links(i):
                    p.blackhole()
        if k == "cut_link":
            for p in self._links(*f.targets):
                p.blackhole()
        time.sleep(f.duration)  # the fault holds this long: that is the experiment, not a wait for an event
        self.heal(f)

    def heal(self, f: Fault) -> None:
        g, k = self.g, f.kind
        if k in _ON_TARGET:
            for i in f.targets:
                _ON_TARGET[k][1](g, i)
        for p in self.proxies.values():
            p.heal()


def _until(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.2)
    return False


def run(seed: int, minutes: float, workdir: Path, rate: float = RATE, log=print, protocol: str = "derecho",
        delay_ms: float = 0.0) -> Report:
    from kdsync.testing.delay_proxy import start_proxies, stop_proxies
    from kdsync.testing.fault_proxy import FaultProxy
    from kdsync.testing.local import DURABLE_LINGER_MS, LocalGroup, Writers, check_global_topics

    faults = schedule(seed, minutes * 60)
    report = Report(seed, minutes, protocol, delay_ms, dict(Counter(f.kind for f in faults)))
    proxies: dict[tuple[int, int], FaultProxy] = {}
    delays = None  # the delay proxies' process
    g = LocalGroup(3, workdir, durable=True, metrics=True, source_partitions=2, tick_ms=20, heartbeat_ms=60,
                   suspect_ms=1000, retransmit_ms=100, expect_stalls=True, protocol=protocol,
                   peer_address=lambda i, j: proxies[(i, j)].address)
    try:
        links = [(i, j) for i in range(g.n) for j in range(g.n) if i != j]
        via = {link: g.ports[link[1]] for link in links}  # where each fault proxy forwards to
        if delay_ms > 0:  # member -> fault proxy -> delay proxy -> member
            delays, ports = start_proxies(delay_ms, [str(g.ports[j]) for _, j in links])
            via = dict(zip(links, ports))
        for link in links:
            proxies[link] = FaultProxy(("127.0.0.1", via[link])).start()
        g.start_brokers()
        g.start_members()
        g.wait_ready(90)
        seconds = sum((f.duration if f.kind != "rolling_restart" else 6.0 * g.n) + f.gap for f in faults)
        writers = Writers(g, int((seconds + 5) * rate), "n", rate, linger_ms=DURABLE_LINGER_MS, timeout=240)
        nem = _Nemesis(g, proxies, log)
        t0 = time.monotonic()
        for f in faults:
            try:
                nem.apply(f)
            except Exception as e:  # a fault that could not be applied or healed is a finding
                report.anomalies.append(f"{f.kind} on {f.targets}: {e}")
                nem.heal(f)
            time.sleep(f.gap)  # quiet time between faults (part of the schedule)
        healed = time.monotonic()
        report.fault_seconds = healed - t0
        for i in range(g.n):  # any member a fault left down comes back
            if g.procs[i] is None:
                g.start_member(i)
        report.acknowledged = writers.join()
        report.anomalies += writers.errors
        src = g.read_sources(timeout=60)
        report.in_sources = sum(len(v) for v in src.values())
        report.broker_lost = max(0, report.acknowledged - report.in_sources)
        if report.in_sources != report.acknowledged:  # the brokers recover their logs: none may be lost
            report.anomalies.append(f"{report.acknowledged} writes acknowledged, {report.in_sources} in the "
                                    f"source topics")
        got = g.wait_for(report.in_sources, CONVERGE_S, poll=0.5)
        report.ordered = {n: len(v) for n, v in got.items()}
        if all(len(v) >= report.in_sources for v in got.values()):
            report.converge_s = time.monotonic() - healed
        ok, detail = check_global_topics(got, expected=report.in_sources)
        if not ok:
            report.anomalies.append(detail)
        keys = {k for v in src.values() for (_, _, k) in v}
        for n, v in got.items():
            ordered = {r.key for r in v}
            if ordered != keys:
                report.anomalies.append(f"{n}: {len(keys - ordered)} source records not ordered, "
                                        f"{len(ordered - keys)} ordered records in no source")
        for i in range(g.n):
            p = g.procs[i]
            if p is not None and p.poll() is not None:
                report.anomalies.append(f"member {g.names[i]} exited with {p.returncode}")
        return report
    finally:
        g.close()
        for p in proxies.values():
            p.close()
        if delays is not None:
            stop_proxies(delays, {})


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="kdsync-nemesis", description="Real clusters and members under a seeded "
                                 "fault schedule; exit 0 when nothing was lost, duplicated or reordered.")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--minutes", type=float, default=2.0, help="minutes of faults (default 2)")
    ap.add_argument("--rate", type=float, default=RATE, help="events/s written into each cluster")
    ap.add_argument("--protocol", choices=("derecho", "clock"), default="derecho", help="the members' protocol")
    ap.add_argument("--delay-ms", type=float, default=0.0,
                    help="one-way delay added to every peer link (a delay proxy behind each fault proxy)")
    ap.add_argument("--workdir", type=Path, help="keep configs and logs here (default: a temporary directory)")
    ap.add_argument("--out", type=Path, help="write the report as JSON here")
    a = ap.parse_args(argv)
    if a.minutes <= 0 or a.rate <= 0 or a.delay_ms < 0:
        ap.error("--minutes and --rate must be > 0, --delay-ms >= 0")
    stamp = lambda m: print(f"[{time.strftime('%H:%M:%S')}] {m}", flush=True)  # noqa: E731
    if a.workdir:
        report = run(a.seed, a.minutes, a.workdir, a.rate, stamp, a.protocol, a.delay_ms)
    else:
        with tempfile.TemporaryDirectory(prefix="kdsync-nemesis-") as d:
            report = run(a.seed, a.minutes, Path(d), a.rate, stamp, a.protocol, a.delay_ms)
    for line in report.lines():
        print(line)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(asdict(report), indent=2) + "\n")
    return 0 if not report.anomalies else 1


if __name__ == "__main__":
    sys.exit(main())
