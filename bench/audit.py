"""Audit section: the simulator traces analysed again by the PySpark job
(`kdsync audit --trace ...`), its figures compared with each run's own
summary.json, and the audit's throughput (trace rows per wall second)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.common import Headline, NotMeasured, Section, Table

ROOT = Path(__file__).resolve().parent.parent


def audit_section(run_dirs: list[Path], workdir: Path, timeout: float = 600) -> Section:
    sec = Section("audit", "PySpark audit of the simulator traces (`kdsync audit --trace`)")
    runs = [d for d in run_dirs if (d / "trace.parquet").exists() and (d / "summary.json").exists()]
    if not runs:
        raise NotMeasured("no simulator trace to audit")
    try:
        import pyspark  # noqa: F401

        import kdsync.spark.audit  # noqa: F401
    except Exception as e:
        raise NotMeasured(f"kdsync audit is not importable ({type(e).__name__}: {e}); figures above come from "
                          f"pyarrow over trace.parquet") from None
    out = workdir / "audit"
    cmd = [sys.executable, "-m", "kdsync.cli", "audit", "--master", "local[2]", "--out", str(out),
           "--trace", *map(str, runs)]
    t0 = time.perf_counter()
    # own session, so a timeout stops the audit and the Spark JVM it started (and nothing else)
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise NotMeasured(f"kdsync audit did not finish in {timeout:.0f} s (this box was loaded; "
                          f"rerun with --sections audit)") from None
    wall = time.perf_counter() - t0
    if p.returncode not in (0, 1):
        err = (stderr.strip().splitlines() or ["no output"])[-1]
        raise NotMeasured(f"kdsync audit exited {p.returncode}: {err[:240]}")
    try:
        report = json.loads(stdout)
    except ValueError:
        raise NotMeasured("kdsync audit printed no JSON report") from None

    cmp_rows, mismatches, rows_total = compare(report, runs)
    if not cmp_rows:
        raise NotMeasured("kdsync audit's report names none of the runs it was given")
    sec.intro.append(
        f"`kdsync audit --master local[2] --trace` over {len(runs)} run directories (the first seed of every "
        f"protocol / RTT / loss configuration of the sweep; {rows_total:,} trace rows) took "
        f"{wall:.1f} s wall including Spark start-up: {rows_total / wall:,.0f} trace rows/s. Each run's audit is "
        f"compared with the simulator's own summary.json (delivered counts, violation kinds other than split_brain, "
        f"which only the simulator can see, and p50/p99 within 1 ms).")
    sec.tables.append(Table("audit_vs_summary", "Spark audit vs simulator summary, per run", cmp_rows,
                            show=len(cmp_rows) <= 12))
    sec.tables.append(Table("audit_speed", "Audit throughput", [{
        "runs": len(runs), "trace_rows": rows_total, "wall_s": round(wall, 2),
        "rows_per_s": round(rows_total / wall), "exit_code": p.returncode, "master": "local[2]"}]))
    sec.headlines.append(Headline("audit runs whose figures match summary.json",
                                  f"{len(cmp_rows) - mismatches}/{len(cmp_rows)}", "all", "audit_vs_summary.csv"))
    sec.headlines.append(Headline("audit trace rows/s (local[2], incl. Spark start)", round(rows_total / wall),
                                  "", "audit_speed.csv"))
    return sec


def compare(report: dict, runs: list[Path]) -> tuple[list[dict], int, int]:
    """Per run: the audit's figures next to summary.json; (rows, mismatches, trace rows)."""
    import pyarrow.parquet as pq

    summaries = {}
    rows_total = 0
    for d in runs:
        s = json.loads((d / "summary.json").read_text())
        summaries[f"{s['scenario']}:{s['seed']}"] = s
        rows_total += pq.ParquetFile(d / "trace.parquet").metadata.num_rows
    cmp_rows = []
    mismatches = 0
    for r in report.get("runs", []):
        s = summaries.get(r["run_id"])
        if s is None:
            continue
        a_lat, s_lat = r.get("latency_ms") or {}, s["latency_ms"]
        delivered_same = all(r["events_delivered"].get(m) == n for m, n in s["events_delivered"].items())
        s_agree = any(v["kind"] == "agreement" for v in s["violations"])
        a_agree = bool((r.get("agreement") or {}).get("differing_positions"))
        kinds_s = sorted({v["kind"] for v in s["violations"] if v["kind"] != "split_brain"})
        kinds_a = sorted({v["kind"] for v in r.get("violations", [])})
        d50 = None if a_lat.get("p50") is None else round(a_lat["p50"] - s_lat["p50"], 3)
        d99 = None if a_lat.get("p99") is None else round(a_lat["p99"] - s_lat["p99"], 3)
        same = delivered_same and s_agree == a_agree and kinds_s == kinds_a and all(
            x is not None and abs(x) <= 1.0 for x in (d50, d99))
        mismatches += not same
        cmp_rows.append({"run_id": r["run_id"], "protocol": r["protocol"], "seed": r["seed"],
                         "delivered_equal": delivered_same,
                         "summary_kinds": " ".join(kinds_s), "audit_kinds": " ".join(kinds_a),
                         "audit_differing_positions": (r.get("agreement") or {}).get("differing_positions"),
                         "summary_p50_ms": s_lat["p50"], "audit_p50_ms": a_lat.get("p50"),
                         "summary_p99_ms": s_lat["p99"], "audit_p99_ms": a_lat.get("p99"),
                         "p50_diff_ms": d50, "p99_diff_ms": d99, "match": same})
    return cmp_rows, mismatches, rows_total
