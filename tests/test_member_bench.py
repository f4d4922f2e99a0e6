"""End-to-end performance of `kdsync run` on three local clusters: derecho vs
mirror (throughput from a backlog, p50/p99 latency at a paced rate).

Opt-in (it takes about a minute and its figures depend on the machine):
    KDSYNC_BENCH=1 .venv/bin/python -m pytest -q -s tests/test_member_bench.py
Goal from issue 4: derecho >= 70 % of mirror throughput, p50 within 2 ms of mirror.
"""

import json
import os

import pytest

from kdsync.testing.local import measure

pytestmark = [
    pytest.mark.benchmark,
    pytest.mark.timeout(600),
    pytest.mark.skipif(os.environ.get("KDSYNC_BENCH") != "1", reason="set KDSYNC_BENCH=1 to run the end-to-end benchmark"),
]


def test_derecho_vs_mirror_end_to_end(tmp_path):
    backlog = int(os.environ.get("KDSYNC_BENCH_BACKLOG", "5000"))
    res = {p: measure(p, tmp_path / p, backlog=backlog, rate=300.0, paced=1500) for p in ("mirror", "derecho")}
    ratio = res["derecho"]["throughput_eps"] / res["mirror"]["throughput_eps"]
    dp50 = res["derecho"]["latency_p50_ms"] - res["mirror"]["latency_p50_ms"]
    print(json.dumps({**res, "throughput_ratio": ratio, "p50_delta_ms": dp50}, indent=1))
    assert res["derecho"]["agreement"], res["derecho"]["detail"]
    assert res["mirror"]["throughput_ok"], "mirror lost events"
    assert ratio >= 0.7, f"derecho reaches {ratio:.0%} of mirror throughput (goal >= 70 %)"
