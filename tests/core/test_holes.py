"""A lost slot message is asked for by its receiver (kdsync/core/holes.py):
the hole is seen when a later message's slots arrive first, or when the
sender's own count (derecho: its acknowledgement vector; clock: its clock
report) says more slots exist, and the sender answers within a round trip —
long before its own retransmission (retransmit + heartbeat ticks without
acknowledgement progress).  Every member ends with the same sequence, each
event once."""

import pytest

from kdsync.core.messages import Append, ClockAppend, SlotReq
from kdsync.testing.network import InMemoryNetwork, check_invariants

# the sender's own retransmission would come after 22 ticks
SLOW_RETRANSMIT = dict(suspect_ticks=80, heartbeat_ticks=2, retransmit_ticks=20)
APPEND = {"derecho": Append.TYPE, "clock": ClockAppend.TYPE}


def formed(protocol: str) -> InMemoryNetwork:
    net = InMemoryNetwork(["a", "b", "c"], protocol=protocol, seed=3, **SLOW_RETRANSMIT)
    net.run_until(lambda: all(net.node(i).status == "active" for i in net.ids), 100)
    return net


def settled(net, sub) -> None:
    assert not check_invariants(net, submitted={(e.origin, e.partition, e.offset) for e in sub})


@pytest.mark.parametrize("protocol", sorted(APPEND))
def test_a_lost_slot_message_is_asked_for_when_the_next_one_arrives(protocol):
    net = formed(protocol)
    lost = net.lose_next("a", "b", APPEND[protocol])
    asked = net.sent_by_type.get(SlotReq.TYPE, 0)
    sub = net.submit("a", 2)
    net.tick()
    assert lost == [1] and len(net.topic("b")) == 0
    sub += net.submit("a", 2)  # a's next slots reach b first: the earlier ones are a hole
    net.run_until(lambda: all(len(net.topic(i)) == 4 for i in net.ids), 8)
    assert net.sent_by_type.get(SlotReq.TYPE, 0) > asked  # b asked; a's retransmission was 14+ ticks away
    assert net.node("b").stats["holes_asked"] >= 1 and net.node("c").stats["holes_asked"] == 0  # kdsync_core_events_total
    settled(net, sub)


@pytest.mark.parametrize("protocol", sorted(APPEND))
def test_the_last_slot_message_lost_is_asked_for_after_the_senders_own_count(protocol):
    net = formed(protocol)  # nothing follows the lost message: a's heartbeat (its count) shows the hole
    lost = net.lose_next("a", "b", APPEND[protocol])
    sub = net.submit("a", 3)
    net.run_until(lambda: all(len(net.topic(i)) == 3 for i in net.ids), 10)
    assert lost == [1]
    settled(net, sub)


@pytest.mark.parametrize("protocol", sorted(APPEND))
def test_a_request_that_crosses_the_retransmission_or_a_view_change_is_harmless(protocol):
    # lossy, duplicating, reordering links and a crash: requests cross retransmissions,
    # arrive after the view that they name is over, ask for slots that are already here
    net = InMemoryNetwork(["a", "b", "c", "d", "e"], protocol=protocol, seed=11,
                          suspect_ticks=12, heartbeat_ticks=2, retransmit_ticks=6)
    net.run_until(lambda: all(net.node(i).status == "active" for i in net.ids), 200)
    for a in net.ids:
        for b in net.ids:
            if a != b:
                net.drop(a, b, 0.1)
    net.dup_prob, net.reorder = 0.05, True
    sub = []
    for t in range(80):
        for m in ("a", "b", "c", "d", "e"):
            if m != "e" or t < 30:
                sub += net.submit(m, 1)
        if t == 30:
            net.crash("e")
        net.tick()
    net.recover()
    live = ("a", "b", "c", "d")
    want = {(e.origin, e.partition, e.offset) for e in sub if e.origin != "e"}  # the live origins' events
    net.run_until(lambda: all(want <= {(e.origin, e.partition, e.offset) for e in net.topic(i)} for i in live), 600)
    assert net.sent_by_type.get(SlotReq.TYPE, 0) > 0
    assert not check_invariants(net, live=live)
