"""An idle member's clock: `quiet()` and the late ticks of `kdsync run`.

While every node is quiet (NodeBase.quiet) the member's tick timer skips a
period and runs the pair of ticks at the next one; any input runs the ticks
already due first, and input that makes a node busy puts the timer back on
time (kdsync/ticks.py, TickClock).  `LateClock` is that rule over the
in-memory network, member by member; the tests drive it through crashes,
restarts, partitions and loss and check the outside invariants.
"""

import random

import pytest

from kdsync.testing.network import InMemoryNetwork, check_invariants

FAST = dict(suspect_ticks=8, heartbeat_ticks=2, retransmit_ticks=3)
IDS = ("a", "b", "c")


class LateClock:
    """kdsync run's tick timer, one `period()` per tick period, per member."""

    def __init__(self, net: InMemoryNetwork):
        self.net = net
        self.owed = {i: 0 for i in net.ids}  # ticks due and not run yet
        self.skipping = {i: False for i in net.ids}  # the timer is armed one period late
        self.wakeups = self.skipped = 0
        net.before_input = self.due

    def due(self, i: str) -> None:
        """Input is about to reach i: the ticks already due run first."""
        node = self.net.node(i)
        for _ in range(self.owed[i]):
            node.tick()
        self.owed[i] = 0

    def period(self) -> None:
        net, ran = self.net, []
        for i in net.ids:
            node = net.node(i)
            if node is None:
                self.owed[i], self.skipping[i] = 0, False
                continue
            self.owed[i] += 1
            if self.skipping[i] and node.quiet():  # still quiet: the timer fires a period later
                self.skipping[i] = False
                self.skipped += 1
                continue
            self.due(i)
            self.wakeups += 1
            ran.append(i)
        net.stabilize(max_rounds=50)
        for i in ran:  # each re-arms its timer: late while quiet
            self.skipping[i] = net.node(i) is not None and net.node(i).quiet()

    def run_until(self, cond, max_periods: int = 400) -> int:
        for t in range(max_periods):
            if cond():
                return t
            self.period()
        raise AssertionError(f"not reached in {max_periods} periods; {self.net.describe()}")


def everyone_active(net, members):
    def cond():
        return all(net.node(i) is not None and net.node(i).status == "active"
                   and tuple(net.node(i).view.members) == tuple(members) for i in members)
    return cond


def delivered(net, members, n):
    return lambda: all(net.topic_len(i) >= n for i in members)


def keys(evs):
    return {(e.origin, e.partition, e.offset) for e in evs}


def test_quiet_only_when_nothing_waits_on_a_timer():
    net = InMemoryNetwork(list(IDS), seed=5, **FAST)
    assert not any(net.node(i).quiet() for i in IDS)  # forming: the view change runs on ticks
    net.run_until(everyone_active(net, IDS), 100)
    net.tick(FAST["heartbeat_ticks"] + 1)  # the nulls' acknowledgements ride on a heartbeat
    assert all(net.node(i).quiet() for i in IDS)

    net.submit("a", 3)
    assert not net.node("a").quiet()  # pending data
    net.stabilize()
    net.tick(FAST["heartbeat_ticks"] + 1)
    assert all(net.node(i).quiet() for i in IDS) and net.topic_len("b") == 3

    net.cut_one_way("a", "b")  # a's next slot is lost on its way to b: a must retransmit
    net.submit("a", 1)
    net.stabilize()
    net.tick(FAST["heartbeat_ticks"] + 1)
    assert not net.node("a").quiet()
    net.recover()
    net.tick(FAST["retransmit_ticks"] + FAST["heartbeat_ticks"] + 2)
    assert all(net.node(i).quiet() for i in IDS) and all(net.topic_len(i) == 4 for i in IDS)

    net.crash("c")  # silence: suspicion, then a view change — never quiet meanwhile
    net.tick(FAST["suspect_ticks"] + 1)
    assert not net.node("a").quiet() and not net.node("b").quiet()
    assert check_invariants(net, submitted=keys(net.sources["a"])) == []


def test_an_idle_group_wakes_half_as_often_and_still_sees_a_crash_in_time():
    net = InMemoryNetwork(list(IDS), seed=7, **FAST)
    clock = LateClock(net)
    clock.run_until(everyone_active(net, IDS))
    sent = [e for i in IDS for e in net.submit(i, 5)]
    clock.run_until(delivered(net, IDS, 15))
    clock.wakeups = clock.skipped = 0
    for _ in range(40):
        clock.period()
    assert clock.skipped >= 50 and clock.wakeups <= 70, (clock.wakeups, clock.skipped)  # 3 x 40 periods, ~half

    net.crash("c")  # while every member runs its ticks late
    t = clock.run_until(everyone_active(net, ("a", "b")))
    # suspicion after suspect_ticks of silence, at most one period late, then the view change
    assert t <= FAST["suspect_ticks"] + 12, t
    sent += net.submit("a", 4) + net.submit("b", 4)
    clock.run_until(delivered(net, ("a", "b"), 23))
    net.restart("c")
    clock.run_until(everyone_active(net, IDS))
    clock.run_until(delivered(net, IDS, 23))
    assert check_invariants(net, submitted=keys(sent)) == []


@pytest.mark.parametrize("seed", range(12))
def test_late_ticks_keep_every_invariant_under_faults(seed):
    rng = random.Random(seed)
    net = InMemoryNetwork(list(IDS), seed=seed, **FAST)
    clock = LateClock(net)
    clock.run_until(everyone_active(net, IDS))
    sent = []
    for _ in range(120):
        r = rng.random()
        up = [i for i in IDS if net.node(i) is not None]
        if r < 0.25 and up:
            sent += net.submit(rng.choice(up), rng.randint(1, 4))
        elif r < 0.30 and len(up) == 3:
            net.crash(rng.choice(up))
        elif r < 0.36:
            down = [i for i in IDS if net.node(i) is None]
            if down:
                net.restart(rng.choice(down))
        elif r < 0.40:
            a, b = rng.sample(IDS, 2)
            net.cut(a, b)
        elif r < 0.44:
            a, b = rng.sample(IDS, 2)
            net.drop(a, b, 0.3)
        elif r < 0.52:
            net.recover()
        for _ in range(rng.randint(1, 6)):  # idle stretches: quiet members run their ticks late
            clock.period()
    net.recover()
    for i in IDS:
        if net.node(i) is None:
            net.restart(i)
    clock.run_until(everyone_active(net, IDS), 600)
    n = len({(e.origin, e.partition, e.offset) for e in net.sources.get("a", []) + net.sources.get("b", [])
             + net.sources.get("c", [])})
    clock.run_until(delivered(net, IDS, n), 600)
    assert clock.skipped > 0  # the late path ran
    assert check_invariants(net, submitted=keys(sent)) == []


def test_forming_slots_bound_the_view_changes_ticked_at_once_and_starve_none():
    """kdsync.ticks.FormingSlots (issue 26): at most `slots` groups in a
    view change are ticked at once, first come first served; a group still
    in its view change after `slice` ticks goes behind the others waiting
    (so groups that cannot form never starve those that can); a group out of
    its view change is always ticked and frees its slot."""
    from kdsync.ticks import FormingSlots

    fs = FormingSlots(slots=2, slice_ticks=3)
    topics = [f"t{i}" for i in range(5)]
    ticked: dict[str, int] = {t: 0 for t in topics}
    first_tick: dict[str, int] = {}
    for tick in range(60):
        fs.refill()
        now = [t for t in topics if fs.tick_wanted(t, "forming")]
        assert len(now) <= 2
        for t in now:
            ticked[t] += 1
            first_tick.setdefault(t, tick)
    # every group had turns, in arrival order, and nobody waited more than a round of turns
    assert all(n >= 60 * 2 // 5 - 3 for n in ticked.values()), ticked
    assert sorted(first_tick, key=first_tick.get) == topics
    assert max(first_tick.values()) <= 1 + 3 * 2
    # an active group is ticked whatever the slots, and a group leaving its view change frees a slot
    assert fs.tick_wanted("other", "active")
    fs.refill()
    admitted = set(fs.admitted)
    t = next(iter(admitted))
    assert fs.tick_wanted(t, "active") and t not in fs.admitted
    fs.refill()
    assert len(fs.admitted) == 2 and fs.waiting == 5 - 1 - 2  # t left its view change
    # alone in its view change, a group keeps its slot past the slice
    solo = FormingSlots(slots=1, slice_ticks=2)
    solo.refill()
    assert not solo.tick_wanted("a", "wedged")
    solo.refill()
    assert all(solo.tick_wanted("a", "wedged") for _ in range(10))
