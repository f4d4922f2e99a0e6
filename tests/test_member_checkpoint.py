"""Checkpointed restarts with real Tansu brokers and real `kdsync run`
processes: a restart reads only what follows the checkpoint, a clean stop
leaves an exact one, a member started after an upgrade (no checkpoint topic)
scans and then checkpoints, a global topic whose oldest positions are gone
(with a checkpoint older than its first record) resumes after them, an
unprovable state is refused with one line, and three global partitions with
a kill -9.  Every group test checks agreement record by record.
"""

from __future__ import annotations

import json
import re
import signal
import threading

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from kdsync.testing.local import LocalGroup, check_global_topics, read_global
from kdsync.kafka.checkpoint import Checkpoint
from kdsync.kafka.embedded import EmbeddedCluster
from kdsync.kafka.records import read_global_headers
from kdsync.kafka.topic import ensure_topic, iter_partition, partition_count, read_partition

from helpers import (assert_agree, kill_9, kill_9_mid_stream, member_logs, refused_start, solo_config, wait_until,
                     write_all)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

CP_TOPIC = "events-global.kdsync"



def _last_seq(bootstrap: str) -> int:
    """The position of the latest checkpoint in the cluster (-1: none yet)."""
    cps = checkpoints(bootstrap)
    return cps[-1].seq if cps else -1

def checkpoints(bootstrap: str, topic: str = CP_TOPIC) -> list[Checkpoint]:
    return [Checkpoint.decode(m.value()) for m in read_partition(bootstrap, topic)]


def watermarks_of(records, below: int) -> dict[tuple[str, int], int]:
    """Origin watermarks of the global records at positions below `below`."""
    wm: dict[tuple[str, int], int] = {}
    for r in records:
        if r.seq < below:
            k = (r.origin, r.origin_partition)
            wm[k] = max(wm.get(k, -1), r.origin_offset)
    return wm


def ready_lines(g: LocalGroup, i: int) -> list[dict[str, str]]:
    """The fields of member i's "topic ready" log lines, in order."""
    out = []
    for line in g.log_text(i).splitlines():
        if 'msg="topic ready"' in line:
            out.append(dict(re.findall(r"(\w+)=(\S+)", line)))
    return out


def test_restart_reads_only_what_follows_the_checkpoint(tmp_path):
    g = LocalGroup(3, tmp_path, metrics=True, extra={"checkpoint": {"interval_ms": 300}})
    try:
        g.start_brokers()
        g.start_members()
        g.wait_ready()
        got = assert_agree(g, write_all(g, 200, "a"))
        # the checkpoints follow the durable position, with the watermarks of the positions below theirs
        wait_until(lambda: _last_seq(g.bootstrap(0)) == 600, 20, "a checkpoint at position 600")
        for cp in checkpoints(g.bootstrap(0)):
            assert cp.topic == "events-global" and cp.member == "dc1"
            assert cp.watermarks == watermarks_of(got["dc1"], cp.seq)
            assert cp.offsets[0] <= cp.seq and all(r.seq < cp.seq for r in got["dc1"][:cp.offsets[0]])
        # the metrics follow the confirmed checkpoint: its position, and when it was written
        wait_until(lambda: g.metrics(0).get(("kdsync_checkpoint_position", (("topic", "events"),))) == 600, 20,
                   "kdsync_checkpoint_position 600")
        written = g.metrics(0)[("kdsync_checkpoint_timestamp_seconds", (("topic", "events"),))]
        assert written == checkpoints(g.bootstrap(0))[-1].written_ms / 1000.0
        # a clean stop leaves an exact checkpoint: the next start reads the one record before its offset
        g.signal_member(0, signal.SIGTERM)
        assert g.wait_member(0) == 0, member_logs(g)
        last = checkpoints(g.bootstrap(0))[-1]
        assert (last.seq, last.offsets) == (600, (600,))
        g.start_member(0)
        g.wait_ready(members=[0])
        ready = ready_lines(g, 0)[-1]
        assert (ready["start_seq"], ready["checkpoint"], ready["records_read"]) == ("600", "600", "1"), ready
        # a restarted member reports the checkpoint it started from at once
        assert g.metrics(0)[("kdsync_checkpoint_position", (("topic", "events"),))] == 600
        # kill -9 mid-stream: the restart reads from the last checkpoint, not from position 0
        writers = kill_9_mid_stream(g, 1, 300, "k", 100.0, seen=900, timeout=30)
        g.start_member(1)
        g.wait_ready(members=[1], timeout=60)
        writers.join()
        assert_agree(g, 1500, timeout=90)
        assert len(ready_lines(g, 1)) == 2
        ready = ready_lines(g, 1)[-1]
        assert ready["checkpoint"] != "none" and int(ready["checkpoint"]) >= 600, ready
        assert int(ready["records_read"]) <= int(ready["start_seq"]) - 600 + 1, ready
    finally:
        g.close()


def test_upgrade_without_checkpoint_topic_starts_by_scanning(tmp_path):
    """A global topic written by a version without checkpoints: its member
    starts by reading it whole, then checkpoints."""
    g = LocalGroup(3, tmp_path, metrics=True)
    try:
        g.start_brokers()
        g.start_members()
        g.wait_ready()
        got = assert_agree(g, write_all(g, 100, "u"))
        g.signal_member(0, signal.SIGTERM)
        assert g.wait_member(0) == 0
        admin = AdminClient({"bootstrap.servers": g.bootstrap(0), "log_level": 0})
        admin.delete_topics([CP_TOPIC])[CP_TOPIC].result(10)
        wait_until(lambda: partition_count(g.bootstrap(0), CP_TOPIC) == 0, 10, "the checkpoint topic to be gone")
        g.start_member(0)
        g.wait_ready(members=[0])
        ready = ready_lines(g, 0)[-1]
        assert (ready["start_seq"], ready["checkpoint"], ready["records_read"]) == ("300", "none", "300"), ready
        # the start state is checkpointed at once
        wait_until(lambda: partition_count(g.bootstrap(0), CP_TOPIC) == 1 and checkpoints(g.bootstrap(0)), 20,
                   "a first checkpoint")
        cp = checkpoints(g.bootstrap(0))[-1]
        assert (cp.seq, cp.offsets, cp.watermarks) == (300, (300,), watermarks_of(got["dc1"], 300))
        assert_agree(g, 300 + write_all(g, 50, "u2"))
    finally:
        g.close()


def _global_messages(bootstrap: str, topic: str):
    return list(iter_partition(bootstrap, topic, 0))


def test_restart_after_retention_with_a_checkpoint_older_than_the_first_record(tmp_path):
    """The embedded broker cannot delete records, so the "truncated" global
    topic is built the way `kdsync restore` would rebuild it from an archive
    that starts past position 0: dc1 is killed (its last checkpoint is at
    position 300, its global topic holds 0..599), then dc1's `events-global`
    is deleted and created again holding only positions F..599 (key, value,
    headers and timestamp of each record as they were, at offsets 0..599-F),
    its checkpoint topic kept; F > 300 is picked so that every origin still
    has records from F on.  So the oldest F positions are gone and the
    checkpoint is older than the first record left, as after retention.  dc1 must resume at 600 with the right watermarks, warn once,
    and go on agreeing with the others position by position."""
    g = LocalGroup(3, tmp_path, metrics=True,
                   extra={"checkpoint": {"interval_ms": 3_600_000, "positions": 1_000_000_000}})
    try:
        g.start_brokers()
        g.start_members()
        g.wait_ready()
        assert_agree(g, write_all(g, 100, "r1"))
        g.signal_member(0, signal.SIGTERM)  # a clean stop: an exact checkpoint at 300
        assert g.wait_member(0) == 0
        g.start_member(0)
        g.wait_ready(members=[0])
        got = assert_agree(g, 300 + write_all(g, 100, "r2", rate=150.0))  # paced: the origins interleave
        kill_9(g, 0)  # no checkpoint at 600: the last one stays at 300
        assert checkpoints(g.bootstrap(0))[-1].seq == 300
        # rebuild dc1's global topic from position F on, as a restore from a later archive would
        first = min(max(r.seq for r in got["dc2"] if r.origin == o) for o in g.names)
        assert first >= 350, f"the origins did not interleave: one has no position after {first}"
        keep = [m for m in _global_messages(g.bootstrap(0), g.global_topic)
                if read_global_headers(m.headers()).seq >= first]
        assert len(keep) == 600 - first
        admin = AdminClient({"bootstrap.servers": g.bootstrap(0), "log_level": 0})
        admin.delete_topics([g.global_topic])[g.global_topic].result(10)
        wait_until(lambda: partition_count(g.bootstrap(0), g.global_topic) == 0, 10, "events-global to be gone")
        ensure_topic(g.bootstrap(0), g.global_topic)
        prod = Producer({"bootstrap.servers": g.bootstrap(0), "acks": "all", "enable.idempotence": True,
                         "log_level": 3})
        for m in keep:
            prod.produce(g.global_topic, key=m.key(), value=m.value(), headers=m.headers(), partition=0,
                         timestamp=m.timestamp()[1])
        assert prod.flush(30) == 0
        # every origin has records in F..599, so the watermarks are exact and checkable
        assert {r.origin for r in got["dc2"][first:600]} == set(g.names)
        g.start_member(0)
        g.wait_ready(members=[0])
        log0 = g.log_text(0)
        assert log0.count("before a checkpoint covered them") == 1 and f"lost=300..{first - 1}" in log0, (
            member_logs(g))
        ready = ready_lines(g, 0)[-1]
        assert (ready["start_seq"], ready["checkpoint"], ready["records_read"]) == ("600", "300", str(600 - first))
        # the start state dc1 checkpoints now: position 600 and exactly the other members' watermarks
        wait_until(lambda: _last_seq(g.bootstrap(0)) == 600, 20, "dc1's start checkpoint")
        cp = checkpoints(g.bootstrap(0))[-1]
        assert cp.offsets == (600 - first,) and cp.watermarks == watermarks_of(got["dc2"], 600)
        # and it goes on in step with the others: same event at every position, nothing twice
        write_all(g, 50, "r3")
        ok, detail = check_global_topics(g.wait_for(750, 60, members=[1, 2]), expected=750)
        assert ok, detail + member_logs(g)
        ref = read_global(g.bootstrap(1), g.global_topic)
        wait_until(lambda: len(read_global(g.bootstrap(0), g.global_topic)) == 750 - first, 60, "dc1 to hold F..749")
        mine = read_global(g.bootstrap(0), g.global_topic)
        assert [r.seq for r in mine] == [r.offset + first for r in mine] == list(range(first, 750))
        for r in mine:
            assert (r.event_id, r.key, r.value) == (ref[r.seq].event_id, ref[r.seq].key, ref[r.seq].value), r
        assert len({r.event_id for r in ref}) == 750
    finally:
        g.close()


def test_unprovable_start_is_refused_with_one_line(tmp_path):
    """A checkpoint that says 50 positions are durable next to an empty global
    topic (deleted and created again): exit 1, one line naming what to do."""
    with EmbeddedCluster("solo", log_dir=tmp_path) as c:
        ensure_topic(c.bootstrap, "x")
        ensure_topic(c.bootstrap, "x-global")
        ensure_topic(c.bootstrap, "x-global.kdsync")
        prod = Producer({"bootstrap.servers": c.bootstrap, "log_level": 3})
        prod.produce("x-global.kdsync", key=b"x-global",
                     value=Checkpoint("x-global", 50, (50,), {("solo", 0): 49}, "solo").encode())
        assert prod.flush(10) == 0
        last, stderr = refused_start(solo_config(tmp_path / "solo.toml", c.bootstrap, "x"), timeout=90)
        assert last == ("kdsync run: x-global.kdsync says positions below 50 are durable in x-global, but x-global "
                        "does not hold position 0 (was x-global deleted and created again? then delete "
                        "x-global.kdsync too, or restore x-global), see docs/operations.md"), stderr


def _all_partitions(bootstrap: str, topic: str, parts: int) -> dict[int, list[tuple]]:
    """partition -> [(kdsync.seq, event id, key)] in offset order."""
    out = {}
    for p in range(parts):
        recs = []
        for m in iter_partition(bootstrap, topic, p):
            h = read_global_headers(m.headers())
            recs.append((h.seq, (h.origin, h.origin_partition, h.origin_offset), m.key()))
        out[p] = recs
    return out


def test_three_global_partitions_kill_9_and_restart_from_checkpoint(tmp_path):
    parts = 3
    g = LocalGroup(3, tmp_path, metrics=True,
                   extra={"topics": {"global_partitions": parts}, "checkpoint": {"interval_ms": 300}})
    try:
        g.start_brokers()
        g.start_members()
        g.wait_ready()
        total = write_all(g, 150, "p1")

        def counts():
            return [sum(len(v) for v in _all_partitions(g.bootstrap(i), g.global_topic, parts).values())
                    for i in range(g.n)]

        wait_until(lambda: counts() == [total] * 3, 60, f"{total} records in every cluster", poll=0.3)
        wait_until(lambda: _last_seq(g.bootstrap(0)) == total, 20, "dc1's checkpoint to reach the end")
        cp = checkpoints(g.bootstrap(0))[-1]
        assert len(cp.offsets) == parts
        writers = threading.Thread(target=write_all, args=(g, 300, "p2", 200.0))
        writers.start()
        wait_until(lambda: counts()[0] > total + 150, 30, "dc1 to write more", poll=0.2)
        kill_9(g, 0)
        g.start_member(0)
        g.wait_ready(members=[0], timeout=60)
        writers.join()
        total += 900
        wait_until(lambda: counts() == [total] * 3, 90, f"{total} records in every cluster", poll=0.3)
        topics = [_all_partitions(g.bootstrap(i), g.global_topic, parts) for i in range(g.n)]
        for p in range(parts):
            assert topics[0][p] == topics[1][p] == topics[2][p], f"partition {p} differs"
            seqs = [s for s, _, _ in topics[0][p]]
            assert seqs == sorted(seqs)
        seqs = sorted(s for p in range(parts) for s, _, _ in topics[0][p])
        assert seqs == list(range(total))
        assert len({e for p in range(parts) for _, e, _ in topics[0][p]}) == total
        ready = ready_lines(g, 0)[-1]
        assert ready["checkpoint"] != "none" and int(ready["records_read"]) < int(ready["start_seq"]), ready
    finally:
        g.close()


def test_witness_has_no_checkpoint_and_members_do(tmp_path):
    """Two clusters and a witness: the witness (no Kafka) starts as before; the
    members' checkpoints carry the group's positions."""
    g = LocalGroup(3, tmp_path, metrics=True, witnesses={2}, extra={"checkpoint": {"interval_ms": 300}})
    try:
        g.start_brokers()
        g.start_members()
        g.wait_ready()
        got = g.wait_for(write_all(g, 100, "w", idx=[0, 1]), 40)
        ok, detail = check_global_topics(got, expected=200)
        assert ok, detail + member_logs(g)
        for i in (0, 1):
            wait_until(lambda i=i: _last_seq(g.bootstrap(i)) == 200, 20, f"{g.names[i]}'s checkpoint")
            assert checkpoints(g.bootstrap(i))[-1].watermarks == watermarks_of(got[g.names[i]], 200)
        assert "checkpoint" not in g.log_text(2).lower()
        g.signal_member(0, signal.SIGTERM)
        assert g.wait_member(0) == 0
        g.start_member(0)
        g.wait_ready(members=[0])
        assert ready_lines(g, 0)[-1]["records_read"] == "1"  # only the record before the checkpoint's offset
        write_all(g, 50, "w2", idx=[0, 1])
        ok, detail = check_global_topics(g.wait_for(300, 40), expected=300)
        assert ok, detail + member_logs(g)
    finally:
        g.close()


def test_checkpoint_topic_is_never_a_source_topic():
    from kdsync.config import TopicsSection

    t = TopicsSection(source={"allow": "^events"})
    assert t.matches("events") and t.matches("events-2")
    assert not t.matches("events-global") and not t.matches("events-global.kdsync")
    assert json.loads(Checkpoint("events-global", 1, (1,)).encode())["topic"] == "events-global"
