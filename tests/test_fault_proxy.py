"""kdsync.testing.fault_proxy: a black hole holds bytes without closing or losing them; a cut resets."""

import socket
import threading

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


def test_blackhole_holds_bytes_in_order_and_heal_delivers_them():
    srv = _echo_server()
    with FaultProxy(srv.getsockname()) as p:
        s = socket.create_connection(("127.0.0.1", p.port), timeout=5)
        s.sendall(b"one")
        assert _recv(s, 3) == b"one"
        p.blackhole()
        s.sendall(b"two")
        s.sendall(b"three")
        s.settimeout(0.5)
        try:
            got = s.recv(10)
        except socket.timeout:
            got = None
        assert got is None, "nothing may arrive through a black hole, and the socket stays open"
        s.settimeout(5)
        held = socket.create_connection(("127.0.0.1", p.port), timeout=5)  # accepted, held until the heal
        held.sendall(b"new")
        p.heal()
        assert _recv(s, 8) == b"twothree"
        assert _recv(held, 3) == b"new"
        s.close()
        held.close()
    srv.close()


def test_cut_resets_connections_and_refuses_until_healed():
    srv = _echo_server()
    with FaultProxy(srv.getsockname()) as p:
        s = socket.create_connection(("127.0.0.1", p.port), timeout=5)
        s.sendall(b"x")
        assert _recv(s, 1) == b"x"
        p.cut()
        assert _recv(s, 1) == b""  # closed
        r = socket.create_connection(("127.0.0.1", p.port), timeout=5)
        assert _recv(r, 1) == b""  # refused: accepted and closed
        p.heal()
        t = socket.create_connection(("127.0.0.1", p.port), timeout=5)
        t.sendall(b"y")
        assert _recv(t, 1) == b"y"
    srv.close()
