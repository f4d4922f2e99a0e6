"""Throughput of the TCP transport on loopback: one sender, one receiver, one process.

Both ends share one event loop (and so one core), so the figures are a lower
bound for two members on two machines.  `pytest tests/test_tcp_transport_bench.py
--benchmark-enable` reports messages/s and MB/s in extra_info; in the normal
suite (--benchmark-disable) each case runs once as a check that every message
arrives in order.
"""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from kdsync.transport import TLSSettings
from kdsync.transport.tcp import TcpTransport

CASES = {"100B": (100, 200_000), "1KiB": (1024, 50_000), "64KiB": (65536, 2_000)}


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


async def pump(size: int, count: int, tls: TLSSettings | None = None) -> float:
    """Send `count` messages of `size` bytes a -> b; return seconds until all arrived."""
    ports = free_ports(2)
    peers = {"a": ("127.0.0.1", ports[0]), "b": ("127.0.0.1", ports[1])}
    got = []
    done = asyncio.Event()

    def on_b(peer: str, data: bytes) -> None:
        got.append(data)
        if len(got) == count:
            done.set()

    opts = dict(backoff_initial=0.01, backoff_max=0.1, max_queue_bytes=64 << 20, tls=tls)
    a = TcpTransport("a", peers["a"], peers, lambda p, d: None, **opts)
    b = TcpTransport("b", peers["b"], peers, on_b, **opts)
    await a.start()
    await b.start()
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while not a.stats["b"].connected:
            assert loop.time() < deadline, "link never came up"
            await asyncio.sleep(0.01)
        msgs = [i.to_bytes(8, "big") + bytes(size - 8) for i in range(min(count, 1000))]
        t0 = time.perf_counter()
        i = 0
        while i < count:
            if a.send("b", msgs[i % len(msgs)]):
                i += 1
            else:
                await asyncio.sleep(0)  # queue full: let the writer run
            if i % 256 == 0:
                await asyncio.sleep(0)
        await asyncio.wait_for(done.wait(), 60)
        elapsed = time.perf_counter() - t0
        assert [int.from_bytes(g[:8], "big") for g in got[:1000]] == list(range(min(count, 1000)))
        assert a.stats["b"].frames_out < count
        return elapsed
    finally:
        await a.close()
        await b.close()


@pytest.mark.benchmark
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(CASES))
def test_bench_tcp_one_way_throughput(benchmark, case):
    size, count = CASES[case]
    if benchmark.disabled:
        count = max(50, count // 50)  # quick correctness run in the normal suite
    seconds = benchmark.pedantic(lambda: asyncio.run(pump(size, count)), rounds=1, iterations=1)
    benchmark.extra_info["messages_per_s"] = round(count / seconds)
    benchmark.extra_info["MB_per_s"] = round(size * count / seconds / 1e6, 1)
