"""More `kdsync run` behaviour with real processes: broker down at start
(and librdkafka's own lines in the member's log format, rate-limited), the
original positional form with derecho.cfg (also without `run`, found in the
working directory, its [RDMA] provider mapped to the transport), several
source topics, a witness member, metrics of input lag."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from kdsync.testing.local import LocalGroup, check_agreement, read_global, write_events
from kdsync.kafka.embedded import EmbeddedCluster, die_with_parent, free_port
from kdsync.kafka.records import H_SEQ, global_headers
from kdsync.kafka.topic import ensure_topic

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _wait(cond, timeout: float, what: str, poll: float = 0.05):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll)


def _spawn(args, cwd, log_path, env=None):
    log = open(log_path, "ab")
    try:
        return subprocess.Popen([sys.executable, "-m", "kdsync.cli", *args], cwd=cwd, stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                preexec_fn=die_with_parent, start_new_session=True)
    finally:
        log.close()


def _stop(p: subprocess.Popen) -> int:
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return p.returncode


def test_broker_down_at_start_is_retried(tmp_path):
    """The member starts before its broker, logs the retries, and works once
    the broker is up (a one-member group)."""
    port, listen = free_port(), f"127.0.0.1:{free_port()}"
    cfg = tmp_path / "m.toml"
    cfg.write_text(f"""
state_dir = "{tmp_path / 'state'}"
[member]
id = "solo"
listen = "{listen}"
[peers]
solo = "{listen}"
[kafka]
"bootstrap.servers" = "127.0.0.1:{port}"
[topics]
source = "in"
[protocol]
tick_ms = 5
""")
    log = tmp_path / "member.log"
    # SIGTERM while still waiting for the broker: a clean stop, no traceback
    p = _spawn(["run", "--config", str(cfg)], tmp_path, tmp_path / "first.log")
    _wait(lambda: "retrying" in (tmp_path / "first.log").read_text(), 30, "a retry to be logged")
    p.send_signal(signal.SIGTERM)
    assert p.wait(20) == 0, (tmp_path / "first.log").read_text()
    assert "Traceback" not in (tmp_path / "first.log").read_text()
    p = _spawn(["run", "--config", str(cfg)], tmp_path, log)
    broker = EmbeddedCluster("late", port=port, log_dir=tmp_path)
    try:
        _wait(lambda: "retrying" in log.read_text(), 30, "a retry to be logged")
        assert p.poll() is None
        broker.start()
        ensure_topic(broker.bootstrap, "in")
        write_events(broker.bootstrap, "in", 50, "late")
        _wait(lambda: len(read_global(broker.bootstrap, "in-global")) == 50, 40, "50 records in in-global")
        got = read_global(broker.bootstrap, "in-global")
        assert [r.seq for r in got] == list(range(50)) and [r.origin_offset for r in got] == list(range(50))
        assert _stop(p) == 0
    finally:
        _stop(p)
        broker.close()


def test_original_positional_form_with_derecho_cfg(tmp_path):
    """`kdsync run 1 BROKERS TOPIC` with DERECHO_CONF_FILE: member m0, leader = itself."""
    gms = free_port()
    (tmp_path / "my.cfg").write_text(f"""[DERECHO]
leader_ip = 127.0.0.1
leader_gms_port = {gms}
local_id = 0
local_ip = 127.0.0.1
gms_port = {gms}
""")
    with EmbeddedCluster("legacy", log_dir=tmp_path) as c:
        ensure_topic(c.bootstrap, "test")
        write_events(c.bootstrap, "test", 30, "old")
        p = _spawn(["run", "1", c.bootstrap, "test"], tmp_path, tmp_path / "m.log",
                   env={"DERECHO_CONF_FILE": str(tmp_path / "my.cfg")})
        try:
            _wait(lambda: len(read_global(c.bootstrap, "test-global")) == 30, 40, "30 records in test-global")
            got = read_global(c.bootstrap, "test-global")
            assert {r.origin for r in got} == {"m0"} and [r.seq for r in got] == list(range(30))
            p.send_signal(signal.SIGINT)
            assert p.wait(20) == 0
        finally:
            _stop(p)
        # the state of the member lives next to the derecho.cfg it was configured by
        assert (tmp_path / ".kdsync-state" / "m0").is_dir()


def test_several_source_topics_each_get_their_own_order(tmp_path):
    g = LocalGroup(2, tmp_path, topic="orders", metrics=True, tick_ms=5, suspect_ms=300,
                   extra={"topics": {"source": ["orders", "payments"]}})
    try:
        g.start_brokers()
        for i in g.data:
            ensure_topic(g.bootstrap(i), "payments")
        g.start_members()
        g.wait_ready()
        ts = [threading.Thread(target=write_events, args=(g.bootstrap(i), t, 150, f"{t}-{i}"))
              for i in g.data for t in ("orders", "payments")]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        for topic in ("orders-global", "payments-global"):
            deadline = time.monotonic() + 40
            while True:
                got = {g.names[i]: read_global(g.bootstrap(i), topic) for i in g.data}
                if all(len(v) >= 300 for v in got.values()) or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            ok, detail = check_agreement(got, expected=300)
            assert ok, f"{topic}: {detail}"
            assert all(r.key.decode().startswith(topic.split("-")[0]) for r in got["dc1"])
        m = g.metrics(0)
        assert m[("kdsync_delivered_position", (("topic", "payments"),))] == 300
        lag = ("kdsync_input_lag", (("partition", "0"), ("topic", "orders")))
        assert lag in m
        # everything written is durably ordered and committed: the lag drains to 0
        _wait(lambda: g.metrics(1).get(lag) == 0.0, 10, "input lag to reach 0")
    finally:
        g.close()


def test_witness_keeps_a_two_cluster_group_going(tmp_path):
    """dc1, dc2 with a witness: dc2 crashes, dc1 + witness are a majority and go on."""
    g = LocalGroup(3, tmp_path, topic="events", metrics=True, tick_ms=5, suspect_ms=300,
                   names=["dc1", "dc2", "arb"], witnesses={2})
    try:
        g.start_brokers()
        g.start_members()
        g.wait_ready()
        ts = [threading.Thread(target=write_events, args=(g.bootstrap(i), g.topic, 100, f"w{i}")) for i in g.data]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        got = g.wait_for(200, 30)
        ok, detail = check_agreement(got, expected=200)
        assert ok, detail
        assert not (tmp_path / "tansu-arb.log").exists()  # the witness has no cluster
        g.signal_member(1, signal.SIGKILL)
        g.wait_member(1)
        write_events(g.bootstrap(0), g.topic, 100, "after")
        got = g.wait_for(300, 30, members=[0])
        assert len(got["dc1"]) == 300, g.log_text(0)[-3000:]
        g.start_member(1)
        got = g.wait_for(300, 40)
        ok, detail = check_agreement(got, expected=300)
        assert ok, detail
    finally:
        g.close()


def test_restart_catches_up_through_a_peers_global_topic(tmp_path):
    """log_retention is tiny, so what a restarted member missed is no longer in
    any peer's memory: it must come through a peer's global topic (ReadRequest)."""
    g = LocalGroup(3, tmp_path, topic="events", metrics=True, tick_ms=5, suspect_ms=300,
                   extra={"protocol": {"log_retention": 20, "catchup_chunk": 50, "max_batch": 10}})
    try:
        g.start_brokers()
        g.start_members()
        g.wait_ready()
        write_events(g.bootstrap(0), g.topic, 50, "a")
        got = g.wait_for(50, 30)
        assert all(len(v) == 50 for v in got.values())
        g.signal_member(2, signal.SIGKILL)
        g.wait_member(2)
        ts = [threading.Thread(target=write_events, args=(g.bootstrap(i), g.topic, 150, f"b{i}")) for i in (0, 1)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert len(g.wait_for(350, 30, members=[0, 1])["dc1"]) == 350
        # the core trims its in-memory log when it delivers and the trimmed part is
        # durable: a few more single events after the 350 are durable push them out
        for i in range(5):
            write_events(g.bootstrap(0), g.topic, 1, f"c{i}")
            assert len(g.wait_for(351 + i, 30, members=[0, 1])["dc1"]) == 351 + i
        g.start_member(2)
        got = g.wait_for(355, 40)
        ok, detail = check_agreement(got, expected=355)
        assert ok, detail + g.log_text(2)[-2000:]
        assert "served a read from the global topic" in g.log_text(0) + g.log_text(1)
    finally:
        g.close()


def test_global_partitions_by_key_hash_identical_everywhere(tmp_path):
    from kdsync.kafka.topic import partition_count, read_partition

    g = LocalGroup(2, tmp_path, topic="events", metrics=True, tick_ms=5, suspect_ms=300,
                   extra={"topics": {"global_partitions": 3}})
    try:
        g.start_brokers()
        g.start_members()
        g.wait_ready()
        ts = [threading.Thread(target=write_events, args=(g.bootstrap(i), g.topic, 200, f"k{i}")) for i in g.data]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

        def parts(i):
            return [[(m.key(), dict(m.headers())[H_SEQ]) for m in read_partition(g.bootstrap(i), g.global_topic, p)]
                    for p in range(3)]

        _wait(lambda: all(sum(map(len, parts(i))) == 400 for i in g.data), 40, "400 records in each global topic")
        a, b = parts(0), parts(1)
        assert partition_count(g.bootstrap(0), g.global_topic) == 3
        assert a == b  # same records in the same partition at the same offset
        assert all(len(p) > 50 for p in a)  # spread over the partitions
        seqs = sorted(int(s) for p in a for _, s in p)
        assert seqs == list(range(400))
        for p in a:  # each partition in global order
            assert [int(s) for _, s in p] == sorted(int(s) for _, s in p)
    finally:
        g.close()


def test_foreign_record_in_global_topic_is_fatal_with_one_line(tmp_path):
    listen = f"127.0.0.1:{free_port()}"
    with EmbeddedCluster("foreign", log_dir=tmp_path) as c:
        ensure_topic(c.bootstrap, "src")
        ensure_topic(c.bootstrap, "src-global")
        write_events(c.bootstrap, "src-global", 1, "intruder")  # not written by kdsync
        cfg = tmp_path / "m.toml"
        cfg.write_text(f"""
state_dir = "{tmp_path / 'state'}"
[member]
id = "solo"
listen = "{listen}"
[peers]
solo = "{listen}"
[kafka]
"bootstrap.servers" = "{c.bootstrap}"
[topics]
source = "src"
""")
        r = subprocess.run([sys.executable, "-m", "kdsync.cli", "run", "--config", str(cfg)], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 1
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("kdsync run: src-global[0] offset 0 has no kdsync.seq header"), r.stderr
        assert "Traceback" not in r.stderr


def test_restart_scan_stops_at_the_first_gap_across_partitions(tmp_path):
    """Several global partitions: a crash can leave position 2 missing while 3
    landed.  The member restarts at 2, watermarks come from the prefix only,
    and 3 is remembered so it is not written twice."""
    from confluent_kafka import Producer

    from kdsync.config import config_from_dict
    from kdsync.kafka.reader import load_start
    from kdsync.member import Member

    with EmbeddedCluster("gap", log_dir=tmp_path) as c:
        ensure_topic(c.bootstrap, "g-global", partitions=3)
        p = Producer({"bootstrap.servers": c.bootstrap})
        for seq, part, off in [(0, 0, 0), (1, 1, 1), (3, 2, 3)]:
            p.produce("g-global", key=b"k", value=b"v", partition=seq % 3,
                      headers=global_headers(seq, "dc1", 0, off, 1))
        assert p.flush(10) == 0
        cfg = config_from_dict({"member": {"id": "dc1", "listen": "127.0.0.1:1"}, "peers": {"dc1": "127.0.0.1:1"},
                                "kafka": {"bootstrap.servers": c.bootstrap},
                                "topics": {"source": "g", "global_partitions": 3}}, base_dir=str(tmp_path))
        s = load_start(Member(cfg).kafka_conf, "g-global", 3)  # no checkpoint: read from the first records
        assert (s.end, s.watermarks, s.present) == (2, {("dc1", 0): 1}, {3})
        assert s.checkpoint is None and s.lost is None and s.records == 3


def test_librdkafka_lines_go_through_the_member_log_format_rate_limited(tmp_path):
    """The member starts while its broker is down (~5 s, the fault under
    test): every line on its stderr is a kdsync JSON line, none a raw
    librdkafka ``%3|...`` line; librdkafka's lines come as logger
    kdsync.kafka.client, at most one per kind (facility, level) per
    [log] kafka_interval_ms, with the count of suppressed ones; then the
    broker comes up and the member works."""
    port, listen = free_port(), f"127.0.0.1:{free_port()}"
    cfg = tmp_path / "m.toml"
    cfg.write_text(f"""
state_dir = "{tmp_path / 'state'}"
[member]
id = "solo"
listen = "{listen}"
[peers]
solo = "{listen}"
[kafka]
"bootstrap.servers" = "127.0.0.1:{port}"
[topics]
source = "in"
[log]
format = "json"
kafka_interval_ms = 2000
""")
    log = tmp_path / "member.log"
    p = subprocess.Popen([sys.executable, "-m", "kdsync.cli", "run", "--config", str(cfg)], cwd=tmp_path,
                         stdout=subprocess.DEVNULL, stderr=open(log, "wb"), preexec_fn=die_with_parent,
                         start_new_session=True)
    broker = EmbeddedCluster("late", port=port, log_dir=tmp_path)
    try:
        _wait(lambda: "kdsync.kafka.client" in log.read_text(), 30, "a librdkafka line")
        time.sleep(5)  # the broker stays down this long
        broker.start()
        ensure_topic(broker.bootstrap, "in")
        write_events(broker.bootstrap, "in", 20, "up")
        _wait(lambda: len(read_global(broker.bootstrap, "in-global")) == 20, 40, "20 records in in-global")
        assert _stop(p) == 0
    finally:
        _stop(p)
        broker.close()
    lines = log.read_text().splitlines()
    assert not [x for x in lines if re.match(r"%\d+\|", x)], "raw librdkafka lines on stderr"
    parsed = [json.loads(x) for x in lines]  # every line is one JSON object
    client = [d for d in parsed if d["logger"] == "kdsync.kafka.client"]
    assert client and all(d["member"] == "solo" and d["facility"] and d["client"].startswith("rdkafka#")
                          for d in client)
    assert any(int(d.get("suppressed", 0)) > 0 for d in client), client
    kinds: dict[tuple[str, str], list[float]] = {}
    for d in client:
        kinds.setdefault((d["facility"], d["level"]), []).append(float(d["ts"]))
    for kind, ts in kinds.items():  # the rate limit, kind by kind (ts has millisecond resolution)
        assert all(b - a >= 1.99 for a, b in zip(ts, ts[1:])), (kind, ts)
    assert len(client) <= 6 * len(kinds) and len(kinds) <= 6, client  # ~7 s down: a handful per kind


def test_original_command_line_without_run_and_derecho_cfg_in_the_working_directory(tmp_path):
    """`kdsync 1 BROKERS TOPIC`, as the original kdsync was run: derecho.cfg is
    found in the working directory, its [RDMA] provider = sockets gives TCP
    (one log line says so)."""
    gms = free_port()
    (tmp_path / "derecho.cfg").write_text(f"""[DERECHO]
leader_ip = 127.0.0.1
leader_gms_port = {gms}
local_id = 0
local_ip = 127.0.0.1
gms_port = {gms}

[RDMA]
provider = sockets
""")
    env = {k: v for k, v in os.environ.items() if k != "DERECHO_CONF_FILE"}
    with EmbeddedCluster("orig", log_dir=tmp_path) as c:
        ensure_topic(c.bootstrap, "test")
        write_events(c.bootstrap, "test", 30, "orig")
        log = tmp_path / "m.log"
        p = subprocess.Popen([sys.executable, "-m", "kdsync.cli", "1", c.bootstrap, "test"], cwd=tmp_path,
                             stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env,
                             preexec_fn=die_with_parent, start_new_session=True)
        try:
            _wait(lambda: len(read_global(c.bootstrap, "test-global")) == 30, 40, "30 records in test-global")
            assert [r.seq for r in read_global(c.bootstrap, "test-global")] == list(range(30))
            p.send_signal(signal.SIGINT)
            assert p.wait(20) == 0
        finally:
            _stop(p)
    text = log.read_text()
    line = [x for x in text.splitlines() if "transport from derecho.cfg" in x]
    assert len(line) == 1 and "provider=sockets" in line[0] and "transport=tcp" in line[0], text
    assert f"file={tmp_path / 'derecho.cfg'} " in line[0], line
