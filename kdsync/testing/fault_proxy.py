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

__all__ = ["FaultProxy"]


class FaultProxy:
    def __init__(self, target: tuple[str, int], host: str = "127.0.0.1", port: int = 0):
        self.target = target
        self.host = host
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port = self._sock.getsockname()[1]
        self._open = threading.Event()  # set: bytes flow
        self._open.set()
        self._refuse = False  # cut: close new connections at once
        self._closed = False
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self.forwarded = 0  # bytes, both directions

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def blackholed(self) -> bool:
        return not self._open.is_set()

    def start(self) -> FaultProxy:
        self._sock.listen(64)
        threading.Thread(target=self._accept, name=f"fault-proxy-{self.port}", daemon=True).start()
        return self

    # ------------------------------------------------------------ faults
    def blackhole(self) -> None:
        self._open.clear()

    def cut(self) -> None:
        self._refuse = True
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            _close(s)

    def heal(self) -> None:
        self._refuse = False
        self._open.set()

    def close(self) -> None:
        self._closed = True
        self.cut()
        self._open.set()  # release held pumps: they find their sockets closed
        _close(self._sock)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ forwarding
    def _accept(self) -> None:
        while not self._closed:
            try:
                c, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._connect, args=(c,), daemon=True).start()

    def _connect(self, c: socket.socket) -> None:
        self._open.wait()  # held while black-holed
        if self._refuse or self._closed:
            _close(c)
            return
        try:
            u = socket.create_connection(self.target, timeout=2)
            u.settimeout(None)  # a quiet link is not a dead one
        except OSError:
            _close(c)
            return
        with self._lock:
            self._conns += [c, u]
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
