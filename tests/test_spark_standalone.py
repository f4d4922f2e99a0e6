"""The Spark pipeline on a real standalone cluster (issue 22): a master and
two workers started with pyspark's own launcher (`spark-class`, separate
JVMs), then `kdsync-sim swarm --master spark://...` and `kdsync audit
--master spark://...` as a user runs them, and the master's own account
(its JSON status page) that both applications ran on it, on its workers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from kdsync.kafka.embedded import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

WORKERS = 2  # 1 core and 1 GB each: an application's executor per worker (spark.executor.memory defaults to 1g)


def _status(ui: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{ui}/json/", timeout=5) as r:
        return json.loads(r.read())


def _spark_env(tmp: Path) -> dict[str, str]:
    pyspark = pytest.importorskip("pyspark")
    home = Path(pyspark.__file__).parent
    return {**os.environ, "SPARK_HOME": str(home), "PYSPARK_PYTHON": sys.executable,
            "PYSPARK_DRIVER_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1",
            "SPARK_LOG_DIR": str(tmp / "logs"), "SPARK_WORKER_DIR": str(tmp / "work")}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """spark://127.0.0.1:PORT with WORKERS live workers; yields (url, ui port)."""
    tmp = tmp_path_factory.mktemp("standalone")
    env = _spark_env(tmp)
    spark_class = str(Path(env["SPARK_HOME"]) / "bin" / "spark-class")
    port, ui = free_port(), free_port()
    url = f"spark://127.0.0.1:{port}"
    procs = []

    def start(name: str, args: list[str]) -> None:
        log = open(tmp / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        procs.append((subprocess.Popen([spark_class, *args], stdout=log, stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True), log, tmp / f"{name}.log"))

    start("master", ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port),
                     "--webui-port", str(ui)])
    for i in range(WORKERS):
        start(f"worker{i}", ["org.apache.spark.deploy.worker.Worker", url, "--host", "127.0.0.1", "--cores", "1",
                             "--memory", "1g", "--webui-port", str(free_port()), "--work-dir", str(tmp / f"w{i}")])
    try:
        deadline = time.monotonic() + 180
        while True:  # the master's own status page says the workers registered
            for p, _, path in procs:
                if p.poll() is not None:
                    raise AssertionError(f"{path.name} exited {p.returncode}: {path.read_text()[-2000:]}")
            try:
                alive = [w for w in _status(ui).get("workers", []) if w.get("state") == "ALIVE"]
            except (OSError, ValueError):  # not listening yet, or its web UI answers before the page is JSON
                alive = []
            if len(alive) == WORKERS:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(alive)} of {WORKERS} workers registered with {url} in 180 s")
            time.sleep(0.5)
        yield url, ui
    finally:
        for p, log, _ in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p, log, _ in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            log.close()


def _apps(ui: int) -> list[dict]:
    s = _status(ui)
    return s.get("activeapps", []) + s.get("completedapps", [])


def _run(cmd: list[str], tmp: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = _spark_env(tmp)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def test_swarm_and_audit_run_on_a_standalone_master_with_two_workers(cluster, tmp_path):
    from test_sim_swarm import CI_SEEDS

    url, ui = cluster
    before = {a["id"] for a in _apps(ui)}

    swarm = _run([sys.executable, "-m", "sim.cli", "swarm", "--seeds", "4", "--first", str(CI_SEEDS[0]),
                  "--master", url, "--out", str(tmp_path / "swarm")], tmp_path)
    assert swarm.returncode == 0, swarm.stdout[-2000:] + swarm.stderr[-3000:]
    last = swarm.stdout.strip().splitlines()[-1]
    assert last.startswith("swarm: 4 runs (seeds ") and " 0 failed" in last and f"Spark {url}" in last, last

    from test_audit_trace import SCENARIO  # the audit's own trace test's scenario

    (tmp_path / "s.yaml").write_text(textwrap.dedent(SCENARIO.format(protocol="derecho")))
    sim = _run([sys.executable, "-m", "sim.cli", "run", str(tmp_path / "s.yaml"), "--out", str(tmp_path / "run")],
               tmp_path)
    assert sim.returncode == 0, sim.stderr[-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    audit = _run([sys.executable, "-m", "kdsync.cli", "audit", "--trace", str(tmp_path / "run"), "--master", url,
                  "--out", str(tmp_path / "tables")], tmp_path)
    assert audit.returncode == 0, audit.stderr[-3000:]
    report = json.loads(audit.stdout)
    (r,) = report["runs"]
    assert r["ok"] and r["events_delivered"] == summary["events_delivered"]
    assert (tmp_path / "tables" / "scenarios").is_dir()

    # the master's account: two new applications ran on it, each given executors' cores
    new = [a for a in _apps(ui) if a["id"] not in before]
    assert sorted(a["name"] for a in new) == ["kdsync-audit", "kdsync-swarm"], new
    assert all(a.get("cores", 0) >= 1 for a in new), new
    assert {a["state"] for a in new} <= {"FINISHED", "RUNNING"}, new
