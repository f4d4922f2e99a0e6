"""Core throughput (pytest-benchmark; `make bench` runs it with timing on).

Three derecho members in the in-memory network, every member submitting a
5 000-record `Batch` per round (a Kafka fetch); the figure is events ordered per second of wall time for the
whole group (all three cores' work runs on this one Python thread, with the
real codec on every hop), and the same per member.  The mirror baseline runs
the same workload for the ratio.
"""

import pytest

from kdsync.testing.network import InMemoryNetwork

BATCH, ROUNDS = 5000, 10


def _prepare(protocol):
    net = InMemoryNetwork(["a", "b", "c"], protocol=protocol, seed=1, max_batch=BATCH)
    if protocol != "mirror":  # derecho and sequencer form a view first
        net.run_until(lambda: all(net.node(i).status == "active" for i in "abc"), 100)
    batches = {i: [[net.make_batch(i, BATCH)] for _ in range(ROUNDS)] for i in "abc"}
    return (net, batches), {}


def _drive(net, batches):
    for r in range(ROUNDS):
        for i in "abc":
            net.node(i).submit(batches[i][r])
        net.stabilize()
    return net


@pytest.mark.benchmark(group="core")
@pytest.mark.parametrize("protocol", ["derecho", "mirror", "sequencer"])
def test_core_throughput(benchmark, protocol):
    net = benchmark.pedantic(_drive, setup=lambda: _prepare(protocol), rounds=3, iterations=1)
    total = 3 * BATCH * ROUNDS
    assert all(net.topic_len(i) == total for i in "abc")
    if benchmark.stats is not None:
        mean = benchmark.stats.stats.mean
        benchmark.extra_info["events_per_s_group"] = total / mean
        benchmark.extra_info["events_per_s_per_member"] = 3 * total / mean
