"""kdsync.invariants: every anomaly on small inputs, the same verdict whatever
the split into runs (per event or long runs), run-sized cost, views and
minority deliveries judged by content."""

from __future__ import annotations

import random

import pytest

from kdsync import invariants as C
from kdsync.invariants import OffsetRanges, Run, ViewRecord, check, normalise, runs_from_events, watermarks
from kdsync.core import Event

pytestmark = [pytest.mark.timeout(60)]


def ev(o, p, off):
    return (o, p, off)


def anomalies(found):
    return sorted(v.anomaly for v in found)


def test_vocabulary_maps_every_anomaly_to_a_scenario_kind():
    assert set(C.KIND_OF.values()) <= set(C.KINDS)
    assert {"inconsistent-offsets", "duplicate", "lost-write", "nonmonotonic"} <= set(C.ANOMALIES)
    v = C.Violation(C.LOST_WRITE, "x", "dc1", 3)
    assert v.kind == "loss" and v.as_dict() == {"kind": "loss", "anomaly": "lost-write", "detail": "x", "member": "dc1"}
    with pytest.raises(ValueError, match="unknown anomaly"):
        C.Violation("loss", "old names are not anomalies")


def test_runs_are_normalised_whatever_the_split():
    evs = [ev("a", 0, 0), ev("a", 0, 1), ev("a", 0, 2), ev("b", 0, 0), ev("a", 0, 3)]
    runs = runs_from_events(evs)
    assert runs == [Run(0, "a", 0, 0, 3), Run(3, "b", 0, 0, 1), Run(4, "a", 0, 3, 1)]
    split = [Run(0, "a", 0, 0, 1), Run(1, "a", 0, 1, 2), Run(3, "b", 0, 0, 1), Run(4, "a", 0, 3, 1)]
    assert normalise(reversed(split)) == runs
    assert normalise([Run(0, "a", 0, 0, 2), Run(2, "a", 0, 5, 2)]) == [Run(0, "a", 0, 0, 2), Run(2, "a", 0, 5, 2)]


def test_watermarks_of_events_and_of_runs_agree():
    evs = [Event("a", 0, 0), Event("b", 1, 4), Event("a", 0, 1), Event("a", 1, 0)]
    assert watermarks(evs) == watermarks(runs_from_events(evs)) == {("a", 0): 1, ("b", 1): 4, ("a", 1): 0}
    wm = {("a", 0): 7}
    assert watermarks([Run(0, "a", 0, 0, 3), Run(3, "c", 0, 10, 0)], into=wm) is wm and wm == {("a", 0): 7}


def test_offset_ranges():
    r = OffsetRanges.from_keys([ev("a", 0, x) for x in (0, 1, 2, 5, 6, 9)])
    assert r.intervals("a", 0) == [(0, 3), (5, 7), (9, 10)]
    assert r.outside("a", 0, 1, 11) == [(3, 5), (7, 9), (10, 11)]
    assert r.outside("b", 0, 0, 2) == [(0, 2)]
    assert ("a", 0, 6) in r and ("a", 0, 7) not in r
    assert r.total() == 6


def test_each_anomaly():
    sub = OffsetRanges.from_keys([ev("a", 0, x) for x in range(4)] + [ev("b", 0, x) for x in range(2)])
    good = [ev("a", 0, 0), ev("b", 0, 0), ev("a", 0, 1), ev("a", 0, 2), ev("b", 0, 1), ev("a", 0, 3)]
    assert check({"x": runs_from_events(good), "y": runs_from_events(good[:4])}, submitted=sub, live=["x"]) == []

    swapped = good[:1] + [good[2], good[1]] + good[3:]
    found = check({"x": runs_from_events(good), "y": runs_from_events(swapped)}, submitted=sub)
    assert anomalies(found) == ["inconsistent-offsets"]
    assert found[0].detail == "x and y differ at 2 of 6 common positions; first: seq 1 is b/0/0 at x but a/0/1 at y"

    dup = good + [ev("a", 0, 1)]
    found = check({"x": runs_from_events(dup)}, submitted=sub)
    assert anomalies(found) == ["duplicate", "nonmonotonic"]
    assert found[0].detail == "x delivered 1 duplicate(s); first: a/0/1 at seq 2 and 6"

    found = check({"x": runs_from_events(good + [ev("c", 0, 0)])}, submitted=sub)
    assert anomalies(found) == ["foreign"] and found[0].detail.endswith("first: c/0/0 at seq 6")

    found = check({"x": runs_from_events(good[:3])}, submitted=sub)
    assert anomalies(found) == ["lost-write"]
    assert found[0].detail == "x is missing 3 of 6 acknowledged event(s) after settle; e.g. a/0/2, a/0/3, b/0/1"
    assert check({"x": runs_from_events(good[:3])}, submitted=sub, live=[]) == []

    inverted = [ev("a", 0, 1), ev("a", 0, 0)] + good[1:2] + good[3:]
    found = check({"x": runs_from_events(inverted)}, submitted=sub)
    assert anomalies(found) == ["nonmonotonic"]
    assert found[0].detail == "x delivered 1 event(s) out of origin order; first: a/0/0 at seq 1 after offset 1 at seq 0"


def test_content_is_checked_where_the_driver_has_the_bytes():
    topic = [Event("a", 0, 0, b"ok"), Event("a", 0, 1, b"forged"), Event("a", 0, 2, b"ok")]
    sent = {(e.origin, e.partition, e.offset): e._replace(payload=b"ok") for e in topic}

    def content(member, run):
        bad = [i for i in range(run.count) if topic[run.seq + i] != sent[(run.origin, run.partition, run.first_offset + i)]]
        return (len(bad), bad[0]) if bad else None

    found = check({"x": runs_from_events(topic)}, submitted=OffsetRanges.from_keys(sent), content=content)
    assert anomalies(found) == ["corrupt"] and "first: a/0/1 at seq 1" in found[0].detail


def test_members_holding_the_same_topic_are_each_judged():
    """The checker judges a topic the same as a clean one once (its runs decide
    duplicates, foreign events, order and loss); every member that holds a
    wrong one is still named, and the bytes are checked at every member."""
    sub = OffsetRanges.from_keys([ev("a", 0, x) for x in range(4)])
    good = [ev("a", 0, x) for x in range(4)]
    bad = good + [ev("a", 0, 1), ev("c", 0, 0)]
    found = check({m: runs_from_events(bad) for m in ("x", "y", "z")}, submitted=sub)
    assert sorted((v.anomaly, v.member) for v in found) == sorted(
        (a, m) for m in ("x", "y", "z") for a in ("duplicate", "foreign", "nonmonotonic"))
    short = check({m: runs_from_events(good[:2]) for m in ("x", "y")}, submitted=sub)
    assert sorted((v.anomaly, v.member) for v in short) == [("lost-write", "x"), ("lost-write", "y")]

    def content(member, run):  # y's bytes differ, x's and z's do not: the same runs everywhere
        return (1, 0) if member == "y" else None

    found = check({m: runs_from_events(good) for m in ("x", "y", "z")}, submitted=sub, content=content)
    assert [(v.anomaly, v.member) for v in found] == [("corrupt", "y")]


def _mutate(rng: random.Random, base: list) -> list:
    t = list(base)
    for _ in range(rng.randrange(3)):
        what = rng.randrange(4)
        i = rng.randrange(len(t))
        if what == 0:
            j = rng.randrange(len(t))
            t[i], t[j] = t[j], t[i]
        elif what == 1:
            t.insert(i, t[rng.randrange(len(t))])
        elif what == 2:
            del t[i]
        else:
            t.insert(i, ev("zz", 0, rng.randrange(5)))
    return t[: rng.randrange(len(t) // 2, len(t) + 1)]


def _random_split(rng: random.Random, runs: list[Run]) -> list[Run]:
    out = []
    for r in runs:
        at = 0
        while at < r.count:
            n = rng.randint(1, r.count - at)
            out.append(Run(r.seq + at, r.origin, r.partition, r.first_offset + at, n))
            at += n
    rng.shuffle(out)
    return out


@pytest.mark.parametrize("seed", range(40))
def test_verdict_does_not_depend_on_the_split_into_runs(seed):
    rng = random.Random(seed)
    offs = {("a", 0): 0, ("a", 1): 0, ("b", 0): 0}
    base = []
    for _ in range(rng.randint(5, 60)):
        k = rng.choice(sorted(offs))
        for _ in range(rng.randint(1, 6)):
            base.append(ev(k[0], k[1], offs[k]))
            offs[k] += 1
    sub = OffsetRanges.from_keys(base)
    topics = {m: _mutate(rng, base) for m in ("x", "y", "z")}
    per_event = check({m: [Run(i, *e, 1) for i, e in enumerate(t)] for m, t in topics.items()}, submitted=sub)
    as_runs = check({m: _random_split(rng, runs_from_events(t)) for m, t in topics.items()}, submitted=sub)
    assert [(v.anomaly, v.detail, v.count) for v in per_event] == [(v.anomaly, v.detail, v.count) for v in as_runs]


def test_cost_follows_runs_not_events():
    # 4 * 10**12 events per member: only a run-based checker gets through this
    n = 10**12
    sub = OffsetRanges()
    for o in ("a", "b"):
        sub.add(o, 0, 0, 2 * n)
    x = [Run(0, "a", 0, 0, n), Run(n, "b", 0, 0, 2 * n), Run(3 * n, "a", 0, n, n)]
    y = [Run(0, "a", 0, 0, n // 2), Run(n // 2, "a", 0, n // 2, n // 2), Run(n, "b", 0, 0, 2 * n)]
    assert check({"x": x, "y": y}, submitted=sub, live=["x"]) == []
    z = [Run(0, "a", 0, 0, n), Run(n, "a", 0, n - 5, 10)]  # 5 duplicates, 4 below the top offset, losses
    found = check({"x": x, "z": z}, submitted=sub)
    assert anomalies(found) == ["duplicate", "inconsistent-offsets", "lost-write", "nonmonotonic"]
    assert {v.anomaly: v.count for v in found} == {
        "inconsistent-offsets": 10, "duplicate": 5, "nonmonotonic": 4, "lost-write": 3 * n - 5,
    }


def V(member, vid, members, start=0):
    return ViewRecord(member, vid, tuple(members), tuple(1 for _ in members), start)


def test_views():
    cfg = ("a", "b", "c", "d")
    fine = [V("a", 1, cfg), V("b", 1, cfg), V("a", 2, "abc"), V("c", 2, "abc"), V("a", 3, "ab"), V("a", 4, "abd")]
    assert check({}, views=fine, initial_members=cfg) == []

    found = check({}, views=[V("a", 1, cfg), V("c", 2, "cd", 5), V("a", 2, "abc", 5)], initial_members=cfg)
    assert anomalies(found) == ["view-conflict", "view-without-majority"]
    assert found[0].detail.startswith("view 2 installed as [c, d] (incarnations 1,1) from seq 5 by c and as [a, b, c]")
    assert found[1].detail == "view 2 [c, d] (installed by c) keeps 2 of the 4 members of view 1 [a, b, c, d]: no majority"

    # the first view must keep a majority of the configuration; a later one, of the view before it
    assert anomalies(check({}, views=[V("a", 1, "ab")], initial_members=cfg)) == ["view-without-majority"]
    assert anomalies(check({}, views=[V("a", 1, "abc"), V("a", 5, "bc")], initial_members=cfg)) == []
    assert anomalies(check({}, views=[V("a", 1, "abc"), V("a", 5, "cd")], initial_members=cfg)) == ["view-without-majority"]
    # an incarnation or start position that differs is a conflict too
    assert anomalies(check({}, views=[V("a", 1, cfg, 0), V("b", 1, cfg, 3)])) == ["view-conflict"]


def test_minority_deliveries_are_judged_by_content():
    order = runs_from_events([ev("a", 0, x) for x in range(10)])
    topics = {m: order for m in "abcd"}
    # 2|2: everyone delivered positions 6..9 while no majority existed, identically: fine
    stable = {m: [Run(6, "a", 0, 6, 4)] for m in "abcd"}
    assert check(topics, minority=stable) == []
    # d delivered its own event at 8 while cut off (it is in its topic); the group has a/0/8 there
    forked = runs_from_events([ev("a", 0, x) for x in range(8)] + [ev("d", 0, 0)])
    found = check({**topics, "d": forked}, minority={"d": [Run(8, "d", 0, 0, 1)]})
    assert anomalies(found) == ["inconsistent-offsets"] * 3 + ["minority-divergent"]
    assert found[-1].detail.endswith("first: seq 8 = d/0/0, a has a/0/8 there") and found[-1].member == "d"
    # handed over but lost with the process before it was durable (its topic holds the
    # group's event there now), or delivered by a witness (no topic): nobody saw it
    assert check(topics, minority={"d": [Run(8, "d", 0, 0, 1)]}) == []
    assert check(topics, minority={"w": [Run(8, "d", 0, 0, 1)]}) == []
    # d got ahead of the group while cut off: positions nobody else holds
    short = {m: [Run(0, "a", 0, 0, 6)] for m in "abc"}
    found = check({**short, "d": order}, minority={"d": [Run(6, "a", 0, 6, 4)]})
    assert anomalies(found) == ["minority-only"]
    assert found[0].count == 4 and "held by 0 of the 3 other live member(s)" in found[0].detail
    # judged against live members only: down ones do not hold the final order
    assert check({**short, "d": order}, minority={"d": [Run(6, "a", 0, 6, 4)]}, live=["d"]) == []
