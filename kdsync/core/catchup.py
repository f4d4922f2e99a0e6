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

from kdsync.core.messages import CatchupData, CatchupReq, LogData, LogReq, Snapshot
from kdsync.core.types import Delivery, LogChunk, ReadRequest, RemoteProtocolError
from kdsync.core.base import watermarks_of
from kdsync.core.batch import read_positions

_END = 1 << 62  # no upper bound


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
        if batches is None and not self._read_topic(s, v.view_id, start, vstart):
            # neither in memory nor in a global topic here: an empty answer sends the
            # member to another member's global topic for [start, ...)
            batches = ()
        if batches is not None:
            self._send(s, CatchupData(self.me, self.incarnation, v.view_id, start, batches, vstart).encode())

    def _read_topic(self, peer: str, view_id: int, start: int, stop: int) -> bool:
        """Ask the adapter for positions from `start` of our global topic for
        `peer` (view_id -1: as LOG_DATA); False when they are not durable here."""
        stop = min(stop, start + self.cfg.catchup_chunk, self.durable_seq)
        if self.is_witness or stop <= start:
            return False
        waiting = self.serving.setdefault(start, [])
        if not waiting:
            self._reads.append(ReadRequest(start, stop))
        if (peer, view_id) not in waiting:
            waiting.append((peer, view_id))
        return True

    def _on_log_chunk(self, chunk: LogChunk) -> None:
        for peer, view_id in self.serving.pop(chunk.start, []):
            if view_id < 0:
                self._send(peer, LogData(self.me, self.incarnation, chunk.start, tuple(chunk.batches)).encode())
            else:
                self._send(peer, CatchupData(self.me, self.incarnation, view_id, chunk.start, tuple(chunk.batches),
                                             self.view.start_seq).encode())

    def _on_log_req(self, msg: LogReq) -> None:
        """Positions of our durable global topic, for a member catching up."""
        start, stop = msg.start, msg.stop
        if stop <= start:
            return
        batches = self.log_slice(start, min(stop, self.durable_seq), self.cfg.catchup_chunk)
        if batches is None or not batches:
            if self._read_topic(msg.sender, -1, start, stop):
                return
            batches = ()
        self._send(msg.sender, LogData(self.me, self.incarnation, start, batches).encode())

    # --------------------------------------------------------- receiver side
    def _on_catchup_data(self, msg: CatchupData) -> None:
        prop = self.target
        if prop is None or msg.view != prop.new_view or msg.first > self.next_seq:
            return
        vstart = msg.view_start
        batches = read_positions(msg.batches, self.next_seq, _END, msg.first)
        if self.next_seq + sum(b.count for b in batches) > vstart:
            raise RemoteProtocolError("catch-up data past the view start")
        self.catchup_vstart = vstart
        if batches:
            self._take_catchup(batches)
        elif self.next_seq == vstart:
            self._finish_catchup(vstart)
        else:
            self._ask_log()  # the source does not hold [next, ...): another member's topic does

    def _ask_log(self) -> None:
        """Ask the next member of the target view (round robin, never a witness)
        for the gap from its durable global topic."""
        prop = self.target
        helpers = [m for m in prop.members if m != self.me and self.cfg.roles.get(m, "member") == "member"]
        if not helpers or self.catchup_vstart <= self.next_seq:
            return
        self.catchup_helper = (self.catchup_helper + 1) % len(helpers)
        self.catchup_asked = self.now
        self._send(helpers[self.catchup_helper],
                   LogReq(self.me, self.incarnation, self.next_seq, self.catchup_vstart).encode())

    def _on_log_data(self, msg: LogData) -> None:
        if self.target is None or msg.start > self.next_seq or self.catchup_vstart < 0:
            return
        # never past the view start the source named
        batches = read_positions(msg.batches, self.next_seq, self.catchup_vstart, msg.start)
        if batches:
            self._take_catchup(batches)
        else:
            self._ask_log()  # not there either: the next member

    def _take_catchup(self, batches: list) -> None:
        """Deliver positions from next_seq on (catch-up); finish at the view start, else ask on."""
        n = sum(b.count for b in batches)
        watermarks_of(batches, self.watermarks)
        self._emit(Delivery(self.next_seq, tuple(batches), True, n))
        if self.next_seq == self.catchup_vstart:
            self._finish_catchup(self.catchup_vstart)
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
