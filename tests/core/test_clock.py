"""The clock protocol's own rules, each driven into the case where getting it
wrong breaks an invariant (kdsync/core/clock.py): a slot is delivered only
once a majority holds it (C1), the view change trims at the maximum received
count and hands the slots some members lack to them (fetching what the
leader lacks), and a restarted member's report never counts for that
maximum."""

from kdsync.testing.clocks import ClockFault
from kdsync.testing.network import InMemoryNetwork, check_invariants

FAST = dict(suspect_ticks=8, heartbeat_ticks=2, retransmit_ticks=3)


def formed(ids=("a", "b", "c"), **kw):
    net = InMemoryNetwork(list(ids), protocol="clock", seed=kw.pop("seed", 3), **{**FAST, **kw})
    net.run_until(lambda: all(net.node(i).status == "active" for i in ids), 100)
    return net


def all_active(net, ids, n):
    return lambda: all(net.node(i) is not None and net.node(i).status == "active"
                       and len(net.node(i).view.members) == n for i in ids)


def run_through_a_restart(net, ticks, submit, who, crash_at, restart_at):
    """Tick `ticks` times, submitting `submit(t)` at each tick, `who` crashed
    at tick crash_at and restarted at restart_at; then heal, converge and
    check every invariant over what was submitted."""
    sub = []
    for t in range(ticks):
        sub += submit(t)
        if t == crash_at:
            net.crash(who)
        if t == restart_at:
            net.restart(who)
        net.tick()
    net.recover()
    net.run_until(lambda: all(len(net.topic(i)) == len(sub) for i in net.ids), 300)
    assert not check_invariants(net, submitted={(e.origin, e.partition, e.offset) for e in sub})


def test_a_slot_held_by_a_minority_is_not_delivered():
    net = formed(("a", "b", "c", "d", "e"))
    for p in ("c", "d", "e"):
        net.cut_one_way("a", p)  # a's slot reaches b only: 2 of 5 hold it
    net.submit("a", 3)
    net.tick(3)
    assert [len(net.topic(i)) for i in net.ids] == [0] * 5
    net.recover()
    net.run_until(lambda: all(len(net.topic(i)) == 3 for i in net.ids), 100)
    assert not check_invariants(net)


def test_the_trim_is_the_maximum_and_the_leader_fetches_what_it_lacks():
    # a's slot reaches c, not b: a and c hold it (a majority) and deliver it;
    # a dies; b leads the view change and lacks the slot: it must fetch it from
    # c and deliver it at the same position (a trim at the minimum drops it)
    net = formed()
    net.cut_one_way("a", "b")
    sub = net.submit("a", 4)
    net.tick(4)  # b's heartbeat carries its clock past the slot (C2 at c)
    assert len(net.topic("c")) == 4 and len(net.topic("b")) == 0
    net.crash("a")
    sub += net.submit("b", 2)
    net.run_until(all_active(net, ("b", "c"), 2), 200)
    net.run_until(lambda: len(net.topic("b")) == 6 and len(net.topic("c")) == 6, 100)
    assert net.topic("b") == net.topic("c")
    assert not check_invariants(net, live=("b", "c"))


def test_a_restarted_members_report_does_not_count_for_the_trim():
    # a and b hold a's slot and deliver it, c never sees it; b restarts (it forgot
    # what it acknowledged) and a dies: b (new) and c alone must not start the
    # next view below the delivered slot — they wait for a, then catch up from it
    net = formed()
    net.cut_one_way("a", "c")
    net.submit("a", 3)
    net.tick(4)
    assert len(net.topic("a")) == 3 and len(net.topic("b")) == 3 and len(net.topic("c")) == 0
    for m in ("a", "b"):
        net.members[m].durable_lag = True  # nothing of it is durable at b: b's restart forgets it
    net.flush("a")
    net.crash("b")
    net.crash("a")
    net.restart("b")
    net.recover()
    net.submit("c", 2)
    net.tick(60)
    assert len(net.topic("c")) == 0  # no view of b and c without a: a's delivered slot would be lost
    net.restart("a")
    net.run_until(all_active(net, net.ids, 3), 300)
    net.run_until(lambda: all(len(net.topic(i)) == 5 for i in net.ids), 200)
    assert not check_invariants(net)


def test_skewed_drifting_jumping_clocks_cost_no_safety():
    clocks = {"a": ClockFault(offset_us=40_000, drift_ppm=500),
              "b": ClockFault(offset_us=-30_000, jumps=((20_000, -50_000), (60_000, 90_000))),
              "c": ClockFault(drift_ppm=-800, jumps=((40_000, 70_000),))}
    net = InMemoryNetwork(["a", "b", "c"], protocol="clock", seed=9, clocks=clocks, **FAST)
    net.run_until(all_active(net, net.ids, 3), 100)
    net.reorder = True
    net.dup_prob = 0.1
    run_through_a_restart(net, 120, lambda t: [e for m in net.ids if (t + ord(m)) % 3 == 0 and net.node(m) is not None
                                               for e in net.submit(m, 2)], "c", 50, 80)


def test_a_smaller_commit_quorum_makes_the_view_change_wait_for_more_reports():
    # commit_quorum 2 of 5: a's slot held by a and b is delivered there; a and b
    # die; c, d, e are a majority but cannot tell what a and b delivered (3 < 5 - 2
    # + 1 reports): they must not start a view below it, and wait for a restart
    net = formed(("a", "b", "c", "d", "e"), commit_quorum=2)
    for p in ("c", "d", "e"):
        net.cut_one_way("a", p)
    net.submit("a", 3)
    net.tick(4)
    assert len(net.topic("a")) == 3 and len(net.topic("b")) == 3
    assert all(len(net.topic(m)) == 0 for m in ("c", "d", "e"))
    net.crash("a")
    net.crash("b")
    net.recover()
    net.submit("c", 2)
    net.tick(60)
    assert all(len(net.topic(m)) == 0 for m in ("c", "d", "e"))
    net.restart("b")  # amnesiac: its report cannot count for the trim either; a's topic may hold more
    net.tick(60)
    assert all(len(net.topic(m)) == 0 for m in ("c", "d", "e"))
    net.restart("a")  # everyone has reported: the base path starts after the highest position
    net.run_until(lambda: all(len(net.topic(m)) == 5 for m in net.ids), 400)
    assert not check_invariants(net)


def test_a_lead_is_a_clock_offset_and_costs_no_safety():
    net = InMemoryNetwork(["a", "b", "c"], protocol="clock", seed=4, **{**FAST, "clock_lead_us": 30_000})
    net.run_until(all_active(net, net.ids, 3), 100)
    sub = []
    for t in range(60):
        for m in net.ids:
            sub += net.submit(m, 1)
        net.tick()
    stamps = [net.node(m).stream.clock for m in net.ids]
    assert min(stamps) >= net.time + 30_000 + 10**12 - 1000  # stamps run a lead ahead of the clocks
    net.run_until(lambda: all(len(net.topic(i)) == len(sub) for i in net.ids), 200)
    assert not check_invariants(net, submitted={(e.origin, e.partition, e.offset) for e in sub})




def test_far_slots_acknowledged_late_keep_every_invariant_and_are_not_held_by_skew():
    """Far slots (old on arrival) are acknowledged together, within a
    quarter of their age counted in ticks (kdsync/core/clock.py,
    FAR_ACK_AGE_PART; the message economy is measured in
    tests/test_sim_scenarios.py).  Here c's clock runs 12 ms, then 10 s,
    ahead, so every slot looks old to it: c acknowledges no slower than
    every FAR_ACK_MAX_TICKS ticks whatever the skew, through a crash and a
    restart, with every invariant."""
    from kdsync.core.clock import FAR_ACK_MAX_TICKS

    for offset_us in (12_000, 10_000_000):
        net = formed(clocks={"c": ClockFault(offset_us=offset_us)})
        sent_to_a: list[int] = []
        enqueue = net._enqueue

        def counted(a, b, data, enqueue=enqueue, net=net, sent_to_a=sent_to_a):
            if a == "c" and b == "a":
                sent_to_a.append(net.time // net.TICK_US)
            enqueue(a, b, data)

        net._enqueue = counted
        run_through_a_restart(net, 90, lambda t, net=net: net.submit("a", 1) + (
            net.submit("b", 1) if net.node("b") is not None else []), "b", 40, 60)
        gaps = [y - x for x, y in zip(sent_to_a, sent_to_a[1:])]
        assert max(gaps) <= FAR_ACK_MAX_TICKS, (offset_us, max(gaps))


def test_a_joiners_reports_while_it_asks_to_be_taken_in_are_its_promise_in_the_view_that_takes_it_in():
    # c restarts and asks to be taken in, its clock 1 s ahead; a (the leader) hears
    # its JOIN and its clock reports, then nothing more from it; b never hears it (so
    # b's clock stays behind c's).  In the view that takes c in, a delivers b's
    # events at once: c promised past them before that view began (its hybrid clock
    # never goes back).  The code before waited for c's first report of the new
    # view, which never comes, until a suspected c (another view change).
    net = formed(clocks={"c": ClockFault(offset_us=1_000_000)})
    net.crash("c")
    net.run_until(all_active(net, ("a", "b"), 2), 100)
    net.cut_one_way("c", "b")
    net.restart("c")
    net.tick(1)  # c's JOIN and a report reach a
    net.cut_one_way("c", "a")
    net.run_until(all_active(net, ("a", "b"), 3), 100)
    views_a = len(net.views["a"])
    base = len(net.topic("a"))
    sub = net.submit("b", 3)
    net.run_until(lambda: len(net.topic("a")) == base + 3, 4)  # suspect_ticks is 8
    assert len(net.views["a"]) == views_a and "c" in net.node("a").view.members  # no view change since
    net.recover()
    net.run_until(lambda: all(len(net.topic(i)) == len(net.topic("a")) for i in net.ids), 200)
    assert not check_invariants(net, submitted={(e.origin, e.partition, e.offset) for e in sub})


def test_a_report_naming_a_newer_view_or_another_incarnation_promises_nothing_in_ours():
    # the promise of a report carries into later views of the same incarnation only:
    # one from a view newer than the receiver's (its sender may have cut slots of the
    # views between) or from another incarnation of the sender is no promise here
    from kdsync.core.messages import ClockAck

    net = formed()
    a = net.node("a")
    v = a.view
    k = v.senders.index("b")
    inc_b = v.incarnations[v.members.index("b")]
    before = a.stream.promise(k)
    far = before + 10**9
    for view, inc in ((v.view_id + 1, inc_b), (v.view_id - 1, inc_b + 1)):
        a._note_clock(ClockAck("b", inc, view, (0, 0, 0), (), 0, False, 0, far))
        assert a.stream.promise(k) == before
    a._note_clock(ClockAck("b", inc_b, v.view_id - 1, (0, 0, 0), (), 0, False, 0, far))
    assert a.stream.promise(k) == far  # an older view of the same incarnation: a promise here


def test_a_joiner_reports_each_heartbeat_a_heartbeat_ahead_and_stamps_above_it():
    # c restarts and asks to be taken in while the leader (a) cannot hear it: it
    # sends b a clock report each heartbeat, not each tick (a restarted member of a
    # thousand groups would send one per group per tick), each promising a
    # heartbeat and a tick ahead of its clock so that the promise holds until the
    # next one arrives; once taken in, its own slots are stamped above every clock
    # it reported (the hybrid clock carries the promise)
    from kdsync.core.messages import ClockAck, ClockAppend

    hb = 5
    net = formed(heartbeat_ticks=hb, suspect_ticks=20)
    net.crash("c")
    net.run_until(all_active(net, ("a", "b"), 2), 200)
    net.cut("c", "a")
    net.restart("c")
    c = net.node("c")
    reports, stamps = [], []
    send = c._send

    def spy(to, data):
        if to == "b" and data[1] == ClockAck.TYPE:
            reports.append((c.now_us + c.lead_us, c.codec.decode(bytes(data), "c")))
        elif data[1] == ClockAppend.TYPE:
            stamps.extend(ts for ts, _ in c.codec.decode(bytes(data), "c").slots)
        send(to, data)

    c._send = spy
    ticks = 8 * hb
    net.tick(ticks)
    assert c.status != "active"
    assert 6 <= len(reports) <= ticks // hb + 2, len(reports)  # each tick before: 24 in these 40 ticks
    tick_us = InMemoryNetwork.TICK_US
    ahead = [r.clock - at for at, r in reports]  # 0 while the tick's length is not measured yet
    assert ahead[-1] == (hb + 1) * tick_us and all(a in (0, (hb + 1) * tick_us) for a in ahead), ahead
    net.recover()
    net.run_until(all_active(net, ("a", "b", "c"), 3), 300)
    sub = net.submit("c", 2)
    net.stabilize()
    assert stamps and min(stamps) > max(r.clock for _, r in reports)
    net.run_until(lambda: all(len(net.topic(i)) == len(net.topic("a")) for i in net.ids), 200)
    assert not check_invariants(net, submitted={(e.origin, e.partition, e.offset) for e in sub})
