"""The operator's Friday-evening mistakes, on real brokers and real members
(issue 40): every odd member is refused or refuses, with one line naming the
setting at both ends; the correct members order on without a pause; after
the odd member is fixed every cluster holds the same sequence, exactly once;
`kdsync check` and `kdsync status` say what is wrong at each step, on a
member killed and on a broker down; no traceback anywhere."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from confluent_kafka import Producer

from kdsync.kafka.embedded import die_with_parent, free_port
from kdsync.testing.local import LocalGroup, check_global_topics
from kdsync.testing.stats import percentile
from tests.helpers import member_logs, wait_until

pytestmark = pytest.mark.timeout(900)

RATE = 100  # events/s written into each of dc1's and dc2's clusters all along


class Paced:
    """Writers into some clusters of `g`, `RATE` events/s each, until stop()."""

    def __init__(self, g: LocalGroup, idx: list[int], tag: str):
        self.acked = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(g.bootstrap(i), g.topic, f"{tag}-{g.names[i]}"),
                                         daemon=True) for i in idx]
        for t in self.threads:
            t.start()

    def _done(self, err, _msg) -> None:
        if err is not None:
            self.errors.append(err.str())
        else:
            with self._lock:
                self.acked += 1

    def _run(self, bootstrap: str, topic: str, tag: str) -> None:
        p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 2})
        start, i = time.monotonic(), 0
        while not self._stop.is_set():
            p.produce(topic, key=f"{tag}-{i}".encode(), value=b"v", on_delivery=self._done)
            i += 1
            p.poll(0)
            time.sleep(max(0.0, start + i / RATE - time.monotonic()))
        assert p.flush(60) == 0

    def stop(self) -> int:
        self._stop.set()
        for t in self.threads:
            t.join(90)
        assert not self.errors, self.errors[:3]
        return self.acked


def kdsync(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "kdsync.cli", *args], capture_output=True, text=True, timeout=timeout)
    assert "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    return r


def start_text(g: LocalGroup, name: str, text: str) -> tuple[subprocess.Popen, Path, Path]:
    """A `kdsync run` of config `text` (not one of g's members): (process, config path, log path)."""
    cfg, log = g.dir / f"{name}.toml", g.dir / f"member-{name}.log"
    cfg.write_text(text)
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kdsync.cli", "run", "--config", str(cfg)],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"), preexec_fn=die_with_parent,
                                start_new_session=True)
    return proc, cfg, log


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(30)


def logged(path: Path, text: str) -> bool:
    return path.exists() and text in path.read_text(errors="replace")


# (what the odd member's config changes, the line it logs, the line the correct members log)
ODD = [
    ({"protocol": {"name": "clock"}}, "protocol.name = clock here, derecho at the peer",
     "protocol.name = derecho here, clock at the peer"),
    ({"protocol": {"commit_quorum": 2}}, "protocol.commit_quorum = 2 here, 0 at the peer",
     "protocol.commit_quorum = 0 here, 2 at the peer"),
    ("peers", "members = dc0,dc1,dc2,dc3 here, dc1,dc2,dc3 at the peer",
     "members = dc1,dc2,dc3 here, dc0,dc1,dc2,dc3 at the peer"),
    ({"topics": {"global_suffix": "-all"}}, "topics.global_suffix = -all here, -global at the peer",
     "topics.global_suffix = -global here, -all at the peer"),
    ({"topics": {"source": "orders"}}, "topics.source = orders here, events at the peer",
     "topics.source = events here, orders at the peer"),
]


def test_odd_members_are_refused_by_name_and_the_group_orders_on(tmp_path):
    # suspect_ms well above a loaded box's late loops: the test claims no view change while odd members
    # knock, and with the harness's 300 ms a late loop alone could cause one (the stops here are announced)
    g = LocalGroup(3, tmp_path, metrics=True, suspect_ms=3000)
    with g:
        g.start_brokers()
        g.start_members()
        g.wait_ready(90)
        assert kdsync("check", "--config", str(g.config_path(0))).returncode == 0
        r = kdsync("status", "--config", str(g.config_path(0)))
        assert r.returncode == 0 and "healthy" in r.stdout, r.stdout
        # dc3 leaves cleanly; dc1 and dc2 order on in a view of two, writes running
        assert g.stop_member(2) == 0
        wait_until(lambda: g.metrics(0).get(("kdsync_live_members", (("topic", g.topic),))) == 2, 30, "a view of 2")
        writers = Paced(g, [0, 1], "w")
        time.sleep(1.5)  # past the writers' first records (a cold producer holds them)
        view = g.metrics(0)[("kdsync_view_id", (("topic", g.topic),))]
        # the control: what a refused member costs this box when nothing about the contract is new (a wrong
        # secret was always refused): a member process starting, knocking, and the operator's commands
        t_steady = time.time()
        proc, cfg, log = start_text(g, "dc3-secret", g.config_text(2, transport={"secret": "not the secret"}))
        wait_until(lambda: g.metrics(0).get(("kdsync_peer_refused_total", (("peer", "dc3"), ("reason", "secret"))),
                                            0) >= 1, 30, "dc1 to refuse dc3's wrong secret")
        assert kdsync("check", "--config", str(cfg)).returncode == 1
        assert kdsync("status", "--config", str(g.config_path(0)), "--json").returncode == 1
        assert stop(proc) == 0
        t_fault = time.time()
        good = g.config_text(2)
        marks = []  # (phase, its start): the latency of each phase, printed
        for i, (change, odd_line, good_line) in enumerate(ODD):
            marks.append((odd_line.split(" = ")[0], time.time()))
            if change == "peers":
                text = good.replace("[peers]\n", f'[peers]\ndc0 = "127.0.0.1:{free_port()}"\n')
            else:
                text = g.config_text(2, **change)
            proc, cfg, log = start_text(g, f"dc3-odd{i}", text)
            wait_until(lambda: logged(log, odd_line) and odd_line.split(" = ")[0] in g.log_text(0)
                       and good_line in g.log_text(0) and good_line in g.log_text(1), 30,
                       f"both ends to name {odd_line!r}\n" + member_logs(g))
            lines = [ln for ln in log.read_text().splitlines() if odd_line in ln]
            assert 1 <= len(lines) <= 2 and all("level=error" in ln for ln in lines), lines  # once per peer
            assert sum(good_line in ln for ln in g.log_text(0).splitlines()) == 1
            r = kdsync("check", "--config", str(cfg))  # what the odd member's operator runs
            assert r.returncode == 1 and odd_line in r.stdout and "error: group: only 1 of " in r.stdout, r.stdout
            r = kdsync("status", "--config", str(g.config_path(0)), "--json")
            snap = json.loads(r.stdout)
            assert r.returncode == 1 and not snap["healthy"], r.stdout
            dc3 = next(p for p in snap["members"][0]["peers"] if p["peer"] == "dc3")
            assert dc3["link"] == "none" and dc3["refused"].startswith("contract:") and good_line in dc3["refused_why"]
            assert snap["members"][0]["topics"][0]["status"] == "active"
            assert stop(proc) == 0
            assert "Traceback" not in log.read_text()
        # a copy of dc2's config on another port and state directory: two processes claim dc2
        twin_text = g.config_text(1).replace(f'listen = "127.0.0.1:{g.ports[1]}"', f'listen = "127.0.0.1:{free_port()}"')
        twin_text = twin_text.replace(str(g.dir / "state-dc2"), str(g.dir / "state-dc2-copy")).replace(
            f"127.0.0.1:{g.metrics_ports[1]}", f"127.0.0.1:{free_port()}")
        marks.append(("copy of dc2", time.time()))
        twin, _, twin_log = start_text(g, "dc2-copy", twin_text)
        wait_until(lambda: "two processes claim member dc2" in g.log_text(0), 60,
                   "dc1 to name the two processes claiming dc2\n" + member_logs(g))
        line = next(ln for ln in g.log_text(0).splitlines() if "two processes claim member dc2" in ln)
        assert "level=error" in line and f"127.0.0.1:{g.ports[1]}" in line
        r = kdsync("status", "--config", str(g.config_path(0)))
        assert r.returncode == 1 and "two processes claim member dc2" in r.stdout, r.stdout
        assert stop(twin) == 0 and "Traceback" not in twin_log.read_text()
        t_fixed = time.time()
        # no view change while the odd members knocked: the order never paused for them
        assert g.metrics(0)[("kdsync_view_id", (("topic", g.topic),))] == view, member_logs(g)
        # dc3 fixed: it joins; a copy of its config on another port but the same state directory exits 1
        g.start_member(2)
        g.wait_ready(60, members=[2])
        copy = g.config_text(2).replace(f'listen = "127.0.0.1:{g.ports[2]}"', f'listen = "127.0.0.1:{free_port()}"')
        (g.dir / "dc3-copy.toml").write_text(copy)
        r = kdsync("run", "--config", str(g.dir / "dc3-copy.toml"), timeout=60)
        assert r.returncode == 1, r.stderr
        assert r.stderr.strip() == (f"kdsync run: state directory {g.dir / 'state-dc3'} is in use by process "
                                    f"{g.procs[2].pid} (another member with the same state_dir? each member needs "
                                    f"its own)"), r.stderr
        time.sleep(2)
        total = writers.stop()
        got = g.wait_for(total, 120)
        ok, detail = check_global_topics(got, expected=total)
        assert ok, detail + "\n" + member_logs(g)
        # the correct members' order went on: no pause while odd members knocked
        lat = [(r.origin_ts, r.write_ts - r.origin_ts) for r in got["dc1"] if r.origin in ("dc1", "dc2")]
        steady = [v for ts, v in lat if t_steady * 1000 <= ts < t_fault * 1000]
        fault = [v for ts, v in lat if t_fault * 1000 <= ts < t_fixed * 1000]
        p99s, p99f = percentile(steady, 99), percentile(fault, 99)
        for (name, t0), (_, t1) in zip(marks, marks[1:] + [("", t_fixed)]):
            part = [v for ts, v in lat if t0 * 1000 <= ts < t1 * 1000]
            print(f"{name}: p99 {percentile(part, 99)} ms, max {max(part)} ms ({len(part)} events)")
        print(f"control (wrong secret) p99 {p99s} ms ({len(steady)} events), odd members p99 {p99f} ms ({len(fault)})")
        assert len(steady) > 150 and len(fault) > 800
        # no pause: dc1 never stopped writing the order while the odd members knocked.  A pause for a peer
        # (a suspicion, a view change) stops every delivery for suspect_ms (3 000 ms here) or more, so dc1's
        # longest silence stays below it; the box's noise only delays deliveries, it does not stop them.
        # (The p99 is printed, not bound: on Tansu 0.6 a fetch lists every batch of the partition, so the
        # brokers' cost grows with the run and the later phases' latency with it -- CI: control 54 ms,
        # phases 228-2 679 ms with no pause and no view change; the same test on noida: 81-307 ms.)
        writes = sorted(r.write_ts for r in got["dc1"] if r.origin in ("dc1", "dc2")
                        and t_fault * 1000 <= r.origin_ts < t_fixed * 1000)
        silence = max(b - a for a, b in zip(writes, writes[1:]))
        print(f"dc1's longest silence while odd members knocked: {silence} ms")
        assert silence < 3000, (silence, p99s, p99f)
        # the operator's view of a member killed and of a broker down
        wait_until(lambda: kdsync("status", "--config", str(g.config_path(0))).returncode == 0, 30,
                   "dc1's status healthy once the copy of dc2 is gone")
        g.procs[2].kill()
        g.wait_member(2)
        r = kdsync("status", "--config", str(g.config_path(2)))
        assert r.returncode == 1 and "not running" in r.stdout, r.stdout
        wait_until(lambda: kdsync("status", "--config", str(g.config_path(0))).returncode == 1, 30, "dc1 to miss dc3")
        r = kdsync("check", "--config", str(g.config_path(0)))
        assert r.returncode == 0 and "peer dc3" in r.stdout and "not reachable" in r.stdout, r.stdout
        assert "group: 2 of 3 members reachable and agreeing" in r.stdout
        g.clusters[1].close()  # dc2's broker goes down
        wait_until(lambda: "Kafka client error" in kdsync("status", "--config", str(g.config_path(1))).stdout, 60,
                   "dc2's status to report its broker")
        r = kdsync("check", "--config", str(g.config_path(1)), "--timeout", "2")
        assert r.returncode == 1 and "error: kafka: cannot reach bootstrap.servers" in r.stdout, r.stdout
        for i in range(2):
            assert "Traceback" not in g.log_text(i)


def test_bad_addresses_and_a_bad_config_exit_2_with_one_line(tmp_path):
    text = """
[member]
id = "dc1"
listen = "127.0.0.1:7401"
[peers]
dc1 = "127.0.0.1:7401"
dc2 = "127.0.0.1:7402"
dc3 = "127.0.0.1:7402"
[kafka]
"bootstrap.servers" = "127.0.0.1:9"
[topics]
source = "events"
"""
    (tmp_path / "c.toml").write_text(text)
    for cmd in ("run", "check", "status"):
        r = kdsync(cmd, "--config", str(tmp_path / "c.toml"))
        assert r.returncode == 2, (cmd, r.stderr)
        assert r.stderr.strip() == ("config error: peers.dc3: '127.0.0.1:7402': dc2 and dc3 are at the same address; "
                                    "each member needs its own address"), r.stderr


PREVIOUS_RELEASE = "a4f4929"  # main before the group contract: members that show no contract and no wire range


def _imports_from(pid: int, tree: Path) -> bool:
    """Whether process `pid` runs with `tree` as its working directory (what `python -m` imports first)."""
    return os.readlink(f"/proc/{pid}/cwd") == str(tree)


@pytest.fixture
def previous_release(tmp_path_factory) -> Path:
    """The previous release's kdsync package, from git (a fresh clone has it)."""
    root = Path(__file__).resolve().parent.parent
    if shutil.which("git") is None or subprocess.run(["git", "-C", str(root), "cat-file", "-e",
                                                      f"{PREVIOUS_RELEASE}^{{commit}}"]).returncode != 0:
        pytest.skip(f"commit {PREVIOUS_RELEASE} is not in this checkout (a shallow clone?)")
    out = tmp_path_factory.mktemp("previous")
    archive = subprocess.run(["git", "-C", str(root), "archive", PREVIOUS_RELEASE, "kdsync"], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


def test_a_rolling_upgrade_from_the_previous_release_keeps_ordering_and_versions_are_compared(
        tmp_path, previous_release, monkeypatch):
    g = LocalGroup(3, tmp_path, metrics=True)
    with g:
        g.start_brokers()
        with monkeypatch.context() as m:  # `python -m` puts the working directory first on the path
            m.chdir(previous_release)
            g.start_members()
        g.wait_ready(90)
        assert all(_imports_from(g.procs[i].pid, previous_release) for i in range(3))
        writers = Paced(g, [0, 1, 2], "up")
        for i in range(3):  # one member at a time, writes running
            assert g.stop_member(i) == 0
            g.start_member(i)
            g.wait_ready(60, members=[i])
            old = [g.names[j] for j in range(i + 1, 3)]
            for name in old:
                wait_until(lambda: f"peer {name} runs an older release: its group contract is not compared"
                           in g.log_text(i), 20, f"{g.names[i]} to note {name}'s older release")
        r = kdsync("status", "--config", str(g.config_path(0)))
        assert r.returncode == 0, r.stdout
        total = writers.stop()
        got = g.wait_for(total, 120)
        ok, detail = check_global_topics(got, expected=total)
        assert ok, detail + "\n" + member_logs(g)
        # a member of a release that speaks another wire version is refused with one line at both ends
        assert g.stop_member(2) == 0
        monkeypatch.setenv("KDSYNC_TEST_WIRE", "3-3")
        g.start_member(2)
        monkeypatch.delenv("KDSYNC_TEST_WIRE")
        wait_until(lambda: "no common wire version: this member speaks 3, dc1 speaks 1" in g.log_text(2)
                   and "no common wire version: this member speaks 1, dc3 speaks 3" in g.log_text(0), 30,
                   "both ends to name both wire versions\n" + member_logs(g))
        assert sum("no common wire version" in ln for ln in g.log_text(0).splitlines()) == 1
        assert g.stop_member(2) == 0
        g.start_member(2)
        g.wait_ready(60, members=[2])
        n = total + 60
        from kdsync.testing.local import write_events
        for i in range(3):
            write_events(g.bootstrap(i), g.topic, 20, f"after-{i}")
        got = g.wait_for(n, 60)
        ok, detail = check_global_topics(got, expected=n)
        assert ok, detail


def test_a_clock_member_stopping_beside_older_releases_is_taken_out_by_their_view_change(
        tmp_path, previous_release, monkeypatch):
    """Mid rolling upgrade of a clock group: dc1 runs this release, dc2 and dc3
    the previous one, which drops FENCE as an unknown message (logged: the
    release before stop 42 knows no LEAVE either).  dc1 stopped with SIGTERM
    fences itself (kdsync.core.fence); the older members notice its silence
    and change their view without it, and its restart is taken back — writes
    running throughout, every cluster then holds the same events, once."""
    # suspect_ms above a busy box's reconnects: the previous release's dc3, reconnecting to the restarted
    # dc1 with its backoff, was silent at dc1 for 380 ms and taken out with the harness's 300 (CI), so
    # the view without dc1 this test waits for could not form
    g = LocalGroup(3, tmp_path, protocol="clock", metrics=True, suspect_ms=3000)
    with g:
        g.start_brokers()
        with monkeypatch.context() as m:
            m.chdir(previous_release)
            g.start_members()
        g.wait_ready(90)
        assert g.stop_member(0) == 0
        g.start_member(0)  # this release
        g.wait_ready(60, members=[0])
        assert not _imports_from(g.procs[0].pid, previous_release) and _imports_from(g.procs[1].pid, previous_release)
        writers = Paced(g, [0, 1, 2], "up")

        def without_dc1():
            return [g.log_text(i).count("members=dc2,dc3 ") for i in (1, 2)]

        before = without_dc1()  # the upgrade's own stop made one
        assert g.stop_member(0) == 0
        wait_until(lambda: all(a > b for a, b in zip(without_dc1(), before)), 30,
                   "the older members' view without dc1\n" + member_logs(g))
        assert 'error="unknown message type 23"' in g.log_text(1)
        g.start_member(0)
        g.wait_ready(60, members=[0])
        total = writers.stop()
        got = g.wait_for(total, 120)
        ok, detail = check_global_topics(got, expected=total)
        assert ok, detail + "\n" + member_logs(g)
