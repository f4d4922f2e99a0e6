"""Simulator speed on the yardstick scenario: 3 members, 50 ms RTT, 1 000
events/s in total (sim/scenarios/bench-3dc-1000eps.yaml).

pytest runs with --benchmark-disable by default, so in CI this runs once as a
test (shortened); `make bench` / `pytest --benchmark-enable -m benchmark`
measures it.  The figure is simulated source events per second of wall time.
"""

from __future__ import annotations

import pytest

from sim.runner import run_scenario
from sim.scenario import load_scenario

from sim_helpers import SCENARIOS, need_protocol


def _scenario(poll_ms: float, duration_s: float):
    s = load_scenario(SCENARIOS / "bench-3dc-1000eps.yaml")
    return s.model_copy(
        update={"duration_s": duration_s, "kafka": s.kafka.model_copy(update={"poll_ms": poll_ms})}
    )


@pytest.mark.benchmark
@pytest.mark.timeout(300)
@pytest.mark.parametrize("poll_ms", [0.0, 10.0, 50.0], ids=["per-fetch", "poll-10ms", "poll-50ms"])
def test_sim_speed(benchmark, poll_ms):
    need_protocol("derecho")
    duration = 5.0 if benchmark.disabled else 30.0
    scenario = _scenario(poll_ms, duration)
    result = benchmark.pedantic(run_scenario, args=(scenario,), rounds=1, iterations=1)
    s = result.summary
    assert result.failing == []
    assert s["events_submitted"] > 900 * duration
    assert all(n == s["events_submitted"] for n in s["events_delivered"].values())
    eps = s["events_submitted"] / s["wall_time_s"]
    benchmark.extra_info["simulated_events_per_wall_s"] = round(eps)
    benchmark.extra_info["messages"] = s["network"]["messages"]
    print(f"\n{s['events_submitted']} events in {s['wall_time_s']} s wall: {eps:.0f} simulated events/s (poll_ms={poll_ms})")
