"""RDMA vs TCP in the same VM: round-trip latency and throughput.

Both transports run in this one process and loop, between the same address,
with the same messages.  The two are measured in alternating rounds (the
host running the emulator is shared, its load drifts) and each keeps its best
round.  Under qemu's emulation only the ratio means much."""

from __future__ import annotations

import asyncio
import statistics
import time

import pytest

from kdsync.transport.rdma import RdmaTransport
from kdsync.transport.tcp import TcpTransport

from helpers import group, wait_for

# a measurement, not a behaviour: make bench runs it (KDSYNC_VM_SUITE=bench), make test does not
pytestmark = pytest.mark.bench

ROUNDS = 2
WARMUP, ROUND_TRIPS = 20, 100
THROUGHPUT_MSGS, MSG_BYTES = 6_000, 1024


class Pair:
    """a -> b link of one transport kind; b echoes messages starting with b"p"."""

    def __init__(self, kind: str, addr: str, ports: list[int]) -> None:
        peers = group(["a", "b"], addr, ports)
        self.kind = kind
        self.echoes: list[bytes] = []
        self.received = 0
        self.waiter: asyncio.Future | None = None
        if kind == "rdma":
            mk = lambda m, cb: RdmaTransport(m, peers[m], peers, cb, secret=b"bench", tcp_fallback=False)  # noqa: E731
        else:
            mk = lambda m, cb: TcpTransport(m, peers[m], peers, cb, secret=b"bench")  # noqa: E731
        self.a, self.b = mk("a", self._on_a), mk("b", self._on_b)

    def _on_a(self, peer: str, data: bytes) -> None:
        self.echoes.append(data)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _on_b(self, peer: str, data: bytes) -> None:
        self.received += 1
        if data[:1] == b"p":
            self.b.send(peer, data)

    async def start(self) -> None:
        await self.a.start()
        await self.b.start()
        await wait_for(lambda: self.a.stats["b"].connected and self.b.stats["a"].connected, 60, f"{self.kind} links")

    async def rtts(self) -> list[float]:
        loop = asyncio.get_running_loop()
        out = []
        for i in range(WARMUP + ROUND_TRIPS):
            self.waiter = loop.create_future()
            msg = b"p%07d" % i + b"." * 56  # 64 bytes
            t0 = time.perf_counter()
            assert self.a.send("b", msg)
            await asyncio.wait_for(self.waiter, 10)
            dt = time.perf_counter() - t0
            assert self.echoes[-1] == msg
            if i >= WARMUP:
                out.append(dt * 1e6)
        return out

    async def throughput(self) -> float:
        base = self.received
        payload = b"t" * MSG_BYTES
        t0 = time.perf_counter()
        sent = 0
        while sent < THROUGHPUT_MSGS:
            if self.a.send("b", payload):
                sent += 1
            else:
                await asyncio.sleep(0)  # queue full: let the transport drain
            if sent % 256 == 0:
                await asyncio.sleep(0)
        await wait_for(lambda: self.received - base == THROUGHPUT_MSGS, 120, f"{self.kind} throughput run")
        return THROUGHPUT_MSGS / (time.perf_counter() - t0)

    async def close(self) -> None:
        await self.a.close()
        await self.b.close()


def _summary(rtt_rounds: list[list[float]], tput_rounds: list[float]) -> dict:
    best = min(rtt_rounds, key=statistics.median)
    best = sorted(best)
    tput = max(tput_rounds)
    return {
        "rtt_us_p50": round(statistics.median(best), 1),
        "rtt_us_p99": round(best[int(0.99 * (len(best) - 1))], 1),
        "rtt_us_mean": round(statistics.fmean(best), 1),
        "rtt_us_p50_rounds": [round(statistics.median(r), 1) for r in rtt_rounds],
        "throughput_msgs_s": round(tput, 1),
        "throughput_MB_s": round(tput * MSG_BYTES / 1e6, 2),
        "throughput_rounds": [round(t, 1) for t in tput_rounds],
        "round_trips": len(best),
        "msg_bytes_throughput": MSG_BYTES,
    }


def test_rdma_vs_tcp_latency_and_throughput(addr, ports, results):
    async def run():
        pairs = {"rdma": Pair("rdma", addr, ports[:2]), "tcp": Pair("tcp", addr, ports[2:4])}
        rtts: dict[str, list] = {k: [] for k in pairs}
        tputs: dict[str, list] = {k: [] for k in pairs}
        try:
            for p in pairs.values():
                await p.start()
            for _ in range(ROUNDS):
                for kind, p in pairs.items():
                    rtts[kind].append(await p.rtts())
                    tputs[kind].append(await p.throughput())
        finally:
            for p in pairs.values():
                await p.close()
        return {k: _summary(rtts[k], tputs[k]) for k in pairs}

    out = asyncio.run(run())
    rdma, tcp = out["rdma"], out["tcp"]
    for r in (rdma, tcp):
        assert r["round_trips"] == ROUND_TRIPS and r["rtt_us_p50"] > 0 and r["throughput_msgs_s"] > 0
    results["perf"] = {
        "rdma": rdma,
        "tcp": tcp,
        "rtt_p50_rdma_over_tcp": round(rdma["rtt_us_p50"] / tcp["rtt_us_p50"], 3),
        "throughput_rdma_over_tcp": round(rdma["throughput_msgs_s"] / tcp["throughput_msgs_s"], 3),
        "note": "one process, one asyncio loop, qemu TCG guest, soft-RoCE rxe0 (RoCE MTU 4096); best of "
        f"{ROUNDS} alternating rounds; ratios only",
    }
