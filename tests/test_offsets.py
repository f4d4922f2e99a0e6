"""`kdsync offsets` with real brokers (Tansu and noida-db) and real `kdsync run` members.

A consumer group reads part of `T-global` in one cluster and commits; `kdsync
offsets sync` copies its offsets; a consumer of the same group in another
cluster then resumes at exactly the next event: every event is read once
across the two clusters, nothing skipped, nothing twice.  Also: several global
partitions, the refusals (target group active, target behind) and `--follow`
waiting for a member that catches up, and `translate` found / not found.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from confluent_kafka import Consumer, KafkaError, TopicPartition

from kdsync.testing.local import LocalGroup, write_events
from kdsync.kafka.embedded import die_with_parent
from kdsync.kafka.offsets import ClusterRef, parse_cluster, sync_offsets, translate

pytestmark = [pytest.mark.slow]


def _cli(*args, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kdsync.cli", "offsets", *args], capture_output=True, text=True,
                          timeout=timeout)


def _event(m) -> tuple[str, int, int]:
    h = dict(m.headers())
    return (h["kdsync.origin"].decode(), int(h["kdsync.origin.partition"]), int(h["kdsync.origin.offset"]))


def consume_group(bootstrap: str, topic: str, group: str, partitions: int, limit: int | None = None,
                  timeout: float = 60.0) -> list[tuple[int, int, tuple]]:
    """A real group consumer (subscribe): read `limit` records, or until every
    partition is at its end; commit exactly what was read; leave the group.
    Returns [(partition, offset, event id)] in the order read."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "auto.offset.reset": "earliest",
                  "enable.auto.commit": False, "enable.partition.eof": True, "log_level": 0,
                  "session.timeout.ms": 6000, "fetch.wait.max.ms": 10})
    c.subscribe([topic])
    out, at_end = [], set()
    deadline = time.monotonic() + timeout
    try:
        while limit is None or len(out) < limit:
            assert time.monotonic() < deadline, f"group {group} read {len(out)} records of {topic} in {timeout}s"
            m = c.poll(0.2)
            if m is None:
                continue
            if m.error() is not None:
                assert m.error().code() == KafkaError._PARTITION_EOF, m.error().str()
                at_end.add(m.partition())
                if limit is None and len(at_end) == partitions:
                    break
                continue
            at_end.discard(m.partition())
            out.append((m.partition(), m.offset(), _event(m)))
        last: dict[int, int] = {}
        for p, off, _ in out:
            last[p] = off + 1
        if last:
            c.commit(offsets=[TopicPartition(topic, p, o) for p, o in sorted(last.items())], asynchronous=False)
    finally:
        c.close()
    return out


def all_records(bootstrap: str, topic: str, partitions: int) -> dict[tuple, tuple[int, int, int]]:
    """event id -> (partition, offset, kdsync.seq) of every record of a global topic."""
    from kdsync.kafka.topic import iter_partition

    out = {}
    for p in range(partitions):
        for m in iter_partition(bootstrap, topic, p):
            out[_event(m)] = (p, m.offset(), int(dict(m.headers())["kdsync.seq"]))
    return out


def _write(g: LocalGroup, n: int, tag: str, idx) -> None:
    ts = [threading.Thread(target=write_events, args=(g.bootstrap(i), g.topic, n, f"{tag}-{g.names[i]}")) for i in idx]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def _ref(g: LocalGroup, i: int) -> str:
    return f"{g.names[i]}={g.bootstrap(i)}"


def _assert_resumes_exactly(before, after, everything, committed: dict[int, int]):
    """`after` starts at the committed offset of every partition and reads each
    remaining record once; before + after is every event once."""
    ids_before = [e for _, _, e in before]
    ids_after = [e for _, _, e in after]
    assert len(set(ids_after)) == len(ids_after), "a record was read twice in the target cluster"
    assert not set(ids_before) & set(ids_after), "events read before the fail-over were read again"
    assert set(ids_before) | set(ids_after) == set(everything), "events were skipped by the fail-over"
    for p in {p for p, _, _ in after}:
        offs = [o for q, o, _ in after if q == p]
        assert offs[0] == committed.get(p, 0), (p, offs[0], committed)
        assert offs == list(range(offs[0], offs[0] + len(offs))), f"gap in partition {p}"


# ---------------------------------------------------------------- no brokers
def test_parse_cluster_and_usage_errors_are_one_line():
    assert parse_cluster("dc1=127.0.0.1:9092,h:1") == ClusterRef("dc1", "127.0.0.1:9092,h:1")
    for bad in ("dc1", "=h:1", "dc1=h", "dc1=h:99999", "d c=h:1"):
        with pytest.raises(ValueError):
            parse_cluster(bad)
    r = _cli("sync", "--group", "g", "--topic", "t", "--from", "dc1", "--to", "dc2=h:1")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "--from" in r.stderr and "NAME=BROKERS" in r.stderr
    r = _cli("translate", "--topic", "t", "--cluster", "a=h:1", "--source-partition", "0")
    assert r.returncode == 2 and "--source-offset" in r.stderr and r.stderr.strip().count("\n") == 0
    r = _cli("sync", "--group", "g", "--topic", "t", "--from", "a=127.0.0.1:1", "--to", "a=127.0.0.1:1")
    assert r.returncode == 2 and "same cluster" in r.stderr
    r = _cli("sync", "--group", "g", "--topic", "t", "--from", "a=127.0.0.1:1", "--to", "b=127.0.0.1:2",
             "--timeout", "1")
    assert r.returncode == 1 and r.stderr.startswith("kdsync offsets: cannot reach a at 127.0.0.1:1"), r.stderr
    assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr


# ---------------------------------------------------------------- one global partition, three members
@pytest.mark.timeout(300)
@pytest.mark.parametrize("broker", ["tansu", "noida"])
def test_failover_resumes_at_the_next_event_and_follow_waits_for_a_lagging_member(tmp_path, broker):
    g = LocalGroup(3, tmp_path, topic="events", metrics=True, tick_ms=5, heartbeat_ms=20, suspect_ms=300,
                   broker=broker)
    try:
        g.start_brokers()
        g.start_members()
        g.wait_ready()
        _write(g, 100, "a", range(3))
        got = g.wait_for(300, 60)
        assert all(len(v) == 300 for v in got.values()), {k: len(v) for k, v in got.items()}

        # dc3's member stops; dc1 and dc2 go on ordering without it, so dc3's T-global falls behind
        assert g.stop_member(2) == 0
        _write(g, 100, "b", range(2))
        got = g.wait_for(500, 60, members=[0, 1])
        assert all(len(v) == 500 for v in got.values()), {k: len(v) for k, v in got.items()}
        everything = all_records(g.bootstrap(0), g.global_topic, 1)
        assert len(everything) == 500

        before = consume_group(g.bootstrap(0), g.global_topic, "app", 1, limit=400)
        assert [o for _, o, _ in before] == list(range(400))

        # dc2 is up to date: the group moves there and resumes at offset 400
        r = _cli("sync", "--group", "app", "--topic", "events", "--from", _ref(g, 0), "--to", _ref(g, 1))
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["offsets"] == {"0": 400} and out["previous"] == {"0": None} and out["changed"] is True
        after = consume_group(g.bootstrap(1), g.global_topic, "app", 1)
        _assert_resumes_exactly(before, after, everything, {0: 400})
        assert [e for _, _, e in after] == [e for e, _ in sorted(everything.items(), key=lambda kv: kv[1][1])][400:]

        # dc3 is behind (300 records, the group is at 400): refused with one line, nothing committed
        r = _cli("sync", "--group", "app", "--topic", "events", "--from", _ref(g, 0), "--to", _ref(g, 2))
        assert r.returncode == 1, r.stdout + r.stderr
        assert r.stderr.startswith("kdsync offsets: dc3 is behind: events-global[0] has no record at offset 399")
        assert r.stderr.strip().count("\n") == 0

        # --follow reports the refusal, keeps trying, and syncs once dc3's member has caught up
        follow = subprocess.Popen(
            [sys.executable, "-m", "kdsync.cli", "offsets", "sync", "--group", "app", "--topic", "events",
             "--from", _ref(g, 0), "--to", _ref(g, 2), "--follow", "--interval", "0.3"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=die_with_parent,
            env=dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            first_err = follow.stderr.readline()
            assert "dc3 is behind" in first_err and "retrying every 0.3s" in first_err, first_err
            g.start_member(2)
            line = follow.stdout.readline()  # blocks until a sync succeeded
            assert json.loads(line)["offsets"] == {"0": 400}, line
        finally:
            follow.send_signal(signal.SIGTERM)
            rest_out, rest_err = follow.communicate(timeout=30)
        assert follow.returncode == 0, rest_err
        assert "Traceback" not in rest_err
        after3 = consume_group(g.bootstrap(2), g.global_topic, "app-dc3-check", 1)  # another group: dc3 complete
        assert len(after3) == 500
        after = consume_group(g.bootstrap(2), g.global_topic, "app", 1)
        _assert_resumes_exactly(before, after, everything, {0: 400})

        # translate: one partition, binary search; the answer is the record itself
        bound = 2 * math.ceil(math.log2(500)) + 4
        for origin, off in (("dc1", 0), ("dc2", 57), ("dc3", 99), ("dc1", 199)):
            loc = translate(ClusterRef("dc2", g.bootstrap(1)), "events", 0, off, origin=origin)
            p, o, seq = everything[(origin, 0, off)]
            assert loc.found and (loc.record.partition, loc.record.offset, loc.record.seq) == (p, o, seq)
            assert loc.probes <= bound, (loc.probes, bound)
        r = _cli("translate", "--topic", "events", "--cluster", _ref(g, 2), "--source-partition", "0",
                 "--source-offset", "150", "--origin", "dc2")
        assert r.returncode == 0, r.stderr
        ans = json.loads(r.stdout)
        assert (ans["found"], ans["partition"], ans["offset"], ans["seq"]) == (True, *everything[("dc2", 0, 150)])
        # dc3 wrote 100 events: offset 100 of its source is not (yet) in any global topic
        r = _cli("translate", "--topic", "events", "--cluster", _ref(g, 2), "--source-partition", "0",
                 "--source-offset", "100")
        assert r.returncode == 1 and json.loads(r.stdout)["found"] is False, r.stdout + r.stderr
        assert json.loads(r.stdout)["reason"] == "not yet in events-global"
        r = _cli("translate", "--topic", "nosuch", "--cluster", _ref(g, 2), "--source-partition", "0",
                 "--source-offset", "1")
        assert r.returncode == 2 and "has no topic nosuch-global" in r.stderr
    finally:
        g.close()


# ---------------------------------------------------------------- several global partitions
@pytest.mark.timeout(240)
def test_failover_with_three_global_partitions_and_active_target_refused(tmp_path):
    # on noida (29 s there, 150 s on Tansu's slow group commits): the fail-over itself runs on both brokers above
    parts = 3
    g = LocalGroup(2, tmp_path, topic="events", metrics=True, tick_ms=5, heartbeat_ms=20, suspect_ms=300,
                   extra={"topics": {"global_partitions": parts}}, broker="noida")
    try:
        g.start_brokers()
        g.start_members()
        g.wait_ready()
        _write(g, 200, "k", range(2))
        deadline = time.monotonic() + 60
        while True:
            everything = all_records(g.bootstrap(0), g.global_topic, parts)
            other = all_records(g.bootstrap(1), g.global_topic, parts)
            if len(everything) == len(other) == 400:
                break
            assert time.monotonic() < deadline, (len(everything), len(other))
            time.sleep(0.2)
        assert everything == other  # same partition, offset and seq everywhere
        assert all(sum(1 for p, _, _ in everything.values() if p == q) > 50 for q in range(parts))

        before = consume_group(g.bootstrap(0), g.global_topic, "app", parts, limit=170)
        committed: dict[int, int] = {}
        for p, off, _ in before:
            committed[p] = off + 1

        # a consumer of the group is running in dc2: refused, nothing committed there
        c = Consumer({"bootstrap.servers": g.bootstrap(1), "group.id": "app", "enable.auto.commit": False,
                      "auto.offset.reset": "earliest", "log_level": 0})
        c.subscribe([g.global_topic])
        try:
            deadline = time.monotonic() + 30
            while not c.assignment():
                assert time.monotonic() < deadline, "no assignment in dc2"
                c.poll(0.2)
            with pytest.raises(Exception) as e:
                sync_offsets(ClusterRef("dc1", g.bootstrap(0)), ClusterRef("dc2", g.bootstrap(1)), "app", "events")
            assert "group app is active in dc2" in str(e.value) and "stop its consumers there first" in str(e.value)
            r = _cli("sync", "--group", "app", "--topic", "events", "--from", _ref(g, 0), "--to", _ref(g, 1))
            assert r.returncode == 1 and "group app is active in dc2" in r.stderr and r.stdout == "", r.stderr
        finally:
            c.close()

        res = sync_offsets(ClusterRef("dc1", g.bootstrap(0)), ClusterRef("dc2", g.bootstrap(1)), "app", "events")
        assert res.offsets == committed and res.changed
        assert res.without_commit == [p for p in range(parts) if p not in committed]
        again = sync_offsets(ClusterRef("dc1", g.bootstrap(0)), ClusterRef("dc2", g.bootstrap(1)), "app", "events")
        assert not again.changed and again.previous == committed
        after = consume_group(g.bootstrap(1), g.global_topic, "app", parts)
        _assert_resumes_exactly(before, after, everything, committed)

        # translate across partitions: by the source key when the cluster is the origin, else every partition
        for cluster, origin, off in ((0, "dc1", 5), (0, "dc1", 150), (1, "dc1", 77), (0, "dc2", 199)):
            loc = translate(ClusterRef(g.names[cluster], g.bootstrap(cluster)), "events", 0, off, origin=origin)
            assert loc.found, loc
            assert (loc.record.partition, loc.record.offset, loc.record.seq) == everything[(origin, 0, off)]
        loc = translate(ClusterRef("dc1", g.bootstrap(0)), "events", 0, 200)
        assert not loc.found and loc.reason == "not yet in events-global"
    finally:
        g.close()
