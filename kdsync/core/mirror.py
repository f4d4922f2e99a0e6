"""The `mirror` variant: the MirrorMaker-style baseline, without agreement.

Theory of operation
-------------------
Each member delivers its own batches the moment they are submitted and every
peer's batches the moment they arrive, so two clusters that receive concurrent
writes end up with different interleavings: that weakness is what the bench
measures.  Copying is still reliable: every member keeps a stream of its own
batches numbered from 0 per incarnation, peers acknowledge what they have made
*durable*, and unacknowledged suffixes are retransmitted after
`retransmit_ticks`.  A restarted receiver starts a stream wherever the sender
resends from; duplicates that this causes are dropped by the shared
exactly-once rule (origin watermarks).  Old stream entries are dropped once
every peer acknowledged them, or when more than `log_retention` are kept for
a peer that stays away (the baseline then loses them for that peer).
"""

from __future__ import annotations

from typing import Iterable

from kdsync.core.base import NodeBase
from kdsync.core.errors import RemoteProtocolError
from kdsync.core.batch import Batch
from kdsync.core.codec import BATCHES, INT, Codec, Message


class MirrorData(Message):
    """Own stream entries first.. as batches; `base` = where the sender
    believes the receiver is durable."""

    __slots__ = ("first", "batches", "base")
    TYPE = 1
    FIELDS = (("first", INT), ("batches", BATCHES), ("base", INT))
    first: int
    batches: tuple[Batch, ...]
    base: int


class MirrorAck(Message):
    """The receiver made the stream of incarnation `stream_inc` durable up to
    `upto`."""

    __slots__ = ("stream_inc", "upto")
    TYPE = 2
    FIELDS = (("stream_inc", INT), ("upto", INT))
    stream_inc: int
    upto: int


MIRROR_MESSAGES = (MirrorData, MirrorAck)


class MirrorNode(NodeBase):
    protocol = "mirror"

    def __init__(self, config, **kw) -> None:
        super().__init__(config, **kw)
        self.codec = Codec(MIRROR_MESSAGES, self.members, self.decodes)
        self._stream: list[Batch] = []  # own batches, index = stream pos - _stream_base
        self._stream_base = 0
        self._sent = 0  # stream positions already multicast once
        self._acked = {p: 0 for p in self.peers}  # durable at peer
        self._progress = {p: 0 for p in self.peers}  # tick of last ack progress
        self._recv: dict[str, tuple[int, int]] = {}  # sender -> (incarnation, next expected)
        self._ack_marks: list[tuple[int, str, int, int]] = []  # (seq_end, sender, inc, stream_end)
        self._ack_due: dict[str, tuple[int, int]] = {}  # sender -> (inc, stream_end) to ack

    # inputs
    def submit(self, batches: Iterable[Batch]) -> None:
        batches = self._own_batches(batches)
        if batches:
            self._deliver(batches)
            self._stream.extend(batches)

    def receive(self, sender: str, data: bytes) -> None:
        try:
            msg = self.codec.decode(data, sender)
        except RemoteProtocolError:
            self.stats["bad_messages"] += 1
            raise
        if type(msg) is MirrorData:
            self._on_data(msg.sender, msg.inc, msg.first, msg.batches, msg.base)
        else:
            self._on_ack(msg.sender, msg.stream_inc, msg.upto)

    def _on_data(self, sender: str, inc: int, first: int, events: tuple[Batch, ...], base: int) -> None:
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
                self._send_range(p, start, self._sent)
        self._trim_stream()

    # outputs
    def _chunk_end(self, start: int, stop: int) -> int:
        """The stream position that closes a message of at most max_batch records from `start`."""
        n, i, base = 0, start, self._stream_base
        while i < stop:
            c = self._stream[i - base].count
            if i > start and n + c > self.cfg.max_batch:
                break
            n += c
            i += 1
        return i

    def _send_range(self, peer: str, start: int, stop: int) -> None:
        stop = self._chunk_end(start, stop)
        evs = tuple(self._stream[start - self._stream_base : stop - self._stream_base])
        self._send(peer, MirrorData(self.me, self.incarnation, start, evs, self._acked[peer]).encode())

    def _before_ready(self) -> None:
        end = self._stream_base + len(self._stream)
        while self._sent < end:
            stop = self._chunk_end(self._sent, end)
            evs = tuple(self._stream[self._sent - self._stream_base : stop - self._stream_base])
            for p in self.peers:
                if self._acked[p] == self._sent:
                    self._progress[p] = self.now
                self._send(p, MirrorData(self.me, self.incarnation, self._sent, evs, self._acked[p]).encode())
            self._sent = stop
        for sender, (inc, end_) in sorted(self._ack_due.items()):
            self._send(sender, MirrorAck(self.me, self.incarnation, inc, end_).encode())
        self._ack_due.clear()
