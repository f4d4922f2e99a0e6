"""Reliability section: the nemesis suite (kdsync.testing.nemesis, docs/nemesis.md)
over several seeds on durable clusters — faults by kind, events, time to
converge after the last heal, anomalies.

Seeds and minutes: KDSYNC_NEMESIS_SEEDS (default "1,2,3") and
KDSYNC_NEMESIS_MINUTES (default 4 per seed); each seed's report is also
written to results/nemesis/seed-N.json.  The WAN protocol runs too:
KDSYNC_NEMESIS_CLOCK_SEEDS (default "4") with every peer link
KDSYNC_NEMESIS_DELAY_MS (default 20) ms one way, reports in
results/nemesis/clock-seed-N.json."""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from bench.common import Headline, Section, Table

TITLE = "Reliability: the nemesis suite on durable clusters"


def reliability_section(out: Path, progress: Callable[[], None] = lambda: None,
                        seeds: list[int] | None = None, minutes: float | None = None) -> Section:
    from kdsync.testing.nemesis import run

    def env_seeds(name: str, default: str) -> list[int]:
        return [int(s) for s in os.environ.get(name, default).split(",") if s.strip()]

    seeds = seeds or env_seeds("KDSYNC_NEMESIS_SEEDS", "1,2,3")
    minutes = minutes or float(os.environ.get("KDSYNC_NEMESIS_MINUTES", "4"))
    delay = float(os.environ.get("KDSYNC_NEMESIS_DELAY_MS", "20"))
    runs = [(seed, "derecho", 0.0) for seed in seeds] + \
        [(seed, "clock", delay) for seed in env_seeds("KDSYNC_NEMESIS_CLOCK_SEEDS", "4")]
    sec = Section("reliability", TITLE)
    rows, kinds = [], Counter()
    (out / "nemesis").mkdir(parents=True, exist_ok=True)
    for seed, protocol, delay_ms in runs:
        with tempfile.TemporaryDirectory(prefix=f"kdsync-nemesis-{seed}-") as d:
            r = run(seed, minutes, Path(d), log=lambda _m: None, protocol=protocol, delay_ms=delay_ms)
        name = f"seed-{seed}.json" if protocol == "derecho" else f"{protocol}-seed-{seed}.json"
        (out / "nemesis" / name).write_text(json.dumps(asdict(r), indent=2) + "\n")
        kinds.update(r.faults)
        rows.append({"seed": seed, "protocol": protocol, "delay_ms": delay_ms, "faults": sum(r.faults.values()), "fault_s": round(r.fault_seconds),
                     "acknowledged": r.acknowledged, "in_sources": r.in_sources,
                     "ordered_min": min(r.ordered.values(), default=0),
                     "converge_s": round(r.converge_s, 1) if r.converge_s is not None else "no",
                     "anomalies": len(r.anomalies), "first_anomaly": r.anomalies[0] if r.anomalies else ""})
        progress()
    total_s = sum(r["fault_s"] for r in rows)
    anomalies = sum(r["anomalies"] for r in rows)
    clock = [str(seed) for seed, p, _ in runs if p == "clock"]
    sec.intro = [f"`python -m kdsync.testing.nemesis --seed N --minutes {minutes:g}` for seeds "
                 f"{', '.join(map(str, seeds))}"
                 + (f", and with `--protocol clock --delay-ms {delay:g}` (every peer link {delay:g} ms one way "
                    f"through a delay proxy behind its fault proxy) for seeds {', '.join(clock)}" if clock else "")
                 + ": three durable clusters (Tansu on a local S3 store), three "
                 f"members behind fault proxies, paced writers into every cluster, one fault at a time "
                 f"(docs/nemesis.md). {total_s} s of faults in all."]
    sec.tables = [Table("nemesis_runs", "Runs", rows),
                  Table("nemesis_faults", "Faults by kind (all seeds)",
                        [{"fault": k, "count": v} for k, v in sorted(kinds.items())])]
    conv = [r["converge_s"] for r in rows if r["converge_s"] != "no"]
    sec.headlines = [
        Headline("nemesis: seconds of faults on durable clusters (all seeds)", total_s, ">= 600", "nemesis_runs.csv"),
        Headline("nemesis: anomalies (lost, duplicated, reordered, divergent)", anomalies, "0", "nemesis_runs.csv"),
        Headline("nemesis: worst convergence after the last heal (s)", max(conv) if conv else "no", "",
                 "nemesis_runs.csv"),
    ]
    return sec
