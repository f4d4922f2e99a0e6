"""The stall detector (kdsync.observability.stalls): pure, driven by a fake clock."""

import pytest

from kdsync.observability.stalls import StallDetector


def test_a_stage_that_holds_records_and_does_not_move_stalls_once_then_resumes():
    d = StallDetector(5.0)
    assert d.sample(0.0, "t", "fetch", held=10, progress=0) is None
    assert d.sample(4.9, "t", "fetch", held=10, progress=0) is None
    t = d.sample(5.0, "t", "fetch", held=12, progress=0)
    assert t is not None and t.stalled and t.stage == "fetch" and t.held == 12 and t.for_s == 5.0
    assert d.sample(9.0, "t", "fetch", held=12, progress=0) is None  # said once
    assert d.stalled() == [("t", "fetch")]
    t = d.sample(10.0, "t", "fetch", held=3, progress=9)  # moved
    assert t is not None and not t.stalled and t.for_s == 10.0 and d.stalled() == []
    assert d.sample(14.0, "t", "fetch", held=3, progress=9) is None


def test_nothing_held_is_no_stall_and_progress_resets_the_clock():
    d = StallDetector(5.0)
    d.sample(0.0, "t", "ordering", held=0, progress=0)
    for now in range(1, 30):
        assert d.sample(float(now), "t", "ordering", held=0, progress=0) is None  # idle is fine
    for now in range(30, 60):
        assert d.sample(float(now), "t", "ordering", held=4, progress=now) is None  # busy and moving
    assert d.sample(63.9, "t", "ordering", held=4, progress=59) is None
    t = d.sample(64.0, "t", "ordering", held=4, progress=59)  # unmoved since 59
    assert t is not None and t.stalled and t.for_s == 5.0


def test_stages_and_topics_are_watched_apart():
    d = StallDetector(1.0)
    for s in ("fetch", "delivery report"):
        for tp in ("a", "b"):
            d.sample(0.0, tp, s, 1, 0)
    d.sample(2.0, "a", "fetch", 1, 1)
    got = [d.sample(2.0, tp, s, 1, 0) for s in ("delivery report",) for tp in ("a", "b")]
    assert all(t is not None and t.stalled for t in got) and ("a", "fetch") not in d.stalled()
    d.forget("a")
    assert d.stalled() == [("b", "delivery report")]
    with pytest.raises(ValueError):
        StallDetector(0)


def test_the_ordering_stage_holds_own_events_submitted_and_not_delivered_by_offset():
    """The member's 'ordering' sample counts by source offsets, so batches a
    view change re-cut (resubmitted, merged, caught up) are not left behind."""
    from kdsync.pipeline import TopicPipeline

    p = TopicPipeline("t", "t-global", node=None, state=None, own_next={0: 10})  # ordered below 10 before a restart
    p.submitted_next = {0: 25, 1: 7}
    p.own_next.setdefault(1, 3)  # partition 1 first submitted at offset 3
    assert p.own_waiting() == 15 + 4
    p.own_next[0] = 25
    p.own_next[1] = 7
    assert p.own_waiting() == 0


def test_sample_pipelines_watches_only_topics_that_hold_something():
    """A thousand idle topics cost the health sample a lookup each (issue 26):
    a stage holding nothing has no watch; one that starts holding is watched
    from that sample, stalls after stall_after_s, and is let go once it
    holds nothing again."""
    from types import SimpleNamespace

    from kdsync.observability.stalls import sample_pipelines

    class Metrics:
        def __init__(self):
            self.set = {}
            self.stalled = self

        def labels(self, topic, stage):
            return SimpleNamespace(set=lambda v: self.set.__setitem__((topic, stage), v))

    def pipe(topic):
        return SimpleNamespace(topic=topic, own_waiting=lambda: 0, delivered_end=0, consumed=0,
                               writer=SimpleNamespace(unproduced=0, produced_end=0, outstanding=0, durable_end=0))

    ps = [pipe(f"t{i}") for i in range(1000)]
    unfetched = {}
    source = SimpleNamespace(held_back=False, unfetched=lambda t: unfetched.get(t, 0))
    d, m = StallDetector(5.0), Metrics()
    for now in range(3):
        sample_pipelines(d, m, ps, source, float(now))
    assert d._w == {} and m.set == {}
    ps[7].writer.outstanding = 3  # delivery reports that never come
    unfetched["t9"] = 2  # records the source does not fetch
    for now in range(3, 9):
        sample_pipelines(d, m, ps, source, float(now))
    assert set(d._w) == {"t7", "t9"} and m.set == {("t7", "delivery report"): 1, ("t9", "fetch"): 1}
    assert d.stalled() == [("t7", "delivery report"), ("t9", "fetch")]
    ps[7].writer.outstanding = 0
    sample_pipelines(d, m, ps, source, 9.0)
    assert m.set[("t7", "delivery report")] == 0 and set(d._w) == {"t9"}


def test_the_health_sample_exports_how_long_each_peer_may_be_silent():
    """kdsync_peer_suspect_after_seconds: suspect_ms while nothing ran late;
    then suspect_ms plus what the member's own late loop or a peer's late
    pings taught it (kdsync.core.liveness), at most 4 x suspect_ms."""
    from kdsync.core.liveness import PeerLiveness
    from kdsync.observability.metrics import MemberMetrics
    from kdsync.observability.stalls import loop_delay

    m = MemberMetrics()
    live = PeerLiveness(["dc2", "dc3"], heartbeat_ticks=2, suspect_ticks=10)  # tick 50 ms, suspect_ms 500
    after = lambda peer: m.registry.get_sample_value("kdsync_peer_suspect_after_seconds", {"peer": peer})  # noqa: E731
    loop_delay(m, 0.0, 500, 1, 0, 0.0, live)
    assert after("dc2") == after("dc3") == pytest.approx(0.5)
    for _ in range(3):
        live.tick()
    live.heard("dc3", ping=True)
    for _ in range(7):  # dc3's pings 7 ticks apart: a near miss
        live.tick()
    live.heard("dc3", ping=True)
    loop_delay(m, 0.0, 500, 1, 0, 0.0, live)
    assert (after("dc2"), after("dc3")) == (pytest.approx(0.5), pytest.approx(0.85))
    live.late(100)  # the member's own loop, 5 s late: every peer, capped
    loop_delay(m, 5.0, 500, 1, 0, 0.0, live)
    assert after("dc2") == after("dc3") == pytest.approx(2.0)
