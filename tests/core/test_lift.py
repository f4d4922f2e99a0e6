"""A fenced member's restart is taken back in place, without a view change
(kdsync.core.lift): driven through loss, a cut-off member's return, a
member that does not lift, a crash of the lifted member and a view change
while it is lifted, checked by the outside checker."""

import dataclasses

import pytest

from kdsync.core.messages import Lift, Lifted
from tests.core.test_crash_fence import IDS, LIVE, Net, keys, streaming, view_changes


def lifting(seed=3, **kw):
    return streaming(seed=seed, lift_fence=True, **kw)


def fence_e(net, sub, within=20):
    net.crash("e")
    for step in range(40):
        sub |= keys(net.submit(LIVE[step % 4], 1))
        net.tick(1)
    net.run_until(lambda: all("e" in net.node(i).fenced for i in LIVE), 200)


def everyone_submits(net, sub, members, rounds):
    for step in range(rounds):
        sub |= keys(net.submit(members[step % len(members)], 1))
        net.tick(1)


def all_five_in(net, within):
    net.run_until(lambda: all(net.node(i).status == "active" and len(net.node(i).view.members) == 5
                              for i in IDS), within)


def whole(net, sub, ids=IDS, within=600):
    net.run_until(lambda: all(keys(net.topic(i)) == sub for i in ids), within)


@pytest.mark.parametrize("drop,quorum", [(0.0, 0), (0.0, 2), (0.2, 0), (0.2, 2)])
def test_a_fenced_restart_is_taken_back_without_a_view_change(drop, quorum):
    """e crashes and is fenced; its restart asks every other member to wait
    for it (LIFT) instead of joining: each promises, e's new events are
    ordered at the live members with nobody wedged — no COLLECT, no REPORT —
    and e copies the order from a peer.  Every event once, one order, at
    all five, lossy links too."""
    net, sub = lifting(commit_quorum=quorum)
    for a in IDS:
        for b in IDS:
            if a != b:
                net.drop(a, b, drop)
    fence_e(net, sub)
    before = view_changes(net)
    net.restart("e")
    net.run_until(lambda: net.node("e")._lift_on, 200)
    assert all(net.node(i)._lift_by is not None for i in LIVE)
    everyone_submits(net, sub, IDS, 100)
    net.recover()
    whole(net, sub)
    assert view_changes(net) == before
    assert net.sent_by_type.get(Lift.TYPE, 0) >= 4 and net.sent_by_type.get(Lifted.TYPE, 0) >= 4
    assert all(net.node(i).status == "active" for i in IDS) and net.node("e").state.name == "REJOINING"
    mine = {x for x in sub if x[0] == "e"}
    assert mine and all(mine <= keys(net.topic(i)) for i in IDS)
    assert not check(net, sub)


def check(net, sub):
    from kdsync.testing.network import check_invariants
    return check_invariants(net, submitted=sub)


class Older(Net):
    """`a` takes no member back in place (an older release drops LIFT: no answer)."""

    def config(self, i):
        cfg = super().config(i)
        return dataclasses.replace(cfg, lift_fence=False) if i == "a" else cfg


def test_without_every_promise_the_restart_joins_and_the_view_changes():
    net = Older(list(IDS), seed=4, protocol="clock", crash_fence=True, lift_fence=True,
                suspect_ticks=300, heartbeat_ticks=2, retransmit_ticks=3)
    net.run_until(lambda: all(net.node(i).status == "active" for i in IDS), 100)
    sub = set()
    everyone_submits(net, sub, IDS, 40)
    fence_e(net, sub)
    before = view_changes(net)
    net.restart("e")
    everyone_submits(net, sub, IDS, 60)
    all_five_in(net, 600)
    whole(net, sub)
    assert view_changes(net) > before and net.node("e").stats.get("lifts_given_up") == 1
    assert not net.node("e")._lift_on
    assert not check(net, sub)


def test_a_lifted_member_that_crashes_again_is_suspected_and_the_view_changes():
    """Taken back in place, e crashes again: the others' C2 waits for its
    clock, nothing fences it twice in one view, so it is suspected and the
    view changes without it; its slots held by the others are ordered once."""
    net, sub = lifting()
    fence_e(net, sub)
    net.restart("e")
    net.run_until(lambda: net.node("e")._lift_on, 200)
    everyone_submits(net, sub, IDS, 30)
    before = view_changes(net)
    net.crash("e")
    everyone_submits(net, sub, LIVE, 40)
    net.run_until(lambda: all(net.node(i).status == "active" and "e" not in net.node(i).view.members
                              for i in LIVE), 1500)
    assert view_changes(net) > before
    net.restart("e")
    all_five_in(net, 1500)
    whole(net, sub)
    assert not check(net, sub)


def test_a_view_change_while_a_member_is_lifted_keeps_one_order():
    """e is taken back in place; then d crashes too (a second fence in one
    view is refused): the view changes, e's slots are trimmed with the
    others' and e is taken into the next view; every event once, one order."""
    net, sub = lifting(seed=7)
    fence_e(net, sub)
    net.restart("e")
    net.run_until(lambda: net.node("e")._lift_on, 200)
    everyone_submits(net, sub, IDS, 30)
    net.crash("d")
    everyone_submits(net, sub, ("a", "b", "c", "e"), 60)
    net.restart("d")
    all_five_in(net, 2000)
    whole(net, sub)
    assert not check(net, sub)


def test_a_cut_off_member_told_it_was_fenced_is_taken_back_in_place():
    """e is cut off, not dead: the others fence it; once the partition
    heals they tell it so (FENCE), it takes incarnation + 1 and, instead of
    a JOIN, asks to be taken back in place: no view change at all, and its
    events cut while alone are ordered after its return."""
    net, sub = lifting(seed=7)
    view = net.node("a").view.view_id
    before = view_changes(net)
    net.isolate("e")
    sub |= keys(net.submit("e", 3))
    everyone_submits(net, sub, LIVE, 40)
    net.run_until(lambda: all("e" in net.node(i).fenced for i in LIVE), 200)
    net.recover()
    net.run_until(lambda: net.node("e")._lift_on, 300)
    everyone_submits(net, sub, IDS, 60)
    whole(net, sub)
    assert view_changes(net) == before and all(net.node(i).view.view_id == view for i in IDS)
    assert net.node("e").stats.get("fenced_rejoins") == 1
    assert not check(net, sub)


def test_a_clean_stop_and_restart_is_taken_back_in_place():
    """e stops cleanly (its leave fences it: kdsync.core.fence) and restarts:
    taken back in place, no view change from the stop to the end."""
    net, sub = lifting(seed=5)
    before = view_changes(net)
    sub |= keys(net.submit("e", 3))  # may still be uncut when e stops: consumed again after its restart
    net.stop("e", max_ticks=120)
    everyone_submits(net, sub, LIVE, 30)
    assert all("e" in net.node(i).fenced for i in LIVE)
    net.restart("e")
    net.run_until(lambda: net.node("e")._lift_on, 200)
    everyone_submits(net, sub, IDS, 60)
    whole(net, sub)
    assert view_changes(net) == before
    assert not check(net, sub)


def test_a_member_in_a_view_change_refuses_and_the_restart_joins_at_once():
    """A member that cannot promise (here: wedged) answers so at once: the
    restart joins without waiting out its LIFTs."""
    net, sub = lifting(seed=3)
    fence_e(net, sub)
    net.node("b")._wedge()  # b's view is over: it promises nothing in it
    net.restart("e")
    net.run_until(lambda: net.node("e").stats.get("lifts_given_up") == 1, 30)
    assert not net.node("e")._lift_on
    everyone_submits(net, sub, IDS, 30)
    all_five_in(net, 1500)
    whole(net, sub)
    assert not check(net, sub)


def test_a_late_message_of_the_old_incarnation_is_dropped_once_the_new_one_is_taken_back():
    """e was cut off, then told it was fenced and taken back in place as a
    new incarnation; a message its old incarnation sent before that arrives
    late (a newer clock report): the old incarnation is gone, so it is
    dropped — not taken as the fenced member speaking again (swarm seed
    found it: the FENCE for it named a member no longer fenced)."""
    from kdsync.core.messages import ClockAck

    net, sub = lifting(seed=7)
    old = net.node("e").incarnation
    net.isolate("e")
    everyone_submits(net, sub, LIVE, 40)
    net.run_until(lambda: all("e" in net.node(i).fenced for i in LIVE), 200)
    net.recover()
    net.run_until(lambda: net.node("e")._lift_on, 300)
    a = net.node("a")
    view = a.view.view_id
    told = a.stats.get("fences_told", 0)  # (e learned it was fenced that way)
    late = ClockAck("e", old, view, tuple(a.stream.received), (), 0, False, 0, 10**15).encode()
    a.receive("e", late)
    net.tick(5)
    everyone_submits(net, sub, IDS, 30)
    whole(net, sub)
    assert a.view.view_id == view and a.stats.get("fences_told", 0) == told
    assert not check(net, sub)
