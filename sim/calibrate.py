"""`kdsync-sim calibrate`: measure what a real member and a real broker cost on
this machine, and write a profile that scenarios name (`profile: FILE`).

Theory of operation
-------------------
*Member CPU.*  `kdsync.testing.load.run_load` starts 3 embedded Tansu clusters and one
`kdsync run` per cluster with kdsync's default configuration, and writes a
paced load.  For each rate, over the paced phase, every member gives one
row: process CPU seconds (psutil, user + system), peer frames in + out and
source records consumed + global records written (its Prometheus counters),
and the phase length in ticks.  The simulator charges a member
`message_us` per peer message in or out, `event_us` per record submitted or
delivered and `tick_us` per tick, so the three are the non-negative least
squares fit of CPU = message_us·frames + event_us·events + tick_us·ticks
over every row (`nnls`: exact for a few unknowns, NumPy only).

*Broker.*  On one embedded Tansu: `produce_ms` is the median time from
produce() to the delivery report of one record with acks=all and no linger
(append + acknowledgement; one broker, so nothing to replicate: `ack_ms` 0);
the fetch model is fitted to the time from a record's acknowledgement to a
consumer with the member's `fetch.wait.max.ms` receiving it: the 10th
percentile is `fetch_overhead_ms` (what even a waiting fetch costs) and the
median sets `fetch_check_ms` (= 2 × (median − overhead): how soon a held
fetch notices new data; Tansu does not always wait the whole
`fetch.wait.max.ms`).

*Timing and clients.*  The profile carries kdsync's own defaults for the
member's timers (`timing`), its producer's `linger.ms` (`sink_linger_ms`)
and consumer's `fetch.wait.max.ms`, and the writers' `linger.ms` of the
bench (`kafka.linger_ms`), read from the code, not measured.
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from pathlib import Path

import numpy as np
import yaml

__all__ = ["fit_costs", "nnls", "probe_broker", "measure_member", "calibrate", "write_profile"]

COST_TERMS = ("message_us", "event_us", "tick_us")


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a x - b|| subject to x >= 0, for a few columns: every
    support set is solved by least squares and the best feasible one kept."""
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    n = a.shape[1]
    best, best_res = np.zeros(n), float(np.sum(b * b))
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            sol, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if np.any(sol < 0):
                continue
            x = np.zeros(n)
            x[list(cols)] = sol
            r = a @ x - b
            res = float(r @ r)
            if res < best_res - 1e-18:
                best, best_res = x, res
    return best


def fit_costs(rows: list[dict]) -> dict:
    """rows: {cpu_s, frames, events, ticks} per member and rate.  Returns
    message_us, event_us, tick_us (>= 0) and the fit's r2 and rows."""
    if not rows:
        raise ValueError("no measurement to fit")
    a = np.array([[r["frames"], r["events"], r["ticks"]] for r in rows], dtype=float)
    b = np.array([r["cpu_s"] for r in rows], dtype=float) * 1e6
    x = nnls(a, b)
    pred = a @ x
    ss_tot = float(np.sum((b - b.mean()) ** 2))
    r2 = 1.0 - float(np.sum((b - pred) ** 2)) / ss_tot if ss_tot > 0 else 1.0
    out = {k: round(float(v), 2) for k, v in zip(COST_TERMS, x)}
    out["r2"] = round(r2, 4)
    out["rows"] = len(rows)
    return out


# ------------------------------------------------------------------ broker
def probe_broker(bootstrap: str, fetch_wait_ms: float = 5.0, seconds: float = 4.0, gap_s: float = 0.013,
                 topic: str = "kdsync-calibrate") -> dict:
    """produce (acks=all) and fetch latencies of one broker, in ms (module doc)."""
    from confluent_kafka import Consumer, Producer, TopicPartition

    from kdsync.kafka.topic import ensure_topic

    ensure_topic(bootstrap, topic)
    cons = Consumer({"bootstrap.servers": bootstrap, "group.id": "kdsync-calibrate", "enable.auto.commit": False,
                     "fetch.wait.max.ms": int(fetch_wait_ms), "log_level": 3})
    prod = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 0, "log_level": 3})
    sent: dict[int, float] = {}
    acked: dict[int, float] = {}

    def on_ack(err, m):
        if err is None:
            acked[int(m.key())] = time.monotonic()

    try:
        cons.assign([TopicPartition(topic, 0, 0)])
        t_warm = time.monotonic() + 1.0
        while time.monotonic() < t_warm:
            cons.poll(0.05)
        fetched: list[float] = []
        i = 0
        nxt = time.monotonic()
        stop = nxt + seconds
        while time.monotonic() < stop:
            now = time.monotonic()
            if now >= nxt:
                sent[i] = now
                prod.produce(topic, key=str(i).encode(), value=b"x", partition=0, on_delivery=on_ack)
                i += 1
                nxt += gap_s
            prod.poll(0)
            m = cons.poll(0.0005)
            if m is not None and not m.error():
                t = time.monotonic()
                prod.poll(0)
                k = int(m.key())
                if k in acked:
                    fetched.append((t - acked[k]) * 1000.0)
        prod.flush(10)
    finally:
        cons.close()
    produce = sorted((acked[k] - sent[k]) * 1000.0 for k in acked)
    fetched.sort()
    if len(produce) < 20 or len(fetched) < 20:
        raise RuntimeError(f"broker probe: only {len(produce)} acknowledged and {len(fetched)} fetched records")
    q = statistics.quantiles(fetched, n=10)
    overhead = max(0.0, q[0])
    median = statistics.median(fetched)
    return {"produce_ms": round(statistics.median(produce), 3),
            "produce_p90_ms": round(statistics.quantiles(produce, n=10)[-1], 3),
            "fetch_p10_ms": round(q[0], 3), "fetch_p50_ms": round(median, 3), "fetch_p90_ms": round(q[-1], 3),
            "fetch_overhead_ms": round(overhead, 3),
            "fetch_check_ms": round(min(fetch_wait_ms, max(0.0, 2.0 * (median - overhead))), 3),
            "samples": len(fetched)}


def probe_embedded(fetch_wait_ms: float = 5.0, seconds: float = 4.0) -> dict:
    """probe_broker on a fresh embedded Tansu."""
    import tempfile

    from kdsync.kafka.embedded import EmbeddedCluster

    with tempfile.TemporaryDirectory(prefix="kdsync-calibrate-") as d, EmbeddedCluster("calibrate", log_dir=d) as c:
        c.start()
        return probe_broker(c.bootstrap, fetch_wait_ms, seconds)


# --------------------------------------------------------------------- box
_BOX_PROBE = r"""
import json, sys, time
end = time.perf_counter() + float(sys.argv[1])
over, wall, cpu, n = [], 0.0, 0.0, 0
while time.perf_counter() < end:
    t0 = time.perf_counter()
    time.sleep(0.002)
    over.append(time.perf_counter() - t0 - 0.002)
    n += 1
    if n % 50 == 0:  # now and then 1 ms of CPU: mostly asleep, like a member (CFS favours sleepers)
        c0, w0 = time.thread_time(), time.perf_counter()
        while time.thread_time() - c0 < 0.001:
            pass
        wall += time.perf_counter() - w0
        cpu += time.thread_time() - c0
over.sort()
qs = [1e6 * max(0.0, over[min(len(over) - 1, round(k * (len(over) - 1) / 40))]) for k in range(41)]
print(json.dumps({"wakeup_us": 1e6 * sum(over) / len(over), "wakeup_p50_us": 1e6 * over[len(over) // 2], "quantiles_us": qs,
                  "wakeup_p90_us": 1e6 * over[int(len(over) * 0.9)], "slowdown": wall / cpu if cpu else 1.0,
                  "samples": len(over)}))
"""


def start_box_probe(seconds: float):
    """A process that sleeps 2 ms again and again for `seconds` (every 50th
    time it spins 1 ms of CPU): how late a mostly idle process wakes up (the
    scheduler of this box now) and wall / CPU time when it computes.  It
    stays mostly asleep, like a member, so the scheduler treats it as one and
    it adds almost no load.  `finish_box_probe` reads the result."""
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-c", _BOX_PROBE, str(seconds)], stdout=subprocess.PIPE, text=True)


def finish_box_probe(proc) -> dict:
    import json

    outs, _ = proc.communicate(timeout=120)
    return json.loads(outs.strip().splitlines()[-1])


# ------------------------------------------------------------------ member
def _counter(metrics: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in metrics.items() if n == name and want <= set(ls))


def _snapshot(g) -> list[dict]:
    import psutil

    out = []
    for i, p in enumerate(g.procs):
        m = g.metrics(i)
        t = psutil.Process(p.pid).cpu_times()
        out.append({"t": time.monotonic(), "cpu_s": t.user + t.system,
                    "frames": _counter(m, "kdsync_peer_frames_total"),
                    "events": _counter(m, "kdsync_events_consumed_total") + _counter(m, "kdsync_events_written_total")})
    return out


def measure_member(rates: list[float], duration_s: float, protocol: str = "derecho", tick_ms: float | None = None,
                   say=print) -> tuple[list[dict], list[dict]]:
    """One kdsync.testing.load run per rate; returns (fit rows, one summary per run)."""
    from kdsync.testing.load import run_load
    from kdsync.config import ProtocolSection

    tick_s = (tick_ms or ProtocolSection(name=protocol).tick_ms) / 1000.0
    fetch_wait = defaults()["fetch_wait_ms"]
    rows, runs = [], []
    for rate in rates:
        snap: dict = {}

        def on_group(g, snap=snap):
            import threading

            from kdsync.testing.load import stage_sums

            snap["before"] = _snapshot(g)
            snap["stages0"] = [stage_sums(g, i) for i in range(len(g.procs))]
            snap["box"] = start_box_probe(duration_s)

            def broker():  # the broker's latencies while it carries this rate
                try:
                    snap["broker"] = probe_broker(g.bootstrap(0), fetch_wait, max(1.0, duration_s - 1.0),
                                                  topic="kdsync-calibrate-loaded")
                except Exception as e:  # reported, the fit does not need it
                    snap["broker"] = {"error": str(e)[:200]}

            snap["broker_thread"] = threading.Thread(target=broker, daemon=True)
            snap["broker_thread"].start()

        def on_done(g, out, snap=snap):
            from kdsync.testing.load import stage_sums

            snap["after"] = _snapshot(g)
            s1 = [stage_sums(g, i) for i in range(len(g.procs))]
            tot = sum(b.get("fetch", (0, 0))[0] - a.get("fetch", (0, 0))[0] for a, b in zip(snap["stages0"], s1))
            n = sum(b.get("fetch", (0, 0))[1] - a.get("fetch", (0, 0))[1] for a, b in zip(snap["stages0"], s1))
            snap["member_fetch_ms"] = round(1000 * tot / n, 3) if n else None
            snap["broker_thread"].join(60)

        say(f"calibrate: {protocol} at {rate:g} events/s for {duration_s:g} s")
        r = run_load(protocol, rate, duration_s, on_group=on_group, on_done=on_done, floor=False)
        for i, (b, a) in enumerate(zip(snap["before"], snap["after"])):
            rows.append({"rate_eps": rate, "member": i, "cpu_s": a["cpu_s"] - b["cpu_s"],
                         "frames": a["frames"] - b["frames"], "events": a["events"] - b["events"],
                         "ticks": (a["t"] - b["t"]) / tick_s, "seconds": a["t"] - b["t"]})
        box = finish_box_probe(snap["box"])
        runs.append({**{k: r.get(k) for k in ("rate_eps", "p50_ms", "p99_ms", "cpu_us_per_event",
                                              "frames_out_per_event", "loadavg_1m")},
                     "box": {k: ([round(x, 1) for x in v] if isinstance(v, list) else round(v, 2))
                             for k, v in box.items()},
                     "broker": snap.get("broker", {}),
                     # kdsync_stage_seconds{stage="fetch"}: source CreateTime -> the member's consumer has it
                     "member_fetch_ms": snap.get("member_fetch_ms")})
    return rows, runs


# ----------------------------------------------------------------- profile
def defaults() -> dict:
    """kdsync's own client settings and timers (read from the code)."""
    from kdsync.config import ProtocolSection
    from kdsync.kafka.sink import producer_conf
    from kdsync.kafka.source import consumer_conf

    p = ProtocolSection()
    return {"fetch_wait_ms": float(consumer_conf("x", {})["fetch.wait.max.ms"]),
            "sink_linger_ms": float(producer_conf({})["linger.ms"]),
            "writer_linger_ms": 2.0,  # kdsync.testing.local.write_events (the bench's writers)
            "timing": {k: float(getattr(p, k)) for k in ("tick_ms", "heartbeat_ms", "suspect_ms", "retransmit_ms")}}


def broker_by_rate(runs: list[dict]) -> list[dict]:
    """The broker terms measured under each paced rate (bench/simreal.py
    interpolates them at a point's rate)."""
    keys = ("produce_ms", "fetch_overhead_ms", "fetch_check_ms")
    writer_linger = defaults()["writer_linger_ms"]
    out = []
    for r in runs:
        b = r.get("broker", {})
        if not all(k in b for k in keys):
            continue
        row = {"rate_eps": r["rate_eps"], **{k: b[k] for k in keys}}
        # for comparison only: the members' own mean fetch stage in that run, and what the
        # probe's terms give for it (writer linger + append + fetch median).  The members'
        # mean is dominated by the tail of a busy box (it was 2x the points' own), so it is
        # not used to set produce_ms
        row["member_fetch_ms"] = r.get("member_fetch_ms")
        row["probe_fetch_path_ms"] = round(writer_linger + b["produce_ms"] + b["fetch_p50_ms"], 3)
        out.append(row)
    return out


def kafka_at(profile: dict, rate_eps: float) -> dict:
    """The profile's broker terms at `rate_eps`: linear between the measured
    rates (flat beyond them); the idle probe's when none was measured."""
    pts = sorted(profile.get("calibration", {}).get("broker_by_rate") or [], key=lambda r: r["rate_eps"])
    if not pts:
        return {}
    if rate_eps <= pts[0]["rate_eps"]:
        lo = hi = pts[0]
    elif rate_eps >= pts[-1]["rate_eps"]:
        lo = hi = pts[-1]
    else:
        hi = next(p for p in pts if p["rate_eps"] >= rate_eps)
        lo = [p for p in pts if p["rate_eps"] <= rate_eps][-1]
    w = 0.0 if hi is lo or hi["rate_eps"] == lo["rate_eps"] else (rate_eps - lo["rate_eps"]) / (hi["rate_eps"] - lo["rate_eps"])
    return {k: round(lo[k] + (hi[k] - lo[k]) * w, 3) for k in ("produce_ms", "fetch_overhead_ms", "fetch_check_ms")}


def box_terms(runs: list[dict]) -> dict:
    """wakeup_us and slowdown for the profile: the medians over the paced runs."""
    boxes = [r["box"] for r in runs if r.get("box")]
    if not boxes:
        return {"wakeup_us": 0.0, "slowdown": 1.0}
    n = len(boxes[0].get("quantiles_us", []))
    out = {"wakeup_us": round(statistics.median(b["wakeup_us"] for b in boxes), 1),
           "slowdown": round(max(1.0, statistics.median(b["slowdown"] for b in boxes)), 3)}
    if n and all(len(b.get("quantiles_us", [])) == n for b in boxes):  # pooled: the mean of each quantile
        out["wakeup_quantiles_us"] = [round(statistics.fmean(b["quantiles_us"][k] for b in boxes), 1)
                                      for k in range(n)]
    return out


def build_profile(costs: dict, broker: dict, meta: dict, box: dict | None = None) -> dict:
    d = defaults()
    return {
        "kafka": {"produce_ms": broker["produce_ms"], "ack_ms": 0.0, "linger_ms": 0.0,
                  "writer_linger_ms": d["writer_linger_ms"],
                  "fetch_wait_ms": d["fetch_wait_ms"], "fetch_overhead_ms": broker["fetch_overhead_ms"],
                  "fetch_check_ms": broker["fetch_check_ms"], "sink_linger_ms": d["sink_linger_ms"]},
        "member_cost": {k: costs[k] for k in COST_TERMS} | (box or {}) | {"cores": 1},
        "timing": d["timing"],
        "calibration": {**meta, "fit_r2": costs.get("r2"), "fit_rows": costs.get("rows"), "broker": broker},
    }


def write_profile(profile: dict, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    head = ("# kdsync-sim calibrate: what a real member and broker cost on this machine.\n"
            "# Name it in a scenario with  profile: " + str(path) + "  (docs/scenario.md).\n")
    path.write_text(head + yaml.safe_dump(profile, sort_keys=False), encoding="utf-8")
    return path


def calibrate(out: Path, rates: list[float], duration_s: float, protocol: str = "derecho", say=print) -> dict:
    load0 = os.getloadavg()[0]
    broker = probe_embedded(defaults()["fetch_wait_ms"])
    say(f"calibrate: broker produce {broker['produce_ms']} ms, fetch p50 {broker['fetch_p50_ms']} ms")
    rows, runs = measure_member(rates, duration_s, protocol, say=say)
    costs = fit_costs(rows)
    meta = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "protocol": protocol,
            "broker_by_rate": broker_by_rate(runs),
            "rates_eps": list(rates), "duration_s": duration_s, "loadavg_1m": [round(load0, 2),
                                                                               round(os.getloadavg()[0], 2)],
            "cpus": os.cpu_count(), "runs": runs,
            "members": [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in rows]}
    profile = build_profile(costs, broker, meta, box_terms(runs))
    write_profile(profile, out)
    return profile
