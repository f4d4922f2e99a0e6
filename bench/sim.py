"""The simulator sections: the same workload under derecho / sequencer /
mirror across a sweep of WAN round-trip times and loss rates, several seeds
each, through the public `kdsync-sim run SCENARIO --seed N --out DIR` (called
in-process in pool workers: `sim.cli.main`, so a run does not pay for a new
interpreter),.

Scenario files are generated into a temporary directory (never sim/scenarios).
Figures come from each run's summary.json; disagreeing positions and the
latency distributions are computed from trace.parquet with pyarrow.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import shutil
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import yaml

from bench.common import Headline, NotMeasured, Section, Table, mean, ratio
from kdsync.testing.stats import percentile

PROTOCOLS = ("derecho", "sequencer", "mirror")
KINDS = ("agreement", "integrity", "loss", "origin_order", "split_brain")


@dataclass(frozen=True)
class SweepParams:
    rtts_ms: tuple[float, ...]
    losses: tuple[float, ...]
    seeds: tuple[int, ...]
    duration_s: float
    settle_s: float
    rate_eps: float  # per member
    bursts: tuple[tuple[float, int], ...]  # (at_s, events) at every member at once
    partitions: int = 2


FULL = SweepParams(rtts_ms=(10, 50, 150), losses=(0.0, 0.02), seeds=(1, 2, 3), duration_s=6, settle_s=6,
                   rate_eps=100, bursts=((2.0, 150), (4.0, 150)))
QUICK = SweepParams(rtts_ms=(50,), losses=(0.0,), seeds=(1,), duration_s=3, settle_s=3, rate_eps=50,
                    bursts=((1.0, 100),))


@dataclass(frozen=True)
class SimJob:
    group: str  # "sweep" | "yardstick"
    protocol: str
    rtt_ms: float
    loss: float
    seed: int
    scenario: str  # path of the generated YAML
    out: str  # run directory (summary.json, trace.parquet)


def scenario_dict(name: str, protocol: str, rtt_ms: float, loss: float, p: SweepParams,
                  produce_ms: float = 2.0, consume_ms: float = 1.0) -> dict:
    """The one workload every protocol runs: steady writes at every cluster
    plus bursts that hit every cluster at the same instant (concurrent inserts)."""
    one_way = rtt_ms / 2.0
    workload = [{"member": "all", "rate_eps": p.rate_eps, "payload_bytes": 256, "partitions": p.partitions,
                 "start_s": 0, "stop_s": p.duration_s}]
    workload += [{"member": "all", "burst": n, "at_s": at} for at, n in p.bursts]
    return {
        "name": name, "seed": 1, "protocol": protocol,
        "duration_s": p.duration_s, "settle_s": p.settle_s,
        "members": [{"id": "dc1"}, {"id": "dc2"}, {"id": "dc3"}],
        "network": {"default": {"latency_ms": one_way, "jitter_ms": round(max(0.01, one_way / 10), 3), "loss": loss}},
        "kafka": {"produce_ms": produce_ms, "consume_ms": consume_ms},
        "workload": workload,
    }


def _tag(x: float) -> str:
    return f"{x:g}".replace(".", "p")


def sweep_jobs(p: SweepParams, workdir: Path) -> list[SimJob]:
    scen = workdir / "scenarios"
    scen.mkdir(parents=True, exist_ok=True)
    jobs = []
    for protocol in PROTOCOLS:
        for rtt in p.rtts_ms:
            for loss in p.losses:
                name = f"sweep-{protocol}-rtt{_tag(rtt)}-loss{_tag(loss)}"
                path = scen / f"{name}.yaml"
                path.write_text(yaml.safe_dump(scenario_dict(name, protocol, rtt, loss, p), sort_keys=False))
                for seed in p.seeds:
                    jobs.append(SimJob("sweep", protocol, rtt, loss, seed, str(path),
                                       str(workdir / "runs" / f"{name}-s{seed}")))
    return jobs


def yardstick_jobs(workdir: Path) -> list[SimJob]:
    """The simulator-speed yardstick of issue 3 (sim/scenarios/bench-3dc-1000eps.yaml, as shipped)."""
    path = Path(__file__).resolve().parent.parent / "sim" / "scenarios" / "bench-3dc-1000eps.yaml"
    if not path.exists():
        return []
    return [SimJob("yardstick", "derecho", 50.0, 0.0, 11, str(path), str(workdir / "runs" / "yardstick"))]


def yardstick_rows(jobs: list[SimJob], results: list[dict]) -> list[dict]:
    rows = []
    for job, res in zip(jobs, results):
        row, _ = run_row(job, res)
        rows.append({"scenario": Path(job.scenario).name, "exit_code": row["exit_code"],
                     "events_submitted": row.get("events_submitted"), "sim_wall_s": row.get("sim_wall_s"),
                     "sim_events_per_wall_s": row.get("sim_events_per_wall_s"), "messages": row.get("messages"),
                     "goal": ">= 200 000 (issue 3)", "error": row.get("error")})
    return rows


def run_job(job: SimJob) -> dict:
    """Pool worker: `kdsync-sim run SCENARIO --seed N --out DIR`, in-process.
    Returns {"exit": code, "wall_s": ..., "output": last lines} (never raises
    for a failed run; an ImportError of sim/ is reported as exit -1)."""
    t0 = time.perf_counter()
    buf = io.StringIO()
    try:
        from sim.cli import main as sim_main
    except Exception as e:  # sim/ not there yet
        return {"exit": -1, "wall_s": 0.0, "output": f"cannot import sim.cli: {e}"}
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            code = sim_main(["run", job.scenario, "--seed", str(job.seed), "--out", job.out])
        except Exception as e:  # a crash inside the simulator: report it, keep the bench going
            print(f"kdsync-sim crashed: {type(e).__name__}: {e}")
            code = -1
    lines = buf.getvalue().strip().splitlines()
    return {"exit": code, "wall_s": time.perf_counter() - t0, "output": "\n".join(lines[-6:])}


def trace_facts(run_dir: Path) -> dict:
    """From trace.parquet: positions where members hold different events,
    and the pooled latency samples (ms, source ack -> each global topic)."""
    import pyarrow.parquet as pq

    t = pq.read_table(run_dir / "trace.parquet", columns=["member", "event_id", "seq", "submit_ts", "deliver_ts"])
    d = t.to_pydict()
    by_seq: dict[int, set] = defaultdict(set)
    for ev, seq in zip(d["event_id"], d["seq"]):
        by_seq[seq].add(ev)
    disagree = sum(1 for evs in by_seq.values() if len(evs) > 1)
    lat = [(b - a) * 1000.0 for a, b in zip(d["submit_ts"], d["deliver_ts"])]
    return {"positions": len(by_seq), "disagreeing_positions": disagree, "latency_ms": lat, "rows": t.num_rows}


def run_row(job: SimJob, res: dict) -> tuple[dict, list[float]]:
    """One CSV row per run, plus its latency samples."""
    row = {"group": job.group, "protocol": job.protocol, "rtt_ms": job.rtt_ms, "loss": job.loss, "seed": job.seed,
           "exit_code": res["exit"], "wall_s": round(res["wall_s"], 3)}
    out = Path(job.out)
    if not (out / "summary.json").is_file():
        row["error"] = res["output"].replace("\n", " | ")[:300]
        return row, []
    s = json.loads((out / "summary.json").read_text())
    counts = Counter(v["kind"] for v in s.get("violations", []))
    delivered = list(s["events_delivered"].values())
    row.update({
        "events_submitted": s["events_submitted"],
        "delivered_min": min(delivered) if delivered else 0,
        "p50_ms": s["latency_ms"]["p50"], "p90_ms": s["latency_ms"]["p90"], "p99_ms": s["latency_ms"]["p99"],
        "max_ms": s["latency_ms"]["max"], "throughput_eps": s["throughput_eps"],
        "sim_wall_s": s.get("wall_time_s"),
        "sim_events_per_wall_s": round(s["events_submitted"] / s["wall_time_s"]) if s.get("wall_time_s") else None,
        "messages": (s.get("network") or {}).get("messages"),
        **{f"v_{k}": counts.get(k, 0) for k in KINDS},
        "v_other": sum(n for k, n in counts.items() if k not in KINDS),
    })
    lat: list[float] = []
    if (out / "trace.parquet").exists():
        f = trace_facts(out)
        row["positions"] = f["positions"]
        row["disagreeing_positions"] = f["disagreeing_positions"]
        row["disagreeing_pct"] = round(100.0 * f["disagreeing_positions"] / max(1, f["positions"]), 2)
        lat = f["latency_ms"]
    return row, lat


def sweep_section(jobs: list[SimJob], results: list[dict], p: SweepParams, out: Path, plot,
                  yardstick: list[dict] | None = None) -> Section:
    """Tables and plots of the protocol sweep.  `plot` is bench.plots."""
    sec = Section("sim", "Simulator: the same workload under derecho / sequencer / mirror")
    rows, lats = [], {}
    for job, res in zip(jobs, results):
        row, lat = run_row(job, res)
        rows.append(row)
        lats[(job.protocol, job.rtt_ms, job.loss, job.seed)] = lat
    ran = [r for r in rows if "p50_ms" in r]
    if not ran:
        errs = {r.get("error", "") for r in rows}
        raise NotMeasured(f"no simulator run finished ({'; '.join(sorted(errs))[:300]})")
    n_events = ran[0]["events_submitted"]
    sec.intro.append(
        f"Workload: 3 clusters (dc1..dc3), each writing {p.rate_eps:g} events/s over {p.partitions} partitions for "
        f"{p.duration_s:g} s plus bursts of {', '.join(f'{n} events at t={at:g}s' for at, n in p.bursts)} "
        f"at every cluster at the same instant (~{n_events} events per run); settle {p.settle_s:g} s. "
        f"Sweep: RTT {', '.join(f'{r:g}' for r in p.rtts_ms)} ms (jitter 10 % of the one-way delay), "
        f"loss {', '.join(f'{x:g}' for x in p.losses)}, seeds {', '.join(map(str, p.seeds))}; "
        f"{len(rows)} runs of `kdsync-sim run`, 2 at a time. Latency: source ack -> in each cluster's global topic "
        f"(simulated time, so not affected by the load of this box).")
    # aggregate over seeds
    agg = []
    for protocol in PROTOCOLS:
        for rtt in p.rtts_ms:
            for loss in p.losses:
                rs = [r for r in ran if (r["protocol"], r["rtt_ms"], r["loss"]) == (protocol, rtt, loss)]
                if not rs:
                    continue
                pooled = [x for r in rs for x in lats.get((protocol, rtt, loss, r["seed"]), [])]
                agg.append({
                    "protocol": protocol, "rtt_ms": rtt, "loss": loss, "runs": len(rs),
                    "p50_ms": round(percentile(pooled, 50), 2) if pooled else round(mean([r["p50_ms"] for r in rs]), 2),
                    "p99_ms": round(percentile(pooled, 99), 2) if pooled else round(mean([r["p99_ms"] for r in rs]), 2),
                    "p50_ms_min": min(r["p50_ms"] for r in rs), "p50_ms_max": max(r["p50_ms"] for r in rs),
                    "p99_ms_min": min(r["p99_ms"] for r in rs), "p99_ms_max": max(r["p99_ms"] for r in rs),
                    "throughput_eps": round(mean([r["throughput_eps"] for r in rs]), 1),
                    "delivered_fraction": round(sum(r["delivered_min"] for r in rs) / max(1, sum(r["events_submitted"] for r in rs)), 4),
                    **{f"v_{k}": sum(r[f"v_{k}"] for r in rs) for k in KINDS},
                    "disagreeing_pct": round(mean([r.get("disagreeing_pct") for r in rs]), 2),
                    "failed_runs": sum(1 for r in rs if r["exit_code"] not in (0,)),
                })
    sec.tables.append(Table("sim_runs", "Every simulator run (raw)", rows, show=False))
    sec.tables.append(Table(
        "sim_summary", "Per protocol, RTT and loss (pooled over seeds; violations summed over runs)", agg,
        ["protocol", "rtt_ms", "loss", "runs", "p50_ms", "p99_ms", "throughput_eps", "delivered_fraction",
         "v_agreement", "v_integrity", "v_loss", "v_origin_order", "v_split_brain", "disagreeing_pct"]))
    # ratios vs mirror
    rat = []
    for rtt in p.rtts_ms:
        for loss in p.losses:
            base = next((a for a in agg if (a["protocol"], a["rtt_ms"], a["loss"]) == ("mirror", rtt, loss)), None)
            for protocol in ("derecho", "sequencer"):
                a = next((a for a in agg if (a["protocol"], a["rtt_ms"], a["loss"]) == (protocol, rtt, loss)), None)
                if a and base:
                    rat.append({"protocol": protocol, "rtt_ms": rtt, "loss": loss,
                                "p50_vs_mirror": round(ratio(a["p50_ms"], base["p50_ms"]) or math.nan, 2),
                                "p99_vs_mirror": round(ratio(a["p99_ms"], base["p99_ms"]) or math.nan, 2),
                                "p50_minus_mirror_ms": round(a["p50_ms"] - base["p50_ms"], 1),
                                "p50_in_rtts": round(a["p50_ms"] / rtt, 2) if rtt else None})
    sec.tables.append(Table("sim_ratios", "Latency relative to the mirror baseline (same RTT and loss)", rat))
    for a in agg:
        if a["loss"] == 0.0 and a["rtt_ms"] == sorted(p.rtts_ms)[len(p.rtts_ms) // 2]:
            viol = sum(a[f"v_{k}"] for k in KINDS)
            sec.headlines.append(Headline(f"sim {a['protocol']}: violations at RTT {a['rtt_ms']:g} ms (runs: {a['runs']})",
                                          f"{viol} ({a['disagreeing_pct']:g} % positions disagree)",
                                          "0 for derecho/sequencer", "sim_summary.csv"))
    for r in rat:
        if r["loss"] == 0.0:
            sec.headlines.append(Headline(f"sim {r['protocol']} p50 / mirror p50, RTT {r['rtt_ms']:g} ms",
                                          r["p50_vs_mirror"], "", "sim_ratios.csv"))
    speeds = [r["sim_events_per_wall_s"] for r in ran if r.get("sim_events_per_wall_s")]
    if speeds:
        sec.notes.append(f"Simulator speed over these runs: median {sorted(speeds)[len(speeds) // 2]:,} simulated "
                         f"events per wall second (min {min(speeds):,}, max {max(speeds):,}; two runs in parallel on a "
                         f"shared 2-core box).")
    if yardstick:
        sec.tables.append(Table("sim_speed", "Simulator speed on the yardstick scenario (3 members, 50 ms RTT, "
                                "1 000 events/s; run alongside another simulation on this 2-core box)", yardstick))
        for y in yardstick:
            if y.get("sim_events_per_wall_s"):
                sec.headlines.append(Headline("sim speed: simulated events per wall second (yardstick)",
                                              y["sim_events_per_wall_s"], ">= 200 000 (issue 3)", "sim_speed.csv"))
    failed = [(j, r) for j, r in zip(jobs, rows) if r["exit_code"] != 0]
    if failed:
        repro = out / "repro"
        repro.mkdir(exist_ok=True)
        sec.notes.append(f"{len(failed)} run(s) exited non-zero (a violation the protocol must not have; the "
                         f"scenario files are kept in {out.name}/repro/):")
        for j, r in failed:
            shutil.copy(j.scenario, repro / Path(j.scenario).name)
            detail = _first_violation(Path(j.out))
            sec.notes.append(f"  `kdsync-sim run {out.name}/repro/{Path(j.scenario).name} --seed {j.seed}` "
                             f"(exit {r['exit_code']}): {detail}")
    sec.plots += plot.sim_latency(agg, p, out)
    sec.plots += plot.sim_violations(agg, p, out)
    mid = sorted(p.rtts_ms)[len(p.rtts_ms) // 2]
    cdf = {proto: lats.get((proto, mid, 0.0, p.seeds[0]), []) for proto in PROTOCOLS}
    if any(cdf.values()):
        sec.plots += plot.latency_cdf(cdf, f"Latency CDF, RTT {mid:g} ms, loss 0, seed {p.seeds[0]}", out,
                                      "sim_latency_cdf.png")
    return sec


def _first_violation(run_dir: Path) -> str:
    """The first violation a mirror run may not have (or any, for the others)."""
    try:
        s = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return "no summary.json"
    vs = [v for v in s.get("violations", []) if not (s["protocol"] == "mirror" and v["kind"] in ("agreement", "split_brain"))]
    return f"{vs[0]['kind']}: {vs[0]['detail'][:160]}" if vs else "no violation recorded"


