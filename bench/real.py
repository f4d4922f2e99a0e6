"""Real section: three embedded Tansu clusters on loopback, one `kdsync run`
member per cluster, derecho vs sequencer vs mirror.

Built from the member engineer's pieces (`kdsync.local.LocalGroup`,
`write_events`, `check_agreement`).  It does not call `kdsync.local.measure`
as is: that one starts its throughput clock after `wait_ready()`, by which
time a small backlog is already ordered (it reported 900 000 events/s for
900 events); here the span is taken from the global topics' own record
timestamps (first record written -> last record in the last cluster)."""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import Headline, NotMeasured, Section, Table, ratio

PROTOCOLS = ("derecho", "sequencer", "mirror")


@dataclass(frozen=True)
class RealParams:
    backlog_per_cluster: int = 2000
    paced_total: int = 900
    rate_eps: float = 300.0
    timeout_s: float = 150.0


def measure_e2e(local, protocol: str, workdir: Path, p: RealParams, clusters: int = 3) -> dict:
    """Throughput of a backlog, then latency of a paced stream, on `clusters`
    local clusters.  Raises on a member or broker failure."""
    import threading

    from bench.common import percentile

    def write_all(per: int, tag: str, rate: float | None) -> None:
        errors: list[str] = []

        def one(i: int) -> None:
            try:
                # paced writers warm up first (a cold idempotent producer holds its first records ~0.5 s)
                local.write_events(g.bootstrap(i), g.topic, per, f"{tag}{i}", rate=rate,
                                  warm_topic=local.WARM_TOPIC if rate else None)
            except Exception as e:
                errors.append(str(e))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(clusters)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise RuntimeError(f"writing failed: {errors[0]}")

    out: dict = {"protocol": protocol}
    with local.LocalGroup(clusters, workdir, protocol=protocol, metrics=True) as g:
        g.start_brokers()
        write_all(p.backlog_per_cluster, "b", None)  # members are down: a backlog waits in every source topic
        g.start_members()
        g.wait_ready(timeout=90)
        total = p.backlog_per_cluster * clusters
        got = g.wait_for(total, p.timeout_s, poll=0.5)
        short = {n: len(v) for n, v in got.items() if len(v) < total}
        if short:
            raise RuntimeError(f"backlog of {total} not delivered in {p.timeout_s:.0f} s: {short}")
        ts = [r.write_ts for v in got.values() for r in v]
        span_s = max(1e-3, (max(ts) - min(ts)) / 1000.0)
        out["throughput_eps"] = total / span_s
        out["throughput_span_s"] = round(span_s, 3)
        if protocol == "mirror":
            out["agreement"], out["detail"] = None, "mirror: counts only (no agreed order)"
        else:
            out["agreement"], out["detail"] = local.check_agreement(got, expected=total)
        per = p.paced_total // clusters
        write_all(per, "p", p.rate_eps / clusters)
        got = g.wait_for(total + per * clusters, p.timeout_s, poll=0.5)
        lat = [max(0, r.write_ts - r.origin_ts) for v in got.values() for r in v if (r.key or b"").startswith(b"p")]
        out["latency_p50_ms"] = percentile(lat, 50)
        out["latency_p99_ms"] = percentile(lat, 99)
        out["latency_samples"] = len(lat)
        if protocol != "mirror":
            ok, detail = local.check_agreement(got, expected=total + per * clusters)
            out["agreement"] = bool(out["agreement"]) and ok
            out["detail"] = detail
    return out


def real_section(p: RealParams, plot, out: Path, progress=None) -> Section:
    sec = Section("real", "Real brokers: three local clusters (embedded Tansu), one `kdsync run` per cluster")
    try:
        from kdsync.testing import local
    except Exception as e:
        raise NotMeasured(f"kdsync.testing.local is not importable ({type(e).__name__}: {e})") from None
    missing = [n for n in ("LocalGroup", "write_events", "check_agreement", "WARM_TOPIC") if not hasattr(local, n)]
    if missing:
        raise NotMeasured(f"kdsync.testing.local lacks {', '.join(missing)} (the member's local-cluster helpers)")
    try:
        from kdsync.kafka.embedded import EmbeddedCluster  # noqa: F401
    except Exception as e:
        raise NotMeasured(f"embedded broker not available ({e})") from None
    rows, errors = [], []
    for proto in PROTOCOLS:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=f"kdsync-bench-real-{proto}-") as d:
            try:
                r = measure_e2e(local, proto, Path(d), p)
            except Exception as e:  # one protocol failing must not hide the others
                errors.append(f"{proto}: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
                r = None
        if progress:
            progress()
        if r is None:
            continue
        rows.append({"protocol": proto, "throughput_eps": round(r["throughput_eps"], 1),
                     "p50_ms": r["latency_p50_ms"], "p99_ms": r["latency_p99_ms"],
                     "latency_samples": r.get("latency_samples"), "agreement": r.get("agreement"),
                     "throughput_span_s": r.get("throughput_span_s"),
                     "backlog_per_cluster": p.backlog_per_cluster, "paced_events": p.paced_total,
                     "paced_rate_eps": p.rate_eps, "wall_s": round(time.perf_counter() - t0, 1),
                     "detail": r.get("detail", "")})
    if not rows:
        raise NotMeasured("no protocol could be measured on real brokers: " + "; ".join(errors))
    sec.intro.append(
        f"Throughput: {p.backlog_per_cluster} events written into each cluster's source topic while the members are "
        f"down, then the members start; events/s = all events / (first record in any global topic -> last record in "
        f"the last global topic, broker timestamps). Latency: then {p.paced_total} events written at {p.rate_eps:g} events/s in total across the "
        f"clusters; p50/p99 of (global record timestamp - source record timestamp), ms resolution. Brokers, members "
        f"and writers all share this 2-core box, so compare the ratios, not the absolute figures.")
    sec.tables.append(Table("real_e2e", "End to end on three local clusters", rows))
    by = {r["protocol"]: r for r in rows}
    base = by.get("mirror")
    ratios = []
    for proto in ("derecho", "sequencer"):
        r = by.get(proto)
        if r and base:
            tr = ratio(r["throughput_eps"], base["throughput_eps"])
            dp50 = r["p50_ms"] - base["p50_ms"]
            ratios.append({"protocol": proto, "throughput_vs_mirror": round(tr, 3) if tr else None,
                           "p50_minus_mirror_ms": round(dp50, 2),
                           "p99_minus_mirror_ms": round(r["p99_ms"] - base["p99_ms"], 2),
                           "throughput_goal_met": bool(tr and tr >= 0.70), "p50_goal_met": dp50 <= 2.0})
            sec.headlines.append(Headline(f"real {proto} throughput / mirror throughput",
                                          round(tr, 3) if tr else None, ">= 0.70 (issue 4)", "real_ratios.csv"))
            sec.headlines.append(Headline(f"real {proto} p50 - mirror p50 (ms)", round(dp50, 2),
                                          "<= 2 ms (issue 4)", "real_ratios.csv"))
    if ratios:
        sec.tables.append(Table("real_ratios", "Relative to mirror (goal: >= 70 % throughput, p50 within 2 ms)",
                                ratios))
    if errors:
        sec.notes.append("not measured: " + "; ".join(errors))
    if any(isinstance(r["p50_ms"], float) and math.isnan(r["p50_ms"]) for r in rows):
        sec.notes.append("a latency of '–' means no paced event reached the global topics in time")
    sec.plots += plot.bars(rows, [("throughput_eps", "events/s end to end"), ("p50_ms", "p50 latency (ms)"),
                                  ("p99_ms", "p99 latency (ms)")],
                           "three local clusters, loopback", out, "real_e2e.png")
    return sec
