"""Shards ([topics] shards = K) and workers (kdsync run --workers W): config,
the per-shard checkpoint record, the worker assignment, and real processes
(embedded Tansu brokers, kdsync run --workers, kill -9 of a worker)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from kdsync.config import ConfigError, config_from_dict
from kdsync.kafka.checkpoint import Checkpoint, checkpoint_key
from kdsync.workers import assign_shards

BASE = {"member": {"id": "a", "listen": "127.0.0.1:7000"}, "peers": {"a": "127.0.0.1:7000", "b": "10.0.0.2:7100"},
        "kafka": {"bootstrap.servers": "127.0.0.1:9092"}}


def cfg(**topics):
    return config_from_dict({**BASE, "topics": {"source": "t", **topics}})


# ---------------------------------------------------------------- config
def test_default_is_one_shard():
    c = cfg()
    assert c.shards() == 1 and c.served_shards() == [0] and c.topics.partition_count() == 1


def test_shard_config_shifts_ports_and_state():
    c = cfg(shards=3)
    s2 = c.for_shard(2)
    assert s2.member.listen == "127.0.0.1:7002"
    assert s2.peer_addresses() == {"a": ("127.0.0.1", 7002), "b": ("10.0.0.2", 7102)}
    assert s2.state_path() == c.state_path() / "shard-2"
    assert s2.metrics.listen is None
    assert c.topics.partition_count() == 3 and c.served_shards() == [0, 1, 2]
    assert cfg(shards=4, serve_shards=[3, 1]).served_shards() == [1, 3]
    assert cfg(shards=4, global_partitions=4).topics.partition_count() == 4


@pytest.mark.parametrize("topics, msg", [
    ({"shards": 0}, "topics.shards: Input should be greater than or equal to 1"),
    ({"shards": 2, "serve_shards": [2]}, "topics.serve_shards: 2 is not a shard in 0..1"),
    ({"shards": 2, "serve_shards": []}, "topics.serve_shards: empty list"),
    ({"shards": 2, "serve_shards": [1, 1]}, "topics.serve_shards: names a shard twice"),
    ({"serve_shards": [1]}, "topics.serve_shards: 1 is not a shard in 0..0"),
    ({"shards": 2, "global_partitions": 3}, "topics.global_partitions: with shards = 2"),
])
def test_bad_shard_config_is_one_line(topics, msg):
    with pytest.raises(ConfigError) as e:
        cfg(**topics)
    assert str(e.value).startswith("config error: " + msg)
    assert "\n" not in str(e.value)


def test_port_block_beyond_65535_is_refused():
    with pytest.raises(ConfigError, match=r"peers.b: port \+ shards - 1 is beyond 65535"):
        config_from_dict({**BASE, "peers": {"a": "127.0.0.1:7000", "b": "h:65535"},
                          "topics": {"source": "t", "shards": 2}})


def test_assign_shards():
    assert assign_shards([0, 1, 2, 3], 2) == [[0, 2], [1, 3]]
    assert assign_shards([1, 3], 4) == [[1], [3]]
    assert assign_shards([0, 1, 2], 1) == [[0, 1, 2]]


# ---------------------------------------------------------------- checkpoint record
def test_checkpoint_of_a_shard_has_its_key_and_field():
    cp = Checkpoint("t-global", 10, (7,), {("dc1", 1): 4}, "dc1", 5, shard=1)
    assert Checkpoint.decode(cp.encode()) == cp
    assert checkpoint_key("t-global", 1) == b"t-global/1"
    one = Checkpoint("t-global", 10, (7,), {}, "dc1", 5)
    assert b'"shard"' not in one.encode()  # shards = 1: the record as before
    assert checkpoint_key("t-global") == b"t-global"
    assert Checkpoint.decode(one.encode()).shard is None


# ---------------------------------------------------------------- the supervisor
def _witness_config(tmp_path, port: int, shards: int = 2) -> str:
    p = tmp_path / "w.toml"
    p.write_text(f'state_dir = "{tmp_path / "state"}"\n[member]\nid = "w"\nlisten = "127.0.0.1:{port}"\n'
                 f'role = "witness"\n[peers]\nw = "127.0.0.1:{port}"\nx = "127.0.0.1:{port + 10}"\n'
                 f'[topics]\nsource = "t"\nshards = {shards}\n[protocol]\ntick_ms = 10\n')
    return str(p)


def test_supervisor_gives_up_on_a_worker_that_keeps_dying(tmp_path, monkeypatch):
    """Shard 1's port is taken: its worker dies at every start; the
    supervisor restarts it with backoff, then exits 1 with one line."""
    from kdsync.testing.local import free_port_block

    port = free_port_block(2)
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", port + 1))
    blocker.listen()
    try:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "kdsync.cli", "run", "--config", _witness_config(tmp_path, port),
                            "--workers", "2"], capture_output=True, text=True, timeout=120, env=env)
    finally:
        blocker.close()
    assert r.returncode == 1, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("kdsync run: worker 1 (shards 1) died 5 times within 60 s"), last
    assert r.stderr.count("worker died; restarting it") == 4
    assert time.monotonic() - t0 > 0.5 + 1 + 2 + 4  # the backoff between restarts


@pytest.mark.parametrize("shards", [2, 1])
def test_supervisor_stops_workers_on_sigterm(tmp_path, shards):
    """Two witness shards in two workers (or, with shards = 1, the one member
    in one worker): SIGTERM to `kdsync run --workers 2` stops every worker
    cleanly, exit 0."""
    from kdsync.testing.local import free_port_block

    port = free_port_block(2)
    log = tmp_path / "log"
    with open(log, "wb") as f:
        p = subprocess.Popen([sys.executable, "-m", "kdsync.cli", "run", "--config",
                              _witness_config(tmp_path, port, shards), "--workers", "2"], stdout=f,
                             stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        deadline = time.monotonic() + 30
        while log.read_text().count("member started") < shards:  # every shard's member is up
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            assert p.poll() is None, log.read_text()[-2000:]
            time.sleep(0.05)
        text = log.read_text()
        assert ("shard=0" in text and "shard=1" in text) == (shards == 2)
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0, log.read_text()[-2000:]
    finally:
        if p.poll() is None:
            p.kill()
    text = log.read_text()
    assert text.count("msg=\"member stopped\" clean=True") == shards
    assert "msg=\"supervisor stopped\" clean=True signal=SIGTERM" in text


# ---------------------------------------------------------------- real clusters
@pytest.mark.parametrize("broker", ["tansu", "noida"])
def test_two_shards_two_workers_kill9_a_worker(tmp_path, broker):
    """3 clusters, 2 shards in 2 workers each, 4 source partitions; events
    stream into every cluster while one worker of dc2 is killed with SIGKILL;
    its supervisor restarts it.  Then every partition of the global topic is
    identical in every cluster, every source event is there exactly once, in
    its shard's partition and in source-partition order."""
    from kdsync.testing.local import LocalGroup, check_sharded, write_events

    per, n = 1500, 3
    trace = tmp_path / "trace.jsonl"
    with LocalGroup(n, tmp_path, shards=2, workers=2, source_partitions=4, metrics=True, broker=broker) as g:
        g.member_args[0] = ["--trace-latency", str(trace)]  # dc1's workers trace (dc2's is the one killed)
        g.start_brokers()
        g.start_members()
        g.wait_ready(timeout=120)
        errors: list = []

        def writer(i: int) -> None:
            try:
                write_events(g.bootstrap(i), g.topic, per, f"c{i}", rate=400)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=writer, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        # mid-stream: once dc2's global topic holds some of the events
        got = g.wait_for_partitions(300, 60)
        assert sum(map(len, got["dc2"])) >= 300
        pids = g.worker_pids(1)
        assert len(pids) == 2
        victim = pids[0]
        argv = open(f"/proc/{victim}/cmdline", "rb").read().split(b"\0")
        index = argv[argv.index(b"--worker") + 1].decode()
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:  # the supervisor restarts it (a new pid) and counts it
            now = g.worker_pids(1)
            m = g.metrics(1)
            if (len(now) == 2 and victim not in now
                    and m.get(("kdsync_worker_restarts_total", (("worker", index),))) == 1.0):
                break
            assert time.monotonic() < deadline, g.log_text(1)[-3000:]
            time.sleep(0.1)
        for t in threads:
            t.join()
        assert not errors, errors
        total = per * n
        got = g.wait_for_partitions(total, 180)
        ok, detail = check_sharded(got, expected=total)
        assert ok, detail
        assert all(len(p) > 0 for v in got.values() for p in v)  # both shards carried events
        assert "worker died; restarting it" in g.log_text(1)
        g.wait_ready(timeout=60)  # the restarted worker's shards are active again
        for i in range(n):
            assert g.stop_member(i, timeout=60) == 0, g.log_text(i)[-3000:]
    _assert_shard_traces(trace, got["dc1"])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sharded_group_in_one_process_audit_and_translate(tmp_path, capsys):
    """3 clusters, 2 shards run in the `kdsync run` process itself (no
    --workers): the global topics agree partition by partition; `kdsync
    audit --shards 2` audits each partition as its own run and finds every
    invariant holding;
    `kdsync offsets translate --shards 2` finds events in partition P mod 2."""
    import json

    from kdsync.testing.local import LocalGroup
    from kdsync.kafka.offsets import parse_cluster, translate

    per, n = 150, 3
    trace = tmp_path / "trace.jsonl"
    with LocalGroup(n, tmp_path, shards=2, source_partitions=4, metrics=True) as g:
        g.member_args[1] = ["--trace-latency", str(trace)]
        g.start_brokers()
        g.start_members()
        g.wait_ready(timeout=120)
        got = _write_each_and_agree(g, per, "c", per * n)
        # translate: with --shards, and without (the key's partition first, then the others)
        c2 = parse_cluster(f"dc2={g.bootstrap(1)}")
        for s in (0, 1):
            for r in got["dc2"][s][-1:]:
                for shards in (2, 1):
                    loc = translate(c2, g.topic, r.origin_partition, r.origin_offset, r.origin, shards=shards)
                    assert loc.found and (loc.record.partition, loc.record.offset) == (s, r.offset), (shards, r)
        from kdsync.spark.audit import main

        argv = [a for i in range(n) for a in ("--cluster", f"{g.names[i]}={g.bootstrap(i)}")]
        argv += ["--topic", g.topic, "--master", "local[2]"]
        capsys.readouterr()
        code = main(argv + ["--shards", "2"])
        report = json.loads(capsys.readouterr().out)
        assert code == 0 and report["ok"] is True, report
        runs = {r["run_id"]: r for r in report["runs"]}
        assert set(runs) == {f"{g.topic}/0", f"{g.topic}/1"}
        assert sum(r["events_submitted"] for r in runs.values()) == per * n
        for i in range(n):
            assert g.stop_member(i, timeout=60) == 0, g.log_text(i)[-3000:]
    _assert_shard_traces(trace, got["dc2"])


def _write_each_and_agree(g, per: int, tag: str, total: int, timeout: float = 120) -> dict:
    """`per` events into every cluster's source topic (keys tag<i>-...), then
    wait until the global topics hold `total` and check them partition by
    partition (check_sharded); returns what they hold."""
    from kdsync.testing.local import check_sharded, write_events

    for i in range(g.n):
        write_events(g.bootstrap(i), g.topic, per, f"{tag}{i}")
    got = g.wait_for_partitions(total, timeout)
    ok, detail = check_sharded(got, expected=total)
    assert ok, detail + "\n" + g.log_text(0)[-3000:]
    return got


def _assert_shard_traces(trace, parts) -> None:
    """--trace-latency with shards: shard S's rows in FILE.shard-S, each with
    `shard` = S, covering partition S of the global topic record for record."""
    import json

    assert not trace.exists()  # no file without a shard suffix
    for s, records in enumerate(parts):
        rows = [json.loads(line) for line in open(f"{trace}.shard-{s}")]
        assert {r["shard"] for r in rows} == {s}
        assert sum(r["count"] for r in rows) == len(records)
        at = {r.offset: r for r in records}
        for r in rows:
            first = at[r["seq"]]
            assert (first.origin, first.origin_partition, first.origin_offset) == (
                r["origin"], r["partition"], r["first_offset"])
            assert r["partition"] % 2 == s  # source partition p is ordered by shard p mod K


def test_existing_global_topic_with_fewer_partitions_is_refused(tmp_path):
    """shards = 2 against a global topic created with one partition: one line
    naming the key; with enough partitions it is taken as is."""
    from kdsync.fatal import FatalError
    from kdsync.kafka.embedded import EmbeddedCluster
    from kdsync.kafka.sink import ensure_global
    from kdsync.kafka.topic import ensure_topic

    with EmbeddedCluster("shards", log_dir=tmp_path) as c:
        conf = {"bootstrap.servers": c.bootstrap}
        ensure_topic(c.bootstrap, "old-global", 1)
        with pytest.raises(FatalError) as e:
            ensure_global(conf, "old-global", 2, shards=2)
        assert str(e.value).startswith("topics.shards = 2 but old-global already has 1 partitions")
        assert ensure_global(conf, "new-global", 2, shards=2) == 2  # created with one partition per shard
        assert ensure_global(conf, "new-global", 2, shards=2) == 2


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_serve_shards_spread_over_two_hosts(tmp_path):
    """Each cluster runs shard 0 in one `kdsync run` ("host a", its own
    ports) and shard 1 in another ("host b", other ports, state and metrics),
    chosen by [topics] serve_shards: together they order every partition,
    identical in every cluster."""
    from kdsync.testing.local import LocalGroup, free_port_block

    per, n = 200, 3
    with LocalGroup(n, tmp_path, shards=2, source_partitions=4, metrics=True,
                    extra={"topics": {"serve_shards": [0]}}) as g:
        g.start_brokers()
        g.start_members()  # host a of every cluster: shard 0
        b_ports = [free_port_block(2) for _ in range(n)]
        b_metrics = [free_port_block(1) for _ in range(n)]
        b_procs = []
        try:
            for i in range(n):  # host b: the same config with its own ports, state and metrics; shard 1
                text = g.config_text(i, topics={"serve_shards": [1]})
                for j in range(n):
                    text = text.replace(f"127.0.0.1:{g.ports[j]}\"", f"127.0.0.1:{b_ports[j]}\"")
                text = text.replace(f"127.0.0.1:{g.metrics_ports[i]}\"", f"127.0.0.1:{b_metrics[i]}\"")
                text = text.replace(str(tmp_path / f"state-{g.names[i]}"), str(tmp_path / f"state-b-{g.names[i]}"))
                path = tmp_path / f"b-{g.names[i]}.toml"
                path.write_text(text)
                with open(tmp_path / f"b-{g.names[i]}.log", "wb") as log:
                    b_procs.append(subprocess.Popen([sys.executable, "-m", "kdsync.cli", "run", "--config", str(path)],
                                                    stdout=log, stderr=subprocess.STDOUT,
                                                    env=dict(os.environ, PYTHONUNBUFFERED="1")))
            got = _write_each_and_agree(g, per, "c", per * n, timeout=180)
            assert all(len(p) > 0 for v in got.values() for p in v)
            a_log = g.log_text(0)
            assert "shard=0" in a_log and "shard=1" not in a_log
        finally:
            for p in b_procs:
                p.terminate()
            for p in b_procs:
                try:
                    assert p.wait(60) == 0
                except subprocess.TimeoutExpired:
                    p.kill()
                    raise


def test_shard_metrics_label_every_sample_with_its_shard():
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest

    from kdsync.observability.metrics import MemberMetrics
    from kdsync.workers import ShardMetrics

    ms = {s: SimpleNamespace(metrics=MemberMetrics()) for s in (0, 3)}
    ms[0].metrics.set_status("t", "active")
    ms[3].metrics.set_status("t", "wedged")
    ms[3].metrics.consumed.labels("t").inc(5)
    reg = CollectorRegistry()
    reg.register(ShardMetrics({**ms, 1: SimpleNamespace(metrics=None)}))  # shard 1 not started yet
    text = generate_latest(reg).decode()
    assert 'kdsync_status{shard="0",status="active",topic="t"} 1.0' in text
    assert 'kdsync_status{shard="3",status="wedged",topic="t"} 1.0' in text
    assert 'kdsync_events_consumed_total{shard="3",topic="t"} 5.0' in text
    assert text.count("# TYPE kdsync_status gauge") == 1  # one family, samples of every shard


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sharded_global_topic_archived_restored_and_resumed(tmp_path, capsys):
    """Disaster recovery of one cluster's ordered log with 2 shards: dc1's
    global topic (one partition per shard) is archived with `kdsync archive`;
    dc1's member stops; the cluster loses its global topic and its checkpoint
    topic (both deleted) and `kdsync restore` rebuilds the global topic from
    the archive, every record at its offset in its partition.  dc1's member
    starts again with no checkpoint (each shard reads its own partition back)
    and goes on: after more events in every cluster, every partition is
    identical in every cluster and every source event is there exactly once,
    in its shard's partition and in source-partition order."""
    import json

    from confluent_kafka.admin import AdminClient

    from kdsync.testing.local import LocalGroup
    from kdsync.kafka.checkpoint import checkpoint_topic
    from kdsync.kafka.topic import partition_count
    from kdsync.spark.archive import main_archive, main_restore

    per, n = 120, 3
    root = str(tmp_path / "archive")
    with LocalGroup(n, tmp_path, shards=2, source_partitions=4, metrics=True) as g:
        g.start_brokers()
        g.start_members()
        g.wait_ready(timeout=120)
        got = _write_each_and_agree(g, per, "a", per * n)
        assert g.stop_member(0, timeout=60) == 0, g.log_text(0)[-3000:]
        before = got["dc1"]

        capsys.readouterr()
        dc1 = ["--cluster", f"dc1={g.bootstrap(0)}", "--topic", g.global_topic, "--path", root, "--master", "local[2]"]
        assert main_archive(dc1 + ["--flush"]) == 0, capsys.readouterr().err
        out = json.loads(capsys.readouterr().out)
        assert out["records_archived"] == per * n and set(out["checkpoint"]) == {"0", "1"}

        gone = [g.global_topic, checkpoint_topic(g.global_topic)]
        admin = AdminClient({"bootstrap.servers": g.bootstrap(0), "log_level": 0})
        for f in admin.delete_topics(gone).values():
            f.result(10)
        deadline = time.monotonic() + 20
        while any(partition_count(g.bootstrap(0), t) for t in gone):
            assert time.monotonic() < deadline, "the deleted topics are still there"
            time.sleep(0.1)

        assert main_restore(dc1) == 0, capsys.readouterr().err
        out = json.loads(capsys.readouterr().out)
        assert out["records"] == per * n and out["positions_preserved"] == {"0": True, "1": True}

        g.start_member(0)
        g.wait_ready(timeout=120)
        got = _write_each_and_agree(g, per, "b", 2 * per * n)
        for s in (0, 1):  # the restored prefix is what dc1 held before, record for record
            assert got["dc1"][s][:len(before[s])] == before[s]
        assert "no checkpoint" in g.log_text(0) or "checkpoint=none" in g.log_text(0)
        for i in range(n):
            assert g.stop_member(i, timeout=60) == 0, g.log_text(i)[-3000:]
