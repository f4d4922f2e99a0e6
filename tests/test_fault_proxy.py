"""kdsync.testing.fault_proxy: a black hole holds bytes without closing or losing them; a cut resets."""

import socket
import threading

import pytest

from kdsync.testing.fault_proxy import FaultProxy


def _echo_server():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)

    def serve():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return

            def echo(c=c):
                while data := c.recv(65536):
                    c.sendall(data)
                c.close()
            threading.Thread(target=echo, daemon=True).start()
    threading.Thread(target=serve, daemon=True).start()
    return srv


def _recv(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return out


@pytest.fixture
def proxy():
    """A FaultProxy in front of an echo server."""
    srv = _echo_server()
    try:
        with FaultProxy(srv.getsockname()) as p:
            yield p
    finally:
        srv.close()


def _connect(p: FaultProxy) -> socket.socket:
    return socket.create_connection(("127.0.0.1", p.port), timeout=5)


def _echoed(s: socket.socket, data: bytes) -> bytes:
    """Send data, return as many bytes as came back (fewer if the connection closed)."""
    s.sendall(data)
    return _recv(s, len(data))


def test_blackhole_holds_bytes_in_order_and_heal_delivers_them(proxy):
    s = _connect(proxy)
    assert _echoed(s, b"one") == b"one"
    proxy.blackhole()
    s.sendall(b"two")
    s.sendall(b"three")
    s.settimeout(0.5)
    try:
        got = s.recv(10)
    except socket.timeout:
        got = None
    assert got is None, "nothing may arrive through a black hole, and the socket stays open"
    s.settimeout(5)
    held = _connect(proxy)  # accepted, held until the heal
    held.sendall(b"new")
    proxy.heal()
    assert _recv(s, 8) == b"twothree"
    assert _recv(held, 3) == b"new"
    s.close()
    held.close()


def test_cut_resets_connections_and_refuses_until_healed(proxy):
    s = _connect(proxy)
    assert _echoed(s, b"x") == b"x"
    proxy.cut()
    assert _recv(s, 1) == b""  # closed
    assert _recv(_connect(proxy), 1) == b""  # refused: accepted and closed
    proxy.heal()
    assert _echoed(_connect(proxy), b"y") == b"y"
