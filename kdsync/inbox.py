"""Peer frames to the ordering nodes: the member's inbox.

Every frame a peer sends names its topic (kdsync.transport.channels).  A frame
for a topic whose pipeline runs goes to that topic's node at once — the
tick clock's ticks already due run first, a sleeping node is woken, the node
is handed the host's wall clock — and the node is drained once for every
frame of the loop iteration (`to_process`: peer frames arrive in batches, so
one ready() cuts one slot and one acknowledgement for many).  A frame for a
topic this member orders but has not started yet (a peer formed first) is
kept, at most EARLY_MESSAGES per topic (beyond that the peer retransmits),
and starts that topic; `replay` hands the kept frames to its node once it
is ready.  Frames for a topic this member does not order are dropped; a
malformed frame is counted per peer and logged at most once a second.

The inbox is given what it uses, never the member: the running pipelines,
and callables for the rest (kdsync.member composes it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Protocol

from kdsync.core import RemoteProtocolError
from kdsync.observability.logs import kv
from kdsync.ticks import wall_us
from kdsync.transport.channels import split_channel

log = logging.getLogger("kdsync.member")

EARLY_MESSAGES = 10_000  # peer messages kept per topic while its pipeline starts


class _Node(Protocol):
    def clock(self, now_us: int) -> None: ...
    def receive(self, peer: str, data: bytes) -> None: ...


class _Pipeline(Protocol):
    node: Any  # a kdsync.core OrderingNode


class PeerInbox:
    """`pipelines`: topic -> running pipeline.  `heard(peer, topic, body)`:
    the liveness layer's look at every frame (True: it was a ping, consumed).
    `orders(topic)`: this member orders `topic`.  `known(topic)`: its
    pipeline runs, starts, or is about to.  `start(topic)`: a coroutine
    starting it.  `due()`: run the ticks already due.  `wake(pipeline)`:
    before input reaches its node.  `process(pipeline)`: drain its node
    after this loop iteration's frames.  `bad(peer)`: count a malformed frame."""

    def __init__(self, pipelines: Mapping[str, _Pipeline], *, heard: Callable[[str, str, bytes], bool],
                 orders: Callable[[str], bool], known: Callable[[str], bool],
                 start: Callable[[str], Coroutine[Any, Any, None]], due: Callable[[], None],
                 wake: Callable[[Any], None], process: Callable[[Any], None], bad: Callable[[str], None]):
        self.pipelines = pipelines
        self._heard, self._orders, self._known, self._start = heard, orders, known, start
        self._due, self._wake, self._process, self._bad = due, wake, process, bad
        self.early: dict[str, deque] = {}  # topic -> (peer, frame body) received before its pipeline was ready
        self._bad_logged = 0.0
        self._asked: set[str] = set()  # topics whose start this inbox scheduled and that has not returned yet

    def on_message(self, peer: str, data: bytes) -> None:
        """One frame from `peer` (the transport's callback, on the loop)."""
        try:
            topic, body = split_channel(data)
            if self._heard(peer, topic, body):
                return
            p = self.pipelines.get(topic)
            if p is None:
                if self._orders(topic):
                    self.early.setdefault(topic, deque(maxlen=EARLY_MESSAGES)).append((peer, body))
                    if not self._known(topic) and topic not in self._asked:  # once, not once per frame
                        self._asked.add(topic)
                        asyncio.ensure_future(self._start_once(topic))
                return
            self._due()
            self._wake(p)
            p.node.clock(wall_us())
            p.node.receive(peer, body)
            self._process(p)
        except RemoteProtocolError as e:
            self._dropped(peer, e)

    async def _start_once(self, topic: str) -> None:
        try:
            await self._start(topic)
        finally:  # started, or failed: the next frame asks again
            self._asked.discard(topic)

    def replay(self, topic: str, node: _Node) -> None:
        """`topic`'s pipeline is ready: its node gets the frames kept for it, in arrival order."""
        for peer, body in self.early.pop(topic, ()):
            try:
                node.receive(peer, body)
            except RemoteProtocolError:
                self._bad(peer)

    def _dropped(self, peer: str, e: RemoteProtocolError) -> None:
        self._bad(peer)
        now = time.monotonic()
        if now - self._bad_logged > 1.0:
            self._bad_logged = now
            log.warning("malformed message from peer dropped", **kv(peer=peer, error=str(e)))
