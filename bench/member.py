"""Member section: what one `kdsync run` costs and adds, on real processes
(bench.load: 3 embedded Tansu clusters, one member each, the default
configuration, 2 source partitions, paced writers in every cluster).

Per protocol (derecho, clock, mirror) and total rate (300 / 1 000 / 3 000 events/s):
p50/p99 of global record timestamp - source timestamp next to the plain
producer -> consumer floor of the same run, member CPU per ordered event
(split: event loop / librdkafka threads / other threads), the mean time per
batch of each stage (kdsync_stage_seconds); at 1 000 events/s also the drain
of a backlog and the idle CPU of a member; and the copy floor (bench/copyfloor.py:
CPU per event of a Python process that only consumes and produces, with
kdsync's client settings) at 1 000 events/s."""

from __future__ import annotations

import math
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.common import Headline, NotMeasured, Section, Table, ratio, require_rows

PROTOCOLS = ("derecho", "clock", "mirror")
BROKERS = ("tansu", "noida")
STATS_MS = 250  # [metrics] kafka_stats_ms of the per-broker runs: their Kafka requests counted over a 4 s load
DRAIN_GOAL_EPS = 22_000  # issue 9: >= 2x the ~11 K events/s of 3 clusters measured before


@dataclass(frozen=True)
class MemberParams:
    rates: tuple[float, ...] = (300.0, 1000.0, 3000.0)
    duration_s: float = 4.0
    backlog_per_cluster: int = 5000  # drained at 1 000 events/s
    idle_s: float = 5.0
    drain_runs: int = 3  # drains per protocol, alternating (a sub-second span swings +-30 % on this box): the median
    cpu_pairs: int = 3  # rounds of (copy floor, derecho, clock, clock coalesced) at 1 000 events/s for the CPU ratios
    coalesce_us: int = 2000  # [member] coalesce_us of the coalesced clock run
    brokers: tuple[str, ...] = BROKERS  # the 1 000 events/s point once more on each implementation, alternating
    floor_idle_s: float = 3.0  # at 1 000 events/s: the floor probe alone before the load (issue 43's plain setup)


def _cpu_runs(p: MemberParams) -> list[tuple[str, str, dict]]:
    """The runs of one round of the CPU ratios: (label, protocol, run_load's extra)."""
    return [("copy-floor", "", {}), ("derecho", "derecho", {}), ("clock", "clock", {}),
            (f"clock coalesce_us={p.coalesce_us}", "clock", {"member": {"coalesce_us": p.coalesce_us}})]


def _cpu_ratios(p: MemberParams, errors: list[str], progress=None) -> list[dict]:
    """CPU per event at 1 000 events/s next to the copy floor, each measured
    `p.cpu_pairs` times in alternation (floor, derecho, clock, clock with
    coalesced wake-ups, then again): one floor run measured after minutes of
    other load read 165 µs where the same command on a quiet box reads ~60,
    so a ratio is only taken between runs that saw the same box.  One row per
    label: the medians and every run."""
    from bench.copyfloor import run_copy_floor
    from kdsync.testing.load import run_load

    runs: dict[str, list[dict]] = {label: [] for label, _, _ in _cpu_runs(p)}
    for _ in range(p.cpu_pairs):
        for label, proto, extra in _cpu_runs(p):
            try:
                if not proto:
                    runs[label].append(run_copy_floor(1000.0, p.duration_s))
                    continue
                with tempfile.TemporaryDirectory(prefix="kdsync-bench-cpu-") as d:
                    runs[label].append(run_load(proto, 1000.0, p.duration_s, workdir=Path(d), extra=extra or None))
            except Exception as e:  # one run failing must not hide the others
                errors.append(f"cpu ratio {label}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        if progress:
            progress()
    med = {label: statistics.median(r["cpu_us_per_event"] for r in rs) for label, rs in runs.items() if rs}
    floor = med.get("copy-floor")
    out = []
    for label, rs in runs.items():
        if not rs:
            continue
        row = {"run": label, "runs": len(rs), "cpu_us_per_event": round(med[label], 1),
               "cpu_us_per_event_runs": "/".join(f"{r['cpu_us_per_event']:.0f}" for r in rs),
               "over_floor": round(med[label] / floor, 2) if floor else None}
        for key in ("p50_ms", "p99_ms", "frames_out_per_event", "cpu_us_loop", "floor_p99_ms"):
            xs = [r[key] for r in rs if r.get(key) is not None]
            row[key] = round(statistics.median(xs), 3) if xs else None
        out.append(row)
    return out


def _row(r: dict) -> dict:
    keys = ("protocol", "rate_eps", "events", "p50_ms", "p99_ms", "floor_p50_ms", "floor_p99_ms", "floor_idle_p50_ms",
            "floor_idle_p99_ms", "cpu_us_per_event",
            "cpu_us_loop", "cpu_us_kafka", "cpu_us_threads", "frames_out_per_event", "member_cpu_pct",
            "stage_fetch_ms", "stage_handoff_ms", "stage_sent_ms", "stage_delivered_ms", "stage_produced_ms",
            "stage_report_ms", "drain_eps", "idle_cpu_pct", "broker_cpu_us_per_event", "agreement", "loadavg_1m")
    return {k: r.get(k) for k in keys}


def _more_drains(p: MemberParams, rows: list[dict], errors: list[str], progress=None) -> None:
    """Drain the backlog `p.drain_runs - 1` more times per protocol (alternating,
    drain only: a 1 s paced phase, no floor, no idle); each 1 000 events/s row
    then carries the median drain and every run's figure (`drain_eps_runs`)."""
    from kdsync.testing.load import run_load

    samples = {r["protocol"]: [r["drain_eps"]] for r in rows if r["rate_eps"] == 1000.0 and r.get("drain_eps")}
    for _ in range(p.drain_runs - 1):
        for proto in samples:
            with tempfile.TemporaryDirectory(prefix=f"kdsync-bench-drain-{proto}-") as d:
                try:
                    r = run_load(proto, 1000.0, 1.0, workdir=Path(d), backlog=p.backlog_per_cluster, floor=False)
                    samples[proto].append(r["drain_eps"])
                except Exception as e:
                    errors.append(f"{proto} drain: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        if progress:
            progress()
    for r in rows:
        xs = samples.get(r["protocol"]) if r["rate_eps"] == 1000.0 else None
        r["drain_eps_runs"] = "/".join(f"{x:.0f}" for x in xs) if xs else None
        if xs:
            r["drain_eps"] = round(statistics.median(xs), 1)


def _by_broker(p: MemberParams, errors: list[str], progress=None) -> list[dict]:
    """The 1 000 events/s point of every protocol on each broker implementation,
    the brokers alternating per protocol (the pairs see the same box): latency
    next to that broker's own producer -> consumer floor, the member's CPU and
    the broker's CPU per ordered event."""
    from kdsync.testing.load import run_load

    rows = []
    for proto in PROTOCOLS:
        for broker in p.brokers:
            with tempfile.TemporaryDirectory(prefix=f"kdsync-bench-broker-{broker}-{proto}-") as d:
                try:
                    r = run_load(proto, 1000.0, p.duration_s, workdir=Path(d), broker=broker,
                                 extra={"metrics": {"kafka_stats_ms": STATS_MS}})
                except Exception as e:  # one point failing must not hide the others
                    errors.append(f"{proto} on {broker}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                    continue
            rows.append({"broker": broker, "protocol": proto, "events": r.get("events"), "p50_ms": r.get("p50_ms"),
                         "p99_ms": r.get("p99_ms"), "floor_p50_ms": r.get("floor_p50_ms"),
                         "floor_p99_ms": r.get("floor_p99_ms"), "cpu_us_per_event": r.get("cpu_us_per_event"),
                         "broker_cpu_us_per_event": r.get("broker_cpu_us_per_event"),
                         "requests_per_event": r.get("requests_per_event"),
                         **{k: v for k, v in r.items() if k.startswith("req_")},
                         "agreement": r.get("agreement"), "loadavg_1m": r.get("loadavg_1m")})
        if progress:
            progress()
    return rows


def member_section(p: MemberParams, out: Path, progress=None) -> Section:
    sec = Section("member", "The member under paced load: CPU per event, latency vs the Kafka floor, drain, idle")
    try:
        import psutil  # noqa: F401

        from kdsync.testing.load import run_load
        from kdsync.kafka.embedded import EmbeddedCluster  # noqa: F401
    except Exception as e:
        raise NotMeasured(f"bench.load cannot run here ({type(e).__name__}: {e})") from None
    rows, errors = [], []
    for rate in p.rates:
        for proto in PROTOCOLS:  # the protocols back to back: their ratios see the same load
            kw = dict(backlog=p.backlog_per_cluster, idle_s=p.idle_s, floor_idle_s=p.floor_idle_s) \
                if rate == 1000.0 else {}
            with tempfile.TemporaryDirectory(prefix=f"kdsync-bench-member-{proto}-") as d:
                try:
                    r = run_load(proto, rate, p.duration_s, workdir=Path(d), **kw)
                    rows.append(_row(r))
                except Exception as e:  # one point failing must not hide the others
                    errors.append(f"{proto} at {rate:g}/s: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            if progress:
                progress()
    require_rows(rows, errors, "no point could be measured")
    _more_drains(p, rows, errors, progress)
    try:  # the CPU floor of the client layer: copy only (bench/copyfloor.py), right after the members
        from bench.copyfloor import run_copy_floor

        rows.append(_row(run_copy_floor(1000.0, p.duration_s)))
    except Exception as e:
        errors.append(f"copy floor: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    pairs = _cpu_ratios(p, errors, progress)
    per_broker = _by_broker(p, errors, progress)
    sec.intro.append(
        f"`python -m bench.load` per point: 3 embedded Tansu clusters, one `kdsync run` each with the default "
        f"configuration (only `[protocol] name`), a source topic of 2 partitions, one paced writer per cluster for "
        f"{p.duration_s:g} s. Latency: global record timestamp - `kdsync.origin.ts` (ms resolution) over every "
        f"global topic; floor: a plain producer (`linger.ms=1`) -> consumer (`fetch.wait.max.ms=5`) on cluster 1's "
        f"broker during the same load (at 1 000 events/s also for {p.floor_idle_s:g} s before it, members up and "
        f"idle: floor_idle). CPU: the member process's CPU time over the load / records it ordered "
        f"(loop = main thread, kafka = librdkafka threads, threads = the source consumer and others). Stages: mean "
        f"time per batch (kdsync_stage_seconds). At 1 000 events/s, before the load: {p.backlog_per_cluster} events "
        f"per cluster written while the members were down (drain = all of them / first->last global record; "
        f"the median of {p.drain_runs} drains per protocol, alternating, every run in drain_eps_runs); "
        f"after it: {p.idle_s:g} s without traffic (idle = % of one core). Row `copy-floor` "
        f"(`python -m bench.copyfloor`): the same writers at 1 000 events/s, and per cluster instead of a member "
        f"a Python process that only copies every cluster's source records into its own cluster with kdsync's "
        f"client settings (a consumer thread per cluster, one idempotent producer): what the Kafka client layer "
        f"alone costs per event on this box, the floor under any member built on confluent-kafka.")
    sec.intro.append(
        f"CPU ratios (table member_cpu): at 1 000 events/s, {p.cpu_pairs} rounds of the copy floor, derecho, clock "
        f"and clock with `[member] coalesce_us = {p.coalesce_us}` (kdsync/eventloop.py: the loop's wake-ups at "
        f"least that far apart), in alternation, each beside the same one-hop probe on cluster 1 (the copy floor "
        f"too, since stop 49: the probe costs a copier ~10 % more CPU per event, so a floor without it was "
        f"measured on a quieter box than the members), {p.duration_s:g} s of load each and no drain or idle phase; each "
        f"row is the median of its runs and `over_floor` its ratio to the copy floor's median. The single copy-floor "
        f"row of member_load is kept for history; the ratios are the paired ones.")
    sec.intro.append(
        f"Per broker (table member_brokers): the 1 000 events/s point of each protocol on embedded Tansu and on "
        f"noida-db, the two brokers alternating per protocol, {p.duration_s:g} s each; broker CPU = the three "
        f"broker processes' CPU time over the load / events ordered, per cluster: what the members' requests (and "
        f"the writers') cost the broker; requests_per_event = every Kafka request the members' source consumers "
        f"and producers sent over the load (librdkafka statistics every {STATS_MS} ms, kdsync_kafka_requests_total) "
        f"/ the events "
        f"they ordered, with req_<type>_per_event by request type. Compare within a broker: the floor is that "
        f"broker's own.")
    sec.tables.append(Table("member_load", "Member under paced load (derecho, clock and mirror, 3 clusters)", rows))
    sec.add_table_if_rows("member_cpu", "CPU per event at 1 000 events/s next to the copy floor, paired runs", pairs)
    sec.add_table_if_rows("member_brokers", "The 1 000 events/s point on each broker implementation", per_broker)
    by_run = {r["run"]: r for r in pairs}
    by = {(r["protocol"], r["rate_eps"]): r for r in rows}

    def val(proto, rate, key):
        r = by.get((proto, rate))
        v = r.get(key) if r else None
        return None if v is None or (isinstance(v, float) and math.isnan(v)) else v

    for proto in PROTOCOLS:
        sec.headlines.append(Headline(f"member CPU per ordered event, {proto} at 1 000 events/s (µs)",
                                      val(proto, 1000.0, "cpu_us_per_event"), "<= 50 (issue 9)", "member_load.csv"))
    floor = val("copy-floor", 1000.0, "cpu_us_per_event")
    sec.headlines.append(Headline("copy floor: CPU per copied event at 1 000 events/s, consume + produce only (µs)",
                                  floor, "(the client layer alone; report)", "member_load.csv"))
    for label, goal in (("derecho", "(report)"), ("clock", "<= 1.5 (issue 25)"),
                        (f"clock coalesce_us={p.coalesce_us}", "(report)")):
        sec.headlines.append(Headline(f"member CPU per event / copy floor, {label} at 1 000 events/s "
                                      f"(median of {p.cpu_pairs} paired runs)",
                                      by_run.get(label, {}).get("over_floor"), goal, "member_cpu.csv"))
    c0, c1 = (by_run.get(k, {}).get("p50_ms") for k in ("clock", f"clock coalesce_us={p.coalesce_us}"))
    sec.headlines.append(Headline(f"clock p50 with coalesce_us={p.coalesce_us} - without, 1 000 events/s (ms)",
                                  round(c1 - c0, 1) if c0 is not None and c1 is not None else None, "(report)",
                                  "member_cpu.csv"))
    for proto in ("derecho", "clock"):
        sec.headlines.append(Headline(f"peer frames out per event, {proto} at 1 000 events/s",
                                      val(proto, 1000.0, "frames_out_per_event"), "(report)", "member_load.csv"))
    c, m = val("clock", 1000.0, "p50_ms"), val("mirror", 1000.0, "p50_ms")
    sec.headlines.append(Headline("clock p50 - mirror p50 at 1 000 events/s, LAN (ms)",
                                  round(c - m, 1) if c is not None and m is not None else None, "(report)",
                                  "member_load.csv"))
    for label in ("derecho", "clock"):  # what the members do to the broker beyond what any copier does
        rr = ratio(by_run.get(label, {}).get("floor_p99_ms"), by_run.get("copy-floor", {}).get("floor_p99_ms"))
        sec.headlines.append(Headline(f"plain setup: one-hop probe p99 beside {label} members / beside the copy "
                                      f"floor's copiers, 1 000 events/s (paired runs)", round(rr, 2) if rr else None,
                                      "(report)", "member_cpu.csv"))
    for proto in ("derecho", "clock"):  # issue 43's plain setup: default configs, paced writers, 1 000 events/s
        rr = ratio(val(proto, 1000.0, "floor_p99_ms"), val(proto, 1000.0, "floor_idle_p99_ms"))
        sec.headlines.append(Headline(f"plain setup, {proto} run: one-hop probe p99 under the load / the same "
                                      f"probe's p99 before it (idle), 1 000 events/s", round(rr, 2) if rr else None,
                                      "<= 2 (issue 43)", "member_load.csv"))
        rr = ratio(val(proto, 1000.0, "p99_ms"), val(proto, 1000.0, "floor_p99_ms"))
        sec.headlines.append(Headline(f"plain setup: {proto} p99 / the one-hop probe's p99 under the same load, "
                                      f"1 000 events/s", round(rr, 2) if rr else None, "<= 2 (issue 43)",
                                      "member_load.csv"))
    for rate, goal in ((300.0, "<= 3 (issue 9)"), (1000.0, "<= 6 (issue 9)"), (3000.0, "")):
        rr = ratio(val("derecho", rate, "p99_ms"), val("derecho", rate, "floor_p99_ms"))
        sec.headlines.append(Headline(f"derecho p99 / floor p99 at {rate:,.0f} events/s",
                                      round(rr, 2) if rr else None, goal, "member_load.csv"))
        d, m = val("derecho", rate, "p50_ms"), val("mirror", rate, "p50_ms")
        sec.headlines.append(Headline(f"derecho p50 - mirror p50 at {rate:,.0f} events/s (ms)",
                                      round(d - m, 1) if d is not None and m is not None else None,
                                      "<= 2 (<= 5 acceptable; issue 9)" if rate == 1000.0 else "", "member_load.csv"))
    dd, dm = val("derecho", 1000.0, "drain_eps"), val("mirror", 1000.0, "drain_eps")
    dr = ratio(dd, dm)
    sec.headlines.append(Headline("drain derecho / mirror (3 clusters)", round(dr, 2) if dr else None,
                                  ">= 1.0 (issue 9)", "member_load.csv"))
    sec.headlines.append(Headline("drain derecho, events/s (3 clusters)", dd, f">= {DRAIN_GOAL_EPS:,} (2x ~11 K; issue 9)",
                                  "member_load.csv"))
    sec.headlines.append(Headline("idle member CPU, derecho (% of a core)", val("derecho", 1000.0, "idle_cpu_pct"),
                                  "<= 2 (issue 9)", "member_load.csv"))
    pb = {(r["broker"], r["protocol"]): r for r in per_broker}
    for broker in p.brokers:
        d, m = (pb.get((broker, k), {}).get("p50_ms") for k in ("derecho", "mirror"))
        sec.headlines.append(Headline(f"derecho p50 - mirror p50 at 1 000 events/s on {broker} (ms)",
                                      round(d - m, 1) if d is not None and m is not None else None, "(report)",
                                      "member_brokers.csv"))
        sec.headlines.append(Headline(f"broker CPU per ordered event, derecho at 1 000 events/s on {broker} (µs)",
                                      pb.get((broker, "derecho"), {}).get("broker_cpu_us_per_event"), "(report)",
                                      "member_brokers.csv"))
        sec.headlines.append(Headline(f"Kafka requests per ordered event, derecho at 1 000 events/s on {broker} "
                                      f"(source consumer and producer)",
                                      pb.get((broker, "derecho"), {}).get("requests_per_event"), "(report)",
                                      "member_brokers.csv"))
    sec.note_unmeasured(errors)
    sec.notes.append(f"load average while measuring: {', '.join(str(r['loadavg_1m']) for r in rows)} "
                     f"(2 cores; brokers, members and writers share them)")
    return sec
