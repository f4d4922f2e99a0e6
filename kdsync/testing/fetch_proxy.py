"""A Kafka-protocol proxy in front of one broker that drops one record batch
from one Fetch response: a broker that skips records, on demand.

    proxy = FetchDropProxy(("127.0.0.1", broker_port)).start()
    # the broker advertises proxy.address, so every client connection after
    # the bootstrap goes through the proxy
    proxy.arm("events", min_batches=3, index=1)   # the next answer of >= 3 batches of events loses its 2nd
    ...
    proxy.dropped        # [(topic, partition, first offset, last offset)] of what was dropped

What a client sees is what the issue-41 reproduction saw from Tansu: a Fetch
answer whose batches jump over offsets the partition holds.  A dropped batch
followed by another one in the same answer is a gap the client cannot notice
by itself (librdkafka accepts a later batch, as after compaction); the
client's next fetch asks from after the last batch it got, so without
accounting the dropped records are never read.

How: the proxy lowers the Fetch version it lets the broker announce
(ApiVersions: at most 4, the non-flexible form kdsync.kafka.wire parses), then
rewrites the one Fetch answer (kdsync.kafka.wire.batch_spans) with the batch
cut out.  Answers to kdsync's own gap look (client id `kdsync-gap-look`) are
never touched.  Everything else is forwarded byte for byte.
"""

from __future__ import annotations

import socket
import struct
import threading

from kdsync.kafka.embedded import EmbeddedCluster, free_port
from kdsync.testing.fault_proxy import TcpRelay, _close
from kdsync.kafka.wire import API_VERSIONS, FETCH, _Reader, batch_spans

__all__ = ["FetchDropProxy", "ProxiedCluster"]

MAX_FETCH_VERSION = 4


class FetchDropProxy(TcpRelay):
    name = "fetch-proxy"

    def __init__(self, target: tuple[str, int], host: str = "127.0.0.1", port: int = 0):
        super().__init__(target, host, port)
        self._armed: list[tuple[str, int, int]] = []  # (topic, min_batches, index)
        self.dropped: list[tuple[str, int, int, int]] = []
        self.fetches = 0  # Fetch answers seen

    def arm(self, topic: str, min_batches: int = 3, index: int = 1) -> None:
        """Drop batch `index` of the next Fetch answer holding >= `min_batches` whole batches of `topic`."""
        assert 0 <= index < min_batches - 1, "the dropped batch must be followed by another (a gap, not a short answer)"
        with self._lock:
            self._armed.append((topic, min_batches, index))

    # ------------------------------------------------------------ forwarding
    def _serve(self, c: socket.socket) -> None:
        u = self._dial(c, timeout=5)
        if u is None:
            return
        asked: dict[int, tuple[int, int, str | None]] = {}  # correlation -> (api key, version, client id)
        threading.Thread(target=self._requests, args=(c, u, asked), daemon=True).start()
        self._responses(u, c, asked)

    def _requests(self, c: socket.socket, u: socket.socket, asked: dict) -> None:
        try:
            while True:
                frame = _frame(c)
                key, version, corr = struct.unpack_from(">hhi", frame, 0)
                client = _Reader(frame, 8).string() if len(frame) >= 10 else None
                asked[corr] = (key, version, client)
                u.sendall(struct.pack(">i", len(frame)) + frame)
        except (OSError, EOFError, struct.error):
            pass
        _close(c)
        _close(u)

    def _responses(self, u: socket.socket, c: socket.socket, asked: dict) -> None:
        try:
            while True:
                frame = _frame(u)
                corr = struct.unpack_from(">i", frame, 0)[0]
                key, version, client = asked.pop(corr, (None, None, None))
                if key == API_VERSIONS:
                    frame = _lower_fetch(frame, version)
                elif key == FETCH and version == 4:
                    self.fetches += 1
                    if self._armed and client != "kdsync-gap-look":
                        frame = self._maybe_drop(frame)
                c.sendall(struct.pack(">i", len(frame)) + frame)
        except (OSError, EOFError, struct.error):
            pass
        _close(c)
        _close(u)

    def _maybe_drop(self, frame: bytes) -> bytes:
        r = _Reader(frame, 8)  # correlation id, throttle time
        for _ in range(r.take(">i")):
            name = r.string()
            for _ in range(r.take(">i")):
                p = r.take(">ihqq")[0]
                n = r.take(">i")
                r.i += 16 * max(n, 0)
                size_at = r.i
                size = r.take(">i")
                records = frame[r.i:r.i + max(size, 0)]
                start = r.i
                r.i += max(size, 0)
                with self._lock:
                    rule = next((a for a in self._armed if a[0] == name), None)
                    spans = batch_spans(records) if rule else []
                    if not rule or len(spans) < rule[1]:
                        continue
                    self._armed.remove(rule)
                    b0, b1, base = spans[rule[2]]
                    last = base + struct.unpack_from(">i", records, b0 + 23)[0]
                    self.dropped.append((name, p, base, last))
                new = records[:b0] + records[b1:]
                out = frame[:size_at] + struct.pack(">i", len(new)) + new + frame[start + size:]
                return out
        return frame


class ProxiedCluster(EmbeddedCluster):
    """A Tansu cluster every client reaches through a FetchDropProxy: the
    broker advertises the proxy's address and `bootstrap` is the proxy's."""

    def __init__(self, name: str = "kafka", **kw):
        port = free_port()
        super().__init__(name, port=port, **kw)
        self.proxy = FetchDropProxy(("127.0.0.1", port)).start()

    @property
    def bootstrap(self) -> str:
        return self.proxy.address

    def _tansu_command(self, binary: str, attempts: int):
        argv, env = super()._tansu_command(binary, attempts)
        argv[argv.index("--advertised-listener-url") + 1] = f"tcp://{self.proxy.address}"
        return argv, env

    def close(self) -> None:
        super().close()
        self.proxy.close()


def _lower_fetch(frame: bytes, version: int | None) -> bytes:
    """An ApiVersions answer with Fetch's highest version at most MAX_FETCH_VERSION (patched in place)."""
    b = bytearray(frame)
    r = _Reader(b, 4)
    err = r.take(">h")
    flexible = (version or 0) >= 3 and err == 0
    if flexible:
        n = r.uvarint() - 1
    else:
        n = r.take(">i")
    for _ in range(max(n, 0)):
        key, _lo, hi = struct.unpack_from(">hhh", b, r.i)
        if key == FETCH and hi > MAX_FETCH_VERSION:
            struct.pack_into(">h", b, r.i + 4, MAX_FETCH_VERSION)
        r.i += 6
        if flexible:
            for _ in range(r.uvarint()):  # tagged fields
                r.uvarint()
                r.i += r.uvarint()
    return bytes(b)


def _frame(s: socket.socket) -> bytes:
    n = struct.unpack(">i", _exact(s, 4))[0]
    return _exact(s, n)


def _exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)

