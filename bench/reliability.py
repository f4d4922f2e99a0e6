"""Reliability section: the nemesis suite (kdsync.testing.nemesis, docs/nemesis.md)
over several seeds on durable clusters — faults by kind, events, time to
converge after the last heal, anomalies.

Seeds and minutes: KDSYNC_NEMESIS_SEEDS (default "1,2,3") and
KDSYNC_NEMESIS_MINUTES (default 4 per seed); each seed's report is also
written to results/nemesis/seed-N.json."""

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

    seeds = seeds or [int(s) for s in os.environ.get("KDSYNC_NEMESIS_SEEDS", "1,2,3").split(",") if s.strip()]
    minutes = minutes or float(os.environ.get("KDSYNC_NEMESIS_MINUTES", "4"))
    sec = Section("reliability", TITLE)
    rows, kinds = [], Counter()
    (out / "nemesis").mkdir(parents=True, exist_ok=True)
    for seed in seeds:
        with tempfile.TemporaryDirectory(prefix=f"kdsync-nemesis-{seed}-") as d:
            r = run(seed, minutes, Path(d), log=lambda _m: None)
        (out / "nemesis" / f"seed-{seed}.json").write_text(json.dumps(asdict(r), indent=2) + "\n")
        kinds.update(r.faults)
        rows.append({"seed": seed, "faults": sum(r.faults.values()), "fault_s": round(r.fault_seconds),
                     "acknowledged": r.acknowledged, "in_sources": r.in_sources,
                     "ordered_min": min(r.ordered.values(), default=0),
                     "converge_s": round(r.converge_s, 1) if r.converge_s is not None else "no",
                     "anomalies": len(r.anomalies), "first_anomaly": r.anomalies[0] if r.anomalies else ""})
        progress()
    total_s = sum(r["fault_s"] for r in rows)
    anomalies = sum(r["anomalies"] for r in rows)
    sec.intro = [f"`python -m kdsync.testing.nemesis --seed N --minutes {minutes:g}` for seeds "
                 f"{', '.join(map(str, seeds))}: three durable clusters (Tansu on a local S3 store), three "
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
