"""The "WAN regions" section (issue 25): ordering across regions.

Three questions, each answered in the simulator with the shipped geo
scenarios (sim/scenarios/wan-*.yaml) run once per protocol — the files are
loaded, only `protocol` (and the clock protocol's settings) changed, and
written to a work directory:

1. Five AWS regions (wan-five-regions.yaml): p50 / p99 per origin region for
   mirror, derecho, sequencer and clock (a majority commit quorum, and a
   quorum of 2), next to the clock protocol's steady-state model (below).
2. One far region (wan-one-far-region.yaml): the p50 of events among the
   four near regions, against the same regions with the far one at their
   distance.
3. Three sites 50 ms round trip, without loss and with 2 % loss: clock p50
   minus mirror p50, in round trips, over three seeds pooled (at 2 % loss
   one seed's p50 moves by tens of ms with where its losses fall).

The model (the bound it should approach).  With every member writing all the time, a slot stamped by o
(true time t0, timestamp t0 + lead_o) is written at member i once every
sender k's slots stamped before it are committed at i — i knows `quorum` of
them are held (the q-th smallest of d(k,j) + d(j,i) over holders j; i's own
slots need a round trip) — and every sender's clock report has passed it
(d(k,i) after k's clock did).  So

    model(o, i) = max over k of (lead_o - lead_k + max(commit_q(k, i), d(k, i)))

one-way delays only (no Kafka, no jitter, no ticks): the latency the
protocol approaches when nothing else costs time.  The mirror's is d(o, i).
"""

from __future__ import annotations

import contextlib
import io
import statistics
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import yaml

from bench.common import Headline, NotMeasured, Section, Table, ratio
from kdsync.testing.stats import percentile

SCENARIOS = Path(__file__).resolve().parent.parent / "sim" / "scenarios"
FIVE = "wan-five-regions"
FAR = "wan-one-far-region"
THREE_SEEDS = (3, 4, 5)  # the three-sites runs: seeds pooled
DEFAULTS = "clock defaults"  # clock with no setting at all (issue 42's "no hand tuning")
# (label, protocol, commit quorum or None: the file's)
FIVE_RUNS = (("mirror", "mirror", 0), ("derecho", "derecho", 0), ("sequencer", "sequencer", 0),
             ("clock", "clock", 0), ("clock q=2", "clock", 2), (DEFAULTS, "clock", 0))


def _load(name: str) -> dict:
    return yaml.safe_load((SCENARIOS / f"{name}.yaml").read_text())


def _variant(base: dict, name: str, protocol: str, quorum: int, **changes) -> dict:
    d = dict(base, name=name, protocol=protocol, **changes)
    d.pop("commit_quorum", None)
    if quorum:
        d["commit_quorum"] = quorum
    return d


def delays(s: dict) -> tuple[list[str], dict[tuple[str, str], float]]:
    """Members and one-way delays (ms) of a scenario dict."""
    ids = [m["id"] for m in s["members"]]
    default = s.get("network", {}).get("default", {}).get("latency_ms", 0.0)
    d = {(a, b): (0.0 if a == b else default) for a in ids for b in ids}
    for link in s.get("network", {}).get("links", []):
        d[(link["from"], link["to"])] = link["latency_ms"]
    return ids, d


def clock_bound(s: dict, quorum: int) -> dict[tuple[str, str], float]:
    """model(o, i) of the module docstring for scenario dict `s`."""
    ids, d = delays(s)
    lead = {m["id"]: m.get("clock_lead_ms", 0.0) for m in s["members"]}
    q = quorum or len(ids) // 2 + 1
    commit = {(k, i): sorted(d[(k, j)] + d[(j, i)] for j in ids)[q - 1] for k in ids for i in ids}
    return {(o, i): max(lead[o] - lead[k] + max(commit[(k, i)], d[(k, i)]) for k in ids) for o in ids for i in ids}


def _run(args: tuple[str, str]) -> dict:
    """Pool worker: `kdsync-sim run SCENARIO --out DIR` in-process."""
    scenario, out = args
    from sim.cli import main as sim_main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            code = sim_main(["run", scenario, "--out", out])
        except Exception as e:  # a crash inside the simulator: reported, the section goes on
            print(f"kdsync-sim crashed: {type(e).__name__}: {e}")
            code = -1
    return {"exit": code, "output": buf.getvalue().strip().splitlines()[-3:]}


def _latencies(run_dir: Path, after_s: float) -> dict[tuple[str, str], list[float]]:
    """(origin, member) -> latencies (ms) of events submitted after `after_s`."""
    import pyarrow.parquet as pq

    t = pq.read_table(run_dir / "trace.parquet", columns=["member", "origin", "submit_ts", "deliver_ts"]).to_pydict()
    out: dict[tuple[str, str], list[float]] = {}
    for m, o, a, b in zip(t["member"], t["origin"], t["submit_ts"], t["deliver_ts"]):
        if a >= after_s:
            out.setdefault((o, m), []).append((b - a) * 1000.0)
    return out


def _violations(run_dir: Path) -> int:
    import json

    s = json.loads((run_dir / "summary.json").read_text())
    return len(s.get("violations", []))


def _pool(samples: dict[tuple[str, str], list[float]], keep=lambda o, i: True) -> list[float]:
    return [x for (o, i), xs in samples.items() if keep(o, i) for x in xs]


def wan_section(work: Path, plot, out: Path, jobs: int = 2, progress=lambda: None) -> Section:
    sec = Section("wan", "WAN regions: ordering across regions (clock vs derecho vs the baselines)")
    try:
        five, far = _load(FIVE), _load(FAR)
    except OSError as e:
        raise NotMeasured(f"geo scenarios missing: {e}") from None
    d = work / "wan"
    d.mkdir(parents=True, exist_ok=True)
    runs: dict[str, tuple[str, str]] = {}

    def add(key: str, scenario: dict) -> None:
        path = d / f"{key}.yaml"
        path.write_text(yaml.safe_dump(scenario, sort_keys=False))
        runs[key] = (str(path), str(d / key))

    for label, proto, q in FIVE_RUNS:
        # "clock defaults": no setting at all (kdsync run's timers, every lead chosen by the member)
        plain = {"members": [{"id": m["id"]} for m in five["members"]], "timing": {}} if label == DEFAULTS else {}
        add(f"five-{label.replace(' ', '').replace('=', '')}", _variant(five, f"{FIVE}-{label}", proto, q, **plain))
    near_only = dict(far, network={"default": far["network"]["default"], "links": []},
                     members=[{"id": m["id"]} for m in far["members"]])
    for proto in ("mirror", "derecho", "clock"):
        add(f"far-{proto}", _variant(far, f"{FAR}-{proto}", proto, 0))
        add(f"near-{proto}", _variant(near_only, f"{FAR}-all-near-{proto}", proto, 0))
    three = {"name": "three-sites", "duration_s": 10, "settle_s": 6, "timing": {"tick_ms": 5},
             "members": [{"id": "s1"}, {"id": "s2"}, {"id": "s3"}],
             "network": {"default": {"latency_ms": 25.0, "jitter_ms": 1.25}},
             "kafka": {"produce_ms": 2, "consume_ms": 1},
             "workload": [{"member": "all", "rate_eps": 200, "payload_bytes": 256, "partitions": 2, "start_s": 2}]}
    for loss in (0.0, 0.02):
        for proto in ("mirror", "derecho", "clock"):
            net = {"default": {**three["network"]["default"], **({"loss": loss} if loss else {})}}
            for seed in THREE_SEEDS:
                add(f"three-{proto}-loss{int(loss * 100)}-s{seed}",
                    dict(three, name=f"three-sites-{proto}", protocol=proto, network=net, seed=seed))
    keys = list(runs)
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        results = dict(zip(keys, pool.map(_run, [runs[k] for k in keys])))
    for _ in keys:
        progress()
    failed = [f"{k}: {' | '.join(r['output'])}" for k, r in results.items() if r["exit"] not in (0, 1)]
    if failed:
        raise NotMeasured("simulator runs failed: " + "; ".join(failed)[:400])
    lat = {k: _latencies(Path(runs[k][1]), 2.0) for k in keys}
    viol = {k: _violations(Path(runs[k][1])) for k in keys}

    # 1. five regions, per origin
    ids, one_way = delays(five)
    bound2 = clock_bound(five, 2)
    boundm = clock_bound(five, 0)
    rows = []
    labels = [label for label, _, _ in FIVE_RUNS]
    for o in ids + ["all"]:
        row: dict = {"origin": o}
        for label in labels:
            key = f"five-{label.replace(' ', '').replace('=', '')}"
            xs = _pool(lat[key], (lambda a, b: a == o) if o != "all" else (lambda a, b: True))
            row[f"{label} p50"] = round(percentile(xs, 50), 1) if xs else None
            row[f"{label} p99"] = round(percentile(xs, 99), 1) if xs else None
        sel = [(a, b) for a in ids for b in ids if o in ("all", a)]
        row["model clock p50"] = round(statistics.median(boundm[p] for p in sel), 1)
        row["model clock q=2 p50"] = round(statistics.median(bound2[p] for p in sel), 1)
        row["model mirror p50"] = round(statistics.median(one_way[p] for p in sel), 1)
        rows.append(row)
    sec.tables.append(Table("wan_regions", "Five regions (wan-five-regions.yaml): latency per origin region, ms "
                            "(source ack -> each cluster's global topic; models: one-way delays only, bench/wan.py)", rows))
    allrow = rows[-1]
    mirror50, mirror99 = allrow["mirror p50"], allrow["mirror p99"]
    sec.intro.append("Simulated, 200 events/s at every site, no faults; per origin: every cluster's copy of the "
                     "events written there. `clock` uses the file's clock leads and tick; `clock q=2` also commit_quorum 2 "
                     "(docs/wan.md); `clock defaults` sets nothing (kdsync run's timers, leads chosen by the members). Models: bench/wan.py's docstring.")
    vio = {k: v for k, v in viol.items() if v and not k.endswith("mirror") and "mirror-" not in k}
    sec.headlines += [
        Headline("WAN five regions: clock q=2 p50 / mirror p50", ratio(allrow["clock q=2 p50"], mirror50), "<= 2",
                 "wan_regions.csv"),
        Headline("WAN five regions: clock q=2 p99 / mirror p99", ratio(allrow["clock q=2 p99"], mirror99), "<= 3",
                 "wan_regions.csv"),
        Headline("WAN five regions: clock (majority) p50 / mirror p50", ratio(allrow["clock p50"], mirror50), "",
                 "wan_regions.csv"),
        Headline("WAN five regions: clock with default settings (leads chosen) p50 / mirror p50",
                 ratio(allrow[f"{DEFAULTS} p50"], mirror50), "<= 1.6 (issue 42)", "wan_regions.csv"),
        Headline("WAN five regions: clock with default settings p99 / mirror p99",
                 ratio(allrow[f"{DEFAULTS} p99"], mirror99), "<= 2 (issue 42)", "wan_regions.csv"),
        Headline("WAN five regions: derecho p50 / mirror p50", ratio(allrow["derecho p50"], mirror50), "",
                 "wan_regions.csv"),
        Headline("WAN runs with violations (ordered protocols)", len(vio), "0", "wan_regions.csv"),
    ]

    # 2. one far region
    near = [m["id"] for m in far["members"]][:-1]
    frows = []
    for proto in ("mirror", "derecho", "clock"):
        inner = lambda a, b: a in near and b in near  # noqa: E731
        with_far = percentile(_pool(lat[f"far-{proto}"], inner), 50)
        all_near = percentile(_pool(lat[f"near-{proto}"], inner), 50)
        frows.append({"protocol": proto, "near events p50, far region at 3x": round(with_far, 1),
                      "near events p50, all at the same distance": round(all_near, 1),
                      "rise %": round(100 * (with_far / all_near - 1), 1),
                      "all events p50 with the far region": round(percentile(_pool(lat[f"far-{proto}"]), 50), 1)})
    sec.tables.append(Table("wan_far_region", "One far region (wan-one-far-region.yaml): events among the four near "
                            "regions, ms", frows))
    clock_far = next(r for r in frows if r["protocol"] == "clock")
    sec.headlines.append(Headline("WAN one far region: rise of the near events' p50 under clock (%)",
                                  clock_far["rise %"], "<= 25", "wan_far_region.csv"))

    # 3. three sites, 50 ms round trip
    trows = []
    def three_p50(proto: str, loss: int) -> float:  # the seeds' events pooled
        return percentile([x for seed in THREE_SEEDS for x in _pool(lat[f"three-{proto}-loss{loss}-s{seed}"])], 50)

    for loss in (0, 2):
        m50 = three_p50("mirror", loss)
        for proto in ("derecho", "clock"):
            p50 = three_p50(proto, loss)
            trows.append({"loss %": loss, "protocol": proto, "p50": round(p50, 1), "mirror p50": round(m50, 1),
                          "(p50 - mirror p50) / RTT": round((p50 - m50) / 50.0, 2)})
    sec.tables.append(Table("wan_three_sites", f"Three sites, 50 ms round trip, 200 events/s each, seeds "
                            f"{', '.join(map(str, THREE_SEEDS))} pooled", trows))
    for r in trows:
        if r["protocol"] == "clock":
            sec.headlines.append(Headline(f"WAN three sites, {r['loss %']} % loss: (clock p50 - mirror p50) / RTT",
                                          r["(p50 - mirror p50) / RTT"], "<= 0.5" if r["loss %"] == 0 else "<= 1",
                                          "wan_three_sites.csv"))
    if plot is not None:
        sec.plots += plot.wan_regions(rows[:-1], labels, out)
    if vio:
        sec.notes.append("Violations: " + ", ".join(f"{k} {v}" for k, v in vio.items()))
    return sec
