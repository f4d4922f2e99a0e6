"""The delaying TCP proxy of the sim-vs-real bench (kdsync.testing.delay_proxy)."""

from __future__ import annotations

import socket
import statistics
import threading
import time

import pytest

from kdsync.testing.delay_proxy import DelayProxy


@pytest.fixture
def echo():
    srv = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except OSError:
                return
            def pump(c=c):
                with c:
                    while data := c.recv(65536):
                        c.sendall(data)
            threading.Thread(target=pump, daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield srv.getsockname()[1]
    stop.set()
    srv.close()


def _rtts(port: int, n: int = 15) -> list[float]:
    out = []
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(n):
            t0 = time.perf_counter()
            s.sendall(b"x")
            assert s.recv(1) == b"x"
            out.append((time.perf_counter() - t0) * 1000.0)
    return out


@pytest.mark.parametrize("delay_ms", [10.0, 25.0])
def test_proxy_adds_its_one_way_delay_each_way(echo, delay_ms):
    direct = statistics.median(_rtts(echo))
    with DelayProxy(("127.0.0.1", echo), delay_ms) as p:
        rtts = _rtts(p.port)
        late_ms = 1000.0 * statistics.median(p.late) if p.late else 0.0  # its own scheduling, each hop
    assert min(rtts) >= 2 * delay_ms, rtts  # never early
    added = statistics.median(rtts) - direct
    # at most 8 ms more than the two delays, beyond what the proxy measured as its own lateness on a busy box
    assert 2 * delay_ms <= added + 0.5 and added < 2 * delay_ms + 8.0 + 2 * late_ms, (added, late_ms, rtts)


def test_proxy_keeps_the_stream_intact_and_in_order(echo):
    blob = bytes(range(256)) * 4096  # 1 MiB
    with DelayProxy(("127.0.0.1", echo), 5.0) as p, socket.create_connection(("127.0.0.1", p.port)) as s:
        got = bytearray()

        def read():
            while len(got) < len(blob):
                d = s.recv(65536)
                if not d:
                    break
                got.extend(d)

        t = threading.Thread(target=read)
        t.start()
        s.sendall(blob)
        t.join(20)
    assert bytes(got) == blob
    assert p.bytes == 2 * len(blob)


def test_proxy_process_serves_each_target_until_stdin_closes(echo):
    import json
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-m", "kdsync.testing.delay_proxy", "10", str(echo), f"{echo}:30"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ports = json.loads(p.stdout.readline())
        assert len(ports) == 2 and len(set(ports)) == 2
        first, second = _rtts(ports[0], 3), _rtts(ports[1], 3)
        assert min(first) >= 20.0 and max(first) < 60.0  # the default delay
        assert min(second) >= 60.0  # PORT:DELAY_MS: its own
    finally:
        p.stdin.close()
        last = p.stdout.readline()
        assert p.wait(10) == 0
    report = json.loads(last)  # how late it forwarded: 2 ports x 3 echoes x 2 directions
    assert report["chunks"] == 12 and len(report["late_quantiles_ms"]) == 41
    q = report["late_quantiles_ms"]
    assert q[0] >= 0 and all(a <= b for a, b in zip(q, q[1:])) and q[0] <= report["late_p50_ms"] <= q[-1]


def test_late_quantiles_are_evenly_spaced_order_statistics():
    from kdsync.testing.delay_proxy import late_quantiles

    assert late_quantiles([]) == []
    xs = [i / 1000.0 for i in range(101)]  # 0 .. 100 ms
    assert late_quantiles(xs, n=5) == [0.0, 25.0, 50.0, 75.0, 100.0]
    with DelayProxy(("127.0.0.1", 9), 0.0) as px:
        assert list(px.late) == []  # nothing forwarded, nothing recorded
