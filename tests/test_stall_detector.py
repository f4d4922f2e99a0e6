"""A member that cannot make progress says so (kdsync.observability.stalls), with real processes.

dc2's broker is frozen (SIGSTOP) while events flow into dc1: dc2's member
gets them delivered by the group but its own cluster confirms none of its
writes, so the stage "delivery report" holds records and does not move.
The member must log one "stalled" WARNING naming that stage, export
kdsync_stalled{stage="delivery report"} = 1, and once the broker runs again
log "stall over", set the gauge back to 0 and end identical to the others.
Every other LocalGroup run asserts at close that no member logged a stall
(LocalGroup.assert_no_stall), so false alarms fail the suite.
"""

from __future__ import annotations

import threading
import time

import pytest

from kdsync.testing.local import LocalGroup, check_global_topics, write_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _until(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _stalled(g: LocalGroup, i: int, stage: str) -> float | None:
    for (name, labels), v in g.metrics(i).items():
        if name == "kdsync_stalled" and dict(labels).get("stage") == stage:
            return v
    return None


@pytest.mark.parametrize("broker", ["tansu", "noida"])
def test_a_frozen_broker_is_reported_as_a_stalled_delivery_report_stage_then_recovers(tmp_path, broker):
    with LocalGroup(3, tmp_path, metrics=True, stall_after_ms=1500, expect_stalls=True, broker=broker) as g:
        g.start_brokers()
        g.start_members()
        g.wait_ready(60)
        write_events(g.bootstrap(0), g.topic, 50, "warm")
        g.wait_for(50, 60)
        assert not g.stalls(), g.stalls()
        g.clusters[1].pause()  # SIGSTOP: connections stay open, nothing is answered
        writer = threading.Thread(target=write_events, args=(g.bootstrap(0), g.topic, 200, "held"),
                                  kwargs=dict(rate=200), daemon=True)
        writer.start()
        try:
            line = _until(lambda: [s for s in g.stalls() if s.startswith("dc2:")], 30, "dc2's stall warning")[0]
            assert 'stage="delivery report"' in line and "held=" in line, line
            assert _stalled(g, 1, "delivery report") == 1.0
            assert all(not s.startswith(("dc1:", "dc3:")) for s in g.stalls()), g.stalls()
        finally:
            g.clusters[1].resume()
        writer.join(60)
        got = g.wait_for(250, 90)
        ok, detail = check_global_topics(got, expected=250)
        assert ok, detail
        _until(lambda: 'msg="stall over"' in g.log_text(1) and 'stage="delivery report"' in g.log_text(1), 30,
               "dc2's stall-over line")
        assert _stalled(g, 1, "delivery report") == 0.0
        assert len([s for s in g.stalls() if s.startswith("dc2:")]) == 1  # said once
