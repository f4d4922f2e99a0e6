"""The Ready handshake of `kdsync run`'s ordering nodes, as kdsync/core
prescribes it: a Ready's hard state on disk before anything else of it,
then its messages, deliveries, views and reads, then `advance`.

Hard states go to the member's one log (kdsync.state.StateLog): every
Ready with a hard state in one loop iteration waits, and at the end of the
iteration their states are appended with one fsync (a group commit); then
the rest of each Ready is done and its node drained again.  The loop goes
on meanwhile.  Saved one file and one fsync at a time, on the loop, the
view changes of a hundred groups at once held every group's messages past
the view change's timeouts, round after round: they never formed.

What the handshake uses of the member is `HandshakeHost`: nothing else.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

from kdsync.observability.logs import kv
from kdsync.pipeline import ReadHost, TopicPipeline, serve_read
from kdsync.state import StateLog
from kdsync.ticks import wall_us
from kdsync.transport.channels import frame_channel

__all__ = ["HandshakeHost", "ReadyHandshake"]

log = logging.getLogger("kdsync.member")


class HandshakeHost(ReadHost, Protocol):
    """What the Ready handshake uses of the member that runs it: the loop
    (to save the iteration's hard states at its end), the transport's send,
    the tick clock, the sleeping groups' view digest, the metrics, and the
    callbacks for deliveries and a fatal error; plus `ReadHost` for the
    node's reads."""

    loop: asyncio.AbstractEventLoop
    witness: bool  # no global topic: a delivery is durable at once
    transport: Any  # kdsync.transport.Transport: send(peer, frame)
    clock: Any  # kdsync.ticks.TickClock: wake_if_busy(node)
    sleepers: Any  # kdsync.ticks.Sleepers: views.set(topic, view_id)
    metrics: Any  # kdsync.observability.metrics.MemberMetrics: view_id, live_members, delivered, set_status

    def deliver(self, p: TopicPipeline, d: Any) -> None: ...

    def fatal(self, msg: str) -> None: ...


class ReadyHandshake:
    """The handshake of every node of member `m`, with its hard states in `state_log`."""

    def __init__(self, m: HandshakeHost, state_log: StateLog):
        self.m = m
        self.state_log = state_log
        self.fenced: dict[str, tuple[str, ...]] = {}  # topic -> the members its node fenced (last logged)
        self.rejoins: dict[str, int] = {}  # topic -> times its node was told the others fenced it (last logged)
        self._held: list = []  # (pipeline, Ready) whose hard state waits for this iteration's fsync

    def process(self, p: TopicPipeline) -> None:
        """Drain `p`'s node: each Ready done, or held for its hard state (module doc)."""
        if p.saving:
            return  # drained again once the hard state is on disk
        node = p.node
        node.clock(wall_us())
        while node.has_ready():
            rd = node.ready()
            if rd.hard_state is not None:
                p.saving = True
                if not self._held:
                    self.m.loop.call_soon(self._save_held)
                self._held.append((p, rd))
                return
            self._done(p, rd)
        self.m.clock.wake_if_busy(node)

    def _save_held(self) -> None:
        held, self._held = self._held, []
        try:
            self.state_log.append([(p.topic, rd.hard_state) for p, rd in held])
        except OSError as e:
            return self.m.fatal(f"state_dir: cannot write {self.state_log.path}: {e.strerror or e}")
        for p, rd in held:
            p.saving = False
            self._done(p, rd)
            self.m.process(p)  # the member's: it also pulses (kdsync.ticks.Pulse), a thousand groups may wait here

    def _done(self, p: TopicPipeline, rd) -> None:
        """A Ready whose hard state (if any) is on disk: messages, deliveries, views, reads, advance."""
        m, node = self.m, p.node
        send = m.transport.send
        if rd.messages and p.stages.unsent:
            p.stages.sent(time.monotonic())
        for msg in rd.messages:
            try:
                send(msg.to, frame_channel(p.topic, msg.data))
            except Exception as e:  # unknown peer / oversized: a core bug, not fatal
                log.error("send failed", **kv(peer=msg.to, error=str(e)))
        for d in rd.deliveries:
            m.deliver(p, d)
        for v in rd.views:
            m.sleepers.views.set(p.topic, v.view_id)  # the pings' digest (kdsync.core.liveness.ViewDigest)
            m.metrics.view_id.labels(p.topic).set(v.view_id)
            m.metrics.live_members.labels(p.topic).set(len(v.members))
            log.info("view installed", **kv(topic=p.topic, view=v.view_id, members=",".join(v.members),
                                            start_seq=v.start_seq))
        fenced = tuple(sorted(getattr(node, "fenced", ())))
        if fenced != self.fenced.get(p.topic, ()):
            self.fenced[p.topic] = fenced
            if fenced:  # a clean stop without a view change (clock: kdsync.core.fence)
                log.info("member fenced", **kv(topic=p.topic, view=node.view.view_id, fenced=",".join(fenced)))
        rejoins = node.stats.get("fenced_rejoins", 0)
        if rejoins != self.rejoins.get(p.topic, 0):  # clock: cut off, fenced by the others (kdsync.core.crash_fence)
            self.rejoins[p.topic] = rejoins
            log.warning("fenced by the others while cut off: asking to be taken back",
                        **kv(topic=p.topic, view=node.view.view_id))
        self.note_status(p, rd.status)
        for r in rd.reads:
            asyncio.ensure_future(serve_read(m, p, r.start, r.stop))
        node.advance(rd)
        if m.witness and rd.deliveries:
            node.durable(p.durable_end)
            m.metrics.delivered.labels(p.topic).set(p.durable_end)

    def note_status(self, p: TopicPipeline, status: str) -> None:
        if status and status != p.status:
            # why a view ends: the peers this node suspects (none: a peer's suspicion or a newer view)
            why = {"suspected": ",".join(sorted(getattr(p.node, "suspected", ())))} if status == "wedged" else {}
            log.info("status", **kv(topic=p.topic, status=status, previous=p.status or "-", **why))
            p.status = status
            self.m.metrics.set_status(p.topic, status)
