"""Shards section: the real drain of a backlog with K = 2 shards in 1 worker
process vs 2 worker processes (`kdsync run --workers W`), three embedded
Tansu clusters on this box.

Each run: three clusters, a source topic of 4 partitions per cluster, a
backlog written while the members are down; then `kdsync run --workers W`
starts in every cluster.  Throughput = all events / (first record in any
partition of any global topic -> last record, broker timestamps).  CPU:
process CPU time (utime + stime from /proc, the process and its
descendants) of the members (supervisor + workers) and of the brokers, from
the moment every shard is active to the end of the drain: the split says
where the two cores went.  Every partition is checked identical in every
cluster, every event once (`kdsync.local.check_sharded`).
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import Headline, NotMeasured, Section, Table, ratio

CLK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ShardParams:
    backlog_per_cluster: int = 20_000
    shards: int = 2
    source_partitions: int = 4
    clusters: int = 3
    timeout_s: float = 300.0


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process `pid` and its live descendants; 0 when gone."""
    from kdsync.testing.local import child_pids

    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        f = stat[stat.rindex(")") + 2:].split()
        total += (int(f[11]) + int(f[12])) / CLK  # utime, stime
        todo += child_pids(p)
    return total


def measure_drain(workdir: Path, workers: int, p: ShardParams) -> dict:
    """Drain one backlog with `p.shards` shards in `workers` processes per
    cluster; returns throughput, CPU split and the agreement check.  Raises
    on a member or broker failure."""
    from kdsync.testing import local

    # the protocol's default tick and a suspicion that outlasts a busy box's stalls (LocalGroup's test
    # timings tick every 5 ms, which costs idle CPU in every process)
    with local.LocalGroup(p.clusters, workdir, shards=p.shards, workers=workers,
                         source_partitions=p.source_partitions, metrics=True, tick_ms=10, suspect_ms=1000) as g:
        g.start_brokers()
        local.Writers(g, p.backlog_per_cluster, "b", None).join(strict=True)
        g.start_members()
        g.wait_ready(timeout=120)

        def cpu() -> tuple[float, float]:
            members = sum(tree_cpu_s(pr.pid) for pr in g.procs if pr is not None)
            brokers = sum(tree_cpu_s(c.pid) for c in g.clusters if c.pid)
            return members, brokers

        m0, b0 = cpu()
        w0 = time.perf_counter()
        total = p.backlog_per_cluster * p.clusters
        got = g.wait_for_partitions(total, p.timeout_s, poll=0.2)
        m1, b1 = cpu()
        wall = time.perf_counter() - w0
        short = {n: sum(map(len, v)) for n, v in got.items() if sum(map(len, v)) < total}
        if short:
            raise RuntimeError(f"backlog of {total} not drained in {p.timeout_s:.0f} s: {short}")
        ts = [r.write_ts for v in got.values() for part in v for r in part]
        span = max(1e-3, (max(ts) - min(ts)) / 1000.0)
        ok, detail = local.check_sharded(got, expected=total)
        mc, bc = m1 - m0, b1 - b0
        return {"workers": workers, "shards": p.shards, "throughput_eps": round(total / span, 1),
                "span_s": round(span, 3), "member_cpu_s": round(mc, 2), "broker_cpu_s": round(bc, 2),
                "member_cpu_share": round(mc / max(1e-9, mc + bc), 3),
                "cpu_ms_per_event_members": round(1000 * mc / total, 4),
                "cpu_ms_per_event_brokers": round(1000 * bc / total, 4),
                "cpu_per_wall": round((mc + bc) / max(1e-9, wall), 2),
                "events": total, "agreement": ok, "detail": detail}


def shards_section(out: Path, quick: bool = False, progress=None, p: ShardParams | None = None) -> Section:
    """K = 2 shards, 1 worker vs 2 workers, one run each, back to back."""
    p = p or ShardParams(backlog_per_cluster=5_000 if quick else 20_000)
    sec = Section("shards", "Shards in processes: K = 2 shards, 1 worker vs 2 workers (real brokers)")
    try:
        from kdsync.kafka.embedded import EmbeddedCluster  # noqa: F401
    except Exception as e:
        raise NotMeasured(f"embedded broker not available ({e})") from None
    rows = []
    load = []
    for w in (1, 2):
        load.append(" ".join(f"{x:.1f}" for x in os.getloadavg()))
        with tempfile.TemporaryDirectory(prefix=f"kdsync-bench-shards-w{w}-") as d:
            rows.append(measure_drain(Path(d), w, p))
        if progress:
            progress()
    for r, la in zip(rows, load):
        r["load_avg_before"] = la
    sec.intro.append(
        f"{p.clusters} clusters (embedded Tansu), source topic of {p.source_partitions} partitions, "
        f"{p.backlog_per_cluster} events written into each cluster while the members are down; then "
        f"`kdsync run --workers W` with `[topics] shards = {p.shards}` in every cluster. events/s = all events / "
        f"(first -> last record over every partition of every global topic, broker timestamps). CPU: process CPU time "
        f"of the members (supervisor + workers) and brokers from every shard active to the drain's end. Brokers, "
        f"members and writers share this 2-core box: compare the ratio, measured back to back.")
    sec.tables.append(Table("shards_drain", "Drain of a backlog: 2 shards in 1 vs 2 worker processes", rows))
    by = {r["workers"]: r for r in rows}
    tr = ratio(by[2]["throughput_eps"], by[1]["throughput_eps"])
    sec.headlines.append(Headline("real drain, 2 shards: 2 workers / 1 worker throughput",
                                  round(tr, 3) if tr else None, ">= 1.5 (issue 11)", "shards_drain.csv"))
    sec.headlines.append(Headline("real drain, 2 shards, 2 workers: member share of CPU",
                                  by[2]["member_cpu_share"], "(report: brokers take the rest)", "shards_drain.csv"))
    if not all(r["agreement"] for r in rows):
        sec.notes.append("AGREEMENT FAILED: " + "; ".join(r["detail"] for r in rows if not r["agreement"]))
    return sec


if __name__ == "__main__":  # python -m bench.shards [BACKLOG]: one comparison, printed and in results/
    import json
    import sys

    from bench.common import write_csv

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20_000
    s = shards_section(Path("."), p=ShardParams(backlog_per_cluster=n))
    results = Path(__file__).resolve().parent.parent / "results"
    results.mkdir(exist_ok=True)
    for t in s.tables:
        print(f"wrote {write_csv(t, results)}")
        for r in t.rows:
            print(json.dumps(r))
    for h in s.headlines:
        print(h.figure, h.value, h.goal)
