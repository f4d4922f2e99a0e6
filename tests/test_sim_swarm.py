"""The swarm: at least 200 seeded random runs (topology, rates, network,
faults) with 0 violations; a failing seed is reproducible from its YAML."""

from __future__ import annotations

import pytest

from sim.cli import main
from sim.runner import run_scenario
from sim.swarm import swarm_scenario

from sim_helpers import need_protocol

SEEDS = 200
CHUNK = 25


@pytest.mark.timeout(240)
@pytest.mark.parametrize("first", range(0, SEEDS, CHUNK))
def test_swarm_has_no_violations(first, capsys, tmp_path):
    need_protocol("derecho")
    rc = main(["swarm", "--seeds", str(CHUNK), "--first", str(first), "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"swarm: {CHUNK} runs" in out and " 0 failed" in out


def test_swarm_draws_varied_topologies_and_faults():
    scenarios = [swarm_scenario(s) for s in range(60)]
    assert {len(s.members) for s in scenarios} == {3, 4, 5}
    assert any(s.witnesses for s in scenarios)
    actions = {f.action for s in scenarios for f in s.faults}
    assert {"crash", "restart", "partition", "link", "clock_pause"} <= actions
    assert any(s.network.default.loss for s in scenarios)
    # liveness phase: every crash is followed by a restart before duration_s
    for s in scenarios:
        down = set()
        for f in sorted(s.faults, key=lambda f: f.at_s):
            if f.action == "crash":
                down.add(f.crash)
            elif f.action == "restart":
                down.discard(f.restart)
        assert not down, s.name


@pytest.mark.timeout(60)
def test_swarm_run_is_small():
    need_protocol("derecho")
    r = run_scenario(swarm_scenario(5))
    assert r.summary["events_submitted"] < 2_000
    assert r.summary["sim_time_s"] <= 10
