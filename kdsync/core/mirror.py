"""The `mirror` variant: the MirrorMaker-style baseline, without agreement.

Theory of operation
-------------------
Each member delivers its own events the moment they are submitted and every
peer's events the moment they arrive, so two clusters that receive concurrent
writes end up with different interleavings: that weakness is what the bench
measures.  Copying is still reliable: every member keeps a stream of its own
events numbered from 0 per incarnation, peers acknowledge what they have made
*durable*, and unacknowledged suffixes are retransmitted after
`retransmit_ticks`.  A restarted receiver starts a stream wherever the sender
resends from; duplicates that this causes are dropped by the shared
exactly-once rule (origin watermarks).  Old stream entries are dropped once
every peer acknowledged them, or when more than `log_retention` are kept for
a peer that stays away (the baseline then loses them for that peer).
"""

from __future__ import annotations

from typing import Iterable

from kdsync.core import codec
from kdsync.core.base import NodeBase
from kdsync.core.codec import decode_events, encode_events, want_int
from kdsync.core.types import Event, LocalProtocolError, RemoteProtocolError

DATA, ACK = 1, 2


class MirrorNode(NodeBase):
    protocol = "mirror"

    def __init__(self, config, **kw) -> None:
        super().__init__(config, **kw)
        self._stream: list[Event] = []  # own events, index = stream pos - _stream_base
        self._stream_base = 0
        self._sent = 0  # stream positions already multicast once
        self._acked = {p: 0 for p in self.peers}  # durable at peer
        self._progress = {p: 0 for p in self.peers}  # tick of last ack progress
        self._recv: dict[str, tuple[int, int]] = {}  # sender -> (incarnation, next expected)
        self._ack_marks: list[tuple[int, str, int, int]] = []  # (seq_end, sender, inc, stream_end)
        self._ack_due: dict[str, tuple[int, int]] = {}  # sender -> (inc, stream_end) to ack

    # inputs
    def submit(self, events: Iterable[Event]) -> None:
        events = list(events)
        if not events:
            return
        if self.is_witness:
            raise LocalProtocolError("a witness has no source events to submit")
        self.stats["submitted"] += len(events)
        self._deliver(events)
        self._stream.extend(events)

    def receive(self, sender: str, data: bytes) -> None:
        try:
            msg = codec.unpack(data, self.member_set)
            kind, inc = msg[0], msg[2]
            if kind == DATA and len(msg) == 6:
                self._on_data(msg[1], inc, want_int(msg[3], "first"), decode_events(msg[4]), want_int(msg[5], "base"))
            elif kind == ACK and len(msg) == 5:
                self._on_ack(msg[1], want_int(msg[3], "incarnation"), want_int(msg[4], "upto"))
            else:
                raise RemoteProtocolError(f"unexpected mirror message type {kind}")
        except RemoteProtocolError:
            self.stats["bad_messages"] += 1
            raise

    def _on_data(self, sender: str, inc: int, first: int, events: tuple[Event, ...], base: int) -> None:
        cur = self._recv.get(sender)
        # a stream we have no state for starts where the sender knows we are durable
        expected = base if cur is None or cur[0] != inc else cur[1]
        end = first + len(events)
        if first <= expected < end:
            self._deliver(events[expected - first :])
            expected = end
            self._ack_marks.append((self.next_seq, sender, inc, end))
        self._recv[sender] = (inc, expected)
        self._release_acks()

    def _on_ack(self, sender: str, my_inc: int, upto: int) -> None:
        if my_inc == self.incarnation and upto > self._acked[sender]:
            self._acked[sender] = upto
            self._progress[sender] = self.now
            self._trim_stream()

    def durable(self, seq_end: int) -> None:
        super().durable(seq_end)
        self._release_acks()

    def _release_acks(self) -> None:
        marks = self._ack_marks
        i = 0
        while i < len(marks) and marks[i][0] <= self.durable_seq:
            _, sender, inc, end = marks[i]
            self._ack_due[sender] = (inc, end)
            i += 1
        if i:
            del marks[:i]

    def _trim_stream(self) -> None:
        low = min(self._acked.values(), default=self._sent)
        low = max(low, self._stream_base + len(self._stream) - self.cfg.log_retention)
        low = min(low, self._sent)
        if low > self._stream_base:
            del self._stream[: low - self._stream_base]
            self._stream_base = low

    def tick(self) -> None:
        super().tick()
        end = self._stream_base + len(self._stream)
        for p in self.peers:
            if self._acked[p] < min(self._sent, end) and self.now - self._progress[p] >= self.cfg.retransmit_ticks:
                self._progress[p] = self.now
                start = max(self._acked[p], self._stream_base)
                self._send_range(p, start, min(self._sent, start + self.cfg.max_batch))
        self._trim_stream()

    # outputs
    def _send_range(self, peer: str, start: int, stop: int) -> None:
        evs = self._stream[start - self._stream_base : stop - self._stream_base]
        self._send(peer, codec.pack((DATA, self.me, self.incarnation, start, encode_events(evs), self._acked[peer])))

    def _before_ready(self) -> None:
        end = self._stream_base + len(self._stream)
        while self._sent < end:
            stop = min(end, self._sent + self.cfg.max_batch)
            evs = self._stream[self._sent - self._stream_base : stop - self._stream_base]
            flat = encode_events(evs)
            for p in self.peers:
                if self._acked[p] == self._sent:
                    self._progress[p] = self.now
                self._send(p, codec.pack((DATA, self.me, self.incarnation, self._sent, flat, self._acked[p])))
            self._sent = stop
        for sender, (inc, end_) in sorted(self._ack_due.items()):
            self._send(sender, codec.pack((ACK, self.me, self.incarnation, inc, end_)))
        self._ack_due.clear()
