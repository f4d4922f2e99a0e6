"""Testbed fidelity models of the simulator: the consumer's fetch loop, the
member's producer (linger + acks), the real member's timers, per-tick CPU,
calibration profiles, and the calibration fit."""

from __future__ import annotations

import numpy as np
import pytest

from sim.calibrate import fit_costs, nnls
from sim.runner import Simulation, node_config, run_scenario
from sim.scenario import ScenarioError, parse_scenario


def _scn(kafka: str = "", extra: str = "", workload: str = "[{member: dc1, burst: 10, at_s: 1.0}]",
         members: str = "[{id: dc1}, {id: dc2}, {id: dc3}]") -> str:
    return f"""
name: fid
duration_s: 2
settle_s: 2
members: {members}
network: {{default: {{latency_ms: 0}}}}
kafka: {{produce_ms: 2, consume_ms: 0{kafka}}}
workload: {workload}
{extra}
"""


def _p50(text: str) -> float:
    r = run_scenario(parse_scenario(text))
    assert r.failing == [], [v.detail for v in r.failing]
    return r.summary["latency_ms"]["p50"]


def test_fetch_wait_without_early_wake_holds_records_until_the_fetch_ends():
    base = _p50(_scn())
    # fetches go out at t = 0, 0.02, 0.04, ...: the burst acknowledged at 1.002
    # waits for the fetch that ends at 1.02
    held = _p50(_scn(", fetch_wait_ms: 20"))
    assert held - base == pytest.approx(18.0, abs=0.01)
    # a broker that wakes the held fetch at once on data: no wait at all
    assert _p50(_scn(", fetch_wait_ms: 20, fetch_check_ms: 0")) == pytest.approx(base, abs=0.01)
    # looks every 5 ms: answered at 1.005
    assert _p50(_scn(", fetch_wait_ms: 20, fetch_check_ms: 5")) - base == pytest.approx(3.0, abs=0.01)
    # with 1.5 ms per response the fetches go out every 21.5 ms: the one of 0.989
    # looks at 0.994, 0.999, 1.004 and its answer arrives at 1.0055
    assert _p50(_scn(", fetch_wait_ms: 20, fetch_check_ms: 5, fetch_overhead_ms: 1.5")) - base == \
        pytest.approx(3.5, abs=0.01)


def test_fetch_loop_keeps_every_record_under_steady_load():
    r = run_scenario(parse_scenario(_scn(", fetch_wait_ms: 5, fetch_overhead_ms: 0.5, fetch_check_ms: 1",
                                         workload="[{member: all, rate_eps: 300, partitions: 2}]")))
    assert r.failing == []
    assert all(n == r.summary["events_submitted"] > 1000 for n in r.summary["events_delivered"].values())
    assert r.summary["latency_ms"]["max"] < 20


def test_member_producer_linger_and_acks_delay_durability_not_the_hand_over():
    base = run_scenario(parse_scenario(_scn()))
    slow = run_scenario(parse_scenario(_scn(", sink_linger_ms: 3, ack_ms: 4")))
    assert slow.summary["latency_ms"]["p50"] - base.summary["latency_ms"]["p50"] == pytest.approx(7.0, abs=0.01)
    # the records' CreateTime in the global topic is when they were handed over: unchanged
    assert slow.summary["latency_created_ms"] == base.summary["latency_created_ms"]


def test_member_producer_batches_what_it_is_handed_while_it_lingers():
    text = _scn(", sink_linger_ms: 4", workload="[{member: dc1, burst: 5, at_s: 1.0}, {member: dc2, burst: 5, at_s: 1.001}]",
                extra="member_cost: {event_us: 100}")
    sim = Simulation(parse_scenario(text), 0)
    sim.run()
    t = sim.clusters["dc3"].topic
    assert t.length == 10
    handed = sorted(set(t.handed))
    assert len(handed) >= 2  # two hand-overs (one per origin's slot) ...
    assert len(set(t.ts)) == 1  # ... one producer batch: durable together
    assert t.ts[0] == pytest.approx(handed[0] + 0.004 + 0.002)


def test_timing_counts_the_real_members_timers_in_its_ticks():
    from kdsync.config import ProtocolSection

    s = parse_scenario(_scn(extra="timing: {}"))
    cfg = node_config(s, "dc1")  # kdsync run's defaults, counted as kdsync run counts them
    p = ProtocolSection()
    assert (cfg.heartbeat_ticks, cfg.suspect_ticks, cfg.retransmit_ticks) == \
        (p.ticks(p.heartbeat_ms), p.ticks(p.suspect_ms), p.ticks(p.retransmit_ms))
    assert Simulation(s, 0).tick_s == p.tick_ms / 1000.0
    s = parse_scenario(_scn(extra="timing: {tick_ms: 5, heartbeat_ms: 20, suspect_ms: 300, retransmit_ms: 32}"))
    cfg = node_config(s, "dc1")
    assert (cfg.heartbeat_ticks, cfg.suspect_ticks, cfg.retransmit_ticks) == (4, 60, 6)
    assert Simulation(s, 0).tick_s == 0.005


def test_ticks_fall_on_the_members_tick_boundaries():
    from kdsync.core import make_node

    times: dict[str, list[float]] = {}
    sims: list[Simulation] = []

    def factory(config, **kw):
        node = make_node(config, **kw)
        real = node.tick

        def tick():
            times.setdefault(config.member_id, []).append(sims[0].now)
            real()

        node.tick = tick
        return node

    sim = Simulation(parse_scenario(_scn(extra="timing: {tick_ms: 25}")), 3, factory)
    sims.append(sim)
    sim.run()
    for ts in times.values():
        gaps = np.diff(ts)
        assert len(ts) > 100 and np.allclose(gaps, 0.025)


def test_retransmission_waits_for_the_timer_in_ticks():
    # lost messages are only resent by a tick's timer: a long retransmit_ms shows in the tail
    def p99(retransmit: int) -> float:
        text = _scn(workload="[{member: all, rate_eps: 200}]",
                    extra=f"timing: {{tick_ms: 10, retransmit_ms: {retransmit}, suspect_ms: 5000}}")
        text = text.replace("latency_ms: 0}", "latency_ms: 1, loss: 0.05}")
        r = run_scenario(parse_scenario(text))
        assert r.failing == []
        return r.summary["latency_ms"]["p99"]

    assert p99(400) > p99(20) + 100


def test_tick_cost_is_charged_once_per_tick():
    text = _scn(workload="[]", extra="timing: {tick_ms: 10}\nmember_cost: {tick_us: 1000}")
    sim = Simulation(parse_scenario(text), 0)
    sim.run()
    for m in sim.order:  # 4 s of ticks every 10 ms, 1 ms each (plus a few heartbeats, free)
        assert m.cpu_s == pytest.approx(0.4, abs=0.003)


def test_profile_fills_what_the_scenario_does_not_give(tmp_path):
    prof = tmp_path / "cal.yaml"
    prof.write_text("kafka: {produce_ms: 1.5, fetch_wait_ms: 5}\nmember_cost: {event_us: 80, tick_us: 20}\n"
                    "timing: {tick_ms: 10}\ncalibration: {when: now}\n")
    scn = tmp_path / "s.yaml"
    scn.write_text(_scn(", fetch_overhead_ms: 0.7", extra="profile: cal.yaml\nmember_cost: {event_us: 50}"))
    from sim.scenario import load_scenario

    s = load_scenario(scn)
    assert (s.kafka.produce_ms, s.kafka.fetch_wait_ms, s.kafka.fetch_overhead_ms) == (2.0, 5.0, 0.7)  # own keys win
    assert (s.member_cost.event_us, s.member_cost.tick_us) == (50, 20)
    assert s.timing.tick_ms == 10


def test_profile_errors_are_one_line_naming_the_key(tmp_path):
    scn = tmp_path / "s.yaml"
    scn.write_text(_scn(extra="profile: nowhere.yaml"))
    from sim.scenario import load_scenario

    with pytest.raises(ScenarioError) as e:
        load_scenario(scn)
    msg = str(e.value)
    assert "\n" not in msg and ":9: profile: no such calibration profile 'nowhere.yaml'" in msg
    with pytest.raises(ScenarioError, match=r"kafka.fetch_wait_ms: Input should be greater than or equal to 0"):
        parse_scenario(_scn(", fetch_wait_ms: -1"))


# ------------------------------------------------------------ the calibration fit
def test_calibration_fit_recovers_known_costs_from_noisy_rows():
    rng = np.random.default_rng(7)
    true = {"message_us": 40.0, "event_us": 120.0, "tick_us": 300.0}
    rows = []
    for rate in (0, 100, 300, 1000):
        for _ in range(3):
            secs = 6.0
            events = rate * secs * rng.uniform(0.9, 1.1) * 4 / 3
            frames = 200 * secs + rate * secs * 1.8 * rng.uniform(0.8, 1.2)
            ticks = secs / 0.01
            cpu = (true["message_us"] * frames + true["event_us"] * events + true["tick_us"] * ticks) / 1e6
            rows.append({"cpu_s": cpu * rng.uniform(0.97, 1.03), "frames": frames, "events": events, "ticks": ticks})
    fit = fit_costs(rows)
    for k, v in true.items():
        assert fit[k] == pytest.approx(v, rel=0.25), (k, fit)
    assert fit["r2"] > 0.95


def test_nnls_never_returns_a_negative_cost():
    a = np.array([[1.0, 1.0], [2.0, 1.0], [3.0, 1.0]])
    b = np.array([3.0, 2.0, 1.0])  # plain least squares: slope -1, intercept 4
    x = nnls(a, b)
    assert (x >= 0).all() and x[0] == 0.0 and x[1] == pytest.approx(2.0)


def test_box_terms_wakeup_and_slowdown():
    def run(cost: str):
        sim = Simulation(parse_scenario(_scn(extra=f"timing: {{tick_ms: 10}}\nmember_cost: {{{cost}}}")), 0)
        sim.run()
        lat = sorted(sim.latencies())
        return sim, lat[len(lat) // 2][0]

    plain, p50 = run("tick_us: 1000")
    slow, _ = run("tick_us: 1000, slowdown: 2")
    assert slow.order[0].cpu_s == pytest.approx(2 * plain.order[0].cpu_s, rel=0.01)
    _, woken = run("tick_us: 1000, wakeup_us: 5000")
    # every hop of the burst (fetch -> submit, slot in at each peer, acks back) waits ~5 ms for the scheduler
    assert woken > p50 + 5


def test_calibrate_on_real_members_writes_a_profile_scenarios_can_name(tmp_path):
    """A short real calibration (3 embedded Tansu clusters, 3 kdsync run): the
    profile has every term, non-negative, and a scenario naming it runs."""
    pytest.importorskip("psutil")
    from sim.cli import main

    prof = tmp_path / "cal.yaml"
    assert main(["calibrate", "--out", str(prof), "--rates", "150,600", "--duration", "1.0"]) == 0
    import yaml

    p = yaml.safe_load(prof.read_text())
    c, k = p["member_cost"], p["kafka"]
    assert all(c[t] >= 0 for t in ("message_us", "event_us", "tick_us", "wakeup_us"))
    assert c["message_us"] + c["event_us"] + c["tick_us"] > 0  # a member costs something
    assert c["slowdown"] >= 1.0
    from kdsync.kafka.source import consumer_conf

    member_wait = float(consumer_conf("x", {})["fetch.wait.max.ms"])  # the member's own, read from the code
    assert 0 < k["produce_ms"] < 100 and k["fetch_wait_ms"] == member_wait == 10.0 and k["sink_linger_ms"] == 1.0
    from kdsync.config import ProtocolSection

    d = ProtocolSection()
    assert p["timing"] == {k: float(getattr(d, k)) for k in ("tick_ms", "heartbeat_ms", "suspect_ms", "retransmit_ms")}
    assert len(p["calibration"]["members"]) == 6  # 3 members x 2 rates
    scn = tmp_path / "s.yaml"
    scn.write_text(_scn(workload="[{member: all, rate_eps: 100, partitions: 2}]", extra=f"profile: {prof.name}"))
    from sim.scenario import load_scenario

    r = run_scenario(load_scenario(scn))
    assert r.failing == [] and r.summary["latency_created_ms"]["p50"] > 0


def test_writer_linger_batches_like_librdkafka():
    from sim.workload import writes

    s = parse_scenario(_scn(", linger_ms: 0, writer_linger_ms: 2",
                            workload="[{member: dc1, rate_eps: 2000, partitions: 2}]"))
    ws = [w for block in writes(s, 1, "dc1", 1.0) for w in block]
    exact = [w for block in writes(parse_scenario(_scn(", linger_ms: 0", workload="[{member: dc1, rate_eps: 2000, "
                                                                                   "partitions: 2}]")), 1, "dc1", 1.0)
             for w in block]
    assert sum(w.count for w in ws) == len(exact)  # every record, batched
    assert len(ws) < len(exact) * 0.8 and max(w.count for w in ws) > 1
    assert all(a.t <= b.t for a, b in zip(ws, ws[1:]))  # in send order
    for p in (0, 1):  # a batch leaves 2 ms after the first record it holds, which came after the last batch left
        mine = [w for w in ws if w.partition == p]
        arrivals = [w.t for w in exact if w.partition == p]
        j = 0
        for w in mine:
            assert w.t == pytest.approx(arrivals[j] + 0.002)
            j += w.count
            assert all(t < w.t for t in arrivals[j - w.count:j]) and (j == len(arrivals) or arrivals[j] >= w.t)
    with pytest.raises(ScenarioError, match="writer_linger_ms batches exact arrivals: it needs linger_ms: 0"):
        parse_scenario(_scn(", linger_ms: 5, writer_linger_ms: 2"))


def test_paced_arrivals_are_evenly_spaced_and_poisson_stays_the_default():
    from sim.workload import writes

    def recs(kafka: str, arrivals: str = "", seed: int = 1):
        s = parse_scenario(_scn(kafka, workload=f"[{{member: dc1, rate_eps: 500, partitions: 2{arrivals}}}]"))
        return [w for block in writes(s, seed, "dc1", 0.5) for w in block]

    exact = recs(", linger_ms: 0", ", arrivals: paced")
    assert len(exact) == 1000 and all(w.count == 1 for w in exact)  # 500/s for 2 s, one record each
    gaps = np.diff([w.t for w in exact])
    assert gaps == pytest.approx(np.full(len(gaps), 0.002))  # one every 1/rate
    assert {w.partition for w in exact} == {0, 1}
    assert exact[0].t != recs(", linger_ms: 0", ", arrivals: paced", seed=2)[0].t  # the phase is the seed's
    ticked = recs(", linger_ms: 5", ", arrivals: paced")
    assert sum(w.count for w in ticked) == 1000 and all(round(w.t / 0.005, 6) % 1 == 0 for w in ticked)
    poisson = recs(", linger_ms: 0")
    assert np.std(np.diff([w.t for w in poisson])) > 0.001  # exponential gaps: the default is unchanged
    with pytest.raises(ScenarioError, match="arrivals is for a rate"):
        parse_scenario(_scn(workload="[{member: dc1, burst: 10, at_s: 1.0, arrivals: paced}]"))


def test_link_extra_delay_is_drawn_from_its_quantiles_and_keeps_links_fifo():
    def lat(extra: str) -> dict:
        text = f"""
name: extra
duration_s: 3
settle_s: 2
protocol: mirror
members: [{{id: dc1}}, {{id: dc2}}]
network: {{default: {{latency_ms: 10{extra}}}}}
kafka: {{produce_ms: 0, consume_ms: 0}}
workload: [{{member: dc1, rate_eps: 200}}]
"""
        r = run_scenario(parse_scenario(text))
        assert r.failing == [], [v.detail for v in r.failing]  # FIFO links: origin order holds
        return r.summary["latency_ms"]

    base, const, spread = lat(""), lat(", extra_quantiles_ms: [5, 5]"), lat(", extra_quantiles_ms: [0, 20]")
    # mirror: half the records are local (no hop), half cross one link; the remote half carries the extra
    assert const["p99"] == pytest.approx(base["p99"] + 5, abs=1.0)
    assert base["p99"] + 10 < spread["p99"] <= base["p99"] + 21  # uniform 0..20 ms: its top reaches the p99
    with pytest.raises(ScenarioError, match="extra_quantiles_ms must be >= 0 and non-decreasing"):
        parse_scenario(_scn(extra="").replace("latency_ms: 0", "latency_ms: 0, extra_quantiles_ms: [3, 1]"))


def test_wakeup_quantiles_are_sampled_by_inverse_cdf():
    s = parse_scenario(_scn(extra="member_cost: {wakeup_quantiles_us: [1000, 1000, 3000]}"))
    sim = Simulation(s, 0)
    m = sim.order[0]
    xs = [m._wakeup_delay() for _ in range(4000)]
    assert min(xs) >= 0.001 - 1e-12 and max(xs) <= 0.003 + 1e-12
    assert sum(x <= 0.001 + 1e-9 for x in xs) / len(xs) == pytest.approx(0.5, abs=0.03)  # half the mass at 1 ms
    with pytest.raises(ScenarioError, match="non-decreasing"):
        parse_scenario(_scn(extra="member_cost: {wakeup_quantiles_us: [3, 1]}"))


def test_simreal_scenario_from_a_profile(tmp_path):
    import yaml

    from bench.simreal import LOOPBACK_MS, scenario_for, sim_point
    from sim.calibrate import build_profile, write_profile

    broker = {"produce_ms": 0.9, "fetch_overhead_ms": 0.1, "fetch_check_ms": 3.0}
    prof = write_profile(build_profile({"message_us": 100.0, "event_us": 40.0, "tick_us": 500.0}, broker, {},
                                       {"wakeup_us": 300.0, "slowdown": 1.2}), tmp_path / "cal.yaml")
    d = scenario_for(prof, 300, 10, 3)
    assert d["network"]["default"]["latency_ms"] == 10 + LOOPBACK_MS
    assert d["workload"][0]["arrivals"] == "paced"  # as the real bench's writers
    assert "extra_quantiles_ms" not in d["network"]["default"]
    late = scenario_for(prof, 300, 10, 3, link_late_ms=[0.1, 0.5, 4.0])["network"]["default"]
    assert late == {"latency_ms": 10 + LOOPBACK_MS, "extra_quantiles_ms": [0.1, 0.5, 4.0]}
    s = parse_scenario(yaml.safe_dump(d), str(tmp_path / "x.yaml"))
    assert s.kafka.writer_linger_ms == 2.0 and s.kafka.fetch_wait_ms == 10.0 and s.member_cost.slowdown == 1.2
    near = sim_point(prof, 300, 10, 3, tmp_path)
    far = sim_point(prof, 300, 25, 3, tmp_path)
    assert near["violations"] == 0 and near["events"] > 700
    assert far["p50_ms"] > near["p50_ms"] + 30  # derecho's hops each carry the 15 ms more


def test_the_real_figure_is_the_median_of_runs_and_a_failed_run_is_reported():
    from bench.simreal import real_median

    results = iter([{"p50_ms": 40, "p90_ms": 50, "p99_ms": 90, "events": 10, "stage_fetch_ms": 9.0,
                     "proxy_late_quantiles_ms": [0.1, 1.0, 9.0]},
                    RuntimeError("3 events not ordered in 120 s"),
                    {"p50_ms": 38, "p90_ms": 48, "p99_ms": 52, "events": 10, "stage_fetch_ms": 8.0,
                     "proxy_late_quantiles_ms": [0.3, 0.8, 2.0]},
                    {"p50_ms": 44, "p90_ms": 49, "p99_ms": 60, "events": 10, "stage_fetch_ms": None,
                     "proxy_late_quantiles_ms": [0.2, 0.9, 3.0]}])

    def point(rate, delay, duration):
        r = next(results)
        if isinstance(r, Exception):
            raise r
        return r

    said = []
    m = real_median(1000, 10, 8, runs=4, say=said.append, point=point)
    assert (m["p50_ms"], m["p90_ms"], m["p99_ms"], m["runs"]) == (40, 49, 60, 3)
    assert m["p99_runs_ms"] == "90/52/60" and "stage_fetch_ms" not in m  # a key one run lacks is not invented
    assert m["proxy_late_quantiles_ms"] == [0.2, 0.9, 3.0]  # the median of each quantile over the runs
    assert "run 2: RuntimeError: 3 events not ordered" in m["error"] and said

    def down(rate, delay, duration):
        raise OSError("no broker")

    assert real_median(300, 10, 8, runs=2, say=said.append, point=down) == {
        "error": "run 1: OSError: no broker; run 2: OSError: no broker", "runs": 0}


def test_broker_terms_are_interpolated_at_a_points_rate():
    from sim.calibrate import kafka_at

    prof = {"calibration": {"broker_by_rate": [
        {"rate_eps": 1000, "produce_ms": 3.0, "fetch_overhead_ms": 1.0, "fetch_check_ms": 4.0},
        {"rate_eps": 100, "produce_ms": 1.0, "fetch_overhead_ms": 0.0, "fetch_check_ms": 2.0}]}}
    assert kafka_at(prof, 550) == {"produce_ms": 2.0, "fetch_overhead_ms": 0.5, "fetch_check_ms": 3.0}
    assert kafka_at(prof, 50)["produce_ms"] == 1.0 and kafka_at(prof, 5000)["produce_ms"] == 3.0
    assert kafka_at({}, 300) == {}


def test_stage_means_split_fetch_from_ordering():
    r = run_scenario(parse_scenario(_scn(", linger_ms: 0, fetch_wait_ms: 20")), stages=True)
    st = r.summary["stages_ms"]
    assert st["batches"] == 1 and st["fetch"] == pytest.approx(20.0, abs=0.01)  # written 1.0, fetched 1.02
    assert r.summary["latency_created_ms"]["p50"] == pytest.approx(st["fetch"] + st["ordering"], abs=1.0)
    assert "stages_ms" not in run_scenario(parse_scenario(_scn())).summary


def test_broker_by_rate_keeps_the_probes_terms_and_records_the_members_fetch_stage():
    from sim.calibrate import broker_by_rate

    b = {"produce_ms": 1.0, "fetch_overhead_ms": 0.1, "fetch_check_ms": 3.0, "fetch_p50_ms": 1.5}
    rows = broker_by_rate([{"rate_eps": 300, "broker": b, "member_fetch_ms": 9.5},
                           {"rate_eps": 1000, "broker": b, "member_fetch_ms": None},
                           {"rate_eps": 20, "broker": {"error": "x"}}])
    assert [r["rate_eps"] for r in rows] == [300, 1000]
    assert rows[0]["produce_ms"] == rows[1]["produce_ms"] == 1.0
    assert rows[0]["member_fetch_ms"] == 9.5 and rows[0]["probe_fetch_path_ms"] == pytest.approx(2.0 + 1.0 + 1.5)


def test_latency_after_ready_leaves_out_only_the_records_that_raced_the_groups_formation():
    # 40 ms one way: the first view takes several hops; records written from t=0 wait for it
    text = _scn(workload="[{member: all, rate_eps: 200, partitions: 2}]").replace("latency_ms: 0", "latency_ms: 40")
    r = run_scenario(parse_scenario(text))
    assert r.failing == []
    ready = r.summary["group_ready_s"]
    assert 0.08 < ready < 1.0  # at least one round trip between the members
    whole, after = r.summary["latency_created_ms"], r.summary["latency_created_after_ready_ms"]
    assert whole["max"] >= 1000 * ready - 5  # a record created at ~t=0 waited for the view
    assert after["max"] < whole["max"] and after["p99"] <= whole["p99"]
    assert after["p50"] >= 80  # still at least a round trip: later records are all kept
    # a member that never starts: the group is never ready, nothing is counted after it
    down = run_scenario(parse_scenario(text + "faults: [{at_s: 0, crash: dc3}]"))
    assert down.summary["group_ready_s"] is None
    assert down.summary["latency_created_after_ready_ms"]["p50"] == 0.0
