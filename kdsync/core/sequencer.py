"""The `sequencer` variant: a leader-based order that fails over.

Theory of operation
-------------------
This is the bench's fair leader-based baseline — what a user would pick
instead of kdsync (a Raft log, a Kafka partition leader with acks=all): one
member orders everything, and when it fails another takes over without
losing or duplicating anything acknowledged.

It is the derecho node with one sender per view: the *sequencer* is the
lowest-ranked member of the view whose role is "member".  Every other
member forwards its own batches to the sequencer (FORWARD, numbered per
view, retransmitted until they are delivered); the sequencer cuts its own
and the forwarded batches into its slots, and every member delivers a slot
once every member of the view acknowledged it — the derecho stream with a
single sender, so one hop to the sequencer, one out, and the
acknowledgements.  Failure handling is derecho's, unchanged: suspicion
wedges the view, Paxos agrees on the next one with the ragged trim, and the
next view's sequencer is again its lowest-ranked member, starting after the
trim.  Whatever a member forwarded that is not inside the trim is forwarded
again to the new sequencer (a member keeps its own batches until it has
delivered them: `outbox`), and the exactly-once rule drops a batch ordered
twice, so a sequencer crash loses nothing and duplicates nothing.
"""

from __future__ import annotations

from typing import Iterable

from kdsync.core.batch import Batch
from kdsync.core.derecho import DerechoNode, State
from kdsync.core.messages import SEQUENCER_MESSAGES, Forward

__all__ = ["SequencerNode"]


class SequencerNode(DerechoNode):
    protocol = "sequencer"
    MESSAGES = SEQUENCER_MESSAGES
    _FWD_CHUNK = 64  # batches per retransmitted FORWARD
    _FWD_RESEND_BYTES = 256 << 10  # payload resent per retransmission round beyond its first chunk

    def __init__(self, config, **kw) -> None:
        self.outbox: list[Batch] = []  # own batches not yet delivered here, in submission order
        self.out_sent = 0  # how many of outbox went to this view's sequencer (or into our slots)
        self.out_head = 0  # this view's forward number of outbox[0]
        self.out_progress = 0  # tick of the last delivery of own batches
        self.fwd_expected: dict[str, int] = {}  # sequencer side: next forward number per member
        super().__init__(config, **kw)
        self._handlers[Forward] = self._on_forward

    def _senders_of(self, members) -> tuple[str, ...]:
        for m in members:
            if self.cfg.roles.get(m, "member") == "member":
                return (m,)
        return ()

    def _sequencer(self) -> str | None:
        s = self.view.senders
        return s[0] if s else None

    # ------------------------------------------------------------ inputs
    def submit(self, batches: Iterable[Batch]) -> None:
        self.outbox.extend(self._own_batches(batches))

    def _on_forward(self, msg: Forward) -> None:
        if self._sequencer() != self.me or self.wedged or not self._in_current_view(msg):
            return
        # numbers below `done` were delivered at the forwarder (maybe through its
        # catch-up, never reaching us): nothing to wait for there
        exp = max(self.fwd_expected.get(msg.sender, 0), msg.done)
        first, batches = msg.first, msg.batches
        if first <= exp < first + len(batches):  # in order; a gap waits for the retransmission
            self.pending.extend(batches[exp - first :])
            exp = first + len(batches)
        self.fwd_expected[msg.sender] = exp

    # ------------------------------------------------------------ views
    def _reset_view_state(self) -> None:
        super()._reset_view_state()
        # a new view: everything not delivered goes to its sequencer again
        self.out_sent = 0
        self.out_head = 0
        self.fwd_expected = {}

    def _resubmit_own(self) -> None:
        """The slots of an ended view hold forwarded batches too: those go back
        to their origins' outboxes, not to ours (see module docstring)."""
        back = self.stream.undelivered_own()
        if back:
            self.stats["resubmitted"] += sum(b.count for b in back if b.origin == self.me)
        self.pending.clear()

    def _emit(self, d) -> None:
        super()._emit(d)
        self._drop_delivered()

    def _drop_delivered(self) -> None:
        out = self.outbox
        if not out:
            return
        wm = self.watermarks
        i = 0
        while i < len(out) and out[i].first_offset + out[i].count - 1 <= wm.get((out[i].origin, out[i].partition), -1):
            i += 1
        if i:
            del out[:i]
            self.out_progress = self.now
            sent_done = min(i, self.out_sent)
            self.out_sent -= sent_done
            self.out_head += sent_done

    # ------------------------------------------------------------ output
    def _routing(self) -> bool:
        """Own batches can go somewhere now: into our slots, or to the sequencer."""
        return self.state in (State.ACTIVE, State.CATCHING_UP) and self._sequencer() is not None

    def _before_ready(self) -> None:
        if self.out_sent < len(self.outbox) and self._routing():
            new = self.outbox[self.out_sent :]
            if self._sequencer() == self.me:
                self.pending.extend(new)
            else:
                self._forward(self.out_head + self.out_sent, new)
            self.out_sent = len(self.outbox)
        super()._before_ready()

    def _forward(self, first: int, batches: list[Batch]) -> None:
        if not batches:
            return
        if self.out_progress < self.now - 1 and first == self.out_head:
            self.out_progress = self.now  # the retransmission clock starts with the first send
        self._send(self._sequencer(), Forward(self.me, self.incarnation, self.view.view_id, self.out_head, first,
                                              tuple(batches)).encode())

    def has_ready(self) -> bool:
        return super().has_ready() or (self.out_sent < len(self.outbox) and self._routing())

    def quiet(self) -> bool:
        """Derecho's quiet, and nothing forwarded waits for the sequencer (its
        retransmission timer runs)."""
        return not self.outbox and super().quiet()

    def tick(self) -> None:
        super().tick()
        self._drop_delivered()  # also what was submitted again after being delivered
        if (
            self.out_sent
            and self._routing()
            and self._sequencer() != self.me
            and self.now - self.out_progress >= self.cfg.retransmit_ticks * 2
        ):
            self.out_progress = self.now
            self._resend()

    def _resend(self) -> None:
        """Go back N: what was forwarded and not yet delivered, from the oldest,
        in FORWARDs of `_FWD_CHUNK` batches: at least one chunk, and more while
        the round has resent less than `_FWD_RESEND_BYTES` of payload.

        The sequencer takes forwards in order only, so after one lost FORWARD
        (or one that reached it before it entered the view) it ignores every
        later one: resending only the first chunk moved a backlog of small
        batches by one chunk per round (swarm seeds 4759, 6201, 6429 of the
        sequencer ran out of settle time that way).  The byte bound keeps a
        round small when the sequencer is only slow, not missing anything."""
        out, upto, sent = self.outbox, self.out_sent, 0
        i = 0
        while i < upto and (i == 0 or sent < self._FWD_RESEND_BYTES):
            chunk = out[i : min(i + self._FWD_CHUNK, upto)]
            sent += sum(len(b.data) for b in chunk)
            self._forward(self.out_head + i, chunk)
            i += len(chunk)
