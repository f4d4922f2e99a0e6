"""The RDMA transport over soft-RoCE (rxe0), in the VM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kdsync.transport import make_transport
from kdsync.transport.rdma import RdmaTransport, rdma_usable, unavailable_reason
from kdsync.transport.tcp import TcpTransport

from helpers import group, wait_for

HERE = Path(__file__).resolve().parent


def test_device_is_usable(addr):
    assert unavailable_reason() is None
    ok, dev = rdma_usable(addr)
    assert ok, dev
    assert dev == "rxe0"


def _pair(addr, ports, **kw):
    peers = group(["a", "b"], addr, ports)
    got: dict[str, list] = {"a": [], "b": []}
    opts = dict(secret=b"group-secret", tcp_fallback=False) | kw
    ta = RdmaTransport("a", peers["a"], peers, lambda p, m: got["a"].append((p, m)), **opts)
    tb = RdmaTransport("b", peers["b"], peers, lambda p, m: got["b"].append((p, m)), **opts)
    return ta, tb, got


async def _up(*trs):
    for t in trs:
        await t.start()
    await wait_for(lambda: all(t.path(p) == "rdma" for t in trs for p in t.peers), 30, "RDMA links up")


def test_send_receive_many_in_order(addr, ports):
    sizes = [1, 100, 1000, 20_000, 70_000]  # 70 kB spans two 64 KiB buffers

    async def run():
        ta, tb, got = _pair(addr, ports)
        try:
            await _up(ta, tb)
            n = 1200
            sent_a = [bytes([i % 251]) * sizes[i % len(sizes)] + b"%d" % i for i in range(n)]
            sent_b = [b"b%d" % i for i in range(n)]
            for i in range(n):
                assert ta.send("b", sent_a[i])
                assert tb.send("a", sent_b[i])
            await wait_for(lambda: len(got["b"]) == n and len(got["a"]) == n, 60, "all messages")
            assert [m for _, m in got["b"]] == sent_a
            assert [m for _, m in got["a"]] == sent_b
            assert {p for p, _ in got["b"]} == {"a"}
            # More SENDs than posted receive buffers went through: credits came back.
            assert ta.counters["sends"] > 4 * ta.recv_depth
            assert ta.stats["b"].frames_out > 0 and tb.stats["a"].frames_in > 0
            # Idle: completions are event-driven, nothing polls the CQ or burns CPU.
            await asyncio.sleep(0.2)
            polls, cpu = ta.counters["cq_polls"] + tb.counters["cq_polls"], time.process_time()
            await asyncio.sleep(1.0)
            assert ta.counters["cq_polls"] + tb.counters["cq_polls"] == polls
            assert time.process_time() - cpu < 0.2
        finally:
            await ta.close()
            await tb.close()

    asyncio.run(run())


def test_frame_larger_than_all_buffers(addr, ports):
    async def run():
        ta, tb, got = _pair(addr, ports, buf_size=16 * 1024, recv_depth=4, send_depth=4)
        try:
            await _up(ta, tb)
            big = os.urandom(3 * 1024 * 1024)
            assert ta.send("b", big)
            assert ta.send("b", b"after")
            await wait_for(lambda: len(got["b"]) == 2, 120, "the big message")
            assert got["b"][0][1] == big and got["b"][1][1] == b"after"
            # 3 MiB through 4 buffers of 16 KiB: fragments, recycled ~50 times.
            assert ta.counters["sends"] >= len(big) // (16 * 1024)
        finally:
            await ta.close()
            await tb.close()

    asyncio.run(run())


def test_credits_exhausted_back_pressure(addr, ports):
    """A receiver that stops re-posting buffers stalls the sender at the
    credit limit (no overrun: rnr_retry=0 would turn one into a link error),
    send() refuses once the queue is full, and everything accepted arrives in
    order once the receiver resumes."""

    async def run():
        ta, tb, got = _pair(addr, ports, buf_size=4096, recv_depth=4, send_depth=4, max_queue_bytes=64_000)
        try:
            await _up(ta, tb)
            link = ta._peers["b"].out
            # Stop the receiver's completion processing (as if its loop were busy).
            tb._loop.remove_reader(tb._cc_fd)
            sends0 = ta.counters["sends"]
            accepted = []
            for i in range(10_000):
                msg = b"%06d" % i + b"x" * 994
                if not ta.send("b", msg):
                    break
                accepted.append(msg)
                if i % 20 == 0:
                    await asyncio.sleep(0)
            else:
                raise AssertionError("send() never refused a message")
            await wait_for(lambda: link.credits <= 1, 10, "sender out of credits")
            await asyncio.sleep(0.3)
            # Never more SENDs in flight than the receiver had posted.
            assert ta.counters["sends"] - sends0 <= tb.recv_depth
            assert link.credits >= 0 and ta.counters["credit_waits"] > 0
            assert got["b"] == []
            assert ta.stats["b"].dropped >= 1
            # Resume the receiver.
            tb._loop.add_reader(tb._cc_fd, tb._on_cq_event)
            tb._drain_cq()
            await wait_for(lambda: len(got["b"]) == len(accepted), 60, "the backlog")
            assert [m for _, m in got["b"]] == accepted
            assert ta._peers["b"].out is link and link.state == "up"  # no reset on the way
        finally:
            await ta.close()
            await tb.close()

    asyncio.run(run())


def test_peer_that_disappears_and_returns(addr, ports, results):
    peers = group(["a", "b"], addr, ports)
    env = dict(os.environ, PYTHONPATH=os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, str(HERE / "echo_peer.py"), "b", json.dumps(peers), "s3cret"]

    def spawn():
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, text=True)
        assert p.stdout.readline().strip() == "READY"
        return p

    async def run():
        got: list[bytes] = []
        ta = RdmaTransport("a", peers["a"], peers, lambda p, m: got.append(m), secret=b"s3cret", tcp_fallback=False)
        child = spawn()
        try:
            await ta.start()
            await wait_for(lambda: ta.path("b") == "rdma", 30, "link to b")
            assert ta.send("b", b"ping-1")
            await wait_for(lambda: got == [b"ping-1"], 10, "echo")
            child.send_signal(signal.SIGKILL)
            child.wait()
            t_down = await wait_for(lambda: not ta.stats["b"].connected, 20, "failure detected")
            results["peer_kill_detect_s"] = round(t_down, 3)
            # While b is away messages wait in the queue (bounded), then flow.
            for i in range(50):
                assert ta.send("b", b"while-down-%d" % i)
            child = spawn()
            t_up = await wait_for(lambda: ta.path("b") == "rdma", 30, "reconnect")
            results["peer_reconnect_s"] = round(t_up, 3)
            await wait_for(lambda: len(got) == 51, 20, "echoes of the queued messages")
            assert got[1:] == [b"while-down-%d" % i for i in range(50)]
        finally:
            await ta.close()
            child.kill()
            child.wait()

    asyncio.run(run())


def test_wrong_secret_is_refused(addr, ports):
    async def run():
        peers = group(["a", "b"], addr, ports)
        got: list = []
        ta = RdmaTransport("a", peers["a"], peers, lambda p, m: got.append(m), secret=b"one", tcp_fallback=False)
        tb = RdmaTransport("b", peers["b"], peers, lambda p, m: got.append(m), secret=b"two", tcp_fallback=False)
        try:
            await ta.start()
            await tb.start()
            ta.send("b", b"secret stuff")
            await wait_for(lambda: ta.stats["b"].refused + tb.stats["a"].refused >= 2, 30, "refusals")
            assert got == []
            assert ta.path("b") is None and tb.path("a") is None
        finally:
            await ta.close()
            await tb.close()

    asyncio.run(run())


def test_mixed_group_rdma_and_tcp(addr, ports):
    """a and b talk RDMA; c has only TCP: a and b serve c over TCP."""

    async def run():
        peers = group(["a", "b", "c"], addr, ports)
        got: dict[str, list] = {m: [] for m in peers}
        secret = b"mixed"
        ta = make_transport("auto", "a", peers["a"], peers, lambda p, m: got["a"].append((p, m)), secret=secret)
        tb = make_transport("rdma", "b", peers["b"], peers, lambda p, m: got["b"].append((p, m)), secret=secret)
        tc = make_transport("tcp", "c", peers["c"], peers, lambda p, m: got["c"].append((p, m)), secret=secret)
        assert isinstance(ta, RdmaTransport) and isinstance(tb, RdmaTransport) and isinstance(tc, TcpTransport)
        trs = {"a": ta, "b": tb, "c": tc}
        try:
            for t in trs.values():
                await t.start()
            await wait_for(
                lambda: ta.path("b") == "rdma" and tb.path("a") == "rdma" and ta.path("c") == "tcp" and tb.path("c") == "tcp",
                60,
                "a-b over RDMA, a-c and b-c over TCP",
            )
            for src, t in trs.items():
                for dst in peers:
                    if dst != src:
                        for i in range(20):
                            assert t.send(dst, f"{src}>{dst}#{i}".encode())
            want = {dst: sorted(f"{s}>{dst}#{i}" for s in peers if s != dst for i in range(20)) for dst in peers}
            await wait_for(lambda: all(len(got[d]) == 40 for d in peers), 30, "all messages in the mixed group")
            for dst in peers:
                assert sorted(m.decode() for _, m in got[dst]) == want[dst]
                for src in peers:  # per-sender order is kept
                    seq = [m for p, m in got[dst] if p == src]
                    assert seq == [f"{src}>{dst}#{i}".encode() for i in range(len(seq))]
            assert ta.stats["b"].frames_out > 0  # the RDMA side really carried a-b
        finally:
            for t in trs.values():
                await t.close()

    asyncio.run(run())
