"""A crashed member of the clock protocol is fenced by all the others
instead of stopping the order until a view change (kdsync.core.crash_fence):
driven through loss, a false alarm, an isolation that heals, two crashes
and a member without the fence, checked by the outside checker."""

import dataclasses

import pytest

from kdsync.core.messages import Cap, Collect, NoCap, Report
from kdsync.testing.network import InMemoryNetwork, assert_whole, check_invariants

IDS = ("a", "b", "c", "d", "e")
LIVE = ("a", "b", "c", "d")
SLOW = dict(suspect_ticks=300, heartbeat_ticks=2, retransmit_ticks=3)  # a silence takes 300 ticks to suspect


def keys(evs):
    return {(e.origin, e.partition, e.offset) for e in evs}


class Net(InMemoryNetwork):
    """The in-memory network, with the crash fence off at the members in `without`."""

    def __init__(self, *a, without=(), **kw):
        self.without = set(without)
        super().__init__(*a, **kw)

    def config(self, i):
        cfg = super().config(i)
        return dataclasses.replace(cfg, crash_fence=False) if i in self.without else cfg


def streaming(seed=3, without=(), ids=IDS, ticks=60, **kw):
    """`ids` (five members) formed, each having submitted one event per tick for `ticks` ticks."""
    net = Net(list(ids), seed=seed, protocol="clock", crash_fence=True, without=without, **{**SLOW, **kw})
    net.run_until(lambda: all(net.node(i).status == "active" for i in ids), 100)
    sub = set()
    for _ in range(ticks):
        for i in ids:
            sub |= keys(net.submit(i, 1))
        net.tick(1)
    return net, sub


def view_changes(net):
    return net.sent_by_type.get(Collect.TYPE, 0) + net.sent_by_type.get(Report.TYPE, 0)


def keep_submitting(net, sub, members, rounds, within):
    """One event per round from each of `members` in turn, each delivered at every one of them within `within` ticks."""
    for step in range(rounds):
        mine = keys(net.submit(members[step % len(members)], 1))
        sub |= mine
        net.run_until(lambda: all(mine <= keys(net.topic(i)) for i in members), within)


def taken_back(net, *restarted):
    """`restarted` start again; every member ends active in a view of all five, nobody fenced."""
    for i in restarted:
        net.restart(i)
    net.run_until(lambda: all(net.node(i).status == "active" and len(net.node(i).view.members) == 5
                              and not net.node(i).fenced for i in IDS), 900)
    net.tick(20)


@pytest.mark.parametrize("drop,quorum", [(0.0, 0), (0.2, 0), (0.1, 2), (0.2, 2)])
def test_a_crash_is_fenced_by_every_other_member_and_nobody_stops(drop, quorum):
    """e crashes mid-stream: the four others cap it, fence it at the same
    count, and deliver each other's events within a few ticks the whole time
    — no COLLECT, no REPORT, with lossy links too (caps are resent until
    every one is in).  e's restart is taken back; every event once, everywhere."""
    net, sub = streaming(commit_quorum=quorum)
    for a in IDS:
        for b in IDS:
            if a != b:
                net.drop(a, b, drop)
    before = view_changes(net)
    net.crash("e")
    keep_submitting(net, sub, LIVE, 40, within=20)  # suspect_ticks is 300
    assert view_changes(net) == before
    fences = {net.node(i).fenced.get("e") for i in LIVE}
    assert len(fences) == 1 and None not in fences, fences
    net.recover()
    taken_back(net, "e")
    assert not check_invariants(net, submitted=sub)
    assert all(len(net.topic(i)) == len(sub) for i in IDS)


def test_a_member_that_caps_a_live_one_lifts_its_cap_when_another_has_heard_it():
    """d's messages to c are lost for a while: c's order waits for d and c
    caps d.  The others hear d and answer NOCAP; c lifts its cap, fetches
    what it dropped, and nobody fences d or changes the view."""
    net, sub = streaming(seed=5)
    before = view_changes(net)
    net.cut_one_way("d", "c")
    for _ in range(30):  # a's events wait at c for d's clock report, which never comes
        sub |= keys(net.submit("a", 1))
        net.tick(1)
        if net.node("c")._cap_k == 3:  # c capped d (sender index 3)
            break
    assert net.node("c")._cap_k == 3
    assert net.sent_by_type.get(Cap.TYPE, 0) >= 1
    net.recover()
    net.run_until(lambda: net.node("c")._cap_k < 0, 30)
    assert net.sent_by_type.get(NoCap.TYPE, 0) >= 1 and net.node("c").stats["caps_lifted"] == 1
    keep_submitting(net, sub, IDS, 20, within=20)
    assert view_changes(net) == before and not any(net.node(i).fenced for i in IDS)
    assert not check_invariants(net, submitted=sub)


@pytest.mark.parametrize("alone", [40, 400])
def test_an_isolated_member_is_told_it_was_fenced_and_rejoins_as_a_new_incarnation(alone):
    """e is cut off, not dead: the others fence it and go on; e, alone,
    delivers nothing past the fence (for 400 ticks it also suspects them all
    and leads rounds nobody answers).  Once the partition heals the others
    answer its newer messages with FENCE: e hands its undelivered events
    back, takes incarnation + 1 (persisted before its JOIN leaves) and asks
    to be taken back, so one view change takes it in, led by another member
    from the others' reports.  One order everywhere, every event once."""
    net, sub = streaming(seed=7)
    e_inc, view = net.node("e").incarnation, net.node("a").view.view_id
    net.isolate("e")
    sub |= keys(net.submit("e", 3))  # cut by e, never capped in by anyone: ordered after its return
    keep_submitting(net, sub, LIVE, 20, within=20)
    assert all("e" in net.node(i).fenced for i in LIVE)
    e_had = len(net.topic("e"))
    net.tick(alone)
    assert len(net.topic("e")) == e_had  # a minority of one delivers nothing new
    net.recover()
    taken_back(net)
    assert not check_invariants(net, submitted=sub)
    assert all(len(net.topic(i)) == len(sub) for i in IDS)
    e = net.node("e")
    assert e.stats.get("fenced_rejoins") == 1 and e.incarnation == e_inc + 1
    assert net.members["e"].hard.incarnation == e_inc + 1  # persisted: a restart takes the next one
    assert sum(net.node(i).stats.get("fences_told", 0) for i in LIVE) >= 1
    assert all(net.node(i).view.view_id == view + 1 for i in IDS)  # one view change
    assert all(net.node(i).view.incarnations[IDS.index("e")] == e_inc + 1 for i in IDS)


def test_an_isolated_member_of_an_older_release_is_suspected_after_suspect_ticks_as_before():
    """e ignores a FENCE naming it (a release before the cut-off member's
    rejoin): it keeps speaking as its fenced incarnation, so the others
    suspect it after suspect_ticks and the view changes with e in it, as
    before; nothing is lost or doubled meanwhile."""
    from kdsync.core.fence import Fencing
    from kdsync.core.messages import Fence

    net, sub = streaming(seed=7)
    e = net.node("e")
    e._handlers[Fence] = lambda msg: Fencing._on_fence(e, msg)
    e_inc = e.incarnation
    net.isolate("e")
    keep_submitting(net, sub, LIVE, 20, within=20)
    assert all("e" in net.node(i).fenced for i in LIVE)
    net.recover()
    keep_submitting(net, sub, LIVE, 20, within=20)  # the others still deliver while they tell e
    assert all("e" in net.node(i).fenced for i in LIVE)
    taken_back(net)
    assert not check_invariants(net, submitted=sub)
    assert all(len(net.topic(i)) == len(sub) for i in IDS)
    assert net.node("e").incarnation == e_inc and not net.node("e").stats.get("fenced_rejoins")
    assert sum(net.node(i).stats.get("fences_told", 0) for i in LIVE) >= 2


def test_two_crashes_fence_nobody_and_the_view_changes_as_before():
    """d and e crash at once: no fence can be reached (every other member's
    cap is needed, and d's never comes), so the others suspect both after
    the silence and install a view of three; every event once."""
    net, sub = streaming(suspect_ticks=40)
    net.crash("d")
    net.crash("e")
    live = ("a", "b", "c")
    net.run_until(lambda: all(net.node(i).status == "active" and net.node(i).view.members == live for i in live),
                  300)
    assert not any(net.node(i).fenced for i in live)
    keep_submitting(net, sub, live, 10, within=20)
    taken_back(net, "d", "e")
    assert not check_invariants(net, submitted=sub)


def view_of(net, live, within):
    """Ticks until every one of `live` is active in a view of exactly `live`."""
    return net.run_until(lambda: all(net.node(i).status == "active" and net.node(i).view.members == live
                                     for i in live), within)


def test_two_crashes_are_suspected_once_unusually_silent_not_after_suspect_ticks():
    """d and e crash at once with a majority commit quorum: no fence can be
    reached, so the three others suspect both as soon as they are unusually
    silent and install a view of three long before the 300 ticks of
    suspect_ticks; every event once, the two restarts taken back."""
    net, sub = streaming()
    net.crash("d")
    net.crash("e")
    live = ("a", "b", "c")
    sub |= keys(net.submit("a", 1))  # waits for d's and e's clocks
    took = view_of(net, live, 100)  # suspect_ticks is 300
    assert took < 60, took
    assert sum(net.node(i).stats.get("silent_suspected", 0) for i in live) >= 2
    keep_submitting(net, sub, live, 10, within=20)
    taken_back(net, "d", "e")
    assert not check_invariants(net, submitted=sub)
    assert all(len(net.topic(i)) == len(sub) for i in IDS)


def test_with_commit_quorum_2_two_crashes_are_not_suspected_early():
    """Commit quorum 2 of five: the trim needs four reporters, so a view of
    the three left could not form before a return; nobody suspects early
    (a view change would only wedge them), and the restarts end the wait."""
    net, sub = streaming(commit_quorum=2)
    net.crash("d")
    net.crash("e")
    sub |= keys(net.submit("a", 1))  # waits for d's and e's clocks
    net.tick(100)
    assert not any(net.node(i).stats.get("silent_suspected") for i in ("a", "b", "c"))
    assert all(len(net.node(i).view.members) == 5 for i in ("a", "b", "c"))
    taken_back(net, "d", "e")
    assert not check_invariants(net, submitted=sub)
    assert all(len(net.topic(i)) == len(sub) for i in IDS)


@pytest.mark.parametrize("drop", [0.0, 0.2])
def test_two_members_cut_off_for_a_while_are_suspected_and_taken_back(drop):
    """d and e are cut off from the others (not crashed) and the links are
    lossy: the three others suspect them early and go on in a view of three;
    once the partition heals, d and e are told and taken back.  A false alarm
    costs view changes, never the order: every event once, everywhere."""
    net, sub = streaming()
    for a in IDS:
        for b in IDS:
            if a != b:
                net.drop(a, b, drop)
    net.partition(("a", "b", "c"), ("d", "e"))
    for i in IDS:
        sub |= keys(net.submit(i, 2))
    live = ("a", "b", "c")
    view_of(net, live, 250)
    keep_submitting(net, sub, live, 10, within=40)
    net.recover()
    taken_back(net)
    assert not check_invariants(net, submitted=sub)
    assert all(len(net.topic(i)) == len(sub) for i in IDS)


def test_a_crash_after_a_fence_trims_the_fenced_stream_at_the_fence():
    """e is fenced after its crash; then b crashes too and the view changes
    without either.  The trim ends e's stream where the fence did (the
    members that capped e never count its report, and every reporter capped
    it), so the three left and both returning members hold one order."""
    net, sub = streaming(suspect_ticks=60)
    net.crash("e")
    keep_submitting(net, sub, LIVE, 10, within=20)
    assert all("e" in net.node(i).fenced for i in LIVE)
    net.crash("b")
    live = ("a", "c", "d")
    sub |= keys(net.submit("a", 2))
    net.run_until(lambda: all(net.node(i).status == "active" and net.node(i).view.members == live for i in live),
                  400)
    keep_submitting(net, sub, live, 10, within=20)
    taken_back(net, "b", "e")
    assert not check_invariants(net, submitted=sub)
    assert all(len(net.topic(i)) == len(sub) for i in IDS)


def test_a_member_without_the_fence_keeps_the_view_change():
    """c runs a release (or a setting) without the crash fence: it never
    caps, so the others' caps never complete and e's crash changes the view
    as before — safe in a mixed group."""
    net, sub = streaming(suspect_ticks=40, without=("c",))
    net.crash("e")
    for step in range(300):  # events keep coming: the order waits for e, and the others cap it
        if all(net.node(i).status == "active" and net.node(i).view.members == LIVE for i in LIVE):
            break
        sub |= keys(net.submit(LIVE[step % 4], 1))
        net.tick(1)
    assert not any(net.node(i).fenced for i in LIVE) and net.sent_by_type.get(Cap.TYPE, 0) > 0
    keep_submitting(net, sub, LIVE, 10, within=20)
    assert not check_invariants(net, submitted=sub, live=LIVE)


@pytest.mark.parametrize("mutual", [False, True])
def test_a_capped_member_told_of_the_cap_may_lead_once_the_third_member_is_gone(mutual):
    """Three members: a and b lose each other while both hear c, so b caps a
    (and, `mutual`, a caps b); c crashes before it can call the alarm off.
    Wedged, b refused a as leader for good, and the view could not change
    without a's report (swarm clock seeds 8730099, 8731627).  Now a, told b
    capped it, trusts its own count no more, says so, and may lead: the view
    change takes the base path once c's restart says what it delivered.
    One order, every event once."""
    ids = ["a", "b", "c"]
    net, sub = streaming(seed=11, ids=ids, ticks=20)
    net.cut("a", "b")  # b hears nothing from a
    if mutual:
        net.cut("b", "a")
    cappers = ("a", "b") if mutual else ("b",)
    for _ in range(200):  # events keep coming: their order waits for the silent peer's clock
        sub |= keys(net.submit("a", 1)) | keys(net.submit("b", 1))
        net.tick(1)
        if all(net.node(i)._cap_k >= 0 for i in cappers):
            break
    assert all(net.node(i)._cap_k >= 0 for i in cappers), {i: net.node(i)._cap_k for i in ids}
    net.crash("c")
    net.recover()
    net.tick(400)  # c is suspected (300 ticks): a and b wedge, each capped by the other (or a by b)
    assert all(net.node(i).status == "wedged" for i in ("a", "b"))
    net.restart("c")
    assert_whole(net, ids, sub, members=3, within=3000)


def test_a_restart_of_the_fenced_member_may_lead_the_member_that_fenced_it():
    """Three members: a crashes and is fenced by b and c; c then stops
    cleanly, and a and c start again.  b, the one member that remembers the
    view, held its cap of a's old incarnation and refused the new one as
    leader, while a's ballots kept b's from c: wedged for good (swarm clock
    seed 8771237).  A new incarnation remembers nothing of the view (no trim
    takes its count), so b answers it as any restart, and the three form
    one view: one order, every event once."""
    ids = ["a", "b", "c"]
    net, sub = streaming(seed=5, ids=ids, ticks=20)
    old = net.node("a").incarnation
    net.crash("a")
    for step in range(200):  # events keep coming: their order waits for a's clock, and b and c cap a
        if all("a" in net.node(i).fenced for i in ("b", "c")):
            break
        sub |= keys(net.submit("bc"[step % 2], 1))
        net.tick(1)
    assert all("a" in net.node(i).fenced for i in ("b", "c"))
    net.stop("c")
    net.restart("a")
    net.restart("c")
    b = net.node("b")
    assert b.wedged and "a" in b.fenced

    def reports_to(inc):
        """b's answer to a COLLECT of a's incarnation `inc` with a ballot above every one b promised."""
        net._process_ready()
        before = net.sent_by_type.get(Report.TYPE, 0)
        b.receive("a", Collect("a", inc, b.view.view_id, (b.vc.promised[0] + 1, 0)).encode())
        net._process_ready()
        return net.sent_by_type.get(Report.TYPE, 0) - before

    assert reports_to(old) == 0  # the capped incarnation does not lead b
    assert reports_to(net.node("a").incarnation) == 1  # its restart does
    assert_whole(net, ids, sub, members=3, within=3000)



def test_a_member_capped_below_the_fence_is_sent_the_slots_it_lacks_before_it_fences():
    """e's last slots reach every member but c, then e crashes: c caps e one
    count or more below the others, and the fence is the largest cap.  The
    members that capped higher send c what it lacks as soon as its CAP
    comes; c keeps those slots aside (its cap's promise stands: nothing past
    it is counted or acknowledged) and takes them when it fences, instead
    of fetching them a round trip after (Region failure's crash, seed 30:
    391 ms, 3.6x the steady p99, Oregon asking Frankfurt).  One fence
    everywhere, every event once."""
    from kdsync.core.messages import SlotData

    net, sub = streaming()
    net.cut_one_way("e", "c")
    for _ in range(2):
        sub |= keys(net.submit("e", 1))
        net.tick(1)
    enqueue, held, ahead = net._enqueue, [], []

    def hold(a, b, data):  # the others' CAPs reach c late (c, nearest e, caps first: Oregon in Region failure)
        if isinstance(data, bytes) and b == "c" and not ahead:
            if data[1] == Cap.TYPE:
                held.append((a, b, data))
                return None
            if data[1] == SlotData.TYPE:
                ahead.append(a)
        return enqueue(a, b, data)

    net._enqueue = hold
    net.crash("e")
    net.recover()
    for step in range(100):  # the live ones stream on: their orders wait for e, and they cap it
        sub |= keys(net.submit(LIVE[step % 4], 1))
        net.tick(1)
        if ahead:
            break
    assert ahead  # a higher capper sent c the slots it lacks on c's CAP
    net._enqueue = enqueue
    for m in held:
        enqueue(*m)
    keep_submitting(net, sub, LIVE, 30, within=20)
    fences = {net.node(i).fenced.get("e") for i in LIVE}
    assert len(fences) == 1 and None not in fences, fences
    c = net.node("c")
    assert c._caps[(4, c._cap_a)]["c"] < fences.pop()  # c capped below the fence...
    assert c.stats.get("fence_slots_ahead", 0) >= 1 and c._fence_holder is None  # ...and had the rest, unasked
    taken_back(net, "e")
    assert not check_invariants(net, submitted=sub)
