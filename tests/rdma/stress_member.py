"""One member's RDMA start-up, in its own process, for the start stress test
(tests/rdma/test_start_stress.py, KDSYNC_STRESS_KIND=transport).

Does what `kdsync run` does with its transport (kdsync/member.py): builds it
with make_transport("rdma", ...) and a group contract, starts it (rdma_cm
address check, listener, completion channel and CQ, a dialer per peer),
sends a small message to every peer every 50 ms, and closes it on SIGTERM --
without Kafka, so that a start costs a second, not ten, in the emulated
guest.  What a member has beside the transport and what matters to native
object lifetimes is here too: another thread allocating all the time (the
Kafka client's), so that garbage collections run on it as well as on the
loop's thread, and collections far more often than a member's (thresholds
100, 5, 5), so that the order in which a collection finds objects at
start-up varies from start to start.

Usage: stress_member.py ID PEERS_JSON   (PYTHONFAULTHANDLER=1: a native
crash leaves every thread's Python stack in the output)
"""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import json
import logging
import signal
import sys
import threading
import time


def _churn() -> None:
    """Cyclic garbage, all the time, on a thread of its own."""
    while True:
        for _ in range(200):
            a: list = []
            b = [a]
            a.append(b)
            del a, b
        time.sleep(0.001)


async def _run(me: str, peers: dict[str, tuple[str, int]]) -> None:
    from kdsync.transport import make_transport
    from kdsync.transport.handshake import Local

    log = logging.getLogger("kdsync.transport")
    tr = make_transport("rdma", me, peers[me], peers, lambda p, m: None, secret=b"stress", logger=log,
                        local=Local({"stress": "1"}, listen="%s:%d" % peers[me]))
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_term() -> None:
        # a stop that hangs leaves every thread's stack in the output and ends (exit 1), as kdsync run's does
        faulthandler.dump_traceback_later(20, exit=True)
        stop.set()

    loop.add_signal_handler(signal.SIGTERM, on_term)
    await tr.start()
    while not stop.is_set():
        for p in tr.peers:
            tr.send(p, b"stress %s" % me.encode())
        try:
            await asyncio.wait_for(stop.wait(), 0.05)
        except asyncio.TimeoutError:
            pass
    await tr.close()
    print("CLOSED", flush=True)


def main() -> None:
    me = sys.argv[1]
    peers = {k: (v[0], int(v[1])) for k, v in json.loads(sys.argv[2]).items()}
    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(message)s")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the stress test asks a slow start where it is
    gc.set_threshold(100, 5, 5)
    threading.Thread(target=_churn, name="churn", daemon=True).start()
    asyncio.run(_run(me, peers))


if __name__ == "__main__":
    main()
