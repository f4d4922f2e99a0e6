"""Catch-up of the derecho node: filling the gap before a new view's start.

Theory of operation
-------------------
A member taken into a view whose trim it cannot deliver itself (a joiner, a
restarted member, one that missed views, or one still catching up) pulls
positions [its next position, view start) from the proposal's catch-up
source before it delivers anything of the new view.  The source answers
from its in-memory log, or — for positions only its global topic still
holds — through its adapter (ReadRequest → LogChunk) and then forwards the
chunk.  A request names the view; a source that is no longer in that view,
or is itself catching up, stays silent and the requester retries (and a
newer view change names another source).  Meanwhile the member already
receives and acknowledges the new view's slots, so the view does not stall
while it catches up.

A witness has no global topic: it takes a snapshot instead — the view's
start position and the origin watermarks there — which is all exactly-once
needs.
"""

from __future__ import annotations

from kdsync.core.messages import CatchupData, CatchupReq, Snapshot
from kdsync.core.types import Delivery, LogChunk, ReadRequest, RemoteProtocolError
from kdsync.core.base import watermarks_of


class CatchupPart:
    """Mixin of DerechoNode: catch-up (see module docstring)."""

    def _ask_catchup(self) -> None:
        prop = self.target
        if prop is None:
            return
        self.catchup_asked = self.now
        if prop.source == self.me:
            return
        self._send(prop.source, CatchupReq(self.me, self.incarnation, prop.new_view, self.next_seq,
                                           self.is_witness).encode())

    # ------------------------------------------------------------ source side
    def _on_catchup_req(self, msg: CatchupReq) -> None:
        s = msg.sender
        v = self.view
        # only a member that holds the view's data knows where it starts: one that
        # entered it from disk (a restart) would answer with its own position
        if msg.view != v.view_id or not self._holds_view_data():
            return
        vstart = v.start_seq
        if msg.snapshot_ok and vstart >= 0:
            self._send(s, Snapshot(self.me, self.incarnation, v.view_id, vstart, self.view_wm).encode())
            return
        start = msg.start
        if start >= vstart:
            self._send(s, CatchupData(self.me, self.incarnation, v.view_id, vstart, (), vstart).encode())
            return
        batches = self.log_slice(start, vstart, self.cfg.catchup_chunk)
        if batches is None:
            stop = min(vstart, start + self.cfg.catchup_chunk)
            waiting = self.serving.setdefault(start, [])
            if not waiting:
                self._reads.append(ReadRequest(start, min(stop, self.durable_seq)))
            if (s, v.view_id) not in waiting:
                waiting.append((s, v.view_id))
            return
        self._send(s, CatchupData(self.me, self.incarnation, v.view_id, start, batches, vstart).encode())

    def _on_log_chunk(self, chunk: LogChunk) -> None:
        for peer, view_id in self.serving.pop(chunk.start, []):
            self._send(peer, CatchupData(self.me, self.incarnation, view_id, chunk.start, tuple(chunk.batches),
                                         self.view.start_seq).encode())

    # --------------------------------------------------------- receiver side
    def _on_catchup_data(self, msg: CatchupData) -> None:
        prop = self.target
        if prop is None or msg.view != prop.new_view:
            return
        vstart = msg.view_start
        if msg.first > self.next_seq:
            return
        skip = self.next_seq - msg.first
        batches = []
        for b in msg.batches:
            if skip >= b.count:
                skip -= b.count
                continue
            batches.append(b.slice(skip) if skip else b)
            skip = 0
        n = sum(b.count for b in batches)
        if self.next_seq + n > vstart:
            raise RemoteProtocolError("catch-up data past the view start")
        if batches:
            watermarks_of(batches, self.watermarks)
            self._emit(Delivery(self.next_seq, tuple(batches), True, n))
        if self.next_seq == vstart:
            self._finish_catchup(vstart)
        else:
            self._ask_catchup()

    def _on_snapshot(self, msg: Snapshot) -> None:
        prop = self.target
        if prop is None or msg.view != prop.new_view:
            return
        if not self.is_witness:
            return  # members need the records themselves
        self.watermarks = dict(msg.watermarks)
        self.next_seq = self.durable_seq = msg.view_start
        self._log.clear()
        self._log_len = 0
        self._finish_catchup(msg.view_start)
