"""The `sequencer` variant: a fixed leader assigns every position.

Theory of operation
-------------------
The first configured member is the sequencer for the life of the group.
Every other member forwards its own events to it over a reliable stream
(numbered per incarnation, acknowledged, retransmitted after
`retransmit_ticks`).  The sequencer orders events as they arrive — its own at
submit time — through the shared exactly-once rule, and multicasts each run
of positions; members deliver runs strictly by position, buffering gaps, and
acknowledge their next position so the sequencer can retransmit (from memory,
or through its adapter for positions only its global topic still holds).

This is the bench's "fixed sequencer" baseline: agreement holds and latency
is one hop to the sequencer plus one back, but nothing survives the loss of
the sequencer — the group stops ordering until it returns, and a sequencer
that restarts without its memory may reuse positions that members delivered
but it had not yet made durable.  That is the weakness the comparison shows.
"""

from __future__ import annotations

from typing import Iterable

from kdsync.core import codec
from kdsync.core.base import NodeBase
from kdsync.core.codec import decode_events, encode_events, want_int
from kdsync.core.types import Delivery, Event, LocalProtocolError, LogChunk, ReadRequest, RemoteProtocolError

FWD, FACK, ORD, OACK = 1, 2, 3, 4


class SequencerNode(NodeBase):
    protocol = "sequencer"

    def __init__(self, config, **kw) -> None:
        super().__init__(config, **kw)
        self.leader = self.members[0]
        self.is_leader = self.me == self.leader
        # member side: forward stream
        self._stream: list[Event] = []
        self._stream_base = 0
        self._sent = 0
        self._facked = 0
        self._fprogress = 0
        self._buffer: dict[int, tuple[Event, ...]] = {}
        self._oack_due = True
        # sequencer side
        self._fwd_recv: dict[str, tuple[int, int]] = {}  # member -> (inc, next stream pos)
        self._fack_due: dict[str, tuple[int, int]] = {}
        self._oack = {p: 0 for p in self.peers}
        self._oprogress = {p: 0 for p in self.peers}
        self._new_runs: list[Delivery] = []
        self._pending_reads: dict[int, list[str]] = {}
        self.status = "active"

    # ------------------------------------------------------------------ input
    def submit(self, events: Iterable[Event]) -> None:
        if self.is_witness:
            raise LocalProtocolError("a witness has no source events to submit")
        events = list(events)
        self.stats["submitted"] += len(events)
        if self.is_leader:
            self._order(events)
        else:
            self._stream.extend(events)

    def receive(self, sender: str, data: bytes) -> None:
        try:
            msg = codec.unpack(data, self.member_set)
            kind, s, inc = msg[0], msg[1], msg[2]
            if kind == FWD and len(msg) == 5 and self.is_leader:
                self._on_fwd(s, inc, want_int(msg[3], "first"), decode_events(msg[4]))
            elif kind == FACK and len(msg) == 5 and s == self.leader:
                if want_int(msg[3], "incarnation") == self.incarnation:
                    upto = want_int(msg[4], "upto")
                    if upto > self._facked:
                        self._facked = upto
                        self._fprogress = self.now
                        self._trim_stream()
            elif kind == ORD and len(msg) == 5 and s == self.leader:
                self._on_ord(want_int(msg[3], "first"), decode_events(msg[4]))
            elif kind == OACK and len(msg) == 4 and self.is_leader:
                nxt = want_int(msg[3], "next")
                if nxt != self._oack.get(s):
                    self._oack[s] = nxt
                    self._oprogress[s] = self.now
            else:
                raise RemoteProtocolError(f"unexpected sequencer message type {kind}")
        except RemoteProtocolError:
            self.stats["bad_messages"] += 1
            raise

    def _on_fwd(self, s: str, inc: int, first: int, events: tuple[Event, ...]) -> None:
        cur = self._fwd_recv.get(s)
        # a forward stream starts at 0 with every incarnation: never skip its start
        expected = 0 if cur is None or cur[0] != inc else cur[1]
        end = first + len(events)
        if first <= expected < end:
            self._order(events[expected - first :])
            expected = end
        self._fwd_recv[s] = (inc, expected)
        self._fack_due[s] = (inc, expected)

    def _order(self, events) -> None:
        before = len(self._deliveries)
        self._deliver(events)
        self._new_runs.extend(self._deliveries[before:])

    def _on_ord(self, first: int, events: tuple[Event, ...]) -> None:
        self._oack_due = True
        if first + len(events) <= self.next_seq:
            return
        self._buffer[first] = events
        while True:
            run = None
            for f in (self.next_seq,):
                run = self._buffer.pop(f, None)
            if run is None:
                # a run that starts before next_seq but reaches past it
                for f in sorted(self._buffer):
                    if f < self.next_seq < f + len(self._buffer[f]):
                        evs = self._buffer.pop(f)
                        run = evs[self.next_seq - f :]
                        break
                    if f + len(self._buffer[f]) <= self.next_seq:
                        del self._buffer[f]
            if run is None:
                break
            wm = self.watermarks
            for e in run:
                k = (e.origin, e.partition)
                if e.offset > wm.get(k, -1):
                    wm[k] = e.offset
            self._emit(Delivery(self.next_seq, tuple(run)))

    def _trim_stream(self) -> None:
        low = min(self._facked, self._sent)
        if low > self._stream_base:
            del self._stream[: low - self._stream_base]
            self._stream_base = low

    def _on_log_chunk(self, chunk: LogChunk) -> None:
        for p in self._pending_reads.pop(chunk.start, []):
            self._send(p, codec.pack((ORD, self.me, self.incarnation, chunk.start, encode_events(chunk.events))))

    # ------------------------------------------------------------------ ticks
    def tick(self) -> None:
        super().tick()
        cfg = self.cfg
        if self.is_leader:
            for p in self.peers:
                lag = self._oack[p]
                if lag < self.next_seq and self.now - self._oprogress[p] >= cfg.retransmit_ticks:
                    self._oprogress[p] = self.now
                    evs = self.log_slice(lag, self.next_seq, cfg.catchup_chunk)
                    if evs is None:
                        if lag not in self._pending_reads:
                            self._reads.append(ReadRequest(lag, min(self.durable_seq, lag + cfg.catchup_chunk)))
                        self._pending_reads.setdefault(lag, []).append(p)
                    elif evs:
                        self._send(p, codec.pack((ORD, self.me, self.incarnation, lag, encode_events(evs))))
        else:
            end = self._stream_base + len(self._stream)
            if self._facked < min(self._sent, end) and self.now - self._fprogress >= cfg.retransmit_ticks:
                self._fprogress = self.now
                start = max(self._facked, self._stream_base)
                stop = min(self._sent, start + cfg.max_batch)
                evs = self._stream[start - self._stream_base : stop - self._stream_base]
                self._send(self.leader, codec.pack((FWD, self.me, self.incarnation, start, encode_events(evs))))
            if self.now % max(1, cfg.heartbeat_ticks * 2) == 0:
                self._oack_due = True

    # ----------------------------------------------------------------- output
    def has_ready(self) -> bool:
        if super().has_ready():
            return True
        if self.is_leader:
            return bool(self._new_runs or self._fack_due)
        return self._sent < self._stream_base + len(self._stream) or self._oack_due

    def _before_ready(self) -> None:
        if self.is_leader:
            for d in self._new_runs:
                data = codec.pack((ORD, self.me, self.incarnation, d.first_seq, encode_events(d.events)))
                for p in self.peers:
                    if self._oack[p] == d.first_seq:
                        self._oprogress[p] = self.now
                    self._send(p, data)
            self._new_runs.clear()
            for s, (inc, upto) in sorted(self._fack_due.items()):
                self._send(s, codec.pack((FACK, self.me, self.incarnation, inc, upto)))
            self._fack_due.clear()
            return
        end = self._stream_base + len(self._stream)
        while self._sent < end:
            stop = min(end, self._sent + self.cfg.max_batch)
            evs = self._stream[self._sent - self._stream_base : stop - self._stream_base]
            if self._facked == self._sent:
                self._fprogress = self.now
            self._send(self.leader, codec.pack((FWD, self.me, self.incarnation, self._sent, encode_events(evs))))
            self._sent = stop
        if self._oack_due:
            self._oack_due = False
            self._send(self.leader, codec.pack((OACK, self.me, self.incarnation, self.next_seq)))
