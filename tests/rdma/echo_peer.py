"""A member that echoes every message back to its sender, in its own process
(so a test can SIGKILL it).  Usage: echo_peer.py ID PEERS_JSON [SECRET]

Prints "READY" once listening; then runs until killed.
"""

from __future__ import annotations

import asyncio
import json
import sys


async def main() -> None:
    from kdsync.transport.rdma import RdmaTransport

    me = sys.argv[1]
    peers = {k: tuple(v) for k, v in json.loads(sys.argv[2]).items()}
    secret = sys.argv[3].encode() if len(sys.argv) > 3 else None
    tr: RdmaTransport

    def on_message(peer: str, data: bytes) -> None:
        tr.send(peer, data)

    tr = RdmaTransport(me, peers[me], peers, on_message, secret=secret, tcp_fallback=False)
    await tr.start()
    print("READY", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
