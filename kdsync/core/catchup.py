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

Once it has reported in a change of its view (ViewChange.report), a
member catching up delivers nothing past the `next` position it reported
until the next view is installed: a leader that finds no holder of the
view's data starts the next view at the highest `next` reported, and
positions delivered past it would be given other records there (swarm
clock seed 9040162).  It then catches up to the new view's start.

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
_NEVER = -10**9


class Catchup:
    """The catch-up of one DerechoNode (module docstring): its state, and the
    handlers of the catch-up messages on both sides.

    The node owns one and hands it the messages; this object reads the node's
    position (`next_seq`, `durable_seq`, `view`, `target`: the proposal being
    caught up to), answers from its log (`log_slice`) or its adapter (the
    node's read requests), and hands positions back through `_emit`; at the
    target view's start it calls the node's `_finish_catchup`."""

    def __init__(self, node) -> None:
        self.n = node
        self.asked = _NEVER  # tick of the last request
        self.vstart = -1  # the target view's start, once the source named it
        self.helper = -1  # member asked last for a gap the source does not hold
        self.serving: dict[int, list[tuple[str, int]]] = {}  # read start -> [(peer, view)] (source side)

    def begin(self) -> None:
        """Taken into the node's target view: ask its source."""
        self.asked = _NEVER
        self.vstart = -1
        self.ask()

    def tick(self, now: int, every: int) -> None:
        """Ask again when no answer came within `every` ticks."""
        if self.n.target is not None and now - self.asked >= every and not self._paused():
            self.ask()

    def _stop(self) -> int:
        """Where catch-up stops for now: at the `next` position we reported in
        this view's change, once we did (ViewChange.report), else nowhere."""
        r = self.n.vc.reported_next
        return _END if r is None else r

    def _paused(self) -> bool:
        return self.n.next_seq >= self._stop()

    def ask(self) -> None:
        n = self.n
        prop = n.target
        if prop is None:
            return
        self.asked = n.now
        if prop.source == n.me:
            return
        n._send(prop.source, CatchupReq(n.me, n.incarnation, prop.new_view, n.next_seq, n.is_witness).encode())

    # ------------------------------------------------------------ source side
    def on_req(self, msg: CatchupReq) -> None:
        n = self.n
        s = msg.sender
        v = n.view
        # only a member that holds the view's data knows where it starts: one that
        # entered it from disk (a restart) would answer with its own position
        if msg.view != v.view_id or not n._holds_view_data():
            return
        vstart = v.start_seq
        if msg.snapshot_ok and vstart >= 0:
            n._send(s, Snapshot(n.me, n.incarnation, v.view_id, vstart, n.view_wm).encode())
            return
        start = msg.start
        if start >= vstart:
            n._send(s, CatchupData(n.me, n.incarnation, v.view_id, vstart, (), vstart).encode())
            return
        batches = n.log_slice(start, vstart, n.cfg.catchup_chunk)
        if batches is None and not self._read_topic(s, v.view_id, start, vstart):
            # neither in memory nor in a global topic here: an empty answer sends the
            # member to another member's global topic for [start, ...)
            batches = ()
        if batches is not None:
            n._send(s, CatchupData(n.me, n.incarnation, v.view_id, start, batches, vstart).encode())

    def _read_topic(self, peer: str, view_id: int, start: int, stop: int) -> bool:
        """Ask the adapter for positions from `start` of our global topic for
        `peer` (view_id -1: as LOG_DATA); False when they are not durable here."""
        n = self.n
        stop = min(stop, start + n.cfg.catchup_chunk, n.durable_seq)
        if n.is_witness or stop <= start:
            return False
        waiting = self.serving.setdefault(start, [])
        if not waiting:
            n._reads.append(ReadRequest(start, stop))
        if (peer, view_id) not in waiting:
            waiting.append((peer, view_id))
        return True

    def on_log_chunk(self, chunk: LogChunk) -> None:
        n = self.n
        for peer, view_id in self.serving.pop(chunk.start, []):
            if view_id < 0:
                n._send(peer, LogData(n.me, n.incarnation, chunk.start, tuple(chunk.batches)).encode())
            else:
                n._send(peer, CatchupData(n.me, n.incarnation, view_id, chunk.start, tuple(chunk.batches),
                                          n.view.start_seq).encode())

    def on_log_req(self, msg: LogReq) -> None:
        """Positions of our durable global topic, for a member catching up."""
        n = self.n
        start, stop = msg.start, msg.stop
        if stop <= start:
            return
        batches = n.log_slice(start, min(stop, n.durable_seq), n.cfg.catchup_chunk)
        if batches is None or not batches:
            if self._read_topic(msg.sender, -1, start, stop):
                return
            batches = ()
        n._send(msg.sender, LogData(n.me, n.incarnation, start, batches).encode())

    # --------------------------------------------------------- receiver side
    def on_data(self, msg: CatchupData) -> None:
        n = self.n
        prop = n.target
        if prop is None or msg.view != prop.new_view or msg.first > n.next_seq:
            return
        vstart = msg.view_start
        batches = read_positions(msg.batches, n.next_seq, _END, msg.first)
        if n.next_seq + sum(b.count for b in batches) > vstart:
            raise RemoteProtocolError("catch-up data past the view start")
        self.vstart = vstart
        if batches:
            # not past the position we reported in this view's change (`_stop`): it stays until the next view
            batches = read_positions(batches, n.next_seq, self._stop(), n.next_seq)
            if batches:
                self._take(batches)
        elif n.next_seq == vstart:
            n._finish_catchup(vstart)
        else:
            self._ask_log()  # the source does not hold [next, ...): another member's topic does

    def _ask_log(self) -> None:
        """Ask the next member of the target view (round robin, never a witness)
        for the gap from its durable global topic."""
        n = self.n
        prop = n.target
        helpers = [m for m in prop.members if m != n.me and n.cfg.roles.get(m, "member") == "member"]
        if not helpers or self.vstart <= n.next_seq:
            return
        self.helper = (self.helper + 1) % len(helpers)
        self.asked = n.now
        n._send(helpers[self.helper], LogReq(n.me, n.incarnation, n.next_seq, self.vstart).encode())

    def on_log_data(self, msg: LogData) -> None:
        n = self.n
        if n.target is None or msg.start > n.next_seq or self.vstart < 0:
            return
        # never past the view start the source named, nor past the position we reported (`_stop`)
        batches = read_positions(msg.batches, n.next_seq, min(self.vstart, self._stop()), msg.start)
        if batches:
            self._take(batches)
        elif not self._paused():
            self._ask_log()  # not there either: the next member

    def _take(self, batches: list) -> None:
        """Deliver positions from next_seq on (catch-up); finish at the view start, else ask on."""
        n = self.n
        count = sum(b.count for b in batches)
        watermarks_of(batches, n.watermarks)
        n._emit(Delivery(n.next_seq, tuple(batches), True, count))
        if n.next_seq == self.vstart:
            n._finish_catchup(self.vstart)
        elif not self._paused():
            self.ask()

    def on_snapshot(self, msg: Snapshot) -> None:
        n = self.n
        prop = n.target
        if prop is None or msg.view != prop.new_view:
            return
        if not n.is_witness:
            return  # members need the records themselves
        if self._paused():
            return  # its position was reported in this view's change (`_stop`)
        n.watermarks = dict(msg.watermarks)
        n.next_seq = n.durable_seq = msg.view_start
        n._log.clear()
        n._log_len = 0
        n._finish_catchup(msg.view_start)
