"""The "Region failure" section (issue 42): what one region's failure costs
the others.

The five AWS regions of sim/scenarios/wan-five-regions.yaml (200 events/s
written at every site, with the timing docs/wan.md gives for a WAN:
tick 5, heartbeat 100, suspect 3 000, retransmit 250 ms), run for 30 s per protocol (derecho, clock, and
clock with the crash fence: kdsync.core.crash_fence) and per fault,
all injected at FAULT_S and undone at RETURN_S:

- crash: Tokyo (the far region) crashes, then restarts;
- stop: Tokyo stops cleanly (announced: kdsync.core.departure), then restarts;
- isolate: Tokyo is cut off from the four others, then the partition heals;
- two crash: Tokyo and Oregon crash at once (a minority of two), then restart.
  clock runs it at the default commit quorum (a majority): the file's
  quorum of 2 survives the loss of one member only (docs/wan.md, "Fewer
  holders per event"), so with it a second crash waits for a return by design.

The faults a member must detect (crash, isolate, two crash) run twice: with
suspect_ms as the fixed timeout and with `adaptive_suspect` (suspect_ms the
ceiling, a silent peer suspected after a few of its longest ping gaps:
kdsync.core.liveness).

Per run, over the events of the regions that stay up (origin and receiver
both live for the whole run): their steady p99 (created in STEADY), and the
p99 and worst latency of those created in the AFTER_FAULT_S after the fault
and in the AFTER_RETURN_S after the return; the goal of issue 42 is a worst
within 2x the steady p99 in both windows.  The plot: latency against
creation time (the median and the worst per 100 ms of creation time) of the
crash runs.
"""

from __future__ import annotations

import statistics
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import yaml

from bench.common import Headline, NotMeasured, Section, Table, ratio, require_rows
from bench.wan import SCENARIOS, _run, _violations
from kdsync.testing.stats import percentile

FIVE = "wan-five-regions"
# clock+fence: clock with protocol.crash_fence (kdsync.core.crash_fence); clock+lift: and protocol.lift_fence
# (the fenced region's return taken back in place, without a view change: kdsync.core.lift)
PROTOCOLS = ("derecho", "clock", "clock+fence", "clock+lift")
FAULT_S, RETURN_S, DURATION_S = 10.0, 20.0, 30.0
STEADY = (4.0, 9.5)  # creation times of the steady window (s)
AFTER_FAULT_S, AFTER_RETURN_S = 3.0, 5.0
FAULTS = {  # name -> (regions down or cut off, the faults)
    "crash": (("tyo",), [{"at_s": FAULT_S, "crash": "tyo"}, {"at_s": RETURN_S, "restart": "tyo"}]),
    "stop": (("tyo",), [{"at_s": FAULT_S, "stop": "tyo"}, {"at_s": RETURN_S, "restart": "tyo"}]),
    "isolate": (("tyo",), [{"at_s": FAULT_S, "partition": [["tyo"], ["fra", "ie", "va", "or"]],
                            "until_s": RETURN_S}]),
    "two crash": (("tyo", "or"), [{"at_s": FAULT_S, "crash": "tyo"}, {"at_s": FAULT_S, "crash": "or"},
                                  {"at_s": RETURN_S, "restart": "tyo"}, {"at_s": RETURN_S, "restart": "or"}]),
}
GOAL = 2.0  # worst / steady p99 (issue 42)
ADAPTIVE_FAULTS = ("crash", "isolate", "two crash")  # detected by silence: run with adaptive suspicion too
MAJORITY_FAULTS = ("two crash",)  # clock at the default commit quorum (a majority), not the file's 2
SUSPICION = ("fixed", "adaptive")
TIMING = {"tick_ms": 5, "heartbeat_ms": 100, "suspect_ms": 3000, "retransmit_ms": 250}  # docs/wan.md's WAN settings


def _key(protocol: str, fault: str, suspicion: str) -> str:
    return f"{protocol}-{fault.replace(' ', '-')}" + ("-adaptive" if suspicion == "adaptive" else "")


def _scenario(base: dict, protocol: str, fault: str, suspicion: str = "fixed") -> dict:
    _, faults = FAULTS[fault]
    name, protocol = protocol, protocol.split("+")[0]
    s = dict(base, name=f"{FIVE}-{_key(name, fault, suspicion)}", protocol=protocol, duration_s=DURATION_S,
             faults=faults, timing=dict(TIMING))
    s["crash_fence"] = name.endswith(("+fence", "+lift"))  # clock: without it (the default since stop 61 is with it)
    s["lift_fence"] = name.endswith("+lift")
    if suspicion == "adaptive":
        s["adaptive_suspect"] = True
    if fault in MAJORITY_FAULTS and protocol == "clock":
        s["commit_quorum"] = 0  # a majority: the file's 2 loses only one member without waiting for it
    if protocol != "clock":
        s.pop("commit_quorum", None)
        s["members"] = [{"id": m["id"]} for m in base["members"]]  # no clock lead
    return s


def _trace(run_dir: Path) -> dict:
    import pyarrow.parquet as pq

    return pq.read_table(run_dir / "trace.parquet",
                         columns=["member", "origin", "submit_ts", "deliver_ts"]).to_pydict()


def _live_latencies(t: dict, down: tuple[str, ...]) -> list[tuple[float, float]]:
    """(creation time s, latency ms) of the events of the regions that stay
    up, delivered at regions that stay up."""
    return [(a, (b - a) * 1000.0) for m, o, a, b in zip(t["member"], t["origin"], t["submit_ts"], t["deliver_ts"])
            if m not in down and o not in down]


def _window(lat: list[tuple[float, float]], lo: float, hi: float) -> list[float]:
    return [x for a, x in lat if lo <= a < hi]


def _curve(lat: list[tuple[float, float]], bin_s: float = 0.1) -> list[tuple[float, float, float]]:
    """(bin start s, median ms, worst ms) per `bin_s` of creation time."""
    bins: dict[int, list[float]] = {}
    for a, x in lat:
        bins.setdefault(int(a / bin_s), []).append(x)
    return [(k * bin_s, statistics.median(xs), max(xs)) for k, xs in sorted(bins.items())]


def _plot(curves: dict[str, list[tuple[float, float, float]]], out: Path) -> list[tuple[str, str]]:
    from bench.plots import COLORS, _save, plt

    fig, ax = plt.subplots(figsize=(8.5, 4.2))
    for proto, pts in curves.items():
        xs = [p[0] for p in pts]
        color, style = COLORS.get(proto.split(",")[0]), "--" if "adaptive" in proto else "-"
        ax.plot(xs, [p[2] for p in pts], style, color=color, alpha=0.45, linewidth=0.8, label=f"{proto}: worst")
        ax.plot(xs, [p[1] for p in pts], style, color=color, linewidth=1.4, label=f"{proto}: median")
    ax.axvspan(FAULT_S, RETURN_S, color="#d62728", alpha=0.08, label="Tokyo down")
    ax.set_yscale("log")
    ax.set_xlabel("event created at (s, simulated)")
    ax.set_ylabel("latency at the live regions (ms)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=3)
    title = "five regions, Tokyo crashes at 10 s and restarts at 20 s"
    fig.suptitle(title)
    return [(_save(fig, out, "region_failure.png"), title)]


def region_section(work: Path, out: Path, jobs: int = 2, progress=lambda: None) -> Section:
    sec = Section("region", "Region failure: what one region's crash, stop, isolation or return costs the others")
    try:
        base = yaml.safe_load((SCENARIOS / f"{FIVE}.yaml").read_text())
    except OSError as e:
        raise NotMeasured(f"geo scenario missing: {e}") from None
    d = work / "region"
    d.mkdir(parents=True, exist_ok=True)
    runs, quorums = {}, {}
    for proto in PROTOCOLS:
        for fault in FAULTS:
            for suspicion in SUSPICION if fault in ADAPTIVE_FAULTS else SUSPICION[:1]:
                key = _key(proto, fault, suspicion)
                path = d / f"{key}.yaml"
                scenario = _scenario(base, proto, fault, suspicion)
                path.write_text(yaml.safe_dump(scenario, sort_keys=False))
                runs[(proto, fault, suspicion)] = (str(path), str(d / key))
                quorums[(proto, fault, suspicion)] = scenario.get("commit_quorum")
    with ProcessPoolExecutor(max_workers=max(1, jobs)) as ex:
        results = dict(zip(runs, ex.map(_run, runs.values())))
    progress()
    rows, errors, curves = [], [], {}
    for (proto, fault, suspicion), (_, run_dir) in runs.items():
        res = results[(proto, fault, suspicion)]
        if res["exit"] not in (0, 1):
            errors.append(f"{proto} {fault} ({suspicion}): {' / '.join(res['output'])}")
            continue
        down, _ = FAULTS[fault]
        lat = _live_latencies(_trace(Path(run_dir)), down)
        steady = _window(lat, *STEADY)
        after_fault = _window(lat, FAULT_S, FAULT_S + AFTER_FAULT_S)
        after_return = _window(lat, RETURN_S, RETURN_S + AFTER_RETURN_S)
        if not (steady and after_fault and after_return):
            errors.append(f"{proto} {fault} ({suspicion}): a window holds no event")
            continue
        p99 = percentile(steady, 99)
        quorum = quorums[(proto, fault, suspicion)]  # as run: None (derecho), 0 (a majority) or a count
        row = {"protocol": proto, "fault": fault, "suspicion": suspicion, "down": ",".join(down),
               "commit_quorum": "-" if quorum is None else quorum or "majority",
               "violations": _violations(Path(run_dir)),
               "steady_p99_ms": round(p99, 1),
               "fault_p99_ms": round(percentile(after_fault, 99), 1), "fault_worst_ms": round(max(after_fault), 1),
               "return_p99_ms": round(percentile(after_return, 99), 1),
               "return_worst_ms": round(max(after_return), 1)}
        row["fault_worst_over_steady_p99"] = round(ratio(row["fault_worst_ms"], p99) or 0, 2)
        row["return_worst_over_steady_p99"] = round(ratio(row["return_worst_ms"], p99) or 0, 2)
        rows.append(row)
        if fault == "crash":
            curves[proto if suspicion == "fixed" else f"{proto}, adaptive"] = _curve(lat)
        for when in ("fault", "return"):
            sec.headlines.append(Headline(
                f"{proto}, {fault} of {' and '.join(down)}"
                f"{', adaptive suspicion' if suspicion == 'adaptive' else ''}: live regions' worst latency / steady p99, "
                f"events created in the {AFTER_FAULT_S if when == 'fault' else AFTER_RETURN_S:g} s after the "
                f"{'fault' if when == 'fault' else 'return'}",
                row[f"{when}_worst_over_steady_p99"], f"<= {GOAL:g} (issue 42)", "region_failure.csv"))
    require_rows(rows, errors, "no run could be measured")
    sec.intro.append(
        f"Simulator, the five AWS regions of sim/scenarios/{FIVE}.yaml (200 events/s at every site) with the timing "
        f"docs/wan.md gives for a WAN ({', '.join(f'{k} {v}' for k, v in TIMING.items())}); clock with the file's "
        f"commit quorum ({base.get('commit_quorum', 'majority')}) and Tokyo's lead, derecho with neither; {DURATION_S:g} s "
        f"per run; the fault at {FAULT_S:g} s, the return at {RETURN_S:g} s. Latencies of the events of the regions "
        f"that stay up, at the regions that stay up, by when the event was created: steady = created in "
        f"{STEADY[0]:g}-{STEADY[1]:g} s; fault = in the {AFTER_FAULT_S:g} s after the fault; return = in the "
        f"{AFTER_RETURN_S:g} s after the return. Isolation: Tokyo cut off from the four others, then healed; "
        f"two crash: Tokyo and Oregon at once, clock at the default commit quorum (a majority: a quorum of 2 "
        f"loses one member only without waiting for its return, docs/wan.md).")
    sec.tables.append(Table("region_failure", "Live regions' latency around a region's failure and return", rows))
    if curves:
        sec.plots += _plot(curves, out)
    sec.note_unmeasured(errors)
    return sec
