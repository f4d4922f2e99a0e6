"""Real section: three embedded clusters on loopback, one `kdsync run`
member per cluster, derecho vs sequencer vs mirror, on each broker
implementation (Tansu, noida-db) side by side.

Each protocol is one `kdsync.testing.local.measure`: a backlog's throughput
(the span of the global topics' own record timestamps) and a paced stream's
latency."""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import Headline, NotMeasured, Section, Table, ratio, require_rows

PROTOCOLS = ("derecho", "sequencer", "mirror")
BROKERS = ("tansu", "noida")


@dataclass(frozen=True)
class RealParams:
    backlog_per_cluster: int = 2000
    paced_total: int = 900
    rate_eps: float = 300.0
    timeout_s: float = 150.0
    brokers: tuple[str, ...] = BROKERS


def real_section(p: RealParams, plot, out: Path, progress=None) -> Section:
    sec = Section("real", "Real brokers: three local clusters (embedded Tansu, then noida-db), one `kdsync run` "
                          "per cluster")
    try:
        from kdsync.testing import local
    except Exception as e:
        raise NotMeasured(f"kdsync.testing.local is not importable ({type(e).__name__}: {e})") from None
    try:
        from kdsync.kafka.embedded import EmbeddedCluster  # noqa: F401
    except Exception as e:
        raise NotMeasured(f"embedded broker not available ({e})") from None
    rows, errors = [], []
    for broker in p.brokers:
        for proto in PROTOCOLS:
            t0 = time.perf_counter()
            with tempfile.TemporaryDirectory(prefix=f"kdsync-bench-real-{broker}-{proto}-") as d:
                try:
                    r = local.measure(proto, Path(d), backlog=p.backlog_per_cluster, rate=p.rate_eps,
                                      paced=p.paced_total, timeout=p.timeout_s, broker=broker)
                except Exception as e:  # one protocol failing must not hide the others
                    errors.append(f"{broker} {proto}: {type(e).__name__}: "
                                  f"{str(e).splitlines()[0][:160] if str(e) else ''}")
                    r = None
            if progress:
                progress()
            if r is None:
                continue
            rows.append({"broker": broker, "protocol": proto, "run": f"{proto} / {broker}",
                         "throughput_eps": round(r["throughput_eps"], 1),
                         "p50_ms": r["latency_p50_ms"], "p99_ms": r["latency_p99_ms"],
                         "latency_samples": r.get("latency_samples"), "agreement": r.get("agreement"),
                         "throughput_span_s": r.get("throughput_span_s"),
                         "backlog_per_cluster": p.backlog_per_cluster, "paced_events": p.paced_total,
                         "paced_rate_eps": p.rate_eps, "wall_s": round(time.perf_counter() - t0, 1),
                         "detail": r.get("detail", "")})
    require_rows(rows, errors, "no protocol could be measured on real brokers")
    sec.intro.append(
        f"Throughput: {p.backlog_per_cluster} events written into each cluster's source topic while the members are "
        f"down, then the members start; events/s = all events / (first record in any global topic -> last record in "
        f"the last global topic, broker timestamps). Latency: then {p.paced_total} events written at {p.rate_eps:g} events/s in total across the "
        f"clusters; p50/p99 of (global record timestamp - source record timestamp), ms resolution. The same runs on "
        f"each broker implementation ({', '.join(p.brokers)}); a ratio is taken only between runs on one broker. "
        f"Brokers, members and writers all share this 2-core box, so compare the ratios, not the absolute figures.")
    sec.tables.append(Table("real_e2e", "End to end on three local clusters", rows))
    ratios = []
    for broker in p.brokers:
        by = {r["protocol"]: r for r in rows if r["broker"] == broker}
        base = by.get("mirror")
        tag = "" if broker == "tansu" else f" ({broker})"  # Tansu's headlines keep their names across reports
        for proto in ("derecho", "sequencer"):
            r = by.get(proto)
            if r and base:
                tr = ratio(r["throughput_eps"], base["throughput_eps"])
                dp50 = r["p50_ms"] - base["p50_ms"]
                ratios.append({"broker": broker, "protocol": proto,
                               "throughput_vs_mirror": round(tr, 3) if tr else None,
                               "p50_minus_mirror_ms": round(dp50, 2),
                               "p99_minus_mirror_ms": round(r["p99_ms"] - base["p99_ms"], 2),
                               "throughput_goal_met": bool(tr and tr >= 0.70), "p50_goal_met": dp50 <= 2.0})
                sec.headlines.append(Headline(f"real {proto} throughput / mirror throughput{tag}",
                                              round(tr, 3) if tr else None, ">= 0.70 (issue 4)", "real_ratios.csv"))
                sec.headlines.append(Headline(f"real {proto} p50 - mirror p50 (ms){tag}", round(dp50, 2),
                                              "<= 2 ms (issue 4)", "real_ratios.csv"))
    sec.add_table_if_rows("real_ratios", "Relative to mirror (goal: >= 70 % throughput, p50 within 2 ms)", ratios)
    sec.note_unmeasured(errors)
    if any(isinstance(r["p50_ms"], float) and math.isnan(r["p50_ms"]) for r in rows):
        sec.notes.append("a latency of '–' means no paced event reached the global topics in time")
    sec.plots += plot.bars(rows, [("throughput_eps", "events/s end to end"), ("p50_ms", "p50 latency (ms)"),
                                  ("p99_ms", "p99 latency (ms)")],
                           "three local clusters, loopback", out, "real_e2e.png", label_key="run")
    return sec
