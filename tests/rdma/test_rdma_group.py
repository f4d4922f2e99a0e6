"""A three-member kdsync group ordering concurrent submits over RDMA (rxe0):
the real ordering core (derecho) driven through RdmaTransport, one asyncio
loop, no Kafka (each member's "global topic" is a list)."""

from __future__ import annotations

import asyncio
import random
import time

from kdsync.core import Batch, Event, LogChunk, NodeConfig, RemoteProtocolError, batches_from_events, make_node
from kdsync.transport.rdma import RdmaTransport

from helpers import group, wait_for

TICK_S = 0.05


class Member:
    """The adapter loop of one member: Ready -> sends, deliveries, reads."""

    def __init__(self, mid: str, peers: dict, protocol: str, seed: int) -> None:
        cfg = NodeConfig(
            member_id=mid,
            members=tuple(peers),
            protocol=protocol,
            heartbeat_ticks=2,
            suspect_ticks=60,  # 3 s: emulated CPUs stall, do not churn views
            retransmit_ticks=6,
        )
        self.id = mid
        self.node = make_node(cfg, rng=random.Random(seed))
        self.topic: list[Event] = []
        self.gaps = 0
        self.bad = 0
        self.views: list = []
        self.next_offset = 0
        self._due = False
        self.transport = RdmaTransport(mid, peers[mid], peers, self.on_message, secret=b"g", tcp_fallback=False)

    def on_message(self, peer: str, data: bytes) -> None:
        try:
            self.node.receive(peer, data)
        except RemoteProtocolError:
            self.bad += 1
        self.schedule()

    def schedule(self) -> None:
        if not self._due:
            self._due = True
            asyncio.get_running_loop().call_soon(self.process)

    def submit(self, n: int) -> None:
        evs = [Event(self.id, 0, self.next_offset + j, b"%s-%d" % (self.id.encode(), self.next_offset + j)) for j in range(n)]
        self.next_offset += n
        self.node.submit([Batch.from_events(evs)])
        self.schedule()

    def process(self) -> None:
        self._due = False
        node = self.node
        while node.has_ready():
            rd = node.ready()
            for m in rd.messages:
                self.transport.send(m.to, m.data)
            for d in rd.deliveries:
                if d.first_seq != len(self.topic):
                    self.gaps += 1
                self.topic.extend(d.events())
            if rd.deliveries:
                node.durable(len(self.topic))
            self.views.extend(rd.views)
            for r in rd.reads:
                node.step(LogChunk(r.start, tuple(batches_from_events(self.topic[r.start : r.stop]))))
            node.advance(rd)

    async def ticker(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            self.node.tick()
            self.process()


def test_three_members_agree_over_rdma(addr, ports, results):
    ids = ["dc1", "dc2", "dc3"]
    peers = group(ids, addr, ports)
    per_member, rounds = 100, 5

    async def run():
        members = [Member(m, peers, "derecho", seed=i) for i, m in enumerate(ids)]
        tickers = []
        try:
            for m in members:
                await m.transport.start()
            tickers = [asyncio.create_task(m.ticker()) for m in members]
            await wait_for(
                lambda: all(m.transport.path(p) == "rdma" for m in members for p in m.transport.peers), 60, "links"
            )
            t0 = time.monotonic()
            for _ in range(rounds):  # concurrent submits: every member, same instant
                for m in members:
                    m.submit(per_member // rounds)
                await asyncio.sleep(0.1)
            total = per_member * len(members)
            await wait_for(lambda: all(len(m.topic) >= total for m in members), 120, "all deliveries")
            elapsed = time.monotonic() - t0
            await asyncio.sleep(0.5)  # anything extra (a duplicate) would show up now
            seqs = [[(e.origin, e.partition, e.offset) for e in m.topic] for m in members]
            assert all(len(s) == total for s in seqs), [len(s) for s in seqs]
            assert seqs[0] == seqs[1] == seqs[2], "members disagree on the order"
            assert len(set(seqs[0])) == total  # each event exactly once
            for origin in ids:  # per-origin order
                offs = [o for (g, _, o) in seqs[0] if g == origin]
                assert offs == list(range(per_member))
            origins_in_first_half = {g for (g, _, _) in seqs[0][: total // 2]}
            assert len(origins_in_first_half) > 1  # really interleaved, not one after another
            assert all(m.gaps == 0 and m.bad == 0 for m in members)
            results["group_rdma"] = {
                "protocol": "derecho",
                "members": len(members),
                "events": total,
                "deliver_all_s": round(elapsed, 3),
                "views_installed": [len(m.views) for m in members],
            }
        finally:
            for t in tickers:
                t.cancel()
            await asyncio.gather(*tickers, return_exceptions=True)
            for m in members:
                await m.transport.close()

    asyncio.run(run())
