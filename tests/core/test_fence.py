"""A clean stop of the clock protocol fences the leaver instead of changing
the view (kdsync.core.fence): driven through loss, lost slots, a crash
during the fence and the leaver's return, checked by the outside checker."""

import pytest

from kdsync.core.fence import may_fence, trim_covers
from kdsync.core.messages import ClockAppend, Collect, Fence, Report
from kdsync.testing.network import InMemoryNetwork, assert_whole, check_invariants

FAST = dict(suspect_ticks=300, heartbeat_ticks=2, retransmit_ticks=3)  # a silence takes 300 ticks to notice
IDS = ("a", "b", "c", "d", "e")


def keys(evs):
    return {(e.origin, e.partition, e.offset) for e in evs}


def formed(ids=IDS, **kw):
    net = InMemoryNetwork(list(ids), seed=kw.pop("seed", 3), protocol="clock", **{**FAST, **kw})
    net.run_until(lambda: all(net.node(i).status == "active" for i in ids), 100)
    return net


def view_changes(net):
    return net.sent_by_type.get(Collect.TYPE, 0) + net.sent_by_type.get(Report.TYPE, 0)


def test_which_groups_fence_a_leaver():
    """Only where the group keeps its fault tolerance: odd groups of 3 or
    more (an even group's majority is larger than the view one smaller
    needs), whatever the commit quorum (the trim then needs n - q reporters
    of the others, once they cover what the fenced member held)."""
    assert [n for n in range(1, 10) if may_fence(n, 0)] == [3, 5, 7, 9]
    assert all(may_fence(n, q) for n in (3, 5, 7) for q in (1, 2, 3))
    assert trim_covers((3, 2), [(3, 1), (0, 2)]) and not trim_covers((3, 2), [(2, 2), (2, 1)])


@pytest.mark.parametrize("drop", [0.0, 0.2])
def test_a_clean_stop_changes_no_view_and_the_others_keep_delivering(drop):
    """e stops in the middle of a stream from every member: nobody wedges,
    no view change starts (no COLLECT, no REPORT), and the others' events
    are delivered within a few ticks of their submission the whole time —
    also with lossy links (the Fence is repeated until answered).  e's
    restart is taken back by one view change; every event once, everywhere."""
    net = formed()
    sub = set()
    for i in IDS:
        sub |= keys(net.submit(i, 2))
    net.stabilize()
    for a in IDS:
        for b in IDS:
            if a != b:
                net.drop(a, b, drop)
    before = view_changes(net)
    sub |= keys(net.submit("e", 3))  # may still be uncut when e stops: consumed again after its restart
    took = net.stop("e", max_ticks=120)
    assert net.node("a") is not None and took < 60, took
    live = ("a", "b", "c", "d")
    for step in range(20):
        mine = keys(net.submit(live[step % 4], 1))
        sub |= mine
        net.run_until(lambda: all(mine <= keys(net.topic(i)) for i in live), 40)  # delivered in < 40 ticks
        assert all(net.node(i).state.value == "active" and net.node(i).fenced == {"e": net.node(i).fenced["e"]}
                   for i in live)
    assert view_changes(net) == before
    net.recover()
    net.restart("e")
    net.run_until(lambda: all(net.node(i).status == "active" and len(net.node(i).view.members) == 5
                              and not net.node(i).fenced for i in IDS), 600)
    net.tick(20)
    assert not check_invariants(net, submitted=sub)
    assert all(len(net.topic(i)) == len(sub) for i in IDS)


def test_a_peer_lacking_the_leavers_last_slot_fetches_it_before_it_answers():
    """e's last slot never reaches a: a fences e, asks e for the slot (a
    hole), and answers only once it holds it; e leaves after every answer,
    and a delivers e's events and the others' without a view change."""
    net = formed()
    net.stabilize()
    lost = net.lose_next("e", "a", ClockAppend.TYPE)
    sub = keys(net.submit("e", 2))
    net.tick(1)
    assert lost == [1]
    sub |= keys(net.submit("b", 1))
    before = view_changes(net)
    took = net.stop("e", max_ticks=120)
    assert took < 40, took
    net.run_until(lambda: all(sub <= keys(net.topic(i)) for i in ("a", "b", "c", "d")), 60)
    assert view_changes(net) == before
    assert not check_invariants(net, submitted=sub, live=("a", "b", "c", "d"))


@pytest.mark.parametrize("quorum", [0, 2])
def test_a_crash_while_a_member_is_fenced_changes_the_view_without_either(quorum):
    """a (the lowest rank, the leader a view change would have) stops and is
    fenced; then b crashes.  The view change that suspecting b starts is led
    by c, waits for neither a nor b, and the view it installs holds c, d and e;
    both return later.  Every event once, everywhere.  With a commit quorum
    of 2 the trim has n - q = 3 reporters of the four others, one fewer than
    it needs without the fence: enough because their counts cover a's final
    received vector (else the group would wait for a return)."""
    net = formed(suspect_ticks=30, commit_quorum=quorum)
    sub = set()
    for i in IDS:
        sub |= keys(net.submit(i, 2))
    net.stabilize()
    net.stop("a", max_ticks=120)
    assert all(net.node(i).fenced for i in ("b", "c", "d", "e"))
    sub |= keys(net.submit("c", 2))
    net.crash("b")
    sub |= keys(net.submit("d", 2))
    live = ("c", "d", "e")
    net.run_until(lambda: all(net.node(i).status == "active" and net.node(i).view.members == live for i in live),
                  200)
    sub |= keys(net.submit("e", 2))
    net.run_until(lambda: all(len(net.topic(i)) >= 10 + 6 for i in live), 100)
    net.restart("a")
    net.restart("b")
    assert_whole(net, IDS, sub, members=5, within=800)


def test_a_lost_fence_is_repeated_and_an_even_group_changes_its_view():
    """The first Fence to b is lost: e repeats it (with a Leave for older
    releases) and b fences e then, still without a view change.  In a group
    of four a clean stop changes the view as before (fencing would cost it
    its one tolerated failure)."""
    net = formed()
    net.stabilize()
    lost = net.lose_next("e", "b", Fence.TYPE)
    before = view_changes(net)
    net.stop("e", max_ticks=120)
    assert lost == [1] and net.node("b").fenced and view_changes(net) == before
    four = formed(("a", "b", "c", "d"))
    four.stop("d", max_ticks=120)
    four.run_until(lambda: all(four.node(i).status == "active" and four.node(i).view.members == ("a", "b", "c")
                               for i in ("a", "b", "c")), 100)
    assert not four.node("a").fenced


def test_a_peer_of_an_older_release_takes_the_leave_and_the_group_changes_its_view():
    """b is of a release before fences: it drops FENCE as an unknown message
    (RemoteProtocolError, logged and survived) and suspects e on the LEAVE
    that e repeats with it.  The others fenced e, then join the view change
    b starts; the view of four follows, and nothing is lost or doubled."""
    from kdsync.core import RemoteProtocolError

    net = formed()
    b = net.node("b")

    def unknown(msg):
        raise RemoteProtocolError("unknown message type 23")

    b._handlers[Fence] = unknown
    sub = set()
    for i in IDS:
        sub |= keys(net.submit(i, 2))
    net.stabilize()
    net.stop("e", max_ticks=120)
    live = ("a", "b", "c", "d")
    net.run_until(lambda: all(net.node(i).status == "active" and net.node(i).view.members == live for i in live), 200)
    assert b.stats["bad_messages"] >= 1
    sub |= keys(net.submit("a", 3))
    net.run_until(lambda: all(len(net.topic(i)) >= 10 + 3 for i in live), 100)
    assert not check_invariants(net, submitted=sub, live=live)
