"""`make bench`'s "Real geo run" section: the steady run of bench.geo (real
vs simulated, mirror and clock) and the faults of bench.geo_faults (a kill -9
and a SIGTERM, real vs simulated), in one section.  Its own module so that
neither run imports the other's report."""

from __future__ import annotations

import signal

from bench import geo_faults
from bench.geo import DURATION_S, RATE_EPS, WAN_ADAPTIVE, compare


def geo_section(progress=lambda: None, runs: int = 1):
    """`make bench`'s "Real geo run" section."""
    from bench.common import Headline, NotMeasured, Section, Table

    sec = Section("geo", "Real geo run: five regions on loopback through delay proxies vs the simulator")
    try:
        from kdsync.kafka.embedded import EmbeddedCluster  # noqa: F401
    except Exception as e:
        raise NotMeasured(f"embedded brokers unavailable ({type(e).__name__}: {e})") from None
    rows = compare(("mirror", "clock"), runs, say=lambda m: progress())
    if not any("real p50" in r for r in rows):
        raise NotMeasured("no real run finished: " + "; ".join(r.get("error", "") for r in rows))
    sec.intro.append(
        f"`python -m bench.geo`: five embedded Tansu clusters and five `kdsync run` members (the WAN timers of "
        f"docs/wan.md, adaptive_suspect {str(WAN_ADAPTIVE).lower()}; clock with wan-five-regions' lead and commit quorum), every member link through a delay "
        f"proxy with that link's one-way delay in sim/scenarios/wan-five-regions.yaml, {RATE_EPS:g} events/s in "
        f"all (paced), {DURATION_S:g} s, {runs} run(s) per protocol; then the same in the simulator (3 seeds, the "
        f"broker and member costs of results/calibration.yaml — measured on this machine by `kdsync-sim calibrate`, "
        f"one core per member — and the proxies' own lateness). Two cores carry the ten processes here: the "
        f"real side also queues members and brokers behind each other, which the one-core-per-member model "
        f"does not.")
    sec.tables.append(Table("geo_real_vs_sim", "Five regions, real vs simulated (ms)", rows))
    try:
        frows = geo_faults.compare("clock", say=lambda m: progress())
    except Exception as e:  # noqa: BLE001 - the steady run above still stands
        sec.note_unmeasured([f"geo faults: {type(e).__name__}: {str(e)[:300]}"])
        frows = []
    if frows:
        sec.intro.append(
            "Faults (`python -m bench.geo_faults`, issue 42): the same five regions, clock, writes for "
            f"{geo_faults.WRITE_S:g} s; " + "; ".join(
                f"{ {'tyo': 'Tokyo', 'or': 'Oregon'}.get(who, who)}'s member {'killed' if sig == signal.SIGKILL else 'stopped'} "
                f"({signal.Signals(sig).name}) at {at:g} s and restarted at {back:g} s"
                for _, who, sig, at, back in geo_faults.FAULTS) +
            "; then the same schedule in the simulator (3 seeds). Worst = the worst latency of the live regions' "
            f"events created in the {geo_faults.AFTER_S:g} s after the fault; steady = created "
            f"{geo_faults.STEADY[0]:g}-{geo_faults.STEADY[1]:g} s (before the first fault's in-flight events).")
        sec.tables.append(Table("geo_faults", "Five regions through a crash and a clean stop, real vs simulated "
                                "(ms)", frows))
        for r in frows:
            sec.headlines.append(Headline(f"geo run, clock, {r['fault']}: live regions' worst, real / sim",
                                          r["worst real/sim"], "0.8 - 1.2 (issue 42)", "geo_faults.csv"))
        sec.headlines.append(Headline("geo run, clock, through a crash and a clean stop: every cluster identical, "
                                      "exactly once", all(r["agreement"] for r in frows), "yes", "geo_faults.csv"))
    clock = next((r for r in rows if r.get("protocol") == "clock" and "real p50" in r), None)
    if clock:
        sec.headlines += [Headline("geo run, clock: real p50 / sim p50", clock["p50 real/sim"], "0.8 - 1.2",
                                   "geo_real_vs_sim.csv"),
                          Headline("geo run, clock: real p99 / sim p99", clock["p99 real/sim"], "0.8 - 1.2",
                                   "geo_real_vs_sim.csv"),
                          Headline("geo run, clock: every cluster identical", clock["agreement"], "yes",
                                   "geo_real_vs_sim.csv")]
    return sec
