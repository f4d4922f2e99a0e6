"""RDMA vs TCP in the same VM: round-trip latency and throughput.

Both transports run in this one process and loop, between the same address,
with the same messages; under qemu's emulation only the ratio means much."""

from __future__ import annotations

import asyncio
import statistics
import time

from kdsync.transport.rdma import RdmaTransport
from kdsync.transport.tcp import TcpTransport

from helpers import group, wait_for

WARMUP, ROUND_TRIPS = 30, 300
THROUGHPUT_MSGS, MSG_BYTES = 20_000, 1024


async def _measure(kind: str, addr: str, ports: list[int]) -> dict:
    peers = group(["a", "b"], addr, ports)
    echoes: list[bytes] = []
    received = [0]
    state = {"waiter": None}
    trs: dict = {}

    def on_a(peer: str, data: bytes) -> None:
        echoes.append(data)
        w = state["waiter"]
        if w is not None and not w.done():
            w.set_result(None)

    def on_b(peer: str, data: bytes) -> None:
        received[0] += 1
        if data[:1] == b"p":
            trs["b"].send(peer, data)

    if kind == "rdma":
        mk = lambda m, cb: RdmaTransport(m, peers[m], peers, cb, secret=b"bench", tcp_fallback=False)  # noqa: E731
    else:
        mk = lambda m, cb: TcpTransport(m, peers[m], peers, cb, secret=b"bench")  # noqa: E731
    trs["a"], trs["b"] = mk("a", on_a), mk("b", on_b)
    loop = asyncio.get_running_loop()
    try:
        for t in trs.values():
            await t.start()
        await wait_for(lambda: trs["a"].stats["b"].connected and trs["b"].stats["a"].connected, 60, f"{kind} links")
        rtts = []
        for i in range(WARMUP + ROUND_TRIPS):
            state["waiter"] = loop.create_future()
            msg = b"p%07d" % i + b"." * 56  # 64 bytes
            t0 = time.perf_counter()
            assert trs["a"].send("b", msg)
            await asyncio.wait_for(state["waiter"], 10)
            dt = time.perf_counter() - t0
            assert echoes[-1] == msg
            if i >= WARMUP:
                rtts.append(dt * 1e6)
        base = received[0]
        payload = b"t" * MSG_BYTES
        t0 = time.perf_counter()
        sent = 0
        while sent < THROUGHPUT_MSGS:
            if trs["a"].send("b", payload):
                sent += 1
            else:
                await asyncio.sleep(0)  # queue full: let the transport drain
            if sent % 256 == 0:
                await asyncio.sleep(0)
        await wait_for(lambda: received[0] - base == THROUGHPUT_MSGS, 120, f"{kind} throughput run")
        secs = time.perf_counter() - t0
        rtts.sort()
        return {
            "rtt_us_p50": round(statistics.median(rtts), 1),
            "rtt_us_p99": round(rtts[int(0.99 * (len(rtts) - 1))], 1),
            "rtt_us_mean": round(statistics.fmean(rtts), 1),
            "throughput_msgs_s": round(THROUGHPUT_MSGS / secs, 1),
            "throughput_MB_s": round(THROUGHPUT_MSGS * MSG_BYTES / secs / 1e6, 2),
            "round_trips": len(rtts),
            "msg_bytes_throughput": MSG_BYTES,
        }
    finally:
        for t in trs.values():
            await t.close()


def test_rdma_vs_tcp_latency_and_throughput(addr, ports, results):
    async def run():
        rdma = await _measure("rdma", addr, ports[:2])
        tcp = await _measure("tcp", addr, ports[2:4])
        return rdma, tcp

    rdma, tcp = asyncio.run(run())
    for r in (rdma, tcp):
        assert r["round_trips"] == ROUND_TRIPS and r["rtt_us_p50"] > 0 and r["throughput_msgs_s"] > 0
    results["perf"] = {
        "rdma": rdma,
        "tcp": tcp,
        "rtt_p50_rdma_over_tcp": round(rdma["rtt_us_p50"] / tcp["rtt_us_p50"], 3),
        "throughput_rdma_over_tcp": round(rdma["throughput_msgs_s"] / tcp["throughput_msgs_s"], 3),
        "note": "one process, one asyncio loop, qemu TCG guest with soft-RoCE (rxe0); ratios only",
    }
