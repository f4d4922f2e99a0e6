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
import time

import pytest

from kdsync.testing.local import LocalGroup, check_global_topics, read_global, write_events
from kdsync.kafka.embedded import EmbeddedCluster, die_with_parent, free_port
from kdsync.kafka.records import H_SEQ, global_headers
from kdsync.kafka.topic import ensure_topic

from helpers import refused_start, solo_config, wait_until, write_in_parallel

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _spawn(args, cwd, log_path, env=None, stderr_only=False):
    """`python -m kdsync.cli *args` in a session of its own, dying with this
    process, in environment `env` (this one's by default): its stdout and
    stderr go to log_path (only its stderr with stderr_only, stdout dropped)."""
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "kdsync.cli", *args], cwd=cwd,
                                stdout=subprocess.DEVNULL if stderr_only else log,
                                stderr=log if stderr_only else subprocess.STDOUT, env=env,
                                preexec_fn=die_with_parent, start_new_session=True)


def _stop(p: subprocess.Popen) -> int:
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return p.returncode


def _wait_global(bootstrap: str, topic: str, n: int) -> list:
    """Wait (40 s at most) for n records in the global topic `topic`; return them."""
    wait_until(lambda: len(read_global(bootstrap, topic)) == n, 40, f"{n} records in {topic}")
    return read_global(bootstrap, topic)


def _late_broker(tmp_path, port: int, p: subprocess.Popen, log, log_has: str, what: str, n: int, tag: str,
                 down_s: float = 0.0) -> list:
    """Member p runs while its broker (to be on `port`) is down: once p's log
    shows `log_has` (`what`), the broker starts (`down_s` later), n events are
    written to "in" and ordered into "in-global", p stops with exit 0.
    Returns in-global's records."""
    broker = EmbeddedCluster("late", port=port, log_dir=tmp_path)
    try:
        wait_until(lambda: log_has in log.read_text(), 30, what)
        assert p.poll() is None
        time.sleep(down_s)
        broker.start()
        ensure_topic(broker.bootstrap, "in")
        write_events(broker.bootstrap, "in", n, tag)
        got = _wait_global(broker.bootstrap, "in-global", n)
        assert _stop(p) == 0
        return got
    finally:
        _stop(p)
        broker.close()


def _derecho_cfg(path, extra: str = "") -> None:
    """A derecho.cfg of member 0, the leader, on a free GMS port."""
    gms = free_port()
    path.write_text(f"""[DERECHO]
leader_ip = 127.0.0.1
leader_gms_port = {gms}
local_id = 0
local_ip = 127.0.0.1
gms_port = {gms}
""" + extra)


def _run_legacy(tmp_path, name: str, args, tag: str, log, env=None) -> list:
    """A broker with 30 events in "test"; `kdsync *args(bootstrap)`, run in
    tmp_path, orders them into test-global and stops on SIGINT with exit 0.
    Returns test-global's records."""
    with EmbeddedCluster(name, log_dir=tmp_path) as c:
        ensure_topic(c.bootstrap, "test")
        write_events(c.bootstrap, "test", 30, tag)
        p = _spawn(args(c.bootstrap), tmp_path, log, env=env)
        try:
            got = _wait_global(c.bootstrap, "test-global", 30)
            p.send_signal(signal.SIGINT)
            assert p.wait(20) == 0
            return got
        finally:
            _stop(p)


def test_broker_down_at_start_is_retried(tmp_path):
    """The member starts before its broker, logs the retries, and works once
    the broker is up (a one-member group)."""
    port = free_port()
    cfg = solo_config(tmp_path / "m.toml", f"127.0.0.1:{port}", "in", """
        [protocol]
        tick_ms = 5
        """)
    first = tmp_path / "first.log"
    # SIGTERM while still waiting for the broker: a clean stop, no traceback
    p = _spawn(["run", "--config", str(cfg)], tmp_path, first)
    wait_until(lambda: "retrying" in first.read_text(), 30, "a retry to be logged")
    p.send_signal(signal.SIGTERM)
    assert p.wait(20) == 0, first.read_text()
    assert "Traceback" not in first.read_text()
    log = tmp_path / "member.log"
    p = _spawn(["run", "--config", str(cfg)], tmp_path, log)
    got = _late_broker(tmp_path, port, p, log, "retrying", "a retry to be logged", 50, "late")
    assert [r.seq for r in got] == list(range(50)) and [r.origin_offset for r in got] == list(range(50))


def test_original_positional_form_with_derecho_cfg(tmp_path):
    """`kdsync run 1 BROKERS TOPIC` with DERECHO_CONF_FILE: member m0, leader = itself."""
    _derecho_cfg(tmp_path / "my.cfg")
    got = _run_legacy(tmp_path, "legacy", lambda bootstrap: ["run", "1", bootstrap, "test"], "old", tmp_path / "m.log",
                      env={**os.environ, "DERECHO_CONF_FILE": str(tmp_path / "my.cfg")})
    assert {r.origin for r in got} == {"m0"} and [r.seq for r in got] == list(range(30))
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
        write_in_parallel([(g.bootstrap(i), t, 150, f"{t}-{i}") for i in g.data for t in ("orders", "payments")])
        for topic in ("orders-global", "payments-global"):
            deadline = time.monotonic() + 40
            while True:
                got = {g.names[i]: read_global(g.bootstrap(i), topic) for i in g.data}
                if all(len(v) >= 300 for v in got.values()) or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            ok, detail = check_global_topics(got, expected=300)
            assert ok, f"{topic}: {detail}"
            assert all(r.key.decode().startswith(topic.split("-")[0]) for r in got["dc1"])
        m = g.metrics(0)
        assert m[("kdsync_delivered_position", (("topic", "payments"),))] == 300
        lag = ("kdsync_input_lag", (("partition", "0"), ("topic", "orders")))
        assert lag in m
        # everything written is durably ordered and committed: the lag drains to 0
        wait_until(lambda: g.metrics(1).get(lag) == 0.0, 10, "input lag to reach 0")
    finally:
        g.close()


def test_a_topic_created_while_running_is_found_by_the_pattern_and_ordered(tmp_path):
    """Pattern discovery rides on the source consumer's metadata refresh (one
    listing, no AdminClient): a matching topic created after start is found
    within a refresh (5 s with few topics) and ordered in both clusters; a
    topic the pattern does not match is left alone."""
    g = LocalGroup(2, tmp_path, topic="orders", metrics=True, tick_ms=5, suspect_ms=300,
                   extra={"topics": {"source": {"allow": "^(orders|late-)"}}})
    try:
        g.start_brokers()
        g.start_members()
        g.wait_ready()
        for i in g.data:
            ensure_topic(g.bootstrap(i), "late-1")
            ensure_topic(g.bootstrap(i), "other")
        write_in_parallel([(g.bootstrap(i), "late-1", 60, f"late-{i}") for i in g.data])
        got = {g.names[i]: _wait_global(g.bootstrap(i), "late-1-global", 120) for i in g.data}
        ok, detail = check_global_topics(got, expected=120)
        assert ok, detail
        for i in g.data:
            assert re.search(r"topic ready.*topic=late-1\b", g.log_text(i)), g.log_text(i)[-2000:]
            assert "topic=other" not in g.log_text(i)
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
        write_in_parallel([(g.bootstrap(i), g.topic, 100, f"w{i}") for i in g.data])
        got = g.wait_for(200, 30)
        ok, detail = check_global_topics(got, expected=200)
        assert ok, detail
        assert not (tmp_path / "tansu-arb.log").exists()  # the witness has no cluster
        g.signal_member(1, signal.SIGKILL)
        g.wait_member(1)
        write_events(g.bootstrap(0), g.topic, 100, "after")
        got = g.wait_for(300, 30, members=[0])
        assert len(got["dc1"]) == 300, g.log_text(0)[-3000:]
        g.start_member(1)
        got = g.wait_for(300, 40)
        ok, detail = check_global_topics(got, expected=300)
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
        write_in_parallel([(g.bootstrap(i), g.topic, 150, f"b{i}") for i in (0, 1)])
        assert len(g.wait_for(350, 30, members=[0, 1])["dc1"]) == 350
        # the core trims its in-memory log when it delivers and the trimmed part is
        # durable: a few more single events after the 350 are durable push them out
        for i in range(5):
            write_events(g.bootstrap(0), g.topic, 1, f"c{i}")
            assert len(g.wait_for(351 + i, 30, members=[0, 1])["dc1"]) == 351 + i
        g.start_member(2)
        got = g.wait_for(355, 40)
        ok, detail = check_global_topics(got, expected=355)
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
        write_in_parallel([(g.bootstrap(i), g.topic, 200, f"k{i}") for i in g.data])

        def parts(i):
            return [[(m.key(), dict(m.headers())[H_SEQ]) for m in read_partition(g.bootstrap(i), g.global_topic, p)]
                    for p in range(3)]

        wait_until(lambda: all(sum(map(len, parts(i))) == 400 for i in g.data), 40, "400 records in each global topic")
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
    with EmbeddedCluster("foreign", log_dir=tmp_path) as c:
        ensure_topic(c.bootstrap, "src")
        ensure_topic(c.bootstrap, "src-global")
        write_events(c.bootstrap, "src-global", 1, "intruder")  # not written by kdsync
        last, stderr = refused_start(solo_config(tmp_path / "m.toml", c.bootstrap, "src"), timeout=60)
        assert last.startswith("kdsync run: src-global[0] offset 0 has no kdsync.seq header"), stderr


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
    port = free_port()
    cfg = solo_config(tmp_path / "m.toml", f"127.0.0.1:{port}", "in", """
        [log]
        format = "json"
        kafka_interval_ms = 2000
        """)
    log = tmp_path / "member.log"
    p = _spawn(["run", "--config", str(cfg)], tmp_path, log, stderr_only=True)
    _late_broker(tmp_path, port, p, log, "kdsync.kafka.client", "a librdkafka line", 20, "up",
                 down_s=5)  # the broker stays down this long
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
    _derecho_cfg(tmp_path / "derecho.cfg", """
[RDMA]
provider = sockets
""")
    env = {k: v for k, v in os.environ.items() if k != "DERECHO_CONF_FILE"}
    log = tmp_path / "m.log"
    got = _run_legacy(tmp_path, "orig", lambda bootstrap: ["1", bootstrap, "test"], "orig", log, env=env)
    assert [r.seq for r in got] == list(range(30))
    text = log.read_text()
    line = [x for x in text.splitlines() if "transport from derecho.cfg" in x]
    assert len(line) == 1 and "provider=sockets" in line[0] and "transport=tcp" in line[0], text
    assert f"file={tmp_path / 'derecho.cfg'} " in line[0], line


def test_prepare_topics_skips_reading_topics_that_never_held_a_record(tmp_path):
    """A member starting a thousand new topics reads none of them
    (issue 26): prepare_topics marks the source topics whose global and
    checkpoint topics never held a record, and their start (empty_start) is
    what load_start reads from them; a topic with a record is read."""
    from confluent_kafka import Producer

    from kdsync.config import config_from_dict
    from kdsync.kafka.reader import load_start
    from kdsync.member import Member
    from kdsync.pipeline import Prepared, empty_start, prepare_topics

    with EmbeddedCluster("new", log_dir=tmp_path) as c:
        cfg = config_from_dict({"member": {"id": "dc1", "listen": "127.0.0.1:1"}, "peers": {"dc1": "127.0.0.1:1"},
                                "kafka": {"bootstrap.servers": c.bootstrap},
                                "topics": {"source": {"allow": "^s"}, "global_partitions": 3}},
                               base_dir=str(tmp_path))
        conf = Member(cfg).kafka_conf
        first = prepare_topics(cfg, conf, ["s1", "s2"])
        assert first == {"s1": Prepared(3, True), "s2": Prepared(3, True)}
        assert empty_start("s1-global", 3, None) == load_start(conf, "s1-global", 3)
        assert empty_start("s1-global", 3, 1) == load_start(conf, "s1-global", 1, shard=1)
        p = Producer({"bootstrap.servers": c.bootstrap})
        p.produce("s2-global", key=b"k", value=b"v", partition=1, headers=global_headers(0, "dc1", 0, 0, 1))
        assert p.flush(10) == 0
        assert prepare_topics(cfg, conf, ["s1", "s2"]) == {"s1": Prepared(3, True), "s2": Prepared(3, False)}
