"""The clock protocol's far links (kdsync/core/far_links.py): which links
may hold their messages and for how long (`gaps`, from the delays and
leads), and held messages driven through loss, a crash and a restart on
the in-memory network, checked by the outside checker."""

import pytest

from kdsync.core import far_links
from kdsync.core.far_links import FAR_MAX_TICKS, gaps
from kdsync.core.messages import ClockAck, ClockAppend, SlotReq
from kdsync.testing.clocks import ClockFault
from kdsync.testing.network import InMemoryNetwork, assert_whole

MS = 1000
TICK = 5 * MS
# sim/scenarios/wan-five-regions.yaml: one-way delays (ms), Frankfurt / Ireland / Virginia / Oregon / Tokyo
ONE_WAY = {("fra", "ie"): 9.78, ("fra", "va"): 44.31, ("fra", "or"): 79.75, ("fra", "tyo"): 118.25,
           ("ie", "va"): 40.26, ("ie", "or"): 68.5, ("ie", "tyo"): 106.2, ("va", "or"): 43.49,
           ("va", "tyo"): 72.65, ("or", "tyo"): 44.55}
REGIONS = ["fra", "ie", "va", "or", "tyo"]
DELAY = {**{k: int(v * MS) for k, v in ONE_WAY.items()}, **{(b, a): int(v * MS) for (a, b), v in ONE_WAY.items()}}
LEADS = {"fra": 0, "ie": 0, "va": 0, "or": 0, "tyo": 30 * MS}


def all_gaps(q, lead=LEADS, delay=DELAY, members=REGIONS):
    return {m: gaps(m, members, delay, lead, q, TICK) for m in members}


def test_with_a_commit_quorum_of_two_only_links_nobody_waits_for_hold():
    """Frankfurt and Ireland wait ~80-90 ms for Tokyo's reports whatever
    they send each other (9.8 ms apart): that link holds both ways.
    Tokyo's messages are what the others wait for: never held; nor are
    Frankfurt's to Tokyo (Tokyo's farthest sender)."""
    g = all_gaps(2)
    assert g["fra"].get("ie", 1) > 1 and g["ie"].get("fra", 1) > 1
    assert g["tyo"].get("fra", 1) == 1 and g["tyo"].get("ie", 1) == 1
    assert g["fra"].get("tyo", 1) == 1
    assert all(1 < x <= FAR_MAX_TICKS for row in g.values() for x in row.values())


def test_a_majority_quorum_holds_no_link_the_relays_need():
    """With three of five holders, a slot is ready at a third member once a
    relay's acknowledgement arrives, and on these delays those relays are
    what Virginia and Oregon wait for: Frankfurt -> Ireland feeds Virginia's
    C1 for Frankfurt's slots, so it is not held as it is with a quorum of 2."""
    g = all_gaps(3)
    assert g["fra"].get("ie", 1) == 1


def test_members_equally_far_apart_hold_nothing():
    members = ["a", "b", "c"]
    delay = {(x, y): 25 * MS for x in members for y in members if x != y}
    for q in (2, 0):
        assert all(not gaps(m, members, delay, dict.fromkeys(members, 0), q, TICK) for m in members)


def test_a_lead_shortens_what_the_far_member_makes_the_others_wait():
    """Tokyo's lead makes its reports arrive 30 ms "earlier": Frankfurt and
    Ireland then have less room, and hold less than without it."""
    without = all_gaps(2, lead=dict.fromkeys(REGIONS, 0))
    with_lead = all_gaps(2)
    assert sum(map(sum, (r.values() for r in with_lead.values()))) < \
        sum(map(sum, (r.values() for r in without.values())))


# ------------------------------------------------------------------ held messages under faults
IDS = ("a", "b", "c", "d", "e")
FAST = dict(suspect_ticks=30, heartbeat_ticks=2, retransmit_ticks=3)


def keys(evs):
    return {(e.origin, e.partition, e.offset) for e in evs}


def hold_everything(monkeypatch, ticks):
    """Every member holds its messages to every peer for `ticks` ticks (the
    in-memory network has no delays to measure)."""
    def measure(self):
        self._gap = {p: ticks for p in self.view.members if p != self.me} if ticks > 1 else {}
    monkeypatch.setattr(far_links.FarLinks, "_measure_gaps", measure)


def stream(net, ticks, ids=IDS):
    """Events from each of `ids`, one member per tick; returns their keys."""
    sub = set()
    for t in range(ticks):
        sub |= keys(net.submit(ids[t % len(ids)], 1))
        net.tick(1)
    return sub


@pytest.mark.parametrize("quorum", [0, 2])
def test_held_messages_through_loss_a_crash_and_a_restart(monkeypatch, quorum):
    """Every link holds its messages 3 ticks, 20 % of them are lost, c
    crashes mid-stream and returns: every event once, everywhere, and the
    holds did cut the messages (fewer than the same run without them)."""
    sent = {}
    for hold in (1, 3):
        hold_everything(monkeypatch, hold)
        net = InMemoryNetwork(list(IDS), seed=7, protocol="clock", commit_quorum=quorum, **FAST)
        net.run_until(lambda: all(net.node(i).status == "active" for i in IDS), 100)
        for a in IDS:
            for b in IDS:
                if a != b:
                    net.drop(a, b, 0.2)
        sub = stream(net, 40)
        net.crash("c")
        sub |= stream(net, 40, ("a", "b", "d", "e"))
        net.recover()
        net.restart("c")
        sub |= stream(net, 40)
        assert_whole(net, IDS, sub, members=5, within=600)
        assert all(net.node(i).quiet() for i in IDS)  # nothing left owed
        sent[hold] = net.sent_by_type.get(ClockAppend.TYPE, 0) + net.sent_by_type.get(ClockAck.TYPE, 0)
    assert sent[3] < sent[1], sent


def test_held_messages_go_out_once_their_gap_has_passed(monkeypatch):
    """Without loss, heartbeats and retransmissions 50 ticks apart: an event
    from any member reaches every member within a few gaps (what is owed
    goes out by itself, and a report never counts slots it does not carry,
    which would make a peer ask for them), and nothing stays owed."""
    hold_everything(monkeypatch, 3)
    net = InMemoryNetwork(list(IDS), seed=7, protocol="clock", commit_quorum=2,
                          suspect_ticks=300, heartbeat_ticks=50, retransmit_ticks=50)
    net.run_until(lambda: all(net.node(i).status == "active" for i in IDS), 200)
    sub = set()
    for t in range(30):
        mine = keys(net.submit(IDS[t % 5], 1))
        sub |= mine
        took = net.run_until(lambda: all(mine <= keys(net.topic(i)) for i in IDS), 40)
        assert took <= 3 * 3 + 2, (t, took)
    net.tick(10)
    assert all(net.node(i).quiet() for i in IDS)
    assert all(len(net.topic(i)) == len(sub) for i in IDS)
    assert net.sent_by_type.get(SlotReq.TYPE, 0) == 0


def test_one_held_link_carries_every_slot_within_its_gap(monkeypatch):
    """Only a -> c holds (3 ticks), and c's clock runs far ahead (as a lead
    would), so a waits for little from c: slots cut while the gap runs are
    owed to c, and c gets each within the gap (not at the next heartbeat or
    retransmission, 50 ticks), carried by the next message to it -- a
    report never counts slots it does not carry."""
    def measure(self):
        self._gap = {"c": 3} if self.me == "a" else {}
    monkeypatch.setattr(far_links.FarLinks, "_measure_gaps", measure)
    ids = ("a", "b", "c")
    net = InMemoryNetwork(list(ids), seed=7, protocol="clock", suspect_ticks=300, heartbeat_ticks=50,
                          retransmit_ticks=50, clocks={"c": ClockFault(offset_us=1000 * InMemoryNetwork.TICK_US)})
    net.run_until(lambda: all(net.node(i).status == "active" for i in ids), 200)
    net.tick(50)  # the gaps are measured each heartbeat
    assert net.node("a")._gap == {"c": 3}
    held = 0
    for _ in range(10):
        mine = keys(net.submit("a", 1))
        net.stabilize()
        held += bool(net.node("a")._owed)
        took = net.run_until(lambda: all(mine <= keys(net.topic(i)) for i in ids), 40)
        assert took <= 3, took
    assert held
