"""bench/load.py on real processes: its figures come from the records in the
global topics and the member processes' CPU counters, not from the clock of
the harness."""

import pytest

from kdsync.testing.stats import percentile
from kdsync.testing.load import run_load
from kdsync.testing.local import read_global

pytestmark = pytest.mark.timeout(300)


def test_small_paced_run_measures_the_records(tmp_path):
    seen = {}

    def check(g, out):
        # read every global topic on our own and recompute what run_load reported
        recs = {g.names[i]: read_global(g.bootstrap(i), g.global_topic) for i in range(g.n)}
        lat = [max(0, r.write_ts - r.origin_ts) for v in recs.values() for r in v if r.key.startswith(b"p")]
        seen["lat"] = lat
        seen["counts"] = {n: len(v) for n, v in recs.items()}
        seen["origins"] = {r.origin for v in recs.values() for r in v}
        seen["partitions"] = {r.origin_partition for v in recs.values() for r in v}

    r = run_load("derecho", 150, 1.0, workdir=tmp_path, backlog=50, idle_s=0.5, on_done=check, floor_idle_s=1.0)
    assert r["events"] == 150  # 50 per cluster
    assert seen["counts"] == {"dc1": 303, "dc2": 303, "dc3": 303}  # backlog + 3 warm-up + paced, in every cluster
    assert seen["origins"] == {"dc1", "dc2", "dc3"}
    assert seen["partitions"] == {0, 1}  # keys spread over the 2 source partitions
    assert r["latency_samples"] == len(seen["lat"]) == 450
    assert r["p50_ms"] == percentile(seen["lat"], 50)
    assert r["p99_ms"] == percentile(seen["lat"], 99)
    assert r["agreement"], r["agreement_detail"]
    assert r["floor_samples"] == 50 and r["floor_p50_ms"] <= r["floor_p99_ms"]
    assert 0 < r["floor_idle_p50_ms"] <= r["floor_idle_p99_ms"]  # the probe alone, before the load
    assert r["drain_eps"] > 0
    # CPU per ordered event: each member ordered 150 events in the paced phase
    assert all(c > 0 for c in r["cpu_us_per_event_by_member"])
    assert 0 <= r["idle_cpu_pct"] < 100
    assert r["frames_out_per_event"] > 0


def test_copy_floor_copies_every_record_and_counts_its_cpu():
    from bench.copyfloor import run_copy_floor

    # 600 records: at ~100 µs each the copiers' CPU is tens of ms, well above the 10 ms tick of
    # /proc's per-thread times (150 records could round to 0 on a loaded box)
    r = run_copy_floor(600, 1.0, floor_idle_s=1.0)
    assert r["events"] == 600  # every copier copied (and had acknowledged) all 600 paced records, or it raised
    # the one-hop probe beside the copiers, as beside the members (bench/member.py pairs them), and before them
    assert 0 < r["floor_p50_ms"] <= r["floor_p99_ms"] and 0 < r["floor_idle_p50_ms"] <= r["floor_idle_p99_ms"]
    assert r["cpu_us_per_event"] > 0 and r["cpu_us_kafka"] >= 0 and r["cpu_us_threads"] >= 0  # 10 ms ticks
    assert abs(r["cpu_us_kafka"] + r["cpu_us_threads"] - r["cpu_us_per_event"]) <= 0.2
