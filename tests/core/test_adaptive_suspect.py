"""Adaptive suspicion (kdsync.core.liveness, `[protocol] adaptive_suspect`,
issue 42): suspect_ticks becomes a ceiling, and a peer whose pings came
regularly is suspected after ADAPT_GAPS x its longest ping gap (at least
ADAPT_FLOOR_HEARTBEATS heartbeats).  Unit checks of the limit, then the
in-memory network: a crashed member is removed in a few heartbeats instead of
suspect_ticks, and random fault schedules (partitions, loss, crashes,
restarts) with the early suspicions they cause keep every invariant."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kdsync.core.liveness import ADAPT_FLOOR_HEARTBEATS, ADAPT_GAPS, ADAPT_SAMPLES, PeerLiveness
from kdsync.testing.network import InMemoryNetwork, check_invariants

from test_liveness_tolerance import HB, _pings
from test_properties import clock_op, op, run_schedule

S = 40


def _live(adaptive=True) -> PeerLiveness:
    return PeerLiveness(["b", "c"], heartbeat_ticks=HB, suspect_ticks=S, adaptive=adaptive)


def _silent_after(live: PeerLiveness, peer: str) -> int:
    live.newly_silent()
    for k in range(1, 10 * S):
        live.tick()
        if live.now % HB == 0:
            live.heard("c" if peer == "b" else "b", ping=True)
        new = live.newly_silent()
        if new:
            assert new == {peer} and live.silent == {peer}
            return k
    raise AssertionError("never silent")


def test_regular_pings_make_a_dead_peer_silent_in_a_few_heartbeats_not_suspect_ticks():
    live = _live()
    _pings(live, 40)
    expect = max(ADAPT_GAPS * HB, ADAPT_FLOOR_HEARTBEATS * HB)
    assert live.limit("b") == expect < S
    assert _silent_after(live, "b") == expect + 1
    live.heard("b", ping=True)  # heard again: no longer silent
    live.newly_silent()
    assert live.silent == frozenset()


def test_without_adaptive_or_before_enough_pings_the_limit_is_suspect_ticks():
    fixed = _live(adaptive=False)
    _pings(fixed, 40)
    assert fixed.limit("b") == S and _silent_after(fixed, "b") == S + 1
    young = _live()
    _pings(young, HB * ADAPT_SAMPLES)  # the first ping has no gap: one sample short
    assert young.limit("b") == S


def test_a_late_or_lost_ping_widens_the_limit_and_the_ceiling_holds():
    live = _live()
    _pings(live, 40)
    for _ in range(5 * HB):  # b's pings are lost for four heartbeats: a gap of 5
        live.tick()
        live.heard("c", ping=True)
    live.heard("b", ping=True)
    assert live.limit("b") == ADAPT_GAPS * 5 * HB and live.limit("c") == ADAPT_FLOOR_HEARTBEATS * HB
    for _ in range(S - 2):  # a gap just inside the ceiling (a near miss): the limit is the ceiling then
        live.tick()
        live.heard("c", ping=True)
    live.heard("b", ping=True)
    assert live.limit("b") == S + live.tolerance("b")


def test_the_members_own_lateness_is_added():
    live = _live()
    _pings(live, 40)
    live.late(7)
    assert live.limit("b") == ADAPT_FLOOR_HEARTBEATS * HB + 7


NET = dict(suspect_ticks=S, heartbeat_ticks=HB, retransmit_ticks=3)


@pytest.mark.parametrize("protocol", ["derecho", "clock"])
def test_a_crashed_member_is_removed_in_a_few_heartbeats(protocol):
    def removal(adaptive: bool) -> int:
        ids = ("a", "b", "c", "d", "e")
        net = InMemoryNetwork(ids, protocol=protocol, dormancy=True, adaptive_suspect=adaptive, **NET)
        net.run_until(lambda: all(net.node(i).status == "active" for i in ids))
        net.submit("a", 5)
        net.tick(60)  # enough pings for the adaptive limit
        net.crash("e")
        live = ("a", "b", "c", "d")
        t = net.run_until(lambda: all(net.node(i).view.members == live and net.node(i).status == "active"
                                      for i in live), max_ticks=400)
        net.submit("b", 5)
        net.run_until(lambda: all(len(net.topic(i)) == 10 for i in live))
        assert not check_invariants(net, live=list(live))
        return t

    fast, slow = removal(True), removal(False)
    assert slow > S, slow
    assert fast <= ADAPT_FLOOR_HEARTBEATS * HB + S // 2 < slow, (fast, slow)


EXAMPLES = int(os.environ.get("KDSYNC_DORMANCY_EXAMPLES", "120")) // 2
PROPS = dict(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
             derandomize=not os.environ.get("KDSYNC_RANDOM"),
             phases=None if os.environ.get("KDSYNC_SHRINK") else [Phase.explicit, Phase.reuse, Phase.generate])
# suspect_ticks well above the pings' gaps, so that suspicions come early (and,
# under loss and partitions, falsely): safety must not care
ADAPT = dict(dormancy=True, adaptive_suspect=True, suspect_ticks=24)


@settings(**PROPS)
@given(n=st.integers(3, 5), witness=st.booleans(), seed=st.integers(0, 2**16), ops=st.lists(op, max_size=25))
def test_random_fault_schedules_with_adaptive_suspicion(n, witness, seed, ops):
    run_schedule(n, witness, seed, ops, **ADAPT)


@settings(**PROPS)
@given(n=st.integers(3, 5), witness=st.booleans(), seed=st.integers(0, 2**16), quorum=st.sampled_from([0, 1, 2]),
       ops=st.lists(clock_op, max_size=25))
def test_random_fault_schedules_clock_with_adaptive_suspicion(n, witness, seed, quorum, ops):
    run_schedule(n, witness, seed, ops, protocol="clock", commit_quorum=quorum, **ADAPT)
