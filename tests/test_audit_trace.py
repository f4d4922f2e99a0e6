"""`kdsync audit --trace` on real kdsync-sim output: the audit's counts and
latency equal the simulator's own summary.json, runs are grouped by run,
scenario and protocol, and a mirror run's disagreement is reported but (as in
the simulator) does not fail."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from conftest_spark import get_spark

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SCENARIO = """
name: audit-{protocol}
seed: 3
protocol: {protocol}
duration_s: 2
settle_s: 3
members:
  - id: dc1
  - id: dc2
  - id: dc3
network:
  default: {{latency_ms: 20, jitter_ms: 4}}
kafka: {{produce_ms: 2, consume_ms: 1}}
workload:
  - {{member: all, rate_eps: 80, payload_bytes: 64, partitions: 2}}
  - {{member: all, burst: 40, at_s: 1}}
"""


@pytest.fixture(scope="module")
def sim_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sim")
    procs = {}
    for protocol in ("derecho", "mirror"):  # both simulations at once
        yaml = root / f"{protocol}.yaml"
        yaml.write_text(textwrap.dedent(SCENARIO.format(protocol=protocol)))
        out = root / protocol
        procs[protocol] = (out, subprocess.Popen([sys.executable, "-m", "sim.cli", "run", str(yaml), "--out", str(out)],
                                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    runs = {}
    try:
        for protocol, (out, proc) in procs.items():
            _, err = proc.communicate(timeout=300)
            assert proc.returncode in (0, 1), err[-2000:]
            runs[protocol] = (out, json.loads((out / "summary.json").read_text()), proc.returncode)
    finally:
        for _, proc in procs.values():  # only the simulations this fixture started
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return runs


def test_audit_of_sim_traces_equals_sim_summary(sim_runs, capsys, tmp_path):
    from kdsync.spark.audit import main

    get_spark()
    code = main(["--trace", *[str(out) for out, _, _ in sim_runs.values()], "--master", "local[2]",
                 "--out", str(tmp_path / "tables")])
    report = json.loads(capsys.readouterr().out)
    assert report["runs_total"] == 2
    by_protocol = {r["protocol"]: r for r in report["runs"]}
    for protocol, (_, summary, sim_code) in sim_runs.items():
        r = by_protocol[protocol]
        assert r["scenario"] == summary["scenario"] and r["seed"] == str(summary["seed"])
        assert r["events_delivered"] == summary["events_delivered"]
        if all(n == summary["events_submitted"] for n in summary["events_delivered"].values()):
            assert r["events_submitted"] == summary["events_submitted"]
        for q in ("p50", "p90", "p99", "max"):  # both sides round to 3 decimals
            assert r["latency_ms"][q] == pytest.approx(summary["latency_ms"][q], abs=2e-3), q
        sim_kinds = {v["kind"] for v in summary["violations"]}
        assert (r["agreement"]["differing_positions"] > 0) == ("agreement" in sim_kinds)
        # one vocabulary: what the audit can see from a trace, it names as the simulator does
        audited = {"inconsistent-offsets", "duplicate", "foreign", "lost-write", "nonmonotonic"}
        assert set(r["anomalies"]) == {v["anomaly"] for v in summary["violations"]} & audited
        assert r["ok"] == (sim_code == 0)
    assert by_protocol["derecho"]["ok"] and by_protocol["derecho"]["violations"] == []
    assert code == (0 if all(c == 0 for _, _, c in sim_runs.values()) else 1)

    spark = get_spark()
    scen = {(x["scenario"], x["protocol"]): x for x in spark.read.parquet(str(tmp_path / "tables" / "scenarios")).collect()}
    assert set(scen) == {("audit-derecho", "derecho"), ("audit-mirror", "mirror")}
    assert all(x["runs"] == 1 for x in scen.values())
    windows = spark.read.parquet(str(tmp_path / "tables" / "throughput"))
    total = sum(x["events"] for x in windows.where("run_id like 'audit-derecho%'").collect())
    assert total == sum(sim_runs["derecho"][1]["events_delivered"].values())


def test_trace_with_missing_columns_exits_2(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kdsync.spark.audit import main

    get_spark()
    pq.write_table(pa.table({"run_id": ["r"], "member": ["dc1"]}), tmp_path / "trace.parquet")
    assert main(["--trace", str(tmp_path), "--master", "local[2]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "event_id" in err[0]
