"""A TCP proxy for one directed member link that can black-hole it.

    p = FaultProxy(("127.0.0.1", member_port)).start()
    peer_address = p.address      # give it to the member that dials out
    p.blackhole()                 # bytes stop flowing; no socket is closed
    p.heal()                      # what waited flows again, in order

A black hole is what a partition looks like to TCP: the connection stays
open, writes are accepted until the buffers fill, nothing arrives, nothing
is reset.  Nothing is lost or reordered either (TCP retransmits once the
path is back): the proxy stops reading while black-holed and resumes where it
stopped, so a member that keeps its connection sees its bytes late, and a
member that gives up on the connection (closes it) reconnects through the
proxy.  New connections made while black-holed are accepted and held until
the heal, as a SYN retried across a partition would be.  `cut()` is the
other fault: every connection closed (a reset), new ones refused until
`heal()`.

One thread accepts; each connection has a pump thread per direction.
"""

from __future__ import annotations

import socket
import threading

__all__ = ["FaultProxy", "TcpRelay"]


class TcpRelay:
    """A listener on `host:port` (0: any free port) that hands every accepted
    connection to `_serve(conn)` in a thread of its own (subclasses: FaultProxy,
    kdsync.testing.fetch_proxy.FetchDropProxy), with `target` to relay to."""

    name = "relay"

    def __init__(self, target: tuple[str, int], host: str = "127.0.0.1", port: int = 0):
        self.target = target
        self.host = host
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port = self._sock.getsockname()[1]
        self._closed = False
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []  # open on both sides, closed by close()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self):
        self._sock.listen(64)
        threading.Thread(target=self._accept, name=f"{self.name}-{self.port}", daemon=True).start()
        return self

    def close(self) -> None:
        self._closed = True
        self._drop_all()
        _close(self._sock)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _drop_all(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            _close(s)

    def _accept(self) -> None:
        while not self._closed:
            try:
                c, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _dial(self, c: socket.socket, timeout: float) -> socket.socket | None:
        """A connection to `target` for accepted `c`, both kept for close();
        None (and `c` closed) when the target does not answer."""
        try:
            u = socket.create_connection(self.target, timeout=timeout)
            u.settimeout(None)  # a quiet link is not a dead one
        except OSError:
            _close(c)
            return None
        with self._lock:
            self._conns += [c, u]
        return u

    def _serve(self, c: socket.socket) -> None:
        raise NotImplementedError


class FaultProxy(TcpRelay):
    name = "fault-proxy"

    def __init__(self, target: tuple[str, int], host: str = "127.0.0.1", port: int = 0):
        super().__init__(target, host, port)
        self._open = threading.Event()  # set: bytes flow
        self._open.set()
        self._refuse = False  # cut: close new connections at once
        self.forwarded = 0  # bytes, both directions

    @property
    def blackholed(self) -> bool:
        return not self._open.is_set()

    # ------------------------------------------------------------ faults
    def blackhole(self) -> None:
        self._open.clear()

    def cut(self) -> None:
        self._refuse = True
        self._drop_all()

    def heal(self) -> None:
        self._refuse = False
        self._open.set()

    def close(self) -> None:
        self._refuse = True
        super().close()
        self._open.set()  # release held pumps: they find their sockets closed

    # ------------------------------------------------------------ forwarding
    def _serve(self, c: socket.socket) -> None:
        self._open.wait()  # held while black-holed
        if self._refuse or self._closed:
            _close(c)
            return
        u = self._dial(c, timeout=2)
        if u is None:
            return
        threading.Thread(target=self._pump, args=(c, u), daemon=True).start()
        threading.Thread(target=self._pump, args=(u, c), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while True:
                self._open.wait()  # black-holed: stop reading, the sender's buffers fill
                data = a.recv(65536)
                if not data:
                    break
                self._open.wait()  # black-holed while reading: hold what was read, in order
                b.sendall(data)
                self.forwarded += len(data)
        except OSError:
            pass
        _close(a)
        _close(b)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()
