"""A clean stop is announced (issue 42): on SIGTERM a member leaves its
groups, so the others install their next view at once instead of after
suspect_ms of silence (clock: they fence it and keep their view); its
restart is taken back; nothing lost or doubled."""

from __future__ import annotations

import re
import signal

import pytest

from kdsync.testing.local import LocalGroup, check_global_topics, write_events
from tests.helpers import member_logs, wait_until

pytestmark = pytest.mark.timeout(300)

SUSPECT_MS = 4000  # a silent member would be noticed only after this long


def _ts(line: str) -> float:
    return float(re.search(r"ts=([0-9.]+)", line).group(1))


def _ordering(g: LocalGroup) -> None:
    """Start the group and order 50 events from each of its three clusters."""
    g.start_brokers()
    g.start_members()
    g.wait_ready(90)
    for i in range(3):
        write_events(g.bootstrap(i), g.topic, 50, f"a{i}")
    got = g.wait_for(150, 60)
    assert all(len(v) == 150 for v in got.values()), member_logs(g)


def _order_on_and_take_dc3_back(g: LocalGroup, expected: int = 300) -> None:
    """dc3 is gone: the two others order on, dc3 restarts and is taken back;
    every cluster then holds the same `expected` events exactly once."""
    for i in range(2):
        write_events(g.bootstrap(i), g.topic, 50, f"b{i}")
    g.start_member(2)
    g.wait_ready(60, members=[2])
    write_events(g.bootstrap(2), g.topic, 50, "c2")
    got = g.wait_for(expected, 90)
    ok, detail = check_global_topics(got, expected=expected)
    assert ok, detail + "\n" + member_logs(g)


@pytest.mark.parametrize("protocol", ["derecho", "clock"])
def test_sigterm_leaves_the_group_at_once_and_the_restart_is_taken_back(tmp_path, protocol):
    g = LocalGroup(3, tmp_path, protocol=protocol, suspect_ms=SUSPECT_MS, metrics=True)
    with g:
        _ordering(g)
        g.signal_member(2, signal.SIGTERM)
        assert g.wait_member(2, 30) == 0
        stopping = next(ln for ln in g.log_text(2).splitlines() if 'msg=stopping' in ln)
        assert "left the groups" in g.log_text(2) and "not_confirmed=0" in g.log_text(2), g.log_text(2)[-2000:]
        # derecho: the next view leaves dc3 out; clock: dc1 and dc2 fence it and keep the view
        # (a group of three with a majority quorum loses no fault tolerance by it: kdsync.core.fence)
        done = "fenced=dc3" if protocol == "clock" else "members=dc1,dc2 "
        wait_until(lambda: done in g.log_text(0) and done in g.log_text(1), 30, f"{done} at dc1 and dc2")
        moved = next(ln for ln in g.log_text(0).splitlines() if done in ln)
        took = _ts(moved) - _ts(stopping)
        print(f"{protocol}: SIGTERM to {done.strip()} {took * 1000:.0f} ms (suspect_ms {SUSPECT_MS})")
        assert took < SUSPECT_MS / 1000 / 2, took  # announced, not noticed by silence
        assert "peer silent" not in g.log_text(0)
        if protocol == "clock":
            assert "members=dc1,dc2 " not in g.log_text(0)  # no view change: nobody stopped delivering
        _order_on_and_take_dc3_back(g)


@pytest.mark.parametrize("protocol", ["clock"])
def test_kill9_with_adaptive_suspicion_is_found_in_a_few_heartbeats_not_suspect_ms(tmp_path, protocol):
    """Real processes: with `protocol.adaptive_suspect` a member killed with
    SIGKILL (nothing announced) is suspected after a few of its ping gaps,
    well before suspect_ms; the others order on, its restart is taken back,
    nothing lost or doubled."""
    import time

    g = LocalGroup(3, tmp_path, protocol=protocol, suspect_ms=SUSPECT_MS, heartbeat_ms=100, metrics=True,
                   extra={"protocol": {"adaptive_suspect": True, "crash_fence": False}})  # suspicion alone
    with g:
        _ordering(g)
        killed = time.time()
        g.signal_member(2, signal.SIGKILL)
        g.wait_member(2, 30)
        wait_until(lambda: "members=dc1,dc2 " in g.log_text(0) and "members=dc1,dc2 " in g.log_text(1), 30,
                   "the next view without dc3")
        installed = next(ln for ln in g.log_text(0).splitlines() if "view installed" in ln and "members=dc1,dc2 " in ln)
        took = _ts(installed) - killed
        print(f"{protocol}: SIGKILL to the next view {took * 1000:.0f} ms (suspect_ms {SUSPECT_MS}, adaptive)")
        assert took < SUSPECT_MS / 1000 / 2, took  # found by its ping gaps, not by suspect_ms
        _order_on_and_take_dc3_back(g)


def test_kill9_with_the_crash_fence_is_fenced_by_the_others_without_a_view_change(tmp_path):
    """Real processes: with `protocol.crash_fence` a member killed with
    SIGKILL (nothing announced) while records keep coming is fenced by both
    others (kdsync.core.crash_fence) well before suspect_ms, with no view
    change; they order on, its restart is taken back, nothing lost or
    doubled."""
    import time

    g = LocalGroup(3, tmp_path, protocol="clock", suspect_ms=SUSPECT_MS, heartbeat_ms=100, metrics=True,
                   extra={"protocol": {"crash_fence": True}})
    with g:
        _ordering(g)
        g.signal_member(2, signal.SIGKILL)
        g.wait_member(2, 30)
        writing = time.time()
        for i in range(2):  # records that wait for dc3's clock at dc1 and dc2
            write_events(g.bootstrap(i), g.topic, 10, f"k{i}")
        wait_until(lambda: "fenced=dc3" in g.log_text(0) and "fenced=dc3" in g.log_text(1), 30,
                   "dc1 and dc2 fence dc3")
        fenced = next(ln for ln in g.log_text(0).splitlines() if "fenced=dc3" in ln)
        took = _ts(fenced) - writing
        print(f"clock: records written after the kill to dc3 fenced {took * 1000:.0f} ms "
              f"(suspect_ms {SUSPECT_MS}, crash fence)")
        assert took < SUSPECT_MS / 1000, took  # (producing the records is part of it on a busy box)
        got = g.wait_for(170, 60, members=[0, 1])
        assert all(len(v) == 170 for v in got.values()), member_logs(g)
        assert "members=dc1,dc2 " not in g.log_text(0)  # no view change: nobody stopped delivering
        _order_on_and_take_dc3_back(g, expected=320)


def test_kill9_and_restart_with_lift_fence_is_taken_back_without_any_view_change(tmp_path):
    """Real processes: with `protocol.lift_fence` a member killed with
    SIGKILL is fenced by the others, and its restart is taken back in place
    (kdsync.core.lift): no view is installed after the first at dc1 and
    dc2, and every cluster holds the same events exactly once."""
    g = LocalGroup(3, tmp_path, protocol="clock", suspect_ms=SUSPECT_MS, heartbeat_ms=100, metrics=True,
                   extra={"protocol": {"crash_fence": True, "lift_fence": True}})
    with g:
        _ordering(g)
        views = [g.log_text(i).count("view installed") for i in range(2)]
        g.signal_member(2, signal.SIGKILL)
        g.wait_member(2, 30)
        for i in range(2):  # records that wait for dc3's clock at dc1 and dc2
            write_events(g.bootstrap(i), g.topic, 10, f"k{i}")
        wait_until(lambda: "fenced=dc3" in g.log_text(0) and "fenced=dc3" in g.log_text(1), 30,
                   "dc1 and dc2 fence dc3")
        _order_on_and_take_dc3_back(g, expected=320)
        assert [g.log_text(i).count("view installed") for i in range(2)] == views, member_logs(g)


def test_a_paused_member_is_fenced_then_told_so_and_rejoins_as_a_new_incarnation(tmp_path):
    """Real processes, with `protocol.crash_fence`: dc3 is paused
    (SIGSTOP: cut off, not crashed) while records keep coming in every
    cluster; dc1 and dc2 fence it with no view change and order on.
    Resumed (SIGCONT), dc3 speaks as the fenced member, is told so, hands
    back what it had not written — the records its cluster took meanwhile
    among them — and is taken back as a new incarnation by one view change.
    Every cluster then holds the same events exactly once."""
    g = LocalGroup(3, tmp_path, protocol="clock", suspect_ms=SUSPECT_MS, heartbeat_ms=100, metrics=True,
                   extra={"protocol": {"crash_fence": True}})
    with g:
        _ordering(g)
        views = g.log_text(0).count("view installed")
        g.signal_member(2, signal.SIGSTOP)
        try:
            for i in range(3):
                write_events(g.bootstrap(i), g.topic, 10, f"p{i}")
            wait_until(lambda: "fenced=dc3" in g.log_text(0) and "fenced=dc3" in g.log_text(1), 30,
                       "dc1 and dc2 fence the paused dc3")
            got = g.wait_for(170, 60, members=[0, 1])  # dc3's ten wait in its cluster
            assert all(len(v) == 170 for v in got.values()), member_logs(g)
        finally:
            g.signal_member(2, signal.SIGCONT)
        wait_until(lambda: "fenced by the others while cut off" in g.log_text(2), 30,
                   "dc3 told it was fenced")
        for i in range(3):
            write_events(g.bootstrap(i), g.topic, 50, f"r{i}")
        got = g.wait_for(330, 90)
        ok, detail = check_global_topics(got, expected=330)
        assert ok, detail + "\n" + member_logs(g)
        installed = [ln for ln in g.log_text(0).splitlines() if "view installed" in ln][views:]
        assert len(installed) == 1 and "members=dc1,dc2,dc3 " in installed[0], installed  # one view change
        assert "members=dc1,dc2 " not in g.log_text(0)  # dc3 was never left out: nobody stopped for it
