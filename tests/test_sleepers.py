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
        assert not s.skip("t", node)
        for _ in range(n):
            node.tick()
        member_silent = s.live.ago()["c"] > SUSPECT
        assert ("c" in node.suspected) == member_silent, (n, s.live.now, node.suspected)
        if member_silent:
            break
    assert node.suspected == {"c"}


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
