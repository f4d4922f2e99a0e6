"""Audit throughput on synthetic traces (run by hand, not in CI):

    .venv/bin/python -m bench.audit_bench --rows 1000000 10000000 [--master local[2]]

For each size: writes a synthetic trace.parquet (3 members, every event
delivered everywhere; `rows` trace rows = rows/3 distinct events), then times
`kdsync audit --trace` on it in this process's SparkSession (JVM already up,
so the figure is the audit itself) and reports trace rows/s, events/s, and the
peak resident memory of the Spark JVM (VmHWM) and of this Python driver.
Writes results/audit_bench.csv and prints a table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.common import write_rows


def _vm_hwm_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.audit_bench")
    p.add_argument("--rows", type=int, nargs="+", default=[1_000_000])
    p.add_argument("--master", default="local[2]")
    p.add_argument("--approx", action="store_true", help="approximate percentiles")
    p.add_argument("--out", default="results/audit_bench.csv")
    p.add_argument("--workdir", default=None)
    a = p.parse_args(argv)

    from kdsync.spark.audit import AuditArgs
    from kdsync.spark.audit import run as audit_run
    from kdsync.spark.session import spark_session
    from kdsync.spark.synth import synthetic_trace

    spark = spark_session(a.master, "kdsync-audit-bench", {"spark.ui.showConsoleProgress": "false",
                                                            "spark.sql.shuffle.partitions": "8"})
    jvm_pid = int(spark._jvm.java.lang.ProcessHandle.current().pid())
    work = Path(a.workdir or tempfile.mkdtemp(prefix="kdsync-audit-bench-"))
    rows_out = []
    for n in a.rows:
        events = n // 3
        d = work / f"rows-{n}"
        if d.exists():
            shutil.rmtree(d)
        t0 = time.perf_counter()
        synthetic_trace(spark, events).write.parquet(str(d / "trace.parquet"))
        gen_s = time.perf_counter() - t0
        args = AuditArgs(trace=[str(d)], master=a.master, approx=a.approx)
        t0 = time.perf_counter()
        code, report = audit_run(args)
        wall = time.perf_counter() - t0
        run = report["runs"][0]
        assert code == 0 and run["events_submitted"] == events, (code, run["events_submitted"], events)
        spark.catalog.clearCache()
        row = {"trace_rows": events * 3, "events": events, "master": a.master, "approx": a.approx,
               "generate_s": round(gen_s, 1), "audit_s": round(wall, 1),
               "rows_per_s": round(events * 3 / wall), "events_per_s": round(events / wall),
               "jvm_peak_rss_mib": round(_vm_hwm_kib(jvm_pid) / 1024),
               # VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec from the parent (bench.run)
               "driver_py_peak_rss_mib": round(_vm_hwm_kib(os.getpid()) / 1024),
               "latency_p50_ms": run["latency_ms"]["p50"], "exit_code": code,
               "load_avg_1m": round(os.getloadavg()[0], 1), "cpus": os.cpu_count()}
        rows_out.append(row)
        print(row, flush=True)
        shutil.rmtree(d, ignore_errors=True)
    print(f"wrote {write_rows(rows_out, Path(a.out))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
