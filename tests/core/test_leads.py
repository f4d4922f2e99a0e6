"""The clock protocol's automatic lead (kdsync/core/leads.py): round trips
timed from the member's own slots, rows gossiped, docs/wan.md's rule applied
only once every row is known, and a bad DELAYS frame refused."""

import pytest

from kdsync.core.errors import RemoteProtocolError
from kdsync.core.leads import PROBE_EVERY_US, Leads
from kdsync.core.messages import Delays
from kdsync.testing.network import InMemoryNetwork, check_invariants

MS = 1000


def measured(me, rtt_ms: dict[str, float]) -> Leads:
    """A Leads that timed one slot to each peer with these round trips."""
    le = Leads(me)
    le.on_cut(0, rtt_ms, 0)
    for p, r in rtt_ms.items():
        le.on_ack(p, 1, int(r * MS))
    return le


def test_a_round_trip_is_the_smallest_recent_sample_and_one_slot_is_timed_at_a_time():
    le = Leads("a")
    le.on_cut(0, ["b"], 0)
    le.on_cut(1, ["b"], 10 * MS)  # the first is still in flight: not re-timed
    le.on_ack("b", 1, 90 * MS)  # counts slot 0: 90 ms
    le.on_ack("b", 2, 95 * MS)  # the same probe, already answered
    assert le.row() == {"b": 45 * MS}
    le.on_cut(2, ["b"], 50 * MS)  # within PROBE_EVERY_US of the last probe: not timed
    le.on_ack("b", 3, 60 * MS)
    assert le.row() == {"b": 45 * MS}
    t = PROBE_EVERY_US
    le.on_cut(3, ["b"], t)
    le.on_ack("b", 3, t + 10 * MS)  # does not count slot 3 yet
    le.on_ack("b", 4, t + 70 * MS)  # a faster round trip: the minimum wins
    assert le.row() == {"b": 35 * MS}
    le.on_cut(4, ["b"], 3 * t)
    le.on_ack("b", 5, 3 * t + 200 * MS)  # queueing only adds: the minimum stays
    assert le.row() == {"b": 35 * MS}


def test_the_rule_gives_the_far_member_the_gap_and_waits_for_every_row():
    # far is 90 ms from everyone; the others are 30 ms apart
    le = measured("far", {"a": 180, "b": 180, "c": 176})
    members = ["a", "b", "c", "far"]
    assert le.choose(members) == 0  # no row from the others yet: unchanged
    le.on_row("a", {"b": 30 * MS, "c": 30 * MS, "far": 90 * MS})
    le.on_row("b", {"a": 30 * MS, "c": 30 * MS, "far": 90 * MS})
    assert le.choose(members) == 0  # c's row is missing
    le.on_row("c", {"a": 30 * MS, "b": 31 * MS})  # c has no estimate to far yet: not needed by the rule
    assert le.choose(members) == 90 * MS - 31 * MS  # its farthest (90) minus the largest between others (31)
    le.on_row("c", {"a": 30 * MS, "b": 80 * MS})
    assert le.choose(members) == 10 * MS
    le.on_row("c", {"a": 30 * MS, "b": 80_500})
    assert le.choose(members) == 10 * MS  # moves by less than MIN_STEP_US: unchanged


def test_the_lead_stays_below_most_of_the_nearest_delay_and_is_never_negative():
    le = measured("a", {"b": 20, "c": 300})  # 10 ms to b, 150 to c
    le.on_row("b", {"c": 5 * MS, "a": 10 * MS})
    le.on_row("c", {"b": 5 * MS, "a": 150 * MS})
    assert le.choose(["a", "b", "c"]) == int(0.75 * 10 * MS)
    near = measured("b", {"a": 20, "c": 10})
    near.on_row("a", {"c": 150 * MS, "b": 10 * MS})
    near.on_row("c", {"a": 150 * MS, "b": 5 * MS})
    assert near.choose(["a", "b", "c"]) == 0


def test_a_row_goes_out_when_it_moves_and_to_a_views_new_members():
    le = measured("a", {"b": 100, "c": 100})
    le.new_view(["a", "b", "c"])
    to, row = le.due(["b", "c"])
    assert sorted(to) == ["b", "c"] and row == {"b": 50 * MS, "c": 50 * MS}
    assert le.due(["b", "c"])[0] == []  # unchanged: nothing to send
    le.new_view(["a", "b", "c", "d"])  # d is new: it gets the row
    assert le.due(["b", "c", "d"])[0] == ["d"]
    le.on_cut(5, ["b"], 10**7)
    le.on_ack("b", 6, 10**7 + 60 * MS)  # b moved from 50 to 30 ms: everyone gets it
    assert sorted(le.due(["b", "c", "d"])[0]) == ["b", "c", "d"]


def test_a_bad_delays_frame_is_refused_and_the_node_carries_on():
    net = InMemoryNetwork(["a", "b", "c"], protocol="clock", seed=5, suspect_ticks=8, heartbeat_ticks=2,
                          retransmit_ticks=3, auto_lead=True)
    net.run_until(lambda: all(net.node(i).status == "active" for i in net.ids), 100)
    node = net.node("a")
    view = node.view.view_id
    for bad in (Delays("b", node.view.incarnations[1], view, ("a", "c"), (5,)),  # one delay short
                Delays("b", node.view.incarnations[1], view, ("b",), (5,)),  # to itself
                Delays("b", node.view.incarnations[1], view, ("a",), (61_000_000,))):  # over a minute
        with pytest.raises(RemoteProtocolError):
            node.receive("b", bad.encode())
    sub = []
    for _ in range(40):
        for m in net.ids:
            sub += net.submit(m, 1)
        net.tick()
    net.run_until(lambda: all(len(net.topic(i)) == len(sub) for i in net.ids), 200)
    assert not check_invariants(net, submitted={(e.origin, e.partition, e.offset) for e in sub})
