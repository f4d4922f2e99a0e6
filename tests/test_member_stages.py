"""The latency budget of a real member: `kdsync run --trace-latency FILE` and
the `kdsync_stage_seconds` histogram, on three embedded clusters with one
member each (real processes, real records)."""

from __future__ import annotations

import json
import signal
import threading

import pytest

from kdsync.testing.local import LocalGroup, check_global_topics, write_events

pytestmark = pytest.mark.timeout(240)

PER = 300  # events written into each cluster


def test_trace_and_stage_histograms_account_for_every_record(tmp_path):
    trace = tmp_path / "trace.jsonl"
    g = LocalGroup(3, tmp_path, topic="events", protocol="derecho", metrics=True, tick_ms=5, heartbeat_ms=20,
                   suspect_ms=300, retransmit_ms=30)
    g.member_args[0] = ["--trace-latency", str(trace)]
    try:
        g.start_brokers()
        g.start_members()
        g.wait_ready(timeout=60)
        threads = [threading.Thread(target=write_events, args=(g.bootstrap(i), g.topic, PER, g.names[i]),
                                    kwargs={"rate": 300.0}) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        got = g.wait_for(3 * PER, 60)
        ok, detail = check_global_topics(got, expected=3 * PER)
        assert ok, detail
        m = g.metrics(0)
        g.signal_member(0, signal.SIGTERM)
        assert g.wait_member(0) == 0
    finally:
        g.close()

    def stage_count(stage):
        return m.get(("kdsync_stage_seconds_count", (("stage", stage), ("topic", "events"))), 0)

    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    # every record of the global topic is in exactly one traced batch, at its position
    assert sum(r["count"] for r in rows) == 3 * PER
    by_seq = {r.offset: r for r in got["dc1"]}
    for r in rows:
        first = by_seq[r["seq"]]
        assert (first.origin, first.origin_partition, first.origin_offset) == (r["origin"], r["partition"],
                                                                             r["first_offset"])
        assert first.origin_ts == r["source_ts"]
        assert r["delivered"] <= r["produced"] <= r["durable"]
    own = [r for r in rows if r["origin"] == "dc1"]
    assert sum(r["count"] for r in own) == PER
    for r in own:  # the stages of this member's own batches, in their order
        assert r["fetched"] <= r["submitted"] <= r["delivered"]
        assert r["sent"] is None or r["submitted"] <= r["sent"] <= r["delivered"]
        assert r["fetched"] >= r["source_ts"] / 1000.0 - 0.01  # same host clock
    assert all(r["fetched"] is None and r["submitted"] is None for r in rows if r["origin"] != "dc1")
    # the histograms: one observation per own batch submitted, one per delivery written
    assert stage_count("handoff") == stage_count("fetch") >= len(own)
    assert stage_count("delivered") >= len(own)
    assert stage_count("produced") == stage_count("report") > 0
    assert m[("kdsync_e2e_latency_seconds_count", (("topic", "events"),))] == 3 * PER
    assert m[("kdsync_events_written_total", (("topic", "events"),))] == 3 * PER


def test_histogram_label_counts_each_topic_once_while_topics_start():
    """[metrics] topic_histograms counts the distinct topics a member orders:
    during start-up a topic is both planned and open (or starting), and
    counted once (60 topics stay per topic at the default 100)."""
    from types import SimpleNamespace

    from kdsync.config import MetricsSection
    from kdsync.pipeline import histogram_label

    topics = [f"t{i}" for i in range(60)]
    m = SimpleNamespace(pipelines={t: None for t in topics[:50]}, starting={"t50"}, planned=set(topics),
                        cfg=SimpleNamespace(metrics=MetricsSection()))
    assert histogram_label(m, "t50") == "t50"
    m.cfg.metrics = MetricsSection(topic_histograms=59)
    assert histogram_label(m, "t50") == "_all"


def test_checkpoint_interval_grows_past_twenty_checkpoints_a_second_of_topics():
    """A member writes at most CHECKPOINTS_PER_S checkpoints a second over
    its topics: 100 topics keep `[checkpoint] interval_ms`, 1 000 take one
    every 50 s (each is a broker append), counted once while they start."""
    from types import SimpleNamespace

    from kdsync.config import CheckpointSection
    from kdsync.pipeline import CHECKPOINTS_PER_S, checkpoint_interval

    def member(n: int, interval_ms: int = 10_000):
        topics = {f"t{i}" for i in range(n)}
        return SimpleNamespace(pipelines=dict.fromkeys(topics), starting=set(), planned=topics,
                               cfg=SimpleNamespace(checkpoint=CheckpointSection(interval_ms=interval_ms)))

    assert checkpoint_interval(member(100)) == 10.0
    assert checkpoint_interval(member(1000)) == 1000 / CHECKPOINTS_PER_S == 50.0
    assert checkpoint_interval(member(1000, interval_ms=120_000)) == 120.0
