"""Dormant groups and the member's shared liveness (kdsync.core.liveness,
issue 26): an idle node sleeps (not ticked, sends nothing), wakes on input
within the time an awake node takes, and a dead peer is still suspected in
about suspect_ticks by every group.  Driven through the in-memory network's
dormancy (each member pings its peers over the same faulty links), with the
same random fault schedules and outside invariants as test_properties.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kdsync.core.liveness import Dormancy, PeerLiveness
from kdsync.testing.network import InMemoryNetwork, check_invariants

from test_properties import clock_op, op, run_schedule

FAST = dict(suspect_ticks=8, heartbeat_ticks=2, retransmit_ticks=3)
IDS = ("a", "b", "c")
EXAMPLES = int(os.environ.get("KDSYNC_DORMANCY_EXAMPLES", "120"))
PROPS = dict(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
             derandomize=not os.environ.get("KDSYNC_RANDOM"),
             phases=None if os.environ.get("KDSYNC_SHRINK") else [Phase.explicit, Phase.reuse, Phase.generate])


def _formed(protocol="derecho", **kw) -> InMemoryNetwork:
    net = InMemoryNetwork(IDS, protocol=protocol, dormancy=True, **FAST, **kw)
    net.run_until(lambda: all(net.node(i).status == "active" for i in IDS))
    return net


@pytest.mark.parametrize("protocol", ["derecho", "clock", "sequencer"])
def test_an_idle_group_sleeps_and_sends_one_ping_per_peer_and_nothing_else(protocol):
    """Every member's pings carry the same ViewDigest: no idle heartbeat round
    (nothing a round could tell); with a digest that differs, the rounds come
    back, one per sleeper per idle_ticks."""
    net = _formed(protocol)
    for i in IDS:
        net.submit(i, 5)
    net.run_until(lambda: all(len(net.topic(i)) == 15 for i in IDS))
    net.run_until(lambda: len(net.asleep()) == 3, max_ticks=50)
    sent, pings = sum(net.sent_by_type.values()), net.pings
    net.tick(800)
    assert all(net.live[i].views_agree() for i in IDS)
    assert sum(net.sent_by_type.values()) == sent  # pings only
    assert net.pings - pings == 800 // FAST["heartbeat_ticks"] * 3 * 2
    # a peer whose digest differs (as from a member in another view): idle rounds again
    net.live["a"].views_agree = lambda: False
    sent = sum(net.sent_by_type.values())
    net.tick(800)
    idle = net.dorm["a"].idle_ticks
    assert idle == 10 * FAST["suspect_ticks"]
    rounds = 800 // idle + 1  # a's sleeper wakes for one heartbeat round per idle_ticks
    got = sum(net.sent_by_type.values()) - sent
    assert 0 < got <= rounds * 3 * 2 * 2, got  # the peers it wakes answer and heartbeat once too
    net.run_until(lambda: len(net.asleep()) == 3, max_ticks=50)
    assert not check_invariants(net, live=list(IDS))


def test_a_member_left_in_an_older_view_hears_of_the_newer_one_at_the_next_idle_round():
    """c's links to a and b lose everything c sends: a and b suspect c and go
    on without it, while c, which still hears their pings, sleeps on in the
    old view.  Once c's frames get through again, its next idle heartbeat
    round tells it of the newer view and it rejoins."""
    net = _formed("derecho")
    net.tick(20)
    assert len(net.asleep()) == 3
    net.cut_one_way("c", "a")
    net.cut_one_way("c", "b")
    net.run_until(lambda: all(net.node(i).view.members == ("a", "b") for i in ("a", "b")), max_ticks=100)
    assert net.node("c").view.members == IDS
    net.recover()
    t = net.run_until(lambda: all(len(net.node(i).view.members) == 3 and net.node(i).status == "active"
                                  for i in IDS) and net.node("c").view.view_id == net.node("a").view.view_id,
                      max_ticks=400)
    assert t <= net.dorm["c"].idle_ticks + 100, t
    net.submit("a", 2)
    net.run_until(lambda: all(len(net.topic(i)) == 2 for i in IDS))
    assert not check_invariants(net, live=list(IDS))


@pytest.mark.parametrize("protocol", ["derecho", "clock", "sequencer"])
def test_a_record_at_a_sleeping_group_is_delivered_as_fast_as_by_an_awake_one(protocol):
    def ticks_to_deliver(dormancy: bool) -> int:
        net = InMemoryNetwork(IDS, protocol=protocol, dormancy=dormancy, **FAST)
        net.run_until(lambda: all(net.node(i).status == "active" for i in IDS))
        net.tick(100)
        if dormancy:
            assert len(net.asleep()) == 3
        net.submit("b", 1)
        t = net.run_until(lambda: all(len(net.topic(i)) == 1 for i in IDS), max_ticks=100)
        assert not check_invariants(net, live=list(IDS))
        return t

    awake, asleep = ticks_to_deliver(False), ticks_to_deliver(True)
    assert asleep <= awake + FAST["heartbeat_ticks"], (awake, asleep)


@pytest.mark.parametrize("protocol", ["derecho", "clock"])
def test_a_peer_that_dies_while_every_group_sleeps_is_suspected_in_suspect_ticks(protocol):
    net = _formed(protocol)
    net.tick(50)
    assert len(net.asleep()) == 3
    net.crash("c")
    t = net.run_until(lambda: all(net.node(i).view.members == ("a", "b") and net.node(i).status == "active"
                                  for i in ("a", "b")), max_ticks=200)
    # silent for suspect_ticks at the member, then the woken nodes suspect it at their next tick
    assert t <= FAST["suspect_ticks"] + 2 * FAST["heartbeat_ticks"] + 3 * FAST["retransmit_ticks"], t
    net.submit("a", 3)
    net.run_until(lambda: len(net.topic("b")) == 3)
    net.restart("c")
    net.run_until(lambda: all(net.node(i).status == "active" and len(net.node(i).view.members) == 3 for i in IDS),
                  max_ticks=400)
    net.run_until(lambda: len(net.topic("c")) == 3)
    assert not check_invariants(net, live=list(IDS))


def test_a_lost_acknowledgement_is_sent_again_so_the_sender_can_sleep():
    net = _formed("derecho")
    net.tick(20)
    net.drop("b", "a", 1.0)  # every acknowledgement b sends a is lost
    net.submit("a", 4)
    net.tick(30)
    assert "a" not in net.asleep(), "a slept with an unacknowledged slot"
    net.recover()
    net.run_until(lambda: len(net.asleep()) == 3, max_ticks=60)
    assert all(len(net.topic(i)) == 4 for i in IDS)


def test_nobody_sleeps_until_every_peer_speaks_the_liveness_protocol():
    live = PeerLiveness(["b", "c"], heartbeat_ticks=2, suspect_ticks=8)
    d = Dormancy(live)

    class Quiet:
        now = 0

        def dormant(self):
            return True

        def wake(self, ticks, ago):
            self.now += ticks
            self.ago = ago

    n = Quiet()
    live.heard("b", ping=True)
    live.heard("c")  # an older member: its frames arrive, it never pings
    assert not d.try_sleep("t", n)
    live.heard("c", ping=True)
    assert d.try_sleep("t", n) and d.is_asleep("t")
    for _ in range(5):
        live.tick()
    live.heard("b")
    d.wake("t", n)
    assert n.now == 5 and n.ago == {"b": 0, "c": 5} and not d.is_asleep("t")
    for _ in range(9):
        live.tick()
    assert live.newly_silent() == {"b", "c"} and live.newly_silent() == frozenset()


@settings(**PROPS)
@given(n=st.integers(3, 5), witness=st.booleans(), seed=st.integers(0, 2**16), ops=st.lists(op, max_size=25))
def test_random_fault_schedules_with_sleeping_groups(n, witness, seed, ops):
    run_schedule(n, witness, seed, ops, dormancy=True)


@settings(**PROPS)
@given(n=st.integers(3, 5), witness=st.booleans(), seed=st.integers(0, 2**16), quorum=st.sampled_from([0, 1, 2]),
       ops=st.lists(clock_op, max_size=25))
def test_random_fault_schedules_clock_with_sleeping_groups(n, witness, seed, quorum, ops):
    run_schedule(n, witness, seed, ops, protocol="clock", commit_quorum=quorum, dormancy=True)


@settings(**PROPS)
@given(n=st.integers(3, 5), witness=st.booleans(), seed=st.integers(0, 2**16), ops=st.lists(op, max_size=25))
def test_random_fault_schedules_sequencer_with_sleeping_groups(n, witness, seed, ops):
    run_schedule(n, witness, seed, ops, protocol="sequencer", dormancy=True)
