"""The audit's checks (kdsync.spark.analysis) against a plain-Python reading of
their definitions, on random traces with every anomaly injected: lost rows,
truncated members, an event only one member has at a position (divergence),
inversions in the agreed order and in one member's, duplicates at the same
position, and — in the "moved" cases — an event delivered at two positions
(a duplicate elsewhere, two swapped positions).  The audit answers the
common case from per-event and per-position aggregates and falls back to
every row when an event sits at two positions or the agreed order has an
inversion; each case below drives one of those paths, in trace mode and
against source topics (with a member that delivered nothing and a run only
the sources know)."""

from __future__ import annotations

import math
import random
from collections import defaultdict

import numpy as np
import pytest
from conftest_spark import get_spark

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

COLS = ["run_id", "member", "event_id", "origin", "origin_partition", "origin_offset", "seq", "submit_ts", "deliver_ts"]


def make_run(rng: random.Random, run_id: str, members: list[str], moved: bool, base_inversion: bool):
    """(rows, source events) of one random run."""
    origins = members[:2] + ["far"]  # "far" writes but delivers nothing itself
    next_off: dict[tuple, int] = defaultdict(lambda: 100)  # offsets below 100 are free for one member's own
    events = []
    for _ in range(rng.randint(25, 40)):
        o, p = rng.choice(origins), rng.randint(0, 1)
        events.append((o, p, next_off[o, p]))
        next_off[o, p] += 1
    if base_inversion:  # two events of one origin partition agreed in the wrong order
        i = next(k for k in range(len(events)) for j in range(k + 1, len(events))
                 if events[j][:2] == events[k][:2])
        j = next(j for j in range(i + 1, len(events)) if events[j][:2] == events[i][:2])
        events[i], events[j] = events[j], events[i]
    sources = list(events)
    rows = []
    for mi, m in enumerate(members):
        mine = [(seq, e) for seq, e in enumerate(events, start=10)]
        kind = rng.choice(["clean", "lose", "truncate", "divergent", "dup_same", "own_inversion"]
                          + (["dup_elsewhere", "swap"] if moved else []))
        if mi == 0:
            kind = "clean"
        if kind == "lose":
            del mine[rng.randrange(len(mine))]
        elif kind == "truncate":
            mine = mine[: rng.randint(1, len(mine) - 1)]
        elif kind == "divergent":  # an event nobody else has, in place of the agreed one
            k = rng.randrange(len(mine))
            o, p, _ = mine[k][1]
            mine[k] = (mine[k][0], (o, p, 1000 + mi))
            if rng.random() < 0.5:
                sources.append((o, p, 1000 + mi))
        elif kind == "dup_same":
            k = rng.randrange(len(mine))
            mine.insert(k, mine[k])
        elif kind == "own_inversion":  # the last event replaced by a lower offset of its partition (diverges too)
            o, p, _ = mine[-1][1]
            mine[-1] = (mine[-1][0], (o, p, mi))
        elif kind == "dup_elsewhere":
            k = rng.randrange(len(mine) - 1)
            mine.append((mine[-1][0] + 1, mine[k][1]))
        elif kind == "swap":
            a, b = rng.sample(range(len(mine)), 2)
            (sa, ea), (sb, eb) = mine[a], mine[b]
            mine[a], mine[b] = (sa, eb), (sb, ea)
        for seq, (o, p, off) in mine:
            submit = seq * 0.01 + rng.random() * 0.001
            if rng.random() < 0.05:
                submit = float("nan")  # unknown submit time: no latency
            rows.append((run_id, m, f"{o}/{p}/{off}", o, p, off, seq, submit,
                         (0 if math.isnan(submit) else submit) + 0.005 + rng.random() * 0.05))
    return rows, sources


def reference(rows, sources: dict | None, members: list[str] | None):
    """The definitions of kdsync.spark.analysis, row by row."""
    by_run = defaultdict(list)
    for r in rows:
        by_run[r[0]].append(r)
    runs = set(by_run) | (set(sources) if sources and members else set())
    out = {}
    for run in sorted(runs):
        rs = by_run.get(run, [])
        ms = sorted(members) if members else sorted({r[1] for r in rs})
        src = set(sources.get(run, [])) if sources is not None else {(r[3], r[4], r[5]) for r in rs}
        at = defaultdict(set)
        for r in rs:
            at[r[6]].add((r[3], r[4], r[5]))
        differing = sorted(s for s, e in at.items() if len(e) > 1)
        lats = [(r[8] - r[7]) * 1000 for r in rs if not math.isnan(r[7])]
        delivered_any = {(r[3], r[4], r[5]) for r in rs}
        per = {}
        for m in ms:
            mine = [r for r in rs if r[1] == m]
            ev = {(r[3], r[4], r[5]) for r in mine}
            inv = 0
            best: dict[tuple, int] = {}
            for r in sorted(mine, key=lambda r: (r[3], r[4], r[6], r[5])):
                k = (r[3], r[4])
                if k in best and r[5] < best[k]:
                    inv += 1
                best[k] = max(best.get(k, -1), r[5])
            seqs = {r[6] for r in mine}
            ml = [(r[8] - r[7]) * 1000 for r in mine if not math.isnan(r[7])]
            per[m] = {"delivered": len(mine), "distinct_events": len(ev), "duplicates": len(mine) - len(ev),
                      "foreign": len(ev - src), "lost": len(src - ev), "inversions": inv,
                      "distinct_positions": len(seqs),
                      "missing_positions": (max(seqs) - min(seqs) + 1 - len(seqs)) if seqs else None,
                      "first_seq": min(seqs) if seqs else None, "last_seq": max(seqs) if seqs else None,
                      "latency": _pct(ml)}
        out[run] = {"positions": len(at), "differing_positions": len(differing), "differing_seqs": differing,
                    "first_divergent": differing[0] if differing else None,
                    "events_submitted": len(src), "events_delivered_any": len(delivered_any),
                    "latency": _pct(lats), "members": per}
    return out


def _pct(xs):
    if not xs:
        return None
    v = np.rint(np.array(xs) * 1000) / 1000  # the audit's microsecond resolution
    return [float(x) for x in np.percentile(v, [50, 90, 99])] + [float(v.max())]


def audit(spark, rows, sources=None, members=None):
    from kdsync.spark.analysis import analyse

    trace = spark.createDataFrame(rows, "run_id string, member string, event_id string, origin string, "
                                        "origin_partition int, origin_offset long, seq long, submit_ts double, "
                                        "deliver_ts double")
    src = None
    if sources is not None:
        src = spark.createDataFrame([(run, *e) for run, evs in sources.items() for e in evs],
                                    "run_id string, origin string, origin_partition int, origin_offset long")
    return analyse(trace, src, members=members)


def check(tables, want):
    runs = {r["run_id"]: r for r in tables.runs.collect()}
    assert set(runs) == set(want)
    detail = {k: defaultdict(int) for k in ("lost", "foreign", "inversions", "duplicates")}
    for k in detail:
        for x in getattr(tables, k).collect():
            detail[k][x["run_id"], x["member"]] += x["copies"] - 1 if k == "duplicates" else 1
    divergent = defaultdict(list)
    for x in tables.divergent.collect():
        divergent[x["run_id"]].append(x["seq"])
    members = {(m["run_id"], m["member"]): m for m in tables.members.collect()}
    for run, w in want.items():
        got = runs[run]
        for k in ("positions", "differing_positions", "first_divergent", "events_submitted", "events_delivered_any"):
            assert got[k] == w[k], (run, k, got[k], w[k])
        assert sorted(divergent[run]) == w["differing_seqs"], run
        _same_latency(got, w["latency"], run)
        for m, wm in w["members"].items():
            gm = members[run, m]
            for k, v in wm.items():
                if k != "latency":
                    assert gm[k] == v, (run, m, k, gm[k], v)
            _same_latency(gm, wm["latency"], (run, m))
            for k in ("lost", "foreign", "inversions", "duplicates"):
                assert detail[k][run, m] == wm[k], (run, m, k, "detail table")
        assert got["ok"] == (not any(wm[k] for wm in w["members"].values()
                                     for k in ("duplicates", "foreign", "lost", "inversions"))
                             and w["differing_positions"] == 0)


def _same_latency(row, want, where):
    got = [row[f"latency_ms_{k}"] for k in ("p50", "p90", "p99", "max")]
    if want is None:
        assert got == [None] * 4, where
    else:
        assert got == pytest.approx(want, abs=1e-6), where


@pytest.mark.parametrize("moved, base_inversion, with_sources", [
    (False, False, False),   # per-event and per-position path, no inversion in the agreed order
    (False, True, False),    # the agreed order has an inversion: every member's order checked
    (True, False, False),    # events at two positions: positions from every row
    (False, True, True),     # against source topics: foreign, lost, a silent member, a run only in the sources
])
def test_audit_equals_its_definitions(moved, base_inversion, with_sources):
    spark = get_spark()
    rng = random.Random(f"{moved}-{base_inversion}-{with_sources}")
    rows, sources = [], {}
    members = ["dc1", "dc2", "dc3", "dc4"] if with_sources else None
    for k in range(8):
        names = members[:3] if with_sources else [["dc1", "dc2", "dc3"], ["n0", "n1"], ["a", "b", "c", "d"]][k % 3]
        run_rows, src = make_run(rng, f"run{k}", names, moved, base_inversion and k % 2 == 0)
        rows += run_rows
        sources[f"run{k}"] = src
    if with_sources:  # foreign: delivered, never written; a run nobody delivered
        rows.append(("run1", "dc2", "dc1/0/999", "dc1", 0, 999, 999, 1.0, 1.01))
        sources["run-silent"] = [("dc1", 0, 0), ("dc2", 1, 0)]
    want = reference(rows, sources if with_sources else None, members)
    assert any(r["differing_positions"] for r in want.values())
    assert any(m["lost"] for r in want.values() for m in r["members"].values())
    if moved:
        assert any(m["duplicates"] for r in want.values() for m in r["members"].values())
    check(audit(spark, rows, sources if with_sources else None, members), want)


def test_too_many_members_is_one_line():
    from kdsync.cli_style import UsageError
    from kdsync.spark.analysis import MAX_MEMBERS, _Names

    with pytest.raises(UsageError, match="at most 63"):
        _Names(get_spark(), ["r"], {"r": [f"m{i}" for i in range(MAX_MEMBERS + 1)]}, [])
