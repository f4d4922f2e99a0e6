"""kdsync.ticks.Sleepers: the member's liveness as its nodes hear it when
the tick timer runs late and a pass runs several ticks at once.  A node
suspects a peer when, and only when, the member itself has not heard it for
suspect_ticks — whatever the number of ticks a pass runs (issue 26: a late
loop made every awake group suspect a peer the member still heard)."""

from __future__ import annotations

import pytest

from kdsync.testing.network import InMemoryNetwork
from kdsync.ticks import Sleepers

SUSPECT = 10
IDS = ("a", "b", "c")


def _active_node():
    net = InMemoryNetwork(IDS, suspect_ticks=SUSPECT, heartbeat_ticks=2, retransmit_ticks=3)
    net.run_until(lambda: all(net.node(i).status == "active" for i in IDS))
    return net.node("a")  # driven by hand from here: its messages go nowhere


def _drive(n: int, heard_every: int, rounds: int) -> tuple[set[str], set[str]]:
    """Member `a` runs passes of `n` ticks; b is heard every `heard_every`
    ticks of the member (the frame arrives between passes), c never again.
    Returns (peers the member found silent, peers the node suspected)."""
    node = _active_node()
    s = Sleepers(["b", "c"], heartbeat_ticks=2, suspect_ticks=SUSPECT, send=lambda p, f: None, sleep=False)
    s.live.speaks.update(("b", "c"))
    silent: set[str] = set()
    for _ in range(rounds):
        s.on_ticks(n)
        silent |= {p for p, a in s.live.ago().items() if a > SUSPECT}
        assert not s.skip("t", node)
        for _ in range(n):
            node.tick()
        if s.live.now % heard_every < n:
            s.live.heard("b")
    return silent, set(node.suspected)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_a_late_pass_suspects_no_peer_the_member_hears(n):
    silent, suspected = _drive(n, heard_every=7, rounds=60 // n)
    assert "b" not in silent  # heard every 7 ticks at most (+ n: the pass it arrives in)
    assert "b" not in suspected, f"a pass of {n} ticks suspected a peer heard within {7 + n} ticks"


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_a_silent_peer_is_suspected_in_the_pass_where_the_member_finds_it_silent(n):
    node = _active_node()
    s = Sleepers(["b", "c"], heartbeat_ticks=2, suspect_ticks=SUSPECT, send=lambda p, f: None, sleep=False)
    for i in range(60):
        s.on_ticks(n)
        s.live.heard("b")
        if i < 20:  # c speaks for a while, then falls silent
            s.live.heard("c")
        if _pass_finds_silent(s, node, n, "c"):
            break
    assert node.suspected == {"c"}


def _pass_finds_silent(s, node, n, peer) -> bool:
    """The node runs a pass of n ticks; whether the member now finds `peer`
    silent — and the node suspects it exactly then."""
    assert not s.skip("t", node)
    for _ in range(n):
        node.tick()
    member_silent = s.live.ago()[peer] > SUSPECT
    assert (peer in node.suspected) == member_silent, (n, s.live.now, node.suspected)
    return member_silent


def test_the_awake_groups_are_every_group_not_asleep_in_order_when_many_are():
    s = Sleepers(["b"], heartbeat_ticks=2, suspect_ticks=SUSPECT, send=lambda p, f: None)
    groups = {f"t{i:03d}": object() for i in range(100)}
    assert list(s.awake(groups)) == list(groups)  # none asleep: every group, in order
    for t in list(groups)[:50]:
        s.dorm.asleep[t] = (0, groups[t])
    assert list(s.awake(groups)) == list(groups)[50:]
    for t in list(groups)[50:98]:
        s.dorm.asleep[t] = (0, groups[t])
    assert set(s.awake(groups)) == {"t098", "t099"}  # few awake: found without walking every group
    s.dorm.asleep.clear()
    assert list(s.awake({})) == []


@pytest.mark.parametrize("n", [1, 3])
def test_a_node_suspects_a_late_peer_in_the_pass_where_the_member_does_with_its_tolerance(n):
    """A peer whose pings once came 7-9 ticks apart (a near miss) gets that
    many more ticks of silence; the node hears the member's silence as it counts it,
    so it suspects in the same pass as the member, not at suspect_ticks."""
    node = _active_node()
    s = Sleepers(["b", "c"], heartbeat_ticks=2, suspect_ticks=SUSPECT, send=lambda p, f: None, sleep=False)
    found = None
    for i in range(120 // n):
        s.on_ticks(n)
        if _pass_finds_silent(s, node, n, "b"):
            found = s.live.now
            break
        s.live.heard("c", ping=True)
        if s.live.now < 20 or 26 <= s.live.now < 40:  # b: on time, then a gap of 7-9 ticks, then silent
            s.live.heard("b", ping=True)
    tol = s.live.tolerance("b")
    assert 7 <= tol <= 9
    assert found is not None and found - 40 > SUSPECT + tol - n
    assert node.suspected == {"b"}


def test_the_tick_timer_tells_the_liveness_how_late_the_loop_ran():
    """On a real event loop: a callback blocks the loop for 30 tick periods;
    the next tick pass reports it (TickClock -> GroupTicks -> Sleepers), so
    the member's peers get up to suspect_ticks more silence for a while."""
    import asyncio
    import time

    from kdsync.core.liveness import TOLERANCE_SUSPECTS
    from kdsync.ticks import FormingSlots, GroupTicks, TickClock

    loop = asyncio.new_event_loop()
    s = Sleepers(["b"], heartbeat_ticks=2, suspect_ticks=SUSPECT, send=lambda p, f: None, sleep=False)
    ticks = GroupTicks({}, s, FormingSlots(1, 40), lambda p: None, lambda now: None)
    seen: list[int] = []

    def on_ticks(n, now, late):
        seen.append(late)
        ticks(n, now, late)

    errors: list[Exception] = []
    clock = TickClock(loop, tick_ms=10, quiet=lambda: False, on_ticks=on_ticks, on_error=errors.append,
                      stopping=lambda: False)
    try:
        clock.start()
        loop.run_until_complete(asyncio.sleep(0.1))
        assert s.live.tolerance("b") == max(seen)  # on time: what lateness there was (a busy box: a little)
        loop.call_soon(time.sleep, 0.3)  # the fault: the loop blocked for 30 periods
        loop.run_until_complete(asyncio.sleep(0.1))
        assert not errors
        assert max(seen) >= 25, seen
        assert s.live.tolerance("b") == min(max(seen), TOLERANCE_SUSPECTS * SUSPECT)  # the lateness, capped
    finally:
        clock.stop()
        loop.close()
