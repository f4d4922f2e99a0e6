"""Audit section: the simulator traces analysed again by the PySpark job
(`kdsync audit --trace ...`), its figures compared with each run's own
summary.json, and the audit's throughput (trace rows per wall second); then
the audit at a day's scale (`bench.audit_bench`: synthetic traces of 1 M and
10 M rows, JVM peak) and the Kafka data source on a real global topic
(`bench.kafka_source_bench`), each in a process of its own."""

from __future__ import annotations

import contextlib
import csv
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
    code, stdout, stderr = _run(cmd, timeout, "kdsync audit")
    wall = time.perf_counter() - t0
    if code not in (0, 1):
        err = (stderr.strip().splitlines() or ["no output"])[-1]
        raise NotMeasured(f"kdsync audit exited {code}: {err[:240]}")
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
        "rows_per_s": round(rows_total / wall), "exit_code": code, "master": "local[2]"}]))
    sec.headlines.append(Headline("audit runs whose figures match summary.json",
                                  f"{len(cmp_rows) - mismatches}/{len(cmp_rows)}", "all", "audit_vs_summary.csv"))
    sec.headlines.append(Headline("audit trace rows/s (local[2], incl. Spark start)", round(rows_total / wall),
                                  "", "audit_speed.csv"))
    scale_section(sec, workdir)
    return sec


def _run(cmd: list[str], timeout: float, what: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `cmd`, run in its own session so a
    timeout stops it and the Spark JVM it started (and nothing else)."""
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise NotMeasured(f"{what} did not finish in {timeout:.0f} s (this box was loaded; "
                          f"rerun with --sections audit)") from None
    return p.returncode, stdout, stderr


def _bench(module: str, args: list[str], out: Path, timeout: float) -> list[dict]:
    """Run `python -m module args --out out`; its CSV rows."""
    code, _, stderr = _run([sys.executable, "-m", module, *args, "--out", str(out)], timeout, module)
    if code != 0 or not out.exists():
        err = (stderr.strip().splitlines() or ["no output"])[-1]
        raise NotMeasured(f"{module} exited {code}: {err[:240]}")
    with out.open() as f:
        return list(csv.DictReader(f))


def scale_section(sec: Section, workdir: Path) -> None:
    """The audit at 1 M and 10 M trace rows and the Kafka source, into `sec`."""
    try:
        rows = _bench("bench.audit_bench", ["--rows", "1000000", "10000000", "--master", "local[2]",
                                            "--workdir", str(workdir / "audit-scale")], workdir / "audit_scale.csv", 1200)
        sec.intro.append(
            "**At a day's scale** (`python -m bench.audit_bench --rows 1000000 10000000 --master local[2]`): "
            "synthetic traces of 3 members (every event delivered everywhere), audited one after the other in one "
            "SparkSession whose JVM is already up; trace rows per wall second of the audit and the JVM's peak RSS "
            "(design: docs/design/audit.md).")
        sec.tables.append(Table("audit_scale", "Audit at scale (synthetic traces, local[2])", rows))
        big = max(rows, key=lambda r: int(r["trace_rows"]))
        sec.headlines.append(Headline(f"audit trace rows/s at {int(big['trace_rows']) / 1e6:.0f} M rows (local[2])",
                                      int(big["rows_per_s"]), ">= 300000", "audit_scale.csv"))
        sec.headlines.append(Headline("audit JVM peak RSS at that size (MiB)", int(big["jvm_peak_rss_mib"]),
                                      "< 4096", "audit_scale.csv"))
    except NotMeasured as e:
        sec.notes.append(f"Audit at scale: not measured ({e}).")
    try:
        rows = _bench("bench.kafka_source_bench", ["--records", "2000000", "--master", "local[2]"],
                      workdir / "audit_kafka_source.csv", 1200)
        sec.intro.append(
            "**Real topics** (`python -m bench.kafka_source_bench --records 2000000`): one embedded Tansu broker "
            "holding a source topic and its global topic (2 M records each, 4 partitions, the five kdsync headers); "
            "the kdsync-kafka source reads the global topic (first read of the session: Python workers start "
            "inside the figure), then `kdsync audit --cluster dc1=... --topic bench --shards 4` reads both and "
            "checks them (it must pass).")
        sec.tables.append(Table("audit_kafka_source", "Kafka data source and audit on real topics (local[2])", rows))
        src = next(r for r in rows if r["read"].startswith("global"))
        sec.headlines.append(Headline("kdsync-kafka source records/s (2 M global records, local[2])",
                                      int(src["records_per_s"]), ">= 100000", "audit_kafka_source.csv"))
    except NotMeasured as e:
        sec.notes.append(f"Kafka source: not measured ({e}).")


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
