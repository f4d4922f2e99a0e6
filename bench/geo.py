"""The real geo run (issue 25): five local Tansu clusters and five `kdsync run`
members on loopback, every member link through a delaying proxy with the
one-way delay of the same link in sim/scenarios/wan-five-regions.yaml, paced
writes in every cluster; then the same run in the simulator (the five-region
scenario with the real run's rate, the broker and member costs of
results/calibration.yaml when it exists, and how late the real proxies
forwarded).
Real vs simulated p50 / p99, and the mirror in the same section.

    python -m bench.geo [--protocol clock] [--rate 250] [--duration 8]

Two cores carry ten processes here, so the rate is modest (50 events/s per
region by default) and each figure is the median of a few runs."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

from kdsync.testing.delay_proxy import start_proxies, stop_proxies
from bench.wan import SCENARIOS, delays
from kdsync.testing.stats import percentile

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = SCENARIOS / "wan-five-regions.yaml"
# the WAN settings of docs/wan.md
WAN_TIMING = dict(tick_ms=5, heartbeat_ms=100, suspect_ms=3000, retransmit_ms=250)
WAN_ADAPTIVE = True  # and adaptive_suspect = true (kdsync.core.liveness), real and simulated alike
RATE_EPS = 250.0
DURATION_S = 8.0


@contextlib.contextmanager
def geo_group(protocol: str, out: dict):
    """Five local Tansu clusters and five `kdsync run` members of `protocol`
    on loopback, every member link through a delay proxy with the one-way
    delay of the same link in wan-five-regions.yaml, every member ready.
    Yields (the LocalGroup, member -> its start overrides: a restart passes
    them again); the proxies' lateness goes into `out` at the end."""
    from kdsync.kafka.topic import ensure_topic
    from kdsync.testing import local

    s = yaml.safe_load(SCENARIO.read_text())
    ids, d = delays(s)
    n = len(ids)
    leads = {i: m.get("clock_lead_ms", 0.0) for i, m in enumerate(s["members"])}
    proxies: dict[tuple[int, int], str] = {}
    extra = {"protocol": {"adaptive_suspect": WAN_ADAPTIVE,
                          **({"commit_quorum": s.get("commit_quorum", 0)} if protocol == "clock" else {})}}
    with tempfile.TemporaryDirectory(prefix="kdsync-geo-") as tmp:
        g = local.LocalGroup(n, Path(tmp), protocol=protocol, names=ids, metrics=True,
                             peer_address=lambda i, j: proxies[(i, j)],
                             extra=extra)
        g.timing = dict(WAN_TIMING)
        proxy = None
        try:
            with g:
                links = [(i, j) for i in range(n) for j in range(n) if i != j]
                proxy, ports = start_proxies(0, [f"{g.ports[j]}:{d[(ids[i], ids[j])]}" for i, j in links])
                proxies.update({link: f"127.0.0.1:{port}" for link, port in zip(links, ports)})
                for c in g.clusters:
                    c.start()
                for i in range(n):
                    ensure_topic(g.bootstrap(i), g.topic, 2)
                starts = {i: ({"protocol": {"clock_lead_ms": leads[i]}} if protocol == "clock" and leads[i] else {})
                          for i in range(n)}
                for i in range(n):
                    g.start_member(i, **starts[i])
                g.wait_ready(timeout=120)
                yield g, starts
        finally:
            if proxy is not None:
                stop_proxies(proxy, out)


def real_run(protocol: str, rate_eps: float = RATE_EPS, duration_s: float = DURATION_S,
             timeout_s: float = 120.0) -> dict:
    """One real run; latency = global record timestamp - source timestamp, every
    global topic, records written after every member was ready."""
    from kdsync.testing import local
    from kdsync.testing.load import PacedWriters

    out: dict = {"protocol": protocol, "rate_eps": rate_eps, "duration_s": duration_s}
    with geo_group(protocol, out) as (g, _):
        n = g.n
        per = max(1, int(round(rate_eps * duration_s / n)))
        w = PacedWriters([g.bootstrap(i) for i in range(n)], g.topic, per, "p", rate_eps / n)
        w.warm()
        w.go()
        w.join()
        total = per * n + n  # and the warm-up record of each cluster
        got = g.wait_for(total, timeout_s, poll=0.1)
        short = {k: len(v) for k, v in got.items() if len(v) < total}
        if short:
            raise RuntimeError(f"{total} events not ordered in {timeout_s:.0f} s: {short}")
        lat = [max(0, r.write_ts - r.origin_ts) for v in got.values() for r in v
               if (r.key or b"").startswith(b"p")]
        out.update({"events": per * n, "p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99),
                    "loadavg_1m": round(os.getloadavg()[0], 2)})
        if protocol != "mirror":
            ok, detail = local.check_global_topics(got, expected=total)
            out["agreement"] = ok
            out["agreement_detail"] = detail
    return out


def sim_scenario(protocol: str, rate_eps: float, duration_s: float, late_ms: list[float] | None = None) -> dict:
    """The real geo run as a scenario dict: wan-five-regions' delays, the
    WAN timers, paced writes from 2 s, this machine's broker and member costs
    (results/calibration.yaml, when `kdsync-sim calibrate` wrote it) and how
    late the real proxies forwarded (`late_ms`)."""
    s = yaml.safe_load(SCENARIO.read_text())
    s.update(name=f"geo-{protocol}", protocol=protocol, duration_s=duration_s + 2, settle_s=8,
             timing=dict(WAN_TIMING), adaptive_suspect=WAN_ADAPTIVE,
             workload=[{"member": "all", "rate_eps": rate_eps / len(s["members"]), "partitions": 2,
                        "payload_bytes": 40, "arrivals": "paced", "start_s": 2}])
    if protocol != "clock":
        s.pop("commit_quorum", None)
        for m in s["members"]:
            m.pop("clock_lead_ms", None)
    if late_ms:
        s["network"]["default"]["extra_quantiles_ms"] = list(late_ms)
        for link in s["network"]["links"]:
            link["extra_quantiles_ms"] = list(late_ms)
    calib = ROOT / "results" / "calibration.yaml"
    if calib.is_file():  # this machine's broker and member as `kdsync-sim calibrate` measured them
        from sim.calibrate import kafka_at

        profile = yaml.safe_load(calib.read_text())
        s["kafka"] = {**s.get("kafka", {}), **kafka_at(profile, rate_eps)}
        if profile.get("member_cost"):
            s["member_cost"] = profile["member_cost"]
    return s


def sim_run(protocol: str, rate_eps: float, duration_s: float, workdir: Path, late_ms: list[float] | None = None,
            seeds: int = 3) -> dict:
    """The same in the simulator: the median over `seeds` seeds of the p50 /
    p99 of records created once every member was in its first view."""
    from sim.runner import run_scenario
    from sim.scenario import load_scenario

    path = workdir / f"geo-{protocol}.yaml"
    path.write_text(yaml.safe_dump(sim_scenario(protocol, rate_eps, duration_s, late_ms), sort_keys=False))
    sc = load_scenario(path)
    runs = []
    for seed in range(1, seeds + 1):
        r = run_scenario(sc, seed=seed)
        sm = r.summary  # the mirror has no views, so no "ready": all of its records count
        lat = sm["latency_created_after_ready_ms"] if sm["group_ready_s"] is not None else sm["latency_created_ms"]
        runs.append((lat["p50"], lat["p99"], len(r.failing)))
    return {"p50_ms": statistics.median(x[0] for x in runs), "p99_ms": statistics.median(x[1] for x in runs),
            "violations": sum(x[2] for x in runs), "seeds": seeds}


def compare(protocols=("mirror", "clock"), runs: int = 2, rate_eps: float = RATE_EPS,
            duration_s: float = DURATION_S, say=print) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="kdsync-geo-sim-") as tmp:
        for proto in protocols:
            real = []
            for k in range(runs):
                try:
                    real.append(real_run(proto, rate_eps, duration_s))
                    say(f"geo: {proto} real run {k + 1}: p50 {real[-1]['p50_ms']} p99 {real[-1]['p99_ms']}")
                except Exception as e:  # one run failing must not hide the others
                    say(f"geo: {proto} real run {k + 1} failed: {type(e).__name__}: {str(e)[:200]}")
            if not real:
                rows.append({"protocol": proto, "error": "no real run finished"})
                continue
            late = real[0].get("proxy_late_quantiles_ms")
            sim = sim_run(proto, rate_eps, duration_s, Path(tmp), late)
            r50 = statistics.median(r["p50_ms"] for r in real)
            r99 = statistics.median(r["p99_ms"] for r in real)
            rows.append({"protocol": proto, "real p50": r50, "sim p50": sim["p50_ms"],
                         "p50 real/sim": round(r50 / sim["p50_ms"], 3) if sim["p50_ms"] else None,
                         "real p99": r99, "sim p99": sim["p99_ms"],
                         "p99 real/sim": round(r99 / sim["p99_ms"], 3) if sim["p99_ms"] else None,
                         "real runs": len(real), "real p50 runs": "/".join(f"{r['p50_ms']:g}" for r in real),
                         "agreement": all(r.get("agreement", True) for r in real),
                         "sim violations": sim["violations"], "events per run": real[0]["events"],
                         "proxy late p50 ms": real[0].get("proxy_late_p50_ms"),
                         "loadavg": real[0].get("loadavg_1m")})
    return rows


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m bench.geo", description=__doc__.split("\n\n")[0])
    p.add_argument("--protocol", action="append", help="mirror, derecho, clock (repeat; default mirror and clock)")
    p.add_argument("--rate", type=float, default=RATE_EPS, help="total events/s over the five clusters")
    p.add_argument("--duration", type=float, default=DURATION_S)
    p.add_argument("--runs", type=int, default=2)
    a = p.parse_args(argv)
    rows = compare(tuple(a.protocol or ("mirror", "clock")), a.runs, a.rate, a.duration)
    for r in rows:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
