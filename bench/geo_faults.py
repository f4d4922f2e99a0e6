"""The real geo run through a region's crash and another's clean stop
(issue 42): five local Tansu clusters and five `kdsync run` members on
loopback, every member link through a delay proxy (bench.geo), paced writes
in every cluster; mid-stream Tokyo's member is killed (SIGKILL) and later
restarted, then Oregon's member is stopped (SIGTERM: it announces its leave)
and later restarted.  Then the same schedule in the simulator.

    python -m bench.geo_faults [--protocol clock] [--rate 250] [--seeds 3]

Checked: every cluster's global topic identical, exactly once, every event
written (those written into a region while its member was down are ordered
after it returns).  Measured, per fault, over the events of the regions that
stay up (origin and receiving cluster both up): the worst latency of those
created in the AFTER_S after the fault, next to the steady p99 — real and
simulated side by side (issue 42 asks for real within +-20 % of simulated).
"""

from __future__ import annotations

import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench.geo import RATE_EPS, geo_group, sim_scenario
from kdsync.testing.stats import percentile

# seconds after the writers start.  The steady window ends a second before
# the kill: the killed region's events of its last ~second are still in its
# member's source then and are ordered after its return (re-consumed) — they
# belong to the fault (with them the steady p99 read 13 s).  The stop comes
# 9 s after the restart: a restarted member on this loaded box takes ~6 s
# from exec to its first view, and a stop inside that view change measured
# the collision, not the stop.
STEADY = (1.0, 5.0)
FAULTS = (  # (name, member, signal, at, restart at)
    ("crash", "tyo", signal.SIGKILL, 6.0, 11.0),
    ("stop", "or", signal.SIGTERM, 20.0, 24.0),
)
WRITE_S = 28.0
AFTER_S = 3.0  # the window after a fault (issue 42: the 3 s after it)
SIM_START_S = 2.0  # the simulated workload's start


def _windows(samples: list[tuple[float, str, str, float]]) -> dict:
    """samples: (created s after the start, origin, receiving cluster, latency ms)."""
    steady = [x for t, o, m, x in samples if STEADY[0] <= t < STEADY[1]]
    out = {"steady_p99_ms": round(percentile(steady, 99), 1) if steady else None}
    for name, who, _, at, back in FAULTS:
        xs = [x for t, o, m, x in samples if at <= t < at + AFTER_S and who not in (o, m)]
        out[f"{name}_worst_ms"] = round(max(xs), 1) if xs else None
        ret = [x for t, o, m, x in samples if back <= t < back + AFTER_S and who not in (o, m)]
        out[f"{name}_return_worst_ms"] = round(max(ret), 1) if ret else None
    return out


def real_run(protocol: str = "clock", rate_eps: float = RATE_EPS, timeout_s: float = 180.0) -> dict:
    from kdsync.testing import local
    from kdsync.testing.load import PacedWriters

    out: dict = {"protocol": protocol, "rate_eps": rate_eps}
    with geo_group(protocol, out) as (g, starts):
        n = g.n
        idx = {name: i for i, name in enumerate(g.names)}
        per = max(1, int(round(rate_eps * WRITE_S / n)))
        w = PacedWriters([g.bootstrap(i) for i in range(n)], g.topic, per, "p", rate_eps / n)
        w.warm()
        t0 = time.time()
        w.go()
        events = sorted([(at, "fault", name, who, sig) for name, who, sig, at, _ in FAULTS]
                        + [(back, "restart", name, who, None) for name, who, _, _, back in FAULTS])
        for at, what, name, who, sig in events:
            time.sleep(max(0.0, t0 + at - time.time()))
            i = idx[who]
            if what == "fault":
                g.signal_member(i, sig)
                out[f"{name}_exit"] = g.wait_member(i, 30)
            else:
                g.start_member(i, **starts[i])
        w.join()
        total = per * n + n  # and the warm-up record of each cluster
        got = g.wait_for(total, timeout_s, poll=0.2)
        ok, detail = local.check_global_topics(got, expected=total)
        out.update({"events": per * n, "agreement": ok, "agreement_detail": detail})
        samples = []
        for member, recs in got.items():
            for r in recs:
                if (r.key or b"").startswith(b"p"):
                    samples.append((r.origin_ts / 1000.0 - t0, r.origin, member, max(0, r.write_ts - r.origin_ts)))
        out.update(_windows(samples))
    return out


def sim_run(protocol: str = "clock", rate_eps: float = RATE_EPS, seeds: int = 3, late_ms=None) -> dict:
    """The same schedule in the simulator: per window, the median over seeds."""
    from sim.runner import run_scenario
    from sim.scenario import load_scenario

    s = sim_scenario(protocol, rate_eps, WRITE_S, late_ms)
    s["workload"][0]["stop_s"] = SIM_START_S + WRITE_S
    faults = []
    for name, who, sig, at, back in FAULTS:
        faults.append({"at_s": SIM_START_S + at, ("crash" if sig == signal.SIGKILL else "stop"): who})
        faults.append({"at_s": SIM_START_S + back, "restart": who})
    s.update(name=f"geo-faults-{protocol}", faults=faults, settle_s=20)
    with tempfile.TemporaryDirectory(prefix="kdsync-geo-faults-") as tmp:
        path = Path(tmp) / "s.yaml"
        path.write_text(yaml.safe_dump(s, sort_keys=False))
        sc = load_scenario(path)
        runs, violations = [], 0
        for seed in range(1, seeds + 1):
            r = run_scenario(sc, seed=seed)
            violations += len(r.failing)
            t = r.trace
            runs.append(_windows([(a - SIM_START_S, o, m, (b - a) * 1000.0) for m, o, a, b in
                                  zip(t["member"], t["origin"], t["submit_ts"], t["deliver_ts"])]))
    out = {k: statistics.median(r[k] for r in runs if r[k] is not None) for k in runs[0]}
    out.update(violations=violations, seeds=seeds)
    return out


def compare(protocol: str = "clock", rate_eps: float = RATE_EPS, seeds: int = 3, say=print) -> list[dict]:
    real = real_run(protocol, rate_eps)
    say(f"geo faults: real {json.dumps(real)}")
    sim = sim_run(protocol, rate_eps, seeds, real.get("proxy_late_quantiles_ms"))
    say(f"geo faults: sim {json.dumps(sim)}")
    rows = []
    for name, who, sig, _, _ in FAULTS:
        r, s_ = real[f"{name}_worst_ms"], sim[f"{name}_worst_ms"]
        rows.append({"protocol": protocol, "fault": f"{name} ({who}, {signal.Signals(sig).name})",
                     "real steady p99": real["steady_p99_ms"], "sim steady p99": sim["steady_p99_ms"],
                     "real worst after": r, "sim worst after": s_,
                     "worst real/sim": round(r / s_, 2) if r and s_ else None,
                     "real return worst": real[f"{name}_return_worst_ms"],
                     "sim return worst": sim[f"{name}_return_worst_ms"],
                     "agreement": real["agreement"], "events": real["events"],
                     "sim violations": sim["violations"]})
    return rows


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m bench.geo_faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--protocol", default="clock", help="derecho or clock (default clock)")
    p.add_argument("--rate", type=float, default=RATE_EPS, help="total events/s over the five clusters")
    p.add_argument("--seeds", type=int, default=3, help="simulator seeds")
    a = p.parse_args(argv)
    rows = compare(a.protocol, a.rate, a.seeds)
    for r in rows:
        print(json.dumps(r))
    return 0 if all(r["agreement"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
