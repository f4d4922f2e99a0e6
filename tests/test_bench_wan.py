"""bench/wan.py's latency model of the clock protocol on hand-checkable
networks (the section itself runs in `make bench`: 17 simulator runs)."""

from bench.wan import clock_bound, delays


def three(latency=25.0, lead=0.0):
    return {"members": [{"id": "a", "clock_lead_ms": lead}, {"id": "b"}, {"id": "c"}],
            "network": {"default": {"latency_ms": latency}}}


def test_three_sites_cost_a_round_trip_of_the_writers_own_events():
    m = clock_bound(three(), 0)
    # b's own slots need an acknowledgement (50 ms) and a's stamped before them wait that long at b
    assert m[("a", "b")] == 50.0 and m[("a", "a")] == 50.0


def test_a_lead_moves_the_wait_from_the_others_to_the_leader():
    m = clock_bound(three(lead=10.0), 0)
    assert m[("b", "c")] == 50.0  # b's events wait for c's own commits, not for a
    assert m[("a", "b")] == 60.0  # a's events wait its lead longer


def test_a_smaller_quorum_commits_a_far_writers_slots_on_arrival():
    s = {"members": [{"id": x} for x in "abcde"],
         "network": {"default": {"latency_ms": 10.0},
                     "links": [{"from": "e", "to": x, "latency_ms": 100.0} for x in "abcd"]
                     + [{"from": x, "to": "e", "latency_ms": 100.0} for x in "abcd"]}}
    ids, d = delays(s)
    assert d[("e", "a")] == 100.0 and d[("a", "b")] == 10.0
    majority, two = clock_bound(s, 0), clock_bound(s, 2)
    assert majority[("a", "b")] == 110.0  # e's slots: 100 to get here, 10 more to learn a third holder
    assert two[("a", "b")] == 100.0
