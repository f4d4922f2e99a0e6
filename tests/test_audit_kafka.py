"""`kdsync audit` against real brokers: three embedded clusters (Tansu, then
noida-db: the module runs once per implementation), source
and global topics written directly with a producer, one anomaly injected into
dc2's global topic per topic; the audit must report exactly that anomaly."""

from __future__ import annotations

import json

import pytest
from conftest_spark import Rec, agreed_order, get_spark, produce_sources, write_global

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PER_CLUSTER = 12
CASES = ["clean", "duplicate", "missing", "swap", "reorder", "foreign"]


@pytest.fixture(scope="module", params=["tansu", "noida"])
def clusters(request):
    from kdsync.kafka.embedded import embedded_clusters

    with embedded_clusters(3, broker=request.param) as cs:
        yield cs


def _inject(case: str, order: list[Rec]) -> tuple[list[Rec], list[int], dict]:
    """dc2's global order for `case`, its kdsync.seq headers, and what we did."""
    n = len(order)
    seqs = list(range(n))
    o = list(order)
    if case == "clean":
        return o, seqs, {}
    if case == "duplicate":  # a producer retry: the same record twice, same position header
        k = 5
        return o[:k + 1] + [o[k]] + o[k + 1:], seqs[:k + 1] + [k] + seqs[k + 1:], {"event": o[k].event_id}
    if case == "missing":
        k = 7
        return o[:k] + o[k + 1:], seqs[:k] + seqs[k + 1:], {"event": o[k].event_id, "seq": k}
    if case == "swap":  # neighbours from different origin partitions
        k = 10
        assert (o[k].origin, o[k].partition) != (o[k + 1].origin, o[k + 1].partition)
        o[k], o[k + 1] = o[k + 1], o[k]
        return o, seqs, {"seq": k}
    if case == "reorder":  # two consecutive events of one origin partition swapped
        i = 3
        j = next(x for x in range(i + 1, n) if (o[x].origin, o[x].partition) == (o[i].origin, o[i].partition))
        o[i], o[j] = o[j], o[i]
        return o, seqs, {"seq": i, "other": j}
    if case == "foreign":
        ghost = Rec("dc9", 0, 4242, order[-1].ts, b"ghost", b"never written to a source topic")
        return o + [ghost], seqs + [n], {"event": ghost.event_id}
    raise AssertionError(case)


@pytest.fixture(scope="module")
def topics(clusters):
    """topic name -> injection details; every topic built in every cluster."""
    built = {}
    for case in CASES:
        t = f"t-{case}"
        order = agreed_order(produce_sources(clusters, t, PER_CLUSTER))
        injected = {}
        for c in clusters:
            if c.name == "dc2":
                o, seqs, injected = _inject(case, order)
                write_global(c, t + "-global", o, seqs)
            else:
                write_global(c, t + "-global", order)
        built[t] = injected
    return built


def _audit(clusters, topics_, capsys, extra=()):
    from kdsync.spark.audit import main

    get_spark()
    argv = [a for c in clusters for a in ("--cluster", f"{c.name}={c.bootstrap}")]
    argv += [a for t in topics_ for a in ("--topic", t)]
    code = main(argv + ["--master", "local[2]", *extra])
    out = capsys.readouterr().out
    return code, json.loads(out)


def test_each_anomaly_reported_exactly(clusters, topics, capsys, tmp_path):
    code, report = _audit(clusters, list(topics), capsys, ["--out", str(tmp_path / "out")])
    assert code == 1 and report["ok"] is False
    runs = {r["run_id"]: r for r in report["runs"]}
    assert set(runs) == set(topics)
    n = 3 * PER_CLUSTER
    zero = {"dc1": 0, "dc2": 0, "dc3": 0}

    def expect(run, *, dup=zero, lost=zero, foreign=zero, inv=zero, differing=0, first=None):
        assert run["integrity"]["duplicates"] == dup
        assert run["loss"]["lost"] == lost
        assert run["integrity"]["foreign"] == foreign
        assert run["origin_order"]["inversions"] == inv
        assert run["agreement"]["differing_positions"] == differing
        assert run["agreement"]["first_divergent"] == first
        assert run["events_submitted"] == n
        assert run["integrity"]["malformed"] == {}

    clean = runs["t-clean"]
    expect(clean)
    assert clean["ok"] and clean["violations"] == [] and clean["anomalies"] == {}
    assert clean["events_delivered"] == {"dc1": n, "dc2": n, "dc3": n}
    # the producer stamped deliveries 40 ms after the source timestamp
    assert clean["latency_ms"]["p50"] == pytest.approx(40.0) and clean["latency_ms"]["max"] == pytest.approx(40.0)

    r = runs["t-duplicate"]
    expect(r, dup={**zero, "dc2": 1})
    assert r["integrity"]["duplicate_examples"]["dc2"] == [{"event_id": topics["t-duplicate"]["event"], "copies": 2}]
    assert [v["kind"] for v in r["violations"]] == ["integrity"]
    assert [v["anomaly"] for v in r["violations"]] == ["duplicate"] and r["anomalies"] == {"duplicate": 1}

    r = runs["t-missing"]
    expect(r, lost={**zero, "dc2": 1})
    assert r["loss"]["examples"]["dc2"] == [{"event_id": topics["t-missing"]["event"]}]
    assert r["positions"]["missing_positions"]["dc2"] == 1
    assert [v["kind"] for v in r["violations"]] == ["loss"]
    assert [v["anomaly"] for v in r["violations"]] == ["lost-write"] and r["anomalies"] == {"lost-write": 1}

    r = runs["t-swap"]
    k = topics["t-swap"]["seq"]
    expect(r, differing=2, first=k)
    assert [e["seq"] for e in r["agreement"]["examples"]] == [k, k + 1]
    assert [v["kind"] for v in r["violations"]] == ["agreement"]
    assert r["anomalies"] == {"inconsistent-offsets": 2}

    r = runs["t-reorder"]
    i = topics["t-reorder"]["seq"]
    expect(r, differing=2, first=i, inv={**zero, "dc2": 1})
    assert sorted(v["kind"] for v in r["violations"]) == ["agreement", "origin_order"]
    assert r["anomalies"] == {"inconsistent-offsets": 2, "nonmonotonic": 1}

    r = runs["t-foreign"]
    expect(r, foreign={**zero, "dc2": 1})
    assert r["integrity"]["foreign_examples"]["dc2"] == [{"event_id": topics["t-foreign"]["event"]}]
    assert [v["kind"] for v in r["violations"]] == ["integrity"]
    assert [v["anomaly"] for v in r["violations"]] == ["foreign"]

    # --out: the same facts as Parquet tables
    spark = get_spark()
    members = spark.read.parquet(str(tmp_path / "out" / "members"))
    assert members.count() == 3 * len(CASES)
    lost = spark.read.parquet(str(tmp_path / "out" / "lost")).collect()
    assert [(x["run_id"], x["member"], x["event_id"]) for x in lost] == [("t-missing", "dc2", topics["t-missing"]["event"])]
    assert json.loads((tmp_path / "out" / "report.json").read_text())["ok"] is False


def test_clean_topic_alone_exits_0(clusters, topics, capsys):
    code, report = _audit(clusters, ["t-clean"], capsys)
    assert code == 0 and report["ok"] is True
    assert [r["run_id"] for r in report["runs"]] == ["t-clean"]


def test_unreachable_cluster_is_one_line_exit_2(capsys):
    from kdsync.kafka.embedded import free_port
    from kdsync.spark.audit import main

    code = main(["--cluster", f"dcx=127.0.0.1:{free_port()}", "--topic", "t"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "dcx" in err[0] and "do not answer" in err[0]
