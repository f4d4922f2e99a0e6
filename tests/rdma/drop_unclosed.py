"""An RDMA transport dropped without close() and collected, then RDMA used
again in the same process (tests/rdma/test_rdma_lifetimes_vm.py; issue 44).

Usage: drop_unclosed.py ADDR PORT [--without-finalizers]

Transport `a` brings its link to `b` up (a dialer connection: a CMID with
its own Context/PD wrappers of librdmacm's shared verbs context and PD,
MRs, a QP on a's CQ; and an incoming one on a's listener), is then made
unreachable except through reference cycles, and the cyclic collector runs.
With the module's finalizers (the lifetime rule in kdsync/transport/rdma.py)
every cm id is closed before the collector clears any reference.
`--without-finalizers` removes them first, which is how the module was
before issue 44: the collector then clears objects in its own order, and a
CMID cleared while open drops its Context/PD wrappers, whose finalizers
close librdmacm's shared context and PD under every other cm_id.  Then a new
transport `a` connects to `b` and 200 messages go over RDMA; "OK" at the end.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import time


async def _wait(cond, what: str, timeout: float = 60) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise SystemExit(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def main(addr: str, port: int, finalizers: bool) -> None:
    from kdsync.transport import rdma

    if not finalizers:
        for cls in (rdma._Conn, rdma.RdmaTransport):
            if "__del__" in cls.__dict__:
                delattr(cls, "__del__")
    peers = {"a": (addr, port), "b": (addr, port + 1)}
    got: list[bytes] = []

    def mk(me: str, cb) -> rdma.RdmaTransport:
        return rdma.RdmaTransport(me, peers[me], peers, cb, secret=b"drop", tcp_fallback=False)

    a, b = mk("a", lambda p, m: None), mk("b", lambda p, m: got.append(m))
    await a.start()
    await b.start()
    await _wait(lambda: a.path("b") == "rdma" and b.path("a") == "rdma", "links")
    print("links up", flush=True)
    # Unhook a from the loop (its tasks, readers, timers) without closing anything it holds.
    loop = asyncio.get_running_loop()
    for t in a._tasks:
        t.cancel()
    await asyncio.gather(*a._tasks, return_exceptions=True)
    a._tasks = []
    for fd in [a._cc_fd, a._lchan_fd] + [c.chan_fd for c in a._conns]:
        if fd >= 0:
            loop.remove_reader(fd)
    for c in a._conns:
        if c.timer is not None:
            c.timer.cancel()
    a.cycle = a  # and a cycle of its own, beside the connections'
    gc.disable()
    del a
    print("collected", gc.collect(), flush=True)
    gc.enable()
    # RDMA again, in this process: a new `a`, its links to b, messages both ways.
    a2 = mk("a", lambda p, m: None)
    await a2.start()
    await _wait(lambda: a2.path("b") == "rdma", "the new link")
    base = len(got)
    for i in range(200):
        assert a2.send("b", b"m%d" % i)
    await _wait(lambda: len(got) - base >= 200, "200 messages")
    await a2.close()
    await b.close()
    print("OK", flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), "--without-finalizers" not in sys.argv[3:]))
