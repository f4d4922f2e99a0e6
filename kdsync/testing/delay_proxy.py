"""A TCP proxy that delays every byte by a fixed one-way delay (a WAN link on loopback).

    with DelayProxy(("127.0.0.1", member_port), delay_ms=10) as p:
        peer_address = p.address          # "127.0.0.1:PORT": give it to the member that dials out

Theory of operation
-------------------
The proxy runs its own asyncio loop in a daemon thread.  For each accepted
connection it dials the target and pumps both directions; a pump reads what
has arrived, stamps it with the loop's clock, and a writer task sends each
chunk when `delay` has passed since it arrived — in arrival order, so the
stream stays a stream (FIFO, like one TCP link) and a chunk is never sent
early.  How late each chunk left (the proxy's own scheduling on a busy box)
is kept (`late`) and reported by the command-line proxy when it stops.
Bandwidth is not limited.  Both directions are delayed, so the round
trip over the proxy is 2 × delay (plus loopback).  Closing the proxy closes
every connection it carries.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
from collections import deque

__all__ = ["DelayProxy", "start_proxies", "stop_proxies"]


class DelayProxy:
    """Listen on 127.0.0.1:`port` (0: any free port) and forward to `target`
    with `delay_ms` added to each direction."""

    def __init__(self, target: tuple[str, int], delay_ms: float, port: int = 0, host: str = "127.0.0.1"):
        if delay_ms < 0:
            raise ValueError("delay_ms must be >= 0")
        self.target = target
        self.delay = delay_ms / 1000.0
        self.host = host
        self.port = port
        self.bytes = 0  # forwarded, both directions
        self.late: deque[float] = deque(maxlen=100_000)  # how late (s) each chunk left after it was due
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._conns: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task] = set()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> "DelayProxy":
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = loop.run_until_complete(asyncio.start_server(self._accept, self.host, self.port))
                self.port = self._server.sockets[0].getsockname()[1]
            except BaseException as e:  # noqa: BLE001 - handed to start()
                failure.append(e)
                started.set()
                loop.close()
                return
            started.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name=f"delay-proxy-{self.target[1]}", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            raise failure[0]
        return self

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self._conns.update((writer, up_w))
        for r, w in ((reader, up_w), (up_r, writer)):
            t = asyncio.ensure_future(self._pump(r, w))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        chunks: deque[tuple[float, bytes]] = deque()
        more = asyncio.Event()
        done = False

        async def send() -> None:
            while True:
                while not chunks:
                    if done:
                        return
                    more.clear()
                    await more.wait()
                due, data = chunks[0]
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                chunks.popleft()
                self.late.append(loop.time() - due)
                writer.write(data)
                self.bytes += len(data)
                await writer.drain()

        sender = asyncio.ensure_future(send())
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                chunks.append((loop.time() + self.delay, data))
                more.set()
            done = True
            more.set()
            await sender  # what arrived before the end still goes out, late as it should
        except (OSError, asyncio.CancelledError):
            sender.cancel()
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    def close(self) -> None:
        loop = self._loop
        if loop is None or self._thread is None:
            return

        async def stop() -> None:
            if self._server is not None:
                self._server.close()
            for w in list(self._conns):
                with contextlib.suppress(Exception):
                    w.close()
            for t in list(self._tasks):
                t.cancel()

        with contextlib.suppress(RuntimeError):
            asyncio.run_coroutine_threadsafe(stop(), loop).result(5)
            loop.call_soon_threadsafe(loop.stop)
        self._thread.join(5)
        self._thread = None

    def __enter__(self) -> "DelayProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def late_quantiles(late_s: list[float], n: int = 41) -> list[float]:
    """`n` evenly spaced quantiles (0 .. 100 %) of how late chunks left, in ms
    (empty when nothing was forwarded): what the proxy's own scheduling adds to
    its fixed delay on a busy box."""
    xs = sorted(late_s)
    if not xs:
        return []
    return [round(xs[min(len(xs) - 1, round(k * (len(xs) - 1) / (n - 1)))] * 1000.0, 3) for k in range(n)]


def start_proxies(delay_ms: float, targets: list[str]):
    """`python -m kdsync.testing.delay_proxy DELAY_MS TARGET...` in a process of
    its own (no GIL shared with the writers here); returns (process, the
    proxies' ports in the order of `targets`)."""
    proc = subprocess.Popen([sys.executable, "-m", "kdsync.testing.delay_proxy", str(delay_ms), *targets],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return proc, json.loads(proc.stdout.readline())


def stop_proxies(proc, out: dict) -> None:
    """Stop a `python -m kdsync.testing.delay_proxy` process; its last line
    (how late it forwarded: delay_proxy.late_quantiles) goes into `out` as
    proxy_late_quantiles_ms, proxy_late_p50_ms, proxy_late_p99_ms."""
    proc.stdin.close()
    try:
        late = json.loads(proc.stdout.readline() or "{}")
        if late.get("late_quantiles_ms"):
            out["proxy_late_quantiles_ms"] = late["late_quantiles_ms"]
            out["proxy_late_p50_ms"], out["proxy_late_p99_ms"] = late["late_p50_ms"], late["late_p99_ms"]
        proc.wait(10)
    except (subprocess.TimeoutExpired, ValueError):
        proc.kill()


def main(argv: list[str] | None = None) -> int:
    """`python -m kdsync.testing.delay_proxy DELAY_MS PORT[:DELAY_MS]...`: one
    proxy per target port on 127.0.0.1 (with the first delay, or its own), in
    a process of its own (no GIL shared with the caller); prints the listening
    ports as one JSON list, runs until stdin closes, then prints one JSON
    object: `chunks` forwarded, `late_quantiles_ms` (`late_quantiles`),
    `late_p50_ms`, `late_p99_ms`."""
    args = sys.argv[1:] if argv is None else argv
    delay = float(args[0])
    targets = [(int(a.split(":")[0]), float(a.split(":")[1]) if ":" in a else delay) for a in args[1:]]
    proxies = [DelayProxy(("127.0.0.1", port), d).start() for port, d in targets]
    print(json.dumps([p.port for p in proxies]), flush=True)
    sys.stdin.read()
    for p in proxies:
        p.close()
    late = sorted(x for p in proxies for x in p.late)
    pct = (lambda f: round(late[min(len(late) - 1, int(f * len(late)))] * 1000.0, 3)) if late else (lambda f: None)
    print(json.dumps({"chunks": len(late), "late_quantiles_ms": late_quantiles(late),
                      "late_p50_ms": pct(0.5), "late_p99_ms": pct(0.99)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
