"""The member's failure detector learns how late its box and its peers run
(kdsync.core.liveness, PeerLiveness.late / tolerance; issue 43: a late loop
is not a silent peer).  Without anything late in its window it finds a dead
peer exactly as before; after its own loop ran late, or a peer's pings came
late without it being suspected, a peer gets that much more silence, at
most TOLERANCE_SUSPECTS x suspect_ticks more; the window forgets."""

from __future__ import annotations

import pytest

from kdsync.core.liveness import TOLERANCE_SUSPECTS, WINDOW_SUSPECTS, PeerLiveness

S, HB = 10, 2


def _live() -> PeerLiveness:
    return PeerLiveness(["b", "c"], heartbeat_ticks=HB, suspect_ticks=S)


def _pings(live: PeerLiveness, ticks: int, every: int = HB, peers=("b", "c")) -> None:
    for _ in range(ticks):
        live.tick()
        if live.now % every == 0:
            for p in peers:
                live.heard(p, ping=True)


def _silent_after(live: PeerLiveness, peer: str) -> int:
    """Ticks from now until `peer` (never heard again) is newly silent; the
    other peer keeps pinging every heartbeat."""
    live.newly_silent()
    for k in range(1, 10 * S):
        live.tick()
        for p in live.peers:
            if p != peer and live.now % HB == 0:
                live.heard(p, ping=True)
        new = live.newly_silent()
        if new:
            assert new == {peer}
            return k
    raise AssertionError("never silent")


def test_steady_pings_give_no_tolerance_and_a_dead_peer_is_found_as_before():
    live = _live()
    _pings(live, 200)
    assert live.tolerance("b") == live.tolerance("c") == 0
    assert _silent_after(live, "b") == S + 1


@pytest.mark.parametrize("gap", [HB * 2 + 1, 7, S])
def test_a_near_miss_buys_the_peer_its_gap_and_no_more(gap):
    live = _live()
    _pings(live, 20)
    for _ in range(gap):  # b's pings come `gap` ticks apart once: late, but before it was suspected
        live.tick()
        live.heard("c", ping=True)
    live.heard("b", ping=True)
    assert live.tolerance("b") == gap and live.tolerance("c") == 0
    assert _silent_after(live, "b") == S + gap + 1
    live.heard("c", ping=True)
    assert _silent_after(live, "c") == S + 1  # the other peer's silence is judged as before


def test_gaps_that_are_not_near_misses_teach_nothing():
    live = _live()
    _pings(live, 20)
    for _ in range(2 * HB):  # on time: at most two heartbeats apart
        live.tick()
    live.heard("b", ping=True)
    assert live.tolerance("b") == 0
    for _ in range(S + 5):  # longer than suspect_ticks: a fault (a partition, a crash), not lateness
        live.tick()
        live.heard("c", ping=True)
    assert live.newly_silent() == {"b"}
    live.heard("b", ping=True)
    assert live.tolerance("b") == 0
    for _ in range(S - 1):  # frames that are not pings say nothing of lateness
        live.tick()
        live.heard("c", ping=True)
    live.heard("b")
    assert live.tolerance("b") == 0


def test_the_members_own_lateness_gives_every_peer_time_up_to_the_cap():
    live = _live()
    _pings(live, 20)
    live.late(6)
    assert live.tolerance("b") == live.tolerance("c") == 6
    assert _silent_after(live, "c") == S + 6 + 1
    live.late(500)
    assert live.tolerance("b") == TOLERANCE_SUSPECTS * S  # at most that much more
    live.late(3)  # the window keeps the worst
    assert live.tolerance("b") == TOLERANCE_SUSPECTS * S


def test_the_window_forgets():
    live = _live()
    _pings(live, 20)
    live.late(5)
    _pings(live, WINDOW_SUSPECTS * S // 2 - 21)
    assert live.tolerance("b") == 5  # still in the window's current half
    _pings(live, WINDOW_SUSPECTS * S + 1)
    assert live.tolerance("b") == 0  # both halves turned over
    assert _silent_after(live, "b") == S + 1
