"""The simulator's own models: network links (FIFO, loss, duplication,
reordering, bandwidth, partitions, link faults) and the crash/restart path of
the member adapter (what a restarted node is given)."""

from __future__ import annotations

import textwrap

import pytest
import simpy

from dataclasses import replace

from kdsync.core import Delivery, make_node
from sim.network import SimNetwork
from sim.runner import run_scenario
from sim.scenario import LinkSpec, NetworkSpec, parse_scenario

from sim_helpers import need_protocol


def _net(default: dict, links=(), seed=1):
    env = simpy.Environment()
    got: list[tuple[float, str, str, bytes]] = []
    spec = NetworkSpec.model_validate({"default": default, "links": list(links)})
    net = SimNetwork(env, ("a", "b", "c"), spec, seed, lambda s, d, b, channel: got.append((env.now, s, d, b)))
    return env, net, got


def _send_many(env, net, n, src="a", dst="b", every=0.001, size=10):
    def proc():
        for i in range(n):
            net.send(src, dst, i.to_bytes(4, "big") + b"x" * (size - 4))
            yield env.timeout(every)

    env.process(proc())
    env.run()


def test_jitter_delays_but_a_link_stays_fifo():
    env, net, got = _net({"latency_ms": 20, "jitter_ms": 10})
    _send_many(env, net, 500)
    ids = [int.from_bytes(b[:4], "big") for _, _, _, b in got]
    assert ids == list(range(500))
    delays = sorted(t - int.from_bytes(b[:4], "big") * 0.001 for t, _, _, b in got)
    assert delays[0] >= 0 and delays[-1] - delays[0] > 0.01  # jitter is there


def test_loss_duplication_and_reordering_rates():
    env, net, got = _net({"latency_ms": 10, "jitter_ms": 1, "loss": 0.2, "duplicate": 0.1, "reorder": 0.1})
    _send_many(env, net, 5000)
    ids = [int.from_bytes(b[:4], "big") for _, _, _, b in got]
    distinct = set(ids)
    assert 0.75 < len(distinct) / 5000 < 0.85  # 20 % loss
    assert 0.05 < (len(ids) - len(distinct)) / len(distinct) < 0.15  # 10 % duplicated
    inversions = sum(1 for x, y in zip(ids, ids[1:]) if y < x)
    assert inversions > 100  # reordered copies are overtaken


def test_bandwidth_serialises_messages():
    env, net, got = _net({"latency_ms": 0, "bandwidth_mbps": 8})  # 1 byte per microsecond
    for _ in range(10):
        net.send("a", "b", b"z" * 1000)  # 1 ms each on the wire
    env.run()
    assert [round(t, 6) for t, *_ in got] == [round(0.001 * (i + 1), 6) for i in range(10)]


def test_partitions_link_faults_and_heal():
    env, net, got = _net({"latency_ms": 1})
    net.set_partition([["a"], ["b", "c"]])
    assert not net.can_send("a", "b") and not net.can_send("c", "a") and net.can_send("b", "c")
    net.send("a", "b", b"1")
    net.send("b", "c", b"2")
    net.set_link_fault("b", "c", LinkSpec(loss=1.0))  # asymmetric: b->c cut, c->b fine
    assert not net.can_send("b", "c") and net.can_send("c", "b")
    net.send("b", "c", b"3")
    net.send("c", "b", b"4")
    net.heal()
    assert net.can_send("a", "b") and net.can_send("b", "c")
    net.send("a", "b", b"5")
    env.run()
    assert [b for *_, b in got] == [b"2", b"4", b"5"]


def test_messages_to_oneself_loop_back_and_unknown_peers_are_dropped():
    env, net, got = _net({"latency_ms": 5})
    net.send("a", "a", b"me")
    net.send("a", "zz", b"nobody")
    env.run()
    assert got == [(0.0, "a", "a", b"me")]
    assert net.loopback == 1 and net.misaddressed == 1


def test_directional_override():
    env, net, got = _net({"latency_ms": 5}, links=[{"from": "a", "to": "c", "latency_ms": 50}])
    net.send("a", "c", b"slow")
    net.send("c", "a", b"fast")
    env.run()
    assert [(round(t, 3), b) for t, _, _, b in got] == [(0.005, b"fast"), (0.05, b"slow")]


def test_same_seed_same_network_draws():
    runs = []
    for _ in range(2):
        env, net, got = _net({"latency_ms": 10, "jitter_ms": 5, "loss": 0.1, "reorder": 0.1}, seed=42)
        _send_many(env, net, 300)
        runs.append(got)
    assert runs[0] == runs[1]


RESTART = parse_scenario(
    textwrap.dedent(
        """\
        name: restart
        protocol: derecho
        duration_s: 4
        settle_s: 3
        members: [{id: dc1}, {id: dc2}, {id: dc3}]
        network: {default: {latency_ms: 10, jitter_ms: 1}}
        workload: [{member: all, rate_eps: 100, partitions: 2}]
        faults:
          - {at_s: 1.5, crash: dc2}
          - {at_s: 2.5, restart: dc2}
        """
    )
)


@pytest.mark.timeout(60)
def test_restart_recovers_from_the_global_topic_and_committed_offsets():
    need_protocol("derecho")
    calls = []

    def spy(cfg, **kw):
        node = make_node(cfg, **kw)
        submitted = []
        real_submit = node.submit
        node.submit = lambda evs: (submitted.extend(evs), real_submit(evs))[1]
        calls.append((cfg.member_id, kw, submitted, node))
        return node

    r = run_scenario(RESTART, node_factory=spy)
    assert r.failing == [], r.failing
    dc2 = [(kw, sub, node) for m, kw, sub, node in calls if m == "dc2"]
    assert len(dc2) == 2
    first, (kw, resubmitted, node) = dc2[0][0], dc2[1]
    assert first["start_seq"] == 0 and first["hard_state"] is None
    # the restarted node starts where its global topic ended, with its watermarks and persisted state
    assert kw["start_seq"] > 0 and kw["hard_state"] is not None
    assert kw["watermarks"] and all(off >= 0 for off in kw["watermarks"].values())
    # the global topic held every offset up to each watermark, once
    assert sum(off + 1 for off in kw["watermarks"].values()) == kw["start_seq"]
    # input offsets are committed commit_ms after dc2's own events are durable
    # in its global topic: never ahead of it, and the new consumer starts there,
    # so events already ordered come again and the core drops them
    again = 0
    for p in (0, 1):
        first_again = next(b.first_offset for b in resubmitted if b.partition == p)
        own_wm = kw["watermarks"].get(("dc2", p), -1)
        assert first_again <= own_wm + 1
        again += own_wm + 1 - first_again
    assert again > 0
    assert node.stats["deduplicated"] >= again
    s = r.summary
    assert s["member_state"]["dc2"]["starts"] == 2
    assert all(n == s["events_submitted"] for n in s["events_delivered"].values())


def test_fifo_survives_float_rounding():
    """Messages clamped to the same arrival time, sent at different instants,
    still arrive in send order (SimPy adds the delay to now: rounding must not
    let a later message jump ahead)."""
    import random

    env, net, got = _net({"latency_ms": 60, "jitter_ms": 30})
    gaps = random.Random(5)

    def proc():
        for i in range(20000):
            net.send("a", "b", i.to_bytes(4, "big"))
            yield env.timeout(gaps.random() * 0.0005)

    env.process(proc())
    env.run()
    assert [int.from_bytes(b[:4], "big") for *_, b in got] == list(range(20000))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("poll_ms", [0, 10])
def test_consumer_keeps_consuming_after_a_restart_inside_one_workload_block(poll_ms):
    """Source events written ahead (one block) before a crash must still reach
    the restarted consumer (regression: fetch wake-ups were tied to the dead process)."""
    need_protocol("derecho")
    s = RESTART.model_copy(
        update={
            "faults": parse_scenario(
                "name: x\nduration_s: 4\nmembers: [{id: dc1}, {id: dc2}, {id: dc3}]\n"
                "faults: [{at_s: 2.1, crash: dc2}, {at_s: 2.4, restart: dc2}]\n"
            ).faults,
            # the last block: nothing written later would wake the consumer up again
            "workload": [RESTART.workload[0].model_copy(update={"stop_s": 3.0})],
            "kafka": RESTART.kafka.model_copy(update={"poll_ms": float(poll_ms)}),
        }
    )
    r = run_scenario(s)
    assert r.failing == [], r.failing
    assert all(n == r.summary["events_submitted"] for n in r.summary["events_delivered"].values())


SHARDED = parse_scenario(
    textwrap.dedent(
        """\
        name: sharded
        seed: 9
        protocol: derecho
        duration_s: 3
        settle_s: 4
        shards: 3
        members: [{id: dc1}, {id: dc2}, {id: dc3}]
        network: {default: {latency_ms: 10, jitter_ms: 1}}
        member_cost: {message_us: 20, event_us: 3, ready_us: 30, cores: 2}
        workload:
          - {member: all, rate_eps: 3000, payload_bytes: 64, partitions: 7}
        faults:
          - {at_s: 1.0, crash: dc2}
          - {at_s: 1.8, restart: dc2}
        """
    )
)


@pytest.mark.timeout(120)
def test_shards_are_independent_ordering_groups_each_identical_everywhere():
    """Shard s orders the source partitions p with p % 3 == s into partition s
    of every global topic; through a crash and restart each partition is the
    same sequence at every site, holding exactly its source partitions."""
    need_protocol("derecho")
    from sim.runner import Simulation

    sim = Simulation(SHARDED, SHARDED.seed)
    sim.run()
    r = run_scenario(SHARDED)
    assert r.failing == [] and r.summary["shards"] == 3, [v.detail for v in r.failing]
    assert all(n == r.summary["events_submitted"] for n in r.summary["events_delivered"].values())
    for shard in range(3):
        seqs = {site: [(b.origin, b.partition, b.first_offset, b.count) for b in c.topics[shard].batches]
                for site, c in sim.clusters.items()}
        flat = {site: [(o, p, off + i) for o, p, off, n in runs for i in range(n)] for site, runs in seqs.items()}
        assert flat["dc1"] == flat["dc2"] == flat["dc3"]  # one order per partition, identical everywhere
        assert flat["dc1"] and {p % 3 for _, p, _ in flat["dc1"]} == {shard}
    # the nodes of a site share its two cores: never more than two services at once
    assert all(pool.free <= 2 for pool in sim.cpu.values())


def test_a_broken_shard_is_reported_with_its_shard():
    """A node that drops a record of its delivery is caught in its own shard."""
    need_protocol("derecho")

    def lossy(cfg, **kw):
        node = make_node(cfg, **kw)
        real_ready, real_advance = node.ready, node.advance
        last = {}

        def ready():
            rd = last["rd"] = real_ready()
            if cfg.member_id == "dc3" and rd.deliveries and not getattr(node, "_dropped", False):
                d = rd.deliveries[0]
                b = d.batches[0]
                if b.partition % 3 == 1 and b.count > 1:
                    node._dropped = True
                    short = Delivery(d.first_seq, (b.slice(1),) + d.batches[1:], d.catchup)
                    return replace(rd, deliveries=(short,) + rd.deliveries[1:])
            return rd

        node.ready = ready
        node.advance = lambda rd: real_advance(last["rd"])
        return node

    s = SHARDED.model_copy(update={"faults": []})
    r = run_scenario(s, node_factory=lossy)
    assert r.failing and all(v.detail.startswith("shard 1: ") for v in r.failing), [v.detail for v in r.failing]
