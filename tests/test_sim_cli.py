"""`kdsync-sim` user errors: one line naming file, line and key; exit 2."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from sim.cli import main
from sim.scenario import ScenarioError, dump_scenario, parse_scenario
from sim.swarm import swarm_scenario

GOOD = textwrap.dedent(
    """\
    name: t
    duration_s: 2
    members:
      - id: dc1
      - id: dc2
      - id: dc3
    network:
      default: {latency_ms: 10}
    workload:
      - {member: all, rate_eps: 10}
    faults:
      - {at_s: 1, crash: dc2}
    """
)


def _run_bad(tmp_path, capsys, text: str) -> str:
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    rc = main(["run", str(f)])
    cap = capsys.readouterr()
    assert rc == 2
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1, cap.err
    assert "Traceback" not in cap.err
    assert lines[0].startswith(f"{f}:")
    return lines[0]


def test_good_scenario_parses():
    s = parse_scenario(GOOD)
    assert s.member_ids == ("dc1", "dc2", "dc3") and s.faults[0].action == "crash"


@pytest.mark.parametrize(
    "old,new,line,key",
    [
        ("  default: {latency_ms: 10}", "  default: {latency_ms: 10, lattency: 3}", 8, "network.default.lattency: unknown key"),
        ("duration_s: 2", "duration_s: -2", 2, "duration_s:"),
        ("  - {at_s: 1, crash: dc2}", "  - {at_s: 1, crash: dc9}", 12, "faults[0].crash: unknown member 'dc9'"),
        ("  - {member: all, rate_eps: 10}", "  - {member: all, rate_eps: 10, burst: 3}", 10, "workload[0]:"),
        ("  - id: dc3", "  - id: dc3\n    colour: red", 7, "members[2].colour: unknown key"),
        ("  - {at_s: 1, crash: dc2}", "  - {at_s: 1, crash: dc2, for_s: 3}", 12, "faults[0]:"),
        ("  default: {latency_ms: 10}", "  default: {latency_ms: 10, loss: 1.5}", 8, "network.default.loss:"),
        ("name: t", "name: t\nprotocol: paxos", 2, "protocol:"),
    ],
)
def test_bad_scenario_names_file_line_and_key(tmp_path, capsys, old, new, line, key):
    assert old in GOOD
    msg = _run_bad(tmp_path, capsys, GOOD.replace(old, new))
    assert f"bad.yaml:{line}: " in msg, msg
    assert key in msg, msg


def test_missing_key_and_broken_yaml(tmp_path, capsys):
    msg = _run_bad(tmp_path, capsys, GOOD.replace("duration_s: 2\n", ""))
    assert "duration_s: missing required key" in msg
    msg = _run_bad(tmp_path, capsys, GOOD + "  - {at_s: [\n")
    assert "not valid YAML" in msg


def test_missing_file_and_bad_arguments(tmp_path, capsys):
    assert main(["run", str(tmp_path / "nope.yaml")]) == 2
    assert "no such scenario file" in capsys.readouterr().err
    assert main(["swarm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--seeds" in err[0]
    assert main(["swarm", "--seeds", "0"]) == 2
    assert main([]) == 2


def test_console_script_exit_2_without_traceback(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text(GOOD.replace("name: t", "name: t\nbogus: 1"))
    p = subprocess.run([sys.executable, "-m", "sim.cli", "run", str(f)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip() == f"{f}:2: bogus: unknown key"


@pytest.mark.parametrize("seed", range(20))
def test_swarm_scenarios_round_trip_through_yaml(seed):
    s = swarm_scenario(seed)
    assert parse_scenario(dump_scenario(s)) == s


def test_scenario_error_is_one_line():
    with pytest.raises(ScenarioError) as err:
        parse_scenario("name: x\nduration_s: 1\nmembers: []\n", "x.yaml")
    assert str(err.value).startswith("x.yaml:3: members:")


def test_a_configuration_the_core_refuses_is_a_user_error(tmp_path, capsys, monkeypatch):
    f = tmp_path / "w.yaml"
    f.write_text("name: w\nduration_s: 1\nmembers: [{id: a}, {id: b}]\nworkload: []\n")
    from kdsync.core import LocalProtocolError

    def refuse(cfg, **kw):
        raise LocalProtocolError("no such thing")

    monkeypatch.setattr("sim.runner.make_node", refuse)
    rc = main(["run", str(f)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == "w: protocol derecho refuses member a: no such thing"
