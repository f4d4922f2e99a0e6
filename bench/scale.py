"""The scale section: the ordering core and the simulator at Kafka scale.

* simulator speed: 3 sites at 100 000 events/s offered for 5 s
  (sim/scenarios/bench-3dc-100k.yaml), simulated events per wall second,
  next to a bare SimPy timeout loop measured in the same process (the
  ceiling of any SimPy model);
* message economy: peer messages per delivered event at 1 000, 10 000 and
  100 000 events/s on the same 3-site network (it must fall as load rises);
* fifty sites (sim/scenarios/bench-fifty-sites.yaml): wall time and
  violations of 20 000 events/s with crashes and restarts for 40 s;
* a fair leader-based baseline: sim/scenarios/sequencer-failover.yaml (the
  sequencer down for 8 s) under the fail-over sequencer and under derecho:
  events lost and duplicated.
"""

from __future__ import annotations

import time
from pathlib import Path

from bench.common import Headline, NotMeasured, Section, Table

ROOT = Path(__file__).resolve().parent.parent
SCEN = ROOT / "sim" / "scenarios"


def bare_simpy_rate(n: int = 300_000) -> float:
    """Timeouts per wall second of a bare SimPy loop (one process, one timeout per step)."""
    import simpy

    env = simpy.Environment()

    def loop(env):
        for _ in range(n):
            yield env.timeout(0.001)

    env.process(loop(env))
    t0 = time.perf_counter()
    env.run()
    return n / (time.perf_counter() - t0)


def _run(scenario, seed=None):
    from sim.runner import run_scenario

    t0 = time.perf_counter()
    r = run_scenario(scenario, seed)
    return r, time.perf_counter() - t0


def _rate_scenario(rate_total: float):
    from sim.scenario import load_scenario

    s = load_scenario(SCEN / "bench-3dc-100k.yaml")
    wl = [w.model_copy(update={"rate_eps": rate_total / 3}) for w in s.workload]
    return s.model_copy(update={"name": f"economy-{rate_total:g}", "workload": wl})


def scale_section(quick: bool, plot=None, out: Path | None = None) -> Section:
    try:
        from sim.scenario import load_scenario
    except Exception as e:  # pragma: no cover - the simulator is part of the package
        raise NotMeasured(f"sim not importable: {e}") from None
    sec = Section("scale", "Core and simulator at Kafka scale")
    sec.intro.append(
        "Simulator speed = simulated events per wall second of the whole run (model, core, SimPy; the checkers "
        "after the run excluded); the bare SimPy rate is a loop of timeouts in the same process, the ceiling of "
        "any SimPy model. Messages per event = every peer message sent / events delivered at a member.")

    # speed at 100 000 events/s offered, next to the bare SimPy rate
    bare = bare_simpy_rate(100_000 if quick else 300_000)
    s100 = _rate_scenario(30_000.0 if quick else 100_000.0)
    r, wall = _run(s100)
    sim_wall = r.summary["wall_time_s"]
    eps = r.summary["events_submitted"] / sim_wall
    speed = [{"run": s100.name, "events": r.summary["events_submitted"], "run_wall_s": round(sim_wall, 2),
              "with_checks_wall_s": round(wall, 2), "sim_events_per_wall_s": round(eps),
              "bare_simpy_timeouts_per_s": round(bare), "ratio_to_bare": round(eps / bare, 3),
              "violations": len(r.violations)}]
    sec.tables.append(Table("scale_sim_speed", "Simulator speed at 100 000 events/s offered (3 sites)", speed))
    sec.headlines.append(Headline("sim events per wall second at 100 K events/s offered", round(eps),
                                  ">= 200 000", "scale_sim_speed.csv"))
    sec.headlines.append(Headline("sim speed / bare SimPy timeout rate (same process)", round(eps / bare, 3),
                                  ">= 0.25", "scale_sim_speed.csv"))

    # message economy
    rows = []
    for rate in ((1_000.0, 10_000.0, 30_000.0) if quick else (1_000.0, 10_000.0, 100_000.0)):
        rr, _ = _run(_rate_scenario(rate))
        s = rr.summary
        delivered = min(s["events_delivered"].values())
        rows.append({"offered_eps": rate, "events": delivered, "peer_messages": s["network"]["messages"],
                     "messages_per_event": round(s["network"]["messages"] / max(1, delivered), 4),
                     "p50_ms": s["latency_ms"]["p50"], "p99_ms": s["latency_ms"]["p99"],
                     "violations": len(rr.violations)})
    sec.tables.append(Table("scale_messages", "Peer messages per delivered event (3 sites, 50 ms RTT)", rows))
    sec.headlines.append(Headline(f"messages per event at {rows[-1]['offered_eps']:g} events/s",
                                  rows[-1]["messages_per_event"], "<= 0.05 at 100 K", "scale_messages.csv"))

    # fifty sites (minutes: not in --quick)
    if quick:
        sec.notes.append("fifty sites: skipped by --quick (the 40 s scenario takes minutes)")
    else:
        fr, fwall = _run(load_scenario(SCEN / "bench-fifty-sites.yaml"))
        fs = fr.summary
        sec.tables.append(Table("scale_fifty", "Fifty sites, 20 000 events/s, crashes and restarts", [{
            "scenario": fs["scenario"], "sim_time_s": fs["sim_time_s"], "events": fs["events_submitted"],
            "run_wall_s": fs["wall_time_s"], "with_checks_wall_s": round(fwall, 1),
            "messages": fs["network"]["messages"], "p50_ms": fs["latency_ms"]["p50"],
            "p99_ms": fs["latency_ms"]["p99"], "violations": len(fr.violations)}]))
        sec.headlines.append(Headline("fifty-site scenario wall time (s)", round(fwall, 1),
                                      "< 600 with 0 violations", "scale_fifty.csv"))
        sec.headlines.append(Headline("fifty-site scenario violations", len(fr.violations), "0",
                                      "scale_fifty.csv"))

    # the fair leader-based baseline: the sequencer dies for 8 s
    base = load_scenario(SCEN / "sequencer-failover.yaml")
    frows = []
    for proto in ("sequencer", "derecho"):
        rr, _ = _run(base.model_copy(update={"protocol": proto, "name": f"failover-{proto}"}))
        s = rr.summary
        kinds = s.get("violation_counts", {})
        frows.append({"protocol": proto, "events": s["events_submitted"],
                      "fewest_delivered": min(s["events_delivered"].values()),
                      "loss_violations": kinds.get("loss", 0), "integrity_violations": kinds.get("integrity", 0),
                      "p50_ms": s["latency_ms"]["p50"], "p99_ms": s["latency_ms"]["p99"]})
    sec.tables.append(Table("scale_failover", "Sequencer (dc1) down for 8 s: fail-over sequencer vs derecho", frows))
    seq = frows[0]
    sec.headlines.append(Headline("fail-over sequencer: events lost when the sequencer dies for 8 s",
                                  seq["events"] - seq["fewest_delivered"], "0", "scale_failover.csv"))

    # scale-out: shards sharing each site's modelled cores
    srows = shard_scaling(quick)
    sec.tables.append(Table("scale_shards", "Drain throughput against shards (simulated, 16 cores per site)", srows))
    if plot is not None and out is not None:
        sec.plots += plot.shard_scaling(srows, out)
    top = srows[-1]
    sec.headlines.append(Headline(f"sim: {top['shards']} shards / 1 shard drain throughput (16 cores per site)",
                                  top["speedup"], ">= 12 at 16 shards", "scale_shards.csv"))
    sec.notes.append(f"shards: member cost {SHARD_COST} (µs; the calibration of the real member replaces it when "
                     f"given), a backlog of records over 16 source partitions at each site")
    return sec


SHARD_COST = {"message_us": 30.0, "event_us": 5.0, "ready_us": 50.0}  # when no calibration profile is given


def shard_scaling(quick: bool, cost: dict | None = None, cores: int = 16) -> list[dict]:
    """Drain throughput of a backlog against the number of shards (simulated):
    3 sites with `cores` modelled cores each, every site holding a backlog
    spread over 16 source partitions at t = 0.1 s; throughput = records /
    time until the last one is durable in every global topic."""
    from sim.runner import Simulation
    from sim.scenario import Scenario

    cost = dict(cost or SHARD_COST)
    per_site = 60_000 if quick else 400_000
    rows = []
    for k in ((1, 4, 16) if quick else (1, 2, 4, 8, 16)):
        s = Scenario.model_validate({
            "name": f"shards-{k}", "seed": 7, "protocol": "derecho", "duration_s": 1.0, "settle_s": 60.0,
            "shards": k, "members": [{"id": "dc1"}, {"id": "dc2"}, {"id": "dc3"}],
            "network": {"default": {"latency_ms": 5.0, "jitter_ms": 0.5, "bandwidth_mbps": 100000.0}},
            "kafka": {"produce_ms": 2.0, "consume_ms": 1.0},
            "member_cost": {**cost, "cores": cores},
            "workload": [{"member": "all", "burst": per_site, "at_s": 0.1, "partitions": 16, "payload_bytes": 100}],
        })
        t0 = time.perf_counter()
        sim = Simulation(s, s.seed)
        sim.run(stop_when_settled=True)
        total = sim.acknowledged()
        done = max(max(t.ts, default=0.0) for c in sim.clusters.values() for t in c.topics)
        complete = all(sum(t.length for t in c.topics) == total for c in sim.clusters.values())
        drain = done - 0.1
        rows.append({"shards": k, "cores_per_site": cores, "records": total, "drain_s": round(drain, 3),
                     "records_per_s": round(total / drain) if complete and drain > 0 else None,
                     "complete": complete, "wall_s": round(time.perf_counter() - t0, 1)})
    base = rows[0]["records_per_s"]
    for r in rows:
        r["speedup"] = round(r["records_per_s"] / base, 2) if base and r["records_per_s"] else None
    return rows
