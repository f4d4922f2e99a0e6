"""Core section: events ordered per second of one ordering core, derecho vs
sequencer vs mirror.  The full run calls the core engineer's pytest-benchmark
(tests/core/test_core_bench.py, `--benchmark-enable --benchmark-json`); the
quick run drives the same in-memory harness (kdsync.testing.network) with a
smaller batch in this process."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from bench.common import Headline, NotMeasured, Section, Table, ratio

ROOT = Path(__file__).resolve().parent.parent
BENCH_FILE = ROOT / "tests" / "core" / "test_core_bench.py"
PROTOCOLS = ("derecho", "sequencer", "mirror")


def _pytest_benchmark(workdir: Path, timeout: float) -> list[dict]:
    if not BENCH_FILE.exists():
        raise NotMeasured(f"{BENCH_FILE.relative_to(ROOT)} does not exist yet")
    js = workdir / "core_bench.json"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(BENCH_FILE), "--benchmark-enable",
           f"--benchmark-json={js}", "-o", "addopts="]
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise NotMeasured(f"core benchmark did not finish in {timeout:.0f} s") from None
    if not js.exists():
        tail = (p.stdout + p.stderr).strip().splitlines()[-1:] or ["no output"]
        raise NotMeasured(f"core benchmark failed (exit {p.returncode}): {tail[0][:200]}")
    rows = []
    for b in json.loads(js.read_text())["benchmarks"]:
        proto = (b.get("params") or {}).get("protocol") or b["name"].split("[")[-1].rstrip("]")
        st = b["stats"]
        rows.append({"protocol": proto, "method": "pytest-benchmark (tests/core/test_core_bench.py)",
                     "rounds": st["rounds"], "mean_s": round(st["mean"], 4), "stddev_s": round(st["stddev"], 4),
                     "min_s": round(st["min"], 4),
                     "events_per_s_group": round(b["extra_info"].get("events_per_s_group", 0)),
                     "events_per_s_per_member": round(b["extra_info"].get("events_per_s_per_member", 0))})
    if p.returncode != 0:
        failed = [ln for ln in p.stdout.splitlines() if "FAILED" in ln]
        for r in rows:
            r["note"] = "; ".join(failed)[:200]
    return rows


def _direct(batch: int = 1000, rounds: int = 4, repeats: int = 2) -> list[dict]:
    """The same workload as the core benchmark, smaller: 3 members, every
    member submitting `batch` events per round, stabilised after each round."""
    try:
        from kdsync.testing.network import InMemoryNetwork
    except Exception as e:
        raise NotMeasured(f"kdsync.testing.network not importable: {e}") from None
    rows = []
    for proto in PROTOCOLS:
        times = []
        for _ in range(repeats):
            try:
                net = InMemoryNetwork(["a", "b", "c"], protocol=proto, seed=1, max_batch=batch)
                if proto != "mirror":
                    net.run_until(lambda: all(net.node(i).status == "active" for i in "abc"), 100)
                batches = {i: [[net.make_batch(i, batch)] for _ in range(rounds)] for i in "abc"}
                t0 = time.perf_counter()
                for r in range(rounds):
                    for i in "abc":
                        net.node(i).submit(batches[i][r])
                    net.stabilize()
                times.append(time.perf_counter() - t0)
            except ImportError as e:
                raise NotMeasured(f"protocol {proto} not available: {e}") from None
            total = 3 * batch * rounds
            if not all(net.topic_len(i) == total for i in "abc"):
                raise NotMeasured(f"{proto}: not every member delivered the {total} events in the core harness")
        best = min(times)
        rows.append({"protocol": proto, "method": f"in-process harness, batch {batch} x {rounds} rounds",
                     "rounds": repeats, "mean_s": round(sum(times) / len(times), 4), "stddev_s": None,
                     "min_s": round(best, 4), "events_per_s_group": round(3 * batch * rounds / best),
                     "events_per_s_per_member": round(9 * batch * rounds / best)})
    return rows


def core_section(workdir: Path, quick: bool, plot, out: Path) -> Section:
    sec = Section("core", "Ordering core throughput (one Python process, in-memory network)")
    rows = _direct() if quick else _pytest_benchmark(workdir, timeout=300)
    order = {p: i for i, p in enumerate(PROTOCOLS)}
    rows.sort(key=lambda r: order.get(r["protocol"], 9))
    sec.intro.append("Three members in the core's in-memory network (every message through the real codec), every "
                     "member submitting batches; events/s = events ordered by the whole group per wall second "
                     "(all three cores share one thread), per member = 3x that. "
                     + ("Quick mode: the small in-process variant." if quick else
                        "Figures from pytest-benchmark (3 rounds of 150 000 events)."))
    sec.tables.append(Table("core_throughput", "Core throughput", rows))
    by = {r["protocol"]: r for r in rows}
    if "derecho" in by and "mirror" in by:
        sec.headlines.append(Headline("core derecho events/s / mirror events/s",
                                      round(ratio(by["derecho"]["events_per_s_group"],
                                                  by["mirror"]["events_per_s_group"]), 2), "", "core_throughput.csv"))
        sec.headlines.append(Headline("core derecho events/s for the group (3 members, one thread)",
                                      by["derecho"]["events_per_s_group"], ">= 1 M/s",
                                      "core_throughput.csv"))
    sec.plots += plot.bars(rows, [("events_per_s_group", "events ordered / s (group)")],
                           "ordering core throughput", out, "core_throughput.png")
    return sec
