"""Random fault schedules over 3–5 members, checked by an outside checker.

Each example draws a group (maybe with a witness), then a schedule of
submits, ticks, crashes, restarts, partitions, lossy/duplicating/reordering
links; then every fault heals, every crashed member restarts, and the group
must converge: agreement, integrity, origin order, no loss, no split brain.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kdsync.testing.clocks import ClockFault
from kdsync.testing.network import InMemoryNetwork, check_invariants

EXAMPLES = int(os.environ.get("KDSYNC_PROPERTY_EXAMPLES", "300"))
RUNS = {"count": 0}

op = st.one_of(
    st.tuples(st.just("submit"), st.integers(0, 4), st.integers(1, 30), st.integers(0, 1)),
    st.tuples(st.just("tick"), st.integers(1, 30)),
    st.tuples(st.just("crash"), st.integers(0, 4)),
    st.tuples(st.just("restart"), st.integers(0, 4)),
    st.tuples(st.just("isolate"), st.integers(0, 4)),
    st.tuples(st.just("split"), st.integers(1, 2)),
    st.tuples(st.just("lossy"), st.integers(0, 4), st.integers(0, 4), st.sampled_from([0.2, 0.5, 1.0])),
    st.tuples(st.just("dup")),
    st.tuples(st.just("reorder")),
    st.tuples(st.just("heal")),
)
# the clock protocol's schedules also skew, drift and jump members' clocks
clock_op = st.one_of(
    op,
    st.tuples(st.just("skew"), st.integers(0, 4), st.integers(-200_000, 200_000), st.integers(-5000, 5000)),
    st.tuples(st.just("jump"), st.integers(0, 4), st.integers(-300_000, 300_000)),
)


def run_schedule(n, witness, seed, ops, protocol="derecho", **cfg):
    ids = [f"m{i}" for i in range(n)]
    wit = (ids[-1],) if witness else ()
    net = InMemoryNetwork(ids, protocol=protocol, seed=seed, witnesses=wit,
                          **{"suspect_ticks": 8, "heartbeat_ticks": 2, "retransmit_ticks": 3, **cfg})
    members = [i for i in ids if i not in wit]
    submitted = set()
    down = set()
    for o in ops:
        kind = o[0]
        if kind == "submit":
            who = members[o[1] % len(members)]
            if who not in down:
                submitted |= {(e.origin, e.partition, e.offset) for e in net.submit(who, o[2], o[3])}
        elif kind == "tick":
            net.tick(o[1])
        elif kind == "crash":
            who = ids[o[1] % n]
            if who not in down:
                net.crash(who)
                down.add(who)
        elif kind == "restart":
            who = ids[o[1] % n]
            if who in down:
                net.restart(who)
                down.discard(who)
        elif kind == "isolate":
            net.isolate(ids[o[1] % n])
        elif kind == "split":
            net.partition(ids[: o[1]], ids[o[1] :])
        elif kind == "lossy":
            net.drop(ids[o[1] % n], ids[o[2] % n], o[3])
        elif kind == "dup":
            net.dup_prob = 0.3
        elif kind == "reorder":
            net.reorder = True
        elif kind == "heal":
            net.recover()
        elif kind == "skew":  # offset (µs) and drift (ppm) from now on
            net.clocks[ids[o[1] % n]] = ClockFault(o[2], o[3], net.clocks.get(ids[o[1] % n], ClockFault()).jumps)
        elif kind == "jump":  # the clock steps by o[2] µs now
            who = ids[o[1] % n]
            c = net.clocks.get(who, ClockFault())
            net.clocks[who] = ClockFault(c.offset_us, c.drift_ppm, c.jumps + ((net.time, o[2]),))
        # safety holds at every step, not only at the end
        assert not check_invariants(net), net.log
    net.recover()
    for who in sorted(down):
        net.restart(who)
    def converged():
        nodes = [net.node(i) for i in ids]
        if not all(x.status == "active" and len(x.view.members) == n for x in nodes):
            return False
        if len({x.view.view_id for x in nodes}) != 1:
            return False
        return all(len(net.topic(i)) >= len(submitted) for i in members)
    net.run_until(converged, max_ticks=3000)
    problems = check_invariants(net, submitted=submitted, live=members)
    assert not problems, (problems, net.log[-20:])
    if net.dormancy:  # and then the idle group falls asleep: nothing keeps a node awake for ever
        net.run_until(lambda: len(net.asleep()) == n, max_ticks=200)
    return net


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=not os.environ.get("KDSYNC_RANDOM"), phases=None if os.environ.get("KDSYNC_SHRINK") else [Phase.explicit, Phase.reuse, Phase.generate])
@given(n=st.integers(3, 5), witness=st.booleans(), seed=st.integers(0, 2**16), ops=st.lists(op, max_size=int(os.environ.get("KDSYNC_PROPERTY_OPS", "25"))))
def test_random_fault_schedules(n, witness, seed, ops):
    RUNS["count"] += 1
    run_schedule(n, witness, seed, ops)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=not os.environ.get("KDSYNC_RANDOM"), phases=None if os.environ.get("KDSYNC_SHRINK") else [Phase.explicit, Phase.reuse, Phase.generate])
@given(n=st.integers(3, 5), witness=st.booleans(), seed=st.integers(0, 2**16), ops=st.lists(op, max_size=int(os.environ.get("KDSYNC_PROPERTY_OPS", "25"))))
def test_random_fault_schedules_fail_over_sequencer(n, witness, seed, ops):
    """The leader-based baseline fails over through the same view change:
    the same schedules, the same invariants (no loss when the sequencer dies)."""
    run_schedule(n, witness, seed, ops, protocol="sequencer")


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=not os.environ.get("KDSYNC_RANDOM"), phases=None if os.environ.get("KDSYNC_SHRINK") else [Phase.explicit, Phase.reuse, Phase.generate])
@given(n=st.integers(3, 5), witness=st.booleans(), seed=st.integers(0, 2**16), quorum=st.sampled_from([0, 1, 2]),
       ops=st.lists(clock_op, max_size=int(os.environ.get("KDSYNC_PROPERTY_OPS", "25"))))
def test_random_fault_schedules_clock(n, witness, seed, quorum, ops):
    """The clock protocol: the same schedules plus skewed, drifting and
    jumping clocks and every commit quorum; the same invariants."""
    run_schedule(n, witness, seed, ops, protocol="clock", commit_quorum=quorum)


def test_property_runs_counted():
    # hypothesis runs the test above EXAMPLES times (plus shrinking on failure)
    assert EXAMPLES >= 100
