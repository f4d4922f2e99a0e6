"""Every shipped scenario runs on the real core with 0 failing violations;
the mirror baseline on concurrent bursts shows its agreement violations and
still exits 0."""

from __future__ import annotations

import pytest

from sim.cli import main
from sim.runner import run_scenario
from sim.scenario import load_scenario

from sim_helpers import SCENARIOS, need_protocol

# the benchmark scenario is run by test_sim_bench.py
SHIPPED = sorted(p for p in SCENARIOS.glob("*.yaml") if not p.name.startswith("bench-"))


def test_at_least_the_required_scenarios_ship():
    names = {p.stem for p in SHIPPED}
    required = {
        "steady-3dc-wan", "concurrent-bursts", "follower-crash-restart", "leader-crash",
        "minority-partition-heal", "asymmetric-partition", "lossy-links", "two-dc-witness",
        "five-rolling-restarts", "protocol-derecho", "protocol-sequencer", "protocol-mirror",
        "protocol-clock", "wan-five-regions", "wan-one-far-region", "clock-faults",
    }
    assert required <= names
    protocols = {load_scenario(p).protocol for p in SHIPPED}
    assert protocols == {"derecho", "clock", "sequencer", "mirror"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_scenario_holds_every_invariant(path):
    scenario = load_scenario(path)
    need_protocol(scenario.protocol)
    result = run_scenario(scenario)
    s = result.summary
    assert result.failing == [], [v.detail for v in result.failing]
    assert s["events_submitted"] > 0
    live = [m for m, st in s["member_state"].items() if st["up"] and m in s["events_delivered"]]
    # no loss: every live cluster holds every acknowledged event
    for m in live:
        assert s["events_delivered"][m] == s["events_submitted"], m
    if scenario.protocol != "mirror":
        assert s["violations"] == []


def test_protocol_comparison_shares_one_workload():
    runs = [load_scenario(SCENARIOS / f"protocol-{p}.yaml") for p in ("derecho", "clock", "sequencer", "mirror")]
    dumps = [s.model_dump(exclude={"name", "protocol"}) for s in runs]
    assert all(d == dumps[0] for d in dumps[1:])


def test_wan_regions_cite_their_source_and_are_asymmetric_like_it():
    text = (SCENARIOS / "wan-five-regions.yaml").read_text()
    assert "acomputerscientistlearnsaws.blogspot.com" in text
    s = load_scenario(SCENARIOS / "wan-five-regions.yaml")
    assert len(s.members) == 5
    one_way = {(link.from_, link.to): link.latency_ms for link in s.network.links}
    assert one_way[("fra", "tyo")] == 118.25 and one_way[("tyo", "fra")] == 118.3  # 236.5 / 236.6 ms round trips
    assert all((b, a) in one_way for a, b in one_way)  # every pair both ways


@pytest.mark.timeout(120)
def test_mirror_reports_agreement_violations_on_concurrent_bursts_and_exits_0(capsys):
    need_protocol("mirror")
    path = SCENARIOS / "protocol-mirror.yaml"
    rc = main(["run", str(path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "\x1b" not in out  # no progress bar when stdout is not a terminal
    assert "agreement" in out
    assert f"repro: kdsync-sim run {path} --seed 10" in out
