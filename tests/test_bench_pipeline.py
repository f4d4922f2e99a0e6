"""Smoke test of the bench pipeline (`python -m bench.run --quick`): tiny
parameters, core + simulator sections, real files out, sane numbers."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _rows(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-quick")
    p = subprocess.run([sys.executable, "-m", "bench.run", "--quick", "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=170)
    return p, out


@pytest.mark.timeout(200)
def test_quick_bench_writes_report_csv_and_png(quick):
    p, out = quick
    assert p.returncode == 0, p.stdout + p.stderr
    report = (out / "report.md").read_text()
    for name in ("core_throughput", "sim_summary", "sim_runs", "sim_ratios", "summary"):
        assert (out / f"{name}.csv").stat().st_size > 0, name
    pngs = sorted(out.glob("*.png"))
    assert {"core_throughput.png", "sim_latency_vs_rtt.png", "sim_violations.png"} <= {f.name for f in pngs}
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
        assert f"]({png.name})" in report, f"{png.name} not embedded in report.md"
    # every section is either measured or says why not
    assert "## Ordering core throughput" in report
    assert "not measured: skipped by --quick" in report
    assert "| core derecho events/s / mirror events/s |" in report


@pytest.mark.timeout(200)
def test_quick_bench_numbers_are_sane(quick):
    p, out = quick
    assert p.returncode == 0, p.stdout + p.stderr
    core = {r["protocol"]: r for r in _rows(out / "core_throughput.csv")}
    assert set(core) == {"derecho", "sequencer", "mirror"}
    assert all(float(r["events_per_s_group"]) > 1000 for r in core.values())

    summary = {r["protocol"]: r for r in _rows(out / "sim_summary.csv")}
    assert set(summary) == {"derecho", "sequencer", "mirror"}
    for proto, r in summary.items():
        # everything submitted reached every cluster, with a positive latency below the run's length
        assert float(r["delivered_fraction"]) == 1.0, proto
        assert 0 < float(r["p50_ms"]) <= float(r["p99_ms"]) < 6000, proto
    # the point of the comparison: the baseline disagrees under concurrent bursts, the total orders do not
    assert int(summary["mirror"]["v_agreement"]) > 0
    assert float(summary["mirror"]["disagreeing_pct"]) > 0
    for proto in ("derecho", "sequencer"):
        r = summary[proto]
        assert all(int(r[f"v_{k}"]) == 0 for k in ("agreement", "integrity", "loss", "origin_order", "split_brain"))
        assert float(r["disagreeing_pct"]) == 0
    # agreement costs at least one more network step than copying
    assert float(summary["derecho"]["p50_ms"]) > float(summary["mirror"]["p50_ms"])
    runs = _rows(out / "sim_runs.csv")
    assert len(runs) == 3 and all(r["exit_code"] == "0" for r in runs)


def test_bad_arguments_exit_2_with_one_line(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    for args in (["--sections", "core,nope"], ["--out", str(f)], ["--jobs", "0"]):
        p = subprocess.run([sys.executable, "-m", "bench.run", *args], cwd=ROOT, capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == 2, args
        assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr, p.stderr


def test_missing_part_is_reported_not_crashed(tmp_path, monkeypatch):
    """A section whose part is absent says 'not measured: <reason>' (here the
    RDMA VM results), and the run still exits 0 on core + sim."""
    from bench import rdma
    from bench.common import NotMeasured

    with pytest.raises(NotMeasured, match="no VM results"):
        rdma.rdma_section(False, results_dir=tmp_path / "none")
    (tmp_path / "vm").mkdir()
    (tmp_path / "vm" / "results.json").write_text(
        '{"perf": {"rtt_p50_rdma_over_tcp": 0.25}, "member": {"p50_ms_ratio_rdma_over_tcp": 0.9}, "pytest_exit": 0}')
    (tmp_path / "vm" / "run.json").write_text('{"commit": "abc1234"}')
    sec = rdma.rdma_section(False, results_dir=tmp_path / "vm")
    ratios = next(t for t in sec.tables if t.name == "rdma_ratios").rows
    assert [(r["key"], r["ratio"]) for r in ratios] == [("member.p50_ms_ratio_rdma_over_tcp", 0.9),
                                                        ("perf.rtt_p50_rdma_over_tcp", 0.25)]
    assert "commit abc1234" in sec.intro[0]
    assert any("member.p99_ms_ratio_rdma_over_tcp" in n for n in sec.notes)  # what the run lacks is said
