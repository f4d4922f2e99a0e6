"""`kdsync demo`: passes on embedded brokers (Tansu and noida-db), reports
the baseline's disagreement, and leaves no process behind, also on Ctrl-C."""

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]


def _children(pid: int) -> set[int]:
    out = set()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.add(int(d))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _demo(*args, **kw):
    return subprocess.Popen([sys.executable, "-m", "kdsync.cli", "demo", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


@pytest.mark.parametrize("broker", ["tansu", "noida"])
def test_demo_agrees_and_cleans_up(broker):
    p = _demo("--clusters", "3", "--events", "900", "--broker", broker)
    out, err = p.communicate(timeout=140)
    assert p.returncode == 0, out + err
    assert f"brokers     3 embedded {broker}\n" in out
    assert "agreement   YES: 900 records identical in 3 clusters" in out
    assert "latency     p50" in out and "throughput" in out
    assert "floor       p50" in out and "kdsync p99 / floor p99 = " in out  # the box's one hop beside it
    assert not _children(p.pid)


def test_demo_mirror_baseline_disagrees():
    p = _demo("--clusters", "3", "--events", "900", "--rate", "600", "--protocol", "mirror")
    out, err = p.communicate(timeout=140)
    # concurrent writes interleave differently in each cluster without agreement
    assert p.returncode == 1, out + err
    assert "agreement   NO" in out


@pytest.mark.parametrize("broker,binary", [("tansu", "tansu"), ("noida", "noida-db start")])
def test_demo_ctrl_c_stops_every_process(broker, binary):
    p = _demo("--clusters", "3", "--events", "100000", "--rate", "200", "--broker", broker)
    try:
        deadline = time.monotonic() + 60
        kids: set[int] = set()
        while len(kids) < 6 or not all(_cmdline(k) for k in kids):  # 3 brokers + 3 members
            assert time.monotonic() < deadline and p.poll() is None, p.stderr.read() if p.poll() is not None else ""
            kids = _children(p.pid)
            time.sleep(0.1)
        names = sorted(_cmdline(k) for k in kids)
        p.send_signal(signal.SIGINT)
        p.wait(60)
        assert p.returncode == 130
        assert sum(binary in n for n in names) == 3 and sum("kdsync.cli run" in n for n in names) == 3, names
        assert not [k for k in kids if _alive(k)]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_demo_bad_arguments_exit_2():
    p = _demo("--clusters", "0")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 2 and err.strip() == "kdsync demo: --clusters must be between 1 and 16"
    p = _demo("--bogus")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 2 and "Traceback" not in err
    p = _demo("--broker", "kafka")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 2 and err.strip() == ("kdsync demo: invalid value for '--broker': 'kafka' is not one of "
                                                 "'tansu', 'noida' (see kdsync demo --help)")
    p = _demo("--durable", "--broker", "noida")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("kdsync demo: --durable runs on Tansu only"), err


def test_writers_warm_up_outside_the_ordered_topic(tmp_path):
    """write_events(warm_topic=...): the idempotent producer's first record
    goes to the warm-up topic and is acknowledged before `on_ready` runs and
    before the first counted record (a cold producer holds its first records
    ~0.5 s, which the demo and the bench would report as ordering latency);
    the counted topic gets exactly the n records."""
    from kdsync.testing.local import WARM_TOPIC, write_events
    from kdsync.kafka.embedded import EmbeddedCluster
    from kdsync.kafka.topic import ensure_topic, read_partition

    with EmbeddedCluster("warm", log_dir=tmp_path) as c:
        ensure_topic(c.bootstrap, "events", 1)
        seen = []
        n = write_events(c.bootstrap, "events", 20, "w", rate=200.0, warm_topic=WARM_TOPIC,
                         on_ready=lambda: seen.append((len(read_partition(c.bootstrap, WARM_TOPIC)),
                                                       len(read_partition(c.bootstrap, "events")))))
        assert seen == [(1, 0)]
        assert n == 20 and len(read_partition(c.bootstrap, "events")) == 20


def test_extra_and_override_member_keys_go_into_the_member_table(tmp_path):
    from kdsync.testing import local
    from kdsync.config import load_config

    g = local.LocalGroup(3, tmp_path, extra={"member": {"state_dir": str(tmp_path / "elsewhere")},
                                            "checkpoint": {"interval_ms": 2000}})
    path = tmp_path / "dc2.toml"
    path.write_text(g.config_text(1, protocol={"name": "sequencer"}, member={"state_dir": str(tmp_path / "b")}))
    cfg = load_config(str(path))  # one [member] table: a second would be a TOML error
    assert cfg.member.id == "dc2" and cfg.member.state_dir == str(tmp_path / "b")
    assert cfg.checkpoint.interval_ms == 2000 and cfg.protocol.name == "sequencer"
    assert load_config(str(_write(tmp_path / "dc1.toml", g.config_text(0)))).member.state_dir == str(tmp_path / "elsewhere")


def _write(path, text):
    path.write_text(text)
    return path
